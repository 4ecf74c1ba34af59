//! Registration hooks: a pool tells a [`Registrar`] of each region of its
//! memory once the region is mapped and bound to its node, before any
//! object or buffer from it is handed out, and again, with the same region,
//! before the region is unmapped. What a program registers there once (an
//! io_uring ring's fixed buffers, a VFIO/iommufd DMA mapping, an RDMA
//! memory region) then covers every buffer the pool hands out of it, with
//! no page-table walk or pin per request: SPDK's and DPDK's memory
//! registration notifications, for a pool of this crate.
//!
//! A region is one chunk of the pool's slabs (see the slab module's design:
//! one `mmap` + `mbind` each, as long as what the node already holds, up to
//! 256 MiB). Every registration of a region is matched by exactly one
//! unregistration; a region released for a move is taken back with
//! `register_moved`, and one whose registration was lost or undone is
//! registered again on demand. A slab given back inside a registered region keeps its
//! pages (unregistered regions return them to the OS at once): a registered
//! page is pinned, and a page returned and faulted in again would be a new
//! one, not the page the device was given. The region goes, unregistered
//! first, with its last slab ([`shrink`](crate::slab::RawCache::shrink), a
//! dropped cache's last object).
//!
//! The calls run under the node's slab lock: a registrar must not allocate
//! from the same pool; it may use the global allocator, other pools and
//! system calls.
//!
//! # Uses
//!
//! * **io_uring fixed buffers**: `IORING_REGISTER_BUFFERS2`/`_UPDATE` puts
//!   each region in a slot of a sparse table; a buffer's `READ_FIXED` names
//!   the slot (`buf_index`) and its address lies in the region. The pinned
//!   pages count against `RLIMIT_MEMLOCK` (`ENOMEM` beyond it).
//! * **VFIO / iommufd**: `VFIO_IOMMU_MAP_DMA` (or `IOMMU_IOAS_MAP`) with
//!   the region's address as the I/O virtual address, unmapped in
//!   `unregister`.
//! * **RDMA**: `ibv_reg_mr` of the region (its `lkey`/`rkey` for every
//!   buffer in it), `ibv_dereg_mr` in `unregister`.
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use numaweave::slab::{RawCache, Refusal, Region, Registrar};
//!
//! /// Keeps the regions, as an io_uring or RDMA registrar would keep its
//! /// table of registered memory.
//! #[derive(Default)]
//! struct Table(Mutex<Vec<(usize, usize)>>);
//!
//! impl Registrar for Table {
//!     fn register(&self, r: &Region) -> Result<(), Refusal> {
//!         self.0.lock().unwrap().push((r.addr.as_ptr() as usize, r.len));
//!         Ok(())
//!     }
//!     fn unregister(&self, r: &Region) {
//!         self.0.lock().unwrap().retain(|&(a, _)| a != r.addr.as_ptr() as usize);
//!     }
//! }
//!
//! let table = Arc::new(Table::default());
//! let pool = RawCache::builder("io_bufs", 4096).align(4096).registrar(table.clone()).build().unwrap();
//! let buf = pool.alloc().unwrap();
//! let a = buf.as_ptr() as usize;
//! // The buffer lies in a region registered before it was handed out.
//! assert!(table.0.lock().unwrap().iter().any(|&(b, l)| (b..b + l).contains(&a)));
//! // SAFETY: an object of this pool, given back once.
//! unsafe { pool.free(buf) };
//! pool.shrink();
//! assert!(table.0.lock().unwrap().is_empty(), "unregistered as it went");
//! ```

use core::ptr::NonNull;

/// One region of a pool's memory, as a [`Registrar`] is told of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Its first byte (aligned to `page_size`).
    pub addr: NonNull<u8>,
    /// Its length in bytes (a multiple of `page_size`).
    pub len: usize,
    /// The node its memory is bound to (the node id as the topology has
    /// it).
    pub node: usize,
    /// The size of the pages behind it: the hugetlb page size for a pool
    /// on hugetlb pages, else the base page size (transparent huge pages,
    /// where the kernel gives them, are not promised).
    pub page_size: usize,
}

// SAFETY: a region is a description of memory (address, length, node), not
// access to it: sending or sharing the description reads nothing.
unsafe impl Send for Region {}
// SAFETY: as for `Send`; nothing in it can be changed through `&Region`.
unsafe impl Sync for Region {}

/// Why a [`Registrar`] refused a region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The registration failed with this errno: the allocation fails with
    /// [`Error::Registration`](crate::Error::Registration).
    Errno(i32),
    /// Pinning the region would take the process past its
    /// `RLIMIT_MEMLOCK`: the allocation fails with
    /// [`Error::MemlockLimit`](crate::Error::MemlockLimit).
    Memlock {
        /// The limit, in bytes.
        limit: u64,
        /// What was pinned already, in bytes.
        pinned: u64,
    },
}

/// Told of a pool's memory region by region: see the [module
/// documentation](self). Given to a pool by its builder's `registrar`.
pub trait Registrar: Send + Sync {
    /// Registers `region`, before any object of it is handed out. A
    /// refusal fails the allocation that needed the region (see
    /// [`Refusal`]); the region is unmapped and `unregister` is not called
    /// for it.
    fn register(&self, region: &Region) -> Result<(), Refusal>;

    /// Unregisters `region`, registered before: before it is unmapped
    /// (nothing of the pool uses it any more), or right after a
    /// registration the pool undoes because the kernel moved the region's
    /// pages to another node as they were pinned
    /// ([`OffNodePins::Refuse`](super::OffNodePins::Refuse)). A region
    /// undone so is unmapped if it was fresh; one registered again (after
    /// a move, or on demand) keeps the objects already out of it, and no
    /// new slab is carved from it until it is registered again.
    fn unregister(&self, region: &Region);

    /// Whether the pool's regions may move to another node
    /// (`migrate`, through [`release_for_move`](Self::release_for_move) and
    /// [`register_moved`](Self::register_moved)). The default, false, makes
    /// a migration of a pool with a registered region fail with
    /// [`Error::RegisteredRegion`](crate::Error::RegisteredRegion) before
    /// anything moves: the kernel or a device holds the pages' physical
    /// addresses, so they cannot move behind its back.
    fn can_move(&self) -> bool {
        false
    }

    /// Lets go of `region` (the pin, the device mapping) so that its pages
    /// can move, keeping what names it (an io_uring slot, an RDMA key's
    /// place) for [`register_moved`](Self::register_moved). Called under
    /// the node's slab lock, with no new slab carved from the region
    /// meanwhile; buffers already out may still be in use, and I/O on them
    /// until `register_moved` returns is the registrar's to refuse or
    /// delay. A refusal leaves the region where it is, registered: its
    /// pages are reported as not moved, with the refusal.
    fn release_for_move(&self, region: &Region) -> Result<(), Refusal> {
        let _ = region;
        Err(Refusal::Errno(libc::EOPNOTSUPP))
    }

    /// Registers `region` again once its pages moved (`region.node` is the
    /// new node), under the names `release_for_move` kept. A refusal does
    /// not fail the migration (its pages have moved): it is counted in
    /// [`Migration::registrations_lost`](crate::slab::Migration), with the
    /// errno. The region stays in the pool, unregistered (`unregister` is
    /// not called for it), and no new slab is carved from it until
    /// [`register`](Self::register) takes it again, which the pool asks
    /// before carving from it and [`RawCache::register_again`](crate::slab::RawCache::register_again)
    /// asks for an object's region. Objects of slabs carved in it before
    /// the move stay in service: a pool whose device must know every
    /// object's memory calls `register_again` for those (`NodeRing` does,
    /// at each buffer it hands out).
    fn register_moved(&self, region: &Region) -> Result<(), Refusal> {
        self.register(region)
    }
}
