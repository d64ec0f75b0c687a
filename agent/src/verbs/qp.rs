//! RC queue pair with the extended (`ibv_wr_*`) posting API.
//!
//! Wrapped here over rdma-mummy-sys: sideway's `ExtendedQueuePair` asserts in `Drop`, converts
//! `qp->state` with a `panic!` on unknown values inside `modify`'s error path, and hides the
//! `ibv_qp_ex` pointer needed to post without its guard's `&mut self` borrow.
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys as sys;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use super::cq::Cq;
use super::negotiate::{PathParams, LINK_ETHERNET};
use super::VerbsOptions;
use crate::fabric::FabricError;

pub(crate) struct Qp {
    qp: NonNull<sys::ibv_qp>,
    qpx: NonNull<sys::ibv_qp_ex>,
    pub max_send_wr: u32,
    /// Created with `IBV_QP_EX_WITH_BIND_MW` and the provider has `wr_bind_mw`.
    can_bind: bool,
    // Destroyed in Drop before these are released: the CQ and PD outlive the QP.
    _cq: Arc<Cq>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: libibverbs QPs may be used from any thread. Posting (`ibv_wr_start`..`ibv_wr_complete`)
// is not reentrant on one QP: every caller holds the per-QP mutex of `connection::QpSlot`, and
// `modify` is only called during setup (single owner) or to move the QP to ERR, which the
// kernel serializes against posting.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

fn modify_err(step: &'static str, attr: &'static str, rc: i32, what: String) -> FabricError {
    FabricError::Negotiation { step, attr, detail: format!("ibv_modify_qp: {} ({what})", io::Error::from_raw_os_error(rc)) }
}

impl Qp {
    /// Creates an RC QP (RESET) whose send and receive completions go to `cq`. With `bind_mw`
    /// it can also post type-2 memory-window binds (grant mode `mw`, responder QPs).
    pub fn create(pd: &Arc<ProtectionDomain>, cq: &Arc<Cq>, max_send_wr: u32, bind_mw: bool) -> Result<Qp, FabricError> {
        let mut send_ops = sys::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE.0
            | sys::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_READ.0;
        if bind_mw {
            send_ops |= sys::ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_BIND_MW.0;
        }
        // SAFETY: an all-zero ibv_qp_init_attr_ex is a valid "nothing set" value (null pointers,
        // zero counts); the fields that matter are filled in below.
        let mut attr: sys::ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
        attr.send_cq = cq.as_ibv_cq();
        attr.recv_cq = cq.as_ibv_cq();
        attr.cap = sys::ibv_qp_cap { max_send_wr, max_recv_wr: 1, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        attr.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        attr.comp_mask =
            sys::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0 | sys::ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.0;
        // SAFETY: reading the raw PD pointer of a live PD (we keep an Arc below).
        attr.pd = unsafe { pd.pd().as_ptr() };
        attr.send_ops_flags = send_ops as u64;
        // SAFETY: the PD and CQ are live; attr is initialised; the PD's context is the device
        // context the PD was allocated from. NULL is handled.
        let raw = unsafe { sys::ibv_create_qp_ex((*attr.pd).context, &mut attr) };
        let qp = NonNull::new(raw).ok_or_else(|| FabricError::Negotiation {
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
                return Err(FabricError::Other("provider has no extended QP (ibv_qp_to_qp_ex)".into()));
            }
        };
        let mut me = Qp { qp, qpx, max_send_wr, can_bind: false, _cq: Arc::clone(cq), _pd: Arc::clone(pd) };
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
            return Err(FabricError::Other("provider lacks the ibv_wr_* RDMA WRITE/READ posting API".into()));
        }
        if bind_mw {
            // SAFETY: reading the function table of a live ibv_qp_ex.
            me.can_bind = unsafe { me.qpx.as_ref().wr_bind_mw.is_some() };
            if !me.can_bind {
                return Err(FabricError::Other("provider lacks ibv_wr_bind_mw (type-2 memory windows)".into()));
            }
        }
        Ok(me)
    }

    pub fn qpn(&self) -> u32 {
        // SAFETY: live QP; qp_num is immutable after creation.
        unsafe { self.qp.as_ref().qp_num }
    }

    fn modify(&self, attr: &mut sys::ibv_qp_attr, mask: u32) -> Result<(), i32> {
        // SAFETY: live QP, fully initialised attr; errors are returned as errno values.
        let rc = unsafe { sys::ibv_modify_qp(self.qp.as_ptr(), attr, mask as i32) };
        if rc == 0 {
            Ok(())
        } else {
            Err(rc)
        }
    }

    fn zeroed_attr() -> sys::ibv_qp_attr {
        // SAFETY: ibv_qp_attr is plain old data; all-zero is valid and means "unset".
        unsafe { std::mem::zeroed() }
    }

    /// RESET → INIT: port, pkey index 0, remote READ/WRITE + local write access.
    pub fn to_init(&self, port: u8) -> Result<(), FabricError> {
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
        self.modify(&mut a, mask).map_err(|rc| modify_err("INIT", "port", rc, format!("port {port}, pkey_index 0")))
    }

    /// INIT → RTR towards the peer endpoint in `path`.
    pub fn to_rtr(&self, path: &PathParams, link_layer: &str, port: u8, sgid_index: u32, max_dest_rd_atomic: u8) -> Result<(), FabricError> {
        use sys::ibv_qp_attr_mask as m;
        let r = &path.remote;
        let mut a = Self::zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = path.path_mtu;
        a.dest_qp_num = r.qpn;
        a.rq_psn = r.psn;
        a.max_dest_rd_atomic = max_dest_rd_atomic;
        a.min_rnr_timer = 12;
        a.ah_attr.port_num = port;
        a.ah_attr.sl = 0;
        if link_layer == LINK_ETHERNET {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = sys::ibv_gid { raw: r.gid };
            a.ah_attr.grh.sgid_index = sgid_index.min(255) as u8;
            a.ah_attr.grh.hop_limit = 64;
            a.ah_attr.grh.traffic_class = 0;
            a.ah_attr.grh.flow_label = 0;
        } else {
            a.ah_attr.is_global = 0;
            a.ah_attr.dlid = r.lid as u16;
        }
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_AV.0
            | m::IBV_QP_PATH_MTU.0
            | m::IBV_QP_DEST_QPN.0
            | m::IBV_QP_RQ_PSN.0
            | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | m::IBV_QP_MIN_RNR_TIMER.0;
        self.modify(&mut a, mask).map_err(|rc| {
            // Route resolution of the GRH fails with ETIMEDOUT / ENETUNREACH / EHOSTUNREACH.
            let attr = match rc {
                nix::libc::ETIMEDOUT | nix::libc::ENETUNREACH | nix::libc::EHOSTUNREACH => "dgid",
                _ => "attributes",
            };
            modify_err(
                "RTR",
                attr,
                rc,
                format!(
                    "dest_qpn {:#x}, path_mtu code {}, sgid_index {sgid_index}, dgid {}, max_dest_rd_atomic {max_dest_rd_atomic}",
                    r.qpn,
                    path.path_mtu,
                    super::negotiate::gid_string(&r.gid)
                ),
            )
        })
    }

    /// RTR → RTS with our PSN and the retry policy of `opts`.
    pub fn to_rts(&self, psn: u32, max_rd_atomic: u8, opts: &VerbsOptions) -> Result<(), FabricError> {
        use sys::ibv_qp_attr_mask as m;
        let mut a = Self::zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = psn;
        a.timeout = opts.timeout;
        a.retry_cnt = opts.retry_cnt;
        a.rnr_retry = opts.rnr_retry;
        a.max_rd_atomic = max_rd_atomic;
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_SQ_PSN.0
            | m::IBV_QP_TIMEOUT.0
            | m::IBV_QP_RETRY_CNT.0
            | m::IBV_QP_RNR_RETRY.0
            | m::IBV_QP_MAX_QP_RD_ATOMIC.0;
        self.modify(&mut a, mask).map_err(|rc| {
            modify_err(
                "RTS",
                "attributes",
                rc,
                format!(
                    "timeout {}, retry_cnt {}, rnr_retry {}, max_rd_atomic {max_rd_atomic}",
                    opts.timeout, opts.retry_cnt, opts.rnr_retry
                ),
            )
        })
    }

    /// Moves the QP to ERR: outstanding WRs complete with WR_FLUSH_ERR.
    pub fn to_err(&self) {
        let mut a = Self::zeroed_attr();
        a.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
        if let Err(rc) = self.modify(&mut a, sys::ibv_qp_attr_mask::IBV_QP_STATE.0) {
            tracing::warn!(qpn = self.qpn(), error = %io::Error::from_raw_os_error(rc), "cannot move QP to ERR");
        }
    }

    /// Posts one RDMA WRITE or READ. The caller holds this QP's posting lock and guarantees the
    /// local range `[laddr, laddr+len)` is inside a live registration with `lkey`, kept alive until
    /// the WR's completion (the in-flight list).
    ///
    /// # Safety
    /// Not reentrant: the caller must serialize calls on one QP. The local memory must stay
    /// registered and mapped until the WR completes or is flushed.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post_rdma(
        &self,
        wr_id: u64,
        read: bool,
        signaled: bool,
        rkey: u32,
        remote_addr: u64,
        lkey: u32,
        laddr: u64,
        len: u32,
    ) -> io::Result<()> {
        let q = self.qpx.as_ptr();
        // SAFETY: (caller contract) exclusive posting on a live extended QP whose function table
        // was checked in `create`; one WR between wr_start and wr_complete.
        unsafe {
            sys::ibv_wr_start(q);
            (*q).wr_id = wr_id;
            (*q).wr_flags = if signaled { sys::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 };
            if read {
                sys::ibv_wr_rdma_read(q, rkey, remote_addr);
            } else {
                sys::ibv_wr_rdma_write(q, rkey, remote_addr);
            }
            sys::ibv_wr_set_sge(q, lkey, laddr, len);
            let rc = sys::ibv_wr_complete(q);
            if rc == 0 {
                Ok(())
            } else {
                Err(io::Error::from_raw_os_error(rc))
            }
        }
    }

    /// Posts one signaled type-2 window bind: `mw` gets key `rkey` over `[addr, addr+len)` of the
    /// MR `mr`, with `access` (`IBV_ACCESS_REMOTE_*`).
    ///
    /// # Safety
    /// Not reentrant: the caller must serialize posting on this QP. `mw` and `mr` must be live
    /// objects of this QP's PD, and stay allocated/registered until the bind's completion has
    /// been polled (or the QP is in ERR and the WR flushed).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post_bind_mw(
        &self,
        wr_id: u64,
        mw: *mut sys::ibv_mw,
        rkey: u32,
        mr: *mut sys::ibv_mr,
        addr: u64,
        len: u64,
        access: u32,
    ) -> io::Result<()> {
        if !self.can_bind {
            return Err(io::Error::other("QP was not created for memory-window binds"));
        }
        let q = self.qpx.as_ptr();
        let info = sys::ibv_mw_bind_info { mr, addr, length: len, mw_access_flags: access };
        // SAFETY: (caller contract) exclusive posting on a live extended QP; `wr_bind_mw` was
        // checked to exist in `create` (`can_bind`). The provider copies `info` into the WQE
        // before `ibv_wr_bind_mw` returns, so a stack value is enough.
        unsafe {
            sys::ibv_wr_start(q);
            (*q).wr_id = wr_id;
            (*q).wr_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
            sys::ibv_wr_bind_mw(q, mw, rkey, &info);
            let rc = sys::ibv_wr_complete(q);
            if rc == 0 {
                Ok(())
            } else {
                Err(io::Error::from_raw_os_error(rc))
            }
        }
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: the QP is ours; no post can run concurrently (posting borrows the connection,
        // which owns this Qp). Destroying drops outstanding WRs, whose memory is still held by
        // the in-flight list being dropped after us.
        let rc = unsafe { sys::ibv_destroy_qp(self.qp.as_ptr()) };
        if rc != 0 {
            tracing::error!(error = %io::Error::from_raw_os_error(rc), "ibv_destroy_qp failed; leaking the QP");
        }
    }
}
