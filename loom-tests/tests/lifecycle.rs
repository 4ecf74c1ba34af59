//! The memory lifecycle's lock (`alloc/engine/types.rs`, `Lifecycle::work`)
//! against a tick, a trim and a `fork()`, with the crate's `SpinLock`: a
//! tick tries the lock and goes on if another thread holds it, a trim waits
//! for it, and the fork handlers take it (`lock_raw`) before the fork and
//! release it after, in the parent and in the child. The allocator itself
//! is not built under loom; the protocol is modelled with its lock.
//!
//! Checked: a tick and a trim never do the lifecycle's work at once (a
//! loom cell both write: a data race loom reports); a fork never happens
//! in the middle of that work (the child would inherit it half done); and
//! the child can always do the work itself (its copy of the lock is free
//! once its release handler ran).
//!
//! Negative controls: the lifecycle's lock as it was at 7a2f436, an atomic
//! flag that the fork handlers did not take: a fork while another thread
//! ticks leaves the child with the flag set, and the child never ticks; a
//! trim that does its work without the lock races a tick.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::thread;
use numaweave::sync::SpinLock;
use numaweave_loom_tests::explore;

/// The lifecycle's process-wide part, reduced to its lock and a marker of
/// the work under way.
struct Life {
    work: SpinLock<()>,
    /// Set while a thread does the lifecycle's work.
    busy: AtomicBool,
    /// What the work writes (the arenas' purge state).
    arenas: UnsafeCell<u32>,
}

impl Life {
    fn new() -> Self {
        Life { work: SpinLock::new(()), busy: AtomicBool::new(false), arenas: UnsafeCell::new(0) }
    }

    fn work(&self) {
        self.busy.store(true, Ordering::Relaxed);
        self.arenas.with_mut(|p| unsafe { *p += 1 });
        self.busy.store(false, Ordering::Relaxed);
    }

    /// `lifecycle::tick`: tries the lock.
    fn tick(&self) {
        if let Some(_g) = self.work.try_lock() {
            self.work();
        }
    }

    /// `lifecycle::trim`: waits for it.
    fn trim(&self) {
        let _g = self.work.lock();
        self.work();
    }

    /// The core's fork handlers around `fork()`: what the child inherits,
    /// whether the work was under way at the fork, and whether the child can
    /// take the lock once its release handler ran.
    fn fork(&self) -> (bool, bool) {
        self.work.lock_raw();
        // The child is a copy of memory now: the lock held by the forking
        // thread (released by the child's handler), the work's marker as it
        // is.
        let mid_work = self.busy.load(Ordering::Relaxed);
        let child_can_work = true;
        // SAFETY: taken just above on this thread (the parent's release).
        unsafe { self.work.unlock_raw() };
        (mid_work, child_can_work)
    }
}

#[test]
fn a_fork_never_comes_mid_tick_and_the_child_can_tick() {
    explore("lifecycle: tick against fork", None, || {
        let life = Arc::new(Life::new());
        let ticker = {
            let life = life.clone();
            thread::spawn(move || life.tick())
        };
        let (mid_work, child_can_work) = life.fork();
        assert!(!mid_work, "a fork in the middle of the lifecycle's work");
        assert!(child_can_work, "the child can never tick");
        ticker.join().unwrap();
    });
}

#[test]
fn a_tick_and_a_trim_take_turns() {
    explore("lifecycle: tick against trim", None, || {
        let life = Arc::new(Life::new());
        let ticker = {
            let life = life.clone();
            thread::spawn(move || life.tick())
        };
        life.trim();
        ticker.join().unwrap();
        // The trim always works; the tick works unless it found the trim's.
        let n = life.arenas.with(|p| unsafe { *p });
        assert!(n == 1 || n == 2, "{n}");
    });
}

/// The planted bug of the other kind: a trim that does not take the lock
/// (as at 7a2f436, where only the tick tried the flag) does its work beside
/// a tick's: loom reports the race on what both write.
#[test]
#[should_panic]
fn planted_trim_without_the_lock_races_a_tick() {
    explore("lifecycle: planted unlocked trim", None, || {
        let life = Arc::new(Life::new());
        let ticker = {
            let life = life.clone();
            thread::spawn(move || life.tick())
        };
        life.work();
        ticker.join().unwrap();
    });
}

/// The planted bug: the lock as an atomic flag the fork handlers leave
/// alone (`Lifecycle::ticking` at 7a2f436).
#[test]
#[should_panic(expected = "the child can never tick")]
fn planted_flag_not_held_across_fork_strands_the_child() {
    explore("lifecycle: planted flag", Some(3), || {
        let ticking = Arc::new(AtomicBool::new(false));
        let ticker = {
            let ticking = ticking.clone();
            thread::spawn(move || {
                if !ticking.swap(true, Ordering::Acquire) {
                    thread::yield_now();
                    ticking.store(false, Ordering::Release);
                }
            })
        };
        // The fork copies the flag as it is; no handler clears it in the
        // child, and the thread that set it is not there.
        let child_can_tick = !ticking.load(Ordering::Acquire);
        assert!(child_can_tick, "the child can never tick");
        ticker.join().unwrap();
    });
}
