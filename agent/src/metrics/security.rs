//! What the agent records about callers it refuses: TLS handshakes on the gRPC port that failed,
//! by reason, and calls the role table denied, by method and the caller's role. Both label sets
//! are closed: reasons are a fixed list, methods are the ones this agent serves (anything else is
//! `unknown`, decided where the services are known: `service::auth`), roles are node, client, admin or `none` (a certificate without a role).
use metrics::{counter, describe_counter, Unit};

pub const TLS_HANDSHAKE_FAILURES: &str = "xfer_tls_handshake_failures_total";
pub const RPC_DENIED: &str = "xfer_rpc_denied_total";

pub fn describe() {
    describe_counter!(
        TLS_HANDSHAKE_FAILURES,
        Unit::Count,
        "TLS handshakes the gRPC port refused, by reason (no_certificate, unknown_ca: the certificate does not chain to tls.ca, expired, bad_certificate, client_alert: the client refused this agent's certificate, protocol: not TLS, e.g. plaintext, timeout, closed, evicted: closed in its handshake by newer sockets at the pending cap, other)."
    );
    describe_counter!(
        RPC_DENIED,
        Unit::Count,
        "Calls refused before any handler ran, by method (package.Service/Method; unknown for methods this agent does not serve) and the caller's role (node, client, admin; none: a certificate with no xfer role)."
    );
}

/// A refused handshake (`reason` from the closed set of `service::handshake::Refusal`).
pub fn tls_handshake_failure(reason: &'static str) {
    counter!(TLS_HANDSHAKE_FAILURES, "reason" => reason).increment(1);
}

/// A call the role table refused: `method` is a served `package.Service/Method` or `unknown`
/// (`service::auth::method_label`), so the label stays bounded.
pub fn rpc_denied(method: String, role: &'static str) {
    counter!(RPC_DENIED, "method" => method, "role" => role).increment(1);
}
