//! io_uring fixed buffers from a node's pool (`--features io-uring`): data
//! written and read back through `WRITE_FIXED`/`READ_FIXED`, every buffer in
//! a registered slot, regions unregistered as the pool shrinks, and the
//! memlock limit refusing a region with a typed error while the ring goes
//! on. Skipped, saying so, where the kernel refuses io_uring.
#![cfg(feature = "io-uring")]

use std::io::{Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::sync::Mutex;

use io_uring::{opcode, types};
use numaweave::Error;
use numaweave::uring::{FixedBuffers, NodeRing};

/// The memlock test lowers the process's limit: the tests run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const SIZE: usize = 4096;

fn ring() -> Option<NodeRing> {
    let node = numaweave::Topology::global().current_node();
    match NodeRing::new(node, SIZE, 64) {
        Ok(r) => Some(r),
        Err(e) => {
            println!("skipped: no io_uring here ({e})");
            None
        }
    }
}

/// Runs one fixed-buffer operation and returns its result.
fn run(ring: &NodeRing, e: io_uring::squeue::Entry) -> i32 {
    // SAFETY: the buffers the entry names outlive this call.
    unsafe { ring.run_one(&e) }.unwrap()
}

#[test]
fn fixed_writes_and_reads_round_trip_through_registered_buffers() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ring) = ring() else { return };
    let mut file = tempfile();
    let fd = types::Fd(file.as_raw_fd());
    // 600 buffers: several regions (chunks double from 8 slabs).
    let mut bufs: Vec<_> = (0..600).map(|_| ring.alloc().unwrap()).collect();
    let slots: std::collections::HashSet<u16> = bufs.iter().map(|b| b.index()).collect();
    assert!(slots.len() >= 2, "600 buffers in {} registered region(s)", slots.len());
    assert!(ring.pinned() as usize >= 600 * SIZE);
    for (i, b) in bufs.iter_mut().enumerate() {
        b.fill(i as u8 ^ 0x5a);
        b[..8].copy_from_slice(&(i as u64).to_le_bytes());
    }
    for (i, b) in bufs.iter_mut().enumerate() {
        let w = opcode::WriteFixed::new(fd, b.as_mut_ptr(), SIZE as u32, b.index()).offset((i * SIZE) as u64).build();
        assert_eq!(run(&ring, w), SIZE as i32, "WRITE_FIXED of buffer {i}");
    }
    // Read every block back into another buffer, through its own slot.
    for (i, b) in bufs.iter_mut().enumerate().rev() {
        b.fill(0);
        let r = opcode::ReadFixed::new(fd, b.as_mut_ptr(), SIZE as u32, b.index()).offset((i * SIZE) as u64).build();
        assert_eq!(run(&ring, r), SIZE as i32, "READ_FIXED into buffer {i}");
        assert_eq!(u64::from_le_bytes(b[..8].try_into().unwrap()), i as u64);
        assert!(b[8..].iter().all(|&x| x == i as u8 ^ 0x5a), "buffer {i} read back wrong");
    }
    // What was written is in the file, as a plain read sees it.
    file.seek(SeekFrom::Start(7 * SIZE as u64)).unwrap();
    let mut plain = vec![0u8; SIZE];
    std::io::Read::read_exact(&mut file, &mut plain).unwrap();
    assert_eq!(u64::from_le_bytes(plain[..8].try_into().unwrap()), 7);
    // Every buffer back and a shrink: every region leaves its slot.
    drop(bufs);
    ring.pool().shrink();
    assert_eq!(ring.pinned(), 0, "regions unregistered as the pool shrank");
    assert_eq!(ring.pool().stats().total().registered_bytes, 0);
}

#[test]
fn a_region_past_the_memlock_limit_is_refused_and_the_ring_goes_on() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ring) = ring() else { return };
    let first = ring.alloc().unwrap();
    let pinned = FixedBuffers::pinned_in_process();
    assert!(pinned > 0);
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a valid rlimit to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut old) }, 0);
    // Room for what is pinned and a page more: the next region is refused.
    let low = libc::rlimit { rlim_cur: pinned + 4096, rlim_max: old.rlim_max };
    // SAFETY: lowering the soft limit only.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &low) }, 0);
    let mut held = Vec::new();
    let refused = loop {
        match ring.alloc() {
            Ok(b) => held.push(b),
            Err(e) => break e,
        }
        assert!(held.len() < 100_000, "never refused");
    };
    // SAFETY: the limit as it was.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &old) }, 0);
    match refused {
        Error::MemlockLimit { limit, pinned: p, asked, .. } => {
            assert_eq!(limit, pinned + 4096);
            assert_eq!(p, pinned);
            assert!(asked > 4096);
            let text = refused.to_string();
            assert!(text.contains("RLIMIT_MEMLOCK") && text.contains("ulimit -l"), "{text}");
        }
        e => panic!("expected MemlockLimit, got {e}"),
    }
    assert_eq!(FixedBuffers::pinned_in_process(), pinned, "nothing of the refused region stays pinned");
    // The ring goes on: a buffer of a registered region reads a file.
    let mut file = tempfile();
    file.write_all(&[0xc3; SIZE]).unwrap();
    let mut b = held.pop().unwrap_or(first);
    let r = opcode::ReadFixed::new(types::Fd(file.as_raw_fd()), b.as_mut_ptr(), SIZE as u32, b.index()).build();
    assert_eq!(run(&ring, r), SIZE as i32);
    assert!(b.iter().all(|&x| x == 0xc3));
    // And with the limit back, new regions again.
    drop(b);
    drop(held);
    let more: Vec<_> = (0..300).map(|_| ring.alloc().unwrap()).collect();
    drop(more);
}

fn tempfile() -> std::fs::File {
    let dir = std::env::temp_dir();
    let path = dir.join(format!("numaweave-uring-{}-{:?}", std::process::id(), std::thread::current().id()));
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    f
}
