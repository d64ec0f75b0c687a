//! `xferctl info`: the agent's `GetInfo`.

use anyhow::Context;
use clap::Args;
use xfer_proto::v1::{AgentInfo, GetInfoRequest};

use crate::units::format_bytes;
use crate::view::{self, duration, fabric_name, gid_text, human_duration, limit_bytes};
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {}

pub async fn run(_opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let mut client = ctx.client().await?;
    let info = client
        .get_info(GetInfoRequest {})
        .await
        .context("GetInfo")?
        .into_inner();
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
    let reason = if info.fabric_reason.is_empty() {
        String::new()
    } else {
        format!(" ({})", info.fabric_reason)
    };
    kv("fabric:", format!("{}{reason}", fabric_name(info.fabric)));
    if !info.data_address.is_empty() {
        kv("data address:", info.data_address.clone());
    }
    kv(
        "uptime:",
        duration(&info.uptime)
            .map(human_duration)
            .unwrap_or_else(|| "-".into()),
    );
    kv(
        "regions:",
        format!(
            "{} ({} registered)",
            info.regions,
            format_bytes(info.registered_bytes)
        ),
    );
    if let Some(l) = &info.limits {
        kv(
            "memlock:",
            format!(
                "soft {} / hard {}",
                limit_bytes(l.memlock_soft),
                limit_bytes(l.memlock_hard)
            ),
        );
        kv(
            "CAP_IPC_LOCK:",
            if l.cap_ipc_lock { "yes" } else { "no" }.into(),
        );
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
                if l.max_registered_bytes == 0 {
                    "-".to_string()
                } else {
                    format_bytes(l.max_registered_bytes)
                },
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
            if d.selected_gid_index < 0 {
                "none".to_string()
            } else {
                d.selected_gid_index.to_string()
            }
        ));
        for g in &d.gids {
            let mark = if i64::from(g.index) == i64::from(d.selected_gid_index) {
                '*'
            } else {
                ' '
            };
            out.push_str(&format!(
                "   {mark}gid[{}] {:<7} {:<10} {}\n",
                g.index,
                g.r#type,
                g.netdev,
                gid_text(&g.raw)
            ));
        }
    }
    out
}
