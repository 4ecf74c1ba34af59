//! What an arena's pages hold: the walk behind the statistics' stranded
//! bytes (free blocks a class keeps in pages still in use, where no other
//! class can take them: a size-class allocator's fragmentation) and
//! uncollected ones (blocks other threads freed, waiting for the page's
//! owner).
//!
//! The walk runs under the arena's lock, which guards the slot maps and
//! under which every page descriptor is written (`init_page`, at the
//! slots' taking) and given back (`free_page`): the fixed facts it reads
//! of a taken slot's page do not change under it. Of what the owner writes
//! it reads only `used` and `carved`, counts any thread may read
//! (`OwnerCount`), and the count of its remote frees (an atomic word); a
//! heap may take or free blocks meanwhile, so a figure is one moment's, as
//! a statistic is.

use core::ptr;

use super::Arena;
use crate::alloc::engine::segment::masked_blocks_of;
use crate::alloc::engine::size_class::{CLASSES, SLOTS, class_size};
use crate::alloc::engine::types::{Page, SegmentKind};

/// One page as the walk sees it, in blocks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PageUsage {
    pub(crate) class: usize,
    pub(crate) block_size: u64,
    pub(crate) capacity: u64,
    /// Handed out or in a thread's free cache.
    pub(crate) in_use: u64,
    /// Freed by other threads, not yet collected by the owner.
    pub(crate) uncollected: u64,
    /// Carved (ever prepared) and free.
    pub(crate) stranded: u64,
}

impl Arena {
    /// Calls `each` for every page of this arena's small segments.
    pub(crate) fn page_usage(&self, mut each: impl FnMut(PageUsage)) {
        let g = self.inner.lock();
        let mut seg = g.segments;
        // SAFETY: listed segments are live under the lock we hold, and
        // their slot maps and the descriptors of their taken slots change
        // only under it (see the module docs); `used`, `carved` and the
        // remote list's word are atomics.
        unsafe {
            while !seg.is_null() {
                if (*seg).seg.kind == SegmentKind::Small {
                    let free = (*seg).free_slots;
                    // (Slot 0 is the header.)
                    for s in 1..SLOTS {
                        if free & (1 << s) != 0 || usize::from((*seg).slot_page[s]) != s {
                            continue;
                        }
                        // (A raw pointer, no reference: the owner writes
                        // the descriptor's other fields meanwhile.)
                        let page = ptr::addr_of!((*seg).pages).cast::<Page>().add(s);
                        let class = usize::from((*page).info.class);
                        debug_assert!(class < CLASSES && usize::from((*page).info.first_slot) == s);
                        let carved = u64::from((*page).carved.get());
                        // (`used` counts one more while the page is its
                        // heap's current page for the class, and remote
                        // frees until they are collected.)
                        let used = u64::from((*page).used.get()).min(carved);
                        let pending = ((*page).remote.thread_free.len() as u64).min(used);
                        each(PageUsage {
                            class,
                            block_size: u64::from((*page).info.block_size),
                            capacity: u64::from((*page).info.capacity),
                            in_use: used - pending,
                            uncollected: pending,
                            // (Blocks a purge masked hold no memory.)
                            stranded: (carved - used).saturating_sub(masked_blocks_of(page) as u64),
                        });
                    }
                }
                seg = (*seg).seg.next;
            }
        }
    }
}

/// One size class's pages on a node ([`NumaAlloc::class_usage`](crate::NumaAlloc::class_usage)):
/// what a size-class allocator strands. The figures are one moment's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClassUsage {
    /// The class's block size in bytes.
    pub block_size: u64,
    /// Pages of the class (each of one to four 64 KiB slots).
    pub pages: u64,
    /// The bytes those pages' blocks span.
    pub bytes: u64,
    /// Bytes of their blocks in use: handed out, or in a thread's free
    /// cache (kept for reuse).
    pub in_use: u64,
    /// Bytes of blocks other threads freed into those pages that the
    /// pages' owners have not collected yet (they are collected when a
    /// page runs dry, or when an exited thread's heap is adopted or
    /// reclaimed).
    pub uncollected: u64,
    /// Bytes of free blocks in those pages that were ever handed out or
    /// prepared (carved): memory only this class can use again until the
    /// page empties. Resident, but for the parts of it purged once the
    /// class went quiet (every OS page that only free blocks cover; a
    /// block whose link page went counts no more).
    /// The pages' never-carved rest counts in neither.
    pub stranded: u64,
}

impl Arena {
    /// The size classes' pages of this arena, indexed by class, summed
    /// from [`page_usage`](Self::page_usage) into `u` (one moment's
    /// figures; the caller's array, so that a refill that publishes them
    /// keeps 4 KiB off its thread's stack).
    pub(crate) fn class_usage_into(&self, u: &mut [ClassUsage; CLASSES]) {
        for (c, x) in u.iter_mut().enumerate() {
            *x = ClassUsage { block_size: class_size(c) as u64, ..ClassUsage::default() };
        }
        self.page_usage(|p| {
            let (x, bs) = (&mut u[p.class % CLASSES], p.block_size);
            x.pages += 1;
            x.bytes += p.capacity * bs;
            x.in_use += p.in_use * bs;
            x.uncollected += p.uncollected * bs;
            x.stranded += p.stranded * bs;
        });
    }
}
