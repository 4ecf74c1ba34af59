//! Free-list links: a free block's first word names the next free block of
//! its page, plainly, or in a hardened build encoded with the page's key
//! and checked against the page's bounds before it is followed.

use core::ptr;

use crate::alloc::engine::types::{Block, Page};
use crate::hardened::{self, BlockKind, HARDENED};

/// The link a free block of `page` stores to the next one: encoded in a
/// hardened build, plain otherwise.
#[inline(always)]
pub(crate) unsafe fn link(page: *mut Page, next: *mut Block) -> *mut Block {
    if HARDENED {
        // SAFETY: the caller passes a live page.
        hardened::encode(next, unsafe { (*page).info.key })
    } else {
        next
    }
}

/// Asks the CPU for the line of `block`, a free list's new head: the next
/// pop of its class reads its link there, and the caller writes the block.
/// A block another thread freed was last written by that thread's core
/// (its link): a miss of ~100 ns in the pop itself, on every allocation
/// of a producer whose consumer frees (64 B-2 KiB `alloc_zeroed` took
/// 64-256 ns where snmalloc, which prefetches so, took under 64). Asked
/// for one pop ahead, the line comes while the program uses the block it
/// got.
#[inline(always)]
pub(super) fn prefetch(block: *mut Block) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it changes nothing the program can
    // see and never faults, whatever the address (null included).
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(block.cast::<i8>())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = block;
}

/// Hardened builds: whether `block`, the head of `page`'s free list, lies
/// outside the page's blocks (a pool page, with no slots of its own, is not
/// checked: its `links` is `usize::MAX`). Checked before the head is read:
/// a link overwritten by a stray write decodes to anywhere at all, and the
/// pop that read it made it the head. (Its alignment to a block would cost
/// a multiplication on every pop.)
///
/// # Safety
/// `page` is a live page.
#[inline(always)]
pub(crate) unsafe fn outside(page: *mut Page, block: *mut Block) -> bool {
    // SAFETY: `page` is live (the caller's word); its `info` is written
    // once, when the page is taken, so reading it races with nothing.
    let (start, links) = unsafe { ((*page).info.start as usize, (*page).info.links) };
    debug_assert!(links > 0, "a page with a free list spans some blocks");
    (block as usize).wrapping_sub(start) >= links
}

/// Checks the link `next` read from a free block of `page` as
/// [`outside`] checks a head (null, the list's end, passes).
///
/// # Safety
/// `page` is a live page.
#[inline(always)]
pub(super) unsafe fn link_outside(page: *mut Page, next: *mut Block) -> bool {
    // SAFETY: `page` is live (the caller's word), as `outside` needs.
    !next.is_null() && unsafe { outside(page, next) }
}

/// Reports a free block of `page` linking to `next`, outside the page: null
/// (the rest of the list is dropped if the report does not abort).
///
/// # Safety
/// `page` is a live page.
#[cold]
#[inline(never)]
pub(crate) unsafe fn corrupted_list(page: *mut Page, next: *mut Block) -> *mut Block {
    // SAFETY: `page` is live (the caller's word): its `info` is read for
    // the report, nothing is read through `next`.
    unsafe {
        hardened::misuse(format_args!(
            "corrupted free list in the {}-byte page at {:p} (node {}): a free block links to {next:p}",
            (*page).info.block_size,
            (*page).info.start,
            (*page).info.node
        ));
    }
    ptr::null_mut()
}

/// The block a free block of `page` links to (see [`link`]); a hardened
/// build checks it lies in the page (a corrupted list is reported).
#[inline(always)]
pub(crate) unsafe fn next_of(page: *mut Page, block: *mut Block) -> *mut Block {
    // SAFETY: the caller passes a free block of the page.
    let stored = unsafe { (*block).next };
    if !HARDENED {
        return stored;
    }
    // SAFETY: as above.
    unsafe {
        let next = hardened::decode(stored, (*page).info.key);
        if link_outside(page, next) {
            return corrupted_list(page, next);
        }
        next
    }
}

/// What a page's blocks are, for hardened reports and checks: a pool's page
/// (no slots of its own) lends region blocks.
///
/// # Safety
/// `page` is live.
#[inline(always)]
pub(crate) unsafe fn kind_of(page: *mut Page) -> (usize, BlockKind) {
    // SAFETY: `page` is live (the caller's word); `info` is written once,
    // when the page is taken.
    let (bs, node, slots) =
        unsafe { ((*page).info.block_size as usize, usize::from((*page).info.node), (*page).info.slots) };
    (bs, if slots == 0 { BlockKind::Region(bs, node) } else { BlockKind::Sized(bs, node) })
}
