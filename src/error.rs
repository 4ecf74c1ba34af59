//! The crate's typed error.
//!
//! Every explicit API returns [`Result`]; the `GlobalAlloc` path never builds an
//! [`Error`] at all (it returns null). The type is `Copy` and holds no heap
//! data, so it can be made anywhere, the allocator's own start-up included.

use core::fmt;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = core::result::Result<T, E>;

/// What kind of device a locality lookup was about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// A PCI function named by its bus id, e.g. `0000:03:00.0`.
    Pci,
    /// A block device or partition, e.g. `nvme0n1`, `sda`.
    Block,
    /// A network interface, e.g. `eth0`.
    Net,
    /// A name that was tried as each of the kinds above.
    Any,
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::Pci => "PCI device",
            DeviceKind::Block => "block device",
            DeviceKind::Net => "network interface",
            DeviceKind::Any => "device",
        })
    }
}

/// A short name stored inline (truncated at [`Name::CAPACITY`] bytes), so errors
/// stay `Copy` and allocation-free.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Name {
    buf: [u8; Name::CAPACITY],
    len: u8,
}

impl Name {
    /// Bytes kept; a longer name is cut and shown with a trailing `…`.
    pub const CAPACITY: usize = 48;

    /// Copies at most [`CAPACITY`](Self::CAPACITY) bytes of `s`.
    pub fn new(s: &str) -> Self {
        let mut buf = [0u8; Self::CAPACITY];
        let mut n = s.len().min(Self::CAPACITY);
        while !s.is_char_boundary(n) {
            n -= 1;
        }
        buf[..n].copy_from_slice(&s.as_bytes()[..n]);
        let truncated = n < s.len();
        Self { buf, len: n as u8 | if truncated { 0x80 } else { 0 } }
    }

    /// The stored (possibly truncated) name.
    pub fn as_str(&self) -> &str {
        let n = usize::from(self.len & 0x7f);
        // Built from a `&str` cut at a char boundary.
        core::str::from_utf8(&self.buf[..n]).unwrap_or("?")
    }

    fn truncated(&self) -> bool {
        self.len & 0x80 != 0
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())?;
        if self.truncated() {
            f.write_str("…")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{self}\"")
    }
}

/// Everything that can go wrong in the explicit (non-`GlobalAlloc`) APIs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// A system call failed; `call` names it and `errno` is the kernel's answer.
    Os {
        /// The failing call, e.g. `"mbind"`.
        call: &'static str,
        /// The raw `errno` value.
        errno: i32,
    },
    /// A node id that is not online in the topology (or is beyond
    /// [`MAX_NODES`](crate::topology::MAX_NODES)).
    InvalidNode {
        /// The rejected id.
        node: usize,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// A size or alignment the crate cannot serve (overflow, beyond the documented maximum).
    LayoutTooLarge {
        /// Requested size in bytes.
        size: usize,
        /// Requested alignment in bytes.
        align: usize,
    },
    /// A node could not supply the memory asked for.
    NodeOutOfMemory {
        /// The node that ran out.
        node: usize,
    },
    /// A device name that does not exist, or is malformed.
    NoSuchDevice {
        /// What kind of device was looked up.
        kind: DeviceKind,
        /// The name as given.
        name: Name,
    },
    /// A topology description (builder, `NUMAWEAVE_TOPOLOGY`, hwloc input) that is
    /// not valid.
    InvalidTopology {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// hwloc refused a request (only with the `hwloc` feature).
    Hwloc {
        /// The hwloc operation that failed.
        what: &'static str,
    },
    /// A slab cache's node holds as many objects as its limit allows.
    LimitReached {
        /// The node at its limit.
        node: usize,
        /// The limit, in objects.
        limit: usize,
    },
    /// A wait for a free object ended without one.
    Timeout {
        /// How long it waited.
        waited: core::time::Duration,
    },
    /// A slab cache's options do not fit together (or name a device with no node).
    InvalidCache {
        /// What is wrong.
        reason: &'static str,
    },
    /// A memory policy that cannot be applied (empty node set, zero
    /// granularity, all-zero weights, malformed `NUMAWEAVE_POLICY` text).
    InvalidPolicy {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A pool's registrar refused a region of its memory
    /// ([`Registrar`](crate::slab::Registrar)): the allocation that needed
    /// the region failed and the region was unmapped.
    Registration {
        /// The region's node.
        node: usize,
        /// The region's length in bytes.
        len: usize,
        /// The registrar's answer, an errno value (`ENOMEM` from
        /// `io_uring_register` is `RLIMIT_MEMLOCK` reached).
        errno: i32,
    },
    /// Registering a region of a pool would pin more memory than the
    /// process's `RLIMIT_MEMLOCK` allows (a registrar that pins, such as
    /// `uring::FixedBuffers` of the `io-uring` feature, said so before
    /// asking the kernel): the allocation that needed it failed, nothing was kept.
    MemlockLimit {
        /// The region's node.
        node: usize,
        /// The soft `RLIMIT_MEMLOCK`, in bytes.
        limit: u64,
        /// Bytes pinned already.
        pinned: u64,
        /// Bytes the region would have pinned.
        asked: usize,
    },
    /// The kernel moved pages of a pool's region to another node as its
    /// registrar pinned them (the node's memory is movable, `ZONE_MOVABLE`,
    /// where no long-term pin may stay: CXL and memory-only nodes usually
    /// are): the registration was undone, the region unmapped, and the
    /// allocation that needed it failed. A pool built with
    /// [`OffNodePins::Report`](crate::slab::OffNodePins::Report) keeps such
    /// regions and counts their pages instead.
    PinsLeftNode {
        /// The node the region was bound to.
        node: usize,
        /// The region's length in bytes.
        len: usize,
        /// Its pages the kernel held on other nodes.
        pages: usize,
    },
    /// A pool could not move to another node: this region of it is
    /// registered with a registrar that cannot let it go for a move (its
    /// pages are pinned for the kernel or a device). Nothing moved.
    RegisteredRegion {
        /// The region's first byte.
        addr: usize,
        /// Its length in bytes.
        len: usize,
        /// The node it is on.
        node: usize,
    },
    /// An io_uring ring or buffer ring asked with sizes the kernel does not
    /// take (`io` layer, feature `io-uring`).
    InvalidRing {
        /// What is wrong.
        reason: &'static str,
    },
    /// A completion handed to a provided-buffer ring names a buffer the
    /// ring has not lent to the kernel (a completion taken twice, or one of
    /// another buffer group): taking it would alias a buffer in use.
    BufferNotLent {
        /// The ring's buffer group.
        group: u16,
        /// The buffer id the completion named.
        bid: u16,
    },
}

impl Error {
    /// For [`Error::Os`] and [`Error::Registration`], the errno; `None`
    /// otherwise.
    pub fn errno(&self) -> Option<i32> {
        match *self {
            Error::Os { errno, .. } | Error::Registration { errno, .. } => Some(errno),
            _ => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Error::Os { call, errno } => {
                write!(f, "{call} failed: {} (errno {errno})", errno_name(errno))
            }
            Error::InvalidNode { node, reason } => write!(f, "invalid NUMA node {node}: {reason}"),
            Error::LayoutTooLarge { size, align } => {
                write!(f, "layout too large: {size} bytes aligned to {align}")
            }
            Error::NodeOutOfMemory { node } => write!(f, "NUMA node {node} is out of memory"),
            Error::NoSuchDevice { kind, name } => write!(f, "no such {kind}: {name:?}"),
            Error::InvalidTopology { reason } => write!(f, "invalid topology: {reason}"),
            Error::Hwloc { what } => write!(f, "hwloc: {what} failed"),
            Error::LimitReached { node, limit } => {
                write!(f, "slab cache limit reached: node {node} holds its {limit} objects")
            }
            Error::Timeout { waited } => write!(f, "no free object within {waited:?}"),
            Error::InvalidCache { reason } => write!(f, "invalid slab cache: {reason}"),
            Error::InvalidPolicy { reason } => write!(f, "invalid memory policy: {reason}"),
            Error::Registration { node, len, errno } => {
                write!(f, "the registrar refused {len} bytes on node {node}: {} (errno {errno})", errno_name(errno))?;
                if errno == libc::ENOMEM {
                    // What ENOMEM from a registration that pins usually means.
                    f.write_str(
                        "; pinned memory counts against RLIMIT_MEMLOCK (`ulimit -l`, systemd's LimitMEMLOCK=)",
                    )?;
                }
                Ok(())
            }
            Error::MemlockLimit { node, limit, pinned, asked } => write!(
                f,
                "pinning {asked} more bytes on node {node} would pass RLIMIT_MEMLOCK ({limit} bytes, {pinned} pinned); \
                 raise it with `ulimit -l` or systemd's LimitMEMLOCK="
            ),
            Error::PinsLeftNode { node, len, pages } => write!(
                f,
                "pinning a {len}-byte region on node {node} moved {pages} of its pages to other nodes (the node's \
                 memory is movable, where no pin may stay); the registration was undone"
            ),
            Error::RegisteredRegion { addr, len, node } => write!(
                f,
                "the pool's region at {addr:#x} ({len} bytes, node {node}) is registered and its registrar cannot \
                 release it for a move: nothing moved"
            ),
            Error::InvalidRing { reason } => write!(f, "invalid io_uring ring: {reason}"),
            Error::BufferNotLent { group, bid } => {
                write!(f, "buffer {bid} of buffer group {group} is not lent to the kernel (a completion taken twice?)")
            }
        }
    }
}

impl std::error::Error for Error {}

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
        libc::EXDEV => "EXDEV",
        libc::EEXIST => "EEXIST",
        libc::ENODEV => "ENODEV",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::ENFILE => "ENFILE",
        libc::EMFILE => "EMFILE",
        libc::ENOSPC => "ENOSPC",
        libc::ENOBUFS => "ENOBUFS",
        libc::ERANGE => "ERANGE",
        libc::ENOSYS => "ENOSYS",
        libc::ENAMETOOLONG => "ENAMETOOLONG",
        libc::EOVERFLOW => "EOVERFLOW",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        _ => "E?",
    }
}

/// Why a table another process published (`numaweave numastat PID`'s
/// reading of `slab::published` and `stats::class_table`) could not be
/// read from its file: the file, or its bytes (`B`, the table's own
/// error).
///
/// ```
/// use numaweave::error::ReadError;
/// let e: ReadError<&str> = ReadError::Bad("not a table");
/// assert_eq!(e.to_string(), "not a table");
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum ReadError<B> {
    /// The file could not be read.
    Io(std::io::Error),
    /// Its bytes are not a table.
    Bad(B),
}

impl<B: fmt::Display> fmt::Display for ReadError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::Io(e) => e.fmt(f),
            ReadError::Bad(b) => b.fmt(f),
        }
    }
}

impl<B: fmt::Debug + fmt::Display> std::error::Error for ReadError<B> {}
