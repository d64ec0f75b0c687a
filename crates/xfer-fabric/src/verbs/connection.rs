//! A verbs connection: `qps` RC QPs to one peer sharing one CQ, their way from INIT to RTS,
//! completion delivery, and the task that drives the CQ from its completion channel. Both halves
//! build on it: the initiator's ([`super::initiator`]) and the responder's
//! ([`super::responder`], with its marker receives in [`super::markers`]). No `unsafe`: the raw
//! objects and posting are `xfer_rdma`'s.
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

use rand::TryRngCore;
use sideway::ibverbs::completion::CompletionChannel;
use xfer_rdma::cq::{Cq, RawWc};
use xfer_rdma::qp::{queue_of, RcQp, Route, RtrAttrs, RtsAttrs};

use super::device::{Device, PortView};
use super::negotiate::{self, LINK_ETHERNET};
use super::options::VerbsOptions;
use crate::{Completion, CompletionSink, Endpoint, FabricError, Registration, VerbsEndpoint, WcStatus};

/// Completions read per `ibv_poll_cq` batch.
pub(super) const POLL_BATCH: usize = 64;
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
    pub(super) wr_id: u64,
    /// The work request's registration, kept until the WR is retired (the QP also keeps its MR
    /// and memory itself). `None` for window binds.
    pub(super) _local: Option<Arc<dyn Registration>>,
}

pub(crate) struct QpSlot {
    /// The QP with its in-flight list; destroying it ends DMA before in-flight memory is released.
    pub(super) qp: RcQp<InFlight>,
    pub(super) psn: u32,
}

pub(crate) struct ConnInner {
    // Drop order: QPs first, then the CQs they use, then their channels (also held by the CQs).
    pub(super) slots: Vec<QpSlot>,
    pub(super) cq: Arc<Cq>,
    /// Responder connections: the receive CQ (with its channel) where markers complete.
    pub(super) recv: Option<(Arc<Cq>, Arc<CompletionChannel>)>,
    pub(super) channel: Option<Arc<CompletionChannel>>,
    pub(super) peer: String,
    /// Set on the first error completion: the pool replaces the connection.
    pub(super) broken: AtomicBool,
    /// Set by `close`: posts are refused and the CQ task exits once everything is flushed.
    pub(super) closing: AtomicBool,
    /// Wakes the CQ task on `close` and on a hand-back (a stored permit is not lost if the
    /// task is busy).
    pub(super) wake: tokio::sync::Notify,
    /// Held across a whole [`ConnInner::drain`] (poll *and* retire-and-deliver): two pollers
    /// (the CQ task and a transfer's `progress`) would otherwise deliver completions out of
    /// order, and a later completion's retirement would swallow an earlier signaled WR's.
    pub(super) drain_lock: Mutex<()>,
    /// Held across a whole [`drain_markers`] (poll, delivery, repost): the receive task, the
    /// marker poller and `Peer.Complete` all drain the receive CQ, and one connection's markers
    /// must reach the sink in the order they completed.
    pub(super) marker_lock: Mutex<()>,
    /// The data-path worker thread the polling is handed to (`Connection::hand_off`); `None`
    /// while the CQ task polls.
    pub(super) worker: Mutex<Option<std::thread::Thread>>,
    /// True while `worker` is set (read by the CQ task on every turn without the lock).
    pub(super) handed_off: AtomicBool,
    /// Added to the QP index of every completion delivered: the index of this connection's first
    /// QP in a connection over several devices, whose parts share one sink (0 otherwise).
    pub(super) qp_base: usize,
    /// The path MTU the QPs negotiated, in bytes (0 until `connect`).
    pub(super) path_mtu: std::sync::atomic::AtomicU32,
}

/// `ibv_modify_qp`'s error in `step` as a negotiation error.
fn modify_err(step: &'static str, attr: &'static str, e: std::io::Error, what: String) -> FabricError {
    FabricError::Negotiation { step, attr, detail: format!("ibv_modify_qp: {e} ({what})") }
}

/// The peer's endpoints for a connection, validated, with the port's facts they were checked
/// against: what [`ConnInner::move_to_rts`] moves the QPs with.
pub(crate) struct Checked {
    view: PortView,
    paths: Vec<negotiate::PathParams>,
}

fn draw_psn() -> Result<u32, FabricError> {
    // OsRng: the kernel CSPRNG (getrandom): a PSN a peer could guess would let it inject packets.
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
            qp_base: 0,
            path_mtu: Default::default(),
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
        let v = dev.view();
        self.slots
            .iter()
            .map(|s| {
                Endpoint::Verbs(VerbsEndpoint {
                    qpn: s.qp.qpn(),
                    psn: s.psn,
                    gid: v.gid,
                    gid_index: v.gid_index,
                    lid: v.lid as u32,
                    port: dev.port as u32,
                    mtu: v.active_mtu,
                    max_rd_atomic: dev.max_rd_atomic as u32,
                    gid_type: v.gid_type.clone(),
                    link_layer: v.link_layer.clone(),
                    rail: 0,
                    device: dev.name.clone(),
                    ipv4_prefix: v.ipv4_prefix,
                })
            })
            .collect()
    }

    /// Validates the peer's endpoints and moves every QP INIT → RTR → RTS.
    pub fn connect(&self, dev: &Device, opts: &VerbsOptions, remote: &[Endpoint]) -> Result<(), FabricError> {
        let checked = self.validate(dev, remote)?;
        self.move_to_rts(dev, opts, &checked)
    }

    /// Validates the peer's endpoints against this connection's QPs and the port's facts, read
    /// once here for the whole connection (they change only on a refresh). An error here is the
    /// peer's: a broken or hostile answer.
    pub fn validate(&self, dev: &Device, remote: &[Endpoint]) -> Result<Checked, FabricError> {
        let view = dev.view();
        let local = negotiate::LocalPort {
            link_layer: view.link_layer.clone(),
            gid_type: view.gid_type.clone(),
            mtu: view.active_mtu,
            max_rd_atomic: dev.max_rd_atomic,
        };
        let paths = negotiate::validate_remote(&local, remote, Some(self.slots.len()))?;
        Ok(Checked { view, paths })
    }

    /// Moves every QP INIT → RTR → RTS along `checked`'s paths. An error here is the local
    /// device's (e.g. no route to the peer's GID): the endpoints were valid.
    pub fn move_to_rts(&self, dev: &Device, opts: &VerbsOptions, checked: &Checked) -> Result<(), FabricError> {
        let Checked { view: v, paths } = checked;
        let mtu = paths.iter().filter_map(|p| negotiate::mtu_bytes(p.path_mtu)).min().unwrap_or(0);
        self.path_mtu.store(mtu, Ordering::Release);
        for (slot, path) in self.slots.iter().zip(paths) {
            let r = &path.remote;
            let sgid_index = v.gid_index;
            let route = if v.link_layer == LINK_ETHERNET {
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
    pub(super) fn unpark_worker(&self) {
        if let Some(t) = self.worker.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            t.unpark();
        }
    }

    pub(super) fn all_idle(&self) -> bool {
        self.slots.iter().all(|s| s.qp.is_idle())
    }

    pub(super) fn set_err_all(&self) {
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
    pub(super) fn handle(&self, wc: RawWc, sink: &CompletionSink) {
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
        let _ = sink.send(Completion { wr_id, qp: qp + self.qp_base, status, byte_len });
    }

    /// Reports every WR still in flight as flushed (the CQ task gives up waiting for the device).
    /// The entries stay on the lists, and so their memory stays registered, until the QPs are
    /// destroyed.
    pub(super) fn report_unflushed(&self, sink: &CompletionSink) {
        for (qp, slot) in self.slots.iter().enumerate() {
            slot.qp.for_each_in_flight(|e| {
                let _ = sink.send(Completion { wr_id: e.wr_id, qp: qp + self.qp_base, status: WcStatus::WrFlushErr, byte_len: 0 });
            });
        }
    }

    /// Retires the window binds whose completions are in `buf` (the responder's CQ) and empties it.
    pub(super) fn retire_binds(&self, buf: &mut Vec<RawWc>) {
        for wc in buf.drain(..) {
            if let Some(i) = self.slot_of(&wc) {
                self.slots[i].qp.retire(wc);
            }
        }
    }

    /// The slot whose QP posted the WR `wc` reports (by the QP index in its `wr_id`).
    pub(super) fn slot_of(&self, wc: &RawWc) -> Option<usize> {
        let index = queue_of(wc.wr_id());
        self.slots.iter().position(|s| s.qp.index() == index)
    }

    /// Polls the CQ empty; returns how many completions were handled.
    pub(super) fn drain(&self, sink: &CompletionSink, buf: &mut Vec<RawWc>) -> Result<usize, FabricError> {
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
}

/// The CQ task: event-driven through the completion channel (or busy-polling), until the
/// connection is closed and every WR has been retired.
pub(super) async fn run_cq(inner: Arc<ConnInner>, sink: CompletionSink, busy_poll: bool) {
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
