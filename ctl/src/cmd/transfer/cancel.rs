//! `xferctl transfer cancel ID`.

use clap::Args;
use xfer_proto::v1::TransferState;

use crate::progress;
use crate::view;
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {
    /// Transfer id.
    pub id: String,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let mut client = ctx.client().await?;
    // The cancel's answer is the record at that instant (still RUNNING): follow it until it has
    // stopped, and report that.
    let t = progress::cancel_and_wait(&mut client, &opt.id).await?;
    if ctx.json {
        ctx.print_json(&view::transfer_json(&t))
    } else {
        let state = view::state_name(t.state);
        let what = if t.state == TransferState::Cancelled as i32 { "cancelled".to_string() } else { format!("had already {state}") };
        ctx.print(&format!("transfer {}: {what} ({} of {} bytes done)\n", t.id, t.bytes_done, t.length))
    }
}
