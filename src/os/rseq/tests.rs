//! The registration as glibc made it (and its absence under the tunable
//! that turns it off), the fields the kernel fills, and the per-CPU stacks
//! under preemption, migration, signals and fork: no pointer lost or taken
//! twice. A planted non-restartable stack shows the checker finds a pointer
//! taken twice.

use super::*;
use crate::rng::Rng;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TUNABLE: &str = "glibc.pthread.rseq=0";

/// glibc's version as (major, minor).
fn glibc_version() -> (u32, u32) {
    // SAFETY: returns a static NUL-terminated string.
    let v = unsafe { std::ffi::CStr::from_ptr(libc::gnu_get_libc_version()) }.to_string_lossy().into_owned();
    let mut it = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

/// Whether this process runs with glibc's registration turned off.
fn tunable_off() -> bool {
    std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains(TUNABLE))
}

#[test]
fn registration_is_glibcs() {
    let r = registration();
    if tunable_off() {
        assert_eq!(r, None, "glibc registered no area: nothing to share");
        assert!(CpuStacks::new(1, 8).is_none(), "no stacks without a registration");
        return;
    }
    // glibc 2.35 and later register an area on any kernel since 4.18.
    assert!(glibc_version() >= (2, 35), "this test's machine runs glibc 2.35 or later");
    let r = r.expect("glibc registered rseq for this thread");
    assert!(r.feature_size() >= ORIGINAL_FEATURES);
    if super::super::kernel_version() >= (6, 3) {
        assert!(r.node().is_some() && r.mm_cid().is_some(), "Linux 6.3 fills node_id and mm_cid");
    }
}

#[test]
fn registration_off_under_the_tunable() {
    if tunable_off() {
        return; // (This is the child below.)
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "os::rseq::tests::registration_is_glibcs", "--test-threads=1"])
        .env("GLIBC_TUNABLES", TUNABLE)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("1 passed"), "the child: {text}");
}

#[test]
fn fields_are_the_cpu_and_node_the_thread_runs_on() {
    let Some(r) = registration() else {
        assert!(tunable_off(), "a registration on this machine");
        return;
    };
    let cpus = crate::os::cpu::allowed_cpus().unwrap();
    std::thread::spawn(move || {
        for &cpu in &cpus {
            crate::os::cpu::pin_current_thread_to([cpu]).unwrap();
            let (c, node) = crate::os::cpu::getcpu().unwrap();
            assert_eq!((r.cpu(), c), (Some(cpu), cpu));
            if let Some(n) = r.node() {
                assert_eq!(n, node);
            }
            if let Some(id) = r.mm_cid() {
                assert!(id < cpus.len(), "a concurrency id is below the CPUs allowed: {id}");
            }
        }
    })
    .join()
    .unwrap();
}

#[test]
fn a_stack_fills_and_empties_in_order() {
    let Some(stacks) = CpuStacks::new(3, 16) else {
        assert!(tunable_off());
        return;
    };
    let stacks = stacks.unwrap();
    std::thread::scope(|s| {
        s.spawn(|| {
            // One CPU: every call works on one row.
            crate::os::cpu::pin_current_thread_to([crate::os::cpu::allowed_cpus().unwrap()[0]]).unwrap();
            let p = |k: usize| NonNull::new((k * 8) as *mut u8).unwrap();
            assert_eq!(stacks.pop(1), None);
            for k in 1..=16 {
                assert!(stacks.push(1, p(k)));
            }
            assert!(!stacks.push(1, p(99)), "a full stack refuses");
            assert!(stacks.push(2, p(77)), "another list of the row has room");
            for k in (1..=16).rev() {
                assert_eq!(stacks.pop(1), Some(p(k)));
            }
            assert_eq!(stacks.pop(1), None);
            assert_eq!(stacks.pop(0), None);
            assert_eq!(stacks.pop(2), Some(p(77)));
            // The unchecked forms (the per-CPU caches' free and pop) work on
            // the same stacks as the checked `_on_cpu` ones (the CPU's row,
            // which the index's may not be): held to a depth, in order, the
            // last list's stack the row's last (its room is the row's end).
            let (l0, l1, l2) = (stacks.list_offset(0), stacks.list_offset(1), stacks.list_offset(2));
            // SAFETY: offsets of these stacks, depths at most the room of 16.
            unsafe {
                for k in 1..=4 {
                    assert!(stacks.push_upto_on_cpu_unchecked(l2, p(k), 4));
                }
                assert!(!stacks.push_upto_on_cpu_unchecked(l2, p(5), 4), "held to its depth");
                assert!(stacks.push_upto_on_cpu_unchecked(l2, p(5), 16));
                assert_eq!(stacks.pop_on_cpu(2), Some(p(5)));
                assert_eq!(stacks.pop_on_cpu_unchecked(l2), Some(p(4)));
                assert!(stacks.push_upto_on_cpu(0, p(40), 16));
                assert_eq!(stacks.pop_on_cpu_unchecked(l0), Some(p(40)));
                for k in (1..=3).rev() {
                    assert_eq!(stacks.pop_on_cpu_unchecked(l2), Some(p(k)));
                }
                assert_eq!(stacks.pop_on_cpu_unchecked(l2), None);
                assert_eq!(stacks.pop_on_cpu_unchecked(l1), None);
            }
        });
    });
}

/// A push held to a row commits only while the thread runs on that CPU:
/// named another CPU's row, it refuses and leaves both rows as they were.
#[test]
fn a_push_held_to_a_row_commits_only_there() {
    let Some(stacks) = CpuStacks::new(2, 8) else {
        assert!(tunable_off());
        return;
    };
    let stacks = stacks.unwrap();
    let cpus = crate::os::cpu::allowed_cpus().unwrap();
    let (here, other) = (cpus[0], cpus.get(1).copied().unwrap_or(cpus[0] + 1));
    std::thread::scope(|s| {
        s.spawn(|| {
            crate::os::cpu::pin_current_thread_to([here]).unwrap();
            let p = |k: usize| NonNull::new((k * 8) as *mut u8).unwrap();
            assert_eq!(stacks.cpu_row(), Some(here));
            assert!(!stacks.push_upto_on_row(other, 1, p(1), 8), "a push named another CPU's row");
            assert_eq!(stacks.len(here, 1), 0);
            if other < stacks.rows() {
                assert_eq!(stacks.len(other, 1), 0);
            }
            assert!(stacks.push_upto_on_row(here, 1, p(2), 8));
            assert!(!stacks.push_upto_on_row(here, 1, p(3), 1), "held to one, the stack is full");
            assert_eq!(stacks.len(here, 1), 1);
            assert_eq!(stacks.pop_on_cpu(1), Some(p(2)));
        });
    });
}

/// A worker out of tokens takes up to 8 from the shared pool.
fn refill_from(pool: &Mutex<Vec<usize>>, mine: &mut Vec<usize>) {
    let mut g = pool.lock().unwrap();
    let at = g.len() - g.len().min(8);
    mine.extend(g.drain(at..));
}

const TOKENS: usize = 4096;
const LISTS: usize = 2;

/// The stacks the signal handler uses.
static STACKS: AtomicPtr<CpuStacks> = AtomicPtr::new(core::ptr::null_mut());
/// Who holds each token (true: taken from a stack, not yet given back).
static TAKEN: [AtomicBool; TOKENS] = [const { AtomicBool::new(false) }; TOKENS];
/// Tokens taken twice (must stay 0).
static TWICE: AtomicUsize = AtomicUsize::new(0);
/// Tokens a signal handler could not push back (it may not lock): lock-free slots.
static SPILL: [AtomicUsize; 64] = [const { AtomicUsize::new(0) }; 64];
static HANDLED: AtomicUsize = AtomicUsize::new(0);

fn token(k: usize) -> NonNull<u8> {
    NonNull::new(((k + 1) * 8) as *mut u8).unwrap()
}
fn token_of(p: NonNull<u8>) -> usize {
    p.as_ptr() as usize / 8 - 1
}

/// A token taken from a stack: marks it, counting a second take.
fn took(p: NonNull<u8>) -> usize {
    let k = token_of(p);
    assert!(k < TOKENS, "a pointer the stacks never held: {p:?}");
    if TAKEN[k].swap(true, Ordering::AcqRel) {
        TWICE.fetch_add(1, Ordering::Relaxed);
    }
    k
}

/// Gives a token back (unmarked first: once on a stack another may take it).
fn give(stacks: &CpuStacks, list: usize, k: usize) -> bool {
    TAKEN[k].store(false, Ordering::Release);
    if stacks.push(list, token(k)) {
        return true;
    }
    TAKEN[k].store(true, Ordering::Release);
    false
}

extern "C" fn on_signal(_: libc::c_int) {
    let _errno = crate::os::KeepErrno::new();
    let stacks = STACKS.load(Ordering::Acquire);
    if stacks.is_null() {
        return;
    }
    // SAFETY: set before any signal is sent, cleared only after every
    // worker (the signals' targets) has been joined.
    let stacks = unsafe { &*stacks };
    HANDLED.fetch_add(1, Ordering::Relaxed);
    // A handler interrupting a sequence: its own sequence runs on the row
    // and the interrupted one restarts.
    for list in 0..LISTS {
        if let Some(p) = stacks.pop(list) {
            let k = took(p);
            if !give(stacks, list, k) {
                // No room (another thread filled it meanwhile): a spill slot.
                let slot =
                    SPILL.iter().find(|s| s.compare_exchange(0, k + 1, Ordering::AcqRel, Ordering::Relaxed).is_ok());
                assert!(slot.is_some(), "spill slots for a handler's tokens");
                TAKEN[k].store(false, Ordering::Release);
            }
        }
    }
}

#[test]
fn stacks_keep_every_pointer_under_preemption_migration_signals_and_fork() {
    let Some(stacks) = CpuStacks::new(LISTS, 64) else {
        assert!(tunable_off());
        return;
    };
    // A raw pointer the workers and the handler borrow from, and which
    // the end takes back whole once they are done.
    let raw: *mut CpuStacks = Box::into_raw(Box::new(stacks.unwrap()));
    STACKS.store(raw, Ordering::Release);
    // SAFETY: the handler is async-signal-safe (sequences and atomics).
    unsafe {
        let mut sa: libc::sigaction = core::mem::zeroed();
        sa.sa_sigaction = on_signal as *const () as usize;
        sa.sa_flags = libc::SA_RESTART;
        assert_eq!(libc::sigaction(libc::SIGUSR2, &sa, core::ptr::null_mut()), 0);
    }
    let pool: Arc<Mutex<Vec<usize>>> = Arc::new(Mutex::new((0..TOKENS).collect()));
    let stop = Arc::new(AtomicBool::new(false));
    let cpus = crate::os::cpu::allowed_cpus().unwrap();
    let workers = 16; // far more than this machine's CPUs: preemption in sequences
    // SAFETY: live until the `Box::from_raw` below, after every user.
    let stacks_ref: &'static CpuStacks = unsafe { &*raw };
    let handles: Vec<_> = (0..workers)
        .map(|w| {
            let (pool, stop, cpus) = (pool.clone(), stop.clone(), cpus.clone());
            std::thread::spawn(move || {
                let stacks = stacks_ref;
                let mut mine: Vec<usize> = Vec::new();
                let mut r = Rng(0x9e37_79b9_7f4a_7c15u64 ^ w as u64);
                let mut ops = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let x = r.next();
                    let list = (x as usize >> 8) % LISTS;
                    if !x.is_multiple_of(3) {
                        match stacks.pop(list) {
                            Some(p) => mine.push(took(p)),
                            None => refill_from(&pool, &mut mine),
                        }
                    } else if let Some(k) = mine.pop()
                        && !give(stacks, list, k)
                    {
                        mine.push(k);
                    }
                    if mine.len() > 32 {
                        pool.lock().unwrap().extend(mine.drain(16..));
                    }
                    ops += 1;
                    // Workers 0 and 1 move between CPUs every 5,000 calls.
                    if w < 2 && ops.is_multiple_of(5000) {
                        let cpu = cpus[(ops / 5000) as usize % cpus.len()];
                        crate::os::cpu::pin_current_thread_to([cpu]).unwrap();
                    }
                }
                pool.lock().unwrap().extend(mine);
                ops
            })
        })
        .collect();
    let threads: Vec<libc::pthread_t> =
        handles.iter().map(std::os::unix::thread::JoinHandleExt::as_pthread_t).collect();
    let start = Instant::now();
    let mut forks = 0;
    while start.elapsed() < Duration::from_secs(3) {
        for &t in &threads {
            // SAFETY: the worker has not been joined: its pthread_t is live.
            unsafe { libc::pthread_kill(t, libc::SIGUSR2) };
        }
        if forks < 20 && start.elapsed() > Duration::from_millis(100 * (forks + 1)) {
            forks += 1;
            // SAFETY: the child calls only the sequences, reads, and _exit.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // The child's one thread: the rows are a copy, with no
                // other thread to run on them. What it takes from its row is
                // distinct (no pointer twice within one row's stacks).
                let mut seen = [false; TOKENS];
                let mut bad = 0;
                for list in 0..LISTS {
                    while let Some(p) = stacks_ref.pop(list) {
                        let k = token_of(p);
                        if k >= TOKENS || std::mem::replace(&mut seen[k], true) {
                            bad += 1;
                        }
                    }
                }
                // SAFETY: ends the child without running the parent's exit handlers.
                unsafe { libc::_exit(if bad == 0 { 0 } else { 1 }) };
            }
            assert!(pid > 0);
            let mut status = 0;
            // SAFETY: waits for our child.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child's rows held a pointer twice");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    stop.store(true, Ordering::Relaxed);
    let ops: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    STACKS.store(core::ptr::null_mut(), Ordering::Release);
    assert_eq!(TWICE.load(Ordering::Relaxed), 0, "a pointer taken twice");
    // Every token exactly once: on a stack, in the pool, or spilled.
    let mut count = vec![0u32; TOKENS];
    for k in pool.lock().unwrap().iter() {
        count[*k] += 1;
    }
    for s in &SPILL {
        let v = s.swap(0, Ordering::Relaxed);
        if v != 0 {
            count[v - 1] += 1;
        }
    }
    // SAFETY: the workers are joined, the forks' children waited for and
    // the handler's pointer cleared: no reference from `raw` is used again.
    let mut stacks = unsafe { Box::from_raw(raw) };
    stacks.drain(|_, p| count[token_of(p)] += 1);
    let lost = count.iter().filter(|&&c| c == 0).count();
    let twice = count.iter().filter(|&&c| c > 1).count();
    assert_eq!((lost, twice), (0, 0), "tokens lost / held twice after {ops} operations");
    assert!(HANDLED.load(Ordering::Relaxed) > 100, "signals reached the workers");
    assert!(ops > 100_000, "the workers ran: {ops}");
}

/// The checker above finds a pointer taken twice: a stack whose pop and
/// push read the count, yield, and store (the sequence without its
/// restart) hands a token out twice within seconds.
#[test]
fn planted_bug_a_stack_without_restarts_takes_a_pointer_twice() {
    struct Plain {
        top: AtomicUsize,
        slots: Vec<AtomicUsize>,
    }
    impl Plain {
        fn pop(&self) -> Option<usize> {
            let t = self.top.load(Ordering::Relaxed);
            if t == 0 {
                return None;
            }
            let v = self.slots[t].load(Ordering::Relaxed);
            std::thread::yield_now(); // preempted here, no restart
            self.top.store(t - 1, Ordering::Relaxed);
            Some(v)
        }
        fn push(&self, v: usize) -> bool {
            let t = self.top.load(Ordering::Relaxed);
            if t + 1 >= self.slots.len() {
                return false;
            }
            self.slots[t + 1].store(v, Ordering::Relaxed);
            std::thread::yield_now();
            self.top.store(t + 1, Ordering::Relaxed);
            true
        }
    }
    let plain = Arc::new(Plain { top: AtomicUsize::new(0), slots: (0..65).map(|_| AtomicUsize::new(0)).collect() });
    for k in 0..64 {
        assert!(plain.push(k));
    }
    let taken: Arc<Vec<AtomicBool>> = Arc::new((0..64).map(|_| AtomicBool::new(false)).collect());
    let found = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let handles: Vec<_> = (0..8)
        .map(|_| {
            let (plain, taken, found) = (plain.clone(), taken.clone(), found.clone());
            std::thread::spawn(move || {
                while !found.load(Ordering::Relaxed) && start.elapsed() < Duration::from_secs(20) {
                    if let Some(k) = plain.pop() {
                        if taken[k].swap(true, Ordering::AcqRel) {
                            found.store(true, Ordering::Relaxed);
                        }
                        taken[k].store(false, Ordering::Release);
                        let _ = plain.push(k);
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert!(found.load(Ordering::Relaxed), "the checker sees a pointer taken twice");
}

/// A drain's run on rows indexed by `index`: workers pop and push tokens
/// while a drainer takes rows (with the fence, or without it: the planted
/// bug) into the pool, until `stop` or a token is taken twice; returns
/// (tokens taken twice, lost or held twice at the end, rows drained).
fn drain_run(index: Index, fenced: bool, seconds: u64) -> (usize, usize, usize) {
    const N: usize = 2048;
    let reg = registration().expect("checked by the caller");
    let stacks = Arc::new(CpuStacks::with_index(reg, index, 1, 32).unwrap());
    let taken: Arc<Vec<AtomicBool>> = Arc::new((0..N).map(|_| AtomicBool::new(false)).collect());
    let twice = Arc::new(AtomicUsize::new(0));
    let pool: Arc<Mutex<Vec<usize>>> = Arc::new(Mutex::new((0..N).collect()));
    let stop = Arc::new(AtomicBool::new(false));
    let tok = |k: usize| NonNull::new(((k + 1) * 8) as *mut u8).unwrap();
    let take = {
        let (taken, twice) = (taken.clone(), twice.clone());
        move |p: NonNull<u8>| {
            let k = p.as_ptr() as usize / 8 - 1;
            if taken[k].swap(true, Ordering::AcqRel) {
                twice.fetch_add(1, Ordering::Relaxed);
            }
            k
        }
    };
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let (stacks, taken, pool, stop, take) =
                (stacks.clone(), taken.clone(), pool.clone(), stop.clone(), take.clone());
            std::thread::spawn(move || {
                let mut mine: Vec<usize> = Vec::new();
                let mut r = Rng(0x2545_f491_4f6c_dd1du64 ^ w);
                while !stop.load(Ordering::Relaxed) {
                    if r.next().is_multiple_of(2) {
                        match stacks.pop(0) {
                            Some(p) => mine.push(take(p)),
                            None => refill_from(&pool, &mut mine),
                        }
                    } else if let Some(k) = mine.pop() {
                        taken[k].store(false, Ordering::Release);
                        if !stacks.push(0, tok(k)) {
                            taken[k].store(true, Ordering::Release);
                            mine.push(k);
                        }
                    }
                    if mine.len() > 32 {
                        pool.lock().unwrap().extend(mine.drain(16..));
                    }
                }
                pool.lock().unwrap().extend(mine);
            })
        })
        .collect();
    let start = Instant::now();
    let mut drained = 0;
    let mut row = 0;
    while start.elapsed() < Duration::from_secs(seconds) && twice.load(Ordering::Relaxed) == 0 {
        row = (row + 1) % stacks.rows();
        let mut got = Vec::new();
        let done = if fenced {
            stacks.drain_row(row, |_, p| got.push(p)).unwrap()
        } else {
            stacks.drain_row_unfenced(row, |_, p| got.push(p))
        };
        drained += usize::from(done);
        let ks: Vec<usize> = got.into_iter().map(&take).collect();
        pool.lock().unwrap().extend(ks);
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    let mut stacks = Arc::try_unwrap(stacks).ok().expect("the workers are joined");
    let mut count = vec![0u32; N];
    stacks.drain(|_, p| count[p.as_ptr() as usize / 8 - 1] += 1);
    for k in pool.lock().unwrap().iter() {
        count[*k] += 1;
    }
    let bad = count.iter().filter(|&&c| c != 1).count();
    (twice.load(Ordering::Relaxed), bad, drained)
}

/// A drainer on another thread (a trim) takes rows while 8 threads on
/// 2 CPUs pop and push on them: nothing taken twice or lost.
#[test]
fn rows_drained_by_another_thread_keep_every_pointer() {
    if CpuStacks::new(1, 1).is_none() {
        assert!(tunable_off());
        return;
    }
    // Rows by CPU (each fenced alone) and, where the kernel has them, by
    // concurrency id (every CPU fenced).
    let mm_cid = registration().unwrap().mm_cid().is_some();
    for index in [Index::Cpu, Index::ConcurrencyId].into_iter().filter(|&i| i == Index::Cpu || mm_cid) {
        let (twice, bad, drained) = drain_run(index, true, 3);
        assert_eq!((twice, bad), (0, 0), "{index:?}: after {drained} rows drained");
        assert!(drained > 1000, "{index:?}: the drainer ran: {drained}");
    }
}

/// The drain without its fence: a sequence that saw the row open commits
/// after the drainer took it, and a token is taken twice (or lost).
#[test]
fn planted_bug_a_drain_without_the_fence_takes_a_pointer_twice() {
    if CpuStacks::new(1, 1).is_none() {
        assert!(tunable_off());
        return;
    }
    assert!(std::thread::available_parallelism().unwrap().get() >= 2, "the race needs two CPUs");
    let (twice, bad, drained) = drain_run(Index::Cpu, false, 30);
    assert!(twice + bad > 0, "the checker sees the race ({drained} rows drained)");
}
