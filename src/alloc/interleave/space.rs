//! Spaces: the regions an interleaver carves from, one current region per
//! node, replaced when full.
//!
//! A [`ThreadSpace`] is carved by one thread (a thread interleaver's): plain
//! cells, no lock, and each region is charged [`CREDIT`] references up front
//! (what is left given back when it is retired) instead of one atomic
//! operation per block. It keeps every region it still has blocks in, and
//! moves to one with room before it maps another, so a thread with many
//! buffers live reuses the space their frees leave. A [`SharedSpace`] (an interleave handle's) is
//! carved under a per-node lock, one reference taken per block.

use core::cell::Cell;
use core::ptr::{self, NonNull};

use crate::alloc::engine::types::State;
use crate::alloc::region::{self, NodeRegion, REGION_ALIGN_MAX, UNIT, units_for};
use crate::os::mem::Huge;
use crate::sync::{AtomicPtr, Ordering, SpinLock};
use crate::topology::MAX_NODES;

/// References a thread space charges a region with (more than it can hold
/// blocks).
const CREDIT: usize = 1 << 24;

/// A turn's first block starts on `turn_align` bytes (a page, or 2 MiB for
/// byte turns of 2 MiB or more, so whole huge pages belong to one node, in
/// regions that huge pages may back), within what a region can give.
fn turn_units(turn_align: usize) -> usize {
    turn_align.clamp(UNIT, crate::alloc::engine::types::SEGMENT_SIZE / 2) / UNIT
}

/// See the module docs.
pub(crate) struct ThreadSpace {
    current: [Cell<*mut NodeRegion>; MAX_NODES],
    /// Per node, the space's other regions (linked through
    /// `NodeRegion::next_owned`): full when they stopped being current, they get
    /// room back as their blocks are freed.
    others: [Cell<*mut NodeRegion>; MAX_NODES],
    turn_units: usize,
    /// The owning interleaver's address, written into its regions (set when
    /// the interleaver has its final address, before it carves).
    owner: Cell<usize>,
    /// The pages for its regions (the policy's, else the process's).
    huge: Huge,
}

impl ThreadSpace {
    pub(crate) fn new(turn_align: usize, huge: Huge) -> Self {
        Self {
            current: core::array::from_fn(|_| Cell::new(ptr::null_mut())),
            others: core::array::from_fn(|_| Cell::new(ptr::null_mut())),
            turn_units: turn_units(turn_align),
            owner: Cell::new(0),
            huge,
        }
    }

    /// Records the owning interleaver's address.
    pub(crate) fn set_owner(&self, owner: usize) {
        debug_assert!(self.current.iter().all(|c| c.get().is_null()), "regions carved before the owner was known");
        self.owner.set(owner);
    }

    /// The current region for `node` (null: none yet).
    #[inline(always)]
    pub(crate) fn region(&self, node: usize) -> *mut NodeRegion {
        self.current[node].get()
    }

    /// A turn's first block starts on this many units.
    pub(crate) fn turn_units(&self) -> usize {
        self.turn_units
    }

    /// A block of `size` bytes aligned to `align` (≤ [`REGION_ALIGN_MAX`])
    /// on `node`, part of cursor turn `turn`: a block the thread freed, else
    /// carved. Null when the node's arena cannot map a region.
    pub(crate) fn alloc(&self, node: usize, size: usize, align: usize, turn: u64) -> *mut u8 {
        debug_assert!(align <= REGION_ALIGN_MAX);
        let units = units_for(size);
        let align = align.max(UNIT);
        loop {
            let r = self.current[node].get();
            // SAFETY: the regions of a thread space are carved and retired
            // by this thread only.
            if let Some(reg) = unsafe { r.as_ref() }
                && reg.credit() > 0
            {
                // SAFETY: as above.
                let p = unsafe {
                    reg.pop_reuse(units, align)
                        .or_else(|| reg.carve(units, align / UNIT, turn, self.turn_units))
                        .or_else(|| {
                            reg.reclaim_reuse().then(|| reg.carve(units, align / UNIT, turn, self.turn_units))?
                        })
                };
                if let Some(p) = p {
                    reg.set_credit(reg.credit() - 1);
                    return p;
                }
            }
            // A region with room for the block at a turn's alignment: a
            // turn may start there.
            if !self.next_region(node, units, (align / UNIT).max(self.turn_units)) {
                return ptr::null_mut();
            }
        }
    }

    /// Makes another region current for `node`: one of the space's others
    /// with room for `units` units aligned to `align` units, else a fresh
    /// one. Regions found with no live block on the way are retired (their
    /// mapping goes back to the arena). False when none can be mapped.
    #[cold]
    fn next_region(&self, node: usize, units: usize, align: usize) -> bool {
        let cur = self.current[node].get();
        let mut link = &self.others[node];
        let mut found: *mut NodeRegion = ptr::null_mut();
        loop {
            let r = link.get();
            if r.is_null() {
                break;
            }
            // SAFETY: one of this space's regions, this thread's.
            let reg = unsafe { &*r };
            let next = reg.next_owned.get();
            // SAFETY: as above: we carve it.
            if found.is_null() && reg.credit() > 0 && unsafe { reg.has_room(units, align) } {
                found = r;
                link.set(next);
                continue;
            }
            if reg.is_unused() {
                link.set(next);
                // SAFETY: ours, off the list, retired once.
                unsafe { region::retire(NonNull::new_unchecked(r)) };
                continue;
            }
            link = &reg.next_owned;
        }
        if found.is_null() {
            let Some(state) = State::try_get() else { return false };
            debug_assert_ne!(self.owner.get(), 0);
            let Some(fresh) = region::map(state, node, CREDIT, self.owner.get(), self.huge) else { return false };
            found = fresh.as_ptr();
        }
        if !cur.is_null() {
            // SAFETY: ours.
            unsafe { (*cur).next_owned.set(self.others[node].get()) };
            self.others[node].set(cur);
        }
        self.current[node].set(found);
        true
    }
}

impl Drop for ThreadSpace {
    fn drop(&mut self) {
        for node in 0..MAX_NODES {
            let mut r = self.current[node].replace(ptr::null_mut());
            if r.is_null() {
                r = self.others[node].replace(ptr::null_mut());
            } else {
                // SAFETY: ours.
                unsafe { (*r).next_owned.set(self.others[node].replace(ptr::null_mut())) };
            }
            while let Some(reg) = NonNull::new(r) {
                // SAFETY: ours, carved by this thread only; each retired
                // once, here, its unused credit and the owner's frees
                // settled.
                unsafe {
                    r = reg.as_ref().next_owned.get();
                    region::retire(reg);
                }
            }
        }
    }
}

/// See the module docs.
pub(crate) struct SharedSpace {
    current: [AtomicPtr<NodeRegion>; MAX_NODES],
    locks: [SpinLock<()>; MAX_NODES],
    turn_units: usize,
    /// The pages for its regions (the policy's, else the process's).
    huge: Huge,
    /// The next space of [`SPACES`] (written under its lock).
    next: AtomicPtr<SharedSpace>,
}

/// Every registered space ([`SharedSpace::register`]), linked through
/// `next`, for the `fork()` handlers: a child forked while another thread
/// carves from a handle finds the handle's locks free.
static SPACES: SpinLock<SpaceList> = SpinLock::new(SpaceList(ptr::null_mut()));
struct SpaceList(*mut SharedSpace);
// SAFETY: the listed spaces are `Sync`; the list is followed under the lock.
unsafe impl Send for SpaceList {}

/// Before `fork()`: the list of spaces, then each space's node locks (a
/// space's lock is held while its region is mapped from an arena: the
/// arenas come later, in the core's rank).
pub(crate) fn lock_spaces_for_fork() {
    SPACES.lock_raw();
    // SAFETY: the list is ours (just locked); a listed space is live until
    // its drop unlinks it, which waits for the list's lock.
    unsafe {
        let mut sp = (*SPACES.raw_value()).0;
        while let Some(space) = sp.as_ref() {
            space.locks.iter().for_each(SpinLock::lock_raw);
            sp = space.next.load(Ordering::Relaxed);
        }
    }
}

/// After `fork()`, in the parent and the child: releases what
/// [`lock_spaces_for_fork`] took.
///
/// # Safety
/// Taken by `lock_spaces_for_fork` on this thread (or, in the child, the
/// thread it was copied from).
pub(crate) unsafe fn unlock_spaces_after_fork() {
    // SAFETY: this thread (or, in the child, its original) took the list's lock and
    // every space's lock in `lock_spaces_for_fork` (the caller's word); listed spaces
    // are live while the list is locked.
    unsafe {
        let mut sp = (*SPACES.raw_value()).0;
        while let Some(space) = sp.as_ref() {
            space.locks.iter().for_each(|l| l.unlock_raw());
            sp = space.next.load(Ordering::Relaxed);
        }
        SPACES.unlock_raw();
    }
}

// SAFETY: the current regions are carved under their node's lock; a region
// is retired under the same lock before anyone may free it.
unsafe impl Sync for SharedSpace {}
// SAFETY: as above.
unsafe impl Send for SharedSpace {}

impl SharedSpace {
    pub(crate) fn new(turn_align: usize, huge: Huge) -> Self {
        Self {
            current: core::array::from_fn(|_| AtomicPtr::new(ptr::null_mut())),
            locks: core::array::from_fn(|_| SpinLock::new(())),
            turn_units: turn_units(turn_align),
            huge,
            next: AtomicPtr::new(ptr::null_mut()),
        }
    }

    /// Lists the space for the `fork()` handlers, at its final address
    /// (boxed: it stays there until dropped, which unlists it).
    pub(crate) fn list_for_fork(&self) {
        let mut l = SPACES.lock();
        self.next.store(l.0, Ordering::Relaxed);
        l.0 = ptr::from_ref(self).cast_mut();
    }

    /// A block of `size` bytes aligned to `align` on `node`, part of cursor
    /// turn `turn`. Null when the node's arena cannot map a region.
    ///
    /// A thread takes a reference on a region only while it is current, under
    /// the node's lock, and a region stops being current (and is retired)
    /// under the same lock: nobody touches a region freed under them.
    pub(crate) fn alloc(&self, node: usize, size: usize, align: usize, turn: u64) -> *mut u8 {
        debug_assert!(align <= REGION_ALIGN_MAX);
        let units = units_for(size);
        let align = align.max(UNIT) / UNIT;
        let _g = self.locks[node].lock();
        loop {
            let r = self.current[node].load(Ordering::Relaxed);
            if !r.is_null() {
                // SAFETY: current, so live; we hold the carving lock.
                let reg = unsafe { &*r };
                // SAFETY: as above.
                if let Some(p) = unsafe { reg.carve(units, align, turn, self.turn_units) } {
                    reg.acquire();
                    return p;
                }
            }
            let Some(state) = State::try_get() else { return ptr::null_mut() };
            let Some(fresh) = region::map(state, node, 0, 0, self.huge) else { return ptr::null_mut() };
            let old = self.current[node].swap(fresh.as_ptr(), Ordering::Relaxed);
            if let Some(old) = NonNull::new(old) {
                // SAFETY: no longer current, under the lock: retired once.
                unsafe { region::retire(old) };
            }
        }
    }
}

impl Drop for SharedSpace {
    fn drop(&mut self) {
        // Unlisted first (waiting for a `fork()` that holds the list): the
        // fork handlers never see a space being dropped.
        {
            let mut l = SPACES.lock();
            let me = ptr::from_mut(self);
            let mut at: *mut *mut SharedSpace = &mut l.0;
            // SAFETY: the list's links, under its lock; each listed space is
            // live. A space never registered is not found.
            unsafe {
                while !(*at).is_null() {
                    if *at == me {
                        *at = self.next.load(Ordering::Relaxed);
                        break;
                    }
                    at = (**at).next.as_ptr();
                }
            }
        }
        for node in 0..MAX_NODES {
            let r = self.current[node].swap(ptr::null_mut(), Ordering::Relaxed);
            if let Some(r) = NonNull::new(r) {
                // SAFETY: `&mut self`: nobody carves; retired once.
                unsafe { region::retire(r) };
            }
        }
    }
}
