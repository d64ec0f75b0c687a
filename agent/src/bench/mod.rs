//! Benchmarks, above the core: `Agent.Bench` (perftest-style WRITE/READ, the KV-cache pattern
//! over transfers or a channel, connection setup) and `Agent.TcpBaseline` with its sink
//! (`Peer.OpenSink`). They use the agent only through `Node`'s public calls — scratch regions,
//! the peer pool, grants, jobs on the data-path driver — as any client of the core would; the
//! target side of a benchmark (its scratch region) is the core's (`Node::open_bench_region`).
//!
//! * [`params`] — what a benchmark is asked and what it reports;
//! * [`data`] — bandwidth and latency over one grant on the peer's scratch region;
//! * [`per_path`] — the same once per path of one connection, pinned to it (`xferctl doctor`);
//! * [`phase`] — what those phases share (grant, buffer, segments, WR template, statistics);
//! * [`kv`] — the KV-cache pattern, through `SubmitTransfer` or over one channel;
//! * [`connect`] — connection setup cost and memory per QP;
//! * [`tcp`] — the raw TCP baseline and its one-shot sink;
//! * [`sample`] — distinct random slots for the KV pattern.
use std::sync::Arc;

use crate::error::NodeError;
use crate::node::Node;

mod connect;
mod data;
mod kv;
mod params;
mod per_path;
mod phase;
mod sample;
mod tcp;
mod walk;

pub use params::{BenchParams, BenchResult, PathProbe, BENCH_MAX_HOLD, BENCH_MAX_INTERVAL};
pub use tcp::{open_sink, tcp_baseline};

/// `Agent.Bench`: the pattern `p` asks for (connection setup, the KV pattern, or perftest-style
/// messages) against `p.peer`. Admin-only; one at a time.
pub async fn run(node: &Arc<Node>, p: BenchParams) -> Result<BenchResult, NodeError> {
    if p.connections > 0 {
        return connect::run(node, p).await;
    }
    if p.blocks > 0 {
        return kv::run(node, p).await;
    }
    data::run(node, p).await
}
