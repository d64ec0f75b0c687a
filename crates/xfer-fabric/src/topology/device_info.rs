//! Adds where a device sits to the [`DeviceInfo`] the verbs layer reports: NUMA node, PCI
//! address and speed from sysfs, the netdev and the IPv4 prefix of the selected GID.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::net::ipv4_prefix;
use super::sysfs::DeviceTopo;
use crate::DeviceInfo;

/// Fills `info`'s topology fields from `devices` (matched by name and port) and, when the
/// selected GID is IPv4-mapped, the prefix of that address on its interface.
pub fn add_topology(info: &mut DeviceInfo, devices: &[DeviceTopo]) {
    add_topology_with(info, devices, ipv4_prefix);
}

/// [`add_topology`] with the interface lookup as a parameter, so tests need no such interface.
fn add_topology_with(info: &mut DeviceInfo, devices: &[DeviceTopo], prefix_of: impl Fn(Ipv4Addr) -> Option<u8>) {
    let device = devices.iter().find(|d| d.name == info.name);
    let port = device.and_then(|d| d.ports.iter().find(|p| p.port == info.port));
    info.numa_node = device.and_then(|d| d.numa_node);
    info.pci_address = device.and_then(|d| d.pci_address.clone());
    info.speed_mbps = port.and_then(|p| p.rate_mbps);
    let selected = info.selected_gid_index.and_then(|i| info.gids.iter().find(|g| g.index == i));
    info.netdev = selected.map(|g| g.netdev.clone()).filter(|n| !n.is_empty()).or_else(|| port.and_then(|p| p.netdevs.first().cloned()));
    info.ipv4_prefix = selected.and_then(|g| Ipv6Addr::from(g.raw).to_ipv4_mapped()).and_then(prefix_of);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::sysfs::PortTopo;
    use crate::GidInfo;

    fn gid(index: u32, raw: [u8; 16], netdev: &str) -> GidInfo {
        GidInfo { index, raw, gid_type: "RoCEv2".into(), netdev: netdev.into() }
    }

    fn v4(a: [u8; 4]) -> [u8; 16] {
        Ipv4Addr::from(a).to_ipv6_mapped().octets()
    }

    fn topo() -> Vec<DeviceTopo> {
        let port = |port, rate, netdevs: &[&str]| PortTopo {
            port,
            state: "ACTIVE".into(),
            link_layer: "Ethernet".into(),
            rate_mbps: rate,
            netdevs: netdevs.iter().map(|s| s.to_string()).collect(),
        };
        vec![
            DeviceTopo { name: "mlx5_0".into(), numa_node: Some(0), pci_address: Some("0000:3b:00.0".into()), ports: vec![] },
            DeviceTopo {
                name: "mlx5_1".into(),
                numa_node: Some(1),
                pci_address: Some("0000:af:00.0".into()),
                ports: vec![port(1, Some(200_000), &["ens1np0"]), port(2, Some(100_000), &["ens1np1", "vlan7"])],
            },
        ]
    }

    fn prefixes(addr: Ipv4Addr) -> Option<u8> {
        (addr == Ipv4Addr::new(10, 1, 0, 5)).then_some(24)
    }

    #[test]
    fn a_device_gets_its_port_facts_and_the_selected_gids_subnet() {
        let mut info = DeviceInfo {
            name: "mlx5_1".into(),
            port: 2,
            gids: vec![gid(0, [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1], "ens1np1"), gid(3, v4([10, 1, 0, 5]), "vlan7")],
            selected_gid_index: Some(3),
            ..Default::default()
        };
        add_topology_with(&mut info, &topo(), prefixes);
        assert_eq!(info.numa_node, Some(1));
        assert_eq!(info.pci_address.as_deref(), Some("0000:af:00.0"));
        assert_eq!(info.speed_mbps, Some(100_000), "port 2's rate, not port 1's");
        assert_eq!(info.netdev.as_deref(), Some("vlan7"), "the selected GID's netdev");
        assert_eq!(info.ipv4_prefix, Some(24));
    }

    #[test]
    fn without_a_selected_ipv4_gid_the_ports_first_netdev_and_no_prefix() {
        let mut info = DeviceInfo { name: "mlx5_1".into(), port: 1, gids: vec![gid(0, v4([10, 1, 0, 5]), "")], ..Default::default() };
        add_topology_with(&mut info, &topo(), prefixes);
        assert_eq!((info.netdev.as_deref(), info.ipv4_prefix, info.speed_mbps), (Some("ens1np0"), None, Some(200_000)));
        info.selected_gid_index = Some(0);
        add_topology_with(&mut info, &topo(), prefixes);
        assert_eq!((info.netdev.as_deref(), info.ipv4_prefix), (Some("ens1np0"), Some(24)), "an empty GID netdev falls back");
        info.gids[0].raw = v4([192, 168, 0, 1]);
        add_topology_with(&mut info, &topo(), prefixes);
        assert_eq!(info.ipv4_prefix, None, "an address no interface holds");
    }

    #[test]
    fn a_device_or_port_sysfs_does_not_list_stays_unknown() {
        let mut info = DeviceInfo { name: "mlx5_0".into(), port: 1, ..Default::default() };
        add_topology_with(&mut info, &topo(), prefixes);
        assert_eq!((info.numa_node, info.pci_address.as_deref()), (Some(0), Some("0000:3b:00.0")));
        assert_eq!((info.speed_mbps, info.netdev.as_deref()), (None, None));
        let mut info = DeviceInfo { name: "rxe9".into(), port: 1, numa_node: Some(5), ..Default::default() };
        add_topology_with(&mut info, &topo(), prefixes);
        assert_eq!((info.numa_node, info.pci_address, info.speed_mbps, info.netdev), (None, None, None, None));
    }
}
