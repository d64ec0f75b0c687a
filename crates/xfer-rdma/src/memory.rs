//! Region memory: the bytes a fabric reads and writes on behalf of remote peers.
//!
//! Region memory behaves like DMA memory: the NIC (verbs fabric) or the TCP fabric's socket tasks
//! read and write it concurrently with each other and with local applications that share a `file`
//! or `shm` mapping. Rust references cannot describe that, so this type lives in the one crate that
//! may use `unsafe` (raw-pointer copies, slices that exist only inside one socket call) and
//! exposes a small safe API whose contract is spelled out below.
//!
//! # Contract
//! * The mapping stays valid for as long as any `Arc<RegionMemory>` exists; every in-flight work
//!   request holds one (the agent's `fabric::WorkRequest`; on verbs also the QP's in-flight list,
//!   through `mr::Mr`, feature `verbs`), so memory is never unmapped under a posted WR.
//! * Every accessor bounds-checks `offset + len` (with overflow checks) before touching memory.
//! * Concurrent writes to overlapping bytes give unspecified (torn) bytes, exactly as overlapping
//!   RDMA operations do; the agent never relies on the contents of bytes that are being written.
//! * A file-backed mapping whose file shrinks is *poisoned* ([`crate::sigbus`]): the missing
//!   pages read as zeros and swallow writes instead of raising SIGBUS. `read_at`/`write_at` check
//!   [`RegionMemory::intact`] after the copy; whoever moves bytes with the zero-copy socket
//!   operations must do the same before trusting, returning or acknowledging them.
//! * No safe function returns a Rust reference (`&[u8]`, `&mut [u8]`) into the mapping: safe code
//!   reaches region memory only through raw copies (`read_at` = copy out, `write_at` = copy in)
//!   and the zero-copy socket operations ([`crate::scatter`]'s reads and [`crate::gather`]'s
//!   writes), where a slice exists only inside one read or write call. Bytes that other parties change concurrently are therefore never observed through a
//!   reference that Rust assumes to be stable across user code.
use std::fs::File;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

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

/// Error for memory whose file shrank under its mapping (see [`crate::sigbus`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the file shrank under its mapping")]
pub struct Poisoned;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
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
    ReadOnly {
        _map: Mmap,
    },
}

/// A mapping of region memory (anonymous, file-backed or shared-memory object).
pub struct RegionMemory {
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
    /// Registered with the SIGBUS registry (file and shm mappings). Declared before `backing`
    /// so it is dropped (unregistered) before the memory is unmapped.
    sigbus: Option<crate::sigbus::Guard>,
    /// The mapped file (a duplicate descriptor), for file and shm mappings: a truncation inside
    /// the last page raises no SIGBUS (the page still exists), so [`RegionMemory::intact`] also
    /// compares the file's size with the mapping.
    file: Option<File>,
    /// Set once the file was seen shorter than the mapping (sticky, like SIGBUS poisoning).
    short: std::sync::atomic::AtomicBool,
    backing: Backing,
}

impl std::fmt::Debug for RegionMemory {
    // No address: on verbs it is the registered address peers would aim at, and it leaves the
    // agent only in a grant, to the peer it is granted to. Registrations and work requests print through this.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionMemory").field("len", &self.len).field("writable", &self.writable).finish()
    }
}

// SAFETY: RegionMemory owns its mapping and only hands out raw access through bounds-checked
// accessors; the memory is shared with hardware and other processes by design (see the module
// contract), so moving or sharing the handle between threads adds no new hazard.
unsafe impl Send for RegionMemory {}
// SAFETY: as above; all mutation goes through raw pointers under the module contract.
unsafe impl Sync for RegionMemory {}

/// Anonymous regions at least this long ask for transparent huge pages (one huge page).
const THP_MIN: usize = 2 << 20;

impl RegionMemory {
    /// Private, zeroed anonymous memory. `hugepages` asks for MAP_HUGETLB (2 MiB pages).
    pub fn anonymous(len: usize, hugepages: bool) -> io::Result<Self> {
        let mut opts = MmapOptions::new();
        opts.len(len);
        if hugepages {
            opts.huge(None);
        }
        let map = opts.map_anon()?;
        if !hugepages && len >= THP_MIN {
            // Transparent huge pages where the host allows them on request (`madvise`, the
            // common default): a KV pool is touched in small blocks at random places, and with
            // 4 KiB pages each block costs a TLB miss in every copy into or out of it (the
            // kernel's socket copies, the landing stores) and, on a NIC, a translation entry.
            // A hint only: a host with huge pages off keeps 4 KiB pages.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
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
            Self {
                ptr,
                len,
                writable: false,
                sigbus: None,
                file: None,
                short: Default::default(),
                backing: Backing::ReadOnly { _map: map },
            }
        };
        mem.sigbus = Some(crate::sigbus::register(mem.ptr.as_ptr() as usize, mem.len)?);
        mem.file = Some(file.try_clone()?);
        Ok(mem)
    }

    fn from_mut(mut map: MmapMut) -> Self {
        let len = map.len();
        // An mmap never returns address 0 on success; dangling() is only reached for len 0,
        // which callers reject before mapping.
        let ptr = NonNull::new(map.as_mut_ptr()).unwrap_or(NonNull::dangling());
        Self { ptr, len, writable: true, sigbus: None, file: None, short: Default::default(), backing: Backing::Writable(map) }
    }

    /// True once the file under this mapping shrank and a page beyond its end was touched, or
    /// [`RegionMemory::intact`] saw the file shorter than the mapping. Sticky: the region must be
    /// recreated.
    pub fn poisoned(&self) -> bool {
        self.short.load(std::sync::atomic::Ordering::Acquire) || self.sigbus.as_ref().is_some_and(|g| g.poisoned())
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
            return Err(Poisoned);
        }
        // A file cut inside its last mapped page raises no SIGBUS for that page: compare sizes
        // (one fstat; if it fails, nothing can be told and the SIGBUS check stands).
        if let Some(f) = &self.file {
            if f.metadata().is_ok_and(|m| m.len() < self.len as u64) {
                self.short.store(true, std::sync::atomic::Ordering::Release);
                return Err(Poisoned);
            }
        }
        Ok(())
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

    /// Copies bytes out of the mapping (a raw copy: no reference into the mapping is formed);
    /// `Poisoned` if the file shrank (then `buf` holds zeros where the file is missing and must
    /// not be used).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), MemError> {
        if self.poisoned() {
            return Err(MemError::Poisoned);
        }
        self.read_at_poll(offset, buf)?;
        Ok(self.intact()?)
    }

    /// [`RegionMemory::read_at`] for polling loops: checks the SIGBUS guard's flag (one atomic
    /// load) but not the file's size (an `fstat`), so bytes of a file cut inside its last page
    /// read as zeros here instead of failing. For memory read again and again where a stale or
    /// zero read is caught by the reader's own protocol (a seqlock, a stamp compared to what is
    /// expected); [`RegionMemory::read_at`] otherwise.
    pub fn read_at_poll(&self, offset: u64, buf: &mut [u8]) -> Result<(), MemError> {
        let start = self.check(offset, buf.len() as u64)?;
        // SAFETY: `start + buf.len()` lies within the live mapping (checked above; the mapping
        // outlives `&self`). `ptr::copy` has memmove semantics, so it is sound even if `buf` were
        // to overlap the mapping. Racing writers (NIC, peers, other processes) may tear the bytes,
        // which the module contract allows; no Rust reference to the mapping is created.
        unsafe { std::ptr::copy(self.ptr.as_ptr().add(start), buf.as_mut_ptr(), buf.len()) };
        self.guarded()
    }

    /// Copies bytes into the mapping (a raw copy); `Poisoned` if the file shrank (the bytes may be
    /// lost).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<(), MemError> {
        if !self.writable {
            return Err(ReadOnly.into());
        }
        if self.poisoned() {
            return Err(MemError::Poisoned);
        }
        let start = self.check(offset, data.len() as u64)?;
        // SAFETY: within the live, writable mapping (checked above); memmove semantics as in
        // `read_at`. Concurrent access by others is the DMA-like sharing of the module contract.
        unsafe { std::ptr::copy(data.as_ptr(), self.ptr.as_ptr().add(start), data.len()) };
        Ok(self.intact()?)
    }

    /// Writes `byte` over the whole region, a MiB at a time through [`Self::write_at`]. A
    /// benchmark's memory is filled before any clock starts: untouched anonymous memory reads as
    /// the kernel's one shared zero page, always in the cache, which would flatter every copy
    /// out of it.
    pub fn fill(&self, byte: u8) -> Result<(), MemError> {
        let chunk = vec![byte; 1 << 20];
        let mut at = 0u64;
        while at < self.len() {
            let n = (self.len() - at).min(chunk.len() as u64) as usize;
            self.write_at(at, &chunk[..n])?;
            at += n as u64;
        }
        Ok(())
    }

    /// The address of `offset..offset + len` of a writable mapping (bounds checked), for [`crate::landing`].
    pub(crate) fn range_mut_ptr(&self, offset: u64, len: usize) -> Result<*mut u8, MemError> {
        if !self.writable {
            return Err(ReadOnly.into());
        }
        let start = self.check(offset, len as u64)?;
        // `start <= self.len` (checked above): the pointer stays inside the mapping or one past its
        // end, so `wrapping_add` computes exactly what `add` would, without `unsafe`.
        Ok(self.ptr.as_ptr().wrapping_add(start))
    }

    /// `offset..offset + len` of the mapping as a shared slice (bounds checked), for the gathered
    /// writes of [`crate::gather`] (many such slices in one vectored write).
    /// # Safety
    /// The slice must not outlive the one `poll_write_vectored` it is made for: others change
    /// these bytes at any time (the module contract).
    pub(crate) unsafe fn transient_slice(&self, offset: u64, len: usize) -> Result<&[u8], OutOfRange> {
        let start = self.check(offset, len as u64)?;
        // SAFETY: `start + len` lies within the live mapping (checked above), which outlives
        // `&self`; how long the slice may live is the caller's contract (see `# Safety`).
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(start), len) })
    }

    /// `offset..offset + len` of a writable mapping as a mutable slice (bounds and writability
    /// checked), for the zero-copy receives of [`crate::scatter`].
    /// # Safety
    /// The slice must not outlive the one read call it is made for: others change these bytes
    /// at any time (the module contract).
    // A mutable slice from `&self` is this module's contract, not an aliasing bug: the bytes are
    // shared with the NIC and peers anyway, and the slice lives for one call (`# Safety`).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn transient_slice_mut(&self, offset: u64, len: usize) -> Result<&mut [u8], MemError> {
        let dst = self.range_mut_ptr(offset, len)?;
        // SAFETY: `dst..dst + len` lies within the live, writable mapping (checked by
        // `range_mut_ptr`), which outlives `&self`; how long the slice may live is the caller's
        // contract (see `# Safety`).
        Ok(unsafe { std::slice::from_raw_parts_mut(dst, len) })
    }

    /// Flushes a file-backed mapping to its file (msync).
    pub fn flush(&self) -> io::Result<()> {
        match &self.backing {
            Backing::Writable(m) => m.flush(),
            Backing::ReadOnly { .. } => Ok(()),
        }
    }

    /// The naturally aligned `T`-sized word at `offset`, as a pointer (bounds and alignment
    /// checked; writes also need a writable mapping).
    fn word<T>(&self, offset: u64, write: bool) -> Result<*mut T, MemError> {
        let size = std::mem::size_of::<T>() as u64;
        let start = self.check(offset, size)?;
        if write && !self.writable {
            return Err(ReadOnly.into());
        }
        // SAFETY: `start + size` lies within the mapping (checked above).
        let p = unsafe { self.ptr.as_ptr().add(start) };
        if !(p as usize).is_multiple_of(std::mem::align_of::<T>()) {
            return Err(OutOfRange { offset, len: size, size: self.len as u64 }.into());
        }
        Ok(p.cast())
    }

    /// The SIGBUS guard's verdict alone (no `fstat`): the word accessors run in polling loops,
    /// and a word of a file cut inside its last page merely reads as zero, which the protocols
    /// using them (the notification ring's seqlock) reject.
    fn guarded(&self) -> Result<(), MemError> {
        if self.poisoned() {
            return Err(MemError::Poisoned);
        }
        Ok(())
    }

    /// Atomically loads the aligned 64-bit word at `offset` with `order` (shared-memory
    /// protocols between processes: the notification ring).
    pub fn load_u64(&self, offset: u64, order: Ordering) -> Result<u64, MemError> {
        let p = self.word::<u64>(offset, false)?;
        // SAFETY: `p` is aligned and inside the mapping, which lives as long as `&self`. Every
        // party to a word used this way (this crate's ring, the agent, the Python reader's
        // aligned 8-byte loads) accesses it only whole and atomically; memory the mapping's
        // other users treat as plain bytes merely reads as some value. The file shrinking under
        // it is the SIGBUS guard's case (zero pages), checked below.
        let v = unsafe { AtomicU64::from_ptr(p) }.load(order);
        self.guarded()?;
        Ok(v)
    }

    /// Atomically stores `v` into the aligned 64-bit word at `offset` with `order`.
    pub fn store_u64(&self, offset: u64, v: u64, order: Ordering) -> Result<(), MemError> {
        let p = self.word::<u64>(offset, true)?;
        // SAFETY: as in `load_u64`, on a writable mapping.
        unsafe { AtomicU64::from_ptr(p) }.store(v, order);
        self.guarded()
    }

    /// Atomically stores `v` into the aligned 32-bit word at `offset` even if the mapping is
    /// poisoned: a last word to readers (a ring's closed flag) when nothing else can be written.
    /// The store lands in the file if its page is still there, in a private zero page (the
    /// SIGBUS guard's) otherwise; either way it stays inside the mapping.
    pub fn store_u32_unguarded(&self, offset: u64, v: u32, order: Ordering) -> Result<(), MemError> {
        let p = self.word::<u32>(offset, true)?;
        // SAFETY: as in `load_u64`, on a writable mapping; a page past the file's end raises a
        // SIGBUS that the guard turns into a private zero page, so the store cannot fault.
        unsafe { AtomicU32::from_ptr(p) }.store(v, order);
        Ok(())
    }

    /// Atomically loads the aligned 32-bit word at `offset` with `order`.
    pub fn load_u32(&self, offset: u64, order: Ordering) -> Result<u32, MemError> {
        let p = self.word::<u32>(offset, false)?;
        // SAFETY: as in `load_u64`.
        let v = unsafe { AtomicU32::from_ptr(p) }.load(order);
        self.guarded()?;
        Ok(v)
    }

    /// Atomically adds `v` to the aligned 32-bit word at `offset` (wrapping); returns the
    /// previous value.
    pub fn fetch_add_u32(&self, offset: u64, v: u32, order: Ordering) -> Result<u32, MemError> {
        let p = self.word::<u32>(offset, true)?;
        // SAFETY: as in `load_u64`, on a writable mapping.
        let old = unsafe { AtomicU32::from_ptr(p) }.fetch_add(v, order);
        self.guarded()?;
        Ok(old)
    }

    /// Atomically subtracts `v` from the aligned 32-bit word at `offset` (wrapping).
    pub fn fetch_sub_u32(&self, offset: u64, v: u32, order: Ordering) -> Result<u32, MemError> {
        let p = self.word::<u32>(offset, true)?;
        // SAFETY: as in `load_u64`, on a writable mapping.
        let old = unsafe { AtomicU32::from_ptr(p) }.fetch_sub(v, order);
        self.guarded()?;
        Ok(old)
    }

    /// Sleeps while the aligned 32-bit word at `offset` holds `expected` (`FUTEX_WAIT`, shared:
    /// the word may live in a mapping of another process), for at most `timeout`. Returns when
    /// woken, when the word differs, on a signal or at the timeout; the caller re-reads the
    /// state it waits for in every case.
    pub fn futex_wait(&self, offset: u64, expected: u32, timeout: std::time::Duration) -> Result<(), MemError> {
        let p = self.word::<u32>(offset, false)?;
        let ts = nix::libc::timespec {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as nix::libc::time_t,
            tv_nsec: timeout.subsec_nanos() as nix::libc::c_long,
        };
        // SAFETY: FUTEX_WAIT only reads the aligned word at `p` (inside the live mapping) and
        // `ts` (a live local); it writes no memory. Its errors (EAGAIN: the word changed; EINTR;
        // ETIMEDOUT) all mean "look again", which the caller does.
        let _ = unsafe {
            nix::libc::syscall(nix::libc::SYS_futex, p, nix::libc::FUTEX_WAIT, expected, &ts as *const nix::libc::timespec, 0usize, 0u32)
        };
        self.guarded()
    }

    /// Wakes every process sleeping in [`RegionMemory::futex_wait`] on the word at `offset`.
    pub fn futex_wake(&self, offset: u64) -> Result<(), MemError> {
        let p = self.word::<u32>(offset, false)?;
        // SAFETY: FUTEX_WAKE touches no user memory; `p` only names the futex (aligned, inside
        // the live mapping).
        let _ = unsafe { nix::libc::syscall(nix::libc::SYS_futex, p, nix::libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;

    use super::*;

    #[test]
    fn bounds_and_overflow_are_checked() {
        let m = RegionMemory::anonymous(4096, false).unwrap();
        let mut one = [0u8; 1];
        assert!(matches!(m.read_at(4096, &mut one), Err(MemError::OutOfRange(_))));
        assert!(m.check(u64::MAX, 2).is_err());
        assert!(m.check(0, 4096).is_ok());
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
        let mut all = vec![1u8; 8192];
        m.read_at(0, &mut all).unwrap();
        assert!(all.iter().all(|&b| b == 0));
    }

    #[test]
    fn fill_covers_every_byte_and_refuses_read_only_memory() {
        // Past a MiB and not a multiple of it: the last, short chunk is written too.
        let len = (1 << 20) + 4097;
        let m = RegionMemory::anonymous(len, false).unwrap();
        m.fill(0xa5).unwrap();
        let mut all = vec![0u8; len];
        m.read_at(0, &mut all).unwrap();
        assert!(all.iter().all(|&b| b == 0xa5));
        let f = tempfile::tempfile().unwrap();
        f.set_len(4096).unwrap();
        let ro = RegionMemory::map_file(&f, 4096, false).unwrap();
        assert!(matches!(ro.fill(1), Err(MemError::ReadOnly(_))));
        let mut back = vec![9u8; 4096];
        ro.read_at(0, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 0), "a refused fill changed nothing");
    }

    /// Exactly `len` bytes of `rd` into `offset..` of `m`, through the zero-copy receive
    /// ([`RegionMemory::poll_read_scatter`] with no tail); `UnexpectedEof` if the stream ends.
    async fn recv_exact(m: &RegionMemory, rd: &mut tokio::io::DuplexStream, offset: u64, len: usize) -> io::Result<()> {
        let mut done = 0usize;
        while done < len {
            let n =
                std::future::poll_fn(|cx| m.poll_read_scatter(Pin::new(&mut *rd), cx, offset + done as u64, len - done, &mut [])).await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            done += n;
        }
        Ok(())
    }

    #[tokio::test]
    async fn zero_copy_socket_io_moves_bytes_and_checks_bounds() {
        let m = RegionMemory::anonymous(8192, false).unwrap();
        let (mut a, mut b) = tokio::io::duplex(1024);
        let payload: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        let send = async {
            use tokio::io::AsyncWriteExt;
            a.write_all(&payload).await.unwrap();
            drop(a);
        };
        let recv = recv_exact(&m, &mut b, 100, payload.len());
        let ((), r) = tokio::join!(send, recv);
        r.unwrap();
        let mut got = vec![0u8; payload.len()];
        m.read_at(100, &mut got).unwrap();
        assert_eq!(got, payload);
        // The stream ended: one more byte is UnexpectedEof, and nothing past the range moved.
        let e = recv_exact(&m, &mut b, 0, 1).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        let mut head = [9u8; 100];
        m.read_at(0, &mut head).unwrap();
        assert!(head.iter().all(|&x| x == 0));

        // Out of range, both directions: refused before any byte moves.
        let (mut c, mut d) = tokio::io::duplex(64);
        assert!(recv_exact(&m, &mut d, 8000, 193).await.is_err());
        assert!(crate::gather::write_all_gathered(&mut c, &[crate::gather::Piece::Region(&m, 8192, 1)]).await.is_err());
        // Send side: the receiver sees exactly the region's bytes.
        let (mut e1, mut e2) = tokio::io::duplex(1 << 16);
        crate::gather::write_all_gathered(&mut e1, &[crate::gather::Piece::Region(&m, 100, 5000)]).await.unwrap();
        drop(e1);
        let mut out = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut e2, &mut out).await.unwrap();
        assert_eq!(out, payload);
    }

    #[tokio::test]
    async fn zero_copy_receive_into_read_only_memory_is_refused() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(4096).unwrap();
        let m = RegionMemory::map_file(&f, 4096, false).unwrap();
        let (_a, mut b) = tokio::io::duplex(64);
        let e = recv_exact(&m, &mut b, 0, 16).await.unwrap_err();
        assert!(e.to_string().contains("read-only"), "{e}");
    }
}
