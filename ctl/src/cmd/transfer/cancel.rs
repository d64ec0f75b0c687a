//! `xferctl transfer cancel ID`.

use anyhow::Context;
use clap::Args;
use xfer_proto::v1::CancelTransferRequest;

use crate::view;
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {
    /// Transfer id.
    pub id: String,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let mut client = ctx.client().await?;
    let t = client
        .cancel_transfer(CancelTransferRequest { id: opt.id.clone() })
        .await
        .with_context(|| format!("cancelling transfer {}", opt.id))?
        .into_inner();
    if ctx.json {
        ctx.print_json(&view::transfer_json(&t))
    } else {
        ctx.print(&format!(
            "transfer {}: {} ({} of {} bytes done)\n",
            t.id,
            view::state_name(t.state),
            t.bytes_done,
            t.length
        ))
    }
}
