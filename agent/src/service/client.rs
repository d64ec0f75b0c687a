//! The agent's gRPC client to other agents: domain calls in, protobuf on the wire (the messages
//! are built and read in `convert`). What a peer answers is checked before it is kept.
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint as TonicEndpoint};
use xfer_proto::v1 as pb;

use super::auth::Role;
use super::convert::{
    announce_request_to_pb, bench_region_request_to_pb, close_bench_region_request_to_pb, complete_request_to_pb, disconnect_request_to_pb,
    grant_info_from_pb, grant_request_to_pb, handshake_reply_from_pb, peer_connect_request_to_pb, revoke_request_to_pb, sink_request_to_pb,
    verify_batch_request_to_pb,
};
use super::tls::TlsMaterial;
use crate::checksum::Algo;
use crate::peer_api::{CompleteParams, GrantAsk, GrantInfo, HandshakeReply, PeerApi, PeerError, RemoteCode, Walk};
use xfer_fabric::{Endpoint, FabricKind};

#[derive(Clone)]
pub struct PeerClient {
    addr: String,
    peer: pb::peer_client::PeerClient<Channel>,
    /// Who answered at `addr` (mTLS only): the node name its certificate proved.
    identity: Arc<Mutex<Identity>>,
    tls: bool,
}

/// The node identity a TLS connection to a peer proved, and the one it must prove once pinned.
#[derive(Debug, Default)]
struct Identity {
    seen: Option<String>,
    pinned: Option<String>,
}

/// Time to establish the HTTP/2 connection to a peer: an unreachable peer fails fast.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound on any single peer RPC (the peer's work per call is small and local).
const RPC_TIMEOUT: Duration = Duration::from_secs(30);
/// A peer that accepts TCP but stalls the TLS handshake fails within this.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl PeerClient {
    /// A lazily connecting client to the agent at `addr` (`host:port`); with `tls`, over mTLS
    /// (the agent's certificate presented, the peer verified against the CA for the address' host
    /// or `tls.server_name`, and its certificate's node name recorded: the pool keys peers on it).
    pub fn new(addr: &str, tls: Option<&TlsMaterial>) -> Result<PeerClient, PeerError> {
        let bad = || PeerError::BadAddress(addr.to_string());
        let ep = TonicEndpoint::from_shared(format!("http://{addr}"))
            .map_err(|_| bad())?
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(RPC_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5));
        let identity = Arc::new(Mutex::new(Identity::default()));
        let channel = match tls {
            None => ep.connect_lazy(),
            Some(t) => tls_channel(&ep, addr, t, identity.clone()).map_err(|_| bad())?,
        };
        Ok(PeerClient {
            addr: addr.to_string(),
            // Agents call each other's Peer service only (their certificates have the node role).
            peer: pb::peer_client::PeerClient::new(channel).max_decoding_message_size(64 << 20),
            identity,
            tls: tls.is_some(),
        })
    }

    fn err(&self, s: tonic::Status) -> PeerError {
        use tonic::Code;
        let code = match s.code() {
            Code::NotFound => RemoteCode::NotFound,
            Code::InvalidArgument | Code::OutOfRange => RemoteCode::InvalidArgument,
            Code::PermissionDenied | Code::Unauthenticated => RemoteCode::PermissionDenied,
            Code::FailedPrecondition
                if s.metadata().get(crate::peer_api::ERROR_REASON_KEY).is_some_and(|v| v == crate::peer_api::UNKNOWN_CONNECTION) =>
            {
                RemoteCode::UnknownConnection
            }
            Code::FailedPrecondition => RemoteCode::FailedPrecondition,
            Code::ResourceExhausted => RemoteCode::ResourceExhausted,
            Code::DeadlineExceeded => RemoteCode::DeadlineExceeded,
            Code::Unavailable | Code::Unknown | Code::Cancelled if is_transport(&s) => {
                return PeerError::Unreachable { addr: self.addr.clone(), detail: transport_detail(&s) }
            }
            Code::Unavailable => RemoteCode::Unavailable,
            _ => RemoteCode::Other,
        };
        // A peer's message reaches this agent's callers (transfer errors): at most 1 KiB of it.
        let message: String = s.message().chars().take(1024).collect();
        PeerError::Remote { addr: self.addr.clone(), code, message }
    }

    fn bad(&self, detail: impl Into<String>) -> PeerError {
        PeerError::Protocol { addr: self.addr.clone(), detail: detail.into() }
    }

    fn identity(&self, node_name: String, instance_id: String) -> Result<(String, String), PeerError> {
        check_identity(&node_name, &instance_id).map_err(|e| self.bad(e))?;
        Ok((node_name, instance_id))
    }
}

/// A peer's node name and instance id, bounded before they are kept and shown (ListPeers,
/// transfer records): a node name is at most 253 bytes without control characters, an instance
/// id an id (or empty).
fn check_identity(node_name: &str, instance_id: &str) -> Result<(), String> {
    if node_name.len() > xfer_fabric::identity::MAX_NAME_LEN || node_name.chars().any(char::is_control) {
        return Err(format!("peer node name of {} bytes, or with control characters", node_name.len()));
    }
    if !instance_id.is_empty() && !xfer_engine::ids::valid_wire_id(instance_id) {
        return Err("peer instance id is not 1-64 characters of [A-Za-z0-9_.-]".into());
    }
    Ok(())
}

/// The gRPC channel to a peer over mTLS, with the TLS handshake done here rather than by tonic so
/// that the peer's verified certificate can be read: it must carry the node role, its name is
/// recorded in `identity`, and once the pool pinned a name, a connection to any other node (the
/// address now belongs to another agent) is refused before a request is sent on it.
fn tls_channel(ep: &TonicEndpoint, addr: &str, tls: &TlsMaterial, identity: Arc<Mutex<Identity>>) -> Result<Channel, String> {
    let mut cfg = (*tls.data.client).clone();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    // gRPC stays with rustls: only data streams hand their keys to the kernel (`tls.kernel`).
    cfg.enable_secret_extraction = false;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let data = tls.data.clone();
    let server_name = data.server_name_for(addr)?;
    let addr = addr.to_string();
    Ok(ep.connect_with_connector_lazy(tower::service_fn(move |_: tonic::transport::Uri| {
        let (connector, data, server_name, addr, identity) =
            (connector.clone(), data.clone(), server_name.clone(), addr.clone(), identity.clone());
        async move {
            let tcp = tokio::net::TcpStream::connect(&addr).await?;
            tcp.set_nodelay(true)?;
            let stream = tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, connector.connect(server_name, tcp))
                .await
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
            let caller = data.caller_of(stream.get_ref().1.peer_certificates()).map_err(std::io::Error::other)?;
            if caller.role != Role::Node {
                return Err(std::io::Error::other(format!("the agent at {addr} presented a {} certificate, not a node's", caller.role)));
            }
            let mut id = identity.lock().unwrap_or_else(|p| p.into_inner());
            id.seen = Some(caller.name.clone());
            if let Some(pinned) = id.pinned.as_ref().filter(|p| **p != caller.name) {
                return Err(std::io::Error::other(format!("the agent at {addr} is now node {:?}, not {pinned:?}", caller.name)));
            }
            drop(id);
            Ok::<_, std::io::Error>(TokioIo::new(stream))
        }
    })))
}

#[async_trait::async_trait]
impl PeerApi for PeerClient {
    fn verified_identity(&self) -> Option<String> {
        self.identity.lock().unwrap_or_else(|p| p.into_inner()).seen.clone()
    }

    fn authenticates(&self) -> bool {
        self.tls
    }

    fn pin_identity(&self, name: &str) {
        self.identity.lock().unwrap_or_else(|p| p.into_inner()).pinned = Some(name.to_string());
    }

    async fn handshake(
        &self,
        node_name: &str,
        fabric: FabricKind,
        endpoints: Vec<Endpoint>,
        connection_id: &xfer_engine::ids::ConnectionId,
    ) -> Result<HandshakeReply, PeerError> {
        let req = peer_connect_request_to_pb(node_name, fabric, &endpoints, connection_id);
        let r = self.peer.clone().connect(req).await.map_err(|s| self.err(s))?.into_inner();
        let reply = handshake_reply_from_pb(r).map_err(|e| self.bad(e))?;
        let (node_name, instance_id) = self.identity(reply.node_name, reply.instance_id)?;
        Ok(HandshakeReply { node_name, instance_id, ..reply })
    }

    /// `Peer.Grant`, bound to the caller's connection `connection_id` (grant mode mw binds its
    /// windows on that connection's QPs).
    async fn grant(
        &self,
        ask: &GrantAsk<'_>,
        node_name: &str,
        connection_id: &xfer_engine::ids::ConnectionId,
    ) -> Result<GrantInfo, PeerError> {
        let req = grant_request_to_pb(ask, node_name, connection_id);
        let r = self.peer.clone().grant(req).await.map_err(|s| self.err(s))?.into_inner();
        let info = grant_info_from_pb(r).map_err(|e| self.bad(e))?;
        let (node_name, instance_id) = self.identity(info.node_name, info.instance_id)?;
        Ok(GrantInfo { node_name, instance_id, ..info })
    }

    async fn revoke(&self, grant_id: &str) -> Result<(), PeerError> {
        self.peer.clone().revoke(revoke_request_to_pb(grant_id)).await.map_err(|s| self.err(s))?;
        Ok(())
    }

    /// Returns whether the target's checksum matched (true when none was sent).
    async fn complete(&self, p: CompleteParams) -> Result<bool, PeerError> {
        let has = p.checksum.is_some();
        let r = self.peer.clone().complete(complete_request_to_pb(p)).await.map_err(|s| self.err(s))?.into_inner();
        Ok(!has || r.checksum_matched)
    }

    async fn announce(&self, grant_id: &xfer_engine::ids::GrantId, seq: u64, tag: &[u8]) -> Result<(), PeerError> {
        self.peer.clone().announce(announce_request_to_pb(grant_id, seq, tag)).await.map_err(|s| self.err(s))?;
        Ok(())
    }

    async fn verify_batch(
        &self,
        grant_id: &xfer_engine::ids::GrantId,
        seq: u64,
        sum: (Algo, u64),
        spans: Vec<(u64, u64)>,
        settle: bool,
    ) -> Result<bool, PeerError> {
        let req = verify_batch_request_to_pb(grant_id, seq, sum, spans, settle);
        let r = self.peer.clone().verify_batch(req).await.map_err(|s| self.err(s))?.into_inner();
        Ok(r.checksum_matched)
    }

    async fn disconnect(&self, connection_id: &xfer_engine::ids::ConnectionId, node_name: &str) {
        let req = disconnect_request_to_pb(connection_id, node_name);
        // Best effort: a dead peer has already dropped the connection's state.
        let _ = self.peer.clone().disconnect(req).await;
    }

    async fn open_sink(&self, connections: u32, tls: bool, walk: Walk) -> Result<String, PeerError> {
        let r = self.peer.clone().open_sink(sink_request_to_pb(connections, tls, walk)).await.map_err(|s| self.err(s))?.into_inner();
        Ok(r.address)
    }

    /// `Peer.OpenBenchRegion`: a scratch region on the peer for a benchmark; returns its name.
    async fn open_bench_region(&self, length: u64) -> Result<String, PeerError> {
        let r = self.peer.clone().open_bench_region(bench_region_request_to_pb(length)).await.map_err(|s| self.err(s))?.into_inner();
        crate::regions::validate_name(&r.region).map_err(|e| self.bad(e.to_string()))?;
        Ok(r.region)
    }

    async fn ping(&self) -> Result<(), PeerError> {
        self.peer.clone().ping(pb::PingRequest::default()).await.map_err(|s| self.err(s))?;
        Ok(())
    }

    async fn close_bench_region(&self, region: &str) -> Result<(), PeerError> {
        self.peer.clone().close_bench_region(close_bench_region_request_to_pb(region)).await.map_err(|s| self.err(s))?;
        Ok(())
    }
}

/// The [`Connector`](crate::peer_api::Connector) the agent uses: a gRPC [`PeerClient`] per peer
/// address, over mTLS when `tls` is given.
pub fn connector(tls: Option<std::sync::Arc<TlsMaterial>>) -> crate::peer_api::Connector {
    std::sync::Arc::new(move |addr: &str| -> Result<std::sync::Arc<dyn PeerApi>, PeerError> {
        Ok(std::sync::Arc::new(PeerClient::new(addr, tls.as_deref())?))
    })
}

/// Whether a status came from the transport (no answer from the peer) rather than the peer.
fn is_transport(s: &tonic::Status) -> bool {
    use std::error::Error;
    let mut src: Option<&(dyn Error + 'static)> = s.source();
    while let Some(e) = src {
        if e.is::<tonic::transport::Error>() || e.is::<std::io::Error>() {
            return true;
        }
        src = e.source();
    }
    let m = s.message();
    m.contains("transport error") || m.contains("connection") || m.contains("tcp connect") || m.contains("timed out")
}

fn transport_detail(s: &tonic::Status) -> String {
    use std::error::Error;
    let mut parts = vec![s.message().to_string()];
    let mut src: Option<&(dyn Error + 'static)> = s.source();
    while let Some(e) = src {
        let t = e.to_string();
        if !parts.contains(&t) {
            parts.push(t);
        }
        src = e.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::NodeError;
    use crate::peer_api::RemoteCode;

    /// The responder's "unknown connection" refusal reaches the initiator as its own code (the
    /// marker survives the status), while any other FAILED_PRECONDITION stays what it is: only
    /// the former makes the initiator retry on a fresh connection.
    #[tokio::test]
    async fn unknown_connection_is_told_apart_from_other_preconditions() {
        let c = PeerClient::new("127.0.0.1:1", None).unwrap();
        let code = |e: NodeError| match c.err(super::super::convert::transfer_status(e)) {
            PeerError::Remote { code, .. } => code,
            other => panic!("{other:?}"),
        };
        assert_eq!(code(NodeError::UnknownConnection("no connection \"x\"".into())), RemoteCode::UnknownConnection);
        assert_eq!(code(NodeError::FailedPrecondition("region is draining".into())), RemoteCode::FailedPrecondition);
        // A status that merely says the words is not the marker.
        let s = tonic::Status::failed_precondition("unknown-connection");
        assert!(matches!(c.err(s), PeerError::Remote { code: RemoteCode::FailedPrecondition, .. }));
    }

    /// What a peer answers is bounded before it is kept: its name, its instance id, its errors.
    #[tokio::test]
    async fn a_peers_answers_are_bounded() {
        assert_eq!(check_identity("node-b", "0123abcd"), Ok(()));
        assert_eq!(check_identity("", ""), Ok(()));
        assert!(check_identity(&"n".repeat(254), "x").is_err());
        assert!(check_identity("node\u{1b}[2J", "x").is_err());
        assert!(check_identity("node-b", &"i".repeat(65)).is_err());
        assert!(check_identity("node-b", "a/b").is_err());
        let c = PeerClient::new("127.0.0.1:1", None).unwrap();
        match c.err(tonic::Status::internal("e".repeat(1 << 20))) {
            PeerError::Remote { message, .. } => assert_eq!(message.len(), 1024),
            other => panic!("{other:?}"),
        }
    }
}
