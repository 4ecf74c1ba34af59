//! Where a free goes: the calling thread's own page (or free cache), the
//! calling CPU's cache (`cpu.rs`, where there are per-CPU caches), else the
//! page's remote list (`free.rs`). Above both parts it routes between.

use super::free::free_remote;
use super::{Heap, cpu, current_or_none};
use crate::alloc::engine::segment;
use crate::alloc::engine::types::{Block, OWNER_THREAD, Page, SmallSegment};
use crate::sync::Ordering;

/// Frees `p`, a live block of `page` (of a small segment), on the page's
/// free list if the calling thread's heap owns it, else on its remote list.
///
/// # Safety
/// `p` is a live block of `page`, checked (hardened builds) and marked freed.
#[inline(always)]
pub(crate) unsafe fn free_block(page: *mut Page, p: *mut u8) {
    // (`NO_HEAP` owns no page.)
    let heap = current_or_none();
    // SAFETY: `p` is a live block of `page` (the caller's word), so `page` is a live
    // descriptor whose `info.heap` is fixed while `p` is; equal to ours, we own the page.
    unsafe {
        if (*page).info.heap.load(Ordering::Relaxed) == heap {
            Heap::free_local(heap, page, p.cast::<Block>());
        } else {
            free_foreign(page, p.cast::<Block>());
        }
    }
}

/// Frees `p`, a live block of small segment `seg` whose slot's sink
/// ([`sink_of`](segment::sink_of)) is `sink`: into the sink if the
/// calling thread's heap owns it, else onto its page's remote list.
///
/// # Safety
/// `p` is a live block of `seg`; `sink` its slot's sink.
#[inline(always)]
pub(crate) unsafe fn free_to_sink(seg: *mut SmallSegment, sink: *mut Page, p: *mut u8) {
    // (`NO_HEAP` owns no page, nor is it a free cache's heap.)
    let heap = current_or_none();
    // SAFETY: `p` is a live block of `seg` and `sink` its slot's sink (the caller's word);
    // the sink's `info.heap` is the page's owner (a free cache's is its heap), fixed
    // while `p` is live.
    unsafe {
        if (*sink).info.heap.load(Ordering::Relaxed) == heap {
            debug_assert!(
                Heap::is_cache(heap, sink) || sink == segment::page_of(seg, p),
                "a slot's sink is its page or its owner's free cache"
            );
            debug_assert!(
                (*heap).owned.load(Ordering::Relaxed) == OWNER_THREAD,
                "a local free into a heap no thread owns"
            );
            debug_assert!(
                (*segment::page_of(seg, p)).info.heap.load(Ordering::Relaxed) == heap,
                "a local free of another heap's block (sink {sink:p}, page {:p})",
                segment::page_of(seg, p)
            );
            Heap::free_local(heap, sink, p.cast::<Block>());
        } else {
            free_foreign(segment::page_of(seg, p), p.cast::<Block>());
        }
    }
}

/// A free of a block whose page (or sink) the calling thread's heap does
/// not own: into the calling CPU's cache where there are per-CPU caches
/// that hold its class and node (`cpu.rs`), else a remote free.
///
/// # Safety
/// As [`free_remote`].
///
/// Without the caches, a jump to [`free_remote`] after one test, as before
/// there were caches: a call of its own ahead of it (a frame, the test)
/// cost every remote free of the per-thread caches, which every
/// cross-thread workload makes.
#[inline(always)]
pub(super) unsafe fn free_foreign(page: *mut Page, block: *mut Block) {
    // SAFETY: `block` is a live block of `page`, given up (the caller's word).
    unsafe {
        if cpu::get().is_none() {
            free_remote(page, block);
        } else {
            free_cached(page, block);
        }
    }
}

/// [`free_foreign`] where there are per-CPU caches. Cold, though it is
/// every free of a thread the caches serve: so the fast paths of the
/// per-thread caches keep the local free as their straight line (laid
/// out as the likely branch). The push it mostly is makes no call, so it
/// saves no register: the rest is a tail call away (five registers saved
/// and restored were a sixth of a per-CPU `malloc`/`free` pair).
///
/// # Safety
/// As [`free_remote`].
#[cold]
#[inline(never)]
unsafe fn free_cached(page: *mut Page, block: *mut Block) {
    // SAFETY: `block` is a live block of `page`, given up (the caller's word).
    unsafe {
        if !cpu::push_free(page, block.cast()) {
            free_cached_slow(page, block);
        }
    }
}

/// [`free_cached`] when its push did not serve: a full stack, another
/// node's block, a class or owner the caches do not take.
///
/// # Safety
/// As [`free_remote`].
#[cold]
#[inline(never)]
unsafe fn free_cached_slow(page: *mut Page, block: *mut Block) {
    // SAFETY: as in `free_cached`.
    unsafe {
        if !cpu::free(page, block.cast()) {
            free_remote(page, block);
        }
    }
}
