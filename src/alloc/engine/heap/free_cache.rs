//! The free cache: per class, one list of the blocks the owner freed, across
//! its pages on its node, newest first; the direct page where the
//! placement would take any of those pages. Filled with a page's whole
//! free list, given back to the pages when full or idle.

use core::ptr;

use super::{Heap, Placement, empty_page, in_page, link, node_of};
use crate::alloc::engine::segment::{self, segment_of};
use crate::alloc::engine::size_class::{self, CLASSES};
use crate::alloc::engine::types::{Block, Page, SmallSegment, State};
use crate::hardened::HARDENED;
use crate::sync::{AtomicPtr, Ordering};

/// Whether local frees go through the class's free cache. Not in hardened
/// builds: their free-list links are encoded with each page's key and
/// checked against the page's bounds, which a list of many pages' blocks
/// has not.
pub(crate) const CACHING: bool = !HARDENED;

/// The most blocks a class's free cache holds before a free gives all but
/// the newest half of them back to their pages (more when a page's long
/// list was taken whole): 512 KiB of blocks, between 8 and 256 of them.
/// glibc's `bench-malloc-thread` pattern (a working set of 1,024 blocks to
/// 32 KiB replaced at random) refilled one `malloc` in 17 with 64 KiB (at
/// least 4), one in 100 with 256 KiB (at least 8), fewer with more, and
/// its peak RSS fell from 27 to 17 and 13 MiB (tcmalloc's: 17): blocks
/// freed are reused before pages are touched. Little enough that an idle
/// class's blocks are not missed while they wait for `expire_kept`.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) const fn cache_room(class: usize) -> u32 {
    let n = (512 * 1024 / size_class::class_size(class)) as u32;
    if n < 8 {
        8
    } else if n > 256 {
        256
    } else {
        n
    }
}

impl Heap {
    /// [`refill`](Self::refill) where the class's free cache may serve: it
    /// becomes the direct page; if it is empty, the free blocks of a page
    /// that has some (the direct page that ran dry once its remote frees
    /// are taken or more of it carved, else the first on the list, else a
    /// fresh page) move into it, and it serves them. A page of another
    /// node than the heap's (its frees do not go through the cache) serves
    /// as the direct page, as under any policy.
    ///
    /// # Safety
    /// As [`refill`](Self::refill), no loan open in the class.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn refill_cache(
        heap: *mut Heap,
        class: usize,
        state: &State,
        placement: &mut impl Placement,
    ) -> *mut u8 {
        // SAFETY: as in `refill`: the caller's heap, its pages live and
        // theirs to write.
        unsafe {
            let cache = Heap::cache_page(heap, class);
            let home = (*heap).node;
            let old = (*heap).direct[class];
            if old != cache {
                if (*cache).free.is_null()
                    && old != empty_page()
                    && node_of(old) == home
                    && Heap::refill_from(heap, old)
                {
                    Heap::take_into_cache(heap, class, old);
                    Heap::set_cache_src(heap, class, old);
                }
                Heap::set_direct(heap, class, cache);
            }
            if !(*cache).free.is_null() {
                return Heap::pop(heap, class);
            }
            let src = (*heap).cache_src[class];
            if !src.is_null() && placement.accepts(node_of(src)) && Heap::refill_from(heap, src) {
                return Heap::serve_from(heap, class, src);
            }
            let mut page = (*heap).lists[class].head;
            while !page.is_null() {
                let next = (*page).next;
                if page != src && placement.accepts(node_of(page)) && Heap::refill_from(heap, page) {
                    return Heap::serve_from(heap, class, page);
                }
                page = next;
            }
            let (node, within) = placement.fresh();
            let Some(page) = Heap::fresh_page(heap, class, state, state.node_arena(node), within) else {
                return ptr::null_mut();
            };
            placement.took(node_of(page));
            Heap::serve_from(heap, class, page)
        }
    }

    /// The end of [`refill_cache`](Self::refill_cache): `page`, with free
    /// blocks, serves through the (empty) free cache if it is of the heap's
    /// node, else as the direct page.
    ///
    /// # Safety
    /// As [`take_into_cache`](Self::take_into_cache); the cache is direct.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn serve_from(heap: *mut Heap, class: usize, page: *mut Page) -> *mut u8 {
        // SAFETY: `heap` is the calling thread's and owns `page`, of `class` with free
        // blocks; the class's cache is empty and direct (the caller's word): what
        // `take_into_cache`, `set_direct` and `pop` ask.
        unsafe {
            if node_of(page) == (*heap).node {
                Heap::take_into_cache(heap, class, page);
                Heap::set_cache_src(heap, class, page);
            } else {
                Heap::set_direct(heap, class, page);
            }
            Heap::pop(heap, class)
        }
    }

    /// Moves the free list of `page`, one of the heap's pages of `class`
    /// with free blocks, into the class's empty free cache, all of it. A
    /// page left without a free block leaves its list until one comes back
    /// if it is carved to the end (else a later refill carves more of it).
    ///
    /// A list longer than the cache's room (remote frees taken, or many
    /// blocks freed while the page was not served from) is taken whole
    /// too, with one free's room left: the next free the cache takes gives
    /// all but half its room back. Taking half the room's worth walked the
    /// list to its middle, a serial chain of loads of lines another thread
    /// had written (a producer's blocks its consumer freed: 7.4 against
    /// 4.7 µs a batch of 256), each read again by the allocation that
    /// wrote it.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap and owns `page`; the cache is
    /// empty.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn take_into_cache(heap: *mut Heap, class: usize, page: *mut Page) {
        // SAFETY: `heap` is the calling thread's and owns `page`; the cache is empty (the
        // caller's word): these fields are ours alone. `used` counts the page's blocks off
        // its free list (and the references), so the rest of what it carved is on the list
        // or masked by a purge;
        // its links are plain (the cache exists only where they are: `CACHING`).
        unsafe {
            let cache = Heap::cache_page(heap, class);
            let room = cache_room(class);
            debug_assert!((*cache).free.is_null() && !(*page).free.is_null());
            // (Its room may be more: a list longer than the room left one.)
            debug_assert!((*cache).used.get() >= room, "an empty cache has all its room");
            let masked = (*page).purged_free.get();
            let n = (*page).carved.get()
                - ((*page).used.get() - Heap::references(heap, page))
                - if masked == 0 { 0 } else { segment::masked_blocks_of(page) as u32 };
            // The page's frees come to the cache again (they may have been
            // sent to the page by a flush).
            segment::set_sink(segment_of((*page).info.start).cast(), page, cache);
            (*cache).free = (*page).free;
            (*page).free = ptr::null_mut();
            (*cache).used.set(if n < room { room - n } else { 1 });
            (*page).used.add(n);
            // A page with remote frees waiting stays listed, so that a
            // refill takes them (`refill_from`): full and off the list, no
            // refill would look at it, and its remote frees would not
            // queue it again while its `thread_free` holds any.
            if (*page).carved.get() == (*page).info.capacity && masked == 0 && !(*page).pending {
                (*heap).unlink(page);
                (*page).in_full = true;
            }
        }
    }

    /// Gives `block` back to `page`, its page, which this heap owns (a block
    /// leaving the free cache).
    ///
    /// # Safety
    /// As [`free_local`](Self::free_local), the block's counters already
    /// booked.
    pub(super) unsafe fn give_back(heap: *mut Heap, page: *mut Page, block: *mut Block) {
        // SAFETY: `heap` is the calling thread's and owns `page`; `block` is a live block of
        // it (the caller's word): the page's list and `used` are ours to write.
        unsafe {
            debug_assert!((*page).used.get() > 0, "a cached block of a page with none in use");
            debug_assert!(in_page(page, block.cast()) && (*page).info.heap.load(Ordering::Relaxed) == heap);
            // As `push`, but the event is the page's alone (a page, not a
            // cache), and no free's: the caller is in the midst of one.
            (*block).next = link(page, (*page).free);
            (*page).free = block;
            if super::free::used_sub_one_is_zero(page) || (*page).in_full {
                Heap::page_event_with(heap, page, true);
            }
        }
    }

    /// The class's free cache: where the heap's pages of `class` send the
    /// blocks the owner frees.
    ///
    /// # Safety
    /// `heap` is a live heap; `class < CLASSES`.
    #[inline(always)]
    pub(crate) unsafe fn cache_page(heap: *mut Heap, class: usize) -> *mut Page {
        debug_assert!(class < CLASSES);
        // SAFETY: in bounds of the heap's array (the contract).
        unsafe { (&raw mut (*heap).cache).cast::<Page>().add(class) }
    }

    /// Whether `page` is one of the heap's free caches.
    #[inline(always)]
    pub(super) fn is_cache(heap: *mut Heap, page: *mut Page) -> bool {
        // SAFETY: only the array's address is taken.
        let base = unsafe { &raw const (*heap).cache } as usize;
        (page as usize).wrapping_sub(base) < core::mem::size_of::<[Page; CLASSES]>()
    }

    /// The sink ([`sink_of`](segment::sink_of)) of `page`, of
    /// `class`, that `heap` takes: its free cache of the class if the page
    /// is on the heap's node (so that a cache's blocks are all of one
    /// node), else (and in hardened builds) the page itself.
    ///
    /// # Safety
    /// `heap` is a live heap the calling thread owns (it writes the heap's
    /// free cache unsynchronised); `page` a page descriptor with its
    /// `info.node` set; `class < CLASSES`.
    ///
    /// A class's free cache is written here, when the heap takes its first
    /// page of the class (a heap's caches are 17 KiB, most of which a
    /// thread using a few classes never touches).
    pub(crate) unsafe fn sink_for(heap: *mut Heap, page: *mut Page, class: usize) -> *mut Page {
        // SAFETY: `heap` is live and `class < CLASSES` (the caller's word), so the cache is
        // in bounds; the caller is also the heap's owner (`fresh_page`, taking the page), so
        // no other thread writes the cache, nor reads it before a block of the page is out.
        unsafe {
            if !CACHING || usize::from((*page).info.node) != (*heap).node {
                return page;
            }
            let c = Heap::cache_page(heap, class);
            if (*c).info.heap.load(Ordering::Relaxed).is_null() {
                debug_assert!((*c).free.is_null(), "a free cache of no heap holds blocks");
                c.write(Page::empty());
                (*c).used.set(cache_room(class));
                (*c).info.heap = AtomicPtr::new(heap);
                (*c).info.block_size = size_class::class_size(class) as u32;
                (*c).info.class = class as u8;
                (*c).info.node = (*heap).node as u8;
            }
            c
        }
    }

    /// Gives the blocks of the class's free cache back to their pages, all
    /// but the `keep` newest (which the next allocations take while their
    /// lines are still cached). With `bypass`, a page a block goes back to
    /// takes the owner's frees itself from then on (its slots' sink) until
    /// the cache is filled from it again: where frees outrun allocations
    /// (a collector's sweep, a burst of frees), or under a policy the cache
    /// does not serve, blocks are not handled twice.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap (or its exiting owner's).
    #[cold]
    #[inline(never)]
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) unsafe fn flush_cache(heap: *mut Heap, class: usize, keep: u32, bypass: bool) {
        // SAFETY: the cache's blocks are free blocks of this heap's pages of
        // the class (only the owner's frees put them there), each counted in
        // use by its page, so each page is live; their links are plain
        // (not a hardened build: `CACHING`).
        unsafe {
            let cache = Heap::cache_page(heap, class);
            let mut rest = (*cache).free;
            let mut last: *mut Block = ptr::null_mut();
            let mut kept = 0;
            while kept < keep && !rest.is_null() {
                last = rest;
                rest = (*rest).next;
                kept += 1;
            }
            if last.is_null() {
                (*cache).free = ptr::null_mut();
            } else {
                (*last).next = ptr::null_mut();
            }
            while !rest.is_null() {
                let next = (*rest).next;
                let seg = segment_of(rest.cast()).cast::<SmallSegment>();
                let page = segment::page_of(seg, rest.cast());
                if bypass {
                    segment::set_sink(seg, page, page);
                }
                Heap::give_back(heap, page, rest);
                rest = next;
            }
            // Room for as many frees as keep the cache within its bound.
            (*cache).used.set(cache_room(class) - kept);
            debug_assert!((*cache).used.get() > 0);
        }
    }

    /// Makes `page` (null: none) the page the class's free cache is filled
    /// from first, moving the reference that holds from the one before
    /// (which, if that empties it, is kept or given back as a free would).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap (or its exiting owner's); `page`
    /// is null or a live page of the heap of `class`.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn set_cache_src(heap: *mut Heap, class: usize, page: *mut Page) {
        // SAFETY: as in `set_direct`: owner-only fields of the heap's live
        // pages (a referenced page is never given back).
        unsafe {
            let old = (*heap).cache_src[class];
            if old == page {
                return;
            }
            if !page.is_null() {
                Heap::take_reference(heap, page);
            }
            (*heap).cache_src[class] = page;
            if !old.is_null() {
                Heap::drop_reference(heap, old);
            }
        }
    }
}
