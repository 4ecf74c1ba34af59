//! Memory policies: where allocations go. `Local` (the calling thread's
//! node), `Bind` (a node set, strictly), `Preferred` (one node, falling back by
//! distance), and `Interleave` with a granularity: spread over a node set, but
//! stay on a node for `Count(n)` allocations or until `Bytes(b)` were placed
//! there, optionally weighted (a node of weight w gets w turns per round, as
//! Linux's `MPOL_WEIGHTED_INTERLEAVE`).
//!
//! The granularity is the point of the source thread (Shaohua Li, "numa:
//! interleave allocation granularity", 2011): page-by-page interleave breaks
//! the physical contiguity of I/O buffers (more DMA segments); moving to the
//! next node only after a run keeps a buffer on one node. David Rientjes'
//! objection, that counting allocations lets nodes drift apart in bytes when
//! sizes vary, is why `Bytes(b)` exists: see [`Cursor`].
//!
//! This module holds the policies, their validation and text form, and the
//! lock-free interleave [`Cursor`]. [`NumaAlloc`](crate::NumaAlloc) applies
//! them at three levels:
//!
//! - **process default**: [`Config::policy`](crate::Config::policy) or
//!   `NUMAWEAVE_POLICY` (a bad string is reported on stderr and `local`
//!   kept); a default interleave gives each thread its own cursor, as Linux
//!   keeps a task's interleave position per task;
//! - **per thread, scoped**: [`with_policy`](crate::with_policy) returns a
//!   guard that restores the previous policy when dropped;
//! - **per call**: allocator handles for `allocator_api2` collections,
//!   [`NumaAlloc::on_node`](crate::NumaAlloc::on_node) and
//!   [`NumaAlloc::interleave`](crate::NumaAlloc::interleave) (its own cursor).
//!
//! `Local`, `Bind` and `Preferred` cost nothing on the allocation fast path:
//! they choose where a thread's heap takes pages from. Under `Interleave` the
//! cursor places every allocation, carved from a per-node bump region, so the
//! blocks of one turn are adjacent in memory (one extent, not one per block).
//!
//! # Text form (`NUMAWEAVE_POLICY`)
//!
//! ```text
//! local
//! tier:lower                   the lower memory tier nearest the thread (CXL)
//! bind:<nodes>                 e.g. bind:1, bind:0-1
//! preferred:<node>             e.g. preferred:0
//! interleave:<nodes>[:count=<n>|:bytes=<size>][:weights=<w>,<w>,…|:weights=auto]
//!                              e.g. interleave:0-3:bytes=2M
//!                                   interleave:0,1:count=8:weights=3,1
//! ```
//!
//! `<nodes>` is the kernel's list format; `<size>` takes `K`, `M`, `G`
//! suffixes; weights are given in node order, one per node of the set, or
//! `auto` (from each thread's bandwidth to each node, see
//! [`Interleave::with_auto_weights`]). The
//! default granularity is `count=1` (page-by-page interleave's analogue).
//!
//! ```
//! use numaweave::policy::{Granularity, Policy};
//! let p: Policy = "interleave:0,1:count=8:weights=3,1".parse().unwrap();
//! let Policy::Interleave(i) = &p else { unreachable!() };
//! assert_eq!(i.granularity(), Granularity::Count(8));
//! assert_eq!(i.weight(0), 3);
//! assert_eq!(p.to_string(), "interleave:0-1:count=8:weights=3,1");
//! ```

mod cursor;
mod rules;
mod weights;

use core::fmt;

pub use cursor::{Cursor, MAX_ROUND, Pick};
pub use rules::{MAX_RULES, SizeRules};
pub use weights::{AutoWeights, WeightSource, reduce_weights};

use crate::error::{Error, Result};
use crate::os::mem::Huge;
use crate::topology::{MAX_NODES, NodeSet, Topology};

/// How long an interleave stays on one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Granularity {
    /// `n` allocations per node per turn.
    Count(u32),
    /// A node's turn ends at the first allocation that brings it to at least
    /// `b` bytes in that turn.
    Bytes(u64),
}

/// Interleave over a node set; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interleave {
    nodes: NodeSet,
    granularity: Granularity,
    weights: [u8; MAX_NODES],
    huge: Option<Huge>,
    /// `weights=auto`: each thread's weights from the bandwidth its node
    /// sees ([`Interleave::with_auto_weights`]).
    auto: bool,
}

impl Interleave {
    /// Interleave over `nodes` with `granularity`, every node weight 1.
    pub fn new(nodes: NodeSet, granularity: Granularity) -> Result<Self> {
        let mut weights = [0u8; MAX_NODES];
        for n in nodes.iter() {
            weights[n] = 1;
        }
        let i = Self { nodes, granularity, weights, huge: None, auto: false };
        i.check()?;
        Ok(i)
    }

    /// The same nodes and weights with another granularity (checked).
    #[cfg_attr(loom, allow(dead_code))]
    pub(crate) fn with_granularity(mut self, granularity: Granularity) -> Result<Self> {
        self.granularity = granularity;
        self.check()?;
        Ok(self)
    }

    /// Sets node weights, in node order, one per node of the set: a node of
    /// weight w gets w consecutive turns per round.
    pub fn with_weights(mut self, weights: &[u8]) -> Result<Self> {
        if weights.len() != self.nodes.len() {
            return Err(Error::InvalidPolicy { reason: "one weight per interleaved node is needed" });
        }
        for (n, &w) in self.nodes.iter().zip(weights) {
            self.weights[n] = w;
        }
        self.auto = false;
        self.check()?;
        Ok(self)
    }

    /// `weights=auto`: each thread weights the nodes by the bandwidth *its
    /// own node* sees to each ([`Topology::interleave_weights`]: the ACPI
    /// HMAT, else sysfs), reduced to small integers as the kernel reduces
    /// them; so a thread on socket 1 weights the CXL memory behind socket 0
    /// lower than a thread on socket 0 does. Where a bandwidth is unknown,
    /// the kernel's weighted-interleave weights; where those are missing
    /// too, equal weights. A thread that moves to another node takes that
    /// node's weights at its next pick (the turn in progress ends there).
    /// An interleave handle takes the weights of the thread that makes it.
    ///
    /// ```
    /// use numaweave::policy::Policy;
    /// use numaweave::topology::Topology;
    /// let mut b = Topology::synthetic(2).memory_only_nodes(1);
    /// // GB/s: each socket 64 to its own DRAM, 32 to the other's and to the CXL node.
    /// for (i, t, gbps) in [(0, 0, 64), (0, 1, 32), (0, 2, 32), (1, 0, 32), (1, 1, 64), (1, 2, 32)] {
    ///     b = b.bandwidth(i, t, gbps * 1000);
    /// }
    /// let t = b.build().unwrap();
    /// let p: Policy = "interleave:0-2:bytes=2M:weights=auto".parse().unwrap();
    /// let Policy::Interleave(i) = p else { unreachable!() };
    /// let (on0, _) = i.weights_for(&t, 0);
    /// let (on1, _) = i.weights_for(&t, 1);
    /// assert_eq!([on0.weight(0), on0.weight(1), on0.weight(2)], [2, 1, 1]);
    /// assert_eq!([on1.weight(0), on1.weight(1), on1.weight(2)], [1, 2, 1]);
    /// ```
    pub fn with_auto_weights(mut self) -> Self {
        for n in self.nodes.iter() {
            self.weights[n] = 1;
        }
        self.auto = true;
        self
    }

    /// Whether the weights are `auto` (derived per thread).
    pub fn has_auto_weights(&self) -> bool {
        self.auto
    }

    /// With `auto` weights, the weights the threads of each CPU node of
    /// `topo` apply (the verbose line, the statistics); `None` otherwise.
    pub fn auto_weights_by_node(&self, topo: &Topology) -> Option<WeightsByNode> {
        if !self.auto {
            return None;
        }
        let mut t = WeightsByNode {
            nodes: self.nodes,
            initiators: topo.cpu_nodes(),
            weights: [[0; MAX_NODES]; MAX_NODES],
            source: WeightSource::Equal,
        };
        for (k, i) in t.initiators.iter().enumerate() {
            let (w, src) = self.weights_for(topo, i);
            for n in self.nodes.iter() {
                t.weights[i][n] = w.weight(n);
            }
            if k == 0 {
                t.source = src.unwrap_or(WeightSource::Equal);
            }
        }
        Some(t)
    }

    /// The interleave as a thread on `initiator` applies it: with `auto`
    /// weights, the weights derived for that node (and where they came
    /// from); otherwise itself (`None`).
    pub fn weights_for(&self, topo: &Topology, initiator: usize) -> (Interleave, Option<WeightSource>) {
        if !self.auto {
            return (*self, None);
        }
        let w = topo.interleave_weights(initiator, self.nodes);
        let mut out = *self;
        out.auto = false;
        out.weights = w.weights;
        // More turns than a round holds (many nodes of unlike bandwidth):
        // halved, none below 1, until they fit.
        while out.nodes.iter().map(|n| usize::from(out.weights[n])).sum::<usize>() > MAX_ROUND {
            for n in out.nodes.iter() {
                out.weights[n] = (out.weights[n] / 2).max(1);
            }
        }
        (out, Some(w.source))
    }

    /// Weights as the kernel's weighted interleave has them
    /// (`/sys/kernel/mm/mempolicy/weighted_interleave/nodeN`, Linux 6.9+);
    /// `None` where the kernel has none.
    pub fn with_system_weights(self) -> Result<Option<Self>> {
        let mut w = [0u8; MAX_NODES];
        for n in self.nodes.iter() {
            match crate::topology::read_kernel_weight(n) {
                Ok(Some(x)) => w[n] = x,
                Ok(None) => return Ok(None),
                Err(reason) => return Err(Error::InvalidPolicy { reason }),
            }
        }
        let ws: Vec<u8> = self.nodes.iter().map(|n| w[n]).collect();
        self.with_weights(&ws).map(Some)
    }

    /// The pages the interleave's regions (where its page-and-larger
    /// buffers are carved) are made of: transparent huge pages, or 2 MiB
    /// pages of each node's hugetlb pool, so that a turn of `Bytes(2 MiB)`
    /// is one physical run ([`Config::huge`](crate::Config::huge) for the
    /// process, which this overrides). Text form `:huge` (hugetlb) or
    /// `:huge=thp|hugetlb|off`.
    ///
    /// ```
    /// use numaweave::Huge;
    /// use numaweave::policy::Policy;
    /// let p: Policy = "interleave:0-1:bytes=2M:huge".parse().unwrap();
    /// let Policy::Interleave(i) = p else { unreachable!() };
    /// assert_eq!(i.huge_pages(), Some(Huge::Hugetlb));
    /// assert_eq!(p.to_string(), "interleave:0-1:bytes=2097152:huge=hugetlb");
    /// ```
    pub fn with_huge_pages(mut self, huge: Huge) -> Self {
        self.huge = Some(huge);
        self
    }

    /// What [`with_huge_pages`](Self::with_huge_pages) set (`None`: the
    /// process's [`Config::huge`](crate::Config::huge)).
    pub fn huge_pages(&self) -> Option<Huge> {
        self.huge
    }

    /// The interleaved nodes.
    pub fn nodes(&self) -> NodeSet {
        self.nodes
    }

    /// The granularity.
    pub fn granularity(&self) -> Granularity {
        self.granularity
    }

    /// The weight of `node` (0 for a node not interleaved).
    pub fn weight(&self, node: usize) -> u8 {
        self.weights.get(node).copied().unwrap_or(0)
    }

    fn check(&self) -> Result<()> {
        if self.nodes.is_empty() {
            return Err(Error::InvalidPolicy { reason: "empty node set" });
        }
        match self.granularity {
            Granularity::Count(0) | Granularity::Bytes(0) => {
                return Err(Error::InvalidPolicy { reason: "zero granularity" });
            }
            Granularity::Bytes(b) if b >= 1 << 40 => {
                return Err(Error::InvalidPolicy { reason: "byte granularity of 1 TiB or more" });
            }
            _ => {}
        }
        let total: usize = self.nodes.iter().map(|n| usize::from(self.weights[n])).sum();
        if total == 0 {
            return Err(Error::InvalidPolicy { reason: "all weights are zero" });
        }
        if total > MAX_ROUND {
            return Err(Error::InvalidPolicy { reason: "weights add up to more than MAX_ROUND (1024) turns" });
        }
        Ok(())
    }
}

/// `weights=auto` as the threads of each CPU node apply it
/// ([`Interleave::auto_weights_by_node`]); displays as
/// `weights=auto (bandwidth from the ACPI HMAT): from node 0: 8,4,2,1; from node 1: 4,8,1,2`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightsByNode {
    /// The interleaved nodes.
    pub nodes: NodeSet,
    /// The CPU nodes (initiators).
    pub initiators: NodeSet,
    /// By initiator, then interleaved node.
    pub weights: [[u8; MAX_NODES]; MAX_NODES],
    /// Where the first initiator's weights came from.
    pub source: WeightSource,
}

impl fmt::Display for WeightsByNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "weights=auto ({}):", self.source)?;
        for (k, i) in self.initiators.iter().enumerate() {
            write!(f, "{} from node {i}: ", if k > 0 { ";" } else { "" })?;
            for (j, n) in self.nodes.iter().enumerate() {
                write!(f, "{}{}", if j > 0 { "," } else { "" }, self.weights[i][n])?;
            }
        }
        Ok(())
    }
}

/// A memory policy; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// The calling thread's node (the default).
    Local,
    /// Only these nodes, never elsewhere.
    Bind(NodeSet),
    /// This node first, then the others by distance.
    Preferred(usize),
    /// Spread over nodes with a granularity.
    Interleave(Interleave),
    /// The lower memory tier nearest the calling thread (CXL memory behind
    /// its socket: [`Topology::nearest_lower_tier`]); the thread's own node
    /// (the top tier) where the machine has no lower tier or that node is
    /// out of memory, counted as a fallback. For cold data: a cache's
    /// values, a storage engine's cold pages.
    LowerTier,
}

impl Policy {
    /// Checks the policy against `topo`: every node named must be online, have
    /// memory, and be allowed to this process (`Mems_allowed`).
    pub fn validate(&self, topo: &Topology) -> Result<()> {
        let check = |n: usize| -> Result<()> {
            topo.check_node(n)?;
            if !topo.memory_nodes().contains(n) {
                return Err(Error::InvalidNode { node: n, reason: "has no memory" });
            }
            if !topo.allowed_nodes().contains(n) {
                return Err(Error::InvalidNode { node: n, reason: "not in this process's Mems_allowed" });
            }
            Ok(())
        };
        match self {
            Policy::Local | Policy::LowerTier => Ok(()),
            Policy::Preferred(n) => check(*n),
            Policy::Bind(s) => {
                if s.is_empty() {
                    return Err(Error::InvalidPolicy { reason: "empty node set" });
                }
                s.iter().try_for_each(check)
            }
            Policy::Interleave(i) => {
                i.check()?;
                i.nodes.iter().try_for_each(check)
            }
        }
    }
}

impl core::str::FromStr for Policy {
    type Err = Error;

    /// Parses the text form (module docs); does not check nodes against a
    /// topology ([`Policy::validate`] does).
    fn from_str(s: &str) -> Result<Policy> {
        let bad = |reason| Error::InvalidPolicy { reason };
        let s = s.trim();
        let mut parts = s.split(':');
        let kind = parts.next().unwrap_or("");
        let nodes = |t: Option<&str>| -> Result<NodeSet> {
            let t = t.ok_or(bad("a node list is needed"))?;
            match NodeSet::parse_list(t) {
                Ok((set, 0)) if !set.is_empty() => Ok(set),
                Ok((set, 0)) if set.is_empty() => Err(bad("empty node set")),
                Ok(_) => Err(Error::InvalidNode { node: MAX_NODES, reason: "beyond MAX_NODES (64)" }),
                Err(_) => Err(bad("malformed node list (want e.g. 0-3,5)")),
            }
        };
        let p = match kind {
            "local" => Policy::Local,
            "tier" => match parts.next().map(str::trim) {
                Some("lower") => Policy::LowerTier,
                _ => return Err(bad("tier needs lower (tier:lower)")),
            },
            "bind" => Policy::Bind(nodes(parts.next())?),
            "preferred" => {
                let n: usize =
                    parts.next().and_then(|t| t.trim().parse().ok()).ok_or(bad("preferred needs one node id"))?;
                if n >= MAX_NODES {
                    return Err(Error::InvalidNode { node: n, reason: "beyond MAX_NODES (64)" });
                }
                Policy::Preferred(n)
            }
            "interleave" => {
                let set = nodes(parts.next())?;
                let mut granularity = Granularity::Count(1);
                // Fixed storage: the allocator parses `NUMAWEAVE_POLICY` during
                // its own start-up, where nothing may allocate.
                let mut weights: Option<([u8; MAX_NODES], usize)> = None;
                let mut auto = false;
                let mut huge = None;
                for opt in parts.by_ref() {
                    if opt.trim() == "huge" {
                        huge = Some(Huge::Hugetlb);
                        continue;
                    }
                    let (k, v) = opt.split_once('=').ok_or(bad("interleave options are key=value"))?;
                    match k.trim() {
                        "huge" => huge = Some(v.parse().map_err(bad)?),
                        "count" => {
                            granularity =
                                Granularity::Count(v.trim().parse().map_err(|_| bad("count=N needs a number"))?)
                        }
                        "bytes" => {
                            let b = crate::units::parse_bytes(v).ok_or(bad("bytes=SIZE needs e.g. 2M"))?;
                            granularity = Granularity::Bytes(b as u64);
                        }
                        "weights" if v.trim() == "auto" => auto = true,
                        "weights" => {
                            let mut w = ([0u8; MAX_NODES], 0);
                            for x in v.split(',') {
                                if w.1 == MAX_NODES {
                                    return Err(bad("more weights than nodes"));
                                }
                                w.0[w.1] = x.trim().parse().map_err(|_| bad("weights are 0..=255, comma-separated"))?;
                                w.1 += 1;
                            }
                            weights = Some(w);
                        }
                        _ => return Err(bad("unknown interleave option (count, bytes, weights, huge)")),
                    }
                }
                let mut i = Interleave::new(set, granularity)?;
                if let Some((w, n)) = weights {
                    if auto {
                        return Err(bad("weights are given or auto, not both"));
                    }
                    i = i.with_weights(&w[..n])?;
                }
                if auto {
                    i = i.with_auto_weights();
                }
                if let Some(h) = huge {
                    i = i.with_huge_pages(h);
                }
                Policy::Interleave(i)
            }
            _ => return Err(bad("unknown policy (local, bind, preferred, interleave, tier)")),
        };
        if parts.next().is_some() {
            return Err(bad("trailing text after the policy"));
        }
        Ok(p)
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::Local => f.write_str("local"),
            Policy::LowerTier => f.write_str("tier:lower"),
            Policy::Bind(s) => write!(f, "bind:{s}"),
            Policy::Preferred(n) => write!(f, "preferred:{n}"),
            Policy::Interleave(i) => {
                write!(f, "interleave:{}", i.nodes)?;
                match i.granularity {
                    Granularity::Count(n) => write!(f, ":count={n}")?,
                    Granularity::Bytes(b) => write!(f, ":bytes={b}")?,
                }
                // No allocation: the allocator prints policies at start-up.
                if i.auto {
                    f.write_str(":weights=auto")?;
                } else if i.nodes.iter().any(|n| i.weights[n] != 1) {
                    f.write_str(":weights=")?;
                    for (k, n) in i.nodes.iter().enumerate() {
                        write!(f, "{}{}", if k > 0 { "," } else { "" }, i.weights[n])?;
                    }
                }
                match i.huge {
                    Some(Huge::Off) => f.write_str(":huge=off")?,
                    Some(Huge::Thp) => f.write_str(":huge=thp")?,
                    Some(Huge::Hugetlb) => f.write_str(":huge=hugetlb")?,
                    Some(Huge::Hugetlb1G) => f.write_str(":huge=hugetlb-1g")?,
                    None => {}
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grammar_round_trips() {
        for s in [
            "local",
            "bind:1",
            "bind:0-3",
            "preferred:0",
            "interleave:0-3:count=1",
            "interleave:0-1:count=8:weights=3,1",
            "interleave:0-1:count=8:weights=3,1:huge=thp",
            "interleave:0-3:count=2:huge=hugetlb",
            "interleave:0-3:count=2:huge=off",
            "interleave:0-3:count=2:huge=hugetlb-1g",
            "interleave:0-3:bytes=2097152:weights=auto",
            "tier:lower",
        ] {
            assert_eq!(s.parse::<Policy>().unwrap().to_string(), s);
        }
        let p: Policy = "interleave:0-3:bytes=2M".parse().unwrap();
        assert_eq!(p.to_string(), "interleave:0-3:bytes=2097152");
        assert_eq!("interleave:2".parse::<Policy>().unwrap().to_string(), "interleave:2:count=1");
        assert_eq!(
            "interleave:0-1:huge:bytes=64K".parse::<Policy>().unwrap().to_string(),
            "interleave:0-1:bytes=65536:huge=hugetlb"
        );
        assert!("interleave:0-1:huge=1G".parse::<Policy>().is_err());
    }

    #[test]
    fn bad_policies_are_typed_errors() {
        for s in [
            "",
            "nearest",
            "bind",
            "bind:",
            "bind:x",
            "preferred",
            "preferred:a",
            "interleave:0-1:count=0",
            "interleave:0-1:bytes=0",
            "interleave:0-1:weights=0,0",
            "interleave:0-1:weights=1",
            "interleave:0-1:weights=1,2,3",
            "interleave:0-1:speed=3",
            "interleave:0-1:count",
            "interleave:0-1:weights=auto:weights=1,2",
            "interleave:0-1:weights=autox",
            "local:extra",
            "tier",
            "tier:upper",
            "tier:lower:x",
        ] {
            let e = s.parse::<Policy>().unwrap_err();
            assert!(matches!(e, Error::InvalidPolicy { .. }), "{s:?}: {e:?}");
        }
        assert!(matches!("bind:70".parse::<Policy>(), Err(Error::InvalidNode { .. })));
        assert!(matches!("preferred:64".parse::<Policy>(), Err(Error::InvalidNode { .. })));
    }

    #[test]
    fn system_weights_are_the_kernels_or_none() {
        let i = Interleave::new(NodeSet::single(0), Granularity::Count(1)).unwrap();
        match std::fs::read_to_string("/sys/kernel/mm/mempolicy/weighted_interleave/node0") {
            Ok(s) => assert_eq!(i.with_system_weights().unwrap().unwrap().weight(0), s.trim().parse::<u8>().unwrap()),
            Err(_) => assert_eq!(i.with_system_weights().unwrap(), None),
        }
    }

    #[test]
    fn validation_against_a_topology() {
        let t = Topology::synthetic(2).memory_only_nodes(1).allowed("0,2".parse().unwrap()).build().unwrap();
        assert!("interleave:0,2:bytes=1M".parse::<Policy>().unwrap().validate(&t).is_ok());
        assert!("local".parse::<Policy>().unwrap().validate(&t).is_ok());
        let outside = "bind:1".parse::<Policy>().unwrap().validate(&t).unwrap_err();
        assert_eq!(outside, Error::InvalidNode { node: 1, reason: "not in this process's Mems_allowed" });
        let offline = "preferred:5".parse::<Policy>().unwrap().validate(&t).unwrap_err();
        assert!(matches!(offline, Error::InvalidNode { node: 5, .. }));
    }
}
