//! Per-CPU caches of small blocks (`NUMAWEAVE_CPU_CACHE=1`,
//! `Config::cpu_cache`): for each CPU and each class of blocks up to
//! [`MAX_BLOCK`], a stack of free blocks that the threads running there
//! pop and push with restartable sequences on the rseq area glibc
//! registered (`os/rseq.rs`), indexed by `cpu_id` so that a row's blocks
//! are its CPU's node's: a refill's pushes and, with an arena per node, a
//! free's push commit only on the row they chose (`push_upto_on_row`), so
//! a thread that moves in between gives its blocks back to their pages.
//!
//! A thread served by them needs no heap of its own for those classes: an
//! empty stack is refilled with half its depth from its CPU's *home* heap
//! (one per CPU, on the CPU's node, under a lock of its own: one lock for
//! the batch); a full one gives half its depth back to the blocks' pages
//! (remote frees, collected by the pages' owners). So the free blocks a process keeps
//! cached grow with its CPUs, not its threads, and a thread that the
//! scheduler moves to another node's CPU takes that node's blocks from its
//! next allocation. A free goes to the cache only if the block is of the
//! node the thread runs on; a cached block is still in use for its page.
//!
//! Bounds: a class's stack holds at most `CLASS_BYTES` of blocks (2 to
//! `DEPTH` of them), so a CPU caches at most [`CpuCache::bytes_per_cpu`]
//! (746 KiB, every class full), the process that times its CPUs.
//! `NumaAlloc::trim` takes every CPU's blocks back (`drain`).
//!
//! The cache is made inside the allocator's start-up (never half made
//! across a fork), only where glibc registered rseq and the process
//! default is `Local`; never in hardened builds, whose checks need every
//! block's free to reach its page.

use core::ptr::{self, NonNull};

use super::Heap;
use super::free::free_remote_unarmed;
use crate::alloc::engine::segment::{self, segment_of};
use crate::alloc::engine::size_class::{self, CLASSES};
use crate::alloc::engine::types::{Block, Mode, Page, SharedHeap, SmallSegment, State};
use crate::hardened::HARDENED;
use crate::os::rseq::{self, CpuStacks, Index};
use crate::sets::MAX_CPUS;
use crate::sync::{CachePadded, InitCell, Ordering, SpinLock};

/// The largest block the caches hold.
pub(crate) const MAX_BLOCK: usize = 2 * 1024;
/// The bytes of blocks one class's stack holds at most.
const CLASS_BYTES: usize = 32 * 1024;
/// The deepest stack (blocks of 128 bytes and less).
const DEPTH: usize = 128;

/// The per-CPU caches: the stacks, one list per cached class.
pub(crate) struct CpuCache {
    stacks: CpuStacks,
    /// Classes below this are cached.
    classes: usize,
    /// Each cached class's depth.
    depth: [u8; CLASSES],
    /// Each cached class's stack in a row (`CpuStacks::list_offset`):
    /// what the pop and the free's push take, one load.
    offset: [u32; CLASSES],
    /// Whether the topology has more than one memory node (a free then
    /// checks the block's node against the thread's, in per-node mode).
    multi: bool,
}

/// Made only inside the state's start-up (`config::start`'s hook).
static CACHE: InitCell<CpuCache> = InitCell::new();

/// Per CPU, the heap its cache refills from and its blocks go back to (a
/// remote free each, collected at its next refill or by the lifecycle),
/// made on first use on the CPU's node, used under its lock: a CPU's
/// blocks come from pages of its own, so two CPUs' blocks seldom share a
/// cache line (a heap the node's CPUs shared interleaved them: two
/// threads on two CPUs ran small blocks at 1.3 times one thread's rate).
/// Each on cache lines of its own: every refill writes its CPU's lock, and
/// four 16-byte locks to a line had neighbouring CPUs' refills steal it.
static HOMES: [CachePadded<SpinLock<SharedHeap>>; MAX_CPUS] =
    [const { CachePadded(SpinLock::new(SharedHeap(ptr::null_mut()))) }; MAX_CPUS];

/// The home heaps' locks of the CPUs the kernel may name (none without the
/// caches): what `fork()` holds, and the lifecycle reclaims.
pub(crate) fn homes() -> impl DoubleEndedIterator<Item = &'static SpinLock<SharedHeap>> {
    HOMES[..get().map_or(0, CpuCache::homes)].iter().map(|l| &l.0)
}

/// A class's depth: `CLASS_BYTES` of blocks, 2 to `DEPTH` of them.
const fn depth_of(size: usize) -> usize {
    let d = CLASS_BYTES / size;
    if d < 2 {
        2
    } else if d > DEPTH {
        DEPTH
    } else {
        d
    }
}

impl CpuCache {
    /// The most bytes of free blocks one CPU's stacks hold.
    pub(crate) fn bytes_per_cpu(&self) -> usize {
        (0..self.classes).map(|c| usize::from(self.depth[c]) * size_class::class_size(c)).sum()
    }

    /// The rows (CPUs the kernel may name).
    pub(crate) fn cpus(&self) -> usize {
        self.stacks.rows()
    }

    /// The home heaps in use: one per row, at most `MAX_CPUS`.
    fn homes(&self) -> usize {
        self.stacks.rows().min(MAX_CPUS)
    }

    /// The bytes of free blocks the stacks hold now (a moment's figure).
    pub(crate) fn cached_bytes(&self) -> usize {
        let mut b = 0;
        for row in 0..self.stacks.rows() {
            for c in 0..self.classes {
                b += self.stacks.len(row, c) * size_class::class_size(c);
            }
        }
        b
    }

    /// How many blocks a refill takes and a flush gives back.
    #[inline]
    fn batch(&self, class: usize) -> usize {
        usize::from(self.depth[class]).div_ceil(2)
    }

    /// The class of `page`'s blocks if the caches take their frees: a
    /// cached class, of a page whose owner they serve (the homes' and those
    /// of threads they serve; not the nodes' shared and cold heaps', nor
    /// those of threads with a policy of their own or no row, whose blocks
    /// go home to their pages).
    ///
    /// # Safety
    /// `page` is the descriptor of a live block's page.
    #[inline(always)]
    unsafe fn class_taken(&self, page: *mut Page) -> Option<usize> {
        // SAFETY: a live block's page descriptor (the caller's word), whose
        // owner is fixed while the block is live and is a live heap (heaps
        // are never freed).
        unsafe {
            let (class, owner) = (usize::from((*page).info.class), (*page).info.heap.load(Ordering::Relaxed));
            (class < self.classes && (*owner).cpu_served.load(Ordering::Relaxed)).then_some(class)
        }
    }

    /// Pushes `p` onto the calling CPU's stack of `class`, held to the
    /// class's depth; false when it is full (or its row closed). The
    /// stack's offset from a table: no bound test, no multiplication, no
    /// call on the way (what a free's push is, `push_free`).
    ///
    /// # Safety
    /// `class < self.classes`.
    #[inline(always)]
    unsafe fn push_here(&self, class: usize, p: NonNull<u8>) -> bool {
        debug_assert!(class < self.classes && self.classes <= CLASSES && usize::from(self.depth[class]) <= DEPTH);
        // SAFETY: `class < self.classes` (the caller's word), at most
        // `CLASSES`, the tables' length: its offset is the `list_offset` of
        // the class's stack (`init` made the stacks one list a class) and
        // its depth at most `DEPTH`, the stacks' room (`depth_of`).
        unsafe {
            let depth = usize::from(*self.depth.get_unchecked(class));
            let offset = *self.offset.get_unchecked(class) as usize;
            self.stacks.push_upto_on_cpu_unchecked(offset, p, depth)
        }
    }
}

/// Makes the caches if glibc registered rseq (and the fence can be
/// registered): called once, inside the state's start-up, `multi` whether
/// the topology has more than one memory node. Reports a failure and
/// leaves the caches off.
pub(crate) fn init(multi: bool) {
    if HARDENED {
        return;
    }
    let Some(reg) = rseq::registration() else {
        crate::os::file::report(format_args!("numaweave: no rseq registration: per-thread caches"));
        return;
    };
    let classes = size_class::class_of(MAX_BLOCK) + 1;
    let mut depth = [0u8; CLASSES];
    for (c, d) in depth.iter_mut().enumerate().take(classes) {
        *d = depth_of(size_class::class_size(c)) as u8;
    }
    match CpuStacks::with_index(reg, Index::Cpu, classes, DEPTH) {
        Ok(stacks) => {
            // (A row is `classes` stacks of `DEPTH + 1` words: 37 KiB.)
            let mut offset = [0u32; CLASSES];
            for (c, o) in offset.iter_mut().enumerate().take(classes) {
                *o = u32::try_from(stacks.list_offset(c)).expect("a row of under 4 GiB");
            }
            CACHE.get_or_init(|| CpuCache { stacks, classes, depth, offset, multi });
        }
        Err(e) => crate::os::file::report(format_args!("numaweave: per-CPU caches: {e}; per-thread caches")),
    }
}

/// The caches, if this process has them.
#[inline(always)]
pub(crate) fn get() -> Option<&'static CpuCache> {
    if HARDENED { None } else { CACHE.get() }
}

/// Whether the caches serve `class` (they exist and hold its blocks).
#[inline(always)]
pub(crate) fn serves(class: usize) -> bool {
    matches!(get(), Some(c) if class < c.classes)
}

/// Whether the caches can serve the calling thread: they exist and its
/// rseq area names a row. One whose area names none (not registered, or
/// its CPU past the rows the kernel's `possible` list gave) would take
/// the one-block refill at every allocation and a remote free at every
/// free: it keeps a heap of its own instead. (glibc itself ends a process
/// whose new thread it could not register.)
pub(crate) fn serves_thread() -> bool {
    matches!(get(), Some(c) if c.stacks.cpu_row().is_some())
}

/// A block of `class` from the calling CPU's stack, null when it is empty
/// (the caller then [`refill`]s).
///
/// # Safety
/// [`serves`]`(class)`.
#[inline(always)]
pub(crate) unsafe fn pop(class: usize) -> *mut u8 {
    match get() {
        Some(c) => {
            debug_assert!(class < c.classes, "a class the caches do not hold");
            // SAFETY: `class < c.classes` (the caller's word), below
            // `CLASSES`: its entry is the `list_offset` of the class's stack
            // (`init` made the stacks one list a class).
            unsafe { c.stacks.pop_on_cpu_unchecked(*c.offset.get_unchecked(class) as usize) }
                .map_or(ptr::null_mut(), NonNull::as_ptr)
        }
        None => ptr::null_mut(),
    }
}

/// A block of `class` for a thread whose CPU's stack was empty: half the
/// stack's depth taken from its CPU's home heap under one hold of its
/// lock, one returned and the rest pushed onto the CPU's row (a block that
/// finds the stack full, or the thread moved to another CPU, goes back to
/// its page). A thread whose row the sequences cannot use (its registration
/// failed, its CPU past the rows) takes one block, from the home of its
/// CPU modulo the homes. Null when no memory can be had.
///
/// # Safety
/// [`serves`]`(class)`.
#[cold]
#[inline(never)]
pub(crate) unsafe fn refill(state: &State, class: usize) -> *mut u8 {
    let Some(c) = get() else { return ptr::null_mut() };
    debug_assert!(class < c.classes);
    let mut got = [ptr::null_mut::<u8>(); DEPTH.div_ceil(2)];
    let (cpu, want) = match c.stacks.cpu_row() {
        Some(row) => (row, c.batch(class)),
        None => (crate::os::cpu::current_cpu().unwrap_or(0), 1),
    };
    // Past `MAX_CPUS`, the home whose index the CPU has modulo the homes,
    // so that a home keeps to one node (its index's).
    let home = cpu % c.homes();
    let node = row_node(state, home);
    let mut g = HOMES[home].0.lock();
    // SAFETY: the home's lock, held; `class < CLASSES` (a cached class).
    let n = unsafe { Heap::alloc_batch_in(&mut g, state, node, class, &mut got[..want]) };
    drop(g);
    if n == 0 {
        return ptr::null_mut();
    }
    // Onto this CPU's row only: a thread moved since it chose the home
    // gives the rest back (its row holds its node's blocks alone).
    for &p in got[1..n].iter().rev() {
        // SAFETY: blocks just taken from the home heap, ours to keep or give back.
        unsafe {
            if !c.stacks.push_upto_on_row(cpu, class, NonNull::new_unchecked(p), usize::from(c.depth[class])) {
                give_back(p);
            }
        }
    }
    got[0]
}

/// The node whose blocks row `row`'s stacks hold: its CPU's, by the
/// topology, as the arenas name it (the calling thread's where the
/// topology does not know the CPU).
fn row_node(state: &State, row: usize) -> usize {
    match state.topology.node_of_cpu(row) {
        Some(n) => state.home_arena(n).node,
        None => state.current_arena().node,
    }
}

/// [`free`]'s common case, taken where it needs no call: one memory
/// node, the block's class cached and its page's owner served, and the
/// calling CPU's stack of the class with room. False in every other case,
/// which [`free`] then decides (trying the push again, once a batch).
///
/// # Safety
/// As [`free`].
#[inline(always)]
pub(crate) unsafe fn push_free(page: *mut Page, p: *mut u8) -> bool {
    let Some(c) = get() else { return false };
    // SAFETY: a live block's page (the caller's word); a class `class_taken`
    // gave is below `c.classes`; `p` is not null (a live block).
    unsafe { !c.multi && c.class_taken(page).is_some_and(|class| c.push_here(class, NonNull::new_unchecked(p))) }
}

/// Frees `p`, a live block of `page`, into the calling CPU's stack if the
/// caches hold its class and its page's owner is one they serve, and it is
/// of the node the thread runs on; false (nothing done) otherwise. A full
/// stack first gives half its depth back to the blocks' pages.
///
/// # Safety
/// `p` is a live block of `page`, given up to this call.
#[inline(always)]
pub(crate) unsafe fn free(page: *mut Page, p: *mut u8) -> bool {
    let Some(c) = get() else { return false };
    // SAFETY: a live block's page (the caller's word).
    let Some(class) = (unsafe { c.class_taken(page) }) else { return false };
    // SAFETY: `p` is not null (a live block).
    let p = unsafe { NonNull::new_unchecked(p) };
    if !c.multi {
        // SAFETY: `class_taken` gave a class below `c.classes`.
        return unsafe { c.push_here(class, p) } || flush_and_push(c, class, p, None);
    }
    // With an arena per node, onto the row of a CPU of the block's node
    // alone: the row chosen, the push checks the thread still runs there.
    let Some(row) = c.stacks.cpu_row() else { return false };
    // SAFETY: as above.
    if !on_node(row, unsafe { usize::from((*page).info.node) }) {
        return false;
    }
    c.stacks.push_upto_on_row(row, class, p, usize::from(c.depth[class])) || flush_and_push(c, class, p, Some(row))
}

/// Whether row `row` holds `node`'s blocks, where the allocator has an
/// arena per node (else every row holds the one arena's).
#[inline(never)]
fn on_node(row: usize, node: usize) -> bool {
    match State::try_get() {
        Some(s) => s.mode != Mode::PerNode || row_node(s, row) == node,
        None => false,
    }
}

/// [`free`]'s push onto a full stack: half its depth given back to the
/// blocks' pages first, then `p` pushed (onto `row` alone, if given;
/// false if the stack is full again, closed, or the thread left `row`).
#[cold]
#[inline(never)]
fn flush_and_push(c: &CpuCache, class: usize, p: NonNull<u8>, row: Option<usize>) -> bool {
    if row.is_some() && c.stacks.cpu_row() != row {
        // The push failed because the thread moved, not for a full stack:
        // the new CPU's row keeps its blocks.
        return false;
    }
    for _ in 0..c.batch(class) {
        match c.stacks.pop_on_cpu(class) {
            // SAFETY: a block the stacks held: live for its page, ours to give back.
            Some(q) => unsafe { give_back(q.as_ptr()) },
            None => break,
        }
    }
    let depth = usize::from(c.depth[class]);
    match row {
        Some(row) => c.stacks.push_upto_on_row(row, class, p, depth),
        None => c.stacks.push_upto_on_cpu(class, p, depth),
    }
}

/// Gives `p`, a block the caches held (in use for its page), back to its
/// page: a remote free (the page's owner collects it).
///
/// # Safety
/// `p` is a block of a small segment's page, in use for it and unused.
unsafe fn give_back(p: *mut u8) {
    // SAFETY: `p` is a block of a live small segment's page (the caller's word).
    unsafe {
        let seg = segment_of(p).cast::<SmallSegment>();
        free_remote_unarmed(segment::page_of(seg, p), p.cast::<Block>());
    }
}

/// Takes every CPU's cached blocks back to their pages (a trim): each row
/// closed and fenced while it is emptied (`CpuStacks::drain_row`); a row
/// another thread is draining, or one the fence failed on, is passed over.
pub(crate) fn drain() {
    let Some(c) = get() else { return };
    for row in 0..c.stacks.rows() {
        // SAFETY: every pointer in the stacks is a block in use for its page
        // and unused (put there by `refill` or `free`).
        let _ = c.stacks.drain_row(row, |_, p| unsafe { give_back(p.as_ptr()) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the docs state of the caches' bounds (ARCHITECTURE.md,
    /// `Config::cpu_cache`): 36 classes, up to 2 KiB, at most 746 KiB of
    /// free blocks a CPU, each class's stack 2 to 128 deep and within 32 KiB
    /// (but the 2-block floor), every refill at least one block.
    #[test]
    fn the_bounds_the_docs_state() {
        let classes = size_class::class_of(MAX_BLOCK) + 1;
        assert_eq!(classes, 36);
        assert_eq!(size_class::class_size(classes - 1), MAX_BLOCK);
        let mut total = 0;
        for c in 0..classes {
            let (size, d) = (size_class::class_size(c), depth_of(size_class::class_size(c)));
            assert!((2..=DEPTH).contains(&d));
            assert!(d * size <= CLASS_BYTES.max(2 * size));
            assert!(d.div_ceil(2) >= 1 && d.div_ceil(2) <= DEPTH.div_ceil(2));
            total += d * size;
        }
        assert_eq!(total / 1024, 746);
    }
}
