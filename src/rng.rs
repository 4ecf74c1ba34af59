//! The one pseudo-random generator of the tests and benches (xorshift64,
//! Marsaglia's 13/7/17 triple): the same workload in every run. A module of
//! the crate's unit tests, and included (`#[path]`) by the integration
//! tests and the benches: one file for all.

/// A deterministic sequence from a nonzero seed.
pub struct Rng(pub u64);

#[allow(dead_code)]
impl Rng {
    /// The next value (never 0 from a nonzero seed).
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A value below `n` (not 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
