//! Moving a pool to another node while it is in use, the demotion condition
//! that moves it by itself, and where its pages are.
//!
//! A migration first binds every chunk of every node's slabs to the new
//! node, so that pages faulted from then on land there, and sets the node
//! new chunks are mapped on. It then moves the pages already present with
//! `move_pages`, [`MOVE_BATCH`] pages at a time under the node's slab lock:
//! the lock keeps a chunk from being unmapped (and its address reused)
//! under the call, and is let go between batches, so refills wait for one
//! batch at most. Threads go on allocating and freeing from their
//! magazines throughout; the kernel copies each page and maps the copy at
//! the same address, so no object moves and none is copied by us.
//!
//! A registered chunk (a [`Registrar`](super::Registrar) pins it for the
//! kernel or a device) moves only through its registrar: released, moved
//! and registered again under its lock, the names it had kept
//! ([`Registrar::can_move`](super::Registrar::can_move)). A registrar that
//! cannot do that makes the migration fail before anything moves.
//!
//! A [`Demotion`] is checked on the cache's slow paths (a thread's
//! magazines running empty or full), at most once per its period: no thread of
//! the allocator's own ever runs it.

use core::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::cache::{Core, NodeSlabs};
use super::chunk::Extent;
use super::register::Refusal;
use crate::error::{Error, Result};
use crate::os::mem;
use crate::os::pages::{self, MOVE_BATCH};
use crate::sync::Mutex;

/// No node: the cache was never migrated, or no demotion is set.
const NOWHERE: usize = usize::MAX;

/// How long pages of a released registered region that are still pinned
/// are tried again.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

/// How often a demotion condition is looked at by default.
const DEFAULT_PERIOD: Duration = Duration::from_millis(100);

/// Why pages of a migration stayed where they were.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stuck {
    /// Pinned (held for I/O by the kernel or a device) or busy at the moment
    /// (`EBUSY`, `EAGAIN`): migrating again later may move them.
    Busy,
    /// The target node had no free page for them (`ENOMEM`).
    NodeFull,
    /// Another process maps them too (`EACCES`): after a `fork`, until the
    /// child writes to them or exits.
    Shared,
    /// The pool's registrar would not release their region for the move.
    Registrar(Refusal),
    /// Another refusal of `move_pages`, with its errno.
    Os(i32),
}

impl Stuck {
    fn of_errno(errno: i32) -> Stuck {
        match errno {
            libc::EBUSY | libc::EAGAIN => Stuck::Busy,
            libc::ENOMEM => Stuck::NodeFull,
            libc::EACCES => Stuck::Shared,
            e => Stuck::Os(e),
        }
    }
}

/// Pages that did not move, for one reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unmoved {
    /// Why.
    pub why: Stuck,
    /// How many pages (of the chunk's page size).
    pub pages: usize,
    /// Their bytes.
    pub bytes: u64,
}

/// What one migration did: see `migrate` on [`SlabCache`](super::SlabCache),
/// [`RawCache`](super::RawCache) and [`DmaPool`](super::DmaPool).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Migration {
    /// The node the pool is on now.
    pub to: usize,
    /// Pages moved there.
    pub pages_moved: usize,
    /// Their bytes.
    pub bytes_moved: u64,
    /// Present pages that were on the node already.
    pub pages_already: usize,
    /// Pages that stayed where they were, by reason (empty: the pool is
    /// wholly on `to`).
    pub unmoved: Vec<Unmoved>,
    /// Registered regions released, moved and registered again.
    pub regions_moved: usize,
    /// How long it took.
    pub took: Duration,
}

impl Migration {
    fn new(to: usize) -> Self {
        Migration {
            to,
            pages_moved: 0,
            bytes_moved: 0,
            pages_already: 0,
            unmoved: Vec::new(),
            regions_moved: 0,
            took: Duration::ZERO,
        }
    }

    /// Pages that did not move, for any reason.
    pub fn pages_unmoved(&self) -> usize {
        self.unmoved.iter().map(|u| u.pages).sum()
    }

    fn stuck(&mut self, why: Stuck, pages: usize, page_size: usize) {
        let bytes = (pages * page_size) as u64;
        match self.unmoved.iter_mut().find(|u| u.why == why) {
            Some(u) => {
                u.pages += pages;
                u.bytes += bytes;
            }
            None => self.unmoved.push(Unmoved { why, pages, bytes }),
        }
    }
}

impl fmt::Display for Migration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "to node {}: {} pages moved ({} bytes), {} there already, {} unmoved, in {:?}",
            self.to,
            self.pages_moved,
            self.bytes_moved,
            self.pages_already,
            self.pages_unmoved(),
            self.took
        )?;
        for u in &self.unmoved {
            write!(f, "; {} pages: {:?}", u.pages, u.why)?;
        }
        Ok(())
    }
}

/// A condition under which a pool moves itself to another node: the free
/// memory of the node it watches drops below a threshold (another program
/// or cache filled it), and cold pools make room by going to the lower
/// tier.
///
/// ```
/// use std::time::Duration;
/// use numaweave::slab::{Demotion, RawCache};
///
/// let pool = RawCache::builder("cold_index", 4096).build().unwrap();
/// // Off to the lower tier when node 0 has less than 1 GiB free; on a
/// // machine without one, name the node with `.to(node)`.
/// let d = Demotion::when_free_below(0, 1 << 30).to(0).every(Duration::from_millis(50));
/// pool.demote_when(Some(d)).unwrap();
/// assert_eq!(pool.stats().demotions, 0);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demotion {
    watch: usize,
    free_below: u64,
    to: Option<usize>,
    every: Duration,
}

impl Demotion {
    /// Moves the pool when `node` has fewer than `bytes` free (`MemFree`),
    /// to the lower-tier node nearest `node` unless [`to`](Self::to) names
    /// one.
    pub fn when_free_below(node: usize, bytes: u64) -> Self {
        Demotion { watch: node, free_below: bytes, to: None, every: DEFAULT_PERIOD }
    }

    /// Moves it to `node`.
    pub fn to(mut self, node: usize) -> Self {
        self.to = Some(node);
        self
    }

    /// Looks at the condition at most once per `period` (100 ms by
    /// default; zero: at every slow path).
    pub fn every(mut self, period: Duration) -> Self {
        self.every = period;
        self
    }

    /// The node watched.
    pub fn watched(&self) -> usize {
        self.watch
    }

    /// The threshold, in bytes.
    pub fn free_below(&self) -> u64 {
        self.free_below
    }
}

/// A cache's migration state and counters.
pub(crate) struct Moves {
    /// One migration at a time (a demotion only tries it).
    moving: Mutex<()>,
    /// The node every node's slabs lie on since the last migration
    /// (`NOWHERE`: each on its own).
    placed: AtomicUsize,
    pub(crate) migrations: AtomicU64,
    pub(crate) moved_bytes: AtomicU64,
    pub(crate) demotions: AtomicU64,
    /// The demotion condition: the watched node (`NOWHERE`: none), written
    /// last when one is set, and read first.
    watch: AtomicUsize,
    below: AtomicU64,
    target: AtomicUsize,
    every_ms: AtomicU64,
    /// When it is next looked at (`os::monotonic_ms`).
    next_ms: AtomicU64,
}

impl Moves {
    pub(crate) const fn new() -> Self {
        Moves {
            moving: Mutex::new(()),
            placed: AtomicUsize::new(NOWHERE),
            migrations: AtomicU64::new(0),
            moved_bytes: AtomicU64::new(0),
            demotions: AtomicU64::new(0),
            watch: AtomicUsize::new(NOWHERE),
            below: AtomicU64::new(0),
            target: AtomicUsize::new(NOWHERE),
            every_ms: AtomicU64::new(0),
            next_ms: AtomicU64::new(0),
        }
    }

    /// The node every node's slabs were moved to, if the cache was migrated.
    pub(crate) fn placed(&self) -> Option<usize> {
        Some(self.placed.load(Ordering::Relaxed)).filter(|&n| n != NOWHERE)
    }

    /// The `fork()` handlers' part: taken before the cache's node locks,
    /// as a migration takes them.
    pub(crate) fn lock_for_fork(&self) {
        self.moving.lock_raw();
    }

    /// Releases what [`lock_for_fork`](Self::lock_for_fork) took.
    ///
    /// # Safety
    /// Taken by `lock_for_fork` on this thread (or the thread a forked
    /// child was copied from).
    pub(crate) unsafe fn unlock_after_fork(&self) {
        // SAFETY: taken by `lock_for_fork` (the caller's word).
        unsafe { self.moving.unlock_raw() };
    }
}

impl Core {
    /// The node whose memory holds the slabs of node `list`.
    #[inline]
    pub(crate) fn memory_node(&self, list: usize) -> usize {
        self.moves.placed().unwrap_or(list)
    }

    /// The kernel node new chunks of node `list` are mapped on.
    pub(crate) fn phys_for(&self, list: usize) -> usize {
        self.topo.physical_node(self.memory_node(list))
    }

    /// Moves every node's slabs to `to` (see the module documentation).
    pub(crate) fn migrate(&self, to: usize) -> Result<Migration> {
        self.check_target(to)?;
        let _one = self.moves.moving.lock();
        self.migrate_locked(to)
    }

    fn check_target(&self, to: usize) -> Result<()> {
        self.topo.check_node(to)?;
        if !self.topo.memory_nodes().contains(to) {
            return Err(Error::InvalidNode { node: to, reason: "the node has no memory" });
        }
        if !self.topo.allowed_nodes().contains(to) {
            return Err(Error::InvalidNode { node: to, reason: "not in this process's allowed memory nodes" });
        }
        Ok(())
    }

    /// [`migrate`](Self::migrate), `moving` held.
    fn migrate_locked(&self, to: usize) -> Result<Migration> {
        let t0 = Instant::now();
        // A registered region that cannot move fails the whole migration
        // before anything moves.
        for ns in self.nodes.iter() {
            let s = ns.lock();
            if s.chunks.registrar().is_some_and(|r| !r.can_move())
                && let Some(e) = s.chunks.extents(self.slab_bytes).into_iter().find(|e| e.registered)
            {
                let node = s.chunks.region(&e).node;
                return Err(Error::RegisteredRegion { addr: e.base, len: e.len, node });
            }
        }
        let phys = self.topo.physical_node(to);
        let mut rep = Migration::new(to);
        let before = self.moves.placed();
        // New chunks land on `to` from here on: a refill that maps one
        // before its node's chunks are listed below is listed and moved
        // with them (the list is read under the same lock).
        self.moves.placed.store(to, Ordering::Relaxed);
        for (list, ns) in self.nodes.iter().enumerate() {
            let from = before.unwrap_or(list);
            let extents = {
                let mut s = ns.lock();
                // New pages of the node's chunks land on `to` too.
                s.chunks.rebind(phys, to)?;
                s.chunks.extents(self.slab_bytes)
            };
            for e in extents {
                if e.registered {
                    self.move_registered(ns, e, from, phys, &mut rep)?;
                } else {
                    self.move_plain(ns, e, phys, &mut rep)?;
                }
            }
        }
        self.moves.migrations.fetch_add(1, Ordering::Relaxed);
        rep.took = t0.elapsed();
        Ok(rep)
    }

    /// Moves a chunk no registrar holds, a batch under the lock at a time.
    fn move_plain(&self, ns: &NodeSlabs, e: Extent, phys: usize, rep: &mut Migration) -> Result<()> {
        let mut off = 0;
        loop {
            let s = ns.lock();
            // Unmapped since (its last slab went): nothing left to move.
            let Some(now) = s.chunks.extent(e.base, self.slab_bytes) else { return Ok(()) };
            if off >= now.used {
                return Ok(());
            }
            let n = ((now.used - off) / now.page_size).min(MOVE_BATCH);
            self.move_batch(now.base + off, n, now.page_size, phys, rep)?;
            drop(s);
            off += n * now.page_size;
        }
    }

    /// Moves a registered chunk through its registrar, under the lock
    /// throughout: released, moved, registered again.
    fn move_registered(&self, ns: &NodeSlabs, e: Extent, from: usize, phys: usize, rep: &mut Migration) -> Result<()> {
        let mut s = ns.lock();
        let Some(e) = s.chunks.extent(e.base, self.slab_bytes) else { return Ok(()) };
        let Some(r) = s.chunks.registrar().cloned() else { return Ok(()) };
        let after = s.chunks.region(&e);
        let before = super::Region { node: from, ..after };
        if let Err(refusal) = r.release_for_move(&before) {
            let present = self.present_pages(e.base, e.used, e.page_size);
            rep.stuck(Stuck::Registrar(refusal), present, e.page_size);
            return Ok(());
        }
        let end = e.used;
        // A released pin may go a little later than the release (io_uring
        // before Linux 6.4 drops it from a kernel worker, up to a second
        // on): pages still pinned are tried again for a while.
        let deadline = Instant::now() + RELEASE_WAIT;
        let mut wait = Duration::from_millis(5);
        let mut first = true;
        let moved = loop {
            let mut pass = Migration::new(rep.to);
            let mut off = 0;
            let mut r = Ok(());
            while off < end && r.is_ok() {
                let n = ((end - off) / e.page_size).min(MOVE_BATCH);
                r = self.move_batch(e.base + off, n, e.page_size, phys, &mut pass);
                off += n * e.page_size;
            }
            rep.pages_moved += pass.pages_moved;
            rep.bytes_moved += pass.bytes_moved;
            if first {
                rep.pages_already += pass.pages_already;
            }
            first = false;
            let busy = pass.unmoved.iter().any(|u| u.why == Stuck::Busy);
            if r.is_err() || !busy || Instant::now() + wait > deadline {
                for u in pass.unmoved {
                    rep.stuck(u.why, u.pages, e.page_size);
                }
                break r;
            }
            std::thread::sleep(wait);
            wait = (wait * 2).min(Duration::from_millis(100));
        };
        // Registered again whatever the move did: pages that stayed are as
        // good to the registrar as moved ones.
        if let Err(refusal) = r.register_moved(&after) {
            s.chunks.lose_registration(e.base);
            let errno = match refusal {
                Refusal::Errno(e) => e,
                Refusal::Memlock { .. } => libc::ENOMEM,
            };
            return Err(Error::Registration { node: after.node, len: after.len, errno });
        }
        rep.regions_moved += 1;
        moved
    }

    /// Moves the `n` pages of `page` bytes from `start` that are present
    /// and elsewhere to kernel node `phys`, counting them in `rep`. The
    /// caller holds the lock of the node whose chunk they are.
    fn move_batch(&self, start: usize, n: usize, page: usize, phys: usize, rep: &mut Migration) -> Result<()> {
        debug_assert!(n <= MOVE_BATCH);
        let mut addrs = [core::ptr::null::<u8>(); MOVE_BATCH];
        let mut st = [0i32; MOVE_BATCH];
        for (i, a) in addrs[..n].iter_mut().enumerate() {
            *a = (start + i * page) as *const u8;
        }
        mem::page_nodes(&addrs[..n], &mut st[..n])?;
        let mut todo = [core::ptr::null::<u8>(); MOVE_BATCH];
        let mut k = 0;
        for (i, &s) in st[..n].iter().enumerate() {
            if s == phys as i32 {
                rep.pages_already += 1;
            } else if s >= 0 {
                todo[k] = addrs[i];
                k += 1;
            }
            // Negative: not present (never touched, or given back): nothing
            // to move.
        }
        if k == 0 {
            return Ok(());
        }
        // Unwritten statuses keep this mark (see below).
        st[..k].fill(i32::MIN);
        // SAFETY: the pages are in a chunk of this cache that the caller's
        // lock keeps mapped; a cache hands out no physical address that
        // the kernel does not know of (`phys_addr` asks for a locked pool,
        // whose pages move too: see `DmaPool::migrate`).
        let failed = unsafe { pages::move_to(&todo[..k], phys, &mut st[..k])? };
        if failed > 0 {
            // When pages fail to migrate, the kernel leaves the statuses of
            // the pages it tried unwritten (it returns only how many
            // failed): ask again where each of those is. One still
            // elsewhere could not be isolated or migrated: pinned or busy.
            let mut again = [0i32; MOVE_BATCH];
            mem::page_nodes(&todo[..k], &mut again[..k])?;
            for (s, &a) in st[..k].iter_mut().zip(&again[..k]) {
                if *s == i32::MIN {
                    *s = if a == phys as i32 { a } else { -libc::EBUSY };
                }
            }
        }
        let mut moved = 0;
        for &s in &st[..k] {
            if s == phys as i32 {
                moved += 1;
            } else if s < 0 && -s != libc::ENOENT {
                rep.stuck(Stuck::of_errno(-s), 1, page);
            }
        }
        rep.pages_moved += moved;
        rep.bytes_moved += (moved * page) as u64;
        self.moves.moved_bytes.fetch_add((moved * page) as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Present pages of `[start, start + len)`, of `page` bytes.
    fn present_pages(&self, start: usize, len: usize, page: usize) -> usize {
        let mut count = 0;
        self.each_page_node(start, len, page, |s| count += usize::from(s >= 0));
        count
    }

    /// Calls `f` with the kernel node (or negative errno) of each page.
    fn each_page_node(&self, start: usize, len: usize, page: usize, mut f: impl FnMut(i32)) {
        let mut addrs = [core::ptr::null::<u8>(); MOVE_BATCH];
        let mut st = [0i32; MOVE_BATCH];
        let mut off = 0;
        while off < len {
            let n = ((len - off) / page).clamp(1, MOVE_BATCH);
            for (i, a) in addrs[..n].iter_mut().enumerate() {
                *a = (start + off + i * page) as *const u8;
            }
            if mem::page_nodes(&addrs[..n], &mut st[..n]).is_ok() {
                st[..n].iter().for_each(|&s| f(s));
            }
            off += n * page;
        }
    }

    /// Where the cache's pages are now: (node, pages, bytes) per node that
    /// holds any, by node. A page query over every chunk's used part; the
    /// node's lock is held only to list its chunks, not across the queries,
    /// which for a cache of gigabytes take a while (a query touches no
    /// memory: a chunk unmapped meanwhile counts as whatever is mapped
    /// there then, most often nothing).
    pub(crate) fn resident(&self) -> Vec<(usize, usize, u64)> {
        let mut by_phys = [(0usize, 0u64); crate::topology::MAX_NODES];
        for ns in self.nodes.iter() {
            let extents = ns.lock().chunks.extents(self.slab_bytes);
            for e in extents {
                self.each_page_node(e.base, e.used, e.page_size, |n| {
                    if let Some(slot) = usize::try_from(n).ok().and_then(|n| by_phys.get_mut(n)) {
                        slot.0 += 1;
                        slot.1 += e.page_size as u64;
                    }
                });
            }
        }
        let mut out: Vec<(usize, usize, u64)> = Vec::new();
        for (phys, &(pages, bytes)) in by_phys.iter().enumerate().filter(|(_, p)| p.0 > 0) {
            let node = self.topo.logical_node(phys).unwrap_or(phys);
            match out.iter_mut().find(|o| o.0 == node) {
                Some(o) => {
                    o.1 += pages;
                    o.2 += bytes;
                }
                None => out.push((node, pages, bytes)),
            }
        }
        out.sort_unstable();
        out
    }

    /// Sets (or with `None` clears) the demotion condition.
    pub(crate) fn set_demotion(&self, d: Option<Demotion>) -> Result<()> {
        let m = &self.moves;
        let Some(d) = d else {
            m.watch.store(NOWHERE, Ordering::Release);
            return Ok(());
        };
        self.topo.check_node(d.watch)?;
        let to = match d.to {
            Some(n) => n,
            None => self
                .topo
                .nearest_lower_tier(d.watch)
                .ok_or(Error::InvalidNode { node: d.watch, reason: "no lower-tier node to demote to: name one" })?,
        };
        self.check_target(to)?;
        // Cleared first so that a refill never sees half a condition.
        m.watch.store(NOWHERE, Ordering::Release);
        m.below.store(d.free_below, Ordering::Relaxed);
        m.target.store(to, Ordering::Relaxed);
        m.every_ms.store(d.every.as_millis().min(u128::from(u64::MAX)) as u64, Ordering::Relaxed);
        m.next_ms.store(0, Ordering::Relaxed);
        m.watch.store(d.watch, Ordering::Release);
        Ok(())
    }

    /// Looks at the demotion condition, if one is set and due: from the
    /// slow paths (allocation and free), with no lock held.
    #[inline]
    pub(crate) fn check_demotion(&self) {
        if self.moves.watch.load(Ordering::Relaxed) != NOWHERE {
            self.check_demotion_slow();
        }
    }

    #[cold]
    #[inline(never)]
    fn check_demotion_slow(&self) {
        let m = &self.moves;
        let now = crate::os::monotonic_ms();
        let next = m.next_ms.load(Ordering::Relaxed);
        let every = m.every_ms.load(Ordering::Relaxed);
        // One thread looks per period.
        if now < next || m.next_ms.compare_exchange(next, now + every, Ordering::Relaxed, Ordering::Relaxed).is_err() {
            return;
        }
        let watch = m.watch.load(Ordering::Acquire);
        if watch == NOWHERE {
            return;
        }
        let (below, to) = (m.below.load(Ordering::Relaxed), m.target.load(Ordering::Relaxed));
        if m.placed() == Some(to) || self.topo.free_memory(watch).is_ok_and(|free| free >= below) {
            return;
        }
        // A migration running now (by hand, or another thread's demotion)
        // is left to finish; the condition is looked at again next period.
        let Some(_one) = m.moving.try_lock() else { return };
        if self.migrate_locked(to).is_ok() {
            m.demotions.fetch_add(1, Ordering::Relaxed);
        }
    }
}
