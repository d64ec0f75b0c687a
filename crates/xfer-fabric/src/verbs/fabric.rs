//! [`VerbsFabric`]: the `Fabric` trait over RC QPs.
use super::options::GrantMode;
use std::sync::Arc;

use async_trait::async_trait;

use sideway::ibverbs::AccessFlags;
use xfer_rdma::memory::RegionMemory;
use xfer_rdma::mr::Mr;
use xfer_rdma::qp::WindowAccess;

use super::connection::ConnInner;
use super::device::Device;
use super::initiator::VerbsPrepared;
use super::mr::VerbsRegistration;
use super::negotiate;
use super::options::VerbsOptions;
use super::prebuilt::Prebuilt;
use super::responder::{on_blocking_pool, AcceptedHandle, AcceptedIndex, OnBlockingPool, VerbsAccepted};
use crate::{
    Accepted, Access, CompletionSink, Endpoint, ExposeRequest, Exposure, Fabric, FabricError, FabricInfo, FabricKind, PendingConnection,
    Registration, RemoteKey, RemoteOp,
};

/// The verbs data plane: one device context and PD shared by every registration and connection.
pub struct VerbsFabric {
    dev: Arc<Device>,
    opts: Arc<VerbsOptions>,
    /// Accepted connections by id, for `mw` binds.
    accepted: Arc<AcceptedIndex>,
    /// Where responder connections report notification markers.
    markers: Option<Arc<dyn crate::MarkerSink>>,
    /// Connections built ahead of need (`verbs.prebuilt`).
    prebuilt: Arc<Prebuilt<Shape, ConnInner>>,
    /// Negotiations that started from a prebuilt connection.
    prebuilt_hits: std::sync::atomic::AtomicU64,
    /// This device's part of the node's `xfer_prebuilt_qps` (shared by a fabric's devices).
    prebuilt_share: Arc<crate::metrics::PrebuiltShare>,
    /// Busy-polls the receive CQs of responder connections that expect markers soon.
    poller: Arc<super::marker_poll::MarkerPoller>,
    /// Wakes the builder thread ([`VerbsFabric::refill`]); started on first use.
    builder: std::sync::Mutex<Option<std::sync::mpsc::SyncSender<()>>>,
}

/// What a connection is built as: everything [`ConnInner::build`] takes but the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shape {
    qps: usize,
    depth: usize,
    with_channel: bool,
    bind_mw: bool,
    markers: bool,
}

/// Shapes the pool keeps, and QPs it holds in all (DoS bound: a peer choosing 256-QP
/// connections cannot make this agent hold more than this many idle QPs).
const PREBUILT_SHAPES: usize = 4;
const PREBUILT_MAX_QPS: usize = 64;

impl Shape {
    /// The initiator's half: `depth` WRs per QP, completions through a channel.
    fn initiator(qps: usize, depth: usize) -> Shape {
        Shape { qps, depth, with_channel: true, bind_mw: false, markers: false }
    }

    /// The responder's half: window binds only (a one-WR send queue, polled), with `bind_mw` in
    /// grant mode `mw`, and the marker receives.
    fn responder(qps: usize, bind_mw: bool) -> Shape {
        Shape { qps, depth: 1, with_channel: false, bind_mw, markers: true }
    }

    fn build(&self, dev: &Arc<Device>, opts: &VerbsOptions, peer: &str) -> Result<ConnInner, FabricError> {
        ConnInner::build(dev, opts, peer, self.qps, self.depth, self.with_channel, self.bind_mw, self.markers)
    }
}

impl std::fmt::Debug for VerbsFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsFabric").field("dev", &self.dev).finish()
    }
}

impl VerbsFabric {
    /// Opens the device and port `opts` select and picks the GID (see [`VerbsOptions`]).
    pub fn open(opts: VerbsOptions) -> Result<VerbsFabric, FabricError> {
        opts.validate()?;
        let dev = Device::open(&opts)?;
        let prebuilt = Arc::new(Prebuilt::new(opts.prebuilt, PREBUILT_SHAPES, PREBUILT_MAX_QPS, |s: &Shape| s.qps));
        let poller = Arc::new(super::marker_poll::MarkerPoller::new(opts.marker_spin));
        Ok(VerbsFabric {
            dev: Arc::new(dev),
            opts: Arc::new(opts),
            accepted: Arc::default(),
            markers: None,
            prebuilt,
            prebuilt_hits: Default::default(),
            prebuilt_share: Arc::new(crate::metrics::PrebuiltShare::new(Arc::default())),
            poller,
            builder: Default::default(),
        })
    }

    /// A connection of `shape` for `peer`: a prebuilt one (fresh PSNs) if one is ready, else
    /// built now. Either way the pool is topped up by the builder thread, off this negotiation.
    /// Also says whether it was prebuilt (the caller counts the build once per connection).
    fn connection(&self, mut shape: Shape, peer: &str) -> Result<(ConnInner, bool), FabricError> {
        // A shape the device cannot hold is refused here, with its reason, and never learnt.
        shape.depth = ConnInner::check_shape(&self.dev, &self.opts, shape.qps, shape.depth)?.0;
        let taken = self.prebuilt.take(&shape);
        drop(taken.evicted);
        if taken.refill {
            self.refill();
        }
        let conn = match taken.item {
            Some(c) => {
                self.prebuilt_hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                c.for_peer(peer).map(|c| (c, true))
            }
            None => shape.build(&self.dev, &self.opts, peer).map(|c| (c, false)),
        };
        self.prebuilt_share.publish(self.prebuilt.held().1);
        conn
    }

    /// Teaches the pool the shapes of a connection of `qps` QPs and `depth` (the initiator's and
    /// the responder's half) before any negotiation asks, and starts building them.
    pub fn prebuild(&self, qps: usize, depth: usize) {
        let Ok((depth, _)) = ConnInner::check_shape(&self.dev, &self.opts, qps, depth) else { return };
        let halves = [Shape::initiator(qps, depth), Shape::responder(qps, self.opts.mw_grants())];
        // Nothing is built yet, so nothing is taken: these takes only record the demand (both
        // must run; at most one of them asks for the refill, which then builds both).
        let asks: Vec<bool> = halves.iter().map(|s| self.prebuilt.take(s).refill).collect();
        if asks.contains(&true) {
            self.refill();
        }
    }

    /// Builds what the pool is short of now, on this thread, and returns how many connections
    /// it built (what a refill after a negotiation does on the builder thread).
    pub fn fill_prebuilt(&self) -> Result<usize, FabricError> {
        fill(&self.prebuilt, &self.dev, &self.opts, &self.prebuilt_share)
    }

    /// Negotiations (either role) that started from a prebuilt connection.
    pub fn prebuilt_hits(&self) -> u64 {
        self.prebuilt_hits.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Builds what the pool is short of on the fabric's builder thread, a thread of its own in
    /// the `SCHED_IDLE` class: it gets a core only when no other thread wants it, so the builds
    /// a negotiation starts never compete with that negotiation (its gRPC round trip, the peer's
    /// accept, the QP transitions) or with the data path. In the VM (2 vCPUs shared by both
    /// agents), where both agents' refills used to run during every handshake, this and the
    /// responder's early answer took Peer.Connect's p50 from 8.7-9.4 ms to 7.7-8.2 ms in one
    /// boot. The thread holds the pool's lock only to pick a shape and to store what it built
    /// (a few instructions, never across a build), so a negotiation rarely meets it held by a
    /// preempted builder; one that does waits until the builder runs again (priority
    /// inversion, bounded by the scheduler). If the thread cannot be started, the build runs
    /// on the blocking pool instead.
    fn refill(&self) {
        let parts = || (Arc::clone(&self.prebuilt), Arc::clone(&self.dev), Arc::clone(&self.opts), Arc::clone(&self.prebuilt_share));
        let mut builder = self.builder.lock().unwrap_or_else(|e| e.into_inner());
        if builder.is_none() {
            // One pending wake is enough: the build fills every shape that is short.
            let (tx, rx) = std::sync::mpsc::sync_channel::<()>(1);
            let (pool, dev, opts, share) = parts();
            let spawned = std::thread::Builder::new().name("xfer-prebuild".into()).spawn(move || {
                if let Err(e) = xfer_rdma::thread::run_when_idle() {
                    tracing::debug!(error = %e, "the connection builder runs at normal priority (SCHED_IDLE refused)");
                }
                // Ends when the fabric (the sender) is dropped.
                while rx.recv().is_ok() {
                    fill_or_log(&pool, &dev, &opts, &share);
                }
            });
            match spawned {
                Ok(_) => *builder = Some(tx),
                Err(e) => tracing::warn!(error = %e, "cannot start the connection builder thread; building on the blocking pool"),
            }
        }
        if let Some(tx) = builder.as_ref() {
            match tx.try_send(()) {
                // A wake already pending covers this one.
                Ok(()) | Err(std::sync::mpsc::TrySendError::Full(())) => return,
                // The thread is gone (it ends only with the fabric): build below, start anew next time.
                Err(std::sync::mpsc::TrySendError::Disconnected(())) => *builder = None,
            }
        }
        drop(builder);
        let (pool, dev, opts, share) = parts();
        let run = move || fill_or_log(&pool, &dev, &opts, &share);
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(run)),
            // Outside a runtime (not the agent's case: negotiations are async) build inline.
            Err(_) => run(),
        }
    }

    /// Connections ready in the pool and the QPs they hold.
    pub fn prebuilt(&self) -> (usize, usize) {
        self.prebuilt.held()
    }

    /// Reports the notification markers that arrive on accepted connections to `sink` (the
    /// grant table). Without one they are received and dropped.
    pub fn with_markers(mut self, sink: Arc<dyn crate::MarkerSink>) -> Self {
        self.markers = Some(sink);
        self
    }

    pub fn device_name(&self) -> &str {
        &self.dev.name
    }

    /// Publishes this device's prebuilt QPs into `total`, the node's sum over its devices (a
    /// fabric over several devices gives them one), instead of a total of its own. Called right
    /// after opening, before anything is built.
    pub(crate) fn with_prebuilt_total(mut self, total: Arc<crate::metrics::PrebuiltTotal>) -> Self {
        self.prebuilt_share = Arc::new(crate::metrics::PrebuiltShare::new(total));
        self
    }

    pub fn gid_index(&self) -> u32 {
        self.dev.view().gid_index
    }

    /// The opened device (its facts, context and port), for a fabric over several devices.
    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// The initiator's half of a connection on this device, concretely: a fabric over several
    /// devices prepares one per device and finishes each with its own QP numbering.
    pub(crate) fn prepare_part(&self, peer: &str, qps: usize, depth: usize, sink: CompletionSink) -> Result<VerbsPrepared, FabricError> {
        let (inner, prebuilt) = self.connection(Shape::initiator(qps, depth), peer)?;
        Ok(VerbsPrepared { inner, dev: Arc::clone(&self.dev), opts: (*self.opts).clone(), sink, prebuilt })
    }

    /// The responder's half of a connection on this device, and whether its QPs were prebuilt
    /// (a fabric over several devices counts one build per connection, not one per device).
    pub(crate) async fn accept_part(
        &self,
        peer: &str,
        connection_id: &xfer_engine::ids::ConnectionId,
        remote: &[Endpoint],
    ) -> Result<(Vec<Endpoint>, Box<dyn Accepted>, bool), FabricError> {
        // An initiator over several devices offers one group of QPs per device (a rail): this
        // one device answers the group it reaches, tagged with its number.
        let v = self.dev.view();
        let facts = super::rails::reach::RailFacts {
            device: self.dev.name.clone(),
            link_layer: v.link_layer,
            gid: v.gid,
            ipv4_prefix: v.ipv4_prefix,
        };
        let (chosen, rail) = super::rails::one_rail(facts, remote)?;
        let remote = &chosen[..];
        // Validate before allocating anything for the peer.
        negotiate::validate_remote(&self.dev.local_port(), remote, None)?;
        // The responder posts nothing but window binds (grant mode mw), one at a time per QP: a
        // one-WR send queue and no completion channel (binds are polled by `bind_windows`). Its
        // receives (notification markers) complete on a CQ of their own.
        let started = std::time::Instant::now();
        let (inner, prebuilt) = self.connection(Shape::responder(remote.len(), self.opts.mw_grants()), peer)?;
        let mut eps = inner.endpoints(&self.dev);
        if let Some(rail) = rail {
            for e in &mut eps {
                if let Endpoint::Verbs(v) = e {
                    v.rail = rail;
                }
            }
        }
        let acc = Arc::new(VerbsAccepted::new(inner, connection_id.clone(), self.markers.clone(), Arc::clone(&self.poller)));
        // The agent refuses an id it holds, but only once the fabric answered: two offers under
        // one id racing each other both get here, and the later must not take the earlier's
        // place in the index (grants would bind windows on its QPs). An entry whose handle was
        // dropped has left the index already, so a live one is a connection still open.
        {
            let mut index = self.accepted.lock().unwrap_or_else(|e| e.into_inner());
            if index.get(connection_id).is_some_and(|w| w.strong_count() > 0) {
                return Err(FabricError::Negotiation {
                    step: "connect",
                    attr: "connection_id",
                    detail: format!("connection {connection_id} is already open on this agent"),
                });
            }
            index.insert(connection_id.clone(), Arc::downgrade(&acc));
        }
        // The initiator needs only our QP numbers and PSNs to move its own QPs to RTS: answer
        // with them now and move ours to RTR and RTS while the answer travels (a third of the
        // handshake in the VM; see `Accepted::readiness` for why no byte can arrive early).
        let (dev, opts, remote, finishing) = (Arc::clone(&self.dev), Arc::clone(&self.opts), remote.to_vec(), Arc::clone(&acc));
        tokio::task::spawn_blocking(move || {
            finishing.finish(&dev, &opts, &remote);
            crate::metrics::accept_ready(started.elapsed());
        });
        Ok((eps, Box::new(AcceptedHandle { acc, index: Arc::clone(&self.accepted), id: connection_id.clone() }), prebuilt))
    }

    /// Finds our own registration behind a trait object (grant MRs are over its memory, windows
    /// are bound to its MR).
    fn ours(reg: &Arc<dyn Registration>) -> Result<&VerbsRegistration, FabricError> {
        reg.as_any()
            .downcast_ref::<VerbsRegistration>()
            .ok_or_else(|| FabricError::Registration("registration does not belong to the verbs fabric".into()))
    }
}

#[async_trait]
impl Fabric for VerbsFabric {
    fn grants_need_connection(&self) -> bool {
        self.opts.mw_grants()
    }

    fn kind(&self) -> FabricKind {
        FabricKind::Verbs
    }

    fn polled(&self) -> bool {
        true
    }

    fn device_name(&self) -> Option<&str> {
        Some(VerbsFabric::device_name(self))
    }

    fn info(&self) -> FabricInfo {
        FabricInfo { kind: FabricKind::Verbs, devices: vec![self.dev.info()], data_address: None }
    }

    fn register(&self, memory: Arc<RegionMemory>, access: Access) -> Result<Arc<dyn Registration>, FabricError> {
        Ok(Arc::new(VerbsRegistration::new(&self.dev.pd, memory, access, self.opts.grant_mode)?))
    }

    async fn expose(&self, reg: &Arc<dyn Registration>, req: &ExposeRequest) -> Result<Exposure, FabricError> {
        // Mode `region` only hands out a key; `mr` pins pages (ibv_reg_mr) and `mw` waits for
        // the binds' completions, so those run on the blocking pool, never on a runtime thread.
        if self.opts.grant_mode == GrantMode::Region {
            return expose_now(&self.dev, &self.opts, &self.accepted, reg, req, None);
        }
        let (dev, opts, reg, req) = (Arc::clone(&self.dev), Arc::clone(&self.opts), Arc::clone(reg), req.clone());
        let accepted = Arc::clone(&self.accepted);
        on_blocking_pool(move |pool| expose_now(&dev, &opts, &accepted, &reg, &req, Some(pool)))
            .await
            .map_err(|e| FabricError::Other(format!("exposing a grant: {e}")))?
    }

    async fn prepare(
        &self,
        peer: &str,
        _connection_id: &xfer_engine::ids::ConnectionId,
        qps: usize,
        depth: usize,
        sink: CompletionSink,
    ) -> Result<Box<dyn PendingConnection>, FabricError> {
        let part = self.prepare_part(peer, qps, depth, sink)?;
        crate::metrics::connection_build("initiator", part.prebuilt);
        Ok(Box::new(part))
    }

    async fn accept(
        &self,
        peer: &str,
        connection_id: &xfer_engine::ids::ConnectionId,
        remote: &[Endpoint],
    ) -> Result<(Vec<Endpoint>, Box<dyn Accepted>), FabricError> {
        let (eps, acc, prebuilt) = self.accept_part(peer, connection_id, remote).await?;
        crate::metrics::connection_build("responder", prebuilt);
        Ok((eps, acc))
    }
}

/// Builds what `pool` is short of on this thread and publishes what it then holds.
fn fill(
    pool: &Prebuilt<Shape, ConnInner>,
    dev: &Arc<Device>,
    opts: &VerbsOptions,
    share: &crate::metrics::PrebuiltShare,
) -> Result<usize, FabricError> {
    let built = pool.refill(|s: &Shape| s.build(dev, opts, ""));
    share.publish(pool.held().1);
    built
}

/// [`fill`] off any negotiation: a failure is logged, and the next negotiation's take retries.
fn fill_or_log(pool: &Prebuilt<Shape, ConnInner>, dev: &Arc<Device>, opts: &VerbsOptions, share: &crate::metrics::PrebuiltShare) {
    if let Err(e) = fill(pool, dev, opts, share) {
        tracing::debug!(error = %e, "building connections ahead of need failed (the next negotiation retries)");
    }
}

/// [`Fabric::expose`] for verbs, synchronously: on the blocking pool for modes `mr` and `mw`
/// (`pool`, the proof of it, which mode `mw`'s binds need), inline for mode `region`.
fn expose_now(
    dev: &Arc<Device>,
    opts: &VerbsOptions,
    accepted: &AcceptedIndex,
    reg: &Arc<dyn Registration>,
    req: &ExposeRequest,
    pool: Option<&OnBlockingPool>,
) -> Result<Exposure, FabricError> {
    let vreg = VerbsFabric::ours(reg)?;
    let memory = reg.memory();
    memory.check(req.offset, req.len).map_err(|e| FabricError::LocalRange(e.to_string()))?;
    if req.len == 0 {
        return Err(FabricError::LocalRange("cannot expose an empty range".into()));
    }
    if !reg.access().allows(req.op) {
        return Err(FabricError::Registration(format!("region access ceiling {} does not allow remote {}", reg.access(), req.op)));
    }
    let addr = reg.addr() + req.offset;
    match opts.grant_mode {
        GrantMode::Region => {
            // Only a fabric opened in grant mode `region` gives region MRs remote access; in
            // `mr` and `mw` the region MR's keys open nothing remotely.
            if !vreg.remote_key_exposed() {
                return Err(FabricError::Other(
                    "grant mode region needs the fabric opened for it (verbs.grant_mode = \"region\" at \
                     start-up): this region's MR has local access only"
                        .into(),
                ));
            }
            Ok(Exposure { addr, key: RemoteKey::Rkey(reg.rkey()), keepalive: None })
        }
        GrantMode::Mr => {
            let flags = match req.op {
                RemoteOp::Read => AccessFlags::RemoteRead,
                RemoteOp::Write => {
                    if !memory.writable() {
                        return Err(FabricError::Registration("remote write to read-only memory".into()));
                    }
                    AccessFlags::RemoteWrite | AccessFlags::LocalWrite
                }
            };
            // A dedicated MR over exactly the granted range (it keeps the memory alive); dropping
            // it deregisters (revokes) it.
            let grant_mr: Arc<Mr> = Mr::register(&dev.pd, memory, req.offset, req.len, flags)?;
            let key = RemoteKey::Rkey(grant_mr.rkey());
            Ok(Exposure { addr, key, keepalive: Some(Box::new(grant_mr)) })
        }
        GrantMode::Mw => {
            if dev.max_mw == 0 {
                return Err(FabricError::Other(format!("device {} supports no memory windows (max_mw 0)", dev.name)));
            }
            let Some(conn) = &req.connection else {
                return Err(FabricError::Other("grant mode mw binds a window on the grantee's QPs: the grant names no connection".into()));
            };
            let found = accepted.lock().unwrap_or_else(|e| e.into_inner()).get(conn).and_then(std::sync::Weak::upgrade);
            let Some(accepted) = found else {
                return Err(FabricError::Other(format!("connection {conn} is not open on this agent")));
            };
            let access = match req.op {
                RemoteOp::Read => WindowAccess::RemoteRead,
                RemoteOp::Write => {
                    if !memory.writable() {
                        return Err(FabricError::Registration("remote write to read-only memory".into()));
                    }
                    WindowAccess::RemoteWrite
                }
            };
            // `expose` runs this mode on the blocking pool; the bind waits for the device there.
            let Some(pool) = pool else {
                return Err(FabricError::Other("a memory-window bind waits for the device and must run on the blocking pool".into()));
            };
            let grant = accepted.bind_windows(pool, &dev.pd, &vreg.mr, req.offset, req.len, access)?;
            let key = RemoteKey::PerQp(grant.rkeys().into());
            Ok(Exposure { addr, key, keepalive: Some(Box::new(grant)) })
        }
    }
}
