//! Fabric conformance suite: the behaviour every fabric must show, run against two in-process
//! agent cores (`Node`s) connected over one fabric.
//!
//! Every case runs twice: `tcp::<case>` on the TCP fabric on 127.0.0.1 (part of `make test`),
//! and `verbs::<case>` on the verbs fabric on the devices named by `XFER_RXE_A_DEV`/
//! `XFER_RXE_B_DEV` with addresses `XFER_RXE_A`/`XFER_RXE_B` (set by `scripts/rxe-vm` inside the
//! Soft-RoCE VM). The verbs cases are `#[ignore = "needs Soft-RoCE"]`: on the host `cargo test`
//! reports them as ignored, never as passed; `scripts/rxe-guest-test` runs this binary with
//! `--include-ignored` and fails unless every case of both fabrics ran and passed. `rails::<case>`
//! runs the verbs cases on a fabric over two devices per side (`XFER_RXE_A_DEV` and
//! `XFER_RXE_A2_DEV` <-> `XFER_RXE_B_DEV` and `XFER_RXE_B2_DEV`, two links on two subnets), so
//! every connection has two paths and every grant one key per QP.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use std::sync::Arc;
use std::time::Duration;
use xfer_engine::ids::ConnectionId;

use tokio::sync::mpsc;
use xfer_agent::config::{Config, FabricChoice};
use xfer_agent::error::NodeError;
use xfer_agent::grants::{Grant, GrantTable};
use xfer_agent::node::{GrantParams, InboundEnd, Node, NotifyAsk};
use xfer_agent::regions::{Region, RegionSpec};
use xfer_fabric::tcp::TcpFabric;
use xfer_fabric::{Access, Completion, Connection, Fabric, RemoteOp, WcStatus, WorkRequest, WrOp};

struct Side {
    node: Arc<Node>,
    /// The node's fabric and grant table, as the test made them (the node keeps its own private).
    fabric: Arc<dyn Fabric>,
    grants: Arc<GrantTable>,
    _dir: tempfile::TempDir,
}

/// The fabric a test case runs on.
#[derive(Clone, Copy)]
enum Kind {
    Tcp,
    #[cfg(feature = "verbs")]
    Verbs,
    /// verbs over two devices per side
    #[cfg(feature = "verbs")]
    Rails,
    /// verbs on the second device only (`XFER_RXE_A2_DEV`, `XFER_RXE_B2_DEV`)
    #[cfg(feature = "verbs")]
    Second,
    /// `Rails` in grant mode `mw` (a window per QP, bound on each device's part)
    #[cfg(feature = "verbs")]
    RailsMw,
}

async fn side(name: &str, which: char, kind: Kind) -> Side {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config { node_name: name.to_string(), state_dir: dir.path().to_path_buf(), ..Config::default() };
    let grants = Arc::new(GrantTable::new(1024));
    let fabric: Arc<dyn Fabric> = match kind {
        Kind::Tcp => Arc::new(TcpFabric::bind("127.0.0.1:0".parse().unwrap(), grants.clone(), None).await.unwrap()),
        #[cfg(feature = "verbs")]
        Kind::Verbs => {
            let var = |k: &str| std::env::var(format!("XFER_RXE_{which}{k}")).unwrap_or_else(|_| panic!("XFER_RXE_{which}{k} not set"));
            cfg.fabric = FabricChoice::Verbs;
            cfg.verbs.device = var("_DEV");
            cfg.listen = format!("{}:7470", var("")).parse().unwrap();
            cfg.data_listen = Some(format!("{}:7471", var("")).parse().unwrap());
            xfer_fabric::verbs::open_fabric(cfg.verbs_options(), grants.clone()).unwrap()
        }
        #[cfg(feature = "verbs")]
        Kind::Second => {
            let var = |k: &str| std::env::var(format!("XFER_RXE_{which}2{k}")).unwrap_or_else(|_| panic!("XFER_RXE_{which}2{k} not set"));
            cfg.fabric = FabricChoice::Verbs;
            cfg.verbs.device = var("_DEV");
            cfg.listen = format!("{}:7470", var("")).parse().unwrap();
            cfg.data_listen = Some(format!("{}:7471", var("")).parse().unwrap());
            xfer_fabric::verbs::open_fabric(cfg.verbs_options(), grants.clone()).unwrap()
        }
        #[cfg(feature = "verbs")]
        Kind::Rails | Kind::RailsMw => {
            let var = |k: &str| std::env::var(format!("XFER_RXE_{which}{k}")).unwrap_or_else(|_| panic!("XFER_RXE_{which}{k} not set"));
            cfg.fabric = FabricChoice::Verbs;
            if matches!(kind, Kind::RailsMw) {
                cfg.verbs.grant_mode = xfer_fabric::verbs::GrantMode::Mw;
            }
            cfg.verbs.devices = vec![var("_DEV"), var("2_DEV")];
            cfg.listen = format!("{}:7470", var("")).parse().unwrap();
            cfg.data_listen = Some(format!("{}:7471", var("")).parse().unwrap());
            let f = xfer_fabric::verbs::open_fabric(cfg.verbs_options(), grants.clone()).unwrap();
            assert_eq!(f.info().devices.len(), 2, "a fabric over both devices");
            f
        }
    };
    Side {
        node: Node::new(cfg, fabric.clone(), "test".into(), grants.clone(), xfer_agent::service::client::connector(None)),
        fabric,
        grants,
        _dir: dir,
    }
}

fn cid(s: &str) -> ConnectionId {
    ConnectionId::parse(s).unwrap()
}

/// A connects to B with `qps` QPs, as connection `conn-1` of peer "a" (which replaces an earlier
/// `conn-1`: connection ids are never reused while one is open).
async fn connect(a: &Side, b: &Side, qps: usize, depth: usize) -> (Arc<dyn Connection>, mpsc::UnboundedReceiver<Completion>) {
    b.node.disconnect(&cid("conn-1"), "a");
    let (tx, rx) = mpsc::unbounded_channel();
    let pending = a.fabric.prepare("b", &cid("conn-1"), qps, depth, tx).await.unwrap();
    let eps = b.node.accept_connection("a", &cid("conn-1"), a.fabric.kind(), &pending.local_endpoints()).await.unwrap();
    (pending.complete(&eps).await.unwrap(), rx)
}

fn region(s: &Side, name: &str, len: u64, access: Access) -> Arc<Region> {
    s.node.create_region(RegionSpec::anonymous(name, len, access)).unwrap()
}

async fn grant(s: &Side, region: &str, offset: u64, len: u64, op: RemoteOp, ttl: Option<Duration>) -> Arc<Grant> {
    s.node
        .grant(&GrantParams {
            notify: None,
            region: region.into(),
            offset,
            length: len,
            op,
            ttl,
            peer: "a".into(),
            connection_id: Some(cid("conn-1")),
        })
        .await
        .unwrap()
}

fn fill(r: &Region, seed: u8) -> Vec<u8> {
    let data: Vec<u8> = (0..r.length).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    r.memory.write_at(0, &data).unwrap();
    data
}

fn bytes(r: &Region) -> Vec<u8> {
    let mut v = vec![0u8; r.length as usize];
    r.memory.read_at(0, &mut v).unwrap();
    v
}

#[allow(clippy::too_many_arguments)]
fn wr(id: u64, op: WrOp, local: &Region, local_off: u64, len: u32, g: &Grant, remote_off: u64, signaled: bool) -> WorkRequest {
    WorkRequest {
        wr_id: id,
        op,
        local: local.registration.clone(),
        local_offset: local_off,
        len,
        remote_addr: g.exposure.addr + remote_off,
        remote_key: g.exposure.key.clone(),
        signaled,
    }
}

async fn next(rx: &mut mpsc::UnboundedReceiver<Completion>) -> Completion {
    tokio::time::timeout(Duration::from_secs(20), rx.recv()).await.expect("completion within 20 s").expect("sink open")
}

async fn write_then_read_roundtrip_with_selective_signalling(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", 1 << 20, Access::ReadWrite);
    let back = region(&a, "back", 1 << 20, Access::ReadWrite);
    let dst = region(&b, "dst", 1 << 20, Access::ReadWrite);
    let data = fill(&src, 7);
    let (conn, mut rx) = connect(&a, &b, 2, 16).await;
    let gw = grant(&b, "dst", 0, 1 << 20, RemoteOp::Write, None).await;
    // 16 chunks of 64 KiB striped over 2 QPs; only the last on each QP is signaled.
    for i in 0..16u64 {
        let qp = (i % 2) as usize;
        conn.post(qp, wr(i, WrOp::Write, &src, i << 16, 1 << 16, &gw, i << 16, i >= 14)).unwrap();
    }
    let mut got = [next(&mut rx).await, next(&mut rx).await];
    got.sort_by_key(|c| c.wr_id);
    assert_eq!(got.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(), vec![(14, WcStatus::Success), (15, WcStatus::Success)]);
    assert!(bytes(&dst) == data, "WRITE must land every byte");

    let gr = grant(&b, "dst", 0, 1 << 20, RemoteOp::Read, None).await;
    conn.post(0, wr(100, WrOp::Read, &back, 0, 1 << 20, &gr, 0, true)).unwrap();
    let c = next(&mut rx).await;
    assert_eq!((c.wr_id, c.status), (100, WcStatus::Success));
    assert!(bytes(&back) == data, "READ must bring every byte back");
    assert!(!conn.is_broken());
}

async fn write_past_the_grant_is_refused_and_bytes_past_it_are_unchanged(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", 64 << 10, Access::ReadWrite);
    let dst = region(&b, "dst", 64 << 10, Access::ReadWrite);
    fill(&src, 1);
    let before = fill(&dst, 99);
    let (conn, mut rx) = connect(&a, &b, 1, 8).await;
    // Grant 4 KiB at offset 8 KiB; write 4 KiB + 1 byte.
    let g = grant(&b, "dst", 8192, 4096, RemoteOp::Write, None).await;
    conn.post(0, wr(1, WrOp::Write, &src, 0, 4097, &g, 0, true)).unwrap();
    let c = next(&mut rx).await;
    assert_eq!((c.wr_id, c.status), (1, WcStatus::RemAccessErr));
    let after = bytes(&dst);
    assert!(after[..8192] == before[..8192] && after[12288..] == before[12288..], "bytes outside the grant changed");
    assert!(conn.is_broken(), "a QP that hit an error is broken");
}

async fn grant_for_read_does_not_allow_write_and_vice_versa(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", 8192, Access::ReadWrite);
    let dst = region(&b, "dst", 8192, Access::ReadWrite);
    fill(&src, 1);
    let before = fill(&dst, 2);
    let (conn, mut rx) = connect(&a, &b, 1, 8).await;
    let g = grant(&b, "dst", 0, 8192, RemoteOp::Read, None).await;
    conn.post(0, wr(1, WrOp::Write, &src, 0, 4096, &g, 0, true)).unwrap();
    assert_eq!(next(&mut rx).await.status, WcStatus::RemAccessErr);
    assert!(bytes(&dst) == before);

    let (conn, mut rx) = connect(&a, &b, 1, 8).await;
    let g = grant(&b, "dst", 0, 8192, RemoteOp::Write, None).await;
    conn.post(0, wr(2, WrOp::Read, &src, 0, 4096, &g, 0, true)).unwrap();
    assert_eq!(next(&mut rx).await.status, WcStatus::RemAccessErr);
}

async fn region_access_ceiling_is_enforced_at_grant_time(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let _conn = connect(&a, &b, 1, 8).await;
    region(&b, "ro", 4096, Access::Read);
    region(&b, "wo", 4096, Access::Write);
    let p = |r: &str, op| GrantParams {
        notify: None,
        region: r.into(),
        offset: 0,
        length: 4096,
        op,
        ttl: None,
        peer: "a".into(),
        connection_id: Some(cid("conn-1")),
    };
    assert!(b.node.grant(&p("ro", RemoteOp::Write)).await.is_err(), "read-only region must not be granted for WRITE");
    assert!(b.node.grant(&p("wo", RemoteOp::Read)).await.is_err(), "write-only region must not be granted for READ");
    assert!(b.node.grant(&p("ro", RemoteOp::Read)).await.is_ok());
}

async fn revoked_grant_key_is_dead(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", 8192, Access::ReadWrite);
    let dst = region(&b, "dst", 8192, Access::ReadWrite);
    fill(&src, 5);
    let before = fill(&dst, 6);
    let (conn, mut rx) = connect(&a, &b, 1, 8).await;
    let g = grant(&b, "dst", 0, 8192, RemoteOp::Write, None).await;
    let (addr, key) = (g.exposure.addr, g.exposure.key.clone());
    b.grants.revoke(&g.id);
    drop(g);
    let w = WorkRequest {
        wr_id: 9,
        op: WrOp::Write,
        local: src.registration.clone(),
        local_offset: 0,
        len: 4096,
        remote_addr: addr,
        remote_key: key,
        signaled: true,
    };
    conn.post(0, w).unwrap();
    assert_eq!(next(&mut rx).await.status, WcStatus::RemAccessErr);
    assert!(bytes(&dst) == before);
}

async fn expired_grant_is_refused(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", 8192, Access::ReadWrite);
    let dst = region(&b, "dst", 8192, Access::ReadWrite);
    let before = fill(&dst, 6);
    fill(&src, 1);
    let (conn, mut rx) = connect(&a, &b, 1, 8).await;
    let g = grant(&b, "dst", 0, 8192, RemoteOp::Write, Some(Duration::from_secs(60))).await;
    let w = wr(1, WrOp::Write, &src, 0, 4096, &g, 0, true);
    // Only the grant table holds the grant now: expiry must kill its key (verbs: deregister the MR).
    drop(g);
    // The reaper as it runs once the TTL has passed (reap takes the time: no waiting).
    let now = std::time::SystemTime::now();
    assert_eq!(b.grants.reap(now), 0, "not expired before its TTL");
    assert_eq!(b.grants.reap(now + Duration::from_secs(61)), 1);
    conn.post(0, w).unwrap();
    assert_eq!(next(&mut rx).await.status, WcStatus::RemAccessErr);
    assert!(bytes(&dst) == before);
}

async fn after_an_error_later_work_requests_are_flushed_not_failed(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", 1 << 16, Access::ReadWrite);
    region(&b, "dst", 1 << 16, Access::ReadWrite);
    fill(&src, 3);
    let (conn, mut rx) = connect(&a, &b, 1, 16).await;
    let g = grant(&b, "dst", 0, 4096, RemoteOp::Write, None).await;
    conn.post(0, wr(1, WrOp::Write, &src, 0, 4096, &g, 0, true)).unwrap();
    conn.post(0, wr(2, WrOp::Write, &src, 0, 8192, &g, 0, true)).unwrap(); // past the grant
    let mut posted = 2;
    for id in 3..6 {
        if conn.post(0, wr(id, WrOp::Write, &src, 0, 1024, &g, 0, true)).is_ok() {
            posted += 1;
        }
    }
    let first = next(&mut rx).await;
    assert_eq!((first.wr_id, first.status), (1, WcStatus::Success));
    let second = next(&mut rx).await;
    assert_eq!((second.wr_id, second.status), (2, WcStatus::RemAccessErr));
    for _ in 2..posted {
        let c = next(&mut rx).await;
        assert_eq!(c.status, WcStatus::WrFlushErr, "WRs after the first error are flushed: {c:?}");
    }
    assert!(conn.post(0, wr(9, WrOp::Write, &src, 0, 16, &g, 0, true)).is_err() || next(&mut rx).await.status == WcStatus::WrFlushErr);
}

async fn local_range_is_checked_at_post(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", 4096, Access::ReadWrite);
    region(&b, "dst", 8192, Access::ReadWrite);
    let (conn, _rx) = connect(&a, &b, 1, 8).await;
    let g = grant(&b, "dst", 0, 8192, RemoteOp::Write, None).await;
    assert!(conn.post(0, wr(1, WrOp::Write, &src, 1, 4096, &g, 0, true)).is_err());
    assert!(conn.post(5, wr(1, WrOp::Write, &src, 0, 16, &g, 0, true)).is_err(), "no such QP");
}

async fn a_grant_may_name_only_the_callers_own_connection(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    region(&b, "dst", 8192, Access::ReadWrite);
    let (_conn, _rx) = connect(&a, &b, 1, 8).await;
    let mut p = GrantParams {
        notify: None,
        region: "dst".into(),
        offset: 0,
        length: 4096,
        op: RemoteOp::Write,
        ttl: None,
        peer: "z".into(),
        connection_id: Some(cid("conn-1")),
    };
    let e = b.node.grant(&p).await.unwrap_err();
    assert!(matches!(e, NodeError::PermissionDenied(_)), "another peer's connection: {e:?}");
    p.peer = "a".into();
    assert!(b.node.grant(&p).await.is_ok());
}

async fn disconnect_revokes_the_grants_of_that_connection(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", 8192, Access::ReadWrite);
    let dst = region(&b, "dst", 8192, Access::ReadWrite);
    fill(&src, 4);
    let before = fill(&dst, 8);
    let (conn, mut rx) = connect(&a, &b, 1, 8).await;
    let g = b
        .node
        .grant(&GrantParams {
            notify: None,
            region: "dst".into(),
            offset: 0,
            length: 8192,
            op: RemoteOp::Write,
            ttl: None,
            peer: "a".into(),
            connection_id: Some(cid("conn-1")),
        })
        .await
        .unwrap();
    let w = wr(1, WrOp::Write, &src, 0, 4096, &g, 0, true);
    drop(g);
    assert_eq!(b.grants.len(), 1);
    b.node.disconnect(&cid("conn-1"), "a");
    assert_eq!(b.grants.len(), 0, "the connection's grants are revoked with it");
    // Whatever the fabric does with the old key now (tcp: refused; verbs: the QPs are gone),
    // it must not succeed, and the bytes must not change.
    let _ = conn.post(0, w);
    if let Ok(Some(c)) = tokio::time::timeout(Duration::from_secs(20), rx.recv()).await {
        assert_ne!(c.status, WcStatus::Success, "{c:?}");
    }
    assert!(bytes(&dst) == before);
}

/// A WRITE grant on `region` asked on connection `conn` with a notification (`tag`, one marker
/// per QP of `markers`).
async fn grant_notify(s: &Side, region: &str, len: u64, conn: &str, tag: &[u8], markers: u32) -> Arc<Grant> {
    let p = GrantParams {
        notify: Some(NotifyAsk::Once { tag: tag.to_vec(), markers }),
        region: region.into(),
        offset: 0,
        length: len,
        op: RemoteOp::Write,
        ttl: None,
        peer: "a".into(),
        connection_id: Some(cid(conn)),
    };
    s.node.grant(&p).await.unwrap()
}

fn marker(id: u64, local: &Region, g: &Grant) -> WorkRequest {
    let slot = g.notify.as_ref().map(|n| n.slot).unwrap();
    WorkRequest { len: 0, op: WrOp::Notify { slot }, ..wr(id, WrOp::Write, local, 0, 0, g, 0, true) }
}

/// Reads a round's completions until its `n` markers' (wr_id 1000 and up, signaled) came, every
/// one a success.
async fn markers_completed(rx: &mut mpsc::UnboundedReceiver<Completion>, n: usize) {
    let mut done = 0;
    while done < n {
        let c = next(rx).await;
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
        if c.wr_id >= 1000 {
            done += 1;
        }
    }
}

/// The notification guarantee: a subscriber that reads the region the moment its notification
/// arrives sees every byte of the batch. Eight rounds, each writing new bytes over 4 QPs with
/// the marker right behind the last data WR of every QP (no waiting for completions, as the
/// engine posts them), the subscriber comparing all 4 MiB as soon as it is told.
async fn a_notification_comes_only_after_every_byte_is_visible(k: Kind) {
    const LEN: u64 = 4 << 20;
    const CHUNK: u64 = 64 << 10;
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", LEN, Access::ReadWrite);
    let dst = region(&b, "dst", LEN, Access::ReadWrite);
    let (conn, mut rx) = connect(&a, &b, 4, 32).await;
    for round in 0..8u8 {
        let data = fill(&src, round.wrapping_mul(37).wrapping_add(1));
        let mut notes = b.grants.hub().subscribe();
        let tag = format!("batch-{round}");
        let g = grant_notify(&b, "dst", LEN, "conn-1", tag.as_bytes(), 4).await;
        // The reader: wakes on the notification and compares at once.
        let (dst2, want, tag2) = (dst.clone(), data.clone(), tag.clone());
        let reader = tokio::spawn(async move {
            let n = tokio::time::timeout(Duration::from_secs(20), notes.recv()).await.expect("notification within 20 s").unwrap();
            let seen = bytes(&dst2);
            assert_eq!(n.tag, tag2.as_bytes(), "the notification carries its tag");
            (seen == want, n.via, n.region.clone())
        });
        // 64 chunks, 16 per QP (within the depth of 32 with the marker); only markers signaled.
        let chunks = LEN / CHUNK;
        for i in 0..chunks {
            conn.post((i % 4) as usize, wr(i, WrOp::Write, &src, i * CHUNK, CHUNK as u32, &g, i * CHUNK, false)).unwrap();
        }
        for qp in 0..4 {
            conn.post(qp, marker(1000 + qp as u64, &src, &g)).unwrap();
        }
        let (complete, via, region) = reader.await.unwrap();
        assert!(complete, "round {round}: the subscriber saw stale bytes when it was notified");
        assert_eq!((via, region.as_str()), (xfer_agent::notify::Via::Fabric, "dst"));
        markers_completed(&mut rx, 4).await;
        b.grants.revoke(&g.id);
    }
}

/// The same guarantee through a notification ring (`WatchInboundRing`), read the way an
/// application polls one: a thread spinning on the mapped ring compares the region the moment a
/// notification comes out of it. On verbs every grant also hands the connection to the marker
/// poller (`verbs.marker_spin`), so this is the poller's path as well as the receive task's.
/// Closing the subscription closes the ring (a reader is told) and removes its object.
async fn a_ring_notification_comes_only_after_every_byte_is_visible(k: Kind) {
    use xfer_rdma::ring::{RingError, RingReader, RingVia};
    const LEN: u64 = 2 << 20;
    const CHUNK: u64 = 64 << 10;
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", LEN, Access::ReadWrite);
    let dst = region(&b, "dst", LEN, Access::ReadWrite);
    let (conn, mut rx) = connect(&a, &b, 4, 32).await;
    let ring = b.node.watch_inbound_ring("dst", None, 16).unwrap();
    let path = std::path::Path::new("/dev/shm").join(&ring.object);
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let mem = xfer_rdma::memory::RegionMemory::map_file(&file, ring.length as usize, true).unwrap();
    let mut reader = Some(RingReader::open(mem).unwrap());
    for round in 0..8u8 {
        let data = fill(&src, round.wrapping_mul(53).wrapping_add(3));
        let tag = format!("ring-{round}");
        let g = grant_notify(&b, "dst", LEN, "conn-1", tag.as_bytes(), 4).await;
        let (dst2, want, mut r) = (dst.clone(), data.clone(), reader.take().unwrap());
        // Spins for the whole wait (as a polling application does), compares at once.
        let app = std::thread::spawn(move || {
            let n = r.next_timeout(Duration::from_secs(20), Duration::from_secs(20)).unwrap().expect("a notification within 20 s");
            let fresh = bytes(&dst2) == want;
            (r, n, fresh)
        });
        let chunks = LEN / CHUNK;
        for i in 0..chunks {
            conn.post((i % 4) as usize, wr(i, WrOp::Write, &src, i * CHUNK, CHUNK as u32, &g, i * CHUNK, false)).unwrap();
        }
        for qp in 0..4 {
            conn.post(qp, marker(1000 + qp as u64, &src, &g)).unwrap();
        }
        let (r, n, fresh) = tokio::task::spawn_blocking(move || app.join().unwrap()).await.unwrap();
        assert!(fresh, "round {round}: the ring's reader saw stale bytes when it was notified");
        assert_eq!((n.seq, n.tag.as_slice(), n.region.as_str(), n.via), (round as u64, tag.as_bytes(), "dst", RingVia::Fabric));
        assert_eq!((n.offset, n.length, n.peer.as_str()), (0, LEN, "a"));
        reader = Some(r);
        markers_completed(&mut rx, 4).await;
        b.grants.revoke(&g.id);
    }
    let mut reader = reader.unwrap();
    drop(ring);
    assert_eq!(reader.try_next(), Err(RingError::Closed), "the reader is told the subscription ended");
    assert!(!path.exists(), "the ring's object is removed with its subscription");
}

/// A marker counts only on the connection its grant was asked on, and only while the grant is
/// live: a marker from another connection of the same peer, or for a revoked grant, publishes
/// nothing. (Ordering on one connection is what proves the refused marker was processed: the
/// valid notification sent after it on the same QP arrives, and nothing else does.)
async fn markers_count_only_on_their_connection_and_while_the_grant_lives(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", 1 << 20, Access::ReadWrite);
    region(&b, "dst", 1 << 20, Access::ReadWrite);
    let (conn1, _rx1) = connect(&a, &b, 1, 16).await;
    // A second connection of the same peer.
    let (tx2, mut rx2) = mpsc::unbounded_channel();
    let pending = a.fabric.prepare("b", &cid("conn-2"), 1, 16, tx2).await.unwrap();
    let eps = b.node.accept_connection("a", &cid("conn-2"), a.fabric.kind(), &pending.local_endpoints()).await.unwrap();
    let conn2 = pending.complete(&eps).await.unwrap();
    let mut notes = b.grants.hub().subscribe();
    let on1 = grant_notify(&b, "dst", 1 << 20, "conn-1", b"on-conn-1", 1).await;
    let revoked = grant_notify(&b, "dst", 1 << 20, "conn-2", b"revoked", 1).await;
    let good = grant_notify(&b, "dst", 1 << 20, "conn-2", b"good", 1).await;
    let revoked_marker = marker(2, &src, &revoked);
    b.grants.revoke(&revoked.id);
    // conn-1's grant named on conn-2 (tcp: its token; verbs: its slot under conn-1's grant key).
    conn2.post(0, marker(1, &src, &on1)).unwrap();
    let c = next(&mut rx2).await;
    if matches!(k, Kind::Tcp) {
        assert_eq!(c.status, WcStatus::RemAccessErr, "tcp NAKs a marker under another connection's token");
        // The stream is broken now; the rest goes over a fresh conn-2.
        b.node.disconnect(&cid("conn-2"), "a");
        return tcp_rest(&a, &b, &src, notes).await;
    }
    // verbs: the WRITE WITH IMMEDIATE itself is fine (the key is valid); the target ignores it.
    assert_eq!(c.status, WcStatus::Success, "{c:?}");
    conn2.post(0, revoked_marker).ok();
    let c = next(&mut rx2).await;
    // A revoked grant's key is dead (REM_ACCESS_ERR), or, where the device does not check a
    // zero-length WRITE's key, the marker arrives and is refused by the target.
    if c.status == WcStatus::Success {
        conn2.post(0, marker(3, &src, &good)).unwrap();
        assert_eq!(next(&mut rx2).await.status, WcStatus::Success);
        let n = tokio::time::timeout(Duration::from_secs(20), notes.recv()).await.expect("notification").unwrap();
        assert_eq!(n.tag, b"good", "only the valid marker published");
    }
    assert!(notes.try_recv().is_err(), "nothing else was published");
    assert!(!on1.notify.as_ref().unwrap().is_published());
    drop(conn1);
}

async fn tcp_rest(a: &Side, b: &Side, src: &Region, mut notes: tokio::sync::broadcast::Receiver<Arc<xfer_agent::notify::Notification>>) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let pending = a.fabric.prepare("b", &cid("conn-3"), 1, 16, tx).await.unwrap();
    let eps = b.node.accept_connection("a", &cid("conn-3"), a.fabric.kind(), &pending.local_endpoints()).await.unwrap();
    let conn = pending.complete(&eps).await.unwrap();
    let revoked = grant_notify(b, "dst", 1 << 20, "conn-3", b"revoked", 1).await;
    let m = marker(1, src, &revoked);
    b.grants.revoke(&revoked.id);
    conn.post(0, m).unwrap();
    assert_eq!(next(&mut rx).await.status, WcStatus::RemAccessErr, "a revoked grant's marker is NAKed");
    assert!(notes.try_recv().is_err(), "nothing was published");
}

/// `post_batch` (one doorbell on verbs) posts a run of WRs in order: 16 unsignaled WRITEs and a
/// signaled marker on one QP complete with the marker's one completion, every byte landed, and
/// the notification came. A run that does not fit the QP's depth is refused whole.
async fn a_batch_of_work_requests_posts_in_order(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", 1 << 20, Access::ReadWrite);
    let dst = region(&b, "dst", 1 << 20, Access::ReadWrite);
    let data = fill(&src, 77);
    let (conn, mut rx) = connect(&a, &b, 1, 32).await;
    let mut notes = b.grants.hub().subscribe();
    let g = grant_notify(&b, "dst", 1 << 20, "conn-1", b"run", 1).await;
    let mut run: Vec<WorkRequest> = (0..16u64).map(|i| wr(i, WrOp::Write, &src, i << 16, 1 << 16, &g, i << 16, false)).collect();
    run.push(marker(16, &src, &g));
    conn.post_batch(0, run).unwrap();
    let c = next(&mut rx).await;
    assert_eq!((c.wr_id, c.status), (16, WcStatus::Success), "one completion, the marker's");
    let n = tokio::time::timeout(Duration::from_secs(20), notes.recv()).await.expect("notification").unwrap();
    assert_eq!(n.tag, b"run");
    assert!(bytes(&dst) == data, "every byte of the run landed");
    if matches!(k, Kind::Tcp) {
        return; // tcp queues without a send-queue bound; the depth check is the verbs QP's
    }
    // 40 WRs do not fit a QP of depth 32: refused before any is posted, and the QP is fine.
    let too_many: Vec<WorkRequest> = (100..140u64).map(|i| wr(i, WrOp::Write, &src, 0, 4096, &g, 0, i == 139)).collect();
    let (id, e) = conn.post_batch(0, too_many).unwrap_err();
    assert_eq!(id, 100, "{e}");
    assert!(!conn.is_broken());
    conn.post(0, wr(200, WrOp::Write, &src, 0, 4096, &g, 0, true)).unwrap();
    assert_eq!(next(&mut rx).await.wr_id, 200);
}

/// A transfer may poll its leased connection itself (`progress`): completions it reads reach the
/// sink once, in order, interleaved with what the fabric's own task delivers.
async fn polling_a_connection_delivers_each_completion_once(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", 1 << 20, Access::ReadWrite);
    region(&b, "dst", 1 << 20, Access::ReadWrite);
    let (conn, mut rx) = connect(&a, &b, 1, 16).await;
    let g = grant(&b, "dst", 0, 1 << 20, RemoteOp::Write, None).await;
    for round in 0..50u64 {
        conn.post(0, wr(round, WrOp::Write, &src, 0, 4096, &g, 0, true)).unwrap();
        let c = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                conn.progress();
                if let Ok(c) = rx.try_recv() {
                    return c;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("completion within 20 s");
        assert_eq!((c.wr_id, c.status), (round, WcStatus::Success), "each completion once, in order");
    }
    assert!(rx.try_recv().is_err(), "no completion delivered twice");
}

/// A notification is counted on the grantee's connection, so asking one needs a connection the
/// caller made: an id nobody holds (yet), or another peer's, is refused on every fabric.
async fn a_notification_needs_the_callers_own_connection(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    region(&b, "dst", 1 << 20, Access::ReadWrite);
    let (_conn, _rx) = connect(&a, &b, 1, 16).await;
    let ask = |conn: &str, peer: &str| GrantParams {
        notify: Some(NotifyAsk::Once { tag: b"t".to_vec(), markers: 1 }),
        region: "dst".into(),
        offset: 0,
        length: 4096,
        op: RemoteOp::Write,
        ttl: None,
        peer: peer.into(),
        connection_id: Some(cid(conn)),
    };
    assert!(b.node.grant(&ask("conn-9", "a")).await.is_err(), "an id nobody holds");
    assert!(b.node.grant(&ask("conn-1", "mallory")).await.is_err(), "another peer's connection");
    assert_eq!(b.grants.len(), 0);
    assert!(b.node.grant(&ask("conn-1", "a")).await.is_ok(), "the caller's own connection");
}

/// `Peer.Complete` comes only after the initiator saw every marker acknowledged; by then the
/// markers have arrived at the target (rxe, like hardware, writes the receive completion before
/// it acknowledges), so the notification is theirs (`via fabric`), never the Complete's that
/// merely beat the target's receive task. Sixteen rounds, each calling Complete the moment the
/// marker's completion is seen.
async fn markers_acknowledged_before_complete_publish_the_notification(k: Kind) {
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", 1 << 20, Access::ReadWrite);
    let dst = region(&b, "dst", 1 << 20, Access::ReadWrite);
    let (conn, mut rx) = connect(&a, &b, 2, 16).await;
    let mut notes = b.grants.hub().subscribe();
    for round in 0..16u64 {
        let data = fill(&src, round as u8 ^ 0x5a);
        let tag = format!("round-{round}");
        let g = grant_notify(&b, "dst", 1 << 20, "conn-1", tag.as_bytes(), 2).await;
        for qp in 0..2u64 {
            conn.post(qp as usize, wr(qp, WrOp::Write, &src, qp << 19, 1 << 19, &g, qp << 19, false)).unwrap();
            conn.post(qp as usize, marker(100 + qp, &src, &g)).unwrap();
        }
        for _ in 0..2 {
            assert_eq!(next(&mut rx).await.status, WcStatus::Success);
        }
        let tid = xfer_engine::ids::TransferId::random();
        b.node.complete_inbound(&tid, &g.id, "a", InboundEnd { bytes: 1 << 20, op_write: true, checksum: None, spans: &[] }).await.unwrap();
        let n = notes.try_recv().expect("published by the time Complete returns");
        assert_eq!((n.tag.as_slice(), n.via), (tag.as_bytes(), xfer_agent::notify::Via::Fabric), "round {round}");
        assert!(notes.try_recv().is_err(), "published once");
        assert!(bytes(&dst) == data, "round {round}: every byte landed");
    }
}

/// A channel grant's markers name their batch in the immediate (verbs: the 32 bits of the WRITE
/// WITH IMMEDIATE; tcp: the NOTIFY frame's), and each batch is published once its tag was
/// announced and all its markers arrived, in either order, with every byte of the batch in
/// place. Four batches on one grant, over 2 QPs: the tag announced before the data for even
/// batches, after the markers completed for odd ones.
async fn a_channel_grant_notifies_each_batch_after_its_bytes(k: Kind) {
    const LEN: u64 = 1 << 20;
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", LEN, Access::ReadWrite);
    let dst = region(&b, "dst", LEN, Access::ReadWrite);
    let (conn, mut rx) = connect(&a, &b, 2, 16).await;
    let p = GrantParams {
        notify: Some(NotifyAsk::Channel { markers: 2 }),
        region: "dst".into(),
        offset: 0,
        length: LEN,
        op: RemoteOp::Write,
        ttl: None,
        peer: "a".into(),
        connection_id: Some(cid("conn-1")),
    };
    let g = b.node.grant(&p).await.unwrap();
    let base = g.channel.as_ref().unwrap().base_imm;
    assert_ne!(base & xfer_engine::notes::CHANNEL_BIT, 0);
    let mut notes = b.grants.hub().subscribe();
    for seq in 0..4u64 {
        let data = fill(&src, seq as u8 + 40);
        let tag = format!("batch-{seq}");
        if seq % 2 == 0 {
            b.node.announce(&g.id, "a", seq, tag.clone().into_bytes()).unwrap();
        }
        let reader = {
            let (dst, want) = (dst.clone(), data.clone());
            let mut notes = b.grants.hub().subscribe();
            tokio::spawn(async move {
                let n = tokio::time::timeout(Duration::from_secs(20), notes.recv()).await.expect("notification").unwrap();
                (bytes(&dst) == want, n)
            })
        };
        for qp in 0..2u64 {
            conn.post(qp as usize, wr(qp, WrOp::Write, &src, qp * LEN / 2, (LEN / 2) as u32, &g, qp * LEN / 2, false)).unwrap();
            let imm = xfer_engine::notes::channel_imm(base, seq);
            conn.post(
                qp as usize,
                WorkRequest { len: 0, op: WrOp::Notify { slot: imm }, ..wr(100 + qp, WrOp::Write, &src, 0, 0, &g, 0, true) },
            )
            .unwrap();
        }
        for _ in 0..2 {
            assert_eq!(next(&mut rx).await.status, WcStatus::Success);
        }
        if seq % 2 == 1 {
            b.node.announce(&g.id, "a", seq, tag.clone().into_bytes()).unwrap();
        }
        let (complete, n) = reader.await.unwrap();
        assert!(complete, "batch {seq}: the subscriber saw stale bytes");
        assert_eq!((n.tag.as_slice(), n.via), (tag.as_bytes(), xfer_agent::notify::Via::Fabric), "batch {seq}");
        assert_eq!(notes.recv().await.unwrap().tag, tag.as_bytes(), "published once, in order");
    }
    assert!(notes.try_recv().is_err());
    // A batch announced twice, or one already published, is refused; nothing is published.
    assert!(b.node.announce(&g.id, "a", 2, b"again".to_vec()).is_err());
    assert!(b.node.announce(&g.id, "mallory", 4, b"x".to_vec()).is_err(), "another peer's grant");
    assert!(notes.try_recv().is_err());
}

/// What the data-path worker needs of a lease: the connection and its completions.
struct Held {
    conn: Arc<dyn Connection>,
    rx: mpsc::UnboundedReceiver<Completion>,
}

impl xfer_agent::transfer::job::Leased for Held {
    fn conn(&self) -> &Arc<dyn Connection> {
        &self.conn
    }
    fn completions(&mut self) -> &mut mpsc::UnboundedReceiver<Completion> {
        &mut self.rx
    }
}

/// A connection handed to the device's data-path worker thread (`transfer::worker`) is driven
/// by it alone: the worker posts, polls, and parks until the connection's completion event
/// unparks it (spin 0: it parks after every empty poll, so every completion needs a wake-up).
/// 1,024 4 KiB WRITEs over 2 QPs land every byte, a READ of it all comes back intact, and once
/// handed back the connection delivers completions to its sink again. A fabric without the
/// mode (tcp) refuses the hand-off, touching nothing, and the job runs on the caller's task.
async fn a_connection_handed_to_the_data_path_worker_is_driven_by_it(k: Kind) {
    use xfer_agent::transfer::job::{Job, WrTemplate};
    use xfer_agent::transfer::worker::{Refused, Worker};
    use xfer_engine::batch::Seg;
    use xfer_engine::machine::{Machine, MachineConfig, Markers, State};
    const LEN: u64 = 4 << 20;
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", LEN, Access::ReadWrite);
    let back = region(&a, "back", LEN, Access::ReadWrite);
    let dst = region(&b, "dst", LEN, Access::ReadWrite);
    let data = fill(&src, 3);
    let (conn, rx) = connect(&a, &b, 2, 16).await;
    let worker: Worker<Held> = Worker::start("conformance-dp", Duration::ZERO, tokio::runtime::Handle::current(), None).unwrap();
    let mut held = Held { conn: conn.clone(), rx };
    for (op, local, remote_op) in [(WrOp::Write, &src, RemoteOp::Write), (WrOp::Read, &back, RemoteOp::Read)] {
        let g = grant(&b, "dst", 0, LEN, remote_op, None).await;
        let machine = Machine::new(MachineConfig {
            segs: Arc::from([Seg { local: 0, remote: 0, len: LEN }]),
            chunk: 4096,
            qps: 2,
            depth: 16,
            signal_every: 4,
            deadline: None,
            markers: Markers::None,
            path_of: Arc::from([]),
            weights: Vec::new(),
        });
        let (reg, addr, key) = (local.registration.clone(), g.exposure.addr, g.exposure.key.clone());
        let wr = WrTemplate { op, notify_slot: 0, local: reg, remote_addr: addr, remote_key: key, wrap: None };
        let job = Job { machine, lease: held, wr, probe: None, cancel: tokio_util::sync::CancellationToken::new(), progress: None };
        let done = match (k, worker.run(job).await) {
            (_, Ok(done)) => {
                assert!(!matches!(k, Kind::Tcp), "tcp connections cannot be handed off");
                done
            }
            (Kind::Tcp, Err(Refused::Busy(job))) => xfer_agent::transfer::driver::drive(*job, None, Duration::ZERO).await.unwrap(),
            (_, Err(_)) => panic!("the worker refused a verbs connection"),
        };
        assert_eq!(done.machine.state(), &State::Succeeded, "{op:?}");
        assert_eq!(done.machine.bytes_done(), LEN);
        held = done.lease;
    }
    assert!(bytes(&dst) == data, "the WRITEs landed every byte");
    assert!(bytes(&back) == data, "the READs brought every byte back");
    // Handed back: the fabric's own completion task delivers again.
    let g = grant(&b, "dst", 0, LEN, RemoteOp::Write, None).await;
    conn.post(1, wr(7, WrOp::Write, &src, 0, 4096, &g, 0, true)).unwrap();
    let c = next(&mut held.rx).await;
    assert_eq!((c.wr_id, c.qp, c.status), (7, 1, WcStatus::Success));
}

/// One `#[tokio::test]` per case and fabric: `tcp::<case>` runs everywhere, `verbs::<case>` only
/// with `--ignored`/`--include-ignored` (in the Soft-RoCE VM).
macro_rules! per_fabric {
    ($($case:ident),* $(,)?) => {
        mod tcp {
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case(super::Kind::Tcp).await
                }
            )*
        }
        #[cfg(feature = "verbs")]
        mod verbs {
            $(
                #[tokio::test]
                #[ignore = "needs Soft-RoCE (make test-rxe)"]
                async fn $case() {
                    super::$case(super::Kind::Verbs).await
                }
            )*
        }
        #[cfg(feature = "verbs")]
        mod rails {
            $(
                #[tokio::test]
                #[ignore = "needs Soft-RoCE (make test-rxe)"]
                async fn $case() {
                    super::$case(super::Kind::Rails).await
                }
            )*
        }
    };
}

per_fabric!(
    write_then_read_roundtrip_with_selective_signalling,
    write_past_the_grant_is_refused_and_bytes_past_it_are_unchanged,
    grant_for_read_does_not_allow_write_and_vice_versa,
    region_access_ceiling_is_enforced_at_grant_time,
    revoked_grant_key_is_dead,
    expired_grant_is_refused,
    after_an_error_later_work_requests_are_flushed_not_failed,
    local_range_is_checked_at_post,
    a_grant_may_name_only_the_callers_own_connection,
    disconnect_revokes_the_grants_of_that_connection,
    a_notification_comes_only_after_every_byte_is_visible,
    a_ring_notification_comes_only_after_every_byte_is_visible,
    markers_count_only_on_their_connection_and_while_the_grant_lives,
    a_batch_of_work_requests_posts_in_order,
    polling_a_connection_delivers_each_completion_once,
    a_notification_needs_the_callers_own_connection,
    markers_acknowledged_before_complete_publish_the_notification,
    a_channel_grant_notifies_each_batch_after_its_bytes,
    a_connection_handed_to_the_data_path_worker_is_driven_by_it,
);

/// A fabric over two devices per side: one path per link, QPs numbered path after path, and a
/// grant with one key per QP; bytes written on every QP of both paths land and read back.
#[cfg(feature = "verbs")]
#[tokio::test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn rails_two_links_make_two_paths_with_a_key_per_qp() {
    two_paths_with_a_key_per_qp(Kind::Rails).await
}

/// The same in grant mode `mw`: each device binds a window on each of its QPs of the connection.
#[cfg(feature = "verbs")]
#[tokio::test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn rails_two_links_in_grant_mode_mw_bind_a_window_per_qp() {
    two_paths_with_a_key_per_qp(Kind::RailsMw).await
}

#[cfg(feature = "verbs")]
async fn two_paths_with_a_key_per_qp(k: Kind) {
    let dev = |k: &str| std::env::var(format!("XFER_RXE_{k}_DEV")).unwrap();
    let (a, b) = (side("a", 'A', k).await, side("b", 'B', k).await);
    let src = region(&a, "src", 1 << 20, Access::ReadWrite);
    let back = region(&a, "back", 1 << 20, Access::ReadWrite);
    let _dst = region(&b, "dst", 1 << 20, Access::ReadWrite);
    let data = fill(&src, 3);
    let (conn, mut rx) = connect(&a, &b, 2, 16).await;
    assert_eq!(conn.qps(), 4, "two QPs on each of two paths");
    let paths: Vec<(String, String, std::ops::Range<usize>)> =
        conn.paths().into_iter().map(|p| (p.local_device, p.remote_device, p.qps)).collect();
    assert_eq!(paths, vec![(dev("A"), dev("B"), 0..2), (dev("A2"), dev("B2"), 2..4)]);
    // Each path reports the MTU its QPs negotiated (what `doctor --peer` shows).
    for p in conn.paths() {
        assert!((256..=4096).contains(&p.mtu) && p.mtu.is_power_of_two(), "{p:?}");
    }
    let gw = grant(&b, "dst", 0, 1 << 20, RemoteOp::Write, None).await;
    // The key the initiator checks when a grant arrives fits this connection.
    gw.exposure.key.fits(conn.qps(), &conn.paths()).unwrap();
    match &gw.exposure.key {
        xfer_fabric::RemoteKey::PerQp(keys) => {
            assert_eq!(keys.len(), 4);
            if matches!(k, Kind::RailsMw) {
                let distinct: std::collections::BTreeSet<u32> = keys.iter().copied().collect();
                assert_eq!(distinct.len(), 4, "one window per QP");
            }
        }
        other => panic!("a multi-device grant has one key per QP, not {other:?}"),
    }
    for i in 0..16u64 {
        conn.post((i % 4) as usize, wr(i, WrOp::Write, &src, i << 16, 1 << 16, &gw, i << 16, true)).unwrap();
    }
    let mut qps = std::collections::BTreeSet::new();
    for _ in 0..16 {
        let c = next(&mut rx).await;
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
        assert_eq!(c.qp as u64, c.wr_id % 4, "a completion names the connection's QP it was posted on");
        qps.insert(c.qp);
    }
    assert_eq!(qps.len(), 4);
    let gr = grant(&b, "dst", 0, 1 << 20, RemoteOp::Read, None).await;
    for i in 0..16u64 {
        conn.post((i % 4) as usize, wr(100 + i, WrOp::Read, &back, i << 16, 1 << 16, &gr, i << 16, true)).unwrap();
    }
    for _ in 0..16 {
        assert_eq!(next(&mut rx).await.status, WcStatus::Success);
    }
    assert_eq!(bytes(&back), data, "every byte went out on one path and came back on another");
    assert!(!conn.is_broken());
}

/// A fabric over two devices and a single-device one work together either way round: the
/// single device answers (or is answered on) the one rail it reaches, and grants from a
/// multi-device responder carry a key per QP a plain connection can use.
#[cfg(feature = "verbs")]
#[tokio::test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn rails_and_a_single_device_fabric_connect_over_the_link_they_share() {
    let dev = |k: &str| std::env::var(format!("XFER_RXE_{k}_DEV")).unwrap();
    for (ka, kb, path) in [(Kind::Rails, Kind::Second, Some((dev("A2"), dev("B2")))), (Kind::Verbs, Kind::Rails, None)] {
        let (a, b) = (side("a", 'A', ka).await, side("b", 'B', kb).await);
        let src = region(&a, "src", 1 << 18, Access::ReadWrite);
        let back = region(&a, "back", 1 << 18, Access::ReadWrite);
        let _dst = region(&b, "dst", 1 << 18, Access::ReadWrite);
        let data = fill(&src, 9);
        let (conn, mut rx) = connect(&a, &b, 2, 8).await;
        assert_eq!(conn.qps(), 2, "one path of two QPs");
        if let Some((local, remote)) = &path {
            let paths: Vec<(String, String)> = conn.paths().into_iter().map(|p| (p.local_device, p.remote_device)).collect();
            assert_eq!(paths, vec![(local.clone(), remote.clone())]);
        }
        let gw = grant(&b, "dst", 0, 1 << 18, RemoteOp::Write, None).await;
        let gr = grant(&b, "dst", 0, 1 << 18, RemoteOp::Read, None).await;
        for i in 0..4u64 {
            conn.post((i % 2) as usize, wr(i, WrOp::Write, &src, i << 16, 1 << 16, &gw, i << 16, true)).unwrap();
        }
        for _ in 0..4 {
            assert_eq!(next(&mut rx).await.status, WcStatus::Success);
        }
        for i in 0..4u64 {
            conn.post((i % 2) as usize, wr(10 + i, WrOp::Read, &back, i << 16, 1 << 16, &gr, i << 16, true)).unwrap();
        }
        for _ in 0..4 {
            assert_eq!(next(&mut rx).await.status, WcStatus::Success);
        }
        assert_eq!(bytes(&back), data);
    }
}

/// Runs `ip` with `args` in the VM; panics with its stderr if it fails.
#[cfg(feature = "verbs")]
fn ip(args: &[&str]) -> String {
    let out = std::process::Command::new("ip").args(args).output().expect("run ip");
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Takes a netdev down and, when dropped (also on a failed assertion), up again with the
/// policy routes and permanent neighbour entries that going down deleted, so later tests in
/// the same boot find the link as the VM set it up.
#[cfg(feature = "verbs")]
struct LinkDown {
    netdev: String,
    routes: Vec<String>,
    neighbours: Vec<String>,
}

#[cfg(feature = "verbs")]
impl LinkDown {
    fn new(netdev: &str) -> LinkDown {
        let routes = ip(&["route", "show", "table", "all", "dev", netdev])
            .lines()
            .filter(|l| !l.contains("proto kernel") && !l.starts_with("local") && !l.starts_with("broadcast") && !l.trim().is_empty())
            .map(str::to_string)
            .collect();
        let neighbours = ip(&["neigh", "show", "dev", netdev, "nud", "permanent"])
            .lines()
            .filter(|l| l.contains("lladdr"))
            // `ADDR lladdr MAC PERMANENT`: the address and the link-layer address.
            .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .collect();
        ip(&["link", "set", netdev, "down"]);
        LinkDown { netdev: netdev.to_string(), routes, neighbours }
    }
}

#[cfg(feature = "verbs")]
impl Drop for LinkDown {
    fn drop(&mut self) {
        ip(&["link", "set", &self.netdev, "up"]);
        for r in &self.routes {
            let mut args: Vec<&str> = vec!["route", "replace"];
            args.extend(r.split_whitespace());
            args.extend(["dev", &self.netdev]);
            ip(&args);
        }
        for n in &self.neighbours {
            let mut args: Vec<&str> = vec!["neigh", "replace"];
            args.extend(n.split_whitespace());
            args.extend(["dev", &self.netdev, "nud", "permanent"]);
            ip(&args);
        }
    }
}

/// Waits (bounded, to fail rather than hang) until the fabric reports a device change after
/// `changes` was taken and then says `device` is `up`. The change is what the event handler
/// publishes once it has acted on the event (failed the connection parts); the port state alone
/// may say "down" before the handler has run.
#[cfg(feature = "verbs")]
async fn device_becomes(fabric: &xfer_fabric::verbs::RailsFabric, changes: &mut tokio::sync::watch::Receiver<u64>, device: &str, up: bool) {
    let seen = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            changes.changed().await.unwrap();
            if fabric.device_states().iter().any(|s| s.name == device && s.up == up) {
                return;
            }
        }
    })
    .await;
    assert!(seen.is_ok(), "{device} did not go {} (states {:?})", if up { "up" } else { "down" }, fabric.device_states());
}

/// A link that goes down: its device's asynchronous event takes it out of new connections and
/// fails its connection parts (the other path still carries work requests); when the link comes
/// back the device is offered again and a connection made meanwhile asks to be replaced.
#[cfg(feature = "verbs")]
#[tokio::test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn rails_a_link_that_goes_down_leaves_new_connections_and_comes_back() {
    let var = |k: &str| std::env::var(format!("XFER_RXE_{k}")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config { node_name: "a".into(), state_dir: dir.path().to_path_buf(), ..Config::default() };
    cfg.fabric = FabricChoice::Verbs;
    cfg.verbs.devices = vec![var("A_DEV"), var("A2_DEV")];
    cfg.listen = format!("{}:7470", var("A")).parse().unwrap();
    let grants = Arc::new(GrantTable::new(1024));
    let per_device = xfer_fabric::verbs::resolve_devices(&cfg.verbs_options()).unwrap();
    let rails = Arc::new(xfer_fabric::verbs::RailsFabric::open(per_device, grants.clone()).unwrap());
    let fabric: Arc<dyn Fabric> = rails.clone();
    let a = Side {
        node: Node::new(cfg, fabric.clone(), "test".into(), grants.clone(), xfer_agent::service::client::connector(None)),
        fabric,
        grants,
        _dir: dir,
    };
    let b = side("b", 'B', Kind::Rails).await;
    let src = region(&a, "src", 1 << 18, Access::ReadWrite);
    let _dst = region(&b, "dst", 1 << 18, Access::ReadWrite);
    fill(&src, 5);
    let (both, mut rx) = connect(&a, &b, 2, 8).await;
    assert_eq!(both.paths().len(), 2);
    let gw = grant(&b, "dst", 0, 1 << 18, RemoteOp::Write, None).await;
    let second = var("A2_DEV");
    // Taken before the link changes, so the change it makes is seen however soon it comes.
    let mut changes = rails.state_changes();
    let down = LinkDown::new(&var("A2_NETDEV"));
    device_becomes(&rails, &mut changes, &second, false).await;
    // The down device's part was moved to ERR: posting there is refused, the other path works.
    assert!(both.is_broken(), "a connection with a failed path reports it");
    assert!(both.post(2, wr(1, WrOp::Write, &src, 0, 4096, &gw, 0, true)).is_err());
    both.post(0, wr(2, WrOp::Write, &src, 0, 4096, &gw, 0, true)).unwrap();
    let c = next(&mut rx).await;
    assert_eq!((c.wr_id, c.status), (2, WcStatus::Success));
    // A new connection offers only the device that is up.
    let (one, _rx1) = connect(&a, &b, 2, 8).await;
    let paths: Vec<(String, String)> = one.paths().into_iter().map(|p| (p.local_device, p.remote_device)).collect();
    assert_eq!(paths, vec![(var("A_DEV"), var("B_DEV"))]);
    assert!(!one.wants_reconnect(), "nothing better is available while the link is down");
    let mut changes = rails.state_changes();
    drop(down);
    device_becomes(&rails, &mut changes, &second, true).await;
    assert!(one.wants_reconnect(), "a device it lacks is up again: the pool should replace it");
    // Held back by the agent, an up device is left out as well; released, it is used again.
    assert!(a.fabric.hold_back(&second, true));
    assert!(a.fabric.device_states().iter().any(|s| s.name == second && s.up && s.held_back && !s.offered()));
    let (held, _rx2) = connect(&a, &b, 2, 8).await;
    assert_eq!(held.paths().len(), 1);
    assert!(!held.wants_reconnect());
    assert!(a.fabric.hold_back(&second, false));
    assert!(held.wants_reconnect());
    let (again, _rx3) = connect(&a, &b, 2, 8).await;
    assert_eq!(again.paths().len(), 2, "both links again once the link is back and not held");
    assert!(!a.fabric.hold_back("no-such-device", true));
}
