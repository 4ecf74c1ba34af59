//! Loans: a class's direct slot lent to a page the heap does not own (an
//! interleaver's turn), its blocks taken out of the heap's counters when
//! the loan ends.

use core::ptr;

use super::{Heap, bump, empty_page};
use crate::alloc::engine::types::{Loan, Page};
use crate::sync::Ordering;

impl Heap {
    /// Lends the class's direct slot to `page`, a page this heap does not own
    /// (whose blocks are freed elsewhere than through it): the fast path
    /// serves its blocks, counted as the heap's until [`end_loan`](Self::end_loan).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap, with no loan open; `page` holds
    /// blocks of `class`'s size (at least) and stays live until the loan ends.
    pub(crate) unsafe fn lend(heap: *mut Heap, class: usize, page: *mut Page) {
        // SAFETY: the heap is the calling thread's (its slot and loan are
        // ours to write) and `page` stays live until the loan ends, as the
        // caller promises.
        unsafe {
            debug_assert!((*heap).loan.page.is_null(), "a second loan while one is open");
            debug_assert!((*page).info.heap.load(Ordering::Relaxed).is_null(), "lending a slot to a heap page");
            // A lent page is not the heap's: the slot holds no reference.
            Heap::set_direct(heap, class, empty_page());
            (*heap).direct[class] = page;
            (*heap).loan = Loan { page, class, used0: (*page).used.get() };
        }
    }

    /// Whether the class's direct slot is lent.
    #[inline(always)]
    pub(crate) unsafe fn is_lent(heap: *mut Heap, class: usize) -> bool {
        // SAFETY: the caller's heap.
        unsafe {
            let l = (*heap).loan;
            !l.page.is_null() && l.class == class && (*heap).direct[class] == l.page
        }
    }

    /// A block of the page lent for `class`, if its direct slot is lent and
    /// the page has one (null otherwise).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap; `class < CLASSES`.
    #[inline(always)]
    pub(crate) unsafe fn pop_loan(heap: *mut Heap, class: usize) -> *mut u8 {
        // SAFETY: the caller's heap and a class below CLASSES; `pop` runs only
        // on a lent slot, whose page the lender keeps live.
        unsafe { if Heap::is_lent(heap, class) { Heap::pop(heap, class) } else { ptr::null_mut() } }
    }

    /// Ends the open loan, if any: the direct slot is the class's empty page
    /// again (unless something else took it meanwhile), and the blocks the
    /// fast path took from the lent page leave the heap's counters (they are
    /// not the heap's).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap (or its exiting owner's).
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) unsafe fn end_loan(heap: *mut Heap) {
        // SAFETY: `heap` is the calling thread's heap (or its exiting owner's: the caller's
        // word), so its loan, slots and counters are ours; the lent page is live while lent.
        unsafe {
            let Loan { page, class, used0 } = (*heap).loan;
            if page.is_null() {
                return;
            }
            (*heap).loan.page = ptr::null_mut();
            if (*heap).direct[class] == page {
                (*heap).direct[class] = empty_page();
            }
            let taken = u64::from((*page).used.get().wrapping_sub(used0));
            bump(&(*heap).counters.allocs[class], taken.wrapping_neg());
        }
    }
}
