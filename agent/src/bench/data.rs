//! The perftest-style benchmark: bandwidth (`iters` messages, `depth` WRs outstanding per QP)
//! and latency (one WR at a time on one QP) over a grant on the peer's scratch region, each
//! phase a job on the data-path driver; with `per_path`, the phases run once per path instead
//! ([`per_path`]).
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::params::{BenchParams, BenchResult};
use super::per_path;
use super::phase::{bandwidth_segs, bench_buffer, bench_wr, grant_ask, shape, wr_op, Latency};
use crate::error::NodeError;
use crate::node::Node;
use crate::peers::PeerEntry;
use crate::transfer::job::{qp_map, Job, LatencyProbe};
use xfer_engine::batch::Seg;
use xfer_engine::machine::{Machine, MachineConfig, Markers, State};

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

/// Most WRs of a latency phase.
const MAX_LAT_ITERS: u32 = 10_000;

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
    let (qps, path_of) = (lease.qps(), qp_map(&lease.conn().paths(), lease.qps()));
    let machine = Machine::new(MachineConfig {
        segs,
        markers: Markers::None,
        chunk: piece,
        qps,
        depth,
        signal_every: node.transfer_defaults().signal_every,
        deadline: Some(Instant::now() + Duration::from_secs(600)),
        path_of,
        // Equal weights, not placement: a benchmark's figure is what placement is judged
        // against, so it must not depend on rates learnt from earlier jobs, and its buffer is
        // scratch memory whose NUMA node says nothing about where the user's data lives.
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

    let bandwidth = BenchResult { size: p.size, iters, bytes: p.size * iters as u64, seconds, ..Default::default() };

    // Latency: one WR at a time on one QP (unless none was asked for).
    let lat_iters = p.lat_iters.map_or(iters.clamp(1, MAX_LAT_ITERS), |n| n.min(MAX_LAT_ITERS));
    if lat_iters == 0 {
        return Ok(bandwidth);
    }
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
    Ok(BenchResult { lat_avg_us: lat.avg_us, lat_p50_us: lat.p50_us, lat_p99_us: lat.p99_us, lat_iters: lat.n, ..bandwidth })
}
