//! Bump regions: where interleaved and node-directed allocations are carved,
//! so that consecutive allocations of one node's turn are adjacent in the
//! address space (a run of I/O buffers is one extent, not one per buffer).
//!
//! A region is a 4 MiB segment (kind [`REGION`]) of one node's arena, carved
//! front to back by any thread with a CAS on its `top`; it is never reused
//! piecemeal. Every live block holds a reference (`live`); the [`Space`] that
//! carves from the region holds none, but *retires* it (sets `RETIRED`) when
//! it moves to a fresh one. The region goes back to the OS when it is retired
//! and its last block is freed, whichever comes last: freeing is a single
//! `fetch_sub` from any thread, through the global allocator like any block.
//!
//! A block-start bitmap (one bit per 16 bytes) answers `usable_size`.

use core::ptr::{self, NonNull};

use super::segment::{SEGMENT_SIZE, SLOT_SIZE, Segment};
use super::state::State;
use crate::os::mem::{self, BindFlags, MemPolicy};
use crate::sync::{AtomicPtr, AtomicU64, AtomicUsize, Ordering, SpinLock};
use crate::topology::MAX_NODES;

/// Segment kind of a region.
pub(crate) const REGION: u8 = 0x3c;
/// Blocks start this far into the region (the header and bitmap come first).
const DATA: usize = SLOT_SIZE;
const GRAIN: usize = 16;
const BITMAP_WORDS: usize = SEGMENT_SIZE / GRAIN / 64;
const RETIRED: usize = 1 << (usize::BITS - 1);
/// Largest block a region serves; larger ones get a huge mapping of their own.
pub(crate) const REGION_MAX: usize = 1 << 20;
/// Largest alignment a region serves.
pub(crate) const REGION_ALIGN_MAX: usize = SLOT_SIZE;

#[repr(C)]
pub(crate) struct Region {
    pub(crate) seg: Segment,
    /// Offset of the first byte not carved yet.
    top: AtomicUsize,
    /// Live blocks, plus `RETIRED` once its space has moved on.
    live: AtomicUsize,
    /// The cursor turn the last block belonged to (a hint for aligning the
    /// start of each turn).
    last_turn: AtomicU64,
    starts: [AtomicU64; BITMAP_WORDS],
}

const _: () = assert!(core::mem::size_of::<Region>() <= DATA);

/// Where a space carves for each node: the current region, replaced under a
/// lock when full.
pub(crate) struct Space {
    current: [AtomicPtr<Region>; MAX_NODES],
    replace: SpinLock<()>,
    /// A turn's first block is aligned to this (a page, or 2 MiB for byte
    /// turns of 2 MiB or more, so whole huge pages belong to one node).
    turn_align: usize,
}

impl Space {
    pub(crate) fn new(turn_align: usize) -> Self {
        Self {
            current: core::array::from_fn(|_| AtomicPtr::new(ptr::null_mut())),
            replace: SpinLock::new(()),
            turn_align: turn_align.clamp(crate::os::page_size(), SEGMENT_SIZE / 2),
        }
    }

    /// A block of `size` bytes aligned to `align` on `node`'s region, as part
    /// of cursor turn `turn`. Null when the node's arena cannot map a region.
    pub(crate) fn alloc(&self, state: &State, node: usize, size: usize, align: usize, turn: u64) -> *mut u8 {
        debug_assert!(size <= REGION_MAX && align <= REGION_ALIGN_MAX);
        let size = size.max(1).next_multiple_of(GRAIN);
        // Blocks of a page or more start on a page: a turn of I/O buffers
        // then covers whole pages.
        let page = crate::os::page_size();
        let align = if size >= page { align.max(page) } else { align.max(GRAIN) };
        loop {
            let r = self.current[node].load(Ordering::Acquire);
            if !r.is_null() {
                // SAFETY: a current region is live: retired (and so freeable)
                // only after it stops being current, and our reference below
                // keeps it from being freed while we carve.
                if let Some(p) = unsafe { self.carve(r, size, align, turn) } {
                    return p;
                }
            }
            if !self.replace_full(state, node, r) {
                return ptr::null_mut();
            }
        }
    }

    /// # Safety
    /// `r` is (or was until just now) this space's current region for its node.
    unsafe fn carve(&self, r: *mut Region, size: usize, align: usize, turn: u64) -> Option<*mut u8> {
        // SAFETY: see `alloc`.
        let reg = unsafe { &*r };
        // Take the block's reference first: a region seen retired is left alone.
        if reg.live.fetch_add(1, Ordering::Acquire) & RETIRED != 0 {
            // SAFETY: the reference we just took.
            unsafe { release(r) };
            return None;
        }
        let new_turn = reg.last_turn.load(Ordering::Relaxed) != turn;
        let mut top = reg.top.load(Ordering::Relaxed);
        loop {
            let mut start = top.next_multiple_of(align);
            if new_turn {
                start = start.next_multiple_of(self.turn_align);
            }
            let end = start + size;
            if end > SEGMENT_SIZE {
                // SAFETY: the reference taken above.
                unsafe { release(r) };
                return None;
            }
            match reg.top.compare_exchange_weak(top, end, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => {
                    let bit = start / GRAIN;
                    reg.starts[bit / 64].fetch_or(1 << (bit % 64), Ordering::Relaxed);
                    if new_turn {
                        reg.last_turn.store(turn, Ordering::Relaxed);
                    }
                    return Some(r.cast::<u8>().wrapping_add(start));
                }
                Err(t) => top = t,
            }
        }
    }

    /// Makes a fresh region current for `node` if `full` still is; false when
    /// none can be mapped.
    fn replace_full(&self, state: &State, node: usize, full: *mut Region) -> bool {
        let _g = self.replace.lock();
        if self.current[node].load(Ordering::Relaxed) != full {
            return true; // another thread replaced it
        }
        let Some(fresh) = map(state, node) else { return false };
        self.current[node].store(fresh.as_ptr(), Ordering::Release);
        if !full.is_null() {
            // SAFETY: it was current until the store above; retired once, here.
            unsafe { retire(full) };
        }
        true
    }
}

impl Drop for Space {
    fn drop(&mut self) {
        for c in &self.current {
            let r = c.swap(ptr::null_mut(), Ordering::AcqRel);
            if !r.is_null() {
                // SAFETY: our current region, retired once.
                unsafe { retire(r) };
            }
        }
    }
}

/// Maps a region bound to `node`'s memory (nearest other node when that one
/// is out of memory, as for any segment).
fn map(state: &State, node: usize) -> Option<NonNull<Region>> {
    let arena = state.arena(node).unwrap_or_else(|| state.home_arena(node));
    let base = mem::map_aligned(SEGMENT_SIZE, SEGMENT_SIZE).ok()?;
    let policy = arena.policy(state);
    if policy != MemPolicy::Default {
        // SAFETY: our fresh mapping.
        if unsafe { mem::bind(base, SEGMENT_SIZE, policy, BindFlags::NONE) }.is_err() {
            // SAFETY: ours, unused.
            let _ = unsafe { mem::unmap(base, SEGMENT_SIZE) };
            return None;
        }
    }
    let r = base.as_ptr().cast::<Region>();
    // SAFETY: the mapping is zeroed (so are `live`, `last_turn` and the
    // bitmap); the header fits before `DATA`.
    unsafe {
        ptr::addr_of_mut!((*r).seg).write(Segment {
            kind: REGION,
            arena: arena.node as u8,
            map_base: base.as_ptr(),
            map_len: SEGMENT_SIZE,
            next: ptr::null_mut(),
        });
        (*r).top.store(DATA, Ordering::Relaxed);
        (*r).last_turn.store(u64::MAX, Ordering::Relaxed);
    }
    if arena.spilled(state, base) {
        arena.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
    }
    arena.counters.reserved.fetch_add(SEGMENT_SIZE as u64, Ordering::Relaxed);
    arena.counters.region_live.fetch_add(1, Ordering::Relaxed);
    NonNull::new(r)
}

/// Marks `r` retired; frees it if no block is live.
///
/// # Safety
/// `r` is a live region that its space has just stopped using; called once.
unsafe fn retire(r: *mut Region) {
    // SAFETY: per the contract.
    let old = unsafe { (*r).live.fetch_or(RETIRED, Ordering::AcqRel) };
    debug_assert_eq!(old & RETIRED, 0);
    if old == 0 {
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
    if unsafe { (*r).live.fetch_sub(1, Ordering::AcqRel) } == RETIRED | 1 {
        // SAFETY: retired, and ours was the last reference.
        unsafe { unmap(r) };
    }
}

unsafe fn unmap(r: *mut Region) {
    if let Some(state) = State::try_get() {
        // SAFETY: the region is ours to drop (see callers).
        let node = usize::from(unsafe { (*r).seg.arena });
        if let Some(a) = state.arena(node).or_else(|| Some(state.home_arena(node))) {
            a.counters.reserved.fetch_sub(SEGMENT_SIZE as u64, Ordering::Relaxed);
            a.counters.region_live.fetch_sub(1, Ordering::Relaxed);
        }
    }
    // SAFETY: a whole segment mapping of ours, with no live block.
    let _ = unsafe { mem::unmap(NonNull::new_unchecked(r.cast()), SEGMENT_SIZE) };
}

/// Frees a block of region `seg`.
///
/// # Safety
/// `seg` is the region of a live block that the caller gives up.
pub(crate) unsafe fn free(seg: *mut Segment) {
    // SAFETY: per the contract.
    unsafe { release(seg.cast()) }
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
