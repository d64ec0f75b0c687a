//! A hostile initiator against a multi-device responder on Soft-RoCE: agent B on both of its
//! devices (`verbs.devices`), offered rails by hand through `Peer.Connect`. Offers no device of
//! B reaches (another subnet, another link layer, too narrow a prefix) are refused and accept
//! nothing; offers under one connection id racing each other leave exactly one connection.
//! Each test asserts the refusal and that nothing else changed: `xfer_accepted_connections`, and
//! the refused ids still free for an honest offer.
//!
//! Every test needs the devices: `#[ignore = "needs Soft-RoCE"]`, run by
//! `scripts/rxe-guest-test` in the VM with `--include-ignored`.
#![cfg(feature = "verbs")]

use xfer_proto::v1 as pb;

use crate::common::{connect_req, gauge, Agent};

/// B on both of its devices, and what its devices are matched by: (IPv4 address, prefix).
async fn responder() -> (Agent, Vec<([u8; 4], u32)>) {
    let var = |k: &str| std::env::var(format!("XFER_RXE_{k}")).unwrap_or_else(|_| panic!("XFER_RXE_{k} not set: run in scripts/rxe-vm"));
    let devs = [var("B_DEV"), var("B2_DEV")].join(",");
    let b = Agent::start_fabric("redteam-b", "verbs", &[("XFER_VERBS__DEVICES", devs.as_str())]);
    let info = b.client().await.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    let facts: Vec<([u8; 4], u32)> = info
        .devices
        .iter()
        .map(|d| {
            let gid = d.gids.iter().find(|g| g.index as i32 == d.selected_gid_index).expect("a selected GID");
            (gid.raw[12..16].try_into().unwrap(), d.ipv4_prefix)
        })
        .collect();
    assert_eq!(facts.len(), 2, "{info:?}");
    (b, facts)
}

/// One RoCEv2 endpoint of rail `rail` at `ip/prefix` (a made-up QP: B only moves its own QPs).
fn ep(rail: u32, ip: [u8; 4], prefix: u32, link_layer: &str) -> pb::Endpoint {
    let mut gid = vec![0u8; 16];
    gid[10] = 0xff;
    gid[11] = 0xff;
    gid[12..].copy_from_slice(&ip);
    pb::Endpoint {
        kind: Some(pb::endpoint::Kind::Verbs(pb::VerbsEndpoint {
            qpn: 0x100 + rail,
            psn: 7,
            gid,
            gid_index: 1,
            lid: 1,
            port: 1,
            mtu: 1024,
            max_rd_atomic: 16,
            gid_type: "RoCEv2".into(),
            link_layer: link_layer.into(),
            rail,
            device: format!("fake{rail}"),
            ipv4_prefix: prefix,
        })),
    }
}

/// An address on the same subnet as `ip` that is not `ip`.
fn neighbour(ip: [u8; 4]) -> [u8; 4] {
    [ip[0], ip[1], ip[2], if ip[3] == 200 { 201 } else { 200 }]
}

fn offer(id: &str, endpoints: Vec<pb::Endpoint>) -> pb::PeerConnectRequest {
    pb::PeerConnectRequest { fabric: pb::FabricKind::Verbs as i32, endpoints, ..connect_req(id) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn hostile_offers_to_a_two_device_responder() {
    let (b, facts) = responder().await;
    let mut p = b.peer_client().await;
    let accepted = gauge(&b, "xfer_accepted_connections");
    let (ip0, pre0) = facts[0];
    let (ip1, pre1) = facts[1];
    let cases: Vec<(&str, Vec<pb::Endpoint>, &str)> = vec![
        // Every rail on a subnet B has no device on.
        ("far", vec![ep(0, [192, 0, 2, 1], 24, "Ethernet"), ep(9, [198, 51, 100, 1], 24, "Ethernet")], "reaches any"),
        // B's own subnets, but another link layer.
        ("ib", vec![ep(0, neighbour(ip0), pre0, "InfiniBand"), ep(1, neighbour(ip1), pre1, "InfiniBand")], "reaches any"),
        // A subnet of B's, claimed with a prefix that puts B's address outside it.
        ("narrow", vec![ep(0, [ip0[0], ip0[1], ip0[2] ^ 0x80, 1], 32, "Ethernet")], "reaches any"),
    ];
    for (id, eps, says) in cases {
        let e = p.connect(offer(id, eps)).await.expect_err(id);
        assert!(e.message().contains(says), "{id}: {}", e.message());
    }
    assert_eq!(gauge(&b, "xfer_accepted_connections"), accepted, "no refused offer left a connection");
    // The refused ids were never taken: an offer B reaches may use one, one rail per device.
    let good = vec![ep(5, neighbour(ip0), pre0, "Ethernet"), ep(63, neighbour(ip1), pre1, "Ethernet")];
    let answer = p.connect(offer("far", good)).await.expect("an offer both devices reach").into_inner();
    let rails: Vec<u32> = answer
        .endpoints
        .iter()
        .map(|e| match &e.kind {
            Some(pb::endpoint::Kind::Verbs(v)) => v.rail,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(rails, vec![5, 63], "answered under the offer's own rail numbers");
    assert_eq!(gauge(&b, "xfer_accepted_connections"), accepted + 1.0);
    offers_racing_under_one_id_leave_one_connection(&b, &facts).await;
}

/// Eight offers under one id at once (one agent, started once: starting agents is slow under
/// TCG): exactly one holds the id, and its answer is whole. (The made-up peer has no address
/// on the link, so B's QPs never reach RTR: no grant is asked on it.)
async fn offers_racing_under_one_id_leave_one_connection(b: &Agent, facts: &[([u8; 4], u32)]) {
    let accepted = gauge(b, "xfer_accepted_connections");
    let (ip0, pre0) = facts[0];
    let (ip1, pre1) = facts[1];
    let good = vec![ep(0, neighbour(ip0), pre0, "Ethernet"), ep(1, neighbour(ip1), pre1, "Ethernet")];
    let mut calls = Vec::new();
    for _ in 0..8 {
        let mut p = b.peer_client().await;
        let req = offer("contested", good.clone());
        calls.push(tokio::spawn(async move { p.connect(req).await }));
    }
    let mut won = 0;
    for c in calls {
        match c.await.unwrap() {
            // The winner's answer is whole: one endpoint per rail.
            Ok(a) => {
                won += 1;
                assert_eq!(a.into_inner().endpoints.len(), 2);
            }
            Err(e) => assert!(e.message().contains("already"), "{}", e.message()),
        }
    }
    assert_eq!(won, 1, "exactly one offer holds the id");
    assert_eq!(gauge(b, "xfer_accepted_connections"), accepted + 1.0);
}
