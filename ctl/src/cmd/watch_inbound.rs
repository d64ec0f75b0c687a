//! `xferctl watch-inbound [REGION] [--tag TAG] [--count N]`: print the notifications of batches
//! other agents move into (or read out of) this agent's regions (`Agent.WatchInbound`), one line
//! (or one JSON object) each, as they are published — that is, once every byte of the batch is
//! visible in the region. Live only: start it before the batch can land. `--count N` exits after
//! N notifications (scripts use it to wait for one). `--ring` receives them through a
//! shared-memory ring instead of the stream (`Agent.WatchInboundRing`; xferctl must then run on
//! the agent's host, as a user that may open its shm objects).

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
    /// Receive through a shared-memory ring (WatchInboundRing) rather than the gRPC stream.
    #[arg(long)]
    pub ring: bool,
}

/// Where notifications come from.
enum Source {
    Stream(xfer_client::Inbound),
    Ring(xfer_client::InboundRing),
}

impl Source {
    async fn next(&mut self) -> anyhow::Result<Option<xfer_client::Notification>> {
        match self {
            Source::Stream(s) => s.try_next().await.context("receiving notifications"),
            Source::Ring(r) => match r.next().await {
                Ok(n) => Ok(Some(n)),
                // The agent closed the ring (it shuts down): the end, as for the stream.
                Err(xfer_client::Error::Unavailable(_)) => Ok(None),
                Err(e) => Err(anyhow::Error::new(e).context("reading the notification ring")),
            },
        }
    }
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let client = ctx.client().await?;
    let (region, tag) = (opt.region.as_deref(), opt.tag.as_deref().map(str::as_bytes));
    let mut stream = if opt.ring {
        Source::Ring(client.watch_inbound_ring(region, tag, 0).await.context("opening a notification ring")?)
    } else {
        Source::Stream(client.watch_inbound(region, tag).await.context("watching inbound notifications")?)
    };
    // The subscription is in place once the call answered: say so on stderr, so a script (or a
    // test) can start the batch only then.
    eprintln!("watching {} for notifications", opt.region.as_deref().unwrap_or("every region"));
    let mut seen = 0u64;
    while opt.count.is_none_or(|c| seen < c) {
        let Some(n) = stream.next().await? else {
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
