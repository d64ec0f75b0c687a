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
use serde_json::{json, Value};
use xfer_client::{BenchResult, BenchSpec, Op, TcpBaseline, TcpBaselineSpec};

use crate::target::normalize_agent;
use crate::units::{format_size_compact, gbit_per_s, parse_size};
use crate::view::Table;
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

/// A baseline's median run and which baseline it is.
type Base<'a> = Option<(&'a TcpBaseline, Baseline)>;

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
}

/// Bytes the TCP baseline streams per run: at least 1 GiB, and 16× the largest message size.
/// Short runs on a shared 2-core machine were seen to vary by ±30 %.
pub fn baseline_bytes(sizes: &[u64]) -> u64 {
    let largest = sizes.iter().copied().max().unwrap_or(0);
    largest.saturating_mul(16).max(1 << 30)
}

/// The baseline is measured this many times, interleaved with the sizes (before, between,
/// after), and the median run is reported, so a noisy moment skews neither side alone.
const BASELINE_RUNS: usize = 3;

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

/// Bandwidth in Gb/s, from the agent's figure or recomputed from bytes and seconds.
fn row_gbit(r: &BenchResult) -> f64 {
    if r.gbit_per_s > 0.0 {
        r.gbit_per_s
    } else {
        gbit_per_s(r.bytes, r.seconds)
    }
}

/// A table whose rows are the `lead` cells, the bandwidth (Gb/s and GiB/s), the `tail` cells
/// and, with a baseline, the bandwidth as a ratio of it (`BW/tcp` or `BW/tls`; `-` when the
/// baseline is 0).
fn bandwidth_table(
    lead: &[&str],
    tail: &[&str],
    rows: &[BenchResult],
    baseline: Base<'_>,
    cells: impl Fn(&BenchResult) -> (Vec<String>, Vec<String>),
) -> String {
    let mut header: Vec<&str> = lead.to_vec();
    header.extend(["BW Gb/s", "BW GiB/s"]);
    header.extend(tail);
    let base = baseline.map(|(b, _)| b.gbit_per_s).filter(|g| *g > 0.0);
    let label = baseline.map(|(_, kind)| format!("BW/{}", kind.name()));
    if let Some(label) = &label {
        header.push(label);
    }
    let mut t = Table::new(&header);
    for r in rows {
        let gbit = row_gbit(r);
        let (mut row, after) = cells(r);
        row.push(format!("{gbit:.2}"));
        row.push(format!("{:.3}", gbit * 1e9 / 8.0 / (1u64 << 30) as f64));
        row.extend(after);
        if baseline.is_some() {
            row.push(base.map(|b| format!("{:.2}", gbit / b)).unwrap_or_else(|| "-".into()));
        }
        t.row(row);
    }
    t.render()
}

/// The perftest-style table.
pub fn render(rows: &[BenchResult], baseline: Base<'_>) -> String {
    let mut out = bandwidth_table(&["#bytes", "iters"], &["lat avg us", "lat p50 us", "lat p99 us"], rows, baseline, |r| {
        (
            vec![r.size.to_string(), r.iters.to_string()],
            vec![format!("{:.2}", r.lat_avg_us), format!("{:.2}", r.lat_p50_us), format!("{:.2}", r.lat_p99_us)],
        )
    });
    if let Some((b, kind)) = baseline {
        out.push_str(&format!(
            "# {} baseline (median of {BASELINE_RUNS} runs): {} bytes in {:.3} s = {:.2} Gb/s\n",
            kind.name(),
            b.bytes,
            b.seconds,
            b.gbit_per_s
        ));
    }
    out
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

/// The KV-pattern table: one row per run.
pub fn render_kv(rows: &[BenchResult], baseline: Base<'_>) -> String {
    let channel = rows.iter().any(|r| r.channel);
    let mut tail = vec!["batch p50 ms", "batch p99 ms", "submit p50 us", "prep ns/seg"];
    if channel {
        tail.extend(["repost ns/seg", "open ms"]);
    }
    bandwidth_table(&["pattern", "batches"], &tail, rows, baseline, |r| {
        let mut after = vec![
            format!("{:.2}", r.lat_p50_us / 1e3),
            format!("{:.2}", r.lat_p99_us / 1e3),
            format!("{:.0}", r.submit_p50_us),
            format!("{:.0}", r.prep_ns_per_segment),
        ];
        if channel {
            after.extend([format!("{:.1}", r.repost_ns_per_segment), format!("{:.2}", r.channel_open_us / 1e3)]);
        }
        let name = if r.channel { "kv channel" } else { "kv" };
        (vec![format!("{name} {}x{}", r.blocks, format_size_compact(r.size)), r.iters.to_string()], after)
    })
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    let kv = opt.pattern == Pattern::Kv;
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
    let mut base_runs = Vec::new();
    // Baseline runs go before the first size, in the middle and after the last.
    let base_at: Vec<usize> = match opt.baseline {
        Some(_) => vec![0, opt.sizes.len() / 2, opt.sizes.len()],
        None => Vec::new(),
    };
    let mut rows = Vec::new();
    for (i, &size) in opt.sizes.iter().chain(std::iter::once(&0)).enumerate() {
        for _ in base_at.iter().filter(|&&k| k == i).take(BASELINE_RUNS) {
            let kind = if baseline_req.tls { "TLS" } else { "TCP" };
            base_runs.push(client.tcp_baseline(&baseline_req).await.with_context(|| format!("{kind} baseline to {}", opt.peer))?);
        }
        if i == opt.sizes.len() {
            break;
        }
        let r = client
            .bench(&BenchSpec {
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
            })
            .await
            .with_context(|| format!("bench {} of {} with {}", op, format_size_compact(size), opt.peer))?;
        rows.push(r);
    }
    let median = median_run(base_runs);
    let baseline = median.as_ref().zip(opt.baseline);
    if ctx.json {
        ctx.print_json(&json_doc(&ctx.agent, &opt.peer, op, &rows, baseline))
    } else {
        let fabric = rows.first().map(|r| r.fabric.to_string()).unwrap_or_default();
        let header = format!("# {} {} -> {} over {fabric}\n", op, ctx.agent, opt.peer);
        let table = if kv { render_kv(&rows, baseline) } else { render(&rows, baseline) };
        ctx.print(&(header + &table))
    }
}

fn json_doc(agent: &str, peer: &str, op: Op, rows: &[BenchResult], baseline: Base<'_>) -> Value {
    let base = baseline.map(|(b, _)| b.gbit_per_s).filter(|g| *g > 0.0);
    json!({
        "agent": agent,
        "peer": peer,
        "op": op.to_string(),
        "rows": rows.iter().map(|r| {
            let gbit = row_gbit(r);
            json!({
                "size": r.size,
                "iters": r.iters,
                "bytes": r.bytes,
                "seconds": r.seconds,
                "gbit_per_s": gbit,
                "gib_per_s": gbit * 1e9 / 8.0 / (1u64 << 30) as f64,
                "lat_avg_us": r.lat_avg_us,
                "lat_p50_us": r.lat_p50_us,
                "lat_p99_us": r.lat_p99_us,
                "lat_iters": r.lat_iters,
                "fabric": r.fabric.to_string(),
                "ratio_to_baseline": base.map(|b| gbit / b),
                "pattern": if r.blocks > 0 { "kv" } else { "messages" },
                "blocks": r.blocks,
                "submit_p50_us": r.submit_p50_us,
                "prep_ns_per_segment": r.prep_ns_per_segment,
                "channel": r.channel,
                "repost_ns_per_segment": r.repost_ns_per_segment,
                "channel_open_us": r.channel_open_us,
            })
        }).collect::<Vec<_>>(),
        "baseline": baseline.map(|(b, kind)| json!({
            "kind": kind.name(),
            "bytes": b.bytes,
            "seconds": b.seconds,
            "gbit_per_s": b.gbit_per_s,
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baseline_size() {
        assert_eq!(baseline_bytes(&[4096]), 1 << 30);
        assert_eq!(baseline_bytes(&[4096, 128 << 20]), 2 << 30);
        assert_eq!(baseline_bytes(&[]), 1 << 30);
        assert_eq!(baseline_bytes(&[u64::MAX]), u64::MAX);
    }

    #[test]
    fn table_with_ratio() {
        let rows = [BenchResult {
            size: 1 << 20,
            iters: 100,
            bytes: 100 << 20,
            seconds: 1.0,
            gbit_per_s: 0.0, // recomputed from bytes/seconds
            lat_avg_us: 10.0,
            lat_p50_us: 9.5,
            lat_p99_us: 20.0,
            ..Default::default()
        }];
        let base = TcpBaseline { bytes: 1, seconds: 1.0, gbit_per_s: 0.8388608 };
        let text = render(&rows, Some((&base, Baseline::Tcp)));
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().unwrap().split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
        assert_eq!(header, ["#bytes", "iters", "BW Gb/s", "BW GiB/s", "lat avg us", "lat p50 us", "lat p99 us", "BW/tcp"]);
        let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        // 100 MiB in 1 s = 0.8388608 Gb/s = 0.098 GiB/s; ratio 1.00.
        assert_eq!(row, ["1048576", "100", "0.84", "0.098", "10.00", "9.50", "20.00", "1.00"]);
        assert!(text.contains("# tcp baseline"));
        let doc = json_doc("a", "b", Op::Write, &rows, Some((&base, Baseline::Tcp)));
        assert_eq!(doc["rows"][0]["size"], 1 << 20);
        assert!((doc["rows"][0]["ratio_to_baseline"].as_f64().unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(doc["baseline"]["kind"], "tcp");
    }
}
