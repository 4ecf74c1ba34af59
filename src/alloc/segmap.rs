//! Which 4 MiB chunks of the address space hold a live segment of this
//! allocator: one bit per chunk, so that a pointer of unknown origin (given
//! to C's `free` by a program, or checked by a hardened build) can be told
//! ours or not from the pointer alone, without reading memory it points to.
//!
//! Every segment, region and huge mapping starts on a chunk boundary and a
//! block's owner is found from `segment_of(p)`, so one bit, for the chunk of
//! the header, is enough: a pointer is ours if its `segment_of` chunk is
//! marked. The bits cover user addresses below 2^47 (4 MiB of bitmap,
//! reserved without committing: only the pages for the ranges the process
//! uses are ever touched).

use core::ptr;

use super::segment::{SEGMENT_SHIFT, segment_of};
use crate::os::mem;
use crate::sync::{AtomicPtr, AtomicU8, AtomicU64, Ordering};

const ADDR_BITS: u32 = 47;
const WORDS: usize = (1 << (ADDR_BITS as usize - SEGMENT_SHIFT)) / 64;

static MAP: AtomicPtr<AtomicU64> = AtomicPtr::new(ptr::null_mut());
/// 0: not made yet, 1: made, 2: could not be made (nothing is checked).
static STATE: AtomicU8 = AtomicU8::new(0);

/// Makes the map (once, at the allocator's start-up, before any segment).
pub(crate) fn init() {
    if STATE.load(Ordering::Relaxed) != 0 {
        return;
    }
    match mem::map(WORDS * 8) {
        Ok(m) => {
            MAP.store(m.as_ptr().cast(), Ordering::Release);
            STATE.store(1, Ordering::Release);
        }
        Err(_) => STATE.store(2, Ordering::Release),
    }
}

/// The bit of the chunk at `base` (a segment's header), if it is covered.
#[inline(always)]
fn slot(base: usize) -> Option<(&'static AtomicU64, u64)> {
    let i = base >> SEGMENT_SHIFT;
    if i >= WORDS * 64 {
        return None;
    }
    let m = MAP.load(Ordering::Acquire);
    if m.is_null() {
        return None;
    }
    // SAFETY: `i / 64 < WORDS`, inside the map, which is never unmapped.
    Some((unsafe { &*m.add(i / 64) }, 1u64 << (i % 64)))
}

/// Marks the chunk at `base` (4 MiB aligned) as holding a live segment.
pub(crate) fn insert(base: *const u8) {
    debug_assert_eq!(base as usize & ((1 << SEGMENT_SHIFT) - 1), 0);
    if let Some((w, b)) = slot(base as usize) {
        let old = w.fetch_or(b, Ordering::Relaxed);
        debug_assert_eq!(old & b, 0, "a segment marked twice");
    }
}

/// Unmarks the chunk at `base` (its segment is going away).
pub(crate) fn remove(base: *const u8) {
    if let Some((w, b)) = slot(base as usize) {
        let old = w.fetch_and(!b, Ordering::Relaxed);
        debug_assert_ne!(old & b, 0, "a segment unmarked twice");
    }
}

/// Whether `p` may be a block of this allocator: its segment is live. True
/// when the map could not be made (nothing can be checked then).
///
/// Relaxed is enough: a thread holding a pointer to a block got it through
/// whatever ordered the block's allocation, which came after the marking.
#[inline(always)]
pub(crate) fn contains(p: *const u8) -> bool {
    match slot(segment_of(p) as usize) {
        Some((w, b)) => w.load(Ordering::Relaxed) & b != 0,
        None => STATE.load(Ordering::Relaxed) == 2 && (p as usize) >> ADDR_BITS == 0,
    }
}
