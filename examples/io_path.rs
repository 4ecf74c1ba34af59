//! An I/O path in miniature, after Jeff Moyer's "make I/O path allocations
//! more numa-friendly" (`../shared/sources/000_…`): commands, their sense
//! buffers and the data buffers live in slab caches on the node of the block
//! device that serves the file.
//!
//! ```text
//! cargo run --release --example io_path -- [--device NAME] [--dir DIR]
//!     [--threads N] [--seconds S] [--file-mib M] [--request-kib K]
//!     [--uring [--no-fixed | --recv]]
//! ```
//!
//! It writes a scratch file whose every 4 KiB block holds its own block
//! number, finds the block device under it (sysfs; `--device` overrides),
//! builds the caches on that device's node (local where it has none), then
//! runs worker threads that read random requests with `O_DIRECT` `preadv`
//! into slab buffers, merging buffers adjacent in memory into one iovec, and
//! check every block read. The data buffers come from a `DmaPool`: each lies
//! inside one 2 MiB page, on hugetlb pages with `NUMAWEAVE_HUGE=hugetlb`.
//! Prints IOPS, MiB/s, segments per request (virtual: the iovecs; physical:
//! the page frames behind them, sampled, when run as root) and the slabinfo
//! table.
//!
//! With `--uring` (built with `--features io-uring`) each worker has a
//! `NodeRing` on the device's node and reads each request with one
//! `READ_FIXED` into a buffer of the request's size from the ring's pool,
//! whose regions are the ring's registered buffers (no page walk or pin per
//! request); with `--uring --no-fixed` the same buffers through plain
//! `READ` (a walk and a pin per request). It then also prints the regions
//! registered and the bytes pinned.
//!
//! With `--uring --recv` it is a network path instead: a thread streams a
//! known pattern over a loopback TCP connection and the receiver takes it,
//! for `--seconds` each, first with `recv(2)` into a buffer of a `DmaPool`,
//! then with io_uring receives into a provided-buffer ring of the same
//! pool's buffers on one node (`BufRing`: the kernel picks a buffer when
//! data arrives, the receiver verifies it and gives it back). Prints MiB/s
//! of both, their ratio, the receives and the buffers the ring went
//! through.

use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::os::unix::io::AsRawFd as _;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use numaweave::Error;
use numaweave::slab::{DmaPool, Home, SlabBox, SlabCache, phys_segments, slabinfo};
use numaweave::topology::Topology;

const BLOCK: usize = 4096;
const SENSE: usize = 96;

/// A command: what the driver tracks per request (`struct scsi_cmnd`).
struct Command {
    tag: u64,
    offset: u64,
    blocks: usize,
    /// The sense buffer, from its own cache (`cmd->sense_buffer`).
    sense: Option<SlabBox<[u8; SENSE]>>,
    status: i64,
}

/// The command pool: commands and sense buffers, allocated as a pair.
struct CommandPool {
    cmds: SlabCache<Command>,
    senses: SlabCache<[u8; SENSE]>,
}

impl CommandPool {
    /// `scsi_get_command`: a command and its sense buffer or neither. When
    /// the sense buffer cannot be had (its cache is at its limit), the
    /// command is given back (`kmem_cache_free(pool->cmd_slab, cmd)`).
    fn get(&self, tag: u64, offset: u64, blocks: usize) -> Result<SlabBox<Command>, Error> {
        let mut cmd = self.cmds.try_alloc(Command { tag, offset, blocks, sense: None, status: 0 })?;
        match self.senses.try_alloc([0; SENSE]) {
            Ok(s) => {
                cmd.sense = Some(s);
                Ok(cmd)
            }
            Err(e) => {
                drop(cmd); // undo the first half
                Err(e)
            }
        }
    }
}

struct Args {
    device: Option<String>,
    dir: PathBuf,
    threads: usize,
    seconds: f64,
    file_mib: usize,
    request_kib: usize,
    engine: Engine,
    /// The network leg (`--uring --recv`).
    recv: bool,
}

/// How requests are read.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Engine {
    /// `preadv` into 4 KiB slab buffers, adjacent ones merged.
    Preadv,
    /// io_uring `READ_FIXED` into a registered buffer of the request's size.
    Fixed,
    /// io_uring plain `READ` into the same buffers.
    Plain,
}

fn parse_args() -> Args {
    let mut a = Args {
        device: None,
        dir: std::env::temp_dir(),
        threads: 0,
        seconds: 2.0,
        file_mib: 64,
        request_kib: 32,
        engine: Engine::Preadv,
        recv: false,
    };
    let (mut uring, mut no_fixed) = (false, false);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--device" => a.device = Some(val()),
            "--dir" => a.dir = PathBuf::from(val()),
            "--threads" => a.threads = val().parse().unwrap_or_else(|_| usage("--threads N")),
            "--seconds" => a.seconds = val().parse().unwrap_or_else(|_| usage("--seconds S")),
            "--file-mib" => a.file_mib = val().parse().unwrap_or_else(|_| usage("--file-mib M")),
            "--request-kib" => a.request_kib = val().parse().unwrap_or_else(|_| usage("--request-kib K")),
            "--uring" => uring = true,
            "--no-fixed" => no_fixed = true,
            "--recv" => a.recv = true,
            "-h" | "--help" => usage(""),
            other => usage(&format!("unknown argument {other}")),
        }
    }
    if a.request_kib == 0 || !a.request_kib.is_multiple_of(4) || a.request_kib > 1024 {
        usage("--request-kib must be a multiple of 4, at most 1024");
    }
    if a.file_mib * 1024 < a.request_kib {
        usage("--file-mib must hold at least one request");
    }
    if a.recv && (!uring || no_fixed) {
        usage("--recv goes with --uring (and not --no-fixed)");
    }
    a.engine = match (uring, no_fixed) {
        (false, false) => Engine::Preadv,
        (false, true) => usage("--no-fixed goes with --uring"),
        (true, _) if cfg!(not(feature = "io-uring")) => usage("--uring: built without --features io-uring"),
        (true, false) => Engine::Fixed,
        (true, true) => Engine::Plain,
    };
    a
}

fn usage(msg: &str) -> ! {
    if !msg.is_empty() {
        eprintln!("io_path: {msg}");
    }
    eprintln!(
        "usage: io_path [--device NAME] [--dir DIR] [--threads N] [--seconds S] [--file-mib M] [--request-kib K] \
         [--uring [--no-fixed | --recv]]"
    );
    std::process::exit(2)
}

/// Writes the scratch file: block `i` starts with `i` and is filled with its low byte.
fn write_scratch(path: &PathBuf, blocks: usize) -> std::io::Result<()> {
    let mut f = File::create(path)?;
    let mut chunk = vec![0u8; 256 * BLOCK];
    for first in (0..blocks).step_by(256) {
        let n = (blocks - first).min(256);
        for (j, b) in chunk.chunks_mut(BLOCK).take(n).enumerate() {
            let i = (first + j) as u64;
            b.fill(i as u8);
            b[..8].copy_from_slice(&i.to_le_bytes());
        }
        f.write_all(&chunk[..n * BLOCK])?;
    }
    f.sync_all()
}

/// Opens with `O_DIRECT`, or without it (and says so) where the file system
/// refuses it (tmpfs, overlayfs on some kernels).
fn open_direct(path: &PathBuf) -> std::io::Result<(File, bool)> {
    match OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            println!("notice: {} refuses O_DIRECT; reading through the page cache", path.display());
            Ok((File::open(path)?, false))
        }
        Err(e) => Err(e),
    }
}

/// Groups `bufs` (in file order) into iovecs, one per run of buffers that are
/// adjacent in memory.
fn merge(bufs: &[NonNull<u8>], iov: &mut Vec<libc::iovec>) {
    iov.clear();
    for b in bufs {
        match iov.last_mut() {
            Some(last) if last.iov_base as usize + last.iov_len == b.as_ptr() as usize => last.iov_len += BLOCK,
            _ => iov.push(libc::iovec { iov_base: b.as_ptr().cast(), iov_len: BLOCK }),
        }
    }
}

/// The next request: a random aligned run of `per_req` blocks, and its
/// command from the pool (waiting, counted, while the pool is at its
/// limit).
fn next_request(
    rng: &mut u64,
    tag: &mut u64,
    blocks: usize,
    per_req: usize,
    pool: &CommandPool,
    totals: &Totals,
) -> (usize, SlabBox<Command>) {
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    let first = (*rng as usize % (blocks - per_req + 1)) / per_req * per_req;
    *tag += 1;
    loop {
        match pool.get(*tag, (first * BLOCK) as u64, per_req) {
            Ok(c) => return (first, c),
            Err(Error::LimitReached { .. }) => {
                totals.pool_waits.fetch_add(1, Ordering::Relaxed);
                std::thread::yield_now();
            }
            Err(e) => panic!("command pool: {e}"),
        }
    }
}

impl Totals {
    /// Books a request of `bytes` read through `segments` iovecs; every
    /// 64th, its physical segments too (`phys`: pagemap, root only).
    fn done(&self, bytes: usize, segments: usize, tag: u64, phys: impl FnOnce() -> Result<usize, Error>) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.segments.fetch_add(segments as u64, Ordering::Relaxed);
        if tag.is_multiple_of(64) {
            match phys() {
                Ok(p) => {
                    self.phys_sampled.fetch_add(1, Ordering::Relaxed);
                    self.phys_segments.fetch_add(p as u64, Ordering::Relaxed);
                }
                Err(_) => self.phys_unavailable.store(true, Ordering::Relaxed),
            }
        }
    }
}

#[derive(Default)]
struct Totals {
    requests: AtomicU64,
    bytes: AtomicU64,
    segments: AtomicU64,
    phys_segments: AtomicU64,
    phys_sampled: AtomicU64,
    phys_unavailable: AtomicBool,
    pool_waits: AtomicU64,
    /// io_uring engines: regions registered and bytes pinned, all rings.
    regions: AtomicU64,
    pinned: AtomicU64,
}

fn main() {
    let args = parse_args();
    let topo = Topology::global();
    #[cfg(feature = "io-uring")]
    if args.recv {
        return net::run(&args);
    }
    std::fs::create_dir_all(&args.dir).expect("scratch directory");
    let path = args.dir.join(format!("numaweave-io_path-{}.dat", std::process::id()));
    let blocks = args.file_mib * 1024 * 1024 / BLOCK;
    write_scratch(&path, blocks).expect("writing the scratch file");

    // The device and its node.
    let found = topo.block_device_of(&path).expect("stat of the scratch file");
    let device = args.device.clone().or(found.clone());
    let node = match &device {
        Some(d) => match topo.device_node(d) {
            Ok(n) => n,
            Err(e) => {
                eprintln!("io_path: {e}");
                std::process::exit(1);
            }
        },
        None => None,
    };
    println!(
        "scratch file {} ({} MiB) on {}{}",
        path.display(),
        args.file_mib,
        found.as_deref().unwrap_or("no block device"),
        match (&args.device, &device) {
            (Some(d), _) => format!("; device given: {d}"),
            _ => String::new(),
        }
    );
    match node {
        Some(n) => println!("device node: {n}: caches placed there"),
        None => println!("device node: none reported (NUMA_NO_NODE or one-node machine): caches local to each thread"),
    }

    let threads = if args.threads > 0 {
        args.threads
    } else {
        let near = node.map(|n| topo.cpus_of(n).len()).unwrap_or(0);
        near.max(std::thread::available_parallelism().map_or(2, |n| n.get()).min(4)).max(2)
    };
    let per_req = args.request_kib * 1024 / BLOCK;
    // A queue depth per thread, as a driver's tag set: commands and sense
    // buffers are limited to it (per node), data buffers to what it needs.
    let depth = 8 * threads;
    let home = node.map_or(Home::Local, Home::Node);
    let pool = Arc::new(CommandPool {
        cmds: SlabCache::<Command>::builder("io_cmd").hwcache_align().home(home).limit(depth).build().unwrap(),
        senses: SlabCache::<[u8; SENSE]>::builder("io_sense").home(home).limit(depth).build().unwrap(),
    });
    let data = Arc::new(
        DmaPool::builder("io_data_4k", BLOCK).home(home).limit(depth * per_req + 64 * threads).build().unwrap(),
    );

    let (file, direct) = open_direct(&path).expect("opening the scratch file");
    let file = Arc::new(file);
    let totals = Arc::new(Totals::default());
    let stop = Arc::new(AtomicBool::new(false));
    let how = match args.engine {
        Engine::Preadv => format!("{per_req} × 4 KiB slab buffers, preadv"),
        Engine::Fixed => "one registered buffer each, io_uring READ_FIXED".to_owned(),
        Engine::Plain => "one buffer each, io_uring READ (not fixed)".to_owned(),
    };
    println!(
        "{threads} threads, {} KiB requests ({how}), {}",
        args.request_kib,
        if direct { "O_DIRECT" } else { "buffered" }
    );

    let start = Instant::now();
    let mut workers = Vec::new();
    for t in 0..threads {
        let (pool, data, file, totals, stop) = (pool.clone(), data.clone(), file.clone(), totals.clone(), stop.clone());
        let engine = args.engine;
        workers.push(std::thread::spawn(move || {
            if engine != Engine::Preadv {
                #[cfg(feature = "io-uring")]
                uring_worker(t, engine, node, &pool, &file, blocks, per_req, &totals, &stop);
                return;
            }
            let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1);
            let mut bufs = vec![std::ptr::null_mut(); per_req];
            let mut iov = Vec::with_capacity(per_req);
            let mut tag = (t as u64) << 48;
            while !stop.load(Ordering::Relaxed) {
                let (first, mut cmd) = next_request(&mut rng, &mut tag, blocks, per_req, &pool, &totals);
                data.alloc_bulk(&mut bufs).expect("data buffers");
                let nn: Vec<NonNull<u8>> = bufs.iter().map(|&p| NonNull::new(p).unwrap()).collect();
                merge(&nn, &mut iov);
                // SAFETY: every iovec covers slab buffers we own, sized and
                // aligned for O_DIRECT (4 KiB).
                let n = unsafe {
                    libc::preadv(file.as_raw_fd(), iov.as_ptr(), iov.len() as i32, cmd.offset as libc::off_t)
                };
                cmd.status = n as i64;
                if n as usize != cmd.blocks * BLOCK {
                    let sense = cmd.sense.as_mut().unwrap();
                    sense[0] = 0x70; // fixed-format sense: current error
                    panic!(
                        "tag {:#x}: short read {n} at {} ({:?})",
                        cmd.tag,
                        cmd.offset,
                        std::io::Error::last_os_error()
                    );
                }
                for (j, b) in nn.iter().enumerate() {
                    let want = (first + j) as u64;
                    // SAFETY: a 4 KiB buffer just filled by the read.
                    let got = unsafe { b.as_ptr().cast::<u64>().read() };
                    assert_eq!(got, want, "block {want} read into the wrong buffer");
                }
                totals.done(per_req * BLOCK, iov.len(), tag, || {
                    iov.iter().map(|v| phys_segments(v.iov_base.cast::<u8>().cast_const(), v.iov_len)).sum()
                });
                // Freed last-first: the magazine hands them back in address
                // order next time, so the next request merges the same way.
                let rev: Vec<NonNull<u8>> = nn.into_iter().rev().collect();
                // SAFETY: the request's buffers, each freed once.
                unsafe { data.free_bulk(&rev) };
                drop(cmd);
            }
        }));
    }
    std::thread::sleep(Duration::from_secs_f64(args.seconds));
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    let reqs = totals.requests.load(Ordering::Relaxed);
    let mib = totals.bytes.load(Ordering::Relaxed) as f64 / (1 << 20) as f64;
    let segs = totals.segments.load(Ordering::Relaxed) as f64 / reqs.max(1) as f64;
    println!(
        "{reqs} requests in {secs:.2} s: {:.0} IOPS, {:.1} MiB/s, {segs:.2} segments per request ({} each), {} waits for a command",
        reqs as f64 / secs,
        mib / secs,
        if args.engine == Engine::Preadv { format!("{per_req} buffers") } else { "one buffer".to_owned() },
        totals.pool_waits.load(Ordering::Relaxed)
    );
    let sampled = totals.phys_sampled.load(Ordering::Relaxed);
    if sampled > 0 {
        println!(
            "physical segments per request: {:.2} ({sampled} requests sampled; pages behind the buffers, from /proc/self/pagemap)",
            totals.phys_segments.load(Ordering::Relaxed) as f64 / sampled as f64
        );
    } else if totals.phys_unavailable.load(Ordering::Relaxed) {
        println!("physical segments per request: unavailable (page frame numbers need root)");
    }
    if args.engine != Engine::Preadv {
        println!(
            "io_uring: {} region(s) registered, {:.1} MiB pinned (all rings, at the end)",
            totals.regions.load(Ordering::Relaxed),
            totals.pinned.load(Ordering::Relaxed) as f64 / (1 << 20) as f64
        );
    }
    println!("\n{}", slabinfo());
    let _ = std::fs::remove_file(&path);
}

/// One worker of the io_uring engines: a ring on the device's node (this
/// thread's where it has none), one buffer of the request's size per
/// request, read with `READ_FIXED` (its registered slot) or plain `READ`,
/// every block checked.
#[cfg(feature = "io-uring")]
#[allow(clippy::too_many_arguments)]
fn uring_worker(
    t: usize,
    engine: Engine,
    node: Option<usize>,
    pool: &CommandPool,
    file: &File,
    blocks: usize,
    per_req: usize,
    totals: &Totals,
    stop: &AtomicBool,
) {
    use io_uring::{opcode, types};
    use numaweave::io::uring::NodeRing;

    let len = per_req * BLOCK;
    let node = node.unwrap_or_else(|| Topology::global().current_node());
    let ring = NodeRing::new(node, len, 8).unwrap_or_else(|e| panic!("io_uring on node {node}: {e}"));
    let fd = types::Fd(file.as_raw_fd());
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ (t as u64 + 1);
    let mut tag = (t as u64) << 48;
    while !stop.load(Ordering::Relaxed) {
        let (first, cmd) = next_request(&mut rng, &mut tag, blocks, per_req, pool, totals);
        let mut buf = ring.alloc().unwrap_or_else(|e| {
            // MemlockLimit says the limit and how to raise it.
            eprintln!("io_path: a registered data buffer on node {node}: {e}");
            std::process::exit(1)
        });
        let p = buf.as_mut_ptr();
        let sqe = match engine {
            Engine::Fixed => opcode::ReadFixed::new(fd, p, len as u32, buf.index()).offset(cmd.offset).build(),
            _ => opcode::Read::new(fd, p, len as u32).offset(cmd.offset).build(),
        };
        // SAFETY: the buffer and the file outlive the request.
        let n = unsafe { ring.run_one(&sqe) }.expect("io_uring");
        assert_eq!(n, len as i32, "tag {:#x}: read of {len} at {} gave {n}", cmd.tag, cmd.offset);
        for (j, b) in buf.chunks(BLOCK).enumerate() {
            let want = (first + j) as u64;
            assert_eq!(u64::from_le_bytes(b[..8].try_into().unwrap()), want, "block {want} read wrong");
        }
        totals.done(len, 1, tag, || phys_segments(p.cast_const(), len));
    }
    totals.regions.fetch_add(ring.pool().stats().total().registered_regions as u64, Ordering::Relaxed);
    totals.pinned.fetch_add(ring.pinned(), Ordering::Relaxed);
}

/// The network leg (`--uring --recv`): loopback TCP received with `recv(2)`
/// and through a provided-buffer ring, every byte verified.
#[cfg(feature = "io-uring")]
mod net {
    use std::io::{Read as _, Write as _};
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::os::fd::AsRawFd as _;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    use numaweave::io::uring::NodeRing;
    use numaweave::slab::DmaPool;
    use numaweave::topology::Topology;

    /// The stream's period: a prime, so that no buffer size lines up with it.
    const PERIOD: usize = 65_521;

    /// What one receiver did.
    struct Leg {
        bytes: u64,
        receives: u64,
        secs: f64,
    }

    /// A connected pair and a sender streaming the pattern until `stop`.
    fn connect(stop: Arc<AtomicBool>, table: Arc<Vec<u8>>) -> (TcpStream, std::thread::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback listener");
        let addr = listener.local_addr().unwrap();
        let sender = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).expect("connect over loopback");
            let mut at = 0;
            while !stop.load(Ordering::Relaxed) {
                // 64 KiB a write, continuing the pattern where it stopped.
                s.write_all(&table[at..at + 65_536]).expect("send");
                at = (at + 65_536) % PERIOD;
            }
            s.shutdown(Shutdown::Write).unwrap();
        });
        (listener.accept().expect("accept").0, sender)
    }

    /// Checks `got` against the pattern from stream offset `at`.
    fn verify(table: &[u8], at: u64, got: &[u8]) {
        let i = (at % PERIOD as u64) as usize;
        assert!(got == &table[i..i + got.len()], "stream bytes at {at} received wrong");
    }

    /// Receives until `seconds` pass, then until the sender's end; `recv`
    /// returns the bytes of one receive, verified, 0 at the end.
    fn leg(seconds: f64, table: &Arc<Vec<u8>>, mut recv: impl FnMut(&TcpStream, u64) -> usize) -> Leg {
        let stop = Arc::new(AtomicBool::new(false));
        let (rx, sender) = connect(stop.clone(), table.clone());
        let (t0, mut bytes, mut receives) = (Instant::now(), 0u64, 0u64);
        let deadline = t0 + Duration::from_secs_f64(seconds);
        loop {
            let n = recv(&rx, bytes);
            if n == 0 {
                break;
            }
            bytes += n as u64;
            receives += 1;
            if receives.is_multiple_of(256) && Instant::now() >= deadline {
                stop.store(true, Ordering::Relaxed);
            }
        }
        sender.join().unwrap();
        Leg { bytes, receives, secs: t0.elapsed().as_secs_f64() }
    }

    pub(super) fn run(args: &super::Args) {
        let len = args.request_kib * 1024;
        let node = Topology::global().current_node();
        // The pattern, long enough that any offset has a whole 64 KiB write
        // or a whole buffer after it.
        let table: Arc<Vec<u8>> =
            Arc::new((0..PERIOD + len.max(65_536)).map(|k| ((k % PERIOD) as u8).wrapping_mul(31) ^ 0x5a).collect());
        println!("loopback TCP, {} KiB receives, buffers on node {node}, {} s a leg", args.request_kib, args.seconds);

        let pool = DmaPool::builder("net_rx", len).node(node).build().expect("a pool on the node");
        let mut buf = pool.alloc().expect("a receive buffer");
        let plain = leg(args.seconds, &table, |rx, at| {
            let n = (&*rx).read(&mut buf).expect("recv");
            verify(&table, at, &buf[..n]);
            n
        });
        drop(buf);

        let ring = NodeRing::new(node, len, 64).unwrap_or_else(|e| panic!("io_uring on node {node}: {e}"));
        let group = ring.buf_ring(0, 16).unwrap_or_else(|e| {
            eprintln!("io_path: a provided-buffer ring: {e}");
            std::process::exit(1)
        });
        let mut bids = std::collections::HashSet::new();
        let ringed = leg(args.seconds, &table, |rx, at| {
            // SAFETY: the socket outlives the request; the ring selects the buffer.
            let cqe = unsafe { ring.run_one_entry(&group.recv(rx.as_raw_fd())) }.expect("io_uring");
            let Some(b) = group.take(&cqe).expect("recv with a provided buffer") else { return 0 };
            verify(&table, at, &b);
            bids.insert(b.bid());
            b.len() // `b` goes back into the ring here
        });
        assert_eq!(group.available(), usize::from(group.entries()), "every buffer back in the ring");

        let mib = |l: &Leg| l.bytes as f64 / l.secs / (1 << 20) as f64;
        for (name, l) in [("recv(2) into a pool buffer", &plain), ("io_uring RECV, provided-buffer ring", &ringed)] {
            println!(
                "{name:<37} {:>9.0} MiB/s  {:>8} receives  {:>6.1} KiB each  {} MiB verified",
                mib(l),
                l.receives,
                l.bytes as f64 / l.receives.max(1) as f64 / 1024.0,
                l.bytes >> 20
            );
        }
        println!(
            "buffer ring: {} buffers of {} KiB on node {node}, {} of them used, every one back; uring / recv(2) = {:.2}",
            group.entries(),
            len / 1024,
            bids.len(),
            mib(&ringed) / mib(&plain)
        );
    }
}
