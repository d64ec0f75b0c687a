//! `xferctl transfer watch ID`: follow a transfer to its end. Exits like `cp` does (10 FAILED,
//! 11 CANCELLED).

use std::time::Instant;

use clap::Args;

use crate::progress;
use crate::view;
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {
    /// Transfer id.
    pub id: String,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let client = ctx.client().await?;
    let started = Instant::now();
    let t = progress::watch(&client, &opt.id, true).await?;
    if ctx.json {
        ctx.print_json(&view::transfer_json(&t))?;
    }
    progress::outcome(&t, false)?;
    if !ctx.json {
        ctx.print(&format!("{}\n", progress::copied_line(&t, started)))?;
    }
    Ok(())
}
