//! `xfer.v1.Agent`, the service xferctl and local applications call: regions, transfers,
//! channels, inbound notifications, peers and (admin-only) benchmarks. Each handler checks its
//! request's bounds, calls the [`Node`](crate::node::Node) in domain types and converts the
//! answer in `convert`; the caller's identity comes from the role check, never from a field.
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, info_span, warn, Instrument};
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_server::Agent;

use super::bounds::Bounded;
use super::convert::{
    agent_info_to_pb, algo_from_pb, bench_params_from_pb, bench_to_pb, bound_status, channel_input_from_pb, channel_open_from_pb,
    channel_opened_to_pb, channel_output_to_pb, checksum_to_pb, inbound_ring_to_pb, invalid, join_status, lagged_status,
    notification_to_pb, peer_address, peer_info_to_pb, peer_list_to_pb, peer_status, region_list_to_pb, region_piece_to_pb,
    region_spec_from_pb, region_status, region_to_pb, region_view_to_pb, region_written_to_pb, require, ring_failed_status,
    tcp_baseline_to_pb, transfer_list_to_pb, transfer_request_from_pb, transfer_status, transfer_to_pb,
};
use super::{caller_of, Services};
use crate::node::ChannelEnd;
use crate::regions::RegionError;
use crate::tenants::Tenant;

type Stream2<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Channel requests read ahead of the batch running (each with a list of at most
/// `transfer.max_segments`): enough to keep the channel busy, few enough that a caller that
/// never reads its answers pins little memory.
const CHANNEL_INPUT_QUEUE: usize = 4;

#[tonic::async_trait]
impl Agent for Services {
    async fn get_info(&self, _: Request<pb::GetInfoRequest>) -> Result<Response<pb::AgentInfo>, Status> {
        Ok(Response::new(agent_info_to_pb(&self.node, crate::sys::memlock(), crate::sys::cap_ipc_lock())))
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
        Ok(Response::new(Default::default()))
    }

    async fn list_regions(&self, req: Request<pb::ListRegionsRequest>) -> Result<Response<pb::ListRegionsResponse>, Status> {
        let sel = self.checked(req)?.label_selector.into_iter().collect();
        Ok(Response::new(region_list_to_pb(&self.node.list_regions(&sel))))
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
        Ok(Response::new(region_written_to_pb(written)))
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
            let item = u.0.memory.read_at(pos, &mut buf).map(|_| region_piece_to_pb(pos, buf));
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
        Ok(Response::new(checksum_to_pb(algo, value)))
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
        let params = channel_open_from_pb(inbound.message().await?.map(|m| self.checked_msg(m)).transpose()?)?;
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
                    ChannelEnd::Closed => match bad {
                        Some(s) => {
                            warn!(error = %s.message(), "channel ended on a malformed message");
                            let _ = tx.send(Err(s)).await;
                        }
                        None => info!("channel closed"),
                    },
                    ChannelEnd::Failed(e) => {
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
        Ok(Response::new(transfer_list_to_pb(&self.node.list_transfers())))
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
            xfer_engine::shape::qps(r.qps as usize).map_err(|e| transfer_status(e.into()))?;
        }
        let peer = self.node.connect_peer(&r.peer, r.qps as usize, &tenant).await.map_err(peer_status)?;
        Ok(Response::new(peer_info_to_pb(&peer, self.node.fabric_kind())))
    }

    async fn list_peers(&self, _: Request<pb::ListPeersRequest>) -> Result<Response<pb::ListPeersResponse>, Status> {
        Ok(Response::new(peer_list_to_pb(&self.node.peers(), self.node.fabric_kind())))
    }

    async fn bench(&self, req: Request<pb::BenchRequest>) -> Result<Response<pb::BenchResponse>, Status> {
        let p = bench_params_from_pb(self.checked(req)?)?;
        let b = crate::bench::run(&self.node, p).await.map_err(transfer_status)?;
        Ok(Response::new(bench_to_pb(&b, self.node.fabric_kind())))
    }

    async fn tcp_baseline(&self, req: Request<pb::TcpBaselineRequest>) -> Result<Response<pb::TcpBaselineResponse>, Status> {
        let r = self.checked(req)?;
        require(!r.peer.is_empty(), "peer address is required")?;
        peer_address(&r.peer)?;
        let bytes = if r.bytes == 0 { 256 << 20 } else { r.bytes.min(64 << 30) };
        let tls = if r.tls { Some(super::peer::baseline_tls(&self.node).map_err(transfer_status)?) } else { None };
        let (bytes, seconds) = crate::bench::tcp_baseline(
            &self.node,
            &r.peer,
            bytes,
            r.connections,
            if r.block == 0 { 1 << 20 } else { r.block },
            tls,
            crate::peer_api::Walk { pool: r.pool, scatter: r.scatter },
        )
        .await
        .map_err(transfer_status)?;
        Ok(Response::new(tcp_baseline_to_pb(bytes, seconds)))
    }
}
