//! Provided-buffer rings of a [`NodeRing`]: buffers of its pool lent to the
//! kernel, which picks one when data arrives.

use core::cell::Cell;
use core::marker::PhantomData;
use core::ops::{Deref, DerefMut};
use core::ptr::NonNull;
use std::sync::atomic::Ordering;

use io_uring::squeue::Entry;
use io_uring::types::IOU_PBUF_RING_INC;

use super::{NodeRing, io_error, pin, unpin};
use crate::error::{Error, Result};
use crate::os::mem::{Mapping, MemPolicy};
use crate::slab::DmaPool;
use crate::topology::Topology;

/// Bytes of one entry of a provided-buffer ring (`struct io_uring_buf`:
/// address, length, buffer id; the first entry's last two bytes are the
/// ring's tail).
const BUF_ENTRY: usize = 16;

/// Where the tail lives: the `resv` field of entry 0 (`struct
/// io_uring_buf_ring`'s union).
const TAIL_OFFSET: usize = 14;

/// A provided-buffer ring (`IORING_REGISTER_PBUF_RING`, Linux 5.19) of a
/// [`NodeRing`]: `entries` buffers of the ring's pool, on its node, lent to
/// the kernel as buffer group [`bgid`](Self::bgid). A read or receive that
/// selects a buffer (`IOSQE_BUFFER_SELECT`, [`recv`](Self::recv),
/// [`read`](Self::read)) gets one when data arrives, not when it is
/// submitted, so a server with thousands of idle sockets needs buffers for
/// the data in flight only. The completion names the buffer;
/// [`take`](Self::take) turns it into a [`ProvidedBuf`] holding the bytes
/// received, which goes back into the ring when it drops, ready for the
/// next request. The ring's entries live on the node too (one page or a
/// few, pinned by the kernel: counted against `RLIMIT_MEMLOCK` with the
/// fixed buffers).
///
/// An *incremental* ring ([`NodeRing::buf_ring_incremental`],
/// `IOU_PBUF_RING_INC`, Linux 6.12) lets the kernel consume a buffer in
/// pieces: each completion takes the next bytes of the buffer at the
/// ring's head, so a pool of large buffers (64 KiB, a hugepage run) serves
/// many small receives, not one each. It is for sockets and pipes: a
/// completion of no bytes, or a failure, does not say whether the kernel
/// took its buffer (a regular file's read takes the rest of it when it
/// begins), so that buffer stays out of the ring until the ring drops
/// rather than risk being in it twice. Requests that select from it ask
/// for a whole buffer ([`recv`](Self::recv), [`read`](Self::read)): one
/// that asks for less and runs from io-wq takes part of a buffer without
/// saying where the next piece starts. [`take`](Self::take) then hands out
/// each piece as a [`ProvidedBuf`]; the buffer goes back into the ring once
/// the kernel is done with it (a completion without `IORING_CQE_F_BUF_MORE`)
/// and every piece of it has dropped. [`buffers_used`](Self::buffers_used)
/// and [`bytes_received`](Self::bytes_received) say how well the buffers
/// are used.
///
/// One thread uses it (it is neither `Send` nor `Sync`), as it uses the
/// `NodeRing`: the application is the ring's one producer. It is dropped
/// only when no request that selects from it is in flight (what the
/// submitter of such a request promises for the buffers it names): a read
/// of a file takes its buffer when it starts, and the kernel writes it
/// until the read completes.
///
/// ```no_run
/// use std::io::Write;
/// use std::os::fd::AsRawFd;
/// use numaweave::io::uring::NodeRing;
///
/// let ring = NodeRing::new(0, 4096, 64).unwrap();
/// let group = ring.buf_ring(7, 16).unwrap();
/// let (mut tx, rx) = std::os::unix::net::UnixStream::pair().unwrap();
/// tx.write_all(b"hello").unwrap();
/// // SAFETY: the socket outlives the request; the buffer is the ring's.
/// let cqe = unsafe { ring.run_one_entry(&group.recv(rx.as_raw_fd())) }.unwrap();
/// let buf = group.take(&cqe).unwrap().expect("a buffer was selected");
/// assert_eq!(&*buf, b"hello");
/// drop(buf); // back in the ring
/// ```
pub struct BufRing<'a> {
    owner: &'a NodeRing,
    bgid: u16,
    /// The ring's entries, bound to the ring's node.
    mem: Mapping,
    /// Buffer by id, from the owner's pool.
    bufs: Box<[NonNull<u8>]>,
    /// Whether the kernel holds each buffer (in the ring, not taken; for
    /// an incremental ring, not yet consumed whole).
    lent: Box<[Cell<bool>]>,
    /// Consumed in pieces (`IOU_PBUF_RING_INC`).
    incremental: bool,
    /// Per buffer, the bytes the kernel has filled so far: where its next
    /// piece starts (incremental rings; 0 otherwise).
    filled: Box<[Cell<u32>]>,
    /// Per buffer, pieces the application holds.
    pieces: Box<[Cell<u32>]>,
    /// Per buffer, the ring entry it was last provided in: while the
    /// kernel holds the buffer, the entry's length is what it has left.
    entry: Box<[Cell<u16>]>,
    /// Buffers handed back after a use, and bytes taken (cumulative).
    used: Cell<u64>,
    received: Cell<u64>,
    /// The next tail to publish; entries below it are the kernel's.
    tail: Cell<u16>,
    _not_send_sync: PhantomData<*mut u8>,
}

/// Buffers of a pool taken for a buffer ring that is not made yet: given
/// back if the making fails (null slots, not filled, are skipped).
struct Lent<'p> {
    pool: &'p DmaPool,
    bufs: Vec<*mut u8>,
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        let taken: Vec<NonNull<u8>> = self.bufs.iter().filter_map(|&p| NonNull::new(p)).collect();
        // SAFETY: buffers of `pool` from its `alloc_bulk`, not lent to the
        // kernel (the ring was not registered), each given back once.
        unsafe { self.pool.free_bulk(&taken) };
    }
}

/// A buffer the kernel filled, taken from a [`BufRing`] by
/// [`BufRing::take`]: derefs to the bytes received and goes back into the
/// ring as it drops.
pub struct ProvidedBuf<'r> {
    ring: &'r BufRing<'r>,
    bid: u16,
    /// Where the piece starts in its buffer (0 but in incremental rings).
    off: usize,
    len: usize,
}

impl ProvidedBuf<'_> {
    /// The buffer's id in its group.
    pub fn bid(&self) -> u16 {
        self.bid
    }

    /// Where the bytes start in the buffer: 0, but for the second and
    /// later pieces of an incremental ring's buffer.
    pub fn offset(&self) -> usize {
        self.off
    }
}

impl Deref for ProvidedBuf<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: buffer `bid` is live (the ring holds it until it drops),
        // `off + len` is at most its size (checked in `take`), the kernel
        // wrote these bytes before posting the completion and does not
        // touch them again until the buffer is recycled, which waits for
        // this guard (an incremental ring's kernel writes only past the
        // bytes it has filled, and this piece lies below them), and no
        // other guard covers them (pieces of a buffer do not overlap).
        unsafe { core::slice::from_raw_parts(self.ring.bufs[usize::from(self.bid)].as_ptr().add(self.off), self.len) }
    }
}

impl DerefMut for ProvidedBuf<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`; `&mut self` makes this the only view of
        // the piece.
        unsafe {
            core::slice::from_raw_parts_mut(self.ring.bufs[usize::from(self.bid)].as_ptr().add(self.off), self.len)
        }
    }
}

impl Drop for ProvidedBuf<'_> {
    fn drop(&mut self) {
        self.ring.put_piece(self.bid);
    }
}

impl NodeRing {
    /// A provided-buffer ring of `entries` buffers from this ring's pool
    /// (a power of two, at most 32,768) as buffer group `bgid`; see
    /// [`BufRing`]. Fails with the pool's error when it has no buffers,
    /// with [`Error::MemlockLimit`] when the ring's entries would pass
    /// `RLIMIT_MEMLOCK`, and with the `io_uring_register` error when the
    /// kernel refuses (`EINVAL` before Linux 5.19, `EEXIST` for a group
    /// taken); nothing is kept.
    pub fn buf_ring(&self, bgid: u16, entries: u16) -> Result<BufRing<'_>> {
        self.make_buf_ring(bgid, entries, false)
    }

    /// An incremental provided-buffer ring (`IOU_PBUF_RING_INC`, Linux
    /// 6.12): the kernel fills each buffer in pieces, one receive after
    /// another (see [`BufRing`]), so the pool's buffers can be large (a
    /// `NodeRing` of 64 KiB buffers, or on huge pages) without a buffer
    /// per small message. On an older kernel (`EINVAL`) the ring is made
    /// whole-buffer instead ([`BufRing::is_incremental`] says which);
    /// otherwise it fails as [`buf_ring`](Self::buf_ring) does.
    pub fn buf_ring_incremental(&self, bgid: u16, entries: u16) -> Result<BufRing<'_>> {
        match self.make_buf_ring(bgid, entries, true) {
            Err(Error::Os { errno: libc::EINVAL, .. }) => self.make_buf_ring(bgid, entries, false),
            r => r,
        }
    }

    fn make_buf_ring(&self, bgid: u16, entries: u16, incremental: bool) -> Result<BufRing<'_>> {
        if !entries.is_power_of_two() || entries > 1 << 15 {
            return Err(Error::InvalidRing { reason: "a buffer ring's entries are a power of two up to 32768" });
        }
        let n = usize::from(entries);
        // The entries on the node, in a mapping of their own: page-aligned,
        // as the kernel asks of memory it maps for the ring (unmapped when
        // dropped, so every early return below gives it back).
        let bytes = (n * BUF_ENTRY).max(crate::os::page_size());
        let mem = Mapping::map(bytes).map_err(|_| Error::NodeOutOfMemory { node: self.node })?;
        mem.bind(MemPolicy::Preferred(Topology::global().physical_node(self.node)))?;
        let mut bufs = Lent { pool: &self.pool, bufs: vec![core::ptr::null_mut(); n] };
        if let Err(e) = self.pool.alloc_bulk(&mut bufs.bufs) {
            // All or none: none taken, whatever the slots hold.
            bufs.bufs.clear();
            return Err(e);
        }
        pin(bytes as u64).map_err(|(limit, pinned)| Error::MemlockLimit {
            node: self.node,
            limit,
            pinned,
            asked: bytes,
        })?;
        // SAFETY: `mem` is a fresh writable mapping of `bytes` bytes; the
        // tail must read 0 when the kernel first looks.
        unsafe { mem.as_ptr().write_bytes(0, bytes) };
        // (The registration: `mem` holds `entries` entries, is page-aligned
        // and stays mapped until `BufRing::drop` unregisters the group
        // first.)
        let reg = crate::os::failpoint::check(crate::os::failpoint::Call::UringRegister).and_then(|()| {
            let flags = if incremental { IOU_PBUF_RING_INC as u16 } else { 0 };
            // SAFETY: `mem` holds `entries` entries, is page-aligned and
            // stays mapped until `BufRing::drop` unregisters the group first.
            unsafe { self.ring.submitter().register_buf_ring_with_flags(mem.as_ptr() as u64, entries, bgid, flags) }
                .map_err(|e| io_error("io_uring_register(IORING_REGISTER_PBUF_RING, Linux 5.19)", &e))
        });
        if let Err(e) = reg {
            unpin(bytes as u64);
            return Err(e);
        }
        let bufs: Box<[NonNull<u8>]> =
            core::mem::take(&mut bufs.bufs).into_iter().map(|p| NonNull::new(p).expect("alloc_bulk fills")).collect();
        let ring = BufRing {
            owner: self,
            bgid,
            mem,
            bufs,
            lent: (0..n).map(|_| Cell::new(false)).collect(),
            incremental,
            filled: (0..n).map(|_| Cell::new(0)).collect(),
            pieces: (0..n).map(|_| Cell::new(0)).collect(),
            entry: (0..n).map(|_| Cell::new(0)).collect(),
            used: Cell::new(0),
            received: Cell::new(0),
            tail: Cell::new(0),
            _not_send_sync: PhantomData,
        };
        for bid in 0..entries {
            ring.provide(bid);
        }
        Ok(ring)
    }
}

impl<'a> BufRing<'a> {
    /// The buffer group id requests name (`buf_group`).
    pub fn bgid(&self) -> u16 {
        self.bgid
    }

    /// Buffers in the ring.
    pub fn entries(&self) -> u16 {
        self.bufs.len() as u16
    }

    /// Bytes per buffer (the owner's pool's).
    pub fn buffer_size(&self) -> usize {
        self.owner.pool.buffer_size()
    }

    /// Buffers the kernel holds now, ready for data (the rest are taken).
    pub fn available(&self) -> usize {
        self.lent.iter().filter(|l| l.get()).count()
    }

    /// Whether the kernel consumes the buffers in pieces
    /// ([`NodeRing::buf_ring_incremental`] on Linux 6.12 or later).
    pub fn is_incremental(&self) -> bool {
        self.incremental
    }

    /// Buffers handed back into the ring after the kernel filled them
    /// (cumulative): against [`bytes_received`](Self::bytes_received), how
    /// much of each buffer a use filled.
    pub fn buffers_used(&self) -> u64 {
        self.used.get()
    }

    /// Bytes of every piece [`take`](Self::take) handed out (cumulative).
    pub fn bytes_received(&self) -> u64 {
        self.received.get()
    }

    /// Bytes the kernel pins for the ring's entries.
    pub fn pinned(&self) -> u64 {
        self.mem.len() as u64
    }

    /// A receive of up to a buffer's size from socket `fd` into a buffer
    /// the kernel selects from this group (`IORING_OP_RECV` with
    /// `IOSQE_BUFFER_SELECT`).
    pub fn recv(&self, fd: std::os::fd::RawFd) -> Entry {
        io_uring::opcode::Recv::new(io_uring::types::Fd(fd), core::ptr::null_mut(), self.buffer_size() as u32)
            .buf_group(self.bgid)
            .build()
            .flags(io_uring::squeue::Flags::BUFFER_SELECT)
    }

    /// A read of up to a buffer's size at `offset` of file `fd` into a
    /// buffer the kernel selects from this group.
    pub fn read(&self, fd: std::os::fd::RawFd, offset: u64) -> Entry {
        io_uring::opcode::Read::new(io_uring::types::Fd(fd), core::ptr::null_mut(), self.buffer_size() as u32)
            .offset(offset)
            .buf_group(self.bgid)
            .build()
            .flags(io_uring::squeue::Flags::BUFFER_SELECT)
    }

    /// The buffer a completion of this group's request filled: `Ok(None)`
    /// when the kernel selected none (a request that ended before data
    /// came), or, in an incremental ring, filled no byte of it; an
    /// [`Error::Os`] with the request's errno when it failed (`ENOBUFS`:
    /// every buffer was taken; a buffer the failed request selected stays
    /// the kernel's); [`Error::BufferNotLent`] when the completion names a
    /// buffer this ring does not lend (one taken already, or another
    /// group's) or, in an incremental ring, bytes the kernel has not
    /// consumed. Completions are taken once each, in the order the kernel
    /// posted them (as the completion queue gives them): an incremental
    /// ring's pieces are cut in that order.
    pub fn take(&self, cqe: &io_uring::cqueue::Entry) -> Result<Option<ProvidedBuf<'_>>> {
        let Some(bid) = io_uring::cqueue::buffer_select(cqe.flags()) else {
            return if cqe.result() < 0 {
                Err(Error::Os { call: "io_uring (buffer-select request)", errno: -cqe.result() })
            } else {
                Ok(None)
            };
        };
        let i = usize::from(bid);
        if !self.lent.get(i).is_some_and(Cell::get) {
            return Err(Error::BufferNotLent { group: self.bgid, bid });
        }
        let res = cqe.result();
        let failed = |errno| Err(Error::Os { call: "io_uring (buffer-select request)", errno });
        let (off, len) = if self.incremental {
            let off = self.filled[i].get() as usize;
            // The piece must lie in what the kernel has consumed (the
            // entry's length is what it has left, later completions'
            // bytes included): a completion taken twice, or one the kernel
            // did not post, would otherwise hand out bytes it is still to
            // write.
            let len = usize::try_from(res).ok();
            if len.is_some_and(|l| off + l > self.buffer_size() - self.left_in_entry(i)) {
                return Err(Error::BufferNotLent { group: self.bgid, bid });
            }
            match len {
                // Each completion says whether the buffer goes on after it
                // (`BUF_MORE`); taken in the order posted, that is the
                // buffer's state after these bytes, whatever later
                // completions have consumed since.
                Some(l) if l > 0 => {
                    // Done when this completion says so and the kernel has
                    // moved past the entry (it writes its length 0 then); a
                    // request that took only part of the buffer when it
                    // began (a shorter length than the buffer's, or one run
                    // from io-wq) posts no BUF_MORE though the rest stays at
                    // the head: the buffer stays lent then.
                    if !io_uring::cqueue::buffer_more(cqe.flags()) && self.left_in_entry(i) == 0 {
                        self.lent[i].set(false);
                    } else {
                        self.filled[i].set((off + l) as u32);
                    }
                    (off, l)
                }
                // No bytes, or a failure: the kernel may not have consumed
                // the buffer (6.12 posts an empty receive without
                // BUF_MORE and leaves the buffer at the head; a failure
                // commits nothing) or may have taken all of it (a file
                // read takes the rest when it starts). The buffer stays
                // lent: never provided twice, at worst out of use until
                // the ring drops (see the type's documentation).
                _ => return if res < 0 { failed(-res) } else { Ok(None) },
            }
        } else {
            let Ok(len) = usize::try_from(res) else {
                // A failed request: before Linux 6.12 the kernel consumed
                // its buffer, which goes back; since, a request that fails
                // commits nothing and the buffer stays at the ring's head
                // (the kernel's, handed out by a later completion), unless
                // it was taken when the request began (a file read): it
                // stays lent, never provided twice.
                if crate::os::kernel_version() < (6, 12) && self.pieces[i].get() == 0 {
                    self.lent[i].set(false);
                    self.used.set(self.used.get() + 1);
                    self.provide(bid);
                }
                return failed(-res);
            };
            if len > self.buffer_size() {
                debug_assert!(false, "a completion of {len} bytes into a {}-byte buffer", self.buffer_size());
                return failed(libc::EOVERFLOW);
            }
            self.lent[i].set(false);
            (0, len)
        };
        // The guard holds a piece of the buffer now; the buffer goes back
        // once the kernel is done with it and its last piece drops.
        self.pieces[i].set(self.pieces[i].get() + 1);
        self.received.set(self.received.get() + len as u64);
        Ok(Some(ProvidedBuf { ring: self, bid, off, len }))
    }

    /// What the kernel has left of buffer `i` in its ring entry, in bytes.
    fn left_in_entry(&self, i: usize) -> usize {
        let at = usize::from(self.entry[i].get()) * BUF_ENTRY + 8;
        // SAFETY: the entry lies inside the ring's memory (its index is
        // below `entries`), live while `self` is, and its length field is
        // 4-aligned (entries are 16 bytes from a page). The kernel writes it
        // as it consumes the buffer; the entry is not reused while the
        // kernel holds the buffer (the ring is a queue of at most `entries`
        // buffers, and this one is ahead of every buffer provided after
        // it). An atomic load reads the kernel's last word.
        let left = unsafe { core::sync::atomic::AtomicU32::from_ptr(self.mem.as_ptr().add(at).cast()) };
        (left.load(Ordering::Acquire) as usize).min(self.buffer_size())
    }

    /// A piece of buffer `bid` dropped: the buffer goes back into the ring
    /// once the kernel is done with it and no piece is out.
    fn put_piece(&self, bid: u16) {
        let i = usize::from(bid);
        let left = self.pieces[i].get() - 1;
        self.pieces[i].set(left);
        if left == 0 && !self.lent[i].get() {
            self.used.set(self.used.get() + 1);
            self.provide(bid);
        }
    }

    /// Puts buffer `bid` at the ring's tail and publishes it.
    fn provide(&self, bid: u16) {
        let i = usize::from(bid);
        debug_assert!(!self.lent[i].get() && self.pieces[i].get() == 0, "buffer {bid} provided twice");
        self.filled[i].set(0);
        let tail = self.tail.get();
        let slot = usize::from(tail & (self.entries() - 1));
        self.entry[i].set(slot as u16);
        // SAFETY: `slot` < entries, so the entry lies inside the ring's
        // memory, live while `self` is. The kernel reads entries below the
        // published tail only, and this one is at it: no one reads it while
        // it is written. Each field is written on its own so that entry 0's
        // last two bytes, the tail, are written only atomically below.
        unsafe {
            let e = self.mem.as_ptr().add(slot * BUF_ENTRY);
            e.cast::<u64>().write(self.bufs[i].as_ptr() as u64);
            e.add(8).cast::<u32>().write(self.buffer_size() as u32);
            e.add(12).cast::<u16>().write(bid);
        }
        self.lent[i].set(true);
        let tail = tail.wrapping_add(1);
        self.tail.set(tail);
        // SAFETY: the tail is 2-aligned (the ring is page-aligned), live
        // while `self` is, and only ever accessed atomically: by this store
        // and by the kernel's acquire load, which then sees the entry
        // written above.
        unsafe { core::sync::atomic::AtomicU16::from_ptr(self.mem.as_ptr().add(TAIL_OFFSET).cast()) }
            .store(tail, Ordering::Release);
    }
}

impl Drop for BufRing<'_> {
    fn drop(&mut self) {
        // The kernel lets go of the ring and its buffers first: it selects
        // a buffer only while a request runs, and holds none across waits.
        let _ = self.owner.ring.submitter().unregister_buf_ring(self.bgid);
        unpin(self.pinned());
        // SAFETY: every buffer is back (a `ProvidedBuf` borrows the ring, so
        // none outlives it), the kernel holds none after unregistering, and
        // each is a buffer of the owner's pool given back once here.
        unsafe { self.owner.pool.free_bulk(&self.bufs) };
        // (`mem`, unregistered above, is unmapped as the field drops.)
    }
}
