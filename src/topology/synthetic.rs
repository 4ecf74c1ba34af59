//! Synthetic topologies for testing topology-dependent logic on a one-node
//! host: logical nodes laid over the real ones, as the kernel's `numa=fake`
//! splits real memory into emulated nodes.
//!
//! Memory placement stays real: the [OS layer](crate::os) is always given the
//! physical node behind a logical one ([`Topology::physical_node`]), so a
//! "node 3" allocation on a one-node host is an allocation on node 0 that the
//! rest of the crate books as node 3.

use super::perf::{MemoryPerformance, PerfSource};
use super::{LOCAL_DISTANCE, MAX_CPUS, MAX_NODES, NodeSet, REMOTE_DISTANCE, Source, Topology};
use crate::error::{Error, Result};

/// Distance to and from a memory-only node when the builder is not told
/// otherwise (the numa-vm harness uses the same: farther than a socket hop).
pub const MEMORY_ONLY_DISTANCE: u8 = 30;

/// Builds a synthetic [`Topology`]: `nodes` nodes with CPUs (numbered from 0,
/// `cpus_per_node` consecutive CPU ids each), then `memory_only` nodes with
/// memory and no CPU. Distances default to 10 local, 20 between CPU nodes and
/// 30 to or from a memory-only node. Node ids run from 0 unless
/// [`ids`](Self::ids) gives others: a machine may have nodes 0 and 2 only.
///
/// ```
/// use numaweave::topology::Topology;
/// let t = Topology::synthetic(2)
///     .cpus_per_node(4)
///     .memory_only_nodes(1)
///     .distance(0, 1, 21)
///     .build()
///     .unwrap();
/// assert!(t.is_synthetic());
/// assert_eq!(t.nodes().to_string(), "0-2");
/// assert_eq!(t.memory_only_nodes().to_string(), "2");
/// assert_eq!(t.cpus_of(1).to_string(), "4-7");
/// assert_eq!(t.distance(1, 0), 21);
/// assert_eq!(t.nodes_by_distance(2).collect::<Vec<_>>(), [2, 0, 1]);
/// ```
#[derive(Clone)]
pub struct SyntheticBuilder {
    nodes: usize,
    cpus_per_node: usize,
    memory_only: usize,
    memory_per_node: u64,
    distance: [[u8; MAX_NODES]; MAX_NODES],
    allowed: Option<NodeSet>,
    ids: Option<NodeSet>,
    perf: Option<Box<MemoryPerformance>>,
}

impl SyntheticBuilder {
    /// `nodes` nodes with one CPU each and 1 GiB of memory each.
    pub fn new(nodes: usize) -> Self {
        Self {
            nodes,
            cpus_per_node: 1,
            memory_only: 0,
            memory_per_node: 1 << 30,
            distance: [[0; MAX_NODES]; MAX_NODES],
            allowed: None,
            ids: None,
            perf: None,
        }
    }

    fn perf_mut(&mut self) -> &mut MemoryPerformance {
        self.perf.get_or_insert_with(|| {
            let mut p = Box::new(MemoryPerformance::unknown());
            p.source = PerfSource::Synthetic;
            p
        })
    }

    /// The bandwidth, in MB/s, a thread on node `initiator` sees to memory
    /// on node `target` (as an HMAT gives it); by node id. Pairs not given
    /// are unknown ([`Topology::bandwidth`] is `None`).
    pub fn bandwidth(mut self, initiator: usize, target: usize, mb_per_s: u32) -> Self {
        if initiator < MAX_NODES && target < MAX_NODES {
            self.perf_mut().bandwidth[initiator][target] = mb_per_s;
        }
        self
    }

    /// The latency, in ns, a thread on `initiator` sees to memory on `target`.
    pub fn latency(mut self, initiator: usize, target: usize, ns: u16) -> Self {
        if initiator < MAX_NODES && target < MAX_NODES {
            self.perf_mut().latency[initiator][target] = ns;
        }
        self
    }

    /// The kernel's memory tier of `node`, 1 the top (as
    /// `/sys/devices/virtual/memory_tiering` ranks them).
    pub fn memory_tier(mut self, node: usize, tier: u8) -> Self {
        if node < MAX_NODES {
            self.perf_mut().tier[node] = tier;
        }
        self
    }

    /// The kernel's weighted-interleave weight of `node`
    /// (`/sys/kernel/mm/mempolicy/weighted_interleave/nodeN`).
    pub fn kernel_weight(mut self, node: usize, weight: u8) -> Self {
        if node < MAX_NODES {
            self.perf_mut().kernel_weight[node] = weight;
        }
        self
    }

    /// The node ids, ascending: the first `nodes` have CPUs, the rest are
    /// the memory-only ones; as many as there are nodes (else
    /// [`build`](Self::build) refuses). Distances and the allowed set are
    /// given by id.
    ///
    /// ```
    /// use numaweave::topology::{NodeSet, Topology};
    /// let t = Topology::synthetic(2).ids("0,2".parse().unwrap()).build().unwrap();
    /// assert_eq!(t.nodes().to_string(), "0,2");
    /// assert_eq!(t.cpus_of(2).to_string(), "1");
    /// assert_eq!(t.nodes_by_distance(2).collect::<Vec<_>>(), [2, 0]);
    /// ```
    pub fn ids(mut self, ids: NodeSet) -> Self {
        self.ids = Some(ids);
        self
    }

    /// CPUs on each node with CPUs.
    pub fn cpus_per_node(mut self, cpus: usize) -> Self {
        self.cpus_per_node = cpus;
        self
    }

    /// Memory-only nodes (CXL-like), numbered after the CPU nodes.
    pub fn memory_only_nodes(mut self, count: usize) -> Self {
        self.memory_only = count;
        self
    }

    /// Bytes of memory reported for each node.
    pub fn memory_per_node(mut self, bytes: u64) -> Self {
        self.memory_per_node = bytes;
        self
    }

    /// Sets the distance between `a` and `b` (both directions). Out-of-range
    /// ids or values are reported by [`build`](Self::build).
    pub fn distance(mut self, a: usize, b: usize, d: u8) -> Self {
        if a < MAX_NODES && b < MAX_NODES {
            self.distance[a][b] = d;
            self.distance[b][a] = d;
        } else {
            // Remembered as an impossible entry so build() can reject it.
            self.distance[0][0] = u8::MAX;
        }
        self
    }

    /// Restricts the nodes the process may use (as a cpuset's `mems` would).
    pub fn allowed(mut self, nodes: NodeSet) -> Self {
        self.allowed = Some(nodes);
        self
    }

    /// Lays the topology over this machine's real memory nodes (see
    /// [`build_over`](Self::build_over)).
    pub fn build(self) -> Result<Topology> {
        self.build_over(&Topology::detect()?)
    }

    /// Builds the topology, laying the `k`-th logical node over the
    /// `k mod R`-th memory node of `real` (R = its number of memory nodes).
    pub fn build_over(self, real: &Topology) -> Result<Topology> {
        let total = self.nodes + self.memory_only;
        if self.nodes == 0 && self.memory_only == 0 {
            return Err(Error::InvalidTopology { reason: "a topology needs at least one node" });
        }
        if total > MAX_NODES {
            return Err(Error::InvalidTopology { reason: "more than MAX_NODES (64) nodes" });
        }
        if self.nodes == 0 || self.cpus_per_node == 0 {
            return Err(Error::InvalidTopology { reason: "at least one node with at least one CPU is needed" });
        }
        if self.nodes.checked_mul(self.cpus_per_node).is_none_or(|c| c > MAX_CPUS) {
            return Err(Error::InvalidTopology { reason: "more than MAX_CPUS (1024) CPUs" });
        }
        let online = self.ids.unwrap_or(NodeSet::first_n(total));
        if online.len() != total {
            return Err(Error::InvalidTopology { reason: "as many node ids as nodes are needed" });
        }
        let mut t = Topology::empty(Source::Synthetic { physical_nodes: 0, fake: false });
        t.online = online;
        t.with_cpus = online.iter().take(self.nodes).collect();
        t.with_memory = t.online;
        for (i, n) in t.with_cpus.iter().enumerate() {
            for c in 0..self.cpus_per_node {
                t.cpu_node[i * self.cpus_per_node + c] = n as u8;
            }
        }
        for a in 0..MAX_NODES {
            for b in 0..MAX_NODES {
                let given = self.distance[a][b];
                let inside = online.contains(a) && online.contains(b);
                if given != 0 && !inside {
                    return Err(Error::InvalidTopology { reason: "distance given for a node that does not exist" });
                }
                if !inside {
                    continue;
                }
                let memory_only = !t.with_cpus.contains(a) || !t.with_cpus.contains(b);
                t.distance[a][b] = match given {
                    0 if a == b => LOCAL_DISTANCE,
                    0 if memory_only => MEMORY_ONLY_DISTANCE,
                    0 => REMOTE_DISTANCE,
                    d if a == b && d != LOCAL_DISTANCE => {
                        return Err(Error::InvalidTopology { reason: "a node's distance to itself must be 10" });
                    }
                    d if a != b && d <= LOCAL_DISTANCE => {
                        return Err(Error::InvalidTopology { reason: "distances between nodes must exceed 10" });
                    }
                    d => d,
                };
            }
        }
        for n in online.iter() {
            t.memory[n] = self.memory_per_node;
        }
        lay_over(&mut t, real, false)?;
        if let Some(a) = self.allowed {
            if !a.is_subset(&t.online) {
                return Err(Error::InvalidTopology { reason: "allowed nodes outside the topology" });
            }
            t.allowed = t.allowed.intersection(&a);
            if t.allowed.is_empty() {
                return Err(Error::InvalidTopology { reason: "no allowed node left" });
            }
        }
        t.perf = self.perf.map(std::sync::Arc::from);
        Ok(t)
    }

    /// `fake:N`: splits `real` into `n` logical nodes like `numa=fake=N`. The
    /// real CPUs are dealt round-robin (the i-th online CPU goes to node
    /// `i mod n`), so with more nodes than CPUs the last nodes are memory-only.
    /// Each real memory node's memory is shared equally among the logical nodes
    /// laid over it. Distances: 10 local; between logical nodes over the same
    /// real node 20, so that fallback order is exercised; otherwise the real
    /// distance.
    pub fn fake(real: &Topology, n: usize) -> Result<Topology> {
        if n == 0 || n > MAX_NODES {
            return Err(Error::InvalidTopology { reason: "fake:N needs 1 <= N <= 64" });
        }
        Self::fake_ids(real, NodeSet::first_n(n))
    }

    /// [`fake`](Self::fake) with the nodes `ids` (`fake:0,2`: nodes 0 and 2
    /// and no node 1, as after a hot-remove): the i-th online CPU goes to
    /// the `i mod n`-th id.
    pub fn fake_ids(real: &Topology, ids: NodeSet) -> Result<Topology> {
        if ids.is_empty() {
            return Err(Error::InvalidTopology { reason: "a topology needs at least one node" });
        }
        let mut id = [0u8; MAX_NODES];
        for (i, n) in ids.iter().enumerate() {
            id[i] = n as u8;
        }
        let n = ids.len();
        let mut t = Topology::empty(Source::Synthetic { physical_nodes: 0, fake: true });
        t.online = ids;
        t.with_memory = t.online;
        t.ignored_cpus = real.ignored_cpus;
        for (i, c) in real.cpus().iter().enumerate() {
            t.cpu_node[c] = id[i % n];
            t.with_cpus.insert(usize::from(id[i % n]));
        }
        lay_over(&mut t, real, true)?;
        Ok(t)
    }
}

/// Maps every logical node of `t` onto a real memory node of `real`, fills in
/// memory shares (when `split_memory`) and distances left unset, and derives
/// the allowed set.
fn lay_over(t: &mut Topology, real: &Topology, split_memory: bool) -> Result<()> {
    let mut phys = [0u8; MAX_NODES];
    let mut count = 0;
    for p in real.memory_nodes().iter() {
        phys[count] = p as u8;
        count += 1;
    }
    if count == 0 {
        return Err(Error::InvalidTopology { reason: "the real topology has no memory node" });
    }
    for (i, n) in t.online.iter().enumerate() {
        t.physical[n] = phys[i % count];
    }
    let on_same = |t: &Topology, p: usize| t.online.iter().filter(|&m| t.physical_node(m) == p).count() as u64;
    for n in t.online.iter() {
        let p = t.physical_node(n);
        if split_memory {
            t.memory[n] = real.memory_of(p) / on_same(t, p).max(1);
        }
        for m in t.online.iter() {
            if t.distance[n][m] == 0 {
                let q = t.physical_node(m);
                t.distance[n][m] = if n == m {
                    LOCAL_DISTANCE
                } else if p == q {
                    REMOTE_DISTANCE
                } else {
                    real.distance(p, q).max(LOCAL_DISTANCE + 1)
                };
            }
        }
    }
    t.allowed = t.online.iter().filter(|&n| real.allowed_nodes().contains(t.physical_node(n))).collect();
    t.source = match t.source {
        Source::Synthetic { fake, .. } => Source::Synthetic { physical_nodes: count as u8, fake },
        s => s,
    };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_node_real(cpus: usize) -> Topology {
        let mut t = Topology::empty(Source::Sysfs);
        t.online = NodeSet::single(0);
        t.with_cpus = t.online;
        t.with_memory = t.online;
        t.allowed = t.online;
        t.distance[0][0] = 10;
        t.memory[0] = 8 << 30;
        for c in 0..cpus {
            t.cpu_node[c] = 0;
        }
        t
    }

    #[test]
    fn fake_deals_cpus_round_robin() {
        let real = one_node_real(8);
        let t = SyntheticBuilder::fake(&real, 4).unwrap();
        assert_eq!(t.node_count(), 4);
        assert!(t.is_synthetic());
        assert_eq!(t.cpus_of(0).to_string(), "0,4");
        assert_eq!(t.cpus_of(3).to_string(), "3,7");
        assert_eq!(t.memory_of(2), 2 << 30);
        assert_eq!(t.distance(0, 3), 20);
        assert_eq!(t.allowed_nodes().to_string(), "0-3");
        assert!((0..4).all(|n| t.physical_node(n) == 0));
        assert_eq!(t.memory_only_nodes(), NodeSet::new());
    }

    #[test]
    fn fake_with_more_nodes_than_cpus_has_memory_only_nodes() {
        let t = SyntheticBuilder::fake(&one_node_real(2), 4).unwrap();
        assert_eq!(t.cpu_nodes().to_string(), "0-1");
        assert_eq!(t.memory_only_nodes().to_string(), "2-3");
    }

    #[test]
    fn builder_rejects_nonsense() {
        let real = one_node_real(2);
        let bad = [
            SyntheticBuilder::new(0),
            SyntheticBuilder::new(65),
            SyntheticBuilder::new(2).cpus_per_node(0),
            SyntheticBuilder::new(2).cpus_per_node(1000),
            SyntheticBuilder::new(2).distance(0, 1, 5),
            SyntheticBuilder::new(2).distance(0, 0, 12),
            SyntheticBuilder::new(2).distance(0, 7, 20),
            SyntheticBuilder::new(2).distance(0, 70, 20),
            SyntheticBuilder::new(2).allowed(NodeSet::single(5)),
        ];
        for b in bad {
            assert!(matches!(b.build_over(&real), Err(Error::InvalidTopology { .. })));
        }
        assert!(SyntheticBuilder::fake(&real, 0).is_err());
        assert!(SyntheticBuilder::fake(&real, 65).is_err());
    }

    #[test]
    fn fallback_order_follows_distances() {
        let t = SyntheticBuilder::new(4)
            .memory_only_nodes(1)
            .distance(0, 1, 12)
            .distance(0, 2, 32)
            .distance(0, 3, 22)
            .build_over(&one_node_real(2))
            .unwrap();
        assert_eq!(t.nodes_by_distance(0).collect::<Vec<_>>(), [0, 1, 3, 4, 2]);
        assert_eq!(t.nodes_by_distance(4).collect::<Vec<_>>(), [4, 0, 1, 2, 3]);
        assert_eq!(t.distance(4, 2), MEMORY_ONLY_DISTANCE);
    }

    #[test]
    fn sparse_ids_keep_their_numbers_everywhere() {
        let real = one_node_real(4);
        let t = SyntheticBuilder::new(2)
            .cpus_per_node(2)
            .memory_only_nodes(1)
            .ids("0,2,5".parse().unwrap())
            .distance(0, 2, 21)
            .build_over(&real)
            .unwrap();
        assert_eq!(t.nodes().to_string(), "0,2,5");
        assert_eq!(t.cpu_nodes().to_string(), "0,2");
        assert_eq!(t.memory_only_nodes().to_string(), "5");
        assert_eq!(t.cpus_of(2).to_string(), "2-3");
        assert_eq!(t.node_of_cpu(3), Some(2));
        assert_eq!((t.distance(0, 2), t.distance(2, 5), t.distance(5, 5)), (21, MEMORY_ONLY_DISTANCE, 10));
        assert_eq!(t.nodes_by_distance(2).collect::<Vec<_>>(), [2, 0, 5]);
        assert!(!t.nodes().contains(1) && t.memory_of(1) == 0);
        assert!(t.check_node(1).is_err() && t.check_node(2).is_ok());
        assert_eq!(t.allowed_nodes().to_string(), "0,2,5");
        let bad = [
            SyntheticBuilder::new(2).ids("0,2,5".parse().unwrap()),
            SyntheticBuilder::new(2).ids("0,2".parse().unwrap()).distance(0, 1, 20),
            SyntheticBuilder::new(2).ids("0,2".parse().unwrap()).allowed(NodeSet::single(1)),
        ];
        for b in bad {
            assert!(matches!(b.build_over(&real), Err(Error::InvalidTopology { .. })));
        }
        let f = SyntheticBuilder::fake_ids(&real, "0,2".parse().unwrap()).unwrap();
        assert_eq!(
            (f.nodes().to_string(), f.cpus_of(0).to_string(), f.cpus_of(2).to_string()),
            ("0,2".into(), "0,2".into(), "1,3".into())
        );
        assert_eq!(f.distance(0, 2), REMOTE_DISTANCE);
    }

    #[test]
    fn logical_nodes_spread_over_real_ones() {
        let mut real = one_node_real(4);
        real.online = "0-1".parse().unwrap();
        real.with_memory = real.online;
        real.allowed = NodeSet::single(1);
        real.distance[0][1] = 21;
        real.distance[1][0] = 21;
        real.distance[1][1] = 10;
        let t = SyntheticBuilder::fake(&real, 4).unwrap();
        assert_eq!((0..4).map(|n| t.physical_node(n)).collect::<Vec<_>>(), [0, 1, 0, 1]);
        assert_eq!(t.distance(0, 1), 21);
        assert_eq!(t.distance(0, 2), 20);
        assert_eq!(t.allowed_nodes().to_string(), "1,3");
        assert_eq!(t.logical_node(1), Some(1));
        assert_eq!(t.physical_set("0-3".parse().unwrap()).to_string(), "0-1");
    }
}
