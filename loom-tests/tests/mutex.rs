//! The blocking lock the slab layer and the lifecycle take (`sync::Mutex`,
//! a three-state futex mutex), with the futex as loom stands it in (see
//! `sync/mutex.rs`): the value compared under the lock a wake takes.
//!
//! * Two threads take the lock by turns and write the value it guards (a
//!   loom cell: two holders at once are a data race loom reports); one of
//!   them, finding it held, sleeps and must be woken.
//! * A `try_lock` that fails, twice, while another thread holds the lock
//!   leaves it held: the holder's writes and the trier's never meet.
//!
//! Negative controls: a failed `try_lock` that releases the holder's lock
//! (the bug `then_some` made: the guard built before the test, dropped when
//! it failed) lets two threads write at once; a holder that never lets go
//! leaves its waiter asleep, which loom reports as a deadlock (the stand-in
//! futex really sleeps: a lost wake-up would show the same way).
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use numaweave::sync::Mutex;
use numaweave_loom_tests::explore;

#[test]
fn threads_take_turns_and_a_sleeper_is_woken() {
    explore("mutex: two lockers", None, || {
        let m = Arc::new(Mutex::new(0u32));
        let t = {
            let m = m.clone();
            thread::spawn(move || *m.lock() += 1)
        };
        *m.lock() += 1;
        t.join().unwrap();
        assert_eq!(*m.lock(), 2);
    });
}

/// The holder's side: holds the lock across two writes; another thread
/// tries it twice, and writes only under a guard it got.
fn try_model(release_on_failure: bool) {
    explore("mutex: a failed try under a holder", None, move || {
        let m = Arc::new(Mutex::new(0u32));
        let holder = {
            let m = m.clone();
            thread::spawn(move || {
                let mut g = m.lock();
                *g += 1;
                thread::yield_now();
                *g += 1;
            })
        };
        for _ in 0..2 {
            match m.try_lock() {
                Some(mut g) => *g += 10,
                None if release_on_failure => {
                    // Planted bug: the guard made before the test dropped
                    // on failure, releasing the holder's lock.
                    // SAFETY: not so: this is the bug the control plants.
                    unsafe { m.unlock_raw() };
                }
                None => {}
            }
        }
        holder.join().unwrap();
        let v = *m.lock();
        assert!(v == 2 || v == 12 || v == 22, "{v}");
    });
}

#[test]
fn a_failed_try_lock_leaves_the_lock_with_its_holder() {
    try_model(false);
}

#[test]
#[should_panic]
fn planted_try_lock_that_releases_on_failure_is_caught() {
    try_model(true);
}

#[test]
#[should_panic(expected = "deadlock")]
fn planted_holder_that_never_lets_go_leaves_its_waiter_asleep() {
    loom::model(|| {
        // Leaked, not in a loom `Arc`: loom's deadlock report unwinds, and
        // an `Arc` dropped while it does aborts the process.
        let m: &'static Mutex<()> = Box::leak(Box::new(Mutex::new(())));
        m.lock_raw();
        let t = thread::spawn(move || drop(m.lock()));
        t.join().unwrap();
    });
}
