//! Process-wide allocator state (its type is in `types.rs`), set up once at
//! the first allocation: the topology, the mode, the arenas, the registry
//! of heaps; the core's `fork()` handlers. The top floor of the core.
//!
//! Start-up never recurses: topology discovery and the environment are read
//! without the heap, and heap descriptors come from `mmap`ed metadata chunks.

use core::mem::MaybeUninit;
use core::ptr;

use super::lifecycle;
use super::types::{Arena, ExitHook, Lifecycle, MetaChunk, Mode, STATE, Settings, State};
use crate::hardened::{self, HARDENED};
use crate::os::{file, thread};
use crate::sync::{AtomicBool, InitCell, Ordering, SpinLock};
use crate::topology::{MAX_NODES, Topology};

/// The part of the state's start-up that belongs to the layers above the
/// core (the default placement): run once inside it, after the topology is
/// known and before any other thread can see the state. A trait, not a
/// closure, so that its code can be placed with the rest of the start-up
/// (a closure takes no `link_section`).
pub(crate) trait UpperStart {
    /// Sets the layers' part of the configuration up for `topology`.
    fn start(&self, topology: &Topology);
}

impl State {
    /// The state, set up by the first caller with `config`; `upper` runs
    /// once inside that set-up ([`UpperStart`]).
    #[cold]
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) fn get(config: &Settings, upper: &dyn UpperStart) -> &'static State {
        match STATE.get() {
            Some(s) => s,
            // SAFETY: `init` writes every field (its last lines check the
            // list against the struct).
            None => unsafe { STATE.get_or_init_in_place(|slot| State::init(*config, upper, slot)) },
        }
    }

    /// Sets the state up in `slot`, field by field: built as a value it
    /// took 40 KiB of stack (two copies of its 18 KiB, most of it the
    /// arenas), pages every program kept in its RSS.
    #[cold]
    #[unsafe(link_section = ".text.sorted.numaweave")]
    fn init(config: Settings, upper: &dyn UpperStart, slot: &mut MaybeUninit<State>) {
        // A child forked while another thread holds one of the allocator's
        // locks would wait on it forever: hold them all across fork(). (The
        // handlers only take and release the core's spin locks; the layers
        // above register their own, see `ForkRank`.)
        if let Err(e) = thread::at_fork(thread::ForkRank::Engine, fork_prepare, fork_release) {
            file::report(format_args!("numaweave: no fork handlers ({e}): fork() from a threaded program may hang"));
        }
        if HARDENED {
            hardened::init();
            hardened::set_fast_bound(super::size_class::SMALL_MAX);
        }
        let s = slot.as_mut_ptr();
        let topology: &'static Topology = allocator_topology();
        // SAFETY: writes the field in place (nothing was there to drop).
        unsafe { (&raw mut (*s).topology).write(topology) };
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
        upper.start(topology);
        // Without it exited threads' heaps wait for adoption only when a
        // thread of the same node exits cleanly; nothing breaks.
        let exit_key = match thread::ExitKey::new(lifecycle::thread_exit) {
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
                settled: _,
                life: _,
            } = s;
        };
    }

    /// Once, when the first heap is made (after start-up, outside the
    /// allocator's locks: this may allocate): prints the configuration and
    /// topology (`NUMAWEAVE_VERBOSE`). True when it printed: the caller
    /// adds its layer's lines.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) fn settle(&'static self) -> bool {
        if self.config.verbose && !self.settled.swap(true, Ordering::Relaxed) {
            self.settle_slow();
            return true;
        }
        false
    }

    /// What `settle` does when asked to: out of line and not in the hot
    /// text (formatting code).
    #[cold]
    #[inline(never)]
    fn settle_slow(&'static self) {
        let c = &self.config;
        file::write_stderr(format_args!(
            "numaweave: mode {:?} (asked {:?}), strict {}, purge threshold {} B, purge delay {} ms, huge pages {:?}\n{}",
            self.mode, c.mode, c.strict, c.purge_threshold, c.purge_delay_ms, c.huge, self.topology
        ));
    }
}

/// Every lock of the allocator core, in one fixed order (`ForkRank::Engine`
/// among the layers': the interleaving's and the slab caches' are taken
/// before these): the lifecycle's `work` first (its holder takes the
/// others: a tick purges arenas and claims orphans), the arenas' `shared`
/// and `cold` locks and the per-CPU caches' home heaps' next (a thread
/// holding one takes the others, never two of them: `heap/shared.rs`,
/// `heap/cpu.rs`), then the rest, of which no code path holds two at once.
fn fork_locks(state: &State) -> impl DoubleEndedIterator<Item = &dyn RawLock> {
    let shared = state.arenas.iter().map(|a| &a.shared as &dyn RawLock);
    let cold = state.arenas.iter().map(|a| &a.cold as &dyn RawLock);
    let homes = super::heap::cpu::homes().map(|l| l as &dyn RawLock);
    let arenas = state.arenas.iter().map(|a| &a.inner as &dyn RawLock);
    [&state.life.work as &dyn RawLock]
        .into_iter()
        .chain(shared)
        .chain(cold)
        .chain(homes)
        .chain([&state.meta as &dyn RawLock, &state.heaps as &dyn RawLock])
        .chain(arenas)
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
        // SAFETY: the forking thread took this lock with `take` (`lock_raw`) and holds no
        // guard for it (`release`'s contract), as `unlock_raw` asks.
        unsafe { self.unlock_raw() }
    }
}

/// Whether the last [`fork_prepare`] took the state's locks: it found the
/// state ready. [`fork_release`] releases only then (a state another
/// thread was making at the prepare is ready at the release, its locks
/// not taken, maybe held by their owners).
static TOOK_LOCKS: AtomicBool = AtomicBool::new(false);

fn fork_prepare() {
    let took = State::try_get().map(|s| fork_locks(s).for_each(|l| l.take())).is_some();
    TOOK_LOCKS.store(took, Ordering::Relaxed);
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
    if TOOK_LOCKS.swap(false, Ordering::Relaxed)
        && let Some(s) = State::try_get()
    {
        // SAFETY: `fork_prepare` took every one of them on this (or, in the
        // child, the copied) thread: it found the state ready, as it is now.
        fork_locks(s).rev().for_each(|l| unsafe { l.release() });
    }
}

/// The topology as the allocator sees it: the process's
/// ([`Topology::global`]: `NUMAWEAVE_TOPOLOGY` honoured), but under `hwloc`,
/// which allocates and so cannot serve the allocator's own start-up, one of
/// its own read from sysfs. A reference, not a copy in the state: a copy
/// took 6 KiB more of every process's memory, and as much of its stack.
fn allocator_topology() -> &'static Topology {
    if file::env(c"NUMAWEAVE_TOPOLOGY").is_some_and(|v| v.trim_ascii() == "hwloc") {
        return SYSFS.get_or_init(sysfs_topology);
    }
    Topology::global()
}

/// The allocator's topology under `NUMAWEAVE_TOPOLOGY=hwloc` (see
/// [`allocator_topology`]): made only inside the state's making.
static SYSFS: InitCell<Topology> = InitCell::new();

/// Out of line: its own topology value stays off `State::init`'s stack.
#[cold]
#[inline(never)]
fn sysfs_topology() -> Topology {
    file::report(format_args!("numaweave: the allocator reads the topology from sysfs (hwloc allocates)"));
    Topology::detect().unwrap_or_else(|_| Topology::single_node())
}
