//! Regions: where interleaved buffers of a page and more are carved, page by
//! page, so that consecutive buffers of one node's turn are adjacent in the
//! address space (a run of I/O buffers is one extent, not one per buffer).
//!
//! A region is a 4 MiB segment (kind [`SegmentKind::Region`]) of one node's
//! arena, cut into 4 KiB *units*; its header fills the first unit(s). Every
//! block is a whole number of units: a bitmap says which units are in use,
//! and the block's first unit records its length, so a free needs no size
//! and `usable_size` is exact.
//!
//! One *carver* at a time (the thread of an exclusive space, or the holder
//! of a shared space's node lock) takes units: at the top of the free run
//! it is in (so that a turn's blocks are back to back), else from the lowest
//! free run that fits (so that freed space is reused for any size). Any
//! thread frees: it clears the block's bits, and the units become *dirty*
//! (free but still committed); the carver returns dirty units to the OS
//! (`MADV_DONTNEED`) once more than [`DIRTY_MAX`] of them pile up, so a
//! long-lived block pins its own pages, not the region's megabytes; under a
//! purge delay in rounds a delay apart, each returning only the units that
//! were dirty already at the round before (a unit freed behind the carver's
//! top would otherwise be returned and faulted in again when the carver
//! comes back).
//!
//! An exclusive space's thread (the region's *owner*) also keeps what it
//! frees on LIFO reuse lists by length, for the node's next allocation of
//! that length (a loop that allocates and frees an I/O buffer then cycles a
//! warm block instead of walking the region), up to [`REUSE_MAX`] units;
//! its frees change no shared word until the region is retired.
//!
//! Lifetime: every live block holds a reference (`live`, a [`RetireCount`]);
//! the space that carves a region holds none, but retires it when it lets
//! go of it (it is full, or the space is dropped). The region goes back to
//! its arena when it is retired and its last block is freed, whichever comes
//! last; the threads that free into a retired region return each 2 MiB of
//! it that no block uses any more (whole, so that huge pages stay whole).

use core::cell::Cell;
use core::ptr::{self, NonNull};

use super::engine::types::State;
use super::engine::types::{Block, SEGMENT_SIZE, Segment, SegmentKind};
use crate::os::mem::{self, Huge};
use crate::sync::{AtomicUsize, Ordering, RetireCount, UnitMap};

/// A region's unit of carving (the smallest page size).
pub(crate) const UNIT: usize = 4096;
const UNITS: usize = SEGMENT_SIZE / UNIT;
const WORDS: usize = UNITS / 64;
/// Set once a region has asked for transparent huge pages: only then do the
/// statistics look up what the kernel gave (a read of `/proc/self/smaps`).
pub(crate) static THP_ASKED: crate::sync::AtomicBool = crate::sync::AtomicBool::new(false);

/// Largest block a region serves; larger ones get a huge mapping of their own.
pub(crate) const REGION_MAX: usize = 1 << 20;
/// Largest alignment a region serves.
pub(crate) const REGION_ALIGN_MAX: usize = 64 * 1024;
/// Reuse lists: one per length in units up to this (256 KiB, the largest
/// size class); longer blocks go straight back to the bitmap.
const REUSE_LISTS: usize = 64;
/// Units an owner keeps on its reuse lists at most (1 MiB).
pub(crate) const REUSE_MAX: usize = 256;
/// Dirty units a region keeps committed before the carver purges them (2 MiB).
pub(crate) const DIRTY_MAX: usize = 512;

#[repr(C)]
pub(crate) struct NodeRegion {
    pub(crate) seg: Segment,
    /// Live blocks (references), and whether its space has let go of it.
    live: RetireCount,
    /// For a region of an exclusive space, until it is retired: the address
    /// of the thread interleaver whose space carves it (0 otherwise). Only
    /// the thread using that interleaver can see its own address there.
    owner: AtomicUsize,
    /// Which units are in use, which are dirty (free, not returned to the
    /// OS yet), and each block's length.
    units: UnitMap<WORDS>,
    /// The carver's: the next unit to carve and the end of the free run it
    /// is in (units from `top` to `limit` are free), and the cursor turn the
    /// last block carved belonged to.
    top: Cell<usize>,
    limit: Cell<usize>,
    last_turn: Cell<u64>,
    /// The carver's purge rounds (under a purge delay): the units dirty at
    /// the last round, and when the next may run (monotonic ms).
    aged: Cell<[u64; WORDS]>,
    next_purge: Cell<u64>,
    /// The owner's: references charged up front and not yet handed out, and
    /// blocks it freed (references dropped without an atomic operation);
    /// both settled when the region is retired.
    credit: Cell<usize>,
    owner_freed: Cell<usize>,
    /// The owner's: the next region of its space on the same node.
    pub(crate) next_owned: Cell<*mut NodeRegion>,
    /// The owner's reuse lists (blocks still marked in use, holding no
    /// reference), and their units.
    reuse_units: Cell<usize>,
    reuse: [Cell<*mut Block>; REUSE_LISTS],
}

/// Units the header takes.
const FIRST: usize = core::mem::size_of::<NodeRegion>().div_ceil(UNIT);
const _: () = assert!(FIRST == 1 && UNITS.is_multiple_of(64));

/// `x` rounded up to `a`, a power of two.
#[inline(always)]
pub(crate) fn up(x: usize, a: usize) -> usize {
    debug_assert!(a.is_power_of_two());
    (x + a - 1) & !(a - 1)
}

/// Units a block of `size` bytes takes.
#[inline(always)]
pub(crate) fn units_for(size: usize) -> usize {
    size.max(1).div_ceil(UNIT)
}

/// Maps a region bound to `node`'s memory (nearest other node when that one
/// is out of memory, as for any segment), reusing a cached segment-aligned
/// mapping of the node when there is one. `references` blocks are charged up
/// front (an exclusive space's credit), `owner` is its interleaver's address
/// (0 for a shared space); `huge` says which pages (see `Config::huge`).
pub(crate) fn map(
    state: &State,
    node: usize,
    references: usize,
    owner: usize,
    huge: Huge,
) -> Option<NonNull<NodeRegion>> {
    let arena = state.node_arena(node);
    if huge == Huge::Thp && !THP_ASKED.load(Ordering::Relaxed) {
        THP_ASKED.store(true, Ordering::Relaxed);
    }
    // Hugetlb pages first when asked (a cached mapping is of base pages); a
    // node whose pool is short gets base pages, counted.
    // Regions are 4 MiB: 2 MiB pages for either hugetlb size.
    let hugetlb = if huge.hugetlb_page().is_some() {
        let got = arena.map_hugetlb_bound(state, SEGMENT_SIZE);
        if got.is_none() && state.config.strict {
            // Strict: no base pages instead (the allocation fails).
            return None;
        }
        let c = if got.is_some() { &arena.counters.huge_regions } else { &arena.counters.huge_fallbacks };
        c.fetch_add(1, Ordering::Relaxed);
        got
    } else {
        None
    };
    let cached = if hugetlb.is_some() { None } else { arena.take_huge(state, SEGMENT_SIZE) };
    let fresh = cached.is_none();
    let (base, len) = match (hugetlb, cached) {
        (Some(b), _) => (b, SEGMENT_SIZE),
        (None, Some(c)) => c,
        (None, None) => {
            let b = arena.map_bound(state, SEGMENT_SIZE)?;
            if huge == Huge::Thp {
                // SAFETY: our fresh segment-aligned mapping. Failure (THP not
                // built in) leaves base pages.
                let _ = unsafe { mem::set_hugepages(b, SEGMENT_SIZE, true) };
            }
            (b, SEGMENT_SIZE + super::engine::arena::guard_len())
        }
    };
    debug_assert_eq!(base.as_ptr() as usize % SEGMENT_SIZE, 0);
    let r = base.as_ptr().cast::<NodeRegion>();
    // SAFETY: the header fits its units; a fresh mapping is zeroed, a reused
    // one (a dead region or a huge block's mapping) is cleared.
    unsafe {
        if !fresh {
            r.cast::<u8>().write_bytes(0, FIRST * UNIT);
        }
        ptr::addr_of_mut!((*r).seg).write(Segment::new(SegmentKind::Region, arena.node, base.as_ptr(), len));
        (*r).seg.hugetlb = hugetlb.is_some();
        (*r).live.reset(references);
        (*r).credit.set(if owner != 0 { references } else { 0 });
        (*r).owner.store(owner, Ordering::Relaxed);
        (*r).top.set(FIRST);
        (*r).limit.set(UNITS);
        (*r).last_turn.set(u64::MAX);
        // The header's units are never free.
        (*r).units.reserve(0, FIRST);
    }
    if fresh {
        if arena.spilled(state, base) {
            arena.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        arena.counters.reserved.fetch_add(len as u64, Ordering::Relaxed);
    }
    arena.counters.region_live.fetch_add(1, Ordering::Relaxed);
    super::engine::segmap::insert(base.as_ptr(), super::engine::types::SegmentKind::Region);
    NonNull::new(r)
}

impl NodeRegion {
    /// Carves a block of `units` units whose start is a multiple of `align`
    /// units (a power of two): at the top when it fits there (`turn`: the
    /// cursor turn it belongs to; a turn's first block starts on
    /// `turn_align` units, so that whole huge pages belong to one node),
    /// else at the lowest free run that fits. `None` when no run fits. The
    /// caller accounts for the block's reference.
    ///
    /// # Safety
    /// The caller is the region's carver (see the module docs).
    pub(crate) unsafe fn carve(&self, units: usize, align: usize, turn: u64, turn_align: usize) -> Option<*mut u8> {
        debug_assert!(units > 0 && units <= REGION_MAX / UNIT);
        let a = if self.last_turn.get() != turn { align.max(turn_align) } else { align };
        let start = up(self.top.get(), a);
        let start = if start + units <= self.limit.get() {
            start
        } else {
            self.purge_if_dirty();
            let (s, end) = self.find_run(units, a)?;
            self.limit.set(end);
            s
        };
        self.take(start, units);
        self.top.set(start + units);
        self.last_turn.set(turn);
        Some(self.addr(start))
    }

    /// Carves up to `n` blocks of `units` units back to back at the top
    /// (the first on a `first_align` boundary, in units), for a pool; how
    /// many were carved, and the first. The caller accounts for references.
    ///
    /// # Safety
    /// As [`carve`](Self::carve).
    pub(crate) unsafe fn carve_run(&self, units: usize, n: usize, first_align: usize) -> (usize, *mut u8) {
        let start = up(self.top.get(), first_align);
        let fit = self.limit.get().saturating_sub(start) / units;
        let n = n.min(fit);
        for i in 0..n {
            self.take(start + i * units, units);
        }
        if n > 0 {
            self.top.set(start + n * units);
        }
        (n, self.addr(start))
    }

    /// Undoes the last `n` blocks of `units` units carved at the top (never
    /// handed out), the first at `first`, and sets the top back to `top` (an
    /// address): a run carved ahead for a pool and not used.
    ///
    /// # Safety
    /// As [`carve`](Self::carve); the blocks were carved by the caller and
    /// are free.
    pub(crate) unsafe fn uncarve(&self, first: *mut u8, n: usize, units: usize, top: usize) {
        let i = self.index(first);
        debug_assert_eq!(i + n * units, self.top.get(), "only the top run can be uncarved");
        for k in 0..n {
            self.untake(i + k * units, units);
        }
        self.top.set(self.index(top as *mut u8));
    }

    /// The address of the region's top (the next unit to carve).
    ///
    /// # Safety
    /// As [`carve`](Self::carve).
    pub(crate) unsafe fn top(&self) -> usize {
        self as *const Self as usize + self.top.get() * UNIT
    }

    /// The cursor turn of the last block carved, and a setter for the
    /// window, which carves a turn's first block itself.
    pub(crate) fn last_turn(&self) -> u64 {
        self.last_turn.get()
    }

    /// See [`last_turn`](Self::last_turn).
    ///
    /// # Safety
    /// As [`carve`](Self::carve).
    pub(crate) unsafe fn set_last_turn(&self, turn: u64) {
        self.last_turn.set(turn);
    }

    /// The length in bytes of the block at `p` (0 if no block starts there).
    #[inline]
    pub(crate) fn block_size(&self, p: *const u8) -> usize {
        if !(p as usize).is_multiple_of(UNIT) {
            return 0;
        }
        self.units.block_len(self.index(p)) * UNIT
    }

    /// Marks `units` units from `start` in use, `start` the block's first.
    fn take(&self, start: usize, units: usize) {
        debug_assert_eq!(self.seg.kind, SegmentKind::Region);
        debug_assert!(start >= FIRST);
        self.units.take(start, units);
    }

    /// Marks the block of `units` units at `start` free (and dirty: still
    /// committed).
    fn untake(&self, start: usize, units: usize) {
        self.units.untake(start, units);
    }

    /// The lowest run of at least `units` free units starting on a multiple
    /// of `align` units: its start, and the end of the free run.
    fn find_run(&self, units: usize, align: usize) -> Option<(usize, usize)> {
        self.units.find_run(units, align, FIRST)
    }

    /// Returns dirty free units to the OS once more than [`DIRTY_MAX`] are
    /// waiting. Under a purge delay, in rounds at least a delay apart, each
    /// returning the units dirty already at the round before (the heap's pages
    /// likewise wait their delay): a region whose blocks come and go reuses
    /// its committed units instead of faulting them in again, and what it
    /// keeps is bounded by its size and what was freed within two delays.
    fn purge_if_dirty(&self) {
        if self.units.dirty_units() <= DIRTY_MAX {
            return;
        }
        let Some((state, now)) = State::try_get().and_then(|s| Some((s, super::engine::arena::delay_clock(s)?))) else {
            self.purge();
            return;
        };
        if now < self.next_purge.get() {
            return;
        }
        self.next_purge.set(now + state.config.purge_delay_ms);
        let mut aged = self.aged.get();
        let purged = self.units.purge_aged(&mut aged, |s, n| self.decommit(s, n));
        self.aged.set(aged);
        self.count_purged(purged);
    }

    /// Returns every dirty free unit to the OS (the carver only).
    fn purge(&self) {
        let purged = self.units.purge(|s, n| self.decommit(s, n));
        self.count_purged(purged);
    }

    /// With no carver left (retired): returns the 2 MiB around unit `i` to
    /// the OS if no block uses any of it. Only whole ones, so that huge
    /// pages are not split.
    fn purge_free_chunk(&self, i: usize) {
        // The header is in use: the region's first chunk is never returned.
        let purged = self.units.purge_free_chunk(i, (2 << 20) / UNIT, |s, n| self.decommit(s, n));
        self.count_purged(purged);
    }

    /// Returns `n` free units from `s` to the OS.
    fn decommit(&self, s: usize, n: usize) {
        // SAFETY: free units of ours, nobody's block.
        let _ = unsafe { mem::decommit(NonNull::new_unchecked(self.addr(s)), n * UNIT) };
    }

    fn count_purged(&self, units: usize) {
        if units > 0
            && let Some(state) = State::try_get()
        {
            let a = state.node_arena(usize::from(self.seg.arena));
            a.counters.purged.fetch_add((units * UNIT) as u64, Ordering::Relaxed);
        }
    }

    /// An owner's reuse list for blocks of `units` units: its first block, if
    /// it is aligned to `align` bytes (the caller charges its reference).
    ///
    /// # Safety
    /// The caller is the region's owner, before retiring it.
    #[inline(always)]
    pub(crate) unsafe fn pop_reuse(&self, units: usize, align: usize) -> Option<*mut u8> {
        let list = self.reuse.get(units - 1)?;
        let b = list.get();
        if b.is_null() || !(b as usize).is_multiple_of(align) {
            return None;
        }
        // SAFETY: a free block on the list: its first word is the link.
        list.set(unsafe { (*b).next });
        self.reuse_units.set(self.reuse_units.get() - units);
        Some(b.cast())
    }

    /// Files the chain `head ..= tail` of free blocks of `units` units (no
    /// references held) on the owner's reuse list, or in the bitmap once the
    /// lists hold [`REUSE_MAX`] units.
    ///
    /// # Safety
    /// As [`pop_reuse`](Self::pop_reuse); the blocks are this region's, in use
    /// in the bitmap, and the caller gives them up.
    pub(crate) unsafe fn file_free(&self, head: *mut Block, tail: *mut Block, units: usize) {
        let mut b = head;
        loop {
            // SAFETY: `b` is a free block of this region the caller gives up, so its first word
            // links the chain; read before filing overwrites it.
            let next = unsafe { (*b).next };
            match self.reuse.get(units - 1) {
                Some(list) if self.reuse_units.get() + units <= REUSE_MAX => {
                    // SAFETY: a free block of ours: its first word is the link.
                    unsafe { (*b).next = list.get() };
                    list.set(b);
                    self.reuse_units.set(self.reuse_units.get() + units);
                }
                _ => self.untake(self.index(b.cast()), units),
            }
            if b == tail {
                break;
            }
            b = next;
        }
    }

    /// Empties the reuse lists into the bitmap (before a search that might
    /// otherwise fail, and at retirement).
    fn flush_reuse(&self) {
        for (i, list) in self.reuse.iter().enumerate() {
            let mut b = list.replace(ptr::null_mut());
            while !b.is_null() {
                // SAFETY: blocks on the lists are free blocks of ours.
                let next = unsafe { (*b).next };
                self.untake(self.index(b.cast()), i + 1);
                b = next;
            }
        }
        self.reuse_units.set(0);
    }

    /// The owner frees a block of `units` units: reuse list or bitmap, its
    /// reference dropped without an atomic operation (settled at retirement).
    ///
    /// # Safety
    /// As [`file_free`](Self::file_free), for one live block the owner gives up.
    pub(crate) unsafe fn owner_free(&self, p: *mut u8, units: usize) {
        let b = p.cast::<Block>();
        // SAFETY: `p` is one live block of `units` units that the owner gives
        // up (the caller's word): a one-block chain for `file_free`.
        unsafe { self.file_free(b, b, units) };
        self.owner_freed.set(self.owner_freed.get() + 1);
    }

    /// References left to hand out (an exclusive space's).
    #[inline(always)]
    pub(crate) fn credit(&self) -> usize {
        self.credit.get()
    }

    /// Sets what [`credit`](Self::credit) returns (the owner only).
    #[inline(always)]
    pub(crate) fn set_credit(&self, credit: usize) {
        self.credit.set(credit);
    }

    /// Whether no block of the region is live (the owner's view: other
    /// threads' frees may make it true later, never false).
    pub(crate) fn is_unused(&self) -> bool {
        // Acquire: the frees counted are over before the caller reuses or
        // retires the region.
        self.live.count() == self.credit.get() + self.owner_freed.get()
    }

    /// Whether `owner` (the calling thread's interleaver in force) owns the
    /// region and has not retired it.
    #[inline(always)]
    pub(crate) fn owned_by(&self, owner: usize) -> bool {
        owner != 0 && self.owner.load(Ordering::Relaxed) == owner
    }

    /// Whether a block of `units` units aligned to `align` units would fit
    /// (the reuse lists emptied into the bitmap first).
    ///
    /// # Safety
    /// As [`pop_reuse`](Self::pop_reuse).
    pub(crate) unsafe fn has_room(&self, units: usize, align: usize) -> bool {
        self.flush_reuse();
        self.purge_if_dirty();
        self.find_run(units, align).is_some()
    }

    /// A carver that could find no room: empties the reuse lists into the
    /// bitmap so that the next search sees them; false if they were empty.
    ///
    /// # Safety
    /// As [`pop_reuse`](Self::pop_reuse).
    pub(crate) unsafe fn reclaim_reuse(&self) -> bool {
        if self.reuse_units.get() == 0 {
            return false;
        }
        self.flush_reuse();
        true
    }

    /// Takes one reference, for a block a shared space carves.
    pub(crate) fn acquire(&self) {
        let got = self.live.try_acquire();
        debug_assert_eq!(got, crate::sync::Acquired::Yes, "a reference on a retired region");
    }

    fn index(&self, p: *const u8) -> usize {
        debug_assert_eq!(self.seg.kind, SegmentKind::Region);
        debug_assert!(p as usize >= self as *const Self as usize, "a pointer below its region");
        let i = (p as usize - self as *const Self as usize) / UNIT;
        debug_assert!((FIRST..=UNITS).contains(&i), "a pointer outside its region");
        i
    }

    fn addr(&self, i: usize) -> *mut u8 {
        (self as *const Self as usize + i * UNIT) as *mut u8
    }
}

/// Lets go of `r`, the region a space carved from until now: the owner's
/// reuse lists emptied, free memory returned, the references charged up
/// front and not used and the owner's frees settled, then retired (and
/// freed, if no block is live).
///
/// # Safety
/// The caller is `r`'s carver (and owner, if it has one), calls this once,
/// and touches `r` no more.
pub(crate) unsafe fn retire(r: NonNull<NodeRegion>) {
    let r = r.as_ptr();
    // SAFETY: the caller is `r`'s carver (and owner, if any), retires it once
    // and touches it no more: no one else writes its carver-only fields, and
    // the region stays mapped until `live.retire()` below finds no block
    // live and unmaps it, after the last use of `reg`.
    unsafe {
        let reg = &*r;
        reg.flush_reuse();
        // A region with a block still live keeps only its pages: the rest
        // goes back now. One with none goes back whole, below, to its
        // arena's cache of mappings (pages, and huge pages, intact).
        if !reg.is_unused() {
            reg.purge();
        }
        // From now on every free goes through `live`, and returns its units
        // to the OS at once.
        reg.owner.store(0, Ordering::Relaxed);
        let settle = reg.credit.replace(0) + reg.owner_freed.replace(0);
        if settle > 0 {
            // Not retired yet: this cannot be the freeing release.
            let last = reg.live.release_n(settle);
            debug_assert!(!last);
        }
        if reg.live.retire() {
            unmap(r);
        }
    }
}

/// Frees a block of region `seg` that its owner does not keep: its units
/// back to the bitmap (to the OS at once in a retired region), its
/// reference dropped; the region goes with its last block once retired.
///
/// # Safety
/// `p` is a live block of region `seg`, given up by the caller.
pub(crate) unsafe fn free_shared(seg: *mut Segment, p: *mut u8) {
    let r = seg.cast::<NodeRegion>();
    // SAFETY: `p` is a live block of region `seg` (the caller's word), holding a
    // reference, so the region stays mapped until our `release`.
    unsafe {
        let reg = &*r;
        let units = reg.block_size(p) / UNIT;
        debug_assert!(units > 0, "free of a pointer that is no region block");
        let i = reg.index(p);
        reg.untake(i, units);
        // A retired region has no carver: the freeing threads return each
        // 2 MiB of it that no block uses any more (several at once do no
        // harm). Only whole ones, so that huge pages are not split: a
        // mapping whose last block goes is reused whole by its arena.
        if reg.live.is_retired() {
            reg.purge_free_chunk(i);
        }
        if reg.live.release() {
            unmap(r);
        }
    }
}

/// Gives a dead region's mapping back: to its arena's cache of
/// segment-aligned mappings, else to the OS.
///
/// # Safety
/// Retired with no live block: nobody else can reach `r`.
unsafe fn unmap(r: *mut NodeRegion) {
    // SAFETY: `r` is retired with no live block (the caller's word): nobody else can
    // reach it, and its header is still mapped.
    let (node, base, len, hugetlb) =
        unsafe { (usize::from((*r).seg.arena), (*r).seg.map_base, (*r).seg.map_len, (*r).seg.hugetlb) };
    super::engine::segmap::remove(base);
    // SAFETY: the region's own mapping.
    let base = unsafe { NonNull::new_unchecked(base) };
    if let Some(state) = State::try_get() {
        let a = state.node_arena(node);
        a.counters.region_live.fetch_sub(1, Ordering::Relaxed);
        // A hugetlb mapping goes back to the pool: as a cached mapping it
        // could be reused as a huge block, which `mremap` cannot resize.
        if !hugetlb && a.keep_huge(state, base, len) {
            return;
        }
        a.counters.reserved.fetch_sub(len as u64, Ordering::Relaxed);
        a.counters.purged.fetch_add(len as u64, Ordering::Relaxed);
    }
    // SAFETY: a whole mapping of ours with no live block.
    let _ = unsafe { mem::unmap(base, len) };
}

/// The usable size of the region block at `p`.
///
/// # Safety
/// `p` is a live block of region `seg`.
pub(crate) unsafe fn usable_size(seg: *mut Segment, p: *const u8) -> usize {
    // SAFETY: `p` is a live block of region `seg` (the caller's word), so the
    // region header is live.
    unsafe { (*seg.cast::<NodeRegion>()).block_size(p) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A region of this thread (exclusive), checked through its bitmap:
    /// turns back to back, free without a size, reuse across lengths,
    /// the owner's lists bounded, dirty memory purged.
    #[test]
    fn carving_freeing_and_reuse() {
        let state = crate::alloc::config::state();
        let node = state.current_arena().node;
        let owner = 0x1000;
        let r = map(state, node, 1 << 20, owner, Huge::Off).unwrap();
        // SAFETY: our region; we are its carver and owner.
        unsafe {
            let reg = r.as_ref();
            let a = reg.carve(1, 1, 0, 1).unwrap();
            let b = reg.carve(2, 1, 0, 1).unwrap();
            assert_eq!(b as usize - a as usize, UNIT, "a turn's blocks are back to back");
            assert_eq!((reg.block_size(a), reg.block_size(b)), (UNIT, 2 * UNIT));
            assert_eq!(reg.block_size(b.add(UNIT)), 0, "no block starts inside another");
            // A new turn starts on its alignment (16 units here).
            let c = reg.carve(1, 1, 1, 16).unwrap();
            assert_eq!((c as usize - r.as_ptr() as usize) % (16 * UNIT), 0);
            // Freed into the bitmap (no owner path), the lowest run serves
            // the next search, for another length.
            reg.untake(reg.index(a), 1);
            reg.untake(reg.index(b), 2);
            reg.top.set(reg.limit.get());
            let d = reg.carve(3, 1, 1, 1).unwrap();
            assert_eq!(d, a, "three freed units reused for a three-unit block");
            // The owner's lists keep at most REUSE_MAX units; the rest is dirty.
            let blocks: Vec<*mut u8> = (0..300).map(|_| reg.carve(1, 1, 1, 1).unwrap()).collect();
            for &p in &blocks {
                reg.owner_free(p, 1);
            }
            assert_eq!(reg.reuse_units.get(), REUSE_MAX);
            assert_eq!(reg.units.dirty_units(), 300 - REUSE_MAX);
            assert_eq!(reg.pop_reuse(1, UNIT), Some(blocks[REUSE_MAX - 1]), "LIFO");
            reg.flush_reuse();
            assert_eq!(reg.units.dirty_units(), 299, "all but the one popped");
            reg.purge();
            assert_eq!(reg.units.dirty_units(), 0);
            reg.untake(reg.index(blocks[REUSE_MAX - 1]), 1);
            for p in [c, d] {
                reg.untake(reg.index(p), reg.block_size(p) / UNIT);
            }
            assert!(reg.owned_by(owner) && !reg.owned_by(0));
            reg.credit.set((1 << 20) - 300);
            assert!(reg.is_unused());
            retire(r);
        }
    }
}
