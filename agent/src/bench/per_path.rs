//! The per-path probe `xferctl doctor --peer` asks for: one connection to the peer (a path per
//! pair of devices that reach each other, one path on tcp), and for each path a bandwidth phase
//! and a latency phase with the machine pinned to that path — weight 1 for it, 0 (standby) for
//! the others. A path that fails mid-phase is reported as failed even though the standbys
//! finished the phase for it: the probe is about the path, not the bytes.
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::params::{BenchParams, BenchResult, PathProbe};
use super::phase::{bandwidth_segs, bench_buffer, bench_wr, grant_ask, shape, wr_op, Latency};
use crate::error::NodeError;
use crate::node::Node;
use crate::peers::PeerEntry;
use crate::transfer::job::{qp_map, Job, LatencyProbe};
use xfer_engine::batch::Seg;
use xfer_engine::machine::{Machine, MachineConfig, Markers, PathEvent, State};

/// How long one phase on one path may take: a dead path fails its QPs within the transport's
/// retry budget, well inside this, and the doctor must answer.
const PHASE_DEADLINE: Duration = Duration::from_secs(60);

/// Latency samples per path: enough for a median, short enough for a doctor.
const LAT_ITERS: u32 = 100;

/// Runs both phases once per path of one leased connection. The whole-run fields of the result
/// are the first path's, so a caller that reads only those sees one real path.
pub(super) async fn phases(
    node: &Arc<Node>,
    peer: &Arc<PeerEntry>,
    scratch: &str,
    p: &BenchParams,
    iters: u32,
) -> Result<BenchResult, NodeError> {
    let ask = grant_ask(scratch, p);
    let local = bench_buffer(node, p.size).await?;
    let (qps, depth) = shape(node, p)?;
    let (piece, segs) = bandwidth_segs(node, p, iters);
    let op = wr_op(p);
    let cancel = CancellationToken::new();
    // One connection and grant for every phase: the paths are the connection's.
    let mut held = node.acquire_exempt(peer, &ask, qps, depth).await?;
    let (mut lease, grant) = held.take_parts()?;
    let paths = lease.conn().paths();
    let path_of = qp_map(&paths, lease.qps());
    let mut probes = Vec::with_capacity(paths.len());
    let mut first_lat = None;
    for (i, path) in paths.iter().enumerate() {
        let weights: Vec<u32> = (0..paths.len()).map(|j| u32::from(j == i)).collect();
        let mut probe = PathProbe {
            local_device: path.local_device.clone(),
            remote_device: path.remote_device.clone(),
            mtu: path.mtu,
            ..Default::default()
        };

        let machine = Machine::new(MachineConfig {
            segs: Arc::clone(&segs),
            markers: Markers::None,
            chunk: piece,
            qps: lease.qps(),
            depth,
            signal_every: node.transfer_defaults().signal_every,
            deadline: Some(Instant::now() + PHASE_DEADLINE),
            path_of: Arc::clone(&path_of),
            weights: weights.clone(),
        });
        let wr = bench_wr(op, local.clone(), p.size, grant.clone());
        let t0 = Instant::now();
        let mut done = node.run_job(Job { machine, lease, wr, probe: None, cancel: cancel.clone(), progress: None }).await?;
        let seconds = t0.elapsed().as_secs_f64();
        lease = done.lease;
        if let Some(e) = pinned_failure(&mut done.machine, i) {
            probe.error = Some(format!("bandwidth phase: {e}"));
            probes.push(probe);
            continue;
        }
        probe.bytes = done.machine.path_bytes().get(i).copied().unwrap_or(0);
        probe.seconds = seconds;

        // Latency on the path's first QP: the machine sees only the QPs up to it, and every
        // earlier one belongs to another path (a standby).
        let first = path.qps.start;
        let lat_iters = iters.clamp(1, LAT_ITERS);
        let machine = Machine::new(MachineConfig {
            segs: Arc::from([Seg { local: 0, remote: 0, len: p.size * u64::from(lat_iters) }]),
            markers: Markers::None,
            chunk: p.size,
            qps: first + 1,
            depth: 1,
            signal_every: 1,
            deadline: Some(Instant::now() + PHASE_DEADLINE),
            path_of: qp_map(&paths, first + 1),
            weights,
        });
        let wr = bench_wr(op, local.clone(), p.size, grant.clone());
        let timing = Some(LatencyProbe::default());
        let mut done = node.run_job(Job { machine, lease, wr, probe: timing, cancel: cancel.clone(), progress: None }).await?;
        lease = done.lease;
        if let Some(e) = pinned_failure(&mut done.machine, i) {
            probe.error = Some(format!("latency phase: {e}"));
        } else {
            let lat = Latency::of(&done.probe.map(|t| t.samples).unwrap_or_default());
            probe.lat_p50_us = lat.p50_us;
            if i == 0 {
                first_lat = Some(lat);
            }
        }
        probes.push(probe);
    }
    lease.release(probes.iter().all(|pr| pr.error.is_none()));
    drop(held);
    let (bytes, seconds) = probes.first().map_or((0, 0.0), |f| (f.bytes, f.seconds));
    let lat = first_lat.unwrap_or(Latency { avg_us: 0.0, p50_us: 0.0, p99_us: 0.0, n: 0 });
    Ok(BenchResult {
        size: p.size,
        iters,
        bytes,
        seconds,
        lat_avg_us: lat.avg_us,
        lat_p50_us: lat.p50_us,
        lat_p99_us: lat.p99_us,
        lat_iters: lat.n,
        paths: probes,
        ..Default::default()
    })
}

/// Why a phase pinned to `path` did not show that path working: the phase failed, or the path
/// went down (with the reason, when the driver left the machine's event for it) and the
/// standbys carried the rest.
fn pinned_failure(machine: &mut Machine, path: usize) -> Option<String> {
    let mut why = None;
    while let Some(PathEvent::Down { path: p, reason, .. }) = machine.poll_event() {
        if p == path {
            why = Some(reason.to_string());
        }
    }
    match machine.state() {
        State::Succeeded if machine.path_is_up(path) => None,
        State::Succeeded => Some(match why {
            Some(why) => format!("the path went down: {why} (the other paths finished the phase)"),
            None => "the path went down (the other paths finished the phase)".into(),
        }),
        State::Failed(f) => Some(format!("{f:?}")),
        State::Cancelled => Some("cancelled".into()),
        State::Running => Some("did not finish".into()),
    }
}
