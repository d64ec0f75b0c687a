//! A transfer whose connection loses every path with no port event to explain it — Soft-RoCE
//! flushing a connection's QPs under load — resumes on a fresh connection and grant with what no
//! completion retired, is verified end to end, and its batch is announced exactly once; without
//! resumes (or when every connection dies) it fails with the path's code and is never announced.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use xfer_agent::peer_api::{Connector, PeerApi, PeerError};
use xfer_agent::transfer::{Op, TransferRequest, TransferState};
use xfer_engine::batch::SegmentSpec;
use xfer_engine::failure::FailureCode;
use xfer_engine::status::WcStatus;
use xfer_fabric::{Completion, CompletionSink, Connection, Fabric, FabricError, WorkRequest};

use crate::initiator::{finished, node_on, region, write, LocalPeer, Node2, A};
use crate::wrapped::Wrapped;

/// Signaled data WRs a doomed connection carries before every later post on it is flushed.
const FLUSH_AFTER: u32 = 3;

/// The tcp fabric whose first `doomed` connections flush every post after their
/// `FLUSH_AFTER`-th signaled data WR (`WR_FLUSH_ERR`, not posted; the connection then counts as
/// broken), on every QP: the whole connection is lost at once, with no event.
pub(crate) fn flushing(inner: Arc<dyn Fabric>, doomed: u32) -> Arc<dyn Fabric> {
    let made = AtomicU32::new(0);
    Arc::new(Wrapped {
        inner,
        wrap: Box::new(move |sink, _| {
            let doomed = made.fetch_add(1, Ordering::AcqRel) < doomed;
            Box::new(move |conn| {
                Arc::new(FlushingConn { conn, sink, doomed, signaled: AtomicU32::new(0), flushed: AtomicBool::new(false) })
            })
        }),
    })
}

struct FlushingConn {
    conn: Arc<dyn Connection>,
    sink: CompletionSink,
    doomed: bool,
    signaled: AtomicU32,
    flushed: AtomicBool,
}

impl Connection for FlushingConn {
    fn qps(&self) -> usize {
        self.conn.qps()
    }
    fn paths(&self) -> Vec<xfer_fabric::PathInfo> {
        self.conn.paths()
    }
    fn post(&self, qp: usize, wr: WorkRequest) -> Result<(), FabricError> {
        if self.doomed && wr.len > 0 && wr.signaled && self.signaled.fetch_add(1, Ordering::AcqRel) >= FLUSH_AFTER {
            self.flushed.store(true, Ordering::Release);
        }
        if self.flushed.load(Ordering::Acquire) {
            let _ = self.sink.send(Completion { wr_id: wr.wr_id, qp, status: WcStatus::WrFlushErr, byte_len: 0 });
            return Ok(());
        }
        self.conn.post(qp, wr)
    }
    fn is_broken(&self) -> bool {
        self.flushed.load(Ordering::Acquire) || self.conn.is_broken()
    }
    fn close(&self) {
        self.conn.close()
    }
}

pub(crate) const LEN: u64 = 1 << 20;
const SEG: u64 = 16 << 10;

/// Agents A (initiator, over a [`flushing`] fabric whose first `doomed` connections die) and B;
/// A's `src` holds a pattern, B's `dst` zeros (1 MiB each).
async fn pair(doomed: u32, resumes: u32) -> (Node2, Node2) {
    let no_peer = |_: &str| -> Result<Arc<dyn PeerApi>, PeerError> { unreachable!("B initiates nothing") };
    let b = node_on("node-b", Arc::new(no_peer), |_| {}, |f| f).await;
    let peer = Arc::new(LocalPeer::new(b.node.clone()));
    let connector: Connector = Arc::new(move |_: &str| -> Result<Arc<dyn PeerApi>, PeerError> { Ok(peer.clone()) });
    let a = node_on(A, connector, |c| c.transfer.resume_attempts = resumes, |inner| flushing(inner, doomed)).await;
    region(&a.node, "src", LEN, 0);
    a.node.region("src").unwrap().memory.write_at(0, &pattern()).unwrap();
    region(&b.node, "dst", LEN, 0);
    (a, b)
}

pub(crate) fn pattern() -> Vec<u8> {
    (0..LEN).map(|i| (i % 251) as u8 + 1).collect()
}

/// A batch of 64 segments of 16 KiB, the destination in reverse order, with a notification.
fn batch() -> TransferRequest {
    let mut req = write("src", "dst", 0, false);
    req.length = 0;
    req.notify = Some(b"resumed-batch".to_vec());
    req.options.qps = Some(2);
    req.options.depth = Some(4);
    let n = LEN / SEG;
    req.segments = (0..n).map(|i| SegmentSpec { local: i * SEG, remote: (n - 1 - i) * SEG, len: SEG }).collect();
    req
}

fn expected() -> Vec<u8> {
    let data = pattern();
    let n = (LEN / SEG) as usize;
    (0..n).flat_map(|i| data[(n - 1 - i) * SEG as usize..(n - i) * SEG as usize].to_vec()).collect()
}

fn dst(b: &Node2) -> Vec<u8> {
    let mut got = vec![0u8; LEN as usize];
    b.node.region("dst").unwrap().memory.read_at(0, &mut got).unwrap();
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_lost_its_whole_connection_resumes_lands_and_is_announced_once() {
    let (a, b) = pair(1, 2).await;
    let mut notes = b.grants.hub().subscribe();
    let t = a.node.submit(batch()).await.unwrap();
    let r = finished(&a.node, &t.id).await;
    assert_eq!(r.state, TransferState::Succeeded, "{r:?}");
    assert!(r.verified, "a resumed transfer is verified end to end: {r:?}");
    assert!(r.failovers >= 1, "the resume is counted: {r:?}");
    assert_eq!(r.bytes_done, LEN, "progress counts every byte once: {r:?}");
    assert!(dst(&b) == expected(), "the bytes that landed");
    let n = notes.try_recv().expect("announced once every byte landed");
    assert_eq!(n.tag, b"resumed-batch");
    assert!(notes.try_recv().is_err(), "announced twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_resumes_too() {
    let (a, b) = pair(1, 2).await;
    // A pull: A's `dst` (zeros) gets B's `src` (the pattern), one range.
    region(&b.node, "src", LEN, 0);
    b.node.region("src").unwrap().memory.write_at(0, &pattern()).unwrap();
    region(&a.node, "dst", LEN, 0);
    let mut req = write("dst", "src", 0, false);
    req.op = Op::Read;
    req.options.qps = Some(2);
    req.options.depth = Some(4);
    let t = a.node.submit(req).await.unwrap();
    let r = finished(&a.node, &t.id).await;
    assert_eq!(r.state, TransferState::Succeeded, "{r:?}");
    assert!(r.verified && r.failovers >= 1, "{r:?}");
    let mut got = vec![0u8; LEN as usize];
    a.node.region("dst").unwrap().memory.read_at(0, &mut got).unwrap();
    assert!(got == pattern(), "the bytes read");
}

/// Without resumes, or when every fresh connection dies too, the transfer fails with the
/// flush's code, the message says what happened, and the batch is never announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_resume_or_a_live_connection_the_batch_fails_and_is_never_announced() {
    for (doomed, resumes) in [(1, 0), (u32::MAX, 2)] {
        let (a, b) = pair(doomed, resumes).await;
        let mut notes = b.grants.hub().subscribe();
        let t = a.node.submit(batch()).await.unwrap();
        let r = finished(&a.node, &t.id).await;
        assert_eq!(r.state, TransferState::Failed, "{r:?}");
        assert_eq!(r.error_code, Some(FailureCode::Completion(WcStatus::WrFlushErr)), "{r:?}");
        assert!(r.error.as_deref().unwrap_or("").contains("every path to the peer is down"), "{r:?}");
        assert_eq!(r.failovers, resumes, "each resume is counted: {r:?}");
        assert!(notes.try_recv().is_err(), "a batch that did not land was announced");
        assert!(dst(&b) != expected(), "it did not land whole");
    }
}
