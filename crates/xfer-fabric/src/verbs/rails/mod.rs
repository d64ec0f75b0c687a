//! [`RailsFabric`]: one verbs fabric over every device of the node. Each device keeps its own
//! single-device [`VerbsFabric`] (context, PD, prebuilt pool, accepted index); this fabric
//! composes them:
//! * a registration is one MR per device ([`register`]);
//! * a connection is one part per *rail*, a local device matched one to one with a peer's device
//!   it reaches ([`reach`]): the initiator offers one group of QPs per device whose port is up
//!   ([`pending`]), the responder answers the groups its devices reach ([`accept`]), and the
//!   initiator's connection numbers the QPs rail after rail and routes each post to its device
//!   ([`connection`]), telling the transfer machine which QPs share a path (`Connection::paths`);
//! * a grant is exposed on every device that carries a rail of the grantee's connection, with
//!   one key per QP (`RemoteKey::PerQp`), so grants always need the connection.
//!
//! A device takes part in a connection at most once, so each part can use the parent's
//! connection id in its own device's fabric: markers and window binds need no mapping.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use xfer_rdma::memory::RegionMemory;

use super::device::query_port;
use super::options::VerbsOptions;
use super::VerbsFabric;
use crate::{
    Accepted, Access, CompletionSink, Endpoint, ExposeRequest, Exposure, Fabric, FabricError, FabricInfo, FabricKind, PendingConnection,
    Registration,
};

mod accept;
mod connection;
mod pending;
pub mod reach;
mod register;

/// `ibv_port_state` IBV_PORT_ACTIVE.
const PORT_ACTIVE: u32 = 4;

/// One device of a [`RailsFabric`].
pub(crate) struct RailDevice {
    pub fabric: VerbsFabric,
    /// Cleared when the device reports its port or itself down, set again when the port is
    /// ACTIVE; a device that is not up is not offered to new connections.
    up: AtomicBool,
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

    /// Whether new connections may use this device: not reported down, and its port ACTIVE now.
    pub fn offered(&self) -> bool {
        self.up.load(Ordering::Acquire) && self.port_active()
    }

    /// Records what the device reported about itself (its async events).
    pub fn set_up(&self, up: bool) {
        self.up.store(up, Ordering::Release);
    }

    /// What the peer matches this device by.
    pub fn facts(&self) -> reach::RailFacts {
        let d = self.fabric.device();
        reach::RailFacts { device: d.name.clone(), link_layer: d.link_layer.clone(), gid: d.gid, ipv4_prefix: d.ipv4_prefix }
    }
}

/// One device's state as [`RailsFabric::device_states`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceState {
    pub name: String,
    /// New connections use it: not reported down, and its port ACTIVE.
    pub up: bool,
}

/// The verbs data plane over several devices. See the module docs.
pub struct RailsFabric {
    devices: Arc<[Arc<RailDevice>]>,
    accepted: Arc<accept::AcceptedIndex>,
}

impl std::fmt::Debug for RailsFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.devices.iter().map(|d| d.name()).collect();
        f.debug_struct("RailsFabric").field("devices", &names).finish()
    }
}

impl RailsFabric {
    /// Opens one [`VerbsFabric`] per entry of `per_device` (each naming its device, port and
    /// GID), all reporting markers to `markers`.
    pub fn open(per_device: Vec<VerbsOptions>, markers: Arc<dyn crate::MarkerSink>) -> Result<RailsFabric, FabricError> {
        if per_device.is_empty() {
            return Err(FabricError::NoDevice("no devices to open".into()));
        }
        let mut devices = Vec::with_capacity(per_device.len());
        for o in per_device {
            let fabric = VerbsFabric::open(o)?.with_markers(Arc::clone(&markers));
            devices.push(Arc::new(RailDevice { fabric, up: AtomicBool::new(true) }));
        }
        Ok(RailsFabric { devices: devices.into(), accepted: Arc::default() })
    }

    /// Builds connections of `qps` QPs per device and `depth` ahead of need on every device.
    pub fn prebuild(&self, qps: usize, depth: usize) {
        for d in self.devices.iter() {
            d.fabric.prebuild(qps, depth);
        }
    }

    /// Every device, in order, and whether new connections use it.
    pub fn device_states(&self) -> Vec<DeviceState> {
        self.devices.iter().map(|d| DeviceState { name: d.name().to_string(), up: d.offered() }).collect()
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
        FabricInfo { kind: FabricKind::Verbs, devices: self.devices.iter().map(|d| d.fabric.device().info()).collect(), data_address: None }
    }

    fn polled(&self) -> bool {
        true
    }

    /// The first device: where the data-path worker thread is placed.
    fn device_name(&self) -> Option<&str> {
        self.devices.first().map(|d| d.name())
    }

    fn register(&self, memory: Arc<RegionMemory>, access: Access) -> Result<Arc<dyn Registration>, FabricError> {
        Ok(Arc::new(register::RailsRegistration::register(&self.devices, memory, access)?))
    }

    async fn expose(&self, reg: &Arc<dyn Registration>, req: &ExposeRequest) -> Result<Exposure, FabricError> {
        accept::expose(&self.devices, &self.accepted, reg, req).await
    }

    async fn prepare(
        &self,
        peer: &str,
        _connection_id: &xfer_engine::ids::ConnectionId,
        qps: usize,
        depth: usize,
        sink: CompletionSink,
    ) -> Result<Box<dyn PendingConnection>, FabricError> {
        Ok(Box::new(pending::RailsPending::prepare(&self.devices, peer, qps, depth, sink)?))
    }

    async fn accept(
        &self,
        peer: &str,
        connection_id: &xfer_engine::ids::ConnectionId,
        remote: &[Endpoint],
    ) -> Result<(Vec<Endpoint>, Box<dyn Accepted>), FabricError> {
        accept::accept(&self.devices, &self.accepted, peer, connection_id, remote).await
    }
}
