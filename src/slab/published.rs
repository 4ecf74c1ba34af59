//! The table of every cache's chunks that another process can read:
//! `numaweave numastat PID` finds it through `/proc/PID/fd` (a memory file
//! named [`FILE_NAME`]) and asks the kernel where each chunk's pages are,
//! so it shows a live program's memory per cache and node with no thread,
//! socket or signal in the program.
//!
//! The file holds a header and [`SLOTS`] entries of 64 bytes, every field
//! a little-endian `u64` written atomically:
//!
//! ```text
//! header: magic "NWSLABS1", pid, seq (odd while an entry changes), chunks not listed (the table was full)
//! entry:  start, len (0: a free slot), page size, name (40 bytes, NUL-padded)
//! ```
//!
//! Entries change under a cache's node lock (a chunk mapped or unmapped),
//! then under this table's own lock; a reader retries while `seq` is odd or
//! changed under it. A child made by `fork` shares its parent's file until
//! it first maps or unmaps a chunk, when it makes its own (copied): the
//! pid in the header tells a reader whose table it is.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::os::memfd::MemFile;
use crate::sync::Mutex;

/// The memory file's name (`/memfd:numaweave-slabs (deleted)` in
/// `/proc/PID/fd`).
pub const FILE_NAME: &str = "numaweave-slabs";
/// Entries the table holds; chunks beyond are counted, not listed.
pub const SLOTS: usize = 4096;
const MAGIC: u64 = u64::from_le_bytes(*b"NWSLABS1");
const WORDS: usize = 8;
/// Bytes of a name kept.
const NAME: usize = 40;
const HEADER_WORDS: usize = 8;

/// One chunk as the table lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Its first byte.
    pub start: usize,
    /// Its length.
    pub len: usize,
    /// The size of the pages behind it.
    pub page_size: usize,
    /// The cache's name (its first 40 bytes).
    pub name: String,
}

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

/// Reads a table from the bytes of its file; `None` when they are not one
/// (or changed under every one of a few tries: read the file again).
///
/// ```
/// use numaweave::slab::{RawCache, published};
/// let pool = RawCache::builder("listed", 4096).build().unwrap();
/// let p = pool.alloc().unwrap();
/// // This process's own table, as `numaweave numastat PID` finds it.
/// let link = std::fs::read_dir("/proc/self/fd").unwrap().flatten().find(|e| {
///     std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().contains(published::FILE_NAME))
/// });
/// let t = published::parse(&std::fs::read(link.unwrap().path()).unwrap()).unwrap();
/// assert_eq!(t.pid, std::process::id());
/// let a = p.as_ptr() as usize;
/// assert!(t.chunks.iter().any(|c| c.name == "listed" && (c.start..c.start + c.len).contains(&a)));
/// # unsafe { pool.free(p) };
/// ```
pub fn parse(bytes: &[u8]) -> Option<Table> {
    let word = |i: usize| bytes.get(i * 8..i * 8 + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()));
    if word(0)? != MAGIC {
        return None;
    }
    // The bytes are one read of the file: a torn read shows as an odd
    // `seq` (an entry was changing), which the caller retries.
    if word(2)? % 2 == 1 {
        return None;
    }
    let mut chunks = Vec::new();
    for slot in 0..SLOTS {
        let at = HEADER_WORDS + slot * WORDS;
        let Some(len) = word(at + 1) else { break };
        if len == 0 {
            continue;
        }
        let name_bytes = &bytes[(at + 3) * 8..(at + 3) * 8 + NAME];
        let end = name_bytes.iter().position(|&b| b == 0).unwrap_or(NAME);
        chunks.push(Chunk {
            start: word(at)? as usize,
            len: len as usize,
            page_size: word(at + 2)? as usize,
            name: String::from_utf8_lossy(&name_bytes[..end]).into_owned(),
        });
    }
    Some(Table { pid: word(1)? as u32, chunks, unlisted: word(3)? })
}

/// This process's table, once made (`None` before the first chunk, or
/// where the kernel has no `memfd_create`).
struct Writer {
    file: Option<MemFile>,
    /// `memfd_create` failed: not tried again.
    failed: bool,
    pid: i32,
}

static TABLE: Mutex<Writer> = Mutex::new(Writer { file: None, failed: false, pid: 0 });

impl Writer {
    fn words(&self) -> Option<&[AtomicU64]> {
        let f = self.file.as_ref()?;
        // SAFETY: the mapping is `len` bytes, page-aligned (so aligned for
        // u64), shared with readers that only read; every access to it is
        // atomic, so the other process's reads race with nothing here.
        Some(unsafe { core::slice::from_raw_parts(f.ptr.as_ptr().cast::<AtomicU64>(), f.len / 8) })
    }

    /// The table of this process, made (or, in a forked child, copied) now
    /// if need be.
    fn ready(&mut self) -> Option<&[AtomicU64]> {
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        if self.file.is_some() && self.pid != pid {
            // A forked child: its own copy, the parent's file left alone.
            let old = self.file.take()?;
            if let Ok(new) = MemFile::create(c"numaweave-slabs", old.len) {
                // SAFETY: both mappings are `len` bytes, distinct.
                unsafe { core::ptr::copy_nonoverlapping(old.ptr.as_ptr(), new.ptr.as_ptr(), old.len) };
                self.file = Some(new);
            } else {
                self.failed = true;
            }
            // SAFETY: the child's copy of the parent's mapping and
            // descriptor; nothing else here uses them.
            unsafe { old.destroy() };
            self.pid = pid;
            self.words()?[1].store(pid as u64, Ordering::Relaxed);
        }
        if self.file.is_none() && !self.failed {
            match MemFile::create(c"numaweave-slabs", (HEADER_WORDS + SLOTS * WORDS) * 8) {
                Ok(f) => {
                    self.file = Some(f);
                    self.pid = pid;
                    let w = self.words()?;
                    w[1].store(pid as u64, Ordering::Relaxed);
                    w[0].store(MAGIC, Ordering::Release);
                }
                Err(_) => self.failed = true,
            }
        }
        self.words()
    }
}

/// Changes the table under its `seq`.
fn edit(f: impl FnOnce(&[AtomicU64])) {
    let mut t = TABLE.lock();
    let Some(w) = t.ready() else { return };
    w[2].fetch_add(1, Ordering::AcqRel);
    f(w);
    w[2].fetch_add(1, Ordering::Release);
}

/// Lists a chunk of cache `name`.
pub(crate) fn publish(start: usize, len: usize, page_size: usize, name: &str) {
    edit(|w| {
        let Some(slot) = (0..SLOTS).find(|s| w[HEADER_WORDS + s * WORDS + 1].load(Ordering::Relaxed) == 0) else {
            w[3].fetch_add(1, Ordering::Relaxed);
            return;
        };
        let e = &w[HEADER_WORDS + slot * WORDS..][..WORDS];
        let mut name_bytes = [0u8; NAME];
        let n = name.len().min(NAME);
        name_bytes[..n].copy_from_slice(&name.as_bytes()[..n]);
        for (i, c) in name_bytes.chunks(8).enumerate() {
            e[3 + i].store(u64::from_le_bytes(c.try_into().unwrap()), Ordering::Relaxed);
        }
        e[0].store(start as u64, Ordering::Relaxed);
        e[2].store(page_size as u64, Ordering::Relaxed);
        e[1].store(len as u64, Ordering::Relaxed);
    });
}

/// Takes the chunk at `start` off the table.
pub(crate) fn withdraw(start: usize) {
    edit(|w| {
        for s in 0..SLOTS {
            let e = &w[HEADER_WORDS + s * WORDS..][..WORDS];
            if e[1].load(Ordering::Relaxed) != 0 && e[0].load(Ordering::Relaxed) == start as u64 {
                e[1].store(0, Ordering::Relaxed);
                return;
            }
        }
    });
}
