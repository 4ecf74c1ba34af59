//! Placement checks against a real kernel: run inside the numa-vm guest by
//! `.ci/vm-tests` with `NUMAWEAVE_VM_LAYOUT` describing the guest, and on any
//! host as a one-node sanity check (checks that need the guest's layout or
//! root in a throwaway VM are skipped there, and say so).
//!
//! `NUMAWEAVE_VM_LAYOUT=nodes:4,cpus-per-node:2,memory-only:1,mem-per-node:512M`
//! `NUMAWEAVE_VM_DISTANCES=10,20,30;20,10,30;30,30,10` (optional; default as
//! the harness: 10 local, 20 between CPU nodes, 30 to or from memory-only ones)
//!
//! The binary has its own harness (`harness = false`): it re-runs itself as a
//! child inside a cpuset cgroup, and prints the closing line
//! `N passed, N failed, N skipped`.

use std::io::Write as _;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::Command;

use std::alloc::{GlobalAlloc, Layout};
use std::collections::HashSet;
use std::sync::mpsc;

use allocator_api2::alloc::Allocator as _;

use numaweave::os::{self, mem::BindFlags, mem::Mapping, mem::MemPolicy};
use numaweave::policy::{Cursor, Granularity, Interleave, Policy};
use numaweave::slab::{DmaPool, RawCache, SlabBox, SlabCache};
use numaweave::topology::{self, CpuSet, NodeSet, PerfSource, Topology};
use numaweave::{Error, Mode, NumaAlloc};

const PAGES: usize = 32;

/// The guest layout the harness was asked for.
#[derive(Debug, Clone)]
struct Guest {
    cpu_nodes: usize,
    cpus_per_node: usize,
    memory_only: usize,
    mem_per_node: u64,
    distances: Vec<Vec<u8>>,
}

impl Guest {
    fn from_env() -> Option<Guest> {
        let spec = std::env::var("NUMAWEAVE_VM_LAYOUT").ok()?;
        let mut l =
            Guest { cpu_nodes: 2, cpus_per_node: 2, memory_only: 0, mem_per_node: 512 << 20, distances: vec![] };
        for kv in spec.split(',') {
            let (k, v) = kv.split_once(':').expect("NUMAWEAVE_VM_LAYOUT: want key:value pairs");
            match k {
                "nodes" => l.cpu_nodes = v.parse().unwrap(),
                "cpus-per-node" => l.cpus_per_node = v.parse().unwrap(),
                "memory-only" => l.memory_only = v.parse().unwrap(),
                "mem-per-node" => {
                    let (n, shift) = match v.as_bytes().last() {
                        Some(b'G' | b'g') => (&v[..v.len() - 1], 30),
                        Some(b'M' | b'm') => (&v[..v.len() - 1], 20),
                        _ => (v, 20),
                    };
                    l.mem_per_node = n.parse::<u64>().unwrap() << shift;
                }
                other => panic!("NUMAWEAVE_VM_LAYOUT: unknown key {other}"),
            }
        }
        let total = l.cpu_nodes + l.memory_only;
        l.distances = match std::env::var("NUMAWEAVE_VM_DISTANCES") {
            Ok(m) => m.split(';').map(|row| row.split(',').map(|d| d.trim().parse().unwrap()).collect()).collect(),
            Err(_) => (0..total)
                .map(|i| {
                    (0..total)
                        .map(|j| match (i == j, i >= l.cpu_nodes || j >= l.cpu_nodes) {
                            (true, _) => 10,
                            (false, true) => 30,
                            (false, false) => 20,
                        })
                        .collect()
                })
                .collect(),
        };
        assert_eq!(l.distances.len(), total, "distance matrix size");
        Some(l)
    }
}

enum Outcome {
    Pass,
    Skip(&'static str),
}

type Check = fn(&Topology, Option<&Guest>) -> Outcome;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--cpuset-child") {
        cpuset_child(&args[i + 1], &args[i + 2]);
        return;
    }
    if args.iter().any(|a| a == "--kernel-weights-child") {
        let t = Topology::detect().unwrap();
        let w: Vec<Option<u8>> = t.memory_nodes().iter().map(|n| t.kernel_interleave_weight(n)).collect();
        println!("kernel weights read: {w:?}");
        return;
    }
    if args.iter().any(|a| a == "--size-rules-child") {
        size_rules_child();
        return;
    }
    if args.iter().any(|a| a == "--perf-unprivileged-child") {
        perf_unprivileged_child();
        return;
    }
    if let Some(i) = args.iter().position(|a| a == "--cpuset-live-child") {
        cpuset_live_child(&args[i + 1], &args[i + 2]);
        return;
    }
    // As libtest reads them: a name filter, and `--skip NAME` (given to every
    // test binary of a `cargo test -- --skip NAME` run).
    let (mut filter, mut skips) = (None, Vec::new());
    let mut rest = args.iter();
    while let Some(a) = rest.next() {
        if a == "--skip" {
            skips.extend(rest.next().cloned());
        } else if !a.starts_with('-') && filter.is_none() {
            filter = Some(a.clone());
        }
    }
    let layout = Guest::from_env();
    let topo = Topology::detect().expect("topology discovery");
    println!("{topo}");

    let checks: &[(&str, Check)] = &[
        ("topology_matches_the_guest_exactly", topology_matches_the_guest_exactly),
        ("each_cpu_reports_its_own_node", each_cpu_reports_its_own_node),
        ("bound_pages_land_on_their_node", bound_pages_land_on_their_node),
        ("pagemap_frames_belong_to_the_bound_node", pagemap_frames_belong_to_the_bound_node),
        ("interleave_rotates_page_by_page", interleave_rotates_page_by_page),
        ("preferred_and_move_place_pages", preferred_and_move_place_pages),
        ("strict_bind_outside_allowed_is_a_typed_error", strict_bind_outside_allowed_is_a_typed_error),
        ("cpuset_mems_confine_every_page", cpuset_mems_confine_every_page),
        ("cpuset_mems_narrowed_while_allocating", cpuset_mems_narrowed_while_allocating),
        ("numaalloc_blocks_land_on_the_threads_node", numaalloc_blocks_land_on_the_threads_node),
        ("numaalloc_remote_frees_return_home", numaalloc_remote_frees_return_home),
        ("purged_pages_come_back_on_their_node", purged_pages_come_back_on_their_node),
        ("numaalloc_falls_back_by_distance_when_a_node_is_full", numaalloc_falls_back_by_distance_when_a_node_is_full),
        ("slab_objects_land_on_the_cache_node", slab_objects_land_on_the_cache_node),
        ("policy_interleave_pages_follow_the_cursor", policy_interleave_pages_follow_the_cursor),
        ("policy_bind_never_leaves_its_set", policy_bind_never_leaves_its_set),
        (
            "policy_preferred_falls_back_by_distance_from_its_node",
            policy_preferred_falls_back_by_distance_from_its_node,
        ),
        ("slab_remote_frees_go_home_to_their_node", slab_remote_frees_go_home_to_their_node),
        ("slab_chunks_scale_and_stay_on_their_node", slab_chunks_scale_and_stay_on_their_node),
        ("slab_hugetlb_pages_are_on_the_node_and_contiguous", slab_hugetlb_pages_are_on_the_node_and_contiguous),
        ("slab_gigantic_pages_make_one_physical_run", slab_gigantic_pages_make_one_physical_run),
        ("hmat_matrix_and_auto_weights_of_each_socket", hmat_matrix_and_auto_weights_of_each_socket),
        (
            "hmat_weights_auto_placement_follows_the_sockets_weights",
            hmat_weights_auto_placement_follows_the_sockets_weights,
        ),
        (
            "hmat_tier_lower_lands_on_the_sockets_memory_only_node",
            hmat_tier_lower_lands_on_the_sockets_memory_only_node,
        ),
        (
            "hmat_size_rules_keep_small_blocks_local_and_weight_big_ones",
            hmat_size_rules_keep_small_blocks_local_and_weight_big_ones,
        ),
        ("hmat_kernel_weighted_interleave_places_as_ours", hmat_kernel_weighted_interleave_places_as_ours),
        #[cfg(feature = "io-uring")]
        (
            "uring_rings_per_node_read_and_write_fixed_on_their_node",
            uring_rings_per_node_read_and_write_fixed_on_their_node,
        ),
    ];
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    for (name, check) in checks {
        if filter.as_deref().is_some_and(|f| !name.contains(f)) || skips.iter().any(|s| name.contains(s.as_str())) {
            continue;
        }
        print!("test {name} ... ");
        let _ = std::io::stdout().flush();
        match catch_unwind(AssertUnwindSafe(|| check(&topo, layout.as_ref()))) {
            Ok(Outcome::Pass) => {
                println!("ok");
                passed += 1;
            }
            Ok(Outcome::Skip(why)) => {
                println!("skipped ({why})");
                skipped += 1;
            }
            Err(_) => {
                println!("FAILED");
                failed += 1;
            }
        }
    }
    println!("multinode: {passed} passed, {failed} failed, {skipped} skipped");
    if failed > 0 {
        std::process::exit(1);
    }
}

/// Maps `PAGES` pages with 4 KiB granularity (no THP), under `policy`, touched.
fn touched(policy: MemPolicy) -> Mapping {
    let r = Mapping::map(PAGES * os::page_size()).unwrap();
    r.set_hugepages(false).unwrap();
    r.bind(policy).unwrap();
    touch(&r);
    r
}

fn touch(r: &Mapping) {
    for i in 0..r.len() / os::page_size() {
        // SAFETY: inside the region, which is mapped and writable.
        unsafe { r.as_ptr().add(i * os::page_size()).write_volatile(i as u8 | 1) };
    }
}

fn nodes_of(r: &Mapping) -> Vec<Option<usize>> {
    let mut v = Vec::new();
    r.page_node_list(&mut v).unwrap();
    v
}

fn topology_matches_the_guest_exactly(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let Some(l) = layout else { return Outcome::Skip("needs NUMAWEAVE_VM_LAYOUT (numa-vm guest)") };
    let total = l.cpu_nodes + l.memory_only;
    assert!(!t.is_synthetic());
    assert_eq!(t.nodes(), NodeSet::first_n(total), "online nodes");
    assert_eq!(t.cpu_nodes(), NodeSet::first_n(l.cpu_nodes), "nodes with CPUs");
    assert_eq!(t.memory_nodes(), NodeSet::first_n(total), "nodes with memory");
    let memonly: NodeSet = (l.cpu_nodes..total).collect();
    assert_eq!(t.memory_only_nodes(), memonly, "memory-only nodes");
    assert_eq!(t.allowed_nodes(), NodeSet::first_n(total), "allowed nodes");
    assert_eq!(t.ignored_nodes(), 0);
    for n in 0..total {
        let want: CpuSet =
            if n < l.cpu_nodes { (n * l.cpus_per_node..(n + 1) * l.cpus_per_node).collect() } else { CpuSet::new() };
        assert_eq!(t.cpus_of(n), want, "cpus of node {n}");
        for m in 0..total {
            assert_eq!(t.distance(n, m), l.distances[n][m], "distance {n}->{m}");
        }
        // The kernel keeps some of each node (node 0 most) for itself.
        let mem = t.memory_of(n);
        assert!(mem <= l.mem_per_node && mem >= l.mem_per_node / 2, "memory of node {n}: {mem}");
    }
    // Fallback order from each node follows the distances.
    for n in 0..total {
        let order: Vec<usize> = t.nodes_by_distance(n).collect();
        assert_eq!(order[0], n);
        assert!(order.windows(2).all(|w| t.distance(n, w[0]) <= t.distance(n, w[1])), "order from {n}: {order:?}");
    }
    Outcome::Pass
}

fn each_cpu_reports_its_own_node(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let cpus: Vec<usize> = t.cpus().iter().collect();
    assert!(!cpus.is_empty());
    std::thread::scope(|s| {
        for &cpu in &cpus {
            s.spawn(move || {
                os::cpu::pin_current_thread(cpu).unwrap();
                let (c, n) = os::cpu::getcpu().unwrap();
                assert_eq!(c, cpu, "getcpu after pinning to {cpu}");
                assert_eq!(t.node_of_cpu(cpu), Some(n), "cpu {cpu}: table vs getcpu");
                assert_eq!(t.current_cpu(), Some(cpu));
                assert_eq!(t.current_node(), n);
                if let Some(l) = layout {
                    assert_eq!(n, cpu / l.cpus_per_node, "cpu {cpu} is on the wrong node");
                }
            });
        }
    });
    println!("\n  checked {} CPUs", cpus.len());
    Outcome::Pass
}

fn bound_pages_land_on_their_node(t: &Topology, _: Option<&Guest>) -> Outcome {
    for n in t.memory_nodes().iter() {
        let r = touched(MemPolicy::Bind(NodeSet::single(n)));
        let got = nodes_of(&r);
        assert!(got.iter().all(|&g| g == Some(n)), "bind to node {n}: pages on {got:?}");
        // Contents survive: the pages are real, not a zero page.
        // SAFETY: inside the region.
        assert_eq!(unsafe { r.as_ptr().add(3 * os::page_size()).read() }, 3 | 1);
    }
    Outcome::Pass
}

fn pagemap_frames_belong_to_the_bound_node(t: &Topology, _: Option<&Guest>) -> Outcome {
    for n in t.memory_nodes().iter() {
        let r = touched(MemPolicy::Bind(NodeSet::single(n)));
        for i in [0, PAGES / 2, PAGES - 1] {
            let p = r.as_ptr().wrapping_add(i * os::page_size());
            let pfn = match os::mem::page_frame(p) {
                Ok(Some(pfn)) => pfn,
                Err(Error::Os { errno: libc::EPERM, .. }) => {
                    return Outcome::Skip("pagemap hides frames (no CAP_SYS_ADMIN)");
                }
                other => panic!("pagemap for page {i}: {other:?}"),
            };
            match topology::node_of_frame(pfn).unwrap() {
                Some(m) => assert_eq!(m, n, "frame {pfn:#x} of a page bound to node {n}"),
                None => return Outcome::Skip("no memory-block sysfs on this kernel"),
            }
        }
    }
    Outcome::Pass
}

fn interleave_rotates_page_by_page(t: &Topology, _: Option<&Guest>) -> Outcome {
    let set = t.memory_nodes();
    let ids: Vec<usize> = set.iter().collect();
    let r = touched(MemPolicy::Interleave(set));
    let got: Vec<usize> = nodes_of(&r).into_iter().map(|g| g.expect("page not present")).collect();
    for w in got.windows(2) {
        let i = ids.iter().position(|&x| x == w[0]).expect("page outside the interleave set");
        assert_eq!(w[1], ids[(i + 1) % ids.len()], "interleave sequence {got:?}");
    }
    for &n in &ids {
        let c = got.iter().filter(|&&g| g == n).count();
        assert!(c.abs_diff(PAGES / ids.len()) <= 1, "node {n} got {c} of {PAGES} pages");
    }
    Outcome::Pass
}

fn preferred_and_move_place_pages(t: &Topology, _: Option<&Guest>) -> Outcome {
    let nodes: Vec<usize> = t.memory_nodes().iter().collect();
    let last = *nodes.last().unwrap();
    // Preferred: plenty of memory, so every page lands on the preferred node.
    let r = touched(MemPolicy::Preferred(last));
    assert!(nodes_of(&r).iter().all(|&g| g == Some(last)), "preferred {last}");
    // Migration of present pages keeps their contents.
    let r = touched(MemPolicy::Bind(NodeSet::single(nodes[0])));
    r.bind_range(0, r.len(), MemPolicy::Bind(NodeSet::single(last)), BindFlags::MOVE).unwrap();
    assert!(nodes_of(&r).iter().all(|&g| g == Some(last)), "moved to {last}");
    for i in 0..PAGES {
        // SAFETY: inside the region.
        assert_eq!(unsafe { r.as_ptr().add(i * os::page_size()).read() }, i as u8 | 1);
    }
    // Decommitted pages are gone and come back zeroed.
    r.decommit(0, r.len()).unwrap();
    assert!(nodes_of(&r).iter().all(|g| g.is_none()), "decommitted pages still present");
    // SAFETY: inside the region.
    assert_eq!(unsafe { r.as_ptr().read() }, 0);
    Outcome::Pass
}

fn strict_bind_outside_allowed_is_a_typed_error(t: &Topology, _: Option<&Guest>) -> Outcome {
    let r = Mapping::map(os::page_size()).unwrap();
    // A node beyond the topology: the kernel refuses it, and the error names the call.
    let bogus = t.nodes().last().unwrap() + 1;
    let e = r.bind(MemPolicy::Bind(NodeSet::single(bogus))).unwrap_err();
    assert_eq!(e, Error::Os { call: "mbind", errno: libc::EINVAL });
    assert!(e.to_string().contains("mbind failed: EINVAL"), "{e}");
    assert!(matches!(r.bind(MemPolicy::Bind(NodeSet::new())), Err(Error::InvalidNode { .. })));
    Outcome::Pass
}

const CGROUP: &str = "/sys/fs/cgroup";

fn write_file(path: &str, what: &str) {
    std::fs::write(path, what).unwrap_or_else(|e| panic!("write {what:?} to {path}: {e}"));
}

fn cpuset_mems_confine_every_page(t: &Topology, layout: Option<&Guest>) -> Outcome {
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
fn run_child(args: &[&str]) {
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let out = Command::new(exe).args(args).output().unwrap();
    print!("\n{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "child {args:?} failed: {}", out.status);
}

/// Runs in a child process: joins the cgroup, then tries every way to get
/// memory elsewhere.
fn cpuset_child(group: &str, confined: &str) {
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
fn cpuset_group(name: &str, mems: &str) -> String {
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

fn cpuset_mems_narrowed_while_allocating(t: &Topology, layout: Option<&Guest>) -> Outcome {
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
fn cpuset_live_child(group: &str, victim: &str) {
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

/// The allocator under test, as a value beside the binary's System allocator.
static A: NumaAlloc = NumaAlloc::new();

/// Kernel nodes of every page of `[p, p+len)`, after touching them.
fn touch_and_locate(p: *mut u8, len: usize) -> Vec<Option<usize>> {
    let page = os::page_size();
    let first = p as usize & !(page - 1);
    let addrs: Vec<*const u8> = (first..p as usize + len).step_by(page).map(|a| a as *const u8).collect();
    // SAFETY: the block is `len` writable bytes.
    unsafe { p.write_bytes(0x5a, len) };
    let mut st = vec![0i32; addrs.len()];
    os::mem::page_nodes(&addrs, &mut st).unwrap();
    st.into_iter().map(|s| usize::try_from(s).ok()).collect()
}

fn first_cpu(t: &Topology, node: usize) -> usize {
    t.cpus_of(node).first().unwrap()
}

fn numaalloc_blocks_land_on_the_threads_node(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let want = if t.memory_nodes().len() > 1 { Mode::PerNode } else { Mode::Flat };
    assert_eq!(A.mode(), want);
    let _ = layout;
    for node in t.cpu_nodes().iter() {
        let cpu = first_cpu(t, node);
        let phys = t.physical_node(node);
        std::thread::spawn(move || {
            os::cpu::pin_current_thread(cpu).unwrap();
            let small = Layout::from_size_align(4000, 8).unwrap();
            let huge = Layout::from_size_align(2 << 20, 8).unwrap();
            // SAFETY: valid layouts; blocks freed with them below.
            unsafe {
                let blocks: Vec<*mut u8> = (0..64).map(|_| A.alloc(small)).collect();
                let big = A.alloc(huge);
                for &b in &blocks {
                    assert_eq!(A.node_of(b), if want == Mode::PerNode { node } else { 0 });
                    let got = touch_and_locate(b, small.size());
                    assert!(got.iter().all(|&g| g == Some(phys)), "small block of cpu {cpu}: pages on {got:?}");
                }
                let got = touch_and_locate(big, huge.size());
                assert!(got.iter().all(|&g| g == Some(phys)), "huge block of cpu {cpu}: pages on {got:?}");
                for b in blocks {
                    A.dealloc(b, small);
                }
                A.dealloc(big, huge);
            }
            println!("\n  cpu {cpu}: 64 small blocks and a 2 MiB block, every page on node {node}");
        })
        .join()
        .unwrap();
    }
    Outcome::Pass
}

/// Memory given back to the kernel (`MADV_DONTNEED` by a trim, as the purge
/// delay does) and faulted in again when its blocks are handed out again
/// lands on the node its range is bound to: under `Local` on each node
/// with CPUs (small blocks and a huge block, in the same mappings as
/// before the purge), and under an interleave (I/O buffers, each on the
/// node the cursor names).
fn purged_pages_come_back_on_their_node(t: &Topology, _: Option<&Guest>) -> Outcome {
    let small = Layout::from_size_align(8000, 8).unwrap();
    let huge = Layout::from_size_align(4 << 20, 8).unwrap();
    for node in t.cpu_nodes().iter() {
        let (cpu, phys) = (first_cpu(t, node), t.physical_node(node));
        std::thread::spawn(move || {
            os::cpu::pin_current_thread(cpu).unwrap();
            // SAFETY: valid layouts; blocks freed with them.
            unsafe {
                let first: Vec<usize> = (0..512).map(|_| A.alloc(small) as usize).collect();
                let big = A.alloc(huge);
                for &b in &first {
                    (b as *mut u8).write_bytes(1, small.size());
                }
                big.write_bytes(1, huge.size());
                for &b in &first {
                    A.dealloc(b as *mut u8, small);
                }
                A.dealloc(big, huge);
                let back = A.trim();
                assert!(back > 0, "nothing was given back");
                let again: Vec<*mut u8> = (0..512).map(|_| A.alloc(small)).collect();
                let big = A.alloc(huge);
                let reused = again.iter().filter(|&&b| first.contains(&(b as usize))).count();
                for &b in &again {
                    let got = touch_and_locate(b, small.size());
                    assert!(got.iter().all(|&g| g == Some(phys)), "a purged block of cpu {cpu}: pages on {got:?}");
                }
                let got = touch_and_locate(big, huge.size());
                assert!(got.iter().all(|&g| g == Some(phys)), "a purged huge block of cpu {cpu}: pages on {got:?}");
                for b in again {
                    A.dealloc(b, small);
                }
                A.dealloc(big, huge);
                println!(
                    "\n  cpu {cpu}: {} KiB purged, {reused} of 512 blocks handed out again, every page on node {node}",
                    back >> 10
                );
            }
        })
        .join()
        .unwrap();
    }
    let nodes = t.memory_nodes().intersection(&t.allowed_nodes());
    if nodes.len() < 2 {
        return Outcome::Pass;
    }
    let policy = Interleave::new(nodes, Granularity::Count(2)).unwrap();
    let topo = t.clone();
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(first_cpu(&topo, topo.cpu_nodes().first().unwrap())).unwrap();
        let l = Layout::from_size_align(64 << 10, 4096).unwrap();
        let round = |what: &str| {
            let model = Cursor::new(&policy);
            let mut raw: Vec<*mut u8> = Vec::with_capacity(48);
            {
                let _g = numaweave::with_policy(Policy::Interleave(policy)).unwrap();
                for _ in 0..48 {
                    // SAFETY: a valid layout; freed below.
                    raw.push(unsafe { A.alloc(l) });
                }
            }
            for (i, &p) in raw.iter().enumerate() {
                let want = topo.physical_node(model.next(l.size()));
                let got = touch_and_locate(p, l.size());
                assert!(got.iter().all(|&n| n == Some(want)), "{what} buffer {i}: pages on {got:?}, want {want}");
            }
            for p in raw {
                // SAFETY: allocated above with `l`.
                unsafe { A.dealloc(p, l) };
            }
        };
        round("interleaved");
        let back = A.trim();
        round("purged and interleaved again");
        println!("\n  interleave over {nodes}: {} KiB purged, 48 buffers again, every page on its node", back >> 10);
    })
    .join()
    .unwrap();
    Outcome::Pass
}

fn numaalloc_remote_frees_return_home(t: &Topology, _: Option<&Guest>) -> Outcome {
    let nodes: Vec<usize> = t.cpu_nodes().iter().collect();
    if nodes.len() < 2 {
        return Outcome::Skip("needs two nodes with CPUs");
    }
    let (home, away) = (*nodes.last().unwrap(), nodes[0]);
    let (home_cpu, away_cpu) = (first_cpu(t, home), first_cpu(t, away));
    let l = Layout::from_size_align(512, 8).unwrap();
    let before = A.stats();
    let (tx, rx) = mpsc::channel::<Vec<usize>>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let owner = std::thread::spawn(move || {
        os::cpu::pin_current_thread(home_cpu).unwrap();
        // A thread's first 8 blocks of a class come from its node's shared
        // heap (their remote frees collected there, later): held, so that
        // the 1000 below are the owner's own.
        // SAFETY: valid layout.
        let first: Vec<usize> = (0..8).map(|_| unsafe { A.alloc(l) } as usize).collect();
        // SAFETY: valid layout.
        let blocks: Vec<usize> = (0..1000).map(|_| unsafe { A.alloc(l) } as usize).collect();
        tx.send(blocks.clone()).unwrap();
        done_rx.recv().unwrap();
        // SAFETY: valid layout.
        let again: Vec<usize> = (0..1000).map(|_| unsafe { A.alloc(l) } as usize).collect();
        let old: HashSet<usize> = blocks.into_iter().collect();
        let reused = again.iter().filter(|p| old.contains(p)).count();
        for p in again.into_iter().chain(first) {
            // SAFETY: allocated above with `l`.
            unsafe { A.dealloc(p as *mut u8, l) };
        }
        reused
    });
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(away_cpu).unwrap();
        for p in rx.recv().unwrap() {
            // SAFETY: blocks allocated with `l` by the owner.
            unsafe {
                assert_eq!(A.node_of(p as *const u8), home);
                A.dealloc(p as *mut u8, l);
            }
        }
        done_tx.send(()).unwrap();
    })
    .join()
    .unwrap();
    let reused = owner.join().unwrap();
    let after = A.stats();
    let remote = after.per_node[home].remote_frees - before.per_node[home].remote_frees;
    println!(
        "\n  1000 blocks of node {home} freed on node {away}: {remote} remote frees booked on node {home}, {reused} reused by their owner\n{after}"
    );
    assert!(remote >= 1000);
    assert!(reused >= 900);
    Outcome::Pass
}

fn numaalloc_falls_back_by_distance_when_a_node_is_full(t: &Topology, layout: Option<&Guest>) -> Outcome {
    if layout.is_none() {
        return Outcome::Skip("fills a node: only inside the numa-vm guest");
    }
    let node = t.cpu_nodes().first().unwrap();
    let cpu = first_cpu(t, node);
    let target = (t.memory_of(node) + (64 << 20)) as usize;
    let before = A.stats().per_node[node].fallbacks;
    let placed = fill_from_cpu(cpu, target, None);
    let after = A.stats().per_node[node].fallbacks;
    println!(
        "\n  filled node {node} with {} MiB: pages per node {:?}, {} fallbacks",
        target >> 20,
        placed.iter().enumerate().filter(|(_, c)| **c > 0).collect::<Vec<_>>(),
        after - before
    );
    assert!(after > before, "no fallback counted");
    assert_spilled_to_nearest(t, node, &placed);
    Outcome::Pass
}

/// Allocates `bytes` in 128 KiB blocks (size-class pages, drawn from the
/// arenas) on a thread pinned to `cpu`, under `policy` when given, touching
/// every page; frees them and gives the memory back. Returns the pages found
/// on each kernel node.
fn fill_from_cpu(cpu: usize, bytes: usize, policy: Option<Policy>) -> Vec<usize> {
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(cpu).unwrap();
        let _g = policy.map(|p| numaweave::with_policy(p).unwrap());
        let l = Layout::from_size_align(128 << 10, 8).unwrap();
        let mut blocks = Vec::with_capacity(bytes / l.size() + 1);
        let mut per_node = vec![0usize; numaweave::topology::MAX_NODES];
        while blocks.len() * l.size() < bytes {
            // SAFETY: valid layout.
            let p = unsafe { A.alloc(l) };
            assert!(!p.is_null(), "allocation failed after {} MiB", (blocks.len() * l.size()) >> 20);
            for n in touch_and_locate(p, l.size()).into_iter().flatten() {
                per_node[n] += 1;
            }
            blocks.push(p);
        }
        for p in blocks {
            // SAFETY: allocated above with `l`.
            unsafe { A.dealloc(p, l) };
        }
        A.collect();
        per_node
    })
    .join()
    .unwrap()
}

/// Checks that a fill of node `from` (`placed`: pages per kernel node)
/// overflowed, and only to the memory nodes nearest `from`: never farther
/// than the nearest other node while that one has room.
fn assert_spilled_to_nearest(t: &Topology, from: usize, placed: &[usize]) {
    let elsewhere: Vec<usize> = (0..placed.len()).filter(|&n| placed[n] > 0 && n != t.physical_node(from)).collect();
    assert!(!elsewhere.is_empty(), "nothing placed outside node {from}");
    let nearest = t.nodes_by_distance(from).find(|&n| n != from && t.memory_nodes().contains(n)).unwrap();
    let d = t.distance(from, nearest);
    for n in elsewhere {
        let ln = t.logical_node(n).unwrap();
        assert_eq!(
            t.distance(from, ln),
            d,
            "overflow of node {from} reached node {ln} (distance {}) before the nearest, {nearest}",
            t.distance(from, ln)
        );
    }
}

fn slab_objects_land_on_the_cache_node(t: &Topology, _: Option<&Guest>) -> Outcome {
    // Allocate from a thread on the first CPU node, whatever the cache's node.
    let cpu = first_cpu(t, t.cpu_nodes().first().unwrap());
    let topo = t.clone();
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(cpu).unwrap();
        let t = &topo;
        for node in t.memory_nodes().iter() {
            let phys = t.physical_node(node);
            let cache = RawCache::builder("vm_homed", 2048).node(node).build().unwrap();
            let objs: Vec<_> = (0..200).map(|_| cache.alloc().unwrap()).collect();
            for &o in &objs {
                // SAFETY: a live object of `cache`.
                assert_eq!(unsafe { cache.node_of(o) }, node);
                let got = touch_and_locate(o.as_ptr(), 2048);
                assert!(got.iter().all(|&g| g == Some(phys)), "object of a cache homed on {node}: pages on {got:?}");
            }
            // SAFETY: each freed once.
            unsafe { cache.free_bulk(&objs) };
            println!("\n  cache homed on node {node}: 200 objects from cpu {cpu}, every page on node {node}");
        }
        let any = SlabCache::<[u8; 512]>::new("vm_alloc_on").unwrap();
        for node in t.memory_nodes().iter() {
            let phys = t.physical_node(node);
            let mut objs: Vec<_> = (0..100).map(|_| any.alloc_on(node, [0; 512]).unwrap()).collect();
            for o in objs.iter_mut() {
                assert_eq!(SlabBox::node(o), node);
                let got = touch_and_locate(o.as_mut_ptr(), 512);
                assert!(got.iter().all(|&g| g == Some(phys)), "alloc_on({node}): pages on {got:?}");
            }
        }
        println!("  alloc_on(k) for every node k: every page on node k");
    })
    .join()
    .unwrap();
    Outcome::Pass
}

/// A `NodeRing` per memory node, used from the test's thread: every buffer
/// on the ring's node (move_pages), written with
/// `WRITE_FIXED` and read back with `READ_FIXED` through its registered slot.
#[cfg(feature = "io-uring")]
fn uring_rings_per_node_read_and_write_fixed_on_their_node(t: &Topology, _: Option<&Guest>) -> Outcome {
    use std::os::fd::AsRawFd;

    use io_uring::{opcode, types};
    use numaweave::io::uring::NodeRing;

    const SIZE: usize = 4096;
    let run = |ring: &NodeRing, e: io_uring::squeue::Entry| {
        // SAFETY: the buffer and file the entry names outlive this call.
        unsafe { ring.run_one(&e) }.unwrap()
    };
    for node in t.memory_nodes().iter() {
        let ring = match NodeRing::new(node, SIZE, 32) {
            Ok(r) => r,
            Err(e) => {
                print!("({e}) ");
                return Outcome::Skip("no io_uring in the guest");
            }
        };
        let phys = t.physical_node(node);
        let path = format!("/tmp/numaweave-uring-{node}");
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let fd = types::Fd(file.as_raw_fd());
        let mut bufs: Vec<_> = (0..64).map(|_| ring.alloc().unwrap()).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            let got = touch_and_locate(b.as_mut_ptr(), SIZE);
            assert!(got.iter().all(|&g| g == Some(phys)), "ring of node {node}: buffer {i} on {got:?}");
            b.fill(node as u8 ^ i as u8);
            let w = opcode::WriteFixed::new(fd, b.as_mut_ptr(), SIZE as u32, b.index()).offset((i * SIZE) as u64);
            assert_eq!(run(&ring, w.build()), SIZE as i32);
        }
        for (i, b) in bufs.iter_mut().enumerate() {
            b.fill(0);
            let r = opcode::ReadFixed::new(fd, b.as_mut_ptr(), SIZE as u32, b.index()).offset((i * SIZE) as u64);
            assert_eq!(run(&ring, r.build()), SIZE as i32);
            assert!(b.iter().all(|&x| x == node as u8 ^ i as u8), "ring of node {node}: buffer {i} read back wrong");
        }
        drop(bufs);
        // A provided-buffer ring of 8 of the pool's buffers receives a
        // stream 32 times its size: every buffer filled on the node,
        // verified, recycled.
        let group = ring.buf_ring(node as u16, 8).unwrap();
        let (tx, rx) = std::os::unix::net::UnixStream::pair().unwrap();
        const STREAM: usize = 32 * 8 * SIZE;
        let byte = move |k: usize| (k as u8).wrapping_mul(13) ^ (k >> 12) as u8 ^ node as u8;
        let sender = std::thread::spawn(move || {
            let data: Vec<u8> = (0..STREAM).map(byte).collect();
            std::io::Write::write_all(&mut &tx, &data).unwrap();
        });
        let (mut got, mut bids) = (0, std::collections::HashSet::new());
        while got < STREAM {
            // SAFETY: the socket outlives the request; the buffer is the ring's.
            let cqe = unsafe { ring.run_one_entry(&group.recv(rx.as_raw_fd())) }.unwrap();
            let mut buf = group.take(&cqe).unwrap().expect("a buffer selected");
            assert!(!buf.is_empty(), "ring of node {node}: the stream ended at {got}");
            for (i, &b) in buf.iter().enumerate() {
                assert_eq!(b, byte(got + i), "ring of node {node}: byte {} received wrong", got + i);
            }
            got += buf.len();
            if bids.insert(buf.bid()) {
                let n = buf.len();
                let on = touch_and_locate(buf.as_mut_ptr(), n);
                assert!(on.iter().all(|&g| g == Some(phys)), "ring of node {node}: provided buffer on {on:?}");
            }
        }
        sender.join().unwrap();
        assert_eq!(group.available(), 8);
        println!(
            "\n  ring of node {node}: 64 fixed buffers on node {node}, {} bytes pinned, written and read back; \
             {STREAM} bytes received through {} provided buffers on node {node}",
            ring.pinned(),
            bids.len()
        );
    }
    Outcome::Pass
}

fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().count()
}

/// 1 GiB of 4 KiB buffers (8,456 slabs of 128 KiB) homed on the last node:
/// a few chunk mappings, not one per slab, and every buffer on the node.
fn slab_chunks_scale_and_stay_on_their_node(t: &Topology, _: Option<&Guest>) -> Outcome {
    let node = t.memory_nodes().iter().last().unwrap();
    let phys = t.physical_node(node);
    let cache = RawCache::builder("vm_dma_4k", 4096).align(4096).node(node).build().unwrap();
    let before = mappings();
    let mut objs = vec![std::ptr::null_mut(); (1 << 30) / 4096];
    for part in objs.chunks_mut(4096) {
        cache.alloc_bulk(part).unwrap();
    }
    let st = cache.stats().total();
    let grown = mappings().saturating_sub(before);
    assert!(
        st.chunks <= 64 && grown <= st.chunks + 16,
        "{grown} new mappings, {} chunks, {} slabs",
        st.chunks,
        st.slabs
    );
    // Every 97th buffer touched and located (a sample across all chunks).
    let mut bad = Vec::new();
    for (i, &o) in objs.iter().enumerate().step_by(97) {
        let got = touch_and_locate(o, 4096);
        if !got.iter().all(|&g| g == Some(phys)) {
            bad.push((i, o, got));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} sampled buffers of a cache homed on {node} elsewhere, first {:?}, last {:?}",
        bad.len(),
        objs.len() / 97,
        bad.first(),
        bad.last()
    );
    let objs: Vec<_> = objs.into_iter().map(|p| std::ptr::NonNull::new(p).unwrap()).collect();
    // A free writes the object's link word (touching its page): 16 MiB at a
    // time, each batch's emptied slabs given back before the next.
    for batch in objs.chunks(4096) {
        // SAFETY: objects of `cache`, each freed once.
        unsafe { cache.free_bulk(batch) };
        cache.shrink();
    }
    assert_eq!(cache.stats().total().chunks, 0);
    println!(
        "\n  {} buffers of 4 KiB on node {node}: {} slabs in {} chunks ({grown} new mappings), sampled pages all on node {node}",
        objs.len(),
        st.slabs,
        st.chunks
    );
    Outcome::Pass
}

fn reserve_huge_pages(phys: usize, pages: usize) -> bool {
    reserve_pages(phys, "2048kB", pages)
}

fn reserve_pages(phys: usize, size: &str, pages: usize) -> bool {
    let f = format!("/sys/devices/system/node/node{phys}/hugepages/hugepages-{size}/nr_hugepages");
    std::fs::write(&f, pages.to_string()).is_ok()
        && std::fs::read_to_string(&f).is_ok_and(|s| s.trim().parse::<usize>() == Ok(pages))
}

/// A cache of 4 KiB buffers on hugetlb pages reserved on the last node (the
/// guest's sysfs, as an administrator would): every chunk on huge pages,
/// every buffer on the node, each 2 MiB page physically contiguous; a node
/// with no reservation falls back to base pages, counted, still on its node.
fn slab_hugetlb_pages_are_on_the_node_and_contiguous(t: &Topology, layout: Option<&Guest>) -> Outcome {
    if layout.is_none() {
        return Outcome::Skip("reserves huge pages: only inside the numa-vm guest");
    }
    let node = t.memory_nodes().iter().last().unwrap();
    let other = t.memory_nodes().iter().next().unwrap();
    let (phys, other_phys) = (t.physical_node(node), t.physical_node(other));
    if node == other || !reserve_huge_pages(phys, 16) {
        return Outcome::Skip("no second node, or no hugetlb pages to reserve");
    }
    let cache =
        RawCache::builder("vm_huge_4k", 4096).align(4096).node(node).huge(numaweave::Huge::Hugetlb).build().unwrap();
    let objs: Vec<_> = (0..3072).map(|_| cache.alloc().unwrap()).collect();
    let st = cache.stats().total();
    assert!(st.chunks > 0 && st.huge_chunks == st.chunks && st.huge_fallbacks == 0, "{st:?}");
    let mut runs = HashSet::new();
    for &o in &objs {
        let p = o.as_ptr();
        let got = touch_and_locate(p, 4096);
        assert!(got.iter().all(|&g| g == Some(phys)), "hugetlb buffer of node {node}: pages on {got:?}");
        let base = (p as usize) & !((2 << 20) - 1);
        let (f, fb) = (os::mem::page_frame(p).unwrap(), os::mem::page_frame(base as *const u8).unwrap());
        let (Some(f), Some(fb)) = (f, fb) else { panic!("no frame for {p:p}") };
        assert_eq!(f - fb, ((p as usize - base) / 4096) as u64, "{p:p} not contiguous with its huge page");
        runs.insert(base);
    }
    // SAFETY: objects of `cache`, each freed once.
    unsafe { cache.free_bulk(&objs) };
    cache.shrink();
    drop(cache);
    // DMA buffers of 64 KiB on the same pool: each one physical segment.
    let dma =
        DmaPool::builder("vm_dma_64k", 64 << 10).node(node).huge(numaweave::Huge::Hugetlb).lock(true).build().unwrap();
    let bufs: Vec<_> = (0..48).map(|_| dma.alloc().unwrap()).collect();
    for b in &bufs {
        assert_eq!(b.node(), node);
        assert_eq!(b.phys_segments().unwrap(), 1, "a 64 KiB DMA buffer at {:p} in pieces", b.as_ptr());
        assert_eq!(b.phys_addr().unwrap() % (64 << 10), (b.as_ptr() as u64) % (64 << 10));
    }
    let dma_huge = dma.stats().total().huge_chunks;
    drop(bufs);
    dma.shrink();
    drop(dma);
    // Nothing reserved on the other node: base pages there, counted.
    reserve_huge_pages(other_phys, 0);
    let plain = RawCache::builder("vm_huge_fallback", 4096)
        .align(4096)
        .node(other)
        .huge(numaweave::Huge::Hugetlb)
        .build()
        .unwrap();
    let o = plain.alloc().unwrap();
    let st2 = plain.stats().total();
    assert!(st2.huge_fallbacks >= 1 && st2.huge_chunks == 0, "{st2:?}");
    let got = touch_and_locate(o.as_ptr(), 4096);
    assert!(got.iter().all(|&g| g == Some(other_phys)), "fallback buffer of node {other}: pages on {got:?}");
    // SAFETY: allocated above from `plain`, freed once.
    unsafe { plain.free(o) };
    plain.shrink();
    reserve_huge_pages(phys, 0);
    println!(
        "\n  3072 buffers of 4 KiB on hugetlb pages of node {node}: {} chunks, {} huge pages used, each one physical run; 48 locked DMA buffers of 64 KiB ({dma_huge} hugetlb chunks), each one physical segment; node {other} without a reservation fell back ({} counted)",
        st.chunks,
        runs.len(),
        st2.huge_fallbacks
    );
    Outcome::Pass
}

/// A DMA pool on a 1 GiB page reserved on the last node (guests with
/// nodes of more than 1 GiB; skipped where the page cannot be reserved):
/// 128 buffers of 512 KiB, all on the node, physically one run across them.
fn slab_gigantic_pages_make_one_physical_run(t: &Topology, layout: Option<&Guest>) -> Outcome {
    if layout.is_none() {
        return Outcome::Skip("reserves a 1 GiB page: only inside the numa-vm guest");
    }
    let node = t.memory_nodes().iter().last().unwrap();
    let phys = t.physical_node(node);
    if !reserve_pages(phys, "1048576kB", 1) {
        return Outcome::Skip("no 1 GiB page could be reserved on the node (nodes of 1 GiB or less)");
    }
    let pool = DmaPool::builder("vm_dma_512k", 512 << 10).node(node).huge(numaweave::Huge::Hugetlb1G).build().unwrap();
    let bufs: Vec<_> = (0..128).map(|_| pool.alloc().unwrap()).collect();
    let st = pool.stats().total();
    assert!(st.chunks == 1 && st.huge_chunks == 1 && st.huge_fallbacks == 0, "{st:?}");
    let (va0, pa0) = (bufs[0].as_ptr() as u64, bufs[0].phys_addr().unwrap());
    for b in &bufs {
        assert_eq!(b.node(), node);
        assert_eq!(b.phys_segments().unwrap(), 1);
        assert_eq!(
            b.phys_addr().unwrap().wrapping_sub(pa0),
            (b.as_ptr() as u64).wrapping_sub(va0),
            "not one physical run"
        );
    }
    drop(bufs);
    pool.shrink();
    drop(pool);
    reserve_pages(phys, "1048576kB", 0);
    println!("\n  128 DMA buffers of 512 KiB on a 1 GiB page of node {node}: one chunk, one physical run");
    Outcome::Pass
}

fn slab_remote_frees_go_home_to_their_node(t: &Topology, _: Option<&Guest>) -> Outcome {
    let nodes: Vec<usize> = t.cpu_nodes().iter().collect();
    if nodes.len() < 2 {
        return Outcome::Skip("needs two nodes with CPUs");
    }
    let (home, away) = (*nodes.last().unwrap(), nodes[0]);
    let (home_cpu, away_cpu) = (first_cpu(t, home), first_cpu(t, away));
    let cache = std::sync::Arc::new(SlabCache::<[u64; 32]>::builder("vm_remote").node(home).build().unwrap());
    // A thread on the home node allocates; a thread on node `away` frees.
    let c = cache.clone();
    let objs = std::thread::spawn(move || {
        os::cpu::pin_current_thread(home_cpu).unwrap();
        (0..1000).map(|i| c.alloc([i; 32]).unwrap()).collect::<Vec<_>>()
    })
    .join()
    .unwrap();
    let addrs: HashSet<usize> = objs.iter().map(|b| SlabBox::as_ptr(b) as usize).collect();
    let before = cache.stats().node(home);
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(away_cpu).unwrap();
        for (i, b) in objs.into_iter().enumerate() {
            assert!(b.iter().all(|&w| w == i as u64));
            drop(b);
        }
    })
    .join()
    .unwrap();
    let after = cache.stats().node(home);
    let remote = after.remote_frees - before.remote_frees;
    assert_eq!(remote, 1000, "frees on node {away} of node {home}'s objects: {after:?}");
    assert_eq!(cache.stats().node(away).active, 0, "a node-{away} thread kept node-{home} objects");
    // Back in node `home`'s slabs: the owner's next allocations reuse them.
    let c = cache.clone();
    let reused = std::thread::spawn(move || {
        os::cpu::pin_current_thread(home_cpu).unwrap();
        let again: Vec<_> = (0..1000).map(|i| c.alloc([i; 32]).unwrap()).collect();
        again.iter().filter(|b| addrs.contains(&(SlabBox::as_ptr(b) as usize))).count()
    })
    .join()
    .unwrap();
    println!(
        "\n  1000 objects of node {home} freed on node {away}: {remote} remote frees on node {home}, {reused} reused there\n{}",
        cache.stats()
    );
    assert!(reused >= 900);
    Outcome::Pass
}

/// InterleaveHandle buffers from a handle (its own cursor, so the sequence is
/// known): every page of every buffer is on the node a second cursor, fed the
/// same sizes, predicts. Weighted (the first node gets two turns) and by
/// count and by bytes.
fn policy_interleave_pages_follow_the_cursor(t: &Topology, _: Option<&Guest>) -> Outcome {
    let nodes = t.memory_nodes().intersection(&t.allowed_nodes());
    if nodes.len() < 2 {
        return Outcome::Skip("needs two nodes with memory");
    }
    let weights: Vec<u8> = nodes.iter().enumerate().map(|(i, _)| if i == 0 { 2 } else { 1 }).collect();
    let topo = t.clone();
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(first_cpu(&topo, topo.cpu_nodes().first().unwrap())).unwrap();
        for g in [Granularity::Count(3), Granularity::Bytes(256 << 10)] {
            let policy = Interleave::new(nodes, g).unwrap().with_weights(&weights).unwrap();
            let h = A.interleave(policy).unwrap();
            let model = Cursor::new(&policy);
            let mut bufs = Vec::new();
            for i in 0..64usize {
                let size = 4096 << (i % 5); // 4–64 KiB
                let b = allocator_api2::vec::Vec::<u8, _>::with_capacity_in(size, h.clone());
                let want = topo.physical_node(model.next(size));
                let got = touch_and_locate(b.as_ptr().cast_mut(), size);
                assert!(
                    got.iter().all(|&n| n == Some(want)),
                    "{g:?} buffer {i} ({size} B): pages on {got:?}, want {want}"
                );
                bufs.push(b);
            }
            let extents =
                bufs.windows(2).filter(|w| w[0].as_ptr() as usize + w[0].capacity() != w[1].as_ptr() as usize).count()
                    + 1;
            println!(
                "\n  {g:?} over {nodes} weights {weights:?}: 64 buffers, every page on its node, {extents} extents"
            );

            // The same through the global allocator under a scoped policy
            // (its thread-only cursor and turn window), as I/O buffers
            // (page-aligned: placed block by block): nothing else may
            // allocate while the guard is up, so the vector is made first.
            let model = Cursor::new(&policy);
            let mut raw: Vec<(*mut u8, Layout)> = Vec::with_capacity(64);
            {
                let _g = numaweave::with_policy(Policy::Interleave(policy)).unwrap();
                for i in 0..64usize {
                    let l = Layout::from_size_align(4096 << (i % 5), 4096).unwrap();
                    // SAFETY: a valid layout; freed below.
                    raw.push((unsafe { A.alloc(l) }, l));
                }
            }
            for (i, &(p, l)) in raw.iter().enumerate() {
                let want = topo.physical_node(model.next(l.size()));
                let got = touch_and_locate(p, l.size());
                assert!(got.iter().all(|&n| n == Some(want)), "scoped {g:?} buffer {i}: pages on {got:?}, want {want}");
            }
            for (p, l) in raw {
                // SAFETY: allocated above with `l`.
                unsafe { A.dealloc(p, l) };
            }
            println!("  the same under with_policy: 64 buffers, every page on its node");

            // Freed as it goes (blocks the thread frees are reused within
            // the turn, or by the node's next turn): 3000 buffers, five live
            // at a time, each written and its page asked for under the guard
            // (`page_node` does not allocate), off the model's node: none.
            let model = Cursor::new(&policy);
            let l = Layout::from_size_align(4096, 4096).unwrap();
            let mut wrong: Vec<(usize, Option<usize>)> = Vec::with_capacity(3000);
            let mut ring = [std::ptr::null_mut::<u8>(); 5];
            {
                let _g = numaweave::with_policy(Policy::Interleave(policy)).unwrap();
                for i in 0..3000usize {
                    let slot = &mut ring[i % 5];
                    if !slot.is_null() {
                        // SAFETY: allocated below with `l`, five steps ago.
                        unsafe { A.dealloc(*slot, l) };
                    }
                    // SAFETY: a valid layout; 4096 writable bytes, freed above or below.
                    let p = unsafe { A.alloc(l) };
                    // SAFETY: as above.
                    unsafe { p.write_bytes(i as u8, 4096) };
                    *slot = p;
                    let want = topo.physical_node(model.next(4096));
                    let got = os::mem::page_node(p).unwrap();
                    if got != Some(want) && wrong.len() < wrong.capacity() {
                        wrong.push((i, got));
                    }
                }
                for p in ring {
                    // SAFETY: the last five, allocated with `l`.
                    unsafe { A.dealloc(p, l) };
                }
            }
            assert!(wrong.is_empty(), "scoped {g:?} churn: buffers off their node: {:?}", &wrong[..wrong.len().min(8)]);
            println!("  freed as it goes (five live): 3000 buffers, every one on its node");
        }
    })
    .join()
    .unwrap();
    Outcome::Pass
}

fn policy_bind_never_leaves_its_set(t: &Topology, _: Option<&Guest>) -> Outcome {
    let mem: Vec<usize> = t.memory_nodes().intersection(&t.allowed_nodes()).iter().collect();
    if mem.len() < 2 {
        return Outcome::Skip("needs two nodes with memory");
    }
    let cpu = first_cpu(t, t.cpu_nodes().first().unwrap());
    let topo = t.clone();
    std::thread::spawn(move || {
        os::cpu::pin_current_thread(cpu).unwrap();
        // A far node alone, then a pair that excludes the thread's own node.
        let sets = [NodeSet::single(*mem.last().unwrap()), mem[1..].iter().take(2).copied().collect::<NodeSet>()];
        for set in sets {
            let phys: Vec<usize> = set.iter().map(|n| topo.physical_node(n)).collect();
            let _g = numaweave::with_policy(Policy::Bind(set)).unwrap();
            for size in [64, 4000, 100_000, 3 << 20] {
                let l = Layout::from_size_align(size, 8).unwrap();
                // SAFETY: valid layout; freed below.
                let ps: Vec<*mut u8> = (0..8).map(|_| unsafe { A.alloc(l) }).collect();
                for &p in &ps {
                    let got = touch_and_locate(p, size);
                    assert!(
                        got.iter().all(|n| n.is_some_and(|n| phys.contains(&n))),
                        "bind:{set}, {size} B: pages on {got:?}"
                    );
                    // SAFETY: allocated above with `l`.
                    unsafe { A.dealloc(p, l) };
                }
            }
            println!("\n  bind:{set} from cpu {cpu}: 64 B to 3 MiB blocks, every page inside the set");
        }
    })
    .join()
    .unwrap();
    Outcome::Pass
}

/// Preferred on a node other than the thread's, filled past its size: the
/// overflow goes to the node nearest *the preferred node*, not the thread's.
fn policy_preferred_falls_back_by_distance_from_its_node(t: &Topology, layout: Option<&Guest>) -> Outcome {
    if layout.is_none() {
        return Outcome::Skip("fills a node: only inside the numa-vm guest");
    }
    let cpu_nodes: Vec<usize> = t.cpu_nodes().iter().collect();
    if cpu_nodes.len() < 2 {
        return Outcome::Skip("needs two nodes with CPUs");
    }
    let (home, pref) = (cpu_nodes[0], *cpu_nodes.last().unwrap());
    let cpu = first_cpu(t, home);
    let target = (t.memory_of(pref) + (64 << 20)) as usize;
    let placed = fill_from_cpu(cpu, target, Some(Policy::Preferred(pref)));
    println!(
        "\n  preferred:{pref} from node {home}, {} MiB: pages per node {:?}",
        target >> 20,
        placed.iter().enumerate().filter(|(_, c)| **c > 0).collect::<Vec<_>>()
    );
    assert!(placed[t.physical_node(pref)] > 0, "nothing on the preferred node");
    assert_spilled_to_nearest(t, pref, &placed);
    Outcome::Pass
}

/// numa-vm's `--hmat` defaults (its README): local DRAM 100 GB/s and 80 ns,
/// the other socket's 50 and 140; memory-only node k behind CPU node
/// k % sockets, 30 GB/s and 250 ns from there, 15 and 350 from elsewhere.
/// In the table's unit, MB/s: QEMU reads `100G` as 100 x 2^30 bytes/s and
/// writes 102,400 of 2^20.
fn hmat_default(sockets: usize, i: usize, t: usize) -> (u32, u32) {
    let (gb, ns) = match (t < sockets, i == t % sockets) {
        (true, true) => (100, 80),
        (true, false) => (50, 140),
        (false, true) => (30, 250),
        (false, false) => (15, 350),
    };
    (gb * 1024, ns)
}

/// The guest with `--hmat`: the HMAT is read (as root) and gives the whole
/// initiator x target matrix the harness put in it, and each socket's
/// `weights=auto` are its own row reduced as the kernel reduces.
fn hmat_matrix_and_auto_weights_of_each_socket(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let Some(l) = layout else { return Outcome::Skip("needs NUMAWEAVE_VM_LAYOUT (numa-vm guest)") };
    if t.perf_source() != PerfSource::Hmat {
        return Outcome::Skip("no ACPI HMAT (numa-vm --hmat)");
    }
    for i in t.cpu_nodes().iter() {
        for tgt in t.memory_nodes().iter() {
            let (bw, ns) = hmat_default(l.cpu_nodes, i, tgt);
            assert_eq!(t.bandwidth(i, tgt), Some(bw), "bandwidth {i} -> {tgt}");
            assert_eq!(t.latency(i, tgt), Some(ns), "latency {i} -> {tgt}");
        }
    }
    let all = t.memory_nodes();
    for i in t.cpu_nodes().iter() {
        let row: Vec<u32> = all.iter().map(|tgt| hmat_default(l.cpu_nodes, i, tgt).0).collect();
        let want = numaweave::policy::reduce_weights(&row);
        let got = t.interleave_weights(i, all);
        assert_eq!(got.of(all), want[..all.len()].to_vec(), "weights of socket {i}");
        println!("\n  socket {i}: bandwidth {row:?} MB/s -> weights {:?} ({})", got.of(all), got.source);
    }
    // Without root the HMAT is unreadable: sysfs's access1 figures (each
    // target's best initiator) and the distances, and the source says so.
    run_child(&["--perf-unprivileged-child"]);
    if l.cpu_nodes == 2 && l.memory_only == 2 {
        // The figures: each socket favours its own DRAM, then the
        // other's, then its own CXL node, then the other's.
        assert_eq!(t.interleave_weights(0, all).of(all), [8, 4, 2, 1]);
        assert_eq!(t.interleave_weights(1, all).of(all), [4, 8, 1, 2]);
    }
    print!("{t}");
    Outcome::Pass
}

/// Bytes placed per node under `interleave:ALL:bytes=1M:weights=auto` by a
/// thread on each socket (64 KiB I/O buffers, two whole rounds: every turn
/// complete), measured with `move_pages`: each node holds exactly its
/// weight's share of turns. Then the thread moves to the other socket
/// under the same guard: what it places from there follows that socket's
/// weights.
fn hmat_weights_auto_placement_follows_the_sockets_weights(t: &Topology, layout: Option<&Guest>) -> Outcome {
    if layout.is_none() || t.perf_source() != PerfSource::Hmat || t.cpu_nodes().len() < 2 {
        return Outcome::Skip("needs the numa-vm guest with --hmat and two sockets");
    }
    const TURN: usize = 1 << 20;
    const BUF: usize = 64 << 10;
    let all = t.memory_nodes().intersection(&t.allowed_nodes());
    let policy: Policy = format!("interleave:{all}:bytes=1M:weights=auto").parse().unwrap();
    let sockets: Vec<usize> = t.cpu_nodes().iter().collect();
    let topo = t.clone();
    std::thread::spawn(move || {
        // Places `rounds` whole rounds of `from`'s weights; bytes per node.
        let place = |from: usize, rounds: usize, held: &mut Vec<(*mut u8, Layout)>| -> Vec<usize> {
            let w = topo.interleave_weights(from, all);
            let turns: usize = w.of(all).iter().map(|&x| usize::from(x)).sum();
            let count = rounds * turns * TURN / BUF;
            let l = Layout::from_size_align(BUF, 4096).unwrap();
            let first = held.len();
            for _ in 0..count {
                // SAFETY: a valid layout; freed by the caller.
                held.push((unsafe { A.alloc(l) }, l));
            }
            let mut per = vec![0usize; topology::MAX_NODES];
            for &(p, _) in &held[first..] {
                let on = touch_and_locate(p, BUF);
                let n = on[0].expect("page not present");
                assert!(on.iter().all(|&g| g == Some(n)), "a 64 KiB buffer split over nodes: {on:?}");
                per[n] += BUF;
            }
            for n in all.iter() {
                let want = rounds * usize::from(w.weights[n]) * TURN;
                assert_eq!(
                    per[n],
                    want,
                    "from socket {from}: node {n} holds {} KiB, its weight's share is {} KiB (weights {:?})",
                    per[n] >> 10,
                    want >> 10,
                    w.of(all)
                );
            }
            println!(
                "\n  from socket {from}: weights {:?}, {rounds} rounds, MiB per node {:?}",
                w.of(all),
                all.iter().map(|n| per[n] >> 20).collect::<Vec<_>>()
            );
            per
        };
        for (k, &s) in sockets.iter().enumerate() {
            let other = sockets[(k + 1) % sockets.len()];
            os::cpu::pin_current_thread(first_cpu(&topo, s)).unwrap();
            let mut held = Vec::with_capacity(4096);
            {
                let _g = numaweave::with_policy(policy).unwrap();
                place(s, 2, &mut held);
                // Moved to the other socket: its weights from the next pick.
                os::cpu::pin_current_thread(first_cpu(&topo, other)).unwrap();
                place(other, 2, &mut held);
            }
            for (p, l) in held {
                // SAFETY: allocated above with `l`.
                unsafe { A.dealloc(p, l) };
            }
        }
    })
    .join()
    .unwrap();
    Outcome::Pass
}

/// `tier:lower`, `A.cold()` and `alloc_cold` from each socket land on the
/// memory-only node behind it (the lower tier nearest by bandwidth).
fn hmat_tier_lower_lands_on_the_sockets_memory_only_node(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let Some(l) = layout else { return Outcome::Skip("needs NUMAWEAVE_VM_LAYOUT (numa-vm guest)") };
    if t.perf_source() != PerfSource::Hmat || l.memory_only < l.cpu_nodes {
        return Outcome::Skip("needs --hmat and a memory-only node behind every socket");
    }
    let topo = t.clone();
    let sockets = l.cpu_nodes;
    std::thread::spawn(move || {
        for s in topo.cpu_nodes().iter() {
            // The memory-only node k hangs off socket k % sockets; the
            // first such is behind `s`.
            let want = (sockets..sockets + topo.memory_only_nodes().len()).find(|k| k % sockets == s).unwrap();
            assert_eq!(topo.nearest_lower_tier(s), Some(want));
            os::cpu::pin_current_thread(first_cpu(&topo, s)).unwrap();
            let cold = A.cold();
            assert_eq!(cold.node(), want);
            let mut v: allocator_api2::vec::Vec<u8, _> =
                allocator_api2::vec::Vec::with_capacity_in(1 << 20, cold.clone());
            v.resize(1 << 20, 1);
            let on = touch_and_locate(v.as_mut_ptr(), 1 << 20);
            assert!(on.iter().all(|&g| g == Some(want)), "cold data of socket {s}: {on:?}, want {want}");
            let lay = Layout::from_size_align(256 << 10, 4096).unwrap();
            let p = A.alloc_cold(lay).unwrap();
            let on = touch_and_locate(p.as_ptr(), 256 << 10);
            assert!(on.iter().all(|&g| g == Some(want)), "alloc_cold of socket {s}: {on:?}");
            // SAFETY: allocated above with `lay`.
            unsafe { A.dealloc(p.as_ptr(), lay) };
            let mut raw = Vec::with_capacity(64);
            {
                let _g = numaweave::with_policy(Policy::LowerTier).unwrap();
                let sl = Layout::from_size_align(2000, 8).unwrap();
                for _ in 0..64 {
                    // SAFETY: a valid layout; freed below.
                    raw.push(unsafe { A.alloc(sl) });
                }
            }
            for &p in &raw {
                let on = touch_and_locate(p, 2000);
                assert!(on.iter().all(|&g| g == Some(want)), "tier:lower block of socket {s}: {on:?}");
                // SAFETY: allocated above, 2000 bytes.
                unsafe { A.dealloc(p, Layout::from_size_align(2000, 8).unwrap()) };
            }
            println!("\n  socket {s}: cold data, alloc_cold and tier:lower all on node {want}");
        }
    })
    .join()
    .unwrap();
    Outcome::Pass
}

/// The child of `hmat_matrix_and_auto_weights_of_each_socket`: as user
/// nobody, the HMAT (mode 0400) cannot be read; the figures come from
/// sysfs, exact for each target's best initiator.
fn perf_unprivileged_child() {
    // SAFETY: plain calls dropping privileges (group first).
    unsafe {
        assert_eq!(libc::setgid(65534), 0, "setgid");
        assert_eq!(libc::setuid(65534), 0, "setuid");
    }
    assert!(std::fs::read("/sys/firmware/acpi/tables/HMAT").is_err(), "the HMAT is readable without root");
    let t = Topology::detect().unwrap();
    assert_eq!(t.perf_source(), PerfSource::SysfsAccess);
    let sockets = t.cpu_nodes().len();
    for tgt in t.memory_nodes().iter() {
        let best = tgt % sockets;
        assert_eq!(t.bandwidth(best, tgt), Some(hmat_default(sockets, best, tgt).0), "best initiator of {tgt}");
        assert_eq!(t.latency(best, tgt), Some(hmat_default(sockets, best, tgt).1));
    }
    let all = t.memory_nodes();
    println!(
        "perf child (user nobody): {}; socket 0 weights {:?}",
        t.perf_source(),
        t.interleave_weights(0, all).of(all)
    );
}

/// The rules of `hmat_size_rules_keep_small_blocks_local_and_weight_big_ones`.
const SIZE_RULES: &str = "<64K:local;>=64K:interleave:0-3:bytes=1M:weights=auto";

/// A whole program under rules by size (`NUMAWEAVE_POLICY`, read when the
/// allocator starts: in a child): small blocks on the thread's node, blocks
/// of 64 KiB and more over every node by the socket's weights.
fn hmat_size_rules_keep_small_blocks_local_and_weight_big_ones(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let Some(l) = layout else { return Outcome::Skip("needs NUMAWEAVE_VM_LAYOUT (numa-vm guest)") };
    if t.perf_source() != PerfSource::Hmat || l.cpu_nodes != 2 || l.memory_only != 2 {
        return Outcome::Skip("needs --hmat, 2 sockets and 2 memory-only nodes");
    }
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let out = Command::new(exe).arg("--size-rules-child").env("NUMAWEAVE_POLICY", SIZE_RULES).output().unwrap();
    print!("\n{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "size-rules child failed: {}", out.status);
    Outcome::Pass
}

/// The child: `A` starts here, under `SIZE_RULES`.
fn size_rules_child() {
    let t = Topology::detect().unwrap();
    os::cpu::pin_current_thread(first_cpu(&t, 0)).unwrap();
    // Small blocks, aligned or not: node 0 only.
    let mut small = Vec::with_capacity(512);
    for k in 0..512usize {
        let l = Layout::from_size_align(16 + (k * 97) % 60_000, if k % 2 == 0 { 8 } else { 4096 }).unwrap();
        // SAFETY: a valid layout; freed below.
        small.push((unsafe { A.alloc(l) }, l));
    }
    for &(p, l) in &small {
        let on = touch_and_locate(p, l.size());
        assert!(on.iter().all(|&g| g == Some(0)), "a {}-byte block on {on:?} under {SIZE_RULES}", l.size());
    }
    // 64 KiB blocks (65,000-byte requests): two rounds of socket 0's
    // weights (8,4,2,1 turns of 1 MiB), bytes per node exact.
    let turns = 15;
    let l = Layout::from_size_align(65_000, 8).unwrap();
    let mut per = [0usize; 4];
    let mut big = Vec::with_capacity(2 * turns * 16);
    for _ in 0..2 * turns * 16 {
        // SAFETY: a valid layout; freed below.
        let p = unsafe { A.alloc(l) };
        let on = touch_and_locate(p, 65_536);
        let n = on[0].unwrap();
        assert!(on.iter().all(|&g| g == Some(n)), "a 64 KiB block split: {on:?}");
        per[n] += 65_536;
        big.push(p);
    }
    assert_eq!(per, [16 << 20, 8 << 20, 4 << 20, 2 << 20], "64 KiB blocks per node under {SIZE_RULES}");
    for p in big {
        // SAFETY: allocated above with `l`.
        unsafe { A.dealloc(p, l) };
    }
    for (p, l) in small {
        // SAFETY: allocated above with `l`.
        unsafe { A.dealloc(p, l) };
    }
    println!(
        "  size-rules child: {SIZE_RULES}: 512 small blocks on node 0; 64 KiB blocks MiB per node {:?}",
        per.map(|b| b >> 20)
    );
}

/// `MPOL_WEIGHTED_INTERLEAVE` (Linux 6.9).
const MPOL_WEIGHTED_INTERLEAVE: i32 = 6;

/// Against the kernel's own weighted interleave (a 6.9+ guest kernel, with
/// `--hmat`): its memory tiers as read; socket 0's derived weights written
/// into `weighted_interleave/nodeN` are what the topology reads back; and
/// 120 pages under `MPOL_WEIGHTED_INTERLEAVE` land on each node in the
/// same share as 120 page buffers under our `weights=auto` from socket 0.
fn hmat_kernel_weighted_interleave_places_as_ours(t: &Topology, layout: Option<&Guest>) -> Outcome {
    let Some(l) = layout else { return Outcome::Skip("needs NUMAWEAVE_VM_LAYOUT (numa-vm guest)") };
    const SYSFS: &str = "/sys/kernel/mm/mempolicy/weighted_interleave";
    if t.perf_source() != PerfSource::Hmat || l.cpu_nodes != 2 || l.memory_only != 2 {
        return Outcome::Skip("needs --hmat, 2 sockets and 2 memory-only nodes");
    }
    if !std::path::Path::new(SYSFS).exists() {
        return Outcome::Skip("no weighted interleave in this kernel (6.9+; NUMA_VM_KERNEL)");
    }
    // The kernel's tiers (6.12 puts the HMAT's slower nodes in a tier of
    // their own): the lower tier is the memory-only nodes.
    assert_eq!(t.memory_tier(0), Some(1));
    assert!(t.memory_tier(2).unwrap() > 1, "node 2 in tier {:?}", t.memory_tier(2));
    assert_eq!(t.lower_tier_nodes(), t.memory_only_nodes());
    let all = t.memory_nodes();
    let ours = t.interleave_weights(0, all);
    assert_eq!(ours.of(all), [8, 4, 2, 1]);
    let write_weights = |w: &[u8]| {
        for (n, x) in all.iter().zip(w) {
            write_file(&format!("{SYSFS}/node{n}"), &x.to_string());
        }
    };
    write_weights(&ours.of(all));
    // A new process reads the kernel's weights as written.
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let out = Command::new(&exe).arg("--kernel-weights-child").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("kernel weights read: [Some(8), Some(4), Some(2), Some(1)]"), "{text}");
    // The kernel's placement: 120 pages (eight rounds of 15).
    let pages = 120;
    let r = Mapping::map(pages * os::page_size()).unwrap();
    r.set_hugepages(false).unwrap();
    let mask: u64 = all.iter().map(|n| 1u64 << t.physical_node(n)).sum();
    // SAFETY: mbind on our own mapping with a one-word node mask.
    let rc = unsafe {
        libc::syscall(libc::SYS_mbind, r.as_ptr(), r.len(), MPOL_WEIGHTED_INTERLEAVE, &mask as *const u64, 65, 0)
    };
    assert_eq!(rc, 0, "mbind(MPOL_WEIGHTED_INTERLEAVE): {}", std::io::Error::last_os_error());
    touch(&r);
    let mut kernel = [0usize; 4];
    for n in nodes_of(&r) {
        kernel[n.expect("page not present")] += 1;
    }
    // Ours: 120 page buffers from socket 0 under weights=auto, a page a turn.
    let policy: Policy = format!("interleave:{all}:count=1:weights=auto").parse().unwrap();
    let topo = t.clone();
    let numaweave = std::thread::spawn(move || {
        os::cpu::pin_current_thread(first_cpu(&topo, 0)).unwrap();
        let l = Layout::from_size_align(4096, 4096).unwrap();
        let mut held = Vec::with_capacity(pages);
        {
            let _g = numaweave::with_policy(policy).unwrap();
            for _ in 0..pages {
                // SAFETY: a valid layout; freed below.
                held.push(unsafe { A.alloc(l) });
            }
        }
        let mut per = [0usize; 4];
        for &p in &held {
            per[touch_and_locate(p, 4096)[0].expect("page not present")] += 1;
            // SAFETY: allocated above with `l`.
            unsafe { A.dealloc(p, l) };
        }
        per
    })
    .join()
    .unwrap();
    write_weights(&[1, 1, 1, 1]);
    println!("\n  weights 8,4,2,1: pages per node, the kernel's {kernel:?}, numaweave's {numaweave:?}");
    assert_eq!(kernel, [64, 32, 16, 8]);
    assert_eq!(numaweave, kernel);
    Outcome::Pass
}
