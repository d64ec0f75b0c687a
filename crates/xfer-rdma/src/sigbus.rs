//! Surviving SIGBUS on file-backed region memory.
//!
//! A `file` or `shm` region is a `MAP_SHARED` mapping of a file that other processes may
//! truncate. Touching a page beyond the file's new end raises SIGBUS, whose default action kills
//! the agent with every region and transfer in it. This module keeps that from happening, the
//! way databases that mmap their files do:
//!
//! * Every file-backed mapping is entered in a fixed-size, lock-free [registry](register) of
//!   `(start, len, poisoned)` slots.
//! * A process-wide SIGBUS handler ([`install`], `SA_SIGINFO | SA_ONSTACK`) looks the faulting
//!   address (`si_addr`) up in the registry. Inside a registered mapping it marks the slot
//!   *poisoned*, maps private anonymous zero pages (`MAP_FIXED`) from the faulting page to the
//!   end of the mapping and returns: the faulting load or store is retried and sees (or writes)
//!   zeros. A fault anywhere else restores the action installed before it (the Rust runtime's
//!   or the default) and returns, so the fault repeats under it; a SIGBUS sent with `kill` gets
//!   the default action. A real crash stays a crash.
//! * Every operation that copies region memory checks the poisoned flag *after* the copy
//!   (`RegionMemory::intact`) and fails instead of returning or acknowledging the bytes. The flag
//!   is set *before* the zero pages are mapped, so a thread that reads a zero page without
//!   faulting itself (another thread already replaced it) still sees the flag afterwards.
//!
//! The handler is async-signal-safe: it allocates nothing, takes no lock and calls only
//! `mmap`, `sigaction` and `raise` (raw system calls in glibc and musl). It reads the registry
//! with atomics only; a slot being rewritten concurrently is skipped through a per-slot sequence
//! counter (a seqlock whose data are atomics too).
//!
//! Verbs: the NIC's DMA into or out of a truncated page does not fault the CPU; that case is not
//! covered here (see ARCHITECTURE.md).
use std::io;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use nix::libc;

/// Number of file-backed mappings that can be registered at once (each `file`/`shm` region is
/// one). Creating more fails with a clear error rather than running unprotected.
pub const SLOTS: usize = 4096;

struct Slot {
    /// Even: stable. Odd: being (re)written; readers skip it.
    seq: AtomicUsize,
    start: AtomicUsize,
    /// 0: free.
    len: AtomicUsize,
    poisoned: AtomicBool,
    /// Allocation among registering threads (not read by the handler).
    claimed: AtomicBool,
}

impl Slot {
    const fn new() -> Self {
        Self {
            seq: AtomicUsize::new(0),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            poisoned: AtomicBool::new(false),
            claimed: AtomicBool::new(false),
        }
    }
}

static REGISTRY: [Slot; SLOTS] = [const { Slot::new() }; SLOTS];
/// Slots at or above this index have never been claimed; bounds the handler's scan.
static HIGH_WATER: AtomicUsize = AtomicUsize::new(0);
static PAGE_SIZE: AtomicUsize = AtomicUsize::new(4096);
/// The SIGBUS action in place before ours (the Rust runtime's, or the default).
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();
static INSTALL: Mutex<bool> = Mutex::new(false);

/// A registered mapping; unregisters on drop. Drop it *before* unmapping the memory.
#[derive(Debug)]
pub struct Guard {
    index: usize,
}

impl Guard {
    pub fn poisoned(&self) -> bool {
        REGISTRY[self.index].poisoned.load(Ordering::SeqCst)
    }

    #[cfg(test)]
    fn index(&self) -> usize {
        self.index
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let s = &REGISTRY[self.index];
        s.seq.fetch_add(1, Ordering::SeqCst);
        s.len.store(0, Ordering::SeqCst);
        s.start.store(0, Ordering::SeqCst);
        s.poisoned.store(false, Ordering::SeqCst);
        s.seq.fetch_add(1, Ordering::SeqCst);
        s.claimed.store(false, Ordering::SeqCst);
    }
}

/// Enters `start..start+len` (a live mapping the caller owns) in the registry. Installs the
/// handler on first use, so no file mapping ever exists without it.
pub fn register(start: usize, len: usize) -> io::Result<Guard> {
    install()?;
    if len == 0 {
        return Err(io::Error::other("cannot register an empty mapping"));
    }
    for (index, s) in REGISTRY.iter().enumerate() {
        if s.claimed.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            s.seq.fetch_add(1, Ordering::SeqCst);
            s.start.store(start, Ordering::SeqCst);
            s.poisoned.store(false, Ordering::SeqCst);
            s.len.store(len, Ordering::SeqCst);
            s.seq.fetch_add(1, Ordering::SeqCst);
            HIGH_WATER.fetch_max(index + 1, Ordering::SeqCst);
            return Ok(Guard { index });
        }
    }
    Err(io::Error::other(format!("more than {SLOTS} file-backed mappings: the SIGBUS registry is full")))
}

/// The slot whose stable mapping contains `addr`, if any. Async-signal-safe: atomics only.
fn lookup(addr: usize) -> Option<(usize, usize, &'static Slot)> {
    let n = HIGH_WATER.load(Ordering::SeqCst).min(SLOTS);
    for s in &REGISTRY[..n] {
        let s1 = s.seq.load(Ordering::SeqCst);
        if s1 % 2 == 1 {
            // Being written: not a mapping a thread can be faulting in (a faulting thread keeps
            // its region's mapping, and so its slot, alive and unchanged).
            continue;
        }
        let start = s.start.load(Ordering::SeqCst);
        let len = s.len.load(Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if s.seq.load(Ordering::SeqCst) != s1 || len == 0 {
            continue;
        }
        if addr >= start && addr - start < len {
            return Some((start, len, s));
        }
    }
    None
}

/// Installs the process-wide SIGBUS handler once. Called at agent start and by [`register`].
pub fn install() -> io::Result<()> {
    let mut done = INSTALL.lock().unwrap_or_else(|p| p.into_inner());
    if *done {
        return Ok(());
    }
    // SAFETY: sysconf has no preconditions; it is called here, outside the handler.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 {
        PAGE_SIZE.store(page as usize, Ordering::SeqCst);
    }
    let handler: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) = on_sigbus;
    // SAFETY: an all-zero sigaction is a valid value for every field (empty mask, no flags); the
    // ones that matter are set below.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = handler as usize;
    action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
    // SAFETY: an all-zero sigaction is valid; the kernel overwrites it with the old action.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: `on_sigbus` is async-signal-safe (see its comments): it touches only atomics and
    // statics that are initialised before this call, and calls only mmap/sigaction/raise. Both
    // pointers are to valid, live sigaction values.
    if unsafe { libc::sigaction(libc::SIGBUS, &action, &mut old) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let _ = PREVIOUS.set(old);
    *done = true;
    Ok(())
}

extern "C" fn on_sigbus(sig: c_int, info: *mut libc::siginfo_t, _ctx: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo_t to an SA_SIGINFO handler. si_code > 0 means the
    // kernel raised it for a fault (BUS_ADRERR etc.), so si_addr is the faulting address; for a
    // signal sent by a process (si_code <= 0) the union holds a pid instead and we do not look.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    if code > 0 {
        if let Some((start, len, slot)) = lookup(addr) {
            let page = PAGE_SIZE.load(Ordering::SeqCst);
            let from = addr & !(page - 1);
            let end = (start + len).div_ceil(page) * page;
            // Poison first: whoever later reads a zero page without faulting sees the flag
            // when it checks after its copy.
            slot.poisoned.store(true, Ordering::SeqCst);
            // SAFETY: `from..end` lies inside a live mapping the agent owns (registered, and kept
            // mapped by the faulting thread's reference to it). Replacing those pages with
            // private zero pages is what every reader and writer of the poisoned region expects
            // (they check the flag). mmap is a direct system call: async-signal-safe.
            let r = unsafe {
                libc::mmap(
                    from as *mut c_void,
                    end - from,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if r != libc::MAP_FAILED {
                return; // the faulting instruction is retried against the zero pages
            }
        }
    }
    // Not ours. A fault: put the previous action back (the Rust runtime's, which reports stack
    // overflows, or the default) and return; the faulting instruction faults again under it. A
    // signal sent by a process (si_code <= 0) would not repeat: default action and raise it
    // (the runtime's handler would swallow it).
    // SAFETY: sigaction, signal and raise are async-signal-safe. PREVIOUS was set before the
    // handler was installed and lives in a static.
    unsafe {
        match PREVIOUS.get() {
            Some(prev) if code > 0 => {
                libc::sigaction(sig, prev, std::ptr::null_mut());
            }
            _ => {
                libc::signal(sig, libc::SIG_DFL);
            }
        }
        if code <= 0 {
            // Pending until this handler returns, then delivered with the default action.
            libc::raise(sig);
        }
    }
    // A fault returns to the faulting instruction, which faults again under the old action.
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_lookup_and_poison() {
        let a = register(0xffff_9000_0000, 0x4000).unwrap();
        let b = register(0xffff_a000_0000, 0x1000).unwrap();
        assert_ne!(a.index(), b.index());
        let (start, len, slot) = lookup(0xffff_9000_3fff).unwrap();
        assert_eq!((start, len), (0xffff_9000_0000, 0x4000));
        assert!(lookup(0xffff_9000_4000).is_none_or(|(s, _, _)| s != 0xffff_9000_0000));
        assert!(lookup(0xffff_8fff_ffff).is_none_or(|(s, _, _)| s != 0xffff_9000_0000));
        assert!(!a.poisoned());
        slot.poisoned.store(true, Ordering::SeqCst);
        assert!(a.poisoned());
        assert!(!b.poisoned());
        let ia = a.index();
        drop(a);
        assert!(lookup(0xffff_9000_0000).is_none_or(|(s, _, _)| s != 0xffff_9000_0000));
        // A reused slot starts clean.
        let c = register(0xffff_b000_0000, 0x1000).unwrap();
        if c.index() == ia {
            assert!(!c.poisoned());
        }
    }

    #[test]
    fn a_truncated_file_mapping_reads_zeros_and_is_poisoned() {
        use crate::memory::{MemError, RegionMemory};
        let f = tempfile::tempfile().unwrap();
        f.set_len(16384).unwrap();
        let m = RegionMemory::map_file(&f, 16384, true).unwrap();
        m.write_at(0, &[7u8; 16384]).unwrap();
        f.set_len(4096).unwrap();
        let mut buf = vec![1u8; 16384];
        assert!(matches!(m.read_at(0, &mut buf), Err(MemError::Poisoned)));
        assert_eq!(&buf[..4096], &[7u8; 4096][..]);
        assert!(buf[4096..].iter().all(|&b| b == 0));
        assert!(m.poisoned());
        // Writes are refused too, and later reads fail without faulting again.
        assert!(matches!(m.write_at(8192, b"x"), Err(MemError::Poisoned)));
        assert!(matches!(m.read_at(0, &mut buf[..10]), Err(MemError::Poisoned)));
    }
}
