//! The responder's side of a multi-device fabric: matching the initiator's rails to our devices
//! in `Peer.Connect` (one device per rail, [`super::reach`]), the accepted connection's parts, and
//! exposing a grant on every device that carries one of its rails, with one key per QP in the
//! initiator's QP order.
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use xfer_engine::ids::ConnectionId;

use super::pending::by_rail;
use super::reach::{facts_of, match_rails, RailFacts};
use super::register::RailsRegistration;
use super::RailDevice;
use crate::{Accepted, Endpoint, ExposeRequest, Exposure, Fabric, FabricError, Readiness, Registration, RemoteKey};

/// One accepted rail: our device (the fabric's index), its QPs, and its part of the connection
/// (the device fabric's accepted handle, under the parent's connection id).
struct AcceptedPart {
    device: usize,
    qps: usize,
    handle: Box<dyn Accepted>,
}

/// The responder's multi-device connection, parts in the initiator's rail order (which is the
/// connection's QP order).
pub(crate) struct RailsAccepted {
    parts: Vec<AcceptedPart>,
    ready: tokio::sync::watch::Receiver<Readiness>,
}

/// Accepted connections by id, for grants.
pub(crate) type AcceptedIndex = Mutex<HashMap<ConnectionId, Weak<RailsAccepted>>>;

/// What `accept` hands the agent; dropping it drops every part and leaves the index.
struct AcceptedHandle {
    acc: Arc<RailsAccepted>,
    index: Arc<AcceptedIndex>,
    id: ConnectionId,
}

/// Matches the initiator's rails in `remote` to our devices that are up and accepts each
/// matched rail on its device; answers those rails only, tagged with the initiator's rail
/// numbers and our devices' names.
pub(crate) async fn accept(
    devices: &Arc<[Arc<RailDevice>]>,
    index: &Arc<AcceptedIndex>,
    peer: &str,
    id: &ConnectionId,
    remote: &[Endpoint],
) -> Result<(Vec<Endpoint>, Box<dyn Accepted>), FabricError> {
    let rails = by_rail(remote)?;
    let remote_facts: Vec<RailFacts> = rails
        .values()
        .map(|eps| match eps.first() {
            Some(Endpoint::Verbs(v)) => facts_of(v),
            _ => RailFacts::default(),
        })
        .collect();
    let offered: Vec<usize> = (0..devices.len()).filter(|&i| devices[i].offered()).collect();
    let local_facts: Vec<RailFacts> = offered.iter().map(|&i| devices[i].facts()).collect();
    let pairs = match_rails(&local_facts, &remote_facts);
    if pairs.is_empty() {
        return Err(unmatched(devices, &offered, &remote_facts));
    }
    let rail_numbers: Vec<u32> = rails.keys().copied().collect();
    let groups: Vec<Vec<Endpoint>> = rails.into_values().collect();
    let mut answer = Vec::new();
    let mut parts = Vec::with_capacity(pairs.len());
    for (r, l) in pairs {
        let device = offered[l];
        let d = &devices[device];
        let (eps, handle) = d.fabric.accept(peer, id, &groups[r]).await?;
        parts.push(AcceptedPart { device, qps: eps.len(), handle });
        for mut e in eps {
            if let Endpoint::Verbs(v) = &mut e {
                v.rail = rail_numbers[r];
            }
            answer.push(e);
        }
    }
    tracing::debug!(%peer, connection = %id, rails = parts.len(), offered = remote_facts.len(), "accepted a multi-device connection");
    let ready = combined_readiness(&parts);
    let acc = Arc::new(RailsAccepted { parts, ready });
    index.lock().unwrap_or_else(|e| e.into_inner()).insert(id.clone(), Arc::downgrade(&acc));
    Ok((answer, Box::new(AcceptedHandle { acc, index: Arc::clone(index), id: id.clone() })))
}

/// A single-device responder's answer to an initiator that offered several rails: the rail our
/// one device (`ours`) reaches best, with its endpoints, or the offer as it is when it has one
/// rail. The refusal names both sides when our device reaches none of them.
pub(crate) fn one_rail(ours: RailFacts, remote: &[Endpoint]) -> Result<(Vec<Endpoint>, Option<u32>), FabricError> {
    let rails = by_rail(remote)?;
    if rails.len() <= 1 {
        return Ok((remote.to_vec(), None));
    }
    let facts: Vec<RailFacts> = rails
        .values()
        .map(|eps| match eps.first() {
            Some(Endpoint::Verbs(v)) => facts_of(v),
            _ => RailFacts::default(),
        })
        .collect();
    let local = [ours];
    let Some(&(r, _)) = match_rails(&local, &facts).first() else {
        let theirs: Vec<String> = facts.iter().map(RailFacts::describe).collect();
        return Err(FabricError::Negotiation {
            step: "negotiate",
            attr: "devices",
            detail: format!(
                "our device {} reaches none of the peer's [{}]: a pair needs the same link layer and, on RoCE, addresses in \
                 one IPv4 subnet",
                local[0].describe(),
                theirs.join(", ")
            ),
        });
    };
    let Some((&number, eps)) = rails.iter().nth(r) else { return Ok((remote.to_vec(), None)) };
    Ok((eps.clone(), Some(number)))
}

/// The refusal when no device of ours reaches any of the initiator's: both sides' devices and
/// subnets, and what would fix it.
fn unmatched(devices: &[Arc<RailDevice>], offered: &[usize], remote: &[RailFacts]) -> FabricError {
    let ours: Vec<String> = offered.iter().map(|&i| devices[i].facts().describe()).collect();
    let down: Vec<&str> = (0..devices.len()).filter(|i| !offered.contains(i)).map(|i| devices[i].name()).collect();
    let theirs: Vec<String> = remote.iter().map(RailFacts::describe).collect();
    let down = if down.is_empty() { String::new() } else { format!(" (down here: {})", down.join(", ")) };
    FabricError::Negotiation {
        step: "negotiate",
        attr: "devices",
        detail: format!(
            "none of our devices [{}]{down} reaches any of the peer's [{}]: a pair needs the same link layer and, on RoCE, \
             addresses in one IPv4 subnet; put each NIC pair on a shared subnet, or list the devices that do in verbs.devices",
            ours.join(", "),
            theirs.join(", ")
        ),
    }
}

/// Ready once every part is; failed as soon as one fails.
fn combined_readiness(parts: &[AcceptedPart]) -> tokio::sync::watch::Receiver<Readiness> {
    let mut waits: Vec<tokio::sync::watch::Receiver<Readiness>> = parts.iter().filter_map(|p| p.handle.readiness()).collect();
    let (tx, rx) = tokio::sync::watch::channel(Readiness::Pending);
    tokio::spawn(async move {
        for w in &mut waits {
            let outcome = match w.wait_for(|r| *r != Readiness::Pending).await {
                Ok(r) => r.clone(),
                Err(_) => Readiness::Failed("the connection was dropped before it was ready".into()),
            };
            if let Readiness::Failed(_) = outcome {
                tx.send_replace(outcome);
                return;
            }
        }
        tx.send_replace(Readiness::Ready);
    });
    rx
}

impl Accepted for AcceptedHandle {
    fn drain_markers(&self) {
        for p in &self.acc.parts {
            p.handle.drain_markers();
        }
    }

    fn expect_markers(&self, until: std::time::Instant, waiting: Box<dyn Fn() -> bool + Send>) {
        // One condition for every part: whoever asks first sees the same answer.
        let waiting = Arc::new(Mutex::new(waiting));
        for p in &self.acc.parts {
            let w = Arc::clone(&waiting);
            p.handle.expect_markers(until, Box::new(move || (w.lock().unwrap_or_else(|e| e.into_inner()))()));
        }
    }

    fn readiness(&self) -> Option<tokio::sync::watch::Receiver<Readiness>> {
        Some(self.acc.ready.clone())
    }
}

impl Drop for AcceptedHandle {
    fn drop(&mut self) {
        let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        if index.get(&self.id).is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.acc))) {
            index.remove(&self.id);
        }
    }
}

/// Exposes a range on every device carrying a rail of the grantee's connection; the key has one
/// entry per QP of that connection, in the initiator's QP order.
pub(crate) async fn expose(
    devices: &[Arc<RailDevice>],
    index: &AcceptedIndex,
    reg: &Arc<dyn Registration>,
    req: &ExposeRequest,
) -> Result<Exposure, FabricError> {
    let ours = RailsRegistration::of(reg)?;
    let Some(id) = &req.connection else {
        return Err(FabricError::Other(
            "a grant on a multi-device fabric names its connection (each device has its own keys, one per QP)".into(),
        ));
    };
    let found = index.lock().unwrap_or_else(|e| e.into_inner()).get(id).and_then(Weak::upgrade);
    let Some(acc) = found else {
        return Err(FabricError::Other(format!("connection {id} is not open on this agent")));
    };
    let mut keys = Vec::new();
    let mut keep = Vec::with_capacity(acc.parts.len());
    let mut addr = None;
    for p in &acc.parts {
        let d = &devices[p.device];
        let part = ours.part(p.device).ok_or_else(|| FabricError::Registration(format!("the registration has no part on {}", d.name())))?;
        let e = d.fabric.expose(part, req).await?;
        if *addr.get_or_insert(e.addr) != e.addr {
            return Err(FabricError::Other(format!("device {} exposes the range at another address than the first device", d.name())));
        }
        expand_key(&e.key, p.qps, &mut keys).map_err(|m| FabricError::Other(format!("device {}: {m}", d.name())))?;
        keep.push(e);
    }
    let addr = addr.ok_or_else(|| FabricError::Other(format!("connection {id} has no device part")))?;
    Ok(Exposure { addr, key: RemoteKey::PerQp(keys.into()), keepalive: Some(Box::new(keep)) })
}

/// Appends one device's grant key for its `qps` QPs to `keys`: an rkey serves every QP of the
/// device, per-QP keys (windows) must be one per QP.
pub(crate) fn expand_key(key: &RemoteKey, qps: usize, keys: &mut Vec<u32>) -> Result<(), String> {
    match key {
        RemoteKey::Rkey(k) => keys.extend(std::iter::repeat_n(*k, qps)),
        RemoteKey::PerQp(ks) if ks.len() == qps => keys.extend(ks.iter().copied()),
        RemoteKey::PerQp(ks) => return Err(format!("{} per-QP keys for {qps} QPs", ks.len())),
        RemoteKey::Token(_) => return Err("a token key on a verbs device".into()),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::VerbsEndpoint;

    fn ep(rail: u32, ip: [u8; 4], qpn: u32) -> Endpoint {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&ip);
        Endpoint::Verbs(VerbsEndpoint { qpn, gid, rail, ipv4_prefix: 24, link_layer: "Ethernet".into(), ..Default::default() })
    }

    #[test]
    fn one_device_answers_the_rail_it_reaches() {
        let ours = RailFacts {
            device: "mlx5_0".into(),
            link_layer: "Ethernet".into(),
            gid: match ep(0, [10, 0, 1, 9], 1) {
                Endpoint::Verbs(v) => v.gid,
                Endpoint::Tcp { .. } => unreachable!(),
            },
            ipv4_prefix: 24,
        };
        let offer = [ep(0, [10, 0, 0, 1], 1), ep(0, [10, 0, 0, 1], 2), ep(1, [10, 0, 1, 1], 3), ep(1, [10, 0, 1, 1], 4)];
        let (eps, rail) = one_rail(ours.clone(), &offer).unwrap();
        assert_eq!(rail, Some(1));
        assert_eq!(eps, offer[2..].to_vec());
        // One rail: as it is, unchecked (what a single-device initiator sends).
        let (eps, rail) = one_rail(ours.clone(), &offer[..2]).unwrap();
        assert_eq!((eps.len(), rail), (2, None));
        let far = [ep(0, [10, 0, 5, 1], 1), ep(1, [10, 0, 6, 1], 2)];
        let e = one_rail(ours, &far).unwrap_err().to_string();
        assert!(e.contains("reaches none") && e.contains("10.0.5.1/24"), "{e}");
    }

    #[test]
    fn keys_expand_to_one_per_qp_in_rail_order() {
        let mut keys = Vec::new();
        expand_key(&RemoteKey::Rkey(7), 2, &mut keys).unwrap();
        expand_key(&RemoteKey::PerQp(vec![1, 2, 3].into()), 3, &mut keys).unwrap();
        assert_eq!(keys, vec![7, 7, 1, 2, 3]);
        assert!(expand_key(&RemoteKey::PerQp(vec![1].into()), 2, &mut keys).is_err());
        assert!(expand_key(&RemoteKey::Token([0; 16]), 1, &mut keys).is_err());
    }
}
