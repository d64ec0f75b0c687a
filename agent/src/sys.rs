//! Facts about the process the agent runs in: locked-memory and open-file limits, capabilities,
//! and the back-off of accept loops that run out of file descriptors.
use std::time::Duration;

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
    let half = usize::try_from(nofile / 2).unwrap_or(usize::MAX).max(1);
    (configured > half).then_some(half)
}

/// First pause after a failed accept.
pub const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest pause between failed accepts.
pub const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Exponential back-off of an accept loop: a failed accept (EMFILE, ENFILE, ...) pauses the loop
/// 10 ms, doubling to 1 s while accepts keep failing; a successful accept resets it. Without it
/// a listener out of file descriptors is readable forever and its loop spins.
#[derive(Debug, Default)]
pub struct AcceptBackoff {
    next: Option<Duration>,
}

impl AcceptBackoff {
    /// Counts a failed accept on `listener` (metric label) and returns how long to pause.
    pub fn failed(&mut self, listener: &'static str) -> Duration {
        crate::metrics::accept_error(listener);
        let d = self.next.unwrap_or(ACCEPT_BACKOFF_MIN);
        self.next = Some((d * 2).min(ACCEPT_BACKOFF_MAX));
        d
    }

    pub fn succeeded(&mut self) {
        self.next = None;
    }
}

/// The gRPC listener as a stream of accepted sockets, with [`AcceptBackoff`] on errors: errors are
/// logged, counted and waited out instead of handed to the server, which would retry at once.
pub fn incoming_with_backoff(
    listener: tokio::net::TcpListener,
    name: &'static str,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures::stream::unfold((listener, AcceptBackoff::default()), move |(listener, mut backoff)| async move {
        loop {
            match listener.accept().await {
                Ok((s, _)) => {
                    backoff.succeeded();
                    return Some((Ok(s), (listener, backoff)));
                }
                Err(e) => {
                    let pause = backoff.failed(name);
                    tracing::warn!(listener = name, error = %e, ?pause, "accept failed; backing off");
                    tokio::time::sleep(pause).await;
                }
            }
        }
    })
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
    #[test]
    fn accept_backoff_doubles_to_the_cap_and_resets() {
        use super::*;
        let mut b = AcceptBackoff::default();
        let mut seen = Vec::new();
        for _ in 0..10 {
            seen.push(b.failed("test"));
        }
        assert_eq!(seen[0], ACCEPT_BACKOFF_MIN);
        assert_eq!(seen[1], ACCEPT_BACKOFF_MIN * 2);
        assert_eq!(*seen.last().unwrap(), ACCEPT_BACKOFF_MAX);
        assert!(seen.windows(2).all(|w| w[0] <= w[1]));
        b.succeeded();
        assert_eq!(b.failed("test"), ACCEPT_BACKOFF_MIN);
    }
}
