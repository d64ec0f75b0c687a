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
//! Data streams are bound to the authenticated control plane (DESIGN §8): `Peer.Connect` (over
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
//! connection broken, so the pool never lends it again. Failed accepts (EMFILE) back off
//! ([`crate::sys::AcceptBackoff`]) instead of spinning.
//!
//! Revocation is immediate: a WRITE payload lands in chunks, each under the grant's
//! [`GrantLease`], so once a grant is revoked (explicitly, by expiry, with its region or its
//! connection) no further byte lands, and a stream mid-payload on it is closed without an ACK.
use crate::ids::ConnectionId;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::frame::{FrameError, Header, Kind, ACK_REQUESTED, HEADER_LEN};
use super::stall::{is_stall, StallGuard};
use super::{
    Accepted, Access, Completion, CompletionSink, Connection, DataSecret, Endpoint, ExposeRequest, Exposure, Fabric, FabricError,
    FabricInfo, FabricKind, PendingConnection, Registration, RemoteKey, RemoteOp, WcStatus, WorkRequest, WrOp,
};
use crate::identity::tls::DataTls;
use crate::identity::Role;
use xfer_rdma::memory::RegionMemory;

/// The initiator's TLS handshake on a data stream must complete within this; it is also the
/// default of the target's `limits.data_handshake_timeout`.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// The target's bounds on its data port (`limits.*` in the configuration).
#[derive(Debug, Clone, Copy)]
pub struct DataLimits {
    /// Open sockets from accept until close, hello or not (`limits.max_data_connections`).
    pub max_connections: usize,
    /// Sockets before their hello; the oldest is closed at the cap
    /// (`limits.max_pending_data_connections`).
    pub max_pending: usize,
    /// Streams of one identity, counted once the hello names a session
    /// (`limits.max_data_connections_per_peer`).
    pub max_connections_per_peer: usize,
    /// (TLS handshake and) hello deadline (`limits.data_handshake_timeout`).
    pub handshake_timeout: Duration,
    /// A stream with no frame for this long is closed (`limits.data_idle_timeout`).
    pub idle_timeout: Duration,
    /// A WRITE payload must arrive in full within this of its header, or the stream is closed
    /// (`limits.data_payload_timeout`).
    pub payload_timeout: Duration,
}

impl Default for DataLimits {
    fn default() -> Self {
        DataLimits {
            max_connections: 4096,
            max_pending: 128,
            max_connections_per_peer: 256,
            handshake_timeout: HELLO_TIMEOUT,
            idle_timeout: Duration::from_secs(300),
            payload_timeout: Duration::from_secs(30),
        }
    }
}

/// Sockets still before their hello, oldest first (by accept order). Entering at the cap closes
/// the oldest: see the module docs.
struct PendingSockets {
    queue: Mutex<std::collections::BTreeMap<u64, CancellationToken>>,
    next: std::sync::atomic::AtomicU64,
    max: usize,
}

impl PendingSockets {
    fn new(max: usize) -> Arc<PendingSockets> {
        Arc::new(PendingSockets { queue: Mutex::new(Default::default()), next: Default::default(), max: max.max(1) })
    }

    /// Registers a socket before its hello; its token is cancelled if it is evicted.
    fn enter(self: &Arc<Self>) -> PendingGuard {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let token = CancellationToken::new();
        // A poisoned lock means a panic while holding it; the map is still consistent.
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        while q.len() >= self.max {
            let Some((_, oldest)) = q.pop_first() else { break };
            oldest.cancel();
            crate::metrics::data_connection_closed("evicted");
        }
        q.insert(id, token.clone());
        PendingGuard { pending: self.clone(), id, token }
    }
}

/// A socket's place among the [`PendingSockets`]; leaving (hello read, or the socket closed)
/// drops it.
struct PendingGuard {
    pending: Arc<PendingSockets>,
    id: u64,
    token: CancellationToken,
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        self.pending.queue.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
    }
}

/// First bytes of a data stream's hello (protocol version 1).
const HELLO_MAGIC: &[u8; 4] = b"XFR1";
/// Most data streams one connection may open (`transfer.qps` is at most 64).
const MAX_STREAMS_PER_SESSION: usize = 64;

/// The target's grant table as the TCP fabric sees it: resolves a frame's token and range to
/// region memory, or the status to NAK with.
pub trait AccessCheck: Send + Sync + 'static {
    /// Returns the memory, the offset inside it and the grant's [`GrantLease`] for `len` bytes at
    /// remote address `addr`, for a frame that arrived on a data stream of connection
    /// `connection`.
    fn check(&self, connection: &ConnectionId, token: &[u8; 16], addr: u64, len: u64, op: RemoteOp) -> Result<Checked, WcStatus>;
    /// A NOTIFY frame (a notification marker) under `token` with immediate `imm` arrived on a
    /// data stream of `connection`, after every earlier frame of that stream was served. `Err`
    /// NAKs it.
    fn marker(&self, connection: &ConnectionId, token: &[u8; 16], imm: u32) -> Result<(), WcStatus>;
}

/// A frame that passed [`AccessCheck::check`]: where its bytes go, and the lease of the grant
/// that allowed it.
pub struct Checked {
    pub memory: Arc<RegionMemory>,
    pub offset: u64,
    pub lease: Arc<GrantLease>,
}

/// A grant's liveness as the data plane sees it. A WRITE payload is copied into region memory in
/// chunks of at most [`PAYLOAD_CHUNK`], each under a read lock of `live` and only while the lease
/// is live and unexpired; [`GrantLease::revoke`] takes the write lock, so once it returns no byte
/// lands under this lease any more. It also cancels `revoked`, which closes a stream waiting for
/// the rest of such a payload at once.
#[derive(Debug)]
pub struct GrantLease {
    live: std::sync::RwLock<bool>,
    revoked: CancellationToken,
    expires_at: std::time::SystemTime,
}

/// Most bytes copied into region memory per check of a [`GrantLease`].
pub const PAYLOAD_CHUNK: usize = 64 << 10;

impl GrantLease {
    pub fn new(expires_at: std::time::SystemTime) -> Arc<GrantLease> {
        Arc::new(GrantLease { live: std::sync::RwLock::new(true), revoked: CancellationToken::new(), expires_at })
    }

    /// Ends the lease. Waits for a chunk being copied under it (never for the network: chunks
    /// are copied from bytes already received); after it returns, no byte is written under it.
    pub fn revoke(&self) {
        *self.live.write().unwrap_or_else(|p| p.into_inner()) = false;
        self.revoked.cancel();
    }

    /// Whether the lease is neither revoked nor expired (a snapshot).
    pub fn is_live(&self) -> bool {
        self.hold().is_some()
    }

    /// Runs `f` with the lease held live (None, without running it, once revoked or expired):
    /// a [`GrantLease::revoke`] waits for `f`, so once it returns `f` has run or never will.
    /// `f` must not block or revoke.
    pub fn while_live<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        let _live = self.hold()?;
        Some(f())
    }

    /// Holds the lease live while the guard lives (revocation waits for it); None once revoked
    /// or expired.
    fn hold(&self) -> Option<std::sync::RwLockReadGuard<'_, bool>> {
        let g = self.live.read().unwrap_or_else(|p| p.into_inner());
        (*g && std::time::SystemTime::now() < self.expires_at).then_some(g)
    }
}

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

/// One connection's data-plane session on the target: who made it, its secret, and a token that
/// closes its streams when the connection goes away.
struct Session {
    owner: String,
    secret: DataSecret,
    streams: usize,
    closed: CancellationToken,
}

/// Sessions by connection id, and open streams by owner. std Mutex: map operations only, never
/// held across an await.
struct Sessions {
    map: Mutex<SessionMaps>,
    max_per_owner: usize,
}

#[derive(Default)]
struct SessionMaps {
    sessions: HashMap<ConnectionId, Session>,
    /// Admitted streams per owner, across all of its sessions.
    per_owner: HashMap<String, usize>,
}

/// Why a hello was refused; `PerPeer` is counted apart in metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    Hello(&'static str),
    PerPeer,
}

impl Sessions {
    fn new(max_per_owner: usize) -> Self {
        Sessions { map: Mutex::new(SessionMaps::default()), max_per_owner }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SessionMaps> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits one more stream of `connection` presenting `secret` from `identity` (TLS: the client
    /// certificate's NAME; plaintext: None). Returns the token that ends the stream with the
    /// session, and the session's owner (for [`Sessions::stream_ended`]).
    fn admit(&self, connection: &ConnectionId, secret: &[u8; 32], identity: Option<&str>) -> Result<(CancellationToken, String), Refusal> {
        use subtle::ConstantTimeEq;
        let mut maps = self.lock();
        let SessionMaps { sessions, per_owner } = &mut *maps;
        let s = sessions.get_mut(connection).ok_or(Refusal::Hello("unknown connection"))?;
        if !bool::from(s.secret.0.ct_eq(secret)) {
            return Err(Refusal::Hello("wrong connection secret"));
        }
        if identity.is_some_and(|id| id != s.owner) {
            return Err(Refusal::Hello("the client certificate is not the identity that made the connection"));
        }
        if s.streams >= MAX_STREAMS_PER_SESSION {
            return Err(Refusal::Hello("too many streams on this connection"));
        }
        let owned = per_owner.entry(s.owner.clone()).or_insert(0);
        if *owned >= self.max_per_owner {
            return Err(Refusal::PerPeer);
        }
        *owned += 1;
        s.streams += 1;
        Ok((s.closed.clone(), s.owner.clone()))
    }

    /// A stream admitted for `owner` on `connection` ended (its session may be gone already).
    fn stream_ended(&self, connection: &ConnectionId, owner: &str) {
        let mut maps = self.lock();
        if let Some(s) = maps.sessions.get_mut(connection) {
            s.streams = s.streams.saturating_sub(1);
        }
        if let Some(n) = maps.per_owner.get_mut(owner) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                maps.per_owner.remove(owner);
            }
        }
    }
}

/// The responder's half of a tcp connection: its session. Dropping it (disconnect) forgets the
/// secret and closes every stream of the connection.
struct TcpAccepted {
    sessions: Arc<Sessions>,
    connection: ConnectionId,
}

impl Accepted for TcpAccepted {}

impl Drop for TcpAccepted {
    fn drop(&mut self) {
        if let Some(s) = self.sessions.lock().sessions.remove(&self.connection) {
            s.closed.cancel();
        }
    }
}

/// The TCP fabric: a data listener serving one-sided operations, and initiator connections.
pub struct TcpFabric {
    data_address: SocketAddr,
    shutdown: CancellationToken,
    sessions: Arc<Sessions>,
    tls: Option<DataTls>,
}

impl TcpFabric {
    /// Starts serving frames checked by `check` on an already bound data listener. With `tls`,
    /// streams in both directions are TLS with the agent's certificates.
    pub fn serve(
        listener: TcpListener,
        check: Arc<dyn AccessCheck>,
        tls: Option<DataTls>,
        limits: DataLimits,
    ) -> Result<TcpFabric, FabricError> {
        let data_address = listener.local_addr()?;
        let shutdown = CancellationToken::new();
        let sessions = Arc::new(Sessions::new(limits.max_connections_per_peer));
        let open = crate::sys::Slots::new(limits.max_connections, crate::metrics::data_connections);
        let pending = PendingSockets::new(limits.max_pending);
        let ctx = ServeCtx { check, sessions: sessions.clone(), tls: tls.clone(), shutdown: shutdown.clone(), limits, open, pending };
        tokio::spawn(serve(listener, ctx));
        Ok(TcpFabric { data_address, shutdown, sessions, tls })
    }

    /// Binds `addr` and serves on it with the default [`DataLimits`] (tests and tools; the agent
    /// binds in `app`).
    pub async fn bind(addr: SocketAddr, check: Arc<dyn AccessCheck>, tls: Option<DataTls>) -> Result<TcpFabric, FabricError> {
        let listener = TcpListener::bind(addr).await.map_err(|e| FabricError::Bind { addr: addr.to_string(), error: e })?;
        TcpFabric::serve(listener, check, tls, DataLimits::default())
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
        Ok(Box::new(TcpPending { qps: qps.max(1), sink, peer: peer.to_string(), connection: connection_id.clone(), tls: self.tls.clone() }))
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
        let session = Session { owner: peer.to_string(), secret, streams: 0, closed: CancellationToken::new() };
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

struct TcpPending {
    qps: usize,
    sink: CompletionSink,
    /// The peer's gRPC address: the data host when the target listens on an unspecified address,
    /// and the TLS server name.
    peer: String,
    connection: ConnectionId,
    tls: Option<DataTls>,
}

impl TcpPending {
    /// Opens one data stream (TLS when on) and sends the hello.
    async fn open_stream(&self, address: SocketAddr, secret: &DataSecret) -> Result<(BoxRead, BoxWrite), FabricError> {
        let connect_err = |e: std::io::Error| FabricError::Connect { addr: address.to_string(), source: e };
        let stream = if address.ip().is_unspecified() {
            // The target listens on every address: reach it where its gRPC service answered.
            let host = crate::identity::tls::host_of(&self.peer);
            TcpStream::connect((host, address.port())).await.map_err(connect_err)?
        } else {
            TcpStream::connect(address).await.map_err(connect_err)?
        };
        stream.set_nodelay(true)?;
        let id = self.connection.as_str();
        let mut hello = Vec::with_capacity(4 + 1 + id.len() + 32);
        hello.extend_from_slice(HELLO_MAGIC);
        hello.push(id.len() as u8);
        hello.extend_from_slice(id.as_bytes());
        hello.extend_from_slice(&secret.0);
        match &self.tls {
            None => {
                let (rd, mut wr) = stream.into_split();
                wr.write_all(&hello).await.map_err(connect_err)?;
                Ok((Box::new(rd), Box::new(wr)))
            }
            Some(tls) => {
                let name = tls.server_name_for(&self.peer).map_err(|detail| FabricError::Negotiation {
                    step: "data stream",
                    attr: "tls.server_name",
                    detail,
                })?;
                let connector = tokio_rustls::TlsConnector::from(tls.client.clone());
                let mut s = tokio::time::timeout(HELLO_TIMEOUT, connector.connect(name, stream))
                    .await
                    .map_err(|_| connect_err(std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out")))?
                    .map_err(connect_err)?;
                // The target must be an agent, not any certificate the CA signed.
                match tls.caller_of(s.get_ref().1.peer_certificates()) {
                    Ok(c) if c.role == Role::Node => {}
                    Ok(c) => {
                        return Err(FabricError::Negotiation {
                            step: "data stream",
                            attr: "certificate",
                            detail: format!("the target's certificate has the {} role, not node", c.role),
                        })
                    }
                    Err(e) => return Err(FabricError::Negotiation { step: "data stream", attr: "certificate", detail: e.to_string() }),
                }
                s.write_all(&hello).await.map_err(connect_err)?;
                let (rd, wr) = tokio::io::split(s);
                Ok((Box::new(rd), Box::new(wr)))
            }
        }
    }
}

type BoxRead = Box<dyn AsyncRead + Send + Unpin>;
type BoxWrite = Box<dyn AsyncWrite + Send + Unpin>;

#[async_trait]
impl PendingConnection for TcpPending {
    fn local_endpoints(&self) -> Vec<Endpoint> {
        Vec::new()
    }

    async fn complete(self: Box<Self>, remote: &[Endpoint]) -> Result<Arc<dyn Connection>, FabricError> {
        let (address, secret) = match remote.first() {
            Some(Endpoint::Tcp { address, secret: Some(secret) }) => (*address, *secret),
            Some(Endpoint::Tcp { secret: None, .. }) => {
                return Err(FabricError::Negotiation {
                    step: "connect",
                    attr: "secret",
                    detail: "peer sent no data-connection secret (an agent older than this protocol?)".into(),
                })
            }
            Some(Endpoint::Verbs(_)) => {
                return Err(FabricError::Negotiation {
                    step: "connect",
                    attr: "fabric",
                    detail: "peer runs the verbs fabric; this agent runs tcp".into(),
                })
            }
            None => {
                return Err(FabricError::Negotiation {
                    step: "connect",
                    attr: "endpoints",
                    detail: "peer returned no data endpoint".into(),
                })
            }
        };
        let cancel = CancellationToken::new();
        let broken = Arc::new(AtomicBool::new(false));
        let mut qps = Vec::with_capacity(self.qps);
        for index in 0..self.qps {
            let (rd, wr) = self.open_stream(address, &secret).await?;
            qps.push(TcpQp::start(index, rd, wr, self.sink.clone(), broken.clone(), cancel.clone()));
        }
        Ok(Arc::new(TcpConnection { qps, broken, cancel }))
    }
}

struct TcpConnection {
    qps: Vec<TcpQp>,
    broken: Arc<AtomicBool>,
    cancel: CancellationToken,
}

impl Connection for TcpConnection {
    fn qps(&self) -> usize {
        self.qps.len()
    }

    fn post(&self, qp: usize, wr: WorkRequest) -> Result<(), FabricError> {
        let q = self.qps.get(qp).ok_or(FabricError::NoSuchQp(qp))?;
        if !matches!(wr.remote_key, RemoteKey::Token(_)) {
            return Err(FabricError::BadRemoteKey);
        }
        wr.local.memory().check(wr.local_offset, wr.len as u64).map_err(|e| FabricError::LocalRange(e.to_string()))?;
        if wr.op == WrOp::Read && !wr.local.memory().writable() {
            return Err(FabricError::LocalRange("READ into read-only memory".into()));
        }
        if q.state.lock().map_err(|_| FabricError::QpBroken)?.broken || self.broken.load(Ordering::Acquire) {
            return Err(FabricError::QpBroken);
        }
        q.tx.send(wr).map_err(|_| FabricError::QpBroken)
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    fn close(&self) {
        self.broken.store(true, Ordering::Release);
        self.cancel.cancel();
    }
}

impl Drop for TcpConnection {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

struct Pending {
    wr: WorkRequest,
}

/// Shared by the writer and reader tasks of one stream. Holding the lock orders "queue a WR" with
/// "the stream broke", so every WR gets exactly one completion or flush.
struct QpState {
    pending: VecDeque<Pending>,
    broken: bool,
}

struct TcpQp {
    tx: mpsc::UnboundedSender<WorkRequest>,
    state: Arc<Mutex<QpState>>,
}

impl TcpQp {
    fn start(
        index: usize,
        rd: BoxRead,
        wr: BoxWrite,
        sink: CompletionSink,
        conn_broken: Arc<AtomicBool>,
        cancel: CancellationToken,
    ) -> TcpQp {
        let (tx, rx) = mpsc::unbounded_channel();
        let state = Arc::new(Mutex::new(QpState { pending: VecDeque::new(), broken: false }));
        let ctx = QpCtx { index, sink, state: state.clone(), conn_broken, cancel };
        tokio::spawn(writer(ctx.clone(), wr, rx));
        tokio::spawn(reader(ctx, rd));
        TcpQp { tx, state }
    }
}

#[derive(Clone)]
struct QpCtx {
    index: usize,
    sink: CompletionSink,
    state: Arc<Mutex<QpState>>,
    conn_broken: Arc<AtomicBool>,
    cancel: CancellationToken,
}

impl QpCtx {
    fn complete(&self, wr: &WorkRequest, status: WcStatus) {
        crate::metrics::work_completion(status.name());
        // The receiver is gone only when nobody waits for completions any more.
        let _ = self.sink.send(Completion { wr_id: wr.wr_id, qp: self.index, status, byte_len: wr.len });
    }

    /// Breaks the QP: the first pending WR completes with `first`, the rest are flushed.
    fn fail(&self, first: WcStatus) {
        self.conn_broken.store(true, Ordering::Release);
        let drained: Vec<Pending> = match self.state.lock() {
            Ok(mut st) => {
                st.broken = true;
                st.pending.drain(..).collect()
            }
            Err(_) => Vec::new(),
        };
        for (i, p) in drained.iter().enumerate() {
            self.complete(&p.wr, if i == 0 { first } else { WcStatus::WrFlushErr });
        }
        self.cancel.cancel();
    }

    /// Queues a WR as pending, or flushes it if the QP already broke.
    fn enqueue(&self, wr: WorkRequest) -> Option<WorkRequest> {
        let Ok(mut st) = self.state.lock() else {
            return None;
        };
        if st.broken {
            drop(st);
            self.complete(&wr, WcStatus::WrFlushErr);
            return None;
        }
        st.pending.push_back(Pending { wr: wr.clone() });
        Some(wr)
    }
}

async fn writer(ctx: QpCtx, out: BoxWrite, mut rx: mpsc::UnboundedReceiver<WorkRequest>) {
    // Small frames (headers, small payloads) are coalesced and flushed once no further WR is
    // queued; payloads at least as large as the buffer bypass it, so big chunks are not copied.
    let mut out = BufWriter::with_capacity(64 << 10, out);
    loop {
        let wr = tokio::select! {
            _ = ctx.cancel.cancelled() => break,
            wr = rx.recv() => match wr { Some(wr) => wr, None => break },
        };
        let Some(wr) = ctx.enqueue(wr) else { continue };
        let RemoteKey::Token(token) = wr.remote_key else {
            ctx.fail(WcStatus::LocQpOpErr);
            break;
        };
        let kind = match wr.op {
            WrOp::Write => Kind::Write,
            WrOp::Read => Kind::ReadReq,
            WrOp::Notify { .. } => Kind::Notify,
        };
        let mut h = Header::new(kind, wr.wr_id);
        // A NOTIFY names its grant by token and carries the marker's immediate (a verbs WRITE
        // WITH IMMEDIATE's 32 bits) where other frames carry the address; it has no length.
        h.addr = match wr.op {
            WrOp::Notify { slot } => slot as u64,
            _ => wr.remote_addr,
        };
        h.len = if kind == Kind::Notify { 0 } else { wr.len };
        h.token = token;
        if wr.signaled {
            h.flags |= ACK_REQUESTED;
        }
        // Memory over a file that can shrink is copied out first: a truncated page then faults in
        // the agent (and poisons the memory, see `xfer_rdma::sigbus`) instead of failing the socket
        // write with EFAULT, and zeros standing in for the file are never sent.
        let bounce = if wr.op == WrOp::Write && wr.local.memory().can_shrink() {
            let mut b = vec![0u8; wr.len as usize];
            if let Err(e) = wr.local.memory().read_at(wr.local_offset, &mut b) {
                warn!(qp = ctx.index, error = %e, "tcp fabric: cannot send from local memory");
                ctx.fail(WcStatus::LocProtErr);
                break;
            }
            Some(b)
        } else {
            None
        };
        let send = async {
            out.write_all(&h.encode()).await?;
            if let Some(b) = &bounce {
                out.write_all(b).await?;
            } else if wr.op == WrOp::Write {
                // Straight from region memory: no bounce buffer. Bounds were checked at post.
                wr.local.memory().write_all_from(&mut out, wr.local_offset, wr.len as usize).await?;
            }
            if rx.is_empty() {
                out.flush().await?;
            }
            Ok::<(), std::io::Error>(())
        };
        // A write waits on the target reading; closing the connection must not wait for that
        // (a stopped or hostile target would otherwise hold this task and its socket for ever).
        let res = tokio::select! {
            r = send => r,
            _ = ctx.cancel.cancelled() => break,
        };
        if let Err(e) = res {
            debug!(qp = ctx.index, error = %e, "tcp fabric: stream write failed");
            ctx.fail(WcStatus::RetryExcErr);
            break;
        }
    }
    // Flush whatever was posted after the stream stopped.
    rx.close();
    while let Ok(wr) = rx.try_recv() {
        ctx.complete(&wr, WcStatus::WrFlushErr);
    }
    // The end of stream for the target, unless the connection was closed: then the stream is
    // dropped as it is (a shutdown could wait on the target like any write).
    tokio::select! {
        _ = out.shutdown() => {}
        _ = ctx.cancel.cancelled() => {}
    }
}

async fn reader(ctx: QpCtx, rd: BoxRead) {
    let mut rd = BufReader::with_capacity(64 << 10, rd);
    let first_error = loop {
        let mut hb = [0u8; HEADER_LEN];
        let res = tokio::select! {
            _ = ctx.cancel.cancelled() => break WcStatus::WrFlushErr,
            r = rd.read_exact(&mut hb) => r,
        };
        if let Err(e) = res {
            debug!(qp = ctx.index, error = %e, "tcp fabric: peer stream closed");
            break WcStatus::RetryExcErr;
        }
        let h = match Header::decode(&hb) {
            Ok(h) => h,
            Err(e) => {
                warn!(qp = ctx.index, error = %e, "tcp fabric: bad frame from target");
                break WcStatus::RemInvReqErr;
            }
        };
        match handle_response(&ctx, &mut rd, &h).await {
            Ok(None) => {}
            Ok(Some(status)) => break status,
            Err(e) => {
                debug!(qp = ctx.index, error = %e, "tcp fabric: read of response failed");
                break WcStatus::RetryExcErr;
            }
        }
    };
    ctx.fail(first_error);
}

/// Handles one response frame; `Some(status)` breaks the QP with that status for the matched WR.
async fn handle_response(ctx: &QpCtx, rd: &mut BufReader<BoxRead>, h: &Header) -> std::io::Result<Option<WcStatus>> {
    // Responses arrive in posting order; earlier unsignaled WRITEs completed silently. A READ or
    // a signaled WR is always answered, so a response that skips one is the target breaking the
    // protocol: the QP fails (the skipped WR with the error) rather than losing its completion.
    let matched = {
        let Ok(mut st) = ctx.state.lock() else { return Ok(Some(WcStatus::GeneralErr)) };
        loop {
            match st.pending.front() {
                None => return Ok(Some(WcStatus::RemInvReqErr)),
                Some(p) if p.wr.wr_id == h.id => break st.pending.pop_front(),
                Some(p) if p.wr.op == WrOp::Read || p.wr.signaled => return Ok(Some(WcStatus::RemInvReqErr)),
                Some(_) => {
                    st.pending.pop_front();
                }
            }
        }
    };
    let Some(p) = matched else { return Ok(Some(WcStatus::GeneralErr)) };
    // Every return below that does not complete the WR (a refusal, a bad answer, a payload cut
    // short by `?`) puts it back at the head of the queue, so the stream's failure reports it.
    let mut m = Matched { ctx, wr: p.wr, done: false };
    let wr = &m.wr;
    match h.kind {
        // Only a signaled WR asks for an ACK; one for a silent WR is the target breaking the
        // protocol (the driver must never see a completion for a WR it did not signal).
        Kind::Ack if matches!(wr.op, WrOp::Write | WrOp::Notify { .. }) && wr.signaled => {
            ctx.complete(m.done(), WcStatus::Success);
            Ok(None)
        }
        Kind::ReadResp if wr.op == WrOp::Read && h.status == 0 => {
            if h.len != wr.len {
                return Ok(Some(WcStatus::RemInvReqErr));
            }
            let mem = wr.local.memory();
            if mem.can_shrink() {
                // Through a buffer, so a truncated page faults in the agent (not EFAULT in the
                // socket read), the stream stays in sync, and a poisoned region fails the WR.
                let mut b = vec![0u8; wr.len as usize];
                rd.read_exact(&mut b).await?;
                if mem.write_at(wr.local_offset, &b).is_err() {
                    return Ok(Some(WcStatus::LocProtErr));
                }
            } else {
                if !mem.writable() || mem.check(wr.local_offset, wr.len as u64).is_err() {
                    return Ok(Some(WcStatus::LocProtErr));
                }
                // Straight into region memory: no bounce buffer.
                mem.read_exact_into(rd, wr.local_offset, wr.len as usize).await?;
            }
            let wr = m.done();
            if wr.signaled {
                ctx.complete(wr, WcStatus::Success);
            }
            Ok(None)
        }
        Kind::Nak | Kind::ReadResp => {
            let status = WcStatus::from_code(h.status as u32);
            Ok(Some(if status.is_success() { WcStatus::RemInvReqErr } else { status }))
        }
        _ => Ok(Some(WcStatus::RemInvReqErr)),
    }
}

/// The WR an answer was matched to, taken off the head of the queue. Dropped before
/// [`Matched::done`] (any return that does not complete it), it goes back to the head, so `fail`
/// reports it with the stream's error instead of losing its completion.
struct Matched<'a> {
    ctx: &'a QpCtx,
    wr: WorkRequest,
    done: bool,
}

impl Matched<'_> {
    /// The answer was handled in full: the WR leaves the queue for good.
    fn done(&mut self) -> &WorkRequest {
        self.done = true;
        &self.wr
    }
}

impl Drop for Matched<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Error paths only: the queue takes its own copy (an Arc and a few words).
        if let Ok(mut st) = self.ctx.state.lock() {
            st.pending.push_front(Pending { wr: self.wr.clone() });
        }
    }
}

/// The initiator side of one data stream, driven from memory: `wrs` are posted in order on a QP
/// whose frames go to `wr` and whose target answers are read from `rd` (which must end). Returns
/// once both of the stream's tasks are gone (the answers read to their end or to a protocol
/// error, every WR handed to the writer): every completion the QP produced, and how many WRs
/// could not be posted (the stream had already ended; they are the last ones). As on verbs, a WR
/// completes once (an unsignaled one only if it fails). Public (but not API) for the
/// `initiator_answers` fuzz target.
#[doc(hidden)]
pub async fn run_initiator_stream<R, W>(rd: R, wr: W, wrs: Vec<WorkRequest>) -> (Vec<Completion>, usize)
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    let (sink, mut completions) = mpsc::unbounded_channel();
    let qp = TcpQp::start(0, Box::new(rd), Box::new(wr), sink, Arc::new(AtomicBool::new(false)), CancellationToken::new());
    let mut refused = 0;
    for w in wrs {
        if qp.tx.send(w).is_err() {
            refused += 1;
        }
    }
    // No more WRs: the writer ends once it has handed on the posted ones, the reader at the end
    // of the answers, and the sink closes with them.
    drop(qp);
    let mut got = Vec::new();
    while let Some(c) = completions.recv().await {
        got.push(c);
    }
    (got, refused)
}

/// A registration of `memory` as the tcp fabric makes one (no keys), for
/// [`run_initiator_stream`]'s callers.
#[doc(hidden)]
pub fn registration(memory: Arc<RegionMemory>, access: Access) -> Arc<dyn Registration> {
    Arc::new(TcpRegistration { memory, access })
}

// ------------------------------------------------------------------ target side

#[derive(Clone)]
struct ServeCtx {
    check: Arc<dyn AccessCheck>,
    sessions: Arc<Sessions>,
    tls: Option<DataTls>,
    shutdown: CancellationToken,
    limits: DataLimits,
    /// Open sockets on the data port (`limits.max_data_connections`), from accept until close.
    open: Arc<crate::sys::Slots>,
    pending: Arc<PendingSockets>,
}

async fn serve(listener: TcpListener, ctx: ServeCtx) {
    let mut backoff = crate::sys::AcceptBackoff::default();
    loop {
        let accepted = tokio::select! {
            _ = ctx.shutdown.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, from)) => {
                backoff.succeeded();
                // Counted from accept until the socket closes: a flood of silent sockets cannot
                // take more than the cap (and the hello deadline reclaims them).
                let Some(slot) = ctx.open.take() else {
                    crate::metrics::data_connection_refused("total");
                    debug!(%from, max = ctx.limits.max_connections, "tcp fabric: data connection refused (limits.max_data_connections)");
                    drop(stream);
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let ctx = ctx.clone();
                let pending = ctx.pending.enter();
                tokio::spawn(async move {
                    if let Err(e) = serve_stream(stream, pending, &ctx).await {
                        debug!(%from, error = %e, "tcp fabric: data stream ended");
                    }
                    drop(slot);
                });
            }
            Err(e) => {
                // EMFILE/ENFILE: the listener stays readable, so retrying at once would spin.
                let pause = backoff.failed("data");
                warn!(error = %e, ?pause, "tcp fabric: accept failed; backing off");
                tokio::select! {
                    _ = ctx.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
    }
}

/// Reads a stream's hello: the connection id and its secret. Public (but not API) for the fuzz
/// target.
#[doc(hidden)]
pub async fn read_hello<R: AsyncRead + Unpin>(rd: &mut R) -> Result<(ConnectionId, [u8; 32]), ServeError> {
    let mut head = [0u8; 5];
    rd.read_exact(&mut head).await?;
    if &head[..4] != HELLO_MAGIC {
        return Err(ServeError::Hello("not an xfer data stream (bad magic)"));
    }
    let n = head[4] as usize;
    if n == 0 || n > 64 {
        return Err(ServeError::Hello("connection id must be 1-64 bytes"));
    }
    let mut id = vec![0u8; n];
    rd.read_exact(&mut id).await?;
    let id = std::str::from_utf8(&id).map_err(|_| ServeError::Hello("connection id is not UTF-8"))?;
    let id = ConnectionId::parse(id).map_err(|_| ServeError::Hello("connection id must be 1-64 characters from [A-Za-z0-9_.-]"))?;
    let mut secret = [0u8; 32];
    rd.read_exact(&mut secret).await?;
    Ok((id, secret))
}

/// One data stream: (TLS handshake,) hello within `limits.data_handshake_timeout`, then frames
/// until the stream, its session or the fabric ends, or it idles for `limits.data_idle_timeout`.
async fn serve_stream(stream: TcpStream, pending: PendingGuard, ctx: &ServeCtx) -> Result<(), ServeError> {
    let deadline = ctx.limits.handshake_timeout;
    let late = || {
        crate::metrics::data_connection_closed("handshake");
    };
    match &ctx.tls {
        None => {
            let (mut rd, mut wr) = stream.into_split();
            let hello = match before_hello(&pending, deadline, read_hello(&mut rd)).await {
                Some(Ok(h)) => h,
                Some(Err(e)) => {
                    refuse(&mut wr, 0, WcStatus::RemInvReqErr).await;
                    return Err(e);
                }
                None => {
                    late();
                    return Err(ServeError::Hello("no hello in time"));
                }
            };
            drop(pending);
            serve_session(rd, wr, hello, None, ctx).await
        }
        Some(tls) => {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.server.clone());
            let handshake = async {
                let mut s = acceptor.accept(stream).await?;
                let hello = read_hello(&mut s).await?;
                Ok::<_, ServeError>((s, hello))
            };
            let (mut s, hello) = before_hello(&pending, deadline, handshake).await.ok_or_else(|| {
                late();
                ServeError::Hello("no TLS handshake and hello in time")
            })??;
            drop(pending);
            let who = match tls.caller_of(s.get_ref().1.peer_certificates()) {
                Ok(c) if c.role == Role::Node => c.name,
                _ => {
                    refuse(&mut s, 0, WcStatus::RemAccessErr).await;
                    return Err(ServeError::Hello("data streams need a node certificate"));
                }
            };
            let (rd, wr) = tokio::io::split(s);
            serve_session(rd, wr, hello, Some(who), ctx).await
        }
    }
}

/// Runs a stream's (TLS handshake and) hello until `deadline` (`None`) or until a newer socket
/// evicts this one from the [`PendingSockets`] (an error).
async fn before_hello<T>(
    pending: &PendingGuard,
    deadline: Duration,
    hello: impl std::future::Future<Output = Result<T, ServeError>>,
) -> Option<Result<T, ServeError>> {
    tokio::select! {
        _ = pending.token.cancelled() => Some(Err(ServeError::Hello(
            "closed before its hello to make room for a newer socket (limits.max_pending_data_connections)"
        ))),
        r = tokio::time::timeout(deadline, hello) => r.ok(),
    }
}

/// One NAK (of frame `id`, 0 before any frame) before closing a refused stream, so the initiator
/// fails with a status rather than a bare EOF.
async fn refuse<W: AsyncWrite + Unpin>(wr: &mut W, id: u64, status: WcStatus) {
    let _ = wr.write_all(&Header::nak(id, status).encode()).await;
    let _ = wr.flush().await;
}

async fn serve_session<R, W>(
    rd: R,
    mut wr: W,
    hello: (ConnectionId, [u8; 32]),
    identity: Option<String>,
    ctx: &ServeCtx,
) -> Result<(), ServeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (connection, secret) = hello;
    let (closed, owner) = match ctx.sessions.admit(&connection, &secret, identity.as_deref()) {
        Ok(c) => c,
        Err(why) => {
            refuse(&mut wr, 0, WcStatus::RemAccessErr).await;
            return Err(match why {
                Refusal::Hello(why) => ServeError::Hello(why),
                Refusal::PerPeer => {
                    crate::metrics::data_connection_refused("per_peer");
                    ServeError::Hello("too many data streams from this identity (limits.max_data_connections_per_peer)")
                }
            });
        }
    };
    let r = tokio::select! {
        _ = ctx.shutdown.cancelled() => Ok(()),
        _ = closed.cancelled() => Ok(()),
        r = serve_frames_idle(rd, wr, &*ctx.check, &connection, Some(ctx.limits.idle_timeout), Some(ctx.limits.payload_timeout)) => r,
    };
    ctx.sessions.stream_ended(&connection, &owner);
    match r {
        Err(ServeError::Idle) => crate::metrics::data_connection_closed("idle"),
        Err(ServeError::PayloadTimeout) => crate::metrics::data_connection_closed("payload"),
        Err(ServeError::Revoked) => crate::metrics::data_connection_closed("revoked"),
        Err(ServeError::Stalled) => crate::metrics::data_connection_closed("stalled"),
        _ => {}
    }
    r
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("protocol violation: {0}")]
    Frame(#[from] FrameError),
    #[error("unexpected {0:?} frame from initiator")]
    Unexpected(Kind),
    #[error("refused data stream: {0}")]
    Hello(&'static str),
    #[error("closed idle data stream (no frame within limits.data_idle_timeout)")]
    Idle,
    #[error("closed data stream: a WRITE payload did not arrive within limits.data_payload_timeout")]
    PayloadTimeout,
    #[error("closed data stream: the grant of the WRITE payload being received was revoked, expired or its region deleted")]
    Revoked,
    #[error("closed data stream: the region's file shrank while a READ answer was being sent")]
    ShrankMidAnswer,
    #[error("closed data stream: the initiator did not read its answers within limits.data_idle_timeout")]
    Stalled,
}

/// The target side of one data stream of connection `connection` (its hello already checked):
/// reads frames from `rd`, checks each against `check`, moves payloads to/from region memory and
/// answers on `wr`. Returns `Ok` at a clean end of stream. Public (but not API) so the fuzz target
/// can drive it from memory without sockets.
#[doc(hidden)]
pub async fn serve_frames<R, W>(rd: R, wr: W, check: &dyn AccessCheck, connection: &ConnectionId) -> Result<(), ServeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    serve_frames_idle(rd, wr, check, connection, None, None).await
}

/// [`serve_frames`], ending with [`ServeError::Idle`] when no frame header starts arriving
/// within `idle`, and with [`ServeError::PayloadTimeout`] when a WRITE payload (stored or
/// discarded) is not complete within `payload` of its header.
async fn serve_frames_idle<R, W>(
    rd: R,
    wr: W,
    check: &dyn AccessCheck,
    connection: &ConnectionId,
    idle: Option<Duration>,
    payload: Option<Duration>,
) -> Result<(), ServeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut rd = BufReader::with_capacity(64 << 10, rd);
    // Responses are coalesced, and flushed before any read that could wait for the initiator:
    // the initiator writes whole frames, so bytes already buffered never wait on our answers.
    // An initiator that stops reading its answers fails the stream after `idle` without
    // progress (a write, not only a read, can wait on the peer).
    let mut wr = BufWriter::with_capacity(64 << 10, StallGuard::new(wr, idle));
    let served = serve_loop(&mut rd, &mut wr, check, connection, idle, payload).await;
    // However the stream ends (a bad frame, a payload cut short, a revocation, the idle timer),
    // the answers to the frames served before it are still delivered: a READ answered in full
    // must not reach the initiator cut short because a later frame was refused. When the loop
    // failed, its error is the one returned (and a stalled reader gets no second wait).
    let stalled = matches!(&served, Err(ServeError::Io(e)) if is_stall(e));
    let flushed = if stalled { Ok(()) } else { wr.flush().await.map_err(ServeError::from) };
    served.and(flushed).map_err(|e| match e {
        ServeError::Io(e) if is_stall(&e) => ServeError::Stalled,
        e => e,
    })
}

/// The frame loop of [`serve_frames_idle`]; its caller flushes `wr` however this returns.
async fn serve_loop<R, W>(
    rd: &mut BufReader<R>,
    wr: &mut BufWriter<W>,
    check: &dyn AccessCheck,
    connection: &ConnectionId,
    idle: Option<Duration>,
    payload: Option<Duration>,
) -> Result<(), ServeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // Whether this stream has refused a WRITE or READ. On an RC QP a refused work request puts
    // the QP in error and nothing behind it executes; this stream serves on (it stays in sync),
    // but a notification marker behind a refused request must not count: the initiator pipelines
    // its markers right behind its data, so the marker of a batch whose WRITE was just NAKed (a
    // poisoned region, a range past the grant) is already on the wire. Initiators never reuse a
    // stream after a NAK (the QP breaks), so this costs an honest peer nothing.
    let mut refused = false;
    loop {
        if rd.buffer().is_empty() {
            wr.flush().await?;
        }
        let mut hb = [0u8; HEADER_LEN];
        let read = match idle {
            None => rd.read_exact(&mut hb).await,
            Some(idle) => match tokio::time::timeout(idle, rd.read_exact(&mut hb)).await {
                Ok(r) => r,
                Err(_) => return Err(ServeError::Idle),
            },
        };
        match read {
            Ok(_) => {}
            // A clean end of stream (the caller flushes what is buffered).
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let h = match Header::decode(&hb) {
            Ok(h) => h,
            Err(e) => {
                // The stream cannot be resynchronised: NAK and close.
                refuse(wr, 0, WcStatus::RemInvReqErr).await;
                return Err(e.into());
            }
        };
        match h.kind {
            Kind::Write => {
                let deadline = payload.map(|p| tokio::time::Instant::from_std(crate::deadline::instant_after(p)));
                let target = check.check(connection, &h.token, h.addr, h.len as u64, RemoteOp::Write).and_then(|t| {
                    match (t.memory.writable(), t.memory.check(t.offset, h.len as u64), t.memory.intact()) {
                        (true, Ok(_), Ok(())) => Ok(t),
                        _ => Err(WcStatus::RemAccessErr),
                    }
                });
                match target {
                    Ok(t) => {
                        // Revoked (or expired) before the payload is in: the stream is closed
                        // rather than resynchronised, and no further byte lands.
                        let stored = within(deadline, Some(&t.lease), store_payload(rd, &t, h.len as usize)).await?;
                        if stored {
                            if h.flags & ACK_REQUESTED != 0 {
                                wr.write_all(&Header::new(Kind::Ack, h.id).encode()).await?;
                            }
                        } else {
                            refused = true;
                            wr.write_all(&Header::nak(h.id, WcStatus::RemAccessErr).encode()).await?;
                        }
                    }
                    Err(status) => {
                        refused = true;
                        within(deadline, None, async { Ok(discard(rd, h.len as u64).await?) }).await?;
                        wr.write_all(&Header::nak(h.id, status).encode()).await?;
                    }
                }
            }
            Kind::ReadReq => {
                let mut resp = Header::new(Kind::ReadResp, h.id);
                match check.check(connection, &h.token, h.addr, h.len as u64, RemoteOp::Read).map(|t| (t.memory, t.offset)) {
                    Ok((mem, off)) if mem.can_shrink() => {
                        // Copied out piece by piece through one small buffer (a peer's READ never
                        // makes the agent hold its whole length): a truncated page faults in the
                        // agent and poisons the region, and zeros standing in for it are never
                        // sent. A region already poisoned is NAKed; one that is poisoned while its
                        // answer is on the way closes the stream (the header promised the length),
                        // so the initiator fails the WR instead of taking the zeros.
                        if mem.intact().is_err() {
                            refused = true;
                            resp.status = WcStatus::RemAccessErr.code();
                            wr.write_all(&resp.encode()).await?;
                        } else {
                            resp.len = h.len;
                            wr.write_all(&resp.encode()).await?;
                            let len = h.len as usize;
                            let mut b = vec![0u8; len.min(PAYLOAD_CHUNK)];
                            let mut done = 0usize;
                            while done < len {
                                let n = (len - done).min(PAYLOAD_CHUNK);
                                if mem.read_at(off + done as u64, &mut b[..n]).is_err() {
                                    return Err(ServeError::ShrankMidAnswer);
                                }
                                wr.write_all(&b[..n]).await?;
                                done += n;
                            }
                        }
                    }
                    Ok((mem, off)) => {
                        resp.len = h.len;
                        wr.write_all(&resp.encode()).await?;
                        mem.write_all_from(wr, off, h.len as usize).await?;
                    }
                    Err(status) => {
                        refused = true;
                        resp.status = status.code();
                        wr.write_all(&resp.encode()).await?;
                    }
                }
            }
            Kind::Notify if refused => {
                // Behind a refused request (see `refused`): flushed, as on an RC QP in error.
                crate::metrics::notify_marker("refused");
                wr.write_all(&Header::nak(h.id, WcStatus::WrFlushErr).encode()).await?;
            }
            Kind::Notify => {
                // Every earlier frame of this stream has been served and accepted (its bytes are
                // in region memory): the marker may count.
                // An immediate wider than 32 bits names nothing.
                let imm = u32::try_from(h.addr).unwrap_or(0);
                match check.marker(connection, &h.token, imm) {
                    Ok(()) if h.flags & ACK_REQUESTED != 0 => wr.write_all(&Header::new(Kind::Ack, h.id).encode()).await?,
                    Ok(()) => {}
                    Err(status) => wr.write_all(&Header::nak(h.id, status).encode()).await?,
                }
            }
            other => {
                refuse(wr, h.id, WcStatus::RemInvReqErr).await;
                return Err(ServeError::Unexpected(other));
            }
        }
    }
}

/// Runs a payload read until `deadline` ([`ServeError::PayloadTimeout`]) or until `lease` (if
/// any) is revoked ([`ServeError::Revoked`]), whichever comes first.
async fn within<T>(
    deadline: Option<tokio::time::Instant>,
    lease: Option<&GrantLease>,
    read: impl std::future::Future<Output = Result<T, ServeError>>,
) -> Result<T, ServeError> {
    let revoked = async {
        match lease {
            Some(l) => l.revoked.cancelled().await,
            None => std::future::pending().await,
        }
    };
    let guarded = async {
        tokio::select! {
            biased;
            _ = revoked => Err(ServeError::Revoked),
            r = read => r,
        }
    };
    match deadline {
        Some(d) => tokio::time::timeout_at(d, guarded).await.unwrap_or(Err(ServeError::PayloadTimeout)),
        None => guarded.await,
    }
}

/// Reads a WRITE payload of `len` bytes into the checked target, chunk by chunk, each chunk
/// copied into region memory only while the grant's lease is held live (see [`GrantLease`]).
/// `Ok(false)`: every byte was read but some did not land (a shrunk file: NAK, the stream stays in
/// sync). [`ServeError::Revoked`] once the lease is revoked or expired mid-payload.
async fn store_payload<R: AsyncRead + Unpin>(rd: &mut R, t: &Checked, len: usize) -> Result<bool, ServeError> {
    let mem = &t.memory;
    if mem.can_shrink() {
        // Through a buffer: a truncated page faults in the agent (poisoning the region) rather
        // than as EFAULT in the socket read, the stream stays in sync, and a write that landed in
        // zero pages is NAKed, not acknowledged.
        let mut buf = vec![0u8; len.min(PAYLOAD_CHUNK)];
        let mut done = 0usize;
        let mut landed = true;
        while done < len {
            let want = (len - done).min(PAYLOAD_CHUNK);
            let n = rd.read(&mut buf[..want]).await?;
            if n == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
            let Some(_live) = t.lease.hold() else { return Err(ServeError::Revoked) };
            landed &= mem.write_at(t.offset + done as u64, &buf[..n]).is_ok();
            done += n;
        }
        return Ok(landed);
    }
    // Straight from the socket into region memory: no bounce buffer. Each read into the region
    // happens inside one poll, under the lease.
    let mut done = 0usize;
    while done < len {
        let want = (len - done).min(PAYLOAD_CHUNK);
        let n = std::future::poll_fn(|cx| {
            let Some(live) = t.lease.hold() else { return std::task::Poll::Ready(Err(ServeError::Revoked)) };
            let r = mem.poll_read_into(std::pin::Pin::new(&mut *rd), cx, t.offset + done as u64, want);
            drop(live);
            r.map(|r| r.map_err(ServeError::from))
        })
        .await?;
        if n == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
        done += n;
    }
    Ok(true)
}

/// Reads and drops `len` payload bytes of a refused WRITE so the stream stays in sync.
async fn discard<R: AsyncReadExt + Unpin>(rd: &mut R, mut len: u64) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 << 10];
    while len > 0 {
        let n = (len as usize).min(buf.len());
        rd.read_exact(&mut buf[..n]).await?;
        len -= n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: [u8; 16] = [0x22; 16];
    const LEN: usize = 64 << 10;

    /// One READ grant over a whole 64 KiB region at address 0, with the region's bytes 0, 1, 2, …
    struct ReadAll {
        memory: Arc<RegionMemory>,
        lease: Arc<GrantLease>,
    }

    impl ReadAll {
        fn new() -> ReadAll {
            let memory = Arc::new(RegionMemory::anonymous(LEN, false).expect("64 KiB mapping"));
            let pattern: Vec<u8> = (0..LEN).map(|i| i as u8).collect();
            memory.write_at(0, &pattern).expect("fill");
            let lease = GrantLease::new(std::time::SystemTime::now() + Duration::from_secs(3600));
            ReadAll { memory, lease }
        }
    }

    impl AccessCheck for ReadAll {
        fn check(&self, _: &ConnectionId, token: &[u8; 16], addr: u64, len: u64, op: RemoteOp) -> Result<Checked, WcStatus> {
            if token != &TOKEN || op != RemoteOp::Read || addr.checked_add(len).is_none_or(|end| end > LEN as u64) {
                return Err(WcStatus::RemAccessErr);
            }
            Ok(Checked { memory: self.memory.clone(), offset: addr, lease: self.lease.clone() })
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
        qp.tx.send(work(7, WrOp::Write, &local, LEN as u32, true)).expect("the writer is running");
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
            qp.tx.send(work(id, WrOp::Write, &local, 16, true)).expect("the writer is running");
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
        let r = serve_frames_idle(rd, wr, &grants, &connection(), Some(idle), Some(Duration::from_secs(30))).await;
        assert!(matches!(r, Err(ServeError::Stalled)), "{r:?}");
        assert_eq!(start.elapsed(), idle);
        drop(ours);
    }
}
