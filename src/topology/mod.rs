//! NUMA topology: which nodes exist, which have CPUs and which only memory,
//! how far apart they are, which CPU belongs to which node, which nodes this
//! process may use, and where the calling thread runs now.
//!
//! Discovery ([`Topology::detect`]) reads sysfs and procfs into fixed-size
//! tables on the stack: it never allocates, because the allocator calls it
//! during its own start-up. [`Topology::global`] discovers once per process and
//! honours `NUMAWEAVE_TOPOLOGY`:
//!
//! | value | topology |
//! | --- | --- |
//! | unset, `sysfs` | the machine's, from `/sys/devices/system/node` |
//! | `fake:N` | N logical nodes over the real ones (1 ≤ N ≤ [`MAX_NODES`]), CPUs dealt round-robin, like the kernel's `numa=fake` |
//! | `fake:LIST` | the same with these node ids (`fake:0,2`: no node 1, as after a hot-remove) |
//! | `hwloc` | from hwloc (only with the `hwloc` feature) |
//!
//! An invalid value is reported once on stderr and the default is used.
//!
//! # Limits
//! Node ids at or above [`MAX_NODES`] (64) and CPU ids at or above [`MAX_CPUS`]
//! (1024) are not represented. Such nodes are left out of every set (counted
//! in [`Topology::ignored_nodes`]); CPUs on them, or beyond `MAX_CPUS`, have no
//! node, and a thread running there is treated as running on
//! [`Topology::default_node`]. Memory is still never placed on a node the
//! process may not use: binding goes through the kernel, which checks.

mod device;
pub(crate) mod display;
#[cfg(feature = "hwloc")]
pub mod hwloc;
mod perf;
mod synthetic;
mod sysfs;

pub use crate::sets::{CpuSet, IdSet, Iter, MAX_CPUS, MAX_NODES, NodeSet};
pub use perf::PerfSource;
#[cfg(test)]
pub(crate) use perf::cxl_machine;
pub(crate) use perf::read_kernel_weight;
#[cfg(not(loom))]
pub(crate) use perf::{hold_for_fork as perf_hold_for_fork, release_after_fork as perf_release_after_fork};
pub use synthetic::{MEMORY_ONLY_DISTANCE, SyntheticBuilder};
pub use sysfs::node_of_frame;

use crate::error::{Error, Result};
#[cfg(not(loom))]
use crate::sync::InitCell;

/// The kernel's "no node" (`NUMA_NO_NODE`), as sysfs reports it for a device
/// not attached to a node.
pub const NUMA_NO_NODE: i32 = -1;

/// Distance from a node to itself in the ACPI SLIT convention.
pub const LOCAL_DISTANCE: u8 = 10;

/// Distance between two distinct nodes when the firmware gives none.
pub const REMOTE_DISTANCE: u8 = 20;

const NO_NODE: u8 = u8::MAX;

/// Where a [`Topology`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The machine's, from sysfs.
    Sysfs,
    /// A kernel without NUMA support (no `/sys/devices/system/node`): one
    /// node 0 holding every CPU and all memory.
    NoNuma,
    /// Synthetic: `fake:N` or the [`SyntheticBuilder`]. `physical_nodes` is the
    /// number of real nodes it is laid over.
    Synthetic {
        /// Real memory nodes the logical nodes are laid over.
        physical_nodes: u8,
        /// Whether it came from `NUMAWEAVE_TOPOLOGY=fake:N` (else the builder).
        fake: bool,
    },
    /// From hwloc (feature `hwloc`); `synthetic` for an hwloc synthetic description.
    Hwloc {
        /// Whether hwloc built it from a synthetic description rather than this machine.
        synthetic: bool,
    },
}

/// A NUMA topology: fixed-size tables, `Copy`-free but cheap to move (about 6 KiB).
///
/// ```
/// use numaweave::topology::Topology;
/// let t = Topology::global();
/// assert!(t.node_count() >= 1);
/// let here = t.current_node();
/// assert!(t.nodes().contains(here));
/// assert_eq!(t.distance(here, here), 10);
/// ```
#[derive(Clone)]
pub struct Topology {
    source: Source,
    online: NodeSet,
    with_cpus: NodeSet,
    with_memory: NodeSet,
    allowed: NodeSet,
    distance: [[u8; MAX_NODES]; MAX_NODES],
    memory: [u64; MAX_NODES],
    physical: [u8; MAX_NODES],
    cpu_node: [u8; MAX_CPUS],
    ignored_nodes: u16,
    ignored_cpus: u16,
    /// A synthetic topology's memory performance; `None`: the machine's,
    /// read on first use (or none, for a synthetic one given none).
    perf: Option<std::sync::Arc<perf::MemoryPerformance>>,
}

/// [`Topology::global`]'s value.
#[cfg(not(loom))]
static GLOBAL: InitCell<Topology> = InitCell::new();
// Under loom, `InitCell` holds loom atomics, which can live in no
// process-wide static; the models exercise `InitCell` directly.
#[cfg(loom)]
static GLOBAL: std::sync::OnceLock<Topology> = std::sync::OnceLock::new();

/// `fork()` handlers' part (the allocator core's, `ForkRank::Engine`): no
/// child inherits the process topology half read.
#[cfg(not(loom))]
pub(crate) fn global_hold_for_fork() {
    GLOBAL.hold_for_fork();
}

/// After `fork()`: see [`global_hold_for_fork`].
#[cfg(not(loom))]
pub(crate) fn global_release_after_fork() {
    GLOBAL.release_after_fork();
}

impl Topology {
    /// [`empty`](Self::empty)'s value written over `self`, in place: no 6
    /// KiB temporary on the stack.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    fn clear(&mut self, source: Source) {
        let slot = core::ptr::from_mut(self).cast::<core::mem::MaybeUninit<Topology>>();
        // SAFETY: `self` is valid, so dropping it in place is sound (its one
        // owned field, `perf`, is let go); nothing reads it before
        // `empty_in`, which cannot fail, writes every field again.
        unsafe {
            core::ptr::drop_in_place(self);
            Topology::empty_in(&mut *slot, source);
        }
    }

    /// An empty topology written into `slot` field by field, returned
    /// initialised: the one list of an empty topology's fields ([`empty`](Self::empty)
    /// and [`clear`](Self::clear) are made with it).
    #[unsafe(link_section = ".text.sorted.numaweave")]
    fn empty_in(slot: &mut core::mem::MaybeUninit<Topology>, source: Source) -> &mut Topology {
        let s = slot.as_mut_ptr();
        // SAFETY: each write fills one field of the slot in place (nothing
        // was there to drop); together every field (the pattern below lists
        // them), so the slot is initialised when it is returned.
        unsafe {
            (&raw mut (*s).source).write(source);
            (&raw mut (*s).online).write(NodeSet::new());
            (&raw mut (*s).with_cpus).write(NodeSet::new());
            (&raw mut (*s).with_memory).write(NodeSet::new());
            (&raw mut (*s).allowed).write(NodeSet::new());
            (&raw mut (*s).distance).write([[0; MAX_NODES]; MAX_NODES]);
            (&raw mut (*s).memory).write([0; MAX_NODES]);
            (&raw mut (*s).physical).write(core::array::from_fn(|i| i as u8));
            (&raw mut (*s).cpu_node).write([NO_NODE; MAX_CPUS]);
            (&raw mut (*s).ignored_nodes).write(0);
            (&raw mut (*s).ignored_cpus).write(0);
            (&raw mut (*s).perf).write(None);
        }
        // The fields written above, by name: a field added to `Topology`
        // fails to compile here until it is written too.
        let _: fn(&Topology) = |t| {
            let Topology {
                source: _,
                online: _,
                with_cpus: _,
                with_memory: _,
                allowed: _,
                distance: _,
                memory: _,
                physical: _,
                cpu_node: _,
                ignored_nodes: _,
                ignored_cpus: _,
                perf: _,
            } = t;
        };
        // SAFETY: every field was written above.
        unsafe { slot.assume_init_mut() }
    }

    fn empty(source: Source) -> Self {
        let mut t = core::mem::MaybeUninit::uninit();
        Topology::empty_in(&mut t, source);
        // SAFETY: `empty_in` initialised it.
        unsafe { t.assume_init() }
    }

    /// The machine's topology, read from sysfs and procfs now (no environment
    /// override, no caching). Without a NUMA kernel it is one node 0
    /// ([`Source::NoNuma`]). Never allocates.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub fn detect() -> Result<Self> {
        sysfs::detect()
    }

    /// The process-wide topology, discovered on first use (see the module docs
    /// for `NUMAWEAVE_TOPOLOGY`). Never fails: if discovery itself fails, the
    /// result is a single node 0 with every CPU, reported once on stderr.
    pub fn global() -> &'static Topology {
        // SAFETY: `from_env_in` leaves the slot initialised.
        #[cfg(not(loom))]
        return unsafe { GLOBAL.get_or_init_in_place(from_env_in) };
        #[cfg(loom)]
        GLOBAL.get_or_init(from_env)
    }

    /// A builder for a synthetic topology of `nodes` logical nodes with CPUs
    /// (see [`SyntheticBuilder`]).
    pub fn synthetic(nodes: usize) -> SyntheticBuilder {
        SyntheticBuilder::new(nodes)
    }

    /// `fake:N`: `n` logical nodes laid over this machine's real ones, like
    /// the kernel's `numa=fake=N`; see [`SyntheticBuilder::fake`].
    pub fn fake(n: usize) -> Result<Self> {
        SyntheticBuilder::fake(&Self::detect()?, n)
    }

    /// One node 0 with every online CPU and all memory (what a kernel without
    /// NUMA support looks like). Never allocates.
    #[cfg_attr(loom, allow(dead_code))] // only the allocator uses it
    pub(crate) fn single_node() -> Self {
        sysfs::single_node_fallback()
    }

    /// Where this topology came from.
    pub fn source(&self) -> Source {
        self.source
    }

    /// Whether this is not the machine's real layout (fake or builder, or an
    /// hwloc synthetic description). Everything that prints a topology says so.
    pub fn is_synthetic(&self) -> bool {
        matches!(self.source, Source::Synthetic { .. } | Source::Hwloc { synthetic: true })
    }

    /// Online nodes.
    pub fn nodes(&self) -> NodeSet {
        self.online
    }

    /// Number of online nodes.
    pub fn node_count(&self) -> usize {
        self.online.len()
    }

    /// Nodes with at least one CPU.
    pub fn cpu_nodes(&self) -> NodeSet {
        self.with_cpus
    }

    /// Nodes with memory.
    pub fn memory_nodes(&self) -> NodeSet {
        self.with_memory
    }

    /// Nodes with memory but no CPU: CXL expanders, HBM, persistent memory.
    pub fn memory_only_nodes(&self) -> NodeSet {
        self.with_memory.difference(&self.with_cpus)
    }

    /// Nodes whose memory this process may use: `Mems_allowed` from
    /// `/proc/self/status` (so `numactl --membind` and cpusets count), as it was
    /// at discovery, limited to online nodes with memory.
    pub fn allowed_nodes(&self) -> NodeSet {
        self.allowed
    }

    /// Online nodes at or beyond [`MAX_NODES`] that were left out.
    pub fn ignored_nodes(&self) -> usize {
        usize::from(self.ignored_nodes)
    }

    /// CPUs at or beyond [`MAX_CPUS`], or on ignored nodes, that were left out.
    pub fn ignored_cpus(&self) -> usize {
        usize::from(self.ignored_cpus)
    }

    /// Checks that `node` is online and returns it.
    pub fn check_node(&self, node: usize) -> Result<usize> {
        if node >= MAX_NODES {
            Err(Error::InvalidNode { node, reason: "beyond MAX_NODES (64)" })
        } else if !self.online.contains(node) {
            Err(Error::InvalidNode { node, reason: "not an online node" })
        } else {
            Ok(node)
        }
    }

    /// The node of CPU `cpu`, `None` for a CPU that is offline or not represented.
    #[inline]
    pub fn node_of_cpu(&self, cpu: usize) -> Option<usize> {
        match self.cpu_node.get(cpu) {
            Some(&n) if n != NO_NODE => Some(usize::from(n)),
            _ => None,
        }
    }

    /// CPUs of `node` (empty for a memory-only or unknown node).
    pub fn cpus_of(&self, node: usize) -> CpuSet {
        let mut s = CpuSet::new();
        if node < MAX_NODES {
            for (cpu, &n) in self.cpu_node.iter().enumerate() {
                if usize::from(n) == node {
                    s.insert(cpu);
                }
            }
        }
        s
    }

    /// Every CPU that has a node.
    pub fn cpus(&self) -> CpuSet {
        self.cpu_node.iter().enumerate().filter(|(_, n)| **n != NO_NODE).map(|(c, _)| c).collect()
    }

    /// Distance from `a` to `b` in ACPI SLIT units (10 = local); 0 when either
    /// node is not online.
    #[inline]
    pub fn distance(&self, a: usize, b: usize) -> u8 {
        if self.online.contains(a) && self.online.contains(b) { self.distance[a][b] } else { 0 }
    }

    /// Total memory of `node` in bytes (0 when unknown or memory-less).
    pub fn memory_of(&self, node: usize) -> u64 {
        if self.online.contains(node) { self.memory[node] } else { 0 }
    }

    /// The kernel node that holds the memory of `node`: `node` itself, except
    /// in a synthetic topology, whose logical nodes are laid over real ones.
    /// This is the id the [OS layer](crate::os) must be given.
    #[inline]
    pub fn physical_node(&self, node: usize) -> usize {
        usize::from(self.physical.get(node).copied().unwrap_or(0))
    }

    /// The kernel node ids behind a set of (logical) nodes.
    pub fn physical_set(&self, nodes: NodeSet) -> NodeSet {
        nodes.iter().map(|n| self.physical_node(n)).collect()
    }

    /// The huge-page pools (hugetlbfs) of `node` as the kernel reports them
    /// now: pages of each size reserved, free and surplus, smallest size
    /// first; empty where the kernel has none. Read from sysfs at each call
    /// (the pools change as programs take pages), so not for hot paths. A
    /// synthetic topology's node reports the pools of the real node under it
    /// (nodes laid over one real node share them).
    ///
    /// ```
    /// use numaweave::Topology;
    /// let t = Topology::detect().unwrap();
    /// for pool in t.huge_pages(t.default_node()).unwrap().iter() {
    ///     println!("{} KiB pages: {} free of {}", pool.page_size >> 10, pool.free, pool.total);
    /// }
    /// ```
    pub fn huge_pages(&self, node: usize) -> Result<HugePages> {
        self.check_node(node)?;
        sysfs::huge_pages(self.physical_node(node))
    }

    /// Free memory of `node` in bytes now (`MemFree` from its sysfs
    /// meminfo), as a demotion condition watches it. Read at each call, with
    /// no allocation; a synthetic node reports the real node under it.
    ///
    /// ```
    /// use numaweave::Topology;
    /// let t = Topology::detect().unwrap();
    /// let node = t.default_node();
    /// let (free, total) = (t.free_memory(node).unwrap(), t.memory_of(node));
    /// assert!(free > 0 && (total == 0 || free <= total), "{free} free of {total}");
    /// ```
    pub fn free_memory(&self, node: usize) -> Result<u64> {
        self.check_node(node)?;
        sysfs::read_node_free(self.physical_node(node))
    }

    /// The logical node for a kernel node id (the lowest logical node laid
    /// over it), as used to translate a device's `numa_node`.
    pub fn logical_node(&self, physical: usize) -> Option<usize> {
        self.online.iter().find(|&n| self.physical_node(n) == physical)
    }

    /// The node used when a thread's CPU has no node: the first allowed node
    /// with CPUs, else the first allowed node, else node 0.
    pub fn default_node(&self) -> usize {
        self.allowed
            .intersection(&self.with_cpus)
            .first()
            .or_else(|| self.allowed.first())
            .or_else(|| self.online.first())
            .unwrap_or(0)
    }

    /// The CPU the calling thread runs on now (the rseq area, else
    /// `sched_getcpu`: no system call).
    #[inline]
    pub fn current_cpu(&self) -> Option<usize> {
        crate::os::cpu::current_cpu()
    }

    /// The node of the CPU the calling thread runs on now, or
    /// [`default_node`](Self::default_node) when that CPU has none. A hint: the
    /// thread may migrate right after.
    #[inline]
    pub fn current_node(&self) -> usize {
        match self.current_cpu().and_then(|c| self.node_of_cpu(c)) {
            Some(n) => n,
            None => self.default_node(),
        }
    }

    /// Online nodes ordered by distance from `from` (itself first, ties by id):
    /// the order in which to fall back when `from` is out of memory.
    pub fn nodes_by_distance(&self, from: usize) -> NodeOrder {
        let mut order = NodeOrder { ids: [0; MAX_NODES], len: 0, pos: 0 };
        for n in self.online.iter() {
            order.ids[order.len] = n as u8;
            order.len += 1;
        }
        let d = |n: u8| (self.distance(from, usize::from(n)), n);
        order.ids[..order.len].sort_unstable_by_key(|&n| d(n));
        order
    }
}

/// Nodes in fallback order, from [`Topology::nodes_by_distance`].
#[derive(Clone, Debug)]
pub struct NodeOrder {
    ids: [u8; MAX_NODES],
    len: usize,
    pos: usize,
}

impl Iterator for NodeOrder {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        (self.pos < self.len).then(|| {
            self.pos += 1;
            usize::from(self.ids[self.pos - 1])
        })
    }
}

/// Builds the process topology as `NUMAWEAVE_TOPOLOGY` asks, into `slot`.
/// Without the variable, in place: start-up's stack pages stay in every
/// program's RSS, and each copy of a topology on the way took 6 KiB of them.
#[cfg(not(loom))]
#[unsafe(link_section = ".text.sorted.numaweave")]
fn from_env_in(slot: &mut core::mem::MaybeUninit<Topology>) {
    let t = Topology::empty_in(slot, Source::Sysfs);
    match crate::os::file::env(c"NUMAWEAVE_TOPOLOGY") {
        None => real_topology_into(t),
        Some(spec) => *t = from_spec(spec),
    }
}

/// [`from_env_in`] as a value (the loom build's `OnceLock`).
#[cfg(loom)]
fn from_env() -> Topology {
    match crate::os::file::env(c"NUMAWEAVE_TOPOLOGY") {
        None => real_topology(),
        Some(spec) => from_spec(spec),
    }
}

/// This machine's topology, or one node if discovery fails, into `t` (an
/// empty one).
#[unsafe(link_section = ".text.sorted.numaweave")]
fn real_topology_into(t: &mut Topology) {
    if let Err(e) = sysfs::detect_into(t) {
        crate::os::file::report(format_args!("numaweave: topology discovery failed ({e}); assuming one node"));
        sysfs::single_node_fallback_into(t);
    }
}

/// [`real_topology_into`] as a value.
#[inline(never)]
fn real_topology() -> Topology {
    let mut t = Topology::empty(Source::Sysfs);
    real_topology_into(&mut t);
    t
}

/// The topology `NUMAWEAVE_TOPOLOGY` asks for.
#[cold]
#[inline(never)]
fn from_spec(spec: &str) -> Topology {
    match parse_spec(spec) {
        Ok(Spec::Sysfs) => real_topology(),
        Ok(Spec::Fake(ids)) => match SyntheticBuilder::fake_ids(&real_topology(), ids) {
            Ok(t) => t,
            Err(e) => {
                crate::os::file::report(format_args!(
                    "numaweave: NUMAWEAVE_TOPOLOGY={spec}: {e}; using the real topology"
                ));
                real_topology()
            }
        },
        #[cfg(feature = "hwloc")]
        Ok(Spec::Hwloc) => match hwloc::detect() {
            Ok(t) => t,
            Err(e) => {
                crate::os::file::report(format_args!("numaweave: NUMAWEAVE_TOPOLOGY=hwloc: {e}; using sysfs"));
                real_topology()
            }
        },
        Err(why) => {
            crate::os::file::report(format_args!(
                "numaweave: ignoring NUMAWEAVE_TOPOLOGY={spec:?}: {why} (want sysfs, fake:N or hwloc)"
            ));
            real_topology()
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Spec {
    Sysfs,
    /// `fake:N` or `fake:LIST`: the node ids.
    Fake(NodeSet),
    #[cfg(feature = "hwloc")]
    Hwloc,
}

fn parse_spec(s: &str) -> core::result::Result<Spec, &'static str> {
    let s = s.trim();
    if s.is_empty() || s == "sysfs" {
        return Ok(Spec::Sysfs);
    }
    if s == "hwloc" {
        #[cfg(feature = "hwloc")]
        return Ok(Spec::Hwloc);
        #[cfg(not(feature = "hwloc"))]
        return Err("built without the `hwloc` feature");
    }
    if let Some(n) = s.strip_prefix("fake:") {
        // A count, or a list of ids (with a ',' or a '-').
        if n.contains([',', '-']) {
            return match n.parse::<NodeSet>() {
                Ok(ids) if !ids.is_empty() => Ok(Spec::Fake(ids)),
                _ => Err("fake:LIST needs node ids below 64 (0,2 or 0-1,4)"),
            };
        }
        return match n.parse::<usize>() {
            Ok(n) if (1..=MAX_NODES).contains(&n) => Ok(Spec::Fake(NodeSet::first_n(n))),
            _ => Err("fake:N needs 1 <= N <= 64"),
        };
    }
    Err("unknown topology source")
}

/// One size of huge pages on a node: the kernel's hugetlb pool
/// (`/sys/devices/system/node/nodeN/hugepages/hugepages-<size>kB`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HugePool {
    /// Bytes per page (2 MiB, 1 GiB on x86-64).
    pub page_size: usize,
    /// Pages in the pool (`nr_hugepages`: reserved at boot or through sysfs).
    pub total: u64,
    /// Pages nobody has taken (`free_hugepages`).
    pub free: u64,
    /// Pages beyond the pool, allocated on demand (`surplus_hugepages`).
    pub surplus: u64,
}

/// A node's huge-page pools, smallest page size first; from
/// [`Topology::huge_pages`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HugePages {
    pools: [HugePool; Self::MAX_SIZES],
    len: usize,
}

impl HugePages {
    /// Sizes kept (x86-64 has two, arm64 up to four).
    pub const MAX_SIZES: usize = 4;

    fn push(&mut self, p: HugePool) {
        if self.len < Self::MAX_SIZES {
            self.pools[self.len] = p;
            self.len += 1;
        }
    }

    /// The pools.
    pub fn iter(&self) -> core::slice::Iter<'_, HugePool> {
        self.pools[..self.len].iter()
    }

    /// The pool of pages of `page_size` bytes, if the kernel has one.
    pub fn get(&self, page_size: usize) -> Option<HugePool> {
        self.iter().find(|p| p.page_size == page_size).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_grammar() {
        assert_eq!(parse_spec(""), Ok(Spec::Sysfs));
        assert_eq!(parse_spec("sysfs"), Ok(Spec::Sysfs));
        assert_eq!(parse_spec("fake:4"), Ok(Spec::Fake(NodeSet::first_n(4))));
        assert_eq!(parse_spec(" fake:64 "), Ok(Spec::Fake(NodeSet::first_n(64))));
        assert_eq!(parse_spec("fake:0,2"), Ok(Spec::Fake("0,2".parse().unwrap())));
        assert_eq!(parse_spec("fake:0-1,4"), Ok(Spec::Fake("0,1,4".parse().unwrap())));
        assert!(parse_spec("fake:0,64").is_err());
        assert!(parse_spec("fake:2-").is_err());
        assert!(parse_spec("fake:0").is_err());
        assert!(parse_spec("fake:65").is_err());
        assert!(parse_spec("fake:x").is_err());
        assert!(parse_spec("numa=fake").is_err());
        #[cfg(not(feature = "hwloc"))]
        assert!(parse_spec("hwloc").is_err());
    }
}
