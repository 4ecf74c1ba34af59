//! What NUMA support costs on the fast path: the same single-thread churn in
//! flat mode and in per-node mode (on a synthetic two-node topology, so the
//! per-node code runs on any machine), each in its own process (the mode is
//! chosen once per process), alternating, in one run.
//!
//! ```text
//! cargo bench --bench modes
//! ```
//!
//! Prints the median time per alloc+free pair in each mode and their ratio.
//! The design claim it checks: the mode is consulted only when a heap takes a
//! fresh page, so the ratio stays within noise of 1.0 (target: within 2%).

use std::alloc::{GlobalAlloc, Layout};
use std::hint::black_box;
use std::process::Command;
use std::time::Instant;

#[path = "../src/rng.rs"]
mod rng;
use rng::Rng;

static A: numaweave::NumaAlloc = numaweave::NumaAlloc::new();

/// ns per alloc+free pair: 256 blocks of 16–4096 bytes, allocated then freed
/// in a shuffled order, repeated; the best of 15 samples of 20,000 rounds.
fn measure() -> f64 {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15u64);
    let mut next = || rng.next();
    let sizes: Vec<usize> = (0..256).map(|_| 16 + (next() % 4081) as usize).collect();
    let mut order: Vec<usize> = (0..256).collect();
    for i in (1..256).rev() {
        order.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    let mut ptrs = [std::ptr::null_mut::<u8>(); 256];
    let mut round = || {
        for (i, &s) in sizes.iter().enumerate() {
            // SAFETY: valid layouts; freed below.
            ptrs[i] = unsafe { A.alloc(Layout::from_size_align_unchecked(s, 8)) };
        }
        for &i in &order {
            // SAFETY: allocated above with this layout.
            unsafe { A.dealloc(black_box(ptrs[i]), Layout::from_size_align_unchecked(sizes[i], 8)) };
        }
    };
    for _ in 0..2000 {
        round();
    }
    let mut samples: Vec<f64> = (0..15)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..20_000 {
                round();
            }
            t.elapsed().as_nanos() as f64 / (20_000.0 * 256.0)
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn main() {
    if std::env::var_os("NUMAWEAVE_MODES_CHILD").is_some() {
        // Pin to one CPU so both modes run the same code on the same core.
        numaweave::os::cpu::pin_current_thread(0).ok();
        println!("{} {:?}", measure(), A.mode());
        return;
    }
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list` asks every bench binary
    }
    let exe = std::env::current_exe().unwrap();
    let run = |mode: &str| -> f64 {
        let mut c = Command::new(&exe);
        c.env("NUMAWEAVE_MODES_CHILD", "1").env("NUMAWEAVE_MODE", mode);
        if mode == "per-node" {
            c.env("NUMAWEAVE_TOPOLOGY", "fake:2");
        }
        let out = c.output().unwrap();
        let s = String::from_utf8(out.stdout).unwrap();
        let mut it = s.split_whitespace();
        let ns: f64 = it.next().unwrap().parse().unwrap();
        let got = it.next().unwrap();
        assert_eq!(got.to_lowercase().replace('-', ""), mode.replace('-', ""), "child ran in mode {got}");
        ns
    };
    let (mut flat, mut per_node) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        flat.push(run("flat"));
        per_node.push(run("per-node"));
    }
    flat.sort_by(f64::total_cmp);
    per_node.sort_by(f64::total_cmp);
    let (f, p) = (flat[2], per_node[2]);
    println!("churn 256 x 16-4096 B, ns per alloc+free pair (median of 5 processes each):");
    println!("  flat                 {f:.2} ns   runs {flat:.2?}");
    println!("  per-node (fake:2)    {p:.2} ns   runs {per_node:.2?}");
    println!("  per-node / flat      {:.3}", p / f);
}
