//! Returning an arena's free memory to the OS: each page waits out the
//! purge delay from its own free (the delay doubling while purged pages
//! are asked back within it in bulk, halving again when quiet), then goes back with
//! `MADV_DONTNEED`; wholly free segments past a few are unmapped. Run on
//! the allocator's slow paths: there is no thread or timer of its own.

use core::ptr::{self, NonNull};

use super::{Arena, ArenaInner, CACHED_BYTES_FACTOR, SEGMENT_SIZE, SLOT_SIZE, SmallSegment, State, slot_mask};
use crate::alloc::engine::types::{Cached, Due, Window};
use crate::os::mem;
use crate::sync::Ordering;

/// The purge delay grows to at most this many doublings of the configured
/// one (100 ms: 1.6 s; jemalloc decays over 10 s).
const MAX_DELAY_SHIFT: u32 = 4;

/// A raised delay halves after this many delays (a power of two) in which
/// too few purged pages were taken back early to keep it ([`note_reuse`]).
pub(super) const DELAY_DECAY: u64 = 16;

/// Empty segments an arena keeps mapped past the purge delay (their pages
/// purged); more are unmapped. An explicit purge keeps one.
const KEPT_EMPTY: usize = 4;

impl Arena {
    /// With a purge delay: returns to the OS the free pages of segments and
    /// the cached mappings that have stayed unused for the delay (on the
    /// allocator's slow paths: page hand-out and return, thread exit,
    /// `collect`; there is no thread or timer of its own).
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(super) fn purge_expired(&self, state: &State, g: &mut ArenaInner, now: u64) {
        self.purge_due(state, g, now);
        // The lifecycle ticks at the earliest arena's due time.
        state.life.note_due(Due::Memory, g.purge_at);
    }

    /// [`purge_expired`](Self::purge_expired) but telling the lifecycle.
    fn purge_due(&self, state: &State, g: &mut ArenaInner, now: u64) {
        if g.delay_shift > 0 && now >= g.early_at + delay_of(state, g) * DELAY_DECAY {
            // Quiet for a long while (`note_reuse`): give memory back sooner again.
            g.delay_shift -= 1;
            g.early_at = now;
        }
        if g.bound_shift > 0 && now >= g.bound_seen + delay_of(state, g) * DELAY_DECAY {
            // No burst near the raised bound for a long while: lower it.
            if g.dirty_peak as usize <= committed_bound(state, g) / 2 {
                g.bound_shift -= 1;
            }
            g.bound_seen = now;
            g.dirty_peak = self.counters.dirty.load(Ordering::Relaxed);
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
    pub(super) unsafe fn decommit_dirty(&self, seg: *mut SmallSegment) {
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
    pub(super) unsafe fn decommit_slots(&self, seg: *mut SmallSegment, mask: u64) {
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
    pub(super) unsafe fn unmap_segment(&self, seg: *mut SmallSegment) {
        // SAFETY: a live segment of this arena with no slot in use, off the
        // list, under the lock the caller holds: nothing points into it.
        unsafe {
            debug_assert_eq!((*seg).free_slots, !1u64);
            let dirty = ((*seg).dirty_slots.count_ones() as usize * SLOT_SIZE) as u64;
            self.counters.dirty.fetch_sub(dirty, Ordering::Relaxed);
            self.counters.purged.fetch_add(dirty, Ordering::Relaxed);
            self.counters.reserved.fetch_sub(SEGMENT_SIZE as u64, Ordering::Relaxed);
            crate::alloc::engine::segmap::remove(seg.cast());
            let _ = mem::unmap(NonNull::new_unchecked(seg.cast()), (*seg).seg.map_len);
        }
    }

    /// The lifecycle's tick (`lifecycle::tick`): what is due at `now`
    /// goes back.
    pub(crate) fn tick_at(&self, state: &State, now: u64) {
        let mut g = self.inner.lock();
        self.purge_expired(state, &mut g, now);
    }

    /// Returns every free, committed slot to the OS, and unmaps segments that
    /// are entirely free, keeping one for reuse.
    pub(super) fn purge(&self, g: &mut ArenaInner) {
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

    /// Unmaps what holds address space and serves nothing: every wholly
    /// free segment (none kept) and every cached mapping. Free slots of
    /// segments in use stay as they are (purging them gives back memory,
    /// not address space). The bytes of address space given back.
    pub(crate) fn unmap_unused(&self) -> usize {
        let mut g = self.inner.lock();
        let mut freed = g.cached_bytes;
        let c = core::mem::replace(&mut g.cached, ptr::null_mut());
        // SAFETY: the whole list, off the arena.
        unsafe { self.unmap_cached(&mut g, c) };
        let mut link: *mut *mut SmallSegment = &mut g.segments;
        // SAFETY: the list and its segments are guarded by the lock we hold;
        // a segment with every slot free has no page of any heap in it (a
        // heap's kept and cached pages hold their slots), so nothing points
        // into it.
        unsafe {
            while !(*link).is_null() {
                let seg = *link;
                if (*seg).free_slots == !1u64 {
                    *link = (*seg).seg.next;
                    freed += (*seg).seg.map_len;
                    self.unmap_segment(seg);
                    continue;
                }
                link = &mut (*seg).seg.next;
            }
        }
        freed
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
}

/// The purge delay in force in an arena (ms).
pub(super) fn delay_of(state: &State, g: &ArenaInner) -> u64 {
    state.config.purge_delay_ms << g.delay_shift
}

/// The free page memory an arena with a purge delay keeps committed before
/// it returns all of it at once: 8 times the threshold, doubled while such
/// bursts recur ([`note_bound_purge`]).
pub(super) fn committed_bound(state: &State, g: &ArenaInner) -> usize {
    state.config.purge_threshold.saturating_mul(CACHED_BYTES_FACTOR) << g.bound_shift
}

/// Free memory (`dirty` bytes) passed the bound at `now`: whether it goes
/// back at once. It does, unless it passed the bound within four delays
/// before too: then the program frees and allocates more than the bound in
/// a loop (a JSON service drops a 100 MB document and parses the next:
/// every round faulted it all in again, 29,000 faults a round), and the
/// bound doubles until it is twice the burst, up to [`MAX_DELAY_SHIFT`]
/// doublings (1 GiB by default), and what is free stays for the next
/// round, under the raised bound and the delay (at the last doubling, what
/// is past the bound still goes back). The burst is what the bound's
/// purges of the last four delays returned and what passes it now: a drop
/// of 250 MB passes the bound of 64 MB (purged), passes it again 64 MB
/// later, which raises the bound to 512 MB (the first doubling past twice
/// the 128 MB and more of the burst), and stays. Purging at the raise
/// too faulted it in again in the next round: `serde_json`'s 18 MB
/// document parsed 5 times took 122,000–139,000 faults, 87,000–90,000
/// kept. The bound comes down again once free memory stayed under half of
/// it for [`DELAY_DECAY`] delays (`Arena::purge_expired`); the delay still
/// returns what waits, so a program that goes quiet gives it all back.
pub(super) fn note_bound_purge(g: &mut ArenaInner, state: &State, now: u64, dirty: u64) -> bool {
    let window = 4 * delay_of(state, g);
    let recurs = g.bound_at != 0 && now < g.bound_at + window;
    g.bound_at = now;
    if recurs {
        let burst = g.burst.add(now, window, 0).saturating_add(dirty);
        while g.bound_shift < MAX_DELAY_SHIFT && (committed_bound(state, g) as u64) < burst.saturating_mul(2) {
            g.bound_shift += 1;
        }
        g.bound_seen = now;
        if dirty <= committed_bound(state, g) as u64 {
            // Kept, not returned: not part of a later burst's sum.
            return false;
        }
    }
    g.burst.add(now, window, dirty);
    true
}

/// Slots the purge delay gave back, taken again within the delay: the
/// program's memory rests longer between uses than the delay (sqlite3's
/// statements once freed tens of MiB and allocated them again 100–250 ms
/// later, and faulted in 10,000 pages more than under glibc with 100 ms).
/// The delay doubles, as glibc raises its mmap threshold when a freed
/// mapping is asked again, once the bytes so taken back within one delay
/// reach [`early_need`]: an eighth of the purge threshold (1 MiB: 256
/// faults a delay saved) at the configured delay, four times more for each
/// doubling, as each holds twice the free memory for twice as long. A few
/// pages taken back early are not worth it: a program that starts and ends
/// threads all the time (`memory churn`) takes back 64–400 KiB a delay,
/// and a delay raised 16-fold for that held 1 MiB more of its 14. Only
/// slots purged under the delay in force count, up to [`MAX_DELAY_SHIFT`]
/// doublings, the committed bound unchanged. The delay comes down again in
/// [`Arena::purge_expired`] after [`DELAY_DECAY`] delays in which no delay
/// took back a quarter of [`early_need`].
///
/// # Safety
/// `seg` is a listed segment of the arena whose lock `g` is.
pub(super) unsafe fn note_reuse(g: &mut ArenaInner, seg: *mut SmallSegment, mask: u64, state: &State) {
    // SAFETY: `seg` is a listed segment of the arena whose lock `g` is (the caller's word):
    // it is mapped, and its slot map and times change only under that lock, held.
    unsafe {
        let purged = (*seg).purged_slots & mask;
        if purged == 0 {
            return;
        }
        (*seg).purged_slots &= !mask;
        let at = slots_in(purged).map(|s| (*seg).freed_at[s]).max().unwrap_or(0);
        let now = crate::os::monotonic_ms();
        let delay = delay_of(state, g);
        if at < g.raised_at || now >= at.saturating_add(delay) {
            return;
        }
        let early = g.early.add(now, delay, u64::from(purged.count_ones()) * SLOT_SIZE as u64);
        let need = early_need(state, g);
        if early >= need / 4 {
            // Enough to keep the delay in force from decaying.
            g.early_at = now;
        }
        if early >= need && g.delay_shift < MAX_DELAY_SHIFT {
            g.delay_shift += 1;
            g.raised_at = now;
            g.early.restart(now);
        }
    }
}

/// The bytes of purged slots taken back within one delay that double the
/// delay in force: an eighth of the purge threshold, times four for each
/// doubling already made ([`note_reuse`]).
pub(super) fn early_need(state: &State, g: &ArenaInner) -> u64 {
    ((state.config.purge_threshold / 8).max(SLOT_SIZE) as u64) << (2 * g.delay_shift)
}

/// Now (ms, monotonic), if a purge delay is configured.
#[inline]
pub(crate) fn delay_clock(state: &State) -> Option<u64> {
    (state.config.purge_delay_ms > 0).then(crate::os::monotonic_ms)
}

/// The earlier of two due times (0: none).
pub(super) fn soonest(a: u64, b: u64) -> u64 {
    match (a, b) {
        (0, x) | (x, 0) => x,
        (x, y) => x.min(y),
    }
}

/// A segment's dirty slots freed at least `delay` ms before `now`, and
/// when the first of the others is due (0: none).
pub(super) fn aged_slots(seg: &SmallSegment, now: u64, delay: u64) -> (u64, u64) {
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
pub(super) fn slots_in(mask: u64) -> impl Iterator<Item = usize> {
    let mut m = mask;
    core::iter::from_fn(move || {
        let s = (m != 0).then(|| m.trailing_zeros() as usize)?;
        m &= m - 1;
        Some(s)
    })
}

/// `map()`, and when the OS refuses it, `map()` once more after every arena
/// has unmapped the address space it holds unused ([`Arena::unmap_unused`]),
/// if any did. Freed segments and cached mappings wait out the purge delay
/// mapped; under an address-space limit (`RLIMIT_AS`) or strict overcommit
/// (`vm.overcommit_memory=2`, where a mapping is charged whole) they would
/// make a large `malloc` fail that glibc, which unmaps at once, serves: a
/// program that filled 256 MiB of `RLIMIT_AS` with 1 KiB blocks and freed
/// them could then have no block over 112 MiB (glibc: 240 MiB; after 1 MiB
/// blocks, 192). Fall back, do not starve.
///
/// Called with no arena lock held (each arena's is taken in turn).
pub(crate) fn map_or_reclaim<T>(state: &State, mut map: impl FnMut() -> Option<T>) -> Option<T> {
    map().or_else(|| if unmap_unused_everywhere(state) { map() } else { None })
}

/// Every arena's [`Arena::unmap_unused`]; whether any gave address space back.
#[cold]
#[inline(never)]
fn unmap_unused_everywhere(state: &State) -> bool {
    let mut freed = 0;
    for n in state.nodes().iter() {
        if let Some(a) = state.arena(n) {
            freed += a.unmap_unused();
        }
    }
    freed > 0
}

impl Window {
    /// Nothing summed, never started.
    pub(crate) const NEW: Self = Self { sum: 0, from: 0 };

    /// Adds `bytes` at `now` and returns the sum, starting a new window
    /// first if this one never started or `span` ms or more have passed
    /// since it did: a sum over at most `span` ms, counted from its first
    /// `add`, so bytes spread thinly over a long time never add up to a
    /// burst.
    pub(crate) fn add(&mut self, now: u64, span: u64, bytes: u64) -> u64 {
        if self.from == 0 || now >= self.from.saturating_add(span) {
            self.restart(now);
        }
        self.sum = self.sum.saturating_add(bytes);
        self.sum
    }

    /// Starts a new, empty window at `now`: what was summed has been
    /// acted on.
    pub(crate) fn restart(&mut self, now: u64) {
        (self.sum, self.from) = (0, now);
    }
}
