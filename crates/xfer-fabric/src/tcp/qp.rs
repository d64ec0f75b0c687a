//! One initiator "QP": a data stream's writer task (frames out, WRITE payloads straight from
//! region memory) and reader task (answers in, READ payloads straight into region memory), and
//! the in-order completion of every WR posted on it, as on an RC QP.
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};
use xfer_rdma::gather::{write_all_gathered, Piece};
use xfer_rdma::scatter::{ScatterRead, Stepwise};

use super::wire::FrameReader;
use crate::frame::{Header, Kind, ACK_REQUESTED, HEADER_LEN};
use crate::{Completion, CompletionSink, RemoteKey, WcStatus, WorkRequest, WrOp};

/// Either half of a data stream, plain TCP or TLS.
pub(super) type BoxRead = Box<dyn ScatterRead + Send + Unpin>;
pub(super) type BoxWrite = Box<dyn AsyncWrite + Send + Unpin>;

struct Outstanding {
    wr: WorkRequest,
    /// The WR could not be framed (it was never sent): it completes with this status once every
    /// WR before it has been answered, as on an RC QP, and the QP breaks.
    failed: Option<WcStatus>,
}

/// What [`QpCtx::enqueue`] made of a gather's WRs.
enum Queued {
    /// The QP had broken: every WR was flushed.
    Flushed,
    /// Every WR is pending; all are to be sent.
    All,
    /// The WR at this index could not be framed and waits, pending, for the WRs before it. Those
    /// are sent, then this fence: a signaled zero-length WRITE under its id, answered (ACK or
    /// NAK, either will do) only after every earlier frame of the stream was served, since an
    /// unsignaled WR that succeeds is never answered.
    Fenced(usize, Header),
    /// The WR at this index could not be framed and no WR is pending before it: it completes
    /// with this status now.
    FailNow(WcStatus),
}

/// Shared by the writer and reader tasks of one stream. Holding the lock orders "queue a WR" with
/// "the stream broke", so every WR gets exactly one completion or flush.
pub(super) struct QpState {
    pending: VecDeque<Outstanding>,
    pub(super) broken: bool,
}

pub(super) struct TcpQp {
    /// Runs of WRs for the writer: a run posted at once is taken in one wake-up and leaves in as
    /// few writes as its frames fill (the writer flushes once the queue is empty).
    pub(super) tx: mpsc::UnboundedSender<Vec<WorkRequest>>,
    pub(super) state: Arc<Mutex<QpState>>,
}

impl TcpQp {
    pub(super) fn start(
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
        let drained: Vec<Outstanding> = match self.state.lock() {
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

    /// Queues a gather's WRs as pending (one lock for all), or flushes them if the QP already
    /// broke. `bad`: the index and status of the first WR that could not be framed; it is queued
    /// marked failed (the WRs after it are queued too, to be flushed behind it).
    fn enqueue<'a>(&self, wrs: impl IntoIterator<Item = &'a WorkRequest>, bad: Option<(usize, WcStatus)>) -> Queued {
        let Ok(mut st) = self.state.lock() else {
            return Queued::Flushed;
        };
        if st.broken {
            drop(st);
            for wr in wrs {
                self.complete(wr, WcStatus::WrFlushErr);
            }
            return Queued::Flushed;
        }
        let before = st.pending.len();
        st.pending.extend(
            wrs.into_iter()
                .enumerate()
                .map(|(i, wr)| Outstanding { wr: wr.clone(), failed: bad.filter(|&(at, _)| at == i).map(|(_, status)| status) }),
        );
        let Some((at, status)) = bad else { return Queued::All };
        // The WR just before the bad one (sent earlier, or in this gather): the fence goes under
        // its grant token (a frame that was framed has one).
        let prev = (before + at).checked_sub(1).and_then(|j| st.pending.get(j));
        match (prev.map(|p| (&p.wr.remote_key, p.wr.remote_addr)), st.pending.get(before + at)) {
            (Some((RemoteKey::Token(token), addr)), Some(bad)) => {
                let mut fence = Header::new(Kind::Write, bad.wr.wr_id);
                (fence.addr, fence.token, fence.flags) = (addr, *token, ACK_REQUESTED);
                Queued::Fenced(at, fence)
            }
            // Nothing pending before it (a WR that was framed has a token, so a WR before it
            // always lands above): it is the oldest pending WR, for `fail` to complete.
            _ => Queued::FailNow(status),
        }
    }
}

/// Most frames one gathered write carries: a header and at most one payload slice each, within
/// the kernel's limit of slices per `writev`.
const GATHER_FRAMES: usize = xfer_rdma::gather::MAX_SLICES / 2;
/// Runs already queued are added to a gathered write while it carries less than this (a run is
/// never split; one WR may be longer).
const GATHER_BYTES: usize = 2 << 20;

async fn writer(ctx: QpCtx, mut out: BoxWrite, mut rx: mpsc::UnboundedReceiver<Vec<WorkRequest>>) {
    // Every run already queued (up to the gather limits) leaves in one gathered write: headers
    // and payloads straight from region memory, one system call and one push of segments for
    // many frames, no payload copied in user space. The stream is flushed once nothing more is
    // queued (a TLS stream may hold the last record back until then).
    'runs: loop {
        // A run already queued is taken without arming the cancellation's waiter (a lock each).
        let queued = match rx.try_recv() {
            Ok(run) if !ctx.cancel.is_cancelled() => Some(run),
            Ok(run) => {
                for wr in &run {
                    ctx.complete(wr, WcStatus::WrFlushErr);
                }
                break;
            }
            Err(_) => None,
        };
        let run = match queued {
            Some(run) => run,
            None => tokio::select! {
                _ = ctx.cancel.cancelled() => break,
                run = rx.recv() => match run { Some(run) => run, None => break },
            },
        };
        let mut runs = vec![run];
        let (mut frames, mut bytes) = (runs[0].len(), payload_bytes(&runs[0]));
        // (The run that passes a limit still joins: a write of more slices than the kernel
        // takes at once is sent in several calls.)
        while frames < GATHER_FRAMES && bytes < GATHER_BYTES {
            let Ok(run) = rx.try_recv() else { break };
            (frames, bytes) = (frames + run.len(), bytes + payload_bytes(&run));
            runs.push(run);
        }
        if !gather_and_send(&ctx, &mut out, &runs).await {
            break 'runs;
        }
        if rx.is_empty() {
            let flushed = tokio::select! {
                biased;
                r = out.flush() => r,
                _ = ctx.cancel.cancelled() => break 'runs,
            };
            if let Err(e) = flushed {
                debug!(qp = ctx.index, error = %e, "tcp fabric: stream flush failed");
                ctx.fail(WcStatus::RetryExcErr);
                break 'runs;
            }
        }
    }
    // Whatever was posted after the stream stopped is flushed: behind a WR that could not be
    // framed (it waits for the answers to the WRs before it), or now if the QP broke.
    rx.close();
    while let Ok(run) = rx.try_recv() {
        ctx.enqueue(&run, None);
    }
    // The end of stream for the target, unless the connection was closed: then the stream is
    // dropped as it is (a shutdown could wait on the target like any write).
    tokio::select! {
        _ = out.shutdown() => {}
        _ = ctx.cancel.cancelled() => {}
    }
}

/// Payload bytes a run puts on the stream (WRITEs only; requests and markers are headers).
fn payload_bytes(run: &[WorkRequest]) -> usize {
    run.iter().filter(|wr| wr.op == WrOp::Write).map(|wr| wr.len as usize).sum()
}

/// Queues `runs` as pending and writes their frames in one gathered write (more if the socket
/// takes less). `false` once the writer must stop: the stream failed or was closed, the QP had
/// broken (the runs are flushed), or a WR could not be framed. That WR is not sent; the frames
/// before it are, followed by a fence whose answer tells the reader every WR before it was
/// served, so it completes in order with its own status and the WRs after it are flushed, as on
/// an RC QP.
async fn gather_and_send(ctx: &QpCtx, out: &mut BoxWrite, runs: &[Vec<WorkRequest>]) -> bool {
    // Each WR's encoded header and (memory that can shrink) payload copy, up to the first WR
    // that cannot be framed.
    let mut frames = Vec::new();
    let mut bad = None;
    for (i, wr) in runs.iter().flatten().enumerate() {
        match frame_of(ctx, wr) {
            Ok((h, bounce)) => frames.push((wr, h.encode(), bounce)),
            Err(status) => {
                bad = Some((i, status));
                break;
            }
        }
    }
    // Every WR is pending before the first is written: whatever stops the stream below, the
    // reader's `fail` completes each of them once.
    let fence = match ctx.enqueue(runs.iter().flatten(), bad) {
        Queued::Flushed => return false,
        Queued::All => None,
        Queued::Fenced(at, fence) => Some((at, fence.encode())),
        Queued::FailNow(status) => {
            ctx.fail(status);
            return false;
        }
    };
    let mut pieces = Vec::with_capacity(frames.len() * 2 + 1);
    for (wr, head, bounce) in &frames {
        pieces.push(Piece::Bytes(head));
        match bounce {
            Some(b) => pieces.push(Piece::Bytes(b)),
            // Straight from region memory: bounds were checked at post.
            None if wr.op == WrOp::Write => pieces.push(Piece::Region(wr.local.memory(), wr.local_offset, wr.len as usize)),
            None => {}
        }
    }
    if let Some((_, fence)) = &fence {
        pieces.push(Piece::Bytes(fence));
    }
    // A write waits on the target reading; closing the connection must not wait for that (a
    // stopped or hostile target would otherwise hold this task and its socket for ever). The
    // send first: one that completes at once never arms the cancellation's waiter.
    let res = tokio::select! {
        biased;
        r = async {
            write_all_gathered(out, &pieces).await?;
            // The fence must reach the target now: nothing more is sent on this stream.
            if fence.is_some() {
                out.flush().await?;
            }
            Ok::<(), std::io::Error>(())
        } => r,
        _ = ctx.cancel.cancelled() => return false,
    };
    if let Err(e) = res {
        debug!(qp = ctx.index, error = %e, "tcp fabric: stream write failed");
        ctx.fail(WcStatus::RetryExcErr);
        return false;
    }
    if let Some((at, _)) = fence {
        debug!(qp = ctx.index, sent = at, "tcp fabric: a WR could not be framed; the stream stops behind it");
        return false;
    }
    true
}

/// The frame header of `wr`, and its payload copied out when its memory is over a file that can
/// shrink; `Err` is the status that breaks the QP.
fn frame_of(ctx: &QpCtx, wr: &WorkRequest) -> Result<(Header, Option<Vec<u8>>), WcStatus> {
    let RemoteKey::Token(token) = wr.remote_key else {
        return Err(WcStatus::LocQpOpErr);
    };
    let kind = match wr.op {
        WrOp::Write => Kind::Write,
        WrOp::Read => Kind::ReadReq,
        WrOp::Notify { .. } => Kind::Notify,
    };
    let mut h = Header::new(kind, wr.wr_id);
    // A NOTIFY names its grant by token and carries the marker's immediate (a verbs WRITE WITH
    // IMMEDIATE's 32 bits) where other frames carry the address; it has no length.
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
    if wr.op == WrOp::Write && wr.local.memory().can_shrink() {
        let mut b = vec![0u8; wr.len as usize];
        if let Err(e) = wr.local.memory().read_at(wr.local_offset, &mut b) {
            warn!(qp = ctx.index, error = %e, "tcp fabric: cannot send from local memory");
            return Err(WcStatus::LocProtErr);
        }
        return Ok((h, Some(b)));
    }
    Ok((h, None))
}

async fn reader(ctx: QpCtx, rd: BoxRead) {
    let mut rd = FrameReader::new(rd);
    let first_error = loop {
        let mut hb = [0u8; HEADER_LEN];
        // The read first: an answer already received never arms the cancellation's waiter.
        let res = tokio::select! {
            biased;
            r = rd.read_exact(&mut hb) => r,
            _ = ctx.cancel.cancelled() => break WcStatus::WrFlushErr,
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
        // A READ answer's payload waits on the target like a header does: closing the connection
        // must not wait for a target that stopped sending mid-answer (the WR, put back at the
        // head of the queue when its handling is dropped, is flushed below).
        let handled = tokio::select! {
            biased;
            r = handle_response(&ctx, &mut rd, &h) => r,
            _ = ctx.cancel.cancelled() => break WcStatus::WrFlushErr,
        };
        match handled {
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
async fn handle_response(ctx: &QpCtx, rd: &mut FrameReader<BoxRead>, h: &Header) -> std::io::Result<Option<WcStatus>> {
    // Responses arrive in posting order; earlier unsignaled WRITEs completed silently. A READ or
    // a signaled WR is always answered, so a response that skips one is the target breaking the
    // protocol: the QP fails (the skipped WR with the error) rather than losing its completion.
    let matched = {
        let Ok(mut st) = ctx.state.lock() else { return Ok(Some(WcStatus::GeneralErr)) };
        loop {
            match st.pending.front() {
                None => return Ok(Some(WcStatus::RemInvReqErr)),
                // The WR that could not be framed, reached by the answer to the fence sent in its
                // place: every WR before it was answered (or, unsignaled, served without an
                // answer). It completes with its own status and the QP breaks (it stays at the
                // head of the queue for `fail`).
                Some(Outstanding { failed: Some(status), .. }) => return Ok(Some(*status)),
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
                // Straight into region memory, or landed from the read buffer: no bounce buffer.
                rd.read_exact_region(mem, wr.local_offset, wr.len as usize).await?;
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
            st.pending.push_front(Outstanding { wr: self.wr.clone(), failed: None });
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
    let qp = TcpQp::start(0, Box::new(Stepwise(rd)), Box::new(wr), sink, Arc::new(AtomicBool::new(false)), CancellationToken::new());
    let mut refused = 0;
    for w in wrs {
        if qp.tx.send(vec![w]).is_err() {
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
