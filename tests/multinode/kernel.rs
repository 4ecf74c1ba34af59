//! The kernel's placement as the OS layer drives it: the topology against
//! the guest, `getcpu`, `mbind`, pagemap frames, interleave, `move_pages`.

use super::*;

pub(super) fn topology_matches_the_guest_exactly(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let Some(l) = layout else { return Outcome::Skip("needs NUMAWEAVE_VM_LAYOUT (numa-vm guest)") };
    let total = l.cpu_nodes + l.memory_only;
    assert!(!t.is_synthetic());
    assert_eq!(t.nodes(), NodeSet::first_n(total), "online nodes");
    assert_eq!(t.cpu_nodes(), NodeSet::first_n(l.cpu_nodes), "nodes with CPUs");
    assert_eq!(t.memory_nodes(), NodeSet::first_n(total), "nodes with memory");
    let memonly: NodeSet = (l.cpu_nodes..total).collect();
    assert_eq!(t.memory_only_nodes(), memonly, "memory-only nodes");
    assert_eq!(t.allowed_nodes(), NodeSet::first_n(total), "allowed nodes");
    assert_eq!(t.ignored_nodes(), 0);
    for n in 0..total {
        let want: CpuSet =
            if n < l.cpu_nodes { (n * l.cpus_per_node..(n + 1) * l.cpus_per_node).collect() } else { CpuSet::new() };
        assert_eq!(t.cpus_of(n), want, "cpus of node {n}");
        for m in 0..total {
            assert_eq!(t.distance(n, m), l.distances[n][m], "distance {n}->{m}");
        }
        // The kernel keeps some of each node (node 0 most) for itself.
        let mem = t.memory_of(n);
        assert!(mem <= l.mem_per_node && mem >= l.mem_per_node / 2, "memory of node {n}: {mem}");
    }
    // Fallback order from each node follows the distances.
    for n in 0..total {
        let order: Vec<usize> = t.nodes_by_distance(n).collect();
        assert_eq!(order[0], n);
        assert!(order.windows(2).all(|w| t.distance(n, w[0]) <= t.distance(n, w[1])), "order from {n}: {order:?}");
    }
    Outcome::Pass
}

pub(super) fn each_cpu_reports_its_own_node(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let cpus: Vec<usize> = t.cpus().iter().collect();
    assert!(!cpus.is_empty());
    std::thread::scope(|s| {
        for &cpu in &cpus {
            s.spawn(move || {
                os::cpu::pin_current_thread(cpu).unwrap();
                let (c, n) = os::cpu::getcpu().unwrap();
                assert_eq!(c, cpu, "getcpu after pinning to {cpu}");
                assert_eq!(t.node_of_cpu(cpu), Some(n), "cpu {cpu}: table vs getcpu");
                assert_eq!(t.current_cpu(), Some(cpu));
                assert_eq!(t.current_node(), n);
                if let Some(l) = layout {
                    assert_eq!(n, cpu / l.cpus_per_node, "cpu {cpu} is on the wrong node");
                }
            });
        }
    });
    println!("\n  checked {} CPUs", cpus.len());
    Outcome::Pass
}

pub(super) fn bound_pages_land_on_their_node(t: &Topology, _: Option<&Guest>) -> Outcome {
    for n in t.memory_nodes().iter() {
        let r = touched(MemPolicy::Bind(NodeSet::single(n)));
        let got = nodes_of(&r);
        assert!(got.iter().all(|&g| g == Some(n)), "bind to node {n}: pages on {got:?}");
        // Contents survive: the pages are real, not a zero page.
        // SAFETY: inside the region.
        assert_eq!(unsafe { r.as_ptr().add(3 * os::page_size()).read() }, 3 | 1);
    }
    Outcome::Pass
}

pub(super) fn pagemap_frames_belong_to_the_bound_node(t: &Topology, _: Option<&Guest>) -> Outcome {
    for n in t.memory_nodes().iter() {
        let r = touched(MemPolicy::Bind(NodeSet::single(n)));
        for i in [0, PAGES / 2, PAGES - 1] {
            let p = r.as_ptr().wrapping_add(i * os::page_size());
            let pfn = match os::mem::page_frame(p) {
                Ok(Some(pfn)) => pfn,
                Err(Error::Os { errno: libc::EPERM, .. }) => {
                    return Outcome::Skip("pagemap hides frames (no CAP_SYS_ADMIN)");
                }
                other => panic!("pagemap for page {i}: {other:?}"),
            };
            match topology::node_of_frame(pfn).unwrap() {
                Some(m) => assert_eq!(m, n, "frame {pfn:#x} of a page bound to node {n}"),
                None => return Outcome::Skip("no memory-block sysfs on this kernel"),
            }
        }
    }
    Outcome::Pass
}

pub(super) fn interleave_rotates_page_by_page(t: &Topology, _: Option<&Guest>) -> Outcome {
    let set = t.memory_nodes();
    let ids: Vec<usize> = set.iter().collect();
    let r = touched(MemPolicy::Interleave(set));
    let got: Vec<usize> = nodes_of(&r).into_iter().map(|g| g.expect("page not present")).collect();
    for w in got.windows(2) {
        let i = ids.iter().position(|&x| x == w[0]).expect("page outside the interleave set");
        assert_eq!(w[1], ids[(i + 1) % ids.len()], "interleave sequence {got:?}");
    }
    for &n in &ids {
        let c = got.iter().filter(|&&g| g == n).count();
        assert!(c.abs_diff(PAGES / ids.len()) <= 1, "node {n} got {c} of {PAGES} pages");
    }
    Outcome::Pass
}

pub(super) fn preferred_and_move_place_pages(t: &Topology, _: Option<&Guest>) -> Outcome {
    let nodes: Vec<usize> = t.memory_nodes().iter().collect();
    let last = *nodes.last().unwrap();
    // Preferred: plenty of memory, so every page lands on the preferred node.
    let r = touched(MemPolicy::Preferred(last));
    assert!(nodes_of(&r).iter().all(|&g| g == Some(last)), "preferred {last}");
    // Migration of present pages keeps their contents.
    let r = touched(MemPolicy::Bind(NodeSet::single(nodes[0])));
    r.bind_range(0, r.len(), MemPolicy::Bind(NodeSet::single(last)), BindFlags::MOVE).unwrap();
    assert!(nodes_of(&r).iter().all(|&g| g == Some(last)), "moved to {last}");
    for i in 0..PAGES {
        // SAFETY: inside the region.
        assert_eq!(unsafe { r.as_ptr().add(i * os::page_size()).read() }, i as u8 | 1);
    }
    // Decommitted pages are gone and come back zeroed.
    r.decommit(0, r.len()).unwrap();
    assert!(nodes_of(&r).iter().all(|g| g.is_none()), "decommitted pages still present");
    // SAFETY: inside the region.
    assert_eq!(unsafe { r.as_ptr().read() }, 0);
    Outcome::Pass
}

pub(super) fn strict_bind_outside_allowed_is_a_typed_error(t: &Topology, _: Option<&Guest>) -> Outcome {
    let r = Mapping::map(os::page_size()).unwrap();
    // A node beyond the topology: the kernel refuses it, and the error names the call.
    let bogus = t.nodes().last().unwrap() + 1;
    let e = r.bind(MemPolicy::Bind(NodeSet::single(bogus))).unwrap_err();
    assert_eq!(e, Error::Os { call: "mbind", errno: libc::EINVAL });
    assert!(e.to_string().contains("mbind failed: EINVAL"), "{e}");
    assert!(matches!(r.bind(MemPolicy::Bind(NodeSet::new())), Err(Error::InvalidNode { .. })));
    Outcome::Pass
}
