//! A reference count with a "retired" bit: the lifetime rule of the
//! allocator's bump regions. Every live block holds a reference; the space
//! that carves the region holds none, but retires it when it moves on. The
//! region may be freed exactly once, by whoever makes "retired, and no
//! reference" true: the last release after retirement, or the retirement
//! itself when nothing is live. Modelled with loom in `loom-tests/`.

use super::shim::{AtomicUsize, Ordering};

const RETIRED: usize = 1 << (usize::BITS - 1);

/// See the module docs.
///
/// ```
/// use numaweave::sync::{Acquired, RetireCount};
/// let c = RetireCount::new();
/// assert_eq!(c.try_acquire(), Acquired::Yes);
/// assert!(!c.retire()); // a reference is live
/// assert_eq!(c.try_acquire(), Acquired::Retired); // no new ones once retired
/// assert!(c.release()); // the last one: free now
/// ```
pub struct RetireCount {
    v: AtomicUsize,
}

/// What [`RetireCount::try_acquire`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acquired {
    /// A reference is now held.
    Yes,
    /// Retired: no reference taken.
    Retired,
    /// Retired, and the caller's attempt was the last thing keeping it: the
    /// caller must free it.
    RetiredFree,
}

impl RetireCount {
    /// No references, not retired.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        Self { v: AtomicUsize::new(0) }
    }

    /// No references, not retired (loom's atomics are not `const`).
    #[cfg(loom)]
    pub fn new() -> Self {
        Self { v: AtomicUsize::new(0) }
    }

    /// Sets `n` references, not retired (on memory nobody else sees yet).
    pub fn reset(&self, n: usize) {
        self.v.store(n, Ordering::Relaxed);
    }

    /// Takes a reference unless the count is retired.
    #[inline]
    pub fn try_acquire(&self) -> Acquired {
        // Acquire: a holder sees what the previous holders and the
        // initialiser wrote.
        if self.v.fetch_add(1, Ordering::Acquire) & RETIRED == 0 {
            return Acquired::Yes;
        }
        if self.release() { Acquired::RetiredFree } else { Acquired::Retired }
    }

    /// Drops one reference; true when it was the last one after retirement
    /// (the caller frees).
    #[inline]
    pub fn release(&self) -> bool {
        self.release_n(1)
    }

    /// Drops `n` references at once (credit given back); true as for
    /// [`release`](Self::release).
    #[inline]
    pub fn release_n(&self, n: usize) -> bool {
        // AcqRel: the freeing thread sees every holder's last use; every
        // holder's use happens before its release.
        self.v.fetch_sub(n, Ordering::AcqRel) == RETIRED | n
    }

    /// References held now (not counting retirement; a snapshot).
    #[inline]
    pub fn count(&self) -> usize {
        self.v.load(Ordering::Acquire) & !RETIRED
    }

    /// Whether the count was retired (a hint for the holder of a reference:
    /// it stays true once true).
    #[inline]
    pub fn is_retired(&self) -> bool {
        self.v.load(Ordering::Relaxed) & RETIRED != 0
    }

    /// Retires the count (once); true when no reference is live (the caller
    /// frees).
    pub fn retire(&self) -> bool {
        let old = self.v.fetch_or(RETIRED, Ordering::AcqRel);
        debug_assert_eq!(old & RETIRED, 0, "retired twice");
        old == 0
    }
}

impl Default for RetireCount {
    fn default() -> Self {
        Self::new()
    }
}
