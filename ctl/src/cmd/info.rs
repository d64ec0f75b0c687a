//! `xferctl info`: the agent's `GetInfo`.

use anyhow::Context;
use clap::Args;
use xfer_client::AgentInfo;

use crate::units::format_bytes;
use crate::view::{self, gid_text, human_duration, limit_bytes};
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {}

pub async fn run(_opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let client = ctx.client().await?;
    let info = client.info().await.context("GetInfo")?;
    if ctx.json {
        ctx.print_json(&view::info_json(&info))
    } else {
        ctx.print(&render(&info, &ctx.agent))
    }
}

/// The human view of `GetInfo`.
pub fn render(info: &AgentInfo, addr: &str) -> String {
    let mut out = String::new();
    let mut kv = |k: &str, v: String| out.push_str(&format!("{k:<17} {v}\n"));
    kv("agent:", addr.to_string());
    kv("node:", info.node_name.clone());
    kv("version:", info.version.clone());
    let reason = if info.fabric_reason.is_empty() { String::new() } else { format!(" ({})", info.fabric_reason) };
    kv("fabric:", format!("{}{reason}", info.fabric));
    if !info.data_address.is_empty() {
        kv("data address:", info.data_address.clone());
    }
    kv("uptime:", info.uptime.map(human_duration).unwrap_or_else(|| "-".into()));
    kv("regions:", format!("{} ({} registered)", info.regions, format_bytes(info.registered_bytes)));
    if let Some(l) = &info.limits {
        kv("memlock:", format!("soft {} / hard {}", limit_bytes(l.memlock_soft), limit_bytes(l.memlock_hard)));
        kv("CAP_IPC_LOCK:", if l.cap_ipc_lock { "yes" } else { "no" }.into());
        let max = |v: u64| {
            if v == 0 {
                "-".to_string()
            } else {
                v.to_string()
            }
        };
        kv(
            "limits:",
            format!(
                "max regions {}, max registered {}, max transfers {}",
                max(u64::from(l.max_regions)),
                if l.max_registered_bytes == 0 { "-".to_string() } else { format_bytes(l.max_registered_bytes) },
                max(u64::from(l.max_transfers)),
            ),
        );
    }
    if info.devices.is_empty() {
        out.push_str("devices:          none\n");
    } else {
        out.push_str("devices:\n");
    }
    for d in &info.devices {
        out.push_str(&format!(
            "  {} port {}: {} {} MTU {} LID {} selected GID {}\n",
            d.name,
            d.port,
            d.state,
            d.link_layer,
            d.active_mtu,
            d.lid,
            d.selected_gid_index.map_or_else(|| "none".to_string(), |i| i.to_string())
        ));
        for g in &d.gids {
            let mark = if d.selected_gid_index == Some(g.index) { '*' } else { ' ' };
            out.push_str(&format!("   {mark}gid[{}] {:<7} {:<10} {}\n", g.index, g.kind, g.netdev, gid_text(&g.raw)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use xfer_client::{Device, Fabric, Gid, Limits};

    #[test]
    fn renders_fabric_reason_limits_and_selected_gid() {
        let mut raw = vec![0u8; 16];
        raw[10] = 0xff;
        raw[11] = 0xff;
        raw[12..].copy_from_slice(&[10, 0, 0, 1]);
        let info = AgentInfo {
            node_name: "n1".into(),
            version: "0.1.0".into(),
            fabric: Fabric::Tcp,
            fabric_reason: "no RDMA devices".into(),
            limits: Some(Limits { memlock_soft: u64::MAX, memlock_hard: u64::MAX, cap_ipc_lock: true, ..Default::default() }),
            uptime: Some(std::time::Duration::from_secs(3723)),
            devices: vec![Device {
                name: "rxe0".into(),
                port: 1,
                state: "ACTIVE".into(),
                link_layer: "Ethernet".into(),
                active_mtu: 1024,
                selected_gid_index: Some(1),
                gids: vec![
                    Gid {
                        index: 0,
                        raw: vec![0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
                        kind: "RoCEv1".into(),
                        netdev: "eth0".into(),
                    },
                    Gid { index: 1, raw, kind: "RoCEv2".into(), netdev: "eth0".into() },
                ],
                ..Default::default()
            }],
            ..Default::default()
        };
        let text = render(&info, "h:7470");
        assert!(text.contains("fabric:           tcp (no RDMA devices)"), "{text}");
        assert!(text.contains("soft unlimited / hard unlimited"), "{text}");
        assert!(text.contains("uptime:           1h 2m 3s"), "{text}");
        assert!(text.contains("rxe0 port 1: ACTIVE Ethernet MTU 1024"), "{text}");
        assert!(text.contains("   gid[0] RoCEv1  eth0       fe80::1"), "{text}");
        assert!(text.contains("  *gid[1] RoCEv2  eth0       ::ffff:10.0.0.1 (10.0.0.1)"), "{text}");
    }
}
