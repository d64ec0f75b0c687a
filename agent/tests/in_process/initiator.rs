//! The initiator driven against an in-process peer: a [`PeerApi`] that calls the target `Node`
//! directly (no gRPC), with hooks to hold a call. The tcp data plane is real (both nodes' tcp
//! fabrics on loopback). This is where orderings that a real deployment only hits by chance —
//! a call held while other transfers run — are made deterministic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;
use xfer_engine::ids::ConnectionId;

use async_trait::async_trait;
use tokio::sync::Notify;
use xfer_agent::config::Config;
use xfer_agent::grants::GrantTable;
use xfer_agent::node::{GrantParams, InboundEnd, Node, NotifyAsk};
use xfer_agent::peer_api::{CompleteParams, Connector, GrantAsk, GrantInfo, HandshakeReply, PeerApi, PeerError, RemoteCode, Walk};
use xfer_agent::regions::RegionSpec;
use xfer_agent::transfer::{Op, TransferOptions, TransferRecord, TransferRequest, TransferState};
use xfer_fabric::tcp::TcpFabric;
use xfer_fabric::{Access, Endpoint, Fabric, FabricKind, RemoteKey};

/// The initiator's name as the target sees it (what a certificate's NAME would be).
pub(crate) const A: &str = "node-a";
/// Any address: the connector below ignores it.
pub(crate) const B_ADDR: &str = "127.0.0.1:1";

/// `PeerApi` over the target node in this process.
pub(crate) struct LocalPeer {
    target: Arc<Node>,
    /// While set, `complete` waits for a `notify_one` before calling the target.
    hold_complete: Option<Arc<Notify>>,
    /// Notified when a held `complete` has arrived (and is waiting).
    complete_arrived: Arc<Notify>,
    /// While set, `grant` waits here after the target granted (the answer is not yet returned).
    hold_grant: Option<Arc<Notify>>,
    /// Notified when a held grant has been made at the target.
    grant_made: Arc<Notify>,
    /// Notified on every `disconnect` and `revoke` call.
    gave_back: Arc<Notify>,
    /// While set, every grant is answered with this key instead of the target's (a hostile or
    /// broken peer).
    key: Option<RemoteKey>,
}

impl LocalPeer {
    pub(crate) fn new(target: Arc<Node>) -> LocalPeer {
        LocalPeer {
            target,
            hold_complete: None,
            complete_arrived: Arc::new(Notify::new()),
            hold_grant: None,
            grant_made: Arc::new(Notify::new()),
            gave_back: Arc::new(Notify::new()),
            key: None,
        }
    }
}

fn remote(e: impl std::fmt::Display) -> PeerError {
    PeerError::Remote { addr: B_ADDR.into(), code: RemoteCode::Other, message: e.to_string() }
}

#[async_trait]
impl PeerApi for LocalPeer {
    async fn handshake(
        &self,
        node_name: &str,
        fabric: FabricKind,
        endpoints: Vec<Endpoint>,
        connection_id: &ConnectionId,
    ) -> Result<HandshakeReply, PeerError> {
        assert_eq!(node_name, A);
        let endpoints = self.target.accept_connection(A, connection_id, fabric, &endpoints).await.map_err(remote)?;
        Ok(HandshakeReply {
            node_name: self.target.node_name().to_string(),
            instance_id: self.target.instance_id().to_string(),
            fabric: self.target.fabric_kind(),
            endpoints,
            max_connections: self.target.limits().max_connections_per_peer as u32,
            max_streams: self.target.streams_per_peer() as u32,
        })
    }

    async fn grant(&self, ask: &GrantAsk<'_>, _node_name: &str, connection_id: &ConnectionId) -> Result<GrantInfo, PeerError> {
        let p = GrantParams {
            region: ask.region.to_string(),
            offset: ask.offset,
            length: ask.length,
            op: ask.op,
            ttl: Some(ask.ttl),
            peer: A.to_string(),
            connection_id: Some(connection_id.clone()),
            notify: ask.notify.map(|(t, m)| match ask.channel {
                true => NotifyAsk::Channel { markers: m },
                false => NotifyAsk::Once { tag: t.to_vec(), markers: m },
            }),
        };
        let g = self.target.grant(&p).await.map_err(remote)?;
        if let Some(hold) = &self.hold_grant {
            self.grant_made.notify_one();
            hold.notified().await;
        }
        let key: RemoteKey = self.key.clone().unwrap_or_else(|| g.exposure.key.clone());
        Ok(GrantInfo {
            grant_id: g.id.clone(),
            addr: g.exposure.addr,
            key,
            length: g.len,
            expires_at: Some(g.expires_at),
            node_name: self.target.node_name().to_string(),
            instance_id: self.target.instance_id().to_string(),
            notify_slot: g.notify.as_ref().map(|n| n.slot).or(g.channel.as_ref().map(|c| c.base_imm)).unwrap_or(0),
        })
    }

    async fn revoke(&self, grant_id: &str) -> Result<(), PeerError> {
        let r = self.target.revoke(grant_id, A).map_err(remote);
        self.gave_back.notify_one();
        r
    }

    async fn complete(&self, p: CompleteParams) -> Result<bool, PeerError> {
        if let Some(hold) = &self.hold_complete {
            self.complete_arrived.notify_one();
            hold.notified().await;
        }
        let v = self
            .target
            .complete_inbound(
                &p.transfer_id,
                &p.grant_id,
                A,
                InboundEnd { bytes: p.bytes, op_write: p.op_write, checksum: p.checksum, spans: &p.spans },
            )
            .await
            .map_err(remote)?;
        Ok(p.checksum.is_none() || v.is_some_and(|v| v.0))
    }

    async fn announce(&self, grant_id: &xfer_engine::ids::GrantId, seq: u64, tag: &[u8]) -> Result<(), PeerError> {
        self.target.announce(grant_id, A, seq, tag.to_vec()).map_err(remote)
    }

    async fn verify_batch(
        &self,
        grant_id: &xfer_engine::ids::GrantId,
        seq: u64,
        sum: (xfer_agent::checksum::Algo, u64),
        spans: Vec<(u64, u64)>,
        settle: bool,
    ) -> Result<bool, PeerError> {
        let (matched, _) = self.target.verify_batch(grant_id.as_str(), A, seq, sum, &spans, settle).await.map_err(remote)?;
        Ok(matched)
    }

    async fn disconnect(&self, connection_id: &ConnectionId, _node_name: &str) {
        self.target.disconnect(connection_id, A);
        self.gave_back.notify_one();
    }

    async fn open_sink(&self, _connections: u32, _tls: bool, _walk: Walk) -> Result<String, PeerError> {
        Err(remote("not in this test"))
    }

    async fn open_bench_region(&self, _length: u64) -> Result<String, PeerError> {
        Err(remote("not in this test"))
    }

    async fn close_bench_region(&self, _region: &str) -> Result<(), PeerError> {
        Err(remote("not in this test"))
    }

    async fn ping(&self) -> Result<(), PeerError> {
        Err(remote("not in this test"))
    }
}

pub(crate) struct Node2 {
    pub(crate) node: Arc<Node>,
    pub(crate) grants: Arc<GrantTable>,
    _dir: tempfile::TempDir,
}

async fn node(name: &str, connector: Connector) -> Node2 {
    node_with(name, connector, |_| {}, false).await
}

/// [`node`] with its configuration changed by `tune`, and with `two_paths` over a [`TwoPaths`]
/// fabric.
pub(crate) async fn node_with(name: &str, connector: Connector, tune: impl FnOnce(&mut Config), two_paths: bool) -> Node2 {
    node_on(name, connector, tune, |f| if two_paths { Arc::new(TwoPaths(f)) } else { f }).await
}

/// [`node`] with its configuration changed by `tune`, over the tcp fabric as `wrap` returns it.
pub(crate) async fn node_on(
    name: &str,
    connector: Connector,
    tune: impl FnOnce(&mut Config),
    wrap: impl FnOnce(Arc<dyn Fabric>) -> Arc<dyn Fabric>,
) -> Node2 {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config { node_name: name.to_string(), state_dir: dir.path().to_path_buf(), ..Config::default() };
    tune(&mut cfg);
    let grants = Arc::new(GrantTable::new(1024));
    let fabric = wrap(Arc::new(TcpFabric::bind("127.0.0.1:0".parse().unwrap(), grants.clone(), None).await.unwrap()));
    Node2 { node: Node::new(cfg, fabric, "test".into(), grants.clone(), connector), grants, _dir: dir }
}

/// The tcp fabric with every connection holding twice the QPs asked, as a connection over two
/// devices holds the QPs asked on each: what the tenant's charge must count.
struct TwoPaths(Arc<dyn Fabric>);

#[async_trait]
impl Fabric for TwoPaths {
    fn kind(&self) -> FabricKind {
        self.0.kind()
    }
    fn grants_need_connection(&self) -> bool {
        self.0.grants_need_connection()
    }
    fn info(&self) -> xfer_fabric::FabricInfo {
        self.0.info()
    }
    fn register(
        &self,
        memory: Arc<xfer_rdma::memory::RegionMemory>,
        access: Access,
    ) -> Result<Arc<dyn xfer_fabric::Registration>, xfer_fabric::FabricError> {
        self.0.register(memory, access)
    }
    async fn expose(
        &self,
        reg: &Arc<dyn xfer_fabric::Registration>,
        req: &xfer_fabric::ExposeRequest,
    ) -> Result<xfer_fabric::Exposure, xfer_fabric::FabricError> {
        self.0.expose(reg, req).await
    }
    fn connection_qps(&self, qps: usize) -> usize {
        2 * qps
    }
    async fn prepare(
        &self,
        peer: &str,
        connection_id: &ConnectionId,
        qps: usize,
        depth: usize,
        sink: xfer_fabric::CompletionSink,
    ) -> Result<Box<dyn xfer_fabric::PendingConnection>, xfer_fabric::FabricError> {
        self.0.prepare(peer, connection_id, 2 * qps, depth, sink).await
    }
    async fn accept(
        &self,
        peer: &str,
        connection_id: &ConnectionId,
        remote: &[Endpoint],
    ) -> Result<(Vec<Endpoint>, Box<dyn xfer_fabric::Accepted>), xfer_fabric::FabricError> {
        self.0.accept(peer, connection_id, remote).await
    }
}

pub(crate) fn region(n: &Node, name: &str, len: u64, fill: u8) {
    let r = n.create_region(RegionSpec::anonymous(name, len, Access::ReadWrite)).unwrap();
    r.memory.write_at(0, &vec![fill; len as usize]).unwrap();
}

pub(crate) fn write(local: &str, remote: &str, len: u64, verify: bool) -> TransferRequest {
    TransferRequest {
        notify: None,
        segments: Vec::new(),
        op: Op::Write,
        local_region: local.into(),
        local_offset: 0,
        remote_agent: B_ADDR.into(),
        remote_region: remote.into(),
        remote_offset: 0,
        length: len,
        // One QP and the same depth for both transfers, so a pooled connection fits either.
        options: TransferOptions {
            chunk_size: Some(4096),
            qps: Some(1),
            depth: Some(1),
            verify,
            algo: None,
            timeout: Some(Duration::from_secs(120)),
        },
    }
}

/// Waits (on the record's watch channel, not on time) until the transfer is finished.
pub(crate) async fn finished(n: &Node, id: &str) -> TransferRecord {
    let h = n.transfer(id).unwrap();
    let mut rx = h.record.subscribe();
    loop {
        let r = rx.borrow_and_update().clone();
        if !matches!(r.state, TransferState::Queued | TransferState::Connecting | TransferState::Running) {
            return r;
        }
        rx.changed().await.unwrap();
    }
}

/// A transfer's connection carries its grant until `Peer.Complete`. While one transfer waits for
/// its Complete, a second transfer to the same peer must not be lent that connection: if it were,
/// cancelling the second (which discards its connection, and `Peer.Disconnect` revokes every grant
/// bound to it) would revoke the first transfer's grant before its Complete arrives — the soak saw
/// exactly that as VERIFY_FAILED "grant not found".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_is_not_lent_to_another_transfer_before_complete() {
    let b = node("node-b", Arc::new(|_: &str| -> Result<Arc<dyn PeerApi>, PeerError> { unreachable!("B initiates nothing") })).await;
    let hold = Arc::new(Notify::new());
    let arrived = Arc::new(Notify::new());
    let target = b.node.clone();
    let (h, ar) = (hold.clone(), arrived.clone());
    let connector: Connector = Arc::new(move |_: &str| -> Result<Arc<dyn PeerApi>, PeerError> {
        Ok(Arc::new(LocalPeer { hold_complete: Some(h.clone()), complete_arrived: ar.clone(), ..LocalPeer::new(target.clone()) }))
    });
    let a = node(A, connector).await;
    region(&a.node, "src", 64 << 10, 7);
    region(&a.node, "big", 16 << 20, 8);
    region(&b.node, "dst", 64 << 10, 0);
    region(&b.node, "dst2", 16 << 20, 0);

    // T1: its data lands, then its Complete is held at the peer.
    let t1 = a.node.submit(write("src", "dst", 64 << 10, true)).await.unwrap();
    arrived.notified().await;
    // T2 to the same peer meanwhile; cancelled at once (it discards its connection).
    let t2 = a.node.submit(write("big", "dst2", 16 << 20, false)).await.unwrap();
    a.node.cancel(&t2.id).unwrap();
    let r2 = finished(&a.node, &t2.id).await;
    assert_eq!(r2.state, TransferState::Cancelled, "{r2:?}");
    // Let T1's Complete through: its grant must still be there, and the checksum verified.
    hold.notify_one();
    let r1 = finished(&a.node, &t1.id).await;
    assert_eq!(r1.state, TransferState::Succeeded, "{r1:?}");
    assert!(r1.verified, "{r1:?}");
    let mut got = vec![0u8; 64 << 10];
    b.node.region("dst").unwrap().memory.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 7));
}

/// A submit whose caller goes away while the peer is granting (the gRPC request was dropped):
/// nothing the half-done submit obtained survives. The lease guard discards the connection,
/// which (`Peer.Disconnect`) revokes every grant the target bound to it — including the one whose
/// answer never arrived — and no record or slot is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_dropped_mid_grant_leaves_nothing_behind() {
    let b = node("node-b", Arc::new(|_: &str| -> Result<Arc<dyn PeerApi>, PeerError> { unreachable!("B initiates nothing") })).await;
    let hold = Arc::new(Notify::new());
    let peer = Arc::new(LocalPeer { hold_grant: Some(hold.clone()), ..LocalPeer::new(b.node.clone()) });
    let (made, gave_back) = (peer.grant_made.clone(), peer.gave_back.clone());
    let connector: Connector = Arc::new(move |_: &str| -> Result<Arc<dyn PeerApi>, PeerError> { Ok(peer.clone()) });
    let a = node(A, connector).await;
    region(&a.node, "src", 64 << 10, 7);
    region(&b.node, "dst", 64 << 10, 0);
    assert_eq!(b.grants.len(), 0);

    let submit = tokio::spawn({
        let n = a.node.clone();
        async move { n.submit(write("src", "dst", 64 << 10, false)).await }
    });
    made.notified().await;
    assert_eq!(b.grants.len(), 1, "the target granted");
    submit.abort();
    assert!(submit.await.unwrap_err().is_cancelled());
    // The dropped lease disconnects; that revokes the grant bound to the connection.
    gave_back.notified().await;
    assert_eq!(b.grants.len(), 0, "the grant went with the connection");
    assert!(a.node.list_transfers().is_empty(), "no record of a submit that never returned");
    // The initiator still works: the same transfer goes through.
    hold.notify_one(); // a permit for the next held grant
    let t = a.node.submit(write("src", "dst", 64 << 10, false)).await.unwrap();
    let r = finished(&a.node, &t.id).await;
    assert_eq!(r.state, TransferState::Succeeded, "{r:?}");
}

/// A peer whose grant carries a per-QP key list that does not fit the connection (one key short,
/// one too many, an `Each` list with no token to serve the rest): the initiator refuses the grant
/// when it arrives, naming both counts, before any work request is posted: the submit fails.
/// Nothing moved (the target's memory), and the grant is given back (revoked at the target).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_keys_do_not_fit_the_connection_is_refused_before_any_post() {
    let cases: Vec<(RemoteKey, &str)> = vec![
        (RemoteKey::PerQp(vec![1].into()), "1 per-QP keys for a connection of 2 QPs"),
        (RemoteKey::PerQp(vec![1, 2, 3].into()), "3 per-QP keys for a connection of 2 QPs"),
        (RemoteKey::PerQp(Vec::new().into()), "0 per-QP keys for a connection of 2 QPs"),
        (RemoteKey::Each(vec![RemoteKey::Rkey(1)].into()), "1 per-QP keys for a connection of 2 QPs, and no token last"),
    ];
    for (key, want) in cases {
        let b = node("node-b", Arc::new(|_: &str| -> Result<Arc<dyn PeerApi>, PeerError> { unreachable!("B initiates nothing") })).await;
        let peer = Arc::new(LocalPeer { key: Some(key.clone()), ..LocalPeer::new(b.node.clone()) });
        let gave_back = peer.gave_back.clone();
        let connector: Connector = Arc::new(move |_: &str| -> Result<Arc<dyn PeerApi>, PeerError> { Ok(peer.clone()) });
        let a = node(A, connector).await;
        region(&a.node, "src", 64 << 10, 7);
        region(&b.node, "dst", 64 << 10, 0);
        let mut req = write("src", "dst", 64 << 10, false);
        req.options.qps = Some(2);
        // The submit itself is refused (the grant is asked before the transfer is accepted).
        let err = a.node.submit(req).await.unwrap_err().to_string();
        assert!(err.contains("its grant's key does not fit connection") && err.contains(want), "{key:?}: {err}");
        assert!(a.node.list_transfers().iter().all(|r| r.bytes_done == 0), "{key:?}: nothing posted");
        let mut got = vec![1u8; 64 << 10];
        b.node.region("dst").unwrap().memory.read_at(0, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 0), "{key:?}: the target's bytes changed");
        // The refused grant is given back: revoked at the target, directly or with its connection.
        while !b.grants.is_empty() {
            gave_back.notified().await;
        }
    }
}

/// A tenant is charged the QPs its connection holds, not the QPs it asked for: over a fabric whose
/// connections hold two paths of the asked QPs each, a lease of 2 QPs counts 4, and the tenant's
/// share of the peer's streams (the peer keeps 8 for this agent; `limits.tenant_share` 0.5 gives
/// 4) refuses its next lease at the real count (4 + 2 > 4; counting what was asked, 2 + 1, would
/// have let it through).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_is_charged_the_qps_its_connection_holds() {
    let no_peer = |_: &str| -> Result<Arc<dyn PeerApi>, PeerError> { unreachable!("B initiates nothing") };
    let b = node_with("node-b", Arc::new(no_peer), |c| c.limits.max_data_connections_per_peer = 8, false).await;
    let hold = Arc::new(Notify::new());
    let peer = Arc::new(LocalPeer { hold_complete: Some(hold.clone()), ..LocalPeer::new(b.node.clone()) });
    let arrived = peer.complete_arrived.clone();
    let connector: Connector = Arc::new(move |_: &str| -> Result<Arc<dyn PeerApi>, PeerError> { Ok(peer.clone()) });
    let a = node_with(A, connector, |_| {}, true).await;
    region(&a.node, "src", 64 << 10, 7);
    region(&b.node, "dst", 64 << 10, 0);
    let alice =
        xfer_agent::tenants::Tenant::of(&xfer_fabric::identity::Caller { role: xfer_fabric::identity::Role::Client, name: "alice".into() });

    let mut first = write("src", "dst", 64 << 10, false);
    first.options.qps = Some(2);
    let t1 = a.node.submit_as(first, &alice).await.unwrap();
    arrived.notified().await; // its lease is held until its Complete is let through
    let entry = a.node.peers().into_iter().next().unwrap();
    assert_eq!(entry.tenant_held(&alice), (1, 4), "2 QPs asked, 4 held and charged");
    assert_eq!(entry.held(), (1, 4), "the entry counts the same QPs");

    let mut second = write("src", "dst", 64 << 10, false);
    second.options.qps = Some(1);
    let e = a.node.submit_as(second, &alice).await.unwrap_err().to_string();
    assert!(e.contains("holds 1 connections (4 streams)") && e.contains("its share is") && e.contains("4 streams"), "{e}");
    assert_eq!(entry.tenant_held(&alice), (1, 4), "a refused lease charges nothing");

    hold.notify_one();
    let r1 = finished(&a.node, &t1.id).await;
    assert_eq!(r1.state, TransferState::Succeeded, "{r1:?}");
}
