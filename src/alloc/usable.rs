//! A live block's usable size, from the pointer alone: its segment's kind
//! says where to look (the page's class, the region's block, the huge
//! block's mapping).

use super::engine::segment::{page_of, segment_of};
use super::engine::types::{Segment, SegmentKind, SmallSegment};
use super::{huge, region};
use crate::hardened;

/// The usable size of the live block at `p` (under `NUMAWEAVE_CHECK=full`
/// in a hardened build, the size it was asked for: the rest is red zone).
///
/// # Safety
/// `p` is a live block of this allocator.
pub(super) unsafe fn usable_size(p: *const u8) -> usize {
    // SAFETY: `p` is a live block of this allocator (the caller's word, as the doc says).
    let bs = unsafe { raw_usable_size(p) };
    if hardened::full() {
        // SAFETY: a live block, handed out with its red zone.
        return unsafe { hardened::asked_size(p, bs) };
    }
    bs
}

/// The size of the live block at `p`, whole.
///
/// # Safety
/// `p` is a live block of this allocator.
pub(super) unsafe fn raw_usable_size(p: *const u8) -> usize {
    let seg = segment_of(p);
    // SAFETY: `p` is a live block (the caller's word), so its segment header is mapped.
    unsafe {
        match (*seg).kind {
            SegmentKind::Huge => huge::usable_size(seg, p),
            kind => paged_usable_size(seg, kind, p),
        }
    }
}

/// The size of the live block at `p` of a small or region segment `seg`
/// whose kind the caller has read already.
///
/// # Safety
/// `p` is a live block of this allocator in `seg`, whose kind is `kind`
/// (not huge).
#[inline(always)]
pub(super) unsafe fn paged_usable_size(seg: *mut Segment, kind: SegmentKind, p: *const u8) -> usize {
    debug_assert!(kind != SegmentKind::Huge);
    // SAFETY: `p` is a live block of `seg`, a small or region segment (the caller's
    // word): its slot belongs to a page, or its region knows its size.
    unsafe {
        if kind == SegmentKind::Small {
            (*page_of(seg.cast::<SmallSegment>(), p)).info.block_size as usize
        } else {
            region::usable_size(seg, p)
        }
    }
}
