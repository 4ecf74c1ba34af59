//! Synchronisation primitives, switched to loom's under `cfg(loom)`.
//!
//! Every concurrent structure in the crate imports its atomics and cells from
//! here, never from `std` directly, so that the models in `loom-tests/` explore
//! the same code that ships (the approach of sharded-slab's `sync.rs`).

mod mutex;
mod once;
mod retire;
pub mod seqlock;
mod shim;
mod spin;
mod stack;
mod unit_map;
pub use mutex::{Mutex, MutexGuard};
pub use once::InitCell;
pub use retire::{Acquired, RetireCount};
#[allow(unused_imports)]
pub(crate) use shim::*;
pub use spin::{SpinGuard, SpinLock};
pub use stack::{AtomicStack, CountedStack, Linked};
pub use unit_map::{UnitMap, for_words};

/// Keeps a value on cache lines of its own (two, against the adjacent-line
/// prefetcher), so that threads writing it do not steal the lines its
/// neighbours' owners keep hot.
#[repr(C, align(128))]
#[cfg_attr(loom, allow(dead_code))]
pub(crate) struct CachePadded<T>(pub(crate) T);
