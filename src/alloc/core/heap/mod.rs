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
//! This file holds the heap's state and what every part reads; the parts:
//! `pop.rs` (the fast path and the refill), `free.rs` (local and remote
//! frees, gathering remote ones), `cache.rs` (the free cache), `pages.rs`
//! (page lists, the direct slot's references, empty and idle pages),
//! `loan.rs` (lent slots), `life.rs` (a thread's heap made, adopted, given
//! up), `decay.rs` (the heap's part in giving memory back), `shared.rs`
//! (a thread's first blocks of a class from its node's shared heap) and
//! `links.rs` (free-list links, encoded in hardened builds).

mod cache;
mod decay;
mod free;
mod life;
mod links;
mod loan;
mod pages;
mod pop;
mod shared;

use cache::{CACHING, cache_room};
use decay::{Beat, HeapLife};
#[cfg(feature = "hardened")]
pub(crate) use free::free_block;
#[cfg(not(feature = "hardened"))]
pub(crate) use free::free_to_sink;
pub(crate) use life::{for_each_heap, init_current, thread_exit};
use links::link;
use links::next_of;
#[cfg(feature = "hardened")]
use links::{corrupted_list, kind_of, outside};
use pages::EXPIRE_EVERY;

use core::ptr;
#[cfg(feature = "hardened")]
use core::ptr::NonNull;

use super::arena::Arena;
use super::segment::{Block, Page, SegmentKind, segment_of};
use super::size_class::{CLASSES, page_slots};
use super::state::State;
use super::{segment, size_class};
use crate::sync::{AtomicPtr, AtomicStack, AtomicU64, CachePadded, Ordering};
use crate::topology::NodeSet;

/// The page every empty direct slot points to, so the fast path needs no null
/// check: its free list is always empty.
static EMPTY_PAGE: EmptyPage = EmptyPage(Page::empty());
#[repr(transparent)]
struct EmptyPage(Page);
// SAFETY: never written: `free` stays null, so no path reaches past the check
// that sends callers to the slow path, which replaces it before touching it.
unsafe impl Sync for EmptyPage {}

#[inline(always)]
const fn empty_page() -> *mut Page {
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
    ".popsection",
    none = sym NO_HEAP,
);

/// Per-heap counters: written only by the thread that owns the heap (relaxed
/// load + store, no read-modify-write), read by anyone and summed into
/// [`Stats`](super::stats::Stats).
///
/// Allocations are counted per class, indexed by the class the pop already
/// has in a register: one counter written, no load of the block size; their
/// bytes are each class's count times its block size, summed when read.
/// Frees keep a count and a byte total at fixed places: a free learns its
/// class only from the page, two loads into it, and a counter indexed by
/// that class puts a store whose address comes last on the path (Larson's
/// pattern ran 5–10% slower with it, where these two cost nothing
/// measurable).
pub(crate) struct HeapCounters {
    /// Blocks handed out, per class.
    pub(crate) allocs: [AtomicU64; CLASSES],
    /// Blocks freed into the heap's pages, remote frees included.
    pub(crate) frees: AtomicU64,
    /// Their bytes.
    pub(crate) bytes_freed: AtomicU64,
    /// Blocks other threads freed into this heap's pages, collected here.
    pub(crate) remote_frees: AtomicU64,
}

impl HeapCounters {
    const fn new() -> HeapCounters {
        HeapCounters {
            allocs: [const { AtomicU64::new(0) }; CLASSES],
            frees: AtomicU64::new(0),
            bytes_freed: AtomicU64::new(0),
            remote_frees: AtomicU64::new(0),
        }
    }

    /// Allocations of every class.
    fn allocs_total(&self) -> u64 {
        self.allocs.iter().fold(0u64, |s, a| s.wrapping_add(a.load(Ordering::Relaxed)))
    }

    /// (allocations, frees, bytes allocated, bytes freed, remote frees), summed over the classes.
    fn sums(&self) -> (u64, u64, u64, u64, u64) {
        let ld = |x: &AtomicU64| x.load(Ordering::Relaxed);
        let mut s = (0u64, ld(&self.frees), 0u64, ld(&self.bytes_freed), ld(&self.remote_frees));
        for class in 0..CLASSES {
            let a = ld(&self.allocs[class]);
            s.0 = s.0.wrapping_add(a);
            s.2 = s.2.wrapping_add(a.wrapping_mul(super::size_class::class_size(class) as u64));
        }
        s
    }
}

#[inline(always)]
pub(super) fn bump(c: &AtomicU64, by: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(by), Ordering::Relaxed);
}

/// A list of pages of one class that (may) have free blocks: fresh pages
/// at the head, pages that got a block back while full at the tail (see
/// [`Heap::page_event_with`]).
#[derive(Clone, Copy)]
struct PageList {
    head: *mut Page,
    tail: *mut Page,
}

/// A direct slot lent to a page the heap does not own (see the module docs).
#[derive(Clone, Copy)]
struct Loan {
    /// The lent page (null: no loan).
    page: *mut Page,
    class: usize,
    /// The page's `used` when lent: the fast path counts what it takes.
    used0: u32,
}

#[repr(C)]
pub(crate) struct Heap {
    /// Per class, the page to allocate from: hot, first.
    direct: [*mut Page; CLASSES],
    /// Written by the owner on every operation: next to `direct`, away from
    /// anything other threads write.
    pub(crate) counters: HeapCounters,
    lists: [PageList; CLASSES],
    /// Per class, one page kept when it became empty, so that a heap whose
    /// blocks are freed elsewhere (producer/consumer) does not hand a page to
    /// its arena and take it back over and over. Checked lazily: if it is in
    /// use again when another page empties, that one is kept instead. A
    /// class gone idle gives its kept page back (see [`Heap::expire_kept`]).
    kept_empty: [*mut Page; CLASSES],
    /// Refills of this heap, all classes (wrapping): the clock by which a
    /// class is found idle.
    refills: u32,
    /// Per class, `refills` at its last refill.
    last_refill: [u32; CLASSES],
    /// The node the heap was made or adopted on (stats are booked there).
    pub(crate) node: usize,
    loan: Loan,
    /// Links: all heaps (registry), orphans of an arena.
    pub(crate) next_all: *mut Heap,
    pub(crate) next_orphan: *mut Heap,
    /// Who owns it: [`OWNER_THREAD`] (a live thread), [`OWNER_NONE`] (an
    /// exited thread's, waiting on its arena's orphan list) or
    /// [`OWNER_RECLAIM`] (an orphan a thread is collecting). Changed under
    /// the arena's lock while the heap is listed there.
    pub(crate) owned: AtomicU64,
    /// A word for the layer above: the owning thread's policy state, which
    /// the placement sets when a thread makes or adopts the heap and reads
    /// on refills (cheaper than its thread-local in the C library). Opaque
    /// here: the heap never reads it; a thread's exit clears it.
    pub(crate) policy: *const (),
    /// Pages with remote frees waiting in `thread_free` (doubly linked through
    /// `pend_prev`/`pend_next`).
    pending: *mut Page,
    /// Pages of this heap with remote frees waiting: written by other threads.
    pub(crate) remote_pages: CachePadded<AtomicStack<Page>>,
    /// Per class, the heap's free cache: a page descriptor of no page
    /// ([`Heap::cache_page`]; its `info` names the heap and the class's
    /// block size), whose free list holds blocks of the heap's pages of the
    /// class on the heap's node, the most recently freed first. The owner's
    /// frees of such blocks go here (the slots' sink, `segment::sink_of`),
    /// and where the placement would take any such page the cache is the
    /// class's direct page: a block freed is the next one handed out, its
    /// line still in the CPU's cache, and a class whose pages hold few
    /// blocks is not refilled page after page. Emptied, it is refilled
    /// with a page's whole free list. Its `used` is the room left (length
    /// plus room is [`cache_room`]; a page's list taken whole may leave a
    /// room of one): the free that fills it gives all but the room's newest
    /// half back to the blocks' pages ([`Heap::flush_cache`]), and a refill
    /// under a policy that chooses among pages gives all of it back first.
    /// A cached block is in use for its page, which therefore stays.
    cache: [Page; CLASSES],
    /// Per class, whether the last refill's placement let the free cache
    /// serve; cleared with the direct pages.
    cache_serves: [bool; CLASSES],
    /// Per class, the page the free cache was last filled from (null:
    /// none), tried first at the next fill, as a direct page is: the
    /// blocks freed to it (remote frees, given-back ones) are the
    /// recently used ones, and a producer whose consumer frees its blocks
    /// keeps to one page. It holds a reference on the page, as the direct
    /// slot does (`Heap::set_cache_src`).
    cache_src: [*mut Page; CLASSES],
    /// Per class, the free cache's room at the last look of
    /// [`Heap::expire_kept`]: unchanged at the next, the class is idle and
    /// its cached blocks go back to their pages.
    cache_seen: [u32; CLASSES],
    /// Per class, the heap's `allocs` counter when its free cache last
    /// filled up (see `Heap::page_event`).
    cache_filled_at: [u64; CLASSES],
    /// Per class, the blocks taken from the node's shared heap
    /// (`shared.rs`).
    sparse: [u8; CLASSES],
    /// The heap's part in the memory lifecycle (`decay.rs`): last, away
    /// from what the fast paths read.
    pub(crate) life: HeapLife,
}

/// [`Heap::owned`]: an exited thread's heap, waiting for adoption.
pub(crate) const OWNER_NONE: u64 = 0;
/// [`Heap::owned`]: a live thread's heap.
pub(crate) const OWNER_THREAD: u64 = 1;
/// [`Heap::owned`]: an exited thread's heap a thread is collecting.
pub(crate) const OWNER_RECLAIM: u64 = 2;
/// [`Heap::owned`]: a node's shared heap (`shared.rs`), used under its
/// arena's `shared` lock.
pub(crate) const OWNER_SHARED: u64 = 3;

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
    if h == no_heap() { ptr::null_mut() } else { h }
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

impl Heap {
    /// Whether a live thread owns the heap.
    pub(crate) fn is_owned(&self) -> bool {
        self.owned.load(Ordering::Relaxed) == OWNER_THREAD
    }

    /// Whether it is a node's shared heap.
    pub(crate) fn is_shared(&self) -> bool {
        self.owned.load(Ordering::Relaxed) == OWNER_SHARED
    }

    /// The heap's node and (allocs, frees, bytes allocated, bytes freed, remote frees).
    pub(crate) fn node_and_counters(&self) -> (usize, (u64, u64, u64, u64, u64)) {
        (self.node, self.counters.sums())
    }
}

/// Whether a pop of a page with free blocks served `p`: always, but in a
/// hardened build whose pop found the list corrupted and, under
/// `NUMAWEAVE_ON_ERROR=report`, dropped it (null: the caller looks further).
#[inline(always)]
pub(super) fn served(p: *mut u8) -> bool {
    cfg!(not(feature = "hardened")) || !p.is_null()
}

/// Whether a hardened build may have dropped a corrupted free list (its
/// free blocks lost to their page) since a report it went on from.
pub(super) fn lists_dropped() -> bool {
    #[cfg(feature = "hardened")]
    return crate::hardened::went_on();
    #[cfg(not(feature = "hardened"))]
    false
}

/// The address range of `page`'s slots: from its first slot's start (a
/// [coloured](size_class::coloured) page's block starts a few lines in)
/// to its last slot's end.
///
/// # Safety
/// `page` is a live heap page (its `info` is read).
#[inline]
pub(super) unsafe fn page_span(page: *mut Page) -> core::ops::Range<usize> {
    use super::segment::SLOT_SIZE;
    // SAFETY: the caller passes a live page.
    let (start, slots) = unsafe { ((*page).info.start as usize, usize::from((*page).info.slots)) };
    let base = start & !(SLOT_SIZE - 1);
    base..base + slots * SLOT_SIZE
}

/// Whether `p` lies in the blocks of `page` (a heap page).
///
/// # Safety
/// `page` is a live heap page (its `info` is read).
pub(super) unsafe fn in_page(page: *mut Page, p: *const u8) -> bool {
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
    debug_assert!(align.is_power_of_two() && align <= super::segment::SLOT_SIZE && !p.is_null());
    let q = (p as usize & !(align - 1)) as *mut u8;
    // SAFETY: a block of a small page (the caller's word): its segment
    // header and page descriptor are live.
    #[cfg(debug_assertions)]
    unsafe {
        let page = segment::page_of(segment_of(p).cast::<segment::SmallSegment>(), p);
        debug_assert!((*page).info.capacity == 1 && usize::from((*page).info.class) == class);
        debug_assert!(
            page_span(page).start <= q as usize && p as usize + size_class::class_size(class) <= page_span(page).end
        );
    }
    q
}

/// The node (arena) of one of the heap's pages.
#[inline(always)]
pub(super) unsafe fn node_of(page: *mut Page) -> usize {
    // SAFETY: the caller passes a live page.
    usize::from(unsafe { (*page).info.node })
}

/// Bytes of memory a fresh page of `class` takes from its arena.
pub(crate) const fn page_bytes(class: usize) -> usize {
    page_slots(class) * super::segment::SLOT_SIZE
}

#[cfg(test)]
mod tests;
