//! `xferctl peers`: the agent's peer connections (`ListPeers`).

use anyhow::Context;
use clap::Args;
use xfer_proto::v1::ListPeersRequest;

use crate::view;
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {}

pub async fn run(_opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let mut client = ctx.client().await?;
    let peers = client
        .list_peers(ListPeersRequest {})
        .await
        .context("ListPeers")?
        .into_inner()
        .peers;
    if ctx.json {
        ctx.print_json(&serde_json::Value::Array(
            peers.iter().map(view::peer_json).collect(),
        ))
    } else {
        ctx.print(&view::peer_table(&peers))
    }
}
