//! Per-node arenas: each owns the segments bound to its node, hands pages to
//! heaps, takes empty pages back, returns memory to the OS past a threshold,
//! and keeps the heaps of exited threads for new threads to adopt.
//!
//! Everything here is a slow path, under the arena's spin lock: a thread comes
//! here once per page (64 – 256 KiB of blocks), not per block.

use core::ptr::{self, NonNull};

use super::segmap;
use super::segment::{segment_of, store_sinks};
use super::size_class::{COLOURS, class_size, coloured, page_blocks, page_slots};
use super::types::{
    Arena, ArenaCounters, ArenaInner, Heap, Mode, OWNER_NONE, OWNER_RECLAIM, OWNER_THREAD, Page, SEGMENT_SIZE,
    SLOT_SIZE, SLOTS, Segment, SegmentKind, SmallSegment, State,
};
use crate::hardened::{self, HARDENED};
use crate::os::mem::{self, BindFlags, MemPolicy};
use crate::sync::{AtomicUsize, Ordering};
use crate::topology::NodeSet;

mod cached;
mod purge;
mod usage;

pub use usage::ClassUsage;

use cached::CACHED_BYTES_FACTOR;
pub(crate) use purge::delay_clock;
pub(crate) use purge::map_or_reclaim;
use purge::{committed_bound, delay_of, note_reuse, soonest};

impl Arena {
    /// The kernel policy for this arena's mappings.
    pub(crate) fn policy(&self, state: &State) -> MemPolicy {
        match self.bind_to {
            None => MemPolicy::Default,
            Some(p) if state.config.strict => MemPolicy::Bind(NodeSet::single(p)),
            Some(p) => MemPolicy::Preferred(p),
        }
    }

    /// Takes an exited thread's heap waiting on this arena, if there is one
    /// not being collected, for the calling thread ([`OWNER_THREAD`]).
    pub(crate) fn adopt_orphan(&self) -> *mut Heap {
        let mut g = self.inner.lock();
        let mut link: *mut *mut Heap = &mut g.orphans;
        // SAFETY: listed heaps are live (heaps are never freed); the list
        // and the owners of listed heaps change under the lock we hold.
        unsafe {
            while !(*link).is_null() {
                let h = *link;
                if (*h).owned.load(Ordering::Relaxed) == OWNER_NONE {
                    *link = (*h).next_orphan;
                    (*h).next_orphan = ptr::null_mut();
                    (*h).owned.store(OWNER_THREAD, Ordering::Relaxed);
                    return h;
                }
                link = &mut (*h).next_orphan;
            }
        }
        ptr::null_mut()
    }

    /// Lists `heap`, its thread gone, for adoption.
    ///
    /// # Safety
    /// `heap` is a live heap its exiting thread gives up, on no list.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) unsafe fn park_orphan(&self, heap: *mut Heap) {
        let mut g = self.inner.lock();
        // SAFETY: `heap` is a live heap its exiting thread gives up, on no list (the caller's
        // word): its owner word and orphan link are ours to write under the lock.
        unsafe {
            (*heap).owned.store(OWNER_NONE, Ordering::Relaxed);
            (*heap).next_orphan = g.orphans;
        }
        g.orphans = heap;
    }

    /// Claims up to `out.len()` of the heaps waiting on this arena whose
    /// pages got remote frees, or (with `kept_due`) whose kept free blocks
    /// are due: kept since `kept_due` or before ([`OWNER_RECLAIM`]: not
    /// adopted meanwhile); returns how many it put in `out`, and the
    /// earliest time a heap it passed over has kept its blocks since (0:
    /// none), so that the caller notes when that heap is due. Each heap
    /// claimed is let go with [`release_orphan`](Self::release_orphan).
    pub(crate) fn claim_orphans(&self, out: &mut [*mut Heap], kept_due: Option<u64>) -> (usize, u64) {
        let g = self.inner.lock();
        let (mut k, mut earliest) = (0, 0u64);
        let mut h = g.orphans;
        // SAFETY: as in `adopt_orphan`; the decay of an unowned heap was
        // last written by an owner before it let go under this lock.
        unsafe {
            while !h.is_null() && k < out.len() {
                let kept = (*h).life.decay.kept_since();
                let due = kept_due.is_some_and(|d| kept != 0 && kept <= d);
                let unowned = (*h).owned.load(Ordering::Relaxed) == OWNER_NONE;
                if unowned && (due || !(*h).remote_pages.0.is_empty()) {
                    (*h).owned.store(OWNER_RECLAIM, Ordering::Relaxed);
                    out[k] = h;
                    k += 1;
                } else if unowned && kept != 0 && (earliest == 0 || kept < earliest) {
                    earliest = kept;
                }
                h = (*h).next_orphan;
            }
        }
        (k, earliest)
    }

    /// Lets go of a heap [`claim_orphans`](Self::claim_orphans) claimed.
    pub(crate) fn release_orphan(&self, heap: *mut Heap) {
        let _g = self.inner.lock();
        // SAFETY: a listed heap (claimed, so still listed), live.
        unsafe { (*heap).owned.store(OWNER_NONE, Ordering::Relaxed) };
    }

    /// Bytes the OS got back from this arena (cumulative).
    pub(crate) fn returned(&self) -> u64 {
        self.counters.purged.load(Ordering::Relaxed)
    }

    /// Bytes of the arena's segments and cached mappings the kernel holds
    /// in memory (`mincore`), and of those, the bytes of free slots and
    /// cached mappings: what is resident and free, measured, so that the
    /// two figures add up (free slots are counted whole in `dirty`, touched
    /// or not). The ranges and free-slot masks are copied under the lock
    /// and the kernel asked outside it: a `mincore` per segment, thousands
    /// for a large heap, would keep the node's refills spinning. A range
    /// unmapped meanwhile is refused by the kernel and counts nothing (a
    /// statistic of the moment it is read).
    pub(crate) fn resident(&self) -> (u64, u64) {
        /// A cached mapping's mask: all of it free.
        const CACHED: u64 = u64::MAX;
        let count = |g: &ArenaInner| {
            let mut n = 0;
            // SAFETY: listed segments and cached mappings are live under
            // the lock the caller holds.
            unsafe {
                let mut seg = g.segments;
                while !seg.is_null() {
                    n += 1;
                    seg = (*seg).seg.next;
                }
                let mut c = g.cached;
                while !c.is_null() {
                    n += 1;
                    c = (*c).next;
                }
            }
            n
        };
        let n = count(&self.inner.lock());
        // (Room for a few made meanwhile: more are left out.)
        let mut ranges: Vec<(usize, usize, u64)> = Vec::new();
        if ranges.try_reserve_exact(n + 8).is_err() {
            return (0, 0);
        }
        {
            let g = self.inner.lock();
            // SAFETY: as in `count`; a segment's slot map is read under the
            // lock that guards it.
            unsafe {
                let mut seg = g.segments;
                while !seg.is_null() && ranges.len() < ranges.capacity() {
                    ranges.push((seg as usize, SEGMENT_SIZE, (*seg).free_slots));
                    seg = (*seg).seg.next;
                }
                let mut c = g.cached;
                while !c.is_null() && ranges.len() < ranges.capacity() {
                    ranges.push((c as usize, (*c).len, CACHED));
                    c = (*c).next;
                }
            }
        }
        let page = crate::os::page_size();
        let per_slot = SLOT_SIZE / page;
        let (mut all, mut free) = (0u64, 0u64);
        let mut present = [false; SEGMENT_SIZE / 4096];
        for (at, len, mask) in ranges {
            // SAFETY: a page-aligned address of a mapping of ours when it
            // was copied; `mincore` only reads the page tables (an unmapped
            // range is refused), never the memory.
            let at = unsafe { NonNull::new_unchecked(at as *mut u8) };
            if mask == CACHED {
                let n = mem::resident_bytes(at, len).unwrap_or(0);
                all += n;
                free += n;
                continue;
            }
            let pages = len / page;
            if pages > present.len() || mem::resident_pages(at, len, &mut present).is_err() {
                continue;
            }
            for (slot, chunk) in present[..pages].chunks(per_slot).enumerate() {
                let n = chunk.iter().filter(|&&p| p).count() as u64 * page as u64;
                all += n;
                if mask & (1 << slot) != 0 {
                    free += n;
                }
            }
        }
        (all, free)
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
                take_slots(&mut g, page_slots(class), &other.counters, state).map(|p| init_page(p, class, heap))
            };
            let page = match taken {
                Some(p) => Some(p),
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
    #[unsafe(link_section = ".text.sorted.numaweave")]
    fn map_and_take(&self, state: &State, class: usize, heap: *mut Heap) -> Option<NonNull<Page>> {
        let seg = self.map_segment(state)?;
        let mut g = self.inner.lock();
        // SAFETY: a fresh segment, ours alone until linked.
        unsafe { (*seg.as_ptr()).seg.next = g.segments };
        g.segments = seg.as_ptr();
        take_slots(&mut g, page_slots(class), &self.counters, state).map(|p| init_page(p, class, heap))
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
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) fn map_bound(&self, state: &State, len: usize) -> Option<NonNull<u8>> {
        let guard = guard_len();
        let base = purge::map_or_reclaim(state, || {
            segmap::NEAR.map_aligned_at(len + guard, SEGMENT_SIZE, 0, mem::Charge::Lazy).ok()
        })?;
        if !segmap::can_mark(base.as_ptr()) {
            // SAFETY: ours, unused.
            let _ = unsafe { mem::unmap(base, len + guard) };
            return None;
        }
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
        let base = mem::map_hugetlb_on(
            len,
            SEGMENT_SIZE,
            mem::HUGE_PAGE,
            self.policy(state),
            self.bind_to,
            Some(&segmap::NEAR),
        )
        .ok()?;
        if !segmap::can_mark(base.as_ptr()) {
            // SAFETY: ours, unused.
            let _ = unsafe { mem::unmap(base, len) };
            return None;
        }
        Some(base)
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
        segmap::insert(base.as_ptr(), SegmentKind::Small);
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
            let seg = segment_of((*page).info.start) as *mut SmallSegment;
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
            debug_assert_eq!((*page).used.get(), 0);
            (*page).info.heap.store(ptr::null_mut(), Ordering::Relaxed);
            // A free into the page now fails the hardened free's bound.
            if HARDENED {
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
        // cached mappings get, raised while bursts past it recur): a burst
        // of frees past the threshold alone (a garbage collector's sweep) is
        // taken again moments later.
        let now = delay_clock(state);
        let bound = match now {
            Some(_) => committed_bound(state, &g),
            None => state.config.purge_threshold,
        };
        g.dirty_peak = g.dirty_peak.max(dirty);
        let purge_all =
            dirty as usize > bound && now.is_none_or(|now| purge::note_bound_purge(&mut g, state, now, dirty));
        if purge_all {
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
}

/// Memory for one heap descriptor, from `mmap`ed chunks (never the heap
/// itself: this runs when a thread has no heap yet).
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) fn alloc_meta(state: &State, size: usize, align: usize) -> Option<NonNull<u8>> {
    const CHUNK: usize = 1 << 20;
    let mut g = state.meta.lock();
    let mut p = (g.next as usize).next_multiple_of(align);
    if g.next.is_null() || p + size > g.end as usize {
        // (The arenas' locks are taken alone, after `meta`: the lock
        // table's order.)
        let chunk = map_or_reclaim(state, || mem::map(CHUNK).ok())?;
        g.next = chunk.as_ptr();
        // SAFETY: end of the fresh chunk.
        g.end = unsafe { chunk.as_ptr().add(CHUNK) };
        p = (g.next as usize).next_multiple_of(align);
    }
    g.next = (p + size) as *mut u8;
    NonNull::new(p as *mut u8)
}

/// Bytes of the guard page after every mapping (`NUMAWEAVE_GUARD=1` in a
/// hardened build), else 0.
#[inline]
pub(crate) fn guard_len() -> usize {
    if HARDENED && hardened::guards() { crate::os::page_size() } else { 0 }
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
#[unsafe(link_section = ".text.sorted.numaweave")]
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

/// The start line of the next [coloured](coloured) page: a relaxed
/// counter, 23 lines on a page (prime to [`COLOURS`], so that 64 pages in
/// a row start at 64 different lines).
static NEXT_COLOUR: AtomicUsize = AtomicUsize::new(0);

/// Writes a fresh page descriptor for `class` owned by `heap`. Under the
/// arena's lock, with the slots' taking: the walk of the arena's pages
/// (`usage.rs`) reads the descriptors of taken slots under that lock.
#[unsafe(link_section = ".text.sorted.numaweave")]
fn init_page((seg, first, slots): (*mut SmallSegment, usize, usize), class: usize, heap: *mut Heap) -> NonNull<Page> {
    let bs = class_size(class);
    let colour = if coloured(class) { NEXT_COLOUR.fetch_add(23, Ordering::Relaxed) % COLOURS * 64 } else { 0 };
    debug_assert!(slots == page_slots(class) && colour + bs * page_blocks(class) <= slots * SLOT_SIZE);
    // SAFETY: the slots were just taken under the arena lock, which the
    // caller still holds, so nobody else uses this descriptor or the slot
    // map entries.
    unsafe {
        for s in first..first + slots {
            (*seg).slot_page[s] = first as u8;
        }
        let page = (*seg).pages.as_mut_ptr().add(first);
        let start = seg.cast::<u8>().add(first * SLOT_SIZE + colour);
        ptr::write(page, Page::empty());
        (*page).info.capacity = page_blocks(class) as u32;
        (*page).info.block_size = bs as u32;
        (*page).info.class = class as u8;
        (*page).info.slots = slots as u8;
        (*page).info.first_slot = first as u8;
        (*page).info.node = (*seg).seg.arena;
        (*page).info.start = start;
        (*page).info.heap.store(heap, Ordering::Relaxed);
        // Its own sink: the heap that takes it points the slots at its free
        // cache, if it keeps one (`Heap::fresh_page`).
        store_sinks(seg, page, page);
        if HARDENED {
            (*page).info.key = hardened::page_key(page.cast());
            (*page).info.inv = u64::MAX / bs as u64 + 1;
            // (Full-mode frees are all checked out of line: see `Info::span`.)
            (*page).info.span = if hardened::full_now() { 0 } else { (*page).info.capacity * bs as u32 };
            (*page).info.links = slots * SLOT_SIZE;
        }
        NonNull::new_unchecked(page)
    }
}

#[cfg(test)]
mod tests;
