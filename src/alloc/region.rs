//! Bump regions: where interleaved and node-directed allocations are carved,
//! so that consecutive allocations of one node's turn are adjacent in the
//! address space (a run of I/O buffers is one extent, not one per buffer).
//!
//! A region is a 4 MiB segment (kind [`REGION`]) of one node's arena, carved
//! front to back by any thread with a CAS on its `top`; it is never reused
//! piecemeal. Every live block holds a reference (`live`); the [`Space`] that
//! carves from the region holds none, but *retires* it (a [`RetireCount`]) when
//! it moves to a fresh one. The region goes back to the OS when it is retired
//! and its last block is freed, whichever comes last: freeing is a single
//! `fetch_sub` from any thread, through the global allocator like any block.
//!
//! A block-start bitmap (one bit per 16 bytes) answers `usable_size`.

use core::ptr::{self, NonNull};

use super::segment::{SEGMENT_SIZE, SLOT_SIZE, Segment};
use super::state::State;
use crate::os::mem;
use crate::sync::{Acquired, AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering, RetireCount, SpinLock};
use crate::topology::MAX_NODES;

/// Segment kind of a region.
pub(crate) const REGION: u8 = 0x3c;
/// Blocks start this far into the region (the header and bitmap come first).
const DATA: usize = SLOT_SIZE;
const GRAIN: usize = 16;
const BITMAP_WORDS: usize = SEGMENT_SIZE / GRAIN / 64;
/// References an exclusive space charges a region with (more than it can
/// hold blocks).
const CREDIT: usize = 1 << 24;
/// Blocks this large or larger start on a page (4 KiB, the smallest page
/// size; the real page size is asked only for them).
const PAGE_MIN: usize = 4096;
/// Largest block a region serves; larger ones get a huge mapping of their own.
pub(crate) const REGION_MAX: usize = 1 << 20;
/// Largest alignment a region serves.
pub(crate) const REGION_ALIGN_MAX: usize = SLOT_SIZE;

#[repr(C)]
pub(crate) struct Region {
    pub(crate) seg: Segment,
    /// Offset of the first byte not carved yet.
    top: AtomicUsize,
    /// Live blocks (references), retired once its space has moved on.
    live: RetireCount,
    /// The cursor turn the last block belonged to (a hint for aligning the
    /// start of each turn).
    last_turn: AtomicU64,
    /// For a region of an exclusive space: the owning thread's token (0
    /// otherwise). Its own frees only bump `owner_freed` (plain store, no
    /// read-modify-write) until it retires the region and settles them.
    owner: AtomicUsize,
    owner_freed: AtomicUsize,
    owner_retired: AtomicBool,
    starts: [AtomicU64; BITMAP_WORDS],
}

const _: () = assert!(core::mem::size_of::<Region>() <= DATA);

/// `x` rounded up to `a`, a power of two (a mask, not a division: this is on
/// every interleaved allocation).
#[inline(always)]
pub(crate) fn up(x: usize, a: usize) -> usize {
    debug_assert!(a.is_power_of_two());
    (x + a - 1) & !(a - 1)
}

/// Where a space carves for each node: the current region, replaced under a
/// lock when full.
pub(crate) struct Space {
    current: [AtomicPtr<Region>; MAX_NODES],
    /// Carved by one thread only (a scoped policy's): plain loads and stores
    /// instead of read-modify-writes, and each current region is charged
    /// `CREDIT` references up front (the unused rest given back when it is
    /// retired) instead of one `fetch_add` per block.
    pub(crate) exclusive: bool,
    credit: [AtomicUsize; MAX_NODES],
    /// A shared space's per-node carving locks.
    pub(crate) locks: [SpinLock<()>; MAX_NODES],
    /// A turn's first block is aligned to this (a page, or 2 MiB for byte
    /// turns of 2 MiB or more, so whole huge pages belong to one node).
    turn_align: usize,
}

impl Space {
    pub(crate) fn new(turn_align: usize) -> Self {
        Self {
            current: core::array::from_fn(|_| AtomicPtr::new(ptr::null_mut())),
            exclusive: false,
            credit: core::array::from_fn(|_| AtomicUsize::new(0)),
            locks: core::array::from_fn(|_| SpinLock::new(())),
            turn_align: turn_align.clamp(crate::os::page_size(), SEGMENT_SIZE / 2),
        }
    }

    /// A block of `size` bytes aligned to `align` on `node`'s region, as part
    /// of cursor turn `turn`. Null when the node's arena cannot map a region.
    ///
    /// A shared space carves under its node's lock: a thread may only take a
    /// reference on a region while it is current, and a region stops being
    /// current (and is retired, and perhaps freed) under the same lock, so
    /// no thread ever touches a region that was freed under it. An exclusive
    /// space has no other carver and needs no lock.
    #[inline]
    pub(crate) fn alloc(&self, node: usize, size: usize, align: usize, turn: u64) -> *mut u8 {
        debug_assert!(size <= REGION_MAX && align <= REGION_ALIGN_MAX);
        let (size, align) = block_layout(size, align);
        if self.exclusive {
            loop {
                let r = self.current[node].load(Ordering::Relaxed);
                if !r.is_null() {
                    // SAFETY: the current region of an exclusive space is
                    // retired only by this thread.
                    if let Some(p) = unsafe { self.carve(r, node, size, align, turn) } {
                        return p;
                    }
                }
                if !self.replace(node, r) {
                    return ptr::null_mut();
                }
            }
        }
        let _g = self.locks[node].lock();
        loop {
            let r = self.current[node].load(Ordering::Acquire);
            if !r.is_null() {
                // SAFETY: the current region is live: retired only once it is
                // no longer current, which needs the lock we hold.
                if let Some(p) = unsafe { self.carve(r, node, size, align, turn) } {
                    return p;
                }
            }
            if !self.replace(node, r) {
                return ptr::null_mut();
            }
        }
    }

    /// For an exclusive space's caller that serves the rest of a turn on its
    /// own: the node's current region, its top, its end, and the credit left.
    pub(crate) fn window_state(&self, node: usize) -> Option<(*mut Region, usize, usize, usize)> {
        debug_assert!(self.exclusive);
        let r = self.current[node].load(Ordering::Relaxed);
        if r.is_null() {
            return None;
        }
        // SAFETY: the current region of an exclusive space, used by this thread only.
        let top = unsafe { (*r).top.load(Ordering::Relaxed) };
        Some((r, r as usize + top, r as usize + SEGMENT_SIZE, self.credit[node].load(Ordering::Relaxed)))
    }

    /// Takes back the credit a window left (see [`window_state`](Self::window_state)).
    pub(crate) fn settle_credit(&self, node: usize, credit: usize) {
        self.credit[node].store(credit, Ordering::Relaxed);
    }

    /// Carves a block at the top of `r`, the current region for `node`. Its
    /// reference comes from the exclusive space's credit, or (shared) is
    /// taken on the region's count.
    ///
    /// # Safety
    /// `r` is the current region for `node`, and the caller holds the node's
    /// lock (shared) or is the space's thread (exclusive): no one else
    /// carves it, and frees never touch its top or bitmap.
    #[inline(always)]
    unsafe fn carve(&self, r: *mut Region, node: usize, size: usize, align: usize, turn: u64) -> Option<*mut u8> {
        // SAFETY: see `alloc`.
        let reg = unsafe { &*r };
        let new_turn = reg.last_turn.load(Ordering::Relaxed) != turn;
        let a = if new_turn { align.max(self.turn_align) } else { align };
        let start = r as usize + up(reg.top.load(Ordering::Relaxed), a);
        let end = start + size;
        if end > r as usize + SEGMENT_SIZE {
            return None;
        }
        if self.exclusive {
            let credit = self.credit[node].load(Ordering::Relaxed);
            if credit == 0 {
                return None;
            }
            self.credit[node].store(credit - 1, Ordering::Relaxed);
        } else {
            // Current, so not retired: the reference is ours.
            let got = reg.live.try_acquire();
            debug_assert_eq!(got, Acquired::Yes);
        }
        // SAFETY: per the contract, `start..end` is free space at its top.
        unsafe { book(r, start, end) };
        if new_turn {
            reg.last_turn.store(turn, Ordering::Relaxed);
        }
        Some(start as *mut u8)
    }

    /// Retires `r`, this space's region for `node` until now.
    ///
    /// # Safety
    /// As [`retire`]; `r` was current for `node`; for an exclusive space,
    /// called on the owning thread.
    unsafe fn retire_current(&self, node: usize, r: *mut Region) {
        if self.exclusive {
            // SAFETY: per the contract; the owner's fields are ours.
            unsafe {
                // From now on the owner's frees go through `live` too.
                (*r).owner_retired.store(true, Ordering::Relaxed);
                // Give back the credit not turned into blocks, and settle the
                // owner's frees so far.
                let unused = self.credit[node].swap(0, Ordering::Relaxed);
                let freed = (*r).owner_freed.load(Ordering::Relaxed);
                // Not retired yet: this cannot be the freeing release.
                let last = (*r).live.release_n(unused + freed);
                debug_assert!(!last);
            }
        }
        // SAFETY: per the contract.
        unsafe { retire(r) };
    }

    /// Makes a fresh region current for `node` in place of `full`, which is
    /// retired; false when none can be mapped.
    ///
    /// Called with the node's lock held (shared) or by the owning thread
    /// (exclusive), so `full` is still the current region.
    #[cold]
    fn replace(&self, node: usize, full: *mut Region) -> bool {
        let Some(state) = State::try_get() else { return false };
        let Some(fresh) = map(state, node) else { return false };
        if !full.is_null() {
            // SAFETY: nobody can take a reference on it any more (see
            // `alloc`): retired once, here, before its credit (exclusive)
            // makes way for the fresh region's.
            unsafe { self.retire_current(node, full) };
        }
        if self.exclusive {
            // SAFETY: fresh, not yet visible to anyone.
            unsafe {
                (*fresh.as_ptr()).live.reset(CREDIT);
                (*fresh.as_ptr()).owner.store(thread_token(), Ordering::Relaxed);
            }
            self.credit[node].store(CREDIT, Ordering::Relaxed);
        }
        self.current[node].store(fresh.as_ptr(), Ordering::Release);
        true
    }
}

impl Drop for Space {
    fn drop(&mut self) {
        for node in 0..MAX_NODES {
            let r = self.current[node].swap(ptr::null_mut(), Ordering::AcqRel);
            if !r.is_null() {
                // SAFETY: our current region, retired once.
                unsafe { self.retire_current(node, r) };
            }
        }
    }
}

/// Maps a region bound to `node`'s memory (nearest other node when that one
/// is out of memory, as for any segment), reusing a cached segment-aligned
/// mapping of the node when there is one (an interleave that frees as it
/// goes would otherwise map and unmap 4 MiB every thousand 4 KiB blocks).
fn map(state: &State, node: usize) -> Option<NonNull<Region>> {
    let arena = state.node_arena(node);
    let cached = arena.take_huge(SEGMENT_SIZE);
    let fresh = cached.is_none();
    let (base, len) = match cached {
        Some(c) => c,
        None => (arena.map_bound(state, SEGMENT_SIZE)?, SEGMENT_SIZE),
    };
    let r = base.as_ptr().cast::<Region>();
    // SAFETY: the header fits before `DATA`; a fresh mapping is zeroed, a
    // reused one gets its counters and bitmap cleared.
    unsafe {
        ptr::addr_of_mut!((*r).seg).write(Segment {
            kind: REGION,
            arena: arena.node as u8,
            map_base: base.as_ptr(),
            map_len: len,
            next: ptr::null_mut(),
        });
        (*r).top.store(DATA, Ordering::Relaxed);
        (*r).live.reset(0);
        (*r).owner.store(0, Ordering::Relaxed);
        (*r).owner_freed.store(0, Ordering::Relaxed);
        (*r).owner_retired.store(false, Ordering::Relaxed);
        (*r).last_turn.store(u64::MAX, Ordering::Relaxed);
        if !fresh {
            ptr::addr_of_mut!((*r).starts).write_bytes(0, 1);
        }
    }
    if fresh {
        if arena.spilled(state, base) {
            arena.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        arena.counters.reserved.fetch_add(len as u64, Ordering::Relaxed);
    }
    arena.counters.region_live.fetch_add(1, Ordering::Relaxed);
    NonNull::new(r)
}

/// Marks `r` retired; frees it if no block is live.
///
/// # Safety
/// `r` is a live region that its space has just stopped using; called once.
unsafe fn retire(r: *mut Region) {
    // SAFETY: per the contract.
    if unsafe { (*r).live.retire() } {
        // SAFETY: retired with no live block: nobody can reach it again.
        unsafe { unmap(r) };
    }
}

/// Drops one block's reference; frees the region after its last block once retired.
///
/// # Safety
/// The caller holds a reference (a live block of `r`, or one taken in `carve`).
unsafe fn release(r: *mut Region) {
    // SAFETY: our reference keeps it alive until this returns.
    if unsafe { (*r).live.release() } {
        // SAFETY: retired, and ours was the last reference.
        unsafe { unmap(r) };
    }
}

/// The size and alignment a region block of `size` bytes aligned to `align`
/// really gets: a multiple of 16 bytes, and a page alignment for blocks of
/// a page or more (a turn of I/O buffers then covers whole pages).
#[inline(always)]
pub(crate) fn block_layout(size: usize, align: usize) -> (usize, usize) {
    if up(size.max(1), GRAIN) >= PAGE_MIN {
        block_layout_in(size, align, crate::os::page_size())
    } else {
        block_layout_in(size, align, usize::MAX)
    }
}

/// [`block_layout`] with the page size known (`usize::MAX`: no page rule).
#[inline(always)]
pub(crate) fn block_layout_in(size: usize, align: usize, page: usize) -> (usize, usize) {
    let size = up(size.max(1), GRAIN);
    let align = if size >= page { align.max(page) } else { align.max(GRAIN) };
    (size, align)
}

/// Books a block carved at `start..end` (addresses) of region `r`: the
/// region's top and the block's start bit.
///
/// # Safety
/// `r` is a current region that only the caller carves (an exclusive
/// space's thread, or a shared space's lock holder), and `start..end` was
/// free space at its top. Frees never touch the top or the bitmap.
#[inline(always)]
pub(crate) unsafe fn book(r: *mut Region, start: usize, end: usize) {
    // SAFETY: per the contract.
    let reg = unsafe { &*r };
    reg.top.store(end - r as usize, Ordering::Relaxed);
    let bit = (start - r as usize) / GRAIN;
    let w = &reg.starts[bit / 64];
    w.store(w.load(Ordering::Relaxed) | 1 << (bit % 64), Ordering::Relaxed);
}

/// Gives a dead region's mapping back: to its arena's cache of
/// segment-aligned mappings, else to the OS.
///
/// # Safety
/// Retired with no live block: nobody else can reach `r`.
unsafe fn unmap(r: *mut Region) {
    // SAFETY: per the contract the header is ours.
    let (node, base, len) = unsafe { (usize::from((*r).seg.arena), (*r).seg.map_base, (*r).seg.map_len) };
    // SAFETY: the region's own mapping.
    let base = unsafe { NonNull::new_unchecked(base) };
    if let Some(state) = State::try_get() {
        let a = state.node_arena(node);
        a.counters.region_live.fetch_sub(1, Ordering::Relaxed);
        if a.keep_huge(state, base, len) {
            return;
        }
        a.counters.reserved.fetch_sub(len as u64, Ordering::Relaxed);
        a.counters.purged.fetch_add(len as u64, Ordering::Relaxed);
    }
    // SAFETY: a whole mapping of ours with no live block.
    let _ = unsafe { mem::unmap(base, len) };
}

thread_local! {
    /// Its address identifies the thread (never 0; unique among live threads).
    static TOKEN: u8 = const { 0 };
}

#[inline(always)]
fn thread_token() -> usize {
    TOKEN.with(|t| t as *const u8 as usize)
}

/// Frees a block of region `seg`.
///
/// # Safety
/// `seg` is the region of a live block that the caller gives up.
#[inline]
pub(crate) unsafe fn free(seg: *mut Segment) {
    let r = seg.cast::<Region>();
    // SAFETY: per the contract the region is live.
    unsafe {
        let owner = (*r).owner.load(Ordering::Relaxed);
        // The owning thread, before it retires the region: a plain count.
        if owner != 0 && owner == thread_token() && !(*r).owner_retired.load(Ordering::Relaxed) {
            let f = &(*r).owner_freed;
            f.store(f.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            return;
        }
        release(r)
    }
}

/// The usable size of the region block at `p`: up to the next block's start
/// (or the region's top).
///
/// # Safety
/// `p` is a live block of region `seg`.
pub(crate) unsafe fn usable_size(seg: *mut Segment, p: *const u8) -> usize {
    // SAFETY: per the contract.
    let r = unsafe { &*seg.cast::<Region>() };
    let off = p as usize - seg as usize;
    let top = r.top.load(Ordering::Acquire);
    let mut bit = off / GRAIN + 1;
    while bit * GRAIN < top {
        let w = r.starts[bit / 64].load(Ordering::Acquire) >> (bit % 64);
        if w != 0 {
            return (bit + w.trailing_zeros() as usize) * GRAIN - off;
        }
        bit = (bit / 64 + 1) * 64;
    }
    top - off
}
