//! Memory registrations: the region MR (`Fabric::register`) and dedicated grant MRs
//! (`GrantMode::Mr`). sideway's `MemoryRegion` is used as is: its `Drop` deregisters without
//! asserting.
use std::sync::Arc;
use std::time::Instant;

use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;

use super::memory::RegionMemory;
use crate::fabric::{Access, FabricError, Registration, RemoteOp};

/// Access flags for a region MR from its ceiling. REMOTE_WRITE requires LOCAL_WRITE, which
/// requires writable memory.
pub(crate) fn region_flags(writable: bool, ceiling: Access) -> Result<AccessFlags, FabricError> {
    let mut flags = AccessFlags::none();
    if writable {
        flags |= AccessFlags::LocalWrite;
    }
    if ceiling.allows(RemoteOp::Read) {
        flags |= AccessFlags::RemoteRead;
    }
    if ceiling.allows(RemoteOp::Write) {
        if !writable {
            return Err(FabricError::Registration(format!(
                "access ceiling {ceiling} allows remote writes but the memory is mapped read-only"
            )));
        }
        flags |= AccessFlags::RemoteWrite;
    }
    Ok(flags)
}

/// Registers `[addr, addr+len)` of `memory` (already bounds-checked by the caller).
pub(crate) fn reg(
    pd: &Arc<ProtectionDomain>,
    memory: &RegionMemory,
    offset: u64,
    len: u64,
    flags: AccessFlags,
) -> Result<Arc<MemoryRegion>, FabricError> {
    let start = memory.check(offset, len).map_err(|e| FabricError::Registration(e.to_string()))?;
    if len == 0 {
        return Err(FabricError::Registration("cannot register an empty range".into()));
    }
    let ptr = memory.as_mut_ptr() as usize + start;
    // SAFETY: [ptr, ptr+len) lies inside the live mapping (checked above). The returned MR is
    // always stored next to an Arc<RegionMemory> declared after it (VerbsRegistration,
    // GrantMr), so the memory is unmapped only after the MR is deregistered.
    unsafe { pd.reg_mr(ptr, len as usize, flags) }.map_err(|e| {
        let os = std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default();
        let hint = if os.contains("Cannot allocate memory") || os.contains("Resource temporarily") {
            " (RLIMIT_MEMLOCK too low? raise it or grant CAP_IPC_LOCK)"
        } else {
            ""
        };
        FabricError::Registration(format!("ibv_reg_mr({len} bytes, {flags:?}): {e}: {os}{hint}"))
    })
}

/// A region registered with the device.
pub(crate) struct VerbsRegistration {
    // Field order is drop order: the MR is deregistered before the memory may be unmapped.
    pub mr: Arc<MemoryRegion>,
    pub memory: Arc<RegionMemory>,
    pub access: Access,
    pub flags: AccessFlags,
}

impl std::fmt::Debug for VerbsRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsRegistration")
            .field("memory", &self.memory)
            .field("access", &self.access)
            .field("flags", &self.flags)
            .finish()
    }
}

impl VerbsRegistration {
    /// `mw_bind`: also allow memory windows to be bound to the MR (grant mode `mw`).
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        memory: Arc<RegionMemory>,
        access: Access,
        mw_bind: bool,
    ) -> Result<Self, FabricError> {
        let mut flags = region_flags(memory.writable(), access)?;
        if mw_bind {
            flags |= AccessFlags::MemoryWindowBind;
        }
        let started = Instant::now();
        let mr = reg(pd, &memory, 0, memory.len(), flags)?;
        crate::metrics::registration_duration(started.elapsed());
        Ok(VerbsRegistration { mr, memory, access, flags })
    }
}

impl Registration for VerbsRegistration {
    fn memory(&self) -> &Arc<RegionMemory> {
        &self.memory
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
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A dedicated MR over exactly one granted range; dropping it deregisters (revokes) it.
pub(crate) struct GrantMr {
    pub _mr: Arc<MemoryRegion>,
    pub _memory: Arc<RegionMemory>,
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn flags_follow_the_ceiling() {
        let f = region_flags(true, Access::ReadWrite).unwrap();
        assert_eq!(f, AccessFlags::LocalWrite | AccessFlags::RemoteRead | AccessFlags::RemoteWrite);
        let f = region_flags(true, Access::Read).unwrap();
        assert_eq!(f, AccessFlags::LocalWrite | AccessFlags::RemoteRead);
        let f = region_flags(false, Access::Read).unwrap();
        assert_eq!(f, AccessFlags::RemoteRead);
        let f = region_flags(true, Access::Write).unwrap();
        assert_eq!(f, AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        assert!(region_flags(false, Access::Write).is_err());
        assert!(region_flags(false, Access::ReadWrite).is_err());
    }
}
