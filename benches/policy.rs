//! What memory policies cost `NumaAlloc`, in one run (ratios against a
//! baseline measured alongside, not absolute times, are the point on a noisy
//! machine; times are the thread's CPU time):
//!
//! - the default `Local` policy against the same allocator with policies
//!   switched off (`NUMAWEAVE_POLICY=none`), in alternating child processes
//!   (the switch is read at start-up; twelve of each, in ABBA order), on this
//!   machine and on `fake:2` in per-node mode: the policy lookup sits on the
//!   slow path only, so the churn should not notice it;
//! - an interleaved allocation (`Count(8)`, `Bytes(2 MiB)` over every memory
//!   node, or over the two nodes of `fake:2` on a one-node machine, so that
//!   turns do change node) against a local one: alloc + free of a 4 KiB
//!   buffer in a loop, page-aligned (an I/O buffer: placed block by block,
//!   turn by turn) with the buffer left alone or its first word written (an
//!   I/O buffer is used: a placement that walks fresh memory shows there),
//!   or unaligned (placed page by page: the local fast path), under a
//!   scoped interleave in a pinned child process, then under the process
//!   default interleave (one child process per policy, in rounds).
//!
//! ```text
//! cargo bench --bench policy
//! ```

use std::alloc::{GlobalAlloc, Layout};
use std::hint::black_box;
use std::process::Command;

use numaweave::NumaAlloc;
use numaweave::policy::{Granularity, Interleave, Policy};

#[path = "../src/rng.rs"]
mod rng;
use rng::Rng;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

/// CPU time of the calling thread, in nanoseconds: on a shared machine the
/// time a thread waits for a CPU is not what the allocator costs.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid `timespec` to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Mixed-size churn: 256 live blocks of 16 B–16 KiB, replaced one by one;
/// nanoseconds per alloc + free pair.
fn churn(rounds: usize) -> f64 {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15u64);
    let mut live: Vec<(*mut u8, Layout)> = Vec::with_capacity(256);
    let t = thread_cpu_ns();
    for i in 0..rounds {
        let x = rng.next();
        let l = Layout::from_size_align(16 << (x % 11), 8).unwrap();
        // SAFETY: valid layout; freed below or at the end.
        let p = unsafe { A.alloc(l) };
        assert!(!p.is_null());
        if live.len() < 256 {
            live.push((p, l));
        } else {
            let k = i % 256;
            let (q, ql) = std::mem::replace(&mut live[k], (p, l));
            // SAFETY: allocated above with `ql`.
            unsafe { A.dealloc(q, ql) };
        }
    }
    let ns = (thread_cpu_ns() - t) as f64 / rounds as f64;
    for (p, l) in live {
        // SAFETY: allocated above with `l`.
        unsafe { A.dealloc(p, l) };
    }
    ns
}

/// Alloc + free of a 4 KiB buffer (page-aligned, as an I/O buffer, or not;
/// its first word written or not); nanoseconds per pair.
fn pairs(n: usize, align: usize, write: bool) -> f64 {
    let l = Layout::from_size_align(4096, align).unwrap();
    let t = thread_cpu_ns();
    for i in 0..n {
        // SAFETY: valid layout; freed at once.
        unsafe {
            let p = black_box(A.alloc(l));
            if write {
                p.cast::<usize>().write_volatile(i);
            }
            A.dealloc(p, l);
        }
    }
    (thread_cpu_ns() - t) as f64 / n as f64
}

/// The interleave figures, in a child pinned to one CPU.
fn interleave_pairs() {
    let _ = numaweave::os::cpu::pin_current_thread(numaweave::Topology::global().cpus().first().unwrap_or(0));
    let nodes = numaweave::Topology::global().memory_nodes();
    let synthetic =
        if numaweave::Topology::global().is_synthetic() { " (fake:2 on this one-node machine)" } else { "" };
    for (align, write) in [(4096, false), (4096, true), (8, false)] {
        let mut local = Vec::new();
        let mut count8 = Vec::new();
        let mut bytes2m = Vec::new();
        pairs(100_000, align, write);
        // Nine rounds, each local then both interleaves back to back: the
        // median of the rounds' ratios is the figure a busy spell of the
        // machine moves least.
        for _ in 0..9 {
            local.push(pairs(1_000_000, align, write));
            for (g, v) in [(Granularity::Count(8), &mut count8), (Granularity::Bytes(2 << 20), &mut bytes2m)] {
                let _g = numaweave::with_policy(Policy::Interleave(Interleave::new(nodes, g).unwrap())).unwrap();
                v.push(pairs(1_000_000, align, write));
            }
        }
        let ratio = |v: &[f64]| median(v.iter().zip(&local).map(|(a, b)| a / b).collect());
        let (rc, rb) = (ratio(&count8), ratio(&bytes2m));
        let (l, c, b) = (median(local), median(count8), median(bytes2m));
        let what = if write { ", first word written" } else { "" };
        println!(
            "\n4 KiB alloc+free pairs aligned to {align}{what}, interleaved over nodes {nodes}{synthetic}, ns (medians of 9 rounds; ratio: median of the rounds' ratios):"
        );
        println!("  Local           {l:.2}");
        println!("  Count(8)        {c:.2}  = {rc:.2}x local");
        println!("  Bytes(2 MiB)    {b:.2}  = {rb:.2}x local");
    }
}

/// Runs this bench again with `var` set (the part to run), on `fake:2` in
/// per-node mode or not, under `policy` (`NUMAWEAVE_POLICY`) if given; its
/// standard output.
fn child(var: &str, fake2: bool, policy: Option<&str>) -> String {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.env(var, "1");
    if fake2 {
        c.env("NUMAWEAVE_TOPOLOGY", "fake:2").env("NUMAWEAVE_MODE", "per-node");
    }
    if let Some(p) = policy {
        c.env("NUMAWEAVE_POLICY", p);
    }
    let out = c.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    if std::env::var_os("NUMAWEAVE_BENCH_PAIRS").is_some() {
        interleave_pairs();
        return;
    }
    if std::env::var_os("NUMAWEAVE_BENCH_DEFAULT").is_some() {
        // Under the process default policy (`NUMAWEAVE_POLICY`), pinned:
        // page-aligned 4 KiB pairs, the same with the first word written,
        // and unaligned ones.
        let _ = numaweave::os::cpu::pin_current_thread(numaweave::Topology::global().cpus().first().unwrap_or(0));
        pairs(100_000, 4096, false);
        println!("{} {} {}", pairs(1_000_000, 4096, false), pairs(1_000_000, 4096, true), pairs(1_000_000, 8, false));
        return;
    }
    if std::env::var_os("NUMAWEAVE_BENCH_CHILD").is_some() {
        // Pinned, on a thread started after the pinning: a thread that moved
        // between (fake) nodes, as the main thread may have since its first
        // allocation, makes `Local` keep its pages of the other node aside
        // and take fresh ones on its new node. That is the policy working,
        // not what it costs to look up.
        let _ = numaweave::os::cpu::pin_current_thread(numaweave::Topology::global().cpus().first().unwrap_or(0));
        let ns = std::thread::spawn(|| {
            churn(200_000); // warm-up
            churn(2_000_000)
        });
        println!("{}", ns.join().unwrap());
        return;
    }
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list`
    }
    // On this machine's topology, and on `fake:2` in per-node mode, where
    // `Local` checks the node of the pages it refills from.
    for (label, fake2) in [("this machine", false), ("fake:2, per-node", true)] {
        let run = |policy: &str| -> f64 { child("NUMAWEAVE_BENCH_CHILD", fake2, Some(policy)).trim().parse().unwrap() };
        let (mut with, mut without) = (Vec::new(), Vec::new());
        // ABBA order: neither side always runs second.
        for i in 0..12 {
            if i % 2 == 0 {
                with.push(run("local"));
                without.push(run("none"));
            } else {
                without.push(run("none"));
                with.push(run("local"));
            }
        }
        let (w, wo) = (median(with.clone()), median(without.clone()));
        println!("churn on {label}, ns per alloc+free pair (12 processes each, ABBA order):");
        println!("  default Local policy   {w:.2}  {with:.2?}");
        println!("  policies switched off  {wo:.2}  {without:.2?}");
        // Each pair ran back to back, so a busy spell of the machine slows
        // both of it: the median of the twelve pairs' ratios is the figure
        // that spell moves least; the minima agree on a quiet machine.
        let paired = median(with.iter().zip(&without).map(|(a, b)| a / b).collect());
        let fastest = with.iter().copied().fold(f64::MAX, f64::min) / without.iter().copied().fold(f64::MAX, f64::min);
        println!(
            "  Local / off = {paired:.3} (median of the pairs' ratios; medians {:.3}, minima {fastest:.3})",
            w / wo
        );
    }

    let two = numaweave::Topology::global().memory_nodes().len() < 2;
    print!("{}", child("NUMAWEAVE_BENCH_PAIRS", two, None));

    // The process default interleave (each thread its own cursor): its
    // processes against `local` ones, in turn, seven rounds.
    let nodes = if two { "0-1".to_string() } else { numaweave::Topology::global().memory_nodes().to_string() };
    let policies = ["local".to_string(), format!("interleave:{nodes}:count=8"), format!("interleave:{nodes}:bytes=2M")];
    let mut ns: Vec<Vec<[f64; 3]>> = vec![Vec::new(); 3];
    for _ in 0..7 {
        for (k, p) in policies.iter().enumerate() {
            let out = child("NUMAWEAVE_BENCH_DEFAULT", two, Some(p));
            let v: Vec<f64> = out.split_whitespace().map(|x| x.parse().unwrap()).collect();
            ns[k].push([v[0], v[1], v[2]]);
        }
    }
    println!(
        "\nprocess default policy, 4 KiB alloc+free pairs: page-aligned (plain / first word written) and unaligned, ns (medians of 7 processes; ratio: median of the rounds' ratios):"
    );
    for (k, p) in policies.iter().enumerate() {
        let m = |i: usize| median(ns[k].iter().map(|x| x[i]).collect());
        let r = |i: usize| median(ns[k].iter().zip(&ns[0]).map(|(a, b)| a[i] / b[i]).collect());
        println!("  {p:28} {:6.2} {:6.2} {:6.2}  = {:.2}x / {:.2}x / {:.2}x local", m(0), m(1), m(2), r(0), r(1), r(2));
    }
}
