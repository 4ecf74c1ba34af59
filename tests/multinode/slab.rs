//! Node slabs: objects on the cache's node, chunks, hugetlb and gigantic
//! pages, remote frees; io_uring rings per node (feature `io-uring`).

use super::*;

pub(super) fn slab_objects_land_on_the_cache_node(t: &Topology, _: Option<&Guest>) -> Outcome {
    // Allocate from a thread on the first CPU node, whatever the cache's node.
    let cpu = first_cpu(t, t.cpu_nodes().first().unwrap());
    let topo = t.clone();
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(cpu).unwrap();
        let t = &topo;
        for node in t.memory_nodes().iter() {
            let phys = t.physical_node(node);
            let cache = RawCache::builder("vm_homed", 2048).node(node).build().unwrap();
            let objs: Vec<_> = (0..200).map(|_| cache.alloc().unwrap()).collect();
            for &o in &objs {
                // SAFETY: a live object of `cache`.
                assert_eq!(unsafe { cache.node_of(o) }, node);
                let got = touch_and_locate(o.as_ptr(), 2048);
                assert!(got.iter().all(|&g| g == Some(phys)), "object of a cache homed on {node}: pages on {got:?}");
            }
            // SAFETY: each freed once.
            unsafe { cache.free_bulk(&objs) };
            println!("\n  cache homed on node {node}: 200 objects from cpu {cpu}, every page on node {node}");
        }
        let any = SlabCache::<[u8; 512]>::new("vm_alloc_on").unwrap();
        for node in t.memory_nodes().iter() {
            let phys = t.physical_node(node);
            let mut objs: Vec<_> = (0..100).map(|_| any.alloc_on(node, [0; 512]).unwrap()).collect();
            for o in objs.iter_mut() {
                assert_eq!(SlabBox::node(o), node);
                let got = touch_and_locate(o.as_mut_ptr(), 512);
                assert!(got.iter().all(|&g| g == Some(phys)), "alloc_on({node}): pages on {got:?}");
            }
        }
        println!("  alloc_on(k) for every node k: every page on node k");
    })
    .join()
    .unwrap();
    Outcome::Pass
}

/// A `NodeRing` per memory node, used from the test's thread: every buffer
/// on the ring's node (move_pages), written with
/// `WRITE_FIXED` and read back with `READ_FIXED` through its registered slot.
#[cfg(feature = "io-uring")]
pub(super) fn uring_rings_per_node_read_and_write_fixed_on_their_node(t: &Topology, _: Option<&Guest>) -> Outcome {
    use std::os::fd::AsRawFd;

    use io_uring::{opcode, types};
    use numaweave::io::uring::NodeRing;

    const SIZE: usize = 4096;
    let run = |ring: &NodeRing, e: io_uring::squeue::Entry| {
        // SAFETY: the buffer and file the entry names outlive this call.
        unsafe { ring.run_one(&e) }.unwrap()
    };
    for node in t.memory_nodes().iter() {
        let ring = match NodeRing::new(node, SIZE, 32) {
            Ok(r) => r,
            Err(e) => {
                print!("({e}) ");
                return Outcome::Skip("no io_uring in the guest");
            }
        };
        let phys = t.physical_node(node);
        let path = format!("/tmp/numaweave-uring-{node}");
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let fd = types::Fd(file.as_raw_fd());
        let mut bufs: Vec<_> = (0..64).map(|_| ring.alloc().unwrap()).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            let got = touch_and_locate(b.as_mut_ptr(), SIZE);
            assert!(got.iter().all(|&g| g == Some(phys)), "ring of node {node}: buffer {i} on {got:?}");
            b.fill(node as u8 ^ i as u8);
            let w = opcode::WriteFixed::new(fd, b.as_mut_ptr(), SIZE as u32, b.index()).offset((i * SIZE) as u64);
            assert_eq!(run(&ring, w.build()), SIZE as i32);
        }
        for (i, b) in bufs.iter_mut().enumerate() {
            b.fill(0);
            let r = opcode::ReadFixed::new(fd, b.as_mut_ptr(), SIZE as u32, b.index()).offset((i * SIZE) as u64);
            assert_eq!(run(&ring, r.build()), SIZE as i32);
            assert!(b.iter().all(|&x| x == node as u8 ^ i as u8), "ring of node {node}: buffer {i} read back wrong");
        }
        drop(bufs);
        // A provided-buffer ring of 8 of the pool's buffers receives a
        // stream 32 times its size: every buffer filled on the node,
        // verified, recycled.
        let group = ring.buf_ring(node as u16, 8).unwrap();
        let (tx, rx) = std::os::unix::net::UnixStream::pair().unwrap();
        const STREAM: usize = 32 * 8 * SIZE;
        let byte = move |k: usize| (k as u8).wrapping_mul(13) ^ (k >> 12) as u8 ^ node as u8;
        let sender = std::thread::spawn(move || {
            let data: Vec<u8> = (0..STREAM).map(byte).collect();
            std::io::Write::write_all(&mut &tx, &data).unwrap();
        });
        let (mut got, mut bids) = (0, std::collections::HashSet::new());
        while got < STREAM {
            // SAFETY: the socket outlives the request; the buffer is the ring's.
            let cqe = unsafe { ring.run_one_entry(&group.recv(rx.as_raw_fd())) }.unwrap();
            let mut buf = group.take(&cqe).unwrap().expect("a buffer selected");
            assert!(!buf.is_empty(), "ring of node {node}: the stream ended at {got}");
            for (i, &b) in buf.iter().enumerate() {
                assert_eq!(b, byte(got + i), "ring of node {node}: byte {} received wrong", got + i);
            }
            got += buf.len();
            if bids.insert(buf.bid()) {
                let n = buf.len();
                let on = touch_and_locate(buf.as_mut_ptr(), n);
                assert!(on.iter().all(|&g| g == Some(phys)), "ring of node {node}: provided buffer on {on:?}");
            }
        }
        sender.join().unwrap();
        assert_eq!(group.available(), 8);
        // The ring's pool moved to another memory node while buffers are
        // out and the provided ring holds its own: each registered region
        // released, moved and put back in its slot, so the same indices
        // read the same data on the new node.
        let mem: Vec<usize> = t.memory_nodes().iter().collect();
        let other = mem[(mem.iter().position(|&n| n == node).unwrap() + 1) % mem.len()];
        let mut bufs: Vec<_> = (0..8).map(|_| ring.alloc().unwrap()).collect();
        let m = ring.pool().migrate(other).unwrap();
        assert!(m.unmoved.is_empty() && m.regions_moved >= 1, "ring of node {node}: {m}");
        for (i, b) in bufs.iter_mut().enumerate() {
            let on = touch_and_locate(b.as_mut_ptr(), SIZE);
            assert!(on.iter().all(|&g| g == Some(t.physical_node(other))), "moved ring buffer {i} on {on:?}");
            let r = opcode::ReadFixed::new(fd, b.as_mut_ptr(), SIZE as u32, b.index()).offset((i * SIZE) as u64);
            assert_eq!(run(&ring, r.build()), SIZE as i32);
            assert!(b.iter().all(|&x| x == node as u8 ^ i as u8), "moved ring buffer {i} read back wrong");
        }
        print!("\n  ring of node {node} moved to node {other} in use: {m}; READ_FIXED through the same slots");
        drop(bufs);
        println!(
            "\n  ring of node {node}: 64 fixed buffers on node {node}, {} bytes pinned, written and read back; \
             {STREAM} bytes received through {} provided buffers on node {node}",
            ring.pinned(),
            bids.len()
        );
    }
    Outcome::Pass
}

pub(super) fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().count()
}

/// 1 GiB of 4 KiB buffers (8,456 slabs of 128 KiB) homed on the last node:
/// a few chunk mappings, not one per slab, and every buffer on the node.
pub(super) fn slab_chunks_scale_and_stay_on_their_node(t: &Topology, _: Option<&Guest>) -> Outcome {
    let node = t.memory_nodes().iter().last().unwrap();
    let phys = t.physical_node(node);
    let cache = RawCache::builder("vm_dma_4k", 4096).align(4096).node(node).build().unwrap();
    let before = mappings();
    let mut objs = vec![std::ptr::null_mut(); (1 << 30) / 4096];
    for part in objs.chunks_mut(4096) {
        cache.alloc_bulk(part).unwrap();
    }
    let st = cache.stats().total();
    let grown = mappings().saturating_sub(before);
    assert!(
        st.chunks <= 64 && grown <= st.chunks + 16,
        "{grown} new mappings, {} chunks, {} slabs",
        st.chunks,
        st.slabs
    );
    // Every 97th buffer touched and located (a sample across all chunks).
    let mut bad = Vec::new();
    for (i, &o) in objs.iter().enumerate().step_by(97) {
        let got = touch_and_locate(o, 4096);
        if !got.iter().all(|&g| g == Some(phys)) {
            bad.push((i, o, got));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} sampled buffers of a cache homed on {node} elsewhere, first {:?}, last {:?}",
        bad.len(),
        objs.len() / 97,
        bad.first(),
        bad.last()
    );
    let objs: Vec<_> = objs.into_iter().map(|p| std::ptr::NonNull::new(p).unwrap()).collect();
    // A free writes the object's link word (touching its page): 16 MiB at a
    // time, each batch's emptied slabs given back before the next.
    for batch in objs.chunks(4096) {
        // SAFETY: objects of `cache`, each freed once.
        unsafe { cache.free_bulk(batch) };
        cache.shrink();
    }
    assert_eq!(cache.stats().total().chunks, 0);
    println!(
        "\n  {} buffers of 4 KiB on node {node}: {} slabs in {} chunks ({grown} new mappings), sampled pages all on node {node}",
        objs.len(),
        st.slabs,
        st.chunks
    );
    Outcome::Pass
}

pub(super) fn reserve_huge_pages(phys: usize, pages: usize) -> bool {
    reserve_pages(phys, "2048kB", pages)
}

pub(super) fn reserve_pages(phys: usize, size: &str, pages: usize) -> bool {
    let f = format!("/sys/devices/system/node/node{phys}/hugepages/hugepages-{size}/nr_hugepages");
    std::fs::write(&f, pages.to_string()).is_ok()
        && std::fs::read_to_string(&f).is_ok_and(|s| s.trim().parse::<usize>() == Ok(pages))
}

/// A cache of 4 KiB buffers on hugetlb pages reserved on the last node (the
/// guest's sysfs, as an administrator would): every chunk on huge pages,
/// every buffer on the node, each 2 MiB page physically contiguous; a node
/// with no reservation falls back to base pages, counted, still on its node.
pub(super) fn slab_hugetlb_pages_are_on_the_node_and_contiguous(t: &Topology, layout: Option<&Guest>) -> Outcome {
    if layout.is_none() {
        return Outcome::Skip("reserves huge pages: only inside the numa-vm guest");
    }
    let node = t.memory_nodes().iter().last().unwrap();
    let other = t.memory_nodes().iter().next().unwrap();
    let (phys, other_phys) = (t.physical_node(node), t.physical_node(other));
    if node == other || !reserve_huge_pages(phys, 16) {
        return Outcome::Skip("no second node, or no hugetlb pages to reserve");
    }
    let cache =
        RawCache::builder("vm_huge_4k", 4096).align(4096).node(node).huge(numaweave::Huge::Hugetlb).build().unwrap();
    let objs: Vec<_> = (0..3072).map(|_| cache.alloc().unwrap()).collect();
    let st = cache.stats().total();
    assert!(st.chunks > 0 && st.huge_chunks == st.chunks && st.huge_fallbacks == 0, "{st:?}");
    let mut runs = HashSet::new();
    for &o in &objs {
        let p = o.as_ptr();
        let got = touch_and_locate(p, 4096);
        assert!(got.iter().all(|&g| g == Some(phys)), "hugetlb buffer of node {node}: pages on {got:?}");
        let base = (p as usize) & !((2 << 20) - 1);
        let (f, fb) = (os::mem::page_frame(p).unwrap(), os::mem::page_frame(base as *const u8).unwrap());
        let (Some(f), Some(fb)) = (f, fb) else { panic!("no frame for {p:p}") };
        assert_eq!(f - fb, ((p as usize - base) / 4096) as u64, "{p:p} not contiguous with its huge page");
        runs.insert(base);
    }
    // SAFETY: objects of `cache`, each freed once.
    unsafe { cache.free_bulk(&objs) };
    cache.shrink();
    drop(cache);
    // DMA buffers of 64 KiB on the same pool: each one physical segment.
    let dma =
        DmaPool::builder("vm_dma_64k", 64 << 10).node(node).huge(numaweave::Huge::Hugetlb).lock(true).build().unwrap();
    let bufs: Vec<_> = (0..48).map(|_| dma.alloc().unwrap()).collect();
    for b in &bufs {
        assert_eq!(b.node(), node);
        assert_eq!(b.phys_segments().unwrap(), 1, "a 64 KiB DMA buffer at {:p} in pieces", b.as_ptr());
        assert_eq!(b.phys_addr().unwrap() % (64 << 10), (b.as_ptr() as u64) % (64 << 10));
    }
    let dma_huge = dma.stats().total().huge_chunks;
    drop(bufs);
    dma.shrink();
    drop(dma);
    // Nothing reserved on the other node: base pages there, counted.
    reserve_huge_pages(other_phys, 0);
    let plain = RawCache::builder("vm_huge_fallback", 4096)
        .align(4096)
        .node(other)
        .huge(numaweave::Huge::Hugetlb)
        .build()
        .unwrap();
    let o = plain.alloc().unwrap();
    let st2 = plain.stats().total();
    assert!(st2.huge_fallbacks >= 1 && st2.huge_chunks == 0, "{st2:?}");
    let got = touch_and_locate(o.as_ptr(), 4096);
    assert!(got.iter().all(|&g| g == Some(other_phys)), "fallback buffer of node {other}: pages on {got:?}");
    // SAFETY: allocated above from `plain`, freed once.
    unsafe { plain.free(o) };
    plain.shrink();
    reserve_huge_pages(phys, 0);
    println!(
        "\n  3072 buffers of 4 KiB on hugetlb pages of node {node}: {} chunks, {} huge pages used, each one physical run; 48 locked DMA buffers of 64 KiB ({dma_huge} hugetlb chunks), each one physical segment; node {other} without a reservation fell back ({} counted)",
        st.chunks,
        runs.len(),
        st2.huge_fallbacks
    );
    Outcome::Pass
}

/// A DMA pool on a 1 GiB page reserved on the last node (guests with
/// nodes of more than 1 GiB; skipped where the page cannot be reserved):
/// 128 buffers of 512 KiB, all on the node, physically one run across them.
pub(super) fn slab_gigantic_pages_make_one_physical_run(t: &Topology, layout: Option<&Guest>) -> Outcome {
    if layout.is_none() {
        return Outcome::Skip("reserves a 1 GiB page: only inside the numa-vm guest");
    }
    let node = t.memory_nodes().iter().last().unwrap();
    let phys = t.physical_node(node);
    if !reserve_pages(phys, "1048576kB", 1) {
        return Outcome::Skip("no 1 GiB page could be reserved on the node (nodes of 1 GiB or less)");
    }
    let pool = DmaPool::builder("vm_dma_512k", 512 << 10).node(node).huge(numaweave::Huge::Hugetlb1G).build().unwrap();
    let bufs: Vec<_> = (0..128).map(|_| pool.alloc().unwrap()).collect();
    let st = pool.stats().total();
    assert!(st.chunks == 1 && st.huge_chunks == 1 && st.huge_fallbacks == 0, "{st:?}");
    let (va0, pa0) = (bufs[0].as_ptr() as u64, bufs[0].phys_addr().unwrap());
    for b in &bufs {
        assert_eq!(b.node(), node);
        assert_eq!(b.phys_segments().unwrap(), 1);
        assert_eq!(
            b.phys_addr().unwrap().wrapping_sub(pa0),
            (b.as_ptr() as u64).wrapping_sub(va0),
            "not one physical run"
        );
    }
    drop(bufs);
    pool.shrink();
    drop(pool);
    reserve_pages(phys, "1048576kB", 0);
    println!("\n  128 DMA buffers of 512 KiB on a 1 GiB page of node {node}: one chunk, one physical run");
    Outcome::Pass
}

pub(super) fn slab_remote_frees_go_home_to_their_node(t: &Topology, _: Option<&Guest>) -> Outcome {
    let nodes: Vec<usize> = t.cpu_nodes().iter().collect();
    if nodes.len() < 2 {
        return Outcome::Skip("needs two nodes with CPUs");
    }
    let (home, away) = (*nodes.last().unwrap(), nodes[0]);
    let (home_cpu, away_cpu) = (first_cpu(t, home), first_cpu(t, away));
    let cache = std::sync::Arc::new(SlabCache::<[u64; 32]>::builder("vm_remote").node(home).build().unwrap());
    // A thread on the home node allocates; a thread on node `away` frees.
    let c = cache.clone();
    let objs = std::thread::spawn(move || {
        os::cpu::pin_current_thread(home_cpu).unwrap();
        (0..1000).map(|i| c.alloc([i; 32]).unwrap()).collect::<Vec<_>>()
    })
    .join()
    .unwrap();
    let addrs: HashSet<usize> = objs.iter().map(|b| SlabBox::as_ptr(b) as usize).collect();
    let before = cache.stats().node(home);
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(away_cpu).unwrap();
        for (i, b) in objs.into_iter().enumerate() {
            assert!(b.iter().all(|&w| w == i as u64));
            drop(b);
        }
    })
    .join()
    .unwrap();
    let after = cache.stats().node(home);
    let remote = after.remote_frees - before.remote_frees;
    assert_eq!(remote, 1000, "frees on node {away} of node {home}'s objects: {after:?}");
    assert_eq!(cache.stats().node(away).active, 0, "a node-{away} thread kept node-{home} objects");
    // Back in node `home`'s slabs: the owner's next allocations reuse them.
    let c = cache.clone();
    let reused = std::thread::spawn(move || {
        os::cpu::pin_current_thread(home_cpu).unwrap();
        let again: Vec<_> = (0..1000).map(|i| c.alloc([i; 32]).unwrap()).collect();
        again.iter().filter(|b| addrs.contains(&(SlabBox::as_ptr(b) as usize))).count()
    })
    .join()
    .unwrap();
    println!(
        "\n  1000 objects of node {home} freed on node {away}: {remote} remote frees on node {home}, {reused} reused there\n{}",
        cache.stats()
    );
    assert!(reused >= 900);
    Outcome::Pass
}
