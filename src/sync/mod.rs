//! Synchronisation primitives, switched to loom's under `cfg(loom)`.
//!
//! Every concurrent structure in the crate imports its atomics and cells from
//! here, never from `std` directly, so that the models in `loom-tests/` explore
//! the same code that ships (the approach of sharded-slab's `sync.rs`).

#[cfg(not(loom))]
mod mutex;
mod once;
mod retire;
mod spin;
mod stack;
mod unit_map;
#[cfg(not(loom))]
pub use mutex::{Mutex, MutexGuard};
pub use once::InitCell;
pub use retire::{Acquired, RetireCount};
pub use spin::{SpinGuard, SpinLock};
pub use stack::{AtomicStack, CountedStack, Linked};
pub use unit_map::{UnitMap, for_words};

/// Keeps a value on cache lines of its own (two, against the adjacent-line
/// prefetcher), so that threads writing it do not steal the lines its
/// neighbours' owners keep hot.
#[repr(C, align(128))]
#[cfg_attr(loom, allow(dead_code))]
pub(crate) struct CachePadded<T>(pub(crate) T);

#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) use loom::{
    cell::UnsafeCell,
    hint::spin_loop,
    sync::atomic::{
        AtomicBool, AtomicI32, AtomicPtr, AtomicU8, AtomicU16, AtomicU32, AtomicU64, AtomicUsize, Ordering,
    },
    thread::yield_now,
};

#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) use std::{
    hint::spin_loop,
    sync::atomic::{
        AtomicBool, AtomicI32, AtomicPtr, AtomicU8, AtomicU16, AtomicU32, AtomicU64, AtomicUsize, Ordering,
    },
    thread::yield_now,
};

/// `std::cell::UnsafeCell` with loom's closure-based access API, so callers
/// write the same code under both configurations.
#[cfg(not(loom))]
#[derive(Debug)]
#[allow(dead_code)]
pub(crate) struct UnsafeCell<T: ?Sized>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    pub(crate) const fn new(data: T) -> Self {
        Self(std::cell::UnsafeCell::new(data))
    }
}

#[cfg(not(loom))]
impl<T: ?Sized> UnsafeCell<T> {
    #[inline(always)]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    #[inline(always)]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}
