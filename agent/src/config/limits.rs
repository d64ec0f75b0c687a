//! The `limits` section: how much of everything the agent holds at once (regions, bytes,
//! transfers, connections, peers), its timeouts against slow or silent sockets, and the share
//! one tenant may take of each.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use xfer_common::{ByteSize, HumanDuration};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct LimitsConfig {
    pub max_regions: usize,
    pub max_registered_bytes: ByteSize,
    /// Memory of benchmarks (an admin's `Bench` and `TcpBaseline` buffers and pools, a peer's
    /// `OpenBenchRegion` scratch region, `OpenSink` buffers): a budget of its own, not counted
    /// against `max_registered_bytes`, so a benchmark never makes a client's region fail.
    pub max_bench_bytes: ByteSize,
    pub max_grants_per_peer: usize,
    pub max_transfers: usize,
    pub max_transfers_per_peer: usize,
    pub max_message_size: ByteSize,
    /// Distinct `peer` label values in metrics; further peers are counted as `other`.
    pub max_peer_labels: usize,
    /// Open sockets on the tcp data port, from accept until close (hello or not).
    pub max_data_connections: usize,
    /// Data streams of one identity (a session's owner), counted once the hello names a session.
    pub max_data_connections_per_peer: usize,
    /// Open connections on the gRPC port (enforced as at most a quarter of RLIMIT_NOFILE); further
    /// sockets are closed at once.
    pub max_grpc_connections: usize,
    /// Sockets on the tcp data port still before their hello; at the cap the oldest is closed to
    /// make room, so silent sockets can never keep a real peer's stream out.
    pub max_pending_data_connections: usize,
    /// A data stream must complete its (TLS handshake and) hello within this.
    pub data_handshake_timeout: HumanDuration,
    /// A data stream that sends no frame for this long is closed (not a tcp standby rail's: it
    /// idles by design and lives as long as its verbs connection).
    pub data_idle_timeout: HumanDuration,
    /// A WRITE payload (or a refused one being discarded) must arrive in full within this of its
    /// header, or the stream is closed.
    pub data_payload_timeout: HumanDuration,
    /// Entries in the peer pool (peer agents by address); the least recently used idle one is
    /// evicted.
    pub max_peers: usize,
    /// The gRPC servers (network port and unix socket) ping every connection this often and
    /// close one that does not answer within as long again, with every stream on it (0 = never
    /// ping): what a vanished client held — a notification ring, a channel — is given back.
    pub grpc_keepalive: HumanDuration,
    /// Negotiated connections kept for one peer identity, as responder and as initiator (an
    /// initiator also stays under what the responder advertises).
    pub max_connections_per_peer: usize,
    /// The share (0 < f <= 1) of each global limit one authenticated identity may hold:
    /// transfers and channels, `WatchInbound` subscriptions, regions, registered bytes and a
    /// peer's inbound records. 1 turns shares off.
    pub tenant_share: f64,
}

impl LimitsConfig {
    /// `grpc_keepalive`, `None` when off.
    pub fn grpc_keepalive(&self) -> Option<Duration> {
        Some(self.grpc_keepalive.0).filter(|d| !d.is_zero())
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_regions: 1024,
            max_registered_bytes: ByteSize(64 << 30),
            max_bench_bytes: ByteSize(1 << 30),
            max_grants_per_peer: 1024,
            max_transfers: 256,
            max_transfers_per_peer: 64,
            max_message_size: ByteSize(16 << 20),
            max_peer_labels: 256,
            max_data_connections: 4096,
            max_data_connections_per_peer: 256,
            max_pending_data_connections: 128,
            max_grpc_connections: 1024,
            data_handshake_timeout: HumanDuration(Duration::from_secs(10)),
            data_idle_timeout: HumanDuration(Duration::from_secs(300)),
            data_payload_timeout: HumanDuration(Duration::from_secs(30)),
            max_peers: 1024,
            grpc_keepalive: HumanDuration(Duration::from_secs(30)),
            max_connections_per_peer: 256,
            tenant_share: 0.5,
        }
    }
}
