//! The memory lifecycle, process-wide: what is waiting to go back to the OS,
//! and the tick that sends it; the heaps of exited threads, reclaimed; trim.
//!
//! There is no thread or timer of the allocator's own (one would make every
//! single-threaded program multi-threaded: glibc's `__libc_single_threaded`
//! false, stdio locking, `fork()` no longer safe in a signal handler). The
//! work is done by the threads that allocate, on their slow paths, when it
//! is due: [`Lifecycle::due`] holds the earliest time an arena has memory
//! to purge, and a heap's refill looks at it (`heap/decay.rs`). A thread
//! that keeps allocating reaches a refill often; one that has gone quiet
//! (a few calls a second, each served by the fast path) is brought back to
//! its refills while something is due, at no cost to the fast path: its
//! direct slots are emptied, and each refill serves one block without
//! filling the slot again until nothing is due (see `Heap::heartbeat`).
//!
//! An exited thread's heap waits on its arena for a new thread to adopt
//! it; blocks of its pages that other threads free meanwhile go onto the
//! pages' remote lists, which nobody would collect: the first such free of
//! a page flags [`Lifecycle::note_orphan_work`], and the next tick claims
//! each waiting heap with remote frees, collects them and gives its empty
//! pages back ([`reclaim_orphans`]). The free blocks of its pages still in
//! use stay resident for a delay (the next thread of the node most likely
//! adopts the heap and takes them again); a tick after that purges them if
//! no thread did ([`Lifecycle::note_orphans_due`]).

use super::heap::Heap;
use super::state::State;
use crate::sync::{AtomicBool, AtomicU64, Ordering};

/// The process-wide part of the lifecycle, in [`State`].
pub(crate) struct Lifecycle {
    /// The earliest time (ms, `os::monotonic_ms`) some arena has memory due
    /// to go back to the OS; 0: none.
    due: AtomicU64,
    /// Some exited thread's heap has remote frees waiting to be collected.
    orphan_work: AtomicBool,
    /// The earliest time (ms) an exited thread's heap has kept its free
    /// blocks for a delay (`HeapLife::kept_since`); 0: none.
    orphans_due: AtomicU64,
    /// Bumped by [`trim`](crate::NumaAlloc::trim): a live heap that sees it
    /// changed at its next slow path gives back what it holds free.
    trim_epoch: AtomicU64,
    /// Held by the one thread that ticks at a time (the others go on).
    ticking: AtomicBool,
    /// When (ms) exited threads' heaps were last reclaimed: at most once a
    /// clock tick (4 ms), however many frees into them ask for it.
    reclaimed_at: AtomicU64,
}

impl Lifecycle {
    pub(crate) const fn new() -> Lifecycle {
        Lifecycle {
            due: AtomicU64::new(0),
            orphan_work: AtomicBool::new(false),
            orphans_due: AtomicU64::new(0),
            trim_epoch: AtomicU64::new(0),
            ticking: AtomicBool::new(false),
            reclaimed_at: AtomicU64::new(0),
        }
    }

    /// An arena has memory due at `at` (ms; 0: nothing).
    pub(crate) fn note_due(&self, at: u64) {
        if at == 0 {
            return;
        }
        let mut cur = self.due.load(Ordering::Relaxed);
        while cur == 0 || at < cur {
            match self.due.compare_exchange_weak(cur, at, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return,
                Err(c) => cur = c,
            }
        }
    }

    /// An exited thread's heap keeps free blocks until `at` (ms).
    pub(crate) fn note_orphans_due(&self, at: u64) {
        let mut cur = self.orphans_due.load(Ordering::Relaxed);
        while cur == 0 || at < cur {
            match self.orphans_due.compare_exchange_weak(cur, at, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return,
                Err(c) => cur = c,
            }
        }
    }

    /// An exited thread's heap got a remote free to collect.
    pub(crate) fn note_orphan_work(&self) {
        if !self.orphan_work.load(Ordering::Relaxed) {
            self.orphan_work.store(true, Ordering::Relaxed);
        }
    }

    /// Whether anything waits for a tick: memory due to be purged (now or
    /// later), or exited threads' remote frees. A heap stays in reach of its
    /// refills while this holds.
    #[inline]
    pub(crate) fn pending(&self) -> bool {
        self.due.load(Ordering::Relaxed) != 0
            || self.orphan_work.load(Ordering::Relaxed)
            || self.orphans_due.load(Ordering::Relaxed) != 0
    }

    /// The trim epoch a heap compares with the one it last saw.
    #[inline]
    pub(crate) fn trim_epoch(&self) -> u64 {
        self.trim_epoch.load(Ordering::Relaxed)
    }

    /// Asks every live heap to give back what it holds free at its next
    /// slow path (its owner alone may touch it).
    pub(crate) fn request_trim(&self) {
        self.trim_epoch.fetch_add(1, Ordering::Relaxed);
    }
}

/// Does what is due at `now` (ms): exited threads' heaps reclaimed if they
/// got remote frees, every arena's memory that waited out its delay
/// purged. One thread at a time; a thread that finds another ticking goes
/// on (the work is not its own).
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.hot.numaweave")]
pub(crate) fn tick(state: &State, now: u64) {
    let life = &state.life;
    let due = life.due.load(Ordering::Relaxed);
    let kept = life.orphans_due.load(Ordering::Relaxed);
    let kept = kept != 0 && now >= kept;
    let orphans = life.orphan_work.load(Ordering::Relaxed) && life.reclaimed_at.load(Ordering::Relaxed) != now;
    if !(orphans || kept || (due != 0 && now >= due)) {
        return;
    }
    if life.ticking.swap(true, Ordering::Acquire) {
        return;
    }
    if orphans || kept {
        life.reclaimed_at.store(now, Ordering::Relaxed);
        life.orphan_work.store(false, Ordering::Relaxed);
        if kept {
            life.orphans_due.store(0, Ordering::Relaxed);
        }
        reclaim_orphans(state, now, kept);
    }
    if life.due.load(Ordering::Relaxed) != 0 && now >= life.due.load(Ordering::Relaxed) {
        // Each arena notes its next due time again as it purges (and so
        // does any arena that frees meanwhile): the earliest stays.
        life.due.store(0, Ordering::Relaxed);
        for n in state.nodes().iter() {
            if let Some(a) = state.arena(n) {
                a.tick_at(state, now);
            }
        }
    }
    life.ticking.store(false, Ordering::Release);
}

/// Collects the remote frees of exited threads' heaps and gives their
/// empty pages back. Each heap with remote frees waiting is claimed on its
/// arena's list (so that no thread adopts it meanwhile: one that starts now
/// adopts another or makes one), collected outside the lock, and let go.
pub(crate) fn reclaim_orphans(state: &State, now: u64, kept: bool) {
    let delay = state.config.purge_delay_ms;
    // Heaps whose kept blocks waited out the delay by now.
    let kept_due = kept.then(|| now.saturating_sub(delay).max(1));
    for n in state.nodes().iter() {
        let Some(arena) = state.arena(n) else { continue };
        let mut claimed = [core::ptr::null_mut::<Heap>(); RECLAIM_BATCH];
        loop {
            let k = arena.claim_orphans(&mut claimed, kept_due);
            for &h in &claimed[..k] {
                // SAFETY: a claimed heap is owned by nobody else and reached
                // by other threads only through its pages' remote lists
                // (atomic) until released.
                unsafe {
                    Heap::collect_orphan(h, now, delay);
                    // Kept blocks not yet due: a later tick's.
                    let since = (*h).life.kept_since;
                    if since != 0 {
                        state.life.note_orphans_due(since + delay);
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
        // The same for its heap of cold blocks.
        for lock in [&arena.shared, &arena.cold] {
            if let Some(g) = lock.try_lock()
                && !g.0.is_null()
            {
                // SAFETY: the node's shared (or cold) heap, under its lock.
                unsafe { Heap::give_back_free(g.0) };
            }
        }
    }
}

/// Orphans claimed at once by [`reclaim_orphans`] (a stack array).
const RECLAIM_BATCH: usize = 16;

/// Gives back everything free: the calling thread's heap, exited threads'
/// heaps, every arena's free pages, empty segments and cached mappings;
/// other live heaps at their next slow path.
pub(crate) fn trim(state: &State) {
    let h = super::heap::current();
    if !h.is_null() {
        // SAFETY: the calling thread's heap.
        unsafe { Heap::trim(h) };
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
                    unsafe { Heap::trim(g.0) };
                }
            }
        }
    }
    for n in state.nodes().iter() {
        if let Some(a) = state.arena(n) {
            a.purge_now();
        }
    }
}
