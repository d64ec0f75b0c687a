//! Connection pool per peer agent: the gRPC client, negotiated fabric connections, reuse, and
//! recreation after errors or a peer restart.
//!
//! A transfer *leases* a whole connection (its QPs and its completion queue) for its lifetime, so
//! completions need no demultiplexing and each QP's send queue is bounded by one transfer's
//! `depth`. Concurrent transfers to one peer get separate connections; finished, healthy and
//! drained connections go back to a bounded idle list. A connection is never reused after an error
//! (`is_broken`), after a cancelled transfer left WRs outstanding, or when the peer's instance id
//! changed (it restarted: its QPs and listeners are gone).
//!
//! Every call to a peer goes through [`PeerEntry::call`], which bounds retries and keeps a
//! per-peer back-off: a call refused before it reached the peer (connection refused) is retried
//! at most [`CALL_ATTEMPTS`] times; after [`BACKOFF_AFTER`] consecutive transport failures, or
//! one *slow* failure (a connect that timed out: the peer is silent, and every further attempt
//! would cost the same timeout), the peer is *backing off*: calls fail at once, without network
//! IO, for a window that starts at [`BACKOFF_BASE`] and doubles up to [`BACKOFF_CAP`]. Calls that
//! were already waiting for the peer's connection fail when the window starts: the gRPC channel
//! connects for one request at a time, so N callers would otherwise wait N timeouts. The first
//! call after the window is a probe; any answer from the peer (even an error status) resets the
//! back-off. A dead peer therefore costs its callers about one connect timeout per window, and
//! never touches transfers to other peers: each peer has its own entry, channel and connections.
//!
//! A peer is an identity, not a string ([`pool`]): an entry is keyed on the node name the peer's
//! certificate proves (mTLS) or on its resolved socket address (plaintext), and every spelling of
//! an address that reaches it shares that entry, its gRPC channel and its connections. The
//! connections one entry holds (leased and idle) stay under `limits.max_connections_per_peer` and
//! under what the peer advertised in `Peer.Connect` it keeps for this agent, so the responder
//! never has to evict a connection this agent still counts on.
//!
//! The pool holds at most `limits.max_peers` entries (any client may name any address in
//! `Agent.Connect` or a submit). A new address past the cap evicts the least recently used entry
//! that nothing else holds (no transfer, lease or call in flight): its idle connections are closed
//! and disconnected. When every entry is in use the new address is refused (RESOURCE_EXHAUSTED).
mod health;
mod pool;
mod tenancy;

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use crate::metrics as m;
use crate::peer_api::{PeerApi, PeerError};
use health::Health;
pub use health::{BACKOFF_AFTER, BACKOFF_BASE, BACKOFF_CAP};
pub use pool::{PeerKey, PeerPool};
use xfer_engine::ids::ConnectionId;
use xfer_fabric::{Completion, Connection};

/// Attempts of one call whose connection was refused (the request never reached the peer, so a
/// retry is safe even for non-idempotent calls such as `Grant`).
pub const CALL_ATTEMPTS: u32 = 3;
/// Delay before the first retry; doubles per attempt.
const RETRY_DELAY: Duration = Duration::from_millis(100);
/// A transport failure that took this long was a timeout, not a refusal: back off at once.
const SLOW_FAILURE: Duration = Duration::from_secs(1);

/// A negotiated connection: its QPs (or streams), its completions and who it was made with. It
/// rests in a peer's idle list between leases.
pub struct PooledConn {
    conn: Arc<dyn Connection>,
    completions: mpsc::UnboundedReceiver<Completion>,
    connection_id: ConnectionId,
    qps: usize,
    depth: usize,
    /// The peer's instance id when the connection was negotiated.
    instance_id: String,
    /// Counts it against its entry's connection bound while it exists.
    held: HeldConn,
}

/// Connections (and their QPs or streams) an entry holds, leased or idle.
#[derive(Debug, Default)]
pub struct ConnCounts {
    conns: AtomicUsize,
    streams: AtomicUsize,
}

/// One connection's share of [`ConnCounts`], given back when the connection is dropped, however
/// it ends (released to a full idle list, discarded, closed because the peer restarted).
struct HeldConn {
    counts: Arc<ConnCounts>,
    streams: usize,
}

impl HeldConn {
    fn new(counts: &Arc<ConnCounts>, streams: usize) -> HeldConn {
        counts.conns.fetch_add(1, Ordering::AcqRel);
        counts.streams.fetch_add(streams, Ordering::AcqRel);
        HeldConn { counts: counts.clone(), streams }
    }
}

impl HeldConn {
    /// Makes this connection's count `streams`, the QPs it really holds (it was counted what
    /// it could hold at most before it was negotiated).
    fn settle(&mut self, streams: usize) {
        self.counts.streams.fetch_add(streams, Ordering::AcqRel);
        self.counts.streams.fetch_sub(self.streams, Ordering::AcqRel);
        self.streams = streams;
    }
}

impl Drop for HeldConn {
    fn drop(&mut self) {
        self.counts.conns.fetch_sub(1, Ordering::AcqRel);
        self.counts.streams.fetch_sub(self.streams, Ordering::AcqRel);
    }
}

/// A connection leased by one transfer: an RAII guard. [`Lease::release`] hands it back (to the
/// idle list when `clean`); dropping it without that discards it — the connection is closed and
/// the peer told to forget it — so no exit path, early return, panic or cancelled future can leak
/// a connection or put one with unknown WRs back in the pool.
pub struct Lease {
    /// `None` once released.
    inner: Option<PooledConn>,
    /// Taken from the idle list (negotiated for an earlier transfer).
    reused: bool,
    peer: Arc<PeerEntry>,
    home: Arc<Home>,
    /// Its tenant's share of the connections to this peer, given back with the lease.
    _charge: Option<tenancy::LeaseCharge>,
}

/// What a lease needs to go back: the pool's settings, shared by every lease it made.
struct Home {
    node_name: String,
    max_idle_per_peer: usize,
}

impl Lease {
    #[allow(clippy::expect_used)]
    fn inner(&self) -> &PooledConn {
        // Invariant: `inner` is taken only by `release(self)` and `drop`, which consume the lease.
        self.inner.as_ref().expect("a live lease holds its connection")
    }

    pub fn conn(&self) -> &Arc<dyn Connection> {
        &self.inner().conn
    }

    /// The connection's completion queue (this lease's transfer is its only reader).
    #[allow(clippy::expect_used)]
    pub fn completions(&mut self) -> &mut mpsc::UnboundedReceiver<Completion> {
        // Invariant: as in `inner`.
        &mut self.inner.as_mut().expect("a live lease holds its connection").completions
    }

    pub fn connection_id(&self) -> &ConnectionId {
        &self.inner().connection_id
    }

    /// The connection's QPs: on a fabric over several devices, the shape asked for on each path
    /// times its paths (the pool matches idle connections by the shape asked, `PooledConn::qps`).
    pub fn qps(&self) -> usize {
        self.inner().conn.qps()
    }

    /// The peer's instance id when the connection was negotiated.
    pub fn instance_id(&self) -> &str {
        &self.inner().instance_id
    }

    /// Whether the connection came from the idle list rather than a fresh negotiation.
    pub fn reused(&self) -> bool {
        self.reused
    }

    /// Hands the connection back. `clean` means every WR it posted has completed successfully:
    /// then, if it is healthy and the idle list has room, the next transfer may reuse it.
    pub fn release(mut self, clean: bool) {
        let Some(mut c) = self.inner.take() else { return };
        // Completions that arrived after the transfer stopped listening belong to no one.
        while c.completions.try_recv().is_ok() {}
        if clean && !c.conn.wants_reconnect() {
            if let Ok(mut idle) = self.peer.idle.lock() {
                if idle.len() < self.home.max_idle_per_peer {
                    idle.push(c);
                    drop(idle);
                    update_gauge(&self.peer);
                    return;
                }
            }
        }
        discard(&self.peer, &self.home.node_name, c);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(c) = self.inner.take() {
            debug!(peer = %self.peer.addr, connection = %c.connection_id, "lease dropped without release; discarding its connection");
            discard(&self.peer, &self.home.node_name, c);
        }
    }
}

/// Closes a connection and tells the peer to forget its session (in the background; skipped when
/// no runtime is left, at exit).
fn discard(peer: &Arc<PeerEntry>, me: &str, c: PooledConn) {
    c.conn.close();
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        let client = peer.client.clone();
        let me = me.to_string();
        rt.spawn(async move { client.disconnect(&c.connection_id, &me).await });
    }
    update_gauge(peer);
}

fn update_gauge(peer: &Arc<PeerEntry>) {
    let name = peer.node_name();
    let label = if name.is_empty() { peer.addr.clone() } else { name };
    let idle_qps: usize = peer.idle.lock().map(|i| i.iter().map(|l| l.qps).sum()).unwrap_or(0);
    m::qp_connections(&label, "idle", idle_qps);
}

/// One peer agent: who it is, the address it was first reached at, and its connections.
pub struct PeerEntry {
    /// Who this entry is (what the pool keys it on).
    pub key: PeerKey,
    /// The spelling it was first reached at (canonical): dialled, and shown in `ListPeers`.
    pub addr: String,
    pub client: Arc<dyn PeerApi>,
    /// Connections this entry holds, leased or idle.
    held: Arc<ConnCounts>,
    /// What the peer keeps for this agent (`Peer.Connect`'s answer): connections, streams (0 =
    /// no bound; both 0 until the first answer).
    advertised: Mutex<(u32, u32)>,
    /// Leased connections and streams per tenant.
    tenants: tenancy::TenantLeases,
    /// Node name and instance id learned from the last Connect/Grant. std Mutex: no awaits held.
    identity: Mutex<(String, String)>,
    idle: Mutex<Vec<PooledConn>>,
    pub last_connect: Mutex<Option<Duration>>,
    /// Consecutive transport failures and the back-off window. std Mutex: no awaits held.
    health: Mutex<Health>,
    /// Bumped whenever a back-off window starts; calls in flight watch it to give up waiting.
    backoff_started: watch::Sender<u64>,
    /// The pool's clock at the last lookup (LRU eviction).
    last_used: AtomicU64,
}

impl PeerEntry {
    fn new(key: PeerKey, addr: String, client: Arc<dyn PeerApi>, now: u64) -> PeerEntry {
        PeerEntry {
            key,
            addr,
            client,
            held: Arc::new(ConnCounts::default()),
            advertised: Mutex::new((0, 0)),
            tenants: tenancy::TenantLeases::default(),
            identity: Mutex::new((String::new(), String::new())),
            idle: Mutex::new(Vec::new()),
            last_connect: Mutex::new(None),
            health: Mutex::new(Health::default()),
            backoff_started: watch::channel(0).0,
            last_used: AtomicU64::new(now),
        }
    }

    /// Connections and streams (QPs) this entry holds, leased or idle.
    pub fn held(&self) -> (usize, usize) {
        (self.held.conns.load(Ordering::Acquire), self.held.streams.load(Ordering::Acquire))
    }

    /// The leased connections and their QPs charged to `tenant` (its share's count).
    pub fn tenant_held(&self, tenant: &crate::tenants::Tenant) -> (usize, usize) {
        self.tenants.of(tenant)
    }

    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The last transport error, while calls to the peer keep failing (`None` once one succeeds).
    pub fn last_failure(&self) -> Option<String> {
        let h = self.health();
        (h.failures > 0).then(|| h.last_error.clone())
    }

    /// Fails at once while the peer is backing off.
    pub fn admit(&self) -> Result<(), PeerError> {
        let h = self.health();
        match h.backing_off(Instant::now()) {
            None => Ok(()),
            Some(left) => Err(PeerError::Unreachable {
                addr: self.addr.clone(),
                detail: format!(
                    "backing off for another {:.1} s after {} consecutive failures (last: {})",
                    left.as_secs_f64(),
                    h.failures,
                    h.last_error
                ),
            }),
        }
    }

    /// Whether calls to this peer currently fail fast.
    pub fn is_backing_off(&self) -> bool {
        self.health().backing_off(Instant::now()).is_some()
    }

    /// Feeds a call's outcome into the back-off: a transport failure counts, anything the peer
    /// answered (success or an error status) resets it.
    pub fn record<T>(&self, r: &Result<T, PeerError>, took: Duration) {
        match r {
            Err(e) if e.is_transport() => {
                let started = self.health().failure(Instant::now(), e.to_string(), took >= SLOW_FAILURE);
                if let Some(window) = started {
                    warn!(peer = %self.addr, ?window, error = %e, "peer unreachable; backing off");
                    self.backoff_started.send_modify(|g| *g += 1);
                }
            }
            _ => {
                let mut h = self.health();
                if h.failures > 0 {
                    if h.until.is_some() {
                        info!(peer = %self.addr, "peer answers again; back-off reset");
                    }
                    h.success();
                }
            }
        }
    }

    /// Runs one call to the peer under the back-off, retrying a refused connection at most
    /// [`CALL_ATTEMPTS`] times (100 ms, then 200 ms apart). If a back-off window starts while the
    /// call waits (another call found the peer dead), it fails at once with the back-off error;
    /// a request that did reach a slow peer is then abandoned (a grant it created expires).
    pub async fn call<T, F, Fut>(&self, mut f: F) -> Result<T, PeerError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, PeerError>>,
    {
        let mut delay = RETRY_DELAY;
        let mut attempt = 1;
        loop {
            self.admit()?;
            let mut started = self.backoff_started.subscribe();
            let t0 = Instant::now();
            let fut = f();
            tokio::pin!(fut);
            let r = loop {
                tokio::select! {
                    r = &mut fut => break r,
                    Ok(()) = started.changed() => self.admit()?,
                }
            };
            self.record(&r, t0.elapsed());
            match r {
                Err(e) if attempt < CALL_ATTEMPTS && e.is_refused() => {
                    debug!(peer = %self.addr, attempt, error = %e, "connection refused; retrying");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                    attempt += 1;
                }
                r => return r,
            }
        }
    }

    /// The identity metric labels name this peer by: the one the peer's own metrics name this
    /// agent by, so both sides' `peer` labels agree. The NAME its certificate proved (mTLS); without
    /// TLS its address the way a plaintext agent names a caller (`loopback`, or the IP).
    pub fn label_identity(&self) -> String {
        if let Some(name) = self.client.verified_identity() {
            return name;
        }
        let host = xfer_fabric::identity::tls::host_of(&self.addr);
        match host.parse::<std::net::IpAddr>() {
            Ok(ip) => xfer_fabric::identity::plaintext_name(Some(std::net::SocketAddr::new(ip, 0))),
            Err(_) => host.to_string(),
        }
    }

    pub fn node_name(&self) -> String {
        self.identity.lock().map(|g| g.0.clone()).unwrap_or_default()
    }

    /// Records what the peer says about itself. A changed instance id drops idle connections.
    pub fn observe(&self, node_name: &str, instance_id: &str) {
        let Ok(mut id) = self.identity.lock() else { return };
        if !id.1.is_empty() && id.1 != instance_id {
            info!(peer = %self.addr, "peer restarted (new instance id); dropping idle connections");
            if let Ok(mut idle) = self.idle.lock() {
                for l in idle.drain(..) {
                    l.conn.close();
                }
            }
        }
        // The name the peer's certificate proved wins over the one it declares (mTLS): labels
        // and records then name who really answered.
        let name = self.client.verified_identity().unwrap_or_else(|| node_name.to_string());
        *id = (name, instance_id.to_string());
    }

    /// Idle connections that can still be lent (a broken one, e.g. closed by the peer's
    /// `limits.data_idle_timeout`, is not counted: `lease` discards it).
    pub fn idle_count(&self) -> usize {
        self.idle.lock().map(|i| i.iter().filter(|l| !l.conn.wants_reconnect()).count()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use crate::peer_api::{PeerError, RemoteCode};

    #[test]
    fn only_refused_connections_are_retried() {
        let refused = PeerError::Unreachable { addr: "a".into(), detail: "tcp connect error: Connection refused (os error 111)".into() };
        let timeout = PeerError::Unreachable { addr: "a".into(), detail: "transport error: timed out".into() };
        let answered = PeerError::Remote { addr: "a".into(), code: RemoteCode::NotFound, message: "no".into() };
        assert!(refused.is_refused() && refused.is_transport());
        assert!(!timeout.is_refused() && timeout.is_transport());
        assert!(!answered.is_refused() && !answered.is_transport());
    }
}
