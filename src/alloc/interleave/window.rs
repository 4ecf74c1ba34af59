//! The window: the turn in progress of a thread interleaver, served without
//! picking. It holds the turn's node and that node's current region (whose
//! top and credit it carves and spends in place), and what is left of the
//! turn; it is booked into the cursor ([`ThreadInterleaver::close_window`])
//! before the cursor is used for anything else. One thread only: plain cells.
//!
//! [`ThreadInterleaver::close_window`]: super::ThreadInterleaver

use core::cell::Cell;
use core::ptr;

use crate::alloc::region::NodeRegion;
use crate::policy::Pick;

pub(crate) struct Window {
    /// `Count`: the allocations left in the turn (0: closed).
    allocs_left: Cell<u64>,
    /// `Bytes`: the bytes served since the window opened (closed once they
    /// reach `limit`: a byte turn ends at the allocation that reaches it).
    bytes_served: Cell<u64>,
    /// `Count`: allocations left when it opened. `Bytes`: the bytes the turn
    /// had left then. 0: closed.
    limit: Cell<u64>,
    /// The turn's node and that node's current region.
    region: Cell<*mut NodeRegion>,
    node: Cell<usize>,
    /// The turn, and whether none of its blocks was carved yet (its first
    /// one starts on the space's turn alignment).
    turn: Cell<u64>,
    fresh: Cell<bool>,
    /// Whether the interleave counts allocations (else bytes).
    count: bool,
}

impl Window {
    pub(crate) fn new(count: bool) -> Self {
        Self {
            allocs_left: Cell::new(0),
            bytes_served: Cell::new(0),
            limit: Cell::new(0),
            region: Cell::new(ptr::null_mut()),
            node: Cell::new(0),
            turn: Cell::new(0),
            fresh: Cell::new(false),
            count,
        }
    }

    /// Opens the window on `left` of turn `pick` (allocations, or bytes) in
    /// `r`, its node's current region; `fresh`: none of the turn's blocks
    /// was carved yet.
    #[inline(always)]
    pub(crate) fn open(&self, r: *mut NodeRegion, pick: Pick, left: u64, fresh: bool) {
        debug_assert!(!r.is_null() && left > 0);
        self.region.set(r);
        self.node.set(pick.node);
        self.turn.set(pick.turn);
        self.fresh.set(fresh);
        if self.count {
            self.allocs_left.set(left);
        } else {
            self.bytes_served.set(0);
        }
        self.limit.set(left);
    }

    /// Whether some of the turn is left (a byte turn ends at the allocation
    /// that reaches its bytes).
    #[inline(always)]
    pub(crate) fn is_open(&self) -> bool {
        if self.count { self.allocs_left.get() != 0 } else { self.bytes_served.get() < self.limit.get() }
    }

    /// Allocations the turn has left for blocks of `size` bytes (0: closed).
    #[inline(always)]
    pub(crate) fn allocations_left(&self, size: usize) -> u64 {
        if self.count {
            self.allocs_left.get()
        } else {
            self.limit.get().saturating_sub(self.bytes_served.get()).div_ceil(size as u64)
        }
    }

    /// Books `n` allocations of `size` bytes served (negative: given back).
    #[inline(always)]
    pub(crate) fn serve(&self, n: i64, size: usize) {
        if self.count {
            debug_assert!(n <= self.allocs_left.get() as i64, "a count turn served past its end");
            self.allocs_left.set((self.allocs_left.get() as i64 - n) as u64);
        } else {
            self.bytes_served.set((self.bytes_served.get() as i64 + n * size as i64) as u64);
        }
    }

    /// Closes the window: what it served, as (allocations, bytes) for the
    /// cursor to settle; `None` when it was closed.
    #[inline(always)]
    pub(crate) fn close(&self) -> Option<(u64, u64)> {
        let limit = self.limit.get();
        if limit == 0 {
            return None;
        }
        self.limit.set(0);
        Some(if self.count {
            (limit - self.allocs_left.replace(0), 0)
        } else {
            let bytes = self.bytes_served.replace(0);
            (u64::from(bytes > 0), bytes)
        })
    }

    /// The turn's node and region.
    #[inline(always)]
    pub(crate) fn turn(&self) -> (usize, *mut NodeRegion) {
        (self.node.get(), self.region.get())
    }

    /// The alignment (in units) of the next block carved in the window: the
    /// turn's first starts on `turn_units`.
    #[inline(always)]
    pub(crate) fn first_align(&self, align: usize, turn_units: usize) -> usize {
        if self.fresh.get() { align.max(turn_units) } else { align }
    }

    /// A block of the turn was carved in the window's region.
    ///
    /// # Safety
    /// The caller is the region's carver.
    #[inline(always)]
    pub(crate) unsafe fn carved(&self) {
        if self.fresh.replace(false) {
            // SAFETY: the caller is the region's carver, the one thread that
            // writes its last turn.
            unsafe { (*self.region.get()).set_last_turn(self.turn.get()) };
        }
    }
}
