//! The regions' unit map (`numaweave::sync::UnitMap`, the code that ships):
//! one carver takes units, any thread frees blocks, dirty free units are
//! returned to the OS by the carver (a live region) or by the freeing
//! threads (a retired one, whole chunks only).
//!
//! The memory of each unit is a loom cell: a freeing thread writes its
//! block's units before it frees them (its last use), a carver that takes
//! units writes them (its first use), a purge "returns" units to the OS by
//! reading them (the OS may take them back only after their last use;
//! several threads returning the same free pages at once is harmless, as
//! `madvise` is). Loom reports any of those not ordered by the protocol.
//!
//! Checked: a carver that finds units free through the map may use them (the
//! freer's last use happens before); a purge returns only units no block
//! uses, and the dirty count ends right, when the carver purges while
//! another thread frees and when two freeing threads purge a retired map at
//! once. Negative control: a carver that trusts a block's length alone (a
//! relaxed word, not the bitmap's acquire) races with the freer.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;
use numaweave::sync::UnitMap;

/// Units whose memory is modelled (blocks live in the first ones).
const CELLS: usize = 6;

struct World {
    map: UnitMap<1>,
    mem: [UnsafeCell<usize>; CELLS],
}

impl World {
    fn new() -> Arc<Self> {
        Arc::new(Self { map: UnitMap::new(), mem: core::array::from_fn(|_| UnsafeCell::new(0)) })
    }

    /// Uses units `s..s+n` (a block's owner writing it).
    fn touch(&self, s: usize, n: usize, v: usize) {
        for c in &self.mem[s.min(CELLS)..(s + n).min(CELLS)] {
            // SAFETY (checked by loom): whoever touches a unit owns it now.
            c.with_mut(|p| unsafe { *p = v });
        }
    }

    /// The OS takes units `s..s+n` back (`MADV_DONTNEED`).
    fn decommit(&self, s: usize, n: usize) {
        for c in &self.mem[s.min(CELLS)..(s + n).min(CELLS)] {
            // SAFETY (checked by loom): after every use of the units.
            c.with(|p| unsafe { p.read() });
        }
    }
}

#[test]
fn a_carver_may_use_units_it_finds_free() {
    loom::model(|| {
        let w = World::new();
        // The carver's block A at units 0..2, handed to another thread.
        w.map.take(0, 2);
        let freer = {
            let w = w.clone();
            thread::spawn(move || {
                w.touch(0, 2, 1); // its last use
                w.map.untake(0, 2);
            })
        };
        // The carver looks for two free units below 4 until it finds them.
        loop {
            if let Some((s, _)) = w.map.find_run(2, 1, 0).filter(|&(s, _)| s + 2 <= 4) {
                w.map.take(s, 2);
                w.touch(s, 2, 2); // its first use
                break;
            }
            thread::yield_now();
        }
        freer.join().unwrap();
    });
}

#[test]
#[should_panic(expected = "Causality violation")]
fn trusting_the_length_alone_races_with_the_freer() {
    loom::model(|| {
        let w = World::new();
        w.map.take(0, 2);
        let freer = {
            let w = w.clone();
            thread::spawn(move || {
                w.touch(0, 2, 1);
                w.map.untake(0, 2);
            })
        };
        // Planted bug: the length is cleared first, with a relaxed store;
        // seeing it is not seeing the freer's use of the memory.
        while w.map.block_len(0) != 0 {
            thread::yield_now();
        }
        w.touch(0, 2, 2);
        freer.join().unwrap();
    });
}

#[test]
fn the_carver_purges_only_free_units_while_another_thread_frees() {
    loom::model(|| {
        let w = World::new();
        w.map.take(0, 2); // freed by the other thread
        w.map.take(2, 2); // live through the purge
        w.map.take(4, 1);
        w.map.untake(4, 1); // dirty already
        let freer = {
            let w = w.clone();
            thread::spawn(move || {
                w.touch(0, 2, 1);
                w.map.untake(0, 2);
            })
        };
        let purged = w.map.purge(|s, n| w.decommit(s, n));
        w.touch(2, 2, 3); // the live block is the carver's still
        freer.join().unwrap();
        let left = w.map.dirty_units();
        assert_eq!(purged + left, 3, "purged {purged}, left dirty {left}");
        assert!(purged >= 1, "the unit dirty before the purge went back");
    });
}

#[test]
fn freeing_threads_purge_a_retired_map_once_and_only_when_free() {
    loom::model(|| {
        let w = World::new();
        w.map.take(0, 2);
        w.map.take(2, 2);
        let free = |s: usize| {
            let w = w.clone();
            thread::spawn(move || {
                w.touch(s, 2, s + 1);
                w.map.untake(s, 2);
                w.map.purge_free_chunk(s, 64, |cs, n| w.decommit(cs, n))
            })
        };
        let (a, b) = (free(0), free(2));
        let purged = a.join().unwrap() + b.join().unwrap();
        assert_eq!(purged, 4, "every dirty unit counted clean once");
        assert_eq!(w.map.dirty_units(), 0);
    });
}
