//! How much of a node's memory the kernel keeps movable, from
//! `/proc/zoneinfo`.
//!
//! Memory onlined into `ZONE_MOVABLE` (CXL expanders and other memory-only
//! nodes usually are, and `movable_node`, `movablecore=` or
//! `online_movable` make any node's so) holds only pages the kernel can
//! migrate. A long-term pin (an io_uring fixed buffer, an RDMA memory
//! region, a VFIO DMA mapping: `FOLL_LONGTERM` in `mm/gup.c`) cannot stay
//! there: before pinning, the kernel moves each such page to a zone that
//! takes pins, on the same node if one there has room, else on another
//! node. A pool that registers its pages may so find them off its node
//! with nothing said; the slab layer asks here whether that can happen
//! before it looks where the pages went.

use crate::error::Result;

/// A node's managed pages (base pages the buddy allocator owns) by the
/// kind of zone they are in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeZones {
    /// In `ZONE_MOVABLE`: no long-term pin may stay there.
    pub movable: u64,
    /// In every other zone (`DMA`, `DMA32`, `Normal`): pins stay.
    pub pinnable: u64,
}

/// The zones of kernel node `node` now (memory may be onlined or offlined
/// at any time); `None` when the file gives no managed pages of it (a node
/// it does not list, or lines it cannot read): not known.
pub fn node_zones(node: usize) -> Result<Option<NodeZones>> {
    let text = super::file::read_to_end(c"/proc/zoneinfo")?;
    Ok(parse(&String::from_utf8_lossy(&text), node))
}

/// [`node_zones`] of `text`, a `/proc/zoneinfo`: each zone starts with a
/// line `Node N, zone NAME` and gives its `managed` pages on a line of its
/// own (the per-CPU lists that follow have no such line).
pub(crate) fn parse(text: &str, node: usize) -> Option<NodeZones> {
    let mut z = NodeZones::default();
    let mut read = false;
    // The zone being read, if it is one of `node`'s: movable or not.
    let mut current: Option<bool> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("Node ") {
            current = rest
                .split_once(", zone")
                .and_then(|(n, name)| (n.trim().parse::<usize>().ok() == Some(node)).then(|| name.trim() == "Movable"));
        } else if let Some(movable) = current
            && let Some(v) = line.trim_start().strip_prefix("managed")
            && let Ok(pages) = v.trim().parse::<u64>()
        {
            read = true;
            if movable {
                z.movable += pages;
            } else {
                z.pinnable += pages;
            }
        }
    }
    read.then_some(z)
}

#[cfg(test)]
mod tests {
    use super::{NodeZones, parse};

    /// Lines as Linux 6.1 prints them (a memory-only node whose blocks were
    /// onlined movable but for the two holding its memory map), trimmed.
    const SAMPLE: &str = "\
Node 0, zone      DMA
  per-node stats
      nr_inactive_anon 10
  pages free     3840
        boost    0
        min      33
        spanned  4095
        present  3998
        managed  3840
  pagesets
    cpu: 0
              count 0
Node 0, zone    DMA32
  pages free     100000
        spanned  126976
        present  126976
        managed  124758
Node 0, zone  Movable
  pages free     0
        spanned  0
        present  0
        managed  0
Node 2, zone    DMA32
  pages free     52000
        spanned  65536
        present  65536
        managed  63000
Node 2, zone   Normal
  pages free     0
        spanned  0
        present  0
        managed  0
Node 2, zone  Movable
  pages free     65536
        spanned  65536
        present  65536
        managed  65536
Node 2, zone   Device
  pages free     0
        spanned  0
        present  0
        managed  0
";

    #[test]
    fn each_nodes_zones_are_summed_by_kind() {
        assert_eq!(parse(SAMPLE, 0), Some(NodeZones { movable: 0, pinnable: 3840 + 124_758 }));
        assert_eq!(parse(SAMPLE, 2), Some(NodeZones { movable: 65_536, pinnable: 63_000 }));
        // Node 1 is not listed; node 20 is not node 2: not known.
        assert_eq!(parse(SAMPLE, 1), None);
        assert_eq!(parse(SAMPLE, 20), None);
    }

    #[test]
    fn a_damaged_file_reads_as_not_known_not_a_panic() {
        for text in ["", "Node", "Node x, zone Movable\n managed 5", "Node 2, zone Movable\n managed -1\n managed z"] {
            assert_eq!(parse(text, 2), None, "{text:?}");
        }
    }

    #[test]
    fn this_machines_file_parses() {
        // Some node of every machine has memory that takes pins.
        let any = (0..1024).find_map(|n| super::node_zones(n).expect("/proc/zoneinfo").filter(|z| z.pinnable > 0));
        assert!(any.is_some(), "no node with pinnable memory read");
    }
}
