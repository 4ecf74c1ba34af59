//! What the hardened library costs, in one run: the mixed-size churn of
//! `benches/c/churn.c` (256 live blocks of 16 B – 16 KiB, replaced one by
//! one) through `malloc`/`free` of `libnumaweave.so`, of
//! `libnumaweave_hardened.so`, and of the latter with `NUMAWEAVE_CHECK=full`
//! (red zones and poison), each preloaded, alternating, pinned, 9 rounds;
//! each figure the thread's CPU time per alloc+free pair, each ratio the
//! median of the rounds' ratios. Builds both libraries (the hardened one
//! into `target/hardened/`). Needs a C compiler (says so and stops
//! otherwise).
//!
//! ```text
//! cargo bench --bench hardened
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn cargo(args: &[&str]) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let st = Command::new(cargo).args(args).current_dir(env!("CARGO_MANIFEST_DIR")).status().unwrap();
    assert!(st.success(), "cargo {args:?} failed");
}

/// One run of the churn under `lib` (with `env`), pinned to `cpu`: ns per pair.
fn churn(exe: &Path, lib: &Path, env: &[(&str, &str)], cpu: usize, rounds: usize) -> f64 {
    let out = Command::new("taskset")
        .args(["-c", &cpu.to_string()])
        .arg(exe)
        .arg(rounds.to_string())
        .env("LD_PRELOAD", lib)
        .env_remove("NUMAWEAVE_CHECK")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(out.status.success(), "churn failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let Some(cc) = ["cc", "gcc", "clang"].into_iter().find(|c| Command::new(c).arg("--version").output().is_ok())
    else {
        println!("hardened bench: no C compiler, nothing measured");
        return;
    };
    // target/release/deps/<bench> -> target/
    let target: PathBuf = std::env::current_exe().unwrap().ancestors().nth(3).unwrap().to_path_buf();
    cargo(&["build", "-q", "--release", "-p", "numaweave-capi"]);
    let hardened_dir = target.join("hardened");
    cargo(&[
        "build",
        "-q",
        "--release",
        "--manifest-path",
        "capi/hardened/Cargo.toml",
        "--target-dir",
        hardened_dir.to_str().unwrap(),
    ]);
    let plain = target.join("release/libnumaweave.so");
    let hardened = hardened_dir.join("release/libnumaweave_hardened.so");
    let exe = std::env::temp_dir().join(format!("numaweave-hchurn-{}", std::process::id()));
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/c/churn.c");
    let st = Command::new(cc).args(["-O2", src, "-o", exe.to_str().unwrap()]).status().unwrap();
    assert!(st.success(), "compiling churn.c failed");
    let cpu = numaweave::Topology::global().cpus().first().unwrap_or(0);
    let rounds = 2_000_000;
    let full = [("NUMAWEAVE_CHECK", "full")];
    churn(&exe, &plain, &[], cpu, rounds / 10);
    let (mut p, mut h, mut f) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..9 {
        p.push(churn(&exe, &plain, &[], cpu, rounds));
        h.push(churn(&exe, &hardened, &[], cpu, rounds));
        f.push(churn(&exe, &hardened, &full, cpu, rounds));
    }
    let ratio = |x: &[f64]| median(x.iter().zip(&p).map(|(a, b)| a / b).collect());
    println!("churn 256 x 16 B-16 KiB through malloc/free, ns per alloc+free pair (thread CPU time, 9 rounds):");
    println!("  libnumaweave.so                          {:.2}  {p:.2?}", median(p.clone()));
    println!("  libnumaweave_hardened.so                 {:.2}  {h:.2?}", median(h.clone()));
    println!("  libnumaweave_hardened.so, CHECK=full     {:.2}  {f:.2?}", median(f.clone()));
    println!("  hardened / plain = {:.3}; with CHECK=full {:.3} (medians of the rounds' ratios)", ratio(&h), ratio(&f));
    let _ = std::fs::remove_file(exe);
}
