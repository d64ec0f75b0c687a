//! The ring's format: the header and slot offsets, the notification as the ring carries it
//! ([`RingNote`]), the size rules, and the error both ends report.

use crate::memory::MemError;

pub const MAGIC: [u8; 8] = *b"XFERRING";
pub const VERSION: u32 = 1;
/// Header bytes before slot 0.
pub const HEADER: u64 = 256;
/// Bytes of a slot before its variable part.
pub const SLOT_FIXED: u64 = 64;
pub(super) const OFF_VERSION: u64 = 8;
pub(super) const OFF_SLOT_SIZE: u64 = 12;
pub(super) const OFF_SLOTS: u64 = 16;
pub(super) const OFF_FLAGS: u64 = 20;
pub(super) const OFF_HEAD: u64 = 64;
pub(super) const OFF_WAKE: u64 = 128;
pub(super) const OFF_WAITERS: u64 = 132;
pub(super) const FLAG_CLOSED: u32 = 1;
/// Largest tag a ring carries (the agent's `transfer.max_notify_bytes` ceiling).
pub const MAX_TAG: usize = 64 << 10;
/// Largest slot: the largest tag and two names of at most `u16::MAX` bytes.
pub const MAX_SLOT_SIZE: u32 = ((SLOT_FIXED as usize + MAX_TAG + 2 * u16::MAX as usize).div_ceil(64) * 64) as u32;
/// Fewest and most slots a ring may have.
pub const MIN_SLOTS: u32 = 16;
pub const MAX_SLOTS: u32 = 1 << 16;

/// Why a ring cannot be used, or what a reader missed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    #[error("not a notification ring: {0}")]
    Format(String),
    #[error("the reader fell behind and lost {0} notifications")]
    Lagged(u64),
    #[error("the agent closed the ring")]
    Closed,
    #[error("ring memory: {0}")]
    Memory(#[from] MemError),
}

/// Which operation a notification is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingOp {
    Write = 1,
    Read = 2,
}

/// How the agent knew the batch was complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingVia {
    Fabric = 1,
    Complete = 2,
}

/// One notification as the ring carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingNote {
    /// Its number in the ring (0-based).
    pub seq: u64,
    pub at_unix_ns: u64,
    pub offset: u64,
    pub length: u64,
    pub op: RingOp,
    pub via: RingVia,
    pub tag: Vec<u8>,
    pub region: String,
    pub peer: String,
}

/// The slot size that holds a tag of `max_tag` bytes, a region name of `max_region` and a peer
/// name of `max_peer` (rounded up to 64 bytes).
pub fn slot_size(max_tag: usize, max_region: usize, max_peer: usize) -> u32 {
    let need = SLOT_FIXED as usize + max_tag + max_region + max_peer;
    need.div_ceil(64).saturating_mul(64).min(u32::MAX as usize) as u32
}

/// Bytes a ring of `slots` slots of `slot_size` takes.
pub fn ring_len(slots: u32, slot_size: u32) -> u64 {
    HEADER + u64::from(slots) * u64::from(slot_size)
}

/// Checks a slot size: a multiple of 64 from [`SLOT_FIXED`] to [`MAX_SLOT_SIZE`].
pub(super) fn check_slot_size(slot_size: u32) -> Result<(), RingError> {
    if slot_size < SLOT_FIXED as u32 || slot_size > MAX_SLOT_SIZE || !slot_size.is_multiple_of(64) {
        return Err(RingError::Format(format!("slot size {slot_size}: a multiple of 64 from {SLOT_FIXED} to {MAX_SLOT_SIZE}")));
    }
    Ok(())
}

/// Checks a slot count: a power of two in `MIN_SLOTS..=MAX_SLOTS`.
pub fn check_slots(slots: u32) -> Result<(), String> {
    if !(MIN_SLOTS..=MAX_SLOTS).contains(&slots) || !slots.is_power_of_two() {
        return Err(format!("a ring has a power of two of slots between {MIN_SLOTS} and {MAX_SLOTS}, not {slots}"));
    }
    Ok(())
}
