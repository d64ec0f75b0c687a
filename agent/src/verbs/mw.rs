//! Type-2 memory windows: grant mode `mw` (DESIGN §2).
//!
//! A grant binds one window per responder QP of the grantee's connection (a type-2 window only
//! answers accesses that arrive on the QP it was bound on, and transfers stripe over every QP of
//! a connection). The bind itself is a send WR on the responder QP; `connection::VerbsAccepted`
//! posts it (`xfer_rdma::qp::RcQp::post_bind_mw`) and polls the responder CQ for its completion.
//! The windows themselves are `xfer_rdma::mw::Mw`. Revocation deallocates the windows:
//! when `ibv_dealloc_mw` returns, the key is dead (an access gets REM_ACCESS_ERR).
//!
//! Windows are range-safe only on devices that check accesses against the window: rxe (6.1)
//! checks the key and the QP, but the range against the underlying MR (DESIGN §13).
use std::sync::Arc;

use xfer_rdma::mr::Mr;
use xfer_rdma::mw::Mw;

use super::connection::ConnInner;

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
