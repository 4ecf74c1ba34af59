//! The arena's unit tests: pages, the purge delay, cached mappings.

use core::ptr;

use super::purge::{self, DELAY_DECAY};
use super::{Arena, State, guard_len};
use crate::alloc::engine::size_class::{COLOURS, class_of, class_size, coloured, page_slots};
use crate::alloc::engine::types::{Page, SEGMENT_SIZE, SLOT_SIZE, Window};
use crate::os::mem;
use crate::sync::Ordering;

fn state() -> &'static State {
    crate::alloc::config::state()
}

/// An arena of its own (flat: no binding), apart from the process's.
fn arena() -> Arena {
    Arena::new(0, None)
}

/// For the purge delay's tests: the state, an arena of its own, the
/// configured delay (ms), a class of 20,000-byte blocks and its page's
/// bytes; `None` where the configuration leaves nothing to time: the delay
/// off or under 20 ms (`NUMAWEAVE_PURGE_DELAY`: pages would go back while
/// a test frees them), the threshold under 1 MiB (`NUMAWEAVE_PURGE`: a
/// burst of a few pages). Said on the real stderr (the harness captures
/// `eprintln!`), and a failure under `NUMAWEAVE_TEST_STRICT`.
fn with_delay() -> Option<(&'static State, Arena, u64, usize, u64)> {
    use std::io::Write;
    let state = state();
    let delay = state.config.purge_delay_ms;
    if delay < 20 || state.config.purge_threshold < 1 << 20 {
        let why = "the purge delay's tests need a delay of 20 ms or more and a threshold of 1 MiB or more";
        let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
        assert!(std::env::var_os("NUMAWEAVE_TEST_STRICT").is_none(), "{why}, and NUMAWEAVE_TEST_STRICT is set");
        return None;
    }
    let class = class_of(20_000);
    Some((state, arena(), delay, class, (page_slots(class) * SLOT_SIZE) as u64))
}

fn sleep(ms: u64) {
    std::thread::sleep(std::time::Duration::from_millis(ms));
}

#[test]
fn pages_are_disjoint_slot_aligned_and_described() {
    let (state, a) = (state(), arena());
    let mut seen: Vec<(usize, usize)> = Vec::new();
    for size in [64, 20_000, 100_000, 64, 20_000] {
        let class = class_of(size);
        let page = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
        // SAFETY: a page just handed out.
        let (start, slots, first) = unsafe {
            assert_eq!(usize::from((*page).info.class), class);
            assert_eq!((*page).info.block_size as usize, class_size(class));
            ((*page).info.start as usize, usize::from((*page).info.slots), usize::from((*page).info.first_slot))
        };
        assert_eq!(slots, page_slots(class));
        assert_eq!(first % slots, 0, "a page of {slots} slots starts on a multiple of {slots}");
        // A coloured page's block starts a few lines into its first slot.
        let colour = start % SLOT_SIZE;
        assert!(colour == 0 || (coloured(class) && colour < COLOURS * 64 && colour.is_multiple_of(64)), "{colour}");
        let start = start - colour;
        let end = start + slots * SLOT_SIZE;
        assert!(seen.iter().all(|&(s, e)| end <= s || start >= e), "pages overlap");
        seen.push((start, end));
    }
    assert_eq!(
        a.counters.pages_in_use.load(Ordering::Relaxed) as usize,
        seen.iter().map(|(s, e)| e - s).sum::<usize>()
    );
}

#[test]
fn freed_pages_are_reused_then_purged_and_empty_segments_unmapped() {
    let (state, a) = (state(), arena());
    // Pages of four slots: fifteen fit a segment, twenty take two.
    let class = class_of(200_000);
    assert_eq!(page_slots(class), 4);
    let pages: Vec<*mut Page> =
        (0..20).map(|_| a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr()).collect();
    assert!(a.counters.reserved.load(Ordering::Relaxed) >= 2 * SEGMENT_SIZE as u64);
    // SAFETY: pages of this arena with no block live and no heap.
    unsafe { a.free_page(state, pages[0]) };
    assert_eq!(a.counters.dirty.load(Ordering::Relaxed), 4 * SLOT_SIZE as u64, "below the threshold: kept");
    let again = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
    assert_eq!(again, pages[0], "a freed page is handed out again");
    assert_eq!(a.counters.dirty.load(Ordering::Relaxed), 0);
    for &p in &pages {
        // SAFETY: as above.
        unsafe { a.free_page(state, p) };
    }
    a.purge_now();
    assert_eq!(a.counters.dirty.load(Ordering::Relaxed), 0);
    assert_eq!(a.counters.pages_in_use.load(Ordering::Relaxed), 0);
    assert_eq!(a.counters.reserved.load(Ordering::Relaxed), SEGMENT_SIZE as u64, "one empty segment kept");
}

#[test]
fn cached_mappings_serve_requests_that_fit_and_grow_for_larger_ones() {
    if guard_len() > 0 {
        // Guard pages (hardened, NUMAWEAVE_GUARD=1) turn the cache off:
        // a mapping's guard must follow the block it holds.
        let m = mem::map_aligned(SEGMENT_SIZE, SEGMENT_SIZE).unwrap();
        assert!(!arena().keep_huge(state(), m, SEGMENT_SIZE));
        // SAFETY: our mapping, refused by the cache.
        let _ = unsafe { mem::unmap(m, SEGMENT_SIZE) };
        return;
    }
    let (state, a) = (state(), arena());
    let len = SEGMENT_SIZE;
    let m = mem::map_aligned(len, SEGMENT_SIZE).unwrap();
    // SAFETY: our fresh mapping: a marker past the first page (the
    // cache's own header lives in the first bytes).
    unsafe { m.as_ptr().add(8192).write(0x5a) };
    assert!(a.keep_huge(state, m, len));
    assert_eq!(a.take_huge(state, len / 2), Some((m, len)), "a smaller request takes it");
    assert!(a.take_huge(state, len / 2).is_none(), "taken once");
    assert!(a.keep_huge(state, m, len));
    if state.config.purge_delay_ms > 0 {
        // A larger request grows it: the pages move along.
        let (g, glen) = a.take_huge(state, 3 * len).unwrap();
        assert_eq!(glen, 3 * len);
        assert_eq!(g.as_ptr() as usize % SEGMENT_SIZE, 0);
        // SAFETY: the grown mapping, ours.
        unsafe {
            assert_eq!(g.as_ptr().add(8192).read(), 0x5a, "the cached pages came along");
            mem::unmap(g, glen).unwrap();
        }
    } else {
        assert!(a.take_huge(state, 3 * len).is_none());
        assert_eq!(a.take_huge(state, len), Some((m, len)));
        // SAFETY: ours, unused.
        unsafe { mem::unmap(m, len).unwrap() };
    }
    let bound = state.config.purge_threshold * if state.config.purge_delay_ms > 0 { 8 } else { 1 };
    let big = mem::map_aligned(bound + SEGMENT_SIZE, SEGMENT_SIZE).unwrap();
    assert!(!a.keep_huge(state, big, bound + SEGMENT_SIZE), "over the bound: not kept");
    // SAFETY: ours, unused.
    unsafe { mem::unmap(big, bound + SEGMENT_SIZE).unwrap() };
    assert_eq!(a.counters.dirty.load(Ordering::Relaxed), 0);
}

#[test]
fn free_pages_wait_out_the_delay() {
    let Some((state, a, delay, class, bytes)) = with_delay() else { return };
    let p = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
    // SAFETY: a page of this arena with no block live and no heap.
    unsafe { a.free_page(state, p) };
    assert_eq!(a.counters.dirty.load(Ordering::Relaxed), bytes, "kept committed for the delay");
    let purged = a.counters.purged.load(Ordering::Relaxed);
    a.tick_at(state, crate::os::monotonic_ms());
    assert_eq!(a.counters.purged.load(Ordering::Relaxed), purged, "not yet");
    sleep(delay + 20);
    a.tick_at(state, crate::os::monotonic_ms());
    assert_eq!(a.counters.dirty.load(Ordering::Relaxed), 0, "purged once the delay is over");
    assert_eq!(a.counters.purged.load(Ordering::Relaxed), purged + bytes);
}

#[test]
fn a_page_freed_late_waits_its_own_delay() {
    let Some((state, a, delay, class, bytes)) = with_delay() else { return };
    let p = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
    let q = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
    // SAFETY: pages of this arena, in use.
    unsafe {
        use crate::alloc::engine::segment::segment_of;
        assert_eq!(segment_of((*p).info.start), segment_of((*q).info.start), "one segment");
    }
    let purged = a.counters.purged.load(Ordering::Relaxed);
    // SAFETY: pages of this arena with no block live and no heap.
    unsafe { a.free_page(state, p) };
    sleep(delay / 2);
    // SAFETY: as above.
    unsafe { a.free_page(state, q) };
    // Past the first page's delay, well before the second's.
    sleep(delay / 2 + 5);
    a.tick_at(state, crate::os::monotonic_ms());
    assert_eq!(a.counters.purged.load(Ordering::Relaxed), purged + bytes, "the first page's delay is over");
    assert_eq!(a.counters.dirty.load(Ordering::Relaxed), bytes, "the second page has not waited its delay");
    sleep(delay / 2 + 20);
    a.tick_at(state, crate::os::monotonic_ms());
    assert_eq!(a.counters.dirty.load(Ordering::Relaxed), 0, "now it has");
    assert_eq!(a.counters.purged.load(Ordering::Relaxed), purged + 2 * bytes);
}

/// Takes `n` pages of `class` and frees them all, in order: the pages.
fn freed_pages(state: &'static State, a: &Arena, class: usize, n: usize) -> Vec<*mut Page> {
    let pages: Vec<*mut Page> =
        (0..n).map(|_| a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr()).collect();
    for &p in &pages {
        // SAFETY: a page of this arena, just handed out, with no block live and no heap.
        unsafe { a.free_page(state, p) };
    }
    pages
}

/// [`freed_pages`], then waits out the delay and ticks: the pages, all
/// purged.
fn purged_pages(state: &'static State, a: &Arena, class: usize, n: usize, delay: u64) -> Vec<*mut Page> {
    let before = a.counters.purged.load(Ordering::Relaxed);
    let pages = freed_pages(state, a, class, n);
    let in_force = purge::delay_of(state, &a.inner.lock());
    sleep(in_force + 20);
    a.tick_at(state, crate::os::monotonic_ms());
    let bytes = (page_slots(class) * SLOT_SIZE) as u64;
    assert_eq!(
        a.counters.purged.load(Ordering::Relaxed),
        before + n as u64 * bytes,
        "purged after {in_force} ms (configured: {delay})"
    );
    pages
}

#[test]
fn a_few_pages_taken_back_soon_after_their_purge_keep_the_delay() {
    let Some((state, a, delay, class, bytes)) = with_delay() else { return };
    // A thread's worth of pages, purged and taken again by the next thread
    // at once: too few to be worth holding every free page longer.
    let n = ((purge::early_need(state, &a.inner.lock()) - 1) / bytes) as usize;
    assert!(n > 0, "a page of class {class} is as large as what raises the delay");
    let mut pages = purged_pages(state, &a, class, n, delay);
    let mut again: Vec<*mut Page> =
        (0..n).map(|_| a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr()).collect();
    pages.sort();
    again.sort();
    assert_eq!(again, pages, "the purged slots are taken again, within the delay");
    assert_eq!(a.inner.lock().delay_shift, 0, "{n} pages taken back early do not raise the delay");
}

#[test]
fn pages_taken_back_soon_after_their_purge_lengthen_the_delay() {
    let Some((state, a, delay, class, bytes)) = with_delay() else { return };
    let purged = || a.counters.purged.load(Ordering::Relaxed);
    // What raises the delay from the configured one, in pages.
    let n = purge::early_need(state, &a.inner.lock()).div_ceil(bytes) as usize;
    let mut pages = purged_pages(state, &a, class, n, delay);
    let mut again = Vec::new();
    for i in 0..n {
        assert_eq!(a.inner.lock().delay_shift, 0, "{i} of {n} pages taken back: not yet");
        again.push(a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr());
    }
    pages.sort();
    again.sort();
    assert_eq!(again, pages, "the purged slots are taken again, within the delay");
    assert_eq!(a.inner.lock().delay_shift, 1);
    let base = purged();
    for &p in &again {
        // SAFETY: a page of this arena with no block live and no heap.
        unsafe { a.free_page(state, p) };
    }
    sleep(delay + 20);
    a.tick_at(state, crate::os::monotonic_ms());
    assert_eq!(purged(), base, "the delay has doubled: still committed");
    sleep(delay);
    a.tick_at(state, crate::os::monotonic_ms());
    assert_eq!(purged(), base + n as u64 * bytes, "purged after the doubled delay");
    // One page taken back at once, under a quarter of what the doubled
    // delay needs to rise again: counted, but it does not keep the delay
    // up; the others taken back long after their purge count nothing.
    let (early_at, need) = {
        let g = a.inner.lock();
        (g.early_at, purge::early_need(state, &g))
    };
    assert!(bytes < need / 4, "a page of {bytes} bytes, a quarter of {need}");
    let first = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
    assert!(pages.contains(&first));
    assert_eq!(a.inner.lock().early.sum, bytes, "taken back within the delay");
    assert_eq!(a.inner.lock().early_at, early_at, "too few to keep the delay up");
    sleep(2 * delay + 20);
    for _ in 1..n {
        let p = a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr();
        assert!(pages.contains(&p) && p != first);
    }
    assert_eq!(a.inner.lock().delay_shift, 1, "a late reuse does not raise the delay");
    let g = a.inner.lock();
    assert_eq!((g.early.sum, g.early_at), (bytes, early_at), "nor counts");
    drop(g);
    // Quiet for DELAY_DECAY doubled delays: back to the configured one.
    sleep(2 * delay * DELAY_DECAY + 20);
    a.tick_at(state, crate::os::monotonic_ms());
    assert_eq!(a.inner.lock().delay_shift, 0);
}

#[test]
fn bursts_past_the_bound_that_recur_raise_it_until_they_fit() {
    let Some((state, a, _delay, class, bytes)) = with_delay() else { return };
    let purged = || a.counters.purged.load(Ordering::Relaxed);
    let bound = purge::committed_bound(state, &a.inner.lock()) as u64;
    // A burst of pages a little past the bound, all freed at once.
    let n = (bound / bytes + 4) as usize;
    let burst = || {
        freed_pages(state, &a, class, n);
    };
    burst();
    assert!(purged() > 0, "past the bound: returned at once");
    assert_eq!(a.inner.lock().bound_shift, 0, "once is a burst, not a loop");
    burst();
    let shift = a.inner.lock().bound_shift;
    assert!(shift > 0, "a burst past the bound again, within four delays: the bound rises");
    assert!(purge::committed_bound(state, &a.inner.lock()) as u64 >= 2 * bound, "to twice the burst at least");
    let before = purged();
    burst();
    assert_eq!(purged(), before, "the same burst fits under the raised bound: nothing returned at once");
    a.purge_now();
}

#[test]
fn a_burst_that_passes_the_bound_twice_on_its_way_is_purged_once_then_kept() {
    let Some((state, a, _delay, class, bytes)) = with_delay() else { return };
    let bound = purge::committed_bound(state, &a.inner.lock()) as u64;
    // Two and a half bounds of pages freed at once: purged when free memory
    // passes the bound; when it passes it once more, the bound rises to
    // twice both together, and what is free stays.
    let n = (5 * bound / 2 / bytes) as usize;
    freed_pages(state, &a, class, n);
    let purged = a.counters.purged.load(Ordering::Relaxed);
    assert!(purged > bound && purged < bound + 2 * bytes, "{purged} bytes purged, the first pass only");
    let dirty = a.counters.dirty.load(Ordering::Relaxed);
    assert_eq!(dirty, n as u64 * bytes - purged, "the rest kept committed");
    let raised = purge::committed_bound(state, &a.inner.lock()) as u64;
    assert!(raised >= 4 * bound, "raised to {} MiB, for a burst of twice {} MiB", raised >> 20, bound >> 20);
    assert_eq!(a.inner.lock().burst.sum, purged, "only what went back is summed");
    a.purge_now();
}

#[test]
fn unmap_unused_gives_back_every_empty_segment_and_cached_mapping_and_nothing_else() {
    use crate::alloc::engine::segment::segment_of;
    let (state, a) = (state(), arena());
    // Pages of four slots: fifteen fill the first segment, five start a
    // second.
    let class = class_of(200_000);
    let pages: Vec<*mut Page> =
        (0..20).map(|_| a.alloc_page(state, class, ptr::null_mut(), None).unwrap().as_ptr()).collect();
    assert_eq!(a.counters.reserved.load(Ordering::Relaxed), 2 * SEGMENT_SIZE as u64);
    // SAFETY: pages just handed out, the first one's first slot ours to
    // write.
    let (live, live_start, last_start) = unsafe { (pages[0], (*pages[0]).info.start, (*pages[19]).info.start) };
    assert_ne!(segment_of(live_start), segment_of(last_start), "twenty pages fill more than a segment");
    // SAFETY: the live page's own memory.
    unsafe { live_start.write_bytes(0x77, 4096) };
    for &p in &pages[1..] {
        // SAFETY: pages of this arena with no block live and no heap.
        unsafe { a.free_page(state, p) };
    }
    let mut cached = 0;
    if guard_len() == 0 {
        // A huge block's mapping freed into the cache (counted reserved,
        // as the huge path counts it).
        let m = mem::map_aligned(SEGMENT_SIZE, SEGMENT_SIZE).unwrap();
        a.counters.reserved.fetch_add(SEGMENT_SIZE as u64, Ordering::Relaxed);
        assert!(a.keep_huge(state, m, SEGMENT_SIZE));
        cached = SEGMENT_SIZE;
    }
    let freed = a.unmap_unused();
    // (Address space: a segment's guard page, if any, goes with it.)
    assert_eq!(freed, SEGMENT_SIZE + guard_len() + cached, "the empty segment and the cached mapping, exactly");
    assert_eq!(a.counters.reserved.load(Ordering::Relaxed), SEGMENT_SIZE as u64, "the live page's segment stays");
    assert!(a.take_huge(state, SEGMENT_SIZE).is_none(), "nothing cached is left");
    // SAFETY: the live page's memory, still mapped.
    unsafe { assert!((0..4096).all(|i| live_start.add(i).read() == 0x77), "a live page is kept whole") };
    assert_eq!(a.unmap_unused(), 0, "nothing more to give back");
    // SAFETY: as above.
    unsafe { a.free_page(state, live) };
    assert_eq!(a.unmap_unused(), SEGMENT_SIZE + guard_len(), "an emptied segment goes too, none kept");
    assert_eq!(a.counters.reserved.load(Ordering::Relaxed), 0);
}

#[test]
fn a_window_sums_bytes_for_its_span_from_its_first_add_then_starts_again() {
    let mut w = Window::NEW;
    assert_eq!(w.add(1_000, 100, 5), 5, "the first add starts it");
    assert_eq!(w.add(1_099, 100, 7), 12, "within the span: summed");
    assert_eq!(w.add(1_100, 100, 3), 3, "a span after its start: a new window");
    assert_eq!(w.from, 1_100);
    assert_eq!(w.add(1_150, 100, u64::MAX), u64::MAX, "saturates");
    w.restart(1_160);
    assert_eq!((w.sum, w.from), (0, 1_160));
    assert_eq!(w.add(1_200, 100, 2), 2, "restarted: counts from 1,160");
    assert_eq!(w.add(1_260, 100, 2), 2, "and ends a span after it");
}
