//! Restartable sequences on the area glibc registers for each thread: where
//! that area is, the CPU, node and concurrency id the kernel keeps in it, and
//! per-CPU stacks of pointers whose pop and push are restartable sequences.
//!
//! glibc (2.35 and later) registers one `struct rseq` per thread at the
//! thread's start and publishes where it is: `__rseq_offset` (from the
//! thread pointer) and `__rseq_size` (0 when it registered none: an older
//! kernel, `GLIBC_TUNABLES=glibc.pthread.rseq=0`). A process has one
//! registration per thread, so this module never registers its own: it
//! shares glibc's, as librseq does, and writes one field of the area, the
//! critical-section pointer (`rseq_cs`), which is the user's to write. The
//! kernel writes the others: `cpu_id` at each return to user space after a
//! move, and from Linux 6.3 `node_id` and `mm_cid` (the process's
//! concurrency id: dense, below the number of CPUs it may use, unique among
//! its threads running at once). The two symbols are weak references (a
//! `global_asm!` table the dynamic linker fills, 0 where glibc lacks them),
//! so a binary loads and runs where they do not exist; there
//! [`registration`] is `None` and the callers keep their per-thread paths.
//!
//! A restartable sequence is a few instructions between a start and a
//! commit (one store) that the kernel restarts at an abort handler if the
//! thread is preempted, migrated or signalled in between: the code reads
//! the CPU (or concurrency id), works on that CPU's data, and commits with
//! one store, as if it held that CPU alone. Its descriptor (`struct
//! rseq_cs`: start, length, abort address) is in the `__rseq_cs` section;
//! the abort handler, in `__rseq_failure`, follows the 4-byte signature
//! glibc registered (`0x53053053` on x86-64, encoded inside a `ud1` so that
//! it never executes) and jumps back to the start, which stores the
//! descriptor's address again (the kernel clears it when it aborts).
//! After a sequence `rseq_cs` still points at its descriptor (as librseq
//! leaves it): the kernel reads it at the thread's next preemption, so the
//! code must stay mapped while threads that ran it live (a library of ours
//! loaded with `dlopen` must not be `dlclose`d; the preloaded C library
//! never is). A `vfork` child (`CLONE_VM`) shares its parent thread's
//! area but the kernel does not restart its sequences: it must not
//! allocate, as POSIX already asks (glibc's `posix_spawn` child does not).
//! Only x86-64 has the sequences; elsewhere [`registration`] is `None`.

use core::ptr::NonNull;
use core::sync::atomic::{AtomicUsize, Ordering};

use super::ReadOnce;
use super::mem::Mapping;
use crate::error::Result;

/// Where the calling threads' rseq areas are, and what the kernel fills in
/// them: glibc's registration, read once for the process.
/// Only [`registration`] makes one (its fields are where the sequences
/// write: a made-up offset would write into the thread's control block).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Registration {
    offset: isize,
    feature_size: usize,
}

// The fields of `struct rseq` (include/uapi/linux/rseq.h).
const CPU_ID: usize = 4;
const RSEQ_CS: usize = 8;
const NODE_ID: usize = 20;
const MM_CID: usize = 24;
/// `AT_RSEQ_FEATURE_SIZE` (Linux 6.3): the auxiliary vector's entry.
const AT_RSEQ_FEATURE_SIZE: libc::c_ulong = 27;
/// The area's size before the kernel reported one: up to `flags`.
const ORIGINAL_FEATURES: usize = 20;
/// The length glibc registered before 2.40 (`sizeof(struct rseq)` then).
const ORIGINAL_LENGTH: usize = 32;

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
core::arch::global_asm!(
    ".weak __rseq_offset",
    ".weak __rseq_size",
    ".pushsection .data.rel.ro.numaweave_rseq,\"aw\"",
    ".balign 8",
    ".globl __numaweave_rseq_refs",
    ".hidden __numaweave_rseq_refs",
    "__numaweave_rseq_refs:",
    ".quad __rseq_offset",
    ".quad __rseq_size",
    ".popsection",
);

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
unsafe extern "C" {
    /// The addresses of glibc's `__rseq_offset` and `__rseq_size`, each
    /// null where the running glibc has no such symbol.
    static __numaweave_rseq_refs: [*const u8; 2];
}

/// glibc's registration, if it made one for this process's threads (read
/// once; every thread glibc starts has an area at the same offset).
///
/// ```
/// use numaweave::os::rseq;
///
/// if let Some(r) = rseq::registration() {
///     // The CPU as the kernel last wrote it: no call, no system call.
///     let cpu = r.cpu().expect("a thread glibc started is registered");
///     assert!(cpu < 1 << 16);
/// } // (else glibc registered none: `GLIBC_TUNABLES=glibc.pthread.rseq=0`)
/// ```
pub fn registration() -> Option<Registration> {
    static REGISTRATION: ReadOnce = ReadOnce::new();
    // One word, so that a thread that sees it sees all of it: the offset
    // (32 bits, signed) above 1 + the feature size; 1 alone for none.
    let v = REGISTRATION.get(|| match read_registration() {
        Some(r) if i32::try_from(r.offset).is_ok() && r.feature_size < 1 << 16 => {
            ((r.offset as i32 as u32 as usize) << 32) | (1 + r.feature_size)
        }
        _ => 1,
    });
    let low = v & 0xffff_ffff;
    (low > 1).then(|| Registration { offset: (v >> 32) as u32 as i32 as isize, feature_size: low - 1 })
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn read_registration() -> Option<Registration> {
    // SAFETY: the table is ours, filled by the dynamic linker before any
    // code ran; each entry is null or the address of glibc's symbol, which
    // glibc wrote before the program's first instruction and never after.
    let (offset, size) = unsafe {
        let [off, size] = core::ptr::addr_of!(__numaweave_rseq_refs).read();
        if off.is_null() || size.is_null() {
            return None;
        }
        (off.cast::<isize>().read(), size.cast::<u32>().read())
    };
    if size == 0 {
        return None;
    }
    // SAFETY: getauxval has no preconditions; 0 for an entry the kernel
    // did not pass.
    let reported = unsafe { libc::getauxval(AT_RSEQ_FEATURE_SIZE) } as usize;
    // glibc before 2.40 registers 32 bytes and says 20 (or 32) in
    // `__rseq_size`; the kernel fills what it knows up to the registered
    // length. Later ones register and say the kernel's size.
    let registered = (size as usize).max(ORIGINAL_LENGTH);
    let feature_size = if reported == 0 { ORIGINAL_FEATURES } else { reported.min(registered) };
    let r = Registration { offset, feature_size };
    // A registered thread's `cpu_id` is a CPU, never the -1 ("not yet") or
    // -2 ("registration failed") it starts as.
    r.cpu().map(|_| r)
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn read_registration() -> Option<Registration> {
    None
}

/// The 4-byte field at `field` of the calling thread's area (`fs:`-relative).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[inline(always)]
fn read_u32(offset: isize, field: usize) -> u32 {
    let v: u32;
    // SAFETY: reads 4 bytes of the calling thread's own rseq area (glibc's,
    // at `offset` from the thread pointer for every thread it started);
    // `field` is one of the area's fields. The kernel writes them only while
    // this thread is not running, so a plain load sees a whole value; the
    // asm (not `pure`) is not merged with an earlier read.
    unsafe {
        core::arch::asm!(
            "mov {v:e}, dword ptr fs:[{o} + {f}]",
            v = out(reg) v,
            o = in(reg) offset,
            f = in(reg) field,
            options(nostack, readonly, preserves_flags),
        );
    }
    v
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn read_u32(_: isize, _: usize) -> u32 {
    u32::MAX
}

impl Registration {
    /// The area's offset from the thread pointer (`__rseq_offset`).
    pub fn offset(&self) -> isize {
        self.offset
    }

    /// The bytes of the area the kernel fills: `AT_RSEQ_FEATURE_SIZE` (20
    /// before Linux 6.3, which reports none), at most what glibc
    /// registered.
    pub fn feature_size(&self) -> usize {
        self.feature_size
    }

    /// The CPU the calling thread runs on now (stale as soon as it
    /// returns, as `sched_getcpu`'s; read with no call); `None` on a
    /// thread whose registration failed or was undone.
    #[inline]
    pub fn cpu(&self) -> Option<usize> {
        let c = read_u32(self.offset, CPU_ID);
        (c < 1 << 31).then_some(c as usize)
    }

    /// The (kernel) node of that CPU, where the kernel fills it (6.3+).
    #[inline]
    pub fn node(&self) -> Option<usize> {
        (self.feature_size >= NODE_ID + 4).then(|| read_u32(self.offset, NODE_ID) as usize)
    }

    /// The calling thread's concurrency id, where the kernel fills it
    /// (6.3+): below the number of CPUs the process may use, and no two of
    /// its threads running at once have the same.
    #[inline]
    pub fn mm_cid(&self) -> Option<usize> {
        (self.feature_size >= MM_CID + 4).then(|| read_u32(self.offset, MM_CID) as usize)
    }
}

/// What indexes per-CPU data: the CPU, or the concurrency id where the
/// kernel has one (denser: a process allowed 4 of 64 CPUs uses 4 rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Index {
    /// `cpu_id`.
    Cpu,
    /// `mm_cid`.
    ConcurrencyId,
}

/// Per-CPU stacks of pointers: for each CPU (each concurrency id) `lists`
/// stacks of up to `cap` non-null pointers each, whose pop and push are
/// restartable sequences: a thread works on the stack of the CPU it runs on
/// as if it held that CPU alone, with no atomic instruction and no lock.
/// Each CPU's row is its own run of cache lines, its first word a *closed*
/// flag the sequences check: a closed row serves nothing (pop finds it
/// empty, push full).
///
/// Any thread may take a row's pointers ([`drain_row`](Self::drain_row)):
/// it closes the row, then has the kernel restart every sequence running
/// on it (`membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ)`, which the
/// constructor registers the process for, Linux 5.10), after which no
/// sequence that saw the row open can still commit; it empties the row and
/// opens it again. This is how a trim reaches blocks cached on other CPUs.
///
/// ```
/// use core::ptr::NonNull;
/// use numaweave::os::rseq::CpuStacks;
///
/// if let Some(stacks) = CpuStacks::new(2, 64) {
///     let stacks = stacks.unwrap();
///     let block = NonNull::new(0x1000 as *mut u8).unwrap();
///     assert!(stacks.push(0, block));
///     // Another thread that runs on this CPU now would take it; so would
///     // we, unless the scheduler moved us meanwhile.
///     let mut found = stacks.pop(0) == Some(block);
///     for row in 0..stacks.rows() {
///         stacks.drain_row(row, |_, p| found |= p == block).unwrap();
///     }
///     assert!(found);
/// }
/// ```
pub struct CpuStacks {
    map: Mapping,
    reg: Registration,
    index: Index,
    rows: usize,
    row_bytes: usize,
    lists: usize,
    cap: usize,
}

// SAFETY: the rows are reached only through the sequences (each on the row of
// the CPU it runs on, restarted if another thread could have run there), by a
// drainer that closed the row and fenced it (`drain_row`), or through
// `&mut self`; the mapping itself is `Send + Sync`.
unsafe impl Send for CpuStacks {}
// SAFETY: as for `Send`: a shared `CpuStacks` writes its rows only through
// the sequences (`pop`, `push`, `push_upto`, their `_on_cpu` and
// `_on_cpu_unchecked` forms and `push_upto_on_row`, each on the row of the
// CPU it runs on) and
// `drain_row` (a closed, fenced row),
// which never let two threads write one row at once; `len` only reads a
// count, a word the sequences store whole, so it reads a value one of them
// stored (a moment's figure, as its doc says).
unsafe impl Sync for CpuStacks {}

/// `membarrier`'s commands (include/uapi/linux/membarrier.h).
const MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ: libc::c_int = 1 << 7;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ: libc::c_int = 1 << 8;
const MEMBARRIER_CMD_FLAG_CPU: libc::c_uint = 1;

fn membarrier(cmd: libc::c_int, flags: libc::c_uint, cpu: libc::c_int) -> Result<()> {
    let _errno = super::KeepErrno::new();
    // SAFETY: membarrier takes no pointers; an unknown command is EINVAL.
    let r = unsafe { libc::syscall(libc::SYS_membarrier, cmd, flags, cpu) };
    super::os_result(r, "membarrier")?;
    Ok(())
}

/// The process's registration for the rseq fence, made once (`membarrier`
/// keeps it for the process's life, and a forked child inherits it).
fn fence_registered() -> Result<()> {
    static REGISTERED: ReadOnce = ReadOnce::new();
    // 1: registered; 2 + errno: refused.
    match REGISTERED.get(|| match membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED_RSEQ, 0, 0) {
        Ok(()) => 1,
        Err(e) => 2 + e.errno().unwrap_or(libc::EINVAL).max(0) as usize,
    }) {
        1 => Ok(()),
        v => Err(crate::error::Error::Os { call: "membarrier", errno: (v - 2) as i32 }),
    }
}

/// A restartable sequence on the calling thread's row of `$stacks`, stack
/// at `$list` bytes into the row, rows indexed by the area's `$field`: the
/// frame every sequence shares, around `$body` (which addresses the stack
/// through `{c}` and must end with its one committing store). From 20:
/// `$reset` (the outputs a restart must clear), `{t}` = the area's offset
/// from the thread pointer, `rseq_cs` pointed at the descriptor (23). The
/// critical section, 21 to 22: leave (for 22, every output as `$reset`
/// left it) if the thread's `cpu_id` is negative (its registration failed
/// or was undone: the kernel restarts nothing for it, and its `mm_cid` may
/// be stale or 0), if the row index is past the rows (never, for a
/// registered thread, but past `MAX_CPUS` possible CPUs: a CPU is below
/// the possible ones) or if the row is closed (its first word not 0,
/// `drain_row`); else `{c}` = the stack (`base + index * row_bytes +
/// list`, inside the mapping). The descriptor goes to `__rseq_cs`, the
/// abort handler (24, after glibc's signature inside a `ud1`) to
/// `__rseq_failure`: it jumps back to 20 (the kernel clears `rseq_cs` when
/// it aborts). `$operands`: the body's own.
///
/// The stacks' geometry (rows, row bytes, the mapping's base, the area's
/// offset) is read from `$stacks` in place (`{s}`, fields by `offset_of!`),
/// not each passed in a register: a push then needs seven registers, not
/// ten, which the caller-saved ones hold, and a free that pushes saves
/// none of the callee-saved ones. `{t}` holds the offset until the body
/// takes it as scratch; a restart loads it again (no input is written, so
/// a restart finds every one as it was).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
macro_rules! row_sequence {
    ($stacks:expr, $list:expr, $field:expr, reset = $reset:literal, body = [$($body:literal),* $(,)?], $($operands:tt)*) => {
        core::arch::asm!(
            "20:",
            $reset,
            "mov {t}, qword ptr [{s} + {o_off}]",
            "lea {c}, [rip + 23f]",
            "mov qword ptr fs:[{t} + {cs}], {c}",
            "21:",
            "cmp dword ptr fs:[{t} + {cpu_id}], 0",
            "jl 22f",
            "mov {c:e}, dword ptr fs:[{t} + {field}]",
            "cmp {c}, qword ptr [{s} + {o_rows}]",
            "jae 22f",
            "imul {c}, qword ptr [{s} + {o_row_bytes}]",
            "add {c}, qword ptr [{s} + {o_base}]",
            "cmp qword ptr [{c}], 0",
            "jne 22f",
            "add {c}, {list}",
            $($body,)*
            "22:",
            ".pushsection __rseq_cs, \"aw\"",
            ".balign 32",
            "23:",
            ".long 0, 0",
            ".quad 21b, 22b - 21b, 24f",
            ".popsection",
            ".pushsection __rseq_failure, \"ax\"",
            ".byte 0x0f, 0xb9, 0x3d",
            ".long 0x53053053",
            "24:",
            "jmp 20b",
            ".popsection",
            t = out(reg) _,
            c = out(reg) _,
            s = in(reg) core::ptr::from_ref::<CpuStacks>($stacks),
            list = in(reg) $list,
            o_off = const core::mem::offset_of!(CpuStacks, reg) + core::mem::offset_of!(Registration, offset),
            o_rows = const core::mem::offset_of!(CpuStacks, rows),
            o_row_bytes = const core::mem::offset_of!(CpuStacks, row_bytes),
            o_base = const core::mem::offset_of!(CpuStacks, map) + super::mem::MAPPING_PTR,
            cs = const RSEQ_CS,
            cpu_id = const CPU_ID,
            field = const $field,
            $($operands)*
            options(nostack),
        )
    };
}

/// [`row_sequence!`] with `push_at`'s body (below), after the `check`
/// instructions (which may leave at `22f`, `{ok}` still 0): the push with
/// a test of its own shares the one push body.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
macro_rules! push_sequence {
    ($stacks:expr, $list:expr, $field:expr, check = [$($check:literal),* $(,)?], $($operands:tt)*) => {
        row_sequence!(
            $stacks, $list, $field,
            reset = "xor {ok:e}, {ok:e}",
            body = [
                $($check,)*
                "mov {t}, qword ptr [{c}]",
                "cmp {t}, {cap}",
                "jae 22f",
                "inc {t}",
                "mov qword ptr [{c} + 8*{t}], {p}",
                "mov {ok:e}, 1",
                "mov qword ptr [{c}], {t}",
            ],
            $($operands)*
        )
    };
}

/// The CPUs the kernel may name: one past the last of
/// `/sys/devices/system/cpu/possible` (`0-15`, `0,2-5`), read into a buffer
/// on the stack (glibc's `sysconf(_SC_NPROCESSORS_CONF)` may fall back to
/// `opendir`, which allocates: the allocator makes its caches inside its
/// start-up); [`MAX_CPUS`](crate::sets::MAX_CPUS) where the file cannot be
/// read. A concurrency id is below it too.
fn possible_cpus() -> usize {
    let mut buf = [0u8; 256];
    let last = super::file::read_str(c"/sys/devices/system/cpu/possible", &mut buf)
        .ok()
        .and_then(|s| s.trim().rsplit([',', '-']).next().and_then(|n| n.parse::<usize>().ok()));
    match last {
        Some(n) => (n + 1).min(crate::sets::MAX_CPUS),
        None => crate::sets::MAX_CPUS,
    }
}

/// The first word of a row: its closed flag.
const HEAD: usize = 8;

impl CpuStacks {
    /// Stacks of `cap` pointers, `lists` to a CPU, for every CPU the kernel
    /// may name; `None` without glibc's registration (or off x86-64); an
    /// error when the OS refuses the mapping or the rseq fence (Linux
    /// before 5.10).
    pub fn new(lists: usize, cap: usize) -> Option<Result<CpuStacks>> {
        let reg = registration()?;
        let index = if reg.mm_cid().is_some() { Index::ConcurrencyId } else { Index::Cpu };
        Some(Self::with_index(reg, index, lists, cap))
    }

    /// [`new`](Self::new) indexed by `index`: `ConcurrencyId` only where
    /// the kernel fills `mm_cid` (else every thread would read 0 and share
    /// row 0 unguarded). Crate-private: the tests take the `Cpu` index on
    /// 6.3+ too (its per-CPU fence).
    pub(crate) fn with_index(reg: Registration, index: Index, lists: usize, cap: usize) -> Result<CpuStacks> {
        assert!(lists > 0 && cap > 0, "stacks of no lists or no room");
        assert!(index == Index::Cpu || reg.mm_cid().is_some(), "no concurrency ids before Linux 6.3");
        fence_registered()?;
        let rows = possible_cpus();
        let too_large = crate::error::Error::LayoutTooLarge { size: usize::MAX, align: 64 };
        let row_bytes = cap
            .checked_add(1)
            .and_then(|c| c.checked_mul(lists))
            .and_then(|w| w.checked_mul(8))
            .and_then(|b| b.checked_add(HEAD + 63))
            .map(|b| b & !63)
            .ok_or(too_large)?;
        let map = Mapping::map(rows.checked_mul(row_bytes).ok_or(too_large)?)?;
        Ok(CpuStacks { map, reg, index, rows, row_bytes, lists, cap })
    }

    /// What indexes the rows.
    pub fn index(&self) -> Index {
        self.index
    }

    /// How many rows there are (CPUs the kernel may name).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// How many pointers one stack holds.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// The row the calling thread's `cpu_id` names, if the sequences can
    /// use it (`*_on_cpu`): `None` where the thread's registration failed
    /// or was undone, or its CPU is past the rows.
    #[inline]
    pub fn cpu_row(&self) -> Option<usize> {
        self.reg.cpu().filter(|&c| c < self.rows)
    }

    /// Where stack `list` lies in a row (its count's offset): what the
    /// unchecked forms ([`pop_on_cpu_unchecked`](Self::pop_on_cpu_unchecked),
    /// [`push_upto_on_cpu_unchecked`](Self::push_upto_on_cpu_unchecked))
    /// take, so that a caller with a table of them spends one load on it,
    /// not a multiplication. Panics if `list` is past the lists.
    #[inline(always)]
    pub fn list_offset(&self, list: usize) -> usize {
        assert!(list < self.lists);
        HEAD + list * (self.cap + 1) * 8
    }

    /// Takes the top pointer of stack `list` of the CPU the calling thread
    /// runs on; `None` when that stack is empty (or its row closed).
    #[inline]
    pub fn pop(&self, list: usize) -> Option<NonNull<u8>> {
        let list_off = self.list_offset(list);
        // SAFETY: `list_off` is `list`'s offset (`list_offset` checked it).
        let v = unsafe {
            match self.index {
                Index::Cpu => self.pop_at::<CPU_ID>(list_off),
                Index::ConcurrencyId => self.pop_at::<MM_CID>(list_off),
            }
        };
        NonNull::new(v as *mut u8)
    }

    /// Puts `p` on stack `list` of the CPU the calling thread runs on;
    /// false (and `p` not kept) when that stack is full (or its row closed).
    #[inline]
    pub fn push(&self, list: usize, p: NonNull<u8>) -> bool {
        self.push_upto(list, p, self.cap)
    }

    /// [`push`](Self::push) onto a stack held to `cap` pointers (at most
    /// the stacks' room): lists of one set may keep different depths.
    #[inline]
    pub fn push_upto(&self, list: usize, p: NonNull<u8>, cap: usize) -> bool {
        let list_off = self.list_offset(list);
        let cap = cap.min(self.cap);
        // SAFETY: `list_off` is `list`'s offset (`list_offset` checked it), `cap`
        // clamped to the room.
        unsafe {
            match self.index {
                Index::Cpu => self.push_at::<CPU_ID>(list_off, p.as_ptr() as usize, cap),
                Index::ConcurrencyId => self.push_at::<MM_CID>(list_off, p.as_ptr() as usize, cap),
            }
        }
    }

    /// [`pop`](Self::pop) on the row of the CPU the thread runs on
    /// whatever the index (a per-CPU cache whose rows must each hold one
    /// node's blocks): no match on the index on the way.
    #[inline(always)]
    pub fn pop_on_cpu(&self, list: usize) -> Option<NonNull<u8>> {
        // SAFETY: `list`'s offset (`list_offset` checked it).
        NonNull::new(unsafe { self.pop_at::<CPU_ID>(self.list_offset(list)) } as *mut u8)
    }

    /// [`pop_on_cpu`](Self::pop_on_cpu) of the stack at `offset`, as
    /// [`push_upto_on_cpu_unchecked`](Self::push_upto_on_cpu_unchecked).
    ///
    /// # Safety
    /// `offset` is a [`list_offset`](Self::list_offset) of these stacks.
    #[inline(always)]
    pub unsafe fn pop_on_cpu_unchecked(&self, offset: usize) -> Option<NonNull<u8>> {
        debug_assert!(self.is_list_offset(offset), "a pop outside the stacks");
        // SAFETY: a list's offset (the caller's word).
        NonNull::new(unsafe { self.pop_at::<CPU_ID>(offset) } as *mut u8)
    }

    /// [`push_upto`](Self::push_upto) on the row of the CPU the thread runs
    /// on whatever the index, as [`pop_on_cpu`](Self::pop_on_cpu).
    #[inline(always)]
    pub fn push_upto_on_cpu(&self, list: usize, p: NonNull<u8>, cap: usize) -> bool {
        // SAFETY: `list`'s offset (`list_offset` checked it), `cap` clamped.
        unsafe { self.push_at::<CPU_ID>(self.list_offset(list), p.as_ptr() as usize, cap.min(self.cap)) }
    }

    /// [`push_upto_on_cpu`](Self::push_upto_on_cpu) onto the stack at
    /// `offset` ([`list_offset`](Self::list_offset)) without a check of it
    /// or of `cap`, for a caller whose lists and depths are the stacks' own
    /// by construction (the per-CPU caches' free): no bound test, no panic
    /// path and no clamp on the way, so a free that pushes makes no call
    /// and keeps no register of its caller's.
    ///
    /// # Safety
    /// `offset` is a [`list_offset`](Self::list_offset) of these stacks and
    /// `cap` at most their room ([`cap`](Self::cap)): the sequence then
    /// writes inside that stack.
    #[inline(always)]
    pub unsafe fn push_upto_on_cpu_unchecked(&self, offset: usize, p: NonNull<u8>, cap: usize) -> bool {
        debug_assert!(self.is_list_offset(offset) && cap <= self.cap, "a push outside the stacks");
        // SAFETY: a list's offset and a depth within the room (the caller's word).
        unsafe { self.push_at::<CPU_ID>(offset, p.as_ptr() as usize, cap) }
    }

    /// Whether `offset` is one of [`list_offset`](Self::list_offset)'s.
    fn is_list_offset(&self, offset: usize) -> bool {
        let stride = (self.cap + 1) * 8;
        offset >= HEAD && (offset - HEAD).is_multiple_of(stride) && (offset - HEAD) / stride < self.lists
    }

    /// [`push_upto_on_cpu`](Self::push_upto_on_cpu) only while the thread
    /// runs on CPU `row`: false (and `p` not kept) when it runs elsewhere
    /// by the push, as when the stack is full. Checked inside the sequence,
    /// so a thread that moves between its choice of `row` (a node's blocks
    /// for that CPU's row) and the push never puts `p` on another row.
    #[inline(always)]
    pub fn push_upto_on_row(&self, row: usize, list: usize, p: NonNull<u8>, cap: usize) -> bool {
        // SAFETY: `list`'s offset (`list_offset` checked it), `cap` clamped.
        unsafe { self.push_on_row_at(self.list_offset(list), p.as_ptr() as usize, cap.min(self.cap), row) }
    }

    /// The pop's sequence on stack `list_off` of the row `FIELD` names.
    ///
    /// # Safety
    /// `list_off` is a [`list_offset`](Self::list_offset) of these stacks.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[inline(always)]
    unsafe fn pop_at<const FIELD: usize>(&self, list_off: usize) -> usize {
        let v: usize;
        // SAFETY: a restartable sequence on the calling thread's row (the
        // frame `row_sequence!` describes; `list_off` is a list's offset, the
        // caller's word, so `list_off + (cap + 1) * 8 <= row_bytes` and the
        // stack is inside the mapping). The body loads the
        // stack's count `top` (0..=cap; leaves with `v` = 0 if it is 0) and
        // its top slot (1-based: slot k at 8 * k); only its last
        // instruction, the store of `top - 1`, changes memory: the commit.
        // If the thread is preempted, migrated or signalled before it, or a
        // drainer fences the row, the kernel moves it to the abort handler,
        // which restarts the sequence (`v` zeroed again): so from the row
        // index's read to the commit no other thread ran on this CPU (no
        // other thread of the process had this concurrency id) and no
        // drainer took the row, and the row is ours alone, as a per-CPU
        // variable under preemption off is the kernel's. After the commit
        // the slot is the caller's: the next push on this row writes it
        // only after raising `top` past it.
        unsafe {
            row_sequence!(
                self, list_off, FIELD,
                reset = "xor {v:e}, {v:e}",
                body = [
                    "mov {t}, qword ptr [{c}]",
                    "test {t}, {t}",
                    "jz 22f",
                    "mov {v}, qword ptr [{c} + 8*{t}]",
                    "dec {t}",
                    "mov qword ptr [{c}], {t}",
                ],
                v = out(reg) v,
            );
        }
        v
    }

    /// The push's sequence onto stack `list_off` of the row `FIELD` names,
    /// held to `cap` pointers.
    ///
    /// # Safety
    /// `list_off` is a [`list_offset`](Self::list_offset) of these stacks
    /// and `cap` at most their room ([`cap`](Self::cap)).
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[inline(always)]
    unsafe fn push_at<const FIELD: usize>(&self, list_off: usize, p: usize, cap: usize) -> bool {
        let ok: usize;
        // SAFETY: a restartable sequence on the calling thread's row, as in
        // `pop_at` (`list_off` a list's offset, the caller's word): between
        // the row index's read and the commit no other thread works on the
        // row and no drainer took it. The body checks `top < cap` (`cap <=
        // self.cap`, the stack's room: the caller's word, so slot `top + 1`
        // is inside the stack), writes `p` to slot `top + 1` (above the stack's top:
        // no one reads it until the commit), sets `ok` (a register: a
        // restart zeroes it again), and commits with the store of `top + 1`.
        // An abort after the slot's write leaves a value above `top`, which
        // counts for nothing.
        unsafe {
            push_sequence!(
                self, list_off, FIELD,
                check = [],
                ok = out(reg) ok,
                cap = in(reg) cap,
                p = in(reg) p,
            );
        }
        ok != 0
    }

    /// [`push_at`](Self::push_at)'s sequence, committed only on row `row`.
    ///
    /// # Safety
    /// As [`push_at`](Self::push_at).
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[inline(always)]
    unsafe fn push_on_row_at(&self, list_off: usize, p: usize, cap: usize, row: usize) -> bool {
        let ok: usize;
        // SAFETY: `push_at`'s sequence (`push_sequence!`, the caller's word on
        // `list_off` and `cap`) on the row
        // `cpu_id` names, with one test first: `cpu_id` read again inside the critical section equals
        // `row` (else it leaves with `ok` = 0, nothing written). A thread
        // moved after that read is moved to the abort handler before the
        // commit, and the restart reads `cpu_id` again: so the push commits
        // only on row `row`, by a thread running on that CPU.
        unsafe {
            push_sequence!(
                self, list_off, CPU_ID,
                check = ["cmp dword ptr fs:[{t} + {cpu_id}], {row:e}", "jne 22f"],
                ok = out(reg) ok,
                cap = in(reg) cap,
                p = in(reg) p,
                row = in(reg) row,
            );
        }
        ok != 0
    }

    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    unsafe fn push_on_row_at(&self, _: usize, _: usize, _: usize, _: usize) -> bool {
        unreachable!("no registration off x86-64 Linux")
    }

    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    unsafe fn pop_at<const FIELD: usize>(&self, _: usize) -> usize {
        unreachable!("no registration off x86-64 Linux")
    }

    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    unsafe fn push_at<const FIELD: usize>(&self, _: usize, _: usize, _: usize) -> bool {
        unreachable!("no registration off x86-64 Linux")
    }

    /// Row `row`'s closed flag.
    fn closed(&self, row: usize) -> &AtomicUsize {
        assert!(row < self.rows);
        // SAFETY: the row's first word, inside the mapping and aligned (rows
        // are whole cache lines); only atomics and the sequences' plain
        // loads (which, inside a restartable sequence, are fenced by
        // `drain_row`) reach it.
        unsafe { AtomicUsize::from_ptr(self.map.as_ptr().add(row * self.row_bytes).cast()) }
    }

    /// How many pointers stack `list` of row `row` holds now (a moment's
    /// figure: threads may be working on the row).
    pub fn len(&self, row: usize, list: usize) -> usize {
        assert!(row < self.rows);
        // SAFETY: the stack's count word, inside the mapping and aligned;
        // read atomically (the sequences' stores to it are single aligned
        // 8-byte moves).
        let top = unsafe {
            AtomicUsize::from_ptr(self.map.as_ptr().add(row * self.row_bytes + self.list_offset(list)).cast())
                .load(Ordering::Relaxed)
        };
        top.min(self.cap)
    }

    /// Takes every pointer of row `row`'s stacks while other threads may
    /// be running sequences on it: closes the row, fences it (no sequence
    /// that saw it open can commit after), hands each pointer to `each`
    /// with its list, empties the stacks and opens the row again. `Ok(false)`
    /// when another thread is draining the row (nothing taken).
    pub fn drain_row(&self, row: usize, mut each: impl FnMut(usize, NonNull<u8>)) -> Result<bool> {
        let closed = self.closed(row);
        if closed.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return Ok(false);
        }
        // Every sequence that read the flag before our store and has not
        // committed is restarted, on its return to user space, before this
        // call returns (and reads the flag closed); what the committed ones
        // wrote is visible to us after it (its barriers).
        let fenced = match self.index {
            Index::Cpu => {
                membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ, MEMBARRIER_CMD_FLAG_CPU, row as libc::c_int)
            }
            // (A concurrency id is no CPU: every CPU is fenced.)
            Index::ConcurrencyId => membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED_RSEQ, 0, 0),
        };
        if let Err(e) = fenced {
            closed.store(0, Ordering::Release);
            return Err(e);
        }
        // SAFETY: the row is closed and fenced: no sequence works on it, and
        // no other drainer (the flag is ours); its words are inside the mapping.
        unsafe { self.empty_row(row, &mut each) };
        closed.store(0, Ordering::Release);
        Ok(true)
    }

    /// [`drain_row`](Self::drain_row) without the fence: the planted bug of
    /// its test (a sequence that saw the row open commits after the drain).
    #[cfg(test)]
    pub(crate) fn drain_row_unfenced(&self, row: usize, mut each: impl FnMut(usize, NonNull<u8>)) -> bool {
        let closed = self.closed(row);
        if closed.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
            return false;
        }
        // SAFETY: not so (the bug planted): sequences may still run on it.
        unsafe { self.empty_row(row, &mut each) };
        closed.store(0, Ordering::Release);
        true
    }

    /// Empties row `row`'s stacks into `each`.
    ///
    /// # Safety
    /// No other thread works on the row (closed and fenced, or `&mut self`).
    unsafe fn empty_row(&self, row: usize, each: &mut impl FnMut(usize, NonNull<u8>)) {
        for list in 0..self.lists {
            // SAFETY: inside the mapping (row < rows, the list's words within
            // the row); no other thread works on it (the caller's word).
            unsafe {
                let s = self.map.as_ptr().add(row * self.row_bytes + self.list_offset(list)).cast::<usize>();
                let top = AtomicUsize::from_ptr(s).load(Ordering::Relaxed);
                debug_assert!(top <= self.cap, "a stack's count past its room");
                for k in 1..=top.min(self.cap) {
                    if let Some(p) = NonNull::new(s.add(k).read() as *mut u8) {
                        each(list, p);
                    }
                }
                // (Atomic: `len` may read the count meanwhile.)
                AtomicUsize::from_ptr(s).store(0, Ordering::Relaxed);
            }
        }
    }

    /// Every pointer the stacks hold, each row's stacks emptied: no thread
    /// can run a sequence on them meanwhile (`&mut self`).
    pub fn drain(&mut self, mut each: impl FnMut(usize, NonNull<u8>)) {
        for row in 0..self.rows {
            // SAFETY: `&mut self`: no sequence runs on the rows.
            unsafe { self.empty_row(row, &mut each) };
        }
    }
}

#[cfg(test)]
mod tests;
