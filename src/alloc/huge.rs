//! Blocks larger than [`SMALL_MAX`](super::engine::size_class::SMALL_MAX), or aligned
//! beyond 64 KiB: each gets its own mapping, bound to the node of the thread
//! that allocates it, with a one-page [`Segment`] header in front so that
//! `segment_of` finds it like any other block. Growing reallocations move the
//! pages with `mremap` (in place when the address space after the block is
//! free, else to a new aligned range), never copying.

use core::ptr::{self, NonNull};

use super::engine::heap::Heap;
use super::engine::segment::segment_of;
use super::engine::types::Arena;
use super::engine::types::State;
use super::engine::types::{SEGMENT_SIZE, Segment, SegmentKind};
use crate::hardened::HARDENED;
use crate::os::{self, mem};
use crate::sync::Ordering;

/// Largest alignment served (1 GiB). Larger requests get null.
pub const MAX_ALIGN: usize = 1 << 30;

/// Header-to-block offset for `align`: one page, or the alignment itself, or
/// (beyond the segment size) exactly one segment, so the header always sits on
/// a segment boundary just before the block.
fn block_offset(align: usize) -> usize {
    if align <= SEGMENT_SIZE { align.max(os::page_size()) } else { SEGMENT_SIZE }
}

fn map_len(offset: usize, size: usize) -> Option<usize> {
    let page = os::page_size();
    let total = offset.checked_add(size)?.checked_add(page - 1)? & !(page - 1);
    (total <= isize::MAX as usize / 2).then_some(total)
}

/// A fresh mapping for a huge block, charged whole against the kernel's
/// overcommit policy ([`mem::Charge::Whole`]): a block is handed out whole,
/// and a `malloc` the kernel judges impossible must fail with `ENOMEM`, as
/// glibc's does, not succeed and end in the OOM killer. Refused, it is
/// asked for again once the arenas have unmapped what they hold unused
/// ([`map_or_reclaim`](super::engine::arena::map_or_reclaim)), and with
/// per-CPU caches once more after they and their homes gave back what
/// they hold (`lifecycle::cpu_reclaim`).
#[unsafe(link_section = ".text.sorted.numaweave")]
fn reserve(state: &State, total: usize, align: usize, offset: usize) -> Option<NonNull<u8>> {
    let guard = super::engine::arena::guard_len();
    let (align, offset) = if align <= SEGMENT_SIZE { (SEGMENT_SIZE, 0) } else { (align, offset) };
    let map = || super::engine::segmap::NEAR.map_aligned_at(total + guard, align, offset, mem::Charge::Whole).ok();
    let base = super::engine::arena::map_or_reclaim(state, map).or_else(|| {
        // Blocks the per-CPU caches hold, and those they gave back to their
        // home heaps' pages (remote frees, not collected yet), keep their
        // segments mapped: take them back, then ask once more.
        super::engine::heap::cpu::get()?;
        super::engine::lifecycle::cpu_reclaim(state);
        super::engine::arena::map_or_reclaim(state, map)
    })?;
    if !super::engine::segmap::can_mark(base.as_ptr()) {
        // SAFETY: ours, unused.
        let _ = unsafe { mem::unmap(base, total + guard) };
        return None;
    }
    if guard > 0 {
        // SAFETY: the last page of our fresh reservation, past the block's.
        let _ = unsafe { mem::protect_none(NonNull::new_unchecked(base.as_ptr().add(total)), guard) };
    }
    Some(base)
}

/// A huge block's header: the segment header every kind begins with, and
/// what the program last asked for (in the header's page, before the
/// block at its offset of a page or more).
#[repr(C)]
struct HugeHeader {
    seg: Segment,
    /// The size last asked for (`alloc`, `realloc`): a `realloc` larger
    /// than it is a growth, kept in a mapping with room (a buffer that grew
    /// into a cached mapping does not shrink back to its size at its next
    /// doubling), one below half the mapping a shrink, given back.
    asked: usize,
}

const _: () = assert!(core::mem::size_of::<HugeHeader>() <= 4096);

/// The header of the huge block at `p`.
fn header(p: *const u8) -> *mut HugeHeader {
    segment_of(p).cast()
}

/// Allocates a huge block on `node` (its arena; the home arena of a node
/// without memory); null on failure. With `zero`, the block reads as zeroes
/// (fresh mappings already do; reused ones are cleared).
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) fn alloc_on(state: &State, node: usize, size: usize, align: usize, zero: bool) -> *mut u8 {
    alloc_in(state, state.node_arena(node), size, align, zero)
}

fn alloc_in(state: &State, arena: &super::engine::types::Arena, size: usize, align: usize, zero: bool) -> *mut u8 {
    if align > MAX_ALIGN {
        return ptr::null_mut();
    }
    let off = block_offset(align);
    let Some(total) = map_len(off, size) else { return ptr::null_mut() };
    // A cached mapping of this node (segment-aligned, so any alignment up to
    // the segment size fits at the same offset), else a fresh one.
    let cached = if align <= SEGMENT_SIZE { arena.take_huge(state, total) } else { None };
    let fresh = cached.is_none();
    let (base, total) = match cached {
        Some(c) => c,
        None => match reserve(state, total, align, off) {
            Some(b) => (b, total),
            None => return ptr::null_mut(),
        },
    };
    let policy = arena.policy(state);
    if fresh && policy != mem::MemPolicy::Default {
        // SAFETY: our fresh mapping. A failed bind leaves first-touch placement,
        // which is still a valid block.
        let _ = unsafe { mem::bind(base, total, policy, mem::BindFlags::NONE) };
    }
    let h = base.as_ptr().cast::<HugeHeader>();
    // SAFETY: the header page is the start of our mapping.
    unsafe {
        ptr::write(
            h,
            HugeHeader { seg: Segment::new(SegmentKind::Huge, arena.node, base.as_ptr(), total), asked: size },
        );
    }
    super::engine::segmap::insert_huge(base.as_ptr(), off);
    let c = &arena.counters;
    // The header page, just touched, tells where the block's memory comes from.
    if fresh && arena.spilled(state, base) {
        c.fallbacks.fetch_add(1, Ordering::Relaxed);
    }
    if fresh {
        c.reserved.fetch_add(total as u64, Ordering::Relaxed);
    }
    c.huge_live.fetch_add(1, Ordering::Relaxed);
    c.huge_bytes.fetch_add(total as u64, Ordering::Relaxed);
    c.huge_allocs.fetch_add(1, Ordering::Relaxed);
    // SAFETY: inside the mapping, which holds `off + size` bytes.
    unsafe {
        let p = base.as_ptr().add(off);
        if HARDENED {
            (*h).seg.set_block(p);
        }
        if zero && !fresh {
            ptr::write_bytes(p, 0, size);
        }
        p
    }
}

/// Frees the huge block whose header is `seg` (the state exists once a
/// block does).
///
/// # Safety
/// `seg` is the header of a live huge block.
#[inline(always)]
pub(crate) unsafe fn free_block(seg: *mut Segment) {
    if let Some(state) = State::try_get() {
        // SAFETY: `seg` is the header of a live huge block (the caller's word),
        // as `free` asks.
        unsafe { free(state, seg) };
    }
}

/// Frees the huge block whose header is `seg`.
///
/// # Safety
/// `seg` must be the header of a live huge block.
// Out of line: `free` reaches it by a tail call and keeps no frame.
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) unsafe fn free(state: &State, seg: *mut Segment) {
    // SAFETY: `seg` is the header of a live huge block (the caller's word): its
    // fields are written once, at mapping.
    let (base, len, arena) = unsafe { ((*seg).map_base, (*seg).map_len, usize::from((*seg).arena)) };
    let a = &state.arenas[arena];
    let c = &a.counters;
    c.huge_live.fetch_sub(1, Ordering::Relaxed);
    c.huge_bytes.fetch_sub(len as u64, Ordering::Relaxed);
    c.huge_frees.fetch_add(1, Ordering::Relaxed);
    if HARDENED {
        super::engine::segmap::remove_huge(base);
    } else {
        super::engine::segmap::remove(base);
    }
    // SAFETY: the whole mapping of a block nobody uses any more.
    let base = unsafe { NonNull::new_unchecked(base) };
    // Segment-aligned mappings can be reused for any huge block of this node.
    if (base.as_ptr() as usize).is_multiple_of(SEGMENT_SIZE) && a.keep_huge(state, base, len) {
        // The mapping is due to go back after the purge delay: the freeing
        // thread is armed to reach a tick (a free's last step).
        let me = super::engine::heap::current();
        if !me.is_null() {
            // SAFETY: the calling thread's heap, between operations on it.
            unsafe { Heap::arm(me, state) };
        }
        return;
    }
    c.reserved.fetch_sub(len as u64, Ordering::Relaxed);
    c.purged.fetch_add(len as u64, Ordering::Relaxed);
    // SAFETY: as above, with its guard page if it has one.
    let _ = unsafe { mem::unmap(base, len + super::engine::arena::guard_len()) };
}

/// Resizes the huge block `p` (aligned to `align`) to `new_size` (> SMALL_MAX)
/// without copying; null when the address space cannot be had (the block is
/// then untouched).
///
/// # Safety
/// `p` must be a live huge block of this allocator.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) unsafe fn realloc(state: &State, p: *mut u8, align: usize, new_size: usize) -> *mut u8 {
    let seg = segment_of(p);
    // SAFETY: `p` is a live huge block of this allocator (the caller's word), so its
    // segment header and block header are mapped.
    let (base, len, arena, asked) =
        unsafe { ((*seg).map_base, (*seg).map_len, usize::from((*seg).arena), (*header(p)).asked) };
    let off = p as usize - base as usize;
    let Some(total) = map_len(off, new_size) else { return ptr::null_mut() };
    if super::engine::arena::guard_len() > 0 {
        // A guard page ends the mapping: the caller moves the block.
        return ptr::null_mut();
    }
    let a = &state.arenas[arena];
    let c = &a.counters;
    // SAFETY: `base` is the start of our whole mapping.
    let old = unsafe { NonNull::new_unchecked(base) };
    if total <= len && (new_size >= asked || total >= len / 2) {
        // Fits the mapping (a reused cached mapping often has room to grow),
        // and is no shrink to below half of it.
        // SAFETY: the live header.
        unsafe { (*header(p)).asked = new_size };
        return p;
    }
    if total > len
        && align <= SEGMENT_SIZE
        && let Some(b) = grow_into_cached(state, a, old, len, off, total)
    {
        // SAFETY: the new mapping's live header; the block at the same offset.
        unsafe {
            (*b.as_ptr().cast::<HugeHeader>()).asked = new_size;
            return b.as_ptr().add(off);
        }
    }
    let new_base = if total < len || align <= SEGMENT_SIZE {
        // In place: shrinking always works; growing when the range after it is free.
        // SAFETY: our whole mapping; it does not move.
        match unsafe { mem::remap(old, len, total, false) } {
            Ok(b) => Some(b),
            Err(_) if total > len => {
                // Move the pages to a fresh, segment-aligned range.
                // The move releases the old range, where a mapping another
                // thread makes next may land and be marked: unmark it first
                // (nobody else may use this block meanwhile), or its mark
                // would be found taken and then lost.
                reserve(state, total, align, off).and_then(|to| {
                    super::engine::segmap::remove(old.as_ptr());
                    // SAFETY: `to` is our fresh reservation of `total` bytes.
                    unsafe { mem::remap_to(old, len, total, to) }.ok().or_else(|| {
                        super::engine::segmap::insert_huge(old.as_ptr(), off);
                        // SAFETY: the reservation is unused.
                        let _ = unsafe { mem::unmap(to, total) };
                        None
                    })
                })
            }
            Err(_) => None,
        }
    } else {
        None
    };
    let Some(b) = new_base else { return ptr::null_mut() };
    if b != old {
        super::engine::segmap::insert_huge(b.as_ptr(), off);
    }
    // SAFETY: the header moved with the pages (it is their first page).
    unsafe {
        let h = b.as_ptr().cast::<HugeHeader>();
        (*h).seg.map_base = b.as_ptr();
        (*h).seg.map_len = total;
        (*h).asked = new_size;
        if HARDENED {
            (*h).seg.set_block(b.as_ptr().add(off));
        }
    }
    if total >= len {
        c.reserved.fetch_add((total - len) as u64, Ordering::Relaxed);
        c.huge_bytes.fetch_add((total - len) as u64, Ordering::Relaxed);
    } else {
        c.reserved.fetch_sub((len - total) as u64, Ordering::Relaxed);
        c.huge_bytes.fetch_sub((len - total) as u64, Ordering::Relaxed);
    }
    // SAFETY: same offset inside the (possibly moved) mapping.
    unsafe { b.as_ptr().add(off) }
}

/// Grows the huge block whose mapping is `old` (`len` bytes, the block at
/// `off`) into a cached mapping of the arena with room for `total` bytes,
/// copying its bytes there: the cached mapping's pages are committed, where
/// growing in place would fault every new page in (a copy of the old bytes
/// costs less than faulting as many new ones in and zeroing them). A loop
/// that grows a buffer by doubling, frees it and grows it again (a
/// serializer's output) faulted 4,096 pages in a round for its 16 MiB,
/// which the last round's mapping now serves. (Moving the pages there with
/// `mremap` instead left the mapping in two parts, which a later `mremap`
/// of both refuses.) The old mapping goes back to the cache. The new
/// mapping's start, or `None` (the block untouched) when none fits.
fn grow_into_cached(
    state: &State,
    a: &Arena,
    old: NonNull<u8>,
    len: usize,
    off: usize,
    total: usize,
) -> Option<NonNull<u8>> {
    let (to, l) = a.take_huge_to_grow(state, total)?;
    let b = to.as_ptr();
    // SAFETY: `to` is a cached mapping of ours of `l >= total > len` bytes,
    // off the cache; `old` is our live block's whole mapping, whose header
    // and bytes are copied before it is given up.
    unsafe {
        let h = b.cast::<HugeHeader>();
        ptr::write(
            h,
            HugeHeader {
                seg: Segment::new(SegmentKind::Huge, a.node, b, l),
                asked: (*old.as_ptr().cast::<HugeHeader>()).asked,
            },
        );
        if HARDENED {
            (*h).seg.set_block(b.add(off));
        }
        ptr::copy_nonoverlapping(old.as_ptr().add(off), b.add(off), len - off);
        super::engine::segmap::remove(old.as_ptr());
        super::engine::segmap::insert_huge(b, off);
    }
    let c = &a.counters;
    c.huge_bytes.fetch_add((l - len) as u64, Ordering::Relaxed);
    // The old mapping, of the block no more, is cached or unmapped as a
    // freed one is.
    if !a.keep_huge(state, old, len) {
        c.reserved.fetch_sub(len as u64, Ordering::Relaxed);
        c.purged.fetch_add(len as u64, Ordering::Relaxed);
        // SAFETY: our mapping, unused now.
        let _ = unsafe { mem::unmap(old, len) };
    }
    Some(to)
}

/// Usable size of the huge block whose header is `seg`.
///
/// # Safety
/// `seg` must be the header of a live huge block.
pub(crate) unsafe fn usable_size(seg: *mut Segment, p: *const u8) -> usize {
    // SAFETY: `seg` is the header of a live huge block holding `p` (the
    // caller's word).
    unsafe { (*seg).map_base as usize + (*seg).map_len - p as usize }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> &'static State {
        crate::alloc::config::state()
    }

    #[test]
    fn huge_blocks_are_aligned_sized_and_keep_contents_when_resized() {
        let state = state();
        let node = state.current_arena().node;
        for align in [16, 4096, 1 << 20, 8 << 20] {
            let size = 300_000;
            let p = alloc_on(state, node, size, align, true);
            assert!(!p.is_null() && (p as usize).is_multiple_of(align), "align {align}");
            // SAFETY: a live huge block of `size` zeroed bytes.
            unsafe {
                assert!(std::slice::from_raw_parts(p, size).iter().all(|&b| b == 0));
                assert!(usable_size(segment_of(p), p) >= size);
                p.write_bytes(0x5a, size);
                // Grown far past its mapping (moved or in place), then shrunk.
                // Beyond a segment's alignment a block that cannot grow in
                // place is not moved here (the caller copies).
                let q = realloc(state, p, align, 40 << 20);
                if q.is_null() {
                    // (With guard pages no block grows in place.)
                    assert!(align > SEGMENT_SIZE || super::super::engine::arena::guard_len() > 0);
                    free(state, segment_of(p));
                    continue;
                }
                assert!((q as usize).is_multiple_of(align));
                assert!(std::slice::from_raw_parts(q, size).iter().all(|&b| b == 0x5a), "contents lost");
                assert!(usable_size(segment_of(q), q) >= 40 << 20);
                let r = realloc(state, q, align, 1 << 20);
                assert!(!r.is_null() && std::slice::from_raw_parts(r, size).iter().all(|&b| b == 0x5a));
                free(state, segment_of(r));
            }
        }
    }

    #[test]
    fn too_large_or_too_aligned_is_null() {
        let state = state();
        assert!(alloc_on(state, 0, 16, MAX_ALIGN * 2, false).is_null());
        assert!(alloc_on(state, 0, isize::MAX as usize, 16, false).is_null());
        assert_eq!(map_len(os::page_size(), usize::MAX - 10), None);
    }
}
