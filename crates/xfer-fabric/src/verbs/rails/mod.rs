//! [`RailsFabric`]: one verbs fabric over every device of the node. Each device keeps its own
//! single-device [`VerbsFabric`] (context, PD, prebuilt pool, accepted index); this fabric
//! composes them:
//! * a registration is one MR per device (`register`);
//! * a connection is one part per *rail*, a local device matched one to one with a peer's device
//!   it reaches ([`reach`]): the initiator offers one group of QPs per device whose port is up
//!   (`pending`), the responder answers the groups its devices reach (`accept`), and the
//!   initiator's connection numbers the QPs rail after rail and routes each post to its device
//!   (`connection`), telling the transfer machine which QPs share a path (`Connection::paths`);
//!   a rail whose QPs cannot be moved to RTS at Connect (no route to the peer's device yet the
//!   port still ACTIVE) is left out, not the connection: the initiator keeps it dead in the QP
//!   numbering, the responder's readiness waits for its other parts (`ready`);
//! * a grant is exposed on every device that carries a rail of the grantee's connection, with
//!   one key per QP (`RemoteKey::PerQp`), so grants always need the connection.
//!
//! With a tcp fallback ([`RailsFabric::with_fallback`], `fallback`) every connection also
//! offers the agent's tcp fabric as one last rail, a standby path used only when no device's
//! path is up; its grants' keys are then `RemoteKey::Each` (an rkey per verbs QP, then a token).
//!
//! A device takes part in a connection at most once, so each part can use the parent's
//! connection id in its own device's fabric: markers and window binds need no mapping.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use async_trait::async_trait;
use xfer_rdma::memory::RegionMemory;

use super::device::query_port;
use super::initiator::VerbsConnection;
use super::options::VerbsOptions;
use super::VerbsFabric;
use crate::{
    Accepted, Access, CompletionSink, DeviceState, Endpoint, ExposeRequest, Exposure, Fabric, FabricError, FabricInfo, FabricKind,
    PendingConnection, Registration,
};

mod accept;
mod connection;
pub(crate) use accept::one_rail;
mod events;
mod fallback;
mod pending;
pub mod reach;
mod ready;
mod register;

/// `ibv_port_state` IBV_PORT_ACTIVE.
const PORT_ACTIVE: u32 = 4;

/// The key a responder's grant carries for each QP of a part that failed: nothing is exposed on
/// it, as nothing can land there (its QPs are in ERR), and the slots keep every later QP's key in
/// place. The initiator posts nothing with it (`connection::translate`: the QP counts as broken).
pub(crate) const NO_KEY: u32 = 0;

/// One device of a [`RailsFabric`].
pub(crate) struct RailDevice {
    pub fabric: VerbsFabric,
    /// Cleared when the device reports its port or itself down, set again when the port is
    /// ACTIVE; a device that is not up is not offered to new connections.
    up: AtomicBool,
    /// The initiator's connection parts on this device, moved to ERR when it goes down.
    parts: Mutex<Vec<Weak<VerbsConnection>>>,
    /// Counts the fabric's device state changes (shared by its devices).
    changes: Arc<tokio::sync::watch::Sender<u64>>,
    /// Left out of new connections by the agent ([`Fabric::hold_back`]), whatever its port says.
    held_back: AtomicBool,
}

impl RailDevice {
    pub fn name(&self) -> &str {
        self.fabric.device_name()
    }

    /// Whether the port is ACTIVE now (asks the device).
    pub fn port_active(&self) -> bool {
        let dev = self.fabric.device();
        query_port(&dev.ctx, dev.port).is_ok_and(|f| f.state == PORT_ACTIVE)
    }

    /// Whether the device is up: not reported down, its port ACTIVE now, and its port's facts
    /// read while ACTIVE. A device opened with its port down reads them here until they are
    /// settled, not only on its port's events: the event may be handled after the port is
    /// ACTIVE, or before its IPv4 GID is back, and the events thread may be missing.
    pub fn up(&self) -> bool {
        self.up.load(Ordering::Acquire) && self.port_active() && (self.fabric.device().view().settled || self.refresh())
    }

    /// Reads the port's facts again (see `Device::refresh`); a change is announced like a state
    /// change, so idle connections built on the old facts are replaced. Whether the facts kept
    /// (new, or the last ones if reading failed) are usable.
    fn refresh(&self) -> bool {
        match self.fabric.device().refresh() {
            Ok((view, changed)) => {
                if changed {
                    self.changes.send_modify(|n| *n += 1);
                }
                view.active
            }
            Err(e) => {
                tracing::debug!(device = %self.name(), error = %e, "the device's port facts are not usable yet");
                self.fabric.device().view().active
            }
        }
    }

    /// Whether new connections may use this device: up, and not held back.
    pub fn offered(&self) -> bool {
        !self.held_back.load(Ordering::Acquire) && self.up()
    }

    fn state(&self) -> DeviceState {
        DeviceState { name: self.name().to_string(), up: self.up(), held_back: self.held_back.load(Ordering::Acquire) }
    }

    /// Remembers a connection part on this device, to fail it if the device goes down.
    pub fn track(&self, part: &Arc<VerbsConnection>) {
        let mut parts = self.parts.lock().unwrap_or_else(|e| e.into_inner());
        parts.retain(|p| p.strong_count() > 0);
        parts.push(Arc::downgrade(part));
    }

    /// Handles one of the device's asynchronous events.
    fn on_event(&self, ev: events::AsyncEvent) {
        let name = self.name();
        crate::metrics::device_event(name, events::label(&ev));
        let port = self.fabric.device().port;
        // A device that came up after start reads its facts (GID, LID, MTU) on its port's
        // events until they are settled; one whose facts were read up at start keeps them, as a
        // GID read while the port comes back might not be the one it had yet.
        let after = events::up_after(&ev, port);
        if (after == Some(true) || events::facts_may_change(&ev)) && !self.fabric.device().view().settled {
            self.refresh();
        }
        match after {
            Some(true) => {
                self.up.store(true, Ordering::Release);
                crate::metrics::device_port_up(name, true);
                if self.fabric.device().view().active {
                    tracing::info!(device = %name, "RDMA port is ACTIVE: offered to new connections");
                } else {
                    tracing::warn!(device = %name, "RDMA port is ACTIVE but has no usable GID yet: offered once it has one");
                }
            }
            Some(false) => {
                self.up.store(false, Ordering::Release);
                crate::metrics::device_port_up(name, false);
                let parts: Vec<Arc<VerbsConnection>> =
                    self.parts.lock().unwrap_or_else(|e| e.into_inner()).drain(..).filter_map(|p| p.upgrade()).collect();
                tracing::warn!(device = %name, event = ?ev, connections = parts.len(),
                    "RDMA device down: not offered to new connections; its connections' work requests are flushed to move to other paths");
                for p in parts {
                    p.fail();
                }
            }
            None => {
                tracing::debug!(device = %name, event = ?ev, "RDMA device event");
                return;
            }
        }
        self.changes.send_modify(|n| *n += 1);
    }

    /// What the peer matches this device by.
    pub fn facts(&self) -> reach::RailFacts {
        let d = self.fabric.device();
        let v = d.view();
        reach::RailFacts { device: d.name.clone(), link_layer: v.link_layer, gid: v.gid, ipv4_prefix: v.ipv4_prefix }
    }
}

/// The verbs data plane over several devices. See the module docs.
pub struct RailsFabric {
    devices: Arc<[Arc<RailDevice>]>,
    accepted: Arc<accept::AcceptedIndex>,
    /// One asynchronous-event thread per device, stopped when the fabric is dropped.
    _events: Vec<events::EventThread>,
    changes: Arc<tokio::sync::watch::Sender<u64>>,
    /// The tcp fabric carried as every connection's last, standby rail (`transfer.fallback = tcp`).
    fallback: Option<Arc<fallback::Fallback>>,
}

impl std::fmt::Debug for RailsFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.devices.iter().map(|d| d.name()).collect();
        f.debug_struct("RailsFabric").field("devices", &names).field("fallback", &self.fallback.is_some()).finish()
    }
}

impl RailsFabric {
    /// Opens one [`VerbsFabric`] per entry of `per_device` (each naming its device, port and
    /// GID), all reporting markers to `markers`.
    pub fn open(per_device: Vec<VerbsOptions>, markers: Arc<dyn crate::MarkerSink>) -> Result<RailsFabric, FabricError> {
        if per_device.is_empty() {
            return Err(FabricError::NoDevice("no devices to open".into()));
        }
        let opened = per_device.into_iter().map(VerbsFabric::open).collect::<Result<Vec<_>, _>>()?;
        Ok(RailsFabric::over(opened, markers))
    }

    /// A fabric over `opened` (one or more devices, just opened: nothing built on them yet), all
    /// reporting markers to `markers`. A device whose port is not ACTIVE yet is opened all the
    /// same and offered once it is.
    pub(crate) fn over(opened: Vec<VerbsFabric>, markers: Arc<dyn crate::MarkerSink>) -> RailsFabric {
        let mut devices = Vec::with_capacity(opened.len());
        let changes = Arc::new(tokio::sync::watch::Sender::new(0));
        // `xfer_prebuilt_qps` is the node's: every device's pool adds to one total.
        let prebuilt = Arc::new(crate::metrics::PrebuiltTotal::default());
        for f in opened {
            let fabric = f.with_markers(Arc::clone(&markers)).with_prebuilt_total(Arc::clone(&prebuilt));
            devices.push(Arc::new(RailDevice {
                fabric,
                up: AtomicBool::new(true),
                parts: Mutex::default(),
                changes: Arc::clone(&changes),
                held_back: AtomicBool::new(false),
            }));
        }
        let mut threads = Vec::with_capacity(devices.len());
        for d in &devices {
            crate::metrics::device_port_up(d.name(), d.up());
            if !d.fabric.device().view().active {
                tracing::warn!(device = %d.name(), "RDMA device's port is not ACTIVE at start: offered to new connections once it is");
            }
            let weak = Arc::downgrade(d);
            let on_event = move |ev| {
                if let Some(d) = weak.upgrade() {
                    d.on_event(ev);
                }
            };
            match events::spawn(d.name(), &d.fabric.device().ctx, on_event) {
                Ok(t) => threads.push(t),
                // Without events a device that goes down is still left out of new connections
                // (its port is queried then); only the early flush of its work requests is lost.
                Err(e) => tracing::warn!(device = %d.name(), error = %e, "cannot watch the device's asynchronous events"),
            }
        }
        RailsFabric { devices: devices.into(), accepted: Arc::default(), _events: threads, changes, fallback: None }
    }

    /// Carries `tcp` (the agent's tcp fabric, serving its data listener) as every connection's
    /// last rail: a standby path, used only when no device's path is up.
    pub fn with_fallback(mut self, tcp: Arc<dyn Fabric>) -> RailsFabric {
        self.fallback = Some(Arc::new(fallback::Fallback::new(tcp)));
        self
    }

    /// Whether connections carry a tcp fallback rail.
    pub fn has_fallback(&self) -> bool {
        self.fallback.is_some()
    }

    /// Builds connections of `qps` QPs per device and `depth` ahead of need on every device.
    pub fn prebuild(&self, qps: usize, depth: usize) {
        for d in self.devices.iter() {
            d.fabric.prebuild(qps, depth);
        }
    }

    /// Every device, in order, and whether new connections use it.
    pub fn device_states(&self) -> Vec<DeviceState> {
        self.devices.iter().map(|d| d.state()).collect()
    }

    /// Leaves `device` out of new connections, or offers it again; false if there is none.
    pub fn hold_back(&self, device: &str, held: bool) -> bool {
        let Some(d) = self.devices.iter().find(|d| d.name() == device) else { return false };
        if d.held_back.swap(held, Ordering::AcqRel) != held {
            tracing::info!(%device, held, "RDMA device {} new connections", if held { "held back from" } else { "offered to" });
            self.changes.send_modify(|n| *n += 1);
        }
        true
    }

    /// Changes whenever a device goes down or comes back (its value counts the changes): wait on
    /// it, then read [`Self::device_states`].
    pub fn state_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// The devices' names, in order.
    pub fn device_names(&self) -> Vec<String> {
        self.devices.iter().map(|d| d.name().to_string()).collect()
    }
}

#[async_trait]
impl Fabric for RailsFabric {
    fn kind(&self) -> FabricKind {
        FabricKind::Verbs
    }

    /// Each device has its own keys, so a grant's key is one per QP of the grantee's connection.
    fn grants_need_connection(&self) -> bool {
        true
    }

    fn info(&self) -> FabricInfo {
        FabricInfo {
            kind: FabricKind::Verbs,
            devices: self.devices.iter().map(|d| d.fabric.device().info()).collect(),
            // The fallback's data listener, where peers' tcp rails connect.
            data_address: self.fallback.as_ref().and_then(|f| f.fabric.info().data_address),
        }
    }

    fn polled(&self) -> bool {
        true
    }

    /// The first device: where the data-path worker thread is placed.
    fn device_name(&self) -> Option<&str> {
        self.devices.first().map(|d| d.name())
    }

    fn device_states(&self) -> Vec<DeviceState> {
        RailsFabric::device_states(self)
    }

    fn device_changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        Some(self.state_changes())
    }

    fn hold_back(&self, device: &str, held: bool) -> bool {
        RailsFabric::hold_back(self, device, held)
    }

    fn register(&self, memory: Arc<RegionMemory>, access: Access) -> Result<Arc<dyn Registration>, FabricError> {
        Ok(Arc::new(register::RailsRegistration::register(&self.devices, self.fallback.as_ref().map(|f| &f.fabric), memory, access)?))
    }

    async fn expose(&self, reg: &Arc<dyn Registration>, req: &ExposeRequest) -> Result<Exposure, FabricError> {
        accept::expose(&self.devices, self.fallback.as_deref(), &self.accepted, reg, req).await
    }

    fn connection_qps(&self, qps: usize) -> usize {
        let offered = self.devices.iter().filter(|d| d.offered()).count().max(1);
        qps.saturating_mul(offered + usize::from(self.fallback.is_some()))
    }

    async fn prepare(
        &self,
        peer: &str,
        connection_id: &xfer_engine::ids::ConnectionId,
        qps: usize,
        depth: usize,
        sink: CompletionSink,
    ) -> Result<Box<dyn PendingConnection>, FabricError> {
        // A transfer may ask for more QPs than the agent's default: refused here, naming both
        // numbers, rather than by the peer with RESOURCE_EXHAUSTED.
        let offered = self.devices.iter().filter(|d| d.offered()).count();
        xfer_engine::shape::connection_endpoints(qps, offered, self.fallback.is_some()).map_err(|detail| FabricError::Negotiation {
            step: "prepare",
            attr: "qps",
            detail,
        })?;
        let mut pending = pending::RailsPending::prepare(&self.devices, peer, qps, depth, sink)?;
        // One build per connection, whatever its devices.
        crate::metrics::connection_build("initiator", pending.prebuilt());
        if let Some(f) = &self.fallback {
            // The fallback is a standby: a connection without it still moves data.
            match fallback::PendingTcp::prepare(f, peer, connection_id, qps, depth).await {
                Ok(tcp) => pending.with_fallback(tcp, Arc::clone(f)),
                Err(e) => tracing::warn!(%peer, error = %e, "cannot prepare the tcp fallback rail; connecting without it"),
            }
        }
        Ok(Box::new(pending))
    }

    async fn accept(
        &self,
        peer: &str,
        connection_id: &xfer_engine::ids::ConnectionId,
        remote: &[Endpoint],
    ) -> Result<(Vec<Endpoint>, Box<dyn Accepted>), FabricError> {
        accept::accept(&self.devices, self.fallback.as_deref(), &self.accepted, peer, connection_id, remote).await
    }
}
