//! Address space and page placement: `mmap`, `munmap`, `mremap`, `mbind`,
//! `madvise`, `move_pages` and `/proc/self/pagemap`.
//!
//! [`Mapping`] owns a mapping and unmaps it on drop; the `unsafe` free functions
//! are the same operations on raw ranges, for code (the allocator) that keeps
//! its mappings in its own headers.

use core::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{Error, Result};
use crate::sets::{MAX_NODES, NodeSet};

use super::failpoint::{Call, check};
use super::page_size;

/// A kernel memory policy for a range of address space (`mbind`). Node ids are
/// the kernel's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemPolicy {
    /// The thread's or process's policy (`MPOL_DEFAULT`): usually "the node of
    /// the CPU that first touches the page".
    Default,
    /// Only these nodes, never elsewhere (`MPOL_BIND`); a fault fails with
    /// `SIGBUS`/OOM when they are full.
    Bind(NodeSet),
    /// This node first, others when it is full (`MPOL_PREFERRED`).
    Preferred(usize),
    /// Any node of the set first, others when they are full
    /// (`MPOL_PREFERRED_MANY`, Linux 5.15+).
    PreferredMany(NodeSet),
    /// Page by page round-robin over the set (`MPOL_INTERLEAVE`).
    Interleave(NodeSet),
    /// The node of the CPU that touches the page (`MPOL_LOCAL`, Linux 3.8+).
    Local,
}

const MPOL_DEFAULT: i32 = 0;
const MPOL_PREFERRED: i32 = 1;
const MPOL_BIND: i32 = 2;
const MPOL_INTERLEAVE: i32 = 3;
const MPOL_LOCAL: i32 = 4;
const MPOL_PREFERRED_MANY: i32 = 5;

/// `mbind` flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct BindFlags(u32);

impl BindFlags {
    /// Set the policy for pages faulted from now on.
    pub const NONE: BindFlags = BindFlags(0);
    /// Fail (`EIO`) if pages already present do not follow the policy (`MPOL_MF_STRICT`).
    pub const STRICT: BindFlags = BindFlags(1);
    /// Migrate pages already present that do not follow the policy
    /// (`MPOL_MF_MOVE | MPOL_MF_STRICT`).
    pub const MOVE: BindFlags = BindFlags(1 | 2);
}

impl MemPolicy {
    fn raw(&self) -> Result<(i32, u64)> {
        let check = |s: &NodeSet| {
            if s.is_empty() {
                Err(Error::InvalidNode { node: 0, reason: "empty node set in a memory policy" })
            } else {
                Ok(s.bits())
            }
        };
        Ok(match *self {
            MemPolicy::Default => (MPOL_DEFAULT, 0),
            MemPolicy::Local => (MPOL_LOCAL, 0),
            MemPolicy::Bind(s) => (MPOL_BIND, check(&s)?),
            MemPolicy::Interleave(s) => (MPOL_INTERLEAVE, check(&s)?),
            MemPolicy::PreferredMany(s) => (MPOL_PREFERRED_MANY, check(&s)?),
            MemPolicy::Preferred(n) => {
                if n >= MAX_NODES {
                    return Err(Error::InvalidNode { node: n, reason: "beyond MAX_NODES" });
                }
                (MPOL_PREFERRED, 1u64 << n)
            }
        })
    }
}

/// The pages that back memory asked for with a [`Huge`] choice.
///
/// ```
/// use numaweave::os::mem::Huge;
/// assert_eq!("hugetlb".parse::<Huge>(), Ok(Huge::Hugetlb));
/// assert_eq!("hugetlb-1g".parse::<Huge>(), Ok(Huge::Hugetlb1G));
/// assert!("1G".parse::<Huge>().is_err());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Huge {
    /// Base pages; transparent huge pages refused where one would commit
    /// memory nobody touched.
    #[default]
    Off,
    /// Transparent huge pages asked for (`MADV_HUGEPAGE`) on ranges aligned
    /// to [`HUGE_PAGE`]: the kernel gives them when it can, lazily.
    Thp,
    /// Pages of [`HUGE_PAGE`] from the kernel's hugetlb pool (`MAP_HUGETLB`),
    /// committed at once; base pages where the node's pool has too few free.
    Hugetlb,
    /// Pages of [`GIGANTIC_PAGE`] (1 GiB) from the kernel's hugetlb pool, as
    /// [`Hugetlb`](Self::Hugetlb): for slab caches and DMA pools that keep
    /// gigabytes of buffers (a chunk is one such page, committed at once).
    /// Interleave regions (4 MiB) take [`HUGE_PAGE`]s instead.
    Hugetlb1G,
}

impl Huge {
    /// The hugetlb page size this asks for, if any.
    pub fn hugetlb_page(self) -> Option<usize> {
        match self {
            Huge::Hugetlb => Some(HUGE_PAGE),
            Huge::Hugetlb1G => Some(GIGANTIC_PAGE),
            Huge::Off | Huge::Thp => None,
        }
    }
}

impl core::str::FromStr for Huge {
    type Err = &'static str;

    /// `off`, `thp`, `hugetlb` or `hugetlb-1g` (`NUMAWEAVE_HUGE`'s values).
    fn from_str(s: &str) -> core::result::Result<Self, Self::Err> {
        match s.trim() {
            "off" | "" => Ok(Huge::Off),
            "thp" => Ok(Huge::Thp),
            "hugetlb" => Ok(Huge::Hugetlb),
            "hugetlb-1g" => Ok(Huge::Hugetlb1G),
            _ => Err("huge pages: off, thp, hugetlb or hugetlb-1g"),
        }
    }
}

/// The huge page [`Huge`] asks for: 2 MiB (x86-64; arm64 with 4 KiB pages).
pub const HUGE_PAGE: usize = 2 << 20;
/// The gigantic page of [`Huge::Hugetlb1G`]: 1 GiB.
pub const GIGANTIC_PAGE: usize = 1 << 30;

/// Maps `len` bytes (a multiple of `page`) of hugetlb pages of `page` bytes
/// ([`HUGE_PAGE`] or [`GIGANTIC_PAGE`]) aligned to `align` (a power of two,
/// at least `page`): the pages are reserved from the kernel's pool now
/// (`ENOMEM` when it has too few) and taken at the first touch, under the
/// range's policy.
pub fn map_hugetlb(len: usize, align: usize, page: usize) -> Result<NonNull<u8>> {
    let _errno = super::KeepErrno::new();
    if !page.is_power_of_two() || len == 0 || !len.is_multiple_of(page) || !align.is_power_of_two() || align < page {
        return Err(Error::LayoutTooLarge { size: len, align });
    }
    check(Call::Mmap)?;
    // The kernel aligns hugetlb mappings to their page; a larger alignment
    // over-maps by the difference and trims whole pages.
    let extra = align - page;
    let total = len.checked_add(extra).ok_or(Error::LayoutTooLarge { size: len, align })?;
    // MAP_HUGE_2MB / MAP_HUGE_1GB: log2 of the page size above MAP_HUGE_SHIFT.
    let size_flag = (page.trailing_zeros() as i32) << libc::MAP_HUGE_SHIFT;
    // SAFETY: an anonymous mapping at an address of the kernel's choosing
    // cannot alias anything.
    let p = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            total,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | size_flag,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(super::last_error("mmap(MAP_HUGETLB)"));
    }
    let start = p as usize;
    let aligned = start.next_multiple_of(align);
    let (head, tail) = (aligned - start, total - (aligned - start) - len);
    // SAFETY: both trims are whole huge pages of the mapping just made,
    // outside the range returned.
    unsafe {
        if head > 0 {
            libc::munmap(p, head);
        }
        if tail > 0 {
            libc::munmap((aligned + len) as *mut libc::c_void, tail);
        }
    }
    NonNull::new(aligned as *mut u8).ok_or(Error::Os { call: "mmap", errno: libc::ENOMEM })
}

/// [`map_hugetlb`] (in `range` if given), bound with `policy`,
/// committed now (each page touched:
/// it comes from the pool reserved at `mmap`, so the touch cannot fail) and
/// checked with `move_pages` to be on `node` (anywhere, with `None`): under a
/// preferred policy a node whose pool is short is served from another's.
/// On failure nothing stays mapped; pages found elsewhere give
/// [`Error::NodeOutOfMemory`].
pub fn map_hugetlb_on(
    len: usize,
    align: usize,
    page: usize,
    policy: MemPolicy,
    node: Option<usize>,
    range: Option<&AddressRange>,
) -> Result<NonNull<u8>> {
    let p = match range {
        Some(pl) => pl.map_hugetlb(len, align, page)?,
        None => map_hugetlb(len, align, page)?,
    };
    let fail = |e| {
        // SAFETY: the mapping made above; nothing points into it yet.
        let _ = unsafe { unmap(p, len) };
        Err(e)
    };
    if policy != MemPolicy::Default {
        // SAFETY: our fresh mapping, not yet touched.
        if let Err(e) = unsafe { bind(p, len, policy, BindFlags::NONE) } {
            return fail(e);
        }
    }
    const BATCH: usize = 16;
    let (mut pages, mut status) = ([core::ptr::null::<u8>(); BATCH], [0i32; BATCH]);
    let n = len / page;
    let mut i = 0;
    while i < n {
        let k = (n - i).min(BATCH);
        for (j, at) in pages[..k].iter_mut().enumerate() {
            // SAFETY: inside the mapping; the write commits the page under
            // the policy just set.
            unsafe {
                *at = p.as_ptr().add((i + j) * page);
                at.cast_mut().write_volatile(0);
            }
        }
        if let Err(e) = page_nodes(&pages[..k], &mut status[..k]) {
            return fail(e);
        }
        for &s in &status[..k] {
            if s < 0 {
                return fail(Error::Os { call: "move_pages", errno: -s });
            }
            if let Some(want) = node.filter(|&w| s as usize != w) {
                return fail(Error::NodeOutOfMemory { node: want });
            }
        }
        i += k;
    }
    Ok(p)
}

fn check_len(len: usize) -> Result<usize> {
    let page = page_size();
    if len == 0 || len > isize::MAX as usize - page {
        return Err(Error::LayoutTooLarge { size: len, align: page });
    }
    Ok((len + page - 1) & !(page - 1))
}

/// How the kernel's overcommit policy (`vm.overcommit_memory`) sees a
/// mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Charge {
    /// Address space only (`MAP_NORESERVE`): under the default heuristic
    /// the mapping is not checked, and its pages count as they are touched.
    /// For reservations of which a part is ever used (segments, regions).
    Lazy,
    /// The whole length, now: the default heuristic refuses a mapping larger
    /// than RAM and swap together, and strict accounting (mode 2) anything
    /// past the commit limit, with `ENOMEM`. For memory handed out whole (a
    /// huge block), so that an impossible `malloc` fails where the program
    /// can handle it, not later in the OOM killer.
    Whole,
}

/// Maps `len` bytes (rounded up to pages) of private anonymous memory, readable
/// and writable, without reserving swap (`MAP_NORESERVE`): pages are committed
/// by the first touch, on the node the range's policy picks.
pub fn map(len: usize) -> Result<NonNull<u8>> {
    map_charged(len, Charge::Lazy)
}

/// [`map`], charged as `charge` says.
pub fn map_charged(len: usize, charge: Charge) -> Result<NonNull<u8>> {
    let _errno = super::KeepErrno::new();
    let len = check_len(len)?;
    check(Call::Mmap)?;
    let noreserve = if charge == Charge::Lazy { libc::MAP_NORESERVE } else { 0 };
    // SAFETY: an anonymous mapping at an address of the kernel's choosing
    // cannot alias anything.
    let p = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | noreserve,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(super::last_error("mmap"));
    }
    NonNull::new(p.cast()).ok_or(Error::Os { call: "mmap", errno: libc::ENOMEM })
}

/// Like [`map`], with the start aligned to `align` (a power of two; at least a
/// page is always given). Over-maps by `align` and trims both ends.
pub fn map_aligned(len: usize, align: usize) -> Result<NonNull<u8>> {
    map_aligned_at(len, align, 0, Charge::Lazy)
}

/// Like [`map_charged`], placed so that `start + offset` is a multiple of
/// `align` (a power of two): for a header followed by a block aligned to
/// `align`. `offset` must be a multiple of the page size.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub fn map_aligned_at(len: usize, align: usize, offset: usize, charge: Charge) -> Result<NonNull<u8>> {
    let page = page_size();
    if !align.is_power_of_two() || !offset.is_multiple_of(page) || offset > len {
        return Err(Error::LayoutTooLarge { size: len, align });
    }
    if align <= page {
        return map_charged(len, charge);
    }
    let len = check_len(len)?;
    let total = len.checked_add(align).ok_or(Error::LayoutTooLarge { size: len, align })?;
    let base = map_charged(total, charge)?;
    let start = base.as_ptr() as usize;
    let aligned = (start + offset).next_multiple_of(align) - offset;
    let head = aligned - start;
    let tail = total - head - len;
    // SAFETY: head and tail are page-aligned pieces of the mapping made above,
    // outside the range handed out. A trim the kernel refuses stays mapped:
    // address space of nobody's, never touched, not a reason to fail.
    unsafe {
        if head != 0 {
            let _ = unmap(base, head);
        }
        if tail != 0 {
            let _ = unmap(NonNull::new_unchecked((aligned + len) as *mut u8), tail);
        }
    }
    // SAFETY: `aligned` lies inside the mapping, hence non-null.
    Ok(unsafe { NonNull::new_unchecked(aligned as *mut u8) })
}

/// Where a caller's mappings go: one range of the address space, by hint,
/// so that a map of the range (the allocator's segment map) stays small.
/// mimalloc places its segments by hint the same way, from 2 TiB; the
/// kernel's own choices (executables, libraries, other mappings) lie near
/// the top of the user address space. Each mapping claims the next aligned
/// span of the range and asks for it with `MAP_FIXED_NOREPLACE` (which
/// never replaces a mapping: a span someone holds fails, and the next is
/// tried); the first span is at a random point of the range's first
/// eighth. When a few spans in a row are taken, or the range is used up,
/// the kernel chooses ([`map_aligned_at`]).
///
/// ```
/// use numaweave::os::mem::{Charge, AddressRange};
/// static RANGE: AddressRange = AddressRange::new(1 << 40, 1 << 43);
/// let p = RANGE.map_aligned_at(1 << 20, 4 << 20, 0, Charge::Lazy).unwrap();
/// assert_eq!(p.as_ptr() as usize % (4 << 20), 0);
/// assert!(RANGE.contains(p.as_ptr()));
/// // SAFETY: the mapping just made, unused.
/// unsafe { numaweave::os::mem::unmap(p, 1 << 20).unwrap() };
/// ```
pub struct AddressRange {
    start: usize,
    end: usize,
    /// The next span's start (0: not chosen yet).
    next: AtomicUsize,
}

/// Spans a [`AddressRange`] tries before the kernel chooses.
const RANGE_TRIES: usize = 8;

impl AddressRange {
    /// Mappings placed in `[start, end)` (page-aligned).
    pub const fn new(start: usize, end: usize) -> AddressRange {
        AddressRange { start, end, next: AtomicUsize::new(0) }
    }

    /// Whether `p` lies in the range.
    #[inline]
    pub fn contains(&self, p: *const u8) -> bool {
        (p as usize).wrapping_sub(self.start) < self.end - self.start
    }

    /// Claims the next span for `len` bytes starting where `start + offset`
    /// is a multiple of `align`: its start.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    fn claim(&self, len: usize, align: usize, offset: usize) -> Option<usize> {
        let mut cur = self.next.load(Ordering::Relaxed);
        loop {
            let from = if cur == 0 {
                let eighth = ((self.end - self.start) / 8).max(1);
                self.start + (super::random_u64().unwrap_or(0) as usize % eighth)
            } else {
                cur
            };
            let mut at = (from + offset).next_multiple_of(align) - offset;
            if at < from || at.checked_add(len).is_none_or(|e| e > self.end) {
                // Used up: round again from the start (what was unmapped
                // since is free again).
                at = (self.start + offset).next_multiple_of(align) - offset;
            }
            let next = (at + len).next_multiple_of(page_size());
            match self.next.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(at),
                Err(c) => cur = c,
            }
        }
    }

    /// `map(at)` at the range's next spans, a few tries.
    fn map_in(
        &self,
        len: usize,
        align: usize,
        offset: usize,
        map: impl Fn(usize) -> Option<NonNull<u8>>,
    ) -> Option<NonNull<u8>> {
        if !offset.is_multiple_of(page_size()) || offset > len || len > self.end - self.start {
            return None;
        }
        (0..RANGE_TRIES).find_map(|_| map(self.claim(len, align, offset)?))
    }

    /// [`map_aligned_at`], placed in the range if it can be.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub fn map_aligned_at(&self, len: usize, align: usize, offset: usize, charge: Charge) -> Result<NonNull<u8>> {
        let len = check_len(len)?;
        if !align.is_power_of_two() {
            return Err(Error::LayoutTooLarge { size: len, align });
        }
        let align = align.max(page_size());
        let noreserve = if charge == Charge::Lazy { libc::MAP_NORESERVE } else { 0 };
        let placed = self.map_in(len, align, offset, |at| {
            // SAFETY: `MAP_FIXED_NOREPLACE` never replaces a mapping: the
            // kernel maps the free span at `at` or fails.
            unsafe { map_at(at, len, noreserve) }
        });
        match placed {
            Some(p) => Ok(p),
            None => map_aligned_at(len, align, offset, charge),
        }
    }

    /// [`map_hugetlb`], placed in the range if it can be.
    pub fn map_hugetlb(&self, len: usize, align: usize, page: usize) -> Result<NonNull<u8>> {
        if !page.is_power_of_two() || len == 0 || !len.is_multiple_of(page) || !align.is_power_of_two() || align < page
        {
            return Err(Error::LayoutTooLarge { size: len, align });
        }
        let size_flag = (page.trailing_zeros() as i32) << libc::MAP_HUGE_SHIFT;
        let placed = self.map_in(len, align, 0, |at| {
            // SAFETY: as in `map_aligned_at`.
            unsafe { map_at(at, len, libc::MAP_HUGETLB | size_flag) }
        });
        match placed {
            Some(p) => Ok(p),
            None => map_hugetlb(len, align, page),
        }
    }
}

/// Maps `len` bytes exactly at `at`, if no mapping is there
/// (`MAP_FIXED_NOREPLACE`, Linux 4.17; on older kernels a mere hint, and a
/// mapping put elsewhere is undone).
///
/// # Safety
/// Never replaces a mapping; the caller owns what it gets.
unsafe fn map_at(at: usize, len: usize, flags: i32) -> Option<NonNull<u8>> {
    let _errno = super::KeepErrno::new();
    check(Call::Mmap).ok()?;
    // SAFETY: `MAP_FIXED_NOREPLACE` maps the free range at `at` or nothing.
    let p = unsafe {
        libc::mmap(
            at as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE | flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    if p as usize != at {
        // SAFETY: the mapping the kernel just made elsewhere, unused.
        unsafe { libc::munmap(p, len) };
        return None;
    }
    NonNull::new(p.cast())
}

/// Makes `[ptr, ptr+len)` inaccessible (`mprotect(PROT_NONE)`): a guard
/// page, whose access faults.
///
/// # Safety
/// The range must be mapped by this crate, page-aligned, and unused.
pub unsafe fn protect_none(ptr: NonNull<u8>, len: usize) -> Result<()> {
    let _errno = super::KeepErrno::new();
    check(Call::Mprotect)?;
    // SAFETY: forwarded to the caller.
    super::os_result(unsafe { libc::mprotect(ptr.as_ptr().cast(), len, libc::PROT_NONE) }, "mprotect")
}

/// Unmaps `[ptr, ptr+len)`.
///
/// # Safety
/// The range must be mapped by this crate and no live reference may point into it.
pub unsafe fn unmap(ptr: NonNull<u8>, len: usize) -> Result<()> {
    let _errno = super::KeepErrno::new();
    check(Call::Munmap)?;
    // SAFETY: forwarded to the caller.
    super::os_result(unsafe { libc::munmap(ptr.as_ptr().cast(), len) }, "munmap")
}

/// Grows or shrinks a mapping with `mremap`; with `may_move` the kernel may
/// move it (the old address becomes invalid), else it fails with `ENOMEM` when
/// the neighbouring address space is taken.
///
/// # Safety
/// `[ptr, ptr+old_len)` must be a whole mapping made by this crate; if it
/// moves, no reference to the old range may be used afterwards.
pub unsafe fn remap(ptr: NonNull<u8>, old_len: usize, new_len: usize, may_move: bool) -> Result<NonNull<u8>> {
    let _errno = super::KeepErrno::new();
    let new_len = check_len(new_len)?;
    check(Call::Mremap)?;
    let flags = if may_move { libc::MREMAP_MAYMOVE } else { 0 };
    // SAFETY: forwarded to the caller.
    let p = unsafe { libc::mremap(ptr.as_ptr().cast(), old_len, new_len, flags) };
    if p == libc::MAP_FAILED {
        return Err(super::last_error("mremap"));
    }
    NonNull::new(p.cast()).ok_or(Error::Os { call: "mremap", errno: libc::ENOMEM })
}

/// Moves a whole mapping to `[to, to+new_len)` with `mremap(MREMAP_FIXED)`:
/// the pages move (no copy) and keep their node and policy; whatever was
/// mapped at `to` is replaced.
///
/// # Safety
/// `[ptr, ptr+old_len)` must be a whole mapping made by this crate, `to` a
/// page-aligned range of `new_len` bytes that this crate reserved and nobody
/// uses; no reference to the old range may be used afterwards.
pub unsafe fn remap_to(ptr: NonNull<u8>, old_len: usize, new_len: usize, to: NonNull<u8>) -> Result<NonNull<u8>> {
    let _errno = super::KeepErrno::new();
    let new_len = check_len(new_len)?;
    check(Call::Mremap)?;
    // SAFETY: forwarded to the caller.
    let p = unsafe {
        libc::mremap(ptr.as_ptr().cast(), old_len, new_len, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, to.as_ptr())
    };
    if p == libc::MAP_FAILED {
        return Err(super::last_error("mremap"));
    }
    NonNull::new(p.cast()).ok_or(Error::Os { call: "mremap", errno: libc::ENOMEM })
}

/// Sets the memory policy of `[ptr, ptr+len)` (`mbind`). Node ids are the kernel's.
///
/// Fails with `EINVAL` when the set holds no node this process may use
/// (`Mems_allowed`), and with `EIO` under [`BindFlags::STRICT`] when present
/// pages break the policy and cannot be moved.
///
/// # Safety
/// The range must be page-aligned and mapped by this crate. With
/// [`BindFlags::MOVE`] pages may migrate; their contents are kept.
pub unsafe fn bind(ptr: NonNull<u8>, len: usize, policy: MemPolicy, flags: BindFlags) -> Result<()> {
    let _errno = super::KeepErrno::new();
    let (mode, mask) = policy.raw()?;
    check(Call::Mbind)?;
    let mask = [mask];
    // The kernel reads `maxnode - 1` bits (a historical off-by-one that libnuma
    // also compensates for), so pass one more than the bits in the mask.
    let maxnode = if mode == MPOL_DEFAULT || mode == MPOL_LOCAL { 0 } else { MAX_NODES as u64 + 1 };
    let maskp = if maxnode == 0 { core::ptr::null() } else { mask.as_ptr() };
    // SAFETY: forwarded to the caller for the range; the mask outlives the call
    // and holds `maxnode - 1` bits.
    let r = unsafe { libc::syscall(libc::SYS_mbind, ptr.as_ptr(), len, mode, maskp, maxnode, flags.0) };
    super::os_result(r, "mbind")
}

/// Returns the pages of `[ptr, ptr+len)` to the OS (`MADV_DONTNEED`): the range
/// stays mapped, reads give zeroes, and the next touch faults a fresh page under
/// the range's policy.
///
/// # Safety
/// The range must be page-aligned and mapped by this crate, and its contents
/// must no longer be needed by anyone.
pub unsafe fn decommit(ptr: NonNull<u8>, len: usize) -> Result<()> {
    let _errno = super::KeepErrno::new();
    check(Call::Madvise)?;
    // SAFETY: forwarded to the caller.
    super::os_result(unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_DONTNEED) }, "madvise(MADV_DONTNEED)")
}

/// Which pages of `len` at `ptr` (page-aligned, mapped) the kernel holds
/// in memory (`mincore`): `out[i]` is true for the `i`-th page; `out` holds
/// at least a byte per page of the range, at most 4,096 pages (16 MiB of
/// base pages) a call.
pub fn resident_pages(ptr: NonNull<u8>, len: usize, out: &mut [bool]) -> Result<()> {
    let _errno = super::KeepErrno::new();
    let page = super::page_size();
    let pages = len.div_ceil(page);
    let mut vec = [0u8; 4096];
    if pages > vec.len() || out.len() < pages {
        return Err(Error::Os { call: "mincore", errno: libc::EINVAL });
    }
    // SAFETY: a mapped, page-aligned range of the caller's; `vec` holds a
    // byte for each of its pages.
    super::os_result(unsafe { libc::mincore(ptr.as_ptr().cast(), len, vec.as_mut_ptr()) }, "mincore")?;
    for (o, &v) in out.iter_mut().zip(&vec[..pages]) {
        *o = v & 1 != 0;
    }
    Ok(())
}

/// Bytes of `len` at `ptr` (page-aligned, mapped) the kernel holds in
/// memory (`mincore`), counted a page at a time in chunks of 16 MiB.
pub fn resident_bytes(ptr: NonNull<u8>, len: usize) -> Result<u64> {
    let _errno = super::KeepErrno::new();
    let page = super::page_size();
    let mut vec = [0u8; 4096];
    let (mut off, mut n) = (0, 0u64);
    while off < len {
        let chunk = (len - off).min(vec.len() * page);
        // SAFETY: a mapped, page-aligned range of the caller's; `vec` holds a
        // byte for each of its pages.
        let r = unsafe { libc::mincore(ptr.as_ptr().add(off).cast(), chunk, vec.as_mut_ptr()) };
        super::os_result(r, "mincore")?;
        n += vec[..chunk.div_ceil(page)].iter().filter(|&&b| b & 1 != 0).count() as u64 * page as u64;
        off += chunk;
    }
    Ok(n)
}

/// Locks `[ptr, ptr+len)` in memory (`mlock`): its pages are committed now
/// and never swapped out or migrated by reclaim, as memory a device reads
/// and writes behind the kernel's back must be. Fails with `ENOMEM`/`EPERM`
/// beyond `RLIMIT_MEMLOCK` (unprivileged processes: 8 MiB by default).
///
/// # Safety
/// The range must be page-aligned and mapped by this crate.
pub unsafe fn lock(ptr: NonNull<u8>, len: usize) -> Result<()> {
    let _errno = super::KeepErrno::new();
    // SAFETY: forwarded to the caller.
    super::os_result(unsafe { libc::mlock(ptr.as_ptr().cast(), len) }, "mlock")
}

/// The soft `RLIMIT_MEMLOCK`: how many bytes the process may pin (`mlock`,
/// io_uring's registered buffers, RDMA memory regions); `None` when
/// unlimited or unreadable.
pub fn memlock_limit() -> Option<u64> {
    let _errno = super::KeepErrno::new();
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `r` is a valid `rlimit` for the kernel to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 || r.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(r.rlim_cur)
}

/// Undoes [`lock`] (`munlock`), before the range is decommitted (a locked
/// page cannot be) or unmapped.
///
/// # Safety
/// The range must be page-aligned and mapped by this crate.
pub unsafe fn unlock(ptr: NonNull<u8>, len: usize) -> Result<()> {
    let _errno = super::KeepErrno::new();
    // SAFETY: forwarded to the caller.
    super::os_result(unsafe { libc::munlock(ptr.as_ptr().cast(), len) }, "munlock")
}

/// Asks for (`MADV_HUGEPAGE`) or against (`MADV_NOHUGEPAGE`) transparent huge
/// pages on `[ptr, ptr+len)`. Fails with `EINVAL` where THP is not built in.
///
/// # Safety
/// The range must be page-aligned and mapped by this crate.
pub unsafe fn set_hugepages(ptr: NonNull<u8>, len: usize, enable: bool) -> Result<()> {
    let _errno = super::KeepErrno::new();
    check(Call::Madvise)?;
    let advice = if enable { libc::MADV_HUGEPAGE } else { libc::MADV_NOHUGEPAGE };
    // SAFETY: forwarded to the caller.
    super::os_result(
        unsafe { libc::madvise(ptr.as_ptr().cast(), len, advice) },
        if enable { "madvise(MADV_HUGEPAGE)" } else { "madvise(MADV_NOHUGEPAGE)" },
    )
}

/// Whether the kernel backs anonymous memory with transparent huge pages
/// without being asked (`always` in
/// `/sys/kernel/mm/transparent_hugepage/enabled`; false for `madvise`,
/// `never`, or no THP). Read once, then remembered.
pub fn thp_always() -> bool {
    // 1: no, 2: yes.
    static MODE: super::ReadOnce = super::ReadOnce::new();
    MODE.get(|| {
        let mut buf = [0u8; 64];
        let on = super::file::read_str(c"/sys/kernel/mm/transparent_hugepage/enabled", &mut buf)
            .is_ok_and(|s| s.as_bytes().starts_with(b"[always]"));
        1 + on as usize
    }) == 2
}

/// Bytes the kernel backs with transparent huge pages in the mappings that
/// hold the given `(start, len)` ranges: `AnonHugePages` of each mapping
/// (VMA) of `/proc/self/smaps` that overlaps one, each mapping once. What an
/// `MADV_HUGEPAGE` request actually got; a mapping that also holds memory
/// outside the ranges (the kernel merges neighbours with the same flags and
/// policy) counts whole.
pub fn thp_bytes(ranges: &[(usize, usize)]) -> Result<u64> {
    if ranges.is_empty() {
        return Ok(0);
    }
    thp_bytes_of(|a, b| ranges.iter().any(|&(s, l)| s < b && a < s + l))
}

/// Like [`thp_bytes`], over the mappings `[start, end)` that `wanted` picks.
pub fn thp_bytes_of(mut wanted: impl FnMut(usize, usize) -> bool) -> Result<u64> {
    let text = super::file::read_to_end(c"/proc/self/smaps")?;
    let text = String::from_utf8_lossy(&text);
    let mut total = 0;
    let mut inside = false;
    for line in text.lines() {
        let head = line.split_once(' ').and_then(|(r, _)| r.split_once('-'));
        if let Some((a, b)) = head
            && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            inside = wanted(a, b);
        } else if inside && let Some(kb) = line.strip_prefix("AnonHugePages:") {
            total += kb.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap_or(0) * 1024;
        }
    }
    Ok(total)
}

/// Where the pages holding `addrs` are, from `move_pages` with null nodes
/// (which moves nothing). `status[i]` gets the kernel node id of `addrs[i]`'s
/// page, or a negative errno: `-ENOENT` for a page not present (never
/// touched or decommitted), `-EFAULT` for an unmapped address.
///
/// The addresses are not dereferenced, so any value is safe to pass.
pub fn page_nodes(addrs: &[*const u8], status: &mut [i32]) -> Result<()> {
    super::pages::page_nodes_of(0, addrs, status)
}

/// The kernel node id of the page holding `addr`, `None` when the page is not
/// present.
pub fn page_node(addr: *const u8) -> Result<Option<usize>> {
    let mut st = [0i32];
    page_nodes(&[addr], &mut st)?;
    match st[0] {
        n if n >= 0 => Ok(Some(n as usize)),
        e if -e == libc::ENOENT => Ok(None),
        e => Err(Error::Os { call: "move_pages", errno: -e }),
    }
}

/// Physical frames of `out.len()` consecutive pages starting at the page of
/// `start`, in one read of `/proc/self/pagemap`: `None` for a page not
/// present. Frame numbers need `CAP_SYS_ADMIN`; without it the kernel
/// reports them as 0 and this fails with `EPERM`, as [`page_frame`] does.
pub fn page_frames(start: *const u8, out: &mut [Option<u64>]) -> Result<()> {
    let _errno = super::KeepErrno::new();
    // SAFETY: literal path, valid flags.
    let fd = unsafe { libc::open(c"/proc/self/pagemap".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(super::last_error("open(/proc/self/pagemap)"));
    }
    let mut entries = vec![0u64; out.len()];
    let off = (start as usize / page_size() * 8) as libc::off_t;
    let want = entries.len() * 8;
    // SAFETY: reads into the vector's `want` bytes.
    let r = unsafe { libc::pread(fd, entries.as_mut_ptr().cast(), want, off) };
    let err = (r != want as isize).then(|| super::last_error("pread(/proc/self/pagemap)"));
    // SAFETY: `fd` is ours.
    unsafe { libc::close(fd) };
    if let Some(e) = err {
        return Err(e);
    }
    for (o, &e) in out.iter_mut().zip(&entries) {
        *o = if e >> 63 == 0 {
            None
        } else {
            let pfn = e & ((1 << 55) - 1);
            if pfn == 0 {
                return Err(Error::Os { call: "pread(/proc/self/pagemap)", errno: libc::EPERM });
            }
            Some(pfn)
        };
    }
    Ok(())
}

/// The physical frame number of the page holding `addr`, from
/// `/proc/self/pagemap`; `None` when the page is not present. The kernel shows
/// frame numbers only to `CAP_SYS_ADMIN` (others read 0, reported as an
/// `EPERM` error).
pub fn page_frame(addr: *const u8) -> Result<Option<u64>> {
    let _errno = super::KeepErrno::new();
    // SAFETY: literal path, valid flags.
    let fd = unsafe { libc::open(c"/proc/self/pagemap".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(super::last_error("open(/proc/self/pagemap)"));
    }
    let mut entry = 0u64;
    let off = (addr as usize / page_size() * 8) as libc::off_t;
    // SAFETY: reads 8 bytes into a u64 on the stack.
    let r = unsafe { libc::pread(fd, (&mut entry as *mut u64).cast(), 8, off) };
    let err = (r != 8).then(|| super::last_error("pread(/proc/self/pagemap)"));
    // SAFETY: `fd` is ours.
    unsafe { libc::close(fd) };
    if let Some(e) = err {
        return Err(e);
    }
    if entry >> 63 == 0 {
        return Ok(None);
    }
    let pfn = entry & ((1 << 55) - 1);
    if pfn == 0 {
        return Err(Error::Os { call: "pread(/proc/self/pagemap)", errno: libc::EPERM });
    }
    Ok(Some(pfn))
}

/// An owned, page-aligned anonymous mapping, unmapped on drop.
///
/// ```
/// use numaweave::os::mem::{MemPolicy, Mapping};
/// let r = Mapping::map(1 << 20).unwrap();
/// r.bind(MemPolicy::Local).unwrap();
/// // SAFETY: the region is mapped and writable for its whole length.
/// unsafe { r.as_ptr().write_bytes(0xAB, r.len()) };
/// assert!(r.page_nodes_all(|n| n.is_some()).unwrap());
/// ```
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

/// Where a [`Mapping`]'s start lies in it: what the per-CPU stacks'
/// sequences read in place (`os/rseq.rs`), the field itself kept private.
pub(super) const MAPPING_PTR: usize = core::mem::offset_of!(Mapping, ptr);

// SAFETY: a Mapping is an owned range of address space; the raw pointer carries
// no thread affinity.
unsafe impl Send for Mapping {}
// SAFETY: every `&self` method is a system call on the range, which the kernel
// serialises; none hands out references into the memory.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes (rounded up to whole pages), see [`map`].
    pub fn map(len: usize) -> Result<Self> {
        let ptr = map(len)?;
        Ok(Self { ptr, len: check_len(len)? })
    }

    /// Maps `len` bytes aligned to `align`, see [`map_aligned`].
    pub fn map_aligned(len: usize, align: usize) -> Result<Self> {
        let ptr = map_aligned(len, align)?;
        Ok(Self { ptr, len: check_len(len)? })
    }

    /// First byte of the region.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes (a whole number of pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a region holds at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    fn sub(&self, offset: usize, len: usize) -> Result<NonNull<u8>> {
        let page = page_size();
        let end = offset.checked_add(len).ok_or(Error::LayoutTooLarge { size: len, align: page })?;
        if !offset.is_multiple_of(page) || end > self.len || len == 0 {
            return Err(Error::Os { call: "region range", errno: libc::EINVAL });
        }
        // SAFETY: offset < self.len, so the result stays in the mapping.
        Ok(unsafe { self.ptr.add(offset) })
    }

    /// Sets the policy of the whole region for pages faulted from now on.
    pub fn bind(&self, policy: MemPolicy) -> Result<()> {
        self.bind_range(0, self.len, policy, BindFlags::NONE)
    }

    /// Sets the policy of `[offset, offset+len)`; `len` is rounded up to pages.
    pub fn bind_range(&self, offset: usize, len: usize, policy: MemPolicy, flags: BindFlags) -> Result<()> {
        let p = self.sub(offset, len)?;
        // SAFETY: a page-aligned range inside our own mapping; with MOVE the
        // kernel migrates pages but keeps contents.
        unsafe { bind(p, round_up_page(len).min(self.len - offset), policy, flags) }
    }

    /// Returns `[offset, offset+len)` to the OS; it reads as zeroes afterwards.
    pub fn decommit(&self, offset: usize, len: usize) -> Result<()> {
        let p = self.sub(offset, len)?;
        // SAFETY: our own mapping; the region hands out only raw pointers, so
        // dropping contents cannot break a Rust reference.
        unsafe { decommit(p, round_up_page(len).min(self.len - offset)) }
    }

    /// Asks for or against transparent huge pages on the whole region.
    pub fn set_hugepages(&self, enable: bool) -> Result<()> {
        // SAFETY: our own mapping.
        unsafe { set_hugepages(self.ptr, self.len, enable) }
    }

    /// The node of every page of the region (see [`page_nodes`]), one entry per
    /// page: `None` for a page not present.
    pub fn page_node_list(&self, out: &mut Vec<Option<usize>>) -> Result<()> {
        let page = page_size();
        let pages = self.len / page;
        let addrs: Vec<*const u8> = (0..pages).map(|i| self.ptr.as_ptr().wrapping_add(i * page).cast_const()).collect();
        let mut st = vec![0i32; pages];
        page_nodes(&addrs, &mut st)?;
        out.clear();
        out.extend(st.iter().map(|&s| usize::try_from(s).ok()));
        Ok(())
    }

    /// Whether `f` holds for the node of every page.
    pub fn page_nodes_all(&self, f: impl Fn(Option<usize>) -> bool) -> Result<bool> {
        let mut v = Vec::new();
        self.page_node_list(&mut v)?;
        Ok(v.into_iter().all(f))
    }

    /// Gives up ownership without unmapping.
    pub fn into_raw(self) -> (NonNull<u8>, usize) {
        let r = (self.ptr, self.len);
        core::mem::forget(self);
        r
    }

    /// Takes ownership of a mapping made by [`map`], [`map_aligned`] or [`Mapping::into_raw`].
    ///
    /// # Safety
    /// `[ptr, ptr+len)` must be such a whole mapping, owned by nobody else.
    pub unsafe fn from_raw(ptr: NonNull<u8>, len: usize) -> Self {
        Self { ptr, len }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we own the whole mapping and hand out no references into it.
        let _ = unsafe { unmap(self.ptr, self.len) };
    }
}

fn round_up_page(len: usize) -> usize {
    let page = page_size();
    (len + page - 1) & !(page - 1)
}
