//! The initiator's multi-device connection between `prepare` and `Peer.Connect`'s answer: one
//! part per device whose port is up, each offering its QPs as one *rail* (its endpoints tagged
//! with the rail number and the device), and `complete`, which keeps the rails the responder
//! answered and numbers their QPs rail after rail (the tcp fallback's last, when it has one).
//! The responder's answer is checked for every rail before any QP moves (a bad answer fails the
//! Connect); a rail whose QPs then cannot be moved to RTS is kept dead (`connection::settle`).
use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;

use super::connection::{settle, Moved, Rail, RailsConnection};
use super::fallback::{split, Fallback, PendingTcp};
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
    /// The tcp fallback rail, offered with a request endpoint after the devices' rails.
    tcp: Option<(PendingTcp, Arc<Fallback>)>,
    peer: String,
    /// Where the tcp rail's completions are forwarded (the devices' parts have their clones).
    sink: CompletionSink,
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
        Ok(RailsPending { parts, devices: Arc::clone(devices), down, tcp: None, peer: peer.to_string(), sink })
    }

    /// Whether every device's part came from its prebuilt pool.
    pub fn prebuilt(&self) -> bool {
        self.parts.iter().all(|p| p.prepared.prebuilt)
    }

    /// Offers the tcp fallback rail too.
    pub fn with_fallback(&mut self, tcp: PendingTcp, fallback: Arc<Fallback>) {
        self.tcp = Some((tcp, fallback));
    }
}

/// Groups `remote` by rail, in rail order, keeping each rail's endpoints in their order.
pub(crate) fn by_rail(remote: &[Endpoint]) -> Result<BTreeMap<u32, Vec<Endpoint>>, FabricError> {
    let mut rails: BTreeMap<u32, Vec<Endpoint>> = BTreeMap::new();
    // A tcp fallback request is not a rail of devices: the fallback (if any) answers it.
    for e in remote.iter().filter(|e| !e.is_tcp_fallback_request()) {
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
        if self.tcp.is_some() {
            out.push(Endpoint::tcp_fallback_request());
        }
        out
    }

    async fn complete(self: Box<Self>, remote: &[Endpoint]) -> Result<Arc<dyn Connection>, FabricError> {
        let (verbs, tcp_answer) = split(remote);
        let mut answered = by_rail(&verbs)?;
        if let Some(&extra) = answered.keys().find(|&&r| r as usize >= self.parts.len()) {
            return Err(FabricError::Negotiation {
                step: "negotiate",
                attr: "rail",
                detail: format!("the peer answered rail {extra}, and only {} were offered", self.parts.len()),
            });
        }
        // The peer's answer for every rail is checked before any QP moves: endpoints that are not
        // valid are the peer's doing (broken or hostile) and fail the whole Connect.
        let mut checked = Vec::with_capacity(answered.len());
        // Parts the peer did not answer are dropped here: their QPs never left INIT.
        for (rail, part) in self.parts.into_iter().enumerate() {
            let Some(eps) = answered.remove(&(rail as u32)) else { continue };
            let remote_device = match eps.first() {
                Some(Endpoint::Verbs(v)) => v.device.clone(),
                _ => String::new(),
            };
            let ok = part.prepared.check(&eps)?;
            checked.push((part, remote_device, ok));
        }
        if checked.is_empty() {
            return Err(FabricError::Negotiation {
                step: "negotiate",
                attr: "rail",
                detail: "the peer answered none of the offered devices".into(),
            });
        }
        // Then each rail's QPs move to RTS on their own device: one that cannot is the local
        // device's failure (no route to the peer's GID), which leaves that rail dead, not the
        // connection.
        let mut moved = Vec::with_capacity(checked.len());
        let mut base = 0;
        for (part, remote_device, ok) in checked {
            let qps = part.prepared.qps();
            let device = &self.devices[part.device];
            let outcome = part.prepared.complete_checked(&ok, base).map(|conn| {
                device.track(&conn);
                let mtu = conn.path_mtu();
                (conn as Arc<dyn Connection>, mtu)
            });
            let place = Rail { conn: None, mtu: 0, device: part.device, name: device.name().to_string(), remote_device, base, qps };
            moved.push(Moved { rail: place, outcome });
            base += qps;
        }
        let rails = settle(&self.peer, moved)?;
        let tcp = match (self.tcp, tcp_answer) {
            (Some((pending, _)), Some(answer)) => match pending.complete(&answer, base, self.sink).await {
                Ok(rail) => Some(rail),
                // A standby that cannot be opened leaves the devices' rails as they are.
                Err(e) => {
                    tracing::warn!(peer = %self.peer, error = %e, "cannot open the tcp fallback rail; this connection has none");
                    None
                }
            },
            (Some((_, fallback)), None) => {
                fallback.peer_has_none(&self.peer);
                None
            }
            (None, Some(_)) => {
                return Err(FabricError::Negotiation {
                    step: "negotiate",
                    attr: "fallback",
                    detail: "the peer answered a tcp rail that was not asked for".into(),
                })
            }
            (None, None) => None,
        };
        Ok(Arc::new(RailsConnection::new(rails, Arc::clone(&self.devices), self.down).with_fallback(tcp)))
    }
}
