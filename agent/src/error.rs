//! The core's one error: what every `Node` operation (regions, grants, peers, transfers,
//! channels, benchmarks) returns, naming the subsystem that refused. `service::convert::status`
//! maps it to a gRPC status, in one place.
use xfer_engine::batch::BatchError;
use xfer_engine::shape::ShapeError;

use crate::grants::GrantError;
use crate::peer_api::PeerError;
use crate::regions::RegionError;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Region(#[from] RegionError),
    #[error(transparent)]
    Peer(#[from] PeerError),
    #[error(transparent)]
    Grant(#[from] GrantError),
    #[error("{0}")]
    Invalid(String),
    /// A chunk size, QP count or depth out of bounds (INVALID_ARGUMENT).
    #[error("{0}")]
    Shape(#[from] ShapeError),
    /// A bad segment list (INVALID_ARGUMENT; too many segments: RESOURCE_EXHAUSTED).
    #[error("{0}")]
    Batch(#[from] BatchError),
    #[error("{0}")]
    PermissionDenied(String),
    /// A peer named a connection this agent does not have (closed, or made with an earlier
    /// instance): FAILED_PRECONDITION, marked so the peer can tell it from other preconditions.
    #[error("{0}")]
    UnknownConnection(String),
    /// The request is valid but the system is not in a state to serve it (FAILED_PRECONDITION).
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("transfer {0:?} not found")]
    NotFound(String),
    #[error("limit reached: {0}")]
    Limit(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("agent is shutting down")]
    ShuttingDown,
    /// Work in progress was given up: a channel whose batch failed on the fabric (ABORTED).
    #[error("{0}")]
    Aborted(String),
    #[error("{0}")]
    Internal(String),
}

impl From<xfer_engine::Error> for NodeError {
    fn from(e: xfer_engine::Error) -> NodeError {
        match e {
            xfer_engine::Error::Invalid(why) => NodeError::Invalid(why),
            // A range outside the local region is the region's refusal, as from every other check.
            xfer_engine::Error::Range(e) => NodeError::Region(e.into()),
        }
    }
}
