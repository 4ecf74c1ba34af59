//! Pins on a node whose memory is movable (feature `io-uring`): memory of
//! the guest's memory-only node in `ZONE_MOVABLE`, as CXL expanders' memory
//! usually is. `.ci/vm-tests` gives the node a DIMM that the kernel onlines
//! movable at boot (`.ci/qemu-movable`, `memhp_default_state`); in a guest
//! without one the test offlines blocks of the node's boot memory and
//! onlines them movable, which works only where the kernel holds no
//! unmovable page in a block. It changes the guest for good, so it runs
//! only in a guest of its own (`NUMAWEAVE_VM_MOVABLE=1`).

use super::*;

/// Offlines every memory block of kernel node `phys` that the kernel lets
/// go and onlines it movable; how many now are.
fn online_movable(phys: usize) -> usize {
    let dir = format!("/sys/devices/system/node/node{phys}");
    let mut moved = 0;
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let name = e.file_name().into_string().unwrap();
        if name.strip_prefix("memory").is_none_or(|n| n.parse::<u32>().is_err()) {
            continue;
        }
        let state = format!("{dir}/{name}/state");
        // A block holding the node's own memory map cannot go offline.
        if std::fs::write(&state, "offline").is_ok() && std::fs::write(&state, "online_movable").is_ok() {
            moved += 1;
        }
    }
    moved
}

/// A ring on the movable node: its region's pages, moved off the node as
/// the kernel pins them, fail the allocation with `PinsLeftNode` (the
/// default); with `OffNodePins::Report` the region stays, its pages off the
/// node counted in the pool's statistics, and a ring on a node without
/// movable memory counts none.
pub(super) fn uring_pins_moved_off_a_movable_node_are_refused_or_counted(t: &Topology, g: Option<&Guest>) -> Outcome {
    use numaweave::io::uring::NodeRing;
    use numaweave::os::zones;
    use numaweave::slab::{OffNodePins, published};

    let Some(g) = g.filter(|g| g.memory_only > 0) else {
        return Outcome::Skip("needs a guest with a memory-only node");
    };
    if std::env::var_os("NUMAWEAVE_VM_MOVABLE").is_none() {
        return Outcome::Skip("changes the guest's memory: runs in a guest of its own (NUMAWEAVE_VM_MOVABLE=1)");
    }
    let m = g.cpu_nodes; // the first memory-only node, as the topology and the kernel number it
    let phys = t.physical_node(m);
    let at_boot = zones::node_zones(phys).unwrap().expect("the node in /proc/zoneinfo");
    let blocks = if at_boot.movable > 0 { 0 } else { online_movable(phys) };
    // Read the zones again only where blocks were onlined: they changed.
    let z = if blocks > 0 { zones::node_zones(phys).unwrap().expect("the node in /proc/zoneinfo") } else { at_boot };
    println!(
        "\n  node {m}: {} MiB movable from boot, {blocks} memory blocks onlined movable now; zones {z:?}",
        (at_boot.movable as usize * os::page_size()) >> 20
    );
    assert!(z.movable > 0, "no movable memory on node {m}, and no block of it could be offlined");

    // Fill the node's pinnable memory, as a long-lived pinned buffer of
    // another user would: a buffer as large as the node, faulted there
    // (its pinnable zone first fills, then its movable one), pinned by a
    // ring of its own (the kernel moves its movable pages elsewhere).
    let page = os::page_size();
    let fill_len = ((z.movable + z.pinnable) as usize * page).next_multiple_of(2 << 20);
    let fill = Mapping::map(fill_len).unwrap();
    fill.set_hugepages(false).unwrap();
    fill.bind(MemPolicy::Preferred(phys)).unwrap();
    touch(&fill);
    let filler = io_uring::IoUring::new(4).unwrap();
    let iov = [libc::iovec { iov_base: fill.as_ptr().cast(), iov_len: fill_len }];
    // SAFETY: the mapping outlives the ring (dropped after it, below).
    unsafe { filler.submitter().register_buffers(&iov) }.unwrap();
    let kept = nodes_of(&fill).iter().filter(|&&n| n == Some(phys)).count();
    println!("  a filler of {} MiB pinned: {kept} of its pages stay on node {m}", fill_len >> 20);

    // The default: the allocation fails, saying where the pages went.
    let ring = NodeRing::new(m, 4096, 8).unwrap();
    match ring.alloc() {
        Err(Error::PinsLeftNode { node, len, pages }) => {
            assert_eq!(node, m);
            assert!(pages > 0 && pages <= len / page, "{pages} pages of {len} bytes");
            println!("  NodeRing::new({m}).alloc(): refused, {pages} of {} pages pinned off node {m}", len / page);
        }
        Err(e) => panic!("NodeRing on the movable node: {e}"),
        Ok(b) => {
            let got = touch_and_locate(b.as_ptr().cast_mut(), 4096);
            panic!("NodeRing on the movable node handed out a buffer (its page on {got:?})");
        }
    }
    let stats = ring.pool().cache().stats().total();
    assert_eq!((stats.registered_regions, stats.pinned_off_node), (0, 0), "a refused region kept: {stats:?}");
    drop(ring);

    // Reported: the buffer is served; what left the node is counted, and
    // the buffer's own page is among it.
    let ring = NodeRing::with_pins(m, 4096, 8, OffNodePins::Report).unwrap();
    let mut b = ring.alloc().unwrap();
    let got = touch_and_locate(b.as_mut_ptr(), 4096);
    let stats = ring.pool().cache().stats();
    let off = stats.node(m).pinned_off_node;
    assert!(off > 0 && off <= stats.node(m).registered_bytes, "{:?}", stats.node(m));
    assert!(got.iter().all(|&n| n.is_some_and(|n| n != phys)), "the buffer's page on {got:?}, counted {off}");
    println!(
        "  with OffNodePins::Report: served, {} of {} registered KiB counted off node {m} (the buffer's page on {got:?})",
        off >> 10,
        stats.node(m).registered_bytes >> 10
    );
    // As `numaweave numastat PID` reads it: the table says the chunk is
    // node 2's, the kernel has its pages elsewhere.
    let link = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .find(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().contains(published::FILE_NAME)));
    let table = published::read_file(&link.expect("no published table").path()).unwrap();
    let mut off_table = 0;
    for c in table.chunks.iter().filter(|c| c.name() == "uring_fixed" && c.node() == Some(phys)) {
        let addrs: Vec<*const u8> = (c.start..c.start + c.len).step_by(c.page_size()).map(|a| a as *const u8).collect();
        let mut st = vec![0i32; addrs.len()];
        os::pages::page_nodes_of(std::process::id() as i32, &addrs, &mut st).unwrap();
        off_table += st.iter().filter(|&&n| n >= 0 && n as usize != phys).count() * c.page_size();
    }
    assert_eq!(off_table, off, "the published table's chunks off node {m}");
    println!("  the published table (numastat): {} KiB of node {m}'s chunks off it", off_table >> 10);
    drop(b);
    drop(ring);

    // A CPU node's memory is not movable: nothing to count.
    let ring = NodeRing::with_pins(0, 4096, 8, OffNodePins::Report).unwrap();
    let mut b = ring.alloc().unwrap();
    let got = touch_and_locate(b.as_mut_ptr(), 4096);
    assert!(got.iter().all(|&n| n == Some(t.physical_node(0))), "{got:?}");
    assert_eq!(ring.pool().cache().stats().total().pinned_off_node, 0);
    println!("  a ring on node 0 (no movable memory): its buffer on node 0, nothing counted off it");
    drop(b);
    drop(ring);
    drop(filler);
    drop(fill);
    Outcome::Pass
}
