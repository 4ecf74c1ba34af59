//! Every failure path run (`--features failpoints`, with `io-uring` for the
//! ring's registration): the OS layer refuses its Nth call of one kind
//! (`os::failpoint`), for each kind and each N a clean run of the workload
//! reaches, and the workload checks what a user relies on. SQLite's anomaly
//! testing, on the allocator: each point failed in turn, once and from
//! there on, then the OS says yes again and service must be normal.
//!
//! The workload, each operation inside the failpoints' scope (the test's
//! own bookkeeping is never refused): blocks of every size class, huge and
//! zeroed ones, grown and shrunk with `realloc`, freed by their thread and
//! by another; a slab pool's objects one by one and in bulk; its
//! migration and a demotion's steps; `trim`; a `fork` whose child
//! allocates, frees and exits; an io_uring ring's registered buffers.
//!
//! What it checks: no crash (the test would die), no hang (a watchdog), no
//! lost or doubled object (every live block and object keeps the pattern
//! written into it, and no two overlap), zeroed memory is zero, a refusal
//! surfaces as null or a typed error where the API promises one, and once
//! nothing is refused every operation succeeds.
//!
//! `FAILPOINTS_FULL=1` sweeps every N (the default spaces at most 48 per
//! kind); the figures printed go to `docs/testing.md`. Refusals that need
//! pages on another node to move (a full target node, pinned pages retried)
//! are checked in the multi-node guest (`tests/multinode/migrate.rs`).
#![cfg(feature = "failpoints")]

use std::alloc::{GlobalAlloc, Layout};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use numaweave::os::failpoint::{self, Call};
use numaweave::slab::{Demotion, RawCache};
use numaweave::{Error, NumaAlloc, Topology};

mod support;
use support::Rng;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

/// The sweep and the tests below refuse process-wide counts: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// What one run of the workload met.
#[derive(Default, Debug)]
struct Met {
    /// Allocations that returned null.
    nulls: u64,
    /// Typed errors, by name.
    errors: Vec<String>,
}

impl Met {
    fn clean(&self) -> bool {
        self.nulls == 0 && self.errors.is_empty()
    }
    fn error(&mut self, what: &str, e: &Error) {
        if self.errors.len() < 16 {
            self.errors.push(format!("{what}: {e}"));
        }
    }
}

/// A block of the workload: its address, layout and the byte it holds.
#[derive(Clone, Copy)]
struct Block {
    at: usize,
    layout: Layout,
    byte: u8,
}

impl Block {
    /// Fills the block with its byte.
    fn fill(&self) {
        // SAFETY: a live block of `layout.size()` bytes, ours.
        unsafe { (self.at as *mut u8).write_bytes(self.byte, self.layout.size()) };
    }

    /// Its bytes are its byte (the first, last and some in between: a
    /// block of megabytes is not read whole every round).
    fn check(&self, what: &str) {
        let n = self.layout.size();
        let step = (n / 61).max(1);
        for i in (0..n).step_by(step).chain([n - 1]) {
            // SAFETY: inside the live block.
            let b = unsafe { *(self.at as *const u8).add(i) };
            assert_eq!(b, self.byte, "{what}: block {:#x} ({} bytes) byte {i} changed", self.at, n);
        }
    }
}

/// No two blocks overlap.
fn disjoint(blocks: &mut [Block], what: &str) {
    blocks.sort_unstable_by_key(|b| b.at);
    for w in blocks.windows(2) {
        assert!(w[0].at + w[0].layout.size() <= w[1].at, "{what}: blocks {:#x} and {:#x} overlap", w[0].at, w[1].at);
    }
}

/// Sizes across the classes, a few huge ones, alignments up to 64 KiB.
fn layout(r: &mut Rng) -> Layout {
    let size = match r.below(10) {
        0..=4 => 1 + r.below(512) as usize,
        5..=7 => 512 + r.below(64 << 10) as usize,
        8 => (64 << 10) + r.below(256 << 10) as usize,
        _ => (1 << 20) + r.below(3 << 20) as usize,
    };
    let align = [8, 16, 64, 4096, 65536][r.below(5) as usize];
    Layout::from_size_align(size, align).unwrap()
}

/// One thread's blocks: allocated (some zeroed, checked zero), filled,
/// some grown or shrunk with `realloc` (contents kept), half freed; the
/// rest handed to `out` for another thread to check and free.
fn blocks(seed: u64, out: &Mutex<Vec<Block>>, met: &mut Met) {
    let mut r = Rng(seed | 1);
    let mut mine: Vec<Block> = Vec::with_capacity(256);
    failpoint::scope(|| {
        for i in 0..160 {
            let l = layout(&mut r);
            let zeroed = i % 5 == 0;
            // SAFETY: a nonzero size, a power-of-two alignment.
            let p = unsafe { if zeroed { A.alloc_zeroed(l) } else { A.alloc(l) } };
            if p.is_null() {
                met.nulls += 1;
                continue;
            }
            if zeroed {
                let b = Block { at: p as usize, layout: l, byte: 0 };
                b.check("alloc_zeroed");
            }
            let b = Block { at: p as usize, layout: l, byte: (seed as u8).wrapping_add(i as u8) | 1 };
            b.fill();
            mine.push(b);
        }
        // Grown and shrunk: the old contents kept (the part both sizes hold).
        for b in mine.iter_mut().step_by(3) {
            let new = if r.below(2) == 0 { b.layout.size() * 2 + 100 } else { b.layout.size() / 2 + 1 };
            // SAFETY: a live block of this allocator with its layout.
            let q = unsafe { A.realloc(b.at as *mut u8, b.layout, new) };
            if q.is_null() {
                met.nulls += 1;
                continue;
            }
            let kept = Block {
                at: q as usize,
                layout: Layout::from_size_align(new.min(b.layout.size()), b.layout.align()).unwrap(),
                byte: b.byte,
            };
            kept.check("realloc");
            *b =
                Block { at: q as usize, layout: Layout::from_size_align(new, b.layout.align()).unwrap(), byte: b.byte };
            b.fill();
        }
        for b in &mine {
            b.check("before the frees");
        }
        disjoint(&mut mine, "one thread's blocks");
        // (Vectors reserved outside: nothing of the test's own is refused.)
        let half = mine.len() / 2;
        let mut o = out.lock().unwrap();
        assert!(o.len() + mine.len() - half <= o.capacity(), "bookkeeping would allocate");
        o.extend(mine.drain(half..));
        drop(o);
        for b in mine.drain(..) {
            // SAFETY: a live block with its layout, freed once.
            unsafe { A.dealloc(b.at as *mut u8, b.layout) };
        }
    });
}

/// The other thread's blocks, checked and freed here (remote frees).
fn free_others(blocks: &Mutex<Vec<Block>>) {
    let mut b = blocks.lock().unwrap();
    disjoint(&mut b, "both threads' blocks");
    failpoint::scope(|| {
        for x in b.drain(..) {
            x.check("freed by another thread");
            // SAFETY: a live block with its layout, freed once.
            unsafe { A.dealloc(x.at as *mut u8, x.layout) };
        }
    });
}

const OBJ: usize = 4096;

/// The slab pool: objects one by one and in bulk, filled and checked;
/// a migration and a demotion's steps while they live; all freed.
fn slabs(pool: &RawCache, met: &mut Met, objs: &mut Vec<(usize, u8)>) {
    let node = Topology::global().default_node();
    failpoint::scope(|| {
        for i in 0..96u8 {
            match pool.alloc() {
                Ok(p) => {
                    // SAFETY: a fresh object of OBJ bytes.
                    unsafe { p.as_ptr().write_bytes(i | 1, OBJ) };
                    objs.push((p.as_ptr() as usize, i | 1));
                }
                Err(e) => met.error("slab alloc", &e),
            }
        }
        let mut bulk = [core::ptr::null_mut::<u8>(); 32];
        match pool.alloc_bulk(&mut bulk) {
            Ok(()) => {
                for p in bulk {
                    // SAFETY: a fresh object of OBJ bytes.
                    unsafe { p.write_bytes(0x5a, OBJ) };
                    objs.push((p as usize, 0x5a));
                }
            }
            Err(e) => {
                met.error("slab alloc_bulk", &e);
                assert!(bulk.iter().all(|p| p.is_null()), "a failed bulk allocation handed out objects");
            }
        }
        match pool.migrate(node) {
            Ok(m) => assert_eq!(m.to, node),
            Err(e) => met.error("migrate", &e),
        }
        // A demotion (always true: it starts, and its steps run on the
        // slow paths below), then none.
        pool.demote_when(Some(Demotion::when_free_below(node, u64::MAX).to(node).every(Duration::ZERO))).unwrap();
        for _ in 0..4 {
            let mut more = [core::ptr::null_mut::<u8>(); 24];
            if pool.alloc_bulk(&mut more).is_ok() {
                let more = more.map(|p| NonNull::new(p).unwrap());
                // SAFETY: objects of this pool, freed once.
                unsafe { pool.free_bulk(&more) };
            }
        }
        pool.demote_when(None).unwrap();
        for &(a, byte) in objs.iter() {
            // SAFETY: a live object of OBJ bytes.
            let s = unsafe { core::slice::from_raw_parts(a as *const u8, OBJ) };
            assert!(s[0] == byte && s[OBJ - 1] == byte && s[OBJ / 2] == byte, "slab object {a:#x} changed");
        }
        for (a, _) in objs.drain(..) {
            // SAFETY: objects of this pool, each freed once.
            unsafe { pool.free(NonNull::new(a as *mut u8).unwrap()) };
        }
    });
}

/// A child that allocates, checks and frees, and exits; the parent waits
/// for it (a hang fails the test).
fn fork_child() -> bool {
    // SAFETY: the child only allocates through the allocator and exits
    // with `_exit` (no destructor, no stdio).
    let pid = failpoint::scope(|| unsafe { libc::fork() });
    if pid == 0 {
        let mut ok = true;
        let l = Layout::from_size_align(3000, 16).unwrap();
        for i in 0..200u8 {
            // SAFETY: a nonzero size.
            let p = unsafe { A.alloc(l) };
            if p.is_null() {
                continue;
            }
            // SAFETY: a fresh block of 3000 bytes.
            unsafe {
                p.write_bytes(i, 3000);
                ok &= *p.add(2999) == i;
                A.dealloc(p, l);
            }
        }
        A.trim();
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(if ok { 0 } else { 3 }) };
    }
    if pid < 0 {
        return false;
    }
    let start = Instant::now();
    loop {
        let mut st = 0;
        // SAFETY: our child.
        let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
        if r == pid {
            assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "the forked child failed: status {st:#x}");
            return true;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "the forked child hangs");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A ring's registered buffers, each in a registered slot.
#[cfg(feature = "io-uring")]
fn ring(met: &mut Met) {
    use numaweave::io::uring::NodeRing;
    failpoint::scope(|| {
        let node = Topology::global().current_node();
        let r = match NodeRing::new(node, 64 << 10, 8) {
            Ok(r) => r,
            Err(e) => return met.error("NodeRing::new", &e),
        };
        // (No vector: this runs where allocations may be refused.)
        let mut bufs: [Option<_>; 48] = std::array::from_fn(|_| None);
        for slot in &mut bufs {
            match r.alloc() {
                Ok(b) => *slot = Some(b),
                Err(e) => met.error("NodeRing::alloc", &e),
            }
        }
        for b in bufs.iter().flatten() {
            assert!(usize::from(b.index()) < 1024);
        }
    });
}

#[cfg(not(feature = "io-uring"))]
fn ring(_: &mut Met) {}

/// One run of the whole workload.
fn workload(pool: &RawCache, seed: u64) -> Met {
    let mut met = Met::default();
    let handed = Mutex::new(Vec::with_capacity(512));
    let mut m2 = Met::default();
    std::thread::scope(|s| {
        let t = s.spawn(|| {
            let mut m = Met::default();
            blocks(seed ^ 0xabcd, &handed, &mut m);
            m
        });
        blocks(seed, &handed, &mut m2);
        let m = t.join().unwrap();
        met.nulls += m.nulls;
        met.errors.extend(m.errors);
    });
    met.nulls += m2.nulls;
    met.errors.extend(m2.errors);
    // Freed by a thread that did not allocate them.
    std::thread::scope(|s| {
        s.spawn(|| free_others(&handed));
    });
    let mut objs = Vec::with_capacity(256);
    slabs(pool, &mut met, &mut objs);
    failpoint::scope(|| A.trim());
    assert!(fork_child(), "fork failed");
    ring(&mut met);
    met
}

/// Fails the test if a run takes longer than a minute: a hang.
struct Watchdog(Arc<AtomicU64>, Arc<AtomicBool>);

impl Watchdog {
    fn start() -> Watchdog {
        let (beat, stop) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let (b, s) = (beat.clone(), stop.clone());
        std::thread::spawn(move || {
            let (mut last, mut since) = (0, Instant::now());
            while !s.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                let now = b.load(Ordering::Relaxed);
                if now != last {
                    (last, since) = (now, Instant::now());
                } else if since.elapsed() > Duration::from_secs(60) {
                    eprintln!("failpoints: a run has not finished for a minute: a hang");
                    std::process::abort();
                }
            }
        });
        Watchdog(beat, stop)
    }
    fn beat(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.1.store(true, Ordering::Relaxed);
    }
}

#[test]
fn every_refusal_of_every_kind_is_survived_and_service_comes_back() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let full = std::env::var_os("FAILPOINTS_FULL").is_some();
    let pool = RawCache::builder("failpoints", OBJ).magazine(8).build().unwrap();
    let dog = Watchdog::start();
    // A clean run: what each kind's calls number.
    failpoint::disarm();
    assert!(workload(&pool, 1).clean(), "the workload fails with nothing refused");
    failpoint::disarm();
    let clean = workload(&pool, 1);
    assert!(clean.clean());
    let calls: Vec<(Call, u64)> = Call::ALL.iter().map(|&c| (c, failpoint::counts(c).seen)).collect();
    println!("calls of a clean run: {calls:?}");
    let (mut points, mut reached, mut nulls, mut errors) = (0u64, 0u64, 0u64, 0u64);
    let mut by_kind = Vec::new();
    for &(call, n) in &calls {
        let (mut kind_reached, mut kind_points) = (0, 0);
        let step = if full || n <= 48 { 1 } else { n.div_ceil(48) };
        for nth in (1..=n.max(1)).step_by(step as usize) {
            for times in [1, u64::MAX] {
                points += 1;
                kind_points += 1;
                failpoint::arm(call, nth, times);
                let met = workload(&pool, nth * 31 + times.min(2));
                let refused = failpoint::counts(call).refused;
                failpoint::disarm();
                dog.beat();
                if refused > 0 {
                    reached += 1;
                    kind_reached += 1;
                }
                nulls += met.nulls;
                errors += met.errors.len() as u64;
                // The OS says yes again: everything works.
                let after = workload(&pool, nth * 17 + 5);
                assert!(after.clean(), "{call:?} #{nth} (x{times}) refused, then nothing: {after:?}");
                dog.beat();
            }
        }
        by_kind.push(format!("{}: {kind_reached}/{kind_points}", call.name()));
    }
    println!(
        "failpoints: {reached} of {points} points refused a call ({}); {nulls} nulls and {errors} typed errors \
         reached the workload, every run survived, every run after served in full",
        by_kind.join(", ")
    );
    assert!(reached * 2 >= points, "the sweep reached only {reached} of {points} points");
}

#[test]
fn an_unreadable_free_memory_is_not_low() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let node = Topology::global().default_node();
    let pool = RawCache::builder("unreadable", OBJ).magazine(4).build().unwrap();
    pool.demote_when(Some(Demotion::when_free_below(node, u64::MAX).to(node).every(Duration::ZERO))).unwrap();
    failpoint::arm(Call::Open, 1, u64::MAX);
    failpoint::scope(|| {
        for _ in 0..20 {
            let more: Vec<_> = (0..16).map(|_| pool.alloc().unwrap()).collect();
            for p in more {
                // SAFETY: objects of this pool, freed once.
                unsafe { pool.free(p) };
            }
        }
    });
    let refused = failpoint::counts(Call::Open).refused;
    failpoint::disarm();
    assert!(refused > 0, "the free memory was never read");
    assert_eq!(pool.stats().demotions, 0, "an unreadable free memory counted as low");
}

/// A forked child makes its own chunk table at its first new chunk (the
/// parent's is not its to write); with `memfd_create` refused there, its
/// caches grow and serve as before, only unpublished. (The sweep cannot
/// reach this: a process makes its table once, before the sweep starts.)
#[test]
fn a_child_whose_table_cannot_be_made_serves_on() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let pool = RawCache::builder("no-table", OBJ).magazine(4).build().unwrap();
    let p = pool.alloc().unwrap();
    // SAFETY: an object of this pool, freed once.
    unsafe { pool.free(p) };
    failpoint::arm(Call::Memfd, 1, u64::MAX);
    // SAFETY: the child allocates through the allocator and the pool only,
    // and ends with `_exit` (no destructor, no stdio).
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let ok = failpoint::scope(|| {
            // 16 MiB of objects: new chunks past what the parent left.
            let objs: Vec<_> = (0..4096u32).map(|i| (pool.alloc(), i as u8)).collect();
            let mut ok = true;
            for (o, byte) in &objs {
                match o {
                    // SAFETY: a fresh object of OBJ bytes.
                    Ok(p) => unsafe { p.as_ptr().write_bytes(*byte, OBJ) },
                    Err(_) => ok = false,
                }
            }
            for (o, byte) in objs {
                let p = o.unwrap_or(NonNull::dangling());
                if ok {
                    // SAFETY: a live object of OBJ bytes, freed once below.
                    let s = unsafe { core::slice::from_raw_parts(p.as_ptr(), OBJ) };
                    ok &= s[0] == byte && s[OBJ - 1] == byte;
                    // SAFETY: as above.
                    unsafe { pool.free(p) };
                }
            }
            ok
        });
        let refused = failpoint::counts(Call::Memfd).refused;
        // SAFETY: ends the child at once.
        unsafe {
            libc::_exit(if !ok {
                3
            } else if refused == 0 {
                4
            } else {
                0
            })
        };
    }
    failpoint::disarm();
    assert!(pid > 0, "fork failed");
    let mut st = 0;
    // SAFETY: our child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
    assert!(libc::WIFEXITED(st), "the child died: status {st:#x}");
    match libc::WEXITSTATUS(st) {
        0 => {}
        3 => panic!("the child's objects failed or changed without a table"),
        4 => panic!("the child never asked for a table of its own"),
        s => panic!("the child exited {s}"),
    }
}

/// A process that publishes its classes (`NUMAWEAVE_PUBLISH=1`) whose
/// memory file the OS refuses: a forked child, whose first publication
/// makes a file of its own (its parent's is not its to write), is refused
/// it: reported once on stderr, tried no more, no table of its own, and
/// its blocks served and kept as ever. Runs as a child of the test
/// (publishing is chosen at start-up), whose trim before the fork makes
/// the parent's file.
#[test]
fn a_class_table_refused_is_reported_once_and_service_goes_on() {
    const NAME: &str = "a_class_table_refused_is_reported_once_and_service_goes_on";
    if std::env::var_os("FAILPOINTS_PUBLISH_CHILD").is_none() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--nocapture", "--test-threads", "1"])
            .env("NUMAWEAVE_PUBLISH", "1")
            .env("FAILPOINTS_PUBLISH_CHILD", "1")
            .output()
            .unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && stdout.contains("published nothing"), "{stdout}\n{stderr}");
        assert_eq!(stderr.matches("numaweave: NUMAWEAVE_PUBLISH: memfd_create").count(), 1, "{stderr}");
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let l = Layout::from_size_align(3000, 8).unwrap();
    A.trim();
    // SAFETY: the child allocates through the allocator only, and ends
    // with `_exit` (no destructor, no stdio of the parent's).
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        failpoint::arm(Call::Memfd, 1, u64::MAX);
        let kept = failpoint::scope(|| {
            // SAFETY: a valid layout; every block written, checked and freed below.
            let blocks: Vec<usize> = (0..1000).map(|_| unsafe { A.alloc(l) } as usize).collect();
            let mut kept = blocks.iter().all(|&b| b != 0);
            for (i, &b) in blocks.iter().enumerate().filter(|_| kept) {
                // SAFETY: a live block of 3000 bytes.
                unsafe { (b as *mut u8).write_bytes(i as u8, l.size()) };
            }
            A.trim();
            A.trim();
            kept = kept
                && blocks.iter().enumerate().all(|(i, &b)| {
                    // SAFETY: as above.
                    unsafe { std::slice::from_raw_parts(b as *const u8, l.size()) }.iter().all(|&x| x == i as u8)
                });
            for b in blocks.into_iter().filter(|&b| b != 0) {
                // SAFETY: allocated above with `l`, freed once.
                unsafe { A.dealloc(b as *mut u8, l) };
            }
            A.trim();
            kept
        });
        let c = failpoint::counts(Call::Memfd);
        // Tables of this process's own among its descriptors (its parent's
        // file is still open here, with its parent's pid).
        let me = std::process::id();
        let own = std::fs::read_dir("/proc/self/fd")
            .map(|d| {
                d.flatten()
                    .filter(|e| {
                        std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().contains("numaweave-classes"))
                    })
                    .filter(|e| numaweave::stats::class_table::read_file(&e.path()).is_ok_and(|t| t.pid == me))
                    .count()
            })
            .unwrap_or(usize::MAX);
        let code = match (kept, (c.seen, c.refused), own) {
            (false, ..) => 3,
            (_, (1, 1), 0) => 0,
            (_, (1, 1), _) => 4,
            _ => 5,
        };
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(code) };
    }
    assert!(pid > 0, "fork failed");
    let mut st = 0;
    // SAFETY: our child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
    assert!(libc::WIFEXITED(st), "the child died: status {st:#x}");
    match libc::WEXITSTATUS(st) {
        0 => println!("published nothing"),
        3 => panic!("the child's blocks failed or changed without a table"),
        4 => panic!("a table of the child's own without its file"),
        5 => panic!("the child asked for its file other than once"),
        s => panic!("the child exited {s}"),
    }
}

#[cfg(feature = "io-uring")]
/// A ring's region released for a move and refused when registered again:
/// its slot and its `RLIMIT_MEMLOCK` booking come back, and the next
/// buffer of it gets a slot of its own that fixed I/O can use (before: the
/// stale index, every fixed read or write `EFAULT`).
#[test]
fn a_ring_region_refused_after_a_move_is_registered_again_on_demand() {
    use numaweave::io::uring::{FixedBuffers, NodeRing};
    use std::io::{Seek, SeekFrom, Write};
    use std::os::fd::AsRawFd;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let node = Topology::global().current_node();
    let Ok(ring) = NodeRing::new(node, 4096, 8) else {
        support::cannot_run(format_args!("no io_uring here"));
        return;
    };
    let held: Vec<_> = (0..4).map(|_| ring.alloc().unwrap()).collect();
    let (pinned, in_process) = (ring.pinned(), FixedBuffers::pinned_in_process());
    assert!(pinned > 0);
    // Every registration refused: the move's release goes through (it
    // empties the slot), its registration again does not.
    failpoint::arm(Call::UringRegister, 1, u64::MAX);
    let m = failpoint::scope(|| ring.pool().migrate(node)).unwrap();
    failpoint::disarm();
    assert!(m.registrations_lost >= 1, "{m}");
    assert!(ring.pinned() < pinned, "the lost region's slot is still taken");
    assert!(FixedBuffers::pinned_in_process() < in_process, "its memlock booking leaked");
    drop(held);
    // The next buffer's region is registered again, in a slot that works.
    let mut buf = ring.alloc().unwrap();
    assert!(ring.pinned() > 0);
    let mut f = tempfile();
    f.write_all(&[0x42; 4096]).unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    let e = io_uring::opcode::ReadFixed::new(io_uring::types::Fd(f.as_raw_fd()), buf.as_mut_ptr(), 4096, buf.index())
        .build();
    // SAFETY: the buffer and file outlive the call.
    let n = unsafe { ring.run_one(&e) }.unwrap();
    assert_eq!(n, 4096, "READ_FIXED into the registered-again region: {n}");
    assert!(buf.iter().all(|&b| b == 0x42));
}

/// A ring region whose pages cannot be located once pinned (the node's
/// zones unreadable, so looked up; the lookup refused): a pool that
/// promises its node (the default) refuses the region, its registration
/// undone (the slot and the `RLIMIT_MEMLOCK` booking back); one built to
/// report keeps it, counting no page off the node. With the zones
/// unreadable and the lookup working, the region is looked up and kept.
#[cfg(feature = "io-uring")]
#[test]
fn a_ring_region_whose_pins_cannot_be_located_is_refused_or_kept_as_asked() {
    use numaweave::io::uring::{FixedBuffers, NodeRing};
    use numaweave::slab::OffNodePins;
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let node = Topology::global().current_node();
    let rings = [OffNodePins::Refuse, OffNodePins::Report].map(|p| NodeRing::with_pins(node, 4096, 8, p));
    let [Ok(refusing), Ok(reporting)] = rings else {
        support::cannot_run(format_args!("no io_uring here"));
        return;
    };
    let before = FixedBuffers::pinned_in_process();
    failpoint::arm(Call::Open, 1, u64::MAX);
    failpoint::arm_also(Call::PageQuery, 1, u64::MAX);
    let refused = failpoint::scope(|| refusing.alloc().map(drop));
    assert!(failpoint::counts(Call::PageQuery).refused >= 1, "the pages were not looked up");
    let kept = failpoint::scope(|| reporting.alloc());
    failpoint::disarm();
    match refused {
        Err(Error::Os { call: "move_pages(query)", .. }) => {}
        other => panic!("a region that could not be located was not refused: {other:?}"),
    }
    assert_eq!(refusing.pinned(), 0, "the refused region kept its slot");
    let kept = kept.expect("a reporting pool refused the region");
    assert!(reporting.pinned() > 0);
    assert_eq!(FixedBuffers::pinned_in_process() - before, reporting.pinned(), "a memlock booking leaked");
    assert_eq!(reporting.pool().cache().stats().total().pinned_off_node, 0);
    drop(kept);

    // Zones unreadable, lookup working: looked up, and on this machine's
    // node every page is where it belongs.
    failpoint::arm(Call::Open, 1, u64::MAX);
    let served = failpoint::scope(|| refusing.alloc());
    let looked = failpoint::counts(Call::PageQuery).seen;
    failpoint::disarm();
    let buf = served.expect("a region on its node refused");
    assert!(looked >= 1, "the pages were not looked up with the zones unreadable");
    assert!(refusing.pinned() > 0);
    assert_eq!(refusing.pool().cache().stats().total().pinned_off_node, 0);
    drop(buf);
}

#[cfg(feature = "io-uring")]
fn tempfile() -> std::fs::File {
    let path = std::env::temp_dir().join(format!("numaweave-failpoints-{}", std::process::id()));
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    f
}
