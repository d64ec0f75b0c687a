//! Adversarial tests of the target's frame loop on its fast paths: payloads read straight from
//! the socket into region memory, payloads already buffered in full (stored without the
//! revocation watch), headers read on their own behind a straight-in payload, and a writer that
//! sends a header and a large payload in one vectored write. Each pins a promise of the tcp
//! fabric's threat model: no byte lands after a revocation returns, nothing lands outside a
//! grant, and the stream never misreads a frame boundary.
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use xfer_rdma::memory::RegionMemory;

use super::qp::TcpQp;
use super::registration;
use super::serve::{serve_frames, serve_frames_idle, ServeError, StreamTimers};
use crate::frame::{Header, Kind, ACK_REQUESTED, HEADER_LEN};
use crate::grant::{AccessCheck, Checked, GrantGate};
use crate::{Access, RemoteKey, RemoteOp, WcStatus, WorkRequest, WrOp};
use xfer_engine::ids::ConnectionId;

const TOKEN: [u8; 16] = [0x5c; 16];
/// The region: 2 MiB of zeros.
const REGION: usize = 2 << 20;

/// One WRITE grant over `0..grant` of a zeroed region of [`REGION`] bytes. With `revoke_in_check`
/// the grant is revoked right after it is checked (and before `check` returns): a revocation
/// that lands between a frame's check and its payload, the race the fast paths must lose.
struct WriteGrant {
    memory: Arc<RegionMemory>,
    gate: Arc<GrantGate>,
    grant: u64,
    revoke_in_check: AtomicBool,
    /// The grant also allows READs.
    reads: AtomicBool,
}

impl WriteGrant {
    fn new(grant: u64) -> Arc<WriteGrant> {
        Arc::new(WriteGrant {
            memory: Arc::new(RegionMemory::anonymous(REGION, false).expect("a 2 MiB mapping")),
            gate: GrantGate::new(std::time::SystemTime::now() + Duration::from_secs(3600)),
            grant,
            revoke_in_check: AtomicBool::new(false),
            reads: AtomicBool::new(false),
        })
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; REGION];
        self.memory.read_at(0, &mut b).expect("read back");
        b
    }
}

impl AccessCheck for WriteGrant {
    fn check(&self, _: &ConnectionId, token: &[u8; 16], addr: u64, len: u64, op: RemoteOp) -> Result<Checked, WcStatus> {
        let allowed = op == RemoteOp::Write || (op == RemoteOp::Read && self.reads.load(Ordering::SeqCst));
        if token != &TOKEN || !allowed || addr.checked_add(len).is_none_or(|end| end > self.grant) {
            return Err(WcStatus::RemAccessErr);
        }
        let checked = Checked { memory: self.memory.clone(), offset: addr, gate: self.gate.clone(), window: None };
        if self.revoke_in_check.load(Ordering::SeqCst) {
            self.gate.revoke();
        }
        Ok(checked)
    }

    fn marker(&self, _: &ConnectionId, _: &[u8; 16], _: u32) -> Result<(), WcStatus> {
        Ok(())
    }
}

fn connection() -> ConnectionId {
    ConnectionId::parse("redteam-conn").expect("valid id")
}

fn write_frame(id: u64, addr: u64, len: u32, fill: u8) -> Vec<u8> {
    let mut h = Header::new(Kind::Write, id);
    h.addr = addr;
    h.len = len;
    h.token = TOKEN;
    h.flags |= ACK_REQUESTED;
    let mut f = h.encode().to_vec();
    f.resize(HEADER_LEN + len as usize, fill);
    f
}

/// The answers in `out`, as (kind, id, status).
fn answers(out: &[u8]) -> Vec<(Kind, u64, u16)> {
    out.chunks(HEADER_LEN)
        .map(|c| {
            let h = Header::decode(c.try_into().expect("whole headers only")).expect("decodes");
            (h.kind, h.id, h.status)
        })
        .collect()
}

/// A revocation that lands between a WRITE's check and its payload: whether the payload is
/// already buffered in full (stored without the revocation watch), or large and read straight
/// from the socket into region memory, not one byte of it lands, and the stream is closed as
/// revoked.
#[tokio::test]
async fn a_revocation_after_the_check_lands_no_byte_of_a_buffered_or_straight_in_payload() {
    for len in [4096u32, 40 << 10, 1 << 20] {
        let grants = WriteGrant::new(REGION as u64);
        grants.revoke_in_check.store(true, Ordering::SeqCst);
        let input = write_frame(1, 0, len, 0xaa);
        let mut out = Vec::new();
        let r = serve_frames(&input[..], &mut out, &*grants, &connection()).await;
        assert!(matches!(r, Err(ServeError::Revoked)), "{len} bytes: {r:?}");
        assert!(grants.bytes().iter().all(|b| *b == 0), "{len} bytes: a byte landed after the revocation returned");
        assert!(answers(&out).iter().all(|a| a.0 != Kind::Ack), "{len} bytes: acknowledged: {:?}", answers(&out));
    }
}

/// READ requests whose answers are queued for one gathered write, the grant revoked in the
/// check of the last: every answer was still queued (none had started to leave) when the
/// revocation returned, so no READ_RESP header and no byte of the region leaves, and the stream
/// closes as revoked. (An answer that already started is finished: its header promised it.)
#[tokio::test]
async fn read_answers_queued_when_their_grant_is_revoked_never_leave() {
    let grants = WriteGrant::new(REGION as u64);
    grants.reads.store(true, Ordering::SeqCst);
    grants.memory.write_at(0, &[0x3c; 64 << 10]).expect("fill");
    let mut input = Vec::new();
    for (id, len) in [(1u64, 4096u32), (2, 40 << 10), (3, 64 << 10)] {
        let mut h = Header::new(Kind::ReadReq, id);
        (h.addr, h.len, h.token) = (0, len, TOKEN);
        input.extend_from_slice(&h.encode());
    }
    // The revocation lands inside the third request's check: the first two are already queued.
    let checks = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let revoking = RevokeAtCheck { inner: grants.clone(), at: 3, checks: checks.clone() };
    let mut out = Vec::new();
    let r = serve_frames(&input[..], &mut out, &revoking, &connection()).await;
    assert!(matches!(r, Err(ServeError::Revoked)), "{r:?}");
    assert_eq!(checks.load(Ordering::SeqCst), 3);
    assert!(
        out.len() < HEADER_LEN
            || !out
                .chunks(HEADER_LEN)
                .any(|c| c.len() == HEADER_LEN && Header::decode(c.try_into().expect("a header")).is_ok_and(|h| h.kind == Kind::ReadResp)),
        "an answer left after the revocation: {} bytes",
        out.len()
    );
    assert!(!out.windows(64).any(|w| w.iter().all(|b| *b == 0x3c)), "region bytes left after the revocation");
}

/// Revokes the grant of `inner` inside its `at`-th check.
struct RevokeAtCheck {
    inner: Arc<WriteGrant>,
    at: usize,
    checks: Arc<std::sync::atomic::AtomicUsize>,
}

impl AccessCheck for RevokeAtCheck {
    fn check(&self, c: &ConnectionId, token: &[u8; 16], addr: u64, len: u64, op: RemoteOp) -> Result<Checked, WcStatus> {
        let checked = self.inner.check(c, token, addr, len, op);
        if self.checks.fetch_add(1, Ordering::SeqCst) + 1 == self.at {
            self.inner.gate.revoke();
        }
        checked
    }

    fn marker(&self, c: &ConnectionId, token: &[u8; 16], imm: u32) -> Result<(), WcStatus> {
        self.inner.marker(c, token, imm)
    }
}

/// A revocation in the middle of a large payload being read straight from the socket into
/// region memory: the bytes received before it may have landed, none sent after it does, and
/// the stream is closed as revoked.
#[tokio::test]
async fn a_revocation_mid_payload_cuts_a_straight_in_payload_at_once() {
    let grants = WriteGrant::new(REGION as u64);
    // A small pipe: the initiator's writes return only once the target has read all but 4 KiB.
    let (mut ours, theirs) = tokio::io::duplex(4096);
    let (rd, wr) = tokio::io::split(theirs);
    let served = {
        let grants = grants.clone();
        tokio::spawn(async move { serve_frames(rd, wr, &*grants, &connection()).await })
    };
    let len = 1u32 << 20;
    let before = 256usize << 10;
    let frame = write_frame(1, 0, len, 0xaa);
    ours.write_all(&frame[..HEADER_LEN + before]).await.expect("header and first part");
    // The target reads on this (single) thread only while we wait: it is not inside a chunk now.
    grants.gate.revoke();
    // The rest of the payload, marked: none of it may land.
    let rest = vec![0xbbu8; len as usize - before];
    let _ = ours.write_all(&rest).await;
    drop(ours);
    let r = served.await.expect("the serving task");
    assert!(matches!(r, Err(ServeError::Revoked)), "{r:?}");
    let bytes = grants.bytes();
    assert!(!bytes.contains(&0xbb), "a byte sent after the revocation returned landed");
    assert!(bytes[..before - 4096].iter().all(|b| *b == 0xaa), "the bytes received before the revocation landed");
}

/// WRITEs whose length exceeds their grant, or the region, sent as large payloads (the size that
/// would be read straight into region memory): each is refused with a NAK, none of its bytes
/// lands anywhere, and the stream stays in sync: the WRITE behind them lands and is ACKed.
#[tokio::test]
async fn a_large_write_past_its_grant_or_region_is_refused_and_lands_nothing() {
    let grant = 64u64 << 10;
    let grants = WriteGrant::new(grant);
    let mut input = Vec::new();
    input.extend(write_frame(1, 0, 128 << 10, 0xa1)); // twice the grant
    input.extend(write_frame(2, grant - 4096, 1 << 20, 0xa2)); // starts inside, runs past it
    input.extend(write_frame(3, REGION as u64 - 4096, 64 << 10, 0xa3)); // past the region
    input.extend(write_frame(4, u64::MAX - 10, 32 << 10, 0xa4)); // an address that wraps
    input.extend(write_frame(5, 100, 16, 0x77)); // in range: lands
    let mut out = Vec::new();
    let r = serve_frames(&input[..], &mut out, &*grants, &connection()).await;
    assert!(r.is_ok(), "{r:?}");
    let rae = WcStatus::RemAccessErr.code();
    let got = answers(&out);
    assert_eq!(got[..4], [(Kind::Nak, 1, rae), (Kind::Nak, 2, rae), (Kind::Nak, 3, rae), (Kind::Nak, 4, rae)], "each refused: {got:?}");
    // Behind a refusal the stream is flushed as an RC QP in error would be, or acknowledged;
    // either way the fifth frame's header was found where it was.
    assert_eq!(got.len(), 5, "{got:?}");
    assert_eq!(got[4].1, 5);
    let bytes = grants.bytes();
    let landed: Vec<usize> = bytes.iter().enumerate().filter(|(_, b)| **b != 0).map(|(i, _)| i).collect();
    assert!(landed.iter().all(|i| (100..116).contains(i)), "bytes outside the last WRITE landed: {} of them", landed.len());
}

/// A socket that hands its bytes over in small, uneven pieces (a slow or hostile initiator, or a
/// congested link): partial reads everywhere, including inside headers behind a straight-in
/// payload.
struct Trickle {
    data: Vec<u8>,
    at: usize,
    step: usize,
}

impl AsyncRead for Trickle {
    fn poll_read(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let sizes = [1usize, 7, 43, 45, 5000, 16 << 10, 3, 70_000, 29];
        let this = &mut *self;
        let n = sizes[this.step % sizes.len()].min(buf.remaining()).min(this.data.len() - this.at);
        this.step += 1;
        buf.put_slice(&this.data[this.at..this.at + n]);
        this.at += n;
        Poll::Ready(Ok(()))
    }
}

/// Large (straight-in) and small (buffered) WRITEs interleaved, over a socket that returns
/// partial reads of every size: every payload lands exactly where its header says, every header
/// is read where it starts (no frame is misparsed from payload bytes), and each WRITE is ACKed
/// in order.
#[tokio::test]
async fn partial_reads_never_shift_a_frame_boundary() {
    let grants = WriteGrant::new(REGION as u64);
    let frames: [(u64, u32, u8); 8] = [
        (0, 300 << 10, 0x11),
        (400 << 10, 44, 0x22),
        (500 << 10, 16 << 10, 0x33),
        (600 << 10, 100_001, 0x44),
        (800 << 10, 1, 0x55),
        (900 << 10, 65_536, 0x66),
        (1000 << 10, (1 << 20) - 7, 0x77),
        ((2 << 20) - 44, 44, 0x88),
    ];
    let mut input = Vec::new();
    for (i, &(addr, len, fill)) in frames.iter().enumerate() {
        input.extend(write_frame(i as u64 + 1, addr, len, fill));
    }
    let mut out = Vec::new();
    let r = serve_frames(Trickle { data: input, at: 0, step: 0 }, &mut out, &*grants, &connection()).await;
    assert!(r.is_ok(), "{r:?}");
    let acks: Vec<(Kind, u64, u16)> = (1..=frames.len() as u64).map(|id| (Kind::Ack, id, 0)).collect();
    assert_eq!(answers(&out), acks);
    let mut expected = vec![0u8; REGION];
    for &(addr, len, fill) in &frames {
        expected[addr as usize..addr as usize + len as usize].fill(fill);
    }
    assert!(grants.bytes() == expected, "a payload landed off its frame's range");
}

/// The initiator's writer over a pipe that takes a few KiB at a time (partial vectored writes):
/// small frames staged, large payloads sent straight from region memory behind their header.
/// Every frame arrives whole and in posting order, none interleaved with another's bytes.
#[tokio::test]
async fn the_vectored_writer_never_mixes_two_frames_bytes() {
    let memory = Arc::new(RegionMemory::anonymous(REGION, false).expect("a 2 MiB mapping"));
    let pattern: Vec<u8> = (0..REGION).map(|i| (i % 251) as u8).collect();
    memory.write_at(0, &pattern).expect("fill");
    let local = registration(memory, Access::ReadWrite);
    let (ours, mut theirs) = tokio::io::duplex(3000);
    let (rd, wr) = tokio::io::split(ours);
    let (sink, _completions) = mpsc::unbounded_channel();
    let cancel = CancellationToken::new();
    let qp = TcpQp::start(0, Box::new(rd), Box::new(wr), sink, Arc::new(AtomicBool::new(false)), cancel.clone());
    let sizes = [16u32, 70_000, 44, 1 << 20, 65_536 - 44, 65_536, 3, 200_000];
    for (i, &len) in sizes.iter().enumerate() {
        let wr = WorkRequest {
            wr_id: i as u64 + 1,
            op: WrOp::Write,
            local: local.clone(),
            local_offset: i as u64 * 97,
            len,
            remote_addr: i as u64,
            remote_key: RemoteKey::Token(TOKEN),
            signaled: false,
        };
        qp.tx.send(vec![wr]).expect("the writer is running");
    }
    for (i, &len) in sizes.iter().enumerate() {
        let mut hb = [0u8; HEADER_LEN];
        theirs.read_exact(&mut hb).await.expect("a header");
        let h = Header::decode(&hb).expect("a header where a frame starts");
        assert_eq!((h.kind, h.id, h.addr, h.len), (Kind::Write, i as u64 + 1, i as u64, len));
        let mut p = vec![0u8; len as usize];
        theirs.read_exact(&mut p).await.expect("its payload");
        let from = i * 97;
        assert!(p == pattern[from..from + len as usize], "frame {} carries another's bytes", i + 1);
    }
    cancel.cancel();
}

/// A hostile initiator that keeps a header half sent: the idle timer still closes the stream
/// (the timer is skipped only for a header already received in full). Virtual time.
#[tokio::test(start_paused = true)]
async fn a_header_half_sent_is_still_under_the_idle_timer() {
    let grants = WriteGrant::new(REGION as u64);
    let (mut ours, theirs) = tokio::io::duplex(1 << 20);
    let (rd, wr) = tokio::io::split(theirs);
    // A whole small frame, then 43 bytes of the next header: the buffer holds more than a
    // header's length at first, never a whole second header.
    let mut input = write_frame(1, 0, 100, 0x10);
    input.extend_from_slice(&write_frame(2, 0, 100, 0x20)[..HEADER_LEN - 1]);
    ours.write_all(&input).await.expect("sent");
    let idle = Duration::from_secs(300);
    let timers = StreamTimers { idle: Some(idle), stall: Some(idle), payload: Some(Duration::from_secs(30)) };
    let r = serve_frames_idle(rd, wr, &*grants, &connection(), timers).await;
    assert!(matches!(r, Err(ServeError::Idle)), "{r:?}");
    drop(ours);
}

/// A WRITE whose header and part of its payload are buffered but whose rest never comes: the
/// payload deadline still closes the stream (the watch is dropped only for a payload buffered in
/// full). Virtual time.
#[tokio::test(start_paused = true)]
async fn a_payload_buffered_in_part_is_still_under_its_deadline() {
    let grants = WriteGrant::new(REGION as u64);
    let (mut ours, theirs) = tokio::io::duplex(1 << 20);
    let (rd, wr) = tokio::io::split(theirs);
    let frame = write_frame(1, 0, 60 << 10, 0x10);
    ours.write_all(&frame[..frame.len() - 1]).await.expect("all but one byte");
    let payload = Duration::from_secs(30);
    let timers = StreamTimers { idle: Some(Duration::from_secs(300)), stall: None, payload: Some(payload) };
    let start = tokio::time::Instant::now();
    let r = serve_frames_idle(rd, wr, &*grants, &connection(), timers).await;
    assert!(matches!(r, Err(ServeError::PayloadTimeout)), "{r:?}");
    // At the payload deadline (a millisecond's rounding of the timer), long before the idle one.
    assert!(start.elapsed() >= payload && start.elapsed() < Duration::from_secs(31), "{:?}", start.elapsed());
    drop(ours);
}

/// The initiator's side of a target that sends a READ answer's header and part of its payload,
/// then stops sending (and keeps the stream open). Closing the connection (a transfer's
/// deadline, a dropped lease) must end the reader, so the READ gets its error completion and
/// the stream's socket and the local region are let go; the reader used to stay inside the
/// payload read for ever, and the READ never completed. Virtual time: a reader that never ends
/// fails the test at the (virtual) ten minutes, not by hanging it.
#[tokio::test(start_paused = true)]
async fn closing_a_connection_ends_a_reader_inside_a_read_answer_the_target_stopped_sending() {
    let (ours, mut theirs) = tokio::io::duplex(1 << 20);
    let (rd, wr) = tokio::io::split(ours);
    let (sink, mut completions) = mpsc::unbounded_channel();
    let cancel = CancellationToken::new();
    let qp = TcpQp::start(0, Box::new(rd), Box::new(wr), sink, Arc::new(AtomicBool::new(false)), cancel.clone());
    let memory = Arc::new(RegionMemory::anonymous(64 << 10, false).expect("a 64 KiB mapping"));
    let local = registration(memory, Access::ReadWrite);
    let len = 64u32 << 10;
    let read = WorkRequest {
        wr_id: 9,
        op: WrOp::Read,
        local,
        local_offset: 0,
        len,
        remote_addr: 0,
        remote_key: RemoteKey::Token(TOKEN),
        signaled: true,
    };
    qp.tx.send(vec![read]).expect("the writer is running");
    let mut hb = [0u8; HEADER_LEN];
    theirs.read_exact(&mut hb).await.expect("the READ request");
    assert_eq!(Header::decode(&hb).expect("decodes").kind, Kind::ReadReq);
    let mut answer = Header::new(Kind::ReadResp, 9);
    answer.len = len;
    let mut bytes = answer.encode().to_vec();
    bytes.extend_from_slice(&[0xab; 100]);
    theirs.write_all(&bytes).await.expect("the answer's start");
    cancel.cancel();
    let bound = Duration::from_secs(600);
    let c = tokio::time::timeout(bound, completions.recv()).await.expect("a completion for the READ").expect("the sink is open");
    assert_eq!(c.wr_id, 9);
    assert_ne!(c.status, WcStatus::Success, "a READ answered in part cannot succeed");
    // Both stream tasks end (each holds the QP's state) while the target sends nothing more.
    let ended = tokio::time::timeout(bound, async {
        while Arc::strong_count(&qp.state) > 1 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(ended.is_ok(), "the reader is still inside the READ answer");
    drop(theirs);
}

/// Counts the markers `inner` lets count, and revokes its grant inside the first check.
struct CountingMarkers {
    inner: Arc<WriteGrant>,
    markers: std::sync::atomic::AtomicUsize,
}

impl AccessCheck for CountingMarkers {
    fn check(&self, c: &ConnectionId, token: &[u8; 16], addr: u64, len: u64, op: RemoteOp) -> Result<Checked, WcStatus> {
        let checked = self.inner.check(c, token, addr, len, op);
        self.inner.gate.revoke();
        checked
    }

    fn marker(&self, c: &ConnectionId, token: &[u8; 16], imm: u32) -> Result<(), WcStatus> {
        self.markers.fetch_add(1, Ordering::SeqCst);
        self.inner.marker(c, token, imm)
    }
}

/// A READ whose answer is queued, its grant revoked before the answer leaves, and a NOTIFY
/// marker right behind it: the answer is cut (the stream closes), so the marker behind it must
/// not count either, as behind a refused READ (on an RC QP the READ fails and the QP's later
/// requests are flushed). It used to count: the marker was served while the cut answer was still
/// queued. Nothing leaves: no READ_RESP, no region byte, no ACK of the marker.
#[tokio::test]
async fn a_marker_behind_a_read_answer_cut_by_a_revocation_does_not_count() {
    let grants = WriteGrant::new(REGION as u64);
    grants.reads.store(true, Ordering::SeqCst);
    grants.memory.write_at(0, &[0x3c; 4096]).expect("fill");
    let before = grants.bytes();
    let mut read = Header::new(Kind::ReadReq, 1);
    (read.addr, read.len, read.token) = (0, 4096, TOKEN);
    let mut marker = Header::new(Kind::Notify, 2);
    (marker.addr, marker.token, marker.flags) = (7, TOKEN, ACK_REQUESTED);
    let mut input = read.encode().to_vec();
    input.extend_from_slice(&marker.encode());
    let counting = CountingMarkers { inner: grants.clone(), markers: Default::default() };
    let mut out = Vec::new();
    let r = serve_frames(&input[..], &mut out, &counting, &connection()).await;
    assert!(matches!(r, Err(ServeError::Revoked)), "{r:?}");
    assert_eq!(counting.markers.load(Ordering::SeqCst), 0, "the marker behind the cut READ counted");
    assert!(out.is_empty(), "frames left behind the cut answer: {} bytes", out.len());
    assert_eq!(grants.bytes(), before, "the region changed");
}

/// READ grants over two regions: addresses below [`REGION`] name the anonymous one (answers
/// queued for the gathered write), addresses from [`REGION`] on a file-backed one that can shrink
/// (answers copied out and staged).
struct TwoRegions {
    anon: Arc<RegionMemory>,
    file: Arc<RegionMemory>,
    gate: Arc<GrantGate>,
}

impl AccessCheck for TwoRegions {
    fn check(&self, _: &ConnectionId, _: &[u8; 16], addr: u64, _: u64, _: RemoteOp) -> Result<Checked, WcStatus> {
        let (memory, offset) = if addr < REGION as u64 { (self.anon.clone(), addr) } else { (self.file.clone(), addr - REGION as u64) };
        Ok(Checked { memory, offset, gate: self.gate.clone(), window: None })
    }

    fn marker(&self, _: &ConnectionId, _: &[u8; 16], _: u32) -> Result<(), WcStatus> {
        Ok(())
    }
}

/// Answers from memory that can shrink (copied out, staged, a large one written through the
/// staging buffer's bypass) between answers queued for the gathered write: every READ_RESP
/// header is followed by exactly its own payload, in request order, whatever the sizes.
#[tokio::test]
async fn answers_from_shrinkable_memory_and_queued_answers_keep_request_order() {
    let anon = Arc::new(RegionMemory::anonymous(REGION, false).expect("mapping"));
    anon.write_at(0, &vec![0xa1; REGION]).expect("fill");
    let file = tempfile::tempfile().expect("a file");
    file.set_len(REGION as u64).expect("its length");
    let file = Arc::new(RegionMemory::map_file(&file, REGION, true).expect("map the file"));
    assert!(file.can_shrink());
    file.write_at(0, &vec![0xf2; REGION]).expect("fill");
    let later = std::time::SystemTime::now() + Duration::from_secs(3600);
    let regions = TwoRegions { anon, file, gate: GrantGate::new(later) };
    let reads = [(0u64, 100u32), (REGION as u64, 300), (0, 70_000), (REGION as u64, 1 << 20), (0, 44), (REGION as u64, 5), (0, 300_000)];
    let mut input = Vec::new();
    for (i, &(addr, len)) in reads.iter().enumerate() {
        let mut h = Header::new(Kind::ReadReq, i as u64 + 1);
        (h.addr, h.len, h.token) = (addr, len, TOKEN);
        input.extend_from_slice(&h.encode());
    }
    let mut out = Vec::new();
    serve_frames(&input[..], &mut out, &regions, &connection()).await.expect("served");
    let mut at = 0usize;
    for (i, &(addr, len)) in reads.iter().enumerate() {
        let h = Header::decode(out[at..at + HEADER_LEN].try_into().expect("a header")).expect("decodes");
        assert_eq!((h.kind, h.id, h.len), (Kind::ReadResp, i as u64 + 1, len), "answer {i}");
        at += HEADER_LEN;
        let fill = if addr < REGION as u64 { 0xa1 } else { 0xf2 };
        assert!(out[at..at + len as usize].iter().all(|b| *b == fill), "answer {i}'s payload");
        at += len as usize;
    }
    assert_eq!(at, out.len(), "bytes after the last answer");
}
