//! A data stream's two directions as the frame loops use them, with as few system calls and
//! copies per frame as the stream allows.
//!
//! * [`FrameWriter`] (the target's answers) stages small frames and queues READ answers, whose
//!   payloads leave straight from region memory between the staged bytes: every answer queued
//!   while requests were already buffered goes out in one gathered write. A queued answer's grant
//!   is checked again just before the write that would start it.
//! * [`FrameReader`] buffers small frames (one read takes many of them) and reads a large payload,
//!   or the rest of one begun in the buffer, straight into region memory. The end of a payload
//!   and what follows it arrive in one scattered read (a plain socket's `readv`; a read per
//!   buffer on other streams): the next header alone behind a large payload, so the payload
//!   behind it goes straight in too, as much as the buffer holds behind a small one.
//! * [`tls_socket`]: the socket under a TLS stream, read through a buffer. rustls asks its socket
//!   for at most 4 KiB a read, a system call per quarter record; the buffer takes what the
//!   socket holds in one call and hands it over in those pieces.
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, BufReader, ReadBuf};
use tokio::net::TcpStream;
use xfer_rdma::gather::{poll_write_gathered, Piece};
use xfer_rdma::memory::RegionMemory;
use xfer_rdma::scatter::ScatterRead;

use crate::frame::HEADER_LEN;
use crate::grant::GrantGate;

/// Bytes a stream stages or buffers: small frames are coalesced up to this.
pub(super) const STAGE: usize = 64 << 10;
/// A read at least this long with nothing buffered goes straight to its destination.
const DIRECT: usize = 16 << 10;

/// Bytes one read of a TLS stream's socket may take (four records and their overhead).
const TLS_SOCKET_READ: usize = 64 << 10;

/// The socket a TLS data stream runs over (see the module docs). Writes pass straight through.
pub(super) fn tls_socket(stream: TcpStream) -> BufReader<TcpStream> {
    BufReader::with_capacity(TLS_SOCKET_READ, stream)
}

/// Most READ answers one gathered write carries (each a header and a payload slice, within the
/// kernel's limit of slices per `writev`).
const MAX_ANSWERS: usize = xfer_rdma::gather::MAX_SLICES / 2 - 1;
/// Payload bytes of queued READ answers past which they are written before the next is queued.
const ANSWER_BYTES: usize = 2 << 20;

/// A READ answer queued behind its header: its payload leaves straight from region memory in the
/// next gathered write, unless its grant was revoked before that write started.
struct Answer {
    /// `staged[..at]` goes before the payload; its header is the last `head` bytes of that.
    at: usize,
    head: usize,
    /// Its memory and gate: an index into [`FrameWriter`]'s grants.
    grant: usize,
    offset: u64,
    len: usize,
}

/// A queued READ answer's grant was revoked (or expired) before its bytes started to leave: the
/// frames before it were sent, and the stream must close (see [`FrameWriter::answer`]).
#[derive(Debug, thiserror::Error)]
#[error("the grant of a queued READ answer was revoked before it was sent")]
pub(super) struct AnswerRevoked;

/// The sending half of a stream; see the module docs. Its `AsyncWrite` stages what it is given
/// (a write at least [`STAGE`] long goes straight out after everything queued).
pub(super) struct FrameWriter<W> {
    inner: W,
    staged: Vec<u8>,
    answers: Vec<Answer>,
    /// The memory and gate of the queued answers, one entry per run of answers under one grant:
    /// a reference count taken per run, not per answer (each an atomic the connection's other
    /// streams contend for).
    grants: Vec<(Arc<RegionMemory>, Arc<GrantGate>)>,
    /// Payload bytes of `answers`.
    queued: usize,
    /// Bytes of the queued sequence (staged bytes with the answers' payloads between them)
    /// already written.
    sent: usize,
    /// That check cut the queue at a revoked answer: the drain fails once the rest is out.
    revoked: bool,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    pub(super) fn new(inner: W) -> Self {
        FrameWriter {
            inner,
            staged: Vec::with_capacity(STAGE),
            answers: Vec::new(),
            grants: Vec::new(),
            queued: 0,
            sent: 0,
            revoked: false,
        }
    }

    /// Queues a READ answer: `head` (its header), then `offset..offset + len` of `mem` straight
    /// from region memory, in the next gathered write with the frames around it (written first if
    /// the queue is full). If `gate` is no longer live when that write starts, neither this
    /// answer nor anything queued after it is sent, and the drain fails with [`AnswerRevoked`]:
    /// no READ answer starts after its grant's revocation returned.
    pub(super) async fn answer(
        &mut self,
        head: &[u8],
        mem: &Arc<RegionMemory>,
        offset: u64,
        len: usize,
        gate: &Arc<GrantGate>,
    ) -> io::Result<()> {
        if !self.has_answer_room() {
            std::future::poll_fn(|cx| self.poll_drain(cx)).await?;
        }
        self.queue_answer(head, mem, offset, len, gate)
    }

    /// Whether an answer can be queued without writing the queue first.
    pub(super) fn has_answer_room(&self) -> bool {
        self.answers.len() < MAX_ANSWERS && self.queued < ANSWER_BYTES
    }

    /// [`FrameWriter::answer`] without the write: the caller checked
    /// [`FrameWriter::has_answer_room`] (past the limits the answer is still queued, and the
    /// drain's gathered write takes more than one call).
    pub(super) fn queue_answer(
        &mut self,
        head: &[u8],
        mem: &Arc<RegionMemory>,
        offset: u64,
        len: usize,
        gate: &Arc<GrantGate>,
    ) -> io::Result<()> {
        mem.check(offset, len as u64).map_err(io::Error::other)?;
        let grant = match self.grants.last() {
            Some((m, g)) if Arc::ptr_eq(m, mem) && Arc::ptr_eq(g, gate) => self.grants.len() - 1,
            _ => {
                self.grants.push((mem.clone(), gate.clone()));
                self.grants.len() - 1
            }
        };
        self.staged.extend_from_slice(head);
        self.answers.push(Answer { at: self.staged.len(), head: head.len(), grant, offset, len });
        self.queued += len;
        Ok(())
    }

    /// Whether `n` more bytes can be staged without a write first.
    pub(super) fn has_room(&self, n: usize) -> bool {
        self.staged.len() + n <= STAGE
    }

    /// Stages `bytes` (a small answer) without writing; the caller checked
    /// [`FrameWriter::has_room`].
    pub(super) fn stage(&mut self, bytes: &[u8]) {
        self.staged.extend_from_slice(bytes);
    }

    /// Cuts the queue at the first answer none of whose bytes has left (its header included: a
    /// header that left promises its payload) whose grant is no longer live. Run before every
    /// write of the drain: a peer that reads slowly makes a drain many writes, and an answer
    /// queued behind one still leaving must not start after its revocation returned.
    fn check_gates(&mut self) {
        let mut payloads = 0usize;
        // Each grant's liveness, asked once per drain (a snapshot, as one check per answer was).
        let mut live: Vec<Option<bool>> = vec![None; self.grants.len()];
        for i in 0..self.answers.len() {
            let a = &self.answers[i];
            let header_at = a.at - a.head + payloads;
            payloads += a.len;
            if header_at < self.sent {
                continue;
            }
            let alive = *live[a.grant].get_or_insert_with(|| self.grants[a.grant].1.is_live());
            if !alive {
                self.staged.truncate(a.at - a.head);
                self.answers.truncate(i);
                self.queued = self.answers.iter().map(|a| a.len).sum();
                self.revoked = true;
                break;
            }
        }
    }

    /// Writes everything queued out (not flushing `inner`).
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            if !self.revoked {
                self.check_gates();
            }
            let mut pieces = Vec::with_capacity(self.answers.len() * 2 + 1);
            let mut from = 0usize;
            for a in &self.answers {
                pieces.push(Piece::Bytes(&self.staged[from..a.at]));
                pieces.push(Piece::Region(&self.grants[a.grant].0, a.offset, a.len));
                from = a.at;
            }
            pieces.push(Piece::Bytes(&self.staged[from..]));
            let total = self.staged.len() + self.queued;
            if self.sent >= total {
                break;
            }
            let n = ready!(poll_write_gathered(Pin::new(&mut self.inner), cx, &pieces, self.sent))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.staged.clear();
        self.answers.clear();
        self.grants.clear();
        (self.queued, self.sent) = (0, 0);
        if std::mem::take(&mut self.revoked) {
            return Poll::Ready(Err(io::Error::other(AnswerRevoked)));
        }
        Poll::Ready(Ok(()))
    }
}

/// Whether a write failed because a queued READ answer's grant was revoked ([`AnswerRevoked`]).
pub(super) fn is_answer_revoked(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<AnswerRevoked>())
}

impl<W: AsyncWrite + Unpin> AsyncWrite for FrameWriter<W> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.staged.len() + buf.len() > STAGE {
            ready!(this.poll_drain(cx))?;
        }
        if buf.len() >= STAGE {
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        }
        this.staged.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_drain(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

/// The receiving half of a stream; see the module docs.
pub(super) struct FrameReader<R> {
    inner: R,
    buf: Box<[u8]>,
    pos: usize,
    filled: usize,
    /// The last read went straight to its destination (a large payload): the next read that
    /// finds the buffer empty takes only what it asks for (the next header).
    direct: bool,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub(super) fn new(inner: R) -> Self {
        FrameReader { inner, buf: vec![0u8; STAGE].into_boxed_slice(), pos: 0, filled: 0, direct: false }
    }

    /// Bytes received and not yet read.
    pub(super) fn buffered(&self) -> usize {
        self.filled - self.pos
    }

    /// The next `n` bytes of the stream, if they are already buffered (nothing is consumed).
    pub(super) fn peek(&self, n: usize) -> Option<&[u8]> {
        (self.buffered() >= n).then(|| &self.buf[self.pos..self.pos + n])
    }

    /// Drops `n` buffered bytes (at most what is buffered).
    pub(super) fn consume(&mut self, n: usize) {
        self.pos += n.min(self.buffered());
    }

    /// Lands the next `len` buffered bytes in `offset..` of `mem` ([`RegionMemory::land`]) and
    /// consumes them; nothing is consumed if they are not all buffered or do not fit.
    pub(super) fn land_buffered(&mut self, mem: &RegionMemory, offset: u64, len: usize) -> io::Result<()> {
        let bytes = self.peek(len).ok_or(io::ErrorKind::UnexpectedEof)?;
        mem.land(offset, bytes).map_err(io::Error::other)?;
        self.pos += len;
        Ok(())
    }
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// One read into the empty buffer (after a payload that went straight in, at most `want`
    /// bytes: the next header alone, so the payload behind it can go straight in too). Returns
    /// how many bytes it holds now (0 at the end of the stream).
    pub(super) fn poll_fill(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<io::Result<usize>> {
        let limit = if self.direct { want.min(self.buf.len()) } else { self.buf.len() };
        let mut rb = ReadBuf::new(&mut self.buf[..limit]);
        ready!(Pin::new(&mut self.inner).poll_read(cx, &mut rb))?;
        let n = rb.filled().len();
        (self.pos, self.filled) = (0, n);
        if n == limit {
            self.direct = false;
        }
        Poll::Ready(Ok(n))
    }
}

/// Which bytes of a frame's payload a region read is for: `len` bytes starting `done` bytes into
/// a payload of `total`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Part {
    pub(super) done: usize,
    pub(super) len: usize,
    pub(super) total: usize,
}

impl<R: ScatterRead + Unpin> FrameReader<R> {
    /// Up to `part.len` bytes of the stream into `offset..` of `mem`. Bytes already buffered are
    /// landed from the buffer ([`RegionMemory::land`]: streaming stores into a large region).
    /// With nothing buffered, a long read, or the rest of a payload already begun, goes straight
    /// from the socket into the region; buffering it would copy it again. When those are the
    /// payload's last bytes, a socket that can scatter a read also fills the empty buffer in the
    /// same call ([`RegionMemory::poll_read_scatter`]): with the next header alone behind a large
    /// payload (the payload behind that header goes straight in too), with as much as it holds
    /// behind a small one (small frames come in runs). Returns how many bytes landed (0 at the
    /// end of the stream).
    pub(super) fn poll_read_region(
        &mut self,
        cx: &mut Context<'_>,
        mem: &RegionMemory,
        offset: u64,
        part: Part,
    ) -> Poll<io::Result<usize>> {
        let len = part.len;
        if len == 0 {
            return Poll::Ready(Ok(0));
        }
        if self.pos == self.filled {
            if len >= DIRECT || part.done > 0 {
                let large = part.total >= DIRECT;
                let tail = match (part.done + len == part.total, large) {
                    (false, _) => 0,
                    (true, true) => HEADER_LEN,
                    (true, false) => self.buf.len(),
                };
                let n = ready!(mem.poll_read_scatter(Pin::new(&mut self.inner), cx, offset, len, &mut self.buf[..tail]))?;
                let landed = n.min(len);
                (self.pos, self.filled) = (0, n - landed);
                // After a large payload, a next header that was not ready yet is read alone.
                self.direct = large;
                return Poll::Ready(Ok(landed));
            }
            if ready!(self.poll_fill(cx, len))? == 0 {
                return Poll::Ready(Ok(0));
            }
        }
        let n = (self.filled - self.pos).min(len);
        mem.land(offset, &self.buf[self.pos..self.pos + n]).map_err(io::Error::other)?;
        self.pos += n;
        Poll::Ready(Ok(n))
    }

    /// Exactly `len` bytes of the stream, a whole payload, into `offset..` of `mem` (see
    /// [`FrameReader::poll_read_region`]); `UnexpectedEof` if the stream ends first.
    pub(super) async fn read_exact_region(&mut self, mem: &RegionMemory, offset: u64, len: usize) -> io::Result<()> {
        let mut done = 0usize;
        while done < len {
            let part = Part { done, len: len - done, total: len };
            let n = std::future::poll_fn(|cx| self.poll_read_region(cx, mem, offset + done as u64, part)).await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            done += n;
        }
        Ok(())
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for FrameReader<R> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let want = out.remaining();
        if want == 0 {
            return Poll::Ready(Ok(()));
        }
        if this.pos == this.filled {
            if want >= DIRECT {
                this.direct = true;
                return Pin::new(&mut this.inner).poll_read(cx, out);
            }
            if ready!(this.poll_fill(cx, want))? == 0 {
                // End of stream: nothing is put into `out`.
                return Poll::Ready(Ok(()));
            }
        }
        let n = (this.filled - this.pos).min(want);
        out.put_slice(&this.buf[this.pos..this.pos + n]);
        this.pos += n;
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use std::io::IoSliceMut;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// An in-memory stream that scatters a read over its buffers as a socket's `readv` does, at
    /// most `chunk` bytes a call (a socket returns what has arrived), counting its calls.
    struct Scattering {
        data: Vec<u8>,
        at: usize,
        chunk: usize,
        calls: usize,
    }

    impl Scattering {
        fn take(&mut self, bufs: &mut [IoSliceMut<'_>]) -> usize {
            self.calls += 1;
            let mut budget = self.chunk.min(self.data.len() - self.at);
            let mut n = 0;
            for b in bufs.iter_mut() {
                let k = b.len().min(budget);
                b[..k].copy_from_slice(&self.data[self.at..self.at + k]);
                (self.at, budget, n) = (self.at + k, budget - k, n + k);
            }
            n
        }
    }

    impl AsyncRead for Scattering {
        fn poll_read(self: Pin<&mut Self>, _: &mut Context<'_>, out: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
            let n = self.get_mut().take(&mut [IoSliceMut::new(out.initialize_unfilled())]);
            out.advance(n);
            Poll::Ready(Ok(()))
        }
    }

    impl ScatterRead for Scattering {
        fn poll_read_scatter(self: Pin<&mut Self>, _: &mut Context<'_>, bufs: &mut [IoSliceMut<'_>]) -> Poll<io::Result<usize>> {
            Poll::Ready(Ok(self.get_mut().take(bufs)))
        }
    }

    /// Over a stream that scatters: every payload lands whole and in place and every header
    /// reads back as sent, whatever each read returns; with everything arrived, a run of large
    /// frames costs one read per frame (its payload straight in, the next header behind it), and
    /// a run of small frames fewer reads than frames.
    #[tokio::test]
    async fn a_scattering_stream_reads_a_large_frame_and_the_next_header_in_one_call() {
        let sizes: Vec<usize> = [vec![64 << 10; 8], vec![4096; 20], vec![1 << 20, 44, 16 << 10, 100]].concat();
        let mut data = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            data.extend_from_slice(&[i as u8; HEADER_LEN]);
            data.extend((0..n).map(|k| (k * 31 + i) as u8));
        }
        for chunk in [usize::MAX, 3000, 70_000] {
            let mut r = FrameReader::new(Scattering { data: data.clone(), at: 0, chunk, calls: 0 });
            let mem = RegionMemory::anonymous(4 << 20, false).expect("mapping");
            let (mut offset, mut per_frame) = (0u64, Vec::new());
            for (i, &n) in sizes.iter().enumerate() {
                let before = r.inner.calls;
                let mut head = [0u8; HEADER_LEN];
                r.read_exact(&mut head).await.expect("header");
                assert_eq!(head, [i as u8; HEADER_LEN], "frame {i}'s header (chunk {chunk})");
                r.read_exact_region(&mem, offset, n).await.expect("payload");
                let mut got = vec![0u8; n];
                mem.read_at(offset, &mut got).expect("read back");
                assert!(got.iter().enumerate().all(|(k, &b)| b == (k * 31 + i) as u8), "frame {i}'s payload (chunk {chunk})");
                offset += n as u64;
                per_frame.push(r.inner.calls - before);
            }
            assert_eq!(r.read(&mut [0u8; 1]).await.expect("end"), 0);
            if chunk == usize::MAX {
                assert_eq!(per_frame[1..8], [1; 7], "one read per large frame after the first");
                let small: usize = per_frame[8..28].iter().sum();
                assert!(small <= 4, "20 frames of 4 KiB took {small} reads");
            }
        }
    }

    /// Frames of every size, read back byte for byte through the reader's paths (buffered,
    /// straight in, and the header behind a straight-in payload).
    #[tokio::test]
    async fn frames_of_every_size_arrive_whole_and_in_order() {
        let sizes = [44usize, 4096, 44, 70_000, 44, 16 << 10, 44, 300, 1 << 20, 44, 44];
        let mut sent = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            sent.extend((0..n).map(|k| (k + i) as u8));
        }
        let (ours, theirs) = tokio::io::duplex(8192);
        let mem = RegionMemory::anonymous(1 << 20, false).expect("mapping");
        let pattern: Vec<u8> = (0..(1usize << 20)).map(|k| (k * 7) as u8).collect();
        mem.write_at(0, &pattern).expect("fill");
        let expected = {
            let mut e = sent.clone();
            e.extend_from_slice(&[9u8; 44]);
            e.extend_from_slice(&pattern);
            e
        };
        let writer = tokio::spawn(async move {
            let mut w = FrameWriter::new(ours);
            w.write_all(&sent).await.expect("stage");
            let gate = GrantGate::new(std::time::SystemTime::now() + std::time::Duration::from_secs(3600));
            w.answer(&[9u8; 44], &Arc::new(mem), 0, 1 << 20, &gate).await.expect("answer");
            w.shutdown().await.expect("end");
        });
        let mut r = FrameReader::new(theirs);
        let mut got = Vec::new();
        for &n in sizes.iter().chain([44usize, 1 << 20].iter()) {
            let mut b = vec![0u8; n];
            r.read_exact(&mut b).await.expect("frame");
            got.extend_from_slice(&b);
        }
        assert_eq!(r.read(&mut [0u8; 1]).await.expect("end"), 0);
        assert_eq!(got, expected);
        writer.await.expect("writer");
    }

    /// Answers queued behind small frames, the second one's grant revoked before the drain: the
    /// frames and the answer before it leave whole, its header and everything queued after it
    /// never do, and the drain fails with `AnswerRevoked` (the stream closes).
    #[tokio::test]
    async fn an_answer_revoked_before_it_leaves_is_not_sent_nor_anything_behind_it() {
        let mem = Arc::new(RegionMemory::anonymous(1 << 16, false).expect("mapping"));
        mem.write_at(0, &[7u8; 1 << 16]).expect("fill");
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(3600);
        let (live, doomed) = (GrantGate::new(later), GrantGate::new(later));
        let (ours, mut theirs) = tokio::io::duplex(1 << 20);
        let mut w = FrameWriter::new(ours);
        w.write_all(b"ack-1").await.expect("stage");
        w.answer(b"head-1", &mem, 0, 5000, &live).await.expect("queue");
        w.write_all(b"ack-2").await.expect("stage");
        w.answer(b"head-2", &mem, 0, 1 << 16, &doomed).await.expect("queue");
        w.write_all(b"ack-3").await.expect("stage");
        w.answer(b"head-3", &mem, 0, 100, &live).await.expect("queue");
        doomed.revoke();
        let err = w.flush().await.expect_err("the revoked answer fails the drain");
        assert!(is_answer_revoked(&err), "{err}");
        drop(w);
        let mut got = Vec::new();
        theirs.read_to_end(&mut got).await.expect("read");
        let mut expected = b"ack-1head-1".to_vec();
        expected.extend_from_slice(&[7u8; 5000]);
        expected.extend_from_slice(b"ack-2");
        assert_eq!(got, expected);
    }
}
