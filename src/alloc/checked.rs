//! What a hardened build checks on the allocator's own paths (the
//! mechanisms, keys and reports are in [`hardened`](super::hardened)):
//! every free, by kind of block, before anything of the block is trusted,
//! and every block handed out by another path than a heap page's pop.
//!
//! The checks of a small block's free sit inline in `free`, where the
//! segment and page are found anyway: a few loads, one bound, one
//! multiplication, the mark's compare and store; every call they make is a
//! tail call, so `free` keeps no stack frame. The reports and
//! `NUMAWEAVE_CHECK=full` are out of line.

use core::ptr;

use super::engine::segment::{page_of, segment_of};
use super::engine::types::{Page, Segment, SegmentKind, SmallSegment};
use super::engine::{heap, segmap};
use super::{huge, placement, region};
use crate::hardened::{self, BlockKind as B, misuse};

/// Reports a misuse found by a caller of the allocator (the C library's
/// `realloc` of a pointer that is not ours) as the allocator's own: one
/// line on stderr, then `abort()` unless `NUMAWEAVE_ON_ERROR=report`.
#[doc(hidden)]
#[cfg(feature = "hardened")]
pub fn report_misuse(what: core::fmt::Arguments<'_>) {
    misuse(what);
}

/// A free of a pointer in no segment of ours: a huge block freed already,
/// or not ours at all. Reported.
///
/// # Safety
/// None: nothing of `p` is read.
#[cold]
#[inline(never)]
pub(super) unsafe fn foreign(p: *mut u8) {
    if segmap::was_freed_huge(p) {
        misuse(format_args!("double free of {p:p} (huge block)"));
    } else {
        misuse(format_args!("free of {p:p}, which numaweave did not allocate"));
    }
}

/// Checks the free of `p`, in the small segment `small`: the start of a
/// block of a live page, not free already. Returns the page, `p` marked
/// freed, for the caller to free it on; or null when there is nothing more
/// to do: a misuse reported without aborting (the block is leaked), or a
/// free finished out of line (under `NUMAWEAVE_CHECK=full`, red zone
/// checked, body poisoned). Every call in it is a tail call.
///
/// One bound covers four cases: a page's `span` is 0 where no free may
/// reach it (the header's descriptor, a free page's) and under
/// `NUMAWEAVE_CHECK=full` (whose frees are checked out of line), so a
/// pointer into the header or a freed page, a full-mode free and one past
/// the blocks all fail `off < span` and go to [`small_slow`], which tells
/// them apart.
///
/// # Safety
/// `small` is a live small segment (the segment map says so) holding `p`.
#[inline(always)]
pub(super) unsafe fn small(small: *mut SmallSegment, p: *mut u8) -> *mut Page {
    // SAFETY: the segment header is live and every descriptor in it is
    // readable (written when the segment was made); the block's second word
    // is read only once `p` is known to be a block's start in a live page.
    unsafe {
        // `p` may be the segment's end exactly (`segment_of` rounds `p - 1`
        // down): slot 64 wraps to the header's 0, whose descriptor fails.
        let slot = ((p as usize - small as usize) >> crate::alloc::engine::types::SLOT_SHIFT)
            & (crate::alloc::engine::types::SLOTS - 1);
        let first = usize::from(*(*small).slot_page.get_unchecked(slot));
        let page = (*small).pages.as_mut_ptr().add(first);
        let off = (p as usize).wrapping_sub((*page).info.start as usize);
        // Inside the blocks' span (a pointer below `start` wraps above it),
        // then a block's start: for `off < 2^32` and `inv = ceil(2^64 / bs)`,
        // `bs` divides `off` exactly when `off * inv mod 2^64 < inv` (Lemire,
        // Kaser and Kurz, "Faster remainder by direct computation", 2019):
        // one multiplication, its low half.
        let inv = (*page).info.inv;
        let at_start = (off as u64).wrapping_mul(inv) < inv;
        if off >= (*page).info.span as usize || !at_start {
            // Finished there, so that this is a tail call: `free` keeps no
            // frame (a page handed back would need `p` kept across it).
            small_slow(small, p);
            return ptr::null_mut();
        }
        debug_assert_eq!(page, page_of(small, p));
        debug_assert!(off.is_multiple_of((*page).info.block_size as usize) && !hardened::full_now());
        // The mark computed once (the secret is an atomic: never merged).
        let mark = hardened::freed_mark(p);
        let word = p.cast::<usize>().add(1);
        if word.read() == mark {
            return small_double(small, p);
        }
        word.write(mark);
        page
    }
}

/// [`small`] when `p` failed its bound: checks a slot at a time, then
/// reports what is wrong (the block is leaked) or frees it (under
/// `NUMAWEAVE_CHECK=full`, red zone checked, body poisoned).
///
/// # Safety
/// As [`small`].
#[cold]
#[inline(never)]
unsafe fn small_slow(small: *mut SmallSegment, p: *mut u8) {
    // SAFETY: as in `small`; the page's fields are read only once its first
    // slot is known to be in use.
    unsafe {
        let node = (*small).seg.arena;
        let slot = (p as usize - small as usize) >> crate::alloc::engine::types::SLOT_SHIFT;
        if slot == 0 {
            misuse(format_args!("free of {p:p}, inside a segment's header (node {node}): not a block"));
            return;
        }
        if slot >= crate::alloc::engine::types::SLOTS {
            foreign(p);
            return;
        }
        // A live page's first slot is in use and maps to itself; a freed
        // page's descriptor may survive in the map of slots a newer page
        // does not cover (its first slot now inside another page).
        let first = usize::from((*small).slot_page[slot]);
        if (*small).free_slots & (1 << first) != 0 || usize::from((*small).slot_page[first]) != first {
            misuse(format_args!("double free of {p:p} (node {node}): its page was freed already"));
            return;
        }
        let page = (*small).pages.as_mut_ptr().add(first);
        let (start, bs) = ((*page).info.start as usize, (*page).info.block_size as usize);
        let q = (p as usize).wrapping_sub(start) / bs;
        if (p as usize) < start || q >= (*page).info.capacity as usize {
            misuse(format_args!("free of {p:p}, outside the blocks of a {bs}-byte page (node {node})"));
            return;
        }
        if !(p as usize - start).is_multiple_of(bs) {
            let b = (start + q * bs) as *const u8;
            misuse(format_args!("free of {p:p}, inside the {bs}-byte block at {b:p} (node {node})"));
            return;
        }
        if hardened::is_marked_freed(p) {
            small_double(small, p);
            return;
        }
        // Only `NUMAWEAVE_CHECK=full` sends a good free here (its pages'
        // `span` is 0); the fast path would have taken any other.
        debug_assert!(hardened::full_now());
        if !hardened::full_now() {
            hardened::mark_freed(p);
            heap::free_block(page, p);
            return;
        }
        if full_free(p, bs, B::Sized(bs, usize::from(node))) {
            hardened::mark_freed(p);
            heap::free_block(page, p);
        }
    }
}

/// Reports a double free of `p`, a small block's start; null (the block is
/// leaked).
///
/// # Safety
/// As [`small`], `p` a block's start in a live page.
#[cold]
#[inline(never)]
unsafe fn small_double(small: *mut SmallSegment, p: *mut u8) -> *mut Page {
    // SAFETY: `p` is a block's start in a live page of `small` (the caller's
    // word): the page and the block's second word are readable.
    unsafe {
        let bs = (*page_of(small, p)).info.block_size;
        misuse(format_args!("double free of {p:p} ({bs}-byte block, node {})", (*small).seg.arena));
    }
    ptr::null_mut()
}

/// `NUMAWEAVE_CHECK=full` on a free: the red zone checked, the body
/// poisoned; false if the red zone was overwritten (reported; leaked).
///
/// # Safety
/// `p` is a live block of `bs` bytes, handed out with its red zone.
#[inline(never)]
unsafe fn full_free(p: *mut u8, bs: usize, what: B) -> bool {
    // SAFETY: `p` is a live block of `bs` bytes handed out with its red zone
    // (the caller's word), as `check_red_zone` and `poison` ask.
    unsafe {
        if !hardened::check_red_zone(p, bs, what) {
            return false;
        }
        hardened::poison(p, bs);
    }
    true
}

/// Frees `p`, a block of a region (an interleaved I/O buffer), once checked
/// as [`small`] checks (a misuse is reported; the block leaked).
///
/// # Safety
/// `seg` is a live region segment (the segment map says so) holding `p`.
#[inline(never)]
pub(super) unsafe fn region(seg: *mut Segment, p: *mut u8) {
    // SAFETY: the region is live; the block's words are read only once the
    // region's map says `p` starts a block, or the unit it starts is ours.
    unsafe {
        let node = (*seg).arena;
        let bs = region::usable_size(seg, p);
        if bs == 0 {
            if (p as usize).is_multiple_of(region::UNIT) && hardened::is_marked_freed(p) {
                misuse(format_args!("double free of {p:p} (interleaved block, node {node})"));
            } else {
                misuse(format_args!("free of {p:p}, not the start of an interleaved block (node {node})"));
            }
            return;
        }
        let what = B::Region(bs, usize::from(node));
        if hardened::is_marked_freed(p) {
            misuse(format_args!("double free of {p:p} ({what})"));
            return;
        }
        if hardened::full_now() && !full_free(p, bs, what) {
            return;
        }
        hardened::mark_freed(p);
        placement::free_region(seg, p);
    }
}

/// Frees the huge block at `p` once it is found to be the block's start (a
/// double free of one is caught before: its segment is gone from the map,
/// see [`foreign`]) and, under `NUMAWEAVE_CHECK=full`, its red zone intact.
///
/// # Safety
/// `seg` is a live huge segment (the segment map says so) holding `p`.
#[inline(never)]
pub(super) unsafe fn huge(seg: *mut Segment, p: *mut u8) {
    // SAFETY: the segment is live; its block's red zone lies in it.
    unsafe {
        if (*seg).block() != p {
            // Past the block's mapping the chunk is anyone's address space.
            if (p as usize).wrapping_sub((*seg).map_base as usize) >= (*seg).map_len {
                foreign(p);
            } else {
                misuse(format_args!(
                    "free of {p:p}, inside the huge block at {:p} (node {})",
                    (*seg).block(),
                    (*seg).arena
                ));
            }
            return;
        }
        if hardened::full_now() && !hardened::check_red_zone(p, huge::usable_size(seg, p), B::Huge) {
            return;
        }
        huge::free_block(seg);
    }
}

/// A block handed out another way than a heap page's pop (a region's, a
/// huge mapping's; the pop did it already): its freed mark cleared (its
/// poison checked, under `NUMAWEAVE_CHECK=full`).
///
/// # Safety
/// `p` is null or a block just handed out, at least 16 bytes.
pub(super) unsafe fn handed_out(p: *mut u8) {
    if p.is_null() {
        return;
    }
    let seg = segment_of(p);
    // SAFETY: a live block of ours.
    unsafe {
        match (*seg).kind {
            SegmentKind::Region => hardened::handing_out(p, || {
                let bs = region::usable_size(seg, p);
                (bs, B::Region(bs, usize::from((*seg).arena)))
            }),
            // A reused mapping may hold anything: no poison to check.
            SegmentKind::Huge => p.cast::<usize>().add(1).write(0),
            SegmentKind::Small => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::engine::size_class::{CLASSES, class_size};
    use super::super::engine::types::SEGMENT_SIZE;

    /// The block-start test of [`small`](super::small), against a division,
    /// for every class at and around every block boundary of a segment.
    #[test]
    fn one_multiplication_finds_every_block_start() {
        for c in 0..CLASSES {
            let bs = class_size(c);
            let inv = u64::MAX / bs as u64 + 1;
            let at_start = |off: usize| (off as u64).wrapping_mul(inv) < inv;
            for k in 0..SEGMENT_SIZE / bs {
                for off in [k * bs, k * bs + 1, k * bs + bs / 2, k * bs + bs - 1] {
                    assert_eq!(at_start(off), off % bs == 0, "{bs}-byte blocks, offset {off}");
                }
            }
        }
    }
}
