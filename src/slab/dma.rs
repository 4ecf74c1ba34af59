//! I/O buffers a device can use: a node slab cache whose buffers never cross
//! a huge-page boundary they need not cross, optionally locked in memory,
//! with their physical addresses (SPDK's `spdk_dma_malloc_socket`, DPDK's
//! `rte_malloc_socket`).
//!
//! A buffer of `size` bytes is aligned to `size` rounded up to a power of
//! two (at most 2 MiB), so it lies inside one 2 MiB page: on hugetlb pages
//! ([`Huge::Hugetlb`](crate::Huge::Hugetlb)) it is one physically contiguous
//! run, one DMA segment. Buffers of up to 1 MiB (512 KiB in hardened builds
//! with `NUMAWEAVE_CHECK=full`, whose red zones lengthen every slot); a size
//! that is not a power of two wastes the rest of its power-of-two slot. Per-node slabs,
//! per-thread magazines and remote frees are the slab cache's.

use core::ops::{Deref, DerefMut};
use core::ptr::NonNull;

use super::api::{CacheBuilder, RawCache};
use super::slabinfo::CacheStats;
use crate::error::{Error, Result};
use crate::os::mem::{self, HUGE_PAGE};

/// Marks a builder for a [`DmaPool`].
#[derive(Debug)]
pub enum Dma {}

/// The alignment that keeps a buffer of `size` bytes inside one huge page.
fn boundary_align(size: usize) -> usize {
    size.max(8).checked_next_power_of_two().unwrap_or(usize::MAX).min(HUGE_PAGE)
}

impl CacheBuilder<Dma> {
    /// Locks every slab in memory (`mlock`) for as long as it exists: its
    /// pages are committed when it is made and never swapped out or
    /// migrated, so a device may keep the physical addresses. Counts
    /// against `RLIMIT_MEMLOCK`: a slab beyond it fails with the `mlock`
    /// error.
    pub fn lock(mut self, lock: bool) -> Self {
        self.lock = lock;
        self
    }

    /// Zero every buffer as it is allocated (`spdk_dma_zmalloc`).
    pub fn zero(mut self, zero: bool) -> Self {
        self.zero = zero;
        self
    }

    /// Builds the pool. Fails as [`RawCache`]'s builder does, and with
    /// [`Error::LayoutTooLarge`] for buffers over 1 MiB.
    pub fn build(self) -> Result<DmaPool> {
        Ok(DmaPool { raw: RawCache { cache: self.build_core()? } })
    }
}

/// A pool of I/O buffers on a node: a slab cache whose buffers each lie
/// inside one 2 MiB page (aligned to their size rounded up to a power of
/// two), so that on hugetlb pages ([`Huge::Hugetlb`](crate::Huge::Hugetlb),
/// through the builder's `huge` or `NUMAWEAVE_HUGE`) a buffer is one
/// physically contiguous DMA segment; optionally locked in memory; buffers
/// of up to 1 MiB. SPDK's `spdk_dma_malloc_socket`, DPDK's
/// `rte_malloc_socket`. With the builder's
/// [`registrar`](CacheBuilder::registrar), each region of the pool is
/// registered once (io_uring fixed buffers, VFIO, RDMA: see
/// [`Registrar`](super::Registrar)).
///
/// ```
/// use numaweave::slab::DmaPool;
///
/// let pool = DmaPool::builder("nvme_data", 4096).device("lo").or_local().build().unwrap();
/// let mut buf = pool.alloc().unwrap();
/// buf[..5].copy_from_slice(b"hello");
/// assert_eq!(buf.as_ptr() as usize % 4096, 0);
/// // Physical addresses need root (CAP_SYS_ADMIN); others get a typed error.
/// match buf.phys_addr() {
///     Ok(pa) => println!("node {}, physical {pa:#x}", buf.node()),
///     Err(e) => println!("node {}, no physical address: {e}", buf.node()),
/// }
/// ```
pub struct DmaPool {
    raw: RawCache,
}

impl DmaPool {
    /// A builder for buffers of `size` bytes (node, device, limit, huge
    /// pages and magazines as for any cache; `lock` and `zero` of its own).
    pub fn builder(name: &str, size: usize) -> CacheBuilder<Dma> {
        CacheBuilder::new(name, size, boundary_align(size))
    }

    /// Bytes per buffer.
    pub fn buffer_size(&self) -> usize {
        self.raw.object_size()
    }

    /// A buffer from the pool's home node (or the caller's), falling back to
    /// the nearest node with room.
    #[inline]
    pub fn alloc(&self) -> Result<DmaBuf<'_>> {
        self.raw.alloc().map(|p| self.buf(p))
    }

    /// A buffer on `node`, never elsewhere.
    pub fn alloc_on(&self, node: usize) -> Result<DmaBuf<'_>> {
        self.raw.alloc_on(node).map(|p| self.buf(p))
    }

    #[inline]
    fn buf(&self, ptr: NonNull<u8>) -> DmaBuf<'_> {
        debug_assert!(
            self.buffer_size() > HUGE_PAGE
                || ptr.as_ptr() as usize / HUGE_PAGE == (ptr.as_ptr() as usize + self.buffer_size() - 1) / HUGE_PAGE,
            "a DMA buffer crosses a huge-page boundary"
        );
        DmaBuf { ptr, pool: self }
    }

    /// Fills `out` with raw buffers, all or none, for I/O paths that keep
    /// them as pointers; give them back with [`free_bulk`](Self::free_bulk).
    pub fn alloc_bulk(&self, out: &mut [*mut u8]) -> Result<()> {
        self.raw.alloc_bulk(out)
    }

    /// Gives back buffers from [`alloc_bulk`](Self::alloc_bulk).
    ///
    /// # Safety
    /// As [`RawCache::free_bulk`]: buffers of this pool, each once, unused
    /// afterwards.
    pub unsafe fn free_bulk(&self, bufs: &[NonNull<u8>]) {
        // SAFETY: buffers of this pool, each given once and unused afterwards
        // (the caller's word): `RawCache::free_bulk`'s conditions, the pool's
        // cache being that cache.
        unsafe { self.raw.free_bulk(bufs) }
    }

    /// The node of a raw buffer's memory.
    ///
    /// # Safety
    /// `buf` is a live buffer of this pool.
    pub unsafe fn node_of(&self, buf: NonNull<u8>) -> usize {
        // SAFETY: `buf` is a live buffer of this pool, so a live object of its
        // cache.
        unsafe { self.raw.node_of(buf) }
    }

    /// Returns empty slabs' memory (unlocked first) to the OS.
    pub fn shrink(&self) -> usize {
        self.raw.shrink()
    }

    /// The pool's statistics (those of its slab cache).
    pub fn stats(&self) -> CacheStats {
        self.raw.stats()
    }

    /// Moves the pool to `node` while in use, as
    /// [`RawCache::migrate`] does. Buffers keep their addresses, not their
    /// physical addresses: a device given one by [`DmaBuf::phys_addr`]
    /// must be done with it first, unless the pool has a
    /// [`Registrar`](crate::slab::Registrar) (IOMMU, RDMA, io_uring), which
    /// is told to release each region, and registers it again at its new
    /// place.
    pub fn migrate(&self, node: usize) -> Result<super::Migration> {
        self.raw.migrate(node)
    }

    /// Sets (or clears) the condition under which the pool moves itself,
    /// as [`RawCache::demote_when`] does; once a buffer's physical address
    /// was handed out ([`DmaBuf::phys_addr`]), only a demotion that says
    /// so ([`Demotion::moving_device_buffers`](super::Demotion::moving_device_buffers))
    /// moves the pool (a device may hold that address).
    pub fn demote_when(&self, demotion: Option<super::Demotion>) -> Result<()> {
        self.raw.demote_when(demotion)
    }

    /// The slab cache underneath.
    pub fn cache(&self) -> &RawCache {
        &self.raw
    }
}

impl core::fmt::Debug for DmaPool {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DmaPool").field("name", &self.raw.name()).field("size", &self.buffer_size()).finish()
    }
}

/// A buffer of a [`DmaPool`], given back when dropped. Its bytes are what
/// the last user left unless the pool zeroes.
pub struct DmaBuf<'a> {
    ptr: NonNull<u8>,
    pool: &'a DmaPool,
}

impl DmaBuf<'_> {
    /// The buffer's start.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The node of the buffer's memory.
    pub fn node(&self) -> usize {
        // SAFETY: a live buffer of `pool`.
        unsafe { self.pool.node_of(self.ptr) }
    }

    /// The physical address of the buffer's first byte, for a device
    /// (`/proc/self/pagemap`). Commits the buffer's pages first (a read and
    /// rewrite of one byte per page; a locked pool's already are). Needs
    /// `CAP_SYS_ADMIN`: others get an [`Error::Os`] naming the pagemap read
    /// (`EPERM`). Stable while the buffer is live only if the pool locks
    /// (else reclaim may move the page).
    pub fn phys_addr(&self) -> Result<u64> {
        self.commit();
        self.pool.cache().device_may_hold();
        phys_addr(self.ptr.as_ptr())
    }

    /// Physically contiguous runs the buffer spans: 1 on hugetlb pages (or
    /// for a buffer within one base page); as [`phys_addr`](Self::phys_addr)
    /// for its needs.
    pub fn phys_segments(&self) -> Result<usize> {
        self.commit();
        self.pool.cache().device_may_hold();
        phys_segments(self.ptr.as_ptr(), self.len())
    }

    fn commit(&self) {
        let page = crate::os::page_size();
        let (start, end) = (self.ptr.as_ptr() as usize, self.ptr.as_ptr() as usize + self.len());
        let mut a = start;
        while a < end {
            // SAFETY: inside the live buffer; rewriting a byte with its own
            // value changes nothing but makes the page present.
            unsafe {
                let p = a as *mut u8;
                p.write_volatile(p.read_volatile());
            }
            a = (a / page + 1) * page;
        }
    }
}

impl Deref for DmaBuf<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: the buffer's bytes, ours while it is live; mapped memory
        // always holds initialized bytes.
        unsafe { core::slice::from_raw_parts(self.ptr.as_ptr(), self.pool.buffer_size()) }
    }
}

impl DerefMut for DmaBuf<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `deref`, and this handle is the buffer's only one.
        unsafe { core::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.pool.buffer_size()) }
    }
}

impl Drop for DmaBuf<'_> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: a live buffer of `pool`, given back once.
        unsafe { self.pool.raw.free(self.ptr) }
    }
}

impl core::fmt::Debug for DmaBuf<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DmaBuf").field("ptr", &self.ptr).field("len", &self.len()).finish()
    }
}

/// The physical address of the byte at `p` (`/proc/self/pagemap`): an error
/// when its page is not present (`ENOENT`) or the process may not see frame
/// numbers (`EPERM`: needs `CAP_SYS_ADMIN`).
pub fn phys_addr(p: *const u8) -> Result<u64> {
    let page = crate::os::page_size();
    match mem::page_frame(p)? {
        Some(pfn) => Ok(pfn * page as u64 + (p as usize % page) as u64),
        None => Err(Error::Os { call: "pread(/proc/self/pagemap)", errno: libc::ENOENT }),
    }
}

/// How many physically contiguous runs `[p, p + len)` spans (what a device
/// needs as scatter-gather segments); as [`phys_addr`] for its errors.
pub fn phys_segments(p: *const u8, len: usize) -> Result<usize> {
    if len == 0 {
        return Ok(0);
    }
    let page = crate::os::page_size();
    let first = p as usize / page * page;
    let pages = (p as usize + len).div_ceil(page) - first / page;
    let mut frames = vec![None; pages];
    mem::page_frames(first as *const u8, &mut frames)?;
    let mut runs = 0;
    let mut prev: Option<u64> = None;
    for f in frames {
        let Some(f) = f else { return Err(Error::Os { call: "pread(/proc/self/pagemap)", errno: libc::ENOENT }) };
        if prev != Some(f.wrapping_sub(1)) {
            runs += 1;
        }
        prev = Some(f);
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_up_to_a_huge_page_are_aligned_to_stay_inside_one() {
        assert_eq!(boundary_align(1), 8);
        assert_eq!(boundary_align(4096), 4096);
        assert_eq!(boundary_align(96 << 10), 128 << 10);
        assert_eq!(boundary_align(1 << 20), 1 << 20);
        assert_eq!(boundary_align(3 << 20), HUGE_PAGE);
        for size in [512, 4096, 3000, 96 << 10, 1 << 20] {
            let a = boundary_align(size);
            // Any start that is a multiple of `a` keeps [start, start + size)
            // inside one huge page.
            for k in 0..(4 * HUGE_PAGE / a) {
                let s = k * a;
                assert_eq!(s / HUGE_PAGE, (s + size - 1) / HUGE_PAGE, "size {size} at {s:#x}");
            }
        }
    }
}
