//! The target's fast path for frames that arrived whole (a WRITE with its payload, a READ
//! request): the run of them already in the read buffer is served without waiting and without
//! asking the grant table for each frame.
//!
//! Why: a KV-cache batch is thousands of small WRITEs (or READs) under one grant, and the general frame loop
//! paid per frame for a table lookup (its lock, reference counts on the grant, its memory and its
//! gate) and for a hold of the gate, every one of them an atomic on a line the other streams of
//! the connection write too. Here a stream checks a frame against the grant it checked last for
//! the same token ([`Checked::again`]: the grant's operation and range, the memory's bounds) and
//! lands a run of frames under one hold of the gate, at most [`PAYLOAD_CHUNK`] bytes of copies,
//! as the general loop lands one chunk of a large payload. So every promise stays: each frame is
//! checked, and a revocation waits for at most one such run of copies of bytes already received,
//! after which no byte lands under the grant. A READ is answered as the general loop answers it:
//! queued for the next gathered write, its grant checked again before that write starts.
use std::io;

use tokio::io::{AsyncRead, AsyncWrite};

use super::wire::{FrameReader, FrameWriter};
use crate::frame::{Header, Kind, ACK_REQUESTED, HEADER_LEN};
use crate::grant::{AccessCheck, Checked, PAYLOAD_CHUNK};
use crate::{RemoteOp, WcStatus};
use xfer_engine::ids::ConnectionId;

/// The grant a stream checked last, under its token: later frames under the same token are
/// checked against it. The frame loop clears it before any read that may wait, so a stream
/// that goes quiet does not keep a deleted region's memory mapped.
#[derive(Default)]
pub(super) struct GrantCache {
    last: Option<([u8; 16], Checked)>,
}

impl GrantCache {
    pub(super) fn clear(&mut self) {
        self.last = None;
    }

    /// Keeps `checked` as the grant last checked for `token`.
    pub(super) fn keep(&mut self, token: [u8; 16], checked: Checked) {
        self.last = Some((token, checked));
    }

    /// Whether the stream keeps a grant for `token`.
    #[cfg(test)]
    pub(super) fn holds(&self, token: &[u8; 16]) -> bool {
        self.last.as_ref().is_some_and(|(t, _)| t == token)
    }

    /// The memory offset of `len` bytes at `addr` for `op` under the grant last checked for
    /// `token`, if that check stands for them.
    fn again(&self, token: &[u8; 16], addr: u64, len: u64, op: RemoteOp) -> Option<u64> {
        match &self.last {
            Some((t, c)) if t == token => c.again(addr, len, op),
            _ => None,
        }
    }
}

/// Serves the frames at the head of `rd`'s buffer that arrived whole (WRITEs with their payloads,
/// READ requests), until the next frame is not one, or its grant's memory can shrink (the general
/// loop copies those through a buffer), or the answers' stage or queue is full (the general loop
/// writes them out). A frame refused is answered with its status (its payload dropped) and sets
/// `refused` (see the frame loop).
pub(super) fn serve_whole_frames<R, W>(
    rd: &mut FrameReader<R>,
    wr: &mut FrameWriter<W>,
    check: &dyn AccessCheck,
    connection: &ConnectionId,
    cache: &mut GrantCache,
    refused: &mut bool,
) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    while let Some((h, op)) = whole_frame(rd) {
        if !has_room(wr, op) {
            return Ok(());
        }
        let len = u64::from(h.len);
        let offset = match cache.again(&h.token, h.addr, len, op) {
            Some(offset) => offset,
            None => match check.check(connection, &h.token, h.addr, len, op) {
                Ok(t) => {
                    let offset = t.offset;
                    cache.keep(h.token, t);
                    offset
                }
                Err(status) => {
                    refuse(rd, wr, &h, status, refused);
                    continue;
                }
            },
        };
        let Some((_, t)) = &cache.last else { return Ok(()) };
        if t.memory.can_shrink() {
            return Ok(());
        }
        if op == RemoteOp::Write && (!t.memory.writable() || t.memory.intact().is_err()) {
            refuse(rd, wr, &h, WcStatus::RemAccessErr, refused);
            continue;
        }
        // Revoked or expired since it was checked: refused like a frame the table refuses, and
        // the stream forgets the grant.
        let Some(live) = t.gate.hold() else {
            cache.clear();
            refuse(rd, wr, &h, WcStatus::RemAccessErr, refused);
            continue;
        };
        serve(rd, wr, t, &h, offset)?;
        // The frames right behind it of the same kind under the same token, under the same hold:
        // WRITEs up to one chunk of copies, READs (queued, nothing copied) while there is room.
        let mut landed = if op == RemoteOp::Write { len } else { 0 };
        while landed < PAYLOAD_CHUNK as u64 {
            let Some((next, _)) = whole_frame(rd).filter(|(n, o)| n.token == h.token && *o == op) else { break };
            let Some(offset) = t.again(next.addr, u64::from(next.len), op) else { break };
            if !has_room(wr, op) {
                break;
            }
            serve(rd, wr, t, &next, offset)?;
            landed += if op == RemoteOp::Write { u64::from(next.len) } else { 0 };
        }
        drop(live);
    }
    Ok(())
}

/// The next frame, if it is a WRITE whose header and payload are both buffered or a READ
/// request whose header is, with the operation it asks for.
fn whole_frame<R: AsyncRead + Unpin>(rd: &FrameReader<R>) -> Option<(Header, RemoteOp)> {
    let head: &[u8; HEADER_LEN] = rd.peek(HEADER_LEN)?.try_into().ok()?;
    let h = Header::decode(head).ok()?;
    match h.kind {
        Kind::Write if rd.buffered() >= HEADER_LEN + h.len as usize => Some((h, RemoteOp::Write)),
        Kind::ReadReq => Some((h, RemoteOp::Read)),
        _ => None,
    }
}

/// Whether `wr` can take the answer to a frame for `op` without a write first.
fn has_room<W: AsyncWrite + Unpin>(wr: &FrameWriter<W>, op: RemoteOp) -> bool {
    wr.has_room(HEADER_LEN) && (op == RemoteOp::Write || wr.has_answer_room())
}

/// Serves frame `h` at `offset` of `t`'s memory (the caller holds its gate and made room): a
/// WRITE's payload lands and its ACK is staged if it asked for one; a READ's answer is queued,
/// its payload to leave straight from region memory.
fn serve<R, W>(rd: &mut FrameReader<R>, wr: &mut FrameWriter<W>, t: &Checked, h: &Header, offset: u64) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    rd.consume(HEADER_LEN);
    if h.kind == Kind::ReadReq {
        let mut resp = Header::new(Kind::ReadResp, h.id);
        resp.len = h.len;
        return wr.queue_answer(&resp.encode(), &t.memory, offset, h.len as usize, &t.gate);
    }
    rd.land_buffered(&t.memory, offset, h.len as usize)?;
    if h.flags & ACK_REQUESTED != 0 {
        wr.stage(&Header::new(Kind::Ack, h.id).encode());
    }
    Ok(())
}

/// Drops frame `h` (a WRITE's payload with it) and stages its refusal (the caller made room): a
/// NAK for a WRITE, a READ_RESP carrying the status for a READ, as the general loop answers.
fn refuse<R, W>(rd: &mut FrameReader<R>, wr: &mut FrameWriter<W>, h: &Header, status: WcStatus, refused: &mut bool)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    *refused = true;
    if h.kind == Kind::ReadReq {
        rd.consume(HEADER_LEN);
        let mut resp = Header::new(Kind::ReadResp, h.id);
        resp.status = status.code();
        wr.stage(&resp.encode());
    } else {
        rd.consume(HEADER_LEN + h.len as usize);
        wr.stage(&Header::nak(h.id, status).encode());
    }
}
