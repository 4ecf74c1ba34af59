//! What memory policies cost `NumaAlloc`, in one run (ratios, not absolute
//! times, are the point on a noisy machine):
//!
//! - the default `Local` policy against the same allocator with policies
//!   switched off (`NUMAWEAVE_POLICY=none`), in alternating child processes
//!   (the switch is read at start-up; eight of each, in ABBA order): the policy lookup sits on the slow
//!   path only, so the churn should not notice it;
//! - an interleaved allocation (`Count(8)`, `Bytes(2 MiB)` over every memory
//!   node, or over the two nodes of `fake:2` on a one-node machine, so that
//!   turns do change node) against a local one: alloc + free of a 4 KiB
//!   buffer in a loop, page-aligned or not, the buffer left alone or its
//!   first word written (an I/O buffer is used: a placement that walks fresh
//!   memory shows there), in a pinned child process.
//!
//! ```text
//! cargo bench --bench policy
//! ```

use std::alloc::{GlobalAlloc, Layout};
use std::hint::black_box;
use std::process::Command;
use std::time::Instant;

use numaweave::NumaAlloc;
use numaweave::policy::{Granularity, Interleave, Policy};

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

/// Mixed-size churn: 256 live blocks of 16 B–16 KiB, replaced one by one;
/// nanoseconds per alloc + free pair.
fn churn(rounds: usize) -> f64 {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut live: Vec<(*mut u8, Layout)> = Vec::with_capacity(256);
    let t = Instant::now();
    for i in 0..rounds {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
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
    let ns = t.elapsed().as_nanos() as f64 / rounds as f64;
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
    let t = Instant::now();
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
    t.elapsed().as_nanos() as f64 / n as f64
}

/// The interleave figures, in a child pinned to one CPU.
fn interleave_pairs() {
    let _ = numaweave::os::cpu::pin_current_thread(numaweave::Topology::global().cpus().first().unwrap_or(0));
    let nodes = numaweave::Topology::global().memory_nodes();
    let synthetic =
        if numaweave::Topology::global().is_synthetic() { " (fake:2 on this one-node machine)" } else { "" };
    for (align, write) in [(4096, false), (8, false), (8, true)] {
        let mut local = Vec::new();
        let mut count8 = Vec::new();
        let mut bytes2m = Vec::new();
        pairs(100_000, align, write);
        for _ in 0..5 {
            local.push(pairs(1_000_000, align, write));
            for (g, v) in [(Granularity::Count(8), &mut count8), (Granularity::Bytes(2 << 20), &mut bytes2m)] {
                let _g = numaweave::with_policy(Policy::Interleave(Interleave::new(nodes, g).unwrap())).unwrap();
                v.push(pairs(1_000_000, align, write));
            }
        }
        let (l, c, b) = (median(local), median(count8), median(bytes2m));
        let what = if write { ", first word written" } else { "" };
        println!(
            "\n4 KiB alloc+free pairs aligned to {align}{what}, interleaved over nodes {nodes}{synthetic}, ns (median of 5):"
        );
        println!("  Local           {l:.2}");
        println!("  Count(8)        {c:.2}  = {:.2}x local", c / l);
        println!("  Bytes(2 MiB)    {b:.2}  = {:.2}x local", b / l);
    }
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
    let exe = std::env::current_exe().unwrap();
    // On this machine's topology, and on `fake:2` in per-node mode, where
    // `Local` checks the node of the pages it refills from.
    for (label, topo) in [("this machine", None), ("fake:2, per-node", Some("fake:2"))] {
        let run = |policy: &str| -> f64 {
            let mut c = Command::new(&exe);
            c.env("NUMAWEAVE_BENCH_CHILD", "1").env("NUMAWEAVE_POLICY", policy);
            if let Some(t) = topo {
                c.env("NUMAWEAVE_TOPOLOGY", t).env("NUMAWEAVE_MODE", "per-node");
            }
            let out = c.output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
        };
        let (mut with, mut without) = (Vec::new(), Vec::new());
        // ABBA order: neither side always runs second.
        for i in 0..8 {
            if i % 2 == 0 {
                with.push(run("local"));
                without.push(run("none"));
            } else {
                without.push(run("none"));
                with.push(run("local"));
            }
        }
        let (w, wo) = (median(with.clone()), median(without.clone()));
        println!("churn on {label}, ns per alloc+free pair (8 processes each, ABBA order):");
        println!("  default Local policy   {w:.2}  {with:.2?}");
        println!("  policies switched off  {wo:.2}  {without:.2?}");
        // Each pair ran back to back, so a busy spell of the machine slows
        // both of it: the median of the eight pairs' ratios is the figure
        // that spell moves least; the minima agree on a quiet machine.
        let paired = median(with.iter().zip(&without).map(|(a, b)| a / b).collect());
        let fastest = with.iter().copied().fold(f64::MAX, f64::min) / without.iter().copied().fold(f64::MAX, f64::min);
        println!(
            "  Local / off = {paired:.3} (median of the pairs' ratios; medians {:.3}, minima {fastest:.3})",
            w / wo
        );
    }

    let mut c = Command::new(&exe);
    c.env("NUMAWEAVE_BENCH_PAIRS", "1");
    if numaweave::Topology::global().memory_nodes().len() < 2 {
        c.env("NUMAWEAVE_TOPOLOGY", "fake:2").env("NUMAWEAVE_MODE", "per-node");
    }
    let out = c.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    print!("{}", String::from_utf8_lossy(&out.stdout));
}
