//! Exhaustion is bounded and visible (host-safety issue, bullet 6): real agents on loopback under
//! floods of idle data connections and peer-pool churn. No sleeps: every wait is on a socket
//! (EOF) or a gRPC answer, and loops are bounded by counts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::TcpStream;

use crate::common::*;
use futures::StreamExt;
use xfer_proto::v1 as pb;

fn nofile_soft(pid: u32) -> u64 {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    line.split_whitespace().nth(3).unwrap().parse().unwrap()
}

/// Reads one frame header from a refused stream: (kind, status, id).
fn read_frame(s: &mut TcpStream) -> (Kind, u16, u64) {
    let h = read_header(s);
    (h.kind, h.status, h.id)
}

/// Whether the next read sees the stream closed (EOF or a reset).
fn at_eof(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 64];
    match s.read(&mut b) {
        Ok(0) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(_) => false,
    }
}

/// One NAK frame (`REM_INV_REQ_ERR`: the stream never said hello) and then EOF.
fn naked_then_eof(s: &mut TcpStream) -> bool {
    let mut r = [0u8; frame::HEADER_LEN];
    s.read_exact(&mut r).is_ok() && Header::decode(&r).is_ok_and(|h| h.kind == Kind::Nak) && at_eof(s)
}

/// Like `raw_write`, but a stream the agent refused (and closed) gives `None` instead of a panic.
fn try_write(s: &mut TcpStream, token: [u8; 16], addr: u64, payload: &[u8]) -> Option<(u16, Kind)> {
    s.write_all(&frame_header(Kind::Write, frame::ACK_REQUESTED, 7, token, addr, payload.len() as u32)).ok()?;
    s.write_all(payload).ok()?;
    let mut r = [0u8; frame::HEADER_LEN];
    s.read_exact(&mut r).ok()?;
    let h = Header::decode(&r).unwrap();
    Some((h.status, h.kind))
}

const REM_ACCESS_ERR: u16 = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_connection_flood_leaves_transfers_grpc_and_metrics_working() {
    raise_own_nofile();
    let a = Agent::start("node-a");
    // The default cap (4096) is more than this descriptor limit can hold: the agent enforces
    // half the limit (512) and says so.
    let b = Agent::start_env_nofile("node-b", &[("XFER_LIMITS__DATA_HANDSHAKE_TIMEOUT", "3s")], 1024);
    let pid = b.pid().unwrap();
    let limit = nofile_soft(pid);
    assert_eq!(limit, 1024, "ulimit -n 1024 sets the hard limit too: the agent cannot raise it");
    assert!(b.logs().contains("RLIMIT_NOFILE"), "the agent logs its file limits: {}", b.logs());
    assert!(b.logs().contains("enforcing half of it"), "the clamped cap is logged: {}", b.logs());
    let text = scrape(&b);
    assert_eq!(metric(&text, "xfer_limit{limit=\"max_data_connections\"}"), 512.0, "{text}");
    assert_eq!(metric(&text, "xfer_limit{limit=\"open_files\"}"), 1024.0, "{text}");

    const LEN: u64 = 64 << 20;
    a.create("src", LEN, pb::Access::ReadWrite).await;
    b.create("dst", LEN, pb::Access::ReadWrite).await;
    let data = random_bytes(LEN as usize, 61);
    a.put("src", 0, &data).await;
    // No connection from A to B exists yet: the transfer must get new data streams in after the
    // flood.

    // The flood: 2 × 40 streams with a valid hello that then idle, and 2,000 sockets that never
    // send anything. The cap (512), not the fd limit (1024), holds.
    let (address, s1) = b.data_session("flood-1").await;
    let (_, s2) = b.data_session("flood-2").await;
    let flood = tokio::task::spawn_blocking(move || {
        let mut socks = Vec::new();
        for (id, secret) in [("flood-1", &s1), ("flood-2", &s2)] {
            for _ in 0..40 {
                socks.push(open_data_stream(&address, id, secret));
            }
        }
        for _ in 0..2000 {
            match TcpStream::connect(&address) {
                Ok(s) => socks.push(s),
                Err(e) => panic!("connect to the data port: {e}"),
            }
        }
        socks
    });
    let mut socks = flood.await.unwrap();
    assert!(open_fds(pid) < limit as usize, "fds {} at the limit {limit}", open_fds(pid));

    // gRPC and /metrics answer; a 64 MiB transfer completes with the right bytes.
    let t = a.transfer(write_req("src", &b, "dst", LEN)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert!(b.read("dst", 0, LEN).await == data, "bytes differ");
    // Silent sockets never held more than limits.max_pending_data_connections (128) slots: each
    // newer one closed the oldest.
    let text = scrape(&b);
    assert!(metric(&text, "xfer_data_connections_closed_total{reason=\"evicted\"}") >= 1000.0, "{text}");
    assert_eq!(metric(&text, "xfer_limit{limit=\"max_pending_data_connections\"}"), 128.0, "{text}");
    let open = metric(&text, "xfer_data_connections");
    assert!((1.0..=512.0).contains(&open), "xfer_data_connections = {open}");
    assert!(open_fds(pid) < limit as usize, "fds {} at the limit {limit}", open_fds(pid));

    // The first silent socket was evicted (EOF); the last is still pending and is closed at the
    // handshake deadline (EOF), and counted.
    let first_silent = &mut socks[80];
    first_silent.set_read_timeout(Some(READ_GUARD)).unwrap();
    assert!(naked_then_eof(first_silent), "an evicted socket gets one NAK, then EOF");
    let silent = socks.last_mut().unwrap();
    silent.set_read_timeout(Some(READ_GUARD)).unwrap();
    assert!(at_eof(silent));
    let text = scrape(&b);
    assert!(metric(&text, "xfer_data_connections_closed_total{reason=\"handshake\"}") > 0.0, "{text}");
    assert!(open_fds(pid) < limit as usize);
    drop(socks);
    // Still serving.
    b.client().await.list_regions(pb::ListRegionsRequest::default()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_stream_is_closed_and_a_busy_one_is_not() {
    // "Busy" means a frame more often than the idle timeout, which no event can stand in for:
    // the timeout is long next to the gap between two of this test's frames, even when the
    // test is descheduled on a loaded machine (300 ms was not), and the loop runs as long.
    let b = Agent::start_env("node-b", &[("XFER_LIMITS__DATA_IDLE_TIMEOUT", "2s")]);
    let mut idle = b.data_stream("c-idle").await;
    let mut busy = b.data_stream("c-busy").await;
    idle.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 64];
    let mut closed = false;
    // Frames on `busy` (NAKed: no grant, but each is a frame) until `idle` reads EOF; the
    // count bounds the wait.
    for _ in 0..2_000_000 {
        let (status, kind) = raw_write(&mut busy, [0; 16], 0, &[1; 8]);
        assert_eq!((status, kind), (REM_ACCESS_ERR, Kind::Nak), "a busy stream keeps answering");
        match idle.read(&mut buf) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(n) => panic!("unexpected {n} bytes on an idle stream"),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => panic!("idle stream: {e}"),
        }
    }
    assert!(closed, "the idle stream was never closed");
    assert_eq!(raw_write(&mut busy, [0; 16], 0, &[1; 8]), (REM_ACCESS_ERR, Kind::Nak), "the busy stream is still open");
    let text = scrape(&b);
    assert!(metric(&text, "xfer_data_connections_closed_total{reason=\"idle\"}") >= 1.0, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fifth_stream_of_an_identity_is_refused_and_the_first_four_work() {
    let b = Agent::start_env("node-b", &[("XFER_LIMITS__MAX_DATA_CONNECTIONS_PER_PEER", "4")]);
    b.create("dst", 8192, pb::Access::ReadWrite).await;
    let (address, secret) = b.data_session("c1").await;
    let g = b
        .peer_client()
        .await
        .grant(pb::GrantRequest {
            notify: None,
            region: "dst".into(),
            offset: 0,
            length: 4096,
            op: pb::Access::Write as i32,
            ttl: None,
            node_name: "node-a".into(),
            connection_id: "c1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let token: [u8; 16] = g.token.as_slice().try_into().unwrap();
    // Each stream's hello is admitted by its own task on the agent, in no set order: an ACK on
    // each of the four is what says all four hold their places before the fifth says hello.
    let mut four: Vec<TcpStream> = (0..4).map(|_| open_data_stream(&address, "c1", &secret)).collect();
    for (i, s) in four.iter_mut().enumerate() {
        assert_eq!(raw_write(s, token, g.addr, &[i as u8 + 1; 1024]), (0, Kind::Ack), "stream {i} ACKs");
    }
    assert!(b.read("dst", 0, 1024).await == vec![4u8; 1024]);
    // The same identity (plaintext: every loopback caller) on another connection: over the cap.
    let mut fifth = b.data_stream("c2").await;
    let (kind, status, _) = read_frame(&mut fifth);
    assert_eq!((kind, status), (Kind::Nak, REM_ACCESS_ERR), "refused with a NAK");
    assert!(at_eof(&mut fifth), "then closed");
    let text = scrape(&b);
    assert_eq!(metric(&text, "xfer_data_connections_refused_total{reason=\"per_peer\"}"), 1.0, "{text}");
    // The four still work after the refusal.
    for (i, s) in four.iter_mut().enumerate() {
        assert_eq!(raw_write(s, token, g.addr, &[i as u8 + 5; 1024]), (0, Kind::Ack), "stream {i} still ACKs");
    }

    // A closed stream frees its place. The agent sees the close on its own task; the socket's
    // slot (`xfer_data_connections`) is given back only after its place under the per-peer cap,
    // so once the gauge has counted both closed sockets (the fifth and this one) away, a new
    // stream must be admitted. Polled by count, each poll a scrape.
    drop(four.pop());
    let mut seen = 0.0;
    for _ in 0..100_000 {
        seen = metric(&scrape(&b), "xfer_data_connections");
        if seen == 3.0 {
            break;
        }
    }
    assert_eq!(seen, 3.0, "the agent never saw the fifth and the fourth stream close");
    let mut again = open_data_stream(&address, "c1", &secret);
    assert_eq!(raw_write(&mut again, token, g.addr, &[9; 16]), (0, Kind::Ack), "a closed stream's place was freed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn peer_pool_churn_stays_bounded_and_a_live_peer_still_works() {
    const MAX: usize = 64;
    let a = Agent::start_env("node-a", &[("XFER_LIMITS__MAX_PEERS", "64")]);
    let b = Agent::start("node-b");
    a.create("src", 1 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let data = random_bytes(1 << 20, 7);
    a.put("src", 0, &data).await;
    a.client().await.connect(pb::ConnectRequest { peer: b.addr(), qps: 0 }).await.unwrap();

    // 2,000 Connect calls to distinct closed addresses (port 9 on 127.0.x.y refuses).
    let client = a.client().await;
    let results: Vec<Result<(), tonic::Code>> = futures::stream::iter(0..2000u32)
        .map(|i| {
            let mut c = client.clone();
            async move {
                let peer = format!("127.0.{}.{}:9", i / 250, 1 + i % 250);
                c.connect(pb::ConnectRequest { peer, qps: 1 }).await.map(|_| ()).map_err(|s| s.code())
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    assert!(results.iter().all(|r| r.is_err()), "a closed port answered");
    assert!(
        results.iter().all(|r| matches!(r, Err(tonic::Code::Unavailable | tonic::Code::ResourceExhausted))),
        "{:?}",
        results.iter().filter(|r| !matches!(r, Err(tonic::Code::Unavailable | tonic::Code::ResourceExhausted))).take(3).collect::<Vec<_>>()
    );

    let peers = a.client().await.list_peers(pb::ListPeersRequest::default()).await.unwrap().into_inner().peers;
    assert!(peers.len() <= MAX, "{} pool entries", peers.len());
    let text = scrape(&a);
    let gauge = metric(&text, "xfer_peers");
    assert!(gauge <= MAX as f64 && gauge >= 1.0, "xfer_peers = {gauge}");
    assert!(metric(&text, "xfer_peers_evicted_total") >= (2000 - MAX) as f64 * 0.5, "{text}");

    // The live peer still works (its entry may have been evicted and is made again).
    let t = a.transfer(write_req("src", &b, "dst", 1 << 20)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert!(b.read("dst", 0, 1 << 20).await == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_errors_back_off_are_counted_and_the_agent_recovers() {
    raise_own_nofile();
    // Sockets alone cannot use up the descriptors (every listener has its share of the limit),
    // so file regions take them (each holds one descriptor of its file) until one can no longer
    // be made; then the data listener's accept fails with EMFILE too.
    let b = Agent::start_env_nofile("node-b", &[("XFER_LIMITS__DATA_HANDSHAKE_TIMEOUT", "1h")], 256);
    let pid = b.pid().unwrap();
    let (address, secret) = b.data_session("c1").await;
    std::fs::write(root_of(&b).join("f.bin"), vec![0u8; 4096]).unwrap();
    let mut c = b.client().await;
    let mut made = Vec::new();
    for i in 0..300 {
        let name = format!("f{i}");
        match c.create_region(file_region_req(&name, 4096, "f.bin", pb::Access::ReadWrite)).await {
            Ok(_) => made.push(name),
            Err(e) => {
                assert!(e.message().contains("Too many open files"), "the descriptors ran out: {e:?}");
                break;
            }
        }
    }
    assert!(made.len() < 300, "256 descriptors held {} file regions", made.len());
    let socks: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(&address).unwrap()).collect();
    // Every fd is taken. Freeing some lets the agent recover by itself (no restart): the queued
    // sockets are accepted.
    assert!(open_fds(pid) <= 256);
    for name in made {
        c.delete_region(pb::DeleteRegionRequest { name }).await.unwrap();
    }
    drop(socks);
    let mut s = open_data_stream(&address, "c1", &secret);
    assert_eq!(try_write(&mut s, [0; 16], 0, &[1; 8]), Some((REM_ACCESS_ERR, Kind::Nak)), "a new data stream is served");
    // The failed accepts were counted (scraped now: /metrics had no descriptor either).
    let text = scrape(&b);
    assert!(metric(&text, "xfer_accept_errors_total{listener=\"data\"}") >= 1.0, "{text}");
    b.client().await.list_regions(pb::ListRegionsRequest::default()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_the_target_closed_for_idleness_is_never_lent() {
    let a = Agent::start("node-a");
    let b = Agent::start_env("node-b", &[("XFER_LIMITS__DATA_IDLE_TIMEOUT", "300ms")]);
    a.create("src", 1 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let data = random_bytes(1 << 20, 11);
    a.put("src", 0, &data).await;
    let mut c = a.client().await;
    let info = c.connect(pb::ConnectRequest { peer: b.addr(), qps: 0 }).await.unwrap().into_inner();
    assert_eq!(info.qps, 1, "one idle connection in the pool");
    // B closes the idle streams; A's readers see EOF and the pooled connection is broken (ListPeers
    // counts only connections that can be lent). Bounded by a count of calls.
    let mut gone = false;
    for _ in 0..100_000 {
        let peers = c.list_peers(pb::ListPeersRequest::default()).await.unwrap().into_inner().peers;
        if peers.iter().find(|p| p.address == b.addr()).is_some_and(|p| p.qps == 0) {
            gone = true;
            break;
        }
    }
    assert!(gone, "the idle-closed connection still counts as lendable");
    assert!(metric(&scrape(&b), "xfer_data_connections_closed_total{reason=\"idle\"}") >= 1.0);
    // The transfer negotiates a fresh connection instead of using the dead one.
    let t = a.transfer(write_req("src", &b, "dst", 1 << 20)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert!(b.read("dst", 0, 1 << 20).await == data);
}
