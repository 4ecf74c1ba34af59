//! Giving back what a heap holds free: its free caches' blocks to their
//! pages, its kept and empty pages to their arenas, the free blocks of its
//! pages in use to the OS; and *arming*, which empties the direct slots
//! so that each class's next allocation refills. The lifecycle
//! (`lifecycle/`) decides when: a quiet heap's decay, a trim, an exited
//! thread's heap reclaimed; a free's page event arms while something is
//! due. These are its mechanisms, on one heap.

use core::ptr;

use super::{Heap, empty_page};
use super::{next_of, page_span};
use crate::alloc::engine::size_class::CLASSES;
use crate::alloc::engine::types::{ClassSet, Decay, Page, State};
use crate::hardened::HARDENED;

impl Heap {
    /// Empties the heap's direct slots (but a lent one) while something is
    /// due, at most once per clock tick: each class's next allocation
    /// refills and so looks at the clock (see `lifecycle/decay.rs`). Called
    /// where no operation on the heap is under way: after a refill served,
    /// at the end of a free's page event, after a free into an exited
    /// thread's page.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap, between operations on it.
    #[inline]
    pub(crate) unsafe fn arm(heap: *mut Heap, state: &State) {
        #[cfg(test)]
        // SAFETY: `heap` is the calling thread's heap (the caller's word): its lifecycle is ours.
        if unsafe { (*heap).life.steady } {
            return;
        }
        if state.life.pending() {
            let now = crate::os::monotonic_ms();
            // SAFETY: `heap` is the calling thread's heap, between operations on it (the
            // caller's word): its lifecycle fields and slots are ours, as `arm_at` asks.
            unsafe {
                let life = &mut (*heap).life;
                if life.event_armed_at == now {
                    return;
                }
                life.event_armed_at = now;
                // Even if a refill armed in this tick: it may have filled a
                // busy class's slot since.
                life.armed_at = 0;
                Heap::arm_at(heap, now);
            }
        }
    }

    /// [`arm`](Self::arm) at `now` (ms), something being due.
    ///
    /// # Safety
    /// As [`arm`](Self::arm).
    #[cold]
    #[inline(never)]
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) unsafe fn arm_at(heap: *mut Heap, now: u64) {
        // SAFETY: `heap` is the calling thread's heap, between operations on it (the caller's
        // word): its lifecycle fields and direct slots are ours to change.
        unsafe {
            if (*heap).life.armed_at == now {
                return;
            }
            (*heap).life.armed_at = now;
            if (*heap).life.decay == Decay::Busy {
                (*heap).life.set(Decay::Listening);
            }
            // Busy is counted again from here: a thread that frees a burst
            // and goes quiet within the tick of its last allocations
            // would otherwise find those classes busy still.
            (*heap).life.class_refills = [0; CLASSES];
            for class in 0..CLASSES {
                if !Heap::is_lent(heap, class) {
                    Heap::set_direct(heap, class, empty_page());
                    (*heap).cache_serves[class] = false;
                }
            }
        }
    }

    /// Gives back what the heap holds free, for the classes in `classes`:
    /// their free caches' blocks to their pages, their kept pages and every
    /// page left empty (remote frees collected first, for all classes) to
    /// their arenas; their direct slots are emptied (but a lent one), so
    /// that the next allocation of each refills. With `purge_blocks`
    /// false the free blocks of pages still in use stay resident (a thread
    /// that exits or adopts: the next thread of the node most likely takes
    /// those pages again; the lifecycle purges them once they waited out
    /// the delay).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap, between operations on it (or
    /// an exited thread's, claimed; or a shared heap, under its lock).
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) unsafe fn give_back_free_as(heap: *mut Heap, purge_blocks: bool, classes: ClassSet) {
        let given = |class: usize| classes & (1 << class) != 0;
        // SAFETY: the heap is ours alone, between operations (the calling thread's, a claimed
        // exited one, or a shared one under its lock: the caller's word), so its slots,
        // caches and lists may change.
        unsafe {
            for class in (0..CLASSES).filter(|&c| given(c)) {
                if !Heap::is_lent(heap, class) {
                    Heap::set_direct(heap, class, empty_page());
                    (*heap).cache_serves[class] = false;
                }
                if !(*Heap::cache_page(heap, class)).free.is_null() {
                    Heap::flush_cache(heap, class, 0, false);
                }
                Heap::set_cache_src(heap, class, ptr::null_mut());
            }
            Heap::gather_remote(heap);
            while !(*heap).pending.is_null() {
                Heap::take_remote(heap, (*heap).pending, true);
            }
            for class in (0..CLASSES).filter(|&c| given(c)) {
                (*heap).kept_empty[class] = ptr::null_mut();
                let mut p = (*heap).lists[class].head;
                while !p.is_null() {
                    let next = (*p).next;
                    if (*p).used.get() == 0 && (*heap).direct[class] != p {
                        (*heap).release_page(p);
                    } else if purge_blocks {
                        Heap::purge_free_blocks(p);
                    }
                    p = next;
                }
            }
        }
    }

    /// Gives back to the OS the memory of `page`'s free blocks (every whole
    /// OS page of a block past the one that holds its link) and of its
    /// uncarved tail (which a page made of a free page's slots may hold
    /// resident from an earlier class), once until the page serves again:
    /// a page that random frees left partly used, of a class the program
    /// no longer asks for, does not keep its free blocks resident. Their
    /// memory reads as zeroes when handed out again, faulted in on the
    /// node its range is bound to. Not in hardened builds (the poison of
    /// `NUMAWEAVE_CHECK=full` fills a free block).
    ///
    /// # Safety
    /// `page` is a live page of the caller's heap (or of a claimed one).
    #[cold]
    unsafe fn purge_free_blocks(page: *mut Page) {
        if HARDENED {
            // A hardened build keeps freed blocks' contents (the poison
            // a use after free is found by), so purges none.
            return;
        }
        // SAFETY: owner-only fields of a live page of the caller's; the
        // ranges purged are free blocks' memory past their links, and the
        // page's never handed out tail, which no one reads.
        unsafe {
            if (*page).purged {
                return;
            }
            (*page).purged = true;
            let os_page = crate::os::page_size();
            let bs = (*page).info.block_size as usize;
            let start = (*page).info.start as usize;
            let end = page_span(page).end;
            let purge = |from: usize, to: usize| {
                let (a, b) = (from.next_multiple_of(os_page), to & !(os_page - 1));
                if a < b {
                    let _ = crate::os::mem::decommit(core::ptr::NonNull::new_unchecked(a as *mut u8), b - a);
                }
            };
            purge(start + (*page).carved.get() as usize * bs, end);
            if bs > os_page {
                let mut b = (*page).free;
                while !b.is_null() {
                    // (Past the link: the first word stays.)
                    purge(b as usize + core::mem::size_of::<usize>(), b as usize + bs);
                    b = next_of(page, b);
                }
            }
        }
    }
}
