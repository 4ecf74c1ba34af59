//! The pop: a block from the direct page (the fast path), and the refill
//! that finds the direct page a replacement under a [`Placement`] when it
//! runs dry: the heap's pages of the class that the placement accepts
//! (remote frees taken, more blocks carved), else a fresh page of the
//! arena it names.

use core::ptr::{self, NonNull};

use super::{
    CACHING, EXPIRE_EVERY, Heap, Placement, bump, empty_page, in_page, link, lists_dropped, next_of, no_heap, node_of,
    page_bytes, page_span, served,
};
use super::{corrupted_list, kind_of, outside};
use crate::alloc::engine::segment::{self, segment_of};
use crate::alloc::engine::size_class::{CLASSES, MASKED_BLOCKS, starting_in};
use crate::alloc::engine::types::Arena;
use crate::alloc::engine::types::{Block, Page, SmallSegment, State};
use crate::hardened::{self, HARDENED};
use crate::sync::Ordering;
use crate::topology::NodeSet;

/// How much of a page's untouched tail one [`carve`] puts on its free list:
/// one OS page's worth, as mimalloc extends its free lists
/// (`MI_MAX_EXTEND_SIZE`). Every carved block has its link written, so its
/// memory is resident from then on; a page whose class goes quiet keeps at
/// most this much touched beyond what it used. (16 KiB before 2026-12-01:
/// lua's peak RSS 0.2–0.3 MB higher, python3's 0.3 MB, for 0.1% fewer
/// instructions on the C churn.)
pub(super) const CARVE_BYTES: usize = 4 * 1024;

impl Heap {
    /// A block of class `class` from the direct page, or null when it has
    /// none (the caller then refills, or, from [`no_heap`], makes the
    /// thread's heap): the fast path.
    ///
    /// # Safety
    /// `heap` must be the calling thread's heap or [`no_heap`]; `class <
    /// CLASSES`.
    #[inline(always)]
    pub(crate) unsafe fn pop(heap: *mut Heap, class: usize) -> *mut u8 {
        // SAFETY: the caller's heap and a class below CLASSES, as `pop_as` needs.
        unsafe { Heap::pop_as::<true>(heap, class) }
    }

    /// [`pop`](Self::pop) once the caller found `NUMAWEAVE_CHECK=full` off
    /// (hardened builds; the same as `pop` in others).
    ///
    /// # Safety
    /// As [`pop`](Self::pop).
    #[inline(always)]
    pub(crate) unsafe fn pop_checked_off(heap: *mut Heap, class: usize) -> *mut u8 {
        // SAFETY: as in `pop`: the caller's heap, a class below CLASSES.
        unsafe { Heap::pop_as::<false>(heap, class) }
    }

    /// [`pop`](Self::pop), looking whether `NUMAWEAVE_CHECK=full` is on only
    /// with `LOOK_FULL` (hardened builds): `pop_as::<false>` is
    /// [`pop_checked_off`](Self::pop_checked_off).
    ///
    /// # Safety
    /// As [`pop`](Self::pop); without `LOOK_FULL`, as
    /// [`pop_checked_off`](Self::pop_checked_off).
    #[inline(always)]
    pub(crate) unsafe fn pop_as<const LOOK_FULL: bool>(heap: *mut Heap, class: usize) -> *mut u8 {
        debug_assert!(class < CLASSES);
        // SAFETY: the heap is this thread's, or `NO_HEAP`, whose `direct`
        // (all that is read of it: the empty page's list is empty) is an
        // array of CLASSES pages too; `class < CLASSES` by contract.
        unsafe {
            let page = *(*heap).direct.get_unchecked(class);
            let block = (*page).free;
            if block.is_null() {
                return ptr::null_mut();
            }
            debug_assert!(heap != no_heap(), "NO_HEAP's pages have no block");
            // A hardened build's checks that may report or need more than
            // this path finish the pop out of line (tail calls: `malloc`
            // keeps no stack frame). The head first: it is read next.
            if HARDENED && outside(page, block) {
                return Heap::pop_corrupt(page, block);
            }
            debug_assert!(
                Heap::is_lent(heap, class)
                    || Heap::is_cache(heap, page)
                    || (in_page(page, block.cast()) && usize::from((*page).info.class) == class),
                "a direct page of another class, or a free list that left its page"
            );
            debug_assert!(
                Heap::is_lent(heap, class) || (*page).info.heap.load(Ordering::Relaxed) == heap,
                "a direct page of another heap"
            );
            if HARDENED && LOOK_FULL && hardened::full_now() {
                return Heap::pop_full(heap, page, block, class).as_ptr();
            }
            Heap::pop_not_full(heap, page, block, class)
        }
    }

    /// The rest of a pop of `block`, the head of `page`'s free list, with
    /// `NUMAWEAVE_CHECK=full` off.
    ///
    /// # Safety
    /// As [`take`](Self::take).
    #[inline(always)]
    pub(super) unsafe fn pop_not_full(heap: *mut Heap, page: *mut Page, block: *mut Block, class: usize) -> *mut u8 {
        // SAFETY: `block` is the head of `page`'s free list, so a free block of
        // the page whose first word is its link; the heap and page are the
        // caller's (what `take` needs).
        unsafe {
            // (A hardened build checks the link it reads when it is the
            // head: before the next pop reads through it.)
            if HARDENED {
                let next = hardened::decode((*block).next, (*page).info.key);
                hardened::handing_out_plain(block.cast());
                Heap::take(heap, page, block, next, class)
            } else {
                Heap::take(heap, page, block, next_of(page, block), class)
            }
        }
    }

    /// The end of a pop: `block`, the head of `page`'s free list, handed
    /// out; `next` the list's new head; `class` the direct slot's (counted
    /// there: a loan's blocks leave the count with [`end_loan`](Self::end_loan)).
    ///
    /// # Safety
    /// As [`pop`](Self::pop); `block` is `page`'s first free block; `class <
    /// CLASSES`.
    #[inline(always)]
    pub(super) unsafe fn take(
        heap: *mut Heap,
        page: *mut Page,
        block: *mut Block,
        next: *mut Block,
        class: usize,
    ) -> *mut u8 {
        // SAFETY: the page's `free` and `used` are written only by the
        // thread whose heap holds it (its owner, or the borrower of a loan),
        // and the heap's counters only by the heap's thread: the caller;
        // `block` leaves the list here and `next` was its link; the counter
        // is in bounds (`class < CLASSES`).
        unsafe {
            debug_assert!(class < CLASSES);
            (*page).free = next;
            super::links::prefetch(next);
            (*page).used.add(1);
            bump((*heap).counters.allocs.get_unchecked(class), 1);
        }
        block.cast()
    }

    /// A hardened pop under `NUMAWEAVE_CHECK=full`: the block's poison
    /// checked (write after free) before it is handed out. (Not null, and
    /// typed so: the caller's null test folds, the call stays a tail call.)
    ///
    /// # Safety
    /// As [`take`](Self::take).
    #[cold]
    #[inline(never)]
    pub(super) unsafe fn pop_full(heap: *mut Heap, page: *mut Page, block: *mut Block, class: usize) -> NonNull<u8> {
        // SAFETY: `block` is `page`'s first free block, `class < CLASSES` and the heap is
        // this thread's (`take`'s terms, the caller's word); a free block is not null.
        unsafe {
            hardened::handing_out(block.cast(), || kind_of(page));
            NonNull::new_unchecked(Heap::take(heap, page, block, next_of(page, block), class))
        }
    }

    /// A hardened pop whose head, `block`, lies outside its page: a
    /// corrupted list (a free block's link overwritten), reported. Null:
    /// under `NUMAWEAVE_ON_ERROR=report` the list is dropped (its blocks
    /// leaked) and the caller looks further (`malloc` its slow path, which
    /// refills the page or takes another; the slow paths the next page).
    ///
    /// # Safety
    /// As [`take`](Self::take), `block` unread.
    #[cold]
    #[inline(never)]
    pub(super) unsafe fn pop_corrupt(page: *mut Page, block: *mut Block) -> *mut u8 {
        // SAFETY: `page` is live (a page a pop reached), and its `free` is
        // written only by its owner, the caller; `block` is not read.
        unsafe { (*page).free = corrupted_list(page, block) };
        ptr::null_mut()
    }

    /// The slow path: a page of the heap that `placement` accepts and that
    /// can serve (remote frees taken, blocks carved), else a fresh page from
    /// the arena it names, becomes the class's direct page and serves. Null
    /// when no memory can be had. (The facade's slow paths call it through
    /// the lifecycle, `lifecycle::refill`, which beats its heartbeat
    /// around it; the shared heaps' refills call it directly.)
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) unsafe fn refill(
        heap: *mut Heap,
        class: usize,
        state: &State,
        placement: &mut impl Placement,
    ) -> *mut u8 {
        // SAFETY: the caller's heap, between operations on it.
        unsafe {
            let mut p = ptr::null_mut();
            if Heap::sparse(heap, class, placement) {
                // (The node the placement would take a fresh page from: the
                // thread's, under `Local`.)
                let (node, within) = placement.fresh();
                if within.is_none_or(|w| w.contains(node)) {
                    p = Heap::alloc_shared(heap, class, state, node);
                }
            }
            if p.is_null() {
                p = Heap::refill_now(heap, class, state, placement);
            }
            p
        }
    }

    /// [`refill`](Self::refill) past the shared heap.
    ///
    /// # Safety
    /// As [`refill`](Self::refill).
    #[inline(always)]
    unsafe fn refill_now(heap: *mut Heap, class: usize, state: &State, placement: &mut impl Placement) -> *mut u8 {
        // SAFETY: the heap is the calling thread's, so its slots, lists and
        // pages' owner-only fields are written by no other thread; every
        // page reached through them is live (a page leaves the heap only
        // through `release_page`, which unlinks it first).
        unsafe {
            if Heap::is_lent(heap, class) {
                // A lent page that ran dry: the heap's own pages serve now.
                Heap::end_loan(heap);
            }
            Heap::gather_remote(heap);
            let now = (*heap).refills.wrapping_add(1);
            (*heap).refills = now;
            (*heap).last_refill[class] = now;
            let w = &mut (*heap).life.window_refills[class];
            *w = w.saturating_add(1);
            if now.is_multiple_of(EXPIRE_EVERY) {
                Heap::expire_kept(heap, now);
            }
            let cache = Heap::cache_page(heap, class);
            let any = CACHING && placement.cache_serves((*heap).node);
            (*heap).cache_serves[class] = any;
            if any {
                return Heap::refill_cache(heap, class, state, placement);
            }
            if !(*cache).free.is_null() {
                // The policy chooses among pages: they get their blocks
                // back before it looks.
                Heap::flush_cache(heap, class, 0, true);
            }
            Heap::set_cache_src(heap, class, ptr::null_mut());
            let direct = (*heap).direct[class];
            if direct != empty_page()
                && direct != cache
                && placement.accepts(node_of(direct))
                && Heap::refill_from(heap, direct)
            {
                let p = Heap::pop(heap, class);
                if served(p) {
                    return p;
                }
            }
            let mut page = (*heap).lists[class].head;
            while !page.is_null() {
                let mut next = (*page).next;
                if page != direct && placement.accepts(node_of(page)) && Heap::refill_from(heap, page) {
                    Heap::set_direct(heap, class, page);
                    let p = Heap::pop(heap, class);
                    if served(p) {
                        return p;
                    }
                    // The page that left the slot may have gone back to its
                    // arena: on from the list as it is now.
                    next = (*page).next;
                }
                page = next;
            }
            let (node, within) = placement.fresh();
            let Some(page) = Heap::fresh_page(heap, class, state, state.node_arena(node), within) else {
                Heap::set_direct(heap, class, empty_page());
                return ptr::null_mut();
            };
            Heap::set_direct(heap, class, page);
            placement.took(node_of(page));
            Heap::pop(heap, class)
        }
    }

    /// A block of class `class` from a page of the heap on `node` (the
    /// arena node), or from a fresh page of that node's arena (falling back
    /// by distance when it is out of memory), without touching the direct
    /// slot: for callers that place one block (allocator handles). Null when
    /// no memory can be had.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    pub(crate) unsafe fn alloc_on_node(heap: *mut Heap, class: usize, state: &State, node: usize) -> *mut u8 {
        // SAFETY: as in `refill`: the caller's heap, its pages live and
        // theirs to write.
        unsafe {
            let direct = (*heap).direct[class];
            if direct != empty_page()
                && !Heap::is_lent(heap, class)
                && !Heap::is_cache(heap, direct)
                && node_of(direct) == node
                && !(*direct).free.is_null()
            {
                let p = Heap::pop(heap, class);
                if served(p) {
                    return p;
                }
            }
            Heap::gather_remote(heap);
            let mut page = (*heap).lists[class].head;
            while !page.is_null() {
                let next = (*page).next;
                if node_of(page) == node && Heap::refill_from(heap, page) {
                    let p = Heap::pop_from(heap, page);
                    if served(p) {
                        return p;
                    }
                }
                page = next;
            }
            match Heap::fresh_page(heap, class, state, state.node_arena(node), None) {
                Some(page) => Heap::pop_from(heap, page),
                None => ptr::null_mut(),
            }
        }
    }

    /// Pops a block of `page`, one of the heap's pages with a free block
    /// (null only as [`pop`](Self::pop) may be: see [`served`]).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap and owns `page`, whose free list
    /// is not empty.
    pub(super) unsafe fn pop_from(heap: *mut Heap, page: *mut Page) -> *mut u8 {
        // SAFETY: the caller's heap owns `page` (live, owner-only fields ours
        // to write) and its free list is not empty, so `free` is a block of
        // the page.
        unsafe {
            debug_assert_eq!((*page).info.heap.load(Ordering::Relaxed), heap);
            let block = (*page).free;
            debug_assert!(!block.is_null());
            if HARDENED && outside(page, block) {
                return Heap::pop_corrupt(page, block);
            }
            if HARDENED {
                hardened::handing_out(block.cast(), || kind_of(page));
            }
            (*page).free = next_of(page, block);
            (*page).used.add(1);
            bump(&(*heap).counters.allocs[usize::from((*page).info.class)], 1);
            block.cast()
        }
    }

    /// A fresh page from `arena` (falling back within `within`), carved and
    /// on the class's list.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn fresh_page(
        heap: *mut Heap,
        class: usize,
        state: &State,
        arena: &Arena,
        within: Option<NodeSet>,
    ) -> Option<*mut Page> {
        let page = arena.alloc_page(state, class, heap, within)?.as_ptr();
        // SAFETY: a fresh page of ours, none of its blocks handed out: no
        // thread frees into it yet.
        unsafe {
            // Its slots' sink: the heap's free cache of the class where it
            // keeps one (the arena made the page its own sink).
            let sink = Heap::sink_for(heap, page, class);
            if sink != page {
                segment::store_sinks(segment_of((*page).info.start).cast::<SmallSegment>(), page, sink);
            }
            bump(&(*heap).life.page_bytes, page_bytes(class) as u64);
            (*heap).life.grew(state.config.purge_threshold as u64);
            debug_assert!((*page).used.get() == 0 && (*page).carved.get() == 0 && (*page).free.is_null());
            debug_assert_eq!(usize::from((*page).info.class), class);
            (*heap).push_front(page);
            carve(page);
        }
        Some(page)
    }

    /// Makes `page` able to serve (remote frees taken, more blocks carved);
    /// a page that stays full leaves the list until a block comes back.
    ///
    /// # Safety
    /// The heap is the caller's and owns `page`.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn refill_from(heap: *mut Heap, page: *mut Page) -> bool {
        // SAFETY: `page` is one of the caller's heap's pages: live, its list
        // links, free list and counts written only by this thread; remote
        // frees reach it only through `thread_free`, taken atomically.
        unsafe {
            debug_assert_eq!((*page).info.heap.load(Ordering::Relaxed), heap, "refilling from another heap's page");
            // About to serve: what it frees from now on may be purged again.
            (*page).purged_used = u32::MAX;
            if (*page).free.is_null() && (*page).pending {
                // The page is about to serve: not one to give back, even
                // if these frees empty it.
                Heap::take_remote(heap, page, false);
            }
            if (*page).free.is_null() {
                carve(page);
            }
            if !(*page).free.is_null() {
                return true;
            }
            debug_assert!(
                (*page).used.get() - Heap::references(heap, page) == (*page).info.capacity || lists_dropped(),
                "a page without free blocks is full"
            );
            (*heap).unlink(page);
            (*page).in_full = true;
            false
        }
    }
}

/// Carves up to [`CARVE_BYTES`] worth of blocks (at least one) onto the
/// page's free list: the free blocks a purge took off it first (lowest
/// first, their memory faulted in again as the links are written; on a
/// page masked by OS page, one OS page's), else from its untouched tail.
/// Touching memory as late as possible keeps RSS low.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(super) unsafe fn carve(page: *mut Page) {
    // SAFETY: owner-only fields of the caller's page; the blocks linked are
    // free ones of the page (masked by a purge, or never carved).
    unsafe {
        let bs = (*page).info.block_size as usize;
        let most = (CARVE_BYTES / bs).max(1);
        let masked = (*page).purged_free.get();
        if masked != 0 && (*page).info.capacity as usize > MASKED_BLOCKS {
            // A bit an OS page: the blocks that start in the lowest.
            let offset = (*page).info.start as usize - page_span(page).start;
            let k = masked.trailing_zeros() as usize;
            let carved = (*page).carved.get() as usize;
            let mut head = (*page).free;
            for i in starting_in(k, offset, bs, carved).rev() {
                let b = (*page).info.start.add(i * bs).cast::<Block>();
                (*b).next = link(page, head);
                if HARDENED {
                    b.cast::<usize>().add(1).write(0);
                }
                head = b;
            }
            debug_assert!(head != (*page).free, "an OS page masked that no block starts in");
            (*page).free = head;
            (*page).purged_free.set(masked & (masked - 1));
            return;
        }
        if masked != 0 {
            // The lowest `most` of them.
            let (mut take, mut rest) = (0u64, masked);
            for _ in 0..most {
                if rest == 0 {
                    break;
                }
                take |= rest & rest.wrapping_neg();
                rest &= rest - 1;
            }
            let mut head = (*page).free;
            for i in (0..64).rev().filter(|&i| take & (1u64 << i) != 0) {
                let b = (*page).info.start.add(i * bs).cast::<Block>();
                (*b).next = link(page, head);
                if HARDENED {
                    b.cast::<usize>().add(1).write(0);
                }
                head = b;
            }
            (*page).free = head;
            (*page).purged_free.set(masked & !take);
            return;
        }
        let left = (*page).info.capacity - (*page).carved.get();
        if left == 0 {
            return;
        }
        let n = left.min(most as u32);
        let first = (*page).info.start.add((*page).carved.get() as usize * bs);
        debug_assert!(first as usize + n as usize * bs <= page_span(page).end);
        for i in 0..n as usize {
            let b = first.add(i * bs).cast::<Block>();
            let next = if i + 1 < n as usize { first.add((i + 1) * bs).cast() } else { (*page).free };
            (*b).next = link(page, next);
            // A fresh block carries no freed mark (a page's memory may hold
            // an earlier class's stale one).
            if HARDENED {
                b.cast::<usize>().add(1).write(0);
            }
        }
        (*page).free = first.cast();
        (*page).carved.add(n);
    }
}
