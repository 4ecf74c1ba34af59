//! Thread churn with NumaAlloc as the global allocator: 10,000 threads that
//! each allocate must neither grow memory without bound nor leak, because a
//! dead thread's heap is left for the next thread to adopt.

use std::alloc::{GlobalAlloc, Layout};

use numaweave::NumaAlloc;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn churn(threads: usize) {
    for i in 0..threads {
        std::thread::spawn(move || {
            // A mix of small blocks, a medium one and a huge one, some kept
            // until the thread exits, so its heap has live pages to hand over.
            let v: Vec<Box<[u8]>> = (0..64).map(|k| vec![(i + k) as u8; 16 + k * 24].into_boxed_slice()).collect();
            let big = vec![1u8; 100_000];
            let huge = vec![2u8; 600_000];
            assert!(v.iter().enumerate().all(|(k, b)| b[0] == (i + k) as u8));
            assert_eq!(big[99_999] + huge[599_999], 3);
        })
        .join()
        .unwrap();
    }
}

/// The figures read are process-wide: the tests of this binary run one at
/// a time (the harness runs them on threads of one process).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn spawning_and_joining_threads_reuses_heaps_and_leaks_nothing() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    churn(500);
    // (Frees from other threads into an exited thread's heap count there
    // once collected, which a trim does now: std's thread handles are
    // freed across threads. Without it, the last thread's uncollected
    // frees made "before" up to 200 KB higher than "after".)
    numaweave::trim();
    let before = A.stats();
    let rss_before = rss_bytes();
    churn(10_000);
    numaweave::trim();
    let after = A.stats();
    let rss_after = rss_bytes();
    println!("{after}");
    println!("RSS {} MiB -> {} MiB", rss_before >> 20, rss_after >> 20);
    // Heaps are adopted, not made anew: at most a few per concurrently live thread.
    assert!(after.heaps <= before.heaps + 4, "heaps {} -> {}", before.heaps, after.heaps);
    assert!(after.orphan_heaps >= 1);
    // No growth beyond noise: 10,000 threads x ~700 KiB each would be ~7 GiB.
    assert!(rss_after < rss_before + (32 << 20), "RSS grew {} -> {}", rss_before, rss_after);
    let (b, a) = (before.total(), after.total());
    assert!(a.reserved <= b.reserved + (16 << 20), "reserved grew {} -> {}", b.reserved, a.reserved);
    // Every block the threads made was freed: what is in use is what the main
    // thread holds, which has not changed.
    assert!(a.in_use.abs_diff(b.in_use) < 64 << 10, "in use {} -> {}", b.in_use, a.in_use);
    assert!(a.allocs - b.allocs >= 10_000 * 66);
}

#[test]
fn realloc_through_the_global_allocator_keeps_contents() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: valid layouts; each block freed once with its current layout.
    unsafe {
        let mut l = Layout::from_size_align(24, 8).unwrap();
        let mut p = A.alloc(l);
        for i in 0..24 {
            p.add(i).write(i as u8);
        }
        for new in [100, 5000, 200_000, 3 << 20, 10 << 20, 1000, 24] {
            p = A.realloc(p, l, new);
            assert!(!p.is_null());
            for i in 0..24 {
                assert_eq!(p.add(i).read(), i as u8, "after realloc to {new}");
            }
            l = Layout::from_size_align(new, 8).unwrap();
        }
        A.dealloc(p, l);
    }
}
