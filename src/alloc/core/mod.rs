//! The allocator's core: size classes, segments and the map of them, per-node
//! arenas, thread heaps and the process state. These files name each other
//! (the crate's one import cycle across concerns); nothing here names a
//! policy or interleave type: policies reach the core through a refill's
//! [`Placement`](heap::Placement) and a direct slot's loan.

pub(crate) mod arena;
pub(crate) mod heap;
pub(crate) mod lifecycle;
pub(crate) mod segmap;
pub(crate) mod segment;
pub(crate) mod size_class;
pub(crate) mod state;
