//! The published slab table's reader (`slab::published::parse`), as
//! `numaweave numastat PID` runs it on another process's file: whatever
//! the bytes, it never panics, never allocates more than the bytes it was
//! given, and every chunk it accepts is one a query can walk (page-aligned,
//! bounded, not wrapping). A property test over random tables and random
//! damage to real ones (the crate's own generator: seeds are printed, and
//! `PARSE_SEED=N` reruns one).

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use numaweave::NumaAlloc;
use numaweave::slab::published::{self, BadTable, FILE_LEN, ReadError, SLOTS};

mod support;
use support::Rng;

/// The allocator, counting the bytes live while `COUNTING` is set on the
/// calling thread (the test harness runs other tests on other threads).
struct Counting(NumaAlloc);

thread_local! {
    // (Const, without a destructor: the allocator may read it at any time.)
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// Held by the tests that count (the counters are the process's).
static COUNTERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

// SAFETY: every call is passed to `NumaAlloc` unchanged; the counters are
// bookkeeping beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if COUNTING.get() {
            let now = LIVE.fetch_add(l.size(), Ordering::Relaxed).wrapping_add(l.size());
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        // SAFETY: the caller's layout, passed on.
        unsafe { self.0.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if COUNTING.get() {
            LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { self.0.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting(NumaAlloc::new());

const SEQ: usize = 2;

/// `f`'s result, and the most bytes it had live at once (its thread's
/// allocations counted; the caller holds `COUNTERS`).
fn counted<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    COUNTING.set(true);
    let r = f();
    COUNTING.set(false);
    (r, PEAK.load(Ordering::Relaxed) - before)
}

fn put(t: &mut [u8], word: usize, v: u64) {
    t[word * 8..word * 8 + 8].copy_from_slice(&v.to_le_bytes());
}

fn get(t: &[u8], word: usize) -> u64 {
    u64::from_le_bytes(t[word * 8..word * 8 + 8].try_into().unwrap())
}

/// A table as a writer makes it: `n` chunks of a few names; of the first
/// version (no node in entries) or the second (a node in word 2's upper
/// half, plus one).
fn valid(r: &mut Rng, n: usize) -> Vec<u8> {
    let mut t = vec![0u8; FILE_LEN];
    let v2 = r.below(2) == 0;
    t[..8].copy_from_slice(if v2 { b"NWSLABS2" } else { b"NWSLABS1" });
    put(&mut t, 1, 4242);
    put(&mut t, 4, u64::MAX);
    for i in 0..n {
        let slot = r.below(SLOTS as u64) as usize;
        let e = 8 + slot * 8;
        let page = [4096u64, 2 << 20, 1 << 30][r.below(3) as usize];
        put(&mut t, e, (r.below(1 << 20) + 1) * page);
        put(&mut t, e + 1, (r.below(64) + 1) * page);
        let node = if v2 { r.below(5) << 32 } else { 0 };
        put(&mut t, e + 2, page | node);
        let name = format!("cache{}", i % 7);
        t[(e + 3) * 8..(e + 3) * 8 + name.len()].copy_from_slice(name.as_bytes());
    }
    t
}

/// Some damage: words set at random (lengths, starts, page sizes, names),
/// bytes flipped, the file cut or lengthened.
fn damage(r: &mut Rng, t: &mut Vec<u8>) {
    for _ in 0..r.below(8) {
        match r.below(6) {
            0 => {
                let w = 8 + r.below((SLOTS * 8) as u64) as usize;
                put(t, w, r.next());
            }
            1 => {
                let e = 8 + r.below(SLOTS as u64) as usize * 8;
                put(t, e + 1, [u64::MAX, 1 << 62, 4095, r.next()][r.below(4) as usize]);
            }
            2 => {
                let e = 8 + r.below(SLOTS as u64) as usize * 8;
                put(t, e, u64::MAX - 4095);
                put(t, e + 1, 8192);
                put(t, e + 2, 4096);
            }
            3 => {
                let i = r.below(t.len() as u64) as usize;
                t[i] ^= 1 << r.below(8);
            }
            4 => {
                let cut = r.below(t.len() as u64 + 1) as usize;
                t.truncate(cut);
                return;
            }
            _ => t.extend((0..r.below(100)).map(|_| r.next() as u8)),
        }
    }
}

#[test]
fn any_bytes_parse_to_a_bounded_table_or_a_typed_error() {
    let _g = COUNTERS.lock().unwrap_or_else(|e| e.into_inner());
    let seed = std::env::var("PARSE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x9e37_79b9_7f4a_7c15);
    println!("PARSE_SEED={seed}");
    let mut r = Rng(seed);
    let (mut ok, mut bad) = (0, 0);
    for round in 0..600 {
        let n = r.below(if round % 10 == 0 { 4096 } else { 64 }) as usize;
        let mut t = valid(&mut r, n);
        if round % 3 != 0 {
            damage(&mut r, &mut t);
        }
        let seq = if t.len() > 24 { get(&t, SEQ) } else { 0 };
        let (got, peak) = counted(|| published::parse(&t, seq));
        assert!(peak <= t.len(), "round {round}: {peak} bytes allocated for a file of {}", t.len());
        match got {
            Ok(table) => {
                ok += 1;
                for c in &table.chunks {
                    let page = c.page_size();
                    assert!(page.is_power_of_two() && (4096..=1 << 30).contains(&page));
                    assert!(c.start.is_multiple_of(page) && c.len.is_multiple_of(page) && c.len > 0);
                    assert!(c.len as u64 <= published::MAX_CHUNK && c.start.checked_add(c.len).is_some());
                    assert!(c.name().len() <= 40);
                }
            }
            Err(BadTable::Size { len }) => {
                assert_ne!(len, FILE_LEN);
                bad += 1;
            }
            Err(_) => bad += 1,
        }
    }
    println!("{ok} tables accepted, {bad} refused");
    assert!(ok > 100 && bad > 100, "the damage is not varied enough: {ok} accepted, {bad} refused");
}

#[test]
fn a_table_read_while_it_changes_is_refused() {
    let mut r = Rng(7);
    let mut t = valid(&mut r, 3);
    put(&mut t, SEQ, 5);
    assert_eq!(published::parse(&t, 5), Err(BadTable::Changing), "odd seq");
    put(&mut t, SEQ, 6);
    assert_eq!(published::parse(&t, 8), Err(BadTable::Changing), "seq moved on during the read");
    assert!(published::parse(&t, 6).is_ok());
}

/// `read_file` reads the file again from its start after a changing table
/// (a file whose `seq` stays odd is refused as changing, every read of it
/// whole). Before, the second read began at the end the first left the
/// file's offset at, read nothing, and named the table too short.
#[test]
fn a_file_read_again_is_read_from_its_start() {
    let mut r = Rng(11);
    let mut t = valid(&mut r, 2);
    let path = std::env::temp_dir().join(format!("numaweave-published-{}", std::process::id()));
    put(&mut t, SEQ, 4);
    std::fs::write(&path, &t).unwrap();
    assert_eq!(published::read_file(&path).map(|t| t.chunks.len()).ok(), Some(2));
    put(&mut t, SEQ, 5);
    std::fs::write(&path, &t).unwrap();
    let got = published::read_file(&path);
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(got, Err(ReadError::Bad(BadTable::Changing))), "{got:?}");
}

/// The class table's reader (`stats::class_table::parse`), the same way:
/// real tables (written by the crate's own writer) and random damage to
/// them; whatever the bytes, a bounded table whose every row is one a
/// class's pages can have, or a typed error.
#[test]
fn any_bytes_parse_to_a_sound_class_table_or_a_typed_error() {
    use numaweave::stats::ClassUsage;
    use numaweave::stats::class_table::{self as ct, BadClassTable, MAX_ROWS, Row, Words};
    let _g = COUNTERS.lock().unwrap_or_else(|e| e.into_inner());
    let seed = std::env::var("PARSE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_c1a5);
    println!("PARSE_SEED={seed}");
    let mut r = Rng(seed);
    let (mut ok, mut bad) = (0, 0);
    for round in 0..300 {
        let words: Vec<std::sync::atomic::AtomicU64> =
            (0..ct::FILE_LEN / 8).map(|_| std::sync::atomic::AtomicU64::new(0)).collect();
        Words(&words).init(4242);
        let rows = r.below(if round % 10 == 0 { MAX_ROWS as u64 } else { 40 }) as usize;
        let rows: Vec<Row> = (0..rows)
            .map(|i| {
                let bs = 16 * (r.below(1000) + 1);
                let pages = r.below(100) + 1;
                let bytes = pages * 65536;
                let in_use = r.below(bytes / 2);
                let usage =
                    ClassUsage { block_size: bs, pages, bytes, in_use, uncollected: 0, stranded: r.below(bytes / 2) };
                Row { node: i % 64, usage }
            })
            .collect();
        Words(&words).publish(round, &rows);
        let mut t: Vec<u8> = words.iter().flat_map(|w| w.load(Ordering::Relaxed).to_le_bytes()).collect();
        if round % 3 != 0 {
            // Whole-table damage: words set at random (the row count among
            // them), bits flipped; last, maybe, the file cut or lengthened.
            for _ in 0..r.below(6) + 1 {
                match r.below(3) {
                    0 => {
                        let w = r.below((t.len() / 8) as u64) as usize;
                        put(&mut t, w, [u64::MAX, 0, 1 << 40, 1 << 50, r.next()][r.below(5) as usize]);
                    }
                    1 => put(&mut t, 4, r.below(2 * MAX_ROWS as u64)),
                    _ => {
                        let i = r.below(t.len() as u64) as usize;
                        t[i] ^= 1 << r.below(8);
                    }
                }
            }
            match r.below(4) {
                0 => t.truncate(r.below(t.len() as u64 + 1) as usize),
                1 => t.extend((0..r.below(100)).map(|_| r.next() as u8)),
                _ => {}
            }
        }
        let seq = if t.len() > 24 { get(&t, SEQ) } else { 0 };
        let (got, peak) = counted(|| ct::parse(&t, seq));
        assert!(peak <= t.len(), "round {round}: {peak} bytes allocated for a file of {}", t.len());
        match got {
            Ok(table) => {
                ok += 1;
                assert!(table.rows.len() <= MAX_ROWS);
                for row in &table.rows {
                    let u = row.usage;
                    assert!(row.node < 64 && u.block_size > 0 && u.block_size <= 256 << 10 && u.pages > 0);
                    assert!(u.pages <= 1 << 31 && u.bytes <= u.pages * (256 << 10));
                    assert!(u.in_use + u.uncollected + u.stranded <= u.bytes);
                }
            }
            Err(BadClassTable::Size { len }) => {
                assert_ne!(len, ct::FILE_LEN);
                bad += 1;
            }
            Err(_) => bad += 1,
        }
    }
    println!("{ok} class tables accepted, {bad} refused");
    assert!(ok > 50 && bad > 50, "the damage is not varied enough: {ok} accepted, {bad} refused");
}
