//! Region memory: the bytes a fabric reads and writes on behalf of remote peers.
//!
//! Region memory behaves like DMA memory: the NIC (verbs fabric) or the TCP fabric's socket tasks
//! read and write it concurrently with each other and with local applications that share a `file`
//! or `shm` mapping. Rust references cannot describe that, so this type lives in the one module that
//! may use `unsafe` and exposes a small API whose contract is spelled out below.
//!
//! # Contract
//! * The mapping stays valid for as long as any `Arc<RegionMemory>` exists; every in-flight work
//!   request holds one (see `fabric::WorkRequest`), so memory is never unmapped under a posted WR.
//! * Every accessor bounds-checks `offset + len` (with overflow checks) before touching memory.
//! * Concurrent writes to overlapping bytes give unspecified (torn) bytes, exactly as overlapping
//!   RDMA operations do; the agent never relies on the contents of bytes that are being written.
//! * A file-backed mapping whose file shrinks is *poisoned* ([`super::sigbus`]): the missing
//!   pages read as zeros and swallow writes instead of raising SIGBUS. `read_at`/`write_at` check
//!   [`RegionMemory::intact`] after the copy; whoever copies through `slice`/`slice_mut` must do
//!   the same before trusting, returning or acknowledging the bytes.
use std::fs::File;
use std::io;
use std::ptr::NonNull;

use memmap2::{Mmap, MmapMut, MmapOptions};

/// Error for an access outside the mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("range {offset}+{len} is outside memory of {size} bytes")]
pub struct OutOfRange {
    pub offset: u64,
    pub len: u64,
    pub size: u64,
}

/// Error for writing into memory that is mapped read-only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("memory is mapped read-only")]
pub struct ReadOnly;

/// Error for memory whose file shrank under its mapping (see [`super::sigbus`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the file shrank under its mapping")]
pub struct Poisoned;

#[derive(Debug, thiserror::Error)]
pub enum MemError {
    #[error(transparent)]
    OutOfRange(#[from] OutOfRange),
    #[error(transparent)]
    ReadOnly(#[from] ReadOnly),
    #[error("the file shrank under its mapping")]
    Poisoned,
}

impl From<Poisoned> for MemError {
    fn from(_: Poisoned) -> Self {
        MemError::Poisoned
    }
}

enum Backing {
    Writable(MmapMut),
    /// Held only to keep the read-only mapping alive.
    ReadOnly { _map: Mmap },
}

/// A mapping of region memory (anonymous, file-backed or shared-memory object).
pub struct RegionMemory {
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
    /// Registered with the SIGBUS registry (file and shm mappings). Declared before `backing`
    /// so it is dropped (unregistered) before the memory is unmapped.
    sigbus: Option<super::sigbus::Guard>,
    backing: Backing,
}

impl std::fmt::Debug for RegionMemory {
    // No address: on verbs it is the registered address peers would aim at, and it leaves the
    // agent only in a grant (DESIGN §8). Registrations and work requests print through this.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionMemory")
            .field("len", &self.len)
            .field("writable", &self.writable)
            .finish()
    }
}

// SAFETY: RegionMemory owns its mapping and only hands out raw access through bounds-checked
// accessors; the memory is shared with hardware and other processes by design (see the module
// contract), so moving or sharing the handle between threads adds no new hazard.
unsafe impl Send for RegionMemory {}
// SAFETY: as above; all mutation goes through raw pointers under the module contract.
unsafe impl Sync for RegionMemory {}

impl RegionMemory {
    /// Private, zeroed anonymous memory. `hugepages` asks for MAP_HUGETLB (2 MiB pages).
    pub fn anonymous(len: usize, hugepages: bool) -> io::Result<Self> {
        let mut opts = MmapOptions::new();
        opts.len(len);
        if hugepages {
            opts.huge(None);
        }
        let map = opts.map_anon()?;
        Ok(Self::from_mut(map))
    }

    /// Shared mapping of the first `len` bytes of `file`. Writes reach the file (and other
    /// processes mapping it). The caller checked that the file is at least `len` bytes long.
    /// The mapping is registered with the SIGBUS registry: if the file shrinks later, the memory
    /// becomes poisoned instead of killing the agent.
    pub fn map_file(file: &File, len: usize, writable: bool) -> io::Result<Self> {
        let mut opts = MmapOptions::new();
        opts.len(len);
        let mut mem = if writable {
            // SAFETY: the mapping is shared with other processes by design (file and shm
            // regions); concurrent modification by them is part of the module contract and we
            // never create long-lived Rust references into the mapping. Truncation by them is
            // handled by the SIGBUS registry entered below.
            let map = unsafe { opts.map_mut(file)? };
            Self::from_mut(map)
        } else {
            // SAFETY: as above, read-only.
            let map = unsafe { opts.map(file)? };
            let ptr = NonNull::new(map.as_ptr() as *mut u8).ok_or_else(|| io::Error::other("null mapping"))?;
            Self { ptr, len, writable: false, sigbus: None, backing: Backing::ReadOnly { _map: map } }
        };
        mem.sigbus = Some(super::sigbus::register(mem.ptr.as_ptr() as usize, mem.len)?);
        Ok(mem)
    }

    fn from_mut(mut map: MmapMut) -> Self {
        let len = map.len();
        // An mmap never returns address 0 on success; dangling() is only reached for len 0,
        // which callers reject before mapping.
        let ptr = NonNull::new(map.as_mut_ptr()).unwrap_or(NonNull::dangling());
        Self { ptr, len, writable: true, sigbus: None, backing: Backing::Writable(map) }
    }

    /// True once the file under this mapping shrank and a page beyond its end was touched.
    /// Sticky: the region must be recreated.
    pub fn poisoned(&self) -> bool {
        self.sigbus.as_ref().is_some_and(|g| g.poisoned())
    }

    /// Whether a copy in or out of this memory can hit a truncated file (file and shm mappings).
    /// The TCP fabric copies such memory through a buffer so the fault is taken in the agent, not
    /// turned into EFAULT by a socket system call.
    pub fn can_shrink(&self) -> bool {
        self.sigbus.is_some()
    }

    /// `Err(Poisoned)` if the memory is poisoned. Call it *after* copying through `slice` or
    /// `slice_mut`: bytes copied before it returns `Ok` are the file's.
    pub fn intact(&self) -> Result<(), Poisoned> {
        if self.poisoned() {
            Err(Poisoned)
        } else {
            Ok(())
        }
    }

    pub fn len(&self) -> u64 {
        self.len as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn writable(&self) -> bool {
        self.writable
    }

    /// Virtual address of the first byte: the base of the region's registered address space.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Raw base pointer, for registering the memory with a device.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Checks `offset..offset+len` against the mapping and returns the start as usize.
    pub fn check(&self, offset: u64, len: u64) -> Result<usize, OutOfRange> {
        let err = OutOfRange { offset, len, size: self.len as u64 };
        let end = offset.checked_add(len).ok_or(err)?;
        if end > self.len as u64 {
            return Err(err);
        }
        Ok(offset as usize)
    }

    /// Copies bytes out of the mapping; `Poisoned` if the file shrank (then `buf` holds zeros
    /// where the file is missing and must not be used).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), MemError> {
        self.intact()?;
        buf.copy_from_slice(self.slice(offset, buf.len() as u64)?);
        Ok(self.intact()?)
    }

    /// Copies bytes into the mapping; `Poisoned` if the file shrank (the bytes may be lost).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), MemError> {
        self.intact()?;
        self.slice_mut(offset, data.len() as u64)?.copy_from_slice(data);
        Ok(self.intact()?)
    }

    /// A view of `len` bytes at `offset`, used to send them (socket write, checksum) without a
    /// copy. Keep it short-lived: remote peers may write the same bytes meanwhile (module contract).
    pub fn slice(&self, offset: u64, len: u64) -> Result<&[u8], OutOfRange> {
        let start = self.check(offset, len)?;
        // SAFETY: start+len is within the live mapping (checked above) and the mapping outlives
        // `&self`; racing writers may change the bytes, which the module contract allows.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(start), len as usize) })
    }

    /// A mutable view of `len` bytes at `offset`, used to receive bytes straight from a socket
    /// into region memory (no bounce buffer). Short-lived; see the module contract.
    #[allow(clippy::mut_from_ref)]
    pub fn slice_mut(&self, offset: u64, len: u64) -> Result<&mut [u8], MemError> {
        if !self.writable {
            return Err(ReadOnly.into());
        }
        let start = self.check(offset, len)?;
        // SAFETY: within the live, writable mapping (checked above). Aliasing with other views
        // of the same bytes is the DMA-like sharing the module contract describes.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(start), len as usize) })
    }

    /// Flushes a file-backed mapping to its file (msync).
    pub fn flush(&self) -> io::Result<()> {
        match &self.backing {
            Backing::Writable(m) => m.flush(),
            Backing::ReadOnly { .. } => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_and_overflow_are_checked() {
        let m = RegionMemory::anonymous(4096, false).unwrap();
        assert!(m.slice(4096, 1).is_err());
        assert!(m.slice(u64::MAX, 2).is_err());
        assert!(m.slice(0, 4096).is_ok());
        m.write_at(10, b"abc").unwrap();
        let mut b = [0u8; 3];
        m.read_at(10, &mut b).unwrap();
        assert_eq!(&b, b"abc");
        assert!(matches!(m.write_at(4095, b"xy"), Err(MemError::OutOfRange(_))));
    }

    #[test]
    fn read_only_file_mapping_refuses_writes() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(8192).unwrap();
        let m = RegionMemory::map_file(&f, 8192, false).unwrap();
        assert!(matches!(m.write_at(0, b"x"), Err(MemError::ReadOnly(_))));
        assert!(m.slice(0, 8192).is_ok());
    }
}
