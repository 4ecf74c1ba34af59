//! Memory policies applied to [`NumaAlloc`](super::NumaAlloc): the process
//! default (`Config::policy`, `NUMAWEAVE_POLICY`), a scoped per-thread policy
//! ([`with_policy`]), and what each means for the allocator.
//!
//! The fast path never looks at a policy. `Local`, `Bind` and `Preferred`
//! decide which arena a heap takes its next page from, and which of its pages
//! it may refill from, both on the slow path; a thread switching policy has
//! its heap's direct pages cleared so the next allocation of each size goes
//! through that choice once. `Interleave` keeps the direct pages cleared, so
//! every allocation takes the slow path, where the policy's cursor picks the
//! node and a bump region of that node (see `region.rs`) supplies the block.

use core::cell::Cell;
use core::marker::PhantomData;

use super::region::{REGION_ALIGN_MAX, REGION_MAX, Region, Space, block_layout_in, book, up};
use super::state::State;
use crate::error::Result;
use crate::policy::{Cursor, Granularity, Interleave, Pick, Policy};
use crate::sync::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use crate::topology::NodeSet;

/// An interleave in force: its cursor and the regions it carves from.
pub(crate) struct Interleaver {
    pub(crate) cursor: Cursor,
    pub(crate) space: Space,
    /// Used by one thread only (a scoped policy's): the cursor and the
    /// carving skip their atomic read-modify-writes, and the rest of each
    /// turn is served from `window`.
    exclusive: bool,
    count: bool,
    page: usize,
    window: Window,
}

/// An exclusive interleave's turn in progress, served without picking: the
/// turn's node region, where it is carved up to, and what is left of the
/// turn. Booked into the cursor and the space (`close_window`) before any
/// other use of them. Plain loads and stores: one thread only.
struct Window {
    /// `Count`: allocations left in the turn (0: closed). `Bytes`: bytes
    /// served since the window opened (closed once it reaches `b`).
    a: AtomicU64,
    /// `Count`: allocations left when it opened. `Bytes`: the bytes the turn
    /// had left then (0: closed).
    b: AtomicU64,
    region: AtomicPtr<Region>,
    node: AtomicUsize,
    top: AtomicUsize,
    end: AtomicUsize,
    credit: AtomicUsize,
}

impl Interleaver {
    /// For a thread-scoped policy: only the thread that installs it uses it.
    pub(crate) fn exclusive(i: &Interleave) -> Self {
        let mut il = Self::new(i);
        il.exclusive = true;
        il.space.exclusive = true;
        il
    }

    /// Where the next block of `size` bytes goes.
    #[inline]
    pub(crate) fn pick(&self, size: usize) -> crate::policy::Pick {
        if self.exclusive {
            // SAFETY: an exclusive interleaver is reachable from one thread's
            // policy slot only. The window is booked first: the cursor then
            // stands where the window left it.
            unsafe {
                self.close_window();
                self.cursor.pick_exclusive(size)
            }
        } else {
            self.cursor.pick(size)
        }
    }

    /// A block of `size` bytes aligned to `align` on the node the cursor
    /// picks: from that node's region, or (large or very aligned blocks) a
    /// huge mapping of its own. Null when the node cannot supply it.
    #[inline]
    pub(crate) fn alloc_block(&self, size: usize, align: usize) -> *mut u8 {
        let small = size <= REGION_MAX && align <= REGION_ALIGN_MAX;
        if self.exclusive {
            if small {
                // SAFETY: an exclusive interleaver is used by one thread.
                if let Some(p) = unsafe { self.window_alloc(size, align) } {
                    return p;
                }
            }
            // SAFETY: as above.
            return unsafe { self.alloc_exclusive(size, align, small) };
        }
        let pick = self.cursor.pick(size);
        if small { self.space.alloc(pick.node, size, align, pick.turn) } else { self.huge(pick, size, align) }
    }

    fn huge(&self, pick: Pick, size: usize, align: usize) -> *mut u8 {
        match State::try_get() {
            Some(state) => super::huge::alloc_on(state, pick.node, size, align, false),
            None => core::ptr::null_mut(),
        }
    }

    /// The rest of the turn in progress, at the top of its node's region.
    ///
    /// # Safety
    /// Exclusive: called by the one thread that uses this interleaver.
    #[inline(always)]
    unsafe fn window_alloc(&self, size: usize, align: usize) -> Option<*mut u8> {
        let w = &self.window;
        let a = w.a.load(Ordering::Relaxed);
        // Open? (A byte turn ends at the allocation that reaches its budget.)
        if if self.count { a == 0 } else { a >= w.b.load(Ordering::Relaxed) } {
            return None;
        }
        let (bsize, align) = block_layout_in(size, align, self.page);
        let start = up(w.top.load(Ordering::Relaxed), align);
        let end = start + bsize;
        let credit = w.credit.load(Ordering::Relaxed);
        if end > w.end.load(Ordering::Relaxed) || credit == 0 {
            return None;
        }
        w.top.store(end, Ordering::Relaxed);
        w.credit.store(credit - 1, Ordering::Relaxed);
        w.a.store(if self.count { a - 1 } else { a + size as u64 }, Ordering::Relaxed);
        // SAFETY: the window's region is the space's current one for its
        // node, owned by this thread; `start..end` was free at its top.
        unsafe { book(w.region.load(Ordering::Relaxed), start, end) };
        Some(start as *mut u8)
    }

    /// Books the window into the cursor and the space, and closes it.
    ///
    /// # Safety
    /// Exclusive, as [`window_alloc`](Self::window_alloc).
    unsafe fn close_window(&self) {
        let w = &self.window;
        let b = w.b.load(Ordering::Relaxed);
        if b == 0 {
            return;
        }
        let a = w.a.load(Ordering::Relaxed);
        let (served, bytes) = if self.count { (b - a, 0) } else { (u64::from(a > 0), a) };
        // SAFETY: per the contract.
        unsafe { self.cursor.settle_exclusive(served, bytes) };
        self.space.settle_credit(w.node.load(Ordering::Relaxed), w.credit.load(Ordering::Relaxed));
        w.a.store(0, Ordering::Relaxed);
        w.b.store(0, Ordering::Relaxed);
    }

    /// An exclusive allocation that picks: the first of a turn, one that
    /// does not fit the window's region, or a large one. Opens a window on
    /// the rest of the turn.
    ///
    /// # Safety
    /// Exclusive, as [`window_alloc`](Self::window_alloc).
    #[inline(never)]
    unsafe fn alloc_exclusive(&self, size: usize, align: usize, small: bool) -> *mut u8 {
        // SAFETY: per the contract.
        unsafe { self.close_window() };
        // SAFETY: as above.
        let pick = unsafe { self.cursor.pick_exclusive(size) };
        if !small {
            return self.huge(pick, size, align);
        }
        let p = self.space.alloc(pick.node, size, align, pick.turn);
        // SAFETY: as above.
        let left = unsafe { self.cursor.turn_left_exclusive(pick) };
        if !p.is_null()
            && left > 0
            && let Some((r, top, end, credit)) = self.space.window_state(pick.node)
        {
            let w = &self.window;
            w.region.store(r, Ordering::Relaxed);
            w.node.store(pick.node, Ordering::Relaxed);
            w.top.store(top, Ordering::Relaxed);
            w.end.store(end, Ordering::Relaxed);
            w.credit.store(credit, Ordering::Relaxed);
            w.a.store(if self.count { left } else { 0 }, Ordering::Relaxed);
            w.b.store(left, Ordering::Relaxed);
        }
        p
    }

    pub(crate) fn new(i: &Interleave) -> Self {
        // Byte turns of 2 MiB or more start on a 2 MiB boundary, so whole huge
        // pages belong to one node (pointless, and a gap, with one node).
        let turn_align = match i.granularity() {
            Granularity::Bytes(b) if b >= 2 << 20 && i.nodes().len() > 1 => 2 << 20,
            _ => crate::os::page_size(),
        };
        Self {
            cursor: Cursor::new(i),
            space: Space::new(turn_align),
            exclusive: false,
            count: matches!(i.granularity(), Granularity::Count(_)),
            page: crate::os::page_size(),
            window: Window {
                a: AtomicU64::new(0),
                b: AtomicU64::new(0),
                region: AtomicPtr::new(core::ptr::null_mut()),
                node: AtomicUsize::new(0),
                top: AtomicUsize::new(0),
                end: AtomicUsize::new(0),
                credit: AtomicUsize::new(0),
            },
        }
    }
}

impl Drop for Interleaver {
    fn drop(&mut self) {
        if self.exclusive {
            // SAFETY: `&mut self`: nobody else uses it. The space's credit must
            // be settled before it retires its regions.
            unsafe { self.close_window() };
        }
    }
}

/// A policy as the allocator applies it. `Copy`: the interleaver lives as
/// long as whatever installed it (a guard, a handle, the process default).
#[derive(Clone, Copy)]
pub(crate) enum Active {
    Local,
    Bind(NodeSet),
    Preferred(usize),
    Interleave(*const Interleaver),
}

thread_local! {
    /// The calling thread's policy; `None`: the process default.
    static THREAD: Cell<Option<Active>> = const { Cell::new(None) };
}

fn to_active(p: &Policy, il: Option<*const Interleaver>) -> Active {
    match *p {
        Policy::Local => Active::Local,
        Policy::Bind(s) => Active::Bind(s),
        Policy::Preferred(n) => Active::Preferred(n),
        Policy::Interleave(_) => match il {
            Some(il) => Active::Interleave(il),
            None => Active::Local,
        },
    }
}

/// The policy in force on the calling thread: its own, else the process
/// default.
#[inline]
pub(crate) fn active(state: &'static State) -> Active {
    if let Some(a) = THREAD.with(Cell::get) {
        return a;
    }
    to_active(&state.default_policy, state.default_interleaver.as_ref().map(|i| i as *const Interleaver))
}

impl Active {
    /// Whether a heap page on `node` may serve this policy; `here` is the
    /// arena node of the thread's current node.
    #[inline]
    pub(crate) fn accepts(&self, state: &State, node: usize, here: usize) -> bool {
        match *self {
            Active::Interleave(_) => true,
            // Pages of another node wait in the heap's lists for a thread that
            // migrates back (or a policy that wants them), unless this node
            // is out of memory: then its fallback pages serve.
            Active::Local => {
                state.mode != super::Mode::PerNode || node == here || state.arena(here).is_none_or(|a| a.is_exhausted())
            }
            Active::Bind(s) => s.contains(node),
            // The preferred node, or any while it is out of memory.
            Active::Preferred(n) => node == n || state.arena(n).is_none_or(|a| a.is_exhausted()),
        }
    }

    /// The node fresh memory comes from (its arena falls back by distance
    /// when it is out of memory; for `Bind`, only within the set).
    pub(crate) fn node(&self, state: &State) -> usize {
        let here = state.topology.current_node();
        match *self {
            Active::Local | Active::Interleave(_) => here,
            Active::Preferred(n) => n,
            Active::Bind(s) => state.topology.nodes_by_distance(here).find(|&n| s.contains(n)).unwrap_or(here),
        }
    }

    /// The nodes a fallback may use.
    pub(crate) fn fallback_set(&self) -> Option<NodeSet> {
        match *self {
            Active::Bind(s) => Some(s),
            _ => None,
        }
    }
}

/// Allocates `size` bytes aligned to `align` under interleaver `il`.
///
/// # Safety
/// `il` is live for the call.
#[inline]
pub(crate) unsafe fn interleave_alloc(il: *const Interleaver, size: usize, align: usize) -> *mut u8 {
    // SAFETY: per the contract.
    unsafe { (*il).alloc_block(size, align) }
}

/// The interleaver of `a`, or null.
pub(crate) fn interleaver_of(a: Active) -> *const Interleaver {
    match a {
        Active::Interleave(il) => il,
        _ => core::ptr::null(),
    }
}

/// Sets the calling thread's policy until the guard is dropped, then puts the
/// previous one back (guards nest). The policy is checked against the
/// allocator's topology first.
///
/// While an `Interleave` policy is in force, every allocation of the thread
/// takes the allocator's slow path (the cursor is consulted per allocation);
/// other policies cost nothing on the fast path.
///
/// ```
/// use numaweave::policy::Policy;
/// use numaweave::{NumaAlloc, topology::NodeSet};
/// # static A: NumaAlloc = NumaAlloc::new();
/// let node = numaweave::Topology::global().current_node();
/// {
///     let _g = numaweave::with_policy(Policy::Bind(NodeSet::single(node))).unwrap();
///     let v = Box::new([0u8; 4096]); // from `node`'s memory under NumaAlloc
///     # drop(v);
/// }
/// // The previous policy again.
/// ```
pub fn with_policy(policy: Policy) -> Result<PolicyGuard> {
    let state = State::get(&super::Config::new());
    if !state.policies {
        return Err(crate::Error::InvalidPolicy { reason: "memory policies are switched off (NUMAWEAVE_POLICY=none)" });
    }
    policy.validate(&state.topology)?;
    let il = match &policy {
        Policy::Interleave(i) => Some(Box::new(Interleaver::exclusive(i))),
        _ => None,
    };
    let active = to_active(&policy, il.as_deref().map(|p| p as *const Interleaver));
    let prev = THREAD.with(|t| t.replace(Some(active)));
    super::heap::reset_direct_pages(interleaver_of(active));
    Ok(PolicyGuard { prev, _il: il, _not_send: PhantomData })
}

/// Restores the previous policy of the thread when dropped; see [`with_policy`].
#[must_use = "the policy is undone when the guard is dropped"]
pub struct PolicyGuard {
    prev: Option<Active>,
    _il: Option<Box<Interleaver>>,
    /// Thread-scoped: it restores this thread's policy.
    _not_send: PhantomData<*const ()>,
}

impl Drop for PolicyGuard {
    fn drop(&mut self) {
        THREAD.with(|t| t.set(self.prev));
        let il = State::try_get().map_or(core::ptr::null(), |s| interleaver_of(active(s)));
        super::heap::reset_direct_pages(il);
        // The interleaver goes with the guard: its regions are retired and
        // return to the OS when their last block is freed, by any thread.
    }
}

impl core::fmt::Debug for PolicyGuard {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PolicyGuard").finish_non_exhaustive()
    }
}
