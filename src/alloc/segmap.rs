//! Which 4 MiB chunks of the address space hold a live segment of this
//! allocator, and of which kind: one byte per chunk, so that a pointer of
//! unknown origin (given to C's `free` by a program, or checked by a
//! hardened build) can be told ours or not from the pointer alone, without
//! reading memory it points to, and, when it is ours, freed without reading
//! the kind from the segment's header.
//!
//! Every segment, region and huge mapping starts on a chunk boundary and a
//! block's owner is found from `segment_of(p)`, so one mark, for the chunk
//! of the header, is enough: a pointer is ours if its `segment_of` chunk is
//! marked. The marks cover user addresses below 2^47: 32 MiB of zeroed
//! static memory (`.bss`: address space only; the kernel commits a page of
//! it when a segment in the 16 GiB it covers is first marked), at a fixed
//! address, so that the check is a shift, a bound and one byte compared
//! (`free` runs it on every call of a C program: a byte rather than a bit
//! saves the word index, the bit index and the bit test, and holding the
//! kind saves the header's load that the check would otherwise add).

use super::segment::{SEGMENT_SHIFT, SegmentKind, segment_of};
use crate::sync::{AtomicU8, Ordering};

const ADDR_BITS: u32 = 47;
const CHUNKS: usize = 1 << (ADDR_BITS as usize - SEGMENT_SHIFT);

/// The marks (zeroed: nothing is ours until marked).
static MAP: [AtomicU8; CHUNKS] = [const { AtomicU8::new(0) }; CHUNKS];

/// Hardened builds: chunks that held a huge block freed since (a second
/// free of it is a double free, not a foreign pointer).
#[cfg(feature = "hardened")]
static FREED_HUGE: [AtomicU8; CHUNKS] = [const { AtomicU8::new(0) }; CHUNKS];

/// The index of the chunk at `base` (a segment's header), if it is covered.
#[inline(always)]
fn slot(base: usize) -> Option<usize> {
    let i = base >> SEGMENT_SHIFT;
    (i < CHUNKS).then_some(i)
}

/// Marks the chunk at `base` (4 MiB aligned) as holding a live segment of
/// `kind` (its header written already).
pub(crate) fn insert(base: *const u8, kind: SegmentKind) {
    debug_assert_eq!(base as usize & ((1 << SEGMENT_SHIFT) - 1), 0);
    if let Some(i) = slot(base as usize) {
        let old = MAP[i].swap(kind as u8, Ordering::Relaxed);
        debug_assert_eq!(old, 0, "a segment marked twice");
        #[cfg(feature = "hardened")]
        FREED_HUGE[i].store(0, Ordering::Relaxed);
    }
}

/// Hardened builds: unmarks the chunk of a huge block being freed, and
/// remembers it was one.
#[cfg(feature = "hardened")]
pub(crate) fn remove_huge(base: *const u8) {
    remove(base);
    if let Some(i) = slot(base as usize) {
        FREED_HUGE[i].store(1, Ordering::Relaxed);
    }
}

/// Hardened builds: whether `p`'s chunk held a huge block freed since.
#[cfg(feature = "hardened")]
pub(crate) fn was_freed_huge(p: *const u8) -> bool {
    slot(segment_of(p) as usize).is_some_and(|i| FREED_HUGE[i].load(Ordering::Relaxed) != 0)
}

/// Unmarks the chunk at `base` (its segment is going away).
pub(crate) fn remove(base: *const u8) {
    if let Some(i) = slot(base as usize) {
        let old = MAP[i].swap(0, Ordering::Relaxed);
        debug_assert_ne!(old, 0, "a segment unmarked twice");
    }
}

/// Whether `p` may be a block of this allocator: its segment is live.
///
/// Relaxed is enough: a thread holding a pointer to a block got it through
/// whatever ordered the block's allocation, which came after the marking.
#[inline(always)]
pub(crate) fn contains(p: *const u8) -> bool {
    kind(p) != 0
}

/// The kind (`SegmentKind as u8`) of `p`'s segment if it is live, else 0.
/// Relaxed, as [`contains`].
#[inline(always)]
pub(crate) fn kind(p: *const u8) -> u8 {
    slot(segment_of(p) as usize).map_or(0, |i| MAP[i].load(Ordering::Relaxed))
}
