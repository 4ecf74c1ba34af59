//! Hardened builds (cargo feature `hardened`): misuse of the allocator is
//! caught and reported instead of silently corrupting a heap. The checks
//! are a layer, as snmalloc's are: this module is compiled in every build,
//! and every use of it sits behind `if HARDENED { … }` ([`HARDENED`], a
//! constant), so a default build's code has none of it (the compiler drops
//! the branch before optimising) while both builds type-check the same
//! code. Data a default build must not carry is sized by the constant (the
//! map of freed huge mappings, a huge segment's block start, a slab cache's
//! checks: no bytes); `cfg` is left for the public report hook.
//!
//! - Free-list links of heap pages are stored encoded with a per-page key
//!   (mimalloc's encoded free lists, SLUB's hardened free pointer) and
//!   checked before a pop reads through them (the list's head in its page):
//!   a link that does not decode to a block of the page is a corrupted
//!   list.
//! - A freed block carries a *freed mark* in its second word (a value of the
//!   block's address and a process secret), cleared when it is handed out
//!   again: a free that finds it is a double free (heap, region blocks, slab
//!   objects; huge blocks by a map of freed huge mappings).
//! - Every free checks ownership first (the segment map: never
//!   dereferencing a foreign pointer) and that the pointer is a block's
//!   start (an interior pointer is reported).
//! - With `NUMAWEAVE_CHECK=full` (run time): each block gets 8 bytes more,
//!   its slack after the requested size filled with a pattern and ended by
//!   the size and a canary, all checked at free (an overflow: SLUB's red
//!   zone); a freed block is filled with a poison pattern, checked when it is
//!   handed out again (a write after free: SLUB's poisoning). Interleaved
//!   I/O buffers (region blocks, whose free runs merge and split) get the
//!   red zone but no poison check.
//! - With `NUMAWEAVE_GUARD=1`: a page no access is allowed to follows every
//!   segment and huge mapping.
//!
//! On detection: one line on stderr naming what and where, formatted on the
//! stack (no allocation), then `abort()`; with `NUMAWEAVE_ON_ERROR=report` the
//! block is leaked and the program goes on.

use core::fmt;
use core::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};

use crate::os::file;

/// Whether this is a hardened build (cargo feature `hardened`): the one
/// switch every check of the allocator and the slab caches sits behind.
pub(crate) const HARDENED: bool = cfg!(feature = "hardened");

/// The process secret (odd once set).
static SECRET: AtomicU64 = AtomicU64::new(0);
/// Bits: 1 `NUMAWEAVE_CHECK=full`, 2 `NUMAWEAVE_ON_ERROR=report`, 4 guards,
/// 0x80 set once read.
static FLAGS: AtomicU8 = AtomicU8::new(0);
const FULL: u8 = 1;
const REPORT: u8 = 2;
const GUARD: u8 = 4;
const READ: u8 = 0x80;

/// Sizes whose last byte's offset (`size - 1`) is below this may take a
/// heap page's block without a red zone: the small sizes' bound, or 0
/// (none) under `NUMAWEAVE_CHECK=full` and until the switches are read. One
/// compare then stands for the size's bound, the switch's test, (for
/// `alloc`) the first-use check, and a zero size's (which wraps past it).
static FAST_BELOW: AtomicUsize = AtomicUsize::new(0);

/// Bytes a block gets beyond its request under `NUMAWEAVE_CHECK=full`: the
/// requested size's distance to the block's end, and a canary.
pub(crate) const PAD: usize = 8;
/// The slack pattern (red zone) and the poison of freed blocks.
pub(crate) const RED: u8 = 0xbe;
pub(crate) const POISON: u8 = 0xde;

/// Sets the secret and reads the run-time switches, once: at the global
/// allocator's start-up, or at the first slab cache's creation when that
/// comes first (the slab caches work under any global allocator).
pub(crate) fn init() {
    if FLAGS.load(Ordering::Acquire) & READ != 0 {
        return;
    }
    let mut s = crate::os::random_u64().unwrap_or_else(|| {
        // No getrandom: the clock and an address, better than a constant.
        crate::os::monotonic_ms() ^ (&SECRET as *const _ as u64).rotate_left(29)
    });
    // Odd: a freed mark (below) is then odd for every block's start, with
    // no `| 1` on the free's path.
    s |= 1;
    // The first caller's secret wins: links already encoded stay readable.
    let _ = SECRET.compare_exchange(0, s, Ordering::AcqRel, Ordering::Acquire);
    let mut flags = READ;
    let on = |name: &core::ffi::CStr, want: &str| file::env(name).is_some_and(|v| v.trim() == want);
    if on(c"NUMAWEAVE_CHECK", "full") {
        flags |= FULL;
    }
    if on(c"NUMAWEAVE_ON_ERROR", "report") {
        flags |= REPORT;
    }
    if on(c"NUMAWEAVE_GUARD", "1") {
        flags |= GUARD;
    }
    for (name, ok) in [(c"NUMAWEAVE_CHECK", ["full", "default"]), (c"NUMAWEAVE_ON_ERROR", ["abort", "report"])] {
        if let Some(v) = file::env(name)
            && !ok.contains(&v.trim())
        {
            file::report(format_args!(
                "numaweave: ignoring {}={v:?} (want {} or {})",
                name.to_string_lossy(),
                ok[0],
                ok[1]
            ));
        }
    }
    FLAGS.store(flags, Ordering::Release);
}

/// Lets sizes up to `small_max` (the size classes' end) take the fast path,
/// unless `NUMAWEAVE_CHECK=full` is on: the global allocator's start-up
/// calls it after [`init`], before any heap exists (until then the bound is
/// 0, which only sends allocations to the slow path).
pub(crate) fn set_fast_bound(small_max: usize) {
    debug_assert!(FLAGS.load(Ordering::Relaxed) & READ != 0, "init first");
    FAST_BELOW.store(if full() { 0 } else { small_max }, Ordering::Relaxed);
}

/// Whether `malloc` may take a block of `size` bytes off a heap page's
/// free list without a red zone: a small size, not 0,
/// `NUMAWEAVE_CHECK=full` off.
/// False until the switches are read; a thread that has a heap reads them
/// true (they are read before any heap exists, and the heap reached the
/// thread through the state's publication).
#[inline(always)]
pub(crate) fn fast_size(size: usize) -> bool {
    size.wrapping_sub(1) < FAST_BELOW.load(Ordering::Relaxed)
}

#[inline(always)]
fn secret() -> u64 {
    SECRET.load(Ordering::Relaxed)
}

/// Whether `NUMAWEAVE_CHECK=full` is on (never in a default build).
#[inline(always)]
pub(crate) fn full() -> bool {
    HARDENED && flags() & FULL != 0
}

/// Whether guard pages are on (never in a default build).
#[inline]
pub(crate) fn guards() -> bool {
    HARDENED && flags() & GUARD != 0
}

/// Whether `NUMAWEAVE_CHECK=full` is on, once the switches were read (on
/// paths only a block that exists can reach: its allocation read them).
#[inline(always)]
pub(crate) fn full_now() -> bool {
    HARDENED && FLAGS.load(Ordering::Relaxed) & FULL != 0
}

/// The switches, read on first use: the very first allocation must know
/// whether it gets a red zone, before the allocator's state exists.
#[inline(always)]
fn flags() -> u8 {
    let f = FLAGS.load(Ordering::Relaxed);
    if f & READ != 0 {
        return f;
    }
    init();
    FLAGS.load(Ordering::Acquire)
}

/// A page's key for encoding its free-list links (from the secret and the
/// page's address: no two pages share one).
#[inline(always)]
pub(crate) fn page_key(page: *const u8) -> usize {
    ((page as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ secret()) as usize | 1
}

/// A link as stored in a free block.
#[inline(always)]
pub(crate) fn encode<T>(p: *mut T, key: usize) -> *mut T {
    ((p as usize ^ key).rotate_left((key & 63) as u32)).wrapping_add(key) as *mut T
}

/// The link a free block stores, decoded.
#[inline(always)]
pub(crate) fn decode<T>(v: *mut T, key: usize) -> *mut T {
    ((v as usize).wrapping_sub(key).rotate_right((key & 63) as u32) ^ key) as *mut T
}

/// The freed mark of the block at `p` (8-aligned, as every block's start;
/// never 0). The secret makes it unguessable without a read of freed memory
/// (which would give the secret away through any function of it, a
/// multiplication included); being odd, the secret keeps it off every
/// aligned pointer and off 0.
#[inline(always)]
pub(crate) fn freed_mark(p: *const u8) -> usize {
    debug_assert!((p as usize).is_multiple_of(8));
    (p as u64 ^ secret()) as usize
}

/// Whether the block at `p` carries its freed mark (in its second word).
///
/// # Safety
/// `p` is a block of at least 16 bytes of this allocator.
#[inline(always)]
pub(crate) unsafe fn is_marked_freed(p: *const u8) -> bool {
    // SAFETY: a block of ours of at least 16 bytes (the caller's word): its
    // second word is in bounds and aligned.
    unsafe { p.cast::<usize>().add(1).read() == freed_mark(p) }
}

/// Marks the block at `p` freed.
///
/// # Safety
/// As [`is_marked_freed`]; the block is being freed.
#[inline(always)]
pub(crate) unsafe fn mark_freed(p: *mut u8) {
    // SAFETY: as in `is_marked_freed`: the block's second word, ours to write
    // while it is being freed.
    unsafe { p.cast::<usize>().add(1).write(freed_mark(p)) }
}

/// Clears the freed mark of a block handed out (so that user data never
/// carries a stale one). Under `full`, first checks its poison (a write
/// after free) if it had been freed. `what` (its length and description) is
/// only asked for then: the common path is one flag test and one store.
///
/// # Safety
/// As [`is_marked_freed`].
#[inline(always)]
pub(crate) unsafe fn handing_out(p: *mut u8, what: impl FnOnce() -> (usize, BlockKind)) {
    if full_now() {
        let (size, what) = what();
        // SAFETY: `p` is a block of ours of `size` bytes (the page or region
        // that hands it out says so): all of it is readable.
        unsafe { check_poison(p, size, what) };
    }
    // SAFETY: a block of ours of at least 16 bytes, being handed out: its
    // second word is ours to clear.
    unsafe { handing_out_plain(p) };
}

/// [`handing_out`] when `NUMAWEAVE_CHECK=full` is off (the caller looked):
/// the freed mark cleared.
///
/// # Safety
/// As [`is_marked_freed`].
#[inline(always)]
pub(crate) unsafe fn handing_out_plain(p: *mut u8) {
    // SAFETY: a block of ours of at least 16 bytes, being handed out: its
    // second word is ours to clear.
    unsafe { p.cast::<usize>().add(1).write(0) };
}

/// The poison check of [`handing_out`], out of line.
///
/// # Safety
/// As [`is_marked_freed`]; `size` is the block's length.
#[inline(never)]
unsafe fn check_poison(p: *mut u8, size: usize, what: BlockKind) {
    // Interleaved (region) blocks are runs of units that merge and split
    // while free: what lies in them then is not one block's poison. They are
    // checked for double frees only.
    // SAFETY: a block of ours of at least 16 bytes (the caller's word).
    if matches!(what, BlockKind::Region(..)) || !unsafe { is_marked_freed(p) } {
        return;
    }
    // SAFETY: the block's bytes past its two first words.
    let body = unsafe { core::slice::from_raw_parts(p.add(16), size.saturating_sub(16)) };
    if let Some(off) = first_not(body, POISON) {
        misuse(format_args!("write after free into {p:p} ({what}): byte {} changed (to {:#04x})", off + 16, body[off]));
    }
}

/// Poisons a block being freed (under `full`), keeping its two first words
/// (link and freed mark).
///
/// # Safety
/// As [`handing_out`].
#[inline]
pub(crate) unsafe fn poison(p: *mut u8, size: usize) {
    if full_now() && size > 16 {
        // SAFETY: the block is `size` bytes, ours, being freed: bytes 16.. are
        // in bounds and no one else's.
        unsafe { p.add(16).write_bytes(POISON, size - 16) };
    }
}

/// Under `full`: writes the red zone of a block of `bs` bytes handed out for
/// `size` bytes (`size + PAD <= bs`).
///
/// # Safety
/// `p` is such a block, ours.
pub(crate) unsafe fn set_red_zone(p: *mut u8, size: usize, bs: usize) {
    debug_assert!(size + PAD <= bs);
    // SAFETY: `p` is a block of ours of `bs` bytes handed out for `size` (the
    // caller's word): `size..bs` is in it.
    unsafe {
        p.add(size).write_bytes(RED, bs - PAD - size);
        let tail = p.add(bs - PAD).cast::<u32>();
        tail.write_unaligned((bs - size) as u32);
        tail.add(1).write_unaligned(freed_mark(p) as u32);
    }
}

/// Under `full`: checks the red zone of the live block `p` of `bs` bytes;
/// false if it was overwritten (reported).
///
/// # Safety
/// As [`set_red_zone`]; the block was handed out with it.
pub(crate) unsafe fn check_red_zone(p: *mut u8, bs: usize, what: BlockKind) -> bool {
    // SAFETY: `p` is a live block of ours of `bs` bytes with a red zone (the
    // caller's word): its last `PAD` bytes are in it.
    unsafe {
        let tail = p.add(bs - PAD).cast::<u32>();
        let delta = tail.read_unaligned() as usize;
        let canary = tail.add(1).read_unaligned();
        if canary != freed_mark(p) as u32 || delta < PAD || delta > bs {
            // The size and canary words are the red zone of a block asked
            // for all of its slack: a write one past it lands here.
            misuse(format_args!("write past the end of {p:p} ({what}): the red zone after it was overwritten"));
            return false;
        }
        let size = bs - delta;
        let zone = core::slice::from_raw_parts(p.add(size), bs - PAD - size);
        if let Some(off) = first_not(zone, RED) {
            misuse(format_args!(
                "write past the end of {p:p} ({what}, {size} bytes asked): byte {} after its end changed",
                off
            ));
            return false;
        }
    }
    true
}

/// Under `full`: the size a live block was asked for (its red zone's).
///
/// # Safety
/// As [`check_red_zone`].
pub(crate) unsafe fn asked_size(p: *const u8, bs: usize) -> usize {
    // SAFETY: as in `check_red_zone`: the block's last `PAD` bytes are in it.
    let delta = unsafe { p.add(bs - PAD).cast::<u32>().read_unaligned() } as usize;
    bs.saturating_sub(delta.clamp(PAD, bs))
}

/// The offset of the first byte of `b` that is not `v`: 64 bytes a step
/// (vectorized) until one differs, then byte by byte.
#[inline]
pub(crate) fn first_not(b: &[u8], v: u8) -> Option<usize> {
    let pat = u64::from_ne_bytes([v; 8]);
    let mut chunks = b.chunks_exact(64);
    let mut i = 0;
    for c in chunks.by_ref() {
        let acc = c.chunks_exact(8).fold(0, |acc, w| acc | (u64::from_ne_bytes(w.try_into().unwrap()) ^ pat));
        if acc != 0 {
            break;
        }
        i += 64;
    }
    b[i..].iter().position(|&x| x != v).map(|o| o + i)
}

/// What a block is, for reports: `64-byte block, node 1`.
#[derive(Clone, Copy)]
pub(crate) enum BlockKind {
    /// A heap or region block of this size, on this node.
    Sized(usize, usize),
    /// A region block (an interleaved I/O buffer) of this size, on this node.
    Region(usize, usize),
    /// A huge block.
    Huge,
}

impl fmt::Display for BlockKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            BlockKind::Sized(bs, node) => write!(f, "{bs}-byte block, node {node}"),
            BlockKind::Region(bs, node) => write!(f, "{bs}-byte interleaved block, node {node}"),
            BlockKind::Huge => f.write_str("huge block"),
        }
    }
}

/// Reports a misuse: one line on stderr (formatted on the stack), then
/// `abort()`, unless `NUMAWEAVE_ON_ERROR=report` (then the caller leaks the
/// block and goes on).
#[cold]
#[inline(never)]
pub(crate) fn misuse(what: fmt::Arguments<'_>) {
    file::report(format_args!("numaweave: {what}"));
    if flags() & REPORT == 0 {
        crate::os::abort();
    }
    WENT_ON.store(true, Ordering::Relaxed);
}

/// Set once a misuse was reported and the program went on.
static WENT_ON: AtomicBool = AtomicBool::new(false);

/// Whether a misuse was reported and the program went on
/// (`NUMAWEAVE_ON_ERROR=report`): a free list may have been dropped since,
/// its blocks lost to their page (debug assertions on a page's count allow
/// for it).
pub(crate) fn went_on() -> bool {
    WENT_ON.load(Ordering::Relaxed)
}
