//! Revocation is immediate for the tcp data plane (the host-safety issue, bullet 3): once
//! `Peer.Revoke`, grant expiry or `DeleteRegion` has returned, no byte of the granted range
//! changes, even for a WRITE whose header passed the grant check before it: the stream receiving
//! its payload is closed, no ACK is sent, and what the initiator sends afterwards never lands.
//! And a payload that stalls past `limits.data_payload_timeout` closes its stream. Real agents on
//! loopback, raw frames on data streams.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::common::*;
use xfer_proto::v1 as pb;

/// Region, grant and payload size.
const LEN: usize = 1 << 20;
/// Payload bytes sent before the revocation.
const PART: usize = 1000;
/// Polls (20 ms apart) before giving up on a condition that the agent must reach: a hang guard
/// of a minute, far past any wait a loaded machine needs.
const POLLS: usize = 3000;

fn grant(region: &str, conn: &str, ttl: Option<Duration>) -> pb::GrantRequest {
    pb::GrantRequest {
        notify: None,
        region: region.into(),
        offset: 0,
        length: LEN as u64,
        op: pb::Access::Write as i32,
        ttl: ttl.map(|t| prost_types::Duration { seconds: t.as_secs() as i64, nanos: t.subsec_nanos() as i32 }),
        node_name: "node-a".into(),
        connection_id: conn.into(),
    }
}

/// A WRITE header (ACK requested) for `len` bytes at `addr`, as `raw_write` sends it.
fn write_header(s: &mut TcpStream, token: [u8; 16], addr: u64, len: usize) {
    s.write_all(&frame_header(Kind::Write, frame::ACK_REQUESTED, 7, token, addr, len as u32)).unwrap();
}

/// Sends what is left of the payload; the agent may have closed the stream (an error is fine).
fn send_rest(s: &mut TcpStream, rest: &[u8]) {
    s.set_write_timeout(Some(READ_GUARD)).unwrap();
    let _ = s.write_all(rest);
    let _ = s.flush();
}

/// The stream ends (EOF or reset) or answers with a NAK; never an ACK, never silence (a read
/// that runs into the hang guard fails).
fn expect_closed_or_nak(s: &mut TcpStream, what: &str) {
    s.set_read_timeout(Some(READ_GUARD)).unwrap();
    let mut r = [0u8; frame::HEADER_LEN];
    let mut got = 0;
    loop {
        match s.read(&mut r[got..]) {
            Ok(0) => return,
            Ok(n) => {
                got += n;
                if got == r.len() {
                    let h = Header::decode(&r).unwrap();
                    assert_eq!(h.kind, Kind::Nak, "{what}: expected the stream closed or a NAK, got {h:?}");
                    assert_ne!(h.status, 0, "{what}: a NAK carries an error status");
                    return;
                }
            }
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                panic!("{what}: the stream is still open and silent: {e}")
            }
            Err(_) => return, // reset: closed
        }
    }
}

/// Waits (a bounded number of polls) until `read()` shows the first `PART` bytes of `payload`:
/// the frame passed the grant check and its payload is being stored.
async fn wait_landed<F, Fut>(payload: &[u8], mut read: F, what: &str)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Vec<u8>>,
{
    for _ in 0..POLLS {
        if read().await[..PART] == payload[..PART] {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what}: the first {PART} payload bytes never landed");
}

/// Waits (a bounded number of polls) until the agent's metrics contain `needle`: the counter is
/// bumped just after the stream's socket is closed.
async fn wait_metric(a: &Agent, needle: &str) {
    for _ in 0..POLLS {
        if scrape(a).contains(needle) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("metrics never showed {needle:?}:\n{}", scrape(a));
}

fn metric(text: &str, line_prefix: &str) -> Option<f64> {
    text.lines().find(|l| l.starts_with(line_prefix)).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok())
}

/// An anonymous region filled with known bytes, a WRITE grant over all of it on connection `c1`,
/// and a data stream of that connection with a WRITE header and `PART` payload bytes sent, which
/// the agent has stored (so the frame is in flight when this returns). Also the data session
/// (address, secret), for more streams.
struct InFlight {
    before: Vec<u8>,
    payload: Vec<u8>,
    grant: pb::GrantResponse,
    stream: TcpStream,
    session: (String, Vec<u8>),
}

async fn in_flight(a: &Agent, ttl: Option<Duration>) -> InFlight {
    a.create("dst", LEN as u64, pb::Access::ReadWrite).await;
    let before = random_bytes(LEN, 1);
    a.put("dst", 0, &before).await;
    let session = a.data_session("c1").await;
    let mut s = open_data_stream(&session.0, "c1", &session.1);
    let g = a.peer_client().await.grant(grant("dst", "c1", ttl)).await.unwrap().into_inner();
    let payload = random_bytes(LEN, 2);
    write_header(&mut s, g.token.as_slice().try_into().unwrap(), g.addr, LEN);
    s.write_all(&payload[..PART]).unwrap();
    wait_landed(&payload, || a.read("dst", 0, PART as u64), "in flight").await;
    InFlight { before, payload, grant: g, stream: s, session }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_revoke_returns_no_byte_of_an_in_flight_write_lands() {
    let a = Agent::start("node-b");
    let InFlight { before, payload, grant: g, stream: mut s, .. } = in_flight(&a, None).await;

    a.peer_client().await.revoke(pb::RevokeRequest { grant_id: g.grant_id.clone() }).await.unwrap();
    send_rest(&mut s, &payload[PART..]);
    expect_closed_or_nak(&mut s, "revoked mid-payload");

    let now = a.read("dst", 0, LEN as u64).await;
    assert!(now[PART..] == before[PART..], "bytes landed after Revoke returned");
    wait_metric(&a, "xfer_data_connections_closed_total{reason=\"revoked\"} 1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_expiry_no_byte_of_an_in_flight_write_lands() {
    let a = Agent::start("node-b");
    let InFlight { before, payload, stream: mut s, .. } = in_flight(&a, Some(Duration::from_secs(3))).await;

    // The reaper removes the grant: polled, not timed.
    let mut gone = false;
    for _ in 0..POLLS {
        if metric(&scrape(&a), "xfer_grants_active ") == Some(0.0) {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(gone, "the grant never expired");
    send_rest(&mut s, &payload[PART..]);
    expect_closed_or_nak(&mut s, "expired mid-payload");

    let now = a.read("dst", 0, LEN as u64).await;
    assert!(now[PART..] == before[PART..], "bytes landed after the grant expired");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_delete_region_returns_no_byte_of_an_in_flight_write_lands_in_the_file() {
    let a = Agent::start("node-b");
    let file = a.state_dir.join("files").join("victim.bin");
    let before = random_bytes(LEN, 3);
    std::fs::write(&file, &before).unwrap();
    let mut c = a.client().await;
    c.create_region(pb::CreateRegionRequest {
        name: "victim".into(),
        length: LEN as u64,
        kind: pb::RegionKind::File as i32,
        path: "victim.bin".into(),
        access: pb::Access::ReadWrite as i32,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut s = a.data_stream("c1").await;
    let g = a.peer_client().await.grant(grant("victim", "c1", None)).await.unwrap().into_inner();
    let payload = random_bytes(LEN, 4);
    write_header(&mut s, g.token.as_slice().try_into().unwrap(), g.addr, LEN);
    s.write_all(&payload[..PART]).unwrap();
    let f = file.clone();
    wait_landed(&payload, || std::future::ready(std::fs::read(&f).unwrap()), "in flight to the file").await;

    c.delete_region(pb::DeleteRegionRequest { name: "victim".into() }).await.unwrap();
    send_rest(&mut s, &payload[PART..]);
    expect_closed_or_nak(&mut s, "region deleted mid-payload");

    let now = std::fs::read(&file).unwrap();
    assert_eq!(now.len(), LEN);
    assert!(now[PART..] == before[PART..], "bytes landed in the file after DeleteRegion returned");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_stalled_past_data_payload_timeout_closes_its_stream() {
    let a = Agent::start_env("node-b", &[("XFER_LIMITS__DATA_PAYLOAD_TIMEOUT", "300ms")]);
    let InFlight { before, payload, grant: g, stream: mut s, session } = in_flight(&a, None).await;

    // Stalled: the agent closes the stream without an ACK. The read's hang guard is far below
    // limits.data_idle_timeout (300 s), so the close is the payload timeout's.
    s.set_read_timeout(Some(READ_GUARD)).unwrap();
    let mut r = [0u8; frame::HEADER_LEN];
    match s.read(&mut r) {
        Ok(0) => {}
        other => panic!("expected EOF after limits.data_payload_timeout, got {other:?}"),
    }
    send_rest(&mut s, &payload[PART..]);

    let now = a.read("dst", 0, LEN as u64).await;
    assert!(now[PART..] == before[PART..], "bytes after the stall landed");
    wait_metric(&a, "xfer_data_connections_closed_total{reason=\"payload\"} 1").await;
    // The grant itself is untouched: a whole frame on a new stream still lands.
    let mut s2 = open_data_stream(&session.0, "c1", &session.1);
    assert_eq!(raw_write(&mut s2, g.token.as_slice().try_into().unwrap(), g.addr, &payload), (0, Kind::Ack), "ACK");
    assert!(a.read("dst", 0, LEN as u64).await == payload);
}
