//! Red team of channels (`Agent.OpenChannel`, `Peer.Announce`, channel markers): real agents on
//! the tcp fabric driven by gRPC and by raw data-stream frames (plain and mTLS). Every attack
//! asserts its refusal and that nothing else changed: the target's bytes, the notifications
//! published (absence is never shown by waiting: a valid notification is produced afterwards and
//! must be the subscriber's next one), the grants held and the gauges, and that the legitimate
//! channel or grant still works.
//!
//! Attacks:
//! 1. `Peer.Announce`
//!    - on another identity's channel grant (mTLS, node-c on node-a's grant), before and after
//!      the grantee's markers → PERMISSION_DENIED, nothing published, the grantee's own announce
//!      still takes (it would be "already announced" had the forgery counted);
//!    - by a client or admin certificate (`xfer.v1.Peer` needs the node role) → PERMISSION_DENIED;
//!    - on a grant with a single notification, on a grant without one, an unknown, empty or
//!      revoked grant id, a seq past the window (1024 and u64::MAX), a seq already published, a
//!      duplicate announce, a tag over `transfer.max_notify_bytes` → refused with its code,
//!      nothing published;
//!    - `Peer.Complete` on a channel grant with an announced, unmarked batch → publishes nothing;
//!    - many announced batches whose markers never come (each tag up to max_notify_bytes): the
//!      tags a channel grant keeps are bounded (BUG found: 1024 tags of max_notify_bytes per
//!      channel grant, times max_grants_per_peer, i.e. 1 GiB per peer identity at the defaults
//!      and 64 GiB at the tag ceiling; fixed in `notify::ChannelNotes::announce` with a byte
//!      budget; the batch that publishes gives its room back).
//! 2. Forged markers (raw NOTIFY frames, the immediate in the address field): another channel's
//!    immediate (same connection and another connection), a plain slot, 0, an immediate wider
//!    than 32 bits, a seq outside the window (1024, 0x8000, behind the base), the channel's
//!    token on another connection's stream (plain and, under mTLS, another identity's stream),
//!    another connection's channel token, a revoked channel grant's token → NAKed; more markers
//!    than a batch carries and a marker for an already published batch → taken and ignored (an
//!    initiator that lost a path re-sends the markers no completion confirmed, and the originals
//!    may have landed: a NAK would fail its batch after the notification was right); a channel
//!    immediate under a plain notification grant's token counts for that plain grant (the token
//!    names the grant on tcp) and never reaches the channel. No batch publishes before all of its
//!    markers and its announce arrived.
//! 3. The client stream: ChannelOpen twice and a message with no oneof (mid-stream and first) →
//!    INVALID_ARGUMENT after the answers to what came before, grant given back; 2,000 posts sent
//!    without waiting → answered in order, agent alive; posts of oversized segment lists queued
//!    behind a long batch → refused in order without being kept (BUG found: the request queue
//!    held 64 decoded lists of any length, ~24 bytes per segment, ~96 MB per 16 MiB message:
//!    ~6 GB per channel from a client that does not read its answers; fixed in
//!    `convert::channel_input_from_pb` + `Channel::too_many`: a list over
//!    `transfer.max_segments` becomes `ChannelInput::TooMany` as it arrives, and the queue is 4
//!    deep instead of 64 in `service::open_channel`); more than MAX_LISTS lists and
//!    prepared segments past 4 × max_segments → RESOURCE_EXHAUSTED, the old list intact; a client
//!    that drops the stream mid-batch → the target's grant is revoked, the channel gauge drops,
//!    nothing is published, no byte changes after; DeleteRegion of the channel's local region
//!    while open → FAILED_PRECONDITION (busy), the channel goes on; node-role and role-less
//!    certificates calling `Agent.OpenChannel` → PERMISSION_DENIED.
//! 4. Ranges: opens whose remote range overflows u64 or lies past the region, segments near
//!    u64::MAX (remote and local) and u64::MAX lengths → refused, the channel goes on; a grant
//!    that expired under an idle channel → the channel ends on its own with FAILED_PRECONDITION,
//!    giving its transfer slot back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::time::Duration;

use crate::common::chan::*;
use crate::common::pki::Pki;
use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

const REM_INV_REQ_ERR: u16 = 9;
const REM_ACCESS_ERR: u16 = 10;
const MIB: u64 = 1 << 20;
const BLOCK: u64 = 4096;
const CHANNEL_BIT: u32 = 1 << 31;

// ---------------------------------------------------------------------------------------------
// Peer-side helpers: grants, announces, raw NOTIFY frames.

/// `Peer.Grant` of a channel grant (per-batch notifications, `markers` per batch) on `conn`.
fn channel_grant_req(region: &str, len: u64, conn: &str, markers: u32) -> pb::GrantRequest {
    pb::GrantRequest {
        notify: Some(pb::NotifyRequest { tag: vec![], markers, channel: true }),
        region: region.into(),
        offset: 0,
        length: len,
        op: pb::Access::Write as i32,
        ttl: None,
        node_name: "declared".into(),
        connection_id: conn.into(),
    }
}

/// `Peer.Grant` with a single notification (`tag`, `markers`) on `conn`.
fn once_grant_req(region: &str, conn: &str, tag: &[u8], markers: u32) -> pb::GrantRequest {
    pb::GrantRequest {
        notify: Some(pb::NotifyRequest { tag: tag.to_vec(), markers, channel: false }),
        ..grant_req(region, "declared", conn, pb::Access::Write)
    }
}

async fn grant(a: &Agent, req: pb::GrantRequest) -> pb::GrantResponse {
    a.peer_client().await.grant(req).await.unwrap().into_inner()
}

/// The immediate of batch `seq`'s markers on channel grant `g`.
fn imm(g: &pb::GrantResponse, seq: u64) -> u32 {
    assert_ne!(g.notify_slot & CHANNEL_BIT, 0, "a channel grant's slot carries the channel bit");
    g.notify_slot | (seq & 0xffff) as u32
}

fn announce_req(g: &str, seq: u64, tag: &[u8]) -> pb::AnnounceRequest {
    pb::AnnounceRequest { grant_id: g.into(), seq, tag: tag.to_vec() }
}

async fn announce(a: &Agent, g: &str, seq: u64, tag: &[u8]) -> Result<(), tonic::Status> {
    a.peer_client().await.announce(announce_req(g, seq, tag)).await.map(|_| ())
}

/// Sends a NOTIFY frame under `tok` whose address field is `addr` (the immediate), ACK asked;
/// reads the answer: (status, kind, id).
fn notify_addr<S: Read + Write>(s: &mut S, tok: [u8; 16], addr: u64, id: u64) -> (u16, Kind, u64) {
    s.write_all(&frame_header(Kind::Notify, 1, id, tok, addr, 0)).unwrap();
    s.flush().unwrap();
    read_frame_answer(s)
}

fn notify<S: Read + Write>(s: &mut S, tok: [u8; 16], imm: u32, id: u64) -> (u16, Kind, u64) {
    notify_addr(s, tok, imm as u64, id)
}

fn ok_ack(a: (u16, Kind, u64), id: u64, what: &str) {
    assert_eq!(a, (0, Kind::Ack, id), "{what}");
}

fn nak(a: (u16, Kind, u64), status: u16, id: u64, what: &str) {
    assert_eq!(a, (status, Kind::Nak, id), "{what}");
}

/// A fresh notification with `tag` on `region` via `Peer.Complete` (plaintext, connection
/// `conn`): the ordering probe that follows every refusal.
async fn probe(a: &Agent, region: &str, conn: &str, tag: &[u8]) {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let g = grant(a, once_grant_req(region, conn, tag, 1)).await;
    let id = format!("probe-{}", N.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    a.peer_client().await.complete(complete_req(&g.grant_id, &id, 4096, "x")).await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// mTLS helpers: a data stream presenting a node certificate.

type TlsStream = rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>;

/// A TLS data stream to `address` as certificate `who` (of `pki`), saying hello as connection
/// `conn` with `secret`: what an agent with that certificate opens.
fn tls_data_stream(pki: &Pki, who: &str, address: &str, conn: &str, secret: &[u8]) -> TlsStream {
    let cfg = xfer_agent::config::TlsConfig {
        cert: pki.path(&format!("{who}.crt")).display().to_string(),
        key: pki.path(&format!("{who}.key")).display().to_string(),
        ca: pki.path("ca.crt").display().to_string(),
        ..Default::default()
    };
    let m = xfer_agent::service::tls::TlsMaterial::load(&cfg).unwrap();
    let name = m.data.server_name_for(address).unwrap();
    let tcp = std::net::TcpStream::connect(address).unwrap();
    tcp.set_read_timeout(Some(READ_GUARD)).unwrap();
    let conn_tls = rustls::ClientConnection::new(m.data.client.clone(), name).unwrap();
    let mut s = rustls::StreamOwned::new(conn_tls, tcp);
    let mut hello = b"XFR1".to_vec();
    hello.push(conn.len() as u8);
    hello.extend_from_slice(conn.as_bytes());
    hello.extend_from_slice(secret);
    s.write_all(&hello).unwrap();
    s.flush().unwrap();
    s
}

/// `Peer.Connect` (tcp) as connection `id` through `peer`: the data address and secret.
async fn connect_tls(peer: &mut xfer_proto::v1::peer_client::PeerClient<tonic::transport::Channel>, id: &str) -> (String, Vec<u8>) {
    let r = peer.connect(connect_req(id)).await.unwrap().into_inner();
    match &r.endpoints[0].kind {
        Some(pb::endpoint::Kind::Tcp(t)) => (t.address.clone(), t.secret.clone()),
        other => panic!("not a tcp endpoint: {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Client-side helpers: an open channel.

fn open_msg(op: pb::Op, local: &str, peer: &Agent, remote: &str, offset: u64, length: u64, notify: bool) -> pb::ChannelOpen {
    open_msg_qps(op, local, peer, remote, offset, length, notify, 2)
}

fn refused(d: &pb::BatchDone, code: &str, says: &str) {
    assert_eq!((d.state, d.error_code.as_str(), d.bytes), (pb::TransferState::Failed as i32, code, 0), "{d:?}");
    assert!(d.error.contains(says), "{:?} does not say {says:?}", d.error);
}

/// Two plaintext agents: A with `src`, B with `dst` (random contents, returned).
async fn pair(a_env: &[(&str, &str)], len: u64) -> (Agent, Agent, Vec<u8>, Vec<u8>) {
    let a = Agent::start_env("node-a", a_env);
    let b = Agent::start("node-b");
    a.create("src", len, pb::Access::ReadWrite).await;
    b.create("dst", len, pb::Access::ReadWrite).await;
    let src = random_bytes(len as usize, 11);
    let dst = random_bytes(len as usize, 12);
    a.put("src", 0, &src).await;
    b.put("dst", 0, &dst).await;
    (a, b, src, dst)
}

// =============================================================================================
// 1. Peer.Announce

/// Under mTLS, a channel grant is its grantee's alone: node-c (another node identity) can
/// neither announce on node-a's grant nor mark it from its own data stream, and a client or
/// admin certificate cannot call `Peer.Announce` at all. node-a's own markers and announces
/// still take — had node-c's forged announce counted, node-a's would be refused as "already
/// announced" and the published tag would be the forgery. Node-role and role-less certificates
/// cannot open channels (`Agent.OpenChannel` needs the client role).
#[tokio::test]
async fn announce_and_markers_are_the_grantees_alone_under_mtls() {
    let pki = Pki::new();
    let (b, _tb) = pki.agent("node-b");
    let mut admin_b = pki.agent_client(&b, "xferctl").await;
    admin_b.create_region(anon("dst", MIB)).await.unwrap();
    let mut notes = admin_b.watch_inbound(pb::WatchInboundRequest { region: String::new(), tag: None }).await.unwrap().into_inner();

    let mut pa = pki.peer(&b, "node-a").await;
    let mut pc = pki.peer(&b, "node-c").await;
    let (addr, a_secret) = connect_tls(&mut pa, "ca1").await;
    let (_, c_secret) = connect_tls(&mut pc, "cc1").await;
    let g = pa.grant(channel_grant_req("dst", 4096, "ca1", 1)).await.unwrap().into_inner();
    assert_eq!(gauge(&b, "xfer_grants_active"), 1.0);

    // node-c announces batch 0 before any marker, and from its own stream marks it.
    let e = pc.announce(announce_req(&g.grant_id, 0, b"forged-0")).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // Nor can it verify (and so settle) node-a's batch.
    let forged = pb::VerifyBatchRequest {
        grant_id: g.grant_id.clone(),
        spans: vec![pb::GrantSpan { offset: 0, length: 4096 }],
        settle: true,
        ..Default::default()
    };
    let e = pc.verify_batch(forged).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let mut cs = tls_data_stream(&pki, "node-c", &addr, "cc1", &c_secret);
    nak(notify(&mut cs, token_of(&g), imm(&g, 0), 1), REM_ACCESS_ERR, 1, "node-a's token on node-c's stream");
    // node-c's certificate cannot say hello as node-a's connection (it has node-a's token now).
    let mut hijack = tls_data_stream(&pki, "node-c", &addr, "ca1", &a_secret);
    let _ = hijack.write_all(&frame_header(Kind::Notify, 1, 2, token_of(&g), imm(&g, 0) as u64, 0));
    let _ = hijack.flush();
    // The hello is refused (a NAK of frame 0) and the stream closed: the marker is never served.
    nak(read_frame_answer(&mut hijack), REM_ACCESS_ERR, 0, "node-c's hello naming node-a's connection");
    assert_closed(&mut hijack, "node-c's hello naming node-a's connection");

    // Client and admin certificates cannot call the Peer service at all.
    for who in ["xferctl", "admin"] {
        let ch = pki.channel(&b.addr(), "ca.crt", Some(who)).await.unwrap();
        let e = xfer_proto::v1::peer_client::PeerClient::new(ch).announce(announce_req(&g.grant_id, 0, b"client")).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{who}: {e:?}");
    }

    // node-a's marker of batch 0 (its only one): not published without the announce.
    let mut s = tls_data_stream(&pki, "node-a", &addr, "ca1", &a_secret);
    ok_ack(notify(&mut s, token_of(&g), imm(&g, 0), 10), 10, "node-a's marker");
    // node-c tries again now that only the tag is missing.
    let e = pc.announce(announce_req(&g.grant_id, 0, b"forged-0b")).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    pa.announce(announce_req(&g.grant_id, 0, b"real-0")).await.expect("the grantee's own announce takes");
    let n = next_note(&mut notes).await;
    assert_eq!((n.tag.as_slice(), n.region.as_str()), (&b"real-0"[..], "dst"), "the first notification is the grantee's");

    // Batch 1: node-c announces first, then node-a marks and announces.
    let e = pc.announce(announce_req(&g.grant_id, 1, b"forged-1")).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    ok_ack(notify(&mut s, token_of(&g), imm(&g, 1), 11), 11, "node-a's marker of batch 1");
    pa.announce(announce_req(&g.grant_id, 1, b"real-1")).await.expect("not 'already announced': the forgery did not count");
    assert_eq!(next_note(&mut notes).await.tag, b"real-1");

    // Channels are opened by clients only.
    for who in ["node-a", "node-c", "norole"] {
        let open = pb::ChannelOpen {
            op: pb::Op::Write as i32,
            local_region: "dst".into(),
            remote: Some(pb::RemoteRange { agent: b.addr(), region: "dst".into(), offset: 0 }),
            length: 0,
            options: None,
            ttl: None,
            notify: true,
        };
        let ch = pki.channel(&b.addr(), "ca.crt", Some(who)).await.unwrap();
        let mut c = xfer_proto::v1::agent_client::AgentClient::new(ch);
        let e = c.open_channel(futures::stream::iter(vec![msg(pb::channel_request::Msg::Open(open))])).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{who}: {e:?}");
    }
    assert_eq!(gauge(&b, "xfer_channels_open"), 0.0);
    assert_eq!(gauge(&b, "xfer_grants_active"), 1.0, "still node-a's one grant");
    let mut rd = admin_b.read_region(pb::ReadRegionRequest { region: "dst".into(), offset: 0, length: MIB }).await.unwrap().into_inner();
    while let Some(m) = rd.message().await.unwrap() {
        assert!(m.data.iter().all(|&x| x == 0), "no byte of dst changed");
    }
    assert_eq!(notify_markers(&b, "counted"), 2.0);
}

/// Every malformed or misplaced announce is refused with its code and changes nothing: the
/// grant's window is as it was (the valid announce after them publishes exactly once), and a
/// grant with a single notification is not published by an announce.
#[tokio::test]
async fn bad_announces_are_refused_and_change_nothing() {
    let b = Agent::start_env("node-b", &[("XFER_TRANSFER__MAX_NOTIFY_BYTES", "8")]);
    b.create("dst", MIB, pb::Access::ReadWrite).await;
    let before = random_bytes(MIB as usize, 1);
    b.put("dst", 0, &before).await;
    let mut notes = subscribe(&b, "", None).await;
    let c1 = DataSession::of(&b, "c1").await;
    let mut s = c1.open();
    let g = grant(&b, channel_grant_req("dst", 4096, "c1", 1)).await;
    let once = grant(&b, once_grant_req("dst", "c1", b"once", 1)).await;
    let plain = grant(&b, grant_req("dst", "x", "c1", pb::Access::Write)).await;
    let revoked = grant(&b, channel_grant_req("dst", 4096, "c1", 1)).await;
    b.peer_client().await.revoke(pb::RevokeRequest { grant_id: revoked.grant_id.clone() }).await.unwrap();
    assert_eq!(gauge(&b, "xfer_grants_active"), 3.0);

    // (what, grant id, seq, tag, code, words in the message)
    type Case<'a> = (&'a str, &'a str, u64, Vec<u8>, Code, &'a str);
    let cases: Vec<Case> = vec![
        ("a single-notification grant", &once.grant_id, 0, b"x".to_vec(), Code::InvalidArgument, "channel"),
        ("a grant without notification", &plain.grant_id, 0, b"x".to_vec(), Code::InvalidArgument, "channel"),
        ("an unknown grant", "no-such-grant", 0, b"x".to_vec(), Code::NotFound, "not found"),
        ("an invalid grant id", "../../etc", 0, b"x".to_vec(), Code::NotFound, "not found"),
        ("an empty grant id", "", 0, b"x".to_vec(), Code::InvalidArgument, "grant_id"),
        ("a revoked grant", &revoked.grant_id, 0, b"x".to_vec(), Code::NotFound, "not found"),
        ("a tag over max_notify_bytes", &g.grant_id, 0, b"123456789".to_vec(), Code::InvalidArgument, "at most 8"),
        ("a seq past the window", &g.grant_id, 1024, b"x".to_vec(), Code::ResourceExhausted, "window"),
        ("seq u64::MAX", &g.grant_id, u64::MAX, b"x".to_vec(), Code::ResourceExhausted, "window"),
    ];
    for (what, id, seq, tag, code, says) in cases {
        let e = announce(&b, id, seq, &tag).await.expect_err(what);
        assert_eq!(e.code(), code, "{what}: {e:?}");
        assert!(e.message().contains(says), "{what}: {:?} does not say {says:?}", e.message());
    }
    // The revoked grant's marker is refused too.
    nak(notify(&mut s, token_of(&revoked), imm(&revoked, 0), 1), REM_ACCESS_ERR, 1, "a revoked channel grant's marker");

    // Batch 0: announced, then a duplicate announce (refused), then its marker publishes the
    // first tag, once.
    announce(&b, &g.grant_id, 0, b"t0").await.unwrap();
    let e = announce(&b, &g.grant_id, 0, b"dup").await.expect_err("duplicate");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("already announced"), "{e:?}");
    ok_ack(notify(&mut s, token_of(&g), imm(&g, 0), 2), 2, "batch 0's marker");
    let n = next_note(&mut notes).await;
    assert_eq!((n.tag.as_slice(), n.via.as_str()), (&b"t0"[..], "fabric"), "the duplicate did not replace the tag: {n:?}");
    let e = announce(&b, &g.grant_id, 0, b"again").await.expect_err("already published");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("already notified"), "{e:?}");
    ok_ack(notify(&mut s, token_of(&g), imm(&g, 0), 3), 3, "a marker of a published batch: taken, ignored");
    // The window moved: 1024 is inside now, 1025 is not.
    let e = announce(&b, &g.grant_id, 1025, b"x").await.expect_err("past the moved window");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");

    // Peer.Complete on a channel grant whose batch 1 is announced but unmarked: publishes
    // nothing, and the grant is gone.
    let g2 = grant(&b, channel_grant_req("dst", 4096, "c1", 1)).await;
    announce(&b, &g2.grant_id, 0, b"complete").await.unwrap();
    b.peer_client().await.complete(complete_req(&g2.grant_id, "t-g2", 4096, "x")).await.unwrap();
    nak(notify(&mut s, token_of(&g2), imm(&g2, 0), 4), REM_ACCESS_ERR, 4, "after Complete the channel grant is gone");

    probe(&b, "dst", "c1", b"probe").await;
    assert_eq!(next_note(&mut notes).await.tag, b"probe", "nothing published between t0 and the probe");
    assert!(b.read("dst", 0, MIB).await == before, "no byte changed");
    assert_eq!(gauge(&b, "xfer_grants_active"), 3.0, "g, once and plain");
    // Batch 0's marker and the extra one after its publish (taken, ignored: it published nothing).
    assert_eq!(notify_markers(&b, "counted"), 2.0);
}

/// `Peer.VerifyBatch` (a channel batch checked end to end after its initiator failed over) is
/// bounded like every peer input: spans outside the grant, none, too many, an unknown, revoked or
/// non-channel grant are refused; a checksum that does not match settles nothing; only a match
/// publishes the batch's announced notification, once. The ordering probe shows nothing was
/// published by a refusal or a mismatch.
#[tokio::test]
async fn verify_batch_is_bounded_and_only_a_match_publishes() {
    let b = Agent::start("node-b");
    b.create("dst", MIB, pb::Access::ReadWrite).await;
    let data = random_bytes(MIB as usize, 4);
    b.put("dst", 0, &data).await;
    let mut notes = subscribe(&b, "", None).await;
    let _c1 = DataSession::of(&b, "c1").await;
    let g = grant(&b, channel_grant_req("dst", 64 << 10, "c1", 2)).await;
    let once = grant(&b, once_grant_req("dst", "c1", b"once", 1)).await;
    announce(&b, &g.grant_id, 0, b"b0").await.unwrap();
    let spans = [(8192u64, 4096u64), (0, 4096)];
    let order = [&data[8192..12288], &data[..4096]].concat();
    let sum = xxhash_rust::xxh3::xxh3_64(&order);
    let first = xxhash_rust::xxh3::xxh3_64(&data[..4096]);
    let req = |grant: &str, spans: &[(u64, u64)], checksum: u64| pb::VerifyBatchRequest {
        grant_id: grant.into(),
        seq: 0,
        algo: pb::ChecksumAlgo::Xxh3 as i32,
        checksum,
        spans: spans.iter().map(|&(offset, length)| pb::GrantSpan { offset, length }).collect(),
        settle: true,
    };
    let mut p = b.peer_client().await;
    type Case<'a> = (&'a str, pb::VerifyBatchRequest, Code, &'a str);
    let cases: Vec<Case> = vec![
        ("a span past the grant", req(&g.grant_id, &[(60 << 10, 8 << 10)], sum), Code::InvalidArgument, "outside the grant"),
        ("no spans", req(&g.grant_id, &[], sum), Code::InvalidArgument, "spans are required"),
        ("too many spans", req(&g.grant_id, &vec![(0, 1); 100_000], sum), Code::ResourceExhausted, "transfer.max_segments"),
        ("an unknown grant", req("no-such-grant", &spans, sum), Code::NotFound, "not found"),
        ("a single-notification grant", req(&once.grant_id, &[(0, 4096)], first), Code::InvalidArgument, "channel"),
    ];
    for (what, r, code, says) in cases {
        let e = p.verify_batch(r).await.expect_err(what);
        assert_eq!(e.code(), code, "{what}: {e:?}");
        assert!(e.message().contains(says), "{what}: {}", e.message());
    }
    let v = p.verify_batch(req(&g.grant_id, &spans, sum ^ 1)).await.unwrap().into_inner();
    assert!(!v.checksum_matched && v.checksum == sum, "{v:?}");
    probe(&b, "dst", "c1", b"probe").await;
    assert_eq!(next_note(&mut notes).await.tag, b"probe", "nothing was published before the probe");
    let v = p.verify_batch(req(&g.grant_id, &spans, sum)).await.unwrap().into_inner();
    assert!(v.checksum_matched, "{v:?}");
    assert_eq!(next_note(&mut notes).await.tag, b"b0", "a match publishes the announced batch");
    let e = p.verify_batch(req(&g.grant_id, &spans, sum)).await.expect_err("settled twice");
    assert!(e.message().contains("already notified"), "{e:?}");
    probe(&b, "dst", "c1", b"probe-2").await;
    assert_eq!(next_note(&mut notes).await.tag, b"probe-2", "published once");
}

/// A peer that announces batches and never marks them: the tags a channel grant keeps are
/// bounded by bytes, not only by the 1024-batch window (which, times 1 KiB tags and 1,024
/// grants per peer, let one identity park 1 GiB in the target). Publishing a batch gives its
/// room back.
#[tokio::test]
async fn announced_tags_are_bounded_per_channel() {
    let b = Agent::start("node-b");
    b.create("dst", MIB, pb::Access::ReadWrite).await;
    let mut notes = subscribe(&b, "", None).await;
    let c1 = DataSession::of(&b, "c1").await;
    let mut s = c1.open();
    let g = grant(&b, channel_grant_req("dst", 4096, "c1", 1)).await;
    let tag = |seq: u64| {
        let mut t = vec![b'x'; 1024]; // transfer.max_notify_bytes (default)
        t[..8].copy_from_slice(&seq.to_le_bytes());
        t
    };
    let mut p = b.peer_client().await;
    let mut taken = 0u64;
    let refusal = loop {
        match p.announce(announce_req(&g.grant_id, taken, &tag(taken))).await {
            Ok(_) => taken += 1,
            Err(e) => break e,
        }
        assert!(taken < 1024, "1024 tags of 1 KiB kept for one channel grant");
    };
    assert_eq!(refusal.code(), Code::ResourceExhausted, "{refusal:?}");
    assert_eq!(taken, 64, "64 KiB of tags per channel grant");
    // Batch 0's marker publishes it: room for one more.
    ok_ack(notify(&mut s, token_of(&g), imm(&g, 0), 1), 1, "batch 0's marker");
    assert_eq!(next_note(&mut notes).await.tag, tag(0));
    p.announce(announce_req(&g.grant_id, taken, &tag(taken))).await.expect("room again after a publication");
    let e = p.announce(announce_req(&g.grant_id, taken + 1, &tag(taken + 1))).await.expect_err("full again");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    // Small tags still fit while the big ones wait (the bound is on bytes).
    let g2 = grant(&b, channel_grant_req("dst", 4096, "c1", 1)).await;
    for seq in 0..1000 {
        p.announce(announce_req(&g2.grant_id, seq, b"")).await.unwrap_or_else(|e| panic!("empty tag {seq}: {e:?}"));
    }
    // Every kept batch still publishes, in any order, each once.
    for seq in (1..=taken).rev() {
        ok_ack(notify(&mut s, token_of(&g), imm(&g, seq), 10 + seq), 10 + seq, "a kept batch's marker");
        assert_eq!(next_note(&mut notes).await.tag, tag(seq));
    }
}

// =============================================================================================
// 2. Forged markers

/// Markers that name the wrong channel, a plain slot, no channel, a seq outside the window, the
/// channel's token on another connection or another connection's channel: each NAKed; one marker
/// too many or one of a batch already published: taken and ignored. None publishes anything,
/// none lets a batch publish before all of its markers and its announce. The legitimate batches around them publish once,
/// in the order their last piece arrives.
#[tokio::test]
async fn forged_channel_markers_publish_nothing_and_nothing_early() {
    let b = Agent::start("node-b");
    b.create("dst", MIB, pb::Access::ReadWrite).await;
    let before = random_bytes(MIB as usize, 2);
    b.put("dst", 0, &before).await;
    let mut notes = subscribe(&b, "", None).await;
    let (c1, c2) = (DataSession::of(&b, "c1").await, DataSession::of(&b, "c2").await);
    let (mut s1, mut s2) = (c1.open(), c2.open());
    // The channel under attack: 2 markers per batch (two QPs).
    let g = grant(&b, channel_grant_req("dst", 4096, "c1", 2)).await;
    let sibling = grant(&b, channel_grant_req("dst", 4096, "c1", 1)).await;
    let far = grant(&b, channel_grant_req("dst", 4096, "c2", 1)).await;
    let once = grant(&b, once_grant_req("dst", "c1", b"once", 2)).await;
    assert!(once.notify_slot != 0 && once.notify_slot & CHANNEL_BIT == 0);
    assert!(g.notify_slot != sibling.notify_slot && g.notify_slot != far.notify_slot);
    let tg = token_of(&g);
    let mut id = 0u64;
    let mut next = || {
        id += 1;
        id
    };

    // Refused markers, all under g's token on its own connection unless said.
    let wrong: Vec<(&str, u64, u16)> = vec![
        ("a sibling channel's immediate (same connection)", imm(&sibling, 0) as u64, REM_INV_REQ_ERR),
        ("another connection's channel immediate", imm(&far, 0) as u64, REM_INV_REQ_ERR),
        ("a plain notification slot", once.notify_slot as u64, REM_INV_REQ_ERR),
        ("immediate 0", 0, REM_INV_REQ_ERR),
        ("the channel bit alone", CHANNEL_BIT as u64, REM_INV_REQ_ERR),
        ("an address wider than 32 bits", (1u64 << 32) | imm(&g, 0) as u64, REM_INV_REQ_ERR),
        ("seq 1024 (the end of the window)", imm(&g, 1024) as u64, REM_INV_REQ_ERR),
        ("seq 0x8000", imm(&g, 0x8000) as u64, REM_INV_REQ_ERR),
        ("seq 0xffff (behind the base)", imm(&g, 0xffff) as u64, REM_INV_REQ_ERR),
    ];
    for (what, addr, status) in &wrong {
        let i = next();
        nak(notify_addr(&mut s1, tg, *addr, i), *status, i, what);
    }
    let i = next();
    nak(notify(&mut s2, tg, imm(&g, 0), i), REM_ACCESS_ERR, i, "the channel's token on another connection's stream");
    let i = next();
    nak(notify(&mut s1, token_of(&far), imm(&far, 0), i), REM_ACCESS_ERR, i, "another connection's channel token");
    // A channel immediate under the single-notification grant's token: on tcp the token names
    // the grant, so it counts for that grant (1 of its 2 markers: unpublished) and never for g.
    let i = next();
    ok_ack(notify(&mut s1, token_of(&once), imm(&g, 0), i), i, "a channel immediate under a plain grant's token");
    assert_eq!(notify_markers(&b, "counted"), 1.0);

    // Batch 0 of g: one marker of two, then its announce: not published yet.
    let i = next();
    ok_ack(notify(&mut s1, tg, imm(&g, 0), i), i, "batch 0, marker 1 of 2");
    announce(&b, &g.grant_id, 0, b"b0").await.unwrap();
    // Batch 1: announce first, one marker of two.
    announce(&b, &g.grant_id, 1, b"b1").await.unwrap();
    let i = next();
    ok_ack(notify(&mut s1, tg, imm(&g, 1), i), i, "batch 1, marker 1 of 2");
    // Batch 2: both markers, no announce.
    for _ in 0..2 {
        let i = next();
        ok_ack(notify(&mut s1, tg, imm(&g, 2), i), i, "batch 2's markers");
    }
    // A third marker for batch 2 (more than the batch carries), and the sibling's and far's
    // markers for their batch 0 without announces.
    let i = next();
    ok_ack(notify(&mut s1, tg, imm(&g, 2), i), i, "a third marker of a 2-marker batch: taken, ignored");
    let i = next();
    ok_ack(notify(&mut s1, token_of(&sibling), imm(&sibling, 0), i), i, "the sibling's own marker");
    probe(&b, "dst", "c1", b"probe-1").await;
    assert_eq!(next_note(&mut notes).await.tag, b"probe-1", "no batch published before all its markers and its announce");

    // The missing pieces arrive: each batch publishes on its last, once.
    let i = next();
    ok_ack(notify(&mut s1, tg, imm(&g, 1), i), i, "batch 1, marker 2 of 2");
    assert_eq!(next_note(&mut notes).await.tag, b"b1");
    announce(&b, &g.grant_id, 2, b"b2").await.unwrap();
    assert_eq!(next_note(&mut notes).await.tag, b"b2");
    let i = next();
    ok_ack(notify(&mut s1, tg, imm(&g, 0), i), i, "batch 0, marker 2 of 2");
    assert_eq!(next_note(&mut notes).await.tag, b"b0");
    // Published batches count no more markers (taken and ignored); the window base moved past them.
    for seq in [0u64, 1, 2] {
        let i = next();
        ok_ack(notify(&mut s1, tg, imm(&g, seq), i), i, "a marker of a published batch: taken, ignored");
    }
    let e = announce(&b, &g.grant_id, 2, b"again").await.expect_err("published");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let i = next();
    nak(notify(&mut s1, tg, imm(&g, 3 + 1024), i), REM_INV_REQ_ERR, i, "past the moved window");
    probe(&b, "dst", "c1", b"probe-2").await;
    assert_eq!(next_note(&mut notes).await.tag, b"probe-2", "each batch published once");

    assert!(b.read("dst", 0, MIB).await == before, "no byte changed");
    assert_eq!(gauge(&b, "xfer_grants_active"), 4.0, "g, sibling, far and once are all still live");
}

// =============================================================================================
// 3. The client stream

/// A second ChannelOpen, or a message with no oneof, ends the channel with INVALID_ARGUMENT
/// after the answers to everything before it (which ran: bytes landed, the notification came);
/// the grant is given back. As the first message, an empty one is refused before anything is
/// set up.
#[tokio::test]
async fn a_second_open_or_an_empty_message_ends_the_channel_after_its_answers() {
    let (a, b, src, mut want) = pair(&[], MIB).await;
    let mut notes = subscribe(&b, "dst", None).await;
    let second_open = msg(pb::channel_request::Msg::Open(open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, true)));
    for (round, bad) in [second_open, pb::ChannelRequest { msg: None }].into_iter().enumerate() {
        let round = round as u64;
        let mut ch = try_open(&a, open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, true)).await.unwrap();
        assert_eq!(gauge(&b, "xfer_grants_active"), 1.0);
        let (l, r) = (round * BLOCK, (10 + round) * BLOCK);
        // The post and the bad message back to back: the post is answered first.
        ch.send(post_msg(round, vec![seg(l, r, BLOCK)], 0, Some(format!("n{round}").as_bytes()))).await;
        ch.send(bad).await;
        ok(&ch.done().await);
        let end = ch.end().await;
        assert_eq!(end.code(), Code::InvalidArgument, "{end:?}");
        assert_eq!(next_note(&mut notes).await.tag, format!("n{round}").as_bytes());
        want[r as usize..(r + BLOCK) as usize].copy_from_slice(&src[l as usize..(l + BLOCK) as usize]);
        wait_gauge(&b, "xfer_grants_active", 0.0).await;
        wait_gauge(&a, "xfer_channels_open", 0.0).await;
    }
    // An empty first message.
    let s = a.client().await.open_channel(futures::stream::iter(vec![pb::ChannelRequest { msg: None }])).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert!(b.read("dst", 0, MIB).await == want, "exactly the two batches landed");
    assert_eq!(gauge(&b, "xfer_grants_active"), 0.0);
    // The agent still serves channels.
    let mut ch = try_open(&a, open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, false)).await.unwrap();
    ok(&ch.post(9, vec![seg(0, 0, BLOCK)], 0, None).await);
    ch.close().await;
}

/// 2,000 posts (every seventh one bad) sent without waiting for any answer: all answered, in
/// order, each with its own outcome; the agent stays up and the bytes are those of the last
/// batch to each place.
#[tokio::test]
async fn a_flood_of_posts_is_answered_in_order() {
    let (a, b, src, mut want) = pair(&[], MIB).await;
    let mut ch = try_open_depth(&a, open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, false), 4).await.unwrap();
    const N: u64 = 2000;
    let place = |i: u64| (i % 200) * BLOCK;
    let bad = |i: u64| i % 7 == 3;
    let tx = ch.tx.clone().unwrap();
    let sender = tokio::spawn(async move {
        for i in 0..N {
            let segs = if bad(i) { vec![seg(0, MIB, BLOCK)] } else { vec![seg((i % 256) * BLOCK, place(i), BLOCK)] };
            tx.send(post_msg(i, segs, 0, None)).await.unwrap();
        }
    });
    for i in 0..N {
        let d = ch.done().await;
        assert_eq!(d.seq, i, "answers in order");
        if bad(i) {
            refused(&d, "INVALID_ARGUMENT", "outside the granted range");
        } else {
            ok(&d);
            let (l, r) = (((i % 256) * BLOCK) as usize, place(i) as usize);
            want[r..r + BLOCK as usize].copy_from_slice(&src[l..l + BLOCK as usize]);
        }
    }
    sender.await.unwrap();
    ch.close().await;
    assert!(b.read("dst", 0, MIB).await == want);
    a.client().await.get_info(pb::GetInfoRequest {}).await.expect("the agent is alive");
    wait_gauge(&b, "xfer_grants_active", 0.0).await;
}

/// A client that posts lists far over `transfer.max_segments` (each message up to
/// `limits.max_message_size`, 16 MiB) while its channel is busy with a long batch: each is
/// refused (RESOURCE_EXHAUSTED, in its turn) and not kept while it waits, so the agent's peak
/// memory is about one message being decoded, not every message waiting. Before the fix the
/// channel's request queue kept up to 64 decoded lists of any length, ~96 MB per 16 MiB message
/// of 4M segments: ~6 GB per channel from a client that does not read its answers.
#[tokio::test]
async fn oversized_lists_queued_behind_a_long_batch_are_not_kept() {
    // The conversion keeps nothing of an oversized list.
    let big = |n: usize| vec![seg(0, 0, 1); n];
    let post = pb::ChannelRequest {
        msg: Some(pb::channel_request::Msg::Post(pb::ChannelPost { seq: 7, segments: big(5), list: 0, notify: None })),
    };
    match xfer_agent::service::convert::channel_input_from_pb(post, 4).unwrap() {
        xfer_agent::node::ChannelInput::TooMany { seq: 7, list: None, n: 5 } => {}
        other => panic!("{other:?}"),
    }

    let (a, b, _, _) = pair(&[], MIB).await;
    // One byte per work request, one at a time: the first batch would run for many minutes.
    let slow = pb::ChannelOpen {
        options: Some(pb::TransferOptions { chunk_size: 1, qps: 1, depth: 1, ..Default::default() }),
        ..open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, false)
    };
    let mut ch = try_open_depth(&a, slow, 1).await.unwrap();
    let pid = a.pid().unwrap();
    let base = proc_status(pid, "VmRSS:");
    ch.send(post_msg(0, vec![seg(0, 0, MIB)], 0, None)).await;
    // ~16 MB on the wire each: segments {0, 0, 1} take 4 bytes (zero fields are not encoded).
    const N: usize = 4_000_000;
    let list = big(N);
    let tx = ch.tx.clone().unwrap();
    // Three oversized posts, then eight small ones: the client (HTTP/2 flow control, a
    // one-message queue here) cannot hold more than a few messages, so once the sender is
    // done the agent has read the oversized ones (all but the last window of the third).
    let sender = tokio::spawn(async move {
        for i in 1..=3 {
            tx.send(post_msg(i, list.clone(), 0, None)).await.unwrap();
        }
        for i in 4..=11 {
            tx.send(post_msg(i, vec![seg(i * BLOCK, i * BLOCK, BLOCK)], 0, None)).await.unwrap();
        }
    });
    // The agent has room for all of them (hang guard only).
    tokio::time::timeout(Duration::from_secs(120), sender).await.expect("the posts were taken").unwrap();
    // The premise: the long batch is still running, so the oversized posts wait behind it.
    let text = scrape(&a);
    assert_eq!(metric(&text, "xfer_channel_batches_total"), 0.0, "the long batch ended before the posts were sent: {text}");
    // The target ends the long batch (deleting its region revokes the grant); the channel ends.
    b.client().await.delete_region(pb::DeleteRegionRequest { name: "dst".into() }).await.unwrap();
    let d = ch.done().await;
    assert_eq!((d.seq, d.error_code.as_str()), (0, "REM_ACCESS_ERR"), "{d:?}");
    assert_eq!(ch.end().await.code(), Code::Aborted);
    wait_gauge(&a, "xfer_channels_open", 0.0).await;
    let peak = proc_status(pid, "VmHWM:");
    assert!(peak < base + 200 * 1024, "agent peak RSS {peak} KiB from {base} KiB: the waiting lists were kept");

    // On a channel that is not busy, such lists are refused in their turn and it goes on.
    b.create("dst", MIB, pb::Access::ReadWrite).await;
    let mut ch = try_open_depth(&a, open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, false), 1).await.unwrap();
    ch.send(post_msg(1, big(70_000), 0, None)).await;
    ch.send(msg(pb::channel_request::Msg::Prepare(pb::ChannelPrepare { list: 3, segments: big(70_000) }))).await;
    let d = ch.done().await;
    assert_eq!(d.seq, 1);
    refused(&d, "RESOURCE_EXHAUSTED", "70000 segments in one batch");
    let d = ch.done().await;
    refused(&d, "RESOURCE_EXHAUSTED", "list 3: 70000 segments");
    ok(&ch.post(9, vec![seg(0, BLOCK, BLOCK)], 0, None).await);
    ch.close().await;
    let text = scrape(&a);
    assert_eq!(labelled(&text, "xfer_channel_batches_total", &[("result", "refused")]), 1.0, "{text}");
}

/// Lists: at most MAX_LISTS (64) per channel and 4 × `transfer.max_segments` prepared segments
/// over all of them; a refused list leaves the old list of that number as it was; the lists
/// kept still post correctly.
#[tokio::test]
async fn lists_and_prepared_segments_are_bounded() {
    // 16 segments per batch: 64 prepared segments per channel.
    let (a, b, src, mut want) = pair(&[("XFER_TRANSFER__MAX_SEGMENTS", "16")], MIB).await;
    let mut ch = try_open(&a, open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, false)).await.unwrap();
    for list in 1..=64u32 {
        let l = list as u64;
        match ch.prepare(list, vec![seg(l * BLOCK, l * BLOCK, BLOCK)]).await {
            pb::channel_event::Ev::Prepared(p) => assert_eq!((p.list, p.segments), (list, 1)),
            other => panic!("list {list}: {other:?}"),
        }
    }
    // A refused prepare's answer names its list (and no batch).
    let expect_refused = |ev: pb::channel_event::Ev, list: u32, says: &str| match ev {
        pb::channel_event::Ev::Done(d) => {
            assert_eq!((d.list, d.seq), (list, 0), "{d:?}");
            refused(&d, "RESOURCE_EXHAUSTED", says)
        }
        other => panic!("{other:?}"),
    };
    expect_refused(ch.prepare(65, vec![seg(0, 0, BLOCK)]).await, 65, "at most 64 lists");
    expect_refused(ch.prepare(u32::MAX, vec![seg(0, 0, BLOCK)]).await, u32::MAX, "at most 64 lists");
    // Replacing list 1 with two (non-contiguous) segments: 65 prepared segments.
    expect_refused(ch.prepare(1, vec![seg(0, 0, 16), seg(100, 100, 16)]).await, 1, "at most 64 prepared segments");
    // A bad replacement is refused whole; list 1 is still its old self.
    match ch.prepare(1, vec![seg(0, 0, 0)]).await {
        pb::channel_event::Ev::Done(d) => refused(&d, "INVALID_ARGUMENT", "zero length"),
        other => panic!("{other:?}"),
    }
    for list in [1u32, 64] {
        let d = ch.post(list as u64, vec![], list, None).await;
        ok(&d);
        assert_eq!(d.segments, 1);
        let o = (list as u64 * BLOCK) as usize;
        want[o..o + BLOCK as usize].copy_from_slice(&src[o..o + BLOCK as usize]);
    }
    // Replacing a list with one of the same size is fine; with a smaller one makes room.
    match ch.prepare(2, vec![seg(0, 200 * BLOCK, 8)]).await {
        pb::channel_event::Ev::Prepared(p) => assert_eq!(p.segments, 1),
        other => panic!("{other:?}"),
    }
    ch.close().await;

    // The segment budget with max_segments 4: 16 prepared segments per channel.
    let a4 = Agent::start_env("node-a4", &[("XFER_TRANSFER__MAX_SEGMENTS", "4")]);
    a4.create("src", MIB, pb::Access::ReadWrite).await;
    a4.put("src", 0, &src).await;
    let mut ch = try_open(&a4, open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, false)).await.unwrap();
    let four = |list: u64| (0..4).map(|i| seg((list * 8 + i * 2) * BLOCK, (100 + list * 8 + i * 2) * BLOCK, BLOCK)).collect::<Vec<_>>();
    for list in 1..=4u32 {
        match ch.prepare(list, four(list as u64)).await {
            pb::channel_event::Ev::Prepared(p) => assert_eq!(p.segments, 4),
            other => panic!("{other:?}"),
        }
    }
    expect_refused(ch.prepare(5, vec![seg(0, 0, BLOCK)]).await, 5, "at most 16 prepared segments");
    expect_refused(ch.prepare(6, (0..5).map(|i| seg(i * 16, i * 16, 8)).collect()).await, 6, "at most 4");
    match ch.prepare(4, vec![seg(0, 0, BLOCK)]).await {
        pb::channel_event::Ev::Prepared(p) => assert_eq!(p.segments, 1),
        other => panic!("{other:?}"),
    }
    match ch.prepare(5, vec![seg(0, BLOCK, BLOCK), seg(2 * BLOCK, 3 * BLOCK, BLOCK), seg(4 * BLOCK, 5 * BLOCK, BLOCK)]).await {
        pb::channel_event::Ev::Prepared(p) => assert_eq!(p.segments, 3),
        other => panic!("{other:?}"),
    }
    let d = ch.post(3, vec![], 3, None).await;
    ok(&d);
    for s in four(3) {
        let (l, r) = (s.local_offset as usize, s.remote_offset as usize);
        want[r..r + BLOCK as usize].copy_from_slice(&src[l..l + BLOCK as usize]);
    }
    ch.close().await;
    assert!(b.read("dst", 0, MIB).await == want, "exactly the posted lists landed");
    wait_gauge(&b, "xfer_grants_active", 0.0).await;
}

/// A client that drops its stream in the middle of a batch: the batch stops, the target's grant
/// is revoked (no byte changes after), the channel gauge drops, nothing is published, and the
/// agent's transfer slot for that peer is free again (limits.max_transfers_per_peer = 1).
#[tokio::test]
async fn a_client_dropping_mid_batch_gives_everything_back() {
    const LEN: u64 = 32 * MIB;
    let (a, b, _, before) = pair(&[("XFER_LIMITS__MAX_TRANSFERS_PER_PEER", "1")], LEN).await;
    let mut notes = subscribe(&b, "dst", None).await;
    b.data_session("probe").await;
    let slow = pb::ChannelOpen {
        options: Some(pb::TransferOptions { chunk_size: 512, qps: 1, depth: 1, ..Default::default() }),
        ..open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, true)
    };
    let ch = try_open(&a, slow).await.unwrap();
    // A second channel to the same peer is over the limit while this one is open.
    let e = try_open(&a, open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, false)).await.err().expect("over max_transfers_per_peer");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    ch.send(post_msg(1, vec![seg(0, 0, LEN)], 0, Some(b"dropped"))).await;
    // Wait until the batch has moved bytes (its first block is in place), then go away.
    for i in 0.. {
        if b.read("dst", 0, BLOCK).await != before[..BLOCK as usize] {
            break;
        }
        assert!(i < 3000, "the batch never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(ch);
    wait_gauge(&b, "xfer_grants_active", 0.0).await;
    wait_gauge(&a, "xfer_channels_open", 0.0).await;
    // Revoked: from here on no byte of dst changes, and the batch was cut short.
    let after = b.read("dst", 0, LEN).await;
    assert!(after[(LEN - BLOCK) as usize..] == before[(LEN - BLOCK) as usize..], "the batch was not cut short");
    probe(&b, "dst", "probe", b"probe").await;
    assert_eq!(next_note(&mut notes).await.tag, b"probe", "the dropped batch was not notified");
    assert!(b.read("dst", 0, LEN).await == after, "no byte changed after the grant was revoked");
    let text = scrape(&a);
    assert_eq!(labelled(&text, "xfer_channel_batches_total", &[("result", "succeeded")]), 0.0, "{text}");
    // The slot is free: a new channel opens and works.
    let mut ch = try_open(&a, open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, false)).await.unwrap();
    ok(&ch.post(2, vec![seg(0, LEN - BLOCK, BLOCK)], 0, None).await);
    ch.close().await;
}

/// The channel's local region cannot be deleted while the channel is open (FAILED_PRECONDITION,
/// busy): the channel goes on moving the region's bytes; once closed, the delete works.
#[tokio::test]
async fn the_local_region_of_an_open_channel_cannot_be_deleted() {
    let (a, b, src, mut want) = pair(&[], MIB).await;
    let mut ch = try_open(&a, open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, false)).await.unwrap();
    ok(&ch.post(1, vec![seg(0, 0, BLOCK)], 0, None).await);
    let e = a.client().await.delete_region(pb::DeleteRegionRequest { name: "src".into() }).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let d = ch.post(2, vec![seg(BLOCK, 2 * BLOCK, 2 * BLOCK)], 0, None).await;
    ok(&d);
    want[..BLOCK as usize].copy_from_slice(&src[..BLOCK as usize]);
    want[2 * BLOCK as usize..4 * BLOCK as usize].copy_from_slice(&src[BLOCK as usize..3 * BLOCK as usize]);
    assert!(b.read("dst", 0, MIB).await == want);
    assert!(a.read("src", 0, MIB).await == src, "the local region is intact");
    ch.close().await;
    wait_gauge(&a, "xfer_channels_open", 0.0).await;
    a.client().await.delete_region(pb::DeleteRegionRequest { name: "src".into() }).await.expect("deletable once closed");
}

// =============================================================================================
// 4. Ranges and limits

/// Opens whose remote range overflows or lies past the region, and segments near u64::MAX on
/// either side: refused, no grant left, no byte moved; the channel goes on.
#[tokio::test]
async fn ranges_near_u64_max_are_refused() {
    let (a, b, src, mut want) = pair(&[], MIB).await;
    for (what, off, len) in [
        ("an offset near u64::MAX", u64::MAX - 10, 100u64),
        ("offset u64::MAX, to the end", u64::MAX, 0),
        ("offset + length overflowing", 4096, u64::MAX),
        ("past the region", MIB, 1),
    ] {
        match try_open(&a, open_msg(pb::Op::Write, "src", &b, "dst", off, len, false)).await {
            Err(s) => assert!(matches!(s.code(), Code::InvalidArgument | Code::OutOfRange), "{what}: {s:?}"),
            Ok(c) => panic!("{what}: opened {:?}", c.opened),
        }
    }
    assert_eq!(gauge(&b, "xfer_grants_active"), 0.0);
    wait_gauge(&a, "xfer_channels_open", 0.0).await;
    // A channel over [64 KiB, 128 KiB).
    let (lo, span) = (64 * 1024u64, 64 * 1024u64);
    let mut ch = try_open(&a, open_msg(pb::Op::Write, "src", &b, "dst", lo, span, false)).await.unwrap();
    let cases: Vec<(&str, Vec<pb::Segment>, &str)> = vec![
        ("remote near u64::MAX", vec![seg(0, u64::MAX - 16, 16)], "outside the granted range"),
        ("remote u64::MAX - lo, spanning from inside", vec![seg(0, lo, 16), seg(16, u64::MAX - 16, 16)], "outside the granted range"),
        ("remote overflowing", vec![seg(0, u64::MAX - 8, 16)], "overflows"),
        ("local overflowing", vec![seg(u64::MAX - 8, lo, 16)], "overflows"),
        ("length u64::MAX", vec![seg(0, lo, u64::MAX)], "overflows"),
        ("length 4 GiB + 1", vec![seg(0, lo, (4 << 30) + 1)], "beyond the end"),
        ("just below the range", vec![seg(0, lo - 1, 2)], "outside the granted range"),
        ("one byte past the range", vec![seg(0, lo + span - 1, 2)], "outside the granted range"),
    ];
    for (i, (what, segs, says)) in cases.into_iter().enumerate() {
        let d = ch.post(i as u64, segs, 0, None).await;
        assert_eq!(d.state, pb::TransferState::Failed as i32, "{what}: {d:?}");
        assert!(d.error.contains(says), "{what}: {:?} does not say {says:?}", d.error);
    }
    assert!(b.read("dst", 0, MIB).await == want, "no refused batch moved a byte");
    // The edges of the range are fine.
    let d = ch.post(50, vec![seg(0, lo, 1), seg(1, lo + span - 1, 1)], 0, None).await;
    ok(&d);
    want[lo as usize] = src[0];
    want[(lo + span - 1) as usize] = src[1];
    assert!(b.read("dst", 0, MIB).await == want);
    ch.close().await;
}

/// A grant that expires under an idle channel ends the channel on its own (FAILED_PRECONDITION,
/// no post needed), which gives its transfer slot back: a new channel to the same peer opens
/// under `max_transfers_per_peer = 1`.
#[tokio::test]
async fn a_channel_whose_grant_expired_ends_on_its_own() {
    let (a, b, _, before) = pair(&[("XFER_LIMITS__MAX_TRANSFERS_PER_PEER", "1")], MIB).await;
    let open = pb::ChannelOpen {
        ttl: Some(prost_types::Duration { seconds: 1, nanos: 0 }),
        ..open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, false)
    };
    let mut ch = try_open(&a, open).await.unwrap();
    assert!(ch.opened.expires_at.is_some());
    let end = ch.end().await;
    assert_eq!(end.code(), Code::FailedPrecondition, "{end:?}");
    wait_gauge(&a, "xfer_channels_open", 0.0).await;
    assert!(b.read("dst", 0, MIB).await == before);
    let mut ch = try_open(&a, open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, false)).await.unwrap();
    ok(&ch.post(2, vec![seg(0, 0, BLOCK)], 0, None).await);
    ch.close().await;
}
