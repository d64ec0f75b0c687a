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
        let mem = map_object(&region.path, region.length)?;
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

    /// [`ShmRegion::read_at`] for polling loops (a flag or a stamp read again and again): no
    /// `fstat` per call, so bytes of an object cut inside its last page read as zeros instead
    /// of failing; a cut that raised SIGBUS still fails.
    pub fn read_at_poll(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.mem.read_at_poll(offset, buf).map_err(|e| mem_error(&self.region, e))
    }

    /// `len` bytes of the region at `offset`, copied out.
    pub fn read_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read_at(offset, &mut v)?;
        Ok(v)
    }
}

/// Maps the agent's shm object `object` (a name under /dev/shm, never a path), which must be a
/// regular file of at least `length` bytes, read-write.
pub(crate) fn map_object(object: &str, length: u64) -> Result<RegionMemory> {
    // An object name, never a path: the agent's own rule, checked again here.
    if object.is_empty() || object.contains('/') || object.starts_with('.') {
        return Err(Error::Protocol(format!("shared-memory object name {object:?}")));
    }
    let path = PathBuf::from(SHM_DIR).join(object);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    let len = usize::try_from(length).map_err(|_| Error::InvalidArgument("region too large for this process".into()))?;
    let meta = file.metadata().map_err(|e| Error::io(path.display(), e))?;
    // A FIFO or socket planted under the object's name is not the agent's memory, whatever
    // length the region claims (0 included).
    if !meta.file_type().is_file() {
        return Err(Error::FailedPrecondition(format!("{} is not a regular file", path.display())));
    }
    let on_disk = meta.len();
    if on_disk < length {
        return Err(Error::FailedPrecondition(format!("{} is {on_disk} bytes, the region {length}", path.display())));
    }
    RegionMemory::map_file(&file, len, true).map_err(|e| Error::io(format!("mapping {}", path.display()), e))
}

fn mem_error(r: &Region, e: xfer_rdma::memory::MemError) -> Error {
    match e {
        xfer_rdma::memory::MemError::OutOfRange(e) => Error::InvalidArgument(format!("region {:?}: {e}", r.name)),
        e => Error::FailedPrecondition(format!("region {:?}: {e}", r.name)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn shm(path: &str, length: u64) -> Region {
        Region {
            id: "r-1".into(),
            name: "r".into(),
            length,
            kind: RegionKind::Shm,
            path: path.into(),
            access: crate::Access::ReadWrite,
            labels: Default::default(),
            created_at: None,
            expires_at: None,
            lkey: 0,
            rkey: 0,
            addr: 0,
            unavailable: None,
        }
    }

    /// An object name unique to this test run.
    fn unique(tag: &str) -> String {
        format!("xfer-client-redteam-{tag}-{}", std::process::id())
    }

    /// A region an agent (or anyone answering in its place) describes with a path, a length the
    /// object does not have, or an object that is not a regular file: refused, nothing mapped,
    /// nothing in /dev/shm created or changed.
    #[test]
    fn map_refuses_what_is_not_the_agents_object() {
        let passwd = std::fs::read("/etc/passwd").unwrap();
        for path in ["../etc/passwd", "/etc/passwd", "..", ".", "", "a/../../etc/passwd", ".hidden"] {
            assert!(matches!(ShmRegion::map(shm(path, 16)), Err(Error::Protocol(_))), "{path:?}");
        }
        assert_eq!(std::fs::read("/etc/passwd").unwrap(), passwd);

        let dir = std::path::Path::new(SHM_DIR);
        // A symlink planted under the name: not followed.
        let (link, target) = (unique("link"), unique("target"));
        std::fs::write(dir.join(&target), vec![5u8; 4096]).unwrap();
        std::os::unix::fs::symlink(dir.join(&target), dir.join(&link)).unwrap();
        assert!(ShmRegion::map(shm(&link, 4096)).is_err());
        // A FIFO: not a regular file, even for a region that claims no bytes.
        let fifo = unique("fifo");
        nix::unistd::mkfifo(&dir.join(&fifo), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        for len in [0, 4096] {
            let e = ShmRegion::map(shm(&fifo, len)).unwrap_err();
            assert!(matches!(e, Error::FailedPrecondition(_)), "{len}: {e:?}");
        }
        // Shorter than the region (a mapping past its end would SIGBUS), or impossibly long.
        let short = unique("short");
        std::fs::write(dir.join(&short), vec![1u8; 4096]).unwrap();
        for len in [4097, 1 << 40, u64::MAX] {
            assert!(ShmRegion::map(shm(&short, len)).is_err(), "{len}");
        }
        // A directory.
        let sub = unique("dir");
        std::fs::create_dir(dir.join(&sub)).unwrap();
        assert!(ShmRegion::map(shm(&sub, 0)).is_err());
        // Nothing changed.
        assert_eq!(std::fs::read(dir.join(&target)).unwrap(), vec![5u8; 4096]);
        assert_eq!(std::fs::read(dir.join(&short)).unwrap(), vec![1u8; 4096]);
        assert!(std::fs::symlink_metadata(dir.join(&link)).unwrap().file_type().is_symlink());
        // And the same object, long enough, maps.
        let ok = ShmRegion::map(shm(&short, 4096)).unwrap();
        assert_eq!(ok.read_vec(0, 4).unwrap(), vec![1u8; 4]);
        drop(ok);
        for n in [&link, &target, &fifo, &short] {
            std::fs::remove_file(dir.join(n)).unwrap();
        }
        std::fs::remove_dir(dir.join(&sub)).unwrap();
    }
}
