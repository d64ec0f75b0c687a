//! The calls this agent makes on a peer agent's Peer service, in domain types: the [`PeerApi`]
//! trait, its request and reply types, and its errors. `service::client` implements it over gRPC
//! (the only place that sees the protobuf messages); `peers` and `node` use only this module, so
//! the initiator's logic does not depend on the transport and can run against a fake peer.
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::checksum::Algo;
use xfer_fabric::{Endpoint, FabricError, FabricKind, RemoteKey, RemoteOp};

/// What `Peer.Grant` returns.
#[derive(Clone)]
pub struct GrantInfo {
    pub grant_id: xfer_engine::ids::GrantId,
    pub addr: u64,
    pub key: RemoteKey,
    pub length: u64,
    pub expires_at: Option<SystemTime>,
    pub node_name: String,
    pub instance_id: String,
    /// The notification slot the peer assigned (`GrantAsk::notify`); 0 = none.
    pub notify_slot: u32,
}

impl std::fmt::Debug for GrantInfo {
    // The remote address is not printed, and `RemoteKey` hides the key (SECURITY.md).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrantInfo")
            .field("grant_id", &self.grant_id)
            .field("key", &self.key)
            .field("length", &self.length)
            .field("node_name", &self.node_name)
            .finish_non_exhaustive()
    }
}

/// What `Peer.Grant` is asked for.
#[derive(Debug, Clone, Copy)]
pub struct GrantAsk<'a> {
    pub region: &'a str,
    pub offset: u64,
    /// 0 = the rest of the region
    pub length: u64,
    pub op: RemoteOp,
    pub ttl: Duration,
    /// Ask for a notification: (the tag, markers the initiator will send: one per QP).
    pub notify: Option<(&'a [u8], u32)>,
    /// With `notify`: a channel's per-batch notifications (the tag is then unused; each batch's
    /// comes with [`PeerApi::announce`]).
    pub channel: bool,
}

#[derive(Debug, Clone)]
pub struct CompleteParams {
    pub transfer_id: xfer_engine::ids::TransferId,
    pub grant_id: xfer_engine::ids::GrantId,
    pub bytes: u64,
    pub op_write: bool,
    pub node_name: String,
    pub checksum: Option<(Algo, u64)>,
    /// What the checksum covers at the target, in order (offset from the grant's start,
    /// length): a batch's destination segments. Empty: the first `bytes` of the grant.
    pub spans: Vec<(u64, u64)>,
    pub success: bool,
}

/// Result of the responder's half of `Peer.Connect`.
#[derive(Debug, Clone)]
pub struct HandshakeReply {
    pub node_name: String,
    pub instance_id: String,
    pub fabric: FabricKind,
    pub endpoints: Vec<Endpoint>,
    /// What the responder keeps for this agent's identity (0 = no bound).
    pub max_connections: u32,
    pub max_streams: u32,
}

/// The `xfer-error` metadata value of a refusal because the named connection is unknown.
pub const UNKNOWN_CONNECTION: &str = "unknown-connection";
/// The gRPC metadata key that refines a status code for machines (like `google.rpc.ErrorInfo`'s
/// reason): the initiator retries on a fresh connection only for this, not for any
/// FAILED_PRECONDITION.
pub const ERROR_REASON_KEY: &str = "xfer-error";

/// Coarse class of a remote error, mirrored from the peer's gRPC status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteCode {
    NotFound,
    InvalidArgument,
    PermissionDenied,
    FailedPrecondition,
    /// The peer does not know the connection a call named (it closed it, or restarted): a
    /// FAILED_PRECONDITION marked with [`UNKNOWN_CONNECTION`] in the `xfer-error` metadata.
    UnknownConnection,
    ResourceExhausted,
    Unavailable,
    DeadlineExceeded,
    Other,
}

#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("invalid peer address {0:?}")]
    BadAddress(String),
    #[error("peer {addr} is unreachable: {detail}")]
    Unreachable { addr: String, detail: String },
    #[error("peer {addr}: {message}")]
    Remote { addr: String, code: RemoteCode, message: String },
    #[error("peer {addr} sent an invalid reply: {detail}")]
    Protocol { addr: String, detail: String },
    #[error("connecting to peer {addr} failed: {source}")]
    Fabric { addr: String, source: FabricError },
    #[error("peer pool is full: {max} peers (limits.max_peers) are all in use; cannot add {addr}")]
    PoolFull { addr: String, max: usize },
    #[error(transparent)]
    InvalidAddress(#[from] crate::peer_addr::AddrError),
    #[error("peer {addr}: {detail}")]
    ConnectionLimit { addr: String, detail: String },
}

impl PeerError {
    /// The peer did not answer (transport failure), as opposed to answering with an error.
    pub fn is_transport(&self) -> bool {
        matches!(self, PeerError::Unreachable { .. })
    }

    /// The connection was refused: nothing was sent, so retrying cannot duplicate a request.
    pub(crate) fn is_refused(&self) -> bool {
        match self {
            PeerError::Unreachable { detail, .. } => detail.contains("Connection refused") || detail.contains("os error 111"),
            _ => false,
        }
    }
}

/// One peer agent's Peer service, as the initiator calls it.
#[async_trait]
pub trait PeerApi: Send + Sync {
    /// `Peer.Connect`: offer our endpoints for connection `connection_id`; the peer's reply.
    async fn handshake(
        &self,
        node_name: &str,
        fabric: FabricKind,
        endpoints: Vec<Endpoint>,
        connection_id: &xfer_engine::ids::ConnectionId,
    ) -> Result<HandshakeReply, PeerError>;
    /// `Peer.Grant`, bound to connection `connection_id`.
    async fn grant(
        &self,
        ask: &GrantAsk<'_>,
        node_name: &str,
        connection_id: &xfer_engine::ids::ConnectionId,
    ) -> Result<GrantInfo, PeerError>;
    /// `Peer.Revoke`.
    async fn revoke(&self, grant_id: &str) -> Result<(), PeerError>;
    /// `Peer.Complete`: the data landed (or was read); with a checksum the peer verifies it.
    /// Returns whether the peer's checksum matched (true without one).
    async fn complete(&self, p: CompleteParams) -> Result<bool, PeerError>;
    /// `Peer.Announce`: the tag of batch `seq` on a channel grant.
    async fn announce(&self, grant_id: &xfer_engine::ids::GrantId, seq: u64, tag: &[u8]) -> Result<(), PeerError>;
    /// `Peer.VerifyBatch`: the target checksums `spans` of the grant (from its start, in order)
    /// against `sum`; with `settle` and a match it publishes batch `seq`'s notification. Whether
    /// the sums matched.
    async fn verify_batch(
        &self,
        grant_id: &xfer_engine::ids::GrantId,
        seq: u64,
        sum: (Algo, u64),
        spans: Vec<(u64, u64)>,
        settle: bool,
    ) -> Result<bool, PeerError>;
    /// `Peer.Disconnect` (best effort: errors are logged, not returned).
    async fn disconnect(&self, connection_id: &xfer_engine::ids::ConnectionId, node_name: &str);
    /// `Peer.OpenSink` for the raw TCP (or, `tls`, TLS) baseline: the sink's address.
    async fn open_sink(&self, connections: u32, tls: bool, walk: Walk) -> Result<String, PeerError>;
    /// `Peer.OpenBenchRegion`: a scratch region's name.
    async fn open_bench_region(&self, length: u64) -> Result<String, PeerError>;
    /// `Peer.CloseBenchRegion`.
    async fn close_bench_region(&self, region: &str) -> Result<(), PeerError>;
    /// `Peer.Ping`: one round trip that does nothing (the connect benchmark's baseline).
    async fn ping(&self) -> Result<(), PeerError>;
    /// The node name the peer's certificate proved on the last connection (mTLS); `None` in
    /// plaintext or before any connection.
    fn verified_identity(&self) -> Option<String> {
        None
    }
    /// Whether the peer proves a node identity (mTLS): then the pool keys it on that name.
    fn authenticates(&self) -> bool {
        false
    }
    /// From now on a connection whose certificate names another node is refused (the address
    /// was taken over by another agent: the pool must not send this peer's calls there).
    fn pin_identity(&self, _name: &str) {}
}

/// Makes the [`PeerApi`] client for a peer address (`host:port`): the gRPC client in the agent
/// (`service::client::connector`), a fake in tests.
pub type Connector = Arc<dyn Fn(&str) -> Result<Arc<dyn PeerApi>, PeerError> + Send + Sync>;

/// How the two ends of a raw TCP baseline walk memory: with a `pool` (bytes, in all), each stream
/// its own share of it instead of one small hot buffer; with `scatter` too, in pieces of that many
/// bytes at random places of its share, in gathered system calls (a KV batch's access pattern).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Walk {
    pub pool: u64,
    pub scatter: u64,
}
