//! Per-thread magazines, and the allocation and free paths through them.
//!
//! Each thread has a table indexed by cache slot; an entry holds the thread's
//! [`MagPair`]s for that cache, one per node it used. The fast allocation is a
//! TLS load, two indexed loads and a pop; the fast free adds, on a multi-node
//! topology, one load from the object's slab header to learn its node. No
//! atomic instruction and no shared cache line on either.

use core::cell::{Cell, UnsafeCell};
use core::ptr::{self, NonNull};
use std::sync::Arc;

use super::kmem::{KmemCache, OnEmpty};
use super::magazine::{MagPair, Magazine};
use crate::error::{Error, Result};

struct Entry {
    cache: Arc<KmemCache>,
    /// The node this thread ran on at its last slow path.
    thread_node: usize,
    /// Where `alloc()` goes: the cache's home, or `thread_node`.
    default: usize,
    pairs: Box<[Option<MagPair>]>,
}

struct Table {
    entries: Vec<Option<Entry>>,
}

/// Caches with a slot below this get a fast-path slot in [`HOT`]; the rest
/// take the table path (a few more loads).
///
/// The slots are most of the crate's static TLS, which glibc copies and
/// zeroes at the top of every new thread's stack, whether the thread uses
/// a slab or not, so their bytes are resident in every thread. 64 of them
/// (2 KiB) pushed each thread's stack one page further down: a thousand
/// threads holding 64 blocks each kept 4 KiB more apiece (`benches/memory`,
/// `perthread`, 81.3 against 77.3 KiB with the per-CPU caches). A slot
/// stays 32 bytes: at 24 (`u32` counts) the fast pair of a raw cache took
/// 0.5 ns more, at 16 (`u16` counts) twice as long.
const HOT_SLOTS: usize = 32;

const _: () = assert!(core::mem::size_of::<[Hot; HOT_SLOTS]>() <= 1024);

/// The fast path's view of one cache: the `loaded` magazine that `alloc()`
/// pops from and local frees push to, with its count kept here (one load
/// fewer per operation). While a slot is set, the magazine's own count is
/// stale: every slow path that touches the thread's pairs first calls
/// [`Entry::unhot`] and ends with [`Entry::sync_hot`].
struct Hot {
    len: Cell<usize>,
    /// Room for local frees: the magazine's capacity when the thread runs on
    /// the cache's default node, else 0 (frees take the slow path).
    cap: Cell<usize>,
    rounds: Cell<*mut *mut u8>,
    /// The node frees are compared with; `usize::MAX` when unset.
    thread_node: Cell<usize>,
}

impl Hot {
    const fn empty() -> Hot {
        Hot {
            len: Cell::new(0),
            cap: Cell::new(0),
            rounds: Cell::new(ptr::null_mut()),
            thread_node: Cell::new(usize::MAX),
        }
    }
}

thread_local! {
    // No destructor: readable for as long as the thread runs, even while
    // other thread-locals are torn down (`Table`'s drop empties it first).
    static HOT: [Hot; HOT_SLOTS] = const { [const { Hot::empty() }; HOT_SLOTS] };
    static TABLE: UnsafeCell<Table> = const { UnsafeCell::new(Table { entries: Vec::new() }) };
}

impl Entry {
    fn new(cache: Arc<KmemCache>) -> Self {
        let pairs = (0..cache.nodes.len()).map(|_| None).collect();
        let mut e = Self { cache, thread_node: 0, default: 0, pairs };
        e.refresh();
        e
    }

    /// Re-reads the thread's node (a migrated thread follows its node).
    fn refresh(&mut self) {
        self.unhot();
        let cache = &self.cache;
        self.thread_node = if cache.multi_node { cache.topo.current_node() } else { cache.first_node };
        if self.thread_node >= self.pairs.len() {
            self.thread_node = 0;
        }
        self.default = cache.default_node(self.thread_node);
        if self.default >= self.pairs.len() {
            self.default = 0;
        }
        self.sync_hot();
    }

    /// Takes the count back from the fast-path slot into the magazine and
    /// clears the slot.
    fn unhot(&mut self) {
        let i = self.cache.index;
        if i >= HOT_SLOTS {
            return;
        }
        let pairs = &mut self.pairs;
        let default = self.default;
        HOT.with(|h| {
            let s = &h[i];
            if !s.rounds.get().is_null() {
                let m = pairs[default].as_mut().expect("a hot slot's pair is in place").loaded_mut();
                debug_assert!(ptr::eq(m.rounds_ptr(), s.rounds.get()));
                // SAFETY: the slot's count describes this magazine's rounds,
                // pushed and popped only by this thread.
                unsafe { m.set_len(s.len.get()) };
            }
            s.len.set(0);
            s.cap.set(0);
            s.rounds.set(ptr::null_mut());
            s.thread_node.set(usize::MAX);
        });
    }

    /// Points the fast-path slot at the default node's `loaded` magazine.
    fn sync_hot(&mut self) {
        let i = self.cache.index;
        if i >= HOT_SLOTS {
            return;
        }
        let local = self.default == self.thread_node;
        let tn = self.thread_node;
        let m = self.pairs[self.default].as_mut().map(MagPair::loaded_mut);
        HOT.with(|h| {
            let s = &h[i];
            s.thread_node.set(tn);
            match m {
                Some(m) => {
                    s.len.set(m.len());
                    s.cap.set(if local { m.cap() } else { 0 });
                    s.rounds.set(m.rounds_ptr());
                }
                None => {
                    s.len.set(0);
                    s.cap.set(0);
                    s.rounds.set(ptr::null_mut());
                }
            }
        });
    }

    /// Returns every object held to its node's slabs; the slab references to
    /// drop afterwards.
    fn flush(&mut self) -> usize {
        self.unhot();
        let mut refs = 0;
        for (node, pair) in self.pairs.iter_mut().enumerate() {
            if let Some(pair) = pair {
                for m in pair.magazines_mut() {
                    // SAFETY: the magazines hold objects of `node` that this
                    // thread owns.
                    refs += unsafe { self.cache.give_back(node, m.as_slice()) };
                    m.clear();
                }
            }
        }
        refs
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        for e in self.entries.iter_mut() {
            if let Some(mut e) = e.take() {
                flush_entry(&mut e);
            }
        }
    }
}

/// Flushes `e` and lets go of it.
fn flush_entry(e: &mut Entry) {
    let refs = e.flush();
    // SAFETY: `e.cache` is still held, so the cache outlives this; the
    // references are ones the flush handed us.
    unsafe { KmemCache::put_refs(Arc::as_ptr(&e.cache), refs) };
}

/// Runs `f` on the calling thread's table; `None` once the thread's TLS is
/// being torn down.
#[inline(always)]
fn with_table<R>(f: impl FnOnce(&mut Table) -> R) -> Option<R> {
    TABLE
        .try_with(|t| {
            // SAFETY: the table is this thread's; no `&mut` to it outlives `f`,
            // and no caller runs user code (constructors, `Drop`) inside `f`,
            // so nothing re-enters.
            f(unsafe { &mut *t.get() })
        })
        .ok()
}

impl Table {
    /// The entry for `cache`, made on first use. Entries of dropped caches
    /// are flushed on the way (they would keep those caches alive).
    fn entry(&mut self, cache: &Arc<KmemCache>) -> &mut Entry {
        let i = cache.index;
        if self.entries.len() <= i {
            self.entries.resize_with(i + 1, || None);
        }
        if self.entries[i].is_none() {
            for slot in self.entries.iter_mut() {
                if slot.as_ref().is_some_and(|e| e.cache.dead.load(std::sync::atomic::Ordering::Relaxed)) {
                    let mut e = slot.take().expect("checked above");
                    flush_entry(&mut e);
                }
            }
            self.entries[i] = Some(Entry::new(cache.clone()));
        }
        self.entries[i].as_mut().expect("filled above")
    }
}

/// The fast allocation from the thread's magazine for `node` (`None`: the
/// cache's default node for this thread).
#[inline]
pub(crate) fn alloc_fast(cache: &KmemCache, node: Option<usize>) -> Option<NonNull<u8>> {
    match node {
        None => HOT.with(|h| {
            let s = h.get(cache.index)?;
            let len = s.len.get().checked_sub(1)?;
            s.len.set(len);
            // SAFETY: a non-zero count means `rounds` is this thread's
            // `loaded` magazine for the cache and rounds `0..=len` hold
            // objects (kept so by every slow path, see `Hot`).
            Some(unsafe { NonNull::new_unchecked(*s.rounds.get().add(len)) })
        }),
        Some(n) => with_table(|t| {
            let e = t.entries.get_mut(cache.index)?.as_mut()?;
            e.unhot();
            let p = e.pairs.get_mut(n)?.as_mut().and_then(MagPair::pop);
            e.sync_hot();
            p
        })
        .flatten(),
    }
}

/// Pops up to `out.len()` objects from the thread's hot magazine in one go
/// (in the order single pops would give them); returns how many.
#[inline]
pub(crate) fn alloc_fast_many(cache: &KmemCache, out: &mut [*mut u8]) -> usize {
    HOT.with(|h| {
        let Some(s) = h.get(cache.index) else { return 0 };
        let len = s.len.get();
        let k = len.min(out.len());
        let base = s.rounds.get();
        for (j, o) in out[..k].iter_mut().enumerate() {
            // SAFETY: `j < k <= len`: rounds `0..len` hold objects (see
            // `alloc_fast`); a zero count never reads `base`.
            *o = unsafe { *base.add(len - 1 - j) };
        }
        s.len.set(len - k);
        k
    })
}

/// Where an allocation starts.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Start {
    /// The cache's default node for this thread.
    Default,
    /// This node.
    Node(usize),
}

/// The allocation slow path: reload from the depot, else fill from the
/// slabs; with [`OnEmpty::Fallback`] on the other nodes by distance.
pub(crate) fn alloc_slow(cache: &Arc<KmemCache>, start: Start, on_empty: OnEmpty) -> Result<NonNull<u8>> {
    cache.check_demotion();
    let first = with_table(|t| {
        let e = t.entry(cache);
        e.refresh();
        match start {
            Start::Default => e.default,
            Start::Node(n) => n,
        }
    });
    let first = match (first, start) {
        (Some(n), _) | (None, Start::Node(n)) => n,
        (None, Start::Default) => cache.default_node(cache.topo.current_node()),
    };
    let mut last_err = Error::NodeOutOfMemory { node: first };
    for node in cache.candidates(first, on_empty) {
        match alloc_from(cache, node) {
            Ok(p) => {
                if node != first {
                    cache.nodes[first].counters.fallbacks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                return Ok(p);
            }
            Err(e @ (Error::LimitReached { .. } | Error::NodeOutOfMemory { .. })) => {
                if node == first {
                    last_err = e;
                }
            }
            Err(e) => return Err(e),
        }
    }
    Err(last_err)
}

/// One object of `node` through the thread's magazines for it.
fn alloc_from(cache: &Arc<KmemCache>, node: usize) -> Result<NonNull<u8>> {
    // Take the pair out of the table: filling may run a constructor, which
    // may use other caches (and so this table).
    let pair = with_table(|t| {
        let e = t.entry(cache);
        e.unhot();
        let p = e.pairs[node].take().unwrap_or_else(|| MagPair::new(cache.rounds));
        e.sync_hot();
        p
    });
    let Some(mut pair) = pair else {
        // No TLS (thread exit): straight from the slabs.
        let mut m = Magazine::new(1);
        cache.fill(node, &mut m, 1)?;
        return Ok(m.pop().expect("fill gave one"));
    };
    let depot = &cache.nodes[node].depot;
    let got = if let Some(p) = pair.pop() {
        Ok(p)
    } else if pair.reload(depot) {
        Ok(pair.pop().expect("a reloaded magazine is full"))
    } else {
        let cap = pair.cap();
        cache.fill(node, pair.loaded_mut(), cap).map(|_| pair.pop().expect("fill gave at least one"))
    };
    put_pair(cache, node, pair);
    got
}

/// Puts a pair taken out by a slow path back (flushing it if the slot was
/// filled meanwhile, or the thread's TLS is gone).
fn put_pair(cache: &Arc<KmemCache>, node: usize, pair: MagPair) {
    let mut pair = Some(pair);
    with_table(|t| {
        let e = t.entry(cache);
        if e.pairs[node].is_none() {
            e.unhot();
            e.pairs[node] = pair.take();
            e.sync_hot();
        }
    });
    let Some(mut pair) = pair else { return };
    let mut refs = 0;
    for m in pair.magazines_mut() {
        // SAFETY: the pair's objects are `node`'s, owned by this thread.
        refs += unsafe { cache.give_back(node, m.as_slice()) };
        m.clear();
    }
    // SAFETY: `cache` is held by the caller's `Arc`.
    unsafe { KmemCache::put_refs(Arc::as_ptr(cache), refs) };
}

/// What the fast free decided.
enum Freed {
    Done,
    /// The object belongs to another node than the thread's.
    Remote,
    Slow,
}

/// Frees `obj`: into the thread's magazine for its node when the thread is
/// on that node, else home through the node's remote list.
///
/// # Safety
/// `obj` is an object of the cache at `cache`, out of its slab, owned by the
/// caller, and the cache is alive (the object's slab holds a reference).
#[inline]
pub(crate) unsafe fn free(cache: *const KmemCache, obj: NonNull<u8>) {
    // SAFETY: the cache is alive (`obj`'s slab holds a reference to it, as the caller
    // guarantees), so `cache` may be borrowed.
    let c = unsafe { &*cache };
    // SAFETY: `obj` is this cache's.
    let node = if c.multi_node { unsafe { c.node_of(obj) } } else { c.first_node };
    // A limited node with waiters takes frees at once, so they are woken.
    let urgent = c.limited && c.nodes[node].waiters.0.load(std::sync::atomic::Ordering::Relaxed) != 0;
    let fast = if urgent {
        Freed::Slow
    } else {
        HOT.with(|h| {
            let Some(s) = h.get(c.index) else { return Freed::Slow };
            let tn = s.thread_node.get();
            if c.multi_node && node != tn {
                return if tn == usize::MAX { Freed::Slow } else { Freed::Remote };
            }
            let len = s.len.get();
            if len >= s.cap.get() {
                return Freed::Slow;
            }
            // SAFETY: a non-zero `cap` means `rounds` is this thread's
            // `loaded` magazine for the thread's node, with room at `len`.
            unsafe { *s.rounds.get().add(len) = obj.as_ptr() };
            s.len.set(len + 1);
            Freed::Done
        })
    };
    match fast {
        Freed::Done => {}
        // SAFETY: a one-object chain of a free object of `node`.
        Freed::Remote => unsafe { c.free_remote(node, obj, obj, 1) },
        // SAFETY: `obj` is a live object of this cache on `node`, given up once
        // by the caller (`free`'s contract), which is what `free_slow` asks.
        Freed::Slow => unsafe { free_slow(cache, obj, node, urgent) },
    }
}

/// A free the thread's magazines did not take: a full magazine to the
/// node's depot, or the object straight to its slab.
///
/// # Safety
/// `obj` is a live object of `cache` on `node`, given up by the caller; its
/// slab holds a reference to `cache`.
#[cold]
unsafe fn free_slow(cache: *const KmemCache, obj: NonNull<u8>, node: usize, urgent: bool) {
    // Hold the cache: giving objects back may release the slab whose
    // reference kept it alive.
    // SAFETY: `cache` is a live `Arc<KmemCache>` allocation: the caller's live object
    // `obj` sits in a slab that holds a reference to it (as in `free`).
    unsafe { KmemCache::hold(cache) };
    // SAFETY: just held.
    let c = unsafe { &*cache };
    // A pool that only frees (a cold one) still looks at its demotion.
    c.check_demotion();
    let mut refs = 1;
    if urgent {
        // SAFETY: the caller's object, of `node`.
        refs += unsafe { c.give_back(node, &[obj.as_ptr()]) };
    } else {
        // SAFETY: the temporary reference keeps the allocation alive while
        // an `Arc` is borrowed from it.
        let arc = unsafe { core::mem::ManuallyDrop::new(Arc::from_raw(cache)) };
        let outcome = with_table(|t| {
            let e = t.entry(&arc);
            e.refresh();
            if c.multi_node && node != e.thread_node {
                return None;
            }
            e.unhot();
            let pair = e.pairs[node].get_or_insert_with(|| MagPair::new(c.rounds));
            let depot = &c.nodes[node].depot;
            let mut refs = 0;
            while !pair.push(obj) {
                if !pair.unload(depot) {
                    // The depot is at its bound: `previous` goes back to the
                    // slabs, and the next `unload` swaps it in empty.
                    let prev = pair.previous_mut();
                    // SAFETY: `previous` holds this thread's objects of `node`.
                    refs += unsafe { c.give_back(node, prev.as_slice()) };
                    prev.clear();
                }
            }
            e.sync_hot();
            Some(refs)
        });
        match outcome {
            Some(Some(r)) => refs += r,
            // SAFETY: a one-object chain of a free object of `node`.
            Some(None) => unsafe { c.free_remote(node, obj, obj, 1) },
            // SAFETY: the caller's object, of `node`.
            None => refs += unsafe { c.give_back(node, &[obj.as_ptr()]) },
        }
    }
    // SAFETY: the temporary reference plus the slab references handed back.
    unsafe { KmemCache::put_refs(cache, refs) };
}

/// Flushes and forgets the calling thread's magazines for `cache`.
pub(crate) fn flush_current(cache: &Arc<KmemCache>) {
    let e = with_table(|t| t.entries.get_mut(cache.index).and_then(Option::take)).flatten();
    if let Some(mut e) = e {
        flush_entry(&mut e);
    }
}

/// First, last and count of a chain of objects going home.
type Chain = (NonNull<u8>, NonNull<u8>, usize);

/// Frees `objs`: this node's into the thread's magazines, other nodes' home
/// as one chain per node.
///
/// # Safety
/// As [`free`], for every object (no duplicates); the cache is held by `cache`.
pub(crate) unsafe fn free_bulk(cache: &Arc<KmemCache>, objs: &[NonNull<u8>]) {
    if !cache.multi_node {
        for &o in objs {
            // SAFETY: each object is this cache's, live, given once
            // (`free_bulk`'s contract, which is `free`'s for each).
            unsafe { free(Arc::as_ptr(cache), o) };
        }
        return;
    }
    let here = with_table(|t| {
        let e = t.entry(cache);
        e.refresh();
        e.thread_node
    })
    .unwrap_or_else(|| cache.topo.current_node());
    // Per node: the chain being built.
    let mut chains: Vec<Option<Chain>> = vec![None; cache.nodes.len()];
    for &o in objs {
        // SAFETY: an object of this cache.
        let node = unsafe { cache.node_of(o) };
        if node == here {
            // SAFETY: as above: a live object of this cache, given once.
            unsafe { free(Arc::as_ptr(cache), o) };
            continue;
        }
        let c = &mut chains[node];
        match c {
            None => *c = Some((o, o, 1)),
            Some((first, _, n)) => {
                // SAFETY: `o` is free and ours; it goes in front of the chain.
                unsafe { cache.link_before(o, first.as_ptr()) };
                *first = o;
                *n += 1;
            }
        }
    }
    for (node, c) in chains.into_iter().enumerate() {
        if let Some((first, last, n)) = c {
            // SAFETY: a chain of free objects of `node`, linked above.
            unsafe { cache.free_remote(node, first, last, n) };
        }
    }
}
