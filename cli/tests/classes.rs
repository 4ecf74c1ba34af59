//! `numaweave numastat PID` shows a live program's size classes per node
//! when it publishes them (`NUMAWEAVE_PUBLISH=1`): this test starts itself
//! again as that program (numaweave its allocator), which strands half of
//! a class's blocks, trims (a trim publishes) and says its own figures;
//! the command's row of that class must be the same. A forked child of the
//! program publishes a table of its own and leaves its parent's alone.

use std::alloc::{GlobalAlloc, Layout};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use numaweave::NumaAlloc;
use numaweave::stats::class_table;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

/// Blocks of a class nothing else here uses (3 KiB: 21 to a page).
const SIZE: usize = 3000;
const N: usize = 2100;

/// The class's figures on the node of `p`, as `class_usage` says now:
/// node, block size, pages, in use, stranded.
fn figures(p: *const u8) -> (usize, u64, u64, u64, u64) {
    // SAFETY: a live block of `A`'s.
    let node = unsafe { A.node_of(p) };
    let u = A.class_usage(node).into_iter().find(|c| c.block_size >= SIZE as u64).unwrap();
    (node, u.block_size, u.pages, u.in_use, u.stranded)
}

/// The program: blocks made, every other freed, a trim; its figures on
/// stdout; with `fork`, a child that makes more blocks of the class and
/// trims, and checks the tables it can see. Waits for stdin to close.
fn program(fork: bool) {
    let l = Layout::from_size_align(SIZE, 8).unwrap();
    // SAFETY: a valid layout; every other block freed below, the rest kept.
    let blocks: Vec<usize> = (0..N).map(|_| unsafe { A.alloc(l) } as usize).collect();
    for (i, &b) in blocks.iter().enumerate() {
        assert!(b != 0);
        // SAFETY: a live block of `SIZE` bytes.
        unsafe { (b as *mut u8).write_bytes(i as u8, SIZE) };
        if i % 2 == 1 {
            // SAFETY: allocated above with `l`, freed once.
            unsafe { A.dealloc(b as *mut u8, l) };
        }
    }
    A.trim();
    let f = figures(blocks[0] as *const u8);
    if fork {
        child_publishes_its_own(l, f);
    }
    println!("ready {} {} {} {} {}", f.0, f.1, f.2, f.3, f.4);
    std::io::stdout().flush().unwrap();
    let _ = std::io::stdin().lines().count();
}

/// In a forked child: more blocks of the class and a trim publish the
/// child's own table (its pid, its figures); the parent's file, which the
/// child still holds open, keeps the parent's pid and figures.
fn child_publishes_its_own(l: Layout, parent: (usize, u64, u64, u64, u64)) {
    let parent_pid = std::process::id();
    // SAFETY: the process is single-threaded here but for the harness's
    // main thread, which waits in a join: the child runs only this code,
    // then `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = std::panic::catch_unwind(|| {
            // SAFETY: a valid layout; the blocks are the child's, left to its exit.
            let more: Vec<usize> = (0..N).map(|_| unsafe { A.alloc(l) } as usize).collect();
            A.trim();
            let mine = figures(more[0] as *const u8);
            let (mut own, mut parents) = (0, 0);
            for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
                let link = std::fs::read_link(e.path()).unwrap_or_default();
                if !link.to_string_lossy().starts_with("/memfd:numaweave-classes") {
                    continue;
                }
                let t = class_table::read_file(&e.path()).unwrap();
                let row = |t: &class_table::ClassTable, node| {
                    let r = t.rows.iter().find(|r| r.node == node && r.usage.block_size == mine.1).unwrap();
                    (r.node, r.usage.block_size, r.usage.pages, r.usage.in_use, r.usage.stranded)
                };
                if t.pid == std::process::id() {
                    assert_eq!(row(&t, mine.0), mine, "the child's table");
                    own += 1;
                } else {
                    assert_eq!(t.pid, parent_pid);
                    assert_eq!(row(&t, parent.0), parent, "the parent's table, after the child published");
                    parents += 1;
                }
            }
            assert_eq!((own, parents), (1, 1), "tables of the child's and of its parent's");
        });
        // SAFETY: the forked child ends here, running no exit handlers of the parent's.
        unsafe { libc::_exit(i32::from(code.is_err())) };
    }
    let mut status = 0;
    // SAFETY: our child, waited for once.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the forked child failed: {status:#x}");
}

/// Starts this test binary as the program, runs `numaweave numastat` on
/// it, and checks the class's row against the program's figures.
fn run(test: &str) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env("NUMAWEAVE_PUBLISH", "1")
        .env("CLASSES_TEST_PROGRAM", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // A watchdog: a program that hangs is killed (its stdout ends, and
    // the test fails) rather than hanging the test.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (pid, watch) = (child.id() as i32, done.clone());
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(60));
        if !watch.load(std::sync::atomic::Ordering::Relaxed) {
            // SAFETY: a signal to our own child, not yet waited for.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // (After the harness's "test NAME ... " on the same line.)
    let ready = lines.by_ref().map_while(Result::ok).find_map(|l| Some(l.split_once("ready ")?.1.to_owned()));
    let want: Vec<u64> = ready.expect("the program failed").split_whitespace().map(|x| x.parse().unwrap()).collect();
    let out =
        Command::new(env!("CARGO_BIN_EXE_numaweave")).args(["numastat", &child.id().to_string()]).output().unwrap();
    drop(child.stdin.take());
    let status = child.wait().unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(status.success(), "the program failed");
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    assert!(out.status.success());
    assert!(text.contains("Size classes (in KiB)"), "no class table");
    let row: Vec<f64> = text
        .lines()
        .map(|l| l.split_whitespace().filter_map(|x| x.parse::<f64>().ok()).collect::<Vec<_>>())
        .find(|r| r.len() == 7 && r[0] == want[0] as f64 && r[1] == want[1] as f64)
        .expect("the class has no row");
    let kib = |b: u64| b as f64 / 1024.0;
    assert_eq!(row[2], want[2] as f64, "pages");
    assert!((row[4] - kib(want[3])).abs() < 0.06, "in use: {row:?} against {want:?}");
    assert!((row[6] - kib(want[4])).abs() < 0.06, "stranded: {row:?} against {want:?}");
    // Half the blocks stranded, but for what the trim's purges gave back.
    assert!(want[3] >= (N / 2 * SIZE) as u64 && want[4] > 0, "{want:?}");
}

#[test]
fn numastat_shows_the_classes_a_program_publishes() {
    if std::env::var_os("CLASSES_TEST_PROGRAM").is_some() {
        return program(false);
    }
    run("numastat_shows_the_classes_a_program_publishes");
}

#[test]
fn a_forked_child_publishes_a_table_of_its_own() {
    if std::env::var_os("CLASSES_TEST_PROGRAM").is_some() {
        return program(true);
    }
    run("a_forked_child_publishes_a_table_of_its_own");
}

#[test]
fn a_program_that_does_not_publish_says_so() {
    let out = Command::new(env!("CARGO_BIN_EXE_numaweave"))
        .args(["numastat", &std::process::id().to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("no size-class table: start the program with NUMAWEAVE_PUBLISH=1"), "{text}");
}
