//! Memory policies applied to [`NumaAlloc`](super::NumaAlloc): the process
//! default (one [`SizeRules`], a plain policy its one-rule case:
//! `Config::policy`, `Config::policy_rules`, `NUMAWEAVE_POLICY`), a scoped
//! per-thread policy ([`with_policy`]), and what each means for the
//! allocator. The core names no policy: this layer turns them into the
//! core's [`Placement`] (which pages serve a refill, where a fresh one comes
//! from) and, for the facade's slow path, into a [`Where`] ([`place`]).
//!
//! The fast path never looks at a policy. When a heap's direct page runs dry,
//! [`refill`] turns the thread's policy into a [`Placement`]: which of the
//! heap's pages may serve, and which arena a fresh page comes from. `Local`,
//! `Bind` and `Preferred` act there; a thread switching policy has its heap's
//! direct pages cleared so the next allocation of each size goes through that
//! choice once.
//!
//! Under `Interleave` the thread's [`ThreadInterleaver`] decides, with a
//! boundary at I/O buffers:
//!
//! - *I/O buffers* follow the cursor block by block, with exact turns
//!   (`Count(n)`: n blocks, `Bytes(b)`: until b bytes are reached), a turn's
//!   blocks back to back in its node's region: blocks of a page and more
//!   aligned to a page or more (what `O_DIRECT` and DMA need: an aligned
//!   `Layout`, `posix_memalign`, `aligned_alloc`), and every block larger
//!   than the size classes (256 KiB).
//! - every other block (what general code allocates: `Box`, `Vec`,
//!   `malloc`) is placed *page by page*: any page of the heap serves it
//!   (freed blocks are reused where they are, as under `Local`), and each
//!   fresh heap page goes to the node next in the interleaver's page
//!   rotation (the policy's nodes and weights; a page per turn under
//!   `Count`, the policy's bytes per turn under `Bytes`). Its memory is
//!   interleaved, and the fast path is the local one.

use core::cell::Cell;
use core::marker::PhantomData;
use core::ptr;

use super::engine::heap::{self, Heap, Placement, cpu, page_bytes};
use super::engine::lifecycle;
use super::engine::size_class::class_size;
use super::engine::types::Segment;
use super::engine::types::{Mode, State};
use super::interleave::{self, ThreadInterleaver};
use crate::error::Result;
use crate::os::file;
use crate::os::thread::{self, ExitKey, ForkRank};
use crate::policy::{Interleave, Policy, SizeRules};
use crate::sync::{InitCell, Ordering, SpinLock};
use crate::topology::{MAX_NODES, NodeSet, Topology};

/// A policy as the allocator applies it. `Copy`: the interleaver lives as
/// long as whatever installed it (a guard, or the thread for the process
/// default).
#[derive(Clone, Copy)]
pub(crate) enum Active {
    Local,
    Bind(NodeSet),
    Preferred(usize),
    Interleave(*const ThreadInterleaver),
    LowerTier,
    /// The process default by size (more than one rule), with the thread's
    /// interleaver for its interleave rule (null if it has none).
    Rules(*const ThreadInterleaver),
}

/// A thread's policy state; plain cells, read on slow paths only.
pub(crate) struct ThreadPolicy {
    /// The thread's own policy (`with_policy`); `None`: the process default.
    scoped: Cell<Option<Active>>,
    /// Whether `il` and `local` describe the policy in force.
    resolved: Cell<bool>,
    /// The interleaver in force (null: not an interleave): the refill's
    /// first check, so that an interleaved allocation skips the lookup.
    il: Cell<*const ThreadInterleaver>,
    /// Whether rules by size are in force: the refill's first check.
    rules: Cell<bool>,
    /// Whether `Local` is in force: the refill's second check, so that
    /// `Local` costs no policy lookup while the heap is not mixed.
    local: Cell<bool>,
    /// The node of the arena the heap's last fresh page came from under
    /// `Local`: pages of that node serve `Local` without asking where the
    /// thread runs.
    last_node: Cell<usize>,
    /// Whether any page of the heap may be on another node than
    /// `last_node` (a fallback, another policy's pages, a migration, an
    /// adopted heap): until then `Local` takes any page without reading its
    /// node.
    mixed: Cell<bool>,
    /// The thread's own interleaver for a process default interleave (as
    /// Linux keeps interleave state per task), made on first use; dropped at
    /// thread exit.
    default_il: Cell<*mut ThreadInterleaver>,
}

thread_local! {
    static THREAD: ThreadPolicy = const {
        ThreadPolicy {
            scoped: Cell::new(None),
            resolved: Cell::new(false),
            il: Cell::new(ptr::null()),
            rules: Cell::new(false),
            local: Cell::new(false),
            last_node: Cell::new(0),
            mixed: Cell::new(false),
            default_il: Cell::new(ptr::null_mut()),
        }
    };
}

fn to_active(p: &Policy, il: Option<*const ThreadInterleaver>) -> Active {
    match *p {
        Policy::Local => Active::Local,
        Policy::Bind(s) => Active::Bind(s),
        Policy::Preferred(n) => Active::Preferred(n),
        Policy::LowerTier => Active::LowerTier,
        Policy::Interleave(_) => match il {
            Some(il) => Active::Interleave(il),
            None => Active::Local,
        },
    }
}

/// The process default placement, validated against the allocator's
/// topology.
struct Default {
    rules: SizeRules,
    /// `false`: policies switched off (`NUMAWEAVE_POLICY=none`), the slow
    /// path never looks them up.
    policies: bool,
}

/// The process default, set inside the state's start-up (`config::start`):
/// whoever sees the state sees it. (Not held across fork: it is made only
/// while `STATE`, which fork holds, is being made.)
static DEFAULT: InitCell<Default> = InitCell::new();

/// What a process without a default set uses (only before the state exists).
static LOCAL: Default = Default { rules: SizeRules::single(Policy::Local), policies: true };

#[inline]
fn default() -> &'static Default {
    DEFAULT.get().unwrap_or(&LOCAL)
}

/// Sets the process default: `rules` if `topology` can serve them, else
/// local (reported); `policies` false switches policies off; `cpu_cache`
/// makes the per-CPU caches where the default is local. Called once,
/// from the state's start-up (every process's: in the hot text).
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) fn set_default(rules: SizeRules, policies: bool, cpu_cache: bool, topology: &Topology) {
    let rules = match rules.as_single() {
        Some(Policy::Local) => rules,
        _ => match rules.validate(topology) {
            Ok(()) => rules,
            Err(e) => {
                file::report(format_args!("numaweave: default policy {rules}: {e}; using local"));
                SizeRules::single(Policy::Local)
            }
        },
    };
    let local = !policies || matches!(rules.as_single(), Some(Policy::Local));
    DEFAULT.get_or_init(|| Default { rules, policies });
    if cpu_cache && local {
        cpu::init(topology.memory_nodes().len() > 1);
    } else if cpu_cache {
        file::report(format_args!("numaweave: per-CPU caches serve only the local default: per-thread caches"));
    }
}

/// The process default's interleave: the one policy's, or the interleave
/// rule's.
pub(crate) fn default_interleave() -> Option<&'static Interleave> {
    default().rules.interleave()
}

impl ThreadPolicy {
    /// The policy in force: the thread's own, else the process default (an
    /// interleave gets the thread's own interleaver, made now if need be).
    #[unsafe(link_section = ".text.sorted.numaweave")]
    fn active(&self, state: &'static State) -> Active {
        if let Some(a) = self.scoped.get() {
            return a;
        }
        let rules = &default().rules;
        let il = || rules.interleave().and_then(|i| self.default_interleaver(state, i));
        match rules.as_single() {
            Some(Policy::Interleave(_)) => match il() {
                Some(il) => Active::Interleave(il),
                None => Active::Local,
            },
            Some(p) => to_active(&p, None),
            None => Active::Rules(il().unwrap_or(ptr::null())),
        }
    }

    /// Caches what the refill checks first about `active`.
    fn set_active(&self, active: Active) {
        self.il.set(match active {
            Active::Interleave(il) | Active::Rules(il) => il,
            _ => ptr::null(),
        });
        self.rules.set(matches!(active, Active::Rules(_)));
        self.local.set(matches!(active, Active::Local));
        self.resolved.set(true);
    }

    /// The thread's interleaver for the default interleave `i`, made on first
    /// use; `None` when no memory can be had for it.
    fn default_interleaver(&self, state: &'static State, i: &Interleave) -> Option<*const ThreadInterleaver> {
        let il = self.default_il.get();
        if !il.is_null() {
            return Some(il);
        }
        let il = spare_interleaver(state)?;
        // SAFETY: metadata memory of the right layout, holding nothing.
        unsafe { ThreadInterleaver::write(il, i, state) };
        self.default_il.set(il);
        // Dropped at thread exit; without the key it stays (its regions
        // with it) until the process ends.
        if let Some(k) = exit_key() {
            k.set(il.cast());
        }
        Some(il)
    }

    /// Whether the per-CPU caches serve the thread: they can
    /// ([`cpu::serves_thread`]) and it has no policy of its own (what its
    /// heap's `cpu_served` says).
    fn cpu_served(&self) -> bool {
        self.scoped.get().is_none() && cpu::serves_thread()
    }

    /// The thread takes a page on `node` under `Local`: pages of another
    /// node it took before are foreign from now on.
    fn note_node(&self, node: usize) {
        if self.last_node.get() != node {
            self.mixed.set(true);
            self.last_node.set(node);
        }
    }

    /// A page of `node` came in: the heap is mixed if that is not the node
    /// `Local` last took pages from.
    fn note_page(&self, node: usize) {
        if node != self.last_node.get() {
            self.mixed.set(true);
        }
    }
}

/// Default interleavers of exited threads, for the next thread to reuse
/// (their memory is metadata memory, never freed).
static SPARE: SpinLock<SpareList> = SpinLock::new(SpareList(ptr::null_mut()));
struct SpareList(*mut ThreadInterleaver);
// SAFETY: the pointers are to unused metadata memory, handed out under the lock.
unsafe impl Send for SpareList {}

/// Registers the interleaving's `fork()` handlers ([`ForkRank::Interleave`]),
/// once, before its first lock can be held: the handles' spaces, then the
/// spare list (a leaf: nothing is taken under it).
pub(crate) fn register_fork_handlers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Err(e) = thread::at_fork(ForkRank::Interleave, fork_prepare, fork_release) {
            file::report(format_args!("numaweave: no fork handlers for interleaving ({e}): fork() may hang"));
        }
    });
}

fn fork_prepare() {
    interleave::lock_spaces_for_fork();
    SPARE.lock_raw();
    LOWER_TIER.hold_for_fork();
    KEY.hold_for_fork();
}

fn fork_release() {
    KEY.release_after_fork();
    LOWER_TIER.release_after_fork();
    // SAFETY: both taken by `fork_prepare` on this thread (or, in the
    // child, the thread it was copied from).
    unsafe {
        SPARE.unlock_raw();
        interleave::unlock_spaces_after_fork();
    }
}

/// Memory for a thread interleaver: an exited thread's, else fresh metadata.
fn spare_interleaver(state: &State) -> Option<*mut ThreadInterleaver> {
    register_fork_handlers();
    let mut g = SPARE.lock();
    let p = g.0;
    if !p.is_null() {
        // SAFETY: a spare's first word links the next spare.
        g.0 = unsafe { p.cast::<*mut ThreadInterleaver>().read() };
        return Some(p);
    }
    drop(g);
    let (size, align) = (core::mem::size_of::<ThreadInterleaver>(), core::mem::align_of::<ThreadInterleaver>());
    super::engine::arena::alloc_meta(state, size, align).map(|p| p.as_ptr().cast())
}

/// The key whose destructor drops a thread's default interleaver.
static KEY: InitCell<Option<ExitKey>> = InitCell::new();

fn exit_key() -> Option<&'static ExitKey> {
    KEY.get_or_init(|| ExitKey::new(drop_default_interleaver).ok()).as_ref()
}

/// Thread exit: the thread's default interleaver is dropped (its pool taken
/// back, its regions retired: they go back once other threads free their
/// last blocks) and its memory kept for another thread.
extern "C" fn drop_default_interleaver(il: *mut libc::c_void) {
    let il = il.cast::<ThreadInterleaver>();
    THREAD.with(|t| {
        if t.default_il.get() != il {
            return;
        }
        t.default_il.set(ptr::null_mut());
        if t.il.get() == il.cast_const() {
            t.il.set(ptr::null());
            t.resolved.set(false);
        }
    });
    // SAFETY: the exiting thread's interleaver, used by nobody else; its
    // memory is kept as a spare once dropped.
    unsafe {
        ptr::drop_in_place(il);
        let mut g = SPARE.lock();
        il.cast::<*mut ThreadInterleaver>().write(g.0);
        g.0 = il;
    }
}

/// Frees a region block (an interleaved I/O buffer): its owner's
/// interleaver, if that is the caller's, takes it back, else its region.
///
/// # Safety
/// `p` is a live block of the region `seg`, given up by the caller.
/// Out of line: the policy's
/// thread-local is read here, never on the small blocks' free path.
#[cold]
#[inline(never)]
pub(crate) unsafe fn free_region(seg: *mut Segment, p: *mut u8) {
    // SAFETY: `p` is a live block of region `seg` given up by the caller (its word), and
    // `thread_interleaver()` is this thread's in force: what `interleave::free` asks.
    unsafe { interleave::free(seg, p, thread_interleaver()) }
}

/// The calling thread's interleaver in force, null if none (or not looked up
/// yet: then the thread has no region block of its own).
#[inline(always)]
pub(crate) fn thread_interleaver() -> *const ThreadInterleaver {
    THREAD.with(|t| t.il.get())
}

/// The calling thread's interleaver in force for a block of `size` bytes
/// (its size class's, for blocks the classes serve): the policy looked up
/// if need be; under rules by size, only where the size's rule is the
/// interleave. For an allocation that does not go through a heap refill.
fn interleaver_for(t: &ThreadPolicy, size: usize) -> Option<&'static ThreadInterleaver> {
    if t.rules.get() && !matches!(default().rules.policy_for(size), Policy::Interleave(_)) {
        return None;
    }
    // SAFETY: the interleaver outlives the policy that installed it, and
    // this thread's use of it.
    unsafe { t.il.get().as_ref() }
}

/// Where a block goes, as the facade's slow path asks ([`place`]).
pub(crate) enum Where {
    /// A block of the class from the calling thread's heap (a refill, if it
    /// needs one, asks the policy for a page: [`refill`]).
    Class(usize),
    /// A block of the class (a page class, page-aligned) that follows the
    /// interleaver's turns: an I/O buffer.
    Turn(usize, &'static ThreadInterleaver),
    /// A block beyond the classes carved from the interleaver's regions.
    Region(&'static ThreadInterleaver),
    /// A block beyond the classes, a mapping of its own on this node.
    Node(usize),
}

/// Which node (or interleaver) serves a block of `size` bytes aligned to
/// `align` (`class`: its size class, if the classes serve it), under the
/// calling thread's policy: the one place the facade's slow path asks,
/// once per allocation. Under an interleave, I/O buffers (page-aligned
/// blocks of a page and more, and blocks beyond the size classes) follow
/// its turns; under rules by size, the rule of the block's size (its
/// class's size, for blocks the classes serve) decides.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) fn place(state: &'static State, class: Option<usize>, size: usize, align: usize) -> Where {
    if !default().policies {
        return match class {
            Some(c) => Where::Class(c),
            None => Where::Node(state.current_arena().node),
        };
    }
    THREAD.with(|t| {
        if !t.resolved.get() {
            t.set_active(t.active(state));
        }
        match class {
            Some(c) => match interleaver_for(t, class_size(c)) {
                Some(il) if align >= super::region::UNIT => Where::Turn(c, il),
                _ => Where::Class(c),
            },
            None => match interleaver_for(t, size) {
                Some(il) if interleave::region_serves(size, align) => Where::Region(il),
                Some(il) => Where::Node(il.pick_node(size)),
                None => {
                    let active = match t.active(state) {
                        Active::Rules(il) => rule_active(size, il),
                        a => a,
                    };
                    Where::Node(active.node(state))
                }
            },
        }
    })
}

/// The policy in force under rules by size for a block of `size` bytes:
/// its rule's (the interleave rule with the thread's interleaver `il`).
fn rule_active(size: usize, il: *const ThreadInterleaver) -> Active {
    match default().rules.policy_for(size) {
        p @ Policy::Interleave(_) => to_active(&p, (!il.is_null()).then_some(il)),
        p => to_active(&p, None),
    }
}

/// A heap the calling thread was just given (made, or adopted: `adopted`)
/// takes the thread's policy state: its word points at it, and an adopted
/// heap, which may hold pages of several nodes, has `Local` check them.
///
/// # Safety
/// `h` is the calling thread's heap, just made or adopted.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) unsafe fn bind_heap(h: *mut Heap, adopted: bool) {
    THREAD.with(|t| {
        // SAFETY: the calling thread's heap, which only this thread uses
        // until it exits (then another adopts it and comes here).
        unsafe {
            t.last_node.set((*h).node);
            (*h).policy = ptr::from_ref(t).cast();
            (*h).cpu_served.store(t.cpu_served(), Ordering::Relaxed);
        }
        t.mixed.set(adopted);
    });
}

/// The verbose start-up line of this layer: the default placement, and the
/// weights `weights=auto` worked out. Out of line (formatting code).
#[cold]
#[inline(never)]
pub(crate) fn show_default(state: &State) {
    let d = default();
    let off = if d.policies { "" } else { " (policies off)" };
    file::write_stderr(format_args!("numaweave: policy {}{off}\n", d.rules));
    if let Some(w) = default_interleave().and_then(|i| i.auto_weights_by_node(state.topology)) {
        file::write_stderr(format_args!("numaweave: {w}\n"));
    }
    if let Some(c) = cpu::get() {
        file::write_stderr(format_args!(
            "numaweave: per-CPU caches: {} CPUs, at most {} KiB of free blocks each\n",
            c.cpus(),
            c.bytes_per_cpu() / 1024
        ));
    }
}

/// The policy state of the thread that owns `heap`, the calling one. In the
/// C library `THREAD` is general-dynamic TLS (a `__tls_get_addr` call at
/// every access, as `os/tls.rs` explains); the heap keeps its address, which
/// holds while the thread lives, and the thread is the heap's only user.
///
/// # Safety
/// `heap` is the calling thread's heap.
#[inline]
unsafe fn policy_of(heap: *mut Heap) -> &'static ThreadPolicy {
    // SAFETY: `heap` is the calling thread's (the caller's word), so `policy` is what
    // `thread_heap` set for this thread, live while it lives (a heap made elsewhere, only
    // in tests, has none and looks it up).
    match unsafe { (*heap).policy.cast::<ThreadPolicy>().as_ref() } {
        Some(t) => t,
        None => this_thread_policy(),
    }
}

/// The calling thread's policy state, looked up (out of line: the compiler
/// would compute the TLS address ahead of the branch that needs it).
#[cold]
#[inline(never)]
fn this_thread_policy() -> &'static ThreadPolicy {
    // SAFETY: `THREAD` has no destructor; its storage lasts as long as the
    // calling thread, which is as long as its heap's use of it.
    THREAD.with(|t| unsafe { &*(t as *const ThreadPolicy) })
}

/// A block of `class` from the per-CPU caches, for a thread they serve
/// (null when no memory can be had): the calling CPU's stack, else a
/// refill of it; either beats the lifecycle while it has work waiting, as
/// a heap's refills do.
///
/// # Safety
/// [`cpu::serves`]`(class)`.
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) unsafe fn cpu_alloc(class: usize) -> *mut u8 {
    // SAFETY: a class the caches serve (the caller's word).
    let p = unsafe { cpu_pop(class) };
    if !p.is_null() {
        return p;
    }
    // SAFETY: as above.
    unsafe { cpu_alloc_refill(class) }
}

/// [`cpu_alloc`] past its pop, for a caller whose own pop of the calling
/// CPU's stack of `class` just found it empty (`malloc`'s slow path, after
/// [`cpu_pop_malloc`]): a refill of the stack, not a second pop of it. A
/// block another thread pushed meanwhile is no harm: the refill serves
/// from its batch and the stack keeps what it has room for.
///
/// # Safety
/// [`cpu::serves`]`(class)`.
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) unsafe fn cpu_alloc_refill(class: usize) -> *mut u8 {
    let Some(state) = State::try_get() else { return ptr::null_mut() };
    // SAFETY: a class the caches serve (the caller's word).
    unsafe { lifecycle::cpu_refill(state, class) }
}

/// The top of the calling CPU's stack of `class`, null when it is empty;
/// a block served beats the lifecycle while it has work waiting (by a
/// tail call: the callers keep no frame for it). What [`cpu_alloc`] and
/// [`cpu_pop_malloc`] share.
///
/// # Safety
/// [`cpu::serves`]`(class)`.
#[inline(always)]
unsafe fn cpu_pop(class: usize) -> *mut u8 {
    // SAFETY: a class the caches serve (the caller's word).
    let p = unsafe { cpu::pop(class) };
    if !p.is_null() && State::try_get().is_some_and(|s| s.life.pending()) {
        // SAFETY: the caches served this allocation: the thread's heap, if
        // it has one, is between operations.
        return unsafe { cpu_beat_then(p) };
    }
    p
}

/// C's `malloc` after its fast path missed, for a thread the per-CPU
/// caches serve (its slot holds `CPU_NO_HEAP`) and a size they hold: the
/// top of its CPU's stack of the class, else null (not such a thread or
/// size, or the stack empty: the caller's slow path refills, through
/// [`cpu_alloc`]). First in `malloc`'s slow path, inline: before, every
/// such allocation went through the slow path's checks and `cpu_alloc`'s
/// call.
///
/// # Safety
/// None: any `size` is accepted.
#[inline(always)]
pub(crate) unsafe fn cpu_pop_malloc(size: usize) -> *mut u8 {
    // (Hardened builds have no caches.) A size of 0 wraps past the bound.
    if crate::hardened::HARDENED
        || size.wrapping_sub(1) >= cpu::MAX_BLOCK
        || heap::current_or_none() != heap::cpu_no_heap()
    {
        return ptr::null_mut();
    }
    // SAFETY: 1 to MAX_BLOCK bytes, a class the caches hold (their classes
    // are those of the sizes to MAX_BLOCK); a thread whose slot holds
    // `CPU_NO_HEAP` is one they serve, so they exist.
    unsafe { cpu_pop(super::engine::size_class::class_of_malloc_small(size)) }
}

/// [`cpu_pop`]'s block `p`, after the lifecycle's beat (work is waiting):
/// out of line, reached by a tail call.
///
/// # Safety
/// The calling thread's heap, if it has one, is between operations (the
/// caches served).
#[cold]
#[inline(never)]
unsafe fn cpu_beat_then(p: *mut u8) -> *mut u8 {
    if let Some(state) = State::try_get() {
        // SAFETY: the caller's word.
        unsafe { lifecycle::cpu_beat(state) };
    }
    p
}

/// Whether the per-CPU caches serve `class` for the calling thread, whose
/// slot holds `heap`: a thread with a heap says so in it (`cpu_served`,
/// set when the heap is bound and when a policy is installed); one marked
/// served has no heap yet; one not yet looked at is served if it has no
/// policy of its own and its rseq area names a row, and marked so.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) fn cpu_serves(heap: *mut Heap, class: usize) -> bool {
    if !cpu::serves(class) {
        return false;
    }
    if heap::is_heap(heap) {
        // SAFETY: the calling thread's heap (its slot's).
        return unsafe { (*heap).cpu_served.load(Ordering::Relaxed) };
    }
    if heap == heap::cpu_no_heap() {
        return true;
    }
    // (With policies off no thread has one of its own: no TLS to read.)
    let served = if default().policies { THREAD.with(ThreadPolicy::cpu_served) } else { cpu::serves_thread() };
    if served {
        heap::set_cpu_served(true);
    }
    served
}

/// The slow path of an allocation of class `class` whose direct page ran
/// dry: a refill under the thread's policy.
///
/// # Safety
/// `heap` is the calling thread's heap.
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) unsafe fn refill(heap: *mut Heap, class: usize) -> *mut u8 {
    let Some(state) = State::try_get() else { return ptr::null_mut() };
    // SAFETY: the caller's heap.
    if unsafe { (*heap).cpu_served.load(Ordering::Relaxed) } && cpu::serves(class) {
        // SAFETY: a class the per-CPU caches serve.
        return unsafe { cpu_alloc(class) };
    }
    if !default().policies {
        // SAFETY: the caller's heap.
        return unsafe { refill_any(heap, class, state, &mut AnyPage { t: None, state }) };
    }
    // SAFETY: the caller's heap.
    let t = unsafe { policy_of(heap) };
    if !t.resolved.get() {
        t.set_active(t.active(state));
    }
    if t.rules.get() {
        // SAFETY: the caller's heap.
        return unsafe { refill_by_size(heap, class, state, t) };
    }
    let il = t.il.get();
    // SAFETY: the caller's heap; the interleaver outlives the policy
    // that installed it.
    unsafe {
        if !il.is_null() {
            return refill_rotation(heap, class, state, &mut Rotation { t, il: &*il, class });
        }
        if t.local.get() && !t.mixed.get() {
            // `Local` with every page of the heap on the node it last
            // took a page for: nothing to choose, any page serves.
            let track = state.mode == Mode::PerNode;
            return refill_any(heap, class, state, &mut AnyPage { t: track.then_some(t), state });
        }
        let active = t.active(state);
        if matches!(active, Active::Local) && state.mode != Mode::PerNode {
            // One arena: `Local` has nothing to choose.
            return refill_any(heap, class, state, &mut AnyPage { t: None, state });
        }
        refill_by_policy(heap, class, state, &mut ByPolicy { t, state, active, here: None })
    }
}

/// The lifecycle's refill (`lifecycle::refill`) under the default
/// placement, any page of the heap: in the section of the code every
/// program runs (`.text.sorted.numaweave`), where the instances for the
/// rotation and the other policies, which only programs with such a
/// policy run, are not (each took 2 KiB of it).
///
/// # Safety
/// `heap` is the calling thread's heap.
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
unsafe fn refill_any(heap: *mut Heap, class: usize, state: &State, p: &mut AnyPage<'_>) -> *mut u8 {
    // SAFETY: the caller's heap.
    unsafe { lifecycle::refill(heap, class, state, p) }
}

/// [`refill_any`] under an interleave's rotation.
///
/// # Safety
/// `heap` is the calling thread's heap.
#[inline(never)]
unsafe fn refill_rotation(heap: *mut Heap, class: usize, state: &State, p: &mut Rotation<'_>) -> *mut u8 {
    // SAFETY: the caller's heap.
    unsafe { lifecycle::refill(heap, class, state, p) }
}

/// [`refill_any`] under the thread's other policies.
///
/// # Safety
/// `heap` is the calling thread's heap.
#[inline(never)]
unsafe fn refill_by_policy(heap: *mut Heap, class: usize, state: &State, p: &mut ByPolicy<'_>) -> *mut u8 {
    // SAFETY: the caller's heap.
    unsafe { lifecycle::refill(heap, class, state, p) }
}

/// [`refill`] under rules by size: the rule of the class's block size
/// decides. Under the interleave rule, classes of a page and more follow
/// the cursor block by block (the interleaver lends the heap the rest of
/// the turn), smaller ones page by page.
///
/// # Safety
/// `heap` is the calling thread's heap, `t` its policy state.
#[cold]
#[inline(never)]
unsafe fn refill_by_size(heap: *mut Heap, class: usize, state: &'static State, t: &ThreadPolicy) -> *mut u8 {
    // SAFETY: the caller's heap; the interleaver outlives the policy that
    // installed it.
    unsafe {
        match rule_active(class_size(class), t.il.get()) {
            Active::Interleave(il) if class >= super::engine::size_class::PAGE_CLASS => (*il).alloc_class(heap, class),
            Active::Interleave(il) => refill_rotation(heap, class, state, &mut Rotation { t, il: &*il, class }),
            Active::Local if state.mode != Mode::PerNode => {
                refill_any(heap, class, state, &mut AnyPage { t: None, state })
            }
            active => refill_by_policy(heap, class, state, &mut ByPolicy { t, state, active, here: None }),
        }
    }
}

/// A block of `class` on `node` (an allocator handle's), from the pages of
/// that node of `heap`, the calling thread's.
pub(crate) fn alloc_on_node(state: &'static State, heap: *mut Heap, class: usize, node: usize) -> *mut u8 {
    let node = state.node_arena(node).node;
    THREAD.with(|t| t.note_page(node));
    // SAFETY: the calling thread's heap.
    unsafe { Heap::alloc_on_node(heap, class, state, node) }
}

/// Policies off, or `Local` with nothing to choose: any page serves, fresh
/// pages from the arena of the node the thread runs on now. With `t`
/// (per-node mode), notes when the heap becomes mixed.
struct AnyPage<'a> {
    t: Option<&'a ThreadPolicy>,
    state: &'a State,
}

impl Placement for AnyPage<'_> {
    fn accepts(&mut self, _: usize) -> bool {
        true
    }
    fn fresh(&mut self) -> (usize, Option<NodeSet>) {
        let node = self.state.current_arena().node;
        if let Some(t) = self.t {
            t.note_node(node);
        }
        (node, None)
    }
    fn took(&mut self, node: usize) {
        if let Some(t) = self.t {
            t.note_page(node);
        }
    }
    fn cache_serves(&mut self, _: usize) -> bool {
        true
    }
}

/// Blocks under a page under an interleave: any page serves, fresh pages
/// from the interleaver's page rotation.
struct Rotation<'a> {
    t: &'a ThreadPolicy,
    il: &'a ThreadInterleaver,
    class: usize,
}

impl Placement for Rotation<'_> {
    fn accepts(&mut self, _: usize) -> bool {
        true
    }
    fn fresh(&mut self) -> (usize, Option<NodeSet>) {
        (self.il.page_node(page_bytes(self.class)), None)
    }
    fn took(&mut self, node: usize) {
        self.t.note_page(node);
    }
}

/// `Local` on a mixed heap, `Bind`, `Preferred`: only pages the policy
/// accepts serve (for `Local`: pages of its last node, or of the node the
/// thread runs on now, looked up only if a page of another node shows up).
struct ByPolicy<'a> {
    t: &'a ThreadPolicy,
    state: &'static State,
    active: Active,
    here: Option<usize>,
}

impl Placement for ByPolicy<'_> {
    fn accepts(&mut self, node: usize) -> bool {
        match self.active {
            Active::Local if node == self.t.last_node.get() => true,
            a => {
                let state = self.state;
                a.accepts(state, node, *self.here.get_or_insert_with(|| state.current_arena().node))
            }
        }
    }
    fn fresh(&mut self) -> (usize, Option<NodeSet>) {
        let node = self.state.node_arena(self.active.node(self.state)).node;
        if matches!(self.active, Active::Local) {
            self.t.note_node(node);
        }
        (node, self.active.fallback_set())
    }
    fn took(&mut self, node: usize) {
        self.t.note_page(node);
    }
    fn cache_serves(&mut self, node: usize) -> bool {
        self.accepts(node)
    }
}

impl Active {
    /// Whether a heap page on `node` may serve this policy; `here` is the
    /// arena node of the thread's current node.
    #[inline]
    fn accepts(&self, state: &State, node: usize, here: usize) -> bool {
        match *self {
            // (Rules are resolved to their size's policy before a page is
            // chosen: `refill_by_size`.)
            Active::Interleave(_) | Active::Rules(_) => true,
            // Pages of another node wait in the heap's lists for a thread that
            // migrates back (or a policy that wants them), unless this node
            // is out of memory: then its fallback pages serve.
            Active::Local => {
                state.mode != Mode::PerNode || node == here || state.arena(here).is_none_or(|a| a.is_exhausted())
            }
            Active::Bind(s) => s.contains(node),
            // The preferred node, or any while it is out of memory.
            Active::Preferred(n) => node == n || state.arena(n).is_none_or(|a| a.is_exhausted()),
            // The tier's node, or (no lower tier, or it is out of memory)
            // the thread's own.
            Active::LowerTier => match lower_tier_map(state)[here % MAX_NODES] {
                u8::MAX => node == here,
                // (The arena lock only for pages of the thread's node.)
                m => node == usize::from(m) || (node == here && cold_target(state, here).1),
            },
        }
    }

    /// The node fresh memory comes from (its arena falls back by distance
    /// when it is out of memory; for `Bind`, only within the set).
    #[unsafe(link_section = ".text.sorted.numaweave")]
    fn node(&self, state: &State) -> usize {
        let here = state.topology.current_node();
        match *self {
            Active::Local | Active::Interleave(_) | Active::Rules(_) => here,
            Active::Preferred(n) => n,
            Active::LowerTier => cold_node(state, here),
            Active::Bind(s) => state.topology.nodes_by_distance(here).find(|&n| s.contains(n)).unwrap_or(here),
        }
    }

    /// The nodes a fallback may use.
    fn fallback_set(&self) -> Option<NodeSet> {
        match *self {
            Active::Bind(s) => Some(s),
            _ => None,
        }
    }
}

/// [`lower_tier_map`]'s table.
static LOWER_TIER: InitCell<[u8; MAX_NODES]> = InitCell::new();

/// The lower-tier node nearest each node (by logical id; `u8::MAX`: none
/// with an arena), worked out once from the allocator's topology.
fn lower_tier_map(state: &State) -> &'static [u8; MAX_NODES] {
    if let Some(m) = LOWER_TIER.get() {
        return m;
    }
    // Held across fork() from now on, so that no child inherits it half made.
    register_fork_handlers();
    LOWER_TIER.get_or_init(|| {
        let t = state.topology;
        let mut map = [u8::MAX; MAX_NODES];
        for n in t.nodes().iter() {
            // Among the lower-tier nodes the allocator places on.
            if let Some(m) = t.nearest_lower_tier_among(n, |m| state.arena(m).is_some()) {
                map[n] = m as u8;
            }
        }
        map
    })
}

/// Where cold data of a thread on `here` goes (`tier:lower`, `A.cold()`):
/// the nearest lower-tier node, unless there is none or it is out of
/// memory; then `here`, the top tier (`true`: a fallback).
pub(crate) fn cold_target(state: &State, here: usize) -> (usize, bool) {
    match lower_tier_map(state)[here % MAX_NODES] {
        u8::MAX => (here, true),
        m => {
            let m = usize::from(m);
            if state.arena(m).is_some_and(|a| !a.is_exhausted()) { (m, false) } else { (here, true) }
        }
    }
}

/// [`cold_target`] for a fresh page or block: a fallback to the top tier
/// is counted on `here`'s arena.
pub(crate) fn cold_node(state: &State, here: usize) -> usize {
    let (node, fell_back) = cold_target(state, here);
    if fell_back {
        state.node_arena(here).counters.fallbacks.fetch_add(1, crate::sync::Ordering::Relaxed);
    }
    node
}

/// Makes `active` the thread's policy in force: recorded, and the heap's
/// direct pages cleared so that every class refills under it.
fn install(t: &ThreadPolicy, active: Active) {
    t.set_active(active);
    let h = heap::current_or_none();
    if heap::is_heap(h) {
        // SAFETY: the calling thread's heap.
        unsafe {
            Heap::clear_direct(h);
            (*h).cpu_served.store(t.cpu_served(), Ordering::Relaxed);
        }
    } else if h == heap::cpu_no_heap() && t.scoped.get().is_some() {
        // Its next allocation decides again, under the thread's policy.
        heap::set_cpu_served(false);
    }
}

/// [`with_policy`](crate::with_policy), the allocator's `state` started.
pub(crate) fn with_policy_in(state: &'static State, policy: Policy) -> Result<PolicyGuard> {
    if !default().policies {
        return Err(crate::Error::InvalidPolicy { reason: "memory policies are switched off (NUMAWEAVE_POLICY=none)" });
    }
    policy.validate(state.topology)?;
    let il = match &policy {
        Policy::Interleave(i) => {
            let b = Box::<ThreadInterleaver>::new_uninit();
            let p = Box::into_raw(b).cast::<ThreadInterleaver>();
            // SAFETY: fresh, uninitialised memory for one interleaver.
            unsafe { ThreadInterleaver::write(p, i, state) };
            // SAFETY: initialised just above, from `Box::into_raw`.
            Some(unsafe { Box::from_raw(p) })
        }
        _ => None,
    };
    let active = to_active(&policy, il.as_deref().map(|p| p as *const ThreadInterleaver));
    let prev = THREAD.with(|t| {
        let prev = t.scoped.replace(Some(active));
        install(t, active);
        prev
    });
    Ok(PolicyGuard { prev, _il: il, _not_send: PhantomData })
}

/// Restores the previous policy of the thread when dropped; see [`with_policy`](crate::with_policy).
#[must_use = "the policy is undone when the guard is dropped"]
pub struct PolicyGuard {
    prev: Option<Active>,
    _il: Option<Box<ThreadInterleaver>>,
    /// Thread-scoped: it restores this thread's policy.
    _not_send: PhantomData<*const ()>,
}

impl Drop for PolicyGuard {
    fn drop(&mut self) {
        if let Some(s) = State::try_get() {
            THREAD.with(|t| {
                t.scoped.set(self.prev);
                install(t, t.active(s));
            });
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
