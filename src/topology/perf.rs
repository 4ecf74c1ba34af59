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

use super::{MAX_NODES, NodeSet, Topology};
use crate::error::Result;
use crate::os::file::{self, PathBuf};

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

    /// The sysfs fallback: best initiators exactly, the others by distance.
    fn read_sysfs_access(&mut self, t: &Topology) -> bool {
        let mut any = false;
        for target in t.memory_nodes().iter() {
            let Some(best) = read_access(target) else { continue };
            let Some(b) = best.initiators.iter().next() else { continue };
            any = true;
            let db = u64::from(t.distance(b, target));
            for i in t.cpu_nodes().iter() {
                let di = u64::from(t.distance(i, target)).max(1);
                let (bw, lat) = if best.initiators.contains(i) {
                    (u64::from(best.bandwidth), u64::from(best.latency))
                } else {
                    (u64::from(best.bandwidth) * db / di, u64::from(best.latency) * di / db.max(1))
                };
                self.bandwidth[i][target] = bw as u32;
                self.latency[i][target] = lat.min(u64::from(u16::MAX)) as u16;
            }
        }
        any
    }

    /// `/sys/devices/virtual/memory_tiering/memory_tierN/nodelist`: tiers
    /// ranked by `N` (lower is faster), 1 the top.
    fn read_tiers(&mut self) {
        const DIR: &core::ffi::CStr = c"/sys/devices/virtual/memory_tiering";
        let mut ids = [0usize; 16];
        let mut len = 0;
        let _ = file::for_each_entry(DIR, |name| {
            if let Some(id) = name.strip_prefix("memory_tier").and_then(|n| crate::sets::parse_id(n.as_bytes()))
                && len < ids.len()
            {
                ids[len] = id;
                len += 1;
            }
        });
        ids[..len].sort_unstable();
        let mut buf = [0u8; 512];
        for (rank, &id) in ids[..len].iter().enumerate() {
            let mut p = PathBuf::new();
            p.push("/sys/devices/virtual/memory_tiering/memory_tier").push_num(id).push("/nodelist");
            if let Ok(s) = file::read_str(p.as_cstr(), &mut buf)
                && let Ok((nodes, _)) = NodeSet::parse_list(s)
            {
                for n in nodes.iter() {
                    self.tier[n] = (rank + 1) as u8;
                }
            }
        }
    }

    /// `/sys/kernel/mm/mempolicy/weighted_interleave/nodeN` (Linux 6.9+)
    /// and its `auto` (6.16+).
    fn read_kernel_weights(&mut self, online: NodeSet) {
        for n in online.iter() {
            self.kernel_weight[n] = read_kernel_weight(n).ok().flatten().unwrap_or(0);
        }
        let mut buf = [0u8; 16];
        if let Ok(s) = file::read_str(c"/sys/kernel/mm/mempolicy/weighted_interleave/auto", &mut buf) {
            self.kernel_auto = match s {
                "true" | "Y" | "1" => Some(true),
                "false" | "N" | "0" => Some(false),
                _ => None,
            };
        }
    }
}

/// The kernel's weighted-interleave weight of node `n`, read now
/// (`/sys/kernel/mm/mempolicy/weighted_interleave/nodeN`, Linux 6.9+):
/// `None` where it cannot be read (no such file: an older kernel).
pub(crate) fn read_kernel_weight(n: usize) -> core::result::Result<Option<u8>, &'static str> {
    let mut p = PathBuf::new();
    p.push("/sys/kernel/mm/mempolicy/weighted_interleave/node").push_num(n);
    let mut buf = [0u8; 16];
    match file::read_str(p.as_cstr(), &mut buf) {
        Ok(s) => crate::sets::parse_id(s.as_bytes())
            .and_then(|w| u8::try_from(w).ok())
            .map(Some)
            .ok_or("malformed sysfs weight"),
        Err(_) => Ok(None),
    }
}

/// What the kernel reports for one target: its best initiators and their
/// bandwidth (MB/s, the lower of read and write) and latency (ns, the higher).
struct Access {
    initiators: NodeSet,
    bandwidth: u32,
    latency: u32,
}

fn read_access(target: usize) -> Option<Access> {
    for class in ["access1", "access0"] {
        let mut dir = PathBuf::new();
        dir.push("/sys/devices/system/node/node").push_num(target).push("/").push(class).push("/initiators");
        let mut initiators = NodeSet::new();
        if file::for_each_entry(dir.as_cstr(), |name| {
            if let Some(n) = name.strip_prefix("node").and_then(|n| crate::sets::parse_id(n.as_bytes()))
                && n < MAX_NODES
            {
                initiators.insert(n);
            }
        })
        .is_err()
            || initiators.is_empty()
        {
            continue;
        }
        let mut buf = [0u8; 32];
        let mut value = |leaf: &str| -> u32 {
            let mut p = PathBuf::new();
            p.push(dir.as_str()).push("/").push(leaf);
            file::read_str(p.as_cstr(), &mut buf)
                .ok()
                .and_then(|s| crate::sets::parse_id(s.as_bytes()))
                .and_then(|v| u32::try_from(v).ok())
                .unwrap_or(0)
        };
        let (rb, wb, rl, wl) =
            (value("read_bandwidth"), value("write_bandwidth"), value("read_latency"), value("write_latency"));
        let bandwidth = match (rb, wb) {
            (0, b) | (b, 0) => b,
            (r, w) => r.min(w),
        };
        return Some(Access { initiators, bandwidth, latency: rl.max(wl) });
    }
    None
}

/// Reads `buf.len()` bytes at `off` of the table; short is an error.
type Fetch<'a> = dyn FnMut(u64, &mut [u8]) -> Result<usize> + 'a;

fn fetch_exact(fetch: &mut Fetch<'_>, off: u64, buf: &mut [u8]) -> core::result::Result<(), &'static str> {
    match fetch(off, buf) {
        Ok(n) if n == buf.len() => Ok(()),
        Ok(_) => Err("HMAT shorter than its structures say"),
        Err(_) => Err("HMAT unreadable"),
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// The ACPI table header (36 bytes) and HMAT's 4 reserved bytes.
const HMAT_HEADER: u64 = 40;
/// System Locality Latency and Bandwidth Information.
const SLLBI: u16 = 1;
/// Its fixed part: header, flags, data type, transfer size, counts, base unit.
const SLLBI_FIXED: usize = 32;

/// One System Locality Latency and Bandwidth Information structure's
/// fixed part.
struct Sllbi {
    at: u64,
    flags: u8,
    data_type: u8,
    initiators: usize,
    targets: usize,
    base: u64,
}

/// Parses the HMAT read through `fetch` into `out`'s matrices (by node,
/// domains mapped onto `online` in ascending order). Errors say what was
/// wrong; `out` may be partly filled then.
pub(crate) fn parse_hmat(
    fetch: &mut Fetch<'_>,
    online: NodeSet,
    out: &mut MemoryPerformance,
) -> core::result::Result<(), &'static str> {
    let mut head = [0u8; HMAT_HEADER as usize];
    fetch_exact(fetch, 0, &mut head)?;
    if &head[..4] != b"HMAT" {
        return Err("not an HMAT");
    }
    let length = u64::from(u32_at(&head, 4));
    let revision = head[8];
    // First pass: the proximity domains named, to map them onto nodes.
    let mut domains = [0u32; MAX_NODES];
    let mut ndomains = 0;
    let mut any = false;
    for_each_sllbi(fetch, length, |fetch, s| {
        any = true;
        let mut b = [0u8; 4];
        for k in 0..s.initiators + s.targets {
            fetch_exact(fetch, s.at + (SLLBI_FIXED + 4 * k) as u64, &mut b)?;
            let d = u32::from_le_bytes(b);
            if !domains[..ndomains].contains(&d) {
                if ndomains == MAX_NODES {
                    return Err("more proximity domains than MAX_NODES");
                }
                domains[ndomains] = d;
                ndomains += 1;
            }
        }
        Ok(())
    })?;
    if !any {
        return Err("no latency or bandwidth structure");
    }
    domains[..ndomains].sort_unstable();
    if ndomains > online.len() {
        return Err("more proximity domains than online nodes");
    }
    // Domains onto nodes, ascending; where every domain is a node id
    // already, as itself.
    let mut node_of = [0usize; MAX_NODES];
    let identity = domains[..ndomains].iter().all(|&d| (d as usize) < MAX_NODES && online.contains(d as usize));
    for (k, &d) in domains[..ndomains].iter().enumerate() {
        node_of[k] = if identity { d as usize } else { online.iter().nth(k).unwrap_or(0) };
    }
    let node = |d: u32| domains[..ndomains].binary_search(&d).map(|k| node_of[k]).ok();
    // Values from an access-type structure are final; read/write ones
    // combine (lower bandwidth, higher latency) until an access one comes.
    let mut exact_bw = [0u64; MAX_NODES];
    let mut exact_lat = [0u64; MAX_NODES];
    for_each_sllbi(fetch, length, |fetch, s| {
        let mut inits = [0usize; MAX_NODES];
        let mut targs = [0usize; MAX_NODES];
        let mut b = [0u8; 4];
        for (k, slot) in inits[..s.initiators].iter_mut().chain(&mut targs[..s.targets]).enumerate() {
            fetch_exact(fetch, s.at + (SLLBI_FIXED + 4 * k) as u64, &mut b)?;
            *slot = node(u32::from_le_bytes(b)).ok_or("unmapped domain")?;
        }
        let entries = s.at + (SLLBI_FIXED + 4 * (s.initiators + s.targets)) as u64;
        // Row by row: a row is at most 64 entries, 128 bytes.
        let mut row = [0u8; 2 * MAX_NODES];
        for (i, &ini) in inits[..s.initiators].iter().enumerate() {
            let row = &mut row[..2 * s.targets];
            fetch_exact(fetch, entries + (2 * s.targets * i) as u64, row)?;
            for (j, &tgt) in targs[..s.targets].iter().enumerate() {
                let Some(v) = normalize(u16_at(row, 2 * j), s.base, s.data_type, revision) else { continue };
                let bit = 1u64 << tgt;
                match s.data_type {
                    3 => {
                        out.bandwidth[ini][tgt] = v;
                        exact_bw[ini] |= bit;
                    }
                    4 | 5 if exact_bw[ini] & bit == 0 => {
                        let cur = out.bandwidth[ini][tgt];
                        out.bandwidth[ini][tgt] = if cur == 0 { v } else { cur.min(v) };
                    }
                    0 => {
                        out.latency[ini][tgt] = v.min(u32::from(u16::MAX)) as u16;
                        exact_lat[ini] |= bit;
                    }
                    1 | 2 if exact_lat[ini] & bit == 0 => {
                        let cur = u32::from(out.latency[ini][tgt]);
                        out.latency[ini][tgt] = cur.max(v).min(u32::from(u16::MAX)) as u16;
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    })?;
    Ok(())
}

/// Runs `f` on every memory-level (not memory-side cache) latency and
/// bandwidth structure of the table.
fn for_each_sllbi(
    fetch: &mut Fetch<'_>,
    length: u64,
    mut f: impl FnMut(&mut Fetch<'_>, &Sllbi) -> core::result::Result<(), &'static str>,
) -> core::result::Result<(), &'static str> {
    let mut at = HMAT_HEADER;
    while at + 8 <= length {
        let mut h = [0u8; SLLBI_FIXED];
        fetch_exact(fetch, at, &mut h[..8])?;
        let (kind, len) = (u16_at(&h, 0), u64::from(u32_at(&h, 4)));
        if len < 8 || at + len > length {
            return Err("malformed HMAT structure length");
        }
        if kind == SLLBI {
            if len < SLLBI_FIXED as u64 {
                return Err("short latency and bandwidth structure");
            }
            fetch_exact(fetch, at, &mut h)?;
            let s = Sllbi {
                at,
                flags: h[8],
                data_type: h[9],
                initiators: u32_at(&h, 12) as usize,
                targets: u32_at(&h, 16) as usize,
                base: u64::from_le_bytes(h[24..32].try_into().unwrap()),
            };
            if s.initiators > MAX_NODES || s.targets > MAX_NODES {
                return Err("more proximity domains than MAX_NODES");
            }
            let need = SLLBI_FIXED + 4 * (s.initiators + s.targets) + 2 * s.initiators * s.targets;
            if (need as u64) > len {
                return Err("latency and bandwidth structure shorter than its lists");
            }
            // Memory hierarchy 0: the memory itself, not a memory-side cache.
            if s.flags & 0x0f == 0 {
                f(fetch, &s)?;
            }
        }
        at += len;
    }
    Ok(())
}

/// An entry in the kernel's units (ns, MB/s), as `hmat_normalize` does;
/// `None` for "not given" (0) and "unreachable" (0xffff).
fn normalize(entry: u16, base: u64, data_type: u8, revision: u8) -> Option<u32> {
    if entry == 0 || entry == u16::MAX {
        return None;
    }
    let v = u64::from(entry).checked_mul(base).filter(|&v| v <= u64::from(u32::MAX))?;
    let v = match revision {
        // Revision 1 gave tenths.
        1 if v < 10 => return None,
        1 => v.div_ceil(10),
        // Picoseconds to nanoseconds for the latencies.
        _ if data_type <= 2 => v.div_ceil(1000),
        _ => v,
    };
    Some(v as u32)
}

impl Topology {
    /// This topology's memory performance tables: the machine's (read on
    /// first use) or what a synthetic topology was given.
    pub(crate) fn perf(&self) -> &MemoryPerformance {
        match &self.perf {
            Some(p) => p,
            None if self.is_synthetic() => {
                static NONE: MemoryPerformance = MemoryPerformance::unknown();
                &NONE
            }
            None => machine_perf(self),
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
        self.perf().source
    }

    /// The bandwidth (MB/s) a thread on `initiator` sees to memory on
    /// `target`, where known.
    pub fn bandwidth(&self, initiator: usize, target: usize) -> Option<u32> {
        let v = *self.perf().bandwidth.get(initiator)?.get(target)?;
        (v != 0).then_some(v)
    }

    /// The latency (ns) a thread on `initiator` sees to memory on `target`,
    /// where known.
    pub fn latency(&self, initiator: usize, target: usize) -> Option<u32> {
        let v = *self.perf().latency.get(initiator)?.get(target)?;
        (v != 0).then_some(u32::from(v))
    }

    /// The kernel's memory tier of `node`, 1 the top (fastest), where the
    /// kernel has tiers (`/sys/devices/virtual/memory_tiering`).
    pub fn memory_tier(&self, node: usize) -> Option<u8> {
        self.perf().tier.get(node).copied().filter(|&t| t != 0)
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
            let slower = self.cpu_nodes().iter().all(|i| {
                let (own, there) = (p.bandwidth[i][i], p.bandwidth[i][n]);
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
        self.perf().kernel_weight.get(node).copied().filter(|&w| w != 0)
    }

    /// Whether the kernel derives its weights itself
    /// (`weighted_interleave/auto`, Linux 6.16+), where it says.
    pub fn kernel_weights_auto(&self) -> Option<bool> {
        self.perf().kernel_auto
    }

    /// Interleave weights over `nodes` for a thread on `initiator`: in
    /// proportion to the bandwidth it sees to each (reduced as the kernel
    /// does, [`reduce_weights`]); where some node's is unknown, the
    /// kernel's weights; where those are missing too, equal.
    ///
    /// ```
    /// use numaweave::topology::{Topology, WeightSource, PerfSource};
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

    /// The bandwidth and latency matrices as text (the topology's display
    /// and `numaweave topology`), one row per CPU node; empty when nothing
    /// is known.
    pub(crate) fn write_perf(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let p = self.perf();
        if p.source != PerfSource::Unknown {
            writeln!(f, "memory performance from {}: bandwidth GB/s / latency ns, initiator -> target", p.source)?;
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
            match p.kernel_auto {
                Some(true) => writeln!(f, " (auto, from bandwidth)")?,
                Some(false) => writeln!(f, " (set by hand)")?,
                None => writeln!(f)?,
            }
        }
        Ok(())
    }
}

/// The machine's tables (see [`machine_perf`]).
#[cfg(not(loom))]
static MACHINE: crate::sync::InitCell<MemoryPerformance> = crate::sync::InitCell::new();

/// The machine's tables, read once, in place (24 KiB: not built on the
/// stack of whichever thread asks first).
fn machine_perf(t: &Topology) -> &'static MemoryPerformance {
    #[cfg(not(loom))]
    // SAFETY: the closure leaves the slot initialised: zeroed (every
    // table entry "not known"), its two enum fields written before any
    // reference to the value is made, then filled.
    unsafe {
        MACHINE.get_or_init_in_place(|slot| {
            let p = slot.as_mut_ptr();
            p.write_bytes(0, 1);
            core::ptr::addr_of_mut!((*p).source).write(PerfSource::Unknown);
            core::ptr::addr_of_mut!((*p).kernel_auto).write(None);
            (*p).fill_machine(t);
        })
    }
    #[cfg(loom)]
    {
        static MACHINE: std::sync::OnceLock<MemoryPerformance> = std::sync::OnceLock::new();
        MACHINE.get_or_init(|| {
            let mut p = MemoryPerformance::unknown();
            p.fill_machine(t);
            p
        })
    }
}

/// `fork()` handlers' part (the allocator core's, `ForkRank::Core`): the
/// machine's tables are not being read while a child is made.
#[cfg(not(loom))]
pub(crate) fn hold_for_fork() {
    MACHINE.hold_for_fork();
}

/// After `fork()`: see [`hold_for_fork`].
#[cfg(not(loom))]
pub(crate) fn release_after_fork() {
    MACHINE.release_after_fork();
}

/// Builds an HMAT as firmware lays it out: an access-latency and an
/// access-bandwidth structure from `initiators` to `targets` (latency in
/// ns, bandwidth in MB/s, one row per initiator), and a memory-side cache
/// structure the parser must skip.
#[cfg(test)]
fn build_hmat(targets: &[u32], initiators: &[u32], lat_ns: &[&[u32]], bw_mbps: &[&[u32]]) -> Vec<u8> {
    let mut t = vec![0u8; 40];
    t[..4].copy_from_slice(b"HMAT");
    t[8] = 2;
    let sllbi = |data_type: u8, base: u64, rows: &[&[u32]], div: u32, out: &mut Vec<u8>| {
        let len = SLLBI_FIXED + 4 * (initiators.len() + targets.len()) + 2 * initiators.len() * targets.len();
        let mut s = vec![0u8; len];
        s[0..2].copy_from_slice(&SLLBI.to_le_bytes());
        s[4..8].copy_from_slice(&(len as u32).to_le_bytes());
        s[9] = data_type;
        s[12..16].copy_from_slice(&(initiators.len() as u32).to_le_bytes());
        s[16..20].copy_from_slice(&(targets.len() as u32).to_le_bytes());
        s[24..32].copy_from_slice(&base.to_le_bytes());
        let mut at = SLLBI_FIXED;
        for &d in initiators.iter().chain(targets) {
            s[at..at + 4].copy_from_slice(&d.to_le_bytes());
            at += 4;
        }
        for row in rows {
            for &v in row.iter() {
                s[at..at + 2].copy_from_slice(&((v / div) as u16).to_le_bytes());
                at += 2;
            }
        }
        out.extend_from_slice(&s);
    };
    // Latency: entries in ns with a base of 1000 ps. Bandwidth: entries in
    // 100 MB/s with a base of 100.
    sllbi(0, 1000, lat_ns, 1, &mut t);
    sllbi(3, 100, bw_mbps, 100, &mut t);
    // A memory-side cache structure, which must be skipped.
    let mut cache = vec![0u8; 8];
    cache[0..2].copy_from_slice(&2u16.to_le_bytes());
    cache[4..8].copy_from_slice(&8u32.to_le_bytes());
    t.extend_from_slice(&cache);
    let len = t.len() as u32;
    t[4..8].copy_from_slice(&len.to_le_bytes());
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(table: &[u8], online: NodeSet) -> core::result::Result<MemoryPerformance, &'static str> {
        let mut p = MemoryPerformance::unknown();
        let mut fetch = |off: u64, buf: &mut [u8]| -> Result<usize> {
            let off = off as usize;
            if off >= table.len() {
                return Ok(0);
            }
            let n = buf.len().min(table.len() - off);
            buf[..n].copy_from_slice(&table[off..off + n]);
            Ok(n)
        };
        parse_hmat(&mut fetch, online, &mut p).map(|()| p)
    }

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
    fn an_hmat_gives_the_whole_matrix_in_the_kernels_units() {
        let lat: [&[u32]; 2] = [&[80, 140, 250, 350], &[140, 80, 350, 250]];
        let bw: [&[u32]; 2] = [&[100_000, 50_000, 30_000, 15_000], &[50_000, 100_000, 15_000, 30_000]];
        let table = build_hmat(&[0, 1, 2, 3], &[0, 1], &lat, &bw);
        let p = parse(&table, NodeSet::first_n(4)).unwrap();
        for i in 0..2 {
            for t in 0..4 {
                assert_eq!(p.bandwidth[i][t], bw[i][t], "bandwidth {i} -> {t}");
                assert_eq!(u32::from(p.latency[i][t]), lat[i][t], "latency {i} -> {t}");
            }
        }
        assert_eq!(p.bandwidth[2], [0; MAX_NODES], "a memory-only node initiates nothing");
    }

    #[test]
    fn domains_map_onto_nodes_in_ascending_order() {
        // Domains 4 and 9 on a machine whose nodes are 0 and 1.
        let table = build_hmat(&[4, 9], &[4, 9], &[&[10, 20], &[20, 10]], &[&[2000, 1000], &[1000, 2000]]);
        let p = parse(&table, NodeSet::first_n(2)).unwrap();
        assert_eq!((p.bandwidth[0][1], p.bandwidth[1][1]), (1000, 2000));
        // More domains than nodes: refused.
        assert!(parse(&table, NodeSet::first_n(1)).is_err());
    }

    #[test]
    fn malformed_tables_are_refused_not_misread() {
        let good = build_hmat(&[0, 1], &[0], &[&[10, 20]], &[&[2000, 1000]]);
        assert!(parse(&good, NodeSet::first_n(2)).is_ok());
        assert!(parse(b"SRAT", NodeSet::first_n(2)).is_err());
        let mut short = good.clone();
        short.truncate(good.len() - 12);
        assert!(parse(&short, NodeSet::first_n(2)).is_err(), "a table shorter than its header says");
        let mut bad_len = good.clone();
        bad_len[44..48].copy_from_slice(&3u32.to_le_bytes());
        assert!(parse(&bad_len, NodeSet::first_n(2)).is_err(), "a structure of 3 bytes");
        let mut too_many = good;
        too_many[40 + 12..40 + 16].copy_from_slice(&1000u32.to_le_bytes());
        assert!(parse(&too_many, NodeSet::first_n(2)).is_err(), "1000 initiators");
    }

    /// Two sockets and a CXL node behind each, as numa-vm's `--hmat`
    /// defaults describe them.
    fn cxl_machine() -> super::super::SyntheticBuilder {
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

    #[test]
    fn each_socket_weights_by_its_own_bandwidth() {
        let t = cxl_machine().build().unwrap();
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

    #[test]
    fn revision_one_and_unreachable_entries() {
        assert_eq!(normalize(0, 1, 3, 2), None);
        assert_eq!(normalize(u16::MAX, 1, 3, 2), None);
        assert_eq!(normalize(80, 1000, 0, 2), Some(80), "80,000 ps");
        assert_eq!(normalize(5, 1, 3, 1), None, "revision 1: under 10 is nothing");
        assert_eq!(normalize(125, 1, 3, 1), Some(13));
        assert_eq!(normalize(u16::MAX - 1, u64::MAX, 3, 2), None, "overflow");
    }
}
