//! The notification bookkeeping a grant keeps, with no I/O: counting a one-shot grant's markers
//! until its notification may be published ([`PendingNote`]), and a channel grant's window of
//! batches, each published once its tag was announced and all its markers arrived
//! ([`ChannelNotes`]). What a peer sends (immediates, sequence numbers, tags) is bounded here:
//! nothing outside the window is kept. Publishing is the caller's (the notification hub), and so is
//! the clock: a marker is counted with the time it arrived, which the delay histogram starts from.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// A one-shot grant's notification until it is published: its tag, the slot its markers name,
/// how many of them arrived and when the first did. (A channel grant keeps [`ChannelNotes`].)
#[derive(Debug)]
pub struct PendingNote {
    /// Markers name it by this (set by the grant table when the grant is inserted; never 0).
    pub slot: u32,
    pub tag: Vec<u8>,
    /// Markers to wait for: one per QP of the initiator's connection.
    pub markers: u32,
    seen: AtomicU32,
    /// When the first marker arrived (the delay histogram starts there).
    first: Mutex<Option<Instant>>,
    published: AtomicBool,
}

impl PendingNote {
    pub fn new(tag: Vec<u8>, markers: u32) -> PendingNote {
        PendingNote {
            slot: 0,
            tag,
            markers: markers.max(1),
            seen: AtomicU32::new(0),
            first: Mutex::new(None),
            published: AtomicBool::new(false),
        }
    }

    /// Counts one marker that arrived at `now`; true when it was the last one expected.
    pub fn marker(&self, now: Instant) -> bool {
        if let Ok(mut f) = self.first.lock() {
            f.get_or_insert(now);
        }
        self.seen.fetch_add(1, Ordering::AcqRel).saturating_add(1) == self.markers
    }

    /// Claims the right to publish (true once).
    pub fn claim(&self) -> bool {
        !self.published.swap(true, Ordering::AcqRel)
    }

    pub fn is_published(&self) -> bool {
        self.published.load(Ordering::Acquire)
    }

    /// When the first marker arrived, if one did.
    pub fn started(&self) -> Option<Instant> {
        self.first.lock().ok().and_then(|f| *f)
    }
}

/// Marker immediates of channel grants have this bit set; the grant's channel slot is in bits
/// 16..31 and the batch's sequence number (mod 2^16) in bits 0..16. Plain slots stay below it.
pub const CHANNEL_BIT: u32 = 1 << 31;
/// Channel slots are 1..=this (15 bits).
pub const MAX_CHANNEL_SLOT: u32 = 0x7fff;
/// Batches of one channel whose notification may be outstanding at once (announced or marked
/// but not yet published). Below 2^15, so that 16 bits of sequence number name one batch.
pub const CHANNEL_WINDOW: u64 = 1024;
/// Tag bytes one channel grant keeps for batches announced but not yet published (an announce
/// is always taken when none is kept, so a tag of any allowed size fits). The window alone
/// bounded the *count*: 1024 tags of `transfer.max_notify_bytes` per channel grant, times
/// `limits.max_grants_per_peer`, let one peer identity park 1 GiB in this agent at the defaults
/// (64 GiB at the tag ceiling) by announcing batches it never marks. An honest initiator has one
/// or two batches announced and unpublished at a time.
pub const CHANNEL_TAG_BYTES: usize = 64 << 10;

/// The immediate a marker of batch `seq` carries on a channel whose grant's slot base is `base`
/// (`CHANNEL_BIT | slot << 16`, what `GrantResponse.notify_slot` says).
pub fn channel_imm(base: u32, seq: u64) -> u32 {
    base | (seq & 0xffff) as u32
}

/// Why a channel marker or announcement was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChannelRefusal {
    #[error("the marker names another channel")]
    WrongChannel,
    #[error("batch {0} is outside the window of {CHANNEL_WINDOW} batches not yet notified")]
    OutOfWindow(u64),
    #[error("batch {0} was already notified")]
    AlreadyPublished(u64),
    #[error("batch {0} was already announced")]
    AlreadyAnnounced(u64),
    #[error("batch {0}: the channel already keeps {CHANNEL_TAG_BYTES} bytes of tags of batches announced and not yet notified")]
    TagBudget(u64),
}

/// A channel grant's per-batch notifications (`NotifyRequest.channel`). Batch `seq` is
/// published once its tag was announced (`Peer.Announce`) and all `markers` of it arrived, in
/// whichever order: the markers ride the fabric behind the batch's data, the announcement the
/// control plane, and neither waits for the other. At most [`CHANNEL_WINDOW`] batches from the
/// oldest unpublished one on are tracked; anything outside is refused, so a peer cannot grow
/// this state.
#[derive(Debug)]
pub struct ChannelNotes {
    /// `CHANNEL_BIT | slot << 16`, set by the grant table when the grant is inserted.
    pub base_imm: u32,
    /// Markers per batch: one per QP of the grantee's connection.
    pub markers: u32,
    window: Mutex<Window>,
}

#[derive(Debug, Default)]
struct Window {
    /// The oldest batch not yet published.
    base: u64,
    entries: BTreeMap<u64, Entry>,
    /// Published batches above `base` (batches may complete out of order).
    published: BTreeSet<u64>,
    /// Bytes of the tags in `entries` (at most [`CHANNEL_TAG_BYTES`] once more than one).
    tag_bytes: usize,
}

#[derive(Debug, Default)]
struct Entry {
    tag: Option<Vec<u8>>,
    seen: u32,
    first: Option<Instant>,
}

/// A batch ready to publish: its tag and when its first marker came.
pub type Ready = (Vec<u8>, Option<Instant>);

impl ChannelNotes {
    pub fn new(markers: u32) -> ChannelNotes {
        ChannelNotes { base_imm: 0, markers: markers.max(1), window: Mutex::new(Window::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Window> {
        self.window.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One marker with immediate `imm`, arrived at `now`. `Ok(Some(..))` when it completed its batch.
    ///
    /// A marker beyond a batch's count — for a batch that has all its markers, or was already
    /// published, even one the window has moved past — is taken and ignored (`Ok(None)`): an
    /// initiator that lost a path re-sends the markers no completion confirmed, and the original
    /// may have landed anyway. It counts toward nothing (the count stays at `markers`), and
    /// refusing it would fail the initiator's batch after its notification was right.
    pub fn marker(&self, imm: u32, now: Instant) -> Result<Option<Ready>, ChannelRefusal> {
        if imm & 0xffff_0000 != self.base_imm {
            return Err(ChannelRefusal::WrongChannel);
        }
        let mut w = self.lock();
        // The one batch in the window whose number ends in these 16 bits.
        let off = (imm as u16).wrapping_sub(w.base as u16) as u64;
        if off >= CHANNEL_WINDOW {
            // Or one of the window's width behind it: those were all published.
            let behind = (1u64 << 16) - off;
            if behind <= CHANNEL_WINDOW && behind <= w.base {
                return Ok(None);
            }
            return Err(ChannelRefusal::OutOfWindow(w.base + off));
        }
        let seq = w.base + off;
        if w.published.contains(&seq) {
            return Ok(None);
        }
        let e = w.entries.entry(seq).or_default();
        if e.seen >= self.markers {
            return Ok(None);
        }
        e.seen += 1;
        e.first.get_or_insert(now);
        Ok(Self::take_if_ready(&mut w, seq, self.markers))
    }

    /// The tag of batch `seq`. `Ok(Some(..))` when its markers had all arrived already.
    pub fn announce(&self, seq: u64, tag: Vec<u8>) -> Result<Option<Ready>, ChannelRefusal> {
        let mut w = self.lock();
        if seq < w.base || w.published.contains(&seq) {
            return Err(ChannelRefusal::AlreadyPublished(seq));
        }
        if seq - w.base >= CHANNEL_WINDOW {
            return Err(ChannelRefusal::OutOfWindow(seq));
        }
        if w.entries.get(&seq).is_some_and(|e| e.tag.is_some()) {
            return Err(ChannelRefusal::AlreadyAnnounced(seq));
        }
        if w.tag_bytes > 0 && w.tag_bytes.saturating_add(tag.len()) > CHANNEL_TAG_BYTES {
            return Err(ChannelRefusal::TagBudget(seq));
        }
        w.tag_bytes += tag.len();
        let e = w.entries.entry(seq).or_default();
        e.tag = Some(tag);
        Ok(Self::take_if_ready(&mut w, seq, self.markers))
    }

    /// Batch `seq` counts as fully marked without its markers: its initiator held them back after
    /// a path failed over and this agent checked the batch's bytes end to end instead.
    /// `Ok(Some(..))` when its tag was announced (it is ready now).
    pub fn settle(&self, seq: u64) -> Result<Option<Ready>, ChannelRefusal> {
        let mut w = self.lock();
        if seq < w.base || w.published.contains(&seq) {
            return Err(ChannelRefusal::AlreadyPublished(seq));
        }
        if seq - w.base >= CHANNEL_WINDOW {
            return Err(ChannelRefusal::OutOfWindow(seq));
        }
        let e = w.entries.entry(seq).or_default();
        e.seen = self.markers;
        Ok(Self::take_if_ready(&mut w, seq, self.markers))
    }

    fn take_if_ready(w: &mut Window, seq: u64, markers: u32) -> Option<Ready> {
        let ready = w.entries.get(&seq).is_some_and(|e| e.tag.is_some() && e.seen == markers);
        if !ready {
            return None;
        }
        let e = w.entries.remove(&seq)?;
        w.tag_bytes -= e.tag.as_ref().map_or(0, Vec::len);
        w.published.insert(seq);
        while w.published.remove(&w.base) {
            w.base += 1;
        }
        Some((e.tag?, e.first))
    }

    /// Batches announced or marked and not yet published (tests, metrics).
    pub fn unpublished(&self) -> usize {
        self.lock().entries.len()
    }

    /// True while a batch is expected to complete: one was announced or marked and is not yet
    /// published, or none has been published yet (a fresh channel's first batch is coming).
    pub fn expecting(&self) -> bool {
        let w = self.lock();
        !w.entries.is_empty() || (w.base == 0 && w.published.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chan(markers: u32) -> ChannelNotes {
        ChannelNotes { base_imm: CHANNEL_BIT | 7 << 16, ..ChannelNotes::new(markers) }
    }

    /// A batch is ready once announced and fully marked, in either order; batches complete out of
    /// order and each is published once.
    #[test]
    fn a_channel_batch_needs_its_tag_and_every_marker_in_any_order() {
        let c = chan(2);
        let imm = |seq| channel_imm(c.base_imm, seq);
        // Batch 0: markers first.
        assert_eq!(c.marker(imm(0), Instant::now()), Ok(None));
        assert_eq!(c.marker(imm(0), Instant::now()), Ok(None), "two markers, no tag yet");
        assert_eq!(c.announce(0, b"b0".to_vec()).unwrap().map(|r| r.0), Some(b"b0".to_vec()));
        // Batch 2 before batch 1: announcement first.
        assert_eq!(c.announce(2, b"b2".to_vec()), Ok(None));
        assert_eq!(c.marker(imm(2), Instant::now()), Ok(None));
        assert_eq!(c.marker(imm(2), Instant::now()).unwrap().map(|r| r.0), Some(b"b2".to_vec()));
        assert_eq!(c.announce(1, b"b1".to_vec()), Ok(None));
        assert_eq!(c.marker(imm(1), Instant::now()), Ok(None));
        assert_eq!(c.marker(imm(1), Instant::now()).unwrap().map(|r| r.0), Some(b"b1".to_vec()));
        assert_eq!(c.unpublished(), 0);
        // Published batches stay published.
        assert_eq!(c.announce(1, b"again".to_vec()), Err(ChannelRefusal::AlreadyPublished(1)));
        assert_eq!(c.announce(2, b"again".to_vec()), Err(ChannelRefusal::AlreadyPublished(2)));
        assert_eq!(c.lock().base, 3, "the window moved past every published batch");
    }

    /// A batch settled after a failover is published once, with its tag, whether the tag or the
    /// settlement came first; settling a published or far-away batch is refused.
    #[test]
    fn a_settled_batch_is_published_once_with_its_tag() {
        let c = chan(3);
        let imm = |seq| channel_imm(c.base_imm, seq);
        assert_eq!(c.announce(0, b"b0".to_vec()), Ok(None));
        assert_eq!(c.marker(imm(0), Instant::now()), Ok(None), "one marker of three landed before the failover");
        assert_eq!(c.settle(0).unwrap().map(|r| r.0), Some(b"b0".to_vec()));
        assert_eq!(c.settle(0), Err(ChannelRefusal::AlreadyPublished(0)));
        assert_eq!(c.marker(imm(0), Instant::now()), Ok(None), "a late marker counts toward nothing");
        assert_eq!(c.settle(1), Ok(None), "settled before its tag: ready once announced");
        assert_eq!(c.announce(1, b"b1".to_vec()).unwrap().map(|r| r.0), Some(b"b1".to_vec()));
        assert_eq!(c.settle(5000), Err(ChannelRefusal::OutOfWindow(5000)));
        assert_eq!(c.unpublished(), 0);
    }

    /// A channel expects a batch until its first is published, and afterwards only while one is
    /// announced or marked and not yet published (what the marker poller is told).
    #[test]
    fn a_channel_expects_markers_for_its_first_batch_and_for_unpublished_ones() {
        let c = chan(1);
        assert!(c.expecting(), "a fresh channel's first batch is coming");
        assert_eq!(c.announce(0, b"b0".to_vec()), Ok(None));
        assert!(c.expecting());
        assert!(c.marker(channel_imm(c.base_imm, 0), Instant::now()).unwrap().is_some());
        assert!(!c.expecting(), "batch 0 published, nothing else announced");
        assert_eq!(c.marker(channel_imm(c.base_imm, 1), Instant::now()), Ok(None), "marker before its announce");
        assert!(c.expecting());
        assert!(c.announce(1, vec![]).unwrap().is_some());
        assert!(!c.expecting());
    }

    /// What a peer controls (immediates, sequence numbers, how often it repeats them) cannot grow
    /// the state past the window or publish anything twice.
    #[test]
    fn a_channel_refuses_what_lies_outside_its_window() {
        let c = chan(1);
        let imm = |seq| channel_imm(c.base_imm, seq);
        assert_eq!(c.marker(CHANNEL_BIT | 8 << 16, Instant::now()), Err(ChannelRefusal::WrongChannel));
        assert_eq!(c.marker(5, Instant::now()), Err(ChannelRefusal::WrongChannel), "a plain slot");
        assert_eq!(c.announce(CHANNEL_WINDOW, b"x".to_vec()), Err(ChannelRefusal::OutOfWindow(CHANNEL_WINDOW)));
        assert_eq!(c.marker(imm(CHANNEL_WINDOW), Instant::now()), Err(ChannelRefusal::OutOfWindow(CHANNEL_WINDOW)));
        assert_eq!(c.marker(imm(0xffff), Instant::now()), Err(ChannelRefusal::OutOfWindow(0xffff)), "behind the base: outside too");
        // Fill the whole window with markers only: bounded.
        for seq in 0..CHANNEL_WINDOW {
            assert_eq!(c.marker(imm(seq), Instant::now()), Ok(None));
        }
        assert_eq!(c.unpublished(), CHANNEL_WINDOW as usize);
        assert_eq!(c.marker(imm(3), Instant::now()), Ok(None), "an extra marker is ignored, not kept");
        assert_eq!(c.unpublished(), CHANNEL_WINDOW as usize);
        assert_eq!(c.announce(3, b"t".to_vec()).unwrap().map(|r| r.0), Some(b"t".to_vec()));
        assert_eq!(c.announce(3, b"t".to_vec()), Err(ChannelRefusal::AlreadyPublished(3)));
        assert_eq!(c.announce(4, b"a".to_vec()).unwrap().map(|r| r.0), Some(b"a".to_vec()));
        assert_eq!(c.announce(4, b"a".to_vec()), Err(ChannelRefusal::AlreadyPublished(4)));
        // Sequence numbers wrap their 16 bits: after 70,000 batches the marker still names one.
        let c = chan(1);
        for seq in 0..70_000u64 {
            assert_eq!(c.announce(seq, vec![]), Ok(None));
            assert!(c.marker(channel_imm(c.base_imm, seq), Instant::now()).unwrap().is_some(), "batch {seq}");
        }
        assert_eq!(c.unpublished(), 0);
    }

    /// Tags of announced, unpublished batches are bounded by bytes; publishing gives room back,
    /// and a refused announce leaves no trace in the window.
    #[test]
    fn a_channel_keeps_a_bounded_number_of_tag_bytes() {
        let c = chan(1);
        let big = |seq: u64| vec![seq as u8; 1024];
        for seq in 0..64 {
            assert_eq!(c.announce(seq, big(seq)), Ok(None));
        }
        assert_eq!(c.announce(64, big(64)), Err(ChannelRefusal::TagBudget(64)));
        assert_eq!(c.unpublished(), 64, "the refused announce left no entry");
        assert_eq!(c.announce(64, vec![]), Ok(None), "an empty tag still fits");
        assert_eq!(c.marker(channel_imm(c.base_imm, 5), Instant::now()).unwrap().map(|r| r.0), Some(big(5)));
        assert_eq!(c.announce(65, big(65)), Ok(None), "room again");
        assert_eq!(c.announce(66, big(66)), Err(ChannelRefusal::TagBudget(66)));
        // One tag is always taken, whatever its size.
        let c = chan(1);
        assert_eq!(c.announce(0, vec![0; CHANNEL_TAG_BYTES + 1]), Ok(None));
        assert_eq!(c.announce(1, vec![1]), Err(ChannelRefusal::TagBudget(1)));
    }

    /// Markers beyond a batch's count (an initiator re-sent those a dead path did not confirm,
    /// and the originals landed too) are taken and ignored: before the announce, after the
    /// publish, and once the window moved past the batch. They never count toward another batch.
    #[test]
    fn extra_markers_of_a_batch_are_harmless() {
        let c = chan(2);
        let imm = |seq| channel_imm(c.base_imm, seq);
        // Three markers for batch 0 before its tag: the third is ignored.
        for _ in 0..3 {
            assert_eq!(c.marker(imm(0), Instant::now()), Ok(None));
        }
        assert_eq!(c.announce(0, b"b0".to_vec()).unwrap().map(|r| r.0), Some(b"b0".to_vec()));
        // After its publish, with batch 1 in flight: ignored, and batch 1 still needs two.
        assert_eq!(c.announce(1, b"b1".to_vec()), Ok(None));
        assert_eq!(c.marker(imm(0), Instant::now()), Ok(None));
        assert_eq!(c.marker(imm(1), Instant::now()), Ok(None), "batch 1's first of two");
        assert_eq!(c.marker(imm(1), Instant::now()).unwrap().map(|r| r.0), Some(b"b1".to_vec()));
        // The window has moved past 0 and 1: their late markers are ignored too, and batch 2
        // still needs both of its own.
        assert_eq!(c.lock().base, 2);
        assert_eq!(c.marker(imm(0), Instant::now()), Ok(None));
        assert_eq!(c.marker(imm(1), Instant::now()), Ok(None));
        assert_eq!(c.announce(2, b"b2".to_vec()), Ok(None));
        assert_eq!(c.marker(imm(2), Instant::now()), Ok(None));
        assert_eq!(c.unpublished(), 1);
        assert_eq!(c.marker(imm(2), Instant::now()).unwrap().map(|r| r.0), Some(b"b2".to_vec()));
        // Far behind (more than a window) is still outside.
        for seq in 3..3 + CHANNEL_WINDOW + 10 {
            assert_eq!(c.announce(seq, vec![]), Ok(None));
            assert_eq!(c.marker(imm(seq), Instant::now()), Ok(None));
            assert!(c.marker(imm(seq), Instant::now()).unwrap().is_some());
        }
        assert!(matches!(c.marker(imm(0), Instant::now()), Err(ChannelRefusal::OutOfWindow(_))));
    }

    /// A hostile initiator with markers now taken when extra: thousands of repeats of one
    /// batch's marker, on any QP of any path, neither publish it before its announce, nor
    /// publish it twice, nor count toward the next batch, nor keep more than one entry.
    #[test]
    fn repeated_markers_never_fire_early_twice_or_for_another_batch() {
        let c = chan(4);
        let imm = |seq| channel_imm(c.base_imm, seq);
        for _ in 0..10_000 {
            assert_eq!(c.marker(imm(0), Instant::now()), Ok(None), "no tag: never published");
        }
        assert_eq!(c.unpublished(), 1, "one entry however many markers");
        assert_eq!(c.lock().entries.get(&0).map(|e| e.seen), Some(4), "the count stops at the batch's markers");
        // Batch 1 announced with none of its markers: batch 0's extras do not complete it.
        assert_eq!(c.announce(1, b"b1".to_vec()), Ok(None));
        for _ in 0..100 {
            assert_eq!(c.marker(imm(0), Instant::now()), Ok(None));
        }
        assert_eq!(c.lock().entries.get(&1).map(|e| e.seen), Some(0));
        // Batch 0 is published once, at its announce, and its extras after that change nothing.
        assert_eq!(c.announce(0, b"b0".to_vec()).unwrap().map(|r| r.0), Some(b"b0".to_vec()));
        for _ in 0..100 {
            assert_eq!(c.marker(imm(0), Instant::now()), Ok(None));
        }
        assert_eq!(c.announce(0, b"b0".to_vec()), Err(ChannelRefusal::AlreadyPublished(0)));
        assert_eq!(c.unpublished(), 1, "only batch 1 waits");
        // Markers naming batches up to the window's edge are bounded by the window.
        for seq in 2..CHANNEL_WINDOW + 1 {
            for _ in 0..5 {
                assert_eq!(c.marker(imm(seq), Instant::now()), Ok(None));
            }
        }
        assert_eq!(c.unpublished(), CHANNEL_WINDOW as usize);
        assert!(c.marker(imm(CHANNEL_WINDOW + 1), Instant::now()).is_err(), "past the window");
        // A one-shot note: extras after its N-th marker never fire it again.
        let n = PendingNote::new(b"t".to_vec(), 2);
        assert!(!n.marker(Instant::now()));
        assert!(n.marker(Instant::now()));
        assert!((0..10_000).all(|_| !n.marker(Instant::now())));
    }

    /// A one-shot grant's count fires once, at its N-th marker; extras change nothing.
    #[test]
    fn a_pending_note_fires_at_its_last_marker_only() {
        let n = PendingNote::new(b"t".to_vec(), 2);
        assert!(!n.marker(Instant::now()));
        assert!(n.marker(Instant::now()));
        assert!(!n.marker(Instant::now()), "an extra marker does not fire it again");
        assert!(n.claim() && !n.claim());
    }
}
