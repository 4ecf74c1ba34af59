//! A blocking lock for the slab layer's slow paths, whose critical sections
//! may map memory or run an object constructor: a futex mutex of three
//! states (Drepper's "Futexes are tricky": free, held, held with sleepers),
//! as std's. Unlike std's it can be taken in one function and released in
//! another ([`lock_raw`](Mutex::lock_raw)), which the `fork()` handlers do.
//! Not modelled by loom (the slab caches that use it are not built there).

use core::cell::UnsafeCell;
use core::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::os::thread::{futex_wait, futex_wake};

const FREE: u32 = 0;
const HELD: u32 = 1;
/// Held, and a thread may sleep on it: the unlock wakes one.
const CONTENDED: u32 = 2;

/// Spins before a waiter sleeps: most critical sections are a few list
/// moves.
const SPINS: u32 = 100;

/// A mutual-exclusion lock owning a `T`. A panic while it is held releases
/// it (the guard's drop) without poisoning: callers keep their data
/// consistent at every step that can panic.
///
/// ```
/// use numaweave::sync::Mutex;
/// static COUNT: Mutex<u32> = Mutex::new(0);
/// *COUNT.lock() += 1;
/// assert_eq!(*COUNT.lock(), 1);
/// ```
pub struct Mutex<T> {
    state: AtomicU32,
    value: UnsafeCell<T>,
}

// SAFETY: the lock hands out `&mut T` to one thread at a time (Acquire on
// lock, Release on unlock), like `std::sync::Mutex<T>`.
unsafe impl<T: Send> Sync for Mutex<T> {}
// SAFETY: moving the lock moves the `T`.
unsafe impl<T: Send> Send for Mutex<T> {}

impl<T> Mutex<T> {
    /// An unlocked lock holding `value`.
    pub const fn new(value: T) -> Self {
        Self { state: AtomicU32::new(FREE), value: UnsafeCell::new(value) }
    }

    /// Waits until the lock is free and takes it.
    #[inline]
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.lock_raw();
        MutexGuard { lock: self }
    }

    /// Takes the lock if it is free now, without waiting.
    ///
    /// ```
    /// use numaweave::sync::Mutex;
    /// let m = Mutex::new(());
    /// let held = m.lock();
    /// assert!(m.try_lock().is_none());
    /// drop(held);
    /// assert!(m.try_lock().is_some());
    /// ```
    #[inline]
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        self.state
            .compare_exchange(FREE, HELD, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
            .then_some(MutexGuard { lock: self })
    }

    /// Takes the lock without a guard, for `fork()` handlers, which take
    /// locks in one function and release them in another.
    #[inline]
    pub fn lock_raw(&self) {
        if self.state.compare_exchange(FREE, HELD, Ordering::Acquire, Ordering::Relaxed).is_err() {
            self.lock_contended();
        }
    }

    #[cold]
    fn lock_contended(&self) {
        let mut spins = 0;
        while spins < SPINS && self.state.load(Ordering::Relaxed) != FREE {
            core::hint::spin_loop();
            spins += 1;
        }
        // From here on the lock is taken as contended: whoever holds it next
        // wakes a sleeper when it lets go (perhaps needlessly, never too
        // few).
        while self.state.swap(CONTENDED, Ordering::Acquire) != FREE {
            futex_wait(&self.state, CONTENDED, None);
        }
    }

    /// Releases a lock taken with [`lock_raw`](Self::lock_raw).
    ///
    /// # Safety
    /// The caller (or, in a forked child, the thread it was copied from) took
    /// the lock with `lock_raw`, and no guard for it exists.
    #[inline]
    pub unsafe fn unlock_raw(&self) {
        if self.state.swap(FREE, Ordering::Release) == CONTENDED {
            futex_wake(&self.state, 1);
        }
    }

    /// The value, for the holder of a raw lock.
    ///
    /// # Safety
    /// The caller holds the lock (taken with [`lock_raw`](Self::lock_raw)),
    /// and the reference does not outlive it nor meet another.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn raw_value(&self) -> &mut T {
        debug_assert_ne!(self.state.load(Ordering::Relaxed), FREE);
        // SAFETY: the lock makes the value the caller's alone.
        unsafe { &mut *self.value.get() }
    }
}

/// Holds a [`Mutex`] until dropped.
pub struct MutexGuard<'a, T> {
    lock: &'a Mutex<T>,
}

impl<T> Deref for MutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard proves the lock is held.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as above; `&mut self` makes the borrow unique.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for MutexGuard<'_, T> {
    fn drop(&mut self) {
        // SAFETY: the guard's lock was taken by `lock`, and the guard is
        // its only record.
        unsafe { self.lock.unlock_raw() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_take_turns_and_sleepers_are_woken() {
        static M: Mutex<u64> = Mutex::new(0);
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    for _ in 0..20_000 {
                        let mut g = M.lock();
                        let v = *g;
                        // Long enough now and then that waiters sleep.
                        if v.is_multiple_of(1000) {
                            std::thread::sleep(std::time::Duration::from_micros(50));
                        }
                        *g = v + 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*M.lock(), 80_000);
    }

    #[test]
    fn a_raw_lock_is_released_elsewhere() {
        let m = Mutex::new(5);
        m.lock_raw();
        // SAFETY: held raw just above.
        unsafe {
            *m.raw_value() += 1;
            m.unlock_raw();
        }
        assert_eq!(*m.lock(), 6);
    }
}
