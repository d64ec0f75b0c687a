//! The agent's core: regions, grants, transfers, peers and the fabric, and the operations the
//! gRPC services expose (in domain types). `service` converts protobuf to these calls and back.
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, info_span, warn, Instrument};

use crate::checksum::{self, Algo};
use crate::config::Config;
use crate::fabric::{
    Accepted, Endpoint, ExposeRequest, Fabric, FabricError, FabricKind, GrantMode, Registration, RemoteOp, WorkRequest, WrOp,
};
use crate::grants::{Grant, GrantError, GrantTable};
use crate::metrics as m;
use crate::peers::{Lease, PeerEntry, PeerError, PeerPool, RemoteCode};
use crate::service::tls::TlsMaterial;
use crate::regions::{new_id, RegionPolicy, RegionRegistry, RegionUse};
use crate::service::client::{CompleteParams, GrantAsk, GrantInfo};
use crate::transfer::driver::{pump, LatencyProbe};
use crate::transfer::machine::{Failure, Machine, MachineConfig, State};
use crate::transfer::{Op, TransferError, TransferHandle, TransferRecord, TransferRegistry, TransferRequest, TransferState};
use xfer_rdma::memory::RegionMemory;

/// What `Peer.Grant` asks for, in domain terms.
#[derive(Debug, Clone)]
pub struct GrantParams {
    pub region: String,
    pub offset: u64,
    /// 0 = the rest of the region
    pub length: u64,
    pub op: RemoteOp,
    pub ttl: Option<Duration>,
    pub peer: String,
    /// The grantee's connection to bind the grant to (`GrantRequest.connection_id`). Grant mode
    /// `mw` on verbs needs it: the windows are bound on that connection's QPs.
    pub connection_id: Option<String>,
}

#[derive(Debug, Clone)]
pub struct BenchParams {
    pub peer: String,
    pub op: Op,
    pub size: u64,
    pub iters: u32,
    pub qps: usize,
    pub depth: usize,
}

#[derive(Debug, Clone, Default)]
pub struct BenchResult {
    pub size: u64,
    pub iters: u32,
    pub bytes: u64,
    pub seconds: f64,
    pub lat_avg_us: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub lat_iters: u32,
}

/// (peer identity, keepalive of the responder's QPs or data session; `mw` grants bind windows
/// on them, tcp grants work only on its streams)
/// An accepted connection: its owner (the caller's identity), the responder half, and when it was
/// accepted (a sequence number: lower is older).
type AcceptedConn = (String, Arc<dyn Accepted>, u64);

/// Responder halves one peer identity may hold; connecting more evicts one of them.
const MAX_CONNECTIONS_PER_PEER: usize = 256;

pub struct Node {
    pub config: Config,
    pub fabric: Arc<dyn Fabric>,
    pub fabric_reason: String,
    pub regions: RegionRegistry,
    pub grants: Arc<GrantTable>,
    /// Transfers this agent initiated.
    pub transfers: TransferRegistry,
    /// Transfers peers completed into this agent (`Peer.Complete`), by `PEER/ID`.
    inbound: TransferRegistry,
    pub peers: PeerPool,
    pub started: Instant,
    /// Random per start: peers use it to notice this agent restarted.
    pub instance_id: String,
    /// Responder halves of connections, by connection id (peer node, keepalive).
    accepted: Mutex<HashMap<String, AcceptedConn>>,
    /// Orders `accepted` by age (eviction takes the oldest).
    accept_seq: std::sync::atomic::AtomicU64,
    /// Cancelled on SIGTERM: refuse new transfers.
    pub draining: CancellationToken,
    /// Submits past the limit check that have not inserted their record yet, by peer address.
    /// Counted with the active transfers so concurrent submits cannot overshoot the limits.
    submitting: Mutex<HashMap<String, usize>>,
    /// Background revocations of peer grants in flight; `drain` waits for them.
    pending_revokes: Arc<AtomicUsize>,
    /// Admin calls (`Bench`, `TcpBaseline`) run one at a time.
    admin_slot: Arc<tokio::sync::Semaphore>,
    /// One `Peer.OpenSink` at a time; its task holds the permit until the sink closes.
    sink_slot: Arc<tokio::sync::Semaphore>,
    /// The scratch region of the benchmark running against this agent, and its owner.
    bench_region: Mutex<Option<(String, String)>>,
}

/// Finished transfers remembered per direction. Every field of a record is bounded (ids 64
/// bytes, names 253), so both histories together stay far below `limits.max_message_size` in one
/// `ListTransfers` answer.
pub const TRANSFER_HISTORY: usize = 1000;

/// Each sink connection's read buffer.
const SINK_BUFFER: usize = 256 << 10;
/// A sink waits this long for each baseline connection.
const SINK_ACCEPT_WITHIN: Duration = Duration::from_secs(10);
/// A sink closes after this, whatever its state.
const SINK_LIFETIME: Duration = Duration::from_secs(120);
/// Largest TCP baseline send buffer.
const BASELINE_MAX_BLOCK: u64 = 16 << 20;
/// A benchmark's scratch region on the target is reaped after this at the latest.
const BENCH_REGION_TTL: Duration = Duration::from_secs(600);

/// A submit's slot under `limits.max_transfers` and `max_transfers_per_peer`, held from the
/// limit check until the transfer's record is in the registry (which then counts it).
struct SubmitSlot<'a> {
    node: &'a Node,
    peer: String,
}

impl Drop for SubmitSlot<'_> {
    fn drop(&mut self) {
        let mut m = self.node.submitting.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.peer);
            }
        }
    }
}

impl Node {
    /// `tls`: the agent's mTLS material for its calls to peers (None = plaintext).
    pub fn new(
        config: Config,
        fabric: Arc<dyn Fabric>,
        fabric_reason: String,
        grants: Arc<GrantTable>,
        tls: Option<Arc<TlsMaterial>>,
    ) -> Arc<Node> {
        let mut policy = RegionPolicy::new(config.regions.effective_file_roots(&config.state_dir));
        policy.shm_mode = config.regions.shm_mode.0;
        // Both were checked by Config::validate; a failure here keeps the private defaults.
        policy.shm_gid = config.regions.shm_gid().unwrap_or(None);
        if let Ok(uid) = config.regions.shm_owner_uid() {
            policy.shm_owner = uid;
        }
        let regions = RegionRegistry::new(
            fabric.clone(),
            config.state_dir.clone(),
            crate::regions::RegionLimits {
                max_regions: config.limits.max_regions,
                max_registered_bytes: config.limits.max_registered_bytes.0,
            },
            policy,
        );
        let peers = PeerPool::new(fabric.clone(), config.node_name.clone(), tls, config.limits.max_peers);
        Arc::new(Node {
            regions,
            grants,
            transfers: TransferRegistry::new(TRANSFER_HISTORY),
            inbound: TransferRegistry::new(TRANSFER_HISTORY),
            peers,
            started: Instant::now(),
            instance_id: new_id(),
            accepted: Mutex::new(HashMap::new()),
            accept_seq: std::sync::atomic::AtomicU64::new(0),
            draining: CancellationToken::new(),
            submitting: Mutex::new(HashMap::new()),
            pending_revokes: Arc::new(AtomicUsize::new(0)),
            admin_slot: Arc::new(tokio::sync::Semaphore::new(1)),
            sink_slot: Arc::new(tokio::sync::Semaphore::new(1)),
            bench_region: Mutex::new(None),
            fabric,
            fabric_reason,
            config,
        })
    }

    /// Background housekeeping: region leases and grant expiry.
    pub fn spawn_reapers(self: &Arc<Self>, shutdown: CancellationToken) {
        let node = self.clone();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let now = SystemTime::now();
                node.grants.reap(now);
                // Catalog writes fsync: off the reactor.
                let n = node.clone();
                let expired = tokio::task::spawn_blocking(move || n.regions.reap_expired(now)).await.unwrap_or_default();
                for r in expired {
                    node.grants.revoke_region(&r.id);
                }
            }
        });
        // Regions the catalog has but that could not be restored (file missing, owner mismatch,
        // ...) come back as soon as they can: retried every `regions.retry_interval`.
        let node = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(node.config.regions.retry_interval.0);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let n = node.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    n.regions.retry_unavailable();
                    n.regions.retry_dirty_catalog();
                })
                .await;
            }
        });
    }

    pub fn delete_region(&self, name: &str) -> Result<(), crate::regions::RegionError> {
        let Some(r) = self.regions.delete(name)? else {
            // An unavailable region: never registered, so no grants.
            return Ok(());
        };
        let n = self.grants.revoke_region(&r.id);
        if n > 0 {
            info!(region = %name, grants = n, "revoked grants of deleted region");
        }
        Ok(())
    }

    // ------------------------------------------------------------------ Peer side

    pub async fn accept_connection(
        &self,
        peer: &str,
        connection_id: &str,
        fabric: FabricKind,
        endpoints: &[Endpoint],
    ) -> Result<Vec<Endpoint>, FabricError> {
        if fabric != self.fabric.kind() {
            return Err(FabricError::Negotiation {
                step: "connect",
                attr: "fabric",
                detail: format!("initiator runs {fabric}, this agent runs {}", self.fabric.kind()),
            });
        }
        let taken = || FabricError::Negotiation {
            step: "connect",
            attr: "connection_id",
            detail: format!("connection {connection_id:?} already exists on this agent"),
        };
        // An id is never reused: another caller's connection must not be replaced by naming it.
        if self.accepted.lock().unwrap_or_else(|e| e.into_inner()).contains_key(connection_id) {
            return Err(taken());
        }
        let (mine, keep) = self.fabric.accept(peer, connection_id, endpoints).await?;
        let seq = self.accept_seq.fetch_add(1, Ordering::Relaxed);
        let (evicted, total) = {
            let mut acc = self.accepted.lock().unwrap_or_else(|e| e.into_inner());
            if acc.contains_key(connection_id) {
                return Err(taken());
            }
            // Bound per-peer state: a peer that never disconnects (one that crashed, or leaks)
            // cannot grow it without limit. Only a connection that holds no grant is evicted,
            // the oldest first: evicting one in use would revoke a running transfer's grants.
            let mut evicted = None;
            let from_peer = acc.values().filter(|v| v.0 == peer).count();
            if from_peer >= MAX_CONNECTIONS_PER_PEER {
                let idle = acc
                    .iter()
                    .filter(|(k, v)| v.0 == peer && !self.grants.has_connection(k))
                    .min_by_key(|(_, v)| v.2)
                    .map(|(k, _)| k.clone());
                match idle {
                    Some(k) => evicted = acc.remove_entry(&k),
                    None => {
                        return Err(FabricError::Negotiation {
                            step: "connect",
                            attr: "connections",
                            detail: format!(
                                "{peer} already has {from_peer} connections to this agent, each with a live grant \
                                 (limit {MAX_CONNECTIONS_PER_PEER} per peer)"
                            ),
                        });
                    }
                }
            }
            acc.insert(connection_id.to_string(), (peer.to_string(), Arc::from(keep), seq));
            (evicted, acc.len())
        };
        m::accepted_connections(total);
        if let Some((id, _)) = evicted {
            let n = self.grants.revoke_connection(&id);
            warn!(peer, connection = %id, grants = n, "evicted the oldest idle connection of a peer that never disconnected it (limit {MAX_CONNECTIONS_PER_PEER} per peer)");
        }
        Ok(mine)
    }

    /// Drops the responder half of a connection and revokes the grants asked for on it, if the
    /// peer `owner` made it.
    pub fn disconnect(&self, connection_id: &str, owner: &str) {
        let removed = {
            let mut acc = self.accepted.lock().unwrap_or_else(|e| e.into_inner());
            let removed = if acc.get(connection_id).is_some_and(|c| c.0 == owner) { acc.remove(connection_id) } else { None };
            m::accepted_connections(acc.len());
            removed
        };
        // Dropped outside the lock: a tcp session closes its streams, verbs tears QPs down.
        let removed = removed.is_some();
        if removed {
            let n = self.grants.revoke_connection(connection_id);
            if n > 0 {
                info!(connection = %connection_id, grants = n, "peer disconnected; revoked its grants on that connection");
            }
        }
    }

    pub async fn grant(&self, p: &GrantParams) -> Result<Arc<Grant>, TransferError> {
        let region = self.regions.get(&p.region)?;
        if !region.access.allows(p.op) {
            return Err(TransferError::PermissionDenied(format!(
                "region {:?} has access {:?}; remote {} is not allowed",
                region.name, region.access, p.op
            )));
        }
        if p.offset > region.length {
            return Err(TransferError::Invalid(format!(
                "offset {} is beyond the end of region {:?} ({} bytes)",
                p.offset, region.name, region.length
            )));
        }
        let length = if p.length == 0 { region.length - p.offset } else { p.length };
        if length == 0 {
            return Err(TransferError::Invalid(format!("nothing to grant: offset {} is the end of region {:?}", p.offset, region.name)));
        }
        region.check_range(p.offset, length)?;
        let ttl = p.ttl.filter(|t| !t.is_zero()).unwrap_or(self.config.grants.default_ttl.0).min(self.config.grants.max_ttl.0);
        let expires_at = SystemTime::now() + ttl;
        let mode = self.config.verbs.grant_mode;
        let connection = self.grant_connection(p)?;
        if self.grant_needs_connection() && connection.is_none() {
            return Err(TransferError::FailedPrecondition(if self.fabric.kind() == FabricKind::Tcp {
                "tcp grants are bound to a data connection: the grant request must name a connection the \
                 caller made with Peer.Connect (connection_id)"
                    .into()
            } else {
                "this agent grants with memory windows (verbs.grant_mode = mw), which are bound to the \
                 grantee's QPs: the grant request must name a connection the caller made with Peer.Connect \
                 (connection_id)"
                    .into()
            }));
        }
        let bound_to = connection.clone();
        let req = ExposeRequest { offset: p.offset, len: length, op: p.op, expires_at, peer: p.peer.clone(), mode, connection };
        let exposure = self
            .fabric
            .expose(&region.registration, &req)
            .await
            .map_err(|e| TransferError::Internal(format!("exposing region {:?}: {e}", region.name)))?;
        let grant = Grant {
            id: new_id(),
            region,
            peer: p.peer.clone(),
            offset: p.offset,
            len: length,
            op: p.op,
            expires_at,
            exposure,
            connection_id: p.connection_id.clone().filter(|c| !c.is_empty()),
            lease: crate::fabric::tcp::GrantLease::new(expires_at),
        };
        let grant = self.grants.insert(grant)?;
        // A DeleteRegion (or lease expiry) that ran since the lookup above revoked the region's
        // grants before this one existed: re-check that the very same region is still live, or
        // the grant would outlive it (its token writing into a region nobody can see or delete).
        let region_live = matches!(self.regions.describe(&grant.region.name), Ok(crate::regions::RegionView::Live(r)) if Arc::ptr_eq(&r, &grant.region));
        if !region_live {
            self.grants.revoke(&grant.id);
            return Err(TransferError::Region(crate::regions::RegionError::NotFound(grant.region.name.clone())));
        }
        // A Disconnect (or an eviction) that ran since `grant_connection` looked the connection up
        // revoked the connection's grants before this one existed: re-check that the very same
        // connection is still there, or the grant would outlive it and work on the streams of
        // whichever connection next takes that id (ids are chosen by callers).
        if let (Some(id), Some(conn)) = (grant.connection_id.as_deref(), bound_to) {
            let live = self
                .accepted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(id)
                .is_some_and(|(owner, c, _)| *owner == p.peer && Arc::ptr_eq(c, &conn));
            if !live {
                self.grants.revoke(&grant.id);
                return Err(TransferError::FailedPrecondition(format!("connection {id:?} was closed while the grant was made")));
            }
        }
        Ok(grant)
    }

    /// The accepted connection a grant names. It must have been made by the grant's peer
    /// (PERMISSION_DENIED otherwise). An unknown id is an error only where the grant needs the
    /// connection (`mw` on verbs); other modes do not use it.
    fn grant_connection(&self, p: &GrantParams) -> Result<Option<Arc<dyn Accepted>>, TransferError> {
        let Some(id) = p.connection_id.as_deref().filter(|s| !s.is_empty()) else { return Ok(None) };
        let acc = self.accepted.lock().unwrap_or_else(|e| e.into_inner());
        match acc.get(id) {
            Some((owner, conn, _)) if *owner == p.peer => Ok(Some(conn.clone())),
            Some(_) => Err(TransferError::PermissionDenied(format!("connection {id:?} was made by another peer"))),
            None if self.grant_needs_connection() => {
                Err(TransferError::FailedPrecondition(format!(
                    "no connection {id:?} from this peer (closed, or made with an earlier instance of this agent)"
                )))
            }
            None => Ok(None),
        }
    }

    /// Grants that only work on the grantee's connection: tcp tokens (checked per data stream)
    /// and verbs memory windows (bound on its QPs).
    fn grant_needs_connection(&self) -> bool {
        match self.fabric.kind() {
            FabricKind::Tcp => true,
            FabricKind::Verbs => self.config.verbs.grant_mode == GrantMode::Mw,
        }
    }

    pub fn revoke(&self, grant_id: &str, peer: &str) -> Result<(), GrantError> {
        let g = self.grants.get(grant_id, peer, SystemTime::UNIX_EPOCH)?;
        self.grants.revoke(&g.id);
        Ok(())
    }

    /// `Peer.Complete`: the initiator says the data landed (or was read). Verifies the checksum
    /// when one is sent, records an inbound transfer, and revokes the grant.
    pub async fn complete_inbound(
        &self,
        transfer_id: &str,
        grant_id: &str,
        peer: &str,
        bytes: u64,
        op_write: bool,
        checksum: Option<(Algo, u64)>,
    ) -> Result<Option<(bool, u64)>, TransferError> {
        if !crate::regions::valid_wire_id(transfer_id) {
            return Err(TransferError::Invalid("transfer_id must be 1-64 characters from [A-Za-z0-9_.-]".into()));
        }
        let g = self.grants.get(grant_id, peer, SystemTime::now())?;
        // Inbound records are their own namespace, keyed by the authenticated peer: `PEER/ID` can
        // never name an outbound transfer (whose ids have no '/') or another peer's record.
        let record_id = format!("{peer}/{transfer_id}");
        if self.inbound.get(&record_id).is_ok() {
            return Err(TransferError::AlreadyExists(format!("transfer {transfer_id:?} from {peer} was already completed")));
        }
        if bytes > g.len {
            return Err(TransferError::Invalid(format!("{bytes} bytes exceed the grant's {} bytes", g.len)));
        }
        let verdict = match checksum {
            Some((algo, expected)) => {
                let mem = g.region.memory.clone();
                let off = g.offset;
                let got = tokio::task::spawn_blocking(move || checksum::checksum(&mem, off, bytes, algo))
                    .await
                    .map_err(|e| TransferError::Internal(e.to_string()))?
                    .map_err(|e| TransferError::Region(g.region.mem_error(e)))?;
                Some((got == expected, got))
            }
            None => None,
        };
        let op = if op_write { Op::Write } else { Op::Read };
        let now = SystemTime::now();
        let ok = verdict.is_none_or(|v| v.0);
        let rec = TransferRecord {
            id: record_id.clone(),
            op,
            local_region: g.region.name.clone(),
            local_offset: g.offset,
            remote_agent: String::new(),
            remote_region: String::new(),
            remote_offset: 0,
            length: bytes,
            state: if ok { TransferState::Succeeded } else { TransferState::Failed },
            bytes_done: bytes,
            error: (!ok).then(|| "checksum mismatch".to_string()),
            error_code: (!ok).then(|| "CHECKSUM_MISMATCH".to_string()),
            created_at: now,
            started_at: Some(now),
            finished_at: Some(now),
            elapsed: Duration::ZERO,
            verified: verdict.is_some_and(|v| v.0),
            checksum: verdict.map(|v| v.1),
            peer: peer.to_string(),
            inbound: true,
        };
        if self.inbound.insert_new(rec).is_none() {
            // A concurrent Complete with the same id won: it keeps its record and the grant.
            return Err(TransferError::AlreadyExists(format!("transfer {transfer_id:?} from {peer} was already completed")));
        }
        m::transfer_bytes(if op_write { "inbound_write" } else { "inbound_read" }, peer, bytes);
        self.grants.revoke(&g.id);
        Ok(verdict)
    }

    /// `Peer.OpenSink`: a one-shot listener that reads and discards, for the raw TCP baseline.
    /// Bounded like the admin calls that use it: one sink at a time per agent, its buffers
    /// counted against `max_registered_bytes`, [`SINK_ACCEPT_WITHIN`] to connect and
    /// [`SINK_LIFETIME`] in all.
    pub async fn open_sink(&self, local_ip: std::net::IpAddr, connections: u32) -> Result<SocketAddr, TransferError> {
        let n = connections.clamp(1, 64);
        let slot = self.sink_slot.clone().try_acquire_owned().map_err(|_| {
            TransferError::Limit("a TCP baseline sink is already open on this agent (one at a time)".into())
        })?;
        let reservation = self.regions.reserve(n as u64 * SINK_BUFFER as u64, "TCP baseline sink buffers")?;
        let listener = TcpListener::bind(SocketAddr::new(local_ip, 0))
            .await
            .map_err(|e| TransferError::Internal(format!("opening sink: {e}")))?;
        let addr = listener.local_addr().map_err(|e| TransferError::Internal(format!("opening sink: {e}")))?;
        tokio::spawn(async move {
            let _held = (slot, reservation);
            let work = async {
                let mut tasks = Vec::new();
                for _ in 0..n {
                    let (mut s, _) = tokio::time::timeout(SINK_ACCEPT_WITHIN, listener.accept())
                        .await
                        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no baseline connection in time"))??;
                    tasks.push(tokio::spawn(async move {
                        let mut buf = vec![0u8; SINK_BUFFER];
                        while s.read(&mut buf).await.map(|k| k > 0).unwrap_or(false) {}
                        let _ = s.shutdown().await;
                    }));
                }
                drop(listener);
                for t in tasks {
                    let _ = t.await;
                }
                Ok::<(), std::io::Error>(())
            };
            match tokio::time::timeout(SINK_LIFETIME, work).await {
                Err(_) => warn!("tcp baseline sink reached its lifetime; closed"),
                Ok(Err(e)) => debug!(error = %e, "tcp baseline sink closed"),
                Ok(Ok(())) => {}
            }
        });
        Ok(addr)
    }

    /// `Peer.OpenBenchRegion`: the target side of a benchmark, a scratch region for `owner`. One
    /// at a time per agent; the region counts against the region limits and its lease ends after
    /// [`BENCH_REGION_TTL`] even if the caller never closes it.
    pub fn open_bench_region(&self, owner: &str, length: u64) -> Result<String, TransferError> {
        if length == 0 || length > crate::fabric::frame::MAX_PAYLOAD as u64 {
            return Err(TransferError::Invalid(format!("bench size must be 1..={} bytes", crate::fabric::frame::MAX_PAYLOAD)));
        }
        let mut slot = self.bench_region.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((name, _)) = slot.as_ref() {
            if self.regions.get(name).is_ok() {
                return Err(TransferError::Limit("a benchmark against this agent is already running (one at a time)".into()));
            }
        }
        let name = format!("xfer-bench-{}", new_id());
        self.regions.create(crate::regions::RegionSpec {
            name: name.clone(),
            length,
            kind: crate::regions::RegionKind::Anonymous,
            path: None,
            access: crate::fabric::Access::ReadWrite,
            hugepages: false,
            ttl: Some(BENCH_REGION_TTL),
            labels: [("xfer.io/scratch".to_string(), "bench".to_string()), ("xfer.io/owner".to_string(), owner.to_string())].into(),
            adopt_existing: false,
        })?;
        *slot = Some((name.clone(), owner.to_string()));
        Ok(name)
    }

    /// `Peer.CloseBenchRegion`: deletes the caller's scratch region (no-op for anything else).
    pub fn close_bench_region(&self, owner: &str, name: &str) -> Result<(), TransferError> {
        let mut slot = self.bench_region.lock().unwrap_or_else(|e| e.into_inner());
        match slot.as_ref() {
            Some((n, o)) if n == name && o == owner => {
                let n = n.clone();
                *slot = None;
                drop(slot);
                match self.delete_region(&n) {
                    Ok(()) | Err(crate::regions::RegionError::NotFound(_)) => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
            _ => Err(crate::regions::RegionError::NotFound(name.to_string()).into()),
        }
    }

    // ------------------------------------------------------------------ Initiator side

    /// Validates a transfer, obtains the peer's grant and starts it. Bad input fails here with a
    /// clear error; failures after this point are reported in the transfer record.
    pub async fn submit(self: &Arc<Self>, req: TransferRequest) -> Result<TransferRecord, TransferError> {
        if self.draining.is_cancelled() {
            return Err(TransferError::ShuttingDown);
        }
        let slot = self.reserve_slot(&req.remote_agent)?;
        // In use from the lookup on (under the registry lock): a DeleteRegion meanwhile is
        // refused as busy instead of deleting a region this transfer is about to move bytes in.
        let local_use = self.regions.acquire(&req.local_region)?;
        let local = Arc::clone(&local_use.0);
        if req.local_offset > local.length {
            return Err(TransferError::Invalid(format!(
                "offset {} is beyond the end of region {:?} ({} bytes)",
                req.local_offset, local.name, local.length
            )));
        }
        if req.op == Op::Read && !local.memory.writable() {
            return Err(TransferError::PermissionDenied(format!(
                "local region {:?} is mapped read-only and cannot receive a READ",
                local.name
            )));
        }
        let length = match (req.op, req.length) {
            (Op::Write, 0) => local.length - req.local_offset,
            (_, n) => n,
        };
        if req.op == Op::Write && length == 0 {
            return Err(TransferError::Invalid("zero-length transfer: nothing to copy".into()));
        }
        if req.length != 0 || req.op == Op::Write {
            local.check_range(req.local_offset, length)?;
        }
        let opts = &req.options;
        let chunk = opts.chunk_size.unwrap_or(self.config.transfer.chunk_size.0);
        if chunk == 0 || chunk > crate::fabric::frame::MAX_PAYLOAD as u64 {
            return Err(TransferError::Invalid(format!("chunk size must be between 1 and {} bytes", crate::fabric::frame::MAX_PAYLOAD)));
        }
        let qps = opts.qps.unwrap_or(self.config.transfer.qps);
        let depth = opts.depth.unwrap_or(self.config.transfer.depth);
        if !(1..=64).contains(&qps) || !(1..=4096).contains(&depth) {
            return Err(TransferError::Invalid("qps must be 1-64 and depth 1-4096".into()));
        }
        let timeout = opts.timeout.filter(|t| !t.is_zero()).unwrap_or(self.config.transfer.timeout.0);
        let peer = self.peers.peer(&req.remote_agent)?;
        let remote_op = match req.op {
            Op::Write => RemoteOp::Write,
            Op::Read => RemoteOp::Read,
        };
        let grant_ttl = timeout + Duration::from_secs(60);
        // Connect first: the grant is bound to this connection (grant mode mw binds its windows
        // on the connection's QPs). Connect failures are submit errors (UNAVAILABLE, ...).
        let ask = GrantAsk { region: &req.remote_region, offset: req.remote_offset, length, op: remote_op, ttl: grant_ttl };
        let (lease, grant) = self.lease_and_grant(&peer, qps, depth, &ask).await?;
        let length = if length == 0 { grant.length } else { length };
        let refuse = |e: TransferError, lease| {
            self.revoke_later(&peer, &grant.grant_id);
            self.peers.release(&peer, lease, true);
            Err(e)
        };
        if grant.length < length {
            return refuse(TransferError::Invalid(format!("peer granted {} bytes, {} needed", grant.length, length)), lease);
        }
        if let Err(e) = local.check_range(req.local_offset, length) {
            return refuse(e.into(), lease);
        }
        if length == 0 {
            return refuse(TransferError::Invalid("zero-length transfer: nothing to copy".into()), lease);
        }
        if self.draining.is_cancelled() {
            // SIGTERM arrived while the grant was in flight: drain may not see this transfer.
            return refuse(TransferError::ShuttingDown, lease);
        }
        let now = SystemTime::now();
        let record = TransferRecord {
            id: new_id(),
            op: req.op,
            local_region: local.name.clone(),
            local_offset: req.local_offset,
            remote_agent: req.remote_agent.clone(),
            remote_region: req.remote_region.clone(),
            remote_offset: req.remote_offset,
            length,
            state: TransferState::Connecting,
            bytes_done: 0,
            error: None,
            error_code: None,
            created_at: now,
            started_at: None,
            finished_at: None,
            elapsed: Duration::ZERO,
            verified: false,
            checksum: None,
            peer: grant.node_name.clone(),
            inbound: false,
        };
        let handle = self.transfers.insert(record);
        // The id it was stored under (the registry never replaces a record).
        let record = handle.snapshot();
        drop(slot); // the registry counts it from here
        let plan = Plan {
            local: local_use,
            peer,
            grant,
            lease: Mutex::new(Some(lease)),
            chunk,
            depth,
            verify: opts.verify.then(|| opts.algo.unwrap_or(Algo::Xxh3)),
            deadline: Instant::now() + timeout,
        };
        let node = self.clone();
        let span = info_span!("transfer", id = %record.id, op = req.op.as_str(), peer = %req.remote_agent);
        tokio::spawn(async move { node.run(handle, plan).await }.instrument(span));
        Ok(record)
    }

    async fn run(self: Arc<Self>, handle: Arc<TransferHandle>, plan: Plan) {
        let rec = handle.snapshot();
        let started = Instant::now();
        info!(bytes = rec.length, "transfer started");
        let mut outcome = self.execute(&handle, &plan, &rec, started).await;
        // The local region's file shrank under its mapping while the transfer copied it: whatever
        // the fabric reported (a local protection error, or success over zeros standing in for
        // the missing pages), the transfer failed, and the code says why.
        if !matches!(outcome, Err(Outcome::Cancelled)) {
            if let Err(e) = plan.local.0.intact() {
                outcome = Err(Outcome::Failed(REGION_POISONED.into(), e.to_string()));
            }
        }
        let (state, code, msg) = match outcome {
            Ok(verified) => {
                handle.update(|r| {
                    r.verified = verified.is_some();
                    r.checksum = verified;
                });
                (TransferState::Succeeded, None, None)
            }
            Err(Outcome::Cancelled) => (TransferState::Cancelled, Some("CANCELLED".to_string()), Some("cancelled".to_string())),
            Err(Outcome::Failed(code, msg)) => (TransferState::Failed, Some(code), Some(msg)),
        };
        if state != TransferState::Succeeded {
            self.revoke_later(&plan.peer, &plan.grant.grant_id);
        }
        let elapsed = started.elapsed();
        handle.update(|r| {
            r.state = state;
            r.error_code = code.clone();
            r.error = msg.clone();
            r.finished_at = Some(SystemTime::now());
            r.elapsed = elapsed;
        });
        let done = handle.snapshot().bytes_done;
        let result = match state {
            TransferState::Succeeded => "succeeded",
            TransferState::Cancelled => "cancelled",
            _ => "failed",
        };
        m::transfer_finished(rec.op.as_str(), result, elapsed);
        m::transfer_bytes(rec.op.as_str(), &peer_label(&plan.peer), done);
        match state {
            TransferState::Succeeded => info!(bytes = done, secs = elapsed.as_secs_f64(), "transfer succeeded"),
            _ => warn!(result, code = ?code, error = ?msg, bytes = done, "transfer did not succeed"),
        }
    }

    /// Moves the data; `Ok(checksum)` on success (the checksum when verified).
    async fn execute(&self, handle: &TransferHandle, plan: &Plan, rec: &TransferRecord, started: Instant) -> Result<Option<u64>, Outcome> {
        // Leased at submit (the grant is bound to it).
        let Some(mut lease) = plan.lease.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Err(Outcome::Failed("INTERNAL".into(), "transfer started without its connection".into()));
        };
        if handle.cancel.is_cancelled() {
            self.peers.release(&plan.peer, lease, true);
            return Err(Outcome::Cancelled);
        }
        handle.update(|r| {
            r.state = TransferState::Running;
            r.started_at = Some(SystemTime::now());
        });
        let mut machine = Machine::new(MachineConfig {
            total: rec.length,
            chunk: plan.chunk,
            qps: lease.conn.qps(),
            depth: plan.depth,
            signal_every: self.config.transfer.signal_every,
            deadline: Some(plan.deadline),
        });
        let local = plan.local.0.registration.clone();
        let op = if rec.op == Op::Write { WrOp::Write } else { WrOp::Read };
        let (local_off, remote_addr, key) = (rec.local_offset, plan.grant.addr, plan.grant.key.clone());
        pump(
            &mut machine,
            &mut lease,
            &handle.cancel,
            |p| WorkRequest {
                wr_id: p.seq,
                op,
                local: local.clone(),
                local_offset: local_off + p.offset,
                len: p.len,
                remote_addr: remote_addr + p.offset,
                remote_key: key.clone(),
                signaled: p.signaled,
            },
            |bytes| {
                handle.update(|r| {
                    r.bytes_done = bytes;
                    r.elapsed = started.elapsed();
                })
            },
            None,
        )
        .await;
        let clean = machine.state() == &State::Succeeded && machine.outstanding() == 0;
        let state = machine.state().clone();
        self.peers.release(&plan.peer, lease, clean);
        match state {
            State::Succeeded => {}
            State::Cancelled => return Err(Outcome::Cancelled),
            State::Failed(Failure::Completion { status, .. }) => {
                return Err(Outcome::Failed(
                    status.name().to_string(),
                    format!("work request failed with {status}{}", hint(status)),
                ))
            }
            State::Failed(Failure::Post(e)) => return Err(Outcome::Failed("POST_FAILED".into(), e)),
            State::Failed(Failure::Timeout) => return Err(Outcome::Failed("DEADLINE_EXCEEDED".into(), "transfer timed out".into())),
            State::Running => return Err(Outcome::Failed("INTERNAL".into(), "engine stopped early".into())),
        }
        // Data landed. Tell the target (and let it verify), then report.
        let sum = match plan.verify {
            Some(algo) => {
                let mem = plan.local.0.memory.clone();
                let (off, len) = (rec.local_offset, rec.length);
                let v = tokio::task::spawn_blocking(move || checksum::checksum(&mem, off, len, algo))
                    .await
                    .map_err(|e| Outcome::Failed("INTERNAL".into(), e.to_string()))?
                    .map_err(|e| match plan.local.0.mem_error(e) {
                        e @ crate::regions::RegionError::Poisoned { .. } => Outcome::Failed(REGION_POISONED.into(), e.to_string()),
                        e => Outcome::Failed("INTERNAL".into(), e.to_string()),
                    })?;
                Some((algo, v))
            }
            None => None,
        };
        let params = CompleteParams {
            transfer_id: rec.id.clone(),
            grant_id: plan.grant.grant_id.clone(),
            bytes: rec.length,
            op_write: rec.op == Op::Write,
            node_name: self.config.node_name.clone(),
            checksum: sum,
            success: true,
        };
        match plan.peer.call(|| plan.peer.client.complete(params.clone())).await {
            Ok(true) => Ok(sum.map(|s| s.1)),
            Ok(false) => Err(Outcome::Failed(
                "CHECKSUM_MISMATCH".into(),
                "checksum of the destination range does not match the source".into(),
            )),
            Err(e) if sum.is_some() => Err(Outcome::Failed("VERIFY_FAILED".into(), format!("could not verify: {e}"))),
            Err(e) => {
                warn!(error = %e, "Peer.Complete failed; the data landed but the target did not record it");
                Ok(None)
            }
        }
    }

    /// Leases a connection to `peer`, then asks the peer for a grant bound to it
    /// (`GrantRequest.connection_id`: grant mode mw binds its windows on that connection's QPs).
    /// An idle connection may predate a restart of the peer, which then does not know it, or break
    /// while the grant is asked (the peer closed it for idleness): it is discarded and a fresh one
    /// negotiated (once). A pooled connection that breaks after this fails its transfer cleanly
    /// (`RETRY_EXC_ERR` in the record).
    async fn lease_and_grant(
        &self,
        peer: &Arc<PeerEntry>,
        qps: usize,
        depth: usize,
        ask: &GrantAsk<'_>,
    ) -> Result<(Lease, GrantInfo), TransferError> {
        let me = &self.config.node_name;
        let mut retried = false;
        loop {
            let lease = self.peers.lease(peer, qps, depth).await?;
            let cid = lease.connection_id.clone();
            let r = peer.call(|| peer.client.grant(ask, me, &cid)).await;
            match r {
                Ok(grant) => {
                    peer.observe(&grant.node_name, &grant.instance_id);
                    if grant.instance_id == lease.instance_id() && lease.reused() && lease.conn.is_broken() && !retried {
                        // The pooled connection broke while the grant was asked (e.g. the peer
                        // closed its idle streams, limits.data_idle_timeout): the grant is bound to
                        // it, so drop both and start over on a fresh connection, once.
                        debug!(peer = %peer.addr, "pooled connection broke while granting; negotiating a fresh one");
                        self.revoke_later(peer, &grant.grant_id);
                        self.peers.release(peer, lease, false);
                        retried = true;
                        continue;
                    }
                    if grant.instance_id == lease.instance_id() {
                        return Ok((lease, grant));
                    }
                    // The peer restarted after this connection was made: its QPs are gone. The
                    // grant itself does not use the connection (an mw grant would have failed).
                    self.peers.release(peer, lease, false);
                    match self.peers.lease(peer, qps, depth).await {
                        Ok(fresh) => return Ok((fresh, grant)),
                        Err(e) => {
                            self.revoke_later(peer, &grant.grant_id);
                            return Err(e.into());
                        }
                    }
                }
                Err(PeerError::Remote { code: RemoteCode::FailedPrecondition, .. }) if lease.reused() && !retried => {
                    debug!(peer = %peer.addr, "peer does not know a pooled connection; negotiating a fresh one");
                    self.peers.release(peer, lease, false);
                    retried = true;
                }
                Err(e) => {
                    self.peers.release(peer, lease, true);
                    return Err(e.into());
                }
            }
        }
    }

    /// A transfer record by id: an outbound id, or `PEER/ID` for an inbound one.
    pub fn transfer(&self, id: &str) -> Result<Arc<TransferHandle>, TransferError> {
        if id.contains('/') {
            self.inbound.get(id)
        } else {
            self.transfers.get(id)
        }
    }

    /// Outbound records, then inbound ones, each oldest first.
    pub fn list_transfers(&self) -> Vec<TransferRecord> {
        let mut v = self.transfers.list();
        v.extend(self.inbound.list());
        v
    }

    /// Cancels a running transfer; no-op for finished ones.
    pub fn cancel(&self, id: &str) -> Result<TransferRecord, TransferError> {
        let h = self.transfers.get(id)?;
        h.cancel.cancel();
        Ok(h.snapshot())
    }

    // ------------------------------------------------------------------ benchmarks

    /// One admin call (`Bench`, `TcpBaseline`) at a time on this agent.
    fn admin_slot(&self, what: &str) -> Result<tokio::sync::OwnedSemaphorePermit, TransferError> {
        self.admin_slot.clone().try_acquire_owned().map_err(|_| {
            TransferError::Limit(format!("another benchmark is running on this agent ({what} runs one at a time)"))
        })
    }

    /// perftest-style data-path benchmark against `peer`. Admin-only; one at a time; its buffer
    /// counts against `max_registered_bytes` here and the target's scratch region against the
    /// target's region limits.
    pub async fn bench(&self, p: BenchParams) -> Result<BenchResult, TransferError> {
        if p.size == 0 || p.size > crate::fabric::frame::MAX_PAYLOAD as u64 {
            return Err(TransferError::Invalid(format!("bench size must be 1..={} bytes", crate::fabric::frame::MAX_PAYLOAD)));
        }
        let _admin = self.admin_slot("Bench")?;
        let _memory = self.regions.reserve(p.size, "the benchmark buffer")?;
        let iters = if p.iters == 0 { 100 } else { p.iters.min(1_000_000) };
        let peer = self.peers.peer(&p.peer)?;
        let scratch = peer.call(|| peer.client.open_bench_region(p.size)).await?;
        let res = self.bench_with(&peer, &scratch, &p, iters).await;
        if let Err(e) = peer.client.close_bench_region(&scratch).await {
            warn!(error = %e, region = %scratch, "could not delete bench scratch region on peer (its lease ends it)");
        }
        res
    }

    async fn bench_with(&self, peer: &Arc<PeerEntry>, scratch: &str, p: &BenchParams, iters: u32) -> Result<BenchResult, TransferError> {
        let remote_op = if p.op == Op::Write { RemoteOp::Write } else { RemoteOp::Read };
        let ask = GrantAsk { region: scratch, offset: 0, length: p.size, op: remote_op, ttl: Duration::from_secs(3600) };
        let len = usize::try_from(p.size).map_err(|_| TransferError::Invalid("size too large".into()))?;
        let mem = Arc::new(RegionMemory::anonymous(len, false).map_err(|e| TransferError::Internal(e.to_string()))?);
        let local = self
            .fabric
            .register(mem, crate::fabric::Access::ReadWrite)
            .map_err(|e| TransferError::Internal(e.to_string()))?;
        let cancel = CancellationToken::new();
        let op = if p.op == Op::Write { WrOp::Write } else { WrOp::Read };
        let qps = if p.qps == 0 { self.config.transfer.qps } else { p.qps };
        let depth = if p.depth == 0 { self.config.transfer.depth } else { p.depth };

        // Bandwidth: iters WRs of `size`, `depth` outstanding per QP. Each phase has its own
        // connection, and so its own grant (mw grants are bound to a connection).
        let (mut lease, grant) = self.lease_and_grant(peer, qps, depth, &ask).await?;
        let mut machine = Machine::new(MachineConfig {
            total: p.size * iters as u64,
            chunk: p.size,
            qps: lease.conn.qps(),
            depth,
            signal_every: self.config.transfer.signal_every,
            deadline: Some(Instant::now() + Duration::from_secs(600)),
        });
        let t0 = Instant::now();
        pump(&mut machine, &mut lease, &cancel, |q| bench_wr(q.seq, op, &local, p.size, &grant, q.signaled), |_| {}, None).await;
        let seconds = t0.elapsed().as_secs_f64();
        let bw_state = machine.state().clone();
        let clean = bw_state == State::Succeeded;
        self.peers.release(peer, lease, clean);
        if let State::Failed(f) = bw_state {
            self.revoke_later(peer, &grant.grant_id);
            return Err(TransferError::Internal(format!("bench bandwidth phase failed: {f:?}")));
        }

        // Latency: one WR at a time on one QP.
        self.revoke_later(peer, &grant.grant_id);
        let lat_iters = iters.clamp(1, 10_000);
        let (mut lease, grant) = self.lease_and_grant(peer, 1, 1, &ask).await?;
        let mut machine = Machine::new(MachineConfig {
            total: p.size * lat_iters as u64,
            chunk: p.size,
            qps: 1,
            depth: 1,
            signal_every: 1,
            deadline: Some(Instant::now() + Duration::from_secs(600)),
        });
        let mut probe = LatencyProbe::default();
        pump(&mut machine, &mut lease, &cancel, |q| bench_wr(q.seq, op, &local, p.size, &grant, true), |_| {}, Some(&mut probe)).await;
        let lat_ok = machine.state() == &State::Succeeded;
        self.peers.release(peer, lease, lat_ok);
        self.revoke_later(peer, &grant.grant_id);
        if !lat_ok {
            return Err(TransferError::Internal(format!("bench latency phase failed: {:?}", machine.state())));
        }
        let mut us: Vec<f64> = probe.samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        us.sort_by(|a, b| a.total_cmp(b));
        let pct = |q: f64| us.get(((us.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0);
        Ok(BenchResult {
            size: p.size,
            iters,
            bytes: p.size * iters as u64,
            seconds,
            lat_avg_us: us.iter().sum::<f64>() / us.len().max(1) as f64,
            lat_p50_us: pct(0.5),
            lat_p99_us: pct(0.99),
            lat_iters: us.len() as u32,
        })
    }

    /// Raw TCP throughput to the peer's host: what `--baseline tcp` compares against. Admin-only;
    /// one at a time; one shared send buffer of at most [`BASELINE_MAX_BLOCK`], counted against
    /// `max_registered_bytes`.
    pub async fn tcp_baseline(&self, peer_addr: &str, bytes: u64, connections: u32, block: u64) -> Result<(u64, f64), TransferError> {
        let _admin = self.admin_slot("TcpBaseline")?;
        let block = block.clamp(4096, BASELINE_MAX_BLOCK) as usize;
        let _memory = self.regions.reserve(block as u64, "the TCP baseline buffer")?;
        let peer = self.peers.peer(peer_addr)?;
        let n = connections.clamp(1, 64);
        let sink = peer.call(|| peer.client.open_sink(n)).await?;
        let per = bytes.div_ceil(n as u64);
        let buf: Arc<[u8]> = vec![0xa5u8; block].into();
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..n {
            let sink = sink.clone();
            let buf = buf.clone();
            tasks.push(tokio::spawn(async move {
                let mut s = TcpStream::connect(&sink).await?;
                s.set_nodelay(true)?;
                let mut left = per;
                while left > 0 {
                    let k = (left as usize).min(buf.len());
                    s.write_all(&buf[..k]).await?;
                    left -= k as u64;
                }
                s.shutdown().await?;
                // Wait for the sink to close: all bytes were read on the far side.
                let mut one = [0u8; 1];
                let _ = s.read(&mut one).await;
                Ok::<u64, std::io::Error>(per)
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t
                .await
                .map_err(|e| TransferError::Internal(e.to_string()))?
                .map_err(|e| TransferError::Peer(PeerError::Unreachable { addr: sink.clone(), detail: e.to_string() }))?;
        }
        Ok((total, t0.elapsed().as_secs_f64()))
    }

    /// SIGTERM: refuse new transfers, wait up to `grace` for running ones, cancel the rest
    /// (they end CANCELLED), revoke grants (ours, and the peers' grants of cancelled transfers)
    /// and close connections.
    pub async fn drain(&self, grace: Duration) {
        self.draining.cancel();
        let deadline = Instant::now() + grace;
        let mut submitting = self.submitting_count();
        loop {
            let active = self.transfers.active(None);
            if active.is_empty() && submitting == 0 {
                info!("no transfers running");
                break;
            }
            if Instant::now() >= deadline {
                warn!(transfers = active.len(), "shutdown grace elapsed; cancelling running transfers");
                for h in &active {
                    h.cancel.cancel();
                }
                // Give the drivers a moment to record CANCELLED.
                for _ in 0..100 {
                    if self.transfers.active(None).is_empty() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            // Submits that passed the draining check before it was set insert their record or
            // give up (they re-check `draining` after the grant) within one peer call.
            submitting = self.submitting_count();
        }
        // Peer grants of transfers that did not succeed are revoked in the background: let those
        // calls finish (bounded), so the peers do not keep exposures until they expire.
        let until = Instant::now() + Duration::from_secs(3);
        while self.pending_revokes.load(Ordering::Acquire) > 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let n = self.grants.revoke_all();
        info!(grants = n, "revoked all grants");
        self.peers.close_all();
        if let Ok(mut acc) = self.accepted.lock() {
            acc.clear();
            m::accepted_connections(0);
        }
        self.regions.flush_all();
    }

    fn submitting_count(&self) -> usize {
        self.submitting.lock().map(|m| m.values().sum()).unwrap_or(0)
    }

    /// Checks `limits.max_transfers` and `limits.max_transfers_per_peer` and holds a slot until
    /// the transfer's record is inserted, so concurrent submits cannot overshoot.
    fn reserve_slot(&self, peer: &str) -> Result<SubmitSlot<'_>, TransferError> {
        let limits = &self.config.limits;
        let mut m = self.submitting.lock().unwrap_or_else(|p| p.into_inner());
        let active = self.transfers.active(None);
        let total = active.len() + m.values().sum::<usize>();
        if total >= limits.max_transfers {
            return Err(TransferError::Limit(format!("max_transfers = {} ({total} running)", limits.max_transfers)));
        }
        let to_peer = active.iter().filter(|h| h.record.borrow().remote_agent == peer).count() + m.get(peer).copied().unwrap_or(0);
        if to_peer >= limits.max_transfers_per_peer {
            return Err(TransferError::Limit(format!(
                "max_transfers_per_peer = {} ({to_peer} running to {peer})",
                limits.max_transfers_per_peer
            )));
        }
        *m.entry(peer.to_string()).or_insert(0) += 1;
        Ok(SubmitSlot { node: self, peer: peer.to_string() })
    }

    /// Revokes a peer's grant in the background (best effort; `drain` waits for these).
    fn revoke_later(&self, peer: &Arc<PeerEntry>, grant_id: &str) {
        let peer = peer.clone();
        let id = grant_id.to_string();
        let pending = self.pending_revokes.clone();
        pending.fetch_add(1, Ordering::AcqRel);
        tokio::spawn(async move {
            let _ = peer.call(|| peer.client.revoke(&id)).await;
            pending.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

struct Plan {
    local: RegionUse,
    peer: Arc<PeerEntry>,
    grant: GrantInfo,
    /// The connection the grant is bound to; `execute` takes it (std Mutex: no awaits held).
    lease: Mutex<Option<Lease>>,
    chunk: u64,
    depth: usize,
    verify: Option<Algo>,
    deadline: Instant,
}

enum Outcome {
    Cancelled,
    Failed(String, String),
}

/// `error_code` of a transfer whose local region's file shrank under its mapping.
pub const REGION_POISONED: &str = "REGION_POISONED";

fn hint(status: crate::fabric::WcStatus) -> &'static str {
    use crate::fabric::WcStatus::*;
    match status {
        RemAccessErr => " (the peer refused access: outside the grant, wrong operation, expired or revoked)",
        RetryExcErr => " (the peer stopped answering: dead agent, broken link or closed connection)",
        RnrRetryExcErr => " (the peer's receive queue was not ready)",
        RemInvReqErr => " (the peer rejected the request as invalid)",
        _ => "",
    }
}

fn peer_label(peer: &PeerEntry) -> String {
    let n = peer.node_name();
    if n.is_empty() {
        peer.addr.clone()
    } else {
        n
    }
}

fn bench_wr(seq: u64, op: WrOp, local: &Arc<dyn Registration>, size: u64, grant: &GrantInfo, signaled: bool) -> WorkRequest {
    WorkRequest {
        wr_id: seq,
        op,
        local: local.clone(),
        local_offset: 0,
        len: size as u32,
        remote_addr: grant.addr,
        remote_key: grant.key.clone(),
        signaled,
    }
}
