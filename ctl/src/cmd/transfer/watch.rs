//! `xferctl transfer watch ID`: follow a transfer to its end. Exits like `cp` does (10 FAILED,
//! 11 CANCELLED). On a terminal a progress bar shows it move; into a pipe or a log (stdout not a
//! terminal, no `--json`) every change the agent reports is a line, as it happens.

use std::io::IsTerminal;
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
    let lines = !ctx.json && !std::io::stdout().is_terminal();
    let mut last: Option<(xfer_client::State, u64)> = None;
    let t = progress::watch_each(&client, &opt.id, true, |t| {
        if lines && last != Some((t.state, t.bytes_done)) {
            last = Some((t.state, t.bytes_done));
            ctx.print(&progress::change_line(t))?;
        }
        Ok(())
    })
    .await?;
    if ctx.json {
        ctx.print_json(&view::transfer_json(&t))?;
    }
    progress::outcome(&t, false)?;
    if !ctx.json {
        ctx.print(&format!("{}\n", progress::copied_line(&t, started)))?;
    }
    Ok(())
}
