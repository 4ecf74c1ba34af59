//! The table of every cache's chunks that another process can read:
//! `numaweave numastat PID` finds it through `/proc/PID/fd` (a memory file
//! named [`FILE_NAME`]) and asks the kernel where each chunk's pages are,
//! so it shows a live program's memory per cache and node with no thread,
//! socket or signal in the program.
//!
//! The file is [`FILE_LEN`] bytes: a header and [`SLOTS`] entries of 64
//! bytes, every field a little-endian `u64` written atomically:
//!
//! ```text
//! header: magic "NWSLABS2" ("NWSLABS1": no node in entries, still read), pid, seq (odd while an entry changes), chunks not listed (the table was full),
//!         the slot being edited, 3 words unused
//! entry:  start, len (0: a free slot), page size | (node + 1) << 32 (0: not said), name (40 bytes, NUL-padded)
//! ```
//!
//! Entries change under a cache's node lock (a chunk mapped or unmapped),
//! then under this table's own lock, one writer at a time, as a seqlock's
//! writer (`sync/seqlock.rs`): `seq` made odd, a release fence, the
//! entry, `seq` made even with a release store. A reader takes the whole file, then `seq` again: the
//! copy holds if both are the same even value ([`parse`]); the model in
//! `loom-tests/tests/published_table.rs` checks that no torn entry passes.
//!
//! A reader trusts nothing of the file: another process wrote it. [`parse`]
//! takes exactly [`FILE_LEN`] bytes and checks every entry (a page size of
//! 4 KiB to 1 GiB, a start and length on that page size, an end that does
//! not wrap, a node below 2^16, a name of UTF-8), so what it returns is bounded by the bytes
//! it was given, and a bad table is a typed error.
//!
//! A child made by `fork` never writes its parent's file: the shared
//! mapping is not inherited (`MADV_DONTFORK`), and the descriptor, whose
//! number the child may have closed and given to a file of its own, is
//! left alone (forgotten, never closed). At its first change the child
//! makes a table of its own from a private copy of the parent's as it was
//! at the fork (the writer keeps one: private memory is copied at the
//! fork, the file is not).

use crate::sync::{AtomicU64, Ordering, seqlock};

/// The memory file's name (`/memfd:numaweave-slabs (deleted)` in
/// `/proc/PID/fd`).
pub const FILE_NAME: &str = "numaweave-slabs";
/// Entries the table holds; chunks beyond are counted, not listed.
pub const SLOTS: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"NWSLABS2");
/// The first version's magic: entries without a node (word 2 the page
/// size alone), read as entries whose node is not said.
const MAGIC_V1: u64 = u64::from_le_bytes(*b"NWSLABS1");
/// Words of an entry.
const WORDS: usize = 8;
/// Bytes of a name kept.
const NAME: usize = 40;
const HEADER_WORDS: usize = 8;
/// Words of the whole table.
pub const TABLE_WORDS: usize = table_words(SLOTS);
/// Bytes of the file.
pub const FILE_LEN: usize = TABLE_WORDS * 8;

/// Header words.
const H_MAGIC: usize = 0;
const H_PID: usize = 1;
const H_SEQ: usize = 2;
const H_UNLISTED: usize = 3;
/// The slot an edit is changing (`NO_SLOT`: none); read by a forked child
/// whose fork interrupted an edit (a signal handler's fork), which drops
/// that slot from its copy.
const H_EDITING: usize = 4;
const NO_SLOT: u64 = u64::MAX;

/// The largest chunk a reader accepts: larger than any chunk a cache maps
/// (8 slabs up to 256 MiB, or one 1 GiB page a slot), small enough that a
/// query of its pages is bounded.
pub const MAX_CHUNK: u64 = 64 << 30;

/// One chunk as the table lists it: no larger than its entry in the file
/// (so that a table read back is never larger than the bytes it came from).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Its first byte.
    pub start: usize,
    /// Its length.
    pub len: usize,
    page_shift: u8,
    name_len: u8,
    /// The kernel node the chunk is bound to, plus one (0: not said).
    node: u16,
    name: [u8; NAME],
}

impl Chunk {
    /// The kernel node the chunk is bound to (its pages belong there), if
    /// the writer said.
    pub fn node(&self) -> Option<usize> {
        usize::from(self.node).checked_sub(1)
    }

    /// The size of the pages behind it.
    pub fn page_size(&self) -> usize {
        1 << self.page_shift
    }

    /// The cache's name (its first 40 bytes).
    pub fn name(&self) -> &str {
        // Checked to be UTF-8 when the chunk was read.
        core::str::from_utf8(&self.name[..usize::from(self.name_len)]).unwrap_or("?")
    }
}

impl core::fmt::Debug for Chunk {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Chunk")
            .field("start", &format_args!("{:#x}", self.start))
            .field("len", &self.len)
            .field("page_size", &self.page_size())
            .field("node", &self.node())
            .field("name", &self.name())
            .finish()
    }
}

const _: () = assert!(size_of::<Chunk>() <= WORDS * 8);

/// A table read back: whose it is, its chunks, and how many chunks did
/// not fit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// The process that wrote it.
    pub pid: u32,
    /// The chunks listed.
    pub chunks: Vec<Chunk>,
    /// Chunks not listed (the table was full when they were mapped).
    pub unlisted: u64,
}

/// Why bytes are not a table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BadTable {
    /// Not [`FILE_LEN`] bytes.
    Size {
        /// The bytes given.
        len: usize,
    },
    /// No table's magic.
    Magic,
    /// An entry was changing while the bytes were read (`seq` odd, or not
    /// the same after the read): read again.
    Changing,
    /// An entry that no writer of this crate makes.
    Entry {
        /// Its slot.
        slot: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl core::fmt::Display for BadTable {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match *self {
            BadTable::Size { len } => write!(f, "{len} bytes, not a table's {FILE_LEN}"),
            BadTable::Magic => f.write_str("not a numaweave slab table"),
            BadTable::Changing => f.write_str("the table changed while it was read"),
            BadTable::Entry { slot, reason } => write!(f, "entry {slot}: {reason}"),
        }
    }
}

impl std::error::Error for BadTable {}

/// Reads a table from the bytes of its file, read whole, and `seq_after`,
/// its `seq` word read again after them (a writer that changed an entry
/// meanwhile changed it: the bytes are then not trusted).
///
/// ```
/// use numaweave::slab::{RawCache, published};
/// let pool = RawCache::builder("listed", 4096).build().unwrap();
/// let p = pool.alloc().unwrap();
/// // This process's own table, as `numaweave numastat PID` finds it.
/// let link = std::fs::read_dir("/proc/self/fd").unwrap().flatten().find(|e| {
///     std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().contains(published::FILE_NAME))
/// });
/// let path = link.unwrap().path();
/// let t = published::read_file(&path).unwrap();
/// assert_eq!(t.pid, std::process::id());
/// let a = p.as_ptr() as usize;
/// assert!(t.chunks.iter().any(|c| c.name() == "listed" && (c.start..c.start + c.len).contains(&a)));
/// // A copy cut short is no table.
/// let bytes = std::fs::read(&path).unwrap();
/// assert!(published::parse(&bytes[..100], 0).is_err());
/// # unsafe { pool.free(p) };
/// ```
pub fn parse(bytes: &[u8], seq_after: u64) -> Result<Table, BadTable> {
    if bytes.len() != FILE_LEN {
        return Err(BadTable::Size { len: bytes.len() });
    }
    let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
    decode(word, SLOTS, seq_after)
}

/// [`parse`] over a table of `slots` entries whose words `word` reads.
fn decode(word: impl Fn(usize) -> u64, slots: usize, seq_after: u64) -> Result<Table, BadTable> {
    if word(H_MAGIC) != MAGIC && word(H_MAGIC) != MAGIC_V1 {
        return Err(BadTable::Magic);
    }
    let seq = word(H_SEQ);
    if seq % 2 == 1 || seq != seq_after {
        return Err(BadTable::Changing);
    }
    let pid = u32::try_from(word(H_PID)).map_err(|_| BadTable::Entry { slot: 0, reason: "a pid beyond 32 bits" })?;
    // Counted first, so that the vector is made once at its size.
    let listed = (0..slots).filter(|s| word(HEADER_WORDS + s * WORDS + 1) != 0).count();
    let mut chunks = Vec::with_capacity(listed);
    for slot in 0..slots {
        let at = HEADER_WORDS + slot * WORDS;
        let (start, len, page_word) = (word(at), word(at + 1), word(at + 2));
        if len == 0 {
            continue;
        }
        let bad = |reason| Err(BadTable::Entry { slot, reason });
        let (page, node) = (page_word & 0xffff_ffff, page_word >> 32);
        let Ok(node) = u16::try_from(node) else {
            return bad("a node id beyond 16 bits");
        };
        if !page.is_power_of_two() || !(4096..=1 << 30).contains(&page) {
            return bad("a page size that is not a power of two from 4 KiB to 1 GiB");
        }
        if start % page != 0 || len % page != 0 {
            return bad("a start or length off its page size");
        }
        if len > MAX_CHUNK {
            return bad("a chunk longer than 64 GiB");
        }
        if start.checked_add(len).is_none_or(|end| end > usize::MAX as u64) {
            return bad("a chunk past the end of the address space");
        }
        let mut name = [0u8; NAME];
        for (i, c) in name.chunks_mut(8).enumerate() {
            c.copy_from_slice(&word(at + 3 + i).to_le_bytes());
        }
        let end = name.iter().position(|&b| b == 0).unwrap_or(NAME);
        if core::str::from_utf8(&name[..end]).is_err() {
            return bad("a name that is not UTF-8");
        }
        chunks.push(Chunk {
            start: start as usize,
            len: len as usize,
            page_shift: page.trailing_zeros() as u8,
            name_len: end as u8,
            node,
            name,
        });
    }
    Ok(Table { pid, chunks, unlisted: word(H_UNLISTED) })
}

/// Why a table could not be read from a file.
pub type ReadError = crate::error::ReadError<BadTable>;

/// Reads the table in the file at `path` (another process's, through
/// `/proc/PID/fd/N`): at most one byte more than [`FILE_LEN`] is read,
/// then the `seq` word again; read again (a few times) while a writer is
/// changing it.
pub fn read_file(path: &std::path::Path) -> Result<Table, ReadError> {
    crate::os::memfd::read_table(path, FILE_LEN, H_SEQ, parse, |b| *b == BadTable::Changing)
}

/// Reads a table from its live words (an in-process reader; the model's,
/// which keeps a table of a few slots): `seq` with an acquire load (so
/// that no word below is read before it), every word with a relaxed load,
/// then `seq` again after an acquire fence; the table is taken only if
/// both `seq`s are the same even value.
pub fn read_words(words: &[AtomicU64]) -> Result<Table, BadTable> {
    if words.len() < HEADER_WORDS || !(words.len() - HEADER_WORDS).is_multiple_of(WORDS) {
        return Err(BadTable::Size { len: words.len() * 8 });
    }
    let copy = seqlock::read(words, H_SEQ).ok_or(BadTable::Changing)?;
    decode(|i| copy[i], (words.len() - HEADER_WORDS) / WORDS, copy[H_SEQ])
}

/// Words of a table of `slots` entries (the file's has [`SLOTS`]).
pub const fn table_words(slots: usize) -> usize {
    HEADER_WORDS + slots * WORDS
}

/// The writer's side of a table's words (of [`table_words`] for some
/// number of slots): each change a seqlock write.
pub struct Words<'a>(pub &'a [AtomicU64]);

impl Words<'_> {
    fn slots(&self) -> usize {
        (self.0.len() - HEADER_WORDS) / WORDS
    }

    /// A fresh table's header (the words all zero before): `pid`'s, no
    /// entry, no edit under way; the magic last.
    pub fn init(&self, pid: u32) {
        let w = self.0;
        w[H_PID].store(u64::from(pid), Ordering::Relaxed);
        w[H_EDITING].store(NO_SLOT, Ordering::Relaxed);
        w[H_MAGIC].store(MAGIC, Ordering::Release);
    }

    /// The first free slot, if any.
    pub fn free_slot(&self) -> Option<usize> {
        (0..self.slots()).find(|s| self.0[HEADER_WORDS + s * WORDS + 1].load(Ordering::Relaxed) == 0)
    }

    /// The slot listing the chunk at `start`, if any.
    pub fn slot_of(&self, start: usize) -> Option<usize> {
        (0..self.slots()).find(|s| {
            let e = &self.0[HEADER_WORDS + s * WORDS..];
            e[1].load(Ordering::Relaxed) != 0 && e[0].load(Ordering::Relaxed) == start as u64
        })
    }

    /// Lists a chunk in `slot` (a free one), under the seqlock.
    /// `node`: the kernel node the chunk is bound to, if one (an id below
    /// 2^16 - 1; a larger one is not said).
    pub fn list(&self, slot: usize, start: usize, len: usize, page_size: usize, node: Option<usize>, name: &str) {
        let node = node.filter(|&n| n < 0xffff).map_or(0, |n| n as u64 + 1);
        let mut name_bytes = [0u8; NAME];
        let mut n = name.len().min(NAME);
        while !name.is_char_boundary(n) {
            n -= 1;
        }
        name_bytes[..n].copy_from_slice(&name.as_bytes()[..n]);
        self.edit(slot, |e| {
            for (i, c) in name_bytes.chunks(8).enumerate() {
                e[3 + i].store(u64::from_le_bytes(c.try_into().unwrap()), Ordering::Relaxed);
            }
            e[0].store(start as u64, Ordering::Relaxed);
            e[2].store(page_size as u64 | node << 32, Ordering::Relaxed);
            e[1].store(len as u64, Ordering::Relaxed);
        });
    }

    /// Says the chunk in `slot` is bound to kernel node `node` now (it
    /// moved), under the seqlock.
    pub fn set_node(&self, slot: usize, node: usize) {
        let node = if node < 0xffff { node as u64 + 1 } else { 0 };
        self.edit(slot, |e| {
            let page = e[2].load(Ordering::Relaxed) & 0xffff_ffff;
            e[2].store(page | node << 32, Ordering::Relaxed);
        });
    }

    /// Empties `slot`, under the seqlock.
    pub fn clear(&self, slot: usize) {
        self.edit(slot, |e| e[1].store(0, Ordering::Relaxed));
    }

    /// Counts a chunk not listed (the table was full).
    pub fn count_unlisted(&self) {
        seqlock::write(self.0, H_SEQ, || self.0[H_UNLISTED].fetch_add(1, Ordering::Relaxed));
    }

    /// Changes `slot`'s words with `f` as a seqlock writer: `seq` odd, a
    /// release fence (so that a reader that sees any word `f` writes sees
    /// the odd `seq` after its own acquire fence), the words, `seq` even
    /// with a release store.
    fn edit(&self, slot: usize, f: impl FnOnce(&[AtomicU64])) {
        debug_assert!(slot < self.slots());
        let w = self.0;
        w[H_EDITING].store(slot as u64, Ordering::Relaxed);
        seqlock::write(w, H_SEQ, || f(&w[HEADER_WORDS + slot * WORDS..][..WORDS]));
        w[H_EDITING].store(NO_SLOT, Ordering::Relaxed);
    }

    /// Makes these words a copy of `from` for process `pid`: a forked
    /// child's table from its private copy of the parent's. An edit the
    /// fork interrupted (a signal handler's fork) leaves its slot out.
    pub fn copy_for(&self, from: &[AtomicU64], pid: u32) {
        for (d, s) in self.0.iter().zip(from).skip(HEADER_WORDS) {
            d.store(s.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        let mut unlisted = from[H_UNLISTED].load(Ordering::Relaxed);
        if from[H_SEQ].load(Ordering::Relaxed) % 2 == 1 {
            let slot = from[H_EDITING].load(Ordering::Relaxed) as usize;
            if slot < self.slots() {
                self.0[HEADER_WORDS + slot * WORDS + 1].store(0, Ordering::Relaxed);
                unlisted += 1;
            }
        }
        self.0[H_UNLISTED].store(unlisted, Ordering::Relaxed);
        self.0[H_SEQ].store(0, Ordering::Relaxed);
        self.init(pid);
    }
}

#[cfg(not(loom))]
pub(crate) use writer::{publish, rebind, withdraw};

/// This process's table: the memory file readers open, and its private
/// copy, which a forked child inherits as it was at the fork.
#[cfg(not(loom))]
mod writer {
    use super::{FILE_LEN, TABLE_WORDS, Words};
    use crate::os::mem;
    use crate::os::memfd::{MemFile, process_id};
    use crate::os::thread::fork_generation;
    use crate::sync::{AtomicU64, Mutex};

    struct Writer {
        /// The file, made in this process (`None` before the first chunk,
        /// after a failure, and in a forked child until its first change).
        file: Option<MemFile>,
        /// The private copy of the file's words (`None` before the first
        /// chunk).
        shadow: Option<core::ptr::NonNull<u8>>,
        /// Making the file failed: not tried again (the table stays
        /// private, and `numastat` shows no caches).
        failed: bool,
        /// The process the file belongs to, and its fork generation
        /// (`os::thread::fork_generation`: a pid may come back).
        pid: u32,
        forks: u64,
    }

    // SAFETY: the writer is reached only under `TABLE`'s lock; its file and
    // private mapping are process-wide resources.
    unsafe impl Send for Writer {}

    static TABLE: Mutex<Writer> = Mutex::new(Writer { file: None, shadow: None, failed: false, pid: 0, forks: 0 });

    fn words<'a>(p: core::ptr::NonNull<u8>) -> &'a [AtomicU64] {
        // SAFETY: `p` is a live mapping of `FILE_LEN` bytes, page-aligned
        // (so aligned for u64), that lives as long as the process once made
        // (the file's, until a fork's child forgets it under the lock; the
        // private copy's, never unmapped); every access to it is atomic.
        unsafe { core::slice::from_raw_parts(p.as_ptr().cast::<AtomicU64>(), TABLE_WORDS) }
    }

    impl Writer {
        /// The private copy and, if there is one, the file: made now if
        /// need be (the private copy first); in a forked child, a file of
        /// its own made from the private copy.
        fn ready(&mut self) -> Option<(Words<'static>, Option<Words<'static>>)> {
            let (pid, forks) = (process_id(), fork_generation());
            if self.shadow.is_none() {
                let p = mem::map(FILE_LEN).ok()?;
                Words(words(p)).init(pid);
                self.shadow = Some(p);
                (self.pid, self.forks) = (pid, forks);
            }
            let shadow = words(self.shadow?);
            if self.pid != pid || self.forks != forks {
                // A forked child: the parent's file is not ours. Its
                // mapping is not here (`MADV_DONTFORK`), and its descriptor
                // is left alone: the handle goes (it closes nothing).
                self.file = None;
                self.failed = false;
                (self.pid, self.forks) = (pid, forks);
                // The private copy is the parent's table at the fork.
                Words(shadow).copy_for(shadow, pid);
            }
            if self.file.is_none() && !self.failed {
                match MemFile::create(c"numaweave-slabs", FILE_LEN) {
                    Ok(f) => {
                        Words(words(f.ptr)).copy_for(shadow, pid);
                        self.file = Some(f);
                    }
                    Err(_) => self.failed = true,
                }
            }
            Some((Words(shadow), self.file.as_ref().map(|f| Words(words(f.ptr)))))
        }
    }

    /// Lists a chunk of cache `name`, bound to kernel node `node`.
    pub(crate) fn publish(start: usize, len: usize, page_size: usize, node: usize, name: &str) {
        let mut t = TABLE.lock();
        let Some((shadow, file)) = t.ready() else { return };
        // The file is a copy of the private words: the same slot is free in both.
        for w in core::iter::once(shadow).chain(file) {
            match w.free_slot() {
                Some(slot) => w.list(slot, start, len, page_size, Some(node), name),
                None => w.count_unlisted(),
            }
        }
    }

    /// Says the chunk at `start` is bound to kernel node `node` now.
    pub(crate) fn rebind(start: usize, node: usize) {
        edit_chunk(start, |w, slot| w.set_node(slot, node));
    }

    /// Takes the chunk at `start` off the table.
    pub(crate) fn withdraw(start: usize) {
        edit_chunk(start, |w, slot| w.clear(slot));
    }

    /// Applies `f` to the entry of the chunk at `start`, in the private
    /// words and in the file alike.
    fn edit_chunk(start: usize, f: impl Fn(&Words<'_>, usize)) {
        let mut t = TABLE.lock();
        let Some((shadow, file)) = t.ready() else { return };
        for w in core::iter::once(shadow).chain(file) {
            if let Some(slot) = w.slot_of(start) {
                f(&w, slot);
            }
        }
    }
}
