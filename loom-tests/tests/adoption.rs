//! Heap adoption: an exiting thread leaves its heap on its arena's orphan
//! list (under the arena's `SpinLock`), and starting threads either adopt an
//! orphan or make a heap. Modelled with the crate's `SpinLock`.
#![cfg(loom)]

use loom::sync::Arc;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;
use numaweave::sync::SpinLock;

/// The arena's lock-protected part: orphan heap ids, and heaps made so far.
struct Arena {
    inner: SpinLock<(Vec<usize>, usize)>,
}

fn thread_start(a: &Arena) -> usize {
    let mut g = a.inner.lock();
    match g.0.pop() {
        Some(h) => h,
        None => {
            g.1 += 1;
            100 + g.1
        }
    }
}

/// The planted bug: the orphan chosen under the lock and taken under a
/// second one, so two starting threads may choose the same orphan.
fn thread_start_split(a: &Arena) -> usize {
    let chosen = a.inner.lock().0.last().copied();
    let mut g = a.inner.lock();
    match chosen {
        Some(h) => {
            g.0.retain(|&x| x != h);
            h
        }
        None => {
            g.1 += 1;
            100 + g.1
        }
    }
}

fn thread_exit(a: &Arena, heap: usize) {
    a.inner.lock().0.push(heap);
}

#[test]
fn every_heap_has_one_owner() {
    adoption_model(thread_start);
}

/// Negative control: with the orphan chosen and taken under two locks,
/// loom must find both threads adopting the same heap; if this test
/// stopped panicking, the model above would prove nothing.
#[test]
#[should_panic(expected = "adopted twice")]
fn planted_split_adoption_is_caught() {
    adoption_model(thread_start_split);
}

fn adoption_model(start: fn(&Arena) -> usize) {
    loom::model(move || {
        let a = Arc::new(Arena { inner: SpinLock::new((vec![1], 0)) });
        let in_use = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0), AtomicUsize::new(0), AtomicUsize::new(0)]);
        let slot = |h: usize| if h == 1 { 0 } else { h - 100 };
        let ts: Vec<_> = (0..2)
            .map(|_| {
                let (a, in_use) = (a.clone(), in_use.clone());
                thread::spawn(move || {
                    let h = start(&a);
                    // Nobody else may hold this heap now.
                    assert_eq!(in_use[slot(h)].fetch_add(1, Ordering::Relaxed), 0, "heap {h} adopted twice");
                    in_use[slot(h)].fetch_sub(1, Ordering::Relaxed);
                    thread_exit(&a, h);
                })
            })
            .collect();
        for t in ts {
            t.join().unwrap();
        }
        let g = a.inner.lock();
        // Every heap is back on the list; at most one was made (the other
        // thread adopted the orphan, or both ran one after the other).
        assert_eq!(g.0.len(), 1 + g.1, "a heap was adopted twice, then left twice: {:?}", g.0);
        assert!(g.1 <= 1);
    });
}

/// The lock excludes: increments under it are never lost.
#[test]
fn spin_lock_excludes() {
    loom::model(|| {
        let l = Arc::new(SpinLock::new(0usize));
        let ts: Vec<_> = (0..2)
            .map(|_| {
                let l = l.clone();
                thread::spawn(move || {
                    let mut g = l.lock();
                    let v = *g;
                    loom::thread::yield_now();
                    *g = v + 1;
                })
            })
            .collect();
        for t in ts {
            t.join().unwrap();
        }
        assert_eq!(*l.lock(), 2);
    });
}
