//! The one place where failures become an exit code and a one-line message.
//!
//! Commands return `anyhow::Error`s that carry either an [`xfer_client::Error`] (from a call to
//! an agent), a [`Failure`] (a condition xferctl itself detected, such as a FAILED transfer) or
//! anything else (generic, exit 1). [`report`] walks the error chain, picks the exit code from
//! the first typed error it finds and renders the chain as one line: the agent's message, then
//! its status code's name.

use std::fmt;

/// Exit codes that scripts can rely on. Keep in sync with the table in `lib.rs` and `--help`.
pub mod exit {
    pub const OK: u8 = 0;
    pub const GENERIC: u8 = 1;
    pub const USAGE: u8 = 2;
    pub const NOT_FOUND: u8 = 3;
    pub const INVALID_ARGUMENT: u8 = 4;
    pub const PERMISSION_DENIED: u8 = 5;
    pub const FAILED_PRECONDITION: u8 = 6;
    pub const RESOURCE_EXHAUSTED: u8 = 7;
    pub const UNAVAILABLE: u8 = 8;
    pub const DEADLINE_EXCEEDED: u8 = 9;
    pub const TRANSFER_FAILED: u8 = 10;
    pub const TRANSFER_CANCELLED: u8 = 11;
    pub const VERIFY_MISMATCH: u8 = 12;
    pub const ALREADY_EXISTS: u8 = 13;
}

/// The exit-code table as shown in `--help`.
pub const EXIT_CODES_HELP: &str = "\
Exit codes:
   0  success
   1  other error
   2  usage error (bad flags or arguments)
   3  NOT_FOUND            (region, transfer or peer does not exist)
   4  INVALID_ARGUMENT     (also OUT_OF_RANGE: bad range, size or overflow)
   5  PERMISSION_DENIED    (also UNAUTHENTICATED: access ceiling, identity)
   6  FAILED_PRECONDITION  (also ABORTED: region busy, grant expired)
   7  RESOURCE_EXHAUSTED   (agent limits reached)
   8  UNAVAILABLE          (agent or peer unreachable, connection refused)
   9  DEADLINE_EXCEEDED
  10  transfer FAILED      (the transfer's error and error_code are printed)
  11  transfer CANCELLED   (also the gRPC status CANCELLED)
  12  verification mismatch (checksums differ, or --verify was not honoured)
  13  ALREADY_EXISTS       (e.g. a region with that name exists)

Environment:
  XFER_AGENT  default agent address (host, host:port or [v6]:port; default 127.0.0.1:7470)
  XFER_CERT, XFER_KEY, XFER_CA  mTLS client certificate, key and CA (like --cert, --key, --ca)";

/// A failure xferctl detected itself (not an RPC status).
#[derive(Debug)]
pub enum Failure {
    /// Could not open a connection to an agent.
    Connect { addr: String, reason: String },
    /// The transfer ended in FAILED.
    TransferFailed { id: String, error: String, error_code: String },
    /// The transfer ended in CANCELLED.
    TransferCancelled { id: String, error: String },
    /// Data or checksums differ.
    VerifyMismatch(String),
    /// Bad input xferctl found itself (a malformed file, a missing option): exit 2, like clap.
    Usage(String),
}

/// A usage error (exit 2) with this message.
pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Failure::Usage(msg.into()))
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Connect { addr, reason } => {
                write!(f, "cannot connect to agent at {addr}: {reason} (UNAVAILABLE)")
            }
            Failure::TransferFailed { id, error, error_code } => {
                let error = if error.is_empty() { "no reason given" } else { error };
                let code = if error_code.is_empty() { "FAILED" } else { error_code };
                write!(f, "transfer {id} failed: {error} ({code})")
            }
            Failure::TransferCancelled { id, error } => {
                if error.is_empty() {
                    write!(f, "transfer {id} was cancelled (CANCELLED)")
                } else {
                    write!(f, "transfer {id} was cancelled: {error} (CANCELLED)")
                }
            }
            Failure::VerifyMismatch(msg) => write!(f, "verification failed: {msg}"),
            Failure::Usage(msg) => f.write_str(msg),
        }
    }
}

impl std::error::Error for Failure {}

impl Failure {
    fn exit_code(&self) -> u8 {
        match self {
            Failure::Connect { .. } => exit::UNAVAILABLE,
            Failure::TransferFailed { error_code, .. } if is_checksum_code(error_code) => exit::VERIFY_MISMATCH,
            // `cp --timeout` ran out: the documented DEADLINE_EXCEEDED exit, not a generic failure.
            Failure::TransferFailed { error_code, .. } if error_code == "DEADLINE_EXCEEDED" => exit::DEADLINE_EXCEEDED,
            Failure::TransferFailed { .. } => exit::TRANSFER_FAILED,
            Failure::TransferCancelled { .. } => exit::TRANSFER_CANCELLED,
            Failure::VerifyMismatch(_) => exit::VERIFY_MISMATCH,
            Failure::Usage(_) => exit::USAGE,
        }
    }
}

/// A transfer that failed its end-to-end checksum is a verification mismatch (exit 12), not a
/// generic transfer failure.
fn is_checksum_code(code: &str) -> bool {
    let c = code.to_ascii_uppercase();
    c.contains("CHECKSUM") || c.contains("MISMATCH")
}

/// Exit code for an agent's gRPC status, by its canonical name.
pub fn status_exit_code(code: &str) -> u8 {
    match code {
        "OK" => exit::OK,
        "NOT_FOUND" => exit::NOT_FOUND,
        "INVALID_ARGUMENT" | "OUT_OF_RANGE" => exit::INVALID_ARGUMENT,
        "PERMISSION_DENIED" | "UNAUTHENTICATED" => exit::PERMISSION_DENIED,
        "FAILED_PRECONDITION" | "ABORTED" => exit::FAILED_PRECONDITION,
        "RESOURCE_EXHAUSTED" => exit::RESOURCE_EXHAUSTED,
        "UNAVAILABLE" => exit::UNAVAILABLE,
        "DEADLINE_EXCEEDED" => exit::DEADLINE_EXCEEDED,
        "ALREADY_EXISTS" => exit::ALREADY_EXISTS,
        "CANCELLED" => exit::TRANSFER_CANCELLED,
        _ => exit::GENERIC,
    }
}

/// What [`crate::diagnose`] makes of a failed connection to the agent this process connected to
/// (`addr`, when the error names it, must be that agent).
fn diagnosed(addr: Option<&String>, text: &str) -> Option<String> {
    let target = crate::diagnose::last_target()?;
    if addr.is_some_and(|a| *a != target.addr) {
        return None;
    }
    crate::diagnose::explain(&target, text)
}

/// A connection problem's hint for `doctor`'s fix column: the diagnosis when there is one.
pub fn connect_hint(err: &anyhow::Error) -> Option<String> {
    err.chain().find_map(|c| match c.downcast_ref::<xfer_client::Error>()? {
        xfer_client::Error::Connect { addr, detail } => diagnosed(Some(addr), detail),
        xfer_client::Error::Transport(root) => diagnosed(None, root),
        _ => None,
    })
}

/// A client error as (exit code, the code name to append, the text).
fn client_error(e: &xfer_client::Error) -> (u8, Option<String>, String) {
    use xfer_client::Error as E;
    match e {
        E::Connect { addr, detail } => {
            if let Some(line) = diagnosed(Some(addr), detail) {
                return (exit::UNAVAILABLE, Some("UNAVAILABLE".into()), line);
            }
            // tonic's bare "transport error" says nothing: name what failed instead.
            let reason = if detail.is_empty() || detail == "transport error" { "connection failed".to_string() } else { detail.clone() };
            let f = Failure::Connect { addr: addr.clone(), reason };
            (exit::UNAVAILABLE, None, f.to_string())
        }
        // The call never got an answer: the connection failed under it (e.g. a refused TLS
        // handshake, or plaintext sent to an mTLS agent). That is UNAVAILABLE.
        E::Transport(root) => {
            if let Some(line) = diagnosed(None, root) {
                return (exit::UNAVAILABLE, Some("UNAVAILABLE".into()), line);
            }
            (exit::UNAVAILABLE, Some("UNAVAILABLE".into()), format!("connection to the agent failed: {root}"))
        }
        E::Transfer { id, state, code, message } => {
            let f = if *state == xfer_client::State::Cancelled {
                Failure::TransferCancelled { id: id.clone(), error: message.clone() }
            } else {
                Failure::TransferFailed { id: id.clone(), error: message.clone(), error_code: code.clone() }
            };
            (f.exit_code(), None, f.to_string())
        }
        E::Batch { .. } => (exit::TRANSFER_FAILED, None, e.to_string()),
        E::Protocol(_) | E::Io { .. } => (exit::GENERIC, None, e.to_string()),
        // An agent's status: its message, its code's exit code and name.
        status => {
            let code = status.code().to_string();
            let msg = status.message();
            let msg = msg.trim();
            let text = if msg.is_empty() { code.to_ascii_lowercase().replace('_', " ") } else { msg.to_string() };
            (status_exit_code(&code), Some(code), text)
        }
    }
}

/// Renders an error as `(exit code, one-line message without the "error: " prefix)`.
pub fn report(err: &anyhow::Error) -> (u8, String) {
    let mut code = None;
    let mut parts: Vec<String> = Vec::new();
    let mut suffix = None;
    for cause in err.chain() {
        let typed = if let Some(e) = cause.downcast_ref::<xfer_client::Error>() {
            let (exit, name, text) = client_error(e);
            code.get_or_insert(exit);
            if let Some(name) = name {
                suffix.get_or_insert(name);
            }
            Some(text)
        } else if let Some(failure) = cause.downcast_ref::<Failure>() {
            code.get_or_insert(failure.exit_code());
            Some(failure.to_string())
        } else {
            None
        };
        let is_typed = typed.is_some();
        let text = typed.unwrap_or_else(|| cause.to_string());
        // Lower layers often repeat the text of the layer above; keep the line short and
        // readable.
        let text = text.replace('\n', " ");
        let text = text.trim();
        if text.is_empty() || parts.iter().any(|p| p.contains(text)) {
            continue;
        }
        parts.push(text.to_string());
        if is_typed {
            // The typed error is the root cause as far as the user is concerned.
            break;
        }
    }
    let mut line = parts.join(": ");
    if let Some(name) = suffix {
        line.push_str(&format!(" ({name})"));
    }
    (code.unwrap_or(exit::GENERIC), line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    use xfer_client::Error as E;

    #[test]
    fn status_codes_map_to_documented_exit_codes() {
        let table = [
            (E::NotFound(String::new()), 3),
            (E::InvalidArgument(String::new()), 4),
            (E::OutOfRange(String::new()), 4),
            (E::PermissionDenied(String::new()), 5),
            (E::Unauthenticated(String::new()), 5),
            (E::FailedPrecondition(String::new()), 6),
            (E::Aborted(String::new()), 6),
            (E::ResourceExhausted(String::new()), 7),
            (E::Unavailable(String::new()), 8),
            (E::DeadlineExceeded(String::new()), 9),
            (E::Cancelled(String::new()), 11),
            (E::AlreadyExists(String::new()), 13),
            (E::Other { code: "INTERNAL".into(), message: String::new() }, 1),
            (E::Other { code: "UNKNOWN".into(), message: String::new() }, 1),
            (E::Other { code: "UNIMPLEMENTED".into(), message: String::new() }, 1),
            (E::DataLoss(String::new()), 1),
            (E::Protocol(String::new()), 1),
            (E::Transport(String::new()), 8),
            (E::Connect { addr: "h:1".into(), detail: String::new() }, 8),
        ];
        for (e, exit) in table {
            let name = e.code().to_string();
            assert_eq!(report(&anyhow::Error::new(e)).0, exit, "{name}");
        }
    }

    #[test]
    fn status_renders_message_and_code_name() {
        let err = anyhow::Error::new(E::NotFound("region \"foo\" not found".into()));
        assert_eq!(report(&err), (3, "region \"foo\" not found (NOT_FOUND)".to_string()));
    }

    #[test]
    fn context_is_prefixed_on_one_line() {
        let err = Err::<(), _>(E::InvalidArgument("offset 10 beyond end\nof region".into())).context("writing region r").unwrap_err();
        let (code, line) = report(&err);
        assert_eq!(code, 4);
        assert_eq!(line, "writing region r: offset 10 beyond end of region (INVALID_ARGUMENT)");
        assert!(!line.contains('\n'));
    }

    #[test]
    fn empty_status_message_uses_code() {
        let err = anyhow::Error::new(E::ResourceExhausted(String::new()));
        assert_eq!(report(&err), (7, "resource exhausted (RESOURCE_EXHAUSTED)".into()));
    }

    #[test]
    fn a_transfer_error_from_the_client_exits_like_the_transfer_ended() {
        let failed =
            E::Transfer { id: "t".into(), state: xfer_client::State::Failed, code: "CHECKSUM_MISMATCH".into(), message: "differ".into() };
        assert_eq!(report(&anyhow::Error::new(failed)).0, 12);
        let cancelled = E::Transfer { id: "t".into(), state: xfer_client::State::Cancelled, code: String::new(), message: String::new() };
        assert_eq!(report(&anyhow::Error::new(cancelled)), (11, "transfer t was cancelled (CANCELLED)".into()));
    }

    #[test]
    fn failures() {
        let failed = anyhow::Error::new(Failure::TransferFailed {
            id: "t1".into(),
            error: "peer went away".into(),
            error_code: "PEER_UNAVAILABLE".into(),
        });
        assert_eq!(report(&failed), (10, "transfer t1 failed: peer went away (PEER_UNAVAILABLE)".into()));

        let mismatch = anyhow::Error::new(Failure::TransferFailed {
            id: "t2".into(),
            error: "checksums differ".into(),
            error_code: "CHECKSUM_MISMATCH".into(),
        });
        assert_eq!(report(&mismatch).0, 12);

        // `cp --timeout`: the transfer's own deadline is the documented exit 9.
        let deadline = anyhow::Error::new(Failure::TransferFailed {
            id: "t4".into(),
            error: "transfer timed out after 1s".into(),
            error_code: "DEADLINE_EXCEEDED".into(),
        });
        assert_eq!(report(&deadline).0, 9);

        let cancelled = anyhow::Error::new(Failure::TransferCancelled { id: "t3".into(), error: String::new() });
        assert_eq!(report(&cancelled), (11, "transfer t3 was cancelled (CANCELLED)".into()));

        let verify = anyhow::Error::new(Failure::VerifyMismatch("byte 7 differs".into()));
        assert_eq!(report(&verify), (12, "verification failed: byte 7 differs".into()));

        let connect =
            anyhow::Error::new(Failure::Connect { addr: "127.0.0.1:1".into(), reason: "Connection refused (os error 111)".into() });
        let (code, line) = report(&connect);
        assert_eq!(code, 8);
        assert!(line.starts_with("cannot connect to agent at 127.0.0.1:1"), "{line}");
        assert!(line.ends_with("(UNAVAILABLE)"), "{line}");
    }

    #[test]
    fn typed_error_below_context_still_decides_code() {
        let err = Err::<(), _>(Failure::TransferCancelled { id: "x".into(), error: "agent shutting down".into() })
            .context("demo step 3")
            .unwrap_err();
        let (code, line) = report(&err);
        assert_eq!(code, 11);
        assert_eq!(line, "demo step 3: transfer x was cancelled: agent shutting down (CANCELLED)");
    }

    #[test]
    fn transport_failures_under_a_call_are_unavailable() {
        // What the client makes of a status tonic built from a dying connection.
        let io = std::io::Error::new(std::io::ErrorKind::BrokenPipe, "broken pipe");
        let err = anyhow::Error::new(E::from(tonic::Status::from_error(Box::new(io)))).context("GetInfo");
        let (code, line) = report(&err);
        assert_eq!(code, 8, "{line}");
        assert!(line.ends_with("(UNAVAILABLE)"), "{line}");
        assert!(line.contains("broken pipe"), "{line}");
        // A status the agent sent (no source) keeps its own code.
        let err = anyhow::Error::new(E::from(tonic::Status::cancelled("transfer cancelled")));
        assert_eq!(report(&err).0, 11);
    }

    #[test]
    fn generic_errors_exit_one() {
        let err = anyhow::anyhow!("something odd");
        assert_eq!(report(&err), (1, "something odd".into()));
    }
}
