//! A verbs connection: `qps` RC QPs to one peer sharing one CQ, completion delivery, and the task
//! that drives the CQ from its completion channel. No `unsafe`: the raw objects and posting are
//! `xfer_rdma`'s.
//!
//! # In-flight accounting
//! Each QP (`xfer_rdma::qp::RcQp`) numbers its WRs and keeps, per WR in post order, the MR (and so
//! the memory) it points at plus our [`InFlight`] (the transfer's `wr_id` and its
//! `Arc<dyn Registration>`). A completion retires every entry up to the WR it reports: WRs
//! complete in order on an RC QP, and unsignaled WRs that succeeded produce no completion of their
//! own. Flushes (after an error or `close`) complete every remaining WR, so the lists drain; only
//! then does the CQ task stop. Memory is therefore never released while the device may still
//! touch it — and if the task has to give up waiting, the QPs are destroyed (which ends all DMA)
//! before the lists drop.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rand::TryRngCore;
use sideway::ibverbs::completion::CompletionChannel;
use xfer_rdma::cq::{Cq, RawWc};
use xfer_rdma::mr::Mr;
use xfer_rdma::mw::Mw;
use xfer_rdma::qp::{queue_of, Posting, RcQp, RdmaOp, RdmaWr, Route, RtrAttrs, RtsAttrs, WindowAccess};

use super::device::Device;
use super::mr::VerbsRegistration;
use super::negotiate::{self, LINK_ETHERNET};
use super::VerbsOptions;
use crate::fabric::{
    Completion, CompletionSink, Connection, Endpoint, FabricError, MarkerSink, PendingConnection, Readiness, Registration, RemoteKey,
    VerbsEndpoint, WcStatus, WorkRequest, WrOp,
};
use crate::ids::ConnectionId;

/// Completions read per `ibv_poll_cq` batch.
const POLL_BATCH: usize = 64;
/// After `close`, how long the CQ task waits for flushes before it destroys the QPs anyway.
const CLOSE_GRACE: Duration = Duration::from_secs(10);
/// Receives each responder QP keeps posted for notification markers (each marker consumes one
/// and the receive task reposts it). A connection carries one transfer at a time, which sends
/// one marker per QP, so the queue runs dry only if the receive task falls this many markers
/// behind (then the sender's RNR retries cover the repost). 64, not more: the receive queues are
/// built and filled in `Peer.Connect` (with 1,024 the responder's half took 15-24 ms of a 21-30 ms
/// connect on rxe, 6 ms with 64) and cost the target memory per QP for nothing.
const RECV_DEPTH: u32 = 64;

/// What a QP's in-flight list keeps for us per WR, handed back when the WR is retired.
pub(crate) struct InFlight {
    /// The transfer's `wr_id` (a bind's: the QP index).
    wr_id: u64,
    /// The work request's registration, kept until the WR is retired (the QP also keeps its MR
    /// and memory itself). `None` for window binds.
    _local: Option<Arc<dyn Registration>>,
}

pub(crate) struct QpSlot {
    /// The QP with its in-flight list; destroying it ends DMA before in-flight memory is released.
    qp: RcQp<InFlight>,
    psn: u32,
}

pub(crate) struct ConnInner {
    // Drop order: QPs first, then the CQs they use, then their channels (also held by the CQs).
    slots: Vec<QpSlot>,
    cq: Arc<Cq>,
    /// Responder connections: the receive CQ (with its channel) where markers complete.
    recv: Option<(Arc<Cq>, Arc<CompletionChannel>)>,
    channel: Option<Arc<CompletionChannel>>,
    peer: String,
    /// Set on the first error completion: the pool replaces the connection.
    broken: AtomicBool,
    /// Set by `close`: posts are refused and the CQ task exits once everything is flushed.
    closing: AtomicBool,
    /// Wakes the CQ task on `close` and on a hand-back (a stored permit is not lost if the
    /// task is busy).
    wake: tokio::sync::Notify,
    /// Held across a whole [`ConnInner::drain`] (poll *and* retire-and-deliver): two pollers
    /// (the CQ task and a transfer's `progress`) would otherwise deliver completions out of
    /// order, and a later completion's retirement would swallow an earlier signaled WR's.
    drain_lock: Mutex<()>,
    /// Held across a whole [`drain_markers`] (poll, delivery, repost): the receive task, the
    /// marker poller and `Peer.Complete` all drain the receive CQ, and one connection's markers
    /// must reach the sink in the order they completed.
    marker_lock: Mutex<()>,
    /// The data-path worker thread the polling is handed to (`Connection::hand_off`); `None`
    /// while the CQ task polls.
    worker: Mutex<Option<std::thread::Thread>>,
    /// True while `worker` is set (read by the CQ task on every turn without the lock).
    handed_off: AtomicBool,
}

/// `ibv_modify_qp`'s error in `step` as a negotiation error.
fn modify_err(step: &'static str, attr: &'static str, e: std::io::Error, what: String) -> FabricError {
    FabricError::Negotiation { step, attr, detail: format!("ibv_modify_qp: {e} ({what})") }
}

fn draw_psn() -> Result<u32, FabricError> {
    // OsRng: the kernel CSPRNG (getrandom), as DESIGN §8 asks for PSNs.
    rand::rngs::OsRng.try_next_u32().map(|v| v & 0xFF_FFFF).map_err(|e| FabricError::Other(format!("OS random number generator: {e}")))
}

impl ConnInner {
    /// Refuses a connection shape the device cannot hold (with the attribute at fault) before
    /// anything is allocated; returns the depth and the CQ size to build with.
    pub fn check_shape(dev: &Device, opts: &VerbsOptions, qps: usize, depth: usize) -> Result<(usize, u32), FabricError> {
        if qps == 0 || qps > negotiate::MAX_QPS_PER_CONNECTION {
            return Err(FabricError::Negotiation {
                step: "INIT",
                attr: "qps",
                detail: format!("{qps} QPs asked, 1..={} allowed", negotiate::MAX_QPS_PER_CONNECTION),
            });
        }
        let depth = depth.max(1);
        if depth > dev.max_qp_wr as usize {
            return Err(FabricError::Negotiation {
                step: "INIT",
                attr: "max_send_wr",
                detail: format!("depth {depth} exceeds the device's max_qp_wr {}", dev.max_qp_wr),
            });
        }
        // Every WR may produce a completion (flushes do); the CQ must never overflow.
        let need = qps * (depth + 1);
        if need > dev.max_cqe as usize {
            return Err(FabricError::Negotiation {
                step: "INIT",
                attr: "cqe",
                detail: format!("{qps} QPs x depth {depth} need {need} CQEs, device max_cqe is {}", dev.max_cqe),
            });
        }
        let cqe = need.max(opts.cq_size).min(dev.max_cqe as usize) as u32;
        Ok((depth, cqe))
    }

    /// Creates the CQ (with a completion channel if `with_channel`) and `qps` QPs in INIT. With
    /// `bind_mw` the QPs can post memory-window binds (responder QPs in grant mode `mw`). With
    /// `markers` (responder QPs) they also get a receive CQ of their own, with a completion
    /// channel, and [`RECV_DEPTH`] empty receives each for notification markers.
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        dev: &Arc<Device>,
        opts: &VerbsOptions,
        peer: &str,
        qps: usize,
        depth: usize,
        with_channel: bool,
        bind_mw: bool,
        markers: bool,
    ) -> Result<ConnInner, FabricError> {
        let (depth, cqe) = Self::check_shape(dev, opts, qps, depth)?;
        let channel = if with_channel {
            let ch = dev.ctx.create_comp_channel().map_err(|e| FabricError::Other(format!("ibv_create_comp_channel: {e}")))?;
            ch.set_nonblocking(true)?;
            Some(ch)
        } else {
            None
        };
        let cq = Cq::new(&dev.ctx, cqe, channel.as_ref())?;
        let recv = if markers {
            let per_qp = RECV_DEPTH.min(dev.max_qp_wr).max(1);
            let ch = dev.ctx.create_comp_channel().map_err(|e| FabricError::Other(format!("ibv_create_comp_channel: {e}")))?;
            ch.set_nonblocking(true)?;
            // Every receive may complete (flushes do): size the CQ for all of them.
            let rcqe = (qps * per_qp as usize).min(dev.max_cqe as usize) as u32;
            let per_qp = per_qp.min(rcqe / qps.max(1) as u32).max(1);
            Some((Cq::new(&dev.ctx, rcqe, Some(&ch))?, ch, per_qp))
        } else {
            None
        };
        let mut slots = Vec::with_capacity(qps);
        for _ in 0..qps {
            let qp = RcQp::create_with_recv(&dev.pd, &cq, recv.as_ref().map(|(r, _, n)| (r, *n)), depth as u32, bind_mw)?;
            let port = dev.port;
            qp.to_init(port).map_err(|e| modify_err("INIT", "port", e, format!("port {port}, pkey_index 0")))?;
            if let Some((_, _, n)) = &recv {
                for i in 0..*n {
                    qp.post_recv_empty(i as u64).map_err(|e| FabricError::Other(format!("posting the marker receives: {e}")))?;
                }
            }
            slots.push(QpSlot { qp, psn: draw_psn()? });
        }
        Ok(ConnInner {
            slots,
            cq,
            recv: recv.map(|(r, ch, _)| (r, ch)),
            channel,
            peer: peer.to_string(),
            broken: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            wake: tokio::sync::Notify::new(),
            drain_lock: Mutex::new(()),
            marker_lock: Mutex::new(()),
            worker: Mutex::new(None),
            handed_off: AtomicBool::new(false),
        })
    }

    /// A connection built ahead of need ([`super::prebuilt`]), made this negotiation's: the
    /// peer's name for logs, and fresh PSNs (never reuse a draw whose QPs waited in a pool).
    pub fn for_peer(mut self, peer: &str) -> Result<ConnInner, FabricError> {
        self.peer = peer.to_string();
        for s in &mut self.slots {
            s.psn = draw_psn()?;
        }
        Ok(self)
    }

    pub fn endpoints(&self, dev: &Device) -> Vec<Endpoint> {
        self.slots
            .iter()
            .map(|s| {
                Endpoint::Verbs(VerbsEndpoint {
                    qpn: s.qp.qpn(),
                    psn: s.psn,
                    gid: dev.gid,
                    gid_index: dev.gid_index,
                    lid: dev.lid as u32,
                    port: dev.port as u32,
                    mtu: dev.active_mtu,
                    max_rd_atomic: dev.max_rd_atomic as u32,
                    gid_type: dev.gid_type.clone(),
                    link_layer: dev.link_layer.clone(),
                })
            })
            .collect()
    }

    /// Validates the peer's endpoints and moves every QP INIT → RTR → RTS.
    pub fn connect(&self, dev: &Device, opts: &VerbsOptions, remote: &[Endpoint]) -> Result<(), FabricError> {
        let paths = negotiate::validate_remote(&dev.local_port(), remote, Some(self.slots.len()))?;
        for (slot, path) in self.slots.iter().zip(&paths) {
            let r = &path.remote;
            let sgid_index = dev.gid_index;
            let route = if dev.link_layer == LINK_ETHERNET {
                Route::Global { dgid: r.gid, sgid_index: sgid_index.min(255) as u8 }
            } else {
                Route::Local { dlid: r.lid as u16 }
            };
            let rtr = RtrAttrs {
                port: dev.port,
                path_mtu: path.path_mtu,
                dest_qpn: r.qpn,
                rq_psn: r.psn,
                max_dest_rd_atomic: dev.max_rd_atomic,
                route,
            };
            slot.qp.to_rtr(&rtr).map_err(|e| {
                // Route resolution of the GRH fails with ETIMEDOUT / ENETUNREACH / EHOSTUNREACH.
                let attr = match e.raw_os_error() {
                    Some(nix::libc::ETIMEDOUT | nix::libc::ENETUNREACH | nix::libc::EHOSTUNREACH) => "dgid",
                    _ => "attributes",
                };
                modify_err(
                    "RTR",
                    attr,
                    e,
                    format!(
                        "dest_qpn {:#x}, path_mtu code {}, sgid_index {sgid_index}, dgid {}, max_dest_rd_atomic {}",
                        r.qpn,
                        path.path_mtu,
                        negotiate::gid_string(&r.gid),
                        dev.max_rd_atomic
                    ),
                )
            })?;
            let rts = RtsAttrs {
                sq_psn: slot.psn,
                timeout: opts.timeout,
                retry_cnt: opts.retry_cnt,
                rnr_retry: opts.rnr_retry,
                max_rd_atomic: path.max_rd_atomic,
            };
            slot.qp.to_rts(&rts).map_err(|e| {
                modify_err(
                    "RTS",
                    "attributes",
                    e,
                    format!(
                        "timeout {}, retry_cnt {}, rnr_retry {}, max_rd_atomic {}",
                        opts.timeout, opts.retry_cnt, opts.rnr_retry, path.max_rd_atomic
                    ),
                )
            })?;
        }
        Ok(())
    }

    /// Unparks the worker thread polling is handed to, if any.
    fn unpark_worker(&self) {
        if let Some(t) = self.worker.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            t.unpark();
        }
    }

    fn all_idle(&self) -> bool {
        self.slots.iter().all(|s| s.qp.is_idle())
    }

    fn set_err_all(&self) {
        for s in &self.slots {
            s.qp.to_err();
        }
    }

    /// Retires in-flight entries up to the WR `wc` reports and delivers its completion.
    ///
    /// The QP is identified by the completion's QP number (or, failing that, the QP index in its
    /// `wr_id`); `RcQp::retire` finds the WR and, defensively, retires the oldest outstanding WR
    /// for an error completion that matches nothing in flight (flushes arrive in post order, one
    /// per WR), so a device that garbles flush `wr_id`s cannot leave the list undrained. (The
    /// `wr_id 0` flushes first seen on rxe turned out to be stale CQEs from the extended-poll bug
    /// noted in `xfer_rdma::cq`.)
    fn handle(&self, wc: RawWc, sink: &CompletionSink) {
        let status = WcStatus::from_code(wc.status());
        crate::metrics::work_completion(status.name());
        let wr_qp = queue_of(wc.wr_id());
        let by_index = || self.slots.iter().position(|s| s.qp.index() == wr_qp);
        let qp = match self.slots.iter().position(|s| s.qp.qpn() == wc.qp_num()).or_else(by_index) {
            Some(i) => i,
            None => {
                tracing::error!(wr_id = wc.wr_id(), qp_num = wc.qp_num(), peer = %self.peer, "completion for an unknown QP; ignored");
                return;
            }
        };
        let slot = &self.slots[qp];
        let (raw_wr_id, byte_len) = (wc.wr_id(), wc.byte_len());
        let wr_id = slot.qp.retire(wc).map(|e| e.wr_id);
        if !status.is_success() {
            if !self.broken.swap(true, Ordering::AcqRel) && status != WcStatus::WrFlushErr {
                tracing::warn!(peer = %self.peer, qp, status = %status, "work request failed; QP moves to ERR");
            }
            if status != WcStatus::WrFlushErr {
                // The device already moved the QP to ERR; make it explicit (flushes the rest).
                slot.qp.to_err();
            }
        }
        let Some(wr_id) = wr_id else {
            tracing::error!(wr_id = raw_wr_id, qp, status = %status, peer = %self.peer, "completion for a WR not in flight; ignored");
            return;
        };
        // A dropped receiver only means nobody waits for this connection any more.
        let _ = sink.send(Completion { wr_id, qp, status, byte_len });
    }

    /// Reports every WR still in flight as flushed (the CQ task gives up waiting for the device).
    /// The entries stay on the lists, and so their memory stays registered, until the QPs are
    /// destroyed.
    fn report_unflushed(&self, sink: &CompletionSink) {
        for (qp, slot) in self.slots.iter().enumerate() {
            slot.qp.for_each_in_flight(|e| {
                let _ = sink.send(Completion { wr_id: e.wr_id, qp, status: WcStatus::WrFlushErr, byte_len: 0 });
            });
        }
    }

    /// Retires the window binds whose completions are in `buf` (the responder's CQ) and empties it.
    fn retire_binds(&self, buf: &mut Vec<RawWc>) {
        for wc in buf.drain(..) {
            if let Some(i) = self.slot_of(&wc) {
                self.slots[i].qp.retire(wc);
            }
        }
    }

    /// The slot whose QP posted the WR `wc` reports (by the QP index in its `wr_id`).
    fn slot_of(&self, wc: &RawWc) -> Option<usize> {
        let index = queue_of(wc.wr_id());
        self.slots.iter().position(|s| s.qp.index() == index)
    }

    /// Polls the CQ empty; returns how many completions were handled.
    fn drain(&self, sink: &CompletionSink, buf: &mut Vec<RawWc>) -> Result<usize, FabricError> {
        let _one_poller = self.drain_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut total = 0;
        loop {
            buf.clear();
            let n = self.cq.poll(POLL_BATCH, buf)?;
            for wc in buf.drain(..) {
                self.handle(wc, sink);
            }
            total += n;
            if n < POLL_BATCH {
                return Ok(total);
            }
        }
    }

    /// True while this responder connection has marker receives worth polling (it has a
    /// receive side and is not closing).
    pub(crate) fn polls_markers(&self) -> bool {
        self.recv.is_some() && !self.closing.load(Ordering::Acquire)
    }

    /// [`drain_markers`] on this connection's receive CQ, if it has one (the marker poller).
    pub(crate) fn drain_recv(
        &self,
        id: &ConnectionId,
        markers: Option<&Arc<dyn MarkerSink>>,
        buf: &mut Vec<RawWc>,
    ) -> Result<usize, std::io::Error> {
        match self.recv.as_ref() {
            Some((rcq, _)) => drain_markers(self, rcq, id, markers, buf),
            None => Ok(0),
        }
    }
}

/// The CQ task: event-driven through the completion channel (or busy-polling), until the
/// connection is closed and every WR has been retired.
async fn run_cq(inner: Arc<ConnInner>, sink: CompletionSink, busy_poll: bool) {
    let afd = match &inner.channel {
        // The AsyncFd owns an Arc of the channel, so the fd it watches stays open.
        Some(ch) => match xfer_rdma::cq::watch_channel(ch) {
            Ok(a) => Some(a),
            Err(e) => {
                tracing::error!(peer = %inner.peer, error = %e, "cannot watch the completion channel; busy-polling");
                None
            }
        },
        _ => None,
    };
    let mut buf = Vec::with_capacity(POLL_BATCH);
    let mut deadline: Option<tokio::time::Instant> = None;
    let mut was_handed = false;
    loop {
        // Handed off to a worker thread (and not closing): the worker polls; this task only
        // turns the completion channel's events into unparks of that thread.
        let handed = inner.handed_off.load(Ordering::Acquire) && !inner.closing.load(Ordering::Acquire);
        if handed {
            if !was_handed {
                // The event this task may have just consumed (the CQ was armed before the
                // hand-off) could be the one the worker parked for.
                was_handed = true;
                inner.unpark_worker();
            }
            match &afd {
                Some(afd) => tokio::select! {
                    r = afd.readable() => {
                        if let Ok(mut guard) = r {
                            if let Err(e) = inner.cq.drain_events() {
                                tracing::warn!(peer = %inner.peer, error = %e, "reading CQ events failed");
                            }
                            guard.clear_ready();
                        }
                        inner.unpark_worker();
                    }
                    _ = inner.wake.notified() => {}
                },
                None => inner.wake.notified().await,
            }
            continue;
        }
        was_handed = false;
        if let Err(e) = inner.drain(&sink, &mut buf) {
            tracing::error!(peer = %inner.peer, error = %e, "polling the CQ failed; closing the connection");
            inner.broken.store(true, Ordering::Release);
            inner.closing.store(true, Ordering::Release);
            inner.set_err_all();
            inner.report_unflushed(&sink);
            break;
        }
        if inner.closing.load(Ordering::Acquire) {
            if inner.all_idle() {
                break;
            }
            let d = *deadline.get_or_insert_with(|| tokio::time::Instant::now() + CLOSE_GRACE);
            if tokio::time::Instant::now() >= d {
                tracing::warn!(peer = %inner.peer, "flushes did not drain within the grace period; destroying QPs");
                inner.report_unflushed(&sink);
                break;
            }
        }
        let Some(afd) = &afd else {
            // No completion channel: poll, giving other tasks a turn between empty polls.
            tokio::task::yield_now().await;
            continue;
        };
        // Adaptive busy-polling: spin only while work requests are outstanding, so an idle
        // pooled connection costs nothing; otherwise sleep on the completion channel.
        if busy_poll && !inner.all_idle() {
            tokio::task::yield_now().await;
            continue;
        }
        // Arm, then poll once more: a completion that arrived between the last poll and the arm
        // raised no event, and would otherwise wait for the next one.
        if let Err(e) = inner.cq.req_notify() {
            tracing::error!(peer = %inner.peer, error = %e, "ibv_req_notify_cq failed; busy-polling");
            tokio::task::yield_now().await;
            continue;
        }
        match inner.drain(&sink, &mut buf) {
            Ok(n) if n > 0 => continue,
            Ok(_) => {}
            Err(_) => continue, // reported by the drain at the top of the loop
        }
        let sleep = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = afd.readable() => match r {
                Ok(mut guard) => {
                    if let Err(e) = inner.cq.drain_events() {
                        tracing::warn!(peer = %inner.peer, error = %e, "reading CQ events failed");
                    }
                    guard.clear_ready();
                }
                Err(e) => {
                    tracing::error!(peer = %inner.peer, error = %e, "completion channel poll failed; busy-polling");
                    tokio::task::yield_now().await;
                }
            },
            _ = inner.wake.notified() => {}
            _ = sleep => {}
        }
    }
    // Stop watching the fd before the channel can be closed (the last Arc may be ours).
    drop(afd);
    // Ack anything read meanwhile so ibv_destroy_cq does not block.
    let _ = inner.cq.drain_events();
    tracing::debug!(peer = %inner.peer, "CQ task stopped");
}

/// Reads every marker receive completed so far on `rcq`, hands each immediate (the grant's
/// notification slot) to `markers` and reposts the receive it consumed. Returns how many
/// completions it read. The receive task, the marker poller ([`ConnInner::drain_recv`]) and
/// `Peer.Complete` (through [`VerbsAccepted::drain_markers`]) call it; each completion is read
/// once, so they never count a marker twice, and the marker lock keeps one connection's
/// markers in completion order.
fn drain_markers(
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
async fn run_recv(inner: Arc<ConnInner>, id: ConnectionId, markers: Option<Arc<dyn MarkerSink>>) {
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

/// The initiator's connection between `prepare` and the responder's answer.
pub(crate) struct VerbsPending {
    pub inner: ConnInner,
    pub dev: Arc<Device>,
    pub opts: VerbsOptions,
    pub sink: CompletionSink,
}

#[async_trait]
impl PendingConnection for VerbsPending {
    fn local_endpoints(&self) -> Vec<Endpoint> {
        self.inner.endpoints(&self.dev)
    }

    async fn complete(self: Box<Self>, remote: &[Endpoint]) -> Result<Arc<dyn Connection>, FabricError> {
        let me = *self;
        me.inner.connect(&me.dev, &me.opts, remote)?;
        Ok(VerbsConnection::start(me.inner, me.sink, me.opts.busy_poll))
    }
}

/// An established initiator connection. Dropping it closes it.
pub(crate) struct VerbsConnection {
    inner: Arc<ConnInner>,
    /// Where completions go, for [`Connection::progress`] (the CQ task has its own clone).
    sink: CompletionSink,
    /// `progress`'s poll buffer, kept to not allocate per poll (the CQ serializes polling).
    buf: Mutex<Vec<RawWc>>,
}

impl VerbsConnection {
    pub fn start(inner: ConnInner, sink: CompletionSink, busy_poll: bool) -> Arc<dyn Connection> {
        let inner = Arc::new(inner);
        tokio::spawn(run_cq(Arc::clone(&inner), sink.clone(), busy_poll));
        Arc::new(VerbsConnection { inner, sink, buf: Mutex::new(Vec::with_capacity(POLL_BATCH)) })
    }
}

impl Connection for VerbsConnection {
    fn qps(&self) -> usize {
        self.inner.slots.len()
    }

    fn post(&self, qp: usize, wr: WorkRequest) -> Result<(), FabricError> {
        // One WR is a run of one: the same checks, in-flight keeping and doorbell handling.
        self.post_batch(qp, vec![wr]).map_err(|(_, e)| e)
    }

    fn post_batch(&self, qp: usize, wrs: Vec<WorkRequest>) -> Result<(), (u64, FabricError)> {
        let Some(first) = wrs.first().map(|w| w.wr_id) else { return Ok(()) };
        let inner = &self.inner;
        if inner.broken.load(Ordering::Acquire) || inner.closing.load(Ordering::Acquire) {
            return Err((first, FabricError::QpBroken));
        }
        let slot = inner.slots.get(qp).ok_or((first, FabricError::NoSuchQp(qp)))?;
        // One transfer's WRs: one registration for all of them (else post one by one).
        let same = wrs.windows(2).all(|w| Arc::ptr_eq(&w[0].local, &w[1].local));
        let mr: Arc<Mr> = match (same, wrs[0].local.as_any().downcast_ref::<VerbsRegistration>()) {
            (true, Some(v)) => Arc::clone(&v.mr),
            (false, _) => {
                // Mixed registrations (not what a transfer posts): one run per WR.
                for wr in wrs {
                    self.post_batch(qp, vec![wr])?;
                }
                return Ok(());
            }
            (true, None) => return Err((first, FabricError::Registration("registration does not belong to the verbs fabric".into()))),
        };
        let mut items = Vec::with_capacity(wrs.len());
        for wr in wrs {
            let rkey = match &wr.remote_key {
                RemoteKey::Rkey(k) => *k,
                RemoteKey::PerQp(keys) => match keys.get(qp) {
                    Some(k) => *k,
                    None => {
                        return Err((first, FabricError::Other(format!("the grant has {} per-QP keys and none for QP {qp}", keys.len()))));
                    }
                },
                RemoteKey::Token(_) => return Err((first, FabricError::BadRemoteKey)),
            };
            let posting = match wr.op {
                WrOp::Notify { slot: imm } => Posting::WriteImm { rkey, remote_addr: wr.remote_addr, imm, signaled: wr.signaled },
                WrOp::Read | WrOp::Write => Posting::Rdma(RdmaWr {
                    op: if wr.op == WrOp::Read { RdmaOp::Read } else { RdmaOp::Write },
                    signaled: wr.signaled,
                    rkey,
                    remote_addr: wr.remote_addr,
                    local_offset: wr.local_offset,
                    len: wr.len,
                }),
            };
            items.push((posting, InFlight { wr_id: wr.wr_id, _local: Some(wr.local) }));
        }
        slot.qp.post_many(items, &mr).map_err(|e| {
            if matches!(e, xfer_rdma::VerbsError::Io(_)) {
                // The doorbell failed: the device may hold some of these WRs. The connection is
                // done for (the pool discards it, which destroys the QPs and ends any DMA).
                inner.broken.store(true, Ordering::Release);
                slot.qp.to_err();
            }
            (first, e.into())
        })
    }

    fn progress(&self) -> usize {
        // Polls under the CQ's own lock, in the same order the CQ task would: completions are
        // handled once, whoever reads them.
        let Ok(mut buf) = self.buf.try_lock() else { return 0 };
        self.inner.drain(&self.sink, &mut buf).unwrap_or(0)
    }

    fn hand_off(&self, to: Option<std::thread::Thread>) -> bool {
        let inner = &self.inner;
        if inner.channel.is_none() {
            return false;
        }
        let on = to.is_some();
        *inner.worker.lock().unwrap_or_else(|e| e.into_inner()) = to;
        inner.handed_off.store(on, Ordering::Release);
        if !on {
            // The CQ task may be waiting in hand-off mode, on a CQ nobody armed: it must take
            // polling back now (drain, arm) or the next completion would wait for nothing.
            inner.wake.notify_one();
        }
        true
    }

    fn arm_wake(&self) -> bool {
        self.inner.handed_off.load(Ordering::Acquire) && self.inner.cq.req_notify().is_ok()
    }

    fn is_broken(&self) -> bool {
        self.inner.broken.load(Ordering::Acquire)
    }

    fn close(&self) {
        if self.inner.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        self.inner.set_err_all();
        self.inner.wake.notify_one();
        // A worker parked on this connection must see the flushes.
        self.inner.unpark_worker();
    }
}

impl Drop for VerbsConnection {
    fn drop(&mut self) {
        self.close();
    }
}

// ------------------------------------------------------------------ grant mode mw
//
// Type-2 memory windows: grant mode `mw` (DESIGN §2).
//
// A grant binds one window per responder QP of the grantee's connection (a type-2 window only
// answers accesses that arrive on the QP it was bound on, and transfers stripe over every QP of
// a connection). The bind itself is a send WR on the responder QP; `VerbsAccepted` (below)
// posts it (`xfer_rdma::qp::RcQp::post_bind_mw`) and polls the responder CQ for its completion.
// The windows themselves are `xfer_rdma::mw::Mw`. Revocation deallocates the windows:
// when `ibv_dealloc_mw` returns, the key is dead (an access gets REM_ACCESS_ERR).
//
// Windows are range-safe only on devices that check accesses against the window: rxe (6.1)
// checks the key and the QP, but the range against the underlying MR (DESIGN §13).

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
    poller: Arc<super::marker_poll::MarkerPoller>,
    /// Whether the QPs reached RTS ([`VerbsAccepted::finish`] runs after the answer went out).
    ready: tokio::sync::watch::Sender<Readiness>,
}

/// How long a bind may take to complete before the connection is given up.
const BIND_TIMEOUT: Duration = Duration::from_secs(5);

impl VerbsAccepted {
    /// Keeps the responder QPs; with a receive side, starts the task that hands the markers
    /// arriving on connection `id` to `markers`.
    pub fn new(
        inner: ConnInner,
        id: ConnectionId,
        markers: Option<Arc<dyn MarkerSink>>,
        poller: Arc<super::marker_poll::MarkerPoller>,
    ) -> Self {
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
    pub fn expect_markers(&self, until: std::time::Instant, waiting: super::marker_poll::Waiting) {
        if !self.inner.polls_markers() {
            return;
        }
        self.poller.watch(super::marker_poll::Hot {
            inner: Arc::downgrade(&self.inner),
            id: self.id.clone(),
            markers: self.markers.clone(),
            until,
            waiting,
        });
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
    /// the blocking pool (`VerbsFabric::expose`), never on a runtime thread.
    ///
    /// The caller has checked that `[addr, addr+len)` lies inside `mr`, whose memory is
    /// `memory`. A failed bind moves the QP to ERR (the device does), and so breaks the peer's
    /// connection; the pool replaces it.
    pub fn bind_windows(
        &self,
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
                // tidy: blocking context (the blocking pool, see the doc comment).
                std::thread::sleep(Duration::from_micros(20));
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
pub(crate) type AcceptedIndex = Mutex<std::collections::HashMap<crate::ids::ConnectionId, std::sync::Weak<VerbsAccepted>>>;

/// What `Fabric::accept` hands the agent: owning it keeps the responder QPs; dropping it (the
/// peer disconnected) moves them to ERR and takes the connection out of the fabric's index.
pub(crate) struct AcceptedHandle {
    pub(crate) acc: Arc<VerbsAccepted>,
    pub(crate) index: Arc<AcceptedIndex>,
    pub(crate) id: crate::ids::ConnectionId,
}

impl crate::fabric::Accepted for AcceptedHandle {
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
