//! Red team, fairness: one authenticated client that takes all it can of a global limit must
//! leave another client's *first* request served (`limits.tenant_share`). Real agents with mTLS
//! on loopback; two client identities, `xferctl` (the hoarder) and `tenant-b` (the victim). Each
//! test asserts the hoarder's refusal (RESOURCE_EXHAUSTED naming the share), the victim's
//! service, and that the refusal changed nothing (counts, bytes).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::chan::{open_msg_qps, try_open_with};
use crate::common::pki::{role_uri, uri, Pki};
use crate::common::*;
use tonic::transport::Channel;
use tonic::Code;
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;

fn pki() -> Pki {
    let pki = Pki::new();
    pki.leaf("tenant-b", vec![uri(&role_uri("client", "tenant-b"))]);
    pki
}

fn share_refusal(e: &tonic::Status) {
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("tenant_share") && e.message().contains("client/xferctl"), "names the share and who holds it: {e:?}");
}

async fn region_count(c: &mut AgentClient<Channel>) -> usize {
    c.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner().regions.len()
}

fn refused(a: &Agent, limit: &str) -> f64 {
    labelled(&scrape(a), "xfer_tenant_share_refused_total", &[("limit", limit)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_take_every_region_slot() {
    let pki = pki();
    let (a, _t) = pki.agent_with("node-a", "[limits]\nmax_regions = 8\n", "", &[]);
    let mut hoarder = pki.agent_client(&a, "xferctl").await;
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    for i in 0..4 {
        hoarder.create_region(anon(&format!("h{i}"), 4096)).await.unwrap();
    }
    let e = hoarder.create_region(anon("h4", 4096)).await.unwrap_err();
    share_refusal(&e);
    assert_eq!(region_count(&mut hoarder).await, 4, "the refused region does not exist");
    assert_eq!(refused(&a, "regions"), 1.0);
    // The victim's first region (and as many as its own share) are served.
    for i in 0..4 {
        victim.create_region(anon(&format!("v{i}"), 4096)).await.unwrap();
    }
    // A deleted region gives its share back.
    hoarder.delete_region(pb::DeleteRegionRequest { name: "h0".into() }).await.unwrap();
    hoarder.create_region(anon("h4", 4096)).await.unwrap();
    assert_eq!(region_count(&mut victim).await, 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_register_every_byte() {
    let pki = pki();
    let (a, _t) = pki.agent_with("node-a", "[limits]\nmax_registered_bytes = \"1MiB\"\n", "", &[]);
    let mut hoarder = pki.agent_client(&a, "xferctl").await;
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    hoarder.create_region(anon("big", 512 << 10)).await.unwrap();
    let e = hoarder.create_region(anon("more", 4096)).await.unwrap_err();
    share_refusal(&e);
    assert_eq!(refused(&a, "registered_bytes"), 1.0);
    let info = victim.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.registered_bytes, 512 << 10, "the refusal registered nothing");
    victim.create_region(anon("mine", 256 << 10)).await.unwrap();
    // A region larger than the whole share is refused before anything is mapped.
    let e = victim.create_region(anon("huge", 768 << 10)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_hold_every_watch_inbound_place() {
    let pki = pki();
    // 256 places in all; a share of 0.1 is 25 per identity.
    let (a, _t) = pki.agent_with("node-a", "[limits]\ntenant_share = 0.1\n", "", &[]);
    let mut hoarder = pki.agent_client(&a, "xferctl").await;
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    let mut held = Vec::new();
    for _ in 0..25 {
        held.push(hoarder.watch_inbound(pb::WatchInboundRequest::default()).await.unwrap().into_inner());
    }
    let e = hoarder.watch_inbound(pb::WatchInboundRequest::default()).await.unwrap_err();
    share_refusal(&e);
    assert_eq!(refused(&a, "watchers"), 1.0);
    let _mine = victim.watch_inbound(pb::WatchInboundRequest::default()).await.unwrap();
    // Rings count against the same share.
    let e = hoarder.watch_inbound_ring(pb::WatchInboundRingRequest::default()).await.unwrap_err();
    share_refusal(&e);
    let _ring = victim.watch_inbound_ring(pb::WatchInboundRingRequest::default()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_hold_every_transfer_slot_with_idle_channels() {
    let pki = pki();
    let (a, _ta) = pki.agent_with("node-a", "[limits]\nmax_transfers = 4\n", "", &[]);
    let (b, _tb) = pki.agent("node-b");
    let mut hoarder = pki.agent_client(&a, "xferctl").await;
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    let mut b_owner = pki.agent_client(&b, "xferctl").await;
    hoarder.create_region(anon("src", 64 << 10)).await.unwrap();
    victim.create_region(anon("vsrc", 64 << 10)).await.unwrap();
    b_owner.create_region(anon("dst", 1 << 20)).await.unwrap();

    // Idle channels (no post, a long ttl) hold a transfer slot each.
    let mut held = Vec::new();
    for i in 0..2u64 {
        let mut open = open_msg_qps(pb::Op::Write, "src", &b, "dst", i << 16, 64 << 10, false, 1);
        open.ttl = Some(prost_types::Duration { seconds: 86_400, nanos: 0 });
        held.push(try_open_with(&mut hoarder, open, 4).await.unwrap());
    }
    let open = open_msg_qps(pb::Op::Write, "src", &b, "dst", 2 << 16, 64 << 10, false, 1);
    share_refusal(&try_open_with(&mut hoarder, open, 4).await.err().expect("refused"));
    share_refusal(&hoarder.submit_transfer(write_req("src", &b, "dst", 4096)).await.unwrap_err());
    assert_eq!(refused(&a, "transfers"), 2.0);

    // The victim's first transfer is served, and lands.
    let data = random_bytes(64 << 10, 11);
    let msg = pb::WriteRegionRequest { region: "vsrc".into(), offset: 0, data: data.clone() };
    victim.write_region(futures::stream::iter(vec![msg])).await.unwrap();
    let mut req = write_req("vsrc", &b, "dst", data.len() as u64);
    req.remote.as_mut().unwrap().offset = 512 << 10;
    let t = victim.submit_transfer(req).await.unwrap().into_inner();
    let mut w = victim.watch_transfer(pb::WatchTransferRequest { id: t.id }).await.unwrap().into_inner();
    let mut last = None;
    while let Some(m) = w.message().await.unwrap() {
        last = Some(m);
    }
    assert_eq!(last.unwrap().state, pb::TransferState::Succeeded as i32);
    let mut s = b_owner
        .read_region(pb::ReadRegionRequest { region: "dst".into(), offset: 512 << 10, length: data.len() as u64 })
        .await
        .unwrap()
        .into_inner();
    let mut got = Vec::new();
    while let Some(m) = s.message().await.unwrap() {
        got.extend_from_slice(&m.data);
    }
    assert!(got == data, "the victim's bytes arrived");
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_callers_are_one_trusted_user_and_keep_the_whole_limit() {
    let a = Agent::start_env("node-a", &[("XFER_LIMITS__MAX_REGIONS", "4")]);
    for i in 0..4 {
        a.create(&format!("r{i}"), 4096, pb::Access::ReadWrite).await;
    }
    let e = a.client().await.create_region(anon("r4", 4096)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(e.message().contains("max_regions"), "the global limit, not a share: {e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_cannot_push_another_peers_inbound_records_out_of_the_history() {
    let pki = pki();
    // A history of 1000 records; a share of 0.01 is 10 per peer identity.
    let (b, _t) = pki.agent_with("node-b", "[limits]\ntenant_share = 0.01\n", "", &[]);
    let mut owner = pki.agent_client(&b, "xferctl").await;
    owner.create_region(anon("dst", 1 << 20)).await.unwrap();
    let complete_from = async |node: &str, ids: std::ops::Range<u32>| {
        let mut p = pki.peer(&b, node).await;
        let conn = format!("c-{node}");
        p.connect(connect_req(&conn)).await.unwrap();
        for i in ids {
            let g = p.grant(grant_req("dst", node, &conn, pb::Access::Write)).await.unwrap().into_inner();
            p.complete(complete_req(&g.grant_id, &format!("t-{i}"), 4096, node)).await.unwrap();
        }
    };
    complete_from("node-c", 0..3).await;
    complete_from("node-a", 0..40).await;
    let list = owner.list_transfers(pb::ListTransfersRequest {}).await.unwrap().into_inner().transfers;
    let of = |p: &str| list.iter().filter(|r| r.id.starts_with(&format!("{p}/"))).count();
    assert_eq!(of("node-c"), 3, "node-c's records survive node-a's flood: {list:?}");
    assert_eq!(of("node-a"), 10, "node-a keeps its share, its newest records");
    assert!(list.iter().any(|r| r.id == "node-a/t-39") && !list.iter().any(|r| r.id == "node-a/t-0"));
}
