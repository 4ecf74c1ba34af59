//! The ACPI HMAT guest: the matrix, `weights=auto`, the lower tier, rules by
//! size, the kernel's weighted interleave.

use super::*;

/// numa-vm's `--hmat` defaults (its README): local DRAM 100 GB/s and 80 ns,
/// the other socket's 50 and 140; memory-only node k behind CPU node
/// k % sockets, 30 GB/s and 250 ns from there, 15 and 350 from elsewhere.
/// In the table's unit, MB/s: QEMU reads `100G` as 100 x 2^30 bytes/s and
/// writes 102,400 of 2^20.
pub(super) fn hmat_default(sockets: usize, i: usize, t: usize) -> (u32, u32) {
    let (gb, ns) = match (t < sockets, i == t % sockets) {
        (true, true) => (100, 80),
        (true, false) => (50, 140),
        (false, true) => (30, 250),
        (false, false) => (15, 350),
    };
    (gb * 1024, ns)
}

/// The guest with `--hmat`: the HMAT is read (as root) and gives the whole
/// initiator x target matrix the harness put in it, and each socket's
/// `weights=auto` are its own row reduced as the kernel reduces.
pub(super) fn hmat_matrix_and_auto_weights_of_each_socket(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let Some(l) = layout else { return Outcome::Skip("needs NUMAWEAVE_VM_LAYOUT (numa-vm guest)") };
    if t.perf_source() != PerfSource::Hmat {
        return Outcome::Skip("no ACPI HMAT (numa-vm --hmat)");
    }
    for i in t.cpu_nodes().iter() {
        for tgt in t.memory_nodes().iter() {
            let (bw, ns) = hmat_default(l.cpu_nodes, i, tgt);
            assert_eq!(t.bandwidth(i, tgt), Some(bw), "bandwidth {i} -> {tgt}");
            assert_eq!(t.latency(i, tgt), Some(ns), "latency {i} -> {tgt}");
        }
    }
    let all = t.memory_nodes();
    for i in t.cpu_nodes().iter() {
        let row: Vec<u32> = all.iter().map(|tgt| hmat_default(l.cpu_nodes, i, tgt).0).collect();
        let want = numaweave::policy::reduce_weights(&row);
        let got = t.interleave_weights(i, all);
        assert_eq!(got.of(all), want[..all.len()].to_vec(), "weights of socket {i}");
        println!("\n  socket {i}: bandwidth {row:?} MB/s -> weights {:?} ({})", got.of(all), got.source);
    }
    // Without root the HMAT is unreadable: sysfs's access1 figures (each
    // target's best initiator) and the distances, and the source says so.
    run_child(&["--perf-unprivileged-child"]);
    if l.cpu_nodes == 2 && l.memory_only == 2 {
        // The figures: each socket favours its own DRAM, then the
        // other's, then its own CXL node, then the other's.
        assert_eq!(t.interleave_weights(0, all).of(all), [8, 4, 2, 1]);
        assert_eq!(t.interleave_weights(1, all).of(all), [4, 8, 1, 2]);
    }
    print!("{t}");
    Outcome::Pass
}

/// Bytes placed per node under `interleave:ALL:bytes=1M:weights=auto` by a
/// thread on each socket (64 KiB I/O buffers, two whole rounds: every turn
/// complete), measured with `move_pages`: each node holds exactly its
/// weight's share of turns. Then the thread moves to the other socket
/// under the same guard: what it places from there follows that socket's
/// weights.
pub(super) fn hmat_weights_auto_placement_follows_the_sockets_weights(t: &Topology, layout: Option<&Guest>) -> Outcome {
    if layout.is_none() || t.perf_source() != PerfSource::Hmat || t.cpu_nodes().len() < 2 {
        return Outcome::Skip("needs the numa-vm guest with --hmat and two sockets");
    }
    const TURN: usize = 1 << 20;
    const BUF: usize = 64 << 10;
    let all = t.memory_nodes().intersection(&t.allowed_nodes());
    let policy: Policy = format!("interleave:{all}:bytes=1M:weights=auto").parse().unwrap();
    let sockets: Vec<usize> = t.cpu_nodes().iter().collect();
    let topo = t.clone();
    std::thread::spawn(move || {
        // Places `rounds` whole rounds of `from`'s weights; bytes per node.
        let place = |from: usize, rounds: usize, held: &mut Vec<(*mut u8, Layout)>| -> Vec<usize> {
            let w = topo.interleave_weights(from, all);
            let turns: usize = w.of(all).iter().map(|&x| usize::from(x)).sum();
            let count = rounds * turns * TURN / BUF;
            let l = Layout::from_size_align(BUF, 4096).unwrap();
            let first = held.len();
            for _ in 0..count {
                // SAFETY: a valid layout; freed by the caller.
                held.push((unsafe { A.alloc(l) }, l));
            }
            let mut per = vec![0usize; topology::MAX_NODES];
            for &(p, _) in &held[first..] {
                let on = touch_and_locate(p, BUF);
                let n = on[0].expect("page not present");
                assert!(on.iter().all(|&g| g == Some(n)), "a 64 KiB buffer split over nodes: {on:?}");
                per[n] += BUF;
            }
            for n in all.iter() {
                let want = rounds * usize::from(w.weights[n]) * TURN;
                assert_eq!(
                    per[n],
                    want,
                    "from socket {from}: node {n} holds {} KiB, its weight's share is {} KiB (weights {:?})",
                    per[n] >> 10,
                    want >> 10,
                    w.of(all)
                );
            }
            println!(
                "\n  from socket {from}: weights {:?}, {rounds} rounds, MiB per node {:?}",
                w.of(all),
                all.iter().map(|n| per[n] >> 20).collect::<Vec<_>>()
            );
            per
        };
        for (k, &s) in sockets.iter().enumerate() {
            let other = sockets[(k + 1) % sockets.len()];
            os::cpu::pin_current_thread(first_cpu(&topo, s)).unwrap();
            let mut held = Vec::with_capacity(4096);
            {
                let _g = numaweave::with_policy(policy).unwrap();
                place(s, 2, &mut held);
                // Moved to the other socket: its weights from the next pick.
                os::cpu::pin_current_thread(first_cpu(&topo, other)).unwrap();
                place(other, 2, &mut held);
            }
            for (p, l) in held {
                // SAFETY: allocated above with `l`.
                unsafe { A.dealloc(p, l) };
            }
        }
    })
    .join()
    .unwrap();
    Outcome::Pass
}

/// `tier:lower`, `A.cold()` and `alloc_cold` from each socket land on the
/// memory-only node behind it (the lower tier nearest by bandwidth).
pub(super) fn hmat_tier_lower_lands_on_the_sockets_memory_only_node(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let Some(l) = layout else { return Outcome::Skip("needs NUMAWEAVE_VM_LAYOUT (numa-vm guest)") };
    if t.perf_source() != PerfSource::Hmat || l.memory_only < l.cpu_nodes {
        return Outcome::Skip("needs --hmat and a memory-only node behind every socket");
    }
    let topo = t.clone();
    let sockets = l.cpu_nodes;
    std::thread::spawn(move || {
        for s in topo.cpu_nodes().iter() {
            // The memory-only node k hangs off socket k % sockets; the
            // first such is behind `s`.
            let want = (sockets..sockets + topo.memory_only_nodes().len()).find(|k| k % sockets == s).unwrap();
            assert_eq!(topo.nearest_lower_tier(s), Some(want));
            os::cpu::pin_current_thread(first_cpu(&topo, s)).unwrap();
            let cold = A.cold();
            assert_eq!(cold.node(), want);
            let mut v: allocator_api2::vec::Vec<u8, _> =
                allocator_api2::vec::Vec::with_capacity_in(1 << 20, cold.clone());
            v.resize(1 << 20, 1);
            let on = touch_and_locate(v.as_mut_ptr(), 1 << 20);
            assert!(on.iter().all(|&g| g == Some(want)), "cold data of socket {s}: {on:?}, want {want}");
            let lay = Layout::from_size_align(256 << 10, 4096).unwrap();
            let p = A.alloc_cold(lay).unwrap();
            let on = touch_and_locate(p.as_ptr(), 256 << 10);
            assert!(on.iter().all(|&g| g == Some(want)), "alloc_cold of socket {s}: {on:?}");
            // SAFETY: allocated above with `lay`.
            unsafe { A.dealloc(p.as_ptr(), lay) };
            let mut raw = Vec::with_capacity(64);
            {
                let _g = numaweave::with_policy(Policy::LowerTier).unwrap();
                let sl = Layout::from_size_align(2000, 8).unwrap();
                for _ in 0..64 {
                    // SAFETY: a valid layout; freed below.
                    raw.push(unsafe { A.alloc(sl) });
                }
            }
            for &p in &raw {
                let on = touch_and_locate(p, 2000);
                assert!(on.iter().all(|&g| g == Some(want)), "tier:lower block of socket {s}: {on:?}");
                // SAFETY: allocated above, 2000 bytes.
                unsafe { A.dealloc(p, Layout::from_size_align(2000, 8).unwrap()) };
            }
            println!("\n  socket {s}: cold data, alloc_cold and tier:lower all on node {want}");
        }
    })
    .join()
    .unwrap();
    Outcome::Pass
}

/// The child of `hmat_matrix_and_auto_weights_of_each_socket`: as user
/// nobody, the HMAT (mode 0400) cannot be read; the figures come from
/// sysfs, exact for each target's best initiator.
pub(super) fn perf_unprivileged_child() {
    // SAFETY: plain calls dropping privileges (group first).
    unsafe {
        assert_eq!(libc::setgid(65534), 0, "setgid");
        assert_eq!(libc::setuid(65534), 0, "setuid");
    }
    assert!(std::fs::read("/sys/firmware/acpi/tables/HMAT").is_err(), "the HMAT is readable without root");
    let t = Topology::detect().unwrap();
    assert_eq!(t.perf_source(), PerfSource::SysfsAccess);
    let sockets = t.cpu_nodes().len();
    for tgt in t.memory_nodes().iter() {
        let best = tgt % sockets;
        assert_eq!(t.bandwidth(best, tgt), Some(hmat_default(sockets, best, tgt).0), "best initiator of {tgt}");
        assert_eq!(t.latency(best, tgt), Some(hmat_default(sockets, best, tgt).1));
    }
    let all = t.memory_nodes();
    println!(
        "perf child (user nobody): {}; socket 0 weights {:?}",
        t.perf_source(),
        t.interleave_weights(0, all).of(all)
    );
}

/// The rules of `hmat_size_rules_keep_small_blocks_local_and_weight_big_ones`.
pub(super) const SIZE_RULES: &str = "<64K:local;>=64K:interleave:0-3:bytes=1M:weights=auto";

/// A whole program under rules by size (`NUMAWEAVE_POLICY`, read when the
/// allocator starts: in a child): small blocks on the thread's node, blocks
/// of 64 KiB and more over every node by the socket's weights.
pub(super) fn hmat_size_rules_keep_small_blocks_local_and_weight_big_ones(
    t: &Topology,
    layout: Option<&Guest>,
) -> Outcome {
    let Some(l) = layout else { return Outcome::Skip("needs NUMAWEAVE_VM_LAYOUT (numa-vm guest)") };
    if t.perf_source() != PerfSource::Hmat || l.cpu_nodes != 2 || l.memory_only != 2 {
        return Outcome::Skip("needs --hmat, 2 sockets and 2 memory-only nodes");
    }
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let out = Command::new(exe).arg("--size-rules-child").env("NUMAWEAVE_POLICY", SIZE_RULES).output().unwrap();
    print!("\n{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "size-rules child failed: {}", out.status);
    Outcome::Pass
}

/// The child: `A` starts here, under `SIZE_RULES`.
pub(super) fn size_rules_child() {
    let t = Topology::detect().unwrap();
    os::cpu::pin_current_thread(first_cpu(&t, 0)).unwrap();
    // Small blocks, aligned or not: node 0 only.
    let mut small = Vec::with_capacity(512);
    for k in 0..512usize {
        let l = Layout::from_size_align(16 + (k * 97) % 60_000, if k % 2 == 0 { 8 } else { 4096 }).unwrap();
        // SAFETY: a valid layout; freed below.
        small.push((unsafe { A.alloc(l) }, l));
    }
    for &(p, l) in &small {
        let on = touch_and_locate(p, l.size());
        assert!(on.iter().all(|&g| g == Some(0)), "a {}-byte block on {on:?} under {SIZE_RULES}", l.size());
    }
    // 64 KiB blocks (65,000-byte requests): two rounds of socket 0's
    // weights (8,4,2,1 turns of 1 MiB), bytes per node exact.
    let turns = 15;
    let l = Layout::from_size_align(65_000, 8).unwrap();
    let mut per = [0usize; 4];
    let mut big = Vec::with_capacity(2 * turns * 16);
    for _ in 0..2 * turns * 16 {
        // SAFETY: a valid layout; freed below.
        let p = unsafe { A.alloc(l) };
        let on = touch_and_locate(p, 65_536);
        let n = on[0].unwrap();
        assert!(on.iter().all(|&g| g == Some(n)), "a 64 KiB block split: {on:?}");
        per[n] += 65_536;
        big.push(p);
    }
    assert_eq!(per, [16 << 20, 8 << 20, 4 << 20, 2 << 20], "64 KiB blocks per node under {SIZE_RULES}");
    for p in big {
        // SAFETY: allocated above with `l`.
        unsafe { A.dealloc(p, l) };
    }
    for (p, l) in small {
        // SAFETY: allocated above with `l`.
        unsafe { A.dealloc(p, l) };
    }
    println!(
        "  size-rules child: {SIZE_RULES}: 512 small blocks on node 0; 64 KiB blocks MiB per node {:?}",
        per.map(|b| b >> 20)
    );
}

/// `MPOL_WEIGHTED_INTERLEAVE` (Linux 6.9).
pub(super) const MPOL_WEIGHTED_INTERLEAVE: i32 = 6;

/// Against the kernel's own weighted interleave (a 6.9+ guest kernel, with
/// `--hmat`): its memory tiers as read; socket 0's derived weights written
/// into `weighted_interleave/nodeN` are what the topology reads back; and
/// 120 pages under `MPOL_WEIGHTED_INTERLEAVE` land on each node in the
/// same share as 120 page buffers under our `weights=auto` from socket 0.
pub(super) fn hmat_kernel_weighted_interleave_places_as_ours(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let Some(l) = layout else { return Outcome::Skip("needs NUMAWEAVE_VM_LAYOUT (numa-vm guest)") };
    const SYSFS: &str = "/sys/kernel/mm/mempolicy/weighted_interleave";
    if t.perf_source() != PerfSource::Hmat || l.cpu_nodes != 2 || l.memory_only != 2 {
        return Outcome::Skip("needs --hmat, 2 sockets and 2 memory-only nodes");
    }
    if !std::path::Path::new(SYSFS).exists() {
        return Outcome::Skip("no weighted interleave in this kernel (6.9+; NUMA_VM_KERNEL)");
    }
    // The kernel's tiers (6.12 puts the HMAT's slower nodes in a tier of
    // their own): the lower tier is the memory-only nodes.
    assert_eq!(t.memory_tier(0), Some(1));
    assert!(t.memory_tier(2).unwrap() > 1, "node 2 in tier {:?}", t.memory_tier(2));
    assert_eq!(t.lower_tier_nodes(), t.memory_only_nodes());
    let all = t.memory_nodes();
    let ours = t.interleave_weights(0, all);
    assert_eq!(ours.of(all), [8, 4, 2, 1]);
    let write_weights = |w: &[u8]| {
        for (n, x) in all.iter().zip(w) {
            write_file(&format!("{SYSFS}/node{n}"), &x.to_string());
        }
    };
    write_weights(&ours.of(all));
    // A new process reads the kernel's weights as written.
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let out = Command::new(&exe).arg("--kernel-weights-child").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("kernel weights read: [Some(8), Some(4), Some(2), Some(1)]"), "{text}");
    // The kernel's placement: 120 pages (eight rounds of 15).
    let pages = 120;
    let r = Mapping::map(pages * os::page_size()).unwrap();
    r.set_hugepages(false).unwrap();
    let mask: u64 = all.iter().map(|n| 1u64 << t.physical_node(n)).sum();
    // SAFETY: mbind on our own mapping with a one-word node mask.
    let rc = unsafe {
        libc::syscall(libc::SYS_mbind, r.as_ptr(), r.len(), MPOL_WEIGHTED_INTERLEAVE, &mask as *const u64, 65, 0)
    };
    assert_eq!(rc, 0, "mbind(MPOL_WEIGHTED_INTERLEAVE): {}", std::io::Error::last_os_error());
    touch(&r);
    let mut kernel = [0usize; 4];
    for n in nodes_of(&r) {
        kernel[n.expect("page not present")] += 1;
    }
    // Ours: 120 page buffers from socket 0 under weights=auto, a page a turn.
    let policy: Policy = format!("interleave:{all}:count=1:weights=auto").parse().unwrap();
    let topo = t.clone();
    let numaweave = std::thread::spawn(move || {
        os::cpu::pin_current_thread(first_cpu(&topo, 0)).unwrap();
        let l = Layout::from_size_align(4096, 4096).unwrap();
        let mut held = Vec::with_capacity(pages);
        {
            let _g = numaweave::with_policy(policy).unwrap();
            for _ in 0..pages {
                // SAFETY: a valid layout; freed below.
                held.push(unsafe { A.alloc(l) });
            }
        }
        let mut per = [0usize; 4];
        for &p in &held {
            per[touch_and_locate(p, 4096)[0].expect("page not present")] += 1;
            // SAFETY: allocated above with `l`.
            unsafe { A.dealloc(p, l) };
        }
        per
    })
    .join()
    .unwrap();
    write_weights(&[1, 1, 1, 1]);
    println!("\n  weights 8,4,2,1: pages per node, the kernel's {kernel:?}, numaweave's {numaweave:?}");
    assert_eq!(kernel, [64, 32, 16, 8]);
    assert_eq!(numaweave, kernel);
    Outcome::Pass
}
