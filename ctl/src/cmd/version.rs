//! `xferctl version`: this client's version and, unless `--client`, the agent's (its
//! `GetInfo.version` and node name) — the pair to compare when something misbehaves.

use anyhow::Context;
use clap::Args;
use serde_json::json;

use crate::Ctx;

/// This build of xferctl.
pub const CLIENT_VERSION: &str = env!("CARGO_PKG_VERSION");

#[derive(Debug, Args)]
pub struct Opt {
    /// Print only the client's version; do not contact the agent.
    #[arg(long)]
    pub client: bool,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let agent = if opt.client {
        None
    } else {
        // An unreachable agent is an error (exit 8, UNAVAILABLE) after the client's version is printed.
        let got = async {
            let client = ctx.client().await?;
            let info = client.info().await.context("GetInfo")?;
            anyhow::Ok(info)
        }
        .await;
        match got {
            Ok(info) => Some(info),
            Err(e) => {
                if !ctx.json {
                    ctx.print(&format!("client: xferctl {CLIENT_VERSION}\n"))?;
                }
                return Err(e);
            }
        }
    };
    if ctx.json {
        let agent = agent.map(|i| json!({"version": i.version, "node_name": i.node_name, "address": ctx.agent}));
        ctx.print_json(&json!({"client": {"version": CLIENT_VERSION}, "agent": agent}))
    } else {
        let mut out = format!("client: xferctl {CLIENT_VERSION}\n");
        if let Some(i) = agent {
            out.push_str(&format!("agent:  xfer-agent {} (node {}, {})\n", i.version, i.node_name, ctx.agent));
        }
        ctx.print(&out)
    }
}
