//! The allocator's statistics add up: per node, the resident bytes hold at
//! least the free ones and the bytes of live blocks, while threads churn
//! blocks of every size (each written whole: a block never touched is not
//! resident), checked between rounds with the threads stopped, and once
//! more after the pages still in use had their free blocks purged and
//! then emptied. (At
//! 7a2f436 `free_resident` counted free slots whole, touched or not: the
//! README's demo showed more free resident memory than resident memory.)

use std::alloc::{GlobalAlloc, Layout};
use std::sync::{Arc, Barrier};

use numaweave::NumaAlloc;

mod support;
use support::Rng;

#[global_allocator]
static A: NumaAlloc = NumaAlloc::new();

const THREADS: usize = 4;
const ROUNDS: usize = 12;

#[test]
fn resident_memory_holds_the_free_and_the_live_bytes_under_churn() {
    let start = Arc::new(Barrier::new(THREADS + 1));
    let done = Arc::new(Barrier::new(THREADS + 1));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (start, done) = (start.clone(), done.clone());
            std::thread::spawn(move || {
                let mut r = Rng(t as u64 * 7919 + 1);
                let mut live: Vec<(usize, Layout)> = Vec::new();
                for _ in 0..ROUNDS {
                    start.wait();
                    for _ in 0..2000 {
                        let size = match r.below(20) {
                            0 => 300_000 + r.below(700_000) as usize,
                            1..=4 => 1024 + r.below(64 << 10) as usize,
                            _ => 8 + r.below(1000) as usize,
                        };
                        let l = Layout::from_size_align(size, 8).unwrap();
                        // SAFETY: a valid layout; written whole, freed once.
                        let p = unsafe { A.alloc(l) };
                        assert!(!p.is_null());
                        // SAFETY: `size` bytes of the block just allocated.
                        unsafe { p.write_bytes(0x5a, size) };
                        live.push((p as usize, l));
                    }
                    // Half freed, in random order (a page's blocks leave
                    // it holding others: free slots and partly used ones).
                    for _ in 0..live.len() / 2 {
                        let (p, l) = live.swap_remove(r.below(live.len() as u64) as usize);
                        // SAFETY: allocated above with `l`, freed once.
                        unsafe { A.dealloc(p as *mut u8, l) };
                    }
                    done.wait();
                }
                // Most of the rest freed, what the pages still in use hold
                // free given back (their free blocks purged: partly
                // resident pages), then the rest freed: those pages empty
                // into free slots that are resident only in part.
                start.wait();
                for _ in 0..live.len() * 3 / 4 {
                    let (p, l) = live.swap_remove(r.below(live.len() as u64) as usize);
                    // SAFETY: as above.
                    unsafe { A.dealloc(p as *mut u8, l) };
                }
                A.trim();
                for (p, l) in live {
                    // SAFETY: as above.
                    unsafe { A.dealloc(p as *mut u8, l) };
                }
                done.wait();
            })
        })
        .collect();
    let mut checked = 0;
    for round in 0..=ROUNDS {
        start.wait();
        done.wait();
        let s = A.stats();
        for n in s.nodes.iter() {
            let st = &s.per_node[n];
            assert!(
                st.resident >= st.free_resident + st.in_use,
                "round {round}, node {n}: resident {} < free resident {} + in use {}\n{s}",
                st.resident,
                st.free_resident,
                st.in_use
            );
            assert!(st.committed >= st.in_use, "round {round}, node {n}: committed below in use\n{s}");
            checked += 1;
        }
    }
    for w in workers {
        w.join().unwrap();
    }
    println!("{checked} node snapshots add up\n{}", A.stats());
}
