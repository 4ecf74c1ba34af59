//! Raw reads of small kernel files and of the environment, into caller-provided
//! buffers: topology discovery runs inside the allocator's start-up, where the
//! heap is not available yet.

use core::ffi::CStr;
use core::fmt;

use crate::error::{Error, Result};

/// A NUL-terminated path built on the stack with `write!` or
/// [`push`](Self::push) (see the tests below).
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

    /// Appends `s`; a path that would pass [`CAPACITY`](Self::CAPACITY) (or
    /// holds a NUL) stays as it was, so the kernel finds no such file.
    ///
    /// The allocator's start-up builds its sysfs paths with this and
    /// [`push_num`](Self::push_num), not `write!`: `core::fmt`'s code lies
    /// anywhere in the library's text, and every page of it that start-up
    /// touches stays resident in every program (see ARCHITECTURE.md,
    /// "Resident text and start-up stack").
    pub fn push(&mut self, s: &str) -> &mut Self {
        self.push_bytes(s.as_bytes())
    }

    /// Appends `b`: ASCII, or a whole UTF-8 text, so that the buffer stays
    /// text. Out of line: start-up's
    /// path building is a few calls, not a copy of this per piece.
    #[inline(never)]
    #[unsafe(link_section = ".text.sorted.numaweave")]
    fn push_bytes(&mut self, b: &[u8]) -> &mut Self {
        debug_assert!(b.is_ascii() || core::str::from_utf8(b).is_ok());
        if self.len + b.len() <= Self::CAPACITY && !b.contains(&0) {
            self.buf[self.len..self.len + b.len()].copy_from_slice(b);
            self.len += b.len();
            self.buf[self.len] = 0;
        }
        self
    }

    /// Appends `n` in decimal. (Digit by digit through recursion: a loop
    /// over a digit buffer is unrolled twenty times by the optimiser, a
    /// kilobyte of start-up code.)
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub fn push_num(&mut self, n: usize) -> &mut Self {
        if n >= 10 {
            self.push_num(n / 10);
        }
        self.push_bytes(&[b'0' + (n % 10) as u8])
    }
}

impl Default for PathBuf {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Write for PathBuf {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let len = self.len;
        if self.push(s).len == len && !s.is_empty() { Err(fmt::Error) } else { Ok(()) }
    }
}

/// Opens `path` read-only (with `extra` flags), runs `f` on the descriptor
/// and closes it.
fn with_fd<T>(path: &CStr, extra: i32, f: impl FnOnce(i32) -> Result<T>) -> Result<T> {
    let _errno = super::KeepErrno::new();
    super::failpoint::check(super::failpoint::Call::Open)?;
    // SAFETY: `path` is NUL-terminated; flags are valid.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC | extra) };
    if fd < 0 {
        return Err(super::last_error("open"));
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
            return Err(super::last_error(call));
        }
    }
}

/// Reads at most `buf.len()` bytes of the file at `path`, returns how many.
///
/// Made for sysfs and procfs files: a short file read in one or two `read`s.
/// Fails with [`Error::Os`] naming `open` or `read`.
#[unsafe(link_section = ".text.sorted.numaweave")]
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

/// Reads at most `buf.len()` bytes at `offset` of the file at `path`
/// (`pread`), returns how many: a binary table read piece by piece into a
/// stack buffer (the ACPI HMAT), without allocating.
pub fn read_at(path: &CStr, offset: u64, buf: &mut [u8]) -> Result<usize> {
    with_fd(path, 0, |fd| {
        let mut n = 0;
        while n < buf.len() {
            let at = (offset + n as u64) as libc::off_t;
            // SAFETY: the destination is the unfilled tail of `buf`, of the
            // length given.
            let r = retry("pread", || unsafe { libc::pread(fd, buf[n..].as_mut_ptr().cast(), buf.len() - n, at) })?;
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

/// Reads the file at `path` into `buf` and returns its contents as trimmed
/// text. The kernel's list and number files are ASCII: anything else fails
/// with `EILSEQ`.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub fn read_str<'a>(path: &CStr, buf: &'a mut [u8]) -> Result<&'a str> {
    let n = read(path, buf)?;
    ascii(buf[..n].trim_ascii())
}

/// `bytes` as text if they are ASCII. (Not `str::from_utf8`: see
/// [`PathBuf::push`] for why start-up code avoids core's out-of-line helpers.)
#[unsafe(link_section = ".text.sorted.numaweave")]
fn ascii(bytes: &[u8]) -> Result<&str> {
    if !bytes.is_ascii() {
        return Err(Error::Os { call: "read", errno: libc::EILSEQ });
    }
    // SAFETY: ASCII is valid UTF-8.
    Ok(unsafe { core::str::from_utf8_unchecked(bytes) })
}

/// Calls `f` with the rest of the first line of the file at `path` that
/// starts with `key` (`Mems_allowed_list:` in `/proc/self/status`), trimmed;
/// `Ok(None)` when no line does. Reads through `buf` a piece at a time, so a
/// small stack buffer serves a file of any length; lines longer than `buf`
/// are passed over (the key's line must fit).
#[unsafe(link_section = ".text.sorted.numaweave")]
pub fn find_line<T>(path: &CStr, key: &[u8], buf: &mut [u8], f: impl FnOnce(&str) -> T) -> Result<Option<T>> {
    debug_assert!(!buf.is_empty());
    with_fd(path, 0, |fd| {
        // `buf[..held]` is the start of a line not yet seen whole; `skipping`:
        // it is the middle of a line too long for `buf`, whose start was dropped.
        let mut held = 0;
        let mut skipping = false;
        loop {
            // SAFETY: the destination is the unfilled tail of `buf`, of the
            // length given.
            let r = retry("read", || unsafe { libc::read(fd, buf[held..].as_mut_ptr().cast(), buf.len() - held) })?;
            let end = held + r;
            let mut start = 0;
            loop {
                // At the end of the file the last line needs no newline.
                let (line_end, next) = match buf[start..end].iter().position(|&b| b == b'\n') {
                    Some(i) => (start + i, start + i + 1),
                    None if r == 0 && start < end => (end, end),
                    None => break,
                };
                let line = &buf[start..line_end];
                if !skipping && line.starts_with(key) {
                    return Ok(Some(f(ascii(line[key.len()..].trim_ascii())?)));
                }
                skipping = false;
                start = next;
            }
            if r == 0 {
                return Ok(None);
            }
            if start == 0 && end == buf.len() {
                skipping = true;
                held = 0;
            } else {
                buf.copy_within(start..end, 0);
                held = end - start;
            }
        }
    })
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
    let _errno = super::KeepErrno::new();
    // SAFETY: `path` is NUL-terminated.
    unsafe { libc::access(path.as_ptr(), libc::F_OK) == 0 }
}

/// Whether the name of some environment variable starts with `prefix`
/// (which holds no NUL): one pass over `environ`, so that start-up parses
/// its `NUMAWEAVE_*` variables, out-of-line code, only when one is set. The
/// same caveat as [`env()`]: no racing `setenv`.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub fn env_has_prefix(prefix: &[u8]) -> bool {
    unsafe extern "C" {
        static environ: *const *const libc::c_char;
    }
    debug_assert!(!prefix.contains(&0));
    // SAFETY: libc's `environ` is null or a null-terminated array of
    // NUL-terminated strings; read once, by value.
    let mut at = unsafe { environ };
    if at.is_null() {
        return false;
    }
    loop {
        // SAFETY: `at` points into the array, at most at its null end.
        let e = unsafe { *at };
        if e.is_null() {
            return false;
        }
        // Stops at the first byte that differs: at the latest the string's
        // NUL, which no byte of `prefix` matches, so no read passes it.
        // SAFETY: `e.add(i)` is at or before that NUL.
        if prefix.iter().enumerate().all(|(i, &b)| unsafe { *e.add(i) } as u8 == b) {
            return true;
        }
        // SAFETY: `e` was not the terminating null, so the next entry exists.
        at = unsafe { at.add(1) };
    }
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
    let _errno = super::KeepErrno::new();
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
    let _errno = super::KeepErrno::new();
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
    let _errno = super::KeepErrno::new();
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
        let _errno = crate::os::KeepErrno::new();
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(path).ok().map(|m| m.dev())
    }

    /// Where the symbolic link `path` points.
    pub(crate) fn read_link(path: &Path) -> Option<PathBuf> {
        let _errno = crate::os::KeepErrno::new();
        std::fs::read_link(path).ok()
    }

    /// `path` with every link and `..` resolved (`realpath`).
    pub(crate) fn canonical(path: &Path) -> Option<PathBuf> {
        let _errno = crate::os::KeepErrno::new();
        path.canonicalize().ok()
    }

    /// Whether `path` exists.
    pub(crate) fn exists(path: &Path) -> bool {
        let _errno = crate::os::KeepErrno::new();
        path.exists()
    }

    /// The contents of a small text file; `Ok(None)` when it does not exist.
    pub(crate) fn read_text(path: &Path) -> Result<Option<String>> {
        let _errno = crate::os::KeepErrno::new();
        match std::fs::read_to_string(path) {
            Ok(s) => Ok(Some(s)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::Os { call: "read", errno: e.raw_os_error().unwrap_or(libc::EIO) }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of `text` in the temporary directory, removed on drop.
    struct Temp(std::path::PathBuf, std::ffi::CString);

    impl Temp {
        fn new(name: &str, text: &[u8]) -> Self {
            let p = std::env::temp_dir().join(format!("numaweave-{}-{name}", std::process::id()));
            std::fs::write(&p, text).unwrap();
            let c = std::ffi::CString::new(p.clone().into_os_string().into_encoded_bytes()).unwrap();
            Self(p, c)
        }
    }

    impl Drop for Temp {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn find_line_reads_a_file_of_any_length_through_a_small_buffer() {
        let long = "x".repeat(100);
        let text = format!("Name:\tcafé\nCpus_allowed:\t{long}\nMems_allowed_list:\t0-3\nlast:\t7");
        let f = Temp::new("status", text.as_bytes());
        for len in [32, 33, 64, 512] {
            let mut buf = vec![0u8; len];
            let got = find_line(&f.1, b"Mems_allowed_list:", &mut buf, str::to_owned).unwrap();
            assert_eq!(got.as_deref(), Some("0-3"), "buffer of {len}");
            // The last line needs no newline; a key inside a line is no match.
            assert_eq!(find_line(&f.1, b"last:", &mut buf, str::to_owned).unwrap().as_deref(), Some("7"));
            assert_eq!(find_line(&f.1, b"allowed_list:", &mut buf, str::to_owned).unwrap(), None);
        }
        // Neither is the line after a longer-than-the-buffer line taken for
        // the rest of that line, nor the long line's tail for a line.
        let f = Temp::new("long", format!("A:{long}B: tail\nB: 5\n").as_bytes());
        let mut buf = [0u8; 16];
        assert_eq!(find_line(&f.1, b"B:", &mut buf, str::to_owned).unwrap().as_deref(), Some("5"));
        // The key's own line longer than the buffer: passed over.
        assert_eq!(find_line(&f.1, b"A:", &mut buf, str::to_owned).unwrap(), None);
    }

    #[test]
    fn read_str_takes_trimmed_ascii_only() {
        let mut buf = [0u8; 64];
        let f = Temp::new("list", b" 0-3,8\n");
        assert_eq!(read_str(&f.1, &mut buf).unwrap(), "0-3,8");
        let f = Temp::new("utf8", "caf\u{e9}\n".as_bytes());
        assert!(matches!(read_str(&f.1, &mut buf), Err(Error::Os { errno: libc::EILSEQ, .. })));
    }

    #[test]
    fn path_buf_refuses_what_does_not_fit() {
        let mut p = PathBuf::new();
        p.push("/a").push_num(0).push("/").push_num(usize::MAX);
        assert_eq!(p.as_str(), "/a0/18446744073709551615");
        p.push(&"y".repeat(PathBuf::CAPACITY)).push("\0");
        assert_eq!(p.as_str(), "/a0/18446744073709551615");
        assert!(core::fmt::Write::write_str(&mut p, &"y".repeat(PathBuf::CAPACITY)).is_err());
        assert_eq!(p.as_cstr().to_bytes(), p.as_str().as_bytes());
        let mut p = PathBuf::new();
        p.push("/sys/devices/system/node/node").push_num(12).push("/cpulist");
        assert_eq!(p.as_str(), "/sys/devices/system/node/node12/cpulist");
        let mut p = PathBuf::new();
        fmt::Write::write_fmt(&mut p, format_args!("/sys/devices/system/node/node{}/distance", 3)).unwrap();
        assert_eq!(p.as_str(), "/sys/devices/system/node/node3/distance");
    }
}
