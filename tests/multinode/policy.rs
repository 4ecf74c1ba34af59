//! Memory policies: interleave, bind, preferred.

use super::*;

/// InterleaveHandle buffers from a handle (its own cursor, so the sequence is
/// known): every page of every buffer is on the node a second cursor, fed the
/// same sizes, predicts. Weighted (the first node gets two turns) and by
/// count and by bytes.
pub(super) fn policy_interleave_pages_follow_the_cursor(t: &Topology, _: Option<&Guest>) -> Outcome {
    let nodes = t.memory_nodes().intersection(&t.allowed_nodes());
    if nodes.len() < 2 {
        return Outcome::Skip("needs two nodes with memory");
    }
    let weights: Vec<u8> = nodes.iter().enumerate().map(|(i, _)| if i == 0 { 2 } else { 1 }).collect();
    let topo = t.clone();
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(first_cpu(&topo, topo.cpu_nodes().first().unwrap())).unwrap();
        for g in [Granularity::Count(3), Granularity::Bytes(256 << 10)] {
            let policy = Interleave::new(nodes, g).unwrap().with_weights(&weights).unwrap();
            let h = A.interleave(policy).unwrap();
            let model = Cursor::new(&policy);
            let mut bufs = Vec::new();
            for i in 0..64usize {
                let size = 4096 << (i % 5); // 4–64 KiB
                let b = allocator_api2::vec::Vec::<u8, _>::with_capacity_in(size, h.clone());
                let want = topo.physical_node(model.next(size));
                let got = touch_and_locate(b.as_ptr().cast_mut(), size);
                assert!(
                    got.iter().all(|&n| n == Some(want)),
                    "{g:?} buffer {i} ({size} B): pages on {got:?}, want {want}"
                );
                bufs.push(b);
            }
            let extents =
                bufs.windows(2).filter(|w| w[0].as_ptr() as usize + w[0].capacity() != w[1].as_ptr() as usize).count()
                    + 1;
            println!(
                "\n  {g:?} over {nodes} weights {weights:?}: 64 buffers, every page on its node, {extents} extents"
            );

            // The same through the global allocator under a scoped policy
            // (its thread-only cursor and turn window), as I/O buffers
            // (page-aligned: placed block by block): nothing else may
            // allocate while the guard is up, so the vector is made first.
            let model = Cursor::new(&policy);
            let mut raw: Vec<(*mut u8, Layout)> = Vec::with_capacity(64);
            {
                let _g = numaweave::with_policy(Policy::Interleave(policy)).unwrap();
                for i in 0..64usize {
                    let l = Layout::from_size_align(4096 << (i % 5), 4096).unwrap();
                    // SAFETY: a valid layout; freed below.
                    raw.push((unsafe { A.alloc(l) }, l));
                }
            }
            for (i, &(p, l)) in raw.iter().enumerate() {
                let want = topo.physical_node(model.next(l.size()));
                let got = touch_and_locate(p, l.size());
                assert!(got.iter().all(|&n| n == Some(want)), "scoped {g:?} buffer {i}: pages on {got:?}, want {want}");
            }
            for (p, l) in raw {
                // SAFETY: allocated above with `l`.
                unsafe { A.dealloc(p, l) };
            }
            println!("  the same under with_policy: 64 buffers, every page on its node");

            // Freed as it goes (blocks the thread frees are reused within
            // the turn, or by the node's next turn): 3000 buffers, five live
            // at a time, each written and its page asked for under the guard
            // (`page_node` does not allocate), off the model's node: none.
            let model = Cursor::new(&policy);
            let l = Layout::from_size_align(4096, 4096).unwrap();
            let mut wrong: Vec<(usize, Option<usize>)> = Vec::with_capacity(3000);
            let mut ring = [std::ptr::null_mut::<u8>(); 5];
            {
                let _g = numaweave::with_policy(Policy::Interleave(policy)).unwrap();
                for i in 0..3000usize {
                    let slot = &mut ring[i % 5];
                    if !slot.is_null() {
                        // SAFETY: allocated below with `l`, five steps ago.
                        unsafe { A.dealloc(*slot, l) };
                    }
                    // SAFETY: a valid layout; 4096 writable bytes, freed above or below.
                    let p = unsafe { A.alloc(l) };
                    // SAFETY: as above.
                    unsafe { p.write_bytes(i as u8, 4096) };
                    *slot = p;
                    let want = topo.physical_node(model.next(4096));
                    let got = os::mem::page_node(p).unwrap();
                    if got != Some(want) && wrong.len() < wrong.capacity() {
                        wrong.push((i, got));
                    }
                }
                for p in ring {
                    // SAFETY: the last five, allocated with `l`.
                    unsafe { A.dealloc(p, l) };
                }
            }
            assert!(wrong.is_empty(), "scoped {g:?} churn: buffers off their node: {:?}", &wrong[..wrong.len().min(8)]);
            println!("  freed as it goes (five live): 3000 buffers, every one on its node");
        }
    })
    .join()
    .unwrap();
    Outcome::Pass
}

pub(super) fn policy_bind_never_leaves_its_set(t: &Topology, _: Option<&Guest>) -> Outcome {
    let mem: Vec<usize> = t.memory_nodes().intersection(&t.allowed_nodes()).iter().collect();
    if mem.len() < 2 {
        return Outcome::Skip("needs two nodes with memory");
    }
    let cpu = first_cpu(t, t.cpu_nodes().first().unwrap());
    let topo = t.clone();
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(cpu).unwrap();
        // A far node alone, then a pair that excludes the thread's own node.
        let sets = [NodeSet::single(*mem.last().unwrap()), mem[1..].iter().take(2).copied().collect::<NodeSet>()];
        for set in sets {
            let phys: Vec<usize> = set.iter().map(|n| topo.physical_node(n)).collect();
            let _g = numaweave::with_policy(Policy::Bind(set)).unwrap();
            for size in [64, 4000, 100_000, 3 << 20] {
                let l = Layout::from_size_align(size, 8).unwrap();
                // SAFETY: valid layout; freed below.
                let ps: Vec<*mut u8> = (0..8).map(|_| unsafe { A.alloc(l) }).collect();
                for &p in &ps {
                    let got = touch_and_locate(p, size);
                    assert!(
                        got.iter().all(|n| n.is_some_and(|n| phys.contains(&n))),
                        "bind:{set}, {size} B: pages on {got:?}"
                    );
                    // SAFETY: allocated above with `l`.
                    unsafe { A.dealloc(p, l) };
                }
            }
            println!("\n  bind:{set} from cpu {cpu}: 64 B to 3 MiB blocks, every page inside the set");
        }
    })
    .join()
    .unwrap();
    Outcome::Pass
}

/// Preferred on a node other than the thread's, filled past its size: the
/// overflow goes to the node nearest *the preferred node*, not the thread's.
pub(super) fn policy_preferred_falls_back_by_distance_from_its_node(t: &Topology, layout: Option<&Guest>) -> Outcome {
    if layout.is_none() {
        return Outcome::Skip("fills a node: only inside the numa-vm guest");
    }
    let cpu_nodes: Vec<usize> = t.cpu_nodes().iter().collect();
    if cpu_nodes.len() < 2 {
        return Outcome::Skip("needs two nodes with CPUs");
    }
    let (home, pref) = (cpu_nodes[0], *cpu_nodes.last().unwrap());
    let cpu = first_cpu(t, home);
    let target = (t.memory_of(pref) + (64 << 20)) as usize;
    let placed = fill_from_cpu(cpu, target, Some(Policy::Preferred(pref)));
    println!(
        "\n  preferred:{pref} from node {home}, {} MiB: pages per node {:?}",
        target >> 20,
        placed.iter().enumerate().filter(|(_, c)| **c > 0).collect::<Vec<_>>()
    );
    assert!(placed[t.physical_node(pref)] > 0, "nothing on the preferred node");
    assert_spilled_to_nearest(t, pref, &placed);
    Outcome::Pass
}
