//! Pins that leave their node.
//!
//! A registrar that pins for the long term (io_uring fixed buffers, RDMA
//! memory regions, VFIO DMA mappings) makes the kernel move every page of
//! the region that sits in `ZONE_MOVABLE` before it pins it (`mm/gup.c`,
//! `migrate_longterm_unpinnable_folios`): to a zone of the same node that
//! takes pins if one has room, else to another node. CXL and other
//! memory-only nodes are usually onlined movable, so a pool placed there
//! and registered would end on another node while it still says it is on
//! its own. Where the region's node has movable memory (`os::zones`, one
//! read of `/proc/zoneinfo` per registration), the pool asks the kernel
//! where the region's pages are once the registrar has them (`move_pages`
//! with null nodes); with pages elsewhere it refuses the region or keeps it
//! and counts them, as [`OffNodePins`] says. A node without movable memory
//! costs that one read.

use crate::error::Result;
use crate::os::{pages, zones};

/// What a pool does with a region whose pages the kernel moved to another
/// node as its [`Registrar`](super::Registrar) pinned them (the region's
/// node holds movable memory: see the module documentation of the slab
/// layer's `pins`). Given to the pool's builder
/// ([`CacheBuilder::off_node_pins`](super::CacheBuilder::off_node_pins)).
///
/// ```
/// use numaweave::slab::{DmaPool, OffNodePins};
///
/// // A pool that keeps regions the kernel moved off its node, and counts
/// // their pages, rather than failing the allocation.
/// let pool = DmaPool::builder("rx", 4096).off_node_pins(OffNodePins::Report).build().unwrap();
/// let stats = pool.cache().stats();
/// assert_eq!(stats.total().pinned_off_node, 0);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OffNodePins {
    /// The registration is undone, the region unmapped, and the allocation
    /// that needed it fails with
    /// [`Error::PinsLeftNode`](crate::Error::PinsLeftNode): the pool keeps
    /// no region whose pages the pin moved off a node with movable memory.
    /// The default. (Where the node has no movable memory, nothing is
    /// looked up: no pin moves a page off it.)
    #[default]
    Refuse,
    /// The region stays registered where the kernel put it; its pages off
    /// the node are counted in
    /// [`NodeCacheStats::pinned_off_node`](super::NodeCacheStats::pinned_off_node).
    Report,
}

/// How many pages of the region `[base, base + len)` (pages of `page`
/// bytes, bound to kernel node `phys`) the kernel holds on another node:
/// looked up only where pins can leave, on a node with movable memory (or
/// where the zones cannot be read).
pub(crate) fn off_node(base: usize, len: usize, page: usize, phys: usize) -> Result<usize> {
    // Not known (unreadable, or not parsed) counts as movable: looked up.
    let movable = zones::node_zones(phys).ok().flatten().is_none_or(|z| z.movable > 0);
    if !movable {
        return Ok(0);
    }
    pages::count_off_node(base, len, page, phys)
}
