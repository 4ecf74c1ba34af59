//! Per-node arenas: each owns the segments bound to its node, hands pages to
//! heaps, takes empty pages back, returns memory to the OS past a threshold,
//! and keeps the heaps of exited threads for new threads to adopt.
//!
//! Everything here is a slow path, under the arena's spin lock: a thread comes
//! here once per page (64 – 256 KiB of blocks), not per block.

use core::ptr::{self, NonNull};

use super::heap::Heap;
use super::segment::{Page, SEGMENT_SIZE, SLOT_SIZE, SLOTS, Segment, SegmentKind, SmallSegment};
use super::size_class::{class_size, page_slots};
use super::state::{Mode, State};
use crate::os::mem::{self, BindFlags, MemPolicy};
use crate::sync::{AtomicU64, Ordering, SpinLock};
use crate::topology::NodeSet;

/// Counters of one arena, written under its lock or with single atomic adds.
#[derive(Default)]
pub(crate) struct ArenaCounters {
    /// Address space mapped (segments and huge blocks).
    pub(crate) reserved: AtomicU64,
    /// Memory returned to the OS with `MADV_DONTNEED` (cumulative).
    pub(crate) purged: AtomicU64,
    /// Pages' bytes currently handed to heaps.
    pub(crate) pages_in_use: AtomicU64,
    /// Free page bytes still committed (not yet purged).
    pub(crate) dirty: AtomicU64,
    /// Segments this arena's heaps had to take from another node.
    pub(crate) fallbacks: AtomicU64,
    /// Huge blocks live, and their bytes.
    pub(crate) huge_live: AtomicU64,
    pub(crate) huge_bytes: AtomicU64,
    pub(crate) huge_allocs: AtomicU64,
    pub(crate) huge_frees: AtomicU64,
    /// Bump regions (interleave, per-call handles) mapped and not yet released.
    pub(crate) region_live: AtomicU64,
    /// Regions mapped on hugetlb pages, and those that asked and got base
    /// pages (the node's pool was short) (cumulative).
    pub(crate) huge_regions: AtomicU64,
    pub(crate) huge_fallbacks: AtomicU64,
}

pub(crate) struct ArenaInner {
    /// Segments with at least one free slot first; all segments are listed.
    segments: *mut SmallSegment,
    /// Heaps of exited threads, for adoption (linked through `Heap::next_orphan`).
    pub(crate) orphans: *mut Heap,
    /// Set when this node was found out of memory; segment requests go to
    /// the nearest node until it counts down.
    exhausted: u32,
    /// Freed segment-aligned mappings (huge blocks', dead regions') kept for
    /// reuse, newest first, linked through a header in their own first page;
    /// their pages stay committed on this node. Their count and bytes.
    cached: *mut Cached,
    cached_count: usize,
    cached_bytes: usize,
    /// The earliest time (ms, monotonic) a segment's free pages or a cached
    /// mapping is due to go back to the OS; 0: none waiting.
    purge_at: u64,
    /// The delay in force is the configured one shifted left by this: see
    /// [`note_reuse`].
    delay_shift: u32,
    /// When the shift last rose, and when purged pages were last taken back
    /// within the delay (ms, monotonic).
    raised_at: u64,
    early_at: u64,
}

/// The purge delay grows to at most this many doublings of the configured
/// one (100 ms: 1.6 s; jemalloc decays over 10 s).
const MAX_DELAY_SHIFT: u32 = 4;

/// A raised delay halves after this many delays (a power of two) with no
/// purged page taken back early.
const DELAY_DECAY: u64 = 16;

/// A cached mapping's own description, in its first bytes.
#[repr(C)]
struct Cached {
    next: *mut Cached,
    len: usize,
    /// When it was freed (ms), for the purge delay.
    freed_at: u64,
}

/// Without a purge delay (the behaviour before it): at most this many
/// cached mappings, and `purge_threshold` bytes of them.
/// Empty segments an arena keeps mapped past the purge delay (their pages
/// purged); more are unmapped. An explicit purge keeps one.
const KEPT_EMPTY: usize = 4;
const CACHED_MAX: usize = 8;

/// With a purge delay: the bytes of cached mappings an arena keeps, as a
/// multiple of `purge_threshold` (64 MiB by default): a program that
/// allocates and frees large buffers (5–25 MB) reuses their pages, as glibc
/// does once its mmap threshold has risen.
const CACHED_BYTES_FACTOR: usize = 8;

// SAFETY: the raw pointers are owned by the arena and only used under its lock.
unsafe impl Send for ArenaInner {}

pub(crate) struct Arena {
    /// Logical node (index in `State::arenas`).
    pub(crate) node: usize,
    /// Kernel node to bind to, or `None` (flat mode: first touch decides).
    pub(crate) bind_to: Option<usize>,
    pub(crate) inner: SpinLock<ArenaInner>,
    pub(crate) counters: ArenaCounters,
}

impl Arena {
    pub(crate) const fn new(node: usize, bind_to: Option<usize>) -> Self {
        Self {
            node,
            bind_to,
            inner: SpinLock::new(ArenaInner {
                segments: ptr::null_mut(),
                orphans: ptr::null_mut(),
                exhausted: 0,
                cached: ptr::null_mut(),
                cached_count: 0,
                cached_bytes: 0,
                purge_at: 0,
                delay_shift: 0,
                raised_at: 0,
                early_at: 0,
            }),
            counters: ArenaCounters {
                reserved: AtomicU64::new(0),
                purged: AtomicU64::new(0),
                pages_in_use: AtomicU64::new(0),
                dirty: AtomicU64::new(0),
                fallbacks: AtomicU64::new(0),
                huge_live: AtomicU64::new(0),
                huge_bytes: AtomicU64::new(0),
                huge_allocs: AtomicU64::new(0),
                huge_frees: AtomicU64::new(0),
                huge_regions: AtomicU64::new(0),
                huge_fallbacks: AtomicU64::new(0),
                region_live: AtomicU64::new(0),
            },
        }
    }

    /// The kernel policy for this arena's mappings.
    pub(crate) fn policy(&self, state: &State) -> MemPolicy {
        match self.bind_to {
            None => MemPolicy::Default,
            Some(p) if state.config.strict => MemPolicy::Bind(NodeSet::single(p)),
            Some(p) => MemPolicy::Preferred(p),
        }
    }

    /// Whether the node looked out of memory at its last attempt (a racy
    /// hint, for policies deciding whether a fallback page may serve).
    pub(crate) fn is_exhausted(&self) -> bool {
        self.inner.lock().exhausted > 0
    }

    /// A fresh page of class `class` for `heap`, from this arena or, when its
    /// node is out of memory, from the nearest one that is not (within
    /// `within`, when given: a `Bind` policy's set).
    pub(crate) fn alloc_page(
        &self,
        state: &State,
        class: usize,
        heap: *mut Heap,
        within: Option<NodeSet>,
    ) -> Option<NonNull<Page>> {
        let slots = page_slots(class);
        let exhausted = {
            let mut g = self.inner.lock();
            if let Some(now) = delay_clock(state) {
                self.purge_expired(state, &mut g, now);
            }
            if let Some(p) = take_slots(&mut g, slots, &self.counters, state) {
                drop(g);
                return Some(init_page(p, class, heap));
            }
            let e = g.exhausted > 0;
            if e {
                g.exhausted -= 1;
            }
            e
        };
        if !exhausted && let Some(p) = self.map_and_take(state, class, heap) {
            return Some(p);
        }
        self.fallback_page(state, class, heap, within)
    }

    fn fallback_page(
        &self,
        state: &State,
        class: usize,
        heap: *mut Heap,
        within: Option<NodeSet>,
    ) -> Option<NonNull<Page>> {
        if state.config.strict || state.mode == Mode::Flat {
            return None;
        }
        for n in state.topology.nodes_by_distance(self.node).skip(1) {
            if within.is_some_and(|w| !w.contains(n)) {
                continue;
            }
            let Some(other) = state.arena(n) else { continue };
            if other.node == self.node {
                continue;
            }
            let taken = {
                let mut g = other.inner.lock();
                if g.exhausted > 0 {
                    continue;
                }
                take_slots(&mut g, page_slots(class), &other.counters, state)
            };
            let page = match taken {
                Some(p) => Some(init_page(p, class, heap)),
                None => other.map_and_take(state, class, heap),
            };
            if page.is_some() {
                self.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
                return page;
            }
        }
        None
    }

    /// Maps a segment (outside the lock: `mmap` and `mbind` take a while),
    /// links it, and takes a page from it.
    #[unsafe(link_section = ".text.hot.numaweave")]
    fn map_and_take(&self, state: &State, class: usize, heap: *mut Heap) -> Option<NonNull<Page>> {
        let seg = self.map_segment(state)?;
        let mut g = self.inner.lock();
        // SAFETY: a fresh segment, ours alone until linked.
        unsafe { (*seg.as_ptr()).seg.next = g.segments };
        g.segments = seg.as_ptr();
        let p = take_slots(&mut g, page_slots(class), &self.counters, state);
        drop(g);
        p.map(|p| init_page(p, class, heap))
    }

    /// A fresh segment-aligned mapping of `len` bytes under this arena's
    /// policy; `None` when the OS refuses the mapping, or the binding in
    /// strict mode (nothing is left mapped).
    ///
    /// The kernel refuses to bind to a node the process may no longer use
    /// (a container's `cpuset.mems` narrowed under it, a node gone
    /// offline). Not strict, the mapping then keeps the default policy: its
    /// pages come from the nearest node the process may use, and the
    /// callers see the spill ([`spilled`](Self::spilled)) and count it as a
    /// fallback, as when the node is full. Widened again, the node binds as
    /// before.
    #[unsafe(link_section = ".text.hot.numaweave")]
    pub(crate) fn map_bound(&self, state: &State, len: usize) -> Option<NonNull<u8>> {
        let guard = guard_len();
        let base = mem::map_aligned(len + guard, SEGMENT_SIZE).ok()?;
        let policy = self.policy(state);
        if policy != MemPolicy::Default
            // SAFETY: our fresh, segment-aligned mapping.
            && unsafe { mem::bind(base, len, policy, BindFlags::NONE) }.is_err()
            && state.config.strict
        {
            // SAFETY: ours, unused.
            let _ = unsafe { mem::unmap(base, len + guard) };
            return None;
        }
        if guard > 0 {
            // SAFETY: the last page of our fresh mapping, past `len`.
            let _ = unsafe { mem::protect_none(NonNull::new_unchecked(base.as_ptr().add(len)), guard) };
        }
        Some(base)
    }

    /// A fresh segment-aligned mapping of `len` bytes (whole huge pages) from
    /// the hugetlb pool under this arena's policy, committed now and checked
    /// to be on the arena's node (a node whose pool is short would be served
    /// from another's); `None` when the pool has too few pages or they are
    /// elsewhere (nothing is left mapped). No guard page: it would cost a
    /// whole huge page.
    pub(crate) fn map_hugetlb_bound(&self, state: &State, len: usize) -> Option<NonNull<u8>> {
        debug_assert!(len <= SEGMENT_SIZE && len.is_multiple_of(mem::HUGE_PAGE));
        mem::map_hugetlb_on(len, SEGMENT_SIZE, mem::HUGE_PAGE, self.policy(state), self.bind_to).ok()
    }

    /// Maps, binds and initialises a small segment; `None` when the OS has no
    /// memory or (per-node mode) the node turned out to be full.
    fn map_segment(&self, state: &State) -> Option<NonNull<SmallSegment>> {
        let base = self.map_bound(state, SEGMENT_SIZE)?;
        // With THP set to `always`, the first touch of the header, or of any
        // page (64 - 256 KiB), would commit the whole 2 MiB huge page around
        // it, holding pages that may never be used: the segment opts out.
        // Failure (THP not built in) is harmless.
        // SAFETY: our fresh mapping.
        let _ = unsafe { mem::set_hugepages(base, SEGMENT_SIZE, false) };
        let seg = base.as_ptr().cast::<SmallSegment>();
        // SAFETY: the header fits slot 0 (checked at compile time); the
        // mapping is zeroed, so only non-zero fields need writing. This first
        // touch commits the header page under the arena's policy.
        unsafe {
            ptr::addr_of_mut!((*seg).seg).write(Segment::new(
                SegmentKind::Small,
                self.node,
                base.as_ptr(),
                SEGMENT_SIZE + guard_len(),
            ));
            (*seg).free_slots = !1u64; // slot 0 is the header
            (*seg).dirty_slots = 0;
            for i in 0..SLOTS {
                ptr::addr_of_mut!((*seg).pages[i]).write(Page::empty());
            }
        }
        // One query per 4 MiB segment: if the node was full, treat it as
        // exhausted and let the caller take the nearest node's memory.
        if self.spilled(state, base) {
            self.inner.lock().exhausted = 64;
            // SAFETY: ours, unused.
            let _ = unsafe { mem::unmap(base, SEGMENT_SIZE + guard_len()) };
            return None;
        }
        self.counters.reserved.fetch_add(SEGMENT_SIZE as u64, Ordering::Relaxed);
        super::segmap::insert(base.as_ptr(), super::segment::SegmentKind::Small);
        // SAFETY: non-null mapping.
        Some(unsafe { NonNull::new_unchecked(seg) })
    }

    /// Whether the just-touched first page of a fresh mapping of this arena
    /// landed on another node: preferred binding falls back silently when the
    /// node is full. Only asked where it can happen (per-node mode on several
    /// nodes, not strict).
    pub(crate) fn spilled(&self, state: &State, base: NonNull<u8>) -> bool {
        match self.bind_to {
            Some(phys) if state.multi_node && !state.config.strict => {
                mem::page_node(base.as_ptr()).is_ok_and(|n| n.is_some_and(|n| n != phys))
            }
            _ => false,
        }
    }

    /// Takes back an empty page (its heap has let go of it), and purges free
    /// memory once more than the configured threshold has piled up.
    ///
    /// # Safety
    /// `page` must be a page of one of this arena's segments, with no live block
    /// and no heap referring to it.
    pub(crate) unsafe fn free_page(&self, state: &State, page: *mut Page) {
        // SAFETY: `page` is a page of this arena's segments, empty and
        // unreferenced (the caller's word): its segment header is live and the
        // page's slots are ours to return.
        let (seg, first, slots) = unsafe {
            let seg = super::segment::segment_of((*page).info.start) as *mut SmallSegment;
            ((seg), (*page).info.first_slot as usize, (*page).info.slots as usize)
        };
        let mask = slot_mask(first, slots);
        let bytes = (slots * SLOT_SIZE) as u64;
        let mut g = self.inner.lock();
        // SAFETY: segment fields are guarded by the arena lock.
        unsafe {
            debug_assert_eq!((*seg).seg.kind, SegmentKind::Small);
            debug_assert_eq!(usize::from((*seg).seg.arena), self.node, "a page freed to another node's arena");
            debug_assert_eq!((*seg).free_slots & mask, 0, "a page freed twice");
            debug_assert_eq!((*page).used, 0);
            (*page).info.heap.store(ptr::null_mut(), Ordering::Relaxed);
            // A free into the page now fails the hardened free's bound.
            #[cfg(feature = "hardened")]
            {
                (*page).info.span = 0;
            }
            (*seg).free_slots |= mask;
            (*seg).dirty_slots |= mask;
        }
        self.counters.pages_in_use.fetch_sub(bytes, Ordering::Relaxed);
        let dirty = self.counters.dirty.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if g.exhausted > 0 {
            // Memory came back: give the home node another chance.
            g.exhausted = 0;
        }
        // With a delay, the threshold bounds what waits (times the factor
        // cached mappings get): a burst of frees past the threshold alone
        // (a garbage collector's sweep) is taken again moments later.
        let now = delay_clock(state);
        let bound = match now {
            Some(_) => state.config.purge_threshold.saturating_mul(CACHED_BYTES_FACTOR),
            None => state.config.purge_threshold,
        };
        if dirty as usize > bound {
            self.purge(&mut g);
        } else if let Some(now) = now {
            // SAFETY: segment fields are guarded by the arena lock.
            unsafe {
                (&mut (*seg).freed_at)[first..first + slots].fill(now);
                if (*seg).purge_at == 0 {
                    (*seg).purge_at = now + delay_of(state, &g);
                    g.purge_at = soonest(g.purge_at, (*seg).purge_at);
                }
            }
            self.purge_expired(state, &mut g, now);
        }
    }

    /// With a purge delay: returns to the OS the free pages of segments and
    /// the cached mappings that have stayed unused for the delay (on the
    /// allocator's slow paths: page hand-out and return, thread exit,
    /// `collect`; there is no thread or timer of its own).
    #[unsafe(link_section = ".text.hot.numaweave")]
    fn purge_expired(&self, state: &State, g: &mut ArenaInner, now: u64) {
        if g.delay_shift > 0 && now >= g.early_at + delay_of(state, g) * DELAY_DECAY {
            // Quiet for a long while: give memory back sooner again.
            g.delay_shift -= 1;
            g.early_at = now;
        }
        if g.purge_at == 0 || now < g.purge_at {
            return;
        }
        let delay = delay_of(state, g);
        let mut next = 0;
        // Empty segments kept mapped (their pages purged): a program
        // that frees a burst and allocates again (a garbage collector's
        // sweep) finds them without a `mmap` and a fault per page.
        let mut kept_empty = 0;
        let mut link: *mut *mut SmallSegment = &mut g.segments;
        // SAFETY: the list and its segments are guarded by the lock we hold.
        unsafe {
            while !(*link).is_null() {
                let seg = *link;
                let due = (*seg).purge_at;
                if due != 0 && due <= now {
                    // Only the slots unused for the whole delay: in a
                    // steady churn pages empty and fill again all the time,
                    // and purging the ones freed a moment before the round
                    // faulted them in again moments later (twice mimalloc's
                    // page faults).
                    let (old, young_due) = aged_slots(&*seg, now, delay);
                    if (*seg).free_slots == !1u64 && young_due == 0 && kept_empty >= KEPT_EMPTY {
                        *link = (*seg).seg.next;
                        self.unmap_segment(seg);
                        continue;
                    }
                    // At once (`MADV_DONTNEED`), not lazily: a lazily freed
                    // page stays resident until the kernel is short of
                    // memory, so the delay would bound nothing a program's
                    // peak RSS shows.
                    self.decommit_slots(seg, old);
                    (*seg).purged_slots |= old;
                    for s in slots_in(old) {
                        (*seg).freed_at[s] = now;
                    }
                    if young_due != 0 {
                        (*seg).purge_at = young_due;
                        next = soonest(next, young_due);
                    }
                } else if due != 0 {
                    next = soonest(next, due);
                }
                kept_empty += usize::from((*seg).free_slots == !1u64);
                link = &mut (*seg).seg.next;
            }
        }
        // Cached mappings, oldest last: drop the expired tail.
        let mut link: *mut *mut Cached = &mut g.cached;
        // SAFETY: cached mappings are ours, described in their first bytes.
        unsafe {
            while !(*link).is_null() {
                let c = *link;
                if (*c).freed_at + delay <= now {
                    *link = ptr::null_mut();
                    self.unmap_cached(g, c);
                    break;
                }
                next = soonest(next, (*c).freed_at + delay);
                link = &mut (*c).next;
            }
        }
        g.purge_at = next;
    }

    /// Returns a segment's free committed slots to the OS.
    ///
    /// # Safety
    /// `seg` is a segment of this arena; the caller holds the lock.
    unsafe fn decommit_dirty(&self, seg: *mut SmallSegment) {
        // SAFETY: `seg` is a segment of this arena and the caller holds the
        // lock (the caller's word), as `decommit_slots` asks; the dirty slots
        // are a subset of themselves.
        unsafe { self.decommit_slots(seg, (*seg).dirty_slots) };
    }

    /// Returns the `mask` slots of a segment (free and committed) to the OS;
    /// the purge round ends when no dirty slot is left.
    ///
    /// # Safety
    /// As [`decommit_dirty`](Self::decommit_dirty); `mask` is a subset of
    /// the segment's dirty slots.
    unsafe fn decommit_slots(&self, seg: *mut SmallSegment, mask: u64) {
        // SAFETY: `seg` is a live segment of this arena under the lock the
        // caller holds; `mask` names free, committed slots, whose memory no one
        // uses.
        unsafe {
            debug_assert_eq!(mask & !(*seg).dirty_slots, 0, "purging a slot that is not dirty");
            debug_assert_eq!(mask & !(*seg).free_slots, 0, "purging a slot in use");
            let mut d = mask;
            while d != 0 {
                let start = d.trailing_zeros() as usize;
                let run = (d >> start).trailing_ones() as usize;
                let p = NonNull::new_unchecked(seg.cast::<u8>().add(start * SLOT_SIZE));
                if mem::decommit(p, run * SLOT_SIZE).is_ok() {
                    let b = (run * SLOT_SIZE) as u64;
                    self.counters.dirty.fetch_sub(b, Ordering::Relaxed);
                    self.counters.purged.fetch_add(b, Ordering::Relaxed);
                }
                d &= !slot_mask(start, run);
            }
            (*seg).dirty_slots &= !mask;
            if (*seg).dirty_slots == 0 {
                (*seg).purge_at = 0;
            }
        }
    }

    /// Unmaps a wholly free segment (already off the list).
    ///
    /// # Safety
    /// As [`decommit_dirty`](Self::decommit_dirty); no slot is in use.
    unsafe fn unmap_segment(&self, seg: *mut SmallSegment) {
        // SAFETY: a live segment of this arena with no slot in use, off the
        // list, under the lock the caller holds: nothing points into it.
        unsafe {
            debug_assert_eq!((*seg).free_slots, !1u64);
            let dirty = ((*seg).dirty_slots.count_ones() as usize * SLOT_SIZE) as u64;
            self.counters.dirty.fetch_sub(dirty, Ordering::Relaxed);
            self.counters.purged.fetch_add(dirty, Ordering::Relaxed);
            self.counters.reserved.fetch_sub(SEGMENT_SIZE as u64, Ordering::Relaxed);
            super::segmap::remove(seg.cast());
            let _ = mem::unmap(NonNull::new_unchecked(seg.cast()), (*seg).seg.map_len);
        }
    }

    /// The slow-path hook of threads and `collect`: what is due goes back.
    pub(crate) fn tick(&self, state: &State) {
        if let Some(now) = delay_clock(state) {
            let mut g = self.inner.lock();
            self.purge_expired(state, &mut g, now);
        }
    }

    /// Returns every free, committed slot to the OS, and unmaps segments that
    /// are entirely free, keeping one for reuse.
    fn purge(&self, g: &mut ArenaInner) {
        let mut kept_empty = false;
        let mut link: *mut *mut SmallSegment = &mut g.segments;
        // SAFETY: the list and its segments are guarded by the lock we hold.
        unsafe {
            while !(*link).is_null() {
                let seg = *link;
                if (*seg).free_slots == !1u64 && kept_empty {
                    *link = (*seg).seg.next;
                    self.unmap_segment(seg);
                    continue;
                }
                kept_empty |= (*seg).free_slots == !1u64;
                self.decommit_dirty(seg);
                link = &mut (*seg).seg.next;
            }
        }
    }

    /// Purges now, whatever the threshold and the delay (for
    /// `NumaAlloc::collect`).
    pub(crate) fn purge_now(&self) {
        let mut g = self.inner.lock();
        self.purge(&mut g);
        let c = core::mem::replace(&mut g.cached, ptr::null_mut());
        // SAFETY: the whole list, off the arena.
        unsafe { self.unmap_cached(&mut g, c) };
        g.purge_at = 0;
    }

    /// A cached mapping for a block of `len` bytes (segment-aligned, its
    /// pages committed on this node), and its length: the smallest of at
    /// least `len` (and at most 4 times that, or `len` plus a segment: its
    /// pages are committed, and a block pins them all); else, with a purge
    /// delay, the largest smaller one grown to `len` with `mremap` (its pages
    /// move along, only the rest is faulted in), if the address space can be
    /// had.
    #[unsafe(link_section = ".text.hot.numaweave")]
    pub(crate) fn take_huge(&self, state: &State, len: usize) -> Option<(NonNull<u8>, usize)> {
        if guard_len() > 0 {
            return None;
        }
        let mut g = self.inner.lock();
        let fits = |l: usize| l >= len && (l <= len.saturating_mul(4) || l <= len + SEGMENT_SIZE);
        let mut best: *mut *mut Cached = ptr::null_mut();
        let mut largest_small: *mut *mut Cached = ptr::null_mut();
        let mut link: *mut *mut Cached = &mut g.cached;
        // SAFETY: cached mappings are ours, described in their first bytes.
        unsafe {
            while !(*link).is_null() {
                let l = (**link).len;
                if fits(l) && (best.is_null() || l < (**best).len) {
                    best = link;
                }
                if l < len && (largest_small.is_null() || l > (**largest_small).len) {
                    largest_small = link;
                }
                link = &mut (**link).next;
            }
            let grow = best.is_null() && state.config.purge_delay_ms > 0 && !largest_small.is_null();
            let pick = if !best.is_null() {
                best
            } else if grow {
                largest_small
            } else {
                return None;
            };
            let c = *pick;
            *pick = (*c).next;
            let l = (*c).len;
            g.cached_count -= 1;
            g.cached_bytes -= l;
            drop(g);
            self.counters.dirty.fetch_sub(l as u64, Ordering::Relaxed);
            let base = NonNull::new_unchecked(c.cast::<u8>());
            if !grow {
                return Some((base, l));
            }
            // Grown into a fresh segment-aligned range: the pages move along.
            let grown = mem::map_aligned(len, SEGMENT_SIZE).ok().and_then(|to| {
                mem::remap_to(base, l, len, to).ok().or_else(|| {
                    let _ = mem::unmap(to, len);
                    None
                })
            });
            match grown {
                Some(b) => {
                    self.counters.reserved.fetch_add((len - l) as u64, Ordering::Relaxed);
                    Some((b, len))
                }
                None => {
                    self.counters.reserved.fetch_sub(l as u64, Ordering::Relaxed);
                    self.counters.purged.fetch_add(l as u64, Ordering::Relaxed);
                    let _ = mem::unmap(base, l);
                    None
                }
            }
        }
    }

    /// Keeps a freed segment-aligned mapping for reuse; false when it is too
    /// large to keep (the caller unmaps it). Without a purge delay, at most
    /// 8 mappings and `purge_threshold` bytes; with one, up to 8 times that
    /// (oldest dropped first), each for the delay.
    #[unsafe(link_section = ".text.hot.numaweave")]
    pub(crate) fn keep_huge(&self, state: &State, base: NonNull<u8>, len: usize) -> bool {
        if guard_len() > 0 {
            // Guarded mappings end in a page no access is allowed to: not
            // reused, not grown.
            return false;
        }
        let now = delay_clock(state);
        let (bound, count) = match now {
            None => (state.config.purge_threshold, CACHED_MAX),
            Some(_) => (state.config.purge_threshold.saturating_mul(CACHED_BYTES_FACTOR), usize::MAX),
        };
        if len > bound {
            return false;
        }
        let c = base.as_ptr().cast::<Cached>();
        let mut g = self.inner.lock();
        // SAFETY: the mapping is ours, unused, its first page committed.
        unsafe { c.write(Cached { next: g.cached, len, freed_at: now.unwrap_or(0) }) };
        g.cached = c;
        g.cached_count += 1;
        g.cached_bytes += len;
        self.counters.dirty.fetch_add(len as u64, Ordering::Relaxed);
        if let Some(now) = now {
            g.purge_at = soonest(g.purge_at, now + delay_of(state, &g));
        }
        // Over the bounds: the oldest go.
        while g.cached_bytes > bound || g.cached_count > count {
            let mut link: *mut *mut Cached = &mut g.cached;
            // SAFETY: cached mappings are ours; the list has at least two.
            unsafe {
                while !(**link).next.is_null() {
                    link = &mut (**link).next;
                }
                let last = *link;
                *link = ptr::null_mut();
                self.unmap_cached(&mut g, last);
            }
        }
        if let Some(now) = now {
            self.purge_expired(state, &mut g, now);
        }
        true
    }

    /// Unmaps the cached mappings of the chain from `c` (already off the
    /// list) and takes them out of the counts.
    ///
    /// # Safety
    /// `c` is null or a chain of this arena's cached mappings, unlisted.
    unsafe fn unmap_cached(&self, g: &mut ArenaInner, mut c: *mut Cached) {
        while !c.is_null() {
            // SAFETY: `c` is one of this arena's cached mappings, unlisted (the
            // caller's word): its header is live and read by no one else.
            let (next, len) = unsafe { ((*c).next, (*c).len) };
            g.cached_count -= 1;
            g.cached_bytes -= len;
            self.counters.dirty.fetch_sub(len as u64, Ordering::Relaxed);
            self.counters.purged.fetch_add(len as u64, Ordering::Relaxed);
            self.counters.reserved.fetch_sub(len as u64, Ordering::Relaxed);
            // SAFETY: a cached mapping nobody uses.
            let _ = unsafe { mem::unmap(NonNull::new_unchecked(c.cast()), len) };
            c = next;
        }
    }
}

/// Bytes of the guard page after every mapping (`NUMAWEAVE_GUARD=1` in a
/// hardened build), else 0.
#[inline]
pub(crate) fn guard_len() -> usize {
    #[cfg(feature = "hardened")]
    if crate::hardened::guards() {
        return crate::os::page_size();
    }
    0
}

/// The purge delay in force in an arena (ms).
fn delay_of(state: &State, g: &ArenaInner) -> u64 {
    state.config.purge_delay_ms << g.delay_shift
}

/// Slots the purge delay gave back, taken again within the delay: the
/// program's memory rests longer between uses than the delay (sqlite3's
/// statements free tens of MiB and allocate them again 100–250 ms later,
/// and faulted in 10,000 pages more than under glibc with 100 ms). The
/// delay doubles, as glibc raises its mmap threshold when a freed mapping
/// is asked again; once per purge made under the current delay, up to
/// [`MAX_DELAY_SHIFT`] doublings, the committed bound unchanged. It comes
/// down again in [`Arena::purge_expired`] after [`DELAY_DECAY`] quiet delays.
///
/// # Safety
/// `seg` is a listed segment of the arena whose lock `g` is.
unsafe fn note_reuse(g: &mut ArenaInner, seg: *mut SmallSegment, mask: u64, state: &State) {
    // SAFETY: per the contract, the slot map and times are ours under the lock.
    unsafe {
        let purged = (*seg).purged_slots & mask;
        if purged == 0 {
            return;
        }
        (*seg).purged_slots &= !mask;
        let at = slots_in(purged).map(|s| (*seg).freed_at[s]).max().unwrap_or(0);
        let now = crate::os::monotonic_ms();
        if at >= g.raised_at && now < at + delay_of(state, g) {
            g.early_at = now;
            if g.delay_shift < MAX_DELAY_SHIFT {
                g.delay_shift += 1;
                g.raised_at = now;
            }
        }
    }
}

/// Now (ms, monotonic), if a purge delay is configured.
#[inline]
pub(super) fn delay_clock(state: &State) -> Option<u64> {
    (state.config.purge_delay_ms > 0).then(crate::os::monotonic_ms)
}

/// The earlier of two due times (0: none).
fn soonest(a: u64, b: u64) -> u64 {
    match (a, b) {
        (0, x) | (x, 0) => x,
        (x, y) => x.min(y),
    }
}

/// A segment's dirty slots freed at least `delay` ms before `now`, and
/// when the first of the others is due (0: none).
fn aged_slots(seg: &SmallSegment, now: u64, delay: u64) -> (u64, u64) {
    let (mut old, mut due) = (0, 0);
    for s in slots_in(seg.dirty_slots) {
        let at = seg.freed_at[s] + delay;
        if at <= now {
            old |= 1 << s;
        } else {
            due = soonest(due, at);
        }
    }
    (old, due)
}

/// The slots set in `mask`, lowest first.
fn slots_in(mask: u64) -> impl Iterator<Item = usize> {
    let mut m = mask;
    core::iter::from_fn(move || {
        let s = (m != 0).then(|| m.trailing_zeros() as usize)?;
        m &= m - 1;
        Some(s)
    })
}

fn slot_mask(first: usize, slots: usize) -> u64 {
    debug_assert!(first + slots <= SLOTS);
    if slots >= 64 { !0 } else { ((1u64 << slots) - 1) << first }
}

/// Finds `slots` free slots, aligned to `slots`, in the arena's segments:
/// slots still committed (dirty: freed, not yet purged) first, so that a
/// program that frees and allocates again reuses the memory it has instead
/// of touching more (a GC-heavy lua script peaked 30% higher when fresh
/// slots of a newer segment came first).
#[unsafe(link_section = ".text.hot.numaweave")]
fn take_slots(
    g: &mut ArenaInner,
    slots: usize,
    c: &ArenaCounters,
    state: &State,
) -> Option<(*mut SmallSegment, usize, usize)> {
    if c.dirty.load(Ordering::Relaxed) != 0 {
        // SAFETY: listed segments are live; their slot maps are ours under the lock.
        let found = unsafe { find_slots(g, slots, |seg| (*seg).free_slots & (*seg).dirty_slots) };
        if let Some(f) = found {
            return Some(take_found(f, slots, c));
        }
    }
    // SAFETY: as above.
    let (seg, first) = unsafe { find_slots(g, slots, |seg| (*seg).free_slots) }?;
    // SAFETY: a listed segment, under the lock `g` is.
    unsafe { note_reuse(g, seg, slot_mask(first, slots), state) };
    Some(take_found((seg, first), slots, c))
}

/// The first `slots` slots, aligned to `slots`, that are all set in
/// `usable(seg)`, over the arena's segments.
///
/// # Safety
/// The caller holds the arena lock (listed segments are live and their slot
/// maps are ours).
unsafe fn find_slots(
    g: &ArenaInner,
    slots: usize,
    usable: impl Fn(*mut SmallSegment) -> u64,
) -> Option<(*mut SmallSegment, usize)> {
    let mut seg = g.segments;
    while !seg.is_null() {
        let free = usable(seg);
        let mut first = 0;
        while first + slots <= SLOTS {
            let m = slot_mask(first, slots);
            if free & m == m {
                debug_assert!(first > 0, "slot 0 holds the header");
                return Some((seg, first));
            }
            first += slots;
        }
        // SAFETY: `seg` is on the arena's segment list, read under the lock the
        // caller holds, so live.
        seg = unsafe { (*seg).seg.next };
    }
    None
}

/// Takes the slots [`find_slots`] found.
fn take_found(
    (seg, first): (*mut SmallSegment, usize),
    slots: usize,
    c: &ArenaCounters,
) -> (*mut SmallSegment, usize, usize) {
    let m = slot_mask(first, slots);
    // SAFETY: a live segment whose slot map is ours under the caller's lock.
    unsafe {
        debug_assert_eq!((*seg).free_slots & m, m);
        (*seg).free_slots &= !m;
        let dirty = ((*seg).dirty_slots & m).count_ones() as u64 * SLOT_SIZE as u64;
        (*seg).dirty_slots &= !m;
        c.dirty.fetch_sub(dirty, Ordering::Relaxed);
        c.pages_in_use.fetch_add((slots * SLOT_SIZE) as u64, Ordering::Relaxed);
    }
    (seg, first, slots)
}

/// Writes a fresh page descriptor for `class` owned by `heap`.
fn init_page((seg, first, slots): (*mut SmallSegment, usize, usize), class: usize, heap: *mut Heap) -> NonNull<Page> {
    let bs = class_size(class);
    // SAFETY: the slots were just taken under the arena lock, so nobody else
    // uses this descriptor or the slot map entries.
    unsafe {
        for s in first..first + slots {
            (*seg).slot_page[s] = first as u8;
        }
        let page = (*seg).pages.as_mut_ptr().add(first);
        let start = seg.cast::<u8>().add(first * SLOT_SIZE);
        ptr::write(page, Page::empty());
        (*page).info.capacity = ((slots * SLOT_SIZE) / bs) as u32;
        (*page).info.block_size = bs as u32;
        (*page).info.class = class as u8;
        (*page).info.slots = slots as u8;
        (*page).info.first_slot = first as u8;
        (*page).info.node = (*seg).seg.arena;
        (*page).info.start = start;
        (*page).info.heap.store(heap, Ordering::Relaxed);
        let sink = if heap.is_null() { page } else { Heap::sink_for(heap, page, class) };
        super::segment::store_sinks(seg, page, sink);
        #[cfg(feature = "hardened")]
        {
            (*page).info.key = crate::hardened::page_key(page.cast());
            (*page).info.inv = u64::MAX / bs as u64 + 1;
            // (Full-mode frees are all checked out of line: see `Info::span`.)
            (*page).info.span = if crate::hardened::full_now() { 0 } else { (*page).info.capacity * bs as u32 };
            (*page).info.links = slots * SLOT_SIZE;
        }
        NonNull::new_unchecked(page)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::size_class::{SMALL_MAX, class_of};

    fn state() -> &'static State {
        State::get(&crate::alloc::Config::new())
    }

    /// An arena of its own (flat: no binding), apart from the process's.
    fn arena() -> Arena {
        Arena::new(0, None)
    }

    /// For the purge delay's tests: the state, an arena of its own, the
    /// configured delay (ms), a class of 20,000-byte blocks and its page's
    /// bytes; `None` where the delay is configured off.
    fn with_delay() -> Option<(&'static State, Arena, u64, usize, u64)> {
        let state = state();
        let delay = state.config.purge_delay_ms;
        let class = class_of(20_000);
        (delay > 0).then(|| (state, arena(), delay, class, (page_slots(class) * SLOT_SIZE) as u64))
    }

    fn sleep(ms: u64) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }

    #[test]
    fn pages_are_disjoint_slot_aligned_and_described() {
        let (state, a) = (state(), arena());
        let mut seen: Vec<(usize, usize)> = Vec::new();
        for size in [64, 20_000, 100_000, 64, 20_000] {
            let class = class_of(size);
            let page = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
            // SAFETY: a page just handed out.
            let (start, slots, first) = unsafe {
                assert_eq!(usize::from((*page).info.class), class);
                assert_eq!((*page).info.block_size as usize, class_size(class));
                ((*page).info.start as usize, usize::from((*page).info.slots), usize::from((*page).info.first_slot))
            };
            assert_eq!(slots, page_slots(class));
            assert_eq!(first % slots, 0, "a page of {slots} slots starts on a multiple of {slots}");
            assert_eq!(start % SLOT_SIZE, 0);
            let end = start + slots * SLOT_SIZE;
            assert!(seen.iter().all(|&(s, e)| end <= s || start >= e), "pages overlap");
            seen.push((start, end));
        }
        assert_eq!(
            a.counters.pages_in_use.load(Ordering::Relaxed) as usize,
            seen.iter().map(|(s, e)| e - s).sum::<usize>()
        );
    }

    #[test]
    fn freed_pages_are_reused_then_purged_and_empty_segments_unmapped() {
        let (state, a) = (state(), arena());
        // Pages of four slots: fifteen fit a segment, twenty take two.
        let class = class_of(SMALL_MAX);
        assert_eq!(page_slots(class), 4);
        let pages: Vec<*mut Page> =
            (0..20).map(|_| a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr()).collect();
        assert!(a.counters.reserved.load(Ordering::Relaxed) >= 2 * SEGMENT_SIZE as u64);
        // SAFETY: pages of this arena with no block live and no heap.
        unsafe { a.free_page(state, pages[0]) };
        assert_eq!(a.counters.dirty.load(Ordering::Relaxed), 4 * SLOT_SIZE as u64, "below the threshold: kept");
        let again = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
        assert_eq!(again, pages[0], "a freed page is handed out again");
        assert_eq!(a.counters.dirty.load(Ordering::Relaxed), 0);
        for &p in &pages {
            // SAFETY: as above.
            unsafe { a.free_page(state, p) };
        }
        a.purge_now();
        assert_eq!(a.counters.dirty.load(Ordering::Relaxed), 0);
        assert_eq!(a.counters.pages_in_use.load(Ordering::Relaxed), 0);
        assert_eq!(a.counters.reserved.load(Ordering::Relaxed), SEGMENT_SIZE as u64, "one empty segment kept");
    }

    #[test]
    fn cached_mappings_serve_requests_that_fit_and_grow_for_larger_ones() {
        if guard_len() > 0 {
            // Guard pages (hardened, NUMAWEAVE_GUARD=1) turn the cache off:
            // a mapping's guard must follow the block it holds.
            let m = mem::map_aligned(SEGMENT_SIZE, SEGMENT_SIZE).unwrap();
            assert!(!arena().keep_huge(state(), m, SEGMENT_SIZE));
            // SAFETY: our mapping, refused by the cache.
            let _ = unsafe { mem::unmap(m, SEGMENT_SIZE) };
            return;
        }
        let (state, a) = (state(), arena());
        let len = SEGMENT_SIZE;
        let m = mem::map_aligned(len, SEGMENT_SIZE).unwrap();
        // SAFETY: our fresh mapping: a marker past the first page (the
        // cache's own header lives in the first bytes).
        unsafe { m.as_ptr().add(8192).write(0x5a) };
        assert!(a.keep_huge(state, m, len));
        assert_eq!(a.take_huge(state, len / 2), Some((m, len)), "a smaller request takes it");
        assert!(a.take_huge(state, len / 2).is_none(), "taken once");
        assert!(a.keep_huge(state, m, len));
        if state.config.purge_delay_ms > 0 {
            // A larger request grows it: the pages move along.
            let (g, glen) = a.take_huge(state, 3 * len).unwrap();
            assert_eq!(glen, 3 * len);
            assert_eq!(g.as_ptr() as usize % SEGMENT_SIZE, 0);
            // SAFETY: the grown mapping, ours.
            unsafe {
                assert_eq!(g.as_ptr().add(8192).read(), 0x5a, "the cached pages came along");
                mem::unmap(g, glen).unwrap();
            }
        } else {
            assert!(a.take_huge(state, 3 * len).is_none());
            assert_eq!(a.take_huge(state, len), Some((m, len)));
            // SAFETY: ours, unused.
            unsafe { mem::unmap(m, len).unwrap() };
        }
        let bound = state.config.purge_threshold * if state.config.purge_delay_ms > 0 { 8 } else { 1 };
        let big = mem::map_aligned(bound + SEGMENT_SIZE, SEGMENT_SIZE).unwrap();
        assert!(!a.keep_huge(state, big, bound + SEGMENT_SIZE), "over the bound: not kept");
        // SAFETY: ours, unused.
        unsafe { mem::unmap(big, bound + SEGMENT_SIZE).unwrap() };
        assert_eq!(a.counters.dirty.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn free_pages_wait_out_the_delay() {
        let Some((state, a, delay, class, bytes)) = with_delay() else { return };
        let p = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
        // SAFETY: a page of this arena with no block live and no heap.
        unsafe { a.free_page(state, p) };
        assert_eq!(a.counters.dirty.load(Ordering::Relaxed), bytes, "kept committed for the delay");
        let purged = a.counters.purged.load(Ordering::Relaxed);
        a.tick(state);
        assert_eq!(a.counters.purged.load(Ordering::Relaxed), purged, "not yet");
        sleep(delay + 20);
        a.tick(state);
        assert_eq!(a.counters.dirty.load(Ordering::Relaxed), 0, "purged once the delay is over");
        assert_eq!(a.counters.purged.load(Ordering::Relaxed), purged + bytes);
    }

    #[test]
    fn a_page_freed_late_waits_its_own_delay() {
        let Some((state, a, delay, class, bytes)) = with_delay() else { return };
        let p = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
        let q = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
        // SAFETY: pages of this arena, in use.
        unsafe {
            use crate::alloc::segment::segment_of;
            assert_eq!(segment_of((*p).info.start), segment_of((*q).info.start), "one segment");
        }
        let purged = a.counters.purged.load(Ordering::Relaxed);
        // SAFETY: pages of this arena with no block live and no heap.
        unsafe { a.free_page(state, p) };
        sleep(delay / 2);
        // SAFETY: as above.
        unsafe { a.free_page(state, q) };
        // Past the first page's delay, well before the second's.
        sleep(delay / 2 + 5);
        a.tick(state);
        assert_eq!(a.counters.purged.load(Ordering::Relaxed), purged + bytes, "the first page's delay is over");
        assert_eq!(a.counters.dirty.load(Ordering::Relaxed), bytes, "the second page has not waited its delay");
        sleep(delay / 2 + 20);
        a.tick(state);
        assert_eq!(a.counters.dirty.load(Ordering::Relaxed), 0, "now it has");
        assert_eq!(a.counters.purged.load(Ordering::Relaxed), purged + 2 * bytes);
    }

    #[test]
    fn pages_taken_back_soon_after_their_purge_lengthen_the_delay() {
        let Some((state, a, delay, class, bytes)) = with_delay() else { return };
        let purged = || a.counters.purged.load(Ordering::Relaxed);
        let p = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
        // SAFETY: a page of this arena with no block live and no heap.
        unsafe { a.free_page(state, p) };
        sleep(delay + 20);
        a.tick(state);
        assert_eq!(purged(), bytes, "purged after the configured delay");
        let q = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
        assert_eq!(q, p, "the purged slots are taken again, within the delay");
        assert_eq!(a.inner.lock().delay_shift, 1);
        // SAFETY: as above.
        unsafe { a.free_page(state, q) };
        sleep(delay + 20);
        a.tick(state);
        assert_eq!(purged(), bytes, "the delay has doubled: still committed");
        sleep(delay);
        a.tick(state);
        assert_eq!(purged(), 2 * bytes, "purged after the doubled delay");
        // Taken back long after its purge: the delay was long enough.
        sleep(2 * delay + 20);
        let r = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
        assert_eq!(r, p);
        assert_eq!(a.inner.lock().delay_shift, 1, "a late reuse does not raise the delay");
        // Quiet for DELAY_DECAY doubled delays: back to the configured one.
        sleep(2 * delay * DELAY_DECAY + 20);
        a.tick(state);
        assert_eq!(a.inner.lock().delay_shift, 0);
    }
}
