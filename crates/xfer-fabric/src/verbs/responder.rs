//! The responder's half of a verbs connection: its QPs kept in RTS until the peer disconnects,
//! its marker receives, and grant mode `mw` (memory windows bound on its QPs).
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use xfer_rdma::mr::Mr;
use xfer_rdma::mw::Mw;
use xfer_rdma::qp::{queue_of, WindowAccess};

use super::connection::{ConnInner, InFlight, POLL_BATCH};
use super::device::Device;
use super::marker_poll::{Hot, MarkerPoller, MarkerReceiver, Waiting};
use super::markers::{drain_markers, run_recv};
use super::options::VerbsOptions;
use crate::{Endpoint, FabricError, MarkerSink, Readiness, WcStatus};
use xfer_engine::ids::ConnectionId;

// ------------------------------------------------------------------ grant mode mw
//
// Type-2 memory windows: grant mode `mw`.
//
// A grant binds one window per responder QP of the grantee's connection (a type-2 window only
// answers accesses that arrive on the QP it was bound on, and transfers stripe over every QP of
// a connection). The bind itself is a send WR on the responder QP; `VerbsAccepted` (below)
// posts it (`xfer_rdma::qp::RcQp::post_bind_mw`) and polls the responder CQ for its completion.
// The windows themselves are `xfer_rdma::mw::Mw`. Revocation deallocates the windows:
// when `ibv_dealloc_mw` returns, the key is dead (an access gets REM_ACCESS_ERR).
//
// Windows are range-safe only on devices that check accesses against the window: rxe (6.1)
// checks the key and the QP, but the range against the underlying MR.

/// What an `mw` grant keeps alive; dropping it revokes the grant.
pub(crate) struct MwGrant {
    // Field order is drop order: the windows are deallocated (their keys die) first — no bind of
    // them is in flight any more, so these are the last handles; then the MR they were bound to
    // may be deregistered and the memory unmapped; then the responder QPs may be destroyed.
    pub windows: Vec<Arc<Mw>>,
    pub _mr: Arc<Mr>,
    pub _conn: Arc<ConnInner>,
}

impl MwGrant {
    pub fn rkeys(&self) -> Vec<u32> {
        self.windows.iter().map(|w| w.rkey()).collect()
    }
}

/// The responder's side: QPs kept in RTS until the peer disconnects (this handle is dropped).
/// In grant mode `mw` it also binds the grants' memory windows on its QPs.
pub(crate) struct VerbsAccepted {
    inner: Arc<ConnInner>,
    /// The connection's id and where its markers go (also read by [`Self::drain_markers`]).
    id: ConnectionId,
    markers: Option<Arc<dyn MarkerSink>>,
    /// Serializes binds: one bind WR outstanding per QP (the send queues hold one WR), and one
    /// poller of the responder CQ.
    bind_lock: Mutex<()>,
    /// The fabric's marker poller, for connections that expect a notification soon.
    poller: Arc<MarkerPoller>,
    /// Whether the QPs reached RTS ([`VerbsAccepted::finish`] runs after the answer went out).
    ready: tokio::sync::watch::Sender<Readiness>,
}

/// How long a bind may take to complete before the connection is given up.
const BIND_TIMEOUT: Duration = Duration::from_secs(5);

/// How long [`VerbsAccepted::bind_windows`] sleeps between polls of the responder CQ that found
/// nothing. Binds complete in microseconds on hardware (tens on Soft-RoCE), so a short sleep
/// answers the grant promptly without spinning a core for the whole bind.
const BIND_POLL_PAUSE: Duration = Duration::from_micros(20);

/// Proof that the code holding it runs on tokio's blocking pool, never on a runtime worker
/// thread: only [`on_blocking_pool`] makes one (its field is private to this module).
/// [`VerbsAccepted::bind_windows`] takes it because it waits for the device by polling and
/// sleeping: the responder's CQ has no completion channel (binds are its only send work, one at
/// a time per QP, and rare next to the data the connection carries), so there is nothing to
/// await, and a sleep there on a runtime thread would stall every task scheduled on it.
pub(crate) struct OnBlockingPool(());

/// Runs `f` on tokio's blocking pool, handing it the proof that it does.
pub(crate) async fn on_blocking_pool<R: Send + 'static>(f: impl FnOnce(&OnBlockingPool) -> R + Send + 'static) -> Result<R, FabricError> {
    tokio::task::spawn_blocking(move || f(&OnBlockingPool(())))
        .await
        .map_err(|e| FabricError::Other(format!("the blocking task failed: {e}")))
}

impl VerbsAccepted {
    /// Keeps the responder QPs; with a receive side, starts the task that hands the markers
    /// arriving on connection `id` to `markers`.
    pub fn new(inner: ConnInner, id: ConnectionId, markers: Option<Arc<dyn MarkerSink>>, poller: Arc<MarkerPoller>) -> Self {
        let inner = Arc::new(inner);
        if inner.recv.is_some() {
            tokio::spawn(run_recv(Arc::clone(&inner), id.clone(), markers.clone()));
        }
        let ready = tokio::sync::watch::Sender::new(Readiness::Pending);
        VerbsAccepted { inner, id, markers, bind_lock: Mutex::new(()), poller, ready }
    }

    /// Moves the QPs to RTR and RTS with the initiator's `remote` endpoints (blocking: the
    /// device's modify calls) and publishes the outcome to the waiters of [`Self::readiness`].
    /// A failure leaves the connection broken: its QPs in ERR, its grants refused.
    pub fn finish(&self, dev: &Device, opts: &VerbsOptions, remote: &[Endpoint]) {
        let outcome = match self.inner.connect(dev, opts, remote) {
            Ok(()) => Readiness::Ready,
            Err(e) => {
                if self.inner.closing.load(Ordering::Acquire) {
                    // The peer disconnected first (its QPs are in ERR already): nothing is lost.
                    tracing::debug!(peer = %self.inner.peer, connection = %self.id, error = %e, "connection closed before its QPs reached RTS");
                } else {
                    tracing::warn!(peer = %self.inner.peer, connection = %self.id, error = %e, "the responder's QPs could not be moved to RTS");
                }
                self.inner.broken.store(true, Ordering::Release);
                self.inner.set_err_all();
                Readiness::Failed(e.to_string())
            }
        };
        self.ready.send_replace(outcome);
    }

    pub fn readiness(&self) -> tokio::sync::watch::Receiver<Readiness> {
        self.ready.subscribe()
    }

    /// Has the fabric's marker poller busy-poll this connection's receive CQ until `waiting`
    /// turns false or `until` (capped by `verbs.marker_spin`).
    pub fn expect_markers(&self, until: std::time::Instant, waiting: Waiting) {
        if !self.inner.polls_markers() {
            return;
        }
        let inner: Weak<dyn MarkerReceiver> = Arc::downgrade(&self.inner) as Weak<ConnInner>;
        self.poller.watch(Hot { inner, id: self.id.clone(), markers: self.markers.clone(), until, waiting });
    }

    /// Hands every marker that has already completed on this connection to the sink now,
    /// without waiting for the receive task to be scheduled. A marker's receive completion is
    /// written before the device acknowledges the WRITE WITH IMMEDIATE, and the initiator sends
    /// `Peer.Complete` only after that acknowledgement; so draining here first means a batch
    /// whose markers all landed is always published by them (`via fabric`), never by the
    /// `Peer.Complete` that merely raced the receive task.
    pub fn drain_markers(&self) {
        let Some((rcq, _)) = self.inner.recv.as_ref() else { return };
        let mut buf = Vec::with_capacity(POLL_BATCH);
        if let Err(e) = drain_markers(&self.inner, rcq, &self.id, self.markers.as_ref(), &mut buf) {
            tracing::warn!(peer = %self.inner.peer, error = %e, "polling the marker receive CQ failed");
        }
    }

    /// Binds one fresh type-2 window per QP over `[addr, addr+len)` of `mr` with `access`
    /// (`IBV_ACCESS_REMOTE_READ` or `_WRITE`) and waits for every bind to complete, so the keys
    /// work as soon as the grant is answered. Blocks the calling thread for the bind round trip
    /// through the device (microseconds on hardware; bounded by [`BIND_TIMEOUT`]), so it runs on
    /// the blocking pool (`VerbsFabric::expose`), never on a runtime thread: `_pool` proves it.
    ///
    /// The caller has checked that `[addr, addr+len)` lies inside `mr`, whose memory is
    /// `memory`. A failed bind moves the QP to ERR (the device does), and so breaks the peer's
    /// connection; the pool replaces it.
    pub fn bind_windows(
        &self,
        _pool: &OnBlockingPool,
        pd: &Arc<sideway::ibverbs::protection_domain::ProtectionDomain>,
        mr: &Arc<Mr>,
        offset: u64,
        len: u64,
        access: WindowAccess,
    ) -> Result<MwGrant, FabricError> {
        let inner = &self.inner;
        let _g = self.bind_lock.lock().unwrap_or_else(|e| e.into_inner());
        if inner.broken.load(Ordering::Acquire) {
            return Err(FabricError::QpBroken);
        }
        // The agent waits for RTS before it exposes a grant on the connection; a bind posted
        // before would fail and break the connection.
        if *self.ready.borrow() != Readiness::Ready {
            return Err(FabricError::Other("the connection's QPs are not in RTS yet".into()));
        }
        let mut windows = Vec::with_capacity(inner.slots.len());
        for _ in &inner.slots {
            windows.push(Mw::alloc(pd)?);
        }
        // Nothing else posts on the responder QPs; retire anything stale before counting.
        let mut buf = Vec::with_capacity(POLL_BATCH);
        let _ = inner.cq.poll(POLL_BATCH, &mut buf);
        inner.retire_binds(&mut buf);
        let give_up = |e: FabricError| {
            // The connection is done for; binds still outstanding keep their windows (and the
            // MR) alive on the QPs' in-flight lists until they are flushed or the QPs destroyed.
            inner.broken.store(true, Ordering::Release);
            inner.set_err_all();
            e
        };
        let mut keys = Vec::with_capacity(windows.len());
        for (i, (slot, mw)) in inner.slots.iter().zip(&windows).enumerate() {
            // The QP checks the range against the MR and keeps the window and the MR until the
            // bind is retired below.
            match slot.qp.post_bind_mw(mw, mr, offset, len, access, InFlight { wr_id: i as u64, _local: None }) {
                Ok(key) => keys.push(key),
                Err(e) => {
                    // `e` reads as before the move (an I/O error prints as itself).
                    return Err(give_up(FabricError::Other(format!("posting a memory-window bind on responder QP {i}: {e}"))));
                }
            }
        }
        let deadline = std::time::Instant::now() + BIND_TIMEOUT;
        let mut done = vec![false; windows.len()];
        let mut left = windows.len();
        while left > 0 {
            buf.clear();
            let n = inner.cq.poll(POLL_BATCH, &mut buf).map_err(|e| give_up(FabricError::Io(e)))?;
            for wc in buf.drain(..) {
                let status = WcStatus::from_code(wc.status());
                let slot = inner.slot_of(&wc);
                if !status.is_success() {
                    let code = wc.status();
                    let i = slot.unwrap_or_else(|| queue_of(wc.wr_id()));
                    if let Some(s) = slot {
                        inner.slots[s].qp.retire(wc);
                    }
                    return Err(give_up(FabricError::Other(format!(
                        "memory-window bind on responder QP {i} completed with {status} (status {code})"
                    ))));
                }
                let Some(i) = slot else { continue };
                if inner.slots[i].qp.retire(wc).is_some() && !done[i] {
                    done[i] = true;
                    left -= 1;
                }
            }
            if left > 0 && n == 0 {
                if std::time::Instant::now() >= deadline {
                    return Err(give_up(FabricError::Other(format!("memory-window binds did not complete within {BIND_TIMEOUT:?}"))));
                }
                // tidy: blocking context (`OnBlockingPool`: this runs on the blocking pool only).
                std::thread::sleep(BIND_POLL_PAUSE);
            }
        }
        // Every bind was retired (`done`), so the QPs hold no handle on the windows any more:
        // dropping the grant deallocates them.
        for (mw, key) in windows.iter().zip(keys) {
            mw.set_rkey(key);
        }
        Ok(MwGrant { windows, _mr: Arc::clone(mr), _conn: Arc::clone(inner) })
    }
}

/// The fabric's index of its accepted connections, by id: grant mode `mw` finds the QPs to bind
/// on here (an `ExposeRequest` names the connection by id).
pub(crate) type AcceptedIndex = Mutex<std::collections::HashMap<xfer_engine::ids::ConnectionId, std::sync::Weak<VerbsAccepted>>>;

/// What `Fabric::accept` hands the agent: owning it keeps the responder QPs; dropping it (the
/// peer disconnected) moves them to ERR and takes the connection out of the fabric's index.
pub(crate) struct AcceptedHandle {
    pub(crate) acc: Arc<VerbsAccepted>,
    pub(crate) index: Arc<AcceptedIndex>,
    pub(crate) id: xfer_engine::ids::ConnectionId,
}

impl crate::Accepted for AcceptedHandle {
    fn drain_markers(&self) {
        self.acc.drain_markers();
    }

    fn expect_markers(&self, until: std::time::Instant, waiting: Box<dyn Fn() -> bool + Send>) {
        self.acc.expect_markers(until, waiting);
    }

    fn readiness(&self) -> Option<tokio::sync::watch::Receiver<Readiness>> {
        Some(self.acc.readiness())
    }
}

impl Drop for AcceptedHandle {
    fn drop(&mut self) {
        // Stops the marker receive task (and tells a `finish` still running that an error it
        // meets from here on is this close).
        self.acc.inner.closing.store(true, Ordering::Release);
        // The peer is gone: no access through these QPs from here on, even while grants still
        // hold windows bound on them (and so the QPs themselves).
        self.acc.inner.set_err_all();
        self.acc.inner.wake.notify_one();
        let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        if index.get(&self.id).is_some_and(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.acc))) {
            index.remove(&self.id);
        }
    }
}
