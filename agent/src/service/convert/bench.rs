//! The benchmarks on the wire (admin-only): `Agent.Bench` into [`BenchParams`] and its result
//! back, `Agent.TcpBaseline`'s answer, and the peer side's sink and scratch-region answers.
use std::time::Duration;

use tonic::Status;
use xfer_proto::v1 as pb;

use super::peers::peer_address;
use super::scalars::{fabric_to_pb, op_from_pb};
use super::status::{require, transfer_status};
use crate::bench::{BenchParams, BenchResult, PathProbe};
use crate::transfer::Op;
use xfer_fabric::FabricKind;

/// `Agent.Bench`: the peer is required and must parse; qps and depth are 0 (the agent's default)
/// or within the bounds `SubmitTransfer` applies; an unknown op benchmarks WRITE.
pub fn bench_params_from_pb(r: pb::BenchRequest) -> Result<BenchParams, Status> {
    require(!r.peer.is_empty(), "peer address is required")?;
    peer_address(&r.peer)?;
    if r.qps != 0 {
        xfer_engine::shape::qps(r.qps as usize).map_err(|e| transfer_status(e.into()))?;
    }
    if r.depth != 0 {
        xfer_engine::shape::depth(r.depth as usize).map_err(|e| transfer_status(e.into()))?;
    }
    require(
        r.lat_iters.is_none() || (r.blocks == 0 && r.connections == 0 && !r.per_path),
        "lat_iters applies to the message benchmark only (not kv, connect or per path)",
    )?;
    Ok(BenchParams {
        peer: r.peer,
        op: op_from_pb(r.op).unwrap_or(Op::Write),
        size: r.size,
        iters: r.iters,
        qps: r.qps as usize,
        depth: r.depth as usize,
        blocks: r.blocks,
        pool: r.pool,
        channel: r.channel,
        connections: r.connections,
        hold: Duration::from_millis(u64::from(r.hold_ms)),
        interval: Duration::from_millis(u64::from(r.interval_ms)),
        per_path: r.per_path,
        lat_iters: r.lat_iters,
    })
}

/// Gbit/s of `bytes` in `seconds` (0 for a run that took no time).
fn gbit_per_s(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 * 8.0 / seconds / 1e9
    } else {
        0.0
    }
}

/// `Agent.Bench`'s answer, for a run on a node whose fabric is `fabric`.
pub fn bench_to_pb(b: &BenchResult, fabric: FabricKind) -> pb::BenchResponse {
    pb::BenchResponse {
        size: b.size,
        iters: b.iters,
        bytes: b.bytes,
        seconds: b.seconds,
        gbit_per_s: gbit_per_s(b.bytes, b.seconds),
        lat_avg_us: b.lat_avg_us,
        lat_p50_us: b.lat_p50_us,
        lat_p99_us: b.lat_p99_us,
        lat_iters: b.lat_iters,
        fabric: fabric_to_pb(fabric) as i32,
        blocks: b.blocks,
        submit_p50_us: b.submit_p50_us,
        prep_ns_per_segment: b.prep_ns_per_segment,
        channel: b.channel,
        repost_ns_per_segment: b.repost_ns_per_segment,
        channel_open_us: b.channel_open_us,
        connections: b.connections,
        qps_held: b.qps_held,
        rss_bytes_per_qp: b.rss_bytes_per_qp,
        rpc_p50_us: b.rpc_p50_us,
        paths: b.paths.iter().map(path_probe_to_pb).collect(),
    }
}

/// One path of a per-path benchmark, with the MTU its QPs negotiated (0 on tcp).
fn path_probe_to_pb(p: &PathProbe) -> pb::PathProbe {
    pb::PathProbe {
        local_device: p.local_device.clone(),
        remote_device: p.remote_device.clone(),
        mtu: p.mtu,
        gbit_per_s: gbit_per_s(p.bytes, p.seconds),
        lat_p50_us: p.lat_p50_us,
        error: p.error.clone().unwrap_or_default(),
    }
}

/// `Agent.TcpBaseline`'s answer: `bytes` moved in `seconds`.
pub fn tcp_baseline_to_pb(bytes: u64, seconds: f64) -> pb::TcpBaselineResponse {
    pb::TcpBaselineResponse { bytes, seconds, gbit_per_s: gbit_per_s(bytes, seconds) }
}

/// `Peer.OpenSink`'s answer: where the sink listens.
pub fn sink_to_pb(address: std::net::SocketAddr) -> pb::OpenSinkResponse {
    pb::OpenSinkResponse { address: address.to_string() }
}

/// `Peer.OpenBenchRegion`'s answer: the scratch region's name.
pub fn bench_region_to_pb(region: String) -> pb::OpenBenchRegionResponse {
    pb::OpenBenchRegionResponse { region }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The MTU a path negotiated reaches `doctor --peer` as the agent measured it (it used to be
    /// sent as 0, and xferctl guessed from the ports' active MTU).
    #[test]
    fn a_path_probe_carries_its_negotiated_mtu() {
        let p = PathProbe {
            local_device: "rxe0".into(),
            remote_device: "rxe1".into(),
            mtu: 1024,
            bytes: 1 << 20,
            seconds: 1.0,
            ..Default::default()
        };
        let w = path_probe_to_pb(&p);
        assert_eq!((w.local_device.as_str(), w.remote_device.as_str(), w.mtu), ("rxe0", "rxe1", 1024));
        assert_eq!(path_probe_to_pb(&PathProbe::default()).mtu, 0, "tcp: no MTU");
    }
}
