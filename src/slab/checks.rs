//! Hardened slab caches (cargo feature `hardened`; see `hardened.rs` at the
//! crate's root for the switches and the report): a freed raw object
//! carries a freed mark, so a second free is caught on any thread; with
//! `NUMAWEAVE_CHECK=full` every object is followed by a red zone checked at
//! free, and a freed object of a cache without constructor is poisoned,
//! checked when it is handed out again (SLUB's `slub_debug=FZP`).
//!
//! Layout: where the object's own memory cannot hold the free-list link and
//! the mark while it is free (a constructor's state must survive; objects
//! under 16 bytes), they go after the object (and its red zone), as SLUB puts
//! its free pointer; otherwise in its first two words.

use core::ptr::NonNull;

use crate::hardened::{self as h, HARDENED, misuse};

/// Where a cache's objects keep their checks (offsets into an object).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Check {
    /// The freed mark's word.
    mark: usize,
    /// The red zone (empty unless `NUMAWEAVE_CHECK=full`).
    red: (usize, usize),
    /// The poisoned bytes of a freed object (empty unless `full`).
    poison: (usize, usize),
}

/// A cache's checks as it keeps them: one in hardened builds, none (and no
/// bytes of the cache's state) in default ones.
pub(crate) type Checks = [Check; HARDENED as usize];

impl Check {
    /// No checks (what a default build's layout yields, in no bytes).
    const NONE: Check = Check { mark: 0, red: (0, 0), poison: (0, 0) };

    /// The link offset, stride and checks of a cache's objects. With a
    /// constructor the object's state must survive being free, so the link
    /// lives after it (as SLUB does); otherwise in its first word. A
    /// hardened build's free object also carries its freed mark (and under
    /// `NUMAWEAVE_CHECK=full` the object its red zone).
    pub(crate) fn layout(size: usize, align: usize, ctor: bool) -> (usize, usize, Checks) {
        if !HARDENED {
            let link = if ctor { size.next_multiple_of(8) } else { 0 };
            return (link, (link + 8).max(size).next_multiple_of(align), [Check::NONE; HARDENED as usize]);
        }
        h::init();
        let full = h::full();
        // At least one byte of red zone: an overflow by one is the common one.
        let pad = if full { 8 } else { 0 };
        if ctor || size < 16 {
            let link = (size + pad).next_multiple_of(8);
            let stride = (link + 16).next_multiple_of(align);
            let red = if full { (size, link) } else { (0, 0) };
            let poison = if full && !ctor { (0, size) } else { (0, 0) };
            (link, stride, [Check { mark: link + 8, red, poison }; HARDENED as usize])
        } else {
            let stride = (size + pad).next_multiple_of(align);
            let red = if full { (size, stride) } else { (0, 0) };
            let poison = if full { (16, size) } else { (0, 0) };
            (0, stride, [Check { mark: 8, red, poison }; HARDENED as usize])
        }
    }
}

impl Check {
    /// A newly carved object: its red zone written (before the constructor,
    /// so that one writing past the object is caught too).
    ///
    /// # Safety
    /// `obj` is a fresh slot of the cache these checks are of.
    pub(crate) unsafe fn carved(&self, obj: *mut u8) {
        let (a, b) = self.red;
        // SAFETY: the red zone lies inside the slot.
        unsafe { obj.add(a).write_bytes(h::RED, b - a) };
    }

    /// An object being handed out: checks its poison if it was freed (a
    /// write after free), then clears its mark. `name` and `size` are the
    /// cache's, for the report.
    ///
    /// # Safety
    /// `obj` is an object of the cache these checks are of, just taken
    /// from it.
    #[inline]
    pub(crate) unsafe fn handing_out(&self, obj: NonNull<u8>, name: &str, size: usize) {
        let p = obj.as_ptr();
        // SAFETY: the mark word and the poisoned range lie inside the slot.
        unsafe {
            let mark = p.add(self.mark).cast::<usize>();
            if mark.read() == h::freed_mark(p) {
                let (a, b) = self.poison;
                let body = core::slice::from_raw_parts(p.add(a), b - a);
                if let Some(off) = h::first_not(body, h::POISON) {
                    misuse(format_args!(
                        "write after free into {p:p} (slab cache \"{name}\", {size}-byte objects): byte {} changed (to {:#04x})",
                        a + off,
                        body[off]
                    ));
                }
                mark.write(0);
            }
        }
    }

    /// An object being freed by its user: false (after the report, under
    /// `NUMAWEAVE_ON_ERROR=report`) if it is already free or its red zone
    /// was overwritten, and then it must be leaked; else marks and poisons
    /// it. `name`, `size` and `node` (asked only for a report) are the
    /// cache's and the object's.
    ///
    /// # Safety
    /// `obj` is the start of an object of the cache these checks are of
    /// (`KmemCache::check_owner`).
    pub(crate) unsafe fn freeing(
        &self,
        obj: NonNull<u8>,
        name: &str,
        size: usize,
        node: impl FnOnce() -> usize,
    ) -> bool {
        let p = obj.as_ptr();
        // SAFETY: the mark word, the red zone and the poisoned range lie
        // inside the slot, which stays mapped while its slab holds objects.
        unsafe {
            let mark = p.add(self.mark).cast::<usize>();
            if mark.read() == h::freed_mark(p) {
                let node = node();
                misuse(format_args!("double free of {p:p} (slab cache \"{name}\", node {node})"));
                return false;
            }
            let (a, b) = self.red;
            let zone = core::slice::from_raw_parts(p.add(a), b - a);
            if let Some(off) = h::first_not(zone, h::RED) {
                misuse(format_args!(
                    "write past the end of {p:p} (slab cache \"{name}\", {size}-byte objects): byte {off} after its end changed"
                ));
                return false;
            }
            let (a, b) = self.poison;
            p.add(a).write_bytes(h::POISON, b - a);
            mark.write(h::freed_mark(p));
        }
        true
    }
}
