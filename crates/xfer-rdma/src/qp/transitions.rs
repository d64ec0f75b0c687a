//! The QP's state transitions, RESET → INIT → RTR → RTS (and to ERR), with the attributes each
//! needs: where the peer QP is ([`Route`], [`RtrAttrs`]) and our PSN and retry policy
//! ([`RtsAttrs`]).

use std::io;

use rdma_mummy_sys as sys;

use super::rc::RcQp;

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

impl<K> RcQp<K> {
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
}
