//! Topology discovery must not touch the heap: the allocator calls it from its
//! own start-up. A counting global allocator proves it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

thread_local! {
    // Only the test's own thread counts: libtest's main thread allocates
    // (its table of running tests) just after it starts the test's thread,
    // and on a loaded host those allocations fell inside a window. A
    // const-initialised `Cell` without a destructor needs no allocation of
    // its own.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to System; the counter is a plain atomic, the flag a
// thread-local `Cell` that allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded contract.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn allocations_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    ALLOCS.store(0, Ordering::Relaxed);
    COUNTING.with(|c| c.set(true));
    let r = f();
    COUNTING.with(|c| c.set(false));
    (r, ALLOCS.load(Ordering::Relaxed))
}

// One test function: the counter is process-wide (the flag is not), so a
// second test's allocations would be counted while both count.
#[test]
fn discovery_and_queries_never_allocate() {
    let (t, n) = allocations_during(numaweave::Topology::detect);
    let t = t.unwrap();
    assert_eq!(n, 0, "Topology::detect allocated {n} times");

    let (fake, n) = allocations_during(|| numaweave::topology::SyntheticBuilder::fake(&t, 8));
    assert_eq!(n, 0, "fake:8 allocated {n} times");
    let fake = fake.unwrap();

    let (_, n) = allocations_during(|| {
        let g = numaweave::Topology::global();
        let here = g.current_node();
        let order: usize = g.nodes_by_distance(here).sum();
        (g.cpus_of(here).len(), order, fake.current_node(), fake.physical_node(7))
    });
    assert_eq!(n, 0, "global topology and queries allocated {n} times");

    // Memory performance (HMAT or sysfs access figures, tiers, kernel
    // weights): read on first use, from the allocator's slow paths too.
    let (w, n) = allocations_during(|| {
        let g = numaweave::Topology::global();
        let here = g.current_node();
        let _ = (g.perf_source(), g.bandwidth(here, here), g.latency(here, here), g.lower_tier_nodes());
        (g.interleave_weights(here, g.memory_nodes()), g.nearest_lower_tier(here))
    });
    assert_eq!(n, 0, "memory performance queries allocated {n} times");
    assert!(w.0.weights[numaweave::Topology::global().current_node()] >= 1);

    let (_, n) = allocations_during(|| {
        let r = numaweave::os::mem::Mapping::map(1 << 16).unwrap();
        r.bind(numaweave::os::mem::MemPolicy::Local).unwrap();
        numaweave::os::mem::page_node(r.as_ptr()).unwrap()
    });
    assert_eq!(n, 0, "OS layer allocated {n} times");
}
