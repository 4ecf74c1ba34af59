//! The C library as C and C++ programs use it, on the libraries a user
//! gets: `libnumaweave.so` of the release profile (what `cargo build
//! --release --workspace` ships; `.ci/run` runs these tests again after that
//! build, which finds them fresh) and `libnumaweave_hardened.so`. Every
//! program runs against both, compiled here. A tool a test needs that is
//! missing (a C or C++ compiler, objdump, liburing's header) is said on
//! the terminal, past the harness's capture, and fails the test where
//! `NUMAWEAVE_TEST_STRICT` is set (CI sets it); elsewhere the test passes
//! having said so (the library itself needs none of them).
//!
//! - `tests/c/edges.c`: every exported function at its edges, linked;
//! - `tests/c/abi.c`: the malloc ABI as C23 and POSIX state it (alignment
//!   of every entry point at every size to 4 KiB, errno kept by calls that
//!   succeed, overcommit refusal), linked;
//! - `tests/c/hotcold.cc`: the hinted `operator new` family: hot and cold
//!   blocks never on one page, cold ones on the lower tier where there is
//!   one (the multi-node guest runs it too), the failure paths.
//! - `tests/c/cxx.cc`: `operator new`/`delete` in every form, and
//!   `std::bad_alloc` and a new-handler's own exception thrown through
//!   numaweave's `new` (C++ compiler);
//! - `tests/c/register.c`: a cache's registration hooks (each region
//!   registered and unregistered once, a refusal failing the allocation),
//!   and with liburing a `READ_FIXED` into a registered object;
//! - `tests/c/life.c`: a process's life under `LD_PRELOAD` (threads, fork,
//!   dlopen/dlclose, exec, exit while threads allocate);
//! - the fast paths of `malloc` and `free` make no `__tls_get_addr` call,
//!   and C++'s plain `new` no call at all (objdump);
//! - `tests/c/misuse.c`: every misuse `libnumaweave_hardened.so` catches,
//!   each aborting with its report;
//! - `tests/c/forks.c`: `fork()` where glibc's malloc makes it safe (against
//!   stdio's locks, from a signal handler), bounded in time, preloaded;
//! - `tests/c/prefork.c`: a forked worker that closes its inherited
//!   descriptors and opens its own keeps them while its slab cache grows,
//!   and gets a slab table of its own; the table cannot be truncated;
//! - `tests/c/failures.c`: every entry point's failures (sizes, alignments,
//!   an address-space limit) with glibc's result and errno, and four
//!   threads going on with every mmap refused (seccomp), preloaded.
//! - `tests/c/stack.c`: a thread's first allocations touch at most one
//!   page of its stack below its start's (every thread keeps what they
//!   touch), preloaded.
//!
//! The preloaded programs run under glibc's malloc too, as the control that
//! what they expect is what glibc does.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The target directory (`target/`: this test runs from `target/<profile>/deps/`).
fn target_root() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.ancestors().nth(3).unwrap().to_path_buf()
}

/// `target/release`, with `libnumaweave.so`, `libnumaweave.a` and
/// `numaweave.h` built (once per process; nothing is rebuilt when `cargo
/// build --release --workspace` has built them: the package's features are
/// the workspace's).
fn release_dir() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let st = Command::new(option_env!("CARGO").unwrap_or("cargo"))
                .args(["build", "-q", "--release", "-p", "numaweave-capi"])
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .expect("cargo");
            assert!(st.success(), "building libnumaweave failed");
            target_root().join("release")
        })
        .clone()
}

/// `target/hardened/release`, with `libnumaweave_hardened.so` built: a
/// workspace of its own (with the plain library in one cargo run, Cargo
/// would harden both), the build `.ci/run` and the hardened bench then
/// find.
fn hardened_dir() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let dir = target_root().join("hardened");
            let st = Command::new(option_env!("CARGO").unwrap_or("cargo"))
                .args(["build", "-q", "--release", "--manifest-path", "hardened/Cargo.toml", "--target-dir"])
                .arg(&dir)
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .expect("cargo");
            assert!(st.success(), "building libnumaweave_hardened failed");
            dir.join("release")
        })
        .clone()
}

/// A C library under test, as a user gets it.
struct Lib {
    /// `release` or `hardened`.
    name: &'static str,
    /// The directory that holds it.
    dir: PathBuf,
    /// Its name for `-l`.
    link: &'static str,
}

impl Lib {
    /// The shared library, for `LD_PRELOAD`.
    fn so(&self) -> PathBuf {
        let so = self.dir.join(format!("lib{}.so", self.link));
        assert!(so.is_file(), "{} not built", so.display());
        so
    }

    fn hardened(&self) -> bool {
        self.name == "hardened"
    }
}

/// Both libraries: every C program runs against each.
fn libraries() -> [Lib; 2] {
    [
        Lib { name: "release", dir: release_dir(), link: "numaweave" },
        Lib { name: "hardened", dir: hardened_dir(), link: "numaweave_hardened" },
    ]
}

/// A C compiler, or `None` having said the test cannot run.
fn c_compiler() -> Option<String> {
    let cc = tool(&["cc", "gcc", "clang"]);
    if cc.is_none() {
        cannot_run("no C compiler (cc, gcc, clang) on PATH");
    }
    cc
}

/// A C++ compiler, or `None` having said the test cannot run.
fn cxx_compiler() -> Option<String> {
    let cxx = tool(&["c++", "g++", "clang++"]);
    if cxx.is_none() {
        cannot_run("no C++ compiler (c++, g++, clang++) on PATH");
    }
    cxx
}

/// A test (or a leg of one) cannot run: said on the terminal, past the
/// harness's capture, and a failure under `NUMAWEAVE_TEST_STRICT`.
fn cannot_run(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
    assert!(std::env::var_os("NUMAWEAVE_TEST_STRICT").is_none(), "{why}, and NUMAWEAVE_TEST_STRICT is set");
}

/// The first of `names` that runs, if any.
fn tool(names: &[&str]) -> Option<String> {
    names
        .iter()
        .find(|n| Command::new(n).arg("--version").output().is_ok_and(|o| o.status.success()))
        .map(|n| n.to_string())
}

fn src(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c").join(name)
}

/// A scratch directory for one test's programs, under the target
/// directory (each run overwrites the last; nothing is left in `/tmp`).
fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("capi-{name}"));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run(cmd: &mut Command) -> Output {
    // Cargo runs tests with `LD_LIBRARY_PATH` naming `target/debug`, where
    // the test profile's `libnumaweave.so` lies: it outranks a program's
    // RUNPATH, and the programs ran against the debug library, not the
    // release one they were linked with. Gone, the RUNPATH decides.
    cmd.env_remove("LD_LIBRARY_PATH");
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    out
}

fn compile(compiler: &str, args: &[&str]) {
    let out = run(Command::new(compiler).args(args));
    assert!(out.status.success(), "{compiler} {args:?} failed");
}

/// Compiles `source` linked with `lib` (the header from the release
/// directory: the same API in both), into a scratch directory of its own.
fn build_linked(compiler: &str, source: &str, lib: &Lib, extra: &[&str]) -> PathBuf {
    build_linked_with(compiler, source, lib, extra, &[])
}

/// [`build_linked`], with libraries `libs` linked after the program.
fn build_linked_with(compiler: &str, source: &str, lib: &Lib, extra: &[&str], libs: &[&str]) -> PathBuf {
    let include = release_dir();
    let name = source.split('.').next().unwrap();
    let exe = scratch(&format!("{name}-{}", lib.name)).join(name);
    let d = lib.dir.to_str().unwrap();
    let mut args = vec!["-O1", "-g", "-Wall", "-Werror", "-I", include.to_str().unwrap()];
    args.extend(extra);
    let s = src(source);
    let rpath = format!("-Wl,-rpath,{d}");
    let l = format!("-l{}", lib.link);
    args.extend([s.to_str().unwrap(), "-o", exe.to_str().unwrap(), "-L", d, l.as_str(), rpath.as_str()]);
    args.extend(libs);
    args.extend(["-ldl", "-lpthread"]);
    compile(compiler, &args);
    exe
}

/// Runs `exe` and asserts it exited 0 and printed "checks passed".
fn passes(exe: &Path, lib: &Lib, env: &[(&str, &str)]) -> Output {
    let out = run(Command::new(exe).envs(env.iter().copied()));
    let what = format!("{} on the {} library", exe.display(), lib.name);
    assert!(out.status.success(), "{what} failed: {:?}", out.status);
    assert!(String::from_utf8_lossy(&out.stdout).contains("checks passed"), "{what}: no closing line");
    out
}

/// Runs `cmd` for at most `limit`; a run that takes longer is killed and
/// fails the test as a hang.
fn run_bounded(cmd: &mut Command, limit: std::time::Duration, what: &str) -> Output {
    use std::process::Stdio;
    cmd.env_remove("LD_LIBRARY_PATH").stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            eprint!("{}", String::from_utf8_lossy(&out.stderr));
            panic!("{what}: still running after {limit:?}: a hang");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    out
}

/// Compiles `source` alone (nothing of numaweave linked: it is preloaded),
/// into a scratch directory of its own.
fn build_plain(cc: &str, source: &str) -> PathBuf {
    let name = source.split('.').next().unwrap();
    let exe = scratch(name).join(name);
    let include = src("");
    compile(
        cc,
        &[
            "-O1",
            "-fno-builtin",
            "-Wall",
            "-Werror",
            "-I",
            include.to_str().unwrap(),
            src(source).to_str().unwrap(),
            "-o",
            exe.to_str().unwrap(),
            "-ldl",
            "-lpthread",
        ],
    );
    exe
}

/// Runs `exe args` under glibc's malloc (the control), then with each
/// library preloaded, each bounded by `limit`; each must exit 0 and print
/// "checks passed".
fn passes_preloaded_and_under_glibc(exe: &Path, args: &[&str], limit: std::time::Duration) {
    let libs = libraries();
    let mut runs: Vec<(&str, Option<PathBuf>)> = vec![("glibc", None)];
    runs.extend(libs.iter().map(|l| (l.name, Some(l.so()))));
    for (name, so) in runs {
        let mut cmd = Command::new(exe);
        cmd.args(args);
        if let Some(so) = &so {
            cmd.env("LD_PRELOAD", so);
        }
        let what = format!("{} {args:?} under {name}", exe.display());
        let out = run_bounded(&mut cmd, limit, &what);
        assert!(out.status.success(), "{what} failed: {:?}", out.status);
        assert!(String::from_utf8_lossy(&out.stdout).contains("checks passed"), "{what}: no closing line");
    }
}

#[test]
fn a_threads_first_allocations_touch_little_of_its_stack() {
    let Some(cc) = c_compiler() else { return };
    let exe = build_plain(&cc, "stack.c");
    passes_preloaded_and_under_glibc(&exe, &[], std::time::Duration::from_secs(60));
}

#[test]
fn fork_is_safe_against_stdio_and_from_a_signal_handler() {
    let Some(cc) = c_compiler() else { return };
    let exe = build_plain(&cc, "forks.c");
    // A hang showed within a second or two (the stdio case hung every run
    // of 5 s before the list lock was taken first, the signal case within
    // 2,000 signals). Longer: `FORKS_SECONDS=60 FORKS_SIGNALS=10000 cargo
    // test -p numaweave-capi --test c_programs fork`.
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let (seconds, signals) = (env("FORKS_SECONDS", "2"), env("FORKS_SIGNALS", "1500"));
    let limit = std::time::Duration::from_secs(60 + 2 * seconds.parse::<u64>().unwrap_or(0));
    passes_preloaded_and_under_glibc(&exe, &["stdio", &seconds], limit);
    passes_preloaded_and_under_glibc(&exe, &["signal", &signals], limit);
}

#[test]
fn every_failure_sets_errno_as_glibcs_malloc_does() {
    let Some(cc) = c_compiler() else { return };
    let exe = build_plain(&cc, "failures.c");
    let limit = std::time::Duration::from_secs(120);
    passes_preloaded_and_under_glibc(&exe, &["all"], limit);
    passes_preloaded_and_under_glibc(&exe, &["limit"], limit);
    passes_preloaded_and_under_glibc(&exe, &["nommap"], limit);
}

#[test]
fn every_exported_function_at_its_edges() {
    let libs = libraries();
    let Some(cc) = c_compiler() else { return };
    for lib in &libs {
        let exe = build_linked(&cc, "edges.c", lib, &["-std=c11"]);
        // (The hardened library reports a foreign free: edges.c leaves
        // foreign pointers out there.)
        let env: &[(&str, &str)] = if lib.hardened() { &[("EDGES_HARDENED", "1")] } else { &[] };
        let out = passes(&exe, lib, env);
        // The statistics went to stderr (malloc_stats).
        assert!(String::from_utf8_lossy(&out.stderr).contains("numaweave: mode"));
    }
}

#[test]
fn a_caches_regions_registered_once_and_unregistered_once() {
    let libs = libraries();
    let Some(cc) = c_compiler() else { return };
    // The io_uring leg where liburing is installed (Debian's liburing-dev).
    let uring = Path::new("/usr/include/liburing.h").is_file();
    if !uring {
        cannot_run("the io_uring leg: /usr/include/liburing.h not found (liburing-dev)");
    }
    let (extra, link): (&[&str], &[&str]) =
        if uring { (&["-std=gnu11", "-DHAVE_LIBURING"], &["-luring"]) } else { (&["-std=gnu11"], &[]) };
    for lib in &libs {
        let exe = build_linked_with(&cc, "register.c", lib, extra, link);
        passes(&exe, lib, &[]);
    }
}

#[test]
fn a_forked_worker_keeps_its_own_descriptors_and_gets_its_own_table() {
    let libs = libraries();
    let Some(cc) = c_compiler() else { return };
    for lib in &libs {
        let exe = build_linked(&cc, "prefork.c", lib, &["-std=gnu11"]);
        let logs = scratch(&format!("prefork-logs-{}", lib.name));
        let out = run_bounded(Command::new(&exe).arg(&logs), std::time::Duration::from_secs(120), "prefork.c");
        assert!(out.status.success(), "prefork.c on the {} library: {:?}", lib.name, out.status);
        assert!(String::from_utf8_lossy(&out.stdout).contains("checks passed"));
    }
}

#[test]
fn the_malloc_abi_as_the_standards_state_it() {
    let libs = libraries();
    let Some(cc) = c_compiler() else { return };
    for lib in &libs {
        let exe = build_linked(&cc, "abi.c", lib, &["-std=gnu11", "-O2"]);
        passes(&exe, lib, &[]);
    }
}

#[test]
fn cxx_new_and_delete_in_every_form() {
    let libs = libraries();
    let Some(cxx) = cxx_compiler() else { return };
    for lib in &libs {
        let exe = build_linked(&cxx, "cxx.cc", lib, &["-std=c++17"]);
        passes(&exe, lib, &[]);
        // The same program with the library preloaded instead (the C++
        // runtime's own operators are then interposed too).
        passes(&exe, lib, &[("LD_PRELOAD", lib.so().to_str().unwrap())]);
    }
}

#[test]
fn hinted_new_keeps_hot_and_cold_apart() {
    let libs = libraries();
    let Some(cxx) = cxx_compiler() else { return };
    for lib in &libs {
        let exe = build_linked(&cxx, "hotcold.cc", lib, &["-std=c++17"]);
        passes(&exe, lib, &[]);
        passes(&exe, lib, &[("LD_PRELOAD", lib.so().to_str().unwrap())]);
    }
}

#[test]
fn a_process_life_under_preload() {
    let libs = libraries();
    let Some(cc) = c_compiler() else { return };
    let dir = scratch("life");
    let user = dir.join("libuser.so");
    compile(&cc, &["-O1", "-shared", "-fPIC", src("user.c").to_str().unwrap(), "-o", user.to_str().unwrap()]);
    let life = dir.join("life");
    compile(
        &cc,
        &[
            "-O1",
            "-Wall",
            "-Werror",
            src("life.c").to_str().unwrap(),
            "-o",
            life.to_str().unwrap(),
            "-ldl",
            "-lpthread",
        ],
    );
    for lib in &libs {
        let so = lib.so();
        let out = run(Command::new(&life).args(["all", user.to_str().unwrap()]).env("LD_PRELOAD", &so));
        assert!(out.status.success(), "life.c failed on the {} library", lib.name);
        assert!(String::from_utf8_lossy(&out.stdout).contains("life: exec ok"), "the exec'd program did not check in");
        // exit() while four threads allocate, with the statistics printed at exit.
        for _ in 0..5 {
            let out = run(Command::new(&life).arg("exit").env("LD_PRELOAD", &so).env("NUMAWEAVE_SHOW_STATS", "1"));
            assert!(out.status.success(), "exit() while threads allocate: {:?}", out.status);
            assert!(String::from_utf8_lossy(&out.stderr).contains("remote frees"), "no statistics at exit");
        }
    }
}

#[test]
fn fast_paths_make_no_tls_call_and_new_no_call() {
    let lib = release_dir().join("libnumaweave.so");
    let Some(objdump) = tool(&["objdump"]) else {
        cannot_run("no objdump on PATH");
        return;
    };
    let run = |args: &[&str]| {
        let out = Command::new(&objdump).args(args).arg(&lib).output().unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let (symbols, text) = (run(&["-T"]), run(&["-d", "--no-show-raw-insn"]));
    // A function's instructions, found by its exported symbol's address
    // (the linker may fold two identical functions, `_Znwm` and `_Znam`,
    // into one, which objdump labels with one of the names).
    let body = |f: &str| -> Vec<&str> {
        let addr = symbols
            .lines()
            .find(|l| l.split_whitespace().last() == Some(f))
            .and_then(|l| l.split_whitespace().next())
            .unwrap_or_else(|| panic!("{f} not exported by {}", lib.display()));
        let start = format!("{addr} <");
        let body: Vec<&str> =
            text.lines().skip_while(|l| !l.starts_with(&start)).skip(1).take_while(|l| !l.trim().is_empty()).collect();
        assert!(!body.is_empty(), "{f} not found in {}", lib.display());
        body
    };
    for f in ["malloc", "free", "calloc", "realloc"] {
        let body = body(f);
        let tls: Vec<&&str> = body.iter().filter(|l| l.contains("__tls_get_addr")).collect();
        assert!(tls.is_empty(), "{f} calls __tls_get_addr (general-dynamic TLS on its path): {tls:?}");
        println!("{f}: {} instructions, no __tls_get_addr", body.len());
    }
    // C++'s plain `new` (and the hinted one) leaves its fast path by a tail
    // call: an exception
    // thrown after it (std::bad_alloc, a new-handler's) must find no frame
    // of Rust's on its way (a foreign exception entering a frame built with
    // `panic = "abort"` is undefined behaviour: RFC 2945). `cxx.cc` throws
    // them, but would not see a frame's harm every time.
    for f in ["_Znwm", "_Znam", "_Znwm12__hot_cold_t", "_Znam12__hot_cold_t"] {
        let body = body(f);
        let calls: Vec<&&str> = body.iter().filter(|l| l.contains("call")).collect();
        assert!(calls.is_empty(), "{f} keeps a frame across a call: {calls:?}");
        println!("{f}: {} instructions, no call", body.len());
    }
}

#[test]
fn the_hardened_library_reports_each_misuse_and_aborts() {
    use std::os::unix::process::ExitStatusExt;
    let hardened = hardened_dir().join("libnumaweave_hardened.so");
    let Some(cc) = c_compiler() else { return };
    let dir = release_dir();
    let exe = scratch("misuse").join("misuse");
    // Linked with the plain library for the slab API's symbols; the
    // hardened one, preloaded, provides every symbol first.
    let d = dir.to_str().unwrap();
    compile(
        &cc,
        &[
            "-O0",
            "-fno-builtin",
            "-Wall",
            "-Werror",
            "-I",
            d,
            src("misuse.c").to_str().unwrap(),
            "-o",
            exe.to_str().unwrap(),
            "-L",
            d,
            "-lnumaweave",
            &format!("-Wl,-rpath,{d}"),
            "-lpthread",
        ],
    );
    let full = [("NUMAWEAVE_CHECK", "full")];
    let cases: [(&str, &[(&str, &str)]); 11] = [
        ("double-free", &[]),
        ("double-free-other-thread", &[]),
        ("double-free-huge", &[]),
        ("double-free-slab", &[]),
        ("overflow-24", &full),
        ("overflow-20", &full),
        ("write-after-free", &full),
        ("stack-pointer", &[]),
        ("static-pointer", &[]),
        ("interior-pointer", &[]),
        ("wrong-slab-cache", &[]),
    ];
    for (case, env) in cases {
        let out = Command::new(&exe)
            .arg(case)
            .env("LD_PRELOAD", &hardened)
            .env_remove("NUMAWEAVE_CHECK")
            .env_remove("NUMAWEAVE_ON_ERROR")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = err.lines().collect();
        let at = lines.iter().position(|l| l.starts_with("EXPECT ")).unwrap_or_else(|| panic!("{case}: {err}"));
        assert_eq!(lines.get(at + 1).copied(), Some(&lines[at][7..]), "{case}: stderr was\n{err}");
        assert_eq!(out.status.signal(), Some(libc::SIGABRT), "{case}: {:?}, stderr was\n{err}", out.status);
    }
    // The production switch: reported, leaked, and the program goes on.
    let out = Command::new(&exe)
        .arg("double-free")
        .env("LD_PRELOAD", &hardened)
        .env("NUMAWEAVE_ON_ERROR", "report")
        .output()
        .unwrap();
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("survived"), "{out:?}");
}
