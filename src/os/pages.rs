//! Moving pages between nodes while they are in use (`move_pages`), and
//! asking where a process's pages are.
//!
//! The kernel migrates a page by unmapping it, copying it and mapping the
//! copy at the same address: a thread that touches it meanwhile waits on the
//! migration entry and then sees the copy, so a pool moves without one
//! pointer changing. A page is refused, with its own errno, when it cannot
//! be isolated (`EBUSY`: pinned by the kernel or a device, or under I/O),
//! when the target node has no room (`ENOMEM`), or when another process
//! maps it too (`EACCES`: `MPOL_MF_MOVE` moves only pages this process maps
//! alone).

use super::KeepErrno;
use crate::error::{Error, Result};

/// `MPOL_MF_MOVE`: move the pages this process maps alone.
const MPOL_MF_MOVE: libc::c_int = 1 << 1;

/// Pages passed to one `move_pages` call: the kernel walks them in batches
/// of its own; this bounds the caller's arrays and the time a lock is held.
pub const MOVE_BATCH: usize = 512;

/// Moves the pages holding `addrs` to kernel node `node`; `status[i]` gets
/// where `addrs[i]`'s page is afterwards (a node id), or a negative errno:
/// `-ENOENT` (not present: nothing to move), `-EBUSY`, `-ENOMEM`,
/// `-EACCES`, `-EFAULT` (not mapped). Returns how many pages the kernel
/// tried and could not migrate (pinned, or busy): for those, and the
/// others of their batch, it writes no status (the caller asks again).
///
/// Contents and addresses stay; only the physical pages change.
///
/// # Safety
/// Every address lies in memory this crate mapped and whose pages may move
/// (no device holds its physical address without a pin the kernel knows
/// of: such a page is refused with `EBUSY`, which is safe, but a DMA engine
/// given a physical address outside the kernel's knowledge would write to
/// the old page).
pub unsafe fn move_to(addrs: &[*const u8], node: usize, status: &mut [i32]) -> Result<usize> {
    let _errno = KeepErrno::new();
    if status.len() < addrs.len() || node > i32::MAX as usize {
        return Err(Error::Os { call: "move_pages", errno: libc::EINVAL });
    }
    super::failpoint::check(super::failpoint::Call::MovePages)?;
    let nodes = [node as libc::c_int; MOVE_BATCH];
    let mut failed = 0;
    for (a, s) in addrs.chunks(MOVE_BATCH).zip(status.chunks_mut(MOVE_BATCH)) {
        // SAFETY: `a`, `nodes` (at least `a.len()` long) and `s` are valid
        // for `a.len()` elements; the pages' memory is ours to move (the
        // caller's word), and moving keeps their contents and addresses.
        let r = unsafe {
            libc::syscall(
                libc::SYS_move_pages,
                0,
                a.len() as libc::c_ulong,
                a.as_ptr(),
                nodes.as_ptr(),
                s.as_mut_ptr(),
                MPOL_MF_MOVE,
            )
        };
        // A positive result counts pages the kernel could not migrate.
        if r < 0 {
            return Err(super::last_error("move_pages"));
        }
        failed += r as usize;
    }
    Ok(failed)
}

/// Where the pages holding `addrs` in process `pid` (0: this one) are
/// (`move_pages` with null nodes, which moves nothing; another process's
/// needs the right to read its memory map, as `/proc/PID/numa_maps` does).
/// `status[i]` gets the kernel node id of `addrs[i]`'s page, or a negative
/// errno: `-ENOENT` for a page not present (never touched or decommitted),
/// `-EFAULT` for an unmapped address.
///
/// The addresses are not dereferenced, so any value is safe to pass.
pub fn page_nodes_of(pid: i32, addrs: &[*const u8], status: &mut [i32]) -> Result<()> {
    let _errno = KeepErrno::new();
    if status.len() < addrs.len() {
        return Err(Error::Os { call: "move_pages", errno: libc::EINVAL });
    }
    if addrs.is_empty() {
        return Ok(());
    }
    super::failpoint::check(super::failpoint::Call::PageQuery)?;
    // SAFETY: `addrs` and `status` are valid for `addrs.len()` elements; null
    // nodes make it a query, which touches no memory of either process.
    let r = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            pid,
            addrs.len() as libc::c_ulong,
            addrs.as_ptr(),
            core::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0,
        )
    };
    super::os_result(r, "move_pages")
}

/// How many pages of `[base, base + len)`, in pages of `page` bytes, are
/// present on a kernel node other than `node` (pages not present count for
/// none): [`page_nodes_of`] over the range in batches of [`MOVE_BATCH`],
/// on the stack.
///
/// The addresses are not dereferenced, so any range is safe to pass.
pub fn count_off_node(base: usize, len: usize, page: usize, node: usize) -> Result<usize> {
    if page == 0 || !page.is_power_of_two() {
        return Err(Error::Os { call: "move_pages", errno: libc::EINVAL });
    }
    let mut addrs = [core::ptr::null::<u8>(); MOVE_BATCH];
    let mut status = [0i32; MOVE_BATCH];
    let (mut at, end, mut off) = (base, base.saturating_add(len), 0);
    while at < end {
        let n = ((end - at).div_ceil(page)).min(MOVE_BATCH);
        for (i, a) in addrs[..n].iter_mut().enumerate() {
            *a = (at + i * page) as *const u8;
        }
        page_nodes_of(0, &addrs[..n], &mut status[..n])?;
        off += status[..n].iter().filter(|&&s| s >= 0 && s as usize != node).count();
        at += n * page;
    }
    Ok(off)
}
