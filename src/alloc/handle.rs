//! Per-call placement: allocator handles for `allocator_api2` collections.
//!
//! [`NodeHandle`] places every block on one node; [`InterleaveHandle`]
//! spreads blocks over a node set with its own cursor, exactly (one pick per
//! block, whatever its size). Blocks under a page come from the calling
//! thread's heap pages of the node; an interleave handle's blocks of a page
//! and more from its own regions, a turn's blocks back to back. Their blocks
//! are ordinary `NumaAlloc` blocks: when `NumaAlloc` is the global
//! allocator, a block from a handle may be freed through it (or through
//! another handle), and a handle may free a global block.

use core::alloc::Layout;
use core::ptr::NonNull;
use std::sync::Arc;

use allocator_api2::alloc::{AllocError, Allocator};

use super::engine::heap;
use super::engine::size_class::{PAGE_CLASS, class_for};
use super::engine::types::State;
use super::interleave::{self, SharedInterleaver};
use super::{MAX_ALIGN, NumaAlloc, huge, placement};
use crate::error::Result;
use crate::policy::{Interleave, Policy};

/// Where a handle's blocks go (behind the handle's `Arc`, so the size of the
/// larger variant costs one allocation per handle, not per clone).
enum Target {
    Node(usize),
    Interleave(Box<SharedInterleaver>),
    /// The lower tier nearest the allocating thread, looked up per block.
    Cold,
}

struct Source {
    state: &'static State,
    target: Target,
}

impl Source {
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
        let state = self.state;
        let want = super::padded(size);
        let class = class_for(want, align);
        let p = match &self.target {
            Target::Node(n) => match class {
                // SAFETY: a block of class `c` just handed out (or null).
                Some(c) => unsafe { heap::realigned(super::alloc_on_node(state, c, *n), c, align) },
                None => huge::alloc_on(state, *n, want, align, false),
            },
            Target::Interleave(il) => interleave::handle_alloc(il, state, want, align, |node| {
                let c = class.filter(|&c| c < PAGE_CLASS)?;
                Some(super::alloc_on_node(state, c, node))
            }),
            Target::Cold => super::cold_block(state, want, align).0,
        };
        // SAFETY: a block just handed out for `size` bytes.
        unsafe { super::handed_out_for(p, size) };
        NonNull::new(p).map(|p| NonNull::slice_from_raw_parts(p, size)).ok_or(AllocError)
    }
}

/// Frees a handle's (or any `NumaAlloc`) block.
///
/// # Safety
/// `ptr` is a live block of `layout` from a handle or from `NumaAlloc`.
unsafe fn dealloc(ptr: NonNull<u8>, layout: Layout) {
    if layout.size() != 0 {
        // SAFETY: `ptr` is a live block of this allocator (the caller's word),
        // as `free` asks.
        unsafe { super::dealloc::free(ptr.as_ptr()) };
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
pub struct NodeHandle {
    source: Arc<Source>,
    node: usize,
}

impl NodeHandle {
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
pub struct InterleaveHandle {
    source: Arc<Source>,
}

impl InterleaveHandle {
    /// The node whose turn it is.
    pub fn current_node(&self) -> usize {
        match &self.source.target {
            Target::Interleave(il) => il.cursor.current(),
            Target::Node(n) => *n,
            Target::Cold => placement::cold_target(self.source.state, self.source.state.topology.current_node()).0,
        }
    }
}

/// An allocator handle for cold data: every block on the lower memory tier
/// nearest the allocating thread (the CXL memory behind its socket), or on
/// the thread's own node, counted as a fallback, where the machine has no
/// lower tier or that node is out of memory ([`Policy::LowerTier`] for one
/// collection). A cache or a storage engine keeps its hot index in the
/// global allocator's local memory and its cold values here.
///
/// ```
/// use allocator_api2::vec::Vec;
/// use numaweave::NumaAlloc;
/// static A: NumaAlloc = NumaAlloc::new();
///
/// let cold = A.cold();
/// let mut values: Vec<u8, _> = Vec::with_capacity_in(1 << 20, cold.clone());
/// values.extend(std::iter::repeat_n(7u8, 1 << 20));
/// // On a machine without a lower tier, the thread's own node.
/// println!("cold values on node {}", cold.node());
/// ```
#[derive(Clone)]
pub struct ColdHandle {
    source: Arc<Source>,
}

impl ColdHandle {
    /// The node a block allocated now, from this thread, would go to.
    pub fn node(&self) -> usize {
        placement::cold_target(self.source.state, self.source.state.topology.current_node()).0
    }
}

impl NumaAlloc {
    /// A handle for cold data: see [`ColdHandle`].
    pub fn cold(&self) -> ColdHandle {
        ColdHandle { source: Arc::new(Source { state: self.state(), target: Target::Cold }) }
    }

    /// A handle placing every block on `node` (checked against the topology:
    /// online, with memory, allowed to this process).
    pub fn on_node(&self, node: usize) -> Result<NodeHandle> {
        let state = self.state();
        Policy::Preferred(node).validate(state.topology)?;
        Ok(NodeHandle { source: Arc::new(Source { state, target: Target::Node(node) }), node })
    }

    /// A handle interleaving blocks as `policy` says, with its own cursor.
    pub fn interleave(&self, policy: Interleave) -> Result<InterleaveHandle> {
        let state = self.state();
        Policy::Interleave(policy).validate(state.topology)?;
        super::placement::register_fork_handlers();
        let il = SharedInterleaver::boxed(&policy, state);
        Ok(InterleaveHandle { source: Arc::new(Source { state, target: Target::Interleave(il) }) })
    }
}

// SAFETY: blocks are disjoint heap blocks, region carvings or huge mappings,
// aligned as asked, valid until deallocated (a region outlives its blocks:
// each holds a reference), and clones share the source, so any clone may
// free any block.
unsafe impl Allocator for NodeHandle {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        self.source.alloc(layout)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: `ptr` is a live block of this handle (or a clone) and `layout` fits it,
        // as `Allocator::deallocate` requires of its caller: what `dealloc` asks.
        unsafe { dealloc(ptr, layout) }
    }
}

// SAFETY: as for `NodeHandle`.
unsafe impl Allocator for ColdHandle {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        self.source.alloc(layout)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: `ptr` is a live block of this handle (or a clone) and `layout` fits it,
        // as `Allocator::deallocate` requires of its caller: what `dealloc` asks.
        unsafe { dealloc(ptr, layout) }
    }
}

impl core::fmt::Debug for ColdHandle {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ColdHandle").field("node", &self.node()).finish()
    }
}

// SAFETY: as for `NodeHandle`.
unsafe impl Allocator for InterleaveHandle {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        self.source.alloc(layout)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: `ptr` is a live block of this handle (or a clone) and `layout` fits it,
        // as `Allocator::deallocate` requires of its caller: what `dealloc` asks.
        unsafe { dealloc(ptr, layout) }
    }
}

impl core::fmt::Debug for NodeHandle {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("NodeHandle").field("node", &self.node).finish()
    }
}

impl core::fmt::Debug for InterleaveHandle {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("InterleaveHandle").field("current_node", &self.current_node()).finish()
    }
}
