//! Thread-local heaps: the fast paths.
//!
//! Each thread allocates through its own [`Heap`]: one "direct" page per size
//! class whose free list it pops with no atomic operation and no lock. A heap
//! refills from the arena of the node the thread runs on *now* (re-checked at
//! every refill, so a migrated thread follows its node). Blocks freed by other
//! threads come back through the pages' lock-free `thread_free` lists.
//!
//! When a thread exits, its heap gives back its empty pages and waits, whole,
//! on its node's arena for a new thread to adopt it: spawning and joining
//! threads reuses heaps instead of growing memory.

use core::cell::Cell;
use core::ptr;

use super::policy::Active;
use super::segment::{Block, Page};
use super::size_class::CLASSES;
use super::state::State;
use crate::sync::{AtomicStack, AtomicU64, Ordering};

thread_local! {
    /// The calling thread's heap; null before its first allocation and after it
    /// exited. `const`-initialised with no destructor: a plain TLS load.
    static HEAP: Cell<*mut Heap> = const { Cell::new(ptr::null_mut()) };
}

/// The page every empty direct slot points to, so the fast path needs no null
/// check: its free list is always empty.
static EMPTY_PAGE: EmptyPage = EmptyPage(Page::empty());
#[repr(transparent)]
struct EmptyPage(Page);
// SAFETY: never written: `free` stays null, so no path reaches past the check
// that sends callers to the slow path, which replaces it before touching it.
unsafe impl Sync for EmptyPage {}

#[inline(always)]
fn empty_page() -> *mut Page {
    ptr::addr_of!(EMPTY_PAGE.0).cast_mut()
}

/// Per-heap counters: written only by the thread that owns the heap (relaxed
/// load + store, no read-modify-write), read by anyone and summed into
/// [`Stats`](crate::stats::Stats).
#[derive(Default)]
pub(crate) struct HeapCounters {
    pub(crate) allocs: AtomicU64,
    pub(crate) frees: AtomicU64,
    pub(crate) bytes_alloc: AtomicU64,
    pub(crate) bytes_freed: AtomicU64,
    /// Blocks other threads freed into this heap's pages, collected here.
    pub(crate) remote_frees: AtomicU64,
}

#[inline(always)]
fn bump(c: &AtomicU64, by: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(by), Ordering::Relaxed);
}

/// A list of pages of one class that (may) have free blocks.
#[derive(Clone, Copy)]
struct PageList {
    head: *mut Page,
}

/// Keeps a value on cache lines of its own (two, against the adjacent-line
/// prefetcher), so that remote threads writing it do not steal the owner's
/// hot lines.
#[repr(C, align(128))]
pub(crate) struct CachePadded<T>(pub(crate) T);

#[repr(C)]
pub(crate) struct Heap {
    /// Per class, the page to allocate from: hot, first.
    direct: [*mut Page; CLASSES],
    /// Written by the owner on every operation: next to `direct`, away from
    /// anything other threads write.
    pub(crate) counters: HeapCounters,
    lists: [PageList; CLASSES],
    /// Per class, one page kept when it became empty, so that a heap whose
    /// blocks are freed elsewhere (producer/consumer) does not hand a page to
    /// its arena and take it back over and over. Checked lazily: if it is in
    /// use again when another page empties, that one is kept instead.
    kept_empty: [*mut Page; CLASSES],
    /// The node the heap was made or adopted on (stats are booked there).
    pub(crate) node: usize,
    /// The thread's interleaver while an interleave policy is in force (null
    /// otherwise): the slow path's first check, so that an interleaved
    /// allocation skips the policy lookup.
    il: *const super::policy::Interleaver,
    /// The thread's own interleaver for a process default interleave (as
    /// Linux keeps interleave state per task), made on first use in
    /// metadata memory and kept with the heap (`default_il_live`: made and
    /// not yet dropped at thread exit).
    default_il: *mut super::policy::Interleaver,
    default_il_live: bool,
    /// Whether `Local` is the policy in force on the thread (kept with `il`
    /// when a guard sets or restores one): the slow path's second check, so
    /// that `Local` costs no policy lookup while the heap is not mixed.
    local: bool,
    /// The node of the arena its last fresh page came from under `Local`:
    /// pages of that node serve `Local` without asking where the thread runs.
    last_node: usize,
    /// Whether any page of the heap may be on another node than `last_node`
    /// (a fallback, another policy's pages, a migration): until then `Local`
    /// takes any page without reading its node.
    mixed: bool,
    /// Links: all heaps (registry), orphans of an arena.
    pub(crate) next_all: *mut Heap,
    pub(crate) next_orphan: *mut Heap,
    /// Whether a live thread owns it.
    pub(crate) owned: AtomicU64,
    /// Pages with remote frees waiting in `thread_free` (doubly linked through
    /// `pend_prev`/`pend_next`).
    pending: *mut Page,
    /// Pages of this heap with remote frees waiting: written by other threads.
    pub(crate) remote_pages: CachePadded<AtomicStack<Page>>,
}

/// The calling thread's heap, if it has one.
#[inline(always)]
pub(crate) fn current() -> *mut Heap {
    HEAP.with(|h| h.get())
}

impl Heap {
    /// Allocates a block of class `class` (fast path inlined into `alloc`).
    ///
    /// # Safety
    /// `heap` must be the calling thread's heap.
    #[inline(always)]
    pub(crate) unsafe fn alloc_class(heap: *mut Heap, class: usize) -> *mut u8 {
        // SAFETY: the heap is this thread's; `class < CLASSES` by construction.
        unsafe {
            let page = *(*heap).direct.get_unchecked(class);
            let block = (*page).free;
            if !block.is_null() {
                (*page).free = (*block).next;
                (*page).used += 1;
                bump(&(*heap).counters.allocs, 1);
                bump(&(*heap).counters.bytes_alloc, u64::from((*page).info.block_size));
                return block.cast();
            }
            Heap::alloc_slow(heap, class)
        }
    }

    #[cold]
    #[inline(never)]
    unsafe fn alloc_slow(heap: *mut Heap, class: usize) -> *mut u8 {
        // SAFETY: the heap is this thread's.
        let il = unsafe { (*heap).il };
        if !il.is_null() {
            // Under an interleave the cursor places every allocation: the
            // class's direct page is the interleaver's pool for the rest of
            // a turn, else empty (region blocks are not the heap's: its
            // counters stay out of them). Kept apart from the page refill so
            // this path has a small frame.
            // SAFETY: the interleaver outlives the policy that installed it.
            return unsafe { (*il).alloc_class(heap, class) };
        }
        // SAFETY: the caller's contract.
        unsafe { Heap::refill(heap, class) }
    }

    /// The slow path proper: a page that can serve, under the policy in force.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    #[inline(never)]
    unsafe fn refill(heap: *mut Heap, class: usize) -> *mut u8 {
        let Some(state) = State::try_get() else { return ptr::null_mut() };
        if !state.policies {
            // SAFETY: the caller's heap.
            return unsafe { Heap::alloc_slow_any(heap, class, state) };
        }
        // SAFETY: the heap is this thread's.
        if unsafe { (*heap).local && !(*heap).mixed } {
            // `Local` with every page of the heap on the node it last took
            // a page for: nothing to choose, any page serves.
            // SAFETY: the caller's heap.
            return unsafe { Heap::alloc_slow_any(heap, class, state) };
        }
        let active = super::policy::active(state);
        if matches!(active, Active::Local) && state.mode != super::Mode::PerNode {
            // One arena: `Local` has nothing to choose, any page serves
            // (the unmixed heap took the check above).
            // SAFETY: the caller's heap.
            return unsafe { Heap::alloc_slow_any(heap, class, state) };
        }
        if let Active::Interleave(il) = active {
            // A heap made before its thread's interleave was known.
            // SAFETY: the heap is this thread's.
            unsafe { (*heap).il = il };
            // SAFETY: as above.
            return unsafe { Heap::alloc_slow(heap, class) };
        }
        // Only pages the policy accepts may serve (for `Local` on a mixed
        // heap: pages of its last node, or of the node the thread runs on
        // now, looked up only if a page of another node shows up).
        let mut here = None;
        let accepts = |p: *mut Page| {
            // SAFETY: pages on this heap's lists are live pages.
            let node = usize::from(unsafe { (*p).info.node });
            match active {
                // SAFETY: the heap is the caller's.
                Active::Local if node == unsafe { (*heap).last_node } => true,
                _ => active.accepts(state, node, *here.get_or_insert_with(|| state.current_arena().node)),
            }
        };
        // SAFETY: the heap is this thread's (caller's contract).
        unsafe {
            let p = Heap::serve_listed(heap, class, accepts);
            if !p.is_null() {
                return p;
            }
            // A fresh page from the arena the policy picks (for `Local`, the
            // node this thread runs on now).
            let arena = state.node_arena(active.node(state));
            if matches!(active, Active::Local) {
                Heap::note_node(heap, arena.node);
            }
            let p = Heap::fresh_page(heap, class, state, arena, active.fallback_set());
            Heap::note_direct(heap, class);
            p
        }
    }

    /// Serves the allocation from the class's direct page, else from any
    /// page on its list that `accepts` lets serve (after collecting remote
    /// frees); null when none can, for the caller to take a fresh page.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    #[inline(always)]
    unsafe fn serve_listed(heap: *mut Heap, class: usize, mut accepts: impl FnMut(*mut Page) -> bool) -> *mut u8 {
        // SAFETY: per the contract.
        unsafe {
            Heap::collect_remote(heap);
            let direct = (*heap).direct[class];
            if direct != empty_page() && accepts(direct) && Heap::refill_from(heap, direct) {
                return Heap::alloc_class(heap, class);
            }
            let mut page = (*heap).lists[class].head;
            while !page.is_null() {
                let next = (*page).next;
                if page != direct && accepts(page) && Heap::refill_from(heap, page) {
                    (*heap).direct[class] = page;
                    return Heap::alloc_class(heap, class);
                }
                page = next;
            }
            ptr::null_mut()
        }
    }

    /// Any page serves, then the arena of the node the thread runs on now:
    /// the slow path with policies switched off ([`Config::policies`]), and
    /// `Local`'s while every page of the heap is on the node it last took a
    /// page for (noting, in per-node mode, when that stops being true: the
    /// thread moved, or a fallback page came in).
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    ///
    /// [`Config::policies`]: super::Config::policies
    unsafe fn alloc_slow_any(heap: *mut Heap, class: usize, state: &'static State) -> *mut u8 {
        // SAFETY: per the contract.
        unsafe {
            let p = Heap::serve_listed(heap, class, |_| true);
            if !p.is_null() {
                return p;
            }
            let arena = state.current_arena();
            let track = state.policies && state.mode == super::Mode::PerNode;
            if track {
                Heap::note_node(heap, arena.node);
            }
            let p = Heap::fresh_page(heap, class, state, arena, None);
            if track {
                Heap::note_direct(heap, class);
            }
            p
        }
    }

    /// The thread takes a page on `node`: pages of another node it took
    /// before are foreign from now on.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    unsafe fn note_node(heap: *mut Heap, node: usize) {
        // SAFETY: per the contract.
        unsafe {
            if (*heap).last_node != node {
                (*heap).mixed = true;
                (*heap).last_node = node;
            }
        }
    }

    /// A class's new direct page on another node than the heap's (a
    /// fallback, or a policy's placement) makes the heap mixed.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    unsafe fn note_direct(heap: *mut Heap, class: usize) {
        // SAFETY: per the contract.
        unsafe {
            let direct = (*heap).direct[class];
            if direct != empty_page() && usize::from((*direct).info.node) != (*heap).last_node {
                (*heap).mixed = true;
            }
        }
    }

    /// A fresh page from `arena` (falling back within `within`) becomes the
    /// class's direct page and serves the allocation.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap.
    unsafe fn fresh_page(
        heap: *mut Heap,
        class: usize,
        state: &'static State,
        arena: &super::arena::Arena,
        within: Option<crate::topology::NodeSet>,
    ) -> *mut u8 {
        // SAFETY: per the contract.
        unsafe {
            match arena.alloc_page(state, class, heap, within) {
                Some(p) => {
                    let p = p.as_ptr();
                    (*heap).push_front(p);
                    carve(p);
                    (*heap).direct[class] = p;
                    Heap::alloc_class(heap, class)
                }
                None => {
                    (*heap).direct[class] = empty_page();
                    ptr::null_mut()
                }
            }
        }
    }

    /// Makes `page` able to serve (remote frees taken, more blocks carved);
    /// a page that stays full leaves the list until a block comes back.
    ///
    /// # Safety
    /// The heap is the caller's and owns `page`.
    unsafe fn refill_from(heap: *mut Heap, page: *mut Page) -> bool {
        // SAFETY: per the contract.
        unsafe {
            if (*page).free.is_null() && (*page).pending {
                Heap::take_remote(heap, page);
            }
            if (*page).free.is_null() {
                carve(page);
            }
            if !(*page).free.is_null() {
                return true;
            }
            (*heap).unlink(page);
            (*page).in_full = true;
            false
        }
    }

    /// Frees `block` of `page`, which this heap owns.
    ///
    /// # Safety
    /// `heap` is the calling thread's heap and owns `page`; `block` is a live
    /// block of `page`.
    #[inline(always)]
    pub(crate) unsafe fn free_local(heap: *mut Heap, page: *mut Page, block: *mut Block) {
        // SAFETY: per the contract; owner-only fields.
        unsafe {
            (*block).next = (*page).free;
            (*page).free = block;
            (*page).used -= 1;
            bump(&(*heap).counters.frees, 1);
            bump(&(*heap).counters.bytes_freed, u64::from((*page).info.block_size));
            if (*page).used == 0 || (*page).in_full {
                Heap::page_event(heap, page);
            }
        }
    }

    /// A page got a block back while full, or became empty.
    #[cold]
    unsafe fn page_event(heap: *mut Heap, page: *mut Page) {
        // SAFETY: the caller owns the heap and the page.
        unsafe {
            if (*page).in_full {
                (*page).in_full = false;
                (*heap).push_front(page);
            }
            let class = usize::from((*page).info.class);
            if (*page).used == 0 && (*heap).direct[class] != page {
                let kept = (*heap).kept_empty[class];
                if kept.is_null() || kept == page || (*kept).used != 0 {
                    (*heap).kept_empty[class] = page;
                } else {
                    (*heap).retire(page);
                }
            }
        }
    }

    /// Gives an empty page back to its arena.
    unsafe fn retire(&mut self, page: *mut Page) {
        let Some(state) = State::try_get() else { return };
        // SAFETY: the page is empty and ours; after unlinking, nothing here
        // refers to it.
        unsafe {
            self.unlink(page);
            let class = usize::from((*page).info.class);
            if self.kept_empty[class] == page {
                self.kept_empty[class] = ptr::null_mut();
            }
            let seg = super::segment::segment_of((*page).info.start);
            let arena = &state.arenas[usize::from((*seg).arena)];
            arena.free_page(state, page);
        }
    }

    /// Looks at every page of this heap that other threads freed blocks
    /// into. A page whose free list is empty gets them now; the others are put
    /// on the heap's pending list and get them when their free list runs dry
    /// (`take_remote`). Either way the page leaves `remote_pages`, and no
    /// remote thread queues it again while its `thread_free` is not empty.
    ///
    /// # Safety
    /// `heap` must be the calling thread's heap (or an orphan being adopted).
    pub(crate) unsafe fn collect_remote(heap: *mut Heap) {
        // SAFETY: pages on `remote_pages` are this heap's; see `Page`'s Linked impl
        // for why each is on the stack at most once.
        unsafe {
            let mut page = (*heap).remote_pages.0.take_all();
            while !page.is_null() {
                // Read the link before emptying `thread_free`: from then on a
                // remote thread may push the page again and rewrite it.
                let next = (*page).remote.remote_next;
                if (*page).free.is_null() {
                    Heap::take_remote(heap, page);
                } else if !(*page).pending {
                    (*heap).pend_link(page);
                }
                page = next;
            }
        }
    }

    /// Moves the blocks in `page.thread_free` onto its free list, without
    /// walking them when the free list is empty (they were last written by
    /// other cores: a cache miss each).
    unsafe fn take_remote(heap: *mut Heap, page: *mut Page) {
        // SAFETY: the caller owns the heap and the page.
        unsafe {
            if (*page).pending {
                (*heap).pend_unlink(page);
            }
            let (head, n) = (*page).remote.thread_free.take_all();
            if head.is_null() {
                return;
            }
            if (*page).free.is_null() {
                (*page).free = head;
            } else {
                let mut tail = head;
                while !(*tail).next.is_null() {
                    tail = (*tail).next;
                }
                (*tail).next = (*page).free;
                (*page).free = head;
            }
            let n = n as u32;
            (*page).used -= n;
            let c = &(*heap).counters;
            bump(&c.remote_frees, u64::from(n));
            bump(&c.frees, u64::from(n));
            bump(&c.bytes_freed, u64::from(n) * u64::from((*page).info.block_size));
            if (*page).in_full || (*page).used == 0 {
                Heap::page_event(heap, page);
            }
        }
    }

    fn pend_link(&mut self, page: *mut Page) {
        // SAFETY: owner-only fields of a page of this heap.
        unsafe {
            (*page).pending = true;
            (*page).pend_prev = ptr::null_mut();
            (*page).pend_next = self.pending;
            if !self.pending.is_null() {
                (*self.pending).pend_prev = page;
            }
            self.pending = page;
        }
    }

    fn pend_unlink(&mut self, page: *mut Page) {
        // SAFETY: as above; the page is on the pending list.
        unsafe {
            let (prev, next) = ((*page).pend_prev, (*page).pend_next);
            if prev.is_null() {
                self.pending = next;
            } else {
                (*prev).pend_next = next;
            }
            if !next.is_null() {
                (*next).pend_prev = prev;
            }
            (*page).pending = false;
            (*page).pend_prev = ptr::null_mut();
            (*page).pend_next = ptr::null_mut();
        }
    }

    fn push_front(&mut self, page: *mut Page) {
        // SAFETY: owner-only list fields of pages this heap owns.
        unsafe {
            let class = usize::from((*page).info.class);
            let head = self.lists[class].head;
            (*page).prev = ptr::null_mut();
            (*page).next = head;
            if !head.is_null() {
                (*head).prev = page;
            }
            self.lists[class].head = page;
        }
    }

    fn unlink(&mut self, page: *mut Page) {
        // SAFETY: as above. A page off every list has null links and is not a head.
        unsafe {
            let class = usize::from((*page).info.class);
            let (prev, next) = ((*page).prev, (*page).next);
            if !prev.is_null() {
                (*prev).next = next;
            } else if self.lists[class].head == page {
                self.lists[class].head = next;
            }
            if !next.is_null() {
                (*next).prev = prev;
            }
            (*page).prev = ptr::null_mut();
            (*page).next = ptr::null_mut();
            if self.direct[class] == page {
                self.direct[class] = empty_page();
            }
        }
    }

    /// Lets go of every empty page (thread exit, `collect`).
    unsafe fn release_empty_pages(heap: *mut Heap) {
        // SAFETY: the heap is the caller's.
        unsafe {
            Heap::collect_remote(heap);
            while !(*heap).pending.is_null() {
                Heap::take_remote(heap, (*heap).pending);
            }
            for class in 0..CLASSES {
                (*heap).direct[class] = empty_page();
                (*heap).kept_empty[class] = ptr::null_mut();
                let mut p = (*heap).lists[class].head;
                while !p.is_null() {
                    let next = (*p).next;
                    if (*p).used == 0 {
                        (*heap).retire(p);
                    }
                    p = next;
                }
            }
        }
    }
}

/// The calling thread's heap, made (or adopted) on first use. `None` only when
/// the OS refuses the memory for a heap descriptor.
#[cold]
#[inline(never)]
pub(crate) fn init_current(state: &'static State) -> Option<*mut Heap> {
    let node = state.topology.current_node();
    let arena = state.home_arena(node);
    // Adopt a heap left by an exited thread of this node, else make one.
    let heap = {
        let mut g = arena.inner.lock();
        let h = g.orphans;
        if !h.is_null() {
            // SAFETY: orphans are live heaps owned by nobody.
            g.orphans = unsafe { (*h).next_orphan };
        }
        h
    };
    let heap = if heap.is_null() {
        let p = state.alloc_meta(core::mem::size_of::<Heap>(), core::mem::align_of::<Heap>())?;
        let h = p.as_ptr().cast::<Heap>();
        // SAFETY: fresh, suitably aligned metadata memory.
        unsafe {
            ptr::write(
                h,
                Heap {
                    direct: [empty_page(); CLASSES],
                    lists: [PageList { head: ptr::null_mut() }; CLASSES],
                    kept_empty: [ptr::null_mut(); CLASSES],
                    pending: ptr::null_mut(),
                    remote_pages: CachePadded(AtomicStack::new()),
                    node: arena.node,
                    last_node: arena.node,
                    mixed: false,
                    il: ptr::null(),
                    default_il: ptr::null_mut(),
                    default_il_live: false,
                    local: false,
                    counters: HeapCounters::default(),
                    next_all: ptr::null_mut(),
                    next_orphan: ptr::null_mut(),
                    owned: AtomicU64::new(1),
                },
            );
            let mut all = state.heaps.lock();
            (*h).next_all = *all;
            *all = h;
        }
        h
    } else {
        // SAFETY: adopted: ours now. Its pages and their free lists come along;
        // remote frees that arrived meanwhile are collected at the next refill.
        unsafe {
            (*heap).next_orphan = ptr::null_mut();
            (*heap).owned.store(1, Ordering::Relaxed);
            // The previous thread's interleave (and its interleaver) is gone.
            (*heap).il = ptr::null();
        }
        heap
    };
    HEAP.with(|c| c.set(heap));
    // SAFETY: ours now (and current: the policy lookup may make the
    // thread's interleaver, kept in it).
    unsafe { (*heap).local = matches!(super::policy::active(state), Active::Local) };
    // Ask for `thread_exit` at thread exit. glibc keeps the first 32 keys'
    // values inside the thread descriptor, so this does not allocate.
    // SAFETY: a key made at start-up.
    unsafe { libc::pthread_setspecific(state.key, heap.cast()) };
    Some(heap)
}

/// Thread-exit destructor (pthread key): release empty pages, leave the heap
/// for adoption. Allocations after this (from later destructors) make or
/// adopt a heap again, and the key brings us back for it.
pub(crate) extern "C" fn thread_exit(heap: *mut libc::c_void) {
    let heap = heap.cast::<Heap>();
    let Some(state) = State::try_get() else { return };
    if heap.is_null() {
        return;
    }
    // SAFETY: the heap was this thread's; nobody else uses it until adopted.
    unsafe {
        if (*heap).default_il_live {
            // Its pool back, its regions retired: they go back to the OS
            // once other threads free their last blocks.
            (*heap).default_il_live = false;
            (*heap).il = ptr::null();
            ptr::drop_in_place((*heap).default_il);
        }
    }
    HEAP.with(|c| c.set(ptr::null_mut()));
    // SAFETY: as above.
    unsafe {
        Heap::release_empty_pages(heap);
        (*heap).owned.store(0, Ordering::Relaxed);
        let arena = state.home_arena((*heap).node);
        let mut g = arena.inner.lock();
        (*heap).next_orphan = g.orphans;
        g.orphans = heap;
    }
}

/// Points every size class of the calling thread's heap at the empty page,
/// so that the next allocation of each goes through the slow path (and the
/// policy now in force, `active`), and records its interleaver (if any) and
/// whether it is `Local`.
pub(crate) fn reset_direct_pages(active: Active) {
    let h = current();
    if !h.is_null() {
        // SAFETY: the calling thread's heap; the pages stay on its lists.
        unsafe {
            (*h).direct = [empty_page(); CLASSES];
            (*h).il = super::policy::interleaver_of(active);
            (*h).local = matches!(active, Active::Local);
        }
    }
}

/// The calling thread's own interleaver for the process default interleave
/// `policy`, made on first use (with the thread's heap, if need be); `None`
/// when no memory can be had for it.
pub(crate) fn thread_interleaver(
    state: &'static State,
    policy: &crate::policy::Interleave,
) -> Option<*const super::policy::Interleaver> {
    let mut h = current();
    if h.is_null() {
        h = init_current(state)?;
    }
    // SAFETY: the calling thread's heap.
    unsafe {
        if !(*h).default_il_live {
            if (*h).default_il.is_null() {
                let size = core::mem::size_of::<super::policy::Interleaver>();
                let align = core::mem::align_of::<super::policy::Interleaver>();
                (*h).default_il = state.alloc_meta(size, align)?.as_ptr().cast();
            }
            // Metadata memory of the right layout, unused: the previous
            // thread's interleaver (if any) was dropped at its exit.
            ptr::write((*h).default_il, super::policy::Interleaver::exclusive(policy));
            (*h).default_il_live = true;
        }
        Some((*h).default_il)
    }
}

/// Makes `page`, an exclusive interleaver's pool, the direct page of
/// `class` for the calling thread's `heap`.
///
/// # Safety
/// `heap` is the calling thread's heap; `page` holds blocks of `class`'s
/// size and stays live until [`unhook_pool`].
pub(crate) unsafe fn hook_pool(heap: *mut Heap, class: usize, page: *mut Page) {
    // SAFETY: per the contract.
    unsafe { (*heap).direct[class] = page };
}

/// Undoes [`hook_pool`] (if the pool is still hooked) and takes the `taken`
/// blocks of `size` bytes that the fast path counted out of the heap's
/// counters.
///
/// # Safety
/// Called on the thread that hooked the pool; `h` is its heap (or null).
pub(crate) unsafe fn unhook_pool(h: *mut Heap, page: *mut Page, class: usize, taken: usize, size: usize) {
    if h.is_null() {
        return;
    }
    // SAFETY: the calling thread's heap.
    unsafe {
        if (*h).direct[class] == page {
            (*h).direct[class] = empty_page();
        }
        let c = &(*h).counters;
        bump(&c.allocs, (taken as u64).wrapping_neg());
        bump(&c.bytes_alloc, ((taken * size) as u64).wrapping_neg());
    }
}

/// Returns the calling thread's empty pages and purges the arenas.
pub(crate) fn collect_current(state: &State) {
    let h = current();
    if !h.is_null() {
        // SAFETY: the calling thread's heap.
        unsafe { Heap::release_empty_pages(h) };
    }
    for n in state.nodes().iter() {
        if let Some(a) = state.arena(n) {
            a.purge_now();
        }
    }
}

/// Carves up to 16 KiB worth of blocks from the page's untouched tail onto its
/// free list (touching memory as late as possible keeps RSS low).
unsafe fn carve(page: *mut Page) {
    // SAFETY: owner-only fields of the caller's page.
    unsafe {
        let left = (*page).info.capacity - (*page).carved;
        if left == 0 {
            return;
        }
        let bs = (*page).info.block_size as usize;
        let n = left.min((16 * 1024 / bs).max(1) as u32);
        let first = (*page).info.start.add((*page).carved as usize * bs);
        for i in 0..n as usize {
            let b = first.add(i * bs).cast::<Block>();
            (*b).next = if i + 1 < n as usize { first.add((i + 1) * bs).cast() } else { (*page).free };
        }
        (*page).free = first.cast();
        (*page).carved += n;
    }
}

impl Heap {
    /// Whether a live thread owns the heap.
    pub(crate) fn is_owned(&self) -> bool {
        self.owned.load(Ordering::Relaxed) != 0
    }

    /// The heap's node and (allocs, frees, bytes allocated, bytes freed, remote frees).
    pub(crate) fn node_and_counters(&self) -> (usize, (u64, u64, u64, u64, u64)) {
        let c = &self.counters;
        let ld = |x: &AtomicU64| x.load(Ordering::Relaxed);
        (self.node, (ld(&c.allocs), ld(&c.frees), ld(&c.bytes_alloc), ld(&c.bytes_freed), ld(&c.remote_frees)))
    }
}

/// Heaps for stats: every heap ever made.
pub(crate) fn for_each_heap(state: &State, mut f: impl FnMut(&Heap)) {
    let mut h = *state.heaps.lock();
    while !h.is_null() {
        // SAFETY: heaps are never freed; `next_all` is written once, under the
        // registry lock, before the heap is published.
        unsafe {
            f(&*h);
            h = (*h).next_all;
        }
    }
}
