//! Kernel TLS (kTLS) for the tcp fabric's data streams (`tls.kernel = auto`): rustls runs the
//! handshake and the agent checks the peer's certificate on the rustls session, then the stream's
//! record layer (encryption, decryption, record framing) is handed to the kernel, so a payload
//! goes between region memory and the socket without a copy through rustls's buffers.
//!
//! What the kernel needs, and what this module does for it:
//! * the `tls` upper-layer protocol (the `tls` module) and the negotiated suite's AEAD for the
//!   TLS version (AES-128-GCM, AES-256-GCM or ChaCha20-Poly1305, TLS 1.2 or 1.3). Which of
//!   those the kernel takes is probed once per process ([`CompatibleCiphers`]); with none,
//!   every stream stays with rustls, and the agent says why once.
//! * no bytes read ahead of it: with `auto` the handshake runs on a [`CorkStream`] (it reads one
//!   record at a time) instead of the buffered socket ([`super::wire::tls_socket`]), and whatever
//!   rustls already decrypted is drained and handed out before the kernel's bytes.
//! * no record it cannot decrypt as data after the handshake: data-plane servers send no TLS 1.3
//!   session tickets (see [`crate::identity::tls::data_tls`]); a ticket from an older peer is
//!   skipped, and a key update (which the kernel cannot follow) ends the stream with an error.
//!
//! A stream whose suite the kernel cannot take stays with rustls on its [`CorkStream`]. The
//! conversion takes the rustls session's keys out of it, so a kernel that refuses the keys after
//! the probe accepted the suite fails that one stream (counted `failed`, logged); later streams
//! then stay with rustls.
use std::io::{self, IoSliceMut};
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{ready, Context, Poll};

use ::ktls::{CompatibleCiphers, CorkStream, KtlsStream};
use nix::errno::Errno;
use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags, TlsGetRecordType};
use rustls::{CipherSuite, SupportedCipherSuite};
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, BufReader, Interest, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::OnceCell;
use tracing::{debug, warn};
use xfer_rdma::scatter::ScatterRead;

use super::qp::{BoxRead, BoxWrite};
use super::wire::tls_socket;
use crate::identity::tls::{DataTls, KernelTls, SEND_BUFFER};

pub(super) const INITIATOR: &str = "initiator";
pub(super) const TARGET: &str = "target";

/// The largest TLS record plaintext (2^14) and a margin: a control record read whole.
const RECORD_MAX: usize = (16 << 10) + 256;

/// What this process's kernel offers, probed at the first stream that wants it.
enum Support {
    Ciphers(CompatibleCiphers),
    /// Why no stream can go to the kernel.
    None(String),
}

/// What the process knows of its kernel's TLS: one for the process ([`KERNEL`]); unit tests
/// make their own.
pub(super) struct KernelState {
    support: OnceCell<Support>,
    /// The kernel refused a stream's keys after the probe accepted its suite: later streams
    /// stay with rustls rather than lose their stream too.
    refused: AtomicBool,
    /// The fallback has been logged at warn level (later ones at debug).
    warned: AtomicBool,
}

static KERNEL: KernelState = KernelState::new();

impl KernelState {
    const fn new() -> KernelState {
        KernelState { support: OnceCell::const_new(), refused: AtomicBool::new(false), warned: AtomicBool::new(false) }
    }

    async fn support(&self) -> &Support {
        self.support
            .get_or_init(|| async {
                match CompatibleCiphers::new().await {
                    Err(e) => Support::None(format!("probing the kernel's TLS failed: {e}")),
                    Ok(c) if !any_cipher(&c) => Support::None(why_none()),
                    Ok(c) => Support::Ciphers(c),
                }
            })
            .await
    }

    /// Whether a new stream's handshake should prepare for the kernel (`auto`, and the kernel
    /// can take some suite): `Err(None)` for `off` (never probes, never counts),
    /// `Err(Some(why))` when `auto` must stay with rustls.
    async fn wanted(&self, kernel: KernelTls) -> Result<(), Option<String>> {
        if kernel == KernelTls::Off {
            return Err(None);
        }
        if self.refused.load(Ordering::Acquire) {
            return Err(Some("the kernel refused an earlier stream's keys".into()));
        }
        match self.support().await {
            Support::None(why) => Err(Some(why.clone())),
            Support::Ciphers(_) => Ok(()),
        }
    }

    fn fell_back(&self, role: &'static str, why: &str) {
        crate::metrics::data_ktls_stream(role, "fallback");
        if !self.warned.swap(true, Ordering::AcqRel) {
            warn!(role, reason = why, "tcp fabric: tls.kernel = auto, but data streams stay with rustls in user space");
        } else {
            debug!(role, reason = why, "tcp fabric: data stream stays with rustls in user space");
        }
    }

    fn suite_check(&self, suite: Option<SupportedCipherSuite>) -> Result<(), String> {
        match (self.support.get(), suite) {
            (Some(Support::Ciphers(c)), Some(suite)) => kernel_takes(c, suite),
            (_, None) => Err("no negotiated cipher suite".into()),
            (_, Some(_)) => Err("the kernel's TLS was not probed".into()),
        }
    }

    fn converted(&self, role: &'static str, r: Result<KtlsStream<TcpStream>, ::ktls::Error>) -> io::Result<(BoxRead, BoxWrite)> {
        match r {
            Ok(k) => {
                crate::metrics::data_ktls_stream(role, "kernel");
                let (drained, socket) = k.into_raw();
                let (rd, wr) = socket.into_split();
                let reader = KernelReader { rd, pending: drained.unwrap_or_default(), pos: 0, closed: false };
                Ok((Box::new(reader), Box::new(KernelWriter(KtlsStream::new(WriteFd(wr), None)))))
            }
            Err(e) => {
                crate::metrics::data_ktls_stream(role, "failed");
                // A drain error is the peer's (a read failed); anything else is the kernel's
                // answer to the keys, and would be the same for the next stream.
                if !matches!(e, ::ktls::Error::DrainError(_)) && !self.refused.swap(true, Ordering::AcqRel) {
                    warn!(role, error = %e, "tcp fabric: the kernel refused a data stream's TLS keys; later streams stay with rustls");
                }
                Err(io::Error::other(format!("handing the stream's TLS to the kernel failed: {e}")))
            }
        }
    }
}

fn any_cipher(c: &CompatibleCiphers) -> bool {
    [&c.tls12, &c.tls13].iter().any(|v| v.aes_gcm_128 || v.aes_gcm_256 || v.chacha20_poly1305)
}

/// Why the probe found no cipher: most often, no `tls` module.
fn why_none() -> String {
    match std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_ulp") {
        Ok(ulps) if !ulps.split_whitespace().any(|u| u == "tls") => {
            format!("the kernel has no tls module loaded (tcp_available_ulp: {:?}; `modprobe tls` as root)", ulps.trim())
        }
        _ => "the kernel refused every kTLS cipher (AES-GCM and ChaCha20-Poly1305, TLS 1.2 and 1.3)".into(),
    }
}

/// Whether the kernel takes `suite` (its AEAD, for its TLS version).
fn kernel_takes(c: &CompatibleCiphers, suite: SupportedCipherSuite) -> Result<(), String> {
    let (ciphers, version) = match suite {
        SupportedCipherSuite::Tls12(_) => (&c.tls12, "TLS 1.2"),
        SupportedCipherSuite::Tls13(_) => (&c.tls13, "TLS 1.3"),
    };
    let takes = match suite.suite() {
        CipherSuite::TLS13_AES_128_GCM_SHA256
        | CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
        | CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256 => ciphers.aes_gcm_128,
        CipherSuite::TLS13_AES_256_GCM_SHA384
        | CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384
        | CipherSuite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384 => ciphers.aes_gcm_256,
        CipherSuite::TLS13_CHACHA20_POLY1305_SHA256
        | CipherSuite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256
        | CipherSuite::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256 => ciphers.chacha20_poly1305,
        _ => false,
    };
    if takes {
        Ok(())
    } else {
        Err(format!("the kernel cannot take the negotiated {version} suite {:?}", suite.suite()))
    }
}

/// A data stream after its TLS handshake, before its identity is acted on and its halves made.
pub(super) struct Handshaken {
    stream: Stream,
    kernel: &'static KernelState,
    /// Why an `auto` stream was handshaken for rustls alone (`None`: `off`, or ready for the
    /// kernel); counted and said once the handshake succeeded.
    user_because: Option<String>,
}

enum Stream {
    ClientUser(tokio_rustls::client::TlsStream<BufReader<TcpStream>>),
    ClientCorked(tokio_rustls::client::TlsStream<CorkStream<TcpStream>>),
    ServerUser(tokio_rustls::server::TlsStream<BufReader<TcpStream>>),
    ServerCorked(tokio_rustls::server::TlsStream<CorkStream<TcpStream>>),
}

/// The initiator's handshake on `stream`, verifying the target for `name`.
pub(super) async fn connect(tls: &DataTls, name: ServerName<'static>, stream: TcpStream) -> io::Result<Handshaken> {
    connect_with(&KERNEL, tls, name, stream).await
}

/// The target's handshake on an accepted `stream`.
pub(super) async fn accept(tls: &DataTls, stream: TcpStream) -> io::Result<Handshaken> {
    accept_with(&KERNEL, tls, stream).await
}

async fn connect_with(kernel: &'static KernelState, tls: &DataTls, name: ServerName<'static>, stream: TcpStream) -> io::Result<Handshaken> {
    let connector = tokio_rustls::TlsConnector::from(tls.client.clone());
    let (stream, user_because) = match kernel.wanted(tls.kernel).await {
        Ok(()) => (Stream::ClientCorked(connector.connect(name, CorkStream::new(stream)).await?), None),
        Err(why) => (Stream::ClientUser(connector.connect(name, tls_socket(stream)).await?), why),
    };
    Ok(Handshaken { stream, kernel, user_because })
}

async fn accept_with(kernel: &'static KernelState, tls: &DataTls, stream: TcpStream) -> io::Result<Handshaken> {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.server.clone());
    let (stream, user_because) = match kernel.wanted(tls.kernel).await {
        Ok(()) => (Stream::ServerCorked(acceptor.accept(CorkStream::new(stream)).await?), None),
        Err(why) => (Stream::ServerUser(acceptor.accept(tls_socket(stream)).await?), why),
    };
    Ok(Handshaken { stream, kernel, user_because })
}

impl Handshaken {
    /// The peer's verified certificate chain, from the rustls session.
    pub(super) fn peer_certificates(&self) -> Option<&[CertificateDer<'static>]> {
        match &self.stream {
            Stream::ClientUser(s) => s.get_ref().1.peer_certificates(),
            Stream::ClientCorked(s) => s.get_ref().1.peer_certificates(),
            Stream::ServerUser(s) => s.get_ref().1.peer_certificates(),
            Stream::ServerCorked(s) => s.get_ref().1.peer_certificates(),
        }
    }

    /// The stream's halves: the kernel's record layer where the handshake prepared for it and
    /// the kernel takes the suite, else rustls's. Call after the peer's identity was checked.
    pub(super) async fn into_halves(self) -> io::Result<(BoxRead, BoxWrite)> {
        let role = match self.stream {
            Stream::ClientUser(_) | Stream::ClientCorked(_) => INITIATOR,
            Stream::ServerUser(_) | Stream::ServerCorked(_) => TARGET,
        };
        let kernel = self.kernel;
        if let Some(why) = &self.user_because {
            kernel.fell_back(role, why);
        }
        match self.stream {
            Stream::ClientUser(s) => Ok(user_client(s)),
            Stream::ServerUser(s) => Ok(user_server(s)),
            Stream::ClientCorked(s) => match kernel.suite_check(s.get_ref().1.negotiated_cipher_suite()) {
                Ok(()) => kernel.converted(INITIATOR, ::ktls::config_ktls_client(s).await),
                Err(why) => {
                    kernel.fell_back(INITIATOR, &why);
                    Ok(user_client(s))
                }
            },
            Stream::ServerCorked(s) => match kernel.suite_check(s.get_ref().1.negotiated_cipher_suite()) {
                Ok(()) => kernel.converted(TARGET, ::ktls::config_ktls_server(s).await),
                Err(why) => {
                    kernel.fell_back(TARGET, &why);
                    Ok(user_server(s))
                }
            },
        }
    }
}

/// A client stream that stays with rustls: its halves, with a send buffer larger than rustls's
/// default ([`SEND_BUFFER`]).
fn user_client<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(mut s: tokio_rustls::client::TlsStream<S>) -> (BoxRead, BoxWrite) {
    s.get_mut().1.set_buffer_limit(Some(SEND_BUFFER));
    split(s)
}

/// [`user_client`] for the target's side.
fn user_server<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(mut s: tokio_rustls::server::TlsStream<S>) -> (BoxRead, BoxWrite) {
    s.get_mut().1.set_buffer_limit(Some(SEND_BUFFER));
    split(s)
}

fn split<S: AsyncRead + AsyncWrite + Send + 'static>(s: S) -> (BoxRead, BoxWrite) {
    let (rd, wr) = tokio::io::split(s);
    (Box::new(rd), Box::new(wr))
}

/// The receiving half of a kernel TLS stream: what rustls had decrypted, then the socket. A
/// record that is not application data makes the socket's read fail with EIO; it is then read
/// with its record type, and skipped (a session ticket), or ends the stream (close_notify:
/// end of stream; any other alert, a key update or another record type: an error).
struct KernelReader {
    rd: OwnedReadHalf,
    pending: Vec<u8>,
    pos: usize,
    closed: bool,
}

/// A `poll_read` per buffer (the default), not a `readv` of the socket: a record that is not
/// application data fails a plain read with EIO and must then be read with its record type (see
/// `poll_read`).
impl ScatterRead for KernelReader {}

impl AsyncRead for KernelReader {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.pos < this.pending.len() {
                let n = (this.pending.len() - this.pos).min(out.remaining());
                out.put_slice(&this.pending[this.pos..this.pos + n]);
                this.pos += n;
                if this.pos == this.pending.len() {
                    (this.pending, this.pos) = (Vec::new(), 0);
                }
                return Poll::Ready(Ok(()));
            }
            if this.closed || out.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            match ready!(Pin::new(&mut this.rd).poll_read(cx, out)) {
                Err(e) if e.raw_os_error() == Some(Errno::EIO as i32) => this.control_record()?,
                r => return Poll::Ready(r),
            }
        }
    }
}

impl KernelReader {
    /// Reads the record the kernel would not hand over as data, with its type (see the type's
    /// docs). Its bytes, if it is data after all, are kept for the next read.
    fn control_record(&mut self) -> io::Result<()> {
        let mut record = vec![0u8; RECORD_MAX];
        let mut space = [0u8; 64];
        let fd: RawFd = self.rd.as_ref().as_raw_fd();
        let got = self.rd.as_ref().try_io(Interest::READABLE, || {
            let mut iov = [IoSliceMut::new(&mut record)];
            let msg = recvmsg::<()>(fd, &mut iov, Some(&mut space), MsgFlags::empty())?;
            let kind = msg.cmsgs()?.find_map(|c| match c {
                ControlMessageOwned::TlsGetRecordType(t) => Some(t),
                _ => None,
            });
            Ok((msg.bytes, kind))
        });
        let (n, kind) = match got {
            // Readiness was spent: the next poll waits for the socket again.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            r => r?,
        };
        record.truncate(n);
        match kind {
            None | Some(TlsGetRecordType::ApplicationData) => {
                (self.pending, self.pos) = (record, 0);
                self.closed = n == 0;
                Ok(())
            }
            Some(TlsGetRecordType::Alert) => match record[..] {
                [_, 0] => {
                    self.closed = true;
                    Ok(())
                }
                [level, description] => {
                    Err(io::Error::new(io::ErrorKind::ConnectionAborted, format!("the peer sent TLS alert {description} (level {level})")))
                }
                _ => Err(io::Error::new(io::ErrorKind::InvalidData, "a malformed TLS alert")),
            },
            Some(TlsGetRecordType::Handshake) if only_session_tickets(&record) => Ok(()),
            Some(TlsGetRecordType::Handshake) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the peer sent a TLS handshake message after the handshake (a key update?), which the kernel cannot follow",
            )),
            Some(other) => {
                Err(io::Error::new(io::ErrorKind::InvalidData, format!("the peer sent a TLS {other:?} record after the handshake")))
            }
        }
    }
}

/// Whether a handshake record holds whole NewSessionTicket messages only (type 4, 24-bit length).
fn only_session_tickets(mut record: &[u8]) -> bool {
    const NEW_SESSION_TICKET: u8 = 4;
    if record.is_empty() {
        return false;
    }
    while let [kind, a, b, c, rest @ ..] = record {
        let len = u32::from_be_bytes([0, *a, *b, *c]) as usize;
        if *kind != NEW_SESSION_TICKET || rest.len() < len {
            return false;
        }
        record = &rest[len..];
    }
    record.is_empty()
}

/// The socket's write half, for [`KtlsStream`] (which sends close_notify on shutdown).
struct WriteFd(OwnedWriteHalf);

impl AsRawFd for WriteFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_ref().as_raw_fd()
    }
}

impl AsyncWrite for WriteFd {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// The sending half of a kernel TLS stream. Writes go straight to the socket, vectored ones
/// too (a frame's header and payload leave in one system call, and the kernel cuts records),
/// which [`KtlsStream`] alone would split into one write per buffer.
struct KernelWriter(KtlsStream<WriteFd>);

impl AsyncWrite for KernelWriter {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0.get_mut().0).poll_write(cx, buf)
    }
    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0.get_mut().0).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        true
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0.get_mut().0).poll_flush(cx)
    }
    /// close_notify, then the socket's write side.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod stream_tests;

#[cfg(test)]
mod tests {
    use ::ktls::CompatibleCiphersForVersion;

    use super::*;

    #[test]
    fn session_tickets_are_told_from_other_handshake_messages() {
        let ticket = |n: usize| [vec![4u8, 0, 0, n as u8], vec![7u8; n]].concat();
        assert!(only_session_tickets(&ticket(10)));
        assert!(only_session_tickets(&[ticket(10), ticket(3)].concat()));
        // key_update (24), one byte long
        assert!(!only_session_tickets(&[24, 0, 0, 1, 0]));
        assert!(!only_session_tickets(&[ticket(10), vec![24, 0, 0, 1, 0]].concat()));
        // cut short, or a stray byte after a whole ticket
        assert!(!only_session_tickets(&ticket(10)[..8]));
        assert!(!only_session_tickets(&[ticket(2), vec![4]].concat()));
        assert!(!only_session_tickets(&[]));
    }

    /// Every suite of the data plane's configs (ring's, TLS 1.2 and 1.3) maps to the kernel
    /// cipher of its AEAD, so a kernel with all three takes any negotiated suite; one without
    /// ChaCha20-Poly1305 does not take the ChaCha suites.
    #[test]
    fn every_suite_of_the_data_configs_maps_to_a_kernel_cipher() {
        let all = CompatibleCiphersForVersion { aes_gcm_128: true, aes_gcm_256: true, chacha20_poly1305: true };
        let no_chacha = CompatibleCiphersForVersion { aes_gcm_128: true, aes_gcm_256: true, chacha20_poly1305: false };
        let full = CompatibleCiphers { tls12: all, tls13: CompatibleCiphersForVersion { ..all_of() } };
        let partial = CompatibleCiphers { tls12: no_chacha, tls13: CompatibleCiphersForVersion { chacha20_poly1305: false, ..all_of() } };
        let suites = rustls::crypto::ring::default_provider().cipher_suites;
        assert!(suites.len() >= 9, "{suites:?}");
        for s in suites {
            assert!(kernel_takes(&full, s).is_ok(), "{:?}", s.suite());
            let chacha = format!("{:?}", s.suite()).contains("CHACHA20");
            assert_eq!(kernel_takes(&partial, s).is_ok(), !chacha, "{:?}", s.suite());
        }
    }

    fn all_of() -> CompatibleCiphersForVersion {
        CompatibleCiphersForVersion { aes_gcm_128: true, aes_gcm_256: true, chacha20_poly1305: true }
    }

    /// `off` decides without probing the kernel.
    #[tokio::test]
    async fn off_never_probes() {
        let kernel = KernelState::new();
        assert_eq!(kernel.wanted(KernelTls::Off).await, Err(None));
        assert!(kernel.support.get().is_none(), "off probed the kernel");
    }
}
