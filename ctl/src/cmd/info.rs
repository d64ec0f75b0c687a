//! `xferctl info`: the agent's `GetInfo`.

use anyhow::Context;
use clap::Args;
use xfer_client::AgentInfo;

use crate::units::format_bytes;
use crate::view::{self, device_placement, device_table, gid_text, human_duration, limit_bytes};
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
    if !info.fallback.is_empty() {
        kv("fallback:", info.fallback.clone());
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
    if info.devices.len() > 1 {
        // Several devices read best side by side; their GID tables would bury the table.
        for line in device_table(&info.devices).lines() {
            out.push_str(&format!("  {line}\n"));
        }
        out.push_str("  (GID tables: xferctl --json info)\n");
        return out;
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
        out.push_str(&format!("    {}\n", device_placement(d)));
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
        // A software device: no node, no PCI function, no rate known.
        assert!(
            text.contains("rxe0 port 1: ACTIVE Ethernet MTU 1024 LID 0 selected GID 1\n    speed -, NUMA node -, PCI -, netdev -"),
            "{text}"
        );
    }

    fn nic(i: u32, state: &str) -> Device {
        let mut raw = vec![0u8; 16];
        raw[10] = 0xff;
        raw[11] = 0xff;
        raw[12..].copy_from_slice(&[10, i as u8, 0, 1]);
        Device {
            name: format!("mlx5_{i}"),
            port: 1,
            state: state.into(),
            link_layer: "Ethernet".into(),
            active_mtu: 4096,
            selected_gid_index: Some(3),
            gids: vec![Gid { index: 3, raw, kind: "RoCEv2".into(), netdev: format!("ens{i}np0") }],
            numa_node: Some(i / 4),
            pci_address: Some(format!("0000:{:02x}:00.0", 0x10 + i)),
            speed_mbps: Some(200_000),
            netdev: Some(format!("ens{i}np0")),
            ipv4_prefix: Some(24),
            ..Default::default()
        }
    }

    #[test]
    fn one_nic_shows_where_it_sits_under_its_port_line() {
        let info = AgentInfo { fabric: Fabric::Verbs, devices: vec![nic(5, "ACTIVE")], ..Default::default() };
        let text = render(&info, "h:7470");
        assert!(
            text.contains(
                "  mlx5_5 port 1: ACTIVE Ethernet MTU 4096 LID 0 selected GID 3\n    \
                 speed 200 Gb/s, NUMA node 1, PCI 0000:15:00.0, netdev ens5np0 (10.5.0.1/24)\n   *gid[3]"
            ),
            "{text}"
        );
    }

    #[test]
    fn several_devices_make_a_table() {
        let mut devices: Vec<Device> = (0..8).map(|i| nic(i, if i == 6 { "DOWN" } else { "ACTIVE" })).collect();
        devices.push(Device { name: "rxe0".into(), port: 1, state: "ACTIVE".into(), link_layer: "Ethernet".into(), ..Default::default() });
        let info = AgentInfo { fabric: Fabric::Verbs, devices, ..Default::default() };
        let text = render(&info, "h:7470");
        let lines: Vec<&str> = text.lines().skip_while(|l| *l != "devices:").collect();
        assert_eq!(lines.len(), 1 + 1 + 9 + 1, "{text}");
        assert_eq!(lines[1], "  DEVICE  PORT  STATE   LINK      MTU   SPEED     NUMA  PCI           NETDEV   GID");
        assert_eq!(lines[2], "  mlx5_0  1     ACTIVE  Ethernet  4096  200 Gb/s  0     0000:10:00.0  ens0np0  3 10.0.0.1/24");
        assert_eq!(lines[8], "  mlx5_6  1     DOWN    Ethernet  4096  200 Gb/s  1     0000:16:00.0  ens6np0  3 10.6.0.1/24");
        assert_eq!(lines[10], "  rxe0    1     ACTIVE  Ethernet  0     -         -     -             -        none");
        assert!(!text.contains("gid["), "no GID tables in the table view: {text}");
    }

    #[test]
    fn speeds_read_as_people_write_them() {
        use crate::view::speed_text;
        assert_eq!(speed_text(Some(200_000)), "200 Gb/s");
        assert_eq!(speed_text(Some(2_500)), "2.5 Gb/s");
        assert_eq!(speed_text(Some(14_062)), "14.062 Gb/s");
        assert_eq!(speed_text(Some(100)), "100 Mb/s");
        assert_eq!(speed_text(None), "-");
    }

    #[test]
    fn json_carries_placement_with_null_for_unknown() {
        let info =
            AgentInfo { devices: vec![nic(1, "ACTIVE"), Device { name: "rxe0".into(), ..Default::default() }], ..Default::default() };
        let v = view::info_json(&info);
        let d = &v["devices"][0];
        assert_eq!(
            (d["numa_node"].as_u64(), d["pci_address"].as_str(), d["speed_mbps"].as_str()),
            (Some(0), Some("0000:11:00.0"), Some("200000"))
        );
        assert_eq!((d["netdev"].as_str(), d["ipv4_prefix"].as_u64()), (Some("ens1np0"), Some(24)));
        let rxe = &v["devices"][1];
        for k in ["numa_node", "pci_address", "speed_mbps", "netdev", "ipv4_prefix"] {
            assert!(rxe[k].is_null(), "{k}: {rxe}");
        }
    }
}
