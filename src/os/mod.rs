//! The OS layer: the only module that makes system calls.
//!
//! Like mimalloc's `prim/` and snmalloc's platform layer, everything above this
//! module is written against a handful of small, documented primitives:
//!
//! - [`mem`]: reserve and release address space (`mmap`/`munmap`/`mremap`), bind a
//!   range to a node or node set (`mbind`), return pages to the OS
//!   (`madvise(MADV_DONTNEED)`), ask for transparent huge pages, and ask where
//!   pages really are (`move_pages` with null nodes, `/proc/self/pagemap`).
//! - [`pages`]: move a range's pages to another node while they are in use
//!   (`move_pages`), each page's refusal with its errno.
//! - `memfd` (crate-private): a shared memory file other processes read
//!   through `/proc/PID/fd` (`memfd_create`).
//! - [`zones`]: how much of a node's memory is movable (`/proc/zoneinfo`),
//!   where a long-term pin cannot stay.
//! - [`cpu`]: the current CPU and node (`getcpu`, `sched_getcpu`), pinning a thread to a CPU.
//! - [`rseq`]: the rseq area glibc registers for each thread (the CPU, node
//!   and concurrency id the kernel keeps there), and per-CPU stacks whose
//!   pop and push are restartable sequences on it.
//! - `file` (crate-private): raw reads of small sysfs/procfs files into
//!   caller buffers, and the environment, without touching the heap; the
//!   few file-system queries of device locality (which may allocate); one
//!   line on stderr without the heap ([`report`]).
//! - `thread` (crate-private): a destructor at thread exit (pthread key),
//!   the ranked `fork()` handlers, the futex a blocking lock sleeps on.
//! - `tls` (crate-private): the heap's thread-local slot, in the
//!   initial-exec model (platform assembly).
//! - [`abort`]: the end of a process whose heap cannot be trusted.
//! - [`failpoint`]: with the `failpoints` feature (tests), any call of
//!   these refused on demand, as the kernel would refuse it.
//!
//! Node ids at this layer are the kernel's (physical) ids. The topology layer maps
//! the logical nodes of a synthetic topology onto them before calling here.
//!
//! Every failure is an [`Error::Os`](crate::Error::Os) naming the call and
//! errno, and no function here changes the caller's errno (`KeepErrno`).

pub mod cpu;
pub mod failpoint;
// (Under loom only the concurrent structures are built: the allocator,
// which uses most of these, is not.)
#[cfg_attr(loom, allow(dead_code))]
pub(crate) mod file;
pub mod mem;
#[cfg_attr(loom, allow(dead_code))]
pub(crate) mod memfd;
pub mod pages;
pub mod rseq;
#[cfg_attr(loom, allow(dead_code))]
pub(crate) mod thread;
#[cfg(not(loom))]
pub(crate) mod tls;
pub mod zones;

mod errno;

pub use crate::error::errno_name;
pub(crate) use errno::{KeepErrno, last_error, os_result};
pub use errno::{errno, set_errno};
pub use file::report;

/// The size of a base page in bytes (read once from `sysconf`, 4096 on x86-64).
pub fn page_size() -> usize {
    static PAGE: ReadOnce = ReadOnce::new();
    PAGE.get(|| {
        // SAFETY: sysconf has no preconditions.
        let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if v > 0 { v as usize } else { 4096 }
    })
}

/// A fact about the machine read from the OS once, then remembered.
///
/// A plain std atomic, not the loom shim nor `sync::InitCell` (whose loom
/// build cannot live in a static): these caches are not modelled
/// structures, and racing first calls only repeat an idempotent read.
pub(crate) struct ReadOnce(std::sync::atomic::AtomicUsize);

impl ReadOnce {
    pub(crate) const fn new() -> Self {
        Self(std::sync::atomic::AtomicUsize::new(0))
    }

    /// The remembered value, else `read()`'s, remembered; `read` must not
    /// return 0 (taken for "not read yet").
    #[inline]
    pub(crate) fn get(&self, read: impl FnOnce() -> usize) -> usize {
        use std::sync::atomic::Ordering;
        match self.0.load(Ordering::Relaxed) {
            0 => {
                let v = read();
                debug_assert_ne!(v, 0);
                self.0.store(v, Ordering::Relaxed);
                v
            }
            v => v,
        }
    }
}

/// Ends the process at once (`abort()`: `SIGABRT`, a core dump where
/// enabled), for a misuse the hardened build reports: nothing of the
/// process's own (exit handlers, buffers) runs on a heap that cannot be
/// trusted.
pub fn abort() -> ! {
    // SAFETY: always sound.
    unsafe { libc::abort() }
}

/// The running kernel's version as (major, minor) (`uname`), read once;
/// (0, 0) when its release does not read as one.
pub fn kernel_version() -> (u32, u32) {
    static VERSION: ReadOnce = ReadOnce::new();
    let v = VERSION.get(|| {
        // SAFETY: utsname is plain bytes; all-zero is a valid value.
        let mut u: libc::utsname = unsafe { core::mem::zeroed() };
        let _errno = KeepErrno::new();
        // SAFETY: `u` is a valid, writable utsname.
        if unsafe { libc::uname(&mut u) } != 0 {
            return usize::MAX;
        }
        let release: Vec<u8> = u.release.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        let text = String::from_utf8_lossy(&release);
        let mut parts = text.split(|c: char| !c.is_ascii_digit()).filter(|p| !p.is_empty());
        match (parts.next().and_then(|p| p.parse::<usize>().ok()), parts.next().and_then(|p| p.parse::<usize>().ok())) {
            (Some(major), Some(minor)) if major < 1 << 16 && minor < 1 << 16 => (major << 16 | minor) + 1,
            _ => usize::MAX,
        }
    });
    if v == usize::MAX { (0, 0) } else { (((v - 1) >> 16) as u32, ((v - 1) & 0xffff) as u32) }
}

/// A monotonic clock in milliseconds, cheap enough for slow paths
/// (`CLOCK_MONOTONIC_COARSE`, a vDSO read: no system call).
#[unsafe(link_section = ".text.sorted.numaweave")]
pub fn monotonic_ms() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid `timespec` to fill; the clock id exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    // Never 0: 0 means "nothing due" to the allocator's purge bookkeeping.
    (ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000).max(1)
}

/// 64 random bits from the kernel (`getrandom`), if it gives them.
pub fn random_u64() -> Option<u64> {
    let _errno = KeepErrno::new();
    let mut v = 0u64;
    // SAFETY: writes at most 8 bytes into `v`; GRND_NONBLOCK never waits.
    let n = unsafe { libc::getrandom((&mut v as *mut u64).cast(), 8, libc::GRND_NONBLOCK) };
    (n == 8).then_some(v)
}
