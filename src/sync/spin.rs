//! A test-and-test-and-set spin lock for the allocator's slow paths (taking a
//! fresh page from a node arena, thread start and exit). It never allocates
//! and never sleeps in the kernel, so it is usable inside `GlobalAlloc`.
//! Critical sections under it are a few dozen instructions plus, rarely, an
//! `mmap`.

use core::ops::{Deref, DerefMut};

use super::shim::{AtomicBool, Ordering, UnsafeCell, spin_loop, yield_now};

/// A spin lock owning a `T`.
///
/// ```
/// use numaweave::sync::SpinLock;
/// let l = SpinLock::new(0u32);
/// *l.lock() += 1;
/// assert_eq!(*l.lock(), 1);
/// ```
pub struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the lock hands out `&mut T` to one thread at a time (Acquire on
// lock, Release on unlock), like `Mutex<T>`.
unsafe impl<T: Send> Sync for SpinLock<T> {}
// SAFETY: moving the lock moves the `T`.
unsafe impl<T: Send> Send for SpinLock<T> {}

impl<T> SpinLock<T> {
    /// An unlocked lock holding `value`.
    #[cfg(not(loom))]
    pub const fn new(value: T) -> Self {
        Self { locked: AtomicBool::new(false), value: UnsafeCell::new(value) }
    }

    /// An unlocked lock holding `value` (loom's atomics are not `const`).
    #[cfg(loom)]
    pub fn new(value: T) -> Self {
        Self { locked: AtomicBool::new(false), value: UnsafeCell::new(value) }
    }

    /// Waits until the lock is free and takes it.
    #[inline]
    pub fn lock(&self) -> SpinGuard<'_, T> {
        if self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            self.lock_contended();
        }
        SpinGuard { lock: self }
    }

    #[cold]
    fn lock_contended(&self) {
        let mut spins = 0u32;
        loop {
            // Test before test-and-set: wait on a shared read of the line.
            while self.locked.load(Ordering::Relaxed) {
                if cfg!(loom) || spins >= 100 {
                    yield_now();
                } else {
                    spins += 1;
                    spin_loop();
                }
            }
            if self.locked.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                return;
            }
        }
    }

    /// Takes the lock without a guard, for `pthread_atfork` handlers, which
    /// take locks in one function and release them in another.
    pub fn lock_raw(&self) {
        core::mem::forget(self.lock());
    }

    /// Releases a lock taken with [`lock_raw`](Self::lock_raw).
    ///
    /// # Safety
    /// The caller (or, in a forked child, the thread it was copied from) took
    /// the lock with `lock_raw`, and no guard for it exists.
    pub unsafe fn unlock_raw(&self) {
        self.locked.store(false, Ordering::Release);
    }

    /// The value, for the holder of a raw lock.
    ///
    /// # Safety
    /// The caller holds the lock (taken with [`lock_raw`](Self::lock_raw)),
    /// and the pointer is not used past it.
    pub unsafe fn raw_value(&self) -> *mut T {
        self.value.with_mut(|p| p)
    }

    /// Takes the lock if it is free.
    pub fn try_lock(&self) -> Option<SpinGuard<'_, T>> {
        // (`then`, not `then_some`: a guard made before the test would be
        // dropped when it fails, and release the lock its holder has.)
        self.locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
            .then(|| SpinGuard { lock: self })
    }
}

/// Holds a [`SpinLock`] until dropped.
pub struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard proves exclusive ownership of the lock.
        self.lock.value.with(|p| unsafe { &*p })
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as above; `&mut self` makes the borrow unique.
        self.lock.value.with_mut(|p| unsafe { &mut *p })
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_failed_try_lock_leaves_the_lock_with_its_holder() {
        let l = SpinLock::new(0u32);
        let g = l.lock();
        assert!(l.try_lock().is_none());
        // Still held: a second try fails too, and the holder's guard is
        // the one that lets go.
        assert!(l.try_lock().is_none());
        drop(g);
        let g = l.try_lock().expect("free once the holder let go");
        assert!(l.try_lock().is_none());
        drop(g);
    }
}
