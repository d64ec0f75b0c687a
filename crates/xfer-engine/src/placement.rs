//! Placement: which paths a transfer uses and in what proportion, as a pure function of the
//! region's NUMA node, the devices' facts and the paths' state ([`place`]). The transfer machine
//! stripes by the weights it returns (`MachineConfig::weights`); weight 0 is a standby path, used
//! only when every positive-weight path is down.
//!
//! The policy: a transfer prefers the paths whose local device sits on its region's NUMA node
//! (DMA to a device on the other socket crosses the inter-socket link, which costs throughput and
//! the other socket's memory bandwidth). It spreads over every usable path when that finishes
//! the work sooner by more than [`MIN_GAIN`], counting a remote device at its capacity divided by
//! [`CROSS_SOCKET_COST`]. "The work" is the bytes already in flight on a set plus this transfer's,
//! so a small transfer on idle local devices stays local, and one that arrives while they are busy
//! (or while some of them are down) spills over. Weights are proportional to each path's
//! capacity: its measured rate when there is one, else its device's nominal speed.
use std::time::Duration;

/// What a device is, from sysfs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceFacts {
    pub name: String,
    /// The NUMA node the device is attached to (`None`: unknown, or a single-node host).
    pub numa: Option<u32>,
    /// The port's link speed, in Mb/s.
    pub speed_mbps: Option<u64>,
}

/// One path as placement sees it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PathView {
    /// Its local device: an index into the `devices` passed to [`place`].
    pub device: usize,
    /// Up, or its back-off passed ([`crate::paths::PathHealth::usable`]).
    pub usable: bool,
    /// Measured throughput in bytes/s ([`crate::paths::Rate`]), once known.
    pub rate: Option<f64>,
    /// Bytes posted on it and not yet completed, all transfers together.
    pub in_flight: u64,
}

/// What DMA through a device on another NUMA node costs against a local one: the inter-socket
/// link caps it and it takes the other socket's memory bandwidth (measured 1.3–2x on two-socket
/// servers; 1.5 is the middle). A remote device counts at its capacity divided by this.
pub const CROSS_SOCKET_COST: f64 = 1.5;

/// Spreading to the other socket's devices must finish the work at least this much sooner: below
/// it a transfer is latency-bound (a few MB on idle local devices) and spreading buys nothing
/// worth the cross-socket traffic.
pub const MIN_GAIN: Duration = Duration::from_millis(1);

/// The largest weight [`place`] gives (the others are scaled to it).
pub const MAX_WEIGHT: u32 = 1000;

/// The weight of each path (same order as `paths`) for a transfer of `bytes` from a region on
/// NUMA node `region_numa` (`None`: unknown, every path is preferred). Unusable paths get 0; so
/// do the usable remote ones when the local ones suffice (they stay standby). Never all zero
/// while a path is usable.
pub fn place(region_numa: Option<u32>, devices: &[DeviceFacts], paths: &[PathView], bytes: u64) -> Vec<u32> {
    let caps = capacities(devices, paths);
    let local = |p: &PathView| match (region_numa, devices.get(p.device).and_then(|d| d.numa)) {
        (Some(r), Some(d)) => r == d,
        // Unknown on either side: no reason to avoid it.
        _ => true,
    };
    let usable: Vec<usize> = (0..paths.len()).filter(|&i| paths[i].usable).collect();
    let preferred: Vec<usize> = usable.iter().copied().filter(|&i| local(&paths[i])).collect();
    // Effective capacity for this region: a remote device pays the cross-socket cost.
    let eff = |i: usize| if local(&paths[i]) { caps[i] } else { caps[i] / CROSS_SOCKET_COST };
    let chosen = if preferred.is_empty() {
        usable
    } else if preferred.len() < usable.len() {
        let finish = |set: &[usize]| {
            let work: u64 = set.iter().map(|&i| paths[i].in_flight).fold(bytes, u64::saturating_add);
            let cap: f64 = set.iter().map(|&i| eff(i)).sum();
            work as f64 / cap.max(f64::MIN_POSITIVE)
        };
        let gain = finish(&preferred) - finish(&usable);
        if gain > MIN_GAIN.as_secs_f64() {
            usable
        } else {
            preferred
        }
    } else {
        preferred
    };
    let top = chosen.iter().map(|&i| eff(i)).fold(0.0, f64::max);
    let mut w = vec![0u32; paths.len()];
    for &i in &chosen {
        // At least 1: a chosen path is never standby.
        w[i] = ((eff(i) / top * MAX_WEIGHT as f64).round() as u32).clamp(1, MAX_WEIGHT);
    }
    w
}

/// Each path's capacity in bytes/s: measured, else nominal; a path with neither counts as the
/// slowest one known (as 1 when nothing is known: equal shares).
fn capacities(devices: &[DeviceFacts], paths: &[PathView]) -> Vec<f64> {
    let known: Vec<Option<f64>> = paths
        .iter()
        .map(|p| {
            let nominal = devices.get(p.device).and_then(|d| d.speed_mbps).filter(|&s| s > 0).map(|s| s as f64 * 1e6 / 8.0);
            p.rate.filter(|r| r.is_finite() && *r > 0.0).or(nominal)
        })
        .collect();
    let floor = known.iter().flatten().copied().reduce(f64::min).unwrap_or(1.0);
    known.into_iter().map(|c| c.unwrap_or(floor)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    /// A two-socket server with eight 200 Gb/s NICs, four per socket: mlx5_0..3 on node 0,
    /// mlx5_4..7 on node 1; one idle usable path per device.
    fn server() -> (Vec<DeviceFacts>, Vec<PathView>) {
        let devices = (0..8).map(|i| DeviceFacts { name: format!("mlx5_{i}"), numa: Some(i / 4), speed_mbps: Some(200_000) }).collect();
        let paths = (0..8).map(|i| PathView { device: i, usable: true, rate: None, in_flight: 0 }).collect();
        (devices, paths)
    }

    #[test]
    fn a_small_transfer_uses_only_the_local_socket() {
        let (d, p) = server();
        assert_eq!(place(Some(1), &d, &p, 64 * MIB), vec![0, 0, 0, 0, 1000, 1000, 1000, 1000]);
        assert_eq!(place(Some(0), &d, &p, 64 * MIB), vec![1000, 1000, 1000, 1000, 0, 0, 0, 0]);
    }

    /// Local devices busy with other transfers: this one spills to the other socket, whose
    /// devices weigh 1/1.5 of a local one.
    #[test]
    fn busy_local_devices_spill_to_the_other_socket() {
        let (d, mut p) = server();
        for v in &mut p[4..] {
            v.in_flight = GIB;
        }
        assert_eq!(place(Some(1), &d, &p, 64 * MIB), vec![667, 667, 667, 667, 1000, 1000, 1000, 1000]);
        // A large transfer alone spills too: the local socket would take 43 ms, all of them 26.
        let (d, p) = server();
        let w = place(Some(1), &d, &p, 4 * GIB);
        assert!(w[..4].iter().all(|&x| x == 667) && w[4..].iter().all(|&x| x == 1000), "{w:?}");
    }

    /// Two local devices down: the two left carry it all while they suffice, and once the work
    /// outgrows them the other socket joins.
    #[test]
    fn two_local_devices_down_leave_the_others_more() {
        let (d, mut p) = server();
        p[4].usable = false;
        p[5].usable = false;
        assert_eq!(place(Some(1), &d, &p, 16 * MIB), vec![0, 0, 0, 0, 0, 0, 1000, 1000]);
        assert_eq!(place(Some(1), &d, &p, GIB), vec![667, 667, 667, 667, 0, 0, 1000, 1000]);
    }

    #[test]
    fn every_local_device_down_moves_to_the_remote_ones() {
        let (d, mut p) = server();
        for v in &mut p[4..] {
            v.usable = false;
        }
        assert_eq!(place(Some(1), &d, &p, MIB), vec![1000, 1000, 1000, 1000, 0, 0, 0, 0]);
        for v in &mut p {
            v.usable = false;
        }
        assert_eq!(place(Some(1), &d, &p, MIB), vec![0; 8], "nothing usable, nothing placed");
    }

    /// Without the region's NUMA node (or the devices'), every path is preferred and weighs
    /// its capacity: measured where measured, nominal elsewhere.
    #[test]
    fn unknown_numa_uses_every_path_by_capacity() {
        let (d, mut p) = server();
        assert_eq!(place(None, &d, &p, MIB), vec![1000; 8]);
        p[0].rate = Some(12.5e9); // half its 25 GB/s line rate
        assert_eq!(place(None, &d, &p, MIB), vec![500, 1000, 1000, 1000, 1000, 1000, 1000, 1000]);
        let unknown: Vec<DeviceFacts> = d.iter().map(|x| DeviceFacts { numa: None, ..x.clone() }).collect();
        assert_eq!(place(Some(1), &unknown, &p, MIB)[0], 500, "devices of unknown node count as local");
    }

    #[test]
    fn paths_without_facts_get_equal_or_slowest_shares() {
        let d = vec![DeviceFacts::default(), DeviceFacts { speed_mbps: Some(100_000), ..Default::default() }];
        let p =
            vec![PathView { device: 0, usable: true, ..Default::default() }, PathView { device: 1, usable: true, ..Default::default() }];
        assert_eq!(place(None, &d, &p, MIB), vec![1000, 1000], "the unknown one counts as the slowest known");
        let p2 =
            vec![PathView { device: 7, usable: true, ..Default::default() }, PathView { device: 0, usable: true, ..Default::default() }];
        assert_eq!(place(Some(0), &d, &p2, MIB), vec![1000, 1000], "no facts at all (or a device index out of range)");
    }
}
