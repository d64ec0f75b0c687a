//! gRPC services: `xfer.v1.Agent` (xferctl and local apps, `agent`) and `xfer.v1.Peer` (agent
//! to agent, `peer`), plus health and reflection, over one [`Services`]. The only place, with
//! `client` and `convert`, that sees protobuf: requests are checked against their bounds
//! (`Services::checked`), converted to domain calls on [`Node`], and every answer and every
//! domain error is converted in `convert`. Every request passes [`auth::AuthLayer`] first: the
//! caller's role must allow the method, and handlers take the caller's identity from it, never
//! from a field of the request.
use std::sync::Arc;

use tonic::{Request, Status};
use xfer_proto::v1::agent_server::AgentServer;
use xfer_proto::v1::peer_server::PeerServer;

use crate::node::Node;
use bounds::{Bounded, Bounds};
use convert::{auth_status, bound_status};

mod agent;
pub mod auth;
pub mod bounds;
pub mod client;
pub mod convert;
pub mod handshake;
mod peer;
pub mod tls;
mod tls_check;

/// Both services over one `Node`.
#[derive(Clone)]
pub struct Services {
    node: Arc<Node>,
}

/// A server builder that pings every connection each `keepalive` and closes one whose peer
/// does not answer within another `keepalive` (`limits.grpc_keepalive`): a client whose host
/// vanished would otherwise hold its streams — a `WatchInboundRing` subscription's ring, its
/// bytes and its subscriber place, a channel's grant — until TCP gave up, if ever.
/// Concurrent streams (calls) one HTTP/2 connection may have open; more wait for one to end
/// (the client queues them), so one connection cannot fan out without bound.
const MAX_STREAMS_PER_CONNECTION: u32 = 256;

fn keepalive_server(keepalive: Option<std::time::Duration>) -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(keepalive)
        .http2_keepalive_timeout(keepalive)
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
}

impl Services {
    pub fn new(node: Arc<Node>) -> Self {
        Services { node }
    }

    /// Builds the tonic router: Agent, Peer, health and reflection; with `tls`, every connection
    /// must present a client certificate that chains to the CA, and every request must come from
    /// a role the method allows. `health` is the reporter whose status the health service (and the
    /// separate probe listener, [`health_router`]) serve.
    pub async fn router(
        self,
        max_message: usize,
        keepalive: Option<std::time::Duration>,
        tls: Option<&tls::TlsMaterial>,
        health: tonic_health::server::HealthReporter,
    ) -> Result<Router, String> {
        health.set_serving::<AgentServer<Services>>().await;
        health.set_serving::<PeerServer<Services>>().await;
        // Both reflection versions: grpcurl and grpc-java speak v1, while Python's
        // grpcio-reflection and many other tools still speak only v1alpha.
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(xfer_proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        let reflection_v1 = reflection().build_v1().map_err(|e| e.to_string())?;
        let reflection_v1alpha = reflection().build_v1alpha().map_err(|e| e.to_string())?;
        let server = keepalive_server(keepalive);
        let auth = match tls {
            // The TLS handshake is the incoming stream's ([`handshake::tls_incoming`]), so that
            // refused handshakes are counted; the server sees finished TLS streams.
            Some(t) => auth::Authenticator::Tls(t.policy.clone()),
            None => auth::Authenticator::Plaintext,
        };
        Ok(server
            .layer(tower::util::MapResponseLayer::new(oversized_is_resource_exhausted as OversizeFn))
            .layer(auth::AuthLayer::new(auth, auth_status))
            .tcp_nodelay(true)
            .add_service(health_service(&health))
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(AgentServer::new(self.clone()).max_decoding_message_size(max_message).max_encoding_message_size(max_message))
            .add_service(PeerServer::new(self).max_decoding_message_size(max_message).max_encoding_message_size(max_message)))
    }
}

impl Services {
    /// The router of the local unix socket (`unix_listen`): `xfer.v1.Agent`, health and
    /// reflection, no TLS, every caller a client known by its uid ([`auth::Authenticator::Local`]).
    /// `xfer.v1.Peer` is not served there: peers are other nodes.
    pub fn local_router(
        self,
        max_message: usize,
        keepalive: Option<std::time::Duration>,
        health: &tonic_health::server::HealthReporter,
    ) -> Result<Router, String> {
        let reflection = || {
            tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(xfer_proto::FILE_DESCRIPTOR_SET)
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        };
        Ok(keepalive_server(keepalive)
            .layer(tower::util::MapResponseLayer::new(oversized_is_resource_exhausted as OversizeFn))
            .layer(auth::AuthLayer::new(auth::Authenticator::Local, auth_status))
            .add_service(health_service(health))
            .add_service(reflection().build_v1().map_err(|e| e.to_string())?)
            .add_service(reflection().build_v1alpha().map_err(|e| e.to_string())?)
            .add_service(AgentServer::new(self).max_decoding_message_size(max_message).max_encoding_message_size(max_message)))
    }
}

/// The plaintext probe listener (`health_listen`): `grpc.health.v1.Health` and nothing else, so a
/// kubelet gRPC probe works with mTLS on without a client certificate.
pub fn health_router(health: &tonic_health::server::HealthReporter) -> tonic::transport::server::Router {
    tonic::transport::Server::builder().add_service(health_service(health))
}

fn health_service(
    health: &tonic_health::server::HealthReporter,
) -> tonic_health::pb::health_server::HealthServer<tonic_health::server::HealthService> {
    tonic_health::pb::health_server::HealthServer::new(tonic_health::server::HealthService::from_health_reporter(health.clone()))
}

type OversizeFn = fn(http::Response<tonic::body::Body>) -> http::Response<tonic::body::Body>;

/// The router with the role check and the status-rewriting layer below.
pub type Router = tonic::transport::server::Router<
    tower::layer::util::Stack<
        auth::AuthLayer,
        tower::layer::util::Stack<tower::util::MapResponseLayer<OversizeFn>, tower::layer::util::Identity>,
    >,
>;

/// tonic refuses a message over `limits.max_message_size` while decoding, before any handler
/// runs, with OUT_OF_RANGE. The design (and gRPC's reference implementations) call that
/// RESOURCE_EXHAUSTED: rewrite exactly that status, leaving every other one alone.
fn oversized_is_resource_exhausted(mut resp: http::Response<tonic::body::Body>) -> http::Response<tonic::body::Body> {
    let h = resp.headers();
    let out_of_range = h.get("grpc-status").is_some_and(|v| v.as_bytes() == b"11");
    let too_large = h.get("grpc-message").is_some_and(|v| {
        let m = String::from_utf8_lossy(v.as_bytes()).replace("%20", " ");
        m.contains("message length too large")
    });
    if out_of_range && too_large {
        resp.headers_mut().insert("grpc-status", http::HeaderValue::from_static("8"));
    }
    resp
}

/// The caller [`auth::AuthLayer`] authenticated. Every request passes that layer, so a missing
/// caller means the service was mounted without it: refuse rather than guess.
fn caller_of<T>(req: &Request<T>) -> Result<auth::Caller, Status> {
    auth::caller(req).cloned().ok_or_else(|| auth_status(auth::AuthError::NoCertificate))
}

impl Services {
    /// The bounds this agent applies.
    fn bounds(&self) -> Bounds {
        Bounds { max_tag: self.node.max_notify_bytes(), max_segments: self.node.max_segments() }
    }

    /// The request's message, once every field is within its bound.
    fn checked<T: Bounded>(&self, req: Request<T>) -> Result<T, Status> {
        let m = req.into_inner();
        m.check(&self.bounds()).map_err(bound_status)?;
        Ok(m)
    }

    /// One message of a request stream, once every field is within its bound.
    fn checked_msg<T: Bounded>(&self, m: T) -> Result<T, Status> {
        m.check(&self.bounds()).map_err(bound_status)?;
        Ok(m)
    }

    /// [`Services::checked`] for a request whose metadata the handler still needs.
    fn checked_ref<'a, T: Bounded>(&self, req: &'a Request<T>) -> Result<&'a T, Status> {
        req.get_ref().check(&self.bounds()).map_err(bound_status)?;
        Ok(req.get_ref())
    }
}
