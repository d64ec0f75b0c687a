//! The responder's side of a multi-device fabric: matching the initiator's rails to our devices
//! in `Peer.Connect` (one device per rail, [`super::reach`]), the accepted connection's parts, and
//! exposing a grant on every device that carries one of its rails, with one key per QP in the
//! initiator's QP order. With a tcp fallback, an initiator's tcp request is accepted on the tcp
//! fabric under the same connection id, and grants add its token after the devices' keys.
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use xfer_engine::ids::ConnectionId;

use super::fallback::{split, Fallback};
use super::pending::by_rail;
use super::reach::{facts_of, match_rails, RailFacts};
use super::ready;
use super::register::RailsRegistration;
use super::{RailDevice, NO_KEY};
use crate::{Accepted, Endpoint, ExposeRequest, Exposure, Fabric, FabricError, Readiness, Registration, RemoteKey};

/// One accepted rail: our device (the fabric's index), its QPs, and its part of the connection
/// (the device fabric's accepted handle, under the parent's connection id).
struct AcceptedPart {
    device: usize,
    qps: usize,
    handle: Box<dyn Accepted>,
}

impl AcceptedPart {
    /// Whether its QPs could not be moved to RTS: the connection goes on without this rail.
    fn failed(&self) -> bool {
        self.handle.readiness().is_some_and(|r| matches!(*r.borrow(), Readiness::Failed(_)))
    }
}

/// The responder's multi-device connection, parts in the initiator's rail order (which is the
/// connection's QP order).
pub(crate) struct RailsAccepted {
    parts: Vec<AcceptedPart>,
    /// The tcp fallback's session for this connection (the tcp fabric's accepted handle).
    tcp: Option<Box<dyn Accepted>>,
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
    fallback: Option<&Fallback>,
    index: &Arc<AcceptedIndex>,
    peer: &str,
    id: &ConnectionId,
    remote: &[Endpoint],
) -> Result<(Vec<Endpoint>, Box<dyn Accepted>), FabricError> {
    // The agent refuses an id it holds, but only after the fabric answered: two offers under
    // one id racing each other would otherwise both get here, and the later one would take the
    // earlier connection's place in the index (its grants then exposed on the other's QPs).
    if live(index, id) {
        return Err(taken(id));
    }
    let (remote, tcp_request) = split(remote);
    if tcp_request.as_ref().is_some_and(|e| !e.is_tcp_fallback_request()) {
        return Err(FabricError::Negotiation {
            step: "negotiate",
            attr: "endpoint",
            detail: "the peer sent a tcp endpoint that is not a fallback request".into(),
        });
    }
    let rails = by_rail(&remote)?;
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
    let mut prebuilt = true;
    for (r, l) in pairs {
        let device = offered[l];
        let d = &devices[device];
        let (eps, handle, from_pool) = d.fabric.accept_part(peer, id, &groups[r]).await?;
        prebuilt &= from_pool;
        parts.push(AcceptedPart { device, qps: eps.len(), handle });
        for mut e in eps {
            if let Endpoint::Verbs(v) = &mut e {
                v.rail = rail_numbers[r];
            }
            answer.push(e);
        }
    }
    // Only with at least one device rail: the fallback is a standby, never the connection.
    let tcp = match (fallback, tcp_request) {
        (Some(f), Some(_)) => {
            let (eps, handle) = f.fabric.accept(peer, id, &[]).await?;
            answer.extend(eps);
            Some(handle)
        }
        _ => None,
    };
    tracing::debug!(%peer, connection = %id, rails = parts.len(), offered = remote_facts.len(), tcp = tcp.is_some(), "accepted a multi-device connection");
    let ready = ready::combined(
        parts.iter().map(|p| ready::PartReady { device: devices[p.device].name().to_string(), ready: p.handle.readiness() }).collect(),
        peer.to_string(),
        id.to_string(),
    );
    let acc = Arc::new(RailsAccepted { parts, tcp, ready });
    {
        let mut index = index.lock().unwrap_or_else(|e| e.into_inner());
        if index.get(id).is_some_and(|w| w.strong_count() > 0) {
            // Dropping `acc` here drops every part: the racing offer keeps the id.
            return Err(taken(id));
        }
        index.insert(id.clone(), Arc::downgrade(&acc));
    }
    // One build per connection, whatever its devices.
    crate::metrics::connection_build("responder", prebuilt);
    Ok((answer, Box::new(AcceptedHandle { acc, index: Arc::clone(index), id: id.clone() })))
}

/// Whether `id` names a connection of ours that is still open.
fn live(index: &AcceptedIndex, id: &ConnectionId) -> bool {
    index.lock().unwrap_or_else(|e| e.into_inner()).get(id).is_some_and(|w| w.strong_count() > 0)
}

fn taken(id: &ConnectionId) -> FabricError {
    FabricError::Negotiation { step: "connect", attr: "connection_id", detail: format!("connection {id} is already open on this agent") }
}

/// A single-device responder's answer to an initiator's rails: the rail our one device (`ours`)
/// reaches best, with its endpoints and its number, or the one rail offered. The refusal names
/// both sides when our device reaches none of several rails. Either way the rail answered is
/// checked as the multi-device responder's are ([`check_rail`]). A single rail is not refused
/// for its subnet: one device pair may be routed (RoCEv2 over L3), which only the link layer
/// and the device's own route resolution can tell.
/// An initiator's tcp fallback request is left out: a single device has no fallback.
pub(crate) fn one_rail(ours: RailFacts, remote: &[Endpoint]) -> Result<(Vec<Endpoint>, Option<u32>), FabricError> {
    let verbs: Vec<Endpoint> = remote.iter().filter(|e| !e.is_tcp_fallback_request()).cloned().collect();
    let remote = &verbs[..];
    let rails = by_rail(remote)?;
    if rails.len() <= 1 {
        // Nothing offered: the device's own validation refuses it.
        let Some((&number, eps)) = rails.iter().next() else { return Ok((remote.to_vec(), None)) };
        check_rail(number, eps)?;
        return Ok((eps.clone(), Some(number)));
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
    check_rail(number, eps)?;
    Ok((eps.clone(), Some(number)))
}

/// Most rails one offer may carry (the agent refuses higher numbers where it decodes them; this
/// holds for any caller of the fabric).
const MAX_RAILS: u32 = 64;
/// Longest device name, link layer or GID type an endpoint may carry.
const MAX_WORD: usize = 32;

/// One rail of an offer as a device can take it: its number below [`MAX_RAILS`], and every
/// endpoint from one device (the same name, link layer, GID and prefix: a rail is one device's
/// QPs), whose name is a short printable word (it reaches logs, refusals and `paths()`).
pub(crate) fn check_rail(number: u32, eps: &[Endpoint]) -> Result<(), FabricError> {
    let bad = |detail: String| FabricError::Negotiation { step: "negotiate", attr: "rail", detail };
    if number >= MAX_RAILS {
        return Err(bad(format!("rail {number} is out of range (at most {MAX_RAILS} per connection)")));
    }
    let facts: Vec<RailFacts> = eps
        .iter()
        .filter_map(|e| match e {
            Endpoint::Verbs(v) => Some(facts_of(v)),
            Endpoint::Tcp { .. } => None,
        })
        .collect();
    for f in &facts {
        for word in [&f.device, &f.link_layer] {
            if word.len() > MAX_WORD || !word.chars().all(|c| c.is_ascii_graphic() || c == ' ') {
                return Err(bad(format!(
                    "rail {number} names a device or link layer that is not a printable word of at most {MAX_WORD} bytes ({} bytes)",
                    word.len()
                )));
            }
        }
    }
    let Some(first) = facts.first() else { return Ok(()) };
    if let Some(other) = facts.iter().find(|f| *f != first) {
        return Err(bad(format!(
            "rail {number}'s endpoints come from more than one device: {} and {}",
            first.describe(),
            other.describe()
        )));
    }
    Ok(())
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
/// entry per QP of that connection, in the initiator's QP order ([`NO_KEY`] for a failed rail's).
pub(crate) async fn expose(
    devices: &[Arc<RailDevice>],
    fallback: Option<&Fallback>,
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
        if p.failed() {
            keys.extend(std::iter::repeat_n(NO_KEY, p.qps));
            continue;
        }
        let d = &devices[p.device];
        let part = ours.part(p.device).ok_or_else(|| FabricError::Registration(format!("the registration has no part on {}", d.name())))?;
        let e = match d.fabric.expose(part, req).await {
            Ok(e) => e,
            // Its QPs broke since the connection was made (a port-down event moved them to ERR;
            // grant mode mw binds its windows on them): nothing can land there, so the part is
            // left out as one that failed at Connect is, rather than failing every grant.
            Err(FabricError::QpBroken) => {
                keys.extend(std::iter::repeat_n(NO_KEY, p.qps));
                continue;
            }
            Err(e) => return Err(e),
        };
        if *addr.get_or_insert(e.addr) != e.addr {
            return Err(FabricError::Other(format!("device {} exposes the range at another address than the first device", d.name())));
        }
        expand_key(&e.key, p.qps, &mut keys).map_err(|m| FabricError::Other(format!("device {}: {m}", d.name())))?;
        keep.push(e);
    }
    let addr = addr.ok_or_else(|| FabricError::Other(format!("connection {id} has no device part that was made ready")))?;
    let (Some(f), Some(_)) = (fallback, &acc.tcp) else {
        return Ok(Exposure { addr, key: RemoteKey::PerQp(keys.into()), keepalive: Some(Box::new(keep)) });
    };
    // The tcp rail: the same memory, the same address space (the VA), one token for its QPs.
    let part = ours.tcp_part().ok_or_else(|| FabricError::Registration("the registration has no part on the tcp fallback".into()))?;
    let e = f.fabric.expose(part, req).await?;
    if e.addr != addr {
        return Err(FabricError::Other("the tcp fallback exposes the range at another address than the devices".into()));
    }
    let mut each: Vec<RemoteKey> = keys.into_iter().map(RemoteKey::Rkey).collect();
    each.push(e.key.clone());
    keep.push(e);
    Ok(Exposure { addr, key: RemoteKey::Each(each.into()), keepalive: Some(Box::new(keep)) })
}

/// Appends one device's grant key for its `qps` QPs to `keys`: an rkey serves every QP of the
/// device, per-QP keys (windows) must be one per QP.
pub(crate) fn expand_key(key: &RemoteKey, qps: usize, keys: &mut Vec<u32>) -> Result<(), String> {
    match key {
        RemoteKey::Rkey(k) => keys.extend(std::iter::repeat_n(*k, qps)),
        RemoteKey::PerQp(ks) if ks.len() == qps => keys.extend(ks.iter().copied()),
        RemoteKey::PerQp(ks) => return Err(format!("{} per-QP keys for {qps} QPs", ks.len())),
        RemoteKey::Token(_) | RemoteKey::Each(_) => return Err("a token key on a verbs device".into()),
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
        // One rail (what a single-device initiator sends): answered under its own number.
        let (eps, rail) = one_rail(ours.clone(), &offer[..2]).unwrap();
        assert_eq!((eps.len(), rail), (2, Some(0)));
        // A tcp fallback request is left out: a single device has no fallback to answer it with.
        let with_tcp = [offer[0].clone(), offer[1].clone(), Endpoint::tcp_fallback_request()];
        let (eps, rail) = one_rail(ours.clone(), &with_tcp).unwrap();
        assert_eq!((eps, rail), (offer[..2].to_vec(), Some(0)));
        let (eps, rail) = one_rail(ours.clone(), &[offer.to_vec(), vec![Endpoint::tcp_fallback_request()]].concat()).unwrap();
        assert_eq!((eps, rail), (offer[2..].to_vec(), Some(1)));
        let far = [ep(0, [10, 0, 5, 1], 1), ep(1, [10, 0, 6, 1], 2)];
        let e = one_rail(ours, &far).unwrap_err().to_string();
        assert!(e.contains("reaches none") && e.contains("10.0.5.1/24"), "{e}");
    }

    /// What a hostile initiator can offer a single-device responder: rails sparse, huge,
    /// interleaved or all unreachable, endpoints of another fabric. Each gets either the one
    /// rail our device reaches (its endpoints as sent, in order) or a refusal naming both sides.
    #[test]
    fn one_device_takes_hostile_rail_offers_apart() {
        let ours = crate::verbs::rails::reach::facts_of(&match ep(0, [10, 0, 1, 9], 1) {
            Endpoint::Verbs(v) => VerbsEndpoint { device: "rxe0".into(), ..v },
            Endpoint::Tcp { .. } => unreachable!(),
        });
        // Sparse and out of order: rails 63 and 7, interleaved. The reachable one comes back
        // whole, in the order sent, under its own number.
        let offer = [ep(63, [10, 0, 1, 1], 1), ep(7, [10, 0, 5, 1], 2), ep(63, [10, 0, 1, 1], 3), ep(u32::MAX, [10, 0, 6, 1], 4)];
        let (eps, rail) = one_rail(ours.clone(), &offer).unwrap();
        assert_eq!(rail, Some(63));
        assert_eq!(eps, vec![offer[0].clone(), offer[2].clone()]);
        // A tcp endpoint among verbs ones: refused, whatever else is there.
        let tcp = Endpoint::Tcp { address: "127.0.0.1:1".parse().unwrap(), secret: None };
        let e = one_rail(ours.clone(), &[offer[0].clone(), tcp.clone()]).unwrap_err().to_string();
        assert!(e.contains("non-verbs endpoint"), "{e}");
        assert!(by_rail(&[tcp]).is_err());
        // Nothing offered: nothing matched here (the device's own validation refuses it).
        assert_eq!(one_rail(ours.clone(), &[]).unwrap(), (vec![], None));
        // Ten rails, none reachable: one refusal listing them, no panic on names left empty.
        let far: Vec<Endpoint> = (0..10).map(|r| ep(r, [192, 168, r as u8, 1], r + 1)).collect();
        let e = one_rail(ours, &far).unwrap_err().to_string();
        assert!(e.contains("rxe0 (10.0.1.9/24, Ethernet)") && e.contains("(unnamed) (192.168.9.1/24, Ethernet)"), "{e}");
    }

    /// A hostile *one-rail* offer to a single-device responder is checked like a rail of a
    /// multi-device one, not answered as rail 0 as it comes: its number in range and echoed,
    /// every endpoint from one device, names short and printable. A refusal names the rail.
    #[test]
    fn one_device_checks_a_hostile_one_rail_offer() {
        let ours = RailFacts { device: "rxe0".into(), link_layer: "Ethernet".into(), gid: [0; 16], ipv4_prefix: 24 };
        let named = |rail: u32, ip: [u8; 4], qpn: u32, device: &str| match ep(rail, ip, qpn) {
            Endpoint::Verbs(v) => Endpoint::Verbs(VerbsEndpoint { device: device.into(), ..v }),
            tcp => tcp,
        };
        // A lone rail 7 is answered as rail 7, its endpoints as sent.
        let offer = [named(7, [10, 0, 0, 1], 1, "mlx5_3"), named(7, [10, 0, 0, 1], 2, "mlx5_3")];
        assert_eq!(one_rail(ours.clone(), &offer).unwrap(), (offer.to_vec(), Some(7)));
        for (offer, want) in [
            (vec![named(64, [10, 0, 0, 1], 1, "rxe1")], "rail 64 is out of range"),
            (vec![named(u32::MAX, [10, 0, 0, 1], 1, "rxe1")], "rail 4294967295 is out of range"),
            (vec![named(0, [10, 0, 0, 1], 1, "rxe1"), named(0, [10, 0, 0, 1], 2, "rxe3")], "more than one device"),
            (vec![named(0, [10, 0, 0, 1], 1, "rxe1"), named(0, [10, 0, 9, 1], 2, "rxe1")], "more than one device"),
            (vec![named(0, [10, 0, 0, 1], 1, "rxe1"), named(0, [10, 0, 0, 1], 2, "rxe1\nlevel=ERROR")], "not a printable word"),
            (vec![named(2, [10, 0, 0, 1], 1, &"x".repeat(10_000))], "not a printable word of at most 32 bytes (10000 bytes)"),
        ] {
            let e = one_rail(ours.clone(), &offer).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
            assert!(!e.contains('\n') && e.len() < 300, "the refusal carries none of the hostile text: {e}");
        }
        // The rail chosen out of several is checked too.
        let mixed = [named(1, [10, 0, 0, 1], 1, "rxe1"), named(1, [10, 0, 0, 1], 2, "rxe5"), named(2, [192, 168, 0, 1], 3, "rxe2")];
        assert!(one_rail(ours, &mixed).unwrap_err().to_string().contains("rail 1's endpoints come from more than one device"));
    }

    #[test]
    fn keys_expand_to_one_per_qp_in_rail_order() {
        let mut keys = Vec::new();
        expand_key(&RemoteKey::Rkey(7), 2, &mut keys).unwrap();
        expand_key(&RemoteKey::PerQp(vec![1, 2, 3].into()), 3, &mut keys).unwrap();
        assert_eq!(keys, vec![7, 7, 1, 2, 3]);
        assert!(expand_key(&RemoteKey::PerQp(vec![1].into()), 2, &mut keys).is_err());
        assert!(expand_key(&RemoteKey::Token([0; 16]), 1, &mut keys).is_err());
        // A device's key list longer than its QPs is refused too, and a refusal adds nothing.
        let before = keys.clone();
        assert!(expand_key(&RemoteKey::PerQp(vec![1, 2, 3].into()), 2, &mut keys).is_err());
        assert!(expand_key(&RemoteKey::PerQp(Vec::new().into()), 1, &mut keys).is_err());
        assert_eq!(keys, before);
    }

    /// An index entry whose connection is gone does not hold the id; a live one does.
    #[test]
    fn a_live_connection_holds_its_id() {
        let index = AcceptedIndex::default();
        let id = ConnectionId::parse("c1").unwrap();
        assert!(!live(&index, &id));
        let (_tx, ready) = tokio::sync::watch::channel(Readiness::Pending);
        let acc = Arc::new(RailsAccepted { parts: Vec::new(), tcp: None, ready });
        index.lock().unwrap().insert(id.clone(), Arc::downgrade(&acc));
        assert!(live(&index, &id));
        assert!(taken(&id).to_string().contains("connection c1 is already open"));
        drop(acc);
        assert!(!live(&index, &id), "a dropped connection's entry frees the id");
    }
}
