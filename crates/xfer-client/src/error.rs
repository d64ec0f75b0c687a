//! The client's one error type: every gRPC status becomes a variant a caller can match on (no
//! `tonic::Status` escapes), plus what the client itself can fail at (connecting, TLS files,
//! mapping a shared-memory region) and transfers or batches that ended without succeeding.
use std::fmt;

/// Everything a client call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The agent could not be reached (or the TLS handshake failed).
    #[error("cannot connect to agent {addr}: {detail}")]
    Connect { addr: String, detail: String },
    /// The connection failed under a call: the agent went away, or refused the TLS handshake
    /// (an agent with mTLS needs a client certificate from its CA).
    #[error("connection to the agent failed: {0}")]
    Transport(String),
    /// An argument the agent (or the client) refused: a range, a size, a segment, a name.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// The caller's certificate lacks the role, or the region's access ceiling forbids it.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// A limit of the agent (regions, bytes, transfers, segments, subscribers).
    #[error("resource exhausted: {0}")]
    ResourceExhausted(String),
    /// Valid, but not now: an expired grant, a busy region, an unavailable region.
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    /// The agent or its peer is unreachable or shutting down; retry later.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// Work was given up (a channel whose batch failed on the fabric).
    #[error("aborted: {0}")]
    Aborted(String),
    #[error("deadline exceeded: {0}")]
    DeadlineExceeded(String),
    /// A notification subscriber fell too far behind and must subscribe again.
    #[error("data loss: {0}")]
    DataLoss(String),
    #[error("cancelled: {0}")]
    Cancelled(String),
    #[error("out of range: {0}")]
    OutOfRange(String),
    /// Any other status (internal errors, unimplemented methods on an older agent).
    #[error("{code}: {message}")]
    Other { code: String, message: String },
    /// A transfer that ended FAILED or CANCELLED; `code` is `Transfer.error_code`.
    #[error("transfer {id} {state}: {message} ({code})")]
    Transfer { id: String, state: crate::State, code: String, message: String },
    /// A channel batch the agent answered with a failure; `code` is `BatchDone.error_code`
    /// (`INVALID_ARGUMENT`, `RESOURCE_EXHAUSTED`, `NOT_FOUND` for a refused batch, the channel
    /// going on; a transfer failure code otherwise, and the channel then ends).
    #[error("batch {seq} failed ({code}): {message}")]
    Batch { seq: u64, code: String, message: String },
    /// The agent answered something this client does not understand.
    #[error("unexpected answer from the agent: {0}")]
    Protocol(String),
    /// Local I/O: reading TLS files, mapping a shared-memory region.
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<tonic::Status> for Error {
    fn from(s: tonic::Status) -> Error {
        use tonic::Code;
        // A status tonic made from a transport failure carries that error as its source (one
        // from the agent never does).
        if matches!(s.code(), Code::Unknown | Code::Cancelled | Code::Unavailable | Code::Internal) {
            if let Some(source) = std::error::Error::source(&s) {
                let mut cur = source;
                while let Some(next) = cur.source() {
                    cur = next;
                }
                let root = cur.to_string();
                let root = if root.is_empty() || root == "transport error" { s.message().to_string() } else { root };
                return Error::Transport(root);
            }
        }
        let m = s.message().to_string();
        match s.code() {
            Code::InvalidArgument => Error::InvalidArgument(m),
            Code::NotFound => Error::NotFound(m),
            Code::AlreadyExists => Error::AlreadyExists(m),
            Code::PermissionDenied => Error::PermissionDenied(m),
            Code::Unauthenticated => Error::Unauthenticated(m),
            Code::ResourceExhausted => Error::ResourceExhausted(m),
            Code::FailedPrecondition => Error::FailedPrecondition(m),
            Code::Unavailable => Error::Unavailable(m),
            Code::Aborted => Error::Aborted(m),
            Code::DeadlineExceeded => Error::DeadlineExceeded(m),
            Code::DataLoss => Error::DataLoss(m),
            Code::Cancelled => Error::Cancelled(m),
            Code::OutOfRange => Error::OutOfRange(m),
            Code::Unimplemented => Error::Other { code: "UNIMPLEMENTED".into(), message: m },
            Code::Internal => Error::Other { code: "INTERNAL".into(), message: m },
            code => Error::Other { code: "UNKNOWN".into(), message: if m.is_empty() { format!("{code:?}") } else { m } },
        }
    }
}

impl Error {
    /// The gRPC status name for errors that are an agent's status (`NOT_FOUND`, …); the kind of
    /// failure otherwise (`CONNECT`, `TRANSPORT`, `TRANSFER`, `BATCH`, `PROTOCOL`, `IO`).
    pub fn code(&self) -> &str {
        match self {
            Error::Connect { .. } => "CONNECT",
            Error::Transport(_) => "TRANSPORT",
            Error::InvalidArgument(_) => "INVALID_ARGUMENT",
            Error::NotFound(_) => "NOT_FOUND",
            Error::AlreadyExists(_) => "ALREADY_EXISTS",
            Error::PermissionDenied(_) => "PERMISSION_DENIED",
            Error::Unauthenticated(_) => "UNAUTHENTICATED",
            Error::ResourceExhausted(_) => "RESOURCE_EXHAUSTED",
            Error::FailedPrecondition(_) => "FAILED_PRECONDITION",
            Error::Unavailable(_) => "UNAVAILABLE",
            Error::Aborted(_) => "ABORTED",
            Error::DeadlineExceeded(_) => "DEADLINE_EXCEEDED",
            Error::DataLoss(_) => "DATA_LOSS",
            Error::Cancelled(_) => "CANCELLED",
            Error::OutOfRange(_) => "OUT_OF_RANGE",
            Error::Other { code, .. } => code,
            Error::Transfer { .. } => "TRANSFER",
            Error::Batch { .. } => "BATCH",
            Error::Protocol(_) => "PROTOCOL",
            Error::Io { .. } => "IO",
        }
    }

    /// The agent's own words for a status error (without the code); the whole text otherwise.
    pub fn message(&self) -> String {
        match self {
            Error::InvalidArgument(m)
            | Error::NotFound(m)
            | Error::AlreadyExists(m)
            | Error::PermissionDenied(m)
            | Error::Unauthenticated(m)
            | Error::ResourceExhausted(m)
            | Error::FailedPrecondition(m)
            | Error::Unavailable(m)
            | Error::Aborted(m)
            | Error::DeadlineExceeded(m)
            | Error::DataLoss(m)
            | Error::Cancelled(m)
            | Error::OutOfRange(m) => m.clone(),
            Error::Other { message, .. } => message.clone(),
            other => other.to_string(),
        }
    }

    pub(crate) fn io(what: impl fmt::Display, source: std::io::Error) -> Error {
        Error::Io { what: what.to_string(), source }
    }
}
