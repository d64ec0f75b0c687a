//! A hostile initiator's `Peer.Connect` offers for several devices (rails), through the real
//! gRPC service of a real agent: every field of a verbs endpoint a peer picks (rail number,
//! device name, link layer, GID type, IPv4 prefix, how many endpoints, verbs and tcp mixed) is
//! refused where it is decoded, naming the field, before the fabric sees it. Each test asserts the
//! refusal and that nothing else changed: no connection accepted (`xfer_accepted_connections`),
//! the refused ids still free, and another tenant's transfer.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

fn verbs(v: pb::VerbsEndpoint) -> pb::Endpoint {
    pb::Endpoint { kind: Some(pb::endpoint::Kind::Verbs(v)) }
}

/// A verbs endpoint that passes every check, for the hostile ones to start from.
fn good(rail: u32) -> pb::VerbsEndpoint {
    let mut gid = vec![0u8; 16];
    gid[10] = 0xff;
    gid[11] = 0xff;
    gid[12..].copy_from_slice(&[10, 0, 0, 1]);
    pb::VerbsEndpoint {
        qpn: 17 + rail,
        psn: 1,
        gid,
        mtu: 1024,
        link_layer: "Ethernet".into(),
        gid_type: "RoCEv2".into(),
        device: format!("rxe{rail}"),
        ipv4_prefix: 24,
        rail,
        ..Default::default()
    }
}

fn offer(id: &str, endpoints: Vec<pb::Endpoint>) -> pb::PeerConnectRequest {
    pb::PeerConnectRequest { fabric: pb::FabricKind::Verbs as i32, endpoints, ..connect_req(id) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_rail_offers_are_refused_and_accept_nothing() {
    let a = Agent::start("node-a");
    let b = Agent::start("node-b");
    let mut p = b.peer_client().await;
    let accepted = gauge(&b, "xfer_accepted_connections");
    let cases: Vec<(&str, Vec<pb::Endpoint>, Code, &str)> = vec![
        ("rail-64", vec![verbs(good(0)), verbs(good(64))], Code::InvalidArgument, "rail 64 is out of range"),
        ("rail-max", vec![verbs(pb::VerbsEndpoint { rail: u32::MAX, ..good(0) })], Code::InvalidArgument, "rail 4294967295"),
        ("prefix-33", vec![verbs(pb::VerbsEndpoint { ipv4_prefix: 33, ..good(0) })], Code::InvalidArgument, "prefix length 33"),
        ("prefix-255", vec![verbs(pb::VerbsEndpoint { ipv4_prefix: 255, ..good(1) })], Code::InvalidArgument, "prefix length 255"),
        (
            "device-newline",
            vec![verbs(pb::VerbsEndpoint { device: "rxe0\nlevel=ERROR forged".into(), ..good(0) })],
            Code::InvalidArgument,
            "device \"rxe0\\nlevel=ERROR forged\" has the character '\\n'",
        ),
        (
            "device-escape",
            vec![verbs(pb::VerbsEndpoint { device: "\u{1b}[2J".into(), ..good(0) })],
            Code::InvalidArgument,
            "has the character '\\u{1b}'",
        ),
        (
            "device-long",
            vec![verbs(pb::VerbsEndpoint { device: "d".repeat(33), ..good(0) })],
            Code::InvalidArgument,
            "endpoints[0].verbs.device",
        ),
        (
            "link-10k",
            vec![verbs(good(0)), verbs(pb::VerbsEndpoint { link_layer: "E".repeat(10 << 10), ..good(1) })],
            Code::InvalidArgument,
            "endpoints[1].verbs.link_layer",
        ),
        (
            "mixed",
            vec![
                verbs(good(0)),
                pb::Endpoint { kind: Some(pb::endpoint::Kind::Tcp(pb::TcpEndpoint { address: "nope".into(), secret: vec![] })) },
            ],
            Code::InvalidArgument,
            "invalid tcp data address",
        ),
        ("too-many", (0..65).map(|i| verbs(good(i % 64))).collect(), Code::ResourceExhausted, "at most 64 QPs per connection"),
        ("no-kind", vec![verbs(good(0)), pb::Endpoint { kind: None }], Code::InvalidArgument, "endpoint without a kind"),
    ];
    for (id, endpoints, code, says) in cases {
        let e = p.connect(offer(id, endpoints)).await.expect_err(id);
        assert_eq!(e.code(), code, "{id}: {e:?}");
        assert!(e.message().contains(says), "{id}: {}", e.message());
    }
    // Well-formed verbs rails to a tcp agent: the fabric kind is refused, nothing is accepted.
    let sparse = vec![verbs(good(63)), verbs(good(7)), verbs(good(63))];
    let e = p.connect(offer("sparse", sparse)).await.expect_err("a verbs offer to a tcp agent");
    assert!(e.message().contains("this agent runs tcp"), "{}", e.message());
    assert_eq!(gauge(&b, "xfer_accepted_connections"), accepted, "no refused offer left a connection");
    // The refused ids were never taken: an honest connection can use one.
    p.connect(connect_req("rail-64")).await.expect("a refused id is still free");
    assert_eq!(gauge(&b, "xfer_accepted_connections"), accepted + 1.0);
    // And another tenant's transfer still runs, every byte in place.
    let data = random_bytes(1 << 20, 26);
    a.create("victim-src", 1 << 20, pb::Access::ReadWrite).await;
    b.create("victim-dst", 1 << 20, pb::Access::ReadWrite).await;
    a.put("victim-src", 0, &data).await;
    let t = a.transfer(write_req("victim-src", &b, "victim-dst", 1 << 20)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert!(b.read("victim-dst", 0, 1 << 20).await == data);
}
