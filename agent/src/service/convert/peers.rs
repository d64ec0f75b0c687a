//! Peers and grants on the wire: addresses and connection ids a caller names, the endpoints of
//! `Peer.Connect` (every field a peer sent is checked, nothing is trusted), `Peer.Grant` both
//! ways, `Peer.Complete`'s answer and the peer pool as `ListPeers` shows it.
use tonic::Status;
use xfer_proto::v1 as pb;

use super::scalars::{duration_to_pb, fabric_from_pb, fabric_to_pb, request_duration, time_to_pb};
use crate::service::bounds::MAX_ENDPOINT_WORD;

use super::status::{invalid, peer_version_status, require, too_many_endpoints_status};
use crate::grants::Grant;
use crate::node::{GrantParams, Node, NotifyAsk};
use crate::peers::PeerEntry;
use xfer_engine::ids::ConnectionId;
use xfer_fabric::{DataSecret, Endpoint, FabricKind, RemoteKey, RemoteOp, VerbsEndpoint};

/// Most endpoints (QPs) one `Peer.Connect` may carry.
const MAX_QPS_PER_CONNECTION: usize = 64;

/// A peer address as a caller sent it: refused here, before any region, slot or dial is looked
/// at, unless it parses (`crate::peer_addr`); the pool canonicalizes it again when it keys.
pub fn peer_address(addr: &str) -> Result<(), Status> {
    crate::peer_addr::PeerAddr::parse(addr).map(|_| ()).map_err(|e| invalid(e.to_string()))
}

/// A connection id from a peer (INVALID_ARGUMENT unless 1-64 characters of `[A-Za-z0-9_.-]`).
pub fn connection_id_from_pb(id: &str) -> Result<ConnectionId, Status> {
    ConnectionId::parse(id).map_err(|e| invalid(e.to_string()))
}

pub fn endpoint_to_pb(e: &Endpoint) -> pb::Endpoint {
    let kind = match e {
        Endpoint::Tcp { address, secret } => pb::endpoint::Kind::Tcp(pb::TcpEndpoint {
            address: address.to_string(),
            secret: secret.map(|s| s.0.to_vec()).unwrap_or_default(),
        }),
        Endpoint::Verbs(v) => pb::endpoint::Kind::Verbs(pb::VerbsEndpoint {
            qpn: v.qpn,
            psn: v.psn,
            gid: v.gid.to_vec(),
            gid_index: v.gid_index,
            lid: v.lid,
            port: v.port,
            mtu: v.mtu,
            max_rd_atomic: v.max_rd_atomic,
            gid_type: v.gid_type.clone(),
            link_layer: v.link_layer.clone(),
            rail: v.rail,
            device: v.device.clone(),
            ipv4_prefix: v.ipv4_prefix,
        }),
    };
    pb::Endpoint { kind: Some(kind) }
}

/// Validates what a peer sent: every field is checked, nothing is trusted.
pub fn endpoint_from_pb(e: &pb::Endpoint) -> Result<Endpoint, String> {
    match &e.kind {
        Some(pb::endpoint::Kind::Tcp(t)) => {
            let address = t.address.parse().map_err(|_| format!("invalid tcp data address {:?}", t.address))?;
            let secret = match t.secret.len() {
                0 => None,
                32 => t.secret.as_slice().try_into().ok().map(DataSecret),
                n => return Err(format!("tcp data secret must be 32 bytes, got {n}")),
            };
            Ok(Endpoint::Tcp { address, secret })
        }
        Some(pb::endpoint::Kind::Verbs(v)) => {
            let gid: [u8; 16] = v.gid.as_slice().try_into().map_err(|_| format!("GID must be 16 bytes, got {}", v.gid.len()))?;
            if v.qpn == 0 || v.qpn > 0x00ff_ffff {
                return Err(format!("QPN {} is not a 24-bit non-zero value", v.qpn));
            }
            if v.psn > 0x00ff_ffff {
                return Err(format!("PSN {} is not a 24-bit value", v.psn));
            }
            if !matches!(v.mtu, 256 | 512 | 1024 | 2048 | 4096) {
                return Err(format!("MTU {} is not one of 256, 512, 1024, 2048, 4096", v.mtu));
            }
            if v.ipv4_prefix > 32 {
                return Err(format!("IPv4 prefix length {} is over 32", v.ipv4_prefix));
            }
            for (field, value) in [("device", &v.device), ("link_layer", &v.link_layer), ("gid_type", &v.gid_type)] {
                endpoint_word(field, value)?;
            }
            if v.rail as usize >= MAX_QPS_PER_CONNECTION {
                return Err(format!("rail {} is out of range (at most {} per connection)", v.rail, MAX_QPS_PER_CONNECTION));
            }
            Ok(Endpoint::Verbs(VerbsEndpoint {
                qpn: v.qpn,
                psn: v.psn,
                gid,
                gid_index: v.gid_index,
                lid: v.lid,
                port: v.port,
                mtu: v.mtu,
                max_rd_atomic: v.max_rd_atomic,
                gid_type: v.gid_type.clone(),
                link_layer: v.link_layer.clone(),
                rail: v.rail,
                device: v.device.clone(),
                ipv4_prefix: v.ipv4_prefix,
            }))
        }
        None => Err("endpoint without a kind".into()),
    }
}

/// A word of an endpoint (device name, link layer, GID type): these end up in refusals, logs
/// and `paths()`, so a peer may not put control characters or kilobytes there. Empty is
/// allowed: an older peer sends none.
fn endpoint_word(field: &str, value: &str) -> Result<(), String> {
    if value.len() > MAX_ENDPOINT_WORD {
        return Err(format!("{field} is {} bytes long; at most {MAX_ENDPOINT_WORD}", value.len()));
    }
    if let Some(c) = value.chars().find(|&c| !(c.is_ascii_graphic() || c == ' ')) {
        return Err(format!("{field} {value:?} has the character {c:?}; only printable ASCII"));
    }
    Ok(())
}

/// `Peer.Connect`: protocol version, identity and every endpoint the peer sent.
pub fn peer_connect_from_pb(r: &pb::PeerConnectRequest) -> Result<(ConnectionId, FabricKind, Vec<Endpoint>), Status> {
    if r.version != 1 {
        return Err(peer_version_status(r.version));
    }
    require(!r.node_name.is_empty(), "node_name is required")?;
    let id = connection_id_from_pb(&r.connection_id)?;
    let fabric = fabric_from_pb(r.fabric).ok_or_else(|| invalid("fabric kind is required"))?;
    let eps = r.endpoints.iter().map(endpoint_from_pb).collect::<Result<Vec<_>, String>>().map_err(invalid)?;
    if eps.len() > MAX_QPS_PER_CONNECTION {
        return Err(too_many_endpoints_status(MAX_QPS_PER_CONNECTION));
    }
    Ok((id, fabric, eps))
}

/// `Peer.Connect`'s answer: this agent's endpoints (`mine`) and what the initiator must know of it.
pub fn peer_connect_to_pb(node: &Node, mine: &[Endpoint]) -> pb::PeerConnectResponse {
    pb::PeerConnectResponse {
        version: 1,
        node_name: node.node_name().to_string(),
        fabric: fabric_to_pb(node.fabric_kind()) as i32,
        endpoints: mine.iter().map(endpoint_to_pb).collect(),
        instance_id: node.instance_id().to_string(),
        max_connections: node.limits().max_connections_per_peer as u32,
        max_streams: node.streams_per_peer() as u32,
    }
}

/// `Peer.Grant`: required fields, the operation and the ttl.
pub fn grant_params_from_pb(r: pb::GrantRequest) -> Result<GrantParams, Status> {
    require(!r.region.is_empty(), "region is required")?;
    require(!r.node_name.is_empty(), "node_name is required")?;
    let op = match pb::Access::try_from(r.op) {
        Ok(pb::Access::Read) => RemoteOp::Read,
        Ok(pb::Access::Write) => RemoteOp::Write,
        _ => return Err(invalid("grant op must be ACCESS_READ or ACCESS_WRITE")),
    };
    let ttl = request_duration(r.ttl.as_ref(), "ttl")?;
    let connection_id = match r.connection_id.as_str() {
        "" => None,
        id => Some(connection_id_from_pb(id)?),
    };
    let notify = r.notify.map(|n| match n.channel {
        true => NotifyAsk::Channel { markers: n.markers },
        false => NotifyAsk::Once { tag: n.tag, markers: n.markers },
    });
    Ok(GrantParams { region: r.region, offset: r.offset, length: r.length, op, ttl, peer: r.node_name, connection_id, notify })
}

/// `Peer.Grant`'s answer: the grant's key in the form its fabric uses (one rkey, one per QP, or
/// a tcp token), and who issued it (`node`).
pub fn grant_to_pb(g: &Grant, node: &Node) -> pb::GrantResponse {
    let (rkey, token, qp_rkeys, fallback_token) = match &g.exposure.key {
        RemoteKey::Rkey(k) => (*k, Vec::new(), Vec::new(), Vec::new()),
        RemoteKey::PerQp(k) => (0, Vec::new(), k.to_vec(), Vec::new()),
        RemoteKey::Token(t) => (0, t.to_vec(), Vec::new(), Vec::new()),
        RemoteKey::Each(keys) => {
            let (rkeys, token) = each_to_pb(keys);
            (0, Vec::new(), rkeys, token)
        }
    };
    pb::GrantResponse {
        grant_id: g.id.to_string(),
        addr: g.exposure.addr,
        rkey,
        token,
        length: g.len,
        expires_at: Some(time_to_pb(g.expires_at)),
        region_id: g.region.id.clone(),
        instance_id: node.instance_id().to_string(),
        node_name: node.node_name().to_string(),
        qp_rkeys,
        fallback_token,
        notify_slot: g.notify.as_ref().map(|n| n.slot).or(g.channel.as_ref().map(|c| c.base_imm)).unwrap_or(0),
    }
}

/// A key per QP with a tcp fallback token (what the rails fabric makes: the devices' rkeys, then
/// the token) as `qp_rkeys` and `fallback_token`.
pub fn each_to_pb(keys: &[RemoteKey]) -> (Vec<u32>, Vec<u8>) {
    let mut rkeys = Vec::with_capacity(keys.len());
    let mut token = Vec::new();
    for k in keys {
        match k {
            RemoteKey::Rkey(r) => rkeys.push(*r),
            RemoteKey::Token(t) => token = t.to_vec(),
            RemoteKey::PerQp(_) | RemoteKey::Each(_) => {}
        }
    }
    (rkeys, token)
}

/// `Peer.Complete`'s answer: `verdict` is (matched, this side's checksum) when one was compared.
/// The spans a checksum covers, as (offset from the grant's start, length).
pub fn spans_from_pb(spans: &[pb::GrantSpan]) -> Vec<(u64, u64)> {
    spans.iter().map(|s| (s.offset, s.length)).collect()
}

pub fn verify_batch_to_pb(verdict: (bool, u64)) -> pb::VerifyBatchResponse {
    pb::VerifyBatchResponse { checksum_matched: verdict.0, checksum: verdict.1 }
}

pub fn complete_to_pb(verdict: Option<(bool, u64)>) -> pb::CompleteResponse {
    pb::CompleteResponse { checksum_matched: verdict.is_some_and(|v| v.0), checksum: verdict.map(|v| v.1).unwrap_or(0) }
}

/// One entry of the peer pool, on a node whose fabric is `fabric`.
pub fn peer_info_to_pb(p: &PeerEntry, fabric: FabricKind) -> pb::PeerInfo {
    pb::PeerInfo {
        address: p.addr.clone(),
        node_name: p.node_name(),
        fabric: fabric_to_pb(fabric) as i32,
        qps: p.idle_count() as u32,
        state: match (p.last_failure(), p.node_name().is_empty()) {
            (Some(_), _) => "FAILED".into(),
            (None, true) => "NEW".into(),
            (None, false) => "CONNECTED".into(),
        },
        connect_duration: p.last_connect.lock().ok().and_then(|l| *l).map(duration_to_pb),
        error: p.last_failure().unwrap_or_default(),
    }
}

/// `Agent.ListPeers`' answer.
pub fn peer_list_to_pb(peers: &[std::sync::Arc<PeerEntry>], fabric: FabricKind) -> pb::ListPeersResponse {
    pb::ListPeersResponse { peers: peers.iter().map(|p| peer_info_to_pb(p, fabric)).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_endpoints_are_validated() {
        let mut v = pb::VerbsEndpoint { qpn: 17, psn: 5, gid: vec![0; 16], mtu: 4096, ..Default::default() };
        let ok = pb::Endpoint { kind: Some(pb::endpoint::Kind::Verbs(v.clone())) };
        assert!(endpoint_from_pb(&ok).is_ok());
        v.gid = vec![0; 15];
        assert!(endpoint_from_pb(&pb::Endpoint { kind: Some(pb::endpoint::Kind::Verbs(v.clone())) }).unwrap_err().contains("GID"));
        v.gid = vec![0; 16];
        v.psn = 1 << 24;
        assert!(endpoint_from_pb(&pb::Endpoint { kind: Some(pb::endpoint::Kind::Verbs(v.clone())) }).unwrap_err().contains("PSN"));
        v.psn = 1;
        v.mtu = 1500;
        assert!(endpoint_from_pb(&pb::Endpoint { kind: Some(pb::endpoint::Kind::Verbs(v)) }).unwrap_err().contains("MTU"));
        assert!(endpoint_from_pb(&pb::Endpoint { kind: None }).is_err());
        let t = pb::Endpoint { kind: Some(pb::endpoint::Kind::Tcp(pb::TcpEndpoint { address: "nope".into(), secret: Vec::new() })) };
        assert!(endpoint_from_pb(&t).is_err());
    }

    #[test]
    fn an_endpoints_rail_device_and_prefix_cross_the_wire() {
        let e =
            Endpoint::Verbs(VerbsEndpoint { qpn: 9, mtu: 1024, rail: 1, device: "mlx5_1".into(), ipv4_prefix: 24, ..Default::default() });
        assert_eq!(endpoint_from_pb(&endpoint_to_pb(&e)).unwrap(), e);
        let mut v = pb::VerbsEndpoint { qpn: 17, gid: vec![0; 16], mtu: 4096, ipv4_prefix: 33, ..Default::default() };
        let bad = |v: &pb::VerbsEndpoint| endpoint_from_pb(&pb::Endpoint { kind: Some(pb::endpoint::Kind::Verbs(v.clone())) }).unwrap_err();
        assert!(bad(&v).contains("prefix"));
        v.ipv4_prefix = 0;
        v.rail = MAX_QPS_PER_CONNECTION as u32;
        assert!(bad(&v).contains("rail"));
    }

    #[test]
    fn a_tcp_fallback_request_crosses_the_wire_as_itself() {
        let req = Endpoint::tcp_fallback_request();
        let back = endpoint_from_pb(&endpoint_to_pb(&req)).unwrap();
        assert!(back.is_tcp_fallback_request(), "{back:?}");
    }

    #[test]
    fn a_key_with_a_fallback_token_crosses_the_wire_whole() {
        let each: Vec<RemoteKey> = vec![RemoteKey::Rkey(5), RemoteKey::Rkey(6), RemoteKey::Token([9; 16])];
        let (qp_rkeys, fallback_token) = each_to_pb(&each);
        assert_eq!((qp_rkeys.clone(), fallback_token.len()), (vec![5, 6], 16));
        let r = pb::GrantResponse { grant_id: "g-1".into(), qp_rkeys, fallback_token, length: 4096, ..Default::default() };
        let back = super::super::calls::grant_info_from_pb(r.clone()).unwrap();
        assert!(back.key == RemoteKey::Each(each.into()));
        // A token without the devices' keys, or of the wrong size, is refused.
        let mut bad = r.clone();
        bad.qp_rkeys.clear();
        assert!(super::super::calls::grant_info_from_pb(bad).is_err());
        let mut bad = r;
        bad.fallback_token = vec![1; 15];
        assert!(super::super::calls::grant_info_from_pb(bad).is_err());
    }

    /// Every endpoint field a hostile initiator picks for several devices is refused with the
    /// field's name, and what the conversion lets through is exactly what was sent.
    #[test]
    fn hostile_rail_device_and_prefix_fields_are_refused() {
        let base = pb::VerbsEndpoint { qpn: 17, gid: vec![0; 16], mtu: 4096, ..Default::default() };
        let conv = |v: &pb::VerbsEndpoint| endpoint_from_pb(&pb::Endpoint { kind: Some(pb::endpoint::Kind::Verbs(v.clone())) });
        for rail in [64, 65, 1000, u32::MAX] {
            let e = conv(&pb::VerbsEndpoint { rail, ..base.clone() }).unwrap_err();
            assert!(e.contains(&format!("rail {rail} is out of range")), "{e}");
        }
        for prefix in [33, 64, 255, u32::MAX] {
            assert!(conv(&pb::VerbsEndpoint { ipv4_prefix: prefix, ..base.clone() }).unwrap_err().contains("prefix"), "{prefix}");
        }
        for (device, why) in [
            ("rxe0\nERROR forged log line", "character"),
            ("rxe0\u{1b}[31m", "character"),
            ("rxé0", "character"),
            (&"x".repeat(33), "bytes long"),
        ] {
            let e = conv(&pb::VerbsEndpoint { device: device.to_string(), ..base.clone() }).unwrap_err();
            assert!(e.contains("device") && e.contains(why), "{device:?}: {e}");
        }
        let e = conv(&pb::VerbsEndpoint { link_layer: "E".repeat(10 << 10), ..base.clone() }).unwrap_err();
        assert!(e.contains("link_layer is 10240 bytes long"), "{e}");
        let e = conv(&pb::VerbsEndpoint { gid_type: "RoCE\tv2".into(), ..base.clone() }).unwrap_err();
        assert!(e.contains("gid_type"), "{e}");
        // At the bounds: rail 63, prefix 0 and 32, an empty device and a 32-byte one pass as sent.
        for v in [
            pb::VerbsEndpoint { rail: 63, ipv4_prefix: 32, device: "d".repeat(32), ..base.clone() },
            pb::VerbsEndpoint { rail: 0, ipv4_prefix: 0, device: String::new(), link_layer: "InfiniBand".into(), ..base.clone() },
        ] {
            let e = conv(&v).unwrap();
            assert_eq!(endpoint_to_pb(&e), pb::Endpoint { kind: Some(pb::endpoint::Kind::Verbs(v)) });
        }
    }
}
