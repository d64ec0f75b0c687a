//! A verbs connection: `qps` RC QPs to one peer sharing one CQ, the per-QP in-flight lists that
//! keep posted memory alive, and the task that drives the CQ from its completion channel.
//!
//! # In-flight accounting
//! Each QP numbers its WRs (`seq`) and posts them with the device `wr_id = qp << 48 | seq`. The
//! in-flight list holds each WR's `Arc<dyn Registration>` (and so its memory) in post order. A
//! completion for `seq` retires every entry up to it: WRs complete in order on an RC QP, and
//! unsignaled WRs that succeeded produce no completion of their own. Flushes (after an error or
//! `close`) complete every remaining WR, so the list drains; only then does the CQ task stop.
//! Memory is therefore never released while the device may still touch it — and if the task
//! has to give up waiting, the QPs are destroyed (which ends all DMA) before the lists drop.
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rand::TryRngCore;
use sideway::ibverbs::completion::CompletionChannel;
use tokio::io::unix::AsyncFd;

use super::cq::{Cq, RawWc};
use super::device::Device;
use super::mw::{next_rkey, Mw, MwGrant};
use super::negotiate;
use super::qp::Qp;
use super::VerbsOptions;
use crate::fabric::{
    Completion, CompletionSink, Connection, Endpoint, FabricError, PendingConnection, RemoteKey, VerbsEndpoint,
    WcStatus, WorkRequest, WrOp,
};

const SEQ_BITS: u32 = 48;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
/// Completions read per `ibv_start_poll` batch.
const POLL_BATCH: usize = 64;
/// After `close`, how long the CQ task waits for flushes before it destroys the QPs anyway.
const CLOSE_GRACE: Duration = Duration::from_secs(10);

struct InFlight {
    seq: u64,
    wr_id: u64,
    /// Held only to keep the memory registered and mapped until the WR is retired.
    _local: Arc<dyn crate::fabric::Registration>,
}

#[derive(Default)]
struct SlotState {
    inflight: VecDeque<InFlight>,
    next_seq: u64,
}

pub(crate) struct QpSlot {
    // Field order is drop order: the QP is destroyed (no more DMA) before in-flight memory is
    // released.
    qp: Qp,
    psn: u32,
    /// Posting lock and in-flight list. Held while posting so the CQ task cannot see a
    /// completion for a WR that is not on the list yet.
    state: Mutex<SlotState>,
}

pub(crate) struct ConnInner {
    // Drop order: QPs first, then the CQ they use, then its channel (also held by the CQ).
    slots: Vec<QpSlot>,
    cq: Arc<Cq>,
    channel: Option<Arc<CompletionChannel>>,
    peer: String,
    /// Set on the first error completion: the pool replaces the connection.
    broken: AtomicBool,
    /// Set by `close`: posts are refused and the CQ task exits once everything is flushed.
    closing: AtomicBool,
    /// Wakes the CQ task on `close` (a stored permit is not lost if the task is busy).
    wake: tokio::sync::Notify,
}

fn draw_psn() -> Result<u32, FabricError> {
    // OsRng: the kernel CSPRNG (getrandom), as DESIGN §8 asks for PSNs.
    rand::rngs::OsRng
        .try_next_u32()
        .map(|v| v & 0xFF_FFFF)
        .map_err(|e| FabricError::Other(format!("OS random number generator: {e}")))
}

impl ConnInner {
    /// Creates the CQ (with a completion channel if `with_channel`) and `qps` QPs in INIT. With
    /// `bind_mw` the QPs can post memory-window binds (responder QPs in grant mode `mw`).
    pub fn build(
        dev: &Arc<Device>,
        opts: &VerbsOptions,
        peer: &str,
        qps: usize,
        depth: usize,
        with_channel: bool,
        bind_mw: bool,
    ) -> Result<ConnInner, FabricError> {
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
        let channel = if with_channel {
            let ch = dev
                .ctx
                .create_comp_channel()
                .map_err(|e| FabricError::Other(format!("ibv_create_comp_channel: {e}")))?;
            ch.set_nonblocking(true)?;
            Some(ch)
        } else {
            None
        };
        let cq = Cq::new(&dev.ctx, cqe, channel.as_ref())?;
        let mut slots = Vec::with_capacity(qps);
        for _ in 0..qps {
            let qp = Qp::create(&dev.pd, &cq, depth as u32, bind_mw)?;
            qp.to_init(dev.port)?;
            slots.push(QpSlot { qp, psn: draw_psn()?, state: Mutex::new(SlotState::default()) });
        }
        Ok(ConnInner {
            slots,
            cq,
            channel,
            peer: peer.to_string(),
            broken: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            wake: tokio::sync::Notify::new(),
        })
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
            slot.qp.to_rtr(path, &dev.link_layer, dev.port, dev.gid_index, dev.max_rd_atomic)?;
            slot.qp.to_rts(slot.psn, path.max_rd_atomic, opts)?;
        }
        Ok(())
    }

    fn all_idle(&self) -> bool {
        self.slots.iter().all(|s| s.state.lock().unwrap_or_else(|e| e.into_inner()).inflight.is_empty())
    }

    fn set_err_all(&self) {
        for s in &self.slots {
            s.qp.to_err();
        }
    }

    /// Retires in-flight entries up to the WR `wc` reports and delivers its completion.
    ///
    /// The QP is identified by the completion's QP number; the WR by the `seq` in its `wr_id`.
    /// Defensively, an error completion whose `wr_id` matches nothing in flight retires the
    /// oldest outstanding WR of its QP (flushes arrive in post order, one per WR), so a device
    /// that garbles flush `wr_id`s cannot leave the list undrained. (The `wr_id 0` flushes first
    /// seen on rxe turned out to be stale CQEs from the extended-poll bug noted in `cq.rs`.)
    fn handle(&self, wc: RawWc, sink: &CompletionSink) {
        let status = WcStatus::from_code(wc.status);
        crate::metrics::work_completion(status.name());
        let wr_qp = (wc.wr_id >> SEQ_BITS) as usize;
        let seq = wc.wr_id & SEQ_MASK;
        let qp = match self.slots.iter().position(|s| s.qp.qpn() == wc.qp_num) {
            Some(i) => i,
            None if wr_qp < self.slots.len() => wr_qp,
            None => {
                tracing::error!(wr_id = wc.wr_id, qp_num = wc.qp_num, peer = %self.peer, "completion for an unknown QP; ignored");
                return;
            }
        };
        let slot = &self.slots[qp];
        let wr_id = {
            let mut st = slot.state.lock().unwrap_or_else(|e| e.into_inner());
            if wr_qp == qp && st.inflight.iter().any(|e| e.seq == seq) {
                // In order: everything before `seq` completed silently (unsignaled successes).
                let mut found = None;
                while let Some(e) = st.inflight.pop_front() {
                    if e.seq == seq {
                        found = Some(e.wr_id);
                        break;
                    }
                }
                found
            } else if !status.is_success() {
                st.inflight.pop_front().map(|e| e.wr_id)
            } else {
                None
            }
        };
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
            tracing::error!(wr_id = wc.wr_id, qp, status = %status, peer = %self.peer, "completion for a WR not in flight; ignored");
            return;
        };
        // A dropped receiver only means nobody waits for this connection any more.
        let _ = sink.send(Completion { wr_id, qp, status, byte_len: wc.byte_len });
    }

    /// Reports every WR still in flight as flushed (the CQ task gives up waiting for the device).
    /// The entries stay on the lists, and so their memory stays registered, until the QPs are
    /// destroyed.
    fn report_unflushed(&self, sink: &CompletionSink) {
        for (qp, slot) in self.slots.iter().enumerate() {
            let st = slot.state.lock().unwrap_or_else(|e| e.into_inner());
            for e in &st.inflight {
                let _ = sink.send(Completion { wr_id: e.wr_id, qp, status: WcStatus::WrFlushErr, byte_len: 0 });
            }
        }
    }

    /// Polls the CQ empty; returns how many completions were handled.
    fn drain(&self, sink: &CompletionSink, buf: &mut Vec<RawWc>) -> Result<usize, FabricError> {
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
async fn run_cq(inner: Arc<ConnInner>, sink: CompletionSink, busy_poll: bool) {
    let afd = match &inner.channel {
        // SAFETY: the AsyncFd owns an Arc of the channel, so the fd it watches stays open (it is
        // closed only by ibv_destroy_comp_channel in the channel's Drop) until the AsyncFd is
        // dropped and has deregistered it.
        Some(ch) => match unsafe {
            AsyncFd::register_with_interest(Arc::clone(ch), tokio::io::Interest::READABLE)
        }
        .map_err(std::io::Error::from)
        {
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
    loop {
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
}

impl VerbsConnection {
    pub fn start(inner: ConnInner, sink: CompletionSink, busy_poll: bool) -> Arc<dyn Connection> {
        let inner = Arc::new(inner);
        tokio::spawn(run_cq(Arc::clone(&inner), sink, busy_poll));
        Arc::new(VerbsConnection { inner })
    }
}

impl Connection for VerbsConnection {
    fn qps(&self) -> usize {
        self.inner.slots.len()
    }

    fn post(&self, qp: usize, wr: WorkRequest) -> Result<(), FabricError> {
        let inner = &self.inner;
        if inner.broken.load(Ordering::Acquire) || inner.closing.load(Ordering::Acquire) {
            return Err(FabricError::QpBroken);
        }
        let slot = inner.slots.get(qp).ok_or(FabricError::NoSuchQp(qp))?;
        let rkey = match &wr.remote_key {
            RemoteKey::Rkey(k) => *k,
            // An `mw` grant: the window bound on the responder QP paired with this one.
            RemoteKey::PerQp(keys) => *keys.get(qp).ok_or_else(|| {
                FabricError::Other(format!("the grant has {} per-QP keys and none for QP {qp}", keys.len()))
            })?,
            RemoteKey::Token(_) => return Err(FabricError::BadRemoteKey),
        };
        let mem = wr.local.memory();
        mem.check(wr.local_offset, wr.len as u64).map_err(|e| FabricError::LocalRange(e.to_string()))?;
        if wr.op == WrOp::Read && !mem.writable() {
            return Err(FabricError::LocalRange("READ into read-only local memory".into()));
        }
        let laddr = wr.local.addr() + wr.local_offset;
        let lkey = wr.local.lkey();
        let mut st = slot.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.inflight.len() >= slot.qp.max_send_wr as usize {
            return Err(FabricError::Other(format!(
                "send queue of QP {qp} is full ({} WRs outstanding): the caller exceeded its depth",
                st.inflight.len()
            )));
        }
        let seq = st.next_seq & SEQ_MASK;
        let dev_wr_id = ((qp as u64) << SEQ_BITS) | seq;
        // SAFETY: we hold the slot's posting lock (exclusive posting). The local range was
        // checked against the registration's memory above, and the registration is pushed onto
        // the in-flight list below, under the same lock, before the CQ task can retire it.
        unsafe {
            slot.qp.post_rdma(dev_wr_id, wr.op == WrOp::Read, wr.signaled, rkey, wr.remote_addr, lkey, laddr, wr.len)?;
        }
        st.next_seq = st.next_seq.wrapping_add(1);
        st.inflight.push_back(InFlight { seq, wr_id: wr.wr_id, _local: wr.local });
        Ok(())
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
    }
}

impl Drop for VerbsConnection {
    fn drop(&mut self) {
        self.close();
    }
}

/// The responder's side: QPs kept in RTS until the peer disconnects (this handle is dropped).
/// In grant mode `mw` it also binds the grants' memory windows on its QPs.
pub(crate) struct VerbsAccepted {
    inner: Arc<ConnInner>,
    /// Serializes binds: one bind WR outstanding per QP (the send queues hold one WR), and one
    /// poller of the responder CQ.
    bind_lock: Mutex<()>,
}

/// How long a bind may take to complete before the connection is given up.
const BIND_TIMEOUT: Duration = Duration::from_secs(5);

impl VerbsAccepted {
    pub fn new(inner: ConnInner) -> Self {
        VerbsAccepted { inner: Arc::new(inner), bind_lock: Mutex::new(()) }
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
        mr: &Arc<sideway::ibverbs::memory_region::MemoryRegion>,
        memory: &Arc<super::memory::RegionMemory>,
        addr: u64,
        len: u64,
        access: u32,
    ) -> Result<MwGrant, FabricError> {
        let inner = &self.inner;
        let _g = self.bind_lock.lock().unwrap_or_else(|e| e.into_inner());
        if inner.broken.load(Ordering::Acquire) {
            return Err(FabricError::QpBroken);
        }
        let mut windows = Vec::with_capacity(inner.slots.len());
        for _ in &inner.slots {
            windows.push(Mw::alloc(pd)?);
        }
        // Nothing else posts on the responder QPs; drop anything stale before counting.
        let mut buf = Vec::with_capacity(POLL_BATCH);
        let _ = inner.cq.poll(POLL_BATCH, &mut buf);
        buf.clear();
        let keys: Vec<u32> = windows.iter().map(|w| next_rkey(w.rkey())).collect();
        // SAFETY: reading the raw MR pointer of a live MR; `mr` (and so the MR) outlives every
        // bind below: it is moved into the returned grant, or the QPs are in ERR before it drops.
        let mr_ptr = unsafe { mr.mr().as_ptr() };
        let give_up = |e: FabricError| {
            // Outstanding binds must not complete against windows we are about to deallocate.
            inner.broken.store(true, Ordering::Release);
            inner.set_err_all();
            e
        };
        for (i, (slot, mw)) in inner.slots.iter().zip(&windows).enumerate() {
            let _post = slot.state.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: posting is serialized by the slot lock and the bind lock (the responder
            // posts nothing else). The window and the MR belong to this QP's PD (the device's
            // one PD) and stay alive until the completion is polled below, or until the QPs are
            // in ERR (`give_up`) and the WR is flushed.
            let r = unsafe { slot.qp.post_bind_mw(i as u64, mw.as_ptr(), keys[i], mr_ptr, addr, len, access) };
            if let Err(e) = r {
                return Err(give_up(FabricError::Other(format!("posting a memory-window bind on responder QP {i}: {e}"))));
            }
        }
        let deadline = std::time::Instant::now() + BIND_TIMEOUT;
        let mut done = vec![false; windows.len()];
        let mut left = windows.len();
        while left > 0 {
            buf.clear();
            let n = inner.cq.poll(POLL_BATCH, &mut buf).map_err(|e| give_up(FabricError::Io(e)))?;
            for wc in buf.drain(..) {
                let status = WcStatus::from_code(wc.status);
                let i = wc.wr_id as usize;
                if !status.is_success() {
                    return Err(give_up(FabricError::Other(format!(
                        "memory-window bind on responder QP {i} completed with {status} (status {})",
                        wc.status
                    ))));
                }
                if i < done.len() && !done[i] {
                    done[i] = true;
                    left -= 1;
                }
            }
            if left > 0 && n == 0 {
                if std::time::Instant::now() >= deadline {
                    return Err(give_up(FabricError::Other(format!(
                        "memory-window binds did not complete within {BIND_TIMEOUT:?}"
                    ))));
                }
                // tidy: blocking context (the blocking pool, see the doc comment).
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        for (mw, key) in windows.iter_mut().zip(keys) {
            mw.set_rkey(key);
        }
        Ok(MwGrant { windows, _mr: Arc::clone(mr), _memory: Arc::clone(memory), _conn: Arc::clone(inner) })
    }
}

impl crate::fabric::Accepted for VerbsAccepted {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for VerbsAccepted {
    fn drop(&mut self) {
        // The peer is gone: no access through these QPs from here on, even while grants still
        // hold windows bound on them (and so the QPs themselves).
        self.inner.set_err_all();
    }
}
