//! Memory policies applied to [`NumaAlloc`](super::NumaAlloc): the process
//! default (`Config::policy`, `NUMAWEAVE_POLICY`), a scoped per-thread policy
//! ([`with_policy`]), and what each means for the allocator.
//!
//! The fast path never looks at a policy. `Local`, `Bind` and `Preferred`
//! decide which arena a heap takes its next page from, and which of its pages
//! it may refill from, both on the slow path; a thread switching policy has
//! its heap's direct pages cleared so the next allocation of each size goes
//! through that choice once. Under `Interleave` an [`Interleaver`] places
//! every allocation (see `interleave.rs`).

use core::cell::Cell;
use core::marker::PhantomData;

pub(crate) use super::interleave::Interleaver;
use super::state::State;
use crate::error::Result;
use crate::policy::Policy;
use crate::topology::NodeSet;

/// A policy as the allocator applies it. `Copy`: the interleaver lives as
/// long as whatever installed it (a guard, a handle, the thread's heap for
/// the process default).
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
    if let Policy::Interleave(i) = &state.default_policy {
        return to_active(&state.default_policy, super::heap::thread_interleaver(state, i));
    }
    to_active(&state.default_policy, None)
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
/// While an `Interleave` policy is in force, the cursor places every
/// allocation of the thread: the rest of each turn is served by the
/// allocator's fast path, and blocks the thread frees are reused on their
/// node (see the crate's README); other policies cost nothing on the fast
/// path.
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
    super::heap::reset_direct_pages(active);
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
        if let Some(s) = State::try_get() {
            super::heap::reset_direct_pages(active(s));
        }
        // The interleaver goes with the guard: its regions are retired and
        // return to the OS when their last block is freed, by any thread.
    }
}

impl core::fmt::Debug for PolicyGuard {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PolicyGuard").finish_non_exhaustive()
    }
}
