//! An application's end of a ring: reads what the agent published without ever disturbing it
//! (a seqlock per slot), told what it lost when it falls behind, and sleeps on the ring's futex.

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::layout::{
    check_slot_size, check_slots, ring_len, RingError, RingNote, RingOp, RingVia, FLAG_CLOSED, HEADER, MAGIC, OFF_FLAGS, OFF_HEAD,
    OFF_SLOTS, OFF_SLOT_SIZE, OFF_VERSION, OFF_WAITERS, OFF_WAKE, SLOT_FIXED, VERSION,
};
use crate::memory::RegionMemory;

/// An application's end: reads a ring it mapped (writable only for the waiters count).
pub struct RingReader {
    mem: Arc<RegionMemory>,
    slots: u32,
    slot_size: u32,
    next: u64,
}

impl RingReader {
    /// Checks the header of the ring mapped at `mem` and starts at its oldest notification
    /// still held (a fresh ring: the first one).
    pub fn open(mem: RegionMemory) -> Result<RingReader, RingError> {
        if mem.len() < HEADER {
            return Err(RingError::Format(format!("{} bytes", mem.len())));
        }
        let mut magic = [0u8; 8];
        mem.read_at(0, &mut magic)?;
        fence(Ordering::Acquire);
        if magic != MAGIC {
            return Err(RingError::Format("bad magic".into()));
        }
        let word = |off: u64| -> Result<u32, RingError> {
            let mut b = [0u8; 4];
            mem.read_at(off, &mut b)?;
            Ok(u32::from_le_bytes(b))
        };
        let (version, slot_size, slots) = (word(OFF_VERSION)?, word(OFF_SLOT_SIZE)?, word(OFF_SLOTS)?);
        if version != VERSION {
            return Err(RingError::Format(format!("version {version}, this reader knows {VERSION}")));
        }
        check_slots(slots).map_err(RingError::Format)?;
        check_slot_size(slot_size)?;
        if mem.len() < ring_len(slots, slot_size) {
            return Err(RingError::Format(format!("{slots} slots of {slot_size} bytes in {} bytes", mem.len())));
        }
        let head = mem.load_u64(OFF_HEAD, Ordering::Acquire)?;
        Ok(RingReader { mem: std::sync::Arc::new(mem), slots, slot_size, next: head.saturating_sub(u64::from(slots)) })
    }

    /// The number of the next notification this reader returns.
    pub fn position(&self) -> u64 {
        self.next
    }

    /// True once the agent closed the ring.
    pub fn closed(&self) -> Result<bool, RingError> {
        Ok(self.mem.load_u32(OFF_FLAGS, Ordering::Acquire)? & FLAG_CLOSED != 0)
    }

    /// The next notification if one was published, without waiting. `Err(Lagged(k))` once
    /// after `k` were overwritten before this reader got to them (the next call goes on from
    /// the oldest one held); `Err(Closed)` once every notification was read and the agent
    /// closed the ring.
    pub fn try_next(&mut self) -> Result<Option<RingNote>, RingError> {
        // Closed is read first: the writer closes after its last publication, so a head read
        // after seeing the flag is final.
        let closed = self.closed()?;
        let head = self.mem.load_u64(OFF_HEAD, Ordering::Acquire)?;
        if head == self.next {
            return if closed { Err(RingError::Closed) } else { Ok(None) };
        }
        if head < self.next {
            return Err(RingError::Format(format!("head {head} went back below {}", self.next)));
        }
        let slots = u64::from(self.slots);
        if head - self.next > slots {
            return Err(self.skip_to(head - slots));
        }
        let n = self.next;
        let slot = HEADER + (n % slots) * u64::from(self.slot_size);
        let s1 = self.mem.load_u64(slot, Ordering::Acquire)?;
        if s1 != n + 1 {
            // Overwritten (or being overwritten) by a later notification.
            return Err(self.lag_from_head());
        }
        // The fixed part, then only the bytes its lengths name (checked against the slot).
        let mut fixed = [0u8; SLOT_FIXED as usize - 8];
        self.mem.read_at_poll(slot + 8, &mut fixed)?;
        let (region_len, peer_len, tag_len) = lengths(&fixed);
        let var_len = tag_len + region_len + peer_len;
        let fits = var_len <= self.slot_size as usize - SLOT_FIXED as usize;
        let mut var = vec![0u8; if fits { var_len } else { 0 }];
        self.mem.read_at_poll(slot + SLOT_FIXED, &mut var)?;
        fence(Ordering::Acquire);
        if self.mem.load_u64(slot, Ordering::Relaxed)? != s1 {
            return Err(self.lag_from_head());
        }
        if !fits {
            return Err(RingError::Format(format!("notification {n}: lengths past its slot")));
        }
        let note = parse(n, &fixed, &var)?;
        self.next = n + 1;
        Ok(Some(note))
    }

    /// Waits up to `timeout` for the next notification (the first `spin` of it polling, then
    /// sleeping on the ring's futex). `Ok(None)` at the timeout.
    pub fn next_timeout(&mut self, spin: Duration, timeout: Duration) -> Result<Option<RingNote>, RingError> {
        let start = std::time::Instant::now();
        loop {
            if let Some(n) = self.try_next()? {
                return Ok(Some(n));
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Ok(None);
            }
            if waited < spin {
                std::hint::spin_loop();
                continue;
            }
            self.waiter().wait(timeout - waited)?;
        }
    }

    /// A handle that sleeps until this reader has something to read (for waiting on another
    /// thread while the reader stays where it is).
    pub fn waiter(&self) -> RingWaiter {
        RingWaiter { mem: std::sync::Arc::clone(&self.mem), next: self.next }
    }

    fn lag_from_head(&mut self) -> RingError {
        let head = self.mem.load_u64(OFF_HEAD, Ordering::Acquire).unwrap_or(self.next + 1);
        let oldest = head.saturating_sub(u64::from(self.slots)).max(self.next + 1);
        self.skip_to(oldest)
    }

    fn skip_to(&mut self, oldest: u64) -> RingError {
        let lost = oldest.saturating_sub(self.next);
        self.next = oldest.max(self.next);
        RingError::Lagged(lost)
    }
}

/// Sleeps on a ring until notification `next` is published or the ring closes.
pub struct RingWaiter {
    mem: Arc<RegionMemory>,
    next: u64,
}

impl RingWaiter {
    /// Returns once the writer published past `next` or closed the ring, after `at_most`, or
    /// spuriously (a signal); the caller reads the ring again in every case.
    pub fn wait(&self, at_most: Duration) -> Result<(), RingError> {
        let seen = self.mem.load_u32(OFF_WAKE, Ordering::SeqCst)?;
        self.mem.fetch_add_u32(OFF_WAITERS, 1, Ordering::SeqCst)?;
        // Read after announcing the waiter: a publication either is seen here or sees the
        // waiter and wakes the futex (whose word then differs from `seen`).
        let ready = self
            .mem
            .load_u64(OFF_HEAD, Ordering::SeqCst)
            .and_then(|h| Ok(h != self.next || self.mem.load_u32(OFF_FLAGS, Ordering::SeqCst)? & FLAG_CLOSED != 0));
        let r = match ready {
            Ok(true) => Ok(()),
            Ok(false) => self.mem.futex_wait(OFF_WAKE, seen, at_most).map_err(RingError::from),
            Err(e) => Err(e.into()),
        };
        self.mem.fetch_sub_u32(OFF_WAITERS, 1, Ordering::SeqCst)?;
        r
    }
}

/// Region name, peer name and tag lengths of a slot's fixed part (after seq).
fn lengths(f: &[u8; SLOT_FIXED as usize - 8]) -> (usize, usize, usize) {
    let u16_at = |o: usize| u16::from_le_bytes([f[o], f[o + 1]]) as usize;
    let tag = u32::from_le_bytes([f[32], f[33], f[34], f[35]]) as usize;
    (u16_at(28), u16_at(30), tag)
}

/// A slot as notification `n`: its fixed part (after seq) and its variable part (exactly the
/// tag and names its lengths say).
fn parse(n: u64, f: &[u8; SLOT_FIXED as usize - 8], var: &[u8]) -> Result<RingNote, RingError> {
    let u64_at = |o: usize| u64::from_le_bytes([f[o], f[o + 1], f[o + 2], f[o + 3], f[o + 4], f[o + 5], f[o + 6], f[o + 7]]);
    let (region_len, peer_len, tag_len) = lengths(f);
    if tag_len + region_len + peer_len != var.len() {
        return Err(RingError::Format(format!("notification {n}: lengths past its slot")));
    }
    let op = match f[24] {
        1 => RingOp::Write,
        2 => RingOp::Read,
        x => return Err(RingError::Format(format!("notification {n}: op {x}"))),
    };
    let via = match f[25] {
        1 => RingVia::Fabric,
        2 => RingVia::Complete,
        x => return Err(RingError::Format(format!("notification {n}: via {x}"))),
    };
    let text = |s: &[u8]| String::from_utf8(s.to_vec()).map_err(|_| RingError::Format(format!("notification {n}: a name is not UTF-8")));
    Ok(RingNote {
        seq: n,
        at_unix_ns: u64_at(0),
        offset: u64_at(8),
        length: u64_at(16),
        op,
        via,
        tag: var[..tag_len].to_vec(),
        region: text(&var[tag_len..tag_len + region_len])?,
        peer: text(&var[tag_len + region_len..])?,
    })
}

/// Red team of the ring format: a hostile co-writer of the object (or a hostile agent) against
/// the reader, and against the writer. Nothing here may panic, hang or touch memory outside
/// the mapping; what the format cannot carry must be refused.
#[cfg(test)]
mod redteam_tests {

    use super::super::layout::slot_size;
    use super::super::writer::RingWriter;
    use super::*;
    use crate::memory::MemError;
    use crate::ring::test_pair::pair;

    fn scribbler(f: &tempfile::NamedTempFile) -> RegionMemory {
        let len = f.as_file().metadata().unwrap().len() as usize;
        RegionMemory::map_file(f.as_file(), len, true).unwrap()
    }

    fn note(i: u64) -> RingNote {
        RingNote {
            seq: 0,
            at_unix_ns: i,
            offset: i,
            length: 1,
            op: RingOp::Write,
            via: RingVia::Complete,
            tag: format!("t{i}").into_bytes(),
            region: "r".into(),
            peer: "p".into(),
        }
    }

    /// Heads a co-writer stores: far ahead (u64::MAX), behind what was read, and flipping. The
    /// reader returns errors or notes, never panics, never reads outside its mapping, and makes
    /// progress (no endless `Ok(None)` while the head is ahead of it).
    #[test]
    fn hostile_heads_never_panic_or_stall_the_reader() {
        let (mut w, mut r, f) = pair(16, slot_size(8, 8, 8));
        let s = scribbler(&f);
        for i in 0..5 {
            w.publish(&note(i)).unwrap();
        }
        for _ in 0..5 {
            r.try_next().unwrap().unwrap();
        }
        // Backwards.
        s.store_u64(OFF_HEAD, 2, Ordering::SeqCst).unwrap();
        assert!(matches!(r.try_next(), Err(RingError::Format(e)) if e.contains("went back")));
        // Far ahead: lagged, then every call moves on.
        s.store_u64(OFF_HEAD, u64::MAX, Ordering::SeqCst).unwrap();
        assert_eq!(r.try_next(), Err(RingError::Lagged(u64::MAX - 16 - 5)));
        let mut last = r.position();
        for _ in 0..64 {
            match r.try_next() {
                Ok(Some(_)) | Err(RingError::Lagged(_)) => {}
                Ok(None) => break,
                other => panic!("{other:?}"),
            }
            assert!(r.position() > last || r.position() == u64::MAX);
            last = r.position();
        }
        assert_eq!(r.position(), u64::MAX, "caught up with the head");
        // The waiter does not sleep on a head that is not where it expects (the 30 s is a hang
        // guard: it returns at once).
        s.store_u64(OFF_HEAD, 7, Ordering::SeqCst).unwrap();
        r.waiter().wait(Duration::from_secs(30)).unwrap();
        assert!(matches!(r.try_next(), Err(RingError::Format(_))));
        // Every slot's seq and lengths garbage, head one ahead of the reader.
        let (mut w, mut r, f) = pair(16, slot_size(8, 8, 8));
        w.publish(&note(0)).unwrap();
        let s = scribbler(&f);
        let len = s.len();
        s.write_at(HEADER, &vec![0xff; (len - HEADER) as usize]).unwrap();
        s.store_u64(HEADER, 1, Ordering::SeqCst).unwrap();
        assert!(matches!(r.try_next(), Err(RingError::Format(_))), "lengths past the slot, op 0xff");
        for (off, bytes) in [(24usize, vec![1u8, 1]), (28, vec![1, 0, 1, 0, 1, 0, 0, 0])] {
            s.write_at(HEADER + 8 + off as u64, &bytes).unwrap();
        }
        s.write_at(HEADER + SLOT_FIXED, &[0xff, 0xfe, 0xfd]).unwrap();
        assert!(matches!(r.try_next(), Err(RingError::Format(e)) if e.contains("UTF-8")));
        s.write_at(HEADER + SLOT_FIXED, b"tRP").unwrap();
        assert_eq!(r.try_next().unwrap().unwrap().region, "R", "a forged slot reads as a note: the co-writer is trusted by the format");
    }

    /// The writer keeps its own geometry whatever the header says (slots 0, slot size u32::MAX,
    /// head u64::MAX, waiters u32::MAX, flags): it writes only inside the ring and never blocks.
    #[test]
    fn the_writer_ignores_a_scribbled_header() {
        let (mut w, _r, f) = pair(16, slot_size(8, 8, 8));
        let s = scribbler(&f);
        s.write_at(OFF_SLOT_SIZE, &u32::MAX.to_le_bytes()).unwrap();
        s.write_at(OFF_SLOTS, &0u32.to_le_bytes()).unwrap();
        s.write_at(OFF_FLAGS, &u32::MAX.to_le_bytes()).unwrap();
        s.store_u64(OFF_HEAD, u64::MAX, Ordering::SeqCst).unwrap();
        s.write_at(OFF_WAITERS, &u32::MAX.to_le_bytes()).unwrap();
        s.write_at(OFF_WAKE, &u32::MAX.to_le_bytes()).unwrap();
        let len = f.as_file().metadata().unwrap().len();
        for i in 0..100 {
            w.publish(&note(i)).unwrap();
        }
        w.close().unwrap();
        assert_eq!(f.as_file().metadata().unwrap().len(), len);
        assert_eq!(s.load_u64(OFF_HEAD, Ordering::SeqCst).unwrap(), 100);
        assert_eq!(s.load_u32(OFF_WAKE, Ordering::SeqCst).unwrap(), 100, "wrapped from u32::MAX: 101 bumps");
    }

    /// The object truncated under a reader (to nothing, and inside its last page): errors, not
    /// a SIGBUS death, and a waiter does not hang.
    #[test]
    fn truncation_under_the_reader_is_an_error() {
        let (mut w, mut r, f) = pair(16, slot_size(8, 8, 8));
        w.publish(&note(0)).unwrap();
        f.as_file().set_len(0).unwrap();
        assert_eq!(r.try_next(), Err(RingError::Memory(MemError::Poisoned)));
        assert!(r.waiter().wait(Duration::from_secs(30)).is_err());
        // Inside the last page: no fault; the slot in it reads as zeros, which the seqlock
        // rejects (no note made of zeros).
        let (mut w, mut r, f) = pair(16, 4096 - 64);
        let len = f.as_file().metadata().unwrap().len();
        for i in 0..16 {
            w.publish(&note(i)).unwrap();
        }
        for _ in 0..15 {
            r.try_next().unwrap().unwrap();
        }
        f.as_file().set_len(len - 100).unwrap();
        if let Ok(Some(n)) = r.try_next() {
            assert_eq!(n.tag, b"t15", "the last slot, read whole or not at all");
        }
        assert!(w.publish(&note(16)).is_err(), "the writer sees the cut");
    }

    /// A slot can carry at most 64 + 3 x 65,535 bytes (three u16 lengths); a header announcing
    /// wider slots (a hostile agent's, or a co-writer's before the reader opens) makes the
    /// reader allocate and copy `slot_size` bytes on every `try_next` (up to 4 GiB). The reader
    /// should refuse a slot size the format cannot fill.
    #[test]
    fn a_reader_refuses_slots_wider_than_the_format_can_fill() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let wide = 1u32 << 20;
        f.as_file().set_len(ring_len(16, wide)).unwrap(); // sparse
        let mem = RegionMemory::map_file(f.as_file(), ring_len(16, wide) as usize, true).unwrap();
        // The writer refuses such a slot itself: lay out a valid ring, then widen its header.
        assert!(RingWriter::create(RegionMemory::map_file(f.as_file(), ring_len(16, wide) as usize, true).unwrap(), 16, wide).is_err());
        RingWriter::create(mem, 16, 64).unwrap();
        RegionMemory::map_file(f.as_file(), ring_len(16, wide) as usize, true)
            .unwrap()
            .write_at(OFF_SLOT_SIZE, &wide.to_le_bytes())
            .unwrap();
        let most = slot_size(u16::MAX as usize, u16::MAX as usize, u16::MAX as usize);
        let opened = RingReader::open(RegionMemory::map_file(f.as_file(), ring_len(16, wide) as usize, true).unwrap());
        assert!(opened.is_err(), "a slot of {wide} bytes was accepted; no notification can use more than {most}");
    }

    /// The widest tag an agent may be configured to accept (`transfer.max_notify_bytes` up to
    /// 65,536) must fit the format, or the agent silently drops it from every ring.
    #[test]
    fn the_agents_widest_tag_fits_a_slot() {
        let ceiling = 64 << 10;
        let (mut w, mut r, _f) = pair(16, slot_size(ceiling, 128, 253));
        let n = RingNote { tag: vec![b'w'; ceiling], ..note(0) };
        assert_eq!(w.publish(&n), Ok(()), "a {ceiling}-byte tag");
        assert_eq!(r.try_next().unwrap().unwrap().tag.len(), ceiling);
    }
}
