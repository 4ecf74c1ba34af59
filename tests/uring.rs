//! io_uring fixed buffers from a node's pool (`--features io-uring`): data
//! written and read back through `WRITE_FIXED`/`READ_FIXED`, every buffer in
//! a registered slot, regions unregistered as the pool shrinks, and the
//! memlock limit refusing a region with a typed error while the ring goes
//! on. Where the kernel refuses io_uring each test says it cannot run (and
//! fails under `NUMAWEAVE_TEST_STRICT`, as in CI).
#![cfg(feature = "io-uring")]

use std::io::{Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::sync::Mutex;

use io_uring::{opcode, types};
use numaweave::Error;
use numaweave::io::uring::{FixedBuffers, NodeRing};

mod support;

/// The memlock test lowers the process's limit: the tests run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const SIZE: usize = 4096;

fn ring() -> Option<NodeRing> {
    ring_of(SIZE, 64)
}

/// A ring of `entries` and `size`-byte buffers on this thread's node, or
/// `None` where io_uring cannot run here (said).
fn ring_of(size: usize, entries: u32) -> Option<NodeRing> {
    let node = numaweave::Topology::global().current_node();
    match NodeRing::new(node, size, entries) {
        Ok(r) => Some(r),
        Err(e) => {
            support::cannot_run(format_args!("no io_uring here ({e})"));
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
    // Regions again, maybe at the addresses of those gone and in other
    // slots: each buffer still names the slot its region has now.
    let mut again: Vec<_> = (0..600).map(|_| ring.alloc().unwrap()).collect();
    assert!(ring.pinned() as usize >= 600 * SIZE);
    for (i, b) in again.iter_mut().enumerate().step_by(37) {
        b.fill(0);
        let r = opcode::ReadFixed::new(fd, b.as_mut_ptr(), SIZE as u32, b.index()).offset((i * SIZE) as u64).build();
        assert_eq!(run(&ring, r), SIZE as i32, "READ_FIXED into buffer {i} after the shrink");
        assert_eq!(u64::from_le_bytes(b[..8].try_into().unwrap()), i as u64);
    }
}

/// A forked child shares the ring with its parent, not its registrations:
/// the child's shrink of the pool leaves the parent's slots filled (before,
/// it emptied them and the parent's next fixed read failed with EFAULT),
/// and in the child no buffer has a slot.
#[test]
fn a_forked_childs_shrink_leaves_the_parents_slots_alone() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ring) = ring() else { return };
    let mut file = tempfile();
    file.write_all(&[0x6b; SIZE]).unwrap();
    let mut bufs: Vec<_> = (0..100).map(|_| ring.alloc().unwrap()).collect();
    let mut kept = bufs.pop().unwrap();
    drop(bufs);
    let pinned = ring.pinned();
    // SAFETY: the child shrinks the pool and ends with `_exit`.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        ring.pool().shrink();
        let code = if ring.pinned() != 0 { 3 } else { 0 };
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(code) };
    }
    let mut st = 0;
    // SAFETY: our child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
    assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "the child: status {st:#x}");
    assert_eq!(ring.pinned(), pinned);
    kept.fill(0);
    let r = opcode::ReadFixed::new(types::Fd(file.as_raw_fd()), kept.as_mut_ptr(), SIZE as u32, kept.index())
        .offset(0)
        .build();
    assert_eq!(run(&ring, r), SIZE as i32, "READ_FIXED after the child's shrink");
    assert!(kept.iter().all(|&x| x == 0x6b));
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

/// The byte at offset `k` of the streams the buffer-ring tests send.
fn pattern(k: usize) -> u8 {
    (k as u8).wrapping_mul(7) ^ (k >> 12) as u8
}

#[test]
fn a_buffer_ring_receives_a_tcp_stream_recycling_its_buffers() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ring) = ring() else { return };
    let group = ring.buf_ring(3, 16).unwrap();
    assert_eq!((group.entries(), group.available(), group.buffer_size()), (16, 16, SIZE));
    assert!(group.pinned() >= 16 * 16);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // 4 MiB: sixty-four times what the ring holds, so every buffer comes
    // back and is filled again many times.
    const TOTAL: usize = 4 << 20;
    let sender = std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let data: Vec<u8> = (0..TOTAL).map(pattern).collect();
        for piece in data.chunks(10_000) {
            s.write_all(piece).unwrap();
        }
    });
    let (rx, _) = listener.accept().unwrap();
    let (mut got, mut recvs) = (0usize, 0usize);
    let mut bids = std::collections::HashSet::new();
    loop {
        // SAFETY: the socket outlives the request; the buffer is the ring's.
        let cqe = unsafe { ring.run_one_entry(&group.recv(rx.as_raw_fd())) }.unwrap();
        let Some(buf) = group.take(&cqe).unwrap() else { break };
        if buf.is_empty() {
            break; // end of stream
        }
        assert_eq!(group.available(), 15, "the buffer taken is out of the ring");
        for (i, &b) in buf.iter().enumerate() {
            assert_eq!(b, pattern(got + i), "byte {} of the stream", got + i);
        }
        bids.insert(buf.bid());
        got += buf.len();
        recvs += 1;
    }
    sender.join().unwrap();
    assert_eq!(got, TOTAL, "the whole stream, in {recvs} receives");
    assert!(recvs >= TOTAL / SIZE, "{recvs} receives of at most a buffer each");
    assert!(bids.len() <= 16 && !bids.is_empty());
    assert_eq!(group.available(), 16, "every buffer back in the ring");
}

#[test]
fn an_empty_buffer_ring_refuses_with_enobufs_until_a_buffer_comes_back() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ring) = ring() else { return };
    assert!(matches!(ring.buf_ring(1, 3), Err(Error::InvalidRing { .. })), "3 entries is no power of two");
    let group = ring.buf_ring(1, 2).unwrap();
    assert_eq!(ring.buf_ring(1, 2).err().and_then(|e| e.errno()), Some(libc::EEXIST), "a group taken");
    let (mut tx, rx) = std::os::unix::net::UnixStream::pair().unwrap();
    tx.write_all(&[0x11; 3 * SIZE]).unwrap();
    // SAFETY: the socket outlives the request.
    let recv = || unsafe { ring.run_one_entry(&group.recv(rx.as_raw_fd())) }.unwrap();
    let first_cqe = recv();
    let a = group.take(&first_cqe).unwrap().unwrap();
    let b = group.take(&recv()).unwrap().unwrap();
    assert_ne!(a.bid(), b.bid());
    assert_eq!(group.available(), 0);
    // The same completion again would alias buffer `a`: refused.
    assert_eq!(group.take(&first_cqe).err(), Some(Error::BufferNotLent { group: 1, bid: a.bid() }));
    let e = group.take(&recv()).err().expect("no buffer left");
    assert_eq!(e.errno(), Some(libc::ENOBUFS), "{e}");
    drop(a);
    assert_eq!(group.available(), 1);
    let c = group.take(&recv()).unwrap().unwrap();
    assert_eq!(c.len(), SIZE);
    assert!(c.iter().all(|&x| x == 0x11));
    drop((b, c));
    drop(group);
    // Unregistered as it dropped: the group id is free again, and a read
    // of a file selects from it too.
    let group = ring.buf_ring(1, 4).unwrap();
    let mut file = tempfile();
    file.write_all(&[0x5e; 100]).unwrap();
    // SAFETY: the file outlives the request.
    let cqe = unsafe { ring.run_one_entry(&group.read(file.as_raw_fd(), 0)) }.unwrap();
    assert_eq!(&*group.take(&cqe).unwrap().unwrap(), &[0x5e; 100][..]);
}

/// An incremental buffer ring (Linux 6.12) of 64 KiB buffers takes a
/// stream sent 500 bytes at a time: each receive is a piece of the buffer
/// at the ring's head, pieces held while the kernel fills the rest, and a
/// buffer goes back only once filled to its last byte and every piece of
/// it dropped: buffers used = bytes / 64 KiB, where a whole-buffer ring of
/// the same pool uses one a receive (run beside it). A completion taken
/// twice is refused: its bytes would be the kernel's still. On an older
/// kernel the incremental ring is whole-buffer, and the test says so.
#[test]
fn an_incremental_buffer_ring_fills_each_buffer_with_many_receives() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ring) = ring_of(BIG, 16) else { return };
    for (bgid, incremental) in [(9, true), (10, false)] {
        let group = if incremental { ring.buf_ring_incremental(bgid, 4) } else { ring.buf_ring(bgid, 4) }.unwrap();
        if incremental && !group.is_incremental() {
            println!("a kernel before 6.12: the incremental ring is whole-buffer");
        }
        let (got, recvs) = stream_in_small_writes(&ring, &group);
        assert_eq!(group.bytes_received(), got as u64);
        if group.is_incremental() {
            assert_eq!(group.buffers_used(), (got / BIG) as u64, "{recvs} receives");
        } else {
            assert_eq!(group.buffers_used(), recvs);
        }
        assert_eq!(group.available(), 4, "every buffer back in the ring");
        println!(
            "{got} bytes in {recvs} receives used {} buffers of 64 KiB (incremental: {})",
            group.buffers_used(),
            group.is_incremental()
        );
    }
}

const BIG: usize = 64 << 10;

/// Reads of a regular file through a ring of 2 buffers, twenty times each
/// to its end: every read, the 0-byte ones at the end included, gives its
/// buffer back into the ring (no ENOBUFS).
#[test]
fn file_reads_to_their_end_give_every_buffer_back() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ring) = ring_of(BIG, 16) else { return };
    let mut file = tempfile();
    file.write_all(&[0x3c; 100]).unwrap();
    let group = ring.buf_ring(13, 2).unwrap();
    for round in 0..20 {
        // SAFETY: the file outlives the request.
        let cqe = unsafe { ring.run_one_entry(&group.read(file.as_raw_fd(), 0)) }.unwrap();
        let data = group.take(&cqe).unwrap_or_else(|e| panic!("round {round}: {e}")).expect("the file's bytes");
        assert_eq!(&*data, &[0x3c; 100][..], "round {round}");
        drop(data);
        // SAFETY: as above.
        let cqe = unsafe { ring.run_one_entry(&group.read(file.as_raw_fd(), 100)) }.unwrap();
        match group.take(&cqe).unwrap_or_else(|e| panic!("round {round}, at the end: {e}")) {
            None => {}
            Some(b) => assert!(b.is_empty(), "bytes past the end"),
        }
    }
    assert_eq!(group.available(), 2, "a buffer lost");
}

/// Two receives of 2 KiB each into one 4 KiB buffer of an incremental
/// ring, both completed before either is taken (a server reaping a batch):
/// the first piece is the first half (its completion says more is to come,
/// though the buffer is full by the time it is taken), the second the
/// second half, and the buffer goes back once both pieces drop (before:
/// the first take read the full entry, called the buffer done, and the
/// second completion was refused).
#[test]
fn batched_completions_cut_an_incremental_buffer_in_order() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ring) = ring() else { return };
    let group = ring.buf_ring_incremental(14, 1).unwrap();
    if !group.is_incremental() {
        println!("a kernel before 6.12: no incremental ring to check");
        return;
    }
    let (mut tx, rx) = std::os::unix::net::UnixStream::pair().unwrap();
    let data: Vec<u8> = (0..SIZE).map(pattern).collect();
    tx.write_all(&data).unwrap();
    let half = |k: u64| {
        opcode::Recv::new(types::Fd(rx.as_raw_fd()), core::ptr::null_mut(), (SIZE / 2) as u32)
            .buf_group(group.bgid())
            .build()
            .flags(io_uring::squeue::Flags::BUFFER_SELECT)
            .user_data(k)
    };
    {
        let mut sq = ring.submission();
        // SAFETY: the socket and the ring's buffers outlive the requests,
        // reaped below.
        unsafe { sq.push(&half(1)).unwrap() };
        // SAFETY: as above.
        unsafe { sq.push(&half(2)).unwrap() };
    }
    ring.submit_and_wait(2).unwrap();
    let mut cqes: Vec<_> = ring.completion().by_ref().collect();
    cqes.sort_by_key(|c| c.user_data());
    assert_eq!(cqes.len(), 2);
    let first = group.take(&cqes[0]).unwrap().expect("the first half");
    let second = group.take(&cqes[1]).unwrap().expect("the second half");
    assert_eq!((first.offset(), first.len(), second.offset(), second.len()), (0, SIZE / 2, SIZE / 2, SIZE / 2));
    assert_eq!(&*first, &data[..SIZE / 2]);
    assert_eq!(&*second, &data[SIZE / 2..]);
    drop(first);
    assert_eq!(group.buffers_used(), 0, "given back with a piece out");
    drop(second);
    assert_eq!((group.buffers_used(), group.available()), (1, 1), "not given back");
}

/// Sends 2,000 messages of 500 bytes through a socket pair, each received
/// (in one piece or more) through `group` before the next is sent, three
/// pieces held at any time; checks every byte. The bytes and receives.
fn stream_in_small_writes(ring: &NodeRing, group: &numaweave::io::uring::BufRing<'_>) -> (usize, u64) {
    const MSG: usize = 500;
    let (mut tx, rx) = std::os::unix::net::UnixStream::pair().unwrap();
    let (mut got, mut recvs) = (0usize, 0u64);
    let mut held = std::collections::VecDeque::new();
    for m in 0..2000 {
        let msg: Vec<u8> = (m * MSG..(m + 1) * MSG).map(pattern).collect();
        tx.write_all(&msg).unwrap();
        while got < (m + 1) * MSG {
            // SAFETY: the socket outlives the request; the buffer is the ring's.
            let cqe = unsafe { ring.run_one_entry(&group.recv(rx.as_raw_fd())) }.unwrap();
            let piece = group.take(&cqe).unwrap().expect("data was waiting");
            assert!(!piece.is_empty() && piece.offset() + piece.len() <= BIG);
            for (i, &b) in piece.iter().enumerate() {
                assert_eq!(b, pattern(got + i), "byte {} of the stream", got + i);
            }
            if m == 0 {
                assert!(
                    matches!(group.take(&cqe), Err(Error::BufferNotLent { .. })),
                    "a completion taken twice handed out bytes again"
                );
            }
            got += piece.len();
            recvs += 1;
            // A few pieces stay out while the kernel fills the buffer on.
            held.push_back(piece);
            if held.len() > 3 {
                held.pop_front();
            }
        }
    }
    (got, recvs)
}

fn tempfile() -> std::fs::File {
    let dir = std::env::temp_dir();
    let path = dir.join(format!("numaweave-uring-{}-{:?}", std::process::id(), std::thread::current().id()));
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    f
}
