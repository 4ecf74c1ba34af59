//! The loom shim itself: the atomics, `UnsafeCell`, `spin_loop` and
//! `yield_now` every concurrent structure takes, std's in the build that
//! ships and loom's under `--cfg loom`.

#[cfg(loom)]
#[allow(unused_imports)]
pub(crate) use loom::{
    cell::UnsafeCell,
    hint::spin_loop,
    sync::atomic::{
        AtomicBool, AtomicI32, AtomicPtr, AtomicU8, AtomicU16, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
    },
    thread::yield_now,
};

#[cfg(not(loom))]
#[allow(unused_imports)]
pub(crate) use std::{
    hint::spin_loop,
    sync::atomic::{
        AtomicBool, AtomicI32, AtomicPtr, AtomicU8, AtomicU16, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
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
