//! Memory policies applied to `NumaAlloc` (the global allocator here) on a
//! synthetic two-node topology (`fake:2`, per-node mode): scoped `Bind`,
//! `Preferred` and `Interleave` guards, `allocator_api2` handles (`Vec`,
//! `Box`, hashbrown) freed across the global allocator both ways, and the
//! process default from `NUMAWEAVE_POLICY`. Re-runs itself with the
//! environment set (the allocator reads it once).

use std::alloc::{GlobalAlloc, Layout};

use numaweave::policy::{Granularity, Interleave, Policy};
use numaweave::topology::{NodeSet, Topology};
use numaweave::{Mode, NumaAlloc, os, with_policy};

mod support;
use support::in_child;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

/// Runs `test` again in a child on `fake:2`, per-node, with `policy` as the
/// process default; its output.
fn child(test: &str, policy: Option<&str>) -> String {
    let mut env = vec![("NUMAWEAVE_TOPOLOGY", Some("fake:2")), ("NUMAWEAVE_MODE", Some("per-node"))];
    // Tests of exact geometry (adjacent buffers, bytes per turn) run
    // without a hardened build's red zones, which make every block longer.
    // (So do the rules by size, whose 64 KiB blocks are checked against a
    // model cursor fed their usable sizes.)
    if test.starts_with("scoped_interleave_") || test.contains("huge") || policy.is_some_and(|p| p.starts_with('<')) {
        env.push(("NUMAWEAVE_CHECK", None));
    }
    if let Some(p) = policy {
        env.push(("NUMAWEAVE_POLICY", Some(p)));
    }
    if test.contains("hugetlb") {
        env.push(("NUMAWEAVE_HUGE", Some("hugetlb")));
    }
    if test.contains("strict") {
        env.push(("NUMAWEAVE_STRICT", Some("1")));
    }
    support::rerun(test, &env, "")
}

/// Pins the test thread to a CPU of node 0.
fn on_node0() {
    let topo = Topology::global();
    assert!(topo.is_synthetic());
    assert_eq!(A.mode(), Mode::PerNode);
    os::cpu::pin_current_thread(topo.cpus_of(0).first().unwrap()).unwrap();
}

fn node_of<T: ?Sized>(p: *const T) -> usize {
    // SAFETY: callers pass live blocks of `A`.
    unsafe { A.node_of(p.cast()) }
}

#[test]
fn scoped_bind_and_preferred_place_on_their_node_and_restore() {
    if !in_child() {
        assert!(child("scoped_bind_and_preferred_place_on_their_node_and_restore", None).contains("policies checked"));
        return;
    }
    on_node0();
    let here: Vec<Box<[u8; 256]>> = (0..100).map(|_| Box::new([1; 256])).collect();
    assert!(here.iter().all(|b| node_of(&**b) == 0));
    for policy in [Policy::Bind(NodeSet::single(1)), Policy::Preferred(1)] {
        let g = with_policy(policy).unwrap();
        let small: Vec<Box<[u8; 256]>> = (0..100).map(|_| Box::new([2; 256])).collect();
        let big = vec![3u8; 3 << 20];
        assert!(small.iter().all(|b| node_of(&**b) == 1), "{policy}: small blocks off node 1");
        assert_eq!(node_of(big.as_ptr()), 1, "{policy}: huge block off node 1");
        drop(g);
        let after: Vec<Box<[u8; 256]>> = (0..100).map(|_| Box::new([4; 256])).collect();
        assert!(after.iter().all(|b| node_of(&**b) == 0), "after {policy}: the local policy is back");
    }
    // Nested guards restore in order.
    let outer = with_policy(Policy::Bind(NodeSet::single(1))).unwrap();
    {
        let _inner = with_policy(Policy::Local).unwrap();
        assert_eq!(node_of(&*Box::new([0u8; 512])), 0);
    }
    assert_eq!(node_of(&*Box::new([0u8; 512])), 1);
    drop(outer);
    // Invalid policies are typed errors.
    assert!(with_policy(Policy::Bind(NodeSet::single(7))).is_err());
    assert!(with_policy(Policy::Preferred(40)).is_err());
    println!("policies checked on SYNTHETIC topology");
}

#[test]
fn scoped_interleave_follows_the_cursor_and_keeps_turns_contiguous() {
    if !in_child() {
        assert!(
            child("scoped_interleave_follows_the_cursor_and_keeps_turns_contiguous", None)
                .contains("interleave checked")
        );
        return;
    }
    on_node0();
    let regions_before = A.stats().total().regions;
    let nodes: NodeSet = "0-1".parse().unwrap();
    let g = with_policy(Policy::Interleave(Interleave::new(nodes, Granularity::Count(4)).unwrap())).unwrap();
    let layout = Layout::from_size_align(4096, 4096).unwrap();
    let mut bufs: Vec<*mut u8> = Vec::with_capacity(32);
    let g = {
        drop(g);
        // The vector is allocated: from here on, only the buffers are.
        with_policy(Policy::Interleave(Interleave::new(nodes, Granularity::Count(4)).unwrap())).unwrap()
    };
    for _ in 0..32 {
        // SAFETY: a valid layout; freed below.
        bufs.push(unsafe { A.alloc(layout) });
    }
    drop(g);
    let got: Vec<usize> = bufs.iter().map(|&p| node_of(p)).collect();
    let want: Vec<usize> = (0..32).map(|i| (i / 4) % 2).collect();
    assert_eq!(got, want, "Count(4) over 0-1");
    for turn in bufs.chunks(4) {
        for w in turn.windows(2) {
            assert_eq!(w[1] as usize - w[0] as usize, 4096, "a turn's buffers are adjacent");
        }
    }
    // SAFETY: usable sizes of live blocks.
    assert!(bufs.iter().all(|&p| unsafe { A.usable_size(p) } >= 4096));
    for p in bufs {
        // SAFETY: allocated above with `layout`.
        unsafe { A.dealloc(p, layout) };
    }

    // Bytes: mixed sizes of I/O buffers (page-aligned), every node within
    // b plus one allocation.
    let b = 256 << 10;
    let g = with_policy(Policy::Interleave(Interleave::new(nodes, Granularity::Bytes(b)).unwrap())).unwrap();
    let mut per = [0u64; 2];
    let mut blocks = Vec::with_capacity(2000);
    for i in 0..2000u64 {
        let size = 4096 << (i % 6);
        let l = Layout::from_size_align(size, 4096).unwrap();
        // SAFETY: a valid layout; freed below.
        let p = unsafe { A.alloc(l) };
        assert!(!p.is_null());
        per[node_of(p)] += size as u64;
        blocks.push((p, l));
    }
    drop(g);
    assert!(per[0].abs_diff(per[1]) <= b + (128 << 10), "bytes per node {per:?}");
    // Realloc of an interleaved block keeps its contents.
    let (p, l) = blocks.pop().unwrap();
    // SAFETY: a live block of `l`; filled and resized.
    unsafe {
        p.write_bytes(0x5a, l.size());
        let q = A.realloc(p, l, l.size() * 3);
        assert!(std::slice::from_raw_parts(q, l.size()).iter().all(|&x| x == 0x5a));
        A.dealloc(q, Layout::from_size_align(l.size() * 3, 4096).unwrap());
    }
    assert!(A.stats().total().regions > regions_before);
    for (p, l) in blocks {
        // SAFETY: allocated above with `l`.
        unsafe { A.dealloc(p, l) };
    }
    // Every block freed and the guards gone: every region given back.
    assert_eq!(A.stats().total().regions, regions_before, "regions outlived their blocks");
    println!("interleave checked: Count(4) sequence and turns adjacent, Bytes spread {}", per[0].abs_diff(per[1]));
}

/// A scoped interleave reuses what its thread frees, without bending the
/// turns of I/O buffers (page-aligned): allocations freed at once, or a few
/// at a time, keep the exact `Count` sequence and the `Bytes` balance; live
/// blocks never overlap; the thread cycles a handful of warm blocks instead
/// of walking fresh memory; a turn of mixed page-multiple sizes stays back
/// to back; the heap's counters do not take the region blocks in; every
/// region goes back at the end. Unaligned blocks are placed page by page:
/// what the thread frees is reused where it is.
#[test]
fn scoped_interleave_reuses_freed_blocks_within_exact_turns() {
    if !in_child() {
        assert!(child("scoped_interleave_reuses_freed_blocks_within_exact_turns", None).contains("reuse checked"));
        return;
    }
    on_node0();
    let nodes: NodeSet = "0-1".parse().unwrap();
    let count = |n| Policy::Interleave(Interleave::new(nodes, Granularity::Count(n)).unwrap());
    let regions_before = A.stats().total().regions;
    let in_use_before = A.stats().total().in_use;
    // Room for the records, so that under the guards only the blocks are allocated.
    let mut got: Vec<usize> = Vec::with_capacity(30_000);
    let mut addrs: Vec<usize> = Vec::with_capacity(30_000);
    let mut ring: std::collections::VecDeque<(*mut u8, Layout, u8)> = std::collections::VecDeque::with_capacity(16);

    // Freed at once (the pool's put-back), then through a ring of 5 live
    // blocks (put-backs and the reuse list); page-aligned (the pool), and
    // aligned beyond a page (the region directly). Unaligned: page by page.
    for (depth, align) in [(0usize, 8usize), (5, 8), (0, 4096), (5, 4096), (0, 8192), (5, 8192)] {
        got.clear();
        addrs.clear();
        let g = with_policy(count(3)).unwrap();
        for i in 0..9_000usize {
            let l = Layout::from_size_align(4096, align).unwrap();
            // SAFETY: a valid layout; freed below.
            let p = unsafe { A.alloc(l) };
            assert!(!p.is_null());
            got.push(node_of(p));
            addrs.push(p as usize);
            // SAFETY: a fresh block of 4096 bytes.
            unsafe { p.write_bytes(i as u8, 4096) };
            ring.push_back((p, l, i as u8));
            while ring.len() > depth {
                let (q, ql, v) = ring.pop_front().unwrap();
                // SAFETY: live, written above with `v`; no other live block overlaps it.
                unsafe {
                    assert!(
                        std::slice::from_raw_parts(q, 4096).iter().all(|&x| x == v),
                        "a live block was overwritten"
                    );
                    A.dealloc(q, ql);
                }
            }
        }
        while let Some((q, ql, _)) = ring.pop_front() {
            // SAFETY: live blocks of `ql`.
            unsafe { A.dealloc(q, ql) };
        }
        drop(g);
        if align >= 4096 {
            let want: Vec<usize> = (0..9_000).map(|i| (i / 3) % 2).collect();
            assert!(got == want, "depth {depth} align {align}: Count(3) sequence broken");
        }
        addrs.sort_unstable();
        addrs.dedup();
        assert!(addrs.len() <= 2 * (depth + 4), "depth {depth} align {align}: {} distinct blocks", addrs.len());
    }

    // Bytes: mixed sizes of a page and more, half freed at once: the nodes
    // are the ones a model cursor gives, so the balance holds.
    let b = 64 << 10;
    let bytes = Interleave::new(nodes, Granularity::Bytes(b)).unwrap();
    let model = numaweave::policy::Cursor::new(&bytes);
    let mut kept: Vec<(*mut u8, Layout)> = Vec::with_capacity(10_000);
    got.clear();
    let g = with_policy(Policy::Interleave(bytes)).unwrap();
    for i in 0..10_000usize {
        let l = Layout::from_size_align(4096 << (i % 3), 4096).unwrap();
        // SAFETY: a valid layout; freed below.
        let p = unsafe { A.alloc(l) };
        got.push(node_of(p));
        if i % 2 == 0 {
            // SAFETY: just allocated with `l`.
            unsafe { A.dealloc(p, l) };
        } else {
            kept.push((p, l));
        }
    }
    drop(g);
    let mut per = [0u64; 2];
    for (i, &n) in got.iter().enumerate() {
        let size = 4096 << (i % 3);
        assert_eq!(n, model.next(size), "Bytes: allocation {i} off the model's node");
        per[n] += size as u64;
        assert!(per[0].abs_diff(per[1]) <= b + 16384, "step {i}: bytes per node {per:?}");
    }
    for (q, ql) in kept {
        // SAFETY: live blocks of `ql`.
        unsafe { A.dealloc(q, ql) };
    }

    // A turn of mixed page-multiple sizes (the class path switches class at
    // every allocation) is one extent.
    let sizes = [4096usize, 8192, 4096, 12288, 16384, 4096, 32768, 8192];
    let mut bufs: Vec<(*mut u8, Layout)> = Vec::with_capacity(64);
    let g = with_policy(count(4)).unwrap();
    for i in 0..64 {
        let l = Layout::from_size_align(sizes[i % sizes.len()], 4096).unwrap();
        // SAFETY: a valid layout; freed below.
        bufs.push((unsafe { A.alloc(l) }, l));
    }
    drop(g);
    for (t, turn) in bufs.chunks(4).enumerate() {
        assert!(turn.iter().all(|(p, _)| node_of(*p) == t % 2));
        for w in turn.windows(2) {
            assert_eq!(w[0].0 as usize + w[0].1.size(), w[1].0 as usize, "turn {t} is not one extent");
        }
    }
    for (p, l) in bufs {
        // SAFETY: allocated above with `l`.
        unsafe { A.dealloc(p, l) };
    }

    let s = A.stats().total();
    assert_eq!(s.regions, regions_before, "regions outlived their blocks");
    assert!(
        s.in_use.abs_diff(in_use_before) < 1 << 20,
        "heap counters took region blocks in: {} -> {}",
        in_use_before,
        s.in_use
    );
    println!("reuse checked");
}

#[test]
fn handles_work_with_collections_and_the_global_allocator() {
    if !in_child() {
        assert!(child("handles_work_with_collections_and_the_global_allocator", None).contains("handles checked"));
        return;
    }
    on_node0();
    let h1 = A.on_node(1).unwrap();
    let mut v: allocator_api2::vec::Vec<u64, _> = allocator_api2::vec::Vec::new_in(h1.clone());
    v.extend(0..100_000u64);
    assert_eq!(node_of(v.as_ptr()), 1);
    assert_eq!(v.iter().sum::<u64>(), 100_000 * 99_999 / 2);
    let mut m = hashbrown::HashMap::new_in(h1.clone());
    for i in 0..10_000u32 {
        m.insert(i, i * 2);
    }
    assert_eq!(m[&777], 1554);
    // A handle's block freed through the global allocator, and the reverse.
    let b = allocator_api2::boxed::Box::new_in([9u8; 1000], h1.clone());
    let (p, _) = allocator_api2::boxed::Box::into_raw_with_allocator(b);
    assert_eq!(node_of(p), 1);
    // SAFETY: a live block of `A` of this layout.
    unsafe { std::alloc::dealloc(p.cast(), Layout::new::<[u8; 1000]>()) };
    let g = Box::into_raw(Box::new([7u8; 1000]));
    // SAFETY: a global block of this layout, given to the handle to free.
    unsafe {
        allocator_api2::alloc::Allocator::deallocate(
            &h1,
            std::ptr::NonNull::new(g.cast()).unwrap(),
            Layout::new::<[u8; 1000]>(),
        )
    };
    let il = A.interleave(Interleave::new("0-1".parse().unwrap(), Granularity::Count(2)).unwrap()).unwrap();
    let bs: Vec<_> = (0..8).map(|i| allocator_api2::boxed::Box::new_in([i as u8; 64], il.clone())).collect();
    let nodes: Vec<usize> = bs.iter().map(|b| node_of(&**b)).collect();
    assert_eq!(nodes, [0, 0, 1, 1, 0, 0, 1, 1]);
    assert!(A.on_node(9).is_err());
    println!("handles checked");
}

#[test]
fn cold_data_without_a_lower_tier_stays_on_the_threads_node_counted() {
    if !in_child() {
        assert!(
            child("cold_data_without_a_lower_tier_stays_on_the_threads_node_counted", None).contains("cold checked")
        );
        return;
    }
    on_node0();
    let before = A.stats().per_node[0].fallbacks;
    let cold = A.cold();
    assert_eq!(cold.node(), 0);
    let mut values: allocator_api2::vec::Vec<u64, _> = allocator_api2::vec::Vec::new_in(cold.clone());
    values.extend(0..100_000u64);
    assert_eq!(node_of(values.as_ptr()), 0);
    let small: Vec<allocator_api2::boxed::Box<[u8; 100], _>> =
        (0..1000).map(|_| allocator_api2::boxed::Box::new_in([9u8; 100], cold.clone())).collect();
    assert!(small.iter().all(|b| node_of(b.as_ptr()) == 0));
    let l = Layout::from_size_align(1 << 20, 4096).unwrap();
    let p = A.alloc_cold(l).unwrap();
    assert_eq!(node_of(p.as_ptr()), 0);
    // SAFETY: allocated above with `l`.
    unsafe { A.dealloc(p.as_ptr(), l) };
    {
        let _g = with_policy(Policy::LowerTier).unwrap();
        let v = vec![7u8; 300_000];
        assert_eq!(node_of(v.as_ptr()), 0);
    }
    assert!(A.stats().per_node[0].fallbacks > before, "the fallbacks to the top tier are counted");
    // Hinted blocks: cold ones (a hint below 128) on the thread's node here
    // too, but never in a page that holds a hot one (a hint of 128 and
    // more, or none), at every size of the classes.
    let (mut hot, mut cold) = (std::collections::BTreeSet::new(), std::collections::BTreeSet::new());
    let mut blocks = Vec::new();
    for i in 0..3000usize {
        let l = Layout::from_size_align(8 + (i * 37) % 9000, 8).unwrap();
        let (c, h) = (A.alloc_hinted(l, (i % 128) as u8).unwrap(), A.alloc_hinted(l, 128 + (i % 128) as u8).unwrap());
        // SAFETY: a block of `l` just allocated, and one from `A` (the
        // global allocator) that holds one byte.
        let plain = unsafe { A.alloc(Layout::new::<u8>()) };
        let pages = |p: *mut u8, len: usize| p as usize / 4096..=(p as usize + len - 1) / 4096;
        cold.extend(pages(c.as_ptr(), l.size()));
        hot.extend(pages(h.as_ptr(), l.size()));
        hot.extend(pages(plain, 1));
        assert_eq!(node_of(c.as_ptr()), 0);
        blocks.push((c.as_ptr(), l));
        blocks.push((h.as_ptr(), l));
        blocks.push((plain, Layout::new::<u8>()));
    }
    assert_eq!(hot.intersection(&cold).count(), 0, "a page holds hot and cold blocks");
    for (p, l) in blocks {
        // SAFETY: allocated above with `l`.
        unsafe { A.dealloc(p, l) };
    }
    println!("cold checked");
}

#[test]
fn process_default_from_the_environment() {
    if !in_child() {
        let out = child("process_default_from_the_environment", Some("bind:1"));
        assert!(out.contains("default bind:1 checked"));
        let out = child("process_default_from_the_environment", Some("interleave:0-1:count=3"));
        assert!(out.contains("default interleave:0-1:count=3 checked"));
        // `weights=auto` on a topology with no bandwidth figures (fake:2):
        // equal weights, and the statistics say where they came from.
        let out = child("process_default_from_the_environment", Some("interleave:0-1:count=3:weights=auto"));
        assert!(out.contains("default interleave:0-1:count=3:weights=auto checked"), "{out}");
        assert!(out.contains("default interleave weights=auto (equal"), "{out}");
        let rules = "<64K:local;>=64K:interleave:0-1:bytes=256K";
        let out = child("process_default_from_the_environment", Some(rules));
        assert!(out.contains(&format!("default {rules} checked")), "{out}");
        let out = child("process_default_from_the_environment", Some("tier:lower"));
        assert!(out.contains("default tier:lower checked"), "{out}");
        let out = child("process_default_from_the_environment", Some("bogus:1"));
        assert!(out.contains("ignoring NUMAWEAVE_POLICY=\"bogus:1\""), "a bad policy is reported");
        return;
    }
    on_node0();
    let spec = std::env::var("NUMAWEAVE_POLICY").unwrap();
    // An I/O buffer: under an interleave, page-aligned blocks of a page
    // follow the cursor one by one.
    let layout = Layout::from_size_align(4096, 4096).unwrap();
    // SAFETY: valid layout; freed below.
    let ps: Vec<*mut u8> = (0..12).map(|_| unsafe { A.alloc(layout) }).collect();
    let nodes: Vec<usize> = ps.iter().map(|&p| node_of(p)).collect();
    match spec.as_str() {
        "bind:1" => assert!(nodes.iter().all(|&n| n == 1), "{nodes:?}"),
        "interleave:0-1:count=3:weights=auto" => {
            assert_runs_of(3, &nodes);
            print!("{}", A.stats());
        }
        "<64K:local;>=64K:interleave:0-1:bytes=256K" => {
            // 4 KiB buffers are under the bound: local, page-aligned or not.
            assert!(nodes.iter().all(|&n| n == 0), "{nodes:?}");
            // Small blocks stay on the thread's node (a whole-program
            // interleave would rotate their pages). (7,000 of them: their
            // vector stays under 64 KiB, so the interleave's cursor is
            // untouched until the model below starts.)
            let small: Vec<Box<[u8; 256]>> = (0..7_000).map(|_| Box::new([1; 256])).collect();
            assert!(small.iter().all(|b| node_of(&**b) == 0), "256-byte blocks off node 0");
            // 64 KiB blocks and up, aligned or not (a 65,000-byte request is
            // a 64 KiB block), follow the cursor block by block, exactly
            // (mixed sizes in one 256 KiB turn: not a page rotation per
            // size class); 1 MiB blocks a turn each.
            let i = Interleave::new("0-1".parse().unwrap(), Granularity::Bytes(256 << 10)).unwrap();
            let model = numaweave::policy::Cursor::new(&i);
            for align in [8, 4096] {
                let mut bs = Vec::with_capacity(48);
                for k in 0..48 {
                    let l = Layout::from_size_align([65_000, 100_000, 70_000][k % 3], align).unwrap();
                    // SAFETY: a valid layout; freed below.
                    let p = unsafe { A.alloc(l) };
                    // SAFETY: a live block of `A`.
                    let want = model.next(unsafe { A.usable_size(p) });
                    assert_eq!(node_of(p), want, "block {k} ({} B, align {align})", l.size());
                    bs.push((p, l));
                }
                for (p, l) in bs {
                    // SAFETY: allocated above with `l`.
                    unsafe { A.dealloc(p, l) };
                }
            }
            let big: Vec<Vec<u8>> = (0..6).map(|_| vec![3u8; 1 << 20]).collect();
            let on: Vec<usize> = big.iter().map(|v| node_of(v.as_ptr())).collect();
            assert!(on.windows(2).all(|w| w[0] != w[1]), "1 MiB blocks alternate: {on:?}");
        }
        "tier:lower" => {
            // No lower tier on fake:2: the thread's own node, each fresh
            // page counted as a fallback.
            assert!(nodes.iter().all(|&n| n == 0), "{nodes:?}");
            assert!(A.stats().per_node[0].fallbacks > 0, "tier:lower fallbacks counted");
        }
        "interleave:0-1:count=3" => {
            // Each thread has its own cursor (as Linux keeps interleave
            // state per task); this thread's earlier allocations moved it, so
            // the runs of three are there, wherever they start.
            assert_runs_of(3, &nodes);
            // Threads interleave on their own cursors and regions; what they
            // leave is given back once they exit and their blocks are freed.
            let regions = A.stats().total().regions;
            // Plain threads, joined: see `default_interleave_blocks_freed_across_threads`.
            let kept: Vec<Vec<usize>> = {
                let hs: Vec<_> = (0..4)
                    .map(|_| {
                        std::thread::spawn(move || {
                            let mut ps: Vec<*mut u8> = Vec::with_capacity(30);
                            for _ in 0..30 {
                                // SAFETY: a valid layout; freed below.
                                ps.push(unsafe { A.alloc(layout) });
                            }
                            let nodes: Vec<usize> = ps.iter().map(|&p| node_of(p)).collect();
                            for p in ps {
                                // SAFETY: allocated above.
                                unsafe { A.dealloc(p, layout) };
                            }
                            nodes
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            };
            for nodes in &kept {
                assert_runs_of(3, nodes);
            }
            drop(kept); // the threads' last blocks
            assert_eq!(A.stats().total().regions, regions, "exited threads' regions outlived their blocks");
            // Smaller blocks are interleaved page by page: fresh pages
            // alternate between the nodes, whatever each block's turn.
            let small: Vec<Box<[u8; 256]>> = (0..20_000).map(|_| Box::new([1; 256])).collect();
            let on1 = small.iter().filter(|b| node_of(&***b) == 1).count();
            assert!((8_000..=12_000).contains(&on1), "256-byte blocks on node 1: {on1} of 20000");
        }
        _ => assert!(nodes.iter().all(|&n| n == 0), "{nodes:?}"),
    }
    for p in ps {
        // SAFETY: allocated above.
        unsafe { A.dealloc(p, layout) };
    }
    println!("default {spec} checked");
}

/// Under a default interleave (each thread its own cursor, pools and reuse
/// lists), four threads allocate mixed sizes, keep a few, free some at once
/// and hand the rest to the next thread, which checks and frees them (the
/// remote frees of pooled and reused blocks): no block is overwritten while
/// live, and once the threads are gone and every block freed, every region
/// is given back.
#[test]
fn default_interleave_blocks_freed_across_threads() {
    if !in_child() {
        for p in ["interleave:0-1:count=5", "interleave:0-1:bytes=64K:weights=2,1"] {
            assert!(child("default_interleave_blocks_freed_across_threads", Some(p)).contains("exchange checked"));
        }
        return;
    }
    const THREADS: usize = 4;
    const PER: usize = 20_000;
    // This thread's own regions on both nodes first: it allocates too (the
    // channels, the threads), and the count below is of the workers' regions.
    let warm: Vec<Box<[u8; 4096]>> = (0..100).map(|_| Box::new([0; 4096])).collect();
    assert!(warm.iter().any(|b| node_of(&**b) == 0) && warm.iter().any(|b| node_of(&**b) == 1));
    drop(warm);
    let regions = A.stats().total().regions;
    let (txs, rxs): (Vec<_>, Vec<_>) =
        (0..THREADS).map(|_| std::sync::mpsc::channel::<Vec<(usize, usize, u8)>>()).unzip();
    let mut rxs: Vec<Option<_>> = rxs.into_iter().map(Some).collect();
    // Plain threads, joined: `join` returns once a thread is gone, its
    // exit handlers (which retire its regions) run; a scope returns as soon
    // as the closures do.
    let mut workers = Vec::new();
    {
        for t in 0..THREADS {
            let tx = txs[(t + 1) % THREADS].clone();
            let rx = rxs[t].take().unwrap();
            workers.push(std::thread::spawn(move || {
                let check_free = |(p, size, v): (usize, usize, u8)| {
                    let p = p as *mut u8;
                    // SAFETY: a live block of `size` bytes, written with `v`.
                    unsafe {
                        assert!(
                            std::slice::from_raw_parts(p, size).iter().all(|&x| x == v),
                            "a live block was overwritten"
                        );
                        A.dealloc(p, Layout::from_size_align(size, 8).unwrap());
                    }
                };
                let mut rng = support::Rng(0x9e37_79b9_7f4a_7c15u64 ^ t as u64);
                let mut ring: std::collections::VecDeque<(usize, usize, u8)> = std::collections::VecDeque::new();
                let mut batch = Vec::new();
                for i in 0..PER {
                    let x = rng.next();
                    let size = 16 << (x % 13); // 16 B – 64 KiB
                    let v = (i * 7 + t) as u8;
                    // I/O buffers (page-aligned) and other blocks.
                    let align = if size >= 4096 && i % 2 == 0 { 4096 } else { 8 };
                    // SAFETY: a valid layout; freed here or by the next thread.
                    let p = unsafe { A.alloc(Layout::from_size_align(size, align).unwrap()) };
                    assert!(!p.is_null());
                    // SAFETY: `size` fresh bytes.
                    unsafe { p.write_bytes(v, size) };
                    match x % 3 {
                        0 => check_free((p as usize, size, v)),
                        1 => batch.push((p as usize, size, v)),
                        _ => ring.push_back((p as usize, size, v)),
                    }
                    if ring.len() > 8 {
                        check_free(ring.pop_front().unwrap());
                    }
                    if batch.len() == 64 {
                        tx.send(std::mem::take(&mut batch)).unwrap();
                    }
                    while let Ok(b) = rx.try_recv() {
                        b.into_iter().for_each(check_free);
                    }
                }
                tx.send(batch).unwrap();
                drop(tx);
                ring.into_iter().for_each(check_free);
                for b in rx {
                    b.into_iter().for_each(check_free);
                }
            }));
        }
        drop(txs);
    }
    workers.into_iter().for_each(|w| w.join().unwrap());
    assert_eq!(A.stats().total().regions, regions, "regions outlived their blocks");
    println!("exchange checked");
}

/// `nodes` changes node every `n` entries (the first and last runs may be
/// cut short).
fn assert_runs_of(n: usize, nodes: &[usize]) {
    let cuts: Vec<usize> = (1..nodes.len()).filter(|&i| nodes[i] != nodes[i - 1]).collect();
    assert!(!cuts.is_empty() && cuts.windows(2).all(|w| w[1] - w[0] == n), "not runs of {n}: {nodes:?}");
    assert!(cuts[0] <= n && nodes.len() - cuts[cuts.len() - 1] <= n, "not runs of {n}: {nodes:?}");
}

#[test]
fn a_shared_interleave_handle_under_contention() {
    if !in_child() {
        assert!(child("a_shared_interleave_handle_under_contention", None).contains("contention checked"));
        return;
    }
    const THREADS: usize = 4;
    const PER: usize = 20_000;
    let regions_before = A.stats().total().regions;
    {
        let h = A.interleave(Interleave::new("0-1".parse().unwrap(), Granularity::Bytes(64 << 10)).unwrap()).unwrap();
        let (tx, rx) =
            std::sync::mpsc::channel::<Vec<allocator_api2::boxed::Box<[u64; 16], numaweave::InterleaveHandle>>>();
        let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
        let per_node: Vec<[u64; 2]> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..THREADS)
                .map(|t| {
                    let (h, tx, rx) = (h.clone(), tx.clone(), rx.clone());
                    s.spawn(move || {
                        let mut per = [0u64; 2];
                        let mut batch = Vec::with_capacity(64);
                        for i in 0..PER {
                            let v = (t * PER + i) as u64;
                            let b = allocator_api2::boxed::Box::new_in([v; 16], h.clone());
                            per[node_of(&*b)] += 128;
                            batch.push(b);
                            if batch.len() == 64 {
                                tx.send(std::mem::replace(&mut batch, Vec::with_capacity(64))).unwrap();
                            }
                            // Free what another thread allocated, checking it.
                            if let Ok(theirs) = rx.lock().unwrap().try_recv() {
                                for b in theirs {
                                    assert!(b.iter().all(|&x| x == b[0]), "a block was overwritten");
                                }
                            }
                        }
                        drop(batch);
                        per
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        drop(tx);
        for theirs in rx.lock().unwrap().try_iter() {
            for b in theirs {
                assert!(b.iter().all(|&x| x == b[0]));
            }
        }
        let total: [u64; 2] = [per_node.iter().map(|p| p[0]).sum(), per_node.iter().map(|p| p[1]).sum()];
        // One cursor for all threads: within one turn plus one allocation.
        assert!(total[0].abs_diff(total[1]) <= (64 << 10) + 128, "bytes per node {total:?}");
        println!("{THREADS} threads × {PER} blocks: bytes per node {total:?}");
    }
    // Handle and blocks gone: every region given back.
    assert_eq!(A.stats().total().regions, regions_before, "regions outlived their blocks");
    println!("contention checked");
}

/// Buffers of 64 KiB under `Bytes(2 MiB)` over nodes 0-1 (with `huge`
/// pages if given): whole, on their turn's node, and from regions that asked
/// for hugetlb pages (got them where the machine reserved some, else base
/// pages, counted). Returns (regions on hugetlb, fallbacks).
fn hugetlb_regions(huge: Option<numaweave::Huge>) -> (u64, u64) {
    on_node0();
    let before = A.stats().total();
    let nodes: NodeSet = "0-1".parse().unwrap();
    let layout = Layout::from_size_align(64 << 10, 4096).unwrap();
    let mut bufs: Vec<*mut u8> = Vec::with_capacity(64);
    let mut il = Interleave::new(nodes, Granularity::Bytes(2 << 20)).unwrap();
    if let Some(h) = huge {
        il = il.with_huge_pages(h);
    }
    let g = with_policy(Policy::Interleave(il)).unwrap();
    for i in 0..64 {
        // SAFETY: a valid layout; freed below.
        let p = unsafe { A.alloc(layout) };
        assert!(!p.is_null());
        // SAFETY: a live block of 64 KiB.
        unsafe { p.write_bytes(i as u8, layout.size()) };
        bufs.push(p);
    }
    drop(g);
    // Bytes(2 MiB): 32 buffers of 64 KiB per turn, node 0 then node 1.
    let got: Vec<usize> = bufs.iter().map(|&p| node_of(p)).collect();
    assert_eq!(got, (0..64).map(|i| i / 32).collect::<Vec<_>>());
    let after = A.stats().total();
    let (huge, fell) = (after.huge_regions - before.huge_regions, after.huge_fallbacks - before.huge_fallbacks);
    assert!(huge + fell >= 2, "one region per node asked for hugetlb pages: {after:?}");
    for (i, &p) in bufs.iter().enumerate() {
        // SAFETY: live blocks of 64 KiB written above.
        let b = unsafe { std::slice::from_raw_parts(p, layout.size()) };
        assert!(b.iter().all(|&x| x == i as u8), "buffer {i} overwritten");
        // SAFETY: allocated above with `layout`, freed once.
        unsafe { A.dealloc(p, layout) };
    }
    (huge, fell)
}

/// `NUMAWEAVE_HUGE=hugetlb`: every interleave's regions on hugetlb pages.
/// (The guests of `.ci/vm-tests` reserve pages and check that each 2 MiB
/// turn is one physical run.)
#[test]
fn interleave_regions_on_hugetlb_pages_or_counted_fallback() {
    if !in_child() {
        assert!(child("interleave_regions_on_hugetlb_pages_or_counted_fallback", None).contains("hugetlb checked"));
        return;
    }
    let (huge, fell) = hugetlb_regions(None);
    println!("hugetlb checked: {huge} regions on hugetlb pages, {fell} on base pages");
}

/// The same asked by the policy (`interleave:0-1:bytes=2M:huge`), the
/// process left at base pages.
#[test]
fn an_interleave_policy_asks_for_huge_pages_itself() {
    if !in_child() {
        assert!(child("an_interleave_policy_asks_for_huge_pages_itself", None).contains("policy huge checked"));
        return;
    }
    let (huge, fell) = hugetlb_regions(Some(numaweave::Huge::Hugetlb));
    println!("policy huge checked: {huge} regions on hugetlb pages, {fell} on base pages");
}

/// `interleave:…:huge=thp`: regions advised for transparent huge pages,
/// and the statistics say how much of the allocator's memory got them.
#[test]
fn thp_regions_are_counted() {
    if !in_child() {
        assert!(child("thp_regions_are_counted", None).contains("thp checked"));
        return;
    }
    on_node0();
    let nodes: NodeSet = "0-1".parse().unwrap();
    let layout = Layout::from_size_align(64 << 10, 4096).unwrap();
    let mut bufs: Vec<*mut u8> = Vec::with_capacity(64);
    let il = Interleave::new(nodes, Granularity::Bytes(2 << 20)).unwrap().with_huge_pages(numaweave::Huge::Thp);
    let g = with_policy(Policy::Interleave(il)).unwrap();
    for _ in 0..64 {
        // SAFETY: a valid layout; freed below.
        let p = unsafe { A.alloc(layout) };
        assert!(!p.is_null());
        // SAFETY: a live block of 64 KiB.
        unsafe { p.write_bytes(3, layout.size()) };
        bufs.push(p);
    }
    drop(g);
    let thp = A.stats().thp_bytes;
    let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if !mode.is_empty() && !mode.contains("[never]") {
        // Two turns of 2 MiB, each a whole written huge page of a region.
        assert!(thp >= 2 << 20, "4 MiB written in THP regions, {} KiB on huge pages", thp >> 10);
    }
    for p in bufs {
        // SAFETY: allocated above with `layout`, freed once.
        unsafe { A.dealloc(p, layout) };
    }
    println!("thp checked: {} KiB on transparent huge pages", thp >> 10);
}

/// `NUMAWEAVE_STRICT=1` with `NUMAWEAVE_HUGE=hugetlb`: a node whose pool is
/// short fails the buffer (null) rather than taking base pages.
#[test]
fn strict_hugetlb_regions_fail_rather_than_fall_back() {
    if !in_child() {
        assert!(child("strict_hugetlb_regions_fail_rather_than_fall_back", None).contains("strict checked"));
        return;
    }
    on_node0();
    let before = A.stats().total();
    let nodes: NodeSet = "0-1".parse().unwrap();
    let layout = Layout::from_size_align(64 << 10, 4096).unwrap();
    let g = with_policy(Policy::Interleave(Interleave::new(nodes, Granularity::Bytes(2 << 20)).unwrap())).unwrap();
    // SAFETY: a valid layout; freed below if given.
    let p = unsafe { A.alloc(layout) };
    drop(g);
    let after = A.stats().total();
    assert_eq!(after.huge_fallbacks, before.huge_fallbacks, "strict: no base pages instead");
    if p.is_null() {
        assert_eq!(after.huge_regions, before.huge_regions);
    } else {
        assert!(after.huge_regions > before.huge_regions);
        // SAFETY: allocated above with `layout`.
        unsafe { A.dealloc(p, layout) };
    }
    println!("strict checked: {}", if p.is_null() { "no pool, no buffer" } else { "on hugetlb pages" });
}
