//! What a transfer holds from its peer while it runs — the leased connection, the grant, the
//! connection's path plan — as RAII guards that give each back however the transfer ends.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::paths::PathPlan;
use crate::error::NodeError;
use crate::peer_api::GrantInfo;
use crate::peers::{Lease, PeerEntry};
use crate::tenants::Tenant;
use crate::transfer::session::{Command, Session};

/// What a transfer holds from its peer, as RAII guards: the leased connection ([`Lease`]: back to
/// the pool or discarded) and the grant ([`GrantGuard`]: revoked unless the peer consumed it).
/// The session's `Release`/`Revoke`/`GrantConsumed` commands are applied here; anything still
/// held when this drops is discarded and revoked.
pub struct Held {
    pub(super) peer: Arc<PeerEntry>,
    /// Whose share of the connections to `peer` its lease is charged to.
    pub(super) tenant: Tenant,
    pub(super) lease: Option<Lease>,
    pub(super) grant: Option<GrantGuard>,
    /// The path plan of the leased connection, until the job that used it has been learnt from.
    pub(super) paths: Option<PathPlan>,
    /// The NUMA node of the local memory the transfer moves (the placement policy prefers
    /// devices on it); `None` when unknown.
    pub(super) numa: Option<u32>,
    pending_revokes: Arc<AtomicUsize>,
}

impl Held {
    pub(super) fn new(peer: Arc<PeerEntry>, tenant: Tenant, pending_revokes: Arc<AtomicUsize>) -> Held {
        Held { peer, tenant, lease: None, grant: None, paths: None, numa: None, pending_revokes }
    }

    pub(super) fn hold_grant(&mut self, info: GrantInfo) {
        let g = GrantGuard { info, peer: self.peer.clone(), pending: self.pending_revokes.clone(), armed: true };
        // A grant still held here would be revoked by its guard's drop.
        self.grant = Some(g);
    }

    /// The instance id of the agent that granted the held grant (this agent's own when a
    /// transfer names itself as the peer).
    pub(super) fn grant_instance(&self) -> Option<&str> {
        self.grant.as_ref().map(|g| g.info.instance_id.as_str())
    }

    /// The session's next command, after applying the resource ones (release, revoke, consumed).
    /// The lease (taken: the caller gives it back) and a copy of the grant an accepted acquire
    /// holds; the grant itself stays here, revoked when this drops.
    pub fn take_parts(&mut self) -> Result<(Lease, GrantInfo), NodeError> {
        let grant = self.grant.as_ref().map(|g| g.info.clone());
        match (self.lease.take(), grant) {
            (Some(l), Some(g)) => Ok((l, g)),
            _ => Err(NodeError::Internal("accepted without a connection and a grant".into())),
        }
    }

    pub(super) fn settle(&mut self, s: &mut Session) -> Option<Command> {
        loop {
            match s.poll()? {
                Command::Release { clean } => {
                    if let Some(l) = self.lease.take() {
                        l.release(clean);
                    }
                }
                Command::Revoke => {
                    if let Some(g) = self.grant.take() {
                        g.revoke();
                    }
                }
                Command::GrantConsumed => {
                    if let Some(mut g) = self.grant.take() {
                        g.armed = false;
                    }
                }
                other => return Some(other),
            }
        }
    }
}

/// A grant a peer gave this agent: revoked in the background when dropped, unless the peer
/// consumed it (its `Peer.Complete` revokes it there).
pub(super) struct GrantGuard {
    pub(super) info: GrantInfo,
    peer: Arc<PeerEntry>,
    pending: Arc<AtomicUsize>,
    armed: bool,
}

impl GrantGuard {
    pub(super) fn revoke(mut self) {
        self.armed = false;
        revoke_later(&self.peer, &self.info.grant_id, &self.pending);
    }
}

impl Drop for GrantGuard {
    fn drop(&mut self) {
        if self.armed {
            revoke_later(&self.peer, &self.info.grant_id, &self.pending);
        }
    }
}

/// Revokes a peer's grant in the background (best effort; `drain` waits for these). Skipped
/// when no runtime is left (at exit): the grant then ends with its TTL.
fn revoke_later(peer: &Arc<PeerEntry>, grant_id: &str, pending: &Arc<AtomicUsize>) {
    let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
    let peer = peer.clone();
    let id = grant_id.to_string();
    let pending = pending.clone();
    pending.fetch_add(1, Ordering::AcqRel);
    rt.spawn(async move {
        let _ = peer.call(|| peer.client.revoke(&id)).await;
        pending.fetch_sub(1, Ordering::AcqRel);
    });
}
