//! Node slabs on a synthetic two-node topology (`fake:2` over this machine's
//! one node): a cache homed on node 1 gives node-1 objects to a thread on
//! node 0, `alloc_on(k)` gives node k, and objects freed by a thread on node 0
//! go home to node 1 through its remote list, never into node 0's magazines.
//! Re-runs itself with the environment set (the topology is read once).

use numaweave::os;
use numaweave::slab::{Home, SlabBox, SlabCache};
use numaweave::topology::Topology;

mod support;

#[test]
fn home_node_alloc_on_and_remote_frees_on_a_fake_topology() {
    if !support::in_child() {
        support::rerun(
            "home_node_alloc_on_and_remote_frees_on_a_fake_topology",
            &[("NUMAWEAVE_TOPOLOGY", Some("fake:2"))],
            "checked on SYNTHETIC",
        );
        return;
    }
    let topo = Topology::global();
    assert!(topo.is_synthetic());
    assert_eq!(topo.node_count(), 2);
    // Run on a CPU of node 0 (node 1 may have no CPU on a 1-CPU host).
    let cpu0 = topo.cpus_of(0).first().expect("node 0 has a CPU");
    os::cpu::pin_current_thread(cpu0).unwrap();
    assert_eq!(topo.current_node(), 0);

    let cache = SlabCache::<[u64; 8]>::builder("homed").node(1).build().unwrap();
    assert_eq!(cache.home(), Home::Node(1));
    let objs: Vec<_> = (0..1000).map(|i| cache.alloc([i; 8]).unwrap()).collect();
    assert!(objs.iter().all(|b| SlabBox::node(b) == 1), "a cache homed on node 1 gave another node");
    let on0: Vec<_> = (0..100).map(|i| cache.alloc_on(0, [i; 8]).unwrap()).collect();
    assert!(on0.iter().all(|b| SlabBox::node(b) == 0));

    // Freed here, on node 0: node 1's objects go home as remote frees.
    let before = cache.stats().node(1);
    drop(objs);
    let after = cache.stats().node(1);
    assert_eq!(after.remote_frees - before.remote_frees, 1000, "{after:?}");
    // Node 0's objects freed on node 0 are plain local frees.
    drop(on0);
    assert_eq!(cache.stats().node(0).remote_frees, 0);
    // The remote list drains into node 1's slabs: nothing of node 1 is out.
    cache.shrink();
    let n1 = cache.stats().node(1);
    assert_eq!(n1.active, 0, "{n1:?}");
    assert_eq!(n1.slabs, 0);

    // A local cache follows the thread's node; `alloc` falls back to the
    // other node when the home node is at its limit.
    let local = SlabCache::<u64>::builder("local").limit(16).build().unwrap();
    let held: Vec<_> = (0..32).map(|i| local.alloc(i).unwrap()).collect();
    let on = |n| held.iter().filter(|b| SlabBox::node(b) == n).count();
    assert_eq!((on(0), on(1)), (16, 16));
    assert!(local.stats().node(0).fallbacks >= 16);
    assert!(matches!(local.try_alloc(0), Err(numaweave::Error::LimitReached { node: 0, .. })));
    drop(held);
    println!("slab placement checked on SYNTHETIC topology, 2 nodes\n{}", numaweave::slab::slabinfo());
}
