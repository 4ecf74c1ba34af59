//! numaweave as a C library: `libnumaweave.so` (for `LD_PRELOAD`, or linked
//! with `-lnumaweave`) and `libnumaweave.a`.
//!
//! - [`malloc`](mod@malloc): the malloc family as glibc programs call it,
//!   with glibc's behaviour at the edges;
//! - [`cxx`]: C++ `operator new`/`delete` (plain, sized, aligned, nothrow);
//! - [`api`]: what malloc cannot say (`numaweave.h`, generated from it by
//!   cbindgen): allocation on a node, the node of a pointer, a thread's
//!   policy from its text form, node slabs, statistics;
//! - [`foreign`]: pointers numaweave did not allocate, handed to the next
//!   definition of `free`/`realloc`/`malloc_usable_size` (in the hardened
//!   library, `libnumaweave_hardened.so`, a `free` or `realloc` of one is a
//!   misuse, reported).
//!
//! The fast path is the Rust one: the heap pointer is read in the
//! initial-exec TLS model (see numaweave's `os/tls.rs`), so `malloc` and
//! `free` make no `__tls_get_addr` call.

#![allow(non_camel_case_types)]

pub mod api;
pub mod cxx;
pub mod foreign;
pub mod malloc;

use numaweave::NumaAlloc;

/// The allocator, also serving this library's own Rust allocations.
#[global_allocator]
pub static A: NumaAlloc = NumaAlloc::new();

pub(crate) use numaweave::os::set_errno;
