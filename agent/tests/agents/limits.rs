//! Limits (DESIGN §8): every limit, driven past its value through real agents configured with
//! `XFER_LIMITS__*`, answers RESOURCE_EXHAUSTED (the gRPC message size: see
//! `oversized_messages_are_refused_and_the_agent_keeps_serving`), and the agent keeps serving.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_regions_and_max_registered_bytes() {
    let a = Agent::start_env("node-a", &[("XFER_LIMITS__MAX_REGIONS", "2"), ("XFER_LIMITS__MAX_REGISTERED_BYTES", "1MiB")]);
    let mut c = a.client().await;
    c.create_region(anon("r1", 4096)).await.unwrap();
    c.create_region(anon("r2", 4096)).await.unwrap();
    let e = c.create_region(anon("r3", 4096)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("max_regions"), "{e:?}");
    c.delete_region(pb::DeleteRegionRequest { name: "r1".into() }).await.unwrap();

    // 4 KiB is registered; 1 MiB more would pass the 1 MiB limit.
    let e = c.create_region(anon("big", 1 << 20)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("max_registered_bytes"), "{e:?}");
    // Exactly up to the limit is fine, and the agent keeps serving.
    c.create_region(anon("fits", (1 << 20) - 4096)).await.unwrap();
    let list = c.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner();
    assert_eq!(list.regions.len(), 2);
    // The CLI exits 7 for RESOURCE_EXHAUSTED.
    let o = a.ctl(&["region", "create", "r9", "--size", "4KiB"]);
    assert_eq!(o.status.code(), Some(7), "{o:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_grants_per_peer_directly_and_through_a_submit() {
    let a = Agent::start("node-a");
    let b = Agent::start_env("node-b", &[("XFER_LIMITS__MAX_GRANTS_PER_PEER", "2")]);
    a.create("src", 1 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let _session = b.data_session("c1").await;
    let mut p = b.peer_client().await;
    let g1 = p.grant(grant_req("dst", "node-a", "c1", pb::Access::Write)).await.unwrap().into_inner();
    p.grant(grant_req("dst", "node-a", "c1", pb::Access::Write)).await.unwrap();
    let e = p.grant(grant_req("dst", "node-a", "c1", pb::Access::Write)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("max_grants_per_peer"), "{e:?}");
    // The limit is keyed on who calls (in plaintext: the address, every loopback address being
    // one caller), not on the name it declares. Per-identity quotas with certificates:
    // tests/security.rs.
    let e = p.grant(grant_req("dst", "node-z", "c1", pb::Access::Write)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "a declared name is not a new quota: {e:?}");

    // Agent A on loopback is the same caller: its submit needs a third grant from B, and
    // RESOURCE_EXHAUSTED reaches the caller.
    let mut c = a.client().await;
    let e = c.submit_transfer(write_req("src", &b, "dst", 4096)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    // Freeing one grant makes room; the transfer succeeds (and its grant is released again).
    p.revoke(pb::RevokeRequest { grant_id: g1.grant_id }).await.unwrap();
    let t = a.transfer(write_req("src", &b, "dst", 1 << 20)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    let t = a.transfer(write_req("src", &b, "dst", 1 << 20)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "grant returned after completion: {t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_transfers_holds_under_concurrent_submits() {
    let a = Agent::start_env("node-a", &[("XFER_LIMITS__MAX_TRANSFERS", "2")]);
    let (b, c) = (Agent::start("node-b"), Agent::start("node-c"));
    a.create("src", 64 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 64 << 20, pb::Access::ReadWrite).await;
    c.create("dst", 64 << 20, pb::Access::ReadWrite).await;

    // Eight slow transfers submitted at once, to two peers: exactly two are admitted.
    let mut tasks = Vec::new();
    for i in 0..8 {
        let mut req = write_req("src", if i % 2 == 0 { &b } else { &c }, "dst", 0);
        make_slow(&mut req);
        let mut client = a.client().await;
        tasks.push(tokio::spawn(async move { client.submit_transfer(req).await }));
    }
    let mut ok = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(r) => ok.push(r.into_inner().id),
            Err(e) => {
                assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
                assert!(e.message().contains("max_transfers"), "{e:?}");
            }
        }
    }
    assert_eq!(ok.len(), 2, "max_transfers = 2 admitted {}", ok.len());
    // A third, after the fact, is refused too; the CLI says 7.
    let o = a.ctl(&["cp", "src", &format!("{}:dst", b.addr()), "--len", "4KiB"]);
    assert_eq!(o.status.code(), Some(7), "{o:?}");

    // Cancel one: room for exactly one more, which completes.
    a.client().await.cancel_transfer(pb::CancelTransferRequest { id: ok[0].clone() }).await.unwrap();
    assert_eq!(watch_to_end(&a, &ok[0]).await.state, pb::TransferState::Cancelled as i32);
    let t = a.transfer(write_req("src", &c, "dst", 1 << 20)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    a.client().await.cancel_transfer(pb::CancelTransferRequest { id: ok[1].clone() }).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_transfers_per_peer_limits_one_peer_only() {
    let a = Agent::start_env("node-a", &[("XFER_LIMITS__MAX_TRANSFERS_PER_PEER", "1")]);
    let (b, c) = (Agent::start("node-b"), Agent::start("node-c"));
    a.create("src", 64 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 64 << 20, pb::Access::ReadWrite).await;
    c.create("dst", 64 << 20, pb::Access::ReadWrite).await;
    let mut req = write_req("src", &b, "dst", 0);
    make_slow(&mut req);
    let mut cl = a.client().await;
    let slow = cl.submit_transfer(req.clone()).await.unwrap().into_inner();
    wait_progress(&a, &slow.id).await;

    let e = cl.submit_transfer(req).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("max_transfers_per_peer"), "{e:?}");
    // Another peer is not affected.
    let t = a.transfer(write_req("src", &c, "dst", 4 << 20)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    // Once the slow one ends, B takes a transfer again.
    cl.cancel_transfer(pb::CancelTransferRequest { id: slow.id.clone() }).await.unwrap();
    watch_to_end(&a, &slow.id).await;
    let t = a.transfer(write_req("src", &b, "dst", 4 << 20)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
}

/// tonic refuses a message above `max_decoding_message_size` while decoding, before the handler
/// runs, with OUT_OF_RANGE; a layer in `service/` rewrites exactly that to RESOURCE_EXHAUSTED
/// (what grpc-go and grpc-core answer, and what the design asks for).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_messages_are_refused_and_the_agent_keeps_serving() {
    const LIMIT: usize = 256 << 10;
    let oversized_code = Code::ResourceExhausted;
    let a = Agent::start_env("node-a", &[("XFER_LIMITS__MAX_MESSAGE_SIZE", "256KiB")]);
    a.create("r", 1 << 20, pb::Access::ReadWrite).await;

    // WriteRegion: one 512 KiB message in the stream.
    let msg = pb::WriteRegionRequest { region: "r".into(), offset: 0, data: vec![7u8; 2 * LIMIT] };
    let e = a.client().await.write_region(futures::stream::iter(vec![msg])).await.unwrap_err();
    assert_eq!(e.code(), oversized_code, "{e:?}");
    assert!(e.message().contains("too large"), "{e:?}");
    assert!(a.read("r", 0, 16).await == vec![0u8; 16], "nothing written");

    // Peer.Grant with a region name far past the limit.
    let _session = a.data_session("c1").await;
    let mut g = grant_req("r", "node-x", "c1", pb::Access::Write);
    g.region = "x".repeat(LIMIT + 1);
    let e = a.peer_client().await.grant(g).await.unwrap_err();
    assert_eq!(e.code(), oversized_code, "{e:?}");

    // Messages under the limit work on the same agent.
    let data = random_bytes(LIMIT / 2, 3);
    let msgs = vec![pb::WriteRegionRequest { region: "r".into(), offset: 0, data: data.clone() }];
    let w = a.client().await.write_region(futures::stream::iter(msgs)).await.unwrap().into_inner();
    assert_eq!(w.bytes_written, data.len() as u64);
    assert!(a.read("r", 0, data.len() as u64).await == data);
    a.peer_client().await.grant(grant_req("r", "node-x", "c1", pb::Access::Write)).await.unwrap();
}
