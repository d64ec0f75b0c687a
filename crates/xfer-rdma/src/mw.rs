//! [`Mw`]: type-2 memory windows (the agent's grant mode `mw`).
//!
//! Unsafe lives here because a window is a raw libibverbs object: allocated, bound (by
//! [`crate::qp::RcQp::post_bind_mw`], which keeps the window alive until the bind is retired) and
//! deallocated through its pointer. Dropping the last `Arc<Mw>` deallocates it: when
//! `ibv_dealloc_mw` returns, its key is dead (an access gets REM_ACCESS_ERR).
//!
//! Windows are range-safe only on devices that check accesses against the window: rxe (6.1)
//! checks the key and the QP, but the range against the underlying MR.
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use rdma_mummy_sys as sys;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use crate::error::VerbsError;
use crate::mr::Mr;

/// One type-2 memory window. Dropping it deallocates it, which also invalidates its key.
pub struct Mw {
    mw: NonNull<sys::ibv_mw>,
    /// The window's current key: the key `ibv_alloc_mw` gave it, then the one its bind
    /// installed ([`Mw::set_rkey`]). Kept here because rxe's provider does not update
    /// `mw->rkey` after a type-2 bind posted with `ibv_wr_bind_mw`.
    rkey: AtomicU32,
    /// The MR a bind was posted against: kept registered for as long as the window exists.
    bound_to: Mutex<Option<Arc<Mr>>>,
    // Deallocated in Drop before the MR and the PD can be released.
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the raw window is only read by the provider while a bind is posted (under the QP's
// posting lock) and deallocated in Drop with exclusive access; the key we keep is an atomic.
// libibverbs objects may be used from any thread.
unsafe impl Send for Mw {}
// SAFETY: as above.
unsafe impl Sync for Mw {}

impl std::fmt::Debug for Mw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mw").finish_non_exhaustive()
    }
}

/// The next key of a window: the same index (upper 24 bits), the 8-bit tag incremented
/// (`ibv_inc_rkey`, without its overflow on `0xffff_ffff`).
pub fn next_rkey(rkey: u32) -> u32 {
    (rkey & !0xff) | ((rkey as u8).wrapping_add(1) as u32)
}

impl Mw {
    /// Allocates an unbound type-2 window in `pd`.
    pub fn alloc(pd: &Arc<ProtectionDomain>) -> Result<Arc<Mw>, VerbsError> {
        // SAFETY: reading the raw pointer of a live PD (we keep an Arc) and its context's ops
        // table. `ibv_alloc_mw` checks `alloc_mw` itself; `ibv_dealloc_mw` unwraps
        // `dealloc_mw`, so a provider without it is refused here, before anything is allocated.
        let raw = unsafe {
            let pd_ptr = pd.pd().as_ptr();
            if (*(*pd_ptr).context).ops.dealloc_mw.is_none() {
                return Err(VerbsError::Registration("provider cannot deallocate memory windows".into()));
            }
            sys::ibv_alloc_mw(pd_ptr, sys::ibv_mw_type::IBV_MW_TYPE_2)
        };
        let mw =
            NonNull::new(raw).ok_or_else(|| VerbsError::Registration(format!("ibv_alloc_mw(type 2): {}", io::Error::last_os_error())))?;
        // SAFETY: live window, not yet shared; reading a plain field.
        let rkey = unsafe { mw.as_ref().rkey };
        Ok(Arc::new(Mw { mw, rkey: AtomicU32::new(rkey), bound_to: Mutex::new(None), pd: Arc::clone(pd) }))
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_mw {
        self.mw.as_ptr()
    }

    /// Keeps `mr` registered for as long as this window exists (a bind against it was posted).
    pub(crate) fn bind_to(&self, mr: &Arc<Mr>) {
        *self.bound_to.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(mr));
    }

    pub(crate) fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// The window's current key (the one the next bind must name as current).
    pub fn rkey(&self) -> u32 {
        self.rkey.load(Ordering::Acquire)
    }

    /// Records the key a completed bind has installed (what `post_bind_mw` returned).
    pub fn set_rkey(&self, rkey: u32) {
        self.rkey.store(rkey, Ordering::Release);
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        // SAFETY: the window is ours and allocated; `dealloc_mw` was checked to exist in `alloc`.
        // No bind of it is outstanding: a posted bind holds an `Arc<Mw>` until it is retired or
        // its QP destroyed. Deallocating a bound window invalidates it: its key answers
        // REM_ACCESS_ERR from here on.
        let rc = unsafe { sys::ibv_dealloc_mw(self.mw.as_ptr()) };
        if rc != 0 {
            tracing::error!(error = %io::Error::from_raw_os_error(rc), "ibv_dealloc_mw failed; leaking the memory window");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::next_rkey;

    #[test]
    fn next_rkey_bumps_only_the_tag() {
        assert_eq!(next_rkey(0x1234_5600), 0x1234_5601);
        assert_eq!(next_rkey(0x1234_56ff), 0x1234_5600);
        assert_eq!(next_rkey(0xffff_ffff), 0xffff_ff00);
    }
}
