//! `xferctl peers`: the agent's peer connections (`ListPeers`).

use anyhow::Context;
use clap::Args;

use crate::view;
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {}

pub async fn run(_opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let client = ctx.client().await?;
    let peers = client.peers().await.context("ListPeers")?;
    if ctx.json {
        ctx.print_json(&serde_json::Value::Array(peers.iter().map(view::peer_json).collect()))
    } else {
        ctx.print(&view::peer_table(&peers))
    }
}
