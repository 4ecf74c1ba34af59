//! The heap's unit tests: the free cache, counters, loans, kept pages.

use core::ptr;

use super::lists::IDLE_REFILLS;
use super::registry::HeapView;
use super::{EXPIRE_EVERY, Heap, Placement, link};
use crate::alloc::engine::lifecycle::init_current;
use crate::alloc::engine::segment::{page_of, segment_of};
use crate::alloc::engine::size_class::{CLASSES, class_of, class_size};
use crate::alloc::engine::types::{ALL_CLASSES, Block, Page, State};
use crate::topology::NodeSet;

// The free cache and the shared heaps, which hardened builds do not use.
#[cfg(not(feature = "hardened"))]
mod free_cache;
// Purges, which hardened builds do not make.
#[cfg(not(feature = "hardened"))]
mod purge;

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
            assert_eq!((*page).used.get() as usize, cap + 1, "every block, and the direct slot's reference");
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
            if crate::hardened::HARDENED {
                page.info.key = crate::hardened::page_key(ptr::addr_of!(page).cast());
            }
            b[0].write(Block { next: link(&mut page, b[1]) });
            b[1].write(Block { next: link(&mut page, b[2]) });
            b[2].write(Block { next: link(&mut page, ptr::null_mut()) });
            page.free = b[0];
            let before = HeapView::of(heap).node_and_counters().1;
            Heap::lend(heap, class, &mut page);
            assert_eq!(Heap::pop(heap, class), b[0].cast());
            assert_eq!(Heap::pop(heap, class), b[1].cast());
            Heap::end_loan(heap);
            assert!(Heap::pop(heap, class).is_null(), "the slot is empty again");
            assert_eq!(HeapView::of(heap).node_and_counters().1, before, "lent blocks are not the heap's");
            assert_eq!(page.used.get(), 2);
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
            assert_eq!((*page).used.get(), 2, "one block and the direct slot's reference");
            for _ in 0..3 {
                Heap::free_local(heap, page, a.cast());
                assert_eq!((*page).used.get(), 1, "emptied by the free, but for the slot's reference");
                assert_eq!((*heap).direct[class], page);
                assert!((*heap).kept_empty[class].is_null(), "a direct page is not kept");
                assert_eq!(Heap::pop(heap, class), a, "the pair loop stays on the fast path");
            }
            Heap::free_local(heap, page, a.cast());
            // The slot lets go: the page empties now, and is kept.
            Heap::clear_direct(heap);
            assert_eq!((*page).used.get(), 0);
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
            assert_eq!((*third).used.get(), 5, "full, and the direct page");
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
