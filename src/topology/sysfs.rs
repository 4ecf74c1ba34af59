//! Discovery from `/sys/devices/system/node`, `/sys/devices/system/cpu` and
//! `/proc/self/status`, into fixed tables with stack buffers only.

use super::{
    HugePages, HugePool, LOCAL_DISTANCE, MAX_CPUS, MAX_NODES, NO_NODE, NodeSet, REMOTE_DISTANCE, Source, Topology,
};
use crate::error::{Error, Result};
use crate::os::file::{self, PathBuf};

const NODE_DIR: &str = "/sys/devices/system/node";

/// `/sys/devices/system/node/node<n>/<leaf>`, without `core::fmt` (this
/// runs inside the allocator's start-up: see [`PathBuf::push`]).
#[inline(never)]
#[unsafe(link_section = ".text.sorted.numaweave")]
fn node_file(n: usize, leaf: &str) -> PathBuf {
    let mut p = PathBuf::new();
    p.push(NODE_DIR).push("/node").push_num(n).push("/").push(leaf);
    p
}

/// This machine's topology, filled into `t` (an empty one, `Source::Sysfs`:
/// filled in place, so that the process's start-up keeps no copy of its
/// 6 KiB on the stack); on an error `t` is left part filled.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(super) fn detect_into(t: &mut Topology) -> Result<()> {
    // 4 KiB holds any list file below MAX_CPUS and one node's distance row.
    let mut buf = [0u8; 4096];
    let online = match file::read_str(c"/sys/devices/system/node/online", &mut buf) {
        Ok(s) => s,
        Err(Error::Os { errno: libc::ENOENT, .. }) => {
            single_node_fallback_into(t);
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let (online, ignored) = NodeSet::parse_list(online)?;
    if online.is_empty() {
        return Err(Error::InvalidTopology { reason: "sysfs lists no online node" });
    }
    debug_assert!(matches!(t.source, Source::Sysfs) && t.online.is_empty(), "detect_into fills an empty topology");
    t.online = online;
    t.ignored_nodes = ignored as u16;
    t.with_cpus = read_set(c"/sys/devices/system/node/has_cpu", &mut buf)?.unwrap_or(online);
    // `has_memory` is the nodes with any memory; kernels before 2.6.35 lack it.
    t.with_memory = read_set(c"/sys/devices/system/node/has_memory", &mut buf)?.unwrap_or(online);
    t.with_cpus = t.with_cpus.intersection(&online);
    t.with_memory = t.with_memory.intersection(&online);

    for n in online.iter() {
        read_distances(t, n, &mut buf)?;
        t.memory[n] = read_node_memory(n, &mut buf)?;
        let p = node_file(n, "cpulist");
        let (cpus, dropped) = super::CpuSet::parse_list(file::read_str(p.as_cstr(), &mut buf)?)?;
        t.ignored_cpus += dropped as u16;
        for c in cpus.iter() {
            t.cpu_node[c] = n as u8;
        }
    }
    // A node without a cpulist entry still counts as a CPU node if has_cpu says
    // so; the converse (CPUs listed, has_cpu silent) is fixed up here.
    for c in 0..MAX_CPUS {
        if t.cpu_node[c] != NO_NODE {
            t.with_cpus.insert(usize::from(t.cpu_node[c]));
        }
    }
    t.allowed = read_mems_allowed()?.unwrap_or(online).intersection(&t.with_memory);
    if t.allowed.is_empty() {
        // A cpuset may allow only memory-less nodes on odd firmware; never
        // leave the allocator without a node.
        t.allowed = t.with_memory;
    }
    Ok(())
}

/// [`detect_into`] as a value.
pub(super) fn detect() -> Result<Topology> {
    let mut t = Topology::empty(Source::Sysfs);
    detect_into(&mut t)?;
    Ok(t)
}

/// One node 0 with every online CPU and all of `MemTotal`, for kernels built
/// without NUMA and for failed discovery.
pub(super) fn single_node_fallback() -> Topology {
    let mut t = Topology::empty(Source::NoNuma);
    single_node_fallback_into(&mut t);
    t
}

/// [`single_node_fallback`] written over `t`, whatever it held.
#[unsafe(link_section = ".text.sorted.numaweave")]
pub(super) fn single_node_fallback_into(t: &mut Topology) {
    t.clear(Source::NoNuma);
    let mut buf = [0u8; 4096];
    t.online = NodeSet::single(0);
    t.with_cpus = t.online;
    t.with_memory = t.online;
    t.allowed = t.online;
    t.distance[0][0] = LOCAL_DISTANCE;
    let cpus = file::read_str(c"/sys/devices/system/cpu/online", &mut buf)
        .ok()
        .and_then(|s| super::CpuSet::parse_list(s).ok());
    match cpus {
        Some((cpus, dropped)) => {
            t.ignored_cpus = dropped as u16;
            for c in cpus.iter() {
                t.cpu_node[c] = 0;
            }
        }
        None => t.cpu_node[0] = 0,
    }
    if let Ok(s) = file::read_str(c"/proc/meminfo", &mut buf) {
        t.memory[0] = meminfo_kb(s, "MemTotal:").unwrap_or(0) * 1024;
    }
}

#[unsafe(link_section = ".text.sorted.numaweave")]
fn read_set(p: &core::ffi::CStr, buf: &mut [u8]) -> Result<Option<NodeSet>> {
    match file::read_str(p, buf) {
        Ok(s) => Ok(Some(NodeSet::parse_list(s)?.0)),
        Err(Error::Os { errno: libc::ENOENT, .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

#[unsafe(link_section = ".text.sorted.numaweave")]
fn read_distances(t: &mut Topology, n: usize, buf: &mut [u8]) -> Result<()> {
    let p = node_file(n, "distance");
    // The row lists distances to every online node, in ascending id order.
    let row = match file::read_str(p.as_cstr(), buf) {
        Ok(s) => s,
        Err(Error::Os { errno: libc::ENOENT, .. }) => "",
        Err(e) => return Err(e),
    };
    let mut targets = t.online.iter();
    let mut seen = 0;
    for tok in row.split_ascii_whitespace() {
        let d = crate::sets::parse_id(tok.as_bytes()).and_then(|d| u8::try_from(d).ok());
        let d = d.ok_or(Error::InvalidTopology { reason: "malformed node distance" })?;
        let Some(m) = targets.next() else { break };
        t.distance[n][m] = d;
        seen += 1;
    }
    if seen == 0 {
        for m in t.online.iter() {
            t.distance[n][m] = if m == n { LOCAL_DISTANCE } else { REMOTE_DISTANCE };
        }
    }
    Ok(())
}

#[unsafe(link_section = ".text.sorted.numaweave")]
fn read_node_memory(n: usize, buf: &mut [u8]) -> Result<u64> {
    let p = node_file(n, "meminfo");
    match file::read_str(p.as_cstr(), buf) {
        // Lines look like "Node 0 MemTotal:       16303300 kB".
        Ok(s) => Ok(meminfo_kb(s, "MemTotal:").unwrap_or(0) * 1024),
        Err(Error::Os { errno: libc::ENOENT, .. }) => Ok(0),
        Err(e) => Err(e),
    }
}

/// Free memory of kernel node `n` now (`MemFree` of its sysfs meminfo):
/// one small read, no allocation.
pub(crate) fn read_node_free(n: usize) -> Result<u64> {
    let mut buf = [0u8; 2048];
    let p = node_file(n, "meminfo");
    let s = match file::read_str(p.as_cstr(), &mut buf) {
        // A kernel without NUMA (the one-node fallback): the machine's figure.
        Err(Error::Os { errno: libc::ENOENT, .. }) if n == 0 => file::read_str(c"/proc/meminfo", &mut buf)?,
        r => r?,
    };
    meminfo_kb(s, "MemFree:").map(|kb| kb * 1024).ok_or(Error::Os { call: "read", errno: libc::EINVAL })
}

/// The kB figure after `key` in a meminfo-style text. (Byte searches, not
/// `str::find`: start-up code, see [`PathBuf::push`].)
#[unsafe(link_section = ".text.sorted.numaweave")]
fn meminfo_kb(text: &str, key: &str) -> Option<u64> {
    let (text, key) = (text.as_bytes(), key.as_bytes());
    let at = text.windows(key.len()).position(|w| w == key)? + key.len();
    let rest = text[at..].trim_ascii_start();
    // The figure is the token up to the next blank; `parse_id` refuses one
    // with anything but digits in it ("12kB") or too large for a word.
    let digits = rest.iter().position(u8::is_ascii_whitespace).unwrap_or(rest.len());
    crate::sets::parse_id(&rest[..digits]).map(|kb| kb as u64)
}

/// The page size a sysfs huge-page directory is named for
/// (`hugepages-2048kB` → 2 MiB).
fn huge_dir_size(name: &str) -> Option<usize> {
    let kb = crate::sets::parse_id(name.strip_prefix("hugepages-")?.strip_suffix("kB")?.as_bytes())?;
    kb.checked_mul(1024)
}

/// Kernel node `n`'s huge-page pools now, smallest page first; none where
/// the kernel has no hugetlb support or no such node.
pub(super) fn huge_pages(n: usize) -> Result<HugePages> {
    let mut out = HugePages::default();
    let dir = node_file(n, "hugepages");
    let mut sizes = [0usize; HugePages::MAX_SIZES];
    let mut len = 0;
    match file::for_each_entry(dir.as_cstr(), |name| {
        if let Some(size) = huge_dir_size(name)
            && len < sizes.len()
        {
            sizes[len] = size;
            len += 1;
        }
    }) {
        Ok(()) => {}
        Err(Error::Os { errno: libc::ENOENT, .. }) => return Ok(out),
        Err(e) => return Err(e),
    }
    sizes[..len].sort_unstable();
    let mut buf = [0u8; 64];
    for &size in &sizes[..len] {
        let mut count = |what: &str| -> Result<u64> {
            let mut p = node_file(n, "hugepages/hugepages-");
            p.push_num(size / 1024).push("kB/").push(what);
            let s = file::read_str(p.as_cstr(), &mut buf)?;
            crate::sets::parse_id(s.as_bytes()).map(|v| v as u64).ok_or(Error::Os { call: "read", errno: libc::EINVAL })
        };
        let pool = HugePool {
            page_size: size,
            total: count("nr_hugepages")?,
            free: count("free_hugepages")?,
            surplus: count("surplus_hugepages")?,
        };
        out.push(pool);
    }
    Ok(out)
}

/// `Mems_allowed_list` from `/proc/self/status`; `None` when the kernel does not
/// report it (no cpusets).
#[unsafe(link_section = ".text.sorted.numaweave")]
fn read_mems_allowed() -> Result<Option<NodeSet>> {
    // The status file grows with the CPU count (`Cpus_allowed`), the line
    // wanted does not (at most MAX_NODES ids): read it a piece at a time
    // rather than whole into a stack buffer as large as the file.
    let mut buf = [0u8; 512];
    let found = file::find_line(c"/proc/self/status", b"Mems_allowed_list:", &mut buf, NodeSet::parse_list)?;
    Ok(found.and_then(|r| r.ok()).map(|(s, _)| s))
}

/// The kernel node whose memory holds physical frame `pfn` (from
/// [`os::mem::page_frame`](crate::os::mem::page_frame)), from the memory blocks
/// sysfs lists under each node (`nodeN/memoryM`). `None` when no node lists
/// the block (memory hot-plug sysfs absent).
pub fn node_of_frame(pfn: u64) -> Result<Option<usize>> {
    let mut buf = [0u8; 64];
    let s = file::read_str(c"/sys/devices/system/memory/block_size_bytes", &mut buf)?;
    let block = u64::from_str_radix(s, 16).map_err(|_| Error::InvalidTopology { reason: "bad block_size_bytes" })?;
    if block == 0 {
        return Ok(None);
    }
    let id = pfn * crate::os::page_size() as u64 / block;
    let Ok(id) = usize::try_from(id) else { return Ok(None) };
    for n in 0..MAX_NODES {
        let mut p = node_file(n, "memory");
        if file::exists(p.push_num(id).as_cstr()) {
            return Ok(Some(n));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_page_directories_name_their_size() {
        assert_eq!(huge_dir_size("hugepages-2048kB"), Some(2 << 20));
        assert_eq!(huge_dir_size("hugepages-1048576kB"), Some(1 << 30));
        assert_eq!(huge_dir_size("hugepages-64kB"), Some(64 << 10));
        assert_eq!(huge_dir_size("hugepages-2048"), None);
        assert_eq!(huge_dir_size("demote"), None);
    }

    #[test]
    fn huge_pages_agree_with_sysfs_files() {
        let t = detect().unwrap();
        for n in t.nodes().iter() {
            let pools = huge_pages(n).unwrap();
            let dir = format!("{NODE_DIR}/node{n}/hugepages");
            let Ok(entries) = std::fs::read_dir(&dir) else {
                assert_eq!(pools.iter().count(), 0);
                continue;
            };
            let mut sizes: Vec<usize> = entries.filter_map(|e| huge_dir_size(e.ok()?.file_name().to_str()?)).collect();
            sizes.sort_unstable();
            assert_eq!(pools.iter().map(|p| p.page_size).collect::<Vec<_>>(), sizes);
            for p in pools.iter() {
                let read = |f: &str| -> u64 {
                    let s = std::fs::read_to_string(format!("{dir}/hugepages-{}kB/{f}", p.page_size / 1024));
                    s.unwrap().trim().parse().unwrap()
                };
                assert_eq!(p.total, read("nr_hugepages"));
                assert!(p.free <= p.total + p.surplus);
            }
        }
    }

    #[test]
    fn meminfo_parsing() {
        let s = "Node 0 MemTotal:       16303300 kB\nNode 0 MemFree:        1 kB\n";
        assert_eq!(meminfo_kb(s, "MemTotal:"), Some(16303300));
        assert_eq!(meminfo_kb(s, "MemFree:"), Some(1));
        assert_eq!(meminfo_kb(s, "Nope:"), None);
        assert_eq!(meminfo_kb("MemTotal: 12kB\n", "MemTotal:"), None);
        assert_eq!(meminfo_kb("MemTotal:\t7", "MemTotal:"), Some(7));
        assert_eq!(meminfo_kb("MemTotal: 99999999999999999999999 kB", "MemTotal:"), None);
        assert_eq!(meminfo_kb("MemTotal:   \n", "MemTotal:"), None);
    }

    #[test]
    fn detect_agrees_with_sysfs_files() {
        let t = detect().unwrap();
        let online = std::fs::read_to_string("/sys/devices/system/node/online");
        if let Ok(online) = online {
            assert_eq!(t.nodes().to_string(), online.trim());
            for n in t.nodes().iter() {
                let cpus = std::fs::read_to_string(format!("{NODE_DIR}/node{n}/cpulist")).unwrap();
                assert_eq!(t.cpus_of(n).to_string(), cpus.trim());
                let row = std::fs::read_to_string(format!("{NODE_DIR}/node{n}/distance")).unwrap();
                let ours: Vec<String> = t.nodes().iter().map(|m| t.distance(n, m).to_string()).collect();
                assert_eq!(ours.join(" "), row.trim());
            }
        } else {
            assert_eq!(t.source(), Source::NoNuma);
        }
        // Every CPU the kernel says is online has a node.
        let cpus = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap();
        let cpus: super::super::CpuSet = cpus.trim().parse().unwrap();
        for c in cpus.iter() {
            assert!(t.node_of_cpu(c).is_some(), "cpu {c} has no node");
        }
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let mems = status.lines().find_map(|l| l.strip_prefix("Mems_allowed_list:")).unwrap();
        let mems: NodeSet = mems.trim().parse().unwrap();
        assert_eq!(t.allowed_nodes(), mems.intersection(&t.memory_nodes()));
    }
}
