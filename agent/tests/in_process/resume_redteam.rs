//! Red team of the session resume: a peer that lets a transfer's connection die and then holds
//! the resume's Connect or Grant, a peer that restarted between the lost connection and the
//! resume. The transfer's cancel and deadline still hold while it resumes, everything it got
//! from the peer is given back, and bytes a restarted peer lost are never reported as landed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use xfer_agent::peer_api::{CompleteParams, Connector, GrantAsk, GrantInfo, HandshakeReply, PeerApi, PeerError, Walk};
use xfer_agent::transfer::{TransferRecord, TransferState};
use xfer_engine::failure::FailureCode;
use xfer_engine::ids::{ConnectionId, GrantId};
use xfer_fabric::{Endpoint, FabricKind};

use crate::initiator::{finished, node_on, region, write, LocalPeer, Node2, A};
use crate::resume::{flushing, pattern, LEN};

/// A peer over in-process targets: `targets[0]` until `switch_after` grants were made, then
/// `targets[1]` (the peer restarted: a fresh instance). Grant number `hold_grant` (0-based) is
/// made at the target and its answer then held until the test releases it (or the caller
/// drops the call).
struct Hostile {
    targets: Vec<LocalPeer>,
    switch_after: u32,
    /// Grant calls made.
    grants: Arc<AtomicU32>,
    /// Revoke calls that reached a target.
    revokes: Arc<AtomicU32>,
    hold_grant: Option<u32>,
    /// Handshake number n (0-based; `u32::MAX`: none) is accepted at the target and its answer
    /// then held, like `hold_grant`.
    hold_handshake: Arc<AtomicU32>,
    handshakes: AtomicU32,
    /// Notified when the held grant was made at the target.
    arrived: Arc<Notify>,
    release: Arc<Notify>,
    /// Notified after every revoke and disconnect reached the target.
    gave_back: Arc<Notify>,
    /// Which target answered the last handshake (grants and the rest go to that one).
    current: Mutex<usize>,
}

impl Hostile {
    fn target(&self) -> &LocalPeer {
        &self.targets[*self.current.lock().unwrap()]
    }
}

#[async_trait]
impl PeerApi for Hostile {
    async fn handshake(
        &self,
        node_name: &str,
        fabric: FabricKind,
        endpoints: Vec<Endpoint>,
        connection_id: &ConnectionId,
    ) -> Result<HandshakeReply, PeerError> {
        let which = usize::from(self.grants.load(Ordering::Acquire) >= self.switch_after).min(self.targets.len() - 1);
        *self.current.lock().unwrap() = which;
        let reply = self.targets[which].handshake(node_name, fabric, endpoints, connection_id).await;
        if self.hold_handshake.load(Ordering::Acquire) == self.handshakes.fetch_add(1, Ordering::AcqRel) {
            self.arrived.notify_one();
            self.release.notified().await;
        }
        reply
    }
    async fn grant(&self, ask: &GrantAsk<'_>, node_name: &str, connection_id: &ConnectionId) -> Result<GrantInfo, PeerError> {
        let n = self.grants.fetch_add(1, Ordering::AcqRel);
        let g = self.target().grant(ask, node_name, connection_id).await;
        if self.hold_grant == Some(n) {
            self.arrived.notify_one();
            self.release.notified().await;
        }
        g
    }
    async fn revoke(&self, grant_id: &str) -> Result<(), PeerError> {
        let r = self.target().revoke(grant_id).await;
        self.revokes.fetch_add(1, Ordering::AcqRel);
        self.gave_back.notify_one();
        r
    }
    async fn complete(&self, p: CompleteParams) -> Result<bool, PeerError> {
        self.target().complete(p).await
    }
    async fn announce(&self, grant_id: &GrantId, seq: u64, tag: &[u8]) -> Result<(), PeerError> {
        self.target().announce(grant_id, seq, tag).await
    }
    async fn verify_batch(
        &self,
        grant_id: &GrantId,
        seq: u64,
        sum: (xfer_agent::checksum::Algo, u64),
        spans: Vec<(u64, u64)>,
        settle: bool,
    ) -> Result<bool, PeerError> {
        self.target().verify_batch(grant_id, seq, sum, spans, settle).await
    }
    async fn disconnect(&self, connection_id: &ConnectionId, node_name: &str) {
        // Every instance is told: the one that made the connection forgets it.
        for t in &self.targets {
            t.disconnect(connection_id, node_name).await;
        }
        self.gave_back.notify_one();
    }
    async fn open_sink(&self, connections: u32, tls: bool, walk: Walk) -> Result<String, PeerError> {
        self.target().open_sink(connections, tls, walk).await
    }
    async fn open_bench_region(&self, length: u64) -> Result<String, PeerError> {
        self.target().open_bench_region(length).await
    }
    async fn close_bench_region(&self, region: &str) -> Result<(), PeerError> {
        self.target().close_bench_region(region).await
    }
    async fn ping(&self) -> Result<(), PeerError> {
        self.target().ping().await
    }
}

struct World {
    a: Node2,
    /// The peer's instances: the second is the one a restart brings up.
    bs: Vec<Node2>,
    arrived: Arc<Notify>,
    release: Arc<Notify>,
    gave_back: Arc<Notify>,
    revokes: Arc<AtomicU32>,
    grants: Arc<AtomicU32>,
    hold_handshake: Arc<AtomicU32>,
}

/// A (over a fabric whose first connection dies after a few WRs, two resumes allowed, with
/// `timeout`) and `instances` of the peer, each with a zeroed 1 MiB `dst`.
async fn world(instances: usize, switch_after: u32, hold_grant: Option<u32>, timeout: Duration) -> World {
    world_dying(instances, switch_after, hold_grant, timeout, 1, 2).await
}

/// [`world`] holding the answer to handshake `n` instead of a grant's.
async fn world_holding_connect(n: u32) -> World {
    let w = world_dying(1, u32::MAX, None, Duration::from_secs(120), 1, 2).await;
    w.hold_handshake.store(n, Ordering::Release);
    w
}

/// [`world`] where the first `doomed` connections die and `resumes` are allowed.
async fn world_dying(instances: usize, switch_after: u32, hold_grant: Option<u32>, timeout: Duration, doomed: u32, resumes: u32) -> World {
    let no_peer = |_: &str| -> Result<Arc<dyn PeerApi>, PeerError> { unreachable!("the peer initiates nothing") };
    let mut bs = Vec::new();
    for _ in 0..instances {
        let b = node_on("node-b", Arc::new(no_peer), |_| {}, |f| f).await;
        region(&b.node, "dst", LEN, 0);
        bs.push(b);
    }
    let (arrived, release, gave_back) = (Arc::new(Notify::new()), Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (revokes, grants) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let hold_handshake = Arc::new(AtomicU32::new(u32::MAX));
    let peer = Arc::new(Hostile {
        targets: bs.iter().map(|b| LocalPeer::new(b.node.clone())).collect(),
        switch_after,
        grants: grants.clone(),
        revokes: revokes.clone(),
        hold_grant,
        hold_handshake: hold_handshake.clone(),
        handshakes: AtomicU32::new(0),
        arrived: arrived.clone(),
        release: release.clone(),
        gave_back: gave_back.clone(),
        current: Mutex::new(0),
    });
    let connector: Connector = Arc::new(move |_: &str| -> Result<Arc<dyn PeerApi>, PeerError> { Ok(peer.clone()) });
    let a = node_on(
        A,
        connector,
        |c| {
            c.transfer.resume_attempts = resumes;
            c.transfer.timeout.0 = timeout;
        },
        move |inner| flushing(inner, doomed),
    )
    .await;
    region(&a.node, "src", LEN, 0);
    a.node.region("src").unwrap().memory.write_at(0, &pattern()).unwrap();
    World { a, bs, arrived, release, gave_back, revokes, grants, hold_handshake }
}

/// One 1 MiB WRITE over two QPs, with a notification, the transfer's own timeout unset (the
/// agent's `transfer.timeout` applies). Depth 1: every WR is signaled and retired before the
/// next on its QP, so the first WRs have landed (and been retired) when the connection dies.
async fn submit(w: &World) -> TransferRecord {
    let mut req = write("src", "dst", LEN, false);
    req.notify = Some(b"resume-redteam".to_vec());
    req.options.qps = Some(2);
    req.options.depth = Some(1);
    req.options.timeout = None;
    w.a.node.submit(req).await.unwrap()
}

/// Waits until the peer's instances hold no grant and no connection of A's (each revoke or
/// disconnect reaching them wakes this).
async fn peer_forgets_everything(w: &World) {
    loop {
        let held: usize = w.bs.iter().map(|b| b.grants.len() + b.node.state_counts().accepted).sum();
        if held == 0 {
            return;
        }
        w.gave_back.notified().await;
    }
}

/// A cancel while the resume's grant answer is held by the peer ends the transfer CANCELLED at
/// once (it waited for the peer's answer before: up to the RPC timeout per call, for every
/// resume, and a drain's cancel with it), and the peer forgets the grant it made and the fresh
/// connection: nothing published, nothing left held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_while_the_resumes_grant_is_held_ends_the_transfer_and_gives_everything_back() {
    let w = world(1, u32::MAX, Some(1), Duration::from_secs(120)).await;
    let mut notes = w.bs[0].grants.hub().subscribe();
    let t = submit(&w).await;
    w.arrived.notified().await;
    // (The lost connection's grant is revoked in the background: it may still be there.)
    assert!(!w.bs[0].grants.is_empty(), "the resume's grant was made at the peer");
    w.a.node.cancel(&t.id).unwrap();
    let r = finished(&w.a.node, &t.id).await;
    assert_eq!(r.state, TransferState::Cancelled, "{r:?}");
    assert_eq!(r.error_code, Some(FailureCode::Cancelled), "{r:?}");
    peer_forgets_everything(&w).await;
    assert!(notes.try_recv().is_err(), "a cancelled transfer was announced");
    let counts = w.a.node.state_counts();
    assert_eq!((counts.transfers_active, counts.submitting), (0, 0), "{counts:?}");
}

/// The transfer's deadline holds while the resume's grant answer is held: it fails
/// DEADLINE_EXCEEDED saying it was resuming (it ran on, unbounded by its own deadline, until
/// the peer answered), and the peer forgets what the resume got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_holds_while_the_resumes_grant_is_held() {
    // 5 s: ample for the first connection to die (a few 4 KiB WRs) before the deadline, which
    // then passes while the resume waits; nothing here waits on time but the transfer itself.
    let w = world(1, u32::MAX, Some(1), Duration::from_secs(5)).await;
    let t = submit(&w).await;
    w.arrived.notified().await;
    let r = finished(&w.a.node, &t.id).await;
    assert_eq!(r.state, TransferState::Failed, "{r:?}");
    assert_eq!(r.error_code, Some(FailureCode::DeadlineExceeded), "{r:?}");
    assert!(r.error.as_deref().unwrap_or("").contains("resuming"), "{r:?}");
    peer_forgets_everything(&w).await;
    // A late answer finds nobody waiting.
    w.release.notify_one();
}

/// The peer restarted between the lost connection and the resume: the fresh instance's `dst`
/// never got the bytes the first connection retired. The resume moves only what was left, so
/// the end-to-end verify must catch it: the transfer fails CHECKSUM_MISMATCH, never SUCCEEDED,
/// and the new instance never announces the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_restarted_before_the_resume_is_caught_by_the_verify() {
    let w = world(2, 1, None, Duration::from_secs(120)).await;
    let mut notes: Vec<_> = w.bs.iter().map(|b| b.grants.hub().subscribe()).collect();
    let t = submit(&w).await;
    let r = finished(&w.a.node, &t.id).await;
    assert_eq!(r.state, TransferState::Failed, "{r:?}");
    assert_eq!(r.error_code, Some(FailureCode::ChecksumMismatch), "{r:?}");
    assert!(r.failovers >= 1, "it resumed: {r:?}");
    assert!(r.error.as_deref().unwrap_or("").contains("restarted"), "the message says why: {r:?}");
    for n in &mut notes {
        assert!(n.try_recv().is_err(), "a batch that did not land whole was announced");
    }
    let mut got = vec![0u8; LEN as usize];
    w.bs[1].node.region("dst").unwrap().memory.read_at(0, &mut got).unwrap();
    assert!(got != pattern(), "the restarted instance did not get the whole range");
}

/// A drain (SIGTERM, no grace left) while the resume's grant answer is held: the drain's cancel
/// ends the transfer CANCELLED before the drain returns (the resume used to go on past the
/// drain, dialling the peer after the agent closed its connections), and the peer forgets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_while_resuming_cancels_the_transfer_before_it_returns() {
    let w = world(1, u32::MAX, Some(1), Duration::from_secs(120)).await;
    let t = submit(&w).await;
    w.arrived.notified().await;
    w.a.node.drain(Duration::ZERO).await;
    let r = w.a.node.transfer(&t.id).unwrap().snapshot();
    assert_eq!(r.state, TransferState::Cancelled, "ended before the drain returned: {r:?}");
    peer_forgets_everything(&w).await;
}

/// A peer that makes every connection die, against the most resumes allowed (8): nine
/// connections and grants, each given back exactly once (every grant revoked once: none was
/// consumed, nothing landed whole), nothing announced, nothing left held on either side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_dying_through_every_resume_leaks_nothing() {
    let w = world_dying(1, u32::MAX, None, Duration::from_secs(120), u32::MAX, 8).await;
    let mut notes = w.bs[0].grants.hub().subscribe();
    let t = submit(&w).await;
    let r = finished(&w.a.node, &t.id).await;
    assert_eq!(r.state, TransferState::Failed, "{r:?}");
    assert_eq!(r.failovers, 8, "each resume is counted: {r:?}");
    assert!(r.bytes_done <= LEN, "{r:?}");
    peer_forgets_everything(&w).await;
    let grants = w.grants.load(Ordering::Acquire);
    assert_eq!(grants, 9, "one grant per connection");
    // The revokes were sent in the background: the peer forgot every grant, by revoke or by
    // the disconnect of its connection; none was revoked twice.
    assert!(w.revokes.load(Ordering::Acquire) <= grants, "a grant revoked twice");
    assert!(notes.try_recv().is_err(), "a transfer that never landed was announced");
    let c = w.a.node.state_counts();
    assert_eq!((c.transfers_active, c.submitting, c.lease_tenants), (0, 0, 0), "{c:?}");
}

/// A cancel while the resume's Connect answer is held, after the peer accepted the connection:
/// the transfer ends CANCELLED at once and the peer is told to forget the connection it
/// accepted (it was left there, counted against this agent's connections at the peer, and the
/// agent's own count did not include it: a later connection could make the peer evict one in
/// use). The same holds for any negotiation dropped mid-way (a submit whose caller went away).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_while_the_resumes_connect_is_held_leaves_no_connection_at_the_peer() {
    let w = world_holding_connect(1).await;
    let t = submit(&w).await;
    w.arrived.notified().await;
    // (The lost connection's disconnect is sent in the background: it may still be counted.)
    assert!(w.bs[0].node.state_counts().accepted >= 1, "the peer accepted the resume's connection");
    w.a.node.cancel(&t.id).unwrap();
    let r = finished(&w.a.node, &t.id).await;
    assert_eq!(r.state, TransferState::Cancelled, "{r:?}");
    peer_forgets_everything(&w).await;
}

/// A cancel while the resume's grant answer is held counts the resume as `cancelled` in
/// `xfer_transfer_resumes_total`, not as `failed` (it used to: an alert on failed resumes fired
/// for a user's cancel). Current-thread runtime, so every task of both agents records into the
/// test's own recorder (set for this thread only; nothing process-wide).
#[tokio::test]
async fn a_cancel_while_resuming_counts_a_cancelled_resume_not_a_failed_one() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _local = metrics::set_default_local_recorder(&recorder);
    let w = world(1, u32::MAX, Some(1), Duration::from_secs(120)).await;
    let t = submit(&w).await;
    w.arrived.notified().await;
    w.a.node.cancel(&t.id).unwrap();
    let r = finished(&w.a.node, &t.id).await;
    assert_eq!(r.state, TransferState::Cancelled, "{r:?}");
    let text = handle.render();
    let resumes: Vec<&str> = text.lines().filter(|l| l.starts_with("xfer_transfer_resumes_total{")).collect();
    assert_eq!(resumes, vec![r#"xfer_transfer_resumes_total{result="cancelled"} 1"#], "{text}");
    peer_forgets_everything(&w).await;
}
