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
        // SAFETY: a valid layout; the block is written whole, freed once.
        let p = unsafe { A.alloc(l) };
        assert!(!p.is_null());
        // SAFETY: `size` bytes of the block just allocated.
        unsafe { p.write_bytes(0x5a, size) };
        v.push((p as usize, l));
        got += size;
    }
    v
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
