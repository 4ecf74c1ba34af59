//! The C library's fast path against the Rust one, in one run: the same
//! mixed-size churn (256 live blocks of 16 B – 16 KiB, replaced one by one,
//! the same sequence) through `#[global_allocator]` in this process, and
//! through `malloc`/`free` of `libnumaweave.so` in a C program
//! (`benches/c/churn.c`, compiled here, with PLT stubs as usual and once
//! more with `-fno-plt`), alternating, pinned, each figure
//! the thread's CPU time per alloc+free pair; the ratio is the median of the
//! rounds' ratios. Needs a C compiler (says so and stops otherwise).
//!
//! Two controls in the same rounds tell the library's code from the cost of
//! reaching a shared library: the C program linked with `libnumaweave.a`
//! (its `malloc` the program's own: direct calls, local-exec TLS), and the
//! same three builds of the C program with mimalloc, from the sources of
//! the `libmimalloc-sys` crate the `peers` feature fetches (through its
//! `.so`, `-fno-plt`, linked in; skipped, saying so, when absent): what a
//! `.so` costs an allocator that is not numaweave.
//!
//! ```text
//! cargo bench --bench capi
//! ```

use std::alloc::Layout;
use std::path::PathBuf;
use std::process::Command;

use numaweave::NumaAlloc;

#[path = "support/mimalloc.rs"]
mod mimalloc;
#[path = "support/rounds.rs"]
mod rounds;

use rounds::{ratio_to, row};

#[path = "../src/rng.rs"]
mod rng;
use rng::Rng;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid `timespec` to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `std::alloc::alloc` behind a call that is not inlined: what a Rust
/// program built without LTO makes (`__rust_alloc`), as C calls `malloc`.
/// Exported (`no_mangle`), so that LTO cannot specialize it for its one
/// caller: `#[inline(never)]` alone left it knowing, from the loop, that
/// every size is at most 16 KiB and at least 16, and it dropped the size
/// bound and the zero-size case that `malloc` (and `__rust_alloc`, which
/// sees any layout) must test. The alignment is C's 16, a constant as in
/// `malloc` (`__rust_alloc` tests it at run time too).
#[unsafe(no_mangle)]
#[inline(never)]
unsafe extern "Rust" fn numaweave_bench_called_alloc(size: usize) -> *mut u8 {
    // SAFETY: forwarded contract (a size of a valid layout of alignment 16).
    unsafe { std::alloc::alloc(Layout::from_size_align_unchecked(size, 16)) }
}

/// See [`numaweave_bench_called_alloc`].
#[unsafe(no_mangle)]
#[inline(never)]
unsafe extern "Rust" fn numaweave_bench_called_dealloc(p: *mut u8, size: usize) {
    // SAFETY: forwarded contract.
    unsafe { std::alloc::dealloc(p, Layout::from_size_align_unchecked(size, 16)) }
}

/// `std::alloc::alloc`, inlined where it is used.
#[inline(always)]
unsafe fn inlined_alloc(l: Layout) -> *mut u8 {
    // SAFETY: forwarded contract.
    unsafe { std::alloc::alloc(l) }
}

/// `std::alloc::dealloc`, inlined where it is used.
#[inline(always)]
unsafe fn inlined_dealloc(p: *mut u8, l: Layout) {
    // SAFETY: forwarded contract.
    unsafe { std::alloc::dealloc(p, l) }
}

/// `std::alloc::alloc`, through an exported function or inlined (`CALLED`, a constant:
/// chosen at compile time).
#[inline(always)]
unsafe fn alloc<const CALLED: bool>(l: Layout) -> *mut u8 {
    // SAFETY: forwarded contract.
    unsafe { if CALLED { numaweave_bench_called_alloc(l.size()) } else { inlined_alloc(l) } }
}

/// `std::alloc::dealloc`, as [`alloc`].
#[inline(always)]
unsafe fn dealloc<const CALLED: bool>(p: *mut u8, l: Layout) {
    // SAFETY: forwarded contract.
    unsafe { if CALLED { numaweave_bench_called_dealloc(p, l.size()) } else { inlined_dealloc(p, l) } }
}

/// The churn of `benches/c/churn.c`, through the global allocator as Rust
/// code reaches it (`std::alloc::alloc`, inlined into the loop with this
/// build's LTO), or with `called` through a call per operation.
fn churn<const CALLED: bool>(rounds: usize) -> f64 {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15u64);
    let mut live: Vec<(*mut u8, Layout)> = Vec::with_capacity(256);
    let t = thread_cpu_ns();
    for i in 0..rounds {
        let x = rng.next();
        // As C's malloc: alignment 16.
        let l = Layout::from_size_align(16 << (x % 11), 16).unwrap();
        // SAFETY: valid layout; freed below or at the end.
        let p = unsafe { alloc::<CALLED>(l) };
        assert!(!p.is_null());
        if live.len() < 256 {
            live.push((p, l));
        } else {
            let (q, ql) = std::mem::replace(&mut live[i % 256], (p, l));
            // SAFETY: allocated above with `ql`.
            unsafe { dealloc::<CALLED>(q, ql) };
        }
    }
    let ns = (thread_cpu_ns() - t) as f64 / rounds as f64;
    for (p, l) in live {
        // SAFETY: allocated above with `l`.
        unsafe { dealloc::<CALLED>(p, l) };
    }
    ns
}

/// Rounds of the four runs. Each run takes about 40 ms; the host's state
/// moves the figures by ±10% from one run to the next, so the medians want
/// more than a handful.
const ROUNDS: usize = 31;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let Some(cc) = ["cc", "gcc", "clang"].into_iter().find(|c| Command::new(c).arg("--version").output().is_ok())
    else {
        println!("capi bench: no C compiler, nothing measured");
        return;
    };
    // The release library beside this bench's deps/ directory.
    let dir: PathBuf = std::env::current_exe().unwrap().parent().unwrap().parent().unwrap().to_path_buf();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let st = Command::new(cargo).args(["build", "-q", "--release", "-p", "numaweave-capi"]).status().unwrap();
    assert!(st.success(), "building libnumaweave.so failed");
    let lib = dir.join("libnumaweave.so");
    let cpu = numaweave::Topology::global().cpus().first().unwrap_or(0);
    let _ = numaweave::os::cpu::pin_current_thread(cpu);
    let rounds = 2_000_000;
    let d = dir.to_str().unwrap();
    let so = ["-L", d, "-lnumaweave", &format!("-Wl,-rpath,{d}")];
    // The same program twice: as C programs are usually built (each call
    // to `malloc` through a PLT stub: a jump to a jump), and with
    // `-fno-plt` (an indirect call through the GOT, as Arch Linux builds
    // its packages): what the caller's PLT costs is not the library's.
    let exe = c_program(cc, "churn", &so);
    let exe_noplt = c_program(cc, "churn-noplt", &[&so[..], &["-fno-plt"]].concat());
    // Linked into the program (the archive's `malloc` the program's own):
    // local-exec TLS, direct calls. The libraries Rust's `std` needs, as
    // `rustc --print native-static-libs` names them.
    let a = dir.join("libnumaweave.a");
    let exe_static = c_program(
        cc,
        "churn-static",
        &[a.to_str().unwrap(), "-lgcc_s", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl", "-lc", "-lgcc_eh"],
    );
    assert!(lib.is_file());
    let (mi, mi_lib) = mimalloc_programs(cc);
    let run_c = |exe: &PathBuf| {
        let out = Command::new("taskset").args(["-c", &cpu.to_string()]).arg(exe).arg(rounds.to_string()).output();
        let out = match out {
            Ok(o) if o.status.success() => o,
            _ => Command::new(exe).arg(rounds.to_string()).output().unwrap(),
        };
        String::from_utf8_lossy(&out.stdout).trim().parse::<f64>().unwrap()
    };
    churn::<false>(rounds / 10);
    let (mut rust, mut called, mut c, mut c_noplt, mut c_static) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut m = vec![Vec::new(); mi.len()];
    for _ in 0..ROUNDS {
        rust.push(churn::<false>(rounds));
        called.push(churn::<true>(rounds));
        c.push(run_c(&exe));
        c_noplt.push(run_c(&exe_noplt));
        c_static.push(run_c(&exe_static));
        for (exe, t) in mi.iter().zip(&mut m) {
            t.push(run_c(exe));
        }
    }
    println!("churn 256 x 16 B-16 KiB, ns per alloc+free pair (thread CPU time, {ROUNDS} rounds):");
    row("#[global_allocator], inlined (LTO)", &rust);
    row("#[global_allocator], a call per op", &called);
    row("libnumaweave.so (C malloc/free)", &c);
    row("the same, caller built -fno-plt", &c_noplt);
    row("libnumaweave.a linked into it", &c_static);
    println!(
        "  C / Rust = {:.3} against calls, {:.3} against inlined; -fno-plt {:.3} against calls; linked in {:.3} against calls (medians of the rounds' ratios)",
        ratio_to(&c, &called),
        ratio_to(&c, &rust),
        ratio_to(&c_noplt, &called),
        ratio_to(&c_static, &called)
    );
    println!(
        "  numaweave through its .so / linked in = {:.3}, -fno-plt {:.3}",
        ratio_to(&c, &c_static),
        ratio_to(&c_noplt, &c_static)
    );
    if let [so, noplt, linked] = &m[..] {
        println!("  mimalloc (libmimalloc-sys's sources), the same C program:");
        row("libmimalloc.so", so);
        row("the same, caller built -fno-plt", noplt);
        row("mimalloc linked into it", linked);
        println!(
            "  mimalloc through its .so / linked in = {:.3}, -fno-plt {:.3} (what the shared library's calls cost it)",
            ratio_to(so, linked),
            ratio_to(noplt, linked)
        );
    }
    for f in mi.iter().chain(&mi_lib).chain([&exe, &exe_noplt, &exe_static]) {
        let _ = std::fs::remove_file(f);
    }
    hinted_new(d, cpu, rounds);
}

/// C++'s plain `new` against the hinted one, hot and cold
/// (`benches/c/hotcold.cc`, linked with the library): medians of the
/// rounds, and of their ratios to plain `new`.
fn hinted_new(dir: &str, cpu: usize, rounds: usize) {
    let Some(cxx) = ["c++", "g++", "clang++"].into_iter().find(|c| Command::new(c).arg("--version").output().is_ok())
    else {
        println!("hinted new: no C++ compiler, not measured");
        return;
    };
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/c/hotcold.cc");
    let exe = std::env::temp_dir().join(format!("numaweave-hotcold-{}", std::process::id()));
    let st = Command::new(cxx)
        .args(["-O2", "-std=c++17", "-I", dir, src, "-o"])
        .arg(&exe)
        .args(["-L", dir, "-lnumaweave", &format!("-Wl,-rpath,{dir}")])
        .status()
        .unwrap();
    assert!(st.success(), "compiling hotcold.cc failed");
    let (mut plain, mut hot, mut cold) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let out = Command::new("taskset").args(["-c", &cpu.to_string()]).arg(&exe).arg(rounds.to_string()).output();
        let out = match out {
            Ok(o) if o.status.success() => o,
            _ => Command::new(&exe).arg(rounds.to_string()).output().unwrap(),
        };
        let v: Vec<f64> = String::from_utf8_lossy(&out.stdout).split_whitespace().map(|w| w.parse().unwrap()).collect();
        plain.push(v[0]);
        hot.push(v[1]);
        cold.push(v[2]);
    }
    println!("C++ new/delete, the same churn, ns per pair ({ROUNDS} rounds):");
    row("new", &plain);
    row("new(size, __hot_cold_t(254))", &hot);
    row("new(size, __hot_cold_t(1)): the heap of cold blocks", &cold);
    println!("  hot / plain = {:.3}, cold / plain = {:.3}", ratio_to(&hot, &plain), ratio_to(&cold, &plain));
    let _ = std::fs::remove_file(&exe);
}

/// `benches/c/churn.c` compiled (`-O2`, then `args`: flags, objects and
/// libraries, in link order) into a temporary program named after `name`.
fn c_program(cc: &str, name: &str, args: &[&str]) -> PathBuf {
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/c/churn.c");
    let exe = std::env::temp_dir().join(format!("numaweave-{name}-{}", std::process::id()));
    let st = Command::new(cc).args(["-O2", src, "-o"]).arg(&exe).args(args).status().unwrap();
    assert!(st.success(), "compiling churn.c ({name}) failed");
    exe
}

/// The churn linked with mimalloc built from the sources of the
/// `libmimalloc-sys` crate, as the control of what a shared library's calls
/// cost an allocator: through its `.so` (PLT stubs, then `-fno-plt`) and
/// linked into the program; and the library. None (said why) where its
/// sources or the build are missing.
fn mimalloc_programs(cc: &str) -> (Vec<PathBuf>, Option<PathBuf>) {
    let Some(src) = mimalloc::sources() else {
        println!(
            "mimalloc's sources (libmimalloc-sys, fetched by `--features peers`) not in cargo's registry: not measured"
        );
        return (Vec::new(), None);
    };
    let tmp = |name: &str| std::env::temp_dir().join(format!("numaweave-{name}-{}", std::process::id()));
    let (so, obj) = (tmp("libmimalloc.so"), tmp("mimalloc.o"));
    if !mimalloc::build(cc, &src, &[], mimalloc::Kind::Shared, &so)
        || !mimalloc::build(cc, &src, &[], mimalloc::Kind::Object, &obj)
    {
        println!("mimalloc from {}: did not build, not measured", src.display());
        return (Vec::new(), None);
    }
    // The library by its path: the program's DT_NEEDED names it so.
    let so_path = so.to_str().unwrap();
    let programs = vec![
        c_program(cc, "churn-mi", &[so_path]),
        c_program(cc, "churn-mi-noplt", &[so_path, "-fno-plt"]),
        c_program(cc, "churn-mi-static", &[obj.to_str().unwrap(), "-lpthread"]),
    ];
    let _ = std::fs::remove_file(obj);
    (programs, Some(so))
}
