//! The lifetime rule of the allocator's bump regions, on the crate's own
//! `RetireCount` and `SpinLock`: a carver takes a block's reference under the
//! space's lock, and only while the region is current; the space makes it
//! not current and retires it under the same lock; blocks are freed (their
//! reference released) by any thread. The region is freed exactly once, after
//! every use of every block, whichever comes last.
//!
//! A negative control shows why the lock is there: a carver that takes its
//! reference without it may act on a region already freed.
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use numaweave::sync::{Acquired, SpinLock};
use numaweave_loom_tests::region_model::Region;

struct Space {
    /// Whether the region is still current.
    current: SpinLock<bool>,
    region: Region,
}

fn world() -> Arc<Space> {
    let s = Arc::new(Space { current: SpinLock::new(true), region: Region::new() });
    // Block 0 was carved before; its holder frees it on another thread.
    assert_eq!(s.region.live.try_acquire(), Acquired::Yes);
    s
}

fn holder(s: Arc<Space>) -> impl FnOnce() {
    move || {
        s.region.use_block(0);
        s.region.release();
    }
}

fn use_block1(s: &Space) {
    s.region.use_block(1);
    s.region.release();
}

#[test]
fn freed_once_after_every_use() {
    loom::model(|| {
        let s = world();
        let h = thread::spawn(holder(s.clone()));
        let carver = {
            let s = s.clone();
            thread::spawn(move || {
                let got = {
                    let g = s.current.lock();
                    if *g { Some(s.region.live.try_acquire()) } else { None }
                };
                match got {
                    Some(Acquired::Yes) => use_block1(&s),
                    None => {}
                    Some(other) => panic!("a current region was retired: {other:?}"),
                }
            })
        };
        // The space moves on: not current, retired, under the lock.
        let free_now = {
            let mut g = s.current.lock();
            *g = false;
            s.region.live.retire()
        };
        if free_now {
            s.region.free();
        }
        h.join().unwrap();
        carver.join().unwrap();
        assert_eq!(s.region.frees(), 1, "freed other than once");
    });
}

#[test]
#[should_panic]
fn without_the_lock_a_carver_can_touch_a_freed_region() {
    loom::model(|| {
        let s = world();
        let h = thread::spawn(holder(s.clone()));
        let carver = {
            let s = s.clone();
            thread::spawn(move || match s.region.live.try_acquire() {
                Acquired::Yes => use_block1(&s),
                Acquired::Retired => {}
                // Its attempt met a region already retired and freed: a
                // second free (or, in the allocator, a write to unmapped
                // memory).
                Acquired::RetiredFree => s.region.free(),
            })
        };
        if s.region.live.retire() {
            s.region.free();
        }
        h.join().unwrap();
        carver.join().unwrap();
        assert_eq!(s.region.frees(), 1, "freed other than once");
    });
}
