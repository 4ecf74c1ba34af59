//! The public face of the node slabs: the builder, the typed [`SlabCache`] with
//! its owning [`SlabBox`], and the [`RawCache`] for run-time layouts.

use core::fmt;
use core::marker::PhantomData;
use core::ops::{Deref, DerefMut};
use core::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::kmem::{Ctor, Home, KmemCache, OnEmpty, Spec};
use super::local::{self, Start};
use super::magazine::MAG_MAX;
use super::pins::OffNodePins;
use super::register::Registrar;
use super::slabinfo::{CacheStats, register_cache};
use crate::error::{DeviceKind, Error, Result};
use crate::hardened::HARDENED;
use crate::os::mem::Huge;
use crate::topology::Topology;

/// The accessors both cache handles have ([`SlabCache`] and [`RawCache`]:
/// an `Arc<KmemCache>` named `cache`), written once.
macro_rules! cache_accessors {
    () => {
        /// Returns fully free slabs to the OS after flushing this thread's
        /// magazines and every node's depot and remote list into the slabs
        /// (`kmem_cache_shrink`); returns the bytes unmapped. Objects in other
        /// threads' magazines stay there.
        pub fn shrink(&self) -> usize {
            shrink_cache(&self.cache)
        }

        /// A snapshot of the cache's statistics: counters only, no
        /// question to the kernel page by page (see
        /// [`resident`](Self::resident) for where the pages are).
        pub fn stats(&self) -> CacheStats {
            CacheStats::of(&self.cache)
        }

        /// Where the cache's pages are now, per node that holds any, by
        /// node: asked of the kernel page by page (`move_pages`), over every
        /// chunk's present part. Not the nodes the slabs were meant for,
        /// but where their memory is; for a cache of gigabytes a query of
        /// some milliseconds.
        pub fn resident(&self) -> Vec<crate::slab::NodePages> {
            self.cache
                .resident()
                .into_iter()
                .map(|(node, pages, bytes)| crate::slab::NodePages { node, pages, bytes })
                .collect()
        }

        /// Moves the whole pool to `node` while other threads go on
        /// allocating and freeing: every page of its slabs, on every node,
        /// with `move_pages`, no object's address or contents changing.
        /// New slabs come from `node` from the call on, until the next
        /// migration (allocations for another node, `alloc_on` included,
        /// get memory on `node` too). Reports the pages moved and those
        /// that stayed, with why (pinned, the node full, shared with a
        /// child process).
        ///
        /// Fails before anything moves for a node that is not online, has
        /// no memory or is outside the process's allowed nodes, and for a
        /// pool with a registered region whose
        /// [`Registrar`](crate::slab::Registrar) cannot release it
        /// ([`Error::RegisteredRegion`]); one that can is released, moved
        /// and registered again region by region. What the kernel or a
        /// registrar refuses on the way is reported, not an error: pages
        /// left where they were ([`Migration::unmoved`](crate::slab::Migration::unmoved)),
        /// regions left unregistered
        /// ([`Migration::registrations_lost`](crate::slab::Migration::registrations_lost)).
        ///
        /// ```
        /// # use numaweave::slab::RawCache;
        /// let pool = RawCache::builder("frames", 2048).build().unwrap();
        /// let p = pool.alloc().unwrap();
        /// // SAFETY: a fresh object of 2048 bytes.
        /// unsafe { p.as_ptr().write_bytes(7, 2048) };
        /// let m = pool.migrate(0).unwrap();
        /// assert_eq!(m.to, 0);
        /// assert!(m.unmoved.is_empty(), "{m}");
        /// // SAFETY: the same object, where it was.
        /// assert_eq!(unsafe { *p.as_ptr().add(2047) }, 7);
        /// # unsafe { pool.free(p) };
        /// ```
        pub fn migrate(&self, node: usize) -> Result<crate::slab::Migration> {
            self.cache.migrate(node)
        }

        /// Sets the condition under which the pool moves itself (see
        /// [`Demotion`](crate::slab::Demotion)), or with `None` clears it.
        /// Looked at on the slow paths (a thread's magazines running empty
        /// or full), at most once per the condition's period, each look a
        /// bounded step of the move (see the `migrate` module's
        /// documentation: at most 2 MiB moved, no sleep, no registrar
        /// called); the moves count in [`CacheStats::demotions`] and
        /// [`CacheStats::migrated_bytes`]. Fails for a node that is not
        /// online, or when no target is named and the watched node has no
        /// lower tier.
        pub fn demote_when(&self, demotion: Option<crate::slab::Demotion>) -> Result<()> {
            self.cache.set_demotion(demotion)
        }

        /// Registers again, with the pool's [`Registrar`](crate::slab::Registrar),
        /// the region holding `obj` if a migration lost its registration
        /// (the registrar refused it after the move): `Ok(true)` when it is
        /// registered now, `Ok(false)` for a pool without registrar; the
        /// refusal as [`Error::Registration`] or [`Error::MemlockLimit`].
        ///
        /// # Safety
        /// `obj` is a live object of this cache.
        pub unsafe fn register_again(&self, obj: NonNull<u8>) -> Result<bool> {
            // SAFETY: a live object of this cache (the caller's word).
            let node = unsafe { self.cache.node_of(obj) };
            self.cache.register_again(node, obj.as_ptr() as usize)
        }

        /// The cache's name.
        pub fn name(&self) -> &str {
            &self.cache.name
        }

        /// Where objects go by default (a device home is resolved to its node).
        pub fn home(&self) -> Home {
            self.cache.home
        }
    };
}

/// A cache line, for [`CacheBuilder::hwcache_align`] (`SLAB_HWCACHE_ALIGN`).
pub const CACHE_LINE: usize = 64;

/// Marks a builder for a [`RawCache`].
#[derive(Debug)]
pub enum Raw {}

/// Marks a builder for a [`SlabCache<T>`].
pub struct Typed<T>(PhantomData<fn() -> T>);

#[derive(Clone, Debug)]
enum HomeSpec {
    Local,
    Node(usize),
    Device { kind: DeviceKind, name: String, or_local: bool },
}

/// Builds a cache: [`SlabCache::builder`] or [`RawCache::builder`].
///
/// Defaults: objects aligned to their type (raw: to 8 bytes), local to the
/// allocating thread, no limit, magazines sized by object size (64 rounds up
/// to 512-byte objects, down to 8 beyond 32 KiB).
pub struct CacheBuilder<K> {
    name: String,
    size: usize,
    align: usize,
    home: HomeSpec,
    limit: Option<usize>,
    magazine: Option<usize>,
    ctor: Option<Ctor>,
    pub(super) zero: bool,
    huge: Option<Huge>,
    huge_strict: bool,
    pub(super) lock: bool,
    registrar: Option<Arc<dyn Registrar>>,
    pins: OffNodePins,
    _kind: PhantomData<K>,
}

impl<K> CacheBuilder<K> {
    pub(super) fn new(name: &str, size: usize, align: usize) -> Self {
        Self {
            name: name.to_owned(),
            size,
            align,
            home: HomeSpec::Local,
            limit: None,
            magazine: None,
            ctor: None,
            zero: false,
            huge: None,
            huge_strict: false,
            lock: false,
            registrar: None,
            pins: OffNodePins::Refuse,
            _kind: PhantomData,
        }
    }

    /// Aligns every object to at least `align` bytes (a power of two).
    pub fn align(mut self, align: usize) -> Self {
        self.align = self.align.max(align);
        if !align.is_power_of_two() {
            self.align = align; // rejected by `build`
        }
        self
    }

    /// Aligns objects to a cache line, so no two share one
    /// (`SLAB_HWCACHE_ALIGN`).
    pub fn hwcache_align(self) -> Self {
        self.align(CACHE_LINE)
    }

    /// Places objects on `node` (`kmem_cache_create` + `alloc_node` for every
    /// allocation).
    pub fn node(mut self, node: usize) -> Self {
        self.home = HomeSpec::Node(node);
        self
    }

    /// Places objects as `home` says (a resolved [`Home`], e.g. from
    /// another cache's [`SlabCache::home`]).
    pub fn home(mut self, home: Home) -> Self {
        self.home = match home {
            Home::Local => HomeSpec::Local,
            Home::Node(n) => HomeSpec::Node(n),
        };
        self
    }

    /// Places objects on the node of the allocating thread (the default).
    pub fn local(mut self) -> Self {
        self.home = HomeSpec::Local;
        self
    }

    /// Places objects on the node of a device: a PCI bus id, a block device
    /// (`nvme0n1`, `/dev/sda`) or a network interface, looked up in sysfs
    /// when the cache is built. A device with no node (one-node machines,
    /// virtual devices) fails the build unless [`or_local`](Self::or_local)
    /// follows.
    pub fn device(mut self, name: &str) -> Self {
        self.home = HomeSpec::Device { kind: DeviceKind::Any, name: name.to_owned(), or_local: false };
        self
    }

    /// Like [`device`](Self::device), for the PCI function `bus_id`
    /// (`0000:03:00.0`).
    pub fn pci(mut self, bus_id: &str) -> Self {
        self.home = HomeSpec::Device { kind: DeviceKind::Pci, name: bus_id.to_owned(), or_local: false };
        self
    }

    /// With [`device`](Self::device) or [`pci`](Self::pci): a device that
    /// exists but reports no node gives a local cache instead of an error.
    pub fn or_local(mut self) -> Self {
        if let HomeSpec::Device { or_local, .. } = &mut self.home {
            *or_local = true;
        }
        self
    }

    /// At most `objects` objects in each node's slabs (a mempool's size).
    /// Thread magazines are capped at an eighth of it so that a few threads
    /// cannot strand a node's objects.
    pub fn limit(mut self, objects: usize) -> Self {
        self.limit = Some(objects);
        self
    }

    /// Rounds per thread magazine (1..=64): more trades memory parked in
    /// threads for fewer depot round trips.
    pub fn magazine(mut self, rounds: usize) -> Self {
        self.magazine = Some(rounds);
        self
    }

    /// Slabs on huge pages: [`Huge::Thp`] (transparent, given lazily when
    /// the kernel can) or [`Huge::Hugetlb`] (the node's reserved pool,
    /// committed as slabs are needed; base pages where the pool is short,
    /// counted in [`NodeCacheStats::huge_fallbacks`](super::NodeCacheStats)).
    /// Fewer TLB misses and physically contiguous 2 MiB runs for I/O
    /// buffers; the cost is memory: a huge-page chunk keeps its pages until
    /// all its slabs are gone. Default: `NUMAWEAVE_HUGE` (`off`, `thp`,
    /// `hugetlb`), else off.
    ///
    /// ```
    /// use numaweave::Huge;
    /// use numaweave::slab::RawCache;
    /// let bufs = RawCache::builder("dma_buf", 4096).align(4096).huge(Huge::Thp).build().unwrap();
    /// let b = bufs.alloc().unwrap();
    /// // SAFETY: allocated above from `bufs`, freed once.
    /// unsafe { bufs.free(b) };
    /// ```
    pub fn huge(mut self, huge: Huge) -> Self {
        self.huge = Some(huge);
        self
    }

    /// With [`Huge::Hugetlb`]: a node whose pool is short fails the slab
    /// ([`Error::NodeOutOfMemory`], or the next node for a falling-back
    /// `alloc`) instead of taking base pages.
    pub fn huge_strict(mut self, strict: bool) -> Self {
        self.huge_strict = strict;
        self
    }

    /// Tells `registrar` of each region of the cache's memory, once it is
    /// mapped and bound and before anything of it is handed out, and again
    /// before it is unmapped (see [`Registrar`]): io_uring fixed buffers,
    /// VFIO or iommufd DMA mappings, RDMA memory regions. Given-back slabs
    /// of a registered region keep their pages.
    pub fn registrar(mut self, registrar: Arc<dyn Registrar>) -> Self {
        self.registrar = Some(registrar);
        self
    }

    /// What a region does whose pages the kernel moved to another node as
    /// the registrar pinned them (its node's memory is movable, as CXL and
    /// memory-only nodes usually are): fail the allocation with
    /// [`Error::PinsLeftNode`] ([`OffNodePins::Refuse`], the default) or
    /// stay, counted in [`NodeCacheStats::pinned_off_node`](super::NodeCacheStats::pinned_off_node)
    /// ([`OffNodePins::Report`]). See [`OffNodePins`].
    pub fn off_node_pins(mut self, pins: OffNodePins) -> Self {
        self.pins = pins;
        self
    }

    fn resolve_home(&self, topo: &Topology) -> Result<Home> {
        match &self.home {
            HomeSpec::Local => Ok(Home::Local),
            HomeSpec::Node(n) => Ok(Home::Node(topo.check_node(*n)?)),
            HomeSpec::Device { kind, name, or_local } => {
                let node = match kind {
                    DeviceKind::Pci => topo.pci_node(name)?,
                    DeviceKind::Block => topo.block_device_node(name)?,
                    DeviceKind::Net => topo.net_device_node(name)?,
                    DeviceKind::Any => topo.device_node(name)?,
                };
                match node {
                    Some(n) => Ok(Home::Node(n)),
                    None if *or_local => Ok(Home::Local),
                    None => Err(Error::InvalidCache { reason: "the device reports no NUMA node (use or_local)" }),
                }
            }
        }
    }

    pub(super) fn build_core(self) -> Result<Arc<KmemCache>> {
        if self.name.is_empty() {
            return Err(Error::InvalidCache { reason: "an empty cache name" });
        }
        if self.ctor.is_some() && self.zero {
            return Err(Error::InvalidCache { reason: "zero-on-alloc would wipe what the constructor built" });
        }
        if let Some(r) = self.magazine
            && !(1..=MAG_MAX).contains(&r)
        {
            return Err(Error::InvalidCache { reason: "magazine rounds must be 1..=64" });
        }
        let huge = match self.huge {
            Some(h) => h,
            None => crate::os::file::env(c"NUMAWEAVE_HUGE")
                .unwrap_or("off")
                .parse()
                .map_err(|_| Error::InvalidCache { reason: "NUMAWEAVE_HUGE must be off, thp or hugetlb" })?,
        };
        let topo = Topology::global();
        let home = self.resolve_home(topo)?;
        let spec = Spec {
            name: self.name,
            size: self.size,
            align: self.align,
            home,
            limit: self.limit,
            magazine: self.magazine,
            ctor: self.ctor,
            zero: self.zero,
            huge,
            huge_strict: self.huge_strict,
            lock: self.lock,
            registrar: self.registrar,
            pins: self.pins,
        };
        register_cache(|index| KmemCache::new(spec, index, topo))
    }
}

impl CacheBuilder<Raw> {
    /// A constructor, run once per object when its slab memory is first
    /// handed out (before the object's first allocation), never again while
    /// the slab lives. Objects must come back in their constructed state: a
    /// later allocation gets the object as its last user left it (the
    /// kernel's `ctor` contract). It runs under the node's slab lock, so it
    /// must not allocate from this same cache. Excludes [`zero`](Self::zero).
    pub fn constructor(mut self, ctor: impl Fn(NonNull<u8>) + Send + Sync + 'static) -> Self {
        self.ctor = Some(Box::new(ctor));
        self
    }

    /// Zero every object as it is allocated (`__GFP_ZERO`); without it a new
    /// object's bytes are unspecified.
    pub fn zero(mut self, zero: bool) -> Self {
        self.zero = zero;
        self
    }

    /// Builds the cache. Fails on an empty name, a size or alignment beyond
    /// what a 4 MiB slab holds twice ([`Error::LayoutTooLarge`]), a node
    /// that is not online, an unknown device, or conflicting options.
    pub fn build(self) -> Result<RawCache> {
        Ok(RawCache { cache: self.build_core()? })
    }
}

impl<T> CacheBuilder<Typed<T>> {
    /// Builds the cache (see [`CacheBuilder<Raw>::build`] for the errors).
    pub fn build(self) -> Result<SlabCache<T>> {
        Ok(SlabCache { cache: self.build_core()?, _t: PhantomData })
    }
}

impl<K> fmt::Debug for CacheBuilder<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CacheBuilder")
            .field("name", &self.name)
            .field("size", &self.size)
            .field("align", &self.align)
            .field("home", &self.home)
            .field("limit", &self.limit)
            .field("magazine", &self.magazine)
            .field("constructor", &self.ctor.is_some())
            .field("zero", &self.zero)
            .field("huge", &self.huge)
            .field("huge_strict", &self.huge_strict)
            .field("lock", &self.lock)
            .finish()
    }
}

/// An object, by the fast path when the thread's magazine has one (inlined
/// into every caller: a TLS load, two loads and a store).
/// `RAW`: the cache may zero objects (typed caches never do, so their fast
/// path skips the check).
#[inline(always)]
fn alloc_raw<const RAW: bool>(cache: &Arc<KmemCache>, start: Start, on_empty: OnEmpty) -> Result<NonNull<u8>> {
    if let Start::Default = start
        && let Some(p) = local::alloc_fast(cache, None)
    {
        if HARDENED {
            // SAFETY: just taken from the cache.
            unsafe { cache.handing_out(p) };
        }
        if RAW && cache.zero {
            // SAFETY: a fresh object of `size` bytes, ours.
            unsafe { p.as_ptr().write_bytes(0, cache.size) };
        }
        return Ok(p);
    }
    alloc_raw_slow(cache, start, on_empty)
}

#[inline(never)]
fn alloc_raw_slow(cache: &Arc<KmemCache>, start: Start, on_empty: OnEmpty) -> Result<NonNull<u8>> {
    let node = match start {
        Start::Node(n) => Some(cache.topo.check_node(n)?),
        Start::Default => None,
    };
    let p = match local::alloc_fast(cache, node) {
        Some(p) => p,
        None => local::alloc_slow(cache, start, on_empty)?,
    };
    if HARDENED {
        // SAFETY: just taken from the cache.
        unsafe { cache.handing_out(p) };
    }
    if cache.zero {
        // SAFETY: a fresh object of `size` bytes, ours.
        unsafe { p.as_ptr().write_bytes(0, cache.size) };
    }
    Ok(p)
}

fn alloc_wait_raw(cache: &Arc<KmemCache>, timeout: Duration) -> Result<NonNull<u8>> {
    match alloc_raw::<true>(cache, Start::Default, OnEmpty::Fail) {
        Err(Error::LimitReached { node, .. }) => {
            let deadline = Instant::now() + timeout;
            cache
                .wait(node, deadline, || alloc_raw::<true>(cache, Start::Node(node), OnEmpty::Fail).ok())
                .ok_or(Error::Timeout { waited: timeout })
        }
        r => r,
    }
}

fn alloc_bulk_raw(cache: &Arc<KmemCache>, out: &mut [*mut u8]) -> Result<()> {
    let mut i = 0;
    while i < out.len() {
        // Whole runs straight out of the thread's magazine; the slow path
        // refills it a magazine at a time (one depot or slab lock round trip
        // per `rounds` objects).
        let got = local::alloc_fast_many(cache, &mut out[i..]);
        if HARDENED {
            for &p in &out[i..i + got] {
                // SAFETY: just taken from the cache (non-null).
                unsafe { cache.handing_out(NonNull::new_unchecked(p)) };
            }
        }
        i += got;
        if i == out.len() {
            break;
        }
        match alloc_raw_slow(cache, Start::Default, OnEmpty::Fail) {
            Ok(p) => {
                out[i] = p.as_ptr();
                i += 1;
            }
            Err(e) => {
                // All or nothing, as `kmem_cache_alloc_bulk`.
                for &p in &out[..i] {
                    // SAFETY: allocated above, not yet handed out.
                    unsafe { local::free(Arc::as_ptr(cache), NonNull::new_unchecked(p)) };
                }
                return Err(e);
            }
        }
    }
    if cache.zero {
        for &p in out.iter() {
            // SAFETY: fresh objects of `size` bytes, ours.
            unsafe { p.write_bytes(0, cache.size) };
        }
    }
    Ok(())
}

fn drop_core(cache: &Arc<KmemCache>) {
    cache.dead.store(true, Ordering::Release);
    for ns in cache.nodes.iter() {
        ns.depot.close();
    }
    local::flush_current(cache);
    let (_, refs) = cache.shrink();
    // SAFETY: `cache` (the handle's reference) outlives this call.
    unsafe { KmemCache::put_refs(Arc::as_ptr(cache), refs) };
}

/// Shrinks every live cache, as [`RawCache::shrink`] does one (the calling
/// thread's magazines flushed, the depots and remote lists drained, empty
/// slabs unmapped; [`crate::trim`] and `malloc_trim` call it); returns
/// the bytes unmapped.
///
/// ```
/// use numaweave::slab::{SlabCache, shrink_all};
/// let cache = SlabCache::<[u8; 4096]>::new("scratch").unwrap();
/// let all: Vec<_> = (0..64).map(|_| cache.alloc([0; 4096]).unwrap()).collect();
/// drop(all);
/// assert!(shrink_all() > 0);
/// ```
pub fn shrink_all() -> usize {
    super::slabinfo::live_caches().iter().map(shrink_cache).sum()
}

fn shrink_cache(cache: &Arc<KmemCache>) -> usize {
    local::flush_current(cache);
    let (bytes, refs) = cache.shrink();
    // SAFETY: as in `drop_core`.
    unsafe { KmemCache::put_refs(Arc::as_ptr(cache), refs) };
    bytes
}

/// A typed cache of `T` objects, placed on a node; see the [module
/// docs](super).
///
/// Allocation moves a `T` into an object and returns a [`SlabBox<T>`];
/// dropping the box drops the `T` and returns the object to the cache. On
/// failure the value given is dropped. A typed cache's "constructor" is the
/// value moved in (and `T`'s `Drop` its destructor); the kernel's `ctor`
/// contract, objects constructed once and kept constructed while free, is
/// [`CacheBuilder::constructor`] on a [`RawCache`].
///
/// ```
/// use numaweave::slab::SlabCache;
/// use numaweave::topology::Topology;
///
/// let node = Topology::global().current_node();
/// let cache = SlabCache::<[u64; 32]>::builder("dma_buf").node(node).limit(128).build().unwrap();
/// let b = cache.alloc_on(node, [7; 32]).unwrap();
/// assert_eq!(numaweave::slab::SlabBox::node(&b), node);
/// assert_eq!(b[31], 7);
/// ```
pub struct SlabCache<T> {
    cache: Arc<KmemCache>,
    _t: PhantomData<fn() -> T>,
}

impl<T> SlabCache<T> {
    /// A builder for a cache named `name` (shown by [`slabinfo`](super::slabinfo)).
    pub fn builder(name: &str) -> CacheBuilder<Typed<T>> {
        CacheBuilder::new(name, size_of::<T>(), align_of::<T>())
    }

    /// A cache with the default options: local to the allocating thread, no
    /// limit.
    pub fn new(name: &str) -> Result<Self> {
        Self::builder(name).build()
    }

    #[inline(always)]
    fn wrap(&self, p: Result<NonNull<u8>>, value: T) -> Result<SlabBox<T>> {
        let p = p?.cast::<T>();
        // SAFETY: a fresh object, sized and aligned for `T`, ours.
        unsafe { p.as_ptr().write(value) };
        Ok(SlabBox { ptr: p, cache: NonNull::from(&*self.cache) })
    }

    /// An object on the cache's home node (or the calling thread's node for a
    /// local cache), falling back to the nearest node with room when that
    /// node is at its limit or out of memory (counted in `fallbacks`).
    #[inline]
    pub fn alloc(&self, value: T) -> Result<SlabBox<T>> {
        self.wrap(alloc_raw::<false>(&self.cache, Start::Default, OnEmpty::Fallback), value)
    }

    /// An object on `node` exactly (`kmem_cache_alloc_node`): never falls
    /// back. [`Error::InvalidNode`], [`Error::LimitReached`] or
    /// [`Error::NodeOutOfMemory`] otherwise.
    pub fn alloc_on(&self, node: usize, value: T) -> Result<SlabBox<T>> {
        self.wrap(alloc_raw::<false>(&self.cache, Start::Node(node), OnEmpty::Fail), value)
    }

    /// An object on the home (or local) node, without falling back or
    /// waiting: [`Error::LimitReached`] when the node is at its limit.
    #[inline]
    pub fn try_alloc(&self, value: T) -> Result<SlabBox<T>> {
        self.wrap(alloc_raw::<false>(&self.cache, Start::Default, OnEmpty::Fail), value)
    }

    /// Like [`try_alloc`](Self::try_alloc), but when the node is at its limit,
    /// waits up to `timeout` for another thread to free an object
    /// ([`Error::Timeout`] after that), as SPDK's `iobuf` does.
    pub fn alloc_wait(&self, value: T, timeout: Duration) -> Result<SlabBox<T>> {
        self.wrap(alloc_wait_raw(&self.cache, timeout), value)
    }

    /// `n` objects on the home (or local) node, the i-th holding `init(i)`:
    /// all or none, taking objects from the slabs in batches.
    pub fn alloc_bulk(&self, n: usize, mut init: impl FnMut(usize) -> T) -> Result<Vec<SlabBox<T>>> {
        let mut out = Vec::with_capacity(n);
        let mut buf = [core::ptr::null_mut(); MAG_MAX];
        while out.len() < n {
            let k = (n - out.len()).min(MAG_MAX);
            // On failure `out` drops: the objects already boxed go back too.
            alloc_bulk_raw(&self.cache, &mut buf[..k])?;
            // Objects not yet boxed go back if `init` panics.
            let mut pending = Pending { cache: &self.cache, objs: &buf[..k], done: 0 };
            while pending.done < k {
                let v = init(out.len());
                // SAFETY: from `alloc_bulk_raw`: a fresh, non-null object
                // sized and aligned for `T`.
                let ptr = unsafe { NonNull::new_unchecked(pending.objs[pending.done]) }.cast::<T>();
                // SAFETY: as above.
                unsafe { ptr.as_ptr().write(v) };
                out.push(SlabBox { ptr, cache: NonNull::from(&*self.cache) });
                pending.done += 1;
            }
        }
        Ok(out)
    }

    /// Drops the values and returns the objects in one pass, sending those of
    /// other nodes home in one chain per node.
    ///
    /// # Panics
    /// If a box belongs to another cache.
    pub fn free_bulk(&self, boxes: impl IntoIterator<Item = SlabBox<T>>) {
        let multi = self.cache.multi_node;
        let mut raw = Vec::new();
        for b in boxes {
            assert!(
                core::ptr::eq(b.cache.as_ptr(), Arc::as_ptr(&self.cache)),
                "numaweave: a SlabBox of cache \"{}\" passed to free_bulk of cache \"{}\"",
                b.cache_name(),
                self.cache.name
            );
            if !multi {
                // One node: every free is a local one, nothing to group.
                drop(b);
                continue;
            }
            let b = core::mem::ManuallyDrop::new(b);
            // SAFETY: the box owned a live `T`; it is not used again.
            unsafe { b.ptr.as_ptr().drop_in_place() };
            raw.push(b.ptr.cast::<u8>());
        }
        // SAFETY: objects of this cache, emptied above, owned by us.
        unsafe { local::free_bulk(&self.cache, &raw) };
    }

    cache_accessors!();
}

impl<T> Drop for SlabCache<T> {
    fn drop(&mut self) {
        drop_core(&self.cache);
    }
}

impl<T> fmt::Debug for SlabCache<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlabCache").field("name", &self.cache.name).field("home", &self.cache.home).finish()
    }
}

/// Objects of a bulk allocation not yet handed out; returned on unwind.
struct Pending<'a> {
    cache: &'a Arc<KmemCache>,
    objs: &'a [*mut u8],
    done: usize,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        for &p in &self.objs[self.done..] {
            // SAFETY: objects of this cache holding no value, ours.
            unsafe { local::free(Arc::as_ptr(self.cache), NonNull::new_unchecked(p)) };
        }
    }
}

/// An owned `T` in a slab object: the cache's `Box`. Dropping it drops the
/// `T` and frees the object into the dropping thread's magazine (or, from
/// another node, home to its node). It may outlive its [`SlabCache`].
pub struct SlabBox<T> {
    ptr: NonNull<T>,
    cache: NonNull<KmemCache>,
}

// SAFETY: the box owns its `T` like `Box<T>`; freeing from any thread is what
// the cache is built for.
unsafe impl<T: Send> Send for SlabBox<T> {}
// SAFETY: `&SlabBox<T>` only gives `&T`.
unsafe impl<T: Sync> Sync for SlabBox<T> {}

impl<T> SlabBox<T> {
    /// The node of the object's memory (an associated function, like
    /// `Box::leak`, so it does not shadow a method of `T`).
    pub fn node(this: &Self) -> usize {
        // SAFETY: the box's object belongs to its (alive) cache.
        let list = unsafe { this.cache().node_of(this.ptr.cast()) };
        this.cache().memory_node(list)
    }

    /// The object's address.
    pub fn as_ptr(this: &Self) -> *const T {
        this.ptr.as_ptr()
    }

    fn cache(&self) -> &KmemCache {
        // SAFETY: the object's slab keeps the cache alive while the box exists.
        unsafe { self.cache.as_ref() }
    }

    fn cache_name(&self) -> &str {
        &self.cache().name
    }
}

impl<T> Deref for SlabBox<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the box owns an initialised `T`.
        unsafe { self.ptr.as_ref() }
    }
}

impl<T> DerefMut for SlabBox<T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as above, uniquely.
        unsafe { self.ptr.as_mut() }
    }
}

impl<T> Drop for SlabBox<T> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: the box owns the `T`, dropped once here; then the emptied
        // object goes back to its cache, which its slab keeps alive.
        unsafe {
            self.ptr.as_ptr().drop_in_place();
            local::free(self.cache.as_ptr(), self.ptr.cast());
        }
    }
}

impl<T: fmt::Debug> fmt::Debug for SlabBox<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        (**self).fmt(f)
    }
}

/// A cache of objects whose size and alignment are known at run time, with
/// a raw-pointer API (`kmem_cache_create` with a size).
///
/// ```
/// use numaweave::slab::RawCache;
///
/// let bufs = RawCache::builder("io_buf", 4096).align(4096).zero(true).build().unwrap();
/// let p = bufs.alloc().unwrap();
/// assert_eq!(p.as_ptr() as usize % 4096, 0);
/// // SAFETY: a 4096-byte object of `bufs`, freed once.
/// unsafe {
///     assert_eq!(*p.as_ptr().add(4095), 0);
///     bufs.free(p);
/// }
/// ```
pub struct RawCache {
    pub(super) cache: Arc<KmemCache>,
}

impl RawCache {
    /// A builder for objects of `size` bytes.
    pub fn builder(name: &str, size: usize) -> CacheBuilder<Raw> {
        CacheBuilder::new(name, size, 8)
    }

    /// Object size in bytes.
    pub fn object_size(&self) -> usize {
        self.cache.size
    }

    /// Alignment of every object.
    pub fn align(&self) -> usize {
        self.cache.align
    }

    /// A device may hold the physical address of an object (a DMA pool
    /// handed one out): a demotion leaves the pool where it is unless told
    /// otherwise.
    pub(crate) fn device_may_hold(&self) {
        self.cache.moves.device_addresses.store(true, Ordering::Relaxed);
    }

    /// See [`SlabCache::alloc`].
    #[inline]
    pub fn alloc(&self) -> Result<NonNull<u8>> {
        alloc_raw::<true>(&self.cache, Start::Default, OnEmpty::Fallback)
    }

    /// See [`SlabCache::alloc_on`].
    pub fn alloc_on(&self, node: usize) -> Result<NonNull<u8>> {
        alloc_raw::<true>(&self.cache, Start::Node(node), OnEmpty::Fail)
    }

    /// See [`SlabCache::try_alloc`].
    pub fn try_alloc(&self) -> Result<NonNull<u8>> {
        alloc_raw::<true>(&self.cache, Start::Default, OnEmpty::Fail)
    }

    /// See [`SlabCache::alloc_wait`].
    pub fn alloc_wait(&self, timeout: Duration) -> Result<NonNull<u8>> {
        alloc_wait_raw(&self.cache, timeout)
    }

    /// Fills `out` with objects of the home (or local) node, all or none
    /// (`kmem_cache_alloc_bulk`).
    pub fn alloc_bulk(&self, out: &mut [*mut u8]) -> Result<()> {
        alloc_bulk_raw(&self.cache, out)
    }

    /// Returns `obj` to the cache.
    ///
    /// # Safety
    /// `obj` came from an allocation of a numaweave slab cache, has not been
    /// freed since, and is not used afterwards. (An object of *another*
    /// cache is caught with a panic, and in debug builds a pointer into the
    /// middle of one too; hardened builds also catch a double free and a
    /// pointer into no slab, and report them as the allocator's other
    /// misuses.)
    #[inline]
    pub unsafe fn free(&self, obj: NonNull<u8>) {
        // SAFETY: `obj` is a live object of some numaweave slab cache (the caller's word), so
        // it lies in slab memory, as `check_owner` asks.
        if !unsafe { self.cache.check_owner(obj) } {
            return;
        }
        // SAFETY: checked to be an object of this cache.
        if HARDENED && !unsafe { self.cache.freeing(obj) } {
            return;
        }
        // SAFETY: checked to be ours; the caller gives it up.
        unsafe { local::free(Arc::as_ptr(&self.cache), obj) };
    }

    /// Returns every object of `objs`, sending those of other nodes home in
    /// one chain per node (`kmem_cache_free_bulk`).
    ///
    /// # Safety
    /// As [`free`](Self::free), for each object (no duplicates).
    pub unsafe fn free_bulk(&self, objs: &[NonNull<u8>]) {
        if !HARDENED {
            for &o in objs {
                // SAFETY: each lies in a slab (the caller's word), which is
                // what the check reads; a wrong one panics.
                unsafe { self.cache.check_owner(o) };
            }
            // SAFETY: checked; the caller gives them up.
            unsafe { local::free_bulk(&self.cache, objs) };
        } else {
            // Under `NUMAWEAVE_ON_ERROR=report` the objects found wrong are
            // left out (leaked), the others freed.
            // SAFETY: each is a live object of some numaweave slab cache (the caller's word), so
            // lies in slab memory; checked to be this cache's before its mark is looked at.
            let ok: Vec<_> = objs
                .iter()
                .copied()
                .filter(|&o| unsafe { self.cache.check_owner(o) && self.cache.freeing(o) })
                .collect();
            // SAFETY: checked; the caller gives them up.
            unsafe { local::free_bulk(&self.cache, &ok) };
        }
    }

    /// The node of `obj`'s memory.
    ///
    /// # Safety
    /// `obj` is a live object of this cache.
    pub unsafe fn node_of(&self, obj: NonNull<u8>) -> usize {
        // SAFETY: `obj` is a live object of this cache (the caller's word), as
        // `KmemCache::node_of` asks.
        self.cache.memory_node(unsafe { self.cache.node_of(obj) })
    }

    cache_accessors!();
}

impl Drop for RawCache {
    fn drop(&mut self) {
        drop_core(&self.cache);
    }
}

impl fmt::Debug for RawCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawCache")
            .field("name", &self.cache.name)
            .field("size", &self.cache.size)
            .field("home", &self.cache.home)
            .finish()
    }
}
