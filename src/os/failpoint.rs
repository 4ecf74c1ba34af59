//! Refusals on demand: with the `failpoints` feature (tests only; the
//! feature is never part of a build anyone ships), every system call of
//! this layer that may fail first asks `check` whether to fail as the
//! kernel would, with the errno it would give. A test arms a kind of call
//! to be refused at its Nth occurrence (and the next few), runs a workload
//! and sees what the allocator does with the refusal: SQLite's anomaly
//! testing, each allocation point failed in turn (`tests/failpoints.rs`).
//!
//! Without the feature `check` is an empty inline function: the calls
//! cost nothing.
//!
//! Only calls made by a thread inside `scope` count, so a test's own
//! bookkeeping (its vectors, the harness) is never refused.

/// A kind of call that may be refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    /// `mmap` of anonymous memory (segments, regions, huge blocks, chunks,
    /// metadata), hugetlb included.
    Mmap,
    /// `munmap`.
    Munmap,
    /// `mremap` (huge blocks grown or moved).
    Mremap,
    /// `madvise` (pages given back, huge-page advice).
    Madvise,
    /// `mbind`.
    Mbind,
    /// `move_pages` that moves pages.
    MovePages,
    /// `move_pages` that asks where pages are (null nodes).
    PageQuery,
    /// `mprotect` (guard pages).
    Mprotect,
    /// `memfd_create` (the published slab table).
    Memfd,
    /// `io_uring_register` (fixed buffers, buffer rings).
    UringRegister,
    /// `open` of a sysfs or procfs file (free memory, the topology, maps).
    Open,
}

impl Call {
    /// Every kind, in order.
    pub const ALL: [Call; 11] = [
        Call::Mmap,
        Call::Munmap,
        Call::Mremap,
        Call::Madvise,
        Call::Mbind,
        Call::MovePages,
        Call::PageQuery,
        Call::Mprotect,
        Call::Memfd,
        Call::UringRegister,
        Call::Open,
    ];

    /// The errno the kernel gives when it refuses such a call for want of
    /// resources (what a full machine, a cgroup or a limit produces).
    pub fn errno(self) -> i32 {
        match self {
            Call::Memfd | Call::Open => libc::EMFILE,
            Call::Mprotect | Call::Munmap => libc::ENOMEM,
            Call::Mbind => libc::EIO,
            _ => libc::ENOMEM,
        }
    }

    /// The call's name, as `Error::Os` gives it.
    pub fn name(self) -> &'static str {
        match self {
            Call::Mmap => "mmap",
            Call::Munmap => "munmap",
            Call::Mremap => "mremap",
            Call::Madvise => "madvise",
            Call::Mbind => "mbind",
            Call::MovePages => "move_pages",
            Call::PageQuery => "move_pages(query)",
            Call::Mprotect => "mprotect",
            Call::Memfd => "memfd_create",
            Call::UringRegister => "io_uring_register",
            Call::Open => "open",
        }
    }
}

/// Whether this call of kind `call` is refused: `Err(Error::Os)` with the
/// kind's errno when an armed refusal falls on it.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub(crate) fn check(_call: Call) -> crate::error::Result<()> {
    Ok(())
}

#[cfg(feature = "failpoints")]
pub(crate) use armed::check;
#[cfg(feature = "failpoints")]
pub use armed::{Counts, arm, arm_also, arm_with, counts, disarm, scope};

#[cfg(feature = "failpoints")]
mod armed {
    use core::cell::Cell;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::Call;
    use crate::error::{Error, Result};

    const KINDS: usize = Call::ALL.len();

    /// Per kind: calls counted since the last [`arm`].
    static SEEN: [AtomicU64; KINDS] = [const { AtomicU64::new(0) }; KINDS];
    /// Per kind: the first call refused (1-based; 0: none armed).
    static FROM: [AtomicU64; KINDS] = [const { AtomicU64::new(0) }; KINDS];
    /// Per kind: how many calls from `FROM` on are refused.
    static TIMES: [AtomicU64; KINDS] = [const { AtomicU64::new(0) }; KINDS];
    /// Per kind: refusals made since the last [`arm`].
    static FIRED: [AtomicU64; KINDS] = [const { AtomicU64::new(0) }; KINDS];
    /// Per kind: the errno to refuse with (0: the kind's own).
    static ERRNO: [AtomicU64; KINDS] = [const { AtomicU64::new(0) }; KINDS];

    thread_local! {
        static IN_SCOPE: Cell<bool> = const { Cell::new(false) };
    }

    pub(crate) fn check(call: Call) -> Result<()> {
        if !IN_SCOPE.with(Cell::get) {
            return Ok(());
        }
        let k = call as usize;
        let n = SEEN[k].fetch_add(1, Ordering::Relaxed) + 1;
        let from = FROM[k].load(Ordering::Relaxed);
        if from != 0 && n >= from && n - from < TIMES[k].load(Ordering::Relaxed) {
            FIRED[k].fetch_add(1, Ordering::Relaxed);
            let errno = match ERRNO[k].load(Ordering::Relaxed) {
                0 => call.errno(),
                e => e as i32,
            };
            return Err(Error::Os { call: call.name(), errno });
        }
        Ok(())
    }

    /// Refuses the `nth` call of kind `call` from now (1-based) and the
    /// `times - 1` after it; the counts of every kind start again.
    pub fn arm(call: Call, nth: u64, times: u64) {
        disarm();
        FROM[call as usize].store(nth, Ordering::Relaxed);
        TIMES[call as usize].store(times, Ordering::Relaxed);
    }

    /// Like [`arm`], keeping what else is armed (and the counts): two
    /// kinds refused together.
    pub fn arm_also(call: Call, nth: u64, times: u64) {
        FROM[call as usize].store(nth, Ordering::Relaxed);
        TIMES[call as usize].store(times, Ordering::Relaxed);
    }

    /// Like [`arm`], the refusals with `errno` instead of the kind's own.
    pub fn arm_with(call: Call, nth: u64, times: u64, errno: i32) {
        arm(call, nth, times);
        ERRNO[call as usize].store(errno as u64, Ordering::Relaxed);
    }

    /// Refuses nothing from now on; the counts start again.
    pub fn disarm() {
        for k in 0..KINDS {
            FROM[k].store(0, Ordering::Relaxed);
            SEEN[k].store(0, Ordering::Relaxed);
            FIRED[k].store(0, Ordering::Relaxed);
            ERRNO[k].store(0, Ordering::Relaxed);
        }
    }

    /// Calls of one kind since the last [`arm`] or [`disarm`].
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Counts {
        /// Calls made inside a [`scope`].
        pub seen: u64,
        /// Of those, refused.
        pub refused: u64,
    }

    /// The counts of kind `call`.
    pub fn counts(call: Call) -> Counts {
        Counts {
            seen: SEEN[call as usize].load(Ordering::Relaxed),
            refused: FIRED[call as usize].load(Ordering::Relaxed),
        }
    }

    /// Runs `f` with the calling thread's calls counted (and refused as
    /// armed).
    pub fn scope<R>(f: impl FnOnce() -> R) -> R {
        let was = IN_SCOPE.with(|s| s.replace(true));
        let r = f();
        IN_SCOPE.with(|s| s.set(was));
        r
    }
}
