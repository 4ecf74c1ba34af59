//! A one-time initialised cell that never allocates and never takes a lock
//! that could allocate, so the allocator and topology discovery can use it
//! during their own start-up.

use core::mem::MaybeUninit;

use super::shim::{AtomicU8, Ordering, UnsafeCell, spin_loop, yield_now};

const UNINIT: u8 = 0;
const RUNNING: u8 = 1;
const READY: u8 = 2;

/// Busy-wait rounds before a waiter starts yielding. None under loom, where
/// every spin is a scheduling point and only multiplies the explored states.
#[cfg(not(loom))]
const SPINS: u32 = 64;
#[cfg(loom)]
const SPINS: u32 = 0;

/// A cell written once by the first caller of [`get_or_init`](Self::get_or_init);
/// concurrent callers wait (spinning, then yielding) until the value is published.
///
/// Unlike `std::sync::OnceLock` it is modelled with loom (`loom-tests/`), and its
/// state machine is small enough to argue about in one screen:
/// `UNINIT -> RUNNING` by one CAS winner, `RUNNING -> READY` by a `Release`
/// store after the value is written, readers `Acquire` the `READY` state before
/// they read the value. A panicking initialiser resets the state to `UNINIT`, so a
/// later caller retries instead of waiting forever.
///
/// Calling `get_or_init` on the same cell from inside its own initialiser
/// deadlocks; the crate never does (topology discovery does not allocate).
///
/// ```
/// use numaweave::sync::InitCell;
/// static ANSWER: InitCell<u32> = InitCell::new();
/// assert_eq!(*ANSWER.get_or_init(|| 42), 42);
/// assert_eq!(ANSWER.get(), Some(&42));
/// ```
pub struct InitCell<T> {
    state: AtomicU8,
    value: UnsafeCell<MaybeUninit<T>>,
}

// SAFETY: the value is written by exactly one thread before READY is published
// with Release, and only read after READY is observed with Acquire; sharing the
// cell hands out `&T` across threads (needs `Sync`) and may drop `T` on another
// thread than the writer (needs `Send`).
unsafe impl<T: Send + Sync> Sync for InitCell<T> {}
// SAFETY: moving the cell moves the `T` it may own.
unsafe impl<T: Send> Send for InitCell<T> {}

impl<T> InitCell<T> {
    /// An empty cell.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self { state: AtomicU8::new(UNINIT), value: UnsafeCell::new(MaybeUninit::uninit()) }
    }

    /// An empty cell (loom's atomics are not `const`).
    #[cfg(loom)]
    pub fn new() -> Self {
        Self { state: AtomicU8::new(UNINIT), value: UnsafeCell::new(MaybeUninit::uninit()) }
    }

    /// The value, if some caller has finished initialising it.
    #[inline]
    pub fn get(&self) -> Option<&T> {
        if self.state.load(Ordering::Acquire) == READY {
            // SAFETY: READY was observed with Acquire, so the initialiser's write
            // of the value happens-before this read, and the value is never
            // written again while `self` is borrowed.
            Some(unsafe { self.read() })
        } else {
            None
        }
    }

    /// The value, initialised by `init` if no caller has done so yet. Exactly one
    /// `init` runs to completion per cell (unless it panics, then another may).
    #[inline]
    pub fn get_or_init(&self, init: impl FnOnce() -> T) -> &T {
        match self.get() {
            Some(v) => v,
            None => self.init_slow(|slot| {
                slot.write(init());
            }),
        }
    }

    /// [`get_or_init`](Self::get_or_init) for a large `T`: `init` writes the
    /// value straight into the cell, where a returned value would be built
    /// on the stack and copied (the allocator's state is 18 KiB; every stack
    /// page its start-up touches stays in the program's RSS).
    ///
    /// # Safety
    /// `init` must leave `slot` fully initialised when it returns.
    ///
    /// ```
    /// use core::mem::MaybeUninit;
    /// use numaweave::sync::InitCell;
    /// static TABLE: InitCell<[u64; 4096]> = InitCell::new();
    /// // SAFETY: the closure writes every element.
    /// let t = unsafe {
    ///     TABLE.get_or_init_in_place(|slot: &mut MaybeUninit<[u64; 4096]>| {
    ///         let p = slot.as_mut_ptr().cast::<u64>();
    ///         for i in 0..4096 {
    ///             // SAFETY: `i` is within the array `slot` holds.
    ///             unsafe { p.add(i).write(i as u64 * 3) };
    ///         }
    ///     })
    /// };
    /// assert_eq!(t[4095], 12285);
    /// ```
    #[inline]
    pub unsafe fn get_or_init_in_place(&self, init: impl FnOnce(&mut MaybeUninit<T>)) -> &T {
        match self.get() {
            Some(v) => v,
            None => self.init_slow(init),
        }
    }

    /// Runs `init` on the empty slot once; it leaves the slot initialised
    /// (both callers' contract).
    #[unsafe(link_section = ".text.sorted.numaweave")]
    #[cold]
    fn init_slow(&self, init: impl FnOnce(&mut MaybeUninit<T>)) -> &T {
        if self.claim() {
            // Reset to UNINIT if `init` unwinds, so waiters retry.
            struct Reset<'a>(&'a AtomicU8);
            impl Drop for Reset<'_> {
                fn drop(&mut self) {
                    self.0.store(UNINIT, Ordering::Release);
                }
            }
            let reset = Reset(&self.state);
            self.value.with_mut(|p| {
                // SAFETY: the RUNNING state gives this thread exclusive
                // access: nobody reads before READY, nobody else writes.
                init(unsafe { &mut *p });
            });
            core::mem::forget(reset);
            self.state.store(READY, Ordering::Release);
        }
        // SAFETY: READY observed with Acquire by `claim`, or this thread
        // wrote the value just above.
        unsafe { self.read() }
    }

    /// Moves the cell from empty to RUNNING, for the caller to fill or hold
    /// (true), or waits until it is READY (false; observed with Acquire).
    /// Another thread's RUNNING is waited out: the work is short (a few
    /// sysfs reads), so it spins briefly, then gives up the CPU; a
    /// panicking initialiser's reset to empty lets this caller claim it.
    fn claim(&self) -> bool {
        let mut spins = 0u32;
        loop {
            match self.state.compare_exchange(UNINIT, RUNNING, Ordering::Acquire, Ordering::Acquire) {
                Ok(_) => return true,
                Err(READY) => return false,
                Err(_) => {
                    #[allow(clippy::absurd_extreme_comparisons)] // SPINS is 0 under loom
                    if spins < SPINS {
                        spins += 1;
                        spin_loop();
                    } else {
                        yield_now();
                    }
                }
            }
        }
    }

    /// Before `fork()`: holds the cell across it, so that no child inherits
    /// an initialisation in progress (its thread would not exist there and
    /// the child's first caller would wait forever). Waits for one in
    /// progress to finish; takes an empty cell as an initialiser would, so
    /// none starts until [`release_after_fork`](Self::release_after_fork).
    /// True if it took the cell; false if the value is there.
    ///
    /// ```
    /// use numaweave::sync::InitCell;
    /// static CELL: InitCell<u32> = InitCell::new();
    /// assert!(CELL.hold_for_fork());
    /// assert_eq!(CELL.get(), None);
    /// CELL.release_after_fork();
    /// assert_eq!(*CELL.get_or_init(|| 7), 7);
    /// assert!(!CELL.hold_for_fork()); // initialised: nothing to hold
    /// CELL.release_after_fork();
    /// assert_eq!(CELL.get(), Some(&7));
    /// ```
    pub fn hold_for_fork(&self) -> bool {
        self.claim()
    }

    /// After `fork()`, in the parent and in the child: gives back a cell
    /// [`hold_for_fork`](Self::hold_for_fork) took (while it is held no one
    /// else can have moved it from `RUNNING`); a ready cell stays ready.
    pub fn release_after_fork(&self) {
        let _ = self.state.compare_exchange(RUNNING, UNINIT, Ordering::Release, Ordering::Relaxed);
    }

    /// # Safety
    /// The state must have been observed as READY with Acquire ordering (or
    /// the caller wrote the value itself).
    unsafe fn read(&self) -> &T {
        let p: *const T = self.value.with(|p| p.cast::<T>());
        // SAFETY: the caller saw READY with Acquire (or wrote the value itself), so
        // the value is initialised and visible to us; it is never written again, so a
        // shared reference tied to `&self` is sound.
        unsafe { &*p }
    }
}

impl<T> Default for InitCell<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Drop for InitCell<T> {
    fn drop(&mut self) {
        if self.state.load(Ordering::Acquire) == READY {
            self.value.with_mut(|p| {
                // SAFETY: READY means the value was written; `&mut self` means no
                // reader is left.
                unsafe { (*p).assume_init_drop() };
            });
        }
    }
}

impl<T: core::fmt::Debug> core::fmt::Debug for InitCell<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_tuple("InitCell").field(&self.get()).finish()
    }
}
