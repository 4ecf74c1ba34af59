//! Page lists: each class's list of pages that may serve, the direct slot
//! and the references it and the cache's source hold on their pages, what
//! happens when a page gets a block back while full or empties (kept, or
//! given back to its arena), and idle classes' kept pages expiring.

use core::ptr;

use super::{Heap, bump, cache_room, empty_page, page_bytes};
use crate::alloc::engine::segment::segment_of;
use crate::alloc::engine::size_class::CLASSES;
use crate::alloc::engine::types::{HeapLife, Page, SegmentKind, State};
use crate::sync::Ordering;

/// A heap looks for idle classes' kept pages once in this many refills.
pub(crate) const EXPIRE_EVERY: u32 = 64;
/// A class that has not refilled in this many of its heap's refills is
/// idle. (Refills come once per [`CARVE_BYTES`] of a fresh page's blocks or
/// per page of freed ones: a class in steady use refills well within this
/// and keeps its page; one used rarely gives it back, as mimalloc's retired
/// pages expire after some of the heap's slow-path calls. Lua's tree
/// classes sit idle for a few hundred refills while it builds its strings.)
pub(super) const IDLE_REFILLS: u32 = 256;

/// `HeapLife::grow_mark` once the heap's pages grew past it by the purge
/// threshold: the lifecycle's next refill looks at the classes it left
/// untouched (`lifecycle::refill`), then marks what the heap holds.
pub(crate) const GROWN: u64 = u64::MAX;

/// A heap's growth, counted from the least its pages held since it last
/// looked at its untouched classes.
impl HeapLife {
    /// After a fresh page: [`GROWN`] once the pages grew by `threshold`
    /// (0: never) past the mark.
    pub(super) fn grew(&mut self, threshold: u64) {
        if self.grow_mark != GROWN
            && threshold != 0
            && self.page_bytes.load(Ordering::Relaxed).saturating_sub(self.grow_mark) >= threshold
        {
            self.grow_mark = GROWN;
        }
    }

    /// After a page went back: the mark follows the least the heap held.
    fn shrank(&mut self) {
        if self.grow_mark != GROWN {
            self.grow_mark = self.grow_mark.min(self.page_bytes.load(Ordering::Relaxed));
        }
    }

    /// Growth counted from what the heap holds now.
    pub(crate) fn mark_growth(&mut self) {
        self.grow_mark = self.page_bytes.load(Ordering::Relaxed);
    }
}

impl Heap {
    /// A page got a block back while full, or became empty; or a class's
    /// free cache filled up: the out-of-line end of a free (`push`).
    #[cold]
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn page_event(heap: *mut Heap, page: *mut Page) {
        // SAFETY: the caller owns the heap and the page.
        unsafe {
            if Heap::is_cache(heap, page) {
                let class = usize::from((*page).info.class);
                // Frees outran allocations (fewer of any class since the
                // last time this cache filled than the frees that filled
                // it): a burst, whose pages take their frees themselves.
                // (The sum reads a few hot lines; the flush below walks
                // half the cache.)
                let allocs = (*heap).counters.allocs_total();
                let burst = allocs.wrapping_sub((*heap).cache_filled_at[class]) < u64::from(cache_room(class) / 2);
                (*heap).cache_filled_at[class] = allocs;
                Heap::flush_cache(heap, class, cache_room(class) / 2, burst);
                // Frees filled the cache while a page served: where any
                // page may serve, the cache serves from now on (a loop of
                // pairs runs on it, not on a page whose blocks all come
                // back through it).
                if (*heap).cache_serves[class] && (*heap).direct[class] != page && !Heap::is_lent(heap, class) {
                    Heap::set_direct(heap, class, page);
                }
            } else {
                Heap::page_event_with(heap, page, true);
            }
            // A free's last step: the heap is armed here while something
            // is due (this event may have made it so).
            if let Some(state) = State::try_get() {
                Heap::arm(heap, state);
            }
        }
    }

    /// [`page_event`](Self::page_event); an empty page is kept or given
    /// back only with `may_release`.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn page_event_with(heap: *mut Heap, page: *mut Page, may_release: bool) {
        // SAFETY: the caller owns the heap and the page.
        unsafe {
            if (*page).in_full {
                // At the tail: the pages ahead of it have had longer to
                // gather freed blocks, and it gathers more before a refill
                // reaches it (at the head it served its one block and was
                // full again: Larson's pattern refilled every sixth malloc).
                (*page).in_full = false;
                (*heap).push_back(page);
            }
            let class = usize::from((*page).info.class);
            if may_release && (*page).used.get() == 0 && (*heap).direct[class] != page {
                let kept = (*heap).kept_empty[class];
                if kept.is_null() || kept == page || (*kept).used.get() != 0 {
                    (*heap).kept_empty[class] = page;
                } else {
                    (*heap).release_page(page);
                }
            }
        }
    }

    /// Gives the kept empty pages of classes idle for [`IDLE_REFILLS`] of
    /// the heap's refills back to their arenas, where a page of any class
    /// may take their memory (the arena hands out slots still resident
    /// first) and the purge delay applies. A program that moves from one
    /// mix of sizes to another (lua building a tree of tables, then
    /// strings) no longer holds a page per class of the old mix: lua's peak
    /// RSS 0.36 MB lower. A class in use refills often and keeps its page.
    ///
    /// A free cache that neither took nor gave a block since the last look
    /// (its room unchanged) gives its blocks back to their pages, and its
    /// source page its reference: cached blocks of a class the program has
    /// moved away from do not keep their pages from emptying.
    #[cold]
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn expire_kept(heap: *mut Heap, now: u32) {
        // SAFETY: the caller's heap; kept pages are its own.
        unsafe {
            for class in 0..CLASSES {
                let cache = Heap::cache_page(heap, class);
                let room = (*cache).used.get();
                if !(*cache).free.is_null() && room == (*heap).cache_seen[class] {
                    Heap::flush_cache(heap, class, 0, false);
                    if (*heap).direct[class] == Heap::cache_page(heap, class) {
                        // (Refilled at its next allocation.)
                        Heap::set_direct(heap, class, empty_page());
                    }
                    Heap::set_cache_src(heap, class, ptr::null_mut());
                }
                (*heap).cache_seen[class] = (*Heap::cache_page(heap, class)).used.get();
            }
            for class in 0..CLASSES {
                let kept = (*heap).kept_empty[class];
                if !kept.is_null()
                    && (*kept).used.get() == 0
                    && (*heap).direct[class] != kept
                    && now.wrapping_sub((*heap).last_refill[class]) > IDLE_REFILLS
                {
                    (*heap).release_page(kept);
                }
            }
        }
    }

    /// Gives an empty page back to its arena.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn release_page(&mut self, page: *mut Page) {
        let Some(state) = State::try_get() else { return };
        // SAFETY: the page is empty and ours; after unlinking, nothing here
        // refers to it.
        unsafe {
            debug_assert_eq!((*page).used.get(), 0, "releasing a page with live blocks");
            debug_assert!(
                core::ptr::eq((*page).info.heap.load(Ordering::Relaxed), self),
                "releasing another heap's page"
            );
            debug_assert!(!(*page).pending && (*page).remote.thread_free.is_empty());
            self.unlink(page);
            let class = usize::from((*page).info.class);
            if self.kept_empty[class] == page {
                self.kept_empty[class] = ptr::null_mut();
            }
            let seg = segment_of((*page).info.start);
            debug_assert_eq!((*seg).kind, SegmentKind::Small);
            bump(&self.life.page_bytes, (page_bytes(class) as u64).wrapping_neg());
            self.life.shrank();
            let arena = &state.arenas[usize::from((*seg).arena)];
            arena.free_page(state, page);
        }
    }

    /// Puts `page` at the head of its class's list.
    ///
    /// # Safety
    /// `page` is a live page this heap owns, on no list; the caller is the
    /// heap's owner.
    pub(super) unsafe fn push_front(&mut self, page: *mut Page) {
        // SAFETY: owner-only list fields of pages this heap owns (the
        // contract).
        unsafe {
            debug_assert!((*page).prev.is_null() && (*page).next.is_null(), "page already on a list");
            debug_assert!(core::ptr::eq((*page).info.heap.load(Ordering::Relaxed), self), "another heap's page listed");
            let class = usize::from((*page).info.class);
            let head = self.lists[class].head;
            debug_assert_ne!(head, page);
            (*page).prev = ptr::null_mut();
            (*page).next = head;
            if head.is_null() {
                self.lists[class].tail = page;
            } else {
                (*head).prev = page;
            }
            self.lists[class].head = page;
        }
    }

    /// Puts `page` at the tail of its class's list.
    ///
    /// # Safety
    /// As [`push_front`](Self::push_front).
    pub(super) unsafe fn push_back(&mut self, page: *mut Page) {
        // SAFETY: as in `push_front`.
        unsafe {
            debug_assert!((*page).prev.is_null() && (*page).next.is_null(), "page already on a list");
            debug_assert!(core::ptr::eq((*page).info.heap.load(Ordering::Relaxed), self), "another heap's page listed");
            let class = usize::from((*page).info.class);
            let tail = self.lists[class].tail;
            debug_assert_ne!(tail, page);
            (*page).next = ptr::null_mut();
            (*page).prev = tail;
            if tail.is_null() {
                self.lists[class].head = page;
            } else {
                (*tail).next = page;
            }
            self.lists[class].tail = page;
        }
    }

    /// Takes `page` off its class's list (a page on none is left as it is),
    /// and out of the direct slot if it is there.
    ///
    /// # Safety
    /// `page` is a live page this heap owns; the caller is the heap's owner.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn unlink(&mut self, page: *mut Page) {
        // SAFETY: owner-only list fields of pages this heap owns (the
        // contract). A page off every list has null links and is not a head.
        unsafe {
            let class = usize::from((*page).info.class);
            let (prev, next) = ((*page).prev, (*page).next);
            if !prev.is_null() {
                (*prev).next = next;
            } else if self.lists[class].head == page {
                self.lists[class].head = next;
            }
            if !next.is_null() {
                (*next).prev = prev;
            } else if self.lists[class].tail == page {
                self.lists[class].tail = prev;
            }
            (*page).prev = ptr::null_mut();
            (*page).next = ptr::null_mut();
            if self.direct[class] == page {
                // Its callers unlink a full page or an empty one, which is
                // never direct: the reference dropped leaves blocks in use
                // (so `set_direct` gives nothing back from here).
                debug_assert!((*page).used.get() > 1, "an empty direct page unlinked");
                Heap::set_direct(self, class, empty_page());
            }
        }
    }

    /// Makes `page` (one of the heap's pages, or the empty page) the class's
    /// direct page. The slot holds a reference on the heap page in it: one
    /// more in its `used`, so that a free on the direct page never finds it
    /// empty (a loop of `malloc`/`free` pairs emptied it on every free, and
    /// every free called [`page_event`](Self::page_event) for nothing: 20%
    /// of glibc's `bench-malloc-simple` pair). The page that leaves the slot
    /// loses the reference; if that empties it, it is kept or given back as
    /// a free would have.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap (or its exiting owner's), no loan
    /// in the slot; `page` is the empty page or a live page the heap owns.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) unsafe fn set_direct(heap: *mut Heap, class: usize, page: *mut Page) {
        // SAFETY: the heap is the calling thread's (or its exiting owner's),
        // so its direct slots and its pages' `used` are written by no other
        // thread; `old`, in the slot and not lent, is the empty page or a
        // live page of the heap (a page leaves the heap only through
        // `release_page`, never while direct), and `page` is one of those
        // by the caller's word.
        unsafe {
            debug_assert!(!Heap::is_lent(heap, class), "a reference taken on a lent page");
            let old = (*heap).direct[class];
            if old == page {
                return;
            }
            // (A free cache holds no reference: it is not a page.)
            if page != empty_page() && !Heap::is_cache(heap, page) {
                Heap::take_reference(heap, page);
            }
            (*heap).direct[class] = page;
            if old != empty_page() && !Heap::is_cache(heap, old) {
                Heap::drop_reference(heap, old);
            }
        }
    }

    /// One more reference (a direct slot's, the cache source's) on `page`.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap (or its exiting owner's) and
    /// owns `page`, live.
    pub(super) unsafe fn take_reference(heap: *mut Heap, page: *mut Page) {
        // SAFETY: an owner-only field of a live page of the heap.
        unsafe {
            debug_assert_eq!((*page).info.heap.load(Ordering::Relaxed), heap);
            (*page).used.add(1);
        }
    }

    /// Drops a reference on `page`; if that empties it, it is kept or given
    /// back as a free would.
    ///
    /// # Safety
    /// As [`take_reference`](Self::take_reference); the heap holds one.
    pub(super) unsafe fn drop_reference(heap: *mut Heap, page: *mut Page) {
        // SAFETY: as in `take_reference`.
        unsafe {
            debug_assert!((*page).used.get() > 0);
            (*page).used.sub(1);
            if (*page).used.get() == 0 {
                Heap::page_event_with(heap, page, true);
            }
        }
    }

    /// The references the heap holds on `page` (direct slot, cache source),
    /// counted in its `used`.
    ///
    /// # Safety
    /// `page` is a live page of the heap.
    pub(super) unsafe fn references(heap: *mut Heap, page: *mut Page) -> u32 {
        // SAFETY: the caller's heap; the page's class is fixed.
        unsafe {
            let class = usize::from((*page).info.class);
            u32::from((*heap).direct[class] == page) + u32::from((*heap).cache_src[class] == page)
        }
    }
}
