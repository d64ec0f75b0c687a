//! Every gRPC status the agent answers with is built here: each domain error (regions, grants,
//! peers, transfers, the fabric), the role check's refusals and the request bounds map to one
//! code, so the same failure gets the same code whichever handler meets it. The error types are
//! defined where they arise ([`xfer_fabric::identity::AuthError`], [`BoundError`], ...); this module
//! imports them, and nothing it imports imports it back.
use tonic::Status;

use crate::error::NodeError;
use crate::grants::GrantError;
use crate::peer_api::{PeerError, RemoteCode};
use crate::regions::RegionError;
use crate::service::bounds::BoundError;
use xfer_engine::batch::BatchError;
use xfer_fabric::identity::AuthError;
use xfer_fabric::FabricError;

/// INVALID_ARGUMENT unless `cond` holds.
pub(crate) fn require(cond: bool, msg: &str) -> Result<(), Status> {
    if cond {
        Ok(())
    } else {
        Err(invalid(msg))
    }
}

/// INVALID_ARGUMENT for a malformed request (what a domain type cannot express).
pub(crate) fn invalid(msg: impl Into<String>) -> Status {
    Status::invalid_argument(msg.into())
}

/// INTERNAL for a blocking task that panicked or was cancelled (the runtime shutting down).
pub(crate) fn join_status(e: tokio::task::JoinError) -> Status {
    Status::internal(format!("a blocking task failed: {e}"))
}

/// A `WatchInbound` subscriber fell `missed` notifications behind: its stream ends with this.
pub fn lagged_status(missed: u64) -> Status {
    Status::data_loss(format!("this subscriber fell {missed} notifications behind and missed them; subscribe again"))
}

/// A `WatchInboundRing` subscription whose ring the agent can no longer write ends with this.
pub fn ring_failed_status(why: &str) -> Status {
    Status::data_loss(why.to_string())
}

/// A `Peer.Connect` in a protocol version this agent does not speak.
pub(super) fn peer_version_status(version: u32) -> Status {
    Status::failed_precondition(format!("unsupported peer protocol version {version} (this agent speaks 1)"))
}

/// A `Peer.Connect` asking for more QPs than one connection may have.
pub(super) fn too_many_endpoints_status(max: usize) -> Status {
    Status::resource_exhausted(format!("at most {max} QPs per connection"))
}

pub fn region_status(e: RegionError) -> Status {
    match &e {
        RegionError::NotFound(_) => Status::not_found(e.to_string()),
        RegionError::AlreadyExists(_) => Status::already_exists(e.to_string()),
        RegionError::Invalid(_) | RegionError::PathMissing { .. } | RegionError::FileTooShort { .. } => {
            Status::invalid_argument(e.to_string())
        }
        RegionError::NotRegular { .. } => Status::invalid_argument(e.to_string()),
        RegionError::Busy(_) | RegionError::Unavailable { .. } | RegionError::Poisoned { .. } | RegionError::Unsupported(_) => {
            Status::failed_precondition(e.to_string())
        }
        RegionError::Denied(_) => Status::permission_denied(e.to_string()),
        RegionError::ShmExists { .. } | RegionError::FileExists { .. } => Status::already_exists(e.to_string()),
        RegionError::Limit(_) => Status::resource_exhausted(e.to_string()),
        RegionError::Io { source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied => Status::permission_denied(e.to_string()),
        RegionError::Io { .. } => Status::internal(e.to_string()),
        RegionError::Fabric(f) => fabric_status_code(f, e.to_string()),
    }
}

fn fabric_status_code(f: &FabricError, msg: String) -> Status {
    match f {
        FabricError::Registration(_) => Status::resource_exhausted(msg),
        // The responder keeps no more connections for this identity: a limit, not a mismatch.
        FabricError::Negotiation { attr: "connections", .. } => Status::resource_exhausted(msg),
        FabricError::Negotiation { .. } => Status::failed_precondition(msg),
        FabricError::Connect { .. } => Status::unavailable(msg),
        _ => Status::internal(msg),
    }
}

pub fn fabric_status(f: FabricError) -> Status {
    let msg = f.to_string();
    fabric_status_code(&f, msg)
}

/// A request field over its bound (`service::bounds`).
pub fn bound_status(e: BoundError) -> Status {
    match e {
        BoundError::Invalid(m) => Status::invalid_argument(m),
        BoundError::TooMany(m) => Status::resource_exhausted(m),
    }
}

pub fn grant_status(e: GrantError) -> Status {
    match &e {
        GrantError::NotFound(_) | GrantError::RegionGone(_) => Status::not_found(e.to_string()),
        GrantError::Expired(_) => Status::failed_precondition(e.to_string()),
        GrantError::WrongPeer(_) => Status::permission_denied(e.to_string()),
        GrantError::Limit(_) => Status::resource_exhausted(e.to_string()),
        GrantError::Invalid(_) => Status::invalid_argument(e.to_string()),
    }
}

/// Refused by the role check: no certificate is UNAUTHENTICATED; a certificate without the role
/// a method needs is PERMISSION_DENIED naming that role.
pub fn auth_status(e: AuthError) -> Status {
    match e {
        AuthError::NoCertificate | AuthError::Unusable(_) => Status::unauthenticated(e.to_string()),
        AuthError::NoRole { .. } | AuthError::Ambiguous(_) | AuthError::Reserved(_) | AuthError::Denied { .. } => {
            Status::permission_denied(e.to_string())
        }
        AuthError::Unknown(_) => Status::unimplemented(e.to_string()),
    }
}

pub fn peer_status(e: PeerError) -> Status {
    let msg = e.to_string();
    match &e {
        PeerError::BadAddress(_) | PeerError::InvalidAddress(_) => Status::invalid_argument(msg),
        PeerError::PoolFull { .. } | PeerError::ConnectionLimit { .. } => Status::resource_exhausted(msg),
        PeerError::Unreachable { .. } => Status::unavailable(msg),
        PeerError::Protocol { .. } => Status::internal(msg),
        PeerError::Fabric { source, .. } => fabric_status_code(source, msg),
        PeerError::Remote { code, .. } => match code {
            RemoteCode::NotFound => Status::not_found(msg),
            RemoteCode::InvalidArgument => Status::invalid_argument(msg),
            RemoteCode::PermissionDenied => Status::permission_denied(msg),
            RemoteCode::FailedPrecondition | RemoteCode::UnknownConnection => Status::failed_precondition(msg),
            RemoteCode::ResourceExhausted => Status::resource_exhausted(msg),
            RemoteCode::Unavailable => Status::unavailable(msg),
            RemoteCode::DeadlineExceeded => Status::deadline_exceeded(msg),
            RemoteCode::Other => Status::internal(msg),
        },
    }
}

pub fn transfer_status(e: NodeError) -> Status {
    match e {
        NodeError::Region(r) => region_status(r),
        NodeError::Peer(p) => peer_status(p),
        NodeError::Grant(g) => grant_status(g),
        NodeError::Invalid(m) => Status::invalid_argument(m),
        e @ NodeError::Shape(_) => Status::invalid_argument(e.to_string()),
        e @ NodeError::Batch(BatchError::TooMany { .. }) => Status::resource_exhausted(e.to_string()),
        e @ NodeError::Batch(_) => Status::invalid_argument(e.to_string()),
        NodeError::PermissionDenied(m) => Status::permission_denied(m),
        NodeError::FailedPrecondition(m) => Status::failed_precondition(m),
        NodeError::UnknownConnection(m) => {
            let mut s = Status::failed_precondition(m);
            s.metadata_mut().insert(
                crate::peer_api::ERROR_REASON_KEY,
                tonic::metadata::MetadataValue::from_static(crate::peer_api::UNKNOWN_CONNECTION),
            );
            s
        }
        e @ NodeError::NotFound(_) => Status::not_found(e.to_string()),
        e @ NodeError::Limit(_) => Status::resource_exhausted(e.to_string()),
        NodeError::AlreadyExists(m) => Status::already_exists(m),
        e @ NodeError::ShuttingDown => Status::unavailable(e.to_string()),
        NodeError::Aborted(m) => Status::aborted(m),
        NodeError::Internal(m) => Status::internal(m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn error_codes_follow_the_design() {
        assert_eq!(region_status(RegionError::NotFound("x".into())).code(), Code::NotFound);
        assert_eq!(region_status(RegionError::Invalid("x".into())).code(), Code::InvalidArgument);
        assert_eq!(region_status(RegionError::Poisoned { name: "r".into() }).code(), Code::FailedPrecondition);
        assert_eq!(region_status(RegionError::Limit("x".into())).code(), Code::ResourceExhausted);
        assert_eq!(region_status(RegionError::Denied("x".into())).code(), Code::PermissionDenied);
        assert_eq!(region_status(RegionError::NotRegular { path: "p".into(), kind: "FIFO" }).code(), Code::InvalidArgument);
        assert_eq!(region_status(RegionError::ShmExists { object: "o".into() }).code(), Code::AlreadyExists);
        let unavailable = region_status(RegionError::Unavailable { name: "r".into(), reason: "file missing".into() });
        assert_eq!(unavailable.code(), Code::FailedPrecondition);
        assert!(unavailable.message().contains("file missing"), "{}", unavailable.message());
        assert_eq!(grant_status(GrantError::Expired("g".into())).code(), Code::FailedPrecondition);
        assert_eq!(peer_status(PeerError::Unreachable { addr: "a".into(), detail: "refused".into() }).code(), Code::Unavailable);
        assert_eq!(transfer_status(NodeError::PermissionDenied("ro".into())).code(), Code::PermissionDenied);
    }

    /// A field that cannot mean anything at its size is INVALID_ARGUMENT; more items than a
    /// configured limit is RESOURCE_EXHAUSTED; the message (naming the field) is kept.
    #[test]
    fn bounds_map_to_their_codes() {
        let e = bound_status(BoundError::Invalid("name: 129 bytes; at most 128".into()));
        assert_eq!((e.code(), e.message()), (Code::InvalidArgument, "name: 129 bytes; at most 128"));
        assert_eq!(bound_status(BoundError::TooMany("segments: 17".into())).code(), Code::ResourceExhausted);
    }

    #[test]
    fn refusals_of_the_role_check_map_to_their_codes() {
        assert_eq!(auth_status(AuthError::NoCertificate).code(), Code::Unauthenticated);
        assert_eq!(auth_status(AuthError::Unknown("/x.Y/Z".into())).code(), Code::Unimplemented);
    }
}
