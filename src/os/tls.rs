//! The calling thread's heap pointer: the one thread-local the fast path
//! reads, in the initial-exec TLS model.
//!
//! Rust's `thread_local!` follows the model rustc picks for the crate type:
//! local-exec in an executable (one `fs:`-relative load), but general-dynamic
//! in a `cdylib`, where every access is a call to `__tls_get_addr`. The C
//! library (`capi/`, `LD_PRELOAD`ed into programs) is such a `cdylib`, and a
//! call in every `malloc` and `free` cost 20% of the time of allocation-heavy
//! C programs. So on x86-64 Linux the slot is a `.tdata` symbol of our own,
//! read and written `fs:`-relative through its `@GOTTPOFF` entry: the
//! initial-exec model, as mimalloc's preload build uses. In an executable
//! (static ones included) the linker relaxes it to local-exec; in a shared
//! object it needs the few bytes of static TLS that glibc keeps for libraries
//! loaded at start-up or by `dlopen`.
//!
//! The slot, `__numaweave_heap_tls`, is defined where its initial value is
//! (`alloc/heap.rs`: the address of the heap that is none); this module
//! only reads and writes it. Other targets fall back to `thread_local!`,
//! whose slot starts null.

/// The value of the calling thread's slot (its initial value until set).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[inline(always)]
pub(crate) fn get() -> *mut () {
    let v: *mut ();
    // SAFETY: reads this thread's 8-byte slot (`alloc/heap.rs`): the GOT entry
    // holds its offset from the thread pointer (`fs:0`), fixed at load time.
    // No memory is written; the flags are not touched.
    unsafe {
        core::arch::asm!(
            "mov {v}, qword ptr [rip + __numaweave_heap_tls@GOTTPOFF]",
            "mov {v}, qword ptr fs:[{v}]",
            v = out(reg) v,
            options(nostack, readonly, preserves_flags, pure),
        );
    }
    v
}

/// Sets the calling thread's slot.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[inline]
pub(crate) fn set(v: *mut ()) {
    // SAFETY: writes this thread's 8-byte slot (`alloc/heap.rs`), through the
    // same GOT entry as `get`.
    unsafe {
        core::arch::asm!(
            "mov {o}, qword ptr [rip + __numaweave_heap_tls@GOTTPOFF]",
            "mov qword ptr fs:[{o}], {v}",
            o = out(reg) _,
            v = in(reg) v,
            options(nostack, preserves_flags),
        );
    }
}

/// Stores `v` in the calling thread's beat word and returns what it held:
/// a second 8-byte slot beside the heap's (`__numaweave_beat_tls`, defined
/// with it), for a heartbeat each thread keeps on its own (a word in shared
/// memory would bounce between the CPUs that write it).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[inline(always)]
pub(crate) fn swap_beat(v: u64) -> u64 {
    let old: u64;
    // SAFETY: reads and writes this thread's 8-byte slot (defined in
    // `alloc/engine/heap/mod.rs`), through its GOT entry as `get` does.
    unsafe {
        core::arch::asm!(
            "mov {o}, qword ptr [rip + __numaweave_beat_tls@GOTTPOFF]",
            "mov {old}, qword ptr fs:[{o}]",
            "mov qword ptr fs:[{o}], {v}",
            o = out(reg) _,
            old = out(reg) old,
            v = in(reg) v,
            options(nostack, preserves_flags),
        );
    }
    old
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
thread_local! {
    static SLOT: core::cell::Cell<*mut ()> = const { core::cell::Cell::new(core::ptr::null_mut()) };
    static BEAT: core::cell::Cell<u64> = const { core::cell::Cell::new(0) };
}

/// The value of the calling thread's slot (null until set).
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
#[inline(always)]
pub(crate) fn get() -> *mut () {
    SLOT.with(|s| s.get())
}

/// Sets the calling thread's slot.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
#[inline]
pub(crate) fn set(v: *mut ()) {
    SLOT.with(|s| s.set(v));
}

/// Stores `v` in the calling thread's beat word and returns what it held.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
#[inline(always)]
pub(crate) fn swap_beat(v: u64) -> u64 {
    BEAT.with(|b| b.replace(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_thread_has_its_own_slot() {
        let mine = get();
        let fresh = || {
            std::thread::spawn(|| {
                let initial = get() as usize;
                set(0x1234 as *mut ());
                (initial, get() as usize)
            })
            .join()
            .unwrap()
        };
        let ((a, set_a), (b, _)) = (fresh(), fresh());
        assert_eq!(set_a, 0x1234);
        assert_eq!(a, b, "each new thread's slot starts at the same value");
        assert_ne!(b, 0x1234, "a new thread's slot is not an exited thread's");
        assert_eq!(get(), mine, "another thread's write is not ours");
    }

    #[test]
    fn each_thread_has_its_own_beat_word() {
        let mine = swap_beat(7);
        let fresh = || std::thread::spawn(|| (swap_beat(0x55), swap_beat(0))).join().unwrap();
        let ((a, set_a), (b, _)) = (fresh(), fresh());
        assert_eq!((a, set_a, b), (0, 0x55, 0), "a new thread's word starts at 0, its own");
        assert_eq!(swap_beat(mine), 7, "another thread's write is not ours");
    }
}
