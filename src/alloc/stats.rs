//! Allocator statistics: per node, summed when read from per-heap and
//! per-arena counters (nothing shared is written on the fast path), and a
//! printer in the spirit of `mi_stats_print` / `malloc_stats_print`.

use core::fmt;

pub use super::engine::arena::ClassUsage;
use super::engine::heap::for_each_heap;
pub use super::engine::lifecycle::published as class_table;
use super::engine::size_class::{CLASSES, class_size};
use super::engine::types::SEGMENT_SIZE;
use super::engine::types::{Mode, State};
use crate::os::{file, thread};
use crate::sync::{AtomicI32, Ordering};
use crate::topology::{MAX_NODES, NodeSet};

/// Counters of one node's arena, in bytes or counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Address space mapped for the node (segments and huge blocks).
    pub reserved: u64,
    /// Memory in pages handed to heaps, free pages not yet purged, and huge
    /// blocks: an upper bound of the resident memory.
    pub committed: u64,
    /// Bytes of live blocks (size-class bytes, plus huge mappings).
    pub in_use: u64,
    /// Bytes returned to the OS with `MADV_DONTNEED`, `MADV_FREE` or unmapping
    /// (cumulative).
    pub returned: u64,
    /// Allocations served (cumulative). With the per-CPU caches
    /// ([`Config::cpu_cache`](crate::Config::cpu_cache)), the blocks moved
    /// from pages into the caches, not each allocation they serve.
    pub allocs: u64,
    /// Frees (cumulative), remote ones included.
    pub frees: u64,
    /// Blocks freed by a thread other than their owner and collected back by
    /// the owner (cumulative).
    pub remote_frees: u64,
    /// Pages this node's threads had to take from another node because this
    /// one was out of memory (cumulative).
    pub fallbacks: u64,
    /// Huge blocks live.
    pub huge_live: u64,
    /// Regions (interleaved blocks of a page and more, 4 MiB each) mapped
    /// and not yet released.
    pub regions: u64,
    /// Regions mapped on hugetlb pages ([`Config::huge`](crate::Config::huge))
    /// (cumulative).
    pub huge_regions: u64,
    /// Regions that asked for hugetlb pages and got base pages: the node's
    /// pool was short (cumulative).
    pub huge_fallbacks: u64,
    /// Bytes of the node's segments and cached mappings the kernel holds in
    /// memory (`mincore`), plus live huge blocks whole. At least
    /// `free_resident + in_use` where every live block was written (a block
    /// handed out and never touched may not be resident).
    pub resident: u64,
    /// Of `resident`, the bytes of free memory the kernel still holds:
    /// free pages waiting out the purge delay and cached large mappings
    /// (`mincore`, as `resident`).
    pub free_resident: u64,
    /// Bytes of the pages live threads' heaps and the node's shared heap
    /// hold (of heaps made on this node), their free blocks included.
    pub in_heaps: u64,
    /// Bytes of the pages exited threads' heaps hold, waiting for adoption.
    pub orphaned: u64,
    /// Address space mapped but not committed (purged pages, uncarved
    /// segments): virtual size, not memory.
    pub retained: u64,
    /// Bytes of free blocks in size-class pages still in use, all classes
    /// ([`ClassUsage::stranded`]; by class: [`NumaAlloc::class_usage`](crate::NumaAlloc::class_usage)):
    /// memory only the class that made those pages can use until they empty.
    pub stranded: u64,
    /// Bytes of blocks other threads freed that the owners of their pages
    /// have not collected yet ([`ClassUsage::uncollected`]): free memory
    /// that waits.
    pub uncollected: u64,
}

impl NodeStats {
    fn add(&mut self, o: &NodeStats) {
        self.reserved += o.reserved;
        self.committed += o.committed;
        self.in_use += o.in_use;
        self.returned += o.returned;
        self.allocs += o.allocs;
        self.frees += o.frees;
        self.remote_frees += o.remote_frees;
        self.fallbacks += o.fallbacks;
        self.huge_regions += o.huge_regions;
        self.huge_fallbacks += o.huge_fallbacks;
        self.huge_live += o.huge_live;
        self.regions += o.regions;
        self.resident += o.resident;
        self.free_resident += o.free_resident;
        self.in_heaps += o.in_heaps;
        self.orphaned += o.orphaned;
        self.retained += o.retained;
        self.stranded += o.stranded;
        self.uncollected += o.uncollected;
    }
}

/// A snapshot of [`NumaAlloc::stats`](crate::NumaAlloc::stats). Counters of
/// other threads are read without stopping them, so a snapshot taken while they
/// run is approximate (each counter is exact, the sums are not simultaneous).
#[derive(Clone, Debug)]
pub struct Stats {
    /// The mode in force.
    pub mode: Mode,
    /// Nodes the allocator places memory on (node 0 alone in flat mode).
    pub nodes: NodeSet,
    /// Per node (index = node id); zero for nodes not in `nodes`.
    pub per_node: [NodeStats; MAX_NODES],
    /// Thread heaps made so far, and how many of them wait for adoption.
    pub heaps: usize,
    /// Heaps of exited threads, waiting for a new thread to adopt them.
    pub orphan_heaps: usize,
    /// Whether the topology is synthetic.
    pub synthetic: bool,
    /// Bytes of the allocator's memory the kernel backs with transparent
    /// huge pages, once any interleave region asked for them
    /// ([`Huge::Thp`](crate::Huge::Thp)): `AnonHugePages` of its mappings in
    /// `/proc/self/smaps`, what the requests actually got. 0 (not looked up)
    /// before.
    pub thp_bytes: u64,
    /// The process default interleave's `weights=auto`, as each CPU node's
    /// threads apply it, and their source; `None` for any other policy.
    pub auto_weights: Option<crate::policy::WeightsByNode>,
    /// Bytes of free blocks the per-CPU caches hold
    /// ([`Config::cpu_cache`](crate::Config::cpu_cache); counted in
    /// `in_use`: their pages lent them out). 0 without the caches.
    pub cpu_cached: u64,
}

impl Stats {
    pub(crate) fn snapshot(state: &State) -> Stats {
        // First, before the walk below allocates (which may refill a cache).
        let cpu_cached = super::engine::heap::cpu::get().map_or(0, |c| c.cached_bytes() as u64);
        let mut per_node = [NodeStats::default(); MAX_NODES];
        let nodes = state.nodes();
        for n in nodes.iter() {
            let Some(a) = state.arena(n) else { continue };
            let c = &a.counters;
            let ld = |x: &crate::sync::AtomicU64| x.load(crate::sync::Ordering::Relaxed);
            let s = &mut per_node[n];
            s.reserved = ld(&c.reserved);
            s.committed = ld(&c.pages_in_use) + ld(&c.dirty) + ld(&c.huge_bytes);
            s.returned = ld(&c.purged);
            s.fallbacks = ld(&c.fallbacks);
            s.huge_live = ld(&c.huge_live);
            s.regions = ld(&c.region_live);
            s.huge_regions = ld(&c.huge_regions);
            s.huge_fallbacks = ld(&c.huge_fallbacks);
            s.in_use = ld(&c.huge_bytes);
            s.allocs = ld(&c.huge_allocs);
            s.frees = ld(&c.huge_frees);
            let (resident, free_resident) = a.resident();
            s.free_resident = free_resident;
            s.retained = s.reserved.saturating_sub(s.committed);
            s.resident = resident + ld(&c.huge_bytes);
            let classes = class_usage(state, n);
            s.stranded = classes.iter().map(|u| u.stranded).sum();
            s.uncollected = classes.iter().map(|u| u.uncollected).sum();
        }
        let (mut heaps, mut orphan_heaps) = (0, 0);
        for_each_heap(state, |h| {
            heaps += 1;
            if !h.is_owned() && !h.is_shared() {
                orphan_heaps += 1;
            }
            let (n, c) = h.node_and_counters();
            let s = &mut per_node[n % MAX_NODES];
            if h.is_owned() || h.is_shared() {
                s.in_heaps += h.held_bytes();
            } else {
                s.orphaned += h.held_bytes();
            }
            s.allocs += c.0;
            s.frees += c.1;
            s.in_use = s.in_use.wrapping_add(c.2.wrapping_sub(c.3));
            s.remote_frees += c.4;
        });
        // Mappings that start on a segment of ours (a region, or a segment
        // whose neighbours the kernel merged into its mapping).
        let thp_bytes = if super::region::THP_ASKED.load(crate::sync::Ordering::Relaxed) {
            crate::os::mem::thp_bytes_of(|a, _| {
                a % SEGMENT_SIZE == 0 && super::engine::segmap::contains((a + 1) as *const u8)
            })
            .unwrap_or(0)
        } else {
            0
        };
        Stats {
            mode: state.mode,
            nodes,
            per_node,
            heaps,
            orphan_heaps,
            synthetic: state.topology.is_synthetic(),
            thp_bytes,
            auto_weights: super::placement::default_interleave().and_then(|i| i.auto_weights_by_node(state.topology)),
            cpu_cached,
        }
    }

    /// All nodes summed.
    pub fn total(&self) -> NodeStats {
        let mut t = NodeStats::default();
        for n in self.nodes.iter() {
            t.add(&self.per_node[n]);
        }
        t
    }
}

/// The size classes' pages on `node`'s arena, indexed by class (all zero
/// where the node has none).
pub(crate) fn class_usage(state: &State, node: usize) -> [ClassUsage; CLASSES] {
    let mut u = [ClassUsage::default(); CLASSES];
    match state.arena(node) {
        Some(a) => a.class_usage_into(&mut u),
        None => {
            for (c, x) in u.iter_mut().enumerate() {
                x.block_size = class_size(c) as u64;
            }
        }
    }
    u
}

/// How many classes the stranded lines name, per node.
const MOST_STRANDED: usize = 8;

/// The classes that strand the most on each node, a line each: what the
/// statistics at exit add to the table (`NUMAWEAVE_SHOW_STATS`).
fn write_most_stranded(fd: i32, state: &State) {
    use crate::topology::display::human_bytes as h;
    for n in state.nodes().iter() {
        let mut u = class_usage(state, n);
        u.sort_unstable_by_key(|x| core::cmp::Reverse(x.stranded));
        for x in u.iter().take(MOST_STRANDED).filter(|x| x.stranded > 0) {
            file::write_fd(
                fd,
                format_args!(
                    "node {n}: {:>7} B blocks strand {:>11} in {:>5} pages of {:>11} ({:>11} in use, {:>11} uncollected)\n",
                    x.block_size,
                    h(x.stranded),
                    x.pages,
                    h(x.bytes),
                    h(x.in_use),
                    h(x.uncollected)
                ),
            );
        }
    }
}

/// Prints `stats` on stderr, as the table `Display` gives (for
/// `malloc_stats` and `NUMAWEAVE_SHOW_STATS`).
pub fn print_to_stderr(stats: &Stats) {
    file::write_stderr(format_args!("{stats}"));
}

/// Where the statistics go at exit: a copy of stderr, made when they are
/// asked for (some programs close stderr in their own exit handlers).
static AT_EXIT_FD: AtomicI32 = AtomicI32::new(2);

/// Prints the statistics when the process exits (`NUMAWEAVE_SHOW_STATS`),
/// asked once, when the first heap exists (this may allocate).
pub(crate) fn show_at_exit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        AT_EXIT_FD.store(file::stderr_copy(), Ordering::Relaxed);
        if let Err(e) = thread::at_exit(print_at_exit) {
            file::report(format_args!("numaweave: NUMAWEAVE_SHOW_STATS: {e}"));
        }
    });
}

extern "C" fn print_at_exit() {
    if let Some(s) = State::try_get() {
        let fd = AT_EXIT_FD.load(Ordering::Relaxed);
        file::write_fd(fd, format_args!("{}", Stats::snapshot(s)));
        write_most_stranded(fd, s);
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use crate::topology::display::human_bytes as h;
        writeln!(
            f,
            "numaweave: mode {:?}{}, {} node{}, {} heaps ({} waiting for adoption)",
            self.mode,
            if self.synthetic { " on a SYNTHETIC topology" } else { "" },
            self.nodes.len(),
            if self.nodes.len() == 1 { "" } else { "s" },
            self.heaps,
            self.orphan_heaps
        )?;
        writeln!(
            f,
            "{:>5} {:>11} {:>11} {:>11} {:>11} {:>12} {:>12} {:>12} {:>9} {:>5} {:>7}",
            "node",
            "reserved",
            "committed",
            "in use",
            "returned",
            "allocs",
            "frees",
            "remote frees",
            "fallbacks",
            "huge",
            "regions"
        )?;
        let row = |f: &mut fmt::Formatter<'_>, name: &str, s: &NodeStats| {
            writeln!(
                f,
                "{name:>5} {:>11} {:>11} {:>11} {:>11} {:>12} {:>12} {:>12} {:>9} {:>5} {:>7}",
                h(s.reserved),
                h(s.committed),
                h(s.in_use),
                h(s.returned),
                s.allocs,
                s.frees,
                s.remote_frees,
                s.fallbacks,
                s.huge_live,
                s.regions
            )
        };
        for n in self.nodes.iter() {
            row(f, &n.to_string(), &self.per_node[n])?;
        }
        if self.nodes.len() > 1 {
            row(f, "total", &self.total())?;
        }
        writeln!(
            f,
            "{:>5} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}",
            "node", "resident", "free res.", "stranded", "uncollected", "in heaps", "orphaned", "retained"
        )?;
        let mem_row = |f: &mut fmt::Formatter<'_>, name: &str, s: &NodeStats| {
            writeln!(
                f,
                "{name:>5} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}",
                h(s.resident),
                h(s.free_resident),
                h(s.stranded),
                h(s.uncollected),
                h(s.in_heaps),
                h(s.orphaned),
                h(s.retained)
            )
        };
        for n in self.nodes.iter() {
            mem_row(f, &n.to_string(), &self.per_node[n])?;
        }
        if self.nodes.len() > 1 {
            mem_row(f, "total", &self.total())?;
        }
        if let Some(w) = &self.auto_weights {
            writeln!(f, "default interleave {w}")?;
        }
        if self.thp_bytes > 0 {
            writeln!(f, "transparent huge pages backing it: {}", h(self.thp_bytes))?;
        }
        // Only where hugetlb regions were asked for (`Config::huge`).
        let t = self.total();
        if t.huge_regions + t.huge_fallbacks > 0 {
            write!(f, "hugetlb regions (fell back to base pages):")?;
            for n in self.nodes.iter() {
                let s = &self.per_node[n];
                write!(f, " {n}: {} ({})", s.huge_regions, s.huge_fallbacks)?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}
