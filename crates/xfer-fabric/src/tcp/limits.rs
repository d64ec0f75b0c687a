//! The target's bounds on its data port: how many sockets it holds, and how long a socket may
//! stay before its hello (the oldest such socket makes room for the newest).
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// The initiator's TLS handshake on a data stream must complete within this; it is also the
/// default of the target's `limits.data_handshake_timeout`.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// The target's bounds on its data port (`limits.*` in the configuration).
#[derive(Debug, Clone, Copy)]
pub struct DataLimits {
    /// Open sockets from accept until close, hello or not (`limits.max_data_connections`).
    pub max_connections: usize,
    /// Sockets before their hello; the oldest is closed at the cap
    /// (`limits.max_pending_data_connections`).
    pub max_pending: usize,
    /// Streams of one identity, counted once the hello names a session
    /// (`limits.max_data_connections_per_peer`).
    pub max_connections_per_peer: usize,
    /// (TLS handshake and) hello deadline (`limits.data_handshake_timeout`).
    pub handshake_timeout: Duration,
    /// A stream with no frame for this long is closed (`limits.data_idle_timeout`).
    pub idle_timeout: Duration,
    /// A WRITE payload must arrive in full within this of its header, or the stream is closed
    /// (`limits.data_payload_timeout`).
    pub payload_timeout: Duration,
}

impl Default for DataLimits {
    fn default() -> Self {
        DataLimits {
            max_connections: 4096,
            max_pending: 128,
            max_connections_per_peer: 256,
            handshake_timeout: HELLO_TIMEOUT,
            idle_timeout: Duration::from_secs(300),
            payload_timeout: Duration::from_secs(30),
        }
    }
}

/// Sockets still before their hello, oldest first (by accept order). Entering at the cap closes
/// the oldest: a flood of silent sockets only shortens every silent socket's life.
pub(super) struct PreHelloSockets {
    queue: Mutex<BTreeMap<u64, CancellationToken>>,
    next: AtomicU64,
    max: usize,
}

impl PreHelloSockets {
    pub(super) fn new(max: usize) -> Arc<PreHelloSockets> {
        Arc::new(PreHelloSockets { queue: Mutex::new(Default::default()), next: Default::default(), max: max.max(1) })
    }

    /// Registers a socket before its hello; its token is cancelled if it is evicted.
    pub(super) fn enter(self: &Arc<Self>) -> PreHelloSlot {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let token = CancellationToken::new();
        // A poisoned lock means a panic while holding it; the map is still consistent.
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        while q.len() >= self.max {
            let Some((_, oldest)) = q.pop_first() else { break };
            oldest.cancel();
            crate::metrics::data_connection_closed("evicted");
        }
        q.insert(id, token.clone());
        PreHelloSlot { pending: self.clone(), id, token }
    }
}

/// A socket's place among the [`PreHelloSockets`]; leaving (hello read, or the socket closed)
/// drops it.
pub(super) struct PreHelloSlot {
    pending: Arc<PreHelloSockets>,
    id: u64,
    pub(super) token: CancellationToken,
}

impl Drop for PreHelloSlot {
    fn drop(&mut self) {
        self.pending.queue.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
    }
}
