//! The machine's memory performance tables: read once, on first use, in
//! place; held across `fork()` (the lock table in `os/thread.rs`).

use super::MemoryPerformance;
use crate::topology::Topology;

/// The machine's tables (see [`machine_perf`]).
#[cfg(not(loom))]
static MACHINE: crate::sync::InitCell<MemoryPerformance> = crate::sync::InitCell::new();

/// The machine's tables, read once, in place (24 KiB: not built on the
/// stack of whichever thread asks first).
pub(super) fn machine_perf(t: &Topology) -> &'static MemoryPerformance {
    #[cfg(not(loom))]
    // SAFETY: the closure leaves the slot initialised: zeroed (every
    // table entry "not known"), its two enum fields written before any
    // reference to the value is made, then filled.
    unsafe {
        MACHINE.get_or_init_in_place(|slot| {
            let p = slot.as_mut_ptr();
            p.write_bytes(0, 1);
            core::ptr::addr_of_mut!((*p).source).write(super::PerfSource::Unknown);
            core::ptr::addr_of_mut!((*p).kernel_auto).write(None);
            (*p).fill_machine(t);
        })
    }
    #[cfg(loom)]
    {
        static MACHINE: std::sync::OnceLock<MemoryPerformance> = std::sync::OnceLock::new();
        MACHINE.get_or_init(|| {
            let mut p = MemoryPerformance::unknown();
            p.fill_machine(t);
            p
        })
    }
}

/// `fork()` handlers' part (the allocator core's, `ForkRank::Engine`): the
/// machine's tables are not being read while a child is made.
#[cfg(not(loom))]
pub(crate) fn hold_for_fork() {
    MACHINE.hold_for_fork();
}

/// After `fork()`: see [`hold_for_fork`].
#[cfg(not(loom))]
pub(crate) fn release_after_fork() {
    MACHINE.release_after_fork();
}
