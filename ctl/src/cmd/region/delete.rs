//! `xferctl region delete NAME`.

use anyhow::Context;
use clap::Args;

use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {
    /// Region name.
    pub name: String,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let client = ctx.client().await?;
    client.delete_region(&opt.name).await.with_context(|| format!("deleting region {:?}", opt.name))?;
    if ctx.json {
        ctx.print_json(&serde_json::json!({"deleted": opt.name}))
    } else {
        ctx.print(&format!("deleted region {}\n", opt.name))
    }
}
