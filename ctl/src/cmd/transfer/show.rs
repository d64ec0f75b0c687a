//! `xferctl transfer show ID`.

use anyhow::Context;
use clap::Args;
use xfer_proto::v1::GetTransferRequest;

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
        .get_transfer(GetTransferRequest { id: opt.id.clone() })
        .await
        .with_context(|| format!("getting transfer {}", opt.id))?
        .into_inner();
    if ctx.json {
        ctx.print_json(&view::transfer_json(&t))
    } else {
        ctx.print(&view::transfer_detail(&t))
    }
}
