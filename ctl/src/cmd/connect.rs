//! `xferctl connect PEER`: pre-connect the agent to a peer agent.

use anyhow::Context;
use clap::Args;

use crate::target::normalize_agent;
use crate::view;
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {
    /// Peer agent address: host, host:port or [v6]:port.
    #[arg(value_parser = normalize_agent)]
    pub peer: String,
    /// QPs (verbs) or data connections (tcp) to open; 0 = agent default.
    #[arg(long, default_value_t = 0)]
    pub qps: u32,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let client = ctx.client().await?;
    let peer = client.connect_peer(&opt.peer, opt.qps).await.with_context(|| format!("connecting {} to {}", ctx.agent, opt.peer))?;
    if ctx.json {
        ctx.print_json(&view::peer_json(&peer))
    } else {
        ctx.print(&view::peer_table(std::slice::from_ref(&peer)))
    }
}
