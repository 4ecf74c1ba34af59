//! A small shared memory file that other processes of the same user can
//! read through `/proc/PID/fd` (`memfd_create`): how the slab layer
//! publishes its chunks to `numaweave numastat PID` without a thread or a
//! socket.
//!
//! The file is sealed at its size (`F_SEAL_SHRINK`, `F_SEAL_GROW`): a
//! process that opens it through `/proc/PID/fd` cannot truncate it under
//! the writer's mapping (whose next write would be a `SIGBUS`). Its
//! mapping is not inherited by a forked child (`MADV_DONTFORK`): a child
//! never writes its parent's file.

use core::ptr::NonNull;

use super::KeepErrno;
use crate::error::{Error, Result};

/// A memory file mapped shared and writable here. Its descriptor stays
/// open for the life of the process that made it (readers find the file
/// through it); no handle closes it.
pub(crate) struct MemFile {
    pub(crate) ptr: NonNull<u8>,
}

// SAFETY: the mapping and descriptor are process-wide resources; the
// handle only says where they are, and whoever holds it uses them alone.
unsafe impl Send for MemFile {}

impl MemFile {
    /// Makes one named `name` (shown as `/memfd:NAME (deleted)`), close-on-exec,
    /// zero-filled (its pages are committed as they are written), sealed at
    /// `len` bytes, its mapping left out of forked children.
    pub(crate) fn create(name: &core::ffi::CStr, len: usize) -> Result<MemFile> {
        let _errno = KeepErrno::new();
        super::failpoint::check(super::failpoint::Call::Memfd)?;
        // SAFETY: a NUL-terminated name; the flags are valid.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(super::last_error("memfd_create"));
        }
        let fail = |call| {
            let e = super::last_error(call);
            // SAFETY: our descriptor, opened above, used by nothing else.
            unsafe { libc::close(fd) };
            Err(e)
        };
        // SAFETY: our descriptor.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            return fail("ftruncate");
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: our descriptor, made with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } != 0 {
            return fail("fcntl(F_ADD_SEALS)");
        }
        // SAFETY: a fresh shared mapping of our file, placed by the kernel.
        let p = unsafe {
            libc::mmap(core::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if p == libc::MAP_FAILED {
            return fail("mmap");
        }
        // SAFETY: the mapping just made, `len` bytes.
        if unsafe { libc::madvise(p, len, libc::MADV_DONTFORK) } != 0 {
            let e = super::last_error("madvise(MADV_DONTFORK)");
            // SAFETY: our mapping and descriptor, made above, used by nothing else.
            unsafe {
                libc::munmap(p, len);
                libc::close(fd);
            }
            return Err(e);
        }
        NonNull::new(p.cast()).map(|ptr| MemFile { ptr }).ok_or(Error::Os { call: "mmap", errno: libc::ENOMEM })
    }
}

/// This process's id (`getpid`): a forked child sees a new one.
pub(crate) fn process_id() -> u32 {
    // SAFETY: getpid has no preconditions and cannot fail.
    unsafe { libc::getpid() as u32 }
}

/// Reads a table another process publishes in the file at `path`
/// (through `/proc/PID/fd`): the whole file (up to `len + 1` bytes, so
/// that a longer file shows), then the `u64` at word `seq_word` again, and
/// `parse` of both; read again from the start, ten times a millisecond
/// apart, while `parse` says the table was `changing` (a seqlock's writer
/// was at work).
pub(crate) fn read_table<T, B>(
    path: &std::path::Path,
    len: usize,
    seq_word: usize,
    parse: impl Fn(&[u8], u64) -> Result<T, B>,
    changing: impl Fn(&B) -> bool,
) -> Result<T, crate::error::ReadError<B>> {
    use crate::error::ReadError;
    let mut tries = 1;
    loop {
        let (bytes, seq) = read_seqlocked(path, len, seq_word).map_err(ReadError::Io)?;
        match parse(&bytes, seq) {
            Err(b) if changing(&b) && tries < 10 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            r => return r.map_err(ReadError::Bad),
        }
    }
}

/// The file at `path`: up to `len + 1` bytes from its start, then the
/// little-endian `u64` at word `seq_word` again, which a seqlock's reader
/// compares with the copy's (0 if the file is too short to hold it).
fn read_seqlocked(path: &std::path::Path, len: usize, seq_word: usize) -> std::io::Result<(Vec<u8>, u64)> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path)?;
    let mut bytes = vec![0u8; len + 1];
    let mut n = 0;
    while n < bytes.len() {
        match f.read_at(&mut bytes[n..], n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    bytes.truncate(n);
    let mut seq = [0u8; 8];
    let seq = match f.read_exact_at(&mut seq, (seq_word * 8) as u64) {
        Ok(()) => u64::from_le_bytes(seq),
        Err(_) => 0,
    };
    Ok((bytes, seq))
}
