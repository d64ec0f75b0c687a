//! Red team of batches and target notifications (SECURITY.md promise 10): a peer (in plaintext
//! mode any caller of `xfer.v1.Peer`), a client or a local process trying to get a notification
//! published for a grant that is not theirs, for a batch that failed or was revoked, twice, or
//! before the bytes; to wedge the agent with markers, tags and grants; or to escape the
//! subscribers' filters. Real agents on the tcp fabric driven by raw frames and gRPC, plus an
//! in-process `Node` where a race has to be pinned down.
//!
//! Absence of a notification is never shown by waiting: a valid notification is produced
//! afterwards, and the subscriber's *first* message must be that one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::time::Duration;

use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

const REM_INV_REQ_ERR: u16 = 9;
const REM_ACCESS_ERR: u16 = 10;
const MIB: u64 = 1 << 20;

/// `Peer.Grant` with a notification ask, on connection `conn`.
fn notify_grant_req(region: &str, offset: u64, len: u64, op: pb::Access, conn: &str, tag: &[u8], markers: u32) -> pb::GrantRequest {
    pb::GrantRequest {
        notify: Some(pb::NotifyRequest { tag: tag.to_vec(), markers, channel: false }),
        region: region.into(),
        offset,
        length: len,
        op: op as i32,
        ttl: None,
        node_name: "declared".into(),
        connection_id: conn.into(),
    }
}

async fn grant(a: &Agent, req: pb::GrantRequest) -> Result<pb::GrantResponse, tonic::Status> {
    a.peer_client().await.grant(req).await.map(|r| r.into_inner())
}

/// Sends a NOTIFY frame (`ack`: with ACK_REQUESTED); reads one answer: (status, kind, id).
fn notify_and_read(s: &mut std::net::TcpStream, tok: [u8; 16], id: u64, ack: bool) -> (u16, Kind, u64) {
    s.write_all(&frame_header(Kind::Notify, u8::from(ack), id, tok, 0, 0)).unwrap();
    read_frame_answer(s)
}

/// A fresh notification with `tag` on `region` via `Peer.Complete` (connection `conn`): the
/// ordering probe that follows every refusal.
async fn probe(a: &Agent, region: &str, conn: &str, tag: &[u8]) {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let g = grant(a, notify_grant_req(region, 0, 4096, pb::Access::Write, conn, tag, 1)).await.unwrap();
    let id = format!("probe-{}", N.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    a.peer_client().await.complete(complete_req(&g.grant_id, &id, 4096, "x")).await.unwrap();
}

/// Markers on another connection of the same identity, on a token that never was, under a
/// grant without a notification, and under a revoked grant: every one NAKed, none published.
/// The valid marker sent after them is the subscriber's first notification; a second marker and
/// the grantee's `Peer.Complete` do not publish it again.
#[tokio::test]
async fn markers_count_only_on_their_connection_under_a_live_grant_and_publish_once() {
    let b = Agent::start("node-b");
    b.create("dst", MIB, pb::Access::ReadWrite).await;
    let before = random_bytes(MIB as usize, 1);
    b.put("dst", 0, &before).await;
    let mut notes = subscribe(&b, "", None).await;
    let mut s1 = b.data_stream("c1").await;
    let mut s2 = b.data_stream("c2").await;
    let good = grant(&b, notify_grant_req("dst", 0, 4096, pb::Access::Write, "c1", b"good", 1)).await.unwrap();
    assert_ne!(good.notify_slot, 0);
    let plain = grant(&b, grant_req("dst", "x", "c1", pb::Access::Write)).await.unwrap();
    let revoked = grant(&b, notify_grant_req("dst", 0, 4096, pb::Access::Write, "c1", b"revoked", 1)).await.unwrap();
    b.peer_client().await.revoke(pb::RevokeRequest { grant_id: revoked.grant_id.clone() }).await.unwrap();
    assert_eq!(gauge(&b, "xfer_grants_active"), 2.0);

    // The good grant's token on the other connection's stream (same identity).
    assert_eq!(notify_and_read(&mut s2, token_of(&good), 1, true), (REM_ACCESS_ERR, Kind::Nak, 1), "another connection's stream");
    // Refused markers are NAKed even without ACK_REQUESTED.
    assert_eq!(notify_and_read(&mut s2, token_of(&good), 2, false), (REM_ACCESS_ERR, Kind::Nak, 2), "unacked, other connection");
    assert_eq!(notify_and_read(&mut s1, [0x5a; 16], 3, true), (REM_ACCESS_ERR, Kind::Nak, 3), "a token that never was");
    assert_eq!(notify_and_read(&mut s1, token_of(&plain), 4, true), (REM_INV_REQ_ERR, Kind::Nak, 4), "a grant without a notification");
    assert_eq!(notify_and_read(&mut s1, token_of(&revoked), 5, true), (REM_ACCESS_ERR, Kind::Nak, 5), "a revoked grant");
    assert_eq!(notify_markers(&b, "counted"), 0.0);

    // The real one, then a duplicate.
    assert_eq!(notify_and_read(&mut s1, token_of(&good), 6, true), (0, Kind::Ack, 6));
    let n = next_note(&mut notes).await;
    assert_eq!(
        (n.tag.as_slice(), n.via.as_str(), n.region.as_str()),
        (&b"good"[..], "fabric", "dst"),
        "the first notification is the valid one: {n:?}"
    );
    assert_eq!(notify_and_read(&mut s1, token_of(&good), 7, true), (0, Kind::Ack, 7), "a duplicate marker is counted");
    b.peer_client().await.complete(complete_req(&good.grant_id, "t-good", 4096, "x")).await.unwrap();
    // Once completed, the grant is gone: a late marker is refused.
    assert_eq!(notify_and_read(&mut s1, token_of(&good), 8, true), (REM_ACCESS_ERR, Kind::Nak, 8));
    probe(&b, "dst", "c1", b"next").await;
    let n = next_note(&mut notes).await;
    assert_eq!(n.tag, b"next", "published twice: {n:?}");

    assert!(b.read("dst", 0, MIB).await == before, "no byte changed");
    assert_eq!(gauge(&b, "xfer_grants_active"), 1.0, "only the plain grant is left");
    assert_eq!(notify_markers(&b, "counted"), 2.0);
    assert!(notify_markers(&b, "refused") >= 5.0, "{}", scrape(&b));
    assert_eq!(notify_markers(&b, "no_notification"), 1.0);
}

/// `GrantRequest.notify` is checked before anything is exposed: 0 or 65 markers, a tag over
/// `transfer.max_notify_bytes`, no connection, an unknown connection; a grant per peer past
/// `limits.max_grants_per_peer` is refused whether or not it asks for a notification. None of
/// them leaves a grant behind.
#[tokio::test]
async fn notification_asks_are_bounded_and_leave_nothing() {
    let b = Agent::start_env("node-b", &[("XFER_TRANSFER__MAX_NOTIFY_BYTES", "16"), ("XFER_LIMITS__MAX_GRANTS_PER_PEER", "3")]);
    b.create("dst", MIB, pb::Access::ReadWrite).await;
    b.data_session("c1").await;
    let req = |tag: &[u8], markers: u32, conn: &str| notify_grant_req("dst", 0, 4096, pb::Access::Write, conn, tag, markers);
    let cases: Vec<(&str, pb::GrantRequest, Code, &str)> = vec![
        ("0 markers", req(b"t", 0, "c1"), Code::InvalidArgument, "0 markers"),
        ("65 markers", req(b"t", 65, "c1"), Code::InvalidArgument, "65 markers"),
        ("u32::MAX markers", req(b"t", u32::MAX, "c1"), Code::InvalidArgument, "1..=64"),
        ("a 17-byte tag", req(&[b'x'; 17], 1, "c1"), Code::InvalidArgument, "at most 16"),
        ("a 1 MiB tag", req(&vec![b'x'; 1 << 20], 1, "c1"), Code::InvalidArgument, "at most 16"),
        ("no connection", req(b"t", 1, ""), Code::FailedPrecondition, "connection_id"),
    ];
    let mut p = b.peer_client().await;
    for (what, r, code, says) in cases {
        let e = p.grant(r).await.expect_err(what);
        assert_eq!(e.code(), code, "{what}: {e:?}");
        assert!(e.message().contains(says), "{what}: {:?} does not say {says:?}", e.message());
    }
    let e = p.grant(req(b"t", 1, "nobody")).await.expect_err("unknown connection");
    assert_ne!(e.code(), Code::Ok);
    assert_eq!(gauge(&b, "xfer_grants_active"), 0.0);
    // At the edges: 64 markers and a 16-byte tag are fine; the per-peer limit counts them.
    let mut slots = std::collections::HashSet::new();
    for i in 0..3u8 {
        let g = p.grant(req(&[b'a' + i; 16], 64, "c1")).await.unwrap().into_inner();
        assert!(slots.insert(g.notify_slot) && g.notify_slot != 0, "slots are distinct and non-zero");
    }
    let e = p.grant(req(b"t", 1, "c1")).await.expect_err("past max_grants_per_peer");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert_eq!(gauge(&b, "xfer_grants_active"), 3.0);
    // A tag filter longer than any tag is refused, and so is an unknown region.
    let mut c = b.client().await;
    let e = c.watch_inbound(pb::WatchInboundRequest { region: String::new(), tag: Some(vec![0; 17]) }).await.expect_err("long filter");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = c.watch_inbound(pb::WatchInboundRequest { region: "nope".into(), tag: None }).await.expect_err("unknown region");
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
}

/// A NOTIFY carrying a payload length cannot be resynchronised: NAKed and the stream closed,
/// nothing published. A flood of unacknowledged markers on a live grant publishes it once and
/// keeps the stream in order (the ACKed marker behind the flood answers); a flood of refused
/// markers is answered one NAK each and costs nothing else.
#[tokio::test]
async fn malformed_and_flooded_notify_frames() {
    let b = Agent::start("node-b");
    let c1 = DataSession::of(&b, "c1").await;
    b.create("dst", MIB, pb::Access::ReadWrite).await;
    let mut notes = subscribe(&b, "dst", None).await;
    let mut s = c1.open();
    let g = grant(&b, notify_grant_req("dst", 0, 4096, pb::Access::Write, "c1", b"flood", 2)).await.unwrap();
    // A length on a NOTIFY: NAK REM_INV_REQ_ERR (frame id 0: the header did not decode), EOF.
    s.write_all(&frame_header(Kind::Notify, 1, 9, token_of(&g), 0, 5)).unwrap();
    s.write_all(&[0; 5]).unwrap();
    assert_eq!(read_frame_answer(&mut s), (REM_INV_REQ_ERR, Kind::Nak, 0));
    assert_closed(&mut s, "a NOTIFY with a length");
    assert_eq!(notify_markers(&b, "counted"), 0.0);

    // 2,000 refused markers (a token that never was, no ACK asked): one NAK each.
    let mut s = c1.open();
    let mut flood = Vec::new();
    for i in 0..2000u64 {
        flood.extend_from_slice(&frame_header(Kind::Notify, 0, i, [7; 16], 0, 0));
    }
    s.write_all(&flood).unwrap();
    for i in 0..2000u64 {
        assert_eq!(read_frame_answer(&mut s), (REM_ACCESS_ERR, Kind::Nak, i));
    }
    // 10,000 unacknowledged markers on the live grant (2 expected), then one with ACK.
    let mut flood = Vec::new();
    for i in 0..10_000u64 {
        flood.extend_from_slice(&frame_header(Kind::Notify, 0, i, token_of(&g), 0, 0));
    }
    flood.extend_from_slice(&frame_header(Kind::Notify, 1, 77_777, token_of(&g), 0, 0));
    s.write_all(&flood).unwrap();
    assert_eq!(read_frame_answer(&mut s), (0, Kind::Ack, 77_777), "no answer to unacked markers, in order");
    let n = next_note(&mut notes).await;
    assert_eq!((n.tag.as_slice(), n.via.as_str()), (&b"flood"[..], "fabric"));
    b.peer_client().await.complete(complete_req(&g.grant_id, "t-flood", 4096, "x")).await.unwrap();
    probe(&b, "dst", "c1", b"after").await;
    assert_eq!(next_note(&mut notes).await.tag, b"after", "the flood published once");
    assert_eq!(notify_markers(&b, "counted"), 10_001.0);
    assert_eq!(gauge(&b, "xfer_grants_active"), 0.0);
}

/// NOTIFY under a READ grant counts (a READ batch tells the target its blocks were read: the
/// notification says op READ) and reaches nothing else: no byte changes.
#[tokio::test]
async fn a_marker_under_a_read_grant_says_read_and_changes_nothing() {
    let b = Agent::start("node-b");
    let c1 = DataSession::of(&b, "c1").await;
    b.create("pool", MIB, pb::Access::Read).await;
    let bytes = random_bytes(MIB as usize, 3);
    b.put("pool", 0, &bytes).await;
    let mut notes = subscribe(&b, "pool", None).await;
    let mut s = c1.open();
    let g = grant(&b, notify_grant_req("pool", 4096, 8192, pb::Access::Read, "c1", b"rd", 1)).await.unwrap();
    // A WRITE under the READ grant's token is refused; the marker still counts (it is the
    // grantee's to send).
    assert_eq!(raw_write(&mut s, token_of(&g), g.addr, &[0xee; 64]), (REM_ACCESS_ERR, Kind::Nak));
    let mut s = c1.open();
    let (status, _, data) = raw_read(&mut s, token_of(&g), g.addr, 8192);
    assert_eq!(status, 0);
    assert!(data == bytes[4096..4096 + 8192]);
    assert_eq!(notify_and_read(&mut s, token_of(&g), 1, true), (0, Kind::Ack, 1));
    let n = next_note(&mut notes).await;
    assert_eq!((n.tag.as_slice(), n.op, n.offset, n.length), (&b"rd"[..], pb::Op::Read as i32, 4096, 8192));
    assert!(b.read("pool", 0, MIB).await == bytes);
}

/// RC semantics on the tcp fabric: a work request the target refuses puts the QP in error, and
/// nothing behind it on that QP executes — in particular not a notification marker. The tcp
/// target serves on after a NAK (the stream stays in sync), so a marker pipelined behind a
/// refused WRITE must still not count: an honest initiator sends its markers right behind its
/// data (`Markers::Pipelined`), and when a WRITE is NAKed (the region's file shrank under it,
/// so the page is poisoned) the batch fails — its notification must not be published.
#[tokio::test]
async fn a_marker_behind_a_refused_write_on_its_stream_does_not_count() {
    let b = Agent::start("node-b");
    let c1 = DataSession::of(&b, "c1").await;
    std::fs::write(root_of(&b).join("wr.bin"), random_bytes(MIB as usize, 4)).unwrap();
    b.client().await.create_region(file_region_req("wr", MIB, "wr.bin", pb::Access::ReadWrite)).await.unwrap();
    b.create("dst", MIB, pb::Access::ReadWrite).await;
    let mut notes = subscribe(&b, "", None).await;
    let mut s = c1.open();
    let failed = grant(&b, notify_grant_req("wr", 0, MIB, pb::Access::Write, "c1", b"failed", 1)).await.unwrap();
    let outside = grant(&b, notify_grant_req("dst", 0, 4096, pb::Access::Write, "c1", b"outside", 1)).await.unwrap();
    // The file shrinks after the grant: the next WRITE into it is refused.
    std::fs::OpenOptions::new().write(true).open(root_of(&b).join("wr.bin")).unwrap().set_len(0).unwrap();
    // The initiator's pipeline: WRITE (ACK asked), then the marker, without waiting.
    let mut w = frame_header(Kind::Write, frame::ACK_REQUESTED, 1, token_of(&failed), failed.addr, 4096).to_vec();
    w.extend_from_slice(&[0xab; 4096]);
    w.extend_from_slice(&frame_header(Kind::Notify, 1, 2, token_of(&failed), 0, 0));
    s.write_all(&w).unwrap();
    assert_eq!(read_frame_answer(&mut s), (REM_ACCESS_ERR, Kind::Nak, 1), "the WRITE into the shrunk file");
    let (status, kind, id) = read_frame_answer(&mut s);
    assert_eq!((kind, id), (Kind::Nak, 2), "the marker behind a refused WRITE was acknowledged (status {status})");
    // Same on another region: a WRITE past its grant, then a marker.
    let mut s = c1.open();
    let mut w = frame_header(Kind::Write, frame::ACK_REQUESTED, 3, token_of(&outside), outside.addr + 4096, 16).to_vec();
    w.extend_from_slice(&[0xcd; 16]);
    w.extend_from_slice(&frame_header(Kind::Notify, 1, 4, token_of(&outside), 0, 0));
    s.write_all(&w).unwrap();
    assert_eq!(read_frame_answer(&mut s), (REM_ACCESS_ERR, Kind::Nak, 3));
    assert_eq!(read_frame_answer(&mut s).1, Kind::Nak, "the marker behind a WRITE past the grant");
    // A READ the target refuses stops the stream's markers just the same.
    let mut s = c1.open();
    let mut w = frame_header(Kind::ReadReq, 0, 5, [9; 16], 0, 16).to_vec();
    w.extend_from_slice(&frame_header(Kind::Notify, 1, 6, token_of(&outside), 0, 0));
    s.write_all(&w).unwrap();
    assert_eq!(read_frame_answer(&mut s), (REM_ACCESS_ERR, Kind::ReadResp, 5), "READ_RESP with an error status");
    assert_eq!(read_frame_answer(&mut s).1, Kind::Nak, "the marker behind a refused READ");

    // Neither was published: the next notification is the probe's.
    probe(&b, "dst", "c1", b"probe").await;
    assert_eq!(next_note(&mut notes).await.tag, b"probe");
    // A fresh stream of the same connection, with nothing refused on it, still counts markers.
    let mut s = c1.open();
    assert_eq!(notify_and_read(&mut s, token_of(&outside), 7, true), (0, Kind::Ack, 7));
    assert_eq!(next_note(&mut notes).await.tag, b"outside");
    assert!(b.read("dst", 0, MIB).await.iter().all(|&x| x == 0), "no byte of dst changed");
}

/// A grant that expired (reaped) takes its notification with it: its marker is NAKed and its
/// `Peer.Complete` refused, nothing published.
#[tokio::test]
async fn an_expired_grant_publishes_nothing() {
    let b = Agent::start("node-b");
    b.create("dst", MIB, pb::Access::ReadWrite).await;
    let mut notes = subscribe(&b, "dst", None).await;
    let mut s = b.data_stream("c1").await;
    let mut req = notify_grant_req("dst", 0, 4096, pb::Access::Write, "c1", b"expired", 1);
    req.ttl = Some(prost_types::Duration { seconds: 1, nanos: 0 });
    let g = grant(&b, req).await.unwrap();
    // The reaper removes it (waiting for the gauge, not for a time).
    wait_gauge(&b, "xfer_grants_active", 0.0).await;
    assert_eq!(notify_and_read(&mut s, token_of(&g), 1, true), (REM_ACCESS_ERR, Kind::Nak, 1));
    let e = b.peer_client().await.complete(complete_req(&g.grant_id, "t-exp", 4096, "x")).await.expect_err("expired");
    assert_ne!(e.code(), Code::Ok);
    probe(&b, "dst", "c1", b"probe").await;
    assert_eq!(next_note(&mut notes).await.tag, b"probe");
}

/// The subscribers' filters: by region (name or id, resolved once) and by exact tag. A
/// notification on another region or with a longer/shorter tag is never delivered: the filtered
/// subscriber's first message is the matching one produced after the others.
#[tokio::test]
async fn region_and_tag_filters_hold() {
    let b = Agent::start("node-b");
    let r1 = b.create("r1", MIB, pb::Access::ReadWrite).await;
    b.create("r2", MIB, pb::Access::ReadWrite).await;
    b.data_session("c1").await;
    let mut by_name = subscribe(&b, "r1", None).await;
    let mut by_id = subscribe(&b, &r1.id, None).await;
    let mut by_tag = subscribe(&b, "", Some(b"ab")).await;
    probe(&b, "r2", "c1", b"ab").await; // another region
    probe(&b, "r1", "c1", b"abc").await; // a longer tag
    probe(&b, "r1", "c1", b"a").await; // a shorter tag
    probe(&b, "r1", "c1", b"").await; // no tag
    probe(&b, "r1", "c1", b"ab").await;
    let n = next_note(&mut by_name).await;
    assert_eq!((n.region.as_str(), n.tag.as_slice()), ("r1", &b"abc"[..]));
    assert_eq!(next_note(&mut by_id).await.tag, b"abc");
    let n = next_note(&mut by_tag).await;
    assert_eq!((n.region.as_str(), n.tag.as_slice()), ("r2", &b"ab"[..]));
    let n = next_note(&mut by_tag).await;
    assert_eq!((n.region.as_str(), n.tag.as_slice()), ("r1", &b"ab"[..]), "only exact tags");

    // Delete and recreate r1: a subscriber that named it follows the region it resolved, never
    // the new one under the same name (which a new subscriber sees).
    b.client().await.delete_region(pb::DeleteRegionRequest { name: "r1".into() }).await.unwrap();
    b.create("r1", MIB, pb::Access::ReadWrite).await;
    let mut new = subscribe(&b, "r1", None).await;
    probe(&b, "r1", "c1", b"new").await;
    assert_eq!(next_note(&mut new).await.tag, b"new");
    // The old subscribers' streams end with the agent: nothing more was delivered to them
    // (their backlog held the first three probes; what follows must not be "new").
    drop(b);
    for s in [&mut by_name, &mut by_id] {
        let mut seen = Vec::new();
        // To its end: a stream still open after the guard fails, never passes with what it had.
        while let Ok(Some(n)) = tokio::time::timeout(Duration::from_secs(30), s.message()).await.expect("the stream ends with the agent") {
            seen.push(n.tag);
        }
        assert!(!seen.iter().any(|t| t == b"new"), "the old filter followed the name to a new region: {seen:?}");
    }
}

/// What a batch can reach: its grant spans exactly its remote range, so segments whose span
/// passes the target's region (one byte past, near `u64::MAX`, or contiguous ones that coalesce
/// past the end) are refused and leave no grant; the same shape inside the region lands and
/// leaves the gap between its segments untouched.
#[tokio::test]
async fn a_batch_reaches_no_byte_past_its_span() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    a.create("src", MIB, pb::Access::ReadWrite).await;
    a.put("src", 0, &random_bytes(MIB as usize, 8)).await;
    b.create("small", 64 << 10, pb::Access::ReadWrite).await;
    let before = random_bytes(64 << 10, 9);
    b.put("small", 0, &before).await;
    let mut notes = subscribe(&b, "small", None).await;
    let seg = |l: u64, r: u64, n: u64| pb::Segment { local_offset: l, remote_offset: r, length: n };
    let req = |segments: Vec<pb::Segment>, tag: &[u8]| pb::SubmitTransferRequest {
        op: pb::Op::Write as i32,
        local: Some(pb::LocalRange { region: "src".into(), offset: 0 }),
        remote: Some(pb::RemoteRange { agent: b.addr(), region: "small".into(), offset: 0 }),
        length: None,
        options: None,
        segments,
        notify: Some(tag.to_vec()),
    };
    let mut c = a.client().await;
    // Each segment alone fits; the span from the lowest to the highest does not.
    for (what, segs) in [
        ("a span one byte past the region", vec![seg(0, 0, 16), seg(100, (64 << 10) - 15, 16)]),
        ("a segment near u64::MAX", vec![seg(0, 0, 16), seg(100, u64::MAX - 16, 16)]),
        ("contiguous segments that coalesce past the end", vec![seg(0, (64 << 10) - 32, 32), seg(32, 64 << 10, 32)]),
    ] {
        let e = c.submit_transfer(req(segs, b"bad")).await.expect_err(what);
        assert!(matches!(e.code(), Code::InvalidArgument | Code::OutOfRange), "{what}: {e:?}");
    }
    wait_gauge(&b, "xfer_grants_active", 0.0).await;
    assert!(b.read("small", 0, 64 << 10).await == before);
    // The same shape inside the region lands, and its notification is the first.
    let t = a.transfer(req(vec![seg(0, 0, 16), seg(100, (64 << 10) - 16, 16)], b"ok")).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert_eq!(next_note(&mut notes).await.tag, b"ok");
    let after = b.read("small", 0, 64 << 10).await;
    assert!(after[16..(64 << 10) - 16] == before[16..(64 << 10) - 16], "the gap between the segments is untouched");
}

/// `Peer.Complete` racing a revocation. The target revokes a grant (here `DeleteRegion`; a
/// disconnect, expiry or the grantee's own revoke are the same) while the grantee's Complete is
/// verifying its checksum: once the revocation has returned, the grant's notification must not
/// be published — it would announce bytes of a region that no longer exists (and whose name a
/// new region may already carry). Pinned down in-process: the blocking pool has one thread, held
/// busy, so the Complete is parked at its checksum while the region is deleted.
#[test]
fn a_complete_racing_a_revocation_publishes_nothing() {
    use std::sync::Arc;
    use xfer_agent::config::Config;
    use xfer_agent::grants::GrantTable;
    use xfer_agent::node::{GrantParams, InboundEnd, Node};
    use xfer_agent::regions::RegionSpec;
    use xfer_engine::ids::{ConnectionId, TransferId};
    use xfer_fabric::tcp::TcpFabric;
    use xfer_fabric::{Access, Fabric, FabricKind, RemoteOp};

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().max_blocking_threads(1).build().unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config { node_name: "b".into(), state_dir: dir.path().to_path_buf(), ..Config::default() };
        let grants = Arc::new(GrantTable::new(64));
        let fabric: Arc<dyn Fabric> = Arc::new(TcpFabric::bind("127.0.0.1:0".parse().unwrap(), grants.clone(), None).await.unwrap());
        let node = Node::new(cfg, fabric, "test".into(), grants.clone(), xfer_agent::service::client::connector(None));
        let conn = ConnectionId::parse("c1").unwrap();
        node.accept_connection("a", &conn, FabricKind::Tcp, &[]).await.unwrap();
        node.create_region(RegionSpec::anonymous("doomed", MIB, Access::ReadWrite)).unwrap();
        node.create_region(RegionSpec::anonymous("other", MIB, Access::ReadWrite)).unwrap();
        let ask = |region: &str, tag: &[u8]| GrantParams {
            notify: Some(xfer_agent::node::NotifyAsk::Once { tag: tag.to_vec(), markers: 1 }),
            region: region.into(),
            offset: 0,
            length: 4096,
            op: RemoteOp::Write,
            ttl: None,
            peer: "a".into(),
            connection_id: Some(conn.clone()),
        };
        let doomed = node.grant(&ask("doomed", b"doomed")).await.unwrap();
        let mut rx = grants.hub().subscribe();

        // Hold the only blocking thread.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
        let blocker = tokio::task::spawn_blocking(move || {
            started_tx.send(()).unwrap();
            let _ = held.recv();
        });
        started_rx.recv().unwrap();
        let tid = TransferId::parse("t-doomed").unwrap();
        let checksum = xfer_agent::checksum::checksum(&doomed.region.memory, 0, 4096, xfer_agent::checksum::Algo::Xxh3).unwrap();
        let mut complete = Box::pin(node.complete_inbound(
            &tid,
            doomed.id.as_str(),
            "a",
            InboundEnd { bytes: 4096, op_write: true, checksum: Some((xfer_agent::checksum::Algo::Xxh3, checksum)), spans: &[] },
        ));
        // One poll: the grant is looked up, the checksum queued behind the blocker.
        assert!(futures::poll!(complete.as_mut()).is_pending(), "Complete is parked at its checksum");
        node.delete_region("doomed").unwrap();
        assert_eq!(grants.len(), 0, "the delete revoked the grant");
        release.send(()).unwrap();
        blocker.await.unwrap();
        let _ = complete.await;

        // The probe: a valid Complete on another region.
        let other = node.grant(&ask("other", b"probe")).await.unwrap();
        node.complete_inbound(
            &TransferId::parse("t-probe").unwrap(),
            other.id.as_str(),
            "a",
            InboundEnd { bytes: 4096, op_write: true, checksum: None, spans: &[] },
        )
        .await
        .unwrap();
        let n = rx.recv().await.unwrap();
        assert_eq!(n.tag, b"probe", "a notification was published for a grant revoked before its Complete finished: {n:?}");
        assert_eq!(grants.len(), 0);
    });
}

/// A disconnect and a `DeleteRegion` revoke their grants' notifications: the disconnected
/// connection's stream is closed (its marker never answered), a later Complete on either grant
/// is refused, and nothing is published (the probe is the first notification). Recreating the
/// region under the same name does not revive the old grant.
#[tokio::test]
async fn disconnect_and_delete_take_their_notifications_with_them() {
    let b = Agent::start("node-b");
    b.create("dst", MIB, pb::Access::ReadWrite).await;
    b.create("other", MIB, pb::Access::ReadWrite).await;
    let mut notes = subscribe(&b, "", None).await;
    let c1 = DataSession::of(&b, "c1").await;
    let mut s = c1.open();
    DataSession::of(&b, "c2").await;
    let by_conn = grant(&b, notify_grant_req("dst", 0, 4096, pb::Access::Write, "c1", b"disconnected", 1)).await.unwrap();
    let by_region = grant(&b, notify_grant_req("dst", 0, 4096, pb::Access::Write, "c2", b"deleted", 1)).await.unwrap();
    assert_eq!(gauge(&b, "xfer_grants_active"), 2.0);
    b.peer_client().await.disconnect(pb::DisconnectRequest { connection_id: "c1".into(), node_name: "x".into() }).await.unwrap();
    // The session's streams are being closed and the grant is gone: a marker gets EOF (or a
    // reset), or at most a NAK if the stream served it before closing — never an ACK.
    let _ = s.write_all(&frame_header(Kind::Notify, 1, 1, token_of(&by_conn), 0, 0));
    let mut r = [0u8; frame::HEADER_LEN];
    if s.read_exact(&mut r).is_ok() {
        let h = Header::decode(&r).unwrap();
        assert_eq!((h.status, h.kind), (REM_ACCESS_ERR, Kind::Nak), "a disconnected connection's marker");
    }
    b.client().await.delete_region(pb::DeleteRegionRequest { name: "dst".into() }).await.unwrap();
    b.create("dst", MIB, pb::Access::ReadWrite).await;
    assert_eq!(gauge(&b, "xfer_grants_active"), 0.0);
    for (g, id) in [(&by_conn, "t-conn"), (&by_region, "t-region")] {
        let e = b.peer_client().await.complete(complete_req(&g.grant_id, id, 4096, "x")).await.expect_err(id);
        assert_eq!(e.code(), Code::NotFound, "{id}: {e:?}");
    }
    // The old token on the surviving connection's stream: refused.
    let mut s2 = DataSession::of(&b, "c3").await.open();
    assert_eq!(notify_and_read(&mut s2, token_of(&by_region), 2, true), (REM_ACCESS_ERR, Kind::Nak, 2));
    probe(&b, "other", "c2", b"probe").await;
    assert_eq!(next_note(&mut notes).await.tag, b"probe");
}
