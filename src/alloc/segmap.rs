//! Which 4 MiB chunks of the address space hold a live segment of this
//! allocator: one bit per chunk, so that a pointer of unknown origin (given
//! to C's `free` by a program, or checked by a hardened build) can be told
//! ours or not from the pointer alone, without reading memory it points to.
//!
//! Every segment, region and huge mapping starts on a chunk boundary and a
//! block's owner is found from `segment_of(p)`, so one bit, for the chunk of
//! the header, is enough: a pointer is ours if its `segment_of` chunk is
//! marked. The bits cover user addresses below 2^47: 4 MiB of zeroed static
//! memory (`.bss`: address space only; the kernel commits a page of it when
//! a segment in the 128 GiB it covers is first marked), at a fixed address,
//! so that the check is a shift, one load and a bit test.

use super::segment::{SEGMENT_SHIFT, segment_of};
use crate::sync::{AtomicU64, Ordering};

const ADDR_BITS: u32 = 47;
const WORDS: usize = (1 << (ADDR_BITS as usize - SEGMENT_SHIFT)) / 64;

/// The map (zeroed: nothing is ours until marked).
static MAP: [AtomicU64; WORDS] = {
    #[allow(clippy::declare_interior_mutable_const)]
    const Z: AtomicU64 = AtomicU64::new(0);
    [Z; WORDS]
};

/// Hardened builds: chunks that held a huge block freed since (a second
/// free of it is a double free, not a foreign pointer).
#[cfg(feature = "hardened")]
static FREED_HUGE: [AtomicU64; WORDS] = {
    #[allow(clippy::declare_interior_mutable_const)]
    const Z: AtomicU64 = AtomicU64::new(0);
    [Z; WORDS]
};

/// The bit of the chunk at `base` (a segment's header), if it is covered.
#[inline(always)]
fn slot(base: usize) -> Option<(&'static AtomicU64, u64)> {
    let i = base >> SEGMENT_SHIFT;
    MAP.get(i / 64).map(|w| (w, 1u64 << (i % 64)))
}

/// Marks the chunk at `base` (4 MiB aligned) as holding a live segment.
pub(crate) fn insert(base: *const u8) {
    debug_assert_eq!(base as usize & ((1 << SEGMENT_SHIFT) - 1), 0);
    if let Some((w, b)) = slot(base as usize) {
        let old = w.fetch_or(b, Ordering::Relaxed);
        debug_assert_eq!(old & b, 0, "a segment marked twice");
        #[cfg(feature = "hardened")]
        FREED_HUGE[(base as usize >> SEGMENT_SHIFT) / 64].fetch_and(!b, Ordering::Relaxed);
    }
}

/// Hardened builds: unmarks the chunk of a huge block being freed, and
/// remembers it was one.
#[cfg(feature = "hardened")]
pub(crate) fn remove_huge(base: *const u8) {
    remove(base);
    if let Some((_, b)) = slot(base as usize) {
        FREED_HUGE[(base as usize >> SEGMENT_SHIFT) / 64].fetch_or(b, Ordering::Relaxed);
    }
}

/// Hardened builds: whether `p`'s chunk held a huge block freed since.
#[cfg(feature = "hardened")]
pub(crate) fn was_freed_huge(p: *const u8) -> bool {
    let base = segment_of(p) as usize;
    slot(base).is_some_and(|(_, b)| FREED_HUGE[(base >> SEGMENT_SHIFT) / 64].load(Ordering::Relaxed) & b != 0)
}

/// Unmarks the chunk at `base` (its segment is going away).
pub(crate) fn remove(base: *const u8) {
    if let Some((w, b)) = slot(base as usize) {
        let old = w.fetch_and(!b, Ordering::Relaxed);
        debug_assert_ne!(old & b, 0, "a segment unmarked twice");
    }
}

/// Whether `p` may be a block of this allocator: its segment is live.
///
/// Relaxed is enough: a thread holding a pointer to a block got it through
/// whatever ordered the block's allocation, which came after the marking.
#[inline(always)]
pub(crate) fn contains(p: *const u8) -> bool {
    slot(segment_of(p) as usize).is_some_and(|(w, b)| w.load(Ordering::Relaxed) & b != 0)
}
