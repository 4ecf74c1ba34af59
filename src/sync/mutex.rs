//! A blocking lock for the slab layer's slow paths, whose critical sections
//! may map memory or run an object constructor: a futex mutex of three
//! states (Drepper's "Futexes are tricky": free, held, held with sleepers),
//! as std's. Unlike std's it can be taken in one function and released in
//! another ([`lock_raw`](Mutex::lock_raw)), which the `fork()` handlers do.
//!
//! Under loom (`loom-tests/tests/mutex.rs`) the futex is a loom mutex and
//! condition variable with the kernel's contract: the value is compared
//! and the waiter queued under the same lock a wake takes, so a wake is
//! never lost between the two, and a wake no one waits for does nothing.

use core::ops::{Deref, DerefMut};

use super::shim::{AtomicU32, Ordering, UnsafeCell};

const FREE: u32 = 0;
const HELD: u32 = 1;
/// Held, and a thread may sleep on it: the unlock wakes one.
const CONTENDED: u32 = 2;

/// Spins before a waiter sleeps: most critical sections are a few list
/// moves. (Once under loom: each spin's load would multiply the states it
/// explores, and the sleeping path is the one to check.)
const SPINS: u32 = if cfg!(loom) { 1 } else { 100 };

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
    /// The futex's wait queue, under loom: see the module.
    #[cfg(loom)]
    queue: (loom::sync::Mutex<()>, loom::sync::Condvar),
    value: UnsafeCell<T>,
}

// SAFETY: the lock hands out `&mut T` to one thread at a time (Acquire on
// lock, Release on unlock), like `std::sync::Mutex<T>`.
unsafe impl<T: Send> Sync for Mutex<T> {}
// SAFETY: moving the lock moves the `T`.
unsafe impl<T: Send> Send for Mutex<T> {}

impl<T> Mutex<T> {
    /// An unlocked lock holding `value`.
    #[cfg(not(loom))]
    pub const fn new(value: T) -> Self {
        Self { state: AtomicU32::new(FREE), value: UnsafeCell::new(value) }
    }

    /// An unlocked lock holding `value` (loom's atomics are not `const`).
    #[cfg(loom)]
    pub fn new(value: T) -> Self {
        Self {
            state: AtomicU32::new(FREE),
            queue: (loom::sync::Mutex::new(()), loom::sync::Condvar::new()),
            value: UnsafeCell::new(value),
        }
    }

    /// Waits until the lock is free and takes it.
    #[inline]
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.lock_raw();
        MutexGuard { lock: self }
    }

    /// Takes the lock if it is free now, without waiting. A try that fails
    /// leaves the lock with its holder.
    ///
    /// ```
    /// use numaweave::sync::Mutex;
    /// let m = Mutex::new(());
    /// let held = m.lock();
    /// assert!(m.try_lock().is_none());
    /// // Still held: a failed try released nothing.
    /// assert!(m.try_lock().is_none());
    /// drop(held);
    /// let g = m.try_lock().expect("free once the holder let go");
    /// assert!(m.try_lock().is_none());
    /// # drop(g);
    /// ```
    #[inline]
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        // (`then`, not `then_some`: a guard made before the test would be
        // dropped when it fails, and release the lock its holder has.)
        self.state
            .compare_exchange(FREE, HELD, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
            .then(|| MutexGuard { lock: self })
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
            self.wait();
        }
    }

    /// Sleeps while the state is [`CONTENDED`] (or returns at once).
    #[cfg(not(loom))]
    fn wait(&self) {
        crate::os::thread::futex_wait(&self.state, CONTENDED, None);
    }

    /// Wakes one sleeper, if any.
    #[cfg(not(loom))]
    fn wake(&self) {
        crate::os::thread::futex_wake(&self.state, 1);
    }

    #[cfg(loom)]
    fn wait(&self) {
        let q = self.queue.0.lock().unwrap();
        // (The kernel reads the word under its bucket lock, which a wake
        // takes too.)
        if self.state.load(Ordering::SeqCst) == CONTENDED {
            drop(self.queue.1.wait(q).unwrap());
        }
    }

    #[cfg(loom)]
    fn wake(&self) {
        let _q = self.queue.0.lock().unwrap();
        self.queue.1.notify_one();
    }

    /// Releases a lock taken with [`lock_raw`](Self::lock_raw).
    ///
    /// # Safety
    /// The caller (or, in a forked child, the thread it was copied from) took
    /// the lock with `lock_raw`, and no guard for it exists.
    #[inline]
    pub unsafe fn unlock_raw(&self) {
        if self.state.swap(FREE, Ordering::Release) == CONTENDED {
            self.wake();
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
        self.value.with_mut(|p| unsafe { &mut *p })
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
        self.lock.value.with(|p| unsafe { &*p })
    }
}

impl<T> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as above; `&mut self` makes the borrow unique.
        self.lock.value.with_mut(|p| unsafe { &mut *p })
    }
}

impl<T> Drop for MutexGuard<'_, T> {
    fn drop(&mut self) {
        // SAFETY: the guard's lock was taken by `lock`, and the guard is
        // its only record.
        unsafe { self.lock.unlock_raw() }
    }
}

#[cfg(all(test, not(loom)))]
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

    /// The user's program of the report: the lock held, tried twice, then a
    /// waiter started. Before the fix the first failed try released the
    /// holder's lock: the second try succeeded and the waiter got in while
    /// the lock was held.
    #[test]
    fn a_failed_try_lock_leaves_the_lock_with_its_holder() {
        static M: Mutex<u32> = Mutex::new(0);
        let mut held = M.lock();
        assert!(M.try_lock().is_none());
        assert!(M.try_lock().is_none(), "a failed try released the holder's lock");
        let entered = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let waiter = {
            let entered = entered.clone();
            std::thread::spawn(move || {
                let mut g = M.lock();
                entered.store(true, Ordering::SeqCst);
                *g += 1;
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!entered.load(Ordering::SeqCst), "the waiter got in while the lock was held");
        *held = 10;
        drop(held);
        waiter.join().unwrap();
        assert_eq!(*M.lock(), 11);
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
