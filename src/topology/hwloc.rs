//! Topology, distances and device locality from hwloc (feature `hwloc`).
//!
//! hwloc allocates (through libc's `malloc`, and hwlocality through Rust's
//! global allocator), so unlike the sysfs reader it is not for use inside an
//! allocator's start-up: [`Topology::global`] uses it only when
//! `NUMAWEAVE_TOPOLOGY=hwloc` asks for it.

use hwlocality::object::TopologyObject;
use hwlocality::object::attributes::ObjectAttributes;
use hwlocality::object::types::ObjectType;
use hwlocality::topology::builder::TypeFilter;

use super::{LOCAL_DISTANCE, MAX_CPUS, MAX_NODES, NO_NODE, NodeSet, REMOTE_DISTANCE, Source, Topology};
use crate::error::{DeviceKind, Error, Name, Result};

/// This machine's topology as hwloc sees it.
pub fn detect() -> Result<Topology> {
    let topo = hwlocality::Topology::new().map_err(|_| Error::Hwloc { what: "loading this machine's topology" })?;
    from_hwloc(&topo, false)
}

/// An hwloc topology of this machine with I/O objects kept (PCI devices, block
/// and network OS devices), for [`device_node`].
pub fn load_with_io() -> Result<hwlocality::Topology> {
    hwlocality::Topology::builder()
        .with_io_type_filter(TypeFilter::KeepImportant)
        .map_err(|_| Error::Hwloc { what: "keeping I/O objects" })?
        .build()
        .map_err(|_| Error::Hwloc { what: "loading this machine's topology" })
}

/// A topology from an hwloc synthetic description, e.g.
/// `"pack:2 numa:1 core:2 pu:1"`. Synthetic descriptions carry no distances,
/// so these default to 10 local and 20 remote unless [`from_hwloc`] is given a
/// topology that had distances added.
///
/// ```
/// let t = numaweave::topology::hwloc::synthetic("pack:2 numa:1 core:2 pu:1").unwrap();
/// assert!(t.is_synthetic());
/// assert_eq!(t.nodes().to_string(), "0-1");
/// assert_eq!(t.cpus_of(1).to_string(), "2-3");
/// ```
pub fn synthetic(description: &str) -> Result<Topology> {
    let topo = synthetic_hwloc(description)?;
    from_hwloc(&topo, true)
}

/// The raw hwloc topology for a synthetic description.
pub fn synthetic_hwloc(description: &str) -> Result<hwlocality::Topology> {
    hwlocality::Topology::builder()
        .from_synthetic(description)
        .map_err(|_| Error::InvalidTopology { reason: "hwloc rejected the synthetic description" })?
        .build()
        .map_err(|_| Error::Hwloc { what: "building a synthetic topology" })
}

/// Converts an hwloc topology into the crate's tables. `synthetic` marks it as
/// not this machine's layout (and lays it over node 0 for memory placement).
pub fn from_hwloc(topo: &hwlocality::Topology, synthetic: bool) -> Result<Topology> {
    let mut t = Topology::empty(Source::Hwloc { synthetic });
    let numa: Vec<&TopologyObject> = topo.objects_with_type(ObjectType::NUMANode).collect();
    if numa.is_empty() {
        return Err(Error::InvalidTopology { reason: "hwloc found no NUMA node" });
    }
    for obj in &numa {
        let Some(n) = obj.os_index() else { continue };
        if n >= MAX_NODES {
            t.ignored_nodes += 1;
            continue;
        }
        t.online.insert(n);
        if let Some(ObjectAttributes::NUMANode(a)) = obj.attributes() {
            t.memory[n] = a.local_memory().map_or(0, |m| m.get());
        }
        // hwloc reports every node it keeps as having memory (a node object
        // is a memory object); CPU-less ones are memory-only.
        t.with_memory.insert(n);
        if let Some(cpus) = obj.cpuset() {
            for c in cpus.iter_set() {
                let c = usize::from(c);
                if c >= MAX_CPUS {
                    t.ignored_cpus += 1;
                    continue;
                }
                t.cpu_node[c] = n as u8;
                t.with_cpus.insert(n);
            }
        }
    }
    // The first matrix over NUMA nodes (from the OS, i.e. the SLIT, or added by
    // the user); default values where there is none.
    let matrices = topo.distances(None).map_err(|_| Error::Hwloc { what: "reading distances" })?;
    let matrix =
        matrices.iter().find(|d| d.objects().all(|o| o.is_some_and(|o| o.object_type() == ObjectType::NUMANode)));
    for a in &numa {
        for b in &numa {
            let (Some(i), Some(j)) = (a.os_index(), b.os_index()) else { continue };
            if i >= MAX_NODES || j >= MAX_NODES {
                continue;
            }
            let given = matrix.and_then(|m| m.object_pair_distance((a, b))).map(|(ab, _)| ab);
            t.distance[i][j] = match given {
                Some(d) => u8::try_from(d).unwrap_or(u8::MAX),
                None if i == j => LOCAL_DISTANCE,
                None => REMOTE_DISTANCE,
            };
        }
    }
    let allowed: NodeSet = topo.allowed_nodeset().iter_set().map(usize::from).collect();
    t.allowed = allowed.intersection(&t.with_memory);
    if synthetic {
        // Synthetic nodes are laid over real node 0 for placement.
        t.physical = [0; MAX_NODES];
    }
    debug_assert!(t.cpu_node.iter().all(|&n| n == NO_NODE || t.online.contains(usize::from(n))));
    Ok(t)
}

/// The kernel node of a device in an hwloc topology loaded with I/O objects
/// ([`load_with_io`]): a PCI bus id (`0000:03:00.0`) or an OS device name
/// (`nvme0n1`, `eth0`). `Ok(None)` when hwloc attaches the device to the
/// whole machine rather than to a node.
pub fn device_node(topo: &hwlocality::Topology, name: &str) -> Result<Option<usize>> {
    let obj = topo
        .pci_device_by_bus_id_string(name)
        .ok()
        .flatten()
        .or_else(|| topo.os_devices().find(|o| o.name().is_some_and(|n| n.to_bytes() == name.as_bytes())))
        .ok_or(Error::NoSuchDevice { kind: DeviceKind::Any, name: Name::new(name) })?;
    let Some(anc) = obj.first_non_io_ancestor() else { return Ok(None) };
    // Attached to the machine itself: hwloc's form of the kernel's
    // NUMA_NO_NODE. Attached above several nodes (a package holding two): no
    // single node either.
    let Some(nodes) = anc.nodeset() else { return Ok(None) };
    if anc.object_type() == ObjectType::Machine || nodes.weight() != Some(1) {
        return Ok(None);
    }
    Ok(nodes.first_set().map(usize::from))
}
