//! A seqlock over words that readers copy without a lock, other processes
//! among them (the published tables `numaweave numastat PID` reads: the
//! slab layer's chunks, the allocator's classes). One writer at a time
//! (the caller's lock): `seq` made odd, a release fence, the words, `seq`
//! made even with a release store. A reader loads `seq` (acquire), copies
//! every word, fences (acquire) and loads `seq` again: the copy holds if
//! both are the same even value. A copy that passes holds no word of a
//! later write (the fence pairs with the writer's), and every word of the
//! write whose end it saw. `loom-tests/tests/published_table.rs` checks
//! it, with a reader that tests `seq` once as its negative control.

use super::{AtomicU64, Ordering, fence};

/// Runs `f`, which writes words readers of `words[seq]` copy, as one
/// change: `seq` odd around it. The caller is the only writer.
pub fn write<R>(words: &[AtomicU64], seq: usize, f: impl FnOnce() -> R) -> R {
    let seq = &words[seq];
    // (Even: one writer at a time. Any process of the user may write a
    // published file through `/proc/PID/fd`, so an odd value is not
    // asserted against; it is made even.)
    let s = seq.load(Ordering::Relaxed) & !1;
    seq.store(s + 1, Ordering::Relaxed);
    fence(Ordering::Release);
    let r = f();
    seq.store(s + 2, Ordering::Release);
    r
}

/// A copy of every word, if no write was under way or happened while it
/// was made (`words[seq]` the same even value before and after).
pub fn read(words: &[AtomicU64], seq: usize) -> Option<Vec<u64>> {
    let before = words[seq].load(Ordering::Acquire);
    let copy: Vec<u64> = words.iter().map(|w| w.load(Ordering::Relaxed)).collect();
    fence(Ordering::Acquire);
    let after = words[seq].load(Ordering::Relaxed);
    (before == after && before.is_multiple_of(2)).then_some(copy)
}
