//! Node slabs: caches of fixed-size objects in the style of the kernel's
//! `kmem_cache`, placed on the node of the device that uses them.
//!
//! ```
//! use numaweave::slab::SlabCache;
//!
//! struct Command { tag: u32, lba: u64, sense: [u8; 96] }
//!
//! // Objects on the node of the disk (a local cache where the disk has no node).
//! let cmds = SlabCache::<Command>::builder("scsi_cmd")
//!     .device("lo") // try "nvme0n1", "0000:03:00.0", "eth0"
//!     .or_local()
//!     .hwcache_align()
//!     .build()
//!     .unwrap();
//! let mut c = cmds.alloc(Command { tag: 1, lba: 2048, sense: [0; 96] }).unwrap();
//! c.sense[0] = 0x70;
//! assert_eq!(c.lba, 2048);
//! drop(c); // back to this thread's magazine
//! ```
//!
//! # Design
//!
//! * **Slabs** are slots of node-bound chunks (`mmap` + `mbind` to the node,
//!   as `MPOL_PREFERRED`; a chunk as large as what the node holds, up to
//!   256 MiB, so a cache of tens of GiB needs a few hundred mappings),
//!   carved lazily into objects; one mutex per cache and node guards them.
//! * **Magazines** (Bonwick and Adams 2001; DPDK's per-lcore cache): each
//!   thread keeps two small stacks of object pointers per cache and node, so
//!   an allocation or free is a pop or push on thread-private memory. A
//!   per-node **depot** trades whole magazines under a spin lock when a
//!   thread's pair runs empty or full ([`magazine`]).
//! * **Remote frees**: an object freed by a thread on another node never
//!   enters that thread's magazines; it goes home on its node's lock-free
//!   remote list, drained into the node's slabs at the next refill.
//! * **Limits**: with [`CacheBuilder::limit`], a node's slabs never hold more
//!   than that many objects; [`SlabCache::try_alloc`] then fails with
//!   [`Error::LimitReached`](crate::Error::LimitReached), [`SlabCache::alloc_wait`] sleeps until a free
//!   (frees on a limited node with waiters skip the magazines so the waiter
//!   is woken), and [`SlabCache::alloc`] falls back to the nearest node with
//!   room.
//!
//! # Moving, and where the pages are
//!
//! `migrate(node)` moves a whole cache while it is in use, and a
//! [`Demotion`] moves it by itself when a node runs low (see `migrate.rs`'s
//! design notes). `resident()` on a cache asks the kernel where its pages
//! are ([`RawCache::resident`]). A process with caches also keeps one close-on-exec memory file, the
//! table of its chunks that `numaweave numastat PID` reads from outside
//! ([`published`]).
//!
//! # Lifetimes
//!
//! Dropping a cache while objects are out is safe: the handle goes, its
//! empty slabs are unmapped at once, and the rest of its memory stays until
//! the last object comes back (each slab keeps the cache's shared state
//! alive); [`slabinfo`] lists it as "(dropped)" meanwhile. Objects parked in
//! other threads' magazines come back when those threads exit or next make a
//! cache entry.

// Public only for the loom models in `loom-tests/`.
#[doc(hidden)]
pub mod magazine;

#[cfg(not(loom))]
mod checks;
#[cfg(not(loom))]
mod chunk;
#[cfg(not(loom))]
mod dma;
#[cfg(not(loom))]
mod kmem;
#[cfg(not(loom))]
mod local;
#[cfg(not(loom))]
mod migrate;
#[cfg(not(loom))]
mod node;
#[cfg(not(loom))]
mod pins;
pub mod published;
#[cfg(not(loom))]
pub mod register;
#[cfg(not(loom))]
mod slabinfo;

#[cfg(not(loom))]
pub use api::*;
#[cfg(not(loom))]
pub use dma::{Dma, DmaBuf, DmaPool, phys_addr, phys_segments};
#[cfg(not(loom))]
pub use kmem::Home;
#[cfg(not(loom))]
pub use migrate::{Demotion, Migration, Stuck, Unmoved};
#[cfg(not(loom))]
pub use pins::OffNodePins;
#[cfg(not(loom))]
pub use register::{Refusal, Region, Registrar};
#[cfg(not(loom))]
pub use slabinfo::{CacheStats, NodeCacheStats, NodePages, SlabInfo, slabinfo};

#[cfg(not(loom))]
mod api;
