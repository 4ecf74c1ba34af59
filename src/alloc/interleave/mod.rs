//! Interleaves applied to [`NumaAlloc`](crate::NumaAlloc): the machinery that
//! places blocks turn by turn.
//!
//! - A [`ThreadInterleaver`] serves one thread's interleave (a `with_policy`
//!   guard's, or the thread's copy of a process default). Blocks of a page
//!   and more follow its cursor exactly: each comes from its node's region
//!   (`space.rs`), a turn's blocks back to back. The rest of a turn is served
//!   from the [`Window`](window) without picking, and handed to the heap's
//!   fast path as a [`Pool`](pool); what the thread frees comes back to the
//!   pool or the region's reuse lists. Smaller blocks are placed page by
//!   page: [`page_node`](ThreadInterleaver::page_node) names the node of each
//!   fresh heap page (`placement.rs`).
//! - A [`SharedInterleaver`] serves an interleave handle: every block picks
//!   (one atomic read-modify-write on the shared cursor) and is carved under
//!   its node's lock.
//!
//! Nothing here is on the allocator's fast path; the heap sees only a lent
//! page.

mod pool;
mod space;
mod window;

use core::cell::{Cell, UnsafeCell};
use core::ptr;

use super::engine::heap::{self, Heap};
use super::engine::size_class::{PAGE_CLASS, class_size};
use super::engine::types::{Block, Segment, State};
use super::region::{NodeRegion, REGION_ALIGN_MAX, REGION_MAX, UNIT, units_for};
use crate::os::mem::Huge;
use crate::policy::{Cursor, Granularity, Interleave, Pick};
use crate::topology::Topology;
use space::ThreadSpace;
pub(crate) use space::{SharedSpace, lock_spaces_for_fork, unlock_spaces_after_fork};

/// Where the turns of an interleave start: a page, or 2 MiB for byte turns
/// of 2 MiB or more over several nodes where huge pages may back the
/// regions (hugetlb or THP asked, or THP in `always` mode): a 2 MiB turn in
/// one huge page is one physical run. On base pages the alignment buys no
/// contiguity and costs room (a 4 MiB region, its header in its first
/// unit, has one 2 MiB-aligned start), so turns start on any page.
fn turn_align(i: &Interleave, huge: Huge) -> usize {
    match i.granularity() {
        Granularity::Bytes(b)
            if b >= 2 << 20 && i.nodes().len() > 1 && (huge != Huge::Off || crate::os::mem::thp_always()) =>
        {
            2 << 20
        }
        _ => crate::os::page_size(),
    }
}

/// The pages backing an interleave's regions: the policy's, else the
/// process's.
fn regions_huge(i: &Interleave, state: &State) -> Huge {
    i.huge_pages().unwrap_or(state.config.huge)
}

/// A thread's interleave; see the module docs.
pub(crate) struct ThreadInterleaver {
    /// In a cell: replaced when `auto` weights change (see `follow`).
    cursor: UnsafeCell<Cursor>,
    /// The rotation of fresh heap pages for blocks under a page: the same
    /// nodes and weights, a turn of a page (`Count`) or of the policy's
    /// bytes, at least a page (`Bytes`).
    pages: UnsafeCell<Cursor>,
    space: ThreadSpace,
    window: window::Window,
    pool: pool::Pool,
    /// `weights=auto`: the policy, and the node each cursor's weights were
    /// derived for.
    auto: Option<AutoState>,
}

/// A thread interleaver's `weights=auto` state.
struct AutoState {
    policy: Interleave,
    topology: &'static Topology,
    cursor_from: Cell<usize>,
    pages_from: Cell<usize>,
}

/// The interleave a thread's cursor places by (its weights resolved for
/// `node` where they are `auto`), and the one its page rotation does.
fn cursors_for(i: &Interleave, topology: &Topology, node: usize) -> (Interleave, Interleave) {
    let (i, _) = i.weights_for(topology, node);
    let per_page = match i.granularity() {
        Granularity::Count(_) => Granularity::Bytes(1),
        Granularity::Bytes(b) => Granularity::Bytes(b),
    };
    let pages = i.with_granularity(per_page).unwrap_or(i);
    (i, pages)
}

impl ThreadInterleaver {
    /// Writes a thread interleaver for `i` at `at` (its address is its
    /// regions' owner mark, so it must not move).
    ///
    /// # Safety
    /// `at` is valid for writes of a `ThreadInterleaver`, suitably aligned,
    /// and holds nothing that needs dropping.
    pub(crate) unsafe fn write(at: *mut ThreadInterleaver, i: &Interleave, state: &'static State) {
        let huge = regions_huge(i, state);
        let topology = state.topology;
        let node = if i.has_auto_weights() { topology.current_node() } else { 0 };
        let (placed, pages) = cursors_for(i, topology, node);
        let auto = i.has_auto_weights().then(|| AutoState {
            policy: *i,
            topology,
            cursor_from: Cell::new(node),
            pages_from: Cell::new(node),
        });
        // SAFETY: `at` is valid for writes of a `ThreadInterleaver`, aligned,
        // and holds nothing that needs dropping (the caller's word).
        unsafe {
            at.write(Self {
                cursor: UnsafeCell::new(Cursor::new(&placed)),
                pages: UnsafeCell::new(Cursor::new(&pages)),
                space: ThreadSpace::new(turn_align(i, huge), huge),
                window: window::Window::new(matches!(i.granularity(), Granularity::Count(_))),
                pool: pool::Pool::new(),
                auto,
            });
            (*at).space.set_owner(at as usize);
        }
    }

    /// The placing cursor.
    #[inline(always)]
    fn cursor(&self) -> &Cursor {
        // SAFETY: the cursor is replaced only by `follow`, on the
        // interleaver's own thread, when no reference to it is live (every
        // use below is a call that returns before `follow` can run).
        unsafe { &*self.cursor.get() }
    }

    /// The page rotation's cursor.
    #[inline(always)]
    fn pages(&self) -> &Cursor {
        // SAFETY: as for `cursor`.
        unsafe { &*self.pages.get() }
    }

    /// `weights=auto`: where the thread now runs on another node than the
    /// one a cursor's weights were derived for, that cursor is replaced by
    /// one with the new node's weights, numbering its turns after the old
    /// one's (the turn in progress ends here). `placing`: the placing
    /// cursor too, not only the page rotation.
    ///
    /// # Safety
    /// Exclusive, as [`window_alloc`](Self::window_alloc); with `placing`,
    /// the window closed and booked and no pool open.
    #[inline(always)]
    unsafe fn follow(&self, placing: bool) {
        let Some(a) = &self.auto else { return };
        let node = a.topology.current_node();
        if a.pages_from.get() == node && (!placing || a.cursor_from.get() == node) {
            return;
        }
        // SAFETY: the caller's word, passed on.
        unsafe { self.follow_to(a, node, placing) }
    }

    /// [`follow`](Self::follow)'s replacement of the cursors for `node`.
    /// Out of line: a cursor is 3 KiB, and a frame that builds one (every
    /// caller's, inlined) made each allocator slow path that might reach
    /// it touch two more pages of its thread's stack (the stack probes):
    /// 8 KiB of every thread's RSS.
    ///
    /// # Safety
    /// As [`follow`](Self::follow).
    #[cold]
    #[inline(never)]
    unsafe fn follow_to(&self, a: &AutoState, node: usize, placing: bool) {
        let (i, pages) = cursors_for(&a.policy, a.topology, node);
        if a.pages_from.get() != node {
            a.pages_from.set(node);
            // SAFETY: exclusive (the caller's word): no reference to the
            // page cursor is live; the next base is read before it goes.
            unsafe {
                let base = self.pages().next_turn_base_exclusive();
                *self.pages.get() = Cursor::new_after(&pages, base);
            }
        }
        if placing && a.cursor_from.get() != node {
            a.cursor_from.set(node);
            // SAFETY: as above; the window is booked and closed and no pool
            // is open (the caller's word), so nothing holds part of a turn.
            unsafe {
                let base = self.cursor().next_turn_base_exclusive();
                *self.cursor.get() = Cursor::new_after(&i, base);
            }
        }
    }

    /// The node of the next fresh heap page (`bytes` long) for blocks under
    /// a page.
    pub(crate) fn page_node(&self, bytes: usize) -> usize {
        // SAFETY: a thread interleaver is used by its thread only.
        unsafe {
            self.follow(false);
            self.pages().pick_exclusive(bytes).node
        }
    }

    /// The node of a block this interleaver does not carve (larger than a
    /// region serves), picked in turn like the others.
    pub(crate) fn pick_node(&self, size: usize) -> usize {
        // SAFETY: a thread interleaver is used by its thread only; the pool
        // and the window are booked before the cursor moves.
        unsafe {
            self.reclaim(heap::current());
            self.close_window();
            self.follow(true);
            self.cursor().pick_exclusive(size).node
        }
    }

    /// A block of `size` bytes aligned to `align` (a region serves it:
    /// `size <= REGION_MAX`, `align <= REGION_ALIGN_MAX`) on the node the
    /// cursor picks. Null when the node has no memory.
    pub(crate) fn alloc_block(&self, size: usize, align: usize) -> *mut u8 {
        debug_assert!(size <= REGION_MAX && align <= REGION_ALIGN_MAX);
        // SAFETY: a thread interleaver is used by its thread only.
        unsafe {
            self.reclaim(heap::current());
            if let Some(p) = self.window_alloc(size, align) {
                return p;
            }
            self.alloc_picked(size, align)
        }
    }

    /// A block of size class `class` (a page or more) for `heap`, whose
    /// direct slot for the class ran dry: the first of a turn (or of a
    /// pool), the rest of the turn's allocations of the class put on the
    /// pool for the heap's fast path.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap, and this interleaver the one in
    /// force on the thread.
    #[inline(never)]
    pub(crate) unsafe fn alloc_class(&self, heap: *mut Heap, class: usize) -> *mut u8 {
        debug_assert!(class >= PAGE_CLASS);
        // SAFETY: `heap` is the calling thread's heap and this interleaver the
        // thread's (the caller's word): the pool, window and cursor are this
        // thread's to use.
        unsafe {
            self.reclaim(heap);
            if (self.window.is_open() || self.open_turn()) && self.fill(heap, class) {
                // The pool serves this allocation too.
                let p = Heap::pop(heap, class);
                debug_assert!(!p.is_null());
                return p;
            }
            // No region for the node yet, or it is full: pick, and let the
            // space map one.
            let p = self.alloc_picked(class_size(class), UNIT);
            if !p.is_null() {
                self.fill(heap, class);
            }
            p
        }
    }

    /// The owning thread frees `p`, a block of its region `r`: back on the
    /// pool while the turn has room for it, else onto the region's reuse
    /// lists.
    ///
    /// # Safety
    /// Called on the interleaver's thread; `r` is one of its space's regions
    /// (owned by it) and `p` a live block of `r`, given up.
    pub(crate) unsafe fn free_own(&self, r: &NodeRegion, p: *mut u8) {
        let units = r.block_size(p) / UNIT;
        debug_assert!(units > 0, "free of a pointer that is no region block");
        // SAFETY: on the interleaver's thread, `r` one of its space's regions
        // owned by it and `p` a live block of `r` given up (the caller's word):
        // what `put_back` and `owner_free` ask.
        unsafe {
            if !self.pool.put_back(r as *const NodeRegion as *mut NodeRegion, p, units) {
                r.owner_free(p, units);
            }
        }
    }

    /// The rest of the turn in progress, at its node's region: a block the
    /// thread freed, or carved at the top.
    ///
    /// # Safety
    /// Exclusive: called by the interleaver's thread; no pool open.
    #[inline(always)]
    unsafe fn window_alloc(&self, size: usize, align: usize) -> Option<*mut u8> {
        if !self.window.is_open() {
            return None;
        }
        let (_, r) = self.window.turn();
        // SAFETY: the window's region is the space's current one for its
        // node, carved (and its lists used) by this thread only.
        let reg = unsafe { &*r };
        let credit = reg.credit();
        if credit == 0 {
            return None;
        }
        let (units, align) = (units_for(size), align.max(UNIT));
        // SAFETY: as above.
        let p = match unsafe { reg.pop_reuse(units, align) } {
            Some(p) => p,
            None => {
                let first = self.window.first_align(align / UNIT, self.space.turn_units());
                // SAFETY: as above.
                let (n, p) = unsafe { reg.carve_run(units, 1, first) };
                if n == 0 {
                    return None;
                }
                // SAFETY: as above.
                unsafe { self.window.carved() };
                p
            }
        };
        reg.set_credit(credit - 1);
        self.window.serve(1, size);
        Some(p)
    }

    /// Opens the window on the turn in progress with nothing served yet: the
    /// allocation that needs it is served from the window too, so a turn
    /// change costs no pick. False when the node has no current region (the
    /// caller then picks, and the space maps one).
    ///
    /// # Safety
    /// Exclusive, as [`window_alloc`](Self::window_alloc).
    #[inline(always)]
    unsafe fn open_turn(&self) -> bool {
        // SAFETY: the caller has the interleaver exclusively (on its thread, no
        // pool open), as `close_window` and `pick_exclusive` ask.
        let (pick, left) = unsafe {
            self.close_window();
            self.follow(true);
            self.cursor().turn_exclusive()
        };
        let r = self.space.region(pick.node);
        if r.is_null() {
            return false;
        }
        // SAFETY: the node's current region, ours.
        let fresh = unsafe { (*r).last_turn() } != pick.turn;
        self.window.open(r, pick, left, fresh);
        true
    }

    /// Books the window into the cursor, and closes it.
    ///
    /// # Safety
    /// Exclusive, as [`window_alloc`](Self::window_alloc); no pool is open
    /// ([`reclaim`](Self::reclaim) first).
    #[inline(always)]
    unsafe fn close_window(&self) {
        debug_assert_eq!(self.pool.filled.get(), 0);
        if let Some((served, bytes)) = self.window.close() {
            // SAFETY: exclusive use of the interleaver (the caller's word), so
            // of its cursor.
            unsafe { self.cursor().settle_exclusive(served, bytes) };
        }
    }

    /// An allocation that picks: the first of a turn, or one that does not
    /// fit the window's region. Opens a window on the rest of the turn.
    ///
    /// # Safety
    /// Exclusive, as [`window_alloc`](Self::window_alloc); no pool is open.
    #[inline(never)]
    unsafe fn alloc_picked(&self, size: usize, align: usize) -> *mut u8 {
        // SAFETY: exclusive use of the interleaver with no pool open (the
        // caller's word), as `close_window` and `pick_exclusive` ask.
        let pick = unsafe {
            self.close_window();
            self.follow(true);
            self.cursor().pick_exclusive(size)
        };
        let p = self.space.alloc(pick.node, size, align, pick.turn);
        // SAFETY: as above.
        let left = unsafe { self.cursor().turn_left_exclusive(pick) };
        let r = self.space.region(pick.node);
        if !p.is_null() && left > 0 && !r.is_null() {
            // The space carved the turn's first block.
            self.window.open(r, pick, left, false);
        }
        p
    }

    /// Opens the pool on what is left of the window's turn for size class
    /// `class` and lends it to the heap as the class's direct page.
    ///
    /// # Safety
    /// As [`alloc_class`](Self::alloc_class); no pool is open.
    #[inline(always)]
    unsafe fn fill(&self, heap: *mut Heap, class: usize) -> bool {
        let (w, pl) = (&self.window, &self.pool);
        let size = class_size(class);
        let left = w.allocations_left(size).min(u32::MAX as u64) as usize;
        if left == 0 {
            // Closed: the turn ended with the allocation that picked.
            return false;
        }
        let (_, r) = w.turn();
        // SAFETY: an open window's region, carved and listed by this thread only.
        let credit = unsafe { (*r).credit() };
        // The turn's allowance: blocks on the page plus frees put back.
        let k = left.min(credit);
        if k == 0 {
            return false;
        }
        let units = units_for(size);
        // SAFETY: the window's region, carved and listed by this thread only.
        unsafe {
            let (list, n) = match (*r).pop_reuse(units, UNIT) {
                Some(b) => {
                    let b = b.cast::<Block>();
                    (*b).next = ptr::null_mut();
                    pl.carved.set(false);
                    (b, 1)
                }
                None => {
                    let stride = units * UNIT;
                    let want = pl.hint.get().min((pool::FILL_CARVE_BYTES / stride).max(1));
                    let top0 = (*r).top();
                    let (n, first) = (*r).carve_run(units, k.min(want), w.first_align(1, self.space.turn_units()));
                    if n == 0 {
                        return false;
                    }
                    for i in 0..n {
                        let b = first.add(i * stride).cast::<Block>();
                        (*b).next = if i + 1 < n { first.add((i + 1) * stride).cast() } else { ptr::null_mut() };
                    }
                    w.carved();
                    pl.carved.set(true);
                    pl.stride.set(stride);
                    pl.top0.set(top0);
                    (first.cast(), n)
                }
            };
            // Booked as if all were taken; `reclaim` settles what was.
            (*r).set_credit(credit - n);
            w.serve(n as i64, size);
            pl.open(r, list, n, units, size, k - n);
            Heap::lend(heap, class, pl.page());
        }
        true
    }

    /// Takes the pool back from the heap and books what the fast path took.
    /// Blocks still on the page go back where they came from: carved ones by
    /// moving the region's top back when nothing was put back on the page (a
    /// turn of mixed sizes stays back to back), else onto the reuse lists.
    ///
    /// # Safety
    /// Exclusive, as [`window_alloc`](Self::window_alloc); `heap` is the
    /// calling thread's heap (or null, after its thread-exit release).
    #[inline(always)]
    unsafe fn reclaim(&self, heap: *mut Heap) {
        let pl = &self.pool;
        let n = pl.filled.get();
        if n == 0 {
            return;
        }
        // SAFETY: we run on the interleaver's thread (the caller's word): the pool, its
        // region and its lists are this thread's, and `heap`, if not null, is its heap,
        // whose only loan is the pool's.
        unsafe {
            if !heap.is_null() {
                Heap::end_loan(heap);
            }
            let (taken, put_back, rest_list) = pl.close();
            let units = pl.units.get();
            let size = (*pl.page()).info.block_size as usize;
            // References: `n` were charged at the fill; a block put back and
            // taken again is the same reference (its free was not counted
            // either), so what the pool holds now goes back to the credit.
            let rest = n + put_back - taken;
            let r = pl.region.get();
            (*r).set_credit((*r).credit() + rest);
            self.window.serve(taken as i64 - n as i64, size);
            let carved = pl.carved.get();
            let hint = pl.hint.get();
            pl.hint.set(if carved && taken >= n {
                (hint * 2).min(pool::FILL_CARVE_BYTES / UNIT)
            } else if carved {
                taken.max(1)
            } else {
                hint
            });
            if rest == 0 {
                return;
            }
            if carved && put_back == 0 {
                // The last `rest` blocks carved, never handed out.
                let top = if rest == n { pl.top0.get() } else { rest_list as usize };
                (*r).uncarve(rest_list.cast(), rest, units, top);
            } else {
                let mut tail = rest_list;
                while !(*tail).next.is_null() {
                    tail = (*tail).next;
                }
                (*r).file_free(rest_list, tail, units);
            }
        }
    }
}

impl Drop for ThreadInterleaver {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: nobody else uses it. The space's credit must
        // be settled before it retires its regions (when `space` drops).
        unsafe {
            self.reclaim(heap::current());
            self.close_window();
        }
    }
}

/// An interleave handle's machinery; see the module docs.
pub(crate) struct SharedInterleaver {
    pub(crate) cursor: Cursor,
    pub(crate) space: SharedSpace,
}

impl SharedInterleaver {
    /// A handle's interleaver, boxed (its space listed for the `fork()`
    /// handlers at the address it keeps).
    pub(crate) fn boxed(i: &Interleave, state: &State) -> Box<Self> {
        let huge = regions_huge(i, state);
        // `weights=auto`: the weights of the node of the thread making it.
        let (placed, _) = i.weights_for(state.topology, state.topology.current_node());
        let il = Box::new(Self { cursor: Cursor::new(&placed), space: SharedSpace::new(turn_align(i, huge), huge) });
        il.space.list_for_fork();
        il
    }
}

/// Frees `p`, a block of region `seg`: the calling thread's own interleaver
/// (`il`, the one in force on it, or null) takes back blocks of its regions;
/// any other block goes back to its region's bitmap.
///
/// # Safety
/// `p` is a live block of region `seg`, given up by the caller; `il` is the
/// calling thread's interleaver in force (or null).
#[inline]
pub(crate) unsafe fn free(seg: *mut Segment, p: *mut u8, il: *const ThreadInterleaver) {
    // SAFETY: `p` is a live block of region `seg` (the caller's word) and holds a
    // reference to it, so the region's header is live.
    let r = unsafe { &*seg.cast::<NodeRegion>() };
    if r.owned_by(il as usize) {
        // SAFETY: owned by `il`, which is this thread's.
        unsafe { (*il).free_own(r, p) };
    } else {
        // SAFETY: `p` is a live block of the live region `seg` (the caller's
        // word), freed by a thread that does not own the region: `free_shared`
        // is for those.
        unsafe { super::region::free_shared(seg, p) };
    }
}

/// Whether a block of `size` bytes aligned to `align` may come from a region.
#[inline]
pub(crate) fn region_serves(size: usize, align: usize) -> bool {
    size <= REGION_MAX && align <= REGION_ALIGN_MAX
}

/// A block for an interleave handle, on the node its cursor picked: a region
/// block (a page and more), a heap block (`small`: smaller blocks, from the
/// calling thread's heap pages of that node), or a huge mapping.
pub(crate) fn handle_alloc(
    il: &SharedInterleaver,
    state: &State,
    size: usize,
    align: usize,
    small: impl FnOnce(usize) -> Option<*mut u8>,
) -> *mut u8 {
    let pick: Pick = il.cursor.pick(size);
    if let Some(p) = small(pick.node) {
        return p;
    }
    if region_serves(size, align) {
        il.space.alloc(pick.node, size, align, pick.turn)
    } else {
        super::huge::alloc_on(state, pick.node, size, align, false)
    }
}
