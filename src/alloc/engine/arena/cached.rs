//! Freed segment-aligned mappings (huge blocks', dead regions') kept for
//! reuse under the purge delay, newest first, described in their own first
//! bytes; a request takes the smallest that fits, or grows the largest
//! smaller one with `mremap`.

use core::ptr::{self, NonNull};

use super::purge::{delay_of, soonest};
use super::{Arena, ArenaInner, SEGMENT_SIZE, State, delay_clock, guard_len};
use crate::alloc::engine::segmap;
use crate::alloc::engine::types::Cached;
use crate::os::mem;
use crate::sync::Ordering;

/// Without a purge delay (the behaviour before it): at most this many
/// cached mappings, and `purge_threshold` bytes of them.
const CACHED_MAX: usize = 8;

/// With a purge delay: the bytes of cached mappings an arena keeps, as a
/// multiple of `purge_threshold` (64 MiB by default): a program that
/// allocates and frees large buffers (5–25 MB) reuses their pages, as glibc
/// does once its mmap threshold has risen.
pub(super) const CACHED_BYTES_FACTOR: usize = 8;

impl Arena {
    /// A cached mapping for a block of `len` bytes (segment-aligned, its
    /// pages committed on this node), and its length: the smallest of at
    /// least `len` (and at most 4 times that, or `len` plus a segment: its
    /// pages are committed, and a block pins them all); else, with a purge
    /// delay, the largest smaller one grown to `len` with `mremap` (its pages
    /// move along, only the rest is faulted in), if the address space can be
    /// had.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) fn take_huge(&self, state: &State, len: usize) -> Option<(NonNull<u8>, usize)> {
        self.take_cached(state, len, 4, true)
    }

    /// A cached mapping a huge block growing to `len` bytes may move into
    /// (`mremap` of its pages onto the mapping's start: the rest of the
    /// mapping, already committed, needs no fault): the smallest of at least
    /// `len` and at most 8 times that (a block that grows once tends to grow
    /// again: a `Vec` doubling to the size it had last time), and its
    /// length.
    pub(crate) fn take_huge_to_grow(&self, state: &State, len: usize) -> Option<(NonNull<u8>, usize)> {
        self.take_cached(state, len, 8, false)
    }

    /// The smallest cached mapping of at least `len` and at most `slack`
    /// times that (or `len` plus a segment); else, with `grow` and a purge
    /// delay, the largest smaller one grown to `len`.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    fn take_cached(&self, state: &State, len: usize, slack: usize, grow: bool) -> Option<(NonNull<u8>, usize)> {
        if guard_len() > 0 {
            return None;
        }
        let mut g = self.inner.lock();
        let fits = |l: usize| l >= len && (l <= len.saturating_mul(slack) || l <= len + SEGMENT_SIZE);
        let mut best: *mut *mut Cached = ptr::null_mut();
        let mut largest_small: *mut *mut Cached = ptr::null_mut();
        let mut link: *mut *mut Cached = &mut g.cached;
        // SAFETY: cached mappings are ours, described in their first bytes.
        unsafe {
            while !(*link).is_null() {
                let l = (**link).len;
                if fits(l) && (best.is_null() || l < (**best).len) {
                    best = link;
                }
                if l < len && (largest_small.is_null() || l > (**largest_small).len) {
                    largest_small = link;
                }
                link = &mut (**link).next;
            }
            let grow = grow && best.is_null() && state.config.purge_delay_ms > 0 && !largest_small.is_null();
            let pick = if !best.is_null() {
                best
            } else if grow {
                largest_small
            } else {
                return None;
            };
            let c = *pick;
            *pick = (*c).next;
            let l = (*c).len;
            g.cached_count -= 1;
            g.cached_bytes -= l;
            drop(g);
            self.counters.dirty.fetch_sub(l as u64, Ordering::Relaxed);
            let base = NonNull::new_unchecked(c.cast::<u8>());
            if !grow {
                return Some((base, l));
            }
            // Grown into a fresh segment-aligned range: the pages move along.
            let grown = segmap::NEAR.map_aligned_at(len, SEGMENT_SIZE, 0, mem::Charge::Lazy).ok().and_then(|to| {
                if !segmap::can_mark(to.as_ptr()) {
                    let _ = mem::unmap(to, len);
                    return None;
                }
                mem::remap_to(base, l, len, to).ok().or_else(|| {
                    let _ = mem::unmap(to, len);
                    None
                })
            });
            match grown {
                Some(b) => {
                    self.counters.reserved.fetch_add((len - l) as u64, Ordering::Relaxed);
                    Some((b, len))
                }
                None => {
                    self.counters.reserved.fetch_sub(l as u64, Ordering::Relaxed);
                    self.counters.purged.fetch_add(l as u64, Ordering::Relaxed);
                    let _ = mem::unmap(base, l);
                    None
                }
            }
        }
    }

    /// Keeps a freed segment-aligned mapping for reuse; false when it is too
    /// large to keep (the caller unmaps it). Without a purge delay, at most
    /// 8 mappings and `purge_threshold` bytes; with one, up to 8 times that
    /// (oldest dropped first), each for the delay.
    #[unsafe(link_section = ".text.sorted.numaweave")]
    pub(crate) fn keep_huge(&self, state: &State, base: NonNull<u8>, len: usize) -> bool {
        if guard_len() > 0 {
            // Guarded mappings end in a page no access is allowed to: not
            // reused, not grown.
            return false;
        }
        let now = delay_clock(state);
        let (bound, count) = match now {
            None => (state.config.purge_threshold, CACHED_MAX),
            Some(_) => (state.config.purge_threshold.saturating_mul(CACHED_BYTES_FACTOR), usize::MAX),
        };
        if len > bound {
            return false;
        }
        let c = base.as_ptr().cast::<Cached>();
        let mut g = self.inner.lock();
        // SAFETY: the mapping is ours, unused, its first page committed.
        unsafe { c.write(Cached { next: g.cached, len, freed_at: now.unwrap_or(0) }) };
        g.cached = c;
        g.cached_count += 1;
        g.cached_bytes += len;
        self.counters.dirty.fetch_add(len as u64, Ordering::Relaxed);
        if let Some(now) = now {
            g.purge_at = soonest(g.purge_at, now + delay_of(state, &g));
        }
        // Over the bounds: the oldest go.
        while g.cached_bytes > bound || g.cached_count > count {
            let mut link: *mut *mut Cached = &mut g.cached;
            // SAFETY: cached mappings are ours; the list has at least two.
            unsafe {
                while !(**link).next.is_null() {
                    link = &mut (**link).next;
                }
                let last = *link;
                *link = ptr::null_mut();
                self.unmap_cached(&mut g, last);
            }
        }
        if let Some(now) = now {
            self.purge_expired(state, &mut g, now);
        }
        true
    }

    /// Unmaps the cached mappings of the chain from `c` (already off the
    /// list) and takes them out of the counts.
    ///
    /// # Safety
    /// `c` is null or a chain of this arena's cached mappings, unlisted.
    pub(super) unsafe fn unmap_cached(&self, g: &mut ArenaInner, mut c: *mut Cached) {
        while !c.is_null() {
            // SAFETY: `c` is one of this arena's cached mappings, unlisted (the
            // caller's word): its header is live and read by no one else.
            let (next, len) = unsafe { ((*c).next, (*c).len) };
            g.cached_count -= 1;
            g.cached_bytes -= len;
            self.counters.dirty.fetch_sub(len as u64, Ordering::Relaxed);
            self.counters.purged.fetch_add(len as u64, Ordering::Relaxed);
            self.counters.reserved.fetch_sub(len as u64, Ordering::Relaxed);
            // SAFETY: a cached mapping nobody uses.
            let _ = unsafe { mem::unmap(NonNull::new_unchecked(c.cast()), len) };
            c = next;
        }
    }
}
