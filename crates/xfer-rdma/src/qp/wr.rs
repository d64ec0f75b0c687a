//! What a caller posts on an RC QP ([`RdmaWr`], [`Posting`], window binds) and how a device
//! `wr_id` names the QP and the WR it came from.

use rdma_mummy_sys as sys;

/// A device `wr_id` is `index << SEQ_BITS | seq`: the QP's index in its connection and the WR's
/// sequence number on that QP.
pub(super) const SEQ_BITS: u32 = 48;
pub(super) const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;
/// The most QPs one CQ's `wr_id`s can tell apart.
pub const MAX_INDEX: usize = (1 << (64 - SEQ_BITS)) - 1;

/// The index (see [`RcQp::create`](crate::qp::RcQp::create)) of the QP that posted the WR a device `wr_id` names.
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

/// One WR of [`RcQp::post_many`](crate::qp::RcQp::post_many).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Posting {
    Rdma(RdmaWr),
    /// A zero-length RDMA WRITE WITH IMMEDIATE (a notification marker, see
    /// [`RcQp::post_write_imm`](crate::qp::RcQp::post_write_imm)).
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
    /// The `ibv_access_flags` bit of this access.
    pub(super) fn flags(self) -> u32 {
        match self {
            WindowAccess::RemoteRead => sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            WindowAccess::RemoteWrite => sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
        }
    }
}
