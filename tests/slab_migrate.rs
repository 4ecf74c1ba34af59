//! Pools that move while in use: `migrate` keeps every object's address and
//! contents while other threads allocate and free, reports what it did,
//! goes through a registrar or refuses before anything moves, and a
//! demotion condition moves a pool from its own slow path. Pages really
//! changing nodes is checked in the multi-node guest (tests/multinode/);
//! here the machine has one node, so logical nodes come from `fake:2`
//! where a test needs two.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use numaweave::Error;
use numaweave::slab::{Demotion, DmaPool, RawCache, Refusal, Region, Registrar, SlabBox, SlabCache, Stuck};
use numaweave::topology::Topology;

mod support;

const OBJ: usize = 4096;

/// Fills `n` objects of `pool` with a pattern of their index.
fn filled(pool: &RawCache, n: usize) -> Vec<usize> {
    (0..n)
        .map(|i| {
            let p = pool.alloc().unwrap();
            // SAFETY: a fresh object of OBJ bytes.
            unsafe { p.as_ptr().write_bytes(i as u8, OBJ) };
            p.as_ptr() as usize
        })
        .collect()
}

fn check(objs: &[usize]) {
    for (i, &a) in objs.iter().enumerate() {
        // SAFETY: live objects of OBJ bytes, written by `filled`.
        let s = unsafe { core::slice::from_raw_parts(a as *const u8, OBJ) };
        assert!(s.iter().all(|&b| b == i as u8), "object {i} at {a:#x} changed");
    }
}

#[test]
fn a_pool_migrates_while_threads_allocate_and_free_and_nothing_moves_in_memory() {
    let pool = Arc::new(RawCache::builder("migrating", OBJ).build().unwrap());
    let objs = filled(&pool, 4096); // 16 MiB
    let stop = Arc::new(AtomicBool::new(false));
    let churn: Vec<_> = (0..2)
        .map(|t| {
            let (pool, stop) = (pool.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rounds = 0u64;
                while !stop.load(Relaxed) || rounds < 50 {
                    let mine: Vec<_> = (0..200)
                        .map(|k| {
                            let p = pool.alloc().unwrap();
                            // SAFETY: a fresh object of OBJ bytes.
                            unsafe { p.as_ptr().write_bytes((t * 7 + k) as u8, OBJ) };
                            p
                        })
                        .collect();
                    for (k, p) in mine.into_iter().enumerate() {
                        // SAFETY: written just above, still ours.
                        assert_eq!(unsafe { *p.as_ptr().add(OBJ - 1) }, (t * 7 + k) as u8);
                        // SAFETY: an object of this pool, given back once.
                        unsafe { pool.free(p) };
                    }
                    rounds += 1;
                }
            })
        })
        .collect();
    let node = Topology::global().default_node();
    for _ in 0..5 {
        let m = pool.migrate(node).unwrap();
        assert_eq!(m.to, node);
        assert!(m.unmoved.is_empty(), "{m}");
        // Every page the objects were written to is present, and on the
        // node (the only one here): counted as there already, or moved.
        assert!(m.pages_already + m.pages_moved >= objs.len() * OBJ / 4096, "{m}");
        check(&objs);
    }
    stop.store(true, Relaxed);
    churn.into_iter().for_each(|t| t.join().unwrap());
    check(&objs);
    let st = pool.stats();
    assert_eq!((st.migrations, st.demotions, st.placed, st.unsettled), (5, 0, Some(node), false));
    let resident = pool.resident();
    let on: u64 = resident.iter().map(|r| r.bytes).sum();
    assert!(on >= (objs.len() * OBJ) as u64, "{resident:?}");
    assert!(resident.iter().all(|r| r.node == node), "{resident:?}");
    assert!(st.to_string().contains("5 migrations (0 demotions) moved"), "{st}");
    for a in objs {
        // SAFETY: objects of this pool, each given back once.
        unsafe { pool.free(core::ptr::NonNull::new(a as *mut u8).unwrap()) };
    }
    // A node that is not online is refused before anything happens.
    assert!(matches!(pool.migrate(usize::MAX / 2), Err(Error::InvalidNode { .. })));
    assert_eq!(pool.stats().migrations, 5);
}

/// Keeps regions as an io_uring table would, slot by slot, and says what it
/// was asked.
struct Table {
    movable: bool,
    refuse_release: bool,
    slots: Mutex<Vec<Option<(usize, usize)>>>,
    registers: AtomicUsize,
    releases: AtomicUsize,
    reregisters: AtomicUsize,
}

impl Table {
    fn new(movable: bool, refuse_release: bool) -> Arc<Self> {
        Arc::new(Table {
            movable,
            refuse_release,
            slots: Mutex::new(Vec::new()),
            registers: AtomicUsize::new(0),
            releases: AtomicUsize::new(0),
            reregisters: AtomicUsize::new(0),
        })
    }
    fn key(r: &Region) -> (usize, usize) {
        (r.addr.as_ptr() as usize, r.len)
    }
}

impl Registrar for Table {
    fn register(&self, r: &Region) -> Result<(), Refusal> {
        self.registers.fetch_add(1, Relaxed);
        self.slots.lock().unwrap().push(Some(Self::key(r)));
        Ok(())
    }
    fn unregister(&self, r: &Region) {
        let mut s = self.slots.lock().unwrap();
        let i = s.iter().position(|&x| x == Some(Self::key(r))).expect("unregistered a region never registered");
        s[i] = None;
    }
    fn can_move(&self) -> bool {
        self.movable
    }
    fn release_for_move(&self, r: &Region) -> Result<(), Refusal> {
        assert!(self.slots.lock().unwrap().contains(&Some(Self::key(r))), "released a region not registered");
        self.releases.fetch_add(1, Relaxed);
        if self.refuse_release { Err(Refusal::Errno(libc::EBUSY)) } else { Ok(()) }
    }
    fn register_moved(&self, r: &Region) -> Result<(), Refusal> {
        // The same slot: the region is still in the table, where it was.
        assert!(self.slots.lock().unwrap().contains(&Some(Self::key(r))), "moved region lost its slot");
        self.reregisters.fetch_add(1, Relaxed);
        Ok(())
    }
}

#[test]
fn a_registered_pool_moves_through_its_registrar_or_not_at_all() {
    let node = Topology::global().default_node();
    // A registrar that cannot release: a typed error naming a region, and
    // nothing moved.
    let fixed = Table::new(false, false);
    let pool = RawCache::builder("pinned", OBJ).registrar(fixed.clone()).build().unwrap();
    let pinned = filled(&pool, 300);
    match pool.migrate(node) {
        Err(Error::RegisteredRegion { addr, len, node: n }) => {
            assert!(fixed.slots.lock().unwrap().contains(&Some((addr, len))), "the error names no registered region");
            assert_eq!(n, node);
        }
        other => panic!("a pinned pool migrated: {other:?}"),
    }
    let st = pool.stats();
    assert_eq!((st.migrations, st.placed, fixed.releases.load(Relaxed)), (0, None, 0));
    check(&pinned);

    // One that can: each region released and registered again in its slot,
    // none registered anew.
    let table = Table::new(true, false);
    let movable = RawCache::builder("movable", OBJ).registrar(table.clone()).build().unwrap();
    let objs = filled(&movable, 300);
    let regions = table.registers.load(Relaxed);
    assert!(regions >= 2);
    let m = movable.migrate(node).unwrap();
    assert_eq!(m.regions_moved, regions, "{m}");
    assert_eq!((table.releases.load(Relaxed), table.reregisters.load(Relaxed)), (regions, regions));
    assert_eq!(table.registers.load(Relaxed), regions, "a moved region was registered as a new one");
    assert_eq!(movable.stats().total().registered_regions, regions);
    check(&objs);

    // One that refuses to release: the region stays registered where it
    // was; the migration goes on with the rest.
    let refusing = Table::new(true, true);
    let stuck = RawCache::builder("refusing", OBJ).registrar(refusing.clone()).build().unwrap();
    let objs2 = filled(&stuck, 100);
    let pages: usize = stuck.resident().iter().map(|r| r.pages).sum();
    let m = stuck.migrate(node).unwrap();
    assert_eq!((m.regions_moved, refusing.reregisters.load(Relaxed)), (0, 0));
    assert!(refusing.releases.load(Relaxed) >= 1);
    // Nothing moved; every page is accounted for, either on the target
    // already (every one where the pool has a single node) or stuck by the
    // registrar's refusal, and by nothing else.
    let stuck_pages: usize = m.unmoved.iter().map(|u| u.pages).sum();
    assert_eq!(m.pages_moved, 0, "{m}");
    assert!(pages > 0 && m.pages_already + stuck_pages == pages, "{pages} pages: {m}");
    assert!(m.unmoved.iter().all(|u| u.why == Stuck::Registrar(Refusal::Errno(libc::EBUSY))), "{m}");
    assert_eq!(stuck.stats().total().registered_regions, refusing.registers.load(Relaxed));
    check(&objs2);
    for (p, objs) in [(&pool, pinned), (&movable, objs), (&stuck, objs2)] {
        for a in objs {
            // SAFETY: objects of this pool, each given back once.
            unsafe { p.free(core::ptr::NonNull::new(a as *mut u8).unwrap()) };
        }
    }
}

/// `n` rounds of 16 objects of `pool` allocated, then freed: through a
/// magazine of 4, each round reaches the slow paths several times, where
/// the demotion condition is looked at (and a step taken).
fn slow_paths(pool: &SlabCache<[u8; 512]>, n: usize) {
    for r in 0..n {
        let xs: Vec<_> = (0..16).map(|i| pool.alloc([(r + i) as u8; 512]).unwrap()).collect();
        for (i, x) in xs.iter().enumerate() {
            assert_eq!((x[0], x[511]), ((r + i) as u8, (r + i) as u8));
        }
    }
}

#[test]
fn a_demotion_moves_the_pool_step_by_step_from_its_slow_paths_without_a_thread() {
    let topo = Topology::global();
    let node = topo.default_node();
    let pool = SlabCache::<[u8; 512]>::builder("demoted").magazine(4).build().unwrap();
    // Threads of this test: named as it is (a thread started from it
    // inherits its name; the other tests of this binary, running
    // meanwhile, start and end threads named after themselves).
    let mine = std::fs::read_to_string("/proc/thread-self/comm").unwrap();
    let threads = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .flatten()
            .filter(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c == mine))
            .count()
    };
    // Never true (no node has less than 0 bytes free): nothing happens,
    // however many slow paths.
    pool.demote_when(Some(Demotion::when_free_below(node, 0).to(node).every(Duration::ZERO))).unwrap();
    let held: Vec<_> = (0..100).map(|i| pool.alloc([i as u8; 512]).unwrap()).collect();
    slow_paths(&pool, 20);
    assert_eq!((pool.stats().migrations, pool.stats().demotions), (0, 0));
    // Always true: the first slow path after this starts a demotion (the
    // pool bound to the node), the next ones each move a step of it, until
    // the pass is over: one demotion, one migration, the pool settled.
    let before = threads();
    pool.demote_when(Some(Demotion::when_free_below(node, u64::MAX).to(node).every(Duration::ZERO))).unwrap();
    slow_paths(&pool, 40);
    let st = pool.stats();
    assert_eq!((st.demotions, st.migrations, st.placed, st.unsettled), (1, 1, Some(node), false), "{st}");
    assert_eq!(threads(), before, "a demotion started a thread");
    // The pool is where it should be; the condition still holds, but
    // nothing is left to move: no second demotion.
    slow_paths(&pool, 40);
    assert_eq!((pool.stats().demotions, pool.stats().migrations), (1, 1));
    assert_eq!(held.len(), 100);
    for (i, x) in held.iter().enumerate() {
        assert_eq!((x[0], x[511]), (i as u8, i as u8), "object {i} changed");
    }
    pool.demote_when(None).unwrap();
    drop(held);
    // A pool that only frees looks at its condition too: its frees start
    // the demotion and take its steps.
    let cold = SlabCache::<[u8; 512]>::builder("only_freed").magazine(4).build().unwrap();
    let objs: Vec<_> = (0..400).map(|i| cold.alloc([i as u8; 512]).unwrap()).collect();
    cold.demote_when(Some(Demotion::when_free_below(node, u64::MAX).to(node).every(Duration::ZERO))).unwrap();
    assert_eq!(cold.stats().demotions, 0);
    drop(objs);
    let st = cold.stats();
    assert_eq!((st.demotions, st.migrations, st.unsettled), (1, 1, false), "frees alone did not demote: {st}");
    // Without a lower tier the target must be named.
    if topo.lower_tier_nodes().is_empty() {
        assert!(matches!(pool.demote_when(Some(Demotion::when_free_below(node, 1))), Err(Error::InvalidNode { .. })));
    }
}

/// A device may hold the physical address of a DMA pool's buffer once it
/// was handed out: a demotion leaves such a pool alone unless it says it
/// may move it. (On 7a2f436 the pool moved.)
#[test]
fn a_dma_pool_whose_addresses_were_handed_out_is_not_demoted_unless_told() {
    let node = Topology::global().default_node();
    let always = || Demotion::when_free_below(node, u64::MAX).to(node).every(Duration::ZERO);
    let pool = DmaPool::builder("device_rx", 4096).magazine(4).build().unwrap();
    let buf = pool.alloc().unwrap();
    // (Root reads the address; others get EPERM: handed out or not, a
    // device may have been given it.)
    let _ = buf.phys_addr();
    pool.demote_when(Some(always())).unwrap();
    for _ in 0..3 {
        let bufs: Vec<_> = (0..64).map(|_| pool.alloc().unwrap()).collect();
        drop(bufs);
    }
    assert_eq!((pool.stats().demotions, pool.stats().migrations), (0, 0), "a device's buffers were moved");
    pool.demote_when(Some(always().moving_device_buffers(true))).unwrap();
    for _ in 0..3 {
        let bufs: Vec<_> = (0..64).map(|_| pool.alloc().unwrap()).collect();
        drop(bufs);
    }
    assert_eq!((pool.stats().demotions, pool.stats().migrations), (1, 1));
    drop(buf);
}

#[test]
fn a_dma_pool_migrates_and_its_buffers_say_their_new_node() {
    if !support::in_child() {
        support::rerun(
            "a_dma_pool_migrates_and_its_buffers_say_their_new_node",
            &[("NUMAWEAVE_TOPOLOGY", Some("fake:2"))],
            "moved to node 1",
        );
        return;
    }
    let pool = DmaPool::builder("nic_rx", 2048).node(0).build().unwrap();
    let bufs: Vec<_> = (0..64).map(|_| pool.alloc().unwrap()).collect();
    assert!(bufs.iter().all(|b| b.node() == 0));
    let m = pool.migrate(1).unwrap();
    assert_eq!(m.to, 1);
    // Logical node 1 lies over the same real node: nothing to copy, and
    // every buffer, old or new, now says node 1.
    assert!(bufs.iter().all(|b| b.node() == 1));
    assert_eq!(pool.alloc().unwrap().node(), 1);
    let cache = SlabCache::<u64>::builder("typed").node(0).build().unwrap();
    let x = cache.alloc(7).unwrap();
    cache.migrate(1).unwrap();
    assert_eq!((SlabBox::node(&x), *x), (1, 7));
    assert_eq!(pool.stats().placed, Some(1));
    println!("moved to node 1");
}
