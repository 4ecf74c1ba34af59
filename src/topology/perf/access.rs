//! What sysfs says of memory performance: each target's best initiators
//! (`nodeN/access1`, `access0`), the kernel's memory tiers, and its
//! weighted-interleave weights. Fixed buffers: nothing is allocated.

use super::MemoryPerformance;
use crate::os::file::{self, PathBuf};
use crate::topology::{MAX_NODES, NodeSet, Topology};

impl MemoryPerformance {
    /// The sysfs fallback: best initiators exactly, the others by distance.
    pub(super) fn read_sysfs_access(&mut self, t: &Topology) -> bool {
        let mut any = false;
        for target in t.memory_nodes().iter() {
            let Some(best) = read_access(target) else { continue };
            let Some(b) = best.initiators.iter().next() else { continue };
            any = true;
            let db = u64::from(t.distance(b, target));
            for i in t.cpu_nodes().iter() {
                let di = u64::from(t.distance(i, target)).max(1);
                let (bw, lat) = if best.initiators.contains(i) {
                    (u64::from(best.bandwidth), u64::from(best.latency))
                } else {
                    (u64::from(best.bandwidth) * db / di, u64::from(best.latency) * di / db.max(1))
                };
                self.bandwidth[i][target] = bw as u32;
                self.latency[i][target] = lat.min(u64::from(u16::MAX)) as u16;
            }
        }
        any
    }

    /// `/sys/devices/virtual/memory_tiering/memory_tierN/nodelist`: tiers
    /// ranked by `N` (lower is faster), 1 the top.
    pub(super) fn read_tiers(&mut self) {
        const DIR: &core::ffi::CStr = c"/sys/devices/virtual/memory_tiering";
        let mut ids = [0usize; 16];
        let mut len = 0;
        let _ = file::for_each_entry(DIR, |name| {
            if let Some(id) = name.strip_prefix("memory_tier").and_then(|n| crate::sets::parse_id(n.as_bytes()))
                && len < ids.len()
            {
                ids[len] = id;
                len += 1;
            }
        });
        ids[..len].sort_unstable();
        let mut buf = [0u8; 512];
        for (rank, &id) in ids[..len].iter().enumerate() {
            let mut p = PathBuf::new();
            p.push("/sys/devices/virtual/memory_tiering/memory_tier").push_num(id).push("/nodelist");
            if let Ok(s) = file::read_str(p.as_cstr(), &mut buf)
                && let Ok((nodes, _)) = NodeSet::parse_list(s)
            {
                for n in nodes.iter() {
                    self.tier[n] = (rank + 1) as u8;
                }
            }
        }
    }

    /// `/sys/kernel/mm/mempolicy/weighted_interleave/nodeN` (Linux 6.9+)
    /// and its `auto` (6.16+).
    pub(super) fn read_kernel_weights(&mut self, online: NodeSet) {
        for n in online.iter() {
            self.kernel_weight[n] = read_kernel_weight(n).ok().flatten().unwrap_or(0);
        }
        let mut buf = [0u8; 16];
        if let Ok(s) = file::read_str(c"/sys/kernel/mm/mempolicy/weighted_interleave/auto", &mut buf) {
            self.kernel_auto = match s {
                "true" | "Y" | "1" => Some(true),
                "false" | "N" | "0" => Some(false),
                _ => None,
            };
        }
    }
}

/// The kernel's weighted-interleave weight of node `n`, read now
/// (`/sys/kernel/mm/mempolicy/weighted_interleave/nodeN`, Linux 6.9+):
/// `None` where it cannot be read (no such file: an older kernel).
pub(crate) fn read_kernel_weight(n: usize) -> core::result::Result<Option<u8>, &'static str> {
    let mut p = PathBuf::new();
    p.push("/sys/kernel/mm/mempolicy/weighted_interleave/node").push_num(n);
    let mut buf = [0u8; 16];
    match file::read_str(p.as_cstr(), &mut buf) {
        Ok(s) => crate::sets::parse_id(s.as_bytes())
            .and_then(|w| u8::try_from(w).ok())
            .map(Some)
            .ok_or("malformed sysfs weight"),
        Err(_) => Ok(None),
    }
}

/// What the kernel reports for one target: its best initiators and their
/// bandwidth (MB/s, the lower of read and write) and latency (ns, the higher).
pub(super) struct Access {
    pub(super) initiators: NodeSet,
    pub(super) bandwidth: u32,
    pub(super) latency: u32,
}

pub(super) fn read_access(target: usize) -> Option<Access> {
    for class in ["access1", "access0"] {
        let mut dir = PathBuf::new();
        dir.push("/sys/devices/system/node/node").push_num(target).push("/").push(class).push("/initiators");
        let mut initiators = NodeSet::new();
        if file::for_each_entry(dir.as_cstr(), |name| {
            if let Some(n) = name.strip_prefix("node").and_then(|n| crate::sets::parse_id(n.as_bytes()))
                && n < MAX_NODES
            {
                initiators.insert(n);
            }
        })
        .is_err()
            || initiators.is_empty()
        {
            continue;
        }
        let mut buf = [0u8; 32];
        let mut value = |leaf: &str| -> u32 {
            let mut p = PathBuf::new();
            p.push(dir.as_str()).push("/").push(leaf);
            file::read_str(p.as_cstr(), &mut buf)
                .ok()
                .and_then(|s| crate::sets::parse_id(s.as_bytes()))
                .and_then(|v| u32::try_from(v).ok())
                .unwrap_or(0)
        };
        let (rb, wb, rl, wl) =
            (value("read_bandwidth"), value("write_bandwidth"), value("read_latency"), value("write_latency"));
        let bandwidth = match (rb, wb) {
            (0, b) | (b, 0) => b,
            (r, w) => r.min(w),
        };
        return Some(Access { initiators, bandwidth, latency: rl.max(wl) });
    }
    None
}
