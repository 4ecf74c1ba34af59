//! [`NodeTable`]: one registered-buffer table per node, shared by every
//! ring on the node.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use io_uring::IoUring;
use io_uring::types::CloneBuffersFlags;

use super::{FixedBuffers, NodeRing, Table, io_error, pin, unpin};
use crate::error::{Error, Result};
use crate::os::thread::fork_generation;
use crate::slab::DmaPool;

/// How the rings of a [`NodeTable`] share its registration, as the kernel
/// allows (found when the table is made).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// Each ring registers a pool of its own (kernels before 6.12, or
    /// clones refused): pinned and charged once per ring, as
    /// [`NodeRing::new`].
    PerRing,
    /// Rings clone the node's table as they are made (Linux 6.12); a
    /// region that comes later is registered by each ring itself.
    Clone,
    /// Rings clone the node's table, and each change of a slot reaches
    /// every ring as it is made (Linux 6.13).
    CloneRanges,
}

/// The registered table of one node's pool, shared by every ring made from
/// it.
///
/// A server runs a ring per worker. With a [`NodeRing`] each, every ring
/// registers (pins, and charges against `RLIMIT_MEMLOCK`) a table of its
/// own. A [`NodeTable`] registers the node's pool once, in a ring that does
/// no I/O (the *primary*), and each ring made from it takes the table by
/// clone (`IORING_REGISTER_CLONE_BUFFERS`, Linux 6.12): the clone refers to
/// the same pinned pages, so N rings on a node pin and charge their buffers
/// once. Every ring of the table allocates from the same pool, and a
/// buffer's index is the same in every ring.
///
/// Changes reach every ring under the table's lock. A region registered
/// (the pool grew) or registered again after a move is cloned into every
/// ring at once where the kernel clones over a table with buffers (Linux
/// 6.13, `IORING_REGISTER_DST_REPLACE`; the whole table, as a one-slot
/// clone loses the slots above it on 6.13 to 6.18 before the fix); on
/// 6.12, whose clone takes an empty table only, each ring registers such a
/// region itself (pinned and charged once more for that ring: only the
/// regions there at a ring's making are shared). A region leaving or
/// released for a move is emptied in every ring at once, so that no clone
/// keeps its pages pinned. A change a ring could not take (the memlock
/// limit, an error) is made again at its next [`NodeRing::alloc`] or
/// [`NodeRing::sync`], which report a failure. Before Linux 6.12,
/// [`NodeTable::ring`] makes a [`NodeRing`] of its own, registering as
/// ever ([`Sharing::PerRing`]).
///
/// ```no_run
/// use numaweave::io::uring::NodeTable;
///
/// // Four workers on node 0: one pool, registered once.
/// let table = NodeTable::new(0, 4096).unwrap();
/// let rings: Vec<_> = (0..4).map(|_| table.ring(64).unwrap()).collect();
/// let buf = rings[2].alloc().unwrap();
/// // The same index names the buffer in every ring of the table.
/// println!("{:?}: buffer {} pinned once, {} bytes", table.sharing(), buf.index(), table.pinned());
/// ```
pub struct NodeTable {
    node: usize,
    buf_size: usize,
    sharing: Sharing,
    /// The pool every ring allocates from, registered in `fixed` (none for
    /// [`Sharing::PerRing`]). Dropped first: its regions are unregistered
    /// while the primary ring is open.
    pool: Option<Arc<DmaPool>>,
    fixed: Option<Arc<FixedBuffers>>,
    primary: Option<Arc<IoUring>>,
    /// The fork generation of the process that made it.
    forks: u64,
}

impl NodeTable {
    /// A table of `buf_size`-byte buffers (up to 1 MiB) on `node`, shared by
    /// the rings [`ring`](Self::ring) makes. Asks the kernel once which
    /// [`Sharing`] it allows.
    pub fn new(node: usize, buf_size: usize) -> Result<Arc<Self>> {
        let primary = Arc::new(IoUring::new(1).map_err(|e| io_error("io_uring_setup", &e))?);
        let fixed = FixedBuffers::new(primary.clone(), 1024)?;
        let sharing = Self::probe(&primary);
        let forks = fork_generation();
        if sharing == Sharing::PerRing {
            return Ok(Arc::new(Self { node, buf_size, sharing, pool: None, fixed: None, primary: None, forks }));
        }
        {
            let mut t = fixed.table.lock().unwrap_or_else(|e| e.into_inner());
            t.ranges = sharing == Sharing::CloneRanges;
            t.node = node;
        }
        let pool = DmaPool::builder("uring_table", buf_size).node(node).registrar(fixed.clone()).build()?;
        Ok(Arc::new(Self {
            node,
            buf_size,
            sharing,
            pool: Some(Arc::new(pool)),
            fixed: Some(fixed),
            primary: Some(primary),
            forks,
        }))
    }

    /// What the kernel allows: a clone of the primary's (empty, sparse)
    /// table into a fresh ring, then one slot of it cloned over the same.
    fn probe(primary: &IoUring) -> Sharing {
        let Ok(probe) = IoUring::new(1) else { return Sharing::PerRing };
        let src = primary.as_raw_fd();
        if probe.submitter().register_buffers_clone(src).is_err() {
            return Sharing::PerRing;
        }
        match probe.submitter().register_buffers_clone_offset(src, 0, 0, 1, CloneBuffersFlags::DST_REPLACE) {
            Ok(()) => Sharing::CloneRanges,
            Err(_) => Sharing::Clone,
        }
    }

    /// A ring of `entries` submission entries holding a clone of the
    /// table: its buffers from the table's pool, their indices the same in
    /// every ring of the table. With [`Sharing::PerRing`], a
    /// [`NodeRing::new`] of its own. Fails with `EPERM` in a forked child
    /// (the table, its primary ring included, is its parent's).
    pub fn ring(self: &Arc<Self>, entries: u32) -> Result<NodeRing> {
        if fork_generation() != self.forks {
            return Err(Error::Os { call: "NodeTable::ring (a table of the parent process)", errno: libc::EPERM });
        }
        let (Some(pool), Some(fixed), Some(primary)) = (&self.pool, &self.fixed, &self.primary) else {
            return NodeRing::new(self.node, self.buf_size, entries);
        };
        let ring = Arc::new(IoUring::new(entries).map_err(|e| io_error("io_uring_setup", &e))?);
        let stale = Arc::new(AtomicBool::new(false));
        {
            // Under the lock no slot changes: the clone is the table as it is.
            let mut t = fixed.table.lock().unwrap_or_else(|e| e.into_inner());
            ring.submitter()
                .register_buffers_clone(primary.as_raw_fd())
                .map_err(|e| io_error("io_uring_register(IORING_REGISTER_CLONE_BUFFERS, Linux 6.12)", &e))?;
            prune(&mut t);
            t.followers.push(Follower {
                ring: Arc::downgrade(&ring),
                stale: stale.clone(),
                own: Vec::new(),
                missing: Vec::new(),
                unemptied: Vec::new(),
            });
        }
        Ok(NodeRing {
            pool: pool.clone(),
            fixed: fixed.clone(),
            ring,
            node: self.node,
            stale: Some(stale),
            table: Some(self.clone()),
            last: core::cell::Cell::new(None),
            sq_busy: core::cell::Cell::new(false),
            cq_busy: core::cell::Cell::new(false),
            _not_sync: core::marker::PhantomData,
        })
    }

    /// Makes the changes the follower with flag `stale` could not take
    /// when they were made, under the table's lock, from its own thread:
    /// the error of one still refused (its flag stays set).
    pub(super) fn resync(&self, stale: &Arc<AtomicBool>) -> Result<()> {
        let (Some(fixed), Some(primary)) = (&self.fixed, &self.primary) else { return Ok(()) };
        if fork_generation() != self.forks {
            // The table is the parent's (its lock may have been held at the
            // fork, and its rings are shared with the parent).
            return Err(Error::Os { call: "NodeRing::sync (a table of the parent process)", errno: libc::EPERM });
        }
        let mut t = fixed.table.lock().unwrap_or_else(|e| e.into_inner());
        let t = &mut *t;
        let Some(f) = t.followers.iter_mut().find(|f| Arc::ptr_eq(&f.stale, stale)) else { return Ok(()) };
        let Some(ring) = f.ring.upgrade() else { return Ok(()) };
        let mut last = None;
        if t.ranges {
            f.missing.clear();
            f.unemptied.clear();
            if let Err(e) = clone_all(&ring, primary) {
                f.missing.push(0);
                last = Some(io_error("io_uring_register(IORING_REGISTER_CLONE_BUFFERS)", &e));
            }
        } else {
            for slot in core::mem::take(&mut f.unemptied) {
                if let Err(e) = f.empty(&ring, slot) {
                    f.unemptied.push(slot);
                    last = Some(io_error("io_uring_register(IORING_REGISTER_BUFFERS_UPDATE)", &e));
                }
            }
            for slot in core::mem::take(&mut f.missing) {
                if let Some(region) = t.slots[usize::from(slot)]
                    && let Err(e) = f.fill(&ring, slot, region, t.node)
                {
                    f.missing.push(slot);
                    last = Some(e);
                }
            }
        }
        stale.store(!(f.missing.is_empty() && f.unemptied.is_empty()), Ordering::Release);
        last.map_or(Ok(()), Err)
    }

    /// Whether the follower with flag `stale` still lacks `slot` (a region
    /// it could not take; with ranges, any change).
    pub(super) fn lacks(&self, stale: &Arc<AtomicBool>, slot: u16) -> bool {
        let Some(fixed) = &self.fixed else { return false };
        if fork_generation() != self.forks {
            return true;
        }
        let t = fixed.table.lock().unwrap_or_else(|e| e.into_inner());
        t.followers
            .iter()
            .find(|f| Arc::ptr_eq(&f.stale, stale))
            .is_some_and(|f| if t.ranges { !f.missing.is_empty() } else { f.missing.contains(&slot) })
    }

    /// The ring with flag `stale` goes: its own registrations' bookings
    /// come back (the kernel drops the pins as the ring closes).
    pub(super) fn leave(&self, stale: &Arc<AtomicBool>) {
        let Some(fixed) = &self.fixed else { return };
        if fork_generation() != self.forks {
            return;
        }
        let mut t = fixed.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = t.followers.iter().position(|f| Arc::ptr_eq(&f.stale, stale)) {
            let f = t.followers.swap_remove(i);
            f.own.iter().for_each(|&(_, len)| unpin(len));
        }
    }

    /// How its rings share the registration.
    pub fn sharing(&self) -> Sharing {
        self.sharing
    }

    /// The node its buffers are on.
    pub fn node(&self) -> usize {
        self.node
    }

    /// The pool its rings allocate from (`None` with [`Sharing::PerRing`]:
    /// each ring has its own, [`NodeRing::pool`]).
    pub fn pool(&self) -> Option<&DmaPool> {
        self.pool.as_deref()
    }

    /// Bytes the table has registered (pinned and charged once for all its
    /// rings); 0 with [`Sharing::PerRing`].
    pub fn pinned(&self) -> u64 {
        self.fixed.as_ref().map_or(0, |f| f.registered())
    }

    /// Rings holding a clone of the table now (0 in a forked child: the
    /// table is its parent's).
    pub fn rings(&self) -> usize {
        if fork_generation() != self.forks {
            return 0;
        }
        self.fixed.as_ref().map_or(0, |f| {
            let t = f.table.lock().unwrap_or_else(|e| e.into_inner());
            t.followers.iter().filter(|f| Weak::strong_count(&f.ring) > 0).count()
        })
    }
}

/// A ring holding a clone of a node's table.
pub(super) struct Follower {
    ring: Weak<IoUring>,
    /// Set while the ring lacks a change (`missing`, `unemptied`): made at
    /// its next `alloc` or `sync`.
    stale: Arc<AtomicBool>,
    /// Slots the ring registered itself (6.12: regions after its clone),
    /// with the bytes booked against `RLIMIT_MEMLOCK` for each.
    own: Vec<(u16, u64)>,
    /// Slots filled in the table that the ring could not take yet (with
    /// ranges: one entry means "clone the whole table again").
    missing: Vec<u16>,
    /// Slots emptied in the table that the ring could not empty yet.
    unemptied: Vec<u16>,
}

impl Follower {
    /// Empties `slot` in the ring (its reference to the pages goes, and
    /// with it any pin of its own, whose booking comes back).
    fn empty(&mut self, ring: &IoUring, slot: u16) -> std::io::Result<()> {
        let empty = libc::iovec { iov_base: core::ptr::null_mut(), iov_len: 0 };
        // SAFETY: the empty iovec names no memory.
        unsafe { ring.submitter().register_buffers_update(u32::from(slot), &[empty], None) }?;
        if let Some(i) = self.own.iter().position(|&(s, _)| s == slot) {
            unpin(self.own.swap_remove(i).1);
        }
        Ok(())
    }

    /// Registers `region` (start, length) in the ring's `slot` itself,
    /// booked against `RLIMIT_MEMLOCK` first.
    fn fill(&mut self, ring: &IoUring, slot: u16, (start, len): (usize, usize), node: usize) -> Result<()> {
        pin(len as u64).map_err(|(limit, pinned)| Error::MemlockLimit { node, limit, pinned, asked: len })?;
        let iov = libc::iovec { iov_base: start as *mut libc::c_void, iov_len: len };
        // SAFETY: the region is registered in the primary's table (the
        // caller read it there under the table's lock), so it stays mapped
        // until the table empties the slot, which empties this ring's too.
        match unsafe { ring.submitter().register_buffers_update(u32::from(slot), &[iov], None) } {
            Ok(()) => {
                // An own registration the update replaced (its emptying
                // had failed) goes with its booking.
                if let Some(i) = self.own.iter().position(|&(s, _)| s == slot) {
                    unpin(self.own.swap_remove(i).1);
                }
                self.own.push((slot, len as u64));
                Ok(())
            }
            Err(e) => {
                unpin(len as u64);
                Err(io_error("io_uring_register(IORING_REGISTER_BUFFERS_UPDATE)", &e))
            }
        }
    }
}

/// Drops the followers whose rings are gone (their own bookings back).
fn prune(t: &mut Table) {
    t.followers.retain(|f| {
        let live = f.ring.strong_count() > 0;
        if !live {
            f.own.iter().for_each(|&(_, len)| unpin(len));
        }
        live
    });
}

/// The whole table of `primary` cloned over `ring`'s (Linux 6.13). Not a
/// one-slot clone: 6.13 to 6.18 before the fix keep only the slots below
/// a clone's destination and drop those above it.
fn clone_all(ring: &IoUring, primary: &IoUring) -> std::io::Result<()> {
    ring.submitter().register_buffers_clone_offset(primary.as_raw_fd(), 0, 0, 0, CloneBuffersFlags::DST_REPLACE)
}

/// Slot `slot` of `primary`'s table changed (filled with the region
/// `t.slots[slot]` names, or emptied): every follower changes the same way,
/// under the table's lock `t`. An emptied slot is emptied in every
/// follower at once, so that no clone keeps the pages pinned (a region
/// leaving, or moving). A filled one is cloned with the whole table where
/// the kernel clones over a table with buffers, else registered by each
/// follower itself. What a follower cannot take now it takes at its next
/// sync.
pub(super) fn to_followers(primary: &IoUring, t: &mut Table, slot: u16, filled: bool) {
    prune(t);
    let (ranges, node, region) = (t.ranges, t.node, t.slots[usize::from(slot)]);
    for f in &mut t.followers {
        let Some(ring) = f.ring.upgrade() else { continue };
        f.missing.retain(|&s| s != slot || ranges);
        f.unemptied.retain(|&s| s != slot);
        if !filled {
            if f.empty(&ring, slot).is_err() {
                f.unemptied.push(slot);
            }
        } else if ranges {
            if clone_all(&ring, primary).is_err() {
                f.missing.push(slot);
            }
        } else if let Some(region) = region
            && f.fill(&ring, slot, region, node).is_err()
        {
            f.missing.push(slot);
        }
        if !(f.missing.is_empty() && f.unemptied.is_empty()) {
            f.stale.store(true, Ordering::Release);
        }
    }
}
