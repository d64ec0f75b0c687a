//! The RC QP object: creation over one completion queue, the in-flight list that keeps posted
//! memory alive, retiring completions from it, and destruction (which ends all DMA before the
//! memory, the CQ and the PD are released).

use std::collections::VecDeque;
use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use rdma_mummy_sys as sys;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use super::wr::{queue_of, MAX_INDEX, SEQ_MASK};
use crate::cq::{Cq, RawWc};
use crate::error::VerbsError;
use crate::mr::Mr;
use crate::mw::Mw;

/// What an in-flight WR keeps alive until it is retired.
pub(super) enum Hold {
    /// The MR (and so its memory) a WRITE reads or a READ writes.
    Rdma(#[allow(dead_code)] Arc<Mr>),
    /// The window being bound and the MR it is bound to.
    Bind(#[allow(dead_code)] Arc<Mw>, #[allow(dead_code)] Arc<Mr>),
}

pub(super) struct InFlight<K> {
    pub(super) seq: u64,
    pub(super) keep: K,
    pub(super) _hold: Hold,
}

pub(super) struct SendState<K> {
    pub(super) inflight: VecDeque<InFlight<K>>,
    pub(super) next_seq: u64,
}

/// An RC QP whose send completions go to one [`Cq`], with its in-flight list. `K` is the
/// caller's value per WR, handed back by [`RcQp::retire`].
pub struct RcQp<K> {
    pub(super) qp: NonNull<sys::ibv_qp>,
    pub(super) qpx: NonNull<sys::ibv_qp_ex>,
    pub(super) index: usize,
    pub(super) max_send_wr: u32,
    /// Created with `IBV_QP_EX_WITH_BIND_MW` and the provider has `wr_bind_mw`.
    pub(super) can_bind: bool,
    /// The provider has `wr_rdma_write_imm` and `wr_set_sge_list` (notification markers).
    pub(super) can_write_imm: bool,
    /// Receives may be posted ([`RcQp::post_recv_empty`]): created with a receive CQ of its own.
    pub(super) can_recv: bool,
    /// Posting lock and in-flight list. Held while posting, so a completion is never retired
    /// for a WR that is not on the list yet.
    pub(super) state: Mutex<SendState<K>>,
    // Destroyed in Drop before these are released: the in-flight memory, the CQ and the PD
    // outlive the QP.
    pub(super) cq: Arc<Cq>,
    pub(super) recv_cq: Option<Arc<Cq>>,
    pub(super) pd: Arc<ProtectionDomain>,
}

// SAFETY: libibverbs QPs may be used from any thread. Posting (`ibv_wr_start`..`ibv_wr_complete`)
// is not reentrant on one QP: every post holds `state`'s mutex. `modify` moves the QP between
// states, which the kernel serializes against posting. `K` values are only touched under the
// mutex, as in `Mutex<K>` (hence `K: Send` for both).
unsafe impl<K: Send> Send for RcQp<K> {}
// SAFETY: as above.
unsafe impl<K: Send> Sync for RcQp<K> {}

impl<K> std::fmt::Debug for RcQp<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RcQp").field("qpn", &self.qpn()).field("index", &self.index).finish()
    }
}

impl<K> RcQp<K> {
    /// Creates an RC QP (RESET) whose send and receive completions go to `cq`. It gets the next
    /// index of `cq` ([`RcQp::index`]: 0, 1, 2... in creation order, never reused, at most
    /// [`MAX_INDEX`]), which its completions carry ([`queue_of`]). With `bind_mw` it can also post
    /// type-2 memory-window binds.
    pub fn create(pd: &Arc<ProtectionDomain>, cq: &Arc<Cq>, max_send_wr: u32, bind_mw: bool) -> Result<Self, VerbsError> {
        Self::create_with_recv(pd, cq, None, max_send_wr, bind_mw)
    }

    /// [`RcQp::create`], with receive completions going to `recv: (cq, max_recv_wr)` instead of
    /// `cq`: a responder QP that takes notification markers (zero-length RDMA WRITE WITH
    /// IMMEDIATE, each consuming one receive) keeps its receive completions apart from the send
    /// completions whose in-flight bookkeeping `cq` drives.
    pub fn create_with_recv(
        pd: &Arc<ProtectionDomain>,
        cq: &Arc<Cq>,
        recv: Option<(&Arc<Cq>, u32)>,
        max_send_wr: u32,
        bind_mw: bool,
    ) -> Result<Self, VerbsError> {
        // SAFETY: reading the raw PD pointer of a live PD (we keep an Arc below) and the context
        // pointer it holds.
        let pd_ctx = unsafe { (*pd.pd().as_ptr()).context };
        if pd_ctx != cq.context_ptr() {
            return Err(VerbsError::Other("the CQ and the PD belong to different device contexts".into()));
        }
        let Some(index) = cq.claim_index(MAX_INDEX) else {
            return Err(VerbsError::Other(format!("a CQ takes at most {} QPs", MAX_INDEX + 1)));
        };
        if let Some((rcq, _)) = recv {
            if rcq.context_ptr() != cq.context_ptr() {
                return Err(VerbsError::Other("the receive CQ belongs to another device context".into()));
            }
        }
        let mut send_ops = sys::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE.0
            | sys::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM.0
            | sys::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_READ.0;
        if bind_mw {
            send_ops |= sys::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_BIND_MW.0;
        }
        // SAFETY: an all-zero ibv_qp_init_attr_ex is a valid "nothing set" value (null pointers,
        // zero counts); the fields that matter are filled in below.
        let mut attr: sys::ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
        attr.send_cq = cq.as_ibv_cq();
        attr.recv_cq = recv.map_or_else(|| cq.as_ibv_cq(), |(r, _)| r.as_ibv_cq());
        let max_recv_wr = recv.map_or(1, |(_, n)| n.max(1));
        attr.cap = sys::ibv_qp_cap { max_send_wr, max_recv_wr, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        attr.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        attr.comp_mask = sys::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0 | sys::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.0;
        // SAFETY: reading the raw PD pointer of a live PD (we keep an Arc below).
        attr.pd = unsafe { pd.pd().as_ptr() };
        attr.send_ops_flags = send_ops as u64;
        // SAFETY: the PD and the CQs are live and of the same context (checked above); attr is
        // initialised. NULL is handled.
        let raw = unsafe { sys::ibv_create_qp_ex(pd_ctx, &mut attr) };
        let qp = NonNull::new(raw).ok_or_else(|| VerbsError::Setup {
            step: "INIT",
            attr: "create_qp",
            detail: format!("ibv_create_qp_ex(max_send_wr={max_send_wr}): {}", io::Error::last_os_error()),
        })?;
        // SAFETY: `qp` was created with IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, so it is an ibv_qp_ex.
        let qpx = unsafe { sys::ibv_qp_to_qp_ex(qp.as_ptr()) };
        let qpx = match NonNull::new(qpx) {
            Some(p) => p,
            None => {
                // SAFETY: destroying the QP we just created and never shared.
                unsafe { sys::ibv_destroy_qp(qp.as_ptr()) };
                return Err(VerbsError::Other("provider has no extended QP (ibv_qp_to_qp_ex)".into()));
            }
        };
        let state = Mutex::new(SendState { inflight: VecDeque::new(), next_seq: 0 });
        let mut me = RcQp {
            qp,
            qpx,
            index,
            max_send_wr,
            can_bind: false,
            can_write_imm: false,
            can_recv: recv.is_some(),
            state,
            cq: Arc::clone(cq),
            recv_cq: recv.map(|(r, _)| Arc::clone(r)),
            pd: Arc::clone(pd),
        };
        // SAFETY: reading the function table of a live ibv_qp_ex.
        let ops_ok = unsafe {
            let x = me.qpx.as_ref();
            x.wr_start.is_some()
                && x.wr_complete.is_some()
                && x.wr_abort.is_some()
                && x.wr_rdma_write.is_some()
                && x.wr_rdma_read.is_some()
                && x.wr_set_sge.is_some()
        };
        if !ops_ok {
            return Err(VerbsError::Other("provider lacks the ibv_wr_* RDMA WRITE/READ posting API".into()));
        }
        // SAFETY: reading the function table of a live ibv_qp_ex.
        me.can_write_imm = unsafe {
            let x = me.qpx.as_ref();
            x.wr_rdma_write_imm.is_some() && x.wr_set_sge_list.is_some()
        };
        if me.can_recv {
            // SAFETY: reading the context's ops table of a live QP.
            let has_post_recv = unsafe { (*me.qp.as_ref().context).ops.post_recv.is_some() };
            if !has_post_recv {
                return Err(VerbsError::Other("provider lacks ibv_post_recv".into()));
            }
        }
        if bind_mw {
            // SAFETY: reading the function table of a live ibv_qp_ex.
            me.can_bind = unsafe { me.qpx.as_ref().wr_bind_mw.is_some() };
            if !me.can_bind {
                return Err(VerbsError::Other("provider lacks ibv_wr_bind_mw (type-2 memory windows)".into()));
            }
        }
        Ok(me)
    }

    pub fn qpn(&self) -> u32 {
        // SAFETY: live QP; qp_num is immutable after creation.
        unsafe { self.qp.as_ref().qp_num }
    }

    /// The QP's index on its CQ (see [`RcQp::create`]), unique among the CQ's QPs.
    pub fn index(&self) -> usize {
        self.index
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, SendState<K>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Retires the in-flight WRs a completion accounts for and returns the `K` of the WR it
    /// reports (`None` if none: a silent success, or a completion this QP does not know).
    ///
    /// `wc` must come from this QP's CQ and name this QP (by QP number, or by the index in its
    /// `wr_id`, unique on the CQ, where a device garbles the number); otherwise nothing is
    /// retired. A completion
    /// for `seq` retires every entry up to it: WRs complete in order on an RC QP, and
    /// unsignaled WRs that succeeded produce no completion of their own. Defensively, an error
    /// completion whose `wr_id` matches nothing in flight retires the oldest outstanding WR (an
    /// error leaves the QP in ERR, where no WR touches memory any more, and flushes arrive in
    /// post order, one per WR), so a device that garbles flush `wr_id`s cannot leave the list
    /// undrained.
    pub fn retire(&self, wc: RawWc) -> Option<K> {
        let ours = wc.qp_num() == self.qpn() || queue_of(wc.wr_id()) == self.index;
        if !wc.from(&self.cq) || !ours {
            return None;
        }
        let seq = wc.wr_id() & SEQ_MASK;
        let mut st = self.lock();
        if queue_of(wc.wr_id()) == self.index && st.inflight.iter().any(|e| e.seq == seq) {
            while let Some(e) = st.inflight.pop_front() {
                if e.seq == seq {
                    return Some(e.keep);
                }
            }
            None
        } else if !wc.is_success() {
            st.inflight.pop_front().map(|e| e.keep)
        } else {
            None
        }
    }

    /// True if no WR is in flight.
    pub fn is_idle(&self) -> bool {
        self.lock().inflight.is_empty()
    }

    /// Calls `f` with the `K` of every WR in flight, oldest first (they stay in flight).
    pub fn for_each_in_flight(&self, mut f: impl FnMut(&K)) {
        for e in &self.lock().inflight {
            f(&e.keep);
        }
    }
}

impl<K> Drop for RcQp<K> {
    fn drop(&mut self) {
        // SAFETY: the QP is ours; no post can run concurrently (`&mut self`). Destroying it ends
        // all DMA; the in-flight list (and so the memory of outstanding WRs) is released after
        // this, when the fields drop.
        let rc = unsafe { sys::ibv_destroy_qp(self.qp.as_ptr()) };
        if rc != 0 {
            tracing::error!(error = %io::Error::from_raw_os_error(rc), "ibv_destroy_qp failed; leaking the QP and its in-flight memory");
            // The QP may still touch in-flight memory and uses the CQ and PD: leak them too.
            let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
            std::mem::forget(std::mem::take(&mut st.inflight));
            std::mem::forget(Arc::clone(&self.cq));
            std::mem::forget(Arc::clone(&self.pd));
        }
    }
}
