#![allow(non_snake_case)]

//! C++ `operator new` and `operator delete` (Itanium C++ ABI names): plain,
//! array, sized and aligned (`std::align_val_t`).
//!
//! When the memory cannot be had, `new` calls the program's new-handler
//! (`std::get_new_handler()`) and tries again, as [new.delete.single] says;
//! with no handler it throws `std::bad_alloc` (through the C++ runtime's own
//! `std::__throw_bad_alloc`), or aborts in a program without a C++ runtime.
//! A handler may throw too. Either exception must reach the caller.
//!
//! The library is built with `panic = "abort"`, under which a foreign
//! exception must not pass through a Rust frame (RFC 2945 leaves it
//! undefined). So what throws runs in naked functions (x86-64 assembly with
//! its own call-frame information, which the unwinder reads as it reads a
//! C compiler's): a stub calls the allocation in Rust, which returns before
//! anything is thrown, and only on null jumps to [`new_failed`], which
//! calls the handler and the thrower itself. A plain `new` is a Rust
//! function whose fast path (a pop, as `malloc`'s) makes no call and whose
//! every other way out is a tail call to that stub ([`new_plain_miss`]):
//! its frame is gone before the stub runs (`capi/tests` checks that it
//! makes no call). A stub in front of the fast path (a `push`, a `call`, a
//! `pop`, a test) cost alloc-test's `new`/`delete` loop 7% of its time.
//! The aligned forms are stubs in front of `aligned_alloc`. On other
//! targets numaweave leaves `new` to the C++ runtime, whose `new` calls
//! `malloc` (numaweave's).
//!
//! The nothrow forms are the C++ runtime's: since GCC 9 (and in libc++) they
//! call the throwing `operator new` (numaweave's) and turn any exception
//! into null, which is what the standard asks and what numaweave could not
//! do without a C++ personality routine of its own.
//!
//! The hinted forms (`operator new(size_t, __hot_cold_t)` and its array,
//! aligned and nothrow variants, as tcmalloc exports them for LLVM's
//! `-optimize-hot-cold-new`) take a hint byte: below 128 the block is cold
//! (`NumaAlloc::alloc_hinted`: the lower memory tier, in pages no hot
//! block shares), else the form without the hint serves. The throwing ones
//! are stubs as above, their failure path carrying the coldness to the
//! retry; the nothrow ones, which no C++ runtime has, try once and on
//! failure hand over to the runtime's unhinted nothrow form (the
//! new-handler loop, and its exception caught), whose block is hot.
//!
//! `delete` frees like `free` (the size and alignment are found from the
//! block). Plain `new` gets a block aligned to 16
//! (`__STDCPP_DEFAULT_NEW_ALIGNMENT__`) at every size, as compilers assume.

use core::alloc::{GlobalAlloc, Layout};
use core::ffi::c_void;
use core::sync::atomic::{AtomicUsize, Ordering};

use crate::A;
use crate::malloc::{aligned_alloc, free_inline};
use numaweave::alloc::COLD_BELOW;

/// `__STDCPP_DEFAULT_NEW_ALIGNMENT__` on x86-64 and aarch64.
const NEW_ALIGN: usize = 16;

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
/// libstdc++'s `std::__throw_bad_alloc()`.
static THROW_BAD_ALLOC: Sym = Sym(c"_ZSt17__throw_bad_allocv", AtomicUsize::new(0));
/// libc++'s `std::__1::__throw_bad_alloc()`.
static THROW_BAD_ALLOC_LIBCXX: Sym = Sym(c"_ZNSt3__117__throw_bad_allocEv", AtomicUsize::new(0));

/// A plain `new`'s block: `size` bytes aligned to [`NEW_ALIGN`], null when
/// none can be had (never unwinds).
#[unsafe(link_section = ".text.sorted.numaweave")]
extern "C" fn new_plain(size: usize) -> *mut c_void {
    if size.wrapping_sub(1) < numaweave::alloc::SMALL_MAX {
        // SAFETY: a valid layout: a small size, a power-of-two alignment.
        return unsafe { A.alloc(Layout::from_size_align_unchecked(size, NEW_ALIGN)) }.cast();
    }
    new_large(size)
}

/// [`new_plain`] of a size of 0 or past the size classes: out of line, so
/// that the small sizes' path tests one bound.
#[cold]
#[inline(never)]
fn new_large(size: usize) -> *mut c_void {
    // A size that cannot be a `Layout` of this alignment is refused here;
    // `alloc` serves a zero size as one byte's block.
    let Ok(layout) = Layout::from_size_align(size, NEW_ALIGN) else { return core::ptr::null_mut() };
    // SAFETY: a valid layout.
    unsafe { A.alloc(layout) }.cast()
}

/// An aligned `new`'s block, null when none can be had (never unwinds).
extern "C" fn new_aligned(size: usize, align: usize) -> *mut c_void {
    // SAFETY: C's aligned_alloc, which checks `align` (`std::align_val_t`
    // is a power of two, the caller's contract) and returns null on failure.
    unsafe { aligned_alloc(align, size) }
}

/// In [`new_failed`]'s alignment argument: the failed `new` was hinted
/// cold, and so is the retry.
const COLD_BIT: usize = 1 << 63;

/// [`new_failed`]'s retry: `align` 0 for a plain `new`, with [`COLD_BIT`]
/// for a cold one.
extern "C" fn new_retry(size: usize, align: usize) -> *mut c_void {
    match (align & COLD_BIT != 0, align & !COLD_BIT) {
        (true, a) => new_cold(size, a),
        (false, 0) => new_plain(size),
        (false, a) => new_aligned(size, a),
    }
}

/// A cold block (a hint below [`COLD_BELOW`]) of `size` bytes aligned to
/// `align` (0: `new`'s 16), null when none can be had.
fn new_cold(size: usize, align: usize) -> *mut c_void {
    let Ok(layout) = Layout::from_size_align(size, align.max(NEW_ALIGN)) else { return core::ptr::null_mut() };
    A.alloc_hinted(layout, 0).map_or(core::ptr::null_mut(), |p| p.as_ptr().cast())
}

/// A hinted `new`'s block, null when none can be had (never unwinds).
extern "C" fn new_hinted(size: usize, hint: u8) -> *mut c_void {
    if hint >= COLD_BELOW { new_plain(size) } else { new_cold(size, 0) }
}

/// A hinted aligned `new`'s block, null when none can be had.
extern "C" fn new_hinted_aligned(size: usize, align: usize, hint: u8) -> *mut c_void {
    if hint >= COLD_BELOW { new_aligned(size, align) } else { new_cold(size, align) }
}

/// The program's new-handler, 0 when it has none (or no C++ runtime).
extern "C" fn new_handler() -> usize {
    let Some(get) = GET_NEW_HANDLER.get() else { return 0 };
    // SAFETY: `std::get_new_handler`: no arguments, returns the handler (a
    // function pointer, null when none is set); it does not throw.
    let get: extern "C" fn() -> usize = unsafe { core::mem::transmute(get) };
    get()
}

/// The C++ runtime's function that throws `std::bad_alloc`; without a C++
/// runtime, reports and aborts (nothing can catch an exception there).
extern "C" fn bad_alloc_thrower() -> usize {
    if let Some(f) = THROW_BAD_ALLOC.get().or_else(|| THROW_BAD_ALLOC_LIBCXX.get()) {
        return f;
    }
    numaweave::os::report(format_args!("numaweave: out of memory in operator new, and no C++ runtime to throw"));
    // SAFETY: always sound.
    unsafe { libc::abort() }
}

/// Where a `new` goes when its allocation failed, with the frame of the
/// `new` it was jumped to from (`rdi` the size, `rsi` the alignment, 0 for
/// a plain `new`): runs the new-handler and tries again while there is
/// one; with none, throws `std::bad_alloc`. The handler and the thrower are
/// called from this frame, whose call-frame information says where the
/// three registers it saves are, so the unwinder passes through it to the
/// caller's handler.
///
/// # Safety
/// Reached only by a jump from the `new`s below, as their tail.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
unsafe extern "C-unwind" fn new_failed() -> *mut c_void {
    core::arch::naked_asm!(
        ".cfi_startproc",
        "push rbx",
        ".cfi_def_cfa_offset 16",
        ".cfi_offset rbx, -16",
        "push r12",
        ".cfi_def_cfa_offset 24",
        ".cfi_offset r12, -24",
        // The third push keeps the stack aligned to 16 at each call.
        "push r13",
        ".cfi_def_cfa_offset 32",
        ".cfi_offset r13, -32",
        "mov rbx, rdi",
        "mov r12, rsi",
        "2:",
        "call {handler}",
        "test rax, rax",
        "jz 3f",
        // The handler frees memory, throws, or ends the program.
        "call rax",
        "mov rdi, rbx",
        "mov rsi, r12",
        "call {retry}",
        "test rax, rax",
        "jz 2b",
        ".cfi_remember_state",
        "pop r13",
        ".cfi_def_cfa_offset 24",
        "pop r12",
        ".cfi_def_cfa_offset 16",
        "pop rbx",
        ".cfi_def_cfa_offset 8",
        "ret",
        ".cfi_restore_state",
        "3:",
        "call {thrower}",
        "call rax",
        "ud2",
        ".cfi_endproc",
        handler = sym new_handler,
        retry = sym new_retry,
        thrower = sym bad_alloc_thrower,
    )
}

/// Defines a throwing `new`: `$save` keeps its arguments for the failure
/// path (and the stack aligned to 16 at the call), `$alloc` allocates,
/// `$restore` undoes `$save`; on null, `$fail_args` sets what
/// [`new_failed`] takes besides the size (`rsi`: the alignment, 0 for a
/// plain `new`) and it goes there by a jump.
macro_rules! throwing_new {
    ($(#[$m:meta])* $vis:vis $name:ident($($arg:ident: $t:ty),*) => $alloc:ident,
     save [$($save:literal),*], restore [$($restore:literal),*], fail [$($fail:literal),*]) => {
        $(#[$m])*
        ///
        /// # Safety
        /// The C++ contract of the operator.
        #[cfg(target_arch = "x86_64")]
        #[unsafe(naked)]
        $vis unsafe extern "C-unwind" fn $name($($arg: $t),*) -> *mut c_void {
            core::arch::naked_asm!(
                ".cfi_startproc",
                $($save,)*
                "call {alloc}",
                $($restore,)*
                "test rax, rax",
                "jz 2f",
                "ret",
                "2:",
                $($fail,)*
                "jmp {failed}",
                ".cfi_endproc",
                alloc = sym $alloc,
                failed = sym new_failed,
            )
        }
    };
}

throwing_new! {
    /// A plain `new`'s way out of its fast path, reached by a tail call
    /// with the size: [`new_plain`]'s block, or the new-handler and
    /// `std::bad_alloc` ([`new_failed`]). The size is kept across the call
    /// (a push that also aligns).
    #[unsafe(link_section = ".text.sorted.numaweave")]
    new_plain_miss(size: usize) => new_plain,
    save ["push rdi", ".cfi_def_cfa_offset 16"],
    restore ["pop rdi", ".cfi_def_cfa_offset 8"],
    fail ["xor esi, esi"]
}

/// Defines a plain `new`: the fast path ([`NumaAlloc::alloc_fast_new`], no
/// call) in Rust, and anything else a tail call to [`new_plain_miss`].
/// The tail call is what lets an exception from there reach the caller:
/// `new`'s frame is gone before anything is thrown (`capi/tests` checks
/// that the function makes no call).
///
/// [`NumaAlloc::alloc_fast_new`]: numaweave::NumaAlloc::alloc_fast_new
macro_rules! new_plain_fn {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        ///
        /// # Safety
        /// The C++ contract of the operator.
        #[cfg(target_arch = "x86_64")]
        #[unsafe(no_mangle)]
        #[unsafe(link_section = ".text.sorted.numaweave")]
        pub unsafe extern "C-unwind" fn $name(size: usize) -> *mut c_void {
            // SAFETY: any size is accepted.
            let p = unsafe { A.alloc_fast_new(size) };
            if !p.is_null() {
                return p.cast();
            }
            // SAFETY: reached with the size in `rdi` as the stub expects,
            // by a jump (a call in tail position, nothing left to do here).
            unsafe { new_plain_miss(size) }
        }
    };
}

/// An aligned `new`: size and alignment kept (two pushes and a pad).
macro_rules! new_aligned_fn {
    ($(#[$m:meta])* $name:ident) => {
        throwing_new! {
            $(#[$m])*
            #[unsafe(no_mangle)]
            pub $name(size: usize, align: usize) => new_aligned,
            save ["push rdi", ".cfi_def_cfa_offset 16", "push rsi", ".cfi_def_cfa_offset 24",
                  "sub rsp, 8", ".cfi_def_cfa_offset 32"],
            restore ["add rsp, 8", ".cfi_def_cfa_offset 24", "pop rsi", ".cfi_def_cfa_offset 16",
                     "pop rdi", ".cfi_def_cfa_offset 8"],
            fail []
        }
    };
}

new_plain_fn! {
    /// `operator new(size_t)`.
    _Znwm
}
new_plain_fn! {
    /// `operator new[](size_t)`.
    _Znam
}
new_aligned_fn! {
    /// `operator new(size_t, std::align_val_t)`.
    _ZnwmSt11align_val_t
}
new_aligned_fn! {
    /// `operator new[](size_t, std::align_val_t)`.
    _ZnamSt11align_val_t
}

throwing_new! {
    /// A hinted `new`'s way out of its fast path, reached by a tail call
    /// with the size and the hint: [`new_hinted`]'s block, or the
    /// new-handler and `std::bad_alloc` ([`new_failed`]), the coldness
    /// going to the retry ([`COLD_BIT`], no alignment). Size and hint are
    /// kept across the call (two pushes and a pad).
    new_hinted_miss(size: usize, hint: u8) => new_hinted,
    save ["push rdi", ".cfi_def_cfa_offset 16", "push rsi", ".cfi_def_cfa_offset 24",
          "sub rsp, 8", ".cfi_def_cfa_offset 32"],
    restore ["add rsp, 8", ".cfi_def_cfa_offset 24", "pop rsi", ".cfi_def_cfa_offset 16",
             "pop rdi", ".cfi_def_cfa_offset 8"],
    // rsi = COLD_BIT if the hint (its low byte) is below 128, else 0.
    fail ["cmp sil, 128", "sbb rsi, rsi", "shl rsi, 63"]
}

/// Defines a hinted `new` (size, hint): a hot hint takes plain `new`'s fast
/// path; anything else is a tail call to [`new_hinted_miss`] (as for
/// [`new_plain_fn`]: no Rust frame is live when it throws).
macro_rules! new_hinted_fn {
    ($(#[$m:meta])* $name:ident) => {
        $(#[$m])*
        ///
        /// # Safety
        /// The C++ contract of the operator.
        #[cfg(target_arch = "x86_64")]
        #[unsafe(no_mangle)]
        pub unsafe extern "C-unwind" fn $name(size: usize, hint: u8) -> *mut c_void {
            if hint >= COLD_BELOW {
                // SAFETY: any size is accepted.
                let p = unsafe { A.alloc_fast_new(size) };
                if !p.is_null() {
                    return p.cast();
                }
            }
            // SAFETY: reached with the size and hint in `rdi` and `rsi` as
            // the stub expects, by a jump (a call in tail position).
            unsafe { new_hinted_miss(size, hint) }
        }
    };
}

/// A hinted aligned `new` (size, alignment, hint): the three kept (three
/// pushes keep the stack aligned); on failure the alignment goes to the
/// retry with the coldness.
macro_rules! new_hinted_aligned_fn {
    ($(#[$m:meta])* $name:ident) => {
        throwing_new! {
            $(#[$m])*
            #[unsafe(no_mangle)]
            pub $name(size: usize, align: usize, hint: u8) => new_hinted_aligned,
            save ["push rdi", ".cfi_def_cfa_offset 16", "push rsi", ".cfi_def_cfa_offset 24",
                  "push rdx", ".cfi_def_cfa_offset 32"],
            restore ["pop rdx", ".cfi_def_cfa_offset 24", "pop rsi", ".cfi_def_cfa_offset 16",
                     "pop rdi", ".cfi_def_cfa_offset 8"],
            fail ["cmp dl, 128", "sbb rax, rax", "shl rax, 63", "or rsi, rax"]
        }
    };
}

new_hinted_fn! {
    /// `operator new(size_t, __hot_cold_t)`.
    _Znwm12__hot_cold_t
}
new_hinted_fn! {
    /// `operator new[](size_t, __hot_cold_t)`.
    _Znam12__hot_cold_t
}
new_hinted_aligned_fn! {
    /// `operator new(size_t, std::align_val_t, __hot_cold_t)`.
    _ZnwmSt11align_val_t12__hot_cold_t
}
new_hinted_aligned_fn! {
    /// `operator new[](size_t, std::align_val_t, __hot_cold_t)`.
    _ZnamSt11align_val_t12__hot_cold_t
}

/// libstdc++'s (or libc++'s, which shares the Itanium names) unhinted
/// nothrow forms, where a hinted nothrow `new` goes when its block cannot
/// be had: they run the new-handler loop and catch its exception.
static NEW_NOTHROW: Sym = Sym(c"_ZnwmRKSt9nothrow_t", AtomicUsize::new(0));
static NEW_NOTHROW_ALIGNED: Sym = Sym(c"_ZnwmSt11align_val_tRKSt9nothrow_t", AtomicUsize::new(0));

/// A hinted nothrow `new`'s failure: the C++ runtime's nothrow form (`align`
/// 0: the plain one), null without a C++ runtime.
#[cold]
fn new_nothrow_fallback(size: usize, align: usize, nt: *const c_void) -> *mut c_void {
    match align {
        0 => match NEW_NOTHROW.get() {
            Some(f) => {
                // SAFETY: `operator new(size_t, const std::nothrow_t&)`:
                // noexcept, so nothing unwinds into this frame.
                let f: extern "C" fn(usize, *const c_void) -> *mut c_void = unsafe { core::mem::transmute(f) };
                f(size, nt)
            }
            None => core::ptr::null_mut(),
        },
        _ => match NEW_NOTHROW_ALIGNED.get() {
            Some(f) => {
                // SAFETY: `operator new(size_t, std::align_val_t, const
                // std::nothrow_t&)`: noexcept, as above.
                let f: extern "C" fn(usize, usize, *const c_void) -> *mut c_void = unsafe { core::mem::transmute(f) };
                f(size, align, nt)
            }
            None => core::ptr::null_mut(),
        },
    }
}

macro_rules! new_hinted_nothrow_fns {
    ($($(#[$m:meta])* $name:ident;)*) => {$(
        $(#[$m])*
        ///
        /// # Safety
        /// The C++ contract of the operator.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(size: usize, nt: *const c_void, hint: u8) -> *mut c_void {
            let p = new_hinted(size, hint);
            if p.is_null() { new_nothrow_fallback(size, 0, nt) } else { p }
        }
    )*};
}

macro_rules! new_hinted_aligned_nothrow_fns {
    ($($(#[$m:meta])* $name:ident;)*) => {$(
        $(#[$m])*
        ///
        /// # Safety
        /// The C++ contract of the operator.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(size: usize, align: usize, nt: *const c_void, hint: u8) -> *mut c_void {
            let p = new_hinted_aligned(size, align, hint);
            if p.is_null() { new_nothrow_fallback(size, align, nt) } else { p }
        }
    )*};
}

new_hinted_nothrow_fns! {
    /// `operator new(size_t, const std::nothrow_t&, __hot_cold_t)`.
    _ZnwmRKSt9nothrow_t12__hot_cold_t;
    /// `operator new[](size_t, const std::nothrow_t&, __hot_cold_t)`.
    _ZnamRKSt9nothrow_t12__hot_cold_t;
}

new_hinted_aligned_nothrow_fns! {
    /// `operator new(size_t, std::align_val_t, const std::nothrow_t&, __hot_cold_t)`.
    _ZnwmSt11align_val_tRKSt9nothrow_t12__hot_cold_t;
    /// `operator new[](size_t, std::align_val_t, const std::nothrow_t&, __hot_cold_t)`.
    _ZnamSt11align_val_tRKSt9nothrow_t12__hot_cold_t;
}

macro_rules! delete_fns {
    ($($(#[$m:meta])* $name:ident($($arg:ident: $t:ty),*);)*) => {$(
        $(#[$m])*
        ///
        /// # Safety
        /// The C++ contract of the operator.
        #[unsafe(no_mangle)]
        #[unsafe(link_section = ".text.sorted.numaweave")]
        pub unsafe extern "C" fn $name(p: *mut c_void $(, $arg: $t)*) {
            $(let _ = $arg;)*
            // SAFETY: `p` is null or a live block from `new` (the operator's C++ contract),
            // so ours or the next allocator's, as `free_inline` asks; its size and alignment
            // are found from the block.
            unsafe { free_inline(p) }
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
