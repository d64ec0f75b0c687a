//! A region registered with every device of a [`super::RailsFabric`]: one MR per device (each
//! device has its own keys), behind one [`Registration`]. Posting picks the MR of the device a
//! QP is on; exposing a grant exposes each device's MR. With a tcp fallback the memory is
//! registered with the tcp fabric too (no keys: its grants are tokens), for the tcp rail's posts.
use std::sync::Arc;

use xfer_rdma::memory::RegionMemory;

use super::RailDevice;
use crate::{Access, Fabric, FabricError, Registration};

/// One registration per device, in the fabric's device order.
pub(crate) struct RailsRegistration {
    parts: Vec<Arc<dyn Registration>>,
    /// The tcp fallback's registration of the same memory.
    tcp: Option<Arc<dyn Registration>>,
    memory: Arc<RegionMemory>,
    access: Access,
}

impl std::fmt::Debug for RailsRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RailsRegistration").field("memory", &self.memory).field("devices", &self.parts.len()).finish()
    }
}

impl RailsRegistration {
    /// Registers `memory` on every device (a port that is down still registers: the MR is ready
    /// when the port comes back).
    pub fn register(
        devices: &[Arc<RailDevice>],
        fallback: Option<&Arc<dyn Fabric>>,
        memory: Arc<RegionMemory>,
        access: Access,
    ) -> Result<RailsRegistration, FabricError> {
        let mut parts = Vec::with_capacity(devices.len());
        for d in devices {
            let reg = d.fabric.register(Arc::clone(&memory), access).map_err(|e| match e {
                FabricError::Registration(m) => FabricError::Registration(format!("{}: {m}", d.name())),
                other => other,
            })?;
            parts.push(reg);
        }
        let tcp = fallback.map(|f| f.register(Arc::clone(&memory), access)).transpose()?;
        Ok(RailsRegistration { parts, tcp, memory, access })
    }

    /// The tcp fallback's registration, if the fabric has one.
    pub fn tcp_part(&self) -> Option<&Arc<dyn Registration>> {
        self.tcp.as_ref()
    }

    /// The registration on device `device` (the fabric's index).
    pub fn part(&self, device: usize) -> Option<&Arc<dyn Registration>> {
        self.parts.get(device)
    }

    /// Ours, behind a trait object.
    pub fn of(reg: &Arc<dyn Registration>) -> Result<&RailsRegistration, FabricError> {
        reg.as_any()
            .downcast_ref::<RailsRegistration>()
            .ok_or_else(|| FabricError::Registration("registration does not belong to this multi-device verbs fabric".into()))
    }
}

impl Registration for RailsRegistration {
    fn memory(&self) -> &Arc<RegionMemory> {
        &self.memory
    }
    // The first device's keys: what a caller that knows one device sees. Grants hand out every
    // device's keys (`RemoteKey::PerQp`).
    fn lkey(&self) -> u32 {
        self.parts.first().map_or(0, |p| p.lkey())
    }
    fn rkey(&self) -> u32 {
        self.parts.first().map_or(0, |p| p.rkey())
    }
    fn access(&self) -> Access {
        self.access
    }
    fn remote_key_exposed(&self) -> bool {
        self.parts.first().is_some_and(|p| p.remote_key_exposed())
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
