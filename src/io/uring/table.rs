//! [`NodeTable`]: one registered-buffer table per node, shared by every
//! ring on the node.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

use io_uring::IoUring;
use io_uring::types::CloneBuffersFlags;

use super::{FixedBuffers, Follower, NodeRing, io_error};
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
    /// Rings clone the node's table (Linux 6.12); a region that comes
    /// later reaches a ring at its next `alloc` or `sync`.
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
/// Changes reach every ring under the table's lock: a region registered
/// (the pool grew) or registered again after a move is cloned into each
/// ring's slot at once where the kernel clones ranges (Linux 6.13,
/// `IORING_REGISTER_DST_REPLACE`), else (6.12) each ring clones the whole
/// table again at its next [`NodeRing::alloc`] or [`NodeRing::sync`], on
/// its own thread; a region leaving or released for a move is emptied in
/// every ring at once, so no clone keeps its pages pinned. Before Linux
/// 6.12, [`NodeTable::ring`] makes a [`NodeRing`] of its own, registering
/// as ever ([`Sharing::PerRing`]).
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
        fixed.table.lock().unwrap_or_else(|e| e.into_inner()).ranges = sharing == Sharing::CloneRanges;
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
            t.followers.push(Follower { ring: Arc::downgrade(&ring), stale: stale.clone() });
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

    /// Clones the whole table into `ring` again (its clone lacks a change),
    /// under the table's lock: with ranges, over the old one; else the old
    /// one unregistered first (the kernel clones into an empty table only),
    /// which is why the ring's own thread does it.
    pub(super) fn resync(&self, ring: &IoUring, stale: &AtomicBool) -> Result<()> {
        let (Some(fixed), Some(primary)) = (&self.fixed, &self.primary) else { return Ok(()) };
        let t = fixed.table.lock().unwrap_or_else(|e| e.into_inner());
        stale.store(false, Ordering::Relaxed);
        let src = primary.as_raw_fd();
        let done = if t.ranges {
            ring.submitter().register_buffers_clone_offset(src, 0, 0, 0, CloneBuffersFlags::DST_REPLACE)
        } else {
            let _ = ring.submitter().unregister_buffers();
            ring.submitter().register_buffers_clone(src)
        };
        drop(t);
        done.map_err(|e| {
            stale.store(true, Ordering::Release);
            io_error("io_uring_register(IORING_REGISTER_CLONE_BUFFERS)", &e)
        })
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

    /// Rings holding a clone of the table now.
    pub fn rings(&self) -> usize {
        self.fixed.as_ref().map_or(0, |f| {
            let t = f.table.lock().unwrap_or_else(|e| e.into_inner());
            t.followers.iter().filter(|f| Weak::strong_count(&f.ring) > 0).count()
        })
    }
}
