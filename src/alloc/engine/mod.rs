//! The allocator's core, in floors that only look down: size classes
//! (`size_class.rs`) → where a pointer's segment and page are (`segment.rs`,
//! `segmap.rs`) → per-node arenas (`arena/`) → thread heaps (`heap/`) → the
//! memory lifecycle (`lifecycle/`) → the process state (`state.rs`). Their
//! data types are in one file every floor names, `types.rs`, as mimalloc's
//! are in `types.h`; `.ci/layers` checks that no file names a floor above
//! its own. Nothing here names a policy or interleave type: policies reach
//! the core through a refill's [`Placement`](heap::Placement) and a direct
//! slot's loan.

pub(crate) mod arena;
pub(crate) mod heap;
pub(crate) mod lifecycle;
pub(crate) mod segmap;
pub(crate) mod segment;
pub(crate) mod size_class;
pub(crate) mod state;
pub(crate) mod types;
