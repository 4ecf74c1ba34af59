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
use crate::alloc::engine::size_class::{CLASSES, MASKED_BLOCKS, starting_in};
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
    /// Every OS page that only free blocks, the tail and the colour's gap
    /// cover goes back, link pages too: a free block whose link would be
    /// lost leaves the list for the page's `purged_free` mask, which
    /// [`carve`] links again before the tail (lowest first). On a page of
    /// at most [`MASKED_BLOCKS`] (blocks of 1 KiB and more) the mask has a
    /// bit a block; on the others a bit an OS page, for the blocks that
    /// start in it ([`starting_in`]): Robson's pattern (free every other
    /// block, again each round) leaves whole OS pages of small blocks free
    /// that random frees seldom do. Pages of more than 64 OS pages give
    /// back their tail only.
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
            let span = page_span(page);
            let g = Blocks::of(page, &span);
            let os_page = g.os_page;
            // The uncarved tail, from its first whole OS page: given back
            // once (it is not written after: `tail_clean`).
            let tail = (g.start + g.carved * g.bs).next_multiple_of(os_page).min(span.end);
            if g.os_pages() > 64 {
                if !(*page).tail_clean {
                    (*page).tail_clean = decommit(tail, span.end) || tail == span.end;
                }
                return;
            }
            // Each OS page of the span goes (`gone`) when every block it
            // touches is free: listed, masked before, or never carved (the
            // gap before `start` and the bytes past the last block are no
            // block's). `fresh`: those a listed block touches, whose memory
            // its free left resident; the others went at an earlier purge,
            // or are the tail and the gap, and count in no `purged`.
            // (`listed`: the listed blocks, a bit each, on a page masked so.)
            let (mut gone, fresh, listed) = if g.cap <= MASKED_BLOCKS {
                free_pages_by_block(page, &g)
            } else {
                let (gone, fresh) = free_pages_by_os_page(page, &g);
                (gone, fresh, 0)
            };
            // (A tail given back before holds no memory.)
            if (*page).tail_clean {
                let first = (tail - span.start) / os_page;
                gone &= if first >= 64 { u64::MAX } else { (1u64 << first) - 1 };
            }
            // An OS page masked before went at that purge (or, refused,
            // stays resident, its blocks masked all the same): not again.
            let went = if g.cap > MASKED_BLOCKS { (*page).purged_free.get() } else { 0 };
            // Listed blocks whose link page goes leave the list, for the
            // mask; before the `madvise`, which takes their links.
            unlist_gone(page, &g, gone, listed);
            let gone = gone & !went;
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
        }
    }
}

/// Gives back `from..to` (empty: nothing); whether it went.
///
/// # Safety
/// The range lies in a page's span and holds no byte anyone reads but
/// through links the caller rewrites.
unsafe fn decommit(from: usize, to: usize) -> bool {
    #[cfg(test)]
    DECOMMITS.with(|n| n.set(n.get() + u64::from(from < to)));
    if from >= to {
        return false;
    }
    // SAFETY: `from` is in a span, so not null; no one reads the range's
    // contents again (the caller's word), so they may read as zeroes.
    unsafe { crate::os::mem::decommit(core::ptr::NonNull::new_unchecked(from as *mut u8), to - from) }.is_ok()
}

/// A page's blocks as a purge sees them: where they lie in the span.
struct Blocks {
    /// The span's start and length.
    base: usize,
    span_len: usize,
    /// The first block's.
    start: usize,
    /// A block's size.
    bs: usize,
    /// The page's blocks, and those carved.
    cap: usize,
    carved: usize,
    os_page: usize,
}

impl Blocks {
    /// Where `page`'s blocks lie, its `carved` as it is now.
    ///
    /// # Safety
    /// `page` is a live page of the caller's, `span` its span.
    unsafe fn of(page: *mut Page, span: &core::ops::Range<usize>) -> Blocks {
        // SAFETY: owner-only fields of the caller's live page (its word).
        unsafe {
            Blocks {
                base: span.start,
                span_len: span.len(),
                start: (*page).info.start as usize,
                bs: (*page).info.block_size as usize,
                cap: (*page).info.capacity as usize,
                carved: (*page).carved.get() as usize,
                os_page: crate::os::page_size(),
            }
        }
    }

    /// The blocks that touch OS page `k` of the span (`first..=last`), or
    /// none (the gap before the first block, the bytes past the last).
    fn touching(&self, k: usize) -> Option<(usize, usize)> {
        let (lo, hi) = (self.base + k * self.os_page, self.base + (k + 1) * self.os_page);
        if hi <= self.start || lo >= self.start + self.cap * self.bs {
            return None;
        }
        Some((lo.saturating_sub(self.start) / self.bs, ((hi - 1 - self.start) / self.bs).min(self.cap - 1)))
    }

    /// OS pages in the span.
    fn os_pages(&self) -> usize {
        self.span_len / self.os_page
    }

    /// The index of `b`, a block of the page's.
    fn index(&self, b: *mut Block) -> usize {
        let at = b as usize - self.start;
        debug_assert!(at.is_multiple_of(self.bs) && at / self.bs < self.carved, "a free block never carved");
        at / self.bs
    }
}

/// The OS pages of its span (at most 64) that only free blocks of `page`,
/// a page of at most [`MASKED_BLOCKS`], cover, those of them a listed
/// block touches, and the listed blocks (`(gone, fresh, listed)`): a bit
/// a block.
///
/// # Safety
/// `page` is a live page of the caller's, `g` its blocks.
#[cold]
#[inline(never)]
unsafe fn free_pages_by_block(page: *mut Page, g: &Blocks) -> (u64, u64, u64) {
    // SAFETY: owner-only fields of the caller's live page (its word); its
    // list holds free blocks of it, each once.
    unsafe {
        let upto = |n: usize| if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
        let mut listed = 0u64;
        let mut b = (*page).free;
        while !b.is_null() {
            let i = g.index(b);
            debug_assert!(listed & (1 << i) == 0, "a block listed twice");
            listed |= 1 << i;
            b = next_of(page, b);
        }
        let masked = (*page).purged_free.get();
        debug_assert!(masked & listed == 0 && masked & !upto(g.carved) == 0);
        let free = listed | masked | (upto(g.cap) & !upto(g.carved));
        let (mut gone, mut fresh) = (0u64, 0u64);
        for k in 0..g.os_pages() {
            let Some((first, last)) = g.touching(k) else {
                gone |= 1 << k;
                continue;
            };
            let touched = upto(last + 1) & !upto(first);
            if free & touched == touched {
                gone |= 1 << k;
                if listed & touched != 0 {
                    fresh |= 1 << k;
                }
            }
        }
        (gone, fresh, listed)
    }
}

/// As [`free_pages_by_block`], for a page of more blocks, whose mask has
/// a bit an OS page: counts, for each OS page, the free blocks that touch
/// it against all the blocks that do.
///
/// # Safety
/// As [`free_pages_by_block`].
#[cold]
#[inline(never)]
unsafe fn free_pages_by_os_page(page: *mut Page, g: &Blocks) -> (u64, u64) {
    // SAFETY: as `free_pages_by_block`.
    unsafe {
        // The OS pages block `i` touches.
        let touches = |i: usize| {
            let at = g.start + i * g.bs - g.base;
            at / g.os_page..=(at + g.bs - 1) / g.os_page
        };
        let mut free = [0u32; 64];
        let mut fresh = 0u64;
        let mut b = (*page).free;
        let mut n = 0;
        while !b.is_null() {
            n += 1;
            debug_assert!(n <= g.carved, "a free list longer than the blocks carved");
            for k in touches(g.index(b)) {
                free[k] += 1;
                fresh |= 1 << k;
            }
            b = next_of(page, b);
        }
        let mut masked = (*page).purged_free.get();
        while masked != 0 {
            for i in starting_in(masked.trailing_zeros() as usize, g.start - g.base, g.bs, g.carved) {
                for k in touches(i) {
                    free[k] += 1;
                }
            }
            masked &= masked - 1;
        }
        let mut gone = 0u64;
        for (k, &free) in free.iter().enumerate().take(g.os_pages()) {
            let Some((first, last)) = g.touching(k) else {
                gone |= 1 << k;
                continue;
            };
            // The never carved blocks among those that touch it.
            let uncarved = (last + 1).saturating_sub(first.max(g.carved));
            debug_assert!(free as usize + uncarved <= last + 1 - first, "a block counted free twice");
            if free as usize + uncarved == last + 1 - first {
                gone |= 1 << k;
            }
        }
        (gone, fresh & gone)
    }
}

/// Takes off `page`'s list the blocks whose link lies in a `gone` OS page
/// of the span and masks them (`Page::purged_free`); the others stay
/// linked, lowest address first on a page of at most [`MASKED_BLOCKS`]
/// (whose listed blocks `listed` has, a bit each), in their order on the
/// others.
///
/// # Safety
/// `page` is a live page of the caller's, `g` its blocks; every OS page in
/// `gone` holds only free blocks' memory, and is still resident or reads
/// as zeroes only where no listed block's link lies.
#[cold]
#[inline(never)]
unsafe fn unlist_gone(page: *mut Page, g: &Blocks, gone: u64, listed: u64) {
    // SAFETY: owner-only fields of the caller's live page; the links read
    // are those of its listed free blocks, still in place (the caller's
    // word), and those written are of blocks it keeps listed.
    unsafe {
        let page_of = |b: *mut Block| (b as usize - g.base) / g.os_page;
        let goes = |b: *mut Block| gone & (1 << page_of(b)) != 0;
        let masked = (*page).purged_free.get();
        if g.cap <= MASKED_BLOCKS {
            let mut head: *mut Block = ptr::null_mut();
            let mut moved = 0u64;
            for i in (0..64).rev().filter(|&i| listed & (1 << i) != 0) {
                let block = (g.start + i * g.bs) as *mut Block;
                if goes(block) {
                    moved |= 1 << i;
                } else {
                    (*block).next = link(page, head);
                    head = block;
                }
            }
            (*page).free = head;
            (*page).purged_free.set(masked | moved);
            return;
        }
        let (mut head, mut last): (*mut Block, *mut Block) = (ptr::null_mut(), ptr::null_mut());
        let mut moved = 0u64;
        let mut b = (*page).free;
        while !b.is_null() {
            let next = next_of(page, b);
            if goes(b) {
                moved |= 1 << page_of(b);
            } else {
                if last.is_null() {
                    head = b;
                } else {
                    (*last).next = link(page, b);
                }
                last = b;
            }
            b = next;
        }
        if !last.is_null() {
            (*last).next = link(page, ptr::null_mut());
        }
        (*page).free = head;
        (*page).purged_free.set(masked | moved);
    }
}

#[cfg(test)]
std::thread_local! {
    /// The ranges [`Heap::purge_free_blocks`] gave back on this thread.
    pub(crate) static DECOMMITS: core::cell::Cell<u64> = const { core::cell::Cell::new(0) };
}
