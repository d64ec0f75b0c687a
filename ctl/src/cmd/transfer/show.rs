//! `xferctl transfer show ID`.

use anyhow::Context;
use clap::Args;

use crate::view;
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {
    /// Transfer id.
    pub id: String,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let client = ctx.client().await?;
    let t = client.get_transfer(&opt.id).await.with_context(|| format!("getting transfer {}", opt.id))?;
    if ctx.json {
        ctx.print_json(&view::transfer_json(&t))
    } else {
        ctx.print(&view::transfer_detail(&t))
    }
}
