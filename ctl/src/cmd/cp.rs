//! `xferctl cp SRC DST`: copy a range between regions with a one-sided transfer.
//!
//! Each side is `[AGENT:]REGION[@OFFSET]`; a side without an agent is on `--agent`. By default the
//! agent holding SRC initiates an `OP_WRITE` (local = SRC, remote = DST); with `--pull` the agent
//! holding DST initiates an `OP_READ` (local = DST, remote = SRC). The remote agent address is
//! passed as the user wrote it: it must be reachable from the initiating agent.
//!
//! `--segments FILE` (`-` = stdin) makes it one batch: every listed segment (see
//! [`crate::segments`]) moves in one transfer with one state and one progress count.
//! `--notify TAG` has the destination... the *target* agent tell its `WatchInbound` subscribers
//! (`xferctl watch-inbound`) once every byte has landed.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use xfer_client::{Op, Options, Segment, Transfer, TransferSpec};

use crate::client::Client;
use crate::progress;
use crate::target::{parse_location, Location};
use crate::units::{parse_duration, parse_size};
use crate::view;
use crate::Ctx;

#[derive(Debug, Args)]
pub struct Opt {
    /// Source: [AGENT:]REGION[@OFFSET].
    #[arg(value_parser = parse_location, value_name = "SRC")]
    pub src: Location,
    /// Destination: [AGENT:]REGION[@OFFSET].
    #[arg(value_parser = parse_location, value_name = "DST")]
    pub dst: Location,
    /// Bytes to copy (default: the rest of SRC). 0 is sent as 0, which the agent refuses
    /// (INVALID_ARGUMENT): a zero-length copy is a mistake, never "everything".
    #[arg(long, value_parser = parse_size)]
    pub len: Option<u64>,
    /// Compare end-to-end checksums of source and destination before reporting success.
    #[arg(long)]
    pub verify: bool,
    /// Chunk size per work request (default: agent's).
    #[arg(long, value_parser = parse_size)]
    pub chunk: Option<u64>,
    /// Outstanding work requests per QP (default: agent's).
    #[arg(long)]
    pub depth: Option<u32>,
    /// QPs / data connections to stripe over (default: agent's).
    #[arg(long)]
    pub qps: Option<u32>,
    /// Let the DST agent pull with OP_READ instead of SRC pushing with OP_WRITE.
    #[arg(long)]
    pub pull: bool,
    /// Fail the transfer if it takes longer than this (e.g. 30s, 5m).
    #[arg(long, value_parser = parse_duration)]
    pub timeout: Option<Duration>,
    /// Print the transfer id and return without waiting for the transfer to finish.
    #[arg(long)]
    pub no_wait: bool,
    /// On Ctrl-C, stop following the transfer and leave it running (prints its id). Without
    /// it, Ctrl-C cancels the transfer, waits for it to stop and says so (exit 11).
    #[arg(long)]
    pub detach: bool,
    /// Move a list of segments as one batch: a file (`-` = stdin) with one `SRC_OFF DST_OFF LEN`
    /// per line, or `SRC_OFF DST_OFF LEN xCOUNT [SRC_STRIDE [DST_STRIDE]]` for strided blocks.
    /// Offsets are relative to SRC's and DST's @OFFSET.
    #[arg(long, value_name = "FILE", conflicts_with = "len")]
    pub segments: Option<std::path::PathBuf>,
    /// Notify the target agent's `WatchInbound` subscribers with this tag once every byte has
    /// landed (see `xferctl watch-inbound`).
    #[arg(long, value_name = "TAG")]
    pub notify: Option<String>,
}

/// A batch and its notification, for [`plan`].
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub segments: Vec<crate::segments::Seg>,
    pub notify: Option<Vec<u8>>,
}

/// Transfer tuning shared by `cp` and `demo`.
#[derive(Debug, Clone, Default)]
pub struct Tuning {
    pub chunk: Option<u64>,
    pub depth: Option<u32>,
    pub qps: Option<u32>,
    pub verify: bool,
    pub timeout: Option<Duration>,
}

/// Who initiates a copy and with what request.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The agent that receives `SubmitTransfer`.
    pub initiator: String,
    pub spec: TransferSpec,
}

/// Builds the transfer for copying `src` to `dst` (`default_agent` fills missing agents).
pub fn plan(
    src: &Location,
    dst: &Location,
    default_agent: &str,
    len: Option<u64>,
    pull: bool,
    tuning: &Tuning,
    batch: &Batch,
) -> anyhow::Result<Plan> {
    let src_agent = src.agent_or(default_agent).to_string();
    let dst_agent = dst.agent_or(default_agent).to_string();
    let options =
        Options { chunk_size: tuning.chunk, qps: tuning.qps, depth: tuning.depth, verify: tuning.verify, timeout: tuning.timeout };
    let (initiator, op, local, remote, remote_agent) =
        if pull { (dst_agent, Op::Read, dst, src, src_agent) } else { (src_agent, Op::Write, src, dst, dst_agent) };
    // Segment offsets are relative to each side's @OFFSET; the request then carries none.
    let shift = |base: u64, off: u64| base.checked_add(off).context("a segment offset overflows");
    let segments = batch
        .segments
        .iter()
        .map(|s| {
            let (l, r) = if pull { (s.dst, s.src) } else { (s.src, s.dst) };
            Ok(Segment { local: shift(local.offset, l)?, remote: shift(remote.offset, r)?, len: s.len })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let (local_off, remote_off) = if segments.is_empty() { (local.offset, remote.offset) } else { (0, 0) };
    let mut spec =
        TransferSpec::new(op, &local.region, &remote_agent, &remote.region).at(local_off, remote_off).segments(segments).options(options);
    spec.length = len;
    spec.notify = batch.notify.clone();
    Ok(Plan { initiator, spec })
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let tuning = Tuning { chunk: opt.chunk, depth: opt.depth, qps: opt.qps, verify: opt.verify, timeout: opt.timeout };
    let segments = match &opt.segments {
        None => Vec::new(),
        Some(path) => {
            let text = if path.as_os_str() == "-" {
                crate::segments::read_text(std::io::stdin())
            } else {
                let f = std::fs::File::open(path).with_context(|| format!("reading the segment list {}", path.display()))?;
                crate::segments::read_text(f)
            }
            .map_err(|e| crate::error::usage(format!("--segments {}: {e}", path.display())))?;
            crate::segments::parse(&text).map_err(|e| crate::error::usage(format!("--segments {}: {e}", path.display())))?
        }
    };
    let batch = Batch { segments, notify: opt.notify.map(String::into_bytes) };
    let plan = plan(&opt.src, &opt.dst, &ctx.agent, opt.len, opt.pull, &tuning, &batch)?;
    let client = ctx.connect(&plan.initiator).await?;
    // Registered before the submit, so a Ctrl-C at any moment after it is ours (a handler first
    // installed when the wait starts would leave a window where Ctrl-C kills xferctl outright).
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).context("handling Ctrl-C")?;
    let started = Instant::now();
    let t = submit(&client, &plan).await?;
    if opt.no_wait {
        return if ctx.json { ctx.print_json(&view::transfer_json(&t)) } else { ctx.print(&format!("{}\n", t.id)) };
    }
    let id = t.id.clone();
    let t = tokio::select! {
        t = progress::watch(&client, &id, true) => t?,
        _ = interrupt.recv() => {
            if opt.detach {
                eprintln!("detached: transfer {id} keeps running (follow it with `xferctl transfer watch {id}`)");
                return if ctx.json { ctx.print_json(&serde_json::json!({"id": id, "detached": true})) } else { ctx.print(&format!("{id}\n")) };
            }
            // Like scp or rclone: an interrupted copy is stopped, and the user is told.
            eprintln!("interrupted: cancelling transfer {id}");
            // The watch future is dropped before this handler runs, so its client is free again.
            progress::cancel_and_wait(&client, &id).await?
        }
    };
    if ctx.json {
        ctx.print_json(&view::transfer_json(&t))?;
    }
    progress::outcome(&t, opt.verify)?;
    if !ctx.json {
        ctx.print(&format!("{}\n", progress::copied_line(&t, started)))?;
    }
    Ok(())
}

/// Submits the planned transfer on the initiating agent.
pub async fn submit(client: &Client, plan: &Plan) -> anyhow::Result<Transfer> {
    client.submit(plan.spec.clone()).await.with_context(|| format!("submitting {} transfer to {}", plan.spec.op, plan.initiator))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(s: &str) -> Location {
        parse_location(s).unwrap()
    }

    #[test]
    fn push_is_write_from_src_agent() {
        let p = plan(&loc("a:1:src@4KiB"), &loc("b:dst"), "d:9", Some(100), false, &Tuning::default(), &Batch::default()).unwrap();
        assert_eq!(p.initiator, "a:1");
        assert_eq!(p.spec.op, Op::Write);
        assert_eq!((p.spec.local_region.as_str(), p.spec.local_offset), ("src", 4096));
        assert_eq!(p.spec.peer, "b:7470");
        assert_eq!(p.spec.remote_region, "dst");
        assert_eq!(p.spec.length, Some(100));
    }

    #[test]
    fn pull_is_read_from_dst_agent() {
        let p = plan(&loc("src@1"), &loc("b:dst@2"), "d:9", None, true, &Tuning::default(), &Batch::default()).unwrap();
        assert_eq!(p.initiator, "b:7470");
        assert_eq!(p.spec.op, Op::Read);
        assert_eq!((p.spec.local_region.as_str(), p.spec.local_offset), ("dst", 2));
        assert_eq!((p.spec.peer.as_str(), p.spec.remote_region.as_str(), p.spec.remote_offset), ("d:9", "src", 1));
    }

    #[test]
    fn defaults_and_options() {
        let tuning = Tuning { chunk: Some(1 << 20), depth: Some(8), qps: Some(2), verify: true, timeout: Some(Duration::from_secs(30)) };
        let p = plan(&loc("s"), &loc("t"), "d:9", None, false, &tuning, &Batch::default()).unwrap();
        assert_eq!(p.initiator, "d:9");
        assert_eq!(p.spec.peer, "d:9");
        let o = &p.spec.options;
        assert_eq!((o.chunk_size, o.depth, o.qps, o.verify), (Some(1 << 20), Some(8), Some(2), true));
        assert_eq!(o.timeout, Some(Duration::from_secs(30)));
    }
}
