//! Each tenant's share of what this agent keeps to one peer: leased connections and their
//! streams (QPs). The entry's bound (`limits.max_connections_per_peer` and what the peer
//! advertises) is the agent's as a whole; without a share, one client's long-lived channels with
//! many QPs would hold every stream the peer keeps for this agent, and every other client's
//! transfer to that peer would be refused until they end.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::tenants::{share_of, Tenant};

/// Leased connections and streams per tenant, for one peer entry.
#[derive(Debug, Default)]
pub(super) struct TenantLeases {
    held: Arc<Mutex<HashMap<Tenant, (usize, usize)>>>,
}

/// One lease's charge to its tenant; given back on drop (release, discard, a cancelled future).
pub(super) struct LeaseCharge {
    held: Arc<Mutex<HashMap<Tenant, (usize, usize)>>>,
    tenant: Tenant,
    streams: usize,
}

impl TenantLeases {
    /// Charges one connection of `streams` to `tenant` unless that passes its share (`share` of
    /// `max_conns` connections and of `max_streams` streams; `usize::MAX` = no bound). `Err` says
    /// what it holds and its share. Exempt tenants are not counted.
    pub(super) fn charge(
        &self,
        tenant: &Tenant,
        streams: usize,
        max_conns: usize,
        max_streams: usize,
        share: f64,
    ) -> Result<Option<LeaseCharge>, String> {
        // Exempt tenants, and shares turned off (1): the entry's own bound is the only one.
        if tenant.key().is_none() || share >= 1.0 {
            return Ok(None);
        }
        let cap = |max: usize| if max == usize::MAX { usize::MAX } else { share_of(max as u64, share) as usize };
        let (conn_cap, stream_cap) = (cap(max_conns), cap(max_streams));
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let (c, s) = held.get(tenant).copied().unwrap_or((0, 0));
        if c + 1 > conn_cap || s.saturating_add(streams) > stream_cap {
            return Err(format!(
                "{tenant} holds {c} connections ({s} streams) to this peer: its share is {conn_cap} connections{} \
                 (limits.tenant_share of what this agent keeps for the peer); other identities keep the rest",
                if stream_cap == usize::MAX { String::new() } else { format!(" and {stream_cap} streams") }
            ));
        }
        let e = held.entry(tenant.clone()).or_insert((0, 0));
        *e = (e.0 + 1, e.1 + streams);
        Ok(Some(LeaseCharge { held: self.held.clone(), tenant: tenant.clone(), streams }))
    }

    /// Tenants holding leases (an entry lives only while something is leased).
    pub(super) fn tenants(&self) -> usize {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The connections and streams (QPs) `tenant` holds.
    pub(super) fn of(&self, tenant: &Tenant) -> (usize, usize) {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).get(tenant).copied().unwrap_or((0, 0))
    }
}

impl LeaseCharge {
    /// Makes this lease's charge `streams`, the QPs its connection really holds (known once it
    /// is made or taken from the idle list; it was charged what it could hold at most).
    pub(super) fn settle(&mut self, streams: usize) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = held.get_mut(&self.tenant) {
            e.1 = e.1.saturating_sub(self.streams).saturating_add(streams);
        }
        self.streams = streams;
    }
}

impl Drop for LeaseCharge {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = held.get_mut(&self.tenant) {
            *e = (e.0.saturating_sub(1), e.1.saturating_sub(self.streams));
            if e.0 == 0 {
                held.remove(&self.tenant);
            }
        }
    }
}
