//! The memory lifecycle as a program sees it, with `NumaAlloc` as the global
//! allocator: trim gives every free page back, an exited thread's pages are
//! reused or given back, and memory comes back without a call while a
//! thread goes on making a few calls a second. Each test measures its
//! process's resident memory, so each runs alone in a child process of its
//! own (`support::rerun`).

mod support;

use std::alloc::{GlobalAlloc, Layout};
use std::time::{Duration, Instant};

use numaweave::NumaAlloc;
use support::{Rng, in_child, rerun};

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

const MIB: usize = 1 << 20;

/// The process's resident bytes (`/proc/self/statm`).
fn resident() -> usize {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = s.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * numaweave::os::page_size()
}

/// Blocks of 16 B to 64 KiB (log-uniform), `bytes` of them, written.
fn burst(rng: &mut Rng, bytes: usize) -> Vec<(usize, Layout)> {
    let mut v = Vec::new();
    let mut got = 0;
    while got < bytes {
        let size = 16usize << rng.below(13);
        let size = size + rng.below(size as u64) as usize;
        let l = Layout::from_size_align(size, 8).unwrap();
        v.push((written(l, 0x5a), l));
        got += size;
    }
    v
}

/// A block of layout `l`, every byte of it `byte` (freed by the caller).
fn written(l: Layout, byte: u8) -> usize {
    // SAFETY: a valid layout; the block written whole.
    unsafe {
        let p = A.alloc(l);
        assert!(!p.is_null());
        p.write_bytes(byte, l.size());
        p as usize
    }
}

fn free_all(blocks: Vec<(usize, Layout)>) {
    for (p, l) in blocks {
        // SAFETY: allocated with `l` by `burst`, freed once.
        unsafe { A.dealloc(p as *mut u8, l) };
    }
}

/// Stats summed over the nodes.
fn total() -> numaweave::stats::NodeStats {
    A.stats().total()
}

#[test]
fn trim_gives_back_every_free_page() {
    if !in_child() {
        rerun("trim_gives_back_every_free_page", &[], "trimmed to");
        return;
    }
    let base = resident();
    // Four threads allocate 32 MiB each and exit; main frees it all (remote
    // frees into exited threads' pages), keeping nothing.
    let handles: Vec<_> = (0..4).map(|t| std::thread::spawn(move || burst(&mut Rng(t + 1), 32 * MIB))).collect();
    let blocks: Vec<_> = handles.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let peak = resident() - base;
    free_all(blocks);
    let returned = A.trim();
    let t = total();
    let held = resident().saturating_sub(base);
    println!("{}", A.stats());
    println!("trimmed to {} KiB from {} MiB ({} MiB back)", held >> 10, peak / MIB, returned / MIB as u64);
    assert_eq!(t.free_resident, 0, "free pages left committed");
    assert_eq!(t.orphaned, 0, "exited threads' heaps hold pages");
    assert!(held <= 4 * MIB, "{} KiB resident above the start after trim", held >> 10);
}

#[test]
fn an_exited_threads_pages_are_reused_or_given_back() {
    if !in_child() {
        rerun("an_exited_threads_pages_are_reused_or_given_back", &[], "pages reused");
        return;
    }
    // A thread allocates and exits, leaving its blocks to main.
    let blocks = std::thread::spawn(|| burst(&mut Rng(7), 16 * MIB)).join().unwrap();
    free_all(blocks);
    // The exited thread's heap holds no page once its blocks are freed: the
    // frees into it had the lifecycle collect them.
    let deadline = Instant::now() + Duration::from_secs(10);
    while total().orphaned != 0 {
        assert!(Instant::now() < deadline, "an exited thread's heap still holds {} bytes", total().orphaned);
        std::thread::sleep(Duration::from_millis(10));
        // (A few calls, as a program that goes on makes.)
        drop(std::hint::black_box(Box::new([0u8; 64])));
    }
    // A new thread takes that memory again: no address space is added for
    // the same blocks (free slots and segments first, not fresh mappings).
    let reserved = total().reserved;
    let again = std::thread::spawn(|| burst(&mut Rng(7), 16 * MIB)).join().unwrap();
    let grown = total().reserved - reserved;
    println!("pages reused: {} KiB of address space added for the second thread's 16 MiB", grown >> 10);
    assert!(grown <= 4 * MIB as u64, "{} KiB of address space added", grown >> 10);
    free_all(again);
}

#[test]
fn memory_comes_back_without_a_call() {
    if !in_child() {
        rerun("memory_comes_back_without_a_call", &[], "came back");
        return;
    }
    let base = resident();
    // Below what an arena gives back at once (8 times the 8 MiB purge
    // threshold): what is freed waits out the purge delay.
    let blocks = burst(&mut Rng(3), 40 * MIB);
    let peak = resident() - base;
    free_all(blocks);
    // One small allocation and free every 10 ms, served by the fast path:
    // the lifecycle still reaches the purge when it is due.
    let start = Instant::now();
    loop {
        let held = resident().saturating_sub(base);
        if held <= 16 * MIB {
            println!("{} MiB came back in {} ms ({} KiB left)", peak / MIB, start.elapsed().as_millis(), held >> 10);
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{} MiB still resident after 10 s:\n{}",
            held / MIB,
            A.stats()
        );
        drop(std::hint::black_box(Box::new([1u8; 64])));
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Exited threads' kept free blocks come back however their exits fall:
/// two threads exit 40 ms apart, each leaving its pages half in use (the
/// live half handed to main, never freed) and the other half kept for the
/// next thread of the node. The tick that purges the first heap's blocks
/// when they are due must leave the second's due time noted. (Before, it
/// cleared it: the second heap's blocks stayed resident until a trim,
/// another exit or a remote free into its pages.) Not in hardened builds,
/// which keep freed blocks' contents (the poison a write after free is
/// found by) and so purge none.
#[cfg(not(feature = "hardened"))]
#[test]
fn every_exited_threads_kept_blocks_come_back() {
    if !in_child() {
        rerun("every_exited_threads_kept_blocks_come_back", &[], "kept blocks");
        return;
    }
    /// 32 KiB blocks, two to a page: every other one freed leaves every
    /// page in use with one free block, whose pages past its first go
    /// back to the OS when the heap's kept blocks are purged.
    fn half_kept() -> Vec<usize> {
        let l = Layout::from_size_align(32 << 10, 8).unwrap();
        let all: Vec<usize> = (0..256).map(|_| written(l, 0x3c)).collect();
        let (even, odd): (Vec<_>, Vec<_>) = all.iter().enumerate().partition(|(i, _)| i % 2 == 0);
        for (_, &p) in even {
            // SAFETY: blocks allocated above, freed once (the odd ones by
            // main).
            unsafe { A.dealloc(p as *mut u8, l) };
        }
        odd.into_iter().map(|(_, &p)| p).collect()
    }
    let base = resident();
    // Both alive at once (two heaps: a thread that starts after another
    // exited adopts its heap), the second exiting 40 ms after the first.
    let go = std::sync::Arc::new(std::sync::Barrier::new(3));
    let spawn = |wait_ms| {
        let go = go.clone();
        std::thread::spawn(move || {
            let live = half_kept();
            go.wait();
            std::thread::sleep(Duration::from_millis(wait_ms));
            live
        })
    };
    let (a, b) = (spawn(0), spawn(40));
    go.wait();
    let first = a.join().unwrap();
    let second = b.join().unwrap();
    let held = resident() - base;
    let start = Instant::now();
    // 2 × 4 MiB kept: at least 6 of them back.
    loop {
        let now = resident().saturating_sub(base);
        if now + 6 * MIB <= held {
            println!(
                "kept blocks: {} of {} KiB back in {} ms",
                (held - now) >> 10,
                held >> 10,
                start.elapsed().as_millis()
            );
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{} KiB of {} KiB still resident after 5 s:\n{}",
            now >> 10,
            held >> 10,
            A.stats()
        );
        drop(std::hint::black_box(Box::new([1u8; 64])));
        std::thread::sleep(Duration::from_millis(5));
    }
    let l = Layout::from_size_align(32 << 10, 8).unwrap();
    for p in first.into_iter().chain(second) {
        // SAFETY: the live halves, freed once.
        unsafe { A.dealloc(p as *mut u8, l) };
    }
}

/// Pages left partly used purge their free blocks (link pages too, for
/// blocks of 1 KiB and more) while other threads free into them and the
/// owners allocate from them again: every block keeps what was written
/// into it until it is freed (a purge of a live block's memory, or a block
/// handed out twice, breaks a tag), and the purges take memory back.
#[cfg(not(feature = "hardened"))]
#[test]
fn purged_pages_in_use_serve_again_under_remote_frees() {
    use std::sync::mpsc;
    if !in_child() {
        // (A purge delay of 10 s: the exited threads' free blocks wait for
        // the trim, however long the main thread takes to get to it.)
        rerun(
            "purged_pages_in_use_serve_again_under_remote_frees",
            &[("NUMAWEAVE_PURGE_DELAY", Some("10s"))],
            "purged pages served",
        );
        return;
    }
    const THREADS: usize = 4;
    /// A block of `words` words, each its tag.
    fn make(tag: u64, words: usize) -> (usize, usize) {
        let l = Layout::array::<u64>(words).unwrap();
        // SAFETY: a valid layout; the block written whole.
        unsafe {
            let p = A.alloc(l).cast::<u64>();
            assert!(!p.is_null());
            for i in 0..words {
                p.add(i).write(tag);
            }
            (p as usize, words)
        }
    }
    fn check_and_free((p, words): (usize, usize)) {
        // SAFETY: a block `make` wrote, freed once, here.
        unsafe {
            let p = p as *mut u64;
            let tag = p.read();
            for i in 0..words {
                assert_eq!(p.add(i).read(), tag, "word {i} of {words} of a live block changed");
            }
            A.dealloc(p.cast(), Layout::array::<u64>(words).unwrap());
        }
    }
    let mut to: Vec<mpsc::Sender<Vec<(usize, usize)>>> = Vec::new();
    let mut from = Vec::new();
    for _ in 0..THREADS {
        let (s, r) = mpsc::channel();
        to.push(s);
        from.push(r);
    }
    let stop = Instant::now() + Duration::from_millis(1500);
    // (The workers exit together: one still trimming would purge the pages
    // of one that exited before the main thread looks at them.)
    let done = std::sync::Arc::new(std::sync::Barrier::new(THREADS));
    let workers: Vec<_> = from
        .into_iter()
        .enumerate()
        .map(|(t, inbox)| {
            let next = to[(t + 1) % THREADS].clone();
            let done = done.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(t as u64 + 1);
                let mut kept: Vec<(usize, usize)> = Vec::new();
                let mut round = 0u64;
                while Instant::now() < stop {
                    // 1-16 KiB blocks: pages of at most 64 blocks.
                    // (Every other one of 4, 8 or 12 KiB: blocks of whole OS pages.)
                    let mut batch: Vec<(usize, usize)> = (0..128)
                        .map(|i| {
                            let words = if i % 2 == 0 { 512 * (1 + rng.below(3)) } else { 128 + rng.below(1920) };
                            make((t as u64) << 48 | round << 16 | i, words as usize)
                        })
                        .collect();
                    // A quarter to the next thread (remote frees), half freed here at
                    // random, a quarter kept a while: pages stay partly used.
                    let theirs: Vec<_> = batch.drain(..32).collect();
                    let _ = next.send(theirs);
                    for b in batch.drain(..) {
                        if rng.below(3) == 0 { kept.push(b) } else { check_and_free(b) }
                    }
                    while kept.len() > 512 {
                        let i = rng.below(kept.len() as u64) as usize;
                        check_and_free(kept.swap_remove(i));
                    }
                    while let Ok(v) = inbox.try_recv() {
                        v.into_iter().for_each(check_and_free);
                    }
                    if round % 16 == t as u64 {
                        numaweave::trim();
                    }
                    round += 1;
                }
                // Half of what it kept freed after its last trim: pages in
                // use with free blocks for the main thread's trim, however
                // late in the loop that last trim came.
                let mut i = 0;
                kept.retain(|&b| {
                    i += 1;
                    if i % 2 == 0 {
                        check_and_free(b);
                    }
                    i % 2 != 0
                });
                drop(next);
                done.wait();
                (kept, inbox)
            })
        })
        .collect();
    drop(to);
    let ends: Vec<_> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let mut kept = Vec::new();
    for (k, inbox) in ends {
        while let Ok(v) = inbox.try_recv() {
            v.into_iter().for_each(check_and_free);
        }
        kept.extend(k);
    }
    // The exited threads' pages hold their kept blocks among free ones: a
    // trim purges the free ones, and a free block of whole OS pages strands
    // no memory after it (before block purges, a trim left each resident).
    let before = stranded_in(4096, 12288);
    numaweave::trim();
    let after = stranded_in(4096, 12288);
    assert!(before >= MIB as u64, "only {} KiB stranded", before >> 10);
    assert!(after < before / 16, "a trim left {} of {} KiB stranded", after >> 10, before >> 10);
    kept.into_iter().for_each(check_and_free);
    println!("purged pages served again: {} KiB stranded, {} KiB after a trim", before >> 10, after >> 10);
}

/// Bytes stranded in pages in use of the classes from `min` to `max` bytes
/// whose blocks are whole OS pages, on every node.
#[cfg(not(feature = "hardened"))]
fn stranded_in(min: u64, max: u64) -> u64 {
    let s = A.stats();
    let classes = s.nodes.iter().flat_map(|n| A.class_usage(n));
    let os = numaweave::os::page_size() as u64;
    let whole =
        |u: &numaweave::stats::ClassUsage| (min..=max).contains(&u.block_size) && u.block_size.is_multiple_of(os);
    classes.filter(whole).map(|u| u.stranded).sum()
}

/// A thread that adopts an exited thread's heap and grows by the purge
/// threshold in classes of its own has the free blocks of the classes it
/// never touched purged then, not a purge delay later: an exited thread's
/// 4 KiB blocks, three in four freed, strand no memory once the next
/// thread has taken 16 MiB of 20 KiB blocks (the delay is 10 s here, so
/// only the growth can have purged them).
#[cfg(not(feature = "hardened"))]
#[test]
fn growth_purges_the_classes_an_adopted_heap_left_untouched() {
    if !in_child() {
        rerun(
            "growth_purges_the_classes_an_adopted_heap_left_untouched",
            &[("NUMAWEAVE_PURGE_DELAY", Some("10s")), ("NUMAWEAVE_CPU_CACHE", None)],
            "untouched classes purged",
        );
        return;
    }
    let small = Layout::from_size_align(4096, 8).unwrap();
    let stranded = || stranded_in(4096, 4096);
    let live: Vec<usize> = std::thread::spawn(move || {
        let all: Vec<usize> = (0..4096).map(|_| written(small, 0x6b)).collect();
        let (keep, free): (Vec<_>, Vec<_>) = all.into_iter().enumerate().partition(|(i, _)| i % 4 == 0);
        for (_, p) in free {
            // SAFETY: allocated above, freed once.
            unsafe { A.dealloc(p as *mut u8, small) };
        }
        keep.into_iter().map(|(_, p)| p).collect()
    })
    .join()
    .unwrap();
    let before = stranded();
    assert!(before >= 8 << 20, "the exited thread's pages strand {} KiB", before >> 10);
    let big = Layout::from_size_align(20 << 10, 8).unwrap();
    let grown: Vec<usize> = std::thread::spawn(move || (0..820).map(|_| written(big, 0x2d)).collect()).join().unwrap();
    let after = stranded();
    assert!(after < 1 << 20, "still {} KiB stranded of {} KiB", after >> 10, before >> 10);
    for p in live {
        // SAFETY: kept above, untouched since.
        unsafe {
            assert!(core::slice::from_raw_parts(p as *const u8, 4096).iter().all(|&b| b == 0x6b));
            A.dealloc(p as *mut u8, small);
        }
    }
    for p in grown {
        // SAFETY: allocated above, freed once.
        unsafe { A.dealloc(p as *mut u8, big) };
    }
    println!("untouched classes purged: {} KiB stranded, then {} KiB", before >> 10, after >> 10);
}
