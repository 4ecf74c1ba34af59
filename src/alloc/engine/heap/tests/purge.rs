//! A purge of a partly used page's free blocks: the OS pages only free
//! blocks cover go back, link pages too; live blocks keep their memory and
//! their contents; the page hands each purged block out again, once.

use core::ptr::{self, NonNull};
use std::collections::HashSet;

use super::{Anywhere, on_fresh_heap};
use crate::alloc::engine::heap::giveback::DECOMMITS;
use crate::alloc::engine::heap::{Heap, page_span};
use crate::alloc::engine::size_class::{MASKED_BLOCKS, class_of, class_size};
use crate::alloc::engine::types::ALL_CLASSES;

/// Blocks of `size` fill a page; those `freed` picks are freed and the
/// heap gives back what it holds free, its pages' free blocks purged.
fn purge_and_serve_again(size: usize, freed: fn(usize, usize) -> bool) {
    on_fresh_heap(move |state, heap| {
        let class = class_of(size);
        let bs = class_size(class);
        let os = crate::os::page_size();
        let node = state.current_arena().node;
        // SAFETY: this thread's heap and its pages; the blocks are ours.
        unsafe {
            let mut blocks = vec![Heap::refill(heap, class, state, &mut Anywhere(node))];
            let page = (*heap).direct[class];
            let cap = (*page).info.capacity as usize;
            let start = (*page).info.start as usize;
            while blocks.len() < cap {
                let mut b = Heap::pop(heap, class);
                if b.is_null() {
                    b = Heap::refill(heap, class, state, &mut Anywhere(node));
                }
                assert_eq!((*heap).direct[class], page, "the first page serves all its blocks");
                blocks.push(b);
            }
            blocks.sort_unstable();
            for (i, &b) in blocks.iter().enumerate() {
                assert_eq!(b as usize, start + i * bs);
                ptr::write_bytes(b, 0xa5, bs);
            }
            let gone: Vec<usize> = (0..cap).filter(|&i| freed(i, cap)).collect();
            let is_gone: Vec<bool> = (0..cap).map(|i| freed(i, cap)).collect();
            // In two rounds, each purged: the second finds the first's
            // blocks masked (and counts them free).
            let (early, late) = gone.split_at(gone.len() / 2);
            DECOMMITS.with(|n| n.set(0));
            for &i in early {
                Heap::free_local(heap, page, blocks[i].cast());
            }
            Heap::give_back_free_as(heap, true, ALL_CLASSES);
            let first = DECOMMITS.with(|n| n.replace(0));
            let masked = (*page).purged_free.get();
            for &i in late {
                Heap::free_local(heap, page, blocks[i].cast());
            }
            Heap::give_back_free_as(heap, true, ALL_CLASSES);
            let second = DECOMMITS.with(|n| n.replace(0));
            assert!(first + second > 0, "{bs} B blocks: nothing given back");
            if cap > MASKED_BLOCKS {
                // (Bits an OS page: the first round's stay set.)
                assert_eq!((*page).purged_free.get() & masked, masked, "{bs} B blocks: a masked OS page came back");
            }

            // Each OS page of the blocks: resident exactly when a live block touches it.
            let span = page_span(page);
            let mut resident = vec![false; span.len() / os];
            crate::os::mem::resident_pages(NonNull::new(span.start as *mut u8).unwrap(), span.len(), &mut resident)
                .unwrap();
            for (k, &r) in resident.iter().enumerate() {
                let (lo, hi) = (span.start + k * os, span.start + (k + 1) * os);
                let live = (0..cap).any(|i| !is_gone[i] && start + i * bs < hi && start + (i + 1) * bs > lo);
                if live {
                    assert!(r, "{bs} B blocks: OS page {k}, which a live block touches, was given back");
                } else if hi > start && lo < start + cap * bs {
                    assert!(!r, "{bs} B blocks: OS page {k}, only free blocks' memory, is resident");
                }
            }
            for i in (0..cap).filter(|&i| !is_gone[i]) {
                let b = core::slice::from_raw_parts(blocks[i], bs);
                assert!(b.iter().all(|&x| x == 0xa5), "{bs} B blocks: live block {i} lost its contents");
            }

            // The freed blocks come back, each once, then the page is full.
            let want: HashSet<usize> = gone.iter().map(|&i| blocks[i] as usize).collect();
            let mut again = HashSet::new();
            for _ in 0..gone.len() {
                let mut b = Heap::pop(heap, class);
                if b.is_null() {
                    b = Heap::refill(heap, class, state, &mut Anywhere(node));
                }
                assert!(want.contains(&(b as usize)), "{bs} B blocks: {b:?} was not free");
                assert!(again.insert(b as usize), "{bs} B blocks: {b:?} handed out twice");
            }
            assert!((*page).free.is_null() && (*page).purged_free.get() == 0, "{bs} B blocks: a block left behind");
            let b = Heap::refill(heap, class, state, &mut Anywhere(node));
            let other = (*heap).direct[class];
            assert!(!b.is_null() && !want.contains(&(b as usize)) && other != page);
            // Everything freed: the heap leaves no page in use for a test
            // that adopts it.
            Heap::free_local(heap, other, b.cast());
            let live = blocks.iter().map(|&p| p as usize).filter(|p| !want.contains(p));
            for p in live.chain(again) {
                Heap::free_local(heap, page, (p as *mut u8).cast());
            }
        }
    });
}

#[test]
fn whole_page_blocks_go_back_with_their_links() {
    // 4 KiB blocks: each OS page one block (the link page too, which a
    // purge kept resident before).
    purge_and_serve_again(4096, |i, _| i % 3 != 0);
}

#[test]
fn small_blocks_go_back_where_neighbours_are_free_too() {
    // 1 KiB and 1.5 KiB blocks: an OS page goes when all the blocks that
    // touch it are free (the first half), not where a live one does.
    purge_and_serve_again(1024, |i, cap| i < cap / 2 || i % 4 == 1);
    purge_and_serve_again(1536, |i, cap| i < cap / 2 || i % 4 == 1);
    // 5 KiB blocks straddle OS pages, and the tail past the last is free.
    purge_and_serve_again(5120, |i, _| i % 2 == 0 || i < 5);
}

#[test]
fn blocks_below_a_kib_go_back_by_os_page() {
    // Robson's pattern (every other block freed, round after round)
    // leaves whole OS pages of small blocks free, which only the tail went
    // back of before. 16 B blocks, 256 an OS page: one live in 512.
    purge_and_serve_again(16, |i, _| i % 512 != 0);
    // 96 B blocks straddle OS pages; 640 B blocks, six an OS page.
    purge_and_serve_again(96, |i, cap| i < cap / 2 || i % 64 == 1);
    purge_and_serve_again(640, |i, _| i % 16 != 3);
}

/// A page's uncarved tail goes back at its first purge and not at the
/// next: carving writes below `carved` only, so the tail holds no memory
/// the kernel keeps. Before, a heap that thread after thread adopted
/// (mimalloc-bench's mleak: each thread one block, then exit) gave the
/// same tail back at each of its decays, a `madvise` and the address
/// space's lock every time. Blocks of 128 B (a page of 512, its OS pages
/// masked a bit each; the three live blocks keep the first) and of 2 KiB
/// (32: a bit a block).
#[test]
fn a_tail_given_back_is_not_given_back_again() {
    // (40 more of 128 B carve another OS page's worth; 10 more of 2 KiB
    // stay within their page of 32.)
    for (size, more) in [(128, 40), (2048, 10)] {
        on_fresh_heap(move |state, heap| {
            let class = class_of(size);
            let os = crate::os::page_size();
            let node = state.current_arena().node;
            let given = || DECOMMITS.with(|n| n.replace(0));
            // SAFETY: this thread's heap and its pages; the blocks are ours.
            unsafe {
                let take = |n: usize, blocks: &mut Vec<*mut u8>| {
                    for _ in 0..n {
                        let mut b = Heap::pop(heap, class);
                        if b.is_null() {
                            b = Heap::refill(heap, class, state, &mut Anywhere(node));
                        }
                        ptr::write_bytes(b, 0x5a, class_size(class));
                        blocks.push(b);
                    }
                };
                let mut blocks = Vec::new();
                take(3, &mut blocks);
                let page = (*heap).direct[class];
                let span = page_span(page);
                given();
                Heap::give_back_free_as(heap, true, ALL_CLASSES);
                assert!(given() >= 1, "{size} B blocks: the tail was not given back");
                // Served again: carving goes on into the tail.
                let carved = (*page).carved.get();
                take(more, &mut blocks);
                assert!((*page).carved.get() > carved, "{size} B blocks: no more was carved");
                assert!(blocks.iter().all(|&b| span.contains(&(b as usize))), "{size} B blocks: another page served");
                Heap::give_back_free_as(heap, true, ALL_CLASSES);
                assert_eq!(given(), 0, "{size} B blocks: a purge with no free block gave the tail back again");
                // What it skipped holds no memory.
                let tail = ((*page).info.start as usize + (*page).carved.get() as usize * class_size(class))
                    .next_multiple_of(os);
                if tail < span.end {
                    let mut resident = vec![false; (span.end - tail) / os];
                    crate::os::mem::resident_pages(
                        NonNull::new(tail as *mut u8).unwrap(),
                        span.end - tail,
                        &mut resident,
                    )
                    .unwrap();
                    assert!(resident.iter().all(|&r| !r), "{size} B blocks: the tail is resident");
                }
                for &b in &blocks {
                    assert!(core::slice::from_raw_parts(b, class_size(class)).iter().all(|&x| x == 0x5a));
                    Heap::free_local(heap, page, b.cast());
                }
            }
        });
    }
}
