//! The OS layer: the only module that makes system calls.
//!
//! Like mimalloc's `prim/` and snmalloc's platform layer, everything above this
//! module is written against a handful of small, documented primitives:
//!
//! - [`mem`]: reserve and release address space (`mmap`/`munmap`/`mremap`), bind a
//!   range to a node or node set (`mbind`), return pages to the OS
//!   (`madvise(MADV_DONTNEED)`), ask for transparent huge pages, and ask where
//!   pages really are (`move_pages` with null nodes, `/proc/self/pagemap`).
//! - [`cpu`]: the current CPU and node (`getcpu`, `sched_getcpu`), thread affinity.
//! - [`file`](mod@file): raw reads of small sysfs/procfs files into caller buffers, and the
//!   environment, without touching the heap; and the few file-system queries
//!   of device locality (which may allocate).
//! - [`thread`]: a destructor at thread exit (pthread key) and `fork()` handlers.
//!
//! Node ids at this layer are the kernel's (physical) ids. The topology layer maps
//! the logical nodes of a synthetic topology onto them before calling here.
//!
//! Every failure is an [`Error::Os`](crate::Error::Os) naming the call and
//! errno, and no function here changes the caller's errno ([`KeepErrno`]).

pub mod cpu;
pub mod file;
pub mod mem;
pub mod thread;

/// `Ok` where a call returned 0, else the error its `errno` names: the
/// check of every wrapper here whose call returns 0 or -1.
#[inline]
pub(crate) fn os_result(rc: impl Into<i64>, call: &'static str) -> crate::error::Result<()> {
    if rc.into() != 0 { Err(crate::error::Error::last_os(call)) } else { Ok(()) }
}

/// The calling thread's `errno`.
#[inline]
pub fn errno() -> i32 {
    // SAFETY: `__errno_location` always returns a valid pointer to this
    // thread's errno.
    unsafe { *libc::__errno_location() }
}

/// Sets the calling thread's `errno`.
#[inline]
pub fn set_errno(e: i32) {
    // SAFETY: as in `errno`.
    unsafe { *libc::__errno_location() = e };
}

/// Puts back, when dropped, the `errno` the calling thread had when it was
/// made. Every function of this layer whose libc call may fail holds one
/// from before the call, so a failure's errno travels only in its
/// [`Error::Os`](crate::Error::Os) and nothing above this layer sees errno
/// change: a `malloc` that succeeded after an `mremap` in place failed, or
/// after start-up found a sysfs file missing, leaves errno as it found it,
/// as POSIX asks of `free` and C programs rely on of every call. (Two
/// thread-local accesses, beside a system call.)
#[must_use]
pub(crate) struct KeepErrno(i32);

impl KeepErrno {
    #[inline]
    pub(crate) fn new() -> Self {
        Self(errno())
    }
}

impl Drop for KeepErrno {
    #[inline]
    fn drop(&mut self) {
        set_errno(self.0);
    }
}

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

/// A monotonic clock in milliseconds, cheap enough for slow paths
/// (`CLOCK_MONOTONIC_COARSE`, a vDSO read: no system call).
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

/// The symbolic name of an errno value (`"EINVAL"`), or `"E?"` for one not listed.
pub fn errno_name(errno: i32) -> &'static str {
    match errno {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::ESRCH => "ESRCH",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::ENXIO => "ENXIO",
        libc::E2BIG => "E2BIG",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::EBUSY => "EBUSY",
        libc::EEXIST => "EEXIST",
        libc::ENODEV => "ENODEV",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::ENFILE => "ENFILE",
        libc::EMFILE => "EMFILE",
        libc::ENOSPC => "ENOSPC",
        libc::ERANGE => "ERANGE",
        libc::ENOSYS => "ENOSYS",
        libc::ENAMETOOLONG => "ENAMETOOLONG",
        libc::EOVERFLOW => "EOVERFLOW",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        _ => "E?",
    }
}
