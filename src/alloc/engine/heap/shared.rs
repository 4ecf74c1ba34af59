//! Heaps a node's threads share, each used under a lock of its arena: the
//! shared heap that serves a thread's first blocks of a class, and the
//! heap of cold blocks.
//!
//! A thread that holds a few blocks of many classes (a connection's
//! buffers, a request's strings) would otherwise take a page for each, and
//! touch at least an OS page of each: 1,000 threads holding 64 blocks of
//! 16 B to 2 KiB (66 KiB live) took 166 KiB each, where glibc's shared
//! arenas take 75. So in a process with threads, a heap's first
//! [`SPARSE_BLOCKS`] blocks of a class it has no page of come from a heap
//! its node's threads share ([`OWNER_SHARED`]), under the arena's `shared`
//! lock: their blocks lie together in its pages. Every free of such a block
//! is a remote free (the shared heap is no thread's), collected by the
//! next thread that takes a block of the class there, or by the
//! lifecycle's reclaim (`lifecycle::reclaim_orphans`). A class used more
//! than that gets pages of the thread's own, as before: the fast path is
//! untouched, and a thread's first blocks of each class are slow-path
//! allocations (a lock and a pop).
//!
//! Cold blocks (a hint below 128: `NumaAlloc::alloc_hinted`, the hinted
//! `operator new`, the cold handle) come from the heap of cold blocks of
//! the node they are placed on ([`Heap::alloc_cold`]): its pages hold no
//! hot block, so a page a program touches often never carries cold data
//! along, nor the other way round, on whichever node the cold data lands
//! (the lower tier, or the thread's own when there is none). Their frees
//! are remote frees, collected as the shared heap's are.

use core::ptr;

use super::{Heap, Placement, empty_page};
use crate::alloc::engine::segment::{self, segment_of};
use crate::alloc::engine::size_class::CLASSES;
use crate::alloc::engine::types::SharedHeap;
use crate::alloc::engine::types::{OWNER_SHARED, OWNER_THREAD, SmallSegment, State};
use crate::hardened::HARDENED;
use crate::sync::Ordering;
use crate::topology::NodeSet;

/// Blocks of a class a heap takes from its node's shared heap before it
/// takes a page of its own for it.
pub(super) const SPARSE_BLOCKS: u8 = 8;

/// Whether heaps take their first blocks from the shared heap. Not in
/// hardened builds: a block freed once goes back to the shared heap, whose
/// page may then serve another class, and a second free of it is reported
/// as a double free of a block of that class; a thread's own pages keep
/// the report exact.
const SHARING: bool = !HARDENED;

/// The shared heap's placement: any of its pages, fresh ones from its node.
struct Home(usize);

impl Placement for Home {
    fn accepts(&mut self, _: usize) -> bool {
        true
    }
    fn fresh(&mut self) -> (usize, Option<NodeSet>) {
        (self.0, None)
    }
    fn took(&mut self, _: usize) {}
}

impl Heap {
    /// A block of `class` from the heap of cold blocks of `node`'s arena
    /// (made on first use; fresh pages from that arena), null when no
    /// memory can be had.
    ///
    /// # Safety
    /// `class < CLASSES` (the pop indexes its slot unchecked).
    #[cold]
    #[inline(never)]
    pub(crate) unsafe fn alloc_cold(state: &State, node: usize, class: usize) -> *mut u8 {
        let arena = state.node_arena(node);
        let mut g = arena.cold.lock();
        // SAFETY: `g` is the cold heap's lock, held; `class < CLASSES` (the
        // caller's word).
        unsafe { Heap::alloc_locked(&mut g, state, arena.node, class) }
    }

    /// A block of `class` from a heap a node's threads share (the shared
    /// heap, or the heap of cold blocks), made on first use; fresh pages
    /// from `node`'s arena. Null when no memory can be had.
    ///
    /// # Safety
    /// `slot` is the content of that heap's lock, held by the caller: the
    /// heap is used under it alone (no thread's TLS slot names it, so no
    /// fast path reaches it), which is what its owner-only fields need;
    /// `class < CLASSES`.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    unsafe fn alloc_locked(slot: &mut SharedHeap, state: &State, node: usize, class: usize) -> *mut u8 {
        debug_assert!(class < CLASSES);
        if slot.0.is_null() {
            match Heap::make(state, node, OWNER_SHARED) {
                Some(h) => slot.0 = h,
                None => return ptr::null_mut(),
            }
        }
        let sh = slot.0;
        // SAFETY: the caller holds `sh`'s lock, under which alone the heap is used (its
        // word), as `pop` and `refill` need of an owner; `class < CLASSES` as the callers
        // must (asserted above in debug builds).
        unsafe {
            let mut p = Heap::pop(sh, class);
            if p.is_null() {
                p = Heap::refill(sh, class, state, &mut Home(node));
            }
            if !p.is_null() {
                let seg = segment_of(p).cast::<SmallSegment>();
                let pg = segment::page_of(seg, p);
                debug_assert!((*pg).info.heap.load(Ordering::Relaxed) == sh, "a shared block of another heap's page");
                debug_assert_eq!(usize::from((*pg).info.class), class);
            }
            p
        }
    }

    /// Blocks of `class` into `out` from the heap in `slot` (made on first
    /// use, fresh pages from `node`'s arena), whose lock the caller holds:
    /// a per-CPU cache's refill from its CPU's heap (`cpu.rs`). How many;
    /// fewer than asked only when no more memory can be had. The heap is
    /// marked as one whose blocks the caches may hold.
    ///
    /// # Safety
    /// `slot` is the content of that heap's lock, held by the caller (the
    /// heap is used under it alone); `class < CLASSES`.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn alloc_batch_in(
        slot: &mut SharedHeap,
        state: &State,
        node: usize,
        class: usize,
        out: &mut [*mut u8],
    ) -> usize {
        let mut n = 0;
        while n < out.len() {
            // SAFETY: the caller holds the heap's lock; `class < CLASSES`
            // (the caller's word).
            let p = unsafe { Heap::alloc_locked(slot, state, node, class) };
            if p.is_null() {
                break;
            }
            out[n] = p;
            n += 1;
        }
        // Other threads' frees read the flag (`cpu::free`): one that still
        // reads false frees the block back to its page, as any remote free.
        // Stored once, so that the line those frees read stays clean.
        // SAFETY: the heap, made by the pop above if need be.
        if n > 0 && !unsafe { (*slot.0).cpu_served.load(Ordering::Relaxed) } {
            // SAFETY: as above.
            unsafe { (*slot.0).cpu_served.store(true, Ordering::Relaxed) };
        }
        n
    }

    /// Whether the refill of `class` takes its block from the node's shared
    /// heap: a heap of a thread of a process with threads, under a placement
    /// of its own node's pages (`Local`'s: the one the free cache serves),
    /// with no page of the class, and fewer than [`SPARSE_BLOCKS`] blocks of
    /// it taken so far.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    #[inline]
    pub(super) unsafe fn sparse(heap: *mut Heap, class: usize, placement: &mut impl Placement) -> bool {
        // SAFETY: owner-only fields of the caller's heap.
        unsafe {
            SHARING
                && (*heap).sparse[class] < SPARSE_BLOCKS
                && (*heap).lists[class].head.is_null()
                && (*heap).direct[class] == empty_page()
                && (*heap).owned.load(Ordering::Relaxed) == OWNER_THREAD
                && placement.cache_serves((*heap).node)
                && !crate::os::thread::single_threaded()
        }
    }

    /// A block of `class` from the shared heap of `node` (the placement's
    /// node for a fresh page; made on first use), counted against the
    /// class's [`SPARSE_BLOCKS`]; null when no memory can be had (the
    /// caller refills its own page then).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap, between operations on it.
    #[cold]
    #[inline(never)]
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn alloc_shared(heap: *mut Heap, class: usize, state: &State, node: usize) -> *mut u8 {
        let arena = state.node_arena(node);
        let mut g = arena.shared.lock();
        // SAFETY: `g` is the shared heap's lock, held.
        let p = unsafe { Heap::alloc_locked(&mut g, state, arena.node, class) };
        drop(g);
        if !p.is_null() {
            // SAFETY: the caller's heap, between operations on it.
            unsafe { (*heap).sparse[class] += 1 };
        }
        p
    }
}
