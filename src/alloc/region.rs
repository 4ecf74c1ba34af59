//! Bump regions: where interleaved and node-directed allocations are carved,
//! so that consecutive allocations of one node's turn are adjacent in the
//! address space (a run of I/O buffers is one extent, not one per buffer).
//!
//! A region is a 4 MiB segment (kind [`REGION`]) of one node's arena, carved
//! front to back (under its space's node lock, or by the one thread of an
//! exclusive space); only that thread reuses blocks of it (below). Every
//! live block holds a reference (`live`); the [`Space`] that carves from the
//! region holds none, but *retires* it (a [`RetireCount`]) when it moves to
//! a fresh one. The region goes back to the OS when it is retired and its
//! last block is freed, whichever comes last: freeing is a single
//! `fetch_sub` from any thread, through the global allocator like any block.
//!
//! A block-start bitmap (one bit per 16 bytes) answers `usable_size`.
//!
//! The region of a thread's own interleave (an exclusive space: a
//! `with_policy` guard's, or the thread's copy of a process default
//! interleave) also reuses what its thread frees: such a block goes onto one
//! of the region's reuse lists, keyed by its size (a size class below 4 KiB,
//! a number of 4 KiB units above), and the node's next allocation of that
//! size takes it back. A thread that allocates and frees I/O buffers in a
//! loop then cycles through a few warm blocks instead of walking 4 MiB of
//! cold memory (which cost up to 4× the time of a local allocation once the
//! buffers were written). Blocks of these spaces are carved at their key's
//! size, so any block on a list serves any request of its key.

use core::ptr::{self, NonNull};

use super::segment::{Block, Page, SEGMENT_SIZE, SLOT_SIZE, Segment};
use super::size_class::{CLASSES, SMALL_MAX, class_of, class_size};
use super::state::State;
use crate::os::mem;
use crate::sync::{Acquired, AtomicPtr, AtomicU64, AtomicUsize, Ordering, RetireCount, SpinLock};
use crate::topology::MAX_NODES;

/// Segment kind of a region.
pub(crate) const REGION: u8 = 0x3c;
/// Blocks start this far into the region (the header and bitmap come first).
const DATA: usize = SLOT_SIZE;
pub(crate) const GRAIN: usize = 16;
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
/// Reuse lists of a region: one per size class under [`PAGE_MIN`], one per
/// number of `PAGE_MIN` units up to [`SMALL_MAX`].
const REUSE_LISTS: usize = CLASSES + SMALL_MAX / PAGE_MIN + 1;
/// Key of a block that is never reused (larger than [`SMALL_MAX`]).
pub(crate) const NO_REUSE: usize = usize::MAX;

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
    /// For a region of an exclusive space, until the owner retires it: the
    /// owning thread's token (0 otherwise, and once retired). Its own frees
    /// only bump `owner_freed` (plain store, no read-modify-write) until
    /// then, when it settles them.
    owner: AtomicUsize,
    owner_freed: AtomicUsize,
    /// While the owner's interleaver has a pool of this region's blocks on
    /// its heap's fast path: the pool's key (else [`NO_REUSE`]), its page,
    /// and how many blocks the owner's frees may still put straight back on
    /// it (the rest of the turn's allowance). Owner only.
    pool_key: AtomicUsize,
    pool_page: AtomicPtr<Page>,
    pool_budget: AtomicUsize,
    /// An exclusive space's blocks freed by its thread, by reuse key
    /// ([`reuse_key`]); linked through their first word. Owner only.
    reuse: [AtomicPtr<Block>; REUSE_LISTS],
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

/// An exclusive space's reuse key and block size for a request of `size`
/// bytes (`1 ..= SMALL_MAX`), by its size class (the heap's fast path knows
/// only that): the class while it is under 4 KiB, else the class's size in
/// whole 4 KiB units. Up to 32 KiB that is the request's own size in 4 KiB
/// units (classes there are at most 4 KiB apart), so a stream of
/// page-multiple I/O buffers stays back to back; above, a request gets its
/// class's size (at most 25% more, as from the heap).
#[inline(always)]
pub(crate) fn reuse_key(size: usize) -> (usize, usize) {
    class_key(class_of(size))
}

/// [`reuse_key`] of the sizes of size class `class`.
#[inline(always)]
pub(crate) fn class_key(class: usize) -> (usize, usize) {
    let (key, size) = CLASS_KEYS[class];
    (usize::from(key), size as usize)
}

/// Per size class: its reuse key and block size.
const CLASS_KEYS: [(u16, u32); CLASSES] = {
    let mut t = [(0u16, 0u32); CLASSES];
    let mut c = 0;
    while c < CLASSES {
        let cs = class_size(c);
        t[c] = if cs < PAGE_MIN {
            (c as u16, cs as u32)
        } else {
            let units = cs.div_ceil(PAGE_MIN);
            ((CLASSES + units) as u16, (units * PAGE_MIN) as u32)
        };
        c += 1;
    }
    t
};

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
    page: usize,
}

impl Space {
    pub(crate) fn new(turn_align: usize) -> Self {
        Self {
            current: core::array::from_fn(|_| AtomicPtr::new(ptr::null_mut())),
            exclusive: false,
            credit: core::array::from_fn(|_| AtomicUsize::new(0)),
            locks: core::array::from_fn(|_| SpinLock::new(())),
            turn_align: turn_align.clamp(crate::os::page_size(), SEGMENT_SIZE / 2),
            page: crate::os::page_size(),
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
        if self.exclusive {
            let (key, size, align) = exclusive_layout(size, align, self.page);
            loop {
                let r = self.current[node].load(Ordering::Relaxed);
                if !r.is_null() {
                    // SAFETY: the current region of an exclusive space is
                    // retired only by this thread.
                    unsafe {
                        if let Some(p) = self.reuse(r, node, key, align) {
                            return p;
                        }
                        if let Some(p) = self.carve(r, node, size, align, turn) {
                            return p;
                        }
                    }
                }
                if !self.replace(node, r) {
                    return ptr::null_mut();
                }
            }
        }
        let (size, align) = block_layout(size, align);
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

    /// An exclusive space: a block its thread freed into `r`'s list `key`,
    /// if there is one aligned to `align` (and a reference to give it).
    ///
    /// # Safety
    /// `r` is the space's current region for `node`, and the caller is the
    /// space's thread.
    #[inline(always)]
    unsafe fn reuse(&self, r: *mut Region, node: usize, key: usize, align: usize) -> Option<*mut u8> {
        let credit = self.credit[node].load(Ordering::Relaxed);
        if credit == 0 {
            return None;
        }
        // SAFETY: per the contract.
        let p = unsafe { pop_reuse(r, key, align) }?;
        self.credit[node].store(credit - 1, Ordering::Relaxed);
        Some(p)
    }

    /// The alignment of a turn's first block.
    pub(crate) fn turn_align(&self) -> usize {
        self.turn_align
    }

    /// An exclusive space's current region for `node` (null: none yet), for
    /// its thread's window to carve in place.
    pub(crate) fn current_region(&self, node: usize) -> *mut Region {
        debug_assert!(self.exclusive);
        self.current[node].load(Ordering::Relaxed)
    }

    /// An exclusive space's references left to hand out on `node`'s
    /// current region.
    #[inline(always)]
    pub(crate) fn credit(&self, node: usize) -> usize {
        self.credit[node].load(Ordering::Relaxed)
    }

    /// Sets what [`credit`](Self::credit) returns (the space's thread only).
    #[inline(always)]
    pub(crate) fn set_credit(&self, node: usize, credit: usize) {
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
                (*r).owner.store(0, Ordering::Relaxed);
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
        (*r).pool_key.store(NO_REUSE, Ordering::Relaxed);
        (*r).pool_budget.store(0, Ordering::Relaxed);
        (*r).last_turn.store(u64::MAX, Ordering::Relaxed);
        if !fresh {
            ptr::addr_of_mut!((*r).reuse).write_bytes(0, 1);
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

/// An exclusive space's reuse key, block size and alignment for a block of
/// `size` bytes aligned to `align` (`page`: the page size): blocks up to
/// [`SMALL_MAX`] are carved at their key's size ([`reuse_key`]), larger ones
/// as [`block_layout`] says and never reused.
#[inline(always)]
pub(crate) fn exclusive_layout(size: usize, align: usize, page: usize) -> (usize, usize, usize) {
    if size <= SMALL_MAX {
        let (key, size) = reuse_key(size.max(1));
        (key, size, if size >= page { align.max(page) } else { align.max(GRAIN) })
    } else {
        let (size, align) = block_layout_in(size, align, page);
        (NO_REUSE, size, align)
    }
}

/// [`block_layout`] with the page size known (`usize::MAX`: no page rule).
#[inline(always)]
pub(crate) fn block_layout_in(size: usize, align: usize, page: usize) -> (usize, usize) {
    let size = up(size.max(1), GRAIN);
    let align = if size >= page { align.max(page) } else { align.max(GRAIN) };
    (size, align)
}

/// Takes the first block of `r`'s reuse list `key` if it is aligned to
/// `align` (the caller charges its reference).
///
/// # Safety
/// `r` is the current region of an exclusive space, and the caller is the
/// space's thread.
#[inline(always)]
pub(crate) unsafe fn pop_reuse(r: *mut Region, key: usize, align: usize) -> Option<*mut u8> {
    if key == NO_REUSE {
        return None;
    }
    // SAFETY: per the contract; the lists are the owner's.
    let list = unsafe { &(*r).reuse[key] };
    let b = list.load(Ordering::Relaxed);
    if b.is_null() || b as usize & (align - 1) != 0 {
        return None;
    }
    // SAFETY: a free block of the list: its first word is the link.
    list.store(unsafe { (*b).next }, Ordering::Relaxed);
    Some(b.cast())
}

/// Puts the chain `head..=tail` back at the front of `r`'s reuse list `key`.
///
/// # Safety
/// As [`pop_reuse`]; the chain holds free blocks of the list's size.
#[inline]
pub(crate) unsafe fn give_back_reuse(r: *mut Region, key: usize, head: *mut Block, tail: *mut Block) {
    // SAFETY: per the contract.
    unsafe {
        let list = &(*r).reuse[key];
        (*tail).next = list.load(Ordering::Relaxed);
        list.store(head, Ordering::Relaxed);
    }
}

/// The address of `r`'s top (the first byte not carved).
///
/// # Safety
/// `r` is a live region.
#[inline(always)]
pub(crate) unsafe fn top_addr(r: *mut Region) -> usize {
    // SAFETY: per the contract.
    r as usize + unsafe { (*r).top.load(Ordering::Relaxed) }
}

/// The cursor turn `r`'s last block belonged to.
///
/// # Safety
/// `r` is a live region.
pub(crate) unsafe fn last_turn(r: *mut Region) -> u64 {
    // SAFETY: per the contract.
    unsafe { (*r).last_turn.load(Ordering::Relaxed) }
}

/// Records that a block of turn `turn` was carved in `r`.
///
/// # Safety
/// As [`pop_reuse`].
pub(crate) unsafe fn set_last_turn(r: *mut Region, turn: u64) {
    // SAFETY: per the contract.
    unsafe { (*r).last_turn.store(turn, Ordering::Relaxed) };
}

/// Lets the owner's frees of blocks of `key` go straight onto `page` (an
/// interleaver's pool), `budget` of them at most, until [`close_pool`].
///
/// # Safety
/// As [`pop_reuse`]; `page` stays live until `close_pool`.
pub(crate) unsafe fn open_pool(r: *mut Region, key: usize, page: *mut Page, budget: usize) {
    // SAFETY: per the contract; owner-only fields.
    let reg = unsafe { &*r };
    reg.pool_page.store(page, Ordering::Relaxed);
    reg.pool_budget.store(budget, Ordering::Relaxed);
    reg.pool_key.store(key, Ordering::Relaxed);
}

/// Ends [`open_pool`]; returns the budget left.
///
/// # Safety
/// As [`pop_reuse`].
pub(crate) unsafe fn close_pool(r: *mut Region) -> usize {
    // SAFETY: per the contract; owner-only fields.
    let reg = unsafe { &*r };
    reg.pool_key.store(NO_REUSE, Ordering::Relaxed);
    let left = reg.pool_budget.load(Ordering::Relaxed);
    reg.pool_budget.store(0, Ordering::Relaxed);
    left
}

/// Undoes the booking of the last `n` blocks carved at `r`'s top, the
/// first at `first` and each `stride` bytes after the one before: their
/// start bits cleared and the top set back to `top` (an address).
///
/// # Safety
/// As [`book`]; the blocks were never handed out.
pub(crate) unsafe fn unbook(r: *mut Region, first: usize, n: usize, stride: usize, top: usize) {
    // SAFETY: per the contract.
    let reg = unsafe { &*r };
    for i in 0..n {
        let bit = (first + i * stride - r as usize) / GRAIN;
        let w = &reg.starts[bit / 64];
        w.store(w.load(Ordering::Relaxed) & !(1 << (bit % 64)), Ordering::Relaxed);
    }
    reg.top.store(top - r as usize, Ordering::Relaxed);
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
    /// Its address identifies the thread (never 0, which marks a region no
    /// thread owns; unique among live threads).
    static TOKEN: u8 = const { 0 };
}

#[inline(always)]
fn thread_token() -> usize {
    TOKEN.with(|t| t as *const u8 as usize)
}

/// Frees a block of `size` bytes (as asked for) of region `seg`.
///
/// # Safety
/// `seg` is the region of `p`, a live block that the caller gives up.
#[inline]
pub(crate) unsafe fn free(seg: *mut Segment, p: *mut u8, size: usize) {
    let r = seg.cast::<Region>();
    // SAFETY: per the contract the region is live.
    unsafe {
        let owner = (*r).owner.load(Ordering::Relaxed);
        // The owning thread, before it retires the region: the block goes
        // on its pool or a reuse list, and its reference is counted without
        // a read-modify-write (settled at retirement).
        if owner == thread_token() {
            if size <= SMALL_MAX {
                let key = reuse_key(size.max(1)).0;
                let b = p.cast::<Block>();
                let budget = (*r).pool_budget.load(Ordering::Relaxed);
                if key == (*r).pool_key.load(Ordering::Relaxed) && budget != 0 {
                    // Straight back to the fast path, within the turn: the
                    // pool keeps the reference (it settles the credit for
                    // what it holds when taken back).
                    (*r).pool_budget.store(budget - 1, Ordering::Relaxed);
                    let page = (*r).pool_page.load(Ordering::Relaxed);
                    (*b).next = (*page).free;
                    (*page).free = b;
                    return;
                }
                let list = &(*r).reuse[key];
                (*b).next = list.load(Ordering::Relaxed);
                list.store(b, Ordering::Relaxed);
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size gets a block at least its size, sizes of 4–32 KiB get
    /// exactly their 4 KiB units (page-multiple I/O buffers stay back to
    /// back), and classes that share a key share a block size (a block
    /// filed by one serves the others).
    #[test]
    fn reuse_keys_fit_their_sizes() {
        for size in 1..=SMALL_MAX {
            let (key, bsize) = reuse_key(size);
            assert!(bsize >= size && key < REUSE_LISTS, "size {size}");
            let cs = class_size(class_of(size));
            if cs < PAGE_MIN {
                assert_eq!((key, bsize), (class_of(size), cs));
            } else if size <= 32 * 1024 {
                assert_eq!(bsize, size.div_ceil(PAGE_MIN) * PAGE_MIN, "size {size}");
            }
        }
        for a in 0..CLASSES {
            for b in 0..CLASSES {
                if class_key(a).0 == class_key(b).0 {
                    assert_eq!(class_key(a).1, class_key(b).1);
                }
            }
        }
    }
}
