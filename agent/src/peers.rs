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
//! The pool holds at most `limits.max_peers` entries (any client may name any address in
//! `Agent.Connect` or a submit). A new address past the cap evicts the least recently used entry
//! that nothing else holds (no transfer, lease or call in flight): its idle connections are closed
//! and disconnected. When every entry is in use the new address is refused (RESOURCE_EXHAUSTED).
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tracing::{debug, info, info_span, warn, Instrument};

use crate::fabric::{Completion, Connection, Fabric, FabricError};
use crate::ids::ConnectionId;
use crate::metrics as m;
use crate::peer_api::{Connector, PeerApi, PeerError};

/// Consecutive transport failures after which a peer is put in back-off.
pub const BACKOFF_AFTER: u32 = 3;
/// First back-off window; it doubles with every failed probe.
pub const BACKOFF_BASE: Duration = Duration::from_secs(1);
/// Longest back-off window.
pub const BACKOFF_CAP: Duration = Duration::from_secs(30);
/// Attempts of one call whose connection was refused (the request never reached the peer, so a
/// retry is safe even for non-idempotent calls such as `Grant`).
pub const CALL_ATTEMPTS: u32 = 3;
/// Delay before the first retry; doubles per attempt.
const RETRY_DELAY: Duration = Duration::from_millis(100);
/// A transport failure that took this long was a timeout, not a refusal: back off at once.
const SLOW_FAILURE: Duration = Duration::from_secs(1);

/// Transport health of one peer: consecutive failures and the back-off window.
#[derive(Debug, Default)]
struct Health {
    failures: u32,
    window: Duration,
    until: Option<Instant>,
    last_error: String,
}

impl Health {
    /// `Some(remaining)` while backing off at `now`.
    fn backing_off(&self, now: Instant) -> Option<Duration> {
        self.until.and_then(|u| u.checked_duration_since(now)).filter(|d| !d.is_zero())
    }

    fn success(&mut self) {
        *self = Health::default();
    }

    /// Records a transport failure; returns the new window when it starts one. A `slow` failure
    /// (a timeout) starts one at once.
    fn failure(&mut self, now: Instant, error: String, slow: bool) -> Option<Duration> {
        self.failures = self.failures.saturating_add(1);
        self.last_error = error;
        if self.failures < BACKOFF_AFTER && !slow {
            return None;
        }
        self.window = if self.window.is_zero() { BACKOFF_BASE } else { (self.window * 2).min(BACKOFF_CAP) };
        self.until = Some(now + self.window);
        Some(self.window)
    }
}

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

    pub fn qps(&self) -> usize {
        self.inner().qps
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
        if clean && !c.conn.is_broken() {
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

/// One peer agent, by the address transfers name it with.
pub struct PeerEntry {
    pub addr: String,
    pub client: Arc<dyn PeerApi>,
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
    fn health(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(|p| p.into_inner())
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
        *id = (node_name.to_string(), instance_id.to_string());
    }

    /// Idle connections that can still be lent (a broken one, e.g. closed by the peer's
    /// `limits.data_idle_timeout`, is not counted: `lease` discards it).
    pub fn idle_count(&self) -> usize {
        self.idle.lock().map(|i| i.iter().filter(|l| !l.conn.is_broken()).count()).unwrap_or(0)
    }
}

pub struct PeerPool {
    fabric: Arc<dyn Fabric>,
    /// This agent's name and the idle-list bound, shared with every lease.
    home: Arc<Home>,
    /// Makes the client for a new peer address.
    connector: Connector,
    /// Most entries (`limits.max_peers`).
    max_peers: usize,
    /// Logical clock for `PeerEntry::last_used`.
    clock: AtomicU64,
    /// addr → peer. std Mutex: map operations only.
    peers: Mutex<HashMap<String, Arc<PeerEntry>>>,
}

impl PeerPool {
    pub fn new(fabric: Arc<dyn Fabric>, node_name: String, connector: Connector, max_peers: usize) -> Self {
        PeerPool {
            fabric,
            home: Arc::new(Home { node_name, max_idle_per_peer: 8 }),
            connector,
            max_peers: max_peers.max(1),
            clock: AtomicU64::new(0),
            peers: Mutex::new(HashMap::new()),
        }
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<PeerEntry>>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The peer at `addr` (host:port), creating its gRPC client on first use.
    pub fn peer(&self, addr: &str) -> Result<Arc<PeerEntry>, PeerError> {
        if let Some(p) = self.map().get(addr) {
            p.last_used.store(self.tick(), Ordering::Relaxed);
            return Ok(p.clone());
        }
        let client = (self.connector)(addr)?;
        let entry = Arc::new(PeerEntry {
            addr: addr.to_string(),
            client,
            identity: Mutex::new((String::new(), String::new())),
            idle: Mutex::new(Vec::new()),
            last_connect: Mutex::new(None),
            health: Mutex::new(Health::default()),
            backoff_started: watch::channel(0).0,
            last_used: AtomicU64::new(self.tick()),
        });
        let (entry, evicted, size) = {
            let mut map = self.map();
            if let Some(p) = map.get(addr) {
                // Another caller added it meanwhile.
                return Ok(p.clone());
            }
            let mut evicted = None;
            if map.len() >= self.max_peers {
                // Only the map holds an entry that no transfer, lease or call uses.
                let victim = map
                    .values()
                    .filter(|p| Arc::strong_count(p) == 1)
                    .min_by_key(|p| p.last_used.load(Ordering::Relaxed))
                    .map(|p| p.addr.clone());
                match victim.and_then(|v| map.remove(&v)) {
                    Some(v) => evicted = Some(v),
                    None => return Err(PeerError::PoolFull { addr: addr.to_string(), max: self.max_peers }),
                }
            }
            map.insert(addr.to_string(), entry.clone());
            (entry, evicted, map.len())
        };
        m::peers(size);
        if let Some(v) = evicted {
            debug!(peer = %v.addr, "peer pool full (limits.max_peers): evicted the least recently used peer");
            m::peer_evicted();
            let drained: Vec<PooledConn> = v.idle.lock().map(|mut i| i.drain(..).collect()).unwrap_or_default();
            for l in drained {
                discard(&v, &self.home.node_name, l);
            }
        }
        Ok(entry)
    }

    /// Entries in the pool.
    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.map().is_empty()
    }

    pub fn list(&self) -> Vec<Arc<PeerEntry>> {
        let mut v: Vec<_> = self.map().values().cloned().collect();
        v.sort_by(|a, b| a.addr.cmp(&b.addr));
        v
    }

    /// A connection with `qps` QPs to `peer`: an idle one if healthy, else a new negotiation.
    pub async fn lease(&self, peer: &Arc<PeerEntry>, qps: usize, depth: usize) -> Result<Lease, PeerError> {
        let current = peer.identity.lock().map(|g| g.1.clone()).unwrap_or_default();
        let mut stale = Vec::new();
        let mut found = None;
        if let Ok(mut idle) = peer.idle.lock() {
            // A broken connection (e.g. the target closed its idle streams: the readers saw EOF)
            // or one to an earlier instance of the peer is never lent again.
            let (keep, drop): (Vec<PooledConn>, Vec<PooledConn>) =
                idle.drain(..).partition(|l| !l.conn.is_broken() && l.instance_id == current);
            *idle = keep;
            stale = drop;
            if let Some(pos) = idle.iter().position(|l| l.qps == qps && l.depth >= depth) {
                found = Some(idle.swap_remove(pos));
            }
        }
        for l in stale {
            // Closes it and tells the peer to forget the session.
            discard(peer, &self.home.node_name, l);
        }
        if let Some(c) = found {
            update_gauge(peer);
            return Ok(self.guard(peer, c, true));
        }
        let c = self.negotiate(peer, qps, depth).instrument(info_span!("peer", peer = %peer.addr)).await?;
        Ok(self.guard(peer, c, false))
    }

    fn guard(&self, peer: &Arc<PeerEntry>, c: PooledConn, reused: bool) -> Lease {
        Lease { inner: Some(c), reused, peer: peer.clone(), home: self.home.clone() }
    }

    async fn negotiate(&self, peer: &Arc<PeerEntry>, qps: usize, depth: usize) -> Result<PooledConn, PeerError> {
        let started = Instant::now();
        let (tx, rx) = mpsc::unbounded_channel();
        let fabric_err = |source| PeerError::Fabric { addr: peer.addr.clone(), source };
        let connection_id = ConnectionId::random();
        let pending = self.fabric.prepare(&peer.addr, &connection_id, qps, depth, tx).await.map_err(fabric_err)?;
        let prepared = Instant::now();
        m::connect_phase("prepare", prepared - started);
        let endpoints = pending.local_endpoints();
        let node_name = &self.home.node_name;
        let reply = peer.call(|| peer.client.handshake(node_name, self.fabric.kind(), endpoints.clone(), &connection_id)).await?;
        let shaken = Instant::now();
        m::connect_phase("handshake", shaken - prepared);
        if reply.fabric != self.fabric.kind() {
            return Err(fabric_err(FabricError::Negotiation {
                step: "connect",
                attr: "fabric",
                detail: format!("peer runs {} but this agent runs {}", reply.fabric, self.fabric.kind()),
            }));
        }
        let conn = match pending.complete(&reply.endpoints).await {
            Ok(c) => c,
            Err(e) => {
                let client = peer.client.clone();
                let id = connection_id.clone();
                let me = node_name.clone();
                tokio::spawn(async move { client.disconnect(&id, &me).await });
                return Err(fabric_err(e));
            }
        };
        m::connect_phase("complete", shaken.elapsed());
        peer.observe(&reply.node_name, &reply.instance_id);
        let took = started.elapsed();
        m::connect_duration(took);
        if let Ok(mut l) = peer.last_connect.lock() {
            *l = Some(took);
        }
        debug!(peer = %peer.addr, qps, ?took, "connection negotiated");
        update_gauge(peer);
        Ok(PooledConn { conn, completions: rx, connection_id, qps, depth, instance_id: reply.instance_id })
    }

    /// Closes every idle connection (shutdown).
    pub fn close_all(&self) {
        for p in self.list() {
            let drained: Vec<PooledConn> = p.idle.lock().map(|mut i| i.drain(..).collect()).unwrap_or_default();
            for l in drained {
                discard(&p, &self.home.node_name, l);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer_api::RemoteCode;

    #[test]
    fn back_off_starts_after_consecutive_failures_doubles_to_the_cap_and_resets() {
        let t0 = Instant::now();
        let mut h = Health::default();
        for _ in 1..BACKOFF_AFTER {
            assert_eq!(h.failure(t0, "refused".into(), false), None);
            assert_eq!(h.backing_off(t0), None, "no back-off before {BACKOFF_AFTER} failures");
        }
        assert_eq!(h.failure(t0, "refused".into(), false), Some(BACKOFF_BASE));
        assert_eq!(h.backing_off(t0), Some(BACKOFF_BASE));
        assert_eq!(h.backing_off(t0 + BACKOFF_BASE), None, "the window ends: the next call probes");
        // Failed probes double the window, up to the cap.
        let mut want = BACKOFF_BASE;
        for _ in 0..20 {
            want = (want * 2).min(BACKOFF_CAP);
            assert_eq!(h.failure(t0, "refused".into(), false), Some(want));
        }
        assert_eq!(want, BACKOFF_CAP);
        h.success();
        assert_eq!(h.backing_off(t0), None);
        assert_eq!(h.failure(t0, "x".into(), false), None, "a success resets the count");
        h.success();
        assert_eq!(h.failure(t0, "connect timed out".into(), true), Some(BACKOFF_BASE), "a timeout backs off at once");
    }

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
