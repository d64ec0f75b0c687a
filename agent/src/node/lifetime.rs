//! How state ends with what it belongs to.
//!
//! A region ends one way, whatever the reason (`DeleteRegion`, its lease, a benchmark's scratch
//! region closed or run out): it is marked retiring under the registry lock (no new use, no new
//! grant), its grants are revoked while it is still visible — a tcp chunk being copied finishes,
//! a stream mid-payload is closed, verbs exposures are deregistered — and only then does it leave
//! the registry and its catalog entry. So once a lookup answers NOT_FOUND no byte of it changes
//! and no batch into it can still succeed. Then what was kept for it goes: its notification
//! channel (whose subscribers' streams end) and the benchmark slot it held.
//!
//! [`Node::state_counts`] reports the size of every per-owner map the agent keeps, so tests can
//! check that each returns to its baseline once its owners are gone.
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tracing::info;

use super::shares::Shares;
use super::Node;
use crate::grants::GrantTable;
use crate::regions::{Region, RegionError, RegionRegistry};

/// The state that belongs to regions: the registry, the grants peers hold on them, the
/// per-identity shares of what clients create, and the benchmark scratch region a peer holds.
pub(super) struct Regions {
    pub(super) registry: RegionRegistry,
    pub(super) grants: Arc<GrantTable>,
    /// Per-identity shares of the region, registered-bytes and subscriber limits.
    pub(super) shares: Shares,
    /// The scratch region of the benchmark running against this agent, and its owner.
    pub(super) bench_region: Mutex<Option<(String, String)>>,
}

/// Entries of the agent's per-owner maps (see the module docs). Maps bounded by design rather
/// than by their owners' lifetime are reported as such: the transfer histories keep the last
/// [`super::TRANSFER_HISTORY`] finished records each, the peer pool at most `limits.max_peers`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateCounts {
    /// Live, unavailable and being-created regions.
    pub regions: usize,
    /// Live grants (and their entries by token, notification slot and channel slot).
    pub grants: usize,
    pub grant_tokens: usize,
    pub grant_slots: usize,
    pub grant_channels: usize,
    /// Per-region notification channels (only regions that have a `WatchInbound` subscriber).
    pub notify_channels: usize,
    /// `WatchInboundRing` subscribers.
    pub rings: usize,
    /// `WatchInbound` subscriptions, streams and rings.
    pub subscribers: usize,
    /// Responder halves of connections peers made.
    pub accepted: usize,
    /// Peers with a submit or channel past admission that has not inserted its record yet.
    pub submitting: usize,
    /// Running outbound transfers (channels included).
    pub transfers_active: usize,
    /// Outbound and inbound transfer records kept (running and history).
    pub transfers_kept: usize,
    pub inbound_kept: usize,
    /// Peer pool entries, and the spellings remembered for them.
    pub peers: usize,
    pub peer_aliases: usize,
    /// Identities holding a share of regions, bytes or subscriptions (`tenants`), and of the
    /// connections to peers (summed over peers).
    pub tenants: usize,
    pub lease_tenants: usize,
    /// Whether a benchmark's scratch region is held for a peer.
    pub bench_region: bool,
}

impl Regions {
    /// `DeleteRegion`: the region ends (see the module docs) before this returns.
    pub(super) fn delete(&self, name: &str) -> Result<(), RegionError> {
        let mut revoked = 0;
        let gone = self.registry.delete(name, |r| revoked = self.cut_off(r))?;
        // None: an unavailable region, never registered, so nothing reached it.
        if let Some(r) = gone {
            self.forget(&r);
            if revoked > 0 {
                info!(region = %name, grants = revoked, "revoked grants of deleted region");
            }
        }
        Ok(())
    }

    /// Ends the regions whose lease is over at `now` exactly as [`Regions::delete`] does
    /// (the reaper calls it every 250 ms; tests call it with a `now` of their choosing).
    /// Blocking (the catalog is written): call it off the runtime's threads. Returns how many.
    pub(super) fn reap(&self, now: SystemTime) -> usize {
        let gone = self.registry.reap_expired(now, |r| {
            let n = self.cut_off(r);
            if n > 0 {
                info!(region = %r.name, grants = n, "region lease ended; revoked its grants");
            }
        });
        for r in &gone {
            self.forget(r);
        }
        gone.len()
    }

    /// Revokes every grant on `region` (marked retiring, so no new one is made): when this
    /// returns, no tcp payload byte lands in it and verbs exposures of it are gone.
    fn cut_off(&self, region: &Region) -> usize {
        self.grants.revoke_region(&region.id)
    }

    /// Drops what was kept for a region that left the registry.
    fn forget(&self, region: &Region) {
        self.grants.hub().forget_region(&region.id);
        let mut slot = self.bench_region.lock().unwrap_or_else(|e| e.into_inner());
        if slot.as_ref().is_some_and(|(name, _)| *name == region.name) {
            *slot = None;
        }
    }
}

impl Node {
    /// `DeleteRegion`: the region ends (see the module docs) before this returns.
    pub fn delete_region(&self, name: &str) -> Result<(), RegionError> {
        self.regions.delete(name)
    }

    /// Ends the regions whose lease is over at `now` exactly as [`Node::delete_region`] does
    /// (the reaper calls it every 250 ms; tests call it with a `now` of their choosing).
    /// Blocking (the catalog is written): call it off the runtime's threads. Returns how many.
    pub fn reap_regions(&self, now: SystemTime) -> usize {
        self.regions.reap(now)
    }

    /// The sizes of the agent's per-owner maps (tests and introspection).
    pub fn state_counts(&self) -> StateCounts {
        let (grants, grant_tokens, grant_slots, grant_channels) = self.regions.grants.counts();
        let (notify_channels, rings, subscribers) = self.regions.grants.hub().counts();
        StateCounts {
            regions: self.regions.registry.totals().0,
            grants,
            grant_tokens,
            grant_slots,
            grant_channels,
            notify_channels,
            rings,
            subscribers,
            accepted: self.responder.accepted.lock().unwrap_or_else(|e| e.into_inner()).len(),
            submitting: self.initiator.submitting.lock().unwrap_or_else(|e| e.into_inner()).len(),
            transfers_active: self.initiator.transfers.active(None).len(),
            transfers_kept: self.initiator.transfers.len(),
            inbound_kept: self.responder.inbound.len(),
            peers: self.initiator.peers.list().len(),
            peer_aliases: self.initiator.peers.alias_count(),
            tenants: self.tenants_holding(),
            lease_tenants: self.initiator.peers.lease_tenants(),
            bench_region: self.regions.bench_region.lock().unwrap_or_else(|e| e.into_inner()).is_some(),
        }
    }
}
