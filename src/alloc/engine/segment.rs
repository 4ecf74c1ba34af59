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

use super::types::{Page, SEGMENT_MASK, SLOT_SHIFT, SLOTS, Segment, SegmentKind, SmallSegment};
use crate::sync::Ordering;

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
    // SAFETY: `p` is in a slot of `seg` that belongs to a page (the caller's word), so
    // `slot` is in 1..SLOTS and the map holds that page's first slot, whose descriptor
    // is the page's.
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
#[inline(always)]
pub(crate) unsafe fn sink_of(seg: *mut SmallSegment, p: *const u8) -> *mut Page {
    let slot = (p as usize - seg as usize) >> SLOT_SHIFT;
    // SAFETY: `p` is in a slot of `seg` that belongs to a page (the caller's word), so
    // `slot` is in 1..SLOTS and its sink was set when its heap took the page.
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
    // SAFETY: `page` is a page of `seg` with its descriptor written (the caller's word),
    // so its `first_slot` and `slots` name its own slots, in range; the stores are atomic.
    unsafe {
        let first = usize::from((*page).info.first_slot);
        for s in first..first + usize::from((*page).info.slots) {
            (*seg).slot_sink[s].store(sink, Ordering::Relaxed);
        }
    }
}

/// Free blocks `page`'s `purged_free` holds off its list (see
/// [`masked_blocks`](super::size_class::masked_blocks)): for its owner's
/// count of what its list holds, and for the usage walk, which reads it
/// from another thread (a mask and a `carved` of different moments only
/// skew its figure: each OS page's count is bounded by the page itself).
///
/// # Safety
/// `page` is the descriptor of a taken page of a live small segment.
pub(crate) unsafe fn masked_blocks_of(page: *const Page) -> usize {
    // SAFETY: a live descriptor (the caller's word); `info` is set when a
    // heap takes the page and then only read, the mask and `carved` are
    // atomics.
    unsafe {
        super::size_class::masked_blocks(
            (*page).purged_free.get(),
            (*page).info.capacity as usize,
            (*page).info.start as usize & (super::size_class::SLOT_SIZE - 1),
            (*page).info.block_size as usize,
            (*page).carved.get() as usize,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::engine::types::{SEGMENT_SIZE, SLOT_SIZE};

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
