//! Moving a pool to another node while it is in use, the demotion condition
//! that moves it by itself, and where its pages are.
//!
//! A migration first binds every chunk of every node's slabs to the new
//! node, so that pages faulted from then on land there, and sets the node
//! new chunks are mapped on. It then moves the pages already present with
//! `move_pages`, chunk by chunk, without the node's slab lock: a chunk
//! being moved is marked so (`Chunks::begin_move`), which keeps it mapped
//! (its last slab going meanwhile unmaps it when the move ends), so
//! refills, frees and `fork()` never wait on a move. Threads go on
//! allocating and freeing from their magazines throughout; the kernel
//! copies each page and maps the copy at the same address, so no object
//! moves and none is copied by us. A chunk's present pages are its used
//! part, or all of it where its pages are committed whole (huge pages, or
//! a registered chunk, which its registrar pins).
//!
//! When the kernel refuses pages, they are counted by reason and the rest
//! goes on: a target without room fails a whole `move_pages` call
//! (`ENOMEM`), after which the pages left are counted as
//! [`Stuck::NodeFull`] without asking again. A chunk whose rebinding the
//! kernel refuses still has its pages moved (its new pages fault where
//! they did; counted in [`Migration::chunks_unbound`]).
//!
//! A registered chunk (a [`Registrar`](super::Registrar) pins it for the
//! kernel or a device) moves only through its registrar: released (no slab
//! is carved from it until it is registered again), moved, registered
//! again, the names it had kept
//! ([`Registrar::can_move`](super::Registrar::can_move)); still-pinned
//! pages are tried again for up to 2 s, sleeping without the node's lock.
//! A registrar that cannot release at all makes the migration fail before
//! anything moves; one that cannot register the region again leaves it
//! unregistered, counted in [`Migration::registrations_lost`], and
//! registered again on demand ([`RawCache::register_again`](super::RawCache::register_again)).
//!
//! A [`Demotion`] is looked at on the cache's slow paths (a thread's
//! magazines running empty or full), at most once per its period: no
//! thread of the allocator's own runs it, and the thread that trips it does
//! one bounded step: the first step of a pass rebinds every chunk (an
//! `mbind` each), each later one queries and moves at most
//! [`STEP_BYTES`] (or one huge page) with `move_pages`; none sleeps, none
//! holds the node's slab lock while the kernel moves pages, none calls a
//! registrar (registered chunks are left to [`migrate`](super::RawCache::migrate)).
//! A pool whose buffers' physical addresses were handed out
//! ([`DmaBuf::phys_addr`](super::DmaBuf::phys_addr)) is demoted only if
//! its demotion says so ([`Demotion::moving_device_buffers`]).

use core::fmt;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::chunk::Extent;
use super::kmem::{KmemCache, NOWHERE, Pass};
use super::node::NodeSlabs;
use super::register::Refusal;
use crate::error::{Error, Result};
use crate::os::mem;
use crate::os::pages::{self, MOVE_BATCH};

/// How long pages of a released registered region that are still pinned
/// are tried again.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

/// How often a demotion condition is looked at by default.
const DEFAULT_PERIOD: Duration = Duration::from_millis(100);

/// The most a demotion's step moves (or queries) after its first: 2 MiB of
/// base pages, or one huge page.
pub const STEP_BYTES: usize = 2 << 20;

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

    /// Whether trying again later may move the pages (a demotion does).
    fn transient(self) -> bool {
        matches!(self, Stuck::Busy | Stuck::NodeFull)
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
    /// Registered regions released for the move that their registrar then
    /// refused to register again: unregistered now (the pool registers
    /// them again on demand), with the last refusal's errno.
    pub registrations_lost: usize,
    /// The errno of the last refusal counted in `registrations_lost`
    /// (`EXDEV`: the kernel moved pages off `to` as it pinned them again,
    /// under [`OffNodePins::Refuse`](super::OffNodePins::Refuse)).
    pub lost_errno: i32,
    /// Chunks the kernel refused to rebind to `to` (`mbind`): their pages
    /// moved, but new ones fault where they did before.
    pub chunks_unbound: usize,
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
            registrations_lost: 0,
            lost_errno: 0,
            chunks_unbound: 0,
            took: Duration::ZERO,
        }
    }

    /// Pages that did not move, for any reason.
    pub fn pages_unmoved(&self) -> usize {
        self.unmoved.iter().map(|u| u.pages).sum()
    }

    /// Whether the pool lies wholly on `to` and nothing of it was refused
    /// (every page moved or there already, every chunk bound there, every
    /// region registered again).
    pub fn complete(&self) -> bool {
        self.unmoved.is_empty() && self.chunks_unbound == 0 && self.registrations_lost == 0
    }

    fn stuck(&mut self, why: Stuck, pages: usize, page_size: usize) {
        if pages == 0 {
            return;
        }
        let bytes = (pages * page_size) as u64;
        match self.unmoved.iter_mut().find(|u| u.why == why) {
            Some(u) => {
                u.pages += pages;
                u.bytes += bytes;
            }
            None => self.unmoved.push(Unmoved { why, pages, bytes }),
        }
    }

    fn refused_for_now(&self) -> usize {
        self.unmoved.iter().filter(|u| u.why.transient()).map(|u| u.pages).sum()
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
        if self.registrations_lost > 0 {
            write!(f, "; {} regions not registered again (errno {})", self.registrations_lost, self.lost_errno)?;
        }
        if self.chunks_unbound > 0 {
            write!(f, "; {} chunks not rebound", self.chunks_unbound)?;
        }
        Ok(())
    }
}

/// A condition under which a pool moves itself to another node: the free
/// memory of the node it watches drops below a threshold (another program
/// or cache filled it), and cold pools make room by going to the lower
/// tier. A free memory that cannot be read is not low.
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
    device_buffers: bool,
}

impl Demotion {
    /// Moves the pool when `node` has fewer than `bytes` free (`MemFree`),
    /// to the lower-tier node nearest `node` unless [`to`](Self::to) names
    /// one.
    pub fn when_free_below(node: usize, bytes: u64) -> Self {
        Demotion { watch: node, free_below: bytes, to: None, every: DEFAULT_PERIOD, device_buffers: false }
    }

    /// Moves it to `node`.
    pub fn to(mut self, node: usize) -> Self {
        self.to = Some(node);
        self
    }

    /// Looks at the condition at most once per `period` (100 ms by
    /// default; zero: at every slow path). Each look that finds a demotion
    /// under way takes one of its steps.
    pub fn every(mut self, period: Duration) -> Self {
        self.every = period;
        self
    }

    /// Moves a pool whose buffers' physical addresses were handed out
    /// ([`DmaBuf::phys_addr`](super::DmaBuf::phys_addr)) too: the caller
    /// says no device holds them any more. Without it such a pool is not
    /// demoted (it still moves with `migrate`).
    pub fn moving_device_buffers(mut self, yes: bool) -> Self {
        self.device_buffers = yes;
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

/// How much of a chunk one pass over it may move.
#[derive(Clone, Copy)]
enum Budget {
    /// All of it (a migration).
    Whole,
    /// At most this many bytes, or one page (a demotion's step).
    Bytes(usize),
}

impl KmemCache {
    /// Moves every node's slabs to `to` (see the module documentation).
    pub(crate) fn migrate(&self, to: usize) -> Result<Migration> {
        self.check_target(to)?;
        let mut progress = self.moves.moving.lock();
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
        let mut rep = Migration::new(to);
        let before = self.moves.placed();
        self.place_on(to, &mut rep);
        let phys = self.topo.physical_node(to);
        let mut full = false;
        for (list, ns) in self.nodes.iter().enumerate() {
            let from = before.unwrap_or(list);
            let bases: Vec<usize> = ns.lock().chunks.extents(self.slab_bytes).iter().map(|e| e.base).collect();
            for base in bases {
                self.move_chunk(ns, base, 0, Budget::Whole, true, from, phys, &mut full, &mut rep);
            }
        }
        // A migration covers whatever a demotion's pass had left.
        progress.pass = None;
        self.moves.settled.store(rep.complete(), Ordering::Relaxed);
        self.moves.migrations.fetch_add(1, Ordering::Relaxed);
        rep.took = t0.elapsed();
        Ok(rep)
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

    /// New chunks land on `to` from here on, and every chunk is bound
    /// there. (A refill that maps a chunk before its node's chunks are
    /// bound here maps it on `to` already: `placed` is read under the same
    /// lock.) The caller holds `moving`.
    fn place_on(&self, to: usize, rep: &mut Migration) {
        self.moves.placed.store(to, Ordering::Relaxed);
        let phys = self.topo.physical_node(to);
        for ns in self.nodes.iter() {
            if let Some((_, n)) = ns.lock().chunks.rebind(phys, to) {
                rep.chunks_unbound += n;
            }
        }
    }

    /// Moves the present pages of the chunk at `base` on `ns` from `off`
    /// on, as much as `budget` allows, to kernel node `phys`; a registered
    /// chunk only if `registered` (released and registered again through
    /// its registrar; it was on node `from`). Returns where a later step
    /// goes on (`None`: the chunk is done, or gone). `full` says the
    /// target had no room for a whole call: pages left are counted, not
    /// tried. The caller holds `moving`; the node's lock is taken only to
    /// begin and end the move.
    #[allow(clippy::too_many_arguments)]
    fn move_chunk(
        &self,
        ns: &NodeSlabs,
        base: usize,
        off: usize,
        budget: Budget,
        registered: bool,
        from: usize,
        phys: usize,
        full: &mut bool,
        rep: &mut Migration,
    ) -> Option<usize> {
        let (e, reg) = {
            let mut s = ns.lock();
            let e = s.chunks.extent(base, self.slab_bytes)?;
            let reg = match s.chunks.registrar().cloned().filter(|_| e.registered) {
                Some(_) if !registered => return None,
                Some(r) => {
                    let after = s.chunks.region(&e);
                    let before = super::Region { node: from, ..after };
                    if let Err(refusal) = r.release_for_move(&before) {
                        drop(s);
                        let present = self.present_pages(e.base, e.resident_len(), e.page_size);
                        rep.stuck(Stuck::Registrar(refusal), present, e.page_size);
                        return None;
                    }
                    Some((r, after))
                }
                None => None,
            };
            let began = s.chunks.begin_move(base, reg.is_some());
            debug_assert!(began);
            (e, reg)
        };
        // The chunk stays mapped until `end_move`: the node's lock is free.
        let end = e.resident_len();
        let limit = match budget {
            Budget::Whole => end,
            Budget::Bytes(b) => end.min(off + b.max(e.page_size)),
        };
        if reg.is_some() {
            // A released pin may go a little later than the release
            // (io_uring before Linux 6.4 drops it from a kernel worker, up
            // to a second on): pages still pinned are tried again for a
            // while, sleeping without any lock but `moving`.
            let deadline = Instant::now() + RELEASE_WAIT;
            let mut wait = Duration::from_millis(5);
            let mut first = true;
            loop {
                let mut pass = Migration::new(rep.to);
                self.move_range(e, off, limit, phys, full, &mut pass);
                rep.pages_moved += pass.pages_moved;
                rep.bytes_moved += pass.bytes_moved;
                if first {
                    rep.pages_already += pass.pages_already;
                }
                first = false;
                let busy = pass.unmoved.iter().any(|u| u.why == Stuck::Busy);
                if !busy || Instant::now() + wait > deadline {
                    for u in pass.unmoved {
                        rep.stuck(u.why, u.pages, e.page_size);
                    }
                    break;
                }
                std::thread::sleep(wait);
                wait = (wait * 2).min(Duration::from_millis(100));
            }
        } else {
            self.move_range(e, off, limit, phys, full, rep);
        }
        let at = limit;
        let mut s = ns.lock();
        if let Some((r, after)) = reg {
            // Registered again whatever the move did: pages that stayed are
            // as good to the registrar as moved ones. Pages the kernel
            // moved off the target as it pinned them again lose the
            // registration as a refusal would (`EXDEV`, under
            // `OffNodePins::Refuse`).
            let before = s.chunks.off_node_now(e.base);
            let moved = r.register_moved(&after).and_then(|()| {
                s.chunks
                    .settle_pins(e.base, &*r, &after, before)
                    .map_err(|err| Refusal::Errno(err.errno().unwrap_or(libc::EXDEV)))
            });
            match moved {
                Ok(()) => rep.regions_moved += 1,
                Err(refusal) => {
                    s.chunks.lose_registration(e.base);
                    rep.registrations_lost += 1;
                    rep.lost_errno = match refusal {
                        Refusal::Errno(e) => e,
                        Refusal::Memlock { .. } => libc::ENOMEM,
                    };
                }
            }
        }
        s.chunks.end_move(e.base);
        (at < end).then_some(at)
    }

    /// [`move_batch`](Self::move_batch) over `[off, limit)` of chunk `e`.
    fn move_range(&self, e: Extent, off: usize, limit: usize, phys: usize, full: &mut bool, rep: &mut Migration) {
        let mut at = off;
        while at < limit {
            let n = ((limit - at) / e.page_size).clamp(1, MOVE_BATCH);
            self.move_batch(e.base + at, n, e.page_size, phys, full, rep);
            at += n * e.page_size;
        }
    }

    /// Moves the `n` pages of `page` bytes from `start` that are present
    /// and elsewhere to kernel node `phys`, counting them in `rep`; with
    /// `full` (the target refused a whole call for want of room) only
    /// counts them. The chunk is marked moving (it stays mapped).
    fn move_batch(&self, start: usize, n: usize, page: usize, phys: usize, full: &mut bool, rep: &mut Migration) {
        debug_assert!(n <= MOVE_BATCH);
        let mut addrs = [core::ptr::null::<u8>(); MOVE_BATCH];
        let mut st = [0i32; MOVE_BATCH];
        for (i, a) in addrs[..n].iter_mut().enumerate() {
            *a = (start + i * page) as *const u8;
        }
        if let Err(err) = mem::page_nodes(&addrs[..n], &mut st[..n]) {
            // Where they are is unknown: the batch's pages count as unmoved.
            rep.stuck(Stuck::Os(err.errno().unwrap_or(libc::EIO)), n, page);
            return;
        }
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
            return;
        }
        if *full {
            rep.stuck(Stuck::NodeFull, k, page);
            return;
        }
        // Unwritten statuses keep this mark (see below).
        st[..k].fill(i32::MIN);
        // SAFETY: the pages are in a chunk of this cache that stays mapped
        // while marked moving; a cache hands out no physical address that
        // the kernel does not know of (`phys_addr` asks for a locked pool,
        // whose pages move too: see `DmaPool::migrate`, and a demotion
        // leaves a pool that handed one out alone).
        let failed = match unsafe { pages::move_to(&todo[..k], phys, &mut st[..k]) } {
            Ok(f) => f,
            Err(err) => {
                // The whole call refused: for want of room (the target is
                // full: the rest is only counted), or another errno.
                let errno = err.errno().unwrap_or(libc::EIO);
                *full |= errno == libc::ENOMEM;
                rep.stuck(Stuck::of_errno(errno), k, page);
                return;
            }
        };
        if failed > 0 {
            // When pages fail to migrate, the kernel leaves the statuses of
            // the pages it tried unwritten (it returns only how many
            // failed): ask again where each of those is. One still
            // elsewhere could not be isolated or migrated: pinned or busy.
            let mut again = [0i32; MOVE_BATCH];
            if mem::page_nodes(&todo[..k], &mut again[..k]).is_err() {
                again[..k].fill(-libc::EBUSY);
            }
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
    /// holds any, by node. A page query over every chunk's present part;
    /// the node's lock is held only to list its chunks, not across the
    /// queries, which for a cache of gigabytes take a while (a query
    /// touches no memory: a chunk unmapped meanwhile counts as whatever is
    /// mapped there then, most often nothing).
    pub(crate) fn resident(&self) -> Vec<(usize, usize, u64)> {
        let mut by_phys = [(0usize, 0u64); crate::topology::MAX_NODES];
        for ns in self.nodes.iter() {
            let extents = ns.lock().chunks.extents(self.slab_bytes);
            for e in extents {
                self.each_page_node(e.base, e.resident_len(), e.page_size, |n| {
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

    /// Registers again the chunk holding `obj` if a migration lost its
    /// registration (see [`Chunks::register_again`](super::chunk::Chunks::register_again)).
    pub(crate) fn register_again(&self, node: usize, obj: usize) -> Result<bool> {
        self.nodes[node].lock().chunks.register_again(obj)
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
        m.device_ok.store(d.device_buffers, Ordering::Relaxed);
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

    /// One look at the condition, and at most one step of a demotion (see
    /// the module documentation for its bound).
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
        if watch == NOWHERE || (m.device_addresses.load(Ordering::Relaxed) && !m.device_ok.load(Ordering::Relaxed)) {
            return;
        }
        let to = m.target.load(Ordering::Relaxed);
        // A migration running now (by hand, or another thread's step) is
        // left to finish; the condition is looked at again next period.
        let Some(mut progress) = m.moving.try_lock() else { return };
        let pass = match progress.pass {
            Some(p) if p.to == to => p,
            _ => {
                let done = m.placed() == Some(to) && m.settled.load(Ordering::Relaxed);
                // A free memory that cannot be read is not low.
                let low = self.topo.free_memory(watch).is_ok_and(|free| free < m.below.load(Ordering::Relaxed));
                if done || !low {
                    return;
                }
                // The pass's first step: new pages land on `to` from now.
                if m.placed() != Some(to) {
                    m.demotions.fetch_add(1, Ordering::Relaxed);
                }
                m.settled.store(false, Ordering::Relaxed);
                m.migrations.fetch_add(1, Ordering::Relaxed);
                let mut rep = Migration::new(to);
                self.place_on(to, &mut rep);
                progress.pass = Some(Pass { to, list: 0, base: 0, off: 0, refused: 0 });
                return;
            }
        };
        progress.pass = self.demotion_step(pass);
    }

    /// One step of a demotion's pass: at most [`STEP_BYTES`] (or one huge
    /// page) of the first chunk at or above the pass's place that it has
    /// not done. The pass, to go on, or `None` when it is over (the pool
    /// then settled if the kernel refused nothing for now).
    fn demotion_step(&self, mut pass: Pass) -> Option<Pass> {
        let phys = self.topo.physical_node(pass.to);
        let mut full = false;
        while pass.list < self.nodes.len() {
            let ns = &self.nodes[pass.list];
            let next = {
                let s = ns.lock();
                s.chunks.extents(self.slab_bytes).into_iter().find(|e| e.base >= pass.base && !e.registered)
            };
            let Some(e) = next else {
                pass = Pass { list: pass.list + 1, base: 0, off: 0, ..pass };
                continue;
            };
            let off = if e.base == pass.base { pass.off } else { 0 };
            let mut rep = Migration::new(pass.to);
            let left = self.move_chunk(
                ns,
                e.base,
                off,
                Budget::Bytes(STEP_BYTES),
                false,
                pass.list,
                phys,
                &mut full,
                &mut rep,
            );
            pass.refused += rep.refused_for_now();
            pass = match left {
                Some(off) => Pass { base: e.base, off, ..pass },
                None => Pass { base: e.base + 1, off: 0, ..pass },
            };
            return Some(pass);
        }
        self.moves.settled.store(pass.refused == 0, Ordering::Relaxed);
        None
    }
}
