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
//! The allocator places its mappings between 1 TiB and 8 TiB, by hint
//! ([`NEAR`], as mimalloc places its segments from 2 TiB), and the marks
//! cover the addresses below 8 TiB: 2 MiB of zeroed static memory (`.bss`:
//! address space only; the kernel commits a page of it when a segment in
//! the 16 GiB it covers is first marked), at a fixed address, so that the
//! check is a shift, a bound and one byte compared (`free` runs it on every
//! call of a C program: a byte rather than a bit saves the word index, the
//! bit index and the bit test, and holding the kind saves the header's load
//! that the check would otherwise add). A mapping the kernel had to place
//! elsewhere (the range taken) is marked in a second map of the whole user
//! address space below 2^47, mapped when first needed (32 MiB of address
//! space); C's `free` finds such blocks out of line. (A map of the whole
//! address space in `.bss` made every process 32 MiB larger in virtual
//! size: python3 could not start under `ulimit -v 50000`.)

use core::ptr::{self, NonNull};

use super::segment::segment_of;

use super::types::{SEGMENT_SHIFT, SegmentKind};
use crate::hardened::HARDENED;
use crate::os::mem::{self, AddressRange};
use crate::sync::{AtomicPtr, AtomicU8, Ordering};

/// Where the allocator's mappings go: 1 TiB to 8 TiB.
pub(crate) static NEAR: AddressRange = AddressRange::new(NEAR_RANGE.start, NEAR_RANGE.end);

/// The address range of [`NEAR`].
pub(crate) const NEAR_RANGE: core::ops::Range<usize> = (1 << 40)..(1 << NEAR_BITS);

/// The marks cover addresses below 2^43 (8 TiB) in [`MAP`], the rest of
/// the user address space (below 2^47) in [`FAR`].
const NEAR_BITS: usize = 43;
const CHUNKS: usize = 1 << (NEAR_BITS - SEGMENT_SHIFT);
const ALL_CHUNKS: usize = 1 << (47 - SEGMENT_SHIFT);

/// The marks (zeroed: nothing is ours until marked).
static MAP: [AtomicU8; CHUNKS] = [const { AtomicU8::new(0) }; CHUNKS];

/// The marks of chunks at or above 8 TiB, indexed as [`MAP`] (its first
/// `CHUNKS` bytes unused): mapped when a mapping first lands there.
static FAR: AtomicPtr<AtomicU8> = AtomicPtr::new(ptr::null_mut());

/// [`FAR`], mapped now if `make` (null if it is not and cannot be).
#[cold]
#[inline(never)]
fn far(make: bool) -> *mut AtomicU8 {
    let f = FAR.load(Ordering::Acquire);
    if !f.is_null() || !make {
        return f;
    }
    let Ok(m) = mem::map(ALL_CHUNKS) else { return ptr::null_mut() };
    let m = m.as_ptr().cast::<AtomicU8>();
    match FAR.compare_exchange(ptr::null_mut(), m, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => m,
        Err(other) => {
            // SAFETY: the mapping just made, seen by no one.
            let _ = unsafe { mem::unmap(NonNull::new_unchecked(m.cast()), ALL_CHUNKS) };
            other
        }
    }
}

/// The mark of chunk `i` (below 2^47), if it has one to hold: `MAP`'s, or
/// `FAR`'s (mapped now with `make`).
#[inline(always)]
fn entry(i: usize, make: bool) -> Option<&'static AtomicU8> {
    if i < CHUNKS {
        return Some(&MAP[i]);
    }
    if i >= ALL_CHUNKS {
        return None;
    }
    let f = far(make);
    // SAFETY: a mapping of `ALL_CHUNKS` zeroed bytes that is never unmapped
    // once published; `i` is within it.
    (!f.is_null()).then(|| unsafe { &*f.add(i) })
}

/// Hardened builds: the marks of chunks below 8 TiB that held a huge block
/// freed since (a second free of its start is a double free, not a foreign
/// pointer; above 8 TiB it is reported as a foreign one). Empty in a
/// default build, which would carry 2 MiB of `.bss` for nothing.
static FREED_HUGE: [AtomicU8; FREED_CHUNKS] = [const { AtomicU8::new(0) }; FREED_CHUNKS];
const FREED_CHUNKS: usize = if HARDENED { CHUNKS } else { 0 };

/// The bit of a huge block's mark; the low five bits are the log2 of the
/// block's offset from its header. (Small and region marks have it clear.)
const HUGE_MARK: u8 = 0x80;
const _: () = assert!(SegmentKind::Small as u8 & HUGE_MARK == 0 && SegmentKind::Region as u8 & HUGE_MARK == 0);

/// Whether the chunk at `base` can be marked: below 8 TiB, or the marks
/// above are mapped (now, if need be). A mapping whose chunk cannot be is
/// given up by the caller before anything is put in it.
pub(crate) fn can_mark(base: *const u8) -> bool {
    entry(base as usize >> SEGMENT_SHIFT, true).is_some()
}

/// Marks the chunk at `base` (4 MiB aligned, [`can_mark`]) as holding a
/// live small segment or region (`kind`; its header written already).
pub(crate) fn insert(base: *const u8, kind: SegmentKind) {
    debug_assert!(kind != SegmentKind::Huge, "a huge block is marked with its offset");
    mark(base, kind as u8);
}

/// Marks the chunk at `base` ([`can_mark`]) as holding a live huge block
/// at `base + offset` (its header written already).
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
    let i = base as usize >> SEGMENT_SHIFT;
    let Some(e) = entry(i, true) else {
        debug_assert!(false, "a chunk marked that cannot be (can_mark)");
        return;
    };
    let old = e.swap(mark, Ordering::Relaxed);
    debug_assert_eq!(old, 0, "a segment marked twice");
    if let Some(f) = FREED_HUGE.get(i) {
        f.store(0, Ordering::Relaxed);
    }
}

/// Hardened builds: unmarks the chunk of a huge block being freed, and
/// remembers its mark.
pub(crate) fn remove_huge(base: *const u8) {
    let i = base as usize >> SEGMENT_SHIFT;
    if let Some(e) = entry(i, false) {
        let old = e.swap(0, Ordering::Relaxed);
        debug_assert!(is_huge(old), "a huge block's chunk marked {old:#x}");
        if let Some(f) = FREED_HUGE.get(i) {
            f.store(old, Ordering::Relaxed);
        }
    }
}

/// Hardened builds: whether `p` is the start of a huge block freed since
/// (rather than any other address of its chunk, which may be anyone's).
pub(crate) fn was_freed_huge(p: *const u8) -> bool {
    FREED_HUGE.get(segment_of(p) as usize >> SEGMENT_SHIFT).is_some_and(|f| {
        let m = f.load(Ordering::Relaxed);
        m != 0 && is_huge_block(p, m)
    })
}

/// Unmarks the chunk at `base` (its segment is going away).
pub(crate) fn remove(base: *const u8) {
    if let Some(e) = entry(base as usize >> SEGMENT_SHIFT, false) {
        let old = e.swap(0, Ordering::Relaxed);
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
    match MAP.get(i) {
        Some(m) => m.load(Ordering::Relaxed),
        None => far_kind(i),
    }
}

/// [`kind`] of a pointer below 8 TiB only (0 above): C's `free` takes
/// this on its straight path, the rest out of line.
#[inline(always)]
pub(crate) fn near_kind(p: *const u8) -> u8 {
    let i = opaque((p as usize).wrapping_sub(1) >> SEGMENT_SHIFT);
    MAP.get(i).map_or(0, |m| m.load(Ordering::Relaxed))
}

/// [`kind`] of chunk `i`, at or above 8 TiB.
#[cold]
#[inline(never)]
fn far_kind(i: usize) -> u8 {
    entry(i, false).map_or(0, |m| m.load(Ordering::Relaxed))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_placed_below_8_tib_and_others_are_marked_far() {
        // A mapping placed for the allocator lands in its range, on a chunk
        // boundary, and is found by the straight path's lookup.
        let near = NEAR.map_aligned_at(1 << SEGMENT_SHIFT, 1 << SEGMENT_SHIFT, 0, mem::Charge::Lazy).unwrap();
        assert!(NEAR.contains(near.as_ptr()), "placed at {:p}", near.as_ptr());
        insert(near.as_ptr(), SegmentKind::Small);
        // SAFETY: inside the mapping.
        let inner = unsafe { near.as_ptr().add(4096) };
        assert_eq!(near_kind(inner), SegmentKind::Small as u8);
        assert_eq!(kind(inner), SegmentKind::Small as u8);
        remove(near.as_ptr());
        assert_eq!(kind(inner), 0);
        // One the kernel placed (near the top of the address space): marked
        // in the far map, invisible to the straight path, found by `kind`.
        let far = mem::map_aligned(1 << SEGMENT_SHIFT, 1 << SEGMENT_SHIFT).unwrap();
        assert!(far.as_ptr() as usize >= 1 << NEAR_BITS, "the kernel placed a mapping at {:p}", far.as_ptr());
        assert!(can_mark(far.as_ptr()));
        insert(far.as_ptr(), SegmentKind::Region);
        // SAFETY: inside the mapping.
        let inner = unsafe { far.as_ptr().add(4096) };
        assert_eq!(near_kind(inner), 0);
        assert_eq!(kind(inner), SegmentKind::Region as u8);
        assert!(owns(inner));
        remove(far.as_ptr());
        assert!(!owns(inner));
        // SAFETY: the test's own mappings, unmarked.
        unsafe {
            mem::unmap(near, 1 << SEGMENT_SHIFT).unwrap();
            mem::unmap(far, 1 << SEGMENT_SHIFT).unwrap();
        }
    }

    #[test]
    fn a_span_someone_holds_is_skipped() {
        // Two spans at 16 TiB (above the allocator's range: nothing of the
        // process is there); the first held by another range's mapping.
        let (s, span) = (1usize << 44, 4usize << 20);
        let holder = AddressRange::new(s, s + span).map_aligned_at(span, span, 0, mem::Charge::Lazy).unwrap();
        assert_eq!(holder.as_ptr() as usize, s);
        let range = AddressRange::new(s, s + 2 * span);
        let got = range.map_aligned_at(span, span, 0, mem::Charge::Lazy).unwrap();
        assert_eq!(got.as_ptr() as usize, s + span, "the held span was skipped, the free one taken");
        // SAFETY: the test's own mappings.
        unsafe {
            mem::unmap(holder, span).unwrap();
            mem::unmap(got, span).unwrap();
        }
    }
}
