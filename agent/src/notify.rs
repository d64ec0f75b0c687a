//! Target-side notifications: a peer that moves a batch into (or out of) one of this agent's
//! regions can ask, with its grant, that local applications be told once every byte is in place.
//!
//! The grant carries a [`Pending`] notification (the tag, how many markers to expect and the
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
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use tokio::sync::broadcast;

use crate::metrics as m;
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

/// A grant's notification until it is published.
#[derive(Debug)]
pub struct Pending {
    /// Markers name it by this (set by the grant table when the grant is inserted; never 0).
    pub slot: u32,
    pub tag: Vec<u8>,
    /// Markers to wait for: one per QP of the initiator's connection.
    pub markers: u32,
    seen: AtomicU32,
    /// When the first marker arrived (the delay histogram starts there).
    first: Mutex<Option<Instant>>,
    published: AtomicBool,
}

impl Pending {
    pub fn new(tag: Vec<u8>, markers: u32) -> Pending {
        Pending {
            slot: 0,
            tag,
            markers: markers.max(1),
            seen: AtomicU32::new(0),
            first: Mutex::new(None),
            published: AtomicBool::new(false),
        }
    }

    /// Counts one marker; true when it was the last one expected.
    pub fn marker(&self) -> bool {
        if let Ok(mut f) = self.first.lock() {
            f.get_or_insert_with(Instant::now);
        }
        self.seen.fetch_add(1, Ordering::AcqRel).saturating_add(1) == self.markers
    }

    /// Claims the right to publish (true once).
    fn claim(&self) -> bool {
        !self.published.swap(true, Ordering::AcqRel)
    }

    pub fn is_published(&self) -> bool {
        self.published.load(Ordering::Acquire)
    }

    fn started(&self) -> Option<Instant> {
        self.first.lock().ok().and_then(|f| *f)
    }
}

/// Marker immediates of channel grants have this bit set; the grant's channel slot is in bits
/// 16..31 and the batch's sequence number (mod 2^16) in bits 0..16. Plain slots stay below it.
pub const CHANNEL_BIT: u32 = 1 << 31;
/// Channel slots are 1..=this (15 bits).
pub const MAX_CHANNEL_SLOT: u32 = 0x7fff;
/// Batches of one channel whose notification may be outstanding at once (announced or marked
/// but not yet published). Below 2^15, so that 16 bits of sequence number name one batch.
pub const CHANNEL_WINDOW: u64 = 1024;
/// Tag bytes one channel grant keeps for batches announced but not yet published (an announce
/// is always taken when none is kept, so a tag of any allowed size fits). The window alone
/// bounded the *count*: 1024 tags of `transfer.max_notify_bytes` per channel grant, times
/// `limits.max_grants_per_peer`, let one peer identity park 1 GiB in this agent at the defaults
/// (64 GiB at the tag ceiling) by announcing batches it never marks. An honest initiator has one
/// or two batches announced and unpublished at a time.
pub const CHANNEL_TAG_BYTES: usize = 64 << 10;

/// The immediate a marker of batch `seq` carries on a channel whose grant's slot base is `base`
/// (`CHANNEL_BIT | slot << 16`, what `GrantResponse.notify_slot` says).
pub fn channel_imm(base: u32, seq: u64) -> u32 {
    base | (seq & 0xffff) as u32
}

/// Why a channel marker or announcement was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChannelRefusal {
    #[error("the marker names another channel")]
    WrongChannel,
    #[error("batch {0} is outside the window of {CHANNEL_WINDOW} batches not yet notified")]
    OutOfWindow(u64),
    #[error("batch {0} was already notified")]
    AlreadyPublished(u64),
    #[error("batch {0} was already announced")]
    AlreadyAnnounced(u64),
    #[error("more markers than the {0} the channel's batches carry")]
    TooManyMarkers(u32),
    #[error("batch {0}: the channel already keeps {CHANNEL_TAG_BYTES} bytes of tags of batches announced and not yet notified")]
    TagBudget(u64),
}

/// A channel grant's per-batch notifications (`NotifyRequest.channel`). Batch `seq` is
/// published once its tag was announced (`Peer.Announce`) and all `markers` of it arrived, in
/// whichever order: the markers ride the fabric behind the batch's data, the announcement the
/// control plane, and neither waits for the other. At most [`CHANNEL_WINDOW`] batches from the
/// oldest unpublished one on are tracked; anything outside is refused, so a peer cannot grow
/// this state.
#[derive(Debug)]
pub struct ChannelNotes {
    /// `CHANNEL_BIT | slot << 16`, set by the grant table when the grant is inserted.
    pub base_imm: u32,
    /// Markers per batch: one per QP of the grantee's connection.
    pub markers: u32,
    window: Mutex<Window>,
}

#[derive(Debug, Default)]
struct Window {
    /// The oldest batch not yet published.
    base: u64,
    entries: std::collections::BTreeMap<u64, Entry>,
    /// Published batches above `base` (batches may complete out of order).
    published: std::collections::BTreeSet<u64>,
    /// Bytes of the tags in `entries` (at most [`CHANNEL_TAG_BYTES`] once more than one).
    tag_bytes: usize,
}

#[derive(Debug, Default)]
struct Entry {
    tag: Option<Vec<u8>>,
    seen: u32,
    first: Option<Instant>,
}

/// A batch ready to publish: its tag and when its first marker came.
pub type Ready = (Vec<u8>, Option<Instant>);

impl ChannelNotes {
    pub fn new(markers: u32) -> ChannelNotes {
        ChannelNotes { base_imm: 0, markers: markers.max(1), window: Mutex::new(Window::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Window> {
        self.window.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One marker with immediate `imm`. `Ok(Some(..))` when it completed its batch.
    pub fn marker(&self, imm: u32) -> Result<Option<Ready>, ChannelRefusal> {
        if imm & 0xffff_0000 != self.base_imm {
            return Err(ChannelRefusal::WrongChannel);
        }
        let mut w = self.lock();
        // The one batch in the window whose number ends in these 16 bits.
        let off = (imm as u16).wrapping_sub(w.base as u16) as u64;
        if off >= CHANNEL_WINDOW {
            return Err(ChannelRefusal::OutOfWindow(w.base + off));
        }
        let seq = w.base + off;
        if w.published.contains(&seq) {
            return Err(ChannelRefusal::AlreadyPublished(seq));
        }
        let e = w.entries.entry(seq).or_default();
        if e.seen >= self.markers {
            return Err(ChannelRefusal::TooManyMarkers(self.markers));
        }
        e.seen += 1;
        e.first.get_or_insert_with(Instant::now);
        Ok(Self::take_if_ready(&mut w, seq, self.markers))
    }

    /// The tag of batch `seq`. `Ok(Some(..))` when its markers had all arrived already.
    pub fn announce(&self, seq: u64, tag: Vec<u8>) -> Result<Option<Ready>, ChannelRefusal> {
        let mut w = self.lock();
        if seq < w.base || w.published.contains(&seq) {
            return Err(ChannelRefusal::AlreadyPublished(seq));
        }
        if seq - w.base >= CHANNEL_WINDOW {
            return Err(ChannelRefusal::OutOfWindow(seq));
        }
        if w.entries.get(&seq).is_some_and(|e| e.tag.is_some()) {
            return Err(ChannelRefusal::AlreadyAnnounced(seq));
        }
        if w.tag_bytes > 0 && w.tag_bytes.saturating_add(tag.len()) > CHANNEL_TAG_BYTES {
            return Err(ChannelRefusal::TagBudget(seq));
        }
        w.tag_bytes += tag.len();
        let e = w.entries.entry(seq).or_default();
        e.tag = Some(tag);
        Ok(Self::take_if_ready(&mut w, seq, self.markers))
    }

    fn take_if_ready(w: &mut Window, seq: u64, markers: u32) -> Option<Ready> {
        let ready = w.entries.get(&seq).is_some_and(|e| e.tag.is_some() && e.seen == markers);
        if !ready {
            return None;
        }
        let e = w.entries.remove(&seq)?;
        w.tag_bytes -= e.tag.as_ref().map_or(0, Vec::len);
        w.published.insert(seq);
        while w.published.remove(&w.base) {
            w.base += 1;
        }
        Some((e.tag?, e.first))
    }

    /// Batches announced or marked and not yet published (tests, metrics).
    pub fn unpublished(&self) -> usize {
        self.lock().entries.len()
    }

    /// True while a batch is expected to complete: one was announced or marked and is not yet
    /// published, or none has been published yet (a fresh channel's first batch is coming).
    pub fn expecting(&self) -> bool {
        let w = self.lock();
        !w.entries.is_empty() || (w.base == 0 && w.published.is_empty())
    }
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
    pub fn publish(&self, p: &Pending, about: About<'_>, via: Via) -> bool {
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
        let p = Pending::new(b"req-7".to_vec(), 3);
        assert!(!p.marker());
        assert!(!p.marker());
        assert!(p.marker(), "third of three");
        assert!(hub.publish(&p, about(), Via::Fabric));
        assert!(!hub.publish(&p, about(), Via::Complete), "Complete after the markers is a no-op");
        let n = rx.try_recv().unwrap();
        assert_eq!((n.tag.as_slice(), n.via, n.region.as_str()), (&b"req-7"[..], Via::Fabric, "kv"));
        assert!(rx.try_recv().is_err(), "published once");
        assert!(!p.marker(), "a duplicate marker never completes it again");
    }

    /// A busy region does not push the subscribers of another region behind; a subscriber of
    /// all regions is, and is told so. Subscriptions are bounded and give their place back.
    #[test]
    fn a_busy_region_does_not_cut_off_another_regions_subscribers() {
        let hub = Hub::new(4);
        let mut quiet = hub.subscribe_bounded(Some("r2"), 3).unwrap();
        let mut all = hub.subscribe_bounded(None, 3).unwrap();
        for i in 0..100u8 {
            hub.publish(&Pending::new(vec![i], 1), about(), Via::Fabric); // region r1
        }
        let r2 = About { region: "other", region_id: "r2", ..about() };
        hub.publish(&Pending::new(b"r2".to_vec(), 1), r2, Via::Fabric);
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
        hub.publish(&Pending::new(b"n".to_vec(), 1), about(), Via::Fabric);
        assert_eq!(new.try_recv().unwrap().tag, b"n");
        drop(new);
        assert_eq!(hub.counts(), (0, 0, 0));
    }

    fn chan(markers: u32) -> ChannelNotes {
        ChannelNotes { base_imm: CHANNEL_BIT | 7 << 16, ..ChannelNotes::new(markers) }
    }

    /// A batch is ready once announced and fully marked, in either order; batches complete out of
    /// order and each is published once.
    #[test]
    fn a_channel_batch_needs_its_tag_and_every_marker_in_any_order() {
        let c = chan(2);
        let imm = |seq| channel_imm(c.base_imm, seq);
        // Batch 0: markers first.
        assert_eq!(c.marker(imm(0)), Ok(None));
        assert_eq!(c.marker(imm(0)), Ok(None), "two markers, no tag yet");
        assert_eq!(c.announce(0, b"b0".to_vec()).unwrap().map(|r| r.0), Some(b"b0".to_vec()));
        // Batch 2 before batch 1: announcement first.
        assert_eq!(c.announce(2, b"b2".to_vec()), Ok(None));
        assert_eq!(c.marker(imm(2)), Ok(None));
        assert_eq!(c.marker(imm(2)).unwrap().map(|r| r.0), Some(b"b2".to_vec()));
        assert_eq!(c.announce(1, b"b1".to_vec()), Ok(None));
        assert_eq!(c.marker(imm(1)), Ok(None));
        assert_eq!(c.marker(imm(1)).unwrap().map(|r| r.0), Some(b"b1".to_vec()));
        assert_eq!(c.unpublished(), 0);
        // Published batches stay published.
        assert_eq!(c.announce(1, b"again".to_vec()), Err(ChannelRefusal::AlreadyPublished(1)));
        assert_eq!(c.announce(2, b"again".to_vec()), Err(ChannelRefusal::AlreadyPublished(2)));
        assert_eq!(c.lock().base, 3, "the window moved past every published batch");
    }

    /// A channel expects a batch until its first is published, and afterwards only while one is
    /// announced or marked and not yet published (what the marker poller is told).
    #[test]
    fn a_channel_expects_markers_for_its_first_batch_and_for_unpublished_ones() {
        let c = chan(1);
        assert!(c.expecting(), "a fresh channel's first batch is coming");
        assert_eq!(c.announce(0, b"b0".to_vec()), Ok(None));
        assert!(c.expecting());
        assert!(c.marker(channel_imm(c.base_imm, 0)).unwrap().is_some());
        assert!(!c.expecting(), "batch 0 published, nothing else announced");
        assert_eq!(c.marker(channel_imm(c.base_imm, 1)), Ok(None), "marker before its announce");
        assert!(c.expecting());
        assert!(c.announce(1, vec![]).unwrap().is_some());
        assert!(!c.expecting());
    }

    /// What a peer controls (immediates, sequence numbers, how often it repeats them) cannot grow
    /// the state past the window or publish anything twice.
    #[test]
    fn a_channel_refuses_what_lies_outside_its_window() {
        let c = chan(1);
        let imm = |seq| channel_imm(c.base_imm, seq);
        assert_eq!(c.marker(CHANNEL_BIT | 8 << 16), Err(ChannelRefusal::WrongChannel));
        assert_eq!(c.marker(5), Err(ChannelRefusal::WrongChannel), "a plain slot");
        assert_eq!(c.announce(CHANNEL_WINDOW, b"x".to_vec()), Err(ChannelRefusal::OutOfWindow(CHANNEL_WINDOW)));
        assert_eq!(c.marker(imm(CHANNEL_WINDOW)), Err(ChannelRefusal::OutOfWindow(CHANNEL_WINDOW)));
        assert_eq!(c.marker(imm(0xffff)), Err(ChannelRefusal::OutOfWindow(0xffff)), "behind the base: outside too");
        // Fill the whole window with markers only: bounded.
        for seq in 0..CHANNEL_WINDOW {
            assert_eq!(c.marker(imm(seq)), Ok(None));
        }
        assert_eq!(c.unpublished(), CHANNEL_WINDOW as usize);
        assert_eq!(c.marker(imm(3)), Err(ChannelRefusal::TooManyMarkers(1)));
        assert_eq!(c.announce(3, b"t".to_vec()).unwrap().map(|r| r.0), Some(b"t".to_vec()));
        assert_eq!(c.announce(3, b"t".to_vec()), Err(ChannelRefusal::AlreadyPublished(3)));
        assert_eq!(c.announce(4, b"a".to_vec()).unwrap().map(|r| r.0), Some(b"a".to_vec()));
        assert_eq!(c.announce(4, b"a".to_vec()), Err(ChannelRefusal::AlreadyPublished(4)));
        // Sequence numbers wrap their 16 bits: after 70,000 batches the marker still names one.
        let c = chan(1);
        for seq in 0..70_000u64 {
            assert_eq!(c.announce(seq, vec![]), Ok(None));
            assert!(c.marker(channel_imm(c.base_imm, seq)).unwrap().is_some(), "batch {seq}");
        }
        assert_eq!(c.unpublished(), 0);
    }

    /// Tags of announced, unpublished batches are bounded by bytes; publishing gives room back,
    /// and a refused announce leaves no trace in the window.
    #[test]
    fn a_channel_keeps_a_bounded_number_of_tag_bytes() {
        let c = chan(1);
        let big = |seq: u64| vec![seq as u8; 1024];
        for seq in 0..64 {
            assert_eq!(c.announce(seq, big(seq)), Ok(None));
        }
        assert_eq!(c.announce(64, big(64)), Err(ChannelRefusal::TagBudget(64)));
        assert_eq!(c.unpublished(), 64, "the refused announce left no entry");
        assert_eq!(c.announce(64, vec![]), Ok(None), "an empty tag still fits");
        assert_eq!(c.marker(channel_imm(c.base_imm, 5)).unwrap().map(|r| r.0), Some(big(5)));
        assert_eq!(c.announce(65, big(65)), Ok(None), "room again");
        assert_eq!(c.announce(66, big(66)), Err(ChannelRefusal::TagBudget(66)));
        // One tag is always taken, whatever its size.
        let c = chan(1);
        assert_eq!(c.announce(0, vec![0; CHANNEL_TAG_BYTES + 1]), Ok(None));
        assert_eq!(c.announce(1, vec![1]), Err(ChannelRefusal::TagBudget(1)));
    }

    #[test]
    fn a_slow_subscriber_is_told_what_it_missed() {
        let hub = Hub::new(2);
        let mut rx = hub.subscribe();
        for i in 0..5u8 {
            hub.publish(&Pending::new(vec![i], 1), about(), Via::Complete);
        }
        match rx.try_recv() {
            Err(broadcast::error::TryRecvError::Lagged(n)) => assert_eq!(n, 3),
            other => panic!("expected a lag report, got {other:?}"),
        }
        assert_eq!(rx.try_recv().unwrap().tag, vec![3]);
    }
}
