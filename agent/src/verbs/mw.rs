//! Type-2 memory windows: grant mode `mw` (DESIGN §2).
//!
//! A grant binds one window per responder QP of the grantee's connection (a type-2 window only
//! answers accesses that arrive on the QP it was bound on, and transfers stripe over every QP of
//! a connection). The bind itself is a send WR on the responder QP; `connection::VerbsAccepted`
//! posts it and polls the responder CQ for its completion. Revocation deallocates the windows:
//! when `ibv_dealloc_mw` returns, the key is dead (an access gets REM_ACCESS_ERR).
//!
//! Windows are range-safe only on devices that check accesses against the window: rxe (6.1)
//! checks the key and the QP, but the range against the underlying MR (DESIGN §13).
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_mummy_sys as sys;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use super::connection::ConnInner;
use super::memory::RegionMemory;
use crate::fabric::FabricError;

/// One type-2 memory window. Dropping it deallocates it, which also invalidates its key.
pub(crate) struct Mw {
    mw: NonNull<sys::ibv_mw>,
    // Deallocated in Drop before the PD can be released.
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: a window is only read (its key) and mutated (`set_rkey`) by the binder, which holds the
// connection's bind lock; `ibv_dealloc_mw` in Drop runs with exclusive access. libibverbs objects
// may be used from any thread.
unsafe impl Send for Mw {}
// SAFETY: as above.
unsafe impl Sync for Mw {}

/// The next key of a window: the same index (upper 24 bits), the 8-bit tag incremented
/// (`ibv_inc_rkey`, without its overflow on `0xffff_ffff`).
pub(crate) fn next_rkey(rkey: u32) -> u32 {
    (rkey & !0xff) | ((rkey as u8).wrapping_add(1) as u32)
}

impl Mw {
    /// Allocates an unbound type-2 window in `pd`.
    pub fn alloc(pd: &Arc<ProtectionDomain>) -> Result<Mw, FabricError> {
        // SAFETY: reading the raw pointer of a live PD (we keep an Arc) and its context's ops
        // table. `ibv_alloc_mw` checks `alloc_mw` itself; `ibv_dealloc_mw` unwraps
        // `dealloc_mw`, so a provider without it is refused here, before anything is allocated.
        let raw = unsafe {
            let pd_ptr = pd.pd().as_ptr();
            if (*(*pd_ptr).context).ops.dealloc_mw.is_none() {
                return Err(FabricError::Registration("provider cannot deallocate memory windows".into()));
            }
            sys::ibv_alloc_mw(pd_ptr, sys::ibv_mw_type::IBV_MW_TYPE_2)
        };
        let mw = NonNull::new(raw).ok_or_else(|| {
            FabricError::Registration(format!("ibv_alloc_mw(type 2): {}", io::Error::last_os_error()))
        })?;
        Ok(Mw { mw, _pd: Arc::clone(pd) })
    }

    pub fn as_ptr(&self) -> *mut sys::ibv_mw {
        self.mw.as_ptr()
    }

    /// The window's current key (what the provider presents as "current" in the next bind).
    pub fn rkey(&self) -> u32 {
        // SAFETY: live window; reading a plain field.
        unsafe { self.mw.as_ref().rkey }
    }

    /// Records the key a bind has installed. rxe's provider does not update `mw->rkey` after a
    /// type-2 bind posted with `ibv_wr_bind_mw`, yet sends it as the current key of the next
    /// bind, and the kernel refuses a bind whose current key does not match (DESIGN §13).
    pub fn set_rkey(&mut self, rkey: u32) {
        // SAFETY: live window; `&mut self` and the bind lock make this the only access.
        unsafe { self.mw.as_mut().rkey = rkey };
    }
}

impl Drop for Mw {
    fn drop(&mut self) {
        // SAFETY: the window is ours and allocated; `dealloc_mw` was checked to exist in `alloc`.
        // Deallocating a bound window invalidates it: its key answers REM_ACCESS_ERR from here on.
        let rc = unsafe { sys::ibv_dealloc_mw(self.mw.as_ptr()) };
        if rc != 0 {
            tracing::error!(error = %io::Error::from_raw_os_error(rc), "ibv_dealloc_mw failed; leaking the memory window");
        }
    }
}

/// What an `mw` grant keeps alive; dropping it revokes the grant.
pub(crate) struct MwGrant {
    // Field order is drop order: the windows are deallocated (their keys die) first; then the MR
    // they were bound to may be deregistered and the memory unmapped; then the responder QPs may
    // be destroyed.
    pub windows: Vec<Mw>,
    pub _mr: Arc<MemoryRegion>,
    pub _memory: Arc<RegionMemory>,
    pub _conn: Arc<ConnInner>,
}

impl MwGrant {
    pub fn rkeys(&self) -> Vec<u32> {
        self.windows.iter().map(Mw::rkey).collect()
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
