//! A bitmap of equal units with a length at each block's first unit: the
//! concurrency of the allocator's regions, apart from their memory so that
//! loom can check it (`loom-tests/tests/unit_map.rs`).
//!
//! One *carver* at a time takes units ([`take`](UnitMap::take)); any thread
//! frees a block ([`untake`](UnitMap::untake)): its units become free and
//! *dirty* (still committed). The carver purges dirty free units
//! ([`purge`](UnitMap::purge)); once there is no carver any more (a retired
//! region), freeing threads purge whole free chunks
//! ([`purge_free_chunk`](UnitMap::purge_free_chunk)), several at once if
//! need be.
//!
//! Orderings: a freeing thread clears a block's length, counts its newly
//! dirty units, then clears its bits with Release; whoever reads the bits
//! with Acquire and finds them clear (the carver looking for room, a thread
//! purging) sees the length cleared, the count raised, and the freer's last
//! use of the memory.

use super::shim::{AtomicU16, AtomicU64, AtomicUsize, Ordering};

/// See the module docs: `W` words of 64 units, all storage inline (the
/// allocator keeps it in a region's header).
#[repr(C)]
pub struct UnitMap<const W: usize> {
    used: [AtomicU64; W],
    dirty: [AtomicU64; W],
    dirty_units: AtomicUsize,
    /// At each unit: the length of the block that starts there (0: none).
    len: [[AtomicU16; 64]; W],
}

/// Calls `f(word, mask)` for the words covering units `start..start+n`.
#[inline]
pub fn for_words(start: usize, n: usize, mut f: impl FnMut(usize, u64)) {
    let (mut i, end) = (start, start + n);
    while i < end {
        let w = i / 64;
        let hi = end.min((w + 1) * 64);
        let bits = hi - i;
        let m = if bits == 64 { !0 } else { ((1u64 << bits) - 1) << (i % 64) };
        f(w, m);
        i = hi;
    }
}

impl<const W: usize> UnitMap<W> {
    /// All units free and clean.
    #[cfg(not(loom))]
    pub const fn new() -> Self {
        #[allow(clippy::declare_interior_mutable_const)]
        const Z64: AtomicU64 = AtomicU64::new(0);
        #[allow(clippy::declare_interior_mutable_const)]
        const Z16: AtomicU16 = AtomicU16::new(0);
        #[allow(clippy::declare_interior_mutable_const)]
        const ROW: [AtomicU16; 64] = [Z16; 64];
        Self { used: [Z64; W], dirty: [Z64; W], dirty_units: AtomicUsize::new(0), len: [ROW; W] }
    }

    /// All units free and clean (loom's atomics are not `const`).
    #[cfg(loom)]
    pub fn new() -> Self {
        Self {
            used: core::array::from_fn(|_| AtomicU64::new(0)),
            dirty: core::array::from_fn(|_| AtomicU64::new(0)),
            dirty_units: AtomicUsize::new(0),
            len: core::array::from_fn(|_| core::array::from_fn(|_| AtomicU16::new(0))),
        }
    }

    #[inline(always)]
    fn used(&self) -> &[AtomicU64] {
        &self.used
    }

    #[inline(always)]
    fn dirty(&self) -> &[AtomicU64] {
        &self.dirty
    }

    #[inline(always)]
    fn dirty_count(&self) -> &AtomicUsize {
        &self.dirty_units
    }

    #[inline(always)]
    fn len_at(&self, i: usize) -> &AtomicU16 {
        &self.len[i / 64][i % 64]
    }

    /// Units in the map.
    pub fn units(&self) -> usize {
        self.used().len() * 64
    }

    /// Marks `n` units from `start` in use for good, as no block (a header).
    pub fn reserve(&self, start: usize, n: usize) {
        for_words(start, n, |w, m| {
            self.used()[w].fetch_or(m, Ordering::Relaxed);
        });
    }

    /// Marks `n` units from `start` in use, `start` a block's first (the
    /// carver only). Returns how many of them were dirty.
    pub fn take(&self, start: usize, n: usize) -> usize {
        debug_assert!(n > 0 && start + n <= self.units());
        debug_assert_eq!(self.len_at(start).load(Ordering::Relaxed), 0, "a block starts there already");
        let mut cleaned = 0;
        for_words(start, n, |w, m| {
            let old = self.used()[w].fetch_or(m, Ordering::Relaxed);
            debug_assert_eq!(old & m, 0, "taking units in use");
            // A load first: most units taken are not dirty, and the RMW on
            // a word freeing threads may write is the costly part.
            if self.dirty()[w].load(Ordering::Relaxed) & m != 0 {
                cleaned += (self.dirty()[w].fetch_and(!m, Ordering::Relaxed) & m).count_ones() as usize;
            }
        });
        if cleaned > 0 {
            self.dirty_count().fetch_sub(cleaned, Ordering::Relaxed);
        }
        self.len_at(start).store(n as u16, Ordering::Relaxed);
        cleaned
    }

    /// Marks the block of `n` units at `start` free and dirty (any thread,
    /// for a block it gives up).
    pub fn untake(&self, start: usize, n: usize) {
        debug_assert_eq!(usize::from(self.len_at(start).load(Ordering::Relaxed)), n, "not a block of that length");
        self.len_at(start).store(0, Ordering::Relaxed);
        for_words(start, n, |w, m| {
            let dirtied = (!self.dirty()[w].fetch_or(m, Ordering::Relaxed) & m).count_ones() as usize;
            if dirtied > 0 {
                self.dirty_count().fetch_add(dirtied, Ordering::Relaxed);
            }
            // Release: see the module docs.
            let old = self.used()[w].fetch_and(!m, Ordering::Release);
            debug_assert_eq!(old & m, m, "freeing units not in use");
        });
    }

    /// The length of the block starting at unit `i` (0: none starts there).
    #[inline]
    pub fn block_len(&self, i: usize) -> usize {
        usize::from(self.len_at(i).load(Ordering::Relaxed))
    }

    /// The first unit in use in `from..to`.
    pub fn first_used(&self, from: usize, to: usize) -> Option<usize> {
        self.first_where(from, to, 0)
    }

    /// The first free unit in `from..to`.
    pub fn first_free(&self, from: usize, to: usize) -> Option<usize> {
        self.first_where(from, to, !0)
    }

    /// The first unit in `from..to` whose bit, XORed with `flip`'s, is set:
    /// in use with `flip` 0, free with all ones.
    fn first_where(&self, from: usize, to: usize, flip: u64) -> Option<usize> {
        let mut i = from;
        while i < to {
            // Acquire: see the module docs. The shift brings in zeros,
            // units that do not match: the next word is looked at.
            let w = (self.used()[i / 64].load(Ordering::Acquire) ^ flip) >> (i % 64);
            if w != 0 {
                let u = i + w.trailing_zeros() as usize;
                return (u < to).then_some(u);
            }
            i = (i / 64 + 1) * 64;
        }
        None
    }

    /// The lowest run of at least `n` free units from `from` on, starting on
    /// a multiple of `align` units: its start, and the end of the free run.
    ///
    /// A candidate that meets a unit in use resumes at the first free unit
    /// after it, not the unit after it: a region of small blocks is
    /// searched a word of its bitmap at a time, not a unit at a time (every
    /// start inside the run in use would meet a unit in use itself).
    pub fn find_run(&self, n: usize, align: usize, from: usize) -> Option<(usize, usize)> {
        debug_assert!(align.is_power_of_two() && n > 0);
        let units = self.units();
        // `align` is a power of two: a mask, not `next_multiple_of`'s division.
        let up = |i: usize| (i + align - 1) & !(align - 1);
        let mut i = up(from);
        while i + n <= units {
            match self.first_used(i, i + n) {
                None => return Some((i, self.first_used(i + n, units).unwrap_or(units))),
                Some(u) => i = up(self.first_free(u, units)?),
            }
        }
        None
    }

    /// Dirty units now.
    pub fn dirty_units(&self) -> usize {
        self.dirty_count().load(Ordering::Relaxed)
    }

    /// Calls `decommit(start, n)` for every run of dirty free units and
    /// counts them clean; how many. The carver only (no unit gets taken
    /// meanwhile); freeing threads may go on.
    pub fn purge(&self, decommit: impl FnMut(usize, usize)) -> usize {
        self.purge_masked(|_| !0, decommit)
    }

    /// [`purge`](Self::purge) of the units that were dirty already when the
    /// carver last called this (their bits in `aged`), so that a unit freed
    /// a moment before a purge is not returned to the OS just to be faulted
    /// in again; then `aged` holds the units left dirty, for the next call.
    /// The carver only.
    pub fn purge_aged(&self, aged: &mut [u64; W], decommit: impl FnMut(usize, usize)) -> usize {
        let purged = self.purge_masked(|w| aged[w], decommit);
        for (a, d) in aged.iter_mut().zip(self.dirty()) {
            *a = d.load(Ordering::Relaxed);
        }
        purged
    }

    /// [`purge`](Self::purge) of the units whose bit is set in `mask(word)`.
    fn purge_masked(&self, mask: impl Fn(usize) -> u64, mut decommit: impl FnMut(usize, usize)) -> usize {
        let mut purged = 0;
        let mut run = None;
        for i in 0..=self.units() {
            let cand = i < self.units() && {
                let (w, b) = (i / 64, 1u64 << (i % 64));
                mask(w) & b != 0
                    && self.dirty()[w].load(Ordering::Relaxed) & b != 0
                    && self.used()[w].load(Ordering::Acquire) & b == 0
            };
            match (cand, run) {
                (true, None) => run = Some(i),
                (false, Some(s)) => {
                    run = None;
                    decommit(s, i - s);
                    for_words(s, i - s, |w, m| {
                        purged += (self.dirty()[w].fetch_and(!m, Ordering::Relaxed) & m).count_ones() as usize;
                    });
                }
                _ => {}
            }
        }
        if purged > 0 {
            self.dirty_count().fetch_sub(purged, Ordering::Relaxed);
        }
        purged
    }

    /// With no carver left: if no unit of the `chunk` units around unit `i`
    /// (`chunk` a multiple of 64) is in use and some is dirty, calls
    /// `decommit(start, chunk)` and counts them clean; how many. Any number
    /// of threads at once.
    pub fn purge_free_chunk(&self, i: usize, chunk: usize, decommit: impl FnOnce(usize, usize)) -> usize {
        debug_assert!(chunk.is_multiple_of(64));
        let start = i / chunk * chunk;
        let words = start / 64..(start + chunk) / 64;
        // Acquire: the frees of every block that was there are over.
        if words.clone().any(|w| self.used()[w].load(Ordering::Acquire) != 0)
            || words.clone().all(|w| self.dirty()[w].load(Ordering::Relaxed) == 0)
        {
            return 0;
        }
        decommit(start, chunk);
        let mut purged = 0;
        for w in words {
            purged += self.dirty()[w].swap(0, Ordering::Relaxed).count_ones() as usize;
        }
        self.dirty_count().fetch_sub(purged, Ordering::Relaxed);
        purged
    }
}

impl<const W: usize> Default for UnitMap<W> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn words_cover_exactly_the_units() {
        let mut got = Vec::new();
        for_words(60, 70, |w, m| got.push((w, m)));
        assert_eq!(got, vec![(0, 0xf << 60), (1, !0), (2, (1 << 2) - 1)]);
        got.clear();
        for_words(64, 64, |w, m| got.push((w, m)));
        assert_eq!(got, vec![(1, !0)]);
    }

    #[test]
    fn runs_lengths_dirt_and_purges() {
        let m = UnitMap::<4>::new();
        m.reserve(0, 1);
        assert_eq!(m.find_run(3, 1, 0), Some((1, 256)));
        assert_eq!(m.take(1, 3), 0);
        assert_eq!(m.take(4, 70), 0);
        assert_eq!((m.block_len(1), m.block_len(4), m.block_len(5)), (3, 70, 0));
        assert_eq!(m.find_run(1, 64, 0), Some((128, 256)), "aligned past the blocks");
        m.untake(1, 3);
        assert_eq!((m.block_len(1), m.dirty_units()), (0, 3));
        assert_eq!(m.find_run(2, 1, 1), Some((1, 4)), "a freed run, up to the next block");
        // Taking a dirty unit makes it clean.
        assert_eq!(m.take(2, 1), 1);
        assert_eq!(m.dirty_units(), 2);
        let mut calls = Vec::new();
        assert_eq!(m.purge(|s, n| calls.push((s, n))), 2);
        assert_eq!((calls, m.dirty_units()), (vec![(1, 1), (3, 1)], 0));
        // A whole free chunk goes back; one with a block in it stays.
        m.untake(4, 70);
        m.untake(2, 1);
        assert_eq!(m.purge_free_chunk(10, 64, |_, _| panic!("unit 0 is in use")), 0);
        // Units 64..74 were the block's: dirty; the rest of the chunk never used.
        assert_eq!(m.purge_free_chunk(70, 64, |s, n| assert_eq!((s, n), (64, 64))), 10);
        assert_eq!(m.dirty_units(), 71 - 10);
        assert_eq!(m.purge_free_chunk(70, 64, |_, _| panic!("clean already")), 0);
    }

    /// `find_run` (which skips a run in use a word at a time) finds what a
    /// unit-by-unit search finds, on maps of blocks of random lengths.
    #[test]
    fn runs_found_are_the_lowest_that_fit() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |k: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % k) as usize
        };
        for _ in 0..200 {
            let m = UnitMap::<4>::new();
            let mut used = [false; 256];
            let mut i = next(8);
            while i < 256 {
                let long = next(2) == 0;
                let n = (1 + next(if long { 80 } else { 4 })).min(256 - i);
                m.take(i, n);
                used[i..i + n].iter_mut().for_each(|u| *u = true);
                i += n + next(6);
            }
            for _ in 0..50 {
                let (n, align, from) = (1 + next(40), 1 << next(7), next(256));
                let naive = (from.next_multiple_of(align)..256)
                    .step_by(align)
                    .find(|&s| s + n <= 256 && used[s..s + n].iter().all(|u| !u));
                let want = naive.map(|s| (s, (s + n..256).find(|&e| used[e]).unwrap_or(256)));
                assert_eq!(m.find_run(n, align, from), want, "n {n}, align {align}, from {from}");
            }
        }
    }

    /// A round returns only what was dirty at the round before; a unit
    /// taken again meanwhile, or freed since, stays.
    #[test]
    fn aged_purges_skip_units_freed_since_the_last_round() {
        let m = UnitMap::<2>::new();
        let mut aged = [0u64; 2];
        assert_eq!((m.take(0, 4), m.take(4, 4), m.take(8, 4)), (0, 0, 0));
        m.untake(0, 4);
        m.untake(4, 4);
        assert_eq!(m.purge_aged(&mut aged, |_, _| panic!("nothing aged yet")), 0);
        assert_eq!(aged, [0xff, 0]);
        // Units 4..8 reused, 8..12 freed: only 0..4 were dirty at both rounds.
        assert_eq!(m.take(4, 4), 4);
        m.untake(8, 4);
        let mut calls = Vec::new();
        assert_eq!(m.purge_aged(&mut aged, |s, n| calls.push((s, n))), 4);
        assert_eq!((calls, m.dirty_units(), aged), (vec![(0, 4)], 4, [0xf00, 0]));
        assert_eq!(m.purge_aged(&mut aged, |s, n| assert_eq!((s, n), (8, 4))), 4);
        assert_eq!((m.dirty_units(), aged), (0, [0, 0]));
    }
}
