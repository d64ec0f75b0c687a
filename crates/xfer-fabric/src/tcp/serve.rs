//! The target's frame loop: the frames of one admitted data stream, each checked against the
//! grant table before it touches region memory, answered with ACK, NAK or READ_RESP; WRITE
//! payloads land chunk by chunk under the grant's gate.
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::whole::{serve_whole_frames, GrantCache};
use super::wire::{is_answer_revoked, FrameReader, FrameWriter, Part};

use crate::frame::{FrameError, Header, Kind, ACK_REQUESTED, HEADER_LEN};
use crate::grant::{AccessCheck, Checked, GrantGate, PAYLOAD_CHUNK};
use crate::stall::{is_stall, StallGuard};
use crate::{RemoteOp, WcStatus};
use xfer_engine::ids::ConnectionId;
use xfer_rdma::scatter::{ScatterRead, Stepwise};

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

/// One NAK (of frame `id`, 0 before any frame) before closing a refused stream, so the initiator
/// fails with a status rather than a bare EOF.
pub(super) async fn refuse<W: AsyncWrite + Unpin>(wr: &mut W, id: u64, status: WcStatus) {
    let _ = wr.write_all(&Header::nak(id, status).encode()).await;
    let _ = wr.flush().await;
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
    serve_frames_idle(Stepwise(rd), wr, check, connection, StreamTimers::default()).await
}

/// The time limits of one served stream; `None` is no limit.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct StreamTimers {
    /// No frame header starts arriving within this: [`ServeError::Idle`].
    pub(super) idle: Option<Duration>,
    /// The initiator reads none of our answers within this: [`ServeError::Stalled`].
    pub(super) stall: Option<Duration>,
    /// A WRITE payload (stored or discarded) is not complete within this of its header:
    /// [`ServeError::PayloadTimeout`].
    pub(super) payload: Option<Duration>,
}

/// [`serve_frames`] under `timers`.
pub(super) async fn serve_frames_idle<R, W>(
    rd: R,
    wr: W,
    check: &dyn AccessCheck,
    connection: &ConnectionId,
    timers: StreamTimers,
) -> Result<(), ServeError>
where
    R: ScatterRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut rd = FrameReader::new(rd);
    // Responses are coalesced, and flushed before any read that could wait for the initiator:
    // the initiator writes whole frames, so bytes already buffered never wait on our answers.
    // An initiator that stops reading its answers fails the stream after `stall` without
    // progress (a write, not only a read, can wait on the peer).
    let mut wr = FrameWriter::new(StallGuard::new(wr, timers.stall));
    let served = serve_loop(&mut rd, &mut wr, check, connection, timers.idle, timers.payload).await;
    // However the stream ends (a bad frame, a payload cut short, a revocation, the idle timer),
    // the answers to the frames served before it are still delivered: a READ answered in full
    // must not reach the initiator cut short because a later frame was refused. When the loop
    // failed, its error is the one returned (and a stalled reader gets no second wait).
    let stalled = matches!(&served, Err(ServeError::Io(e)) if is_stall(e));
    let flushed = if stalled { Ok(()) } else { wr.flush().await.map_err(ServeError::from) };
    served.and(flushed).map_err(|e| match e {
        ServeError::Io(e) if is_stall(&e) => ServeError::Stalled,
        ServeError::Io(e) if is_answer_revoked(&e) => ServeError::Revoked,
        e => e,
    })
}

/// The frame loop of [`serve_frames_idle`]; its caller flushes `wr` however this returns.
async fn serve_loop<R, W>(
    rd: &mut FrameReader<R>,
    wr: &mut FrameWriter<StallGuard<W>>,
    check: &dyn AccessCheck,
    connection: &ConnectionId,
    idle: Option<Duration>,
    payload: Option<Duration>,
) -> Result<(), ServeError>
where
    R: ScatterRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // Whether this stream has refused a WRITE or READ. On an RC QP a refused work request puts
    // the QP in error and nothing behind it executes; this stream serves on (it stays in sync),
    // but a notification marker behind a refused request must not count: the initiator pipelines
    // its markers right behind its data, so the marker of a batch whose WRITE was just NAKed (a
    // poisoned region, a range past the grant) is already on the wire. Initiators never reuse a
    // stream after a NAK (the QP breaks), so this costs an honest peer nothing.
    let mut refused = false;
    let mut cache = GrantCache::default();
    loop {
        // WRITEs and READs that arrived whole are served first, without waiting (see `whole`).
        serve_whole_frames(rd, wr, check, connection, &mut cache, &mut refused)?;
        // The stream forgets its grant before anything that may wait: a read (no whole header
        // left: a stream that goes quiet or trickles a header), and the general loop's writes (a
        // peer that does not read its answers), so a waiting stream keeps no region mapped.
        cache.clear();
        if rd.buffered() == 0 {
            // The answers leave before the stream waits for the initiator.
            wr.flush().await?;
        }
        let mut hb = [0u8; HEADER_LEN];
        // A header already received cannot wait: no timer for it (one per frame otherwise).
        let read = match idle {
            Some(idle) if rd.buffered() < HEADER_LEN => match tokio::time::timeout(idle, rd.read_exact(&mut hb)).await {
                Ok(r) => r,
                Err(_) => return Err(ServeError::Idle),
            },
            _ => rd.read_exact(&mut hb).await,
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
                // A payload already received in full cannot wait on the network: it is stored
                // without the deadline and revocation watch (each chunk still lands only under
                // the live gate, so a revocation still cuts it).
                let buffered = rd.buffered() >= h.len as usize;
                let deadline = match buffered {
                    true => None,
                    false => payload.map(|p| tokio::time::Instant::from_std(xfer_common::deadline::instant_after(p))),
                };
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
                        let stored = match buffered {
                            true => store_payload(rd, &t, h.len as usize).await?,
                            false => within(deadline, Some(&t.gate), store_payload(rd, &t, h.len as usize)).await?,
                        };
                        // The answer's write may wait on the peer: no grant is kept through it.
                        drop(t);
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
                match check.check(connection, &h.token, h.addr, h.len as u64, RemoteOp::Read).map(|t| (t.memory, t.offset, t.gate)) {
                    Ok((mem, off, _)) if mem.can_shrink() => {
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
                    Ok((mem, off, gate)) => {
                        // Queued behind its header and sent with the frames around it in one
                        // gathered write, the payload straight from region memory; not at all
                        // (the stream closes) if the grant is revoked before that write starts.
                        resp.len = h.len;
                        wr.answer(&resp.encode(), &mem, off, h.len as usize, &gate).await?;
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
                // The READ answers queued ahead of the marker leave first: one whose grant is
                // revoked before it starts is cut and closes the stream as revoked, and the
                // marker behind it does not count (as behind a refused READ).
                wr.flush().await?;
                // Every earlier frame of this stream has been served and accepted (its bytes are
                // in region memory, its answer sent): the marker may count.
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

/// Runs a payload read until `deadline` ([`ServeError::PayloadTimeout`]) or until `gate` (if
/// any) is revoked ([`ServeError::Revoked`]), whichever comes first.
async fn within<T>(
    deadline: Option<tokio::time::Instant>,
    gate: Option<&GrantGate>,
    read: impl std::future::Future<Output = Result<T, ServeError>>,
) -> Result<T, ServeError> {
    let revoked = async {
        match gate {
            Some(l) => l.revoked().await,
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
/// copied into region memory only while the grant's gate is held live (see [`GrantGate`]).
/// `Ok(false)`: every byte was read but some did not land (a shrunk file: NAK, the stream stays in
/// sync). [`ServeError::Revoked`] once the gate is revoked or expired mid-payload.
async fn store_payload<R: ScatterRead + Unpin>(rd: &mut FrameReader<R>, t: &Checked, len: usize) -> Result<bool, ServeError> {
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
            let Some(_live) = t.gate.hold() else { return Err(ServeError::Revoked) };
            landed &= mem.write_at(t.offset + done as u64, &buf[..n]).is_ok();
            done += n;
        }
        return Ok(landed);
    }
    // Straight from the socket into region memory when nothing is buffered, else landed from the
    // read buffer (streaming stores into a large region). Each copy into the region happens
    // inside one poll, under the gate.
    let mut done = 0usize;
    while done < len {
        let want = (len - done).min(PAYLOAD_CHUNK);
        let n = std::future::poll_fn(|cx| {
            let Some(live) = t.gate.hold() else { return std::task::Poll::Ready(Err(ServeError::Revoked)) };
            let r = rd.poll_read_region(cx, mem, t.offset + done as u64, Part { done, len: want, total: len });
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
