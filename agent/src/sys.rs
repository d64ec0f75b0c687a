//! Facts about the process the agent runs in: locked-memory and open-file limits, capabilities,
//! and the back-off of accept loops that run out of file descriptors.
use xfer_fabric::accept::{AcceptBackoff, Slot, Slots};

/// Raises the soft RLIMIT_NOFILE to the hard limit. Returns (soft before, soft after, hard); the
/// error says why the raise failed (the limits are then unchanged).
pub fn raise_nofile() -> Result<(u64, u64, u64), String> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(|e| format!("getrlimit(RLIMIT_NOFILE): {e}"))?;
    if soft >= hard {
        return Ok((soft, soft, hard));
    }
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(|e| format!("setrlimit(RLIMIT_NOFILE, {hard}): {e}"))?;
    Ok((soft, hard, hard))
}

/// The soft RLIMIT_NOFILE now (`u64::MAX` if unlimited or unknown).
pub fn nofile() -> u64 {
    use nix::sys::resource::{getrlimit, Resource};
    getrlimit(Resource::RLIMIT_NOFILE).map(|(soft, _)| soft).unwrap_or(u64::MAX)
}

/// The data-connection cap actually enforced: `configured`, but never more than half the
/// descriptor limit `nofile`, so idle data connections alone can never take the descriptors that
/// gRPC, peers, metrics and region files need. `None` when no clamp is needed.
pub fn clamp_connections(configured: usize, nofile: u64) -> Option<usize> {
    let half = share(nofile, 2);
    (configured > half).then_some(half)
}

/// Open connections of one listener (gRPC, health, metrics), at most `max`: a [`Counted`] socket
/// holds a slot until it is dropped. A socket accepted at the cap is closed at once and counted
/// (`xfer_listener_connections_refused_total{listener}`), so idle sockets on a control port can
/// never take the descriptors that region files, the catalog and the data plane need.
#[derive(Debug)]
pub struct ConnLimit {
    slots: std::sync::Arc<Slots>,
    name: &'static str,
}

impl ConnLimit {
    pub fn new(name: &'static str, max: usize) -> std::sync::Arc<ConnLimit> {
        crate::metrics::limit_for_listener(name, max as u64);
        let slots = Slots::new(max.max(1), move |n| crate::metrics::listener_connections(name, n));
        std::sync::Arc::new(ConnLimit { slots, name })
    }

    fn admit<S>(&self, inner: S) -> Option<Counted<S>> {
        match self.slots.take() {
            Some(slot) => Some(Counted { inner, _slot: slot }),
            None => {
                crate::metrics::listener_connection_refused(self.name);
                None
            }
        }
    }
}

/// An accepted socket that holds one slot of its listener's [`ConnLimit`].
#[derive(Debug)]
pub struct Counted<S> {
    inner: S,
    _slot: Slot,
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Counted<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The caller's address (plaintext identity), certificates or peer credentials (the unix
/// socket's uid) come from the socket underneath.
impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for Counted<S> {
    type ConnectInfo = S::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// A listening socket [`incoming_with_backoff`] accepts from: TCP (gRPC, health) or unix (the
/// local socket).
pub trait Listener: Send + 'static {
    type Stream: Send + 'static;
    type Addr: std::fmt::Debug + Send;
    fn accept(&self) -> impl std::future::Future<Output = std::io::Result<(Self::Stream, Self::Addr)>> + Send;
}

impl Listener for tokio::net::TcpListener {
    type Stream = tokio::net::TcpStream;
    type Addr = std::net::SocketAddr;
    /// Accepted TCP sockets get TCP_NODELAY: tonic's `Server::tcp_nodelay` applies only to
    /// listeners tonic binds itself, not to `serve_with_incoming`, so without this every gRPC
    /// answer written in more than one segment could wait for the peer's delayed ACK.
    async fn accept(&self) -> std::io::Result<(Self::Stream, Self::Addr)> {
        let (s, from) = tokio::net::TcpListener::accept(self).await?;
        if let Err(e) = s.set_nodelay(true) {
            tracing::debug!(?from, error = %e, "cannot set TCP_NODELAY on an accepted connection");
        }
        Ok((s, from))
    }
}

impl Listener for tokio::net::UnixListener {
    type Stream = tokio::net::UnixStream;
    type Addr = tokio::net::unix::SocketAddr;
    fn accept(&self) -> impl std::future::Future<Output = std::io::Result<(Self::Stream, Self::Addr)>> + Send {
        tokio::net::UnixListener::accept(self)
    }
}

/// A listener as a stream of accepted sockets, each holding a slot of `limit`, with
/// [`AcceptBackoff`] on errors: errors are logged, counted and waited out instead of handed to
/// the server, which would retry at once.
pub fn incoming_with_backoff<L: Listener>(
    listener: L,
    name: &'static str,
    limit: std::sync::Arc<ConnLimit>,
) -> impl futures::Stream<Item = std::io::Result<Counted<L::Stream>>> {
    futures::stream::unfold((listener, AcceptBackoff::default()), move |(listener, mut backoff)| {
        let limit = limit.clone();
        async move {
            loop {
                match listener.accept().await {
                    Ok((s, from)) => {
                        backoff.succeeded();
                        match limit.admit(s) {
                            Some(s) => return Some((Ok(s), (listener, backoff))),
                            None => tracing::debug!(listener = name, ?from, "connection refused: the listener is at its cap"),
                        }
                    }
                    Err(e) => {
                        let pause = backoff.failed(name);
                        tracing::warn!(listener = name, error = %e, ?pause, "accept failed; backing off");
                        tokio::time::sleep(pause).await;
                    }
                }
            }
        }
    })
}

/// Shares of the descriptor limit `nofile`: the data port gets at most half
/// ([`clamp_connections`]), gRPC at most a quarter ([`grpc_cap`]), health, metrics and the local
/// unix socket at most a sixteenth each ([`probe_cap`], [`unix_cap`]); so at least a sixteenth
/// stays for region files, the catalog and connections to peers.
fn share(nofile: u64, divisor: u64) -> usize {
    usize::try_from(nofile / divisor).unwrap_or(usize::MAX).max(1)
}

/// The gRPC listener's cap: `configured` (`limits.max_grpc_connections`), at most a quarter of
/// `nofile`.
pub fn grpc_cap(configured: usize, nofile: u64) -> usize {
    configured.min(share(nofile, 4))
}

/// The local unix socket's cap: `configured` (`limits.max_grpc_connections`), at most a
/// sixteenth of `nofile`. Its own budget, so local applications cannot lock peers out of the
/// gRPC port, nor the reverse.
pub fn unix_cap(configured: usize, nofile: u64) -> usize {
    configured.min(share(nofile, 16))
}

/// The health and metrics listeners' cap: 64, at most a sixteenth of `nofile`.
pub fn probe_cap(nofile: u64) -> usize {
    64usize.min(share(nofile, 16))
}

/// RLIMIT_MEMLOCK (soft, hard) in bytes; `u64::MAX` means unlimited.
pub fn memlock() -> (u64, u64) {
    use nix::sys::resource::{getrlimit, Resource};
    getrlimit(Resource::RLIMIT_MEMLOCK).unwrap_or((0, 0))
}

/// Whether CAP_IPC_LOCK is in the effective set (parsing shared with `xferctl doctor`).
pub fn cap_ipc_lock() -> bool {
    xfer_common::host::own_cap_ipc_lock()
}

#[cfg(test)]
mod tests {
    /// Every gRPC, health and metrics connection comes through `incoming_with_backoff`; the
    /// TCP ones must have Nagle off (tonic's own setting does not reach them).
    #[tokio::test]
    async fn accepted_tcp_connections_have_nodelay() {
        use super::*;
        use futures::StreamExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let mut incoming = Box::pin(incoming_with_backoff(l, "test", ConnLimit::new("test", 4)));
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let served = incoming.next().await.unwrap().unwrap();
        assert!(served.inner.nodelay().unwrap(), "TCP_NODELAY on the accepted socket");
    }

    #[test]
    fn descriptor_shares() {
        use super::*;
        // The data port keeps to half the limit.
        assert_eq!(clamp_connections(4096, 1024), Some(512));
        assert_eq!(clamp_connections(512, 1024), None);
        assert_eq!(clamp_connections(4096, u64::MAX), None);
        assert_eq!(clamp_connections(4096, 1), Some(1));
        // gRPC a quarter, health and metrics a sixteenth (and never more than 64).
        assert_eq!(grpc_cap(1024, 1024), 256);
        assert_eq!(grpc_cap(1024, 256), 64);
        assert_eq!(grpc_cap(100, 1 << 20), 100);
        assert_eq!(grpc_cap(1024, 2), 1);
        assert_eq!(probe_cap(1024), 64);
        assert_eq!(unix_cap(1024, 1024), 64);
        assert_eq!(unix_cap(100, 1 << 20), 100);
        assert_eq!(unix_cap(1024, 2), 1);
        assert_eq!(probe_cap(256), 16);
        assert_eq!(probe_cap(2), 1);
    }
}
