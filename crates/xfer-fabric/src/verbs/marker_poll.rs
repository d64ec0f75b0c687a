//! The responder's marker poller: one OS thread per verbs fabric that busy-polls the marker
//! receive CQs of connections that expect a notification soon, so the last marker of a batch
//! is seen within one poll instead of after a completion-channel wake-up (the "last byte
//! visible → application" latency).
//!
//! A one-sided WRITE raises nothing at the target, so the responder cannot see a batch coming
//! from its data; what it does see is the grant: a grant with a notification (`Peer.Grant`) or
//! a channel batch's announcement (`Peer.Announce`) says that markers will follow on one
//! connection. The responder then hands that connection to this thread ([`Hot`]) until the
//! notification is published, the connection closes, or `verbs.marker_spin` has passed since
//! the ask, whichever comes first. Past that, the connection's receive task (woken by the
//! completion channel) sees its markers as before: the budget bounds the cost (one core while
//! any connection is hot), never correctness.
//!
//! The poller knows a connection only as a [`MarkerReceiver`]. Both this thread and the receive
//! task drain the same receive CQ under the connection's marker lock (held across poll and
//! delivery): each completion is read once and the markers of one connection are delivered in
//! the order they completed.
//!
//! Between rounds the thread yields its core (`sched_yield`): on a busy host, the agents,
//! the kernel's RoCE processing and the application waiting for the notification need it
//! more than another poll does.
use std::collections::VecDeque;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use xfer_rdma::cq::RawWc;

use crate::MarkerSink;
use xfer_engine::ids::ConnectionId;

/// A responder connection's marker receive side, as the poller sees it.
pub(crate) trait MarkerReceiver: Send + Sync {
    /// True while the connection has marker receives worth polling (it has a receive side and
    /// is not closing).
    fn polls_markers(&self) -> bool;
    /// Hands every marker completed so far on the connection's receive CQ to `markers` (as
    /// connection `id`); returns how many completions it read.
    fn drain_recv(&self, id: &ConnectionId, markers: Option<&Arc<dyn MarkerSink>>, buf: &mut Vec<RawWc>) -> Result<usize, std::io::Error>;
}

/// Whether the notification a connection was made hot for is still unpublished.
pub type Waiting = Box<dyn Fn() -> bool + Send>;

/// One connection to poll until `until` or until `waiting` says no.
pub(crate) struct Hot {
    pub inner: Weak<dyn MarkerReceiver>,
    pub id: ConnectionId,
    pub markers: Option<Arc<dyn MarkerSink>>,
    pub until: Instant,
    pub waiting: Waiting,
}

/// The poller of one fabric: started on first use, stopped when dropped.
pub(crate) struct MarkerPoller {
    budget: Duration,
    tx: Mutex<Option<Sender<Hot>>>,
}

impl MarkerPoller {
    /// `budget`: how long after an ask a connection is polled at most (`verbs.marker_spin`);
    /// zero turns the poller off.
    pub fn new(budget: Duration) -> MarkerPoller {
        MarkerPoller { budget, tx: Mutex::new(None) }
    }

    /// Polls connection `hot` (its `until` is capped by the budget). Does nothing when the
    /// budget is zero or the thread cannot be started (the receive task still sees the
    /// markers).
    pub fn watch(&self, mut hot: Hot) {
        if self.budget.is_zero() {
            return;
        }
        hot.until = hot.until.min(xfer_common::deadline::instant_after(self.budget));
        let mut tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        if tx.is_none() {
            let (s, r) = mpsc::channel();
            let spawned = std::thread::Builder::new().name("xfer-markers".into()).spawn(move || run(r));
            match spawned {
                Ok(_) => *tx = Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot start the marker poller; markers are seen through the completion channel");
                    return;
                }
            }
        }
        crate::metrics::marker_spin("asked");
        if let Some(s) = tx.as_ref() {
            if s.send(hot).is_err() {
                // The thread is gone (it only ends when this sender is dropped): start another
                // on the next ask.
                *tx = None;
            }
        }
    }
}

/// A connection being polled and why: every ask on it that is still live (several grants, or
/// a channel's successive batches, may wait on one connection; it is polled once per round).
struct Polled {
    inner: Weak<dyn MarkerReceiver>,
    id: ConnectionId,
    markers: Option<Arc<dyn MarkerSink>>,
    /// (until, still waiting), oldest first.
    asks: VecDeque<(Instant, Waiting)>,
}

impl Polled {
    /// Drops the asks that are over: published, or past their time. `Some(why)` once none is
    /// left: `budget` if one ran out of time still waiting, else `published`.
    fn settle(&mut self, now: Instant) -> Option<&'static str> {
        let mut timed_out = false;
        self.asks.retain(|(until, waiting)| {
            if !waiting() {
                return false;
            }
            timed_out |= now >= *until;
            now < *until
        });
        self.asks.is_empty().then_some(if timed_out { "budget" } else { "published" })
    }
}

/// Asks kept per connection: a peer asking faster than its asks expire (grants and
/// announcements every few µs) cannot grow this thread's state.
const MAX_ASKS: usize = 64;

/// Adds `h` to `polled`, as one more reason to poll its connection if that is polled already.
fn add(polled: &mut Vec<Polled>, h: Hot) {
    let p = match polled.iter().position(|p| Weak::ptr_eq(&p.inner, &h.inner)) {
        Some(i) => &mut polled[i],
        None => {
            polled.push(Polled { inner: h.inner, id: h.id, markers: h.markers, asks: VecDeque::new() });
            let last = polled.len() - 1;
            &mut polled[last]
        }
    };
    if p.asks.len() >= MAX_ASKS {
        // The oldest ask goes: the newest is the one whose markers are still coming.
        drop(p.asks.pop_front());
    }
    p.asks.push_back((h.until, h.waiting));
}

/// The thread: polls every hot connection, drops those done, blocks when none is left.
fn run(rx: Receiver<Hot>) {
    let mut polled: Vec<Polled> = Vec::new();
    let mut buf = Vec::new();
    loop {
        if polled.is_empty() {
            match rx.recv() {
                Ok(h) => add(&mut polled, h),
                Err(_) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(h) => add(&mut polled, h),
                Err(TryRecvError::Empty) => break,
                // The fabric is gone: finish what is hot, then stop at the blocking `recv`.
                Err(TryRecvError::Disconnected) => break,
            }
        }
        let now = Instant::now();
        polled.retain_mut(|p| {
            let Some(inner) = p.inner.upgrade() else { return false };
            if !inner.polls_markers() {
                return false;
            }
            if let Err(e) = inner.drain_recv(&p.id, p.markers.as_ref(), &mut buf) {
                tracing::warn!(error = %e, "polling a marker receive CQ failed; leaving it to its receive task");
                return false;
            }
            // Settled after the drain: the marker that completed a batch was just delivered.
            match p.settle(now) {
                Some(why) => {
                    crate::metrics::marker_spin(why);
                    false
                }
                None => true,
            }
        });
        if !polled.is_empty() {
            std::thread::yield_now();
        }
    }
}
