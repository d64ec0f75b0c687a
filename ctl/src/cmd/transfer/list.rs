//! `xferctl transfer list`.

use anyhow::Context;
use clap::Args;

use crate::view;
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {}

pub async fn run(_opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let client = ctx.client().await?;
    let transfers = client.transfers().await.context("listing transfers")?;
    if ctx.json {
        ctx.print_json(&serde_json::Value::Array(transfers.iter().map(view::transfer_json).collect()))
    } else {
        ctx.print(&view::transfer_table(&transfers))
    }
}
