//! [`Mr`]: a memory registration that owns the memory it registers.
//!
//! Unsafe lives here because `ibv_reg_mr` takes a raw address the device may read and write until
//! the MR is deregistered: the memory must outlive the registration. An `Mr` holds an
//! `Arc<RegionMemory>` that is released only after the MR is deregistered (field order), and the
//! range is checked against the mapping before registering. sideway's `MemoryRegion` is used as
//! is: its `Drop` deregisters without asserting.
use std::sync::Arc;

use rdma_mummy_sys as sys;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;

use crate::error::VerbsError;
use crate::memory::RegionMemory;

/// `[offset, offset+len)` of a [`RegionMemory`] registered in a PD.
pub struct Mr {
    // Field order is drop order: the MR is deregistered before the memory may be unmapped.
    mr: Arc<MemoryRegion>,
    memory: Arc<RegionMemory>,
    pd: Arc<ProtectionDomain>,
    offset: u64,
    len: u64,
    flags: AccessFlags,
}

impl std::fmt::Debug for Mr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Keys are not printed (they open memory to peers).
        f.debug_struct("Mr")
            .field("memory", &self.memory)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("flags", &self.flags)
            .finish()
    }
}

impl Mr {
    /// Registers `[offset, offset+len)` of `memory` in `pd` with `flags`.
    pub fn register(
        pd: &Arc<ProtectionDomain>,
        memory: &Arc<RegionMemory>,
        offset: u64,
        len: u64,
        flags: AccessFlags,
    ) -> Result<Arc<Mr>, VerbsError> {
        let start = memory.check(offset, len).map_err(|e| VerbsError::Registration(e.to_string()))?;
        if len == 0 {
            return Err(VerbsError::Registration("cannot register an empty range".into()));
        }
        let ptr = memory.as_mut_ptr() as usize + start;
        // SAFETY: [ptr, ptr+len) lies inside the live mapping (checked above). The MR is stored
        // in an `Mr` next to a clone of `memory` declared after it, so the memory is unmapped
        // only after the MR is deregistered.
        let mr = unsafe { pd.reg_mr(ptr, len as usize, flags) }.map_err(|e| {
            let os = std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default();
            let hint = if os.contains("Cannot allocate memory") || os.contains("Resource temporarily") {
                " (RLIMIT_MEMLOCK too low? raise it or grant CAP_IPC_LOCK)"
            } else {
                ""
            };
            VerbsError::Registration(format!("ibv_reg_mr({len} bytes, {flags:?}): {e}: {os}{hint}"))
        })?;
        Ok(Arc::new(Mr { mr, memory: Arc::clone(memory), pd: Arc::clone(pd), offset, len, flags }))
    }

    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// The memory the MR is over (it lives at least as long as the MR).
    pub fn memory(&self) -> &Arc<RegionMemory> {
        &self.memory
    }

    pub fn flags(&self) -> AccessFlags {
        self.flags
    }

    /// True if `[offset, offset+len)` of the memory lies inside the registered range.
    pub fn covers(&self, offset: u64, len: u64) -> bool {
        offset >= self.offset && offset.checked_add(len).is_some_and(|end| end <= self.offset + self.len)
    }

    pub(crate) fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_mr {
        // SAFETY: reading the raw pointer of our live MR; users post it while holding an
        // `Arc<Mr>` (the QP's in-flight list), so it outlives every use.
        unsafe { self.mr.mr().as_ptr() }
    }
}
