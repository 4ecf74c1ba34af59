//! Device locality: the NUMA node a PCI function, block device or network
//! interface is attached to, from sysfs (`…/numa_node`, where `-1` is the
//! kernel's `NUMA_NO_NODE`).
//!
//! Not on the allocator's start-up path, so it may allocate.

use std::path::{Path, PathBuf};

use super::Topology;
use crate::error::{DeviceKind, Error, Name, Result};
use crate::os::file::paths;

const SYSFS: &str = "/sys";

impl Topology {
    /// The node of the PCI function `bus_id` (`0000:03:00.0`, or `03:00.0` for
    /// domain 0). `Ok(None)` when the kernel reports no node (`-1`) or has no
    /// NUMA support; [`Error::NoSuchDevice`] for a malformed or absent id.
    ///
    /// ```
    /// use numaweave::{Error, topology::Topology};
    /// let t = Topology::global();
    /// assert!(matches!(t.pci_node("not-a-bus-id"), Err(Error::NoSuchDevice { .. })));
    /// ```
    pub fn pci_node(&self, bus_id: &str) -> Result<Option<usize>> {
        self.map_physical(lookup(Path::new(SYSFS), DeviceKind::Pci, bus_id)?)
    }

    /// The node of the block device or partition `name` (`nvme0n1`, `sda2`,
    /// `/dev/vda`), found by walking up from the device to the first ancestor
    /// (usually its PCI controller) that reports a node.
    pub fn block_device_node(&self, name: &str) -> Result<Option<usize>> {
        self.map_physical(lookup(Path::new(SYSFS), DeviceKind::Block, name)?)
    }

    /// The node of the network interface `name` (`eth0`); `Ok(None)` for a
    /// virtual interface (`lo`, bridges) or one without a node.
    pub fn net_device_node(&self, name: &str) -> Result<Option<usize>> {
        self.map_physical(lookup(Path::new(SYSFS), DeviceKind::Net, name)?)
    }

    /// The node of `name` tried as a PCI bus id, then a block device, then a
    /// network interface.
    pub fn device_node(&self, name: &str) -> Result<Option<usize>> {
        self.map_physical(lookup(Path::new(SYSFS), DeviceKind::Any, name)?)
    }

    /// The block device (or partition) that holds the file system of
    /// `path`, by its device number under `/sys/dev/block`: `vda`, `nvme0n1p2`.
    /// `Ok(None)` for file systems without one (tmpfs, overlay, NFS);
    /// [`Error::NoSuchDevice`] when `path` does not exist.
    ///
    /// ```
    /// use numaweave::topology::Topology;
    /// let t = Topology::global();
    /// if let Some(dev) = t.block_device_of(std::env::temp_dir()).unwrap() {
    ///     println!("{dev} on node {:?}", t.block_device_node(&dev).unwrap());
    /// }
    /// ```
    pub fn block_device_of(&self, path: impl AsRef<Path>) -> Result<Option<String>> {
        block_device_of(Path::new(SYSFS), path.as_ref())
    }

    /// Kernel node → this topology's node (the lowest logical node over it).
    fn map_physical(&self, node: Option<usize>) -> Result<Option<usize>> {
        Ok(node.and_then(|p| self.logical_node(p)))
    }
}

/// Looks `name` up under the sysfs tree at `root`; returns the kernel node id.
pub(crate) fn lookup(root: &Path, kind: DeviceKind, name: &str) -> Result<Option<usize>> {
    let missing = || Error::NoSuchDevice { kind, name: Name::new(name) };
    match kind {
        DeviceKind::Pci => {
            let id = pci_bus_id(name).ok_or_else(missing)?;
            let dir = root.join("bus/pci/devices").join(id);
            if !paths::exists(&dir) {
                return Err(missing());
            }
            read_numa_node(&dir.join("numa_node"))
        }
        DeviceKind::Block | DeviceKind::Net => {
            let name = name.strip_prefix("/dev/").unwrap_or(name);
            if !plain_name(name) {
                return Err(missing());
            }
            let class = if kind == DeviceKind::Block { "class/block" } else { "class/net" };
            let dev = paths::canonical(&root.join(class).join(name)).ok_or_else(missing)?;
            walk_up(root, &dev)
        }
        DeviceKind::Any => {
            for k in [DeviceKind::Pci, DeviceKind::Block, DeviceKind::Net] {
                match lookup(root, k, name) {
                    Err(Error::NoSuchDevice { .. }) => continue,
                    r => return r,
                }
            }
            Err(missing())
        }
    }
}

pub(crate) fn block_device_of(root: &Path, path: &Path) -> Result<Option<String>> {
    let dev = paths::device_number(path)
        .ok_or_else(|| Error::NoSuchDevice { kind: DeviceKind::Block, name: Name::new(&path.to_string_lossy()) })?;
    // glibc's `gnu_dev_major`/`gnu_dev_minor` encoding.
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let link = root.join(format!("dev/block/{major}:{minor}"));
    Ok(paths::read_link(&link).and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned())))
}

/// `DDDD:BB:DD.F` in lower case, accepting `BB:DD.F` for domain 0.
fn pci_bus_id(s: &str) -> Option<String> {
    let s = s.trim().to_ascii_lowercase();
    let full = if s.matches(':').count() == 1 { format!("0000:{s}") } else { s };
    let b = full.as_bytes();
    let shape = b.len() == 12 && b[4] == b':' && b[7] == b':' && b[10] == b'.';
    let hex = || [0..4, 5..7, 8..10, 11..12].into_iter().all(|r| b[r].iter().all(u8::is_ascii_hexdigit));
    (shape && hex()).then_some(full)
}

/// A single path component: no separators, no `.`/`..`, not empty.
fn plain_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 255 && s != "." && s != ".." && !s.contains(['/', '\0'])
}

/// The first `numa_node` file on the way from `dev` up to `root/devices`.
fn walk_up(root: &Path, dev: &Path) -> Result<Option<usize>> {
    let top: PathBuf = paths::canonical(root).unwrap_or_else(|| root.to_path_buf()).join("devices");
    for dir in dev.ancestors() {
        if !dir.starts_with(&top) || dir == top {
            break;
        }
        let f = dir.join("numa_node");
        if paths::exists(&f) {
            return read_numa_node(&f);
        }
    }
    Ok(None)
}

fn read_numa_node(f: &Path) -> Result<Option<usize>> {
    let Some(s) = paths::read_text(f)? else { return Ok(None) };
    let v: i64 = s.trim().parse().map_err(|_| Error::InvalidTopology { reason: "malformed numa_node file" })?;
    Ok(usize::try_from(v).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::symlink;

    /// A miniature sysfs: an NVMe controller on node 1, a NIC with no node (-1),
    /// a virtual interface without a device.
    fn fake_sysfs() -> PathBuf {
        let root = std::env::temp_dir().join(format!(
            "numaweave-sysfs-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&root);
        let pci = root.join("devices/pci0000:00");
        let nvme = pci.join("0000:03:00.0");
        fs::create_dir_all(nvme.join("nvme/nvme0/nvme0n1/nvme0n1p1")).unwrap();
        fs::write(nvme.join("numa_node"), "1\n").unwrap();
        let nic = pci.join("0000:05:00.1");
        fs::create_dir_all(nic.join("net/eth0")).unwrap();
        fs::write(nic.join("numa_node"), "-1\n").unwrap();
        fs::create_dir_all(root.join("devices/virtual/net/lo")).unwrap();
        for d in ["bus/pci/devices", "class/block", "class/net"] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        symlink(&nvme, root.join("bus/pci/devices/0000:03:00.0")).unwrap();
        symlink(&nic, root.join("bus/pci/devices/0000:05:00.1")).unwrap();
        symlink(nvme.join("nvme/nvme0/nvme0n1"), root.join("class/block/nvme0n1")).unwrap();
        symlink(nvme.join("nvme/nvme0/nvme0n1/nvme0n1p1"), root.join("class/block/nvme0n1p1")).unwrap();
        symlink(nic.join("net/eth0"), root.join("class/net/eth0")).unwrap();
        symlink(root.join("devices/virtual/net/lo"), root.join("class/net/lo")).unwrap();
        root
    }

    #[test]
    fn finds_nodes_through_sysfs_links() {
        let root = fake_sysfs();
        assert_eq!(lookup(&root, DeviceKind::Pci, "0000:03:00.0").unwrap(), Some(1));
        assert_eq!(lookup(&root, DeviceKind::Pci, "03:00.0").unwrap(), Some(1));
        assert_eq!(lookup(&root, DeviceKind::Pci, "0000:05:00.1").unwrap(), None);
        assert_eq!(lookup(&root, DeviceKind::Block, "nvme0n1").unwrap(), Some(1));
        assert_eq!(lookup(&root, DeviceKind::Block, "/dev/nvme0n1p1").unwrap(), Some(1));
        assert_eq!(lookup(&root, DeviceKind::Net, "eth0").unwrap(), None);
        assert_eq!(lookup(&root, DeviceKind::Net, "lo").unwrap(), None);
        assert_eq!(lookup(&root, DeviceKind::Any, "nvme0n1").unwrap(), Some(1));
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn bad_names_are_errors_not_panics() {
        let root = fake_sysfs();
        for (kind, name) in [
            (DeviceKind::Pci, "0000:99:00.0"),
            (DeviceKind::Pci, "zz:00.0"),
            (DeviceKind::Pci, ""),
            (DeviceKind::Block, "sdz"),
            (DeviceKind::Block, "../../etc"),
            (DeviceKind::Block, ""),
            (DeviceKind::Net, "eth0/../lo"),
            (DeviceKind::Any, "nothing-here"),
        ] {
            match lookup(&root, kind, name) {
                Err(Error::NoSuchDevice { kind: k, name: n }) => {
                    assert_eq!(k, kind);
                    assert_eq!(n.as_str(), name);
                }
                other => panic!("{kind:?} {name:?}: {other:?}"),
            }
        }
        let msg = lookup(&root, DeviceKind::Block, "sdz").unwrap_err().to_string();
        assert_eq!(msg, "no such block device: \"sdz\"");
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn real_sysfs_loopback_has_no_node() {
        let t = Topology::detect().unwrap();
        assert_eq!(t.net_device_node("lo").unwrap(), None);
        assert!(t.block_device_node("no-such-disk-xyz").is_err());
    }
}
