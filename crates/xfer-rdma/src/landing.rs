//! Landing received payloads in region memory: [`RegionMemory::land`] copies a payload the tcp
//! fabric already holds in its read buffer into the region, with non-temporal (streaming) stores
//! when the region is far larger than the CPU's caches.
//!
//! Why: a KV-cache batch scatters thousands of small blocks over a pool of gigabytes, so each
//! block lands in lines no cache holds. An ordinary copy first reads every destination line from
//! memory (read for ownership) only to overwrite it whole; streaming stores skip that read and do
//! not evict the lines the agent is working with. Measured on this project's 2-core EPYC host:
//! 4 KiB copies to random pages of a 256 MiB buffer, 6-9 GB/s with `memcpy`, 12-16 GB/s
//! streaming. A small region (a benchmark's scratch buffer, a notification ring) stays in cache,
//! where ordinary stores are faster: those copy as before.
use std::ptr;

use crate::memory::{MemError, RegionMemory};

/// Regions at least this long take streaming stores: twice a large last-level cache, so a
/// random line of theirs is most likely not cached.
pub const STREAMING_REGION: u64 = 64 << 20;
/// Copies shorter than this use ordinary stores (the fence and the edges would cost more).
const MIN_STREAMING_COPY: usize = 1024;

impl RegionMemory {
    /// Copies `data` into `offset..` of the mapping (bounds and writability checked), with
    /// streaming stores when the region is at least [`STREAMING_REGION`] long and the copy at
    /// least 1 KiB; the stores are fenced before this returns, so whatever the caller does next
    /// (an ACK, a notification) is ordered after them. Memory that [`can_shrink`] is copied by
    /// [`RegionMemory::write_at`] (its poisoning checks apply).
    ///
    /// [`can_shrink`]: RegionMemory::can_shrink
    pub fn land(&self, offset: u64, data: &[u8]) -> Result<(), MemError> {
        if self.can_shrink() {
            return self.write_at(offset, data);
        }
        let dst = self.range_mut_ptr(offset, data.len())?;
        if self.len() >= STREAMING_REGION && data.len() >= MIN_STREAMING_COPY {
            // SAFETY: `dst..dst + data.len()` lies within the live, writable mapping (checked by
            // `range_mut_ptr`); `data` is the caller's buffer, not region memory, so the two do
            // not overlap. Concurrent writers of the same bytes tear them, as the memory
            // module's contract allows.
            unsafe { copy_streaming(data.as_ptr(), dst, data.len()) };
        } else {
            // SAFETY: as above; `ptr::copy` (memmove) as in `write_at`.
            unsafe { ptr::copy(data.as_ptr(), dst, data.len()) };
        }
        Ok(())
    }
}

/// Copies `len` bytes with non-temporal stores for the 16-byte-aligned middle of the
/// destination and ordinary stores for its edges, then fences the stores.
///
/// # Safety
/// `src..src + len` must be readable, `dst..dst + len` writable, and the two must not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let head = dst.align_offset(16).min(len);
    // SAFETY (this block and the loops below): every offset stays below `len`, within both
    // ranges the caller vouched for; the stores in the loops go to 16-byte-aligned addresses
    // (`dst + head` is aligned and each step adds a multiple of 16), as `_mm_stream_si128`
    // requires; SSE2 is part of the x86_64 baseline, so the intrinsics are always available.
    unsafe {
        ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 64 <= len {
            let a = _mm_loadu_si128(src.add(i).cast::<__m128i>());
            let b = _mm_loadu_si128(src.add(i + 16).cast::<__m128i>());
            let c = _mm_loadu_si128(src.add(i + 32).cast::<__m128i>());
            let d = _mm_loadu_si128(src.add(i + 48).cast::<__m128i>());
            _mm_stream_si128(dst.add(i).cast::<__m128i>(), a);
            _mm_stream_si128(dst.add(i + 16).cast::<__m128i>(), b);
            _mm_stream_si128(dst.add(i + 32).cast::<__m128i>(), c);
            _mm_stream_si128(dst.add(i + 48).cast::<__m128i>(), d);
            i += 64;
        }
        while i + 16 <= len {
            _mm_stream_si128(dst.add(i).cast::<__m128i>(), _mm_loadu_si128(src.add(i).cast::<__m128i>()));
            i += 16;
        }
        ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
        // Streaming stores are weakly ordered: fence them before anything that announces them.
        _mm_sfence();
    }
}

/// Other architectures: an ordinary copy.
///
/// # Safety
/// As for the x86_64 version.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { ptr::copy_nonoverlapping(src, dst, len) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every alignment and length around the streaming paths' edges, in a region large enough
    /// to stream: the bytes read back are the bytes given, and the bytes around them are
    /// untouched.
    #[test]
    fn streaming_copies_land_exactly_the_given_bytes() {
        let mem = RegionMemory::anonymous(STREAMING_REGION as usize, false).expect("mapping");
        let src: Vec<u8> = (0..20_000usize).map(|k| (k * 31 + 7) as u8).collect();
        for (i, &(offset, len)) in
            [(0u64, 1024usize), (1, 1024), (15, 1100), (17, 4096), (4093, 4099), (64, 16_384), (33, 1039)].iter().enumerate()
        {
            let base = (i as u64) << 20;
            let at = base + offset;
            mem.write_at(base, &[0xee; 20_100]).expect("fill");
            mem.land(at, &src[i..i + len]).expect("land");
            let mut back = vec![0u8; 20_100];
            mem.read_at(base, &mut back).expect("read back");
            let o = offset as usize;
            assert!(back[..o].iter().all(|b| *b == 0xee), "before {offset}+{len}");
            assert_eq!(&back[o..o + len], &src[i..i + len], "{offset}+{len}");
            assert!(back[o + len..].iter().all(|b| *b == 0xee), "after {offset}+{len}");
        }
    }

    /// A range past the mapping is refused before any byte is copied.
    #[test]
    fn landing_outside_the_mapping_is_refused() {
        let mem = RegionMemory::anonymous(4096, false).expect("mapping");
        assert!(mem.land(4000, &[1u8; 200]).is_err());
        let mut back = vec![0u8; 4096];
        mem.read_at(0, &mut back).expect("read back");
        assert!(back.iter().all(|b| *b == 0));
    }
}
