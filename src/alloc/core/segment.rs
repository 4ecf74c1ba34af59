//! Segments: 4 MiB-aligned mappings, each owned by one node arena and bound to
//! its node. Any pointer's owner is found in O(1) without a lock: mask the
//! pointer to its segment, read the segment's kind, then (small segments) index
//! the page table by the 64 KiB slot the pointer falls in.
//!
//! Three kinds ([`SegmentKind`]), one header ([`Segment`]) in front of each:
//!
//! - small: slot 0 holds the [`SmallSegment`] header (the segment fields, a
//!   slot→page map and 64 page descriptors); slots 1..64 are handed out as
//!   pages of 1 to 4 slots to thread heaps;
//! - huge: one block larger than [`SMALL_MAX`](super::size_class::SMALL_MAX)
//!   (or aligned beyond a slot), the header a page before it (`huge.rs`);
//! - region: page-granular carving for interleaved buffers of a page and more
//!   (`region.rs`).

use core::ptr;

use super::heap::Heap;
use crate::sync::{AtomicPtr, CountedStack, Linked, Ordering};

pub(crate) const SEGMENT_SHIFT: usize = 22;
/// Size and alignment of a small segment (4 MiB).
pub(crate) const SEGMENT_SIZE: usize = 1 << SEGMENT_SHIFT;
pub(crate) const SEGMENT_MASK: usize = SEGMENT_SIZE - 1;
pub(crate) const SLOT_SHIFT: usize = 16;
/// A page is 1 to 4 slots of 64 KiB (see `size_class::page_slots`).
pub(crate) const SLOT_SIZE: usize = 1 << SLOT_SHIFT;
pub(crate) const SLOTS: usize = SEGMENT_SIZE / SLOT_SIZE;

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
    /// Hardened builds, huge: where the block starts (an interior pointer
    /// is told from it).
    #[cfg(feature = "hardened")]
    pub(crate) block: *mut u8,
}

impl Segment {
    /// A header of `kind` for the mapping `map_base..map_base + map_len` of
    /// the arena of `node`.
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
            #[cfg(feature = "hardened")]
            block: ptr::null_mut(),
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
    pub(crate) used: u32,
    /// Blocks carved from the page so far.
    pub(crate) carved: u32,
    /// Unlinked from its heap's class list because it had no free block.
    pub(crate) in_full: bool,
    /// On the owning heap's pending list (see `heap.rs`).
    pub(crate) pending: bool,
    /// Its free blocks' memory and its uncarved tail were given back to the
    /// OS since it last served (see `Heap::purge_free_blocks`; owner only).
    pub(crate) purged: bool,
    /// Links in the owning heap's class list (owner only).
    pub(crate) prev: *mut Page,
    pub(crate) next: *mut Page,
    /// Links in the owning heap's list of pages whose remote frees wait in
    /// `thread_free` until `free` runs dry (owner only).
    pub(crate) pend_prev: *mut Page,
    pub(crate) pend_next: *mut Page,
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
    /// Hardened builds: the key its free-list links are encoded with.
    #[cfg(feature = "hardened")]
    pub(crate) key: usize,
    /// Hardened builds: `ceil(2^64 / block_size)`, so that a free tells a
    /// block's start by one multiplication (Lemire's divisibility test), not
    /// a division.
    #[cfg(feature = "hardened")]
    pub(crate) inv: u64,
    /// Hardened builds: `capacity * block_size`, the bytes the blocks span,
    /// where `free` checks a block on its fast path; 0 where it must not:
    /// a descriptor of no live page (the header's, a free page's) and every
    /// page under `NUMAWEAVE_CHECK=full` (whose frees are checked out of
    /// line), so that one bound sends all of them to the slow path.
    #[cfg(feature = "hardened")]
    pub(crate) span: u32,
    /// Hardened builds: how far past `start` a free block's link may point
    /// (the page's slots); `usize::MAX` for a page not checked (a pool's).
    #[cfg(feature = "hardened")]
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
            used: 0,
            carved: 0,
            in_full: false,
            pending: false,
            purged: false,
            prev: ptr::null_mut(),
            next: ptr::null_mut(),
            pend_prev: ptr::null_mut(),
            pend_next: ptr::null_mut(),
            info: Info {
                heap: AtomicPtr::new(ptr::null_mut()),
                block_size: 0,
                capacity: 0,
                start: ptr::null_mut(),
                class: 0,
                slots: 0,
                first_slot: 0,
                node: 0,
                #[cfg(feature = "hardened")]
                key: 0,
                #[cfg(feature = "hardened")]
                inv: 0,
                #[cfg(feature = "hardened")]
                span: 0,
                #[cfg(feature = "hardened")]
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
    /// taken again soon after, they tell the arena its delay is too short.
    pub(crate) purged_slots: u64,
    /// When (ms, monotonic) its first dirty slot is due to be purged (0:
    /// none waiting), with a purge delay. Under the arena lock.
    pub(crate) purge_at: u64,
    /// For each slot of a page, the page's first slot.
    pub(crate) slot_page: [u8; SLOTS],
    pub(crate) pages: [Page; SLOTS],
    /// For each slot of a page, where its owner's frees go (see
    /// [`sink_of`]); set when a heap takes the page, changed by its owner
    /// ([`set_sink`]) while other threads may read it to free a block
    /// (relaxed: either value sends them to the page's remote list).
    pub(crate) slot_sink: [AtomicPtr<Page>; SLOTS],
    /// When each dirty slot was freed (ms, monotonic), with a purge delay;
    /// for a slot of `purged_slots`, when it was purged.
    /// Last: `free` reads `slot_page` and `pages` at short offsets.
    pub(crate) freed_at: [u64; SLOTS],
}

const _: () = assert!(core::mem::size_of::<SmallSegment>() <= SLOT_SIZE);

/// The segment holding `p`: `(p - 1)` rounded down, so a huge block aligned
/// to exactly the segment size still finds the header just before it.
#[inline(always)]
pub(crate) fn segment_of(p: *const u8) -> *mut Segment {
    ((p as usize).wrapping_sub(1) & !SEGMENT_MASK) as *mut Segment
}

/// The page descriptor for `p` in small segment `seg`.
///
/// # Safety
/// `p` must point into a slot of `seg` that belongs to a page.
#[inline(always)]
pub(crate) unsafe fn page_of(seg: *mut SmallSegment, p: *const u8) -> *mut Page {
    let slot = (p as usize - seg as usize) >> SLOT_SHIFT;
    // SAFETY: per the contract `slot` indexes a live page's slot; the map holds
    // the page's first slot, whose descriptor is the page's.
    unsafe {
        debug_assert_eq!((*seg).seg.kind, SegmentKind::Small);
        debug_assert!(slot > 0 && slot < SLOTS, "pointer in a segment's header slot");
        let first = *(*seg).slot_page.get_unchecked(slot) as usize;
        debug_assert!(first <= slot && (*seg).free_slots & (1 << first) == 0, "pointer into a free slot");
        (*seg).pages.as_mut_ptr().add(first)
    }
}

/// Where a free of `p`, a block of small segment `seg`, by its page's
/// owner goes: the owning heap's free cache of the page's class
/// (`Heap::cache_page`; hardened builds: the page itself, whose links are
/// encoded with its key). One load, in place of the page's: the cache's
/// `info` names the owner and the block size as the page's does, so a
/// local free does not touch the page at all, and only a remote free
/// looks the page up ([`page_of`]).
///
/// # Safety
/// `p` must point into a slot of `seg` that belongs to a page.
#[cfg(not(feature = "hardened"))]
#[inline(always)]
pub(crate) unsafe fn sink_of(seg: *mut SmallSegment, p: *const u8) -> *mut Page {
    let slot = (p as usize - seg as usize) >> SLOT_SHIFT;
    // SAFETY: per the contract `slot` indexes a live page's slot, whose
    // entry was set when its heap took the page.
    unsafe {
        debug_assert!(slot > 0 && slot < SLOTS, "pointer in a segment's header slot");
        let sink = (*seg).slot_sink.get_unchecked(slot).load(Ordering::Relaxed);
        debug_assert!(!sink.is_null());
        sink
    }
}

/// Makes `sink` where the owner's frees of `page`'s blocks go (see
/// [`sink_of`]), if it is not already.
///
/// # Safety
/// `page` is a live page of `seg`, owned by the calling thread's heap;
/// `sink` is the page or its heap's free cache of its class.
#[inline]
pub(crate) unsafe fn set_sink(seg: *mut SmallSegment, page: *mut Page, sink: *mut Page) {
    // SAFETY: the page's slots are its own while it is live, and their
    // sinks are written only by its owner (the caller); a thread freeing a
    // block of the page meanwhile reads either sink, both owned by the
    // caller's heap, so it takes the remote path whichever it reads.
    unsafe {
        if (*seg).slot_sink[usize::from((*page).info.first_slot)].load(Ordering::Relaxed) != sink {
            store_sinks(seg, page, sink);
        }
    }
}

/// Makes `sink` the sink of every slot of `page` (a page taken by a heap:
/// whatever its slots held before; or [`set_sink`]'s change).
///
/// # Safety
/// `page` is a page of `seg` whose slots and descriptor are written; only
/// its owner (or the thread setting it up) writes its sinks.
#[inline]
pub(crate) unsafe fn store_sinks(seg: *mut SmallSegment, page: *mut Page, sink: *mut Page) {
    // SAFETY: per the contract; the slots are the page's own.
    unsafe {
        let first = usize::from((*page).info.first_slot);
        for s in first..first + usize::from((*page).info.slots) {
            (*seg).slot_sink[s].store(sink, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_descriptors_keep_writers_on_their_own_lines() {
        assert_eq!(core::mem::size_of::<Page>(), 192);
        assert_eq!(core::mem::offset_of!(Page, info), 64);
        assert_eq!(core::mem::offset_of!(Page, remote), 128);
        // The owner's fast path touches `free` and `used` only: line 0.
        assert!(core::mem::offset_of!(Page, used) < 64);
    }

    #[test]
    fn segment_of_finds_the_header_before_any_block() {
        let base = 7 * SEGMENT_SIZE;
        // The first byte after the header slot, the last byte of the
        // segment, and a huge block aligned to exactly the segment size
        // (its header is the segment before).
        assert_eq!(segment_of((base + SLOT_SIZE) as *const u8) as usize, base);
        assert_eq!(segment_of((base + SEGMENT_SIZE - 1) as *const u8) as usize, base);
        assert_eq!(segment_of((base + SEGMENT_SIZE) as *const u8) as usize, base);
    }

    #[test]
    fn page_of_maps_every_slot_of_a_page_to_its_descriptor() {
        // A header laid out in ordinary memory (it is only read here).
        let layout = core::alloc::Layout::new::<SmallSegment>();
        // SAFETY: a fresh zeroed allocation of the header's layout; the
        // slot pointers below are computed, never dereferenced.
        unsafe {
            let seg = std::alloc::alloc_zeroed(layout).cast::<SmallSegment>();
            (*seg).seg.kind = SegmentKind::Small;
            (*seg).free_slots = !(0b1111 << 4);
            for s in 4..8 {
                (*seg).slot_page[s] = 4;
            }
            let at = |slot: usize, off: usize| (seg as usize + slot * SLOT_SIZE + off) as *const u8;
            for slot in 4..8 {
                assert_eq!(page_of(seg, at(slot, 0)), (*seg).pages.as_mut_ptr().add(4));
                assert_eq!(page_of(seg, at(slot, SLOT_SIZE - 1)), (*seg).pages.as_mut_ptr().add(4));
            }
            std::alloc::dealloc(seg.cast(), layout);
        }
    }
}
