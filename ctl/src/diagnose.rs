//! Telling apart why a connection to an agent failed, so the message says what to change: TLS
//! sent to a plaintext agent, plaintext sent to an mTLS agent, `--agent` pointed at the metrics
//! or health port (HTTP/1), no client certificate, a client certificate from another CA, an
//! agent certificate the `--ca` does not vouch for. The transport's error text alone cannot tell
//! some of these apart (TLS to a plaintext agent and TLS to the metrics port both read "corrupt
//! message"), so the address is probed once, only after a failure: one HTTP/1.0 request, and the
//! first bytes of the answer say what listens there.
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

/// The agent this process connected to last, and how: what a failed call is explained against.
#[derive(Debug, Clone, Default)]
pub struct Target {
    pub addr: String,
    /// `--ca` was given (the connection is TLS).
    pub tls: bool,
    /// `--cert` and `--key` were given.
    pub client_cert: bool,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub server_name: Option<String>,
}

static LAST_TARGET: Mutex<Option<Target>> = Mutex::new(None);

/// Records the agent a connection is being made to (`crate::client::connect_with`).
pub fn remember(target: Target) {
    *LAST_TARGET.lock().unwrap_or_else(|p| p.into_inner()) = Some(target);
}

/// The agent last connected to.
pub fn last_target() -> Option<Target> {
    LAST_TARGET.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// What answered a probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speaks {
    /// An HTTP/1 server: the agent's metrics/health listener, or something else that is not gRPC.
    Http1,
    /// A TLS server (it answered plaintext with a TLS alert record).
    Tls,
    /// A plaintext HTTP/2 server (it answered with a SETTINGS frame): a plaintext agent.
    PlainGrpc,
    /// Nothing useful (closed, timed out, unreachable, something else).
    Unknown,
}

/// Classifies the first bytes a server sent back to an HTTP/1.0 request.
pub fn classify(reply: &[u8]) -> Speaks {
    if reply.starts_with(b"HTTP/1.") {
        Speaks::Http1
    } else if reply.len() >= 2 && reply[0] == 0x15 && reply[1] == 0x03 {
        Speaks::Tls
    } else if reply.len() >= 9 && reply[3] == 0x04 {
        // An HTTP/2 frame header: 3 bytes length, type 4 (SETTINGS) — the server preface.
        Speaks::PlainGrpc
    } else {
        Speaks::Unknown
    }
}

/// Sends one HTTP/1.0 request to `addr` and classifies the answer (at most a second for each
/// step).
pub fn probe(addr: &str) -> Speaks {
    const STEP: Duration = Duration::from_secs(1);
    let Some(sa) = addr.to_socket_addrs().ok().and_then(|mut a| a.next()) else { return Speaks::Unknown };
    let Ok(mut s) = TcpStream::connect_timeout(&sa, STEP) else { return Speaks::Unknown };
    let _ = s.set_read_timeout(Some(STEP));
    let _ = s.set_write_timeout(Some(STEP));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: xferctl\r\n\r\n").is_err() {
        return Speaks::Unknown;
    }
    let mut buf = [0u8; 16];
    let mut n = 0;
    while n < buf.len() {
        match s.read(&mut buf[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    classify(&buf[..n])
}

/// One TLS handshake with the target's own files, then a read: the agent's verdict on the client
/// certificate comes as an alert after the handshake (TLS 1.3), which a gRPC connection that was
/// already writing may lose to a reset. The rustls error, or None if the handshake and read went
/// through (or could not be tried).
pub fn tls_probe(target: &Target) -> Option<String> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    const STEP: Duration = Duration::from_secs(2);
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(target.ca.as_ref()?).ok()? {
        roots.add(c.ok()?).ok()?;
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder =
        rustls::ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions().ok()?.with_root_certificates(roots);
    let config = match (&target.cert, &target.key) {
        (Some(c), Some(k)) => {
            let chain = CertificateDer::pem_file_iter(c).ok()?.collect::<Result<Vec<_>, _>>().ok()?;
            builder.with_client_auth_cert(chain, PrivateKeyDer::from_pem_file(k).ok()?).ok()?
        }
        _ => builder.with_no_client_auth(),
    };
    let host = target.server_name.clone().unwrap_or_else(|| host_of(&target.addr).to_string());
    let name = ServerName::try_from(host).ok()?;
    let mut conn = rustls::ClientConnection::new(std::sync::Arc::new(config), name).ok()?;
    let sa = target.addr.to_socket_addrs().ok()?.next()?;
    let mut sock = TcpStream::connect_timeout(&sa, STEP).ok()?;
    sock.set_read_timeout(Some(STEP)).ok()?;
    sock.set_write_timeout(Some(STEP)).ok()?;
    let mut tls = rustls::Stream::new(&mut conn, &mut sock);
    let mut byte = [0u8; 1];
    match tls.flush().and_then(|()| tls.read(&mut byte)) {
        Err(e) => Some(e.to_string()),
        Ok(_) => None,
    }
}

fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    addr.rsplit_once(':').map_or(addr, |(h, _)| h)
}

/// Whether a transport error reads like the two ends disagree on the protocol or on identity
/// (worth a probe), rather than like nobody listening.
fn looks_like_mismatch(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    [
        "corrupt message",
        "invalidcontenttype",
        "frame with invalid size",
        "broken pipe",
        "connection reset",
        "h2 protocol",
        "http2",
        "alert",
        "certificate",
        "tls",
        "unexpected eof",
        "handshake",
    ]
    .iter()
    .any(|k| t.contains(k))
}

/// The line (message and hint, no status suffix) for a failed connection to `target` whose
/// transport said `text`; None when nothing better than the transport's own words is known.
pub fn explain(target: &Target, text: &str) -> Option<String> {
    if !looks_like_mismatch(text) {
        return None;
    }
    let speaks = probe(&target.addr);
    if speaks == Speaks::Tls && target.tls {
        if let Some(verdict) = tls_probe(target) {
            return explain_with(target, &verdict, speaks);
        }
    }
    explain_with(target, text, speaks)
}

/// [`explain`] with the probe's answer given (for tests).
pub fn explain_with(target: &Target, text: &str, speaks: Speaks) -> Option<String> {
    let addr = &target.addr;
    match (speaks, target.tls) {
        (Speaks::Http1, _) => Some(format!(
            "{addr} answers HTTP/1, not gRPC: it is likely the agent's metrics/health port (metrics_listen, 9470 by \
             default); point --agent (or $XFER_AGENT) at the agent's gRPC address (listen, port 7470 by default)"
        )),
        (Speaks::PlainGrpc, true) => Some(format!(
            "the agent at {addr} speaks plaintext (insecure = true), not TLS: drop --ca, --cert and --key (and $XFER_CA, \
             $XFER_CERT, $XFER_KEY) to talk to it, or run it with mTLS"
        )),
        (Speaks::Tls, false) => Some(format!(
            "the agent at {addr} requires mTLS and this connection was plaintext: give --ca, --cert and --key (or \
             $XFER_CA, $XFER_CERT, $XFER_KEY), a client certificate and key issued by the agent's CA"
        )),
        (_, true) => explain_tls(target, text),
        _ => None,
    }
}

/// A TLS connection to a TLS agent that failed: whose certificate was refused, and why.
fn explain_tls(target: &Target, text: &str) -> Option<String> {
    let addr = &target.addr;
    let t = text.to_ascii_lowercase();
    if t.contains("certificaterequired") || (!target.client_cert && t.contains("alert")) {
        return Some(format!(
            "the agent at {addr} requires a client certificate (mTLS) and none was given: add --cert and --key (or \
             $XFER_CERT, $XFER_KEY) issued by the agent's CA"
        ));
    }
    if t.contains("received fatal alert") {
        return Some(format!(
            "the agent at {addr} refused the client certificate ({text}): it must be issued by the CA in the agent's \
             tls.ca and be valid now (the agent counts the reason in xfer_tls_handshake_failures_total)"
        ));
    }
    if t.contains("notvalidforname") || t.contains("not valid for name") {
        return Some(format!(
            "the agent's certificate does not carry the name {addr} was reached by: pass --tls-server-name with one of \
             its DNS names (e.g. the agent's node name, or the chart's xfer-agent.NAMESPACE.svc)"
        ));
    }
    if t.contains("unknownissuer") || t.contains("unknown issuer") || t.contains("invalid peer certificate") {
        let ca = target.ca.as_deref().map(|p| p.display().to_string()).unwrap_or_default();
        return Some(format!(
            "the agent's certificate is not vouched for by --ca {ca} ({text}): give the CA that issued the agents' \
             certificates"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(tls: bool, client_cert: bool) -> Target {
        Target { addr: "127.0.0.1:7470".into(), tls, client_cert, ca: tls.then(|| "ca.crt".into()), ..Default::default() }
    }

    #[test]
    fn probes_read_the_first_bytes() {
        assert_eq!(classify(b"HTTP/1.0 200 OK\r\n"), Speaks::Http1);
        assert_eq!(classify(&[0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x32]), Speaks::Tls);
        assert_eq!(classify(&[0, 0, 0x18, 0x04, 0, 0, 0, 0, 0, 0, 3]), Speaks::PlainGrpc);
        assert_eq!(classify(b""), Speaks::Unknown);
    }

    #[test]
    fn each_mistake_has_its_own_message() {
        let corrupt = "received corrupt message of type InvalidContentType";
        let a = explain_with(&target(true, true), corrupt, Speaks::PlainGrpc).unwrap();
        assert!(a.contains("speaks plaintext") && a.contains("drop --ca"), "{a}");
        let b = explain_with(&target(true, true), corrupt, Speaks::Http1).unwrap();
        assert!(b.contains("metrics/health port"), "{b}");
        let b = explain_with(&target(false, false), "stream closed because of a broken pipe", Speaks::Http1).unwrap();
        assert!(b.contains("metrics/health port"), "{b}");
        let d = explain_with(&target(false, false), "frame with invalid size", Speaks::Tls).unwrap();
        assert!(d.contains("requires mTLS") && d.contains("--cert"), "{d}");
        let e = explain_with(&target(true, false), "received fatal alert: CertificateRequired", Speaks::Tls).unwrap();
        assert!(e.contains("requires a client certificate"), "{e}");
        let f = explain_with(&target(true, true), "received fatal alert: UnknownCA", Speaks::Tls).unwrap();
        assert!(f.contains("refused the client certificate"), "{f}");
        let g = explain_with(&target(true, true), "invalid peer certificate: UnknownIssuer", Speaks::Tls).unwrap();
        assert!(g.contains("not vouched for by --ca ca.crt"), "{g}");
        assert_eq!(explain_with(&target(false, false), "frame with invalid size", Speaks::PlainGrpc), None);
        assert!(!looks_like_mismatch("Connection refused (os error 111)"));
    }
}
