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
//! marked, and, for a huge block, if it is the block's start. Small
//! segments and regions fill their chunk, but a huge block's mapping may
//! end well before its chunk does, and the rest of the chunk is anyone's
//! address space: another allocator's block may lie there. So a huge
//! block's mark holds the block's offset from its header (a power of two:
//! a page, the block's alignment, or the segment size), and a pointer of
//! unknown origin in its chunk is ours only at that offset, told from the
//! mark alone (reading the header could race with the block's unmapping).
//!
//! The marks cover user addresses below 2^47: 32 MiB of zeroed static
//! memory (`.bss`: address space only; the kernel commits a page of it
//! when a segment in the 16 GiB it covers is first marked), at a fixed
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

/// Hardened builds: the marks of chunks that held a huge block freed since
/// (a second free of its start is a double free, not a foreign pointer).
#[cfg(feature = "hardened")]
static FREED_HUGE: [AtomicU8; CHUNKS] = [const { AtomicU8::new(0) }; CHUNKS];

/// The index of the chunk at `base` (a segment's header), if it is covered.
#[inline(always)]
fn slot(base: usize) -> Option<usize> {
    let i = base >> SEGMENT_SHIFT;
    (i < CHUNKS).then_some(i)
}

/// The bit of a huge block's mark; the low five bits are the log2 of the
/// block's offset from its header. (Small and region marks have it clear.)
const HUGE_MARK: u8 = 0x80;
const _: () = assert!(SegmentKind::Small as u8 & HUGE_MARK == 0 && SegmentKind::Region as u8 & HUGE_MARK == 0);

/// Marks the chunk at `base` (4 MiB aligned) as holding a live small
/// segment or region (`kind`; its header written already).
pub(crate) fn insert(base: *const u8, kind: SegmentKind) {
    debug_assert!(kind != SegmentKind::Huge, "a huge block is marked with its offset");
    mark(base, kind as u8);
}

/// Marks the chunk at `base` as holding a live huge block at `base +
/// offset` (its header written already).
pub(crate) fn insert_huge(base: *const u8, offset: usize) {
    debug_assert!(offset.is_power_of_two() && offset <= 1 << SEGMENT_SHIFT);
    mark(base, HUGE_MARK | offset.trailing_zeros() as u8);
}

/// Whether a mark (non-zero) is a huge block's.
#[inline(always)]
pub(crate) fn is_huge(mark: u8) -> bool {
    mark & HUGE_MARK != 0
}

/// Whether `p`, in a chunk marked `mark` (non-zero), may be a block of
/// ours: anywhere in a small segment or region, only the block's start in
/// a huge block's chunk.
#[inline(always)]
pub(crate) fn may_be_block(p: *const u8, mark: u8) -> bool {
    !is_huge(mark) || is_huge_block(p, mark)
}

/// Whether `p`, in a chunk marked `mark` (a huge block's), is the block's
/// start.
#[inline(always)]
pub(crate) fn is_huge_block(p: *const u8, mark: u8) -> bool {
    debug_assert!(is_huge(mark));
    (p as usize).wrapping_sub(segment_of(p) as usize) == 1 << (mark & 0x1f)
}

fn mark(base: *const u8, mark: u8) {
    debug_assert_eq!(base as usize & ((1 << SEGMENT_SHIFT) - 1), 0);
    if let Some(i) = slot(base as usize) {
        let old = MAP[i].swap(mark, Ordering::Relaxed);
        debug_assert_eq!(old, 0, "a segment marked twice");
        #[cfg(feature = "hardened")]
        FREED_HUGE[i].store(0, Ordering::Relaxed);
    }
}

/// Hardened builds: unmarks the chunk of a huge block being freed, and
/// remembers its mark.
#[cfg(feature = "hardened")]
pub(crate) fn remove_huge(base: *const u8) {
    if let Some(i) = slot(base as usize) {
        let old = MAP[i].swap(0, Ordering::Relaxed);
        debug_assert!(is_huge(old), "a huge block's chunk marked {old:#x}");
        FREED_HUGE[i].store(old, Ordering::Relaxed);
    }
}

/// Hardened builds: whether `p` is the start of a huge block freed since
/// (rather than any other address of its chunk, which may be anyone's).
#[cfg(feature = "hardened")]
pub(crate) fn was_freed_huge(p: *const u8) -> bool {
    slot(segment_of(p) as usize).is_some_and(|i| {
        let m = FREED_HUGE[i].load(Ordering::Relaxed);
        m != 0 && is_huge_block(p, m)
    })
}

/// Unmarks the chunk at `base` (its segment is going away).
pub(crate) fn remove(base: *const u8) {
    if let Some(i) = slot(base as usize) {
        let old = MAP[i].swap(0, Ordering::Relaxed);
        debug_assert_ne!(old, 0, "a segment unmarked twice");
    }
}

/// Whether `p` lies in the chunk of a live segment of ours (which, for a
/// huge block, says nothing of the rest of the chunk: see [`owns`]).
///
/// Relaxed is enough: a thread holding a pointer to a block got it through
/// whatever ordered the block's allocation, which came after the marking.
#[inline(always)]
pub(crate) fn contains(p: *const u8) -> bool {
    kind(p) != 0
}

/// Whether `p` may be a block of ours: its segment is live and, in a huge
/// block's chunk, it is the block's start. Relaxed, as [`contains`].
#[inline(always)]
pub(crate) fn owns(p: *const u8) -> bool {
    let m = kind(p);
    m != 0 && may_be_block(p, m)
}

/// The mark of `p`'s segment if it is live, else 0: `SegmentKind as u8` for
/// a small segment or a region, a huge block's mark (see [`is_huge`])
/// otherwise. Relaxed, as [`contains`].
#[inline(always)]
pub(crate) fn kind(p: *const u8) -> u8 {
    let i = opaque((p as usize).wrapping_sub(1) >> SEGMENT_SHIFT);
    MAP.get(i).map_or(0, |m| m.load(Ordering::Relaxed))
}

/// `i`, which the compiler may no longer trace to the pointer it came
/// from. Left to see the shift, LLVM turns the bound `i < CHUNKS` back into
/// `p - 1 < 2^47`: on x86-64 a 64-bit constant (`movabs`, which it then
/// narrows `segment_of`'s mask to, and a `lea` for the bound), twelve
/// instructions before the mark's compare instead of ten, on every `free` of
/// a C program (C churn of `benches/c`, 21 rounds against the Rust churn:
/// 1.120× → 1.106×).
#[inline(always)]
fn opaque(#[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))] mut i: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: an empty block (a comment naming the register): it reads and
    // writes nothing, `i` comes out as it went in.
    unsafe {
        core::arch::asm!("/* {0} */", inout(reg) i, options(pure, nomem, nostack, preserves_flags));
    }
    i
}
