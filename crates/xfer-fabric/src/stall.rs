//! A writer that gives up on a reader who stopped reading.
//!
//! The TCP fabric's target side answers an initiator's frames (ACKs, NAKs, READ responses of up
//! to 256 MiB) on the data stream. TCP itself never times out a send that makes no progress, so
//! an initiator that keeps its socket open but stops reading would hold the stream's task, its
//! buffers and its slot under `limits.max_data_connections_per_peer` for ever. [`StallGuard`]
//! wraps the stream's write half: a write or flush that makes no progress for `limit` fails with
//! an [`std::io::ErrorKind::TimedOut`] error that [`is_stall`] recognises. Any progress (one
//! byte taken) restarts the clock, so a slow but live reader is never cut off.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::AsyncWrite;
use tokio::time::Sleep;

/// The error a stalled write fails with (recognised by [`is_stall`]).
#[derive(Debug, thiserror::Error)]
#[error("the reader took no byte for {0:?}")]
struct Stalled(Duration);

/// Whether `e` is a [`StallGuard`]'s timeout.
pub fn is_stall(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Stalled>())
}

/// See the module docs. `limit: None` wraps without a limit.
pub struct StallGuard<W> {
    inner: W,
    limit: Option<Duration>,
    /// Armed when a write or flush first returns `Pending`; dropped on any progress.
    timer: Option<Pin<Box<Sleep>>>,
}

impl<W> StallGuard<W> {
    pub fn new(inner: W, limit: Option<Duration>) -> Self {
        StallGuard { inner, limit, timer: None }
    }

    /// Called when the inner writer returned `Pending`: arms the timer if needed and fails once
    /// it has run out (the timer's waker is registered, so the task wakes for that).
    fn pending<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let Some(limit) = self.limit else { return Poll::Pending };
        let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.timer = None;
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, Stalled(limit))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn settle<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match r {
            Poll::Pending => self.pending(cx),
            ready => {
                self.timer = None;
                ready
            }
        }
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for StallGuard<W> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.settle(cx, r)
    }

    // Forwarded, so a READ answer's header and payload still leave in one system call.
    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.settle(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_flush(cx);
        this.settle(cx, r)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.settle(cx, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const LIMIT: Duration = Duration::from_secs(5);

    #[tokio::test(start_paused = true)]
    async fn a_reader_that_takes_nothing_fails_the_write_after_the_limit() {
        let (w, _r) = tokio::io::duplex(16);
        let mut g = StallGuard::new(w, Some(LIMIT));
        let start = tokio::time::Instant::now();
        let e = g.write_all(&[7u8; 64]).await.expect_err("nobody reads");
        assert!(is_stall(&e), "{e}");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        // Virtual time: exactly the limit, counted from the first write that could not proceed.
        assert_eq!(start.elapsed(), LIMIT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_that_keeps_taking_bytes_is_never_cut_off() {
        let (w, mut r) = tokio::io::duplex(16);
        let mut g = StallGuard::new(w, Some(LIMIT));
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut b = [0u8; 16];
            loop {
                // Each read comes just inside the limit; all of them together take far longer.
                tokio::time::sleep(LIMIT - Duration::from_millis(1)).await;
                match r.read(&mut b).await {
                    Ok(0) | Err(_) => return got,
                    Ok(n) => got.extend_from_slice(&b[..n]),
                }
            }
        });
        let data: Vec<u8> = (0..128u8).collect();
        g.write_all(&data).await.expect("a live reader");
        g.shutdown().await.expect("shutdown");
        drop(g);
        assert_eq!(reader.await.expect("reader"), data);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_limit_it_only_passes_through() {
        let (w, mut r) = tokio::io::duplex(16);
        let mut g = StallGuard::new(w, None);
        let writer = tokio::spawn(async move {
            g.write_all(&[1u8; 64]).await.expect("write");
        });
        // Long after any limit would have run out, the reader starts and gets every byte.
        tokio::time::sleep(Duration::from_secs(3600)).await;
        let mut got = vec![0u8; 64];
        r.read_exact(&mut got).await.expect("read");
        writer.await.expect("writer");
        assert_eq!(got, vec![1u8; 64]);
    }
}
