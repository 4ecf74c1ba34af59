//! Hardened builds (`--features hardened`): every misuse the issue lists is
//! caught with its exact one-line report, then `abort()`. Each misuse runs in
//! a child process (this test binary again, told the case by an environment
//! variable); the child prints the report it expects, computed from the
//! addresses it got, before committing the misuse, and the parent compares.

#![cfg(feature = "hardened")]

use std::alloc::{GlobalAlloc, Layout};
use std::process::Command;
use std::ptr::NonNull;

use numaweave::NumaAlloc;
use numaweave::slab::RawCache;

mod support;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

const CASE: &str = "NUMAWEAVE_TEST_MISUSE";

/// Tells the parent which report must follow.
fn expect(line: String) {
    eprintln!("EXPECT {line}");
}

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

/// A small segment's size and alignment.
const SEGMENT: usize = 4 << 20;

/// `full` under `NUMAWEAVE_CHECK=full`, else `plain`.
fn full_or(full: usize, plain: usize) -> usize {
    if std::env::var("NUMAWEAVE_CHECK").is_ok_and(|v| v == "full") { full } else { plain }
}

/// The misuses, by name; each ends in the report (and abort) or returns.
fn misuse(case: &str) {
    // SAFETY: deliberate misuse of blocks of this allocator, which a
    // hardened build must catch before touching anything it should not.
    unsafe {
        match case {
            "past-a-huge-block" => {
                // A huge block's usable end is its mapping's end: under
                // `NUMAWEAVE_GUARD=1` the next page is the guard.
                let l = layout(8 << 20, 16);
                let p = A.alloc(l);
                let end = p.add(A.usable_size(p));
                end.sub(1).write_volatile(1);
                // What the kernel has at `end`: the guard, mapped, no access.
                let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
                let at = end as usize;
                let perms = maps.lines().find_map(|l| {
                    let (range, rest) = l.split_once(' ')?;
                    let (a, b) = range.split_once('-')?;
                    let (a, b) = (usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?);
                    (a <= at && at < b).then(|| rest[..4].to_string())
                });
                eprintln!("GUARD {}", perms.as_deref().unwrap_or("unmapped"));
                eprintln!("WRITING {end:p}");
                end.write_volatile(1);
                eprintln!("NOT STOPPED");
            }
            "double-free-local" => {
                let p = A.alloc(layout(64, 8));
                A.dealloc(p, layout(64, 8));
                expect(format!("numaweave: double free of {p:p} (64-byte block, node 0)"));
                A.dealloc(p, layout(64, 8));
            }
            "double-free-other-thread" => {
                let p = A.alloc(layout(64, 8));
                let q = p as usize;
                std::thread::spawn(move || A.dealloc(q as *mut u8, layout(64, 8))).join().unwrap();
                expect(format!("numaweave: double free of {p:p} (64-byte block, node 0)"));
                A.dealloc(p, layout(64, 8));
            }
            "double-free-huge" => {
                let l = layout(64 << 20, 8);
                let p = A.alloc(l);
                A.dealloc(p, l);
                expect(format!("numaweave: double free of {p:p} (huge block)"));
                A.dealloc(p, l);
            }
            "double-free-interleaved" => {
                let l = layout(8192, 4096);
                let p = A.alloc(l);
                let node = A.node_of(p);
                A.dealloc(p, l);
                expect(format!("numaweave: double free of {p:p} (8192-byte interleaved block, node {node})"));
                A.dealloc(p, l);
            }
            "double-free-slab" => {
                let c = RawCache::builder("sense", 96).build().unwrap();
                let p = c.alloc().unwrap();
                c.free(p);
                expect(format!("numaweave: double free of {p:p} (slab cache \"sense\", node 0)"));
                c.free(p);
            }
            "overflow-24" => {
                let p = A.alloc(layout(24, 8));
                p.add(24).write(1);
                expect(format!(
                    "numaweave: write past the end of {p:p} (32-byte block, node 0): the red zone after it was overwritten"
                ));
                A.dealloc(p, layout(24, 8));
            }
            "overflow-20" => {
                let p = A.alloc(layout(20, 4));
                p.add(21).write(1);
                expect(format!(
                    "numaweave: write past the end of {p:p} (32-byte block, node 0, 20 bytes asked): byte 1 after its end changed"
                ));
                A.dealloc(p, layout(20, 4));
            }
            "write-after-free" => {
                let p = A.alloc(layout(64, 8));
                A.dealloc(p, layout(64, 8));
                p.add(40).write(7);
                expect(format!(
                    "numaweave: write after free into {p:p} (80-byte block, node 0): byte 40 changed (to 0x07)"
                ));
                let q = A.alloc(layout(64, 8));
                // The block comes back first (LIFO): the report is above.
                eprintln!("not reported; got {q:p}");
            }
            "corrupted-link" => {
                let l = layout(64, 8);
                let p = A.alloc(l);
                let q = A.alloc(l);
                A.dealloc(q, l);
                A.dealloc(p, l);
                // A write after free over the link of the list's head (the
                // last block freed): the pop that hands `p` out again makes
                // where it points the head, which the next pop checks before
                // it reads through it (under `NUMAWEAVE_CHECK=full` the
                // first pop checks the link). Where it points, decoded with
                // the page's key, only the allocator knows: the report is
                // matched up to there.
                p.cast::<usize>().write(0x4141_4141_4141_4141);
                let page = p as usize & !0xffff;
                expect(format!(
                    "numaweave: corrupted free list in the 64-byte page at {page:#x} (node 0): a free block links to ..."
                ));
                let r = A.alloc(l);
                let s = A.alloc(l);
                eprintln!("not reported; got {r:p}, {s:p}");
            }
            "stack-pointer" => {
                let x = 5u64;
                let p = &x as *const u64 as *mut u8;
                expect(format!("numaweave: free of {p:p}, which numaweave did not allocate"));
                A.free(p);
            }
            "interior-pointer" => {
                let p = A.alloc(layout(64, 8));
                let i = p.add(16);
                expect(format!("numaweave: free of {i:p}, inside the 64-byte block at {p:p} (node 0)"));
                A.free(i);
            }
            "huge-interior" => {
                let p = A.alloc(layout(300_000, 8));
                let i = p.add(4096);
                expect(format!("numaweave: free of {i:p}, inside the huge block at {p:p} (node 0)"));
                A.free(i);
            }
            "beside-huge" => {
                // Past the block's mapping, in its chunk: anyone's address
                // space (nothing of it is read).
                let p = A.alloc(layout(300_000, 8));
                let q = (p as usize & !(SEGMENT - 1)) + SEGMENT / 2;
                expect(format!("numaweave: free of {q:#x}, which numaweave did not allocate"));
                A.free(q as *mut u8);
            }
            "beside-freed-huge" => {
                // The same once the block is freed: a double free is its
                // start's only.
                let p = A.alloc(layout(300_000, 8));
                A.free(p);
                let q = (p as usize & !(SEGMENT - 1)) + SEGMENT / 2;
                expect(format!("numaweave: free of {q:#x}, which numaweave did not allocate"));
                A.free(q as *mut u8);
            }
            // The cases below also run under `NUMAWEAVE_CHECK=full`, where a
            // request gets 8 bytes more (its class: 72 -> 80, 40 -> 48) and
            // every small free is checked out of line.
            "double-free-72" => {
                let p = A.alloc(layout(72, 8));
                A.dealloc(p, layout(72, 8));
                expect(format!("numaweave: double free of {p:p} ({}-byte block, node 0)", full_or(80, 72)));
                A.dealloc(p, layout(72, 8));
            }
            "interior-72" => {
                let p = A.alloc(layout(72, 8));
                let i = p.add(16);
                let bs = full_or(80, 72);
                expect(format!("numaweave: free of {i:p}, inside the {bs}-byte block at {p:p} (node 0)"));
                A.free(i);
            }
            "outside-the-blocks" => {
                // A one-slot page of 48-byte blocks: 1365 of them span
                // 65,520 bytes, and the last 16 hold none.
                let p = A.alloc(layout(full_or(40, 48), 8));
                let q = (p as usize & !0xffff) + 65_520;
                expect(format!("numaweave: free of {q:#x}, outside the blocks of a 48-byte page (node 0)"));
                A.free(q as *mut u8);
            }
            "page-freed-already" => {
                // A block over 64 KiB has a page of its own: freed, the page
                // is empty; `collect` gives it back to the arena.
                // (The report's text is made first: an allocation after
                // `collect` could take the page's slots again.)
                let l = layout(100 << 10, 8);
                let p = A.alloc(l);
                let line = format!("numaweave: double free of {p:p} (node 0): its page was freed already");
                A.dealloc(p, l);
                A.collect();
                expect(line);
                A.dealloc(p, l);
            }
            "stale-descriptor" => {
                // A page of 20,000-byte blocks (class 20 KiB, with the red
                // zone too) spans four slots: block 4 starts in its second.
                // Freed and given back, the page leaves its descriptor named
                // by the slot map of all four slots; the second's entry must
                // not be taken for a live page's.
                let l = layout(20_000, 8);
                let blocks: Vec<*mut u8> = (0..12).map(|_| A.alloc(l)).collect();
                let start = blocks.iter().map(|&b| b as usize).min().unwrap();
                assert_eq!(start & 0xffff, 0, "a fresh page's first block starts its first slot");
                let p = (start + 4 * 20_480) as *mut u8;
                assert!(blocks.contains(&p) && p as usize - start >= 0x10000, "block 4 in the page's second slot");
                let line = format!("numaweave: double free of {p:p} (node 0): its page was freed already");
                for &b in &blocks {
                    A.dealloc(b, l);
                }
                A.collect();
                expect(line);
                A.dealloc(p, l);
            }
            "header-pointer" => {
                let p = A.alloc(layout(64, 8));
                let h = ((p as usize & !(SEGMENT - 1)) + 0x200) as *mut u8;
                expect(format!("numaweave: free of {h:p}, inside a segment's header (node 0): not a block"));
                A.free(h);
            }
            "segment-end" => {
                // Rounded as `p - 1`, the segment's end maps to the segment.
                let p = A.alloc(layout(64, 8));
                let e = ((p as usize & !(SEGMENT - 1)) + SEGMENT) as *mut u8;
                expect(format!("numaweave: free of {e:p}, which numaweave did not allocate"));
                A.free(e);
            }
            "wrong-slab-cache" => {
                let a = RawCache::builder("io_cmd", 256).build().unwrap();
                let b = RawCache::builder("sense_buf", 96).build().unwrap();
                let p = a.alloc().unwrap();
                expect(format!("numaweave: object {p:p} of slab cache \"io_cmd\" freed into slab cache \"sense_buf\""));
                b.free(p);
            }
            "slab-stack-pointer" => {
                let b = RawCache::builder("sense_buf", 96).build().unwrap();
                let mut x = [0u8; 96];
                let p = NonNull::new(x.as_mut_ptr()).unwrap();
                expect(format!("numaweave: {p:p} freed into slab cache \"sense_buf\" is not in any slab"));
                b.free(p);
            }
            "slab-overflow" => {
                let c = RawCache::builder("sense", 96).build().unwrap();
                let p = c.alloc().unwrap();
                p.as_ptr().add(96).write(1);
                expect(format!(
                    "numaweave: write past the end of {p:p} (slab cache \"sense\", 96-byte objects): byte 0 after its end changed"
                ));
                c.free(p);
            }
            "slab-write-after-free" => {
                let c = RawCache::builder("sense", 96).build().unwrap();
                let p = c.alloc().unwrap();
                c.free(p);
                p.as_ptr().add(50).write(1);
                expect(format!(
                    "numaweave: write after free into {p:p} (slab cache \"sense\", 96-byte objects): byte 50 changed (to 0x01)"
                ));
                let _q = c.alloc().unwrap();
            }
            "report-and-go-on" => {
                // NUMAWEAVE_ON_ERROR=report: each misuse is reported, the
                // block leaked, and the heap stays sound.
                let l = layout(64, 8);
                let (a, b) = (A.alloc(l), A.alloc(l));
                A.dealloc(b, l);
                A.dealloc(a, l);
                a.cast::<usize>().write(0x4141_4141_4141_4141);
                expect(format!(
                    "numaweave: corrupted free list in the 64-byte page at {:#x} (node 0): a free block links to ...",
                    a as usize & !0xffff
                ));
                // The list is dropped; the second allocation is served all
                // the same, not from where the link pointed.
                let (r, s) = (A.alloc(l), A.alloc(l));
                assert!(!r.is_null() && !s.is_null() && r != s);
                let p = A.alloc(layout(64, 8));
                A.dealloc(p, layout(64, 8));
                expect(format!("numaweave: double free of {p:p} (64-byte block, node 0)"));
                A.dealloc(p, layout(64, 8));
                let c = RawCache::builder("sense", 96).build().unwrap();
                let o = c.alloc().unwrap();
                c.free(o);
                expect(format!("numaweave: double free of {o:p} (slab cache \"sense\", node 0)"));
                c.free(o);
                // The double frees did not put the blocks on a list twice:
                // live blocks never share an address.
                let mut seen = std::collections::HashSet::new();
                let blocks: Vec<_> = (0..10_000).map(|_| A.alloc(layout(64, 8))).collect();
                assert!(blocks.iter().all(|&b| seen.insert(b as usize)));
                let objs: Vec<_> = (0..1000).map(|_| c.alloc().unwrap()).collect();
                assert!(objs.iter().all(|&o| seen.insert(o.as_ptr() as usize)));
                eprintln!("went on");
            }
            "none" => busy(),
            other => panic!("unknown misuse {other}"),
        }
    }
}

/// Correct use, busy: sizes from 1 B to 1 MiB, reallocs, slab objects,
/// what is left freed on another thread; every byte checked before a free.
fn busy() {
    let c = RawCache::builder("sense", 96).build().unwrap();
    let check = |p: usize, n: usize, v: u8| {
        // SAFETY: a live block of at least `n` bytes.
        assert!((0..n).all(|k| unsafe { *(p as *const u8).add(k) } == v), "block {p:#x} changed");
    };
    let left: Vec<_> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4u64)
            .map(|t| {
                let c = &c;
                s.spawn(move || {
                    let mut r = support::Rng(0x9e37_79b9_7f4a_7c15u64 ^ t);
                    let mut rng = move || r.next();
                    let mut live: Vec<(usize, usize, u8)> = Vec::new();
                    let mut objs: Vec<(usize, usize, u8)> = Vec::new();
                    for i in 0..20_000u32 {
                        let r = rng();
                        let size = ((1usize << (r % 21)) + (r >> 32) as usize % 64).min(1 << 20);
                        let v = (i % 251) as u8;
                        // SAFETY: blocks of this allocator, used within their sizes.
                        unsafe {
                            let p = A.alloc(layout(size, 8));
                            assert!(!p.is_null());
                            p.write_bytes(v, size);
                            live.push((p as usize, size, v));
                            if live.len() > 64 {
                                let (q, n, w) = live.swap_remove((r >> 8) as usize % live.len());
                                check(q, n, w);
                                if r & 1 == 0 {
                                    let m = n / 2 + 1;
                                    let q2 = A.realloc(q as *mut u8, layout(n, 8), m);
                                    check(q2 as usize, m.min(n), w);
                                    A.dealloc(q2, layout(m, 8));
                                } else {
                                    A.dealloc(q as *mut u8, layout(n, 8));
                                }
                            }
                            let o = c.alloc().unwrap();
                            o.as_ptr().write_bytes(v, 96);
                            objs.push((o.as_ptr() as usize, 96, v));
                            if objs.len() > 32 {
                                let (o, n, w) = objs.swap_remove(0);
                                check(o, n, w);
                                c.free(NonNull::new(o as *mut u8).unwrap());
                            }
                        }
                    }
                    (live, objs)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    for (live, objs) in left {
        for (p, n, v) in live {
            check(p, n, v);
            // SAFETY: a live block of this allocator.
            unsafe { A.dealloc(p as *mut u8, layout(n, 8)) };
        }
        for (o, n, v) in objs {
            check(o, n, v);
            // SAFETY: a live object of `c`.
            unsafe { c.free(NonNull::new(o as *mut u8).unwrap()) };
        }
    }
}

/// Runs `case` in a child; returns its stderr and whether it aborted.
fn run(case: &str, env: &[(&str, &str)]) -> (String, bool) {
    let (err, signal) = run_to_signal(case, env);
    (err, signal == Some(libc::SIGABRT))
}

/// Runs `case` in a child; returns its stderr and the signal it died of.
fn run_to_signal(case: &str, env: &[(&str, &str)]) -> (String, Option<i32>) {
    use std::os::unix::process::ExitStatusExt;
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(CASE, case)
        .env_remove("NUMAWEAVE_CHECK")
        .env_remove("NUMAWEAVE_GUARD")
        .env_remove("NUMAWEAVE_ON_ERROR")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (err, out.status.signal())
}

/// The child's side: commits the misuse named in the environment.
#[test]
fn child() {
    if let Ok(case) = std::env::var(CASE) {
        misuse(&case);
    }
}

/// Whether `got`, the line after an expectation, is the report `want`
/// names: the same line, or (`want` ending in `...`) one that goes on from
/// where it stops.
fn is_report(want: &str, got: Option<&str>) -> bool {
    let got = got.unwrap_or("");
    match want.strip_suffix("...") {
        Some(prefix) => got.starts_with(prefix) && got.len() > prefix.len(),
        None => got == want,
    }
}

/// Checks that `case` aborts right after its expected report.
fn aborts_with_report(case: &str, env: &[(&str, &str)]) {
    let (err, aborted) = run(case, env);
    let lines: Vec<&str> = err.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.starts_with("EXPECT "))
        .unwrap_or_else(|| panic!("{case}: no expectation in\n{err}"));
    assert!(is_report(&lines[at][7..], lines.get(at + 1).copied()), "{case}: stderr was\n{err}");
    assert!(aborted, "{case}: did not abort; stderr was\n{err}");
}

#[test]
fn double_free_local() {
    aborts_with_report("double-free-local", &[]);
}

#[test]
fn double_free_from_another_thread() {
    aborts_with_report("double-free-other-thread", &[]);
}

#[test]
fn double_free_huge() {
    aborts_with_report("double-free-huge", &[]);
}

#[test]
fn double_free_interleaved() {
    aborts_with_report(
        "double-free-interleaved",
        &[
            ("NUMAWEAVE_TOPOLOGY", "fake:2"),
            ("NUMAWEAVE_MODE", "per-node"),
            ("NUMAWEAVE_POLICY", "interleave:0-1:count=1"),
        ],
    );
}

#[test]
fn double_free_slab() {
    aborts_with_report("double-free-slab", &[]);
}

#[test]
fn overflow_by_one_byte() {
    aborts_with_report("overflow-24", &[("NUMAWEAVE_CHECK", "full")]);
    aborts_with_report("overflow-20", &[("NUMAWEAVE_CHECK", "full")]);
}

#[test]
fn write_after_free() {
    aborts_with_report("write-after-free", &[("NUMAWEAVE_CHECK", "full")]);
}

#[test]
fn corrupted_free_list_link() {
    aborts_with_report("corrupted-link", &[]);
}

#[test]
fn free_of_a_stack_pointer() {
    aborts_with_report("stack-pointer", &[]);
    aborts_with_report("slab-stack-pointer", &[]);
}

#[test]
fn free_of_an_interior_pointer() {
    aborts_with_report("interior-pointer", &[]);
    aborts_with_report("huge-interior", &[]);
}

/// `NUMAWEAVE_GUARD=1`: a write past a huge block's end meets the guard
/// page (SIGSEGV at the write); without it, the next page is unmapped
/// address space or another mapping, and nothing is promised.
#[test]
fn a_write_past_a_huge_block_meets_its_guard_page() {
    let (err, signal) = run_to_signal("past-a-huge-block", &[("NUMAWEAVE_GUARD", "1")]);
    assert!(err.contains("GUARD ---p"), "no guard page after the block: {err}");
    assert!(err.contains("WRITING") && !err.contains("NOT STOPPED"), "{err}");
    assert_eq!(signal, Some(libc::SIGSEGV), "{err}");
}

#[test]
fn free_of_a_pointer_beside_a_huge_block() {
    aborts_with_report("beside-huge", &[]);
    aborts_with_report("beside-freed-huge", &[]);
}

/// Small blocks' frees that fail the fast path's one bound, told apart out
/// of line; under `NUMAWEAVE_CHECK=full` every small free goes that way.
#[test]
fn small_misuses_with_and_without_full_checks() {
    for env in [&[][..], &[("NUMAWEAVE_CHECK", "full")][..]] {
        for case in [
            "double-free-72",
            "interior-72",
            "outside-the-blocks",
            "page-freed-already",
            "stale-descriptor",
            "header-pointer",
            "segment-end",
        ] {
            aborts_with_report(case, env);
        }
    }
}

#[test]
fn free_into_the_wrong_slab_cache() {
    aborts_with_report("wrong-slab-cache", &[]);
}

#[test]
fn raw_cache_red_zone_and_poison() {
    aborts_with_report("slab-overflow", &[("NUMAWEAVE_CHECK", "full")]);
    aborts_with_report("slab-write-after-free", &[("NUMAWEAVE_CHECK", "full")]);
}

#[test]
fn report_mode_leaks_and_goes_on() {
    let (err, aborted) = run("report-and-go-on", &[("NUMAWEAVE_ON_ERROR", "report")]);
    assert!(!aborted, "{err}");
    let lines: Vec<&str> = err.lines().collect();
    let expected: Vec<_> = lines.iter().enumerate().filter(|(_, l)| l.starts_with("EXPECT ")).collect();
    assert_eq!(expected.len(), 3, "{err}");
    for (i, l) in expected {
        assert!(is_report(&l[7..], lines.get(i + 1).copied()), "{err}");
    }
    assert!(err.contains("went on"), "{err}");
}

#[test]
fn without_misuse_nothing_is_reported() {
    // Every check on, on a busy workload: not one false report.
    let (err, aborted) = run("none", &[("NUMAWEAVE_CHECK", "full")]);
    assert!(!aborted && !err.contains("numaweave:"), "{err}");
}
