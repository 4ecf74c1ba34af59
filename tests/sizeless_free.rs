//! A free without a size is exact for every kind of block, under every
//! policy: a randomized differential workload (1 B – 1 MiB, every byte
//! checked before it is freed, realloc, blocks handed to other threads) frees
//! each block with the size it asked for, with its usable size, or with a
//! size in between, as C's `free(p)` (which knows no size) has to. Run under
//! `local`, five interleaves and three lists of rules by size on `fake:2` in
//! per-node mode, each in a child process (the allocator reads
//! `NUMAWEAVE_POLICY` once).

use std::alloc::{GlobalAlloc, Layout};
use std::sync::mpsc;

use numaweave::NumaAlloc;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

const POLICIES: [&str; 9] = [
    "local",
    "interleave:0-1:count=1",
    "interleave:0-1:count=8",
    "interleave:0-1:bytes=64K",
    "interleave:0-1:bytes=2M",
    "interleave:0-1:bytes=256K:weights=3,1",
    // Rules by size: small local, big interleaved (by class, above and
    // below a page), and a three-tier list with tier:lower.
    "<64K:local;>=64K:interleave:0-1:bytes=256K",
    "<1K:bind:1;>=1K:interleave:0-1:count=4:weights=auto",
    "<4K:local;<512K:tier:lower;>=512K:interleave:0-1:bytes=1M",
];

mod support;
use support::Rng;

/// Log-uniform over 1 B – 1 MiB.
fn size_of_next(r: &mut Rng) -> usize {
    let k = r.next() % 21;
    let s = (1usize << k) + (r.next() as usize & ((1 << k) - 1));
    s.min(1 << 20)
}

/// A live block: where, its layout, and the seed of its contents.
#[derive(Clone, Copy)]
struct Live {
    p: usize,
    layout: Layout,
    seed: u64,
}

/// The contents of the word at `i` (and of the bytes of a tail word).
fn word(seed: u64, i: usize) -> u64 {
    seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

fn fill(b: &Live) {
    let (p, len) = (b.p as *mut u8, b.layout.size());
    // SAFETY: a live block of `len` bytes, at least 8-aligned.
    unsafe {
        let words = p.cast::<u64>();
        for i in 0..len / 8 {
            words.add(i).write(word(b.seed, i));
        }
        let tail = word(b.seed, len / 8).to_le_bytes();
        for i in len / 8 * 8..len {
            p.add(i).write(tail[i % 8]);
        }
    }
}

fn check(b: &Live, len: usize, what: &str) {
    let p = b.p as *const u8;
    // SAFETY: a live block of at least `len` bytes, at least 8-aligned.
    unsafe {
        let words = p.cast::<u64>();
        for i in 0..len / 8 {
            assert_eq!(words.add(i).read(), word(b.seed, i), "{what}: word {i} of a {len}-byte block changed");
        }
        let tail = word(b.seed, len / 8).to_le_bytes();
        for i in len / 8 * 8..len {
            assert_eq!(p.add(i).read(), tail[i % 8], "{what}: byte {i} of a {len}-byte block changed");
        }
    }
}

/// Frees `b` with its size, its usable size, or one in between.
fn free(b: Live, rng: &mut Rng) {
    check(&b, b.layout.size(), "before free");
    // SAFETY: a live block of `A`.
    let usable = unsafe { A.usable_size(b.p as *const u8) };
    assert!(usable >= b.layout.size(), "usable size {usable} under the {} asked for", b.layout.size());
    let size = match rng.next() % 3 {
        0 => b.layout.size(),
        1 => usable,
        _ => b.layout.size() + (rng.next() as usize % (usable - b.layout.size() + 1)),
    };
    // SAFETY: a live block; any size from the one asked for to the usable one.
    unsafe { A.dealloc(b.p as *mut u8, Layout::from_size_align(size, b.layout.align()).unwrap()) };
}

fn worker(t: usize, ops: usize, tx: mpsc::Sender<Vec<Live>>, rx: mpsc::Receiver<Vec<Live>>) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((t as u64 + 1) * 0x1234_5678));
    let mut live: Vec<Live> = Vec::with_capacity(600);
    let mut out: Vec<Live> = Vec::new();
    for _ in 0..ops {
        let align = [8, 8, 8, 64, 4096][rng.next() as usize % 5];
        let layout = Layout::from_size_align(size_of_next(&mut rng), align).unwrap();
        // SAFETY: a valid layout.
        let p = unsafe { A.alloc(layout) };
        assert!(!p.is_null());
        assert_eq!(p as usize % align, 0, "misaligned");
        let b = Live { p: p as usize, layout, seed: rng.next() };
        fill(&b);
        live.push(b);
        if live.len() > 512 {
            let i = rng.next() as usize % live.len();
            let b = live.swap_remove(i);
            match rng.next() % 4 {
                0 => out.push(b),
                1 => {
                    // Realloc to another size: the common prefix survives.
                    let new = size_of_next(&mut rng);
                    // SAFETY: a live block of `b.layout`.
                    let q = unsafe { A.realloc(b.p as *mut u8, b.layout, new) };
                    assert!(!q.is_null());
                    let moved =
                        Live { p: q as usize, layout: Layout::from_size_align(new, b.layout.align()).unwrap(), ..b };
                    check(&moved, new.min(b.layout.size()), "after realloc");
                    let moved = Live { seed: rng.next(), ..moved };
                    fill(&moved);
                    live.push(moved);
                }
                _ => free(b, &mut rng),
            }
        }
        if out.len() == 32 {
            tx.send(std::mem::take(&mut out)).unwrap();
        }
        while let Ok(theirs) = rx.try_recv() {
            theirs.into_iter().for_each(|b| free(b, &mut rng));
        }
    }
    tx.send(out).unwrap();
    drop(tx);
    live.into_iter().for_each(|b| free(b, &mut rng));
    for theirs in rx {
        theirs.into_iter().for_each(|b| free(b, &mut rng));
    }
}

#[test]
fn freeing_with_any_size_up_to_the_usable_one_is_exact_under_every_policy() {
    if !support::in_child() {
        for policy in POLICIES {
            let env = [
                ("NUMAWEAVE_TOPOLOGY", Some("fake:2")),
                ("NUMAWEAVE_MODE", Some("per-node")),
                ("NUMAWEAVE_POLICY", Some(policy)),
            ];
            support::rerun(
                "freeing_with_any_size_up_to_the_usable_one_is_exact_under_every_policy",
                &env,
                "workload checked",
            );
        }
        return;
    }
    const THREADS: usize = 4;
    let before = A.stats().total();
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| mpsc::channel::<Vec<Live>>()).unzip();
    let mut rxs: Vec<_> = rxs.into_iter().map(Some).collect();
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let tx = txs[(t + 1) % THREADS].clone();
            let rx = rxs[t].take().unwrap();
            std::thread::spawn(move || worker(t, 6_000, tx, rx))
        })
        .collect();
    drop(txs);
    workers.into_iter().for_each(|w| w.join().unwrap());
    let after = A.stats().total();
    // Every block freed and the threads gone: their regions go back.
    assert_eq!(after.regions, before.regions, "regions outlived their blocks");
    println!(
        "{}: workload checked ({} allocations)",
        std::env::var("NUMAWEAVE_POLICY").unwrap(),
        after.allocs - before.allocs
    );
}
