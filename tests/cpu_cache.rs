//! Per-CPU caches (`Config::cpu_cache`) as a program relies on them: every
//! block handed out once at a time and its contents kept while threads
//! (many more than CPUs) allocate, free each other's blocks, move between
//! CPUs with `sched_setaffinity`, trim (which takes the caches' rows apart
//! under them) and fork; a trim takes every cached block back; a thread
//! with a policy of its own is served by its heap. Where glibc registered
//! no rseq the per-thread caches serve, and the same checks pass: the
//! binary runs itself again under `GLIBC_TUNABLES=glibc.pthread.rseq=0`.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use numaweave::{Config, NumaAlloc};

mod support;
use support::Rng;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::with_config(Config::new().cpu_cache(true));

/// The figures read are process-wide: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A live block: its address, size and the byte it was filled with.
struct Live(usize, usize, u8);

fn layout(size: usize) -> Layout {
    Layout::from_size_align(size, if size >= 16 { 16 } else { 8 }).unwrap()
}

/// Fills a fresh block of `size` bytes with `tag` (all of a small one; the
/// first and last 64 bytes and a middle one of a larger one).
fn fill(p: *mut u8, size: usize, tag: u8) {
    // SAFETY: a live block of at least `size` bytes.
    unsafe {
        if size <= 256 {
            p.write_bytes(tag, size);
        } else {
            p.write_bytes(tag, 64);
            p.add(size - 64).write_bytes(tag, 64);
            *p.add(size / 2) = tag;
        }
    }
}

/// Whether the block still holds what [`fill`] wrote.
fn intact(b: &Live) -> bool {
    let p = b.0 as *const u8;
    let (size, tag) = (b.1, b.2);
    // SAFETY: a live block of at least `size` bytes.
    unsafe {
        let all = |from: usize, n: usize| (from..from + n).all(|i| *p.add(i) == tag);
        if size <= 256 { all(0, size) } else { all(0, 64) && all(size - 64, 64) && *p.add(size / 2) == tag }
    }
}

fn free(b: Live) {
    assert!(intact(&b), "block {:#x} of {} bytes lost its contents (handed out twice?)", b.0, b.1);
    // SAFETY: a live block of this size, freed once.
    unsafe { A.dealloc(b.0 as *mut u8, layout(b.1)) };
}

/// Sizes up to the caches' 2 KiB, most of them small, some past it.
fn size(r: &mut Rng) -> usize {
    match r.below(16) {
        0 => 2048 + 1 + r.below(30 * 1024) as usize,
        1..=3 => 512 + r.below(1536) as usize,
        _ => 1 + r.below(512) as usize,
    }
}

/// The CPUs this thread may run on.
fn allowed() -> Vec<usize> {
    numaweave::os::cpu::allowed_cpus().unwrap()
}

fn pin(cpu: usize) {
    numaweave::os::cpu::pin_current_thread(cpu).unwrap();
}

#[test]
fn on_exactly_where_glibc_registered_rseq() {
    let _g = serial();
    let rseq = numaweave::os::rseq::registration().is_some();
    // (Never in hardened builds: their checks need every free at its page.)
    assert_eq!(A.cpu_caches(), rseq && !cfg!(feature = "hardened"));
    if support::in_child() {
        assert!(!rseq, "the child runs without rseq");
    }
    println!("caches on: {}", A.cpu_caches());
}

/// 16 threads on this machine's CPUs for 3 s, each keeping up to 256
/// blocks: it frees its own, and sends every fourth to the next thread,
/// which checks and frees it; each moves to another allowed CPU every 2,000
/// steps. A trimmer drains the caches every 5 ms meanwhile, and the main
/// thread forks 20 children that allocate, check and free on their own.
#[test]
fn blocks_are_handed_out_once_under_migration_trim_and_fork() {
    let _g = serial();
    const THREADS: usize = 16;
    let stop = AtomicBool::new(false);
    let steps = AtomicU64::new(0);
    let cpus = allowed();
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| mpsc::channel::<Live>()).unzip();
    std::thread::scope(|s| {
        for (t, rx) in rxs.into_iter().enumerate() {
            let tx = txs[(t + 1) % THREADS].clone();
            let (stop, steps, cpus) = (&stop, &steps, &cpus);
            s.spawn(move || {
                let mut r = Rng(0x9e37_79b9_7f4a_7c15 ^ (t as u64 + 1));
                let mut live: Vec<Live> = Vec::new();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    if n.is_multiple_of(2_000) {
                        pin(cpus[r.below(cpus.len() as u64) as usize]);
                    }
                    while let Ok(b) = rx.try_recv() {
                        free(b);
                    }
                    if live.len() < 256 && r.below(3) != 0 {
                        let sz = size(&mut r);
                        // SAFETY: a non-zero size.
                        let p = unsafe { A.alloc(layout(sz)) };
                        assert!(!p.is_null());
                        assert_eq!(p as usize % layout(sz).align(), 0);
                        let tag = (n as u8) | 1;
                        fill(p, sz, tag);
                        live.push(Live(p as usize, sz, tag));
                    } else if !live.is_empty() {
                        let b = live.swap_remove(r.below(live.len() as u64) as usize);
                        if r.below(4) == 0 {
                            let _ = tx.send(b).map_err(|e| free(e.0));
                        } else {
                            free(b);
                        }
                    }
                }
                live.into_iter().for_each(free);
                drop(tx);
                // What the previous thread sent after we stopped.
                std::thread::sleep(Duration::from_millis(50));
                while let Ok(b) = rx.try_recv() {
                    free(b);
                }
                steps.fetch_add(n, Ordering::Relaxed);
            });
        }
        drop(txs);
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                numaweave::trim();
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let t0 = Instant::now();
        let mut forks = 0;
        while t0.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(100));
            if forks < 20 {
                forks += 1;
                // SAFETY: the child allocates through the allocator (which
                // holds its locks across fork) and leaves with `_exit`.
                let pid = unsafe { libc::fork() };
                assert!(pid >= 0);
                if pid == 0 {
                    let mut r = Rng(0x2545_f491_4f6c_dd1d ^ forks);
                    let mut live = Vec::new();
                    for k in 0..2_000u32 {
                        let sz = size(&mut r);
                        // SAFETY: a non-zero size.
                        let p = unsafe { A.alloc(layout(sz)) };
                        if p.is_null() {
                            // SAFETY: leaving the child.
                            unsafe { libc::_exit(2) };
                        }
                        fill(p, sz, k as u8 | 1);
                        live.push(Live(p as usize, sz, k as u8 | 1));
                    }
                    let ok = live.iter().all(intact);
                    live.into_iter().for_each(free);
                    numaweave::trim();
                    // SAFETY: leaving the child.
                    unsafe { libc::_exit(if ok { 0 } else { 1 }) };
                }
                let mut status = 0;
                // SAFETY: our child.
                assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
                assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child {forks}: status {status:#x}");
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    println!("{} steps of 16 threads; caches on: {}", steps.load(Ordering::Relaxed), A.cpu_caches());
}

/// Blocks freed into the caches are in use for their pages until a trim
/// takes them back; after it the caches hold no more than what the
/// calling thread took since (the trim's own allocations) and the bytes
/// in use are no more than they were before (less where the harness's
/// other threads, the last test's exiting one, freed meanwhile: a slow
/// run saw 497 KB in use before and 52 KB after).
#[test]
fn trim_takes_every_cached_block_back() {
    let _g = serial();
    numaweave::trim();
    let before = A.stats();
    let cpus = allowed();
    // A thread on each CPU frees blocks of ten classes (100 B to 2 KiB) there.
    std::thread::scope(|s| {
        for &cpu in &cpus {
            s.spawn(move || {
                pin(cpu);
                let blocks: Vec<Vec<u8>> = (0..400).map(|k| vec![k as u8; 100 + (k % 10) * 210]).collect();
                drop(blocks);
            });
        }
    });
    let cached = A.stats().cpu_cached;
    println!("cached {cached} B on {} CPUs before the trim, {} B before the threads", cpus.len(), before.cpu_cached);
    numaweave::trim();
    let after = A.stats();
    println!("cached {} B after it", after.cpu_cached);
    if A.cpu_caches() {
        // Ten classes, up to 32 KiB each, on each CPU the threads ran on.
        assert!(cached >= cpus.len() as u64 * (64 << 10), "{cached} bytes cached after the frees");
        assert!(cached <= cpus.len() as u64 * (1 << 20), "{cached} bytes cached on {} CPUs", cpus.len());
        assert!(after.cpu_cached < 32 << 10, "a trim left {} bytes in the caches", after.cpu_cached);
    } else {
        assert_eq!(cached + after.cpu_cached, 0);
    }
    let (b, a) = (before.total(), after.total());
    // Cached blocks the trim left out would be in use still: 64 KiB and
    // more a CPU (checked above).
    assert!(a.in_use < b.in_use + (64 << 10), "in use {} -> {}", b.in_use, a.in_use);
}

/// A thread with a policy of its own allocates from its heap, under that
/// policy, and what it frees goes back to its heap, not to the caches;
/// the caches serve it again once the guard is dropped.
///
/// `cpu_cached` is the whole process's: the harness's own threads (the
/// last test's, exiting; the reporter) free into the caches while this
/// test runs, so each check counts rounds, a millisecond apart. A round
/// makes 50 blocks of 104 bytes and frees them, reading the count
/// before, between and after. Their stack holds 128, is refilled with 64
/// when empty and gives 64 back when full, so a round the caches serve
/// moves the count by 50 − 64k blocks at the allocations and again at
/// the frees: never 0 (nor with the `Vec`'s own 400 bytes, class 448,
/// refilled 36 at a time: no sum of those multiples is 0).
#[test]
fn a_thread_policy_takes_the_heap() {
    const ROUNDS: usize = 10;
    const BLOCKS: usize = 50;
    /// One round: whether the caches' count stayed as it was throughout.
    fn still(r: usize, node: Option<usize>) -> bool {
        std::thread::sleep(Duration::from_millis(1));
        let before = A.stats().cpu_cached;
        let v: Vec<Box<[u8; 100]>> = (0..BLOCKS).map(|_| Box::new([r as u8; 100])).collect();
        let between = A.stats().cpu_cached;
        if let Some(node) = node {
            // SAFETY: live blocks of ours.
            assert!(v.iter().all(|b| unsafe { A.node_of(b.as_ptr()) } == node));
        }
        assert!(v.iter().all(|b| b[0] == r as u8 && b[99] == r as u8));
        drop(v);
        before == between && between == A.stats().cpu_cached
    }
    let _g = serial();
    numaweave::trim();
    let node = numaweave::Topology::global().current_node();
    std::thread::spawn(move || {
        let g = numaweave::with_policy(numaweave::policy::Policy::Bind(numaweave::topology::NodeSet::single(node)))
            .unwrap();
        let held = (0..ROUNDS).filter(|&r| still(r, Some(node))).count();
        assert!(held > ROUNDS / 2, "the caches took part in {} of {ROUNDS} rounds under a policy", ROUNDS - held);
        drop(g);
        let served = (0..ROUNDS).filter(|&r| !still(r, None)).count();
        if A.cpu_caches() {
            assert!(served > ROUNDS / 2, "the caches served the thread after its guard in {served} of {ROUNDS} rounds");
        } else {
            assert_eq!(A.stats().cpu_cached, 0);
        }
    })
    .join()
    .unwrap();
}

/// The same checks where glibc registered no rseq: this binary again,
/// under the tunable that turns glibc's registration off.
#[test]
fn without_rseq_the_per_thread_caches_serve() {
    if support::in_child() || numaweave::os::rseq::registration().is_none() {
        return;
    }
    // (Reading the children's output allocates: not beside the others.)
    let _g = serial();
    let off = [("GLIBC_TUNABLES", Some("glibc.pthread.rseq=0"))];
    for test in [
        "on_exactly_where_glibc_registered_rseq",
        "blocks_are_handed_out_once_under_migration_trim_and_fork",
        "trim_takes_every_cached_block_back",
        "a_thread_policy_takes_the_heap",
    ] {
        support::rerun(test, &off, "test result: ok. 1 passed");
    }
}
