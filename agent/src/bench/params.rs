//! What a benchmark is asked ([`BenchParams`]) and what it reports ([`BenchResult`]), and the
//! statistics over its samples.
use std::time::Duration;

use crate::transfer::{Op, TransferOptions};

#[derive(Debug, Clone)]
pub struct BenchParams {
    pub peer: String,
    pub op: Op,
    pub size: u64,
    pub iters: u32,
    pub qps: usize,
    pub depth: usize,
    /// KV pattern: blocks of `size` per batch (0 = the perftest-style message benchmark).
    pub blocks: u32,
    /// KV pattern: pool bytes on each side (0 = 4 x blocks x size).
    pub pool: u64,
    /// KV pattern over a channel: the list prepared once and posted `iters` times.
    pub channel: bool,
    /// Connection setup: fresh connections to negotiate and hold (0 = another pattern).
    pub connections: u32,
    /// Connection setup: how long to keep them all once the last is up (at most
    /// [`BENCH_MAX_HOLD`]).
    pub hold: Duration,
    /// Connection setup: untimed wait before each connection after the first (at most
    /// [`BENCH_MAX_INTERVAL`]); zero = back to back.
    pub interval: Duration,
    /// The bandwidth and latency phases once per path of one connection (`xferctl doctor`).
    pub per_path: bool,
    /// Message benchmark: WRs of the latency phase (`None`: as many as the bandwidth phase's, up
    /// to 10,000; 0: no latency phase).
    pub lat_iters: Option<u32>,
}

impl BenchParams {
    /// The transfer options the asked shape gives (0 QPs or depth: the agent's defaults).
    pub fn transfer_options(&self) -> TransferOptions {
        TransferOptions { qps: (self.qps > 0).then_some(self.qps), depth: (self.depth > 0).then_some(self.depth), ..Default::default() }
    }
}

#[derive(Debug, Clone, Default)]
pub struct BenchResult {
    pub size: u64,
    pub iters: u32,
    pub bytes: u64,
    pub seconds: f64,
    pub lat_avg_us: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub lat_iters: u32,
    pub blocks: u32,
    pub submit_p50_us: f64,
    pub prep_ns_per_segment: f64,
    pub channel: bool,
    pub repost_ns_per_segment: f64,
    pub channel_open_us: f64,
    pub connections: u32,
    pub qps_held: u32,
    pub rss_bytes_per_qp: f64,
    /// Connection setup: p50 of a `Peer.Ping` round trip to the same peer, same run.
    pub rpc_p50_us: f64,
    /// Per path ([`BenchParams::per_path`]): what each path of the connection did, in QP order.
    pub paths: Vec<PathProbe>,
}

/// One path's share of a per-path benchmark.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PathProbe {
    /// Empty on tcp.
    pub local_device: String,
    /// As the peer names it; empty on tcp.
    pub remote_device: String,
    /// The path MTU the path's QPs negotiated, in bytes; 0 on tcp.
    pub mtu: u32,
    /// The bandwidth phase on this path alone.
    pub bytes: u64,
    pub seconds: f64,
    /// The latency phase on the path's first QP.
    pub lat_p50_us: f64,
    /// Why the path failed a phase; `None` when both succeeded on it.
    pub error: Option<String>,
}

/// Longest the connection benchmark keeps its connections once they are all up.
pub const BENCH_MAX_HOLD: Duration = Duration::from_secs(60);

/// Longest pause the connection benchmark takes between two connections.
pub const BENCH_MAX_INTERVAL: Duration = Duration::from_secs(1);

/// A KV run's result: `iters` batches of `blocks` blocks of `block` bytes that took `busy` in
/// all; `batch_us` per batch, `submit_us` per submit (or post to first work request), and the
/// list's cost per segment.
pub(super) fn kv_result(
    block: u64,
    blocks: u64,
    iters: u32,
    busy: Duration,
    mut batch_us: Vec<f64>,
    mut submit_us: Vec<f64>,
    prep_ns: f64,
) -> BenchResult {
    let avg = batch_us.iter().sum::<f64>() / batch_us.len().max(1) as f64;
    batch_us.sort_by(|a, b| a.total_cmp(b));
    submit_us.sort_by(|a, b| a.total_cmp(b));
    BenchResult {
        size: block,
        iters,
        bytes: block * blocks * iters as u64,
        seconds: busy.as_secs_f64(),
        lat_avg_us: avg,
        lat_p50_us: percentile(&batch_us, 0.5),
        lat_p99_us: percentile(&batch_us, 0.99),
        lat_iters: batch_us.len() as u32,
        blocks: blocks as u32,
        submit_p50_us: percentile(&submit_us, 0.5),
        prep_ns_per_segment: prep_ns,
        ..Default::default()
    }
}

/// The `q` quantile of `sorted` (0 when empty).
pub(super) fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted.get(((sorted.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0)
}
