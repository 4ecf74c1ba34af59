//! Pointers numaweave did not allocate: memory of another allocator (a
//! library linked with its own, blocks from before numaweave was loaded), or
//! a stray pointer. numaweave tells them from its own by its map of the
//! address space it owns (`NumaAlloc::owns`: the pointer alone, never
//! dereferenced). They go to the next definition of the function
//! (`dlsym(RTLD_NEXT, …)`: glibc's, under `LD_PRELOAD`); where there is none
//! (a static program), `free` reports the first one on stderr and ignores
//! them all, `realloc` fails with `ENOMEM`, `malloc_usable_size` says 0.

use core::ffi::{CStr, c_void};
use core::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// A function resolved once with `dlsym(RTLD_NEXT, name)`: 0 not yet, 1 none.
struct Next {
    name: &'static CStr,
    f: AtomicUsize,
}

impl Next {
    const fn new(name: &'static CStr) -> Self {
        Self { name, f: AtomicUsize::new(0) }
    }

    /// The next definition's address, if there is one.
    fn get(&self) -> Option<usize> {
        let f = self.f.load(Ordering::Acquire);
        if f > 1 {
            return Some(f);
        }
        if f == 1 {
            return None;
        }
        // SAFETY: a NUL-terminated name; RTLD_NEXT asks for the definition
        // after this library's. (dlsym may allocate on its own first use:
        // through our malloc, which is fine; it never reaches here again
        // before it returns, as the pointer it frees would be ours.)
        let p = unsafe { libc::dlsym(libc::RTLD_NEXT, self.name.as_ptr()) } as usize;
        let v = if p == 0 { 1 } else { p };
        self.f.store(v, Ordering::Release);
        (v > 1).then_some(v)
    }
}

static FREE: Next = Next::new(c"free");
static REALLOC: Next = Next::new(c"realloc");
static USABLE: Next = Next::new(c"malloc_usable_size");
static REPORTED: AtomicBool = AtomicBool::new(false);

/// Frees a pointer that is not numaweave's.
///
/// # Safety
/// `p` is a live block of the next allocator (or the call is a bug of the
/// caller's, reported and ignored when there is no next allocator).
#[cold]
#[inline(never)]
pub unsafe fn free(p: *mut c_void) {
    // A hardened library trusts no pointer it does not own: the allocator's
    // checked free names it (a huge block freed twice, or not ours at all).
    #[cfg(feature = "hardened")]
    {
        // SAFETY: a hardened free checks ownership before reading anything.
        unsafe { crate::A.free(p.cast()) };
        return;
    }
    #[allow(unreachable_code)]
    match FREE.get() {
        Some(f) => {
            // SAFETY: the next `free`, with `free`'s signature.
            let f: unsafe extern "C" fn(*mut c_void) = unsafe { core::mem::transmute(f) };
            // SAFETY: `p` is a live block of the next allocator (the caller's word), which
            // its `free` takes.
            unsafe { f(p) }
        }
        None => {
            if !REPORTED.swap(true, Ordering::Relaxed) {
                numaweave::os::report(format_args!(
                    "numaweave: free({p:p}): not a block of numaweave, and no other allocator to give it to: ignored (reported once)"
                ));
            }
        }
    }
}

/// Resizes a pointer that is not numaweave's.
///
/// # Safety
/// As [`free`], for `realloc`.
#[cold]
#[inline(never)]
pub unsafe fn realloc(p: *mut c_void, size: usize) -> *mut c_void {
    #[cfg(feature = "hardened")]
    {
        let _ = size;
        numaweave::alloc::report_misuse(format_args!("realloc of {p:p}, which numaweave did not allocate"));
        crate::set_errno(libc::ENOMEM);
        return core::ptr::null_mut();
    }
    #[allow(unreachable_code)]
    match REALLOC.get() {
        Some(f) => {
            // SAFETY: the next `realloc`, with `realloc`'s signature.
            let f: unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void = unsafe { core::mem::transmute(f) };
            // SAFETY: `p` is a live block of the next allocator (the caller's word), which
            // its `realloc` may resize.
            unsafe { f(p, size) }
        }
        None => {
            crate::set_errno(libc::ENOMEM);
            core::ptr::null_mut()
        }
    }
}

/// The usable size of a pointer that is not numaweave's (0 if unknown).
///
/// # Safety
/// As [`free`], for `malloc_usable_size`.
#[cold]
#[inline(never)]
pub unsafe fn usable_size(p: *mut c_void) -> usize {
    match USABLE.get() {
        Some(f) => {
            // SAFETY: the next `malloc_usable_size`, with its signature.
            let f: unsafe extern "C" fn(*mut c_void) -> usize = unsafe { core::mem::transmute(f) };
            // SAFETY: `p` is a live block of the next allocator (the caller's word), which
            // its `malloc_usable_size` may read.
            unsafe { f(p) }
        }
        None => 0,
    }
}
