//! io_uring fixed buffers from a node's pool (feature `io-uring`, with the
//! `io-uring` crate).
//!
//! A [`NodeRing`] is one ring and one [`DmaPool`] on a node, the model for a
//! storage or network thread pinned to that node's CPUs. Each region of the
//! pool (a chunk of its slabs, see [`slab::register`](crate::slab::register))
//! goes into a slot of the ring's sparse registered-buffer table as it is
//! mapped (`IORING_REGISTER_BUFFERS2` sparse, then `_BUFFERS_UPDATE`), so a
//! chunk that arrives later is registered without re-registering the rest,
//! and leaves its slot before it is unmapped. A buffer from
//! [`NodeRing::alloc`] carries the slot its region has: a `READ_FIXED` or
//! `WRITE_FIXED` names it as `buf_index`, and the kernel neither walks the
//! page tables nor pins pages per request.
//!
//! A [`NodeTable`] registers a node's pool once and gives each ring made
//! from it a clone of the table (`IORING_REGISTER_CLONE_BUFFERS`, Linux
//! 6.12): a ring per worker, the buffers pinned and charged once.
//!
//! A [`BufRing`] ([`NodeRing::buf_ring`], `IORING_REGISTER_PBUF_RING`)
//! lends buffers of the same pool to the kernel as a buffer group: a
//! receive or read that selects from it gets a buffer when data arrives,
//! [`BufRing::take`] hands it to the application, and it goes back into the
//! ring when the application drops it.
//!
//! Registered buffers are pinned. [`FixedBuffers`] keeps what all rings of
//! the process have pinned within the soft `RLIMIT_MEMLOCK` (whatever the
//! process's capabilities, so the limit means the same to root): a region
//! beyond it fails the allocation with [`Error::MemlockLimit`], which says
//! the limit, what is pinned and what was asked; nothing is kept and the
//! ring goes on serving from the regions it has. [`NodeRing::pinned`] and
//! the pool's statistics (`registered_bytes` per node) say what is pinned.
//!
//! Needs Linux 5.19 or later (sparse registration and updates came in
//! 5.13, buffer rings in 5.19); [`NodeRing::new`] on an older kernel fails
//! with the `io_uring_register` error (`EINVAL`) instead of later.
//!
//! ```no_run
//! use std::os::fd::AsRawFd;
//! use io_uring::{opcode, types};
//! use numaweave::io::uring::NodeRing;
//!
//! let ring = NodeRing::new(0, 4096, 64).unwrap();
//! let file = std::fs::File::open("/etc/hostname").unwrap();
//! let mut buf = ring.alloc().unwrap();
//! let read = opcode::ReadFixed::new(types::Fd(file.as_raw_fd()), buf.as_mut_ptr(), 4096, buf.index())
//!     .build()
//!     .user_data(1);
//! // SAFETY: the buffer and the file outlive the request.
//! let n = unsafe { ring.run_one(&read) }.unwrap();
//! assert!(n > 0);
//! ```

use core::cell::Cell;
use core::marker::PhantomData;
use core::ops::{Deref, DerefMut};
use core::ptr::NonNull;
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use io_uring::IoUring;
use io_uring::squeue::Entry;

use crate::error::{Error, Result};
use crate::os::mem::memlock_limit;
use crate::os::thread::fork_generation;
use crate::slab::{DmaBuf, DmaPool, OffNodePins, Refusal, Region, Registrar};

/// Bytes pinned by every [`FixedBuffers`] of the process.
static PINNED: AtomicU64 = AtomicU64::new(0);

/// Books `len` more pinned bytes within the soft `RLIMIT_MEMLOCK`, or
/// books nothing and returns the limit and what was pinned before. Booked
/// before the kernel is asked, so that two rings racing for the last of
/// the limit cannot both pass.
fn pin(len: u64) -> core::result::Result<(), (u64, u64)> {
    let pinned = PINNED.fetch_add(len, Ordering::Relaxed);
    match memlock_limit() {
        Some(limit) if pinned + len > limit => {
            PINNED.fetch_sub(len, Ordering::Relaxed);
            Err((limit, pinned))
        }
        _ => Ok(()),
    }
}

/// Gives back what [`pin`] booked.
fn unpin(len: u64) {
    PINNED.fetch_sub(len, Ordering::Relaxed);
}

/// Granule of the address-to-slot map: a region covers whole granules but
/// at its ends, where another region may start.
const GRANULE_SHIFT: u32 = 21;

/// The table of one ring's registered buffers: which slot each region of
/// the pool has.
#[derive(Default)]
struct Table {
    /// Slots taken, by slot: the region's start and length.
    slots: Vec<Option<(usize, usize)>>,
    /// Per 2 MiB granule, the slots of the regions that touch it (one or
    /// two but where regions are small).
    granules: HashMap<usize, Vec<u16>>,
    /// Rings that hold a clone of this table ([`NodeTable`]): each change
    /// of a slot reaches them under this table's lock (`table::to_followers`).
    followers: Vec<table::Follower>,
    /// The kernel clones a table over one that has buffers (Linux 6.13):
    /// a change is cloned into each follower; else (6.12) a follower
    /// registers a region that came after its clone itself.
    ranges: bool,
    /// The node the table's regions are on (for a follower's errors).
    node: usize,
}

impl Table {
    fn granules(start: usize, len: usize) -> core::ops::RangeInclusive<usize> {
        (start >> GRANULE_SHIFT)..=((start + len - 1) >> GRANULE_SHIFT)
    }
}

/// A [`Registrar`] that puts each region of a pool into a slot of one
/// ring's sparse registered-buffer table, within `RLIMIT_MEMLOCK` (see the
/// [module documentation](self)). [`NodeRing`] makes and uses one; it is
/// public for rings the application makes itself, which must have a sparse
/// table of `slots` entries registered ([`FixedBuffers::new`] does it).
///
/// A table is its process's. A forked child shares the ring (the same
/// kernel object) with its parent, so there it makes no kernel call and
/// takes no lock (a parent's thread may have held it at the fork): no
/// region has a slot in the child, registering is refused (`EPERM`), and
/// giving a region back leaves the parent's slot alone.
pub struct FixedBuffers {
    ring: Arc<IoUring>,
    table: Mutex<Table>,
    /// Bumped as a region leaves its slot: a slot found before and the
    /// same generation now is still that region's.
    generation: AtomicU64,
    /// The fork generation of the process that made the table
    /// (`os::thread::fork_generation`).
    forks: u64,
}

impl FixedBuffers {
    /// Registers a sparse table of `slots` buffers (at most 16,384) on
    /// `ring` and returns the registrar that fills it.
    pub fn new(ring: Arc<IoUring>, slots: u16) -> Result<Arc<Self>> {
        crate::os::failpoint::check(crate::os::failpoint::Call::UringRegister)?;
        ring.submitter()
            .register_buffers_sparse(u32::from(slots))
            .map_err(|e| io_error("io_uring_register(IORING_REGISTER_BUFFERS2)", &e))?;
        let table = Table { slots: vec![None; usize::from(slots)], ..Table::default() };
        let forks = fork_generation();
        Ok(Arc::new(Self { ring, table: Mutex::new(table), generation: AtomicU64::new(0), forks }))
    }

    /// Whether this process made the table (not a forked child of it).
    fn ours(&self) -> bool {
        fork_generation() == self.forks
    }

    /// The slot of the registered region that holds `len` bytes at `p`, if
    /// one does: a hash lookup and a scan of one or two entries.
    pub fn index_of(&self, p: *const u8, len: usize) -> Option<u16> {
        self.find(p as usize, len).map(|hit| hit.slot)
    }

    /// The region holding `len` bytes at `a`, its slot, and the generation
    /// the answer holds for.
    fn find(&self, a: usize, len: usize) -> Option<Hit> {
        if !self.ours() {
            return None;
        }
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        // Read under the lock, which unregistering holds as it bumps it.
        let generation = self.generation.load(Ordering::Relaxed);
        let slots = t.granules.get(&(a >> GRANULE_SHIFT))?;
        slots.iter().copied().find_map(|s| {
            let (start, l) = t.slots[usize::from(s)]?;
            (a >= start && a + len <= start + l).then_some(Hit { start, len: l, slot: s, generation })
        })
    }

    /// Bytes this table has registered (pinned) now.
    pub fn registered(&self) -> u64 {
        if !self.ours() {
            return 0;
        }
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        t.slots.iter().flatten().map(|&(_, len)| len as u64).sum()
    }

    /// Bytes every table of the process has pinned now.
    pub fn pinned_in_process() -> u64 {
        PINNED.load(Ordering::Relaxed)
    }

    fn update(&self, slot: u16, iov: libc::iovec) -> io::Result<()> {
        // SAFETY: the iovec names a region of a pool's memory that stays
        // mapped until this slot is updated to the empty iovec (the pool
        // unregisters before it unmaps), or the empty iovec itself.
        unsafe { self.ring.submitter().register_buffers_update(u32::from(slot), &[iov], None) }
    }
}

impl Registrar for FixedBuffers {
    fn register(&self, r: &Region) -> core::result::Result<(), Refusal> {
        if !self.ours() {
            return Err(Refusal::Errno(libc::EPERM));
        }
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let Some(slot) = t.slots.iter().position(Option::is_none) else {
            return Err(Refusal::Errno(libc::ENOSPC));
        };
        let len = r.len as u64;
        pin(len).map_err(|(limit, pinned)| Refusal::Memlock { limit, pinned })?;
        let slot = slot as u16;
        let iov = libc::iovec { iov_base: r.addr.as_ptr().cast(), iov_len: r.len };
        let refused = crate::os::failpoint::check(crate::os::failpoint::Call::UringRegister)
            .map_err(|e| e.errno().unwrap_or(libc::EIO))
            .and_then(|()| self.update(slot, iov).map_err(|e| e.raw_os_error().unwrap_or(libc::EIO)));
        if let Err(errno) = refused {
            unpin(len);
            return Err(Refusal::Errno(errno));
        }
        let start = r.addr.as_ptr() as usize;
        t.slots[usize::from(slot)] = Some((start, r.len));
        for g in Table::granules(start, r.len) {
            t.granules.entry(g).or_default().push(slot);
        }
        self.to_followers(&mut t, slot, true);
        Ok(())
    }

    fn unregister(&self, r: &Region) {
        if !self.ours() {
            // The slot is the parent's (a child's pool never registers).
            return;
        }
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        // Its slot, through the map: one of the few that touch its first granule.
        let Some(slot) = Self::slot_in(&t, r) else {
            debug_assert!(false, "a region unregistered that this table does not hold");
            return;
        };
        // The slot empty again before the pool unmaps the region. (It
        // cannot fail for a slot this table filled; if it did, the ring
        // would keep the pages pinned, not point at freed memory.)
        let _ = self.update(slot, libc::iovec { iov_base: core::ptr::null_mut(), iov_len: 0 });
        self.to_followers(&mut t, slot, false);
        self.forget(&mut t, slot, r);
    }

    /// A ring's buffers can move: the slot is emptied (the kernel drops its
    /// pin once the requests using it complete), and filled again with the
    /// same region after the move, so every buffer keeps its index.
    fn can_move(&self) -> bool {
        true
    }

    fn release_for_move(&self, r: &Region) -> core::result::Result<(), Refusal> {
        if !self.ours() {
            return Err(Refusal::Errno(libc::EPERM));
        }
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let slot = Self::slot_in(&t, r).ok_or(Refusal::Errno(libc::ENOENT))?;
        // Fixed I/O on the region's buffers fails (`EFAULT`) until the slot
        // is filled again; the slot stays taken in the table meanwhile.
        self.update(slot, libc::iovec { iov_base: core::ptr::null_mut(), iov_len: 0 })
            .map_err(|e| Refusal::Errno(e.raw_os_error().unwrap_or(libc::EIO)))?;
        // The clones' references to the pages go too, or they stay pinned.
        self.to_followers(&mut t, slot, false);
        Ok(())
    }

    /// A refusal gives the slot and its `RLIMIT_MEMLOCK` booking back (the
    /// slot is empty since the release): the region is no longer this
    /// table's, and a buffer of it finds no slot until the pool registers
    /// it again ([`NodeRing::alloc`] asks).
    fn register_moved(&self, r: &Region) -> core::result::Result<(), Refusal> {
        if !self.ours() {
            return Err(Refusal::Errno(libc::EPERM));
        }
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let slot = Self::slot_in(&t, r).ok_or(Refusal::Errno(libc::ENOENT))?;
        let iov = libc::iovec { iov_base: r.addr.as_ptr().cast(), iov_len: r.len };
        let refused = crate::os::failpoint::check(crate::os::failpoint::Call::UringRegister)
            .map_err(|e| e.errno().unwrap_or(libc::EIO))
            .and_then(|()| self.update(slot, iov).map_err(|e| e.raw_os_error().unwrap_or(libc::EIO)));
        if let Err(errno) = refused {
            self.forget(&mut t, slot, r);
            return Err(Refusal::Errno(errno));
        }
        self.to_followers(&mut t, slot, true);
        Ok(())
    }
}

impl FixedBuffers {
    /// Slot `slot` of the primary ring changed: every follower follows
    /// (`table::to_followers`).
    fn to_followers(&self, t: &mut Table, slot: u16, filled: bool) {
        table::to_followers(&self.ring, t, slot, filled);
    }

    /// Takes region `r`, in `slot` (empty in the ring), off the table: the
    /// slot free, the generation bumped (a slot found before is stale),
    /// its pages no longer counted as pinned.
    fn forget(&self, t: &mut Table, slot: u16, r: &Region) {
        let start = r.addr.as_ptr() as usize;
        t.slots[usize::from(slot)] = None;
        self.generation.fetch_add(1, Ordering::Release);
        for g in Table::granules(start, r.len) {
            if let Some(v) = t.granules.get_mut(&g) {
                v.retain(|&s| s != slot);
                if v.is_empty() {
                    t.granules.remove(&g);
                }
            }
        }
        unpin(r.len as u64);
    }

    /// The slot `r` holds in `t`, through the granule map.
    fn slot_in(t: &Table, r: &Region) -> Option<u16> {
        let start = r.addr.as_ptr() as usize;
        t.granules
            .get(&(start >> GRANULE_SHIFT))
            .and_then(|v| v.iter().copied().find(|&s| t.slots[usize::from(s)] == Some((start, r.len))))
    }
}

/// A region found in a [`FixedBuffers`] table, and when.
#[derive(Clone, Copy)]
struct Hit {
    start: usize,
    len: usize,
    slot: u16,
    generation: u64,
}

fn io_error(call: &'static str, e: &io::Error) -> Error {
    Error::Os { call, errno: e.raw_os_error().unwrap_or(libc::EIO) }
}

/// A ring and a pool of fixed buffers on one node: see the [module
/// documentation](self). Used from one thread at a time (it is `Send`, not
/// `Sync`): the submission and completion queues are its own.
pub struct NodeRing {
    // Dropped first: the pool's regions are unregistered (those whose
    // buffers are all back) while the table and ring still exist; the
    // table, held by the pool's registrar too, keeps the ring open until
    // the last region goes.
    pool: Arc<DmaPool>,
    fixed: Arc<FixedBuffers>,
    ring: Arc<IoUring>,
    node: usize,
    /// A ring of a [`NodeTable`]: its clone of the node's table lacks a
    /// change when set.
    stale: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// The table it clones (kept alive: its primary ring holds the pins).
    table: Option<Arc<NodeTable>>,
    /// The region of the last buffer handed out: the next buffer usually
    /// lies in it, and then needs no lookup (no lock) for its slot.
    last: Cell<Option<Hit>>,
    /// A [`Submission`] is live; a [`Completion`] is live. (Flags, not
    /// `&mut self`: buffers borrow the ring while requests are queued.)
    sq_busy: Cell<bool>,
    cq_busy: Cell<bool>,
    _not_sync: PhantomData<Cell<()>>,
}

/// One of the ring's queues, held by one user at a time: [`Submission`]
/// and [`Completion`] ([`NodeRing::submission`], [`NodeRing::completion`]).
/// Its flag is cleared as it drops (the queue itself then publishes its
/// head or tail).
pub struct Queue<'a, Q> {
    queue: Q,
    busy: &'a Cell<bool>,
}

/// The ring's submission queue, one at a time.
pub type Submission<'a> = Queue<'a, io_uring::SubmissionQueue<'a, Entry>>;

/// The ring's completion queue, one at a time.
pub type Completion<'a> = Queue<'a, io_uring::CompletionQueue<'a>>;

impl<Q> Deref for Queue<'_, Q> {
    type Target = Q;
    fn deref(&self) -> &Q {
        &self.queue
    }
}

impl<Q> DerefMut for Queue<'_, Q> {
    fn deref_mut(&mut self) -> &mut Q {
        &mut self.queue
    }
}

impl<Q> Drop for Queue<'_, Q> {
    fn drop(&mut self) {
        self.busy.set(false);
    }
}

/// A buffer of a [`NodeRing`]'s pool, with the slot of the registered
/// region it lies in: `buf_index` of a `READ_FIXED`/`WRITE_FIXED` of it.
pub struct FixedBuf<'a> {
    buf: DmaBuf<'a>,
    index: u16,
}

impl FixedBuf<'_> {
    /// The registered-buffer slot that holds this buffer.
    pub fn index(&self) -> u16 {
        self.index
    }

    /// The buffer's first byte (for the SQE's address).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.buf.as_ptr()
    }
}

impl Deref for FixedBuf<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf
    }
}

impl DerefMut for FixedBuf<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }
}

impl Drop for NodeRing {
    fn drop(&mut self) {
        // A ring of a table leaves it: the bookings of the regions it
        // registered itself come back (the kernel unpins as it closes).
        if let (Some(stale), Some(table)) = (&self.stale, &self.table) {
            table.leave(stale);
        }
    }
}

impl NodeRing {
    /// A ring of `entries` submission entries and a pool of `buf_size`-byte
    /// buffers (up to 1 MiB) on `node`, its regions registered as they
    /// come (up to 1,024 regions: a pool of tens of GiB).
    ///
    /// A region whose pages the kernel moves to another node as it pins
    /// them (the node's memory is movable, as a CXL node's usually is)
    /// fails the allocation that needed it with
    /// [`Error::PinsLeftNode`]: see [`with_pins`](Self::with_pins).
    pub fn new(node: usize, buf_size: usize, entries: u32) -> Result<Self> {
        Self::with_pins(node, buf_size, entries, OffNodePins::Refuse)
    }

    /// [`new`](Self::new), with what a region whose pages the kernel pinned
    /// off the node does: [`OffNodePins::Report`] keeps it and counts its
    /// pages in the pool's `pinned_off_node` (its statistics per node).
    ///
    /// ```no_run
    /// use numaweave::io::uring::NodeRing;
    /// use numaweave::slab::OffNodePins;
    ///
    /// // Buffers on node 2 (a CXL expander, onlined movable), wherever the
    /// // kernel pins them; how many bytes left the node is counted.
    /// let ring = NodeRing::with_pins(2, 4096, 64, OffNodePins::Report).unwrap();
    /// let buf = ring.alloc().unwrap();
    /// let off = ring.pool().cache().stats().total().pinned_off_node;
    /// println!("{off} bytes pinned off node 2");
    /// # drop(buf);
    /// ```
    pub fn with_pins(node: usize, buf_size: usize, entries: u32, pins: OffNodePins) -> Result<Self> {
        let ring = Arc::new(IoUring::new(entries).map_err(|e| io_error("io_uring_setup", &e))?);
        let fixed = FixedBuffers::new(ring.clone(), 1024)?;
        let pool = DmaPool::builder("uring_fixed", buf_size)
            .node(node)
            .registrar(fixed.clone())
            .off_node_pins(pins)
            .build()?;
        Ok(Self {
            pool: Arc::new(pool),
            fixed,
            ring,
            node,
            stale: None,
            table: None,
            last: Cell::new(None),
            sq_busy: Cell::new(false),
            cq_busy: Cell::new(false),
            _not_sync: PhantomData,
        })
    }

    /// A buffer on the ring's node (the nearest with memory when it is out
    /// of it), in a registered region. Fails as [`DmaPool::alloc`] does, and
    /// with [`Error::MemlockLimit`] when its region would pass
    /// `RLIMIT_MEMLOCK` (and [`Error::PinsLeftNode`], see [`new`](Self::new)). A region a migration left unregistered (the kernel
    /// refused it again after the move) is registered again here, in a
    /// slot of its own; a refusal is the error (the buffer goes back).
    pub fn alloc(&self) -> Result<FixedBuf<'_>> {
        let buf = self.pool.alloc()?;
        let (a, len) = (buf.as_ptr() as usize, self.pool.buffer_size());
        // The last region still holds its slot if no region has left the
        // table since (a slot is emptied only by unregistering or a refused
        // registration after a move, which bump the generation); the buffer,
        // live, is in a region of the pool, and regions do not overlap, so
        // if it lies in the last one that is its region. Acquire pairs with
        // the bump's release.
        let index = match self.last.get() {
            Some(h)
                if a >= h.start
                    && a + len <= h.start + h.len
                    && self.fixed.generation.load(Ordering::Acquire) == h.generation =>
            {
                h.slot
            }
            _ => {
                let h = match self.fixed.find(a, len) {
                    Some(h) => h,
                    None => {
                        // SAFETY: a live buffer of this pool.
                        let again = unsafe { self.pool.cache().register_again(NonNull::new_unchecked(buf.as_ptr())) };
                        match again.map(|_| self.fixed.find(a, len)) {
                            Ok(Some(h)) => h,
                            Ok(None) => {
                                debug_assert!(false, "a buffer of a registered pool in no registered region");
                                return Err(Error::Registration { node: self.node, len, errno: libc::ENOENT });
                            }
                            Err(e) => return Err(e),
                        }
                    }
                };
                self.last.set(Some(h));
                h.slot
            }
        };
        debug_assert_eq!(self.fixed.index_of(buf.as_ptr(), len), Some(index));
        // The buffer's region may be new to the node's table: this ring's
        // clone takes it before the buffer's index is used here. A change
        // it still cannot take fails the allocation only if it is this
        // buffer's slot (the buffer goes back).
        if let Err(e) = self.sync()
            && let (Some(stale), Some(table)) = (&self.stale, &self.table)
            && table.lacks(stale, index)
        {
            return Err(e);
        }
        Ok(FixedBuf { buf, index })
    }

    /// For a ring of a [`NodeTable`]: makes the changes of the node's table
    /// this ring could not take as they were made (a region its own
    /// registration of which the memlock limit refused on Linux 6.12, a
    /// failed clone or update), and says the error of one still refused.
    /// [`alloc`](Self::alloc) does it before handing out a buffer. Nothing
    /// to do for a ring of its own, or when nothing failed; `EPERM` in a
    /// forked child.
    pub fn sync(&self) -> Result<()> {
        match (&self.stale, &self.table) {
            (Some(stale), Some(table)) if stale.load(Ordering::Acquire) => table.resync(stale),
            _ => Ok(()),
        }
    }

    /// The node the ring's buffers are on.
    pub fn node(&self) -> usize {
        self.node
    }

    /// The pool the buffers come from (statistics, `shrink`).
    pub fn pool(&self) -> &DmaPool {
        &self.pool
    }

    /// Bytes of this ring's registered regions (pinned).
    pub fn pinned(&self) -> u64 {
        self.fixed.registered()
    }

    /// The submission queue. Panics if one is live already.
    pub fn submission(&self) -> Submission<'_> {
        assert!(!self.sq_busy.replace(true), "a second submission queue of a NodeRing while one is live");
        Queue {
            // SAFETY: no other submission queue of the ring exists: this
            // `NodeRing` is used from one thread (not `Sync`), its flag
            // says none of its own is live, and the ring's other holder
            // (the registrar) makes only `io_uring_register` calls, which
            // do not touch the queue.
            queue: unsafe { self.ring.submission_shared() },
            busy: &self.sq_busy,
        }
    }

    /// The completion queue. Panics if one is live already.
    pub fn completion(&self) -> Completion<'_> {
        assert!(!self.cq_busy.replace(true), "a second completion queue of a NodeRing while one is live");
        Queue {
            // SAFETY: as for `submission`: no other completion queue of the
            // ring exists.
            queue: unsafe { self.ring.completion_shared() },
            busy: &self.cq_busy,
        }
    }

    /// Submits what is queued and waits for `want` completions.
    pub fn submit_and_wait(&self, want: usize) -> Result<usize> {
        self.ring.submit_and_wait(want).map_err(|e| io_error("io_uring_enter", &e))
    }

    /// Runs one request on a ring with nothing else in flight (one request
    /// at a time, as a synchronous caller issues them): queues `entry`,
    /// submits it, waits for its completion and returns its result (bytes,
    /// or a negated errno). Fails with `EBUSY` when the submission queue is
    /// full.
    ///
    /// # Safety
    /// What `entry` names (its buffer, its file) stays valid until this
    /// returns, as the io_uring crate's `push` asks.
    pub unsafe fn run_one(&self, entry: &Entry) -> Result<i32> {
        // SAFETY: the caller's word, passed on.
        Ok(unsafe { self.run_one_entry(entry) }?.result())
    }

    /// As [`run_one`](Self::run_one), returning the whole completion (its
    /// flags name a selected buffer).
    ///
    /// # Safety
    /// As [`run_one`](Self::run_one).
    pub unsafe fn run_one_entry(&self, entry: &Entry) -> Result<io_uring::cqueue::Entry> {
        // SAFETY: the caller keeps what `entry` names valid until its
        // completion, reaped below before returning.
        unsafe { self.submission().push(entry) }
            .map_err(|_| Error::Os { call: "io_uring (queue full)", errno: libc::EBUSY })?;
        self.submit_and_wait(1)?;
        Ok(self.completion().next().expect("io_uring_enter waited for a completion"))
    }
}

mod buf_ring;
mod table;
pub use buf_ring::{BufRing, ProvidedBuf};
pub use table::{NodeTable, Sharing};
