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

use core::ptr;
#[cfg(feature = "hardened")]
use core::ptr::NonNull;

use super::arena::Arena;
use super::segment::{Block, Page, SegmentKind, segment_of};
use super::size_class::{CLASSES, page_slots};
use super::state::State;
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
fn bump(c: &AtomicU64, by: u64) {
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
    /// Whether a live thread owns it.
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
}

/// Whether local frees go through the class's free cache. Not in hardened
/// builds: their free-list links are encoded with each page's key and
/// checked against the page's bounds, which a list of many pages' blocks
/// has not.
const CACHING: bool = cfg!(not(feature = "hardened"));

/// The most blocks a class's free cache holds before a free gives all but
/// the newest half of them back to their pages (more when a page's long
/// list was taken whole): 512 KiB of blocks, between 8 and 256 of them.
/// glibc's `bench-malloc-thread` pattern (a working set of 1,024 blocks to
/// 32 KiB replaced at random) refilled one `malloc` in 17 with 64 KiB (at
/// least 4), one in 100 with 256 KiB (at least 8), fewer with more, and
/// its peak RSS fell from 27 to 17 and 13 MiB (tcmalloc's: 17): blocks
/// freed are reused before pages are touched. Little enough that an idle
/// class's blocks are not missed while they wait for `expire_kept`.
const fn cache_room(class: usize) -> u32 {
    let n = (512 * 1024 / super::size_class::class_size(class)) as u32;
    if n < 8 {
        8
    } else if n > 256 {
        256
    } else {
        n
    }
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
    /// A block of class `class` from the direct page, or null when it has
    /// none (the caller then refills, or, from [`no_heap`], makes the
    /// thread's heap): the fast path.
    ///
    /// # Safety
    /// `heap` must be the calling thread's heap or [`no_heap`]; `class <
    /// CLASSES`.
    #[inline(always)]
    pub(crate) unsafe fn pop(heap: *mut Heap, class: usize) -> *mut u8 {
        // SAFETY: the caller's heap and a class below CLASSES, as `pop_as` needs.
        unsafe { Heap::pop_as::<true>(heap, class) }
    }

    /// [`pop`](Self::pop) once the caller found `NUMAWEAVE_CHECK=full` off
    /// (hardened builds; the same as `pop` in others).
    ///
    /// # Safety
    /// As [`pop`](Self::pop).
    #[inline(always)]
    pub(crate) unsafe fn pop_checked_off(heap: *mut Heap, class: usize) -> *mut u8 {
        // SAFETY: as in `pop`: the caller's heap, a class below CLASSES.
        unsafe { Heap::pop_as::<false>(heap, class) }
    }

    /// [`pop`](Self::pop), looking whether `NUMAWEAVE_CHECK=full` is on only
    /// with `LOOK_FULL` (hardened builds): `pop_as::<false>` is
    /// [`pop_checked_off`](Self::pop_checked_off).
    ///
    /// # Safety
    /// As [`pop`](Self::pop); without `LOOK_FULL`, as
    /// [`pop_checked_off`](Self::pop_checked_off).
    #[inline(always)]
    pub(crate) unsafe fn pop_as<const LOOK_FULL: bool>(heap: *mut Heap, class: usize) -> *mut u8 {
        debug_assert!(class < CLASSES);
        // SAFETY: the heap is this thread's, or `NO_HEAP`, whose `direct`
        // (all that is read of it: the empty page's list is empty) is an
        // array of CLASSES pages too; `class < CLASSES` by contract.
        unsafe {
            let page = *(*heap).direct.get_unchecked(class);
            let block = (*page).free;
            if block.is_null() {
                return ptr::null_mut();
            }
            debug_assert!(heap != no_heap(), "NO_HEAP's pages have no block");
            // A hardened build's checks that may report or need more than
            // this path finish the pop out of line (tail calls: `malloc`
            // keeps no stack frame). The head first: it is read next.
            #[cfg(feature = "hardened")]
            if outside(page, block) {
                return Heap::pop_corrupt(page, block);
            }
            debug_assert!(
                Heap::is_lent(heap, class)
                    || Heap::is_cache(heap, page)
                    || (in_page(page, block.cast()) && usize::from((*page).info.class) == class),
                "a direct page of another class, or a free list that left its page"
            );
            #[cfg(feature = "hardened")]
            if LOOK_FULL && crate::hardened::full_now() {
                return Heap::pop_full(heap, page, block, class).as_ptr();
            }
            Heap::pop_not_full(heap, page, block, class)
        }
    }

    /// The rest of a pop of `block`, the head of `page`'s free list, with
    /// `NUMAWEAVE_CHECK=full` off.
    ///
    /// # Safety
    /// As [`take`](Self::take).
    #[inline(always)]
    unsafe fn pop_not_full(heap: *mut Heap, page: *mut Page, block: *mut Block, class: usize) -> *mut u8 {
        // SAFETY: `block` is the head of `page`'s free list, so a free block of
        // the page whose first word is its link; the heap and page are the
        // caller's (what `take` needs).
        unsafe {
            // (A hardened build checks the link it reads when it is the
            // head: before the next pop reads through it.)
            #[cfg(feature = "hardened")]
            {
                let next = crate::hardened::decode((*block).next, (*page).info.key);
                crate::hardened::handing_out_plain(block.cast());
                Heap::take(heap, page, block, next, class)
            }
            #[cfg(not(feature = "hardened"))]
            Heap::take(heap, page, block, next_of(page, block), class)
        }
    }

    /// The end of a pop: `block`, the head of `page`'s free list, handed
    /// out; `next` the list's new head; `class` the direct slot's (counted
    /// there: a loan's blocks leave the count with [`end_loan`](Self::end_loan)).
    ///
    /// # Safety
    /// As [`pop`](Self::pop); `block` is `page`'s first free block; `class <
    /// CLASSES`.
    #[inline(always)]
    unsafe fn take(heap: *mut Heap, page: *mut Page, block: *mut Block, next: *mut Block, class: usize) -> *mut u8 {
        // SAFETY: the page's `free` and `used` are written only by the
        // thread whose heap holds it (its owner, or the borrower of a loan),
        // and the heap's counters only by the heap's thread: the caller;
        // `block` leaves the list here and `next` was its link; the counter
        // is in bounds (`class < CLASSES`).
        unsafe {
            debug_assert!(class < CLASSES);
            (*page).free = next;
            (*page).used += 1;
            bump((*heap).counters.allocs.get_unchecked(class), 1);
        }
        block.cast()
    }

    /// A hardened pop under `NUMAWEAVE_CHECK=full`: the block's poison
    /// checked (write after free) before it is handed out. (Not null, and
    /// typed so: the caller's null test folds, the call stays a tail call.)
    ///
    /// # Safety
    /// As [`take`](Self::take).
    #[cfg(feature = "hardened")]
    #[cold]
    #[inline(never)]
    unsafe fn pop_full(heap: *mut Heap, page: *mut Page, block: *mut Block, class: usize) -> NonNull<u8> {
        // SAFETY: per the contract; `block` is not null.
        unsafe {
            crate::hardened::handing_out(block.cast(), || kind_of(page));
            NonNull::new_unchecked(Heap::take(heap, page, block, next_of(page, block), class))
        }
    }

    /// A hardened pop whose head, `block`, lies outside its page: a
    /// corrupted list (a free block's link overwritten), reported. Null:
    /// under `NUMAWEAVE_ON_ERROR=report` the list is dropped (its blocks
    /// leaked) and the caller looks further (`malloc` its slow path, which
    /// refills the page or takes another; the slow paths the next page).
    ///
    /// # Safety
    /// As [`take`](Self::take), `block` unread.
    #[cfg(feature = "hardened")]
    #[cold]
    #[inline(never)]
    unsafe fn pop_corrupt(page: *mut Page, block: *mut Block) -> *mut u8 {
        // SAFETY: `page` is live (a page a pop reached), and its `free` is
        // written only by its owner, the caller; `block` is not read.
        unsafe { (*page).free = corrupted_list(page, block) };
        ptr::null_mut()
    }

    /// The slow path: a page of the heap that `placement` accepts and that
    /// can serve (remote frees taken, blocks carved), else a fresh page from
    /// the arena it names, becomes the class's direct page and serves. Null
    /// when no memory can be had.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    #[unsafe(link_section = ".text.hot.numaweave")]
    pub(crate) unsafe fn refill(
        heap: *mut Heap,
        class: usize,
        state: &State,
        placement: &mut impl Placement,
    ) -> *mut u8 {
        // SAFETY: the heap is the calling thread's, so its slots, lists and
        // pages' owner-only fields are written by no other thread; every
        // page reached through them is live (a page leaves the heap only
        // through `release_page`, which unlinks it first).
        unsafe {
            if Heap::is_lent(heap, class) {
                // A lent page that ran dry: the heap's own pages serve now.
                Heap::end_loan(heap);
            }
            Heap::gather_remote(heap);
            let now = (*heap).refills.wrapping_add(1);
            (*heap).refills = now;
            (*heap).last_refill[class] = now;
            if now.is_multiple_of(EXPIRE_EVERY) {
                Heap::expire_kept(heap, now);
            }
            let cache = Heap::cache_page(heap, class);
            let any = CACHING && placement.cache_serves((*heap).node);
            (*heap).cache_serves[class] = any;
            if any {
                return Heap::refill_cache(heap, class, state, placement);
            }
            if !(*cache).free.is_null() {
                // The policy chooses among pages: they get their blocks
                // back before it looks.
                Heap::flush_cache(heap, class, 0, true);
            }
            Heap::set_cache_src(heap, class, ptr::null_mut());
            let direct = (*heap).direct[class];
            if direct != empty_page()
                && direct != cache
                && placement.accepts(node_of(direct))
                && Heap::refill_from(heap, direct)
            {
                let p = Heap::pop(heap, class);
                if served(p) {
                    return p;
                }
            }
            let mut page = (*heap).lists[class].head;
            while !page.is_null() {
                let mut next = (*page).next;
                if page != direct && placement.accepts(node_of(page)) && Heap::refill_from(heap, page) {
                    Heap::set_direct(heap, class, page);
                    let p = Heap::pop(heap, class);
                    if served(p) {
                        return p;
                    }
                    // The page that left the slot may have gone back to its
                    // arena: on from the list as it is now.
                    next = (*page).next;
                }
                page = next;
            }
            let (node, within) = placement.fresh();
            let Some(page) = Heap::fresh_page(heap, class, state, state.node_arena(node), within) else {
                Heap::set_direct(heap, class, empty_page());
                return ptr::null_mut();
            };
            Heap::set_direct(heap, class, page);
            placement.took(node_of(page));
            Heap::pop(heap, class)
        }
    }

    /// A block of class `class` from a page of the heap on `node` (the
    /// arena node), or from a fresh page of that node's arena (falling back
    /// by distance when it is out of memory), without touching the direct
    /// slot: for callers that place one block (allocator handles). Null when
    /// no memory can be had.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    pub(crate) unsafe fn alloc_on_node(heap: *mut Heap, class: usize, state: &State, node: usize) -> *mut u8 {
        // SAFETY: as in `refill`: the caller's heap, its pages live and
        // theirs to write.
        unsafe {
            let direct = (*heap).direct[class];
            if direct != empty_page()
                && !Heap::is_lent(heap, class)
                && !Heap::is_cache(heap, direct)
                && node_of(direct) == node
                && !(*direct).free.is_null()
            {
                let p = Heap::pop(heap, class);
                if served(p) {
                    return p;
                }
            }
            Heap::gather_remote(heap);
            let mut page = (*heap).lists[class].head;
            while !page.is_null() {
                let next = (*page).next;
                if node_of(page) == node && Heap::refill_from(heap, page) {
                    let p = Heap::pop_from(heap, page);
                    if served(p) {
                        return p;
                    }
                }
                page = next;
            }
            match Heap::fresh_page(heap, class, state, state.node_arena(node), None) {
                Some(page) => Heap::pop_from(heap, page),
                None => ptr::null_mut(),
            }
        }
    }

    /// Pops a block of `page`, one of the heap's pages with a free block
    /// (null only as [`pop`](Self::pop) may be: see [`served`]).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap and owns `page`, whose free list
    /// is not empty.
    unsafe fn pop_from(heap: *mut Heap, page: *mut Page) -> *mut u8 {
        // SAFETY: the caller's heap owns `page` (live, owner-only fields ours
        // to write) and its free list is not empty, so `free` is a block of
        // the page.
        unsafe {
            debug_assert_eq!((*page).info.heap.load(Ordering::Relaxed), heap);
            let block = (*page).free;
            debug_assert!(!block.is_null());
            #[cfg(feature = "hardened")]
            if outside(page, block) {
                return Heap::pop_corrupt(page, block);
            }
            #[cfg(feature = "hardened")]
            crate::hardened::handing_out(block.cast(), || kind_of(page));
            (*page).free = next_of(page, block);
            (*page).used += 1;
            bump(&(*heap).counters.allocs[usize::from((*page).info.class)], 1);
            block.cast()
        }
    }

    /// A fresh page from `arena` (falling back within `within`), carved and
    /// on the class's list.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    #[unsafe(link_section = ".text.hot.numaweave")]
    unsafe fn fresh_page(
        heap: *mut Heap,
        class: usize,
        state: &State,
        arena: &Arena,
        within: Option<NodeSet>,
    ) -> Option<*mut Page> {
        let page = arena.alloc_page(state, class, heap, within)?.as_ptr();
        // SAFETY: a fresh page of ours.
        unsafe {
            debug_assert!((*page).used == 0 && (*page).carved == 0 && (*page).free.is_null());
            debug_assert_eq!(usize::from((*page).info.class), class);
            (*heap).push_front(page);
            carve(page);
        }
        Some(page)
    }

    /// Makes `page` able to serve (remote frees taken, more blocks carved);
    /// a page that stays full leaves the list until a block comes back.
    ///
    /// # Safety
    /// The heap is the caller's and owns `page`.
    #[unsafe(link_section = ".text.hot.numaweave")]
    unsafe fn refill_from(heap: *mut Heap, page: *mut Page) -> bool {
        // SAFETY: `page` is one of the caller's heap's pages: live, its list
        // links, free list and counts written only by this thread; remote
        // frees reach it only through `thread_free`, taken atomically.
        unsafe {
            debug_assert_eq!((*page).info.heap.load(Ordering::Relaxed), heap, "refilling from another heap's page");
            if (*page).free.is_null() && (*page).pending {
                // The page is about to serve: not one to give back, even
                // if these frees empty it.
                Heap::take_remote(heap, page, false);
            }
            if (*page).free.is_null() {
                carve(page);
            }
            if !(*page).free.is_null() {
                return true;
            }
            debug_assert!(
                (*page).used - Heap::references(heap, page) == (*page).info.capacity || lists_dropped(),
                "a page without free blocks is full"
            );
            (*heap).unlink(page);
            (*page).in_full = true;
            false
        }
    }

    /// Frees `block` of a page this heap owns onto `page`: the block's page,
    /// or the heap's free cache of its class (what the block's slot names).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap and owns `page`; `block` is a live
    /// block of `page`, or of a page of the heap on its node whose class's
    /// free cache `page` is.
    #[inline(always)]
    pub(crate) unsafe fn free_local(heap: *mut Heap, page: *mut Page, block: *mut Block) {
        // SAFETY: the caller's heap owns the page (or it is the heap's free
        // cache): its `free`, `used` and the heap's counters are written by
        // this thread alone.
        unsafe {
            debug_assert!((*page).used > 0, "free of a block of a page with none in use");
            debug_assert!(
                (in_page(page, block.cast()) || Heap::is_cache(heap, page))
                    && (*page).info.heap.load(Ordering::Relaxed) == heap
            );
            // The counters first: their stores may alias the page as far
            // as the compiler knows, and after them it read `used` back
            // from memory for the test (`cmpl $0`) instead of taking the
            // decrement's flags.
            bump(&(*heap).counters.frees, 1);
            bump(&(*heap).counters.bytes_freed, u64::from((*page).info.block_size));
            Heap::push(heap, page, block);
        }
    }

    /// Pushes `block` on `page`'s free list: the block's page, or the
    /// class's free cache, whose `used` is the room left and reaches 0 when
    /// this push fills it (`page_event` then gives half back).
    ///
    /// # Safety
    /// As [`free_local`](Self::free_local), the counters booked.
    #[inline(always)]
    unsafe fn push(heap: *mut Heap, page: *mut Page, block: *mut Block) {
        // SAFETY: per the contract; owner-only fields.
        unsafe {
            (*block).next = link(page, (*page).free);
            (*page).free = block;
            (*page).used -= 1;
            if (*page).used == 0 || (*page).in_full {
                Heap::page_event(heap, page);
            }
        }
    }

    /// [`refill`](Self::refill) where the class's free cache may serve: it
    /// becomes the direct page; if it is empty, the free blocks of a page
    /// that has some (the direct page that ran dry once its remote frees
    /// are taken or more of it carved, else the first on the list, else a
    /// fresh page) move into it, and it serves them. A page of another
    /// node than the heap's (its frees do not go through the cache) serves
    /// as the direct page, as under any policy.
    ///
    /// # Safety
    /// As [`refill`](Self::refill), no loan open in the class.
    #[unsafe(link_section = ".text.hot.numaweave")]
    unsafe fn refill_cache(heap: *mut Heap, class: usize, state: &State, placement: &mut impl Placement) -> *mut u8 {
        // SAFETY: as in `refill`: the caller's heap, its pages live and
        // theirs to write.
        unsafe {
            let cache = Heap::cache_page(heap, class);
            let home = (*heap).node;
            let old = (*heap).direct[class];
            if old != cache {
                if (*cache).free.is_null()
                    && old != empty_page()
                    && node_of(old) == home
                    && Heap::refill_from(heap, old)
                {
                    Heap::take_into_cache(heap, class, old);
                    Heap::set_cache_src(heap, class, old);
                }
                Heap::set_direct(heap, class, cache);
            }
            if !(*cache).free.is_null() {
                return Heap::pop(heap, class);
            }
            let src = (*heap).cache_src[class];
            if !src.is_null() && placement.accepts(node_of(src)) && Heap::refill_from(heap, src) {
                return Heap::serve_from(heap, class, src);
            }
            let mut page = (*heap).lists[class].head;
            while !page.is_null() {
                let next = (*page).next;
                if page != src && placement.accepts(node_of(page)) && Heap::refill_from(heap, page) {
                    return Heap::serve_from(heap, class, page);
                }
                page = next;
            }
            let (node, within) = placement.fresh();
            let Some(page) = Heap::fresh_page(heap, class, state, state.node_arena(node), within) else {
                return ptr::null_mut();
            };
            placement.took(node_of(page));
            Heap::serve_from(heap, class, page)
        }
    }

    /// The end of [`refill_cache`](Self::refill_cache): `page`, with free
    /// blocks, serves through the (empty) free cache if it is of the heap's
    /// node, else as the direct page.
    ///
    /// # Safety
    /// As [`take_into_cache`](Self::take_into_cache); the cache is direct.
    unsafe fn serve_from(heap: *mut Heap, class: usize, page: *mut Page) -> *mut u8 {
        // SAFETY: per the contract.
        unsafe {
            if node_of(page) == (*heap).node {
                Heap::take_into_cache(heap, class, page);
                Heap::set_cache_src(heap, class, page);
            } else {
                Heap::set_direct(heap, class, page);
            }
            Heap::pop(heap, class)
        }
    }

    /// Moves the free list of `page`, one of the heap's pages of `class`
    /// with free blocks, into the class's empty free cache, all of it. A
    /// page left without a free block leaves its list until one comes back
    /// if it is carved to the end (else a later refill carves more of it).
    ///
    /// A list longer than the cache's room (remote frees taken, or many
    /// blocks freed while the page was not served from) is taken whole
    /// too, with one free's room left: the next free the cache takes gives
    /// all but half its room back. Taking half the room's worth walked the
    /// list to its middle, a serial chain of loads of lines another thread
    /// had written (a producer's blocks its consumer freed: 7.4 against
    /// 4.7 µs a batch of 256), each read again by the allocation that
    /// wrote it.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap and owns `page`; the cache is
    /// empty.
    unsafe fn take_into_cache(heap: *mut Heap, class: usize, page: *mut Page) {
        // SAFETY: per the contract; owner-only fields. `used` counts the
        // page's blocks off its free list (and the references), so the rest
        // of what it carved is on the list; its links are plain (the cache
        // exists only where they are: `CACHING`).
        unsafe {
            let cache = Heap::cache_page(heap, class);
            let room = cache_room(class);
            debug_assert!((*cache).free.is_null() && !(*page).free.is_null());
            // (Its room may be more: a list longer than the room left one.)
            debug_assert!((*cache).used >= room, "an empty cache has all its room");
            let n = (*page).carved - ((*page).used - Heap::references(heap, page));
            // The page's frees come to the cache again (they may have been
            // sent to the page by a flush).
            super::segment::set_sink(segment_of((*page).info.start).cast(), page, cache);
            (*cache).free = (*page).free;
            (*page).free = ptr::null_mut();
            (*cache).used = if n < room { room - n } else { 1 };
            (*page).used += n;
            if (*page).carved == (*page).info.capacity {
                (*heap).unlink(page);
                (*page).in_full = true;
            }
        }
    }

    /// Gives `block` back to `page`, its page, which this heap owns (a block
    /// leaving the free cache).
    ///
    /// # Safety
    /// As [`free_local`](Self::free_local), the block's counters already
    /// booked.
    unsafe fn give_back(heap: *mut Heap, page: *mut Page, block: *mut Block) {
        // SAFETY: per the contract; owner-only fields.
        unsafe {
            debug_assert!((*page).used > 0, "a cached block of a page with none in use");
            debug_assert!(in_page(page, block.cast()) && (*page).info.heap.load(Ordering::Relaxed) == heap);
            Heap::push(heap, page, block);
        }
    }

    /// A page got a block back while full, or became empty; or a class's
    /// free cache filled up.
    #[cold]
    #[unsafe(link_section = ".text.hot.numaweave")]
    unsafe fn page_event(heap: *mut Heap, page: *mut Page) {
        // SAFETY: the caller owns the heap and the page.
        unsafe {
            if Heap::is_cache(heap, page) {
                let class = usize::from((*page).info.class);
                // Frees outran allocations (fewer of any class since the
                // last time this cache filled than the frees that filled
                // it): a burst, whose pages take their frees themselves.
                // (The sum reads a few hot lines; the flush below walks
                // half the cache.)
                let allocs = (*heap).counters.allocs_total();
                let burst = allocs.wrapping_sub((*heap).cache_filled_at[class]) < u64::from(cache_room(class) / 2);
                (*heap).cache_filled_at[class] = allocs;
                Heap::flush_cache(heap, class, cache_room(class) / 2, burst);
                // Frees filled the cache while a page served: where any
                // page may serve, the cache serves from now on (a loop of
                // pairs runs on it, not on a page whose blocks all come
                // back through it).
                if (*heap).cache_serves[class] && (*heap).direct[class] != page && !Heap::is_lent(heap, class) {
                    Heap::set_direct(heap, class, page);
                }
                return;
            }
            Heap::page_event_with(heap, page, true)
        }
    }

    /// The class's free cache: where the heap's pages of `class` send the
    /// blocks the owner frees.
    ///
    /// # Safety
    /// `heap` is a live heap; `class < CLASSES`.
    #[inline(always)]
    pub(crate) unsafe fn cache_page(heap: *mut Heap, class: usize) -> *mut Page {
        debug_assert!(class < CLASSES);
        // SAFETY: in bounds of the heap's array (the contract).
        unsafe { (&raw mut (*heap).cache).cast::<Page>().add(class) }
    }

    /// Whether `page` is one of the heap's free caches.
    #[inline(always)]
    fn is_cache(heap: *mut Heap, page: *mut Page) -> bool {
        // SAFETY: only the array's address is taken.
        let base = unsafe { &raw const (*heap).cache } as usize;
        (page as usize).wrapping_sub(base) < core::mem::size_of::<[Page; CLASSES]>()
    }

    /// The sink ([`sink_of`](super::segment::sink_of)) of `page`, of
    /// `class`, that `heap` takes: its free cache of the class if the page
    /// is on the heap's node (so that a cache's blocks are all of one
    /// node), else (and in hardened builds) the page itself.
    ///
    /// # Safety
    /// `heap` is a live heap; `page` a page descriptor with its `info.node`
    /// set; `class < CLASSES`.
    pub(crate) unsafe fn sink_for(heap: *mut Heap, page: *mut Page, class: usize) -> *mut Page {
        // SAFETY: forwarded contract.
        unsafe {
            if CACHING && usize::from((*page).info.node) == (*heap).node { Heap::cache_page(heap, class) } else { page }
        }
    }

    /// Gives the blocks of the class's free cache back to their pages, all
    /// but the `keep` newest (which the next allocations take while their
    /// lines are still cached). With `bypass`, a page a block goes back to
    /// takes the owner's frees itself from then on (its slots' sink) until
    /// the cache is filled from it again: where frees outrun allocations
    /// (a collector's sweep, a burst of frees), or under a policy the cache
    /// does not serve, blocks are not handled twice.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap (or its exiting owner's).
    #[cold]
    #[inline(never)]
    #[unsafe(link_section = ".text.hot.numaweave")]
    pub(crate) unsafe fn flush_cache(heap: *mut Heap, class: usize, keep: u32, bypass: bool) {
        // SAFETY: the cache's blocks are free blocks of this heap's pages of
        // the class (only the owner's frees put them there), each counted in
        // use by its page, so each page is live; their links are plain
        // (not a hardened build: `CACHING`).
        unsafe {
            let cache = Heap::cache_page(heap, class);
            let mut rest = (*cache).free;
            let mut last: *mut Block = ptr::null_mut();
            let mut kept = 0;
            while kept < keep && !rest.is_null() {
                last = rest;
                rest = (*rest).next;
                kept += 1;
            }
            if last.is_null() {
                (*cache).free = ptr::null_mut();
            } else {
                (*last).next = ptr::null_mut();
            }
            while !rest.is_null() {
                let next = (*rest).next;
                let seg = segment_of(rest.cast()).cast::<super::segment::SmallSegment>();
                let page = super::segment::page_of(seg, rest.cast());
                if bypass {
                    super::segment::set_sink(seg, page, page);
                }
                Heap::give_back(heap, page, rest);
                rest = next;
            }
            // Room for as many frees as keep the cache within its bound.
            (*cache).used = cache_room(class) - kept;
            debug_assert!((*cache).used > 0);
        }
    }

    /// [`page_event`](Self::page_event); an empty page is kept or given
    /// back only with `may_release`.
    #[unsafe(link_section = ".text.hot.numaweave")]
    unsafe fn page_event_with(heap: *mut Heap, page: *mut Page, may_release: bool) {
        // SAFETY: the caller owns the heap and the page.
        unsafe {
            if (*page).in_full {
                // At the tail: the pages ahead of it have had longer to
                // gather freed blocks, and it gathers more before a refill
                // reaches it (at the head it served its one block and was
                // full again: Larson's pattern refilled every sixth malloc).
                (*page).in_full = false;
                (*heap).push_back(page);
            }
            let class = usize::from((*page).info.class);
            if may_release && (*page).used == 0 && (*heap).direct[class] != page {
                let kept = (*heap).kept_empty[class];
                if kept.is_null() || kept == page || (*kept).used != 0 {
                    (*heap).kept_empty[class] = page;
                } else {
                    (*heap).release_page(page);
                }
            }
        }
    }

    /// Gives the kept empty pages of classes idle for [`IDLE_REFILLS`] of
    /// the heap's refills back to their arenas, where a page of any class
    /// may take their memory (the arena hands out slots still resident
    /// first) and the purge delay applies. A program that moves from one
    /// mix of sizes to another (lua building a tree of tables, then
    /// strings) no longer holds a page per class of the old mix: lua's peak
    /// RSS 0.36 MB lower. A class in use refills often and keeps its page.
    ///
    /// A free cache that neither took nor gave a block since the last look
    /// (its room unchanged) gives its blocks back to their pages, and its
    /// source page its reference: cached blocks of a class the program has
    /// moved away from do not keep their pages from emptying.
    #[cold]
    #[unsafe(link_section = ".text.hot.numaweave")]
    unsafe fn expire_kept(heap: *mut Heap, now: u32) {
        // SAFETY: the caller's heap; kept pages are its own.
        unsafe {
            for class in 0..CLASSES {
                let cache = Heap::cache_page(heap, class);
                let room = (*cache).used;
                if !(*cache).free.is_null() && room == (*heap).cache_seen[class] {
                    Heap::flush_cache(heap, class, 0, false);
                    if (*heap).direct[class] == Heap::cache_page(heap, class) {
                        // (Refilled at its next allocation.)
                        Heap::set_direct(heap, class, empty_page());
                    }
                    Heap::set_cache_src(heap, class, ptr::null_mut());
                }
                (*heap).cache_seen[class] = (*Heap::cache_page(heap, class)).used;
            }
            for class in 0..CLASSES {
                let kept = (*heap).kept_empty[class];
                if !kept.is_null()
                    && (*kept).used == 0
                    && (*heap).direct[class] != kept
                    && now.wrapping_sub((*heap).last_refill[class]) > IDLE_REFILLS
                {
                    (*heap).release_page(kept);
                }
            }
        }
    }

    /// Gives an empty page back to its arena.
    #[unsafe(link_section = ".text.hot.numaweave")]
    unsafe fn release_page(&mut self, page: *mut Page) {
        let Some(state) = State::try_get() else { return };
        // SAFETY: the page is empty and ours; after unlinking, nothing here
        // refers to it.
        unsafe {
            debug_assert_eq!((*page).used, 0, "releasing a page with live blocks");
            debug_assert!(!(*page).pending && (*page).remote.thread_free.is_empty());
            self.unlink(page);
            let class = usize::from((*page).info.class);
            if self.kept_empty[class] == page {
                self.kept_empty[class] = ptr::null_mut();
            }
            let seg = segment_of((*page).info.start);
            debug_assert_eq!((*seg).kind, SegmentKind::Small);
            let arena = &state.arenas[usize::from((*seg).arena)];
            arena.free_page(state, page);
        }
    }

    /// Looks at every page of this heap that other threads freed blocks
    /// into. A page whose free list is empty gets them now; the others are put
    /// on the heap's pending list and get them when their free list runs dry
    /// (`take_remote`). Either way the page leaves `remote_pages`, and no
    /// remote thread queues it again while its `thread_free` is not empty.
    ///
    /// # Safety
    /// `heap` must be the calling thread's heap (or an orphan being adopted).
    pub(crate) unsafe fn gather_remote(heap: *mut Heap) {
        // SAFETY: pages on `remote_pages` are this heap's; see `Page`'s Linked impl
        // for why each is on the stack at most once.
        unsafe {
            // Look before taking: the swap is a locked instruction (about
            // twenty cycles) and the queue is empty at most refills; a page
            // queued just after the look is gathered at the next one, as it
            // would be if queued just after the swap.
            if (*heap).remote_pages.0.is_empty() {
                return;
            }
            let mut page = (*heap).remote_pages.0.take_all();
            while !page.is_null() {
                debug_assert_eq!((*page).info.heap.load(Ordering::Relaxed), heap);
                // Read the link before emptying `thread_free`: from then on a
                // remote thread may push the page again and rewrite it.
                let next = (*page).remote.remote_next;
                if (*page).free.is_null() {
                    Heap::take_remote(heap, page, true);
                } else if !(*page).pending {
                    (*heap).pend_link(page);
                }
                page = next;
            }
        }
    }

    /// Moves the blocks in `page.thread_free` onto its free list, without
    /// walking them when the free list is empty (they were last written by
    /// other cores: a cache miss each). With `may_release`, a page they empty
    /// may go back to its arena.
    #[unsafe(link_section = ".text.hot.numaweave")]
    unsafe fn take_remote(heap: *mut Heap, page: *mut Page, may_release: bool) {
        // SAFETY: the caller owns the heap and the page.
        unsafe {
            if (*page).pending {
                (*heap).pend_unlink(page);
            }
            let (head, n) = (*page).remote.thread_free.take_all();
            if head.is_null() {
                return;
            }
            // The chain's links are stored as the page's own (`free_remote`):
            // spliced as it is, walked only to reach its tail.
            if (*page).free.is_null() {
                (*page).free = head;
            } else {
                let mut tail = head;
                loop {
                    let next = next_of(page, tail);
                    if next.is_null() {
                        break;
                    }
                    tail = next;
                }
                (*tail).next = link(page, (*page).free);
                (*page).free = head;
            }
            let n = n as u32;
            debug_assert!(n <= (*page).used, "more remote frees than blocks in use");
            (*page).used -= n;
            let c = &(*heap).counters;
            bump(&c.remote_frees, u64::from(n));
            bump(&c.frees, u64::from(n));
            bump(&c.bytes_freed, u64::from(n) * u64::from((*page).info.block_size));
            if (*page).in_full || ((*page).used == 0 && may_release) {
                Heap::page_event_with(heap, page, may_release);
            }
        }
    }

    /// Puts `page` at the head of the pages with remote frees waiting.
    ///
    /// # Safety
    /// `page` is a live page of this heap, not on the pending list; the
    /// caller is the heap's owner (the fields are owner-only).
    unsafe fn pend_link(&mut self, page: *mut Page) {
        // SAFETY: owner-only fields of a page of this heap (the contract).
        unsafe {
            (*page).pending = true;
            (*page).pend_prev = ptr::null_mut();
            (*page).pend_next = self.pending;
            if !self.pending.is_null() {
                (*self.pending).pend_prev = page;
            }
            self.pending = page;
        }
    }

    /// Takes `page` off the pending list.
    ///
    /// # Safety
    /// `page` is a live page of this heap on the pending list; the caller is
    /// the heap's owner.
    unsafe fn pend_unlink(&mut self, page: *mut Page) {
        // SAFETY: the contract: the page and its neighbours on the list are
        // this heap's, their links owner-only.
        unsafe {
            let (prev, next) = ((*page).pend_prev, (*page).pend_next);
            if prev.is_null() {
                debug_assert_eq!(self.pending, page);
                self.pending = next;
            } else {
                (*prev).pend_next = next;
            }
            if !next.is_null() {
                (*next).pend_prev = prev;
            }
            (*page).pending = false;
            (*page).pend_prev = ptr::null_mut();
            (*page).pend_next = ptr::null_mut();
        }
    }

    /// Puts `page` at the head of its class's list.
    ///
    /// # Safety
    /// `page` is a live page this heap owns, on no list; the caller is the
    /// heap's owner.
    unsafe fn push_front(&mut self, page: *mut Page) {
        // SAFETY: owner-only list fields of pages this heap owns (the
        // contract).
        unsafe {
            debug_assert!((*page).prev.is_null() && (*page).next.is_null(), "page already on a list");
            let class = usize::from((*page).info.class);
            let head = self.lists[class].head;
            debug_assert_ne!(head, page);
            (*page).prev = ptr::null_mut();
            (*page).next = head;
            if head.is_null() {
                self.lists[class].tail = page;
            } else {
                (*head).prev = page;
            }
            self.lists[class].head = page;
        }
    }

    /// Puts `page` at the tail of its class's list.
    ///
    /// # Safety
    /// As [`push_front`](Self::push_front).
    unsafe fn push_back(&mut self, page: *mut Page) {
        // SAFETY: as in `push_front`.
        unsafe {
            debug_assert!((*page).prev.is_null() && (*page).next.is_null(), "page already on a list");
            let class = usize::from((*page).info.class);
            let tail = self.lists[class].tail;
            debug_assert_ne!(tail, page);
            (*page).next = ptr::null_mut();
            (*page).prev = tail;
            if tail.is_null() {
                self.lists[class].head = page;
            } else {
                (*tail).next = page;
            }
            self.lists[class].tail = page;
        }
    }

    /// Takes `page` off its class's list (a page on none is left as it is),
    /// and out of the direct slot if it is there.
    ///
    /// # Safety
    /// `page` is a live page this heap owns; the caller is the heap's owner.
    unsafe fn unlink(&mut self, page: *mut Page) {
        // SAFETY: owner-only list fields of pages this heap owns (the
        // contract). A page off every list has null links and is not a head.
        unsafe {
            let class = usize::from((*page).info.class);
            let (prev, next) = ((*page).prev, (*page).next);
            if !prev.is_null() {
                (*prev).next = next;
            } else if self.lists[class].head == page {
                self.lists[class].head = next;
            }
            if !next.is_null() {
                (*next).prev = prev;
            } else if self.lists[class].tail == page {
                self.lists[class].tail = prev;
            }
            (*page).prev = ptr::null_mut();
            (*page).next = ptr::null_mut();
            if self.direct[class] == page {
                // Its callers unlink a full page or an empty one, which is
                // never direct: the reference dropped leaves blocks in use
                // (so `set_direct` gives nothing back from here).
                debug_assert!((*page).used > 1, "an empty direct page unlinked");
                Heap::set_direct(self, class, empty_page());
            }
        }
    }

    /// Makes `page` (one of the heap's pages, or the empty page) the class's
    /// direct page. The slot holds a reference on the heap page in it: one
    /// more in its `used`, so that a free on the direct page never finds it
    /// empty (a loop of `malloc`/`free` pairs emptied it on every free, and
    /// every free called [`page_event`](Self::page_event) for nothing: 20%
    /// of glibc's `bench-malloc-simple` pair). The page that leaves the slot
    /// loses the reference; if that empties it, it is kept or given back as
    /// a free would have.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap (or its exiting owner's), no loan
    /// in the slot; `page` is the empty page or a live page the heap owns.
    #[unsafe(link_section = ".text.hot.numaweave")]
    unsafe fn set_direct(heap: *mut Heap, class: usize, page: *mut Page) {
        // SAFETY: the heap is the calling thread's (or its exiting owner's),
        // so its direct slots and its pages' `used` are written by no other
        // thread; `old`, in the slot and not lent, is the empty page or a
        // live page of the heap (a page leaves the heap only through
        // `release_page`, never while direct), and `page` is one of those
        // by the caller's word.
        unsafe {
            debug_assert!(!Heap::is_lent(heap, class), "a reference taken on a lent page");
            let old = (*heap).direct[class];
            if old == page {
                return;
            }
            // (A free cache holds no reference: it is not a page.)
            if page != empty_page() && !Heap::is_cache(heap, page) {
                Heap::take_reference(heap, page);
            }
            (*heap).direct[class] = page;
            if old != empty_page() && !Heap::is_cache(heap, old) {
                Heap::drop_reference(heap, old);
            }
        }
    }

    /// Makes `page` (null: none) the page the class's free cache is filled
    /// from first, moving the reference that holds from the one before
    /// (which, if that empties it, is kept or given back as a free would).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap (or its exiting owner's); `page`
    /// is null or a live page of the heap of `class`.
    unsafe fn set_cache_src(heap: *mut Heap, class: usize, page: *mut Page) {
        // SAFETY: as in `set_direct`: owner-only fields of the heap's live
        // pages (a referenced page is never given back).
        unsafe {
            let old = (*heap).cache_src[class];
            if old == page {
                return;
            }
            if !page.is_null() {
                Heap::take_reference(heap, page);
            }
            (*heap).cache_src[class] = page;
            if !old.is_null() {
                Heap::drop_reference(heap, old);
            }
        }
    }

    /// One more reference (a direct slot's, the cache source's) on `page`.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap (or its exiting owner's) and
    /// owns `page`, live.
    unsafe fn take_reference(heap: *mut Heap, page: *mut Page) {
        // SAFETY: an owner-only field of a live page of the heap.
        unsafe {
            debug_assert_eq!((*page).info.heap.load(Ordering::Relaxed), heap);
            (*page).used += 1;
        }
    }

    /// Drops a reference on `page`; if that empties it, it is kept or given
    /// back as a free would.
    ///
    /// # Safety
    /// As [`take_reference`](Self::take_reference); the heap holds one.
    unsafe fn drop_reference(heap: *mut Heap, page: *mut Page) {
        // SAFETY: as in `take_reference`.
        unsafe {
            debug_assert!((*page).used > 0);
            (*page).used -= 1;
            if (*page).used == 0 {
                Heap::page_event_with(heap, page, true);
            }
        }
    }

    /// The references the heap holds on `page` (direct slot, cache source),
    /// counted in its `used`.
    ///
    /// # Safety
    /// `page` is a live page of the heap.
    unsafe fn references(heap: *mut Heap, page: *mut Page) -> u32 {
        // SAFETY: the caller's heap; the page's class is fixed.
        unsafe {
            let class = usize::from((*page).info.class);
            u32::from((*heap).direct[class] == page) + u32::from((*heap).cache_src[class] == page)
        }
    }

    /// Lends the class's direct slot to `page`, a page this heap does not own
    /// (whose blocks are freed elsewhere than through it): the fast path
    /// serves its blocks, counted as the heap's until [`end_loan`](Self::end_loan).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap, with no loan open; `page` holds
    /// blocks of `class`'s size (at least) and stays live until the loan ends.
    pub(crate) unsafe fn lend(heap: *mut Heap, class: usize, page: *mut Page) {
        // SAFETY: the heap is the calling thread's (its slot and loan are
        // ours to write) and `page` stays live until the loan ends, as the
        // caller promises.
        unsafe {
            debug_assert!((*heap).loan.page.is_null(), "a second loan while one is open");
            debug_assert!((*page).info.heap.load(Ordering::Relaxed).is_null(), "lending a slot to a heap page");
            // A lent page is not the heap's: the slot holds no reference.
            Heap::set_direct(heap, class, empty_page());
            (*heap).direct[class] = page;
            (*heap).loan = Loan { page, class, used0: (*page).used };
        }
    }

    /// Whether the class's direct slot is lent.
    #[inline(always)]
    unsafe fn is_lent(heap: *mut Heap, class: usize) -> bool {
        // SAFETY: the caller's heap.
        unsafe {
            let l = (*heap).loan;
            !l.page.is_null() && l.class == class && (*heap).direct[class] == l.page
        }
    }

    /// A block of the page lent for `class`, if its direct slot is lent and
    /// the page has one (null otherwise).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap; `class < CLASSES`.
    #[inline(always)]
    pub(crate) unsafe fn pop_loan(heap: *mut Heap, class: usize) -> *mut u8 {
        // SAFETY: the caller's heap and a class below CLASSES; `pop` runs only
        // on a lent slot, whose page the lender keeps live.
        unsafe { if Heap::is_lent(heap, class) { Heap::pop(heap, class) } else { ptr::null_mut() } }
    }

    /// Ends the open loan, if any: the direct slot is the class's empty page
    /// again (unless something else took it meanwhile), and the blocks the
    /// fast path took from the lent page leave the heap's counters (they are
    /// not the heap's).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap (or its exiting owner's).
    pub(crate) unsafe fn end_loan(heap: *mut Heap) {
        // SAFETY: per the contract; the lent page is live while lent.
        unsafe {
            let Loan { page, class, used0 } = (*heap).loan;
            if page.is_null() {
                return;
            }
            (*heap).loan.page = ptr::null_mut();
            if (*heap).direct[class] == page {
                (*heap).direct[class] = empty_page();
            }
            let taken = u64::from((*page).used.wrapping_sub(used0));
            bump(&(*heap).counters.allocs[class], taken.wrapping_neg());
        }
    }

    /// Points every class at the empty page, so that the next allocation of
    /// each goes through a refill (under whatever placement is in force then).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    #[unsafe(link_section = ".text.hot.numaweave")]
    pub(crate) unsafe fn clear_direct(heap: *mut Heap) {
        // SAFETY: per the contract; the pages stay on the heap's lists.
        unsafe {
            Heap::end_loan(heap);
            for class in 0..CLASSES {
                Heap::set_direct(heap, class, empty_page());
                (*heap).cache_serves[class] = false;
            }
        }
    }

    /// Lets go of every empty page (thread exit, `collect`).
    #[unsafe(link_section = ".text.hot.numaweave")]
    pub(crate) unsafe fn release_empty_pages(heap: *mut Heap) {
        // SAFETY: the heap is the caller's.
        unsafe {
            Heap::clear_direct(heap);
            for class in 0..CLASSES {
                if !(*Heap::cache_page(heap, class)).free.is_null() {
                    Heap::flush_cache(heap, class, 0, false);
                }
                Heap::set_cache_src(heap, class, ptr::null_mut());
            }
            Heap::gather_remote(heap);
            while !(*heap).pending.is_null() {
                Heap::take_remote(heap, (*heap).pending, true);
            }
            for class in 0..CLASSES {
                (*heap).kept_empty[class] = ptr::null_mut();
                let mut p = (*heap).lists[class].head;
                while !p.is_null() {
                    let next = (*p).next;
                    if (*p).used == 0 {
                        (*heap).release_page(p);
                    }
                    p = next;
                }
            }
        }
    }

    /// Whether a live thread owns the heap.
    pub(crate) fn is_owned(&self) -> bool {
        self.owned.load(Ordering::Relaxed) != 0
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
fn served(p: *mut u8) -> bool {
    cfg!(not(feature = "hardened")) || !p.is_null()
}

/// Whether a hardened build may have dropped a corrupted free list (its
/// free blocks lost to their page) since a report it went on from.
fn lists_dropped() -> bool {
    #[cfg(feature = "hardened")]
    return crate::hardened::went_on();
    #[cfg(not(feature = "hardened"))]
    false
}

/// Whether `p` lies in the blocks of `page` (a heap page).
///
/// # Safety
/// `page` is a live heap page (its `info` is read).
unsafe fn in_page(page: *mut Page, p: *const u8) -> bool {
    // SAFETY: the caller passes a live page.
    let (start, slots) = unsafe { ((*page).info.start as usize, usize::from((*page).info.slots)) };
    (start..start + slots * super::segment::SLOT_SIZE).contains(&(p as usize))
}

/// Frees `p`, a live block of `page` (of a small segment), on the page's
/// free list if the calling thread's heap owns it, else on its remote list.
///
/// # Safety
/// `p` is a live block of `page`, checked (hardened builds) and marked freed.
#[cfg(feature = "hardened")]
#[inline(always)]
pub(crate) unsafe fn free_block(page: *mut Page, p: *mut u8) {
    // (`NO_HEAP` owns no page.)
    let heap = current_or_none();
    // SAFETY: per the contract; `info.heap` is fixed while `p` is live.
    unsafe {
        if (*page).info.heap.load(Ordering::Relaxed) == heap {
            Heap::free_local(heap, page, p.cast::<Block>());
        } else {
            free_remote(page, p.cast::<Block>());
        }
    }
}

/// Frees `p`, a live block of small segment `seg` whose slot's sink
/// ([`sink_of`](super::segment::sink_of)) is `sink`: into the sink if the
/// calling thread's heap owns it, else onto its page's remote list.
///
/// # Safety
/// `p` is a live block of `seg`; `sink` its slot's sink.
#[cfg(not(feature = "hardened"))]
#[inline(always)]
pub(crate) unsafe fn free_to_sink(seg: *mut super::segment::SmallSegment, sink: *mut Page, p: *mut u8) {
    // (`NO_HEAP` owns no page, nor is it a free cache's heap.)
    let heap = current_or_none();
    // SAFETY: per the contract; the sink's `info.heap` is the page's owner
    // (a free cache's is its heap), fixed while `p` is live.
    unsafe {
        if (*sink).info.heap.load(Ordering::Relaxed) == heap {
            debug_assert!(
                Heap::is_cache(heap, sink) || sink == super::segment::page_of(seg, p),
                "a slot's sink is its page or its owner's free cache"
            );
            Heap::free_local(heap, sink, p.cast::<Block>());
        } else {
            free_remote(super::segment::page_of(seg, p), p.cast::<Block>());
        }
    }
}

/// A block of another heap's page: push it on the page's `thread_free`; the
/// first push onto an empty list also queues the page on its heap, once.
#[cold]
unsafe fn free_remote(page: *mut Page, block: *mut Block) {
    // SAFETY: the block is live and ours to give back; the page and its heap
    // outlive it (heaps are never freed, pages not reassigned while they hold
    // a live block).
    unsafe {
        // (A hardened build stores the link encoded, as in the page's own
        // list: the owner then takes the chain without walking it.)
        if (*page).remote.thread_free.push_by(block, |b, next| (*b).next = link(page, next)) {
            let heap = (*page).info.heap.load(Ordering::Relaxed);
            (*heap).remote_pages.0.push(page);
        }
    }
}

/// The link a free block of `page` stores to the next one: encoded in a
/// hardened build, plain otherwise.
#[inline(always)]
pub(super) unsafe fn link(page: *mut Page, next: *mut Block) -> *mut Block {
    #[cfg(feature = "hardened")]
    // SAFETY: the caller passes a live page.
    return crate::hardened::encode(next, unsafe { (*page).info.key });
    #[cfg(not(feature = "hardened"))]
    {
        let _ = page;
        next
    }
}

/// Hardened builds: whether `block`, the head of `page`'s free list, lies
/// outside the page's blocks (a pool page, with no slots of its own, is not
/// checked: its `links` is `usize::MAX`). Checked before the head is read:
/// a link overwritten by a stray write decodes to anywhere at all, and the
/// pop that read it made it the head. (Its alignment to a block would cost
/// a multiplication on every pop.)
///
/// # Safety
/// `page` is a live page.
#[cfg(feature = "hardened")]
#[inline(always)]
unsafe fn outside(page: *mut Page, block: *mut Block) -> bool {
    // SAFETY: `page` is live (the caller's word); its `info` is written
    // once, when the page is taken, so reading it races with nothing.
    let (start, links) = unsafe { ((*page).info.start as usize, (*page).info.links) };
    debug_assert!(links > 0, "a page with a free list spans some blocks");
    (block as usize).wrapping_sub(start) >= links
}

/// Checks the link `next` read from a free block of `page` as
/// [`outside`] checks a head (null, the list's end, passes).
///
/// # Safety
/// `page` is a live page.
#[cfg(feature = "hardened")]
#[inline(always)]
unsafe fn link_outside(page: *mut Page, next: *mut Block) -> bool {
    // SAFETY: `page` is live (the caller's word), as `outside` needs.
    !next.is_null() && unsafe { outside(page, next) }
}

/// Reports a free block of `page` linking to `next`, outside the page: null
/// (the rest of the list is dropped if the report does not abort).
///
/// # Safety
/// `page` is a live page.
#[cfg(feature = "hardened")]
#[cold]
#[inline(never)]
unsafe fn corrupted_list(page: *mut Page, next: *mut Block) -> *mut Block {
    // SAFETY: `page` is live (the caller's word): its `info` is read for
    // the report, nothing is read through `next`.
    unsafe {
        crate::hardened::misuse(format_args!(
            "corrupted free list in the {}-byte page at {:p} (node {}): a free block links to {next:p}",
            (*page).info.block_size,
            (*page).info.start,
            (*page).info.node
        ));
    }
    ptr::null_mut()
}

/// The block a free block of `page` links to (see [`link`]); a hardened
/// build checks it lies in the page (a corrupted list is reported).
#[inline(always)]
unsafe fn next_of(page: *mut Page, block: *mut Block) -> *mut Block {
    // SAFETY: the caller passes a free block of the page.
    let stored = unsafe { (*block).next };
    #[cfg(feature = "hardened")]
    // SAFETY: as above.
    unsafe {
        let next = crate::hardened::decode(stored, (*page).info.key);
        if link_outside(page, next) {
            return corrupted_list(page, next);
        }
        next
    }
    #[cfg(not(feature = "hardened"))]
    {
        let _ = page;
        stored
    }
}

/// What a page's blocks are, for hardened reports and checks: a pool's page
/// (no slots of its own) lends region blocks.
#[cfg(feature = "hardened")]
///
/// # Safety
/// `page` is live.
#[inline(always)]
unsafe fn kind_of(page: *mut Page) -> (usize, crate::hardened::BlockKind) {
    // SAFETY: `page` is live (the caller's word); `info` is written once,
    // when the page is taken.
    let (bs, node, slots) =
        unsafe { ((*page).info.block_size as usize, usize::from((*page).info.node), (*page).info.slots) };
    (
        bs,
        if slots == 0 {
            crate::hardened::BlockKind::Region(bs, node)
        } else {
            crate::hardened::BlockKind::Sized(bs, node)
        },
    )
}

/// The node (arena) of one of the heap's pages.
#[inline(always)]
unsafe fn node_of(page: *mut Page) -> usize {
    // SAFETY: the caller passes a live page.
    usize::from(unsafe { (*page).info.node })
}

/// The calling thread's heap, made (or adopted) on first use, and whether it
/// was adopted (its pages may be on several nodes). `None` only when the OS
/// refuses the memory for a heap descriptor.
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.hot.numaweave")]
pub(crate) fn init_current(state: &'static State) -> Option<(*mut Heap, bool)> {
    let node = state.topology.current_node();
    let arena = state.home_arena(node);
    // Adopt a heap left by an exited thread of this node, else make one.
    let heap = {
        let mut g = arena.inner.lock();
        let h = g.orphans;
        if !h.is_null() {
            // SAFETY: orphans are live heaps owned by nobody.
            g.orphans = unsafe { (*h).next_orphan };
        }
        h
    };
    let adopted = !heap.is_null();
    let heap = if heap.is_null() {
        let p = state.alloc_meta(core::mem::size_of::<Heap>(), core::mem::align_of::<Heap>())?;
        let h = p.as_ptr().cast::<Heap>();
        // SAFETY: fresh, suitably aligned metadata memory.
        unsafe {
            // Field by field, in place: the free caches make the heap
            // 18 KiB, more than a value on a small thread's stack should be.
            (&raw mut (*h).direct).write([empty_page(); CLASSES]);
            (&raw mut (*h).counters).write(HeapCounters::new());
            (&raw mut (*h).lists).write([PageList { head: ptr::null_mut(), tail: ptr::null_mut() }; CLASSES]);
            (&raw mut (*h).kept_empty).write([ptr::null_mut(); CLASSES]);
            (&raw mut (*h).refills).write(0);
            (&raw mut (*h).last_refill).write([0; CLASSES]);
            (&raw mut (*h).node).write(arena.node);
            (&raw mut (*h).loan).write(Loan { page: ptr::null_mut(), class: 0, used0: 0 });
            (&raw mut (*h).next_all).write(ptr::null_mut());
            (&raw mut (*h).next_orphan).write(ptr::null_mut());
            (&raw mut (*h).owned).write(AtomicU64::new(1));
            (&raw mut (*h).policy).write(ptr::null());
            (&raw mut (*h).pending).write(ptr::null_mut());
            (&raw mut (*h).remote_pages).write(CachePadded(AtomicStack::new()));
            (&raw mut (*h).cache_serves).write([false; CLASSES]);
            (&raw mut (*h).cache_src).write([ptr::null_mut(); CLASSES]);
            (&raw mut (*h).cache_seen).write([0; CLASSES]);
            (&raw mut (*h).cache_filled_at).write([0; CLASSES]);
            for class in 0..CLASSES {
                let c = Heap::cache_page(h, class);
                c.write(Page::empty());
                (*c).used = cache_room(class);
                (*c).info.heap = AtomicPtr::new(h);
                (*c).info.block_size = super::size_class::class_size(class) as u32;
                (*c).info.class = class as u8;
                (*c).info.node = arena.node as u8;
            }
            let mut all = state.heaps.lock();
            (*h).next_all = *all;
            *all = h;
        }
        h
    } else {
        // SAFETY: adopted: ours now. Its pages and their free lists come along;
        // remote frees that arrived meanwhile are collected at the next refill.
        unsafe {
            debug_assert!(!(*heap).is_owned() && (*heap).loan.page.is_null());
            debug_assert!((*heap).direct.iter().all(|&d| d == empty_page()), "an orphan with direct pages");
            debug_assert!(
                (0..CLASSES).all(|c| (*Heap::cache_page(heap, c)).free.is_null() && (*heap).cache_src[c].is_null()),
                "an orphan with cached blocks"
            );
            (*heap).next_orphan = ptr::null_mut();
            (*heap).owned.store(1, Ordering::Relaxed);
        }
        heap
    };
    crate::os::tls::set(heap.cast());
    // Ask for `thread_exit` at thread exit.
    state.exit_key.set(heap.cast());
    Some((heap, adopted))
}

/// Thread-exit destructor (pthread key): release empty pages, leave the heap
/// for adoption. Allocations after this (from later destructors) make or
/// adopt a heap again, and the key brings us back for it.
#[unsafe(link_section = ".text.hot.numaweave")]
pub(crate) extern "C" fn thread_exit(heap: *mut libc::c_void) {
    let heap = heap.cast::<Heap>();
    let Some(state) = State::try_get() else { return };
    if heap.is_null() {
        return;
    }
    crate::os::tls::set(no_heap().cast());
    // SAFETY: the heap was this thread's; nobody else uses it until adopted.
    unsafe {
        Heap::release_empty_pages(heap);
        debug_assert!((*heap).direct.iter().all(|&d| d == empty_page()) && (*heap).loan.page.is_null());
        (*heap).owned.store(0, Ordering::Relaxed);
        // The thread's policy state goes with the thread.
        (*heap).policy = ptr::null();
        let arena = state.home_arena((*heap).node);
        {
            let mut g = arena.inner.lock();
            (*heap).next_orphan = g.orphans;
            g.orphans = heap;
        }
        // What waited out its purge delay goes back now.
        arena.tick(state);
    }
}

/// A heap looks for idle classes' kept pages once in this many refills.
const EXPIRE_EVERY: u32 = 64;
/// A class that has not refilled in this many of its heap's refills is
/// idle. (Refills come once per [`CARVE_BYTES`] of a fresh page's blocks or
/// per page of freed ones: a class in steady use refills well within this
/// and keeps its page; one used rarely gives it back, as mimalloc's retired
/// pages expire after some of the heap's slow-path calls. Lua's tree
/// classes sit idle for a few hundred refills while it builds its strings.)
const IDLE_REFILLS: u32 = 256;

/// How much of a page's untouched tail one [`carve`] puts on its free list:
/// one OS page's worth, as mimalloc extends its free lists
/// (`MI_MAX_EXTEND_SIZE`). Every carved block has its link written, so its
/// memory is resident from then on; a page whose class goes quiet keeps at
/// most this much touched beyond what it used. (16 KiB before 2026-12-01:
/// lua's peak RSS 0.2–0.3 MB higher, python3's 0.3 MB, for 0.1% fewer
/// instructions on the C churn.)
const CARVE_BYTES: usize = 4 * 1024;

/// Carves up to [`CARVE_BYTES`] worth of blocks (at least one) from the
/// page's untouched tail onto its free list: touching memory as late as
/// possible keeps RSS low.
unsafe fn carve(page: *mut Page) {
    // SAFETY: owner-only fields of the caller's page.
    unsafe {
        let left = (*page).info.capacity - (*page).carved;
        if left == 0 {
            return;
        }
        let bs = (*page).info.block_size as usize;
        let n = left.min((CARVE_BYTES / bs).max(1) as u32);
        let first = (*page).info.start.add((*page).carved as usize * bs);
        debug_assert!(
            first as usize + n as usize * bs
                <= (*page).info.start as usize + usize::from((*page).info.slots) * super::segment::SLOT_SIZE
        );
        for i in 0..n as usize {
            let b = first.add(i * bs).cast::<Block>();
            let next = if i + 1 < n as usize { first.add((i + 1) * bs).cast() } else { (*page).free };
            (*b).next = link(page, next);
            // A fresh block carries no freed mark (a page's memory may hold
            // an earlier class's stale one).
            #[cfg(feature = "hardened")]
            b.cast::<usize>().add(1).write(0);
        }
        (*page).free = first.cast();
        (*page).carved += n;
    }
}

/// Heaps for stats: every heap ever made.
pub(crate) fn for_each_heap(state: &State, mut f: impl FnMut(&Heap)) {
    let mut h = *state.heaps.lock();
    while !h.is_null() {
        // SAFETY: heaps are never freed; `next_all` is written once, under the
        // registry lock, before the heap is published.
        unsafe {
            f(&*h);
            h = (*h).next_all;
        }
    }
}

/// Bytes of memory a fresh page of `class` takes from its arena.
pub(crate) const fn page_bytes(class: usize) -> usize {
    page_slots(class) * super::segment::SLOT_SIZE
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::size_class::{class_of, class_size};

    /// Any page serves; fresh pages from the thread's node.
    struct Anywhere(usize);
    impl Placement for Anywhere {
        fn accepts(&mut self, _: usize) -> bool {
            true
        }
        fn fresh(&mut self) -> (usize, Option<NodeSet>) {
            (self.0, None)
        }
        fn took(&mut self, _: usize) {}
    }

    /// Any page serves, and so does the free cache (`Local`'s placement).
    #[cfg(not(feature = "hardened"))]
    struct Cached(usize);
    #[cfg(not(feature = "hardened"))]
    impl Placement for Cached {
        fn accepts(&mut self, _: usize) -> bool {
            true
        }
        fn fresh(&mut self) -> (usize, Option<NodeSet>) {
            (self.0, None)
        }
        fn took(&mut self, _: usize) {}
        fn cache_serves(&mut self, _: usize) -> bool {
            true
        }
    }

    /// A block of `class` through the fast path, refilled under `placement`.
    ///
    /// # Safety
    /// `heap` is this thread's heap.
    #[cfg(not(feature = "hardened"))]
    unsafe fn alloc_via(heap: *mut Heap, class: usize, state: &State, placement: &mut impl Placement) -> *mut u8 {
        // SAFETY: the caller's heap.
        unsafe {
            let p = Heap::pop(heap, class);
            let p = if p.is_null() { Heap::refill(heap, class, state, placement) } else { p };
            assert!(!p.is_null());
            p
        }
    }

    /// Frees `p` as `free` does.
    ///
    /// # Safety
    /// `p` is a live small block.
    #[cfg(not(feature = "hardened"))]
    unsafe fn free_small(p: *mut u8) {
        let seg = segment_of(p).cast::<super::super::segment::SmallSegment>();
        // SAFETY: a live small block of `seg`.
        unsafe { free_to_sink(seg, super::super::segment::sink_of(seg, p), p) }
    }

    /// The blocks on the class's free cache.
    ///
    /// # Safety
    /// `heap` is this thread's heap.
    #[cfg(not(feature = "hardened"))]
    unsafe fn cached(heap: *mut Heap, class: usize) -> Vec<*mut u8> {
        let mut v = Vec::new();
        // SAFETY: the cache's list is of free blocks of this heap's pages.
        unsafe {
            let mut b = (*Heap::cache_page(heap, class)).free;
            while !b.is_null() {
                v.push(b.cast());
                b = (*b).next;
            }
        }
        v
    }

    #[test]
    #[cfg(not(feature = "hardened"))]
    fn the_free_cache_serves_frees_newest_first_across_pages_and_gives_back_when_full() {
        on_fresh_heap(|state, heap| {
            // 64 KiB blocks: four to a page, a cache of eight.
            let class = class_of(64 * 1024);
            let room = cache_room(class) as usize;
            assert_eq!(room, 8);
            let node = state.current_arena().node;
            let mut p = Cached(node);
            // SAFETY: this thread's heap; blocks of it, freed once.
            unsafe {
                let blocks: Vec<*mut u8> = (0..3 * room).map(|_| alloc_via(heap, class, state, &mut p)).collect();
                let pages: std::collections::HashSet<usize> =
                    blocks.iter().map(|&b| page_of_block(b) as usize).collect();
                assert!(pages.len() >= 6, "24 blocks of four to a page");
                assert_eq!((*heap).direct[class], Heap::cache_page(heap, class), "the cache serves under Local");
                // Two blocks of different pages: the newest comes back first.
                let (x, y) = (blocks[0], blocks[3 * room - 1]);
                assert_ne!(page_of_block(x), page_of_block(y));
                let used_x = (*page_of_block(x)).used;
                free_small(x);
                free_small(y);
                assert_eq!(cached(heap, class), vec![y, x]);
                assert_eq!((*page_of_block(x)).used, used_x, "a cached block is in use for its page");
                assert_eq!(alloc_via(heap, class, state, &mut p), y);
                assert_eq!(alloc_via(heap, class, state, &mut p), x);
                // Filling the cache gives the older blocks back to their
                // pages and keeps the newest half.
                for &b in &blocks[..room] {
                    free_small(b);
                }
                let kept = cached(heap, class);
                let newest: Vec<*mut u8> = blocks[room / 2..room].iter().rev().copied().collect();
                assert_eq!(kept, newest);
                for &b in &blocks[room..] {
                    free_small(b);
                }
                assert!(cached(heap, class).len() <= room, "the cache holds at most its room");
                // At exit every block is back on its page, every page empty.
                Heap::release_empty_pages(heap);
                assert!(cached(heap, class).is_empty());
                for &pg in &pages {
                    assert!(!listed(heap, class, pg as *mut Page), "an emptied page goes back");
                }
            }
        });
    }

    #[test]
    #[cfg(not(feature = "hardened"))]
    fn a_burst_of_frees_goes_to_the_pages_until_the_cache_takes_from_them() {
        on_fresh_heap(|state, heap| {
            // (A class no other test of this module uses.)
            let class = class_of(1024);
            let room = cache_room(class) as usize;
            let node = state.current_arena().node;
            let sink = |b: *mut u8| {
                let seg = segment_of(b).cast::<super::super::segment::SmallSegment>();
                // SAFETY: a live small block.
                unsafe { super::super::segment::sink_of(seg, b) }
            };
            // SAFETY: this thread's heap; blocks of it, freed once.
            unsafe {
                let blocks: Vec<*mut u8> =
                    (0..4 * room).map(|_| alloc_via(heap, class, state, &mut Cached(node))).collect();
                let cache = Heap::cache_page(heap, class);
                // A block in the middle stays, so its page does.
                let w = blocks[2 * room];
                assert_eq!(sink(w), cache, "a page of the heap's node sends frees to the cache");
                // Frees with no allocation between them: once the cache has
                // filled twice, the pages it gives blocks back to take
                // their frees themselves.
                for &b in blocks.iter().filter(|&&b| b != w) {
                    free_small(b);
                }
                assert!(cached(heap, class).len() <= room);
                assert_eq!(sink(w), page_of_block(w), "a burst's page takes its frees itself");
                // Once the cache takes the page's blocks, its frees come back.
                let mut taken = Vec::new();
                while sink(w) != cache {
                    taken.push(alloc_via(heap, class, state, &mut Cached(node)));
                    assert!(taken.len() <= 8 * room, "the cache never took from the page again");
                }
                free_small(w);
                for b in taken {
                    free_small(b);
                }
                Heap::release_empty_pages(heap);
            }
        });
    }

    #[test]
    #[cfg(not(feature = "hardened"))]
    fn an_idle_free_cache_gives_its_blocks_back() {
        on_fresh_heap(|state, heap| {
            // (A class no other test of this module uses.)
            let class = class_of(2048);
            let node = state.current_arena().node;
            // SAFETY: this thread's heap; blocks of it, freed once.
            unsafe {
                let blocks: Vec<*mut u8> = (0..40).map(|_| alloc_via(heap, class, state, &mut Cached(node))).collect();
                for &b in &blocks {
                    free_small(b);
                }
                assert!(cached(heap, class).len() >= 40);
                // A look records the room; the class uses it in between.
                let now = (*heap).refills;
                Heap::expire_kept(heap, now);
                let b = alloc_via(heap, class, state, &mut Cached(node));
                Heap::expire_kept(heap, now);
                assert!(!cached(heap, class).is_empty(), "a class in use keeps its cache");
                free_small(b);
                // Two looks with nothing in between: idle, given back.
                Heap::expire_kept(heap, now);
                Heap::expire_kept(heap, now);
                assert!(cached(heap, class).is_empty() && (*heap).cache_src[class].is_null());
                assert_ne!((*heap).direct[class], Heap::cache_page(heap, class));
                let page = page_of_block(blocks[0]);
                assert!(!listed(heap, class, page) || (*page).used == 0, "its pages are empty again");
                // And it serves again at the next allocation.
                let b = alloc_via(heap, class, state, &mut Cached(node));
                assert_eq!((*heap).direct[class], Heap::cache_page(heap, class));
                free_small(b);
                Heap::release_empty_pages(heap);
            }
        });
    }

    #[test]
    #[cfg(not(feature = "hardened"))]
    fn a_policy_that_chooses_pages_gets_the_cached_blocks_back_first() {
        on_fresh_heap(|state, heap| {
            // (A class no other test of this module uses.)
            let class = class_of(96);
            let node = state.current_arena().node;
            // SAFETY: this thread's heap; blocks of it, freed once.
            unsafe {
                let blocks: Vec<*mut u8> = (0..8).map(|_| alloc_via(heap, class, state, &mut Cached(node))).collect();
                let page = page_of_block(blocks[0]);
                assert!(blocks.iter().all(|&b| page_of_block(b) == page));
                // The rest of what the fresh page carved is in the cache too.
                let before = cached(heap, class).len();
                assert_eq!((*heap).cache_src[class], page, "the cache was filled from the page");
                assert_eq!((*page).used, (*page).carved + 1, "cached blocks in use for their page, and the reference");
                for &b in &blocks {
                    free_small(b);
                }
                assert_eq!(cached(heap, class).len(), before + 8);
                // Under a placement that chooses pages the cache does not
                // serve: its blocks go back to their page before it looks.
                (*heap).direct[class] = empty_page();
                let b = Heap::refill(heap, class, state, &mut Anywhere(node));
                assert!(cached(heap, class).is_empty() && (*heap).cache_src[class].is_null());
                assert_ne!((*heap).direct[class], Heap::cache_page(heap, class));
                assert_eq!(page_of_block(b), page, "the page its blocks went back to serves");
                assert_eq!((*page).used, 2, "every block back but one out, and the direct reference");
                // (Nothing left in use: the next test to adopt this heap
                // finds its pages as fresh as a new heap's.)
                free_small(b);
                Heap::release_empty_pages(heap);
            }
        });
    }

    /// A heap of its own on a fresh thread (the test harness's threads may
    /// have one already, made by other tests of this binary).
    fn on_fresh_heap(f: impl FnOnce(&'static State, *mut Heap) + Send + 'static) {
        std::thread::spawn(move || {
            let state = State::get(&crate::alloc::Config::new());
            let (heap, _) = init_current(state).unwrap();
            f(state, heap);
        })
        .join()
        .unwrap();
    }

    /// The per-class counters sum to the exact counts and bytes: blocks of
    /// several classes handed out (by the fast path and by
    /// `alloc_on_node`), freed locally (through the free cache where it
    /// serves, so that it fills and gives back), and freed by another
    /// thread and collected.
    #[test]
    #[cfg(not(feature = "hardened"))]
    fn counters_count_every_block_and_byte_once() {
        on_fresh_heap(|state, heap| {
            let node = state.current_arena().node;
            let sizes = [1, 24, 48, 200, 1000, 3000, 20_000, 100_000, 256 * 1024];
            // SAFETY: this thread's heap; blocks of it, each freed once
            // (the remote ones by the other thread, then collected here).
            unsafe {
                let (_, c0) = (*heap).node_and_counters();
                let mut local = Vec::new();
                let mut remote = Vec::new();
                let mut bytes = 0u64;
                for (i, &size) in sizes.iter().enumerate() {
                    let class = class_of(size);
                    for k in 0..3 * cache_room(class) as usize + i {
                        // Every fifth through the handles' path (`pop_from`).
                        let b = if k % 5 == 4 {
                            Heap::alloc_on_node(heap, class, state, node)
                        } else {
                            alloc_via(heap, class, state, &mut Cached(node))
                        };
                        assert!(!b.is_null());
                        bytes += class_size(class) as u64;
                        if k % 3 == 0 { remote.push(b as usize) } else { local.push(b) }
                    }
                }
                let n = (local.len() + remote.len()) as u64;
                let (_, c1) = (*heap).node_and_counters();
                assert_eq!((c1.0 - c0.0, c1.1 - c0.1, c1.2 - c0.2, c1.3 - c0.3), (n, 0, bytes, 0));
                for &b in &local {
                    free_small(b);
                }
                let n_remote = remote.len() as u64;
                std::thread::spawn(move || {
                    for b in remote {
                        free_small(b as *mut u8);
                    }
                })
                .join()
                .unwrap();
                Heap::release_empty_pages(heap);
                let (_, c2) = (*heap).node_and_counters();
                assert_eq!(
                    (c2.0 - c0.0, c2.1 - c0.1, c2.2 - c0.2, c2.3 - c0.3, c2.4 - c0.4),
                    (n, n, bytes, bytes, n_remote),
                    "(allocs, frees, bytes allocated, bytes freed, remote frees)"
                );
            }
        });
    }

    #[test]
    fn blocks_come_back_lifo_and_a_drained_page_refills() {
        on_fresh_heap(|state, heap| {
            let class = class_of(64);
            // SAFETY: this thread's heap.
            unsafe {
                assert!(Heap::pop(heap, class).is_null(), "a new heap's direct slots are empty");
                let node = state.current_arena().node;
                let a = Heap::refill(heap, class, state, &mut Anywhere(node));
                let b = Heap::pop(heap, class);
                assert!(!a.is_null() && !b.is_null() && a != b);
                assert_eq!(b as usize - a as usize, class_size(class), "carved in address order");
                let page = (*heap).direct[class];
                Heap::free_local(heap, page, b.cast());
                assert_eq!(Heap::pop(heap, class), b, "the last block freed is the next handed out");
                // Drain the page: every block distinct, then a refill.
                let cap = (*page).info.capacity as usize;
                let mut seen = std::collections::HashSet::new();
                seen.insert(a as usize);
                seen.insert(b as usize);
                for _ in 2..cap {
                    let mut p = Heap::pop(heap, class);
                    if p.is_null() {
                        p = Heap::refill(heap, class, state, &mut Anywhere(node));
                    }
                    assert!(seen.insert(p as usize));
                }
                assert_eq!((*page).used as usize, cap + 1, "every block, and the direct slot's reference");
                let p = Heap::refill(heap, class, state, &mut Anywhere(node));
                assert!(!p.is_null() && (*heap).direct[class] != page, "a full page gives way to a fresh one");
                assert!((*page).in_full);
            }
        });
    }

    #[test]
    fn a_loan_serves_the_fast_path_and_leaves_the_counters_as_they_were() {
        on_fresh_heap(|_, heap| {
            let class = class_of(4096);
            let mut blocks = vec![[0u64; 512]; 3];
            // SAFETY: a page descriptor of ours with three blocks on its free
            // list, lent to this thread's heap and taken back.
            unsafe {
                let mut page = Page::empty();
                page.info.block_size = 4096;
                let b: Vec<*mut Block> = blocks.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
                // (Links as the page stores them: encoded in hardened builds,
                // with a key as a real page's.)
                #[cfg(feature = "hardened")]
                {
                    page.info.key = crate::hardened::page_key(ptr::addr_of!(page).cast());
                }
                b[0].write(Block { next: link(&mut page, b[1]) });
                b[1].write(Block { next: link(&mut page, b[2]) });
                b[2].write(Block { next: link(&mut page, ptr::null_mut()) });
                page.free = b[0];
                let before = (*heap).node_and_counters().1;
                Heap::lend(heap, class, &mut page);
                assert_eq!(Heap::pop(heap, class), b[0].cast());
                assert_eq!(Heap::pop(heap, class), b[1].cast());
                Heap::end_loan(heap);
                assert!(Heap::pop(heap, class).is_null(), "the slot is empty again");
                assert_eq!((*heap).node_and_counters().1, before, "lent blocks are not the heap's");
                assert_eq!(page.used, 2);
            }
        });
    }

    /// The page descriptor of a block a heap handed out.
    ///
    /// # Safety
    /// `b` is a live small block.
    unsafe fn page_of_block(b: *mut u8) -> *mut Page {
        // SAFETY: a small block lies in a page of its small segment.
        unsafe { super::super::segment::page_of(segment_of(b).cast(), b) }
    }

    /// Whether `page` is on the heap's list of `class`'s pages (a page given
    /// back to the arena is not). Looked at instead of the arena's page
    /// counts, which the tests running beside this one change too.
    ///
    /// # Safety
    /// `heap` is this thread's heap.
    unsafe fn listed(heap: *mut Heap, class: usize, page: *mut Page) -> bool {
        // SAFETY: the caller's heap; its listed pages are live.
        unsafe {
            let mut p = (*heap).lists[class].head;
            while !p.is_null() && p != page {
                p = (*p).next;
            }
            !p.is_null()
        }
    }

    /// Fills two pages of `class` (four 16 KiB blocks each) and frees the
    /// first page's blocks while the second is direct, so the first is kept
    /// empty. Returns the second page's blocks and the kept page.
    ///
    /// # Safety
    /// `heap` is this thread's heap, `class` holds four blocks a page.
    unsafe fn keep_an_emptied_page(state: &'static State, heap: *mut Heap, class: usize) -> (Vec<*mut u8>, *mut Page) {
        let node = state.current_arena().node;
        // SAFETY: the caller's heap and the blocks it hands out.
        unsafe {
            let mut ps = Vec::new();
            for _ in 0..8 {
                let mut p = Heap::pop(heap, class);
                if p.is_null() {
                    p = Heap::refill(heap, class, state, &mut Anywhere(node));
                }
                ps.push(p);
            }
            let first = page_of_block(ps[0]);
            for &p in &ps[..4] {
                Heap::free_local(heap, first, p.cast());
            }
            assert_eq!((*heap).kept_empty[class], first, "emptied while not direct: kept");
            assert!(listed(heap, class, first));
            (ps.split_off(4), first)
        }
    }

    /// Frees blocks (of any pages) back to this thread's heap.
    ///
    /// # Safety
    /// `heap` is this thread's heap, the blocks its own and live.
    unsafe fn free_all(heap: *mut Heap, blocks: &[*mut u8]) {
        for &p in blocks {
            // SAFETY: the caller's heap and live blocks.
            unsafe { Heap::free_local(heap, page_of_block(p), p.cast()) };
        }
    }

    #[test]
    fn an_emptied_page_is_kept_once_then_released() {
        on_fresh_heap(|state, heap| {
            let class = class_of(16 * 1024);
            // SAFETY: this thread's heap and its blocks.
            unsafe {
                let (rest, first) = keep_an_emptied_page(state, heap, class);
                Heap::release_empty_pages(heap);
                assert!((*heap).kept_empty[class].is_null());
                assert!(!listed(heap, class, first), "released to the arena");
                free_all(heap, &rest);
            }
        });
    }

    #[test]
    fn an_idle_class_gives_its_kept_page_back() {
        on_fresh_heap(|state, heap| {
            let (class, other) = (class_of(16 * 1024), class_of(64));
            let node = state.current_arena().node;
            // SAFETY: this thread's heap and its blocks.
            unsafe {
                let (rest, first) = keep_an_emptied_page(state, heap, class);
                // Refills of another class only: each one a tick of the
                // heap's clock.
                let tick = |n: u32| {
                    for _ in 0..n {
                        let b = Heap::refill(heap, other, state, &mut Anywhere(node));
                        assert!(!b.is_null());
                        free_all(heap, &[b]);
                    }
                };
                tick(IDLE_REFILLS / 2);
                assert_eq!((*heap).kept_empty[class], first, "not idle yet");
                assert!(listed(heap, class, first));
                tick(IDLE_REFILLS + EXPIRE_EVERY);
                assert!((*heap).kept_empty[class].is_null(), "an idle class's page expires");
                assert!(!listed(heap, class, first), "given back to the arena");
                // The class still serves, from its other page and fresh ones.
                free_all(heap, &rest);
                let p = Heap::refill(heap, class, state, &mut Anywhere(node));
                assert!(!p.is_null());
                free_all(heap, &[p]);
            }
        });
    }

    #[test]
    fn the_direct_page_stays_while_a_pair_loop_empties_it_and_is_kept_when_it_leaves() {
        on_fresh_heap(|state, heap| {
            let class = class_of(256);
            let node = state.current_arena().node;
            // SAFETY: this thread's heap and its blocks.
            unsafe {
                let a = Heap::refill(heap, class, state, &mut Anywhere(node));
                let page = (*heap).direct[class];
                assert_eq!((*page).used, 2, "one block and the direct slot's reference");
                for _ in 0..3 {
                    Heap::free_local(heap, page, a.cast());
                    assert_eq!((*page).used, 1, "emptied by the free, but for the slot's reference");
                    assert_eq!((*heap).direct[class], page);
                    assert!((*heap).kept_empty[class].is_null(), "a direct page is not kept");
                    assert_eq!(Heap::pop(heap, class), a, "the pair loop stays on the fast path");
                }
                Heap::free_local(heap, page, a.cast());
                // The slot lets go: the page empties now, and is kept.
                Heap::clear_direct(heap);
                assert_eq!((*page).used, 0);
                assert_eq!((*heap).kept_empty[class], page, "emptied as it left the slot: kept");
                Heap::release_empty_pages(heap);
                assert!(!listed(heap, class, page), "released to the arena");
            }
        });
    }

    #[test]
    fn a_refill_takes_the_page_that_got_blocks_back_first() {
        on_fresh_heap(|state, heap| {
            // Four 16 KiB blocks a page: three full pages.
            let class = class_of(16 * 1024);
            let node = state.current_arena().node;
            // SAFETY: this thread's heap and its blocks.
            unsafe {
                let mut ps = Vec::new();
                for _ in 0..12 {
                    let mut p = Heap::pop(heap, class);
                    if p.is_null() {
                        p = Heap::refill(heap, class, state, &mut Anywhere(node));
                    }
                    ps.push(p);
                }
                let (first, second, third) = (page_of_block(ps[0]), page_of_block(ps[4]), page_of_block(ps[8]));
                assert!((*first).in_full && (*second).in_full && (*heap).direct[class] == third);
                assert_eq!((*third).used, 5, "full, and the direct page");
                // A block back to the first full page, then to the second.
                Heap::free_local(heap, first, ps[0].cast());
                Heap::free_local(heap, second, ps[4].cast());
                assert!(!(*first).in_full && !(*second).in_full);
                // The third page has none: the refill takes the first's.
                assert!(Heap::pop(heap, class).is_null());
                let p = Heap::refill(heap, class, state, &mut Anywhere(node));
                assert_eq!(p, ps[0], "the first page's block, freed first");
                assert_eq!((*heap).direct[class], first);
                ps.remove(4);
                free_all(heap, &ps);
            }
        });
    }
}
