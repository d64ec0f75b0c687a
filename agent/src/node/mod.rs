//! The agent's core: regions, grants, transfers, peers and the fabric, and the operations the
//! gRPC services expose (in domain types). `service` converts protobuf to these calls and back.
//!
//! `Node` is split by role, one file each; its fields are private to this module:
//! * this file — the `Node` itself, start-up (`new`, reapers) and drain;
//! * [`lifetime`] — how a region ends (delete, lease) and what is kept per owner;
//! * [`responder`] — the target side: accepting connections, grants, revocation, `Peer.Complete`;
//! * [`inbound`] — notifications to this agent's subscribers (`WatchInbound`, rings), tag bounds;
//! * [`initiator`] — the initiator side: submit, the transfer's run, leases and grants from peers;
//! * [`limits`] — admission (transfer slots, the admin and sink slots) and the data path's knobs;
//! * [`shares`] — the per-identity shares of regions, bytes and subscriptions;
//! * [`channel`] — channels: one connection and one grant held, many batches posted;
//! * [`scratch`] — the target side of a benchmark: its scratch region.
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::Config;
use crate::grants::GrantTable;
use crate::metrics as m;
use crate::peer_api::{Connector, PeerError};
use crate::peers::{Lease, PeerEntry, PeerPool};
use crate::regions::{RegionPolicy, RegionRegistry, RegionUse};
use crate::transfer::TransferRegistry;
use xfer_engine::ids::new_id;
use xfer_fabric::{Fabric, FabricKind};
use xfer_rdma::memory::RegionMemory;

mod acquire;
mod channel;
mod held;
mod inbound;
mod initiator;
mod lifetime;
mod limits;
mod paths;
mod responder;
mod scratch;
mod shares;
mod verify;

pub use channel::{BatchOutcome, Channel, ChannelEnd, ChannelInfo, ChannelInput, ChannelOutput, ChannelParams};
pub use held::Held;
pub use inbound::InboundRing;
use initiator::Initiator;
use lifetime::Regions;
pub use lifetime::StateCounts;
use responder::Responder;
pub use responder::{GrantParams, InboundEnd, NotifyAsk};
pub use scratch::BENCH_REGION_TTL;

/// The agent's core, composed of parts that own their state — [`Regions`] (the registry, the
/// grants on it, the shares, the benchmark scratch slot), [`Initiator`] (outbound transfers, the
/// peer pool, admission, the data-path worker) and [`Responder`] (accepted connections,
/// inbound records, notification rings) — and what every part reads: the configuration, the
/// fabric and the drain switch. The service-facing calls stay on `Node`, delegating.
pub struct Node {
    config: Config,
    fabric: Arc<dyn Fabric>,
    fabric_reason: String,
    regions: Regions,
    initiator: Initiator,
    responder: Responder,
    started: Instant,
    /// Random per start: peers use it to notice this agent restarted.
    instance_id: String,
    /// Cancelled on SIGTERM: refuse new transfers.
    draining: CancellationToken,
    /// Admin calls (`Bench`, `TcpBaseline`) run one at a time.
    admin_slot: Arc<tokio::sync::Semaphore>,
    /// One `Peer.OpenSink` at a time; its task holds the permit until the sink closes.
    sink_slot: Arc<tokio::sync::Semaphore>,
}

/// Finished transfers remembered per direction. Every field of a record is bounded (ids 64
/// bytes, names 253), so both histories together stay far below `limits.max_message_size` in one
/// `ListTransfers` answer.
pub const TRANSFER_HISTORY: usize = 1000;

impl Node {
    /// `tls`: the agent's mTLS material for its calls to peers (None = plaintext).
    pub fn new(config: Config, fabric: Arc<dyn Fabric>, fabric_reason: String, grants: Arc<GrantTable>, connector: Connector) -> Arc<Node> {
        let mut policy = RegionPolicy::new(config.regions.effective_file_roots(&config.state_dir));
        policy.shm_mode = config.regions.shm_mode.0;
        policy.allow_hard_links = config.regions.allow_hard_links;
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
                max_bench_bytes: config.limits.max_bench_bytes.0,
            },
            policy,
        );
        let peers = PeerPool::new(
            fabric.clone(),
            config.node_name.clone(),
            connector,
            config.limits.max_peers,
            config.limits.max_connections_per_peer,
            config.limits.tenant_share,
        );
        let ring_prefix = format!(
            "{}{:08x}.",
            crate::regions::PRIVATE_SHM_PREFIX,
            xxhash_rust::xxh3::xxh3_64(
                std::fs::canonicalize(&config.state_dir).unwrap_or_else(|_| config.state_dir.clone()).as_os_str().as_encoded_bytes()
            ) as u32
        );
        regions.sweep_private_shm(&ring_prefix);
        let shares = shares::Shares::new(&config.limits);
        regions.set_charge(shares.charge());
        Arc::new(Node {
            regions: Regions { registry: regions, grants, shares, bench_region: Mutex::new(None) },
            initiator: Initiator {
                transfers: TransferRegistry::new(TRANSFER_HISTORY),
                peers,
                submitting: Mutex::new(HashMap::new()),
                pending_revokes: Arc::new(AtomicUsize::new(0)),
                worker: std::sync::OnceLock::new(),
                paths: paths::PathBook::new(&fabric.info().devices),
            },
            responder: Responder {
                inbound: TransferRegistry::new(TRANSFER_HISTORY),
                accepted: Mutex::new(HashMap::new()),
                accept_seq: std::sync::atomic::AtomicU64::new(0),
                ring_prefix,
            },
            started: Instant::now(),
            instance_id: new_id(),
            draining: CancellationToken::new(),
            admin_slot: Arc::new(tokio::sync::Semaphore::new(1)),
            sink_slot: Arc::new(tokio::sync::Semaphore::new(1)),
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
                node.regions.grants.reap(now);
                // Catalog writes fsync: off the reactor (only when a lease ended).
                if node.regions.registry.housekeeping_due(Some(now)) {
                    let n = node.clone();
                    let _ = tokio::task::spawn_blocking(move || n.reap_regions(now)).await;
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
                if !node.regions.registry.housekeeping_due(None) {
                    continue;
                }
                let n = node.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    n.regions.registry.retry_unavailable();
                    n.regions.registry.retry_dirty_catalog();
                })
                .await;
            }
        });
    }

    // ------------------------------------------------------------------ what services read

    /// This agent's node name (its certificate's NAME under mTLS).
    pub fn node_name(&self) -> &str {
        &self.config.node_name
    }

    /// Random per start: peers use it to notice this agent restarted.
    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    pub fn fabric_kind(&self) -> FabricKind {
        self.fabric.kind()
    }

    pub fn fabric_info(&self) -> xfer_fabric::FabricInfo {
        self.fabric.info()
    }

    /// `transfer.fallback` as it is in effect: `tcp` only on the verbs fabric (on tcp every path
    /// is tcp already, and the setting is ignored).
    pub fn fallback(&self) -> crate::config::Fallback {
        match self.fabric.kind() {
            xfer_fabric::FabricKind::Verbs => self.config.transfer.fallback,
            xfer_fabric::FabricKind::Tcp => crate::config::Fallback::Never,
        }
    }

    /// Why this fabric was chosen (`fabric = auto` explains itself).
    pub fn fabric_reason(&self) -> &str {
        &self.fabric_reason
    }

    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// The limits and transfer defaults in force (the validated configuration).
    /// `transfer.max_notify_bytes`: the longest tag a request may carry.
    pub fn max_notify_bytes(&self) -> usize {
        self.config.transfer.max_notify_bytes
    }

    /// `transfer.max_segments`: the most segments a batch may list.
    pub fn max_segments(&self) -> usize {
        self.config.transfer.max_segments
    }

    /// The transfer defaults (`[transfer]`): what a request that says nothing gets.
    pub fn transfer_defaults(&self) -> &crate::config::TransferConfig {
        &self.config.transfer
    }

    pub fn limits(&self) -> &crate::config::LimitsConfig {
        &self.config.limits
    }

    /// The agent's certificate files (`[tls]`), None when it runs plaintext (`insecure`).
    pub fn tls_files(&self) -> Option<&crate::config::TlsConfig> {
        (!self.config.insecure).then_some(&self.config.tls)
    }

    // ------------------------------------------------------------------ regions

    /// Re-creates file and shm regions from the catalog (at start); how many came back.
    pub fn restore_regions(&self) -> Result<usize, crate::regions::RegionError> {
        self.regions.registry.restore()
    }

    /// Maps (or allocates) and registers a region. Blocking: call it off the runtime's threads.
    pub fn create_region(&self, spec: crate::regions::RegionSpec) -> Result<Arc<crate::regions::Region>, crate::regions::RegionError> {
        self.regions.registry.create(spec)
    }

    pub fn list_regions(&self, selector: &std::collections::BTreeMap<String, String>) -> Vec<crate::regions::RegionView> {
        self.regions.registry.list(selector)
    }

    pub fn describe_region(&self, name: &str) -> Result<crate::regions::RegionView, crate::regions::RegionError> {
        self.regions.registry.describe(name)
    }

    /// A live region, marked in use until the returned guard drops (see `RegionRegistry::acquire`).
    pub fn use_region(&self, name: &str) -> Result<RegionUse, crate::regions::RegionError> {
        self.regions.registry.acquire_for_client(name)
    }

    /// The local region of `owner`'s transfer or channel, marked in use: a tenant never holds a
    /// benchmark's scratch region (the agent's own benchmarks, exempt, do).
    pub(super) fn local_use(&self, name: &str, owner: &crate::tenants::Tenant) -> Result<RegionUse, crate::regions::RegionError> {
        match owner.key() {
            Some(_) => self.regions.registry.acquire_for_client(name),
            None => self.regions.registry.acquire(name),
        }
    }

    /// A live, intact region by name or id (not marked in use: see [`Node::use_region`]).
    pub fn region(&self, name: &str) -> Result<Arc<crate::regions::Region>, crate::regions::RegionError> {
        self.regions.registry.get(name)
    }

    /// Number of regions (live and unavailable) and bytes registered by live ones.
    pub fn region_totals(&self) -> (usize, u64) {
        self.regions.registry.totals()
    }

    /// Counts `bytes` a benchmark is about to hold (for `what`) against `limits.max_bench_bytes`.
    pub fn reserve_bench(&self, bytes: u64, what: &str) -> Result<crate::regions::Reservation, crate::regions::RegionError> {
        self.regions.registry.reserve_bench(bytes, what)
    }

    /// A benchmark's scratch region, its bytes already in `budget` (see
    /// `RegionRegistry::create_scratch`). Blocking: call it off the runtime's threads.
    pub fn create_scratch(
        &self,
        spec: crate::regions::RegionSpec,
        budget: crate::regions::Reservation,
    ) -> Result<Arc<crate::regions::Region>, crate::regions::RegionError> {
        self.regions.registry.create_scratch(spec, budget)
    }

    /// Registers memory that is no region (a benchmark's buffer) with the fabric.
    pub fn register(
        &self,
        memory: Arc<RegionMemory>,
        access: xfer_fabric::Access,
    ) -> Result<Arc<dyn xfer_fabric::Registration>, xfer_fabric::FabricError> {
        self.fabric.register(memory, access)
    }

    // ------------------------------------------------------------------ peers

    /// `Agent.Connect`: a healthy pooled connection with `qps` QPs (0 = the configured default)
    /// to the agent at `addr`, made now if there is none; returns the peer's pool entry.
    pub async fn connect_peer(&self, addr: &str, qps: usize, tenant: &crate::tenants::Tenant) -> Result<Arc<PeerEntry>, PeerError> {
        let peer = self.initiator.peers.peer(addr).await?;
        let qps = if qps == 0 { self.config.transfer.qps } else { qps };
        self.initiator.peers.lease(&peer, qps, self.config.transfer.depth, tenant).await?.release(true);
        Ok(peer)
    }

    /// The peer pool's entry for `addr` (made if there is none).
    pub async fn peer_entry(&self, addr: &str) -> Result<Arc<PeerEntry>, PeerError> {
        self.initiator.peers.peer(addr).await
    }

    /// A connection to `peer` with `qps` QPs, charged to `tenant`'s share (from the idle pool or
    /// negotiated now).
    pub async fn lease(
        &self,
        peer: &Arc<PeerEntry>,
        qps: usize,
        depth: usize,
        tenant: &crate::tenants::Tenant,
    ) -> Result<Lease, PeerError> {
        self.initiator.peers.lease(peer, qps, depth, tenant).await
    }

    /// The peer pool's entries, by address.
    pub fn peers(&self) -> Vec<Arc<PeerEntry>> {
        self.initiator.peers.list()
    }

    /// SIGTERM: refuse new transfers, wait up to `grace` for running ones, cancel the rest
    /// (they end CANCELLED), revoke grants (ours, and the peers' grants of cancelled transfers)
    /// and close connections.
    pub async fn drain(&self, grace: Duration) {
        self.draining.cancel();
        let deadline = xfer_common::deadline::instant_after(grace);
        let mut submitting = self.initiator.submitting_count();
        loop {
            let active = self.initiator.transfers.active(None);
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
                    if self.initiator.transfers.active(None).is_empty() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            // Submits that passed the draining check before it was set insert their record or
            // give up (they re-check `draining` after the grant) within one peer call.
            submitting = self.initiator.submitting_count();
        }
        // Peer grants of transfers that did not succeed are revoked in the background: let those
        // calls finish (bounded), so the peers do not keep exposures until they expire.
        let until = Instant::now() + Duration::from_secs(3);
        while self.initiator.pending_revokes.load(Ordering::Acquire) > 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let n = self.regions.grants.revoke_all();
        info!(grants = n, "revoked all grants");
        self.initiator.peers.close_all();
        if let Ok(mut acc) = self.responder.accepted.lock() {
            acc.clear();
            m::accepted_connections(0);
        }
        self.regions.registry.flush_all();
    }
}
