//! Slab statistics in the shape of `/proc/slabinfo`, per cache and node, and
//! the registry of live caches behind [`slabinfo`].

use core::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Once, Weak};

use super::kmem::{Home, KmemCache};
use super::node::{lock_ranges_for_fork, unlock_ranges_after_fork};
use crate::os::file;
use crate::os::thread::{ForkRank, at_fork};
use crate::sync::Mutex;

/// One node's share of a cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeCacheStats {
    /// The node.
    pub node: usize,
    /// Objects out of the slabs: with callers, in thread magazines, or in
    /// the depot (`active_objs`).
    pub active: usize,
    /// Objects the node's slabs hold in all (`num_objs`); a node with a
    /// limit never exceeds it.
    pub total: usize,
    /// Of `active`, objects parked in the node's depot (free, not yet back
    /// in a slab).
    pub in_depot: usize,
    /// Slabs mapped (`num_slabs`).
    pub slabs: usize,
    /// Bytes mapped for those slabs.
    pub bytes: usize,
    /// Mappings the slabs are slots of (kernel VMAs: each counts against
    /// `vm.max_map_count`).
    pub chunks: usize,
    /// Of those, chunks on huge pages (as the cache asked).
    pub huge_chunks: usize,
    /// Chunks that asked for hugetlb pages and got base pages: the node's
    /// pool had too few free (cumulative).
    pub huge_fallbacks: u64,
    /// Bytes of the chunks the kernel backs with transparent huge pages now
    /// (a cache built with `Huge::Thp`: what it got, from `AnonHugePages` in
    /// `/proc/self/smaps`; 0 for other caches, which are not looked up).
    pub thp_bytes: u64,
    /// Objects freed by threads on other nodes and sent home (cumulative).
    pub remote_frees: u64,
    /// Times an `alloc_wait` had to wait (cumulative).
    pub waits: u64,
    /// Allocations that found the node at its limit (cumulative).
    pub limit_hits: u64,
    /// Allocations that wanted this node and were served by another
    /// (cumulative).
    pub fallbacks: u64,
    /// Slabs mapped and released since the cache was made (cumulative).
    pub slabs_created: u64,
    /// Slabs returned to the OS (cumulative).
    pub slabs_released: u64,
    /// Chunks registered with the cache's [`Registrar`](super::Registrar)
    /// now.
    pub registered_regions: usize,
    /// Their bytes (pinned where the registrar pins them).
    pub registered_bytes: usize,
    /// Of those, bytes the kernel held on another node than this one once
    /// the registrar had them: pages it moved out of the node's movable
    /// memory to pin them. Only a cache built with
    /// [`OffNodePins::Report`](super::OffNodePins::Report) keeps such
    /// regions; as of each region's registration.
    pub pinned_off_node: usize,
}

impl NodeCacheStats {
    fn add(&mut self, o: &NodeCacheStats) {
        self.active += o.active;
        self.total += o.total;
        self.in_depot += o.in_depot;
        self.slabs += o.slabs;
        self.bytes += o.bytes;
        self.chunks += o.chunks;
        self.huge_chunks += o.huge_chunks;
        self.huge_fallbacks += o.huge_fallbacks;
        self.thp_bytes += o.thp_bytes;
        self.remote_frees += o.remote_frees;
        self.waits += o.waits;
        self.limit_hits += o.limit_hits;
        self.fallbacks += o.fallbacks;
        self.slabs_created += o.slabs_created;
        self.slabs_released += o.slabs_released;
        self.registered_regions += o.registered_regions;
        self.registered_bytes += o.registered_bytes;
        self.pinned_off_node += o.pinned_off_node;
    }
}

/// Where a cache's pages are on one node, as the kernel reports them now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodePages {
    /// The node.
    pub node: usize,
    /// Pages of the cache present there (of the chunks' page size).
    pub pages: usize,
    /// Their bytes.
    pub bytes: u64,
}

/// A snapshot of one cache. Each counter is read exactly, but not all at the
/// same instant; objects in other threads' magazines count as active.
#[derive(Clone, Debug)]
pub struct CacheStats {
    /// The cache's name.
    pub name: String,
    /// Object size asked for, in bytes (`objsize`).
    pub object_size: usize,
    /// Bytes per object in the slab, alignment and free-list link included.
    pub stride: usize,
    /// Alignment of every object.
    pub align: usize,
    /// Objects per full slab (`objperslab`).
    pub objects_per_slab: usize,
    /// Pages per full slab (`pagesperslab`).
    pub pages_per_slab: usize,
    /// Rounds per thread magazine.
    pub magazine_rounds: usize,
    /// The per-node object limit, if any.
    pub limit: Option<usize>,
    /// Where objects go by default.
    pub home: Home,
    /// The cache handle was dropped; objects still out keep it listed.
    pub dropped: bool,
    /// Per node with any slab or activity, by node id.
    pub nodes: Vec<NodeCacheStats>,
    /// The node every node's slabs were moved to by the last migration,
    /// if the cache was migrated.
    pub placed: Option<usize>,
    /// Pages of the cache may lie off `placed`: the last migration or
    /// demotion left some (the kernel refused them, a demotion leaves
    /// registered regions to `migrate`), or a demotion is under way.
    pub unsettled: bool,
    /// Migrations, demotions included (cumulative).
    pub migrations: u64,
    /// Of those, the ones its demotion condition made (cumulative).
    pub demotions: u64,
    /// Bytes migrations moved (cumulative).
    pub migrated_bytes: u64,
}

impl CacheStats {
    pub(crate) fn of(cache: &KmemCache) -> Self {
        let page = crate::os::page_size();
        let mut nodes = Vec::new();
        for (node, ns) in cache.nodes.iter().enumerate() {
            if !cache.topo.nodes().contains(node) {
                continue;
            }
            let mut s = ns.lock();
            // Objects already sent home count as back: drain them first.
            // SAFETY: `s` is this node's locked slabs.
            unsafe { cache.drain_remote(node, &mut s) };
            let c = &ns.counters;
            let (registered_regions, registered_bytes) = s.chunks.registered();
            let n = NodeCacheStats {
                node,
                active: s.active,
                total: s.capacity,
                in_depot: 0,
                slabs: s.slabs(),
                bytes: s.mapped,
                chunks: s.chunks.count(),
                huge_chunks: s.chunks.huge(),
                huge_fallbacks: s.chunks.huge_fallbacks,
                thp_bytes: 0,
                remote_frees: c.remote_frees.load(Ordering::Relaxed),
                waits: c.waits.load(Ordering::Relaxed),
                limit_hits: c.limit_hits.load(Ordering::Relaxed),
                fallbacks: c.fallbacks.load(Ordering::Relaxed),
                slabs_created: c.slabs_created.load(Ordering::Relaxed),
                slabs_released: c.slabs_released.load(Ordering::Relaxed),
                registered_regions,
                registered_bytes,
                pinned_off_node: s.chunks.pinned_off_node(),
            };
            let thp = if cache.huge == crate::os::mem::Huge::Thp { s.chunks.huge_ranges() } else { Vec::new() };
            drop(s);
            let thp_bytes = crate::os::mem::thp_bytes(&thp).unwrap_or(0);
            let n = NodeCacheStats { in_depot: ns.depot.objects(), thp_bytes, ..n };
            if n != (NodeCacheStats { node, ..Default::default() }) {
                nodes.push(n);
            }
        }
        Self {
            name: cache.name.clone(),
            object_size: cache.size,
            stride: cache.stride,
            align: cache.align,
            objects_per_slab: cache.per_slab,
            pages_per_slab: cache.slab_bytes / page,
            magazine_rounds: cache.rounds,
            limit: cache.limit,
            home: cache.home,
            dropped: cache.dead.load(Ordering::Relaxed),
            nodes,
            placed: cache.moves.placed(),
            unsettled: !cache.moves.settled.load(Ordering::Relaxed),
            migrations: cache.moves.migrations.load(Ordering::Relaxed),
            demotions: cache.moves.demotions.load(Ordering::Relaxed),
            migrated_bytes: cache.moves.moved_bytes.load(Ordering::Relaxed),
        }
    }

    /// The counters of `node` (zero when the node has none).
    pub fn node(&self, node: usize) -> NodeCacheStats {
        self.nodes.iter().find(|n| n.node == node).copied().unwrap_or(NodeCacheStats { node, ..Default::default() })
    }

    /// All nodes summed (`node` is 0).
    pub fn total(&self) -> NodeCacheStats {
        let mut t = NodeCacheStats::default();
        for n in &self.nodes {
            t.add(n);
        }
        t
    }
}

const HEADER: &str = "# name                 node   active    total  objsize objperslab pagesperslab  slabs   in_depot  remote_frees  waits  limit_hits  fallbacks";

fn row(f: &mut fmt::Formatter<'_>, c: &CacheStats, n: &NodeCacheStats) -> fmt::Result {
    let name = if c.dropped { format!("{} (dropped)", c.name) } else { c.name.clone() };
    writeln!(
        f,
        "{name:<22} {:>5} {:>8} {:>8} {:>8} {:>10} {:>12} {:>6} {:>10} {:>13} {:>6} {:>11} {:>10}",
        n.node,
        n.active,
        n.total,
        c.object_size,
        c.objects_per_slab,
        c.pages_per_slab,
        n.slabs,
        n.in_depot,
        n.remote_frees,
        n.waits,
        n.limit_hits,
        n.fallbacks
    )
}

impl fmt::Display for CacheStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{HEADER}")?;
        for n in &self.nodes {
            row(f, self, n)?;
        }
        pages_line(f, self)
    }
}

/// The line under a cache's rows that says what migrations moved.
fn pages_line(f: &mut fmt::Formatter<'_>, c: &CacheStats) -> fmt::Result {
    if c.migrations == 0 && !c.unsettled {
        return Ok(());
    }
    writeln!(
        f,
        "#   {}: {} migrations ({} demotions) moved {} bytes, now on node {}{}",
        c.name,
        c.migrations,
        c.demotions,
        c.migrated_bytes,
        c.placed.map_or("-".to_string(), |n| n.to_string()),
        if c.unsettled { " (some pages elsewhere)" } else { "" }
    )
}

/// Every live cache's statistics, printed like `/proc/slabinfo` (one row per
/// cache and node); from [`slabinfo`].
#[derive(Clone, Debug)]
pub struct SlabInfo {
    /// One entry per live cache, oldest first.
    pub caches: Vec<CacheStats>,
}

impl fmt::Display for SlabInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{HEADER}")?;
        for c in &self.caches {
            if c.nodes.is_empty() {
                row(f, c, &NodeCacheStats::default())?;
            }
            for n in &c.nodes {
                row(f, c, n)?;
            }
            pages_line(f, c)?;
        }
        Ok(())
    }
}

/// The caches, and the ones a `fork()` holds.
struct Registry {
    /// Live caches by slot (the slot is also the index into thread tables).
    caches: Vec<Weak<KmemCache>>,
    /// Between the `fork()` handlers: the caches whose locks they hold,
    /// kept alive (a cache whose last reference went meanwhile would free
    /// the locks held).
    held: Vec<Arc<KmemCache>>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry { caches: Vec::new(), held: Vec::new() });

/// Makes a cache in a free slot and lists it.
pub(crate) fn register_cache(make: impl FnOnce(usize) -> crate::Result<KmemCache>) -> crate::Result<Arc<KmemCache>> {
    static FORK: Once = Once::new();
    FORK.call_once(|| {
        if let Err(e) = at_fork(ForkRank::Slab, fork_prepare, fork_release) {
            file::report(format_args!("numaweave: no fork handlers for slab caches ({e}): fork() may hang"));
        }
    });
    let mut r = REGISTRY.lock();
    // A slot is free once its cache is gone: every thread entry for it held a
    // strong reference, so none is left.
    let index = r.caches.iter().position(|w| w.strong_count() == 0).unwrap_or(r.caches.len());
    let cache = Arc::new(make(index)?);
    if index == r.caches.len() {
        r.caches.push(Arc::downgrade(&cache));
    } else {
        r.caches[index] = Arc::downgrade(&cache);
    }
    Ok(cache)
}

/// Before `fork()` (the first rank, [`ForkRank::Slab`]): the registry, every
/// live cache's node locks in slot order, then the table of slab ranges.
/// (The locks of one cache are never held while another's are taken: an
/// object constructor must not allocate from another slab cache, or a
/// `fork()` may find the two locks taken in the other order.)
fn fork_prepare() {
    REGISTRY.lock_raw();
    // SAFETY: taken just above; released by `fork_release`.
    let r = unsafe { REGISTRY.raw_value() };
    // (Allocates: the ranks below are not held yet.)
    let mut held = core::mem::take(&mut r.held);
    held.extend(r.caches.iter().filter_map(Weak::upgrade));
    for c in &held {
        c.lock_for_fork();
    }
    lock_ranges_for_fork();
    r.held = held;
}

/// After `fork()`, in the parent and the child: releases what
/// [`fork_prepare`] took, in the reverse order, then the references it
/// held (the ranks below are released by now: a cache dropped here frees
/// its memory).
fn fork_release() {
    // SAFETY: `fork_prepare` took the registry on this thread (or, in the
    // child, on the thread it was copied from) and still holds it.
    let held = core::mem::take(&mut unsafe { REGISTRY.raw_value() }.held);
    // SAFETY: each lock was taken by `fork_prepare`, as above.
    unsafe {
        unlock_ranges_after_fork();
        let child = crate::os::thread::in_forked_child();
        for c in held.iter().rev() {
            c.unlock_after_fork(child);
        }
        REGISTRY.unlock_raw();
    }
    drop(held);
}

/// Statistics of every live cache, dropped ones with objects still out
/// included.
///
/// ```
/// use numaweave::slab::{SlabCache, slabinfo};
/// let cache = SlabCache::<[u8; 96]>::new("sense_buffer").unwrap();
/// let b = cache.alloc([0; 96]).unwrap();
/// let info = slabinfo();
/// assert!(info.caches.iter().any(|c| c.name == "sense_buffer" && c.total().active >= 1));
/// println!("{info}");
/// # drop(b);
/// ```
pub fn slabinfo() -> SlabInfo {
    SlabInfo { caches: live_caches().iter().map(|c| CacheStats::of(c)).collect() }
}

/// Every live cache (a reference each, taken under the registry's lock).
pub(crate) fn live_caches() -> Vec<Arc<KmemCache>> {
    REGISTRY.lock().caches.iter().filter_map(Weak::upgrade).collect()
}
