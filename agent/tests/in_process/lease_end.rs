//! A lease that ends is a delete: a region whose lease (ttl) ran out while a peer wrote into it
//! takes no byte once a lookup answers NOT_FOUND, and no write into it succeeds after that.
//!
//! In-process (two `Node`s over the tcp fabric on 127.0.0.1) so that the lease ends when the test
//! says: the reaper is called with a `now` past the lease, while a peer writes into the file
//! region continuously and another region of the same agent is written beside it. And end to
//! end, with real agents, a channel and the agent's own reaper.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{mpsc, oneshot};
use xfer_agent::config::Config;
use xfer_agent::error::NodeError;
use xfer_agent::grants::{Grant, GrantTable};
use xfer_agent::node::{GrantParams, Node};
use xfer_agent::regions::{Region, RegionError, RegionKind, RegionSpec};
use xfer_engine::ids::ConnectionId;
use xfer_fabric::tcp::TcpFabric;
use xfer_fabric::{Access, Completion, Connection, Fabric, FabricKind, RemoteOp, WcStatus, WorkRequest, WrOp};

/// Bytes per write; the destination has 16 such chunks, the source 17.
const CHUNK: u64 = 64 << 10;

struct Side {
    node: Arc<Node>,
    fabric: Arc<dyn Fabric>,
    grants: Arc<GrantTable>,
    dir: tempfile::TempDir,
}

async fn side(name: &str) -> Side {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config { node_name: name.to_string(), state_dir: dir.path().to_path_buf(), ..Config::default() };
    let grants = Arc::new(GrantTable::new(1024));
    let fabric: Arc<dyn Fabric> = Arc::new(TcpFabric::bind("127.0.0.1:0".parse().unwrap(), grants.clone(), None).await.unwrap());
    let node = Node::new(cfg, fabric.clone(), "test".into(), grants.clone(), xfer_agent::service::client::connector(None));
    Side { node, fabric, grants, dir }
}

/// A connects to B as connection `id` of peer "a", one QP.
async fn connect(a: &Side, b: &Side, id: &str) -> (Arc<dyn Connection>, mpsc::UnboundedReceiver<Completion>) {
    let id = ConnectionId::parse(id).unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let pending = a.fabric.prepare("b", &id, 1, 4, tx).await.unwrap();
    let eps = b.node.accept_connection("a", &id, FabricKind::Tcp, &pending.local_endpoints()).await.unwrap();
    (pending.complete(&eps).await.unwrap(), rx)
}

fn write_grant(region: &str, conn: &str) -> GrantParams {
    GrantParams {
        notify: None,
        region: region.into(),
        offset: 0,
        length: 16 * CHUNK,
        op: RemoteOp::Write,
        ttl: None,
        peer: "a".into(),
        connection_id: Some(ConnectionId::parse(conn).unwrap()),
    }
}

/// Source chunk `k` of 17: every byte differs from the same byte of the chunk before it.
fn chunk(k: u64) -> Vec<u8> {
    (0..CHUNK).map(|i| (i as u8).wrapping_mul(13).wrapping_add((k as u8).wrapping_mul(29).wrapping_add(1))).collect()
}

/// How one write ended, and whether the region was already gone when it was posted.
#[derive(Debug, Clone, Copy)]
struct Outcome {
    posted_after_gone: bool,
    succeeded: bool,
}

/// Writes into `g`'s region over `conn`, one WR at a time: WR `i` carries source chunk `i % 17` to
/// destination chunk `i % 16`, so every write changes the bytes it lands on. `warm` is told after
/// 50 successful writes; it stops `after_gone` writes after `gone` is set.
async fn write_until(
    conn: Arc<dyn Connection>,
    mut rx: mpsc::UnboundedReceiver<Completion>,
    src: Arc<Region>,
    g: Arc<Grant>,
    gone: Arc<AtomicBool>,
    after_gone: usize,
    warm: oneshot::Sender<()>,
) -> Vec<(u64, Outcome)> {
    let mut warm = Some(warm);
    let mut out = Vec::new();
    let mut ok = 0;
    for i in 0u64.. {
        let posted_after_gone = gone.load(Ordering::SeqCst);
        if out.iter().filter(|(_, o): &&(u64, Outcome)| o.posted_after_gone).count() >= after_gone {
            break;
        }
        let wr = WorkRequest {
            wr_id: i,
            op: WrOp::Write,
            local: src.registration.clone(),
            local_offset: (i % 17) * CHUNK,
            len: CHUNK as u32,
            remote_addr: g.exposure.addr + (i % 16) * CHUNK,
            remote_key: g.exposure.key.clone(),
            signaled: true,
        };
        let succeeded = match conn.post(0, wr) {
            Err(_) => false,
            Ok(()) => {
                let c =
                    tokio::time::timeout(Duration::from_secs(20), rx.recv()).await.expect("a completion within 20 s").expect("sink open");
                assert_eq!(c.wr_id, i);
                c.status == WcStatus::Success
            }
        };
        out.push((i, Outcome { posted_after_gone, succeeded }));
        ok += usize::from(succeeded);
        if ok >= 50 {
            if let Some(w) = warm.take() {
                let _ = w.send(());
            }
        }
        // A broken connection fails every post at once: let the other tasks run.
        tokio::task::yield_now().await;
    }
    out
}

/// The lease of a file region ends while a peer writes into it continuously (the reaper called
/// with a `now` past the lease). From the first NOT_FOUND on: the file's bytes never change again,
/// every write posted is FAILED, a new grant is NOT_FOUND — and another region of the same agent,
/// written over its own connection the whole time, loses no write.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_that_ends_stops_every_byte_before_the_region_is_gone() {
    let (a, b) = (side("a").await, side("b").await);
    let src = a.node.create_region(RegionSpec::anonymous("src", 17 * CHUNK, Access::ReadWrite)).unwrap();
    for k in 0..17 {
        src.memory.write_at(k * CHUNK, &chunk(k)).unwrap();
    }
    let files = b.dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    let file = files.join("leased.bin");
    std::fs::write(&file, vec![0u8; 16 * CHUNK as usize]).unwrap();
    b.node
        .create_region(RegionSpec {
            kind: RegionKind::File,
            path: Some("leased.bin".into()),
            ttl: Some(Duration::from_secs(3600)),
            ..RegionSpec::anonymous("leased", 16 * CHUNK, Access::ReadWrite)
        })
        .unwrap();
    let other = b.node.create_region(RegionSpec::anonymous("other", 16 * CHUNK, Access::ReadWrite)).unwrap();

    let (c1, rx1) = connect(&a, &b, "conn-1").await;
    let (c2, rx2) = connect(&a, &b, "conn-2").await;
    let leased_grant = b.node.grant(&write_grant("leased", "conn-1")).await.unwrap();
    let other_grant = b.node.grant(&write_grant("other", "conn-2")).await.unwrap();
    let gone = Arc::new(AtomicBool::new(false));
    let (warm1, warm1_rx) = oneshot::channel();
    let (warm2, warm2_rx) = oneshot::channel();
    let leased_writer = tokio::spawn(write_until(c1, rx1, src.clone(), leased_grant, gone.clone(), 20, warm1));
    let other_writer = tokio::spawn(write_until(c2, rx2, src.clone(), other_grant, gone.clone(), 100, warm2));
    warm1_rx.await.unwrap();
    warm2_rx.await.unwrap();

    // The lease ends (as the reaper sees it two hours from now) while both writers run; the test
    // looks the region up until it is gone and takes the file's bytes at that moment.
    let node = b.node.clone();
    let reaper = tokio::task::spawn_blocking(move || node.reap_regions(SystemTime::now() + Duration::from_secs(7200)));
    loop {
        match b.node.describe_region("leased") {
            Ok(_) => tokio::task::yield_now().await,
            Err(RegionError::NotFound(_)) => break,
            Err(e) => panic!("{e}"),
        }
    }
    let at_gone = std::fs::read(&file).unwrap();
    gone.store(true, Ordering::SeqCst);
    assert_eq!(reaper.await.unwrap(), 1, "one region's lease ended");
    let leased = leased_writer.await.unwrap();
    let others = other_writer.await.unwrap();

    assert!(std::fs::read(&file).unwrap() == at_gone, "bytes landed in the file after GetRegion answered NOT_FOUND");
    let before = leased.iter().filter(|(_, o)| !o.posted_after_gone && o.succeeded).count();
    assert!(before >= 50, "the peer was writing when the lease ended ({before} writes)");
    let late: Vec<_> = leased.iter().filter(|(_, o)| o.posted_after_gone && o.succeeded).collect();
    assert!(late.is_empty(), "writes posted after NOT_FOUND succeeded: {late:?}");
    let err = b.node.grant(&write_grant("leased", "conn-1")).await.unwrap_err();
    assert!(matches!(err, NodeError::Region(RegionError::NotFound(_))), "{err}");

    // Nothing else changed: the other region's writer lost no write, before or after, and its
    // last 16 writes are its bytes now.
    assert!(others.iter().all(|(_, o)| o.succeeded), "{:?}", others.iter().find(|(_, o)| !o.succeeded));
    assert!(others.iter().filter(|(_, o)| o.posted_after_gone).count() >= 100);
    for (i, _) in &others[others.len() - 16..] {
        let mut got = vec![0u8; CHUNK as usize];
        other.memory.read_at((i % 16) * CHUNK, &mut got).unwrap();
        assert!(got == chunk(i % 17), "chunk {} of the other region", i % 16);
    }
    let counts = b.node.state_counts();
    assert_eq!((counts.regions, counts.grants, counts.grant_tokens), (1, 1, 1), "only the other region and its grant are left");
    assert_eq!(b.grants.len(), 1);
}

/// A region whose lease ended is refused to new uses and new grants at once, and the reaper
/// never takes a region that is in use (a running transfer's source or destination).
#[tokio::test]
async fn a_lease_ends_like_a_delete_and_never_under_a_running_use() {
    let b = side("b").await;
    let spec = |name: &str| RegionSpec { ttl: Some(Duration::from_secs(60)), ..RegionSpec::anonymous(name, 4096, Access::ReadWrite) };
    b.node.create_region(spec("busy")).unwrap();
    b.node.create_region(spec("idle")).unwrap();
    let mut sub = b.node.watch_inbound("idle", None).unwrap();
    let using = b.node.use_region("busy").unwrap();
    let later = SystemTime::now() + Duration::from_secs(120);
    assert_eq!(b.node.reap_regions(later), 1, "only the idle region ends");
    assert!(matches!(b.node.describe_region("idle"), Err(RegionError::NotFound(_))));
    assert!(matches!(sub.try_recv(), Err(tokio::sync::broadcast::error::TryRecvError::Closed)), "its subscribers are told");
    assert!(b.node.describe_region("busy").is_ok(), "a region in use outlives its lease until the use ends");
    drop(using);
    assert_eq!(b.node.reap_regions(later), 1);
    assert!(matches!(b.node.use_region("busy"), Err(RegionError::NotFound(_))));
    drop(sub);
    let c = b.node.state_counts();
    assert_eq!((c.regions, c.notify_channels, c.subscribers), (0, 0, 0));
}

/// The order, pinned down: a tcp chunk being copied under a grant of the region holds its lease,
/// so the region's end waits in its revocation. Until that chunk is in, the region is still there
/// for lookups (GetRegion answers) — it has only stopped taking new uses and grants — and once
/// the lookup answers NOT_FOUND the grant is revoked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_stays_visible_until_its_grants_are_revoked() {
    let (a, b) = (side("a").await, side("b").await);
    b.node
        .create_region(RegionSpec { ttl: Some(Duration::from_secs(60)), ..RegionSpec::anonymous("leased", 16 * CHUNK, Access::ReadWrite) })
        .unwrap();
    let (_conn, _rx) = connect(&a, &b, "conn-1").await;
    let g = b.node.grant(&write_grant("leased", "conn-1")).await.unwrap();
    // A chunk being copied: holds the grant's gate open until released.
    let (held_tx, held_rx) = std::sync::mpsc::channel::<()>();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let gate = g.gate.clone();
    let copier = std::thread::spawn(move || {
        gate.while_live(|| {
            held_tx.send(()).unwrap();
            release_rx.recv().unwrap();
        })
    });
    held_rx.recv().unwrap();
    let node = b.node.clone();
    let reaper = tokio::task::spawn_blocking(move || node.reap_regions(SystemTime::now() + Duration::from_secs(120)));
    // The reaper has marked the region as ending once it takes no new use (looked up without
    // marking it in use: the reaper leaves a region in use alone).
    while b.node.region("leased").is_ok() {
        tokio::task::yield_now().await;
    }
    assert!(b.node.describe_region("leased").is_ok(), "the region vanished while a chunk was still being copied into it");
    assert!(!reaper.is_finished(), "the region's end waits for the chunk");
    let err = b.node.grant(&write_grant("leased", "conn-1")).await.unwrap_err();
    assert!(err.to_string().contains("not found"), "no new grant on an ending region: {err}");
    release_tx.send(()).unwrap();
    assert_eq!(copier.join().unwrap(), Some(()), "the chunk that held the gate open was copied");
    assert_eq!(reaper.await.unwrap(), 1);
    assert!(matches!(b.node.describe_region("leased"), Err(RegionError::NotFound(_))));
    assert!(!g.gate.is_live(), "its grant was revoked");
    assert_eq!(b.grants.len(), 0);
}

/// End to end, as it was seen: real agents, a channel A → B writing batch after batch into B's
/// file region whose lease (ttl, 1 s) runs out on B's own reaper, and a second channel into
/// another region of B beside it. From the first GetRegion that answers NOT_FOUND: the file's
/// bytes never change again and no batch posted after it is SUCCEEDED (the channel ends); the
/// other channel's batches all succeed, before and after.
#[tokio::test]
async fn a_channel_into_a_region_whose_lease_ends_gets_no_success_after_not_found() {
    use crate::common::chan::*;
    use crate::common::{file_region_req, random_bytes, root_of, Agent};
    use xfer_proto::v1 as pb;

    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    a.create("src", 17 * CHUNK, pb::Access::ReadWrite).await;
    a.put("src", 0, &random_bytes(17 * CHUNK as usize, 5)).await;
    b.create("other", 16 * CHUNK, pb::Access::ReadWrite).await;
    std::fs::create_dir_all(root_of(&b)).unwrap();
    let file = root_of(&b).join("leased.bin");
    std::fs::write(&file, vec![0u8; 16 * CHUNK as usize]).unwrap();
    let mut cb = b.client().await;
    cb.create_region(pb::CreateRegionRequest {
        ttl: Some(prost_types::Duration { seconds: 1, nanos: 0 }),
        ..file_region_req("leased", 16 * CHUNK, "leased.bin", pb::Access::ReadWrite)
    })
    .await
    .unwrap();
    let open = |remote: &str| open_msg_qps(pb::Op::Write, "src", &b, remote, 0, 16 * CHUNK, false, 2);
    let mut leased = try_open(&a, open("leased")).await.unwrap();
    let mut other = try_open(&a, open("other")).await.unwrap();
    // Batch i: source chunk i % 17 to destination chunk i % 16 (every batch changes its bytes).
    let batch = |i: u64| vec![seg((i % 17) * CHUNK, (i % 16) * CHUNK, CHUNK)];

    let gone = Arc::new(AtomicBool::new(false));
    let watcher = {
        let gone = gone.clone();
        let (mut cb, file) = (cb.clone(), file.clone());
        tokio::spawn(async move {
            loop {
                match cb.get_region(pb::GetRegionRequest { name: "leased".into() }).await {
                    Ok(_) => continue,
                    Err(s) if s.code() == tonic::Code::NotFound => break,
                    Err(s) => panic!("{s}"),
                }
            }
            let at_gone = std::fs::read(&file).unwrap();
            gone.store(true, Ordering::SeqCst);
            at_gone
        })
    };
    let (mut before, mut late_ok, mut other_ok) = (0, Vec::new(), 0);
    for i in 0u64.. {
        let posted_after_gone = gone.load(Ordering::SeqCst);
        leased.send(post_msg(i, batch(i), 0, None)).await;
        let d = leased.done().await;
        let succeeded = d.state == pb::TransferState::Succeeded as i32;
        if succeeded && posted_after_gone {
            late_ok.push(d.seq);
        }
        before += usize::from(succeeded && !posted_after_gone);
        ok(&other.post(i, batch(i), 0, None).await);
        other_ok += 1;
        if !succeeded {
            break;
        }
    }
    let status = leased.end().await;
    assert_ne!(status.code(), tonic::Code::Ok, "{status:?}");
    let at_gone = watcher.await.unwrap();
    assert!(std::fs::read(&file).unwrap() == at_gone, "bytes landed in the file after GetRegion answered NOT_FOUND");
    assert!(before > 0, "the channel was writing when the lease ended");
    assert!(late_ok.is_empty(), "batches posted after NOT_FOUND were SUCCEEDED: {late_ok:?}");
    // Nothing else changed: the other channel goes on.
    for i in 0..20 {
        ok(&other.post(1_000_000 + i, batch(i), 0, None).await);
    }
    assert!(other_ok > 0);
    other.close().await;
}
