//! Node slabs as a user relies on them: typed objects dropped exactly once,
//! limits, waiting, bulk, raw caches with constructors and zeroing, wrong
//! frees caught, caches dropped with objects out, and many threads allocating
//! here and freeing there with every object's contents checked.

use std::collections::HashSet;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use numaweave::Error;
use numaweave::slab::{DmaPool, RawCache, SlabBox, SlabCache, slabinfo};

/// Counts drops of values it is told about.
struct Tracked {
    id: u64,
    payload: [u64; 30],
    drops: Arc<AtomicUsize>,
}

impl Tracked {
    fn new(id: u64, drops: &Arc<AtomicUsize>) -> Self {
        Self { id, payload: [id.wrapping_mul(0x9e37_79b9_7f4a_7c15); 30], drops: drops.clone() }
    }
    fn check(&self) {
        assert!(
            self.payload.iter().all(|&w| w == self.id.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            "object {} corrupted",
            self.id
        );
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::Relaxed);
    }
}

#[test]
fn typed_objects_are_dropped_once_and_nothing_leaks() {
    let drops = Arc::new(AtomicUsize::new(0));
    let cache = SlabCache::<Tracked>::new("tracked").unwrap();
    let mut live: Vec<SlabBox<Tracked>> = (0..5000).map(|i| cache.alloc(Tracked::new(i, &drops)).unwrap()).collect();
    let addrs: HashSet<usize> = live.iter().map(|b| SlabBox::as_ptr(b) as usize).collect();
    assert_eq!(addrs.len(), 5000, "two live objects share an address");
    for b in &live {
        b.check();
        assert_eq!(SlabBox::as_ptr(b) as usize % align_of::<Tracked>(), 0);
    }
    assert_eq!(drops.load(Ordering::Relaxed), 0);
    live.truncate(2000);
    assert_eq!(drops.load(Ordering::Relaxed), 3000);
    // Reuse: new values land in freed objects and are dropped once each too.
    live.extend((5000..8000).map(|i| cache.alloc(Tracked::new(i, &drops)).unwrap()));
    live.iter().for_each(|b| b.check());
    drop(live);
    assert_eq!(drops.load(Ordering::Relaxed), 8000);
    let st = cache.stats().total();
    assert!(st.slabs > 0);
    let released = cache.shrink();
    let st = cache.stats().total();
    assert_eq!(st.active, 0, "objects still out after every box was dropped: {st:?}");
    assert_eq!(st.slabs, 0, "shrink kept empty slabs");
    assert!(released > 0);
}

#[test]
fn limit_try_alloc_and_fallback_errors() {
    let cache = SlabCache::<[u8; 256]>::builder("limited").limit(64).build().unwrap();
    let mut held: Vec<_> = (0..64).map(|i| cache.try_alloc([i as u8; 256]).unwrap()).collect();
    match cache.try_alloc([0; 256]) {
        Err(Error::LimitReached { limit: 64, .. }) => {}
        other => panic!("expected LimitReached, got {other:?}"),
    }
    let st = cache.stats().total();
    assert_eq!(st.total, 64);
    assert!(st.limit_hits >= 1);
    // Every node is limited: `alloc` falls back and then reports the limit too
    // (on one node) or succeeds elsewhere (several nodes).
    let topo = numaweave::Topology::global();
    match cache.alloc([0; 256]) {
        Err(Error::LimitReached { .. }) => assert_eq!(topo.memory_nodes().len(), 1),
        Ok(b) => {
            assert!(topo.memory_nodes().len() > 1);
            drop(b);
        }
        Err(e) => panic!("unexpected {e}"),
    }
    held.pop();
    let b = cache.try_alloc([9; 256]).expect("a freed object is available again");
    assert!(b.iter().all(|&x| x == 9));
    drop(held);
    drop(b);
    cache.shrink();
    assert_eq!(cache.stats().total().total, 0);
}

#[test]
fn alloc_wait_is_woken_by_a_free_on_another_thread_and_times_out_otherwise() {
    let cache = Arc::new(SlabCache::<u64>::builder("waited").limit(16).build().unwrap());
    let held: Vec<_> = (0..16).map(|i| cache.try_alloc(i).unwrap()).collect();

    // Nobody frees: a timeout, after at least the time asked.
    let t = Instant::now();
    match cache.alloc_wait(0, Duration::from_millis(50)) {
        Err(Error::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(t.elapsed() >= Duration::from_millis(50));

    // Another thread frees one while we wait.
    let (tx, rx) = mpsc::channel::<Vec<SlabBox<u64>>>();
    let freer = thread::spawn(move || {
        let mut held = rx.recv().unwrap();
        thread::sleep(Duration::from_millis(100));
        held.pop();
        held
    });
    tx.send(held).unwrap();
    let t = Instant::now();
    let b = cache.alloc_wait(77, Duration::from_secs(20)).expect("woken by the free");
    assert_eq!(*b, 77);
    assert!(t.elapsed() < Duration::from_secs(20));
    let held = freer.join().unwrap();
    let st = cache.stats().total();
    assert!(st.waits >= 2, "{st:?}");
    drop(held);
    drop(b);
}

#[test]
fn bulk_alloc_and_free() {
    let cache = SlabCache::<[u32; 64]>::new("bulk").unwrap();
    let boxes = cache.alloc_bulk(1000, |i| [i as u32; 64]).unwrap();
    let addrs: HashSet<usize> = boxes.iter().map(|b| SlabBox::as_ptr(b) as usize).collect();
    assert_eq!(addrs.len(), 1000);
    for (i, b) in boxes.iter().enumerate() {
        assert!(b.iter().all(|&x| x == i as u32));
    }
    // Active counts what left the slabs: the 1000, plus what the thread's
    // magazines hold.
    let st = cache.stats();
    assert!((1000..=1000 + 2 * st.magazine_rounds).contains(&st.total().active), "{st:?}");
    cache.free_bulk(boxes);
    cache.shrink();
    assert_eq!(cache.stats().total().active, 0);

    // All or nothing: a bulk larger than the limit leaves nothing out.
    let raw = RawCache::builder("bulk_raw", 100).limit(50).build().unwrap();
    let mut out = vec![std::ptr::null_mut(); 80];
    assert!(matches!(raw.alloc_bulk(&mut out), Err(Error::LimitReached { .. })));
    raw.shrink();
    assert_eq!(raw.stats().total().active, 0);
    let mut out = vec![std::ptr::null_mut(); 50];
    raw.alloc_bulk(&mut out).unwrap();
    let objs: Vec<NonNull<u8>> = out.iter().map(|&p| NonNull::new(p).unwrap()).collect();
    // SAFETY: objects of `raw`, each freed once.
    unsafe { raw.free_bulk(&objs) };
}

#[test]
fn raw_constructor_runs_once_per_object_and_state_survives_free() {
    static CONSTRUCTED: AtomicUsize = AtomicUsize::new(0);
    let cache = RawCache::builder("ctor", 48)
        .constructor(|p| {
            CONSTRUCTED.fetch_add(1, Ordering::Relaxed);
            // SAFETY: the constructor gets a fresh object of 48 bytes.
            unsafe { p.as_ptr().cast::<u64>().write(0xc0ffee) };
        })
        .build()
        .unwrap();
    let objs: Vec<_> = (0..300).map(|_| cache.alloc().unwrap()).collect();
    // Objects are constructed as they leave their slab for a magazine: the
    // 300 handed out, plus at most one magazine's worth still cached.
    let after_first = CONSTRUCTED.load(Ordering::Relaxed);
    let rounds = cache.stats().magazine_rounds;
    assert!((300..=300 + rounds).contains(&after_first), "{after_first} constructor calls for 300 objects");
    for &p in &objs {
        // SAFETY: live objects of 48 bytes.
        unsafe {
            assert_eq!(p.as_ptr().cast::<u64>().read(), 0xc0ffee);
            p.as_ptr().cast::<u64>().add(1).write(42);
        }
    }
    for &p in &objs {
        // SAFETY: each freed once.
        unsafe { cache.free(p) };
    }
    let again: Vec<_> = (0..300).map(|_| cache.alloc().unwrap()).collect();
    assert_eq!(CONSTRUCTED.load(Ordering::Relaxed), after_first, "reused objects are not constructed again");
    for &p in &again {
        // SAFETY: live objects; the constructed word survived being free.
        unsafe {
            assert_eq!(p.as_ptr().cast::<u64>().read(), 0xc0ffee);
            assert_eq!(p.as_ptr().cast::<u64>().add(1).read(), 42);
            cache.free(p);
        }
    }
}

#[test]
fn zeroing_alignment_and_layout_errors() {
    let cache = RawCache::builder("dma", 4096).align(4096).zero(true).build().unwrap();
    let mut objs = Vec::new();
    for _ in 0..100 {
        let p = cache.alloc().unwrap();
        assert_eq!(p.as_ptr() as usize % 4096, 0);
        // SAFETY: a 4096-byte object.
        let s = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), 4096) };
        assert!(s.iter().all(|&b| b == 0), "a zeroing cache gave a dirty object");
        s.fill(0xa5);
        objs.push(p);
    }
    for p in objs {
        // SAFETY: each freed once.
        unsafe { cache.free(p) };
    }
    let p = cache.alloc().unwrap();
    // SAFETY: a 4096-byte object, reused from the dirty ones above.
    assert!(unsafe { std::slice::from_raw_parts(p.as_ptr(), 4096) }.iter().all(|&b| b == 0));
    // SAFETY: freed once.
    unsafe { cache.free(p) };

    assert!(matches!(RawCache::builder("huge", 8 << 20).build(), Err(Error::LayoutTooLarge { .. })));
    assert!(matches!(RawCache::builder("odd", 64).align(48).build(), Err(Error::LayoutTooLarge { .. })));
    assert!(matches!(
        RawCache::builder("both", 64).zero(true).constructor(|_| {}).build(),
        Err(Error::InvalidCache { .. })
    ));
    assert!(matches!(SlabCache::<u8>::builder("far").node(63).build(), Err(Error::InvalidNode { .. })));
    assert!(matches!(
        SlabCache::<u8>::builder("nodev").device("no-such-dev0").build(),
        Err(Error::NoSuchDevice { .. })
    ));
    assert!(matches!(SlabCache::<u8>::builder("").build(), Err(Error::InvalidCache { .. })));
}

// Hardened builds report and abort instead (tests/hardened.rs).
#[cfg(not(feature = "hardened"))]
#[test]
#[should_panic(expected = "of slab cache \"owner\" freed into slab cache \"other\"")]
fn freeing_into_the_wrong_cache_panics() {
    let owner = RawCache::builder("owner", 64).build().unwrap();
    let other = RawCache::builder("other", 64).build().unwrap();
    let p = owner.alloc().unwrap();
    // SAFETY: a slab object; the wrong cache is what is being tested.
    unsafe { other.free(p) };
}

// The wrong cache with slabs far larger than the object's: the address
// below the object aligned to them is still in the object's chunk (every
// chunk starts on the largest slab size), so release builds, which find the
// header by masking, read a header and name the owner too. Hardened builds
// report and abort instead (tests/hardened.rs).
#[cfg(not(feature = "hardened"))]
#[test]
#[should_panic(expected = "of slab cache \"small\" freed into slab cache \"large\"")]
fn freeing_into_a_cache_of_larger_slabs_panics() {
    let small = RawCache::builder("small", 64).build().unwrap();
    let large = RawCache::builder("large", 1 << 20).build().unwrap();
    // Past the first slab of the chunk: its address is not one of `large`'s
    // slab sizes.
    let objs: Vec<_> = (0..2000).map(|_| small.alloc().unwrap()).collect();
    // SAFETY: a slab object; the wrong cache is what is being tested.
    unsafe { large.free(objs[1999]) };
}

// Hardened builds report and abort instead (tests/hardened.rs); release
// builds do not check the offset (a division kept off their free path).
#[cfg(all(not(feature = "hardened"), debug_assertions))]
#[test]
#[should_panic(expected = "not at its start")]
fn freeing_an_interior_pointer_panics() {
    let cache = RawCache::builder("interior", 64).build().unwrap();
    let p = cache.alloc().unwrap();
    // SAFETY: inside a slab; the bad offset is what is being tested.
    unsafe { cache.free(NonNull::new(p.as_ptr().add(8)).unwrap()) };
}

#[test]
fn dropping_a_cache_with_objects_out_is_safe() {
    let drops = Arc::new(AtomicUsize::new(0));
    let cache = SlabCache::<Tracked>::new("short_lived").unwrap();
    let boxes: Vec<_> = (0..500).map(|i| cache.alloc(Tracked::new(i, &drops)).unwrap()).collect();
    drop(cache);
    assert!(slabinfo().caches.iter().any(|c| c.name == "short_lived" && c.dropped && c.total().active >= 500));
    // Objects stay valid and can move to another thread and be dropped there.
    let t = thread::spawn(move || {
        boxes.iter().for_each(|b| b.check());
        drop(boxes);
    });
    t.join().unwrap();
    assert_eq!(drops.load(Ordering::Relaxed), 500);
    assert!(
        !slabinfo().caches.iter().any(|c| c.name == "short_lived"),
        "the dropped cache outlived its last object:\n{}",
        slabinfo()
    );
}

#[test]
fn many_threads_allocate_here_and_free_there() {
    const THREADS: usize = 4;
    const ROUNDS: usize = 20_000;
    let drops = Arc::new(AtomicUsize::new(0));
    let cache = Arc::new(SlabCache::<Tracked>::builder("stress").magazine(8).build().unwrap());
    let barrier = Arc::new(Barrier::new(THREADS));
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| mpsc::channel::<Vec<SlabBox<Tracked>>>()).unzip();
    let mut handles = Vec::new();
    for (t, rx) in rxs.into_iter().enumerate() {
        let next = txs[(t + 1) % THREADS].clone();
        let (cache, drops, barrier) = (cache.clone(), drops.clone(), barrier.clone());
        handles.push(thread::spawn(move || {
            barrier.wait();
            let mut batch = Vec::new();
            let mut mine = Vec::new();
            for i in 0..ROUNDS {
                let id = (t * ROUNDS + i) as u64;
                let b = cache.alloc(Tracked::new(id, &drops)).unwrap();
                if i % 2 == 0 {
                    batch.push(b);
                } else {
                    mine.push(b);
                }
                if batch.len() == 64 {
                    next.send(std::mem::take(&mut batch)).unwrap();
                }
                if mine.len() == 100 {
                    mine.iter().for_each(|b| b.check());
                    mine.clear();
                }
                while let Ok(theirs) = rx.try_recv() {
                    theirs.iter().for_each(|b| b.check());
                }
            }
            next.send(batch).unwrap();
            drop(next);
            drop(mine);
            // Drain what the neighbour still sends.
            while let Ok(theirs) = rx.recv_timeout(Duration::from_secs(5)) {
                theirs.iter().for_each(|b| b.check());
                if drops.load(Ordering::Relaxed) == THREADS * ROUNDS {
                    break;
                }
            }
        }));
    }
    drop(txs);
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(drops.load(Ordering::Relaxed), THREADS * ROUNDS);
    // Every thread has exited (its magazines flushed): nothing is out but what
    // sits in the depots, which shrink returns.
    cache.shrink();
    let st = cache.stats().total();
    assert_eq!(st.active, 0, "objects leaked after all threads exited: {st:?}");
    assert_eq!(st.slabs, 0);
}

#[test]
fn slab_box_is_send_and_sync_when_t_is() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<SlabBox<u64>>();
    assert_send_sync::<SlabCache<std::rc::Rc<u8>>>();
    assert_send_sync::<RawCache>();
}

fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps").unwrap().lines().count()
}

/// A large cache of 4 KiB I/O buffers takes a few hundred mappings, not one
/// per slab: the kernel's `vm.max_map_count` (65,530 by default) would cap a
/// cache of one mapping per 128 KiB slab near 8 GiB.
#[test]
fn a_32_gib_cache_of_4_kib_buffers_needs_few_mappings() {
    // Hardened builds write a mark into every object they hand out, so the
    // buffers would be touched: a smaller cache there (the slabs, not their
    // contents, are what counts).
    let total: usize = if cfg!(feature = "hardened") { 512 << 20 } else { 32 << 30 };
    let cache = RawCache::builder("dma_4k", 4096).align(4096).build().unwrap();
    let before = mappings();
    let mut objs = vec![std::ptr::null_mut(); total / 4096];
    for chunk in objs.chunks_mut(4096) {
        cache.alloc_bulk(chunk).unwrap();
    }
    let st = cache.stats().total();
    let grown = mappings().saturating_sub(before);
    assert!(st.slabs * 4096 * cache.stats().objects_per_slab >= total, "{st:?}");
    assert!(st.chunks <= 300, "{} chunks for {} slabs", st.chunks, st.slabs);
    // Other tests of this process map memory meanwhile: a margin for theirs.
    assert!(grown <= st.chunks + 100, "{grown} new mappings for {} chunks", st.chunks);
    // A free writes the object's link word, touching its page: free 128 MiB
    // at a time and shrink, so that the emptied slabs' pages go back before
    // the next batch (the test would otherwise touch all 32 GiB).
    let objs: Vec<NonNull<u8>> = objs.into_iter().map(|p| NonNull::new(p).unwrap()).collect();
    for batch in objs.chunks(32 << 10) {
        // SAFETY: objects of `cache`, each freed once.
        unsafe { cache.free_bulk(batch) };
        cache.shrink();
    }
    let st = cache.stats().total();
    assert_eq!((st.active, st.slabs, st.chunks), (0, 0, 0), "{st:?}");
    assert!(mappings() <= before + 100, "chunks left mapped after shrink");
}

/// DMA buffers lie inside one 2 MiB page whatever their size (up to 1 MiB),
/// keep their contents, can be locked, and report where they are: their
/// node, and with root their physical address (a typed error without).
#[test]
fn dma_buffers_stay_inside_huge_pages_and_report_their_addresses() {
    const HUGE: usize = 2 << 20;
    // (1 MiB buffers too, except in hardened builds with red zones, whose
    // slots would not fit a slab twice.)
    let sizes: &[usize] = if cfg!(feature = "hardened") {
        &[512, 4096, 3000, 96 << 10, 512 << 10]
    } else {
        &[512, 4096, 3000, 96 << 10, 1 << 20]
    };
    for &size in sizes {
        let pool = DmaPool::builder("dma_sizes", size).build().unwrap();
        let mut bufs: Vec<_> = (0..24).map(|_| pool.alloc().unwrap()).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            let s = b.as_ptr() as usize;
            assert_eq!(b.len(), size);
            assert_eq!(s / HUGE, (s + size - 1) / HUGE, "a {size}-byte buffer at {s:#x} crosses 2 MiB");
            b.fill(i as u8);
        }
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.iter().all(|&x| x == i as u8), "buffer {i} of {size} bytes overwritten");
            assert_eq!(b.node(), 0);
        }
    }
    assert!(matches!(DmaPool::builder("dma_big", 3 << 20).build(), Err(Error::LayoutTooLarge { .. })));

    let pool = DmaPool::builder("dma_locked", 4096).lock(true).zero(true).build().unwrap();
    let b = pool.alloc().unwrap();
    assert!(b.iter().all(|&x| x == 0));
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let locked_kb: u64 =
        status.lines().find_map(|l| l.strip_prefix("VmLck:")).unwrap().trim().trim_end_matches(" kB").parse().unwrap();
    assert!(locked_kb >= 128, "the slab is locked: VmLck {locked_kb} kB");
    match b.phys_addr() {
        Ok(pa) => {
            assert_eq!(pa % 4096, 0, "a page-aligned buffer's physical address");
            assert_eq!(b.phys_segments().unwrap(), 1);
        }
        Err(Error::Os { errno, .. }) => assert_eq!(errno, libc::EPERM, "without CAP_SYS_ADMIN"),
        Err(e) => panic!("{e}"),
    }
    drop(b);
    pool.shrink();
    assert_eq!(pool.stats().total().slabs, 0);
}

/// A cache that asks for transparent huge pages gets them (where THP is not
/// switched off) and its statistics say how much the kernel gave.
#[test]
fn a_thp_cache_counts_the_huge_pages_it_got() {
    let cache = RawCache::builder("thp_4k", 4096).align(4096).huge(numaweave::Huge::Thp).build().unwrap();
    let mut objs = vec![std::ptr::null_mut(); 1024];
    cache.alloc_bulk(&mut objs).unwrap();
    for &o in &objs {
        // SAFETY: live 4 KiB objects of `cache`.
        unsafe { o.write_bytes(7, 4096) };
    }
    let st = cache.stats().total();
    assert!(st.huge_chunks >= 1 && st.huge_chunks == st.chunks, "{st:?}");
    let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if mode.contains("[never]") || mode.is_empty() {
        assert_eq!(st.thp_bytes, 0);
    } else {
        assert!(
            st.thp_bytes >= 2 << 20,
            "4 MiB written in MADV_HUGEPAGE chunks, {} KiB on huge pages",
            st.thp_bytes >> 10
        );
    }
    let objs: Vec<NonNull<u8>> = objs.into_iter().map(|p| NonNull::new(p).unwrap()).collect();
    // SAFETY: objects of `cache`, each freed once.
    unsafe { cache.free_bulk(&objs) };
}

/// `huge_strict`: a node whose hugetlb pool is short fails the slab instead
/// of taking base pages (and a cache without it falls back, counted).
#[test]
fn strict_hugetlb_fails_where_the_pool_is_short() {
    let strict =
        RawCache::builder("hugetlb_strict", 4096).huge(numaweave::Huge::Hugetlb).huge_strict(true).build().unwrap();
    match strict.alloc_on(0) {
        // A machine with pages reserved: they are used.
        Ok(p) => {
            let st = strict.stats().total();
            assert!(st.huge_chunks == st.chunks && st.huge_fallbacks == 0, "{st:?}");
            // SAFETY: allocated above, freed once.
            unsafe { strict.free(p) };
        }
        Err(e) => {
            assert!(matches!(e, Error::NodeOutOfMemory { node: 0 }), "{e}");
            assert_eq!(strict.stats().total().huge_fallbacks, 0);
            let lax = RawCache::builder("hugetlb_lax", 4096).huge(numaweave::Huge::Hugetlb).build().unwrap();
            let p = lax.alloc_on(0).unwrap();
            assert!(lax.stats().total().huge_fallbacks >= 1);
            // SAFETY: allocated above, freed once.
            unsafe { lax.free(p) };
        }
    }
}

/// A registrar that keeps what it was told, and refuses while `refuse` is
/// set (with that errno).
#[derive(Default)]
struct Ledger {
    live: std::sync::Mutex<Vec<(usize, usize, usize)>>,
    registered: AtomicUsize,
    unregistered: AtomicUsize,
    refuse: AtomicUsize,
}

impl numaweave::slab::Registrar for Ledger {
    fn register(&self, r: &numaweave::slab::Region) -> Result<(), numaweave::slab::Refusal> {
        let refuse = self.refuse.load(Ordering::Relaxed);
        if refuse != 0 {
            return Err(numaweave::slab::Refusal::Errno(refuse as i32));
        }
        let a = r.addr.as_ptr() as usize;
        assert!(a.is_multiple_of(r.page_size) && r.len.is_multiple_of(r.page_size) && r.len > 0);
        let mut live = self.live.lock().unwrap();
        assert!(live.iter().all(|&(b, l, _)| a + r.len <= b || b + l <= a), "a region registered twice");
        live.push((a, r.len, r.node));
        self.registered.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    fn unregister(&self, r: &numaweave::slab::Region) {
        let a = r.addr.as_ptr() as usize;
        let mut live = self.live.lock().unwrap();
        let i = live.iter().position(|&(b, l, n)| (b, l, n) == (a, r.len, r.node));
        live.remove(i.expect("a region unregistered that was not registered, or twice"));
        self.unregistered.fetch_add(1, Ordering::Relaxed);
    }
}

impl Ledger {
    /// Whether `len` bytes at `p` lie in one live region.
    fn covers(&self, p: usize, len: usize) -> bool {
        self.live.lock().unwrap().iter().any(|&(b, l, _)| p >= b && p + len <= b + l)
    }
}

#[test]
fn every_region_is_registered_before_use_and_unregistered_once() {
    let ledger = Arc::new(Ledger::default());
    let cache = RawCache::builder("registered_bufs", 4096).align(4096).registrar(ledger.clone()).build().unwrap();
    assert_eq!(ledger.registered.load(Ordering::Relaxed), 0, "nothing mapped before the first object");
    let objs: Vec<NonNull<u8>> = (0..2000).map(|_| cache.alloc().unwrap()).collect();
    for (i, o) in objs.iter().enumerate() {
        assert!(ledger.covers(o.as_ptr() as usize, 4096), "object {i} outside every registered region");
        // SAFETY: an object of the cache, 4096 bytes.
        unsafe { o.as_ptr().write_bytes(i as u8, 4096) };
    }
    let registered = ledger.registered.load(Ordering::Relaxed);
    assert!(registered >= 2, "8 MiB of buffers in {registered} region(s)");
    let st = cache.stats();
    let (regions, bytes) = (st.total().registered_regions, st.total().registered_bytes);
    assert_eq!(regions, registered);
    assert_eq!(bytes, ledger.live.lock().unwrap().iter().map(|r| r.1).sum::<usize>());
    // Half back, and a shrink: regions with live objects stay registered.
    for o in &objs[..1000] {
        // SAFETY: objects of this cache, given back once.
        unsafe { cache.free(*o) };
    }
    cache.shrink();
    for o in &objs[1000..] {
        assert!(ledger.covers(o.as_ptr() as usize, 4096));
    }
    for o in &objs[1000..] {
        // SAFETY: as above.
        unsafe { cache.free(*o) };
    }
    cache.shrink();
    assert_eq!(ledger.unregistered.load(Ordering::Relaxed), ledger.registered.load(Ordering::Relaxed));
    assert!(ledger.live.lock().unwrap().is_empty());
    assert_eq!(cache.stats().total().registered_bytes, 0);
    // Allocations go on (a region registered again) and the drop
    // unregisters what is left.
    let o = cache.alloc().unwrap();
    assert!(ledger.covers(o.as_ptr() as usize, 4096));
    // SAFETY: as above.
    unsafe { cache.free(o) };
    drop(cache);
    assert!(ledger.live.lock().unwrap().is_empty(), "the dropped cache's regions unregistered");
    assert_eq!(ledger.unregistered.load(Ordering::Relaxed), ledger.registered.load(Ordering::Relaxed));
}

/// A forked child leaves its parent's registrations alone: an inherited
/// chunk the child gives back is not unregistered (the registration is the
/// parent's: an io_uring table or a VFIO container the two share), no
/// inherited chunk counts as registered in it, and the child's registrar
/// is asked before the child uses one (a new slab's chunk before it is
/// carved; an object of an older slab through `register_again`). (Before, the
/// child's shrink unregistered the parent's regions.)
#[test]
fn a_forked_child_leaves_its_parents_registrations_alone() {
    let ledger = Arc::new(Ledger::default());
    let cache = RawCache::builder("fork_registered", 4096).align(4096).registrar(ledger.clone()).build().unwrap();
    let objs: Vec<NonNull<u8>> = (0..600).map(|_| cache.alloc().unwrap()).collect();
    let keep = objs[0];
    for o in &objs[1..] {
        // SAFETY: objects of this cache, given back once.
        unsafe { cache.free(*o) };
    }
    let registered = ledger.registered.load(Ordering::Relaxed);
    assert!(registered >= 2);
    // SAFETY: the child uses the cache and the ledger (its own copies) and
    // ends with `_exit`.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = (|| {
            if cache.stats().total().registered_regions != 0 {
                return 3;
            }
            cache.shrink();
            if ledger.unregistered.load(Ordering::Relaxed) != 0 {
                return 4;
            }
            let Ok(o) = cache.alloc() else { return 5 };
            // From a new slab, its chunk registered by the child first; from
            // a slab carved before the fork (a magazine's), registered on
            // demand: either way the child's registrar was asked.
            // SAFETY: a live object of this cache.
            if !matches!(unsafe { cache.register_again(o) }, Ok(true)) {
                return 6;
            }
            if !ledger.covers(o.as_ptr() as usize, 4096) || ledger.registered.load(Ordering::Relaxed) == registered {
                return 6;
            }
            0
        })();
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(code) };
    }
    let mut st = 0;
    // SAFETY: our child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
    assert!(libc::WIFEXITED(st), "the child died: {st:#x}");
    let what = [
        "",
        "",
        "",
        "inherited chunks counted as registered",
        "the parent's regions unregistered",
        "no object",
        "a slab carved from an unregistered chunk",
    ];
    assert_eq!(libc::WEXITSTATUS(st), 0, "in the child: {}", what.get(libc::WEXITSTATUS(st) as usize).unwrap_or(&"?"));
    // SAFETY: as above.
    unsafe { cache.free(keep) };
}

#[test]
fn a_refused_region_fails_the_allocation_and_is_not_kept() {
    let ledger = Arc::new(Ledger { refuse: AtomicUsize::new(libc::ENOMEM as usize), ..Default::default() });
    let pool = DmaPool::builder("refused_bufs", 4096).registrar(ledger.clone()).build().unwrap();
    match pool.alloc() {
        Err(e @ Error::Registration { len, errno, .. }) => {
            assert_eq!(errno, libc::ENOMEM);
            assert!(len >= 4096);
            assert!(e.to_string().contains("RLIMIT_MEMLOCK"), "{e}");
        }
        other => panic!("expected a registration error, got {:?}", other.map(|b| b.as_ptr())),
    }
    let st = pool.stats();
    assert_eq!((st.total().registered_regions, st.nodes.iter().map(|n| n.chunks).sum::<usize>()), (0, 0));
    assert_eq!(ledger.unregistered.load(Ordering::Relaxed), 0, "a refused region is not unregistered");
    // Accepted from now on: the pool serves, from a registered region.
    ledger.refuse.store(0, Ordering::Relaxed);
    let b = pool.alloc().unwrap();
    assert!(ledger.covers(b.as_ptr() as usize, 4096));
    drop(b);
    drop(pool);
    assert!(ledger.registered.load(Ordering::Relaxed) >= 1);
    assert_eq!(ledger.unregistered.load(Ordering::Relaxed), ledger.registered.load(Ordering::Relaxed));
}
