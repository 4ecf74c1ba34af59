//! The calling thread's `errno`, and the rule of this layer: no function
//! of it changes the caller's errno ([`KeepErrno`]); a failure's errno
//! travels in its [`Error::Os`].

use crate::error::Error;

/// `Ok` where a call returned 0, else the error its `errno` names: the
/// check of every wrapper here whose call returns 0 or -1.
#[inline]
pub(crate) fn os_result(rc: impl Into<i64>, call: &'static str) -> crate::error::Result<()> {
    if rc.into() != 0 { Err(last_error(call)) } else { Ok(()) }
}

/// The error of the libc call `call` that just failed: its name and the
/// `errno` it left (read before the wrapper's [`KeepErrno`] puts the
/// caller's back).
#[inline]
pub(crate) fn last_error(call: &'static str) -> Error {
    Error::Os { call, errno: errno() }
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
