//! `free` without a size: the owner of any pointer is found from the
//! pointer alone (its segment's kind from the segment map or the header),
//! and each kind of block goes back where it came from: a heap page's block
//! to its page ([`heap::free_block`]: the calling thread's own page, else
//! the page's remote list), a region block to its interleaver or region
//! ([`placement::free_region`]), a huge block to its arena
//! ([`huge::free_block`]). A hardened build checks each before it trusts
//! anything of the block (`checked.rs`).
//!
//! Small blocks fall straight through to their `ret`; every other kind is
//! reached by a tail call, so `free` keeps no stack frame.

use super::checked;
use super::engine::segment::{segment_of, sink_of};
use super::engine::types::{SegmentKind, SmallSegment};
use super::engine::{heap, segmap};
use super::{huge, placement};
use crate::hardened::HARDENED;

/// The kinds as the segment map's byte and `free_as` name them.
const SMALL: u8 = SegmentKind::Small as u8;
const REGION: u8 = SegmentKind::Region as u8;

/// Frees `p`, a live block of this allocator, whatever its size: the owner
/// is found from the pointer alone.
#[inline(always)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(super) unsafe fn free(p: *mut u8) {
    // A hardened build takes the kind from the segment map, which also says
    // whether `p` is ours at all (`checked`); a misuse reported without
    // aborting leaks the block. Null is in no segment of ours: C's
    // `free(NULL)` costs its test only on the way out.
    if HARDENED {
        // SAFETY: `p` is a live block (caller's contract) or, a misuse, in
        // no segment of ours: then nothing of it is read.
        unsafe {
            if !free_if_small(p) {
                free_checked_not_small(p);
            }
        }
        return;
    }
    // Small blocks fall straight through; the other kinds are reached by a
    // tail call.
    // SAFETY: `p` is a live block (caller's contract), so its segment
    // header is live.
    unsafe {
        let kind = (*segment_of(p)).kind as u8;
        if kind == SMALL {
            free_as(p, SMALL);
        } else {
            free_not_small(p, kind);
        }
    };
}

/// [`free`] of a block that is not in a small segment (default builds).
///
/// # Safety
/// As [`free`]; `kind` is `p`'s segment's.
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
unsafe fn free_not_small(p: *mut u8, kind: u8) {
    // SAFETY: `p` is a live block of this allocator in a segment of `kind` (the
    // caller's word), what `free_as` asks.
    unsafe { free_as(p, kind) }
}

/// A hardened build's `free` of a pointer in no small segment of ours:
/// null (a test and a `ret` straight after it), or the rest by a tail call.
/// Out of line, so that a small block's free falls straight through to a
/// `ret` of its own (with the null test in `free`, LLVM gave both one
/// `ret`, and the small free a taken jump to it).
///
/// # Safety
/// As [`free`].
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
unsafe fn free_checked_not_small(p: *mut u8) {
    if !p.is_null() {
        // SAFETY: `p` is not null, and a live block of ours or, a misuse, in no segment
        // of ours (as `free`, the caller's word): what `free_checked_other` asks.
        unsafe { free_checked_other(p) };
    }
}

/// A hardened build's `free` of a pointer, not null, in no small segment of
/// ours: a region or huge block, or a misuse (reported).
///
/// # Safety
/// As [`free`].
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
unsafe fn free_checked_other(p: *mut u8) {
    debug_assert!(!p.is_null());
    // SAFETY: as in `free`.
    unsafe {
        if !free_if_ours(p) {
            checked::foreign(p);
        }
    }
}

/// Frees `p` and returns true if the segment map says it is in a live
/// segment of ours (one load gives that and the segment's kind), else
/// returns false having read nothing of `p`.
///
/// # Safety
/// If `p` lies in a live segment of ours, it is a live block of this
/// allocator (a hardened build checks that too).
#[inline(always)]
pub(super) unsafe fn free_if_ours(p: *mut u8) -> bool {
    // One dispatch on the mark (each arm gets `free_as` for its kind).
    // SAFETY: a live segment of ours, of the kind its mark names; `p` a
    // block in it (the caller's contract).
    unsafe {
        match segmap::kind(p) {
            0 => return false,
            SMALL => free_as(p, SMALL),
            REGION => free_as(p, REGION),
            huge => {
                // Only the block's start is ours in a huge block's chunk
                // (the rest may be another allocator's): tested here, off
                // the small path. A hardened build checks it in
                // `checked::huge`, which names the misuse.
                if !HARDENED && !segmap::is_huge_block(p, huge) {
                    return false;
                }
                free_as(p, huge)
            }
        }
    }
    true
}

/// Frees `p` and returns true if the segment map says it is in a live
/// small segment of ours, else returns false having read nothing of `p`:
/// [`free_if_ours`] for the common case alone, so that C's `free` takes it
/// on its straight path and reaches the rest by a tail call.
///
/// # Safety
/// As [`free_if_ours`].
#[inline(always)]
pub(super) unsafe fn free_if_small(p: *mut u8) -> bool {
    if segmap::near_kind(p) != SMALL {
        return false;
    }
    // SAFETY: a live small segment of ours holding `p`, so a live block of
    // it (the caller's contract).
    unsafe { free_as(p, SMALL) };
    true
}

/// Frees `p`, a live block in a segment of `kind` (`SegmentKind as u8`,
/// from its header or from the segment map).
///
/// # Safety
/// `p` is a live block of this allocator (a hardened build checks the rest
/// of that), in a segment of `kind`.
#[inline(always)]
unsafe fn free_as(p: *mut u8, kind: u8) {
    let seg = segment_of(p);
    // SAFETY: `p` is a live block (caller's contract), so its segment header
    // is live, and for a small segment the slot belongs to a page. (A
    // hardened build checks the slot before it trusts it, and finishes the
    // free itself where its checks need more than the fast path: every call
    // here is a tail call, so `free` keeps no stack frame.)
    unsafe {
        debug_assert!(
            kind == (*seg).kind as u8 || (segmap::is_huge(kind) && (*seg).kind == SegmentKind::Huge),
            "the segment map names another kind"
        );
        match kind {
            SMALL if HARDENED => {
                let page = checked::small(seg.cast::<SmallSegment>(), p);
                if !page.is_null() {
                    heap::free_block(page, p)
                }
            }
            SMALL => heap::free_to_sink(seg.cast::<SmallSegment>(), sink_of(seg.cast::<SmallSegment>(), p), p),
            REGION if HARDENED => checked::region(seg, p),
            REGION => placement::free_region(seg, p),
            _ if HARDENED => checked::huge(seg, p),
            _ => huge::free_block(seg),
        }
    }
}
