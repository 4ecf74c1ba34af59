//! Node-bound chunks that a cache's slabs are carved from, per node.
//!
//! A slab of its own mapping costs a kernel VMA each: 4 GiB of 4 KiB objects
//! (128 KiB slabs) took 33,827 mappings, and the kernel's default
//! `vm.max_map_count` (65,530) capped a cache near 8 GiB where storage
//! servers keep tens of GiB of I/O buffers. So slabs are *slots* of large
//! chunks instead: one `mmap` + `mbind` per chunk, slots aligned to the slab
//! size (the slab header is still found by masking an object's address).
//! A chunk's length doubles with what the node already holds, from eight
//! slots up to [`MAX_CHUNK`]: a small cache maps little, a 32 GiB one about
//! 130 chunks.
//!
//! A slab given back has its pages returned to the OS at once
//! (`MADV_DONTNEED`: what `shrink` promises) and its slot kept for the next
//! slab; a chunk whose last slab goes is unmapped. Slots are taken lowest
//! chunk first, so that chunks empty out and go once a cache shrinks.
//!
//! Huge pages, when a cache asks ([`Huge`]): a chunk aligned to and sized
//! in 2 MiB pages, with `MADV_HUGEPAGE` (THP) or from the node's hugetlb
//! pool (committed at once and checked to be on the node; where the pool
//! has too few free pages, base pages instead, counted). A huge chunk keeps
//! its pages until the chunk goes: returning a slab's part would split a
//! transparent huge page, and a hugetlb page cannot be returned in part.
//!
//! A pool with a [`Registrar`] registers each chunk once it is mapped and
//! bound, before a slab of it is handed out, and unregisters it before it
//! is unmapped; a registered chunk's given-back slots keep their pages (see
//! `register.rs`).
//!
//! Everything here runs under the node's slab mutex.

use core::ptr::NonNull;
use std::sync::Arc;

use super::pins::{self, OffNodePins};
use super::register::{Refusal, Region, Registrar};
use crate::error::{Error, Result};
use crate::os::mem::{self, BindFlags, HUGE_PAGE, Huge, MemPolicy};
use crate::os::thread::fork_generation;

/// Largest chunk. Address space only until slabs are touched.
pub(crate) const MAX_CHUNK: usize = 256 << 20;
/// Every chunk starts on a multiple of this, the largest slab size
/// (`kmem::MAX_SLAB`, asserted there): an object's address rounded down to
/// any cache's slab size stays in its chunk, so a free into the wrong
/// cache reads a mapped header (and is named), never unmapped memory.
pub(crate) const CHUNK_ALIGN: usize = 4 << 20;
/// Largest hugetlb chunk: its pages are committed when it is mapped.
const MAX_HUGETLB_CHUNK: usize = 32 << 20;
/// Slots in a node's first chunk.
const MIN_SLOTS: usize = 8;

/// One mapping, carved into slots of one size.
struct Chunk {
    base: usize,
    len: usize,
    /// Slots handed out at least once (the rest are untouched).
    carved: usize,
    /// Slots holding a slab.
    used: usize,
    /// Slots given back (their pages returned unless `huge`).
    free: Vec<usize>,
    /// On huge pages, as asked.
    huge: bool,
    /// The size of the pages behind it (hugetlb's, or the base page size).
    page_size: usize,
    /// Registered with the pool's registrar (every chunk of a pool with one,
    /// unless registering it again after a move failed: then registered
    /// again on demand, [`Chunks::register_again`]).
    registered: bool,
    /// A migration is moving its pages, without the node's lock: it stays
    /// mapped until the move ends, even if its last slab goes meanwhile
    /// ([`Chunks::end_move`] unmaps it then).
    moving: bool,
    /// Its registration is released for a move: no slab is carved from it
    /// until it is registered again (a registrar is promised none).
    frozen: bool,
    /// The kernel node it is bound to (at mapping, or by the last move).
    phys: usize,
    /// Of its pages, those the kernel held on another node than `phys`
    /// once the registrar had them (kept with `OffNodePins::Report`).
    off_node: usize,
    /// Pages a refused pin moved off `phys`: they stay there, and are the
    /// pin's doing when the chunk is registered again.
    left_by_pin: usize,
}

/// A chunk as a migration or a placement count sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Extent {
    pub(crate) base: usize,
    /// The chunk's whole length (what a registrar was told of).
    pub(crate) len: usize,
    /// Bytes from `base` that slabs have used, in whole pages of
    /// `page_size` (the rest was never touched).
    pub(crate) used: usize,
    pub(crate) page_size: usize,
    pub(crate) registered: bool,
    /// On huge pages (resident whole, from the first slab on).
    pub(crate) huge: bool,
}

impl Extent {
    /// Bytes from `base` that may hold present pages: the whole chunk when
    /// its pages are committed whole (huge pages; a registered chunk, which
    /// its registrar pins whole), else the part slabs used.
    pub(crate) fn resident_len(&self) -> usize {
        if self.huge || self.registered { self.len } else { self.used }
    }
}

impl Chunk {
    fn has_room(&self, slot: usize) -> bool {
        !self.frozen && (!self.free.is_empty() || (self.carved + 1) * slot <= self.len)
    }
}

/// A node's chunks for one cache, sorted by address.
pub(crate) struct Chunks {
    list: Vec<Chunk>,
    /// No chunk below this index has room.
    first_room: usize,
    /// Chunks that asked for hugetlb pages and got base pages (cumulative).
    pub(crate) huge_fallbacks: u64,
    /// The pool's registrar, and the node (as the topology names it) that
    /// it is told the chunks are on: with one, every chunk is registered.
    registrar: Option<(Arc<dyn Registrar>, usize)>,
    /// What a registration whose pages the kernel moved off the node does.
    pins: OffNodePins,
    /// The cache's name, for the published table of chunks.
    name: Arc<str>,
    /// The fork generation (`os::thread::fork_generation`) the chunks'
    /// `registered` flags are this process's for: in a forked child they
    /// are its parent's, and read as false until [`sync_fork`](Self::sync_fork)
    /// clears them. (The fork handlers do that too, but a single-threaded
    /// process's fork runs none.)
    forks: u64,
}

impl Chunks {
    /// No chunks yet; with `registrar`, each chunk is registered, on `node`,
    /// and `pins` says what a registration the kernel moved off the node
    /// does. Each is listed in the published table under `name`.
    pub(crate) fn new(registrar: Option<(Arc<dyn Registrar>, usize)>, pins: OffNodePins, name: Arc<str>) -> Self {
        Self { list: Vec::new(), first_room: 0, huge_fallbacks: 0, registrar, pins, name, forks: fork_generation() }
    }

    /// Whether this process registered `c` (not a parent before a fork).
    fn holds(&self, c: &Chunk) -> bool {
        c.registered && self.forks == fork_generation()
    }

    /// In a forked child, first: no chunk is registered in it.
    fn sync_fork(&mut self) {
        let now = fork_generation();
        if self.forks != now {
            for c in &mut self.list {
                c.registered = false;
            }
            self.forks = now;
            self.first_room = 0;
        }
    }

    /// Registered chunks, and their bytes.
    pub(crate) fn registered(&self) -> (usize, usize) {
        self.list.iter().filter(|c| self.holds(c)).fold((0, 0), |(n, b), c| (n + 1, b + c.len))
    }

    /// Bytes of registered chunks the kernel held on another node than
    /// theirs once their registrar had them (`OffNodePins::Report`).
    pub(crate) fn pinned_off_node(&self) -> usize {
        self.list.iter().filter(|c| self.holds(c)).map(|c| c.off_node * c.page_size).sum()
    }

    /// Pages of the chunk at `base` on another node than the one it is
    /// bound to, now (before a registration: pages a move left behind are
    /// not the pin's doing); 0 where pins cannot leave or the chunk is gone.
    pub(crate) fn off_node_now(&mut self, base: usize) -> usize {
        let Some(c) = self.find(base) else { return 0 };
        pins::off_node(c.base, c.len, c.page_size, c.phys).unwrap_or(0)
    }

    /// Checks where the kernel left the pages of `region` (chunk at
    /// `region.addr`, bound to `phys`) once its registrar registered it:
    /// pages on another node beyond the `before` there already were the
    /// pin's doing. With any and [`OffNodePins::Refuse`], the registration
    /// is undone and the error says so (the caller unmaps or marks the
    /// chunk); otherwise their count, kept.
    fn check_pins(&self, r: &dyn Registrar, region: &Region, phys: usize, before: usize) -> Result<usize> {
        let base = region.addr.as_ptr() as usize;
        let off = match pins::off_node(base, region.len, region.page_size, phys) {
            Ok(n) => n.saturating_sub(before),
            // Where the pages are cannot be told: a pool that promises them
            // on their node cannot keep the region; one that reports does.
            Err(e) if self.pins == OffNodePins::Refuse => {
                r.unregister(region);
                return Err(e);
            }
            Err(_) => 0,
        };
        if off > 0 && self.pins == OffNodePins::Refuse {
            r.unregister(region);
            return Err(Error::PinsLeftNode { node: region.node, len: region.len, pages: off });
        }
        Ok(off)
    }

    /// Every chunk, for slots of `slot` bytes.
    pub(crate) fn extents(&self, slot: usize) -> Vec<Extent> {
        self.list.iter().map(|c| self.extent_of(c, slot)).collect()
    }

    /// The chunk at `base`, if it is still mapped.
    pub(crate) fn extent(&self, base: usize, slot: usize) -> Option<Extent> {
        let i = self.list.partition_point(|c| c.base < base);
        self.list.get(i).filter(|c| c.base == base).map(|c| self.extent_of(c, slot))
    }

    fn extent_of(&self, c: &Chunk, slot: usize) -> Extent {
        Extent {
            base: c.base,
            len: c.len,
            used: (c.carved * slot).next_multiple_of(c.page_size).min(c.len),
            page_size: c.page_size,
            registered: self.holds(c),
            huge: c.huge,
        }
    }

    /// The pool's registrar, if it has one.
    pub(crate) fn registrar(&self) -> Option<&Arc<dyn Registrar>> {
        self.registrar.as_ref().map(|(r, _)| r)
    }

    /// The region a registrar knows `e` as.
    pub(crate) fn region(&self, e: &Extent) -> Region {
        let node = self.registrar.as_ref().map_or(0, |(_, n)| *n);
        // SAFETY: a mapped chunk's base is never 0.
        Region { addr: unsafe { NonNull::new_unchecked(e.base as *mut u8) }, len: e.len, node, page_size: e.page_size }
    }

    /// Binds every chunk to kernel node `phys` (`MPOL_PREFERRED`, as at
    /// mapping): pages faulted from now on land there, pages present stay
    /// where they are until moved. Regions are described as on `node` from
    /// now on. A chunk the kernel refuses keeps its old policy (its pages
    /// still move when asked; new ones fault where they did): the errno of
    /// the last refusal and how many, if any.
    pub(crate) fn rebind(&mut self, phys: usize, node: usize) -> Option<(i32, usize)> {
        let mut refused = None;
        for c in &mut self.list {
            // SAFETY: a live mapping of ours; a policy change moves nothing.
            let r = unsafe {
                mem::bind(NonNull::new_unchecked(c.base as *mut u8), c.len, MemPolicy::Preferred(phys), BindFlags::NONE)
            };
            match r {
                Ok(()) => {
                    c.phys = phys;
                    // Counted against the old node; counted again as the
                    // chunk is registered on the new one.
                    c.off_node = 0;
                    c.left_by_pin = 0;
                    super::published::rebind(c.base, phys);
                }
                Err(e) => {
                    let n = refused.map_or(0, |(_, n)| n);
                    refused = Some((e.errno().unwrap_or(libc::EIO), n + 1));
                }
            }
        }
        if let Some((_, n)) = &mut self.registrar {
            *n = node;
        }
        refused
    }

    fn find(&mut self, base: usize) -> Option<&mut Chunk> {
        let i = self.list.partition_point(|c| c.base < base);
        self.list.get_mut(i).filter(|c| c.base == base)
    }

    /// A migration starts moving the chunk at `base` (`frozen`: its
    /// registration released): it stays mapped until [`end_move`](Self::end_move).
    /// False if it is no longer mapped.
    pub(crate) fn begin_move(&mut self, base: usize, frozen: bool) -> bool {
        let Some(c) = self.find(base) else { return false };
        debug_assert!(!c.moving && !c.frozen, "a chunk moved by two migrations");
        c.moving = true;
        c.frozen = frozen;
        true
    }

    /// The move of the chunk at `base` ended (its registration, if it was
    /// released, made again or lost): if its last slab went meanwhile, it
    /// goes now.
    pub(crate) fn end_move(&mut self, base: usize) {
        let Some(c) = self.find(base) else {
            debug_assert!(false, "a chunk unmapped while it moved");
            return;
        };
        debug_assert!(c.moving);
        c.moving = false;
        c.frozen = false;
        let (used, i) = (c.used, self.list.partition_point(|c| c.base < base));
        if used == 0 {
            self.unmap_at(i);
        }
        // Its room (a frozen chunk was passed over) or the gap it leaves.
        self.first_room = self.first_room.min(i);
    }

    /// A forked child: no migration runs in it (the thread that ran one in
    /// the parent is not there), so no chunk is moving; and no chunk is
    /// registered in it. Registrations are the parent's (an io_uring
    /// table, a VFIO container, an RDMA protection domain the child shares
    /// or lacks): the child never unregisters them, and registers a chunk
    /// of its own accord before carving a new slab from it (`take`).
    pub(crate) fn after_fork_in_child(&mut self) {
        for c in &mut self.list {
            c.moving = false;
            c.frozen = false;
        }
        self.sync_fork();
    }

    /// After its registrar took the chunk at `base` again once its pages
    /// moved (`region`; `before`: its pages off its node just before, as
    /// [`off_node_now`](Self::off_node_now) counted): where the kernel left them, as
    /// [`check_pins`](Self::check_pins) says. A refusal undoes the
    /// registration and loses it ([`lose_registration`](Self::lose_registration)):
    /// `EXDEV`, the pages left the node.
    pub(crate) fn settle_pins(&mut self, base: usize, r: &dyn Registrar, region: &Region, before: usize) -> Result<()> {
        let Some(phys) = self.find(base).map(|c| c.phys) else { return Ok(()) };
        match self.check_pins(r, region, phys, before) {
            Ok(off) => {
                if let Some(c) = self.find(base) {
                    c.off_node = off;
                }
                Ok(())
            }
            Err(e) => {
                self.lose_registration(base);
                if let (Error::PinsLeftNode { pages, .. }, Some(c)) = (&e, self.find(base)) {
                    c.left_by_pin += pages;
                }
                Err(e)
            }
        }
    }

    /// The chunk at `base` is no longer registered (its registration was
    /// released for a move and could not be made again): it is not
    /// unregistered when it goes, and is registered again on demand.
    pub(crate) fn lose_registration(&mut self, base: usize) {
        if let Some(c) = self.find(base) {
            c.registered = false;
        }
    }

    /// Registers again the chunk holding `addr` if a move lost its
    /// registration: `Ok(true)` when it is registered now (or was), `Ok(false)`
    /// for an address of no chunk; the registrar's refusal as the error.
    pub(crate) fn register_again(&mut self, addr: usize) -> Result<bool> {
        self.sync_fork();
        let Some((r, node)) = self.registrar.clone() else { return Ok(false) };
        let before = {
            let i = self.list.partition_point(|c| c.base <= addr);
            match i.checked_sub(1).map(|i| &self.list[i]) {
                Some(c) if addr < c.base + c.len && !c.registered && !c.frozen => {
                    // Pages an earlier refused pin moved are this pin's to answer for.
                    pins::off_node(c.base, c.len, c.page_size, c.phys).unwrap_or(0).saturating_sub(c.left_by_pin)
                }
                _ => 0,
            }
        };
        let i = self.list.partition_point(|c| c.base <= addr);
        let Some(c) = i.checked_sub(1).map(|i| &mut self.list[i]).filter(|c| addr < c.base + c.len) else {
            return Ok(false);
        };
        if c.registered || c.frozen {
            return Ok(c.registered);
        }
        // SAFETY: a mapped chunk's base is never 0.
        let addr = unsafe { NonNull::new_unchecked(c.base as *mut u8) };
        let region = Region { addr, len: c.len, node, page_size: c.page_size };
        r.register(&region).map_err(|refusal| match refusal {
            Refusal::Errno(errno) => Error::Registration { node, len: c.len, errno },
            Refusal::Memlock { limit, pinned } => Error::MemlockLimit { node, limit, pinned, asked: c.len },
        })?;
        let phys = c.phys;
        // (Refused, it stays unregistered, as it was: asked again next time.)
        let checked = self.check_pins(&*r, &region, phys, before);
        let i = self.list.partition_point(|c| c.base <= addr.as_ptr() as usize) - 1;
        let c = &mut self.list[i];
        match checked {
            Ok(off) => {
                c.registered = true;
                c.off_node = off;
                c.left_by_pin = 0;
                Ok(true)
            }
            Err(e) => {
                if let Error::PinsLeftNode { pages, .. } = e {
                    c.left_by_pin = pages;
                }
                Err(e)
            }
        }
    }

    /// Mappings held.
    pub(crate) fn count(&self) -> usize {
        self.list.len()
    }

    /// The ranges of the chunks on huge pages.
    pub(crate) fn huge_ranges(&self) -> Vec<(usize, usize)> {
        self.list.iter().filter(|c| c.huge).map(|c| (c.base, c.len)).collect()
    }

    /// Of those, mappings on huge pages.
    pub(crate) fn huge(&self) -> usize {
        self.list.iter().filter(|c| c.huge).count()
    }

    /// Bytes of address space held.
    pub(crate) fn reserved(&self) -> usize {
        self.list.iter().map(|c| c.len).sum()
    }

    /// A slot of `slot` bytes (a power of two), aligned to `slot`, on
    /// physical node `phys`: from a chunk with room, else from a new one
    /// backed as `huge` asks.
    /// `strict`: no base pages when hugetlb pages are short (an error).
    pub(crate) fn take(&mut self, slot: usize, phys: usize, huge: Huge, strict: bool) -> Result<NonNull<u8>> {
        debug_assert!(slot.is_power_of_two());
        self.sync_fork();
        loop {
            while self.first_room < self.list.len() && !self.list[self.first_room].has_room(slot) {
                self.first_room += 1;
            }
            if self.first_room == self.list.len() {
                // (A new chunk is registered, or not made.)
                self.grow(slot, phys, huge, strict)?;
            }
            let c = &self.list[self.first_room];
            // A registrar's pool carves no slab from memory its registrar
            // does not know: a chunk whose registration a move lost (or a
            // forked child's inherited one) is registered again first, or
            // passed over (tried again once `first_room` comes back down).
            if self.registrar.is_none() || c.registered {
                break;
            }
            let base = c.base;
            if self.register_again(base).is_err() {
                self.first_room += 1;
            }
        }
        let c = &mut self.list[self.first_room];
        let p = match c.free.pop() {
            Some(p) => p,
            None => {
                c.carved += 1;
                c.base + (c.carved - 1) * slot
            }
        };
        c.used += 1;
        debug_assert!(p >= c.base && p + slot <= c.base + c.len && p % slot == 0);
        // SAFETY: inside a live mapping, which is never at address 0.
        Ok(unsafe { NonNull::new_unchecked(p as *mut u8) })
    }

    /// Maps a new chunk, as long as what the node holds (at least
    /// `MIN_SLOTS` slots, at most `MAX_CHUNK`; whole huge pages when asked),
    /// halving on failure down to one slot; inserts it in address order and
    /// points `first_room` at it.
    fn grow(&mut self, slot: usize, phys: usize, huge: Huge, strict: bool) -> Result<()> {
        let page = huge.hugetlb_page().unwrap_or(HUGE_PAGE);
        let unit = if huge == Huge::Off { slot } else { slot.max(page) };
        let most = if huge == Huge::Hugetlb { MAX_HUGETLB_CHUNK } else { MAX_CHUNK };
        // A registered pool's first chunk is one slot: what it registers is
        // pinned (within RLIMIT_MEMLOCK, 8 MiB by default), so no more is
        // pinned up front than the first slab needs; chunks double from there.
        let first = if self.registrar.is_some() { 1 } else { MIN_SLOTS };
        let mut len = self.reserved().max(first * slot).next_power_of_two().clamp(unit, most.max(unit));
        if huge.hugetlb_page().is_some() {
            // A pool too short for the chunk may still hold a smaller one.
            let mut l = len.max(unit);
            loop {
                if let Ok(p) = Self::map_hugetlb(l, slot, phys, page) {
                    return self.add(p, l, true, page, phys);
                }
                if l == unit {
                    break;
                }
                l /= 2;
            }
            // Base pages from here: not a gigabyte of them at once.
            len = len.min(MAX_CHUNK.max(slot));
            if strict {
                return Err(Error::NodeOutOfMemory { node: phys });
            }
            self.huge_fallbacks += 1;
        }
        let thp = huge == Huge::Thp;
        let least = if thp { slot.max(HUGE_PAGE) } else { slot };
        let base = loop {
            match Self::map(len, slot, phys, thp) {
                Ok(p) => break p,
                Err(e) if len <= least => return Err(e),
                Err(_) => len /= 2,
            }
        };
        self.add(base, len, thp, crate::os::page_size(), phys)
    }

    /// Registers the fresh mapping at `p`, bound to kernel node `phys`, if
    /// the pool has a registrar (a refusal, or pages the kernel pinned off
    /// the node under [`OffNodePins::Refuse`], unmaps it and is the error),
    /// then lists it in address order and points `first_room` at it.
    fn add(&mut self, p: NonNull<u8>, len: usize, huge: bool, page_size: usize, phys: usize) -> Result<()> {
        let mut off_node = 0;
        if let Some((r, node)) = &self.registrar {
            let region = Region { addr: p, len, node: *node, page_size };
            let node = *node;
            let registered = r
                .register(&region)
                .map_err(|refusal| match refusal {
                    Refusal::Errno(errno) => Error::Registration { node, len, errno },
                    Refusal::Memlock { limit, pinned } => Error::MemlockLimit { node, limit, pinned, asked: len },
                })
                // (A fresh mapping: no page is present before the pin.)
                .and_then(|()| self.check_pins(&**r, &region, phys, 0));
            match registered {
                Ok(off) => off_node = off,
                Err(e) => {
                    // SAFETY: our fresh mapping; nothing was handed out of
                    // it, and it is not registered (refused, or undone).
                    let _ = unsafe { mem::unmap(p, len) };
                    return Err(e);
                }
            }
        }
        let base = p.as_ptr() as usize;
        let at = self.list.partition_point(|c| c.base < base);
        let registered = self.registrar.is_some();
        self.list.insert(
            at,
            Chunk {
                base,
                len,
                carved: 0,
                used: 0,
                free: Vec::new(),
                huge,
                page_size,
                registered,
                moving: false,
                frozen: false,
                phys,
                off_node,
                left_by_pin: 0,
            },
        );
        super::published::publish(base, len, page_size, phys, &self.name);
        self.first_room = at;
        Ok(())
    }

    /// A bound mapping of `len` bytes aligned to `slot` and [`CHUNK_ALIGN`]
    /// (and to a huge page with `thp`, which asks for transparent huge
    /// pages).
    fn map(len: usize, slot: usize, phys: usize, thp: bool) -> Result<NonNull<u8>> {
        let align = if thp { slot.max(HUGE_PAGE) } else { slot }.max(CHUNK_ALIGN);
        let p = mem::map_aligned(len, align).map_err(|_| Error::NodeOutOfMemory { node: phys })?;
        // SAFETY: a fresh mapping of ours, not yet touched.
        if let Err(e) = unsafe { mem::bind(p, len, MemPolicy::Preferred(phys), BindFlags::NONE) } {
            // SAFETY: the mapping was made above and nothing points into it.
            let _ = unsafe { mem::unmap(p, len) };
            return Err(e);
        }
        // With THP set to `always`, a slab's first touch (its header) would
        // commit the whole 2 MiB huge page around it, holding other slabs'
        // untouched objects: in a 2-node guest 1 GiB of 4 KiB buffers
        // committed 1 GiB and spilled off its node. Unless huge pages were
        // asked for, slabs smaller than a huge page opt out (as they did as
        // mappings of their own); larger ones keep the system's setting.
        // Failure (THP not built in) is harmless.
        if thp || slot < HUGE_PAGE {
            // SAFETY: our fresh mapping.
            let _ = unsafe { mem::set_hugepages(p, len, thp) };
        }
        Ok(p)
    }

    /// Hugetlb pages for a chunk, bound to `phys`, committed now and checked
    /// to be there: a node whose pool is short would otherwise be served
    /// from another node's pool.
    fn map_hugetlb(len: usize, slot: usize, phys: usize, page: usize) -> Result<NonNull<u8>> {
        mem::map_hugetlb_on(len, slot.max(page).max(CHUNK_ALIGN), page, MemPolicy::Preferred(phys), Some(phys), None)
    }

    /// Gives back the slot at `p` (of `slot` bytes, of which the first
    /// `touched` may hold data): its pages go back to the OS now, and its
    /// chunk is unmapped when no other slot of it is in use.
    ///
    /// # Safety
    /// `p` came from [`take`](Self::take) with the same `slot` and nothing
    /// uses its memory any more.
    pub(crate) unsafe fn give(&mut self, p: NonNull<u8>, slot: usize, touched: usize) {
        self.sync_fork();
        let a = p.as_ptr() as usize;
        let i = self.list.partition_point(|c| c.base <= a) - 1;
        let c = &mut self.list[i];
        let registered = c.registered;
        debug_assert!(a >= c.base && a + slot <= c.base + c.len && c.used > 0);
        c.used -= 1;
        if c.used == 0 && !c.moving {
            self.unmap_at(i);
        } else {
            // A registered chunk's pages are pinned where the registrar
            // handed them to the kernel or a device: returned and faulted in
            // again, a page would be a new one, not the one registered.
            if !c.huge && !registered {
                // SAFETY: nothing uses the slot's memory any more (the caller's word); it is
                // page-aligned (slots are at least a page) and mapped by us (its chunk stays).
                let _ = unsafe { mem::decommit(p, touched.min(slot)) };
            }
            c.free.push(a);
        }
        self.first_room = self.first_room.min(i);
    }

    /// Unmaps the chunk at index `i`, no slot of it in use (unregistered
    /// first, and taken off the published table).
    fn unmap_at(&mut self, i: usize) {
        let c = self.list.remove(i);
        debug_assert!(c.used == 0 && !c.moving);
        // SAFETY: a live mapping is never at address 0.
        let base = unsafe { NonNull::new_unchecked(c.base as *mut u8) };
        if let Some((r, node)) = self.registrar.as_ref().filter(|_| c.registered) {
            r.unregister(&Region { addr: base, len: c.len, node: *node, page_size: c.page_size });
        }
        super::published::withdraw(c.base);
        // SAFETY: no slot of the chunk is in use and no migration moves it
        // (the callers' word); the mapping is ours, and no longer
        // registered. (A refusal leaves address space mapped, nothing else.)
        let _ = unsafe { mem::unmap(base, c.len) };
    }
}

impl Drop for Chunks {
    fn drop(&mut self) {
        // Every slab holds a reference to its cache, so a cache's chunks are
        // all unmapped (with their last slab) before its state is dropped.
        debug_assert!(std::thread::panicking() || self.list.is_empty(), "a cache dropped with chunks mapped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_aligned_disjoint_reused_and_chunks_go_with_their_last_slot() {
        let slot = 64 << 10;
        let mut c = Chunks::new(None, OffNodePins::Refuse, "test".into());
        let mut got: Vec<NonNull<u8>> = (0..100).map(|_| c.take(slot, 0, Huge::Off, false).unwrap()).collect();
        let mut addrs: Vec<usize> = got.iter().map(|p| p.as_ptr() as usize).collect();
        addrs.sort_unstable();
        assert!(addrs.iter().all(|a| a % slot == 0));
        assert!(addrs.windows(2).all(|w| w[1] - w[0] >= slot), "overlapping slots");
        // 8, 8, 16, 32, 64 slots: five mappings for 100 slabs, not 100.
        assert!(c.count() <= 5, "{} chunks", c.count());
        // Any cache's slab header below an object lies in its chunk.
        assert!(c.list.iter().all(|ch| ch.base % CHUNK_ALIGN == 0), "a chunk off CHUNK_ALIGN");
        for p in &got {
            // SAFETY: a slot of ours, in use by nobody but this test.
            unsafe { p.as_ptr().write_bytes(0xab, 4096) };
        }
        // A slot given back has its pages returned; the next slab finds room
        // without a new mapping.
        let back = got.pop().unwrap();
        let chunks = c.count();
        // SAFETY: taken above, no longer used.
        unsafe { c.give(back, slot, 4096) };
        let again = c.take(slot, 0, Huge::Off, false).unwrap();
        assert_eq!(c.count(), chunks);
        // SAFETY: a live slot of ours.
        assert_eq!(unsafe { *again.as_ptr() }, 0, "a slot handed out again keeps old data");
        got.push(again);
        for p in got {
            // SAFETY: taken above, no longer used.
            unsafe { c.give(p, slot, 4096) };
        }
        assert_eq!(c.count(), 0);
        assert_eq!(c.reserved(), 0);
    }

    /// Counts what it is told.
    #[derive(Default)]
    struct Count {
        registered: std::sync::atomic::AtomicUsize,
        unregistered: std::sync::atomic::AtomicUsize,
    }

    impl Registrar for Count {
        fn register(&self, _: &Region) -> core::result::Result<(), Refusal> {
            self.registered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        }
        fn unregister(&self, _: &Region) {
            self.unregistered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    #[test]
    fn a_registered_chunks_slots_keep_their_pages_and_it_unregisters_once() {
        use std::sync::atomic::Ordering::Relaxed;
        let slot = 64 << 10;
        let count = Arc::new(Count::default());
        let mut c = Chunks::new(Some((count.clone(), 0)), OffNodePins::Refuse, "test".into());
        // Registered chunks start at one slot and double: 1, 1, 2 slots.
        let mut got: Vec<NonNull<u8>> = (0..4).map(|_| c.take(slot, 0, Huge::Off, false).unwrap()).collect();
        assert_eq!((count.registered.load(Relaxed), c.registered()), (3, (3, c.reserved())));
        assert_eq!(c.reserved(), 4 * slot, "no more pinned than the slabs need");
        // The last two share a chunk: one given back keeps its pages.
        let a = got.pop().unwrap();
        // SAFETY: a slot of ours, in use by nobody but this test.
        unsafe { a.as_ptr().write_bytes(0xab, 4096) };
        // SAFETY: taken above, no longer used.
        unsafe { c.give(a, slot, 4096) };
        let again = c.take(slot, 0, Huge::Off, false).unwrap();
        assert_eq!(again, a);
        // SAFETY: a live slot of ours: its page was not returned (the
        // registered page is still the one behind it).
        assert_eq!(unsafe { *again.as_ptr() }, 0xab, "a registered slot's page was returned");
        got.push(again);
        for p in got {
            // SAFETY: taken above, no longer used.
            unsafe { c.give(p, slot, 4096) };
        }
        assert_eq!((count.registered.load(Relaxed), count.unregistered.load(Relaxed)), (3, 3));
        assert_eq!(c.count(), 0);
    }

    #[test]
    fn huge_chunks_are_whole_huge_pages_or_counted_fallbacks() {
        let slot = 128 << 10;
        for huge in [Huge::Thp, Huge::Hugetlb, Huge::Hugetlb1G] {
            let mut c = Chunks::new(None, OffNodePins::Refuse, "test".into());
            let got: Vec<NonNull<u8>> = (0..40).map(|_| c.take(slot, 0, huge, false).unwrap()).collect();
            for p in &got {
                // SAFETY: a slot of ours.
                unsafe { p.as_ptr().write_bytes(0x5a, slot) };
            }
            // Hugetlb here has pages only where the machine reserved some:
            // each chunk is on them, or counted as having fallen back.
            let on_huge = c.huge();
            assert_eq!(on_huge as u64 + c.huge_fallbacks, c.count() as u64, "{huge:?}");
            if huge == Huge::Thp {
                assert_eq!(on_huge, c.count());
            }
            let page = huge.hugetlb_page().unwrap_or(HUGE_PAGE);
            for ch in &c.list {
                if ch.huge {
                    assert_eq!((ch.base % page, ch.len % page), (0, 0), "{huge:?}");
                }
            }
            for p in got {
                // SAFETY: a live slot of ours, written above.
                assert_eq!(unsafe { *p.as_ptr().add(slot - 1) }, 0x5a);
                // SAFETY: taken above, no longer used.
                unsafe { c.give(p, slot, slot) };
            }
            assert_eq!(c.count(), 0);
        }
    }
}
