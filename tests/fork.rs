//! fork() while other threads are inside every slow path the crate has:
//! the child must be able to allocate, free, trim and migrate in all of
//! them, and exit. Without the `fork()` handlers a child forked while
//! another thread held a lock (an arena's, the lifecycle's, an interleave
//! handle's, the spare interleavers', a slab cache's, the registry of
//! caches) waits on it forever; a lock that is not held across fork (a
//! cache's migration lock) must be reset in the child.
//!
//! Workers, all at once: interleaved I/O buffers from a handle, small
//! blocks and page-aligned buffers under a thread interleave policy,
//! threads that start and exit (heaps and interleavers adopted and left),
//! slab objects past their magazines (depot and slab locks), caches made
//! and dropped (the registry), a limited cache's `alloc_wait`, blocks freed
//! by another thread; bursts freed and trimmed (the lifecycle's tick and
//! trim), huge blocks mapped and grown, a pool migrated over and over, a
//! pool demoted step by step, chunks mapped and unmapped (the published
//! table's edits), and with the `io-uring` feature rings registering their
//! buffers. The main thread forks `NUMAWEAVE_FORK_ROUNDS` times (1,000 by
//! default), counting the forks made while a worker was inside its slow
//! path; each child does a round of every kind of work, trims, migrates a
//! pool, and exits. Runs on any host (synthetic nodes or one) and, built
//! static, in the multi-node guest (`.ci/vm-tests`).

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use numaweave::policy::{Granularity, Interleave, Policy};
use numaweave::slab::{Demotion, RawCache, SlabCache};
use numaweave::topology::NodeSet;
use numaweave::{InterleaveHandle, NumaAlloc, Topology};

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

static STOP: AtomicBool = AtomicBool::new(false);

/// The slow paths a worker may be inside of when the main thread forks.
const PATHS: [&str; 6] =
    ["tick and trim", "huge mapping", "migration", "demotion", "published-table edit", "ring registration"];

/// Per path, whether a worker is inside it now.
static INSIDE: [AtomicBool; 6] = [const { AtomicBool::new(false) }; 6];

/// Runs `f` marked as inside path `i`.
fn inside<R>(i: usize, f: impl FnOnce() -> R) -> R {
    INSIDE[i].store(true, Ordering::Relaxed);
    let r = f();
    INSIDE[i].store(false, Ordering::Relaxed);
    r
}

/// The nodes to interleave over: every node this process may place on.
fn nodes() -> NodeSet {
    let t = Topology::global();
    t.memory_nodes().intersection(&t.allowed_nodes())
}

fn policy(g: Granularity) -> Interleave {
    Interleave::new(nodes(), g).unwrap()
}

/// What the workers and the children share.
struct Shared {
    handle: InterleaveHandle,
    cmds: SlabCache<[u64; 32]>,
    limited: SlabCache<[u8; 512]>,
    /// Migrated over and over by a worker; migrated by each child.
    moving: RawCache,
    /// Demoted step by step (a condition that always holds, to the node it
    /// is on: every pass's steps run on its slow paths).
    demoted: SlabCache<[u8; 4096]>,
    /// Large objects: chunks mapped and unmapped, each an edit of the
    /// published table.
    chunky: RawCache,
}

/// A burst freed, then trimmed: the lifecycle's tick (what the burst left
/// due) and its trim.
fn tick_and_trim(seed: usize) -> bool {
    let blocks: Vec<Vec<u8>> = (0..256).map(|i| vec![(seed + i) as u8; 1024 + (i * 97) % 20000]).collect();
    let ok = blocks.iter().enumerate().all(|(i, b)| b[b.len() - 1] == (seed + i) as u8);
    drop(blocks);
    if seed.is_multiple_of(4) {
        A.trim();
    }
    ok
}

/// Huge blocks mapped, grown with `realloc`, unmapped.
fn huge(seed: usize) -> bool {
    let l = Layout::from_size_align(1 << 20, 16).unwrap();
    // SAFETY: a valid layout; grown and freed below.
    unsafe {
        let p = A.alloc(l);
        if p.is_null() {
            return false;
        }
        p.write_bytes(seed as u8, 1 << 20);
        let q = A.realloc(p, l, 3 << 20);
        if q.is_null() {
            A.dealloc(p, l);
            return false;
        }
        let ok = *q.add((1 << 20) - 1) == seed as u8;
        A.dealloc(q, Layout::from_size_align(3 << 20, 16).unwrap());
        ok
    }
}

/// Objects of the pool a worker migrates, kept alive across its moves.
fn migrate(s: &Shared, seed: usize) -> bool {
    let node = Topology::global().default_node();
    let objs: Vec<_> = (0..64).map(|_| s.moving.alloc().unwrap()).collect();
    for (i, p) in objs.iter().enumerate() {
        // SAFETY: a fresh object of 4096 bytes.
        unsafe { p.as_ptr().write_bytes((seed + i) as u8, 4096) };
    }
    let m = s.moving.migrate(node);
    let ok = m.is_ok()
        && objs.iter().enumerate().all(|(i, p)| {
            // SAFETY: a live object, written above.
            unsafe { *p.as_ptr().add(4095) == (seed + i) as u8 }
        });
    for p in objs {
        // SAFETY: objects of this pool, each freed once.
        unsafe { s.moving.free(p) };
    }
    ok
}

/// The demoted pool's slow paths: a condition that always holds starts a
/// pass and takes its steps.
fn demote(s: &Shared, seed: usize) -> bool {
    let objs: Vec<_> = (0..24).map(|i| s.demoted.alloc([(seed + i) as u8; 4096]).unwrap()).collect();
    objs.iter().enumerate().all(|(i, o)| o[4095] == (seed + i) as u8)
}

/// Large objects: the pool's chunks mapped and, shrunk, unmapped.
fn chunks(s: &Shared, seed: usize) -> bool {
    let objs: Vec<_> = (0..16).map(|_| s.chunky.alloc().unwrap()).collect();
    for p in &objs {
        // SAFETY: a fresh object of 256 KiB.
        unsafe { p.as_ptr().write_bytes(seed as u8, 256 << 10) };
    }
    for p in objs {
        // SAFETY: objects of this pool, each freed once.
        unsafe { s.chunky.free(p) };
    }
    s.chunky.shrink();
    true
}

/// A ring made, its buffers registered, dropped.
#[cfg(feature = "io-uring")]
fn ring() -> bool {
    let node = Topology::global().current_node();
    match numaweave::io::uring::NodeRing::new(node, 4096, 4) {
        Ok(r) => (0..8).all(|_| r.alloc().is_ok()),
        // No io_uring here (the guest's kernel may lack it): nothing to fork in.
        Err(_) => true,
    }
}

#[cfg(not(feature = "io-uring"))]
fn ring() -> bool {
    true
}

/// A few 4–64 KiB I/O buffers from the handle, written and checked.
fn handle_buffers(s: &Shared, seed: usize) -> bool {
    let mut bufs = Vec::new();
    for i in 0..8 {
        let size = 4096 << ((seed + i) % 5);
        let mut b = allocator_api2::vec::Vec::<u8, _>::with_capacity_in(size, s.handle.clone());
        b.resize(size, (seed + i) as u8);
        bufs.push(b);
    }
    bufs.iter().enumerate().all(|(i, b)| b[b.len() - 1] == (seed + i) as u8)
}

/// Small blocks and page-aligned buffers under a thread interleave policy.
fn under_policy(seed: usize) -> bool {
    let layouts: Vec<Layout> = (0..24)
        .map(|i| if i % 3 == 0 { Layout::from_size_align(4096 << (i % 4), 4096) } else { Layout::array::<u64>(2 + i) })
        .map(Result::unwrap)
        .collect();
    let mut got = Vec::with_capacity(layouts.len());
    {
        let _g = numaweave::with_policy(Policy::Interleave(policy(Granularity::Bytes(64 << 10)))).unwrap();
        for &l in &layouts {
            // SAFETY: a valid layout; freed below with it.
            let p = unsafe { A.alloc(l) };
            if !p.is_null() {
                // SAFETY: a live block of `l.size()` bytes.
                unsafe { p.write_bytes(seed as u8, l.size()) };
            }
            got.push(p);
        }
    }
    let mut ok = true;
    for (p, l) in got.into_iter().zip(layouts) {
        ok &= !p.is_null();
        if !p.is_null() {
            // SAFETY: allocated above with `l`, written whole; freed once.
            unsafe {
                ok &= p.add(l.size() - 1).read() == seed as u8;
                A.dealloc(p, l);
            }
        }
    }
    ok
}

/// Slab objects past the magazines (two rounds each): the depot and the
/// slabs' lock; a cache made and dropped (the registry); `alloc_wait` on a
/// limited cache (its wake).
fn slab_work(s: &Shared, seed: usize) -> bool {
    let objs: Vec<_> = (0..64).map(|i| s.cmds.alloc([(seed + i) as u64; 32]).unwrap()).collect();
    let ok = objs.iter().enumerate().all(|(i, o)| o[31] == (seed + i) as u64);
    drop(objs);
    let scratch = SlabCache::<[u8; 200]>::builder("fork_scratch").magazine(1).build().unwrap();
    let a: Vec<_> = (0..16).map(|_| scratch.alloc([seed as u8; 200]).unwrap()).collect();
    drop(a);
    drop(scratch);
    let w = s.limited.alloc_wait([1; 512], Duration::from_millis(20));
    ok && w.is_ok_and(|b| b[511] == 1)
}

/// Runs `f` on a thread made with `pthread_create` and waits for it: a
/// forked child may not make a std thread, whose start takes std's own
/// locks (which have no fork handlers: a child of a threaded parent may
/// find one held), but a C program's child may make threads, and these
/// allocate, start a heap and leave it at exit.
fn on_new_thread(mut f: impl FnMut() -> bool) -> bool {
    extern "C" fn run(arg: *mut libc::c_void) -> *mut libc::c_void {
        // SAFETY: `arg` is the `&mut dyn FnMut` below, alive until joined.
        let f = unsafe { &mut *arg.cast::<&mut dyn FnMut() -> bool>() };
        if f() { core::ptr::null_mut() } else { core::ptr::dangling_mut() }
    }
    let mut f: &mut dyn FnMut() -> bool = &mut f;
    let mut t: libc::pthread_t = 0;
    let mut ret: *mut libc::c_void = core::ptr::null_mut();
    // SAFETY: `run` gets a pointer to `f`, which outlives the thread (joined
    // before returning); `f` does not panic across the C frame (it returns
    // its verdict).
    unsafe {
        assert_eq!(libc::pthread_create(&mut t, core::ptr::null(), run, (&raw mut f).cast()), 0);
        assert_eq!(libc::pthread_join(t, &mut ret), 0);
    }
    ret.is_null()
}

/// Blocks made here and freed by another thread (remote frees), which also
/// allocates under an interleave policy (its interleaver made and dropped).
fn cross_thread(seed: usize) -> bool {
    let mut blocks: Vec<Box<[u8]>> =
        (0..64).map(|i| 16 + (seed * 7 + i * 13) % 3000).map(|len| vec![len as u8; len].into_boxed_slice()).collect();
    on_new_thread(|| {
        let ok = blocks.iter().all(|b| b[b.len() - 1] == b.len() as u8);
        blocks.clear();
        ok && under_policy(seed)
    })
}

/// One round of every kind of work.
fn every_kind(s: &Shared, seed: usize) -> bool {
    handle_buffers(s, seed)
        && under_policy(seed)
        && slab_work(s, seed)
        && cross_thread(seed)
        && tick_and_trim(seed)
        && huge(seed)
        && demote(s, seed)
        && chunks(s, seed)
}

#[test]
fn children_forked_during_every_kind_of_allocation_can_allocate() {
    let rounds: usize = std::env::var("NUMAWEAVE_FORK_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let node = Topology::global().default_node();
    let shared: &'static Shared = Box::leak(Box::new(Shared {
        handle: A.interleave(policy(Granularity::Count(2))).unwrap(),
        cmds: SlabCache::builder("fork_cmds").magazine(2).build().unwrap(),
        limited: SlabCache::builder("fork_limited").limit(16).magazine(1).build().unwrap(),
        moving: RawCache::builder("fork_moving", 4096).build().unwrap(),
        demoted: SlabCache::builder("fork_demoted").magazine(2).build().unwrap(),
        chunky: RawCache::builder("fork_chunky", 256 << 10).magazine(1).build().unwrap(),
    }));
    shared.demoted.demote_when(Some(Demotion::when_free_below(node, u64::MAX).to(node).every(Duration::ZERO))).unwrap();
    const WORKERS: usize = 11;
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            std::thread::spawn(move || {
                let mut seed = w;
                while !STOP.load(Ordering::Relaxed) {
                    let ok = match w {
                        0 => handle_buffers(shared, seed),
                        1 => under_policy(seed),
                        // Threads that start, allocate under a policy and exit.
                        2 => on_new_thread(|| under_policy(seed)),
                        3 => slab_work(shared, seed),
                        4 => cross_thread(seed),
                        5 => inside(0, || tick_and_trim(seed)),
                        6 => inside(1, || huge(seed)),
                        7 => inside(2, || migrate(shared, seed)),
                        8 => inside(3, || demote(shared, seed)),
                        9 => inside(4, || chunks(shared, seed)),
                        _ => inside(5, ring),
                    };
                    assert!(ok, "worker {w} round {seed}");
                    seed += WORKERS;
                }
            })
        })
        .collect();
    let forks_inside: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];
    let started = Instant::now();
    for round in 0..rounds {
        for (i, f) in INSIDE.iter().enumerate() {
            if f.load(Ordering::Relaxed) {
                forks_inside[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        // SAFETY: the child does its round and leaves with `_exit`, never
        // returning into the test harness.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let ok = every_kind(shared, round) && migrate(shared, round) && {
                A.trim();
                true
            };
            // SAFETY: leaves the child without running the parent's destructors.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let start = Instant::now();
        let mut status = 0;
        loop {
            // SAFETY: our child's pid; `status` is writable.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                break;
            }
            if start.elapsed() > Duration::from_secs(20) {
                // SAFETY: our child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                STOP.store(true, Ordering::Relaxed);
                panic!("child {round} hung: it could not allocate after fork");
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child {round} failed: {status:#x}");
    }
    STOP.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    let inside: Vec<String> = PATHS
        .iter()
        .zip(&forks_inside)
        .filter(|(p, _)| cfg!(feature = "io-uring") || **p != "ring registration")
        .map(|(p, n)| format!("{p} {}", n.load(Ordering::Relaxed)))
        .collect();
    println!(
        "{rounds} children forked among {WORKERS} busy workers, each allocated every way, trimmed and migrated: \
         {:.1?}; forks with a worker inside: {}",
        started.elapsed(),
        inside.join(", ")
    );
}
