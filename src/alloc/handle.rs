//! Per-call placement: allocator handles for `allocator_api2` collections.
//!
//! [`OnNode`] places every block on one node; [`Interleaved`] spreads blocks
//! over a node set with its own cursor. Both carve from bump regions (see
//! `region.rs`), so consecutive blocks on a node are adjacent, and a region's
//! memory goes back to the OS once every block carved from it is freed.
//! Their blocks are ordinary `NumaAlloc` blocks: when `NumaAlloc` is the
//! global allocator, a block from a handle may be freed through it (or
//! through another handle), and a handle may free a global block.

use core::alloc::Layout;
use core::ptr::NonNull;
use std::sync::Arc;

use allocator_api2::alloc::{AllocError, Allocator};

use super::policy::Interleaver;
use super::region::{REGION_ALIGN_MAX, REGION_MAX, Space};
use super::state::State;
use super::{MAX_ALIGN, NumaAlloc, huge};
use crate::error::Result;
use crate::policy::{Interleave, Policy};

/// Where a handle's blocks go (behind the handle's `Arc`, so the size of the
/// larger variant costs one allocation per handle, not per clone).
#[allow(clippy::large_enum_variant)]
enum Place {
    Node(usize, Space),
    Interleave(Interleaver),
}

struct Placer {
    state: &'static State,
    place: Place,
}

impl Placer {
    fn alloc(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        let (size, align) = (layout.size(), layout.align());
        if size == 0 {
            // No memory for a zero-sized block: an aligned, dangling pointer.
            let p = NonNull::new(core::ptr::without_provenance_mut::<u8>(align)).ok_or(AllocError)?;
            return Ok(NonNull::slice_from_raw_parts(p, 0));
        }
        if align > MAX_ALIGN || size > isize::MAX as usize / 2 {
            return Err(AllocError);
        }
        let (node, space, turn) = match &self.place {
            Place::Node(n, space) => (*n, space, 0),
            Place::Interleave(il) => {
                let pick = il.cursor.pick(size);
                (pick.node, &il.space, pick.turn)
            }
        };
        let p = if size <= REGION_MAX && align <= REGION_ALIGN_MAX {
            space.alloc(node, size, align, turn)
        } else {
            huge::alloc_on(self.state, node, size, align, false)
        };
        NonNull::new(p).map(|p| NonNull::slice_from_raw_parts(p, size)).ok_or(AllocError)
    }
}

/// Frees a handle's (or any `NumaAlloc`) block.
///
/// # Safety
/// `ptr` is a live block of `layout` from a handle or from `NumaAlloc`.
unsafe fn dealloc(ptr: NonNull<u8>, layout: Layout) {
    if layout.size() != 0 {
        // SAFETY: per the contract.
        unsafe { super::free(ptr.as_ptr(), layout.size()) };
    }
}

/// An allocator handle that places every block on one node.
///
/// ```
/// use allocator_api2::vec::Vec;
/// use numaweave::NumaAlloc;
/// static A: NumaAlloc = NumaAlloc::new();
///
/// let node = numaweave::Topology::global().current_node();
/// let mut v: Vec<u64, _> = Vec::new_in(A.on_node(node).unwrap());
/// v.extend(0..1000);
/// // SAFETY: a live block of `A`.
/// assert_eq!(unsafe { A.node_of(v.as_ptr().cast()) }, if A.mode() == numaweave::Mode::PerNode { node } else { 0 });
/// ```
#[derive(Clone)]
pub struct OnNode {
    placer: Arc<Placer>,
    node: usize,
}

impl OnNode {
    /// The node blocks go to.
    pub fn node(&self) -> usize {
        self.node
    }
}

/// An allocator handle that interleaves blocks over a node set with its own
/// cursor (shared by its clones).
///
/// ```
/// use allocator_api2::boxed::Box;
/// use numaweave::NumaAlloc;
/// use numaweave::policy::{Granularity, Interleave};
/// static A: NumaAlloc = NumaAlloc::new();
///
/// let nodes = numaweave::Topology::global().memory_nodes();
/// let h = A.interleave(Interleave::new(nodes, Granularity::Bytes(2 << 20)).unwrap()).unwrap();
/// let bufs: Vec<Box<[u8; 4096], _>> = (0..8).map(|_| Box::new_in([0u8; 4096], h.clone())).collect();
/// // One turn: consecutive buffers are adjacent.
/// assert_eq!(bufs[1].as_ptr() as usize - bufs[0].as_ptr() as usize, 4096);
/// ```
#[derive(Clone)]
pub struct Interleaved {
    placer: Arc<Placer>,
}

impl Interleaved {
    /// The node whose turn it is.
    pub fn current_node(&self) -> usize {
        match &self.placer.place {
            Place::Interleave(il) => il.cursor.current(),
            Place::Node(n, _) => *n,
        }
    }
}

impl NumaAlloc {
    /// A handle placing every block on `node` (checked against the topology:
    /// online, with memory, allowed to this process).
    pub fn on_node(&self, node: usize) -> Result<OnNode> {
        let state = self.state();
        Policy::Preferred(node).validate(&state.topology)?;
        let space = Space::new(crate::os::page_size());
        Ok(OnNode { placer: Arc::new(Placer { state, place: Place::Node(node, space) }), node })
    }

    /// A handle interleaving blocks as `policy` says, with its own cursor.
    pub fn interleave(&self, policy: Interleave) -> Result<Interleaved> {
        let state = self.state();
        Policy::Interleave(policy).validate(&state.topology)?;
        Ok(Interleaved { placer: Arc::new(Placer { state, place: Place::Interleave(Interleaver::new(&policy)) }) })
    }
}

// SAFETY: blocks are disjoint carvings of regions or huge mappings, aligned
// as asked, valid until deallocated (a region outlives its blocks: each holds
// a reference), and clones share the placer, so any clone may free any block.
unsafe impl Allocator for OnNode {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        self.placer.alloc(layout)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { dealloc(ptr, layout) }
    }
}

// SAFETY: as for `OnNode`.
unsafe impl Allocator for Interleaved {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        self.placer.alloc(layout)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { dealloc(ptr, layout) }
    }
}

impl core::fmt::Debug for OnNode {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("OnNode").field("node", &self.node).finish()
    }
}

impl core::fmt::Debug for Interleaved {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Interleaved").field("current_node", &self.current_node()).finish()
    }
}
