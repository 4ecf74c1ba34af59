//! The size classes' usage per node, published for other processes
//! (`NUMAWEAVE_PUBLISH=1`, [`Config::publish`](crate::Config::publish)):
//! `numaweave numastat PID` finds a memory file named [`FILE_NAME`] among
//! the process's open files and shows, for each node and class, the bytes
//! its pages span, hold in use, wait to collect and strand
//! ([`ClassUsage`]), so that a user sees a live program's fragmentation
//! with no thread, socket or signal in it.
//!
//! Off by default: the file is a descriptor and, at most once a
//! [`PERIOD_MS`], a walk of every arena's pages under its lock; a program
//! that did not ask pays one flag's test on a refill in 64.
//!
//! The file is [`FILE_LEN`] bytes: a header and up to [`MAX_ROWS`] rows of
//! 64 bytes, every field a little-endian `u64` written atomically:
//!
//! ```text
//! header: magic "NWCLASS1", pid, seq (odd while the rows change), published at (ms of the monotonic clock),
//!         rows, period (ms), 2 words unused
//! row:    node, block size, pages, bytes, in use, uncollected, stranded, 1 word unused
//! ```
//!
//! Each publication rewrites the table whole, one writer at a time (under
//! the lifecycle's work lock, which `fork()` holds), as the writer of
//! `sync/seqlock.rs` (whose loom model is the slab table's): `seq` made
//! odd, a release fence, the rows, `seq` made even with a release store.
//! A reader copies the whole file, then reads `seq` again, and keeps the
//! copy if both are the same even value ([`parse`]). The writer walks
//! every arena's pages into a private array of rows first (under each
//! arena's lock in turn), then copies them into the file: the odd window
//! is a copy of the rows. A reader that meets it tries again
//! ([`read_file`]: ten times, a millisecond apart).
//!
//! A reader trusts nothing of the file: [`parse`] takes exactly
//! [`FILE_LEN`] bytes and checks every row (a node below `MAX_NODES`, a
//! block size of the small classes' range, pages an address space can
//! hold, and the bytes in use, uncollected and stranded within the bytes
//! the pages span: no sum of a table's rows overflows), so a bad table is
//! a typed error.
//!
//! A child made by `fork` never writes its parent's file: the mapping is
//! not inherited (`MADV_DONTFORK`), and the descriptor, whose number the
//! child may have closed and given to a file of its own, is left alone
//! (forgotten, never closed); the child's first publication makes a file
//! of its own. One case is left: a process that never had a second
//! thread takes no lock across `fork()` (see `os/thread.rs`), so a signal
//! handler that forks while the interrupted thread is copying rows into
//! the file has a child that resumes the copy into a mapping it does not
//! have, and faults (the slab table's edits have the same window, a few
//! words long; this one is the copy of the rows).

use super::super::arena::ClassUsage;
use crate::alloc::engine::size_class::{CLASSES, SMALL_MAX};
use crate::sync::{AtomicU64, Ordering, seqlock};
use crate::topology::MAX_NODES;

/// The memory file's name (`/memfd:numaweave-classes (deleted)` in
/// `/proc/PID/fd`).
pub const FILE_NAME: &str = "numaweave-classes";
/// How often a busy process publishes at most (ms).
pub const PERIOD_MS: u64 = 1000;
/// Rows the table holds: a row for each node and class.
pub const MAX_ROWS: usize = MAX_NODES * CLASSES;
const MAGIC: u64 = u64::from_le_bytes(*b"NWCLASS1");
const HEADER_WORDS: usize = 8;
/// Words of a row.
const WORDS: usize = 8;
/// The most pages a row may say: 64 KiB slots below 2^47.
const MAX_PAGES: u64 = 1 << (47 - 16);
const H_MAGIC: usize = 0;
const H_PID: usize = 1;
const H_SEQ: usize = 2;
const H_AT: usize = 3;
const H_ROWS: usize = 4;
const H_PERIOD: usize = 5;

/// Words of a table of `rows` rows.
pub const fn table_words(rows: usize) -> usize {
    HEADER_WORDS + rows * WORDS
}

/// Bytes of the file.
pub const FILE_LEN: usize = table_words(MAX_ROWS) * 8;

/// One class's pages on one node, as the table lists them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    /// The node (the allocator's logical node, as `NUMAWEAVE_SHOW_STATS`
    /// names it).
    pub node: usize,
    /// The class's figures, in bytes.
    pub usage: ClassUsage,
}

/// A table read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClassTable {
    /// The process that wrote it.
    pub pid: u32,
    /// When it was published (ms of `CLOCK_MONOTONIC`, the clock every
    /// process of the machine shares).
    pub published_ms: u64,
    /// How often the process publishes at most (ms).
    pub period_ms: u64,
    /// The classes with pages, by node.
    pub rows: Vec<Row>,
}

/// Why bytes are not a class table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BadClassTable {
    /// Not [`FILE_LEN`] bytes.
    Size {
        /// The bytes given.
        len: usize,
    },
    /// Not a numaweave class table (its magic is another).
    Magic,
    /// Being written while it was read (`seq` odd or changed).
    Changing,
    /// A row that cannot be one.
    Row {
        /// Its index.
        row: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl core::fmt::Display for BadClassTable {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match *self {
            BadClassTable::Size { len } => write!(f, "{len} bytes, not a class table's {FILE_LEN}"),
            BadClassTable::Magic => f.write_str("not a numaweave class table"),
            BadClassTable::Changing => f.write_str("the table changed while it was read"),
            BadClassTable::Row { row, reason } => write!(f, "row {row}: {reason}"),
        }
    }
}

impl std::error::Error for BadClassTable {}

/// Reads a table from the bytes of its file, `seq_after` the sequence
/// word read again after them.
///
/// ```
/// use numaweave::stats::class_table::{BadClassTable, FILE_LEN, parse};
/// assert_eq!(parse(&[0; 8], 0), Err(BadClassTable::Size { len: 8 }));
/// assert_eq!(parse(&vec![0; FILE_LEN], 0), Err(BadClassTable::Magic));
/// ```
pub fn parse(bytes: &[u8], seq_after: u64) -> Result<ClassTable, BadClassTable> {
    if bytes.len() != FILE_LEN {
        return Err(BadClassTable::Size { len: bytes.len() });
    }
    let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
    decode(word, MAX_ROWS, seq_after)
}

fn decode(word: impl Fn(usize) -> u64, max_rows: usize, seq_after: u64) -> Result<ClassTable, BadClassTable> {
    if word(H_MAGIC) != MAGIC {
        return Err(BadClassTable::Magic);
    }
    let seq = word(H_SEQ);
    if seq % 2 == 1 || seq != seq_after {
        return Err(BadClassTable::Changing);
    }
    let bad = |row, reason| Err(BadClassTable::Row { row, reason });
    let pid = u32::try_from(word(H_PID)).map_err(|_| BadClassTable::Row { row: 0, reason: "a pid beyond 32 bits" })?;
    let n = word(H_ROWS);
    if n > max_rows as u64 {
        return bad(0, "more rows than the table holds");
    }
    let mut rows = Vec::with_capacity(n as usize);
    for r in 0..n as usize {
        let w = |i: usize| word(HEADER_WORDS + r * WORDS + i);
        let u =
            ClassUsage { block_size: w(1), pages: w(2), bytes: w(3), in_use: w(4), uncollected: w(5), stranded: w(6) };
        if w(0) >= MAX_NODES as u64 {
            return bad(r, "a node beyond the allocator's nodes");
        }
        if u.block_size == 0 || u.block_size > SMALL_MAX as u64 || !u.block_size.is_multiple_of(8) {
            return bad(r, "a block size beyond the small classes'");
        }
        // A page spans at most 4 slots of 64 KiB, and no more pages than
        // slots fit below 2^47 (so that no sum of rows overflows).
        if u.pages == 0 || u.pages > MAX_PAGES || u.bytes > u.pages * (256 << 10) {
            return bad(r, "no pages, more than an address space holds, or more bytes than they span");
        }
        if u.in_use.saturating_add(u.uncollected).saturating_add(u.stranded) > u.bytes {
            return bad(r, "more bytes in use, uncollected and stranded than the pages span");
        }
        rows.push(Row { node: w(0) as usize, usage: u });
    }
    Ok(ClassTable { pid, published_ms: word(H_AT), period_ms: word(H_PERIOD), rows })
}

/// Why a table could not be read from a file.
pub type ReadError = crate::error::ReadError<BadClassTable>;

/// Reads the table in the file at `path` (another process's, through
/// `/proc/PID/fd`): the whole file, then its `seq` again, tried ten times
/// while a publication is under way.
///
/// ```no_run
/// let t = numaweave::stats::class_table::read_file("/proc/1234/fd/5".as_ref())?;
/// for r in &t.rows {
///     println!("node {}: {} B blocks strand {} B", r.node, r.usage.block_size, r.usage.stranded);
/// }
/// # Ok::<(), numaweave::stats::class_table::ReadError>(())
/// ```
pub fn read_file(path: &std::path::Path) -> Result<ClassTable, ReadError> {
    crate::os::memfd::read_table(path, FILE_LEN, H_SEQ, parse, |b| *b == BadClassTable::Changing)
}

/// Reads a table from words shared with its writer (this process's):
/// `sync::seqlock`'s read.
pub fn read_words(words: &[AtomicU64]) -> Result<ClassTable, BadClassTable> {
    if words.len() < HEADER_WORDS || !(words.len() - HEADER_WORDS).is_multiple_of(WORDS) {
        return Err(BadClassTable::Size { len: words.len() * 8 });
    }
    let copy = seqlock::read(words, H_SEQ).ok_or(BadClassTable::Changing)?;
    decode(|i| copy[i], (words.len() - HEADER_WORDS) / WORDS, copy[H_SEQ])
}

/// A table's words, as its writer sees them.
pub struct Words<'a>(pub &'a [AtomicU64]);

impl Words<'_> {
    /// Makes the table this process's: its pid, the period, then the magic.
    pub fn init(&self, pid: u32) {
        let w = self.0;
        w[H_PID].store(u64::from(pid), Ordering::Relaxed);
        w[H_PERIOD].store(PERIOD_MS, Ordering::Relaxed);
        w[H_MAGIC].store(MAGIC, Ordering::Release);
    }

    /// Rewrites the table at `now` (ms) with `rows` (those past the
    /// table's room dropped), as one `sync::seqlock` write.
    pub fn publish(&self, now: u64, rows: &[Row]) {
        let w = self.0;
        let rows = &rows[..rows.len().min((w.len() - HEADER_WORDS) / WORDS)];
        seqlock::write(w, H_SEQ, || {
            for (words, r) in w[HEADER_WORDS..].chunks_exact(WORDS).zip(rows) {
                let u = &r.usage;
                let v = [r.node as u64, u.block_size, u.pages, u.bytes, u.in_use, u.uncollected, u.stranded, 0];
                for (x, v) in words.iter().zip(v) {
                    x.store(v, Ordering::Relaxed);
                }
            }
            w[H_ROWS].store(rows.len() as u64, Ordering::Relaxed);
            w[H_AT].store(now, Ordering::Relaxed);
        });
    }
}

#[cfg(not(loom))]
pub(crate) use writer::{beat, enable, publish};

#[cfg(not(loom))]
mod writer {
    use core::ptr::NonNull;

    use super::{FILE_LEN, MAX_ROWS, PERIOD_MS, Row, Words, table_words};
    use crate::alloc::engine::arena::ClassUsage;
    use crate::alloc::engine::size_class::CLASSES;
    use crate::alloc::engine::types::State;
    use crate::os::memfd::{MemFile, process_id};
    use crate::os::thread::fork_generation;
    use crate::sync::{AtomicBool, AtomicU64, Ordering, SpinLock};

    /// Whether the process publishes (set once, at start-up).
    static ON: AtomicBool = AtomicBool::new(false);
    /// The earliest time (ms) of the next publication.
    static NEXT: AtomicU64 = AtomicU64::new(0);

    const NO_USAGE: ClassUsage =
        ClassUsage { block_size: 0, pages: 0, bytes: 0, in_use: 0, uncollected: 0, stranded: 0 };

    /// The file, whose it is, and where a publication gathers its rows.
    struct Writer {
        file: Option<MemFile>,
        /// Making it failed: not tried again in this process.
        failed: bool,
        /// The process the file is of, and its fork generation
        /// (`os::thread::fork_generation`: a pid may come back).
        pid: u32,
        forks: u64,
        /// Every row of a publication, gathered before the table is
        /// written (so that the seqlock's odd window is a copy, not the
        /// walk of every arena): a private mapping of `MAX_ROWS` rows,
        /// made at the first publication, touched as far as rows go.
        rows: Option<NonNull<Row>>,
        /// One arena's classes (here, not on the stack of the thread
        /// whose refill publishes: 4 KiB).
        scratch: [ClassUsage; CLASSES],
    }

    // SAFETY: the writer is reached only under `TABLE`'s lock; its file and
    // private mapping are process-wide resources.
    unsafe impl Send for Writer {}

    /// Taken only under the lifecycle's work lock, which `fork()` holds.
    static TABLE: SpinLock<Writer> =
        SpinLock::new(Writer { file: None, failed: false, pid: 0, forks: 0, rows: None, scratch: [NO_USAGE; CLASSES] });

    /// Has the process publish (the facade's start-up).
    pub(crate) fn enable() {
        ON.store(true, Ordering::Relaxed);
    }

    /// A refill's look (one of a heap's refills in 64, every refill of
    /// the per-CPU caches): publishes if the process does and a period has
    /// passed since it last did, unless another thread does the
    /// lifecycle's work now (it is not this thread's).
    #[inline]
    pub(crate) fn beat(state: &State) {
        if ON.load(Ordering::Relaxed) {
            beat_slow(state);
        }
    }

    #[cold]
    #[inline(never)]
    fn beat_slow(state: &State) {
        if crate::os::monotonic_ms() < NEXT.load(Ordering::Relaxed) {
            return;
        }
        if let Some(_work) = state.life.work.try_lock() {
            // Again under the lock: a thread that published while this one
            // waited for it moved `NEXT` on.
            let now = crate::os::monotonic_ms();
            if now >= NEXT.load(Ordering::Relaxed) {
                publish(state, now);
            }
        }
    }

    /// Publishes the classes' usage of every node now, if the process
    /// does. The caller holds the lifecycle's work lock.
    pub(crate) fn publish(state: &State, now: u64) {
        if !ON.load(Ordering::Relaxed) {
            return;
        }
        NEXT.store(now + PERIOD_MS, Ordering::Relaxed);
        let mut g = TABLE.lock();
        let t = &mut *g;
        let (pid, forks) = (process_id(), fork_generation());
        if t.pid != pid || t.forks != forks {
            // A new process, or a forked child: the parent's file is not
            // ours. Its mapping is not here (`MADV_DONTFORK`) and its
            // descriptor is left alone: the handle goes (it closes
            // nothing). The private rows were copied by the fork: kept.
            (t.file, t.failed, t.pid, t.forks) = (None, false, pid, forks);
        }
        if t.file.is_none() && !t.failed {
            match MemFile::create(c"numaweave-classes", FILE_LEN) {
                Ok(f) => {
                    Words(words(&f)).init(pid);
                    t.file = Some(f);
                }
                Err(e) => {
                    t.failed = true;
                    crate::os::file::report(format_args!("numaweave: NUMAWEAVE_PUBLISH: {e}"));
                }
            }
        }
        let Some(f) = &t.file else { return };
        if t.rows.is_none() {
            t.rows = crate::os::mem::map(MAX_ROWS * size_of::<Row>()).ok().map(NonNull::cast);
        }
        let Some(rows) = t.rows else { return };
        // SAFETY: a private mapping of `MAX_ROWS` rows (page-aligned, so
        // aligned for `Row`), never unmapped, used only under `TABLE`'s
        // lock, which we hold; zero-filled, and a zero `Row` is a valid one.
        let rows = unsafe { core::slice::from_raw_parts_mut(rows.as_ptr(), MAX_ROWS) };
        let mut n = 0;
        for node in state.nodes().iter() {
            if let Some(a) = state.arena(node) {
                a.class_usage_into(&mut t.scratch);
                for u in t.scratch.iter().filter(|u| u.pages > 0) {
                    if n < MAX_ROWS {
                        rows[n] = Row { node, usage: *u };
                        n += 1;
                    }
                }
            }
        }
        Words(words(f)).publish(now, &rows[..n]);
    }

    fn words(f: &MemFile) -> &'static [AtomicU64] {
        // SAFETY: the file's mapping is `FILE_LEN` bytes, page-aligned (so
        // aligned for u64), and lives as long as the process that made it
        // (never unmapped; a forked child has no such mapping and forgets
        // the handle before it would use it, above); every access to it is
        // atomic.
        unsafe { core::slice::from_raw_parts(f.ptr.as_ptr().cast::<AtomicU64>(), table_words(MAX_ROWS)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(block_size: u64, pages: u64, in_use: u64, stranded: u64) -> ClassUsage {
        ClassUsage { block_size, pages, bytes: pages * 65536, in_use, uncollected: 0, stranded }
    }

    fn table(rows: &[Row]) -> Vec<AtomicU64> {
        let w: Vec<AtomicU64> = (0..table_words(MAX_ROWS)).map(|_| AtomicU64::new(0)).collect();
        Words(&w).init(42);
        Words(&w).publish(1234, rows);
        w
    }

    fn bytes(w: &[AtomicU64]) -> Vec<u8> {
        w.iter().flat_map(|x| x.load(Ordering::Relaxed).to_le_bytes()).collect()
    }

    /// What a publication writes is what a reader of the file gets back,
    /// and a second publication replaces the first whole.
    #[test]
    fn a_table_reads_back_as_published() {
        let rows = [
            Row { node: 0, usage: usage(64, 3, 1000, 500) },
            Row { node: 1, usage: usage(3072, 101, 3_225_600, 3_072_000) },
        ];
        let w = table(&rows);
        let seq = w[H_SEQ].load(Ordering::Relaxed);
        let t = parse(&bytes(&w), seq).unwrap();
        assert_eq!((t.pid, t.published_ms, t.period_ms), (42, 1234, PERIOD_MS));
        assert_eq!(t.rows, rows);
        assert_eq!(read_words(&w).unwrap(), t);
        Words(&w).publish(2000, &[Row { node: 0, usage: usage(128, 1, 128, 0) }]);
        let t = read_words(&w).unwrap();
        assert_eq!((t.rows.len(), t.rows[0].usage.block_size, t.published_ms), (1, 128, 2000));
    }

    /// A file that is not a whole, quiet, sound table is a typed error.
    #[test]
    fn bad_tables_are_refused() {
        let w = table(&[Row { node: 0, usage: usage(64, 3, 1000, 500) }]);
        let (b, seq) = (bytes(&w), w[H_SEQ].load(Ordering::Relaxed));
        assert_eq!(parse(&b[..8], seq), Err(BadClassTable::Size { len: 8 }));
        assert_eq!(parse(&b, seq + 2), Err(BadClassTable::Changing));
        let mut odd = b.clone();
        odd[H_SEQ * 8] |= 1;
        assert_eq!(parse(&odd, seq | 1), Err(BadClassTable::Changing));
        let set = |word: usize, v: u64| {
            let mut x = b.clone();
            x[word * 8..word * 8 + 8].copy_from_slice(&v.to_le_bytes());
            parse(&x, seq)
        };
        assert_eq!(set(H_MAGIC, 7), Err(BadClassTable::Magic));
        let row = |i| HEADER_WORDS + i;
        for (word, v, reason) in [
            (H_ROWS, MAX_ROWS as u64 + 1, "more rows than the table holds"),
            (row(0), MAX_NODES as u64, "a node beyond the allocator's nodes"),
            (row(1), 0, "a block size beyond the small classes'"),
            (row(1), SMALL_MAX as u64 + 8, "a block size beyond the small classes'"),
            (row(1), 100, "a block size beyond the small classes'"),
            (row(2), 0, "no pages, more than an address space holds, or more bytes than they span"),
            (row(2), 1 << 50, "no pages, more than an address space holds, or more bytes than they span"),
            (row(3), 3 * (256 << 10) + 1, "no pages, more than an address space holds, or more bytes than they span"),
            (row(4), 3 * 65536, "more bytes in use, uncollected and stranded than the pages span"),
            (row(6), u64::MAX, "more bytes in use, uncollected and stranded than the pages span"),
        ] {
            assert_eq!(set(word, v), Err(BadClassTable::Row { row: 0, reason }), "word {word} = {v}");
        }
    }
}
