//! Posting on an RC QP: RDMA WRITEs and READs (several behind one doorbell), notification
//! markers, empty receives and memory-window binds. Every WR is checked before anything is
//! posted, and what it points at goes on the in-flight list under the posting lock.

use std::io;
use std::sync::Arc;

use rdma_mummy_sys as sys;

use super::rc::{Hold, InFlight, RcQp, SendState};
use super::wr::{Posting, RdmaOp, RdmaWr, WindowAccess, SEQ_BITS, SEQ_MASK};
use crate::cq::RawWc;
use crate::error::VerbsError;
use crate::mr::Mr;
use crate::mw::{next_rkey, Mw};

impl<K> RcQp<K> {
    /// Checks that `[offset, offset+len)` of `mr`'s memory lies inside `mr` and that `mr` is of
    /// this QP's PD.
    pub(super) fn check_local(&self, mr: &Mr, offset: u64, len: u64) -> Result<(), VerbsError> {
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
    pub(super) fn next(&self, st: &SendState<K>) -> Result<(u64, u64), VerbsError> {
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
}
