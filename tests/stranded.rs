//! Bytes a size class strands are counted where they are: per class
//! (`NumaAlloc::class_usage`) and per node (`NodeStats::stranded`, the
//! `stranded` column of the statistics), and so are blocks other threads
//! freed that their pages' owner has not collected (`uncollected`). Alone
//! in its process, so that no other test's blocks share the class.

use std::alloc::{GlobalAlloc, Layout};

use numaweave::NumaAlloc;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

const N: usize = 4000;
const SIZE: usize = 768;
/// What a thread's free cache of the class keeps for reuse (in use, for
/// its pages): at most 256 blocks.
const CACHED: usize = 256;

/// Class `bs`'s row on `node`.
fn class_of(node: usize, bs: u64) -> numaweave::stats::ClassUsage {
    A.class_usage(node).into_iter().find(|c| c.block_size == bs).unwrap_or_default()
}

#[test]
fn free_blocks_in_pages_in_use_are_counted_by_class_and_node() {
    let l = Layout::from_size_align(SIZE, 8).unwrap();
    std::thread::spawn(move || {
        // SAFETY: a valid layout; each block written, freed once below.
        let blocks: Vec<usize> = (0..N)
            .map(|i| unsafe {
                let p = A.alloc(l);
                assert!(!p.is_null());
                p.write_bytes(i as u8, SIZE);
                p as usize
            })
            .collect();
        // SAFETY: a block of ours, live.
        let node = unsafe { A.node_of(blocks[0] as *const u8) };
        // The class they took: the one most in use (a hardened build's
        // blocks are larger than asked, for their checks).
        let full = A.class_usage(node).into_iter().max_by_key(|c| c.in_use).unwrap();
        let bs = full.block_size;
        assert!(bs >= SIZE as u64 && full.in_use >= N as u64 * bs, "{full:?}");
        assert!(full.stranded < 64 * bs, "a page's carved rest at most: {full:?}");
        // Every other block freed: each page keeps half its blocks.
        for &p in blocks.iter().step_by(2) {
            // SAFETY: allocated above with `l`, freed once.
            unsafe { A.dealloc(p as *mut u8, l) };
        }
        let half = class_of(node, bs);
        let freed = (N / 2 - CACHED) as u64 * bs;
        assert!(half.stranded >= freed, "half the blocks stranded: {half:?}");
        assert!(half.in_use <= full.in_use - freed, "{half:?}");
        let s = A.stats();
        assert!(s.per_node[node].stranded >= half.stranded, "the node's total holds the class's");
        assert!(s.to_string().contains("stranded"), "the table shows it");
        // Another thread frees 1,000 of the rest, every other one: uncollected
        // (this thread, the pages' owner, does not allocate meanwhile), not
        // in use; and once collected, stranded, as every page keeps a
        // quarter of its blocks live. (Not the first 1,000 of the rest: the
        // pages that held them would empty when a refill or a decay of this
        // thread's heap collects them, which a slow run reaches between two
        // snapshots, and leave the class's counts.)
        let rest: Vec<usize> = blocks.iter().skip(1).step_by(2).copied().collect();
        let theirs: Vec<usize> = rest.iter().step_by(2).copied().collect();
        let ours: Vec<usize> = rest.iter().skip(1).step_by(2).copied().collect();
        assert_eq!(theirs.len(), 1000);
        std::thread::spawn(move || {
            for p in theirs {
                // SAFETY: as above; this thread frees them instead.
                unsafe { A.dealloc(p as *mut u8, l) };
            }
        })
        .join()
        .unwrap();
        let remote = class_of(node, bs);
        assert!(remote.uncollected >= 1000 * bs, "{remote:?}");
        assert!(remote.in_use + 1000 * bs <= half.in_use + 64 * bs, "{remote:?} {half:?}");
        // (The statistics allocate, and a refill of this thread's collects
        // remote frees: what it collects is stranded then, the other half
        // of each page being live.)
        let n = A.stats().per_node[node];
        assert!(n.uncollected + n.stranded >= remote.uncollected + remote.stranded, "{n:?} {remote:?}");
        // The rest freed and trimmed: no page of the class is left to strand.
        for &p in &ours {
            // SAFETY: as above.
            unsafe { A.dealloc(p as *mut u8, l) };
        }
        A.trim();
        let after = class_of(node, bs);
        assert!(after.stranded < 64 * bs && after.uncollected == 0 && after.pages <= 1, "trimmed: {after:?}");
    })
    .join()
    .unwrap();
}
