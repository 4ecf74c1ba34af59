//! Node ids need not be dense: a machine may have nodes 0 and 2 only (a
//! socket with `numa=off`, CXL memory hot-removed). On the synthetic
//! topology `fake:0,2` in per-node mode, the topology, the arenas, explicit
//! placement, the policies (`interleave:0,2`; anything naming node 1 is
//! refused), slab caches and the statistics all use the ids as they are.
//! The test re-runs itself with the environment set, because the allocator
//! reads it once at start-up.

use std::alloc::{GlobalAlloc, Layout};

use allocator_api2::alloc::Allocator as _;
use numaweave::policy::{Granularity, Interleave, Policy};
use numaweave::slab::SlabCache;
use numaweave::topology::{NodeSet, Topology};
use numaweave::{Error, Mode, NumaAlloc, os};

mod support;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

#[test]
fn sparse_node_ids_work_everywhere() {
    if !support::in_child() {
        support::rerun(
            "sparse_node_ids_work_everywhere",
            &[("NUMAWEAVE_TOPOLOGY", Some("fake:0,2")), ("NUMAWEAVE_MODE", Some("per-node"))],
            "SYNTHETIC NUMA topology (fake:0,2",
        );
        return;
    }
    let t = Topology::global();
    println!("{t}");
    let both: NodeSet = "0,2".parse().unwrap();
    assert_eq!((t.nodes(), t.memory_nodes(), t.allowed_nodes()), (both, both, both));
    assert_eq!(A.mode(), Mode::PerNode);

    // Each CPU's thread allocates from its node's arena.
    for cpu in t.cpus().iter() {
        let node = t.node_of_cpu(cpu).unwrap();
        assert!(both.contains(node));
        std::thread::spawn(move || {
            os::cpu::pin_current_thread(cpu).unwrap();
            let v: Vec<u64> = (0..1000).collect();
            let big = vec![7u8; 1 << 20];
            // SAFETY: live blocks of `A`.
            unsafe {
                assert_eq!(A.node_of(v.as_ptr().cast()), node, "a small block of cpu {cpu}");
                assert_eq!(A.node_of(big.as_ptr()), node, "a huge block of cpu {cpu}");
            }
        })
        .join()
        .unwrap();
    }

    // Explicit placement: node 2 serves, node 1 does not exist.
    let l = Layout::from_size_align(4096, 4096).unwrap();
    let p = A.alloc_on(l, 2).unwrap();
    // SAFETY: a live block of `A`, freed once.
    unsafe {
        assert_eq!(A.node_of(p.as_ptr()), 2);
        A.free(p.as_ptr());
    }
    assert!(matches!(A.alloc_on(l, 1), Err(Error::InvalidNode { node: 1, .. })));
    assert!(A.on_node(1).is_err() && A.on_node(2).is_ok());

    // Policies: by their ids; anything naming node 1 refused.
    for good in ["interleave:0,2", "interleave:0,2:count=1:weights=2,1", "bind:2", "preferred:2"] {
        let p: Policy = good.parse().unwrap();
        p.validate(t).unwrap_or_else(|e| panic!("{good}: {e}"));
    }
    for bad in ["interleave:0-2", "interleave:1,2", "bind:1", "preferred:1"] {
        let p: Policy = bad.parse().unwrap();
        assert!(matches!(p.validate(t), Err(Error::InvalidNode { node: 1, .. })), "{bad} was not refused");
    }
    let il = Interleave::new(both, Granularity::Count(1)).unwrap();
    // Page-aligned I/O buffers follow the cursor block by block: 0, 2, 0, 2.
    let h = A.interleave(il).unwrap();
    let bufs: Vec<_> = (0..8).map(|_| h.allocate(l).unwrap()).collect();
    // SAFETY: live blocks of `A`.
    let nodes: Vec<usize> = bufs.iter().map(|b| unsafe { A.node_of(b.as_ptr().cast()) }).collect();
    assert_eq!(nodes, [0, 2, 0, 2, 0, 2, 0, 2], "an interleave handle over 0,2");
    for b in bufs {
        // SAFETY: allocated by `h` with `l`.
        unsafe { h.deallocate(b.cast(), l) };
    }
    let mut raw = Vec::with_capacity(8);
    {
        let _g = numaweave::with_policy(Policy::Interleave(il)).unwrap();
        // SAFETY: a valid layout; freed below.
        raw.extend((0..8).map(|_| unsafe { A.alloc(l) }));
    }
    // SAFETY: live blocks of `A`.
    let nodes: Vec<usize> = raw.iter().map(|&b| unsafe { A.node_of(b) }).collect();
    assert_eq!(nodes, [0, 2, 0, 2, 0, 2, 0, 2], "with_policy(interleave:0,2)");
    for b in raw {
        // SAFETY: allocated above with `l`.
        unsafe { A.dealloc(b, l) };
    }

    // Slab caches homed on node 2; node 1 refused.
    let c = SlabCache::<[u64; 16]>::builder("sparse_cmd").node(2).build().unwrap();
    let o = c.alloc([1; 16]).unwrap();
    assert_eq!(numaweave::slab::SlabBox::node(&o), 2);
    assert!(SlabCache::<[u64; 16]>::builder("sparse_bad").node(1).build().is_err());
    let info = numaweave::slab::slabinfo().to_string();
    assert!(info.contains("sparse_cmd"));

    // Statistics: nodes 0 and 2, each with its own row.
    let s = A.stats();
    assert_eq!(s.nodes, both);
    assert!(s.per_node[2].allocs > 0 && s.per_node[0].allocs > 0 && s.per_node[1].allocs == 0);
    let text = s.to_string();
    println!("{text}");
    let rows: Vec<&str> = text.lines().filter_map(|l| l.split_whitespace().next()).collect();
    assert!(rows.contains(&"2") && !rows.contains(&"1"), "rows {rows:?}");
}
