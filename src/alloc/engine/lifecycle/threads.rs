//! A thread's life as the allocator sees it: its heap made or adopted at
//! its first allocation, and at its exit what the heap holds free given
//! back, the blocks of its pages in use kept a delay for the next thread
//! of the node, and the heap left on its arena for adoption.

use core::ptr;

use super::tick;
use crate::alloc::engine::heap::{Heap, empty_page, no_heap};
use crate::alloc::engine::size_class::CLASSES;
use crate::alloc::engine::types::{ALL_CLASSES, Decay, Due, OWNER_THREAD, State};

/// The calling thread's heap, made (or adopted) on first use, and whether it
/// was adopted (its pages may be on several nodes). `None` only when the OS
/// refuses the memory for a heap descriptor.
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) fn init_current(state: &'static State) -> Option<(*mut Heap, bool)> {
    let node = state.topology.current_node();
    let arena = state.home_arena(node);
    // Adopt a heap left by an exited thread of this node, else make one.
    let heap = arena.adopt_orphan();
    let adopted = !heap.is_null();
    let heap = if heap.is_null() {
        Heap::make(state, arena.node, OWNER_THREAD)?
    } else {
        // SAFETY: adopted (`adopt_orphan` made it the thread's): ours now.
        // Its pages come along, their remote frees collected now and what
        // is left free given back (a new thread's sizes may be none of the
        // last one's: blocks of its classes would otherwise stay resident
        // until it asks for them).
        unsafe {
            debug_assert!((*heap).is_owned() && (*heap).loan.page.is_null());
            debug_assert!((*heap).direct.iter().all(|&d| d == empty_page()), "an orphan with direct pages");
            debug_assert!(
                (0..CLASSES).all(|c| (*Heap::cache_page(heap, c)).free.is_null() && (*heap).cache_src[c].is_null()),
                "an orphan with cached blocks"
            );
            // The exited thread's blocks in pages still in use stay
            // resident: this thread most likely takes them again, and its
            // own decay gives back what it leaves free.
            Heap::give_back_free_as(heap, false, ALL_CLASSES);
            (*heap).life.set(Decay::Busy);
            (*heap).sparse = [0; CLASSES];
            // Its classes untouched by this thread so far, its decay's
            // window and its growth counted from here.
            (*heap).life.window_refills = [0; CLASSES];
            (*heap).life.decayed_at = crate::os::monotonic_ms();
            (*heap).life.mark_growth();
        }
        heap
    };
    crate::os::tls::set(heap.cast());
    // Ask for `thread_exit` at thread exit.
    state.exit_key.set(heap.cast());
    Some((heap, adopted))
}

/// Thread-exit destructor (pthread key): what the heap holds free goes
/// back (cached blocks, kept and empty pages, remote frees collected; the
/// free blocks of pages in use a delay later), and the heap, with the pages
/// that still hold blocks, waits on its node's arena for a new thread to
/// adopt it; blocks other threads free
/// into those pages meanwhile are collected by the lifecycle
/// ([`reclaim_orphans`](super::reclaim_orphans)). Allocations after this (from later
/// destructors) make or adopt a heap again, and the key brings us back for
/// it.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) extern "C" fn thread_exit(heap: *mut core::ffi::c_void) {
    let heap = heap.cast::<Heap>();
    let Some(state) = State::try_get() else { return };
    if heap.is_null() {
        return;
    }
    crate::os::tls::set(no_heap().cast());
    // SAFETY: the heap was this thread's; nobody else uses it until adopted.
    unsafe {
        Heap::end_loan(heap);
        // Free blocks of pages still in use stay resident for the next
        // thread of the node (threads that come and go would otherwise
        // fault them in again, one page at a time); they go back once they
        // waited out the delay, if no thread adopts the heap first.
        Heap::give_back_free_as(heap, false, ALL_CLASSES);
        debug_assert!((*heap).direct.iter().all(|&d| d == empty_page()) && (*heap).loan.page.is_null());
        debug_assert!(
            (0..CLASSES).all(|c| (*Heap::cache_page(heap, c)).free.is_null() && (*heap).cache_src[c].is_null()),
            "an exiting thread's heap keeps cached blocks"
        );
        let now = crate::os::monotonic_ms();
        (*heap).life.set(Decay::Kept { since: now.max(1) });
        // The thread's policy state goes with the thread.
        (*heap).policy = ptr::null();
        state.home_arena((*heap).node).park_orphan(heap);
        state.life.note_due(Due::Orphans, now + state.config.purge_delay_ms);
        // What is due goes back now (the lifecycle's tick; what this exit
        // gave back is due a delay from now, at another thread's slow path).
        tick(state, now);
    }
}
