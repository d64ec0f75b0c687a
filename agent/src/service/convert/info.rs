//! `Agent.GetInfo`'s answer: what the agent reports about itself (name, version, fabric and
//! devices, limits, uptime, what it holds).
use xfer_proto::v1 as pb;

use super::scalars::{duration_to_pb, fabric_to_pb};
use crate::node::Node;
use xfer_fabric::{DeviceInfo, GidInfo};

/// The node's facts, with the process's locked-memory limit `memlock` (soft, hard) and whether
/// it holds CAP_IPC_LOCK.
pub fn agent_info_to_pb(n: &Node, memlock: (u64, u64), cap_ipc_lock: bool) -> pb::AgentInfo {
    let info = n.fabric_info();
    let (regions, registered) = n.region_totals();
    pb::AgentInfo {
        node_name: n.node_name().to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        fabric: fabric_to_pb(info.kind) as i32,
        fabric_reason: n.fabric_reason().to_string(),
        devices: info.devices.iter().map(device_to_pb).collect(),
        limits: Some(pb::Limits {
            memlock_soft: memlock.0,
            memlock_hard: memlock.1,
            cap_ipc_lock,
            max_regions: n.limits().max_regions as u32,
            max_registered_bytes: n.limits().max_registered_bytes.0,
            max_transfers: n.limits().max_transfers as u32,
        }),
        uptime: Some(duration_to_pb(n.uptime())),
        data_address: info.data_address.map(|a| a.to_string()).unwrap_or_default(),
        regions: regions as u32,
        registered_bytes: registered,
        fallback: n.fallback().to_string(),
    }
}

fn device_to_pb(d: &DeviceInfo) -> pb::DeviceInfo {
    pb::DeviceInfo {
        name: d.name.clone(),
        port: d.port,
        state: d.state.clone(),
        link_layer: d.link_layer.clone(),
        active_mtu: d.active_mtu,
        lid: d.lid,
        gids: d.gids.iter().map(gid_to_pb).collect(),
        selected_gid_index: d.selected_gid_index.map(|i| i as i32).unwrap_or(-1),
        // Node numbers beyond i32 do not exist; one that did would read as unknown, not wrap.
        numa_node: d.numa_node,
        pci_address: d.pci_address.clone().unwrap_or_default(),
        speed_mbps: d.speed_mbps.unwrap_or(0),
        netdev: d.netdev.clone().unwrap_or_default(),
        ipv4_prefix: d.ipv4_prefix.map_or(0, u32::from),
    }
}

fn gid_to_pb(g: &GidInfo) -> pb::Gid {
    pb::Gid { index: g.index, raw: g.raw.to_vec(), r#type: g.gid_type.clone(), netdev: g.netdev.clone() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_placement_crosses_the_boundary_with_unknowns_as_the_schema_says() {
        let known = DeviceInfo {
            name: "mlx5_1".into(),
            port: 1,
            numa_node: Some(1),
            pci_address: Some("0000:af:00.0".into()),
            speed_mbps: Some(200_000),
            netdev: Some("ens1np0".into()),
            ipv4_prefix: Some(24),
            selected_gid_index: Some(3),
            ..Default::default()
        };
        let pb = device_to_pb(&known);
        assert_eq!((pb.numa_node, pb.pci_address.as_str(), pb.speed_mbps), (Some(1), "0000:af:00.0", 200_000));
        assert_eq!((pb.netdev.as_str(), pb.ipv4_prefix, pb.selected_gid_index), ("ens1np0", 24, 3));
        let pb = device_to_pb(&DeviceInfo { name: "rxe0".into(), ..Default::default() });
        assert_eq!((pb.numa_node, pb.pci_address.as_str(), pb.speed_mbps), (None, "", 0));
        assert_eq!((pb.netdev.as_str(), pb.ipv4_prefix, pb.selected_gid_index), ("", 0, -1));
    }
}
