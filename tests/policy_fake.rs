//! Memory policies applied to `NumaAlloc` (the global allocator here) on a
//! synthetic two-node topology (`fake:2`, per-node mode): scoped `Bind`,
//! `Preferred` and `Interleave` guards, `allocator_api2` handles (`Vec`,
//! `Box`, hashbrown) freed across the global allocator both ways, and the
//! process default from `NUMAWEAVE_POLICY`. Re-runs itself with the
//! environment set (the allocator reads it once).

use std::alloc::{GlobalAlloc, Layout};
use std::process::Command;

use numaweave::policy::{Granularity, Interleave, Policy};
use numaweave::topology::{NodeSet, Topology};
use numaweave::{Mode, NumaAlloc, os, with_policy};

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

fn child(test: &str, policy: Option<&str>) -> String {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env("NUMAWEAVE_TEST_CHILD", "1")
        .env("NUMAWEAVE_TOPOLOGY", "fake:2")
        .env("NUMAWEAVE_MODE", "per-node");
    if let Some(p) = policy {
        c.env("NUMAWEAVE_POLICY", p);
    }
    let out = c.output().unwrap();
    let (o, e) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    print!("{o}");
    eprint!("{e}");
    assert!(out.status.success(), "child failed");
    o + &e
}

fn in_child() -> bool {
    std::env::var_os("NUMAWEAVE_TEST_CHILD").is_some()
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

    // Bytes: mixed sizes, every node within b plus one allocation.
    let b = 256 << 10;
    let g = with_policy(Policy::Interleave(Interleave::new(nodes, Granularity::Bytes(b)).unwrap())).unwrap();
    let mut per = [0u64; 2];
    let mut blocks = Vec::with_capacity(2000);
    for i in 0..2000u64 {
        let size = 4096 << (i % 6);
        let l = Layout::from_size_align(size, 8).unwrap();
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
        A.dealloc(q, Layout::from_size_align(l.size() * 3, 8).unwrap());
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
fn process_default_from_the_environment() {
    if !in_child() {
        let out = child("process_default_from_the_environment", Some("bind:1"));
        assert!(out.contains("default bind:1 checked"));
        let out = child("process_default_from_the_environment", Some("interleave:0-1:count=3"));
        assert!(out.contains("default interleave:0-1:count=3 checked"));
        let out = child("process_default_from_the_environment", Some("bogus:1"));
        assert!(out.contains("ignoring NUMAWEAVE_POLICY=\"bogus:1\""), "a bad policy is reported");
        return;
    }
    on_node0();
    let spec = std::env::var("NUMAWEAVE_POLICY").unwrap();
    let layout = Layout::from_size_align(1024, 8).unwrap();
    // SAFETY: valid layout; freed below.
    let ps: Vec<*mut u8> = (0..12).map(|_| unsafe { A.alloc(layout) }).collect();
    let nodes: Vec<usize> = ps.iter().map(|&p| node_of(p)).collect();
    match spec.as_str() {
        "bind:1" => assert!(nodes.iter().all(|&n| n == 1), "{nodes:?}"),
        "interleave:0-1:count=3" => {
            // Other allocations of the process share the cursor: the runs of
            // three are there, wherever they start.
            let runs = nodes.windows(2).filter(|w| w[0] != w[1]).count();
            assert!((3..=4).contains(&runs), "{nodes:?}");
        }
        _ => assert!(nodes.iter().all(|&n| n == 0), "{nodes:?}"),
    }
    for p in ps {
        // SAFETY: allocated above.
        unsafe { A.dealloc(p, layout) };
    }
    println!("default {spec} checked");
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
        let (tx, rx) = std::sync::mpsc::channel::<Vec<allocator_api2::boxed::Box<[u64; 16], numaweave::Interleaved>>>();
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
