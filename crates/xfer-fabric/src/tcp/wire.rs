//! A data stream's two directions as the frame loops use them, with as few system calls and
//! copies per frame as the stream allows.
//!
//! * [`FrameWriter`] stages headers and small payloads (many frames leave in one write) and sends
//!   a large payload straight from region memory *behind* the staged bytes in one vectored write:
//!   the header no longer leaves alone as a 44-byte segment ahead of its payload.
//! * [`FrameReader`] buffers small frames (one read takes many of them) and reads a large payload
//!   straight into region memory. After a payload that went straight in, the next header is read
//!   on its own, so the payload behind it goes straight in too instead of through the buffer.
//! * [`tls_socket`]: the socket under a TLS stream, read through a buffer. rustls asks its socket
//!   for at most 4 KiB a read, a system call per quarter record; the buffer takes what the
//!   socket holds in one call and hands it over in those pieces.
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, BufReader, ReadBuf};
use tokio::net::TcpStream;
use xfer_rdma::memory::RegionMemory;

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

/// The sending half of a stream; see the module docs. Its `AsyncWrite` stages what it is given
/// (a write at least [`STAGE`] long goes straight out after the staged bytes).
pub(super) struct FrameWriter<W> {
    inner: W,
    staged: Vec<u8>,
    /// Bytes of `staged` already written.
    sent: usize,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    pub(super) fn new(inner: W) -> Self {
        FrameWriter { inner, staged: Vec::with_capacity(STAGE), sent: 0 }
    }

    /// Whether `len` more bytes fit the staging buffer.
    pub(super) fn fits(&self, len: usize) -> bool {
        self.staged.len() + len <= STAGE
    }

    /// Writes the staged bytes out (not flushing `inner`).
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.staged.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.staged[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.staged.clear();
        self.sent = 0;
        Poll::Ready(Ok(()))
    }

    /// Sends the staged bytes and then `offset..offset + len` of `mem`, straight from region
    /// memory, in vectored writes (one, unless the socket takes less).
    pub(super) async fn send_region(&mut self, mem: &RegionMemory, offset: u64, len: usize) -> io::Result<()> {
        let mut done = 0usize;
        while self.sent < self.staged.len() || done < len {
            let at = offset + done as u64;
            let n = std::future::poll_fn(|cx| {
                let inner = Pin::new(&mut self.inner);
                if self.sent < self.staged.len() {
                    mem.poll_write_vectored_from(inner, cx, &self.staged[self.sent..], at, len - done)
                } else {
                    mem.poll_write_from(inner, cx, at, len - done)
                }
            })
            .await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            let head = n.min(self.staged.len() - self.sent);
            self.sent += head;
            done += n - head;
        }
        self.staged.clear();
        self.sent = 0;
        Ok(())
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for FrameWriter<W> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if !this.fits(buf.len()) {
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
            let limit = if this.direct { want } else { this.buf.len() };
            let mut rb = ReadBuf::new(&mut this.buf[..limit]);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            (this.pos, this.filled) = (0, n);
            if n == 0 {
                // End of stream: nothing is put into `out`.
                return Poll::Ready(Ok(()));
            }
            if n == limit {
                this.direct = false;
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
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Frames of every size, read back byte for byte through the reader's three paths
    /// (buffered, straight in, and a header read on its own after a straight-in payload).
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
            w.write_all(&[9u8; 44]).await.expect("header");
            w.send_region(&mem, 0, 1 << 20).await.expect("region");
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
}
