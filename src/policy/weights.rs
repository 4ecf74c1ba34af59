//! Interleave weights from bandwidths: the kernel's reduction of
//! bandwidths to small integer weights, and the weights a thread on each
//! node gets for `weights=auto` ([`Topology::interleave_weights`]).

use crate::topology::{MAX_NODES, NodeSet, PerfSource, Topology};

/// Where a set of interleave weights came from
/// ([`Topology::interleave_weights`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightSource {
    /// In proportion to the bandwidth the initiator sees to each node, from
    /// this source.
    Bandwidth(PerfSource),
    /// The kernel's weighted-interleave weights
    /// (`/sys/kernel/mm/mempolicy/weighted_interleave/`): some node's
    /// bandwidth was unknown.
    Kernel,
    /// Every node weight 1: neither bandwidths nor kernel weights.
    Equal,
}

impl core::fmt::Display for WeightSource {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            WeightSource::Bandwidth(s) => write!(f, "bandwidth from {s}"),
            WeightSource::Kernel => f.write_str("the kernel's weighted-interleave weights (bandwidth unknown)"),
            WeightSource::Equal => f.write_str("equal (no bandwidth, no kernel weights)"),
        }
    }
}

/// Interleave weights derived for one initiator: one per node of the set
/// (0 elsewhere), and where they came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AutoWeights {
    /// Weight by node id.
    pub weights: [u8; MAX_NODES],
    /// Their source.
    pub source: WeightSource,
}

impl AutoWeights {
    /// The weights of `nodes`, in node order.
    pub fn of(&self, nodes: NodeSet) -> Vec<u8> {
        nodes.iter().map(|n| self.weights[n]).collect()
    }
}

/// The kernel's weight scale: weights are in `1..=WEIGHTINESS` before the
/// GCD reduction (`mm/mempolicy.c`, `weightiness`).
const WEIGHTINESS: u64 = 32;

/// Bandwidths to small integer weights as the kernel reduces them
/// (`reduce_interleave_weights`, Linux 6.16): each node `32 × bw / Σ bw`
/// (at least 1), then divided by their GCD, so 1:2 rather than 16:32.
pub fn reduce_weights(bandwidth: &[u32]) -> [u8; MAX_NODES] {
    debug_assert!(bandwidth.len() <= MAX_NODES);
    let sum: u64 = bandwidth.iter().map(|&b| u64::from(b)).sum();
    let mut w = [0u8; MAX_NODES];
    let mut gcd = 0u64;
    for (i, &b) in bandwidth.iter().enumerate() {
        let scaled = WEIGHTINESS * u64::from(b);
        let v = if b > 0 && sum < scaled { scaled / sum } else { 1 };
        w[i] = v as u8;
        gcd = if gcd == 0 { v } else { gcd_of(gcd, v) };
    }
    for x in &mut w[..bandwidth.len()] {
        *x = (u64::from(*x) / gcd.max(1)) as u8;
    }
    w
}

fn gcd_of(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Topology {
    /// Interleave weights over `nodes` for a thread on `initiator`: in
    /// proportion to the bandwidth it sees to each (reduced as the kernel
    /// does, [`reduce_weights`]); where some node's is unknown, the
    /// kernel's weights; where those are missing too, equal.
    ///
    /// ```
    /// use numaweave::policy::WeightSource;
    /// use numaweave::topology::{PerfSource, Topology};
    /// // Two sockets, a CXL node behind each (the numa-vm HMAT defaults, GB/s).
    /// let mut b = Topology::synthetic(2).memory_only_nodes(2);
    /// for (i, t, gbps) in [(0, 0, 100), (0, 1, 50), (0, 2, 30), (0, 3, 15),
    ///                      (1, 0, 50), (1, 1, 100), (1, 2, 15), (1, 3, 30)] {
    ///     b = b.bandwidth(i, t, gbps * 1000);
    /// }
    /// let t = b.build().unwrap();
    /// let all = t.memory_nodes();
    /// let w0 = t.interleave_weights(0, all);
    /// assert_eq!(w0.of(all), [8, 4, 2, 1]);
    /// assert_eq!(t.interleave_weights(1, all).of(all), [4, 8, 1, 2]);
    /// assert_eq!(w0.source, WeightSource::Bandwidth(PerfSource::Synthetic));
    /// ```
    pub fn interleave_weights(&self, initiator: usize, nodes: NodeSet) -> AutoWeights {
        let mut out = AutoWeights { weights: [0; MAX_NODES], source: WeightSource::Equal };
        let mut bw = [0u32; MAX_NODES];
        let mut known = true;
        for (k, n) in nodes.iter().enumerate() {
            bw[k] = self.bandwidth(initiator, n).unwrap_or(0);
            known &= bw[k] != 0;
        }
        if known && !nodes.is_empty() {
            let w = reduce_weights(&bw[..nodes.len()]);
            for (k, n) in nodes.iter().enumerate() {
                out.weights[n] = w[k];
            }
            out.source = WeightSource::Bandwidth(self.perf_source());
        } else if nodes.iter().all(|n| self.kernel_interleave_weight(n).is_some()) && !nodes.is_empty() {
            for n in nodes.iter() {
                out.weights[n] = self.kernel_interleave_weight(n).unwrap_or(1);
            }
            out.source = WeightSource::Kernel;
        } else {
            for n in nodes.iter() {
                out.weights[n] = 1;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_reduction_of_bandwidths_to_weights() {
        // numa-vm's defaults from socket 0: local 100, other socket 50,
        // its CXL 30, the other's 15 (GB/s).
        assert_eq!(reduce_weights(&[100, 50, 30, 15])[..4], [8, 4, 2, 1]);
        // The kernel's global weights for the same machine (each target's
        // best initiator): 100, 100, 30, 30.
        assert_eq!(reduce_weights(&[100, 100, 30, 30])[..4], [4, 4, 1, 1]);
        assert_eq!(reduce_weights(&[5, 5])[..2], [1, 1]);
        // A node with a tiny share still gets a turn.
        assert_eq!(reduce_weights(&[1000, 1])[..2], [31, 1]);
        assert_eq!(reduce_weights(&[0, 10])[..2], [1, 32]);
    }

    #[test]
    fn each_socket_weights_by_its_own_bandwidth() {
        let t = crate::topology::cxl_machine().build().unwrap();
        let all = t.memory_nodes();
        assert_eq!(t.interleave_weights(0, all).of(all), [8, 4, 2, 1]);
        assert_eq!(t.interleave_weights(1, all).of(all), [4, 8, 1, 2]);
        // Over a subset, the subset's bandwidths only (32 x 50/150 and
        // 32 x 100/150, rounded down as the kernel does: not 1:2).
        let dram: NodeSet = "0-1".parse().unwrap();
        assert_eq!(t.interleave_weights(1, dram).of(dram), [10, 21]);
        assert_eq!(t.latency(1, 3), Some(250));
        // A bandwidth missing: the kernel's weights, then equal ones.
        let partial = Topology::synthetic(2).bandwidth(0, 0, 100).build().unwrap();
        let w = partial.interleave_weights(0, partial.memory_nodes());
        assert_eq!((w.of(partial.memory_nodes()), w.source), (vec![1, 1], WeightSource::Equal));
        let kernel = Topology::synthetic(2).kernel_weight(0, 3).kernel_weight(1, 1).build().unwrap();
        let w = kernel.interleave_weights(1, kernel.memory_nodes());
        assert_eq!((w.of(kernel.memory_nodes()), w.source), (vec![3, 1], WeightSource::Kernel));
    }
}
