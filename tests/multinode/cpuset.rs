//! A cgroup's `cpuset.mems` narrowed and widened under a running process.

use super::*;

pub(super) const CGROUP: &str = "/sys/fs/cgroup";

pub(super) fn write_file(path: &str, what: &str) {
    std::fs::write(path, what).unwrap_or_else(|e| panic!("write {what:?} to {path}: {e}"));
}

pub(super) fn cpuset_mems_confine_every_page(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let Some(_) = layout else { return Outcome::Skip("mounts cgroup2: only inside the numa-vm guest") };
    // Confine a child to the last CPU node; node 0 (where it will also run)
    // and any memory-only node are then off limits.
    let confined = t.cpu_nodes().last().unwrap();
    assert!(confined != 0, "needs at least two CPU nodes");
    let group = cpuset_group("numaweave-test", &confined.to_string());
    run_child(&["--cpuset-child", &group, &confined.to_string()]);
    Outcome::Pass
}

/// Runs this binary again with `args` (a child's part of a check), prints
/// what it printed and asserts that it passed.
pub(super) fn run_child(args: &[&str]) {
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let out = Command::new(exe).args(args).output().unwrap();
    print!("\n{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "child {args:?} failed: {}", out.status);
}

/// Runs in a child process: joins the cgroup, then tries every way to get
/// memory elsewhere.
pub(super) fn cpuset_child(group: &str, confined: &str) {
    let confined: usize = confined.parse().unwrap();
    // "0" moves the writing process (all its threads) into the group.
    write_file(&format!("{group}/cgroup.procs"), "0");
    let t = Topology::detect().unwrap();
    assert_eq!(t.allowed_nodes(), NodeSet::single(confined), "Mems_allowed after joining the cpuset");
    let ok = |what: &str, r: &Mapping| {
        let got = nodes_of(r);
        assert!(got.iter().all(|&g| g == Some(confined)), "{what}: pages on {got:?}, cpuset allows {confined}");
        println!("  cpuset child: {what}: {} pages, all on node {confined}", got.len());
    };
    ok("default policy", &touched(MemPolicy::Default));
    ok("interleave over every node", &touched(MemPolicy::Interleave(t.nodes())));
    ok("preferred-many over every node", &touched(MemPolicy::PreferredMany(t.nodes())));
    // A policy naming only nodes outside the cpuset is refused outright.
    for p in [MemPolicy::Bind(NodeSet::single(0)), MemPolicy::Preferred(0)] {
        let e = Mapping::map(os::page_size()).unwrap().bind(p).unwrap_err();
        assert_eq!(e.errno(), Some(libc::EINVAL), "{p:?} outside the cpuset: {e}");
        println!("  cpuset child: {p:?} refused: {e}");
    }
    // From every CPU, node 0's included, first touches stay inside.
    std::thread::scope(|s| {
        for cpu in t.cpus().iter() {
            let ok = &ok;
            s.spawn(move || {
                os::cpu::pin_current_thread(cpu).unwrap();
                ok(&format!("touched from cpu {cpu}"), &touched(MemPolicy::Local));
            });
        }
    });
}

/// Mounts cgroup2 (once) with the cpuset controller for child groups, and
/// makes the group `name` with `mems`: its path.
pub(super) fn cpuset_group(name: &str, mems: &str) -> String {
    let c = std::ffi::CString::new(CGROUP).unwrap();
    // SAFETY: plain mount(2) of cgroup2 on sysfs's mount point in the guest.
    let r = unsafe { libc::mount(c"none".as_ptr(), c.as_ptr(), c"cgroup2".as_ptr(), 0, std::ptr::null()) };
    assert!(r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EBUSY), "mount cgroup2");
    write_file(&format!("{CGROUP}/cgroup.subtree_control"), "+cpuset");
    let group = format!("{CGROUP}/{name}");
    let _ = std::fs::create_dir(&group);
    write_file(&format!("{group}/cpuset.mems"), mems);
    group
}

pub(super) fn cpuset_mems_narrowed_while_allocating(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let Some(_) = layout else { return Outcome::Skip("mounts cgroup2: only inside the numa-vm guest") };
    // The node taken away: the last with CPUs (a thread keeps running on
    // them: cpuset.mems narrows, cpuset.cpus does not).
    let victim = t.cpu_nodes().last().unwrap();
    assert!(victim != 0, "needs at least two CPU nodes");
    let group = cpuset_group("numaweave-live", &t.memory_nodes().to_string());
    run_child(&["--cpuset-live-child", &group, &victim.to_string()]);
    Outcome::Pass
}

/// Runs in a child process in its own cpuset group: a thread on the
/// victim's CPUs allocates all the time (size-class blocks kept live, huge
/// blocks, I/O buffers of an interleave handle over every node, slab
/// objects homed on the victim) while this thread narrows the group's
/// `cpuset.mems` to leave the victim out, then widens it again. Every
/// allocation must succeed; what is allocated while the victim is out must
/// lie elsewhere, counted as fallbacks; once it is back, new memory is on
/// it again.
pub(super) fn cpuset_live_child(group: &str, victim: &str) {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let victim: usize = victim.parse().unwrap();
    write_file(&format!("{group}/cgroup.procs"), "0");
    let t = Topology::detect().unwrap();
    let all = t.memory_nodes();
    let mut without = all;
    without.remove(victim);
    let phys = t.physical_node(victim);
    let cpu = first_cpu(&t, victim);
    let handle = A.interleave(Interleave::new(all, Granularity::Count(1)).unwrap()).unwrap();
    let cache = RawCache::builder("vm_live", 4096).align(4096).node(victim).build().unwrap();
    // 0: every node allowed; 1: the victim out (set once the narrowing has
    // returned); 2: back (set before the widening starts); 3: stop.
    static PHASE: AtomicUsize = AtomicUsize::new(0);
    static ROUNDS: [AtomicUsize; 3] = [const { AtomicUsize::new(0) }; 3];
    static OUT: AtomicBool = AtomicBool::new(false);
    let fallbacks = || (0..numaweave::topology::MAX_NODES).map(|n| A.stats().per_node[n].fallbacks).sum::<u64>();
    let worker = std::thread::spawn(move || {
        os::cpu::pin_current_thread(cpu).unwrap();
        let small = Layout::from_size_align(16 << 10, 8).unwrap();
        let huge = Layout::from_size_align(1 << 20, 8).unwrap();
        let io = Layout::from_size_align(256 << 10, 4096).unwrap();
        // Per phase: pages found on the victim, pages elsewhere.
        let mut seen = [[0usize; 2]; 3];
        let mut kept: Vec<*mut u8> = Vec::new();
        let (mut buffers, mut kept_huge) = (Vec::new(), Vec::new());
        // The 2 MiB ranges touched while every node was allowed: memory
        // committed then (a transparent huge page of a region, which
        // blocks carved later share; a slab object reused) is not new
        // memory, and the kernel need not move it.
        let mut committed = HashSet::new();
        // Each page of `[p, p + len)` touched: its 2 MiB range and node.
        let locate = |p: *mut u8, len: usize, out: &mut Vec<(usize, Option<usize>)>| {
            let first = p as usize & !(os::page_size() - 1);
            out.extend(
                touch_and_locate(p, len).into_iter().enumerate().map(|(i, n)| ((first + i * os::page_size()) >> 21, n)),
            );
        };
        loop {
            let phase = PHASE.load(Ordering::Acquire);
            if phase == 3 {
                break;
            }
            let mut pages = Vec::new();
            // SAFETY: valid layouts; every block is checked for null and
            // written whole before use; freed (or kept) as below.
            unsafe {
                for _ in 0..16 {
                    let p = A.alloc(small);
                    assert!(!p.is_null(), "a small block failed in phase {phase}");
                    locate(p, small.size(), &mut pages);
                    kept.push(p);
                }
                // (Live too: a freed huge block's mapping would be kept for
                // reuse, and a region could take it without a new binding.)
                let h = A.alloc(huge);
                assert!(!h.is_null(), "a huge block failed in phase {phase}");
                locate(h, huge.size(), &mut pages);
                kept_huge.push(h);
            }
            // Page-aligned I/O buffers (region blocks), kept live, so that
            // every node's turn soon needs a fresh region.
            for _ in 0..2 {
                let b = handle.allocate(io).unwrap_or_else(|_| panic!("an I/O buffer failed in phase {phase}"));
                locate(b.as_ptr().cast(), io.size(), &mut pages);
                buffers.push(b.cast::<u8>());
            }
            let o = cache.alloc().unwrap_or_else(|e| panic!("a slab object failed in phase {phase}: {e}"));
            locate(o.as_ptr(), 4096, &mut pages);
            // SAFETY: allocated just above, freed once.
            unsafe { cache.free(o) };
            // What a round that ran wholly while the victim was out took
            // fresh (the phase moves to 1 once the write has returned) has
            // nothing on it.
            if phase == 0 {
                committed.extend(pages.iter().map(|&(r, _)| r));
            } else if phase == 1 && PHASE.load(Ordering::Acquire) == 1 {
                let on: Vec<usize> = pages
                    .iter()
                    .filter(|&&(r, n)| n == Some(phys) && !committed.contains(&r))
                    .map(|&(r, _)| r)
                    .collect();
                assert!(
                    on.is_empty(),
                    "new memory on node {victim} while cpuset.mems left it out: 2 MiB ranges {on:?}"
                );
            }
            // Counted for a round wholly in one phase, where fresh (memory
            // committed before the narrowing is not what the phases compare).
            for (r, n) in pages.into_iter().filter(|_| PHASE.load(Ordering::Acquire) == phase) {
                if let Some(n) = n.filter(|_| phase == 0 || !committed.contains(&r)) {
                    seen[phase][usize::from(n != phys)] += 1;
                }
            }
            ROUNDS[phase].fetch_add(1, Ordering::Release);
            if phase == 1 {
                OUT.store(true, Ordering::Release);
            }
        }
        for p in kept {
            // SAFETY: allocated above with `small`.
            unsafe { A.dealloc(p, small) };
        }
        for h in kept_huge {
            // SAFETY: allocated above with `huge`.
            unsafe { A.dealloc(h, huge) };
        }
        for b in buffers {
            // SAFETY: allocated above by the handle with `io`.
            unsafe { handle.deallocate(b, io) };
        }
        seen
    });
    // (A worker that panicked ends the child with its message.)
    let wait_rounds = |phase: usize, n: usize| {
        while ROUNDS[phase].load(Ordering::Acquire) < n {
            if worker.is_finished() {
                std::process::exit(1);
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    };
    wait_rounds(0, 8);
    let before = fallbacks();
    write_file(&format!("{group}/cpuset.mems"), &without.to_string());
    assert_eq!(Topology::detect().unwrap().allowed_nodes(), without, "Mems_allowed after narrowing");
    PHASE.store(1, Ordering::Release);
    wait_rounds(1, 48);
    let during = fallbacks();
    // Phase 1 ends before the widening starts: a round still running then
    // may already get the node back.
    PHASE.store(2, Ordering::Release);
    write_file(&format!("{group}/cpuset.mems"), &all.to_string());
    assert_eq!(Topology::detect().unwrap().allowed_nodes(), all, "Mems_allowed after widening");
    wait_rounds(2, 48);
    PHASE.store(3, Ordering::Release);
    let seen = worker.join().unwrap();
    assert!(OUT.load(Ordering::Acquire));
    println!(
        "  live cpuset: pages on node {victim} / elsewhere: all nodes {:?}, node {victim} out {:?}, back {:?}; \
         {} fallbacks while it was out",
        seen[0],
        seen[1],
        seen[2],
        during - before
    );
    assert!(seen[0][0] > 0, "nothing on node {victim} before the narrowing");
    assert!(during > before, "the moves off node {victim} were not counted as fallbacks");
    assert!(seen[2][0] > 0, "nothing on node {victim} after it came back");
}
