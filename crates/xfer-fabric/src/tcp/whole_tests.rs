//! Adversarial tests of the target's fast path for WRITEs that arrived whole ([`super::whole`]):
//! a stream checks later frames against the grant it checked last, so each test pins what that
//! check must still refuse: a grant revoked or expired since, a range past the grant, a frame
//! under another token; and that a stream waiting for its next frame keeps no grant's memory.
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::sync::Notify;
use xfer_rdma::memory::RegionMemory;

use super::serve::serve_frames;
use super::whole::{serve_whole_frames, GrantCache};
use super::wire::{FrameReader, FrameWriter};
use crate::frame::{Header, Kind, ACK_REQUESTED, HEADER_LEN};
use crate::grant::{AccessCheck, Checked, GrantGate, Window};
use crate::{RemoteOp, WcStatus};
use xfer_engine::ids::ConnectionId;

const TOKEN: [u8; 16] = [0x3e; 16];
const OTHER: [u8; 16] = [0x4f; 16];
const REGION: usize = 1 << 20;
/// The grant: WRITEs to remote addresses `BASE + GRANT_AT..BASE + GRANT_AT + GRANT_LEN`.
const BASE: u64 = 0x10_0000;
const GRANT_AT: u64 = 4096;
const GRANT_LEN: u64 = 64 << 10;

/// One WRITE grant under [`TOKEN`] that lets streams reuse its check (a window, as the agent's
/// grant table gives), counting how often the table is asked.
struct Windowed {
    memory: Arc<RegionMemory>,
    gate: Arc<GrantGate>,
    asked: AtomicUsize,
    op: RemoteOp,
}

impl Windowed {
    fn new(expires_at: SystemTime) -> Windowed {
        let memory = Arc::new(RegionMemory::anonymous(REGION, false).expect("a mapping"));
        Windowed { memory, gate: GrantGate::new(expires_at), asked: AtomicUsize::new(0), op: RemoteOp::Write }
    }

    fn live() -> Windowed {
        Windowed::new(SystemTime::now() + Duration::from_secs(3600))
    }

    /// A live READ grant over a region whose byte `i` is `i % 251`.
    fn readable() -> Windowed {
        let g = Windowed { op: RemoteOp::Read, ..Windowed::live() };
        let pattern: Vec<u8> = (0..REGION).map(|i| (i % 251) as u8).collect();
        g.memory.write_at(0, &pattern).expect("fill");
        g
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; REGION];
        self.memory.read_at(0, &mut b).expect("read back");
        b
    }
}

impl AccessCheck for Windowed {
    fn check(&self, _: &ConnectionId, token: &[u8; 16], addr: u64, len: u64, op: RemoteOp) -> Result<Checked, WcStatus> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        if token != &TOKEN || !self.gate.is_live() {
            return Err(WcStatus::RemAccessErr);
        }
        let window = Window { op: self.op, start: BASE + GRANT_AT, len: GRANT_LEN, base: BASE };
        let offset = window.offset(addr, len, op)?;
        self.memory.check(offset, len).map_err(|_| WcStatus::RemAccessErr)?;
        Ok(Checked { memory: self.memory.clone(), offset, gate: self.gate.clone(), window: Some(window) })
    }

    fn marker(&self, _: &ConnectionId, _: &[u8; 16], _: u32) -> Result<(), WcStatus> {
        Ok(())
    }
}

fn connection() -> ConnectionId {
    ConnectionId::parse("whole-conn").expect("valid id")
}

/// A WRITE frame of `len` bytes of `fill` at offset `at` of the grant, asking for an ACK.
fn write(id: u64, token: [u8; 16], at: u64, len: u32, fill: u8) -> Vec<u8> {
    let mut h = Header::new(Kind::Write, id);
    (h.addr, h.len, h.token, h.flags) = (BASE + GRANT_AT + at, len, token, ACK_REQUESTED);
    let mut f = h.encode().to_vec();
    f.resize(HEADER_LEN + len as usize, fill);
    f
}

/// The answers in `out`, as (kind, id, status).
fn answers(out: &[u8]) -> Vec<(Kind, u64, u16)> {
    assert_eq!(out.len() % HEADER_LEN, 0, "answers are whole headers");
    out.chunks(HEADER_LEN)
        .map(|c| {
            let h = Header::decode(c.try_into().expect("a header")).expect("decodes");
            (h.kind, h.id, h.status)
        })
        .collect()
}

const ACK: u16 = 0;
fn nak() -> u16 {
    WcStatus::RemAccessErr.code()
}

/// Many small frames under one token, all buffered: every one lands and is ACKed in order, and
/// the table is not asked per frame.
#[tokio::test]
async fn frames_under_one_token_are_checked_against_one_lookup_and_all_land() {
    let g = Windowed::live();
    let mut input = Vec::new();
    for i in 0..12u64 {
        input.extend(write(i, TOKEN, i * 4096, 4096, i as u8 + 1));
    }
    let mut out = Vec::new();
    serve_frames(&input[..], &mut out, &g, &connection()).await.expect("served");
    let want: Vec<_> = (0..12u64).map(|i| (Kind::Ack, i, ACK)).collect();
    assert_eq!(answers(&out), want);
    // Once for the first frame (the frame loop read its header when the buffer was empty and
    // served it itself), once when the fast path took over the rest.
    assert_eq!(g.asked.load(Ordering::SeqCst), 2, "the table was asked per frame");
    let b = g.bytes();
    for i in 0..12usize {
        let at = GRANT_AT as usize + i * 4096;
        assert!(b[at..at + 4096].iter().all(|&x| x == i as u8 + 1), "frame {i} did not land");
    }
}

/// A frame under the cached token that reaches past the grant (or starts before it) is refused,
/// lands nothing, and the frames around it still land; another token is refused too.
#[tokio::test]
async fn a_frame_past_the_grant_or_under_another_token_is_refused_among_good_ones() {
    let g = Windowed::live();
    let mut input = write(1, TOKEN, 0, 4096, 0x11);
    input.extend(write(2, TOKEN, GRANT_LEN - 100, 200, 0xee)); // 100 bytes past the end
    input.extend(write(3, TOKEN, 4096, 4096, 0x33));
    let mut before = Header::new(Kind::Write, 4);
    (before.addr, before.len, before.token, before.flags) = (BASE + GRANT_AT - 8, 16, TOKEN, ACK_REQUESTED);
    input.extend(before.encode());
    input.extend([0xee; 16]);
    input.extend(write(5, OTHER, 8192, 64, 0xee));
    input.extend(write(6, TOKEN, 8192, 4096, 0x66));
    let mut out = Vec::new();
    serve_frames(&input[..], &mut out, &g, &connection()).await.expect("served");
    assert_eq!(
        answers(&out),
        vec![
            (Kind::Ack, 1, ACK),
            (Kind::Nak, 2, nak()),
            (Kind::Ack, 3, ACK),
            (Kind::Nak, 4, nak()),
            (Kind::Nak, 5, nak()),
            (Kind::Ack, 6, ACK)
        ]
    );
    let b = g.bytes();
    assert!(!b.contains(&0xee), "a refused frame's bytes landed");
    let at = GRANT_AT as usize;
    assert!(b[at..at + 4096].iter().all(|&x| x == 0x11));
    assert!(b[at + 4096..at + 8192].iter().all(|&x| x == 0x33));
    assert!(b[at + 8192..at + 12288].iter().all(|&x| x == 0x66));
}

/// The stream checked a frame under the grant and keeps it; the grant is revoked; the next frame
/// under the same token, already buffered, is refused and lands nothing, and the stream forgets
/// the grant.
#[tokio::test]
async fn a_grant_revoked_after_the_stream_kept_it_refuses_the_next_buffered_frame() {
    let g = Windowed::live();
    let (mut ours, theirs) = tokio::io::duplex(1 << 20);
    let mut rd = FrameReader::new(theirs);
    let mut sink = Vec::new();
    let mut wr = FrameWriter::new(&mut sink);
    let (mut cache, mut refused) = (GrantCache::default(), false);
    ours.write_all(&write(1, TOKEN, 0, 4096, 0x11)).await.expect("sent");
    std::future::poll_fn(|cx| rd.poll_fill(cx, 1)).await.expect("filled");
    serve_whole_frames(&mut rd, &mut wr, &g, &connection(), &mut cache, &mut refused).expect("served");
    assert_eq!(g.asked.load(Ordering::SeqCst), 1);
    assert!(cache.holds(&TOKEN), "the stream did not keep the grant");
    ours.write_all(&write(2, TOKEN, 4096, 4096, 0xee)).await.expect("sent");
    std::future::poll_fn(|cx| rd.poll_fill(cx, 1)).await.expect("filled");
    g.gate.revoke();
    serve_whole_frames(&mut rd, &mut wr, &g, &connection(), &mut cache, &mut refused).expect("served");
    wr.flush().await.expect("flushed");
    drop(wr);
    assert_eq!(answers(&sink), vec![(Kind::Ack, 1, ACK), (Kind::Nak, 2, nak())]);
    assert!(refused, "a notification behind the refused frame would count");
    assert!(!cache.holds(&TOKEN), "the stream kept a revoked grant");
    assert_eq!(rd.buffered(), 0, "the refused frame's payload was not dropped");
    let b = g.bytes();
    assert!(!b.contains(&0xee), "bytes landed after the revocation returned");
    assert!(b[GRANT_AT as usize..GRANT_AT as usize + 4096].iter().all(|&x| x == 0x11));
}

/// As above with a grant that expired rather than being revoked: the kept check does not outlive
/// the expiry (the gate tells).
#[tokio::test]
async fn an_expired_grant_kept_by_the_stream_lands_nothing() {
    let g = Windowed::new(SystemTime::now() - Duration::from_secs(1));
    let mut cache = GrantCache::default();
    let window = Window { op: RemoteOp::Write, start: BASE + GRANT_AT, len: GRANT_LEN, base: BASE };
    // Kept from before the expiry (the table itself would refuse it now).
    cache.keep(TOKEN, Checked { memory: g.memory.clone(), offset: GRANT_AT, gate: g.gate.clone(), window: Some(window) });
    let input = write(1, TOKEN, 0, 4096, 0xee);
    let mut rd = FrameReader::new(&input[..]);
    std::future::poll_fn(|cx| rd.poll_fill(cx, 1)).await.expect("filled");
    let mut sink = Vec::new();
    let mut wr = FrameWriter::new(&mut sink);
    let mut refused = false;
    serve_whole_frames(&mut rd, &mut wr, &g, &connection(), &mut cache, &mut refused).expect("served");
    wr.flush().await.expect("flushed");
    drop(wr);
    assert_eq!(answers(&sink), vec![(Kind::Nak, 1, nak())]);
    assert_eq!(g.asked.load(Ordering::SeqCst), 0, "the kept check was not the one tried");
    assert!(!g.bytes().contains(&0xee), "bytes landed under an expired grant");
}

/// Between bursts, a stream waiting for its next frame holds no reference to the grant's memory
/// or gate: a region deleted meanwhile is unmapped, not kept alive by an idle stream.
#[tokio::test]
async fn a_stream_waiting_for_its_next_frame_keeps_no_grant() {
    let g = Arc::new(Windowed::live());
    let (mut ours, theirs) = tokio::io::duplex(1 << 20);
    let (rd, wr) = tokio::io::split(theirs);
    let served = {
        let g = g.clone();
        tokio::spawn(async move { serve_frames(rd, wr, g.as_ref(), &connection()).await })
    };
    let mut input = Vec::new();
    for i in 0..4u64 {
        input.extend(write(i, TOKEN, i * 4096, 4096, 0x21));
    }
    ours.write_all(&input).await.expect("sent");
    let mut acks = [0u8; 4 * HEADER_LEN];
    ours.read_exact(&mut acks).await.expect("four ACKs");
    assert_eq!(answers(&acks), (0..4u64).map(|i| (Kind::Ack, i, ACK)).collect::<Vec<_>>());
    // The ACKs leave only once the buffer is empty, and the grant is dropped before that flush.
    assert_eq!(Arc::strong_count(&g.memory), 1, "an idle stream holds the region's memory");
    assert_eq!(Arc::strong_count(&g.gate), 1, "an idle stream holds the grant's gate");
    drop(ours);
    served.await.expect("joined").expect("a clean end");
}

/// A READ request for `len` bytes at offset `at` of the grant.
fn read(id: u64, token: [u8; 16], at: u64, len: u32) -> Vec<u8> {
    let mut h = Header::new(Kind::ReadReq, id);
    (h.addr, h.len, h.token) = (BASE + GRANT_AT + at, len, token);
    h.encode().to_vec()
}

/// The stream's answers to READs: (id, status, payload) per READ_RESP, in order.
fn read_answers(mut out: &[u8]) -> Vec<(u64, u16, Vec<u8>)> {
    let mut got = Vec::new();
    while !out.is_empty() {
        let h = Header::decode(out[..HEADER_LEN].try_into().expect("a header")).expect("decodes");
        assert_eq!(h.kind, Kind::ReadResp, "{h:?}");
        let n = if h.status == 0 { h.len as usize } else { 0 };
        got.push((h.id, h.status, out[HEADER_LEN..HEADER_LEN + n].to_vec()));
        out = &out[HEADER_LEN + n..];
    }
    got
}

/// The grant's bytes at offset `at` (the region's pattern).
fn expected(at: u64, len: u32) -> Vec<u8> {
    (0..len as u64).map(|i| ((GRANT_AT + at + i) % 251) as u8).collect()
}

/// More READs than one gathered write answers (the queue fills, the frame loop writes it out and
/// the fast path goes on), a READ past the grant and one under another token among them: each
/// answered in request order with exactly its bytes, or refused with no payload.
#[tokio::test]
async fn reads_under_one_token_are_answered_in_order_past_a_full_queue_and_bad_ones_refused() {
    let g = Windowed::readable();
    let mut input = Vec::new();
    let mut want = Vec::new();
    for i in 0..700u64 {
        let at = (i * 97) % (GRANT_LEN - 64);
        match i {
            300 => {
                input.extend(read(i, TOKEN, GRANT_LEN - 10, 64));
                want.push((i, nak(), Vec::new()));
            }
            301 => {
                input.extend(read(i, OTHER, at, 64));
                want.push((i, nak(), Vec::new()));
            }
            _ => {
                input.extend(read(i, TOKEN, at, 64));
                want.push((i, ACK, expected(at, 64)));
            }
        }
    }
    let mut out = Vec::new();
    serve_frames(&input[..], &mut out, &g, &connection()).await.expect("served");
    assert_eq!(read_answers(&out), want);
    assert!(g.asked.load(Ordering::SeqCst) <= 8, "the table was asked per frame: {}", g.asked.load(Ordering::SeqCst));
}

/// A READ grant kept by the stream and revoked before the next buffered READ under it: that READ
/// is refused with no payload, and nothing of the region leaves after the revocation.
#[tokio::test]
async fn a_read_grant_revoked_after_the_stream_kept_it_answers_nothing_more() {
    let g = Windowed::readable();
    let (mut ours, theirs) = tokio::io::duplex(1 << 20);
    let mut rd = FrameReader::new(theirs);
    let mut sink = Vec::new();
    let mut wr = FrameWriter::new(&mut sink);
    let (mut cache, mut refused) = (GrantCache::default(), false);
    ours.write_all(&read(1, TOKEN, 0, 4096)).await.expect("sent");
    std::future::poll_fn(|cx| rd.poll_fill(cx, 1)).await.expect("filled");
    serve_whole_frames(&mut rd, &mut wr, &g, &connection(), &mut cache, &mut refused).expect("served");
    wr.flush().await.expect("flushed");
    assert!(cache.holds(&TOKEN), "the stream did not keep the grant");
    ours.write_all(&read(2, TOKEN, 4096, 4096)).await.expect("sent");
    std::future::poll_fn(|cx| rd.poll_fill(cx, 1)).await.expect("filled");
    g.gate.revoke();
    serve_whole_frames(&mut rd, &mut wr, &g, &connection(), &mut cache, &mut refused).expect("served");
    wr.flush().await.expect("flushed");
    drop(wr);
    assert_eq!(read_answers(&sink), vec![(1, ACK, expected(0, 4096)), (2, nak(), Vec::new())]);
    assert!(refused && !cache.holds(&TOKEN));
}

/// A reader that tells when a read of it has to wait: the frame loop is then parked on the
/// network.
struct Probe<R> {
    inner: R,
    waiting: Arc<Notify>,
}

impl<R: AsyncRead + Unpin> AsyncRead for Probe<R> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if r.is_pending() {
            self.waiting.notify_one();
        }
        r
    }
}

/// Whole frames followed by part of a header (the rest held back by the peer): the stream
/// waiting for the rest of that header keeps no grant either, though its buffer is not empty.
#[tokio::test]
async fn a_stream_waiting_on_a_trickled_header_keeps_no_grant() {
    let g = Arc::new(Windowed::live());
    let (mut ours, theirs) = tokio::io::duplex(1 << 20);
    let (rd, wr) = tokio::io::split(theirs);
    let mut input = Vec::new();
    for i in 0..4u64 {
        input.extend(write(i, TOKEN, i * 4096, 4096, 0x21));
    }
    input.extend(&write(4, TOKEN, 0, 16, 0x22)[..10]);
    ours.write_all(&input).await.expect("sent");
    let waiting = Arc::new(Notify::new());
    let served = {
        let (g, probe) = (g.clone(), Probe { inner: rd, waiting: waiting.clone() });
        tokio::spawn(async move { serve_frames(probe, wr, g.as_ref(), &connection()).await })
    };
    waiting.notified().await;
    assert_eq!(Arc::strong_count(&g.memory), 1, "a stream waiting on a header holds the region's memory");
    assert_eq!(Arc::strong_count(&g.gate), 1, "a stream waiting on a header holds the grant's gate");
    drop(ours);
    assert!(served.await.expect("joined").is_err(), "a stream cut inside a header is not a clean end");
}
