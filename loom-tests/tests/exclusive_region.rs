//! The lifetime rule of a thread's own interleave region (a `with_policy`
//! guard's, or a thread's copy of the process default interleave), on the
//! crate's own `RetireCount`: the owner charges the region with a credit of
//! references up front, hands out blocks against it with plain loads and
//! stores, counts its own frees without atomics (it reuses those blocks
//! itself), and at retirement (a full region, the guard dropped, the thread
//! exiting) gives back the unused credit and its frees in one release; other
//! threads free their blocks with a release each. The region is freed
//! exactly once, after every use of every block, whichever thread comes last.
//!
//! Negative controls: an owner that forgets one of its frees at retirement
//! never lets the region go; one that counts a free twice lets it go while
//! another thread still uses a block.
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use numaweave_loom_tests::region_model::Region;

const CREDIT: usize = 8;

/// The owner's side: what it hands out and what it frees, plain counters.
struct Owner {
    credit: usize,
    freed: usize,
}

fn model(miscount: isize) {
    loom::model(move || {
        let r = Arc::new(Region::new());
        // Mapped and charged by the owner before anyone else sees it.
        r.live.reset(CREDIT);
        let mut o = Owner { credit: CREDIT, freed: 0 };
        // Block 0 goes to another thread, which uses and frees it.
        o.credit -= 1;
        let remote = {
            let r = r.clone();
            thread::spawn(move || {
                r.use_block(0);
                r.release();
            })
        };
        // Block 1: the owner's, used, freed onto its reuse list, taken
        // again (another reference from the credit), used and freed again.
        for _ in 0..2 {
            o.credit -= 1;
            r.use_block(1);
            o.freed += 1;
        }
        // Retirement: the unused credit and the owner's frees in one go
        // (the region is not retired yet: this cannot be the last release),
        // then the retire mark.
        let back = (o.credit + o.freed).checked_add_signed(miscount).unwrap();
        if r.live.release_n(back) {
            // Only a miscount gets here: the count reached "retired, none
            // live" early (the retired bit wrapped round).
            r.free();
        }
        if r.live.retire() {
            r.free();
        }
        remote.join().unwrap();
        assert_eq!(r.frees(), 1, "freed other than once");
    });
}

#[test]
fn freed_once_after_every_use() {
    model(0);
}

#[test]
#[should_panic(expected = "freed other than once")]
fn an_owner_that_forgets_a_free_never_lets_go() {
    model(-1);
}

#[test]
#[should_panic]
fn an_owner_that_counts_a_free_twice_frees_under_a_user() {
    model(1);
}
