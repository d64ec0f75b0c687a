//! Scattered receives: one read of a socket into the end of a payload in region memory *and* a
//! small buffer behind it (`readv`), so the next frame's header arrives in the same system call
//! as the payload before it, and the payload still goes straight into the region.
//!
//! Why: a stream of large frames read as "header, then payload straight in" costs two system
//! calls per frame, the first for 44 bytes; reading the header together with the payload's
//! buffered tail would put the next payload's first bytes in the buffer too, to be copied again.
//! The caller knows how many bytes its payload still has, so the split costs nothing.
//!
//! The same contract as [`crate::memory`]'s zero-copy socket operations: the slice over region
//! memory exists only inside one read call. Readers without `readv` (TLS in user space,
//! in-memory streams) do the same a read per buffer, so every reader takes the same paths.
use std::io::{self, IoSliceMut};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;

use crate::memory::RegionMemory;

/// A reader that may scatter one read over several buffers, in order.
pub trait ScatterRead: AsyncRead {
    /// Reads into `bufs` in order: as a socket's `readv` does, what is ready now, each buffer
    /// filled before the next. The default does it a `poll_read` per buffer, going on to the next
    /// only while each fills whole and the reader has more ready (TLS streams in user space,
    /// in-memory streams); a plain socket does it in one system call. Returns how many bytes were
    /// read (0 at the end of the stream, or if every buffer is empty).
    fn poll_read_scatter(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &mut [IoSliceMut<'_>]) -> Poll<io::Result<usize>> {
        let mut total = 0usize;
        for b in bufs.iter_mut().filter(|b| !b.is_empty()) {
            let want = b.len();
            let mut rb = ReadBuf::new(b);
            match self.as_mut().poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) => {}
                // A failed stream fails the call, even after bytes: nothing after it is trusted.
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                // Nothing more is ready: the bytes so far are the call's (a waker registered
                // here at most wakes the reader once more than needed).
                Poll::Pending if total > 0 => break,
                Poll::Pending => return Poll::Pending,
            }
            let n = rb.filled().len();
            total += n;
            if n < want {
                break;
            }
        }
        Poll::Ready(Ok(total))
    }
}

/// A plain TCP socket's read half: one `readv` per call.
impl ScatterRead for OwnedReadHalf {
    fn poll_read_scatter(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &mut [IoSliceMut<'_>]) -> Poll<io::Result<usize>> {
        let half: &OwnedReadHalf = self.get_mut();
        let socket: &TcpStream = half.as_ref();
        loop {
            ready!(socket.poll_read_ready(cx))?;
            // A spurious readiness (`WouldBlock`) clears it: the next poll waits for the socket.
            match socket.try_read_vectored(bufs) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return Poll::Ready(r),
            }
        }
    }
}

impl<T: ScatterRead + Unpin + ?Sized> ScatterRead for Box<T> {
    fn poll_read_scatter(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &mut [IoSliceMut<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut **self.get_mut()).poll_read_scatter(cx, bufs)
    }
}

/// Streams whose scattered reads are a read per buffer: halves of a TLS stream in user space,
/// in-memory pipes.
impl<T: AsyncRead> ScatterRead for tokio::io::ReadHalf<T> {}
impl ScatterRead for tokio::io::DuplexStream {}

/// Any reader, its scattered reads a read per buffer (the default [`ScatterRead`]).
#[derive(Debug)]
pub struct Stepwise<R>(pub R);

impl<R: AsyncRead + Unpin> AsyncRead for Stepwise<R> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl<R: AsyncRead + Unpin> ScatterRead for Stepwise<R> {}

impl RegionMemory {
    /// Zero-copy receive with a tail: one read of `rd` into `offset..offset + len` of the mapping
    /// and then into `tail`, scattered in one call where `rd` can. Returns how many bytes were
    /// read in all: the first `min(n, len)` landed in the region, the rest (only once the region
    /// range is full) in `tail`. Bounds and writability are checked first. The only place region
    /// memory is seen as `&mut [u8]` outside `memory` is inside `rd`'s read, for that call. Call
    /// [`RegionMemory::intact`] before trusting or acknowledging the bytes; memory that
    /// [`can_shrink`](RegionMemory::can_shrink) should be filled through
    /// [`RegionMemory::write_at`] instead, so a fault is taken by the agent and not turned into
    /// EFAULT by a system call.
    pub fn poll_read_scatter<R: ScatterRead + ?Sized>(
        &self,
        rd: Pin<&mut R>,
        cx: &mut Context<'_>,
        offset: u64,
        len: usize,
        tail: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        // SAFETY: the slice exists only for the duration of one `poll_read_scatter` (the
        // `IoSliceMut` borrow cannot escape it); `tail` is the caller's own buffer, never region
        // memory, so the two do not overlap. Other writers of the same bytes (peers, the NIC,
        // other processes) give torn bytes, as the memory module's contract states; the agent
        // never reads bytes it is receiving until the frame is complete.
        let region = match unsafe { self.transient_slice_mut(offset, len) } {
            Ok(r) => r,
            Err(e) => return Poll::Ready(Err(io::Error::other(e))),
        };
        let mut bufs = [IoSliceMut::new(region), IoSliceMut::new(tail)];
        rd.poll_read_scatter(cx, &mut bufs)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;

    /// Over a real socket: the end of a payload lands in the region and the bytes behind it in
    /// the tail, in one call; a range outside the mapping or read-only memory is refused before
    /// anything is read (the bytes stay in the socket for the next read).
    #[tokio::test]
    async fn a_socket_read_fills_the_region_then_the_tail() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let mut client = TcpStream::connect(listener.local_addr().expect("address")).await.expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        let (mut rd, _wr) = server.into_split();
        let sent: Vec<u8> = (0..5000u32).map(|i| (i * 13) as u8).collect();
        client.write_all(&sent).await.expect("send");
        let mem = RegionMemory::anonymous(1 << 16, false).expect("mapping");
        let mut tail = [0u8; 44];
        let refused = std::future::poll_fn(|cx| mem.poll_read_scatter(Pin::new(&mut rd), cx, (1 << 16) - 100, 101, &mut tail)).await;
        assert!(refused.is_err(), "a range past the mapping is refused");
        let file = tempfile::tempfile().expect("file");
        file.set_len(4096).expect("length");
        let read_only = RegionMemory::map_file(&file, 4096, false).expect("mapping");
        assert!(std::future::poll_fn(|cx| read_only.poll_read_scatter(Pin::new(&mut rd), cx, 0, 100, &mut tail)).await.is_err());
        // Reads until the range is full and some bytes went to the tail (a read returns what has
        // arrived, which may end inside the range).
        let (mut landed, mut in_tail) = (0usize, 0usize);
        while in_tail == 0 {
            let n = std::future::poll_fn(|cx| mem.poll_read_scatter(Pin::new(&mut rd), cx, 100 + landed as u64, 4000 - landed, &mut tail))
                .await
                .expect("read");
            assert!(n > 0, "the stream ended early");
            let into_range = n.min(4000 - landed);
            (landed, in_tail) = (landed + into_range, n - into_range);
        }
        let mut region = vec![0u8; 4000];
        mem.read_at(100, &mut region).expect("read back");
        assert_eq!(region, sent[..4000], "the payload landed in the region");
        assert_eq!(tail[..in_tail], sent[4000..4000 + in_tail], "the next bytes landed in the tail");
        let mut untouched = vec![1u8; 100];
        mem.read_at(0, &mut untouched).expect("read back");
        assert_eq!(untouched, vec![0u8; 100], "nothing landed before the range");
    }

    /// A reader without `readv` fills the region range, then the tail from what it has ready;
    /// a tail it has nothing ready for ends the call with the region's bytes, and a stream that
    /// fails fails the call.
    #[tokio::test]
    async fn a_stepwise_reader_fills_the_region_then_the_tail_from_what_is_ready() {
        let sent: Vec<u8> = (0..200u32).map(|i| i as u8).collect();
        let mem = RegionMemory::anonymous(4096, false).expect("mapping");
        let mut rd = Stepwise(&sent[..]);
        let mut tail = [7u8; 44];
        let n = std::future::poll_fn(|cx| mem.poll_read_scatter(Pin::new(&mut rd), cx, 0, 150, &mut tail)).await.expect("read");
        assert_eq!(n, 194);
        assert_eq!(tail, sent[150..194]);
        let mut region = vec![0u8; 150];
        mem.read_at(0, &mut region).expect("read back");
        assert_eq!(region, sent[..150]);

        // Only the region's bytes have arrived: the call returns them.
        let (mut ours, theirs) = tokio::io::duplex(1024);
        ours.write_all(&sent[..100]).await.expect("send");
        let mut rd = Stepwise(theirs);
        let mut tail = [7u8; 44];
        let n = std::future::poll_fn(|cx| mem.poll_read_scatter(Pin::new(&mut rd), cx, 1000, 100, &mut tail)).await.expect("read");
        assert_eq!((n, tail), (100, [7u8; 44]));

        // A stream that fails after the region's bytes fails the call.
        let mut failing = Stepwise(tokio_test_failing(&sent[..100]));
        let r = std::future::poll_fn(|cx| mem.poll_read_scatter(Pin::new(&mut failing), cx, 2000, 100, &mut tail)).await;
        assert!(r.is_err(), "{r:?}");
    }

    /// `bytes`, then an error.
    fn tokio_test_failing(bytes: &[u8]) -> impl AsyncRead + Unpin + '_ {
        tokio::io::AsyncReadExt::chain(bytes, Failing)
    }

    struct Failing;

    impl AsyncRead for Failing {
        fn poll_read(self: Pin<&mut Self>, _: &mut Context<'_>, _: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Err(io::Error::other("reset")))
        }
    }
}
