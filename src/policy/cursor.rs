//! The interleave cursor: which node the next allocation of an interleave
//! policy goes to. Shared by any number of threads, lock-free, and exact:
//!
//! - `Count(n)`: every turn has exactly `n` allocations. One `fetch_add` per
//!   allocation: the k-th allocation (in the counter's order) belongs to turn
//!   `k / n`.
//! - `Bytes(b)`: a node's turn ends at the first allocation that brings the
//!   bytes placed in that turn to `b` or more. The turn and its byte count
//!   share one 64-bit word updated by compare-and-swap, so no allocation is
//!   lost or counted twice, however many threads race.
//!
//! With `Bytes(b)` every completed turn places between `b` and `b + L - 1`
//! bytes on its node (L = the largest allocation), whatever the sizes, so
//! nodes advance in step; `Count(n)` places `n` allocations per turn whatever
//! their sizes, so when sizes correlate with the rotation nodes drift apart by
//! whole turns' worth of bytes: Rientjes' objection to counting (both shown in
//! the tests). The overshoot of a turn is not carried into the node's next
//! turn, so over many rounds nodes can still differ by up to `L - 1` bytes per
//! round.

use super::{Granularity, Interleave};
use crate::sync::{AtomicU64, Ordering};
use crate::topology::MAX_NODES;

/// Most turns in one round (the weights' sum).
pub const MAX_ROUND: usize = 1024;

const TURN_BITS: u32 = 16;
const TURN_MASK: u64 = (1 << TURN_BITS) - 1;

/// See the module docs.
///
/// ```
/// use numaweave::policy::{Cursor, Granularity, Interleave};
/// let i = Interleave::new("0-1".parse().unwrap(), Granularity::Bytes(4096)).unwrap();
/// let c = Cursor::new(&i);
/// // 3 KiB stays on node 0, the next 2 KiB brings it past 4 KiB: still node 0,
/// // and its turn ends.
/// assert_eq!([c.next(3072), c.next(2048), c.next(100)], [0, 0, 1]);
/// ```
pub struct Cursor {
    round: [u8; MAX_ROUND],
    len: u64,
    granularity: Granularity,
    /// `Count`: allocations so far. `Bytes`: bytes placed in the current turn
    /// (high bits) and the turn's index in the round (low 16 bits).
    state: AtomicU64,
}

impl Cursor {
    /// A cursor at the start of the first node's first turn.
    pub fn new(policy: &Interleave) -> Self {
        let mut round = [0u8; MAX_ROUND];
        let mut len = 0;
        for n in policy.nodes().iter() {
            for _ in 0..policy.weight(n) {
                round[len] = n as u8;
                len += 1;
            }
        }
        debug_assert!(len > 0 && len <= MAX_ROUND && MAX_NODES <= 256);
        Self { round, len: len as u64, granularity: policy.granularity(), state: AtomicU64::new(0) }
    }

    /// The node for the next allocation of `size` bytes, advancing the cursor.
    #[inline]
    pub fn next(&self, size: usize) -> usize {
        match self.granularity {
            Granularity::Count(n) => {
                let k = self.state.fetch_add(1, Ordering::Relaxed);
                usize::from(self.round[((k / u64::from(n)) % self.len) as usize])
            }
            Granularity::Bytes(b) => {
                let mut cur = self.state.load(Ordering::Relaxed);
                loop {
                    let turn = cur & TURN_MASK;
                    let placed = (cur >> TURN_BITS).saturating_add(size as u64);
                    let next = if placed >= b { (turn + 1) % self.len } else { (placed << TURN_BITS) | turn };
                    // Relaxed: the cursor orders allocations among themselves
                    // (one location, one modification order); it publishes no
                    // other memory.
                    match self.state.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                        Ok(_) => return usize::from(self.round[turn as usize]),
                        Err(c) => cur = c,
                    }
                }
            }
        }
    }

    /// The node whose turn it is now.
    pub fn current(&self) -> usize {
        let s = self.state.load(Ordering::Relaxed);
        let turn = match self.granularity {
            Granularity::Count(n) => (s / u64::from(n)) % self.len,
            Granularity::Bytes(_) => s & TURN_MASK,
        };
        usize::from(self.round[turn as usize])
    }

    /// The round: node of each turn, in order.
    pub fn round(&self) -> &[u8] {
        &self.round[..self.len as usize]
    }

    /// The granularity.
    pub fn granularity(&self) -> Granularity {
        self.granularity
    }
}

impl core::fmt::Debug for Cursor {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Cursor").field("round", &self.round()).field("granularity", &self.granularity).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::topology::NodeSet;

    fn cursor(nodes: &str, g: Granularity, weights: Option<&[u8]>) -> Cursor {
        let mut i = Interleave::new(nodes.parse::<NodeSet>().unwrap(), g).unwrap();
        if let Some(w) = weights {
            i = i.with_weights(w).unwrap();
        }
        Cursor::new(&i)
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    #[test]
    fn count_turns_are_exactly_n_long_and_weighted() {
        let c = cursor("0-2", Granularity::Count(3), Some(&[2, 1, 1]));
        assert_eq!(c.round(), [0, 0, 1, 2]);
        let got: Vec<usize> = (0..24).map(|_| c.next(100)).collect();
        assert_eq!(got, [0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2]);
    }

    #[test]
    fn a_zero_weight_node_gets_no_turn() {
        let c = cursor("0-2", Granularity::Count(1), Some(&[1, 0, 2]));
        let got: Vec<usize> = (0..6).map(|_| c.next(1)).collect();
        assert_eq!(got, [0, 2, 2, 0, 2, 2]);
    }

    #[test]
    fn byte_turns_end_at_the_allocation_reaching_b() {
        let c = cursor("0-1", Granularity::Bytes(1000), None);
        let sizes = [400, 400, 400, 1, 999, 5000, 10, 10];
        let got: Vec<usize> = sizes.iter().map(|&s| c.next(s)).collect();
        // 400+400+400 ≥ 1000 on node 0; node 1 gets 1+999; node 0 gets 5000;
        // node 1 starts again.
        assert_eq!(got, [0, 0, 0, 1, 1, 0, 1, 1]);
    }

    /// Rientjes' point: on a stream whose sizes follow the rotation, every
    /// `Bytes(b)` turn places b..b+L bytes, so the nodes stay close; `Count(n)`
    /// turns differ by the sizes they happen to get, and the nodes drift apart.
    #[test]
    fn bytes_stay_balanced_where_counts_drift() {
        const B: u64 = 2 << 20;
        let bytes = cursor("0-3", Granularity::Bytes(B), None);
        let count = cursor("0-3", Granularity::Count(8), None);
        let (mut by_bytes, mut by_count) = ([0u64; 4], [0u64; 4]);
        let mut r = Rng(7);
        let (mut largest, mut turn_bytes, mut last) = (0u64, 0u64, usize::MAX);
        for i in 0..200_000u64 {
            // Mixed I/O sizes, 4 KiB–64 KiB, plus a pattern that follows the
            // rotation (one run of 8 in 4 is 128 KiB buffers), as real streams can.
            let size = if (i / 8) % 4 == 0 { 128 << 10 } else { 4096 << (r.next() % 5) };
            largest = largest.max(size);
            let n = bytes.next(size as usize);
            if n != last && last != usize::MAX {
                assert!((B..B + largest).contains(&turn_bytes), "a turn placed {turn_bytes} bytes");
                turn_bytes = 0;
            }
            last = n;
            turn_bytes += size;
            by_bytes[n] += size;
            by_count[count.next(size as usize)] += size;
        }
        let spread = |v: &[u64; 4]| v.iter().max().unwrap() - v.iter().min().unwrap();
        let (sb, sc) = (spread(&by_bytes), spread(&by_count));
        println!("after 200,000 allocations: Bytes(2M) spread {sb}, Count(8) spread {sc}");
        assert!(sc > 50 * sb.max(1), "Count(8) should drift far more: {sc} vs {sb}");
        // 3.6 GiB in 4 nodes: Bytes(2M) keeps them within a few turns.
        assert!(sb < 4 * (B + largest), "Bytes spread {sb}");
    }

    #[test]
    fn contended_cursors_lose_and_double_count_nothing() {
        const T: usize = 4;
        const PER: usize = 20_000;
        let c = cursor("0-2", Granularity::Count(5), Some(&[1, 2, 1]));
        let per_node: Vec<[u64; 3]> = std::thread::scope(|s| {
            (0..T)
                .map(|_| {
                    s.spawn(|| {
                        let mut n = [0u64; 3];
                        for _ in 0..PER {
                            n[c.next(1)] += 1;
                        }
                        n
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect()
        });
        let total: [u64; 3] = core::array::from_fn(|i| per_node.iter().map(|n| n[i]).sum());
        // 80,000 allocations = 4,000 rounds of 20 (5 + 10 + 5): exact.
        assert_eq!(total, [20_000, 40_000, 20_000]);

        // Bytes: nothing lost or counted twice: the cursor's own tally of the
        // current turn plus whole turns accounts for every byte.
        let c = cursor("0-1", Granularity::Bytes(10_000), None);
        let placed: Vec<[u64; 2]> = std::thread::scope(|s| {
            (0..T)
                .map(|t| {
                    let c = &c;
                    s.spawn(move || {
                        let mut r = Rng(t as u64 + 1);
                        let mut n = [0u64; 2];
                        for _ in 0..PER {
                            let size = 1 + r.next() % 3000;
                            n[c.next(size as usize)] += size;
                        }
                        n
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect()
        });
        let (a, b) = (placed.iter().map(|n| n[0]).sum::<u64>(), placed.iter().map(|n| n[1]).sum::<u64>());
        // Each completed turn placed 10,000..13,000 bytes on alternating nodes.
        let turns_lo = (a + b) / 13_000;
        assert!(a.abs_diff(b) <= 13_000 + turns_lo * 3_000 / 2, "nodes {a} vs {b}");
        assert!(a.abs_diff(b) < (a + b) / 50, "nodes {a} vs {b}");
    }
}
