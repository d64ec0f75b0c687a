//! The client's benchmark types: what `Agent.Bench` is asked and answers, per path and against
//! the raw TCP (or TLS) baseline of `Agent.TcpBaseline`.
use super::{Fabric, Op};

/// A benchmark between this agent and a peer (`Agent.Bench`); zeros are the agent's defaults.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BenchSpec {
    pub peer: String,
    pub op: Op,
    /// Message (or KV block) size in bytes.
    pub size: u64,
    pub iters: u32,
    pub qps: u32,
    pub depth: u32,
    /// KV pattern: blocks per batch (0 = the plain pattern).
    pub blocks: u32,
    /// KV pattern: the pool the blocks are scattered over.
    pub pool: u64,
    /// KV pattern over a channel (a list prepared once and re-posted).
    pub channel: bool,
    /// Connect pattern: this many connections held at once (0 = not the connect pattern).
    pub connections: u32,
    /// Connect pattern: keep them this long once all are up, in milliseconds (at most 60,000).
    pub hold_ms: u32,
    /// Connect pattern: untimed wait before each connection after the first, in milliseconds
    /// (at most 1,000); 0 = back to back.
    pub interval_ms: u32,
    /// Both phases once per path of one connection, each pinned to its path
    /// ([`BenchResult::paths`]); `xferctl doctor --peer` asks for this.
    pub per_path: bool,
    /// Message pattern: WRs of the latency phase (`None`: the agent's choice, as many as the
    /// bandwidth phase's up to 10,000; `Some(0)`: no latency phase, so the agents' CPU time
    /// over the run is the bandwidth phase's).
    pub lat_iters: Option<u32>,
}

/// What a benchmark run measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BenchResult {
    pub size: u64,
    pub iters: u32,
    /// Bandwidth phase.
    pub bytes: u64,
    pub seconds: f64,
    pub gbit_per_s: f64,
    /// Latency phase (connect pattern: connection setup), microseconds.
    pub lat_avg_us: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub lat_iters: u32,
    pub fabric: Fabric,
    pub blocks: u32,
    pub submit_p50_us: f64,
    pub prep_ns_per_segment: f64,
    pub channel: bool,
    pub repost_ns_per_segment: f64,
    pub channel_open_us: f64,
    pub connections: u32,
    pub qps_held: u32,
    pub rss_bytes_per_qp: f64,
    /// Connection setup: p50 of a `Peer.Ping` round trip to the same peer in the same run, the
    /// baseline the connect times compare with.
    pub rpc_p50_us: f64,
    /// Per path ([`BenchSpec::per_path`]), in the connection's QP order.
    pub paths: Vec<PathProbe>,
}

/// One path of a per-path benchmark: a local device, the peer's device it reached, and what a
/// short sample on that path alone measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PathProbe {
    /// Empty on tcp.
    pub local_device: String,
    /// As the peer names it; empty on tcp.
    pub remote_device: String,
    /// Bytes, as the path's QPs negotiated; 0 on tcp or when the agent does not report it.
    pub mtu: u32,
    pub gbit_per_s: f64,
    pub lat_p50_us: f64,
    /// Why a phase failed on this path; `None` when it worked.
    pub error: Option<String>,
}

/// Raw TCP between the two agents' hosts, the baseline for [`BenchResult`]s.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TcpBaselineSpec {
    pub peer: String,
    /// Bytes to stream in total.
    pub bytes: u64,
    /// Parallel streams (0 = 1).
    pub connections: u32,
    /// Write size (0 = 1 MiB).
    pub block: u64,
    /// TLS streams with the agents' data-plane certificates (the raw TLS baseline).
    pub tls: bool,
    /// > 0: both ends walk buffers this long instead of one small hot buffer each.
    pub pool: u64,
    /// With a pool, in plaintext, and more than zero: both ends move the pool in pieces this
    /// long at random places, in gathered system calls (the KV pattern's memory access, without
    /// protocol).
    pub scatter: u64,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct TcpBaseline {
    pub bytes: u64,
    pub seconds: f64,
    pub gbit_per_s: f64,
}
