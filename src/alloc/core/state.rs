//! Process-wide allocator state, set up once at the first allocation: the
//! topology, the mode, the arenas, and the registry of heaps.
//!
//! Start-up never recurses: topology discovery and the environment are read
//! without the heap, and heap descriptors come from `mmap`ed metadata chunks.

use core::mem::MaybeUninit;
use core::ptr::{self, NonNull};

use super::arena::Arena;
use super::heap::Heap;
use super::lifecycle::Lifecycle;
use crate::os::mem::Huge;
use crate::os::{file, mem, thread};
use crate::policy::{Policy, SizeRules};
use crate::sync::{AtomicBool, InitCell, Ordering, SpinLock};
use crate::topology::{MAX_NODES, NodeSet, Topology};

/// How arenas map to nodes, chosen once at start-up (as knfsd chose its pool
/// mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `Flat` on one node, `PerNode` on several.
    Auto,
    /// One arena, memory placed by first touch: what a NUMA-unaware
    /// allocator does.
    Flat,
    /// One arena per node with memory, each bound to its node; threads take
    /// pages from the arena of the node they run on.
    PerNode,
}

/// Allocator configuration, `const` so it can sit in the `#[global_allocator]`
/// static. Environment variables, read once at start-up, override it:
///
/// | variable | values | default |
/// | --- | --- | --- |
/// | `NUMAWEAVE_MODE` | `auto`, `flat`, `per-node` | `auto` |
/// | `NUMAWEAVE_STRICT` | `0`, `1`: bind strictly (`MPOL_BIND`), never fall back to another node | `0` |
/// | `NUMAWEAVE_PURGE` | bytes (`K`, `M`, `G` suffixes): free page memory an arena keeps committed before returning it to the OS at once (8 times that with a purge delay) | `8M` |
/// | `NUMAWEAVE_PURGE_DELAY` | a duration (`100ms`, `1s`, `0`): how long freed memory stays committed unused ([`Config::purge_delay`]) | `100ms` |
/// | `NUMAWEAVE_POLICY` | the process default [`Policy`] in its text form: `local`, `bind:1`, `preferred:0`, `interleave:0-3:bytes=2M`, `interleave:0,1:count=8:weights=3,1` (see [`policy`](crate::policy)); `none` switches policies off ([`Config::policies`]) | `local` |
/// | `NUMAWEAVE_TOPOLOGY` | see [`topology`](crate::topology) (`hwloc` is not available to the allocator) | `sysfs` |
/// | `NUMAWEAVE_HUGE` | `off`, `thp`, `hugetlb`, `hugetlb-1g`: interleave regions (and slab caches built without a choice) on huge pages ([`Config::huge`]) | `off` |
/// | `NUMAWEAVE_VERBOSE` | `1`: print the configuration and the topology at start ([`Config::verbose`]) | `0` |
/// | `NUMAWEAVE_SHOW_STATS` | `1`: print the per-node statistics at exit ([`Config::show_stats`]) | `0` |
/// | `NUMAWEAVE_CHECK` | hardened builds (feature `hardened`): `full` adds red zones and poison | `default` |
/// | `NUMAWEAVE_ON_ERROR` | hardened builds: `report` leaks a misused block and goes on | `abort` |
/// | `NUMAWEAVE_GUARD` | hardened builds: `1` puts a page no access is allowed to after every segment and huge mapping | `0` |
///
/// An invalid value is reported once on stderr and the configured value kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    pub(crate) mode: Mode,
    pub(crate) strict: bool,
    pub(crate) purge_threshold: usize,
    pub(crate) purge_delay_ms: u64,
    pub(crate) policy: Policy,
    /// Rules by size (none: `policy` for every size).
    pub(crate) rules: SizeRules,
    pub(crate) policies: bool,
    pub(crate) verbose: bool,
    pub(crate) show_stats: bool,
    pub(crate) huge: Huge,
}

impl Config {
    /// The defaults: `Auto`, not strict, 8 MiB purge threshold.
    pub const fn new() -> Self {
        Self {
            mode: Mode::Auto,
            strict: false,
            purge_threshold: 8 << 20,
            purge_delay_ms: 100,
            policy: Policy::Local,
            rules: SizeRules::new(),
            policies: true,
            verbose: false,
            show_stats: false,
            huge: Huge::Off,
        }
    }

    /// Switches memory policies off (`NUMAWEAVE_POLICY=none`): the slow path
    /// skips the policy lookup and every thread allocates as under `Local`
    /// before policies existed (a heap refills from any of its pages).
    /// [`with_policy`](crate::with_policy) then fails. For measuring what
    /// policies cost; there is no other reason to.
    pub const fn policies(mut self, on: bool) -> Self {
        self.policies = on;
        self
    }

    /// The process default memory policy (threads may override it with
    /// [`with_policy`](crate::with_policy)). Checked against the topology at
    /// start-up; an invalid one is reported on stderr and `Local` used.
    ///
    /// An `Interleave` default gives each thread its own cursor and regions
    /// (Linux, too, keeps the interleave position per task): a thread's
    /// allocations rotate over the nodes turn by turn, and what it frees is
    /// reused on its node, as under a [`with_policy`](crate::with_policy)
    /// interleave. For one cursor shared by many threads, use a handle
    /// ([`NumaAlloc::interleave`](crate::NumaAlloc::interleave)).
    pub const fn policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self.rules = SizeRules::new();
        self
    }

    /// A process default by size ([`SizeRules`]: small blocks local, big
    /// ones interleaved, say), instead of one policy for every size.
    /// Checked at start-up like [`policy`](Self::policy).
    pub const fn policy_rules(mut self, rules: SizeRules) -> Self {
        self.rules = rules;
        self
    }

    /// Prints the configuration and the topology on stderr when the first
    /// thread starts allocating (`NUMAWEAVE_VERBOSE=1`).
    pub const fn verbose(mut self, on: bool) -> Self {
        self.verbose = on;
        self
    }

    /// Prints the per-node statistics on stderr at `exit()`
    /// (`NUMAWEAVE_SHOW_STATS=1`, like `MIMALLOC_SHOW_STATS`).
    pub const fn show_stats(mut self, on: bool) -> Self {
        self.show_stats = on;
        self
    }

    /// Sets the mode.
    pub const fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Strict binding: memory of a node comes from that node or not at all
    /// (`MPOL_BIND`; when the node is full the kernel's OOM handling applies,
    /// as under `numactl --membind`). Default: preferred binding, falling back
    /// to the nearest node by distance, every fallback counted.
    pub const fn strict(mut self, strict: bool) -> Self {
        self.strict = strict;
        self
    }

    /// Free page memory (per arena) kept committed for reuse: past it, it is
    /// returned to the OS with `MADV_DONTNEED` at once. With a purge delay
    /// the bound is 8 times this (free pages and freed large mappings each),
    /// and what stays under it goes back once it has waited out the delay.
    pub const fn purge_threshold(mut self, bytes: usize) -> Self {
        self.purge_threshold = bytes;
        self
    }

    /// How long freed memory (pages, empty segments, large mappings) stays
    /// committed unused before it goes back to the OS (checked on the
    /// allocator's slow paths, at thread exit and in
    /// [`NumaAlloc::collect`](crate::NumaAlloc::collect): no thread or timer
    /// of its own). Each page waits from its own free; pages that waited it
    /// out go back to the OS (`MADV_DONTNEED`), and four empty segments per
    /// arena stay mapped; past the bound (see [`purge_threshold`](Self::purge_threshold))
    /// memory goes back at once. An arena whose purged pages are taken again
    /// within the delay doubles it (up to 16 times), and halves it again after
    /// 16 delays without that. Zero: only past the threshold, at once (the
    /// behaviour before the delay). Default 100 ms.
    pub const fn purge_delay(mut self, delay: core::time::Duration) -> Self {
        self.purge_delay_ms = delay.as_millis() as u64;
        self
    }

    /// Interleave regions (where I/O buffers of an interleave are carved,
    /// 4 MiB each) on huge pages: [`Huge::Thp`] asks for transparent huge
    /// pages; [`Huge::Hugetlb`] takes 2 MiB pages from each node's reserved
    /// pool, committed when a region is mapped and checked to be on its node,
    /// so that a turn of `Bytes(2 MiB)` is one physical run; a node whose
    /// pool is short gets base pages (counted in
    /// [`NodeStats::huge_fallbacks`](crate::stats::NodeStats::huge_fallbacks)),
    /// or with `strict` (`NUMAWEAVE_STRICT=1`) the buffer's allocation fails.
    /// What THP requests got: [`Stats::thp_bytes`](crate::stats::Stats::thp_bytes).
    /// Small blocks are unaffected. Default off.
    pub const fn huge(mut self, huge: Huge) -> Self {
        self.huge = huge;
        self
    }

    // Out of line and not in the hot text: called only when some
    // `NUMAWEAVE_*` variable is set.
    #[cold]
    #[inline(never)]
    fn apply_env(mut self) -> Self {
        if let Some(v) = file::env(c"NUMAWEAVE_MODE") {
            match v.trim_ascii() {
                "auto" => self.mode = Mode::Auto,
                "flat" => self.mode = Mode::Flat,
                "per-node" | "pernode" => self.mode = Mode::PerNode,
                _ => {
                    file::report(format_args!("numaweave: ignoring NUMAWEAVE_MODE={v:?} (want auto, flat or per-node)"))
                }
            }
        }
        for (name, flag) in [
            (c"NUMAWEAVE_STRICT", &mut self.strict),
            (c"NUMAWEAVE_VERBOSE", &mut self.verbose),
            (c"NUMAWEAVE_SHOW_STATS", &mut self.show_stats),
        ] {
            if let Some(v) = file::env(name) {
                match v.trim_ascii() {
                    "0" | "false" | "no" => *flag = false,
                    "1" | "true" | "yes" => *flag = true,
                    _ => {
                        file::report(format_args!("numaweave: ignoring {}={v:?} (want 0 or 1)", name.to_string_lossy()))
                    }
                }
            }
        }
        if let Some(v) = file::env(c"NUMAWEAVE_POLICY") {
            let parsed = match SizeRules::is_rules_text(v) {
                true => v.trim().parse::<SizeRules>().map(|r| (Policy::Local, r)),
                false => v.trim().parse::<Policy>().map(|p| (p, SizeRules::new())),
            };
            match parsed {
                _ if v.trim() == "none" => self.policies = false,
                Ok((p, r)) => (self.policy, self.rules) = (p, r),
                Err(e) => file::report(format_args!(
                    "numaweave: ignoring NUMAWEAVE_POLICY={v:?}: {e} (want e.g. local, bind:1, preferred:0, \
                     interleave:0-3:bytes=2M, <64K:local;>=64K:interleave:0-3:bytes=2M)"
                )),
            }
        }
        if let Some(v) = file::env(c"NUMAWEAVE_HUGE") {
            match v.parse::<Huge>() {
                Ok(h) => self.huge = h,
                Err(e) => file::report(format_args!("numaweave: ignoring NUMAWEAVE_HUGE={v:?} ({e})")),
            }
        }
        if let Some(v) = file::env(c"NUMAWEAVE_PURGE_DELAY") {
            match crate::units::parse_millis(v) {
                Some(ms) => self.purge_delay_ms = ms,
                None => file::report(format_args!(
                    "numaweave: ignoring NUMAWEAVE_PURGE_DELAY={v:?} (want a duration: 100ms, 1s, 0)"
                )),
            }
        }
        if let Some(v) = file::env(c"NUMAWEAVE_PURGE") {
            match crate::units::parse_bytes(v) {
                Some(b) => self.purge_threshold = b,
                None => file::report(format_args!("numaweave: ignoring NUMAWEAVE_PURGE={v:?} (want bytes, e.g. 8M)")),
            }
        }
        self
    }
}

impl Default for Config {
    fn default() -> Self {
        Self::new()
    }
}

pub(crate) struct State {
    pub(crate) config: Config,
    /// The mode after resolving `Auto`.
    pub(crate) mode: Mode,
    pub(crate) topology: Topology,
    /// More than one node with memory (and per-node mode): fallbacks are checked.
    pub(crate) multi_node: bool,
    pub(crate) arenas: [Arena; MAX_NODES],
    /// For each logical node, the arena its threads use (nearest allowed node
    /// with memory).
    home: [u8; MAX_NODES],
    /// Every heap ever made, linked through `Heap::next_all` (never shrinks:
    /// heaps are adopted, not freed).
    pub(crate) heaps: SpinLock<*mut Heap>,
    meta: SpinLock<MetaChunk>,
    /// Runs `heap::thread_exit` when a thread with a heap exits.
    pub(crate) exit_key: ExitHook,
    /// The process default policy (validated). An interleave gives each
    /// thread its own cursor and regions (see `policy::thread_interleaver`).
    pub(crate) default_policy: Policy,
    /// The process default by size, when given (validated): then
    /// `default_policy` is unused.
    pub(crate) rules: Option<SizeRules>,
    /// `false`: policies switched off, the slow path never looks them up.
    pub(crate) policies: bool,
    /// Whether the first thread's start-up work (`settle`) was done.
    settled: AtomicBool,
    /// The memory lifecycle: what is due to go back, and when.
    pub(crate) life: Lifecycle,
}

// SAFETY: raw pointers inside are guarded by the spin locks around them.
unsafe impl Sync for State {}
// SAFETY: as above.
unsafe impl Send for State {}

struct MetaChunk {
    next: *mut u8,
    end: *mut u8,
}

static STATE: InitCell<State> = InitCell::new();

/// The thread-exit key, if libc gave one.
pub(crate) struct ExitHook(Option<thread::ExitKey>);

impl ExitHook {
    /// Sets the calling thread's value (its heap).
    pub(crate) fn set(&self, value: *mut libc::c_void) {
        if let Some(k) = &self.0 {
            k.set(value);
        }
    }
}

impl State {
    /// The state, set up by the first caller with `config`.
    #[inline]
    pub(crate) fn get(config: &Config) -> &'static State {
        match STATE.get() {
            Some(s) => s,
            // SAFETY: `init` writes every field (its last lines check the
            // list against the struct).
            None => unsafe { STATE.get_or_init_in_place(|slot| State::init(*config, slot)) },
        }
    }

    /// The state if it exists.
    #[inline]
    pub(crate) fn try_get() -> Option<&'static State> {
        STATE.get()
    }

    /// Sets the state up in `slot`, field by field: built as a value it
    /// took 40 KiB of stack (two copies of its 18 KiB, most of it the
    /// arenas), pages every program kept in its RSS.
    #[cold]
    #[unsafe(link_section = ".text.hot.numaweave")]
    fn init(config: Config, slot: &mut MaybeUninit<State>) {
        // A child forked while another thread holds one of the allocator's
        // locks would wait on it forever: hold them all across fork(). (The
        // handlers only take and release the core's spin locks; the layers
        // above register their own, see `ForkRank`.)
        if let Err(e) = thread::at_fork(thread::ForkRank::Core, fork_prepare, fork_release) {
            file::report(format_args!("numaweave: no fork handlers ({e}): fork() from a threaded program may hang"));
        }
        let config = if file::env_has_prefix(b"NUMAWEAVE_") { config.apply_env() } else { config };
        #[cfg(feature = "hardened")]
        {
            crate::hardened::init();
            crate::hardened::set_fast_bound(super::size_class::SMALL_MAX);
        }
        let s = slot.as_mut_ptr();
        // SAFETY: writes the field in place (nothing was there to drop); the
        // reference taken after it points at that initialised field, which
        // nothing writes again.
        let topology: &Topology = unsafe {
            (&raw mut (*s).topology).write(allocator_topology());
            &(*s).topology
        };
        let mem_nodes = topology.allowed_nodes().intersection(&topology.memory_nodes());
        let mode = match config.mode {
            Mode::Auto if mem_nodes.len() > 1 => Mode::PerNode,
            Mode::Auto => Mode::Flat,
            m => m,
        };
        for n in 0..MAX_NODES {
            let bind = (mode == Mode::PerNode && mem_nodes.contains(n)).then(|| topology.physical_node(n));
            // SAFETY: `n` indexes the slot's `[Arena; MAX_NODES]` field; each
            // element is written once, in place.
            unsafe { (&raw mut (*s).arenas).cast::<Arena>().add(n).write(Arena::new(n, bind)) };
        }
        let mut home = [0u8; MAX_NODES];
        if mode == Mode::PerNode {
            for n in topology.nodes().iter() {
                let h = topology.nodes_by_distance(n).find(|&m| mem_nodes.contains(m)).unwrap_or(0);
                home[n] = h as u8;
            }
        }
        let default_policy = match config.policy {
            Policy::Local => Policy::Local,
            p => checked_default_policy(p, topology),
        };
        let rules = checked_rules(&config.rules, topology);
        // Without it exited threads' heaps wait for adoption only when a
        // thread of the same node exits cleanly; nothing breaks.
        let exit_key = match thread::ExitKey::new(super::heap::thread_exit) {
            Ok(k) => Some(k),
            Err(e) => {
                file::report(format_args!(
                    "numaweave: no thread-exit hook ({e}): exited threads' heaps are not reused"
                ));
                None
            }
        };
        // SAFETY: each write fills one field of the slot, in place; with the
        // two above, every field (the pattern below lists them).
        unsafe {
            (&raw mut (*s).config).write(config);
            (&raw mut (*s).mode).write(mode);
            (&raw mut (*s).multi_node).write(mode == Mode::PerNode && mem_nodes.len() > 1);
            (&raw mut (*s).home).write(home);
            (&raw mut (*s).heaps).write(SpinLock::new(ptr::null_mut()));
            (&raw mut (*s).meta).write(SpinLock::new(MetaChunk { next: ptr::null_mut(), end: ptr::null_mut() }));
            (&raw mut (*s).exit_key).write(ExitHook(exit_key));
            (&raw mut (*s).default_policy).write(default_policy);
            (&raw mut (*s).rules).write(rules);
            (&raw mut (*s).policies).write(config.policies);
            (&raw mut (*s).settled).write(AtomicBool::new(false));
            (&raw mut (*s).life).write(Lifecycle::new());
        }
        // The fields written above, by name: a field added to `State` fails
        // to compile here until it is written too.
        let _: fn(&State) = |s| {
            let State {
                config: _,
                mode: _,
                topology: _,
                multi_node: _,
                arenas: _,
                home: _,
                heaps: _,
                meta: _,
                exit_key: _,
                default_policy: _,
                rules: _,
                policies: _,
                settled: _,
                life: _,
            } = s;
        };
    }

    /// Once, when the first heap is made (after start-up, outside the
    /// allocator's locks: this may allocate): prints the configuration and
    /// topology (`NUMAWEAVE_VERBOSE`).
    #[unsafe(link_section = ".text.hot.numaweave")]
    pub(crate) fn settle(&'static self) {
        if self.config.verbose && !self.settled.swap(true, Ordering::Relaxed) {
            self.settle_slow();
        }
    }

    /// The process default's interleave: the default policy's, or the
    /// interleave rule's.
    pub(crate) fn default_interleave(&self) -> Option<&crate::policy::Interleave> {
        match (&self.rules, &self.default_policy) {
            (Some(r), _) => r.interleave(),
            (None, Policy::Interleave(i)) => Some(i),
            _ => None,
        }
    }

    /// What `settle` does when asked to: out of line and not in the hot
    /// text (formatting code).
    #[cold]
    #[inline(never)]
    fn settle_slow(&'static self) {
        let c = &self.config;
        file::write_stderr(format_args!(
            "numaweave: mode {:?} (asked {:?}), strict {}, purge threshold {} B, purge delay {} ms, huge pages {:?}, policy {}{}\n{}",
            self.mode,
            c.mode,
            c.strict,
            c.purge_threshold,
            c.purge_delay_ms,
            c.huge,
            DefaultShown(self),
            if self.policies { "" } else { " (policies off)" },
            self.topology
        ));
        if let Some(i) = self.default_interleave()
            && let Some(w) = i.auto_weights_by_node(&self.topology)
        {
            file::write_stderr(format_args!("numaweave: {w}\n"));
        }
    }

    /// The arena for logical node `node` (`None` if it has no memory here).
    pub(crate) fn arena(&self, node: usize) -> Option<&Arena> {
        match self.mode {
            Mode::PerNode => (node < MAX_NODES && self.arenas[node].bind_to.is_some()).then(|| &self.arenas[node]),
            _ => (node == 0).then(|| &self.arenas[0]),
        }
    }

    /// The arena a thread running on `node` draws from.
    #[inline]
    pub(crate) fn home_arena(&self, node: usize) -> &Arena {
        match self.mode {
            Mode::PerNode => &self.arenas[usize::from(self.home[node % MAX_NODES])],
            _ => &self.arenas[0],
        }
    }

    /// The arena that places memory on `node`: its own, or for a node
    /// without memory (and in flat mode) the arena its threads draw from.
    #[inline]
    pub(crate) fn node_arena(&self, node: usize) -> &Arena {
        self.arena(node).unwrap_or_else(|| self.home_arena(node))
    }

    /// The arena of the calling thread's current node.
    #[inline]
    pub(crate) fn current_arena(&self) -> &Arena {
        match self.mode {
            Mode::PerNode => self.home_arena(self.topology.current_node()),
            _ => &self.arenas[0],
        }
    }

    /// Memory for one heap descriptor, from `mmap`ed chunks (never the heap
    /// itself: this runs when a thread has no heap yet).
    #[unsafe(link_section = ".text.hot.numaweave")]
    pub(crate) fn alloc_meta(&self, size: usize, align: usize) -> Option<NonNull<u8>> {
        const CHUNK: usize = 1 << 20;
        let mut g = self.meta.lock();
        let mut p = (g.next as usize).next_multiple_of(align);
        if g.next.is_null() || p + size > g.end as usize {
            let chunk = mem::map(CHUNK).ok()?;
            g.next = chunk.as_ptr();
            // SAFETY: end of the fresh chunk.
            g.end = unsafe { chunk.as_ptr().add(CHUNK) };
            p = (g.next as usize).next_multiple_of(align);
        }
        g.next = (p + size) as *mut u8;
        NonNull::new(p as *mut u8)
    }

    /// The memory nodes the allocator places on.
    pub(crate) fn nodes(&self) -> NodeSet {
        match self.mode {
            Mode::PerNode => (0..MAX_NODES).filter(|&n| self.arenas[n].bind_to.is_some()).collect(),
            _ => NodeSet::single(0),
        }
    }
}

/// Every lock of the allocator core, in one fixed order (`ForkRank::Core`
/// among the layers': the interleaving's and the slab caches' are taken
/// before these): the arenas' `shared` locks first (a thread holding one
/// takes the others: `heap/shared.rs`), then the rest, of which no code
/// path holds two at once.
fn fork_locks(state: &State) -> impl DoubleEndedIterator<Item = &dyn RawLock> {
    let shared = state.arenas.iter().map(|a| &a.shared as &dyn RawLock);
    let arenas = state.arenas.iter().map(|a| &a.inner as &dyn RawLock);
    shared.chain([&state.meta as &dyn RawLock, &state.heaps as &dyn RawLock]).chain(arenas)
}

/// The two raw operations the fork handlers need, over locks of any content.
trait RawLock {
    fn take(&self);
    /// # Safety
    /// Taken with `take` by the forking thread.
    unsafe fn release(&self);
}

impl<T> RawLock for SpinLock<T> {
    fn take(&self) {
        self.lock_raw();
    }
    unsafe fn release(&self) {
        // SAFETY: forwarded contract.
        unsafe { self.unlock_raw() }
    }
}

fn fork_prepare() {
    if let Some(s) = State::try_get() {
        fork_locks(s).for_each(|l| l.take());
    }
    // The once-cells (see the lock table in `os/thread.rs`): the state
    // (an initialisation another thread is running is waited out), the
    // topology its start-up reads, the memory-performance tables read
    // lazily by policies (no lock is taken while they are read).
    STATE.hold_for_fork();
    crate::topology::global_hold_for_fork();
    crate::topology::perf_hold_for_fork();
}

/// After fork, in the parent and in the child: release what `fork_prepare`
/// took (in the child the memory is a copy, the locks held by the copy of the
/// forking thread).
fn fork_release() {
    crate::topology::perf_release_after_fork();
    crate::topology::global_release_after_fork();
    STATE.release_after_fork();
    if let Some(s) = State::try_get() {
        // SAFETY: `fork_prepare` took every one of them on this (or, in the
        // child, the copied) thread (the state, ready then, is ready now).
        fork_locks(s).rev().for_each(|l| unsafe { l.release() });
    }
}

/// The rules if there are any and `topology` can serve them; none
/// (reported) otherwise.
#[cold]
#[inline(never)]
fn checked_rules(rules: &SizeRules, topology: &Topology) -> Option<SizeRules> {
    rules.iter().next()?;
    match rules.validate(topology) {
        Ok(()) => Some(*rules),
        Err(e) => {
            file::report(format_args!("numaweave: default policy {rules}: {e}; using local"));
            None
        }
    }
}

/// `policy` if `topology` can serve it, else local (reported). Out of line
/// and not in the hot text: only a configured policy comes here.
#[cold]
#[inline(never)]
fn checked_default_policy(policy: Policy, topology: &Topology) -> Policy {
    match policy.validate(topology) {
        Ok(()) => policy,
        Err(e) => {
            file::report(format_args!("numaweave: default policy {policy}: {e}; using local"));
            Policy::Local
        }
    }
}

/// The topology as the allocator sees it: `NUMAWEAVE_TOPOLOGY` honoured
/// except `hwloc`, which allocates and so cannot serve the allocator's own
/// start-up.
fn allocator_topology() -> Topology {
    if file::env(c"NUMAWEAVE_TOPOLOGY").is_some_and(|v| v.trim_ascii() == "hwloc") {
        return sysfs_topology();
    }
    Topology::global().clone()
}

/// Out of line: its own topology value stays off `State::init`'s stack.
#[cold]
#[inline(never)]
fn sysfs_topology() -> Topology {
    file::report(format_args!("numaweave: the allocator reads the topology from sysfs (hwloc allocates)"));
    Topology::detect().unwrap_or_else(|_| Topology::single_node())
}

/// The process default as the verbose line shows it: the rules, or the policy.
struct DefaultShown<'a>(&'a State);

impl core::fmt::Display for DefaultShown<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match &self.0.rules {
            Some(r) => write!(f, "{r}"),
            None => write!(f, "{}", self.0.default_policy),
        }
    }
}
