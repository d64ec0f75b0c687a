//! `xferctl region show NAME`.

use anyhow::Context;
use clap::Args;

use crate::view;
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {
    /// Region name.
    pub name: String,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let client = ctx.client().await?;
    let region = client.region(&opt.name).await.with_context(|| format!("getting region {:?}", opt.name))?;
    if ctx.json {
        ctx.print_json(&view::region_json(&region))
    } else {
        ctx.print(&view::region_detail(&region))
    }
}
