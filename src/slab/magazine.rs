//! Magazines, the per-node depot, and the remote-free list: the concurrent
//! cache of the node slabs, after Bonwick and Adams, "Magazines and Vmem"
//! (USENIX 2001).
//!
//! A *magazine* is a thread-private stack of object pointers. Each thread keeps
//! two per cache and node ([`MagPair`]: `loaded` and `previous`), so the common
//! allocation and free are a pop or a push on memory no other thread touches.
//! When both are empty (or both full) the thread swaps one whole magazine with
//! the node's [`Depot`] under a short spin lock: one lock round trip per
//! `rounds` objects. Objects freed by a thread on another node never enter that
//! thread's magazines; they go home through the node's [`RemoteList`], a
//! lock-free stack that the node drains into its slabs.
//!
//! This module is built under `cfg(loom)` too: `loom-tests/` models the
//! depot exchange and the remote list with exactly this code.

use core::ptr::{self, NonNull};

use crate::sync::{AtomicStack, SpinLock};

/// The most rounds a magazine holds; a cache may use fewer
/// ([`MagPair::cap`]).
pub const MAG_MAX: usize = 64;

/// A stack of up to `cap` (≤ [`MAG_MAX`]) object pointers. The count and
/// capacity sit next to the first rounds, so a push or pop touches one or two
/// cache lines of thread-private memory.
#[repr(C)]
pub struct Magazine {
    len: usize,
    cap: usize,
    /// The depot's link; null while a thread holds the magazine.
    next: *mut Magazine,
    rounds: [*mut u8; MAG_MAX],
}

// SAFETY: a magazine holds raw pointers to objects; whoever holds the
// magazine owns them, and it moves between threads only through the depot's
// lock.
unsafe impl Send for Magazine {}

impl Magazine {
    /// An empty magazine on the heap that holds up to `cap` (clamped to
    /// 1..=[`MAG_MAX`]) objects.
    pub fn new(cap: usize) -> Box<Self> {
        Box::new(Self { len: 0, cap: cap.clamp(1, MAG_MAX), next: ptr::null_mut(), rounds: [ptr::null_mut(); MAG_MAX] })
    }

    /// Rounds it holds at most.
    #[inline]
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Objects held.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds nothing.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Takes the most recently pushed object.
    #[inline]
    pub fn pop(&mut self) -> Option<NonNull<u8>> {
        let n = self.len.checked_sub(1)?;
        self.len = n;
        // SAFETY: `n < len <= MAG_MAX`, and every pushed round is non-null.
        Some(unsafe { NonNull::new_unchecked(*self.rounds.get_unchecked(n)) })
    }

    /// Pushes `obj` unless full.
    #[inline]
    pub fn push(&mut self, obj: NonNull<u8>) -> bool {
        if self.len >= self.cap {
            return false;
        }
        // SAFETY: `len < cap <= MAG_MAX`.
        unsafe { *self.rounds.get_unchecked_mut(self.len) = obj.as_ptr() };
        self.len += 1;
        true
    }

    /// The objects held, oldest first.
    pub fn as_slice(&self) -> &[*mut u8] {
        &self.rounds[..self.len]
    }

    /// The rounds' storage, for a thread that caches the count outside the
    /// magazine while it owns it (see [`set_len`](Self::set_len)).
    #[inline]
    pub fn rounds_ptr(&mut self) -> *mut *mut u8 {
        self.rounds.as_mut_ptr()
    }

    /// Sets the count after rounds were pushed or popped through
    /// [`rounds_ptr`](Self::rounds_ptr).
    ///
    /// # Safety
    /// `len <= cap`, and rounds `0..len` hold objects the magazine's owner
    /// put there.
    #[inline]
    pub unsafe fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.cap);
        self.len = len;
    }

    /// Reverses the rounds from index `start` up: objects pushed in address
    /// order then pop in address order.
    pub fn reverse_from(&mut self, start: usize) {
        self.rounds[start.min(self.len)..self.len].reverse();
    }

    /// Forgets every object (the caller took them with [`as_slice`](Self::as_slice)).
    pub fn clear(&mut self) {
        self.len = 0;
    }
}

/// A thread's two magazines for one cache and node: Bonwick's `loaded` and
/// `previous`. `previous` is always either full or empty, which is what lets
/// one depot exchange serve `cap` more operations.
pub struct MagPair {
    loaded: Box<Magazine>,
    previous: Box<Magazine>,
}

impl MagPair {
    /// Two empty magazines used up to `cap` rounds (1..=[`MAG_MAX`]).
    pub fn new(cap: usize) -> Self {
        Self { loaded: Magazine::new(cap), previous: Magazine::new(cap) }
    }

    /// Rounds per magazine.
    #[inline]
    pub fn cap(&self) -> usize {
        self.loaded.cap
    }

    /// Objects held in both magazines.
    pub fn len(&self) -> usize {
        self.loaded.len() + self.previous.len()
    }

    /// Whether both magazines are empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The fast allocation: a pop from `loaded`.
    #[inline]
    pub fn pop(&mut self) -> Option<NonNull<u8>> {
        self.loaded.pop()
    }

    /// The fast free: a push onto `loaded`.
    #[inline]
    pub fn push(&mut self, obj: NonNull<u8>) -> bool {
        self.loaded.push(obj)
    }

    /// Makes `loaded` non-empty without touching the slabs, if it can: swaps
    /// in a full `previous`, or trades the empty `previous` for a full
    /// magazine from `depot`. False when the depot had none; the caller then
    /// fills [`loaded_mut`](Self::loaded_mut) from the slabs.
    pub fn reload(&mut self, depot: &Depot) -> bool {
        debug_assert!(self.loaded.is_empty());
        if self.previous.is_empty() && !depot.exchange_for_full(&mut self.previous) {
            return false;
        }
        // `previous` is full (kept, or just traded for): it becomes `loaded`,
        // and the empty `loaded` waits as `previous` for the next frees.
        core::mem::swap(&mut self.loaded, &mut self.previous);
        true
    }

    /// Makes room in `loaded`: swaps in an empty `previous`, or trades the
    /// full `previous` for an empty magazine from `depot`. False when the
    /// depot is at its bound: the caller gives `previous`'s objects back to
    /// the slabs ([`previous_mut`](Self::previous_mut)) and calls again.
    pub fn unload(&mut self, depot: &Depot) -> bool {
        debug_assert_eq!(self.loaded.len(), self.loaded.cap);
        if !self.previous.is_empty() && !depot.exchange_for_empty(&mut self.previous) {
            return false;
        }
        core::mem::swap(&mut self.loaded, &mut self.previous);
        true
    }

    /// `loaded`, for filling from the slabs (when empty) or bulk work.
    pub fn loaded_mut(&mut self) -> &mut Magazine {
        &mut self.loaded
    }

    /// `previous`, for emptying into the slabs when the depot is full.
    pub fn previous_mut(&mut self) -> &mut Magazine {
        &mut self.previous
    }

    /// Both magazines, for flushing every object back.
    pub fn magazines_mut(&mut self) -> [&mut Magazine; 2] {
        [&mut self.loaded, &mut self.previous]
    }
}

/// Full and empty magazines of one node, behind a spin lock held for a
/// handful of pointer moves.
pub struct Depot {
    lists: SpinLock<Lists>,
    max_full: usize,
    /// Rounds of the magazines it makes.
    cap: usize,
}

struct Lists {
    full: *mut Magazine,
    full_len: usize,
    full_objects: usize,
    empty: *mut Magazine,
    empty_len: usize,
    /// Once closed (the cache was dropped) the depot takes no more full
    /// magazines, so objects go straight back to their slabs.
    closed: bool,
}

// SAFETY: the lists hold magazines owned by the depot, reached only under the lock.
unsafe impl Send for Lists {}

/// Empty magazines kept for reuse; beyond, they are freed.
const MAX_EMPTY: usize = 16;

impl Depot {
    /// An empty depot that holds at most `max_full` full magazines (the rest
    /// go back to the slabs, where `shrink` can release them) and makes
    /// magazines of `cap` rounds.
    pub fn new(max_full: usize, cap: usize) -> Self {
        Self {
            lists: SpinLock::new(Lists {
                full: ptr::null_mut(),
                full_len: 0,
                full_objects: 0,
                empty: ptr::null_mut(),
                empty_len: 0,
                closed: false,
            }),
            max_full,
            cap,
        }
    }

    /// Trades the empty magazine in `mag` for a full one; false (and `mag`
    /// untouched) when the depot has none.
    pub fn exchange_for_full(&self, mag: &mut Box<Magazine>) -> bool {
        debug_assert!(mag.is_empty());
        let mut l = self.lists.lock();
        let full = l.full;
        if full.is_null() {
            return false;
        }
        // SAFETY: `full` heads the depot's list and every listed magazine came
        // from `Box::into_raw`; the lock makes the list ours.
        let full = unsafe {
            l.full = (*full).next;
            (*full).next = ptr::null_mut();
            Box::from_raw(full)
        };
        l.full_len -= 1;
        l.full_objects -= full.len;
        let empty = core::mem::replace(mag, full);
        if l.empty_len < MAX_EMPTY {
            let e = Box::into_raw(empty);
            // SAFETY: `e` is ours, from `Box::into_raw`.
            unsafe { (*e).next = l.empty };
            l.empty = e;
            l.empty_len += 1;
        } else {
            drop(l);
            drop(empty);
        }
        true
    }

    /// Trades the full magazine in `mag` for an empty one (a new one if the
    /// depot has none spare); false (and `mag` untouched) when the depot
    /// already holds its bound of full magazines or is closed.
    pub fn exchange_for_empty(&self, mag: &mut Box<Magazine>) -> bool {
        let mut l = self.lists.lock();
        if l.closed || l.full_len >= self.max_full {
            return false;
        }
        let e = l.empty;
        let empty = if e.is_null() {
            None
        } else {
            // SAFETY: `e` heads the empty list; listed magazines came from
            // `Box::into_raw`.
            unsafe {
                l.empty = (*e).next;
                (*e).next = ptr::null_mut();
                l.empty_len -= 1;
                Some(Box::from_raw(e))
            }
        };
        let spare = match empty {
            Some(e) => e,
            None => {
                // Allocate outside the lock; nobody else can fill our slot
                // meanwhile, but the bound may be reached: recheck.
                drop(l);
                let fresh = Magazine::new(self.cap);
                l = self.lists.lock();
                if l.closed || l.full_len >= self.max_full {
                    return false;
                }
                fresh
            }
        };
        let full = core::mem::replace(mag, spare);
        l.full_objects += full.len;
        let f = Box::into_raw(full);
        // SAFETY: `f` is ours; the lock guards the list.
        unsafe { (*f).next = l.full };
        l.full = f;
        l.full_len += 1;
        true
    }

    /// Takes every full magazine (to flush them into the slabs).
    pub fn take_full(&self) -> Vec<Box<Magazine>> {
        let mut l = self.lists.lock();
        let mut m = core::mem::replace(&mut l.full, ptr::null_mut());
        l.full_len = 0;
        l.full_objects = 0;
        drop(l);
        let mut out = Vec::new();
        while !m.is_null() {
            // SAFETY: the chain was the depot's, now detached and ours.
            let b = unsafe { Box::from_raw(m) };
            m = b.next;
            out.push(b);
        }
        out
    }

    /// Stops taking full magazines (see [`exchange_for_empty`](Self::exchange_for_empty)).
    pub fn close(&self) {
        self.lists.lock().closed = true;
    }

    /// Objects held in full magazines (a snapshot).
    pub fn objects(&self) -> usize {
        self.lists.lock().full_objects
    }

    /// Takes the lock without a guard, for the `fork()` handlers.
    #[doc(hidden)]
    pub fn lock_for_fork(&self) {
        self.lists.lock_raw();
    }

    /// Releases the lock [`lock_for_fork`](Self::lock_for_fork) took.
    ///
    /// # Safety
    /// Taken by `lock_for_fork` on this thread (or, in a forked child, the
    /// thread it was copied from).
    #[doc(hidden)]
    pub unsafe fn unlock_after_fork(&self) {
        // SAFETY: `lock_for_fork` took the lock on this thread (or the thread
        // the child was copied from), so it is held and ours to release.
        unsafe { self.lists.unlock_raw() };
    }
}

impl Drop for Depot {
    fn drop(&mut self) {
        let l = &mut *self.lists.lock();
        for head in [&mut l.full, &mut l.empty] {
            let mut m = core::mem::replace(head, ptr::null_mut());
            while !m.is_null() {
                // SAFETY: listed magazines came from `Box::into_raw` and are
                // only reachable from here.
                let b = unsafe { Box::from_raw(m) };
                m = b.next;
            }
        }
    }
}

/// Objects freed by threads on other nodes, on their way home: an
/// [`AtomicStack`] of objects linked through a word inside each free object
/// (at a cache's own offset), taken whole by the node when it refills (so no
/// ABA: nobody pops single nodes).
pub struct RemoteList {
    stack: AtomicStack<u8>,
}

impl RemoteList {
    /// An empty list.
    pub fn new() -> Self {
        Self { stack: AtomicStack::new() }
    }

    /// Pushes the chain `first ..= last`, already linked through the word at
    /// `link` bytes into each object (what `last` links to is overwritten).
    ///
    /// # Safety
    /// Every object of the chain is free, owned by the caller, and has a
    /// writable, pointer-aligned link word at `link`; the caller gives up the
    /// objects.
    pub unsafe fn push_chain(&self, first: NonNull<u8>, last: NonNull<u8>, link: usize) {
        // SAFETY: the chain's objects are free and given up by the caller, so they stay live
        // until taken; the closure writes only `last`'s link word, writable at `link`.
        unsafe {
            self.stack.push_chain_by(first.as_ptr(), last.as_ptr(), |l, head| l.add(link).cast::<*mut u8>().write(head))
        };
    }

    /// Takes everything pushed so far: a chain through the link words, ending in null.
    pub fn take_all(&self) -> *mut u8 {
        if self.stack.is_empty() {
            return ptr::null_mut();
        }
        self.stack.take_all()
    }
}

impl Default for RemoteList {
    fn default() -> Self {
        Self::new()
    }
}
