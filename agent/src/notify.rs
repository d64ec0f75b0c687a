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
//! missed, never blocks the data path.
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use tokio::sync::broadcast;

use crate::fabric::RemoteOp;
use crate::metrics as m;

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
        Pending { slot: 0, tag, markers: markers.max(1), seen: AtomicU32::new(0), first: Mutex::new(None), published: AtomicBool::new(false) }
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
pub struct Hub {
    tx: broadcast::Sender<Arc<Notification>>,
}

impl Hub {
    /// `capacity`: notifications a subscriber may fall behind before it is told it lost some.
    pub fn new(capacity: usize) -> Hub {
        let (tx, _) = broadcast::channel(capacity.max(1));
        Hub { tx }
    }

    /// A new subscriber, unless `max` are subscribed already: every publication wakes every
    /// waiting subscriber, so their number is bounded.
    pub fn subscribe_bounded(&self, max: usize) -> Option<broadcast::Receiver<Arc<Notification>>> {
        (self.tx.receiver_count() < max).then(|| self.tx.subscribe())
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Notification>> {
        self.tx.subscribe()
    }

    /// Publishes `p` unless it already was (markers and `Peer.Complete` race; the first wins).
    pub fn publish(&self, p: &Pending, about: About<'_>, via: Via) -> bool {
        if !p.claim() {
            return false;
        }
        let delay = p.started().map(|t| t.elapsed());
        let n = Notification {
            region: about.region.to_string(),
            region_id: about.region_id.to_string(),
            peer: about.peer.to_string(),
            tag: p.tag.clone(),
            op: about.op,
            offset: about.offset,
            length: about.length,
            at: SystemTime::now(),
            via,
        };
        // No subscriber is not an error: nobody was waiting.
        let _ = self.tx.send(Arc::new(n));
        m::notification_published(via.as_str(), delay);
        true
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
