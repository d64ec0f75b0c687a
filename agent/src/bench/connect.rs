//! The connection-setup benchmark: how long a fresh connection takes to negotiate, what each QP
//! costs in resident memory, and a `Peer.Ping` round trip to the same peer as the baseline.
use std::sync::Arc;
use std::time::Instant;

use super::params::{percentile, BenchParams, BenchResult, BENCH_MAX_HOLD, BENCH_MAX_INTERVAL};
use crate::error::NodeError;
use crate::node::Node;

/// Most connections the connection benchmark holds: what a peer keeps per identity.
const BENCH_MAX_CONNECTIONS: u32 = 256;

/// `Peer.Ping` round trips the connect benchmark times as its baseline.
const BENCH_PINGS: usize = 50;

/// This process's resident memory (VmRSS), in bytes.
fn rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = s.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

/// Connection setup: negotiates `p.connections` fresh connections of `p.qps` QPs to the peer
/// one after another (each `Peer.Connect` to RTS timed), holds them all, measures this
/// process's resident memory growth per QP and times [`BENCH_PINGS`] `Peer.Ping` round trips
/// to the same peer (the baseline), then discards them (the peer forgets them).
pub(super) async fn run(node: &Arc<Node>, p: BenchParams) -> Result<BenchResult, NodeError> {
    if p.connections > BENCH_MAX_CONNECTIONS {
        return Err(NodeError::Invalid(format!("at most {BENCH_MAX_CONNECTIONS} connections (what a peer keeps per identity)")));
    }
    if p.hold > BENCH_MAX_HOLD {
        return Err(NodeError::Invalid(format!("connections are held at most {BENCH_MAX_HOLD:?}")));
    }
    if p.interval > BENCH_MAX_INTERVAL {
        return Err(NodeError::Invalid(format!("the pause between connections is at most {BENCH_MAX_INTERVAL:?}")));
    }
    let _admin = node.admin_slot("Bench")?;
    let qps = xfer_engine::shape::or_default(p.qps, node.transfer_defaults().qps, xfer_engine::shape::qps)?;
    let depth = xfer_engine::shape::or_default(p.depth, node.transfer_defaults().depth, xfer_engine::shape::depth)?;
    let peer = node.peer_entry(&p.peer).await?;
    let before = rss_bytes();
    let mut held = Vec::with_capacity(p.connections as usize);
    let mut us = Vec::with_capacity(p.connections as usize);
    let t = Instant::now();
    for i in 0..p.connections {
        if i > 0 && !p.interval.is_zero() {
            // Pacing, not synchronisation: each negotiation starts on agents that finished
            // the previous one's background work (pool refill, the peer's RTS).
            tokio::time::sleep(p.interval).await;
        }
        let t0 = Instant::now();
        // Every lease is held, so each one is a fresh negotiation (the idle list is empty or
        // holds other shapes).
        let lease = node.lease(&peer, qps, depth, &crate::tenants::Tenant::exempt()).await?;
        if !lease.reused() {
            us.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        held.push(lease);
    }
    let seconds = t.elapsed().as_secs_f64();
    let after = rss_bytes();
    let qps_held: usize = held.iter().map(|l| l.qps()).sum();
    // The baseline, same peer, same run: a gRPC round trip that does nothing. Peer.Connect's
    // handshake is one such call plus the responder's work.
    let mut rpc_us = Vec::with_capacity(BENCH_PINGS);
    for _ in 0..BENCH_PINGS {
        let t0 = Instant::now();
        peer.call(|| peer.client.ping()).await?;
        rpc_us.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    rpc_us.sort_by(|a, b| a.total_cmp(b));
    if !p.hold.is_zero() {
        tokio::time::sleep(p.hold).await;
    }
    for l in held {
        // Discarded, not pooled: the peer is told to forget each.
        l.release(false);
    }
    let per_qp = match (before, after) {
        (Some(b), Some(a)) if qps_held > 0 => a.saturating_sub(b) as f64 / qps_held as f64,
        _ => 0.0,
    };
    let avg = us.iter().sum::<f64>() / us.len().max(1) as f64;
    us.sort_by(|a, b| a.total_cmp(b));
    Ok(BenchResult {
        iters: p.connections,
        seconds,
        lat_avg_us: avg,
        lat_p50_us: percentile(&us, 0.5),
        lat_p99_us: percentile(&us, 0.99),
        lat_iters: us.len() as u32,
        connections: p.connections,
        qps_held: qps_held as u32,
        rss_bytes_per_qp: per_qp,
        rpc_p50_us: percentile(&rpc_us, 0.5),
        ..Default::default()
    })
}
