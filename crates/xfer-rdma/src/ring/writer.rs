//! The agent's end of a ring: lays it out and publishes notifications into it, waking readers
//! that sleep on it only when there is one.

use std::sync::atomic::{fence, Ordering};

use super::layout::{
    check_slot_size, check_slots, ring_len, RingError, RingNote, FLAG_CLOSED, HEADER, MAGIC, MAX_TAG, OFF_FLAGS, OFF_HEAD, OFF_SLOTS,
    OFF_SLOT_SIZE, OFF_VERSION, OFF_WAITERS, OFF_WAKE, SLOT_FIXED, VERSION,
};
use crate::memory::RegionMemory;

/// The agent's end: publishes into a ring it created. Not `Sync` by design of its `&mut`
/// publish: the owner serializes writers.
pub struct RingWriter {
    mem: RegionMemory,
    slots: u32,
    slot_size: u32,
    head: u64,
}

impl RingWriter {
    /// Lays out a fresh ring over `mem` (zeroed memory of at least [`ring_len`] bytes, which no
    /// reader has mapped yet).
    pub fn create(mem: RegionMemory, slots: u32, slot_size: u32) -> Result<RingWriter, RingError> {
        check_slots(slots).map_err(RingError::Format)?;
        check_slot_size(slot_size)?;
        if mem.len() < ring_len(slots, slot_size) {
            return Err(RingError::Format(format!("{} bytes hold no ring of {slots} x {slot_size}", mem.len())));
        }
        mem.write_at(OFF_VERSION, &VERSION.to_le_bytes())?;
        mem.write_at(OFF_SLOT_SIZE, &slot_size.to_le_bytes())?;
        mem.write_at(OFF_SLOTS, &slots.to_le_bytes())?;
        // The magic last: a reader that sees it sees a complete header.
        fence(Ordering::Release);
        mem.write_at(0, &MAGIC)?;
        Ok(RingWriter { mem, slots, slot_size, head: 0 })
    }

    /// Largest tag + region + peer a slot holds.
    pub fn capacity(&self) -> usize {
        (self.slot_size as u64 - SLOT_FIXED) as usize
    }

    /// Notifications published so far.
    pub fn published(&self) -> u64 {
        self.head
    }

    /// Publishes `note` (its `seq` is ignored: the ring numbers it). Names and tag longer than
    /// the slot holds are refused (the agent sizes slots for its largest tag and names).
    pub fn publish(&mut self, note: &RingNote) -> Result<(), RingError> {
        let var = note.tag.len() + note.region.len() + note.peer.len();
        if var > self.capacity() || note.tag.len() > MAX_TAG || note.region.len() > u16::MAX as usize || note.peer.len() > u16::MAX as usize
        {
            return Err(RingError::Format(format!("a notification of {var} bytes of tag and names; slots hold {}", self.capacity())));
        }
        let n = self.head;
        let slot = HEADER + (n % u64::from(self.slots)) * u64::from(self.slot_size);
        // Seqlock write: seq 0, then the body, then seq n+1 (release), then the head.
        self.mem.store_u64(slot, 0, Ordering::Relaxed)?;
        fence(Ordering::Release);
        let mut body = Vec::with_capacity(SLOT_FIXED as usize - 8 + var);
        body.extend_from_slice(&note.at_unix_ns.to_le_bytes());
        body.extend_from_slice(&note.offset.to_le_bytes());
        body.extend_from_slice(&note.length.to_le_bytes());
        body.push(note.op as u8);
        body.push(note.via as u8);
        body.extend_from_slice(&0u16.to_le_bytes());
        body.extend_from_slice(&(note.region.len() as u16).to_le_bytes());
        body.extend_from_slice(&(note.peer.len() as u16).to_le_bytes());
        body.extend_from_slice(&(note.tag.len() as u32).to_le_bytes());
        body.resize(SLOT_FIXED as usize - 8, 0);
        body.extend_from_slice(&note.tag);
        body.extend_from_slice(note.region.as_bytes());
        body.extend_from_slice(note.peer.as_bytes());
        self.mem.write_at(slot + 8, &body)?;
        self.mem.store_u64(slot, n + 1, Ordering::Release)?;
        self.mem.store_u64(OFF_HEAD, n + 1, Ordering::SeqCst)?;
        self.head = n + 1;
        self.wake()
    }

    /// Marks the ring closed (nothing more will be published) and wakes its readers. Also when
    /// the ring can no longer be written (its object was cut short): the flag is stored anyway,
    /// so a reader that still sees the header page learns the ring is over.
    pub fn close(&mut self) -> Result<(), RingError> {
        let closed = match self.mem.load_u32(OFF_FLAGS, Ordering::Relaxed) {
            Ok(f) if f & FLAG_CLOSED != 0 => Ok(()),
            Ok(_) => self.mem.fetch_add_u32(OFF_FLAGS, FLAG_CLOSED, Ordering::SeqCst).map(drop),
            Err(e) => Err(e),
        };
        if let Err(e) = closed {
            self.mem.store_u32_unguarded(OFF_FLAGS, FLAG_CLOSED, Ordering::SeqCst)?;
            let _ = self.mem.fetch_add_u32(OFF_WAKE, 1, Ordering::SeqCst);
            let _ = self.mem.futex_wake(OFF_WAKE);
            return Err(e.into());
        }
        self.wake()
    }

    fn wake(&self) -> Result<(), RingError> {
        self.mem.fetch_add_u32(OFF_WAKE, 1, Ordering::SeqCst)?;
        if self.mem.load_u32(OFF_WAITERS, Ordering::SeqCst)? != 0 {
            self.mem.futex_wake(OFF_WAKE)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::layout::{slot_size, RingOp, RingVia};
    use super::super::reader::RingReader;
    use super::*;
    use crate::ring::test_pair::pair;

    fn note(i: u64) -> RingNote {
        RingNote {
            seq: 0,
            at_unix_ns: 1_700_000_000_000_000_000 + i,
            offset: i * 4096,
            length: 4096,
            op: if i.is_multiple_of(2) { RingOp::Write } else { RingOp::Read },
            via: RingVia::Fabric,
            tag: format!("req-{i}").into_bytes(),
            region: "kv".into(),
            peer: "node-a".into(),
        }
    }

    #[test]
    fn notifications_arrive_in_order_with_every_field() {
        let (mut w, mut r, _f) = pair(16, slot_size(64, 128, 253));
        assert_eq!(r.try_next(), Ok(None));
        for i in 0..40 {
            w.publish(&note(i)).unwrap();
            let got = r.try_next().unwrap().unwrap();
            assert_eq!(got, RingNote { seq: i, ..note(i) });
        }
        assert_eq!(r.try_next(), Ok(None));
        assert_eq!(w.published(), 40);
    }

    /// A reader more than `slots` behind is told how many it lost, once, and goes on from the
    /// oldest notification still held.
    #[test]
    fn a_reader_that_falls_behind_is_told_what_it_lost() {
        let (mut w, mut r, _f) = pair(16, slot_size(64, 128, 253));
        for i in 0..50 {
            w.publish(&note(i)).unwrap();
        }
        assert_eq!(r.try_next(), Err(RingError::Lagged(34)));
        for i in 34..50 {
            assert_eq!(r.try_next().unwrap().unwrap().tag, note(i).tag);
        }
        assert_eq!(r.try_next(), Ok(None));
        // A reader opened late starts at the oldest one held.
        let (mut w, _r, f) = pair(16, slot_size(64, 128, 253));
        for i in 0..20 {
            w.publish(&note(i)).unwrap();
        }
        let len = ring_len(16, slot_size(64, 128, 253)) as usize;
        let mut late = RingReader::open(RegionMemory::map_file(f.as_file(), len, true).unwrap()).unwrap();
        assert_eq!(late.position(), 4);
        assert_eq!(late.try_next().unwrap().unwrap().seq, 4);
    }

    #[test]
    fn closing_ends_the_reader_after_what_was_published() {
        let (mut w, mut r, _f) = pair(16, slot_size(8, 8, 8));
        w.publish(&RingNote { tag: b"t".to_vec(), region: "r".into(), peer: "p".into(), ..note(0) }).unwrap();
        w.close().unwrap();
        assert_eq!(r.try_next().unwrap().unwrap().tag, b"t");
        assert_eq!(r.try_next(), Err(RingError::Closed));
        assert!(r.closed().unwrap());
    }

    /// What a slot cannot hold is refused and publishes nothing; a header that is not a ring
    /// (wrong magic, version, geometry, a short file) is refused by the reader.
    #[test]
    fn bad_notifications_and_bad_rings_are_refused() {
        let (mut w, mut r, f) = pair(16, slot_size(8, 8, 8));
        let big = RingNote { tag: vec![0; 200], ..note(0) };
        assert!(matches!(w.publish(&big), Err(RingError::Format(_))));
        assert_eq!(r.try_next(), Ok(None), "nothing was published");
        let len = ring_len(16, slot_size(8, 8, 8)) as usize;
        let mem = || RegionMemory::map_file(f.as_file(), len, true).unwrap();
        let m = mem();
        m.write_at(OFF_VERSION, &2u32.to_le_bytes()).unwrap();
        assert!(matches!(RingReader::open(mem()), Err(RingError::Format(e)) if e.contains("version 2")));
        m.write_at(OFF_VERSION, &1u32.to_le_bytes()).unwrap();
        m.write_at(OFF_SLOTS, &1000u32.to_le_bytes()).unwrap();
        assert!(RingReader::open(mem()).is_err(), "not a power of two");
        m.write_at(OFF_SLOTS, &(1u32 << 20).to_le_bytes()).unwrap();
        assert!(RingReader::open(mem()).is_err(), "past the file");
        m.write_at(0, b"NOTARING").unwrap();
        assert!(RingReader::open(mem()).is_err());
        // A slot whose lengths point past it (a corrupt or hostile writer) is an error, not a
        // panic.
        let (mut w, mut r, f) = pair(16, slot_size(8, 8, 8));
        w.publish(&note(0)).unwrap();
        RegionMemory::map_file(f.as_file(), len, true).unwrap().write_at(HEADER + 40, &u32::MAX.to_le_bytes()).unwrap();
        assert!(matches!(r.try_next(), Err(RingError::Format(_))));
    }

    /// A reader sleeping on the futex is woken by a publication from another thread.
    #[test]
    fn a_sleeping_reader_is_woken_by_a_publication() {
        let (mut w, mut r, _f) = pair(16, slot_size(64, 128, 253));
        let reader = std::thread::spawn(move || r.next_timeout(Duration::ZERO, Duration::from_secs(60)));
        // Published whether or not the reader sleeps yet: either it sees the head, or the wake.
        w.publish(&note(7)).unwrap();
        let got = reader.join().unwrap().unwrap().unwrap();
        assert_eq!(got.tag, note(7).tag);
    }

    #[test]
    fn concurrent_writer_and_reader_see_no_torn_notification() {
        let (mut w, mut r, _f) = pair(64, slot_size(64, 128, 253));
        let writer = std::thread::spawn(move || {
            for i in 0..20_000 {
                w.publish(&note(i)).unwrap();
            }
            w.close().unwrap();
        });
        let (mut seen, mut lost) = (0u64, 0u64);
        loop {
            match r.next_timeout(Duration::from_micros(50), Duration::from_secs(60)) {
                Ok(Some(n)) => {
                    assert_eq!(n, RingNote { seq: n.seq, ..note(n.seq) }, "a torn slot");
                    seen += 1;
                }
                Err(RingError::Lagged(k)) => lost += k,
                Err(RingError::Closed) => break,
                other => panic!("{other:?}"),
            }
        }
        writer.join().unwrap();
        assert_eq!(seen + lost, 20_000);
    }
}
