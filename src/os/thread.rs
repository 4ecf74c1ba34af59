//! Thread life-cycle hooks from libc: a destructor that runs when a thread
//! exits (a pthread key), handlers around `fork()`, and the futex a blocking
//! lock sleeps on.
//!
//! The allocator needs the first two before it has a heap: neither
//! allocates through it (glibc keeps the first 32 keys' values inside the
//! thread descriptor, and its `pthread_atfork` list is glibc's own memory).

use std::sync::Once;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
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
/// locks of later ranks, never of an earlier one. Before `fork()` each
/// layer's handler takes all its locks, the ranks in this order; after it,
/// in the parent and in the child, they are released in the reverse order.
/// So a child never finds a lock held by a thread it does not have, and the
/// forking thread cannot deadlock with one that holds locks in this order.
/// (Within a rank, the order is its layer's; ARCHITECTURE.md lists it all.)
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
    Core = 2,
}

const RANKS: usize = 3;

/// Per rank, the `prepare` and `release` handlers (`fn()` as `usize`, 0 for
/// none).
static HANDLERS: [[AtomicUsize; 2]; RANKS] = [const { [AtomicUsize::new(0), AtomicUsize::new(0)] }; RANKS];
static INSTALLED: Once = Once::new();

/// Registers `prepare` to run before `fork()` and `release` after it (in
/// the parent and in the child), at `rank` among the other layers' (see
/// [`ForkRank`]), whenever the layers register. A rank registered again
/// keeps its first handlers.
pub fn at_fork(rank: ForkRank, prepare: fn(), release: fn()) -> Result<()> {
    let mut r = 0;
    INSTALLED.call_once(|| {
        // SAFETY: the handlers are plain `extern "C" fn()`s.
        r = unsafe { libc::pthread_atfork(Some(run_prepare), Some(run_release), Some(run_release)) };
    });
    if r != 0 {
        return Err(Error::Os { call: "pthread_atfork", errno: r });
    }
    let [p, q] = &HANDLERS[rank as usize];
    // The release handler first: a `fork()` whose `prepare` ran it finds it.
    if q.compare_exchange(0, release as usize, Ordering::Release, Ordering::Relaxed).is_ok() {
        p.store(prepare as usize, Ordering::Release);
    }
    Ok(())
}

/// The handler stored at `slot`, if any.
fn handler(slot: &AtomicUsize) -> Option<fn()> {
    let f = slot.load(Ordering::Acquire);
    // SAFETY: every nonzero value stored was a `fn()` (`at_fork`).
    (f != 0).then(|| unsafe { core::mem::transmute::<usize, fn()>(f) })
}

/// The ranks whose `prepare` the last `fork()` ran (a bit each): `release`
/// runs for those only, not for a rank registered in between. (glibc runs
/// one `fork()`'s handlers at a time; the parent and the child each have
/// their copy.)
static PREPARED: AtomicUsize = AtomicUsize::new(0);

extern "C" fn run_prepare() {
    let mut ran = 0;
    for (rank, [p, _]) in HANDLERS.iter().enumerate() {
        if let Some(f) = handler(p) {
            f();
            ran |= 1 << rank;
        }
    }
    PREPARED.store(ran, Ordering::Relaxed);
}

extern "C" fn run_release() {
    let ran = PREPARED.swap(0, Ordering::Relaxed);
    for (rank, [_, q]) in HANDLERS.iter().enumerate().rev() {
        if ran & (1 << rank) != 0
            && let Some(f) = handler(q)
        {
            f();
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
