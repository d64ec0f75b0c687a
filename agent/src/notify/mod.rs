//! Target-side notifications: a peer that moves a batch into (or out of) one of this agent's
//! regions can ask, with its grant, that local applications be told once every byte is in place.
//!
//! The grant carries a [`PendingNote`] (the tag, how many markers to expect and the
//! slot markers name it by). The initiator ends every QP of its connection with a zero-length
//! marker behind its last data work request (verbs: RDMA WRITE WITH IMMEDIATE carrying the slot;
//! tcp: a NOTIFY frame under the grant's token). Both fabrics execute one QP's requests in order
//! at the target, so when the last marker arrives every byte before it on every QP is visible:
//! the notification is published then ([`Via::Fabric`]) — one one-way trip after the data, no
//! gRPC round trip. `Peer.Complete` (which the initiator sends only after all its completions)
//! publishes it too if the markers have not all been seen yet ([`Via::Complete`]); whichever
//! comes first wins and the other is a no-op, so a notification is published at most once, and
//! never for a batch that failed or was cancelled (its grant is revoked without one).
//!
//! The [`Hub`] fans notifications out to `WatchInbound` subscribers through a bounded broadcast
//! channel: a subscriber that falls behind by more than its capacity is told how many it
//! missed, never blocks the data path. `WatchInboundRing` subscribers ([`RingSub`]) get them
//! written into their shared-memory ring (`xfer_rdma::ring`) on the publishing thread itself.
//!
//! The bookkeeping of markers and announcements is sans-IO, in `xfer_engine::notes`; this module
//! is the tokio side: the hub, its subscriptions and rings.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use tokio::sync::broadcast;

use crate::metrics as m;
use xfer_engine::notes::PendingNote;
use xfer_fabric::RemoteOp;

/// How a notification was known to be due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// Every marker arrived, in order behind the data on its QP.
    Fabric,
    /// `Peer.Complete` arrived first.
    Complete,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Via::Fabric => "fabric",
            Via::Complete => "complete",
        }
    }
}

/// One published notification.
#[derive(Debug, Clone)]
pub struct Notification {
    pub region: String,
    pub region_id: String,
    /// Node name of the agent that moved the bytes.
    pub peer: String,
    pub tag: Vec<u8>,
    pub op: RemoteOp,
    /// The granted range the batch lay in.
    pub offset: u64,
    pub length: u64,
    pub at: SystemTime,
    pub via: Via,
}

/// What a notification is about: the grant's facts the subscriber sees.
pub struct About<'a> {
    pub region: &'a str,
    pub region_id: &'a str,
    pub peer: &'a str,
    pub op: RemoteOp,
    pub offset: u64,
    pub length: u64,
}

/// Fan-out to `WatchInbound` subscribers.
///
/// One channel for every region and one per region that has subscribers: a subscriber of one
/// region falls behind only by that region's notifications, so a busy region cannot cut off the
/// subscribers of another.
pub struct Hub {
    all: broadcast::Sender<Arc<Notification>>,
    /// By region id, only while the region has subscribers: the last [`Subscription`] of a
    /// region takes its channel out (its 4,096 slots are about 128 KiB), and so does the region's
    /// end ([`Hub::forget_region`]), which also ends its subscribers' streams.
    regions: Arc<RegionChannels>,
    capacity: usize,
    /// `WatchInbound` subscriptions alive ([`Subscription`]s and rings).
    subscribers: Arc<AtomicUsize>,
    /// `WatchInboundRing` subscribers: written in [`Hub::send`] itself, on the publishing
    /// thread (no task hop between the last marker and the application's memory).
    rings: Mutex<Vec<Arc<RingSub>>>,
}

/// One `WatchInboundRing` subscription: its filter and its ring (one writer at a time).
pub struct RingSub {
    region_id: Option<String>,
    tag: Option<Vec<u8>>,
    writer: Mutex<xfer_rdma::ring::RingWriter>,
    /// Set once a write failed (the object shrank, /dev/shm filled up): the ring is closed and
    /// written no more, and the subscription ends with this reason.
    failed: tokio::sync::watch::Sender<Option<String>>,
}

impl RingSub {
    pub fn new(region_id: Option<String>, tag: Option<Vec<u8>>, writer: xfer_rdma::ring::RingWriter) -> RingSub {
        RingSub { region_id, tag, writer: Mutex::new(writer), failed: tokio::sync::watch::channel(None).0 }
    }

    fn has_failed(&self) -> bool {
        self.failed.borrow().is_some()
    }

    fn wants(&self, n: &Notification) -> bool {
        self.region_id.as_ref().is_none_or(|r| *r == n.region_id) && self.tag.as_ref().is_none_or(|t| *t == n.tag)
    }

    fn write(&self, n: &Notification) {
        use xfer_rdma::ring::{RingNote, RingOp, RingVia};
        let note = RingNote {
            seq: 0,
            at_unix_ns: n.at.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos().min(u64::MAX as u128) as u64),
            offset: n.offset,
            length: n.length,
            op: match n.op {
                RemoteOp::Write => RingOp::Write,
                RemoteOp::Read => RingOp::Read,
            },
            via: match n.via {
                Via::Fabric => RingVia::Fabric,
                Via::Complete => RingVia::Complete,
            },
            tag: n.tag.clone(),
            region: n.region.clone(),
            peer: n.peer.clone(),
        };
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        if self.has_failed() {
            return;
        }
        if let Err(e) = w.publish(&note) {
            // Slots hold the largest tag and names this agent accepts, so this is the object
            // failing under the agent (cut short, or /dev/shm full): the ring is lost. Close it
            // (a reader that can still see the flag stops) and end the subscription, which
            // tells the reader through its stream even if it cannot.
            tracing::warn!(error = %e, "a notification ring can no longer be written; ending its subscription");
            let _ = w.close();
            self.failed.send_replace(Some(format!("the agent can no longer write this notification ring ({e}); subscribe again")));
        }
    }

    /// Tells the reader nothing more comes (a ring that failed was closed when it did).
    pub fn close(&self) {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        if self.has_failed() {
            return;
        }
        if let Err(e) = w.close() {
            tracing::warn!(error = %e, "closing a notification ring");
        }
    }
}

/// A ring subscription's place in the [`Hub`]: dropping it stops the writes and gives the
/// subscriber slot back.
pub struct RingSlot {
    hub: std::sync::Weak<Hub>,
    sub: Arc<RingSub>,
    _slot: SubscriberSlot,
}

impl RingSlot {
    /// Resolves with the reason once the ring cannot be written any more (never, normally).
    pub async fn failed(&self) -> String {
        let mut rx = self.sub.failed.subscribe();
        let why = match rx.wait_for(Option::is_some).await {
            Ok(v) => v.clone(),
            // The sender lives in `sub`, which this slot holds: not reached.
            Err(_) => None,
        };
        match why {
            Some(w) => w,
            None => std::future::pending().await,
        }
    }
}

impl Drop for RingSlot {
    fn drop(&mut self) {
        if let Some(hub) = self.hub.upgrade() {
            hub.rings.lock().unwrap_or_else(|e| e.into_inner()).retain(|r| !Arc::ptr_eq(r, &self.sub));
        }
        self.sub.close();
    }
}

/// Region id → (the channel's serial number, its sender). The serial tells a subscription whose
/// channel was taken out (its region ended) from one that replaced it under the same id.
type RegionChannels = Mutex<RegionMap>;

#[derive(Default)]
struct RegionMap {
    next: u64,
    by_id: HashMap<String, (u64, broadcast::Sender<Arc<Notification>>)>,
}

/// A counted subscription: its place is given back when it is dropped, and the last subscription
/// of a region takes the region's channel with it.
pub struct Subscription {
    rx: broadcast::Receiver<Arc<Notification>>,
    /// The region's channel map, id and channel serial, for a subscription to one region.
    region: Option<(Arc<RegionChannels>, String, u64)>,
    _slot: SubscriberSlot,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let Some((regions, id, serial)) = self.region.take() else { return };
        // Under the map's lock, so that no subscribe joins the channel between the count and the
        // removal: this receiver is still alive, so a count of one is this subscription alone.
        let mut map = regions.lock().unwrap_or_else(|e| e.into_inner());
        if map.by_id.get(&id).is_some_and(|(s, tx)| *s == serial && tx.receiver_count() <= 1) {
            map.by_id.remove(&id);
        }
    }
}

struct SubscriberSlot(Arc<AtomicUsize>);

impl SubscriberSlot {
    fn new(count: Arc<AtomicUsize>) -> SubscriberSlot {
        m::inbound_subscribers(1);
        SubscriberSlot(count)
    }
}

impl Drop for SubscriberSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        m::inbound_subscribers(-1);
    }
}

impl Subscription {
    pub async fn recv(&mut self) -> Result<Arc<Notification>, broadcast::error::RecvError> {
        self.rx.recv().await
    }

    pub fn try_recv(&mut self) -> Result<Arc<Notification>, broadcast::error::TryRecvError> {
        self.rx.try_recv()
    }
}

impl Hub {
    /// `capacity`: notifications a subscriber may fall behind before it is told it lost some.
    pub fn new(capacity: usize) -> Hub {
        let capacity = capacity.max(1);
        let (all, _) = broadcast::channel(capacity);
        Hub {
            all,
            regions: Arc::new(Mutex::new(RegionMap::default())),
            capacity,
            subscribers: Arc::new(AtomicUsize::new(0)),
            rings: Mutex::new(Vec::new()),
        }
    }

    /// Adds a ring subscriber unless `max` subscriptions (streams and rings) are alive already.
    pub fn add_ring(self: &Arc<Self>, sub: Arc<RingSub>, max: usize) -> Option<RingSlot> {
        let taken = self.subscribers.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1));
        if taken.is_err() {
            return None;
        }
        let slot = SubscriberSlot::new(Arc::clone(&self.subscribers));
        self.rings.lock().unwrap_or_else(|e| e.into_inner()).push(Arc::clone(&sub));
        Some(RingSlot { hub: Arc::downgrade(self), sub, _slot: slot })
    }

    /// A counted subscription to one region's notifications (`Some(region id)`) or to all, unless
    /// `max` are alive already: every publication wakes its subscribers, so they are bounded.
    pub fn subscribe_bounded(&self, region_id: Option<&str>, max: usize) -> Option<Subscription> {
        let taken = self.subscribers.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1));
        if taken.is_err() {
            return None;
        }
        let slot = SubscriberSlot::new(Arc::clone(&self.subscribers));
        let (rx, region) = match region_id {
            None => (self.all.subscribe(), None),
            Some(id) => {
                let mut map = self.regions.lock().unwrap_or_else(|e| e.into_inner());
                let RegionMap { next, by_id } = &mut *map;
                let (serial, tx) = by_id.entry(id.to_string()).or_insert_with(|| {
                    *next += 1;
                    (*next, broadcast::channel(self.capacity).0)
                });
                (tx.subscribe(), Some((Arc::clone(&self.regions), id.to_string(), *serial)))
            }
        };
        Some(Subscription { rx, region, _slot: slot })
    }

    /// A region ended (deleted, its lease over): its channel goes, and its subscribers' streams
    /// end once they have read what was published before.
    pub fn forget_region(&self, region_id: &str) {
        self.regions.lock().unwrap_or_else(|e| e.into_inner()).by_id.remove(region_id);
    }

    /// Per-region channels, ring subscribers and subscriptions alive (tests, introspection).
    pub fn counts(&self) -> (usize, usize, usize) {
        let channels = self.regions.lock().unwrap_or_else(|e| e.into_inner()).by_id.len();
        let rings = self.rings.lock().unwrap_or_else(|e| e.into_inner()).len();
        (channels, rings, self.subscribers.load(Ordering::Acquire))
    }

    /// Every notification, uncounted (in-process observers: tests).
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Notification>> {
        self.all.subscribe()
    }

    /// Publishes `p` unless it already was (markers and `Peer.Complete` race; the first wins).
    pub fn publish(&self, p: &PendingNote, about: About<'_>, via: Via) -> bool {
        if !p.claim() {
            return false;
        }
        self.send(p.tag.clone(), p.started(), about, via);
        true
    }

    /// Sends one notification to its region's subscribers and to those of every region.
    /// `first`: when its first marker arrived (the delay histogram starts there).
    pub fn send(&self, tag: Vec<u8>, first: Option<Instant>, about: About<'_>, via: Via) {
        let delay = first.map(|t| t.elapsed());
        let n = Notification {
            region: about.region.to_string(),
            region_id: about.region_id.to_string(),
            peer: about.peer.to_string(),
            tag,
            op: about.op,
            offset: about.offset,
            length: about.length,
            at: SystemTime::now(),
            via,
        };
        // No subscriber is not an error: nobody was waiting.
        let n = Arc::new(n);
        // Rings first: their readers are the ones that poll. A ring that failed is let go.
        {
            let mut rings = self.rings.lock().unwrap_or_else(|e| e.into_inner());
            for r in rings.iter().filter(|r| r.wants(&n)) {
                r.write(&n);
            }
            rings.retain(|r| !r.has_failed());
        }
        {
            // A channel is in the map only while it has subscribers (see `Subscription`'s drop).
            let map = self.regions.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((_, tx)) = map.by_id.get(&n.region_id) {
                let _ = tx.send(Arc::clone(&n));
            }
        }
        let _ = self.all.send(n);
        m::notification_published(via.as_str(), delay);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn about() -> About<'static> {
        About { region: "kv", region_id: "r1", peer: "a", op: RemoteOp::Write, offset: 0, length: 8 }
    }

    #[test]
    fn the_last_marker_completes_and_publication_happens_once() {
        let hub = Hub::new(4);
        let mut rx = hub.subscribe();
        let p = PendingNote::new(b"req-7".to_vec(), 3);
        assert!(!p.marker(Instant::now()));
        assert!(!p.marker(Instant::now()));
        assert!(p.marker(Instant::now()), "third of three");
        assert!(hub.publish(&p, about(), Via::Fabric));
        assert!(!hub.publish(&p, about(), Via::Complete), "Complete after the markers is a no-op");
        let n = rx.try_recv().unwrap();
        assert_eq!((n.tag.as_slice(), n.via, n.region.as_str()), (&b"req-7"[..], Via::Fabric, "kv"));
        assert!(rx.try_recv().is_err(), "published once");
        assert!(!p.marker(Instant::now()), "a duplicate marker never completes it again");
    }

    /// A busy region does not push the subscribers of another region behind; a subscriber of
    /// all regions is, and is told so. Subscriptions are bounded and give their place back.
    #[test]
    fn a_busy_region_does_not_cut_off_another_regions_subscribers() {
        let hub = Hub::new(4);
        let mut quiet = hub.subscribe_bounded(Some("r2"), 3).unwrap();
        let mut all = hub.subscribe_bounded(None, 3).unwrap();
        for i in 0..100u8 {
            hub.publish(&PendingNote::new(vec![i], 1), about(), Via::Fabric); // region r1
        }
        let r2 = About { region: "other", region_id: "r2", ..about() };
        hub.publish(&PendingNote::new(b"r2".to_vec(), 1), r2, Via::Fabric);
        assert_eq!(quiet.try_recv().unwrap().tag, b"r2", "region r2's subscriber did not lag");
        assert!(matches!(all.try_recv(), Err(broadcast::error::TryRecvError::Lagged(_))));
        let third = hub.subscribe_bounded(Some("r1"), 3).unwrap();
        assert!(hub.subscribe_bounded(None, 3).is_none(), "at most 3");
        drop(third);
        assert!(hub.subscribe_bounded(None, 3).is_some(), "a dropped subscription gave its place back");
    }

    /// A region's channel (4,096 slots) lives only while the region has subscribers: the last
    /// one takes it out, and so does the region's end, which ends its subscribers. A subscription
    /// left from before the end never takes out the channel of a newer one.
    #[test]
    fn a_regions_channel_goes_with_its_last_subscriber_or_its_region() {
        let hub = Hub::new(4);
        let (a, b) = (hub.subscribe_bounded(Some("r1"), 8).unwrap(), hub.subscribe_bounded(Some("r1"), 8).unwrap());
        assert_eq!(hub.counts(), (1, 0, 2));
        drop(a);
        assert_eq!(hub.counts(), (1, 0, 1), "one subscriber left");
        drop(b);
        assert_eq!(hub.counts(), (0, 0, 0), "the last one took the channel out");

        let mut old = hub.subscribe_bounded(Some("r1"), 8).unwrap();
        hub.forget_region("r1");
        assert_eq!(hub.counts(), (0, 0, 1));
        assert!(matches!(old.try_recv(), Err(broadcast::error::TryRecvError::Closed)), "the region's end ends its subscribers");
        let mut new = hub.subscribe_bounded(Some("r1"), 8).unwrap();
        drop(old);
        assert_eq!(hub.counts(), (1, 0, 1), "the old subscription left the new channel alone");
        hub.publish(&PendingNote::new(b"n".to_vec(), 1), about(), Via::Fabric);
        assert_eq!(new.try_recv().unwrap().tag, b"n");
        drop(new);
        assert_eq!(hub.counts(), (0, 0, 0));
    }

    #[test]
    fn a_slow_subscriber_is_told_what_it_missed() {
        let hub = Hub::new(2);
        let mut rx = hub.subscribe();
        for i in 0..5u8 {
            hub.publish(&PendingNote::new(vec![i], 1), about(), Via::Complete);
        }
        match rx.try_recv() {
            Err(broadcast::error::TryRecvError::Lagged(n)) => assert_eq!(n, 3),
            other => panic!("expected a lag report, got {other:?}"),
        }
        assert_eq!(rx.try_recv().unwrap().tag, vec![3]);
    }
}
