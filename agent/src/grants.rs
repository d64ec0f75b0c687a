//! Grant table: which peer may access which range of which region, with which operation, until
//! when. Grants are revoked explicitly (`Peer.Revoke`), on expiry (the reaper), on region deletion
//! and on peer disconnect. Dropping a grant drops its fabric [`Exposure`], which deregisters a
//! dedicated MR or invalidates a window on verbs; on tcp the token stops resolving, and revoking the
//! grant's [`GrantGate`] makes sure no payload byte lands under it once the revoking call returns.
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Instant, SystemTime};

use crate::metrics as m;
use crate::notify::{About, Hub, Via};
use crate::regions::Region;
use tracing::debug;
use xfer_engine::notes::{ChannelNotes, ChannelRefusal, PendingNote, CHANNEL_BIT, MAX_CHANNEL_SLOT};
use xfer_fabric::grant::{AccessCheck, Checked, GrantGate, Window};
use xfer_fabric::{Exposure, RemoteKey, RemoteOp, WcStatus};

#[derive(Debug, thiserror::Error)]
pub enum GrantError {
    #[error("grant {0:?} not found")]
    NotFound(String),
    #[error("grant {0:?} has expired")]
    Expired(String),
    #[error("grant {0:?} belongs to another peer")]
    WrongPeer(String),
    #[error("limit reached: {0}")]
    Limit(String),
    #[error("{0}")]
    Invalid(String),
    #[error("region {0:?} not found (it is being removed)")]
    RegionGone(String),
}

pub struct Grant {
    pub id: xfer_engine::ids::GrantId,
    pub region: Arc<Region>,
    pub peer: String,
    /// Offset of the granted range inside the region.
    pub offset: u64,
    pub len: u64,
    pub op: RemoteOp,
    pub expires_at: SystemTime,
    pub exposure: Exposure,
    /// The grantee's connection the grant was asked on; the grant dies with it.
    pub connection_id: Option<xfer_engine::ids::ConnectionId>,
    /// Held by every tcp WRITE payload being stored under this grant; revoked when the grant
    /// leaves the table, which waits for a chunk being copied and closes streams mid-payload.
    pub gate: Arc<GrantGate>,
    /// The notification the grantee asked for (`GrantRequest.notify`); its slot is set by
    /// [`GrantTable::insert`].
    pub notify: Option<PendingNote>,
    /// A channel's per-batch notifications (`NotifyRequest.channel`) instead; its slot base is
    /// set by [`GrantTable::insert`].
    pub channel: Option<ChannelNotes>,
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("id", &self.id)
            .field("region", &self.region.name)
            .field("peer", &self.peer)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("op", &self.op)
            .finish()
    }
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<xfer_engine::ids::GrantId, Arc<Grant>>,
    by_token: HashMap<[u8; 16], Arc<Grant>>,
    /// Grants with a notification, by its slot (what a verbs marker's immediate names).
    by_slot: HashMap<u32, Arc<Grant>>,
    next_slot: u32,
    /// Channel grants, by their channel slot (bits 16..31 of their markers' immediates).
    by_channel: HashMap<u32, Arc<Grant>>,
    next_channel: u32,
    /// Ids of grants the reaper removed, so a late `Complete`/`Revoke` hears "expired" rather
    /// than "not found". Bounded (oldest forgotten first).
    expired: std::collections::VecDeque<xfer_engine::ids::GrantId>,
}

const EXPIRED_MEMORY: usize = 4096;

/// All live grants of this agent. A std RwLock: lookups happen per TCP frame and never await.
pub struct GrantTable {
    inner: RwLock<Inner>,
    max_per_peer: usize,
    hub: Arc<Hub>,
}

/// Notifications a `WatchInbound` subscriber may fall behind by before it is told it lost some.
const NOTIFY_BACKLOG: usize = 4096;

impl GrantTable {
    pub fn new(max_per_peer: usize) -> Self {
        GrantTable { inner: RwLock::new(Inner::default()), max_per_peer, hub: Arc::new(Hub::new(NOTIFY_BACKLOG)) }
    }

    /// Where notifications are published (`WatchInbound` subscribes here).
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        // Poisoning only follows a panic mid-update of two maps that are updated together; serve on.
        self.inner.write().unwrap_or_else(|p| p.into_inner())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|p| p.into_inner())
    }

    pub fn insert(&self, mut grant: Grant) -> Result<Arc<Grant>, GrantError> {
        let mut g = self.write();
        // Checked under the table's lock, which the region's end takes (to revoke its grants)
        // after marking it retiring: a grant is either revoked with the others or refused here.
        if grant.region.is_retiring() {
            return Err(GrantError::RegionGone(grant.region.name.clone()));
        }
        let count = g.by_id.values().filter(|x| x.peer == grant.peer).count();
        if count >= self.max_per_peer {
            return Err(GrantError::Limit(format!("max_grants_per_peer = {}", self.max_per_peer)));
        }
        if let Some(n) = grant.notify.as_mut() {
            // A free, non-zero slot below the channel bit: the table holds far fewer grants
            // than 2^31 (`max_grants_per_peer` bounds them).
            let mut slot = g.next_slot;
            loop {
                slot = slot.wrapping_add(1) & !CHANNEL_BIT;
                if slot != 0 && !g.by_slot.contains_key(&slot) {
                    break;
                }
            }
            g.next_slot = slot;
            n.slot = slot;
        }
        if let Some(c) = grant.channel.as_mut() {
            // Channel slots are 15 bits: a free one, or the grant is refused.
            if g.by_channel.len() >= MAX_CHANNEL_SLOT as usize {
                return Err(GrantError::Limit(format!("{MAX_CHANNEL_SLOT} channels with notifications on this agent")));
            }
            let mut slot = g.next_channel;
            loop {
                slot = slot % MAX_CHANNEL_SLOT + 1;
                if !g.by_channel.contains_key(&slot) {
                    break;
                }
            }
            g.next_channel = slot;
            c.base_imm = CHANNEL_BIT | slot << 16;
        }
        let grant = Arc::new(grant);
        for t in tokens(&grant.exposure.key) {
            g.by_token.insert(t, grant.clone());
        }
        if let Some(n) = &grant.notify {
            g.by_slot.insert(n.slot, grant.clone());
        }
        if let Some(c) = &grant.channel {
            g.by_channel.insert(channel_slot(c.base_imm), grant.clone());
        }
        g.by_id.insert(grant.id.clone(), grant.clone());
        m::grants_active(g.by_id.len());
        Ok(grant)
    }

    /// Looks a grant up for `peer`, refusing expired grants and grants of other peers.
    pub fn get(&self, id: &str, peer: &str, now: SystemTime) -> Result<Arc<Grant>, GrantError> {
        let found = {
            let inner = self.read();
            match inner.by_id.get(id) {
                Some(g) => Ok(g.clone()),
                None if inner.expired.iter().any(|x| x == id) => Err(GrantError::Expired(id.to_string())),
                None => Err(GrantError::NotFound(id.to_string())),
            }
        };
        let g = found?;
        if g.peer != peer {
            return Err(GrantError::WrongPeer(id.to_string()));
        }
        if g.expires_at <= now {
            return Err(GrantError::Expired(id.to_string()));
        }
        Ok(g)
    }

    pub fn revoke(&self, id: &str) -> Option<Arc<Grant>> {
        self.remove_where(|g| g.id.as_str() == id).into_iter().next()
    }

    pub fn revoke_region(&self, region_id: &str) -> usize {
        self.remove_where(|g| g.region.id == region_id).len()
    }

    /// Revokes the grants asked for on one connection (the peer disconnected it).
    pub fn revoke_connection(&self, connection_id: &xfer_engine::ids::ConnectionId) -> usize {
        self.remove_where(|g| g.connection_id.as_ref() == Some(connection_id)).len()
    }

    /// Whether any grant is bound to `connection_id`.
    pub fn has_connection(&self, connection_id: &xfer_engine::ids::ConnectionId) -> bool {
        self.read().by_id.values().any(|g| g.connection_id.as_ref() == Some(connection_id))
    }

    pub fn revoke_peer(&self, peer: &str) -> usize {
        self.remove_where(|g| g.peer == peer).len()
    }

    pub fn revoke_all(&self) -> usize {
        self.remove_where(|_| true).len()
    }

    /// Drops grants whose expiry passed.
    pub fn reap(&self, now: SystemTime) -> usize {
        let gone = self.remove_where(|g| g.expires_at <= now);
        if !gone.is_empty() {
            let mut inner = self.write();
            for g in &gone {
                inner.expired.push_back(g.id.clone());
            }
            while inner.expired.len() > EXPIRED_MEMORY {
                inner.expired.pop_front();
            }
        }
        gone.len()
    }

    pub fn len(&self) -> usize {
        self.read().by_id.len()
    }

    /// Entries by id, token, notification slot and channel slot (tests, introspection).
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        let g = self.read();
        (g.by_id.len(), g.by_token.len(), g.by_slot.len(), g.by_channel.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn remove_where(&self, pred: impl Fn(&Grant) -> bool) -> Vec<Arc<Grant>> {
        let mut g = self.write();
        let ids: Vec<xfer_engine::ids::GrantId> = g.by_id.values().filter(|x| pred(x)).map(|x| x.id.clone()).collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(grant) = g.by_id.remove(&id) {
                for t in tokens(&grant.exposure.key) {
                    g.by_token.remove(&t);
                }
                if let Some(n) = &grant.notify {
                    g.by_slot.remove(&n.slot);
                }
                if let Some(c) = &grant.channel {
                    g.by_channel.remove(&channel_slot(c.base_imm));
                }
                out.push(grant);
            }
        }
        m::grants_active(g.by_id.len());
        drop(g);
        // Outside the table lock: once this returns, no payload byte lands under these grants
        // (a chunk being copied finishes first; streams mid-payload are closed).
        for grant in &out {
            grant.gate.revoke();
        }
        out
    }
}

/// The tcp tokens in a grant's key: its token, or a verbs grant's tcp fallback token.
fn tokens(key: &RemoteKey) -> Vec<[u8; 16]> {
    match key {
        RemoteKey::Token(t) => vec![*t],
        RemoteKey::Each(keys) => keys.iter().flat_map(tokens).collect(),
        RemoteKey::Rkey(_) | RemoteKey::PerQp(_) => Vec::new(),
    }
}

impl GrantTable {
    /// Publishes `grant`'s notification, if it has one not yet published (`Peer.Complete`: every
    /// work request of the batch completed at the initiator, so every byte is in place), and
    /// only while the grant is live: a Complete that was still verifying its checksum when the
    /// grant was revoked (DeleteRegion, a disconnect, expiry) publishes nothing.
    pub fn publish_on_complete(&self, grant: &Grant) -> bool {
        let Some(n) = grant.notify.as_ref() else { return false };
        grant.gate.while_live(|| self.hub.publish(n, about(grant), Via::Complete)).unwrap_or(false)
    }

    /// Counts a marker with immediate `imm` for `grant` that arrived on `connection`: a channel
    /// grant's marker names its batch in `imm`; any other grant's counts towards its one
    /// notification. Publishes when it was the batch's last.
    fn count_marker(&self, grant: &Grant, connection: &xfer_engine::ids::ConnectionId, imm: u32) -> Result<(), WcStatus> {
        if grant.channel.is_some() {
            return self.count_channel_marker(grant, connection, imm);
        }
        // A marker counts only on the connection the grant was asked on, and only while the
        // grant is live (a revoked grant's batch was cancelled or failed).
        if grant.connection_id.as_ref() != Some(connection) || !grant.gate.is_live() {
            m::notify_marker("refused");
            return Err(WcStatus::RemAccessErr);
        }
        let Some(n) = &grant.notify else {
            m::notify_marker("no_notification");
            return Err(WcStatus::RemInvReqErr);
        };
        // Counted and published under the grant's gate: a revocation either waits for this or
        // comes first (then the marker is refused), so nothing is published once it returned.
        let counted = grant.gate.while_live(|| {
            if n.marker(Instant::now()) {
                self.hub.publish(n, about(grant), Via::Fabric);
            }
        });
        if counted.is_none() {
            m::notify_marker("refused");
            return Err(WcStatus::RemAccessErr);
        }
        m::notify_marker("counted");
        Ok(())
    }

    /// A channel grant's marker: counted towards the batch `imm` names, which is published once
    /// its tag was announced too.
    fn count_channel_marker(&self, grant: &Grant, connection: &xfer_engine::ids::ConnectionId, imm: u32) -> Result<(), WcStatus> {
        let Some(ch) = &grant.channel else { return Err(WcStatus::RemInvReqErr) };
        if grant.connection_id.as_ref() != Some(connection) {
            m::notify_marker("refused");
            return Err(WcStatus::RemAccessErr);
        }
        // Under the gate, as for a grant's one notification.
        let r = grant.gate.while_live(|| {
            let r = ch.marker(imm, Instant::now());
            if let Ok(Some((tag, first))) = &r {
                self.hub.send(tag.clone(), *first, about(grant), Via::Fabric);
            }
            r
        });
        match r {
            Some(Ok(_)) => {
                m::notify_marker("counted");
                Ok(())
            }
            Some(Err(e)) => {
                debug!(grant = %grant.id, error = %e, "channel marker refused");
                m::notify_marker("refused");
                Err(WcStatus::RemInvReqErr)
            }
            None => {
                m::notify_marker("refused");
                Err(WcStatus::RemAccessErr)
            }
        }
    }

    /// `Peer.Announce`: the tag of batch `seq` of `peer`'s channel grant `grant_id`. Publishes
    /// the batch's notification if its markers all arrived already. Returns the grant.
    pub fn announce(&self, grant_id: &str, peer: &str, seq: u64, tag: Vec<u8>) -> Result<Arc<Grant>, GrantError> {
        let grant = self.get(grant_id, peer, SystemTime::now())?;
        let Some(ch) = &grant.channel else {
            return Err(GrantError::Invalid(format!("grant {grant_id} was not asked for a channel's notifications")));
        };
        let r = grant.gate.while_live(|| {
            let r = ch.announce(seq, tag);
            if let Ok(Some((tag, first))) = &r {
                self.hub.send(tag.clone(), *first, about(grant.as_ref()), Via::Fabric);
            }
            r
        });
        match r {
            Some(Ok(_)) => Ok(grant),
            Some(Err(e @ (ChannelRefusal::OutOfWindow(_) | ChannelRefusal::TagBudget(_)))) => Err(GrantError::Limit(e.to_string())),
            Some(Err(e)) => Err(GrantError::Invalid(e.to_string())),
            None => Err(GrantError::NotFound(format!("grant {grant_id} was revoked"))),
        }
    }

    /// Batch `seq` of `peer`'s channel grant `grant_id` counts as fully marked (its initiator
    /// held the markers after a failover and the batch was verified end to end): published now
    /// if its tag was announced, under the grant's gate.
    pub fn settle(&self, grant_id: &str, peer: &str, seq: u64) -> Result<(), GrantError> {
        let grant = self.get(grant_id, peer, SystemTime::now())?;
        let Some(ch) = &grant.channel else {
            return Err(GrantError::Invalid(format!("grant {grant_id} was not asked for a channel's notifications")));
        };
        let r = grant.gate.while_live(|| {
            let r = ch.settle(seq);
            if let Ok(Some((tag, first))) = &r {
                self.hub.send(tag.clone(), *first, about(grant.as_ref()), Via::Complete);
            }
            r
        });
        match r {
            Some(Ok(_)) => Ok(()),
            Some(Err(e @ ChannelRefusal::OutOfWindow(_))) => Err(GrantError::Limit(e.to_string())),
            Some(Err(e)) => Err(GrantError::Invalid(e.to_string())),
            None => Err(GrantError::NotFound(format!("grant {grant_id} was revoked"))),
        }
    }

    /// A tcp NOTIFY frame: the marker names its grant by token (and a channel's batch by `imm`).
    pub fn marker_by_token(&self, connection: &xfer_engine::ids::ConnectionId, token: &[u8; 16], imm: u32) -> Result<(), WcStatus> {
        let Some(grant) = self.read().by_token.get(token).cloned() else {
            m::notify_marker("refused");
            return Err(WcStatus::RemAccessErr);
        };
        self.count_marker(&grant, connection, imm)
    }
}

/// The channel slot an immediate (or a slot base) names.
fn channel_slot(imm: u32) -> u32 {
    (imm & !CHANNEL_BIT) >> 16
}

fn about(g: &Grant) -> About<'_> {
    About { region: &g.region.name, region_id: &g.region.id, peer: &g.peer, op: g.op, offset: g.offset, length: g.len }
}

impl xfer_fabric::MarkerSink for GrantTable {
    /// A verbs marker: the immediate of a zero-length WRITE WITH IMMEDIATE names the slot.
    fn marker(&self, connection: &xfer_engine::ids::ConnectionId, imm: u32) {
        let grant = if imm & CHANNEL_BIT != 0 {
            self.read().by_channel.get(&channel_slot(imm)).cloned()
        } else {
            self.read().by_slot.get(&imm).cloned()
        };
        match grant {
            Some(g) => {
                let _ = self.count_marker(&g, connection, imm);
            }
            None => m::notify_marker("unknown_slot"),
        }
    }
}

impl AccessCheck for GrantTable {
    fn marker(&self, connection: &xfer_engine::ids::ConnectionId, token: &[u8; 16], imm: u32) -> Result<(), WcStatus> {
        self.marker_by_token(connection, token, imm)
    }

    fn check(
        &self,
        connection: &xfer_engine::ids::ConnectionId,
        token: &[u8; 16],
        addr: u64,
        len: u64,
        op: RemoteOp,
    ) -> Result<Checked, WcStatus> {
        let grant = self.read().by_token.get(token).cloned().ok_or(WcStatus::RemAccessErr)?;
        // A token is valid only on the data streams of the connection it was granted on.
        if grant.connection_id.as_ref() != Some(connection) {
            return Err(WcStatus::RemAccessErr);
        }
        if !grant.gate.is_live() {
            return Err(WcStatus::RemAccessErr);
        }
        let mem = grant.region.memory.clone();
        let window = Window { op: grant.op, start: grant.exposure.addr, len: grant.len, base: mem.addr() };
        let offset = window.offset(addr, len, op)?;
        mem.check(offset, len).map_err(|_| WcStatus::RemAccessErr)?;
        // A stream may check its later frames under this token against the window: the grant's
        // connection, operation and range never change, and its end is the gate's.
        Ok(Checked { memory: mem, offset, gate: grant.gate.clone(), window: Some(window) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fallback_token_inside_a_per_qp_key_is_looked_up_like_a_tcp_grant() {
        let each = RemoteKey::Each(vec![RemoteKey::Rkey(1), RemoteKey::Rkey(2), RemoteKey::Token([3; 16])].into());
        assert_eq!(tokens(&each), vec![[3; 16]]);
        assert_eq!(tokens(&RemoteKey::Token([4; 16])), vec![[4; 16]]);
        assert!(tokens(&RemoteKey::PerQp(vec![1, 2].into())).is_empty());
        assert!(tokens(&RemoteKey::Rkey(1)).is_empty());
    }
}
