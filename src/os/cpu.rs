//! Which CPU and node a thread runs on, and where it may run.

use crate::error::{Error, Result};

/// The CPU and (kernel) node the calling thread runs on, from the `getcpu`
/// system call. The answer may be stale as soon as it returns: the scheduler
/// can move the thread at any time.
pub fn getcpu() -> Result<(usize, usize)> {
    let _errno = super::KeepErrno::new();
    let mut cpu: libc::c_uint = 0;
    let mut node: libc::c_uint = 0;
    // SAFETY: both out-pointers are valid for a write; the cache argument is
    // unused since Linux 2.6.24 and may be null.
    let r = unsafe {
        libc::syscall(
            libc::SYS_getcpu,
            &mut cpu as *mut libc::c_uint,
            &mut node as *mut libc::c_uint,
            core::ptr::null_mut::<libc::c_void>(),
        )
    };
    super::os_result(r, "getcpu")?;
    Ok((cpu as usize, node as usize))
}

/// The CPU the calling thread runs on: read from the rseq area glibc
/// registered for the thread ([`rseq`](super::rseq): two loads, no call),
/// else through glibc's `sched_getcpu` (the vDSO: no system call). `None`
/// when the kernel cannot tell.
#[inline]
#[unsafe(link_section = ".text.sorted.numaweave")]
pub fn current_cpu() -> Option<usize> {
    if let Some(c) = super::rseq::registration().and_then(|r| r.cpu()) {
        return Some(c);
    }
    let _errno = super::KeepErrno::new();
    // SAFETY: no preconditions.
    let c = unsafe { libc::sched_getcpu() };
    usize::try_from(c).ok()
}

/// The CPUs the process may run on: `Cpus_allowed_list` of
/// `/proc/self/status` (the process's main thread, of any size: a
/// container's `cpuset.cpus`, `taskset`), else the calling thread's
/// `sched_getaffinity`.
pub fn allowed_cpus() -> Result<Vec<usize>> {
    if let Ok(text) = super::file::read_to_end(c"/proc/self/status")
        && let Some(list) = String::from_utf8_lossy(&text)
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:").map(|r| r.trim().to_string()))
        && let Some(cpus) = parse_list(&list)
    {
        return Ok(cpus);
    }
    // SAFETY: cpu_set_t is plain bits; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { core::mem::zeroed() };
    let _errno = super::KeepErrno::new();
    // SAFETY: `set` is a valid, writable cpu_set_t of the size given; pid 0
    // is the caller.
    let r = unsafe { libc::sched_getaffinity(0, core::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    super::os_result(r, "sched_getaffinity")?;
    // SAFETY: each index is below CPU_SETSIZE; `set` was filled above.
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
}

/// A kernel CPU list (`0-3,8,10-11`); `None` if it does not read as one.
fn parse_list(list: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b) = (a.trim().parse::<usize>().ok()?, b.trim().parse::<usize>().ok()?);
        if b < a || b - a > 1 << 16 {
            return None;
        }
        out.extend(a..=b);
    }
    (!out.is_empty()).then_some(out)
}

/// Restricts the calling thread to the CPUs `cpus` (`sched_setaffinity`):
/// a worker kept on one node's CPUs, free to move among them. An empty
/// set, or a CPU beyond `CPU_SETSIZE`, is `EINVAL`.
pub fn pin_current_thread_to(cpus: impl IntoIterator<Item = usize>) -> Result<()> {
    // SAFETY: cpu_set_t is plain bits; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { core::mem::zeroed() };
    let mut any = false;
    for cpu in cpus {
        if cpu >= libc::CPU_SETSIZE as usize {
            return Err(Error::Os { call: "sched_setaffinity", errno: libc::EINVAL });
        }
        // SAFETY: `cpu` was checked against CPU_SETSIZE above.
        unsafe { libc::CPU_SET(cpu, &mut set) };
        any = true;
    }
    if !any {
        return Err(Error::Os { call: "sched_setaffinity", errno: libc::EINVAL });
    }
    let _errno = super::KeepErrno::new();
    // SAFETY: `set` is a valid cpu_set_t of the size given; pid 0 is the caller.
    let r = unsafe { libc::sched_setaffinity(0, core::mem::size_of::<libc::cpu_set_t>(), &set) };
    super::os_result(r, "sched_setaffinity")
}

/// Restricts the calling thread to the single CPU `cpu` (`sched_setaffinity`).
pub fn pin_current_thread(cpu: usize) -> Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(Error::Os { call: "sched_setaffinity", errno: libc::EINVAL });
    }
    // SAFETY: cpu_set_t is plain bits; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { core::mem::zeroed() };
    // SAFETY: `cpu` was checked against CPU_SETSIZE above.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    let _errno = super::KeepErrno::new();
    // SAFETY: `set` is a valid cpu_set_t of the size given; pid 0 is the caller.
    let r = unsafe { libc::sched_setaffinity(0, core::mem::size_of::<libc::cpu_set_t>(), &set) };
    super::os_result(r, "sched_setaffinity")
}

#[cfg(test)]
mod tests {
    #[test]
    fn cpu_lists_read_as_the_kernel_writes_them() {
        assert_eq!(super::parse_list("0-3,8,10-11"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(super::parse_list("5"), Some(vec![5]));
        for bad in ["", "x", "3-1", "0-", "1,,a"] {
            assert_eq!(super::parse_list(bad), None, "{bad:?}");
        }
        let mine = super::allowed_cpus().unwrap();
        assert!(mine.contains(&super::current_cpu().unwrap()), "{mine:?}");
    }
}
