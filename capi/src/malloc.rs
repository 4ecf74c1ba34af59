//! The malloc family, with glibc's behaviour at the edges:
//!
//! - a block of more than 8 bytes is aligned to 16 (`alignof(max_align_t)`),
//!   one of 1 to 8 bytes to 8, from every entry point (`malloc`, `calloc`,
//!   `realloc`, the aligned ones, `numaweave_alloc_on_node`): C23 asks that
//!   any object of fundamental alignment no larger than the block fit it,
//!   and a header of a 16-aligned member followed by a flexible array can
//!   be allocated at any size (glibc gives 16 to every block, mimalloc,
//!   jemalloc and tcmalloc 8 only up to 8 bytes); C++'s `new` gets 16 at
//!   every size (see [`cxx`](crate::cxx));
//! - `malloc(0)` and the like return a unique pointer (an 8-byte block),
//!   freed like any other;
//! - on failure null with `errno = ENOMEM` (`posix_memalign` returns the
//!   error, and sets `errno` to `ENOMEM` as glibc's does, not for
//!   `EINVAL`); `calloc` and `reallocarray` check their product;
//! - `realloc(p, 0)` frees `p` and returns null (glibc's choice, C17 leaves it
//!   open); `realloc(NULL, n)` is `malloc(n)`; a failed `realloc` leaves `p`;
//! - `posix_memalign` wants a power of two multiple of `sizeof(void *)`
//!   (`EINVAL`), `aligned_alloc` a power of two (`EINVAL`, as glibc 2.38),
//!   `memalign` rounds other alignments up to a power of two, as glibc does;
//! - `free(NULL)` does nothing; a pointer numaweave did not allocate goes to
//!   the next `free` (see [`foreign`](crate::foreign)).

use core::alloc::{GlobalAlloc, Layout};
use core::ffi::c_void;
use core::ptr;

use numaweave::alloc::{MAX_ALIGN, malloc_align};

use crate::{A, foreign, set_errno};

/// Larger sizes are refused before any layout is made.
const MAX_SIZE: usize = isize::MAX as usize / 2;

/// `size` bytes aligned to `align` (a power of two, at most `MAX_ALIGN`, at
/// least [`malloc_align`]`(size)`), `size` at most `MAX_SIZE`; null with
/// `errno = ENOMEM` on failure.
#[inline(always)]
unsafe fn alloc(size: usize, align: usize, zero: bool) -> *mut c_void {
    debug_assert!(align >= malloc_align(size));
    // SAFETY: `align` is a power of two and `size` rounded up to it fits
    // `isize` (both checked by the callers). `GlobalAlloc` wants a size
    // that is not 0: a zero size gets the smallest block of the alignment.
    let layout = unsafe { Layout::from_size_align_unchecked(size.max(1), align) };
    // SAFETY: a valid layout of a size that is not 0.
    let p = unsafe { if zero { A.alloc_zeroed(layout) } else { A.alloc(layout) } };
    if p.is_null() {
        set_errno(libc::ENOMEM);
    }
    p.cast()
}

/// Allocates `size` bytes (aligned to 16 above 8 bytes, else to 8).
///
/// # Safety
/// The C contract of `malloc`.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
    // The fast path makes no call, so `malloc` keeps no stack frame: what
    // may fail (a refill, errno) is in the slow path, reached by a jump (it
    // is `extern "C"`, so it cannot unwind and needs no landing pad here).
    // SAFETY: any size is accepted; null means "take the slow path".
    let p = unsafe { A.alloc_fast(size) };
    if !p.is_null() {
        return p.cast();
    }
    // SAFETY: the same contract.
    unsafe { malloc_slow(size) }
}

/// `malloc` when the thread's page of the class has no block at hand (or
/// the size is not small, or the thread has no heap yet).
///
/// # Safety
/// The C contract of `malloc`.
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
unsafe extern "C" fn malloc_slow(size: usize) -> *mut c_void {
    // A thread the per-CPU caches serve first: their stack's top (the
    // sequence's registers would cost `malloc` a stack frame).
    // SAFETY: any size is accepted.
    let p = unsafe { A.alloc_cpu(size) };
    if !p.is_null() {
        return p.cast();
    }
    if size == 0 {
        // The fast path sends a zero size here untried: the smallest
        // block, as `malloc(1)` gives it.
        // SAFETY: the same contract.
        return unsafe { malloc(1) };
    }
    if size > MAX_SIZE {
        set_errno(libc::ENOMEM);
        return ptr::null_mut();
    }
    // SAFETY: size checked; `alloc_miss` is `alloc` after the failed pop.
    let p = unsafe { A.alloc_miss(size) };
    if p.is_null() {
        set_errno(libc::ENOMEM);
    }
    p.cast()
}

/// Frees `p` (null: nothing).
///
/// # Safety
/// `p` is null, a live block of this allocator, or a pointer the next
/// allocator owns.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub unsafe extern "C" fn free(p: *mut c_void) {
    // SAFETY: `p` is null, a live block of ours, or the next allocator's (the caller's
    // word), as `free_inline` asks.
    unsafe { free_inline(p) }
}

/// `free`'s body, inlined into C++'s `delete` too: a call from there to
/// the exported `free` is an indirect jump through the GOT (the symbol may
/// be interposed), one more instruction and branch target on every
/// `delete`.
///
/// # Safety
/// As `free`.
#[inline(always)]
pub(crate) unsafe fn free_inline(p: *mut c_void) {
    // The hardened library's free checks ownership itself (and reports a
    // pointer that is not ours, null excepted): one lookup, not two.
    #[cfg(feature = "hardened")]
    {
        // SAFETY: a hardened free reads nothing it has not checked.
        unsafe { A.free(p.cast()) };
        return;
    }
    // The segment map says whether `p` is ours and, if so, its segment's
    // kind: a small block's free falls straight through to its own `ret`;
    // any other pointer, null included (which C programs free often), goes
    // on by a tail call (so `free` keeps no stack frame). With the null
    // test here, LLVM gave both paths one `ret`, and the small free a taken
    // jump to it; in `free_not_small` the null free costs the same, a jump
    // and a test.
    // SAFETY: a pointer in a live segment of ours is a live block of ours
    // (the contract); nothing of any other is read.
    #[allow(unreachable_code)]
    if unsafe { !A.free_if_small(p.cast()) } {
        // SAFETY: `p` is null, a live block of ours or the next allocator's (the caller's
        // word), and `free_if_small` freed nothing of it: as `free_not_small` asks.
        unsafe { free_not_small(p) };
    }
}

/// `free` of a pointer that is not in a small segment of ours: null (a
/// test and a `ret` straight after it), or the rest, by a tail call.
///
/// # Safety
/// As `free`.
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
unsafe fn free_not_small(p: *mut c_void) {
    if !p.is_null() {
        // SAFETY: `p` is not null (tested), and a live block of ours or the next
        // allocator's (the caller's word), as `free_other` asks.
        unsafe { free_other(p) };
    }
}

/// `free` of a region or huge block of ours, or of another allocator's
/// block (the segment map looked at again: off the common path).
///
/// # Safety
/// As `free`, `p` not null.
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
unsafe fn free_other(p: *mut c_void) {
    debug_assert!(!p.is_null());
    // SAFETY: as in `free`.
    if unsafe { !A.free_if_owned(p.cast()) } {
        // SAFETY: `free_if_owned` found `p` in no segment of ours, so by `free`'s
        // contract it is a live block of the next allocator, as `foreign::free` asks.
        unsafe { foreign::free(p) };
    }
}

/// `n` objects of `size` bytes, zeroed; null with `ENOMEM` when the product
/// overflows.
///
/// # Safety
/// The C contract of `calloc`.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub unsafe extern "C" fn calloc(n: usize, size: usize) -> *mut c_void {
    match n.checked_mul(size) {
        // SAFETY: size checked, a valid alignment.
        Some(total) if total <= MAX_SIZE => unsafe { alloc(total, malloc_align(total), true) },
        _ => {
            set_errno(libc::ENOMEM);
            ptr::null_mut()
        }
    }
}

/// Resizes `p` to `size` bytes, keeping its contents up to the smaller size.
///
/// # Safety
/// The C contract of `realloc`.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub unsafe extern "C" fn realloc(p: *mut c_void, size: usize) -> *mut c_void {
    if p.is_null() {
        // SAFETY: `malloc` takes any size; C's contract asks nothing more of its caller.
        return unsafe { malloc(size) };
    }
    // SAFETY: `p` is not null (tested) and, by C's `realloc` contract, a live block of
    // ours or the next allocator's, as `realloc_block` asks.
    unsafe { realloc_block(p, size) }
}

/// `realloc` of a block (`p` not null): out of line, reached by a tail
/// call, so that `realloc(NULL, n)` (some programs' every allocation: lua's)
/// is `malloc`'s path without a stack frame.
///
/// # Safety
/// The C contract of `realloc`, `p` not null.
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
unsafe fn realloc_block(p: *mut c_void, size: usize) -> *mut c_void {
    if size == 0 {
        // SAFETY: `p` is a live block of ours or the next allocator's (C's `realloc`
        // contract, the caller's word), as `free` asks.
        unsafe { free(p) };
        return ptr::null_mut();
    }
    if !A.owns(p.cast()) {
        // SAFETY: not ours: the next allocator's.
        return unsafe { foreign::realloc(p, size) };
    }
    if size > MAX_SIZE {
        set_errno(libc::ENOMEM);
        return ptr::null_mut();
    }
    // SAFETY: a live block of ours, a size checked above (`realloc_unsized`
    // aligns a moved block as `malloc` does).
    let q = unsafe { A.realloc_unsized(p.cast(), size) };
    if q.is_null() {
        set_errno(libc::ENOMEM);
    }
    q.cast()
}

/// `realloc(p, n * size)`, null with `ENOMEM` (and `p` untouched) when the
/// product overflows.
///
/// # Safety
/// The C contract of `reallocarray`.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub unsafe extern "C" fn reallocarray(p: *mut c_void, n: usize, size: usize) -> *mut c_void {
    match n.checked_mul(size) {
        // SAFETY: `p` is null or a live block of ours or the next allocator's (C's
        // `reallocarray` contract), as `realloc` asks.
        Some(total) => unsafe { realloc(p, total) },
        None => {
            set_errno(libc::ENOMEM);
            ptr::null_mut()
        }
    }
}

/// `size` bytes aligned to `align`, or null with `ENOMEM` (also for an
/// alignment beyond what numaweave serves, 1 GiB, as glibc says when it
/// cannot find such memory).
#[unsafe(link_section = ".text.sorted.numaweave")]
unsafe fn aligned(align: usize, size: usize) -> *mut c_void {
    debug_assert!(align.is_power_of_two());
    if align > MAX_ALIGN || size > MAX_SIZE {
        set_errno(libc::ENOMEM);
        return ptr::null_mut();
    }
    // SAFETY: a power of two at most `MAX_ALIGN`, size checked.
    unsafe { alloc(size, align.max(malloc_align(size)), false) }
}

/// POSIX: `*out` = `size` bytes aligned to `align`, a power of two multiple
/// of `sizeof(void *)`; returns 0, `EINVAL` (`errno` untouched) or `ENOMEM`
/// (`errno` set to `ENOMEM` too, as glibc's does: programs print `%m`
/// after it, and glibc's tests look). `*out` is untouched on error.
///
/// # Safety
/// `out` is valid for a write.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> i32 {
    if !align.is_power_of_two() || !align.is_multiple_of(core::mem::size_of::<*mut c_void>()) {
        return libc::EINVAL;
    }
    // SAFETY: a power of two.
    let p = unsafe { aligned(align, size) };
    if p.is_null() {
        // (`aligned` set errno to ENOMEM.)
        return libc::ENOMEM;
    }
    // SAFETY: `out` is valid for a write (the caller's word).
    unsafe { *out = p };
    0
}

/// C11: `size` bytes aligned to `align`, a power of two (else `EINVAL`).
///
/// # Safety
/// The C contract of `aligned_alloc`.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub unsafe extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    if !align.is_power_of_two() {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    }
    // SAFETY: a power of two.
    unsafe { aligned(align, size) }
}

/// `size` bytes aligned to `align` rounded up to a power of two (glibc).
///
/// # Safety
/// The C contract of `memalign`.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub unsafe extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    let Some(align) = align.max(1).checked_next_power_of_two() else {
        set_errno(libc::EINVAL);
        return ptr::null_mut();
    };
    // SAFETY: a power of two.
    unsafe { aligned(align, size) }
}

/// `size` bytes aligned to a page.
///
/// # Safety
/// The C contract of `valloc`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn valloc(size: usize) -> *mut c_void {
    // SAFETY: the page size is a power of two.
    unsafe { aligned(numaweave::os::page_size(), size) }
}

/// `size` bytes rounded up to whole pages (at least one), page-aligned.
///
/// # Safety
/// The C contract of `pvalloc`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pvalloc(size: usize) -> *mut c_void {
    let page = numaweave::os::page_size();
    let Some(size) = size.max(1).checked_next_multiple_of(page) else {
        set_errno(libc::ENOMEM);
        return ptr::null_mut();
    };
    // SAFETY: the page size is a power of two.
    unsafe { aligned(page, size) }
}

/// The bytes usable in the block at `p` (at least what was asked for); 0
/// for null.
///
/// # Safety
/// `p` is null or a live block (of this allocator or the next one).
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub unsafe extern "C" fn malloc_usable_size(p: *mut c_void) -> usize {
    if p.is_null() {
        return 0;
    }
    if !A.owns(p.cast()) {
        // SAFETY: not ours: the next allocator's.
        return unsafe { foreign::usable_size(p) };
    }
    // SAFETY: a live block of ours.
    unsafe { A.usable_size(p.cast()) }
}

/// C23: frees `p`, allocated with `size` bytes.
///
/// # Safety
/// As `free`.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub unsafe extern "C" fn free_sized(p: *mut c_void, _size: usize) {
    // SAFETY: `p` is null or a live block of ours or the next allocator's (the
    // caller's word, as for `free`); the size is found from the block.
    unsafe { free(p) }
}

/// C23: frees `p`, allocated aligned to `align` with `size` bytes.
///
/// # Safety
/// As `free`.
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub unsafe extern "C" fn free_aligned_sized(p: *mut c_void, _align: usize, _size: usize) {
    // SAFETY: `p` is null or a live block of ours or the next allocator's (the
    // caller's word, as for `free`); the size and alignment are found from the block.
    unsafe { free(p) }
}

/// Returns every free page to the OS now (see `NumaAlloc::trim`: the
/// calling thread's free memory, exited threads' heaps, every arena's free
/// pages and cached mappings, slab caches' empty slabs; other threads' at
/// their next slow path). `pad` is ignored, as memory is not kept at a
/// heap's top. 1 if memory went back to the OS, else 0, as glibc's.
#[unsafe(no_mangle)]
pub extern "C" fn malloc_trim(_pad: usize) -> i32 {
    i32::from(numaweave::trim() > 0)
}

/// Prints the allocator's per-node statistics on stderr.
#[unsafe(no_mangle)]
pub extern "C" fn malloc_stats() {
    numaweave::stats::print_to_stderr(&A.stats());
}
