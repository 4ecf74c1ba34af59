//! I/O registration: memory of the crate's pools made known to the kernel
//! for I/O, the layer above the slab caches. Each kind of registration
//! implements the slab layer's [`Registrar`](crate::slab::Registrar) (a
//! pool calls it for each region it maps, and before it unmaps one), so the
//! pool stays unaware of what registers its memory and how.
//!
//! - `uring` (feature `io-uring`): io_uring fixed buffers from a node's
//!   pool, and provided-buffer rings.
//!
//! Room is left here for registrars of other kinds (VFIO DMA mappings,
//! RDMA memory regions): one file each, each with the error variants of
//! its own.

#[cfg(all(feature = "io-uring", not(loom)))]
pub mod uring;
