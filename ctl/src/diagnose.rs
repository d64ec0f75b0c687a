//! Telling apart why a connection to an agent failed, so the message says what to change: TLS
//! sent to a plaintext agent, plaintext sent to an mTLS agent, `--agent` pointed at the metrics
//! or health port (HTTP/1), no client certificate, a client certificate from another CA, an
//! agent certificate the `--ca` does not vouch for. The transport's error text alone cannot tell
//! some of these apart (TLS to a plaintext agent and TLS to the metrics port both read "corrupt
//! message"), so the address is probed once, only after a failure: one HTTP/1.0 request, and the
//! first bytes of the answer say what listens there.
//!
//! Whatever answers at the address may be slow or hostile: both probes together get
//! [`DIAGNOSIS_BUDGET`], checked before every read and write ([`Deadline`]), so a server that
//! trickles its handshake a byte at a time cannot keep xferctl from exiting.
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long the probes after a failed connection may take together.
pub const DIAGNOSIS_BUDGET: Duration = Duration::from_secs(5);

/// A socket whose reads and writes fail with `TimedOut` once `until` has passed: each one waits
/// at most the time left (a per-call timeout alone lets a trickling server go on forever).
struct Deadline<'a> {
    sock: &'a TcpStream,
    until: Instant,
}

impl Deadline<'_> {
    fn left(&self) -> std::io::Result<Duration> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the diagnosis ran out of time"));
        }
        Ok(left)
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.sock.set_read_timeout(Some(self.left()?))?;
        (&mut &*self.sock).read(buf)
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.sock.set_write_timeout(Some(self.left()?))?;
        (&mut &*self.sock).write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

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

/// Sends one HTTP/1.0 request to `addr` and classifies the answer (at most a second to connect,
/// and nothing after `until`).
pub fn probe(addr: &str, until: Instant) -> Speaks {
    const STEP: Duration = Duration::from_secs(1);
    let Some(sa) = addr.to_socket_addrs().ok().and_then(|mut a| a.next()) else { return Speaks::Unknown };
    let Ok(sock) = TcpStream::connect_timeout(&sa, STEP) else { return Speaks::Unknown };
    let mut s = Deadline { sock: &sock, until };
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
/// through (or could not be tried). Nothing is read or written after `until`.
pub fn tls_probe(target: &Target, until: Instant) -> Option<String> {
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
    let sock = TcpStream::connect_timeout(&sa, STEP).ok()?;
    let mut io = Deadline { sock: &sock, until };
    let mut tls = rustls::Stream::new(&mut conn, &mut io);
    let mut byte = [0u8; 1];
    match tls.flush().and_then(|()| tls.read(&mut byte)) {
        // Out of time says nothing about certificates: the transport's own words stand.
        Err(e) if matches!(e.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock) => None,
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
    let until = Instant::now() + DIAGNOSIS_BUDGET;
    let speaks = probe(&target.addr, until);
    if speaks == Speaks::Tls && target.tls {
        if let Some(verdict) = tls_probe(target, until) {
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

    /// Any CA certificate: the trickling server never gets as far as presenting one.
    const SOME_CA: &str = "-----BEGIN CERTIFICATE-----\nMIIBijCCATGgAwIBAgIUP+5NRh1NC2fuaLqF6zHab8ufhNcwCgYIKoZIzj0EAwIw\nGjEYMBYGA1UEAwwPeGZlcmN0bCB0ZXN0IENBMCAXDTI2MTEyNzExNTM0OVoYDzIx\nMjYxMTAzMTE1MzQ5WjAaMRgwFgYDVQQDDA94ZmVyY3RsIHRlc3QgQ0EwWTATBgcq\nhkjOPQIBBggqhkjOPQMBBwNCAARN33+2fswWjsuNyx7KZ7Wslq/WoKrJ7ttrerg7\nQ92Sd9kGptV2SyIzi37b/q4tEqitcI11e8sGbfvWEDoS/oeho1MwUTAdBgNVHQ4E\nFgQUr9mwcPXF+MtvoxXc9YvjckHkcT0wHwYDVR0jBBgwFoAUr9mwcPXF+MtvoxXc\n9YvjckHkcT0wDwYDVR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNHADBEAiBX7rz5\n6c2tzyKWn7B/2apsMac/6FaSshIZCDFSEO31BgIgHM3qwRpXcKZqpfFzevLHL9ri\n4/cPs1gZND5+8MumKSw=\n-----END CERTIFICATE-----\n";

    /// A server that announces a 16 KiB handshake record and then sends it a byte at a time (each
    /// byte well inside the per-read timeout) would hold the TLS probe for minutes; the probe
    /// gives up at its deadline and reports nothing about certificates.
    #[test]
    fn a_server_that_trickles_its_handshake_cannot_hold_the_probe() {
        use std::net::TcpListener;
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, SOME_CA).unwrap();
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            if s.write_all(&[0x16, 0x03, 0x03, 0x40, 0x00]).is_err() {
                return 0;
            }
            // The attacker's pace, one byte per 20 ms, until the client goes away.
            let mut sent = 0;
            while s.write_all(&[0]).is_ok() {
                sent += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            sent
        });
        let target = Target { addr: addr.to_string(), tls: true, ca: Some(ca), ..Default::default() };
        assert_eq!(tls_probe(&target, Instant::now() + Duration::from_millis(300)), None);
        let sent = server.join().unwrap();
        assert!(sent < 0x4000, "the probe left before the record was complete ({sent} bytes)");
    }
}
