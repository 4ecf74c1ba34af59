#![allow(non_snake_case)]

//! C++ `operator new` and `operator delete`, as mimalloc overrides them
//! (Itanium C++ ABI names): plain, array, sized, aligned (`std::align_val_t`)
//! and nothrow.
//!
//! When the memory cannot be had, `new` calls the program's new-handler
//! (`std::get_new_handler()`) and tries again, as the standard says; with no
//! handler it throws `std::bad_alloc` through libstdc++'s own
//! `__cxa_throw` (these functions are `extern "C-unwind"`, so the exception
//! passes through them to the caller), or aborts in a program without the
//! C++ runtime. The nothrow forms return null instead of throwing.
//! `delete` frees like `free` (the size and alignment are found from the
//! block). Plain `new` rounds its size up to 16 bytes, so its blocks are
//! aligned to 16 (`__STDCPP_DEFAULT_NEW_ALIGNMENT__`) as compilers assume.

use core::ffi::c_void;
use core::sync::atomic::{AtomicUsize, Ordering};

use crate::malloc::{aligned_alloc, free, malloc};

/// A C++ runtime symbol looked up once with `dlsym(RTLD_DEFAULT, …)`
/// (0: not yet, 1: absent).
struct Sym(&'static core::ffi::CStr, AtomicUsize);

impl Sym {
    fn get(&self) -> Option<usize> {
        let v = self.1.load(Ordering::Acquire);
        if v == 0 {
            // SAFETY: a NUL-terminated name.
            let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, self.0.as_ptr()) } as usize;
            self.1.store(if p == 0 { 1 } else { p }, Ordering::Release);
            return (p != 0).then_some(p);
        }
        (v > 1).then_some(v)
    }
}

static GET_NEW_HANDLER: Sym = Sym(c"_ZSt15get_new_handlerv", AtomicUsize::new(0));
static ALLOCATE_EXCEPTION: Sym = Sym(c"__cxa_allocate_exception", AtomicUsize::new(0));
static THROW: Sym = Sym(c"__cxa_throw", AtomicUsize::new(0));
static BAD_ALLOC_TYPEINFO: Sym = Sym(c"_ZTISt9bad_alloc", AtomicUsize::new(0));
static BAD_ALLOC_VTABLE: Sym = Sym(c"_ZTVSt9bad_alloc", AtomicUsize::new(0));
static BAD_ALLOC_DTOR: Sym = Sym(c"_ZNSt9bad_allocD1Ev", AtomicUsize::new(0));

/// After a failed allocation: runs the new-handler and returns true (try
/// again); with none, returns false for a nothrow `new`, else throws
/// `std::bad_alloc` (or aborts without a C++ runtime).
unsafe fn out_of_memory(nothrow: bool) -> bool {
    if let Some(get) = GET_NEW_HANDLER.get() {
        // SAFETY: `std::get_new_handler`: no arguments, returns the handler.
        let get: unsafe extern "C" fn() -> Option<unsafe extern "C-unwind" fn()> = unsafe { core::mem::transmute(get) };
        // SAFETY: as above.
        if let Some(handler) = unsafe { get() } {
            // SAFETY: the program's new-handler: it frees memory, throws,
            // or ends the program.
            unsafe { handler() };
            return true;
        }
    }
    if nothrow {
        return false;
    }
    // SAFETY: throws a `std::bad_alloc` (an object that is its vtable
    // pointer) the way compiled C++ does.
    unsafe { throw_bad_alloc() }
}

unsafe fn throw_bad_alloc() -> ! {
    let (Some(alloc), Some(throw), Some(ti), Some(vt), Some(dtor)) =
        (ALLOCATE_EXCEPTION.get(), THROW.get(), BAD_ALLOC_TYPEINFO.get(), BAD_ALLOC_VTABLE.get(), BAD_ALLOC_DTOR.get())
    else {
        numaweave::os::file::report(format_args!("numaweave: out of memory in operator new"));
        // SAFETY: always sound.
        unsafe { libc::abort() }
    };
    // SAFETY: libstdc++'s functions with their Itanium ABI signatures; the
    // object is `std::bad_alloc`: one vtable pointer (the vtable symbol plus
    // two words: offset-to-top and typeinfo come first).
    unsafe {
        let alloc: unsafe extern "C" fn(usize) -> *mut c_void = core::mem::transmute(alloc);
        let throw: unsafe extern "C-unwind" fn(*mut c_void, *mut c_void, usize) -> ! = core::mem::transmute(throw);
        let obj = alloc(core::mem::size_of::<usize>());
        obj.cast::<usize>().write(vt + 2 * core::mem::size_of::<usize>());
        throw(obj, ti as *mut c_void, dtor)
    }
}

#[inline(always)]
#[unsafe(link_section = ".text.hot.numaweave")]
unsafe fn new_impl(size: usize, nothrow: bool) -> *mut c_void {
    // `__STDCPP_DEFAULT_NEW_ALIGNMENT__` is 16 and clang marks what `new`
    // returns as aligned to it, whatever the size: a multiple of 16 gets a
    // 16-byte-aligned block (C's malloc gives 8 to a 24-byte request). A size
    // too large to round stays too large.
    let size = size.saturating_add(15) & !15;
    loop {
        // SAFETY: C's malloc.
        let p = unsafe { malloc(size) };
        // SAFETY: see `out_of_memory`.
        if !p.is_null() || !unsafe { out_of_memory(nothrow) } {
            return p;
        }
    }
}

#[inline(always)]
#[unsafe(link_section = ".text.hot.numaweave")]
unsafe fn new_aligned_impl(size: usize, align: usize, nothrow: bool) -> *mut c_void {
    loop {
        // SAFETY: `std::align_val_t` is a power of two (the caller's
        // contract); C's aligned_alloc checks it anyway.
        let p = unsafe { aligned_alloc(align, size) };
        // SAFETY: see `out_of_memory`.
        if !p.is_null() || !unsafe { out_of_memory(nothrow) } {
            return p;
        }
    }
}

macro_rules! new_fns {
    ($($(#[$m:meta])* $name:ident($($arg:ident: $t:ty),*) => $body:expr;)*) => {$(
        $(#[$m])*
        ///
        /// # Safety
        /// The C++ contract of the operator.
        #[unsafe(no_mangle)]
        pub unsafe extern "C-unwind" fn $name($($arg: $t),*) -> *mut c_void {
            // SAFETY: forwarded contract.
            unsafe { $body }
        }
    )*};
}

// The throwing forms sit with the other hot code; the nothrow ones, which
// programs seldom call, are left out of it to keep it small (see
// ARCHITECTURE.md, "Resident text and start-up stack").
new_fns! {
    /// `operator new(size_t)`.
    #[unsafe(link_section = ".text.hot.numaweave")]
    _Znwm(size: usize) => new_impl(size, false);
    /// `operator new[](size_t)`.
    #[unsafe(link_section = ".text.hot.numaweave")]
    _Znam(size: usize) => new_impl(size, false);
    /// `operator new(size_t, const std::nothrow_t&)`.
    _ZnwmRKSt9nothrow_t(size: usize, _nt: *const c_void) => new_impl(size, true);
    /// `operator new[](size_t, const std::nothrow_t&)`.
    _ZnamRKSt9nothrow_t(size: usize, _nt: *const c_void) => new_impl(size, true);
    /// `operator new(size_t, std::align_val_t)`.
    #[unsafe(link_section = ".text.hot.numaweave")]
    _ZnwmSt11align_val_t(size: usize, align: usize) => new_aligned_impl(size, align, false);
    /// `operator new[](size_t, std::align_val_t)`.
    #[unsafe(link_section = ".text.hot.numaweave")]
    _ZnamSt11align_val_t(size: usize, align: usize) => new_aligned_impl(size, align, false);
    /// `operator new(size_t, std::align_val_t, const std::nothrow_t&)`.
    _ZnwmSt11align_val_tRKSt9nothrow_t(size: usize, align: usize, _nt: *const c_void) => new_aligned_impl(size, align, true);
    /// `operator new[](size_t, std::align_val_t, const std::nothrow_t&)`.
    _ZnamSt11align_val_tRKSt9nothrow_t(size: usize, align: usize, _nt: *const c_void) => new_aligned_impl(size, align, true);
}

macro_rules! delete_fns {
    ($($(#[$m:meta])* $name:ident($($arg:ident: $t:ty),*);)*) => {$(
        $(#[$m])*
        ///
        /// # Safety
        /// The C++ contract of the operator.
        #[unsafe(no_mangle)]
        #[unsafe(link_section = ".text.hot.numaweave")]
        pub unsafe extern "C" fn $name(p: *mut c_void $(, $arg: $t)*) {
            $(let _ = $arg;)*
            // SAFETY: forwarded contract; the size and alignment are found
            // from the block.
            unsafe { free(p) }
        }
    )*};
}

delete_fns! {
    /// `operator delete(void*)`.
    _ZdlPv();
    /// `operator delete[](void*)`.
    _ZdaPv();
    /// `operator delete(void*, size_t)`.
    _ZdlPvm(size: usize);
    /// `operator delete[](void*, size_t)`.
    _ZdaPvm(size: usize);
    /// `operator delete(void*, std::align_val_t)`.
    _ZdlPvSt11align_val_t(align: usize);
    /// `operator delete[](void*, std::align_val_t)`.
    _ZdaPvSt11align_val_t(align: usize);
    /// `operator delete(void*, size_t, std::align_val_t)`.
    _ZdlPvmSt11align_val_t(size: usize, align: usize);
    /// `operator delete[](void*, size_t, std::align_val_t)`.
    _ZdaPvmSt11align_val_t(size: usize, align: usize);
    /// `operator delete(void*, const std::nothrow_t&)`.
    _ZdlPvRKSt9nothrow_t(nt: *const c_void);
    /// `operator delete[](void*, const std::nothrow_t&)`.
    _ZdaPvRKSt9nothrow_t(nt: *const c_void);
    /// `operator delete(void*, std::align_val_t, const std::nothrow_t&)`.
    _ZdlPvSt11align_val_tRKSt9nothrow_t(align: usize, nt: *const c_void);
    /// `operator delete[](void*, std::align_val_t, const std::nothrow_t&)`.
    _ZdaPvSt11align_val_tRKSt9nothrow_t(align: usize, nt: *const c_void);
}
