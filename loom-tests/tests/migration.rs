//! A pool's migration against its own refills and frees (`slab/migrate.rs`,
//! `slab/chunk.rs`), with the crate's `Mutex` for the node's slab lock and
//! the cache's migration lock: the migration records where new chunks go
//! (`placed`), rebinds every chunk under the node lock, then moves each
//! chunk's pages without it, the chunk marked moving (`begin_move`: its
//! last slab going meanwhile leaves it mapped, and `end_move` unmaps it).
//! A refill maps a new chunk under the node lock on the node `placed`
//! names; a free of a chunk's last slab unmaps it unless it is moving.
//! The chunk mapping itself is modelled (two slots, a loom cell each for
//! its memory, which the move and the unmap both touch).
//!
//! Checked: after the migration no mapped chunk is bound off the target
//! (the pool is not split), and no chunk is unmapped under a move (a data
//! race loom reports).
//!
//! Negative controls: `placed` stored after the rebinding (a refill in
//! between maps a chunk on the old node: the pool split); a free that
//! unmaps a moving chunk (unmapped under the move).
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;
use numaweave::sync::Mutex;
use numaweave_loom_tests::explore;

const OLD: usize = 0;
const TO: usize = 1;
const NOWHERE: usize = usize::MAX;

#[derive(Clone, Copy, Default)]
struct Chunk {
    mapped: bool,
    bound: usize,
    used: usize,
    moving: bool,
}

struct Pool {
    /// The node lock: the chunk list.
    slabs: Mutex<[Chunk; 2]>,
    /// The migration lock.
    moving: Mutex<()>,
    placed: AtomicUsize,
    /// Each chunk slot's memory: the move and the unmap touch it.
    memory: [UnsafeCell<u32>; 2],
}

#[derive(Clone, Copy, PartialEq)]
enum Bug {
    None,
    PlacedAfterRebind,
    UnmapWhileMoving,
}

impl Pool {
    fn new() -> Self {
        let first = Chunk { mapped: true, bound: OLD, used: 1, moving: false };
        Pool {
            slabs: Mutex::new([first, Chunk::default()]),
            moving: Mutex::new(()),
            placed: AtomicUsize::new(NOWHERE),
            memory: [UnsafeCell::new(0), UnsafeCell::new(0)],
        }
    }

    /// A refill that needs a new chunk: mapped on `placed` (or the node's own).
    fn refill(&self) {
        let mut s = self.slabs.lock();
        let node = match self.placed.load(Ordering::Relaxed) {
            NOWHERE => OLD,
            n => n,
        };
        s[1] = Chunk { mapped: true, bound: node, used: 1, moving: false };
        self.memory[1].with_mut(|p| unsafe { *p = 1 });
    }

    /// The free of chunk 0's last slab.
    fn free_last(&self, bug: Bug) {
        let mut s = self.slabs.lock();
        s[0].used -= 1;
        if s[0].used == 0 && (!s[0].moving || bug == Bug::UnmapWhileMoving) {
            s[0].mapped = false;
            self.memory[0].with_mut(|p| unsafe { *p = u32::MAX });
        }
    }

    fn migrate(&self, bug: Bug) {
        let _one = self.moving.lock();
        if bug != Bug::PlacedAfterRebind {
            self.placed.store(TO, Ordering::Relaxed);
        }
        {
            let mut s = self.slabs.lock();
            for c in s.iter_mut().filter(|c| c.mapped) {
                c.bound = TO;
            }
        }
        if bug == Bug::PlacedAfterRebind {
            self.placed.store(TO, Ordering::Relaxed);
        }
        for i in 0..2 {
            {
                let mut s = self.slabs.lock();
                if !s[i].mapped {
                    continue;
                }
                s[i].moving = true;
            }
            // move_pages, without the node lock: the chunk's memory.
            self.memory[i].with_mut(|p| unsafe { *p = (*p).wrapping_add(1) });
            let mut s = self.slabs.lock();
            s[i].moving = false;
            if s[i].used == 0 {
                s[i].mapped = false;
                self.memory[i].with_mut(|p| unsafe { *p = u32::MAX });
            }
        }
    }
}

fn model(name: &str, bug: Bug) {
    explore(name, Some(3), move || {
        let pool = Arc::new(Pool::new());
        let user = {
            let pool = pool.clone();
            thread::spawn(move || {
                pool.refill();
                pool.free_last(bug);
            })
        };
        pool.migrate(bug);
        user.join().unwrap();
        let s = pool.slabs.lock();
        assert!(s.iter().filter(|c| c.mapped).all(|c| c.bound == TO), "a chunk bound off the target: the pool split");
    });
}

#[test]
fn a_migration_leaves_no_chunk_behind_and_unmaps_none_under_a_move() {
    model("migration: against a refill and a free", Bug::None);
}

#[test]
#[should_panic(expected = "the pool split")]
fn planted_placed_after_the_rebinding_splits_the_pool() {
    model("migration: planted placed after rebind", Bug::PlacedAfterRebind);
}

#[test]
#[should_panic]
fn planted_unmap_of_a_moving_chunk_is_caught() {
    model("migration: planted unmap while moving", Bug::UnmapWhileMoving);
}
