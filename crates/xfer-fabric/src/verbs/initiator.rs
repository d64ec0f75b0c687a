//! The initiator's half of a verbs connection: its QPs moved to RTS with the responder's
//! endpoints, then work requests posted (one doorbell per batch) and completions polled by the
//! CQ task or, handed off, by a data-path worker thread.
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use xfer_rdma::cq::RawWc;
use xfer_rdma::mr::Mr;
use xfer_rdma::qp::{Posting, RdmaOp, RdmaWr};

use super::connection::{run_cq, Checked, ConnInner, InFlight, POLL_BATCH};
use super::device::Device;
use super::mr::VerbsRegistration;
use super::options::VerbsOptions;
use crate::{CompletionSink, Connection, Endpoint, FabricError, PathInfo, PendingConnection, RemoteKey, WorkRequest, WrOp};

/// The initiator's connection between `prepare` and the responder's answer.
pub(crate) struct VerbsPrepared {
    pub inner: ConnInner,
    pub dev: Arc<Device>,
    pub opts: VerbsOptions,
    pub sink: CompletionSink,
    /// Its QPs were taken from the prebuilt pool (for `xfer_connection_builds_total`).
    pub prebuilt: bool,
}

#[async_trait]
impl PendingConnection for VerbsPrepared {
    fn local_endpoints(&self) -> Vec<Endpoint> {
        self.inner.endpoints(&self.dev)
    }

    async fn complete(self: Box<Self>, remote: &[Endpoint]) -> Result<Arc<dyn Connection>, FabricError> {
        Ok((*self).complete_at(remote, 0)?)
    }
}

impl VerbsPrepared {
    /// Finishes as one part of a connection over several devices: its QPs are that connection's
    /// `base..base + qps`, and the completions it delivers say so.
    pub(crate) fn complete_at(self, remote: &[Endpoint], base: usize) -> Result<Arc<VerbsConnection>, FabricError> {
        let checked = self.check(remote)?;
        self.complete_checked(&checked, base)
    }

    /// Validates the peer's answer for this part (the peer's fault if it fails).
    pub(crate) fn check(&self, remote: &[Endpoint]) -> Result<Checked, FabricError> {
        self.inner.validate(&self.dev, remote)
    }

    /// Moves the QPs to RTS along `checked` (from [`Self::check`]) and starts the part as
    /// connection QPs `base..base + qps`. On an error (the device's: e.g. no route to the peer's
    /// GID) the QPs, on which nothing was posted, are destroyed with `self`.
    pub(crate) fn complete_checked(mut self, checked: &Checked, base: usize) -> Result<Arc<VerbsConnection>, FabricError> {
        self.inner.move_to_rts(&self.dev, &self.opts, checked)?;
        self.inner.qp_base = base;
        Ok(VerbsConnection::start_concrete(self.inner, self.sink, self.opts.busy_poll))
    }

    pub(crate) fn qps(&self) -> usize {
        self.inner.slots.len()
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
    fn start_concrete(inner: ConnInner, sink: CompletionSink, busy_poll: bool) -> Arc<VerbsConnection> {
        let inner = Arc::new(inner);
        tokio::spawn(run_cq(Arc::clone(&inner), sink.clone(), busy_poll));
        Arc::new(VerbsConnection { inner, sink, buf: Mutex::new(Vec::with_capacity(POLL_BATCH)) })
    }

    /// Moves every QP to ERR, so the WRs outstanding on them flush now instead of after the
    /// transport's retries (the device under them went down); the connection counts as broken.
    pub(crate) fn fail(&self) {
        self.inner.broken.store(true, Ordering::Release);
        self.inner.set_err_all();
    }

    /// The path MTU its QPs negotiated, in bytes.
    pub(crate) fn path_mtu(&self) -> u32 {
        self.inner.path_mtu.load(Ordering::Acquire)
    }
}

impl Connection for VerbsConnection {
    fn qps(&self) -> usize {
        self.inner.slots.len()
    }

    fn paths(&self) -> Vec<PathInfo> {
        vec![PathInfo {
            local_device: String::new(),
            remote_device: String::new(),
            qps: 0..self.qps(),
            standby: false,
            mtu: self.path_mtu(),
        }]
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
                RemoteKey::Token(_) | RemoteKey::Each(_) => return Err((first, FabricError::BadRemoteKey)),
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
