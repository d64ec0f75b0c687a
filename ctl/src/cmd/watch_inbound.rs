//! `xferctl watch-inbound [REGION] [--tag TAG] [--count N]`: print the notifications of batches
//! other agents move into (or read out of) this agent's regions (`Agent.WatchInbound`), one line
//! (or one JSON object) each, as they are published — that is, once every byte of the batch is
//! visible in the region. Live only: start it before the batch can land. `--count N` exits after
//! N notifications (scripts use it to wait for one).

use anyhow::Context;
use clap::Args;

use crate::view;
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {
    /// Only this region (name or id); default every region.
    pub region: Option<String>,
    /// Only notifications with exactly this tag.
    #[arg(long)]
    pub tag: Option<String>,
    /// Exit after this many notifications.
    #[arg(long)]
    pub count: Option<u64>,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let client = ctx.client().await?;
    let mut stream = client
        .watch_inbound(opt.region.as_deref(), opt.tag.as_deref().map(str::as_bytes))
        .await
        .context("watching inbound notifications")?;
    // The subscription is in place once the call answered: say so on stderr, so a script (or a
    // test) can start the batch only then.
    eprintln!("watching {} for notifications", opt.region.as_deref().unwrap_or("every region"));
    let mut seen = 0u64;
    while opt.count.is_none_or(|c| seen < c) {
        let Some(n) = stream.try_next().await.context("receiving notifications")? else {
            break;
        };
        seen += 1;
        if ctx.json {
            // One compact object per line: a stream of JSON lines.
            ctx.print(&format!("{}\n", view::notification_json(&n)))?;
        } else {
            ctx.print(&view::notification_line(&n))?;
        }
    }
    Ok(())
}
