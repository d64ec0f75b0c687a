//! Why a transfer did not succeed: one closed set of codes. The transfer record stores a
//! [`FailureCode`], the `xfer_transfer_failures_total{code}` metric counts it, and the proto's
//! `Transfer.error_code` carries [`FailureCode::as_str`] — the same value everywhere, written once.
use crate::machine::{Fault, PathDown};
use crate::status::WcStatus;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureCode {
    /// `CancelTransfer`, or drain at shutdown.
    Cancelled,
    /// `options.timeout` passed before the data landed.
    DeadlineExceeded,
    /// A work request completed with an error status (its verbs name: `REM_ACCESS_ERR`, ...).
    Completion(WcStatus),
    /// The fabric refused to post a work request (the connection broke or closed).
    PostFailed,
    /// Every path to the peer went down during the transfer, the last one by an event (a port
    /// or device failure) rather than a failed work request, whose status is the code then.
    NoPath,
    /// The target's checksum of the destination range differs from the source's.
    ChecksumMismatch,
    /// Verification was asked for, but `Peer.Complete` (which carries the checksum) failed.
    VerifyFailed,
    /// The local region's backing file shrank under its mapping while the transfer used it.
    RegionPoisoned,
    /// A bug or a lost task: never expected.
    Internal,
}

impl FailureCode {
    /// The machine-readable code (`Transfer.error_code`, the metric's `code` label).
    pub fn as_str(self) -> &'static str {
        match self {
            FailureCode::Cancelled => "CANCELLED",
            FailureCode::DeadlineExceeded => "DEADLINE_EXCEEDED",
            FailureCode::Completion(s) => s.name(),
            FailureCode::PostFailed => "POST_FAILED",
            FailureCode::NoPath => "NO_PATH",
            FailureCode::ChecksumMismatch => "CHECKSUM_MISMATCH",
            FailureCode::VerifyFailed => "VERIFY_FAILED",
            FailureCode::RegionPoisoned => "REGION_POISONED",
            FailureCode::Internal => "INTERNAL",
        }
    }

    /// A plain-words hint appended to a completion error's message.
    pub fn hint(self) -> &'static str {
        use WcStatus::*;
        match self {
            FailureCode::Completion(RemAccessErr) => " (the peer refused access: outside the grant, wrong operation, expired or revoked)",
            FailureCode::Completion(RetryExcErr) => " (the peer stopped answering: dead agent, broken link or closed connection)",
            FailureCode::Completion(RnrRetryExcErr) => " (the peer's receive queue was not ready)",
            FailureCode::NoPath => {
                " (every path to the peer is down: a port or device failed on each of them; xferctl doctor shows the devices)"
            }
            FailureCode::Completion(RemInvReqErr) => " (the peer rejected the request as invalid)",
            _ => "",
        }
    }
}

impl std::fmt::Display for FailureCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A transfer's failure: its code and a message for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub code: FailureCode,
    pub message: String,
}

impl Failure {
    pub fn new(code: FailureCode, message: impl Into<String>) -> Failure {
        Failure { code, message: message.into() }
    }

    pub fn cancelled() -> Failure {
        Failure::new(FailureCode::Cancelled, "cancelled")
    }
}

/// The failure a machine fault is reported as.
pub fn failure_of(fault: Fault) -> Failure {
    match fault {
        Fault::Completion { status, .. } => {
            let code = FailureCode::Completion(status);
            Failure::new(code, format!("work request failed with {status}{}", code.hint()))
        }
        Fault::Post(e) => Failure::new(FailureCode::PostFailed, e),
        Fault::Timeout => Failure::new(FailureCode::DeadlineExceeded, "transfer timed out"),
        // The code is the last path's cause where it has one, as with a single path (a dead peer
        // is RETRY_EXC_ERR however many paths led to it); the message says every path went.
        Fault::NoPath { last } => {
            let code = match last {
                PathDown::Completion(status) => FailureCode::Completion(status),
                PathDown::Post(_) => FailureCode::PostFailed,
                PathDown::Event(_) | PathDown::OutOfOrder { .. } => FailureCode::NoPath,
            };
            Failure::new(code, format!("every path to the peer is down; the last: {last}{}", code.hint()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_the_documented_strings() {
        // These strings are API (xferctl's exit codes, users' scripts): the proto comment on
        // Transfer.error_code lists them.
        let proto = include_str!("../../../proto/xfer/v1/xfer.proto");
        for c in [
            FailureCode::Cancelled,
            FailureCode::DeadlineExceeded,
            FailureCode::PostFailed,
            FailureCode::ChecksumMismatch,
            FailureCode::VerifyFailed,
            FailureCode::RegionPoisoned,
            FailureCode::Internal,
            FailureCode::NoPath,
            FailureCode::Completion(WcStatus::RemAccessErr),
            FailureCode::Completion(WcStatus::RetryExcErr),
        ] {
            assert!(proto.contains(c.as_str()), "proto does not document {c}");
        }
        assert_eq!(FailureCode::Completion(WcStatus::RetryExcErr).as_str(), "RETRY_EXC_ERR");
        assert!(FailureCode::Completion(WcStatus::RemAccessErr).hint().contains("refused access"));
    }
}
