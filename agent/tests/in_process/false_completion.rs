//! A path that reports work complete that never landed, then fails: the failure Soft-RoCE showed
//! under load (a READ retired whose bytes never arrived, then its QPs flushed). The transfer's
//! other path carries what the failed one left, and because a path failed over, the session
//! verifies the segments end to end before it succeeds, and the target publishes the batch's
//! notification only on a matching `Peer.Complete`: a batch that did not fully land fails with
//! CHECKSUM_MISMATCH and is never announced; one that did is announced exactly once.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use xfer_agent::peer_api::{Connector, PeerApi, PeerError};
use xfer_agent::transfer::{Op, TransferRequest, TransferState};
use xfer_engine::batch::SegmentSpec;
use xfer_engine::failure::FailureCode;
use xfer_engine::status::WcStatus;
use xfer_fabric::{Completion, CompletionSink, Connection, Fabric, FabricError, PathInfo, WorkRequest};

use crate::initiator::{finished, node_on, region, write, LocalPeer, Node2, A};
use crate::wrapped::Wrapped;

/// Which signaled data WR on the second path is the one the device misreports: the first, so its
/// success is in order (a success reported while an earlier signaled WR of its QP has not
/// reported already takes the path down, and nothing it retired counts).
const LIE_AT: u32 = 1;

/// The tcp fabric with each connection split into two paths of one QP each. On the second path
/// the `LIE_AT`-th signaled data WR is reported complete without being posted when `honest` is
/// false (its bytes never move) and posted as usual when it is true; either way every later post
/// on that path is flushed (`WR_FLUSH_ERR`, not posted), as on a QP the device moved to ERR.
fn lying(inner: Arc<dyn Fabric>, honest: bool) -> Arc<dyn Fabric> {
    Arc::new(Wrapped {
        inner,
        wrap: Box::new(move |sink, qps| {
            assert_eq!(qps, 2, "the test asks for one QP per path");
            Box::new(move |conn| Arc::new(LyingConn { conn, sink, honest, signaled: AtomicU32::new(0) }))
        }),
    })
}

struct LyingConn {
    conn: Arc<dyn Connection>,
    sink: CompletionSink,
    honest: bool,
    /// Signaled data WRs posted to the second path so far.
    signaled: AtomicU32,
}

impl LyingConn {
    fn report(&self, wr: &WorkRequest, status: WcStatus) {
        let byte_len = if status.is_success() { wr.len } else { 0 };
        let _ = self.sink.send(Completion { wr_id: wr.wr_id, qp: 1, status, byte_len });
    }
}

impl Connection for LyingConn {
    fn qps(&self) -> usize {
        self.conn.qps()
    }
    fn paths(&self) -> Vec<PathInfo> {
        let path = |qp: usize| PathInfo {
            local_device: format!("fake{qp}"),
            remote_device: format!("fake{qp}"),
            qps: qp..qp + 1,
            standby: false,
            mtu: 4096,
        };
        vec![path(0), path(1)]
    }
    fn post(&self, qp: usize, wr: WorkRequest) -> Result<(), FabricError> {
        if qp != 1 || wr.len == 0 || !wr.signaled {
            if qp == 1 && self.signaled.load(Ordering::Acquire) >= LIE_AT {
                self.report(&wr, WcStatus::WrFlushErr);
                return Ok(());
            }
            return self.conn.post(qp, wr);
        }
        let n = self.signaled.fetch_add(1, Ordering::AcqRel) + 1;
        match n.cmp(&LIE_AT) {
            std::cmp::Ordering::Less => self.conn.post(qp, wr),
            std::cmp::Ordering::Equal if self.honest => self.conn.post(qp, wr),
            std::cmp::Ordering::Equal => {
                self.report(&wr, WcStatus::Success);
                Ok(())
            }
            std::cmp::Ordering::Greater => {
                self.report(&wr, WcStatus::WrFlushErr);
                Ok(())
            }
        }
    }
    fn is_broken(&self) -> bool {
        self.conn.is_broken()
    }
    fn close(&self) {
        self.conn.close()
    }
}

const LEN: u64 = 1 << 20;
const SEG: u64 = 16 << 10;

/// Agents A (initiator, over a [`Lying`] fabric) and B, with A's `src` of 7s and B's `dst` of 0s
/// (1 MiB each).
async fn pair(honest: bool) -> (Node2, Node2) {
    let no_peer = |_: &str| -> Result<Arc<dyn PeerApi>, PeerError> { unreachable!("B initiates nothing") };
    let b = node_on("node-b", Arc::new(no_peer), |_| {}, |f| f).await;
    let peer = Arc::new(LocalPeer::new(b.node.clone()));
    let connector: Connector = Arc::new(move |_: &str| -> Result<Arc<dyn PeerApi>, PeerError> { Ok(peer.clone()) });
    let a = node_on(A, connector, |_| {}, |inner| lying(inner, honest)).await;
    let data: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8 + 1).collect();
    region(&a.node, "src", LEN, 0);
    a.node.region("src").unwrap().memory.write_at(0, &data).unwrap();
    region(&b.node, "dst", LEN, 0);
    (a, b)
}

/// A batch of 64 segments of 16 KiB, the destination in reverse order of the source, with a
/// notification; one QP per path, 4 KiB work requests each signaled.
fn batch(op: Op) -> TransferRequest {
    let mut req = write(if op == Op::Write { "src" } else { "dst" }, if op == Op::Write { "dst" } else { "src" }, 0, false);
    req.op = op;
    req.length = 0;
    req.notify = Some(b"batch-7".to_vec());
    req.options.qps = Some(2);
    req.options.depth = Some(4);
    let n = LEN / SEG;
    req.segments = (0..n).map(|i| SegmentSpec { local: i * SEG, remote: (n - 1 - i) * SEG, len: SEG }).collect();
    req
}

/// The bytes a transfer should have put in place: segment i of the source at n-1-i.
fn expected() -> Vec<u8> {
    let data: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8 + 1).collect();
    let n = (LEN / SEG) as usize;
    (0..n).flat_map(|i| data[(n - 1 - i) * SEG as usize..(n - i) * SEG as usize].to_vec()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_failed_path_lied_fails_and_is_never_announced() {
    let (a, b) = pair(false).await;
    let mut notes = b.grants.hub().subscribe();
    let t = a.node.submit(batch(Op::Write)).await.unwrap();
    let r = finished(&a.node, &t.id).await;
    assert_eq!(r.state, TransferState::Failed, "{r:?}");
    assert_eq!(r.error_code, Some(FailureCode::ChecksumMismatch), "{r:?}");
    assert!(r.error.as_deref().unwrap_or("").contains("failed over"), "{r:?}");
    assert!(r.failovers >= 1, "{r:?}");
    // `finished` returned after Peer.Complete did: whatever B published, it has.
    assert!(notes.try_recv().is_err(), "a batch that did not fully land was announced");
    let inbound = b.node.list_transfers();
    assert!(inbound.iter().any(|x| x.inbound && x.state == TransferState::Failed), "{inbound:?}");
    // The lie is real: 4 KiB of the destination never arrived.
    let mut got = vec![0u8; LEN as usize];
    b.node.region("dst").unwrap().memory.read_at(0, &mut got).unwrap();
    let missing = got.iter().zip(expected()).filter(|(g, e)| **g != *e).count();
    assert_eq!(missing, 4096, "the lied WR's bytes, and only those, are missing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_failed_over_honestly_is_verified_and_announced_once() {
    for op in [Op::Write, Op::Read] {
        let (a, b) = pair(true).await;
        let mut notes = b.grants.hub().subscribe();
        let mut req = batch(op);
        if op == Op::Read {
            // A pull: A's `dst` (zeros) gets B's `src` (the pattern).
            region(&b.node, "src", LEN, 0);
            let data: Vec<u8> = (0..LEN).map(|i| (i % 251) as u8 + 1).collect();
            b.node.region("src").unwrap().memory.write_at(0, &data).unwrap();
            region(&a.node, "dst", LEN, 0);
            req.segments = req.segments.iter().map(|s| SegmentSpec { local: s.remote, remote: s.local, len: s.len }).collect();
        }
        let t = a.node.submit(req).await.unwrap();
        let r = finished(&a.node, &t.id).await;
        assert_eq!(r.state, TransferState::Succeeded, "{op:?}: {r:?}");
        assert!(r.failovers >= 1 && r.verified, "{op:?}: verified after the failover: {r:?}");
        let n = notes.try_recv().expect("announced once every byte landed");
        assert_eq!(n.tag, b"batch-7");
        assert!(notes.try_recv().is_err(), "{op:?}: announced twice");
        let (side, name) = if op == Op::Write { (&b, "dst") } else { (&a, "dst") };
        let mut got = vec![0u8; LEN as usize];
        side.node.region(name).unwrap().memory.read_at(0, &mut got).unwrap();
        assert!(got == expected(), "{op:?}: the bytes that landed");
    }
}

/// Runs one batch of `batch(op)`'s segments on a channel from A to B; the batch's outcome.
async fn channel_batch(a: &Node2, op: Op) -> xfer_agent::node::BatchOutcome {
    use xfer_agent::node::{ChannelInput, ChannelOutput, ChannelParams};
    let req = batch(op);
    let params = ChannelParams {
        op,
        local_region: req.local_region.clone(),
        remote_agent: req.remote_agent.clone(),
        remote_region: req.remote_region.clone(),
        remote_offset: 0,
        length: 0,
        options: req.options.clone(),
        ttl: None,
        notify: true,
    };
    let ch = a.node.open_channel(params).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let (out_tx, mut out) = tokio::sync::mpsc::channel(4);
    let run = tokio::spawn(ch.run(rx, out_tx, tokio_util::sync::CancellationToken::new()));
    tx.send(ChannelInput::Post { seq: 0, segments: req.segments, list: 0, notify: Some(b"batch-7".to_vec()) }).await.unwrap();
    let Some(ChannelOutput::Done(outcome)) = out.recv().await else { panic!("no outcome") };
    drop(tx);
    run.await.unwrap();
    outcome
}

/// A channel batch across the same lie: the batch fails CHECKSUM_MISMATCH and is never announced;
/// across an honest failover it is verified and announced once (`Peer.VerifyBatch`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_batch_is_verified_after_a_failover_and_announced_only_if_it_landed() {
    for honest in [false, true] {
        let (a, b) = pair(honest).await;
        let mut notes = b.grants.hub().subscribe();
        let outcome = channel_batch(&a, Op::Write).await;
        let mut got = vec![0u8; LEN as usize];
        b.node.region("dst").unwrap().memory.read_at(0, &mut got).unwrap();
        if honest {
            assert!(outcome.ok, "{outcome:?}");
            let n = notes.try_recv().expect("announced once every byte landed");
            assert_eq!(n.tag, b"batch-7");
            assert!(got == expected(), "the bytes that landed");
        } else {
            let (code, msg) = outcome.error.clone().expect("failed");
            assert_eq!(code, "CHECKSUM_MISMATCH", "{outcome:?}");
            assert!(msg.contains("failed over mid-batch"), "{msg}");
            assert_eq!(got.iter().zip(expected()).filter(|(g, e)| **g != *e).count(), 4096, "the lie is real");
        }
        assert!(notes.try_recv().is_err(), "honest {honest}: announced again or announced a batch that did not land");
    }
}
