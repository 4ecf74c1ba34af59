//! Memory performance: the bandwidth and latency each initiator node (a node
//! with CPUs) sees to each target node (a node with memory), the kernel's
//! memory tiers, and its weighted-interleave weights. What a CXL machine's
//! interleave weights and tier placement are derived from.
//!
//! Sources, best first ([`PerfSource`]):
//!
//! 1. The ACPI HMAT (`/sys/firmware/acpi/tables/HMAT`, readable by root):
//!    its System Locality Latency and Bandwidth Information structures give
//!    the whole initiator × target matrix, in their base units (latency in
//!    picoseconds since revision 2, bandwidth in MB/s), normalised as the
//!    kernel's `hmat_normalize` does. Proximity domains map onto node ids
//!    in ascending order (the kernel numbers nodes in SRAT order, ascending
//!    domains on every firmware seen), and the result is checked against
//!    what the kernel itself derived (`access1`, below): a table that
//!    disagrees is not used.
//! 2. sysfs `nodeN/access1/initiators/` (`access0` where there is no
//!    `access1`): per target, only its best CPU initiators' figures. Other
//!    initiators' are estimated by the SLIT distances (bandwidth scaled by
//!    `d(best, t) / d(i, t)`, latency by the inverse).
//! 3. Nothing (distances only): [`PerfSource::Unknown`].
//!
//! Access bandwidth and latency where the table gives them; else the lower
//! of read and write bandwidth and the higher of read and write latency (the
//! kernel's weights use the lower bandwidth too).
//!
//! All of it is read into fixed tables with stack buffers (a weighted
//! interleave made during the allocator's start-up needs it), once, on
//! first use: a process that never asks reads none of it.
//!
//! Files: `hmat.rs` parses the firmware's table, `access.rs` reads what
//! sysfs says (access classes, tiers, the kernel's weights), `machine.rs`
//! holds the machine's tables, read once; this file, what a [`Topology`]
//! answers from them. Interleave weights from bandwidths are the policy
//! layer's (`policy/weights.rs`).

mod access;
mod hmat;
mod machine;

use access::read_access;
pub(crate) use access::read_kernel_weight;
use hmat::parse_hmat;
use machine::machine_perf;
#[cfg(not(loom))]
pub(crate) use machine::{hold_for_fork, release_after_fork};

use super::{MAX_NODES, NodeSet, Topology};
use crate::os::file;

/// Where a topology's memory performance figures came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PerfSource {
    /// The ACPI HMAT: every initiator × target pair as the firmware gives it.
    Hmat,
    /// sysfs `access1`/`access0`: each target's best initiators exactly, the
    /// other initiators estimated from the distances.
    SysfsAccess,
    /// Given to a synthetic topology ([`SyntheticBuilder::bandwidth`](super::SyntheticBuilder::bandwidth)).
    Synthetic,
    /// None: the firmware gives no memory performance (or the topology is
    /// synthetic and was given none).
    Unknown,
}

impl core::fmt::Display for PerfSource {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            PerfSource::Hmat => "the ACPI HMAT",
            PerfSource::SysfsAccess => "sysfs access1 (best initiators; others estimated by distance)",
            PerfSource::Synthetic => "the synthetic topology",
            PerfSource::Unknown => "nowhere (no HMAT, no sysfs access figures)",
        })
    }
}

/// The memory performance tables of a topology (see the module docs).
#[derive(Clone)]
pub(crate) struct MemoryPerformance {
    pub(crate) source: PerfSource,
    /// MB/s, by initiator then target; 0: not known.
    pub(crate) bandwidth: [[u32; MAX_NODES]; MAX_NODES],
    /// ns, by initiator then target; 0: not known.
    pub(crate) latency: [[u16; MAX_NODES]; MAX_NODES],
    /// The node's memory tier, 1 the top; 0: not known.
    pub(crate) tier: [u8; MAX_NODES],
    /// The kernel's weighted-interleave weight of each node; 0: none.
    pub(crate) kernel_weight: [u8; MAX_NODES],
    /// The kernel's `weighted_interleave/auto` (Linux 6.16+), where it has one.
    pub(crate) kernel_auto: Option<bool>,
}

impl MemoryPerformance {
    pub(crate) const fn unknown() -> Self {
        Self {
            source: PerfSource::Unknown,
            bandwidth: [[0; MAX_NODES]; MAX_NODES],
            latency: [[0; MAX_NODES]; MAX_NODES],
            tier: [0; MAX_NODES],
            kernel_weight: [0; MAX_NODES],
            kernel_auto: None,
        }
    }

    /// Fills empty tables with the machine's: HMAT, else sysfs access
    /// figures; tiers and kernel weights either way. Never allocates.
    fn fill_machine(&mut self, t: &Topology) {
        let p = self;
        let hmat = c"/sys/firmware/acpi/tables/HMAT";
        let mut fetch = |off: u64, buf: &mut [u8]| file::read_at(hmat, off, buf);
        if parse_hmat(&mut fetch, t.online, p).is_ok() && p.agrees_with_sysfs(t) {
            p.source = PerfSource::Hmat;
        } else {
            p.bandwidth = [[0; MAX_NODES]; MAX_NODES];
            p.latency = [[0; MAX_NODES]; MAX_NODES];
            if p.read_sysfs_access(t) {
                p.source = PerfSource::SysfsAccess;
            }
        }
        p.read_tiers();
        p.read_kernel_weights(t.online);
    }

    /// Whether the matrix from the HMAT gives each target the best
    /// bandwidth the kernel reports for it (`access1`), where it reports
    /// one: the check that proximity domains were mapped to the right nodes.
    fn agrees_with_sysfs(&self, t: &Topology) -> bool {
        // A kernel that reports nothing (no HMAT support in sysfs) leaves
        // the table, parsed cleanly, standing.
        t.memory_nodes().iter().all(|target| match read_access(target) {
            Some(best) if best.bandwidth != 0 => {
                t.cpu_nodes().iter().map(|i| self.bandwidth[i][target]).max() == Some(best.bandwidth)
            }
            _ => true,
        })
    }
}

impl Topology {
    /// This topology's memory performance tables: the machine's (read on
    /// first use) or what a synthetic topology was given; `None` for a
    /// synthetic topology given none. (Not a static of empty tables: its
    /// 24 KiB of read-only data pushed the start-up's strings into another
    /// 64 KiB of the library, which every process then kept resident.)
    pub(crate) fn perf(&self) -> Option<&MemoryPerformance> {
        match &self.perf {
            Some(p) => Some(p),
            None if self.is_synthetic() => None,
            None => Some(machine_perf(self)),
        }
    }

    /// Where the bandwidth and latency figures came from.
    ///
    /// ```
    /// use numaweave::topology::{PerfSource, Topology};
    /// let t = Topology::synthetic(2).bandwidth(0, 1, 50_000).build().unwrap();
    /// assert_eq!(t.perf_source(), PerfSource::Synthetic);
    /// assert_eq!(Topology::synthetic(2).build().unwrap().perf_source(), PerfSource::Unknown);
    /// ```
    pub fn perf_source(&self) -> PerfSource {
        self.perf().map_or(PerfSource::Unknown, |p| p.source)
    }

    /// The bandwidth (MB/s) a thread on `initiator` sees to memory on
    /// `target`, where known.
    pub fn bandwidth(&self, initiator: usize, target: usize) -> Option<u32> {
        let v = *self.perf()?.bandwidth.get(initiator)?.get(target)?;
        (v != 0).then_some(v)
    }

    /// The latency (ns) a thread on `initiator` sees to memory on `target`,
    /// where known.
    pub fn latency(&self, initiator: usize, target: usize) -> Option<u32> {
        let v = *self.perf()?.latency.get(initiator)?.get(target)?;
        (v != 0).then_some(u32::from(v))
    }

    /// The kernel's memory tier of `node`, 1 the top (fastest), where the
    /// kernel has tiers (`/sys/devices/virtual/memory_tiering`).
    pub fn memory_tier(&self, node: usize) -> Option<u8> {
        self.perf()?.tier.get(node).copied().filter(|&t| t != 0)
    }

    /// The memory nodes below the top tier: by the kernel's tiers where it
    /// has more than one, else the memory-only nodes whose bandwidth from
    /// every CPU node is below that node's own memory's (a CXL expander).
    pub fn lower_tier_nodes(&self) -> NodeSet {
        let p = self.perf();
        let mem = self.memory_nodes();
        let top = mem.iter().filter_map(|n| self.memory_tier(n)).min();
        let mut out = NodeSet::new();
        if mem.iter().filter_map(|n| self.memory_tier(n)).any(|t| Some(t) != top) {
            for n in mem.iter() {
                if self.memory_tier(n).is_some_and(|t| Some(t) != top) {
                    out.insert(n);
                }
            }
            return out;
        }
        for n in self.memory_only_nodes().iter() {
            // (Nothing known of the bandwidths: every figure 0.)
            let slower = self.cpu_nodes().iter().all(|i| {
                let (own, there) = p.map_or((0, 0), |p| (p.bandwidth[i][i], p.bandwidth[i][n]));
                own == 0 || there == 0 || there < own
            });
            if slower {
                out.insert(n);
            }
        }
        out
    }

    /// The lower-tier node nearest a thread on `from` (highest bandwidth,
    /// then shortest distance, then lowest id); `None` where the machine
    /// has no lower tier.
    pub fn nearest_lower_tier(&self, from: usize) -> Option<usize> {
        self.nearest_lower_tier_among(from, |_| true)
    }

    /// [`nearest_lower_tier`](Self::nearest_lower_tier) among the
    /// lower-tier nodes `keep` accepts (the allocator: those it has an
    /// arena for).
    pub(crate) fn nearest_lower_tier_among(&self, from: usize, keep: impl Fn(usize) -> bool) -> Option<usize> {
        self.lower_tier_nodes().iter().filter(|&n| keep(n)).max_by_key(|&n| {
            (self.bandwidth(from, n).unwrap_or(0), core::cmp::Reverse(self.distance(from, n)), core::cmp::Reverse(n))
        })
    }

    /// The kernel's weighted-interleave weight of `node` (Linux 6.9+).
    pub fn kernel_interleave_weight(&self, node: usize) -> Option<u8> {
        self.perf()?.kernel_weight.get(node).copied().filter(|&w| w != 0)
    }

    /// Whether the kernel derives its weights itself
    /// (`weighted_interleave/auto`, Linux 6.16+), where it says.
    pub fn kernel_weights_auto(&self) -> Option<bool> {
        self.perf()?.kernel_auto
    }

    /// The bandwidth and latency matrices as text (the topology's display
    /// and `numaweave topology`), one row per CPU node; empty when nothing
    /// is known.
    pub(crate) fn write_perf(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        if self.perf_source() != PerfSource::Unknown {
            writeln!(
                f,
                "memory performance from {}: bandwidth GB/s / latency ns, initiator -> target",
                self.perf_source()
            )?;
            write!(f, "{:>9}", "")?;
            for tgt in self.memory_nodes().iter() {
                write!(f, " {:>11}", format!("node {tgt}"))?;
            }
            writeln!(f)?;
            for i in self.cpu_nodes().iter() {
                write!(f, "  node {i:<2}")?;
                for tgt in self.memory_nodes().iter() {
                    let bw =
                        self.bandwidth(i, tgt).map_or("-".into(), |b| format!("{}.{}", b / 1000, (b % 1000) / 100));
                    let lat = self.latency(i, tgt).map_or("-".into(), |l| l.to_string());
                    write!(f, " {:>11}", format!("{bw}/{lat}"))?;
                }
                writeln!(f)?;
            }
        }
        let lower = self.lower_tier_nodes();
        if !lower.is_empty() {
            let kernel = self.memory_nodes().iter().any(|n| self.memory_tier(n).is_some_and(|t| t > 1));
            writeln!(
                f,
                "lower memory tier ({}): node{} {lower}",
                if kernel { "kernel memory tiers" } else { "memory-only nodes slower than local memory" },
                if lower.len() == 1 { "" } else { "s" }
            )?;
        }
        let nodes = self.memory_nodes();
        if nodes.iter().any(|n| self.kernel_interleave_weight(n).is_some()) {
            write!(f, "kernel weighted interleave:")?;
            for n in nodes.iter() {
                write!(f, " {n}:{}", self.kernel_interleave_weight(n).unwrap_or(0))?;
            }
            match self.kernel_weights_auto() {
                Some(true) => writeln!(f, " (auto, from bandwidth)")?,
                Some(false) => writeln!(f, " (set by hand)")?,
                None => writeln!(f)?,
            }
        }
        Ok(())
    }
}

/// For tests: two sockets with a CXL node behind each (numa-vm's `--hmat`
/// defaults: GB/s and ns), as a synthetic topology's builder.
#[cfg(test)]
pub(crate) fn cxl_machine() -> crate::topology::SyntheticBuilder {
    let mut b = Topology::synthetic(2).memory_only_nodes(2);
    for (i, t, gbps, ns) in [
        (0, 0, 100, 80),
        (0, 1, 50, 140),
        (0, 2, 30, 250),
        (0, 3, 15, 350),
        (1, 0, 50, 140),
        (1, 1, 100, 80),
        (1, 2, 15, 350),
        (1, 3, 30, 250),
    ] {
        b = b.bandwidth(i, t, gbps * 1000).latency(i, t, ns);
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lower_tier_is_the_slower_memory_nearest_each_socket() {
        let t = cxl_machine().build().unwrap();
        assert_eq!(t.lower_tier_nodes().to_string(), "2-3");
        assert_eq!((t.nearest_lower_tier(0), t.nearest_lower_tier(1)), (Some(2), Some(3)));
        // The kernel's tiers, where it has several, decide.
        let tiers =
            cxl_machine().memory_tier(0, 1).memory_tier(1, 1).memory_tier(2, 1).memory_tier(3, 2).build().unwrap();
        assert_eq!(tiers.lower_tier_nodes().to_string(), "3");
        assert_eq!(tiers.nearest_lower_tier(0), Some(3));
        // No memory-only node: no lower tier.
        assert_eq!(Topology::synthetic(2).build().unwrap().nearest_lower_tier(0), None);
        // A memory-only node as fast as local memory is not a lower tier.
        let fast =
            Topology::synthetic(1).memory_only_nodes(1).bandwidth(0, 0, 100).bandwidth(0, 1, 100).build().unwrap();
        assert!(fast.lower_tier_nodes().is_empty());
        // The display shows the matrix and the tier.
        let text = t.to_string();
        assert!(text.contains("memory performance from the synthetic topology"), "{text}");
        assert!(text.contains("100.0/80") && text.contains("15.0/350"), "{text}");
        assert!(text.contains("lower memory tier") && text.contains("nodes 2-3"), "{text}");
    }
}
