//! Red-team findings against the trust boundary (SECURITY.md "What the agent promises"): each
//! test is an attack that worked against the agent at the commit that closed the trust boundary,
//! run against real agents on loopback. Each asserts the refusal *and* that nothing else changed.
//! Attacks that did not work are listed in the red-team report, not here (security.rs covers the
//! baseline). Tests marked `#[ignore = "known gap: …"]` document an open break.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::pki::{ip, role_uri, uri, Pki};
use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

// ------------------------------------------------------------------ promise 2: roles from certificates

/// A certificate carrying two role URIs (a client and a node URI, say: an issuer whose policy
/// checks that *one* requested SAN is allowed) got whichever role its issuer listed first: with
/// the node URI first, a would-be client called `xfer.v1.Peer`. An SVID carries exactly one URI
/// SAN; conflicting role URIs now carry no role, in either order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_with_conflicting_role_uris_gets_nothing() {
    let pki = Pki::new();
    pki.leaf("node-first", vec![uri(&role_uri("node", "app")), uri(&role_uri("client", "app"))]);
    pki.leaf("client-first", vec![uri(&role_uri("client", "app")), uri(&role_uri("node", "app"))]);
    pki.leaf("two-nodes", vec![uri(&role_uri("node", "node-a")), uri(&role_uri("node", "node-c"))]);
    let (b, _t) = pki.agent("node-b");
    pki.agent_client(&b, "xferctl").await.create_region(anon("dst", 1 << 20)).await.unwrap();
    for who in ["node-first", "client-first", "two-nodes"] {
        let ch = pki.channel(&b.addr(), "ca.crt", Some(who)).await.unwrap();
        let e = xfer_proto::v1::peer_client::PeerClient::new(ch.clone()).connect(connect_req(&format!("c-{who}"))).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{who}: {e:?}");
        assert!(e.message().contains("conflicting"), "{who}: {e:?}");
        let e = xfer_proto::v1::agent_client::AgentClient::new(ch).get_info(pb::GetInfoRequest {}).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{who}: {e:?}");
    }
    // Nothing was made on their behalf; a plain node still connects and is granted.
    let mut node = pki.peer(&b, "node-a").await;
    node.connect(connect_req("ok")).await.unwrap();
    node.grant(grant_req("dst", "whoever", "ok", pb::Access::Write)).await.unwrap();
    assert!(scrape(&b).lines().any(|l| l == "xfer_grants_active 1"), "{}", scrape(&b));
}

// ------------------------------------------------------------------ promise 3: keys and addresses

/// SECURITY.md: "rkeys and registered addresses never leave the agent except in a grant …
/// GetRegion/ListRegions show them only in grant mode `region`". They showed the registered
/// address (the region's virtual address in the agent: an ASLR leak) and, on verbs, the region
/// MR's rkey, in every mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_show_no_keys_or_addresses_outside_grant_mode_region() {
    let b = Agent::start("node-b");
    let created = b.create("r", 4096, pb::Access::ReadWrite).await;
    let mut c = b.client().await;
    let got = c.get_region(pb::GetRegionRequest { name: "r".into() }).await.unwrap().into_inner();
    let listed = c.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner().regions;
    for r in [&created, &got, &listed[0]] {
        assert_eq!((r.rkey, r.addr), (0, 0), "{r:?}");
    }
    // The region is otherwise intact and a grant still carries a usable address.
    assert_eq!((got.name.as_str(), got.length), ("r", 4096));
    let mut p = b.peer_client().await;
    p.connect(connect_req("c1")).await.unwrap();
    let g = p.grant(grant_req("r", "whoever", "c1", pb::Access::Write)).await.unwrap().into_inner();
    assert_ne!(g.addr, 0);
}

// ------------------------------------------------------------------ promise 4: grants die with their connection

/// A `Peer.Grant` racing the `Peer.Disconnect` of its connection could be inserted after the
/// disconnect had revoked the connection's grants: the grant outlived its connection, and since
/// a grant is bound to a connection *id* (which callers choose), its token worked on the streams
/// of the next connection made under that id, by any identity. (A race: without the fix this
/// test caught it in about three runs out of four; with it, no grant can survive.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_racing_disconnect_does_not_outlive_its_connection() {
    let b = Agent::start("node-b");
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let before = random_bytes(1 << 20, 23);
    b.put("dst", 0, &before).await;
    // Grants and disconnects on separate HTTP/2 connections, so the agent serves them in parallel.
    let p = b.peer_client().await;
    let pd = b.peer_client().await;
    let mut survivors = Vec::new();
    for i in 0..300 {
        let id = format!("race-{i}");
        p.clone().connect(connect_req(&id)).await.unwrap();
        // Sixteen grants against one disconnect: some land in the window between the connection
        // lookup and the grant's insertion.
        let grants: Vec<_> = (0..16)
            .map(|_| {
                let (mut pg, gid) = (p.clone(), id.clone());
                tokio::spawn(async move { pg.grant(grant_req("dst", "whoever", &gid, pb::Access::Write)).await })
            })
            .collect();
        pd.clone().disconnect(pb::DisconnectRequest { connection_id: id.clone(), node_name: String::new() }).await.unwrap();
        for g in grants {
            if let Ok(r) = g.await.unwrap() {
                survivors.push((id.clone(), r.into_inner()));
            }
        }
    }
    assert!(!survivors.is_empty(), "no grant won the race: the test proves nothing");
    // Every connection is gone, so is every grant.
    assert!(scrape(&b).lines().any(|l| l == "xfer_grants_active 0"), "{}", scrape(&b));
    // And a new connection under a raced id cannot use the old token.
    survivors.dedup_by(|a, b| a.0 == b.0);
    for (id, g) in survivors.iter().take(20) {
        let mut s = b.data_stream(id).await;
        let token: [u8; 16] = g.token.as_slice().try_into().unwrap();
        assert_eq!(raw_write(&mut s, token, g.addr, &[0xee; 64]), (10, Kind::Nak), "{id}: REM_ACCESS_ERR");
    }
    assert!(b.read("dst", 0, 1 << 20).await == before, "bytes changed");
}

// ------------------------------------------------------------------ promise 5: labels keyed on identity

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_initiator_labels_a_target_by_its_certificate_not_its_claim() {
    // An agent whose certificate says node-b runs with node_name "node-c" (any name it likes):
    // A's record (and its `peer` metric label) for the transfer to it says what the certificate
    // says, which A's pool read in its own TLS handshake.
    let pki = Pki::new();
    pki.leaf("node-c", vec![uri(&role_uri("node", "node-b")), ip("127.0.0.1")]);
    let (a, _ta) = pki.agent("node-a");
    let (b, _tb) = pki.agent("node-c");
    let mut ca = pki.agent_client(&a, "xferctl").await;
    ca.create_region(anon("src", 4096)).await.unwrap();
    pki.agent_client(&b, "xferctl").await.create_region(anon("dst", 4096)).await.unwrap();
    let t = ca.submit_transfer(write_req("src", &b, "dst", 4096)).await.unwrap().into_inner();
    let mut w = ca.watch_transfer(pb::WatchTransferRequest { id: t.id }).await.unwrap().into_inner();
    let mut t = None;
    while let Some(m) = w.message().await.unwrap() {
        t = Some(m);
    }
    let t = t.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert_eq!(t.peer, "node-b", "the target's certificate says node-b: {t:?}");
    let peers = ca.list_peers(pb::ListPeersRequest {}).await.unwrap().into_inner().peers;
    assert_eq!(peers.iter().map(|p| p.node_name.as_str()).collect::<Vec<_>>(), ["node-b"]);
}
// ------------------------------------------------------------------ promise 7: no panics on input

/// `Agent.Connect` took `qps` from the request unchecked (SubmitTransfer checks 1-64): a client
/// asking for 2^32-1 QPs made the tcp fabric reserve a vector of that many streams, and the
/// allocation failure aborted the agent. `Bench` (admin) had the same hole for `qps` and `depth`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_and_bench_refuse_absurd_qps_instead_of_aborting() {
    let pki = Pki::new();
    let (a, _ta) = pki.agent("node-a");
    let (b, _tb) = pki.agent("node-b");
    let mut client = pki.agent_client(&a, "xferctl").await;
    client.create_region(anon("keep", 4096)).await.unwrap();

    let e = client.connect(pb::ConnectRequest { peer: b.addr(), qps: u32::MAX }).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("qps"), "{e:?}");
    let mut admin = pki.agent_client(&a, "admin").await;
    for (qps, depth) in [(u32::MAX, 1), (65, 1), (1, u32::MAX)] {
        let req = pb::BenchRequest { peer: b.addr(), op: pb::Op::Write as i32, size: 4096, iters: 1, qps, depth, ..Default::default() };
        let e = admin.bench(req).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "qps {qps} depth {depth}: {e:?}");
    }

    // The agent is still up, with its state, and sane values still work.
    let mut client = pki.agent_client(&a, "xferctl").await;
    let names: Vec<String> =
        client.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner().regions.into_iter().map(|r| r.name).collect();
    assert_eq!(names, ["keep"]);
    client.connect(pb::ConnectRequest { peer: b.addr(), qps: 2 }).await.unwrap();
    // No scratch region was left behind on B by the refused benchmarks.
    let on_b = pki.agent_client(&b, "xferctl").await.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner().regions;
    assert!(on_b.is_empty(), "{on_b:?}");
}

// ------------------------------------------------------------------ a peer's Complete and other callers' records

/// `Peer.Complete` inserted its inbound record under the `transfer_id` the peer sent, replacing
/// whatever record had that id: a node that learned a transfer id (every target learns the
/// initiator's ids in `Complete`) could replace the record of a client's transfer on the
/// initiator (GetTransfer/WatchTransfer then showed the forger's record, and CancelTransfer
/// cancelled nothing), and an agent writing to itself lost its own outbound record. The id was
/// not validated either (any length).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_cannot_replace_another_callers_transfer_record() {
    let pki = Pki::new();
    let (a, _ta) = pki.agent("node-a");
    let (b, _tb) = pki.agent("node-b");
    let mut ca = pki.agent_client(&a, "xferctl").await;
    let mut cb = pki.agent_client(&b, "xferctl").await;
    ca.create_region(anon("src", 64 << 10)).await.unwrap();
    ca.create_region(anon("bait", 4096)).await.unwrap();
    cb.create_region(anon("dst", 64 << 10)).await.unwrap();
    let data = random_bytes(64 << 10, 21);
    let msg = pb::WriteRegionRequest { region: "src".into(), offset: 0, data: data.clone() };
    ca.write_region(futures::stream::iter(vec![msg])).await.unwrap();

    // The client's transfer A -> B.
    let mut req = write_req("src", &b, "dst", 64 << 10);
    req.remote.as_mut().unwrap().agent = b.addr();
    let t = ca.submit_transfer(req).await.unwrap().into_inner();
    let mut w = ca.watch_transfer(pb::WatchTransferRequest { id: t.id.clone() }).await.unwrap().into_inner();
    let mut done = t.clone();
    while let Some(m) = w.message().await.unwrap() {
        done = m;
    }
    assert_eq!(done.state, pb::TransferState::Succeeded as i32, "{done:?}");

    // node-c (a valid node certificate, as any target of A's transfers would be) asks A for a
    // grant and completes it under the client's transfer id.
    let mut evil = pki.peer(&a, "node-c").await;
    evil.connect(connect_req("evil")).await.unwrap();
    let g = evil.grant(grant_req("bait", "whoever", "evil", pb::Access::Write)).await.unwrap().into_inner();
    let _ = evil
        .complete(pb::CompleteRequest {
            transfer_id: t.id.clone(),
            grant_id: g.grant_id,
            bytes: 4096,
            op: pb::Op::Write as i32,
            node_name: "node-b".into(),
            has_checksum: true,
            checksum: 1,
            algo: pb::ChecksumAlgo::Xxh3 as i32,
            success: true,
            spans: vec![],
        })
        .await;

    // The client's record is untouched: still the outbound, succeeded write to B.
    let now = ca.get_transfer(pb::GetTransferRequest { id: t.id.clone() }).await.unwrap().into_inner();
    assert!(!now.inbound, "the record was replaced by node-c's inbound record: {now:?}");
    assert_eq!((now.state, now.peer.as_str(), now.bytes_done), (done.state, done.peer.as_str(), done.bytes_done), "{now:?}");
    let list = ca.list_transfers(pb::ListTransfersRequest {}).await.unwrap().into_inner().transfers;
    assert_eq!(list.iter().filter(|x| x.id == t.id).count(), 1, "{list:?}");
    assert!(cb.read_region(pb::ReadRegionRequest { region: "dst".into(), offset: 0, length: 0 }).await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_validates_the_transfer_id() {
    let b = Agent::start("node-b");
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let mut p = b.peer_client().await;
    p.connect(connect_req("c1")).await.unwrap();
    let g = p.grant(grant_req("dst", "whoever", "c1", pb::Access::Write)).await.unwrap().into_inner();
    for bad in [String::new(), "x".repeat(1 << 20), "a b".into(), "é".into()] {
        let e = p
            .complete(pb::CompleteRequest {
                transfer_id: bad.clone(),
                grant_id: g.grant_id.clone(),
                bytes: 4096,
                op: pb::Op::Write as i32,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{:?}: {e:?}", &bad[..bad.len().min(8)]);
    }
    // Nothing was recorded, and the grant is still live (a good id completes it).
    let list = b.client().await.list_transfers(pb::ListTransfersRequest {}).await.unwrap().into_inner().transfers;
    assert!(list.is_empty(), "{list:?}");
    p.complete(pb::CompleteRequest {
        transfer_id: "t-1".into(),
        grant_id: g.grant_id,
        bytes: 4096,
        op: pb::Op::Write as i32,
        ..Default::default()
    })
    .await
    .unwrap();
}

/// An agent writing to itself (peer = its own address) used to lose its outbound record to the
/// inbound one of the same id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_to_the_agent_itself_keeps_its_outbound_record() {
    let a = Agent::start("node-a");
    a.create("src", 64 << 10, pb::Access::ReadWrite).await;
    a.create("dst", 64 << 10, pb::Access::ReadWrite).await;
    let data = random_bytes(64 << 10, 22);
    a.put("src", 0, &data).await;
    let done = a.transfer(write_req("src", &a, "dst", 64 << 10)).await.unwrap();
    assert_eq!(done.state, pb::TransferState::Succeeded as i32);
    let t = a.client().await.get_transfer(pb::GetTransferRequest { id: done.id.clone() }).await.unwrap().into_inner();
    assert!(!t.inbound, "{t:?}");
    assert_eq!(t.remote.as_ref().unwrap().region, "dst");
    let list = a.client().await.list_transfers(pb::ListTransfersRequest {}).await.unwrap().into_inner().transfers;
    assert_eq!(list.len(), 2, "one outbound and one inbound record: {list:?}");
    assert_eq!(list.iter().filter(|t| t.inbound).count(), 1, "{list:?}");
    assert!(a.read("dst", 0, 64 << 10).await == data);
}
