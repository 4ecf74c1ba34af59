//! `NumaAlloc`'s blocks on their thread's node, remote frees going home,
//! purged pages coming back on their node, fallbacks by distance.

use super::*;

pub(super) fn numaalloc_blocks_land_on_the_threads_node(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let want = if t.memory_nodes().len() > 1 { Mode::PerNode } else { Mode::Flat };
    assert_eq!(A.mode(), want);
    let _ = layout;
    for node in t.cpu_nodes().iter() {
        let cpu = first_cpu(t, node);
        let phys = t.physical_node(node);
        std::thread::spawn(move || {
            os::cpu::pin_current_thread(cpu).unwrap();
            let small = Layout::from_size_align(4000, 8).unwrap();
            let huge = Layout::from_size_align(2 << 20, 8).unwrap();
            // SAFETY: valid layouts; blocks freed with them below.
            unsafe {
                let blocks: Vec<*mut u8> = (0..64).map(|_| A.alloc(small)).collect();
                let big = A.alloc(huge);
                for &b in &blocks {
                    assert_eq!(A.node_of(b), if want == Mode::PerNode { node } else { 0 });
                    let got = touch_and_locate(b, small.size());
                    assert!(got.iter().all(|&g| g == Some(phys)), "small block of cpu {cpu}: pages on {got:?}");
                }
                let got = touch_and_locate(big, huge.size());
                assert!(got.iter().all(|&g| g == Some(phys)), "huge block of cpu {cpu}: pages on {got:?}");
                for b in blocks {
                    A.dealloc(b, small);
                }
                A.dealloc(big, huge);
            }
            println!("\n  cpu {cpu}: 64 small blocks and a 2 MiB block, every page on node {node}");
        })
        .join()
        .unwrap();
    }
    Outcome::Pass
}

/// Memory given back to the kernel (`MADV_DONTNEED` by a trim, as the purge
/// delay does) and faulted in again when its blocks are handed out again
/// lands on the node its range is bound to: under `Local` on each node
/// with CPUs (small blocks and a huge block, in the same mappings as
/// before the purge), and under an interleave (I/O buffers, each on the
/// node the cursor names).
pub(super) fn purged_pages_come_back_on_their_node(t: &Topology, _: Option<&Guest>) -> Outcome {
    let small = Layout::from_size_align(8000, 8).unwrap();
    let huge = Layout::from_size_align(4 << 20, 8).unwrap();
    for node in t.cpu_nodes().iter() {
        let (cpu, phys) = (first_cpu(t, node), t.physical_node(node));
        std::thread::spawn(move || {
            os::cpu::pin_current_thread(cpu).unwrap();
            // SAFETY: valid layouts; blocks freed with them.
            unsafe {
                let first: Vec<usize> = (0..512).map(|_| A.alloc(small) as usize).collect();
                let big = A.alloc(huge);
                for &b in &first {
                    (b as *mut u8).write_bytes(1, small.size());
                }
                big.write_bytes(1, huge.size());
                for &b in &first {
                    A.dealloc(b as *mut u8, small);
                }
                A.dealloc(big, huge);
                let back = A.trim();
                assert!(back > 0, "nothing was given back");
                let again: Vec<*mut u8> = (0..512).map(|_| A.alloc(small)).collect();
                let big = A.alloc(huge);
                let reused = again.iter().filter(|&&b| first.contains(&(b as usize))).count();
                for &b in &again {
                    let got = touch_and_locate(b, small.size());
                    assert!(got.iter().all(|&g| g == Some(phys)), "a purged block of cpu {cpu}: pages on {got:?}");
                }
                let got = touch_and_locate(big, huge.size());
                assert!(got.iter().all(|&g| g == Some(phys)), "a purged huge block of cpu {cpu}: pages on {got:?}");
                for b in again {
                    A.dealloc(b, small);
                }
                A.dealloc(big, huge);
                println!(
                    "\n  cpu {cpu}: {} KiB purged, {reused} of 512 blocks handed out again, every page on node {node}",
                    back >> 10
                );
            }
            for shape in SHAPES {
                let (purged, served) = partly_used_pages_round(shape, |_, g| g == Some(phys), &format!("cpu {cpu}"));
                println!(
                    "  cpu {cpu}, {} B blocks: {purged} OS pages under free blocks of pages in use purged, {served} \
                     on node {node} again",
                    shape.0
                );
            }
        })
        .join()
        .unwrap();
    }
    let nodes = t.memory_nodes().intersection(&t.allowed_nodes());
    if nodes.len() < 2 {
        return Outcome::Pass;
    }
    let policy = Interleave::new(nodes, Granularity::Count(2)).unwrap();
    let topo = t.clone();
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(first_cpu(&topo, topo.cpu_nodes().first().unwrap())).unwrap();
        let l = Layout::from_size_align(64 << 10, 4096).unwrap();
        let round = |what: &str| {
            let model = Cursor::new(&policy);
            let mut raw: Vec<*mut u8> = Vec::with_capacity(48);
            {
                let _g = numaweave::with_policy(Policy::Interleave(policy)).unwrap();
                for _ in 0..48 {
                    // SAFETY: a valid layout; freed below.
                    raw.push(unsafe { A.alloc(l) });
                }
            }
            for (i, &p) in raw.iter().enumerate() {
                let want = topo.physical_node(model.next(l.size()));
                let got = touch_and_locate(p, l.size());
                assert!(got.iter().all(|&n| n == Some(want)), "{what} buffer {i}: pages on {got:?}, want {want}");
            }
            for p in raw {
                // SAFETY: allocated above with `l`.
                unsafe { A.dealloc(p, l) };
            }
        };
        round("interleaved");
        let back = A.trim();
        round("purged and interleaved again");
        println!("\n  interleave over {nodes}: {} KiB purged, 48 buffers again, every page on its node", back >> 10);
        // Pages in use, under an interleave of one block a node: the
        // blocks handed out again after the purge (the purged ones among
        // them) have their pages on their page's node, on every node of
        // the policy.
        let mut seen = HashSet::new();
        let _g =
            numaweave::with_policy(Policy::Interleave(Interleave::new(nodes, Granularity::Count(1)).unwrap())).unwrap();
        for (size, count, keep) in SHAPES {
            // Blocks below 4 KiB follow the cursor a heap page (64 KiB) at
            // a time: a page more than there are nodes, so that each has
            // one (the first few blocks come from a shared heap's page).
            let count = if size < 4096 { count.max((64 << 10) / size * (nodes.len() + 1)) } else { count };
            let shape = (size, count, keep);
            let (purged, served) = partly_used_pages_round(
                shape,
                |b, g| {
                    // SAFETY: a live block of `A`'s, handed out by the round.
                    let n = unsafe { A.node_of(b) };
                    seen.insert(n);
                    g == Some(topo.physical_node(n))
                },
                "interleaved",
            );
            assert_eq!(seen.len(), nodes.len(), "the blocks handed out again are on nodes {seen:?} alone");
            println!(
                "  interleaved, {} B blocks: {purged} OS pages of pages in use purged, {served} blocks on their \
                 pages' nodes again",
                shape.0
            );
            seen.clear();
        }
    })
    .join()
    .unwrap();
    Outcome::Pass
}

/// The rounds of [`partly_used_pages_round`]: (block size, blocks, one
/// of each node's kept in so many). Blocks of 4 KiB, a class of whole OS
/// pages whose purge masks a bit a block, every other one kept; blocks of
/// 64 B, 64 an OS page, whose purge masks a bit an OS page, one in 128
/// kept (Robson's pattern after a few rounds: every other OS page free).
const SHAPES: [(usize, usize, usize); 2] = [(4096, 256, 2), (64, 4096, 128)];

/// One round of block purges in pages that stay in use: `count` blocks
/// of `size` written, all but one in `keep` of each node's freed, a trim;
/// the OS pages only freed blocks cover must have left memory (the purge
/// happened; a hardened build, which purges no free block, must have
/// kept them all), the live blocks keep their contents, and the blocks
/// handed out again (the purged ones among them) have every page where
/// `on` says (given the block and the node of one of its pages). Returns
/// the OS pages purged and the blocks served again.
fn partly_used_pages_round(
    (size, count, keep): (usize, usize, usize),
    mut on: impl FnMut(*mut u8, Option<usize>) -> bool,
    what: &str,
) -> (usize, usize) {
    let l = Layout::from_size_align(size, 8).unwrap();
    let page = os::page_size();
    // SAFETY: a valid layout; every block is freed with it below.
    let blocks: Vec<usize> = (0..count).map(|_| unsafe { A.alloc(l) } as usize).collect();
    assert!(blocks.iter().all(|&b| b != 0), "{what}: out of memory");
    for (i, &b) in blocks.iter().enumerate() {
        // SAFETY: a live block of `l.size()` bytes.
        unsafe { (b as *mut u8).write_bytes(i as u8, l.size()) };
    }
    // One in `keep` of each node's blocks kept (counted by node: an
    // interleave of one block a node over an even count of nodes would
    // put only freed blocks on some nodes' pages: emptied whole, not
    // partly used).
    let mut seen_on: std::collections::HashMap<usize, usize> = Default::default();
    let (live, freed): (Vec<_>, Vec<_>) = blocks.iter().enumerate().partition(|&(_, &b)| {
        // SAFETY: a live block of `A`'s.
        let k = seen_on.entry(unsafe { A.node_of(b as *const u8) }).or_default();
        *k += 1;
        *k % keep == 1
    });
    for &(_, &b) in &freed {
        // SAFETY: allocated above with `l`.
        unsafe { A.dealloc(b as *mut u8, l) };
    }
    A.trim();
    // The OS pages that freed blocks cover, every byte (so no other block
    // touches them).
    let mut covered: std::collections::BTreeMap<usize, usize> = Default::default();
    for &(_, &b) in &freed {
        let mut a = b;
        while a < b + l.size() {
            let end = ((a & !(page - 1)) + page).min(b + l.size());
            *covered.entry(a & !(page - 1)).or_default() += end - a;
            a = end;
        }
    }
    let under_free: Vec<*const u8> =
        covered.iter().filter(|&(_, &n)| n == page).map(|(&a, _)| a as *const u8).collect::<Vec<_>>();
    // (`mincore`, not `move_pages`: Linux 6.1 says EFAULT of a page not
    // present where later kernels say ENOENT.)
    let purged = under_free
        .iter()
        .filter(|&&a| {
            let mut r = [true];
            os::mem::resident_pages(std::ptr::NonNull::new(a.cast_mut()).unwrap(), page, &mut r).unwrap();
            !r[0]
        })
        .count();
    // A hardened build purges no free block (its poison is what a use
    // after free is found by): every such OS page stays. (Under
    // `NUMAWEAVE_CHECK=full` its red zones make blocks larger than asked,
    // and a block may cover no whole OS page.)
    let hardened = cfg!(feature = "hardened");
    let want = if hardened { 0 } else { under_free.len() };
    assert!(
        (hardened || !under_free.is_empty()) && purged == want,
        "{what}: {purged} of the {} OS pages under free blocks only were given back (want {want})",
        under_free.len()
    );
    for &(i, &b) in &live {
        // SAFETY: a live block of `l.size()` bytes.
        let s = unsafe { std::slice::from_raw_parts(b as *const u8, l.size()) };
        assert!(s.iter().all(|&x| x == i as u8), "{what}: live block {i} lost its contents in the purge");
    }
    // SAFETY: a valid layout; freed below.
    let again: Vec<*mut u8> = (0..freed.len()).map(|_| unsafe { A.alloc(l) }).collect();
    for (k, &b) in again.iter().enumerate() {
        assert!(!b.is_null(), "{what}: out of memory");
        let got = touch_and_locate(b, l.size());
        assert!(got.iter().all(|&g| on(b, g)), "{what}: block {k} handed out after the purge: pages on {got:?}");
    }
    for b in again.into_iter().chain(live.iter().map(|&(_, &b)| b as *mut u8)) {
        // SAFETY: allocated with `l`, each once.
        unsafe { A.dealloc(b, l) };
    }
    (purged, freed.len())
}

pub(super) fn numaalloc_remote_frees_return_home(t: &Topology, _: Option<&Guest>) -> Outcome {
    let nodes: Vec<usize> = t.cpu_nodes().iter().collect();
    if nodes.len() < 2 {
        return Outcome::Skip("needs two nodes with CPUs");
    }
    let (home, away) = (*nodes.last().unwrap(), nodes[0]);
    let (home_cpu, away_cpu) = (first_cpu(t, home), first_cpu(t, away));
    let l = Layout::from_size_align(512, 8).unwrap();
    let before = A.stats();
    let (tx, rx) = mpsc::channel::<Vec<usize>>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let owner = std::thread::spawn(move || {
        os::cpu::pin_current_thread(home_cpu).unwrap();
        // A thread's first 8 blocks of a class come from its node's shared
        // heap (their remote frees collected there, later): held, so that
        // the 1000 below are the owner's own.
        // SAFETY: valid layout.
        let first: Vec<usize> = (0..8).map(|_| unsafe { A.alloc(l) } as usize).collect();
        // SAFETY: valid layout.
        let blocks: Vec<usize> = (0..1000).map(|_| unsafe { A.alloc(l) } as usize).collect();
        tx.send(blocks.clone()).unwrap();
        done_rx.recv().unwrap();
        // SAFETY: valid layout.
        let again: Vec<usize> = (0..1000).map(|_| unsafe { A.alloc(l) } as usize).collect();
        let old: HashSet<usize> = blocks.into_iter().collect();
        let reused = again.iter().filter(|p| old.contains(p)).count();
        for p in again.into_iter().chain(first) {
            // SAFETY: allocated above with `l`.
            unsafe { A.dealloc(p as *mut u8, l) };
        }
        reused
    });
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(away_cpu).unwrap();
        for p in rx.recv().unwrap() {
            // SAFETY: blocks allocated with `l` by the owner.
            unsafe {
                assert_eq!(A.node_of(p as *const u8), home);
                A.dealloc(p as *mut u8, l);
            }
        }
        done_tx.send(()).unwrap();
    })
    .join()
    .unwrap();
    let reused = owner.join().unwrap();
    let after = A.stats();
    let remote = after.per_node[home].remote_frees - before.per_node[home].remote_frees;
    println!(
        "\n  1000 blocks of node {home} freed on node {away}: {remote} remote frees booked on node {home}, {reused} reused by their owner\n{after}"
    );
    assert!(remote >= 1000);
    assert!(reused >= 900);
    Outcome::Pass
}

pub(super) fn numaalloc_falls_back_by_distance_when_a_node_is_full(t: &Topology, layout: Option<&Guest>) -> Outcome {
    if layout.is_none() {
        return Outcome::Skip("fills a node: only inside the numa-vm guest");
    }
    let node = t.cpu_nodes().first().unwrap();
    let cpu = first_cpu(t, node);
    let target = (t.memory_of(node) + (64 << 20)) as usize;
    let before = A.stats().per_node[node].fallbacks;
    let placed = fill_from_cpu(cpu, target, None);
    let after = A.stats().per_node[node].fallbacks;
    println!(
        "\n  filled node {node} with {} MiB: pages per node {:?}, {} fallbacks",
        target >> 20,
        placed.iter().enumerate().filter(|(_, c)| **c > 0).collect::<Vec<_>>(),
        after - before
    );
    assert!(after > before, "no fallback counted");
    assert_spilled_to_nearest(t, node, &placed);
    Outcome::Pass
}

/// Allocates `bytes` in 128 KiB blocks (size-class pages, drawn from the
/// arenas) on a thread pinned to `cpu`, under `policy` when given, touching
/// every page; frees them and gives the memory back. Returns the pages found
/// on each kernel node.
pub(super) fn fill_from_cpu(cpu: usize, bytes: usize, policy: Option<Policy>) -> Vec<usize> {
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(cpu).unwrap();
        let _g = policy.map(|p| numaweave::with_policy(p).unwrap());
        let l = Layout::from_size_align(128 << 10, 8).unwrap();
        let mut blocks = Vec::with_capacity(bytes / l.size() + 1);
        let mut per_node = vec![0usize; numaweave::topology::MAX_NODES];
        while blocks.len() * l.size() < bytes {
            // SAFETY: valid layout.
            let p = unsafe { A.alloc(l) };
            assert!(!p.is_null(), "allocation failed after {} MiB", (blocks.len() * l.size()) >> 20);
            for n in touch_and_locate(p, l.size()).into_iter().flatten() {
                per_node[n] += 1;
            }
            blocks.push(p);
        }
        for p in blocks {
            // SAFETY: allocated above with `l`.
            unsafe { A.dealloc(p, l) };
        }
        A.collect();
        per_node
    })
    .join()
    .unwrap()
}

/// Checks that a fill of node `from` (`placed`: pages per kernel node)
/// overflowed, and only to the memory nodes nearest `from`: never farther
/// than the nearest other node while that one has room.
pub(super) fn assert_spilled_to_nearest(t: &Topology, from: usize, placed: &[usize]) {
    let elsewhere: Vec<usize> = (0..placed.len()).filter(|&n| placed[n] > 0 && n != t.physical_node(from)).collect();
    assert!(!elsewhere.is_empty(), "nothing placed outside node {from}");
    let nearest = t.nodes_by_distance(from).find(|&n| n != from && t.memory_nodes().contains(n)).unwrap();
    let d = t.distance(from, nearest);
    for n in elsewhere {
        let ln = t.logical_node(n).unwrap();
        assert_eq!(
            t.distance(from, ln),
            d,
            "overflow of node {from} reached node {ln} (distance {}) before the nearest, {nearest}",
            t.distance(from, ln)
        );
    }
}

/// A thread that moves between nodes gets its next blocks from the node it
/// runs on: pinned to node 0's CPUs, then node 1's, and so on (20 moves),
/// it makes 2,016 blocks of 16 B to 2 KiB after each move and frees half
/// of the previous batch. Per-CPU caches (`NUMAWEAVE_CPU_CACHE=1`) take
/// each block from the caches of the CPU it runs on, which hold only that
/// node's blocks: at least 99% of the new blocks' pages must be on the
/// thread's node. Per-thread caches keep serving the blocks the heap
/// holds on the node it left, so fewer are (85% in the 2-node guest):
/// printed, and the check says it did not assert.
pub(super) fn numaalloc_blocks_follow_the_thread_across_nodes(t: &Topology, _: Option<&Guest>) -> Outcome {
    let nodes: Vec<usize> = t.cpu_nodes().iter().collect();
    if nodes.len() < 2 || A.mode() != Mode::PerNode {
        return Outcome::Skip("one node with CPUs");
    }
    let cpus: Vec<CpuSet> = nodes.iter().map(|&n| t.cpus_of(n)).collect();
    let phys: Vec<usize> = nodes.iter().map(|&n| t.physical_node(n)).collect();
    let (on, all) = std::thread::spawn(move || {
        let (mut on, mut all) = (0usize, 0usize);
        let mut prev: Vec<(*mut u8, Layout)> = Vec::new();
        let mut kept: Vec<(usize, Layout)> = Vec::new();
        for round in 0..20 {
            let k = round % nodes.len();
            os::cpu::pin_current_thread_to(cpus[k].iter()).unwrap();
            let batch: Vec<(*mut u8, Layout)> = (0..2016)
                .map(|i| {
                    let l = Layout::from_size_align(16 << (i % 8), 8).unwrap();
                    // SAFETY: a valid layout, freed with it below.
                    let p = unsafe { A.alloc(l) };
                    assert!(!p.is_null());
                    (p, l)
                })
                .collect();
            for &(p, l) in &batch {
                let got = touch_and_locate(p, l.size());
                on += got.iter().filter(|&&g| g == Some(phys[k])).count();
                all += got.len();
            }
            // Half of the previous batch freed here, on the new node.
            for (i, (p, l)) in std::mem::replace(&mut prev, batch).into_iter().enumerate() {
                if i % 2 == 0 {
                    // SAFETY: allocated above with `l`, freed once.
                    unsafe { A.dealloc(p, l) };
                } else {
                    kept.push((p as usize, l));
                }
            }
        }
        for (p, l) in prev.into_iter().map(|(p, l)| (p as usize, l)).chain(kept) {
            // SAFETY: allocated above with `l`, not freed yet.
            unsafe { A.dealloc(p as *mut u8, l) };
        }
        (on, all)
    })
    .join()
    .unwrap();
    let share = on as f64 / all as f64;
    println!(
        "\n  {on} of {all} pages of blocks made after a move on the thread's node ({:.1}%); per-CPU caches: {}",
        share * 100.0,
        A.cpu_caches()
    );
    if !A.cpu_caches() {
        return Outcome::Skip("per-thread caches: printed, not asserted");
    }
    assert!(share >= 0.99, "{on} of {all} pages on the thread's node");
    Outcome::Pass
}
