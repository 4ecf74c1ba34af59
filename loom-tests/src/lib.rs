//! Loom models of numaweave's concurrent structures live in `tests/`; this
//! crate only exists so they build with `--cfg loom` in their own target dir:
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test -p numaweave-loom-tests --profile ci --target-dir target/loom
//! ```
//!
//! [`region_model`] holds the bump region as the two region lifetime models
//! (`region_lifetime`, `exclusive_region`) see it.

/// A bump region reduced to what its lifetime rule is about: the crate's
/// own `RetireCount`, two blocks' memory, and how often it was freed.
#[cfg(loom)]
pub mod region_model {
    use loom::cell::UnsafeCell;
    use loom::sync::atomic::{AtomicUsize, Ordering};
    use numaweave::sync::RetireCount;

    /// See the module.
    pub struct Region {
        /// The region's references (its live blocks), as in the allocator.
        pub live: RetireCount,
        /// Two blocks' memory: used by their holders, wiped by the free.
        blocks: [UnsafeCell<usize>; 2],
        frees: AtomicUsize,
    }

    impl Region {
        /// No reference, not retired.
        pub fn new() -> Self {
            Self {
                live: RetireCount::new(),
                blocks: [UnsafeCell::new(0), UnsafeCell::new(0)],
                frees: AtomicUsize::new(0),
            }
        }

        /// A holder uses block `i` (writes its memory).
        pub fn use_block(&self, i: usize) {
            self.blocks[i].with_mut(|p| unsafe { *p += 1 });
        }

        /// Drops one reference; frees the region if that was the last one
        /// after retirement.
        pub fn release(&self) {
            if self.live.release() {
                self.free();
            }
        }

        /// The "munmap": every block's memory, written. A use not ordered
        /// before this is a data race loom reports.
        pub fn free(&self) {
            for b in &self.blocks {
                b.with_mut(|p| unsafe { *p = usize::MAX });
            }
            self.frees.fetch_add(1, Ordering::Relaxed);
        }

        /// How many times the region was freed.
        pub fn frees(&self) -> usize {
            self.frees.load(Ordering::Relaxed)
        }
    }

    impl Default for Region {
        fn default() -> Self {
            Self::new()
        }
    }
}

/// Runs `f` under loom with at most `preemptions` preemptions per
/// execution (`None`: unbounded), prints how many executions it explored
/// under `name`, and returns that number.
#[cfg(loom)]
pub fn explore(name: &str, preemptions: Option<usize>, f: impl Fn() + Sync + Send + 'static) -> usize {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let mut b = loom::model::Builder::new();
    b.preemption_bound = preemptions;
    // Spin locks yield in their loops under loom: more branches than its
    // default 1,000 in an execution where three threads contend.
    b.max_branches = 20_000;
    b.check(move || {
        counted.fetch_add(1, Ordering::Relaxed);
        f()
    });
    let n = runs.load(Ordering::Relaxed);
    println!("loom model {name}: {n} executions");
    n
}
