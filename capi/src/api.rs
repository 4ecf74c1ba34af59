//! The C API beyond malloc: `numaweave.h` is generated from this file by
//! cbindgen (see `build.rs`).
//!
//! Conventions: node ids are the topology's (`numaweave topology` prints
//! them); functions that can fail return a [`numaweave_status`] or null, and
//! [`numaweave_last_error`] then describes the failure in words; text is
//! written into caller buffers with `snprintf`'s contract (the length it
//! needs is returned, the buffer always NUL-terminated when not empty).

use core::alloc::Layout;
use core::cell::{Cell, RefCell};
use core::ffi::{CStr, c_char, c_int, c_void};
use core::fmt::Write as _;
use core::ptr::{self, NonNull};

use numaweave::alloc::malloc_align;
use numaweave::policy::Policy;
use numaweave::slab::{Demotion, RawCache, Refusal, Region, Registrar, Stuck};
use numaweave::{Error, PolicyGuard, Topology};

use crate::A;

/// What a call of this API did.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum numaweave_status {
    /// Done.
    NUMAWEAVE_OK = 0,
    /// An argument was null, not UTF-8, or out of range.
    NUMAWEAVE_INVALID_ARGUMENT = 1,
    /// A node id that is not online, has no memory, or is not allowed.
    NUMAWEAVE_INVALID_NODE = 2,
    /// A policy that does not parse or does not fit the topology.
    NUMAWEAVE_INVALID_POLICY = 3,
    /// The memory could not be had.
    NUMAWEAVE_OUT_OF_MEMORY = 4,
    /// A size or alignment larger than numaweave serves.
    NUMAWEAVE_LAYOUT_TOO_LARGE = 5,
    /// No such device (PCI id, block device, network interface).
    NUMAWEAVE_NO_SUCH_DEVICE = 6,
    /// A slab cache's per-node limit was reached.
    NUMAWEAVE_LIMIT_REACHED = 7,
    /// A system call failed.
    NUMAWEAVE_OS_ERROR = 8,
    /// A pool's registrar refused a region of its memory.
    NUMAWEAVE_REGISTRATION_FAILED = 9,
    /// A pool could not move: a region of it is registered (pinned) and its
    /// registrar cannot release it. Nothing moved.
    NUMAWEAVE_REGISTERED = 10,
    /// The kernel moved a registered region's pages to another node as it
    /// pinned them (the node's memory is movable): the region was refused.
    NUMAWEAVE_PINS_LEFT_NODE = 11,
}

use numaweave_status::*;

thread_local! {
    /// The calling thread's last error, NUL-terminated.
    static LAST_ERROR: RefCell<[u8; 256]> = const { RefCell::new([0; 256]) };
    /// The thread's policy set through this API.
    static POLICY: RefCell<Option<PolicyGuard>> = const { RefCell::new(None) };
    static HAS_ERROR: Cell<bool> = const { Cell::new(false) };
}

/// Records `msg` as the thread's last error; returns `status`.
fn fail(status: numaweave_status, msg: core::fmt::Arguments<'_>) -> numaweave_status {
    struct Buf<'a>(&'a mut [u8; 256], usize);
    impl core::fmt::Write for Buf<'_> {
        fn write_str(&mut self, s: &str) -> core::fmt::Result {
            let n = s.len().min(self.0.len() - 1 - self.1);
            self.0[self.1..self.1 + n].copy_from_slice(&s.as_bytes()[..n]);
            self.1 += n;
            Ok(())
        }
    }
    LAST_ERROR.with_borrow_mut(|b| {
        let mut w = Buf(b, 0);
        let _ = w.write_fmt(msg);
        let n = w.1;
        b[n] = 0;
    });
    HAS_ERROR.with(|h| h.set(true));
    status
}

/// The status for `e`, recorded as the last error.
fn fail_with(e: Error) -> numaweave_status {
    let status = match e {
        Error::InvalidNode { .. } => NUMAWEAVE_INVALID_NODE,
        Error::InvalidPolicy { .. } => NUMAWEAVE_INVALID_POLICY,
        Error::NodeOutOfMemory { .. } => NUMAWEAVE_OUT_OF_MEMORY,
        Error::LayoutTooLarge { .. } => NUMAWEAVE_LAYOUT_TOO_LARGE,
        Error::NoSuchDevice { .. } => NUMAWEAVE_NO_SUCH_DEVICE,
        Error::LimitReached { .. } => NUMAWEAVE_LIMIT_REACHED,
        Error::Os { .. } => NUMAWEAVE_OS_ERROR,
        Error::Registration { .. } | Error::MemlockLimit { .. } => NUMAWEAVE_REGISTRATION_FAILED,
        Error::PinsLeftNode { .. } => NUMAWEAVE_PINS_LEFT_NODE,
        Error::RegisteredRegion { .. } => NUMAWEAVE_REGISTERED,
        _ => NUMAWEAVE_INVALID_ARGUMENT,
    };
    fail(status, format_args!("{e}"))
}

/// A C string argument as text.
///
/// # Safety
/// `s` is null or a NUL-terminated string that outlives `'a`.
unsafe fn text<'a>(s: *const c_char) -> Option<&'a str> {
    if s.is_null() {
        return None;
    }
    // SAFETY: the caller passes a NUL-terminated string.
    unsafe { CStr::from_ptr(s) }.to_str().ok()
}

/// A node id argument.
fn node_arg(node: c_int) -> Result<usize, numaweave_status> {
    usize::try_from(node).map_err(|_| fail(NUMAWEAVE_INVALID_NODE, format_args!("node {node}: not a node id")))
}

/// Writes `t` into `buf` (`len` bytes) like `snprintf`; the length needed.
///
/// # Safety
/// `buf` is null or holds `len` writable bytes.
unsafe fn write_text(buf: *mut c_char, len: usize, t: &str) -> usize {
    if !buf.is_null() && len > 0 {
        let n = t.len().min(len - 1);
        // SAFETY: the caller's buffer holds `len` bytes.
        unsafe {
            ptr::copy_nonoverlapping(t.as_ptr(), buf.cast(), n);
            *buf.add(n) = 0;
        }
    }
    t.len()
}

/// The calling thread's last error in words ("" if none), valid until the
/// thread's next failing call.
#[unsafe(no_mangle)]
pub extern "C" fn numaweave_last_error() -> *const c_char {
    LAST_ERROR.with_borrow(|b| b.as_ptr().cast())
}

/// Nodes online (ids run from 0 to this minus one, gaps possible).
#[unsafe(no_mangle)]
pub extern "C" fn numaweave_node_count() -> c_int {
    Topology::global().nodes().iter().last().map_or(1, |n| n as c_int + 1)
}

/// The node the calling thread runs on now.
#[unsafe(no_mangle)]
pub extern "C" fn numaweave_current_node() -> c_int {
    Topology::global().current_node() as c_int
}

/// `size` bytes aligned to `align` (a power of two; 0 means 16; at least 16
/// above 8 bytes, as `malloc`, so `realloc` may keep the block) on `node`'s
/// memory (the nearest node's when it is full, unless the allocator is
/// strict), freed with `free`. Null on failure (`numaweave_last_error` says
/// why, `errno` is `ENOMEM` or `EINVAL`).
#[unsafe(no_mangle)]
pub extern "C" fn numaweave_alloc_on_node(size: usize, align: usize, node: c_int) -> *mut c_void {
    let align = if align == 0 { 16 } else { align };
    let Ok(node) = node_arg(node) else {
        crate::set_errno(libc::EINVAL);
        return ptr::null_mut();
    };
    let Ok(layout) = Layout::from_size_align(size, align) else {
        fail(NUMAWEAVE_INVALID_ARGUMENT, format_args!("alignment {align} is not a power of two"));
        crate::set_errno(libc::EINVAL);
        return ptr::null_mut();
    };
    // (Fails only for a size no allocation can have: `alloc_on` says so.)
    let layout = layout.align_to(malloc_align(size)).unwrap_or(layout);
    match A.alloc_on(layout, node) {
        Ok(p) => p.as_ptr().cast(),
        Err(e) => {
            crate::set_errno(if matches!(e, Error::InvalidNode { .. }) { libc::EINVAL } else { libc::ENOMEM });
            fail_with(e);
            ptr::null_mut()
        }
    }
}

/// `size` bytes aligned to `align` (as for `numaweave_alloc_on_node`) for
/// cold data: on the lower memory tier nearest the calling thread (the CXL
/// memory behind its socket), or on the thread's own node, counted as a
/// fallback, where the machine has no lower tier or that node is full.
/// Freed with `free`. Null on failure (`errno` `ENOMEM` or `EINVAL`).
#[unsafe(no_mangle)]
pub extern "C" fn numaweave_alloc_cold(size: usize, align: usize) -> *mut c_void {
    let align = if align == 0 { 16 } else { align };
    let Ok(layout) = Layout::from_size_align(size, align) else {
        fail(NUMAWEAVE_INVALID_ARGUMENT, format_args!("alignment {align} is not a power of two"));
        crate::set_errno(libc::EINVAL);
        return ptr::null_mut();
    };
    let layout = layout.align_to(malloc_align(size)).unwrap_or(layout);
    match A.alloc_cold(layout) {
        Ok(p) => p.as_ptr().cast(),
        Err(e) => {
            crate::set_errno(libc::ENOMEM);
            fail_with(e);
            ptr::null_mut()
        }
    }
}

/// `size` bytes with a hot/cold hint, as LLVM's memory profiler gives the
/// hinted `operator new` (0 the coldest, 255 the hottest): below 128 the
/// block is cold, as from `numaweave_alloc_cold` (the lower tier nearest
/// the calling thread, in a page no hot block shares); from 128 on it is
/// `malloc(size)`'s. Aligned as `malloc` aligns. Freed with `free`. Null on
/// failure (`errno` `ENOMEM`).
#[unsafe(no_mangle)]
pub extern "C" fn numaweave_alloc_hint(size: usize, hint: u8) -> *mut c_void {
    let Ok(layout) = Layout::from_size_align(size, malloc_align(size)) else {
        crate::set_errno(libc::ENOMEM);
        return ptr::null_mut();
    };
    match A.alloc_hinted(layout, hint) {
        Ok(p) => p.as_ptr().cast(),
        Err(e) => {
            crate::set_errno(libc::ENOMEM);
            fail_with(e);
            ptr::null_mut()
        }
    }
}

/// The node whose memory holds the block at `p` (as numaweave placed it),
/// or -1 if numaweave did not allocate it.
///
/// # Safety
/// `p` is null or a pointer the caller got from an allocator.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_node_of(p: *const c_void) -> c_int {
    if !A.owns(p.cast()) {
        return -1;
    }
    // SAFETY: a live block of ours.
    unsafe { A.node_of(p.cast()) as c_int }
}

/// Sets the calling thread's memory policy from its text form (`local`,
/// `bind:1`, `preferred:0`, `interleave:0-3:bytes=2M`,
/// `interleave:0,1:count=8:weights=3,1`), replacing one set before; it lasts
/// until changed or cleared. `NUMAWEAVE_INVALID_POLICY` for a string that
/// does not parse or does not fit the topology (the thread's policy is then
/// unchanged).
///
/// # Safety
/// `policy` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_set_thread_policy(policy: *const c_char) -> numaweave_status {
    // SAFETY: `policy` is a NUL-terminated string (the caller's word), which `text` reads.
    let Some(s) = (unsafe { text(policy) }) else {
        return fail(NUMAWEAVE_INVALID_ARGUMENT, format_args!("policy: not a NUL-terminated UTF-8 string"));
    };
    let p: Policy = match s.trim().parse() {
        Ok(p) => p,
        Err(e) => return fail(NUMAWEAVE_INVALID_POLICY, format_args!("{s:?}: {e}")),
    };
    if let Err(e) = p.validate(Topology::global()) {
        return fail(NUMAWEAVE_INVALID_POLICY, format_args!("{s:?}: {e}"));
    }
    POLICY.with_borrow_mut(|g| {
        // The previous guard first: the new one restores the default.
        *g = None;
        match numaweave::with_policy(p) {
            Ok(guard) => {
                *g = Some(guard);
                NUMAWEAVE_OK
            }
            Err(e) => fail_with(e),
        }
    })
}

/// Back to the process default policy for the calling thread.
#[unsafe(no_mangle)]
pub extern "C" fn numaweave_clear_thread_policy() {
    POLICY.with_borrow_mut(|g| *g = None);
}

/// A node slab cache (opaque).
pub struct numaweave_slab {
    cache: RawCache,
}

/// Where a cache's objects go: node `node`, or with `node = -1` the node of
/// the thread that allocates.
///
/// # Safety
/// `name` is null or a NUL-terminated string.
unsafe fn slab_create(
    name: *const c_char,
    size: usize,
    align: usize,
    home: impl FnOnce(
        numaweave::slab::CacheBuilder<numaweave::slab::Raw>,
    ) -> numaweave::slab::CacheBuilder<numaweave::slab::Raw>,
) -> *mut numaweave_slab {
    // SAFETY: `name` is null or a NUL-terminated string (the caller's word),
    // what `text` reads.
    let Some(name) = (unsafe { text(name) }) else {
        fail(NUMAWEAVE_INVALID_ARGUMENT, format_args!("slab name: not a NUL-terminated UTF-8 string"));
        return ptr::null_mut();
    };
    let mut b = RawCache::builder(name, size);
    if align != 0 {
        b = b.align(align);
    }
    match home(b).build() {
        Ok(cache) => Box::into_raw(Box::new(numaweave_slab { cache })),
        Err(e) => {
            fail_with(e);
            ptr::null_mut()
        }
    }
}

/// A cache of `size`-byte objects aligned to `align` (0: their natural
/// alignment) on `node` (-1: the allocating thread's node). Null on error.
///
/// # Safety
/// `name` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_slab_create(
    name: *const c_char,
    size: usize,
    align: usize,
    node: c_int,
) -> *mut numaweave_slab {
    // SAFETY: `name` is a NUL-terminated string (the caller's word).
    unsafe { slab_create(name, size, align, |b| at_node(b, node)) }
}

/// Homes a cache on `node`, or with `node = -1` on the allocating thread's.
fn at_node(
    b: numaweave::slab::CacheBuilder<numaweave::slab::Raw>,
    node: c_int,
) -> numaweave::slab::CacheBuilder<numaweave::slab::Raw> {
    if node < 0 { b.local() } else { b.node(node as usize) }
}

/// A cache placed on the node of `device` (a PCI id such as
/// `0000:03:00.0`, a block device such as `nvme0n1`, or a network interface
/// such as `eth0`); with `or_local`, a device without a node gives a cache
/// on the allocating thread's node instead of an error.
///
/// # Safety
/// `name` and `device` are NUL-terminated strings.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_slab_create_for_device(
    name: *const c_char,
    size: usize,
    align: usize,
    device: *const c_char,
    or_local: bool,
) -> *mut numaweave_slab {
    // SAFETY: `device` is a NUL-terminated string (the caller's word), which `text` reads.
    let Some(dev) = (unsafe { text(device) }) else {
        fail(NUMAWEAVE_INVALID_ARGUMENT, format_args!("device: not a NUL-terminated UTF-8 string"));
        return ptr::null_mut();
    };
    // SAFETY: `name` is a NUL-terminated string (the caller's word).
    unsafe {
        slab_create(name, size, align, |b| {
            let b = b.device(dev);
            if or_local { b.or_local() } else { b }
        })
    }
}

/// A region of a cache's memory, as a registrar is told of it: `len` bytes
/// from `addr`, bound to `node`, on pages of `page_size` bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct numaweave_region {
    /// The region's first byte.
    pub addr: *mut c_void,
    /// Its length in bytes.
    pub len: usize,
    /// The node its memory is bound to.
    pub node: c_int,
    /// The size of the pages behind it (hugetlb's, else the base page).
    pub page_size: usize,
}

/// A registrar for a cache's memory (`numaweave_slab_create_registered`):
/// `register_region` is called once for each region when it is mapped and
/// bound, before anything of it is handed out, and returns 0 or an errno
/// value (which fails the allocation that needed the region, with
/// `NUMAWEAVE_REGISTRATION_FAILED`); `unregister_region` is called once
/// for each registered region before it is unmapped, or at once when the
/// kernel moved the region's pages to another node as they were pinned
/// (the node's memory is movable: the allocation fails with
/// `NUMAWEAVE_PINS_LEFT_NODE`). Both get `ctx`, may be
/// called from any thread that allocates from or frees to the cache, under
/// the cache's node lock (so they must not use this cache), and may use
/// `malloc` and system calls: `io_uring_register_buffers_update_tag`,
/// `VFIO_IOMMU_MAP_DMA`, `ibv_reg_mr` and their inverses.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct numaweave_registrar {
    /// Registers a region: 0, or an errno value.
    pub register_region: Option<unsafe extern "C" fn(ctx: *mut c_void, region: *const numaweave_region) -> c_int>,
    /// Unregisters a region registered before.
    pub unregister_region: Option<unsafe extern "C" fn(ctx: *mut c_void, region: *const numaweave_region)>,
    /// Passed to both.
    pub ctx: *mut c_void,
}

/// How a registrar lets its regions move (`numaweave_slab_migrate`):
/// `release_region` lets go of a region (the pin, the device mapping)
/// keeping what names it (an io_uring slot, an RDMA key's place);
/// `reregister_region` registers it again under those names once its pages
/// moved (`region->node` is the new node). Each returns 0 or an errno value;
/// both get the registrar's `ctx`, under the cache's node lock, as the
/// registrar's functions do.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct numaweave_mover {
    /// Releases a registered region before its pages move: 0, or an errno
    /// value (the region stays registered where it is; its pages are
    /// reported as refused).
    pub release_region: Option<unsafe extern "C" fn(ctx: *mut c_void, region: *const numaweave_region) -> c_int>,
    /// Registers a released region again after its pages moved: 0, or an
    /// errno value (the migration fails with
    /// `NUMAWEAVE_REGISTRATION_FAILED`; the region is no longer registered).
    pub reregister_region: Option<unsafe extern "C" fn(ctx: *mut c_void, region: *const numaweave_region) -> c_int>,
}

/// A C registrar as the library's `Registrar`, with its mover if it has one.
struct CRegistrar(numaweave_registrar, Option<numaweave_mover>);

// SAFETY: `numaweave_slab_create_registered`'s contract: the callbacks may
// be called from any thread, with `ctx`, at the same time.
unsafe impl Send for CRegistrar {}
// SAFETY: as for `Send`.
unsafe impl Sync for CRegistrar {}

/// A registrar's or mover's hook: takes the registrar's `ctx` and a region,
/// answers 0 or an errno value.
type Hook = unsafe extern "C" fn(ctx: *mut c_void, region: *const numaweave_region) -> c_int;

impl CRegistrar {
    fn c_region(r: &Region) -> numaweave_region {
        numaweave_region {
            addr: r.addr.as_ptr().cast(),
            len: r.len,
            node: c_int::try_from(r.node).unwrap_or(c_int::MAX),
            page_size: r.page_size,
        }
    }

    /// Calls `hook` with the registrar's `ctx` and `region`: its 0 as `Ok`,
    /// an errno as the refusal.
    fn call(&self, hook: Hook, region: &Region) -> Result<(), Refusal> {
        let r = Self::c_region(region);
        // SAFETY: the caller of `numaweave_slab_create_registered` (or
        // `_movable`) gave hooks that take its `ctx` and a region they only
        // read, callable from any thread.
        match unsafe { hook(self.0.ctx, &r) } {
            0 => Ok(()),
            e => Err(Refusal::Errno(e)),
        }
    }
}

impl Registrar for CRegistrar {
    fn register(&self, region: &Region) -> Result<(), Refusal> {
        self.0.register_region.map_or(Ok(()), |f| self.call(f, region))
    }

    fn unregister(&self, region: &Region) {
        if let Some(f) = self.0.unregister_region {
            let r = Self::c_region(region);
            // SAFETY: as in `call`.
            unsafe { f(self.0.ctx, &r) };
        }
    }

    fn can_move(&self) -> bool {
        self.1.is_some_and(|m| m.release_region.is_some() && m.reregister_region.is_some())
    }

    fn release_for_move(&self, region: &Region) -> Result<(), Refusal> {
        match self.1.and_then(|m| m.release_region) {
            Some(f) => self.call(f, region),
            None => Err(Refusal::Errno(libc::EOPNOTSUPP)),
        }
    }

    fn register_moved(&self, region: &Region) -> Result<(), Refusal> {
        match self.1.and_then(|m| m.reregister_region) {
            Some(f) => self.call(f, region),
            None => Err(Refusal::Errno(libc::EOPNOTSUPP)),
        }
    }
}

/// `numaweave_slab_create` with a registrar (copied: `registrar` may go
/// after the call, `ctx` must live as long as the cache's memory). Null on
/// error, and null `registrar` is an error.
///
/// # Safety
/// `name` is a NUL-terminated string; `registrar` is null or points at a
/// registrar whose functions may be called from any thread at the same time
/// until the cache's last region is unregistered.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_slab_create_registered(
    name: *const c_char,
    size: usize,
    align: usize,
    node: c_int,
    registrar: *const numaweave_registrar,
) -> *mut numaweave_slab {
    // SAFETY: `registrar` is null or points at a valid registrar (the caller's word).
    let Some(r) = (unsafe { registrar.as_ref() }) else {
        fail(NUMAWEAVE_INVALID_ARGUMENT, format_args!("registrar: null"));
        return ptr::null_mut();
    };
    let r: std::sync::Arc<dyn Registrar> = std::sync::Arc::new(CRegistrar(*r, None));
    // SAFETY: `name` is a NUL-terminated string (the caller's word).
    unsafe { slab_create(name, size, align, |b| at_node(b, node).registrar(r)) }
}

/// `numaweave_slab_create_registered` whose regions can move: with a
/// `mover` (copied, both functions set), `numaweave_slab_migrate` releases,
/// moves and registers again each region instead of failing with
/// `NUMAWEAVE_REGISTERED`. Null on error; a null `registrar` or `mover`,
/// or a mover without both functions, is an error.
///
/// # Safety
/// As `numaweave_slab_create_registered`; `mover` is null or points at a
/// mover whose functions may be called as the registrar's are.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_slab_create_movable(
    name: *const c_char,
    size: usize,
    align: usize,
    node: c_int,
    registrar: *const numaweave_registrar,
    mover: *const numaweave_mover,
) -> *mut numaweave_slab {
    // SAFETY: `registrar` and `mover` are each null or point at a valid one (the
    // caller's word).
    let (Some(r), Some(m)) = (unsafe { registrar.as_ref() }, unsafe { mover.as_ref() }) else {
        fail(NUMAWEAVE_INVALID_ARGUMENT, format_args!("registrar or mover: null"));
        return ptr::null_mut();
    };
    if m.release_region.is_none() || m.reregister_region.is_none() {
        fail(NUMAWEAVE_INVALID_ARGUMENT, format_args!("mover: both functions are needed"));
        return ptr::null_mut();
    }
    let r: std::sync::Arc<dyn Registrar> = std::sync::Arc::new(CRegistrar(*r, Some(*m)));
    // SAFETY: `name` is a NUL-terminated string (the caller's word).
    unsafe { slab_create(name, size, align, |b| at_node(b, node).registrar(r)) }
}

/// An object of the cache, on its home node (the nearest one with memory
/// when that one is out of it). Null on error.
///
/// # Safety
/// `slab` is a live cache.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_slab_alloc(slab: *mut numaweave_slab) -> *mut c_void {
    // SAFETY: `slab` is a live cache (the caller's word), so it may be borrowed.
    let Some(s) = (unsafe { slab.as_ref() }) else { return ptr::null_mut() };
    match s.cache.alloc() {
        Ok(p) => p.as_ptr().cast(),
        Err(e) => {
            fail_with(e);
            ptr::null_mut()
        }
    }
}

/// An object of the cache on `node` exactly (`kmem_cache_alloc_node`).
///
/// # Safety
/// `slab` is a live cache.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_slab_alloc_on(slab: *mut numaweave_slab, node: c_int) -> *mut c_void {
    // SAFETY: `slab` is a live cache (the caller's word), so it may be borrowed.
    let Some(s) = (unsafe { slab.as_ref() }) else { return ptr::null_mut() };
    let Ok(node) = node_arg(node) else { return ptr::null_mut() };
    match s.cache.alloc_on(node) {
        Ok(p) => p.as_ptr().cast(),
        Err(e) => {
            fail_with(e);
            ptr::null_mut()
        }
    }
}

/// Gives an object back to its cache (null: nothing).
///
/// # Safety
/// `slab` is a live cache and `obj` null or one of its live objects.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_slab_free(slab: *mut numaweave_slab, obj: *mut c_void) {
    // SAFETY: `slab` is a live cache (the caller's word), so it may be borrowed.
    if let (Some(s), Some(o)) = (unsafe { slab.as_ref() }, NonNull::new(obj.cast::<u8>())) {
        // SAFETY: `o` is a live object of the cache, given up (the caller's word), as
        // `RawCache::free` asks.
        unsafe { s.cache.free(o) };
    }
}

/// `n` objects into `objs`, all or none.
///
/// # Safety
/// `slab` is a live cache; `objs` holds `n` writable pointers.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_slab_alloc_bulk(
    slab: *mut numaweave_slab,
    objs: *mut *mut c_void,
    n: usize,
) -> numaweave_status {
    // SAFETY: `slab` is a live cache (the caller's word), so it may be borrowed.
    let Some(s) = (unsafe { slab.as_ref() }) else {
        return fail(NUMAWEAVE_INVALID_ARGUMENT, format_args!("null cache"));
    };
    if n == 0 {
        return NUMAWEAVE_OK;
    }
    if objs.is_null() {
        return fail(NUMAWEAVE_INVALID_ARGUMENT, format_args!("null array"));
    }
    // SAFETY: `objs`, not null (checked), holds `n` writable pointers (the caller's
    // word). A C caller's array is often uninitialised: it is nulled first, so the
    // slice is made over initialised pointers.
    let out = unsafe {
        ptr::write_bytes(objs, 0, n);
        core::slice::from_raw_parts_mut(objs.cast::<*mut u8>(), n)
    };
    match s.cache.alloc_bulk(out) {
        Ok(()) => NUMAWEAVE_OK,
        Err(e) => fail_with(e),
    }
}

/// Gives `n` objects back at once.
///
/// # Safety
/// `slab` is a live cache; `objs` holds `n` of its live objects, no object
/// twice.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_slab_free_bulk(slab: *mut numaweave_slab, objs: *const *mut c_void, n: usize) {
    // SAFETY: `slab` is a live cache (the caller's word), so it may be borrowed.
    let Some(s) = (unsafe { slab.as_ref() }) else { return };
    if objs.is_null() || n == 0 {
        return;
    }
    // SAFETY: `objs`, not null (checked), holds `n` live objects (the caller's word),
    // so non-null pointers; `NonNull<u8>` has the layout of a non-null pointer.
    let objs = unsafe { core::slice::from_raw_parts(objs.cast::<NonNull<u8>>(), n) };
    // SAFETY: each of `objs` is a live object of the cache, given up (the caller's
    // word), as `RawCache::free_bulk` asks.
    unsafe { s.cache.free_bulk(objs) };
}

/// Destroys the cache (objects still out stay valid until freed to it).
///
/// # Safety
/// `slab` is null or a live cache, not used after this.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_slab_destroy(slab: *mut numaweave_slab) {
    if !slab.is_null() {
        // SAFETY: `slab` is a live cache, which `slab_create` made with `Box::into_raw`,
        // not used after this (the caller's word).
        drop(unsafe { Box::from_raw(slab) });
    }
}

/// What [`numaweave_slab_migrate`] did.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct numaweave_migration {
    /// The node the pool is on now.
    pub to: c_int,
    /// Pages moved there.
    pub pages_moved: u64,
    /// Bytes moved.
    pub bytes_moved: u64,
    /// Present pages that were there already.
    pub pages_already: u64,
    /// Pages that stayed: pinned or busy (`EBUSY`; try again later).
    pub pages_busy: u64,
    /// Pages that stayed: the node had no room (`ENOMEM`).
    pub pages_node_full: u64,
    /// Pages that stayed: another process maps them too (after `fork`).
    pub pages_shared: u64,
    /// Pages that stayed: the registrar would not release their region.
    pub pages_refused: u64,
    /// Pages that stayed for another reason.
    pub pages_other: u64,
    /// Registered regions released, moved and registered again.
    pub regions_moved: u64,
    /// Registered regions the registrar refused to register again after
    /// the move: unregistered now.
    pub regions_lost: u64,
    /// Chunks the kernel refused to rebind to the node (their new pages
    /// fault where they did).
    pub chunks_unbound: u64,
    /// How long it took, in nanoseconds.
    pub nanoseconds: u64,
}

/// Moves the whole cache to `node` while other threads go on allocating and
/// freeing: no object's address or contents change, new slabs come from
/// `node` from now on (`RawCache::migrate`). Fills `*out` (if not null),
/// zeroed with `to` -1 when the migration fails before it starts.
/// `NUMAWEAVE_REGISTERED` for a cache made with a registrar and no mover
/// (its regions are pinned; nothing moves; `numaweave_slab_create_movable`
/// gives one), `NUMAWEAVE_INVALID_NODE` for a node that is
/// not online, has no memory or is not allowed.
///
/// # Safety
/// `slab` is a live cache; `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_slab_migrate(
    slab: *mut numaweave_slab,
    node: c_int,
    out: *mut numaweave_migration,
) -> numaweave_status {
    // SAFETY: `slab` is a live cache (the caller's word), so it may be borrowed.
    let Some(s) = (unsafe { slab.as_ref() }) else {
        return fail(NUMAWEAVE_INVALID_ARGUMENT, format_args!("slab: null"));
    };
    if !out.is_null() {
        // SAFETY: `out` is not null, so writable (the caller's word).
        unsafe { out.write(numaweave_migration { to: -1, ..Default::default() }) };
    }
    let node = match node_arg(node) {
        Ok(n) => n,
        Err(st) => return st,
    };
    let m = match s.cache.migrate(node) {
        Ok(m) => m,
        Err(e) => return fail_with(e),
    };
    let mut c = numaweave_migration {
        to: c_int::try_from(m.to).unwrap_or(c_int::MAX),
        pages_moved: m.pages_moved as u64,
        bytes_moved: m.bytes_moved,
        pages_already: m.pages_already as u64,
        regions_moved: m.regions_moved as u64,
        regions_lost: m.registrations_lost as u64,
        chunks_unbound: m.chunks_unbound as u64,
        nanoseconds: u64::try_from(m.took.as_nanos()).unwrap_or(u64::MAX),
        ..Default::default()
    };
    for u in &m.unmoved {
        let slot = match u.why {
            Stuck::Busy => &mut c.pages_busy,
            Stuck::NodeFull => &mut c.pages_node_full,
            Stuck::Shared => &mut c.pages_shared,
            Stuck::Registrar(_) => &mut c.pages_refused,
            _ => &mut c.pages_other,
        };
        *slot += u.pages as u64;
    }
    if !out.is_null() {
        // SAFETY: `out` is not null, so writable (the caller's word).
        unsafe { out.write(c) };
    }
    NUMAWEAVE_OK
}

/// Sets the cache's demotion condition: when `watch` has fewer than
/// `free_below` bytes free, the cache moves itself to `to` (-1: the
/// lower-tier node nearest `watch`), looked at from its slow paths at most
/// every `every_ms` milliseconds; no thread of its own. A
/// negative `watch` clears the condition.
///
/// # Safety
/// `slab` is a live cache.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_slab_demote_when(
    slab: *mut numaweave_slab,
    watch: c_int,
    free_below: u64,
    to: c_int,
    every_ms: u32,
) -> numaweave_status {
    // SAFETY: `slab` is a live cache (the caller's word), so it may be borrowed.
    let Some(s) = (unsafe { slab.as_ref() }) else {
        return fail(NUMAWEAVE_INVALID_ARGUMENT, format_args!("slab: null"));
    };
    let d = if watch < 0 {
        None
    } else {
        let mut d = Demotion::when_free_below(watch as usize, free_below)
            .every(std::time::Duration::from_millis(u64::from(every_ms)));
        if to >= 0 {
            d = d.to(to as usize);
        }
        Some(d)
    };
    match s.cache.demote_when(d) {
        Ok(()) => NUMAWEAVE_OK,
        Err(e) => fail_with(e),
    }
}

/// Every live cache's statistics as a table (like `/proc/slabinfo`), into
/// `buf` with `snprintf`'s contract.
///
/// # Safety
/// `buf` is null or holds `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_slabinfo(buf: *mut c_char, len: usize) -> usize {
    let t = numaweave::slab::slabinfo().to_string();
    // SAFETY: `buf` is null or holds `len` writable bytes (the caller's word), as
    // `write_text` needs.
    unsafe { write_text(buf, len, &t) }
}

/// One node's allocator statistics (bytes, or counts since start).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct numaweave_node_stats {
    /// Address space mapped for the node.
    pub reserved: u64,
    /// An upper bound of the resident memory.
    pub committed: u64,
    /// Bytes of live blocks.
    pub in_use: u64,
    /// Bytes returned to the OS (cumulative).
    pub returned: u64,
    /// Allocations (cumulative).
    pub allocs: u64,
    /// Frees (cumulative).
    pub frees: u64,
    /// Blocks freed by other threads and collected by their owner.
    pub remote_frees: u64,
    /// Pages taken from another node because this one was full.
    pub fallbacks: u64,
    /// Huge blocks live.
    pub huge_live: u64,
    /// Interleave regions mapped.
    pub regions: u64,
    /// Regions mapped on hugetlb pages (cumulative).
    pub huge_regions: u64,
    /// Regions that asked for hugetlb pages and got base pages (cumulative).
    pub huge_fallbacks: u64,
    /// Bytes of the node's segments and cached mappings in memory, plus
    /// live huge blocks whole.
    pub resident: u64,
    /// Of `resident`, free memory the kernel still holds.
    pub free_resident: u64,
    /// Bytes of the pages live threads' heaps hold.
    pub in_heaps: u64,
    /// Bytes of the pages exited threads' heaps hold, waiting for adoption.
    pub orphaned: u64,
    /// Address space mapped but not committed.
    pub retained: u64,
    /// Bytes of free blocks in size-class pages still in use: memory only
    /// the class that made those pages can use until they empty.
    pub stranded: u64,
    /// Bytes of blocks other threads freed that the owners of their pages
    /// have not collected yet.
    pub uncollected: u64,
}

impl From<&numaweave::stats::NodeStats> for numaweave_node_stats {
    /// Field by field, by name on both sides and with no `..`: a counter
    /// added to `NodeStats` fails to compile here until this struct (and
    /// so `numaweave.h`) has it too.
    fn from(s: &numaweave::stats::NodeStats) -> Self {
        let numaweave::stats::NodeStats {
            reserved,
            committed,
            in_use,
            returned,
            allocs,
            frees,
            remote_frees,
            fallbacks,
            huge_live,
            regions,
            huge_regions,
            huge_fallbacks,
            resident,
            free_resident,
            in_heaps,
            orphaned,
            retained,
            stranded,
            uncollected,
        } = *s;
        numaweave_node_stats {
            reserved,
            committed,
            in_use,
            returned,
            allocs,
            frees,
            remote_frees,
            fallbacks,
            huge_live,
            regions,
            huge_regions,
            huge_fallbacks,
            resident,
            free_resident,
            in_heaps,
            orphaned,
            retained,
            stranded,
            uncollected,
        }
    }
}

/// Fills `out[node]` for every node below `max` (nodes the allocator does
/// not place on read zero); returns the number of node slots the
/// allocator's statistics have (the highest node id plus one).
///
/// # Safety
/// `out` holds `max` writable entries (or is null with `max = 0`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_stats(out: *mut numaweave_node_stats, max: c_int) -> c_int {
    let s = A.stats();
    let top = s.nodes.iter().last().map_or(0, |n| n + 1);
    for n in 0..(max.max(0) as usize).min(s.per_node.len()) {
        // SAFETY: `n < max`, and `out` holds `max` writable entries (the caller's word).
        unsafe { out.add(n).write((&s.per_node[n]).into()) };
    }
    top as c_int
}

/// The statistics table (what `NUMAWEAVE_SHOW_STATS=1` prints at exit) into
/// `buf` with `snprintf`'s contract.
///
/// # Safety
/// `buf` is null or holds `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn numaweave_stats_print(buf: *mut c_char, len: usize) -> usize {
    let t = A.stats().to_string();
    // SAFETY: `buf` is null or holds `len` writable bytes (the caller's word), as
    // `write_text` needs.
    unsafe { write_text(buf, len, &t) }
}

/// Returns free memory to the OS now (as `malloc_trim`).
#[unsafe(no_mangle)]
pub extern "C" fn numaweave_collect() {
    numaweave::trim();
}
