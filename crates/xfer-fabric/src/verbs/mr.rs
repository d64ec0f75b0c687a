//! Memory registrations: the region MR (`Fabric::register`) and its access flags per grant mode.
//! The MR itself (registration, and the memory it keeps alive) is `xfer_rdma::mr::Mr`; grant mode
//! `mr` registers a dedicated `Mr` per grant (`fabric::expose_now`).
use std::sync::Arc;

use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;
use xfer_rdma::memory::RegionMemory;
use xfer_rdma::mr::Mr;

use super::options::GrantMode;
use crate::{Access, FabricError, Registration, RemoteOp};

/// Access flags for a region MR in grant mode `mode` (remote memory only through grants).
///
/// * `mr`, `mw`: **local access only**. Only grants give remote access: a dedicated grant MR per
///   grant (`mr`), or type-2 windows bound to this MR (`mw`, which adds MW_BIND). A type-2 window
///   may carry remote access the MR lacks; a remote WRITE window needs LOCAL_WRITE on the MR
///   (IB spec C10-76, rxe's `rxe_check_bind_mw`), which writable memory has.
/// * `region`: the region MR itself is handed out, so it carries REMOTE_READ / REMOTE_WRITE from
///   the ceiling (the documented "fastest, least scoped" mode).
///
/// LOCAL_WRITE whenever the memory is writable (the agent READs into its own regions). A remote
/// write ceiling on read-only memory is refused in every mode, as grants could never honour it.
pub(crate) fn region_flags(writable: bool, ceiling: Access, mode: GrantMode) -> Result<AccessFlags, FabricError> {
    if ceiling.allows(RemoteOp::Write) && !writable {
        return Err(FabricError::Registration(format!("access ceiling {ceiling} allows remote writes but the memory is mapped read-only")));
    }
    let mut flags = AccessFlags::none();
    if writable {
        flags |= AccessFlags::LocalWrite;
    }
    match mode {
        GrantMode::Mr => {}
        GrantMode::Mw => flags |= AccessFlags::MemoryWindowBind,
        GrantMode::Region => {
            if ceiling.allows(RemoteOp::Read) {
                flags |= AccessFlags::RemoteRead;
            }
            if ceiling.allows(RemoteOp::Write) {
                // REMOTE_WRITE requires LOCAL_WRITE: set above (writable was checked).
                flags |= AccessFlags::RemoteWrite;
            }
        }
    }
    Ok(flags)
}

/// True if an MR with `flags` answers remote READs or WRITEs with its own rkey.
pub(crate) fn remote_access(flags: AccessFlags) -> bool {
    flags.contains(AccessFlags::RemoteRead) || flags.contains(AccessFlags::RemoteWrite)
}

/// A region registered with the device. Its MR has remote access only in grant mode `region`
/// (see [`region_flags`]).
pub(crate) struct VerbsRegistration {
    /// The MR over the whole memory (it owns the memory: see `xfer_rdma::mr`).
    pub mr: Arc<Mr>,
    pub access: Access,
    pub flags: AccessFlags,
}

impl std::fmt::Debug for VerbsRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsRegistration")
            .field("memory", self.mr.memory())
            .field("access", &self.access)
            .field("flags", &self.flags)
            .finish()
    }
}

impl VerbsRegistration {
    /// Registers the whole of `memory` with the flags grant mode `mode` calls for.
    pub fn new(pd: &Arc<ProtectionDomain>, memory: Arc<RegionMemory>, access: Access, mode: GrantMode) -> Result<Self, FabricError> {
        let flags = region_flags(memory.writable(), access, mode)?;
        // Timed by the caller (`regions`, xfer_registration_duration_seconds on every fabric).
        let mr = Mr::register(pd, &memory, 0, memory.len(), flags)?;
        Ok(VerbsRegistration { mr, access, flags })
    }
}

impl Registration for VerbsRegistration {
    fn memory(&self) -> &Arc<RegionMemory> {
        self.mr.memory()
    }
    fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
    fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
    fn access(&self) -> Access {
        self.access
    }
    fn remote_key_exposed(&self) -> bool {
        remote_access(self.flags)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn region_mode_flags_follow_the_ceiling() {
        let m = GrantMode::Region;
        let f = region_flags(true, Access::ReadWrite, m).unwrap();
        assert_eq!(f, AccessFlags::LocalWrite | AccessFlags::RemoteRead | AccessFlags::RemoteWrite);
        let f = region_flags(true, Access::Read, m).unwrap();
        assert_eq!(f, AccessFlags::LocalWrite | AccessFlags::RemoteRead);
        let f = region_flags(false, Access::Read, m).unwrap();
        assert_eq!(f, AccessFlags::RemoteRead);
        let f = region_flags(true, Access::Write, m).unwrap();
        assert_eq!(f, AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        assert!(region_flags(false, Access::Write, m).is_err());
        assert!(region_flags(false, Access::ReadWrite, m).is_err());
        for access in [Access::Read, Access::Write, Access::ReadWrite] {
            assert!(remote_access(region_flags(true, access, m).unwrap()), "{access}");
        }
    }

    #[test]
    fn mr_mode_region_mr_is_local_only() {
        let m = GrantMode::Mr;
        for access in [Access::Read, Access::Write, Access::ReadWrite] {
            let f = region_flags(true, access, m).unwrap();
            assert_eq!(f, AccessFlags::LocalWrite, "{access}");
            assert!(!remote_access(f));
        }
        // Read-only memory: not even LOCAL_WRITE.
        let f = region_flags(false, Access::Read, m).unwrap();
        assert_eq!(f, AccessFlags::none());
        assert!(!remote_access(f));
        assert!(region_flags(false, Access::Write, m).is_err());
        assert!(region_flags(false, Access::ReadWrite, m).is_err());
    }

    #[test]
    fn mw_mode_region_mr_is_local_only_plus_window_bind() {
        let m = GrantMode::Mw;
        for access in [Access::Read, Access::Write, Access::ReadWrite] {
            let f = region_flags(true, access, m).unwrap();
            // LOCAL_WRITE: remote WRITE windows need it on the MR (C10-76).
            assert_eq!(f, AccessFlags::LocalWrite | AccessFlags::MemoryWindowBind, "{access}");
            assert!(!remote_access(f));
        }
        let f = region_flags(false, Access::Read, m).unwrap();
        assert_eq!(f, AccessFlags::MemoryWindowBind);
        assert!(!remote_access(f));
        assert!(region_flags(false, Access::Write, m).is_err());
        assert!(region_flags(false, Access::ReadWrite, m).is_err());
    }
}
