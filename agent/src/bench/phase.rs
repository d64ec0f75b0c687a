//! What the message benchmark's phases share, whole-connection ([`super::data`]) or per path
//! ([`super::per_path`]): the grant they ask for, the local buffer, the bandwidth phase's
//! segments, the WR template and the latency statistics.
use std::sync::Arc;
use std::time::Duration;

use super::params::{percentile, BenchParams};
use crate::error::NodeError;
use crate::node::Node;
use crate::peer_api::{GrantAsk, GrantInfo};
use crate::transfer::job::WrTemplate;
use crate::transfer::Op;
use xfer_engine::batch::Seg;
use xfer_fabric::{Registration, RemoteOp, WrOp};
use xfer_rdma::memory::RegionMemory;

/// The grant a phase asks for: the whole scratch region, for the benchmark's operation.
pub(super) fn grant_ask<'a>(scratch: &'a str, p: &BenchParams) -> GrantAsk<'a> {
    GrantAsk {
        region: scratch,
        offset: 0,
        length: p.size,
        op: if p.op == Op::Write { RemoteOp::Write } else { RemoteOp::Read },
        ttl: Duration::from_secs(3600),
        notify: None,
        channel: false,
    }
}

pub(super) fn wr_op(p: &BenchParams) -> WrOp {
    if p.op == Op::Write {
        WrOp::Write
    } else {
        WrOp::Read
    }
}

/// Bytes a bandwidth phase keeps in flight per QP when its depth is not asked for (the agent's
/// default depth of 1 MiB chunks keeps 16 MiB).
const BENCH_IN_FLIGHT: u64 = 1 << 20;
/// Most WRs per QP a bandwidth phase posts by default (perftest's default send queue depth).
const BENCH_MAX_DEFAULT_DEPTH: usize = 128;

/// QPs and depth asked for, or the agent's defaults, within the bounds transfers keep. A
/// bandwidth phase of small messages with no depth asked for keeps at least
/// [`BENCH_IN_FLIGHT`] per QP (up to [`BENCH_MAX_DEFAULT_DEPTH`] WRs, as perftest does): at the
/// default depth a window of 16 x 4 KiB measured how fast completions round-trip, not the
/// fabric's bandwidth against a raw stream that has megabytes in flight.
pub(super) fn shape(node: &Node, p: &BenchParams) -> Result<(usize, usize), NodeError> {
    let qps = xfer_engine::shape::or_default(p.qps, node.transfer_defaults().qps, xfer_engine::shape::qps)?;
    let default = node.transfer_defaults().depth;
    let filling = usize::try_from(BENCH_IN_FLIGHT.div_ceil(p.size.max(1))).unwrap_or(usize::MAX).min(BENCH_MAX_DEFAULT_DEPTH);
    let depth = xfer_engine::shape::or_default(p.depth, default.max(filling), xfer_engine::shape::depth)?;
    Ok((qps, depth))
}

/// The local buffer of `size` bytes, registered; mapped and pinned (up to 256 MiB) on the
/// blocking pool.
pub(super) async fn bench_buffer(node: &Arc<Node>, size: u64) -> Result<Arc<dyn Registration>, NodeError> {
    let len = usize::try_from(size).map_err(|_| NodeError::Invalid("size too large".into()))?;
    let n = Arc::clone(node);
    tokio::task::spawn_blocking(move || {
        let mem = Arc::new(RegionMemory::anonymous(len, false).map_err(|e| NodeError::Internal(e.to_string()))?);
        crate::regions::fill_bench(&mem);
        n.register(mem, xfer_fabric::Access::ReadWrite).map_err(|e| NodeError::Internal(e.to_string()))
    })
    .await
    .map_err(|e| NodeError::Internal(e.to_string()))?
}

/// The bandwidth phase's WR length and segments: `iters` messages of `size`, one WR per
/// message, except that READs longer than `verbs.max_read_wr` are split as a transfer's are
/// (each message its own segment, cut into WRs of that length).
pub(super) fn bandwidth_segs(node: &Node, p: &BenchParams, iters: u32) -> (u64, Arc<[Seg]>) {
    let piece = node.wr_chunk(wr_op(p) == WrOp::Read, p.size);
    let segs: Arc<[Seg]> = if piece < p.size {
        (0..iters).map(|_| Seg { local: 0, remote: 0, len: p.size }).collect()
    } else {
        Arc::from([Seg { local: 0, remote: 0, len: p.size * iters as u64 }])
    };
    (piece, segs)
}

/// A latency phase's samples in microseconds: mean, median, 99th percentile and count.
pub(super) struct Latency {
    pub avg_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub n: u32,
}

impl Latency {
    pub fn of(samples: &[Duration]) -> Latency {
        let mut us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        us.sort_by(|a, b| a.total_cmp(b));
        Latency {
            avg_us: us.iter().sum::<f64>() / us.len().max(1) as f64,
            p50_us: percentile(&us, 0.5),
            p99_us: percentile(&us, 0.99),
            n: u32::try_from(us.len()).unwrap_or(u32::MAX),
        }
    }
}

/// The WR template of a benchmark whose messages are `size` bytes: every message reuses the
/// same buffer on both sides, so offsets are taken within a message. (The latency phase's
/// machine signals every WR: one WR per run.)
pub(super) fn bench_wr(op: WrOp, local: Arc<dyn Registration>, size: u64, grant: GrantInfo) -> WrTemplate {
    WrTemplate { op, notify_slot: 0, local, remote_addr: grant.addr, remote_key: grant.key, wrap: Some(size) }
}
