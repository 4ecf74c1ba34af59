//! NumaAlloc beside the system allocator, mimalloc, jemalloc and numalloc, all
//! used as values (`GlobalAlloc` calls on each) in one run, so ratios of
//! medians compare like with like on the same noisy machine.
//!
//! ```text
//! cargo bench --features peers --bench alloc
//! ```
//!
//! Workloads: single-thread churn of 16–4096-byte blocks, realloc growth from
//! 16 bytes to 1 MiB, producer/consumer cross-thread frees (64-byte blocks,
//! and mixed sizes of 1 B – 2 KiB), and a larson-style
//! multi-thread mix where slot arrays migrate between threads.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};

#[path = "../src/rng.rs"]
mod rng;
use rng::Rng;

static NUMAWEAVE: numaweave::NumaAlloc = numaweave::NumaAlloc::new();
static MIMALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;
static JEMALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
static NUMALLOC: numalloc::NumaAlloc = numalloc::NumaAlloc::new();

/// Runs `$body` once per allocator, with `$a` bound to it (monomorphised, so
/// no dynamic dispatch sits between the workload and the allocator).
macro_rules! for_each_allocator {
    ($group:expr, $id:expr, |$a:ident| $body:expr) => {{
        {
            let $a = &NUMAWEAVE;
            $group.bench_function(BenchmarkId::new("numaweave", $id), $body);
        }
        {
            let $a = &MIMALLOC;
            $group.bench_function(BenchmarkId::new("mimalloc", $id), $body);
        }
        {
            let $a = &JEMALLOC;
            $group.bench_function(BenchmarkId::new("jemalloc", $id), $body);
        }
        {
            let $a = &NUMALLOC;
            $group.bench_function(BenchmarkId::new("numalloc", $id), $body);
        }
        {
            let $a = &System;
            $group.bench_function(BenchmarkId::new("system", $id), $body);
        }
    }};
}

/// A deterministic size sequence shared by every allocator.
fn sizes(n: usize, min: usize, max: usize) -> Vec<usize> {
    let mut r = Rng(0x9e37_79b9_7f4a_7c15);
    (0..n)
        .map(|_| {
            // Log-uniform: as many 16–32-byte requests as 2–4 KiB ones.
            let lo = (min as f64).ln();
            let hi = (max as f64).ln();
            let x = (r.next() >> 11) as f64 / (1u64 << 53) as f64;
            ((lo + x * (hi - lo)).exp() as usize).clamp(min, max)
        })
        .collect()
}

/// 256 blocks of mixed sizes allocated, touched, freed in a shuffled order.
fn churn<A: GlobalAlloc>(a: &A, sizes: &[usize], order: &[usize], ptrs: &mut [*mut u8]) {
    for (i, &s) in sizes.iter().enumerate() {
        // SAFETY: valid non-zero layouts; every block is freed below.
        unsafe {
            let p = a.alloc(Layout::from_size_align_unchecked(s, 8));
            p.write(i as u8);
            ptrs[i] = p;
        }
    }
    for &i in order {
        // SAFETY: freeing what was allocated above, with its layout.
        unsafe { a.dealloc(black_box(ptrs[i]), Layout::from_size_align_unchecked(sizes[i], 8)) };
    }
}

fn bench_churn(c: &mut Criterion) {
    let sizes = sizes(256, 16, 4096);
    let mut r = Rng(42);
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, (r.next() % (i as u64 + 1)) as usize);
    }
    let mut g = c.benchmark_group("churn 256 x 16-4096B");
    for_each_allocator!(g, "1 thread", |a| |b| {
        let mut ptrs = vec![std::ptr::null_mut(); sizes.len()];
        b.iter(|| churn(a, &sizes, &order, &mut ptrs))
    });
    g.finish();
}

/// Grows one buffer from 16 bytes to 1 MiB by 1.5x steps (what a `Vec` does),
/// touching the new tail each time, then frees it.
fn grow<A: GlobalAlloc>(a: &A) {
    let mut size = 16usize;
    // SAFETY: valid layouts; realloc'd with the layout it has.
    unsafe {
        let mut p = a.alloc(Layout::from_size_align_unchecked(size, 8));
        while size < 1 << 20 {
            let new = size + size / 2;
            p = a.realloc(p, Layout::from_size_align_unchecked(size, 8), new);
            p.add(new - 1).write(1);
            size = new;
        }
        a.dealloc(p, Layout::from_size_align_unchecked(size, 8));
    }
}

fn bench_realloc(c: &mut Criterion) {
    let mut g = c.benchmark_group("realloc growth 16B-1MiB");
    for_each_allocator!(g, "1 thread", |a| |b| b.iter(|| grow(a)));
    g.finish();
}

/// The producer allocates batches of blocks of the sizes in `sizes` (in
/// turn), writes every byte of each, and sends the batch; the consumer
/// reads each block's first and last byte and frees it: every free is a
/// remote free.
fn producer_consumer<A: GlobalAlloc + Sync>(a: &'static A, sizes: &'static [usize], iters: u64) -> Duration {
    const BATCH: usize = 256;
    let layout = |s: usize| Layout::from_size_align(s, 8).unwrap();
    let (tx, rx) = mpsc::sync_channel::<Vec<(usize, usize)>>(16);
    let start = Instant::now();
    let consumer = std::thread::spawn(move || {
        let mut sum = 0u64;
        for batch in rx {
            for (p, s) in batch {
                // SAFETY: blocks of `s` bytes the producer allocated with
                // `layout(s)` and wrote.
                unsafe {
                    sum += u64::from(*(p as *const u8)) + u64::from(*(p as *const u8).add(s - 1));
                    a.dealloc(p as *mut u8, layout(s));
                }
            }
        }
        black_box(sum);
    });
    let mut k = 0;
    for _ in 0..iters {
        let batch: Vec<(usize, usize)> = (0..BATCH)
            .map(|i| {
                let s = sizes[k % sizes.len()];
                k += 1;
                // SAFETY: valid layout; freed by the consumer.
                let p = unsafe { a.alloc(layout(s)) };
                // SAFETY: `s` writable bytes.
                unsafe { p.write_bytes(i as u8, s) };
                (p as usize, s)
            })
            .collect();
        tx.send(batch).unwrap();
    }
    drop(tx);
    consumer.join().unwrap();
    start.elapsed()
}

fn bench_cross_thread(c: &mut Criterion) {
    let mut g = c.benchmark_group("producer-consumer 256 x 64B");
    for_each_allocator!(g, "2 threads", |a| |b| b.iter_custom(|iters| producer_consumer(a, &[64], iters)));
    g.finish();
    // What a client sending `Vec`s of mixed sizes to another thread does
    // (issue 11's "mixed-size cross-thread" case): log-uniform 1 B - 2 KiB.
    let mixed: &'static [usize] = Vec::leak(sizes(4096, 1, 2048));
    let mut g = c.benchmark_group("producer-consumer 256 x 1B-2KiB");
    for_each_allocator!(g, "2 threads", |a| |b| b.iter_custom(|iters| producer_consumer(a, mixed, iters)));
    g.finish();
}

/// Larson-style: each thread replaces random slots of its array with blocks
/// of random size (16–1024 B); after each round the arrays rotate between
/// threads, so most frees hit blocks another thread allocated.
fn larson<A: GlobalAlloc + Sync>(a: &'static A, threads: usize, rounds: u64) -> Duration {
    const SLOTS: usize = 1024;
    const STEPS: usize = 4096;
    let layout_of = |s: usize| Layout::from_size_align(s, 8).unwrap();
    let sz = sizes(SLOTS * 4, 16, 1024);
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..threads).map(|_| mpsc::channel::<Vec<(usize, usize)>>()).unzip();
    for tx in &txs {
        let arr: Vec<(usize, usize)> = (0..SLOTS)
            .map(|i| {
                let s = sz[i];
                // SAFETY: valid layout; freed by whichever thread ends up with it.
                (unsafe { a.alloc(layout_of(s)) } as usize, s)
            })
            .collect();
        tx.send(arr).unwrap();
    }
    let start = Instant::now();
    std::thread::scope(|scope| {
        for (t, rx) in rxs.into_iter().enumerate() {
            let next = txs[(t + 1) % threads].clone();
            let sz = &sz;
            scope.spawn(move || {
                let mut r = Rng(t as u64 * 7919 + 1);
                for round in 0..rounds {
                    let mut arr = rx.recv().unwrap();
                    for _ in 0..STEPS {
                        let i = (r.next() % SLOTS as u64) as usize;
                        let s = sz[(r.next() % sz.len() as u64) as usize];
                        let (p, old) = arr[i];
                        // SAFETY: each slot holds a live block of its recorded size.
                        unsafe {
                            a.dealloc(p as *mut u8, layout_of(old));
                            let q = a.alloc(layout_of(s));
                            q.write(1);
                            arr[i] = (q as usize, s);
                        }
                    }
                    if round + 1 < rounds {
                        next.send(arr).unwrap();
                    } else {
                        for (p, s) in arr {
                            // SAFETY: as above.
                            unsafe { a.dealloc(p as *mut u8, layout_of(s)) };
                        }
                    }
                }
            });
        }
    });
    start.elapsed()
}

fn bench_larson(c: &mut Criterion) {
    let mut g = c.benchmark_group("larson 1024 slots x 4096 steps");
    for_each_allocator!(g, "2 threads", |a| |b| b.iter_custom(|iters| larson(a, 2, iters)));
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_churn, bench_realloc, bench_cross_thread, bench_larson
}
criterion_main!(benches);
