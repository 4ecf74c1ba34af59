//! numaweave: a NUMA-aware memory allocator for storage and network software on
//! multi-socket and CXL machines.
//!
//! ```
//! use numaweave::NumaAlloc;
//!
//! #[global_allocator]
//! static A: NumaAlloc = NumaAlloc::new();
//!
//! let v: Vec<u64> = (0..1000).collect();
//! assert_eq!(v.iter().sum::<u64>(), 499_500);
//! println!("{}", A.stats());
//! ```
//!
//! The crate is built in layers, each in its own module:
//!
//! - [`alloc`]: [`NumaAlloc`], per-node arenas, thread heaps, remote frees,
//!   huge blocks; [`stats`] sums its counters into a per-node table.
//! - [`policy`]: memory policies: `Local`, `Bind`, `Preferred`, and
//!   `Interleave` with a granularity (`Count(n)` allocations or `Bytes(b)` per
//!   turn, weighted), as the process default, per thread ([`with_policy`]) or
//!   per call (allocator handles [`NodeHandle`], [`InterleaveHandle`], [`ColdHandle`]).
//! - [`slab`]: node slabs, `kmem_cache`-like typed caches of fixed-size
//!   objects (I/O commands, sense and DMA buffers) with per-thread magazines,
//!   placed on a device's node.
//! - [`topology`]: nodes, CPUs, distances, allowed nodes, device locality;
//!   discovered without touching the heap. Synthetic topologies
//!   (`NUMAWEAVE_TOPOLOGY=fake:N`, [`Topology::synthetic`]) make the NUMA logic
//!   testable on one-node machines.
//! - [`os`]: the only module that makes system calls: address space
//!   (`mmap`), placement (`mbind`), release (`madvise`), and where pages really
//!   are (`move_pages`, `/proc/self/pagemap`).
//!
//! The concurrency primitives (`sync`: one-time initialisation, spin lock,
//! push/take-all stacks, the regions' retire count, behind a loom shim) are
//! public only for the loom models in `loom-tests/`, and hidden from the
//! documentation.
//!
//! ```
//! use numaweave::os::mem::{Mapping, MemPolicy};
//! use numaweave::topology::{NodeSet, Topology};
//!
//! let topo = Topology::global();
//! let node = topo.current_node();
//! // Memory for this node: the OS layer takes the kernel's node id.
//! let mapping = Mapping::map(64 * 1024).unwrap();
//! mapping
//!     .bind(MemPolicy::Bind(NodeSet::single(topo.physical_node(node))))
//!     .unwrap();
//! // SAFETY: the mapping is ours, writable for its whole length.
//! unsafe { mapping.as_ptr().write_bytes(1, mapping.len()) };
//! assert!(mapping.page_nodes_all(|n| n == Some(topo.physical_node(node))).unwrap());
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(not(loom))]
pub mod alloc;
pub mod error;
// Compiled in every build, used behind `if HARDENED` (`hardened::HARDENED`):
// a default build's optimizer drops every use. The loom build models the
// concurrent structures, not the allocator, which alone uses these checks.
#[cfg(not(loom))]
pub(crate) mod hardened;
pub mod os;
pub mod policy;
#[cfg(test)]
mod rng;
mod sets;
pub mod slab;
#[cfg(not(loom))]
pub use alloc::stats;
pub mod io;
#[doc(hidden)]
pub mod sync;
pub mod topology;
pub mod units;

#[cfg(not(loom))]
pub use alloc::{ColdHandle, Config, InterleaveHandle, Mode, NodeHandle, NumaAlloc, PolicyGuard, with_policy};
pub use error::{Error, Result};
pub use os::mem::Huge;
pub use topology::Topology;

/// Returns every free page to the OS now (`malloc_trim(0)`): the
/// allocator's ([`NumaAlloc::trim`]) and every slab cache's empty slabs
/// ([`slab::shrink_all`]). Returns the bytes the OS got back. (Here, above
/// both layers, because the allocator does not know the slab caches: they
/// sit above it.)
///
/// ```
/// let v: Vec<Box<[u8; 1000]>> = (0..1000).map(|_| Box::new([1; 1000])).collect();
/// drop(v);
/// let back = numaweave::trim();
/// # let _ = back;
/// ```
#[cfg(not(loom))]
pub fn trim() -> u64 {
    slab::shrink_all() as u64 + NumaAlloc::new().trim()
}
