//! `xferctl transfer cancel ID`.

use clap::Args;
use xfer_client::State;

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
    // The cancel's answer is the record at that instant (still RUNNING): follow it until it has
    // stopped, and report that.
    let t = progress::cancel_and_wait(&client, &opt.id).await?;
    if ctx.json {
        ctx.print_json(&view::transfer_json(&t))
    } else {
        let what = if t.state == State::Cancelled { "cancelled".to_string() } else { format!("had already {}", t.state) };
        ctx.print(&format!("transfer {}: {what} ({} of {} bytes done)\n", t.id, t.bytes_done, t.length))
    }
}
