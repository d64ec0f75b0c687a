//! `xferctl region list [--selector k=v]...`.

use anyhow::Context;
use clap::Args;

use super::parse_label;
use crate::view;
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {
    /// Only regions with this label (repeatable; all must match).
    #[arg(long = "selector", short = 'l', value_parser = parse_label, value_name = "K=V")]
    pub selector: Vec<(String, String)>,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let client = ctx.client().await?;
    let mut regions = client.regions_matching(&opt.selector.into_iter().collect()).await.context("listing regions")?;
    regions.sort_by(|a, b| a.name.cmp(&b.name));
    if ctx.json {
        ctx.print_json(&serde_json::Value::Array(regions.iter().map(view::region_json).collect()))
    } else {
        ctx.print(&view::region_table(&regions))
    }
}
