//! The two ends of a free (`route.rs` chooses between them and the per-CPU
//! caches): a block back onto its slot's sink (its page, or the heap's
//! free cache of its class) when the calling thread owns it, or onto its
//! page's `thread_free` list, whose first push queues the page on its
//! heap; the owner gathers them at its next refill.

use core::ptr;

use super::{Heap, bump, current, in_page, link, next_of};
use crate::alloc::engine::types::{Block, OWNER_THREAD, Page, State};
use crate::sync::Ordering;

impl Heap {
    /// Frees `block` of a page this heap owns onto `page`: the block's page,
    /// or the heap's free cache of its class (what the block's slot names).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap and owns `page`; `block` is a live
    /// block of `page`, or of a page of the heap on its node whose class's
    /// free cache `page` is.
    #[inline(always)]
    pub(crate) unsafe fn free_local(heap: *mut Heap, page: *mut Page, block: *mut Block) {
        // SAFETY: the caller's heap owns the page (or it is the heap's free
        // cache): its `free`, `used` and the heap's counters are written by
        // this thread alone.
        unsafe {
            debug_assert!((*page).used.get() > 0, "free of a block of a page with none in use");
            debug_assert!(
                (in_page(page, block.cast()) || Heap::is_cache(heap, page))
                    && (*page).info.heap.load(Ordering::Relaxed) == heap
            );
            // The counters first: their stores may alias the page as far
            // as the compiler knows, and after them it read `used` back
            // from memory for the test (`cmpl $0`) instead of taking the
            // decrement's flags.
            bump(&(*heap).counters.frees, 1);
            bump(&(*heap).counters.bytes_freed, u64::from((*page).info.block_size));
            Heap::push(heap, page, block);
        }
    }

    /// Pushes `block` on `page`'s free list: the block's page, or the
    /// class's free cache, whose `used` is the room left and reaches 0 when
    /// this push fills it (`page_event` then gives half back).
    ///
    /// # Safety
    /// As [`free_local`](Self::free_local), the counters booked.
    #[inline(always)]
    pub(super) unsafe fn push(heap: *mut Heap, page: *mut Page, block: *mut Block) {
        // SAFETY: `heap` is the calling thread's and owns `page` (the caller's word), so the
        // page's `free` and `used` are this thread's alone; `block`, live and given up, takes
        // the link.
        unsafe {
            (*block).next = link(page, (*page).free);
            (*page).free = block;
            if used_sub_one_is_zero(page) || (*page).in_full {
                Heap::page_event(heap, page);
            }
        }
    }

    /// Looks at every page of this heap that other threads freed blocks
    /// into. A page whose free list is empty gets them now; the others are put
    /// on the heap's pending list and get them when their free list runs dry
    /// (`take_remote`). Either way the page leaves `remote_pages`, and no
    /// remote thread queues it again while its `thread_free` is not empty.
    ///
    /// # Safety
    /// `heap` must be the calling thread's heap (or an orphan being adopted).
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) unsafe fn gather_remote(heap: *mut Heap) {
        // SAFETY: pages on `remote_pages` are this heap's; see `Page`'s Linked impl
        // for why each is on the stack at most once.
        unsafe {
            // Look before taking: the swap is a locked instruction (about
            // twenty cycles) and the queue is empty at most refills; a page
            // queued just after the look is gathered at the next one, as it
            // would be if queued just after the swap.
            if (*heap).remote_pages.0.is_empty() {
                return;
            }
            let mut page = (*heap).remote_pages.0.take_all();
            while !page.is_null() {
                debug_assert_eq!((*page).info.heap.load(Ordering::Relaxed), heap);
                // Read the link before emptying `thread_free`: from then on a
                // remote thread may push the page again and rewrite it.
                let next = (*page).remote.remote_next;
                if (*page).free.is_null() {
                    Heap::take_remote(heap, page, true);
                } else if !(*page).pending {
                    (*heap).pend_link(page);
                }
                page = next;
            }
        }
    }

    /// Moves the blocks in `page.thread_free` onto its free list, without
    /// walking them when the free list is empty (they were last written by
    /// other cores: a cache miss each). With `may_release`, a page they empty
    /// may go back to its arena.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) unsafe fn take_remote(heap: *mut Heap, page: *mut Page, may_release: bool) {
        // SAFETY: the caller owns the heap and the page.
        unsafe {
            if (*page).pending {
                (*heap).pend_unlink(page);
            }
            let (head, n) = (*page).remote.thread_free.take_all();
            if head.is_null() {
                return;
            }
            // The chain's links are stored as the page's own (`free_remote`):
            // spliced as it is, walked only to reach its tail.
            if (*page).free.is_null() {
                (*page).free = head;
            } else {
                let mut tail = head;
                loop {
                    let next = next_of(page, tail);
                    if next.is_null() {
                        break;
                    }
                    tail = next;
                }
                (*tail).next = link(page, (*page).free);
                (*page).free = head;
            }
            let n = n as u32;
            debug_assert!(n <= (*page).used.get(), "more remote frees than blocks in use");
            (*page).used.sub(n);
            let c = &(*heap).counters;
            bump(&c.remote_frees, u64::from(n));
            bump(&c.frees, u64::from(n));
            bump(&c.bytes_freed, u64::from(n) * u64::from((*page).info.block_size));
            if (*page).in_full || ((*page).used.get() == 0 && may_release) {
                Heap::page_event_with(heap, page, may_release);
            }
        }
    }

    /// Puts `page` at the head of the pages with remote frees waiting.
    ///
    /// # Safety
    /// `page` is a live page of this heap, not on the pending list; the
    /// caller is the heap's owner (the fields are owner-only).
    pub(super) unsafe fn pend_link(&mut self, page: *mut Page) {
        // SAFETY: owner-only fields of a page of this heap (the contract).
        unsafe {
            (*page).pending = true;
            (*page).pend_prev = ptr::null_mut();
            (*page).pend_next = self.pending;
            if !self.pending.is_null() {
                (*self.pending).pend_prev = page;
            }
            self.pending = page;
        }
    }

    /// Takes `page` off the pending list.
    ///
    /// # Safety
    /// `page` is a live page of this heap on the pending list; the caller is
    /// the heap's owner.
    pub(super) unsafe fn pend_unlink(&mut self, page: *mut Page) {
        // SAFETY: the contract: the page and its neighbours on the list are
        // this heap's, their links owner-only.
        unsafe {
            let (prev, next) = ((*page).pend_prev, (*page).pend_next);
            if prev.is_null() {
                debug_assert_eq!(self.pending, page);
                self.pending = next;
            } else {
                (*prev).pend_next = next;
            }
            if !next.is_null() {
                (*next).pend_prev = prev;
            }
            (*page).pending = false;
            (*page).pend_prev = ptr::null_mut();
            (*page).pend_next = ptr::null_mut();
        }
    }
}

/// A page of an exited thread's heap got its first remote free since its
/// remote frees were last collected: the lifecycle collects them at its
/// next tick, and the freeing thread's heap is armed so that its next
/// allocation refills and so ticks (a thread that only frees, as a
/// consumer of a producer that has exited, reaches the tick that way; the
/// heap floor does not call the lifecycle above it).
///
/// A per-CPU cache's flush (`cpu.rs`: remote frees into pages, most of
/// them its CPU's home heap's, which no thread owns) arms nothing (`arm`
/// false) and has the lifecycle look a delay later: the heartbeat reaches
/// the tick through the caches' allocations, and arming would have the
/// flushing thread's heap empty its direct slots (its classes beyond the
/// caches) at every flush.
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
fn orphan_freed(arm: bool) {
    let Some(state) = State::try_get() else { return };
    if !arm {
        // The home's own refills collect these; the lifecycle looks a delay
        // on, should it go quiet (not at once: a flush is no exited thread).
        state.look_in_a_delay();
        return;
    }
    state.life.note_orphan_work();
    let me = current();
    if !me.is_null() {
        // SAFETY: the calling thread's heap, between operations (a free's
        // last step).
        unsafe { Heap::arm(me, state) };
    }
}

/// A block of another heap's page: push it on the page's `thread_free`; the
/// first push onto an empty list also queues the page on its heap, once.
#[cold]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(super) unsafe fn free_remote(page: *mut Page, block: *mut Block) {
    // SAFETY: the caller's word, as `push_remote` asks.
    unsafe { push_remote(page, block, true) }
}

/// [`free_remote`] of a block a per-CPU cache gives back (`cpu.rs`): a
/// first free into a page of a heap no thread owns arms no heap and has
/// the lifecycle look a delay later (an exited thread's page among them is
/// collected then, not at the next tick).
///
/// # Safety
/// As [`free_remote`].
pub(super) unsafe fn free_remote_unarmed(page: *mut Page, block: *mut Block) {
    // SAFETY: the caller's word, as `push_remote` asks.
    unsafe { push_remote(page, block, false) }
}

/// [`free_remote`]'s push; `arm`: whether a first free into an exited or
/// shared heap's page arms the freeing thread's heap (`orphan_freed`).
///
/// # Safety
/// As [`free_remote`].
#[inline(always)]
unsafe fn push_remote(page: *mut Page, block: *mut Block, arm: bool) {
    // SAFETY: the block is live and ours to give back; the page and its heap
    // outlive it (heaps are never freed, pages not reassigned while they hold
    // a live block).
    unsafe {
        // (A hardened build stores the link encoded, as in the page's own
        // list: the owner then takes the chain without walking it.)
        if (*page).remote.thread_free.push_by(block, |b, next| (*b).next = link(page, next)) {
            let heap = (*page).info.heap.load(Ordering::Relaxed);
            (*heap).remote_pages.0.push(page);
            if (*heap).owned.load(Ordering::Relaxed) != OWNER_THREAD {
                orphan_freed(arm);
            }
        }
    }
}

/// `used` one less; whether that made it 0 (owner only): a free's test
/// of its page emptying. On x86-64 one `dec` on memory and a jump on
/// its flag, as the compiler makes of a plain field; through the atomic
/// it stored the value and loaded it back to test it (two more
/// instructions on every free).
///
/// # Safety
/// `page` is a live page descriptor of the caller's (its owner's).
#[inline(always)]
pub(super) unsafe fn used_sub_one_is_zero(page: *mut Page) -> bool {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a `dec` of the page's aligned 4-byte `used` (the caller's
    // live page; `repr(transparent)` over an `AtomicU32`, at its
    // offset). It is what a relaxed load and a relaxed store of one
    // less are on x86-64 (aligned 4-byte accesses are atomic; no `lock`:
    // this thread is the count's only writer), so a concurrent relaxed
    // `get` reads the old or the new value. The jump goes to the label
    // block, which returns; the flags are the asm's.
    unsafe {
        core::arch::asm!(
            "dec dword ptr [{p} + {off}]",
            "jz {zero}",
            p = in(reg) page,
            off = const core::mem::offset_of!(Page, used),
            zero = label { return true; },
            options(nostack),
        );
        false
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's live page.
    unsafe {
        (*page).used.sub(1);
        (*page).used.get() == 0
    }
}
