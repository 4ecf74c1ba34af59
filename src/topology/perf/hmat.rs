//! The ACPI HMAT (`/sys/firmware/acpi/tables/HMAT`): its System Locality
//! Latency and Bandwidth Information structures into the initiator ×
//! target matrices of [`MemoryPerformance`], normalised as the kernel's
//! `hmat_normalize` does. Read through a fetch function (the file, or a
//! test's bytes) with stack buffers: nothing is allocated.

use super::MemoryPerformance;
use crate::error::Result;
use crate::topology::{MAX_NODES, NodeSet};

/// Reads `buf.len()` bytes at `off` of the table; short is an error.
pub(crate) type Fetch<'a> = dyn FnMut(u64, &mut [u8]) -> Result<usize> + 'a;

fn fetch_exact(fetch: &mut Fetch<'_>, off: u64, buf: &mut [u8]) -> core::result::Result<(), &'static str> {
    match fetch(off, buf) {
        Ok(n) if n == buf.len() => Ok(()),
        Ok(_) => Err("HMAT shorter than its structures say"),
        Err(_) => Err("HMAT unreadable"),
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// The ACPI table header (36 bytes) and HMAT's 4 reserved bytes.
const HMAT_HEADER: u64 = 40;
/// System Locality Latency and Bandwidth Information.
const SLLBI: u16 = 1;
/// Its fixed part: header, flags, data type, transfer size, counts, base unit.
const SLLBI_FIXED: usize = 32;

/// One System Locality Latency and Bandwidth Information structure's
/// fixed part.
struct Sllbi {
    at: u64,
    flags: u8,
    data_type: u8,
    initiators: usize,
    targets: usize,
    base: u64,
}

/// Parses the HMAT read through `fetch` into `out`'s matrices (by node,
/// domains mapped onto `online` in ascending order). Errors say what was
/// wrong; `out` may be partly filled then.
pub(crate) fn parse_hmat(
    fetch: &mut Fetch<'_>,
    online: NodeSet,
    out: &mut MemoryPerformance,
) -> core::result::Result<(), &'static str> {
    let mut head = [0u8; HMAT_HEADER as usize];
    fetch_exact(fetch, 0, &mut head)?;
    if &head[..4] != b"HMAT" {
        return Err("not an HMAT");
    }
    let length = u64::from(u32_at(&head, 4));
    let revision = head[8];
    // First pass: the proximity domains named, to map them onto nodes.
    let mut domains = [0u32; MAX_NODES];
    let mut ndomains = 0;
    let mut any = false;
    for_each_sllbi(fetch, length, |fetch, s| {
        any = true;
        let mut b = [0u8; 4];
        for k in 0..s.initiators + s.targets {
            fetch_exact(fetch, s.at + (SLLBI_FIXED + 4 * k) as u64, &mut b)?;
            let d = u32::from_le_bytes(b);
            if !domains[..ndomains].contains(&d) {
                if ndomains == MAX_NODES {
                    return Err("more proximity domains than MAX_NODES");
                }
                domains[ndomains] = d;
                ndomains += 1;
            }
        }
        Ok(())
    })?;
    if !any {
        return Err("no latency or bandwidth structure");
    }
    domains[..ndomains].sort_unstable();
    if ndomains > online.len() {
        return Err("more proximity domains than online nodes");
    }
    // Domains onto nodes, ascending; where every domain is a node id
    // already, as itself.
    let mut node_of = [0usize; MAX_NODES];
    let identity = domains[..ndomains].iter().all(|&d| (d as usize) < MAX_NODES && online.contains(d as usize));
    for (k, &d) in domains[..ndomains].iter().enumerate() {
        node_of[k] = if identity { d as usize } else { online.iter().nth(k).unwrap_or(0) };
    }
    let node = |d: u32| domains[..ndomains].binary_search(&d).map(|k| node_of[k]).ok();
    // Values from an access-type structure are final; read/write ones
    // combine (lower bandwidth, higher latency) until an access one comes.
    let mut exact_bw = [0u64; MAX_NODES];
    let mut exact_lat = [0u64; MAX_NODES];
    for_each_sllbi(fetch, length, |fetch, s| {
        let mut inits = [0usize; MAX_NODES];
        let mut targs = [0usize; MAX_NODES];
        let mut b = [0u8; 4];
        for (k, slot) in inits[..s.initiators].iter_mut().chain(&mut targs[..s.targets]).enumerate() {
            fetch_exact(fetch, s.at + (SLLBI_FIXED + 4 * k) as u64, &mut b)?;
            *slot = node(u32::from_le_bytes(b)).ok_or("unmapped domain")?;
        }
        let entries = s.at + (SLLBI_FIXED + 4 * (s.initiators + s.targets)) as u64;
        // Row by row: a row is at most 64 entries, 128 bytes.
        let mut row = [0u8; 2 * MAX_NODES];
        for (i, &ini) in inits[..s.initiators].iter().enumerate() {
            let row = &mut row[..2 * s.targets];
            fetch_exact(fetch, entries + (2 * s.targets * i) as u64, row)?;
            for (j, &tgt) in targs[..s.targets].iter().enumerate() {
                let Some(v) = normalize(u16_at(row, 2 * j), s.base, s.data_type, revision) else { continue };
                let bit = 1u64 << tgt;
                match s.data_type {
                    3 => {
                        out.bandwidth[ini][tgt] = v;
                        exact_bw[ini] |= bit;
                    }
                    4 | 5 if exact_bw[ini] & bit == 0 => {
                        let cur = out.bandwidth[ini][tgt];
                        out.bandwidth[ini][tgt] = if cur == 0 { v } else { cur.min(v) };
                    }
                    0 => {
                        out.latency[ini][tgt] = v.min(u32::from(u16::MAX)) as u16;
                        exact_lat[ini] |= bit;
                    }
                    1 | 2 if exact_lat[ini] & bit == 0 => {
                        let cur = u32::from(out.latency[ini][tgt]);
                        out.latency[ini][tgt] = cur.max(v).min(u32::from(u16::MAX)) as u16;
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    })?;
    Ok(())
}

/// Runs `f` on every memory-level (not memory-side cache) latency and
/// bandwidth structure of the table.
fn for_each_sllbi(
    fetch: &mut Fetch<'_>,
    length: u64,
    mut f: impl FnMut(&mut Fetch<'_>, &Sllbi) -> core::result::Result<(), &'static str>,
) -> core::result::Result<(), &'static str> {
    let mut at = HMAT_HEADER;
    while at + 8 <= length {
        let mut h = [0u8; SLLBI_FIXED];
        fetch_exact(fetch, at, &mut h[..8])?;
        let (kind, len) = (u16_at(&h, 0), u64::from(u32_at(&h, 4)));
        if len < 8 || at + len > length {
            return Err("malformed HMAT structure length");
        }
        if kind == SLLBI {
            if len < SLLBI_FIXED as u64 {
                return Err("short latency and bandwidth structure");
            }
            fetch_exact(fetch, at, &mut h)?;
            let s = Sllbi {
                at,
                flags: h[8],
                data_type: h[9],
                initiators: u32_at(&h, 12) as usize,
                targets: u32_at(&h, 16) as usize,
                base: u64::from_le_bytes(h[24..32].try_into().unwrap()),
            };
            if s.initiators > MAX_NODES || s.targets > MAX_NODES {
                return Err("more proximity domains than MAX_NODES");
            }
            let need = SLLBI_FIXED + 4 * (s.initiators + s.targets) + 2 * s.initiators * s.targets;
            if (need as u64) > len {
                return Err("latency and bandwidth structure shorter than its lists");
            }
            // Memory hierarchy 0: the memory itself, not a memory-side cache.
            if s.flags & 0x0f == 0 {
                f(fetch, &s)?;
            }
        }
        at += len;
    }
    Ok(())
}

/// An entry in the kernel's units (ns, MB/s), as `hmat_normalize` does;
/// `None` for "not given" (0) and "unreachable" (0xffff).
fn normalize(entry: u16, base: u64, data_type: u8, revision: u8) -> Option<u32> {
    if entry == 0 || entry == u16::MAX {
        return None;
    }
    let v = u64::from(entry).checked_mul(base).filter(|&v| v <= u64::from(u32::MAX))?;
    let v = match revision {
        // Revision 1 gave tenths.
        1 if v < 10 => return None,
        1 => v.div_ceil(10),
        // Picoseconds to nanoseconds for the latencies.
        _ if data_type <= 2 => v.div_ceil(1000),
        _ => v,
    };
    Some(v as u32)
}

/// Builds an HMAT as firmware lays it out: an access-latency and an
/// access-bandwidth structure from `initiators` to `targets` (latency in
/// ns, bandwidth in MB/s, one row per initiator), and a memory-side cache
/// structure the parser must skip.
#[cfg(test)]
pub(super) fn build_hmat(targets: &[u32], initiators: &[u32], lat_ns: &[&[u32]], bw_mbps: &[&[u32]]) -> Vec<u8> {
    let mut t = vec![0u8; 40];
    t[..4].copy_from_slice(b"HMAT");
    t[8] = 2;
    let sllbi = |data_type: u8, base: u64, rows: &[&[u32]], div: u32, out: &mut Vec<u8>| {
        let len = SLLBI_FIXED + 4 * (initiators.len() + targets.len()) + 2 * initiators.len() * targets.len();
        let mut s = vec![0u8; len];
        s[0..2].copy_from_slice(&SLLBI.to_le_bytes());
        s[4..8].copy_from_slice(&(len as u32).to_le_bytes());
        s[9] = data_type;
        s[12..16].copy_from_slice(&(initiators.len() as u32).to_le_bytes());
        s[16..20].copy_from_slice(&(targets.len() as u32).to_le_bytes());
        s[24..32].copy_from_slice(&base.to_le_bytes());
        let mut at = SLLBI_FIXED;
        for &d in initiators.iter().chain(targets) {
            s[at..at + 4].copy_from_slice(&d.to_le_bytes());
            at += 4;
        }
        for row in rows {
            for &v in row.iter() {
                s[at..at + 2].copy_from_slice(&((v / div) as u16).to_le_bytes());
                at += 2;
            }
        }
        out.extend_from_slice(&s);
    };
    // Latency: entries in ns with a base of 1000 ps. Bandwidth: entries in
    // 100 MB/s with a base of 100.
    sllbi(0, 1000, lat_ns, 1, &mut t);
    sllbi(3, 100, bw_mbps, 100, &mut t);
    // A memory-side cache structure, which must be skipped.
    let mut cache = vec![0u8; 8];
    cache[0..2].copy_from_slice(&2u16.to_le_bytes());
    cache[4..8].copy_from_slice(&8u32.to_le_bytes());
    t.extend_from_slice(&cache);
    let len = t.len() as u32;
    t[4..8].copy_from_slice(&len.to_le_bytes());
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(table: &[u8], online: NodeSet) -> core::result::Result<MemoryPerformance, &'static str> {
        let mut p = MemoryPerformance::unknown();
        let mut fetch = |off: u64, buf: &mut [u8]| -> Result<usize> {
            let off = off as usize;
            if off >= table.len() {
                return Ok(0);
            }
            let n = buf.len().min(table.len() - off);
            buf[..n].copy_from_slice(&table[off..off + n]);
            Ok(n)
        };
        parse_hmat(&mut fetch, online, &mut p).map(|()| p)
    }

    #[test]
    fn an_hmat_gives_the_whole_matrix_in_the_kernels_units() {
        let lat: [&[u32]; 2] = [&[80, 140, 250, 350], &[140, 80, 350, 250]];
        let bw: [&[u32]; 2] = [&[100_000, 50_000, 30_000, 15_000], &[50_000, 100_000, 15_000, 30_000]];
        let table = build_hmat(&[0, 1, 2, 3], &[0, 1], &lat, &bw);
        let p = parse(&table, NodeSet::first_n(4)).unwrap();
        for i in 0..2 {
            for t in 0..4 {
                assert_eq!(p.bandwidth[i][t], bw[i][t], "bandwidth {i} -> {t}");
                assert_eq!(u32::from(p.latency[i][t]), lat[i][t], "latency {i} -> {t}");
            }
        }
        assert_eq!(p.bandwidth[2], [0; MAX_NODES], "a memory-only node initiates nothing");
    }

    #[test]
    fn domains_map_onto_nodes_in_ascending_order() {
        // Domains 4 and 9 on a machine whose nodes are 0 and 1.
        let table = build_hmat(&[4, 9], &[4, 9], &[&[10, 20], &[20, 10]], &[&[2000, 1000], &[1000, 2000]]);
        let p = parse(&table, NodeSet::first_n(2)).unwrap();
        assert_eq!((p.bandwidth[0][1], p.bandwidth[1][1]), (1000, 2000));
        // More domains than nodes: refused.
        assert!(parse(&table, NodeSet::first_n(1)).is_err());
    }

    #[test]
    fn malformed_tables_are_refused_not_misread() {
        let good = build_hmat(&[0, 1], &[0], &[&[10, 20]], &[&[2000, 1000]]);
        assert!(parse(&good, NodeSet::first_n(2)).is_ok());
        assert!(parse(b"SRAT", NodeSet::first_n(2)).is_err());
        let mut short = good.clone();
        short.truncate(good.len() - 12);
        assert!(parse(&short, NodeSet::first_n(2)).is_err(), "a table shorter than its header says");
        let mut bad_len = good.clone();
        bad_len[44..48].copy_from_slice(&3u32.to_le_bytes());
        assert!(parse(&bad_len, NodeSet::first_n(2)).is_err(), "a structure of 3 bytes");
        let mut too_many = good;
        too_many[40 + 12..40 + 16].copy_from_slice(&1000u32.to_le_bytes());
        assert!(parse(&too_many, NodeSet::first_n(2)).is_err(), "1000 initiators");
    }

    /// Two sockets and a CXL node behind each, as numa-vm's `--hmat`
    /// defaults describe them.
    #[test]
    fn revision_one_and_unreachable_entries() {
        assert_eq!(normalize(0, 1, 3, 2), None);
        assert_eq!(normalize(u16::MAX, 1, 3, 2), None);
        assert_eq!(normalize(80, 1000, 0, 2), Some(80), "80,000 ps");
        assert_eq!(normalize(5, 1, 3, 1), None, "revision 1: under 10 is nothing");
        assert_eq!(normalize(125, 1, 3, 1), Some(13));
        assert_eq!(normalize(u16::MAX - 1, u64::MAX, 3, 2), None, "overflow");
    }
}
