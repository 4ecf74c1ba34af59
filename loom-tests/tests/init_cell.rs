//! Models of `InitCell`, the allocation-free one-time initialisation every lazy
//! global of the crate (the process topology first) goes through.
#![cfg(loom)]

use loom::sync::Arc;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;
use numaweave::sync::InitCell;

/// Two threads race to initialise: exactly one initialiser runs, both see its
/// value, and loom checks that the value's write happens-before every read.
#[test]
fn racing_initialisers_run_once() {
    loom::model(|| {
        let cell = Arc::new(InitCell::<[usize; 2]>::new());
        let runs = Arc::new(AtomicUsize::new(0));
        let spawn = |id: usize| {
            let (cell, runs) = (cell.clone(), runs.clone());
            thread::spawn(move || {
                *cell.get_or_init(|| {
                    runs.fetch_add(1, Ordering::Relaxed);
                    [id, id * 10]
                })
            })
        };
        let a = spawn(1);
        let b = spawn(2);
        let (va, vb) = (a.join().unwrap(), b.join().unwrap());
        assert_eq!(va, vb, "both threads see the same value");
        assert_eq!(va[1], va[0] * 10, "a torn value was observed");
        assert_eq!(runs.load(Ordering::Relaxed), 1, "initialiser ran more than once");
        assert_eq!(cell.get(), Some(&va));
    });
}

/// A reader that only peeks (`get`) sees nothing or the whole value, never a
/// half-written one.
#[test]
fn peeking_reader_sees_none_or_all() {
    loom::model(|| {
        let cell = Arc::new(InitCell::<(usize, usize)>::new());
        let writer = {
            let cell = cell.clone();
            thread::spawn(move || {
                cell.get_or_init(|| (7, 49));
            })
        };
        if let Some(&(a, b)) = cell.get() {
            assert_eq!((a, b), (7, 49));
        }
        writer.join().unwrap();
        assert_eq!(cell.get(), Some(&(7, 49)));
    });
}

/// An initialiser that panics leaves the cell empty, and a waiting thread
/// takes over instead of waiting forever.
#[test]
fn panicking_initialiser_lets_another_retry() {
    loom::model(|| {
        let cell = Arc::new(InitCell::<usize>::new());
        let failing = {
            let cell = cell.clone();
            thread::spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    cell.get_or_init(|| panic!("discovery failed"));
                }));
                // Either it panicked, or the other thread had already initialised.
                assert!(r.is_err() || cell.get() == Some(&5));
            })
        };
        let v = *cell.get_or_init(|| 5);
        assert_eq!(v, 5);
        failing.join().unwrap();
    });
}

/// Negative control: the same publication pattern with the `Release` store
/// planted as `Relaxed` (and the reader's `Acquire` as `Relaxed`). Loom must
/// find the interleaving where the reader sees READY before the value's write
/// is visible, and report the data race: if this test stopped panicking, the
/// models above would prove nothing.
#[test]
#[should_panic(expected = "Causality violation")]
fn planted_relaxed_publication_is_caught() {
    use loom::cell::UnsafeCell;
    use loom::sync::atomic::AtomicU8;

    struct Buggy {
        state: AtomicU8,
        value: UnsafeCell<usize>,
    }
    // SAFETY: deliberately unsound publication, for loom to catch.
    unsafe impl Sync for Buggy {}

    loom::model(|| {
        let cell = Arc::new(Buggy { state: AtomicU8::new(0), value: UnsafeCell::new(0) });
        let writer = {
            let cell = cell.clone();
            thread::spawn(move || {
                // SAFETY: the only writer (racing the reader, which is the bug).
                cell.value.with_mut(|p| unsafe { *p = 42 });
                cell.state.store(2, Ordering::Relaxed); // planted bug: should be Release
            })
        };
        if cell.state.load(Ordering::Relaxed) == 2 {
            // SAFETY: not actually safe; loom must notice.
            let v = cell.value.with(|p| unsafe { *p });
            assert_eq!(v, 42);
        }
        writer.join().unwrap();
    });
}

/// A thread that fills `cell` with 9, raising `in_init` while its
/// initialiser runs (what a fork must never see).
fn spawn_initialiser(
    cell: &Arc<InitCell<usize>>,
    in_init: &Arc<loom::sync::atomic::AtomicBool>,
) -> thread::JoinHandle<usize> {
    let (cell, in_init) = (cell.clone(), in_init.clone());
    thread::spawn(move || {
        *cell.get_or_init(|| {
            in_init.store(true, Ordering::SeqCst);
            in_init.store(false, Ordering::SeqCst);
            9
        })
    })
}

/// `fork()`'s hold: at the moment a child would be made (between
/// `hold_for_fork` and `release_after_fork`) no initialiser is running,
/// whatever the interleaving; the cell is then either empty and held or
/// filled; after the release the racing initialiser runs once.
#[test]
fn a_fork_hold_never_sees_an_initialisation_in_progress() {
    loom::model(|| {
        let cell = Arc::new(InitCell::<usize>::new());
        let in_init = Arc::new(loom::sync::atomic::AtomicBool::new(false));
        let init = spawn_initialiser(&cell, &in_init);
        let took = cell.hold_for_fork();
        // The fork would be here.
        assert!(!in_init.load(Ordering::SeqCst), "a child would inherit an initialisation in progress");
        assert_eq!(took, cell.get().is_none());
        cell.release_after_fork();
        assert_eq!(init.join().unwrap(), 9);
        assert_eq!(cell.get(), Some(&9));
    });
}

/// Negative control: a hold that only looks whether the value is there
/// (planted bug: no claim of the cell, no wait) lets the fork happen in the
/// middle of an initialisation; loom must find that interleaving.
#[test]
#[should_panic(expected = "initialisation in progress")]
fn planted_peeking_fork_hold_is_caught() {
    loom::model(|| {
        let cell = Arc::new(InitCell::<usize>::new());
        let in_init = Arc::new(loom::sync::atomic::AtomicBool::new(false));
        let init = spawn_initialiser(&cell, &in_init);
        let _peek = cell.get().is_some(); // planted bug: should be hold_for_fork()
        assert!(!in_init.load(Ordering::SeqCst), "a child would inherit an initialisation in progress");
        init.join().unwrap();
    });
}
