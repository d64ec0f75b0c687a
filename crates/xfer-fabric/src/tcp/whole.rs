//! The target's fast path for WRITE frames that arrived whole: the run of them already in the
//! read buffer is served without waiting and without asking the grant table for each frame.
//!
//! Why: a KV-cache batch is thousands of small WRITEs under one grant, and the general frame loop
//! paid per frame for a table lookup (its lock, reference counts on the grant, its memory and its
//! gate) and for a hold of the gate, every one of them an atomic on a line the other streams of
//! the connection write too. Here a stream checks a frame against the grant it checked last for
//! the same token ([`Checked::again`]: the grant's operation and range, the memory's bounds) and
//! lands a run of frames under one hold of the gate, at most [`PAYLOAD_CHUNK`] bytes of copies,
//! as the general loop lands one chunk of a large payload. So every promise stays: each frame is
//! checked, and a revocation waits for at most one such run of copies of bytes already received,
//! after which no byte lands under the grant.
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

    /// The memory offset of `len` bytes at `addr` under the grant last checked for `token`, if
    /// that check stands for them.
    fn again(&self, token: &[u8; 16], addr: u64, len: u64) -> Option<u64> {
        match &self.last {
            Some((t, c)) if t == token => c.again(addr, len, RemoteOp::Write),
            _ => None,
        }
    }
}

/// Serves the WRITE frames at the head of `rd`'s buffer whose payloads arrived whole, until the
/// next frame is not one, or lands in memory that can shrink (the general loop copies those
/// through a buffer), or the answers' stage is full (the general loop writes it out). A frame
/// refused is NAKed with its payload dropped, and sets `refused` (see the frame loop).
pub(super) fn serve_whole_writes<R, W>(
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
    while let Some(h) = whole_write(rd) {
        if !wr.has_room(HEADER_LEN) {
            return Ok(());
        }
        let len = u64::from(h.len);
        let offset = match cache.again(&h.token, h.addr, len) {
            Some(offset) => offset,
            None => match check.check(connection, &h.token, h.addr, len, RemoteOp::Write) {
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
        if !t.memory.writable() || t.memory.intact().is_err() {
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
        land(rd, wr, t, &h, offset)?;
        let mut landed = h.len as usize;
        // The frames right behind it under the same token, under the same hold.
        while landed < PAYLOAD_CHUNK {
            let Some(next) = whole_write(rd).filter(|n| n.token == h.token) else { break };
            let Some(offset) = t.again(next.addr, u64::from(next.len), RemoteOp::Write) else { break };
            if !wr.has_room(HEADER_LEN) {
                break;
            }
            land(rd, wr, t, &next, offset)?;
            landed += next.len as usize;
        }
        drop(live);
    }
    Ok(())
}

/// The next frame, if it is a WRITE whose header and payload are both buffered.
fn whole_write<R: AsyncRead + Unpin>(rd: &FrameReader<R>) -> Option<Header> {
    let head: &[u8; HEADER_LEN] = rd.peek(HEADER_LEN)?.try_into().ok()?;
    let h = Header::decode(head).ok()?;
    (h.kind == Kind::Write && rd.buffered() >= HEADER_LEN + h.len as usize).then_some(h)
}

/// Lands frame `h`'s payload at `offset` of `t`'s memory (the caller holds its gate) and stages
/// its ACK if it asked for one (the caller made room).
fn land<R, W>(rd: &mut FrameReader<R>, wr: &mut FrameWriter<W>, t: &Checked, h: &Header, offset: u64) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    rd.consume(HEADER_LEN);
    rd.land_buffered(&t.memory, offset, h.len as usize)?;
    if h.flags & ACK_REQUESTED != 0 {
        wr.stage(&Header::new(Kind::Ack, h.id).encode());
    }
    Ok(())
}

/// Drops frame `h` (header and payload) and stages its NAK (the caller made room).
fn refuse<R, W>(rd: &mut FrameReader<R>, wr: &mut FrameWriter<W>, h: &Header, status: WcStatus, refused: &mut bool)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    *refused = true;
    rd.consume(HEADER_LEN + h.len as usize);
    wr.stage(&Header::nak(h.id, status).encode());
}
