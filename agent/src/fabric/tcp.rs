//! TCP fabric: software one-sided WRITE/READ over TCP streams, for nodes without RDMA and for tests.
//!
//! Each "QP" is one TCP stream from the initiator to the target's data listener (its address is
//! the responder's endpoint in `Peer.Connect`). The initiator side has a writer task (frames out,
//! payload written straight from region memory) and a reader task (ACK/NAK/READ_RESP in, READ
//! payload read straight into region memory). The target validates every frame against its grant
//! table ([`AccessCheck`]) before it touches memory and answers NAK with a verbs-style status on
//! any violation. Streams are processed in order, so an ACK for a signaled WRITE implies every
//! earlier WR on that stream succeeded, exactly like an RC QP.
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::frame::{FrameError, Header, Kind, ACK_REQUESTED, HEADER_LEN};
use super::{
    Access, Accepted, Completion, CompletionSink, Connection, Endpoint, Exposure, ExposeRequest, Fabric,
    FabricError, FabricInfo, FabricKind, PendingConnection, Registration, RemoteKey, RemoteOp, WcStatus,
    WorkRequest, WrOp,
};
use crate::verbs::memory::RegionMemory;

/// The target's grant table as the TCP fabric sees it: resolves a frame's token and range to
/// region memory, or the status to NAK with.
pub trait AccessCheck: Send + Sync + 'static {
    /// Returns the memory and the offset inside it for `len` bytes at remote address `addr`.
    fn check(&self, token: &[u8; 16], addr: u64, len: u64, op: RemoteOp) -> Result<(Arc<RegionMemory>, u64), WcStatus>;
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

/// The responder's half of a tcp connection: nothing to keep (the data listener serves everyone).
struct TcpAccepted;

impl Accepted for TcpAccepted {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The TCP fabric: a data listener serving one-sided operations, and initiator connections.
pub struct TcpFabric {
    data_address: SocketAddr,
    shutdown: CancellationToken,
}

impl TcpFabric {
    /// Binds the data listener and starts serving frames checked by `check`.
    pub async fn bind(addr: SocketAddr, check: Arc<dyn AccessCheck>) -> Result<TcpFabric, FabricError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| FabricError::Connect { addr: addr.to_string(), source: e })?;
        let data_address = listener.local_addr()?;
        let shutdown = CancellationToken::new();
        tokio::spawn(serve(listener, check, shutdown.clone()));
        Ok(TcpFabric { data_address, shutdown })
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
    fn kind(&self) -> FabricKind {
        FabricKind::Tcp
    }

    fn info(&self) -> FabricInfo {
        FabricInfo { kind: FabricKind::Tcp, devices: Vec::new(), data_address: Some(self.data_address) }
    }

    fn register(&self, memory: Arc<RegionMemory>, access: Access) -> Result<Arc<dyn Registration>, FabricError> {
        Ok(Arc::new(TcpRegistration { memory, access }))
    }

    fn expose(&self, reg: &Arc<dyn Registration>, req: &ExposeRequest) -> Result<Exposure, FabricError> {
        reg.memory().check(req.offset, req.len).map_err(|e| FabricError::LocalRange(e.to_string()))?;
        // 128 bits from the OS-seeded CSPRNG: unguessable, checked on every frame.
        let token: [u8; 16] = rand::random();
        Ok(Exposure { addr: reg.addr() + req.offset, key: RemoteKey::Token(token), keepalive: None })
    }

    async fn prepare(
        &self,
        _peer: &str,
        qps: usize,
        _depth: usize,
        sink: CompletionSink,
    ) -> Result<Box<dyn PendingConnection>, FabricError> {
        Ok(Box::new(TcpPending { qps: qps.max(1), sink }))
    }

    async fn accept(&self, _peer: &str, remote: &[Endpoint]) -> Result<(Vec<Endpoint>, Box<dyn Accepted>), FabricError> {
        if let Some(Endpoint::Verbs(_)) = remote.first() {
            return Err(FabricError::Negotiation {
                step: "accept",
                attr: "fabric",
                detail: "initiator offers verbs endpoints but this agent runs the tcp fabric".into(),
            });
        }
        Ok((vec![Endpoint::Tcp { address: self.data_address }], Box::new(TcpAccepted)))
    }
}

struct TcpPending {
    qps: usize,
    sink: CompletionSink,
}

#[async_trait]
impl PendingConnection for TcpPending {
    fn local_endpoints(&self) -> Vec<Endpoint> {
        Vec::new()
    }

    async fn complete(self: Box<Self>, remote: &[Endpoint]) -> Result<Arc<dyn Connection>, FabricError> {
        let address = match remote.first() {
            Some(Endpoint::Tcp { address }) => *address,
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
            let stream = TcpStream::connect(address)
                .await
                .map_err(|e| FabricError::Connect { addr: address.to_string(), source: e })?;
            stream.set_nodelay(true)?;
            qps.push(TcpQp::start(index, stream, self.sink.clone(), broken.clone(), cancel.clone()));
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
        wr.local
            .memory()
            .check(wr.local_offset, wr.len as u64)
            .map_err(|e| FabricError::LocalRange(e.to_string()))?;
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
        stream: TcpStream,
        sink: CompletionSink,
        conn_broken: Arc<AtomicBool>,
        cancel: CancellationToken,
    ) -> TcpQp {
        let (rd, wr) = stream.into_split();
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

async fn writer(ctx: QpCtx, out: tokio::net::tcp::OwnedWriteHalf, mut rx: mpsc::UnboundedReceiver<WorkRequest>) {
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
        let mut h = Header::new(if wr.op == WrOp::Write { Kind::Write } else { Kind::ReadReq }, wr.wr_id);
        h.addr = wr.remote_addr;
        h.len = wr.len;
        h.token = token;
        if wr.signaled {
            h.flags |= ACK_REQUESTED;
        }
        let res = async {
            out.write_all(&h.encode()).await?;
            if wr.op == WrOp::Write {
                // Straight from region memory: no bounce buffer. Bounds were checked at post.
                let data = wr.local.memory().slice(wr.local_offset, wr.len as u64).map_err(std::io::Error::other)?;
                out.write_all(data).await?;
            }
            if rx.is_empty() {
                out.flush().await?;
            }
            Ok::<(), std::io::Error>(())
        }
        .await;
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
    let _ = out.shutdown().await;
}

async fn reader(ctx: QpCtx, rd: tokio::net::tcp::OwnedReadHalf) {
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
async fn handle_response(
    ctx: &QpCtx,
    rd: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    h: &Header,
) -> std::io::Result<Option<WcStatus>> {
    // Responses arrive in posting order; earlier unsignaled WRITEs completed silently.
    let matched = {
        let Ok(mut st) = ctx.state.lock() else { return Ok(Some(WcStatus::GeneralErr)) };
        loop {
            match st.pending.front() {
                None => return Ok(Some(WcStatus::RemInvReqErr)),
                Some(p) if p.wr.wr_id == h.id => break st.pending.pop_front(),
                Some(p) if p.wr.op == WrOp::Read => return Ok(Some(WcStatus::RemInvReqErr)),
                Some(_) => {
                    st.pending.pop_front();
                }
            }
        }
    };
    let Some(p) = matched else { return Ok(Some(WcStatus::GeneralErr)) };
    match h.kind {
        Kind::Ack if p.wr.op == WrOp::Write => {
            ctx.complete(&p.wr, WcStatus::Success);
            Ok(None)
        }
        Kind::ReadResp if p.wr.op == WrOp::Read && h.status == 0 => {
            if h.len != p.wr.len {
                put_back(ctx, p);
                return Ok(Some(WcStatus::RemInvReqErr));
            }
            let dst = match p.wr.local.memory().slice_mut(p.wr.local_offset, p.wr.len as u64) {
                Ok(d) => d,
                Err(_) => {
                    put_back(ctx, p);
                    return Ok(Some(WcStatus::LocProtErr));
                }
            };
            // Straight into region memory: no bounce buffer.
            rd.read_exact(dst).await?;
            if p.wr.signaled {
                ctx.complete(&p.wr, WcStatus::Success);
            }
            Ok(None)
        }
        Kind::Nak | Kind::ReadResp => {
            let status = WcStatus::from_code(h.status as u32);
            let status = if status.is_success() { WcStatus::RemInvReqErr } else { status };
            put_back(ctx, p);
            Ok(Some(status))
        }
        _ => {
            put_back(ctx, p);
            Ok(Some(WcStatus::RemInvReqErr))
        }
    }
}

/// Returns a matched WR to the head of the queue so `fail` reports it with the error status.
fn put_back(ctx: &QpCtx, p: Pending) {
    if let Ok(mut st) = ctx.state.lock() {
        st.pending.push_front(p);
    }
}

// ------------------------------------------------------------------ target side

async fn serve(listener: TcpListener, check: Arc<dyn AccessCheck>, shutdown: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, from)) => {
                let _ = stream.set_nodelay(true);
                let check = check.clone();
                let shutdown = shutdown.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        _ = shutdown.cancelled() => {}
                        r = serve_stream(stream, check) => if let Err(e) = r {
                            debug!(%from, error = %e, "tcp fabric: data stream ended");
                        }
                    }
                });
            }
            Err(e) => {
                warn!(error = %e, "tcp fabric: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("protocol violation: {0}")]
    Frame(#[from] FrameError),
    #[error("unexpected {0:?} frame from initiator")]
    Unexpected(Kind),
}

async fn serve_stream(stream: TcpStream, check: Arc<dyn AccessCheck>) -> Result<(), ServeError> {
    let (rd, wr) = stream.into_split();
    serve_frames(rd, wr, &*check).await
}

/// The target side of one data stream: reads frames from `rd`, checks each against `check`,
/// moves payloads to/from region memory and answers on `wr`. Returns `Ok` at a clean end of
/// stream. Public (but not API) so the fuzz target can drive it from memory without sockets.
#[doc(hidden)]
pub async fn serve_frames<R, W>(rd: R, wr: W, check: &dyn AccessCheck) -> Result<(), ServeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut rd = BufReader::with_capacity(64 << 10, rd);
    // Responses are coalesced, and flushed before any read that could wait for the initiator:
    // the initiator writes whole frames, so bytes already buffered never wait on our answers.
    let mut wr = BufWriter::with_capacity(64 << 10, wr);
    loop {
        if rd.buffer().is_empty() {
            wr.flush().await?;
        }
        let mut hb = [0u8; HEADER_LEN];
        match rd.read_exact(&mut hb).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                wr.flush().await?;
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        }
        let h = match Header::decode(&hb) {
            Ok(h) => h,
            Err(e) => {
                // The stream cannot be resynchronised: NAK and close.
                let mut nak = Header::new(Kind::Nak, 0);
                nak.status = WcStatus::RemInvReqErr.code();
                let _ = wr.write_all(&nak.encode()).await;
                let _ = wr.flush().await;
                return Err(e.into());
            }
        };
        match h.kind {
            Kind::Write => {
                let target = check
                    .check(&h.token, h.addr, h.len as u64, RemoteOp::Write)
                    .and_then(|(mem, off)| match mem.slice_mut(off, h.len as u64) {
                        Ok(_) => Ok((mem, off)),
                        Err(_) => Err(WcStatus::RemAccessErr),
                    });
                match target {
                    Ok((mem, off)) => {
                        // Checked just above; the payload lands straight in region memory.
                        let dst = mem.slice_mut(off, h.len as u64).map_err(std::io::Error::other)?;
                        rd.read_exact(dst).await?;
                        if h.flags & ACK_REQUESTED != 0 {
                            wr.write_all(&Header::new(Kind::Ack, h.id).encode()).await?;
                        }
                    }
                    Err(status) => {
                        discard(&mut rd, h.len as u64).await?;
                        let mut nak = Header::new(Kind::Nak, h.id);
                        nak.status = status.code();
                        wr.write_all(&nak.encode()).await?;
                    }
                }
            }
            Kind::ReadReq => {
                let mut resp = Header::new(Kind::ReadResp, h.id);
                match check.check(&h.token, h.addr, h.len as u64, RemoteOp::Read) {
                    Ok((mem, off)) => {
                        let src = mem.slice(off, h.len as u64).map_err(std::io::Error::other)?;
                        resp.len = h.len;
                        wr.write_all(&resp.encode()).await?;
                        wr.write_all(src).await?;
                    }
                    Err(status) => {
                        resp.status = status.code();
                        wr.write_all(&resp.encode()).await?;
                    }
                }
            }
            other => {
                let mut nak = Header::new(Kind::Nak, h.id);
                nak.status = WcStatus::RemInvReqErr.code();
                let _ = wr.write_all(&nak.encode()).await;
                let _ = wr.flush().await;
                return Err(ServeError::Unexpected(other));
            }
        }
    }
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
