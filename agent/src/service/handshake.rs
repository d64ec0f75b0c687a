//! The gRPC listener's TLS handshakes, run by the agent rather than inside tonic, so that a refused
//! one is logged and counted with its reason (`xfer_tls_handshake_failures_total{reason}`): a
//! caller with no certificate, one from another CA, an expired one, plaintext sent to the TLS
//! port. tonic would drop them silently. Each accepted socket's handshake runs in its own task
//! (one slow client holds only its own listener slot, for at most the handshake timeout); the
//! streams that complete it are handed to tonic in the order they finish.
//!
//! Sockets still in their handshake are unauthenticated, so they may hold only part of the
//! listener's slots: at most `max_pending` at once, and a newer one closes the oldest (reason
//! `evicted`), as the data port does before a hello. Without that, sockets that never send a
//! ClientHello, reopened every handshake timeout, would keep every client with a certificate out.
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::{Stream, StreamExt};
use rustls::{AlertDescription, CertificateError, Error as RustlsError};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Connected;

use crate::metrics;

/// Why a handshake was refused: a closed set, so the metric's label stays bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The client presented no certificate (mTLS requires one).
    NoCertificate,
    /// The client's certificate does not chain to `tls.ca`.
    UnknownCa,
    /// The client's certificate has expired or is not valid yet.
    Expired,
    /// Any other certificate problem: wrong key usage, bad signature, revoked, unparsable.
    BadCertificate,
    /// The client refused this agent's certificate (it sent an alert: e.g. it trusts another CA).
    ClientAlert,
    /// Not TLS, or broken TLS: e.g. plaintext HTTP/2 sent to the TLS port.
    Protocol,
    /// No complete handshake within the handshake timeout.
    Timeout,
    /// The socket closed before the handshake finished (a TCP probe, a client that gave up).
    Closed,
    /// Closed by a newer socket while still in its handshake: `max_pending` were already there.
    Evicted,
    Other,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::NoCertificate => "no_certificate",
            Refusal::UnknownCa => "unknown_ca",
            Refusal::Expired => "expired",
            Refusal::BadCertificate => "bad_certificate",
            Refusal::ClientAlert => "client_alert",
            Refusal::Protocol => "protocol",
            Refusal::Timeout => "timeout",
            Refusal::Closed => "closed",
            Refusal::Evicted => "evicted",
            Refusal::Other => "other",
        }
    }

    /// Every reason, for describing the metric and for tests.
    pub const ALL: [Refusal; 10] = [
        Refusal::NoCertificate,
        Refusal::UnknownCa,
        Refusal::Expired,
        Refusal::BadCertificate,
        Refusal::ClientAlert,
        Refusal::Protocol,
        Refusal::Timeout,
        Refusal::Closed,
        Refusal::Evicted,
        Refusal::Other,
    ];

    /// What a failed server-side handshake says about the client.
    pub fn of(e: &std::io::Error) -> Refusal {
        if let Some(tls) = e.get_ref().and_then(|inner| inner.downcast_ref::<RustlsError>()) {
            return Refusal::of_tls(tls);
        }
        match e.kind() {
            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe => Refusal::Closed,
            std::io::ErrorKind::InvalidData => Refusal::Protocol,
            _ => Refusal::Other,
        }
    }

    pub fn of_tls(e: &RustlsError) -> Refusal {
        use CertificateError as C;
        match e {
            RustlsError::NoCertificatesPresented => Refusal::NoCertificate,
            RustlsError::InvalidCertificate(c) => match c {
                C::UnknownIssuer => Refusal::UnknownCa,
                C::Expired | C::ExpiredContext { .. } | C::NotValidYet | C::NotValidYetContext { .. } => Refusal::Expired,
                _ => Refusal::BadCertificate,
            },
            RustlsError::AlertReceived(AlertDescription::CertificateRequired) => Refusal::NoCertificate,
            RustlsError::AlertReceived(_) => Refusal::ClientAlert,
            RustlsError::InvalidMessage(_)
            | RustlsError::InappropriateMessage { .. }
            | RustlsError::InappropriateHandshakeMessage { .. }
            | RustlsError::PeerIncompatible(_)
            | RustlsError::PeerMisbehaved(_)
            | RustlsError::NoApplicationProtocol
            | RustlsError::DecryptError => Refusal::Protocol,
            _ => Refusal::Other,
        }
    }
}

/// Logs a refusal at most about once a second (a port scan must not flood the log); the counter
/// sees every one.
fn log_refusal(reason: Refusal, remote: Option<std::net::SocketAddr>, error: &dyn std::fmt::Display) {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    if LAST.swap(now, Ordering::Relaxed) != now {
        let remote = remote.map(|a| a.to_string()).unwrap_or_default();
        tracing::warn!(reason = reason.as_str(), %remote, %error, "TLS handshake refused on the gRPC port (xfer_tls_handshake_failures_total counts them all)");
    }
}

/// The remote address of an accepted socket, for the log.
pub trait Remote {
    fn remote(&self) -> Option<std::net::SocketAddr>;
}

impl<S: Connected<ConnectInfo = tonic::transport::server::TcpConnectInfo>> Remote for S {
    fn remote(&self) -> Option<std::net::SocketAddr> {
        self.connect_info().remote_addr()
    }
}

/// How long a refused client has to read the alert that says why.
const LINGER: Duration = Duration::from_secs(1);

/// Closes a refused socket so that the client reads the alert (e.g. "CertificateRequired"): the
/// write side first, then what the client still sends is read and dropped until it closes, for at
/// most [`LINGER`]. Closing with unread bytes would send a reset, and a client that is already
/// writing its first request then sees only "connection closed".
async fn linger<IO: AsyncRead + AsyncWrite + Unpin>(mut io: IO) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = io.shutdown().await;
    let mut sink = [0u8; 1024];
    let _ = tokio::time::timeout(LINGER, async {
        while let Ok(n) = io.read(&mut sink).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
}

/// Sockets in their handshake (or lingering after a refusal), oldest first by accept order.
/// Entering at the cap cancels the oldest: a flood of silent sockets only shortens every silent
/// socket's life, it cannot hold the slots that clients with certificates need.
struct Pending {
    queue: Mutex<(u64, BTreeMap<u64, CancellationToken>)>,
    max: usize,
}

impl Pending {
    fn new(max: usize) -> Arc<Pending> {
        Arc::new(Pending { queue: Mutex::new((0, BTreeMap::new())), max: max.max(1) })
    }

    /// A place for one more socket; the oldest ones are cancelled to make room.
    fn enter(self: &Arc<Self>) -> PendingSlot {
        let token = CancellationToken::new();
        // A poisoned lock means a panic while holding it; the map is still consistent.
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        while q.1.len() >= self.max {
            let Some((_, oldest)) = q.1.pop_first() else { break };
            oldest.cancel();
        }
        let id = q.0;
        q.0 += 1;
        q.1.insert(id, token.clone());
        PendingSlot { pending: self.clone(), id, token }
    }
}

/// A socket's place among the [`Pending`]; dropped when its handshake ends either way.
struct PendingSlot {
    pending: Arc<Pending>,
    id: u64,
    token: CancellationToken,
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        self.pending.queue.lock().unwrap_or_else(|e| e.into_inner()).1.remove(&self.id);
    }
}

/// The TLS streams of the sockets `incoming` accepts, each after its handshake with `config`
/// succeeded within `timeout`; refused handshakes are counted and logged, never yielded. At most
/// `max_pending` sockets are in their handshake at once; a newer one closes the oldest. Accept
/// errors pass through. Ends when `incoming` ends or the consumer drops the stream.
pub fn tls_incoming<S, IO>(
    incoming: S,
    config: Arc<rustls::ServerConfig>,
    timeout: Duration,
    max_pending: usize,
) -> impl Stream<Item = std::io::Result<TlsStream<IO>>> + Send + 'static
where
    S: Stream<Item = std::io::Result<IO>> + Send + 'static,
    IO: AsyncRead + AsyncWrite + Unpin + Send + Remote + 'static,
{
    let acceptor = TlsAcceptor::from(config);
    let pending = Pending::new(max_pending);
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<TlsStream<IO>>>(64);
    tokio::spawn(async move {
        let mut incoming = std::pin::pin!(incoming);
        loop {
            let next = tokio::select! {
                () = tx.closed() => return,
                next = incoming.next() => next,
            };
            let io = match next {
                None => return,
                Some(Err(e)) => {
                    if tx.send(Err(e)).await.is_err() {
                        return;
                    }
                    continue;
                }
                Some(Ok(io)) => io,
            };
            // Entered here, in accept order, so that the oldest is the one evicted.
            let slot = pending.enter();
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                let remote = io.remote();
                let handshake = tokio::time::timeout(timeout, acceptor.accept(io).into_fallible());
                let outcome = tokio::select! {
                    () = slot.token.cancelled() => {
                        metrics::tls_handshake_failure(Refusal::Evicted.as_str());
                        log_refusal(Refusal::Evicted, remote, &"newer sockets were waiting for a handshake slot");
                        return;
                    }
                    outcome = handshake => outcome,
                };
                match outcome {
                    Ok(Ok(tls)) => {
                        drop(slot);
                        // The server is gone when this fails; the stream closes with it.
                        let _ = tx.send(Ok(tls)).await;
                    }
                    Ok(Err((e, io))) => {
                        let reason = Refusal::of(&e);
                        metrics::tls_handshake_failure(reason.as_str());
                        log_refusal(reason, remote, &e);
                        // Still unauthenticated: a newer socket may cut the linger short.
                        tokio::select! {
                            () = slot.token.cancelled() => {}
                            () = linger(io) => {}
                        }
                    }
                    Err(_) => {
                        metrics::tls_handshake_failure(Refusal::Timeout.as_str());
                        log_refusal(Refusal::Timeout, remote, &"no complete handshake in time");
                    }
                }
            });
        }
    });
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_read_from_rustls_errors() {
        let io = |e: RustlsError| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
        assert_eq!(Refusal::of(&io(RustlsError::NoCertificatesPresented)), Refusal::NoCertificate);
        assert_eq!(Refusal::of(&io(RustlsError::InvalidCertificate(CertificateError::UnknownIssuer))), Refusal::UnknownCa);
        assert_eq!(Refusal::of(&io(RustlsError::InvalidCertificate(CertificateError::Expired))), Refusal::Expired);
        assert_eq!(Refusal::of(&io(RustlsError::InvalidCertificate(CertificateError::InvalidPurpose))), Refusal::BadCertificate);
        assert_eq!(Refusal::of(&io(RustlsError::AlertReceived(AlertDescription::UnknownCA))), Refusal::ClientAlert);
        assert_eq!(Refusal::of(&io(RustlsError::InvalidMessage(rustls::InvalidMessage::InvalidContentType))), Refusal::Protocol);
        assert_eq!(Refusal::of(&std::io::Error::from(std::io::ErrorKind::UnexpectedEof)), Refusal::Closed);
        assert_eq!(Refusal::of(&std::io::Error::other("x")), Refusal::Other);
        let names: std::collections::HashSet<_> = Refusal::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(names.len(), Refusal::ALL.len());
    }

    /// At the cap, entering cancels the oldest socket first, and a socket that left makes room
    /// without cancelling anyone.
    #[test]
    fn the_oldest_pending_socket_makes_room() {
        let p = Pending::new(2);
        let first = p.enter();
        let second = p.enter();
        assert!(!first.token.is_cancelled() && !second.token.is_cancelled());
        let third = p.enter();
        assert!(first.token.is_cancelled(), "the oldest was evicted");
        assert!(!second.token.is_cancelled() && !third.token.is_cancelled());
        drop(second);
        let fourth = p.enter();
        assert!(!third.token.is_cancelled() && !fourth.token.is_cancelled(), "a socket that left made room");
        let _fifth = p.enter();
        assert!(third.token.is_cancelled() && !fourth.token.is_cancelled());
    }
}
