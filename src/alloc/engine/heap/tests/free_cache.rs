//! The heap's unit tests of the free cache and the node's shared heaps
//! (neither in hardened builds: `CACHING`, `SHARING`).

use super::{Anywhere, listed, on_fresh_heap, page_of_block};
use crate::alloc::engine::heap::registry::HeapView;
use crate::alloc::engine::heap::{Heap, Placement, cache_room, empty_page, free_to_sink};
use crate::alloc::engine::lifecycle::init_current;
use crate::alloc::engine::segment::{segment_of, sink_of};
use crate::alloc::engine::size_class::{class_of, class_size};
use crate::alloc::engine::types::{ALL_CLASSES, Page, SmallSegment, State};
use crate::sync::Ordering;
use crate::topology::NodeSet;

/// Any page serves, and so does the free cache (`Local`'s placement).
struct Cached(usize);
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
unsafe fn free_small(p: *mut u8) {
    let seg = segment_of(p).cast::<SmallSegment>();
    // SAFETY: a live small block of `seg`.
    unsafe { free_to_sink(seg, sink_of(seg, p), p) }
}

/// The blocks on the class's free cache.
///
/// # Safety
/// `heap` is this thread's heap.
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
            let pages: std::collections::HashSet<usize> = blocks.iter().map(|&b| page_of_block(b) as usize).collect();
            assert!(pages.len() >= 6, "24 blocks of four to a page");
            assert_eq!((*heap).direct[class], Heap::cache_page(heap, class), "the cache serves under Local");
            // Two blocks of different pages: the newest comes back first.
            let (x, y) = (blocks[0], blocks[3 * room - 1]);
            assert_ne!(page_of_block(x), page_of_block(y));
            let used_x = (*page_of_block(x)).used.get();
            free_small(x);
            free_small(y);
            assert_eq!(cached(heap, class), vec![y, x]);
            assert_eq!((*page_of_block(x)).used.get(), used_x, "a cached block is in use for its page");
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
            Heap::give_back_free_as(heap, true, ALL_CLASSES);
            assert!(cached(heap, class).is_empty());
            for &pg in &pages {
                assert!(!listed(heap, class, pg as *mut Page), "an emptied page goes back");
            }
        }
    });
}

#[test]
fn a_burst_of_frees_goes_to_the_pages_until_the_cache_takes_from_them() {
    on_fresh_heap(|state, heap| {
        // (A class no other test of this module uses.)
        let class = class_of(1024);
        let room = cache_room(class) as usize;
        let node = state.current_arena().node;
        let sink = |b: *mut u8| {
            let seg = segment_of(b).cast::<SmallSegment>();
            // SAFETY: a live small block.
            unsafe { sink_of(seg, b) }
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
            Heap::give_back_free_as(heap, true, ALL_CLASSES);
        }
    });
}

#[test]
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
            assert!(!listed(heap, class, page) || (*page).used.get() == 0, "its pages are empty again");
            // And it serves again at the next allocation.
            let b = alloc_via(heap, class, state, &mut Cached(node));
            assert_eq!((*heap).direct[class], Heap::cache_page(heap, class));
            free_small(b);
            Heap::give_back_free_as(heap, true, ALL_CLASSES);
        }
    });
}

#[test]
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
            assert_eq!(
                (*page).used.get(),
                (*page).carved.get() + 1,
                "cached blocks in use for their page, and the reference"
            );
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
            assert_eq!((*page).used.get(), 2, "every block back but one out, and the direct reference");
            // (Nothing left in use: the next test to adopt this heap
            // finds its pages as fresh as a new heap's.)
            free_small(b);
            Heap::give_back_free_as(heap, true, ALL_CLASSES);
        }
    });
}

/// A thread's first blocks of a class come from the node's shared heap,
/// blocks of several threads side by side in its pages, freed remotely
/// (collected by the next thread that takes a block there); past
/// `SPARSE_BLOCKS` the class gets a page of the thread's own. (Two threads
/// at once: a thread that starts after another exited adopts its heap,
/// and with it a page of the class.)
#[test]
fn a_threads_first_blocks_of_a_class_are_the_nodes_shared_heaps() {
    // (The test harness has threads: the shared heap serves.)
    let class = class_of(3000);
    let n = usize::from(crate::alloc::engine::heap::shared::SPARSE_BLOCKS);
    let both = std::sync::Arc::new(std::sync::Barrier::new(2));
    // The threads exit only once their blocks are freed: a remote free into
    // an exited thread's heap would count in the heap of another test that
    // adopted it meanwhile.
    let freed = std::sync::Arc::new(std::sync::Barrier::new(3));
    let run = move |both: std::sync::Arc<std::sync::Barrier>, freed: std::sync::Arc<std::sync::Barrier>| {
        let (tx, rx) = std::sync::mpsc::channel::<Vec<usize>>();
        let t = std::thread::spawn(move || {
            let state = crate::alloc::config::state();
            let (heap, _) = init_current(state).unwrap();
            let node = state.home_arena(0).node;
            // Both threads have made their heaps before either goes on.
            both.wait();
            // SAFETY: this thread's heap; blocks of it, written, not freed
            // until both threads hold theirs.
            let blocks = unsafe {
                if (*heap).lists[class].head.is_null() {
                    let blocks: Vec<*mut u8> =
                        (0..n + 3).map(|_| alloc_via(heap, class, state, &mut Cached(node))).collect();
                    let owners: Vec<*mut Heap> =
                        blocks.iter().map(|&b| (*page_of_block(b)).info.heap.load(Ordering::Relaxed)).collect();
                    assert!(
                        owners[..n].iter().all(|&o| o != heap && HeapView::of(o).is_shared()),
                        "the first blocks are shared"
                    );
                    assert!(owners[n..].iter().all(|&o| o == heap), "then the thread's own page serves");
                    for &b in &blocks {
                        b.write_bytes(0xa5, class_size(class));
                    }
                    blocks.iter().map(|&b| b as usize).collect()
                } else {
                    // (An adopted heap with a page of the class: nothing here to test.)
                    Vec::new()
                }
            };
            both.wait();
            tx.send(blocks).unwrap();
            freed.wait();
        });
        (t, rx)
    };
    let (ta, a) = run(both.clone(), freed.clone());
    let (tb, b) = run(both, freed.clone());
    // (A thread that failed drops its sender: this test fails, not hangs.)
    let (a, b) = (a.recv().unwrap(), b.recv().unwrap());
    for &p in a.iter().chain(&b) {
        // SAFETY: live blocks, freed once, from another thread than their
        // allocating one (remote frees, for the shared heap's too).
        unsafe { free_small(p as *mut u8) };
    }
    freed.wait();
    ta.join().unwrap();
    tb.join().unwrap();
    // (Other tests' exited threads leave heaps without pages of the class,
    // as exits give back what is free: both threads take shared blocks.)
    assert!(!a.is_empty() && !b.is_empty(), "a heap with a page of the class was adopted");
    // The two threads' shared blocks are all distinct.
    let mut all: Vec<usize> = a[..n].iter().chain(&b[..n]).copied().collect();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 2 * n, "a block handed to two threads");
}

/// The per-class counters sum to the exact counts and bytes: blocks of
/// several classes handed out (by the fast path and by
/// `alloc_on_node`), freed locally (through the free cache where it
/// serves, so that it fills and gives back), and freed by another
/// thread and collected.
#[test]
fn counters_count_every_block_and_byte_once() {
    on_fresh_heap(|state, heap| {
        let node = state.current_arena().node;
        let sizes = [1, 24, 48, 200, 1000, 3000, 20_000, 100_000, 256 * 1024];
        // SAFETY: this thread's heap; blocks of it, each freed once
        // (the remote ones by the other thread, then collected here).
        unsafe {
            let (_, c0) = HeapView::of(heap).node_and_counters();
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
            let (_, c1) = HeapView::of(heap).node_and_counters();
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
            Heap::give_back_free_as(heap, true, ALL_CLASSES);
            let (_, c2) = HeapView::of(heap).node_and_counters();
            assert_eq!(
                (c2.0 - c0.0, c2.1 - c0.1, c2.2 - c0.2, c2.3 - c0.3, c2.4 - c0.4),
                (n, n, bytes, bytes, n_remote),
                "(allocs, frees, bytes allocated, bytes freed, remote frees)"
            );
        }
    });
}

/// A page whose blocks another thread freed while its own free list was
/// not empty (so the heap put it on its pending list) keeps those blocks
/// within reach when the free cache takes its list and leaves it with
/// none: a refill after the cache runs dry takes them, not a fresh page,
/// even once the cache's source is another page. Before, the page left
/// its list as full, and its remote frees, which no longer queue it,
/// waited for a flush to hit it: rptest's pattern (batches made by one
/// thread, freed by another) held 4-9 MiB of them, and its resident
/// memory was twice what it is.
#[test]
fn a_pending_page_that_the_cache_empties_keeps_its_remote_frees_in_reach() {
    on_fresh_heap(|state, heap| {
        let node = state.current_arena().node;
        let class = class_of(4096);
        // SAFETY: this thread's heap; blocks of it, each freed once.
        unsafe {
            // A page of 16 blocks, all handed out.
            let first = alloc_via(heap, class, state, &mut Cached(node));
            let page = page_of_block(first);
            let cap = (*page).info.capacity as usize;
            let mut blocks = vec![first];
            while blocks.len() < cap {
                blocks.push(alloc_via(heap, class, state, &mut Cached(node)));
            }
            assert!(blocks.iter().all(|&b| page_of_block(b) == page), "one page served its blocks");
            // Half freed here and sent back to the page's free list; a
            // quarter freed by another thread.
            for &b in &blocks[..cap / 2] {
                free_small(b);
            }
            Heap::flush_cache(heap, class, 0, true);
            assert!(!(*page).free.is_null());
            let remote: Vec<usize> = blocks[cap / 2..cap / 2 + cap / 4].iter().map(|&b| b as usize).collect();
            let theirs = remote.clone();
            std::thread::spawn(move || {
                for b in theirs {
                    free_small(b as *mut u8);
                }
            })
            .join()
            .unwrap();
            // The next refill gathers them (the page goes pending: its
            // list is not empty) and moves the page's list into the cache.
            let mut got = vec![alloc_via(heap, class, state, &mut Cached(node))];
            assert!((*page).pending && (*page).free.is_null(), "the page is pending, its list in the cache");
            for _ in 1..cap / 2 {
                got.push(alloc_via(heap, class, state, &mut Cached(node)));
            }
            // The cache's source moves off the page (as `expire_kept` moves
            // an idle cache's, or a refill from another page): from here
            // only the class's list leads to it.
            Heap::set_cache_src(heap, class, core::ptr::null_mut());
            // The cache is dry: the remote frees come next, from the page.
            let next = alloc_via(heap, class, state, &mut Cached(node));
            assert!(
                remote.contains(&(next as usize)),
                "a refill took {:?} (page {:?}), not one of the page's remote frees",
                next,
                page_of_block(next)
            );
            got.push(next);
            for b in got.into_iter().chain(blocks[cap / 2 + cap / 4..].iter().copied()) {
                free_small(b);
            }
            Heap::give_back_free_as(heap, true, ALL_CLASSES);
        }
    });
}
