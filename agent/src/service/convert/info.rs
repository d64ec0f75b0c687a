//! `Agent.GetInfo`'s answer: what the agent reports about itself (name, version, fabric and
//! devices, limits, uptime, what it holds).
use xfer_proto::v1 as pb;

use super::scalars::{duration_to_pb, fabric_to_pb};
use crate::fabric::{DeviceInfo, GidInfo};
use crate::node::Node;

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
    }
}

fn gid_to_pb(g: &GidInfo) -> pb::Gid {
    pb::Gid { index: g.index, raw: g.raw.to_vec(), r#type: g.gid_type.clone(), netdev: g.netdev.clone() }
}
