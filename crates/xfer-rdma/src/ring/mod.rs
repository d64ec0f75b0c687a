//! The notification ring: target-side notifications published by the agent into a
//! shared-memory object that a local application maps and polls — no gRPC message, no socket,
//! no wake-up of the agent per notification (`Agent.WatchInboundRing`).
//!
//! Safe code over [`RegionMemory`](crate::memory::RegionMemory)'s atomic word accessors: the agent writes with
//! [`RingWriter`], the client crate reads with [`RingReader`], and Python reads the same layout
//! (`python/xfer/ring.py`). One writer per ring (the agent serializes its publications), any
//! number of readers, none of which can disturb the writer or each other: a reader only loads.
//!
//! # Layout (version 1, little-endian, offsets in bytes)
//! Header, [`HEADER`] bytes:
//! * 0: magic `XFERRING`; 8: version (u32, 1); 12: slot size (u32, a multiple of 64);
//!   16: slots (u32, a power of two); 20: flags (u32; bit 0: closed — the agent ended the
//!   subscription and writes nothing more).
//! * 64: head (u64): notifications published so far. Notification `n` (0-based) lives in slot
//!   `n % slots`.
//! * 128: wake (u32): bumped after every publication and on close; readers sleep on it
//!   (`FUTEX_WAIT`). 132: waiters (u32): readers sleeping; the writer calls `FUTEX_WAKE` only
//!   when there is one.
//!
//! Slot `i` at `HEADER + i * slot_size`:
//! * 0: seq (u64): `n + 1` once notification `n` is complete in the slot; 0 while it is being
//!   written (a seqlock: a reader copies the slot between two loads of seq and keeps the copy
//!   only if both are `n + 1`).
//! * 8: `at` (u64, ns since the Unix epoch: when the agent published it); 16: offset (u64);
//!   24: length (u64); 32: op (u8: 1 WRITE, 2 READ); 33: via (u8: 1 fabric, 2 complete);
//!   34: reserved (u16, 0); 36: region name length (u16); 38: peer name length (u16);
//!   40: tag length (u32: tags reach 64 KiB, `transfer.max_notify_bytes`'s ceiling).
//! * 64: the tag, then the region's name, then the peer's name.
//!
//! Slots are at most [`MAX_SLOT_SIZE`] bytes: what the largest tag and names need.
//!
//! A reader that falls more than `slots` behind has lost the oldest notifications: it is told
//! how many ([`RingError::Lagged`]) and goes on from the oldest one still in the ring.
//!
//! `layout.rs` holds the format, `writer.rs` the agent's end and `reader.rs` the application's.
#![forbid(unsafe_code)]

mod layout;
mod reader;
#[cfg(test)]
mod test_pair;
mod writer;

pub use layout::{
    check_slots, ring_len, slot_size, RingError, RingNote, RingOp, RingVia, HEADER, MAGIC, MAX_SLOTS, MAX_SLOT_SIZE, MAX_TAG, MIN_SLOTS,
    SLOT_FIXED, VERSION,
};
pub use reader::{RingReader, RingWaiter};
pub use writer::RingWriter;
