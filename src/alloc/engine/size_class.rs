//! Size classes: 8-byte steps up to 128 bytes, four classes per power of two
//! up to 1 KiB, then eight per power of two up to [`SMALL_MAX`] (256 KiB).
//! Internal waste is at most 25% (a 129-byte request gets a 160-byte block)
//! and 12.5% above 1 KiB.
//!
//! Above a KiB, four classes a doubling (as mimalloc's and jemalloc's) cost
//! memory a program's buffers do not use: sqlite3's page cache holds blocks
//! of 1,032, 4,104 and 4,368 bytes (a KiB or a page and a header), and
//! 1,280- and 5,120-byte blocks are 17 – 25% more than they ask, every
//! one touched; its peak RSS was 1.2× glibc's, which fits them to 16 bytes.
//! Eight classes a doubling give them 1,152 and 4,608 bytes (peak RSS 90 →
//! 83 MiB). Below a KiB the classes stay coarse: sizes there are the
//! many small objects of a few types, and a finer class for each spreads
//! them over more pages.
//!
//! Small objects come in word multiples (a Rust value of 24 or 40 bytes, a
//! boxed slice): 16-byte steps gave each of them a word of waste, 14% of a
//! 56-byte object (mimalloc and tcmalloc step by 8 bytes too). A block sits
//! at a multiple of its size from a 64 KiB-aligned page start, so a class
//! whose size is a multiple of 16 (every class above 128 bytes) gives
//! 16-byte-aligned blocks and the others 8-byte-aligned ones. A Rust layout
//! says its alignment, so a type aligned to 16 gets a class of a multiple of
//! 16 ([`class_of_aligned`]) and the others may take the 8-byte steps.
//!
//! C's `malloc` is told no type: C23 (7.24.3) asks that a block of n bytes
//! hold any object of fundamental alignment of at most n bytes, and a
//! `struct { __m128 v; int n; char data[]; }` allocated as `sizeof + 8` (40
//! bytes) needs 16. So the C library's classes ([`class_of_malloc`]) are
//! the 8-byte class for 1 to 8 bytes and the multiples of 16 above, as
//! glibc, jemalloc, mimalloc and tcmalloc give.

use crate::hardened::HARDENED;

/// The geometry blocks are cut from: 4 MiB segments of 64 KiB slots (see
/// `types.rs`'s `Segment`).
pub(crate) const SEGMENT_SHIFT: usize = 22;
/// Size and alignment of a small segment (4 MiB).
pub(crate) const SEGMENT_SIZE: usize = 1 << SEGMENT_SHIFT;
pub(crate) const SEGMENT_MASK: usize = SEGMENT_SIZE - 1;
pub(crate) const SLOT_SHIFT: usize = 16;
/// A page is 1 to 4 slots of 64 KiB (see [`page_slots`]).
pub(crate) const SLOT_SIZE: usize = 1 << SLOT_SHIFT;
pub(crate) const SLOTS: usize = SEGMENT_SIZE / SLOT_SIZE;

/// Largest size served from size-class pages; larger blocks get their own
/// node-bound mapping.
pub const SMALL_MAX: usize = 256 * 1024;

/// Number of size classes.
pub const CLASSES: usize = FINE_CLASSES + (18 - FINE_SHIFT) * 8;

/// Classes up to 128 bytes, in 8-byte steps.
const STEP_CLASSES: usize = 16;

/// Requests of `1 << FINE_SHIFT` bytes and more take eight classes a
/// doubling.
const FINE_SHIFT: usize = 10;

/// The first fine class: after the step classes and four classes for each
/// doubling from 128 bytes.
const FINE_CLASSES: usize = STEP_CLASSES + (FINE_SHIFT - 7) * 4;

/// Smallest block (and the alignment every block has).
pub const MIN_BLOCK: usize = 8;

/// The largest alignment [`class_of_aligned`] serves (a power of two).
pub const CLASS_ALIGN: usize = 16;

/// The first class of page-sized blocks (4 KiB): under an interleave,
/// classes from here on follow the cursor block by block (regions), the
/// ones below it page by page (heap pages). See `alloc/placement.rs`.
pub(crate) const PAGE_CLASS: usize = FINE_CLASSES + (12 - FINE_SHIFT) * 8 - 1;
const _: () = assert!(class_size(PAGE_CLASS) == 4096 && class_size(PAGE_CLASS - 1) < 4096);

/// Class of a request of `size` bytes (`1 ..= SMALL_MAX`; 0 is treated as 1),
/// aligned to 8.
#[inline(always)]
pub fn class_of(size: usize) -> usize {
    class_of_nonzero(size.max(1))
}

/// Class of a request of `size` bytes (at most [`SMALL_MAX`]; 0 is treated
/// as 1) aligned to `align` (a power of two, at most [`CLASS_ALIGN`]). For 16,
/// setting bit 3 of the last byte's offset rounds the size up to a multiple
/// of 16 as far as the classes can tell (above 128 bytes their bounds are
/// multiples of 32, so the bit changes nothing there): one `or` where the
/// alignment is the constant 16, nothing where it is a constant of 8 or
/// less (most Rust layouts), three instructions and no branch where it is
/// not known at compile time.
#[inline(always)]
pub fn class_of_aligned(size: usize, align: usize) -> usize {
    class_of_aligned_nonzero(size.max(1), align)
}

/// The last byte's offset of a request of `size` bytes, which the caller
/// knows is not 0 (the bound it tested was `size - 1 < SMALL_MAX`, which a
/// zero size wraps past): no saturating subtraction, two instructions fewer
/// than [`class_of`]'s `size.max(1)` (`cmp`, `mov`, `adc` for one `lea`).
#[inline(always)]
fn last_of_nonzero(size: usize) -> usize {
    debug_assert!(size != 0 && size <= SMALL_MAX);
    // The hardened build keeps a freed mark in a block's second word: its
    // smallest block is 16 bytes.
    if HARDENED { (size - 1).max(15) } else { size - 1 }
}

/// The class of C's `malloc(size)` (`size` at most [`SMALL_MAX`]; 0 is
/// treated as 1): aligned to 16 above 8 bytes, as C23 asks of a block that
/// any object of fundamental alignment and of its size fits (see the
/// module's documentation).
///
/// The table of `malloc`'s fast path ([`MALLOC_SMALL_CLASS`]), so a refill
/// after its miss serves the class it looked at; the mask keeps a size
/// past [`SMALL_MAX`] (a caller's bug a debug build reports) in the table.
#[inline(always)]
pub fn class_of_malloc(size: usize) -> usize {
    let t = last_of_nonzero(size.max(1));
    usize::from(MALLOC_SMALL_CLASS[(t >> 3) & (SMALL_MAX / 8 - 1)])
}

/// [`class_of_malloc`] by a table with an entry per 8 bytes of
/// every small size ([`MALLOC_SMALL_CLASS`]): one shift and a load, not
/// [`class_index`]'s two indexes and `cmov` (five instructions more), and
/// no branch on the size (a bound at a KiB or at 32 KiB, below which such
/// a table would be 128 bytes or 4 KiB, was a coin toss for loads whose
/// sizes straddle it: bench-malloc-thread's pattern 25% slower at a KiB,
/// the C churn's mispredictions +52% at 32 KiB). What the C library's
/// `malloc` uses; its 32 KiB are read a line per 512 bytes of the sizes a
/// program asks for.
///
/// # Safety
/// `size` is from 1 to [`SMALL_MAX`].
#[inline(always)]
pub(crate) unsafe fn class_of_malloc_small(size: usize) -> usize {
    debug_assert!(size != 0 && size <= SMALL_MAX);
    // SAFETY: `size - 1` (or 15, hardened) is below SMALL_MAX (the caller's
    // word), so the index is below the table's length (a mask here would
    // cost the fast path an instruction: the compiler does not carry the
    // caller's bound this far).
    usize::from(unsafe { *MALLOC_SMALL_CLASS.get_unchecked(last_of_nonzero(size) >> 3) })
}

/// [`class_of_aligned_nonzero`] with an alignment of 16 (C++'s plain
/// `new`), by a table as [`class_of_malloc_small`].
///
/// # Safety
/// As [`class_of_malloc_small`].
#[inline(always)]
pub(crate) unsafe fn class_of_new_small(size: usize) -> usize {
    debug_assert!(size != 0 && size <= SMALL_MAX);
    // SAFETY: as in `class_of_malloc_small`: the index is below the
    // table's length.
    usize::from(unsafe { *NEW_SMALL_CLASS.get_unchecked(last_of_nonzero(size) >> 3) })
}

/// [`MALLOC_CLASS_OF`] by 8-byte steps up to [`SMALL_MAX`].
static MALLOC_SMALL_CLASS: [u8; SMALL_MAX / 8] = {
    let mut table = [0u8; SMALL_MAX / 8];
    let mut i = 0;
    while i < table.len() {
        table[i] = MALLOC_CLASS_OF[class_index(i * 8)];
        i += 1;
    }
    table
};

/// [`CLASS_OF`] by 8-byte steps up to [`SMALL_MAX`] for an alignment of
/// 16: each step's 16-byte multiple (the `or` of
/// [`class_of_aligned_nonzero`] done here, not on `new`'s fast path).
static NEW_SMALL_CLASS: [u8; SMALL_MAX / 8] = {
    let mut table = [0u8; SMALL_MAX / 8];
    let mut i = 0;
    while i < table.len() {
        table[i] = CLASS_OF[class_index((i * 8) | 8)];
        i += 1;
    }
    table
};

/// [`class_of`] of a size known not to be 0 (see [`last_of_nonzero`]).
#[inline(always)]
pub(crate) fn class_of_nonzero(size: usize) -> usize {
    usize::from(CLASS_OF[class_index(last_of_nonzero(size))])
}

/// [`class_of_aligned`] of a size known not to be 0 (see
/// [`last_of_nonzero`]).
#[inline(always)]
pub(crate) fn class_of_aligned_nonzero(size: usize, align: usize) -> usize {
    debug_assert!(align.is_power_of_two() && align <= CLASS_ALIGN && size <= SMALL_MAX);
    usize::from(CLASS_OF[class_index(last_of_nonzero(size) | ((align >> 1) & 8))])
}

/// Entries of the class tables: one per 8 bytes below a KiB, one per 128
/// bytes from there to [`SMALL_MAX`].
const CLASS_INDEXES: usize = (1024 >> 3) + ((SMALL_MAX - 1024) >> 7);

/// Where the class of the request whose last byte is at offset `t`
/// (`size - 1`, below [`SMALL_MAX`]) is in [`CLASS_OF`]: `t / 8` below a
/// KiB (the classes' bounds there are multiples of 8), past those 128
/// entries `t / 128` above (multiples of 128).
///
/// Both are computed and one taken by a `cmov`: no branch anywhere in the
/// class of a size. A branch at 128 bytes (the old 8-byte steps against a
/// shift table above) was mispredicted on 6 – 16% of the requests of a
/// load mixing sizes across it (Larson's 10 – 1,000 bytes, alloc-test's
/// skewed sizes, bench-malloc-thread's): 264,000 of `new`'s 294,000
/// mispredictions in 4,000,000 alloc-test operations (callgrind), and
/// 10 – 16% of the time of those three patterns (`benches/RESULTS.md`).
/// The load costs the 8-byte steps a cycle or two against their `shr`;
/// the lines a program's small sizes read stay in L1.
///
/// The mask keeps the index in the table for any `t` (an out-of-range one
/// is a caller's bug a debug build reports, not a read past the table),
/// so the compiler drops the bound check: it is exact for `t < SMALL_MAX`.
#[inline(always)]
const fn class_index(t: usize) -> usize {
    debug_assert!(t < SMALL_MAX, "a request past SMALL_MAX");
    if t < 1024 { t >> 3 } else { ((t >> 7) & (SMALL_MAX / 128 - 1)) + (1024 >> 3) - (1024 >> 7) }
}

/// The class of each [`class_index`]: the smallest class at least as large
/// as the requests of that index.
static CLASS_OF: [u8; CLASS_INDEXES] = {
    let mut table = [0u8; CLASS_INDEXES];
    let mut i = 0;
    while i < CLASS_INDEXES {
        // The index's first and last request offsets: one class for both.
        let (first, last) = if i < 128 { (i * 8, i * 8 + 7) } else { ((i - 120) * 128, (i - 120) * 128 + 127) };
        let c = class_of_offset(first);
        assert!(c == class_of_offset(last) && c <= u8::MAX as usize);
        table[i] = c as u8;
        i += 1;
    }
    table
};

/// [`CLASS_OF`] for C's `malloc`: the odd (16-aligned) class for each
/// 8-byte step from 9 to 128 bytes; above, every class is a multiple of 32.
/// A constant, what [`MALLOC_SMALL_CLASS`] is built from: not in the
/// binary.
const MALLOC_CLASS_OF: [u8; CLASS_INDEXES] = {
    let mut table = CLASS_OF;
    let mut i = 1;
    while i < 16 {
        table[i] |= 1;
        i += 1;
    }
    table
};

/// The class of the request whose last byte is at offset `t`, computed:
/// the 8-byte steps up to 128 bytes; above, the leading bit of `t` and the
/// two (four classes a doubling) or three (eight) bits after it. What the
/// tables are built from.
const fn class_of_offset(t: usize) -> usize {
    if t < 128 {
        return t >> 3;
    }
    let b = t.ilog2() as usize;
    let (shift, first) =
        if b < FINE_SHIFT { (b - 2, STEP_CLASSES + (b - 7) * 4) } else { (b - 3, FINE_CLASSES + (b - FINE_SHIFT) * 8) };
    // The shifted value's leading bit is worth 4 (or 8) classes.
    first + (t >> shift) - (1 << (b - shift))
}

/// Block size of class `c`.
#[inline(always)]
pub const fn class_size(c: usize) -> usize {
    if c < STEP_CLASSES {
        return (c + 1) * 8;
    }
    if c < FINE_CLASSES {
        let b = 7 + (c - STEP_CLASSES) / 4;
        let k = (c - STEP_CLASSES) % 4;
        return (1 << b) + (k + 1) * (1 << (b - 2));
    }
    let b = FINE_SHIFT + (c - FINE_CLASSES) / 8;
    let k = (c - FINE_CLASSES) % 8;
    (1 << b) + (k + 1) * (1 << (b - 3))
}

/// The class serving `size` bytes aligned to `align` (a power of two), if a
/// size class can: blocks sit at multiples of their size from a 64 KiB-aligned
/// page start, so a class whose size is a multiple of `align` gives aligned
/// blocks.
#[inline]
pub fn class_for(size: usize, align: usize) -> Option<usize> {
    if align <= CLASS_ALIGN {
        return (size <= SMALL_MAX).then(|| class_of_aligned(size, align));
    }
    if align > SLOT_SIZE || size > SMALL_MAX {
        return None;
    }
    let mut c = class_of(size.max(align));
    while c < CLASSES {
        if class_size(c).is_multiple_of(align) {
            return Some(c);
        }
        c += 1;
    }
    None
}

/// Cache lines a [coloured] page's block may start at: its start line
/// turns through them, page by page.
pub const COLOURS: usize = 64;

/// Whether pages of class `c` are *coloured*: one block a page, starting
/// at one of [`COLOURS`] cache lines from the page's 64 KiB-aligned start
/// (`arena::init_page`), the classes from 64 KiB up. Blocks this large at
/// one offset of every page put the hot first lines of a program's tables
/// into the same few of L1's 64 sets (a 4 KiB period): the regex crate's
/// lazy DFA reads its forward and reverse transition tables (64 and 96
/// KiB) from their first lines on, and they missed L1 on 45% of those
/// reads, against 8% under jemalloc, which starts its large blocks at a
/// random cache line; coloured, the workload's L1 misses fell from 24.8M
/// to 14.6M (jemalloc 13.7M), and its time from 1.05× jemalloc's to
/// 1.00×. Costs: up to a 4 KiB page of memory a block touched whole, and
/// for the classes of a multiple of 64 KiB a slot more of address space.
/// A hardened build does not colour: its checks take a block's place from
/// its page's start.
///
/// A coloured block is aligned to 64; a request aligned beyond that takes
/// its block moved down to the alignment, inside its own page
/// ([`realigned`](super::heap::realigned)).
pub const fn coloured(c: usize) -> bool {
    !HARDENED && one_block(c)
}

/// Whether a page of class `c` holds one block: from 64 KiB, the classes
/// a page [colours](coloured) (a hardened build's pages too, uncoloured).
const fn one_block(c: usize) -> bool {
    class_size(c) >= 64 * 1024
}

/// Blocks a page of class `c` holds: what its slots hold, one from 64 KiB.
pub const fn page_blocks(c: usize) -> usize {
    if one_block(c) { 1 } else { page_slots(c) * 64 * 1024 / class_size(c) }
}

/// Slots (64 KiB each) of a page for class `c`: enough for at least four
/// blocks below 64 KiB; one block (rounded up to whole slots, with room
/// for a [coloured] page's offset) from there. A
/// page of eight large blocks got touched block by block as a program's
/// buffers grew through the classes (a GC-heavy lua script held 2 MiB pages
/// of one live 256 KiB buffer each): one block a page, as mimalloc's large
/// pages, commits what is used, and the slots a block does not fill are
/// never touched.
pub const fn page_slots(c: usize) -> usize {
    let bs = class_size(c);
    if bs <= 16 * 1024 {
        1
    } else if bs < 64 * 1024 {
        4
    } else {
        (bs + (COLOURS - 1) * 64).div_ceil(64 * 1024)
    }
}

/// Pages of at most this many blocks (blocks of 1 KiB and more) mask the
/// free blocks a purge takes off their list a bit a block; the others a
/// bit an OS page of their span (see `Page::purged_free`).
pub(crate) const MASKED_BLOCKS: usize = 64;

/// The blocks that bit `k` of a page's `purged_free` stands for on a page
/// of more than [`MASKED_BLOCKS`]: of its first `carved`, those whose first
/// byte (their link) lies in OS page `k` of the span, the page's first
/// block `offset` bytes into it. A block that starts in one OS page and
/// ends in the next belongs to the one it starts in.
pub(crate) fn starting_in(k: usize, offset: usize, block_size: usize, carved: usize) -> core::ops::Range<usize> {
    let os = crate::os::page_size();
    let first = (k * os).saturating_sub(offset).div_ceil(block_size);
    let end = ((k + 1) * os).saturating_sub(offset).div_ceil(block_size).min(carved);
    first..end.max(first)
}

/// Free blocks a page's `purged_free` (`mask`) holds off its list: a bit
/// each on a page of at most [`MASKED_BLOCKS`], else the blocks
/// [`starting_in`] each OS page whose bit is set.
pub(crate) fn masked_blocks(mask: u64, capacity: usize, offset: usize, block_size: usize, carved: usize) -> usize {
    if capacity <= MASKED_BLOCKS {
        return mask.count_ones() as usize;
    }
    let (mut n, mut rest) = (0, mask);
    while rest != 0 {
        n += starting_in(rest.trailing_zeros() as usize, offset, block_size, carved).len();
        rest &= rest - 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_every_size_with_bounded_waste() {
        assert_eq!(class_size(CLASSES - 1), SMALL_MAX);
        assert_eq!(class_of(SMALL_MAX), CLASSES - 1);
        let mut prev = 0;
        for c in 0..CLASSES {
            assert!(class_size(c) > prev, "class sizes increase");
            assert_eq!(class_size(c) % MIN_BLOCK, 0);
            assert!(class_size(c) <= 128 || class_size(c).is_multiple_of(CLASS_ALIGN));
            prev = class_size(c);
        }
        let smallest = if HARDENED { 16 } else { 1 };
        for size in 1..=SMALL_MAX {
            let c = class_of(size);
            assert_eq!(class_of_nonzero(size), c, "the fast paths' class of {size}");
            let bs = class_size(c);
            assert!(bs >= size, "size {size} in class {c} of {bs}");
            assert!(c == 0 || size <= smallest || class_size(c - 1) < size, "size {size} not in the smallest class");
            assert!(bs - size <= (size / 4).max(15), "waste over 25% for {size}: {bs}");
            assert!(size <= 1 << FINE_SHIFT || bs - size <= size / 8, "waste over 12.5% for {size}: {bs}");
            for align in [1, 2, 4, 8, 16] {
                let ca = class_of_aligned(size, align);
                assert_eq!(
                    class_of_aligned_nonzero(size, align),
                    ca,
                    "the fast paths' class of {size} aligned to {align}"
                );
                assert!(class_size(ca) >= size && class_size(ca).is_multiple_of(align), "{size} aligned to {align}");
                assert!(
                    ca == 0
                        || size <= smallest
                        || class_size(ca - 1) < size
                        || !class_size(ca - 1).is_multiple_of(align)
                );
            }
            // C's classes: 16-aligned above 8 bytes, else the smallest.
            let cm = class_of_malloc(size);
            assert_eq!(
                usize::from(MALLOC_CLASS_OF[class_index(last_of_nonzero(size))]),
                cm,
                "C's class of {size} by 8-byte steps and by the classes' bounds"
            );
            let want = if size > MIN_BLOCK { 16 } else { MIN_BLOCK };
            assert!(class_size(cm) >= size && class_size(cm).is_multiple_of(want), "C's class of {size}");
            assert_eq!(cm, class_of_aligned(size, want), "C's class of {size} is the smallest aligned one");
            // SAFETY: a size from 1 to SMALL_MAX.
            let (ms, ns) = unsafe { (class_of_malloc_small(size), class_of_new_small(size)) };
            assert_eq!(ms, cm, "the C library's fast class of {size}");
            assert_eq!(ns, class_of_aligned(size, 16), "C++ new's fast class of {size}");
        }
        assert_eq!(class_of(0), class_of(1));
        assert_eq!(class_of_malloc(0), class_of(1));
        assert_eq!(class_size(class_of_malloc(8)), if HARDENED { 16 } else { 8 });
        assert_eq!(class_size(class_of_malloc(40)), 48, "C23: a 40-byte block holds a 16-aligned header");
        assert_eq!(class_size(class_of(56)), 56, "word-sized objects get their own class");
        assert_eq!(class_size(class_of(4104)), 4608, "a page and a header: 12% waste, not 25%");
        assert_eq!(class_size(class_of(4368)), 4608);
        assert_eq!(class_size(class_of(1032)), 1152, "a KiB and a header: 12% waste, not 24%");
    }

    #[test]
    fn aligned_classes_give_aligned_blocks() {
        for align in [32, 64, 128, 4096, 65536] {
            for size in [1, 24, 100, 1000, 5000, 70000] {
                if let Some(c) = class_for(size, align) {
                    assert_eq!(class_size(c) % align, 0);
                    assert!(class_size(c) >= size);
                }
            }
        }
        assert_eq!(class_size(class_for(0, 16).unwrap()), 16);
        assert_eq!(class_for(10, 1 << 17), None);
        assert_eq!(class_for(SMALL_MAX + 1, 8), None);
        assert_eq!(class_for(SMALL_MAX + 1, 64), None);
        assert_eq!(class_for(usize::MAX, 64), None);
    }

    #[test]
    fn an_os_page_masks_the_blocks_that_start_in_it() {
        let os = crate::os::page_size();
        // 96 B blocks from the span's start: block 42 starts at 4032 and
        // ends past the first OS page, which it belongs to.
        assert_eq!(starting_in(0, 0, 96, 1000), 0..(os.div_ceil(96)));
        assert_eq!(starting_in(1, 0, 96, 1000), os.div_ceil(96)..(2 * os).div_ceil(96));
        // Only carved blocks; none past `carved`, however late the page.
        assert_eq!(starting_in(1, 0, 96, 50), os.div_ceil(96)..50);
        assert!(starting_in(3, 0, 96, 50).is_empty());
        // A first block `offset` bytes in: OS page 0 holds blocks from 0.
        assert_eq!(starting_in(0, 64, 96, 1000), 0..(os - 64).div_ceil(96));
        // The count: a bit a block up to MASKED_BLOCKS, else by OS page.
        assert_eq!(masked_blocks(0b1011, 64, 0, 1024, 64), 3);
        let by_page = (0..3).map(|k| starting_in(k, 0, 16, 4096).len()).sum::<usize>();
        assert_eq!(masked_blocks(0b111, 4096, 0, 16, 4096), by_page);
        assert_eq!(by_page, 3 * os / 16);
    }

    #[test]
    fn pages_hold_several_blocks_below_64_kib_and_one_from_there() {
        for c in 0..CLASSES {
            let (bs, room) = (class_size(c), page_slots(c) * 65536);
            if bs < 64 * 1024 {
                assert!(room / bs >= 4 && page_blocks(c) == room / bs, "class {c}: {} blocks", room / bs);
                assert!(!coloured(c));
            } else {
                assert_eq!(page_blocks(c), 1, "class {c}: one block a page");
                assert_eq!(coloured(c), !HARDENED);
                // The last colour still fits the block, and no slot less would.
                let need = bs + (COLOURS - 1) * 64;
                assert!(room >= need && room - 65536 < need, "class {c}");
            }
        }
    }
}
