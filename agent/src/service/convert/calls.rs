//! The agent's own calls on a peer (`xfer.v1.Peer` as a client, `service::client`): the requests
//! it sends and how it reads the answers. An answer is a peer's word: every field is checked
//! here before it becomes a domain value (the peer's name and instance id are checked by the
//! client, which keeps them).
use xfer_proto::v1 as pb;

use super::peers::{endpoint_from_pb, endpoint_to_pb};
use super::scalars::{algo_to_pb, duration_to_pb, fabric_from_pb, fabric_to_pb, time_from_pb};
use crate::checksum::Algo;
use crate::peer_api::{CompleteParams, GrantAsk, GrantInfo, HandshakeReply, Walk};
use xfer_engine::ids::{ConnectionId, GrantId};
use xfer_fabric::{Endpoint, FabricKind, RemoteKey, RemoteOp};

/// Most per-QP keys accepted in a grant (a connection has at most 256 QPs).
const MAX_QP_RKEYS: usize = 256;

/// `Peer.Connect` in protocol version 1: who this agent is and its endpoints (`endpoints`) for
/// the connection `connection_id`.
pub fn peer_connect_request_to_pb(
    node_name: &str,
    fabric: FabricKind,
    endpoints: &[Endpoint],
    connection_id: &ConnectionId,
) -> pb::PeerConnectRequest {
    pb::PeerConnectRequest {
        version: 1,
        node_name: node_name.to_string(),
        fabric: fabric_to_pb(fabric) as i32,
        endpoints: endpoints.iter().map(endpoint_to_pb).collect(),
        connection_id: connection_id.to_string(),
    }
}

/// `Peer.Connect`'s answer: the responder's endpoints and fabric, each checked.
pub fn handshake_reply_from_pb(r: pb::PeerConnectResponse) -> Result<HandshakeReply, String> {
    let endpoints = r.endpoints.iter().map(endpoint_from_pb).collect::<Result<Vec<_>, String>>()?;
    let fabric = fabric_from_pb(r.fabric).ok_or("unknown fabric kind")?;
    Ok(HandshakeReply {
        node_name: r.node_name,
        instance_id: r.instance_id,
        fabric,
        endpoints,
        max_connections: r.max_connections,
        max_streams: r.max_streams,
    })
}

/// `Peer.Grant` for `ask`, asked by `node_name` on its connection `connection_id`.
pub fn grant_request_to_pb(ask: &GrantAsk<'_>, node_name: &str, connection_id: &ConnectionId) -> pb::GrantRequest {
    pb::GrantRequest {
        region: ask.region.to_string(),
        offset: ask.offset,
        length: ask.length,
        op: match ask.op {
            RemoteOp::Read => pb::Access::Read,
            RemoteOp::Write => pb::Access::Write,
        } as i32,
        ttl: Some(duration_to_pb(ask.ttl)),
        node_name: node_name.to_string(),
        connection_id: connection_id.to_string(),
        notify: ask.notify.map(|(tag, markers)| pb::NotifyRequest { tag: tag.to_vec(), markers, channel: ask.channel }),
    }
}

/// `Peer.Grant`'s answer: the key in the form the peer's fabric uses, the grant id, and a range
/// that cannot wrap the address space.
pub fn grant_info_from_pb(r: pb::GrantResponse) -> Result<GrantInfo, String> {
    let key = if !r.fallback_token.is_empty() {
        let t: [u8; 16] = r.fallback_token.as_slice().try_into().map_err(|_| "grant fallback token is not 16 bytes")?;
        if r.qp_rkeys.is_empty() || r.qp_rkeys.len() > MAX_QP_RKEYS {
            return Err(format!("grant with a fallback token carries {} per-QP keys", r.qp_rkeys.len()));
        }
        let mut keys: Vec<RemoteKey> = r.qp_rkeys.iter().map(|&k| RemoteKey::Rkey(k)).collect();
        keys.push(RemoteKey::Token(t));
        RemoteKey::Each(keys.into())
    } else if !r.token.is_empty() {
        let t: [u8; 16] = r.token.as_slice().try_into().map_err(|_| "grant token is not 16 bytes")?;
        RemoteKey::Token(t)
    } else if !r.qp_rkeys.is_empty() {
        if r.qp_rkeys.len() > MAX_QP_RKEYS {
            return Err(format!("grant carries {} per-QP keys", r.qp_rkeys.len()));
        }
        RemoteKey::PerQp(r.qp_rkeys.into())
    } else {
        RemoteKey::Rkey(r.rkey)
    };
    let grant_id = GrantId::parse(&r.grant_id).map_err(|e| e.to_string())?;
    // Work requests address `addr + offset` for offsets inside the granted length: a peer's
    // range that wraps the address space is refused here, so those sums cannot overflow.
    if r.addr.checked_add(r.length).is_none() {
        return Err(format!("grant range {:#x}+{} overflows the address space", r.addr, r.length));
    }
    Ok(GrantInfo {
        grant_id,
        addr: r.addr,
        key,
        length: r.length,
        expires_at: r.expires_at.and_then(time_from_pb),
        node_name: r.node_name,
        instance_id: r.instance_id,
        notify_slot: r.notify_slot,
    })
}

/// `Peer.Complete`: the transfer's end as the initiator saw it, with its checksum if one was
/// computed.
pub fn complete_request_to_pb(p: CompleteParams) -> pb::CompleteRequest {
    let (has_checksum, algo, checksum) = match p.checksum {
        Some((a, v)) => (true, algo_to_pb(a), v),
        None => (false, pb::ChecksumAlgo::Xxh3, 0),
    };
    pb::CompleteRequest {
        transfer_id: p.transfer_id.to_string(),
        grant_id: p.grant_id.to_string(),
        bytes: p.bytes,
        op: if p.op_write { pb::Op::Write } else { pb::Op::Read } as i32,
        node_name: p.node_name,
        has_checksum,
        checksum,
        algo: algo as i32,
        success: p.success,
        spans: p.spans.into_iter().map(|(offset, length)| pb::GrantSpan { offset, length }).collect(),
    }
}

/// `Peer.VerifyBatch`: batch `seq` of a channel's grant, its checksum and what it covers.
pub fn verify_batch_request_to_pb(
    grant_id: &GrantId,
    seq: u64,
    sum: (Algo, u64),
    spans: Vec<(u64, u64)>,
    settle: bool,
) -> pb::VerifyBatchRequest {
    pb::VerifyBatchRequest {
        grant_id: grant_id.to_string(),
        seq,
        algo: algo_to_pb(sum.0) as i32,
        checksum: sum.1,
        spans: spans.into_iter().map(|(offset, length)| pb::GrantSpan { offset, length }).collect(),
        settle,
    }
}

/// `Peer.Announce`: batch `seq` of a channel's grant, with its tag.
pub fn announce_request_to_pb(grant_id: &GrantId, seq: u64, tag: &[u8]) -> pb::AnnounceRequest {
    pb::AnnounceRequest { grant_id: grant_id.to_string(), seq, tag: tag.to_vec() }
}

/// `Peer.Disconnect` of the connection `connection_id`, made by `node_name`.
pub fn disconnect_request_to_pb(connection_id: &ConnectionId, node_name: &str) -> pb::DisconnectRequest {
    pb::DisconnectRequest { connection_id: connection_id.to_string(), node_name: node_name.to_string() }
}

/// `Peer.Revoke` of the grant `grant_id`.
pub fn revoke_request_to_pb(grant_id: &str) -> pb::RevokeRequest {
    pb::RevokeRequest { grant_id: grant_id.to_string() }
}

/// `Peer.OpenSink` (benchmark): a tcp sink taking `connections` streams.
pub fn sink_request_to_pb(connections: u32, tls: bool, walk: Walk) -> pb::OpenSinkRequest {
    pb::OpenSinkRequest { connections, tls, pool: walk.pool, scatter: walk.scatter }
}

/// `Peer.OpenBenchRegion` (benchmark): a scratch region of `length` bytes.
pub fn bench_region_request_to_pb(length: u64) -> pb::OpenBenchRegionRequest {
    pb::OpenBenchRegionRequest { length }
}

/// `Peer.CloseBenchRegion` (benchmark) of the scratch region `region`.
pub fn close_bench_region_request_to_pb(region: &str) -> pb::CloseBenchRegionRequest {
    pb::CloseBenchRegionRequest { region: region.to_string() }
}
