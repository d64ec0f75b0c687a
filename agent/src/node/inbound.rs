//! Notifications on this agent's side: subscribing to what peers publish (`WatchInbound`, and
//! `WatchInboundRing`'s shared-memory rings) and the bound every notification tag keeps.
use std::sync::Arc;

use super::Node;
use crate::error::NodeError;

/// `WatchInbound` subscriptions (streams and rings) alive at once on one agent.
pub(super) const MAX_SUBSCRIBERS: usize = 256;

/// Slots of a notification ring unless the caller asks otherwise.
const DEFAULT_RING_SLOTS: u32 = 1024;

/// A live `WatchInboundRing` subscription. Dropping it stops the writes, marks the ring closed
/// (a sleeping reader wakes), removes the object and gives its bytes back.
pub struct InboundRing {
    pub object: String,
    pub length: u64,
    pub slots: u32,
    pub slot_size: u32,
    slot: Option<crate::notify::RingSlot>,
    /// The object's path, removed on drop.
    path: std::path::PathBuf,
    _reservation: crate::regions::Reservation,
}

impl InboundRing {
    /// Resolves with the reason once the agent cannot write the ring any more (the object was
    /// cut short, or the shm filesystem filled up); the subscription should then end.
    pub async fn failed(&self) -> String {
        match &self.slot {
            Some(s) => s.failed().await,
            None => std::future::pending().await,
        }
    }
}

impl Drop for InboundRing {
    fn drop(&mut self) {
        drop(self.slot.take());
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!(object = %self.object, error = %e, "could not remove a notification ring's shm object");
        }
        crate::metrics::inbound_rings(-1);
    }
}

impl Node {
    /// Subscribes to the notifications published on this agent (`WatchInbound`): those of
    /// `region` (a name or id, resolved now to the region's id; empty = every region). Nothing
    /// published once this returns is missed (short of falling 4,096 behind).
    pub fn watch_inbound(&self, region: &str, tag: Option<&[u8]>) -> Result<crate::notify::Subscription, NodeError> {
        let id = self.inbound_filter(region, tag)?;
        // Per region: a subscriber falls behind only by its own region's notifications.
        let sub =
            self.regions.grants.hub().subscribe_bounded(id.as_deref(), MAX_SUBSCRIBERS).ok_or_else(|| {
                NodeError::Limit(format!("{} WatchInbound subscribers are connected to this agent already", MAX_SUBSCRIBERS))
            })?;
        // A region that ended since it was looked up has forgotten its channel already; this
        // subscription would have made it anew and never be told. Looked up again after joining:
        // an end from now on takes the channel out (and ends this stream).
        if let Some(id) = &id {
            self.regions.registry.get(id)?;
        }
        Ok(sub)
    }

    /// `WatchInboundRing`: a shared-memory ring (`xfer_rdma::ring`) that receives the
    /// notifications `WatchInbound(region, tag)` would stream, written by whichever thread
    /// publishes them. The object is private like an shm region's (`regions.shm_mode`,
    /// `regions.shm_group`), named at random, counted against `max_registered_bytes`, and removed
    /// when the returned handle is dropped (the caller's stream closed).
    pub fn watch_inbound_ring(&self, region: &str, tag: Option<&[u8]>, slots: u32) -> Result<InboundRing, NodeError> {
        let (slots, slot_size, length) = self.ring_shape(slots)?;
        let id = self.inbound_filter(region, tag)?;
        let reservation = self.regions.registry.reserve(length, "a notification ring")?;
        let len = usize::try_from(length).map_err(|_| NodeError::Invalid("ring too large for this machine".into()))?;
        let (object, file) = self.create_ring_object(length)?;
        let remove = |e: String| {
            self.regions.registry.remove_private_shm(&object);
            NodeError::Internal(e)
        };
        let mem = match xfer_rdma::memory::RegionMemory::map_file(&file, len, true) {
            Ok(m) => m,
            Err(e) => return Err(remove(format!("mapping notification ring {object}: {e}"))),
        };
        let writer = match xfer_rdma::ring::RingWriter::create(mem, slots, slot_size) {
            Ok(w) => w,
            Err(e) => return Err(remove(format!("laying out notification ring {object}: {e}"))),
        };
        let sub = Arc::new(crate::notify::RingSub::new(id, tag.map(<[u8]>::to_vec), writer));
        let Some(slot) = self.regions.grants.hub().add_ring(sub, MAX_SUBSCRIBERS) else {
            self.regions.registry.remove_private_shm(&object);
            return Err(NodeError::Limit(format!("{} WatchInbound subscribers are connected to this agent already", MAX_SUBSCRIBERS)));
        };
        crate::metrics::inbound_rings(1);
        let path = self.regions.registry.shm_path(&object);
        Ok(InboundRing { object, length, slots, slot_size, slot: Some(slot), path, _reservation: reservation })
    }

    /// The slots (0 = the default), slot size and byte length of a ring asked for with `slots`,
    /// checked: what a ring costs is known before anything is reserved or created.
    pub(super) fn ring_shape(&self, slots: u32) -> Result<(u32, u32, u64), NodeError> {
        let slots = if slots == 0 { DEFAULT_RING_SLOTS } else { slots };
        xfer_rdma::ring::check_slots(slots).map_err(NodeError::Invalid)?;
        // Slots hold the largest tag, region name and peer identity this agent produces.
        let max = self.config.transfer.max_notify_bytes;
        let slot_size = xfer_rdma::ring::slot_size(max, crate::regions::MAX_NAME_LEN, xfer_fabric::identity::MAX_NAME_LEN);
        Ok((slots, slot_size, xfer_rdma::ring::ring_len(slots, slot_size)))
    }

    /// A subscription's filter checked: the region (a name or id, resolved now to its id; empty =
    /// every region) and a tag no longer than any this agent accepts.
    fn inbound_filter(&self, region: &str, tag: Option<&[u8]>) -> Result<Option<String>, NodeError> {
        let max = self.config.transfer.max_notify_bytes;
        if tag.is_some_and(|t| t.len() > max) {
            return Err(NodeError::Invalid(format!("tag filter longer than any tag this agent accepts ({max} bytes)")));
        }
        Ok(match region {
            "" => None,
            r => Some(self.regions.registry.get(r)?.id.clone()),
        })
    }

    /// A new, randomly named shm object for a ring (a name taken by someone else is skipped).
    fn create_ring_object(&self, length: u64) -> Result<(String, std::fs::File), NodeError> {
        let mut last = None;
        for _ in 0..4 {
            let object = format!("{}{:016x}", self.responder.ring_prefix, rand::random::<u64>());
            match self.regions.registry.create_private_shm(&object, length) {
                Ok(f) => return Ok((object, f)),
                Err(e @ crate::regions::RegionError::ShmExists { .. }) => last = Some(e),
                Err(e) => return Err(e.into()),
            }
        }
        Err(last.map_or_else(|| NodeError::Internal("no ring object".into()), NodeError::from))
    }

    /// A notification tag this agent sends or accepts: at most `transfer.max_notify_bytes`.
    pub(super) fn check_notify_tag(&self, tag: &[u8]) -> Result<(), NodeError> {
        let max = self.config.transfer.max_notify_bytes;
        if tag.len() > max {
            return Err(NodeError::Invalid(format!(
                "notification tag of {} bytes; this agent takes at most {max} (transfer.max_notify_bytes)",
                tag.len()
            )));
        }
        Ok(())
    }
}
