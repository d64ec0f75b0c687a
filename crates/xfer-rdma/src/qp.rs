//! RC queue pair with the extended (`ibv_wr_*`) posting API, its state transitions, and the
//! in-flight list that makes posting safe.
//!
//! Unsafe lives here because a posted work request hands the device a raw address: the memory
//! must stay registered and mapped until the device is done with it. [`RcQp`] guarantees that
//! itself. Every posting function takes the MR (an `Arc<`[`Mr`]`>`, which owns its memory) and,
//! for a window bind, the `Arc<`[`Mw`]`>`; the QP keeps those clones on its in-flight list, next
//! to the caller's own value `K`, until [`RcQp::retire`] is given the WR's completion (or a
//! completion that retires it: WRs complete in order on an RC QP), or until the QP is destroyed
//! (which ends all DMA) — whichever comes first. Posting is serialized by the same lock, so no
//! caller contract remains.
//!
//! Wrapped here over rdma-mummy-sys: sideway's `ExtendedQueuePair` asserts in `Drop`, converts
//! `qp->state` with a `panic!` on unknown values inside `modify`'s error path, and hides the
//! `ibv_qp_ex` pointer needed to post without its guard's `&mut self` borrow.
use std::collections::VecDeque;
use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use rdma_mummy_sys as sys;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use crate::cq::{Cq, RawWc};
use crate::error::VerbsError;
use crate::mr::Mr;
use crate::mw::{next_rkey, Mw};

/// A device `wr_id` is `index << SEQ_BITS | seq`: the QP's index in its connection and the WR's
/// sequence number on that QP.
const SEQ_BITS: u32 = 48;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
/// The most QPs one CQ's `wr_id`s can tell apart.
pub const MAX_INDEX: usize = (1 << (64 - SEQ_BITS)) - 1;

/// The index (see [`RcQp::create`]) of the QP that posted the WR a device `wr_id` names.
pub fn queue_of(wr_id: u64) -> usize {
    (wr_id >> SEQ_BITS) as usize
}

/// One-sided operation of a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaOp {
    /// local → remote
    Write,
    /// remote → local
    Read,
}

/// An RDMA WRITE or READ between `[local_offset, local_offset + len)` of an MR's memory and
/// `remote_addr` under `rkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaWr {
    pub op: RdmaOp,
    /// Ask for a completion even on success (unsignaled successes are retired by the next
    /// signaled completion on the same QP).
    pub signaled: bool,
    pub rkey: u32,
    pub remote_addr: u64,
    /// Offset into the MR's [`RegionMemory`](crate::memory::RegionMemory).
    pub local_offset: u64,
    pub len: u32,
}

/// One WR of [`RcQp::post_many`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Posting {
    Rdma(RdmaWr),
    /// A zero-length RDMA WRITE WITH IMMEDIATE (a notification marker, see
    /// [`RcQp::post_write_imm`]).
    WriteImm {
        rkey: u32,
        remote_addr: u64,
        imm: u32,
        signaled: bool,
    },
}

/// Remote access a window bind grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowAccess {
    RemoteRead,
    RemoteWrite,
}

impl WindowAccess {
    fn flags(self) -> u32 {
        match self {
            WindowAccess::RemoteRead => sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            WindowAccess::RemoteWrite => sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
        }
    }
}

/// Where an RC QP goes in INIT → RTR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// RoCE (Ethernet link layer): a GRH towards `dgid` from our GID `sgid_index`.
    Global { dgid: [u8; 16], sgid_index: u8 },
    /// InfiniBand: the peer port's LID.
    Local { dlid: u16 },
}

/// INIT → RTR attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrAttrs {
    pub port: u8,
    /// `enum ibv_mtu` code.
    pub path_mtu: u32,
    pub dest_qpn: u32,
    pub rq_psn: u32,
    pub max_dest_rd_atomic: u8,
    pub route: Route,
}

/// RTR → RTS attributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsAttrs {
    pub sq_psn: u32,
    /// Local ACK timeout exponent (4.096 µs × 2^timeout).
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub max_rd_atomic: u8,
}

/// What an in-flight WR keeps alive until it is retired.
enum Hold {
    /// The MR (and so its memory) a WRITE reads or a READ writes.
    Rdma(#[allow(dead_code)] Arc<Mr>),
    /// The window being bound and the MR it is bound to.
    Bind(#[allow(dead_code)] Arc<Mw>, #[allow(dead_code)] Arc<Mr>),
}

struct InFlight<K> {
    seq: u64,
    keep: K,
    _hold: Hold,
}

struct SendState<K> {
    inflight: VecDeque<InFlight<K>>,
    next_seq: u64,
}

/// An RC QP whose send completions go to one [`Cq`], with its in-flight list. `K` is the
/// caller's value per WR, handed back by [`RcQp::retire`].
pub struct RcQp<K> {
    qp: NonNull<sys::ibv_qp>,
    qpx: NonNull<sys::ibv_qp_ex>,
    index: usize,
    max_send_wr: u32,
    /// Created with `IBV_QP_EX_WITH_BIND_MW` and the provider has `wr_bind_mw`.
    can_bind: bool,
    /// The provider has `wr_rdma_write_imm` and `wr_set_sge_list` (notification markers).
    can_write_imm: bool,
    /// Receives may be posted ([`RcQp::post_recv_empty`]): created with a receive CQ of its own.
    can_recv: bool,
    /// Posting lock and in-flight list. Held while posting, so a completion is never retired
    /// for a WR that is not on the list yet.
    state: Mutex<SendState<K>>,
    // Destroyed in Drop before these are released: the in-flight memory, the CQ and the PD
    // outlive the QP.
    cq: Arc<Cq>,
    recv_cq: Option<Arc<Cq>>,
    pd: Arc<ProtectionDomain>,
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

    fn modify(&self, attr: &mut sys::ibv_qp_attr, mask: u32) -> io::Result<()> {
        // SAFETY: live QP, fully initialised attr; errors are returned as errno values.
        let rc = unsafe { sys::ibv_modify_qp(self.qp.as_ptr(), attr, mask as i32) };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(rc))
        }
    }

    fn zeroed_attr() -> sys::ibv_qp_attr {
        // SAFETY: ibv_qp_attr is plain old data; all-zero is valid and means "unset".
        unsafe { std::mem::zeroed() }
    }

    /// RESET → INIT: port, pkey index 0, remote READ/WRITE + local write access. The error is
    /// `ibv_modify_qp`'s errno.
    pub fn to_init(&self, port: u8) -> io::Result<()> {
        use sys::ibv_qp_attr_mask as m;
        let mut a = Self::zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = port;
        a.qp_access_flags = (sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ
            | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0;
        let mask = m::IBV_QP_STATE.0 | m::IBV_QP_PKEY_INDEX.0 | m::IBV_QP_PORT.0 | m::IBV_QP_ACCESS_FLAGS.0;
        self.modify(&mut a, mask)
    }

    /// INIT → RTR towards the peer QP in `r`. The error is `ibv_modify_qp`'s errno (route
    /// resolution of a GRH fails with ETIMEDOUT / ENETUNREACH / EHOSTUNREACH).
    pub fn to_rtr(&self, r: &RtrAttrs) -> io::Result<()> {
        use sys::ibv_qp_attr_mask as m;
        let mut a = Self::zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = r.path_mtu;
        a.dest_qp_num = r.dest_qpn;
        a.rq_psn = r.rq_psn;
        a.max_dest_rd_atomic = r.max_dest_rd_atomic;
        a.min_rnr_timer = 12;
        a.ah_attr.port_num = r.port;
        a.ah_attr.sl = 0;
        match r.route {
            Route::Global { dgid, sgid_index } => {
                a.ah_attr.is_global = 1;
                a.ah_attr.grh.dgid = sys::ibv_gid { raw: dgid };
                a.ah_attr.grh.sgid_index = sgid_index;
                a.ah_attr.grh.hop_limit = 64;
                a.ah_attr.grh.traffic_class = 0;
                a.ah_attr.grh.flow_label = 0;
            }
            Route::Local { dlid } => {
                a.ah_attr.is_global = 0;
                a.ah_attr.dlid = dlid;
            }
        }
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_AV.0
            | m::IBV_QP_PATH_MTU.0
            | m::IBV_QP_DEST_QPN.0
            | m::IBV_QP_RQ_PSN.0
            | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | m::IBV_QP_MIN_RNR_TIMER.0;
        self.modify(&mut a, mask)
    }

    /// RTR → RTS with our PSN and retry policy. The error is `ibv_modify_qp`'s errno.
    pub fn to_rts(&self, r: &RtsAttrs) -> io::Result<()> {
        use sys::ibv_qp_attr_mask as m;
        let mut a = Self::zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = r.sq_psn;
        a.timeout = r.timeout;
        a.retry_cnt = r.retry_cnt;
        a.rnr_retry = r.rnr_retry;
        a.max_rd_atomic = r.max_rd_atomic;
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_SQ_PSN.0
            | m::IBV_QP_TIMEOUT.0
            | m::IBV_QP_RETRY_CNT.0
            | m::IBV_QP_RNR_RETRY.0
            | m::IBV_QP_MAX_QP_RD_ATOMIC.0;
        self.modify(&mut a, mask)
    }

    /// Moves the QP to ERR: outstanding WRs complete with WR_FLUSH_ERR.
    pub fn to_err(&self) {
        let mut a = Self::zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
        if let Err(e) = self.modify(&mut a, sys::ibv_qp_attr_mask::IBV_QP_STATE.0) {
            tracing::warn!(qpn = self.qpn(), error = %e, "cannot move QP to ERR");
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SendState<K>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checks that `[offset, offset+len)` of `mr`'s memory lies inside `mr` and that `mr` is of
    /// this QP's PD.
    fn check_local(&self, mr: &Mr, offset: u64, len: u64) -> Result<(), VerbsError> {
        mr.memory().check(offset, len).map_err(|e| VerbsError::LocalRange(e.to_string()))?;
        if !mr.covers(offset, len) {
            return Err(VerbsError::LocalRange(format!("range {offset}+{len} is outside its memory registration")));
        }
        if !Arc::ptr_eq(mr.pd(), &self.pd) {
            return Err(VerbsError::Other("the memory registration belongs to another protection domain".into()));
        }
        Ok(())
    }

    /// Reserves the next sequence number, refusing when the send queue is full.
    fn next(&self, st: &SendState<K>) -> Result<(u64, u64), VerbsError> {
        if st.inflight.len() >= self.max_send_wr as usize {
            return Err(VerbsError::Other(format!(
                "send queue of QP {} is full ({} WRs outstanding): the caller exceeded its depth",
                self.index,
                st.inflight.len()
            )));
        }
        let seq = st.next_seq & SEQ_MASK;
        Ok((seq, ((self.index as u64) << SEQ_BITS) | seq))
    }

    /// Posts one RDMA WRITE or READ over `[wr.local_offset, +wr.len)` of `local`'s memory. The
    /// QP keeps `local` (and so the memory) and `keep` until the WR is retired. One WR of
    /// [`RcQp::post_many`].
    pub fn post_rdma(&self, wr: RdmaWr, local: &Arc<Mr>, keep: K) -> Result<(), VerbsError> {
        self.post_many(vec![(Posting::Rdma(wr), keep)], local)
    }

    /// Posts `wrs` (RDMA WRITEs and READs over `local`'s memory, or zero-length WRITE WITH
    /// IMMEDIATE markers) in order with ONE doorbell: one `ibv_wr_start`, every WR, one
    /// `ibv_wr_complete`. Every WR is checked first (nothing is posted if one is bad, or if they
    /// do not all fit the send queue). The QP keeps `local` and each `K` on its in-flight list
    /// like [`RcQp::post_rdma`]. If `ibv_wr_complete` fails the entries stay on the list anyway
    /// (the device may have taken some of them): their memory then lives until the QP is
    /// destroyed, and the caller must treat the QP as broken.
    pub fn post_many(&self, wrs: Vec<(Posting, K)>, local: &Arc<Mr>) -> Result<(), VerbsError> {
        if wrs.is_empty() {
            return Ok(());
        }
        if !Arc::ptr_eq(local.pd(), &self.pd) {
            return Err(VerbsError::Other("the memory registration belongs to another protection domain".into()));
        }
        for (w, _) in &wrs {
            match w {
                Posting::Rdma(wr) => {
                    self.check_local(local, wr.local_offset, wr.len as u64)?;
                    if wr.op == RdmaOp::Read && !local.memory().writable() {
                        return Err(VerbsError::LocalRange("READ into read-only local memory".into()));
                    }
                }
                Posting::WriteImm { .. } if !self.can_write_imm => {
                    return Err(VerbsError::Io(io::Error::other("the provider cannot post RDMA WRITE WITH IMMEDIATE")));
                }
                Posting::WriteImm { .. } => {}
            }
        }
        let base = local.memory().addr();
        let lkey = local.lkey();
        let mut st = self.lock();
        if st.inflight.len() + wrs.len() > self.max_send_wr as usize {
            return Err(VerbsError::Other(format!(
                "send queue of QP {} cannot take {} more WRs ({} outstanding of {}): the caller exceeded its depth",
                self.index,
                wrs.len(),
                st.inflight.len(),
                self.max_send_wr
            )));
        }
        let q = self.qpx.as_ptr();
        // SAFETY: we hold `state`'s lock (exclusive posting) on a live extended QP whose function
        // table was checked in `create` (`wr_rdma_write_imm`/`wr_set_sge_list` only when
        // `can_write_imm`, checked above for markers). Every WR's local range lies inside
        // `local`, an MR of this QP's PD (checked above), whose memory `local` owns; each entry
        // is pushed onto the in-flight list under the same lock, before the doorbell, and stays
        // there until retired or the QP is destroyed, so the memory stays registered and mapped
        // while the device may use it. Markers read no local memory (an empty sge list).
        let rc = unsafe {
            sys::ibv_wr_start(q);
            for (w, keep) in wrs {
                let seq = st.next_seq & SEQ_MASK;
                (*q).wr_id = ((self.index as u64) << SEQ_BITS) | seq;
                match w {
                    Posting::Rdma(wr) => {
                        (*q).wr_flags = if wr.signaled { sys::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
                        match wr.op {
                            RdmaOp::Read => sys::ibv_wr_rdma_read(q, wr.rkey, wr.remote_addr),
                            RdmaOp::Write => sys::ibv_wr_rdma_write(q, wr.rkey, wr.remote_addr),
                        }
                        sys::ibv_wr_set_sge(q, lkey, base + wr.local_offset, wr.len);
                    }
                    Posting::WriteImm { rkey, remote_addr, imm, signaled } => {
                        (*q).wr_flags = if signaled { sys::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
                        sys::ibv_wr_rdma_write_imm(q, rkey, remote_addr, imm.to_be());
                        sys::ibv_wr_set_sge_list(q, 0, std::ptr::null());
                    }
                }
                st.next_seq = st.next_seq.wrapping_add(1);
                st.inflight.push_back(InFlight { seq, keep, _hold: Hold::Rdma(Arc::clone(local)) });
            }
            sys::ibv_wr_complete(q)
        };
        if rc != 0 {
            return Err(VerbsError::Io(io::Error::from_raw_os_error(rc)));
        }
        Ok(())
    }

    /// Posts one notification marker: a zero-length RDMA WRITE WITH IMMEDIATE `imm` (sent in
    /// network byte order; the receiver's [`RawWc::imm`] gives it back in host order) to
    /// `remote_addr` under `rkey`. It touches no local memory (no scatter/gather entry); the
    /// target consumes one posted receive for it and sees it only after every earlier WR of
    /// this QP has executed there (RC ordering). `local` is kept in flight like a data WR's, so
    /// the caller's accounting is the same for every WR. One WR of [`RcQp::post_many`].
    pub fn post_write_imm(
        &self,
        rkey: u32,
        remote_addr: u64,
        imm: u32,
        signaled: bool,
        local: &Arc<Mr>,
        keep: K,
    ) -> Result<(), VerbsError> {
        self.post_many(vec![(Posting::WriteImm { rkey, remote_addr, imm, signaled }, keep)], local)
    }

    /// Posts one receive with no scatter/gather entry, for a notification marker (a zero-length
    /// WRITE WITH IMMEDIATE consumes one; its completion carries the immediate). Needs a QP made
    /// by [`RcQp::create_with_recv`]. A receive with no buffer gives the device no memory to
    /// write, so nothing has to be kept alive for it.
    pub fn post_recv_empty(&self, wr_id: u64) -> Result<(), VerbsError> {
        if !self.can_recv {
            return Err(VerbsError::Io(io::Error::other("QP was not created with a receive CQ")));
        }
        let mut wr = sys::ibv_recv_wr { wr_id, next: std::ptr::null_mut(), sg_list: std::ptr::null_mut(), num_sge: 0 };
        let mut bad: *mut sys::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: live QP whose provider has `post_recv` (checked in `create_with_recv`); `wr` is
        // a single, fully initialised receive with no scatter/gather entries, read by the
        // provider before the call returns (so a stack value is enough).
        let rc = unsafe { sys::ibv_post_recv(self.qp.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::Io(io::Error::from_raw_os_error(rc)));
        }
        Ok(())
    }

    /// True if `wc` was read from this QP's receive CQ and names this QP.
    pub fn owns_recv(&self, wc: &RawWc) -> bool {
        self.recv_cq.as_ref().is_some_and(|r| wc.from(r)) && wc.qp_num() == self.qpn()
    }

    /// Posts one signaled type-2 bind of `mw` over `[offset, offset+len)` of `mr`'s memory with
    /// `access`, and returns the key the bind installs (the window's next key). The QP keeps `mw`,
    /// `mr` and `keep` until the bind is retired; so a window whose bind is never retired stays
    /// allocated until the QP is destroyed. Record the key with [`Mw::set_rkey`] once the bind
    /// has completed successfully.
    pub fn post_bind_mw(
        &self,
        mw: &Arc<Mw>,
        mr: &Arc<Mr>,
        offset: u64,
        len: u64,
        access: WindowAccess,
        keep: K,
    ) -> Result<u32, VerbsError> {
        if !self.can_bind {
            return Err(VerbsError::Io(io::Error::other("QP was not created for memory-window binds")));
        }
        self.check_local(mr, offset, len)?;
        if !Arc::ptr_eq(mw.pd(), &self.pd) {
            return Err(VerbsError::Other("the memory window belongs to another protection domain".into()));
        }
        let rkey = next_rkey(mw.rkey());
        mw.bind_to(mr);
        let info =
            sys::ibv_mw_bind_info { mr: mr.as_ptr(), addr: mr.memory().addr() + offset, length: len, mw_access_flags: access.flags() };
        let mut st = self.lock();
        let (seq, wr_id) = self.next(&st)?;
        let q = self.qpx.as_ptr();
        // SAFETY: we hold `state`'s lock (exclusive posting) on a live extended QP;
        // `wr_bind_mw` was checked to exist in `create` (`can_bind`). The window and the MR are
        // live objects of this QP's PD (checked above) and are pushed onto the in-flight list
        // below, under the same lock, so they stay allocated and registered until the bind is
        // retired or the QP destroyed. The provider copies `info` into the WQE before
        // `ibv_wr_bind_mw` returns, so a stack value is enough.
        let rc = unsafe {
            sys::ibv_wr_start(q);
            (*q).wr_id = wr_id;
            (*q).wr_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
            sys::ibv_wr_bind_mw(q, mw.as_ptr(), rkey, &info);
            sys::ibv_wr_complete(q)
        };
        if rc != 0 {
            return Err(VerbsError::Io(io::Error::from_raw_os_error(rc)));
        }
        st.next_seq = st.next_seq.wrapping_add(1);
        st.inflight.push_back(InFlight { seq, keep, _hold: Hold::Bind(Arc::clone(mw), Arc::clone(mr)) });
        Ok(rkey)
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
