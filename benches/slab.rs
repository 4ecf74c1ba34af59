//! Node slabs beside the alternatives for fixed-size objects, in one run so
//! ratios of medians compare like with like on a noisy machine:
//! `Box` over the system allocator (as raw `System` calls), over `NumaAlloc`
//! (as a value), `sharded-slab`'s `Pool`, and `lockfree-object-pool`'s
//! `LinearObjectPool`.
//!
//! ```text
//! cargo bench --bench slab
//! ```
//!
//! Workloads: one 256-byte object allocated and freed (the pair), a batch of
//! 32 allocated then freed, and objects allocated on one thread and freed on
//! another (batches of 64 through a channel); and a 4 KiB DMA buffer's pair
//! against the same buffer from a plain page-aligned slab cache (issue 14's
//! target: at most 1.2x).

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use std::mem::MaybeUninit;

use numaweave::slab::{DmaPool, RawCache, SlabBox, SlabCache};

static NUMAWEAVE: numaweave::NumaAlloc = numaweave::NumaAlloc::new();

type Obj = [u8; 256];
const LAYOUT: Layout = Layout::new::<Obj>();

/// A `Box<Obj>` over any `GlobalAlloc`, by hand (`Box::new_in` is unstable).
struct RawBox<'a, A: GlobalAlloc>(&'a A, *mut Obj);

impl<'a, A: GlobalAlloc> RawBox<'a, A> {
    #[inline]
    fn new(a: &'a A, v: Obj) -> Self {
        // SAFETY: a valid, non-zero layout; checked for null.
        let p = unsafe { a.alloc(LAYOUT) }.cast::<Obj>();
        assert!(!p.is_null());
        // SAFETY: fresh, sized and aligned for `Obj`.
        unsafe { p.write(v) };
        Self(a, p)
    }
}

impl<A: GlobalAlloc> Drop for RawBox<'_, A> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with `LAYOUT`.
        unsafe { self.0.dealloc(self.1.cast(), LAYOUT) };
    }
}

// SAFETY: the box owns its object; any thread may free through `GlobalAlloc`.
unsafe impl<A: GlobalAlloc + Sync> Send for RawBox<'_, A> {}

/// The pair alone: no bytes written into the object, so what is measured is
/// the allocator (a `MaybeUninit` payload for the typed cache, raw calls for
/// the rest; what `Box::<MaybeUninit<_>>::new_uninit` would cost).
fn pair_bare(c: &mut Criterion) {
    let mut g = c.benchmark_group("slab_pair_bare_256B");
    let cache = SlabCache::<MaybeUninit<Obj>>::new("bench_pair_bare").unwrap();
    g.bench_function("numaweave_slab", |b| b.iter(|| drop(black_box(cache.alloc(MaybeUninit::uninit()).unwrap()))));
    let raw = RawCache::builder("bench_pair_raw", 256).build().unwrap();
    g.bench_function("numaweave_raw_cache", |b| {
        b.iter(|| {
            let p = black_box(raw.alloc().unwrap());
            // SAFETY: allocated just above, freed once.
            unsafe { raw.free(p) };
        })
    });
    let sys = |a: &dyn GlobalAlloc| {
        // SAFETY: a valid layout; freed at once.
        unsafe {
            let p = black_box(a.alloc(LAYOUT));
            a.dealloc(p, LAYOUT);
        }
    };
    g.bench_function("box_system", |b| b.iter(|| sys(&System)));
    g.bench_function("box_numaalloc", |b| b.iter(|| sys(&NUMAWEAVE)));
    // The pools' own pair: take a pooled object and give it back.
    let sharded: sharded_slab::Pool<Vec<u8>> = sharded_slab::Pool::new();
    g.bench_function("sharded_slab_pool", |b| {
        b.iter(|| {
            let key = black_box(sharded.create_with(|_| {}).unwrap());
            sharded.clear(key);
        })
    });
    let lockfree = lockfree_object_pool::LinearObjectPool::<Obj>::new(|| [0; 256], |_| {});
    g.bench_function("lockfree_object_pool", |b| b.iter(|| drop(black_box(lockfree.pull()))));
    g.finish();
}

/// The pair with a 256-byte value moved in, as a caller of `Box::new` pays.
fn pair(c: &mut Criterion) {
    let mut g = c.benchmark_group("slab_pair_256B");
    let cache = SlabCache::<Obj>::new("bench_pair").unwrap();
    g.bench_function("numaweave_slab", |b| b.iter(|| drop(black_box(cache.alloc(black_box([1; 256])).unwrap()))));
    g.bench_function("box_system", |b| b.iter(|| drop(black_box(RawBox::new(&System, black_box([1; 256]))))));
    g.bench_function("box_numaalloc", |b| b.iter(|| drop(black_box(RawBox::new(&NUMAWEAVE, black_box([1; 256]))))));
    let sharded: sharded_slab::Pool<Vec<u8>> = sharded_slab::Pool::new();
    g.bench_function("sharded_slab_pool", |b| {
        b.iter(|| {
            // `Pool` reuses each slot's allocation: the closest it has to a
            // fixed-size object (a `Vec` kept at 256 bytes).
            let key = sharded.create_with(|v| v.resize(256, 1)).unwrap();
            black_box(key);
            sharded.clear(key);
        })
    });
    let lockfree = lockfree_object_pool::LinearObjectPool::<Obj>::new(|| [0; 256], |v| v[0] = 0);
    g.bench_function("lockfree_object_pool", |b| {
        b.iter(|| {
            let mut o = lockfree.pull();
            o[0] = 1;
            drop(black_box(o));
        })
    });
    g.finish();
}

fn bulk(c: &mut Criterion) {
    let mut g = c.benchmark_group("slab_bulk32_256B");
    let cache = SlabCache::<Obj>::new("bench_bulk").unwrap();
    g.bench_function("numaweave_slab_bulk", |b| {
        b.iter(|| {
            let v = cache.alloc_bulk(32, |_| [1; 256]).unwrap();
            cache.free_bulk(black_box(v));
        })
    });
    g.bench_function("numaweave_slab_loop", |b| {
        b.iter(|| {
            let v: Vec<SlabBox<Obj>> = (0..32).map(|_| cache.alloc([1; 256]).unwrap()).collect();
            drop(black_box(v));
        })
    });
    g.bench_function("box_system", |b| {
        b.iter(|| {
            let v: Vec<_> = (0..32).map(|_| RawBox::new(&System, [1; 256])).collect();
            drop(black_box(v));
        })
    });
    g.bench_function("box_numaalloc", |b| {
        b.iter(|| {
            let v: Vec<_> = (0..32).map(|_| RawBox::new(&NUMAWEAVE, [1; 256])).collect();
            drop(black_box(v));
        })
    });
    g.finish();
}

/// Allocates `iters` batches of 64 here, frees them on a consumer thread.
fn cross<T: Send + 'static>(iters: u64, mut make: impl FnMut() -> T) -> Duration {
    let (tx, rx) = mpsc::sync_channel::<Vec<T>>(4);
    let consumer = std::thread::spawn(move || {
        for batch in rx {
            drop(batch);
        }
    });
    let t = Instant::now();
    for _ in 0..iters {
        let batch: Vec<T> = (0..64).map(|_| make()).collect();
        tx.send(batch).unwrap();
    }
    drop(tx);
    consumer.join().unwrap();
    t.elapsed()
}

fn cross_thread(c: &mut Criterion) {
    let mut g = c.benchmark_group("slab_cross_thread_64x256B");
    let cache = std::sync::Arc::new(SlabCache::<Obj>::new("bench_cross").unwrap());
    g.bench_function(BenchmarkId::new("numaweave_slab", 64), |b| {
        b.iter_custom(|n| cross(n, || cache.alloc([1; 256]).unwrap()))
    });
    g.bench_function(BenchmarkId::new("box_system", 64), |b| {
        b.iter_custom(|n| cross(n, || RawBox::new(&System, [1; 256])))
    });
    g.bench_function(BenchmarkId::new("box_numaalloc", 64), |b| {
        b.iter_custom(|n| cross(n, || RawBox::new(&NUMAWEAVE, [1; 256])))
    });
    g.finish();
}

/// A 4 KiB I/O buffer: `DmaPool` (its handle, its boundary alignment)
/// against a `RawCache` of page-aligned 4 KiB objects.
fn dma_pair(c: &mut Criterion) {
    let mut g = c.benchmark_group("dma_pair_4KiB");
    let raw = RawCache::builder("bench_dma_raw", 4096).align(4096).build().unwrap();
    g.bench_function("raw_cache", |b| {
        b.iter(|| {
            let p = black_box(raw.alloc().unwrap());
            // SAFETY: allocated just above, freed once.
            unsafe { raw.free(p) };
        })
    });
    let pool = DmaPool::builder("bench_dma_pool", 4096).build().unwrap();
    g.bench_function("dma_pool", |b| b.iter(|| drop(black_box(pool.alloc().unwrap()))));
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = pair_bare, pair, bulk, cross_thread, dma_pair
}
criterion_main!(benches);
