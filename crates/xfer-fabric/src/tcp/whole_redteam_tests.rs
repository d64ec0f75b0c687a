//! Attacks on the target's fast path ([`super::whole`]) and the answer queue behind it
//! ([`super::wire::FrameWriter`]): a peer's frames mixed across kinds, tokens and buffer
//! boundaries, and revocations placed between them. Each test pins one promise: every frame is
//! answered once, in order, with its own bytes; no NOTIFY counts behind a refused or cut frame;
//! no READ answer leaves after its grant's revocation returned; a stream that waits keeps no grant.
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;
use xfer_rdma::memory::RegionMemory;

use super::serve::{serve_frames, ServeError};
use crate::frame::{Header, Kind, ACK_REQUESTED, HEADER_LEN};
use crate::grant::{AccessCheck, Checked, GrantGate, Window};
use crate::{RemoteOp, WcStatus};
use xfer_engine::ids::ConnectionId;

/// A WRITE grant and two READ grants (each with its own gate) over one region.
const W: [u8; 16] = [0x57; 16];
const R: [u8; 16] = [0x52; 16];
const R2: [u8; 16] = [0x53; 16];
const REGION: usize = 1 << 20;
/// Every grant covers remote addresses `BASE..BASE + GRANT_LEN`, remote `BASE` being offset 0.
const BASE: u64 = 0x40_0000;
const GRANT_LEN: u64 = 256 << 10;
/// The mixed stream WRITEs below this offset of the grant and READs above it: a READ's answer
/// leaves from region memory when the queue is written, so a WRITE behind it to the same bytes
/// may show in it (verbs without a fence allow that too).
const HALF: u64 = GRANT_LEN / 2;

struct Grant {
    token: [u8; 16],
    op: RemoteOp,
    gate: Arc<GrantGate>,
}

/// The grant table: three grants, the markers it counted, and an optional trap: asking for
/// `trap.0` revokes the grant `trap.1` first (a revocation placed exactly between two frames).
struct Table {
    memory: Arc<RegionMemory>,
    grants: Vec<Grant>,
    markers: AtomicUsize,
    trap: Mutex<Option<([u8; 16], [u8; 16])>>,
    /// A marker, once counted, revokes this grant (a revocation right behind the marker).
    after_marker: Mutex<Option<[u8; 16]>>,
}

impl Table {
    fn new() -> Table {
        let memory = Arc::new(RegionMemory::anonymous(REGION, false).expect("a mapping"));
        let pattern: Vec<u8> = (0..REGION).map(|i| (i % 251) as u8).collect();
        memory.write_at(0, &pattern).expect("fill");
        let later = SystemTime::now() + Duration::from_secs(3600);
        let grant = |token, op| Grant { token, op, gate: GrantGate::new(later) };
        let grants = vec![grant(W, RemoteOp::Write), grant(R, RemoteOp::Read), grant(R2, RemoteOp::Read)];
        Table { memory, grants, markers: AtomicUsize::new(0), trap: Mutex::new(None), after_marker: Mutex::new(None) }
    }

    fn gate(&self, token: [u8; 16]) -> &Arc<GrantGate> {
        &self.grants.iter().find(|g| g.token == token).expect("a grant").gate
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; REGION];
        self.memory.read_at(0, &mut b).expect("read back");
        b
    }
}

impl AccessCheck for Table {
    fn check(&self, _: &ConnectionId, token: &[u8; 16], addr: u64, len: u64, op: RemoteOp) -> Result<Checked, WcStatus> {
        let trap = self.trap.lock().expect("trap").filter(|(on, _)| on == token);
        if let Some((_, victim)) = trap {
            self.gate(victim).revoke();
        }
        let g = self.grants.iter().find(|g| &g.token == token).ok_or(WcStatus::RemAccessErr)?;
        if !g.gate.is_live() {
            return Err(WcStatus::RemAccessErr);
        }
        let window = Window { op: g.op, start: BASE, len: GRANT_LEN, base: BASE };
        let offset = window.offset(addr, len, op)?;
        self.memory.check(offset, len).map_err(|_| WcStatus::RemAccessErr)?;
        Ok(Checked { memory: self.memory.clone(), offset, gate: g.gate.clone(), window: Some(window) })
    }

    fn marker(&self, _: &ConnectionId, _: &[u8; 16], _: u32) -> Result<(), WcStatus> {
        self.markers.fetch_add(1, Ordering::SeqCst);
        if let Some(victim) = *self.after_marker.lock().expect("trap") {
            self.gate(victim).revoke();
        }
        Ok(())
    }
}

fn connection() -> ConnectionId {
    ConnectionId::parse("whole-redteam").expect("valid id")
}

fn write(id: u64, token: [u8; 16], at: u64, len: u32, fill: u8, ack: bool) -> Vec<u8> {
    let mut h = Header::new(Kind::Write, id);
    (h.addr, h.len, h.token) = (BASE + at, len, token);
    if ack {
        h.flags = ACK_REQUESTED;
    }
    let mut f = h.encode().to_vec();
    f.resize(HEADER_LEN + len as usize, fill);
    f
}

fn read(id: u64, token: [u8; 16], at: u64, len: u32) -> Vec<u8> {
    let mut h = Header::new(Kind::ReadReq, id);
    (h.addr, h.len, h.token) = (BASE + at, len, token);
    h.encode().to_vec()
}

fn notify(id: u64) -> Vec<u8> {
    let mut h = Header::new(Kind::Notify, id);
    (h.addr, h.token, h.flags) = (7, W, ACK_REQUESTED);
    h.encode().to_vec()
}

/// Every answer in `out`: (kind, id, status, payload of a READ answered in full).
fn parse(mut out: &[u8]) -> Vec<(Kind, u64, u16, Vec<u8>)> {
    let mut got = Vec::new();
    while !out.is_empty() {
        assert!(out.len() >= HEADER_LEN, "an answer cut inside its header: {} bytes", out.len());
        let h = Header::decode(out[..HEADER_LEN].try_into().expect("a header")).expect("decodes");
        let n = if h.kind == Kind::ReadResp && h.status == 0 { h.len as usize } else { 0 };
        assert!(out.len() >= HEADER_LEN + n, "READ answer {} cut short", h.id);
        got.push((h.kind, h.id, h.status, out[HEADER_LEN..HEADER_LEN + n].to_vec()));
        out = &out[HEADER_LEN + n..];
    }
    got
}

fn pattern(at: u64, len: u32) -> Vec<u8> {
    (0..len as u64).map(|i| ((at + i) % 251) as u8).collect()
}

const OK: u16 = 0;
fn nak() -> u16 {
    WcStatus::RemAccessErr.code()
}

/// A deterministic stream of pseudo-random numbers (no new dependency for the tests).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// Thousands of frames of every kind a peer sends, mixed: small and large WRITEs (some asking
/// for no ACK, some zero-length, one at the grant's very end), bursts of hundreds of READs (past
/// the queue's 511 answers and its 2 MiB), READs and WRITEs under the wrong grant or past it,
/// NOTIFYs, token switches, frames straddling the 64 KiB read buffer. Every frame gets its answer
/// once and in order, every READ exactly its own bytes, every WRITE lands exactly, and the
/// markers count only until the first refusal (after it they are flushed).
#[tokio::test]
async fn a_mixed_stream_is_answered_once_in_order_with_its_own_bytes() {
    let g = Table::new();
    let mut model = g.bytes();
    let mut rng = Lcg(0x5eed);
    let (mut input, mut want) = (Vec::new(), Vec::new());
    let (mut refused, mut markers) = (false, 0usize);
    let mut id = 0u64;
    while id < 6000 {
        id += 1;
        match rng.next(100) {
            // A burst of small READs: the answer queue fills by count (511) or bytes (2 MiB).
            0..=2 => {
                let (n, len) = if rng.next(2) == 0 { (600, 64) } else { (540, 4096) };
                for _ in 0..n {
                    let at = HALF + rng.next(HALF - len);
                    input.extend(read(id, R, at, len as u32));
                    want.push((Kind::ReadResp, id, OK, model[at as usize..(at + len) as usize].to_vec()));
                    id += 1;
                }
            }
            3..=30 => {
                let len = [0u64, 1, 44, 300, 4096, 20_000, 70_000][rng.next(7) as usize];
                let at = if rng.next(10) == 0 { GRANT_LEN - len } else { HALF + rng.next(HALF - len + 1) };
                input.extend(read(id, if rng.next(3) == 0 { R2 } else { R }, at, len as u32));
                want.push((Kind::ReadResp, id, OK, model[at as usize..(at + len) as usize].to_vec()));
            }
            31..=80 => {
                let len = [0u64, 1, 44, 300, 4096, 20_000, 70_000, 100_000][rng.next(8) as usize];
                let at = match rng.next(10) {
                    0 if len == 0 => GRANT_LEN,
                    0 => HALF - len,
                    _ => rng.next(HALF - len + 1),
                };
                let (fill, ack) = (rng.next(255) as u8 + 1, rng.next(4) != 0);
                input.extend(write(id, W, at, len as u32, fill, ack));
                model[at as usize..(at + len) as usize].fill(fill);
                if ack {
                    want.push((Kind::Ack, id, OK, Vec::new()));
                }
            }
            81..=94 => {
                input.extend(notify(id));
                if refused {
                    want.push((Kind::Nak, id, WcStatus::WrFlushErr.code(), Vec::new()));
                } else {
                    markers += 1;
                    want.push((Kind::Ack, id, OK, Vec::new()));
                }
            }
            // Refused (rarely, so most of the stream runs before its first refusal): a WRITE
            // one byte past the grant, a WRITE under a READ grant, a READ under the WRITE grant.
            _ if id < 3000 && rng.next(8) != 0 => id -= 1,
            _ => {
                refused = true;
                match rng.next(3) {
                    0 => {
                        input.extend(write(id, W, GRANT_LEN - 100, 101, 0xee, false));
                        want.push((Kind::Nak, id, nak(), Vec::new()));
                    }
                    1 => {
                        input.extend(write(id, R, 0, 64, 0xee, true));
                        want.push((Kind::Nak, id, nak(), Vec::new()));
                    }
                    _ => {
                        input.extend(read(id, W, 0, 64));
                        want.push((Kind::ReadResp, id, nak(), Vec::new()));
                    }
                }
            }
        }
    }
    let mut out = Vec::new();
    serve_frames(&input[..], &mut out, &g, &connection()).await.expect("served");
    let got = parse(&out);
    assert_eq!(got.len(), want.len(), "answers lost or duplicated");
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(a == b, "answer {i} differs: got {:?} want {:?}", (a.0, a.1, a.2, a.3.len()), (b.0, b.1, b.2, b.3.len()));
    }
    assert!(g.bytes() == model, "the region's bytes differ from the frames' WRITEs");
    assert_eq!(g.markers.load(Ordering::SeqCst), markers);
    assert!(refused && markers > 0, "the mix exercised both sides of the first refusal");
}

/// A WRITE grant kept by the stream and revoked between two buffered frames (by the table's
/// lookup of the frame in between, as a `Peer.Revoke` racing the stream would): the WRITE after
/// it lands nothing and is NAKed, and the NOTIFY behind it does not count.
#[tokio::test]
async fn a_marker_behind_a_write_refused_for_a_kept_grant_revoked_does_not_count() {
    let g = Table::new();
    *g.trap.lock().expect("trap") = Some((R, W));
    let mut input = write(1, W, 0, 64, 0x11, true);
    input.extend(read(2, R, 1000, 16));
    input.extend(write(3, W, 64, 64, 0xee, true));
    input.extend(notify(4));
    let mut out = Vec::new();
    serve_frames(&input[..], &mut out, &g, &connection()).await.expect("served");
    let want = vec![
        (Kind::Ack, 1, OK, Vec::new()),
        (Kind::ReadResp, 2, OK, pattern(1000, 16)),
        (Kind::Nak, 3, nak(), Vec::new()),
        (Kind::Nak, 4, WcStatus::WrFlushErr.code(), Vec::new()),
    ];
    assert_eq!(parse(&out), want);
    assert_eq!(g.bytes()[64..128], pattern(64, 64), "a byte landed after the revocation returned");
    assert_eq!(g.markers.load(Ordering::SeqCst), 0, "a marker counted behind a refused WRITE");
}

/// READs queued under a kept grant, the grant revoked before the queue is written (by the lookup
/// of the next frame): neither those answers nor anything behind them leave, the NOTIFY behind
/// them does not count, and the stream closes as revoked.
#[tokio::test]
async fn queued_answers_revoked_before_the_drain_never_leave_and_the_marker_behind_them_does_not_count() {
    let g = Table::new();
    *g.trap.lock().expect("trap") = Some((W, R));
    let mut input = Vec::new();
    for i in 0..5 {
        input.extend(read(i, R, i * 100, 100));
    }
    input.extend(write(5, W, 0, 16, 0x33, true));
    input.extend(notify(6));
    let mut out = Vec::new();
    let r = serve_frames(&input[..], &mut out, &g, &connection()).await;
    assert!(matches!(r, Err(ServeError::Revoked)), "{r:?}");
    assert_eq!(parse(&out), vec![], "an answer left after its grant's revocation returned");
    assert_eq!(g.markers.load(Ordering::SeqCst), 0, "a marker counted behind a cut READ");
}

/// A peer that reads its answers slowly: a large READ answer under one grant is leaving (the
/// gathered write waits on the peer), a second READ under another grant is queued behind it, and
/// that second grant is revoked before a byte of its answer left. No byte of the second answer
/// may leave after the revocation returned: the stream closes behind the first answer.
#[tokio::test]
async fn an_answer_queued_behind_one_still_leaving_is_not_sent_after_its_revocation() {
    let g = Arc::new(Table::new());
    let (ours, theirs) = tokio::io::duplex(4096);
    let (rd, wr) = tokio::io::split(theirs);
    let served = {
        let g = g.clone();
        tokio::spawn(async move { serve_frames(rd, wr, g.as_ref(), &connection()).await })
    };
    let (mut from, mut to) = tokio::io::split(ours);
    let mut input = read(1, R, 0, 60_000);
    input.extend(read(2, R2, 0, 4096));
    to.write_all(&input).await.expect("sent");
    // The first answer has started to leave; the second's header is 60 KB further on.
    let mut got = vec![0u8; 1000];
    from.read_exact(&mut got).await.expect("the first answer started");
    g.gate(R2).revoke();
    to.shutdown().await.expect("end of requests");
    from.read_to_end(&mut got).await.expect("the rest");
    let answers = parse(&got);
    assert_eq!(answers.first().map(|a| (a.1, a.2, a.3 == pattern(0, 60_000))), Some((1, OK, true)));
    assert!(answers.iter().all(|a| a.1 != 2), "READ 2 was answered after its grant's revocation returned");
    let r = served.await.expect("joined");
    assert!(matches!(r, Err(ServeError::Revoked)), "{r:?}");
}

/// A peer that reads none of its answers: its writer never takes a byte, and tells when the
/// stream first waits on it.
struct Stuck {
    waiting: Arc<Notify>,
}

impl AsyncWrite for Stuck {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, _: &[u8]) -> Poll<std::io::Result<usize>> {
        self.waiting.notify_one();
        Poll::Pending
    }
    // Nothing to flush: a socket's flush never waits, only its writes do.
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Pending
    }
}

/// The fast path keeps a grant, then a NOTIFY's ACK finds the answers' stage full and the stream
/// waits on a peer that does not read: that wait (up to `limits.data_idle_timeout`) is a wait like
/// any read, and the stream must not keep the grant's memory or gate through it.
///
/// The frames: 1488 zero-length WRITEs asking for ACKs (65 472 staged bytes), two without (the
/// second straddles the 64 KiB read buffer, so the general loop takes it), one more asking for an
/// ACK (the fast path checks it and keeps the grant; the stage is now 65 516 bytes), a NOTIFY
/// asking for an ACK: 44 more bytes do not fit, and the stage is written to the stuck peer.
#[tokio::test]
async fn a_stream_waiting_on_a_peer_that_does_not_read_keeps_no_grant() {
    let g = Arc::new(Table::new());
    let mut input = Vec::new();
    for i in 0..1488 {
        input.extend(write(i, W, 0, 0, 0, true));
    }
    input.extend(write(1488, W, 0, 0, 0, false));
    input.extend(write(1489, W, 0, 0, 0, false));
    input.extend(write(1490, W, 0, 0, 0, true));
    input.extend(notify(1491));
    let waiting = Arc::new(Notify::new());
    let served = {
        let (g, wr) = (g.clone(), Stuck { waiting: waiting.clone() });
        tokio::spawn(async move { serve_frames(std::io::Cursor::new(input), wr, g.as_ref(), &connection()).await })
    };
    waiting.notified().await;
    let (memory, gate) = (Arc::strong_count(&g.memory), Arc::strong_count(g.gate(W)));
    served.abort();
    let _ = served.await;
    assert_eq!(memory, 1, "a stream waiting on its peer holds the region's memory");
    assert_eq!(gate, 1, "a stream waiting on its peer holds the grant's gate");
}

/// A READ answer queued, then a NOTIFY, then the READ's grant revoked right after the marker
/// counted but before the queue is written: the answer is cut (the stream closes as revoked), so
/// the marker counted behind a READ that never completed. The marker may count only once every
/// answer ahead of it has left.
#[tokio::test]
async fn a_marker_does_not_count_ahead_of_a_queued_answer_cut_after_it() {
    let g = Table::new();
    *g.after_marker.lock().expect("trap") = Some(R);
    let mut input = read(1, R, 0, 4096);
    input.extend(notify(2));
    let mut out = Vec::new();
    let r = serve_frames(&input[..], &mut out, &g, &connection()).await;
    let answers = parse(&out);
    let read_answered = answers.iter().any(|a| a.1 == 1 && a.2 == OK);
    let counted = g.markers.load(Ordering::SeqCst);
    assert!(read_answered || counted == 0, "the marker counted ({counted}) behind READ 1, cut: {r:?}, {answers:?}");
}

/// The general loop's WRITE (the fast path found the stage full) whose ACK then waits on a peer
/// that does not read: the stream keeps no grant through that wait either.
#[tokio::test]
async fn a_write_whose_ack_waits_on_a_peer_that_does_not_read_keeps_no_grant() {
    let g = Arc::new(Table::new());
    let mut input = Vec::new();
    for i in 0..1488 {
        input.extend(write(i, W, 0, 0, 0, true));
    }
    input.extend(write(1488, W, 0, 0, 0, false));
    input.extend(write(1489, W, 0, 0, 0, false));
    input.extend(write(1490, W, 0, 0, 0, true));
    input.extend(write(1491, W, 0, 0, 0, true));
    let waiting = Arc::new(Notify::new());
    let served = {
        let (g, wr) = (g.clone(), Stuck { waiting: waiting.clone() });
        tokio::spawn(async move { serve_frames(std::io::Cursor::new(input), wr, g.as_ref(), &connection()).await })
    };
    waiting.notified().await;
    let (memory, gate) = (Arc::strong_count(&g.memory), Arc::strong_count(g.gate(W)));
    served.abort();
    let _ = served.await;
    assert_eq!(memory, 1, "a stream waiting on its peer holds the region's memory");
    assert_eq!(gate, 1, "a stream waiting on its peer holds the grant's gate");
}

/// Edges checked against the kept grant (each behind a good frame under the same token, so the
/// stream's own check decides): zero-length frames at the grant's two ends pass, one byte outside
/// either end, an address below the grant's base and a range whose end overflows are refused,
/// and none of them panics or lands a byte.
#[tokio::test]
async fn edges_of_a_kept_grant_are_checked_like_the_table_checks_them() {
    let g = Table::new();
    let before = g.bytes();
    let frame = |kind: Kind, id: u64, addr: u64, len: u32| {
        let mut h = Header::new(kind, id);
        let token = if kind == Kind::Write { W } else { R };
        (h.addr, h.len, h.token, h.flags) = (addr, len, token, ACK_REQUESTED);
        let mut f = h.encode().to_vec();
        if kind == Kind::Write {
            f.resize(HEADER_LEN + len as usize, 0xee);
        }
        f
    };
    let cases: [(u64, u32, bool); 7] = [
        (BASE, 0, true),
        (BASE + GRANT_LEN, 0, true),
        (BASE + GRANT_LEN + 1, 0, false),
        (BASE + GRANT_LEN - 1, 2, false),
        (BASE - 1, 1, false),
        (BASE - 1, 0, false),
        (u64::MAX - 10, 100, false),
    ];
    let (mut input, mut want) = (Vec::new(), Vec::new());
    let mut id = 0;
    for kind in [Kind::Write, Kind::ReadReq] {
        for (addr, len, ok) in cases {
            // The good frame that makes the stream keep the grant, then the edge.
            id += 1;
            input.extend(frame(kind, id, BASE + 8, 0));
            want.push(if kind == Kind::Write { (Kind::Ack, id, OK, Vec::new()) } else { (Kind::ReadResp, id, OK, Vec::new()) });
            id += 1;
            input.extend(frame(kind, id, addr, len));
            want.push(match (kind, ok) {
                (Kind::Write, true) => (Kind::Ack, id, OK, Vec::new()),
                (Kind::Write, false) => (Kind::Nak, id, nak(), Vec::new()),
                (_, true) => (Kind::ReadResp, id, OK, Vec::new()),
                (_, false) => (Kind::ReadResp, id, nak(), Vec::new()),
            });
        }
    }
    let mut out = Vec::new();
    serve_frames(&input[..], &mut out, &g, &connection()).await.expect("served");
    assert_eq!(parse(&out), want);
    assert!(g.bytes() == before, "a refused edge landed bytes");
}
