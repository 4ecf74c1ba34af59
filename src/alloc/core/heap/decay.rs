//! The heap's part in giving memory back (the process-wide part is
//! `core/lifecycle.rs`): the heartbeat of its refills, which ticks the
//! lifecycle when something is due; keeping a quiet thread within reach of
//! its refills while something is; giving back what the heap holds free
//! (its free caches' blocks, kept pages, collected remote frees, empty
//! pages) when it has gone quiet, when asked to trim, and for an exited
//! thread's heap, by whichever thread reclaims it.
//!
//! A thread's fast paths never look at a clock. What brings a thread that
//! has gone quiet (a few calls a second, each served by the fast path) back
//! to its refills is *arming*: while something is due, a slow path the
//! thread takes (a refill that looked at the clock, a page event of a
//! free, a free into an exited thread's or the shared heap's page) empties
//! its direct slots, once per clock tick (4 ms), so that each class's next
//! allocation refills. While something is due, a refill fills the class's
//! slot again only once the class has refilled more than [`BUSY_REFILLS`]
//! times in the clock tick: a busy class. A quiet class's refill serves its
//! block and leaves the slot empty, so its next allocation refills too, and
//! the one after the due time ticks. A busy thread pays a few refills per
//! class per tick while something is due, and nothing on its fast paths;
//! a thread that went quiet right after it was busy, with slots still
//! filled, is brought back by its frees' page events and its other slow
//! paths.

use core::ptr;

use super::super::lifecycle;
use super::*;

/// Refills between two looks at the clock while the heap is busy (it looks
/// at every refill while armed or quiet).
const CLOCK_EVERY: u32 = 8;

/// A class that refills more than this many times in a clock tick is busy:
/// its refill fills the slot while something is due. (A rule on the
/// heap's refills, all classes together, filled the slots of a quiet
/// program whose calls each make a burst of allocations, as reading a
/// small file does; one on the time since the class's last refill, those
/// of a program that went quiet within a tick of its last burst: their
/// freed memory was never purged.)
const BUSY_REFILLS: u8 = 8;

/// A class that refilled at least this many times per purge delay since
/// the heap's last decay is in use: the decay leaves it alone (a steady
/// loop keeps its pages; only classes gone quiet give back).
const DECAY_BUSY_REFILLS: u64 = 8;

/// A set of size classes, one bit each.
pub(crate) type ClassSet = u128;
pub(crate) const ALL_CLASSES: ClassSet = ClassSet::MAX;
const _: () = assert!(CLASSES <= ClassSet::BITS as usize);

/// The heap's lifecycle state, written by its owner (or its reclaimer);
/// `page_bytes` is read by anyone for the statistics.
pub(crate) struct HeapLife {
    /// When (ms, coarse: 4 ms steps) the heap last looked at the clock.
    last_look: u64,
    /// Per class, the clock tick (ms, wrapping) of its last refill while the
    /// heap looked at the clock, and its refills in that tick.
    class_at: [u32; CLASSES],
    class_refills: [u8; CLASSES],
    /// When the heap last emptied its direct slots for the lifecycle.
    armed_at: u64,
    /// When a free's slow path last emptied the direct slots: once a tick
    /// too, apart from the refills' arming, which a refill of a busy class
    /// in the same tick (its slot filled again) would otherwise leave the
    /// last word to (a thread that frees a burst and goes quiet within that
    /// tick then never refilled again).
    event_armed_at: u64,
    /// Whether the next refill looks at the clock (armed, or a class of it
    /// found quiet at the last look).
    listen: bool,
    /// When the heap last gave back what it holds free (quiet, or trimmed).
    decayed_at: u64,
    /// The trim epoch last seen (see `Lifecycle::request_trim`).
    trim_seen: u64,
    /// Per class, its refills since the heap's last decay (saturating).
    pub(super) window_refills: [u16; CLASSES],
    /// The last decay kept classes in use that hold memory: the heap looks
    /// at the clock at its refills until a decay finds them quiet too,
    /// whether or not anything else is due (a thread that goes quiet right
    /// after a burst would otherwise keep the burst: nothing else would
    /// bring it back to its refills).
    owed: bool,
    /// An exited thread's heap: when (ms) its thread exited, leaving the
    /// free blocks of its pages in use resident (for the next thread of the
    /// node, which most likely adopts it); 0 when none are kept. The
    /// lifecycle purges them once they waited out the delay
    /// (`lifecycle::reclaim_orphans`). Written by the heap's owner (the
    /// exiting thread, a claimer, an adopter) only.
    pub(crate) kept_since: u64,
    /// Bytes of the pages the heap holds.
    pub(crate) page_bytes: AtomicU64,
    /// Unit tests of the heap's pages and free caches: the lifecycle
    /// leaves this heap's slots alone (other tests' frees, in the same
    /// process, make work due at any time).
    #[cfg(test)]
    pub(super) steady: bool,
}

impl HeapLife {
    pub(super) const fn new() -> HeapLife {
        HeapLife {
            last_look: 0,
            class_at: [0; CLASSES],
            class_refills: [0; CLASSES],
            armed_at: 0,
            event_armed_at: 0,
            listen: false,
            decayed_at: 0,
            trim_seen: 0,
            window_refills: [0; CLASSES],
            owed: false,
            kept_since: 0,
            page_bytes: AtomicU64::new(0),
            #[cfg(test)]
            steady: false,
        }
    }
}

/// What a refill's heartbeat found.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Beat {
    /// Nothing for the lifecycle, or not looked: fill the slot.
    Busy,
    /// Looked at the clock (at this time, ms) while something is due: arm,
    /// and fill the slot only if the class is busy.
    Looked(u64),
    /// Looked at the clock for the heap's own decay alone (it owes one):
    /// fill the slot only if the class is busy; nothing to arm.
    Owed(u64),
}

impl Heap {
    /// At the start of a refill: a trim asked of every heap, a look at the
    /// clock when something is due (or the heap listens), the lifecycle's
    /// tick when it is time, the heap's own decay when it has gone quiet.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap, between operations on it.
    #[inline]
    #[unsafe(link_section = ".text.hot.numaweave")]
    pub(super) unsafe fn heartbeat(heap: *mut Heap, state: &State) -> Beat {
        // SAFETY: per the contract: the lifecycle fields are the owner's.
        unsafe {
            let life = &mut (*heap).life;
            #[cfg(test)]
            if life.steady {
                return Beat::Busy;
            }
            if life.trim_seen != state.life.trim_epoch() {
                return Heap::heartbeat_slow(heap, state);
            }
            if !life.listen && !life.owed && (!state.life.pending() || !(*heap).refills.is_multiple_of(CLOCK_EVERY)) {
                return Beat::Busy;
            }
            Heap::heartbeat_slow(heap, state)
        }
    }

    /// [`heartbeat`](Self::heartbeat) past its first tests.
    ///
    /// # Safety
    /// As [`heartbeat`](Self::heartbeat).
    #[cold]
    #[inline(never)]
    #[unsafe(link_section = ".text.hot.numaweave")]
    unsafe fn heartbeat_slow(heap: *mut Heap, state: &State) -> Beat {
        // SAFETY: per the contract.
        unsafe {
            let epoch = state.life.trim_epoch();
            if (*heap).life.trim_seen != epoch {
                (*heap).life.trim_seen = epoch;
                Heap::trim(heap);
            }
            let now = crate::os::monotonic_ms();
            let life = &mut (*heap).life;
            let new_tick = now != life.last_look;
            life.last_look = now;
            lifecycle::tick(state, now);
            let delay = state.config.purge_delay_ms.max(1);
            if (life.listen || life.owed) && new_tick && now.saturating_sub(life.decayed_at) >= delay {
                // Quiet (a class of it was), and not given back for a delay:
                // what the quiet classes hold free goes back to their pages
                // and arenas (and from them to the OS when due). A class
                // still in use keeps its pages: purging them would only
                // have them faulted in again.
                let elapsed = now.saturating_sub(life.decayed_at);
                let mut quiet: ClassSet = 0;
                for (class, n) in life.window_refills.iter_mut().enumerate() {
                    if u64::from(*n) * delay < DECAY_BUSY_REFILLS * elapsed {
                        quiet |= 1 << class;
                    }
                    *n = 0;
                }
                life.decayed_at = now;
                Heap::give_back_free_as(heap, true, quiet);
                // The classes kept that hold memory are owed a later look:
                // their slots emptied, so that even a quiet thread's next
                // allocation of each refills and comes back here.
                let mut owed = false;
                for class in (0..CLASSES).filter(|&c| quiet & (1 << c) == 0) {
                    if !(*heap).lists[class].head.is_null() || !(*Heap::cache_page(heap, class)).free.is_null() {
                        owed = true;
                        if !Heap::is_lent(heap, class) {
                            Heap::set_direct(heap, class, empty_page());
                            (*heap).cache_serves[class] = false;
                        }
                    }
                }
                (*heap).life.owed = owed;
            }
            // (Set again by `after_beat` if the class proves quiet.)
            (*heap).life.listen = false;
            match (state.life.pending(), (*heap).life.owed) {
                (true, _) => Beat::Looked(now),
                (false, true) => Beat::Owed(now),
                (false, false) => Beat::Busy,
            }
        }
    }

    /// After a refill of `class` served, what its heartbeat asked: arm, and
    /// leave the slot empty unless the class is busy (more than
    /// [`BUSY_REFILLS`] refills in this tick: see the module's docs); the
    /// heap listens on while a class of it is quiet.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap; its refill is done.
    #[cold]
    #[inline(never)]
    #[unsafe(link_section = ".text.hot.numaweave")]
    pub(super) unsafe fn after_beat(heap: *mut Heap, class: usize, beat: Beat) {
        let (now, arm) = match beat {
            Beat::Busy => return,
            Beat::Looked(now) => (now, true),
            Beat::Owed(now) => (now, false),
        };
        // SAFETY: per the contract; a lent slot is the lender's to end.
        unsafe {
            let life = &mut (*heap).life;
            if life.class_at[class] != now as u32 {
                life.class_at[class] = now as u32;
                life.class_refills[class] = 0;
            }
            life.class_refills[class] = life.class_refills[class].saturating_add(1);
            let busy = life.class_refills[class] > BUSY_REFILLS;
            if arm {
                Heap::arm_at(heap, now);
            }
            if !busy {
                (*heap).life.listen = true;
                if !Heap::is_lent(heap, class) {
                    Heap::set_direct(heap, class, empty_page());
                }
            }
        }
    }

    /// Empties the heap's direct slots (but a lent one) while something is
    /// due, at most once per clock tick: each class's next allocation
    /// refills and so looks at the clock (see the module's docs). Called
    /// where no operation on the heap is under way: after a refill served,
    /// at the end of a free's page event, after a free into an exited
    /// thread's page.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap, between operations on it.
    #[inline]
    pub(crate) unsafe fn arm(heap: *mut Heap, state: &State) {
        #[cfg(test)]
        // SAFETY: per the contract.
        if unsafe { (*heap).life.steady } {
            return;
        }
        if state.life.pending() {
            let now = crate::os::monotonic_ms();
            // SAFETY: per the contract.
            unsafe {
                let life = &mut (*heap).life;
                if life.event_armed_at == now {
                    return;
                }
                life.event_armed_at = now;
                // Even if a refill armed in this tick: it may have filled a
                // busy class's slot since.
                life.armed_at = 0;
                Heap::arm_at(heap, now);
            }
        }
    }

    /// [`arm`](Self::arm) at `now` (ms), something being due.
    ///
    /// # Safety
    /// As [`arm`](Self::arm).
    #[cold]
    #[inline(never)]
    #[unsafe(link_section = ".text.hot.numaweave")]
    unsafe fn arm_at(heap: *mut Heap, now: u64) {
        // SAFETY: per the contract.
        unsafe {
            if (*heap).life.armed_at == now {
                return;
            }
            (*heap).life.armed_at = now;
            (*heap).life.listen = true;
            // Busy is counted again from here: a thread that frees a burst
            // and goes quiet within the tick of its last allocations
            // would otherwise find those classes busy still.
            (*heap).life.class_refills = [0; CLASSES];
            for class in 0..CLASSES {
                if !Heap::is_lent(heap, class) {
                    Heap::set_direct(heap, class, empty_page());
                    (*heap).cache_serves[class] = false;
                }
            }
        }
    }

    /// Gives back what the heap holds free: its free caches' blocks to
    /// their pages, its kept pages and every page left empty (remote frees
    /// collected first) to their arenas. The direct slots are emptied (but
    /// a lent one): the next allocation of each class refills.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap, between operations on it (or
    /// an exited thread's, claimed).
    #[unsafe(link_section = ".text.hot.numaweave")]
    pub(crate) unsafe fn give_back_free(heap: *mut Heap) {
        // SAFETY: forwarded contract.
        unsafe { Heap::give_back_free_as(heap, true, ALL_CLASSES) }
    }

    /// [`give_back_free`](Self::give_back_free) for the classes in
    /// `classes` (remote frees are collected for all); with `purge_blocks`
    /// false the free blocks of pages still in use stay resident (a thread
    /// that exits or adopts: the next thread of the node most likely takes
    /// those pages again; the lifecycle purges them once they waited out
    /// the delay).
    ///
    /// # Safety
    /// As for `give_back_free`.
    #[unsafe(link_section = ".text.hot.numaweave")]
    pub(crate) unsafe fn give_back_free_as(heap: *mut Heap, purge_blocks: bool, classes: ClassSet) {
        let given = |class: usize| classes & (1 << class) != 0;
        // SAFETY: per the contract.
        unsafe {
            for class in (0..CLASSES).filter(|&c| given(c)) {
                if !Heap::is_lent(heap, class) {
                    Heap::set_direct(heap, class, empty_page());
                    (*heap).cache_serves[class] = false;
                }
                if !(*Heap::cache_page(heap, class)).free.is_null() {
                    Heap::flush_cache(heap, class, 0, false);
                }
                Heap::set_cache_src(heap, class, ptr::null_mut());
            }
            Heap::gather_remote(heap);
            while !(*heap).pending.is_null() {
                Heap::take_remote(heap, (*heap).pending, true);
            }
            for class in (0..CLASSES).filter(|&c| given(c)) {
                (*heap).kept_empty[class] = ptr::null_mut();
                let mut p = (*heap).lists[class].head;
                while !p.is_null() {
                    let next = (*p).next;
                    if (*p).used == 0 && (*heap).direct[class] != p {
                        (*heap).release_page(p);
                    } else if purge_blocks {
                        Heap::purge_free_blocks(p);
                    }
                    p = next;
                }
            }
        }
    }

    /// Gives back to the OS the memory of `page`'s free blocks (every whole
    /// OS page of a block past the one that holds its link) and of its
    /// uncarved tail (which a page made of a free page's slots may hold
    /// resident from an earlier class), once until the page serves again:
    /// a page that random frees left partly used, of a class the program
    /// no longer asks for, does not keep its free blocks resident. Their
    /// memory reads as zeroes when handed out again, faulted in on the
    /// node its range is bound to. Not in hardened builds (the poison of
    /// `NUMAWEAVE_CHECK=full` fills a free block).
    ///
    /// # Safety
    /// `page` is a live page of the caller's heap (or of a claimed one).
    #[cold]
    unsafe fn purge_free_blocks(page: *mut Page) {
        #[cfg(not(feature = "hardened"))]
        // SAFETY: owner-only fields of a live page of the caller's; the
        // ranges purged are free blocks' memory past their links, and the
        // page's never handed out tail, which no one reads.
        unsafe {
            if (*page).purged {
                return;
            }
            (*page).purged = true;
            let os_page = crate::os::page_size();
            let bs = (*page).info.block_size as usize;
            let start = (*page).info.start as usize;
            let end = page_span(page).end;
            let purge = |from: usize, to: usize| {
                let (a, b) = (from.next_multiple_of(os_page), to & !(os_page - 1));
                if a < b {
                    let _ = crate::os::mem::decommit(core::ptr::NonNull::new_unchecked(a as *mut u8), b - a);
                }
            };
            purge(start + (*page).carved as usize * bs, end);
            if bs > os_page {
                let mut b = (*page).free;
                while !b.is_null() {
                    // (Past the link: the first word stays.)
                    purge(b as usize + core::mem::size_of::<usize>(), b as usize + bs);
                    b = next_of(page, b);
                }
            }
        }
        #[cfg(feature = "hardened")]
        let _ = page;
    }

    /// Trims the calling thread's heap: what it holds free goes back (the
    /// arenas then return it to the OS, see `lifecycle::trim`).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap, between operations on it.
    pub(crate) unsafe fn trim(heap: *mut Heap) {
        // SAFETY: per the contract.
        unsafe {
            Heap::give_back_free(heap);
            (*heap).life.decayed_at = crate::os::monotonic_ms();
            (*heap).life.owed = false;
        }
    }

    /// An exited thread's heap, claimed by the caller: the remote frees of
    /// its pages collected, its empty pages given back.
    ///
    /// # Safety
    /// `heap` is an exited thread's heap that the caller claimed (no other
    /// thread adopts or collects it meanwhile).
    pub(crate) unsafe fn collect_orphan(heap: *mut Heap, now: u64, delay: u64) {
        // SAFETY: per the contract: the heap is the caller's until let go.
        unsafe {
            debug_assert!((*heap).direct.iter().all(|&d| d == empty_page()), "an orphan with direct pages");
            let kept = (*heap).life.kept_since;
            let purge = kept == 0 || now.saturating_sub(kept) >= delay;
            Heap::give_back_free_as(heap, purge, ALL_CLASSES);
            if purge {
                (*heap).life.kept_since = 0;
            }
        }
    }

    /// Bytes of the pages the heap holds.
    pub(crate) fn held_bytes(&self) -> u64 {
        self.life.page_bytes.load(Ordering::Relaxed)
    }
}
