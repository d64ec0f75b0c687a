//! The responder's notification markers: each WRITE WITH IMMEDIATE a peer sends completes a
//! receive on the connection's receive CQ; its immediate (the grant's slot) goes to the marker
//! sink and the receive is posted again. Read by the receive task (woken by the completion
//! channel), the marker poller and `Peer.Complete`, each completion once and in order.
use std::sync::atomic::Ordering;
use std::sync::Arc;

use xfer_rdma::cq::{Cq, RawWc};

use super::connection::{ConnInner, POLL_BATCH};
use super::marker_poll::MarkerReceiver;
use crate::MarkerSink;
use xfer_engine::ids::ConnectionId;

impl MarkerReceiver for ConnInner {
    /// True while this responder connection has marker receives worth polling (it has a
    /// receive side and is not closing).
    fn polls_markers(&self) -> bool {
        self.recv.is_some() && !self.closing.load(Ordering::Acquire)
    }

    /// [`drain_markers`] on this connection's receive CQ, if it has one (the marker poller).
    fn drain_recv(&self, id: &ConnectionId, markers: Option<&Arc<dyn MarkerSink>>, buf: &mut Vec<RawWc>) -> Result<usize, std::io::Error> {
        match self.recv.as_ref() {
            Some((rcq, _)) => drain_markers(self, rcq, id, markers, buf),
            None => Ok(0),
        }
    }
}

/// Reads every marker receive completed so far on `rcq`, hands each immediate (the grant's
/// notification slot) to `markers` and reposts the receive it consumed. Returns how many
/// completions it read. The receive task, the marker poller ([`MarkerReceiver::drain_recv`]) and
/// `Peer.Complete` (through `VerbsAccepted::drain_markers`) call it; each completion is read
/// once, so they never count a marker twice, and the marker lock keeps one connection's
/// markers in completion order.
pub(super) fn drain_markers(
    inner: &ConnInner,
    rcq: &Cq,
    id: &ConnectionId,
    markers: Option<&Arc<dyn MarkerSink>>,
    buf: &mut Vec<RawWc>,
) -> Result<usize, std::io::Error> {
    let _in_order = inner.marker_lock.lock().unwrap_or_else(|e| e.into_inner());
    let mut total = 0;
    loop {
        buf.clear();
        let n = rcq.poll(POLL_BATCH, buf)?;
        for wc in buf.drain(..) {
            let Some(slot) = inner.slots.iter().find(|s| s.qp.owns_recv(&wc)) else { continue };
            if !wc.is_success() {
                // Flushed (the connection is going away) or failed: the QP is in ERR.
                continue;
            }
            match (wc.imm(), markers) {
                (Some(imm), Some(sink)) => sink.marker(id, imm),
                (Some(_), None) => crate::metrics::notify_marker("no_sink"),
                (None, _) => crate::metrics::notify_marker("no_immediate"),
            }
            if let Err(e) = slot.qp.post_recv_empty(wc.wr_id()) {
                if !inner.closing.load(Ordering::Acquire) {
                    tracing::warn!(peer = %inner.peer, error = %e, "cannot repost a marker receive");
                }
            }
        }
        total += n;
        if n < POLL_BATCH {
            return Ok(total);
        }
    }
}

/// The responder's receive task: waits on the receive CQ's channel, hands each marker's
/// immediate (the grant's notification slot) to `markers` and reposts the receive it consumed.
/// A marker's receive completes only after every earlier WR of its QP has executed here (RC
/// ordering), which is the whole guarantee a notification gives. Ends when the connection is
/// dropped (its QPs move to ERR and the receives flush; receives hold no memory, so nothing
/// waits for the flushes).
pub(super) async fn run_recv(inner: Arc<ConnInner>, id: ConnectionId, markers: Option<Arc<dyn MarkerSink>>) {
    let Some((rcq, ch)) = inner.recv.as_ref() else { return };
    let afd = match xfer_rdma::cq::watch_channel(ch) {
        Ok(a) => a,
        Err(e) => {
            tracing::error!(peer = %inner.peer, error = %e, "cannot watch the marker receive channel; markers on this connection are not seen");
            return;
        }
    };
    let mut buf = Vec::with_capacity(POLL_BATCH);
    let drain = |buf: &mut Vec<RawWc>| drain_markers(&inner, rcq, &id, markers.as_ref(), buf);
    loop {
        if inner.closing.load(Ordering::Acquire) {
            break;
        }
        if let Err(e) = drain(&mut buf) {
            tracing::error!(peer = %inner.peer, error = %e, "polling the marker receive CQ failed");
            break;
        }
        if let Err(e) = rcq.req_notify() {
            tracing::error!(peer = %inner.peer, error = %e, "ibv_req_notify_cq failed on the marker receive CQ");
            break;
        }
        // A marker that completed between the drain and the arm raised no event.
        match drain(&mut buf) {
            Ok(n) if n > 0 => continue,
            Ok(_) => {}
            Err(_) => continue,
        }
        tokio::select! {
            r = afd.readable() => match r {
                Ok(mut guard) => {
                    if let Err(e) = rcq.drain_events() {
                        tracing::warn!(peer = %inner.peer, error = %e, "reading marker CQ events failed");
                    }
                    guard.clear_ready();
                }
                Err(e) => {
                    tracing::error!(peer = %inner.peer, error = %e, "marker receive channel poll failed");
                    break;
                }
            },
            _ = inner.wake.notified() => {}
        }
    }
    drop(afd);
    let _ = rcq.drain_events();
    tracing::debug!(peer = %inner.peer, "marker receive task stopped");
}
