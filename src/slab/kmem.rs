//! A cache's shared state ([`KmemCache`], the kernel's `struct kmem_cache`):
//! the object layout, per node the slabs ([`node`](super::node)), and the
//! slow paths that move objects between the slabs, the depot and the
//! thread magazines in front of them (see [`magazine`](super::magazine)),
//! which take and return objects in batches.

use core::ptr::{self, NonNull};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use super::checks::{Check, Checks};
use super::magazine::Magazine;
use super::node::{ListId, NodeSlabs, RANGES, SLAB_MAGIC, Slab, SlabState, Slabs, ranges};
use super::pins::OffNodePins;
use super::register::Registrar;
use crate::error::{Error, Result};
use crate::hardened::HARDENED;
use crate::os::mem::{self, Huge};
use crate::os::thread::futex_wait;
use crate::sync::Mutex;
use crate::topology::{MAX_NODES, Topology};

/// Largest slab; objects must fit at least twice.
pub(crate) const MAX_SLAB: usize = 4 << 20;
const _: () = assert!(MAX_SLAB <= super::chunk::CHUNK_ALIGN, "a slab header must lie in its chunk");
/// Smallest slab (fewer slabs to walk and relist per object).
const MIN_SLAB: usize = 16 << 10;
/// Objects a slab aims to hold at least.
const MIN_OBJECTS: usize = 8;

/// A wrong pointer handed to a cache's free: a panic, or in hardened builds
/// the allocator's misuse report (abort, or false to leak it and go on).
#[cold]
#[inline(never)]
fn reject(what: core::fmt::Arguments<'_>) -> bool {
    if !HARDENED {
        panic!("numaweave: {what}");
    }
    crate::hardened::misuse(what);
    false
}

/// A constructor for raw objects.
pub(crate) type Ctor = Box<dyn Fn(NonNull<u8>) + Send + Sync>;

/// Where a cache's objects go by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Home {
    /// The node of the thread that allocates.
    Local,
    /// A fixed node (given directly, or found from a device).
    Node(usize),
}

/// The fixed facts of a cache, computed by its builder.
pub(crate) struct Spec {
    pub(crate) name: String,
    pub(crate) size: usize,
    pub(crate) align: usize,
    pub(crate) home: Home,
    pub(crate) limit: Option<usize>,
    pub(crate) magazine: Option<usize>,
    pub(crate) ctor: Option<Ctor>,
    pub(crate) zero: bool,
    pub(crate) huge: Huge,
    pub(crate) huge_strict: bool,
    pub(crate) lock: bool,
    /// Told of each chunk as it is mapped and before it goes.
    pub(crate) registrar: Option<Arc<dyn Registrar>>,
    /// What a chunk whose pages the kernel pinned off its node does.
    pub(crate) pins: OffNodePins,
}

/// The shared state of one cache. Kept alive by the cache handle, by every
/// thread that has magazines for it, and by every slab (so objects outliving
/// the handle still find it); freed with the last of them.
#[repr(C)]
pub(crate) struct KmemCache {
    // What the fast paths read, together on the first cache line.
    /// Slot in the per-thread tables and the registry.
    pub(crate) index: usize,
    pub(crate) slab_bytes: usize,
    /// The lowest node (the only one when not `multi_node`).
    pub(crate) first_node: usize,
    /// More than one node: frees must look at the slab's node.
    pub(crate) multi_node: bool,
    pub(crate) zero: bool,
    /// `limit.is_some()`: frees check for waiters.
    pub(crate) limited: bool,
    // The rest.
    pub(crate) name: String,
    pub(crate) size: usize,
    pub(crate) align: usize,
    pub(crate) stride: usize,
    /// Offset of the free-list link inside a free object.
    pub(crate) link: usize,
    pub(crate) first: usize,
    pub(crate) per_slab: usize,
    pub(crate) home: Home,
    pub(crate) limit: Option<usize>,
    pub(crate) rounds: usize,
    pub(crate) ctor: Option<Ctor>,
    /// Which pages the chunks are on, and whether a short hugetlb pool
    /// fails a slab instead of falling back to base pages.
    pub(crate) huge: Huge,
    pub(crate) huge_strict: bool,
    /// Slabs locked in memory (`mlock`) while they exist.
    pub(crate) lock: bool,
    pub(crate) topo: &'static Topology,
    pub(crate) nodes: Box<[NodeSlabs]>,
    /// The handle was dropped: no more depot caching, empty slabs go at once.
    pub(crate) dead: AtomicBool,
    /// Migrations, demotion, and the node the slabs were moved to.
    pub(crate) moves: Moves,
    /// Where objects keep their misuse checks (hardened builds).
    pub(crate) check: Checks,
}

/// No node: the cache was never migrated, or no demotion is set.
pub(crate) const NOWHERE: usize = usize::MAX;

/// A cache's migration state and counters; the migrations themselves are
/// `migrate.rs`'s.
pub(crate) struct Moves {
    /// One migration (or demotion step) at a time; it holds where a
    /// demotion's pass stands. Not held across `fork()` (see
    /// [`KmemCache::lock_for_fork`]).
    pub(crate) moving: Mutex<Progress>,
    /// The node every node's slabs lie on since the last migration
    /// (`NOWHERE`: each on its own).
    pub(crate) placed: AtomicUsize,
    /// The last migration or demotion pass left no page it could move off
    /// `placed` (pages the kernel refused, busy or for want of room, make
    /// a demotion try again).
    pub(crate) settled: AtomicBool,
    pub(crate) migrations: AtomicU64,
    pub(crate) moved_bytes: AtomicU64,
    pub(crate) demotions: AtomicU64,
    /// A buffer's physical address was handed out (`DmaBuf::phys_addr`): a
    /// device may hold it, and a demotion moves the pool only if told it
    /// may ([`Demotion::moving_device_buffers`](super::Demotion::moving_device_buffers)).
    pub(crate) device_addresses: AtomicBool,
    /// The demotion condition: the watched node (`NOWHERE`: none), written
    /// last when one is set, and read first.
    pub(crate) watch: AtomicUsize,
    pub(crate) below: AtomicU64,
    pub(crate) target: AtomicUsize,
    pub(crate) every_ms: AtomicU64,
    /// Whether it may move a pool a device may hold addresses of.
    pub(crate) device_ok: AtomicBool,
    /// When it is next looked at (`os::monotonic_ms`).
    pub(crate) next_ms: AtomicU64,
}

/// Where a demotion's pass stands: the next step starts at `off` bytes
/// into the chunk at `base` of node list `list` (the chunk itself, or the
/// next one above it if it went).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Progress {
    pub(crate) pass: Option<Pass>,
}

/// See [`Progress`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pass {
    pub(crate) to: usize,
    pub(crate) list: usize,
    pub(crate) base: usize,
    pub(crate) off: usize,
    /// Pages of the pass the kernel refused for now (busy, no room).
    pub(crate) refused: usize,
}

impl Moves {
    pub(crate) const fn new() -> Self {
        Moves {
            moving: Mutex::new(Progress { pass: None }),
            placed: AtomicUsize::new(NOWHERE),
            settled: AtomicBool::new(true),
            migrations: AtomicU64::new(0),
            moved_bytes: AtomicU64::new(0),
            demotions: AtomicU64::new(0),
            device_addresses: AtomicBool::new(false),
            watch: AtomicUsize::new(NOWHERE),
            below: AtomicU64::new(0),
            target: AtomicUsize::new(NOWHERE),
            every_ms: AtomicU64::new(0),
            device_ok: AtomicBool::new(false),
            next_ms: AtomicU64::new(0),
        }
    }

    /// The node every node's slabs were moved to, if the cache was migrated.
    pub(crate) fn placed(&self) -> Option<usize> {
        Some(self.placed.load(Ordering::Relaxed)).filter(|&n| n != NOWHERE)
    }

    /// In a forked child: no migration is under way (its thread is not
    /// here), the lock is free, and a demotion's pass starts over.
    ///
    /// # Safety
    /// The caller is a forked child's only thread, in its fork handler.
    unsafe fn reset_in_child(&self) {
        if let Some(mut p) = self.moving.try_lock() {
            p.pass = None;
            return;
        }
        // SAFETY: the holder was a thread of the parent, which the child
        // does not have; its progress may be half written, and is dropped.
        unsafe {
            self.moving.raw_value().pass = None;
            self.moving.unlock_raw();
        }
        self.settled.store(false, Ordering::Relaxed);
    }
}

/// What an allocation may do when its node has nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnEmpty {
    /// Fail with the node's error.
    Fail,
    /// Try the other nodes, nearest first.
    Fallback,
}

impl KmemCache {
    pub(crate) fn new(spec: Spec, index: usize, topo: &'static Topology) -> Result<Self> {
        let page = crate::os::page_size();
        let size = spec.size.max(1);
        if !spec.align.is_power_of_two() || spec.align > MAX_SLAB / 4 {
            return Err(Error::LayoutTooLarge { size, align: spec.align });
        }
        let align = spec.align.max(core::mem::align_of::<*mut u8>());
        let (link, stride, check) = Check::layout(size, align, spec.ctor.is_some());
        let first = core::mem::size_of::<Slab>().next_multiple_of(align);
        if first + 2 * stride > MAX_SLAB {
            return Err(Error::LayoutTooLarge { size, align });
        }
        // At least a header and one object: with a large alignment the
        // header alone takes more than the smallest slab.
        let mut slab_bytes = MIN_SLAB.max(page).max(first + stride).next_power_of_two();
        loop {
            let n = (slab_bytes - first) / stride;
            // The header counts as waste: for page-aligned buffers it takes
            // a whole slot, and longer slabs keep more buffers adjacent.
            let waste = slab_bytes - n * stride;
            if (n >= MIN_OBJECTS && waste <= slab_bytes / 32) || slab_bytes >= MAX_SLAB {
                break;
            }
            slab_bytes *= 2;
        }
        let per_slab = (slab_bytes - first) / stride;
        let rounds = match spec.magazine {
            Some(r) => r,
            None if stride <= 512 => 64,
            None if stride <= 4096 => 32,
            None if stride <= 32 << 10 => 16,
            None => 8,
        };
        // A limited node must not strand its objects in a few threads'
        // magazines: at most an eighth of the limit per magazine.
        let rounds = match spec.limit {
            Some(l) => rounds.min(l / 8),
            None => rounds,
        }
        .clamp(1, super::magazine::MAG_MAX);
        if let Home::Node(n) = spec.home {
            topo.check_node(n)?;
        }
        if spec.limit == Some(0) {
            return Err(Error::InvalidCache { reason: "a per-node limit of 0 objects" });
        }
        let max_node = topo.nodes().iter().max().unwrap_or(0);
        let name: Arc<str> = spec.name.as_str().into();
        let nodes = (0..=max_node)
            .map(|n| NodeSlabs::new(rounds, spec.registrar.clone().map(|r| (r, n)), spec.pins, name.clone()))
            .collect();
        Ok(Self {
            name: spec.name,
            index,
            size,
            align,
            stride,
            link,
            slab_bytes,
            first,
            per_slab,
            home: spec.home,
            limit: spec.limit,
            rounds,
            ctor: spec.ctor,
            zero: spec.zero,
            huge: spec.huge,
            huge_strict: spec.huge_strict,
            lock: spec.lock,
            multi_node: topo.node_count() > 1,
            limited: spec.limit.is_some(),
            first_node: topo.nodes().first().unwrap_or(0),
            topo,
            nodes,
            dead: AtomicBool::new(false),
            moves: Moves::new(),
            check,
        })
    }

    /// The slab holding `obj`.
    #[inline]
    pub(crate) fn slab_of(&self, obj: NonNull<u8>) -> *mut Slab {
        (obj.as_ptr() as usize & !(self.slab_bytes - 1)) as *mut Slab
    }

    /// The node `obj` belongs to.
    ///
    /// # Safety
    /// `obj` is an object of this cache.
    #[inline]
    pub(crate) unsafe fn node_of(&self, obj: NonNull<u8>) -> usize {
        // SAFETY: objects live inside their slab, whose header is mapped.
        unsafe { (*self.slab_of(obj)).node }
    }

    /// Whether `obj` is the start of an object of this cache. If not: a
    /// panic, or in hardened builds a misuse report (then false under
    /// `NUMAWEAVE_ON_ERROR=report`: the caller leaks the object).
    ///
    /// # Safety
    /// `obj` lies in a chunk some numaweave cache mapped (any cache: a
    /// foreign object is what this catches; chunks start on
    /// [`CHUNK_ALIGN`](super::chunk::CHUNK_ALIGN), so the address below it
    /// aligned to this cache's slab size is in the same chunk), or that
    /// address is readable. (Debug and hardened builds need neither: they
    /// look the slab up in the registry of slabs.)
    pub(crate) unsafe fn check_owner(&self, obj: NonNull<u8>) -> bool {
        // Found from the registry, an object of a cache with another slab
        // size is named, not misread, and a pointer into no slab at all (a
        // stack address) is never followed.
        let s = if RANGES {
            let a = obj.as_ptr() as usize;
            match ranges().range(..=a).next_back() {
                Some((&start, &len)) if a < start + len => start as *mut Slab,
                _ => return reject(format_args!("{obj:p} freed into slab cache \"{}\" is not in any slab", self.name)),
            }
        } else {
            self.slab_of(obj)
        };
        // SAFETY: with `RANGES`, `s` is a registered slab, whose header is mapped; else it is
        // the slab-aligned address below `obj`, which the caller's terms make readable.
        let (magic, owner) = unsafe { ((*s).magic, (*s).cache.cast::<KmemCache>()) };
        if magic != SLAB_MAGIC {
            return reject(format_args!(
                "{obj:p} freed into slab cache \"{}\" is not an object of any slab cache",
                self.name
            ));
        }
        if !ptr::eq(owner, self) {
            // SAFETY: a slab with a valid magic points at its live cache (the
            // slab holds a reference to it).
            let other = unsafe { &(*owner).name };
            return reject(format_args!(
                "object {obj:p} of slab cache \"{other}\" freed into slab cache \"{}\"",
                self.name
            ));
        }
        // Debug and hardened builds also check the offset (a division: kept
        // off the default release build's free path).
        let off = obj.as_ptr() as usize - s as usize;
        if off < self.first || (RANGES && !(off - self.first).is_multiple_of(self.stride)) {
            return reject(format_args!(
                "{obj:p} is inside an object of slab cache \"{}\", not at its start",
                self.name
            ));
        }
        true
    }

    /// The default node for a thread on `thread_node`.
    #[inline]
    pub(crate) fn default_node(&self, thread_node: usize) -> usize {
        match self.home {
            Home::Node(n) => n,
            Home::Local => thread_node,
        }
    }

    /// Nodes to try for an allocation that started at `first`: `first`, then
    /// (with [`OnEmpty::Fallback`]) the other allowed memory nodes by distance.
    pub(crate) fn candidates(&self, first: usize, on_empty: OnEmpty) -> impl Iterator<Item = usize> + '_ {
        let usable = self.topo.memory_nodes().intersection(&self.topo.allowed_nodes());
        let rest = self.topo.nodes_by_distance(first).filter(move |&n| n != first && usable.contains(n));
        core::iter::once(first).chain(rest.take(if on_empty == OnEmpty::Fallback { MAX_NODES } else { 0 }))
    }

    #[inline]
    fn link_of(&self, obj: *mut u8) -> *mut *mut u8 {
        // SAFETY (for callers): `link` + 8 ≤ stride, inside the object's slot.
        obj.wrapping_add(self.link).cast()
    }

    /// Moves up to `want` objects of `node` into `mag` (which must have room):
    /// first what other nodes' threads freed here, then free objects of
    /// partial and empty slabs, then new slabs. Ok(0) never happens: the
    /// error says why the node had nothing.
    pub(crate) fn fill(&self, node: usize, mag: &mut Magazine, want: usize) -> Result<usize> {
        let ns = &self.nodes[node];
        let mut s = ns.lock();
        // SAFETY: objects on the remote list are this node's free objects.
        unsafe { self.drain_remote(node, &mut s) };
        let mut got = 0;
        let start = mag.len();
        while got < want {
            let slab = if !s.partial.head.is_null() {
                s.partial.head
            } else if !s.empty.head.is_null() {
                s.empty.head
            } else {
                match self.new_slab(node, &mut s) {
                    Ok(slab) => slab,
                    Err(e) if got == 0 => {
                        if matches!(e, Error::LimitReached { .. }) {
                            ns.counters.limit_hits.fetch_add(1, Ordering::Relaxed);
                        }
                        return Err(e);
                    }
                    Err(_) => break,
                }
            };
            // SAFETY: `slab` is on one of this node's lists and we hold its mutex.
            unsafe {
                while got < want {
                    let Some(obj) = self.take_from(slab) else { break };
                    let pushed = mag.push(obj);
                    debug_assert!(pushed);
                    got += 1;
                }
                self.relist(&mut s, slab);
            }
        }
        s.active += got;
        drop(s);
        // Slabs hand out objects in address order; reversed, the magazine
        // pops them in that order too, so consecutive allocations from fresh
        // memory are adjacent and ascending (I/O buffers merge into one
        // segment).
        mag.reverse_from(start);
        Ok(got)
    }

    /// One object out of `slab`: a free one, else a newly carved one (run
    /// through the constructor).
    ///
    /// # Safety
    /// The caller holds the slab's node mutex.
    unsafe fn take_from(&self, slab: *mut Slab) -> Option<NonNull<u8>> {
        // SAFETY: the caller holds `slab`'s node mutex (its word), which guards `state`: no
        // one else has it.
        let st = unsafe { &mut (*slab).state };
        let obj = if !st.free.is_null() {
            let obj = st.free;
            // SAFETY: a free object's link word holds the next free object.
            st.free = unsafe { *self.link_of(obj) };
            obj
        } else {
            // SAFETY: `cap` is fixed at creation.
            if st.carved >= unsafe { (*slab).cap } {
                return None;
            }
            let obj = slab.cast::<u8>().wrapping_add(self.first + st.carved as usize * self.stride);
            st.carved += 1;
            if let Some(check) = self.check.first() {
                // SAFETY: a fresh slot of this cache.
                unsafe { check.carved(obj) };
            }
            if let Some(ctor) = &self.ctor {
                // SAFETY: a fresh slot of `stride` bytes inside the slab.
                ctor(unsafe { NonNull::new_unchecked(obj) });
            }
            obj
        };
        st.inuse += 1;
        NonNull::new(obj)
    }

    /// Puts `slab` on the list its `inuse` calls for.
    ///
    /// # Safety
    /// `slab` is on one of `s`'s lists; the caller holds the mutex.
    unsafe fn relist(&self, s: &mut Slabs, slab: *mut Slab) {
        // SAFETY: `slab` is on one of the node's lists (the caller's word), so
        // live; its state is read under the node mutex the caller holds.
        let (cur, inuse, cap) = unsafe { ((*slab).state.list, (*slab).state.inuse, (*slab).cap) };
        let want = if inuse == 0 {
            ListId::Empty
        } else if inuse == cap {
            ListId::Full
        } else {
            ListId::Partial
        };
        if want != cur {
            // SAFETY: moved between two lists of the same node.
            unsafe {
                s.list(cur).remove(slab);
                s.list(want).push(slab, want);
            }
        }
    }

    /// Maps a new slab on `node`, within the node's limit.
    fn new_slab(&self, node: usize, s: &mut Slabs) -> Result<*mut Slab> {
        let cap = match self.limit {
            Some(l) if s.capacity >= l => return Err(Error::LimitReached { node, limit: l }),
            Some(l) => self.per_slab.min(l - s.capacity),
            None => self.per_slab,
        };
        let page = crate::os::page_size();
        let len = (self.first + cap * self.stride).next_multiple_of(page);
        debug_assert!(len <= self.slab_bytes);
        let p =
            s.chunks.take(self.slab_bytes, self.phys_for(node), self.huge, self.huge_strict).map_err(|e| match e {
                Error::NodeOutOfMemory { .. } => Error::NodeOutOfMemory { node },
                e => e,
            })?;
        if self.lock {
            // SAFETY: the slab's part of a slot we just took, mapped.
            if let Err(e) = unsafe { mem::lock(p, len) } {
                // SAFETY: the slot holds nothing yet.
                unsafe { s.chunks.give(p, self.slab_bytes, len) };
                return Err(e);
            }
        }
        let slab = p.as_ptr().cast::<Slab>();
        // SAFETY: the mapping is writable and at least one header long.
        unsafe {
            slab.write(Slab {
                magic: SLAB_MAGIC,
                cache: ptr::from_ref(self).cast(),
                node,
                map_len: len,
                cap: cap as u32,
                state: SlabState {
                    free: ptr::null_mut(),
                    inuse: 0,
                    carved: 0,
                    list: ListId::Empty,
                    next: ptr::null_mut(),
                    prev: ptr::null_mut(),
                },
            });
            s.empty.push(slab, ListId::Empty);
            if RANGES {
                ranges().insert(slab as usize, len);
            }
            // Each slab keeps the cache alive (see `KmemCache`).
            Arc::increment_strong_count(self);
        }
        s.capacity += cap;
        s.mapped += len;
        self.nodes[node].counters.slabs_created.fetch_add(1, Ordering::Relaxed);
        Ok(slab)
    }

    /// Unmaps an empty slab; returns the cache reference it held, which the
    /// caller must drop last of all ([`KmemCache::put_refs`]).
    ///
    /// # Safety
    /// `slab` is empty and on `s.empty`; the caller holds the node mutex.
    unsafe fn release(&self, node: usize, s: &mut Slabs, slab: *mut Slab) -> usize {
        // SAFETY: `slab` is empty and on `s.empty` (the caller's word), and the
        // caller holds the node mutex that guards the list.
        let (len, cap) = unsafe {
            s.empty.remove(slab);
            ((*slab).map_len, (*slab).cap as usize)
        };
        s.capacity -= cap;
        s.mapped -= len;
        if RANGES {
            ranges().remove(&(slab as usize));
        }
        // SAFETY: no object of an empty slab is in use; its slot is ours
        // (locked by `new_slab` when the cache locks).
        unsafe {
            let p = NonNull::new_unchecked(slab.cast());
            if self.lock {
                let _ = mem::unlock(p, len);
            }
            s.chunks.give(p, self.slab_bytes, len);
        }
        self.nodes[node].counters.slabs_released.fetch_add(1, Ordering::Relaxed);
        1
    }

    /// Returns `obj` to its slab.
    ///
    /// # Safety
    /// `obj` is an object of this cache on `node`, out of its slab, owned by
    /// the caller; the caller holds the node mutex.
    unsafe fn put(&self, s: &mut Slabs, obj: *mut u8) -> *mut Slab {
        // SAFETY: `obj` is a live object of this cache (the caller's word), so not null.
        let slab = self.slab_of(unsafe { NonNull::new_unchecked(obj) });
        // SAFETY: its slab's state is guarded by the mutex we hold.
        unsafe {
            *self.link_of(obj) = (*slab).state.free;
            (*slab).state.free = obj;
            (*slab).state.inuse -= 1;
            self.relist(s, slab);
        }
        s.active -= 1;
        slab
    }

    /// Moves what other nodes freed into `node`'s slabs.
    ///
    /// # Safety
    /// `s` is `node`'s locked slabs.
    pub(crate) unsafe fn drain_remote(&self, node: usize, s: &mut Slabs) {
        let mut obj = self.nodes[node].remote.0.take_all();
        while !obj.is_null() {
            // SAFETY: the chain's objects are free objects of this node,
            // linked through their link words.
            let next = unsafe { *self.link_of(obj) };
            // SAFETY: as above; we hold the mutex.
            unsafe { self.put(s, obj) };
            obj = next;
        }
    }

    /// Gives `objs` (all of `node`) back to their slabs, wakes waiters, and
    /// returns the cache references of slabs released on the way (a dropped
    /// cache releases empty slabs at once): drop them with
    /// [`KmemCache::put_refs`], last.
    ///
    /// # Safety
    /// Every object is this cache's, of `node`, owned by the caller.
    pub(crate) unsafe fn give_back(&self, node: usize, objs: &[*mut u8]) -> usize {
        let ns = &self.nodes[node];
        let mut refs = 0;
        let mut s = ns.lock();
        let dead = self.dead.load(Ordering::Acquire);
        for &obj in objs {
            // SAFETY: `obj` is this cache's, of `node` and owned by us (the caller's word), and `s`
            // is `node`'s slabs under the mutex we hold: what `put` asks.
            let slab = unsafe { self.put(&mut s, obj) };
            // SAFETY: `slab` is on one of the node's lists.
            if dead && unsafe { (*slab).state.inuse } == 0 {
                // SAFETY: empty, on `s.empty`, mutex held.
                refs += unsafe { self.release(node, &mut s, slab) };
            }
        }
        drop(s);
        if !objs.is_empty() {
            ns.wake_waiters();
        }
        refs
    }

    /// Sends the chain `first ..= last` (`n` objects of `node`, linked through
    /// their link words) home to `node`.
    ///
    /// # Safety
    /// As [`RemoteList::push_chain`]; the objects are this cache's, of `node`.
    pub(crate) unsafe fn free_remote(&self, node: usize, first: NonNull<u8>, last: NonNull<u8>, n: usize) {
        let ns = &self.nodes[node];
        // SAFETY: the chain is `n` free objects of this cache on `node`, linked
        // through their link words, owned by the caller: what `push_chain`
        // needs.
        unsafe { ns.remote.0.push_chain(first, last, self.link) };
        ns.counters.remote_frees.fetch_add(n as u64, Ordering::Relaxed);
        ns.wake_waiters();
    }

    /// Links `obj` in front of `chain` for [`free_remote`](Self::free_remote).
    ///
    /// # Safety
    /// `obj` is a free object of this cache owned by the caller.
    pub(crate) unsafe fn link_before(&self, obj: NonNull<u8>, chain: *mut u8) {
        // SAFETY: `obj` is a free object of this cache owned by the caller, so its link word
        // (inside its slot) is ours to write.
        unsafe { *self.link_of(obj.as_ptr()) = chain };
    }

    /// Blocks until `node` may have a free object, or `deadline`; false on
    /// timeout. The waiter counts itself, reads the wake count, then tries
    /// `try_take`; it sleeps only while the count is what it read, so a
    /// free after its attempt (which saw it counted and bumped the count)
    /// is not missed. No lock: the sleep is on the count itself (a futex).
    pub(crate) fn wait<R>(
        &self,
        node: usize,
        deadline: std::time::Instant,
        mut try_take: impl FnMut() -> Option<R>,
    ) -> Option<R> {
        let ns = &self.nodes[node];
        ns.counters.waits.fetch_add(1, Ordering::Relaxed);
        ns.waiters.0.fetch_add(1, Ordering::SeqCst);
        let got = loop {
            let seen = ns.wake.load(Ordering::SeqCst);
            if let Some(r) = try_take() {
                break Some(r);
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                break None;
            }
            futex_wait(&ns.wake, seen, Some(deadline - now));
        };
        ns.waiters.0.fetch_sub(1, Ordering::SeqCst);
        got
    }

    /// The `fork()` handlers' part here: every node's locks in node order.
    /// (The depot's spin lock and the slabs' mutex are never held
    /// together.) Not the migration lock: a migration holds it across its
    /// moves, which may take seconds, and a fork does not wait for them;
    /// the child resets it ([`unlock_after_fork`](Self::unlock_after_fork)).
    pub(crate) fn lock_for_fork(&self) {
        for ns in self.nodes.iter() {
            ns.slabs.lock_raw();
            ns.depot.lock_for_fork();
        }
    }

    /// Releases what [`lock_for_fork`](Self::lock_for_fork) took. In a
    /// forked child (`child`), first forgets any migration the parent had
    /// under way: no thread of the child runs it, so the migration lock is
    /// reset and no chunk is left moving (the node locks, held here, keep
    /// the chunk lists as the fork found them).
    ///
    /// # Safety
    /// Taken by `lock_for_fork` on this thread (or, in a forked child, the
    /// thread it was copied from).
    pub(crate) unsafe fn unlock_after_fork(&self, child: bool) {
        if child {
            // SAFETY: in a forked child, whose only thread is this one: the
            // lock's holder, if any, was another thread of the parent.
            unsafe { self.moves.reset_in_child() };
            for ns in self.nodes.iter() {
                // SAFETY: taken by `lock_for_fork` (the copied thread's).
                unsafe { ns.slabs.raw_value().chunks.after_fork_in_child() };
            }
        }
        for ns in self.nodes.iter().rev() {
            // SAFETY: `lock_for_fork` took these on this thread (or the thread
            // the child was copied from); released in the reverse order.
            unsafe {
                ns.depot.unlock_after_fork();
                ns.slabs.unlock_raw();
            }
        }
    }

    /// An object being handed out, in a hardened build: its checks
    /// (`hardened.rs`).
    ///
    /// # Safety
    /// `obj` is an object of this cache just taken from it.
    #[inline]
    pub(crate) unsafe fn handing_out(&self, obj: NonNull<u8>) {
        if let Some(check) = self.check.first() {
            // SAFETY: `obj` is an object of this cache just taken from it
            // (the caller's word), which is what the check reads and writes.
            unsafe { check.handing_out(obj, &self.name, self.size) }
        }
    }

    /// An object being freed by its user, in a hardened build: false if it
    /// must be leaked (see `hardened.rs`).
    ///
    /// # Safety
    /// `obj` is the start of an object of this cache ([`KmemCache::check_owner`]).
    pub(crate) unsafe fn freeing(&self, obj: NonNull<u8>) -> bool {
        let Some(check) = self.check.first() else { return true };
        // SAFETY: `obj` is the start of an object of this cache (the
        // caller's word), so its mark word is within it; `node_of` reads the
        // header of a slab of this cache.
        unsafe { check.freeing(obj, &self.name, self.size, || self.node_of(obj)) }
    }

    /// The node whose memory holds the slabs of node `list`.
    #[inline]
    pub(crate) fn memory_node(&self, list: usize) -> usize {
        self.moves.placed().unwrap_or(list)
    }

    /// The kernel node new chunks of node `list` are mapped on.
    pub(crate) fn phys_for(&self, list: usize) -> usize {
        self.topo.physical_node(self.memory_node(list))
    }

    /// Flushes the depots and remote lists into the slabs and unmaps every
    /// empty slab. Returns (bytes unmapped, cache references to drop last).
    pub(crate) fn shrink(&self) -> (usize, usize) {
        let mut bytes = 0;
        let mut refs = 0;
        for (node, ns) in self.nodes.iter().enumerate() {
            for mut m in ns.depot.take_full() {
                // SAFETY: depot objects are this node's, out of their slabs.
                refs += unsafe { self.give_back(node, m.as_slice()) };
                m.clear();
            }
            let mut s = ns.lock();
            // SAFETY: the node's locked slabs.
            unsafe { self.drain_remote(node, &mut s) };
            while !s.empty.head.is_null() {
                let slab = s.empty.head;
                // SAFETY: on `s.empty`, so empty; mutex held.
                bytes += unsafe { (*slab).map_len };
                // SAFETY: as above.
                refs += unsafe { self.release(node, &mut s, slab) };
            }
        }
        (bytes, refs)
    }

    /// Drops `n` references to the cache at `this` (slab references handed
    /// back by the slow paths).
    ///
    /// # Safety
    /// `this` came from an `Arc<KmemCache>` and the caller owns `n` strong
    /// references to it; nothing may use `this` afterwards unless it holds
    /// another reference.
    pub(crate) unsafe fn put_refs(this: *const KmemCache, n: usize) {
        for _ in 0..n {
            // SAFETY: the caller owns `n` strong references to this
            // `Arc<KmemCache>`: each decrement gives one back.
            unsafe { Arc::decrement_strong_count(this) };
        }
    }

    /// Takes a temporary reference for a slow path, which may release the
    /// slab that kept the cache alive.
    ///
    /// # Safety
    /// `this` is a live `Arc<KmemCache>` allocation.
    pub(crate) unsafe fn hold(this: *const KmemCache) {
        // SAFETY: `this` is a live `Arc<KmemCache>` allocation (the caller's word),
        // so its count may be raised.
        unsafe { Arc::increment_strong_count(this) };
    }
}
