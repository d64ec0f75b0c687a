//! gRPC services: `xfer.v1.Agent` (xferctl and local apps) and `xfer.v1.Peer` (agent to agent),
//! plus health and reflection. The only place, with `client` and `convert`, that sees protobuf:
//! requests are validated and converted to domain calls on [`Node`], and every domain error is
//! mapped to a status in `convert`. Every request passes [`auth::AuthLayer`] first: the caller's
//! role must allow the method, and handlers take the caller's identity from it, never from a
//! field of the request.
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, info_span, warn, Instrument};
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_server::{Agent, AgentServer};
use xfer_proto::v1::peer_server::{Peer, PeerServer};

use crate::bench::BenchParams;
use crate::node::Node;
use crate::regions::RegionError;
use crate::tenants::Tenant;

pub mod auth;
pub mod bounds;
pub mod client;
pub mod convert;
pub mod tls;

use bounds::Bounded;
use convert::*;

type Stream2<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Channel requests read ahead of the batch running (each with a list of at most
/// `transfer.max_segments`): enough to keep the channel busy, few enough that a caller that
/// never reads its answers pins little memory.
const CHANNEL_INPUT_QUEUE: usize = 4;

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
        let mut server = keepalive_server(keepalive);
        let auth = match tls {
            Some(t) => {
                server = server.tls_config(t.server_config()).map_err(|e| format!("TLS: {e}"))?;
                auth::Authenticator::Tls(t.policy.clone())
            }
            None => auth::Authenticator::Plaintext,
        };
        Ok(server
            .layer(tower::util::MapResponseLayer::new(oversized_is_resource_exhausted as OversizeFn))
            .layer(auth::AuthLayer::new(auth))
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
            .layer(auth::AuthLayer::new(auth::Authenticator::Local))
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

#[tonic::async_trait]
impl Agent for Services {
    async fn get_info(&self, _: Request<pb::GetInfoRequest>) -> Result<Response<pb::AgentInfo>, Status> {
        let n = &self.node;
        let info = n.fabric_info();
        let (soft, hard) = crate::sys::memlock();
        let (regions, registered) = n.region_totals();
        Ok(Response::new(pb::AgentInfo {
            node_name: n.node_name().to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            fabric: fabric_to_pb(info.kind) as i32,
            fabric_reason: n.fabric_reason().to_string(),
            devices: info
                .devices
                .iter()
                .map(|d| pb::DeviceInfo {
                    name: d.name.clone(),
                    port: d.port,
                    state: d.state.clone(),
                    link_layer: d.link_layer.clone(),
                    active_mtu: d.active_mtu,
                    lid: d.lid,
                    gids: d
                        .gids
                        .iter()
                        .map(|g| pb::Gid { index: g.index, raw: g.raw.to_vec(), r#type: g.gid_type.clone(), netdev: g.netdev.clone() })
                        .collect(),
                    selected_gid_index: d.selected_gid_index.map(|i| i as i32).unwrap_or(-1),
                })
                .collect(),
            limits: Some(pb::Limits {
                memlock_soft: soft,
                memlock_hard: hard,
                cap_ipc_lock: crate::sys::cap_ipc_lock(),
                max_regions: n.limits().max_regions as u32,
                max_registered_bytes: n.limits().max_registered_bytes.0,
                max_transfers: n.limits().max_transfers as u32,
            }),
            uptime: Some(duration_to_pb(n.uptime())),
            data_address: info.data_address.map(|a| a.to_string()).unwrap_or_default(),
            regions: regions as u32,
            registered_bytes: registered,
        }))
    }

    async fn create_region(&self, req: Request<pb::CreateRegionRequest>) -> Result<Response<pb::Region>, Status> {
        let tenant = Tenant::of(&caller_of(&req)?);
        let spec = region_spec_from_pb(self.checked(req)?)?;
        let node = self.node.clone();
        // Mapping and registration can take long for big regions: keep them off the reactor.
        let region =
            tokio::task::spawn_blocking(move || node.create_region_as(spec, &tenant)).await.map_err(join_status)?.map_err(region_status)?;
        Ok(Response::new(region_to_pb(&region)))
    }

    async fn delete_region(&self, req: Request<pb::DeleteRegionRequest>) -> Result<Response<pb::DeleteRegionResponse>, Status> {
        let node = self.node.clone();
        let name = self.checked(req)?.name;
        // The catalog write fsyncs: keep it off the reactor.
        tokio::task::spawn_blocking(move || node.delete_region(&name)).await.map_err(join_status)?.map_err(region_status)?;
        Ok(Response::new(pb::DeleteRegionResponse {}))
    }

    async fn list_regions(&self, req: Request<pb::ListRegionsRequest>) -> Result<Response<pb::ListRegionsResponse>, Status> {
        let sel = self.checked(req)?.label_selector.into_iter().collect();
        let regions = self.node.list_regions(&sel).iter().map(region_view_to_pb).collect();
        Ok(Response::new(pb::ListRegionsResponse { regions }))
    }

    async fn get_region(&self, req: Request<pb::GetRegionRequest>) -> Result<Response<pb::Region>, Status> {
        let r = self.node.describe_region(&self.checked(req)?.name).map_err(region_status)?;
        Ok(Response::new(region_view_to_pb(&r)))
    }

    async fn write_region(&self, req: Request<Streaming<pb::WriteRegionRequest>>) -> Result<Response<pb::WriteRegionResponse>, Status> {
        let tenant = Tenant::of(&caller_of(&req)?);
        let _slot = self.node.byte_stream_slot(&tenant).map_err(transfer_status)?;
        let mut stream = req.into_inner();
        let first = self.checked_msg(stream.message().await?.ok_or_else(|| invalid("empty WriteRegion stream"))?)?;
        require(!first.region.is_empty(), "the first WriteRegion message must name the region")?;
        let use_ = self.node.use_region(&first.region).map_err(region_status)?;
        let region = &use_.0;
        if !region.memory.writable() {
            return Err(region_status(RegionError::Denied(format!("region {:?} is mapped read-only", region.name))));
        }
        let mut offset = first.offset;
        let mut written = 0u64;
        let mut msg = Some(first);
        while let Some(m) = msg {
            if !m.data.is_empty() {
                region.check_range(offset, m.data.len() as u64).map_err(region_status)?;
                // Checks for a shrunken file after the copy: refused, not acknowledged.
                region.memory.write_at(offset, &m.data).map_err(|e| region_status(region.mem_error(e)))?;
                offset += m.data.len() as u64;
                written += m.data.len() as u64;
            }
            msg = stream.message().await?.map(|m| self.checked_msg(m)).transpose()?;
        }
        Ok(Response::new(pb::WriteRegionResponse { bytes_written: written }))
    }

    type ReadRegionStream = Stream2<pb::ReadRegionResponse>;

    async fn read_region(&self, req: Request<pb::ReadRegionRequest>) -> Result<Response<Self::ReadRegionStream>, Status> {
        let tenant = Tenant::of(&caller_of(&req)?);
        let r = self.checked(req)?;
        // Held by the stream's state: a client that never reads holds its place, not more.
        let slot = self.node.byte_stream_slot(&tenant).map_err(transfer_status)?;
        let use_ = self.node.use_region(&r.region).map_err(region_status)?;
        let region = &use_.0;
        let len = if r.length == 0 { region.length.saturating_sub(r.offset) } else { r.length };
        region.check_range(r.offset, len).map_err(region_status)?;
        const PIECE: u64 = 1 << 20;
        let stream = futures::stream::unfold((use_, r.offset, r.offset + len, slot), move |(u, pos, end, slot)| async move {
            if pos >= end {
                return None;
            }
            let n = (end - pos).min(PIECE);
            let mut buf = vec![0u8; n as usize];
            // read_at checks for a shrunken file after the copy: zeros standing in for missing
            // pages are never sent (FAILED_PRECONDITION naming the region instead).
            let item = u.0.memory.read_at(pos, &mut buf).map(|_| pb::ReadRegionResponse { offset: pos, data: buf });
            Some((item.map_err(|e| region_status(u.0.mem_error(e))), (u, pos + n, end, slot)))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn checksum(&self, req: Request<pb::ChecksumRequest>) -> Result<Response<pb::ChecksumResponse>, Status> {
        let r = self.checked(req)?;
        let algo = algo_from_pb(r.algo)?;
        let u = self.node.use_region(&r.region).map_err(region_status)?;
        let region = u.0.clone();
        let len = if r.length == 0 { region.length.saturating_sub(r.offset) } else { r.length };
        region.check_range(r.offset, len).map_err(region_status)?;
        let value = tokio::task::spawn_blocking(move || crate::checksum::checksum(&u.0.memory, r.offset, len, algo))
            .await
            .map_err(join_status)?
            .map_err(|e| region_status(region.mem_error(e)))?;
        Ok(Response::new(pb::ChecksumResponse { algo: algo_to_pb(algo) as i32, value }))
    }

    async fn submit_transfer(&self, req: Request<pb::SubmitTransferRequest>) -> Result<Response<pb::Transfer>, Status> {
        let tenant = Tenant::of(&caller_of(&req)?);
        let treq = transfer_request_from_pb(self.checked(req)?)?;
        let rec = self.node.submit_as(treq, &tenant).await.map_err(transfer_status)?;
        Ok(Response::new(transfer_to_pb(&rec)))
    }

    type WatchTransferStream = Stream2<pb::Transfer>;

    async fn watch_transfer(&self, req: Request<pb::WatchTransferRequest>) -> Result<Response<Self::WatchTransferStream>, Status> {
        let h = self.node.transfer(&self.checked(req)?.id).map_err(transfer_status)?;
        let rx = h.record.subscribe();
        // First the current record, then every change; end after a terminal state.
        let stream = futures::stream::unfold((rx, false, true), |(mut rx, done, first)| async move {
            if done {
                return None;
            }
            if !first && rx.changed().await.is_err() {
                return None;
            }
            let rec = rx.borrow_and_update().clone();
            let terminal = rec.state.is_terminal();
            Some((Ok(transfer_to_pb(&rec)), (rx, terminal, false)))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    type OpenChannelStream = Stream2<pb::ChannelEvent>;

    async fn open_channel(&self, req: Request<Streaming<pb::ChannelRequest>>) -> Result<Response<Self::OpenChannelStream>, Status> {
        let tenant = Tenant::of(&caller_of(&req)?);
        let mut inbound = req.into_inner();
        let open = match inbound.message().await?.map(|m| self.checked_msg(m)).transpose()? {
            Some(pb::ChannelRequest { msg: Some(pb::channel_request::Msg::Open(o)) }) => o,
            Some(_) => return Err(invalid("the first channel message must be ChannelOpen")),
            None => return Err(invalid("the channel stream ended before ChannelOpen")),
        };
        let params = channel_params_from_pb(open)?;
        let channel = self.node.open_channel_as(params, &tenant).await.map_err(transfer_status)?;
        let opened = channel_opened_to_pb(channel.info());
        // Inputs are read by one task and served in order by another (the channel); answers
        // and a final status go out through `tx`. A bounded queue each way: a caller that posts
        // faster than the batches run is held back by HTTP/2 flow control.
        // The request queue is short and its lists at most `transfer.max_segments` long (longer
        // ones are refused as they arrive, not kept): what a caller that never reads its answers
        // makes the agent hold is a few lists, not 64 decoded messages of any size (~24 bytes
        // per segment: 6 GB for 64 messages of 16 MiB).
        let (max_segments, bounds) = (channel.max_segments(), self.bounds());
        let (in_tx, in_rx) = tokio::sync::mpsc::channel(CHANNEL_INPUT_QUEUE);
        let (out_tx, mut out_rx) = tokio::sync::mpsc::channel(64);
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<pb::ChannelEvent, Status>>(64);
        let cancel = tokio_util::sync::CancellationToken::new();
        // The caller went away (the response stream was dropped): stop the channel.
        let gone = cancel.clone();
        let watch_tx = tx.clone();
        let watcher = tokio::spawn(async move {
            watch_tx.closed().await;
            gone.cancel();
        });
        // A malformed message ends the channel with its status, after the answers to what came
        // before it.
        let bad_input: Arc<std::sync::Mutex<Option<Status>>> = Arc::default();
        let bad = bad_input.clone();
        let reader_cancel = cancel.clone();
        tokio::spawn(async move {
            loop {
                let m = tokio::select! {
                    m = inbound.message() => m,
                    _ = reader_cancel.cancelled() => break,
                };
                match m {
                    Ok(Some(m)) => match m.check(&bounds).map_err(bound_status).and_then(|()| channel_input_from_pb(m, max_segments)) {
                        Ok(i) => {
                            if in_tx.send(i).await.is_err() {
                                break;
                            }
                        }
                        Err(s) => {
                            *bad.lock().unwrap_or_else(|e| e.into_inner()) = Some(s);
                            break;
                        }
                    },
                    // Half-closed: the channel finishes what was posted and closes.
                    Ok(None) => break,
                    Err(s) => {
                        debug!(error = %s, "channel request stream failed");
                        reader_cancel.cancel();
                        break;
                    }
                }
            }
        });
        let span = info_span!("channel", id = %channel.info().id, peer = %channel.info().peer);
        tokio::spawn(
            async move {
                let _ = tx.send(Ok(opened)).await;
                let forward_tx = tx.clone();
                let forward = tokio::spawn(async move {
                    while let Some(o) = out_rx.recv().await {
                        if forward_tx.send(Ok(channel_output_to_pb(o))).await.is_err() {
                            break;
                        }
                    }
                });
                let end = channel.run(in_rx, out_tx, cancel).await;
                let _ = forward.await;
                // Its sender must go too, or the response stream would never end.
                watcher.abort();
                let bad = bad_input.lock().unwrap_or_else(|e| e.into_inner()).take();
                match end {
                    crate::node::ChannelEnd::Closed => match bad {
                        Some(s) => {
                            warn!(error = %s.message(), "channel ended on a malformed message");
                            let _ = tx.send(Err(s)).await;
                        }
                        None => info!("channel closed"),
                    },
                    crate::node::ChannelEnd::Failed(e) => {
                        warn!(error = %e, "channel ended");
                        let _ = tx.send(Err(transfer_status(e))).await;
                    }
                }
            }
            .instrument(span),
        );
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    type WatchInboundStream = Stream2<pb::Notification>;

    async fn watch_inbound(&self, req: Request<pb::WatchInboundRequest>) -> Result<Response<Self::WatchInboundStream>, Status> {
        use tokio::sync::broadcast::error::RecvError;
        let tenant = Tenant::of(&caller_of(&req)?);
        let r = self.checked(req)?;
        // The permit (the caller's share of the subscriptions) lives in the stream's state: it
        // is given back when the stream ends or the caller goes away.
        let (rx, permit) = self.node.watch_inbound_as(&r.region, r.tag.as_deref(), &tenant).map_err(transfer_status)?;
        let tag = r.tag;
        let region = r.region;
        let stream = futures::stream::unfold(Some((rx, permit)), move |st| {
            let tag = tag.clone();
            let region = region.clone();
            async move {
                let (mut rx, permit) = st?;
                loop {
                    match rx.recv().await {
                        Ok(n) => {
                            // The subscription is the region's already; the tag is filtered here.
                            if tag.as_ref().is_some_and(|t| *t != n.tag) {
                                continue;
                            }
                            return Some((Ok(notification_to_pb(&n)), Some((rx, permit))));
                        }
                        Err(RecvError::Lagged(k)) => return Some((Err(lagged_status(k)), None)),
                        // A region's channel closes when the region ends (deleted, lease over):
                        // nothing more can come, and the subscriber is told why.
                        Err(RecvError::Closed) if !region.is_empty() => {
                            return Some((Err(region_status(RegionError::NotFound(region))), None))
                        }
                        Err(RecvError::Closed) => return None,
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    type WatchInboundRingStream = Stream2<pb::InboundRing>;

    async fn watch_inbound_ring(
        &self,
        req: Request<pb::WatchInboundRingRequest>,
    ) -> Result<Response<Self::WatchInboundRingStream>, Status> {
        let tenant = Tenant::of(&caller_of(&req)?);
        let r = self.checked(req)?;
        let (ring, permit) = self.node.watch_inbound_ring_as(&r.region, r.tag.as_deref(), r.slots, &tenant).map_err(transfer_status)?;
        let first = inbound_ring_to_pb(&ring);
        info!(object = %ring.object, slots = ring.slots, "notification ring opened");
        // One message, then the stream stays open holding the ring: when the caller closes it
        // (or goes away), tonic drops the stream and with it the ring and its object. A ring the
        // agent can no longer write ends the stream with DATA_LOSS.
        let stream = futures::stream::unfold(Some(((ring, permit), Some(first))), |st| async move {
            let ((ring, permit), first) = st?;
            match first {
                Some(m) => Some((Ok(m), Some(((ring, permit), None)))),
                None => {
                    let why = ring.failed().await;
                    warn!(object = %ring.object, "notification ring failed: {why}");
                    Some((Err(ring_failed_status(&why)), None))
                }
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_transfer(&self, req: Request<pb::GetTransferRequest>) -> Result<Response<pb::Transfer>, Status> {
        let h = self.node.transfer(&self.checked(req)?.id).map_err(transfer_status)?;
        Ok(Response::new(transfer_to_pb(&h.snapshot())))
    }

    async fn list_transfers(&self, _: Request<pb::ListTransfersRequest>) -> Result<Response<pb::ListTransfersResponse>, Status> {
        let transfers = self.node.list_transfers().iter().map(transfer_to_pb).collect();
        Ok(Response::new(pb::ListTransfersResponse { transfers }))
    }

    async fn cancel_transfer(&self, req: Request<pb::CancelTransferRequest>) -> Result<Response<pb::Transfer>, Status> {
        let rec = self.node.cancel(&self.checked(req)?.id).map_err(transfer_status)?;
        Ok(Response::new(transfer_to_pb(&rec)))
    }

    async fn connect(&self, req: Request<pb::ConnectRequest>) -> Result<Response<pb::PeerInfo>, Status> {
        let tenant = Tenant::of(&caller_of(&req)?);
        let r = self.checked(req)?;
        require(!r.peer.is_empty(), "peer address is required")?;
        peer_address(&r.peer)?;
        // Same bound as SubmitTransfer: the fabric allocates per QP (an unchecked 2^32-1 made the
        // tcp fabric's stream vector abort the agent). 0 = the configured default.
        if r.qps != 0 {
            crate::shape::qps(r.qps as usize).map_err(|e| transfer_status(e.into()))?;
        }
        let peer = self.node.connect_peer(&r.peer, r.qps as usize, &tenant).await.map_err(peer_status)?;
        Ok(Response::new(peer_info(&self.node, &peer)))
    }

    async fn list_peers(&self, _: Request<pb::ListPeersRequest>) -> Result<Response<pb::ListPeersResponse>, Status> {
        let peers = self.node.peers().iter().map(|p| peer_info(&self.node, p)).collect();
        Ok(Response::new(pb::ListPeersResponse { peers }))
    }

    async fn bench(&self, req: Request<pb::BenchRequest>) -> Result<Response<pb::BenchResponse>, Status> {
        let r = self.checked(req)?;
        require(!r.peer.is_empty(), "peer address is required")?;
        peer_address(&r.peer)?;
        // 0 = the agent's default; otherwise the bounds SubmitTransfer applies.
        if r.qps != 0 {
            crate::shape::qps(r.qps as usize).map_err(|e| transfer_status(e.into()))?;
        }
        if r.depth != 0 {
            crate::shape::depth(r.depth as usize).map_err(|e| transfer_status(e.into()))?;
        }
        let p = BenchParams {
            peer: r.peer,
            op: op_from_pb(r.op).unwrap_or(crate::transfer::Op::Write),
            size: r.size,
            iters: r.iters,
            qps: r.qps as usize,
            depth: r.depth as usize,
            blocks: r.blocks,
            pool: r.pool,
            channel: r.channel,
            connections: r.connections,
            hold: std::time::Duration::from_millis(u64::from(r.hold_ms)),
            interval: std::time::Duration::from_millis(u64::from(r.interval_ms)),
        };
        let b = crate::bench::run(&self.node, p).await.map_err(transfer_status)?;
        Ok(Response::new(pb::BenchResponse {
            size: b.size,
            iters: b.iters,
            bytes: b.bytes,
            seconds: b.seconds,
            gbit_per_s: if b.seconds > 0.0 { b.bytes as f64 * 8.0 / b.seconds / 1e9 } else { 0.0 },
            lat_avg_us: b.lat_avg_us,
            lat_p50_us: b.lat_p50_us,
            lat_p99_us: b.lat_p99_us,
            lat_iters: b.lat_iters,
            fabric: fabric_to_pb(self.node.fabric_kind()) as i32,
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
        }))
    }

    async fn tcp_baseline(&self, req: Request<pb::TcpBaselineRequest>) -> Result<Response<pb::TcpBaselineResponse>, Status> {
        let r = self.checked(req)?;
        require(!r.peer.is_empty(), "peer address is required")?;
        peer_address(&r.peer)?;
        let bytes = if r.bytes == 0 { 256 << 20 } else { r.bytes.min(64 << 30) };
        let (bytes, seconds) =
            crate::bench::tcp_baseline(&self.node, &r.peer, bytes, r.connections, if r.block == 0 { 1 << 20 } else { r.block })
                .await
                .map_err(transfer_status)?;
        Ok(Response::new(pb::TcpBaselineResponse {
            bytes,
            seconds,
            gbit_per_s: if seconds > 0.0 { bytes as f64 * 8.0 / seconds / 1e9 } else { 0.0 },
        }))
    }
}

fn peer_info(node: &Node, p: &crate::peers::PeerEntry) -> pb::PeerInfo {
    pb::PeerInfo {
        address: p.addr.clone(),
        node_name: p.node_name(),
        fabric: fabric_to_pb(node.fabric_kind()) as i32,
        qps: p.idle_count() as u32,
        state: if p.node_name().is_empty() { "NEW".into() } else { "CONNECTED".into() },
        connect_duration: p.last_connect.lock().ok().and_then(|l| *l).map(duration_to_pb),
    }
}

#[tonic::async_trait]
impl Peer for Services {
    async fn connect(&self, req: Request<pb::PeerConnectRequest>) -> Result<Response<pb::PeerConnectResponse>, Status> {
        let peer = caller_of(&req)?.name;
        let r = self.checked(req)?;
        let (connection_id, fabric, eps) = peer_connect_from_pb(&r)?;
        // Instrumented, not entered: a guard held across the await would tag whatever else
        // this runtime thread runs meanwhile with this peer's span.
        let span = tracing::info_span!("peer", %peer);
        let mine = self.node.accept_connection(&peer, &connection_id, fabric, &eps).instrument(span).await.map_err(fabric_status)?;
        Ok(Response::new(pb::PeerConnectResponse {
            version: 1,
            node_name: self.node.node_name().to_string(),
            fabric: fabric_to_pb(self.node.fabric_kind()) as i32,
            endpoints: mine.iter().map(endpoint_to_pb).collect(),
            instance_id: self.node.instance_id().to_string(),
            max_connections: self.node.limits().max_connections_per_peer as u32,
            max_streams: self.node.streams_per_peer() as u32,
        }))
    }

    async fn grant(&self, req: Request<pb::GrantRequest>) -> Result<Response<pb::GrantResponse>, Status> {
        let peer = caller_of(&req)?.name;
        let mut p = grant_params_from_pb(self.checked(req)?)?;
        // The grant is bound to the authenticated identity, not the declared name.
        p.peer = peer;
        let g = self.node.grant(&p).await.map_err(transfer_status)?;
        let (rkey, token, qp_rkeys) = match &g.exposure.key {
            crate::fabric::RemoteKey::Rkey(k) => (*k, Vec::new(), Vec::new()),
            crate::fabric::RemoteKey::PerQp(k) => (0, Vec::new(), k.to_vec()),
            crate::fabric::RemoteKey::Token(t) => (0, t.to_vec(), Vec::new()),
        };
        Ok(Response::new(pb::GrantResponse {
            grant_id: g.id.to_string(),
            addr: g.exposure.addr,
            rkey,
            token,
            length: g.len,
            expires_at: Some(time_to_pb(g.expires_at)),
            region_id: g.region.id.clone(),
            instance_id: self.node.instance_id().to_string(),
            node_name: self.node.node_name().to_string(),
            qp_rkeys,
            notify_slot: g.notify.as_ref().map(|n| n.slot).or(g.channel.as_ref().map(|c| c.base_imm)).unwrap_or(0),
        }))
    }

    async fn announce(&self, req: Request<pb::AnnounceRequest>) -> Result<Response<pb::AnnounceResponse>, Status> {
        // Only the identity the grant was issued to may announce on it.
        let peer = caller_of(&req)?.name;
        let r = self.checked(req)?;
        require(!r.grant_id.is_empty(), "grant_id is required")?;
        self.node.announce(&r.grant_id, &peer, r.seq, r.tag).map_err(transfer_status)?;
        Ok(Response::new(pb::AnnounceResponse {}))
    }

    async fn revoke(&self, req: Request<pb::RevokeRequest>) -> Result<Response<pb::RevokeResponse>, Status> {
        // Only the identity the grant was issued to may revoke it.
        let peer = caller_of(&req)?.name;
        self.node.revoke(&self.checked_ref(&req)?.grant_id, &peer).map_err(grant_status)?;
        Ok(Response::new(pb::RevokeResponse {}))
    }

    async fn complete(&self, req: Request<pb::CompleteRequest>) -> Result<Response<pb::CompleteResponse>, Status> {
        let peer = caller_of(&req)?.name;
        let r = self.checked(req)?;
        require(!r.grant_id.is_empty(), "grant_id is required")?;
        let transfer_id = crate::ids::TransferId::parse(&r.transfer_id).map_err(|e| invalid(e.to_string()))?;
        let checksum = if r.has_checksum { Some((algo_from_pb(r.algo)?, r.checksum)) } else { None };
        let op_write = op_from_pb(r.op)? == crate::transfer::Op::Write;
        let verdict =
            self.node.complete_inbound(&transfer_id, &r.grant_id, &peer, r.bytes, op_write, checksum).await.map_err(transfer_status)?;
        Ok(Response::new(pb::CompleteResponse {
            checksum_matched: verdict.is_some_and(|v| v.0),
            checksum: verdict.map(|v| v.1).unwrap_or(0),
        }))
    }

    async fn disconnect(&self, req: Request<pb::DisconnectRequest>) -> Result<Response<pb::DisconnectResponse>, Status> {
        // Only the identity that made the connection may tear it down.
        let owner = caller_of(&req)?.name;
        // An id that is not a valid one names no connection: nothing to tear down.
        if let Ok(id) = crate::ids::ConnectionId::parse(&self.checked_ref(&req)?.connection_id) {
            self.node.disconnect(&id, &owner);
        }
        Ok(Response::new(pb::DisconnectResponse {}))
    }

    async fn open_sink(&self, req: Request<pb::OpenSinkRequest>) -> Result<Response<pb::OpenSinkResponse>, Status> {
        let ip = req.local_addr().map(|a| a.ip()).unwrap_or(std::net::IpAddr::from([127, 0, 0, 1]));
        let addr = crate::bench::open_sink(&self.node, ip, self.checked(req)?.connections).await.map_err(transfer_status)?;
        Ok(Response::new(pb::OpenSinkResponse { address: addr.to_string() }))
    }

    async fn open_bench_region(&self, req: Request<pb::OpenBenchRegionRequest>) -> Result<Response<pb::OpenBenchRegionResponse>, Status> {
        let owner = caller_of(&req)?.name;
        let (node, length) = (self.node.clone(), self.checked_ref(&req)?.length);
        // Mapping and registering (pinning) the scratch region can take seconds for a big pool:
        // off the runtime threads, like CreateRegion.
        let region = tokio::task::spawn_blocking(move || node.open_bench_region(&owner, length))
            .await
            .map_err(join_status)?
            .map_err(transfer_status)?;
        Ok(Response::new(pb::OpenBenchRegionResponse { region }))
    }

    async fn close_bench_region(
        &self,
        req: Request<pb::CloseBenchRegionRequest>,
    ) -> Result<Response<pb::CloseBenchRegionResponse>, Status> {
        let owner = caller_of(&req)?.name;
        let (node, region) = (self.node.clone(), self.checked_ref(&req)?.region.clone());
        // Deregistering a big region unpins its pages: off the runtime threads too.
        tokio::task::spawn_blocking(move || node.close_bench_region(&owner, &region))
            .await
            .map_err(join_status)?
            .map_err(transfer_status)?;
        Ok(Response::new(pb::CloseBenchRegionResponse {}))
    }

    async fn ping(&self, _req: Request<pb::PingRequest>) -> Result<Response<pb::PingResponse>, Status> {
        Ok(Response::new(pb::PingResponse {}))
    }
}
