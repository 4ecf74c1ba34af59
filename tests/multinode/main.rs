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

mod blocks;
mod cpuset;
mod hmat;
mod kernel;
mod migrate;
#[cfg(feature = "io-uring")]
mod movable;
mod policy;
mod slab;
use blocks::*;
use cpuset::*;
use hmat::*;
use kernel::*;
use migrate::*;
#[cfg(feature = "io-uring")]
use movable::*;
use policy::*;
use slab::*;

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
        ("numaalloc_blocks_follow_the_thread_across_nodes", numaalloc_blocks_follow_the_thread_across_nodes),
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
        ("slab_cache_migrates_between_nodes_while_in_use", slab_cache_migrates_between_nodes_while_in_use),
        ("slab_registered_pool_moves_through_its_registrar", slab_registered_pool_moves_through_its_registrar),
        #[cfg(feature = "failpoints")]
        (
            "slab_full_target_is_reported_and_a_demotion_tries_again",
            slab_full_target_is_reported_and_a_demotion_tries_again,
        ),
        #[cfg(feature = "failpoints")]
        ("slab_pinned_pages_are_retried_without_the_nodes_lock", slab_pinned_pages_are_retried_without_the_nodes_lock),
        (
            "slab_pool_demotes_to_the_memory_only_node_as_node_0_fills",
            slab_pool_demotes_to_the_memory_only_node_as_node_0_fills,
        ),
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
        #[cfg(feature = "io-uring")]
        (
            "uring_pins_moved_off_a_movable_node_are_refused_or_counted",
            uring_pins_moved_off_a_movable_node_are_refused_or_counted,
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
