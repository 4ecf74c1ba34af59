//! [`Config`]: what a [`NumaAlloc`](super::NumaAlloc) value configures, and
//! the start-up that turns it into the process's allocator: the core's
//! settings go to the state, the default placement to `placement.rs`.

use super::engine::lifecycle::published;
use super::engine::state::UpperStart;
use super::engine::types::{Mode, Settings, State};
use super::placement::{self, PolicyGuard};
use crate::error::Result;
use crate::os::file;
use crate::os::mem::Huge;
use crate::policy::{Policy, SizeRules};
use crate::topology::Topology;

/// Allocator configuration, `const` so it can sit in the `#[global_allocator]`
/// static. Environment variables, read once at start-up, override it:
///
/// | variable | values | default |
/// | --- | --- | --- |
/// | `NUMAWEAVE_MODE` | `auto`, `flat`, `per-node` | `auto` |
/// | `NUMAWEAVE_STRICT` | `0`, `1`: bind strictly (`MPOL_BIND`), never fall back to another node | `0` |
/// | `NUMAWEAVE_PURGE` | bytes (`K`, `M`, `G` suffixes): free page memory an arena keeps committed before returning it to the OS at once (8 times that with a purge delay); a heap's growth that purges its untouched classes | `8M` |
/// | `NUMAWEAVE_PURGE_DELAY` | a duration (`100ms`, `1s`, `0`): how long freed memory stays committed unused ([`Config::purge_delay`]) | `100ms` |
/// | `NUMAWEAVE_POLICY` | the process default [`Policy`] in its text form: `local`, `bind:1`, `preferred:0`, `interleave:0-3:bytes=2M`, `interleave:0,1:count=8:weights=3,1` (see [`policy`](crate::policy)); `none` switches policies off ([`Config::policies`]) | `local` |
/// | `NUMAWEAVE_TOPOLOGY` | see [`topology`](crate::topology) (`hwloc` is not available to the allocator) | `sysfs` |
/// | `NUMAWEAVE_HUGE` | `off`, `thp`, `hugetlb`, `hugetlb-1g`: interleave regions (and slab caches built without a choice) on huge pages ([`Config::huge`]) | `off` |
/// | `NUMAWEAVE_VERBOSE` | `1`: print the configuration and the topology at start ([`Config::verbose`]) | `0` |
/// | `NUMAWEAVE_SHOW_STATS` | `1`: print the per-node statistics at exit ([`Config::show_stats`]) | `0` |
/// | `NUMAWEAVE_CPU_CACHE` | `1`: per-CPU caches of small blocks on glibc's rseq area ([`Config::cpu_cache`]) | `0` |
/// | `NUMAWEAVE_PUBLISH` | `1`: the size classes' usage per node published for `numaweave numastat PID` ([`Config::publish`]) | `0` |
/// | `NUMAWEAVE_CHECK` | hardened builds (feature `hardened`): `full` adds red zones and poison | `default` |
/// | `NUMAWEAVE_ON_ERROR` | hardened builds: `report` leaks a misused block and goes on | `abort` |
/// | `NUMAWEAVE_GUARD` | hardened builds: `1` puts a page no access is allowed to after every segment and huge mapping | `0` |
///
/// An invalid value is reported once on stderr and the configured value kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// What the core reads: mode, binding, purging, huge pages, printing.
    pub(crate) core: Settings,
    /// The process default placement: rules by size, one rule for a plain
    /// policy.
    pub(crate) default: SizeRules,
    /// `false`: policies switched off.
    pub(crate) policies: bool,
    /// Per-CPU caches of small blocks where glibc registered rseq.
    pub(crate) cpu_cache: bool,
    /// The classes' usage published for `numaweave numastat PID`.
    pub(crate) publish: bool,
}

impl Config {
    /// The defaults: `Auto`, not strict, 8 MiB purge threshold.
    pub const fn new() -> Self {
        Self {
            core: Settings::new(),
            default: SizeRules::single(Policy::Local),
            policies: true,
            cpu_cache: false,
            publish: false,
        }
    }

    /// Serves blocks of up to 2 KiB from per-CPU caches
    /// (`NUMAWEAVE_CPU_CACHE=1`): for each CPU and class a stack of free
    /// blocks that the threads running there pop and push with restartable
    /// sequences on the rseq area glibc registered for each thread. The
    /// free blocks kept grow with CPUs, not threads (the caches hold at
    /// most 746 KiB a CPU; each CPU's home heap, whose pages they come
    /// from, holds more), and a thread moved to another node's CPU takes that node's
    /// blocks from its next allocation. Allocation-heavy loops run slower
    /// than under the per-thread caches (`benches/RESULTS.md`). Only under the `Local` default
    /// (a thread's own policy from [`with_policy`] uses its heap); where
    /// glibc registered no rseq (before 2.35,
    /// `GLIBC_TUNABLES=glibc.pthread.rseq=0`) or off x86-64 Linux, and in
    /// hardened builds, the per-thread caches serve. Off by default.
    ///
    /// ```
    /// use numaweave::{Config, NumaAlloc};
    /// static A: NumaAlloc = NumaAlloc::with_config(Config::new().cpu_cache(true));
    /// let v = vec![1u8; 100];
    /// assert_eq!(v.iter().map(|&b| b as u32).sum::<u32>(), 100);
    /// # let _ = &A;
    /// ```
    pub const fn cpu_cache(mut self, on: bool) -> Self {
        self.cpu_cache = on;
        self
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
        self.default = SizeRules::single(policy);
        self
    }

    /// A process default by size ([`SizeRules`]: small blocks local, big
    /// ones interleaved, say), instead of one policy for every size.
    /// Checked at start-up like [`policy`](Self::policy).
    pub const fn policy_rules(mut self, rules: SizeRules) -> Self {
        self.default = rules;
        self
    }

    /// Prints the configuration and the topology on stderr when the first
    /// thread starts allocating (`NUMAWEAVE_VERBOSE=1`).
    pub const fn verbose(mut self, on: bool) -> Self {
        self.core.verbose = on;
        self
    }

    /// Prints the per-node statistics on stderr at `exit()`
    /// (`NUMAWEAVE_SHOW_STATS=1`, like `MIMALLOC_SHOW_STATS`).
    pub const fn show_stats(mut self, on: bool) -> Self {
        self.core.show_stats = on;
        self
    }

    /// Publishes the size classes' usage per node, at most once a second,
    /// to a memory file that `numaweave numastat PID` reads
    /// (`NUMAWEAVE_PUBLISH=1`): for each node and class the bytes its pages
    /// span, hold in use, wait to collect from other threads' frees and
    /// strand ([`ClassUsage`](crate::stats::ClassUsage)), read from
    /// outside while the program runs ([`stats::class_table`](crate::stats::class_table)).
    /// The process's threads publish on their refills (no thread of the
    /// allocator's own) and at [`NumaAlloc::trim`](crate::NumaAlloc::trim):
    /// a program that stopped allocating shows its last figures, with
    /// their age. Costs a descriptor and a walk of the pages once a
    /// second; off by default.
    ///
    /// ```
    /// use numaweave::{Config, NumaAlloc};
    /// static A: NumaAlloc = NumaAlloc::with_config(Config::new().publish(true));
    /// let v = vec![7u8; 1000];
    /// assert_eq!(v[999], 7);
    /// # let _ = &A;
    /// ```
    pub const fn publish(mut self, on: bool) -> Self {
        self.publish = on;
        self
    }

    /// Sets the mode.
    pub const fn mode(mut self, mode: Mode) -> Self {
        self.core.mode = mode;
        self
    }

    /// Strict binding: memory of a node comes from that node or not at all
    /// (`MPOL_BIND`; when the node is full the kernel's OOM handling applies,
    /// as under `numactl --membind`). Default: preferred binding, falling back
    /// to the nearest node by distance, every fallback counted.
    pub const fn strict(mut self, strict: bool) -> Self {
        self.core.strict = strict;
        self
    }

    /// Free page memory (per arena) kept committed for reuse: past it, it is
    /// returned to the OS with `MADV_DONTNEED` at once. With a purge delay
    /// the bound is 8 times this (free pages and freed large mappings each);
    /// the pages' bound is raised to twice a burst of frees past it that
    /// recurs within four delays (at most 16 times; what is free at the
    /// raise stays), and what stays under a bound goes back once it has
    /// waited out the delay. A thread's heap that takes this much in fresh
    /// pages also purges, without waiting, the free blocks of the
    /// classes it has not refilled since it last gave back (the pages an
    /// exited thread's sizes left, once a thread that adopted its heap
    /// grows in sizes of its own).
    pub const fn purge_threshold(mut self, bytes: usize) -> Self {
        self.core.purge_threshold = bytes;
        self
    }

    /// How long freed memory (pages, empty segments, large mappings) stays
    /// committed unused before it goes back to the OS (checked on the
    /// allocator's slow paths, at thread exit and in
    /// [`NumaAlloc::collect`](crate::NumaAlloc::collect): no thread or timer
    /// of its own). Each page waits from its own free; pages that waited it
    /// out go back to the OS (`MADV_DONTNEED`), and four empty segments per
    /// arena stay mapped; past the bound (see [`purge_threshold`](Self::purge_threshold))
    /// memory goes back at once. An arena doubles its delay (up to 16 times)
    /// when pages it purged under the delay are taken again within one
    /// delay, as many as an eighth of the threshold (four times more for
    /// each doubling made), and halves it again after 16 delays without a
    /// quarter of that. Zero: only past the threshold, at once (the
    /// behaviour before the delay). Default 100 ms.
    pub const fn purge_delay(mut self, delay: core::time::Duration) -> Self {
        self.core.purge_delay_ms = delay.as_millis() as u64;
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
        self.core.huge = huge;
        self
    }

    // Out of line and not in the hot text: called only when some
    // `NUMAWEAVE_*` variable is set.
    #[cold]
    #[inline(never)]
    pub(crate) fn apply_env(mut self) -> Self {
        if let Some(v) = file::env(c"NUMAWEAVE_MODE") {
            match v.trim_ascii() {
                "auto" => self.core.mode = Mode::Auto,
                "flat" => self.core.mode = Mode::Flat,
                "per-node" | "pernode" => self.core.mode = Mode::PerNode,
                _ => {
                    file::report(format_args!("numaweave: ignoring NUMAWEAVE_MODE={v:?} (want auto, flat or per-node)"))
                }
            }
        }
        for (name, flag) in [
            (c"NUMAWEAVE_STRICT", &mut self.core.strict),
            (c"NUMAWEAVE_VERBOSE", &mut self.core.verbose),
            (c"NUMAWEAVE_SHOW_STATS", &mut self.core.show_stats),
            (c"NUMAWEAVE_CPU_CACHE", &mut self.cpu_cache),
            (c"NUMAWEAVE_PUBLISH", &mut self.publish),
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
            match v.parse::<SizeRules>() {
                _ if v.trim() == "none" => self.policies = false,
                Ok(r) => self.default = r,
                Err(e) => file::report(format_args!(
                    "numaweave: ignoring NUMAWEAVE_POLICY={v:?}: {e} (want e.g. local, bind:1, preferred:0, \
                     interleave:0-3:bytes=2M, <64K:local;>=64K:interleave:0-3:bytes=2M)"
                )),
            }
        }
        if let Some(v) = file::env(c"NUMAWEAVE_HUGE") {
            match v.parse::<Huge>() {
                Ok(h) => self.core.huge = h,
                Err(e) => file::report(format_args!("numaweave: ignoring NUMAWEAVE_HUGE={v:?} ({e})")),
            }
        }
        if let Some(v) = file::env(c"NUMAWEAVE_PURGE_DELAY") {
            match crate::units::parse_millis(v) {
                Some(ms) => self.core.purge_delay_ms = ms,
                None => file::report(format_args!(
                    "numaweave: ignoring NUMAWEAVE_PURGE_DELAY={v:?} (want a duration: 100ms, 1s, 0)"
                )),
            }
        }
        if let Some(v) = file::env(c"NUMAWEAVE_PURGE") {
            match crate::units::parse_bytes(v) {
                Some(b) => self.core.purge_threshold = b,
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

/// The process's allocator, started with `config` (and the `NUMAWEAVE_*`
/// variables) if no allocation started it yet: the first caller's
/// configuration is the process's.
#[cold]
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(crate) fn start(config: &Config) -> &'static State {
    if let Some(s) = State::try_get() {
        return s;
    }
    let config = if file::env_has_prefix(b"NUMAWEAVE_") { config.apply_env() } else { *config };
    // The default placement is set inside the state's start-up, so that
    // whoever sees the state sees it too.
    State::get(&config.core, &config)
}

impl UpperStart for Config {
    #[unsafe(link_section = ".text.sorted.numaweave")]
    fn start(&self, topology: &Topology) {
        if self.publish {
            published::enable();
        }
        placement::set_default(self.default, self.policies, self.cpu_cache, topology)
    }
}

/// The process's allocator, started with the defaults if need be (for the
/// explicit APIs that are not methods of a [`NumaAlloc`](super::NumaAlloc)).
#[inline]
pub(crate) fn state() -> &'static State {
    match State::try_get() {
        Some(s) => s,
        None => start(&Config::new()),
    }
}

/// Sets the calling thread's policy until the guard is dropped, then puts the
/// previous one back (guards nest). The policy is checked against the
/// allocator's topology first.
///
/// Under an `Interleave` policy, blocks of a page and more follow the
/// interleave exactly (turn by turn, a turn's blocks back to back, what the
/// thread frees reused on its node), smaller ones page by page (see the
/// crate's README); other policies cost nothing on the fast path.
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
    placement::with_policy_in(state(), policy)
}
