//! The pool of peer entries, keyed on who answers rather than on how a caller spelled the
//! address.
//!
//! A lookup goes: the caller's string is parsed into its canonical spelling
//! ([`crate::peer_addr`]); a spelling seen before maps to its entry (`aliases`). A new spelling is
//! resolved to a socket address. In plaintext that socket is the key. Under mTLS the pool asks
//! the peer (one `Peer.Ping`) and keys the entry on the node name its certificate proved; a second
//! spelling that reaches the same node (another host name, another of its addresses) joins that
//! entry and drops its own channel. Until a peer has answered, its entry is keyed on the spelling
//! it is dialled under (which decides the name its certificate is verified for: a spelling that
//! fails verification cannot lend its client to a good spelling of the same socket), so a dead
//! address still has one entry per spelling whose back-off fails callers fast.
//!
//! The client of an identified entry is pinned to its name: if the address is later taken by
//! another agent, that connection is refused, and the next lookup sees the moved identity, drops
//! the entry's aliases and starts over.
use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::{debug, info, info_span, Instrument};

use super::{discard, update_gauge, HeldConn, Home, Lease, PeerEntry, PooledConn};
use crate::metrics as m;
use crate::peer_addr::{canonical, PeerAddr};
use crate::peer_api::{Connector, PeerError};
use crate::tenants::Tenant;
use xfer_engine::ids::ConnectionId;
use xfer_fabric::{Fabric, FabricError};

/// How long a host name's resolution is trusted before the next lookup resolves it again.
const NAME_TTL: Duration = Duration::from_secs(60);
/// A name that does not resolve within this fails the call (the resolver's own timeout is longer).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(3);
/// Spellings remembered per entry the pool may hold: enough for every name and address a real
/// fleet uses, few enough that invented spellings cannot grow the map.
const ALIASES_PER_PEER: usize = 4;

/// Who a pool entry is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PeerKey {
    /// The node name of the peer's certificate (mTLS).
    Node(String),
    /// The resolved socket address (plaintext).
    Socket(SocketAddr),
    /// An mTLS peer that has not answered yet, by the spelling it is dialled under: the spelling
    /// decides the name its certificate is verified for, so a spelling that fails verification
    /// never lends its client to another spelling of the same socket.
    Dialled(String),
}

impl fmt::Display for PeerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerKey::Node(n) => write!(f, "node/{n}"),
            PeerKey::Socket(a) => write!(f, "{a}"),
            PeerKey::Dialled(s) => write!(f, "{s}"),
        }
    }
}

struct Alias {
    key: PeerKey,
    last_used: u64,
    /// When a host name was resolved (`None`: an IP literal, nothing to resolve again).
    resolved_at: Option<Instant>,
}

pub struct PeerPool {
    fabric: Arc<dyn Fabric>,
    /// This agent's name and the idle-list bound, shared with every lease.
    home: Arc<Home>,
    /// Makes the client for a new peer address.
    connector: Connector,
    /// Most entries (`limits.max_peers`).
    max_peers: usize,
    /// Most connections one entry holds (`limits.max_connections_per_peer`).
    max_connections: usize,
    /// The share of an entry's connections one tenant may lease (`limits.tenant_share`).
    tenant_share: f64,
    /// Logical clock for `PeerEntry::last_used` and aliases.
    clock: AtomicU64,
    /// Identity → entry. std Mutex: map operations only.
    peers: Mutex<HashMap<PeerKey, Arc<PeerEntry>>>,
    /// Canonical spelling → identity. std Mutex: map operations only.
    aliases: Mutex<HashMap<String, Alias>>,
}

impl PeerPool {
    pub fn new(
        fabric: Arc<dyn Fabric>,
        node_name: String,
        connector: Connector,
        max_peers: usize,
        max_connections: usize,
        tenant_share: f64,
    ) -> Self {
        PeerPool {
            fabric,
            home: Arc::new(Home { node_name, max_idle_per_peer: 8 }),
            connector,
            max_peers: max_peers.max(1),
            max_connections: max_connections.max(1),
            tenant_share,
            clock: AtomicU64::new(0),
            peers: Mutex::new(HashMap::new()),
            aliases: Mutex::new(HashMap::new()),
        }
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<PeerKey, Arc<PeerEntry>>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn aliases(&self) -> std::sync::MutexGuard<'_, HashMap<String, Alias>> {
        self.aliases.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The peer at `addr` (`host:port`, any spelling), creating its entry on first use.
    pub async fn peer(&self, addr: &str) -> Result<Arc<PeerEntry>, PeerError> {
        let spelled = PeerAddr::parse(addr)?;
        let spelling = spelled.to_string();
        if let Some(p) = self.by_alias(&spelling) {
            return Ok(p);
        }
        let socket = match spelled.socket() {
            Some(s) => s,
            None => resolve(&spelling).await?,
        };
        let resolved_at = spelled.socket().is_none().then(Instant::now);
        // The client dials the spelling: for an IP literal that is the canonical socket; a host
        // name is what a peer's certificate is verified for under mTLS. (A client connects
        // lazily: making one to find out which it is dials nothing.)
        let client = (self.connector)(&spelling)?;
        let pending = if client.authenticates() { PeerKey::Dialled(spelling.clone()) } else { PeerKey::Socket(canonical(socket)) };
        let entry = match self.get(&pending) {
            Some(e) => e,
            None => self.insert(PeerEntry::new(pending.clone(), spelling.clone(), client, self.tick()))?,
        };
        if !entry.client.authenticates() {
            self.alias(spelling, pending, resolved_at);
            return Ok(entry);
        }
        // mTLS: ask who answers there.
        entry.call(|| entry.client.ping()).await?;
        let name = entry.client.verified_identity().ok_or_else(|| PeerError::Protocol {
            addr: entry.addr.clone(),
            detail: "the peer answered but its certificate named no node".into(),
        })?;
        let key = PeerKey::Node(name.clone());
        let joined = {
            let mut map = self.map();
            if map.get(&pending).is_some_and(|e| Arc::ptr_eq(e, &entry)) {
                map.remove(&pending);
            }
            match map.get(&key) {
                Some(existing) => existing.clone(),
                None => {
                    entry.client.pin_identity(&name);
                    let named = Arc::new(PeerEntry::new(key.clone(), entry.addr.clone(), entry.client.clone(), self.tick()));
                    map.insert(key.clone(), named.clone());
                    named
                }
            }
        };
        m::peers(self.len());
        if !Arc::ptr_eq(&joined.client, &entry.client) {
            debug!(spelling = %spelling, peer = %key, "another spelling of a known peer; sharing its entry");
        }
        self.alias(spelling, key, resolved_at);
        Ok(joined)
    }

    /// The entry a known spelling maps to, if it is still there, still fresh and still the same
    /// peer.
    fn by_alias(&self, spelling: &str) -> Option<Arc<PeerEntry>> {
        let now = self.tick();
        let key = {
            let mut aliases = self.aliases();
            let a = aliases.get_mut(spelling)?;
            if a.resolved_at.is_some_and(|t| t.elapsed() >= NAME_TTL) {
                aliases.remove(spelling);
                return None;
            }
            a.last_used = now;
            a.key.clone()
        };
        let p = self.get(&key)?;
        if let (PeerKey::Node(name), Some(seen)) = (&p.key, p.client.verified_identity()) {
            if *name != seen {
                // The address now answers as another node: this entry's client refuses it, and
                // every spelling is looked up afresh.
                info!(peer = %p.key, now = %seen, "a peer's address is now another node's; forgetting its spellings");
                self.aliases().retain(|_, a| a.key != p.key);
                self.map().remove(&p.key);
                return None;
            }
        }
        p.last_used.store(now, Ordering::Relaxed);
        Some(p)
    }

    fn get(&self, key: &PeerKey) -> Option<Arc<PeerEntry>> {
        self.map().get(key).cloned()
    }

    fn alias(&self, spelling: String, key: PeerKey, resolved_at: Option<Instant>) {
        let now = self.tick();
        let mut aliases = self.aliases();
        if aliases.len() >= self.max_peers.saturating_mul(ALIASES_PER_PEER) && !aliases.contains_key(&spelling) {
            // A spelling holds nothing but the key: forgetting the least recently used one
            // costs its next caller one lookup.
            if let Some(oldest) = aliases.iter().min_by_key(|(_, a)| a.last_used).map(|(s, _)| s.clone()) {
                aliases.remove(&oldest);
            }
        }
        aliases.insert(spelling, Alias { key, last_used: now, resolved_at });
        m::peer_aliases(aliases.len());
    }

    /// Adds `entry`, evicting the least recently used unused entry at `limits.max_peers`.
    fn insert(&self, entry: PeerEntry) -> Result<Arc<PeerEntry>, PeerError> {
        let entry = Arc::new(entry);
        let (entry, evicted, size) = {
            let mut map = self.map();
            if let Some(p) = map.get(&entry.key) {
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
                    .map(|p| p.key.clone());
                match victim.and_then(|v| map.remove(&v)) {
                    Some(v) => evicted = Some(v),
                    None => return Err(PeerError::PoolFull { addr: entry.addr.clone(), max: self.max_peers }),
                }
            }
            map.insert(entry.key.clone(), entry.clone());
            (entry, evicted, map.len())
        };
        m::peers(size);
        if let Some(v) = evicted {
            debug!(peer = %v.key, "peer pool full (limits.max_peers): evicted the least recently used peer");
            m::peer_evicted();
            self.aliases().retain(|_, a| a.key != v.key);
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

    /// Tenants holding leased connections, summed over entries.
    pub fn lease_tenants(&self) -> usize {
        self.map().values().map(|p| p.tenants.tenants()).sum()
    }

    /// Spellings remembered (bounded by `limits.max_peers` × 4).
    pub fn alias_count(&self) -> usize {
        self.aliases().len()
    }

    pub fn list(&self) -> Vec<Arc<PeerEntry>> {
        let mut v: Vec<_> = self.map().values().cloned().collect();
        v.sort_by(|a, b| a.addr.cmp(&b.addr));
        v
    }

    /// A connection with `qps` QPs to `peer`: an idle one if healthy, else a new negotiation
    /// within the entry's connection bound. It counts, toward the tenant's share and the entry's
    /// bound, the QPs it holds (`qps` on each of its paths), not the `qps` asked.
    pub async fn lease(&self, peer: &Arc<PeerEntry>, qps: usize, depth: usize, tenant: &Tenant) -> Result<Lease, PeerError> {
        let (max_conns, max_streams) = self.bounds(peer);
        // What a new connection could hold; settled to what the one lent holds below.
        let most = self.fabric.connection_qps(qps);
        let mut charge = peer
            .tenants
            .charge(tenant, most, max_conns, max_streams, self.tenant_share)
            .map_err(|detail| PeerError::ConnectionLimit { addr: peer.addr.clone(), detail })?;
        let current = peer.identity.lock().map(|g| g.1.clone()).unwrap_or_default();
        let mut stale = Vec::new();
        let mut found = None;
        if let Ok(mut idle) = peer.idle.lock() {
            // A broken connection (e.g. the target closed its idle streams: the readers saw EOF),
            // one that lacks a path which is usable again (a device that was down when it was
            // made), or one to an earlier instance of the peer is never lent again.
            let (keep, drop): (Vec<PooledConn>, Vec<PooledConn>) =
                idle.drain(..).partition(|l| !l.conn.wants_reconnect() && l.instance_id == current);
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
            if let Some(ch) = charge.as_mut() {
                ch.settle(c.conn.qps());
            }
            return Ok(self.guard(peer, c, true, charge));
        }
        let held = self.make_room(peer, most).await?;
        let mut c = self.negotiate(peer, qps, depth, held).instrument(info_span!("peer", peer = %peer.addr)).await?;
        let real = c.conn.qps();
        c.held.settle(real);
        if let Some(ch) = charge.as_mut() {
            ch.settle(real);
        }
        Ok(self.guard(peer, c, false, charge))
    }

    /// Keeps a new connection of `qps` streams within `limits.max_connections_per_peer` and what
    /// the peer keeps for this agent: idle connections (oldest first) are closed to make room;
    /// with every connection leased, the new one is refused rather than opened past the bound.
    /// A connection closed to make room is disconnected at the peer before the new one is
    /// negotiated, so the peer's count has dropped by the time the new one reaches it. The new
    /// connection's place is taken in the same step as the check (under the idle list's lock),
    /// so concurrent leases cannot both pass it.
    async fn make_room(&self, peer: &Arc<PeerEntry>, qps: usize) -> Result<HeldConn, PeerError> {
        let (max_conns, max_streams) = self.bounds(peer);
        let fits = |p: &PeerEntry| {
            let (c, s) = p.held();
            c < max_conns && s.saturating_add(qps) <= max_streams
        };
        loop {
            let oldest = {
                let mut idle = peer.idle.lock().unwrap_or_else(|p| p.into_inner());
                if fits(peer) {
                    return Ok(HeldConn::new(&peer.held, qps));
                }
                (!idle.is_empty()).then(|| idle.remove(0))
            };
            match oldest {
                Some(l) => {
                    l.conn.close();
                    peer.client.disconnect(&l.connection_id, &self.home.node_name).await;
                    drop(l);
                    update_gauge(peer);
                }
                None => {
                    let (c, s) = peer.held();
                    return Err(PeerError::ConnectionLimit {
                        addr: peer.addr.clone(),
                        detail: format!(
                            "{c} connections ({s} streams) to this peer are in use; at most {max_conns} connections{} \
                             (limits.max_connections_per_peer, and what the peer keeps for this agent)",
                            if max_streams == usize::MAX { String::new() } else { format!(" and {max_streams} streams") }
                        ),
                    });
                }
            }
        }
    }

    fn guard(&self, peer: &Arc<PeerEntry>, c: PooledConn, reused: bool, charge: Option<super::tenancy::LeaseCharge>) -> Lease {
        Lease { inner: Some(c), reused, peer: peer.clone(), home: self.home.clone(), _charge: charge }
    }

    /// The most connections and streams this agent keeps to `peer`: its own bound and what the
    /// peer advertised (`usize::MAX` streams: no bound).
    fn bounds(&self, peer: &PeerEntry) -> (usize, usize) {
        let (their_conns, their_streams) = *peer.advertised.lock().unwrap_or_else(|p| p.into_inner());
        let max_conns = match their_conns as usize {
            0 => self.max_connections,
            n => n.min(self.max_connections),
        };
        let max_streams = match their_streams as usize {
            0 => usize::MAX,
            n => n,
        };
        (max_conns, max_streams)
    }

    /// A new connection, counted (`held`, from `make_room`) from before the handshake.
    async fn negotiate(&self, peer: &Arc<PeerEntry>, qps: usize, depth: usize, held: HeldConn) -> Result<PooledConn, PeerError> {
        let started = Instant::now();
        let (tx, rx) = mpsc::unbounded_channel();
        let fabric_err = |source| PeerError::Fabric { addr: peer.addr.clone(), source };
        let connection_id = ConnectionId::random();
        let pending = self.fabric.prepare(&peer.addr, &connection_id, qps, depth, tx).await.map_err(fabric_err)?;
        let prepared = Instant::now();
        m::connect_phase("prepare", prepared - started);
        let endpoints = pending.local_endpoints();
        let node_name = &self.home.node_name;
        // From the handshake on, the peer may hold the connection: however this ends short of a
        // connection (an error after the peer answered, or this future dropped: a transfer
        // cancelled or out of time while it resumes, a submit whose caller went away), the peer
        // is told to forget it. A handshake the peer refused left nothing there.
        let mut forget = Forget { peer: Some(peer.clone()), id: connection_id.clone(), me: node_name.clone() };
        let reply = match peer.call(|| peer.client.handshake(node_name, self.fabric.kind(), endpoints.clone(), &connection_id)).await {
            Ok(r) => r,
            Err(e) => {
                forget.peer = None;
                return Err(e);
            }
        };
        let shaken = Instant::now();
        m::connect_phase("handshake", shaken - prepared);
        if let Ok(mut a) = peer.advertised.lock() {
            *a = (reply.max_connections, reply.max_streams);
        }
        if reply.fabric != self.fabric.kind() {
            return Err(fabric_err(FabricError::Negotiation {
                step: "connect",
                attr: "fabric",
                detail: format!("peer runs {} but this agent runs {}", reply.fabric, self.fabric.kind()),
            }));
        }
        let conn = pending.complete(&reply.endpoints).await.map_err(fabric_err)?;
        forget.peer = None;
        m::connect_phase("complete", shaken.elapsed());
        peer.observe(&reply.node_name, &reply.instance_id);
        let took = started.elapsed();
        m::connect_duration(took);
        if let Ok(mut l) = peer.last_connect.lock() {
            *l = Some(took);
        }
        debug!(peer = %peer.addr, qps, ?took, "connection negotiated");
        update_gauge(peer);
        Ok(PooledConn { conn, completions: rx, connection_id, qps, depth, instance_id: reply.instance_id, held })
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

/// Tells the peer to forget a connection whose negotiation did not finish (see
/// [`PeerPool::negotiate`]), in the background, unless its `peer` was taken.
struct Forget {
    peer: Option<Arc<PeerEntry>>,
    id: ConnectionId,
    me: String,
}

impl Drop for Forget {
    fn drop(&mut self) {
        let Some(peer) = self.peer.take() else { return };
        // No runtime left (at exit): the peer drops the connection with this agent's sessions.
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let (id, me) = (self.id.clone(), std::mem::take(&mut self.me));
        rt.spawn(async move { peer.client.disconnect(&id, &me).await });
    }
}

/// The first address `spelling` (a host name) resolves to.
async fn resolve(spelling: &str) -> Result<SocketAddr, PeerError> {
    let unreachable = |detail: String| PeerError::Unreachable { addr: spelling.to_string(), detail };
    match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host(spelling)).await {
        Err(_) => Err(unreachable(format!("resolving the name took over {} s", RESOLVE_TIMEOUT.as_secs()))),
        Ok(Err(e)) => Err(unreachable(format!("cannot resolve the name: {e}"))),
        Ok(Ok(mut addrs)) => addrs.next().ok_or_else(|| unreachable("the name resolves to no address".into())),
    }
}
