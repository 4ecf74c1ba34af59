//! NumaAlloc used as a value (the binary's global allocator stays System):
//! randomized alloc/realloc/free sequences checking alignment, disjointness of
//! live blocks and contents across realloc, from several threads with blocks
//! crossing threads; edge layouts; zeroing.

use std::alloc::{GlobalAlloc, Layout};
use std::collections::BTreeMap;
use std::sync::mpsc;

use numaweave::{Error, NumaAlloc};

static A: NumaAlloc = NumaAlloc::new();

mod support;
use support::Rng;

/// A live block: its layout and the seed of the bytes written into it.
#[derive(Clone, Copy)]
struct Live {
    ptr: usize,
    layout: Layout,
    seed: u8,
}

fn fill(l: &Live) {
    // SAFETY: the block holds `layout.size()` writable bytes.
    let s = unsafe { std::slice::from_raw_parts_mut(l.ptr as *mut u8, l.layout.size()) };
    for (i, b) in s.iter_mut().enumerate() {
        *b = l.seed.wrapping_add((i % 251) as u8);
    }
}

fn check(l: &Live, len: usize) {
    // SAFETY: the block holds at least `len` readable bytes.
    let s = unsafe { std::slice::from_raw_parts(l.ptr as *const u8, len) };
    for (i, &b) in s.iter().enumerate() {
        assert_eq!(b, l.seed.wrapping_add((i % 251) as u8), "byte {i} of block {:#x} ({:?})", l.ptr, l.layout);
    }
}

fn random_layout(r: &mut Rng) -> Layout {
    let size = match r.below(100) {
        0..=59 => 1 + r.below(256) as usize,
        60..=89 => 1 + r.below(16 << 10) as usize,
        90..=97 => 1 + r.below(300 << 10) as usize,
        _ => 1 + r.below(3 << 20) as usize,
    };
    let align = match r.below(100) {
        0..=79 => 1 << r.below(4),
        80..=95 => 1 << (4 + r.below(9)), // up to 4 KiB
        96..=98 => 1 << 16,
        _ => 1 << 20,
    };
    Layout::from_size_align(size, align).unwrap()
}

/// Keeps the live set, checks every new block against its neighbours.
struct Tracker {
    live: BTreeMap<usize, Live>,
}

impl Tracker {
    fn insert(&mut self, l: Live) {
        assert!(l.ptr != 0, "allocation of {:?} failed", l.layout);
        assert_eq!(l.ptr % l.layout.align(), 0, "misaligned {:?} at {:#x}", l.layout, l.ptr);
        // SAFETY: a live block of A.
        assert!(unsafe { A.usable_size(l.ptr as *const u8) } >= l.layout.size());
        let end = l.ptr + l.layout.size();
        if let Some((_, prev)) = self.live.range(..l.ptr).next_back() {
            assert!(prev.ptr + prev.layout.size() <= l.ptr, "overlaps the block before");
        }
        if let Some((&next, _)) = self.live.range(l.ptr..).next() {
            assert!(end <= next, "overlaps the block after");
        }
        fill(&l);
        self.live.insert(l.ptr, l);
    }

    fn remove_random(&mut self, r: &mut Rng) -> Option<Live> {
        if self.live.is_empty() {
            return None;
        }
        let k = r.below(self.live.len() as u64) as usize;
        let key = *self.live.keys().nth(k).unwrap();
        self.live.remove(&key)
    }
}

fn run_sequence(
    seed: u64,
    ops: usize,
    outbox: Option<mpsc::Sender<Vec<Live>>>,
    inbox: Option<mpsc::Receiver<Vec<Live>>>,
) {
    let mut r = Rng(seed);
    let mut t = Tracker { live: BTreeMap::new() };
    for op in 0..ops {
        match r.below(10) {
            0..=4 => {
                let layout = random_layout(&mut r);
                // SAFETY: valid non-zero layout.
                let p = unsafe { A.alloc(layout) } as usize;
                t.insert(Live { ptr: p, layout, seed: r.next() as u8 });
            }
            5..=6 => {
                if let Some(l) = t.remove_random(&mut r) {
                    let new_size = random_layout(&mut r).size();
                    // SAFETY: a live block with its layout; valid new size.
                    let q = unsafe { A.realloc(l.ptr as *mut u8, l.layout, new_size) } as usize;
                    let moved = Live {
                        ptr: q,
                        layout: Layout::from_size_align(new_size, l.layout.align()).unwrap(),
                        seed: l.seed,
                    };
                    assert!(q != 0, "realloc to {new_size} failed");
                    check(&moved, l.layout.size().min(new_size));
                    t.insert(moved);
                }
            }
            _ => {
                if let Some(l) = t.remove_random(&mut r) {
                    check(&l, l.layout.size());
                    // SAFETY: a live block with its layout.
                    unsafe { A.dealloc(l.ptr as *mut u8, l.layout) };
                }
            }
        }
        // Every so often hand a batch to the next thread, which frees it.
        if op % 500 == 499 {
            if let Some(tx) = &outbox {
                let batch: Vec<Live> = (0..20).filter_map(|_| t.remove_random(&mut r)).collect();
                tx.send(batch).unwrap();
            }
            if let Some(rx) = &inbox {
                for batch in rx.try_iter() {
                    for l in batch {
                        check(&l, l.layout.size());
                        // SAFETY: a live block another thread handed over.
                        unsafe { A.dealloc(l.ptr as *mut u8, l.layout) };
                    }
                }
            }
        }
    }
    for (_, l) in std::mem::take(&mut t.live) {
        check(&l, l.layout.size());
        // SAFETY: live block.
        unsafe { A.dealloc(l.ptr as *mut u8, l.layout) };
    }
    if let Some(rx) = inbox {
        drop(outbox);
        for batch in rx {
            for l in batch {
                check(&l, l.layout.size());
                // SAFETY: as above.
                unsafe { A.dealloc(l.ptr as *mut u8, l.layout) };
            }
        }
    }
}

#[test]
fn random_sequences_one_thread() {
    for seed in 1..=4 {
        run_sequence(seed * 0x9e37_79b9, 20_000, None, None);
    }
}

#[test]
fn random_sequences_with_blocks_crossing_threads() {
    const T: usize = 4;
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..T).map(|_| mpsc::channel::<Vec<Live>>()).unzip();
    std::thread::scope(|s| {
        for (i, rx) in rxs.into_iter().enumerate() {
            let tx = txs[(i + 1) % T].clone();
            s.spawn(move || run_sequence(i as u64 * 7919 + 3, 15_000, Some(tx), Some(rx)));
        }
        drop(txs);
    });
}

#[test]
fn edge_layouts() {
    // SAFETY: valid layouts for every call below; blocks freed with their layout.
    unsafe {
        for align in [1usize << 20, 4 << 20, 8 << 20, 64 << 20, 1 << 30] {
            for size in [1usize, 4096, 3 << 20] {
                let l = Layout::from_size_align(size, align).unwrap();
                let p = A.alloc(l);
                assert!(!p.is_null(), "{size} bytes aligned to {align}");
                assert_eq!(p as usize % align, 0);
                p.write_bytes(0xcd, size);
                A.dealloc(p, l);
            }
        }
        let too_aligned = Layout::from_size_align(64, 1 << 31).unwrap();
        assert!(A.alloc(too_aligned).is_null());
        for size in [isize::MAX as usize - 4096, isize::MAX as usize / 2 + 1, 1 << 62] {
            let l = Layout::from_size_align(size, 8).unwrap();
            assert!(A.alloc(l).is_null(), "{size} bytes");
            assert!(matches!(A.try_alloc(l), Err(Error::LayoutTooLarge { .. })));
        }
        // Larger than memory but a valid mapping size: the kernel may refuse
        // (null) or grant address space; either way no panic, and a block we
        // get is usable at both ends.
        let l = Layout::from_size_align(1 << 45, 8).unwrap();
        let p = A.alloc(l);
        if !p.is_null() {
            p.write(1);
            p.add(l.size() - 1).write(1);
            A.dealloc(p, l);
        }
        // Growing far past the first mapping and shrinking back keep contents.
        let l = Layout::from_size_align(300 << 10, 64).unwrap();
        let mut p = A.alloc(l);
        for i in 0..l.size() {
            p.add(i).write(i as u8);
        }
        for new in [5 << 20, 40 << 20, 1 << 20, 100] {
            let old = A.usable_size(p);
            p = A.realloc(p, Layout::from_size_align(old.min(l.size()).max(100), 64).unwrap(), new);
            assert!(!p.is_null());
            assert_eq!(p as usize % 64, 0);
            for i in 0..new.min(100) {
                assert_eq!(p.add(i).read(), i as u8);
            }
        }
        A.dealloc(p, Layout::from_size_align(100, 64).unwrap());
    }
}

#[test]
fn zeroed_blocks_are_zero_even_when_reused() {
    // SAFETY: valid layouts; blocks freed with their layouts.
    unsafe {
        for size in [8usize, 100, 3000, 70_000, 600_000] {
            let l = Layout::from_size_align(size, 8).unwrap();
            let dirty: Vec<*mut u8> = (0..64).map(|_| A.alloc(l)).collect();
            for &p in &dirty {
                p.write_bytes(0xff, size);
            }
            for p in dirty {
                A.dealloc(p, l);
            }
            for _ in 0..64 {
                let p = A.alloc_zeroed(l);
                assert!(std::slice::from_raw_parts(p, size).iter().all(|&b| b == 0), "{size} bytes not zeroed");
                A.dealloc(p, l);
            }
        }
    }
}

#[test]
fn try_alloc_reports_typed_errors() {
    let l = Layout::from_size_align(100, 8).unwrap();
    let p = A.try_alloc(l).unwrap();
    // SAFETY: live block of A with its layout.
    unsafe { A.dealloc(p.as_ptr(), l) };
    let bad = Layout::from_size_align(8, 1 << 31).unwrap();
    assert_eq!(A.try_alloc(bad), Err(Error::LayoutTooLarge { size: 8, align: 1 << 31 }));
}

#[test]
fn empty_memory_goes_back_to_the_os() {
    // One thread fills 64 MiB of 16 KiB blocks, then frees them. With the
    // default purge delay (100 ms) the empty pages wait (a burst of frees is
    // often followed by a burst of allocations) and go back to the OS on
    // the first slow path after the delay: here a block of a size class the
    // thread has not used, which takes a fresh page from the arena. (Past
    // eight times the purge threshold they would go at once; 64 MiB is at
    // that bound, not past it.)
    let (returned_before, returned_after) = std::thread::spawn(|| {
        let l = Layout::from_size_align(16 << 10, 8).unwrap();
        let before = A.stats().total().returned;
        // SAFETY: valid layout; every block freed once with it.
        unsafe {
            let blocks: Vec<*mut u8> = (0..4096).map(|_| A.alloc(l)).collect();
            for &b in &blocks {
                b.write_bytes(1, l.size());
            }
            for b in blocks {
                A.dealloc(b, l);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
        let other = Layout::from_size_align(40 << 10, 8).unwrap();
        // SAFETY: a valid layout, freed at once.
        unsafe { A.dealloc(A.alloc(other), other) };
        (before, A.stats().total().returned)
    })
    .join()
    .unwrap();
    let returned = returned_after - returned_before;
    assert!(returned >= 48 << 20, "only {} MiB returned of 64 MiB freed", returned >> 20);
}

#[test]
fn word_sized_objects_get_blocks_of_their_size_aligned_as_asked() {
    // A hardened build's smallest block is 16 bytes (its freed mark is in the
    // second word); under `NUMAWEAVE_CHECK=full` the usable size is what was
    // asked (the rest is red zone).
    let hardened = cfg!(feature = "hardened");
    let full = hardened && std::env::var("NUMAWEAVE_CHECK").is_ok_and(|v| v == "full");
    // SAFETY: valid layouts; blocks freed with their layouts.
    unsafe {
        for size in [8usize, 24, 40, 56, 72, 120] {
            let l = Layout::from_size_align(size, 8).unwrap();
            let p = A.alloc(l);
            assert!(!p.is_null() && (p as usize).is_multiple_of(8));
            let want = if hardened && !full { size.max(16) } else { size };
            assert_eq!(A.usable_size(p), want, "a {size}-byte object takes no more than its size");
            A.dealloc(p, l);
            // The same size aligned to 16: a 16-byte multiple, 16-aligned.
            let l16 = Layout::from_size_align(size, 16).unwrap();
            let q: Vec<*mut u8> = (0..64).map(|_| A.alloc(l16)).collect();
            for &p in &q {
                assert!(!p.is_null() && (p as usize).is_multiple_of(16), "{size} bytes aligned to 16 at {p:p}");
                assert_eq!(A.usable_size(p), if full { size } else { size.next_multiple_of(16) });
            }
            for p in q {
                A.dealloc(p, l16);
            }
        }
    }
}
