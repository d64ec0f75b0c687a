//! The perftest-style benchmark: bandwidth (`iters` messages, `depth` WRs outstanding per QP)
//! and latency (one WR at a time on one QP) over a grant on the peer's scratch region, each
//! phase a job on the data-path driver; with `per_path`, the phases run once per path instead
//! ([`per_path`]). The pieces both share are here.
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::params::{percentile, BenchParams, BenchResult};
use super::per_path;
use crate::error::NodeError;
use crate::node::Node;
use crate::peer_api::{GrantAsk, GrantInfo};
use crate::peers::PeerEntry;
use crate::transfer::job::{qp_map, Job, LatencyProbe, WrTemplate};
use crate::transfer::Op;
use xfer_engine::batch::Seg;
use xfer_engine::machine::{Machine, MachineConfig, Markers, State};
use xfer_fabric::{Registration, RemoteOp, WrOp};
use xfer_rdma::memory::RegionMemory;

/// perftest-style messages: `iters` WRITEs (or READs) of `p.size` bytes for bandwidth, then one
/// at a time for latency. Its buffer counts against `limits.max_bench_bytes` here and the
/// target's scratch region against the target's.
pub(super) async fn run(node: &Arc<Node>, p: BenchParams) -> Result<BenchResult, NodeError> {
    xfer_engine::shape::bench_size(p.size)?;
    let _admin = node.admin_slot("Bench")?;
    let _memory = node.reserve_bench(p.size, "the benchmark buffer")?;
    let iters = if p.iters == 0 { 100 } else { p.iters.min(1_000_000) };
    let peer = node.peer_entry(&p.peer).await?;
    let scratch = peer.call(|| peer.client.open_bench_region(p.size)).await?;
    let res =
        if p.per_path { per_path::phases(node, &peer, &scratch, &p, iters).await } else { phases(node, &peer, &scratch, &p, iters).await };
    if let Err(e) = peer.client.close_bench_region(&scratch).await {
        warn!(error = %e, region = %scratch, "could not delete bench scratch region on peer (its lease ends it)");
    }
    res
}

/// The bandwidth phase, then the latency phase, each on its own connection and grant.
async fn phases(node: &Arc<Node>, peer: &Arc<PeerEntry>, scratch: &str, p: &BenchParams, iters: u32) -> Result<BenchResult, NodeError> {
    let ask = grant_ask(scratch, p);
    let local = bench_buffer(node, p.size).await?;
    let cancel = CancellationToken::new();
    let op = wr_op(p);
    let (qps, depth) = shape(node, p)?;

    // Bandwidth: each phase has its own connection, and so its own grant (mw grants are bound
    // to a connection); both are RAII guards in `held`, given back when it drops.
    let (piece, segs) = bandwidth_segs(node, p, iters);
    let mut held = node.acquire_exempt(peer, &ask, qps, depth).await?;
    let (lease, grant) = held.take_parts()?;
    let machine = Machine::new(MachineConfig {
        segs,
        markers: Markers::None,
        chunk: piece,
        qps: lease.qps(),
        depth,
        signal_every: node.transfer_defaults().signal_every,
        deadline: Some(Instant::now() + Duration::from_secs(600)),
        path_of: qp_map(&lease.conn().paths(), lease.qps()),
        weights: Vec::new(),
    });
    let (buf, size) = (local.clone(), p.size);
    let wr = bench_wr(op, buf, size, grant);
    let t0 = Instant::now();
    let done = node.run_job(Job { machine, lease, wr, probe: None, cancel: cancel.clone(), progress: None }).await?;
    let seconds = t0.elapsed().as_secs_f64();
    let bw_state = done.machine.state().clone();
    done.lease.release(bw_state == State::Succeeded);
    drop(held);
    if let State::Failed(f) = bw_state {
        return Err(NodeError::Internal(format!("bench bandwidth phase failed: {f:?}")));
    }

    // Latency: one WR at a time on one QP.
    let lat_iters = iters.clamp(1, 10_000);
    let mut held = node.acquire_exempt(peer, &ask, 1, 1).await?;
    let (lease, grant) = held.take_parts()?;
    let machine = Machine::new(MachineConfig {
        segs: Arc::from([Seg { local: 0, remote: 0, len: p.size * lat_iters as u64 }]),
        markers: Markers::None,
        chunk: p.size,
        qps: 1,
        depth: 1,
        signal_every: 1,
        deadline: Some(Instant::now() + Duration::from_secs(600)),
        path_of: Arc::from([]),
        weights: Vec::new(),
    });
    let size = p.size;
    let wr = bench_wr(op, local, size, grant);
    let probe = Some(LatencyProbe::default());
    let done = node.run_job(Job { machine, lease, wr, probe, cancel, progress: None }).await?;
    let lat_ok = done.machine.state() == &State::Succeeded;
    done.lease.release(lat_ok);
    drop(held);
    if !lat_ok {
        return Err(NodeError::Internal(format!("bench latency phase failed: {:?}", done.machine.state())));
    }
    let samples = done.probe.map(|p| p.samples).unwrap_or_default();
    let lat = Latency::of(&samples);
    Ok(BenchResult {
        size: p.size,
        iters,
        bytes: p.size * iters as u64,
        seconds,
        lat_avg_us: lat.avg_us,
        lat_p50_us: lat.p50_us,
        lat_p99_us: lat.p99_us,
        lat_iters: lat.n,
        ..Default::default()
    })
}

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

/// QPs and depth asked for, or the agent's defaults, within the bounds transfers keep.
pub(super) fn shape(node: &Node, p: &BenchParams) -> Result<(usize, usize), NodeError> {
    let qps = xfer_engine::shape::or_default(p.qps, node.transfer_defaults().qps, xfer_engine::shape::qps)?;
    let depth = xfer_engine::shape::or_default(p.depth, node.transfer_defaults().depth, xfer_engine::shape::depth)?;
    Ok((qps, depth))
}

/// The local buffer of `size` bytes, registered; mapped and pinned (up to 256 MiB) on the
/// blocking pool.
pub(super) async fn bench_buffer(node: &Arc<Node>, size: u64) -> Result<Arc<dyn Registration>, NodeError> {
    let len = usize::try_from(size).map_err(|_| NodeError::Invalid("size too large".into()))?;
    let n = Arc::clone(node);
    tokio::task::spawn_blocking(move || {
        let mem = Arc::new(RegionMemory::anonymous(len, false).map_err(|e| NodeError::Internal(e.to_string()))?);
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
