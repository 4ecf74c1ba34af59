//! The pool: the window's turn handed to the heap's fast path, for one size
//! class. A page descriptor the thread's heap takes as the class's direct
//! page ([`Heap::lend`]), holding a few blocks of the turn's node (one block
//! the thread freed, or a run carved at the region's top), and an
//! *allowance* for the rest of the turn: the thread's frees of blocks of
//! that length go straight back on it ([`Pool::put_back`]) until the turn's
//! allocations are used up. A loop that allocates and frees a buffer then
//! cycles one warm block through the fast path, and a turn still ends at its
//! exact count (or bytes): the page never holds more blocks than the turn
//! has allocations left.
//!
//! What the fast path took is booked into the window when the pool is taken
//! back (`ThreadInterleaver::reclaim`), before the window, the cursor or the
//! space is used for anything else. One thread only: plain cells.
//!
//! [`Heap::lend`]: crate::alloc::engine::heap::Heap::lend

use core::cell::{Cell, UnsafeCell};
use core::ptr;

use crate::alloc::engine::types::{Block, Page};
use crate::alloc::region::NodeRegion;
use crate::hardened::{self, HARDENED};

/// Most bytes carved for a pool at once (carving writes each block's first
/// word).
pub(crate) const FILL_CARVE_BYTES: usize = 64 * 1024;

pub(crate) struct Pool {
    page: UnsafeCell<Page>,
    /// Blocks put on the page at the fill (0: no pool open).
    pub(crate) filled: Cell<usize>,
    /// Put-backs left, and the allowance given at the fill.
    allowance: Cell<usize>,
    pub(crate) allowance0: Cell<usize>,
    /// The page's `used` at the fill: the fast path counts what it takes.
    used0: Cell<u32>,
    /// The region its blocks are of, and their length in units.
    pub(crate) region: Cell<*mut NodeRegion>,
    pub(crate) units: Cell<usize>,
    /// Whether the filled blocks were carved (`stride` bytes apart, the
    /// region's top `top0` before) or one block the thread had freed.
    pub(crate) carved: Cell<bool>,
    pub(crate) stride: Cell<usize>,
    pub(crate) top0: Cell<usize>,
    /// How many blocks to carve at the next fill: doubled when a pool is
    /// used up, down to what was taken when it is not (a stream of mixed
    /// sizes switches class at every allocation: carving ahead would be
    /// undone each time).
    pub(crate) hint: Cell<usize>,
}

impl Pool {
    pub(crate) fn new() -> Self {
        Self {
            page: UnsafeCell::new(Page::empty()),
            filled: Cell::new(0),
            allowance: Cell::new(0),
            allowance0: Cell::new(0),
            used0: Cell::new(0),
            region: Cell::new(ptr::null_mut()),
            units: Cell::new(0),
            carved: Cell::new(false),
            stride: Cell::new(0),
            top0: Cell::new(0),
            hint: Cell::new(1),
        }
    }

    /// The page the heap is lent.
    pub(crate) fn page(&self) -> *mut Page {
        self.page.get()
    }

    /// Opens the pool on `list` (`n` blocks of `units` units of `r`, linked)
    /// for blocks of `size` bytes, with `allowance` put-backs.
    ///
    /// # Safety
    /// No pool is open; the blocks are the caller's, free.
    pub(crate) unsafe fn open(
        &self,
        r: *mut NodeRegion,
        list: *mut Block,
        n: usize,
        units: usize,
        size: usize,
        allowance: usize,
    ) {
        debug_assert_eq!(self.filled.get(), 0);
        debug_assert!(n > 0 && !list.is_null());
        let page = self.page.get();
        // SAFETY: the pool's own page, not lent now (no pool is open).
        unsafe {
            if HARDENED {
                // The heap pops with the page's key: encode the links. (The
                // node is for reports.)
                (*page).info.key = hardened::page_key(page.cast());
                (*page).info.node = (*crate::alloc::engine::segment::segment_of(list.cast())).arena;
                let mut b = list;
                while !b.is_null() {
                    let next = (*b).next;
                    (*b).next = crate::hardened::encode(next, (*page).info.key);
                    b = next;
                }
            }
            (*page).free = list;
            (*page).info.block_size = size as u32;
            self.used0.set((*page).used.get());
        }
        self.region.set(r);
        self.units.set(units);
        self.filled.set(n);
        self.allowance.set(allowance);
        self.allowance0.set(allowance);
    }

    /// Closes the pool: the blocks the fast path took, the blocks put back,
    /// and the chain of blocks still on the page (null if none).
    ///
    /// # Safety
    /// The pool is open and its page no longer lent.
    pub(crate) unsafe fn close(&self) -> (usize, usize, *mut Block) {
        let page = self.page.get();
        self.filled.set(0);
        // SAFETY: the pool's own page, no longer lent.
        unsafe {
            let taken = (*page).used.get().wrapping_sub(self.used0.get()) as usize;
            let rest = core::mem::replace(&mut (*page).free, ptr::null_mut());
            if HARDENED {
                // Plain links again, for the region's lists.
                let mut b = rest;
                while !b.is_null() {
                    let next = hardened::decode((*b).next, (*page).info.key);
                    (*b).next = next;
                    b = next;
                }
            }
            (taken, self.allowance0.get() - self.allowance.get(), rest)
        }
    }

    /// The owning thread frees `p`, a block of `units` units of `r`: onto
    /// the page if the pool is open on blocks of that length of `r` and has
    /// allowance left (the block keeps its reference: the pool settles it
    /// when closed). False when the caller must file it elsewhere.
    ///
    /// # Safety
    /// Called on the pool's thread; `p` is a live block of `r`, given up.
    #[inline(always)]
    pub(crate) unsafe fn put_back(&self, r: *mut NodeRegion, p: *mut u8, units: usize) -> bool {
        let left = self.allowance.get();
        if self.filled.get() == 0 || left == 0 || self.region.get() != r || self.units.get() != units {
            return false;
        }
        debug_assert_eq!(crate::alloc::engine::segment::segment_of(p).cast::<NodeRegion>(), r);
        self.allowance.set(left - 1);
        let page = self.page.get();
        let b = p.cast::<Block>();
        // SAFETY: we are on the pool's thread (the caller's word), so the page's free list
        // is ours; `p`, live and given up, takes the link in its first word.
        unsafe {
            (*b).next = if HARDENED { hardened::encode((*page).free, (*page).info.key) } else { (*page).free };
            (*page).free = b;
        }
        true
    }
}
