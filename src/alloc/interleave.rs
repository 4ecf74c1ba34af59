//! An interleave applied to [`NumaAlloc`](super::NumaAlloc): the
//! [`Interleaver`] that a policy in force (a `with_policy` guard's, a
//! thread's copy of the process default, a handle's) places blocks with.
//!
//! Its cursor picks the node and a bump region of that node (see
//! `region.rs`) supplies the block. A handle's interleaver is shared by the
//! threads using the handle: every allocation picks (one atomic
//! read-modify-write) and carves under the node's lock. A thread's own
//! interleaver (exclusive) does neither: it serves the rest of a turn from a
//! [`Window`] on the turn's region, hands it to the heap's fast path as a
//! [`Pool`], and takes back what its thread frees.

use core::cell::UnsafeCell;

use super::region::{
    GRAIN, REGION_ALIGN_MAX, REGION_MAX, Region, Space, book, class_key, close_pool, exclusive_layout, give_back_reuse,
    open_pool, pop_reuse, top_addr, unbook, up,
};
use super::segment::{Block, Page, SEGMENT_SIZE};
use super::size_class::class_size;
use super::state::State;
use crate::policy::{Cursor, Granularity, Interleave, Pick};
use crate::sync::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// An interleave in force: its cursor and the regions it carves from.
pub(crate) struct Interleaver {
    pub(crate) cursor: Cursor,
    pub(crate) space: Space,
    /// Used by one thread only (a scoped policy's): the cursor and the
    /// carving skip their atomic read-modify-writes, and the rest of each
    /// turn is served from `window`.
    exclusive: bool,
    count: bool,
    page: usize,
    window: Window,
}

/// An exclusive interleave's turn in progress, served without picking: the
/// turn's node and region (carved, and its credit spent, in place) and what
/// is left of the turn, booked into the cursor (`close_window`) before any
/// other use of it. Plain loads and stores: one thread only.
struct Window {
    /// `Count`: allocations left in the turn (0: closed). `Bytes`: bytes
    /// served since the window opened (closed once it reaches `b`).
    a: AtomicU64,
    /// `Count`: allocations left when it opened. `Bytes`: the bytes the turn
    /// had left then (0: closed).
    b: AtomicU64,
    /// The turn's node and that node's current region in the space (whose
    /// top and credit the window carves and spends in place).
    region: AtomicPtr<Region>,
    node: AtomicUsize,
    /// The turn, and whether none of its blocks was carved yet (its first
    /// one starts on the space's turn alignment).
    turn: AtomicU64,
    fresh: AtomicBool,
    pool: Pool,
}

/// The window's turn handed to the heap's fast path, for one size class: a
/// page descriptor that the thread's heap uses as the class's direct page,
/// holding a few blocks (one reused block, or a run carved at the window's
/// top), and an allowance for the rest of the turn: the thread's frees of
/// blocks of that size go straight back on it (see `region::free`) until
/// the turn's allocations are used up. A thread that allocates and frees a
/// buffer in a loop then cycles one warm block through the fast path, and a
/// turn still ends at its exact count (or bytes): the page never holds more
/// blocks than the turn has allocations left.
///
/// What the fast path took is booked into the window when the pool is
/// taken back ([`Interleaver::reclaim`]), before the window, the cursor or
/// the space is used for anything else.
struct Pool {
    page: PoolPage,
    /// Blocks put on the page at the fill (0: no pool).
    filled: AtomicUsize,
    /// The free budget given to the region at the fill.
    budget: AtomicUsize,
    /// The page's `used` at the fill: the fast path counts what it takes.
    used0: AtomicU32,
    /// The size class served (its reuse key: `class_key`).
    class: AtomicUsize,
    /// Whether the filled blocks were carved (`stride` bytes apart, the
    /// window's top `top0` before) or one reused block.
    carved: AtomicBool,
    stride: AtomicUsize,
    top0: AtomicUsize,
    /// How many blocks to carve at the next fill: doubled when a pool is
    /// used up, down to what was taken when it is not (a stream of mixed
    /// sizes switches class at every allocation: carving ahead would be
    /// undone each time).
    hint: AtomicUsize,
}

/// Most bytes carved for a pool at once (carving writes each block's first
/// word).
const FILL_CARVE_BYTES: usize = 64 * 1024;

#[repr(transparent)]
struct PoolPage(UnsafeCell<Page>);
// SAFETY: only an exclusive interleaver fills its pool, and an exclusive
// interleaver is used by the one thread whose policy it is (the page is
// that thread's heap's direct page, read by its fast path only).
unsafe impl Sync for PoolPage {}
// SAFETY: the page's pointers are to region blocks and heap-free memory
// that any thread may touch; an exclusive interleaver (the only one whose
// pool is ever filled) is owned by a `!Send` guard, and a shared one's pool
// stays empty.
unsafe impl Send for PoolPage {}

impl Interleaver {
    /// For a thread-scoped policy: only the thread that installs it uses it.
    pub(crate) fn exclusive(i: &Interleave) -> Self {
        let mut il = Self::new(i);
        il.exclusive = true;
        il.space.exclusive = true;
        il
    }

    /// Where the next block of `size` bytes goes.
    #[inline]
    pub(crate) fn pick(&self, size: usize) -> crate::policy::Pick {
        if self.exclusive {
            // SAFETY: an exclusive interleaver is reachable from one thread's
            // policy slot only. The window is booked first: the cursor then
            // stands where the window left it.
            unsafe {
                self.reclaim(super::heap::current());
                self.close_window();
                self.cursor.pick_exclusive(size)
            }
        } else {
            self.cursor.pick(size)
        }
    }

    /// A block of `size` bytes aligned to `align` on the node the cursor
    /// picks: from that node's region, or (large or very aligned blocks) a
    /// huge mapping of its own. Null when the node cannot supply it.
    #[inline]
    pub(crate) fn alloc_block(&self, size: usize, align: usize) -> *mut u8 {
        let small = size <= REGION_MAX && align <= REGION_ALIGN_MAX;
        if self.exclusive {
            // SAFETY: an exclusive interleaver is used by one thread.
            unsafe { self.reclaim(super::heap::current()) };
            if small {
                // SAFETY: as above.
                if let Some(p) = unsafe { self.window_alloc(size, align) } {
                    return p;
                }
            }
            // SAFETY: as above.
            return unsafe { self.alloc_exclusive(size, align, small) };
        }
        let pick = self.cursor.pick(size);
        if small { self.space.alloc(pick.node, size, align, pick.turn) } else { self.huge(pick, size, align) }
    }

    fn huge(&self, pick: Pick, size: usize, align: usize) -> *mut u8 {
        match State::try_get() {
            Some(state) => super::huge::alloc_on(state, pick.node, size, align, false),
            None => core::ptr::null_mut(),
        }
    }

    /// The rest of the turn in progress, at the top of its node's region.
    ///
    /// # Safety
    /// Exclusive: called by the one thread that uses this interleaver.
    #[inline(always)]
    unsafe fn window_alloc(&self, size: usize, align: usize) -> Option<*mut u8> {
        if !self.window_open() {
            return None;
        }
        let w = &self.window;
        let node = w.node.load(Ordering::Relaxed);
        let credit = self.space.credit(node);
        if credit == 0 {
            return None;
        }
        let (key, bsize, align) = exclusive_layout(size, align, self.page);
        let r = w.region.load(Ordering::Relaxed);
        // SAFETY: the window's region is the space's current one for its
        // node, carved (and its lists used) by this thread only.
        let p = match unsafe { pop_reuse(r, key, align) } {
            Some(p) => p,
            None => {
                // SAFETY: as above.
                let start = up(unsafe { top_addr(r) }, self.first_align(align));
                let end = start + bsize;
                if end > r as usize + SEGMENT_SIZE {
                    return None;
                }
                // SAFETY: as above; `start..end` was free at its top.
                unsafe {
                    book(r, start, end);
                    self.carved_in_turn(r);
                }
                start as *mut u8
            }
        };
        self.space.set_credit(node, credit - 1);
        let a = w.a.load(Ordering::Relaxed);
        w.a.store(if self.count { a - 1 } else { a + size as u64 }, Ordering::Relaxed);
        Some(p)
    }

    /// Whether the window has some of its turn left (a byte turn ends at
    /// the allocation that reaches its budget).
    #[inline(always)]
    fn window_open(&self) -> bool {
        let a = self.window.a.load(Ordering::Relaxed);
        if self.count { a != 0 } else { a < self.window.b.load(Ordering::Relaxed) }
    }

    /// The alignment of the next block carved in the window: the turn's
    /// first starts on the space's turn alignment.
    #[inline(always)]
    fn first_align(&self, align: usize) -> usize {
        if self.window.fresh.load(Ordering::Relaxed) { align.max(self.space.turn_align()) } else { align }
    }

    /// A block of the window's turn was carved in `r`.
    ///
    /// # Safety
    /// Exclusive, as [`window_alloc`](Self::window_alloc); `r` is the
    /// window's region.
    #[inline(always)]
    unsafe fn carved_in_turn(&self, r: *mut Region) {
        let w = &self.window;
        if w.fresh.load(Ordering::Relaxed) {
            w.fresh.store(false, Ordering::Relaxed);
            // SAFETY: per the contract.
            unsafe { super::region::set_last_turn(r, w.turn.load(Ordering::Relaxed)) };
        }
    }

    /// Opens the window on the turn in progress with nothing served yet:
    /// the allocation that needs it is served from the window too, so a
    /// turn change costs no pick. False when the node has no current region
    /// (the caller then picks, and the space maps one).
    ///
    /// # Safety
    /// Exclusive, as [`window_alloc`](Self::window_alloc); no pool is open.
    #[inline(always)]
    unsafe fn open_turn(&self) -> bool {
        // SAFETY: per the contract.
        let (pick, left) = unsafe {
            self.close_window();
            self.cursor.turn_exclusive()
        };
        let r = self.space.current_region(pick.node);
        if r.is_null() {
            return false;
        }
        // SAFETY: the node's current region, ours.
        let fresh = unsafe { super::region::last_turn(r) } != pick.turn;
        self.open_window(r, pick, left, fresh);
        true
    }

    /// Opens the window on `left` of turn `pick` (allocations, or bytes), in
    /// `r`, its node's current region; `fresh`: none of the turn's blocks
    /// was carved yet.
    #[inline(always)]
    fn open_window(&self, r: *mut Region, pick: Pick, left: u64, fresh: bool) {
        let w = &self.window;
        w.region.store(r, Ordering::Relaxed);
        w.node.store(pick.node, Ordering::Relaxed);
        w.turn.store(pick.turn, Ordering::Relaxed);
        w.fresh.store(fresh, Ordering::Relaxed);
        w.a.store(if self.count { left } else { 0 }, Ordering::Relaxed);
        w.b.store(left, Ordering::Relaxed);
    }

    /// Books the window into the cursor and the space, and closes it.
    ///
    /// # Safety
    /// Exclusive, as [`window_alloc`](Self::window_alloc); no pool is open
    /// ([`reclaim`](Self::reclaim) first).
    #[inline(always)]
    unsafe fn close_window(&self) {
        debug_assert_eq!(self.window.pool.filled.load(Ordering::Relaxed), 0);
        let w = &self.window;
        let b = w.b.load(Ordering::Relaxed);
        if b == 0 {
            return;
        }
        let a = w.a.load(Ordering::Relaxed);
        let (served, bytes) = if self.count { (b - a, 0) } else { (u64::from(a > 0), a) };
        // SAFETY: per the contract.
        unsafe { self.cursor.settle_exclusive(served, bytes) };
        w.a.store(0, Ordering::Relaxed);
        w.b.store(0, Ordering::Relaxed);
    }

    /// An exclusive allocation that picks: the first of a turn, one that
    /// does not fit the window's region, or a large one. Opens a window on
    /// the rest of the turn.
    ///
    /// # Safety
    /// Exclusive, as [`window_alloc`](Self::window_alloc); no pool is open.
    #[inline(never)]
    unsafe fn alloc_exclusive(&self, size: usize, align: usize, small: bool) -> *mut u8 {
        // SAFETY: per the contract.
        unsafe { self.close_window() };
        // SAFETY: as above.
        let pick = unsafe { self.cursor.pick_exclusive(size) };
        if !small {
            return self.huge(pick, size, align);
        }
        let p = self.space.alloc(pick.node, size, align, pick.turn);
        // SAFETY: as above.
        let left = unsafe { self.cursor.turn_left_exclusive(pick) };
        if !p.is_null()
            && left > 0
            && let r = self.space.current_region(pick.node)
            && !r.is_null()
        {
            // The space carved the turn's first block.
            self.open_window(r, pick, left, false);
        }
        p
    }

    /// A block of size class `class` for the heap of the calling thread,
    /// whose direct page for the class ran dry: the first of a turn (or of a
    /// pool), with the rest of the turn's allocations of the class put on
    /// the pool for the heap's fast path (exclusive interleavers only).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap, and this interleaver the one in
    /// force on the thread.
    #[inline(never)]
    pub(crate) unsafe fn alloc_class(&self, heap: *mut super::heap::Heap, class: usize) -> *mut u8 {
        let size = class_size(class);
        if !self.exclusive {
            return self.alloc_block(size, GRAIN);
        }
        // SAFETY: exclusive: the calling thread's interleaver; `heap` is its
        // heap.
        unsafe {
            self.reclaim(heap);
            if (self.window_open() || self.open_turn()) && self.fill(heap, class) {
                // The pool serves this allocation too.
                return super::heap::Heap::alloc_class(heap, class);
            }
            // No region for the node yet, or it is full: pick, and let the
            // space map one.
            let p = self.alloc_exclusive(size, GRAIN, true);
            if !p.is_null() {
                self.fill(heap, class);
            }
            p
        }
    }

    /// Opens the pool on what is left of the window's turn for size class
    /// `class` (see [`Pool`]) and makes it the heap's direct page for the
    /// class.
    ///
    /// # Safety
    /// As [`alloc_class`](Self::alloc_class); no pool is open.
    #[inline(always)]
    unsafe fn fill(&self, heap: *mut super::heap::Heap, class: usize) -> bool {
        let (w, pl) = (&self.window, &self.window.pool);
        let size = class_size(class);
        let a = w.a.load(Ordering::Relaxed);
        let left = if self.count {
            a
        } else {
            // Allocations until the turn's bytes are reached (none: closed).
            w.b.load(Ordering::Relaxed).saturating_sub(a).div_ceil(size as u64)
        };
        let node = w.node.load(Ordering::Relaxed);
        let credit = self.space.credit(node);
        // The turn's allowance: blocks on the page plus frees put back.
        let k = (left.min(u32::MAX as u64) as usize).min(credit);
        if k == 0 {
            return false;
        }
        let (key, bsize) = class_key(class);
        let r = w.region.load(Ordering::Relaxed);
        let page = pl.page.0.get();
        // SAFETY: the window's region, carved and listed by this thread only.
        unsafe {
            let (list, n) = match pop_reuse(r, key, GRAIN) {
                Some(b) => {
                    let b = b.cast::<Block>();
                    (*b).next = core::ptr::null_mut();
                    pl.carved.store(false, Ordering::Relaxed);
                    (b, 1)
                }
                None => {
                    let align = if bsize >= self.page { self.page } else { GRAIN };
                    let stride = up(bsize, align);
                    let top0 = top_addr(r);
                    let first = up(top0, self.first_align(align));
                    let end = r as usize + SEGMENT_SIZE;
                    let fit = if first + bsize <= end { (end - first - bsize) / stride + 1 } else { 0 };
                    let want = pl.hint.load(Ordering::Relaxed).min((FILL_CARVE_BYTES / stride).max(1));
                    let n = k.min(fit).min(want);
                    if n == 0 {
                        return false;
                    }
                    for i in 0..n {
                        let b = first + i * stride;
                        book(r, b, b + bsize);
                        let next = if i + 1 < n { (b + stride) as *mut Block } else { core::ptr::null_mut() };
                        (*(b as *mut Block)).next = next;
                    }
                    self.carved_in_turn(r);
                    pl.carved.store(true, Ordering::Relaxed);
                    pl.stride.store(stride, Ordering::Relaxed);
                    pl.top0.store(top0, Ordering::Relaxed);
                    (first as *mut Block, n)
                }
            };
            // Booked as if all were taken; `reclaim` settles what was.
            self.space.set_credit(node, credit - n);
            w.a.store(if self.count { a - n as u64 } else { a + (n * size) as u64 }, Ordering::Relaxed);
            (*page).free = list;
            (*page).info.block_size = size as u32;
            pl.used0.store((*page).used, Ordering::Relaxed);
            pl.filled.store(n, Ordering::Relaxed);
            pl.budget.store(k - n, Ordering::Relaxed);
            pl.class.store(class, Ordering::Relaxed);
            open_pool(r, key, page, k - n);
            super::heap::hook_pool(heap, class, page);
        }
        true
    }

    /// Takes the pool back from the heap and the region, and books what
    /// the fast path took (region blocks leave the heap's counters). Blocks
    /// still on the page go back where they came from: carved ones by
    /// moving the window's top back when nothing was put back on the page
    /// (a turn of mixed sizes stays back to back), else onto the region's
    /// reuse list.
    ///
    /// # Safety
    /// Exclusive, as [`window_alloc`](Self::window_alloc); `heap` is the
    /// calling thread's heap (or null).
    #[inline(always)]
    unsafe fn reclaim(&self, heap: *mut super::heap::Heap) {
        let (w, pl) = (&self.window, &self.window.pool);
        let n = pl.filled.load(Ordering::Relaxed);
        if n == 0 {
            return;
        }
        pl.filled.store(0, Ordering::Relaxed);
        let page = pl.page.0.get();
        // The window's region: it changes only once the pool is taken back.
        let r = w.region.load(Ordering::Relaxed);
        // SAFETY: per the contract, the pool and the region's lists are this
        // thread's.
        unsafe {
            let put_back = pl.budget.load(Ordering::Relaxed) - close_pool(r);
            let taken = (*page).used.wrapping_sub(pl.used0.load(Ordering::Relaxed)) as usize;
            let size = (*page).info.block_size as usize;
            let class = pl.class.load(Ordering::Relaxed);
            super::heap::unhook_pool(heap, page, class, taken, size);
            // Settle. References: `n` were charged at the fill; a block put
            // back and taken again is the same reference (its free was not
            // counted either, see `region::free`), so what the pool holds
            // now, `rest`, goes back to the credit.
            let rest = n + put_back - taken;
            let node = w.node.load(Ordering::Relaxed);
            self.space.set_credit(node, self.space.credit(node) + rest);
            let a = w.a.load(Ordering::Relaxed) as i64;
            let d = n as i64 - taken as i64;
            w.a.store(if self.count { a + d } else { a - d * size as i64 } as u64, Ordering::Relaxed);
            let carved = pl.carved.load(Ordering::Relaxed);
            let hint = pl.hint.load(Ordering::Relaxed);
            pl.hint.store(
                if carved && taken >= n {
                    (hint * 2).min(FILL_CARVE_BYTES / GRAIN)
                } else if carved {
                    taken.max(1)
                } else {
                    hint
                },
                Ordering::Relaxed,
            );
            if rest == 0 {
                return;
            }
            let free = (*page).free;
            (*page).free = core::ptr::null_mut();
            if carved && put_back == 0 {
                // The last `rest` blocks carved, never handed out.
                let stride = pl.stride.load(Ordering::Relaxed);
                let top = if rest == n { pl.top0.load(Ordering::Relaxed) } else { free as usize };
                unbook(r, free as usize, rest, stride, top);
            } else {
                let mut tail = free;
                while !(*tail).next.is_null() {
                    tail = (*tail).next;
                }
                give_back_reuse(r, class_key(class).0, free, tail);
            }
        }
    }

    pub(crate) fn new(i: &Interleave) -> Self {
        // Byte turns of 2 MiB or more start on a 2 MiB boundary, so whole huge
        // pages belong to one node (pointless, and a gap, with one node).
        let turn_align = match i.granularity() {
            Granularity::Bytes(b) if b >= 2 << 20 && i.nodes().len() > 1 => 2 << 20,
            _ => crate::os::page_size(),
        };
        Self {
            cursor: Cursor::new(i),
            space: Space::new(turn_align),
            exclusive: false,
            count: matches!(i.granularity(), Granularity::Count(_)),
            page: crate::os::page_size(),
            window: Window {
                a: AtomicU64::new(0),
                b: AtomicU64::new(0),
                region: AtomicPtr::new(core::ptr::null_mut()),
                node: AtomicUsize::new(0),
                turn: AtomicU64::new(0),
                fresh: AtomicBool::new(false),
                pool: Pool {
                    page: PoolPage(UnsafeCell::new(Page::empty())),
                    filled: AtomicUsize::new(0),
                    budget: AtomicUsize::new(0),
                    used0: AtomicU32::new(0),
                    class: AtomicUsize::new(0),
                    carved: AtomicBool::new(false),
                    stride: AtomicUsize::new(0),
                    top0: AtomicUsize::new(0),
                    hint: AtomicUsize::new(1),
                },
            },
        }
    }
}

impl Drop for Interleaver {
    fn drop(&mut self) {
        if self.exclusive {
            // SAFETY: `&mut self`: nobody else uses it. The space's credit must
            // be settled before it retires its regions.
            unsafe {
                self.reclaim(super::heap::current());
                self.close_window();
            }
        }
    }
}
