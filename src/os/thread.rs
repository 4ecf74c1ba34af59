//! Thread life-cycle hooks from libc: a destructor that runs when a thread
//! exits (a pthread key), and handlers around `fork()`.
//!
//! The allocator needs both before it has a heap: neither allocates through
//! it (glibc keeps the first 32 keys' values inside the thread descriptor,
//! and its `pthread_atfork` list is glibc's own memory).

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

/// Registers `prepare` to run in the parent before `fork()`, and `release`
/// after it in both the parent and the child.
pub fn at_fork(prepare: extern "C" fn(), release: extern "C" fn()) -> Result<()> {
    // SAFETY: the handlers are plain `extern "C" fn()`s.
    let r = unsafe { libc::pthread_atfork(Some(prepare), Some(release), Some(release)) };
    if r != 0 {
        return Err(Error::Os { call: "pthread_atfork", errno: r });
    }
    Ok(())
}

/// Registers `f` to run at `exit()` (`atexit`).
pub fn at_exit(f: extern "C" fn()) -> Result<()> {
    // SAFETY: a plain `extern "C" fn()`.
    if unsafe { libc::atexit(f) } != 0 {
        return Err(Error::Os { call: "atexit", errno: libc::ENOMEM });
    }
    Ok(())
}
