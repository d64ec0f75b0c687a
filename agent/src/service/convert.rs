//! Protobuf ⇄ domain conversions (the one proto boundary) and the mapping of every domain error
//! to a gRPC status (DESIGN §9).
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tonic::Status;
use xfer_proto::v1 as pb;

use crate::checksum::Algo;
use crate::fabric::{Access, Endpoint, FabricError, FabricKind, VerbsEndpoint};
use crate::grants::GrantError;
use crate::peers::{PeerError, RemoteCode};
use crate::regions::{Region, RegionError, RegionKind};
use crate::transfer::{Op, TransferError, TransferRecord, TransferState};

pub fn duration_to_pb(d: Duration) -> prost_types::Duration {
    prost_types::Duration { seconds: d.as_secs().min(i64::MAX as u64) as i64, nanos: d.subsec_nanos() as i32 }
}

/// `None` for negative or malformed durations.
pub fn duration_from_pb(d: &prost_types::Duration) -> Option<Duration> {
    if d.seconds < 0 || d.nanos < 0 || d.nanos >= 1_000_000_000 {
        return None;
    }
    Some(Duration::new(d.seconds as u64, d.nanos as u32))
}

pub fn time_to_pb(t: SystemTime) -> prost_types::Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32 }
}

pub fn time_from_pb(t: prost_types::Timestamp) -> Option<SystemTime> {
    if t.seconds < 0 || !(0..1_000_000_000).contains(&t.nanos) {
        return None;
    }
    UNIX_EPOCH.checked_add(Duration::new(t.seconds as u64, t.nanos as u32))
}

pub fn fabric_to_pb(k: FabricKind) -> pb::FabricKind {
    match k {
        FabricKind::Tcp => pb::FabricKind::Tcp,
        FabricKind::Verbs => pb::FabricKind::Verbs,
    }
}

pub fn fabric_from_pb(v: i32) -> Option<FabricKind> {
    match pb::FabricKind::try_from(v).ok()? {
        pb::FabricKind::Tcp => Some(FabricKind::Tcp),
        pb::FabricKind::Verbs => Some(FabricKind::Verbs),
        pb::FabricKind::Unspecified => None,
    }
}

pub fn algo_to_pb(a: Algo) -> pb::ChecksumAlgo {
    match a {
        Algo::Xxh3 => pb::ChecksumAlgo::Xxh3,
        Algo::Crc32c => pb::ChecksumAlgo::Crc32c,
    }
}

pub fn algo_from_pb(v: i32) -> Result<Algo, Status> {
    match pb::ChecksumAlgo::try_from(v) {
        Ok(pb::ChecksumAlgo::Unspecified | pb::ChecksumAlgo::Xxh3) => Ok(Algo::Xxh3),
        Ok(pb::ChecksumAlgo::Crc32c) => Ok(Algo::Crc32c),
        Err(_) => Err(Status::invalid_argument(format!("unknown checksum algorithm {v}"))),
    }
}

pub fn access_to_pb(a: Access) -> pb::Access {
    match a {
        Access::Read => pb::Access::Read,
        Access::Write => pb::Access::Write,
        Access::ReadWrite => pb::Access::ReadWrite,
    }
}

pub fn access_from_pb(v: i32) -> Result<Access, Status> {
    match pb::Access::try_from(v) {
        Ok(pb::Access::Unspecified | pb::Access::ReadWrite) => Ok(Access::ReadWrite),
        Ok(pb::Access::Read) => Ok(Access::Read),
        Ok(pb::Access::Write) => Ok(Access::Write),
        Err(_) => Err(Status::invalid_argument(format!("unknown access {v}"))),
    }
}

pub fn kind_from_pb(v: i32) -> Result<RegionKind, Status> {
    match pb::RegionKind::try_from(v) {
        Ok(pb::RegionKind::Unspecified | pb::RegionKind::Anonymous) => Ok(RegionKind::Anonymous),
        Ok(pb::RegionKind::File) => Ok(RegionKind::File),
        Ok(pb::RegionKind::Shm) => Ok(RegionKind::Shm),
        Err(_) => Err(Status::invalid_argument(format!("unknown region kind {v}"))),
    }
}

fn kind_to_pb(k: RegionKind) -> pb::RegionKind {
    match k {
        RegionKind::Anonymous => pb::RegionKind::Anonymous,
        RegionKind::File => pb::RegionKind::File,
        RegionKind::Shm => pb::RegionKind::Shm,
    }
}

pub fn op_from_pb(v: i32) -> Result<Op, Status> {
    match pb::Op::try_from(v) {
        Ok(pb::Op::Write) => Ok(Op::Write),
        Ok(pb::Op::Read) => Ok(Op::Read),
        _ => Err(Status::invalid_argument("op must be OP_WRITE or OP_READ")),
    }
}

fn op_to_pb(o: Op) -> pb::Op {
    match o {
        Op::Write => pb::Op::Write,
        Op::Read => pb::Op::Read,
    }
}

pub fn region_to_pb(r: &Region) -> pb::Region {
    pb::Region {
        id: r.id.clone(),
        name: r.name.clone(),
        length: r.length,
        kind: kind_to_pb(r.kind) as i32,
        path: r.path.clone().unwrap_or_default(),
        access: access_to_pb(r.access) as i32,
        labels: r.labels.clone().into_iter().collect(),
        created_at: Some(time_to_pb(r.created_at)),
        expires_at: r.expires_at.map(time_to_pb),
        lkey: r.registration.lkey(),
        rkey: r.registration.rkey(),
        addr: r.registration.addr(),
    }
}

fn state_to_pb(s: TransferState) -> pb::TransferState {
    match s {
        TransferState::Queued => pb::TransferState::Queued,
        TransferState::Connecting => pb::TransferState::Connecting,
        TransferState::Running => pb::TransferState::Running,
        TransferState::Succeeded => pb::TransferState::Succeeded,
        TransferState::Failed => pb::TransferState::Failed,
        TransferState::Cancelled => pb::TransferState::Cancelled,
    }
}

pub fn transfer_to_pb(t: &TransferRecord) -> pb::Transfer {
    pb::Transfer {
        id: t.id.clone(),
        op: op_to_pb(t.op) as i32,
        local: Some(pb::LocalRange { region: t.local_region.clone(), offset: t.local_offset }),
        remote: Some(pb::RemoteRange { agent: t.remote_agent.clone(), region: t.remote_region.clone(), offset: t.remote_offset }),
        length: t.length,
        state: state_to_pb(t.state) as i32,
        bytes_done: t.bytes_done,
        error: t.error.clone().unwrap_or_default(),
        error_code: t.error_code.clone().unwrap_or_default(),
        created_at: Some(time_to_pb(t.created_at)),
        started_at: t.started_at.map(time_to_pb),
        finished_at: t.finished_at.map(time_to_pb),
        elapsed_seconds: t.elapsed.as_secs_f64(),
        verified: t.verified,
        checksum: t.checksum.unwrap_or(0),
        peer: t.peer.clone(),
        inbound: t.inbound,
    }
}

pub fn endpoint_to_pb(e: &Endpoint) -> pb::Endpoint {
    let kind = match e {
        Endpoint::Tcp { address } => pb::endpoint::Kind::Tcp(pb::TcpEndpoint { address: address.to_string() }),
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
        }),
    };
    pb::Endpoint { kind: Some(kind) }
}

/// Validates what a peer sent: every field is checked, nothing is trusted.
pub fn endpoint_from_pb(e: &pb::Endpoint) -> Result<Endpoint, String> {
    match &e.kind {
        Some(pb::endpoint::Kind::Tcp(t)) => t
            .address
            .parse()
            .map(|address| Endpoint::Tcp { address })
            .map_err(|_| format!("invalid tcp data address {:?}", t.address)),
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
            }))
        }
        None => Err("endpoint without a kind".into()),
    }
}

// ---------------------------------------------------------------- errors → status

pub fn region_status(e: RegionError) -> Status {
    match &e {
        RegionError::NotFound(_) => Status::not_found(e.to_string()),
        RegionError::AlreadyExists(_) => Status::already_exists(e.to_string()),
        RegionError::Invalid(_) | RegionError::PathMissing { .. } | RegionError::FileTooShort { .. } => {
            Status::invalid_argument(e.to_string())
        }
        RegionError::Busy(_) => Status::failed_precondition(e.to_string()),
        RegionError::Limit(_) => Status::resource_exhausted(e.to_string()),
        RegionError::Io { source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied => {
            Status::permission_denied(e.to_string())
        }
        RegionError::Io { .. } => Status::internal(e.to_string()),
        RegionError::Fabric(f) => fabric_status_code(f, e.to_string()),
    }
}

fn fabric_status_code(f: &FabricError, msg: String) -> Status {
    match f {
        FabricError::Registration(_) => Status::resource_exhausted(msg),
        FabricError::Negotiation { .. } => Status::failed_precondition(msg),
        FabricError::Connect { .. } => Status::unavailable(msg),
        _ => Status::internal(msg),
    }
}

pub fn fabric_status(f: FabricError) -> Status {
    let msg = f.to_string();
    fabric_status_code(&f, msg)
}

pub fn grant_status(e: GrantError) -> Status {
    match &e {
        GrantError::NotFound(_) => Status::not_found(e.to_string()),
        GrantError::Expired(_) => Status::failed_precondition(e.to_string()),
        GrantError::WrongPeer(_) => Status::permission_denied(e.to_string()),
        GrantError::Limit(_) => Status::resource_exhausted(e.to_string()),
    }
}

/// A caller without a usable client certificate (mTLS on) is not authenticated.
pub fn identity_status(e: super::tls::IdentityError) -> Status {
    Status::unauthenticated(e.to_string())
}

pub fn peer_status(e: PeerError) -> Status {
    let msg = e.to_string();
    match &e {
        PeerError::BadAddress(_) => Status::invalid_argument(msg),
        PeerError::Unreachable { .. } => Status::unavailable(msg),
        PeerError::Protocol { .. } => Status::internal(msg),
        PeerError::Fabric { source, .. } => fabric_status_code(source, msg),
        PeerError::Remote { code, .. } => match code {
            RemoteCode::NotFound => Status::not_found(msg),
            RemoteCode::InvalidArgument => Status::invalid_argument(msg),
            RemoteCode::PermissionDenied => Status::permission_denied(msg),
            RemoteCode::FailedPrecondition => Status::failed_precondition(msg),
            RemoteCode::ResourceExhausted => Status::resource_exhausted(msg),
            RemoteCode::Unavailable => Status::unavailable(msg),
            RemoteCode::DeadlineExceeded => Status::deadline_exceeded(msg),
            RemoteCode::Other => Status::internal(msg),
        },
    }
}

pub fn transfer_status(e: TransferError) -> Status {
    match e {
        TransferError::Region(r) => region_status(r),
        TransferError::Peer(p) => peer_status(p),
        TransferError::Grant(g) => grant_status(g),
        TransferError::Invalid(m) => Status::invalid_argument(m),
        TransferError::PermissionDenied(m) => Status::permission_denied(m),
        TransferError::FailedPrecondition(m) => Status::failed_precondition(m),
        e @ TransferError::NotFound(_) => Status::not_found(e.to_string()),
        e @ TransferError::Limit(_) => Status::resource_exhausted(e.to_string()),
        e @ TransferError::ShuttingDown => Status::unavailable(e.to_string()),
        TransferError::Internal(m) => Status::internal(m),
    }
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
        let t = pb::Endpoint { kind: Some(pb::endpoint::Kind::Tcp(pb::TcpEndpoint { address: "nope".into() })) };
        assert!(endpoint_from_pb(&t).is_err());
    }

    #[test]
    fn durations_reject_negative_values() {
        assert_eq!(duration_from_pb(&prost_types::Duration { seconds: -1, nanos: 0 }), None);
        assert_eq!(duration_from_pb(&prost_types::Duration { seconds: 2, nanos: 5 }), Some(Duration::new(2, 5)));
    }

    #[test]
    fn error_codes_follow_the_design() {
        use tonic::Code;
        assert_eq!(region_status(RegionError::NotFound("x".into())).code(), Code::NotFound);
        assert_eq!(region_status(RegionError::Invalid("x".into())).code(), Code::InvalidArgument);
        assert_eq!(region_status(RegionError::Limit("x".into())).code(), Code::ResourceExhausted);
        assert_eq!(grant_status(GrantError::Expired("g".into())).code(), Code::FailedPrecondition);
        assert_eq!(
            peer_status(PeerError::Unreachable { addr: "a".into(), detail: "refused".into() }).code(),
            Code::Unavailable
        );
        assert_eq!(transfer_status(TransferError::PermissionDenied("ro".into())).code(), Code::PermissionDenied);
    }
}
