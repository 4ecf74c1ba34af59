//! What a process-wide interleave costs a whole program, against `local`, in
//! one run: time (the worker's CPU time) and peak RSS (`VmHWM`) of two
//! workloads, each in its own child process per policy (the allocator reads
//! `NUMAWEAVE_POLICY` once), on `fake:2` in per-node mode (two nodes, so
//! that turns do change node, on any machine):
//!
//! - churn: the policy bench's mixed-size churn (256 live blocks of
//!   16 B – 16 KiB, replaced one by one);
//! - random: 4096 live blocks of 1 B – 128 KiB (log-uniform), every byte
//!   written when allocated and checked before it is freed;
//! - random-io: the same with every other block of a page and more
//!   page-aligned (an I/O buffer: under an interleave these follow the
//!   cursor block by block, from the interleaver's regions).
//!
//! Rounds run every policy once, in a rotating order; each figure is the
//! median over the rounds of the ratio to that round's `local` run.
//!
//! ```text
//! cargo bench --bench interleave [-- --rounds N]
//! ```

use std::alloc::{GlobalAlloc, Layout};
use std::process::Command;

use numaweave::NumaAlloc;

#[path = "../src/rng.rs"]
mod rng;
use rng::Rng;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

const POLICIES: [&str; 7] = [
    "local",
    "interleave:0-1:count=1",
    "interleave:0-1:count=8",
    "interleave:0-1:bytes=64K",
    "interleave:0-1:bytes=2M",
    "interleave:0-1:bytes=256K:weights=3,1",
    // Rules by size: small blocks local, 64 KiB and up interleaved.
    "<64K:local;>=64K:interleave:0-1:bytes=2M",
];

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid `timespec` to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Peak resident memory of this process, in KiB.
fn peak_rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn churn(rounds: usize) {
    let mut x = Rng(0x9e37_79b9_7f4a_7c15);
    let mut live: Vec<(*mut u8, Layout)> = Vec::with_capacity(256);
    for i in 0..rounds {
        let l = Layout::from_size_align(16 << (x.next() % 11), 8).unwrap();
        // SAFETY: valid layout; freed below or at the end.
        let p = unsafe { A.alloc(l) };
        assert!(!p.is_null());
        if live.len() < 256 {
            live.push((p, l));
        } else {
            let (q, ql) = std::mem::replace(&mut live[i % 256], (p, l));
            // SAFETY: allocated above with `ql`.
            unsafe { A.dealloc(q, ql) };
        }
    }
    for (p, l) in live {
        // SAFETY: allocated above with `l`.
        unsafe { A.dealloc(p, l) };
    }
}

fn random(ops: usize, io: bool) {
    let mut x = Rng(0x2545_f491_4f6c_dd1d);
    let mut live: Vec<(*mut u8, Layout, u8)> = Vec::with_capacity(4096);
    for i in 0..ops {
        let k = x.next() % 18;
        let size = ((1usize << k) + (x.next() as usize & ((1 << k) - 1))).min(128 << 10);
        let align = if io && size >= 4096 && i % 2 == 0 { 4096 } else { 8 };
        let l = Layout::from_size_align(size, align).unwrap();
        // SAFETY: valid layout; freed below or at the end.
        let p = unsafe { A.alloc(l) };
        assert!(!p.is_null());
        let v = i as u8;
        // SAFETY: `size` fresh bytes.
        unsafe { p.write_bytes(v, size) };
        let check_free = |(q, ql, v): (*mut u8, Layout, u8)| {
            // SAFETY: a live block of `ql`, written with `v`.
            unsafe {
                assert!(std::slice::from_raw_parts(q, ql.size()).iter().all(|&b| b == v), "a live block changed");
                A.dealloc(q, ql);
            }
        };
        if live.len() < 4096 {
            live.push((p, l, v));
        } else {
            let j = x.next() as usize % 4096;
            check_free(std::mem::replace(&mut live[j], (p, l, v)));
        }
    }
    live.into_iter().for_each(|b| {
        // SAFETY: live blocks of their layouts.
        unsafe { A.dealloc(b.0, b.1) }
    });
}

fn child(workload: &str) {
    let _ = numaweave::os::cpu::pin_current_thread(numaweave::Topology::global().cpus().first().unwrap_or(0));
    let t = thread_cpu_ns();
    match workload {
        "churn" => churn(3_000_000),
        "random" => random(300_000, false),
        _ => random(300_000, true),
    }
    println!("{} {}", thread_cpu_ns() - t, peak_rss_kib());
}

fn run(policy: &str, workload: &str) -> (f64, f64) {
    let out = Command::new(std::env::current_exe().unwrap())
        .env("NUMAWEAVE_BENCH_CHILD", workload)
        .env("NUMAWEAVE_TOPOLOGY", "fake:2")
        .env("NUMAWEAVE_MODE", "per-node")
        .env("NUMAWEAVE_POLICY", policy)
        .output()
        .expect("child");
    assert!(out.status.success(), "{policy} {workload}: {}", String::from_utf8_lossy(&out.stderr));
    let s = String::from_utf8_lossy(&out.stdout);
    let mut it = s.split_whitespace().map(|v| v.parse::<f64>().unwrap());
    (it.next().unwrap(), it.next().unwrap())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    if let Ok(w) = std::env::var("NUMAWEAVE_BENCH_CHILD") {
        return child(&w);
    }
    let mut args = std::env::args().skip(1);
    let mut rounds = 5;
    while let Some(a) = args.next() {
        if a == "--rounds" {
            rounds = args.next().and_then(|v| v.parse().ok()).expect("--rounds N");
        }
    }
    for workload in ["churn", "random", "random-io"] {
        // Per policy, per round: (time, peak RSS).
        let mut got = vec![Vec::new(); POLICIES.len()];
        for r in 0..rounds {
            for k in 0..POLICIES.len() {
                let i = (k + r) % POLICIES.len();
                got[i].push(run(POLICIES[i], workload));
            }
        }
        println!("\n{workload}: {rounds} rounds on fake:2 per-node; median of the rounds' ratios to local");
        println!("  {:<40} {:>9} {:>7} {:>10} {:>7}", "policy", "ms", "time", "peak MiB", "RSS");
        for (i, p) in POLICIES.iter().enumerate() {
            let t = median(got[i].iter().zip(&got[0]).map(|(a, b)| a.0 / b.0).collect());
            let m = median(got[i].iter().zip(&got[0]).map(|(a, b)| a.1 / b.1).collect());
            let ms = median(got[i].iter().map(|a| a.0 / 1e6).collect());
            let mib = median(got[i].iter().map(|a| a.1 / 1024.0).collect());
            println!("  {p:<40} {ms:>9.1} {t:>6.2}x {mib:>10.1} {m:>6.2}x");
        }
    }
}
