//! The initiator's multi-device connection between `prepare` and `Peer.Connect`'s answer: one
//! part per device whose port is up, each offering its QPs as one *rail* (its endpoints tagged
//! with the rail number and the device), and `complete`, which keeps the rails the responder
//! answered and numbers their QPs rail after rail.
use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;

use super::connection::{Rail, RailsConnection};
use super::RailDevice;
use crate::verbs::initiator::VerbsPrepared;
use crate::{CompletionSink, Connection, Endpoint, FabricError, PendingConnection};

/// One offered rail: the device (the fabric's index) and its prepared QPs.
struct Part {
    device: usize,
    prepared: VerbsPrepared,
}

pub(crate) struct RailsPending {
    parts: Vec<Part>,
    devices: Arc<[Arc<RailDevice>]>,
    /// Devices left out because they were down: the connection wants replacing once one is up.
    down: Vec<usize>,
}

impl RailsPending {
    /// Prepares `qps` QPs on every device that is up; a device whose part cannot be built is
    /// left out (logged) unless none is left.
    pub fn prepare(
        devices: &Arc<[Arc<RailDevice>]>,
        peer: &str,
        qps: usize,
        depth: usize,
        sink: CompletionSink,
    ) -> Result<RailsPending, FabricError> {
        let mut parts = Vec::with_capacity(devices.len());
        let mut down = Vec::new();
        let mut first_error = None;
        for (i, d) in devices.iter().enumerate() {
            if !d.offered() {
                down.push(i);
                continue;
            }
            match d.fabric.prepare_part(peer, qps, depth, sink.clone()) {
                Ok(prepared) => parts.push(Part { device: i, prepared }),
                Err(e) => {
                    tracing::warn!(device = %d.name(), %peer, error = %e, "cannot prepare this device's part of a connection; leaving it out");
                    first_error.get_or_insert(e);
                }
            }
        }
        if parts.is_empty() {
            return Err(first_error.unwrap_or_else(|| {
                let names: Vec<&str> = devices.iter().map(|d| d.name()).collect();
                FabricError::NoDevice(format!("no device has an ACTIVE port now ({})", names.join(", ")))
            }));
        }
        Ok(RailsPending { parts, devices: Arc::clone(devices), down })
    }
}

/// Groups `remote` by rail, in rail order, keeping each rail's endpoints in their order.
pub(crate) fn by_rail(remote: &[Endpoint]) -> Result<BTreeMap<u32, Vec<Endpoint>>, FabricError> {
    let mut rails: BTreeMap<u32, Vec<Endpoint>> = BTreeMap::new();
    for e in remote {
        let Endpoint::Verbs(v) = e else {
            return Err(FabricError::Negotiation {
                step: "negotiate",
                attr: "endpoint",
                detail: "the peer sent a non-verbs endpoint".into(),
            });
        };
        rails.entry(v.rail).or_default().push(e.clone());
    }
    Ok(rails)
}

#[async_trait]
impl PendingConnection for RailsPending {
    fn local_endpoints(&self) -> Vec<Endpoint> {
        let mut out = Vec::new();
        for (rail, part) in self.parts.iter().enumerate() {
            for mut e in part.prepared.local_endpoints() {
                if let Endpoint::Verbs(v) = &mut e {
                    v.rail = rail as u32;
                }
                out.push(e);
            }
        }
        out
    }

    async fn complete(self: Box<Self>, remote: &[Endpoint]) -> Result<Arc<dyn Connection>, FabricError> {
        let mut answered = by_rail(remote)?;
        if let Some(&extra) = answered.keys().find(|&&r| r as usize >= self.parts.len()) {
            return Err(FabricError::Negotiation {
                step: "negotiate",
                attr: "rail",
                detail: format!("the peer answered rail {extra}, and only {} were offered", self.parts.len()),
            });
        }
        let mut rails = Vec::new();
        let mut base = 0;
        // Parts the peer did not answer are dropped here: their QPs never left INIT.
        for (rail, part) in self.parts.into_iter().enumerate() {
            let Some(eps) = answered.remove(&(rail as u32)) else { continue };
            let remote_device = match eps.first() {
                Some(Endpoint::Verbs(v)) => v.device.clone(),
                _ => String::new(),
            };
            let qps = part.prepared.qps();
            let conn = part.prepared.complete_at(&eps, base)?;
            let device = &self.devices[part.device];
            device.track(&conn);
            rails.push(Rail { conn, device: part.device, name: device.name().to_string(), remote_device, base, qps });
            base += qps;
        }
        if rails.is_empty() {
            return Err(FabricError::Negotiation {
                step: "negotiate",
                attr: "rail",
                detail: "the peer answered none of the offered devices".into(),
            });
        }
        Ok(Arc::new(RailsConnection::new(rails, Arc::clone(&self.devices), self.down)))
    }
}
