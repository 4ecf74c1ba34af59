//! The heap's unit tests: the free cache, counters, loans, kept pages.

use core::ptr;

use super::pages::IDLE_REFILLS;
use super::{EXPIRE_EVERY, Heap, Placement, link};
#[cfg(not(feature = "hardened"))]
use super::{cache_room, empty_page, free_to_sink};
use crate::alloc::core::lifecycle::init_current;
#[cfg(not(feature = "hardened"))]
use crate::alloc::core::segment::sink_of;
use crate::alloc::core::segment::{page_of, segment_of};
use crate::alloc::core::size_class::{CLASSES, class_of, class_size};
#[cfg(not(feature = "hardened"))]
use crate::alloc::core::types::SmallSegment;
use crate::alloc::core::types::{ALL_CLASSES, Block, Page, State};
#[cfg(not(feature = "hardened"))]
use crate::sync::Ordering;
use crate::topology::NodeSet;

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
    let seg = segment_of(p).cast::<SmallSegment>();
    // SAFETY: a live small block of `seg`.
    unsafe { free_to_sink(seg, sink_of(seg, p), p) }
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
            let pages: std::collections::HashSet<usize> = blocks.iter().map(|&b| page_of_block(b) as usize).collect();
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
            Heap::give_back_free_as(heap, true, ALL_CLASSES);
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
            Heap::give_back_free_as(heap, true, ALL_CLASSES);
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
            Heap::give_back_free_as(heap, true, ALL_CLASSES);
        }
    });
}

/// A heap of its own on a fresh thread (the test harness's threads may
/// have one already, made by other tests of this binary).
fn on_fresh_heap(f: impl FnOnce(&'static State, *mut Heap) + Send + 'static) {
    std::thread::spawn(move || {
        let state = crate::alloc::config::state();
        let (heap, _) = init_current(state).unwrap();
        // Every class past its first blocks from the node's shared heap
        // (`shared.rs`, tested on its own below), and no lifecycle arming
        // (`decay.rs`): these tests look at the heap's own pages and slots.
        // SAFETY: this thread's heap.
        unsafe {
            (*heap).sparse = [super::shared::SPARSE_BLOCKS; CLASSES];
            (*heap).life.steady = true;
        }
        f(state, heap);
    })
    .join()
    .unwrap();
}

/// A thread's first blocks of a class come from the node's shared heap,
/// blocks of several threads side by side in its pages, freed remotely
/// (collected by the next thread that takes a block there); past
/// `SPARSE_BLOCKS` the class gets a page of the thread's own. (Two threads
/// at once: a thread that starts after another exited adopts its heap,
/// and with it a page of the class.)
#[test]
#[cfg(not(feature = "hardened"))]
fn a_threads_first_blocks_of_a_class_are_the_nodes_shared_heaps() {
    // (The test harness has threads: the shared heap serves.)
    let class = class_of(3000);
    let n = usize::from(super::shared::SPARSE_BLOCKS);
    let both = std::sync::Arc::new(std::sync::Barrier::new(2));
    let run = move |both: std::sync::Arc<std::sync::Barrier>| {
        std::thread::spawn(move || {
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
                    assert!(owners[..n].iter().all(|&o| o != heap && (*o).is_shared()), "the first blocks are shared");
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
            blocks
        })
    };
    let (a, b) = (run(both.clone()), run(both));
    let (a, b) = (a.join().unwrap(), b.join().unwrap());
    // (Other tests' exited threads leave heaps without pages of the class,
    // as exits give back what is free: both threads take shared blocks.)
    assert!(!a.is_empty() && !b.is_empty(), "a heap with a page of the class was adopted");
    // The two threads' shared blocks are all distinct.
    let mut all: Vec<usize> = a[..n].iter().chain(&b[..n]).copied().collect();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 2 * n, "a block handed to two threads");
    for p in a.into_iter().chain(b) {
        // SAFETY: live blocks, freed once, from another thread than their
        // allocating one (remote frees, for the shared heap's too).
        unsafe { free_small(p as *mut u8) };
    }
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
            Heap::give_back_free_as(heap, true, ALL_CLASSES);
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
    unsafe { page_of(segment_of(b).cast(), b) }
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
            Heap::give_back_free_as(heap, true, ALL_CLASSES);
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
            Heap::give_back_free_as(heap, true, ALL_CLASSES);
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
