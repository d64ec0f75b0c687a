//! Notifications through a shared-memory ring ([`Client::watch_inbound_ring`]): the agent
//! writes each notification into an object this process maps, so receiving one costs a few
//! loads — no gRPC message, no socket read, no task wake-up — or, when the ring is empty and the
//! caller chose to wait, one futex wake-up. The layout and the reader are
//! `xfer_rdma::ring` (shared with the agent's writer).
//!
//! The subscription lives as long as this value: it holds the `WatchInboundRing` stream, and
//! the agent removes the ring when the stream closes.
//!
//! [`Client::watch_inbound_ring`]: crate::Client::watch_inbound_ring
use std::time::{Duration, SystemTime};

use xfer_rdma::ring::{RingError, RingNote, RingOp, RingReader, RingVia};

use futures::stream::BoxStream;
use futures::StreamExt;

use crate::{Error, Notification, Op, Result};

/// How long [`InboundRing::next`] polls before it sleeps on the ring's futex.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// How long one blocking wait lasts before [`InboundRing::next`] checks the subscription again.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// A live ring subscription.
pub struct InboundRing {
    reader: RingReader,
    /// The subscription's stream after its one message, held open: the subscription ends when
    /// it closes. It yields only its end (an error: the agent ended it).
    stream: BoxStream<'static, Result<()>>,
    object: String,
    spin: Duration,
}

impl std::fmt::Debug for InboundRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboundRing").field("object", &self.object).finish_non_exhaustive()
    }
}

impl InboundRing {
    /// Maps the ring `object` (`length` bytes) that the subscription `stream` holds.
    pub(crate) fn open(object: &str, length: u64, stream: BoxStream<'static, Result<()>>) -> Result<InboundRing> {
        let mem = crate::shm::map_object(object, length)?;
        let reader = RingReader::open(mem).map_err(|e| ring_error(object, e))?;
        Ok(InboundRing { reader, stream, object: object.to_string(), spin: DEFAULT_SPIN })
    }

    /// The shm object's name (under /dev/shm).
    pub fn object(&self) -> &str {
        &self.object
    }

    /// How long [`InboundRing::next`] busy-polls before sleeping (default 50 µs): longer
    /// spins trade a core for latency.
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// The next notification if one is there, without waiting. [`Error::DataLoss`] (once) when
    /// this reader fell more than the ring's slots behind: the next call goes on with the
    /// oldest notification still held. [`Error::Unavailable`] once the agent closed the ring.
    pub fn try_next(&mut self) -> Result<Option<Notification>> {
        self.reader.try_next().map(|n| n.map(note)).map_err(|e| ring_error(&self.object, e))
    }

    /// Waits on this thread for the next notification: polls for `spin`, then sleeps on the
    /// ring's futex; `Ok(None)` after `timeout`.
    pub fn next_blocking(&mut self, spin: Duration, timeout: Duration) -> Result<Option<Notification>> {
        self.reader.next_timeout(spin, timeout).map(|n| n.map(note)).map_err(|e| ring_error(&self.object, e))
    }

    /// The next notification: polls for the spin budget on the calling task, then sleeps on the
    /// ring's futex on the blocking pool (in slices, so dropping this future costs at most one
    /// slice of a blocking thread). Fails if the subscription's stream ends (the agent went
    /// away).
    pub async fn next(&mut self) -> Result<Notification> {
        let start = std::time::Instant::now();
        loop {
            if let Some(n) = self.try_next()? {
                return Ok(n);
            }
            if start.elapsed() < self.spin {
                tokio::task::yield_now().await;
                continue;
            }
            let waiter = self.reader.waiter();
            tokio::select! {
                r = tokio::task::spawn_blocking(move || waiter.wait(WAIT_SLICE)) => {
                    r.map_err(|e| Error::Protocol(format!("ring wait: {e}")))?.map_err(|e| ring_error(&self.object, e))?;
                }
                // The only thing the stream sends after the ring is its end.
                m = self.stream.next() => {
                    return Err(match m {
                        Some(Err(e)) => e,
                        _ => Error::Unavailable(format!("the agent ended notification ring {}", self.object)),
                    });
                }
            }
        }
    }
}

fn note(n: RingNote) -> Notification {
    Notification {
        region: n.region,
        peer: n.peer,
        tag: n.tag,
        op: match n.op {
            RingOp::Write => Op::Write,
            RingOp::Read => Op::Read,
        },
        offset: n.offset,
        length: n.length,
        at: Some(SystemTime::UNIX_EPOCH + Duration::from_nanos(n.at_unix_ns)),
        via: match n.via {
            RingVia::Fabric => "fabric",
            RingVia::Complete => "complete",
        }
        .into(),
    }
}

fn ring_error(object: &str, e: RingError) -> Error {
    match e {
        RingError::Lagged(k) => Error::DataLoss(format!("notification ring {object}: this reader fell behind and lost {k} notifications")),
        RingError::Closed => Error::Unavailable(format!("the agent closed notification ring {object}")),
        e => Error::Protocol(format!("notification ring {object}: {e}")),
    }
}
