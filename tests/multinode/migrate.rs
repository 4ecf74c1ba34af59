//! Pools that move while in use: a 256 MiB cache moved from node 0 to node 1
//! while a thread allocates and frees; a registered pool moved through its
//! registrar or refused; a demotion condition that moves a pool to the
//! memory-only node once node 0 fills.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use numaweave::slab::{Demotion, Refusal, Region, Registrar, Stuck, published};

use super::*;

const OBJ: usize = 4096;

/// Kernel nodes of the first page of each object (a query: nothing moves).
fn nodes_of_objects(objs: &[usize]) -> Vec<i32> {
    let addrs: Vec<*const u8> = objs.iter().map(|&a| a as *const u8).collect();
    let mut st = vec![0i32; addrs.len()];
    os::mem::page_nodes(&addrs, &mut st).unwrap();
    st
}

fn fill(pool: &RawCache, n: usize) -> Vec<usize> {
    (0..n)
        .map(|i| {
            let p = pool.alloc().unwrap();
            // SAFETY: a fresh object of OBJ bytes; its first and last words
            // name it.
            unsafe {
                p.as_ptr().cast::<u64>().write(i as u64 ^ 0x5eed);
                p.as_ptr().add(OBJ - 8).cast::<u64>().write(!(i as u64));
            }
            p.as_ptr() as usize
        })
        .collect()
}

fn unchanged(objs: &[usize]) -> bool {
    objs.iter().enumerate().all(|(i, &a)| {
        // SAFETY: live objects written by `fill`.
        unsafe { (a as *const u64).read() == i as u64 ^ 0x5eed && ((a + OBJ - 8) as *const u64).read() == !(i as u64) }
    })
}

pub(super) fn slab_cache_migrates_between_nodes_while_in_use(t: &Topology, g: Option<&Guest>) -> Outcome {
    let Some(g) = g else { return Outcome::Skip("needs the guest's nodes") };
    if t.cpu_nodes().len() < 2 || g.mem_per_node < 512 << 20 {
        return Outcome::Skip("needs two CPU nodes of 512 MiB");
    }
    let (p0, p1) = (t.physical_node(0) as i32, t.physical_node(1) as i32);
    let pool = Arc::new(RawCache::builder("vm_migrating", OBJ).node(0).build().unwrap());
    // 256 MiB of objects, every page on node 0.
    let objs = fill(&pool, (256 << 20) / OBJ);
    assert!(nodes_of_objects(&objs).iter().all(|&n| n == p0), "the pool did not start on node 0");
    // A thread allocates and frees (and checks what it wrote) throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let (pool, stop) = (pool.clone(), stop.clone());
        let cpu = first_cpu(t, 0);
        std::thread::spawn(move || {
            os::cpu::pin_current_thread(cpu).unwrap();
            let mut rounds = 0u64;
            while !stop.load(Relaxed) {
                let mine: Vec<_> = (0..300).map(|_| pool.alloc().unwrap()).collect();
                for (k, p) in mine.iter().enumerate() {
                    // SAFETY: a fresh object of OBJ bytes.
                    unsafe { p.as_ptr().cast::<u64>().write(rounds << 16 | k as u64) };
                }
                for (k, p) in mine.into_iter().enumerate() {
                    // SAFETY: written above, still ours; then freed once.
                    unsafe {
                        assert_eq!(p.as_ptr().cast::<u64>().read(), rounds << 16 | k as u64);
                        pool.free(p);
                    }
                }
                rounds += 1;
            }
            rounds
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    let m = pool.migrate(1).unwrap();
    stop.store(true, Relaxed);
    let rounds = worker.join().unwrap();
    let secs = m.took.as_secs_f64();
    println!(
        "\n  {m}\n  {:.0} ms per GiB (this guest's emulated CPU: not a native figure); the worker ran {rounds} rounds",
        secs * 1e3 / (m.bytes_moved as f64 / (1u64 << 30) as f64)
    );
    assert!(m.unmoved.is_empty(), "{m}");
    assert!(m.bytes_moved >= 256 << 20, "{m}");
    assert!(rounds > 0);
    let where_ = nodes_of_objects(&objs);
    let off: Vec<_> = where_.iter().filter(|&&n| n != p1).collect();
    assert!(off.is_empty(), "{} of {} objects not on node 1: {:?}", off.len(), objs.len(), &off[..off.len().min(8)]);
    assert!(unchanged(&objs), "an object changed in the move");
    // New slabs come from node 1, and the statistics say where it all is.
    let more = fill(&pool, 1000);
    assert!(nodes_of_objects(&more).iter().all(|&n| n == p1), "new objects not on node 1");
    let st = pool.stats();
    assert_eq!((st.placed, st.migrations), (Some(1), 1));
    let resident = pool.resident();
    assert!(resident.iter().all(|r| r.node == 1) && st.migrated_bytes >= 256 << 20, "{st} {resident:?}");
    assert!(!st.unsettled, "{st}");
    println!("  every one of {} objects on node 1, contents unchanged; {st}", objs.len());
    // What `numaweave numastat PID` reads: the published table of chunks,
    // and where the kernel has their pages (this process asking about its
    // own pid, as the command asks about another's).
    let link = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .find(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().contains(published::FILE_NAME)));
    let table = published::read_file(&link.expect("no published table").path()).unwrap();
    let mut by_node = [0usize; 8];
    for c in table.chunks.iter().filter(|c| c.name() == "vm_migrating") {
        assert_eq!(c.node(), Some(p1 as usize), "the table still says the chunk's old node: {c:?}");
        let addrs: Vec<*const u8> = (c.start..c.start + c.len).step_by(c.page_size()).map(|a| a as *const u8).collect();
        let mut st = vec![0i32; addrs.len()];
        os::pages::page_nodes_of(std::process::id() as i32, &addrs, &mut st).unwrap();
        st.iter().filter_map(|&n| usize::try_from(n).ok()).for_each(|n| by_node[n] += 1);
    }
    assert!(by_node[p1 as usize] >= objs.len() && by_node.iter().sum::<usize>() == by_node[p1 as usize], "{by_node:?}");
    println!("  as numastat reads it: pages by node {by_node:?}");
    for a in objs.into_iter().chain(more) {
        // SAFETY: objects of this pool, each freed once.
        unsafe { pool.free(core::ptr::NonNull::new(a as *mut u8).unwrap()) };
    }
    Outcome::Pass
}

/// Counts what it is asked; refuses to release when told to.
struct Reg {
    refuse: bool,
    released: std::sync::atomic::AtomicUsize,
}

impl Registrar for Reg {
    fn register(&self, _: &Region) -> Result<(), Refusal> {
        Ok(())
    }
    fn unregister(&self, _: &Region) {}
    fn can_move(&self) -> bool {
        true
    }
    fn release_for_move(&self, _: &Region) -> Result<(), Refusal> {
        self.released.fetch_add(1, Relaxed);
        if self.refuse { Err(Refusal::Errno(libc::EBUSY)) } else { Ok(()) }
    }
}

pub(super) fn slab_registered_pool_moves_through_its_registrar(t: &Topology, g: Option<&Guest>) -> Outcome {
    if g.is_none() || t.cpu_nodes().len() < 2 {
        return Outcome::Skip("needs the guest's nodes");
    }
    let p1 = t.physical_node(1) as i32;
    for refuse in [false, true] {
        let reg = Arc::new(Reg { refuse, released: 0.into() });
        let pool = RawCache::builder("vm_registered", OBJ).node(0).registrar(reg.clone()).build().unwrap();
        let objs = fill(&pool, 2000);
        let m = pool.migrate(1).unwrap();
        let regions = pool.stats().total().registered_regions;
        assert_eq!(reg.released.load(Relaxed), regions);
        let on1 = nodes_of_objects(&objs).iter().filter(|&&n| n == p1).count();
        if refuse {
            // Nothing moved, and the report says so, page by page, with why.
            assert_eq!((m.regions_moved, m.pages_moved, on1), (0, 0, 0), "{m}");
            assert_eq!(m.unmoved.len(), 1, "{m}");
            assert_eq!(m.unmoved[0].why, Stuck::Registrar(Refusal::Errno(libc::EBUSY)));
            assert!(m.unmoved[0].pages >= objs.len(), "{m}");
        } else {
            assert_eq!((m.regions_moved, on1, m.pages_unmoved()), (regions, objs.len(), 0), "{m}");
        }
        assert!(unchanged(&objs));
        println!("\n  registrar {}: {m}", if refuse { "refusing" } else { "releasing" });
        for a in objs {
            // SAFETY: objects of this pool, each freed once.
            unsafe { pool.free(core::ptr::NonNull::new(a as *mut u8).unwrap()) };
        }
    }
    Outcome::Pass
}

/// A target node without room fails whole `move_pages` calls (`ENOMEM`):
/// the migration reports those pages as `NodeFull` and goes on, the pool
/// says it is unsettled, and a demotion to the node moves them once it has
/// room (before, the migration failed after it had rebound the pool, and a
/// demotion never tried again: the pool stayed split). The refusal is the
/// failpoints' (`--features failpoints`): a node really filled to the last
/// page makes the guest's kernel kill instead.
#[cfg(feature = "failpoints")]
pub(super) fn slab_full_target_is_reported_and_a_demotion_tries_again(t: &Topology, g: Option<&Guest>) -> Outcome {
    use numaweave::os::failpoint::{self, Call};
    if g.is_none() || t.cpu_nodes().len() < 2 {
        return Outcome::Skip("needs the guest's nodes");
    }
    let p1 = t.physical_node(1) as i32;
    let pool = RawCache::builder("vm_full_target", OBJ).node(0).magazine(8).build().unwrap();
    let objs = fill(&pool, 4000);
    failpoint::arm_with(Call::MovePages, 1, u64::MAX, libc::ENOMEM);
    let m = failpoint::scope(|| pool.migrate(1));
    failpoint::disarm();
    let m = m.expect("a full target fails no migration: it is reported");
    assert!(m.unmoved.iter().any(|u| u.why == Stuck::NodeFull && u.pages >= objs.len()), "{m}");
    assert!(!m.complete() && pool.stats().unsettled, "{m}");
    // Node 1 has room again: a demotion to it finds the pool unsettled and
    // moves the rest, step by step, on the pool's slow paths.
    pool.demote_when(Some(Demotion::when_free_below(0, u64::MAX).to(1).every(Duration::ZERO))).unwrap();
    let t0 = Instant::now();
    while pool.stats().unsettled && t0.elapsed() < Duration::from_secs(60) {
        let mine: Vec<_> = (0..32).map(|_| pool.alloc().unwrap()).collect();
        // SAFETY: objects of this pool, each freed once.
        unsafe { pool.free_bulk(&mine) };
    }
    let st = pool.stats();
    let off = nodes_of_objects(&objs).iter().filter(|&&n| n != p1).count();
    assert!(!st.unsettled && off == 0, "{off} objects not on node 1 after the demotion: {st}");
    assert!(unchanged(&objs));
    println!("\n  full target: {m}; then {st}");
    for a in objs {
        // SAFETY: objects of this pool, each freed once.
        unsafe { pool.free(core::ptr::NonNull::new(a as *mut u8).unwrap()) };
    }
    Outcome::Pass
}

/// A registered region released for a move whose pages stay pinned (here:
/// every move refused busy, the failpoints' `EBUSY`) is retried for its
/// 2 s without the node's slab lock: another thread's refills of the node
/// finish while the migration waits (before, they waited for all of it).
#[cfg(feature = "failpoints")]
pub(super) fn slab_pinned_pages_are_retried_without_the_nodes_lock(t: &Topology, g: Option<&Guest>) -> Outcome {
    use numaweave::os::failpoint::{self, Call};
    if g.is_none() || t.cpu_nodes().len() < 2 {
        return Outcome::Skip("needs the guest's nodes");
    }
    struct Movable(AtomicBool);
    impl Registrar for Movable {
        fn register(&self, _: &Region) -> Result<(), Refusal> {
            Ok(())
        }
        fn unregister(&self, _: &Region) {}
        fn can_move(&self) -> bool {
            true
        }
        fn release_for_move(&self, _: &Region) -> Result<(), Refusal> {
            self.0.store(true, Relaxed);
            Ok(())
        }
        fn register_moved(&self, _: &Region) -> Result<(), Refusal> {
            Ok(())
        }
    }
    let reg = Arc::new(Movable(AtomicBool::new(false)));
    let pool =
        Arc::new(RawCache::builder("vm_pinned", OBJ).node(0).magazine(4).registrar(reg.clone()).build().unwrap());
    let objs = fill(&pool, 256);
    let (done, migrating) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(true)));
    let other = {
        let (pool, reg, done, migrating) = (pool.clone(), reg.clone(), done.clone(), migrating.clone());
        std::thread::spawn(move || {
            while !reg.0.load(Relaxed) {
                std::hint::spin_loop();
            }
            // New slabs: the node's slab lock.
            let mine: Vec<_> = (0..512).map(|_| pool.alloc().unwrap()).collect();
            done.store(migrating.load(Relaxed), Relaxed);
            // SAFETY: objects of this pool, each freed once.
            unsafe { pool.free_bulk(&mine) };
        })
    };
    failpoint::arm_with(Call::MovePages, 1, u64::MAX, libc::EBUSY);
    let m = failpoint::scope(|| pool.migrate(1)).unwrap();
    migrating.store(false, Relaxed);
    failpoint::disarm();
    other.join().unwrap();
    assert!(m.took >= Duration::from_secs(1) && m.unmoved.iter().any(|u| u.why == Stuck::Busy), "{m}");
    assert!(done.load(Relaxed), "a refill waited for the migration's retries: {m}");
    assert!(unchanged(&objs));
    println!("\n  pinned: {m}; a refill meanwhile went through");
    for a in objs {
        // SAFETY: objects of this pool, each freed once.
        unsafe { pool.free(core::ptr::NonNull::new(a as *mut u8).unwrap()) };
    }
    Outcome::Pass
}

pub(super) fn slab_pool_demotes_to_the_memory_only_node_as_node_0_fills(t: &Topology, g: Option<&Guest>) -> Outcome {
    let Some(g) = g else { return Outcome::Skip("needs the guest's nodes") };
    if g.memory_only == 0 {
        return Outcome::Skip("needs a memory-only node");
    }
    let lower = t.nearest_lower_tier(0).expect("the memory-only node is a lower tier");
    let pl = t.physical_node(lower) as i32;
    let pool = Arc::new(RawCache::builder("vm_cold_pool", OBJ).node(0).magazine(8).build().unwrap());
    let objs = fill(&pool, (32 << 20) / OBJ);
    let threshold: u64 = 96 << 20;
    pool.demote_when(Some(Demotion::when_free_below(0, threshold).every(Duration::from_millis(20)))).unwrap();
    // The pool's own churn: refills look at the condition.
    let stop = Arc::new(AtomicBool::new(false));
    let worker = {
        let (pool, stop) = (pool.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Relaxed) {
                let mine: Vec<_> = (0..64).map(|_| pool.alloc().unwrap()).collect();
                // SAFETY: objects of this pool, each freed once.
                unsafe { pool.free_bulk(&mine) };
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(pool.stats().demotions, 0, "demoted before node 0 filled");
    // Another allocation fills node 0 until less than half the threshold is
    // free.
    let free = t.free_memory(0).unwrap();
    let fill_len = (free - threshold / 2) as usize & !((2 << 20) - 1);
    let filler = Mapping::map(fill_len).unwrap();
    filler.bind(MemPolicy::Bind(NodeSet::single(t.physical_node(0)))).unwrap();
    touch(&filler);
    println!(
        "\n  node 0: {} MiB free, filled with {} MiB; now {} MiB free",
        free >> 20,
        fill_len >> 20,
        t.free_memory(0).unwrap() >> 20
    );
    // Started, then moved step by step on the worker's slow paths.
    let t0 = Instant::now();
    while (pool.stats().demotions == 0 || pool.stats().unsettled) && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Relaxed);
    worker.join().unwrap();
    let st = pool.stats();
    assert_eq!((st.demotions, st.placed), (1, Some(lower)), "{st}");
    let off = nodes_of_objects(&objs).iter().filter(|&&n| n != pl).count();
    assert_eq!(off, 0, "{off} objects not on the memory-only node {lower}");
    assert!(unchanged(&objs));
    assert!(st.migrated_bytes >= 32 << 20, "{st}");
    println!("  demoted after {:?}: {st}", t0.elapsed());
    drop(filler);
    for a in objs {
        // SAFETY: objects of this pool, each freed once.
        unsafe { pool.free(core::ptr::NonNull::new(a as *mut u8).unwrap()) };
    }
    Outcome::Pass
}
