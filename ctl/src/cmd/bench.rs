//! `xferctl bench --peer B`: data-path bandwidth and latency between two agents across message
//! sizes (`Agent.Bench` runs inside the agent), optionally against a raw TCP baseline
//! (`Agent.TcpBaseline`). `--pattern kv --block SIZE --blocks N` instead runs KV-cache-shaped
//! batches through the product path: N blocks scattered over a pool on each side, one
//! notification per batch, and reports bandwidth, per-batch latency, the submit call and what
//! checking the segment list costs per segment. `--channel` runs the same batches over one channel
//! (`Agent.OpenChannel`): the list prepared once and posted again for every batch, and reports
//! what opening the channel and re-posting the list cost.

use anyhow::Context;
use clap::{Args, ValueEnum};
use serde_json::json;
use xfer_client::{BenchSpec, Op, TcpBaseline, TcpBaselineSpec};

use super::bench_report::{json_doc, render, render_kv, row_gbit, Ratio, BASELINE_RUNS};
use crate::target::normalize_agent;
use crate::units::{format_size_compact, gbit_per_s, parse_size};
use crate::Ctx;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum OpArg {
    Write,
    Read,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Pattern {
    /// One message size at a time, perftest-style.
    Messages,
    /// Batches of scattered blocks with a notification each (SubmitTransfer with segments).
    Kv,
    /// Connection setup: `--connections` fresh connections of `--qps` QPs, each timed and all
    /// held at once (memory per QP).
    Connect,
    /// Notification delay as the target's application sees it: `--iters` batches of `--blocks`
    /// blocks of `--block` bytes into a shared-memory pool on `--peer` that xferctl maps (run
    /// it on the peer's node); from the last byte visible to the notification received.
    Notify,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Baseline {
    /// Raw TCP throughput between the two hosts.
    Tcp,
    /// Raw TLS throughput between the two hosts: rustls streams with the agents' data-plane
    /// certificates and cipher suites, as many as the fabric's (both agents need mTLS).
    Tls,
    /// Raw TCP whose two ends walk buffers as large as the memory the fabric moves (a KV batch's
    /// blocks, or the largest message) instead of one small hot buffer each: as many bytes
    /// leaving from and landing in memory no cache holds as the fabric's.
    TcpPool,
    /// Raw TCP moving a KV batch's blocks as the fabric does, without its protocol: both ends
    /// move buffers of a batch's size in pieces of the block size at random places, in gathered
    /// system calls (plaintext; `--pattern kv` only).
    TcpScatter,
}

impl Baseline {
    fn name(self) -> &'static str {
        match self {
            Baseline::Tcp => "tcp",
            Baseline::Tls => "tls",
            Baseline::TcpPool => "tcp-pool",
            Baseline::TcpScatter => "tcp-scatter",
        }
    }
}

#[derive(Debug, Args)]
pub struct Opt {
    /// Peer agent to benchmark against (host, host:port or [v6]:port).
    #[arg(long, value_parser = normalize_agent)]
    pub peer: String,
    #[arg(long, value_enum, default_value = "write")]
    pub op: OpArg,
    /// Message sizes, comma separated.
    #[arg(
        long,
        value_parser = parse_size,
        value_delimiter = ',',
        default_value = "4KiB,64KiB,1MiB,16MiB"
    )]
    pub sizes: Vec<u64>,
    /// Work requests per size in the bandwidth phase (default: agent's).
    #[arg(long)]
    pub iters: Option<u32>,
    /// QPs / data connections (default: agent's).
    #[arg(long)]
    pub qps: Option<u32>,
    /// Outstanding work requests per QP (default: agent's).
    #[arg(long)]
    pub depth: Option<u32>,
    /// Also measure a baseline and print each size's bandwidth as a ratio of it.
    #[arg(long, value_enum)]
    pub baseline: Option<Baseline>,
    /// With `--baseline`: measure each size (or KV row) this many times, each round the
    /// baseline and then the fabric, and report the median of the rounds' ratios and their
    /// range (on a noisy host one run of either side moves a ratio by a fifth). 1: one fabric
    /// run per size against the median of three baseline runs spread over the sizes.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=15))]
    pub rounds: u32,
    /// `kv`: batches of `--blocks` blocks of `--block` bytes scattered over `--pool`.
    #[arg(long, value_enum, default_value = "messages")]
    pub pattern: Pattern,
    /// KV and notify patterns: bytes per block (default 64KiB; notify: 4KiB).
    #[arg(long, value_parser = parse_size)]
    pub block: Option<u64>,
    /// KV and notify patterns: blocks per batch (default 2048; notify: 16).
    #[arg(long)]
    pub blocks: Option<u32>,
    /// KV pattern: pool bytes on each side (default 4 x blocks x block).
    #[arg(long, value_parser = parse_size)]
    pub pool: Option<u64>,
    /// KV pattern over one channel: the list prepared once, then posted for every batch.
    #[arg(long)]
    pub channel: bool,
    /// Notify pattern: how the application receives its notifications (`ring`: a shared-memory
    /// ring it polls; `stream`: the WatchInbound stream).
    #[arg(long, value_enum, default_value = "ring")]
    pub notify_via: super::bench_notify::NotifyVia,
    /// Connect pattern: keep the connections this long once all are up (at most 60s), so several
    /// initiators' runs hold theirs at the same time.
    #[arg(long, value_parser = crate::units::parse_duration)]
    pub hold: Option<std::time::Duration>,
    /// Connect pattern: wait this long before each connection after the first, untimed (at
    /// most 1s), so each starts on idle agents (latency at low load; default back to back).
    #[arg(long, value_parser = crate::units::parse_duration)]
    pub interval: Option<std::time::Duration>,
    /// Connect pattern: connections to negotiate and hold (at most 256).
    #[arg(long, default_value_t = 100)]
    pub connections: u32,
    /// Messages pattern: WRs of the latency phase, one at a time (at most 10000; default: as
    /// many as the bandwidth phase's, up to 10000). 0 skips the latency phase, so the agents'
    /// CPU time over the run is the bandwidth phase's.
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=10_000))]
    pub latency_iters: Option<u32>,
}

/// Bytes the TCP baseline streams per run: at least 1 GiB, and 16× the largest message size.
/// Short runs on a shared 2-core machine were seen to vary by ±30 %.
pub fn baseline_bytes(sizes: &[u64]) -> u64 {
    let largest = sizes.iter().copied().max().unwrap_or(0);
    largest.saturating_mul(16).max(1 << 30)
}

fn median_run(mut runs: Vec<TcpBaseline>) -> Option<TcpBaseline> {
    runs.sort_by(|a, b| gbit(a).total_cmp(&gbit(b)));
    let mid = runs.len() / 2;
    runs.into_iter().nth(mid)
}

fn gbit(b: &TcpBaseline) -> f64 {
    if b.gbit_per_s > 0.0 {
        b.gbit_per_s
    } else {
        gbit_per_s(b.bytes, b.seconds)
    }
}

/// `--pattern connect`: one run, a table or JSON.
async fn run_connect(opt: &Opt, ctx: &Ctx) -> anyhow::Result<()> {
    if opt.connections == 0 {
        return Err(crate::error::usage("--connections must be greater than zero"));
    }
    let client = ctx.client().await?;
    let r = client
        .bench(&BenchSpec {
            peer: opt.peer.clone(),
            qps: opt.qps.unwrap_or(0),
            depth: opt.depth.unwrap_or(0),
            connections: opt.connections,
            hold_ms: opt.hold.map_or(0, |h| u32::try_from(h.as_millis()).unwrap_or(u32::MAX)),
            interval_ms: opt.interval.map_or(0, |h| u32::try_from(h.as_millis()).unwrap_or(u32::MAX)),
            ..Default::default()
        })
        .await
        .with_context(|| format!("bench connect to {}", opt.peer))?;
    if ctx.json {
        return ctx.print_json(&json!({
            "agent": ctx.agent,
            "peer": opt.peer,
            "pattern": "connect",
            "connections": r.connections,
            "qps_held": r.qps_held,
            "seconds": r.seconds,
            "connect_avg_us": r.lat_avg_us,
            "connect_p50_us": r.lat_p50_us,
            "connect_p99_us": r.lat_p99_us,
            "rss_bytes_per_qp": r.rss_bytes_per_qp,
            "rpc_p50_us": r.rpc_p50_us,
            "fabric": r.fabric.to_string(),
        }));
    }
    ctx.print(&format!(
        "# connect {} -> {} over {}
{} connections, {} QPs held at once: connect p50 {:.2} ms, p99 {:.2} ms, avg {:.2} ms; \
         {:.1} KiB resident per QP on this agent\n\
         baseline, same peer and run: a Peer.Ping round trip p50 {:.3} ms; connect p50 = {:.1} x that\n",
        ctx.agent,
        opt.peer,
        r.fabric,
        r.connections,
        r.qps_held,
        r.lat_p50_us / 1e3,
        r.lat_p99_us / 1e3,
        r.lat_avg_us / 1e3,
        r.rss_bytes_per_qp / 1024.0,
        r.rpc_p50_us / 1e3,
        r.lat_p50_us / r.rpc_p50_us.max(f64::MIN_POSITIVE)
    ))
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let kv = opt.pattern == Pattern::Kv;
    if opt.latency_iters.is_some() && opt.pattern != Pattern::Messages {
        return Err(crate::error::usage("--latency-iters sets the latency phase of --pattern messages only"));
    }
    if opt.pattern == Pattern::Notify {
        let (block, blocks) = (opt.block.unwrap_or(4096), opt.blocks.unwrap_or(16));
        let run = super::bench_notify::run_notify(ctx, &opt.peer, block, blocks, opt.iters.unwrap_or(50), opt.notify_via).await?;
        return super::bench_notify::report(ctx, &opt.peer, block, blocks, &run);
    }
    if opt.pattern == Pattern::Connect {
        return run_connect(&opt, ctx).await;
    }
    let mut opt = opt;
    let (block, blocks) = (opt.block.unwrap_or(64 << 10), opt.blocks.unwrap_or(2048));
    if kv {
        if block == 0 || blocks == 0 {
            return Err(crate::error::usage("--block and --blocks must be greater than zero"));
        }
        opt.sizes = vec![block];
    } else if opt.channel {
        return Err(crate::error::usage("--channel runs the KV pattern: add --pattern kv"));
    } else if opt.baseline == Some(Baseline::TcpScatter) {
        return Err(crate::error::usage("--baseline tcp-scatter moves a KV batch's blocks: add --pattern kv"));
    }
    let opt = opt;
    if opt.sizes.is_empty() || opt.sizes.contains(&0) {
        anyhow::bail!("--sizes must list sizes greater than zero");
    }
    let client = ctx.client().await?;
    let op = match opt.op {
        OpArg::Write => Op::Write,
        OpArg::Read => Op::Read,
    };
    let baseline_req = TcpBaselineSpec {
        peer: opt.peer.clone(),
        bytes: baseline_bytes(&opt.sizes),
        connections: opt.qps.unwrap_or(1).max(1),
        tls: opt.baseline == Some(Baseline::Tls),
        // The memory the fabric moves per batch on each side: a KV batch's blocks (as many bytes
        // as the blocks scattered over the pool; a batch touches no more), or the largest message
        // buffer.
        pool: match opt.baseline {
            Some(Baseline::TcpPool | Baseline::TcpScatter) if kv => (blocks as u64).saturating_mul(block),
            Some(Baseline::TcpPool) => opt.sizes.iter().copied().max().unwrap_or(0),
            _ => 0,
        },
        scatter: if opt.baseline == Some(Baseline::TcpScatter) { block } else { 0 },
        // Write in blocks as large as the largest message (capped at 16 MiB), so the baseline
        // is not handicapped by smaller syscalls than the fabric makes.
        block: opt.sizes.iter().copied().max().unwrap_or(1 << 20).clamp(1 << 20, 16 << 20),
    };
    let spec_of = |size| BenchSpec {
        peer: opt.peer.clone(),
        op,
        size,
        iters: opt.iters.unwrap_or(0),
        qps: opt.qps.unwrap_or(0),
        depth: opt.depth.unwrap_or(0),
        blocks: if kv { blocks } else { 0 },
        pool: if kv { opt.pool.unwrap_or(0) } else { 0 },
        channel: kv && opt.channel,
        connections: 0,
        hold_ms: 0,
        interval_ms: 0,
        per_path: false,
        lat_iters: opt.latency_iters,
    };
    let kind = if baseline_req.tls { "TLS" } else { "TCP" };
    let base_run = || async { client.tcp_baseline(&baseline_req).await.with_context(|| format!("{kind} baseline to {}", opt.peer)) };
    let peer = opt.peer.as_str();
    let fabric_run = |size| {
        let spec = spec_of(size);
        let client = &client;
        async move { client.bench(&spec).await.with_context(|| format!("bench {op} of {} with {peer}", format_size_compact(size))) }
    };
    let mut base_runs = Vec::new();
    let mut rows = Vec::new();
    if opt.rounds > 1 {
        // Each round: the baseline, then the fabric; the row shows its median fabric run.
        for &size in &opt.sizes {
            let (mut runs, mut pairs) = (Vec::new(), Vec::new());
            for _ in 0..opt.rounds {
                let base = match opt.baseline {
                    Some(_) => {
                        let b = base_run().await?;
                        let g = gbit(&b);
                        base_runs.push(b);
                        g
                    }
                    None => 0.0,
                };
                let r = fabric_run(size).await?;
                pairs.push((row_gbit(&r), base));
                runs.push(r);
            }
            runs.sort_by(|a, b| row_gbit(a).total_cmp(&row_gbit(b)));
            let mid = runs.len() / 2;
            if let Some(r) = runs.into_iter().nth(mid) {
                rows.push((r, Ratio::of_rounds(&pairs)));
            }
        }
    } else {
        // Baseline runs go before the first size, in the middle and after the last.
        let base_at: Vec<usize> = match opt.baseline {
            Some(_) => vec![0, opt.sizes.len() / 2, opt.sizes.len()],
            None => Vec::new(),
        };
        let mut fabric = Vec::new();
        for (i, &size) in opt.sizes.iter().chain(std::iter::once(&0)).enumerate() {
            for _ in base_at.iter().filter(|&&k| k == i).take(BASELINE_RUNS) {
                base_runs.push(base_run().await?);
            }
            if i < opt.sizes.len() {
                fabric.push(fabric_run(size).await?);
            }
        }
        let base = median_run(base_runs.clone()).map_or(0.0, |b| gbit(&b));
        rows = fabric
            .into_iter()
            .map(|r| {
                let ratio = Ratio::single(&r, base);
                (r, ratio)
            })
            .collect();
    }
    let median = median_run(base_runs);
    let baseline = median.as_ref().zip(opt.baseline.map(Baseline::name));
    if ctx.json {
        ctx.print_json(&json_doc(&ctx.agent, &opt.peer, op, &rows, baseline))
    } else {
        let fabric = rows.first().map(|(r, _)| r.fabric.to_string()).unwrap_or_default();
        let header = format!("# {} {} -> {} over {fabric}\n", op, ctx.agent, opt.peer);
        let table = if kv { render_kv(&rows, baseline) } else { render(&rows, baseline) };
        ctx.print(&(header + &table))
    }
}

#[cfg(test)]
mod tests {
    use super::baseline_bytes;

    #[test]
    fn baseline_size() {
        assert_eq!(baseline_bytes(&[4096]), 1 << 30);
        assert_eq!(baseline_bytes(&[4096, 128 << 20]), 2 << 30);
        assert_eq!(baseline_bytes(&[]), 1 << 30);
        assert_eq!(baseline_bytes(&[u64::MAX]), u64::MAX);
    }
}
