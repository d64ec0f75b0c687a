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
//! memory exists only inside one read call. Readers that cannot scatter (TLS in user space,
//! in-memory streams) read into the region only, as [`RegionMemory::poll_read_into`] does.
use std::io::{self, IoSliceMut};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;

use crate::memory::RegionMemory;

/// A reader that may scatter one read over several buffers, in order.
pub trait ScatterRead: AsyncRead {
    /// Reads into `bufs` in order, in one call where the reader can (a socket's `readv`). The
    /// default reads into the first non-empty buffer only (one `poll_read`). Returns how many
    /// bytes were read (0 at the end of the stream, or if every buffer is empty).
    fn poll_read_scatter(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &mut [IoSliceMut<'_>]) -> Poll<io::Result<usize>> {
        let Some(first) = bufs.iter_mut().find(|b| !b.is_empty()) else { return Poll::Ready(Ok(0)) };
        let mut rb = ReadBuf::new(first);
        ready!(self.poll_read(cx, &mut rb))?;
        Poll::Ready(Ok(rb.filled().len()))
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

/// Streams that read one buffer at a time: halves of a TLS stream in user space, in-memory pipes.
impl<T: AsyncRead> ScatterRead for tokio::io::ReadHalf<T> {}
impl ScatterRead for tokio::io::DuplexStream {}

/// Any reader, read one buffer at a time (the default [`ScatterRead`]): TLS streams, in-memory
/// streams, tests.
#[derive(Debug)]
pub struct Unscattered<R>(pub R);

impl<R: AsyncRead + Unpin> AsyncRead for Unscattered<R> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl<R: AsyncRead + Unpin> ScatterRead for Unscattered<R> {}

impl RegionMemory {
    /// Zero-copy receive with a tail: one read of `rd` into `offset..offset + len` of the mapping
    /// and then into `tail`, scattered in one call where `rd` can. Returns how many bytes were
    /// read in all: the first `min(n, len)` landed in the region, the rest (only once the region
    /// range is full) in `tail`. Bounds and writability are checked first; see
    /// [`RegionMemory::poll_read_into`] for memory that can shrink and for trusting the bytes.
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

    /// A reader that cannot scatter fills the region range only; the tail stays as it was.
    #[tokio::test]
    async fn an_unscattered_reader_fills_the_region_only() {
        let sent: Vec<u8> = (0..200u32).map(|i| i as u8).collect();
        let mut rd = Unscattered(&sent[..]);
        let mem = RegionMemory::anonymous(4096, false).expect("mapping");
        let mut tail = [7u8; 44];
        let n = std::future::poll_fn(|cx| mem.poll_read_scatter(Pin::new(&mut rd), cx, 0, 150, &mut tail)).await.expect("read");
        assert_eq!(n, 150);
        assert_eq!(tail, [7u8; 44]);
        let mut region = vec![0u8; 150];
        mem.read_at(0, &mut region).expect("read back");
        assert_eq!(region, sent[..150]);
    }
}
