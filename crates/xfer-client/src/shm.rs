//! Shared-memory regions mapped into the caller's process: the agent creates (and registers)
//! the object under `/dev/shm`, this process maps the same object, and bytes written here are
//! the bytes the agent moves — no copy through gRPC. The mapping is
//! `xfer_rdma::memory::RegionMemory` (the workspace's one unsafe crate): bounds-checked raw
//! copies in and out, a SIGBUS guard should the object shrink, and never a `&mut [u8]` over
//! memory the NIC, the agent or a peer may change at the same time.
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use xfer_rdma::memory::RegionMemory;

use crate::{Error, Region, RegionKind, Result};

/// Where POSIX shared-memory objects live.
const SHM_DIR: &str = "/dev/shm";

/// A shared-memory region of the agent, mapped here.
pub struct ShmRegion {
    region: Region,
    mem: RegionMemory,
}

impl std::fmt::Debug for ShmRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmRegion").field("region", &self.region).finish_non_exhaustive()
    }
}

impl ShmRegion {
    pub(crate) fn map(region: Region) -> Result<ShmRegion> {
        if region.kind != RegionKind::Shm {
            return Err(Error::InvalidArgument(format!("region {:?} is not a shared-memory region", region.name)));
        }
        // An object name, never a path: the agent's own rule, checked again here.
        if region.path.is_empty() || region.path.contains('/') || region.path.starts_with('.') {
            return Err(Error::Protocol(format!("shared-memory object name {:?}", region.path)));
        }
        let path = PathBuf::from(SHM_DIR).join(&region.path);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
        let len = usize::try_from(region.length).map_err(|_| Error::InvalidArgument("region too large for this process".into()))?;
        let on_disk = file.metadata().map_err(|e| Error::io(path.display(), e))?.len();
        if on_disk < region.length {
            return Err(Error::FailedPrecondition(format!("{} is {on_disk} bytes, the region {}", path.display(), region.length)));
        }
        let mem = RegionMemory::map_file(&file, len, true).map_err(|e| Error::io(format!("mapping {}", path.display()), e))?;
        Ok(ShmRegion { region, mem })
    }

    /// The region as the agent describes it.
    pub fn region(&self) -> &Region {
        &self.region
    }

    pub fn name(&self) -> &str {
        &self.region.name
    }

    pub fn len(&self) -> u64 {
        self.mem.len()
    }

    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }

    /// Copies `data` into the region at `offset`.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.mem.write_at(offset, data).map_err(|e| mem_error(&self.region, e))
    }

    /// Copies `buf.len()` bytes of the region at `offset` into `buf`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.mem.read_at(offset, buf).map_err(|e| mem_error(&self.region, e))
    }

    /// `len` bytes of the region at `offset`, copied out.
    pub fn read_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read_at(offset, &mut v)?;
        Ok(v)
    }
}

fn mem_error(r: &Region, e: xfer_rdma::memory::MemError) -> Error {
    match e {
        xfer_rdma::memory::MemError::OutOfRange(e) => Error::InvalidArgument(format!("region {:?}: {e}", r.name)),
        e => Error::FailedPrecondition(format!("region {:?}: {e}", r.name)),
    }
}
