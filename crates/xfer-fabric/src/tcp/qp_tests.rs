//! Tests of the initiator QP's completions when a WR cannot be framed (a remote key that is not
//! a grant token, a payload copy from memory that shrank): as on an RC QP, the WRs before it
//! execute and complete on their own, it completes with its own error, and the WRs after it are
//! flushed; every WR completes exactly once, whatever the target or the connection does meanwhile.
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use xfer_rdma::memory::RegionMemory;

use super::qp::TcpQp;
use super::registration;
use super::serve::serve_frames;
use crate::frame::{Header, Kind, ACK_REQUESTED, HEADER_LEN};
use crate::grant::{AccessCheck, Checked, GrantGate};
use crate::{Access, Completion, Registration, RemoteKey, RemoteOp, WcStatus, WorkRequest, WrOp};
use xfer_engine::ids::ConnectionId;

const TOKEN: [u8; 16] = [0x3a; 16];
const LEN: usize = 4096;

/// One WRITE grant under [`TOKEN`] over a whole zeroed page at address 0.
struct WritePage {
    memory: Arc<RegionMemory>,
    gate: Arc<GrantGate>,
}

impl AccessCheck for WritePage {
    fn check(&self, _: &ConnectionId, token: &[u8; 16], addr: u64, len: u64, op: RemoteOp) -> Result<Checked, WcStatus> {
        if token != &TOKEN || op != RemoteOp::Write || addr.checked_add(len).is_none_or(|end| end > LEN as u64) {
            return Err(WcStatus::RemAccessErr);
        }
        Ok(Checked { memory: self.memory.clone(), offset: addr, gate: self.gate.clone(), window: None })
    }

    fn marker(&self, _: &ConnectionId, _: &[u8; 16], _: u32) -> Result<(), WcStatus> {
        Ok(())
    }
}

/// A local page whose byte `i` is `i % 251 + 1` (never zero, so landed bytes show).
fn local() -> Arc<dyn Registration> {
    let memory = Arc::new(RegionMemory::anonymous(LEN, false).expect("a page"));
    let pattern: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8 + 1).collect();
    memory.write_at(0, &pattern).expect("fill");
    registration(memory, Access::ReadWrite)
}

/// A 16-byte WRITE from local offset `at` to remote address `at`, under `key`.
fn write(wr_id: u64, local: &Arc<dyn Registration>, at: u64, key: RemoteKey, signaled: bool) -> WorkRequest {
    WorkRequest { wr_id, op: WrOp::Write, local: local.clone(), local_offset: at, len: 16, remote_addr: at, remote_key: key, signaled }
}

/// A remote key the tcp fabric cannot frame (a verbs rkey): the WR fails at the QP.
const NOT_A_TOKEN: RemoteKey = RemoteKey::Rkey(7);

/// A QP over `ours` and its completions.
fn qp_over(ours: DuplexStream) -> (TcpQp, mpsc::UnboundedReceiver<Completion>, CancellationToken) {
    let (rd, wr) = tokio::io::split(ours);
    let (sink, completions) = mpsc::unbounded_channel();
    let cancel = CancellationToken::new();
    let qp = TcpQp::start(0, Box::new(rd), Box::new(wr), sink, Arc::new(AtomicBool::new(false)), cancel.clone());
    (qp, completions, cancel)
}

/// Every completion until both stream tasks are gone (the sink closes with them), as (id,
/// status). Virtual time: a task that never ends fails the test at the (virtual) hour.
async fn all_completions(mut completions: mpsc::UnboundedReceiver<Completion>) -> Vec<(u64, WcStatus)> {
    let mut got = Vec::new();
    let collect = async {
        while let Some(c) = completions.recv().await {
            got.push((c.wr_id, c.status));
        }
    };
    tokio::time::timeout(Duration::from_secs(3600), collect).await.expect("the QP's tasks end");
    got
}

/// A real target on the other end of a pipe, serving [`WritePage`]; the grant is returned.
fn target(theirs: DuplexStream) -> Arc<WritePage> {
    let grant = Arc::new(WritePage {
        memory: Arc::new(RegionMemory::anonymous(LEN, false).expect("a page")),
        gate: GrantGate::new(std::time::SystemTime::now() + Duration::from_secs(3600)),
    });
    let check = grant.clone();
    tokio::spawn(async move {
        let (rd, wr) = tokio::io::split(theirs);
        let connection = ConnectionId::parse("qp-test-conn").expect("valid id");
        let _ = serve_frames(rd, wr, check.as_ref(), &connection).await;
    });
    grant
}

/// Reads one frame's header (and its payload, returned) from the target's end of the pipe.
async fn frame(theirs: &mut DuplexStream) -> (Header, Vec<u8>) {
    let mut hb = [0u8; HEADER_LEN];
    theirs.read_exact(&mut hb).await.expect("a header");
    let h = Header::decode(&hb).expect("decodes");
    let mut payload = vec![0u8; if h.kind == Kind::Write { h.len as usize } else { 0 }];
    theirs.read_exact(&mut payload).await.expect("its payload");
    (h, payload)
}

/// Two good WRITEs, one that cannot be framed, one more good WRITE, posted as one run against a
/// real target: the first two execute and succeed (their bytes land), the bad one completes with
/// its own error, the last is flushed and never lands. The QP used to give the bad WR's error to
/// the first WRITE (already sent, about to be ACKed) and flush the rest, the bad one included.
#[tokio::test(start_paused = true)]
async fn the_wrs_before_one_that_cannot_be_framed_complete_on_their_own() {
    let (ours, theirs) = tokio::io::duplex(1 << 16);
    let grant = target(theirs);
    let (qp, completions, _cancel) = qp_over(ours);
    let l = local();
    let run = vec![
        write(1, &l, 0, RemoteKey::Token(TOKEN), true),
        write(2, &l, 16, RemoteKey::Token(TOKEN), true),
        write(3, &l, 32, NOT_A_TOKEN, true),
        write(4, &l, 48, RemoteKey::Token(TOKEN), true),
    ];
    qp.tx.send(run).expect("the writer is running");
    drop(qp);
    let got = all_completions(completions).await;
    assert_eq!(got, vec![(1, WcStatus::Success), (2, WcStatus::Success), (3, WcStatus::LocQpOpErr), (4, WcStatus::WrFlushErr)]);
    let mut landed = vec![0u8; 64];
    grant.memory.read_at(0, &mut landed).expect("read back");
    let sent: Vec<u8> = (0..32).map(|i| (i % 251) as u8 + 1).collect();
    assert_eq!(&landed[..32], &sent[..], "the two WRITEs before the bad one landed");
    assert_eq!(&landed[32..], &[0u8; 32][..], "nothing at or after the bad one landed");
}

/// The bad WR is the first of its gather, behind unsignaled WRITEs sent earlier (never answered
/// when they succeed): a signaled zero-length WRITE under its id goes out in its place, and only
/// its answer completes the bad WR (the unsignaled ones succeeded silently).
#[tokio::test(start_paused = true)]
async fn a_fence_behind_unsignaled_writes_completes_the_bad_wr_in_order() {
    let (ours, mut theirs) = tokio::io::duplex(1 << 16);
    let (qp, mut completions, _cancel) = qp_over(ours);
    let l = local();
    qp.tx.send(vec![write(1, &l, 0, RemoteKey::Token(TOKEN), false), write(2, &l, 16, RemoteKey::Token(TOKEN), false)]).expect("running");
    for id in [1, 2] {
        assert_eq!(frame(&mut theirs).await.0.id, id);
    }
    qp.tx.send(vec![write(3, &l, 32, NOT_A_TOKEN, true), write(4, &l, 48, RemoteKey::Token(TOKEN), true)]).expect("running");
    let (fence, payload) = frame(&mut theirs).await;
    assert_eq!((fence.kind, fence.id, fence.len, fence.flags & ACK_REQUESTED != 0), (Kind::Write, 3, 0, true));
    assert_eq!((fence.token, payload.len()), (TOKEN, 0), "under the grant of the WR before it");
    // Nothing completes before the target answers the fence.
    assert!(completions.try_recv().is_err(), "a completion before the fence was answered");
    theirs.write_all(&Header::new(Kind::Ack, 3).encode()).await.expect("the fence's ACK");
    drop(qp);
    assert_eq!(all_completions(completions).await, vec![(3, WcStatus::LocQpOpErr), (4, WcStatus::WrFlushErr)]);
}

/// A WR sent before the bad one fails at the target first: its error is the first completion,
/// and the bad WR is flushed behind it, as on an RC QP.
#[tokio::test(start_paused = true)]
async fn a_sent_wr_that_fails_at_the_target_comes_first_and_the_bad_one_is_flushed() {
    let (ours, theirs) = tokio::io::duplex(1 << 16);
    target(theirs);
    let (qp, completions, _cancel) = qp_over(ours);
    let l = local();
    let run = vec![
        write(1, &l, 0, RemoteKey::Token([0x99; 16]), false), // no such grant: NAKed
        write(2, &l, 16, RemoteKey::Token(TOKEN), true),
        write(3, &l, 32, NOT_A_TOKEN, true),
        write(4, &l, 48, RemoteKey::Token(TOKEN), true),
    ];
    qp.tx.send(run).expect("the writer is running");
    drop(qp);
    let got = all_completions(completions).await;
    let want = vec![(1, WcStatus::RemAccessErr), (2, WcStatus::WrFlushErr), (3, WcStatus::WrFlushErr), (4, WcStatus::WrFlushErr)];
    assert_eq!(got, want);
}

/// The connection is closed while the bad WR waits for the fence's answer: every WR is flushed,
/// each exactly once.
#[tokio::test(start_paused = true)]
async fn closing_the_connection_behind_a_bad_wr_flushes_each_wr_once() {
    let (ours, mut theirs) = tokio::io::duplex(1 << 16);
    let (qp, completions, cancel) = qp_over(ours);
    let l = local();
    let run = vec![
        write(1, &l, 0, RemoteKey::Token(TOKEN), true),
        write(2, &l, 16, NOT_A_TOKEN, true),
        write(3, &l, 32, RemoteKey::Token(TOKEN), false),
    ];
    qp.tx.send(run).expect("the writer is running");
    assert_eq!(frame(&mut theirs).await.0.id, 1);
    assert_eq!(frame(&mut theirs).await.0.id, 2, "the fence");
    // Posted after the writer stopped: flushed behind the bad WR, or refused.
    let late = qp.tx.send(vec![write(4, &l, 48, RemoteKey::Token(TOKEN), true)]).is_ok();
    cancel.cancel();
    drop(qp);
    let got = all_completions(completions).await;
    let mut want = vec![(1, WcStatus::WrFlushErr), (2, WcStatus::WrFlushErr), (3, WcStatus::WrFlushErr)];
    if late {
        want.push((4, WcStatus::WrFlushErr));
    }
    assert_eq!(got, want);
}

/// Nothing is pending before the bad WR: it completes with its error at once and the WRs after
/// it are flushed; nothing goes on the stream.
#[tokio::test(start_paused = true)]
async fn a_bad_wr_with_nothing_before_it_fails_at_once() {
    let (ours, mut theirs) = tokio::io::duplex(1 << 16);
    let (qp, completions, _cancel) = qp_over(ours);
    let l = local();
    qp.tx.send(vec![write(1, &l, 0, NOT_A_TOKEN, false), write(2, &l, 16, RemoteKey::Token(TOKEN), true)]).expect("running");
    drop(qp);
    assert_eq!(all_completions(completions).await, vec![(1, WcStatus::LocQpOpErr), (2, WcStatus::WrFlushErr)]);
    let mut rest = Vec::new();
    theirs.read_to_end(&mut rest).await.expect("the stream ends");
    assert!(rest.is_empty(), "{} bytes went out", rest.len());
}
