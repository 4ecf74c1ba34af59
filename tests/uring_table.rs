//! One registered-buffer table per node shared by every ring
//! (`--features io-uring`, `NodeTable`): pinned and charged once, every
//! index working from every ring as the pool grows and after it moves,
//! and rings that fit `RLIMIT_MEMLOCK` where registrations of their own do
//! not. On a kernel before 6.12 the table makes rings of their own, and
//! each test checks that instead, saying so. Where the kernel refuses
//! io_uring each test says it cannot run (and fails under
//! `NUMAWEAVE_TEST_STRICT`, as in CI).
#![cfg(feature = "io-uring")]

use std::io::{Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use io_uring::{opcode, types};
use numaweave::Error;
use numaweave::io::uring::{FixedBuffers, NodeRing, NodeTable, Sharing};

mod support;

/// The memlock test lowers the process's limit: the tests run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn table(size: usize) -> Option<Arc<NodeTable>> {
    let node = numaweave::Topology::global().current_node();
    match NodeTable::new(node, size) {
        Ok(t) => {
            if t.sharing() == Sharing::PerRing {
                println!("a kernel before 6.12: the table's rings register on their own");
            }
            Some(t)
        }
        Err(e) => {
            support::cannot_run(format_args!("no io_uring here ({e})"));
            None
        }
    }
}

fn run(ring: &NodeRing, e: io_uring::squeue::Entry) -> i32 {
    // SAFETY: the buffers and the file the entry names outlive this call.
    unsafe { ring.run_one(&e) }.unwrap()
}

fn tempfile() -> std::fs::File {
    let path = std::env::temp_dir().join(format!("numaweave-table-{}", std::process::id()));
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    f
}

/// Four rings of one table: 120 buffers allocated from them in turn (the
/// pool grows region by region after the rings were made), each written
/// with `WRITE_FIXED` through the next ring and read back with
/// `READ_FIXED` through the one after, by the index its own ring gave.
/// What is pinned: the table's bytes once where clones follow every change
/// (6.13); on 6.12, whose rings register regions that came after their
/// clone themselves, once more per ring. After the pool moves (`migrate`,
/// each region released and registered again), every index reads again
/// from every ring, and as much is pinned.
#[test]
fn a_node_table_is_pinned_once_and_serves_every_ring_on_every_index() {
    const SIZE: usize = 4096;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(table) = table(SIZE) else { return };
    let shared = table.sharing() != Sharing::PerRing;
    let rings: Vec<NodeRing> = (0..4).map(|_| table.ring(32).unwrap()).collect();
    let before = FixedBuffers::pinned_in_process();
    let mut bufs: Vec<_> = (0..120).map(|i| (i % 4, rings[i % 4].alloc().unwrap())).collect();
    // A buffer of another ring is used after a sync (Linux 6.12 clones
    // whole tables: the ring takes the regions it lacks then).
    let other = |r: usize, k: usize| if shared { (r + k) % 4 } else { r };
    for r in &rings {
        r.sync().unwrap();
    }
    let mut file = tempfile();
    for (i, (r, b)) in bufs.iter_mut().enumerate() {
        b.fill(i as u8 ^ 0x5a);
        let w = opcode::WriteFixed::new(types::Fd(file.as_raw_fd()), b.as_mut_ptr(), SIZE as u32, b.index())
            .offset((i * SIZE) as u64);
        assert_eq!(run(&rings[other(*r, 1)], w.build()), SIZE as i32, "WRITE_FIXED of buffer {i} (ring {r}'s)");
    }
    let read_all = |bufs: &mut Vec<(usize, numaweave::io::uring::FixedBuf<'_>)>, k: usize| {
        for (i, (r, b)) in bufs.iter_mut().enumerate() {
            b.fill(0);
            let rd = opcode::ReadFixed::new(types::Fd(file.as_raw_fd()), b.as_mut_ptr(), SIZE as u32, b.index())
                .offset((i * SIZE) as u64);
            assert_eq!(run(&rings[other(*r, k)], rd.build()), SIZE as i32, "READ_FIXED of buffer {i}");
            assert!(b.iter().all(|&x| x == i as u8 ^ 0x5a), "buffer {i} read back wrong");
        }
    };
    read_all(&mut bufs, 2);
    let pinned = FixedBuffers::pinned_in_process() - before;
    if shared {
        let per_table = if table.sharing() == Sharing::CloneRanges { 1 } else { 5 };
        assert_eq!(pinned, per_table * table.pinned(), "{:?}", table.sharing());
        assert!(table.pinned() >= 120 * SIZE as u64);
        assert_eq!(table.rings(), 4);
    } else {
        assert_eq!(pinned, rings.iter().map(NodeRing::pinned).sum::<u64>());
    }
    println!("{:?}: 120 buffers through 4 rings, {} KiB pinned in all", table.sharing(), pinned >> 10);

    // The pool moves, to another node where there is one (a multi-node
    // guest), else to its own (each region released, its pages moved where
    // the kernel will, registered again).
    let topo = numaweave::Topology::global();
    let to = topo.memory_nodes().iter().find(|&n| n != table.node()).unwrap_or(table.node());
    let pool = if shared { table.pool().unwrap() } else { rings[0].pool() };
    let m = pool.migrate(to).unwrap();
    assert_eq!(m.registrations_lost, 0, "{m}");
    assert!(m.regions_moved >= 1, "{m}");
    for r in &rings {
        r.sync().unwrap();
    }
    read_all(&mut bufs, 3);
    if shared && to != table.node() {
        let phys = topo.physical_node(to);
        for (i, (_, b)) in bufs.iter().enumerate() {
            let n = numaweave::os::mem::page_node(b.as_ptr()).unwrap();
            assert_eq!(n, Some(phys), "buffer {i} not on node {to} after the move");
        }
        println!("moved to node {to}: every buffer there, every index read through every ring");
    }
    assert_eq!(FixedBuffers::pinned_in_process() - before, pinned, "a move changed what is pinned");
    drop(bufs);
    drop(rings);
    assert_eq!(table.rings(), 0);
    let _ = file.seek(SeekFrom::Start(0));
    let _ = file.write(&[0]);
}

/// A region that takes a low slot again (the pool shrank below buffers
/// still out in higher slots, then grew): every ring keeps the higher
/// slots (a one-slot clone over a table drops the slots above it on Linux
/// 6.13 to 6.18 before the fix; the table clones whole), and a buffer of
/// a high slot is read through every ring without a sync.
#[test]
fn a_low_slot_filled_again_leaves_every_ring_its_higher_slots() {
    const SIZE: usize = 4096;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(table) = table(SIZE) else { return };
    if table.sharing() == Sharing::PerRing {
        return;
    }
    let rings: Vec<NodeRing> = (0..3).map(|_| table.ring(16).unwrap()).collect();
    let mut bufs: Vec<_> = (0..300).map(|_| rings[0].alloc().unwrap()).collect();
    let top = bufs.iter().map(|b| b.index()).max().unwrap();
    assert!(top >= 2, "the pool grew to {} regions only", top + 1);
    // Keep one buffer of the highest slot; the rest go, and the pool
    // shrinks: the low slots empty.
    let keep = bufs.iter().position(|b| b.index() == top).unwrap();
    let mut kept = bufs.swap_remove(keep);
    drop(bufs);
    table.pool().unwrap().shrink();
    // Grown again past the kept region's room: a new region, a low slot.
    let mut again = Vec::new();
    while again.len() < 5000 && again.last().is_none_or(|b: &numaweave::io::uring::FixedBuf<'_>| b.index() >= top) {
        again.push(rings[1].alloc().unwrap());
    }
    assert!(again.last().is_some_and(|b| b.index() < top), "no lower slot taken again");
    let mut file = tempfile();
    file.write_all(&[0x77; SIZE]).unwrap();
    for (k, r) in rings.iter().enumerate() {
        kept.fill(0);
        let rd = opcode::ReadFixed::new(types::Fd(file.as_raw_fd()), kept.as_mut_ptr(), SIZE as u32, kept.index());
        assert_eq!(run(r, rd.build()), SIZE as i32, "ring {k}: slot {top} lost");
        assert!(kept.iter().all(|&x| x == 0x77));
    }
}

/// Under a `RLIMIT_MEMLOCK` that holds the table's buffers once and a
/// half: four more rings of the table allocate as many buffers from it
/// (nothing more is pinned), where a second ring registering the same buffers of its own
/// passes the limit (`MemlockLimit`).
#[test]
fn rings_of_one_table_fit_the_memlock_limit_where_their_own_registrations_do_not() {
    // (Small enough for the usual 8 MiB hard limit.)
    const SIZE: usize = 16 << 10;
    const BUFS: usize = 32;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(table) = table(SIZE) else { return };
    if table.sharing() == Sharing::PerRing {
        // Nothing is shared: each ring pins its own (checked above).
        return;
    }
    let first = table.ring(8).unwrap();
    // The pool registers its regions as these are handed out; given back,
    // they stay registered for the rings below to use again.
    drop((0..BUFS).map(|_| first.alloc().unwrap()).collect::<Vec<_>>());
    let once = table.pinned();
    let limit = FixedBuffers::pinned_in_process() + once + once / 2;
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut old) }, 0);
    let new = libc::rlimit { rlim_cur: limit.min(old.rlim_max), rlim_max: old.rlim_max };
    assert!(new.rlim_cur == limit, "the hard limit is below what the test needs");
    // SAFETY: a valid rlimit; the soft limit stays below the hard one.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &new) }, 0);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let more: Vec<NodeRing> = (0..4).map(|_| table.ring(8).unwrap()).collect();
        let bufs: Vec<_> = more.iter().flat_map(|r| (0..BUFS / 4).map(|_| r.alloc().unwrap())).collect();
        assert_eq!(table.pinned(), once, "rings of the table pinned more");
        drop(bufs);
        let own = NodeRing::new(table.node(), SIZE, 8).unwrap();
        let own_bufs: Vec<_> = (0..BUFS).map(|_| own.alloc().unwrap()).collect();
        let second = NodeRing::new(table.node(), SIZE, 8).unwrap();
        // (Held, so that each takes a buffer of its own.)
        let tries: Vec<_> = (0..BUFS).map(|_| second.alloc()).collect();
        let refused = tries.into_iter().find_map(Result::err);
        drop(own_bufs);
        (refused, more.len())
    }));
    // SAFETY: as above: the old limit back.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &old) }, 0);
    let (refused, rings) = result.unwrap();
    match refused {
        Some(Error::MemlockLimit { .. }) => {}
        other => panic!("a second ring's own registration was not refused: {other:?}"),
    }
    println!(
        "{} KiB registered once served {} rings; two rings' own registrations of as much passed the limit",
        once >> 10,
        rings + 1
    );
}

/// A forked child cannot make rings of its parent's table (its primary
/// ring and registrations are the parent's), nor takes its lock.
#[test]
fn a_forked_child_makes_no_ring_of_its_parents_table() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(table) = table(4096) else { return };
    if table.sharing() == Sharing::PerRing {
        return;
    }
    let ring = table.ring(8).unwrap();
    let _buf = ring.alloc().unwrap();
    // SAFETY: the child only asks for a ring (refused before any lock or
    // allocation) and ends with `_exit`.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = match table.ring(8) {
            // (Nor counts the parent's rings: its lock is not taken.)
            Err(Error::Os { errno: libc::EPERM, .. }) if table.rings() == 0 => 0,
            Err(Error::Os { errno: libc::EPERM, .. }) => 3,
            Err(_) => 2,
            Ok(_) => 1,
        };
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    let mut st = 0;
    // SAFETY: our child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
    assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "the child's ring: status {st:#x}");
}
