//! Connection pool per peer agent: the gRPC client, negotiated fabric connections, reuse, and
//! recreation after errors or a peer restart.
//!
//! A transfer *leases* a whole connection (its QPs and its completion queue) for its lifetime, so
//! completions need no demultiplexing and each QP's send queue is bounded by one transfer's
//! `depth`. Concurrent transfers to one peer get separate connections; finished, healthy and
//! drained connections go back to a bounded idle list. A connection is never reused after an error
//! (`is_broken`), after a cancelled transfer left WRs outstanding, or when the peer's instance id
//! changed (it restarted: its QPs and listeners are gone).
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::{debug, info, info_span, Instrument};

use crate::fabric::{Completion, Connection, Endpoint, Fabric, FabricError, FabricKind};
use crate::metrics as m;
use crate::service::client::PeerClient;
use crate::service::tls::TlsMaterial;

/// Coarse class of a remote error, mirrored from the peer's gRPC status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteCode {
    NotFound,
    InvalidArgument,
    PermissionDenied,
    FailedPrecondition,
    ResourceExhausted,
    Unavailable,
    DeadlineExceeded,
    Other,
}

#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("invalid peer address {0:?}")]
    BadAddress(String),
    #[error("peer {addr} is unreachable: {detail}")]
    Unreachable { addr: String, detail: String },
    #[error("peer {addr}: {message}")]
    Remote { addr: String, code: RemoteCode, message: String },
    #[error("peer {addr} sent an invalid reply: {detail}")]
    Protocol { addr: String, detail: String },
    #[error("connecting to peer {addr} failed: {source}")]
    Fabric { addr: String, source: FabricError },
}

/// Result of the responder's half of `Peer.Connect`.
#[derive(Debug, Clone)]
pub struct HandshakeReply {
    pub node_name: String,
    pub instance_id: String,
    pub fabric: FabricKind,
    pub endpoints: Vec<Endpoint>,
}

/// A connection leased by one transfer.
pub struct Lease {
    pub conn: Arc<dyn Connection>,
    pub completions: mpsc::UnboundedReceiver<Completion>,
    pub connection_id: String,
    pub qps: usize,
    pub depth: usize,
    instance_id: String,
}

/// One peer agent, by the address transfers name it with.
pub struct PeerEntry {
    pub addr: String,
    pub client: PeerClient,
    /// Node name and instance id learned from the last Connect/Grant. std Mutex: no awaits held.
    identity: Mutex<(String, String)>,
    idle: Mutex<Vec<Lease>>,
    pub last_connect: Mutex<Option<Duration>>,
}

impl PeerEntry {
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

    pub fn idle_count(&self) -> usize {
        self.idle.lock().map(|i| i.len()).unwrap_or(0)
    }
}

pub struct PeerPool {
    fabric: Arc<dyn Fabric>,
    node_name: String,
    /// mTLS for the gRPC clients to peers (None = plaintext).
    tls: Option<Arc<TlsMaterial>>,
    max_idle_per_peer: usize,
    /// addr → peer. std Mutex: map operations only.
    peers: Mutex<HashMap<String, Arc<PeerEntry>>>,
}

impl PeerPool {
    pub fn new(fabric: Arc<dyn Fabric>, node_name: String, tls: Option<Arc<TlsMaterial>>) -> Self {
        PeerPool { fabric, node_name, tls, max_idle_per_peer: 8, peers: Mutex::new(HashMap::new()) }
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<PeerEntry>>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The peer at `addr` (host:port), creating its gRPC client on first use.
    pub fn peer(&self, addr: &str) -> Result<Arc<PeerEntry>, PeerError> {
        if let Some(p) = self.map().get(addr) {
            return Ok(p.clone());
        }
        let client = PeerClient::new(addr, self.tls.as_deref())?;
        let entry = Arc::new(PeerEntry {
            addr: addr.to_string(),
            client,
            identity: Mutex::new((String::new(), String::new())),
            idle: Mutex::new(Vec::new()),
            last_connect: Mutex::new(None),
        });
        Ok(self.map().entry(addr.to_string()).or_insert(entry).clone())
    }

    pub fn list(&self) -> Vec<Arc<PeerEntry>> {
        let mut v: Vec<_> = self.map().values().cloned().collect();
        v.sort_by(|a, b| a.addr.cmp(&b.addr));
        v
    }

    /// A connection with `qps` QPs to `peer`: an idle one if healthy, else a new negotiation.
    pub async fn lease(&self, peer: &Arc<PeerEntry>, qps: usize, depth: usize) -> Result<Lease, PeerError> {
        let current = peer.identity.lock().map(|g| g.1.clone()).unwrap_or_default();
        if let Ok(mut idle) = peer.idle.lock() {
            idle.retain(|l| !l.conn.is_broken() && l.instance_id == current);
            if let Some(pos) = idle.iter().position(|l| l.qps == qps && l.depth >= depth) {
                return Ok(idle.swap_remove(pos));
            }
        }
        self.negotiate(peer, qps, depth).instrument(info_span!("peer", peer = %peer.addr)).await
    }

    async fn negotiate(&self, peer: &Arc<PeerEntry>, qps: usize, depth: usize) -> Result<Lease, PeerError> {
        let started = Instant::now();
        let (tx, rx) = mpsc::unbounded_channel();
        let fabric_err = |source| PeerError::Fabric { addr: peer.addr.clone(), source };
        let pending = self.fabric.prepare(&peer.addr, qps, depth, tx).await.map_err(fabric_err)?;
        let connection_id = crate::regions::new_id();
        let reply = peer
            .client
            .handshake(&self.node_name, self.fabric.kind(), pending.local_endpoints(), &connection_id)
            .await?;
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
                let me = self.node_name.clone();
                tokio::spawn(async move { client.disconnect(&id, &me).await });
                return Err(fabric_err(e));
            }
        };
        peer.observe(&reply.node_name, &reply.instance_id);
        let took = started.elapsed();
        m::connect_duration(took);
        if let Ok(mut l) = peer.last_connect.lock() {
            *l = Some(took);
        }
        debug!(peer = %peer.addr, qps, ?took, "connection negotiated");
        self.update_gauge(peer, qps);
        Ok(Lease { conn, completions: rx, connection_id, qps, depth, instance_id: reply.instance_id })
    }

    /// Returns a lease. `clean` means every WR it posted has completed successfully.
    pub fn release(&self, peer: &Arc<PeerEntry>, mut lease: Lease, clean: bool) {
        // Completions that arrived after the transfer stopped listening belong to no one.
        while lease.completions.try_recv().is_ok() {}
        let reusable = clean && !lease.conn.is_broken();
        if reusable {
            if let Ok(mut idle) = peer.idle.lock() {
                if idle.len() < self.max_idle_per_peer {
                    idle.push(lease);
                    return;
                }
            }
        }
        self.discard(peer, lease);
    }

    fn discard(&self, peer: &Arc<PeerEntry>, lease: Lease) {
        lease.conn.close();
        let client = peer.client.clone();
        let me = self.node_name.clone();
        tokio::spawn(async move { client.disconnect(&lease.connection_id, &me).await });
        self.update_gauge(peer, 0);
    }

    fn update_gauge(&self, peer: &Arc<PeerEntry>, _qps: usize) {
        let name = peer.node_name();
        let label = if name.is_empty() { peer.addr.clone() } else { name };
        let idle_qps: usize = peer.idle.lock().map(|i| i.iter().map(|l| l.qps).sum()).unwrap_or(0);
        m::qp_connections(&label, "idle", idle_qps);
    }

    /// Closes every idle connection (shutdown).
    pub fn close_all(&self) {
        for p in self.list() {
            let drained: Vec<Lease> = p.idle.lock().map(|mut i| i.drain(..).collect()).unwrap_or_default();
            for l in drained {
                self.discard(&p, l);
            }
        }
    }
}
