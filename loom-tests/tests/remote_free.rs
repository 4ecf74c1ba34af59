//! The remote-free protocol of the allocator, modelled with the crate's own
//! `CountedStack` and `AtomicStack` (the allocator module itself is built
//! without loom: it sits behind `GlobalAlloc`).
//!
//! A thread freeing a block it does not own pushes the block onto the page's
//! `thread_free` (a `CountedStack`); the push that finds the list empty also
//! queues the page on its heap's `remote_pages` (an `AtomicStack`, linked
//! through the page's `remote_next`). The owner takes the heap's list, reads
//! each page's link, then takes the page's blocks with their count.
//!
//! The links are pushed encoded (`push_by`), as a hardened build stores
//! them (`heap::link`: the plain build's encoding is the identity), and
//! decoded by the owner's walk.
//!
//! Checked: every freed block reaches the owner exactly once with the count
//! matching the chain; a page is never on the heap's list twice; the block
//! payloads and the page link are accessed without data races (loom cells).
#![cfg(loom)]

use std::ptr;

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;
use numaweave::sync::{AtomicStack, CountedStack, Linked};

struct Block {
    next: *mut Block,
    payload: UnsafeCell<usize>,
}

// SAFETY: `next` is the block's own link, used only while it is on a stack.
unsafe impl Linked for Block {
    unsafe fn next_ptr(node: *mut Self) -> *mut *mut Self {
        // SAFETY: the caller passes a live block.
        unsafe { ptr::addr_of_mut!((*node).next) }
    }
}

struct Page {
    thread_free: CountedStack<Block>,
    remote_next: *mut Page,
    /// Stands for `remote_next` in loom's race detector: touched wherever the
    /// real code reads or writes the link.
    link: UnsafeCell<()>,
}

// SAFETY: `remote_next` is the page's link on the heap's stack.
unsafe impl Linked for Page {
    unsafe fn next_ptr(node: *mut Self) -> *mut *mut Self {
        // SAFETY: the caller passes a live page; the write through the returned
        // pointer follows at once (inside the stack's push).
        unsafe {
            (*node).link.with_mut(|_| ());
            ptr::addr_of_mut!((*node).remote_next)
        }
    }
}

struct Heap {
    remote_pages: AtomicStack<Page>,
}

struct World {
    heap: Heap,
    pages: Vec<*mut Page>,
}
// SAFETY: the raw pointers are shared the way the allocator shares them.
unsafe impl Send for World {}
// SAFETY: as above.
unsafe impl Sync for World {}

fn new_block(v: usize) -> *mut Block {
    Box::into_raw(Box::new(Block { next: ptr::null_mut(), payload: UnsafeCell::new(v) }))
}

/// A page's link key (a hardened build's; the plain build's is the identity).
const KEY: usize = 0x5a5a_0000_0000_a5a5;

fn encode(p: *mut Block) -> *mut Block {
    (p as usize ^ KEY) as *mut Block
}

/// `free_remote` in `src/alloc/mod.rs`.
fn free_remote(w: &World, page: *mut Page, block: *mut Block) {
    // SAFETY: live page and block, handed over by the freeing thread.
    unsafe {
        if (*page).thread_free.push_by(block, |b, next| (*b).next = encode(next)) {
            w.heap.remote_pages.push(page);
        }
    }
}

/// When the owner's walk reads a page's link to the next queued page.
#[derive(Clone, Copy, PartialEq)]
enum LinkRead {
    /// Before taking the page's blocks, as the allocator does.
    BeforeTake,
    /// After: the planted bug (once the page's list is empty, a remote
    /// free queues the page again and rewrites the link being read).
    AfterTake,
}

/// `collect_remote` + `take_remote` in `src/alloc/heap.rs`: returns the
/// payloads collected, checking counts and that no page is seen twice.
fn collect(w: &World) -> Vec<usize> {
    collect_reading(w, LinkRead::BeforeTake)
}

/// [`collect`], reading each page's link at `when`.
fn collect_reading(w: &World, when: LinkRead) -> Vec<usize> {
    let mut got = Vec::new();
    let mut seen = Vec::new();
    let mut page = w.heap.remote_pages.take_all();
    // SAFETY: pages on the heap's stack are live; see the protocol above.
    unsafe {
        while !page.is_null() {
            assert!(!seen.contains(&page), "page queued twice");
            seen.push(page);
            // The link is read before the page's blocks are taken.
            let read_link = || (*page).link.with(|_| (*page).remote_next);
            let early = if when == LinkRead::BeforeTake { read_link() } else { ptr::null_mut() };
            let (mut b, n) = (*page).thread_free.take_all();
            let next = if when == LinkRead::BeforeTake { early } else { read_link() };
            assert!(!b.is_null(), "a queued page had no block");
            let mut walked = 0;
            while !b.is_null() {
                got.push((*b).payload.with(|p| *p));
                let nb = encode((*b).next);
                drop(Box::from_raw(b));
                b = nb;
                walked += 1;
            }
            assert_eq!(walked, n, "count and chain disagree");
            page = next;
        }
    }
    got
}

fn world(pages: usize) -> Arc<World> {
    let pages = (0..pages)
        .map(|_| {
            Box::into_raw(Box::new(Page {
                thread_free: CountedStack::new(),
                remote_next: ptr::null_mut(),
                link: UnsafeCell::new(()),
            }))
        })
        .collect();
    Arc::new(World { heap: Heap { remote_pages: AtomicStack::new() }, pages })
}

fn free_world(w: &World) {
    for &p in &w.pages {
        // SAFETY: every page was made by `world` and is no longer shared.
        drop(unsafe { Box::from_raw(p) });
    }
}

/// Two threads free into the same page while the owner collects.
#[test]
fn concurrent_remote_frees_reach_the_owner_once() {
    loom::model(|| {
        let w = world(1);
        let freers: Vec<_> = (0..2)
            .map(|i| {
                let w = w.clone();
                thread::spawn(move || {
                    let b = new_block(10 + i);
                    // The payload is written before the push publishes it.
                    free_remote(&w, w.pages[0], b);
                })
            })
            .collect();
        let mut got = collect(&w);
        for f in freers {
            f.join().unwrap();
        }
        got.extend(collect(&w));
        got.sort_unstable();
        assert_eq!(got, [10, 11]);
        free_world(&w);
    });
}

/// A page emptied by the owner is queued again by the next remote free,
/// while the owner may still be walking the list it was on: the link it
/// rewrites must not race with the owner's read of it.
#[test]
fn requeue_while_the_owner_walks() {
    requeue_model(LinkRead::BeforeTake);
}

/// Negative control: the same model with the owner reading a page's link
/// after taking its blocks. Loom must find the remote free that queues the
/// page again meanwhile and report the race on the link; if this test
/// stopped panicking, the model above would prove nothing.
#[test]
#[should_panic(expected = "Causality violation")]
fn planted_late_link_read_is_caught() {
    requeue_model(LinkRead::AfterTake);
}

fn requeue_model(when: LinkRead) {
    loom::model(move || {
        let w = world(2);
        // Both pages start with one remote free queued.
        free_remote(&w, w.pages[0], new_block(1));
        free_remote(&w, w.pages[1], new_block(2));
        let freer = {
            let w = w.clone();
            thread::spawn(move || {
                free_remote(&w, w.pages[1], new_block(3));
                free_remote(&w, w.pages[0], new_block(4));
            })
        };
        let mut got = collect_reading(&w, when);
        freer.join().unwrap();
        got.extend(collect(&w));
        got.sort_unstable();
        assert_eq!(got, [1, 2, 3, 4]);
        free_world(&w);
    });
}
