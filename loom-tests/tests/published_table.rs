//! The published slab table's seqlock (`slab::published`): the writer
//! changes an entry under `seq` (odd, a release fence, the entry's words,
//! even with a release store); a reader copies every word, fences, and
//! reads `seq` again, and accepts the copy only if both reads are the same
//! even value. Modelled on a table of one slot, with the crate's own
//! `Words` and `read_words` (the file's reader does the same with two
//! reads of the file).
//!
//! Checked: a copy the reader accepts shows the slot empty or holding one
//! whole entry, never words of two entries (a torn entry).
//!
//! Negative control: a reader that tests `seq` once, before its copy (as
//! the table's parser once did), accepts a torn entry.
#![cfg(loom)]

use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::thread;
use numaweave::slab::published::{BadTable, Table, Words, read_words, table_words};
use numaweave_loom_tests::explore;

fn table() -> Arc<Vec<AtomicU64>> {
    let w: Vec<AtomicU64> = (0..table_words(1)).map(|_| AtomicU64::new(0)).collect();
    Words(&w).init(7);
    Arc::new(w)
}

/// The entries the writer lists, one after the other, in slot 0.
const A: (usize, usize, Option<usize>, &str) = (0x1000_0000, 0x1_0000, Some(1), "alpha");
const B: (usize, usize, Option<usize>, &str) = (0x2000_0000, 0x2_0000, None, "beta");

fn whole(t: &Table) {
    assert!(t.chunks.len() <= 1);
    if let Some(c) = t.chunks.first() {
        let ok = [A, B].iter().any(|&(s, l, node, n)| {
            c.start == s && c.len == l && c.node() == node && c.name() == n && c.page_size() == 4096
        });
        assert!(ok, "a torn entry accepted: {c:?}");
    }
}

fn model(name: &str, read: fn(&[AtomicU64]) -> Result<Table, BadTable>) {
    explore(name, Some(2), move || {
        let w = table();
        let writer = {
            let w = w.clone();
            thread::spawn(move || {
                let t = Words(&w);
                t.list(0, A.0, A.1, 4096, A.2, A.3);
                t.clear(0);
                t.list(0, B.0, B.1, 4096, B.2, B.3);
            })
        };
        if let Ok(t) = read(&w) {
            whole(&t);
        }
        writer.join().unwrap();
        let t = read(&w).expect("a quiet table reads");
        assert_eq!(t.chunks.len(), 1);
        whole(&t);
    });
}

#[test]
fn a_reader_never_accepts_a_torn_entry() {
    model("published table: a writer and a reader", read_words);
}

/// The planted bug: `seq` tested once, before the copy.
fn read_testing_seq_once(words: &[AtomicU64]) -> Result<Table, BadTable> {
    let seq = words[2].load(Ordering::Acquire);
    if seq % 2 == 1 {
        return Err(BadTable::Changing);
    }
    let copy: Vec<AtomicU64> = words.iter().map(|x| AtomicU64::new(x.load(Ordering::Relaxed))).collect();
    read_words(&copy)
}

#[test]
#[should_panic(expected = "a torn entry accepted")]
fn planted_reader_that_tests_seq_once_accepts_a_torn_entry() {
    model("published table: planted reader", read_testing_seq_once);
}
