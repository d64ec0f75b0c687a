//! The target side of the Peer service: accepting a peer's connection (and bounding how many it
//! keeps), grants on this agent's regions, their revocation, channel announcements and
//! `Peer.Complete`. What local subscribers are told is [`super::inbound`]'s.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tracing::{info, warn};

use super::Node;
use crate::checksum::Algo;
use crate::error::NodeError;
use crate::grants::{Grant, GrantError};
use crate::metrics as m;
use crate::transfer::{Op, TransferRecord, TransferRegistry, TransferState};
use xfer_engine::ids::ConnectionId;
use xfer_fabric::{Accepted, Endpoint, ExposeRequest, FabricError, FabricKind, Readiness, RemoteOp};

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
    pub connection_id: Option<ConnectionId>,
    /// A notification (`GrantRequest.notify`).
    pub notify: Option<NotifyAsk>,
}

/// What `GrantRequest.notify` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotifyAsk {
    /// One notification for the grant, with this tag, once `markers` markers (one per QP)
    /// arrived or `Peer.Complete` came.
    Once { tag: Vec<u8>, markers: u32 },
    /// A channel: one notification per batch, each batch ending in `markers` markers that name
    /// it, its tag sent with `Peer.Announce`.
    Channel { markers: u32 },
}

impl NotifyAsk {
    pub fn markers(&self) -> u32 {
        match self {
            NotifyAsk::Once { markers, .. } | NotifyAsk::Channel { markers } => *markers,
        }
    }
}

/// (peer identity, keepalive of the responder's QPs or data session; `mw` grants bind windows
/// on them, tcp grants work only on its streams)
/// An accepted connection: its owner (the caller's identity), the responder half, and when it was
/// accepted (a sequence number: lower is older).
pub(super) type AcceptedConn = (String, Arc<dyn Accepted>, u64);

/// The target side's state: the connections peers made here and the transfers they completed.
pub(super) struct Responder {
    /// Transfers peers completed into this agent (`Peer.Complete`), by `PEER/ID`.
    pub(super) inbound: TransferRegistry,
    /// Responder halves of connections, by connection id (peer node, keepalive).
    pub(super) accepted: Mutex<HashMap<ConnectionId, AcceptedConn>>,
    /// Orders `accepted` by age (eviction takes the oldest).
    pub(super) accept_seq: AtomicU64,
    /// Names of this agent's notification rings start with this: the private prefix and a tag of
    /// the state dir, so a restart on the same state dir finds (and removes) what a killed run
    /// left, and never another agent's.
    pub(super) ring_prefix: String,
}

impl Responder {
    /// The accepted connection `id`, if `peer` made it.
    fn accepted_by(&self, id: Option<&ConnectionId>, peer: &str) -> Option<Arc<dyn Accepted>> {
        let acc = self.accepted.lock().unwrap_or_else(|e| e.into_inner());
        acc.get(id?).filter(|(owner, _, _)| owner == peer).map(|(_, conn, _)| conn.clone())
    }
}

/// Markers of `grant`'s notification (a channel grant: of its next batch) are due on `conn`,
/// the connection it was granted on: the fabric watches for them closely (verbs: the marker
/// poller, `verbs.marker_spin`) until it is published, the grant ends or the budget runs out.
/// Latency only; the markers are seen without it too.
fn expect_markers(grant: &Arc<Grant>, conn: &dyn Accepted) {
    let ttl = grant.expires_at.duration_since(SystemTime::now()).unwrap_or_default();
    let weak = Arc::downgrade(grant);
    conn.expect_markers(
        xfer_common::deadline::instant_after(ttl),
        Box::new(move || {
            weak.upgrade().is_some_and(|g| {
                g.gate.is_live()
                    && (g.notify.as_ref().is_some_and(|p| !p.is_published()) || g.channel.as_ref().is_some_and(|c| c.expecting()))
            })
        }),
    );
}

/// How long a grant waits for its connection's responder QPs to reach RTS (a few modify calls:
/// milliseconds, even under emulation).
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// Waits until the responder half `conn` (connection `id`) is usable: on verbs its QPs are
/// moved to RTS after `Peer.Connect` was answered ([`Accepted::readiness`]). A half that failed
/// to get there is refused as an unknown connection (the initiator negotiates a fresh one if it
/// took this one from its pool), with the device's reason.
async fn wait_ready(conn: &dyn Accepted, id: &ConnectionId) -> Result<(), NodeError> {
    let Some(mut rx) = conn.readiness() else { return Ok(()) };
    if *rx.borrow_and_update() == Readiness::Pending {
        m::grant_ready_wait();
    }
    let failed = |why: &str| NodeError::UnknownConnection(format!("connection {id} could not be made ready on this agent: {why}"));
    let settled = tokio::time::timeout(READY_TIMEOUT, rx.wait_for(|r| *r != Readiness::Pending)).await;
    match settled {
        // `wait_for` hands back a settled state only: `Ready` or `Failed`.
        Ok(Ok(state)) => match &*state {
            Readiness::Failed(why) => Err(failed(why)),
            _ => Ok(()),
        },
        // The task that moves the QPs ended without a word (it always sends one).
        Ok(Err(_)) => Err(failed("its set-up ended without a result")),
        Err(_) => Err(NodeError::FailedPrecondition(format!(
            "connection {id} is not ready on this agent after {READY_TIMEOUT:?} (its QPs are still being moved to RTS)"
        ))),
    }
}

impl Node {
    /// Data streams (tcp) one peer identity may hold on this agent, as advertised in
    /// `Peer.Connect` (0 = no bound of the fabric's own: verbs QPs are bounded by connections).
    pub fn streams_per_peer(&self) -> usize {
        match self.fabric.kind() {
            FabricKind::Tcp => self.config.limits.max_data_connections_per_peer,
            FabricKind::Verbs => 0,
        }
    }

    // ------------------------------------------------------------------ Peer side

    pub async fn accept_connection(
        &self,
        peer: &str,
        connection_id: &ConnectionId,
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
        if self.responder.accepted.lock().unwrap_or_else(|e| e.into_inner()).contains_key(connection_id) {
            return Err(taken());
        }
        let t0 = Instant::now();
        let (mine, keep) = self.fabric.accept(peer, connection_id, endpoints).await?;
        m::accept_duration(t0.elapsed());
        let seq = self.responder.accept_seq.fetch_add(1, Ordering::Relaxed);
        let (evicted, total) = {
            let mut acc = self.responder.accepted.lock().unwrap_or_else(|e| e.into_inner());
            if acc.contains_key(connection_id) {
                return Err(taken());
            }
            // Bound per-peer state: a peer that never disconnects (one that crashed, or leaks)
            // cannot grow it without limit. Only a connection that holds no grant is evicted,
            // the oldest first: evicting one in use would revoke a running transfer's grants.
            let mut evicted = None;
            let from_peer = acc.values().filter(|v| v.0 == peer).count();
            if from_peer >= self.config.limits.max_connections_per_peer {
                let idle = acc
                    .iter()
                    .filter(|(k, v)| v.0 == peer && !self.regions.grants.has_connection(k))
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
                                 (limits.max_connections_per_peer = {})",
                                self.config.limits.max_connections_per_peer
                            ),
                        });
                    }
                }
            }
            acc.insert(connection_id.clone(), (peer.to_string(), Arc::from(keep), seq));
            (evicted, acc.len())
        };
        m::accepted_connections(total);
        if let Some((id, _)) = evicted {
            let n = self.regions.grants.revoke_connection(&id);
            warn!(peer, connection = %id, grants = n, "evicted the oldest idle connection of a peer that never disconnected it (limits.max_connections_per_peer = {})", self.config.limits.max_connections_per_peer);
        }
        Ok(mine)
    }

    /// Drops the responder half of a connection and revokes the grants asked for on it, if the
    /// peer `owner` made it.
    pub fn disconnect(&self, connection_id: &ConnectionId, owner: &str) {
        let removed = {
            let mut acc = self.responder.accepted.lock().unwrap_or_else(|e| e.into_inner());
            let removed = if acc.get(connection_id).is_some_and(|c| c.0 == owner) { acc.remove(connection_id) } else { None };
            m::accepted_connections(acc.len());
            removed
        };
        // Dropped outside the lock: a tcp session closes its streams, verbs tears QPs down.
        let removed = removed.is_some();
        if removed {
            let n = self.regions.grants.revoke_connection(connection_id);
            if n > 0 {
                info!(connection = %connection_id, grants = n, "peer disconnected; revoked its grants on that connection");
            }
        }
    }

    pub async fn grant(&self, p: &GrantParams) -> Result<Arc<Grant>, NodeError> {
        // A peer's notification ask is checked before anything is looked up or exposed.
        if let Some(ask) = &p.notify {
            if let NotifyAsk::Once { tag, .. } = ask {
                self.check_notify_tag(tag)?;
            }
            let markers = ask.markers();
            if markers == 0 || markers as usize > *xfer_engine::shape::QPS.end() {
                return Err(NodeError::Invalid(format!(
                    "a notification waits for one marker per QP: {markers} markers asked, 1..={} allowed",
                    *xfer_engine::shape::QPS.end()
                )));
            }
        }
        let notify = p.notify.clone();
        let region = self.regions.registry.get(&p.region)?;
        if !region.access.allows(p.op) {
            return Err(NodeError::PermissionDenied(format!(
                "region {:?} has access {:?}; remote {} is not allowed",
                region.name, region.access, p.op
            )));
        }
        if p.offset > region.length {
            return Err(NodeError::Invalid(format!(
                "offset {} is beyond the end of region {:?} ({} bytes)",
                p.offset, region.name, region.length
            )));
        }
        let length = if p.length == 0 { region.length - p.offset } else { p.length };
        if length == 0 {
            return Err(NodeError::Invalid(format!("nothing to grant: offset {} is the end of region {:?}", p.offset, region.name)));
        }
        region.check_range(p.offset, length)?;
        let ttl = p.ttl.filter(|t| !t.is_zero()).unwrap_or(self.config.grants.default_ttl.0).min(self.config.grants.max_ttl.0);
        let expires_at = xfer_common::deadline::system_after(ttl);
        let connection = self.grant_connection(p)?;
        if let (Some(conn), Some(id)) = (&connection, &p.connection_id) {
            wait_ready(conn.as_ref(), id).await?;
        }
        if notify.is_some() && connection.is_none() {
            // Markers count on the connection the grant names: it must be one this caller made
            // (verbs in grant mode mr/region would otherwise take an id nobody holds yet, and
            // whoever connected under it later could count this grant's markers).
            const WHY: &str = "a notification is counted on the grantee's connection: the grant request must name a \
                               connection the caller made with Peer.Connect (connection_id)";
            return Err(match p.connection_id {
                None => NodeError::FailedPrecondition(WHY.into()),
                Some(_) => NodeError::UnknownConnection(WHY.into()),
            });
        }
        if self.fabric.grants_need_connection() && connection.is_none() {
            return Err(NodeError::FailedPrecondition(if self.fabric.kind() == FabricKind::Tcp {
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
        // The fabric is told the id only of a connection checked above (accepted here, by this peer).
        let checked_id = connection.as_ref().and(p.connection_id.clone());
        let bound_to = connection;
        let req = ExposeRequest { offset: p.offset, len: length, op: p.op, expires_at, peer: p.peer.clone(), connection: checked_id };
        let exposure = self
            .fabric
            .expose(&region.registration, &req)
            .await
            .map_err(|e| NodeError::Internal(format!("exposing region {:?}: {e}", region.name)))?;
        let grant = Grant {
            id: xfer_engine::ids::GrantId::random(),
            region,
            peer: p.peer.clone(),
            offset: p.offset,
            len: length,
            op: p.op,
            expires_at,
            exposure,
            connection_id: p.connection_id.clone(),
            gate: xfer_fabric::grant::GrantGate::new(expires_at),
            notify: match &notify {
                Some(NotifyAsk::Once { tag, markers }) => Some(xfer_engine::notes::PendingNote::new(tag.clone(), *markers)),
                _ => None,
            },
            channel: match notify {
                Some(NotifyAsk::Channel { markers }) => Some(xfer_engine::notes::ChannelNotes::new(markers)),
                _ => None,
            },
        };
        let grant = self.regions.grants.insert(grant)?;
        // A DeleteRegion (or lease expiry) that ran since the lookup above revoked the region's
        // grants before this one existed: re-check that the very same region is still live, or
        // the grant would outlive it (its token writing into a region nobody can see or delete).
        let region_live = matches!(self.regions.registry.describe(&grant.region.name), Ok(crate::regions::RegionView::Live(r)) if Arc::ptr_eq(&r, &grant.region));
        if !region_live {
            self.regions.grants.revoke(&grant.id);
            return Err(NodeError::Region(crate::regions::RegionError::NotFound(grant.region.name.clone())));
        }
        // A Disconnect (or an eviction) that ran since `grant_connection` looked the connection up
        // revoked the connection's grants before this one existed: re-check that the very same
        // connection is still there, or the grant would outlive it and work on the streams of
        // whichever connection next takes that id (ids are chosen by callers).
        if let (Some(id), Some(conn)) = (grant.connection_id.as_ref(), bound_to.as_ref()) {
            let live = self
                .responder
                .accepted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(id)
                .is_some_and(|(owner, c, _)| *owner == p.peer && Arc::ptr_eq(c, conn));
            if !live {
                self.regions.grants.revoke(&grant.id);
                return Err(NodeError::FailedPrecondition(format!("connection {id:?} was closed while the grant was made")));
            }
        }
        if let Some(conn) = bound_to.filter(|_| grant.notify.is_some() || grant.channel.is_some()) {
            expect_markers(&grant, conn.as_ref());
        }
        Ok(grant)
    }

    /// The accepted connection a grant names. It must have been made by the grant's peer
    /// (PERMISSION_DENIED otherwise). An unknown id is an error only where the grant needs the
    /// connection (`mw` on verbs); other modes do not use it.
    fn grant_connection(&self, p: &GrantParams) -> Result<Option<Arc<dyn Accepted>>, NodeError> {
        let Some(id) = p.connection_id.as_ref() else { return Ok(None) };
        let acc = self.responder.accepted.lock().unwrap_or_else(|e| e.into_inner());
        match acc.get(id) {
            Some((owner, conn, _)) if *owner == p.peer => Ok(Some(conn.clone())),
            Some(_) => Err(NodeError::PermissionDenied(format!("connection {id:?} was made by another peer"))),
            None if self.fabric.grants_need_connection() => Err(NodeError::UnknownConnection(format!(
                "no connection {id:?} from this peer (closed, or made with an earlier instance of this agent)"
            ))),
            None => Ok(None),
        }
    }

    pub fn revoke(&self, grant_id: &str, peer: &str) -> Result<(), GrantError> {
        let g = self.regions.grants.get(grant_id, peer, SystemTime::UNIX_EPOCH)?;
        self.regions.grants.revoke(&g.id);
        Ok(())
    }

    /// `Peer.Announce`: the tag of batch `seq` of a channel whose grant `grant_id` `peer` holds.
    pub fn announce(&self, grant_id: &str, peer: &str, seq: u64, tag: Vec<u8>) -> Result<(), NodeError> {
        self.check_notify_tag(&tag)?;
        let g = self.regions.grants.announce(grant_id, peer, seq, tag)?;
        // Its markers may still be on their way (an announcement usually comes first).
        if g.channel.as_ref().is_some_and(|c| c.unpublished() > 0) {
            if let Some(conn) = self.responder.accepted_by(g.connection_id.as_ref(), peer) {
                expect_markers(&g, conn.as_ref());
            }
        }
        Ok(())
    }

    /// `Peer.Complete`: the initiator says the data landed (or was read). Verifies the checksum
    /// when one is sent, records an inbound transfer, and revokes the grant.
    pub async fn complete_inbound(
        &self,
        transfer_id: &xfer_engine::ids::TransferId,
        grant_id: &str,
        peer: &str,
        end: InboundEnd<'_>,
    ) -> Result<Option<(bool, u64)>, NodeError> {
        let InboundEnd { bytes, op_write, checksum, spans } = end;
        let g = self.regions.grants.get(grant_id, peer, SystemTime::now())?;
        // Inbound records are their own namespace, keyed by the authenticated peer: `PEER/ID` can
        // never name an outbound transfer (whose ids have no '/') or another peer's record.
        let record_id = format!("{peer}/{transfer_id}");
        if self.responder.inbound.get(&record_id).is_ok() {
            return Err(NodeError::AlreadyExists(format!("transfer {transfer_id:?} from {peer} was already completed")));
        }
        // A checksum covers the first `bytes` of the grant. Without one, `bytes` is the peer's
        // count of what it moved, which a batch READing one block twice may put above the span.
        if checksum.is_some() && spans.is_empty() && bytes > g.len {
            return Err(NodeError::Invalid(format!("{bytes} bytes exceed the grant's {} bytes", g.len)));
        }
        let ranges = super::verify::checked_spans(spans, bytes, g.len)?.unwrap_or_else(|| vec![(0, bytes)]);
        let verdict = match checksum {
            Some((algo, expected)) => {
                let got = super::verify::grant_checksum(&g, &ranges, algo).await?;
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
            error_code: (!ok).then_some(xfer_engine::failure::FailureCode::ChecksumMismatch),
            created_at: now,
            started_at: Some(now),
            finished_at: Some(now),
            elapsed: Duration::ZERO,
            verified: verdict.is_some_and(|v| v.0),
            checksum: verdict.map(|v| v.1),
            peer: peer.to_string(),
            inbound: true,
            segments: 1,
            notify: g.notify.as_ref().map(|n| n.tag.clone()),
            paths: 0,
            failovers: 0,
            fallback: false,
            peer_key: peer.to_string(),
            owner: crate::tenants::Tenant::exempt(),
        };
        // One peer identity keeps at most its share of the inbound history (plaintext has no
        // identities to share it between: every loopback peer is one caller).
        let history = super::TRANSFER_HISTORY as u64;
        let share =
            if self.config.insecure { history } else { crate::tenants::share_of(history, self.config.limits.tenant_share) } as usize;
        if self.responder.inbound.insert_new_within(rec, share, |r| r.peer_key == peer).is_none() {
            // A concurrent Complete with the same id won: it keeps its record and the grant.
            return Err(NodeError::AlreadyExists(format!("transfer {transfer_id:?} from {peer} was already completed")));
        }
        m::transfer_bytes(if op_write { "write" } else { "read" }, "inbound", peer, bytes);
        // Every WR of the batch completed at the initiator: if its markers have not all been
        // seen yet, the notification is due now (published once either way).
        if ok {
            // Markers already acknowledged to the initiator count first (their receive task may
            // simply not have run yet), so `via` says what really carried the notification.
            if g.notify.is_some() {
                if let Some(conn) = self.responder.accepted_by(g.connection_id.as_ref(), peer) {
                    conn.drain_markers();
                }
            }
            self.regions.grants.publish_on_complete(&g);
        }
        self.regions.grants.revoke(&g.id);
        Ok(verdict)
    }
}

/// What the initiator's `Peer.Complete` says about a transfer's end.
#[derive(Debug, Clone, Copy)]
pub struct InboundEnd<'a> {
    /// Bytes moved (with a checksum: what it covers).
    pub bytes: u64,
    pub op_write: bool,
    pub checksum: Option<(Algo, u64)>,
    /// What the checksum covers, in order (offset from the grant's start, length); empty: the
    /// grant's first `bytes`.
    pub spans: &'a [(u64, u64)],
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::watch;

    /// A responder half whose readiness the test drives.
    struct Half(Option<watch::Receiver<Readiness>>);

    impl Accepted for Half {
        fn readiness(&self) -> Option<watch::Receiver<Readiness>> {
            self.0.clone()
        }
    }

    fn id() -> ConnectionId {
        ConnectionId::parse("conn-ready").unwrap()
    }

    #[tokio::test]
    async fn a_half_without_readiness_is_usable_at_once() {
        wait_ready(&Half(None), &id()).await.unwrap();
    }

    /// The grant waits while the QPs are moved, and goes on once they are in RTS.
    #[tokio::test]
    async fn a_grant_waits_for_rts() {
        let (tx, rx) = watch::channel(Readiness::Pending);
        let (half, id) = (Half(Some(rx)), id());
        let waiting = wait_ready(&half, &id);
        tokio::pin!(waiting);
        // Polled once: still pending, so it has not finished.
        assert!(futures::poll!(&mut waiting).is_pending());
        tx.send_replace(Readiness::Ready);
        waiting.await.unwrap();
    }

    /// A half whose QPs could not reach RTS refuses the grant as an unknown connection (the
    /// initiator then negotiates afresh) and says why, with the device's reason.
    #[tokio::test]
    async fn a_half_that_failed_refuses_with_the_reason() {
        let (tx, rx) = watch::channel(Readiness::Pending);
        tx.send_replace(Readiness::Failed("moving QP 0 to RTR: dgid unreachable".into()));
        let e = wait_ready(&Half(Some(rx)), &id()).await.unwrap_err();
        match e {
            NodeError::UnknownConnection(m) => {
                assert!(m.contains("conn-ready") && m.contains("dgid unreachable"), "{m}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// The task that moves the QPs vanished without a word: refused, not waited on forever.
    #[tokio::test]
    async fn a_lost_setup_task_refuses() {
        let (tx, rx) = watch::channel(Readiness::Pending);
        drop(tx);
        let e = wait_ready(&Half(Some(rx)), &id()).await.unwrap_err();
        assert!(matches!(&e, NodeError::UnknownConnection(m) if m.contains("without a result")), "{e:?}");
    }

    /// QPs that never reach RTS: the grant gives up after READY_TIMEOUT (virtual time here).
    #[tokio::test(start_paused = true)]
    async fn a_half_stuck_pending_times_out() {
        let (_tx, rx) = watch::channel(Readiness::Pending);
        let t0 = tokio::time::Instant::now();
        let e = wait_ready(&Half(Some(rx)), &id()).await.unwrap_err();
        assert!(matches!(&e, NodeError::FailedPrecondition(m) if m.contains("not ready")), "{e:?}");
        assert_eq!(t0.elapsed(), READY_TIMEOUT);
    }
}
