//! Thread-local heaps: the fast paths.
//!
//! Each thread allocates through its own [`Heap`]: one "direct" page per size
//! class whose free list it pops with no atomic operation and no lock. When
//! that page runs dry the caller refills it ([`Heap::refill`]) under a
//! [`Placement`]: which of the heap's pages may serve, and which arena a
//! fresh page comes from. The heap knows nothing of memory policies; the
//! placement says what they mean (`placement.rs`). Blocks freed by other
//! threads come back through the pages' lock-free `thread_free` lists.
//!
//! What the owner frees goes to the heap's *free cache* of the block's
//! class (one list across its pages on its node, newest first; hardened
//! builds: the block's page), and where the placement would take any such
//! page, the cache is the class's direct page: a freed block is the next
//! handed out, from any of the pages, as a per-class thread cache does
//! (tcmalloc's). It is refilled with a page's whole free list, and gives
//! all but its room's newest half back to the pages when full. Measured on
//! the public allocator benchmarks' patterns: `benches/RESULTS.md`.
//!
//! A heap can also *lend* a class's direct slot to a page it does not own
//! ([`Heap::lend`]): the fast path then serves that page's blocks until the
//! loan ends ([`Heap::end_loan`]), which takes them back out of the heap's
//! counters. The thread interleaver hands the rest of a turn to the fast
//! path this way.
//!
//! When a thread exits, its heap gives back its empty pages and waits, whole,
//! on its node's arena for a new thread to adopt it: spawning and joining
//! threads reuses heaps instead of growing memory.
//!
//! This file holds what every part reads; the parts:
//! `pop.rs` (the fast path and the refill), `route.rs` (where a free goes),
//! `free.rs` (local and remote frees, gathering remote ones), `cpu.rs` (the
//! per-CPU caches), `free_cache.rs`, `lists.rs`
//! (page lists, the direct slot's references, empty and idle pages),
//! `loan.rs` (lent slots), `registry.rs` (a heap made and listed),
//! `giveback.rs` (what the heap holds free given back, and arming: the
//! mechanisms the lifecycle uses), `shared.rs` (a thread's first blocks of
//! a class from its node's shared heap) and `links.rs` (free-list links,
//! encoded in hardened builds). The heap's type is in `types.rs`; when it
//! gives memory back and how a thread's exit leaves it is the lifecycle's
//! (`lifecycle/`).

pub(crate) mod cpu;
mod free;
mod free_cache;
mod giveback;
mod links;
mod lists;
mod loan;
mod pop;
mod registry;
mod route;
mod shared;

pub(crate) use free_cache::{CACHING, cache_room};
pub(crate) use links::{corrupted_list, kind_of, link, next_of, outside};
pub(crate) use lists::{EXPIRE_EVERY, GROWN};
pub(crate) use registry::for_each_heap;
pub(crate) use route::{free_block, free_to_sink};

use core::ptr;

#[cfg(debug_assertions)]
use super::segment::{self, segment_of};
use super::size_class::{self, CLASSES, page_slots};
#[cfg(debug_assertions)]
use super::types::SmallSegment;
use super::types::{Page, SLOT_SIZE};
use crate::hardened::HARDENED;
use crate::sync::{AtomicU64, Ordering};
use crate::topology::NodeSet;

pub(crate) use super::types::Heap;

/// The page every empty direct slot points to, so the fast path needs no null
/// check: its free list is always empty.
static EMPTY_PAGE: EmptyPage = EmptyPage(Page::empty());
#[repr(transparent)]
struct EmptyPage(Page);
// SAFETY: never written: `free` stays null, so no path reaches past the check
// that sends callers to the slow path, which replaces it before touching it.
unsafe impl Sync for EmptyPage {}

#[inline(always)]
pub(crate) const fn empty_page() -> *mut Page {
    ptr::addr_of!(EMPTY_PAGE.0).cast_mut()
}

/// What the thread-local slot of a thread without a heap points to (before
/// its first allocation, after its exit): a heap's `direct` array whose
/// every page is the empty page. A fast path pops from it as from a heap,
/// finds no block and goes to its slow path, so it tests no null heap (two
/// instructions, as mimalloc's `_mi_heap_empty`); the slow paths tell it
/// apart ([`current`]) and never refill it. Only `direct` is ever read,
/// and nothing is written.
#[repr(C)]
struct NoHeap([*mut Page; CLASSES]);
// SAFETY: never written (see above); the pages it points to are the empty
// page, itself never written.
unsafe impl Sync for NoHeap {}
static NO_HEAP: NoHeap = NoHeap([empty_page(); CLASSES]);
// A fast path reads `(*heap).direct[class]` of `NO_HEAP` cast to a heap.
const _: () = assert!(core::mem::offset_of!(Heap, direct) == 0);

/// [`NO_HEAP`] as a heap pointer (only its `direct` may be read).
#[inline(always)]
pub(crate) fn no_heap() -> *mut Heap {
    ptr::addr_of!(NO_HEAP).cast_mut().cast()
}

/// What the slot of a thread the per-CPU caches serve (`cpu.rs`) points to
/// while it has no heap: as [`NO_HEAP`] for the fast paths, but its slow
/// paths go straight to the caches, having decided once that they may.
static CPU_NO_HEAP: NoHeap = NoHeap([empty_page(); CLASSES]);

/// [`CPU_NO_HEAP`] as a heap pointer (only its `direct` may be read).
#[inline(always)]
pub(crate) fn cpu_no_heap() -> *mut Heap {
    ptr::addr_of!(CPU_NO_HEAP).cast_mut().cast()
}

/// Whether `h`, a value of the thread's slot, is a heap (not one of the two
/// that are none).
#[inline(always)]
pub(crate) fn is_heap(h: *mut Heap) -> bool {
    h != no_heap() && h != cpu_no_heap()
}

/// Marks the calling thread, which has no heap, as one the per-CPU caches
/// serve (`true`), or as undecided again (`false`: its next slow path
/// decides, as a new thread's does).
pub(crate) fn set_cpu_served(on: bool) {
    debug_assert!(!is_heap(current_or_none()), "a thread with a heap marked");
    crate::os::tls::set(if on { cpu_no_heap() } else { no_heap() }.cast());
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
core::arch::global_asm!(
    // The thread-local slot `os/tls.rs` reads and writes, defined here for
    // its initial value, `NO_HEAP`'s address (initialised: `.tdata`; the
    // dynamic linker relocates the image before it copies it for a thread,
    // as it does for mimalloc's `_mi_heap_default`). Hidden, so that the
    // symbol stays inside the binary or library it is linked into.
    ".pushsection .tdata,\"awT\",@progbits",
    ".p2align 3",
    ".globl __numaweave_heap_tls",
    ".hidden __numaweave_heap_tls",
    ".type __numaweave_heap_tls, @object",
    ".size __numaweave_heap_tls, 8",
    "__numaweave_heap_tls:",
    ".quad {none}",
    // The time of the thread's last heartbeat (`os::tls::swap_beat`), beside it.
    ".globl __numaweave_beat_tls",
    ".hidden __numaweave_beat_tls",
    ".type __numaweave_beat_tls, @object",
    ".size __numaweave_beat_tls, 8",
    "__numaweave_beat_tls:",
    ".quad 0",
    ".popsection",
    none = sym NO_HEAP,
);

/// Adds to a counter its owner alone writes (a load and a store, no
/// read-modify-write).
#[inline(always)]
pub(crate) fn bump(c: &AtomicU64, by: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(by), Ordering::Relaxed);
}

/// What a refill may use: the caller's rule for where memory comes from.
/// Implemented by the memory policies (`placement.rs`); the heap only asks.
pub(crate) trait Placement {
    /// Whether a page of the heap on `node` may serve.
    fn accepts(&mut self, node: usize) -> bool;
    /// The node whose arena gives a fresh page, and the nodes its fallback
    /// may use when that node is out of memory (`None`: any, by distance).
    fn fresh(&mut self) -> (usize, Option<NodeSet>);
    /// A fresh page came, from `node` (another than asked, after a fallback).
    fn took(&mut self, node: usize);
    /// Whether the heap's free cache may serve, its blocks all of pages on
    /// `node` (the heap's node): where the policy would take such a page,
    /// and chooses among them by nothing else. (Not under an interleave,
    /// whose turns count blocks page by page.)
    fn cache_serves(&mut self, node: usize) -> bool {
        let _ = node;
        false
    }
}

/// The calling thread's heap, if it has one: null before its first
/// allocation and after it exited.
#[inline(always)]
pub(crate) fn current() -> *mut Heap {
    let h = current_or_none();
    if is_heap(h) { h } else { ptr::null_mut() }
}

/// The calling thread's heap, or [`no_heap`] where it has none: what the
/// fast paths pop from (and compare a page's owner with), one `fs:`-relative
/// load (see `os/tls.rs`). Never refilled or written through.
#[inline(always)]
pub(crate) fn current_or_none() -> *mut Heap {
    let h: *mut Heap = crate::os::tls::get().cast();
    // Other targets' `thread_local!` slot starts null.
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    if h.is_null() {
        return no_heap();
    }
    debug_assert!(!h.is_null(), "the slot starts at NO_HEAP and is never set to null");
    h
}

/// Whether a pop of a page with free blocks served `p`: always, but in a
/// hardened build whose pop found the list corrupted and, under
/// `NUMAWEAVE_ON_ERROR=report`, dropped it (null: the caller looks further).
#[inline(always)]
pub(crate) fn served(p: *mut u8) -> bool {
    !HARDENED || !p.is_null()
}

/// Whether a hardened build may have dropped a corrupted free list (its
/// free blocks lost to their page) since a report it went on from.
pub(crate) fn lists_dropped() -> bool {
    HARDENED && crate::hardened::went_on()
}

/// The address range of `page`'s slots: from its first slot's start (a
/// [coloured](size_class::coloured) page's block starts a few lines in)
/// to its last slot's end.
///
/// # Safety
/// `page` is a live heap page (its `info` is read).
#[inline]
pub(crate) unsafe fn page_span(page: *mut Page) -> core::ops::Range<usize> {
    // SAFETY: the caller passes a live page.
    let (start, slots) = unsafe { ((*page).info.start as usize, usize::from((*page).info.slots)) };
    let base = start & !(SLOT_SIZE - 1);
    base..base + slots * SLOT_SIZE
}

/// Whether `p` lies in the blocks of `page` (a heap page).
///
/// # Safety
/// `page` is a live heap page (its `info` is read).
pub(crate) unsafe fn in_page(page: *mut Page, p: *const u8) -> bool {
    // SAFETY: the caller passes a live page.
    unsafe { page_span(page) }.contains(&(p as usize))
}

/// The block of a [coloured](size_class::coloured) class that `p`, just
/// handed out, is, moved down to `align` (a power of two, at most a slot)
/// when it is not aligned so. The page holds this one block, which starts
/// at most a colour's few lines past the page's 64 KiB-aligned start and
/// ends at least that far before its end: moved down, it still lies in the
/// page, and it is the page's one block at its new address, which frees
/// and later handouts use (the page has lost its colour until it goes back
/// to its arena). Nothing of the page changes: its `info.start` still
/// says where its block was carved, and the tail past that block, which
/// the lifecycle purges, lies past the moved one too. A block of any other
/// class, or one already aligned, is `p`.
///
/// # Safety
/// `p` is a block of a small page of `class`, just handed out, or null.
#[inline]
pub(crate) unsafe fn realigned(p: *mut u8, class: usize, align: usize) -> *mut u8 {
    if !size_class::coloured(class) || (p as usize).is_multiple_of(align) {
        return p;
    }
    debug_assert!(align.is_power_of_two() && align <= SLOT_SIZE && !p.is_null());
    let q = (p as usize & !(align - 1)) as *mut u8;
    // SAFETY: a block of a small page (the caller's word): its segment
    // header and page descriptor are live.
    #[cfg(debug_assertions)]
    unsafe {
        let page = segment::page_of(segment_of(p).cast::<SmallSegment>(), p);
        debug_assert!((*page).info.capacity == 1 && usize::from((*page).info.class) == class);
        debug_assert!(
            page_span(page).start <= q as usize && p as usize + size_class::class_size(class) <= page_span(page).end
        );
    }
    q
}

/// The node (arena) of one of the heap's pages.
#[inline(always)]
pub(crate) unsafe fn node_of(page: *mut Page) -> usize {
    // SAFETY: the caller passes a live page.
    usize::from(unsafe { (*page).info.node })
}

/// Bytes of memory a fresh page of `class` takes from its arena.
pub(crate) const fn page_bytes(class: usize) -> usize {
    page_slots(class) * SLOT_SIZE
}

#[cfg(test)]
mod tests;
