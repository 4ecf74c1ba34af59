//! The core's data types, in one file as mimalloc's `types.h` holds its:
//! segments and their page descriptors, thread heaps, per-node arenas, the
//! process state and the memory lifecycle's part of it. Every floor of the
//! core (`size_class` → `segment`, `segmap` → `arena` → `heap` →
//! `lifecycle` → `state`) names these; what each does with them is in the
//! file named for it. Here are only their definitions, their constructors
//! and accessors that read a field or two.
//!
//! Layouts the fast paths depend on are asserted where they are defined
//! (a `Page` on three cache lines by writer; `Heap::direct` first).

use core::ptr;

use super::size_class::CLASSES;
pub(crate) use super::size_class::{SEGMENT_MASK, SEGMENT_SHIFT, SEGMENT_SIZE, SLOT_SHIFT, SLOT_SIZE, SLOTS};
use crate::hardened::HARDENED;
use crate::os::mem::Huge;
use crate::os::thread;
use crate::sync::{
    AtomicBool, AtomicPtr, AtomicStack, AtomicU32, AtomicU64, CachePadded, CountedStack, InitCell, Linked, Ordering,
    SpinLock,
};
use crate::topology::{MAX_NODES, NodeSet, Topology};

// ---------------------------------------------------------------------------
// Segments and pages
// ---------------------------------------------------------------------------

/// What a segment holds; the first byte of its header. The values are far
/// apart so that a stray byte is unlikely to pass for one in a debug check.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SegmentKind {
    /// Pages of size-class blocks owned by thread heaps.
    Small = 0x5a,
    /// One large block in a mapping of its own.
    Huge = 0xa5,
    /// Interleaved buffers carved page by page.
    Region = 0x3c,
}

/// Fields common to every kind, at the start of every segment.
#[repr(C)]
pub(crate) struct Segment {
    pub(crate) kind: SegmentKind,
    /// The arena (logical node index) that owns the segment.
    pub(crate) arena: u8,
    /// On hugetlb pages (a region mapped with `Huge::Hugetlb`): never cached
    /// for reuse as another kind, never remapped.
    pub(crate) hugetlb: bool,
    /// The mapping's start and length (for a huge block the usable size is
    /// what lies between the block and the mapping's end).
    pub(crate) map_base: *mut u8,
    pub(crate) map_len: usize,
    /// Small: link in the arena's segment list (under the arena lock).
    pub(crate) next: *mut SmallSegment,
    /// Huge, in hardened builds: where the block starts (an interior
    /// pointer is told from it). No bytes in default builds, where it would
    /// push a small segment's page descriptors a cache line further.
    block: [*mut u8; HARDENED as usize],
}

impl Segment {
    /// A header of `kind` for the mapping `map_base..+map_len` of node `node`'s arena.
    pub(crate) fn new(kind: SegmentKind, node: usize, map_base: *mut u8, map_len: usize) -> Self {
        debug_assert!(node < crate::topology::MAX_NODES);
        debug_assert!(map_len >= crate::os::page_size() && (map_base as usize).is_multiple_of(crate::os::page_size()));
        Self {
            kind,
            arena: node as u8,
            hugetlb: false,
            map_base,
            map_len,
            next: ptr::null_mut(),
            block: [ptr::null_mut(); HARDENED as usize],
        }
    }

    /// A huge segment's block start (hardened builds; null in default ones).
    #[inline]
    pub(crate) fn block(&self) -> *mut u8 {
        self.block.first().copied().unwrap_or(ptr::null_mut())
    }

    /// Records a huge segment's block start (hardened builds; nothing in
    /// default ones).
    #[inline]
    pub(crate) fn set_block(&mut self, p: *mut u8) {
        if let Some(b) = self.block.first_mut() {
            *b = p;
        }
    }
}

/// A free-list node stored in a free block.
#[repr(C)]
pub(crate) struct Block {
    pub(crate) next: *mut Block,
}

// SAFETY: `next` is the block's own first word, unused by anyone else while
// the block is free (on a list).
unsafe impl Linked for Block {
    unsafe fn next_ptr(node: *mut Self) -> *mut *mut Self {
        // SAFETY: the caller passes a live block.
        unsafe { ptr::addr_of_mut!((*node).next) }
    }
}

/// A count one thread (a page's owner) writes, by a relaxed load and store
/// (`set`, `add`, `sub`: the one `inc`/`dec`/`add` on memory a plain field
/// compiles to on x86-64), and any thread may read (`get`) for statistics
/// (the arena's walk of its pages, `arena/usage.rs`) with no data race.
#[repr(transparent)]
pub(crate) struct OwnerCount(AtomicU32);

impl OwnerCount {
    pub(crate) const fn new(v: u32) -> Self {
        Self(AtomicU32::new(v))
    }
    #[inline(always)]
    pub(crate) fn get(&self) -> u32 {
        self.0.load(Ordering::Relaxed)
    }
    #[inline(always)]
    pub(crate) fn set(&self, v: u32) {
        self.0.store(v, Ordering::Relaxed);
    }
    #[inline(always)]
    pub(crate) fn add(&self, n: u32) {
        self.set(self.get().wrapping_add(n));
    }
    #[inline(always)]
    pub(crate) fn sub(&self, n: u32) {
        self.set(self.get().wrapping_sub(n));
    }
}

/// A mask the owner of a page writes and statistics read, as [`OwnerCount`].
pub(crate) struct OwnerMask(AtomicU64);

impl OwnerMask {
    #[inline(always)]
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
    #[inline(always)]
    pub(crate) fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed);
    }
}

/// A page descriptor, on three cache lines by who writes them: the owner's
/// list state (written by every local allocation and free), the page's fixed
/// facts (written once, when a heap takes the page; read by every free, local
/// or remote, to find the owner), and the remote-free list (written by other
/// threads). So a remote free neither steals the line the owner's fast path
/// writes nor has its read of `heap` invalidated by it.
#[repr(C, align(64))]
pub(crate) struct Page {
    /// Local free list (owner only).
    pub(crate) free: *mut Block,
    /// Blocks handed out and not yet returned to `free` (owner only; remote
    /// frees still on `thread_free` and blocks in the heap's free cache
    /// count as used), plus one while the page is its heap's direct page
    /// for its class (see `Heap::set_direct`). For a heap's free cache: the
    /// room left (see `Heap::cache`).
    pub(crate) used: OwnerCount,
    /// Blocks carved from the page so far (owner only).
    pub(crate) carved: OwnerCount,
    /// Unlinked from its heap's class list because it had no free block.
    pub(crate) in_full: bool,
    /// On the owning heap's pending list (see `heap.rs`).
    pub(crate) pending: bool,
    /// Its uncarved tail given back, for good (`Heap::purge_free_blocks`).
    pub(crate) tail_clean: bool,
    /// `used` at its last purge of free blocks, `u32::MAX` once it serves again (owner only).
    pub(crate) purged_used: u32,
    /// Links in the owning heap's class list (owner only).
    pub(crate) prev: *mut Page,
    pub(crate) next: *mut Page,
    /// Links in the heap's list of pages whose remote frees wait (owner only).
    pub(crate) pend_prev: *mut Page,
    pub(crate) pend_next: *mut Page,
    /// Free blocks off `free`, their links' OS pages purged: bit i block i, or on a
    /// page of over 64 blocks OS page i of the span (`size_class::starting_in`).
    pub(crate) purged_free: OwnerMask,
    pub(crate) info: Info,
    pub(crate) remote: Remote,
}

/// What a page is: set when a heap takes it, then only read.
#[repr(C, align(64))]
pub(crate) struct Info {
    /// The owning heap. It does not change while the page holds a live block.
    pub(crate) heap: AtomicPtr<Heap>,
    pub(crate) block_size: u32,
    /// Blocks the page holds.
    pub(crate) capacity: u32,
    /// First block.
    pub(crate) start: *mut u8,
    pub(crate) class: u8,
    pub(crate) slots: u8,
    pub(crate) first_slot: u8,
    /// The segment's arena (node), copied here so a policy's slow-path check
    /// reads the line it already has.
    pub(crate) node: u8,
    /// The fields below are set and read in hardened builds only; they fill
    /// what would be the line's padding (28 bytes of fields before them),
    /// so the descriptor is one line in both builds.
    ///
    /// The key its free-list links are encoded with.
    pub(crate) key: usize,
    /// `ceil(2^64 / block_size)`, so that a free tells a block's start by
    /// one multiplication (Lemire's divisibility test), not a division.
    pub(crate) inv: u64,
    /// `capacity * block_size`, the bytes the blocks span, where `free`
    /// checks a block on its fast path; 0 where it must not: a descriptor
    /// of no live page (the header's, a free page's) and every page under
    /// `NUMAWEAVE_CHECK=full` (whose frees are checked out of line), so
    /// that one bound sends all of them to the slow path.
    pub(crate) span: u32,
    /// How far past `start` a free block's link may point (the page's
    /// slots); `usize::MAX` for a page not checked (a pool's).
    pub(crate) links: usize,
}

/// The part of a page other threads write.
#[repr(C, align(64))]
pub(crate) struct Remote {
    /// Blocks freed by other threads, taken by the owner in one swap with
    /// their count (so it need not walk them).
    pub(crate) thread_free: CountedStack<Block>,
    /// Link in the owning heap's list of pages with remote frees waiting.
    pub(crate) remote_next: *mut Page,
}

// SAFETY: `remote_next` is used only as the link of a heap's `remote_pages`
// stack, and a page is on at most one such stack at a time (it is pushed only
// when its `thread_free` goes from empty to non-empty, and that list is emptied
// only by the owner after it took the page off the stack).
unsafe impl Linked for Page {
    unsafe fn next_ptr(node: *mut Self) -> *mut *mut Self {
        // SAFETY: the caller passes a live page.
        unsafe { ptr::addr_of_mut!((*node).remote.remote_next) }
    }
}

impl Page {
    pub(crate) const fn empty() -> Self {
        Self {
            free: ptr::null_mut(),
            used: OwnerCount::new(0),
            carved: OwnerCount::new(0),
            in_full: false,
            pending: false,
            tail_clean: false,
            purged_used: u32::MAX,
            prev: ptr::null_mut(),
            next: ptr::null_mut(),
            pend_prev: ptr::null_mut(),
            pend_next: ptr::null_mut(),
            purged_free: OwnerMask(AtomicU64::new(0)),
            info: Info {
                heap: AtomicPtr::new(ptr::null_mut()),
                block_size: 0,
                capacity: 0,
                start: ptr::null_mut(),
                class: 0,
                slots: 0,
                first_slot: 0,
                node: 0,
                key: 0,
                inv: 0,
                span: 0,
                links: usize::MAX,
            },
            remote: Remote { thread_free: CountedStack::new(), remote_next: ptr::null_mut() },
        }
    }
}

const _: () = assert!(core::mem::size_of::<Info>() == 64, "a page's fixed facts on one cache line");
const _: () = assert!(core::mem::offset_of!(Page, info) == 64 && core::mem::offset_of!(Page, remote) == 128);

/// The header of a small segment, in its slot 0.
#[repr(C)]
pub(crate) struct SmallSegment {
    pub(crate) seg: Segment,
    /// Free slots (bit i = slot i), under the arena lock.
    pub(crate) free_slots: u64,
    /// Free slots whose memory is still committed (not yet purged).
    pub(crate) dirty_slots: u64,
    /// Free slots the purge delay gave back (their `freed_at` says when):
    /// taken again soon after, and enough of them, they tell the arena its
    /// delay is too short (`purge::note_reuse`).
    pub(crate) purged_slots: u64,
    /// When its first dirty slot is due to be purged (monotonic ms, 0: none; arena lock).
    pub(crate) purge_at: u64,
    /// For each slot of a page, the page's first slot.
    pub(crate) slot_page: [u8; SLOTS],
    pub(crate) pages: [Page; SLOTS],
    /// Where each slot's owner's frees go (`segment::sink_of`, `set_sink`):
    /// set when a heap takes the page, changed by its owner while others
    /// read it to free a block (relaxed: either sends them to the remote list).
    pub(crate) slot_sink: [AtomicPtr<Page>; SLOTS],
    /// When each dirty slot was freed (ms, monotonic), with a purge delay;
    /// for a slot of `purged_slots`, when it was purged.
    /// Last: `free` reads `slot_page` and `pages` at short offsets.
    pub(crate) freed_at: [u64; SLOTS],
}

const _: () = assert!(core::mem::size_of::<SmallSegment>() <= SLOT_SIZE);

// ---------------------------------------------------------------------------
// Thread heaps
// ---------------------------------------------------------------------------

/// Per-heap counters: written only by the thread that owns the heap (relaxed
/// load + store, no read-modify-write), read by anyone and summed into
/// [`Stats`](crate::stats::Stats).
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
    pub(crate) const fn new() -> HeapCounters {
        HeapCounters {
            allocs: [const { AtomicU64::new(0) }; CLASSES],
            frees: AtomicU64::new(0),
            bytes_freed: AtomicU64::new(0),
            remote_frees: AtomicU64::new(0),
        }
    }
}

/// A list of pages of one class that (may) have free blocks: fresh pages
/// at the head, pages that got a block back while full at the tail (see
/// `Heap::page_event_with`).
#[derive(Clone, Copy)]
pub(crate) struct PageList {
    pub(crate) head: *mut Page,
    pub(crate) tail: *mut Page,
}

/// A direct slot lent to a page the heap does not own (see the module docs).
#[derive(Clone, Copy)]
pub(crate) struct Loan {
    /// The lent page (null: no loan).
    pub(crate) page: *mut Page,
    pub(crate) class: usize,
    /// The page's `used` when lent: the fast path counts what it takes.
    pub(crate) used0: u32,
}

#[repr(C)]
pub(crate) struct Heap {
    /// Per class, the page to allocate from: hot, first.
    pub(crate) direct: [*mut Page; CLASSES],
    /// Written by the owner on every operation: next to `direct`, away from
    /// anything other threads write.
    pub(crate) counters: HeapCounters,
    pub(crate) lists: [PageList; CLASSES],
    /// Per class, one page kept when it became empty, so that a heap whose
    /// blocks are freed elsewhere (producer/consumer) does not hand a page to
    /// its arena and take it back over and over. Checked lazily: if it is in
    /// use again when another page empties, that one is kept instead. A
    /// class gone idle gives its kept page back (see `Heap::expire_kept`).
    pub(crate) kept_empty: [*mut Page; CLASSES],
    /// Refills of this heap, all classes (wrapping): the clock by which a
    /// class is found idle.
    pub(crate) refills: u32,
    /// Per class, `refills` at its last refill.
    pub(crate) last_refill: [u32; CLASSES],
    /// The node the heap was made or adopted on (stats are booked there).
    pub(crate) node: usize,
    pub(crate) loan: Loan,
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
    pub(crate) pending: *mut Page,
    /// Pages of this heap with remote frees waiting: written by other threads.
    pub(crate) remote_pages: CachePadded<AtomicStack<Page>>,
    /// Per class, whether the last refill's placement let the free cache
    /// serve; cleared with the direct pages.
    pub(crate) cache_serves: [bool; CLASSES],
    /// Per class, the page the free cache was last filled from (null:
    /// none), tried first at the next fill, as a direct page is: the
    /// blocks freed to it (remote frees, given-back ones) are the
    /// recently used ones, and a producer whose consumer frees its blocks
    /// keeps to one page. It holds a reference on the page, as the direct
    /// slot does (`Heap::set_cache_src`).
    pub(crate) cache_src: [*mut Page; CLASSES],
    /// Per class, the free cache's room at the last look of
    /// `Heap::expire_kept`: unchanged at the next, the class is idle and
    /// its cached blocks go back to their pages.
    pub(crate) cache_seen: [u32; CLASSES],
    /// Per class, the heap's `allocs` counter when its free cache last
    /// filled up (see `Heap::page_event`).
    pub(crate) cache_filled_at: [u64; CLASSES],
    /// Per class, the blocks taken from the node's shared heap
    /// (`shared.rs`).
    pub(crate) sparse: [u8; CLASSES],
    /// Whether the per-CPU caches serve the heap's thread (and may hold
    /// blocks of its pages): read by other threads' frees.
    pub(crate) cpu_served: AtomicBool,
    /// The heap's part in the memory lifecycle (`lifecycle/`): after the
    /// fields the fast paths read.
    pub(crate) life: HeapLife,
    /// Per class, the heap's free cache: a page descriptor of no page (`Heap::cache_page`; its
    /// `info` names the heap and the class's block size), whose free list holds blocks of the
    /// heap's pages of the class on the heap's node, the most recently freed first. The owner's
    /// frees of such blocks go here (the slots' sink, `segment::sink_of`), and where the
    /// placement would take any such page the cache is the class's direct page: a block freed
    /// is the next one handed out, its line still in the CPU's cache, and a class whose pages
    /// hold few blocks is not refilled page after page. Emptied, it is refilled with a page's
    /// whole free list. Its `used` is the room left (length plus room is `cache_room`; a page's
    /// list taken whole may leave a room of one): the free that fills it gives all but the
    /// room's newest half back to the blocks' pages (`Heap::flush_cache`), and a refill under a
    /// policy that chooses among pages gives all of it back first. A cached block is in use for
    /// its page, which therefore stays. Last: 18 KiB, touched class by class (`Heap::make`).
    pub(crate) cache: [Page; CLASSES],
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

impl Heap {
    /// Whether a live thread owns the heap.
    pub(crate) fn is_owned(&self) -> bool {
        self.owned.load(Ordering::Relaxed) == OWNER_THREAD
    }
}

// ---------------------------------------------------------------------------
// Arenas
// ---------------------------------------------------------------------------

/// Counters of one arena, written under its lock or with single atomic adds.
#[derive(Default)]
pub(crate) struct ArenaCounters {
    /// Address space mapped (segments and huge blocks).
    pub(crate) reserved: AtomicU64,
    /// Memory returned to the OS with `MADV_DONTNEED` (cumulative).
    pub(crate) purged: AtomicU64,
    /// Pages' bytes currently handed to heaps.
    pub(crate) pages_in_use: AtomicU64,
    /// Free page bytes still committed (not yet purged).
    pub(crate) dirty: AtomicU64,
    /// Segments this arena's heaps had to take from another node.
    pub(crate) fallbacks: AtomicU64,
    /// Huge blocks live, and their bytes.
    pub(crate) huge_live: AtomicU64,
    pub(crate) huge_bytes: AtomicU64,
    pub(crate) huge_allocs: AtomicU64,
    pub(crate) huge_frees: AtomicU64,
    /// Bump regions (interleave, per-call handles) mapped and not yet released.
    pub(crate) region_live: AtomicU64,
    /// Regions mapped on hugetlb pages, and those that asked and got base
    /// pages (the node's pool was short) (cumulative).
    pub(crate) huge_regions: AtomicU64,
    pub(crate) huge_fallbacks: AtomicU64,
}

pub(crate) struct ArenaInner {
    /// Segments with at least one free slot first; all segments are listed.
    pub(crate) segments: *mut SmallSegment,
    /// Heaps of exited threads, for adoption (linked through `Heap::next_orphan`).
    pub(crate) orphans: *mut Heap,
    /// Set when this node was found out of memory; segment requests go to the nearest node
    /// until it counts down.
    pub(crate) exhausted: u32,
    /// Freed segment-aligned mappings (huge blocks', dead regions') kept for reuse, newest
    /// first, linked through a header in their own first page; their pages stay committed on
    /// this node. Their count and bytes.
    pub(crate) cached: *mut Cached,
    pub(crate) cached_count: usize,
    pub(crate) cached_bytes: usize,
    /// The earliest time (ms, monotonic) a segment's free pages or a cached mapping is due to
    /// go back to the OS; 0: none waiting.
    pub(crate) purge_at: u64,
    /// The delay in force is the configured one shifted left by this: see `purge::note_reuse`.
    pub(crate) delay_shift: u32,
    /// When the shift last rose; when purged pages taken back within the delay last kept it up;
    /// the bytes so taken in a window of one delay.
    pub(crate) raised_at: u64,
    pub(crate) early_at: u64,
    pub(crate) early: Window,
    /// The bound of free memory kept committed is the configured one shifted left by this: see
    /// `purge::note_bound_purge`.
    pub(crate) bound_shift: u32,
    /// When free memory last passed the bound (ms, monotonic; 0: never), the most that was free
    /// since the bound was last looked at, and when that was.
    pub(crate) bound_at: u64,
    pub(crate) dirty_peak: u64,
    pub(crate) bound_seen: u64,
    /// What the bound's purges returned in a window of four delays (what a raise keeps is not
    /// summed): only the sum of a burst's passes says what the program frees.
    pub(crate) burst: Window,
}

/// Bytes summed over a window of time that restarts rather than slides (`purge.rs` has its
/// methods): `sum` since `from` (ms, monotonic; 0: never started).
pub(crate) struct Window {
    pub(crate) sum: u64,
    pub(crate) from: u64,
}

// SAFETY: the raw pointers are owned by the arena and only used under its lock.
unsafe impl Send for ArenaInner {}

pub(crate) struct Arena {
    /// Logical node (index in `State::arenas`).
    pub(crate) node: usize,
    /// Kernel node to bind to, or `None` (flat mode: first touch decides).
    pub(crate) bind_to: Option<usize>,
    pub(crate) inner: SpinLock<ArenaInner>,
    /// The node's shared heap (null until a thread first takes a block of
    /// it; see `heap/shared.rs`), and the lock it is used under: taken
    /// before any other lock of the core.
    pub(crate) shared: SpinLock<SharedHeap>,
    /// The node's heap of cold blocks (null until the first one; see
    /// `heap/shared.rs`): its pages hold cold blocks only, so a hot block
    /// never shares a page with one. Taken alone among the heaps' locks,
    /// before the arenas' `inner`.
    pub(crate) cold: SpinLock<SharedHeap>,
    pub(crate) counters: ArenaCounters,
}

/// [`Arena::shared`]'s and [`Arena::cold`]'s content.
pub(crate) struct SharedHeap(pub(crate) *mut Heap);

// SAFETY: the heap is used only under the lock around it.
unsafe impl Send for SharedHeap {}

impl Arena {
    pub(crate) const fn new(node: usize, bind_to: Option<usize>) -> Self {
        Self {
            node,
            bind_to,
            inner: SpinLock::new(ArenaInner {
                segments: ptr::null_mut(),
                orphans: ptr::null_mut(),
                exhausted: 0,
                cached: ptr::null_mut(),
                cached_count: 0,
                cached_bytes: 0,
                purge_at: 0,
                delay_shift: 0,
                raised_at: 0,
                early_at: 0,
                early: Window::NEW,
                bound_shift: 0,
                bound_at: 0,
                dirty_peak: 0,
                bound_seen: 0,
                burst: Window::NEW,
            }),
            shared: SpinLock::new(SharedHeap(ptr::null_mut())),
            cold: SpinLock::new(SharedHeap(ptr::null_mut())),
            counters: ArenaCounters {
                reserved: AtomicU64::new(0),
                purged: AtomicU64::new(0),
                pages_in_use: AtomicU64::new(0),
                dirty: AtomicU64::new(0),
                fallbacks: AtomicU64::new(0),
                huge_live: AtomicU64::new(0),
                huge_bytes: AtomicU64::new(0),
                huge_allocs: AtomicU64::new(0),
                huge_frees: AtomicU64::new(0),
                huge_regions: AtomicU64::new(0),
                huge_fallbacks: AtomicU64::new(0),
                region_live: AtomicU64::new(0),
            },
        }
    }
}

/// A cached mapping's own description, in its first bytes.
#[repr(C)]
pub(crate) struct Cached {
    pub(crate) next: *mut Cached,
    pub(crate) len: usize,
    /// When it was freed (ms), for the purge delay.
    pub(crate) freed_at: u64,
}

// ---------------------------------------------------------------------------
// The process state
// ---------------------------------------------------------------------------

/// How arenas map to nodes, chosen once at start-up (as knfsd chose its pool
/// mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `Flat` on one node, `PerNode` on several.
    Auto,
    /// One arena, memory placed by first touch: what a NUMA-unaware
    /// allocator does.
    Flat,
    /// One arena per node with memory, each bound to its node; threads take
    /// pages from the arena of the node they run on.
    PerNode,
}

/// What the core reads of the configuration (the facade's `Config` holds it,
/// with the default placement the core never sees).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Settings {
    pub(crate) mode: Mode,
    pub(crate) strict: bool,
    pub(crate) purge_threshold: usize,
    pub(crate) purge_delay_ms: u64,
    pub(crate) verbose: bool,
    pub(crate) show_stats: bool,
    pub(crate) huge: Huge,
}

impl Settings {
    /// The defaults: `Auto`, not strict, an 8 MiB purge threshold, a 100 ms
    /// purge delay, no huge pages, nothing printed.
    pub(crate) const fn new() -> Self {
        Self {
            mode: Mode::Auto,
            strict: false,
            purge_threshold: 8 << 20,
            purge_delay_ms: 100,
            verbose: false,
            show_stats: false,
            huge: Huge::Off,
        }
    }
}

pub(crate) struct State {
    pub(crate) config: Settings,
    /// The mode after resolving `Auto`.
    pub(crate) mode: Mode,
    pub(crate) topology: &'static Topology,
    /// More than one node with memory (and per-node mode): fallbacks are checked.
    pub(crate) multi_node: bool,
    pub(crate) arenas: [Arena; MAX_NODES],
    /// For each logical node, the arena its threads use (nearest allowed node
    /// with memory).
    pub(crate) home: [u8; MAX_NODES],
    /// Every heap ever made, linked through `Heap::next_all` (never shrinks:
    /// heaps are adopted, not freed).
    pub(crate) heaps: SpinLock<*mut Heap>,
    pub(crate) meta: SpinLock<MetaChunk>,
    /// Runs `lifecycle::thread_exit` when a thread with a heap exits.
    pub(crate) exit_key: ExitHook,
    /// Whether the first thread's start-up work (`settle`) was done.
    pub(crate) settled: AtomicBool,
    /// The memory lifecycle: what is due to go back, and when.
    pub(crate) life: Lifecycle,
}

// SAFETY: raw pointers inside are guarded by the spin locks around them.
unsafe impl Sync for State {}
// SAFETY: as above.
unsafe impl Send for State {}

pub(crate) struct MetaChunk {
    pub(crate) next: *mut u8,
    pub(crate) end: *mut u8,
}

/// The state, made by the first allocation (`state.rs`).
pub(crate) static STATE: InitCell<State> = InitCell::new();

/// The thread-exit key, if libc gave one.
pub(crate) struct ExitHook(pub(crate) Option<thread::ExitKey>);

impl ExitHook {
    /// Sets the calling thread's value (its heap).
    pub(crate) fn set(&self, value: *mut libc::c_void) {
        if let Some(k) = &self.0 {
            k.set(value);
        }
    }
}

impl State {
    /// The state if it exists.
    #[inline]
    pub(crate) fn try_get() -> Option<&'static State> {
        STATE.get()
    }

    /// The arena for logical node `node` (`None` if it has no memory here).
    pub(crate) fn arena(&self, node: usize) -> Option<&Arena> {
        match self.mode {
            Mode::PerNode => (node < MAX_NODES && self.arenas[node].bind_to.is_some()).then(|| &self.arenas[node]),
            _ => (node == 0).then(|| &self.arenas[0]),
        }
    }

    /// The arena a thread running on `node` draws from.
    #[inline]
    pub(crate) fn home_arena(&self, node: usize) -> &Arena {
        match self.mode {
            Mode::PerNode => &self.arenas[usize::from(self.home[node % MAX_NODES])],
            _ => &self.arenas[0],
        }
    }

    /// The arena that places memory on `node`: its own, or for a node
    /// without memory (and in flat mode) the arena its threads draw from.
    #[inline]
    pub(crate) fn node_arena(&self, node: usize) -> &Arena {
        self.arena(node).unwrap_or_else(|| self.home_arena(node))
    }

    /// The arena of the calling thread's current node.
    #[inline]
    pub(crate) fn current_arena(&self) -> &Arena {
        match self.mode {
            Mode::PerNode => self.home_arena(self.topology.current_node()),
            _ => &self.arenas[0],
        }
    }

    /// Has the lifecycle look a purge delay from now (at least 1 ms): work
    /// no exited thread left, that the heaps' own refills may collect first.
    pub(crate) fn look_in_a_delay(&self) {
        let at = crate::os::monotonic_ms().saturating_add(self.config.purge_delay_ms.max(1));
        self.life.note_due(Due::Orphans, at);
    }

    /// The memory nodes the allocator places on.
    pub(crate) fn nodes(&self) -> NodeSet {
        match self.mode {
            Mode::PerNode => (0..MAX_NODES).filter(|&n| self.arenas[n].bind_to.is_some()).collect(),
            _ => NodeSet::single(0),
        }
    }
}

// ---------------------------------------------------------------------------
// The memory lifecycle's state
// ---------------------------------------------------------------------------

/// A set of size classes, one bit each.
pub(crate) type ClassSet = u128;
pub(crate) const ALL_CLASSES: ClassSet = ClassSet::MAX;
const _: () = assert!(CLASSES <= ClassSet::BITS as usize);

/// Where a heap stands in its decay (`lifecycle/decay.rs`): how often its
/// refills look at the clock while its thread lives, what it keeps once
/// its thread is gone. Changed only through [`HeapLife::set`], which
/// asserts the transition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decay {
    /// A live thread's heap with nothing to watch: every few refills look
    /// at the clock, and only while something is due.
    Busy,
    /// Armed while something is due, or a class of it found quiet: its
    /// next refill looks at the clock.
    Listening,
    /// Its last decay kept classes in use that hold memory: its refills
    /// look at the clock until a decay finds them quiet too (a thread that
    /// goes quiet right after a burst would otherwise keep the burst).
    Owed,
    /// An exited thread's heap, keeping the free blocks of its pages in
    /// use since `since` (ms) for the next thread of its node, which most
    /// likely adopts it; purged once they waited out the purge delay.
    Kept {
        /// When its thread exited (ms, never 0).
        since: u64,
    },
    /// An exited thread's heap whose kept blocks were purged, waiting for
    /// adoption.
    Parked,
}

impl Decay {
    /// Whether a live thread owns the heap.
    pub(crate) fn live(self) -> bool {
        matches!(self, Decay::Busy | Decay::Listening | Decay::Owed)
    }

    /// Whether every refill looks at the clock.
    pub(crate) fn looks(self) -> bool {
        matches!(self, Decay::Listening | Decay::Owed)
    }

    /// When an exited thread's heap began keeping its blocks; 0 when it
    /// keeps none.
    pub(crate) fn kept_since(self) -> u64 {
        match self {
            Decay::Kept { since } => since,
            _ => 0,
        }
    }
}

/// A heap's part in the memory lifecycle, written by its owner (or the
/// thread that claimed it); `page_bytes` is read by anyone for the
/// statistics.
pub(crate) struct HeapLife {
    /// See [`Decay`].
    pub(crate) decay: Decay,
    /// When (ms, coarse: 4 ms steps) the heap last looked at the clock.
    pub(crate) last_look: u64,
    /// Per class, the tick (ms, wrapping) of its last refill while the heap
    /// looked at the clock, and its refills in that tick.
    pub(crate) class_at: [u32; CLASSES],
    pub(crate) class_refills: [u8; CLASSES],
    /// When the heap last emptied its direct slots for the lifecycle.
    pub(crate) armed_at: u64,
    /// When a free's slow path last emptied the direct slots: once a tick,
    /// apart from the refills' (else a busy class's refill in that tick had
    /// the last word, and a thread that freed a burst never refilled again).
    pub(crate) event_armed_at: u64,
    /// When it last gave back what it holds free (quiet, or trimmed).
    pub(crate) decayed_at: u64,
    /// The trim epoch last seen (see [`Lifecycle::request_trim`]).
    pub(crate) trim_seen: u64,
    /// Per class, its refills since the heap's last decay (saturating).
    pub(crate) window_refills: [u16; CLASSES],
    /// Bytes of the pages the heap holds; the least since it last looked at
    /// the classes it left untouched (or `heap::GROWN`: `lifecycle::refill`).
    pub(crate) page_bytes: AtomicU64,
    pub(crate) grow_mark: u64,
    /// Unit tests of the heap's pages and free caches: the lifecycle
    /// leaves this heap's slots alone (other tests' frees, in the same
    /// process, make work due at any time).
    #[cfg(test)]
    pub(crate) steady: bool,
}

impl HeapLife {
    pub(crate) const fn new() -> HeapLife {
        HeapLife {
            decay: Decay::Busy,
            last_look: 0,
            class_at: [0; CLASSES],
            class_refills: [0; CLASSES],
            armed_at: 0,
            event_armed_at: 0,
            decayed_at: 0,
            trim_seen: 0,
            window_refills: [0; CLASSES],
            page_bytes: AtomicU64::new(0),
            grow_mark: 0,
            #[cfg(test)]
            steady: false,
        }
    }

    /// Moves the heap's decay to `to`, a transition the lifecycle makes:
    /// among the live states while its thread lives, `Kept` at its exit,
    /// `Parked` when the kept blocks are purged, `Busy` at adoption.
    #[inline]
    pub(crate) fn set(&mut self, to: Decay) {
        let from = self.decay;
        debug_assert!(
            match (from, to) {
                (f, t) if f.live() && t.live() => true,
                (f, Decay::Kept { since }) => f.live() && since != 0,
                (Decay::Kept { .. }, Decay::Parked) => true,
                (Decay::Kept { .. } | Decay::Parked, Decay::Busy) => true,
                _ => false,
            },
            "a heap's decay moved from {from:?} to {to:?}"
        );
        self.decay = to;
    }
}

/// What [`Lifecycle::note_due`] notes a time for.
pub(crate) enum Due {
    /// An arena's free memory, to purge or unmap.
    Memory,
    /// An exited thread's heap's kept free blocks.
    Orphans,
}

/// The process-wide part of the lifecycle, in [`State`]: what is due to
/// go back to the OS, and the lock of the one thread doing it.
pub(crate) struct Lifecycle {
    /// The earliest time (ms, `os::monotonic_ms`) some arena has memory due
    /// to go back to the OS; 0: none.
    pub(crate) due: AtomicU64,
    /// Some exited thread's heap has remote frees waiting to be collected.
    pub(crate) orphan_work: AtomicBool,
    /// The earliest time (ms) an exited thread's heap kept its free blocks
    /// for a delay ([`Decay::Kept`]); 0: none.
    pub(crate) orphans_due: AtomicU64,
    /// Bumped by [`trim`](crate::NumaAlloc::trim): a live heap that sees it
    /// changed at its next slow path gives back what it holds free.
    pub(crate) trim_epoch: AtomicU64,
    /// The lifecycle's work (a tick, a trim) is one thread's at a time: a
    /// tick that finds the lock held goes on (the work is not its own), a
    /// trim waits. Held across `fork()`, first of the core's locks.
    pub(crate) work: SpinLock<Work>,
}

/// What the thread doing the lifecycle's work keeps, under its lock.
pub(crate) struct Work {
    /// When (ms) exited threads' heaps were last reclaimed: at most once a
    /// clock tick (4 ms), however many frees into them ask for it.
    pub(crate) reclaimed_at: u64,
}

impl Lifecycle {
    pub(crate) const fn new() -> Lifecycle {
        Lifecycle {
            due: AtomicU64::new(0),
            orphan_work: AtomicBool::new(false),
            orphans_due: AtomicU64::new(0),
            trim_epoch: AtomicU64::new(0),
            work: SpinLock::new(Work { reclaimed_at: 0 }),
        }
    }

    /// Something is due at `at` (ms; 0: nothing): an arena's memory
    /// ([`Due::Memory`]) or an exited thread's kept free blocks
    /// ([`Due::Orphans`]). The earlier of that and what was noted stays.
    pub(crate) fn note_due(&self, what: Due, at: u64) {
        let word = match what {
            Due::Memory => &self.due,
            Due::Orphans => &self.orphans_due,
        };
        if at == 0 {
            return;
        }
        let mut cur = word.load(Ordering::Relaxed);
        while cur == 0 || at < cur {
            match word.compare_exchange_weak(cur, at, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return,
                Err(c) => cur = c,
            }
        }
    }

    /// An exited thread's heap got a remote free to collect.
    pub(crate) fn note_orphan_work(&self) {
        if !self.orphan_work.load(Ordering::Relaxed) {
            self.orphan_work.store(true, Ordering::Relaxed);
        }
    }

    /// Whether anything waits for a tick: memory due to be purged (now or
    /// later), or exited threads' remote frees. A heap stays in reach of its
    /// refills while this holds.
    #[inline]
    pub(crate) fn pending(&self) -> bool {
        self.due.load(Ordering::Relaxed) != 0
            || self.orphan_work.load(Ordering::Relaxed)
            || self.orphans_due.load(Ordering::Relaxed) != 0
    }

    /// The trim epoch a heap compares with the one it last saw.
    #[inline]
    pub(crate) fn trim_epoch(&self) -> u64 {
        self.trim_epoch.load(Ordering::Relaxed)
    }

    /// Asks every live heap to give back what it holds free at its next
    /// slow path (its owner alone may touch it).
    pub(crate) fn request_trim(&self) {
        self.trim_epoch.fetch_add(1, Ordering::Relaxed);
    }
}
