//! One node's slabs of a cache: the slab header, the three lists a slab
//! sits on by how many of its objects are out (`partial`, `full`, `empty`)
//! under the node's mutex, the depot and remote-free list in front of them,
//! and (debug and hardened builds) the registry of every slab's range.
//!
//! A *slab* is a slot of a node-bound chunk ([`chunk`](super::chunk)),
//! aligned to its size so that `object & !(slab_bytes - 1)` finds its
//! header, carved lazily into objects of one stride.

use core::ptr;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering, fence};

use super::chunk::Chunks;
use super::magazine::{Depot, RemoteList};
use super::pins::OffNodePins;
use super::register::Registrar;
use crate::hardened::HARDENED;
use crate::os::thread::futex_wake;
use crate::sync::{CachePadded, Mutex, MutexGuard};

/// Marks a slab header (a wrong pointer handed to `free` is caught by it).
pub(super) const SLAB_MAGIC: usize = 0x6e75_6d61_736c_6162; // "numaslab"

/// Full magazines a node's depot keeps before frees go back to the slabs.
const DEPOT_MAX_FULL: usize = 32;

/// Every slab's range, in debug and hardened builds, so that a pointer from
/// another cache (whose slab alignment may differ) or from no cache at all
/// is named rather than followed blindly.
static SLAB_RANGES: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

/// Whether frees look their slab up in [`SLAB_RANGES`] (and check the
/// offset is an object's start): debug and hardened builds.
pub(super) const RANGES: bool = cfg!(debug_assertions) || HARDENED;

pub(super) fn ranges() -> MutexGuard<'static, BTreeMap<usize, usize>> {
    SLAB_RANGES.lock()
}

/// The `fork()` handlers' part here: the table of slab ranges, taken after
/// every node lock (under which it is used).
pub(crate) fn lock_ranges_for_fork() {
    if RANGES {
        SLAB_RANGES.lock_raw();
    }
}

/// Releases what [`lock_ranges_for_fork`] took.
///
/// # Safety
/// Taken by `lock_ranges_for_fork` on this thread (or, in a forked child,
/// the thread it was copied from).
pub(crate) unsafe fn unlock_ranges_after_fork() {
    if RANGES {
        // SAFETY: `lock_ranges_for_fork` took it on this thread (or the
        // thread the child was copied from), so it is held and ours to
        // release.
        unsafe { SLAB_RANGES.unlock_raw() };
    }
}
/// The header at the start of every slab.
#[repr(C, align(128))]
pub(crate) struct Slab {
    // Fixed at creation; read (never written) by frees on any thread.
    pub(super) magic: usize,
    /// The cache that owns the slab (a `*const KmemCache`, kept as an
    /// address: this floor names nothing of the cache above it).
    pub(super) cache: *const (),
    pub(crate) node: usize,
    pub(super) map_len: usize,
    pub(super) cap: u32,
    // Under the node's slab mutex: a separate cache line.
    pub(super) state: SlabState,
}

#[repr(C, align(64))]
pub(super) struct SlabState {
    /// Free objects, linked through their link word.
    pub(super) free: *mut u8,
    /// Objects out of the slab (in magazines, the depot, or with callers).
    pub(super) inuse: u32,
    /// Objects carved so far (the rest are untouched memory).
    pub(super) carved: u32,
    pub(super) list: ListId,
    pub(super) next: *mut Slab,
    pub(super) prev: *mut Slab,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum ListId {
    Partial,
    Full,
    Empty,
}

/// An intrusive doubly linked list of slabs.
pub(super) struct List {
    pub(super) head: *mut Slab,
    pub(super) len: usize,
}

impl List {
    pub(super) const fn new() -> Self {
        Self { head: ptr::null_mut(), len: 0 }
    }

    /// # Safety
    /// `s` is a live slab on no list; the caller holds the node mutex.
    pub(super) unsafe fn push(&mut self, s: *mut Slab, id: ListId) {
        // SAFETY: `s` is a live slab on no list, and the caller holds the node mutex that
        // guards this list and every slab's links (its word).
        unsafe {
            (*s).state.list = id;
            (*s).state.prev = ptr::null_mut();
            (*s).state.next = self.head;
            if !self.head.is_null() {
                (*self.head).state.prev = s;
            }
        }
        self.head = s;
        self.len += 1;
    }

    /// # Safety
    /// `s` is on this list; the caller holds the node mutex.
    pub(super) unsafe fn remove(&mut self, s: *mut Slab) {
        // SAFETY: `s` is on this list (the caller's word), so are its neighbours, and the
        // node mutex the caller holds guards all their links.
        unsafe {
            let (p, n) = ((*s).state.prev, (*s).state.next);
            if p.is_null() {
                self.head = n;
            } else {
                (*p).state.next = n;
            }
            if !n.is_null() {
                (*n).state.prev = p;
            }
            (*s).state.next = ptr::null_mut();
            (*s).state.prev = ptr::null_mut();
        }
        self.len -= 1;
    }
}

/// One node's slabs, under its mutex.
pub(crate) struct Slabs {
    pub(super) partial: List,
    pub(super) full: List,
    pub(super) empty: List,
    /// Objects the node's slabs can hold (what the limit bounds).
    pub(crate) capacity: usize,
    /// Objects out of the slabs.
    pub(crate) active: usize,
    /// Bytes of the slabs (their slots' used part).
    pub(crate) mapped: usize,
    /// The chunks the slabs are slots of.
    pub(crate) chunks: Chunks,
}

// SAFETY: the raw slab pointers are only followed under the node mutex.
unsafe impl Send for Slabs {}

impl Slabs {
    pub(super) fn list(&mut self, id: ListId) -> &mut List {
        match id {
            ListId::Partial => &mut self.partial,
            ListId::Full => &mut self.full,
            ListId::Empty => &mut self.empty,
        }
    }

    pub(crate) fn slabs(&self) -> usize {
        self.partial.len + self.full.len + self.empty.len
    }
}

/// Cumulative per-node counters, bumped on slow paths only.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) remote_frees: AtomicU64,
    pub(crate) waits: AtomicU64,
    pub(crate) limit_hits: AtomicU64,
    pub(crate) fallbacks: AtomicU64,
    pub(crate) slabs_created: AtomicU64,
    pub(crate) slabs_released: AtomicU64,
}

/// Everything a cache keeps for one node.
pub(crate) struct NodeSlabs {
    pub(crate) depot: Depot,
    pub(crate) remote: CachePadded<RemoteList>,
    /// Threads in `alloc_wait` on this node; frees check it to wake them.
    pub(crate) waiters: CachePadded<AtomicUsize>,
    pub(crate) slabs: Mutex<Slabs>,
    /// Bumped by frees when `waiters` is not 0: `alloc_wait` sleeps on it
    /// (a futex) until it changes.
    pub(super) wake: AtomicU32,
    pub(crate) counters: Counters,
}

impl NodeSlabs {
    pub(super) fn new(
        rounds: usize,
        registrar: Option<(Arc<dyn Registrar>, usize)>,
        pins: OffNodePins,
        name: Arc<str>,
    ) -> Self {
        Self {
            depot: Depot::new(DEPOT_MAX_FULL, rounds),
            remote: CachePadded(RemoteList::new()),
            waiters: CachePadded(AtomicUsize::new(0)),
            slabs: Mutex::new(Slabs {
                partial: List::new(),
                full: List::new(),
                empty: List::new(),
                capacity: 0,
                active: 0,
                mapped: 0,
                chunks: Chunks::new(registrar, pins, name),
            }),
            wake: AtomicU32::new(0),
            counters: Counters::default(),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Slabs> {
        // A panic under the lock (a constructor that panicked) leaves the
        // lists consistent: every step that moves a slab completes first.
        self.slabs.lock()
    }

    /// Wakes `alloc_wait`ers after objects came back to this node.
    pub(super) fn wake_waiters(&self) {
        // Pairs with the waiter's count and its read of `wake` (see
        // `KmemCache::wait`): either it sees the objects we returned, or we see
        // it counted and change `wake` under its sleep.
        fence(Ordering::SeqCst);
        if self.waiters.0.load(Ordering::Relaxed) != 0 {
            self.wake.fetch_add(1, Ordering::SeqCst);
            futex_wake(&self.wake, i32::MAX);
        }
    }
}
