//! Red team of `Agent.WatchInboundRing` (notifications through a shared-memory ring): refusals
//! that must leave nothing behind (objects in /dev/shm, subscriber places, registered bytes, the
//! `xfer_inbound_rings` gauge), streams abandoned in every way, the region and tag filters, a
//! hostile co-writer scribbling over or truncating a ring while the agent writes it, another
//! client taking a ring over, and shutdown. Real agents on the tcp fabric; the rings are read
//! with `xfer_rdma::ring::RingReader` over a mapping of the object, as the client crate does.
//!
//! Every test picks its own `transfer.max_notify_bytes`, so its rings have a length no other
//! test's (or other agent's) ring has: "no object left" is checked among the `xfer.ring.*`
//! objects of that length. Absence of a notification is never shown by waiting: a valid one is
//! published afterwards and must be the reader's next.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::*;
use tonic::transport::Channel;
use tonic::Code;
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;
use xfer_proto::v1::peer_client::PeerClient;
use xfer_rdma::memory::RegionMemory;
use xfer_rdma::ring::{RingNote, RingReader};

const SHM: &str = "/dev/shm";
const MIB: u64 = 1 << 20;
const GAUGE: &str = "xfer_inbound_rings";

/// Bytes of a ring of `slots` slots on an agent whose `transfer.max_notify_bytes` is `max`.
fn ring_len(max: usize, slots: u32) -> u64 {
    xfer_rdma::ring::ring_len(slots, xfer_rdma::ring::slot_size(max, 128, 253))
}

/// The ring objects (`xfer.ring.*`) in /dev/shm that are `len` bytes long.
fn objects(len: u64) -> BTreeSet<String> {
    std::fs::read_dir(SHM)
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().to_string_lossy().into_owned();
            let m = std::fs::symlink_metadata(e.path()).ok()?;
            (name.starts_with("xfer.ring.") && m.len() == len).then_some(name)
        })
        .collect()
}

/// Removes the objects named on drop (a test that fails must not leave rings in /dev/shm).
struct Sweep(Vec<String>);

impl Drop for Sweep {
    fn drop(&mut self) {
        for o in &self.0 {
            let _ = std::fs::remove_file(PathBuf::from(SHM).join(o));
        }
    }
}

fn ring_req(region: &str, tag: Option<&[u8]>, slots: u32) -> pb::WatchInboundRingRequest {
    pb::WatchInboundRingRequest { region: region.into(), tag: tag.map(<[u8]>::to_vec), slots }
}

/// `WatchInboundRing`: the stream (held: the ring lives while it is open) and its one message.
async fn open_ring(
    c: &mut AgentClient<Channel>,
    req: pb::WatchInboundRingRequest,
) -> Result<(tonic::Streaming<pb::InboundRing>, pb::InboundRing), tonic::Status> {
    let mut s = c.watch_inbound_ring(req).await?.into_inner();
    let first = tokio::time::timeout(Duration::from_secs(30), s.message())
        .await
        .expect("the ring's message within 30 s (hang guard)")?
        .expect("one message");
    Ok((s, first))
}

/// The ring's object, opened as an application (or a co-writer) does.
fn open_object(r: &pb::InboundRing) -> std::fs::File {
    std::fs::OpenOptions::new().read(true).write(true).custom_flags(nix::libc::O_NOFOLLOW).open(PathBuf::from(SHM).join(&r.object)).unwrap()
}

fn map(r: &pb::InboundRing) -> RegionMemory {
    RegionMemory::map_file(&open_object(r), r.length as usize, true).unwrap()
}

fn reader(r: &pb::InboundRing) -> RingReader {
    RingReader::open(map(r)).unwrap()
}

/// The ring's next notification (polled; 30 s is a hang guard).
async fn next_ring(r: &mut RingReader) -> RingNote {
    for _ in 0..3000 {
        match r.try_next() {
            Ok(Some(n)) => return n,
            Ok(None) => tokio::time::sleep(Duration::from_millis(10)).await,
            Err(e) => panic!("ring reader: {e}"),
        }
    }
    panic!("no notification in the ring within 30 s");
}

/// The reader fell behind by exactly `k` (a 16-slot ring after more than 16 notifications).
fn expect_lag(r: &mut RingReader, k: u64) {
    assert_eq!(r.try_next().unwrap_err(), xfer_rdma::ring::RingError::Lagged(k));
}

/// Polls `cond` (3000 times 10 ms apart: a hang guard, not a synchronisation).
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..3000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never: {what}");
}

fn notify_grant_req(region: &str, conn: &str, tag: &[u8]) -> pb::GrantRequest {
    pb::GrantRequest {
        notify: Some(pb::NotifyRequest { tag: tag.to_vec(), markers: 1, channel: false }),
        region: region.into(),
        offset: 0,
        length: 4096,
        op: pb::Access::Write as i32,
        ttl: None,
        node_name: "declared".into(),
        connection_id: conn.into(),
    }
}

/// Publishes one notification with `tag` on `region`: a grant with a notification on the
/// caller's connection `conn`, then the grantee's `Peer.Complete`.
async fn notify_with(p: &mut PeerClient<Channel>, region: &str, conn: &str, tag: &[u8]) {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let g = p.grant(notify_grant_req(region, conn, tag)).await.unwrap().into_inner();
    let id = format!("t-{}", N.fetch_add(1, Ordering::Relaxed));
    p.complete(complete_req(&g.grant_id, &id, 4096, "x")).await.unwrap();
}

async fn notify(a: &Agent, region: &str, conn: &str, tag: &[u8]) {
    notify_with(&mut a.peer_client().await, region, conn, tag).await;
}

/// Requests the agent must refuse: slot counts that are not a power of two in 16..=65536, a
/// tag filter longer than `transfer.max_notify_bytes`, a region that does not exist, a ring
/// larger than `max_registered_bytes` leaves. Each is refused with its code and leaves no
/// object, no gauge, no reserved byte and no subscriber place behind.
#[tokio::test]
async fn refused_ring_requests_leave_nothing_behind() {
    const MAX: usize = 77;
    let a = Agent::start_env("node-a", &[("XFER_TRANSFER__MAX_NOTIFY_BYTES", "77"), ("XFER_LIMITS__MAX_REGISTERED_BYTES", "8MiB")]);
    a.create("r", MIB, pb::Access::ReadWrite).await;
    let lens: Vec<u64> = [16, 1024, 65536].iter().map(|&s| ring_len(MAX, s)).collect();
    let before: Vec<_> = lens.iter().map(|&l| objects(l)).collect();
    let mut c = a.client().await;
    let cases: Vec<(&str, pb::WatchInboundRingRequest, Code)> = vec![
        ("1 slot", ring_req("", None, 1), Code::InvalidArgument),
        ("15 slots", ring_req("", None, 15), Code::InvalidArgument),
        ("17 slots", ring_req("", None, 17), Code::InvalidArgument),
        ("1000 slots", ring_req("", None, 1000), Code::InvalidArgument),
        ("65537 slots", ring_req("", None, 65537), Code::InvalidArgument),
        ("2^17 slots", ring_req("", None, 1 << 17), Code::InvalidArgument),
        ("u32::MAX slots", ring_req("", None, u32::MAX), Code::InvalidArgument),
        ("a 78-byte tag filter", ring_req("", Some(&[b't'; 78]), 16), Code::InvalidArgument),
        ("a 1 MiB tag filter", ring_req("", Some(&vec![b't'; 1 << 20]), 16), Code::InvalidArgument),
        ("no such region", ring_req("nope", None, 16), Code::NotFound),
        ("a path as region", ring_req("../r", None, 16), Code::NotFound),
        ("past max_registered_bytes", ring_req("", None, 65536), Code::ResourceExhausted),
    ];
    for (what, req, code) in cases {
        let e = open_ring(&mut c, req).await.expect_err(what);
        assert_eq!(e.code(), code, "{what}: {e:?}");
    }
    for (l, b) in lens.iter().zip(&before) {
        assert_eq!(&objects(*l), b, "a refused request left an object of {l} bytes");
    }
    assert_eq!(gauge(&a, GAUGE), 0.0);
    // At the edge: a 77-byte tag filter and 16 slots are fine, by name and by id.
    let id = c.get_region(pb::GetRegionRequest { name: "r".into() }).await.unwrap().into_inner().id;
    let (s1, r1) = open_ring(&mut c, ring_req("r", Some(&[b't'; 77]), 16)).await.unwrap();
    let (s2, r2) = open_ring(&mut c, ring_req(&id, None, 16)).await.unwrap();
    let _sweep = Sweep(vec![r1.object.clone(), r2.object.clone()]);
    assert_eq!((r1.length, r1.slots, r2.length), (lens[0], 16, lens[0]));
    drop((s1, s2));
    eventually("both rings removed", || !PathBuf::from(SHM).join(&r1.object).exists() && !PathBuf::from(SHM).join(&r2.object).exists())
        .await;
    wait_gauge(&a, GAUGE, 0.0).await;
    // Every byte came back: the region plus the rest of max_registered_bytes fit.
    c.create_region(anon("rest", 7 * MIB)).await.expect("the refused and closed rings gave every byte back");
    // And every subscriber place: a stream subscription works.
    let _s = subscribe(&a, "", None).await;
}

/// A ring's bytes are reserved against `max_registered_bytes` while it lives (a region that
/// would not fit is refused) and come back when its stream closes.
#[tokio::test]
async fn ring_bytes_are_reserved_and_come_back() {
    const MAX: usize = 141;
    let len = ring_len(MAX, 1024);
    let limit = 3 * len + len / 2;
    let a = Agent::start_env(
        "node-a",
        &[("XFER_TRANSFER__MAX_NOTIFY_BYTES", "141"), ("XFER_LIMITS__MAX_REGISTERED_BYTES", &limit.to_string())],
    );
    let before = objects(len);
    let mut c = a.client().await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(open_ring(&mut c, ring_req("", None, 0)).await.unwrap());
    }
    let _sweep = Sweep(held.iter().map(|(_, r)| r.object.clone()).collect());
    assert!(held.iter().all(|(_, r)| r.length == len && r.slots == 1024), "0 slots means 1024");
    let e = open_ring(&mut c, ring_req("", None, 0)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    let e = c.create_region(anon("big", len)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert_eq!(objects(len).difference(&before).count(), 3);
    assert_eq!(gauge(&a, GAUGE), 3.0);
    held.pop();
    wait_gauge(&a, GAUGE, 2.0).await;
    assert_eq!(objects(len).difference(&before).count(), 2);
    c.create_region(anon("big", len)).await.expect("the closed ring's bytes came back");
    held.clear();
    wait_gauge(&a, GAUGE, 0.0).await;
    assert_eq!(objects(len), before);
}

/// Rings count toward the 256 `WatchInbound` subscribers: the 257th ring and a stream
/// subscription are refused (the refused ring leaves no object), and closing the rings gives
/// every place back.
#[tokio::test]
async fn rings_share_the_256_subscribers_and_give_their_places_back() {
    const MAX: usize = 205;
    let len = ring_len(MAX, 16);
    let a = Agent::start_env("node-a", &[("XFER_TRANSFER__MAX_NOTIFY_BYTES", "205")]);
    a.create("r", MIB, pb::Access::ReadWrite).await;
    a.data_session("c1").await;
    let before = objects(len);
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(a.client().await);
    }
    let mut held = Vec::new();
    for i in 0..256 {
        held.push(open_ring(&mut clients[i % 8], ring_req("", None, 16)).await.unwrap_or_else(|e| panic!("ring {i}: {e:?}")));
    }
    let _sweep = Sweep(held.iter().map(|(_, r)| r.object.clone()).collect());
    let e = open_ring(&mut clients[0], ring_req("", None, 16)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    let e = a.client().await.watch_inbound(pb::WatchInboundRequest { region: String::new(), tag: None }).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert_eq!(objects(len).difference(&before).count(), 256, "the refused ring left no object");
    assert_eq!(gauge(&a, GAUGE), 256.0);
    // Every ring receives a notification (the agent writes all 256 on the publishing thread).
    let mut last = reader(&held[255].1);
    notify(&a, "r", "c1", b"to-all").await;
    assert_eq!(next_ring(&mut last).await.tag, b"to-all");
    held.clear();
    wait_gauge(&a, GAUGE, 0.0).await;
    eventually("every ring object removed", || objects(len) == before).await;
    let mut s = subscribe(&a, "", None).await;
    notify(&a, "r", "c1", b"after").await;
    assert_eq!(next_note(&mut s).await.tag, b"after");
}

/// A connection whose socket can be cut from under it (no RST_STREAM, no GOAWAY: the peer
/// vanishes), as a crashed or killed application's.
async fn cuttable_channel(a: &Agent) -> (AgentClient<Channel>, std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>) {
    let socks = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let keep = socks.clone();
    let addr = a.addr();
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let (addr, keep) = (addr.clone(), keep.clone());
            async move {
                let s = tokio::net::TcpStream::connect(addr).await?;
                let std = s.into_std()?;
                keep.lock().unwrap().push(std.try_clone()?);
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::TcpStream::from_std(std)?))
            }
        }))
        .await
        .unwrap();
    (AgentClient::new(ch), socks)
}

/// Streams abandoned every way: dropped after the ring's message, dropped before any answer,
/// and connections cut at the socket without closing the stream. Every object is removed, the
/// gauge returns to 0 and every subscriber place comes back.
#[tokio::test]
async fn abandoned_ring_streams_leave_no_object() {
    const MAX: usize = 269;
    let len = ring_len(MAX, 16);
    let a = Agent::start_env("node-a", &[("XFER_TRANSFER__MAX_NOTIFY_BYTES", "269")]);
    a.create("r", MIB, pb::Access::ReadWrite).await;
    a.data_session("c1").await;
    let before = objects(len);
    let mut c = a.client().await;
    let mut seen = Vec::new();
    // Dropped once the ring is known.
    for _ in 0..100 {
        let (s, r) = open_ring(&mut c, ring_req("", None, 16)).await.unwrap();
        seen.push(r.object);
        drop(s);
    }
    // Dropped before the answer (polled once: the request may or may not have reached the agent).
    for _ in 0..100 {
        let mut c2 = c.clone();
        let fut = c2.watch_inbound_ring(ring_req("", None, 16));
        tokio::pin!(fut);
        let _ = futures::poll!(&mut fut);
    }
    // Connections cut at the socket while the stream is open.
    for _ in 0..20 {
        let (mut cc, socks) = cuttable_channel(&a).await;
        let (s, r) = open_ring(&mut cc, ring_req("", None, 16)).await.unwrap();
        seen.push(r.object);
        for sock in socks.lock().unwrap().iter() {
            sock.shutdown(std::net::Shutdown::Both).unwrap();
        }
        std::mem::forget(s);
    }
    let _sweep = Sweep(seen.clone());
    wait_gauge(&a, GAUGE, 0.0).await;
    eventually("every abandoned ring's object removed", || objects(len) == before).await;
    // All 256 places are free again.
    let mut held = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(a.client().await);
    }
    for i in 0..256 {
        held.push(
            open_ring(&mut clients[i % 8], ring_req("", None, 16))
                .await
                .unwrap_or_else(|e| panic!("ring {i} after the abandoned ones: {e:?}")),
        );
    }
    let _sweep2 = Sweep(held.iter().map(|(_, r)| r.object.clone()).collect());
    held.clear();
    wait_gauge(&a, GAUGE, 0.0).await;
}

/// The object is the agent's: a fresh random `xfer.ring.<8 hex state-dir tag>.<16 hex>` name the caller cannot
/// choose, a regular file of the agent's uid with exactly `regions.shm_mode`
/// (0600 by default; 0660 and `regions.shm_group` when configured), as long as announced,
/// laid out as a ring.
#[tokio::test]
async fn ring_objects_are_fresh_private_and_as_announced() {
    for (mode, group, max) in [(0o600u32, None, 333usize), (0o660, Some(65534u32), 397)] {
        let mut env = vec![("XFER_TRANSFER__MAX_NOTIFY_BYTES".to_string(), max.to_string())];
        if let Some(g) = group {
            env.push(("XFER_REGIONS__SHM_MODE".into(), format!("0{mode:o}")));
            env.push(("XFER_REGIONS__SHM_GROUP".into(), g.to_string()));
        }
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let a = Agent::start_env("node-a", &env);
        let mut c = a.client().await;
        let mut names = BTreeSet::new();
        let mut held = Vec::new();
        for _ in 0..8 {
            let (s, r) = open_ring(&mut c, ring_req("", None, 16)).await.unwrap();
            let rest = r.object.strip_prefix("xfer.ring.").unwrap_or_else(|| panic!("{:?}", r.object));
            let (tag, hex) = rest.split_once('.').unwrap_or_else(|| panic!("{:?}", r.object));
            assert!(tag.len() == 8 && tag.bytes().all(|b| b.is_ascii_hexdigit()), "{:?}", r.object);
            assert!(hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()), "{:?}", r.object);
            assert!(names.insert(r.object.clone()), "a name came twice");
            let m = std::fs::symlink_metadata(PathBuf::from(SHM).join(&r.object)).unwrap();
            assert!(m.file_type().is_file());
            assert_eq!(m.permissions().mode() & 0o7777, mode, "{:?}", r.object);
            assert_eq!(m.uid(), nix::unistd::getuid().as_raw());
            if let Some(g) = group {
                assert_eq!(m.gid(), g);
            }
            assert_eq!((m.len(), r.length), (ring_len(max, 16), ring_len(max, 16)));
            assert_eq!(r.slot_size, xfer_rdma::ring::slot_size(max, 128, 253));
            let rd = reader(&r);
            assert_eq!(rd.position(), 0);
            held.push((s, r));
        }
        let _sweep = Sweep(names.iter().cloned().collect());
        held.clear();
        wait_gauge(&a, GAUGE, 0.0).await;
        assert!(names.iter().all(|n| !PathBuf::from(SHM).join(n).exists()));
    }
}

/// Filters: by region name, by region id, by tag, none. Each ring gets exactly what it asked
/// for, in order. A ring that filtered on a region that was deleted (and re-created under the
/// same name: a new id) gets nothing more and disturbs nobody (SECURITY.md: a subscription by
/// name follows the region it resolved to).
#[tokio::test]
async fn rings_get_exactly_what_their_filters_ask() {
    let a = Agent::start_env("node-a", &[("XFER_TRANSFER__MAX_NOTIFY_BYTES", "461")]);
    a.create("ra", MIB, pb::Access::ReadWrite).await;
    let rb = a.create("rb", MIB, pb::Access::ReadWrite).await;
    a.data_session("c1").await;
    let mut c = a.client().await;
    let (_s_all, all) = open_ring(&mut c, ring_req("", None, 16)).await.unwrap();
    let (_s_a, by_name) = open_ring(&mut c, ring_req("ra", None, 16)).await.unwrap();
    let (_s_b, by_id) = open_ring(&mut c, ring_req(&rb.id, None, 16)).await.unwrap();
    let (_s_t, by_tag) = open_ring(&mut c, ring_req("", Some(b"t2"), 16)).await.unwrap();
    let (_s_at, a_and_tag) = open_ring(&mut c, ring_req("ra", Some(b"t2"), 16)).await.unwrap();
    let _sweep = Sweep([&all, &by_name, &by_id, &by_tag, &a_and_tag].iter().map(|r| r.object.clone()).collect());
    let (mut all, mut by_name, mut by_id, mut by_tag, mut a_and_tag) =
        (reader(&all), reader(&by_name), reader(&by_id), reader(&by_tag), reader(&a_and_tag));
    for (region, tag) in [("ra", "t1"), ("rb", "t2"), ("ra", "t2"), ("rb", "t1")] {
        notify(&a, region, "c1", tag.as_bytes()).await;
    }
    let got = |r: RingNote| (r.region, String::from_utf8(r.tag).unwrap());
    let want = |v: &[(&str, &str)]| v.iter().map(|(r, t)| (r.to_string(), t.to_string())).collect::<Vec<_>>();
    let drain = |rd: &mut RingReader| {
        let mut v = Vec::new();
        while let Some(n) = rd.try_next().unwrap() {
            v.push(got(n));
        }
        v
    };
    // Rings are written inside the publication: once Complete returned, every ring has it.
    assert_eq!(drain(&mut all), want(&[("ra", "t1"), ("rb", "t2"), ("ra", "t2"), ("rb", "t1")]));
    assert_eq!(drain(&mut by_name), want(&[("ra", "t1"), ("ra", "t2")]));
    assert_eq!(drain(&mut by_id), want(&[("rb", "t2"), ("rb", "t1")]));
    assert_eq!(drain(&mut by_tag), want(&[("rb", "t2"), ("ra", "t2")]));
    assert_eq!(drain(&mut a_and_tag), want(&[("ra", "t2")]));
    // Region ra deleted and made again: a new region for the filter's purpose.
    c.delete_region(pb::DeleteRegionRequest { name: "ra".into() }).await.unwrap();
    a.create("ra", MIB, pb::Access::ReadWrite).await;
    notify(&a, "ra", "c1", b"t2").await;
    notify(&a, "rb", "c1", b"t3").await;
    assert_eq!(drain(&mut all), want(&[("ra", "t2"), ("rb", "t3")]));
    assert_eq!(drain(&mut by_name), want(&[]), "the old region's ring follows the old region");
    assert_eq!(drain(&mut a_and_tag), want(&[]));
    assert_eq!(drain(&mut by_tag), want(&[("ra", "t2")]));
    assert_eq!(drain(&mut by_id), want(&[("rb", "t3")]));
}

/// A co-writer of the object (anyone who may open it: the agent's uid, `regions.shm_group`)
/// scribbles over a ring's header and slots while the agent writes it: absurd head, zero
/// slots, a slot size past the object, flags, waiters. The agent keeps its own geometry: it
/// writes only inside the object, never blocks, and every other subscriber (a ring and a
/// stream) receives every notification; the scribbled ring is closed and removed when its
/// stream closes.
#[tokio::test]
async fn a_co_writer_scribbling_over_a_ring_disturbs_nobody_else() {
    const MAX: usize = 525;
    let len = ring_len(MAX, 16);
    let a = Agent::start_env("node-a", &[("XFER_TRANSFER__MAX_NOTIFY_BYTES", "525")]);
    a.create("r", MIB, pb::Access::ReadWrite).await;
    a.data_session("c1").await;
    let mut c = a.client().await;
    let (s_victim, victim) = open_ring(&mut c, ring_req("", None, 16)).await.unwrap();
    let (_s_other, other) = open_ring(&mut c, ring_req("", None, 16)).await.unwrap();
    let _sweep = Sweep(vec![victim.object.clone(), other.object.clone()]);
    let mut stream = subscribe(&a, "", None).await;
    let mut other_rd = reader(&other);
    let scribbler = map(&victim);
    scribbler.write_at(len - 4096, &vec![0xee; 4096]).unwrap();
    scribbler.write_at(crate_header::HEADER, &vec![0xff; (len - crate_header::HEADER - 4096) as usize]).unwrap();
    scribbler.store_u64(64, u64::MAX - 3, Ordering::SeqCst).unwrap(); // head
    scribbler.write_at(12, &u32::MAX.to_le_bytes()).unwrap(); // slot size
    scribbler.write_at(16, &0u32.to_le_bytes()).unwrap(); // slots
    scribbler.write_at(20, &0xffff_fffeu32.to_le_bytes()).unwrap(); // flags, closed bit clear
    scribbler.write_at(132, &u32::MAX.to_le_bytes()).unwrap(); // waiters
    for i in 0..40u32 {
        notify(&a, "r", "c1", format!("n{i}").as_bytes()).await;
    }
    expect_lag(&mut other_rd, 24);
    for i in 0..16u32 {
        assert_eq!(next_ring(&mut other_rd).await.tag, format!("n{}", 24 + i).as_bytes(), "the other ring (16 slots: the last 16)");
    }
    for i in 0..40u32 {
        assert_eq!(next_note(&mut stream).await.tag, format!("n{i}").as_bytes(), "the stream subscriber");
    }
    // The agent wrote by its own geometry: head 40, and slot k holds the last notification n
    // with n % 16 == k (seq n + 1).
    assert_eq!(scribbler.load_u64(64, Ordering::SeqCst).unwrap(), 40);
    let slot_size = u64::from(victim.slot_size);
    for k in 0..16u64 {
        let n = 24 + (k + 16 - 24 % 16) % 16;
        assert_eq!(scribbler.load_u64(crate_header::HEADER + k * slot_size, Ordering::SeqCst).unwrap(), n + 1, "slot {k}");
    }
    assert_eq!(std::fs::metadata(PathBuf::from(SHM).join(&victim.object)).unwrap().len(), len, "nothing written past the object");
    drop(s_victim);
    wait_gauge(&a, GAUGE, 1.0).await;
    eventually("the scribbled ring removed", || !PathBuf::from(SHM).join(&victim.object).exists()).await;
    let flags = scribbler.load_u32(20, Ordering::SeqCst).unwrap();
    assert_eq!(flags & 1, 1, "closed on the way out");
    notify(&a, "r", "c1", b"after").await;
    assert_eq!(next_ring(&mut other_rd).await.tag, b"after");
    assert_eq!(next_note(&mut stream).await.tag, b"after");
}

mod crate_header {
    pub const HEADER: u64 = xfer_rdma::ring::HEADER;
}

/// A co-writer truncates a ring while the agent writes it: to nothing (the agent's next store
/// faults: the SIGBUS guard), and inside its last page (no fault: the size check). The agent
/// lives; the other ring and the stream subscriber receive every notification; the truncated
/// rings are closed and removed with their streams.
#[tokio::test]
async fn truncating_a_ring_under_the_agent_hurts_only_that_ring() {
    const MAX: usize = 589;
    let len = ring_len(MAX, 16);
    let a = Agent::start_env("node-a", &[("XFER_TRANSFER__MAX_NOTIFY_BYTES", "589")]);
    let pid = a.pid().unwrap();
    a.create("r", MIB, pb::Access::ReadWrite).await;
    a.data_session("c1").await;
    let mut c = a.client().await;
    let (s_zero, zero) = open_ring(&mut c, ring_req("", None, 16)).await.unwrap();
    let (s_page, page) = open_ring(&mut c, ring_req("", None, 16)).await.unwrap();
    let (_s_other, other) = open_ring(&mut c, ring_req("", None, 16)).await.unwrap();
    let _sweep = Sweep(vec![zero.object.clone(), page.object.clone(), other.object.clone()]);
    let mut stream = subscribe(&a, "", None).await;
    let mut other_rd = reader(&other);
    notify(&a, "r", "c1", b"before").await;
    assert_eq!(next_ring(&mut other_rd).await.tag, b"before");
    assert_eq!(next_note(&mut stream).await.tag, b"before");
    open_object(&zero).set_len(0).unwrap();
    open_object(&page).set_len(len - 100).unwrap();
    for i in 0..40u32 {
        notify(&a, "r", "c1", format!("n{i}").as_bytes()).await;
    }
    expect_lag(&mut other_rd, 24);
    for i in 0..16u32 {
        assert_eq!(next_ring(&mut other_rd).await.tag, format!("n{}", 24 + i).as_bytes());
    }
    for i in 0..40u32 {
        assert_eq!(next_note(&mut stream).await.tag, format!("n{i}").as_bytes());
    }
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists(), "the agent lives");
    drop((s_zero, s_page));
    wait_gauge(&a, GAUGE, 1.0).await;
    eventually("the truncated rings removed", || {
        !PathBuf::from(SHM).join(&zero.object).exists() && !PathBuf::from(SHM).join(&page.object).exists()
    })
    .await;
    // A new ring works (the agent's SIGBUS bookkeeping and limits are intact).
    let (_s_new, new) = open_ring(&mut c, ring_req("", None, 16)).await.unwrap();
    let _sweep2 = Sweep(vec![new.object.clone()]);
    let mut new_rd = reader(&new);
    notify(&a, "r", "c1", b"after").await;
    assert_eq!(next_ring(&mut new_rd).await.tag, b"after");
    assert_eq!(next_ring(&mut other_rd).await.tag, b"after");
}

/// The widest tag the agent accepts (`transfer.max_notify_bytes`, up to its ceiling of 65,536)
/// reaches ring subscribers as it reaches stream subscribers. The ring's tag length is a u16:
/// a tag of exactly 65,536 bytes cannot be written, and the agent drops it for every ring
/// (logging a warning) while streams deliver it.
#[tokio::test]
async fn the_widest_accepted_tag_reaches_ring_subscribers() {
    let a = Agent::start_env("node-a", &[("XFER_TRANSFER__MAX_NOTIFY_BYTES", "65536")]);
    a.create("r", MIB, pb::Access::ReadWrite).await;
    a.data_session("c1").await;
    let mut c = a.client().await;
    let (_s, ring) = open_ring(&mut c, ring_req("", None, 16)).await.unwrap();
    let _sweep = Sweep(vec![ring.object.clone()]);
    let mut rd = reader(&ring);
    let mut stream = subscribe(&a, "", None).await;
    let wide = vec![b'w'; 65536];
    notify(&a, "r", "c1", &wide).await;
    notify(&a, "r", "c1", b"next").await;
    assert_eq!(next_note(&mut stream).await.tag.len(), 65536, "the stream subscriber got the wide tag");
    let first = next_ring(&mut rd).await;
    assert_eq!(first.tag.len(), 65536, "the ring subscriber's first notification is {:?}", String::from_utf8_lossy(&first.tag));
}

/// Shutdown (SIGTERM) with a ring open: the agent tells the ring's reader it is closed and
/// removes the object, as it does when the stream closes.
#[tokio::test]
async fn shutdown_closes_and_removes_open_rings() {
    let mut a = Agent::start_env("node-a", &[("XFER_TRANSFER__MAX_NOTIFY_BYTES", "653")]);
    let mut c = a.client().await;
    let (_s, ring) = open_ring(&mut c, ring_req("", None, 16)).await.unwrap();
    let _sweep = Sweep(vec![ring.object.clone()]);
    let rd = reader(&ring);
    a.sigterm();
    let exit = a.wait_exit(Duration::from_secs(60)).await;
    assert!(exit.is_some(), "the agent exits on SIGTERM");
    let path = PathBuf::from(SHM).join(&ring.object);
    assert!(
        rd.closed().unwrap() && !path.exists(),
        "after shutdown: reader told closed = {}, object left in /dev/shm = {}",
        rd.closed().unwrap(),
        path.exists()
    );
}

/// Another client (another identity: mTLS client role) sees the ring's name in /dev/shm (a
/// world-readable directory) and asks the agent to adopt the object as a shm region
/// (`adopt_existing`: a regular file of the agent's uid). If the agent lets it, WriteRegion
/// forges notifications into the victim's ring that no peer ever made (and the agent's next
/// real notification lands behind the forged head's back). The ring must not be adoptable.
#[tokio::test]
async fn another_client_cannot_take_over_a_ring() {
    const MAX: usize = 717;
    let pki = pki::Pki::new();
    pki.leaf("mallory", vec![pki::uri(&pki::role_uri("client", "mallory"))]);
    let (a, _tmp) = pki.agent_with("node-a", "[transfer]\nmax_notify_bytes = 717", "", &[]);
    let mut victim_c = pki.agent_client(&a, "xferctl").await;
    let mut mallory = pki.agent_client(&a, "mallory").await;
    victim_c.create_region(anon("r", MIB)).await.unwrap();
    let mut peer = pki.peer(&a, "node-b").await;
    peer.connect(connect_req("c1")).await.unwrap();
    let (_s, ring) = open_ring(&mut victim_c, ring_req("", None, 16)).await.unwrap();
    let _sweep = Sweep(vec![ring.object.clone()]);
    let mut victim = reader(&ring);
    assert_eq!(ring.length, ring_len(MAX, 16));
    // Mallory finds the name where anyone can.
    let listed: Vec<String> = std::fs::read_dir(SHM).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(listed.contains(&ring.object));
    let adopted = mallory
        .create_region(pb::CreateRegionRequest {
            name: "stolen".into(),
            length: ring.length,
            kind: pb::RegionKind::Shm as i32,
            path: ring.object.clone(),
            access: pb::Access::ReadWrite as i32,
            adopt_existing: true,
            ..Default::default()
        })
        .await;
    if adopted.is_ok() {
        // A notification of 'forged' in slot 0, then head = 1.
        let mut slot = Vec::new();
        slot.extend_from_slice(&1u64.to_le_bytes());
        slot.extend_from_slice(&0u64.to_le_bytes());
        slot.extend_from_slice(&0u64.to_le_bytes());
        slot.extend_from_slice(&(1u64 << 20).to_le_bytes());
        slot.extend_from_slice(&[1, 1]);
        slot.extend_from_slice(&6u16.to_le_bytes());
        slot.extend_from_slice(&1u16.to_le_bytes());
        slot.extend_from_slice(&6u16.to_le_bytes());
        slot.resize(64, 0);
        slot.extend_from_slice(b"forgedrnode-b");
        let write = |offset: u64, data: Vec<u8>| pb::WriteRegionRequest { region: "stolen".into(), offset, data };
        mallory.write_region(futures::stream::iter(vec![write(xfer_rdma::ring::HEADER, slot)])).await.unwrap();
        mallory.write_region(futures::stream::iter(vec![write(64, 1u64.to_le_bytes().to_vec())])).await.unwrap();
    }
    // No peer has done anything yet: the ring holds nothing (a look, not a wait).
    let premature = victim.try_next().unwrap();
    notify_with(&mut peer, "r", "c1", b"genuine").await;
    let first = match premature {
        Some(n) => n,
        None => next_ring(&mut victim).await,
    };
    assert_eq!(
        first.tag,
        b"genuine",
        "adopting the ring object as a region was {}; the victim's first notification is {:?} (peer {:?}, region {:?})",
        if adopted.is_ok() { "ALLOWED" } else { "refused" },
        String::from_utf8_lossy(&first.tag),
        first.peer,
        first.region
    );
}

/// A ring the agent can no longer write (the object was cut, here by 100 bytes inside its last
/// page: no fault, the size check poisons the whole mapping; a full /dev/shm, which any local
/// user can cause, poisons it the same way through SIGBUS on the next page) gets no
/// notification ever again. Its reader still sees an intact, open ring and its stream stays
/// open: the loss is silent. The agent should close the ring or end the subscription.
#[tokio::test]
async fn a_ring_the_agent_can_no_longer_write_is_not_left_silently_open() {
    let a = Agent::start_env("node-a", &[("XFER_TRANSFER__MAX_NOTIFY_BYTES", "781")]);
    a.create("r", MIB, pb::Access::ReadWrite).await;
    a.data_session("c1").await;
    let mut c = a.client().await;
    let (mut s_victim, victim) = open_ring(&mut c, ring_req("", None, 16)).await.unwrap();
    let _sweep = Sweep(vec![victim.object.clone()]);
    let mut rd = reader(&victim);
    notify(&a, "r", "c1", b"before").await;
    assert_eq!(next_ring(&mut rd).await.tag, b"before");
    open_object(&victim).set_len(victim.length - 100).unwrap();
    notify(&a, "r", "c1", b"lost").await;
    // The subscription ends with DATA_LOSS (the 30 s is a hang guard), and the ring says it is
    // closed where the reader can still see it.
    let ended = tokio::time::timeout(Duration::from_secs(30), s_victim.message()).await.expect("the stream ends");
    let status = ended.expect_err("the stream ends with a status");
    assert_eq!(status.code(), tonic::Code::DataLoss, "{status:?}");
    assert!(status.message().contains("can no longer write"), "{status:?}");
    assert!(rd.closed().unwrap_or(true), "the ring is marked closed (or cannot be read at all)");
    // The agent let the ring go: its gauge is back to 0 once the stream is gone.
    drop(s_victim);
    wait_gauge(&a, GAUGE, 0.0).await;
}

/// An agent killed (SIGKILL, OOM, a crash) cannot remove its rings; restarted on the same state
/// dir, it should not leave them in /dev/shm for ever (each holds the pages it was written to:
/// up to ~96 MiB for 65,536 slots at the default max_notify_bytes, 256 of them).
#[tokio::test]
async fn rings_of_a_killed_agent_do_not_outlive_its_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let env = [("XFER_TRANSFER__MAX_NOTIFY_BYTES", "845")];
    let mut a = Agent::start_with_env("node-a", &state, Ports::new(), &[], &env);
    let (_s, ring) = open_ring(&mut a.client().await, ring_req("", None, 16)).await.unwrap();
    let _sweep = Sweep(vec![ring.object.clone()]);
    a.kill9();
    let path = PathBuf::from(SHM).join(&ring.object);
    assert!(path.exists());
    let b = Agent::start_with_env("node-a", &state, Ports::new(), &[], &env);
    let _ = b.client().await.list_regions(pb::ListRegionsRequest::default()).await.unwrap();
    assert!(!path.exists(), "{} is still in /dev/shm after the agent that made it restarted", ring.object);
}

/// A client whose host vanishes (here: a proxy between it and the agent that stops passing
/// bytes either way, as a dead host or a cut link does, with no FIN and no RST) must not keep
/// its ring for ever: the agent's HTTP/2 keepalive (`limits.grpc_keepalive`, 1 s here) finds the
/// connection dead, ends its streams, closes the ring and removes the object. A live client on
/// another connection keeps its ring. (Found by the red team: no keepalive on the server.)
#[tokio::test]
async fn a_vanished_clients_ring_is_given_back() {
    use tokio::io::AsyncWriteExt;
    let a = Agent::start_env("node-a", &[("XFER_LIMITS__GRPC_KEEPALIVE", "1s")]);
    // The proxy: forwards both ways until `cut`, then holds both sockets open and silent.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = listener.local_addr().unwrap();
    let cut = std::sync::Arc::new(tokio::sync::Notify::new());
    let agent_addr = a.addr();
    let cut2 = cut.clone();
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.unwrap();
        let server = tokio::net::TcpStream::connect(agent_addr).await.unwrap();
        let (mut cr, mut cw) = client.into_split();
        let (mut sr, mut sw) = server.into_split();
        let pump = async {
            tokio::select! {
                _ = tokio::io::copy(&mut cr, &mut sw) => {}
                _ = tokio::io::copy(&mut sr, &mut cw) => {}
            }
        };
        tokio::select! {
            _ = pump => {}
            _ = cut2.notified() => {}
        }
        // Silent from here on: keep the halves alive, send nothing, read nothing.
        let _held = (cr, cw, sr);
        let _ = sw.flush().await;
        std::future::pending::<()>().await;
    });
    let ch = Channel::from_shared(format!("http://{proxy}")).unwrap().connect().await.unwrap();
    let mut vanishing = AgentClient::new(ch);
    let (_s, gone) = open_ring(&mut vanishing, ring_req("", None, 16)).await.unwrap();
    let _sweep = Sweep(vec![gone.object.clone()]);
    let (_live_s, live) = open_ring(&mut a.client().await, ring_req("", None, 16)).await.unwrap();
    let _sweep2 = Sweep(vec![live.object.clone()]);
    wait_gauge(&a, GAUGE, 2.0).await;
    cut.notify_one();
    let path = PathBuf::from(SHM).join(&gone.object);
    eventually("the vanished client's ring is removed", || !path.exists()).await;
    wait_gauge(&a, GAUGE, 1.0).await;
    assert!(PathBuf::from(SHM).join(&live.object).exists(), "the live client's ring stays");
}
