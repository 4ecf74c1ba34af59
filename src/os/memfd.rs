//! A small shared memory file that other processes of the same user can
//! read through `/proc/PID/fd` (`memfd_create`): how the slab layer
//! publishes its chunks to `numaweave numastat PID` without a thread or a
//! socket.

use core::ptr::NonNull;

use super::KeepErrno;
use crate::error::{Error, Result};

/// A memory file of `len` bytes mapped shared and writable here.
pub(crate) struct MemFile {
    pub(crate) fd: i32,
    pub(crate) ptr: NonNull<u8>,
    pub(crate) len: usize,
}

// SAFETY: the mapping and descriptor are process-wide resources; the
// handle only says where they are, and whoever holds it uses them alone.
unsafe impl Send for MemFile {}

impl MemFile {
    /// Makes one named `name` (shown as `/memfd:NAME (deleted)`), close-on-exec,
    /// zero-filled (its pages are committed as they are written).
    pub(crate) fn create(name: &core::ffi::CStr, len: usize) -> Result<MemFile> {
        let _errno = KeepErrno::new();
        // SAFETY: a NUL-terminated name; the flags are valid.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(super::last_error("memfd_create"));
        }
        let fail = |call| {
            let e = super::last_error(call);
            // SAFETY: our descriptor, used by nothing else.
            unsafe { libc::close(fd) };
            Err(e)
        };
        // SAFETY: our descriptor.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            return fail("ftruncate");
        }
        // SAFETY: a fresh shared mapping of our file, placed by the kernel.
        let p = unsafe {
            libc::mmap(core::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if p == libc::MAP_FAILED {
            return fail("mmap");
        }
        NonNull::new(p.cast())
            .map(|ptr| MemFile { fd, ptr, len })
            .ok_or(Error::Os { call: "mmap", errno: libc::ENOMEM })
    }

    /// Closes and unmaps it.
    ///
    /// # Safety
    /// Nothing uses the mapping any more.
    pub(crate) unsafe fn destroy(self) {
        // SAFETY: our mapping and descriptor (the caller's word: unused).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
            libc::close(self.fd);
        }
    }
}
