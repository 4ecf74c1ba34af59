//! Giving back what a heap holds free: its free caches' blocks to their
//! pages, its kept and empty pages to their arenas, the free blocks of its
//! pages in use to the OS; and *arming*, which empties the direct slots
//! so that each class's next allocation refills. The lifecycle
//! (`lifecycle/`) decides when: a quiet heap's decay, a trim, an exited
//! thread's heap reclaimed; a free's page event arms while something is
//! due. These are its mechanisms, on one heap.

use core::ptr;

use super::{Heap, empty_page};
use super::{link, next_of, page_span};
use crate::alloc::engine::size_class::CLASSES;
use crate::alloc::engine::types::{Block, ClassSet, Decay, Page, State};
use crate::hardened::HARDENED;
use crate::sync::Ordering;

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

    /// Gives back to the OS the memory of `page`'s free blocks, once until
    /// the page serves again or more of its blocks are freed, and of its
    /// uncarved tail (which a page made of a free page's slots may hold
    /// resident from an earlier class), once for the page's life:
    /// a page that random frees left partly used, of a class the program
    /// no longer asks for, does not keep its free blocks resident. Their
    /// memory reads as zeroes when handed out again, faulted in on the
    /// node its range is bound to. Not in hardened builds (the poison of
    /// `NUMAWEAVE_CHECK=full` fills a free block).
    ///
    /// A page of at most 64 blocks (blocks of 1 KiB and more) gives back
    /// every OS page that only free blocks, its tail and its colour's gap
    /// cover, link pages too: a free block whose link would be lost leaves
    /// the list for the page's `purged_free` mask, which [`carve`] links
    /// again before the tail (lowest first). Other pages give back their
    /// tail only: an OS page of blocks below 1 KiB holds at least four,
    /// which random frees seldom leave all free.
    ///
    /// # Safety
    /// `page` is a live page of the caller's heap (or of a claimed one).
    ///
    /// [`carve`]: super::pop::carve
    #[cold]
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn purge_free_blocks(page: *mut Page) {
        if HARDENED {
            // A hardened build keeps freed blocks' contents (the poison
            // a use after free is found by), so purges none.
            return;
        }
        // SAFETY: owner-only fields of a live page of the caller's (its
        // word); the ranges given back hold only free blocks' memory, the
        // never handed out tail and the colour's gap, which no one reads
        // but through the links this rewrites.
        unsafe {
            // Once, until it serves again or more of its blocks are freed.
            if (*page).used.get() >= (*page).purged_used {
                return;
            }
            (*page).purged_used = (*page).used.get();
            let os_page = crate::os::page_size();
            let bs = (*page).info.block_size as usize;
            let start = (*page).info.start as usize;
            let span = page_span(page);
            let cap = (*page).info.capacity as usize;
            let carved = (*page).carved.get() as usize;
            let decommit = |from: usize, to: usize| {
                #[cfg(test)]
                DECOMMITS.with(|n| n.set(n.get() + u64::from(from < to)));
                from < to
                    && crate::os::mem::decommit(core::ptr::NonNull::new_unchecked(from as *mut u8), to - from).is_ok()
            };
            // The uncarved tail, from its first whole OS page: given back
            // once (it is not written after: `tail_clean`).
            let tail = (start + carved * bs).next_multiple_of(os_page).min(span.end);
            if cap > MASKED_BLOCKS || span.len() / os_page > 64 {
                if !(*page).tail_clean {
                    (*page).tail_clean = decommit(tail, span.end) || tail == span.end;
                }
                return;
            }
            // The free blocks: listed, masked before, never carved.
            let upto = |n: usize| if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
            let mut listed = 0u64;
            let mut b = (*page).free;
            while !b.is_null() {
                let i = (b as usize - start) / bs;
                debug_assert!(i < carved && (b as usize - start).is_multiple_of(bs) && listed & (1 << i) == 0);
                listed |= 1 << i;
                b = next_of(page, b);
            }
            let masked = (*page).purged_free.get();
            debug_assert!(masked & listed == 0 && masked & !upto(carved) == 0);
            let free = listed | masked | (upto(cap) & !upto(carved));
            // Each OS page of the span (the gap before `start` and the
            // bytes past the last block are no block's): given back when
            // every block it touches is free.
            // (`fresh`: those a listed block touches, whose memory its
            // free left resident; the others went at an earlier purge, or
            // are the tail and the gap, and count in no `returned`.)
            let (mut gone, mut fresh) = (0u64, 0u64);
            for k in 0..span.len() / os_page {
                let (lo, hi) = (span.start + k * os_page, span.start + (k + 1) * os_page);
                if hi <= start || lo >= start + cap * bs {
                    gone |= 1 << k;
                    continue;
                }
                let first = lo.saturating_sub(start) / bs;
                let last = ((hi - 1 - start) / bs).min(cap - 1);
                let touched = upto(last + 1) & !upto(first);
                if free & touched == touched {
                    gone |= 1 << k;
                    if listed & touched != 0 {
                        fresh |= 1 << k;
                    }
                }
            }
            // (A tail given back before holds no memory.)
            if (*page).tail_clean {
                let first = (tail - span.start) / os_page;
                gone &= if first >= 64 { u64::MAX } else { (1u64 << first) - 1 };
            }
            // In runs: one `madvise` for each.
            let (mut k, mut given, mut all) = (0, 0u64, true);
            while k < 64 {
                if gone & (1 << k) == 0 {
                    k += 1;
                    continue;
                }
                let run = (gone >> k).trailing_ones() as usize;
                if decommit(span.start + k * os_page, span.start + (k + run) * os_page) {
                    let in_run = if run == 64 { u64::MAX } else { ((1u64 << run) - 1) << k };
                    given += u64::from((fresh & in_run).count_ones()) * os_page as u64;
                } else {
                    all = false;
                }
                k += run;
            }
            // (Every OS page from `tail` on is gone: only never-carved
            // blocks and the bytes past the last one lie there.)
            (*page).tail_clean |= all;
            if let Some(state) = State::try_get() {
                let arena = &state.arenas[usize::from((*page).info.node)];
                arena.counters.purged.fetch_add(given, Ordering::Relaxed);
            }
            // Listed blocks whose link page went leave the list; the others
            // are linked again, lowest address first.
            let mut head: *mut Block = core::ptr::null_mut();
            let mut moved = 0u64;
            for i in (0..carved).rev().filter(|&i| listed & (1 << i) != 0) {
                let at = start + i * bs;
                if gone & (1 << ((at - span.start) / os_page)) != 0 {
                    moved |= 1 << i;
                } else {
                    let block = at as *mut Block;
                    (*block).next = link(page, head);
                    head = block;
                }
            }
            (*page).free = head;
            (*page).purged_free.set(masked | moved);
        }
    }
}

#[cfg(test)]
std::thread_local! {
    /// The ranges [`Heap::purge_free_blocks`] gave back on this thread.
    pub(crate) static DECOMMITS: core::cell::Cell<u64> = const { core::cell::Cell::new(0) };
}

/// Pages of at most this many blocks are purged block by block (a bit
/// each in `Page::purged_free`).
pub(crate) const MASKED_BLOCKS: usize = 64;
