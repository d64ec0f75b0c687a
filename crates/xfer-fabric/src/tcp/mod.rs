//! TCP fabric: software one-sided WRITE/READ over TCP streams, for nodes without RDMA and for tests.
//!
//! Each "QP" is one TCP stream from the initiator to the target's data listener (its address is
//! the responder's endpoint in `Peer.Connect`). The initiator side has a writer task (frames out,
//! payload written straight from region memory) and a reader task (ACK/NAK/READ_RESP in, READ
//! payload read straight into region memory). The target validates every frame against its grant
//! table ([`AccessCheck`]) before it touches memory and answers NAK with a verbs-style status on
//! any violation. Streams are processed in order, so an ACK for a signaled WRITE implies every
//! earlier WR on that stream succeeded, exactly like an RC QP.
//!
//! Data streams are bound to the authenticated control plane: `Peer.Connect` (over
//! mTLS, or plaintext on loopback) creates a *session* on the target with a random 32-byte secret
//! that only the initiator learns. Every data stream starts with a hello naming the connection and
//! presenting that secret; a stream without a valid hello within `limits.data_handshake_timeout`
//! is closed.
//! Frames on a stream are checked against grants asked on *that* connection only, so a token is
//! worthless on any other stream. With mTLS on, streams are TLS with the agent's certificates
//! (tokio-rustls), the target checks that the client certificate is the identity that made the
//! connection, and the initiator checks that the target's certificate has the node role. Dropping
//! the responder's [`Accepted`] half (`Peer.Disconnect`, eviction, shutdown) ends the session and
//! closes its streams.
//!
//! Exhaustion is bounded ([`DataLimits`]): every accepted socket counts against
//! `limits.max_data_connections` from accept until it closes (hello or not). Sockets still before
//! their hello are at most `limits.max_pending_data_connections`; at that cap the *oldest* is
//! closed to make room for the newest (`xfer_data_connections_closed_total{reason="evicted"}`).
//! A peer's hello follows its connect within a round trip (plus a TLS handshake), so a flood of
//! silent sockets only shortens every silent socket's life: it cannot hold the slots real peers
//! need, unless it opens sockets faster than `max_pending` per handshake time. Once a hello names a
//! session, the stream also counts against its owner's `limits.max_data_connections_per_peer`
//! (refused with a NAK `REM_ACCESS_ERR`). A stream that sends no frame for
//! `limits.data_idle_timeout`, or that does not complete a WRITE payload within
//! `limits.data_payload_timeout`, is closed; the initiator's reader then sees EOF and marks the
//! connection broken, so the pool never lends it again. The one exception to the idle rule is a
//! fabric serving the standby rails of a verbs agent's connections ([`Serving::StandbyRails`]):
//! a standby idles by design, and lives as long as the connection it is a rail of. Failed accepts (EMFILE) back off
//! ([`crate::accept::AcceptBackoff`]) instead of spinning.
//!
//! Revocation is immediate: a WRITE payload lands in chunks, each under the grant's
//! [`GrantGate`](crate::grant::GrantGate), so once a grant is revoked (explicitly, by expiry,
//! with its region or its connection) no further byte lands, and a stream mid-payload on it is
//! closed without an ACK.
//!
//! # Layout
//! * this file — [`TcpFabric`]: the `Fabric` implementation tying the halves together.
//! * `initiator`, `qp` — the initiator's connection and its streams' writer and reader tasks.
//! * `target`, `hello`, `session`, `serve` — the data listener, a stream's hello, the sessions
//!   streams are admitted to, and the frame loop; `limits` — the data port's bounds.
//! * `wire` — a stream's staged writes and buffered reads (payloads straight to and from region
//!   memory).
//! * `ktls` — a TLS stream's handshake and its record layer: rustls's, or the kernel's
//!   (`tls.kernel = auto`).
use std::net::SocketAddr;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use xfer_rdma::memory::RegionMemory;

use crate::grant::AccessCheck;
use crate::identity::tls::DataTls;
use crate::{
    Accepted, Access, CompletionSink, DataSecret, Endpoint, ExposeRequest, Exposure, Fabric, FabricError, FabricInfo, FabricKind,
    PendingConnection, Registration, RemoteKey,
};
use xfer_engine::ids::ConnectionId;

use initiator::TcpPrepared;
use limits::PreHelloSockets;
use session::{DataSession, DataSessions, TcpAccepted};
use target::ServeCtx;

mod hello;
mod initiator;
mod ktls;
mod limits;
mod qp;
#[cfg(test)]
mod qp_tests;
#[cfg(test)]
mod redteam_tests;
mod serve;
mod session;
#[cfg(test)]
mod standby_tests;
mod target;
mod whole;
#[cfg(test)]
mod whole_redteam_tests;
#[cfg(test)]
mod whole_tests;
mod wire;

pub use hello::read_hello;
pub use limits::{DataLimits, HELLO_TIMEOUT};
pub use qp::run_initiator_stream;
pub use serve::{serve_frames, ServeError};

#[derive(Debug)]
struct TcpRegistration {
    memory: Arc<RegionMemory>,
    access: Access,
}

impl Registration for TcpRegistration {
    fn memory(&self) -> &Arc<RegionMemory> {
        &self.memory
    }
    fn lkey(&self) -> u32 {
        0
    }
    fn rkey(&self) -> u32 {
        0
    }
    fn access(&self) -> Access {
        self.access
    }
    fn remote_key_exposed(&self) -> bool {
        // Every frame needs a grant's token; the region itself has no remote key.
        false
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Whose connections a [`TcpFabric`] serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Serving {
    /// Its own: it is the agent's fabric, and peers connect to it in `Peer.Connect`.
    Connections,
    /// The standby rails of another fabric's connections (a verbs agent's
    /// `transfer.fallback = tcp`: only that fabric accepts here, under its own connection's id).
    /// A standby carries nothing while an RDMA path is up, so its streams are not closed for
    /// idleness (`limits.data_idle_timeout`): they stay until that connection ends (its accepted
    /// half is dropped), ready for the moment every RDMA path is lost. Every other limit holds.
    StandbyRails,
}

/// The TCP fabric: a data listener serving one-sided operations, and initiator connections.
pub struct TcpFabric {
    data_address: SocketAddr,
    shutdown: CancellationToken,
    sessions: Arc<DataSessions>,
    tls: Option<DataTls>,
}

impl TcpFabric {
    /// Starts serving frames checked by `check` on an already bound data listener, for
    /// `serving`. With `tls`, streams in both directions are TLS with the agent's certificates.
    pub fn serve(
        listener: TcpListener,
        check: Arc<dyn AccessCheck>,
        tls: Option<DataTls>,
        limits: DataLimits,
        serving: Serving,
    ) -> Result<TcpFabric, FabricError> {
        let data_address = listener.local_addr()?;
        let shutdown = CancellationToken::new();
        let sessions = Arc::new(DataSessions::new(limits.max_connections_per_peer));
        let open = crate::accept::Slots::new(limits.max_connections, crate::metrics::data_connections);
        let pre_hello = PreHelloSockets::new(limits.max_pending);
        let standby = serving == Serving::StandbyRails;
        let ctx =
            ServeCtx { check, sessions: sessions.clone(), tls: tls.clone(), shutdown: shutdown.clone(), limits, open, pre_hello, standby };
        tokio::spawn(target::serve(listener, ctx));
        Ok(TcpFabric { data_address, shutdown, sessions, tls })
    }

    /// Binds `addr` and serves on it with the default [`DataLimits`] (tests and tools; the agent
    /// binds in `app`).
    pub async fn bind(addr: SocketAddr, check: Arc<dyn AccessCheck>, tls: Option<DataTls>) -> Result<TcpFabric, FabricError> {
        let listener = TcpListener::bind(addr).await.map_err(|e| FabricError::Bind { addr: addr.to_string(), error: e })?;
        TcpFabric::serve(listener, check, tls, DataLimits::default(), Serving::Connections)
    }

    pub fn data_address(&self) -> SocketAddr {
        self.data_address
    }
}

impl Drop for TcpFabric {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

#[async_trait]
impl Fabric for TcpFabric {
    fn grants_need_connection(&self) -> bool {
        true
    }

    fn kind(&self) -> FabricKind {
        FabricKind::Tcp
    }

    fn info(&self) -> FabricInfo {
        FabricInfo { kind: FabricKind::Tcp, devices: Vec::new(), data_address: Some(self.data_address) }
    }

    fn register(&self, memory: Arc<RegionMemory>, access: Access) -> Result<Arc<dyn Registration>, FabricError> {
        Ok(Arc::new(TcpRegistration { memory, access }))
    }

    async fn expose(&self, reg: &Arc<dyn Registration>, req: &ExposeRequest) -> Result<Exposure, FabricError> {
        reg.memory().check(req.offset, req.len).map_err(|e| FabricError::LocalRange(e.to_string()))?;
        // 128 bits from the OS-seeded CSPRNG: unguessable, checked on every frame.
        let token: [u8; 16] = rand::random();
        Ok(Exposure { addr: reg.addr() + req.offset, key: RemoteKey::Token(token), keepalive: None })
    }

    async fn prepare(
        &self,
        peer: &str,
        connection_id: &ConnectionId,
        qps: usize,
        _depth: usize,
        sink: CompletionSink,
    ) -> Result<Box<dyn PendingConnection>, FabricError> {
        Ok(Box::new(TcpPrepared {
            qps: qps.max(1),
            sink,
            peer: peer.to_string(),
            connection: connection_id.clone(),
            tls: self.tls.clone(),
        }))
    }

    async fn accept(
        &self,
        peer: &str,
        connection_id: &ConnectionId,
        remote: &[Endpoint],
    ) -> Result<(Vec<Endpoint>, Box<dyn Accepted>), FabricError> {
        if let Some(Endpoint::Verbs(_)) = remote.first() {
            return Err(FabricError::Negotiation {
                step: "accept",
                attr: "fabric",
                detail: "initiator offers verbs endpoints but this agent runs the tcp fabric".into(),
            });
        }
        // 256 bits from the OS-seeded CSPRNG, handed only to the authenticated caller.
        let secret = DataSecret(rand::random());
        let session = DataSession { owner: peer.to_string(), secret, streams: 0, closed: CancellationToken::new() };
        {
            let mut map = self.sessions.lock();
            if map.sessions.contains_key(connection_id) {
                return Err(FabricError::Negotiation {
                    step: "accept",
                    attr: "connection_id",
                    detail: format!("connection {connection_id:?} already exists"),
                });
            }
            map.sessions.insert(connection_id.clone(), session);
        }
        let accepted = TcpAccepted { sessions: self.sessions.clone(), connection: connection_id.clone() };
        Ok((vec![Endpoint::Tcp { address: self.data_address, secret: Some(secret) }], Box::new(accepted)))
    }
}

// The tcp fallback of a verbs fabric asks for its tcp rail with a tcp endpoint of its own kind.
impl Endpoint {
    /// What an initiator with a tcp fallback adds to its verbs endpoints in `Peer.Connect`: "open
    /// a tcp rail too". A tcp endpoint without address or secret, which no tcp responder ever
    /// answers with; a responder that has a fallback accepts it on its tcp fabric under the same
    /// connection id and answers its own tcp endpoint, one without leaves it out.
    pub fn tcp_fallback_request() -> Endpoint {
        Endpoint::Tcp { address: SocketAddr::from(([0, 0, 0, 0], 0)), secret: None }
    }

    /// Whether this is [`Endpoint::tcp_fallback_request`].
    pub fn is_tcp_fallback_request(&self) -> bool {
        matches!(self, Endpoint::Tcp { address, secret: None } if address.port() == 0 && address.ip().is_unspecified())
    }
}

/// A registration of `memory` as the tcp fabric makes one (no keys), for
/// [`run_initiator_stream`]'s callers.
#[doc(hidden)]
pub fn registration(memory: Arc<RegionMemory>, access: Access) -> Arc<dyn Registration> {
    Arc::new(TcpRegistration { memory, access })
}

/// The stream halves driven from memory (no sockets): a target's frame loop, and an initiator QP
/// facing a target that breaks the protocol or stops reading.
#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::mpsc;
    use tokio_util::sync::CancellationToken;
    use xfer_rdma::memory::RegionMemory;

    use super::qp::TcpQp;
    use super::serve::{serve_frames_idle, StreamTimers};
    use super::{registration, run_initiator_stream, serve_frames, ServeError};
    use crate::frame::{Header, Kind, ACK_REQUESTED, HEADER_LEN};
    use crate::grant::{AccessCheck, Checked, GrantGate};
    use crate::{Access, Completion, Registration, RemoteKey, RemoteOp, WcStatus, WorkRequest, WrOp};
    use xfer_engine::ids::ConnectionId;

    const TOKEN: [u8; 16] = [0x22; 16];
    const LEN: usize = 64 << 10;

    /// One READ grant over a whole 64 KiB region at address 0, with the region's bytes 0, 1, 2, …
    struct ReadAll {
        memory: Arc<RegionMemory>,
        gate: Arc<GrantGate>,
    }

    impl ReadAll {
        fn new() -> ReadAll {
            let memory = Arc::new(RegionMemory::anonymous(LEN, false).expect("64 KiB mapping"));
            let pattern: Vec<u8> = (0..LEN).map(|i| i as u8).collect();
            memory.write_at(0, &pattern).expect("fill");
            let gate = GrantGate::new(std::time::SystemTime::now() + Duration::from_secs(3600));
            ReadAll { memory, gate }
        }
    }

    impl AccessCheck for ReadAll {
        fn check(&self, _: &ConnectionId, token: &[u8; 16], addr: u64, len: u64, op: RemoteOp) -> Result<Checked, WcStatus> {
            if token != &TOKEN || op != RemoteOp::Read || addr.checked_add(len).is_none_or(|end| end > LEN as u64) {
                return Err(WcStatus::RemAccessErr);
            }
            Ok(Checked { memory: self.memory.clone(), offset: addr, gate: self.gate.clone(), window: None })
        }

        fn marker(&self, _: &ConnectionId, _: &[u8; 16], _: u32) -> Result<(), WcStatus> {
            Err(WcStatus::RemAccessErr)
        }
    }

    fn read_req(id: u64, len: u32) -> [u8; HEADER_LEN] {
        let mut h = Header::new(Kind::ReadReq, id);
        h.len = len;
        h.token = TOKEN;
        h.encode()
    }

    /// A WR of `len` bytes at local offset 0 of `local`, on a grant named by [`TOKEN`].
    fn work(wr_id: u64, op: WrOp, local: &Arc<dyn Registration>, len: u32, signaled: bool) -> WorkRequest {
        WorkRequest { wr_id, op, local: local.clone(), local_offset: 0, len, remote_addr: 0, remote_key: RemoteKey::Token(TOKEN), signaled }
    }

    /// A QP whose stream is `ours` (the test holds the target's end), its completions and the
    /// cancellation its connection's close fires.
    fn qp_over(ours: tokio::io::DuplexStream) -> (TcpQp, mpsc::UnboundedReceiver<Completion>, CancellationToken) {
        let (rd, wr) = tokio::io::split(ours);
        let (sink, completions) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let qp = TcpQp::start(0, Box::new(rd), Box::new(wr), sink, Arc::new(AtomicBool::new(false)), cancel.clone());
        (qp, completions, cancel)
    }

    fn connection() -> ConnectionId {
        ConnectionId::parse("test-conn").expect("valid id")
    }

    /// Found by the frame_decode fuzz target: a READ answered in full, then a WRITE the target
    /// refuses whose payload the stream cuts short. The stream fails on the short payload; the
    /// READ's answer, already owed, must still reach the initiator whole (it used to sit unsent
    /// in the writer's buffer, so the initiator saw it cut short).
    #[tokio::test]
    async fn answers_owed_before_a_stream_fails_are_delivered_whole() {
        let grants = ReadAll::new();
        let len = LEN as u32 - 65; // header + payload over the writer's 64 KiB buffer
        let mut input = read_req(4, len).to_vec();
        let mut w = Header::new(Kind::Write, 5);
        w.len = 1 << 20;
        w.token = [0x99; 16]; // no such grant: refused, its payload discarded until the stream ends
        input.extend_from_slice(&w.encode());
        input.extend_from_slice(&[0xee; 100]);
        let mut out = Vec::new();
        let r = serve_frames(&input[..], &mut out, &grants, &connection()).await;
        assert!(matches!(r, Err(ServeError::Io(ref e)) if e.kind() == std::io::ErrorKind::UnexpectedEof), "{r:?}");
        let h = Header::decode(out[..HEADER_LEN].try_into().expect("a header")).expect("decodes");
        assert_eq!((h.kind, h.id, h.status, h.len), (Kind::ReadResp, 4, 0, len));
        let payload = &out[HEADER_LEN..];
        assert_eq!(payload.len(), len as usize, "the READ answer arrived whole, and nothing after it");
        assert!(payload.iter().enumerate().all(|(i, b)| *b == i as u8), "the region's bytes");
    }

    /// The initiator's side of a target that stopped reading: its writer is blocked in the
    /// middle of a WRITE's payload. Closing the connection (what a transfer's deadline or a
    /// dropped lease does) must end the writer, so the target sees the stream end and the WR
    /// gets its error completion; the writer used to stay blocked in the write for ever. Virtual
    /// time: a writer that never ends fails the test at the (virtual) hour, not by hanging it.
    #[tokio::test(start_paused = true)]
    async fn closing_a_connection_ends_a_writer_blocked_on_a_target_that_stopped_reading() {
        let (ours, mut theirs) = tokio::io::duplex(4096);
        let (qp, mut completions, cancel) = qp_over(ours);
        let memory = Arc::new(RegionMemory::anonymous(LEN, false).expect("64 KiB mapping"));
        let local = registration(memory, Access::ReadWrite);
        qp.tx.send(vec![work(7, WrOp::Write, &local, LEN as u32, true)]).expect("the writer is running");
        // The header and the start of the payload: the writer is now inside the WR, blocked on
        // a pipe the target no longer reads.
        let mut head = [0u8; HEADER_LEN + 64];
        theirs.read_exact(&mut head).await.expect("the WR started");
        assert_eq!(Header::decode(head[..HEADER_LEN].try_into().expect("a header")).expect("decodes").id, 7);
        cancel.cancel();
        let bound = Duration::from_secs(600);
        let c = tokio::time::timeout(bound, completions.recv()).await.expect("a completion").expect("the sink is open");
        assert_eq!(c.wr_id, 7);
        assert_ne!(c.status, WcStatus::Success, "an unsent WRITE cannot succeed");
        // Both stream tasks end (each holds the QP's state) while the target still reads nothing;
        // polled in virtual time.
        let ended = tokio::time::timeout(bound, async {
            while Arc::strong_count(&qp.state) > 1 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(ended.is_ok(), "the writer is still blocked on the target");
        // The target's side: what was buffered, then EOF; the payload was cut short.
        let mut rest = Vec::new();
        theirs.read_to_end(&mut rest).await.expect("reads to the end");
        assert!(rest.len() < LEN, "the payload was cut short, not completed");
    }

    /// A target that answers a later WR and skips a signaled one (its ACK was asked for): the
    /// skipped WR fails with REM_INV_REQ_ERR and the later one is flushed. It used to be dropped
    /// from the queue without a completion, so its transfer waited for one until its deadline.
    #[tokio::test(start_paused = true)]
    async fn a_target_that_skips_an_asked_for_ack_fails_the_qp() {
        let (ours, mut theirs) = tokio::io::duplex(1 << 20);
        let (qp, mut completions, cancel) = qp_over(ours);
        let memory = Arc::new(RegionMemory::anonymous(4096, false).expect("a page"));
        let local = registration(memory, Access::ReadWrite);
        for id in [1, 2] {
            qp.tx.send(vec![work(id, WrOp::Write, &local, 16, true)]).expect("the writer is running");
        }
        // Both frames arrive at the target (header and 16 bytes each), each asking for an ACK.
        for id in [1, 2] {
            let mut f = [0u8; HEADER_LEN + 16];
            theirs.read_exact(&mut f).await.expect("a frame");
            let h = Header::decode(f[..HEADER_LEN].try_into().expect("a header")).expect("decodes");
            assert_eq!((h.kind, h.id, h.flags & ACK_REQUESTED != 0), (Kind::Write, id, true));
        }
        theirs.write_all(&Header::new(Kind::Ack, 2).encode()).await.expect("the ACK");
        // Virtual time: a completion that never comes fails the test instead of hanging it.
        let mut next =
            async || tokio::time::timeout(Duration::from_secs(600), completions.recv()).await.ok().flatten().map(|c| (c.wr_id, c.status));
        let (first, second) = (next().await, next().await);
        assert_eq!(first, Some((1, WcStatus::RemInvReqErr)), "then {second:?}");
        assert_eq!(second, Some((2, WcStatus::WrFlushErr)));
        cancel.cancel();
    }

    /// Found by the initiator_answers fuzz target: a target that ACKs a WRITE that did not ask
    /// for it. On verbs an unsignaled WR never completes successfully, and the transfer driver
    /// counts on that; the ACK is a protocol error that fails the QP, not a success.
    #[tokio::test]
    async fn an_ack_for_an_unsignaled_write_fails_the_qp() {
        let memory = Arc::new(RegionMemory::anonymous(4096, false).expect("a page"));
        let local = registration(memory, Access::ReadWrite);
        let wrs = vec![work(1, WrOp::Write, &local, 16, false), work(2, WrOp::Write, &local, 16, true)];
        let answers = Header::new(Kind::Ack, 1).encode().to_vec();
        let (completions, refused) = run_initiator_stream(std::io::Cursor::new(answers), tokio::io::sink(), wrs).await;
        let got: Vec<(u64, WcStatus)> = completions.iter().map(|c| (c.wr_id, c.status)).collect();
        assert_eq!(refused, 0);
        assert_eq!(got, vec![(1, WcStatus::RemInvReqErr), (2, WcStatus::WrFlushErr)]);
    }

    /// Found by the initiator_answers fuzz target: a target whose READ answer stops inside its
    /// payload (it died, or closed the stream). The READ fails with the stream's error; it used
    /// to be dropped from the queue without a completion, so a transfer whose peer died in the
    /// middle of a READ answer waited for its deadline instead of failing at once.
    #[tokio::test]
    async fn a_read_answer_cut_short_fails_its_read() {
        let memory = Arc::new(RegionMemory::anonymous(4096, false).expect("a page"));
        let local = registration(memory, Access::ReadWrite);
        let read = work(1, WrOp::Read, &local, 16, true);
        let mut h = Header::new(Kind::ReadResp, 1);
        h.len = 16;
        let mut answers = h.encode().to_vec();
        answers.extend_from_slice(&[0xab; 11]); // 11 of the 16 bytes, then the end
        let (completions, _) = run_initiator_stream(std::io::Cursor::new(answers), tokio::io::sink(), vec![read]).await;
        let got: Vec<(u64, WcStatus)> = completions.iter().map(|c| (c.wr_id, c.status)).collect();
        assert_eq!(got, vec![(1, WcStatus::RetryExcErr)]);
    }

    /// An initiator that sends a READ and never reads the answer: the stream fails as stalled
    /// after the idle limit (virtual time), instead of holding its task for ever.
    #[tokio::test(start_paused = true)]
    async fn an_initiator_that_stops_reading_is_closed_as_stalled() {
        let grants = ReadAll::new();
        let (mut ours, theirs) = tokio::io::duplex(4096);
        let (rd, wr) = tokio::io::split(theirs);
        ours.write_all(&read_req(1, LEN as u32)).await.expect("request");
        let idle = Duration::from_secs(300);
        let start = tokio::time::Instant::now();
        // `ours` stays open and unread: the answer fills the pipe and waits.
        let timers = StreamTimers { idle: Some(idle), stall: Some(idle), payload: Some(Duration::from_secs(30)) };
        let r = serve_frames_idle(rd, wr, &grants, &connection(), timers).await;
        assert!(matches!(r, Err(ServeError::Stalled)), "{r:?}");
        assert_eq!(start.elapsed(), idle);
        drop(ours);
    }
}
