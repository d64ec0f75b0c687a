//! `xfer.v1.Peer`, the service agents call on each other: connection negotiation, grants and
//! their revocation, announcements and completions of inbound transfers, and the benchmark's
//! sink and scratch regions. The caller is the authenticated node identity; a grant or a
//! connection is bound to it, never to a name the request declares.
use tonic::{Request, Response, Status};
use tracing::Instrument;
use xfer_proto::v1 as pb;
use xfer_proto::v1::peer_server::Peer;

use super::convert::{
    algo_from_pb, bench_region_to_pb, complete_to_pb, fabric_status, grant_params_from_pb, grant_status, grant_to_pb, invalid, join_status,
    op_from_pb, peer_connect_from_pb, peer_connect_to_pb, require, sink_to_pb, spans_from_pb, transfer_status, verify_batch_to_pb,
};
use super::{caller_of, Services};
use crate::node::InboundEnd;
use crate::peer_api::Walk;
use crate::transfer::Op;
use xfer_engine::ids::{ConnectionId, TransferId};

/// The agent's data-plane TLS configurations for the raw TLS baseline and its sink, read from
/// its certificate files as at start.
pub(super) fn baseline_tls(node: &crate::node::Node) -> Result<xfer_fabric::identity::tls::DataTls, crate::error::NodeError> {
    use crate::error::NodeError;
    let files =
        node.tls_files().ok_or_else(|| NodeError::Invalid("the TLS baseline needs mTLS on both agents; this one runs plaintext".into()))?;
    let material =
        super::tls::TlsMaterial::load(files).map_err(|e| NodeError::Internal(format!("loading the TLS baseline's certificates: {e}")))?;
    Ok(material.data)
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
        Ok(Response::new(peer_connect_to_pb(&self.node, &mine)))
    }

    async fn grant(&self, req: Request<pb::GrantRequest>) -> Result<Response<pb::GrantResponse>, Status> {
        let peer = caller_of(&req)?.name;
        let mut p = grant_params_from_pb(self.checked(req)?)?;
        // The grant is bound to the authenticated identity, not the declared name.
        p.peer = peer;
        let g = self.node.grant(&p).await.map_err(transfer_status)?;
        Ok(Response::new(grant_to_pb(&g, &self.node)))
    }

    async fn announce(&self, req: Request<pb::AnnounceRequest>) -> Result<Response<pb::AnnounceResponse>, Status> {
        // Only the identity the grant was issued to may announce on it.
        let peer = caller_of(&req)?.name;
        let r = self.checked(req)?;
        require(!r.grant_id.is_empty(), "grant_id is required")?;
        self.node.announce(&r.grant_id, &peer, r.seq, r.tag).map_err(transfer_status)?;
        Ok(Response::new(Default::default()))
    }

    async fn verify_batch(&self, req: Request<pb::VerifyBatchRequest>) -> Result<Response<pb::VerifyBatchResponse>, Status> {
        // Only the identity the grant was issued to may verify (and settle) its batches.
        let peer = caller_of(&req)?.name;
        let r = self.checked(req)?;
        require(!r.grant_id.is_empty(), "grant_id is required")?;
        let sum = (algo_from_pb(r.algo)?, r.checksum);
        let verdict =
            self.node.verify_batch(&r.grant_id, &peer, r.seq, sum, &spans_from_pb(&r.spans), r.settle).await.map_err(transfer_status)?;
        Ok(Response::new(verify_batch_to_pb(verdict)))
    }

    async fn revoke(&self, req: Request<pb::RevokeRequest>) -> Result<Response<pb::RevokeResponse>, Status> {
        // Only the identity the grant was issued to may revoke it.
        let peer = caller_of(&req)?.name;
        self.node.revoke(&self.checked_ref(&req)?.grant_id, &peer).map_err(grant_status)?;
        Ok(Response::new(Default::default()))
    }

    async fn complete(&self, req: Request<pb::CompleteRequest>) -> Result<Response<pb::CompleteResponse>, Status> {
        let peer = caller_of(&req)?.name;
        let r = self.checked(req)?;
        require(!r.grant_id.is_empty(), "grant_id is required")?;
        let transfer_id = TransferId::parse(&r.transfer_id).map_err(|e| invalid(e.to_string()))?;
        let checksum = if r.has_checksum { Some((algo_from_pb(r.algo)?, r.checksum)) } else { None };
        let op_write = op_from_pb(r.op)? == Op::Write;
        let spans = spans_from_pb(&r.spans);
        let verdict = self
            .node
            .complete_inbound(&transfer_id, &r.grant_id, &peer, InboundEnd { bytes: r.bytes, op_write, checksum, spans: &spans })
            .await
            .map_err(transfer_status)?;
        Ok(Response::new(complete_to_pb(verdict)))
    }

    async fn disconnect(&self, req: Request<pb::DisconnectRequest>) -> Result<Response<pb::DisconnectResponse>, Status> {
        // Only the identity that made the connection may tear it down.
        let owner = caller_of(&req)?.name;
        // An id that is not a valid one names no connection: nothing to tear down.
        if let Ok(id) = ConnectionId::parse(&self.checked_ref(&req)?.connection_id) {
            self.node.disconnect(&id, &owner);
        }
        Ok(Response::new(Default::default()))
    }

    async fn open_sink(&self, req: Request<pb::OpenSinkRequest>) -> Result<Response<pb::OpenSinkResponse>, Status> {
        let ip = req.local_addr().map(|a| a.ip()).unwrap_or(std::net::IpAddr::from([127, 0, 0, 1]));
        let r = self.checked(req)?;
        let tls = if r.tls { Some(baseline_tls(&self.node).map_err(transfer_status)?) } else { None };
        let addr = crate::bench::open_sink(&self.node, ip, r.connections, tls, Walk { pool: r.pool, scatter: r.scatter })
            .await
            .map_err(transfer_status)?;
        Ok(Response::new(sink_to_pb(addr)))
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
        Ok(Response::new(bench_region_to_pb(region)))
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
        Ok(Response::new(Default::default()))
    }

    async fn ping(&self, _req: Request<pb::PingRequest>) -> Result<Response<pb::PingResponse>, Status> {
        Ok(Response::new(Default::default()))
    }
}
