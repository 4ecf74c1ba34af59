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
//! For scale, in the same rounds: mimalloc built from the sources of the
//! `libmimalloc-sys` crate the `peers` feature uses (found in cargo's
//! registry at the version `Cargo.lock` names; skipped, saying so, when
//! absent; built as its CMake release build builds it, initial-exec TLS
//! included: `support/mimalloc.rs`), plain and with its secure mode as the
//! `mimalloc` crate's `secure` feature builds it (`MI_SECURE=4`: encoded
//! free lists, double free checks, a canary after each block, randomized
//! allocation), and the latter without the canary (`MI_PADDING=0`: the
//! checks numaweave's hardened build makes without `NUMAWEAVE_CHECK=full`).
//!
//! ```text
//! cargo bench --bench hardened
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "support/mimalloc.rs"]
mod mimalloc;
#[path = "support/rounds.rs"]
mod rounds;

use rounds::{ratio_to, row};

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
    // mimalloc plain, secure as shipped, secure without its canary.
    let mi: Vec<PathBuf> = match mimalloc::sources() {
        Some(src) => {
            let variants: [&[&str]; 3] = [&[], &["-DMI_SECURE=4"], &["-DMI_SECURE=4", "-DMI_PADDING=0"]];
            let libs: Vec<PathBuf> = (0..3)
                .map(|i| std::env::temp_dir().join(format!("numaweave-hchurn-mi{i}-{}.so", std::process::id())))
                .collect();
            if variants.iter().zip(&libs).all(|(d, out)| mimalloc::build(cc, &src, d, mimalloc::Kind::Shared, out)) {
                libs
            } else {
                println!("mimalloc from {}: did not build, not measured", src.display());
                Vec::new()
            }
        }
        None => {
            println!(
                "mimalloc's sources (libmimalloc-sys, fetched by `--features peers`) not in cargo's registry: its secure mode not measured"
            );
            Vec::new()
        }
    };
    churn(&exe, &plain, &[], cpu, rounds / 10);
    let (mut p, mut h, mut f) = (Vec::new(), Vec::new(), Vec::new());
    let mut m = vec![Vec::new(); mi.len()];
    for _ in 0..9 {
        p.push(churn(&exe, &plain, &[], cpu, rounds));
        h.push(churn(&exe, &hardened, &[], cpu, rounds));
        f.push(churn(&exe, &hardened, &full, cpu, rounds));
        for (lib, t) in mi.iter().zip(&mut m) {
            t.push(churn(&exe, lib, &[], cpu, rounds));
        }
    }
    println!("churn 256 x 16 B-16 KiB through malloc/free, ns per alloc+free pair (thread CPU time, 9 rounds):");
    row("libnumaweave.so", &p);
    row("libnumaweave_hardened.so", &h);
    row("libnumaweave_hardened.so, CHECK=full", &f);
    println!(
        "  hardened / plain = {:.3}; with CHECK=full {:.3} (medians of the rounds' ratios)",
        ratio_to(&h, &p),
        ratio_to(&f, &p)
    );
    if let [mp, ms, mn] = &m[..] {
        row("mimalloc (libmimalloc-sys's sources)", mp);
        row("mimalloc, MI_SECURE=4", ms);
        row("mimalloc, MI_SECURE=4, MI_PADDING=0", mn);
        println!("  mimalloc secure / plain = {:.3}; without its canary {:.3}", ratio_to(ms, mp), ratio_to(mn, mp));
    }
    for f in mi.iter().chain([&exe]) {
        let _ = std::fs::remove_file(f);
    }
}
