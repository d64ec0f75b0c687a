//! What each RDMA device is and where it sits, read from a sysfs tree (`<root>/class/infiniband`):
//! NUMA node, PCI address, and per port the state, link layer, rate and netdevs.
//!
//! The root is a parameter so tests read fake trees. The tree is read defensively, because a
//! container may mount anything there: every name is validated (no '/', no "..", bounded length,
//! printable), every file is read through its canonical path only when that stays under the root
//! and is a regular file (so no symlink escapes it, loops fail cleanly and FIFOs are never opened),
//! reads are bounded in bytes and directory listings in entries. Anything unreadable or malformed
//! becomes an absent fact, never an error or a panic.

use std::cmp::Ordering;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

/// One RDMA device and its ports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceTopo {
    pub name: String,
    /// The NUMA node of the device's PCI function; `None` for software devices (rxe) and hosts
    /// without NUMA (`numa_node` reads -1).
    pub numa_node: Option<u32>,
    /// `dddd:bb:dd.f`, the PCI function the device is; `None` without a PCI parent.
    pub pci_address: Option<String>,
    /// By port number.
    pub ports: Vec<PortTopo>,
}

/// One port of a device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PortTopo {
    pub port: u32,
    /// The state's name (`ACTIVE`, `DOWN`, ...) without the kernel's numeric prefix; empty when
    /// unreadable.
    pub state: String,
    /// `Ethernet` or `InfiniBand`; empty when unreadable.
    pub link_layer: String,
    /// From `rate` (`100 Gb/sec (4X EDR)` → 100,000); `None` when unreadable or zero.
    pub rate_mbps: Option<u64>,
    /// The netdevs of the port's GID entries, in GID index order, without duplicates.
    pub netdevs: Vec<String>,
}

/// Longest file read (sysfs attributes are one short line).
const MAX_FILE_BYTES: u64 = 4096;
/// Longest name accepted: device names are at most 63 bytes (`IB_DEVICE_NAME_MAX`), netdevs 15.
const MAX_NAME_LEN: usize = 64;
/// Most directory entries looked at in one listing (devices, ports, GID entries).
const MAX_ENTRIES: usize = 4096;
/// Highest port number (verbs port numbers are one byte).
const MAX_PORT: u32 = 255;

/// Every RDMA device under `<root>/class/infiniband`, sorted by name (numbers in order:
/// `mlx5_2` before `mlx5_10`). An absent or unreadable tree gives no devices.
pub fn read_devices(root: &Path) -> Vec<DeviceTopo> {
    let Ok(root) = fs::canonicalize(root) else { return Vec::new() };
    let tree = Tree { root };
    let class = tree.root.join("class").join("infiniband");
    let mut devices: Vec<DeviceTopo> = tree
        .list(&class)
        .into_iter()
        .filter(|n| valid_name(n))
        // A device directory that resolves outside the root is not part of this tree.
        .filter_map(|name| tree.resolve(&class.join(&name)).map(|dir| tree.device(&dir, name)))
        .collect();
    devices.sort_by(|a, b| natural_cmp(&a.name, &b.name));
    devices
}

/// The RDMA device `name` under `<root>/class/infiniband` alone, as [`read_devices`] reads it,
/// without reading the others: a port's GID entries are one file each (1,024 on Soft-RoCE), so a
/// device's facts take thousands of reads, and a device asking about itself has no use for the
/// rest of the host's. `None` when the device is absent, `name` is not a valid name, or its
/// directory resolves outside the root.
pub fn read_device(root: &Path, name: &str) -> Option<DeviceTopo> {
    if !valid_name(name) {
        return None;
    }
    let tree = Tree { root: fs::canonicalize(root).ok()? };
    let dir = tree.resolve(&tree.root.join("class").join("infiniband").join(name))?;
    Some(tree.device(&dir, name.to_string()))
}

/// A sysfs tree whose reads stay under `root` (canonical).
struct Tree {
    root: PathBuf,
}

impl Tree {
    /// The canonical form of `path` when it exists and stays under the root.
    fn resolve(&self, path: &Path) -> Option<PathBuf> {
        let real = fs::canonicalize(path).ok()?;
        real.starts_with(&self.root).then_some(real)
    }

    /// The names in directory `dir` (at most [`MAX_ENTRIES`], UTF-8 only), sorted.
    fn list(&self, dir: &Path) -> Vec<String> {
        let Some(dir) = self.resolve(dir) else { return Vec::new() };
        let Ok(entries) = fs::read_dir(&dir) else { return Vec::new() };
        let mut names: Vec<String> =
            entries.take(MAX_ENTRIES).filter_map(|e| e.ok()).filter_map(|e| e.file_name().into_string().ok()).collect();
        names.sort();
        names
    }

    /// The trimmed text of a regular file under the root: `None` when missing, outside the root,
    /// not a regular file, longer than [`MAX_FILE_BYTES`], not UTF-8 or holding control characters.
    fn read(&self, path: &Path) -> Option<String> {
        let real = self.resolve(path)?;
        if !fs::metadata(&real).ok()?.is_file() {
            return None;
        }
        let mut bytes = Vec::new();
        // One byte more than allowed tells an oversized file from one exactly at the limit.
        fs::File::open(&real).ok()?.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).ok()?;
        if bytes.len() as u64 > MAX_FILE_BYTES {
            return None;
        }
        let text = String::from_utf8(bytes).ok()?;
        let text = text.trim();
        (!text.chars().any(char::is_control)).then(|| text.to_string())
    }

    fn device(&self, dir: &Path, name: String) -> DeviceTopo {
        let link = dir.join("device");
        // The parent's name, only when the link leads to a directory inside the tree.
        let pci_address = self
            .resolve(&link)
            .filter(|real| real.is_dir())
            .and_then(|real| real.file_name().and_then(|n| n.to_str()).map(str::to_string))
            .filter(|n| is_pci_address(n));
        // Only a device with a parent has a node; rxe and other software devices have none.
        let numa_node = self.read(&link.join("numa_node")).and_then(|t| parse_numa_node(&t));
        let ports_dir = dir.join("ports");
        let mut ports: Vec<PortTopo> = self
            .list(&ports_dir)
            .into_iter()
            .filter_map(|n| n.parse::<u32>().ok().filter(|p| (1..=MAX_PORT).contains(p)).map(|p| (n, p)))
            .map(|(n, port)| self.port(&ports_dir.join(n), port))
            .collect();
        ports.sort_by_key(|p| p.port);
        DeviceTopo { name, numa_node, pci_address, ports }
    }

    fn port(&self, dir: &Path, port: u32) -> PortTopo {
        let state = self.read(&dir.join("state")).map(|t| state_name(&t)).unwrap_or_default();
        let link_layer = self.read(&dir.join("link_layer")).filter(|t| valid_name(t)).unwrap_or_default();
        let rate_mbps = self.read(&dir.join("rate")).and_then(|t| parse_rate_mbps(&t));
        let ndevs = dir.join("gid_attrs").join("ndevs");
        let mut indices: Vec<(u32, String)> = self.list(&ndevs).into_iter().filter_map(|n| n.parse::<u32>().ok().map(|i| (i, n))).collect();
        indices.sort_by_key(|(i, _)| *i);
        let mut netdevs: Vec<String> = Vec::new();
        for (_, entry) in indices {
            // Unpopulated GID entries fail to read (EINVAL/ENODATA): skipped like empty ones.
            let Some(netdev) = self.read(&ndevs.join(entry)).filter(|n| valid_name(n)) else { continue };
            if !netdevs.contains(&netdev) {
                netdevs.push(netdev);
            }
        }
        PortTopo { port, state, link_layer, rate_mbps, netdevs }
    }
}

/// A name from the tree is usable when it is short, printable, without whitespace, and cannot
/// be read as a path component other than itself.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name != "."
        && name != ".."
        && !name.contains("..")
        && name.chars().all(|c| c.is_ascii_graphic() && c != '/')
}

/// `dddd:bb:dd.f` in hex (domains of up to 8 digits occur on VMD and some hypervisors).
fn is_pci_address(s: &str) -> bool {
    let hex = |part: &str, min: usize, max: usize| (min..=max).contains(&part.len()) && part.chars().all(|c| c.is_ascii_hexdigit());
    let mut parts = s.split(':');
    let (Some(domain), Some(bus), Some(rest), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let Some((slot, function)) = rest.split_once('.') else { return false };
    hex(domain, 4, 8) && hex(bus, 2, 2) && hex(slot, 2, 2) && function.len() == 1 && matches!(function.as_bytes()[0], b'0'..=b'7')
}

/// `numa_node`'s value: -1 (no node) and anything unparseable are `None`.
fn parse_numa_node(text: &str) -> Option<u32> {
    text.parse::<i64>().ok().and_then(|n| u32::try_from(n).ok())
}

/// `4: ACTIVE` → `ACTIVE`; text without the numeric prefix is kept whole when it is a name.
fn state_name(text: &str) -> String {
    let name = text.split_once(':').map(|(_, n)| n.trim()).unwrap_or(text);
    if valid_name(name) {
        name.to_string()
    } else {
        String::new()
    }
}

/// `200 Gb/sec (4X HDR)` → 200,000; `2.5 Gb/sec (1X SDR)` → 2,500; `None` for zero, other units
/// or anything else. Integer arithmetic only, so no float rounding and no overflow.
fn parse_rate_mbps(text: &str) -> Option<u64> {
    let mut words = text.split_whitespace();
    let number = words.next()?;
    let per_unit: u64 = match words.next()? {
        "Gb/sec" | "Gb/s" => 1000,
        "Mb/sec" | "Mb/s" => 1,
        _ => return None,
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() || !whole.chars().all(|c| c.is_ascii_digit()) || !fraction.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let mut mbps = whole.parse::<u64>().ok()?.checked_mul(per_unit)?;
    // Fraction digits below one Mb/s are dropped: 14.0625 Gb/s is 14,062 Mb/s.
    let mut scale = per_unit;
    for digit in fraction.bytes() {
        scale /= 10;
        if scale == 0 {
            break;
        }
        mbps = mbps.checked_add(u64::from(digit - b'0') * scale)?;
    }
    (mbps > 0).then_some(mbps)
}

/// Orders names with a trailing number by that number: `mlx5_2` < `mlx5_10`.
fn natural_cmp(a: &str, b: &str) -> Ordering {
    fn split(s: &str) -> (&str, Option<u64>) {
        let digits = s.len() - s.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        let (stem, number) = s.split_at(s.len() - digits);
        (stem, number.parse().ok())
    }
    split(a).cmp(&split(b)).then_with(|| a.cmp(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_to_megabits() {
        assert_eq!(parse_rate_mbps("200 Gb/sec (4X HDR)"), Some(200_000));
        assert_eq!(parse_rate_mbps("100 Gb/sec (4X EDR)"), Some(100_000));
        assert_eq!(parse_rate_mbps("2.5 Gb/sec (1X SDR)"), Some(2_500));
        assert_eq!(parse_rate_mbps("14.0625 Gb/sec (1X FDR)"), Some(14_062));
        assert_eq!(parse_rate_mbps("10 Gb/sec (1X QDR)"), Some(10_000));
        assert_eq!(parse_rate_mbps("0 Gb/sec"), None);
        assert_eq!(parse_rate_mbps("fast"), None);
        assert_eq!(parse_rate_mbps("100 furlongs"), None);
        assert_eq!(parse_rate_mbps("-1 Gb/sec"), None);
        assert_eq!(parse_rate_mbps("1.x Gb/sec"), None);
        assert_eq!(parse_rate_mbps("99999999999999999999 Gb/sec"), None);
        assert_eq!(parse_rate_mbps("18446744073709552 Gb/sec"), None);
        assert_eq!(parse_rate_mbps(""), None);
    }

    #[test]
    fn pci_addresses_are_recognised() {
        assert!(is_pci_address("0000:3b:00.0"));
        assert!(is_pci_address("10000:e1:00.1"));
        assert!(!is_pci_address("0000:3b:00.8"));
        assert!(!is_pci_address("0000:3b:00"));
        assert!(!is_pci_address("pci0000:00"));
        assert!(!is_pci_address("0000:3b:00.0:1"));
        assert!(!is_pci_address("virtual"));
        assert!(!is_pci_address("0000:3b:0g.0"));
        assert!(!is_pci_address("0000:3b:00."));
    }

    #[test]
    fn numa_node_minus_one_is_none() {
        assert_eq!(parse_numa_node("0"), Some(0));
        assert_eq!(parse_numa_node("3"), Some(3));
        assert_eq!(parse_numa_node("-1"), None);
        assert_eq!(parse_numa_node("lots"), None);
        assert_eq!(parse_numa_node("99999999999"), None);
    }

    #[test]
    fn states_lose_their_number() {
        assert_eq!(state_name("4: ACTIVE"), "ACTIVE");
        assert_eq!(state_name("1: DOWN"), "DOWN");
        assert_eq!(state_name("ACTIVE"), "ACTIVE");
        assert_eq!(state_name("4: ../../x"), "");
        assert_eq!(state_name("4: two words"), "");
    }

    #[test]
    fn names_are_validated() {
        assert!(valid_name("mlx5_0"));
        assert!(valid_name("enp59s0f1np1"));
        assert!(!valid_name(""));
        assert!(!valid_name("."));
        assert!(!valid_name(".."));
        assert!(!valid_name("a..b"));
        assert!(!valid_name("a/b"));
        assert!(!valid_name("a b"));
        assert!(!valid_name("naïve"));
        assert!(!valid_name(&"x".repeat(65)));
    }

    #[test]
    fn trailing_numbers_sort_numerically() {
        let mut names = vec!["mlx5_10", "mlx5_2", "rxe0", "mlx5_1", "mlx4_0", "ib"];
        names.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(names, ["ib", "mlx4_0", "mlx5_1", "mlx5_2", "mlx5_10", "rxe0"]);
    }
}
