//! The per-identity shares of the limits a client fills by creating things: regions and their
//! bytes, and `WatchInbound` subscriptions (streams and rings). Transfers and channels are
//! counted with their slots (`limits`); a peer's inbound records where they are kept
//! (`responder`).
//!
//! Each operation here takes its permits before anything is allocated and hands them to what it
//! creates (a region holds its own, a subscription's stream holds its), so the share is given
//! back on every path by which that thing ends.
use std::sync::Arc;

use super::inbound::{InboundRing, MAX_SUBSCRIBERS};
use super::Node;
use crate::config::LimitsConfig;
use crate::error::NodeError;
use crate::metrics as m;
use crate::notify::Subscription;
use crate::regions::{Region, RegionError, RegionSpec};
use crate::tenants::{Permit, Permits, Quota, ShareExceeded, Tenant};

/// `ReadRegion`/`WriteRegion` streams open at once on one agent. Each holds up to a 1 MiB piece
/// (a read) or one decoded message (a write) while its client does not take or send the rest:
/// unbounded, a client that opens streams and never reads them grows the agent without limit.
pub(super) const MAX_BYTE_STREAMS: usize = 64;

pub(super) struct Shares {
    regions: Quota,
    bytes: Quota,
    watchers: Quota,
    byte_streams: Quota,
    /// The global bound of `byte_streams` (a quota only bounds each tenant).
    byte_streams_all: Arc<tokio::sync::Semaphore>,
}

/// A `ReadRegion`/`WriteRegion` stream's place: its tenant's share and the agent's bound, held by
/// the stream's state until it ends.
pub struct StreamSlot {
    _share: Permit,
    _all: tokio::sync::OwnedSemaphorePermit,
}

impl Shares {
    pub(super) fn new(limits: &LimitsConfig) -> Shares {
        let f = limits.tenant_share;
        Shares {
            regions: Quota::new("regions", limits.max_regions as u64, f),
            bytes: Quota::new("registered bytes", limits.max_registered_bytes.0, f),
            watchers: Quota::new("WatchInbound subscriptions", MAX_SUBSCRIBERS as u64, f),
            byte_streams: Quota::new("ReadRegion/WriteRegion streams", MAX_BYTE_STREAMS as u64, f),
            byte_streams_all: Arc::new(tokio::sync::Semaphore::new(MAX_BYTE_STREAMS)),
        }
    }
}

impl Shares {
    /// Charges a region restored from the catalog to its tenant's region and byte shares.
    pub(super) fn charge(&self) -> crate::regions::Charge {
        let (regions, bytes) = (self.regions.clone(), self.bytes.clone());
        Box::new(move |owner, length| Arc::new(Permits(vec![regions.charge(owner, 1), bytes.charge(owner, length)])))
    }
}

/// Takes `n` units of `q` for `tenant`; a refusal is counted under `limit` in
/// `xfer_tenant_share_refused_total`.
fn take(q: &Quota, tenant: &Tenant, n: u64, limit: &'static str) -> Result<Permit, ShareExceeded> {
    q.take(tenant, n).inspect_err(|_| m::share_refused(limit))
}

fn exhausted(e: ShareExceeded) -> NodeError {
    NodeError::Limit(e.to_string())
}

impl Node {
    /// `CreateRegion` on behalf of `tenant`: its share of `max_regions` and
    /// `max_registered_bytes` is taken first, then held by the region until it is gone.
    pub fn create_region_as(&self, mut spec: RegionSpec, tenant: &Tenant) -> Result<Arc<Region>, RegionError> {
        let limit = |e: ShareExceeded| RegionError::Limit(e.to_string());
        // A file region without a length is charged its file's size, not 0.
        self.regions.registry.resolve_length(&mut spec)?;
        let count = take(&self.regions.shares.regions, tenant, 1, "regions").map_err(limit)?;
        let bytes = take(&self.regions.shares.bytes, tenant, spec.length, "registered_bytes").map_err(limit)?;
        spec.shares = Some(Arc::new(Permits(vec![count, bytes])));
        self.create_region(spec)
    }

    /// `WatchInbound` on behalf of `tenant`; the permit must live as long as the subscription.
    pub fn watch_inbound_as(&self, region: &str, tag: Option<&[u8]>, tenant: &Tenant) -> Result<(Subscription, Permit), NodeError> {
        let permit = self.watcher_permit(tenant)?;
        Ok((self.watch_inbound(region, tag)?, permit))
    }

    /// `WatchInboundRing` on behalf of `tenant`: a subscription, and a mapping counted against
    /// `max_registered_bytes` like a region's, so its bytes come out of the tenant's byte share
    /// too (rings alone would otherwise take every registered byte). The permits must live as
    /// long as the ring.
    pub fn watch_inbound_ring_as(
        &self,
        region: &str,
        tag: Option<&[u8]>,
        slots: u32,
        tenant: &Tenant,
    ) -> Result<(InboundRing, Permits), NodeError> {
        let (_, _, length) = self.ring_shape(slots)?;
        let watcher = self.watcher_permit(tenant)?;
        let bytes = take(&self.regions.shares.bytes, tenant, length, "registered_bytes").map_err(exhausted)?;
        Ok((self.watch_inbound_ring(region, tag, slots)?, Permits(vec![watcher, bytes])))
    }

    /// A place for one `ReadRegion`/`WriteRegion` stream of `tenant`, or RESOURCE_EXHAUSTED.
    pub fn byte_stream_slot(&self, tenant: &Tenant) -> Result<StreamSlot, NodeError> {
        let share = take(&self.regions.shares.byte_streams, tenant, 1, "byte_streams").map_err(exhausted)?;
        let all =
            self.regions.shares.byte_streams_all.clone().try_acquire_owned().map_err(|_| {
                NodeError::Limit(format!("{MAX_BYTE_STREAMS} ReadRegion/WriteRegion streams are open on this agent already"))
            })?;
        Ok(StreamSlot { _share: share, _all: all })
    }

    fn watcher_permit(&self, tenant: &Tenant) -> Result<Permit, NodeError> {
        take(&self.regions.shares.watchers, tenant, 1, "watchers").map_err(exhausted)
    }

    /// Identities holding a share of anything (entries live only while something is held).
    pub fn tenants_holding(&self) -> usize {
        self.regions.shares.regions.tenants() + self.regions.shares.bytes.tenants() + self.regions.shares.watchers.tenants()
    }
}
