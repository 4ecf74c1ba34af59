//! Thread life: a thread's heap made or adopted at its first allocation,
//! given up at its exit (what it holds free back to the arena, the rest
//! left for adoption), and the walk over every heap for statistics.

use core::ptr;

use super::*;

impl Heap {
    /// Points every class at the empty page, so that the next allocation of
    /// each goes through a refill (under whatever placement is in force then).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    #[unsafe(link_section = ".text.hot.numaweave")]
    pub(crate) unsafe fn clear_direct(heap: *mut Heap) {
        // SAFETY: per the contract; the pages stay on the heap's lists.
        unsafe {
            Heap::end_loan(heap);
            for class in 0..CLASSES {
                Heap::set_direct(heap, class, empty_page());
                (*heap).cache_serves[class] = false;
            }
        }
    }
}

/// The calling thread's heap, made (or adopted) on first use, and whether it
/// was adopted (its pages may be on several nodes). `None` only when the OS
/// refuses the memory for a heap descriptor.
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.hot.numaweave")]
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
            Heap::give_back_free_as(heap, false, super::decay::ALL_CLASSES);
            (*heap).life.kept_since = 0;
            (*heap).sparse = [0; CLASSES];
        }
        heap
    };
    crate::os::tls::set(heap.cast());
    // Ask for `thread_exit` at thread exit.
    state.exit_key.set(heap.cast());
    Some((heap, adopted))
}

impl Heap {
    /// A new heap on `node`'s arena, owned as `owner` says, listed for the
    /// statistics; `None` when the OS refuses the memory for its
    /// descriptor.
    #[cold]
    pub(crate) fn make(state: &State, node: usize, owner: u64) -> Option<*mut Heap> {
        let p = state.alloc_meta(core::mem::size_of::<Heap>(), core::mem::align_of::<Heap>())?;
        let h = p.as_ptr().cast::<Heap>();
        // SAFETY: fresh, suitably aligned metadata memory.
        unsafe {
            // Field by field, in place: the free caches make the heap
            // 18 KiB, more than a value on a small thread's stack should be.
            (&raw mut (*h).direct).write([empty_page(); CLASSES]);
            (&raw mut (*h).counters).write(HeapCounters::new());
            (&raw mut (*h).lists).write([PageList { head: ptr::null_mut(), tail: ptr::null_mut() }; CLASSES]);
            (&raw mut (*h).kept_empty).write([ptr::null_mut(); CLASSES]);
            (&raw mut (*h).refills).write(0);
            (&raw mut (*h).last_refill).write([0; CLASSES]);
            (&raw mut (*h).node).write(node);
            (&raw mut (*h).loan).write(Loan { page: ptr::null_mut(), class: 0, used0: 0 });
            (&raw mut (*h).next_all).write(ptr::null_mut());
            (&raw mut (*h).next_orphan).write(ptr::null_mut());
            (&raw mut (*h).owned).write(AtomicU64::new(owner));
            (&raw mut (*h).policy).write(ptr::null());
            (&raw mut (*h).pending).write(ptr::null_mut());
            (&raw mut (*h).remote_pages).write(CachePadded(AtomicStack::new()));
            (&raw mut (*h).cache_serves).write([false; CLASSES]);
            (&raw mut (*h).cache_src).write([ptr::null_mut(); CLASSES]);
            (&raw mut (*h).cache_seen).write([0; CLASSES]);
            (&raw mut (*h).cache_filled_at).write([0; CLASSES]);
            (&raw mut (*h).sparse).write([0; CLASSES]);
            (&raw mut (*h).life).write(HeapLife::new());
            // (The free caches are written when the heap takes its first
            // page of their class, `Heap::sink_for`: the metadata chunk's
            // fresh memory reads as zeroes, an empty cache of no heap.)
            let mut all = state.heaps.lock();
            (*h).next_all = *all;
            *all = h;
        }
        Some(h)
    }
}

/// Thread-exit destructor (pthread key): what the heap holds free goes
/// back (cached blocks, kept and empty pages, remote frees collected; the
/// free blocks of pages in use a delay later), and the heap, with the pages
/// that still hold blocks, waits on its node's arena for a new thread to
/// adopt it; blocks other threads free
/// into those pages meanwhile are collected by the lifecycle
/// (`lifecycle::reclaim_orphans`). Allocations after this (from later
/// destructors) make or adopt a heap again, and the key brings us back for
/// it.
#[unsafe(link_section = ".text.hot.numaweave")]
pub(crate) extern "C" fn thread_exit(heap: *mut libc::c_void) {
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
        Heap::give_back_free_as(heap, false, super::decay::ALL_CLASSES);
        debug_assert!((*heap).direct.iter().all(|&d| d == empty_page()) && (*heap).loan.page.is_null());
        let now = crate::os::monotonic_ms();
        (*heap).life.kept_since = now.max(1);
        // The thread's policy state goes with the thread.
        (*heap).policy = ptr::null();
        state.home_arena((*heap).node).park_orphan(heap);
        state.life.note_orphans_due(now + state.config.purge_delay_ms);
        // What is due goes back now (the lifecycle's tick; what this exit
        // gave back is due a delay from now, at another thread's slow path).
        super::super::lifecycle::tick(state, now);
    }
}

/// Heaps for stats: every heap ever made.
pub(crate) fn for_each_heap(state: &State, mut f: impl FnMut(&Heap)) {
    let mut h = *state.heaps.lock();
    while !h.is_null() {
        // SAFETY: heaps are never freed; `next_all` is written once, under the
        // registry lock, before the heap is published.
        unsafe {
            f(&*h);
            h = (*h).next_all;
        }
    }
}
