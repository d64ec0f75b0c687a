//! The perftest-style benchmark: bandwidth (`iters` messages, `depth` WRs outstanding per QP)
//! and latency (one WR at a time on one QP) over a grant on the peer's scratch region, each
//! phase a job on the data-path driver.
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::params::{percentile, BenchParams, BenchResult};
use crate::error::NodeError;
use crate::node::Node;
use crate::peer_api::{GrantAsk, GrantInfo};
use crate::peers::PeerEntry;
use crate::transfer::job::{Job, LatencyProbe, WrTemplate};
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
    let res = phases(node, &peer, &scratch, &p, iters).await;
    if let Err(e) = peer.client.close_bench_region(&scratch).await {
        warn!(error = %e, region = %scratch, "could not delete bench scratch region on peer (its lease ends it)");
    }
    res
}

/// The bandwidth phase, then the latency phase, each on its own connection and grant.
async fn phases(node: &Arc<Node>, peer: &Arc<PeerEntry>, scratch: &str, p: &BenchParams, iters: u32) -> Result<BenchResult, NodeError> {
    let remote_op = if p.op == Op::Write { RemoteOp::Write } else { RemoteOp::Read };
    let ask = GrantAsk {
        region: scratch,
        offset: 0,
        length: p.size,
        op: remote_op,
        ttl: Duration::from_secs(3600),
        notify: None,
        channel: false,
    };
    let len = usize::try_from(p.size).map_err(|_| NodeError::Invalid("size too large".into()))?;
    // Mapping and pinning the buffer (up to 256 MiB) on the blocking pool.
    let n = Arc::clone(node);
    let local = tokio::task::spawn_blocking(move || {
        let mem = Arc::new(RegionMemory::anonymous(len, false).map_err(|e| NodeError::Internal(e.to_string()))?);
        n.register(mem, xfer_fabric::Access::ReadWrite).map_err(|e| NodeError::Internal(e.to_string()))
    })
    .await
    .map_err(|e| NodeError::Internal(e.to_string()))??;
    let cancel = CancellationToken::new();
    let op = if p.op == Op::Write { WrOp::Write } else { WrOp::Read };
    let qps = xfer_engine::shape::or_default(p.qps, node.transfer_defaults().qps, xfer_engine::shape::qps)?;
    let depth = xfer_engine::shape::or_default(p.depth, node.transfer_defaults().depth, xfer_engine::shape::depth)?;

    // Bandwidth: iters messages of `size`, `depth` WRs outstanding per QP: one WR per message,
    // except that READs longer than `verbs.max_read_wr` are split as a transfer's are (each
    // message its own segment, cut into WRs of that length). Each phase has its own
    // connection, and so its own grant (mw grants are bound to a connection); both are RAII
    // guards in `held`, given back when it drops.
    let piece = node.wr_chunk(op == WrOp::Read, p.size);
    let segs: Arc<[Seg]> = if piece < p.size {
        (0..iters).map(|_| Seg { local: 0, remote: 0, len: p.size }).collect()
    } else {
        Arc::from([Seg { local: 0, remote: 0, len: p.size * iters as u64 }])
    };
    let mut held = node.acquire_exempt(peer, &ask, qps, depth).await?;
    let (lease, grant) = held.take_parts()?;
    let machine = Machine::new(MachineConfig {
        segs,
        markers: Markers::None,
        chunk: piece,
        qps: lease.job_paths(op == WrOp::Read).0,
        depth,
        signal_every: node.transfer_defaults().signal_every,
        deadline: Some(Instant::now() + Duration::from_secs(600)),
        path_of: lease.job_paths(op == WrOp::Read).1,
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
    let mut us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    us.sort_by(|a, b| a.total_cmp(b));
    let pct = |q: f64| percentile(&us, q);
    Ok(BenchResult {
        size: p.size,
        iters,
        bytes: p.size * iters as u64,
        seconds,
        lat_avg_us: us.iter().sum::<f64>() / us.len().max(1) as f64,
        lat_p50_us: pct(0.5),
        lat_p99_us: pct(0.99),
        lat_iters: us.len() as u32,
        ..Default::default()
    })
}

/// The WR template of a benchmark whose messages are `size` bytes: every message reuses the
/// same buffer on both sides, so offsets are taken within a message. (The latency phase's
/// machine signals every WR: one WR per run.)
fn bench_wr(op: WrOp, local: Arc<dyn Registration>, size: u64, grant: GrantInfo) -> WrTemplate {
    WrTemplate { op, notify_slot: 0, local, remote_addr: grant.addr, remote_key: grant.key, wrap: Some(size) }
}
