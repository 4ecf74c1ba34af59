//! The memory lifecycle, in one place: what is waiting to go back to the
//! OS and the tick that sends it (here), a heap's decay (`decay.rs`), a
//! thread's start and exit (`threads.rs`); exited threads' heaps reclaimed;
//! trim. Its state is in `types.rs`: the process's [`Lifecycle`], each
//! heap's [`HeapLife`](crate::alloc::engine::types::HeapLife) and
//! [`Decay`].
//!
//! There is no thread or timer of the allocator's own (one would make every
//! single-threaded program multi-threaded: glibc's `__libc_single_threaded`
//! false, stdio locking, `fork()` no longer safe in a signal handler). The
//! work is done by the threads that allocate, on their slow paths, when it
//! is due: `Lifecycle::due` holds the earliest time an arena has memory
//! to purge, and a heap's refill looks at it ([`decay::refill`]). A thread
//! that keeps allocating reaches a refill often; one that has gone quiet
//! (a few calls a second, each served by the fast path) is brought back to
//! its refills while something is due, at no cost to the fast path: its
//! direct slots are emptied, and each refill serves one block without
//! filling the slot again until nothing is due.
//!
//! An exited thread's heap waits on its arena for a new thread to adopt
//! it; blocks of its pages that other threads free meanwhile go onto the
//! pages' remote lists, which nobody would collect: the first such free of
//! a page flags [`Lifecycle::note_orphan_work`] (and arms the freeing
//! thread's heap, so that its next allocation ticks), and the next tick
//! claims each waiting heap with remote frees, collects them and gives its
//! empty pages back ([`reclaim_orphans`]). The free blocks of its pages
//! still in use stay resident for a delay ([`Decay::Kept`]: the next
//! thread of the node most likely adopts the heap and takes them again); a
//! tick after that purges them if no thread did ([`Decay::Parked`]).
//!
//! One thread at a time does the lifecycle's work, under
//! `Lifecycle::work` (a spin lock in the lock table, held across `fork()`):
//! a tick that finds it held goes on (the work is not its own), a trim
//! waits for it.

mod decay;
pub mod published;
mod threads;

pub(crate) use decay::{refill, trim_heap};
pub(crate) use threads::{init_current, thread_exit};

use crate::alloc::engine::heap::{self, Heap, empty_page};
use crate::alloc::engine::size_class::CLASSES;
use crate::alloc::engine::types::{ALL_CLASSES, Decay, Due, Lifecycle, OWNER_RECLAIM, State};
use crate::sync::{AtomicU64, Ordering};

/// Does what is due at `now` (ms): exited threads' heaps reclaimed if they
/// got remote frees, every arena's memory that waited out its delay
/// purged. One thread at a time; a thread that finds another doing the
/// lifecycle's work goes on (the work is not its own).
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) fn tick(state: &State, now: u64) {
    let life: &Lifecycle = &state.life;
    let due = life.due.load(Ordering::Relaxed);
    let kept = life.orphans_due.load(Ordering::Relaxed);
    let kept = kept != 0 && now >= kept;
    let orphans = life.orphan_work.load(Ordering::Relaxed);
    if !(orphans || kept || (due != 0 && now >= due)) {
        return;
    }
    let Some(mut work) = life.work.try_lock() else { return };
    let orphans = orphans && work.reclaimed_at != now;
    if orphans || kept {
        work.reclaimed_at = now;
        life.orphan_work.store(false, Ordering::Relaxed);
        if kept {
            life.orphans_due.store(0, Ordering::Relaxed);
        }
        reclaim_orphans(state, now, kept);
    }
    let due = life.due.load(Ordering::Relaxed);
    if due != 0 && now >= due {
        // Each arena notes its next due time again as it purges (and so
        // does any arena that frees meanwhile): the earliest stays.
        life.due.store(0, Ordering::Relaxed);
        for n in state.nodes().iter() {
            if let Some(a) = state.arena(n) {
                a.tick_at(state, now);
                debug_assert!(
                    {
                        let at = a.inner.lock().purge_at;
                        at == 0 || at > now || state.config.purge_delay_ms == 0
                    },
                    "a tick left memory of node {n} due at or before its time"
                );
            }
        }
    }
}

/// The heartbeat of allocations the per-CPU caches serve while work waits
/// (`Lifecycle::pending`: a loop the caches serve may never refill, and a
/// CPU's stack is no thread's to empty): every 8th of a thread's reads the
/// coarse clock (through the vDSO), and one that finds it moved on since
/// the thread's last look ticks and has the thread's heap, if it has one,
/// look and decay. The count and the time are the thread's own, in one
/// `fs:`-relative word (`os::tls::swap_beat`: the time above 3 bits of
/// count).
///
/// # Safety
/// The calling thread is between operations on its heap, if it has one
/// (an allocation the caches just served, not one of its heap's).
#[cold]
#[inline(never)]
pub(crate) unsafe fn cpu_beat(state: &State) {
    let w = crate::os::tls::swap_beat(0);
    if w & 7 != 7 {
        crate::os::tls::swap_beat(w + 1);
        return;
    }
    let now = crate::os::monotonic_ms();
    crate::os::tls::swap_beat(now << 3);
    if w >> 3 == now {
        return;
    }
    let h = heap::current();
    if h.is_null() {
        tick(state, now);
    } else {
        // SAFETY: the calling thread's heap, between operations on it (the
        // caller's word).
        unsafe { decay::look(h, state) };
    }
}

/// A per-CPU cache's refill (`heap/cpu.rs`), with the heartbeat a heap's
/// refill beats: threads the caches serve have no heap, and memory due to
/// go back must still go back while they allocate.
///
/// # Safety
/// `heap::cpu::serves(class)`.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) unsafe fn cpu_refill(state: &State, class: usize) -> *mut u8 {
    tick(state, crate::os::monotonic_ms());
    published::beat(state);
    // SAFETY: a class the caches serve (the caller's word).
    let p = unsafe { heap::cpu::refill(state, class) };
    if !p.is_null() {
        return p;
    }
    // Out of memory: what the caches and their homes hold free may make a
    // page (fall back, do not starve).
    cpu_reclaim(state);
    // SAFETY: as above.
    unsafe { heap::cpu::refill(state, class) }
}

/// Every per-CPU cache home heap's free memory back (blocks of pages in
/// use purged), each home under its lock: a trim's and `cpu_reclaim`'s.
fn purge_homes() {
    for lock in heap::cpu::homes() {
        let g = lock.lock();
        if !g.0.is_null() {
            // SAFETY: a CPU's home heap, under its lock.
            unsafe { Heap::give_back_free_as(g.0, true, ALL_CLASSES) };
        }
    }
}

/// What the per-CPU caches hold, and what their home heaps hold free, back
/// to the pages and arenas now (the rows drained, the homes' free blocks
/// purged): before a mapping or a refill the OS refused is asked again.
/// Takes the lifecycle's work lock (the drain's, held across fork). A
/// thread that waited for the lock while another reclaimed, a reclaim
/// begun after the waiter failed, takes it as its own: threads failing at
/// once under memory pressure (each a drain of every CPU's row, a fence
/// per row) reclaim once, not once each in turn.
pub(crate) fn cpu_reclaim(state: &State) {
    /// Reclaims begun (counted under the lock, before their work): one
    /// begun since a thread's read began after its failure, and is done
    /// once the thread holds the lock. (A count of reclaims finished
    /// would also count one begun before the failure, whose drain may
    /// have passed rows refilled since.)
    static RECLAIMS: AtomicU64 = AtomicU64::new(0);
    if heap::cpu::get().is_none() {
        return;
    }
    // A read-modify-write, which reads the count's latest value: a plain
    // load might read one from before a reclaim that began earlier.
    let seen = RECLAIMS.fetch_add(0, Ordering::Relaxed);
    let _work = state.life.work.lock();
    // (The lock orders this load after the other's increment.)
    if RECLAIMS.load(Ordering::Relaxed) != seen {
        return;
    }
    RECLAIMS.fetch_add(1, Ordering::Relaxed);
    heap::cpu::drain();
    purge_homes();
}

/// Collects the remote frees of exited threads' heaps and gives their
/// empty pages back; with `kept`, the free blocks the heaps kept since
/// their threads exited are purged once they waited out the delay. Each
/// heap with work waiting is claimed on its arena's list (so that no
/// thread adopts it meanwhile: one that starts now adopts another or makes
/// one), collected outside the lock, and let go. The caller holds
/// `Lifecycle::work`.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) fn reclaim_orphans(state: &State, now: u64, kept: bool) {
    let delay = state.config.purge_delay_ms;
    // Heaps whose kept blocks waited out the delay by now.
    let kept_due = kept.then(|| now.saturating_sub(delay).max(1));
    for n in state.nodes().iter() {
        let Some(arena) = state.arena(n) else { continue };
        let mut claimed = [core::ptr::null_mut::<Heap>(); RECLAIM_BATCH];
        loop {
            let (k, passed_over) = arena.claim_orphans(&mut claimed, kept_due);
            // A heap keeping its blocks, not due yet: noted again (the
            // tick that found orphans due cleared the time).
            if passed_over != 0 {
                state.life.note_due(Due::Orphans, passed_over + delay);
            }
            for &h in &claimed[..k] {
                // SAFETY: a claimed heap is owned by nobody else and reached
                // by other threads only through its pages' remote lists
                // (atomic) until released.
                unsafe {
                    collect_orphan(h, now, delay);
                    // Kept blocks not yet due: a later tick's.
                    let since = (*h).life.decay.kept_since();
                    if since != 0 {
                        state.life.note_due(Due::Orphans, since + delay);
                    }
                }
                arena.release_orphan(h);
            }
            if k < RECLAIM_BATCH {
                break;
            }
        }
        // The node's shared heap: every free of its blocks is a remote one,
        // collected when a thread next takes a block there, or here (if no
        // thread holds it now: then that thread collects).
        // The same for its heap of cold blocks. With per-CPU caches the
        // shared heap is their store, taken from at every refill: a tick
        // collects its remote frees and gives its empty pages back (purged
        // after the delay) but purges none of its free blocks; a trim does.
        for lock in [&arena.shared, &arena.cold] {
            if let Some(g) = lock.try_lock()
                && !g.0.is_null()
            {
                // SAFETY: the node's shared (or cold) heap, under its lock.
                unsafe { Heap::give_back_free_as(g.0, true, ALL_CLASSES) };
            }
        }
    }
    // The per-CPU caches' home heaps (`heap/cpu.rs`) the same way (their
    // remote frees collected, their empty pages back to the arenas, purged
    // after the delay), but that this purges none of the free blocks of
    // their pages in use: they are the caches' store (a trim's
    // `purge_homes` does, taking each lock). Their flushes noted this look
    // a delay after each (`free.rs`).
    for lock in heap::cpu::homes() {
        if let Some(g) = lock.try_lock()
            && !g.0.is_null()
        {
            // SAFETY: a CPU's home heap, under its lock.
            unsafe { Heap::give_back_free_as(g.0, false, ALL_CLASSES) };
        }
    }
}

/// Orphans claimed at once by [`reclaim_orphans`] (a stack array).
const RECLAIM_BATCH: usize = 16;

/// An exited thread's heap, claimed by the caller: the remote frees of its
/// pages collected, its empty pages given back, and its kept blocks purged
/// once they waited out `delay` (ms) by `now`.
///
/// # Safety
/// `heap` is an exited thread's heap that the caller claimed (no other
/// thread adopts or collects it meanwhile).
unsafe fn collect_orphan(heap: *mut Heap, now: u64, delay: u64) {
    // SAFETY: the caller claimed `heap`, an exited thread's (its word): no other thread
    // adopts or collects it until let go, so it is ours, as `give_back_free_as` asks.
    unsafe {
        debug_assert_eq!((*heap).owned.load(Ordering::Relaxed), OWNER_RECLAIM);
        debug_assert!((*heap).direct.iter().all(|&d| d == empty_page()), "an orphan with direct pages");
        let decay = (*heap).life.decay;
        debug_assert!(!decay.live(), "a reclaimed heap in a live state: {decay:?}");
        let kept = decay.kept_since();
        let purge = kept == 0 || now.saturating_sub(kept) >= delay;
        Heap::give_back_free_as(heap, purge, ALL_CLASSES);
        if purge && kept != 0 {
            (*heap).life.set(Decay::Parked);
        }
        debug_assert!(
            (0..CLASSES).all(|c| {
                let mut p = (*heap).lists[c].head;
                while !p.is_null() && (*p).used.get() > 0 {
                    p = (*p).next;
                }
                p.is_null() && (*heap).kept_empty[c].is_null()
            }),
            "a reclaimed orphan keeps an empty page"
        );
    }
}

/// Gives back everything free: the calling thread's heap, exited threads'
/// heaps, every arena's free pages, empty segments and cached mappings;
/// other live heaps at their next slow path. Waits for a tick under way.
pub(crate) fn trim(state: &State) {
    let _work = state.life.work.lock();
    // The blocks the per-CPU caches hold go back to their pages first (under
    // the work lock, which fork holds: no row is left closed in a child),
    // so that the caller's heap collects those of its own pages.
    heap::cpu::drain();
    let h = heap::current();
    if !h.is_null() {
        // SAFETY: the calling thread's heap.
        unsafe { trim_heap(h) };
    }
    state.life.request_trim();
    state.life.orphan_work.store(false, Ordering::Relaxed);
    state.life.orphans_due.store(0, Ordering::Relaxed);
    // Every kept block is due now: a trim gives back everything free.
    reclaim_orphans(state, u64::MAX, true);
    for n in state.nodes().iter() {
        if let Some(a) = state.arena(n) {
            for lock in [&a.shared, &a.cold] {
                let g = lock.lock();
                if !g.0.is_null() {
                    // SAFETY: the node's shared (or cold) heap, under its lock.
                    unsafe { Heap::give_back_free_as(g.0, true, ALL_CLASSES) };
                }
            }
        }
    }
    purge_homes();
    for n in state.nodes().iter() {
        if let Some(a) = state.arena(n) {
            a.purge_now();
        }
    }
    published::publish(state, crate::os::monotonic_ms());
}
