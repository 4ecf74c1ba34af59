//! hwloc as a second source of truth (feature `hwloc`): synthetic topologies,
//! added distances, and agreement with the sysfs reader on this machine.
#![cfg(feature = "hwloc")]

use hwlocality::object::distance::{AddDistancesFlags, DistancesKind};
use hwlocality::object::types::ObjectType;
use numaweave::topology::{NodeSet, Topology, hwloc};

#[test]
fn synthetic_description_becomes_tables() {
    let t = hwloc::synthetic("pack:4 numa:1 core:2 pu:2").unwrap();
    assert!(t.is_synthetic());
    assert!(t.to_string().starts_with("SYNTHETIC"));
    assert_eq!(t.node_count(), 4);
    assert_eq!(t.cpus_of(0).to_string(), "0-3");
    assert_eq!(t.cpus_of(3).to_string(), "12-15");
    assert_eq!(t.node_of_cpu(13), Some(3));
    assert_eq!(t.memory_only_nodes(), NodeSet::new());
    assert_eq!(t.distance(0, 0), 10);
    assert_eq!(t.distance(0, 3), 20);
    assert_eq!(t.allowed_nodes().to_string(), "0-3");
}

#[test]
fn bad_synthetic_description_is_an_error() {
    assert!(matches!(hwloc::synthetic("pack:x numa"), Err(numaweave::Error::InvalidTopology { .. })));
}

#[test]
fn added_distances_are_read_back() {
    let mut topo = hwloc::synthetic_hwloc("pack:3 numa:1 core:1 pu:1").unwrap();
    let want: [[u64; 3]; 3] = [[10, 16, 32], [16, 10, 22], [32, 22, 10]];
    topo.edit(|e| {
        // Name `None`: hwlocality 1.0.0-alpha.13 reads freed memory when given
        // `Some(name)` (an upstream bug).
        e.add_distances(
            None,
            DistancesKind::FROM_USER | DistancesKind::MEANS_LATENCY,
            AddDistancesFlags::empty(),
            |t| {
                let nodes: Vec<_> = t.objects_with_type(ObjectType::NUMANode).map(Some).collect();
                (nodes, want.iter().flatten().copied().collect())
            },
        )
        .unwrap()
    });
    let t = hwloc::from_hwloc(&topo, true).unwrap();
    for (i, row) in want.iter().enumerate() {
        for (j, &d) in row.iter().enumerate() {
            assert_eq!(u64::from(t.distance(i, j)), d, "{i}->{j}");
        }
    }
    assert_eq!(t.nodes_by_distance(0).collect::<Vec<_>>(), [0, 1, 2]);
    assert_eq!(t.nodes_by_distance(2).collect::<Vec<_>>(), [2, 1, 0]);
}

#[test]
fn hwloc_and_sysfs_agree_on_this_machine() {
    let sys = Topology::detect().unwrap();
    let hw = hwloc::detect().unwrap();
    assert!(!hw.is_synthetic());
    assert_eq!(hw.nodes(), sys.nodes(), "online nodes\nhwloc:\n{hw}\nsysfs:\n{sys}");
    assert_eq!(hw.cpu_nodes(), sys.cpu_nodes());
    assert_eq!(hw.memory_only_nodes(), sys.memory_only_nodes());
    assert_eq!(hw.allowed_nodes(), sys.allowed_nodes());
    for n in sys.nodes().iter() {
        assert_eq!(hw.cpus_of(n), sys.cpus_of(n), "cpus of node {n}");
        for m in sys.nodes().iter() {
            assert_eq!(hw.distance(n, m), sys.distance(n, m), "distance {n}->{m}");
        }
        // hwloc reports a node's local memory; sysfs MemTotal may differ by
        // what the kernel reserved, but not by more than a tenth.
        let (a, b) = (hw.memory_of(n) as f64, sys.memory_of(n) as f64);
        assert!((a - b).abs() <= b / 10.0, "memory of node {n}: hwloc {a} sysfs {b}");
    }
}

#[test]
fn hwloc_and_sysfs_agree_on_device_locality() {
    let sys = Topology::detect().unwrap();
    let topo = hwloc::load_with_io().unwrap();
    let mut checked = 0;
    for dev in topo.os_devices().chain(topo.pci_devices()) {
        let name = match dev.object_type() {
            ObjectType::PCIDevice => match dev.attributes() {
                Some(hwlocality::object::attributes::ObjectAttributes::PCIDevice(p)) => {
                    format!("{:04x}:{:02x}:{:02x}.{:x}", p.domain(), p.bus_id(), p.bus_device(), p.function())
                }
                _ => continue,
            },
            _ => match dev.name() {
                Some(n) => n.to_string_lossy().into_owned(),
                None => continue,
            },
        };
        // Only devices sysfs knows under the same name (hwloc also lists DMA
        // engines, GPUs' co-processors and the like).
        let Ok(ours) = sys.device_node(&name) else { continue };
        let theirs = hwloc::device_node(&topo, &name).unwrap();
        assert_eq!(theirs, ours.map(|n| sys.physical_node(n)), "device {name}");
        checked += 1;
    }
    assert!(checked > 0, "no device seen by both hwloc and sysfs");
    assert!(matches!(hwloc::device_node(&topo, "no-such-device0"), Err(numaweave::Error::NoSuchDevice { .. })));
}
