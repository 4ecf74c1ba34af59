//! A demotion's trigger (`slab/migrate.rs`, `check_demotion_slow`), with
//! the crate's `Mutex` for the cache's migration lock: a slow path that
//! finds the condition due (a compare-exchange on the next look's time:
//! one thread per period) tries the lock; the first look starts a pass
//! (the pool placed on the target, one demotion counted), each later one
//! takes a step of it; an explicit `migrate` waits for the lock and ends
//! the pass. Two slow paths race the trigger, and a migration runs beside
//! them.
//!
//! Checked: no two moves at once (a step and a step, a step and the
//! migration: a loom cell each writes), the demotion counted once however
//! the slow paths race, and the pool on the target at the end.
//!
//! Negative control: a `try_lock` that releases the holder's lock when it
//! fails (the bug of `Mutex::try_lock` at 7a2f436: a migration and a
//! demotion ran at once): two moves at once.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use loom::thread;
use numaweave::sync::Mutex;
use numaweave_loom_tests::explore;

const TO: usize = 2;
const NOWHERE: usize = usize::MAX;

struct Pool {
    /// The migration lock, and where a demotion's pass stands (steps left).
    moving: Mutex<Option<u32>>,
    placed: AtomicUsize,
    demotions: AtomicU64,
    /// When the condition is next looked at (a period of 0: every look).
    next: AtomicU64,
    /// What a move writes (the pages).
    pages: UnsafeCell<u32>,
}

impl Pool {
    fn new() -> Self {
        Pool {
            moving: Mutex::new(None),
            placed: AtomicUsize::new(NOWHERE),
            demotions: AtomicU64::new(0),
            next: AtomicU64::new(0),
            pages: UnsafeCell::new(0),
        }
    }

    fn step(&self) {
        self.pages.with_mut(|p| unsafe { *p += 1 });
    }

    /// A slow path's look at the condition (always low here).
    fn check(&self, buggy_try: bool) {
        let next = self.next.load(Ordering::Relaxed);
        if self.next.compare_exchange(next, next, Ordering::Relaxed, Ordering::Relaxed).is_err() {
            return;
        }
        let g = self.moving.try_lock();
        let Some(mut pass) = g else {
            if buggy_try {
                // Planted: the guard made and dropped on failure.
                // SAFETY: not so: the bug the control plants.
                unsafe { self.moving.unlock_raw() };
            }
            return;
        };
        match *pass {
            None if self.placed.load(Ordering::Relaxed) != TO => {
                self.demotions.fetch_add(1, Ordering::Relaxed);
                self.placed.store(TO, Ordering::Relaxed);
                *pass = Some(1);
            }
            None => {}
            Some(left) => {
                self.step();
                *pass = left.checked_sub(1).filter(|&l| l > 0);
            }
        }
    }

    fn migrate(&self) {
        let mut pass = self.moving.lock();
        self.placed.store(TO, Ordering::Relaxed);
        self.step();
        *pass = None;
    }
}

fn model(name: &str, buggy_try: bool) {
    explore(name, Some(2), move || {
        let pool = Arc::new(Pool::new());
        let paths: Vec<_> = (0..2)
            .map(|_| {
                let pool = pool.clone();
                thread::spawn(move || {
                    pool.check(buggy_try);
                    pool.check(buggy_try);
                })
            })
            .collect();
        pool.migrate();
        for p in paths {
            p.join().unwrap();
        }
        assert_eq!(pool.placed.load(Ordering::Relaxed), TO);
        assert!(pool.demotions.load(Ordering::Relaxed) <= 1, "a demotion counted twice");
    });
}

#[test]
fn one_move_at_a_time_and_the_demotion_counted_once() {
    model("demotion: two slow paths and a migration", false);
}

#[test]
#[should_panic]
fn planted_try_lock_that_releases_on_failure_lets_two_moves_run() {
    model("demotion: planted try_lock", true);
}
