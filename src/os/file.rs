//! Raw reads of small kernel files and of the environment, into caller-provided
//! buffers: topology discovery runs inside the allocator's start-up, where the
//! heap is not available yet.

use core::ffi::CStr;
use core::fmt;

use crate::error::{Error, Result};

/// A NUL-terminated path built on the stack with `write!`.
///
/// ```
/// use core::fmt::Write;
/// let mut p = numaweave::os::file::PathBuf::new();
/// write!(p, "/sys/devices/system/node/node{}/distance", 3).unwrap();
/// assert_eq!(p.as_str(), "/sys/devices/system/node/node3/distance");
/// ```
pub struct PathBuf {
    buf: [u8; Self::CAPACITY + 1],
    len: usize,
}

impl PathBuf {
    /// Longest path it holds; longer writes fail with `fmt::Error`.
    pub const CAPACITY: usize = 255;

    /// An empty path.
    pub const fn new() -> Self {
        Self { buf: [0; Self::CAPACITY + 1], len: 0 }
    }

    /// The path as text.
    pub fn as_str(&self) -> &str {
        // Only ever filled from `&str` pieces.
        core::str::from_utf8(&self.buf[..self.len]).unwrap_or("")
    }

    /// The path with its NUL terminator, for the kernel.
    pub fn as_cstr(&self) -> &CStr {
        CStr::from_bytes_until_nul(&self.buf[..=self.len]).unwrap_or(c"")
    }
}

impl Default for PathBuf {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Write for PathBuf {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let b = s.as_bytes();
        if self.len + b.len() > Self::CAPACITY || b.contains(&0) {
            return Err(fmt::Error);
        }
        self.buf[self.len..self.len + b.len()].copy_from_slice(b);
        self.len += b.len();
        self.buf[self.len] = 0;
        Ok(())
    }
}

/// Opens `path` read-only (with `extra` flags), runs `f` on the descriptor
/// and closes it.
fn with_fd<T>(path: &CStr, extra: i32, f: impl FnOnce(i32) -> Result<T>) -> Result<T> {
    // SAFETY: `path` is NUL-terminated; flags are valid.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC | extra) };
    if fd < 0 {
        return Err(Error::last_os("open"));
    }
    let res = f(fd);
    // SAFETY: `fd` is ours and closed once.
    unsafe { libc::close(fd) };
    res
}

/// A `read`-like call (`read`, `getdents64`): its byte count, retried when
/// a signal interrupts it.
fn retry(call: &'static str, mut f: impl FnMut() -> isize) -> Result<usize> {
    loop {
        let r = f();
        if r >= 0 {
            return Ok(r as usize);
        }
        if super::errno() != libc::EINTR {
            return Err(Error::last_os(call));
        }
    }
}

/// Reads at most `buf.len()` bytes of the file at `path`, returns how many.
///
/// Made for sysfs and procfs files: a short file read in one or two `read`s.
/// Fails with [`Error::Os`] naming `open` or `read`.
pub fn read(path: &CStr, buf: &mut [u8]) -> Result<usize> {
    with_fd(path, 0, |fd| {
        let mut n = 0;
        while n < buf.len() {
            // SAFETY: the destination is the unfilled tail of `buf`, of the
            // length given.
            let r = retry("read", || unsafe { libc::read(fd, buf[n..].as_mut_ptr().cast(), buf.len() - n) })?;
            if r == 0 {
                break;
            }
            n += r;
        }
        Ok(n)
    })
}

/// Reads the whole file at `path`, however long (`/proc/self/smaps`).
/// Allocates: not for the allocator's start-up.
pub fn read_to_end(path: &CStr) -> Result<Vec<u8>> {
    with_fd(path, 0, |fd| {
        let mut out = Vec::new();
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            // SAFETY: reads into `chunk`'s bytes.
            let r = retry("read", || unsafe { libc::read(fd, chunk.as_mut_ptr().cast(), chunk.len()) })?;
            if r == 0 {
                return Ok(out);
            }
            out.extend_from_slice(&chunk[..r]);
        }
    })
}

/// Reads the file at `path` into `buf` and returns its contents as trimmed text.
pub fn read_str<'a>(path: &CStr, buf: &'a mut [u8]) -> Result<&'a str> {
    let n = read(path, buf)?;
    core::str::from_utf8(&buf[..n]).map(str::trim).map_err(|_| Error::Os { call: "read", errno: libc::EILSEQ })
}

/// Calls `f` with the name of each entry of the directory at `path` (not
/// `.` or `..`), in the kernel's order. For the small sysfs directories
/// whose entries name what they hold (`hugepages-2048kB`). Reads with
/// `getdents64` into a stack buffer: unlike `opendir`, it never allocates, so
/// it may run inside the allocator's start-up.
pub fn for_each_entry(path: &CStr, mut f: impl FnMut(&str)) -> Result<()> {
    // Records are 8-byte aligned `linux_dirent64`s: d_ino (8), d_off (8),
    // d_reclen (2), d_type (1), then the NUL-terminated name.
    #[repr(C, align(8))]
    struct Buf([u8; 2048]);
    let mut buf = Buf([0; 2048]);
    with_fd(path, libc::O_DIRECTORY, |fd| {
        loop {
            // SAFETY: the kernel writes at most the buffer's length into it.
            let n = retry("getdents64", || unsafe {
                libc::syscall(libc::SYS_getdents64, fd, buf.0.as_mut_ptr(), buf.0.len()) as isize
            })?;
            if n == 0 {
                return Ok(());
            }
            let mut at = 0;
            while at + 19 < n {
                let reclen = usize::from(u16::from_ne_bytes([buf.0[at + 16], buf.0[at + 17]]));
                if reclen == 0 || at + reclen > n {
                    break;
                }
                let name = CStr::from_bytes_until_nul(&buf.0[at + 19..at + reclen]).ok().and_then(|c| c.to_str().ok());
                if let Some(name) = name
                    && name != "."
                    && name != ".."
                {
                    f(name);
                }
                at += reclen;
            }
        }
    })
}

/// Whether `path` exists (`access(F_OK)`).
pub fn exists(path: &CStr) -> bool {
    // SAFETY: `path` is NUL-terminated.
    unsafe { libc::access(path.as_ptr(), libc::F_OK) == 0 }
}

/// The value of an environment variable, without allocating.
///
/// Reads `environ` through libc's `getenv`. Like every reader of the
/// environment it must not race with `setenv`; the crate reads its variables
/// once, at start-up.
pub fn env(name: &CStr) -> Option<&'static str> {
    // SAFETY: `name` is NUL-terminated; getenv returns null or a pointer into
    // the environment block, which lives as long as the process unless
    // modified (see the doc above).
    let p = unsafe { libc::getenv(name.as_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null getenv results are NUL-terminated strings.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str().ok()
}

/// Writes one line to stderr, formatted into a stack buffer (cut at 512
/// bytes), with a single `write(2)`: usable where the heap is not, such as
/// inside the allocator's start-up.
pub fn report(args: fmt::Arguments<'_>) {
    struct Buf {
        b: [u8; 512],
        n: usize,
    }
    impl fmt::Write for Buf {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            let room = self.b.len() - 1 - self.n;
            let k = s.len().min(room);
            self.b[self.n..self.n + k].copy_from_slice(&s.as_bytes()[..k]);
            self.n += k;
            Ok(())
        }
    }
    let mut buf = Buf { b: [0; 512], n: 0 };
    let _ = fmt::write(&mut buf, args);
    buf.b[buf.n] = b'\n';
    // SAFETY: writes `n + 1` initialised bytes of our buffer to fd 2; a failed
    // write to stderr is not worth reporting.
    unsafe { libc::write(2, buf.b.as_ptr().cast(), buf.n + 1) };
}

/// Writes formatted text to stderr without a buffer: each piece the
/// formatter hands over goes out with its own `write(2)` (what the
/// `Display` impls themselves do is theirs).
pub fn write_stderr(args: fmt::Arguments<'_>) {
    write_fd(2, args);
}

/// [`write_stderr`] to the file descriptor `fd`.
pub fn write_fd(fd: i32, args: fmt::Arguments<'_>) {
    struct Fd(i32);
    impl fmt::Write for Fd {
        fn write_str(&mut self, s: &str) -> fmt::Result {
            let mut b = s.as_bytes();
            while !b.is_empty() {
                // SAFETY: writes initialised bytes of `b` to the descriptor.
                let n = unsafe { libc::write(self.0, b.as_ptr().cast(), b.len()) };
                if n <= 0 {
                    if n < 0 && super::errno() == libc::EINTR {
                        continue;
                    }
                    return Err(fmt::Error);
                }
                b = &b[n as usize..];
            }
            Ok(())
        }
    }
    let _ = fmt::write(&mut Fd(fd), args);
}

/// A copy of stderr that outlives the program's own handling of it (some
/// programs close stderr in their exit handlers, before the allocator's
/// run), close-on-exec; stderr itself if it cannot be had.
pub fn stderr_copy() -> i32 {
    // SAFETY: F_DUPFD_CLOEXEC on fd 2 has no memory effects.
    let fd = unsafe { libc::fcntl(2, libc::F_DUPFD_CLOEXEC, 100) };
    if fd < 0 { 2 } else { fd }
}

/// File-system queries for device locality (`Topology::pci_node` and
/// friends), on `std::path` paths. Not used on the allocator's start-up, so
/// they may allocate.
pub(crate) mod paths {
    use std::path::{Path, PathBuf};

    use crate::error::{Error, Result};

    /// The device number (`st_dev`) of the file system holding `path`.
    pub(crate) fn device_number(path: &Path) -> Option<u64> {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(path).ok().map(|m| m.dev())
    }

    /// Where the symbolic link `path` points.
    pub(crate) fn read_link(path: &Path) -> Option<PathBuf> {
        std::fs::read_link(path).ok()
    }

    /// `path` with every link and `..` resolved (`realpath`).
    pub(crate) fn canonical(path: &Path) -> Option<PathBuf> {
        path.canonicalize().ok()
    }

    /// Whether `path` exists.
    pub(crate) fn exists(path: &Path) -> bool {
        path.exists()
    }

    /// The contents of a small text file; `Ok(None)` when it does not exist.
    pub(crate) fn read_text(path: &Path) -> Result<Option<String>> {
        match std::fs::read_to_string(path) {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::Os { call: "read", errno: e.raw_os_error().unwrap_or(libc::EIO) }),
        }
    }
}
