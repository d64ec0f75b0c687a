//! The NUMA node a region's memory is on, from `/proc/self/numa_maps`.
//!
//! Each line of that file is one mapping (VMA): its start address, its policy, then
//! `key=value` fields, among them `N<node>=<pages>` for every node holding pages of it and
//! `kernelpagesize_kB=<size>`. Lines carry no end address, so a range's mappings are the one the
//! range starts in (the last starting at or below it: a region's memory is mapped) and every
//! mapping starting inside the range. Counts are per mapping, so a small region inside a large
//! mapping is judged by the whole mapping. Pages are weighed by their size, so one 2 MiB huge
//! page counts as much as 512 small ones.
//!
//! The kernel walks each mapping's page tables to print its line, which is costly for large
//! processes; [`region_node`] stops reading once past the range, and callers should ask once per
//! region, not per transfer.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader};

/// One line of `numa_maps`: where the mapping starts and the bytes it holds per node.
struct Mapping {
    start: u64,
    bytes: BTreeMap<u32, u64>,
}

/// Parses one line; `None` when it does not start with a hex address.
fn parse_line(line: &str) -> Option<Mapping> {
    let mut fields = line.split_whitespace();
    let start = u64::from_str_radix(fields.next()?, 16).ok()?;
    let mut page_kb: u64 = 4;
    let mut pages: Vec<(u32, u64)> = Vec::new();
    for field in fields {
        let Some((key, value)) = field.split_once('=') else { continue };
        if key == "kernelpagesize_kB" {
            page_kb = value.parse().unwrap_or(page_kb);
        } else if let Some(node) = key.strip_prefix('N') {
            // `file=/path/N3=1` cannot reach here as a node: its key is `file`.
            if let (Ok(node), Ok(count)) = (node.parse::<u32>(), value.parse::<u64>()) {
                pages.push((node, count));
            }
        }
    }
    let mut bytes = BTreeMap::new();
    for (node, count) in pages {
        let b = count.saturating_mul(page_kb).saturating_mul(1024);
        let total: &mut u64 = bytes.entry(node).or_default();
        *total = total.saturating_add(b);
    }
    Some(Mapping { start, bytes })
}

/// Tallies the mappings of one range `[addr, end)`, line by line.
struct Tally {
    addr: u64,
    end: u64,
    /// The mapping the range starts in: the last one starting at or below `addr`.
    first: Option<Mapping>,
    /// Bytes per node of the mappings starting inside the range.
    inside: BTreeMap<u32, u64>,
}

impl Tally {
    fn new(addr: u64, len: u64) -> Self {
        // An empty range still names the mapping `addr` is in.
        Tally { addr, end: addr.saturating_add(len.max(1)), first: None, inside: BTreeMap::new() }
    }

    fn add(&mut self, m: Mapping) {
        if m.start <= self.addr {
            if self.first.as_ref().is_none_or(|f| f.start <= m.start) {
                self.first = Some(m);
            }
        } else if m.start < self.end {
            for (node, b) in m.bytes {
                let total = self.inside.entry(node).or_default();
                *total = total.saturating_add(b);
            }
        }
    }

    /// The node with the most bytes (the lowest such node on a tie, as when pages are
    /// interleaved evenly); `None` when no page is placed yet.
    fn node(mut self) -> Option<u32> {
        if let Some(first) = self.first.take() {
            for (node, b) in first.bytes {
                let total = self.inside.entry(node).or_default();
                *total = total.saturating_add(b);
            }
        }
        // Ascending node order, and max_by_key keeps the last maximum: compare reversed nodes.
        self.inside.into_iter().filter(|(_, b)| *b > 0).max_by_key(|(node, b)| (*b, std::cmp::Reverse(*node))).map(|(node, _)| node)
    }
}

/// The node holding most of the pages of the mappings overlapping `[addr, addr + len)`, from
/// `text` in `/proc/self/numa_maps` format; `None` when no mapping holds a placed page (memory
/// not touched yet) or none overlaps.
pub fn parse_numa_maps(text: &str, addr: u64, len: u64) -> Option<u32> {
    let mut tally = Tally::new(addr, len);
    text.lines().filter_map(parse_line).for_each(|m| tally.add(m));
    tally.node()
}

/// [`parse_numa_maps`] over this process's `/proc/self/numa_maps`; `None` also when the file
/// cannot be read (no NUMA support, a kernel without it).
pub fn region_node(addr: u64, len: u64) -> Option<u32> {
    let file = File::open("/proc/self/numa_maps").ok()?;
    let mut tally = Tally::new(addr, len);
    for line in BufReader::new(file).lines() {
        let Ok(line) = line else { break };
        let Some(m) = parse_line(&line) else { continue };
        // The kernel prints mappings in address order: nothing later overlaps the range, and
        // every line not read is a page-table walk saved.
        if m.start >= tally.end {
            break;
        }
        tally.add(m);
    }
    tally.node()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_NODES: &str = "\
55d0c4a00000 default file=/usr/bin/xfer-agent mapped=120 N0=120 kernelpagesize_kB=4
7f0000000000 default anon=1024 dirty=1024 N0=1000 N1=24 kernelpagesize_kB=4
7f0000400000 default anon=2048 dirty=2048 N1=2048 kernelpagesize_kB=4
7f0000c00000 bind:1 anon=256 dirty=256 N1=256 kernelpagesize_kB=4
7f0001000000 default
7f0002000000 interleave:0-1 anon=512 dirty=512 N0=256 N1=256 kernelpagesize_kB=4
7f0003000000 default file=/dev/hugepages/r\\040(deleted) huge dirty=2 N0=2 kernelpagesize_kB=2048
7f0003400000 default anon=600 dirty=600 N1=600 kernelpagesize_kB=4
7ffd1c000000 default stack anon=33 dirty=33 N0=33 kernelpagesize_kB=4
";

    #[test]
    fn a_range_inside_one_mapping_takes_its_majority() {
        assert_eq!(parse_numa_maps(TWO_NODES, 0x7f00_0000_1000, 4096), Some(0));
        assert_eq!(parse_numa_maps(TWO_NODES, 0x7f00_0040_0000, 1 << 20), Some(1));
        assert_eq!(parse_numa_maps(TWO_NODES, 0x7f00_00c0_0000, 4096), Some(1));
    }

    #[test]
    fn a_range_over_several_mappings_weighs_them_all() {
        // 1000 pages on node 0 against 24 + 2048 on node 1.
        assert_eq!(parse_numa_maps(TWO_NODES, 0x7f00_0000_0000, 0x80_0000), Some(1));
        // Ends exactly where the second mapping starts: only the first counts.
        assert_eq!(parse_numa_maps(TWO_NODES, 0x7f00_0000_0000, 0x40_0000), Some(0));
    }

    #[test]
    fn untouched_memory_has_no_node() {
        assert_eq!(parse_numa_maps(TWO_NODES, 0x7f00_0100_0000, 4096), None);
        assert_eq!(parse_numa_maps("7f0000000000 default\n7f0001000000 default anon=0\n", 0x7f00_0000_0000, 1 << 30), None);
        assert_eq!(parse_numa_maps("", 0x1000, 4096), None);
        // Below the first mapping: nothing holds it.
        assert_eq!(parse_numa_maps(TWO_NODES, 0x1000, 4096), None);
    }

    #[test]
    fn an_even_interleave_goes_to_the_lowest_node() {
        assert_eq!(parse_numa_maps(TWO_NODES, 0x7f00_0200_0000, 1 << 21), Some(0));
        let uneven = "7f0002000000 interleave:0-3 anon=9 N0=2 N1=2 N2=3 N3=2 kernelpagesize_kB=4\n";
        assert_eq!(parse_numa_maps(uneven, 0x7f00_0200_0000, 4096), Some(2));
    }

    #[test]
    fn huge_pages_weigh_by_their_size() {
        // Two 2 MiB pages on node 0 (4 MiB) against 600 small pages on node 1 (2.3 MiB).
        assert_eq!(parse_numa_maps(TWO_NODES, 0x7f00_0300_0000, 0x80_0000), Some(0));
        // Without the page size, 600 pages would beat 2.
        let small = TWO_NODES.replace("kernelpagesize_kB=2048", "kernelpagesize_kB=4");
        assert_eq!(parse_numa_maps(&small, 0x7f00_0300_0000, 0x80_0000), Some(1));
    }

    #[test]
    fn junk_lines_and_fields_are_ignored() {
        let text = "not an address\n\
7f0000000000 default N=5 Nx=3 N1=huge N-1=4 =7 N2=3 kernelpagesize_kB=4 file=/N9=100\n\
zz bind:0 N0=999\n";
        assert_eq!(parse_numa_maps(text, 0x7f00_0000_0000, 4096), Some(2));
        let overflow = "0 default N0=18446744073709551615 N1=1 kernelpagesize_kB=18446744073709551615\n";
        assert_eq!(parse_numa_maps(overflow, u64::MAX - 1, u64::MAX), Some(0));
    }

    #[test]
    fn lines_need_not_be_in_order() {
        let text = "7f0000400000 default N1=10\n7f0000000000 default N0=5\n";
        assert_eq!(parse_numa_maps(text, 0x7f00_0000_1000, 4096), Some(0));
        assert_eq!(parse_numa_maps(text, 0x7f00_0040_1000, 4096), Some(1));
    }

    #[test]
    fn this_processes_touched_memory_has_a_node_where_numa_maps_exists() {
        let buf = vec![1u8; 1 << 20];
        let node = region_node(buf.as_ptr() as u64, buf.len() as u64);
        if std::path::Path::new("/proc/self/numa_maps").exists() {
            assert!(node.is_some(), "touched heap memory is on some node");
        } else {
            assert_eq!(node, None);
        }
    }
}
