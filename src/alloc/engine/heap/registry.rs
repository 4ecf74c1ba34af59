//! The registry of heaps: a heap made (its descriptor from the metadata
//! chunks, listed among every heap), the walk over every heap for
//! statistics, and a heap's direct slots cleared (a placement change).

use core::ptr;

use super::{Heap, empty_page};
use crate::alloc::engine::arena::alloc_meta;
use crate::alloc::engine::size_class::{CLASSES, class_size};
use crate::alloc::engine::types::{HeapCounters, HeapLife, Loan, OWNER_SHARED, OWNER_THREAD, PageList, State};
use crate::sync::{AtomicBool, AtomicStack, AtomicU64, CachePadded, Ordering};

impl Heap {
    /// Points every class at the empty page, so that the next allocation of
    /// each goes through a refill (under whatever placement is in force then).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) unsafe fn clear_direct(heap: *mut Heap) {
        // SAFETY: `heap` is the calling thread's heap (the caller's word), as `end_loan` and
        // `set_direct` ask; the pages it held stay on the heap's lists.
        unsafe {
            Heap::end_loan(heap);
            for class in 0..CLASSES {
                Heap::set_direct(heap, class, empty_page());
                (*heap).cache_serves[class] = false;
            }
        }
    }
}

impl Heap {
    /// A new heap on `node`'s arena, owned as `owner` says, listed for the
    /// statistics; `None` when the OS refuses the memory for its
    /// descriptor.
    #[cold]
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) fn make(state: &State, node: usize, owner: u64) -> Option<*mut Heap> {
        // On a page of its own: the fields every heap touches fill its
        // first two pages, and the free caches after them are touched class
        // by class (a heap across a page boundary touched a page more at
        // each end: 18 KiB a thread that made one allocation, 7 KiB now).
        let align = core::mem::align_of::<Heap>().max(crate::os::page_size());
        let p = alloc_meta(state, core::mem::size_of::<Heap>(), align)?;
        let h = p.as_ptr().cast::<Heap>();
        // SAFETY: fresh, suitably aligned metadata memory.
        unsafe {
            // Field by field, in place: the free caches make the heap
            // 24 KiB, more than a value on a small thread's stack should be.
            (&raw mut (*h).direct).write([empty_page(); CLASSES]);
            (&raw mut (*h).counters).write(HeapCounters::new());
            (&raw mut (*h).lists).write([PageList { head: ptr::null_mut(), tail: ptr::null_mut() }; CLASSES]);
            (&raw mut (*h).kept_empty).write([ptr::null_mut(); CLASSES]);
            (&raw mut (*h).refills).write(0);
            (&raw mut (*h).last_refill).write([0; CLASSES]);
            (&raw mut (*h).node).write(node);
            (&raw mut (*h).loan).write(Loan { page: ptr::null_mut(), class: 0, used0: 0 });
            (&raw mut (*h).next_all).write(ptr::null_mut());
            (&raw mut (*h).next_orphan).write(ptr::null_mut());
            (&raw mut (*h).owned).write(AtomicU64::new(owner));
            (&raw mut (*h).policy).write(ptr::null());
            (&raw mut (*h).pending).write(ptr::null_mut());
            (&raw mut (*h).remote_pages).write(CachePadded(AtomicStack::new()));
            (&raw mut (*h).cache_serves).write([false; CLASSES]);
            (&raw mut (*h).cache_src).write([ptr::null_mut(); CLASSES]);
            (&raw mut (*h).cache_seen).write([0; CLASSES]);
            (&raw mut (*h).cache_filled_at).write([0; CLASSES]);
            (&raw mut (*h).sparse).write([0; CLASSES]);
            (&raw mut (*h).cpu_served).write(AtomicBool::new(false));
            (&raw mut (*h).life).write(HeapLife::new());
            // (The free caches are written when the heap takes its first
            // page of their class, `Heap::sink_for`: the metadata chunk's
            // fresh memory reads as zeroes, an empty cache of no heap.)
            let mut all = state.heaps.lock();
            (*h).next_all = *all;
            *all = h;
        }
        Some(h)
    }
}

/// A heap as the statistics see it while its owner works on it: only its
/// atomics and the fields fixed when it was made are read, through a raw
/// pointer (a `&Heap` would claim its slots, lists and caches unchanging
/// while the owner writes them).
#[derive(Clone, Copy)]
pub(crate) struct HeapView(*const Heap);

impl HeapView {
    /// The view of `h` (tests; the statistics get theirs from
    /// `for_each_heap`).
    ///
    /// # Safety
    /// `h` is a heap made by `Heap::make` (heaps are never freed).
    #[cfg(test)]
    pub(crate) unsafe fn of(h: *const Heap) -> Self {
        Self(h)
    }

    /// Owned by a live thread.
    pub(crate) fn is_owned(self) -> bool {
        // SAFETY: a live heap (never freed); `owned` is an atomic.
        unsafe { (*self.0).owned.load(Ordering::Relaxed) == OWNER_THREAD }
    }

    /// A node's shared heap.
    pub(crate) fn is_shared(self) -> bool {
        // SAFETY: as in `is_owned`.
        unsafe { (*self.0).owned.load(Ordering::Relaxed) == OWNER_SHARED }
    }

    /// The heap's node and (allocs, frees, bytes allocated, bytes freed,
    /// remote frees).
    pub(crate) fn node_and_counters(self) -> (usize, (u64, u64, u64, u64, u64)) {
        // SAFETY: a live heap; `node` is written once, before the heap is
        // published under the registry lock, and `counters` are atomics.
        unsafe { ((*self.0).node, (*self.0).counters.sums()) }
    }

    /// Bytes of the pages the heap holds.
    pub(crate) fn held_bytes(self) -> u64 {
        // SAFETY: a live heap; `page_bytes` is an atomic.
        unsafe { (*self.0).life.page_bytes.load(Ordering::Relaxed) }
    }
}

/// Heaps for stats: every heap ever made.
pub(crate) fn for_each_heap(state: &State, mut f: impl FnMut(HeapView)) {
    let mut h = *state.heaps.lock();
    while !h.is_null() {
        // SAFETY: heaps are never freed; `next_all` is written once, under the
        // registry lock, before the heap is published.
        unsafe {
            f(HeapView(h));
            h = (*h).next_all;
        }
    }
}

impl HeapCounters {
    /// Allocations of every class.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) fn allocs_total(&self) -> u64 {
        self.allocs.iter().fold(0u64, |s, a| s.wrapping_add(a.load(Ordering::Relaxed)))
    }

    /// (allocations, frees, bytes allocated, bytes freed, remote frees), summed over the classes.
    pub(crate) fn sums(&self) -> (u64, u64, u64, u64, u64) {
        let ld = |x: &AtomicU64| x.load(Ordering::Relaxed);
        let mut s = (0u64, ld(&self.frees), 0u64, ld(&self.bytes_freed), ld(&self.remote_frees));
        for class in 0..CLASSES {
            let a = ld(&self.allocs[class]);
            s.0 = s.0.wrapping_add(a);
            s.2 = s.2.wrapping_add(a.wrapping_mul(class_size(class) as u64));
        }
        s
    }
}
