//! Thread life-cycle hooks from libc: a destructor that runs when a thread
//! exits (a pthread key), handlers around `fork()`, and the futex a blocking
//! lock sleeps on.
//!
//! The allocator needs the first two before it has a heap: neither
//! allocates through it (glibc keeps the first 32 keys' values inside the
//! thread descriptor, and the first entries of its `pthread_atfork` list
//! in its own memory, where this crate's one pair goes).
//!
//! # Lock table
//!
//! Every lock, lazily initialised global and once-cell of the crate, in the
//! order `fork()` takes them (and a thread may take them: one holding a lock
//! takes only locks below it; within a rank, a layer's own order). Before
//! `fork()` of a process that has had a second thread, the handlers take
//! every line marked *held*, top to bottom; after it, in the parent and the
//! child, they release them bottom to top. A line marked *reset* is not
//! taken (a fork must not wait for its holder): the child, whose copy of
//! it may be held by a thread it does not have, resets it. A process that never had a
//! second thread takes none: a signal handler may fork it while the thread
//! it interrupted holds any of them, and glibc's malloc does the same. The
//! test below fails when a `SpinLock`, `Mutex`, `InitCell`, `OnceLock`,
//! `Once` or `ReadOnce` of `src/` is missing here (by its file and name).
//!
//! ```text
//! rank        lock (file name)                  kind      fork   taken by, and why
//! ---------   --------------------------------  --------  -----  ---------------------------------------------
//! (glibc)     stdio list lock (_IO_list_lock)   recursive held   fflush(NULL) holds it as it takes each FILE's
//!                                                                lock, and a FILE's holder may malloc (getline):
//!                                                                taken before every allocator lock, as glibc's
//!                                                                fork takes it before its malloc's (bug 19431)
//! Slab        slab/slabinfo.rs REGISTRY         Mutex     held   cache creation, slabinfo, shrink_all; held first
//!                                                                so that the caches it lists stay alive
//!             slab/kmem.rs moving               Mutex     reset  per cache: one migration (or demotion step) at a
//!                                                                time (a demotion only tries it); taken before the
//!                                                                cache's slabs and held across its moves (seconds):
//!                                                                a fork does not wait, the child resets it
//!             slab/node.rs slabs                Mutex     held   per cache and node: carving slabs (maps chunks,
//!                                                                runs constructors and registrars, allocates)
//!             slab/magazine.rs lists            SpinLock  held   per cache and node: the depot; never with slabs
//!             slab/published.rs TABLE           Mutex     -      the published table of chunks; taken only under
//!                                                                a cache's slabs, which fork holds
//!             slab/node.rs SLAB_RANGES          Mutex     held   debug and hardened builds: the slab ranges,
//!                                                                under slabs
//!             slab/slabinfo.rs FORK             Once      -      registers the rank's handlers, under REGISTRY's
//!                                                                first use; nothing is held across a call
//! Interleave  alloc/interleave/space.rs SPACES  SpinLock  held   the handles' spaces (a handle's creation, drop)
//!             alloc/interleave/space.rs locks   SpinLock  held   per space and node: carving (maps regions from
//!                                                                the arenas: the Engine rank below)
//!             alloc/placement.rs SPARE          SpinLock  held   exited threads' interleavers; a leaf
//!             alloc/placement.rs LOWER_TIER     InitCell  held   the lower tier per node, made once from the
//!                                                                topology (a child would wait on a half-made one)
//!             alloc/placement.rs KEY            InitCell  held   the exit key of default interleavers, made once
//!             alloc/placement.rs ONCE           Once      -      registers the rank's handlers
//! Engine      alloc/engine/types.rs work        SpinLock  held   the lifecycle's work (a tick, a trim): one thread
//!                                                                at a time; a tick only tries it, a trim waits; its
//!                                                                holder takes the rest of the core's locks
//!             alloc/engine/lifecycle/published.rs TABLE (SpinLock, fork: -)
//!                                                                the published class table's file
//!                                                                (NUMAWEAVE_PUBLISH); taken only under `work`,
//!                                                                which fork holds; its holder takes each arena's
//!                                                                `inner` (the walk of its pages)
//!             alloc/engine/types.rs shared      SpinLock  held   per arena: its shared heap (heap/shared.rs);
//!                                                                taken before the rest of the core's locks, which
//!                                                                its holder takes (pages, metadata)
//!             alloc/engine/types.rs cold        SpinLock  held   per arena: its heap of cold blocks (heap/shared.rs);
//!                                                                never with `shared`; its holder takes the rest
//!             alloc/engine/heap/cpu.rs HOMES    SpinLock  held   per CPU: the heap its per-CPU cache refills from;
//!                                                                never with `shared`, `cold` or another; its
//!                                                                holder takes the rest
//!             alloc/engine/types.rs meta        SpinLock  held   heap descriptors' metadata chunk; its holder takes
//!                                                                each arena's `inner` when a chunk's mapping fails
//!             alloc/engine/types.rs heaps       SpinLock  held   the list of every heap (creation, statistics)
//!             alloc/engine/types.rs inner       SpinLock  held   per arena: segments, free slots, orphans, cached
//!                                                                mappings, purges; alone
//!             alloc/engine/types.rs STATE       InitCell  held   the allocator's state, made by the first
//!                                                                allocation
//!             topology/mod.rs GLOBAL            InitCell  held   the process's topology, read once (the state's
//!                                                                start-up reads it)
//!             topology/perf/machine.rs MACHINE  InitCell  held   memory-performance tables, read lazily
//! (none)      alloc/placement.rs DEFAULT        InitCell  -      the default placement, made only inside STATE's
//!                                                                making (which fork holds): never half made
//!             alloc/engine/heap/cpu.rs CACHE    InitCell  -      the per-CPU caches: as DEFAULT
//!             alloc/engine/state.rs SYSFS       InitCell  -      the allocator's topology under
//!                                                                NUMAWEAVE_TOPOLOGY=hwloc: as DEFAULT
//!             alloc/stats.rs ONCE               Once      -      registers the statistics' printer at exit
//!             os/thread.rs INSTALLED            atomic    -      installs the one pthread_atfork pair: a once of
//!                                                                its own (std's `Once` lies far from the
//!                                                                start-up's code, a page of text more per process)
//!             os/mod.rs PAGE                    ReadOnce  -      the page size: a racy read-once atomic, no lock
//!             os/mem.rs MODE                    ReadOnce  -      the THP mode: as PAGE
//!             os/mod.rs VERSION                 ReadOnce  -      the kernel's version: as PAGE
//!             os/rseq.rs REGISTRATION           ReadOnce  -      glibc's rseq registration: as PAGE
//!             os/rseq.rs REGISTERED             ReadOnce  -      the membarrier rseq fence's registration: as PAGE
//!             io/uring/mod.rs table             Mutex     -      a ring's registered-buffer table and the rings
//!                                                                that clone it (feature io-uring; under a node's
//!                                                                slabs lock in a registrar call): not held
//!                                                                across fork; a child never
//!                                                                takes it (the table is its parent's: every call
//!                                                                checks the fork generation first)
//! ```

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use crate::error::{Error, Result};

/// A pthread key whose destructor runs at thread exit for every thread that
/// set a non-null value.
#[derive(Clone, Copy, Debug)]
pub struct ExitKey(libc::pthread_key_t);

impl ExitKey {
    /// Makes a key; `dtor` gets the thread's value at its exit (glibc calls it
    /// again, up to four rounds, for values set by other destructors).
    pub fn new(dtor: extern "C" fn(*mut libc::c_void)) -> Result<Self> {
        let mut key: libc::pthread_key_t = 0;
        // SAFETY: `key` is writable; the destructor is an `extern "C" fn(*mut c_void)`.
        let r = unsafe { libc::pthread_key_create(&mut key, Some(dtor)) };
        if r != 0 {
            return Err(Error::Os { call: "pthread_key_create", errno: r });
        }
        Ok(Self(key))
    }

    /// Sets the calling thread's value (null: no destructor call for it).
    // `pthread_setspecific` keeps the pointer; only the destructor, ours,
    // ever reads through it.
    #[allow(clippy::not_unsafe_ptr_arg_deref)]
    pub fn set(&self, value: *mut libc::c_void) {
        // SAFETY: a key made by `new`; glibc stores the first 32 keys' values
        // in the thread descriptor (no allocation), later ones in blocks of
        // its own malloc, never ours.
        unsafe { libc::pthread_setspecific(self.0, value) };
    }
}

/// The lock order, by layer: a thread holding a lock of one rank may take
/// locks of later ranks, never of an earlier one. Before `fork()` of a
/// process with threads, stdio's list lock is taken (as glibc's `fork()`
/// takes it before its malloc's locks), then each layer's handler takes
/// all its locks, the ranks in this order; after it, in the parent and in
/// the child, they are released in the reverse order. So a child never
/// finds a lock held by a thread it does not have, and the forking thread
/// cannot deadlock with one that holds locks in this order. A process
/// that never had a second thread takes none (a signal handler may fork
/// it). (Within a rank, the order is its layer's; ARCHITECTURE.md lists it
/// all.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForkRank {
    /// Slab caches: the registry of caches, each cache's node locks, the
    /// table of slab ranges. Their critical sections allocate (and so take
    /// the ranks below).
    Slab = 0,
    /// Interleaving: the registry of handles' spaces, each space's node
    /// locks (which map regions from the arenas), then the spare
    /// interleavers of exited threads.
    Interleave = 1,
    /// The allocator core: the metadata chunk, the list of heaps, the
    /// arenas. Each is taken alone.
    Engine = 2,
}

const RANKS: usize = 3;

/// Per rank, the `prepare` and `release` handlers (`fn()` as `usize`, 0 for
/// none).
static HANDLERS: [[AtomicUsize; 2]; RANKS] = [const { [AtomicUsize::new(0), AtomicUsize::new(0)] }; RANKS];
/// Whether the `pthread_atfork` pair is installed: `NOT_INSTALLED`,
/// `INSTALLING` (a thread is in `install`) or `INSTALLED_DONE` (and
/// `INSTALL_ERR` says how it went).
static INSTALLED: AtomicU32 = AtomicU32::new(NOT_INSTALLED);
/// `pthread_atfork`'s answer, read once `INSTALLED` is `INSTALLED_DONE`.
static INSTALL_ERR: AtomicI32 = AtomicI32::new(0);
const NOT_INSTALLED: u32 = 0;
const INSTALLING: u32 = 1;
const INSTALLED_DONE: u32 = 2;

/// Registers `prepare` to run before `fork()` and `release` after it (in
/// the parent and in the child), at `rank` among the other layers' (see
/// [`ForkRank`]), whenever the layers register. A rank registered again
/// keeps its first handlers.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub fn at_fork(rank: ForkRank, prepare: fn(), release: fn()) -> Result<()> {
    install()?;
    let [p, q] = &HANDLERS[rank as usize];
    // The release handler first: a `fork()` whose `prepare` ran it finds it.
    if q.compare_exchange(0, release as usize, Ordering::Release, Ordering::Relaxed).is_ok() {
        p.store(prepare as usize, Ordering::Release);
    }
    Ok(())
}

/// Installs the one `pthread_atfork` pair, once; every caller gets its
/// outcome. A caller that finds another thread installing waits for it (a
/// call of glibc's at most: two layers' first uses at once).
#[unsafe(link_section = ".text.sorted.numaweave")]
fn install() -> Result<()> {
    // Done: a load, no read-modify-write (`fork_generation` calls this on
    // paths that run again and again, from every thread).
    if INSTALLED.load(Ordering::Acquire) != INSTALLED_DONE {
        install_slow();
    }
    match INSTALL_ERR.load(Ordering::Relaxed) {
        0 => Ok(()),
        r => Err(Error::Os { call: "pthread_atfork", errno: r }),
    }
}

/// [`install`] before it is done: one thread installs, the others wait.
#[cold]
#[unsafe(link_section = ".text.sorted.numaweave")]
fn install_slow() {
    loop {
        match INSTALLED.compare_exchange(NOT_INSTALLED, INSTALLING, Ordering::Acquire, Ordering::Acquire) {
            Ok(_) => {
                // SAFETY: the handlers are plain `extern "C" fn()`s.
                let r = unsafe { libc::pthread_atfork(Some(run_prepare), Some(run_parent), Some(run_child)) };
                INSTALL_ERR.store(r, Ordering::Relaxed);
                INSTALLED.store(INSTALLED_DONE, Ordering::Release);
                break;
            }
            Err(INSTALLED_DONE) => break,
            Err(_) => std::thread::yield_now(),
        }
    }
}

/// Bumped first thing in the child of every `fork()` (once the handlers
/// are installed).
static FORKS: AtomicU64 = AtomicU64::new(0);

/// The process's fork generation: what a `fork()` child sees differs from
/// what its parent saw before the fork, so that state recorded with it
/// (a registration, a descriptor made) is known to be an ancestor's.
/// Unlike a pid it cannot come back: a pid is reused once its process has
/// gone, and a grandchild may get its grandparent's. Installs the fork
/// handlers on first use (if that fails, it never changes: callers keep
/// the pid beside it).
pub fn fork_generation() -> u64 {
    let _ = install();
    FORKS.load(Ordering::Relaxed)
}

/// The handler stored at `slot`, if any.
fn handler(slot: &AtomicUsize) -> Option<fn()> {
    let f = slot.load(Ordering::Acquire);
    // SAFETY: every nonzero value stored was a `fn()` (`at_fork`).
    (f != 0).then(|| unsafe { core::mem::transmute::<usize, fn()>(f) })
}

/// The ranks whose `prepare` the last `fork()` ran (a bit each), and
/// [`STDIO_HELD`]: `release` runs for those only, not for a rank registered
/// in between. (glibc runs one `fork()`'s handlers at a time; the parent
/// and the child each have their copy.)
static PREPARED: AtomicUsize = AtomicUsize::new(0);

/// In [`PREPARED`]: the prepare took stdio's list lock.
const STDIO_HELD: usize = 1 << RANKS;

/// Before `fork()`: nothing in a process that has only ever had one thread
/// (glibc does the same with its own malloc's locks, so that a signal
/// handler may fork: the thread it interrupted may hold any lock, or be
/// half way through an operation, and no other thread could have taken
/// one); else stdio's list lock, then every rank's locks, in rank order.
///
/// The list lock comes first because glibc's `fork()` takes it after the
/// handlers (and before its own malloc's locks), while `fflush(NULL)`
/// holds it as it takes each `FILE`'s lock, and a `FILE`'s holder may
/// `malloc` (`getline`): with the allocator's locks taken first, the
/// forking thread waits on the list lock, its holder on a `FILE`, the
/// `FILE`'s holder on the allocator (glibc bug 19431's order). Taken
/// here, every thread takes them in the order list, `FILE`, allocator.
/// The lock is recursive: `fork()` takes it again and lets go of its own
/// take before the parent's handlers run.
extern "C" fn run_prepare() {
    if single_threaded() {
        PREPARED.store(0, Ordering::Relaxed);
        return;
    }
    stdio::lock();
    let mut ran = STDIO_HELD;
    for (rank, [p, _]) in HANDLERS.iter().enumerate() {
        if let Some(f) = handler(p) {
            f();
            ran |= 1 << rank;
        }
    }
    PREPARED.store(ran, Ordering::Relaxed);
}

/// After `fork()`, in the parent: the ranks' locks released in reverse
/// order, then the list lock.
extern "C" fn run_parent() {
    if release_ranks() & STDIO_HELD != 0 {
        stdio::unlock();
    }
}

/// After `fork()`, in the child: as in the parent, but the list lock is
/// reset (glibc's child resets it too; its count may hold the parent's
/// takes), and the release handlers see [`in_forked_child`] true.
extern "C" fn run_child() {
    FORKS.fetch_add(1, Ordering::Relaxed);
    IN_CHILD.store(true, Ordering::Relaxed);
    if release_ranks() & STDIO_HELD != 0 {
        stdio::reset();
    }
    IN_CHILD.store(false, Ordering::Relaxed);
}

/// Set while the release handlers run in a forked child.
static IN_CHILD: AtomicBool = AtomicBool::new(false);

/// Whether a release handler runs in the child of a `fork()` (true) or in
/// the parent: a lock the prepare handler did not take, because a fork
/// must not wait for it, is reset in the child instead.
pub fn in_forked_child() -> bool {
    IN_CHILD.load(Ordering::Relaxed)
}

/// Runs the `release` of every rank the last `prepare` ran, last rank
/// first; returns what it ran.
fn release_ranks() -> usize {
    let ran = PREPARED.swap(0, Ordering::Relaxed);
    for (rank, [_, q]) in HANDLERS.iter().enumerate().rev() {
        if ran & (1 << rank) != 0
            && let Some(f) = handler(q)
        {
            f();
        }
    }
    ran
}

/// Whether the process has never had a second thread (glibc's
/// `__libc_single_threaded`, set false before the first `pthread_create`
/// and never again true while threads may exist). Elsewhere, false: the
/// locks are always held.
pub fn single_threaded() -> bool {
    #[cfg(target_env = "gnu")]
    {
        unsafe extern "C" {
            /// glibc 2.32 and later (`<sys/single_threaded.h>`).
            static __libc_single_threaded: core::ffi::c_char;
        }
        // SAFETY: a `char` glibc defines and writes only while one thread
        // exists (the one that creates the second); read as a volatile
        // byte, as its header asks of readers.
        unsafe { core::ptr::read_volatile(&raw const __libc_single_threaded) != 0 }
    }
    #[cfg(not(target_env = "gnu"))]
    false
}

/// stdio's list lock (glibc's `_IO_list_lock`, a recursive lock over the
/// list of open `FILE`s). No-ops elsewhere.
mod stdio {
    #[cfg(target_env = "gnu")]
    unsafe extern "C" {
        fn _IO_list_lock();
        fn _IO_list_unlock();
        fn _IO_list_resetlock();
    }

    pub(super) fn lock() {
        // SAFETY: glibc's exported lock functions, taking no argument; the
        // lock is recursive, so `fork()`'s own take after this one does
        // not wait.
        #[cfg(target_env = "gnu")]
        unsafe {
            _IO_list_lock()
        }
    }

    pub(super) fn unlock() {
        // SAFETY: the calling thread took the lock in `lock` (the parent's
        // forking thread, after `fork()` let go of its own take).
        #[cfg(target_env = "gnu")]
        unsafe {
            _IO_list_unlock()
        }
    }

    pub(super) fn reset() {
        // SAFETY: in a child just forked, the only thread: the lock's
        // state is reset, as glibc's `fork()` itself does in the child.
        #[cfg(target_env = "gnu")]
        unsafe {
            _IO_list_resetlock()
        }
    }
}

/// Sleeps while `word` holds `expected` (`FUTEX_WAIT_PRIVATE`), at most
/// `timeout`: returns after a [`futex_wake`], the timeout, a signal, or at
/// once when the word holds another value. The caller looks again.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let _errno = super::KeepErrno::new();
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let tsp = ts.as_ref().map_or(core::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: the word is a live, aligned u32; the timeout, if any, a valid
    // relative `timespec` on the stack.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG, expected, tsp)
    };
}

/// Wakes up to `n` threads sleeping on `word` in [`futex_wait`].
pub fn futex_wake(word: &AtomicU32, n: i32) {
    let _errno = super::KeepErrno::new();
    // SAFETY: the word is a live, aligned u32; waking has no other effect.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, n) };
}

/// Registers `f` to run at `exit()` (`atexit`).
pub fn at_exit(f: extern "C" fn()) -> Result<()> {
    // SAFETY: a plain `extern "C" fn()`.
    if unsafe { libc::atexit(f) } != 0 {
        return Err(Error::Os { call: "atexit", errno: libc::ENOMEM });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// Every lock and once-cell of `src/` is in the lock table above.
    #[test]
    fn the_lock_table_lists_every_lock() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let table: String =
            include_str!("thread.rs").lines().take_while(|l| l.starts_with("//!")).collect::<Vec<_>>().join("\n");
        let kinds = ["SpinLock<", "Mutex<", "InitCell<", "OnceLock<", "Once ", "Once;", "ReadOnce "];
        let mut missing = Vec::new();
        let mut seen = 0;
        let mut stack = vec![root.clone()];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let path = e.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                let rel = path.strip_prefix(&root).unwrap().to_str().unwrap().to_string();
                // The primitives themselves, and the tests' own locks.
                if !rel.ends_with(".rs") || rel.starts_with("sync/") || rel.ends_with("tests.rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                let body = text.split("#[cfg(test)]\nmod tests").next().unwrap();
                for line in body.lines() {
                    let l = line.trim_start();
                    if l.starts_with("//") || l.starts_with("use ") || l.starts_with("impl") {
                        continue;
                    }
                    // A static or a field: `NAME: Kind<...` (arrays too).
                    let Some((lhs, rhs)) = l.split_once(": ") else { continue };
                    let rhs = rhs
                        .trim_start_matches('[')
                        .trim_start_matches("CachePadded<")
                        .trim_start_matches("std::sync::")
                        .trim_start_matches("crate::sync::");
                    let rhs = rhs.trim_start_matches("super::");
                    if !kinds.iter().any(|k| rhs.starts_with(k) || format!("{rhs} ").starts_with(k)) {
                        continue;
                    }
                    let name = lhs.split_whitespace().last().unwrap();
                    seen += 1;
                    if !table.contains(&format!("{rel} {name} ")) {
                        missing.push(format!("{rel} {name}"));
                    }
                }
            }
        }
        assert!(seen >= 20, "only {seen} locks found: the scan is broken");
        assert!(missing.is_empty(), "not in os/thread.rs's lock table: {missing:?}");
    }
}
