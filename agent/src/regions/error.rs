//! What can go wrong with a region, as one error type the node maps to gRPC statuses.

use xfer_fabric::FabricError;

#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("region {0:?} not found")]
    NotFound(String),
    #[error("region {0:?} already exists")]
    AlreadyExists(String),
    #[error("{0}")]
    Invalid(String),
    #[error("file {path:?} does not exist (create_file, `xferctl region create --create --size SIZE`, creates it)")]
    PathMissing { path: String },
    /// `create_file` found something at the path: it never replaces a file.
    #[error("file {path:?} already exists; create_file never replaces a file (leave --create out to map it)")]
    FileExists { path: String },
    #[error("file {path:?} is {actual} bytes, shorter than the region length {needed}")]
    FileTooShort { path: String, actual: u64, needed: u64 },
    #[error("region {0:?} is in use by a running transfer")]
    Busy(String),
    /// Outside every file root, through a symlink, or an shm object of another owner.
    #[error("{0}")]
    Denied(String),
    #[error("{path:?} is not a regular file (it is a {kind}); regions map regular files only")]
    NotRegular { path: String, kind: &'static str },
    #[error("shm object {object:?} already exists; pass adopt_existing (xferctl region create --adopt) to use it")]
    ShmExists { object: String },
    #[error("region {name:?} is unavailable: {reason}")]
    Unavailable { name: String, reason: String },
    /// The region's file (or shm object) shrank under its mapping (`xfer_rdma::sigbus`).
    #[error("region {name:?}'s file shrank under its mapping; recreate the region")]
    Poisoned { name: String },
    #[error("limit reached: {0}")]
    Limit(String),
    /// The host cannot give what was asked (huge pages none are reserved for): the message
    /// says how to fix it.
    #[error("{0}")]
    Unsupported(String),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    #[error(transparent)]
    Fabric(#[from] FabricError),
}

/// An I/O error with what was being done (`reading regions.json`).
pub(super) fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> RegionError {
    let context = context.into();
    move |source| RegionError::Io { context, source }
}
