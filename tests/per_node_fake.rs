//! Per-node mode on a synthetic two-node topology (`fake:2` over this
//! machine's one node): threads on CPU 0 allocate from node 0's arena, threads
//! on CPU 1 from node 1's, and a block freed by the other node's thread goes
//! back to the heap (and node) it came from. The test re-runs itself with the
//! environment set, because the allocator reads it once at start-up.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::mpsc;

use numaweave::{Mode, NumaAlloc, os, topology::Topology};

mod support;

static A: NumaAlloc = NumaAlloc::new();

#[test]
fn per_node_arenas_and_remote_frees_on_a_fake_topology() {
    if !support::in_child() {
        support::rerun(
            "per_node_arenas_and_remote_frees_on_a_fake_topology",
            &[("NUMAWEAVE_TOPOLOGY", Some("fake:2")), ("NUMAWEAVE_MODE", Some("per-node"))],
            "SYNTHETIC",
        );
        return;
    }
    let topo = Topology::global();
    assert!(topo.is_synthetic());
    assert_eq!(A.mode(), Mode::PerNode);
    let cpus: Vec<usize> = topo.cpus().iter().collect();
    if cpus.len() < 2 {
        println!("SYNTHETIC topology, but only one CPU: nothing to place");
        return;
    }
    let (c0, c1) = (cpus[0], cpus[1]);
    let (n0, n1) = (topo.node_of_cpu(c0).unwrap(), topo.node_of_cpu(c1).unwrap());
    assert_ne!(n0, n1);
    let small = Layout::from_size_align(256, 8).unwrap();
    let huge = Layout::from_size_align(1 << 20, 8).unwrap();

    // Blocks belong to the arena of the allocating thread's node.
    for (cpu, node) in [(c0, n0), (c1, n1)] {
        std::thread::spawn(move || {
            os::cpu::pin_current_thread(cpu).unwrap();
            // SAFETY: valid layouts; blocks freed with them.
            unsafe {
                let p = A.alloc(small);
                let q = A.alloc(huge);
                assert_eq!(A.node_of(p), node, "small block of a thread on cpu {cpu}");
                assert_eq!(A.node_of(q), node, "huge block of a thread on cpu {cpu}");
                A.dealloc(p, small);
                A.dealloc(q, huge);
            }
        })
        .join()
        .unwrap();
    }

    // Blocks made on node n1, freed by a thread on node n0, return to n1.
    let before = A.stats();
    let (tx, rx) = mpsc::channel::<Vec<usize>>();
    let (again_tx, again_rx) = mpsc::channel::<()>();
    let owner = std::thread::spawn(move || {
        os::cpu::pin_current_thread(c1).unwrap();
        // A thread's first 8 blocks of a class come from its node's shared
        // heap (every free of them a remote one, collected there): these
        // are held, so that the 2,000 below are the owner's own.
        // SAFETY: valid layout.
        let first: Vec<usize> = (0..8).map(|_| unsafe { A.alloc(small) } as usize).collect();
        // SAFETY: valid layout.
        let blocks: Vec<usize> = (0..2000).map(|_| unsafe { A.alloc(small) } as usize).collect();
        tx.send(blocks.clone()).unwrap();
        again_rx.recv().unwrap();
        // Allocating again collects the remote frees: the same blocks come back.
        // SAFETY: valid layout.
        let reused: Vec<usize> = (0..2000).map(|_| unsafe { A.alloc(small) } as usize).collect();
        let old: std::collections::HashSet<usize> = blocks.into_iter().collect();
        let back = reused.iter().filter(|p| old.contains(p)).count();
        for p in reused.into_iter().chain(first) {
            // SAFETY: allocated above with `small`.
            unsafe { A.dealloc(p as *mut u8, small) };
        }
        back
    });
    let freer = std::thread::spawn(move || {
        os::cpu::pin_current_thread(c0).unwrap();
        for p in rx.recv().unwrap() {
            // SAFETY: blocks the owner allocated with `small`.
            unsafe {
                assert_eq!(A.node_of(p as *const u8), n1);
                A.dealloc(p as *mut u8, small);
            }
        }
        again_tx.send(()).unwrap();
    });
    freer.join().unwrap();
    let back = owner.join().unwrap();
    let after = A.stats();
    println!("{after}");
    assert!(back >= 1900, "only {back} of 2000 freed blocks were reused by their owner");
    let remote = after.per_node[n1].remote_frees - before.per_node[n1].remote_frees;
    assert!(remote >= 2000, "node {n1} collected {remote} remote frees");
    assert_eq!(after.per_node[n0].remote_frees, before.per_node[n0].remote_frees);
}

#[test]
fn blocks_of_another_node_freed_here_never_serve_local_allocations() {
    if !support::in_child() {
        support::rerun(
            "blocks_of_another_node_freed_here_never_serve_local_allocations",
            &[("NUMAWEAVE_TOPOLOGY", Some("fake:2")), ("NUMAWEAVE_MODE", Some("per-node"))],
            "SYNTHETIC",
        );
        return;
    }
    let topo = Topology::global();
    let cpus: Vec<usize> = topo.cpus().iter().collect();
    if cpus.len() < 2 {
        println!("SYNTHETIC topology, but only one CPU: nothing to place");
        return;
    }
    let c0 = cpus[0];
    let n0 = topo.node_of_cpu(c0).unwrap();
    let other = topo.nodes().iter().find(|&n| n != n0).unwrap();
    use allocator_api2::alloc::Allocator;
    let layout = Layout::from_size_align(200, 8).unwrap();
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(c0).unwrap();
        let there = A.on_node(other).unwrap();
        for round in 0..4 {
            // SAFETY: valid layouts; every block freed once, by this thread.
            unsafe {
                // Local blocks and the other node's, freed in one stream
                // (the local ones through the heap's free cache, the other
                // node's to their pages)...
                let local: Vec<*mut u8> = (0..300).map(|_| A.alloc(layout)).collect();
                let remote: Vec<*mut u8> =
                    (0..300).map(|_| there.allocate(layout).unwrap().as_ptr().cast::<u8>()).collect();
                for (&l, &r) in local.iter().zip(&remote) {
                    assert_eq!(A.node_of(r), other);
                    A.dealloc(r, layout);
                    A.dealloc(l, layout);
                }
                // ...and every local allocation after them is local.
                let again: Vec<*mut u8> = (0..600).map(|_| A.alloc(layout)).collect();
                for &p in &again {
                    assert_eq!(A.node_of(p), n0, "round {round}: a local block on node {}", A.node_of(p));
                }
                for p in again {
                    A.dealloc(p, layout);
                }
            }
        }
    })
    .join()
    .unwrap();
    println!("SYNTHETIC topology: 2,400 local blocks on node {n0} after 1,200 frees of node {other}'s");
}
