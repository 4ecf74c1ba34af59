//! [`NumaAlloc`]: a general-purpose `GlobalAlloc` with per-node arenas.
//!
//! ```
//! use numaweave::NumaAlloc;
//! # /*
//! #[global_allocator]
//! static A: NumaAlloc = NumaAlloc::new();
//! # */
//! # static A: NumaAlloc = NumaAlloc::new();
//! # use std::alloc::{GlobalAlloc, Layout};
//! # let l = Layout::from_size_align(100, 8).unwrap();
//! # let p = unsafe { A.alloc(l) };
//! # assert!(!p.is_null());
//! # unsafe { A.dealloc(p, l) };
//! ```
//!
//! # How it is built
//!
//! - **Segments** (`segment.rs`): 4 MiB-aligned mappings, bound to their node
//!   with `mbind`, cut into 64 KiB slots. The owner of any pointer (segment,
//!   page, heap, node) is found by masking the pointer: O(1), no lock.
//! - **Arenas** (`arena.rs`): one per node with memory (per-node mode) or one
//!   in all (flat mode). They hand pages to heaps under a spin lock, take empty
//!   pages back, purge free memory with `MADV_DONTNEED` past a threshold, and
//!   keep exited threads' heaps for adoption.
//! - **Heaps** (`heap.rs`): one per thread. Allocation pops the free list of
//!   the class's direct page: 14 instructions on x86-64 for a 64-byte block (a
//!   TLS load, heap → page → block → next, a store, `used` and two counters
//!   incremented in place), no atomic operation, no lock, no node lookup.
//!   Freeing a block of one's own page pushes it back the same way; a block
//!   of another heap's page goes onto that page's lock-free `thread_free`
//!   list, and the owner collects it at its next refill: memory returns to
//!   the heap, and so the node, it came from.
//! - **Placement** (`placement.rs`): what a thread's memory policy means for
//!   a heap's refill (which pages serve, which arena gives a fresh one).
//! - **Interleave** (`interleave/`, `region.rs`): blocks of a page and more
//!   under an interleave, turn by turn, from page-granular node regions.
//! - **Huge blocks** (`huge.rs`): above 256 KiB, or aligned beyond 64 KiB, a
//!   mapping of their own, bound to the allocating thread's node; `realloc`
//!   moves their pages with `mremap` instead of copying.
//!
//! In flat mode, and on a one-node machine in `Auto` mode, nothing on the fast
//! paths differs from per-node mode: the node is consulted only when a heap
//! takes a fresh page.
//!
//! # Limits and failure
//! `alloc` returns null (it never panics or aborts) when the OS refuses
//! memory, for sizes whose mapping would exceed `isize::MAX / 2`, and for
//! alignments above [`MAX_ALIGN`] (1 GiB).

mod checked;
mod config;
mod dealloc;
pub(crate) mod engine;
mod handle;
mod huge;
mod interleave;
mod placement;
mod region;
pub mod stats;
mod usable;

use core::alloc::{GlobalAlloc, Layout};
use core::ptr::{self, NonNull};

use self::engine::{heap, segmap, segment, size_class, types};

use checked::handed_out;
#[cfg(feature = "hardened")]
pub use checked::report_misuse;
pub use config::with_policy;
pub use handle::{ColdHandle, InterleaveHandle, NodeHandle};
pub use huge::MAX_ALIGN;
pub use placement::PolicyGuard;
use placement::Where;
pub use size_class::SMALL_MAX;
use usable::{paged_usable_size, raw_usable_size, usable_size};

/// Where the allocator places its mappings (segments, large blocks,
/// regions) when the address space lets it: 1 TiB to 8 TiB, so that a map
/// of them stays small. A tool reading `/proc/PID/numa_maps` tells the
/// allocator's memory by it (`numaweave numastat`).
///
/// ```
/// let p = Box::new([0u8; 100]);
/// // (The test harness's allocator is the system's: its blocks lie elsewhere.)
/// assert!(!numaweave::alloc::NEAR_RANGE.contains(&(&*p as *const _ as usize)));
/// ```
pub const NEAR_RANGE: core::ops::Range<usize> = segmap::NEAR_RANGE;
pub use config::Config;
pub use types::Mode;

use crate::error::{Error, Result};
use crate::hardened::{self, HARDENED};
use heap::Heap;
use segment::segment_of;
use size_class::class_for;
use types::{SegmentKind, State};

/// The calling thread's heap, made (or adopted) on first use; `None` only
/// when the OS refuses the memory for a heap descriptor.
#[inline]
pub(crate) fn thread_heap(state: &'static State) -> Option<*mut Heap> {
    let h = heap::current();
    if !h.is_null() {
        return Some(h);
    }
    first_heap(state)
}

/// A thread's heap made or adopted (its first, or its first since it
/// exited), the thread's policy state bound to it, and [`first_use`].
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
fn first_heap(state: &'static State) -> Option<*mut Heap> {
    let (h, adopted) = self::engine::lifecycle::init_current(state)?;
    // SAFETY: the calling thread's heap, just made or adopted.
    unsafe { placement::bind_heap(h, adopted) };
    first_use(state);
    Some(h)
}

/// What a thread's first heap, or its first block from the per-CPU caches,
/// brings for the process: the configuration and default placement
/// printed once (`NUMAWEAVE_VERBOSE`), the statistics printer registered
/// at exit (`NUMAWEAVE_SHOW_STATS`). Both may allocate: the thread can.
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
fn first_use(state: &'static State) {
    if state.settle() {
        placement::show_default(state);
    }
    if state.config.show_stats {
        stats::show_at_exit();
    }
}

/// Whether the per-CPU caches serve `class` for the calling thread
/// ([`placement::cpu_serves`]); a thread they start serving now has its
/// [`first_use`].
#[inline]
fn cpu_thread(state: &'static State, class: usize) -> bool {
    let h = heap::current_or_none();
    let on = placement::cpu_serves(h, class);
    if on && h == heap::no_heap() {
        first_use(state);
    }
    on
}

/// A block of `class` on `node` from the calling thread's heap (an
/// allocator handle's, `alloc_on`'s); null when no memory can be had.
pub(crate) fn alloc_on_node(state: &'static State, class: usize, node: usize) -> *mut u8 {
    match thread_heap(state) {
        Some(heap) => placement::alloc_on_node(state, heap, class, node),
        None => ptr::null_mut(),
    }
}

/// The allocator. All values share one process-wide allocator, set up by the
/// first allocation with the configuration of the value that made it (and the
/// `NUMAWEAVE_*` variables, see [`Config`]).
#[derive(Clone, Copy, Debug)]
pub struct NumaAlloc {
    config: Config,
}

impl NumaAlloc {
    /// The allocator with the default [`Config`].
    pub const fn new() -> Self {
        Self { config: Config::new() }
    }

    /// The allocator with `config` (used if this value makes the first
    /// allocation in the process).
    pub const fn with_config(config: Config) -> Self {
        Self { config }
    }

    #[inline]
    fn state(&self) -> &'static State {
        match State::try_get() {
            Some(s) => s,
            None => config::start(&self.config),
        }
    }

    /// The mode in force (after resolving [`Mode::Auto`]).
    pub fn mode(&self) -> Mode {
        self.state().mode
    }

    /// Allocates `layout`, with a typed error instead of null.
    pub fn try_alloc(&self, layout: Layout) -> Result<NonNull<u8>> {
        if layout.align() > MAX_ALIGN || layout.size() > isize::MAX as usize / 2 {
            return Err(Error::LayoutTooLarge { size: layout.size(), align: layout.align() });
        }
        // SAFETY: a valid layout; a zero size is served as one byte.
        let p = unsafe { self.alloc(layout) };
        NonNull::new(p).ok_or(Error::NodeOutOfMemory { node: self.state().topology.current_node() })
    }

    /// Allocates `layout` on `node`'s memory (like the kernel's
    /// `kmalloc_node`): a block of the calling thread's heap pages of that
    /// node, or a huge mapping bound to it. When the node is out of memory
    /// the nearest one serves, counted as a fallback (never in strict
    /// mode). Freed like any block. `Error::InvalidNode` for a node that is
    /// offline, has no memory or is outside `Mems_allowed`.
    ///
    /// ```
    /// # use std::alloc::Layout;
    /// # static A: numaweave::NumaAlloc = numaweave::NumaAlloc::new();
    /// let node = numaweave::Topology::global().current_node();
    /// let p = A.alloc_on(Layout::from_size_align(4096, 4096).unwrap(), node).unwrap();
    /// // SAFETY: a live block of `A`, freed once.
    /// unsafe { A.free(p.as_ptr()) };
    /// ```
    pub fn alloc_on(&self, layout: Layout, node: usize) -> Result<NonNull<u8>> {
        let state = self.state();
        crate::policy::Policy::Preferred(node).validate(state.topology)?;
        let (size, align) = (layout.size(), layout.align());
        if align > MAX_ALIGN || size > isize::MAX as usize / 2 {
            return Err(Error::LayoutTooLarge { size, align });
        }
        let want = padded(size);
        let p = match class_for(want, align) {
            // SAFETY: a block of class `c` just handed out (or null).
            Some(c) => unsafe { heap::realigned(alloc_on_node(state, c, node), c, align) },
            None => huge::alloc_on(state, node, want, align, false),
        };
        // SAFETY: a block just handed out for `size` bytes.
        unsafe { handed_out_for(p, size) };
        NonNull::new(p).ok_or(Error::NodeOutOfMemory { node })
    }

    /// A block of `layout` for cold data: [`alloc_hinted`](Self::alloc_hinted)
    /// with the coldest hint (0).
    pub fn alloc_cold(&self, layout: Layout) -> Result<NonNull<u8>> {
        self.alloc_hinted(layout, 0)
    }

    /// A block of `layout` with a hot/cold hint, as LLVM's memory profiler
    /// gives C++'s hinted `operator new` (0 the coldest, 255 the hottest):
    /// below [`COLD_BELOW`] (128, as tcmalloc reads it) the block is cold,
    /// placed on the lower memory tier nearest the calling thread (the
    /// kernel's memory tiers, else the HMAT's bandwidths or the distances
    /// decide; see [`Topology::lower_tier_nodes`](crate::Topology::lower_tier_nodes)),
    /// on the thread's own node, counted as a fallback, where there is none
    /// or it is out of memory. Either way a cold block lies in a page that
    /// holds cold blocks only: hot and cold data never share a page. A hint
    /// of 128 and more is an ordinary allocation. Freed like any block of
    /// this allocator.
    ///
    /// ```
    /// # use std::alloc::Layout;
    /// static A: numaweave::NumaAlloc = numaweave::NumaAlloc::new();
    /// let l = Layout::from_size_align(256, 8).unwrap();
    /// let (cold, hot) = (A.alloc_hinted(l, 1).unwrap(), A.alloc_hinted(l, 254).unwrap());
    /// let page = |p: std::ptr::NonNull<u8>| p.as_ptr() as usize / 4096;
    /// assert_ne!(page(cold), page(hot));
    /// // SAFETY: live blocks of `A`, each freed once.
    /// unsafe { A.free(cold.as_ptr()); A.free(hot.as_ptr()) };
    /// ```
    pub fn alloc_hinted(&self, layout: Layout, hint: u8) -> Result<NonNull<u8>> {
        if hint >= COLD_BELOW {
            return self.try_alloc(layout);
        }
        let (size, align) = (layout.size(), layout.align());
        if align > MAX_ALIGN || size > isize::MAX as usize / 2 {
            return Err(Error::LayoutTooLarge { size, align });
        }
        let state = self.state();
        let (p, node) = cold_block(state, padded(size), align);
        // SAFETY: a block just handed out for `size` bytes.
        unsafe { handed_out_for(p, size) };
        NonNull::new(p).ok_or(Error::NodeOutOfMemory { node })
    }

    /// The usable size of the block at `p`: at least what was asked for, and
    /// exactly what the allocator set aside. Freeing the block with any size
    /// from the one asked for up to this one (or with none, as C's `free`
    /// does) is the same.
    ///
    /// # Safety
    /// `p` must be a live block of this allocator.
    #[inline]
    pub unsafe fn usable_size(&self, p: *const u8) -> usize {
        // SAFETY: `p` is a live block of this allocator (the caller's word), as
        // `usable_size` asks.
        unsafe { usable_size(p) }
    }

    /// Whether `p` may be a block of this allocator: it lies where a live
    /// segment of its has its blocks (found from the pointer alone, without
    /// reading what it points to). False for null, the stack, statics, and
    /// other allocators' memory; true for any pointer to the start of a live
    /// block. (An interior or already freed pointer of a live small segment
    /// or region is not told apart: a hardened build checks those further.
    /// Of a huge block only its start is ours: the rest of its 4 MiB chunk
    /// may lie past its mapping, in another allocator's.)
    #[inline(always)]
    pub fn owns(&self, p: *const u8) -> bool {
        !p.is_null() && segmap::owns(p)
    }

    /// The C library's `malloc` fast path: a block of `size` bytes (aligned
    /// to 16 above 8 bytes, else to 8: [`malloc_align`]) from the calling
    /// thread's heap if its page of the class has one at hand, else null (nothing was tried that could fail: the
    /// caller goes to its slow path, [`GlobalAlloc::alloc`]). No call is
    /// made, so an `extern "C"` caller needs no stack frame and can reach
    /// its slow path by a tail call.
    ///
    /// # Safety
    /// None beyond `GlobalAlloc::alloc`'s: any `size` is accepted.
    #[doc(hidden)]
    #[inline(always)]
    pub unsafe fn alloc_fast(&self, size: usize) -> *mut u8 {
        // SAFETY: `pop_fast` only asks that `class_of` take sizes 1 to SMALL_MAX, as
        // `class_of_malloc_small` does; any `size` is fine here.
        unsafe { self.pop_fast(size, |s| size_class::class_of_malloc_small(s)) }
    }

    /// C's `malloc` after [`alloc_fast`](Self::alloc_fast) missed: a block
    /// from the per-CPU caches for a thread they serve, else null.
    ///
    /// # Safety
    /// None beyond `GlobalAlloc::alloc`'s: any `size` is accepted.
    #[doc(hidden)]
    #[inline(always)]
    pub unsafe fn alloc_cpu(&self, size: usize) -> *mut u8 {
        // SAFETY: any size is accepted.
        unsafe { placement::cpu_pop_malloc(size) }
    }

    /// [`alloc_fast`](Self::alloc_fast) for C++'s plain `new`: the block
    /// aligned to 16 at every size (`__STDCPP_DEFAULT_NEW_ALIGNMENT__`, which
    /// compilers assume of `new`'s blocks), null when the page has none at
    /// hand, having made no call (the caller reaches its slow path by a
    /// tail call).
    ///
    /// # Safety
    /// None beyond `GlobalAlloc::alloc`'s: any `size` is accepted.
    #[doc(hidden)]
    #[inline(always)]
    pub unsafe fn alloc_fast_new(&self, size: usize) -> *mut u8 {
        // SAFETY: `pop_fast` only asks that `class_of` take sizes 1 to SMALL_MAX, as
        // `class_of_new_small` does; any `size` is fine here.
        unsafe { self.pop_fast(size, |s| size_class::class_of_new_small(s)) }
    }

    /// The fast paths' pop: the head of the calling thread's page of
    /// `class_of(size)`, null when `size` is 0 or past the classes, the
    /// thread has no heap or the page no block at hand.
    ///
    /// # Safety
    /// `class_of` may be called with any size from 1 to [`SMALL_MAX`] (it
    /// is called with no other) and maps it to a class.
    #[inline(always)]
    unsafe fn pop_fast(&self, size: usize, class_of: impl Fn(usize) -> usize) -> *mut u8 {
        // The bound is on the last byte's offset, `size - 1`: a zero size
        // wraps past it to the slow path (where `malloc(0)` is
        // `malloc(1)`), so the class needs no saturating subtraction. A
        // hardened build's bound is 0 under `NUMAWEAVE_CHECK=full` (red
        // zones need the slow path), so one compare tests both; otherwise
        // it is SMALL_MAX (`State`'s start-up sets it), so `class_of` sees
        // no larger size.
        let small = if HARDENED { hardened::fast_size(size) } else { size.wrapping_sub(1) < SMALL_MAX };
        if small {
            let heap = heap::current_or_none();
            // SAFETY: the calling thread's heap or `NO_HEAP`; the class is
            // in range (`small`: nor is the size 0); `NUMAWEAVE_CHECK=full`
            // is off (looked at above).
            return unsafe { Heap::pop_checked_off(heap, class_of(size)) };
        }
        ptr::null_mut()
    }

    /// The C library's `malloc` slow path, after [`alloc_fast`](Self::alloc_fast)
    /// found nothing: for a small size, straight to the refill of the
    /// thread's page of the class, or of its CPU's stack when the per-CPU
    /// caches serve it (popped first: [`alloc_cpu`](Self::alloc_cpu)), as
    /// `alloc` would after the same failed pop; else the general slow path.
    /// Null on failure. Not for a zero size (`alloc_fast` does not pop it).
    ///
    /// # Safety
    /// As `GlobalAlloc::alloc` with `size` bytes aligned to
    /// [`malloc_align`]`(size)`, `size` fitting a `Layout`.
    #[doc(hidden)]
    #[inline(always)]
    pub unsafe fn alloc_miss(&self, size: usize) -> *mut u8 {
        debug_assert!(size != 0, "malloc(0) is malloc(1)");
        if hardened::full() {
            // SAFETY: `size` is not 0 and fits a `Layout` with `malloc_align(size)`, a power
            // of two (the caller's word): a valid layout for `alloc`.
            return unsafe { self.alloc(Layout::from_size_align_unchecked(size, malloc_align(size))) };
        }
        if size <= SMALL_MAX {
            let heap = heap::current_or_none();
            let class = size_class::class_of_malloc(size);
            if heap::is_heap(heap) {
                // SAFETY: the calling thread's heap, whose page of the class
                // has no block at hand (the fast path just looked at the
                // same class).
                return unsafe { placement::refill(heap, class) };
            }
            if heap == heap::cpu_no_heap() && heap::cpu::serves(class) {
                // SAFETY: a class the per-CPU caches serve.
                return unsafe { placement::cpu_alloc_refill(class) };
            }
        }
        // SAFETY: `size` is not 0 and fits a `Layout` aligned to `malloc_align(size)` (the
        // caller's word), which is what `alloc_slow` serves.
        unsafe { self.alloc_slow(size, malloc_align(size), false) }
    }

    /// Frees the block at `p` without its size, as C's `free` does: exact
    /// whatever the block's kind (the size is found from the block).
    ///
    /// # Safety
    /// `p` must be a live block of this allocator.
    #[inline(always)]
    pub unsafe fn free(&self, p: *mut u8) {
        // SAFETY: `p` is a live block of this allocator (the caller's word), as
        // `dealloc::free` asks.
        unsafe { dealloc::free(p) }
    }

    /// C's `free` of a pointer of unknown origin: frees `p` and returns
    /// true if the segment map says it is a block of ours, else returns
    /// false having read nothing of `p` (null included). The map's byte
    /// gives the segment's kind too, so the ownership check costs no load
    /// that [`free`](Self::free) would not make.
    ///
    /// # Safety
    /// If `p` lies in a live segment of ours, it is a live block of this
    /// allocator (a hardened build checks that too).
    #[doc(hidden)]
    #[inline(always)]
    pub unsafe fn free_if_owned(&self, p: *mut u8) -> bool {
        // SAFETY: if `p` lies in a live segment of ours it is a live block of this
        // allocator (the caller's word), which is all `free_if_ours` asks.
        unsafe { dealloc::free_if_ours(p) }
    }

    /// [`free_if_owned`](Self::free_if_owned) for blocks of small segments
    /// only (false for any other pointer, having read nothing of it): C's
    /// `free` tries it first, and the rest out of line.
    ///
    /// # Safety
    /// As [`free_if_owned`](Self::free_if_owned).
    #[doc(hidden)]
    #[inline(always)]
    pub unsafe fn free_if_small(&self, p: *mut u8) -> bool {
        // SAFETY: if `p` lies in a live segment of ours it is a live block of this
        // allocator (the caller's word), which is all `free_if_small` asks.
        unsafe { dealloc::free_if_small(p) }
    }

    /// Resizes the block at `p` to `new_size` bytes without its layout, as
    /// C's `realloc` does: contents kept up to the smaller of the block's
    /// usable size and `new_size`, a moved block aligned as the C library's
    /// `malloc` aligns ([`malloc_align`]); null (with `p` untouched) when
    /// out of memory.
    /// The block's segment is looked at once, for both its size and the
    /// choice between keeping, resizing in place and moving it.
    ///
    /// ```
    /// use core::alloc::{GlobalAlloc, Layout};
    /// use numaweave::NumaAlloc;
    /// static A: NumaAlloc = NumaAlloc::new();
    /// // SAFETY: a live block of `A`, resized once, freed once.
    /// unsafe {
    ///     let p = A.alloc(Layout::from_size_align(24, 8).unwrap());
    ///     assert!(!p.is_null());
    ///     p.write_bytes(7, 24);
    ///     let q = A.realloc_unsized(p, 1000);
    ///     assert!(!q.is_null() && (0..24).all(|i| *q.add(i) == 7));
    ///     A.free(q);
    /// }
    /// ```
    ///
    /// # Safety
    /// `p` must be a live block of this allocator; `new_size` must be
    /// non-zero and, rounded up to 16, at most `isize::MAX`.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub unsafe fn realloc_unsized(&self, p: *mut u8, new_size: usize) -> *mut u8 {
        if hardened::full() {
            // SAFETY: `p` is a live block; `new_size` is non-zero and, rounded up to 16, at
            // most `isize::MAX` (the caller's word). Under `full` `realloc` reads only the
            // layout's alignment, so `old` may stand for its size.
            unsafe {
                let old = usable_size(p);
                return self.realloc(p, Layout::from_size_align_unchecked(old, malloc_align(new_size)), new_size);
            }
        }
        // SAFETY: `p` is a live block of ours; `new_size` is non-zero and, rounded up to 16,
        // at most `isize::MAX` (the caller's word), as `realloc_plain` needs.
        unsafe { self.realloc_plain(p, malloc_align(new_size), None, new_size) }
    }

    /// The node whose arena owns the block at `p` (its segment's node).
    ///
    /// # Safety
    /// `p` must be a live block of this allocator.
    pub unsafe fn node_of(&self, p: *const u8) -> usize {
        // SAFETY: `p` is a live block of this allocator (the caller's word), so
        // its segment header is live.
        usize::from(unsafe { (*segment_of(p)).arena })
    }

    /// Returns every free page of the allocator to the OS now: the calling
    /// thread's cached blocks, kept and empty pages; exited threads' heaps
    /// (their remote frees collected first); every arena's free pages,
    /// empty segments and cached large mappings. Other live threads give
    /// back what they hold free at their next slow path (a thread's heap is
    /// its own). Returns the bytes the OS got back. Slab caches have memory
    /// of their own: [`numaweave::trim`](crate::trim) gives back theirs too
    /// (`malloc_trim(0)`).
    ///
    /// ```
    /// use numaweave::NumaAlloc;
    /// static A: NumaAlloc = NumaAlloc::new();
    /// let v: Vec<Box<[u8; 1000]>> = (0..10_000).map(|_| Box::new([1; 1000])).collect();
    /// drop(v);
    /// A.trim();
    /// let s = A.stats();
    /// assert_eq!(s.nodes.iter().map(|n| s.per_node[n].free_resident).sum::<u64>(), 0);
    /// ```
    pub fn trim(&self) -> u64 {
        let state = self.state();
        let returned = || -> u64 { state.nodes().iter().filter_map(|n| state.arena(n)).map(|a| a.returned()).sum() };
        let before = returned();
        self::engine::lifecycle::trim(state);
        returned().saturating_sub(before)
    }

    /// [`trim`](Self::trim), its figure dropped.
    pub fn collect(&self) {
        self.trim();
    }

    /// Whether per-CPU caches serve small blocks
    /// ([`Config::cpu_cache`](crate::Config::cpu_cache), where glibc
    /// registered rseq and the default policy is local).
    ///
    /// ```
    /// use numaweave::NumaAlloc;
    /// static A: NumaAlloc = NumaAlloc::new();
    /// assert!(!A.cpu_caches() || numaweave::os::rseq::registration().is_some());
    /// ```
    pub fn cpu_caches(&self) -> bool {
        let _ = self.state();
        heap::cpu::get().is_some()
    }

    /// A snapshot of the allocator's statistics.
    pub fn stats(&self) -> stats::Stats {
        stats::Stats::snapshot(self.state())
    }

    /// The size classes' pages on `node`, one entry per class that has any,
    /// smallest blocks first: how many, the bytes of their blocks in use,
    /// and the bytes of free blocks they strand (memory no other class can
    /// take until a page empties: where a program's fragmentation is, by
    /// block size). Empty for a node the allocator has no arena on.
    ///
    /// ```
    /// use numaweave::NumaAlloc;
    /// use std::alloc::{GlobalAlloc, Layout};
    ///
    /// static A: NumaAlloc = NumaAlloc::new();
    /// let l = Layout::from_size_align(512, 8).unwrap();
    /// // SAFETY: a valid layout; each block freed once, with it.
    /// let blocks: Vec<*mut u8> = (0..1000).map(|_| unsafe { A.alloc(l) }).collect();
    /// for p in blocks.iter().step_by(2) {
    ///     // SAFETY: allocated above with `l`, freed once.
    ///     unsafe { A.dealloc(*p, l) };
    /// }
    /// // SAFETY: a block of ours, live.
    /// let node = unsafe { A.node_of(blocks[1]) };
    /// let c = A.class_usage(node).into_iter().find(|c| c.block_size == 512).unwrap();
    /// // (A thread's free cache keeps some for reuse: in use, for their pages.)
    /// assert!(c.stranded > 0 && c.in_use < 1000 * 512, "every other block free: {c:?}");
    /// # for p in blocks.iter().skip(1).step_by(2) { unsafe { A.dealloc(*p, l) } }
    /// ```
    pub fn class_usage(&self, node: usize) -> Vec<stats::ClassUsage> {
        stats::class_usage(self.state(), node).into_iter().filter(|u| u.pages > 0).collect()
    }

    /// Every allocation the fast paths do not serve: a block of `size`
    /// bytes aligned to `align` (zeroed with `zero`), placed by the policy
    /// in force; null when no memory can be had.
    ///
    /// # Safety
    /// `size` is non-zero and `align` a power of two (a `Layout`'s), as
    /// `GlobalAlloc::alloc` asks of its caller.
    #[cold]
    #[inline(never)]
    #[unsafe(link_section = ".text.sorted.numaweave")]
    unsafe fn alloc_slow(&self, size: usize, align: usize, zero: bool) -> *mut u8 {
        let state = self.state();
        // Under a thread interleave, I/O buffers (page-aligned blocks of a
        // page and more, and blocks beyond the size classes) come from its
        // regions turn by turn: through the pool it lends the heap when a
        // page alignment is enough, else directly. See `placement.rs`.
        let p = match placement::place(state, class_for(size, align), size, align) {
            Where::Turn(c, il) => {
                let Some(heap) = thread_heap(state) else { return ptr::null_mut() };
                if align > region::UNIT {
                    il.alloc_block(size, align)
                } else {
                    // SAFETY: the calling thread's heap; `c` is a page class
                    // (a multiple of the page alignment); a block of it just
                    // handed out (a region's is aligned already).
                    unsafe {
                        let p = Heap::pop_loan(heap, c);
                        heap::realigned(if p.is_null() { il.alloc_class(heap, c) } else { p }, c, align)
                    }
                }
            }
            Where::Class(c) if cpu_thread(state, c) => {
                // SAFETY: a class the per-CPU caches serve; the block holds
                // `size` bytes, of class `c`, just handed out.
                unsafe { heap::realigned(placement::cpu_alloc(c), c, align) }
            }
            Where::Class(c) => {
                let Some(heap) = thread_heap(state) else { return ptr::null_mut() };
                // SAFETY: the calling thread's heap; the block holds `size`
                // bytes; a block of class `c` just handed out.
                unsafe { heap::realigned(alloc_class::<true>(heap, c), c, align) }
            }
            Where::Region(il) => il.alloc_block(size, align),
            // Fresh huge mappings are zero already: zeroed inside if reused.
            Where::Node(node) => {
                let p = huge::alloc_on(state, node, size, align, zero);
                if HARDENED {
                    // SAFETY: a block just handed out.
                    unsafe { handed_out(p) };
                }
                return p;
            }
        };
        if HARDENED {
            // SAFETY: a block just handed out.
            unsafe { handed_out(p) };
        }
        if zero && !p.is_null() {
            // SAFETY: a block of at least `size` bytes.
            unsafe { ptr::write_bytes(p, 0, size) };
        }
        p
    }
}

impl Default for NumaAlloc {
    fn default() -> Self {
        Self::new()
    }
}

/// A block of class `class` from the calling thread's heap: the fast path,
/// else a refill under the thread's policy.
///
/// With `LOOK_FULL` false the pop does not look at `NUMAWEAVE_CHECK=full`
/// (a hardened build's caller found it off).
///
/// # Safety
/// `heap` is the calling thread's heap; `class < CLASSES`; `full` is off
/// unless `LOOK_FULL`.
#[inline(always)]
unsafe fn alloc_class<const LOOK_FULL: bool>(heap: *mut Heap, class: usize) -> *mut u8 {
    // SAFETY: `heap` is the calling thread's heap and `class < CLASSES` (the
    // caller's word), as the pops ask; `full` is off unless `LOOK_FULL`, as
    // `pop_as::<false>` asks.
    unsafe {
        let p = Heap::pop_as::<LOOK_FULL>(heap, class);
        if !p.is_null() {
            return p;
        }
        placement::refill(heap, class)
    }
}

/// [`NumaAlloc::alloc_paged`]'s miss for a thread with a heap,
/// or one the per-CPU caches serve (`CPU_NO_HEAP`): the heap's refill,
/// the caches, or (a class beyond the caches, no heap yet) the slow
/// path. Out of line, so that the fast path tests one slot value; its
/// arguments in that order, so that the size and alignment stay in the
/// registers they came in (`__rust_alloc`'s, with no move ahead of its pop).
///
/// # Safety
/// `heap` is the calling thread's slot value, not `NO_HEAP`; `class`
/// is the class of `size` bytes aligned to `align`, a valid layout.
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
unsafe fn refill_or_cpu(size: usize, align: usize, heap: *mut Heap, class: usize, a: &NumaAlloc) -> *mut u8 {
    // SAFETY: the caller's word: the thread's heap, whose page of the
    // class has no block at hand; a class the caches serve; else a valid
    // layout for the slow path.
    unsafe {
        if heap != heap::cpu_no_heap() {
            return placement::refill(heap, class);
        }
        if heap::cpu::serves(class) {
            return placement::cpu_alloc(class);
        }
        a.alloc_slow(size, align, false)
    }
}

/// The bytes to set aside for a block of `size` bytes asked by an explicit
/// API (a hardened build under `NUMAWEAVE_CHECK=full` adds a red zone).
#[inline(always)]
pub(crate) fn padded(size: usize) -> usize {
    if hardened::full() {
        return size + hardened::PAD;
    }
    size
}

/// Hints below this are cold ([`NumaAlloc::alloc_hinted`], the hinted
/// `operator new` of the C library): tcmalloc's reading of LLVM's
/// `__hot_cold_t`, whose defaults are 1 for cold, 128 for not cold and 254
/// for hot.
pub const COLD_BELOW: u8 = 128;

/// A cold block of `size` bytes aligned to `align`, and the node it was
/// placed for: on the lower tier nearest the calling thread (its own node,
/// a fallback counted, where there is none), from that node's heap of cold
/// blocks (`heap/shared.rs`), or a mapping of its own beyond the classes.
/// Null when no memory can be had.
pub(crate) fn cold_block(state: &'static State, size: usize, align: usize) -> (*mut u8, usize) {
    let node = placement::cold_node(state, state.topology.current_node());
    let p = match class_for(size, align) {
        // SAFETY: `class_for` gives a class below CLASSES; the block is one
        // of class `c` just handed out (or null), what `realigned` takes.
        Some(c) => unsafe { heap::realigned(Heap::alloc_cold(state, node, c), c, align) },
        None => huge::alloc_on(state, node, size, align, false),
    };
    (p, node)
}

/// A block of an explicit API just handed out for `size` bytes (asked for
/// [`padded`]`(size)`): in hardened builds its freed mark cleared and, under
/// `NUMAWEAVE_CHECK=full`, its red zone set. Nothing otherwise.
///
/// # Safety
/// `p` is null or such a block.
#[inline(always)]
pub(crate) unsafe fn handed_out_for(p: *mut u8, size: usize) {
    if HARDENED {
        // SAFETY: `p` is null or a block of this allocator just handed out
        // for `size` bytes (the caller's word).
        unsafe {
            checked::handed_out(p);
            if hardened::full() && !p.is_null() {
                hardened::set_red_zone(p, size, raw_usable_size(p));
            }
        }
    }
}

/// `NUMAWEAVE_CHECK=full`: `layout` with the red zone's bytes more; the
/// block gets its red zone.
///
/// # Safety
/// As `GlobalAlloc::alloc` (`alloc_zeroed` with `zero`).
#[cold]
#[inline(never)]
unsafe fn alloc_red_zoned(a: &NumaAlloc, layout: Layout, zero: bool) -> *mut u8 {
    let Some(size) = layout.size().checked_add(hardened::PAD) else { return ptr::null_mut() };
    // The padded size must not lose the alignment the size class of the
    // plain size gives (C's malloc relies on it: 16 for a multiple of 16).
    let align = if layout.size().is_multiple_of(size_class::CLASS_ALIGN) {
        layout.align().max(size_class::CLASS_ALIGN)
    } else {
        layout.align()
    };
    let Ok(padded) = Layout::from_size_align(size, align) else { return ptr::null_mut() };
    // SAFETY: a valid layout; the block is ours until returned.
    unsafe {
        let p = if zero { a.alloc_slow(size, padded.align(), true) } else { a.alloc_plain(padded) };
        if !p.is_null() {
            hardened::set_red_zone(p, layout.size(), raw_usable_size(p));
        }
        p
    }
}

// SAFETY: blocks are disjoint (each is on at most one free list or handed out
// once), aligned as asked (size classes whose size is a multiple of the
// alignment, from 64 KiB-aligned pages; region blocks on page boundaries and
// aligned starts; huge blocks placed at aligned offsets), and null is
// returned on every failure.
unsafe impl GlobalAlloc for NumaAlloc {
    #[cfg_attr(not(feature = "hardened"), inline)]
    #[cfg_attr(feature = "hardened", inline(always))]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // A small size under the fast bound answers "switches read, `full`
        // off" in one compare: its pop need not look at `full` again. Only
        // the others ask.
        if HARDENED {
            if hardened::fast_size(layout.size()) {
                // SAFETY: `layout` is `GlobalAlloc::alloc`'s, non-zero in size (its caller's
                // word), and `fast_size` found it at most SMALL_MAX with `full` off, as
                // `alloc_checked_off` asks.
                return unsafe { self.alloc_checked_off(layout) };
            }
            if hardened::full() {
                // SAFETY: `layout` has a non-zero size, as `GlobalAlloc::alloc` requires of its
                // caller; forwarded unchanged.
                return unsafe { alloc_red_zoned(self, layout, false) };
            }
        }
        // SAFETY: `layout` has a non-zero size, as `GlobalAlloc::alloc` requires of its
        // caller; forwarded unchanged.
        unsafe { self.alloc_plain(layout) }
    }

    #[cfg_attr(not(feature = "hardened"), inline)]
    #[cfg_attr(feature = "hardened", inline(always))]
    unsafe fn dealloc(&self, p: *mut u8, _layout: Layout) {
        // SAFETY: `p` is a block this allocator handed out and not freed since, as
        // `GlobalAlloc::dealloc` requires of its caller: what `dealloc::free` asks.
        unsafe { dealloc::free(p) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if hardened::full() {
            // SAFETY: `layout` has a non-zero size, as `GlobalAlloc::alloc_zeroed` requires
            // of its caller; forwarded unchanged.
            return unsafe { alloc_red_zoned(self, layout, true) };
        }
        // Small blocks are cleared; fresh huge mappings are zero already.
        // SAFETY: `layout` is valid with a non-zero size (`GlobalAlloc::alloc_zeroed`'s
        // contract), so its size and alignment are what `alloc_slow` serves.
        unsafe { self.alloc_slow(layout.size(), layout.align(), true) }
    }

    #[unsafe(link_section = ".text.sorted.numaweave")]
    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if hardened::full() {
            // Every size change moves the block: its red zone follows the size.
            // SAFETY: `p` is a live block of `layout`; `new_size` is non-zero and, rounded up
            // to `layout.align()`, at most `isize::MAX` (`GlobalAlloc::realloc`'s contract),
            // so the new layout is valid.
            unsafe {
                let q = self.alloc(Layout::from_size_align_unchecked(new_size, layout.align()));
                if !q.is_null() {
                    ptr::copy_nonoverlapping(p, q, usable_size(p).min(new_size));
                    dealloc::free(p);
                }
                return q;
            }
        }
        // SAFETY: `p` is a live block of `layout`; `new_size` is non-zero and, rounded up
        // to its alignment, at most `isize::MAX` (`GlobalAlloc::realloc`'s contract).
        unsafe { self.realloc_plain(p, layout.align(), Some(layout.size()), new_size) }
    }
}

impl NumaAlloc {
    /// `GlobalAlloc::alloc` without a red zone. (`#[inline]`, not
    /// `always`: so the default build's `malloc` is the very code it was
    /// before the hardened build shared this; the hardened one needs it
    /// inlined.)
    ///
    /// # Safety
    /// As `GlobalAlloc::alloc`: `layout`'s size is non-zero.
    #[cfg_attr(not(feature = "hardened"), inline)]
    #[cfg_attr(feature = "hardened", inline(always))]
    unsafe fn alloc_plain(&self, layout: Layout) -> *mut u8 {
        // `size - 1` against the bound: a zero size (which `GlobalAlloc`
        // callers may not pass, C's `alloc` never does) wraps past it to
        // the slow path, so the class needs no saturating subtraction.
        // SAFETY: `layout` is as `GlobalAlloc::alloc` takes it (non-zero in size, its
        // caller's word), as `alloc_paged` asks.
        unsafe { self.alloc_paged::<true>(layout, layout.size().wrapping_sub(1) < SMALL_MAX) }
    }

    /// A hardened build's `GlobalAlloc::alloc` of a small size with
    /// `NUMAWEAVE_CHECK=full` off (the caller looked): [`alloc_plain`]
    /// whose pop does not look again. Always inlined, as the default
    /// build's `alloc` is in practice: left to LLVM, the hardened one was
    /// kept out of line in a standalone copy of the criterion churn, with a
    /// stack frame and the switch tested twice (1.48× the default build's
    /// time there; 1.33× inlined).
    ///
    /// # Safety
    /// As `GlobalAlloc::alloc`; `layout.size() <= SMALL_MAX`.
    #[inline(always)]
    unsafe fn alloc_checked_off(&self, layout: Layout) -> *mut u8 {
        debug_assert!(layout.size() <= SMALL_MAX && !hardened::full());
        // SAFETY: `layout` is as `GlobalAlloc::alloc` takes it and at most SMALL_MAX (the
        // caller's word), so `small`; `full` is off, as `LOOK_FULL = false` needs.
        unsafe { self.alloc_paged::<false>(layout, true) }
    }

    /// A block for `layout` from the calling thread's heap when `small` (the
    /// size is at most [`SMALL_MAX`]), its alignment a class's and the thread
    /// has a heap, else from the slow path. `LOOK_FULL`: whether the pop
    /// looks at `NUMAWEAVE_CHECK=full` (hardened builds; false only where
    /// the caller found it off).
    ///
    /// # Safety
    /// As `GlobalAlloc::alloc`: `layout`'s size is non-zero; and `small`
    /// only if that size is at most [`SMALL_MAX`] (the class indexes a
    /// table unchecked).
    #[inline(always)]
    unsafe fn alloc_paged<const LOOK_FULL: bool>(&self, layout: Layout, small: bool) -> *mut u8 {
        let (size, align) = (layout.size(), layout.align());
        if align <= size_class::CLASS_ALIGN && small {
            let heap = heap::current_or_none();
            let class = size_class::class_of_aligned_nonzero(size, align);
            // SAFETY: the calling thread's heap or `NO_HEAP`; the class is
            // in range (`small`, which a zero size is not: see
            // `alloc_plain` and `hardened::fast_size`); `full` is off
            // unless `LOOK_FULL`.
            let p = unsafe { Heap::pop_as::<LOOK_FULL>(heap, class) };
            if !p.is_null() {
                return p;
            }
            if heap != heap::no_heap() {
                // SAFETY: the calling thread's heap (or the per-CPU caches'
                // mark), whose page of the class has no block at hand.
                return unsafe { refill_or_cpu(size, align, heap, class, self) };
            }
        }
        // SAFETY: same contract.
        unsafe { self.alloc_slow(size, align, false) }
    }

    /// `GlobalAlloc::realloc` without red zones, for a block whose size is
    /// `old_size` where the caller knows it, its usable size where not (C).
    ///
    /// # Safety
    /// `p` is a live block of this allocator, given up to this call;
    /// `align` a power of two and `new_size` non-zero, together a valid
    /// `Layout`; `old_size`, if given, the size the block was asked with.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    unsafe fn realloc_plain(&self, p: *mut u8, align: usize, old_size: Option<usize>, new_size: usize) -> *mut u8 {
        let seg = segment_of(p);
        // SAFETY: `p` is a live block (caller's contract).
        unsafe {
            let usable = match (*seg).kind {
                kind @ (SegmentKind::Small | SegmentKind::Region) => {
                    // (Never under `NUMAWEAVE_CHECK=full`: the whole block
                    // is the caller's.)
                    let usable = paged_usable_size(seg, kind, p);
                    // Keep the block if the new size fits and would not waste
                    // over half of it (shrinking to a much smaller class
                    // frees memory).
                    if new_size <= usable && (new_size >= usable / 2 || usable <= 64) && new_size <= SMALL_MAX {
                        return p;
                    }
                    usable
                }
                SegmentKind::Huge => {
                    let state = if new_size > SMALL_MAX { State::try_get() } else { None };
                    if let Some(state) = state {
                        let q = huge::realloc(state, p, align, new_size);
                        if !q.is_null() {
                            return q;
                        }
                    }
                    match old_size {
                        Some(size) => size,
                        None => huge::usable_size(seg, p),
                    }
                }
            };
            debug_assert!(old_size.is_none_or(|size| size <= usable));
            // SAFETY: `new_size` with the old alignment is a valid layout per
            // the GlobalAlloc contract.
            let new_layout = Layout::from_size_align_unchecked(new_size, align);
            let q = self.alloc(new_layout);
            if !q.is_null() {
                ptr::copy_nonoverlapping(p, q, old_size.unwrap_or(usable).min(new_size));
                dealloc::free(p);
            }
            q
        }
    }
}

/// The alignment C's `malloc` gives a block of `size` bytes: 16 above 8
/// bytes (`alignof(max_align_t)` on x86-64; C23 asks it of any block that an
/// object of that alignment fits), else 8. Every C entry point aligns at
/// least this much.
///
/// ```
/// assert_eq!(numaweave::alloc::malloc_align(8), 8);
/// assert_eq!(numaweave::alloc::malloc_align(24), 16);
/// ```
#[inline(always)]
pub const fn malloc_align(size: usize) -> usize {
    if size > size_class::MIN_BLOCK { 16 } else { size_class::MIN_BLOCK }
}
