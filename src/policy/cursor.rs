//! The interleave cursor: which node the next allocation of an interleave
//! policy goes to. Shared by any number of threads, lock-free, and exact:
//!
//! - `Count(n)`: every turn has exactly `n` allocations. One `fetch_add` per
//!   allocation: the k-th allocation (in the counter's order) belongs to turn
//!   `k / n`.
//! - `Bytes(b)`: each node keeps a running total of the bytes placed on it,
//!   and a node's turn ends at the first allocation that brings its total to
//!   its next multiple of `b` (its target: `b` × the turns it has had,
//!   counting this one). What a turn overshoots is carried into the node's
//!   next turn, which is that much shorter, so a node's total never runs more
//!   than one allocation past `b` × its turns: over any run, two nodes of
//!   equal weight differ by at most `b` plus one allocation.
//!
//! `Count(n)` places `n` allocations per turn whatever their sizes; when
//! sizes correlate with the rotation the nodes drift apart by whole turns'
//! worth of bytes, without bound: Rientjes' objection to counting (both shown
//! in the tests).
//!
//! # How `Bytes(b)` stays exact without a lock
//!
//! The turn in progress is one word, `(round << 16) | turn`. An allocation
//! reads it, adds its size to the turn's node's total with `fetch_add`, and
//! compares the total before the add with the turn's target:
//!
//! - below, and still below after the add: placed on that node;
//! - below, and at or over after the add: placed there, and this allocation
//!   ends the turn: it advances the word (one CAS; at most one allocation can
//!   see its total cross a given target);
//! - already at or over: the turn ended under it (another allocation crossed
//!   first). It takes its bytes back, helps advance the word (so no thread
//!   ever waits on a preempted one), and starts again.
//!
//! The round number in the word makes it unique (no ABA across rounds).

use super::{Granularity, Interleave};
use crate::sync::{AtomicU64, Ordering, spin_loop};
use crate::topology::MAX_NODES;

/// Most turns in one round (the weights' sum).
pub const MAX_ROUND: usize = 1024;

const TURN_BITS: u32 = 16;
const TURN_MASK: u64 = (1 << TURN_BITS) - 1;

/// Where one allocation goes: its node, and which turn it belongs to (turns
/// are numbered in the cursor's order; consecutive allocations of one turn
/// share the number, so an interleaver can align the start of each turn).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pick {
    /// The node.
    pub node: usize,
    /// The turn's number.
    pub turn: u64,
}

/// See the module docs.
///
/// ```
/// use numaweave::policy::{Cursor, Granularity, Interleave};
/// let i = Interleave::new("0-1".parse().unwrap(), Granularity::Bytes(4096)).unwrap();
/// let c = Cursor::new(&i);
/// // 3 KiB stays on node 0, the next 2 KiB brings it past 4 KiB: still node 0,
/// // and its turn ends; node 1's turn follows.
/// assert_eq!([c.next(3072), c.next(2048), c.next(100)], [0, 0, 1]);
/// // Node 0 overshot by 1 KiB: its next turn ends 1 KiB earlier.
/// assert_eq!([c.next(4000), c.next(3072), c.next(1)], [1, 0, 1]);
/// assert_eq!(c.placed(0), 8192);
/// ```
pub struct Cursor {
    round: [u8; MAX_ROUND],
    /// For each turn, how many turns its node had earlier in the round.
    before: [u16; MAX_ROUND],
    /// Turns per round of each node (its weight).
    turns: [u16; MAX_NODES],
    len: u64,
    granularity: Granularity,
    /// `Count`: allocations so far. `Bytes`: `(round << 16) | turn`.
    state: AtomicU64,
    /// `Bytes`: bytes placed on each node so far.
    placed: [AtomicU64; MAX_NODES],
    /// `Count`, exclusive picks: position in the round, allocations in the
    /// current turn, turns so far (kept instead of dividing the counter each
    /// time).
    ex_pos: AtomicU64,
    ex_in_turn: AtomicU64,
    ex_turn: AtomicU64,
    /// Added to every turn number: a cursor that replaces another (a thread
    /// interleaver's, when its weights change) numbers its turns after the
    /// old one's, so no turn number is seen twice.
    turn_base: u64,
}

impl Cursor {
    /// A cursor at the start of the first node's first turn.
    pub fn new(policy: &Interleave) -> Self {
        Self::new_after(policy, 0)
    }

    /// [`new`](Self::new), its turns numbered from `turn_base` on (see
    /// [`next_turn_base_exclusive`](Self::next_turn_base_exclusive)).
    pub(crate) fn new_after(policy: &Interleave, turn_base: u64) -> Self {
        let mut round = [0u8; MAX_ROUND];
        let mut before = [0u16; MAX_ROUND];
        let mut turns = [0u16; MAX_NODES];
        let mut len = 0;
        for n in policy.nodes().iter() {
            for _ in 0..policy.weight(n) {
                round[len] = n as u8;
                before[len] = turns[n];
                turns[n] += 1;
                len += 1;
            }
        }
        debug_assert!(len > 0 && len <= MAX_ROUND && MAX_NODES <= 256);
        Self {
            round,
            before,
            turns,
            len: len as u64,
            granularity: policy.granularity(),
            state: AtomicU64::new(0),
            placed: core::array::from_fn(|_| AtomicU64::new(0)),
            ex_pos: AtomicU64::new(0),
            ex_in_turn: AtomicU64::new(0),
            ex_turn: AtomicU64::new(0),
            turn_base,
        }
    }

    /// Exclusive picks: a turn number above every one this cursor gave, for
    /// the cursor that replaces it.
    ///
    /// # Safety
    /// As [`pick_exclusive`](Self::pick_exclusive).
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) unsafe fn next_turn_base_exclusive(&self) -> u64 {
        let last = match self.granularity {
            Granularity::Count(_) => self.ex_turn.load(Ordering::Relaxed),
            Granularity::Bytes(_) => self.state.load(Ordering::Relaxed),
        };
        self.turn_base + last + 1
    }

    /// The node for the next allocation of `size` bytes, advancing the cursor.
    #[inline]
    pub fn next(&self, size: usize) -> usize {
        self.pick(size).node
    }

    /// [`next`](Self::next), with the turn the allocation belongs to.
    #[inline]
    pub fn pick(&self, size: usize) -> Pick {
        match self.granularity {
            Granularity::Count(n) => {
                // Relaxed: the cursor orders allocations among themselves
                // (one location, one modification order); it publishes no
                // other memory.
                let k = self.state.fetch_add(1, Ordering::Relaxed);
                let turn = k / u64::from(n);
                Pick { node: usize::from(self.round[(turn % self.len) as usize]), turn: self.turn_base + turn }
            }
            Granularity::Bytes(b) => self.pick_bytes(size as u64, b),
        }
    }

    /// [`pick`](Self::pick) for a cursor only the calling thread uses: the
    /// same sequence, with plain loads and stores instead of atomic
    /// read-modify-writes (a thread-scoped interleave's cursor).
    ///
    /// # Safety
    /// No other thread uses the cursor while this runs (nor ever, between
    /// two exclusive picks, without synchronising with the caller).
    #[inline(always)]
    pub(crate) unsafe fn pick_exclusive(&self, size: usize) -> Pick {
        match self.granularity {
            Granularity::Count(n) => {
                // No division: the turn and the position in the round are
                // kept as they advance (the counter too, for `current`).
                let k = self.state.load(Ordering::Relaxed);
                self.state.store(k + 1, Ordering::Relaxed);
                let pos = self.ex_pos.load(Ordering::Relaxed);
                let c = self.ex_in_turn.load(Ordering::Relaxed) + 1;
                let turn = self.ex_turn.load(Ordering::Relaxed);
                let node = usize::from(self.round[pos as usize]);
                if c == u64::from(n) {
                    self.ex_in_turn.store(0, Ordering::Relaxed);
                    self.ex_pos.store(if pos + 1 == self.len { 0 } else { pos + 1 }, Ordering::Relaxed);
                    self.ex_turn.store(turn + 1, Ordering::Relaxed);
                } else {
                    self.ex_in_turn.store(c, Ordering::Relaxed);
                }
                Pick { node, turn: self.turn_base + turn }
            }
            Granularity::Bytes(b) => {
                let s = self.state.load(Ordering::Relaxed);
                let (node, target) = self.turn_target(s, b);
                let placed = self.placed[node].load(Ordering::Relaxed).saturating_add(size as u64);
                self.placed[node].store(placed, Ordering::Relaxed);
                if placed >= target {
                    self.state.store(self.next_turn(s), Ordering::Relaxed);
                }
                Pick { node, turn: self.turn_base + s }
            }
        }
    }

    /// Loom builds only: [`pick_exclusive`](Self::pick_exclusive) without
    /// its contract, for the models' negative control: a cursor that threads
    /// share must not take the exclusive path, and the model must see the
    /// allocations it then loses.
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn pick_exclusive_shared(&self, size: usize) -> Pick {
        // SAFETY: the exclusive path touches atomics only (relaxed loads and
        // stores, in-bounds indices): shared, its sequence breaks, which is
        // what the control looks for; memory does not.
        unsafe { self.pick_exclusive(size) }
    }

    /// Exclusive picks: what is left of the turn `last` (the last pick)
    /// belongs to, if that pick did not end it: allocations (`Count`) or bytes
    /// before the node's target (`Bytes`; the turn ends at the allocation
    /// that reaches it). 0 when the turn is over. Lets a caller serve the
    /// rest of a turn without picking, then [`settle_exclusive`](Self::settle_exclusive).
    ///
    /// # Safety
    /// As [`pick_exclusive`](Self::pick_exclusive).
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) unsafe fn turn_left_exclusive(&self, last: Pick) -> u64 {
        // SAFETY: the caller has the cursor exclusively (what `pick_exclusive`
        // asks, which `turn_exclusive` asks too).
        let (now, left) = unsafe { self.turn_exclusive() };
        if now.turn == last.turn { left } else { 0 }
    }

    /// Exclusive picks: the turn in progress, without booking anything: its
    /// node and turn ([`Pick`]), and what is left of it (allocations with
    /// `Count`, bytes before its node's target with `Bytes`; never 0). A
    /// caller may serve that much of it and then
    /// [`settle_exclusive`](Self::settle_exclusive).
    ///
    /// # Safety
    /// As [`pick_exclusive`](Self::pick_exclusive).
    #[inline(always)]
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) unsafe fn turn_exclusive(&self) -> (Pick, u64) {
        match self.granularity {
            Granularity::Count(n) => {
                let node = usize::from(self.round[self.ex_pos.load(Ordering::Relaxed) as usize]);
                let left = u64::from(n) - self.ex_in_turn.load(Ordering::Relaxed);
                (Pick { node, turn: self.turn_base + self.ex_turn.load(Ordering::Relaxed) }, left)
            }
            Granularity::Bytes(b) => {
                let s = self.state.load(Ordering::Relaxed);
                let (node, target) = self.turn_target(s, b);
                // A turn ends at the allocation reaching its target, so the
                // turn in progress is below it.
                let left = target.saturating_sub(self.placed[node].load(Ordering::Relaxed)).max(1);
                (Pick { node, turn: self.turn_base + s }, left)
            }
        }
    }

    /// Books `allocs` allocations of `bytes` in all, made within the turn
    /// [`turn_left_exclusive`](Self::turn_left_exclusive) described (and
    /// not past its end), as if each had been picked.
    ///
    /// # Safety
    /// As [`pick_exclusive`](Self::pick_exclusive).
    #[inline(always)]
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) unsafe fn settle_exclusive(&self, allocs: u64, bytes: u64) {
        if allocs == 0 {
            return;
        }
        match self.granularity {
            Granularity::Count(n) => {
                self.state.store(self.state.load(Ordering::Relaxed) + allocs, Ordering::Relaxed);
                let c = self.ex_in_turn.load(Ordering::Relaxed) + allocs;
                if c >= u64::from(n) {
                    let pos = self.ex_pos.load(Ordering::Relaxed);
                    self.ex_in_turn.store(0, Ordering::Relaxed);
                    self.ex_pos.store(if pos + 1 == self.len { 0 } else { pos + 1 }, Ordering::Relaxed);
                    self.ex_turn.store(self.ex_turn.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
                } else {
                    self.ex_in_turn.store(c, Ordering::Relaxed);
                }
            }
            Granularity::Bytes(b) => {
                let s = self.state.load(Ordering::Relaxed);
                let (node, target) = self.turn_target(s, b);
                let placed = self.placed[node].load(Ordering::Relaxed) + bytes;
                self.placed[node].store(placed, Ordering::Relaxed);
                if placed >= target {
                    self.state.store(self.next_turn(s), Ordering::Relaxed);
                }
            }
        }
    }

    fn pick_bytes(&self, size: u64, b: u64) -> Pick {
        loop {
            // Acquire pairs with the Release of the CAS that made this turn
            // current: its node's total already holds the ending allocation.
            let s = self.state.load(Ordering::Acquire);
            let (node, target) = self.turn_target(s, b);
            let old = self.placed[node].fetch_add(size, Ordering::AcqRel);
            if old < target {
                if old.saturating_add(size) >= target {
                    // Ours ends the turn. Only this allocation saw the total
                    // cross `target`; a helper may have advanced it already.
                    self.advance(s);
                }
                return Pick { node, turn: self.turn_base + s };
            }
            // The turn ended under us: give the bytes back, make sure the
            // word moves on, and try the next turn.
            self.placed[node].fetch_sub(size, Ordering::AcqRel);
            self.advance(s);
            spin_loop();
        }
    }

    /// Moves the word from turn `s` to the next one, unless someone did.
    fn advance(&self, s: u64) {
        // Release: the next turn's readers see this turn's total.
        let _ = self.state.compare_exchange(s, self.next_turn(s), Ordering::AcqRel, Ordering::Relaxed);
    }

    /// `Bytes`: the node of turn `s` (`(round << TURN_BITS) | turn`) and
    /// the byte total that ends it (a node's turns end at multiples of `b`,
    /// counted over all its turns so far, so overshoot carries over).
    #[inline(always)]
    fn turn_target(&self, s: u64, b: u64) -> (usize, u64) {
        let (r, t) = (s >> TURN_BITS, (s & TURN_MASK) as usize);
        let node = usize::from(self.round[t]);
        (node, (r * u64::from(self.turns[node]) + u64::from(self.before[t]) + 1).saturating_mul(b))
    }

    /// `Bytes`: the turn after `s`.
    #[inline(always)]
    fn next_turn(&self, s: u64) -> u64 {
        let (r, t) = (s >> TURN_BITS, s & TURN_MASK);
        if t + 1 == self.len { (r + 1) << TURN_BITS } else { (r << TURN_BITS) | (t + 1) }
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

    /// With `Bytes`, the bytes placed on `node` so far (0 with `Count`).
    pub fn placed(&self, node: usize) -> u64 {
        match self.granularity {
            Granularity::Bytes(_) => self.placed.get(node).map_or(0, |p| p.load(Ordering::Relaxed)),
            Granularity::Count(_) => 0,
        }
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

    use crate::rng::Rng;

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
        let sizes = [400, 400, 400, 1, 999, 500, 10, 2000, 10];
        let got: Vec<usize> = sizes.iter().map(|&s| c.next(s)).collect();
        // 400+400+400 = 1200 ≥ 1000 on node 0; node 1: 1+999 = 1000; node 0
        // carries 200, so its second turn ends at 2000 in all: 500 + 10 + 2000
        // would pass it at the 2000; then node 1.
        assert_eq!(got, [0, 0, 0, 1, 1, 0, 0, 0, 1]);
        assert_eq!((c.placed(0), c.placed(1)), (3710, 1010));
    }

    /// Rientjes' point, and the bound: on a stream of mixed sizes, part of
    /// which follows the rotation, `Bytes(b)` keeps every pair of nodes
    /// within `b` plus one allocation of each other at every step (weighted:
    /// per unit of weight), where `Count(n)` lets them drift apart without
    /// bound.
    #[test]
    fn bytes_stay_balanced_where_counts_drift() {
        const B: u64 = 2 << 20;
        for weights in [None, Some(&[3u8, 1, 2, 1][..])] {
            let w: Vec<u64> = weights.map_or(vec![1; 4], |w| w.iter().map(|&x| u64::from(x)).collect());
            let bytes = cursor("0-3", Granularity::Bytes(B), weights);
            let count = cursor("0-3", Granularity::Count(8), weights);
            let (mut by_bytes, mut by_count) = ([0u64; 4], [0u64; 4]);
            let mut r = Rng(7);
            let mut largest = 0u64;
            let mut worst = 0u64;
            for i in 0..200_000u64 {
                // Mixed I/O sizes, 4 KiB–64 KiB, odd sizes, and a pattern that
                // follows the rotation (one run of 8 in 4 is 128 KiB buffers).
                let size = match i % 7 {
                    0 => 1 + r.next() % 9000,
                    _ if (i / 8) % 4 == 0 => 128 << 10,
                    _ => 4096 << (r.next() % 5),
                };
                largest = largest.max(size);
                by_bytes[bytes.next(size as usize)] += size;
                by_count[count.next(size as usize)] += size;
                // Per unit of weight, every node is within one turn plus one
                // allocation of every other (checked at every step).
                let norm: Vec<u64> = (0..4).map(|n| by_bytes[n] / w[n]).collect();
                let spread = norm.iter().max().unwrap() - norm.iter().min().unwrap();
                worst = worst.max(spread);
                assert!(spread <= B + largest, "step {i}: per-weight totals {norm:?} spread {spread}");
            }
            for (n, &placed) in by_bytes.iter().enumerate() {
                assert_eq!(bytes.placed(n), placed);
            }
            let spread = |v: &[u64; 4]| {
                let norm: Vec<u64> = (0..4).map(|n| v[n] / w[n]).collect();
                norm.iter().max().unwrap() - norm.iter().min().unwrap()
            };
            let (sb, sc) = (spread(&by_bytes), spread(&by_count));
            println!(
                "weights {weights:?}: after 200,000 allocations, Bytes(2M) spread {sb} (worst {worst}), Count(8) spread {sc}"
            );
            assert!(sc > 10 * (B + largest), "Count(8) should drift far past Bytes' bound: {sc} vs {sb}");
        }
    }

    #[test]
    fn exclusive_picks_give_the_shared_sequence() {
        for g in [Granularity::Count(3), Granularity::Bytes(5000)] {
            let (a, b) = (cursor("0-2", g, Some(&[2, 1, 1])), cursor("0-2", g, Some(&[2, 1, 1])));
            let mut r = Rng(3);
            for _ in 0..10_000 {
                let size = (1 + r.next() % 3000) as usize;
                // SAFETY: `b` is used by this thread alone.
                assert_eq!(a.pick(size), unsafe { b.pick_exclusive(size) });
            }
        }
    }

    /// Serves what is left of a turn of `node` (`left`, as the exclusive
    /// calls give it), at most `stop` allocations of `sizes` from `*i` on,
    /// without picking, records their node, and books them into `c`.
    ///
    /// # Safety
    /// `c` is the calling thread's alone.
    unsafe fn serve_and_settle(
        c: &Cursor,
        node: usize,
        mut left: u64,
        stop: usize,
        sizes: &[u64],
        i: &mut usize,
        got: &mut Vec<usize>,
    ) {
        let (mut n, mut bytes) = (0, 0);
        while left > 0 && *i < sizes.len() && (n as usize) < stop {
            got.push(node);
            left = match c.granularity() {
                Granularity::Count(_) => left - 1,
                Granularity::Bytes(_) => left.saturating_sub(sizes[*i]),
            };
            n += 1;
            bytes += sizes[*i];
            *i += 1;
        }
        // SAFETY: the caller has the cursor exclusively, as `settle_exclusive`
        // asks.
        unsafe { c.settle_exclusive(n, bytes) };
    }

    /// Serving the rest of a turn from `turn_left_exclusive` and booking it
    /// with `settle_exclusive` gives the same nodes as picking every time.
    #[test]
    fn settled_turns_match_picking_every_time() {
        for g in [Granularity::Count(5), Granularity::Bytes(7000)] {
            let (a, b) = (cursor("0-2", g, Some(&[2, 1, 1])), cursor("0-2", g, Some(&[2, 1, 1])));
            let mut r = Rng(11);
            let sizes: Vec<u64> = (0..20_000).map(|_| 1 + r.next() % 3000).collect();
            let want: Vec<usize> = sizes.iter().map(|&s| a.next(s as usize)).collect();
            let mut got = Vec::new();
            let mut i = 0;
            while i < sizes.len() {
                // SAFETY: `b` is this thread's alone.
                unsafe {
                    let p = b.pick_exclusive(sizes[i] as usize);
                    got.push(p.node);
                    i += 1;
                    serve_and_settle(&b, p.node, b.turn_left_exclusive(p), usize::MAX, &sizes, &mut i, &mut got);
                }
            }
            assert_eq!(got, want, "{g:?}");
        }
    }

    /// Serving whole turns from `turn_exclusive` (nothing picked) and
    /// booking them with `settle_exclusive`, sometimes stopping early, gives
    /// the same nodes as picking every time.
    #[test]
    fn turns_served_without_picking_match_picking_every_time() {
        for g in [Granularity::Count(5), Granularity::Bytes(7000)] {
            let (a, b) = (cursor("0-2", g, Some(&[2, 1, 1])), cursor("0-2", g, Some(&[2, 1, 1])));
            let mut r = Rng(17);
            let sizes: Vec<u64> = (0..20_000).map(|_| 1 + r.next() % 3000).collect();
            let want: Vec<usize> = sizes.iter().map(|&s| a.next(s as usize)).collect();
            let mut got = Vec::new();
            let mut i = 0;
            while i < sizes.len() {
                // SAFETY: `b` is this thread's alone.
                unsafe {
                    let (p, left) = b.turn_exclusive();
                    assert!(left > 0);
                    // Stop early now and then, as a pool taken back does.
                    let stop = 1 + r.next() as usize % 4;
                    serve_and_settle(&b, p.node, left, stop, &sizes, &mut i, &mut got);
                }
            }
            assert_eq!(got, want, "{g:?}");
        }
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
        // The cursor's totals are exactly what the threads placed, and the
        // nodes are within one turn plus one allocation of each other.
        assert_eq!((c.placed(0), c.placed(1)), (a, b));
        assert!(a.abs_diff(b) <= 10_000 + 3_000, "nodes {a} vs {b}");
    }
}
