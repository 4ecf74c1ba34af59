//! A heap's decay: the heartbeat of its refills, which ticks the
//! lifecycle when something is due, keeps a quiet thread within reach of
//! its refills while something is, and gives back what the heap's quiet
//! classes hold free once it has gone quiet (the mechanisms are the
//! heap's: `heap/giveback.rs`). Its states are [`Decay`]'s. A heap that
//! grows by the purge threshold in fresh pages gives back, then, what the
//! classes it has not refilled since its last decay hold free
//! ([`refill`]): growth, not the clock, says an adopted heap's old classes
//! are not this thread's.
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
//!
//! Transitions ([`HeapLife::set`] asserts them): `Busy` → `Listening`
//! (armed, a refill of a quiet class, or a look from the per-CPU caches'
//! heartbeat while work waits, [`look`]); `Listening` → `Busy` (each look
//! at the clock; a quiet class sets it again); a look that decays →
//! `Owed` (it kept classes in use that hold memory) or `Busy`; a trim →
//! `Busy`.

use super::tick;
use crate::alloc::engine::heap::{GROWN, Heap, Placement, empty_page};
use crate::alloc::engine::size_class::CLASSES;
use crate::alloc::engine::types::{ALL_CLASSES, ClassSet, Decay, HeapLife, State};

/// Refills between two looks at the clock while the heap is busy (it looks
/// at every refill while armed or quiet).
const CLOCK_EVERY: u32 = 8;

/// Refills between two looks at whether the classes' usage is due to be
/// published (`published.rs`; a flag's test when the process does not).
const PUBLISH_EVERY: u32 = 64;

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

/// What a refill's heartbeat found.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Beat {
    /// Nothing for the lifecycle, or not looked: fill the slot.
    Busy,
    /// Looked at the clock (at this time, ms) while something is due: arm,
    /// and fill the slot only if the class is busy.
    Looked(u64),
    /// Looked at the clock for the heap's own decay alone (it owes one):
    /// fill the slot only if the class is busy; nothing to arm.
    Owed(u64),
}

/// A refill of `class` for the calling thread's heap ([`Heap::refill`])
/// with the lifecycle around it: the heartbeat first (a trim asked of every
/// heap, the tick when something is due, the heap's decay when it has gone
/// quiet), and after it served, what the heartbeat asked (arm; a quiet
/// class's slot left empty). What the facade's slow paths call.
///
/// Inlined into one function per placement, so that the default's alone
/// is placed with the code every program runs (`placement::refill_any`).
///
/// # Safety
/// `heap` is the calling thread's heap.
#[inline(always)]
pub(crate) unsafe fn refill(heap: *mut Heap, class: usize, state: &State, placement: &mut impl Placement) -> *mut u8 {
    // SAFETY: the caller's heap, between operations on it (the heartbeat's)
    // and after the refill (the rest).
    unsafe {
        let beat = heartbeat(heap, state);
        let p = Heap::refill(heap, class, state, placement);
        if beat != Beat::Busy {
            after_beat(heap, class, beat);
        }
        // (Set by the heap's fresh pages, `Heap::fresh_page`.)
        if (*heap).life.grow_mark == GROWN {
            untouched_back(heap);
        }
        if (*heap).refills.is_multiple_of(PUBLISH_EVERY) {
            super::published::beat(state);
        }
        p
    }
}

/// At the start of a refill: a trim asked of every heap, a look at the
/// clock when something is due (or the heap listens), the lifecycle's tick
/// when it is time, the heap's own decay when it has gone quiet.
///
/// # Safety
/// `heap` is the calling thread's heap, between operations on it.
#[inline]
#[unsafe(link_section = ".text.sorted.numaweave")]
unsafe fn heartbeat(heap: *mut Heap, state: &State) -> Beat {
    // SAFETY: `heap` is the calling thread's heap, between operations on it (the caller's
    // word): its lifecycle fields are the owner's, ours.
    unsafe {
        let life = &(*heap).life;
        #[cfg(test)]
        if life.steady {
            return Beat::Busy;
        }
        if life.trim_seen != state.life.trim_epoch() {
            return heartbeat_slow(heap, state);
        }
        if !life.decay.looks() && (!state.life.pending() || !(*heap).refills.is_multiple_of(CLOCK_EVERY)) {
            return Beat::Busy;
        }
        heartbeat_slow(heap, state)
    }
}

/// The heartbeat of a heap whose thread the per-CPU caches serve, from
/// their allocations (`lifecycle::cpu_beat`): such a heap may never refill
/// (its classes beyond the caches quiet), so it looks at the clock, ticks
/// and decays here.
///
/// # Safety
/// `heap` is the calling thread's heap, between operations on it.
pub(crate) unsafe fn look(heap: *mut Heap, state: &State) {
    // SAFETY: the caller's word, what `heartbeat_slow` asks; the heap's
    // lifecycle fields are ours.
    unsafe {
        let decayed_at = (*heap).life.decayed_at;
        let _ = heartbeat_slow(heap, state);
        if (*heap).life.decayed_at != decayed_at && (*heap).life.decay != Decay::Owed {
            // It decayed and owes nothing: done until work waits again.
            return;
        }
        // Work waited (the caches' allocations look only then) and no
        // refill of the heap's own classes came to look: listen, as a
        // heap's refills do when a class proves quiet, so that a look a
        // delay later decays what its quiet classes hold free (a class
        // still refilling is kept, as ever); and come back then, as no
        // refill of its own may come to look (the caches serve the thread).
        if (*heap).life.decay == Decay::Busy {
            (*heap).life.set(Decay::Listening);
        }
        state.look_in_a_delay();
    }
}

/// [`heartbeat`] past its first tests.
///
/// # Safety
/// As [`heartbeat`].
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
unsafe fn heartbeat_slow(heap: *mut Heap, state: &State) -> Beat {
    // SAFETY: `heap` is the calling thread's heap, between operations on it (as
    // `heartbeat`'s caller says): its fields are ours, as `trim_heap` and `decay` ask.
    unsafe {
        debug_assert!((*heap).life.decay.live(), "a heartbeat of a heap no thread owns");
        let epoch = state.life.trim_epoch();
        if (*heap).life.trim_seen != epoch {
            (*heap).life.trim_seen = epoch;
            trim_heap(heap);
        }
        let now = crate::os::monotonic_ms();
        let life = &mut (*heap).life;
        let new_tick = now != life.last_look;
        life.last_look = now;
        tick(state, now);
        let delay = state.config.purge_delay_ms.max(1);
        if life.decay.looks() && new_tick && now.saturating_sub(life.decayed_at) >= delay {
            decay(heap, now, delay);
        }
        // A look ends listening (set again by `after_beat` if the class
        // proves quiet); what is owed stays owed until a decay pays it.
        if (*heap).life.decay == Decay::Listening {
            (*heap).life.set(Decay::Busy);
        }
        match (state.life.pending(), (*heap).life.decay == Decay::Owed) {
            (true, _) => Beat::Looked(now),
            (false, true) => Beat::Owed(now),
            (false, false) => Beat::Busy,
        }
    }
}

/// The heap has listened for a delay: what its quiet classes (fewer than
/// [`DECAY_BUSY_REFILLS`] refills per purge delay since the last decay)
/// hold free goes back to their pages and arenas (and from them to the OS
/// when due). A class still in use keeps its pages (purging them would
/// only have them faulted in again), and is owed a later look.
///
/// # Safety
/// `heap` is the calling thread's heap, between operations on it.
unsafe fn decay(heap: *mut Heap, now: u64, delay: u64) {
    // SAFETY: `heap` is the calling thread's heap, between operations on it (the caller's
    // word): its lifecycle, lists and slots are ours, as `give_back_free_as` asks.
    unsafe {
        let life: &mut HeapLife = &mut (*heap).life;
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
        // The classes kept that hold memory are owed a later look: their
        // slots emptied, so that even a quiet thread's next allocation of
        // each refills and comes back here.
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
        debug_assert!(
            (0..CLASSES).filter(|&c| quiet & (1 << c) != 0).all(|c| (*Heap::cache_page(heap, c)).free.is_null()),
            "a decay left a quiet class's free cache full"
        );
        (*heap).life.set(if owed { Decay::Owed } else { Decay::Busy });
    }
}

/// After a refill of `class` served, what its heartbeat asked: arm, and
/// leave the slot empty unless the class is busy (more than
/// [`BUSY_REFILLS`] refills in this tick: see the module's docs); the heap
/// listens on while a class of it is quiet.
///
/// # Safety
/// `heap` is the calling thread's heap; its refill is done.
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
unsafe fn after_beat(heap: *mut Heap, class: usize, beat: Beat) {
    let (now, arm) = match beat {
        Beat::Busy => return,
        Beat::Looked(now) => (now, true),
        Beat::Owed(now) => (now, false),
    };
    // SAFETY: `heap` is the calling thread's heap, its refill done (the caller's word):
    // its lifecycle and slots are ours; a lent slot is the lender's to end.
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
            if (*heap).life.decay == Decay::Busy {
                (*heap).life.set(Decay::Listening);
            }
            if !Heap::is_lent(heap, class) {
                Heap::set_direct(heap, class, empty_page());
            }
        }
    }
}

/// Trims the calling thread's heap: what it holds free goes back (the
/// arenas then return it to the OS, see [`trim`](super::trim)), and
/// nothing is owed any more.
///
/// # Safety
/// `heap` is the calling thread's heap, between operations on it.
pub(crate) unsafe fn trim_heap(heap: *mut Heap) {
    // SAFETY: `heap` is the calling thread's heap, between operations on it (the caller's
    // word), as `give_back_free_as` asks; its lifecycle fields are ours.
    unsafe {
        Heap::give_back_free_as(heap, true, ALL_CLASSES);
        (*heap).life.decayed_at = crate::os::monotonic_ms();
        if (*heap).life.decay == Decay::Owed {
            (*heap).life.set(Decay::Busy);
        }
        debug_assert!(
            (0..CLASSES).all(|c| (*Heap::cache_page(heap, c)).free.is_null() && (*heap).cache_src[c].is_null()),
            "a trimmed heap keeps cached blocks"
        );
        debug_assert!((*heap).kept_empty.iter().all(|k| k.is_null()), "a trimmed heap keeps an empty page");
    }
}

/// The heap took fresh pages worth the purge threshold since it last
/// looked: the classes it has not refilled since its last decay, and that
/// have no page to serve from in their slot (a class a loop keeps serving
/// from its page or its free cache refills seldom, but holds its slot),
/// give back what they hold free (their pages in use purged), before it
/// grows more.
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
unsafe fn untouched_back(heap: *mut Heap) {
    // SAFETY: the calling thread's heap, between operations (after a refill).
    unsafe {
        let mut quiet: ClassSet = 0;
        for class in 0..CLASSES {
            if (*heap).life.window_refills[class] == 0 && (*heap).direct[class] == empty_page() {
                quiet |= 1 << class;
            }
        }
        Heap::give_back_free_as(heap, true, quiet);
        (*heap).life.mark_growth();
    }
}
