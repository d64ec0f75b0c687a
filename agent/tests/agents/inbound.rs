//! Inbound transfer records (`Peer.Complete`) are their own namespace, keyed by the authenticated
//! peer: a forged, oversized or duplicate Complete can neither replace nor hide another record,
//! and the history stays bounded (the host-safety issue, bullet 4). Real agents on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_complete_cannot_replace_or_hide_an_outbound_transfer() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    a.create("src", 256 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 256 << 20, pb::Access::ReadWrite).await;
    let mut req = write_req("src", &b, "dst", 0);
    make_slow(&mut req);
    let mut c = a.client().await;
    let t = c.submit_transfer(req).await.unwrap().into_inner();
    wait_progress(&a, &t.id).await;

    // The attacker completes a grant of its own on A under the running transfer's id.
    let _session = a.data_session("c1").await;
    let mut p = a.peer_client().await;
    let g = p.grant(grant_req("src", "node-x", "c1", pb::Access::Write)).await.unwrap().into_inner();
    p.complete(complete_req(&g.grant_id, &t.id, 4096, "node-x")).await.unwrap();

    // The outbound record is untouched and still counted, watched and cancellable.
    let got = c.get_transfer(pb::GetTransferRequest { id: t.id.clone() }).await.unwrap().into_inner();
    assert!(!got.inbound && got.state == pb::TransferState::Running as i32, "{got:?}");
    let list = c.list_transfers(pb::ListTransfersRequest {}).await.unwrap().into_inner().transfers;
    let inbound: Vec<_> = list.iter().filter(|r| r.inbound).collect();
    assert_eq!(inbound.len(), 1);
    assert_eq!(inbound[0].id, format!("loopback/{}", t.id), "inbound ids are PEER/ID");
    assert_eq!(list.iter().filter(|r| r.id == t.id).count(), 1);
    let cancelled = c.cancel_transfer(pb::CancelTransferRequest { id: t.id.clone() }).await.unwrap().into_inner();
    assert!(!cancelled.inbound);
    let end = watch_to_end(&a, &t.id).await;
    assert_eq!(end.state, pb::TransferState::Cancelled as i32, "{end:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_and_duplicate_ids_are_refused_and_change_nothing() {
    let b = Agent::start("node-b");
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let _session = b.data_session("c1").await;
    let mut p = b.peer_client().await;
    let g = p.grant(grant_req("dst", "node-x", "c1", pb::Access::Write)).await.unwrap().into_inner();
    for bad in ["", "a/b", "x y", "ü", &"i".repeat(65)] {
        let e = p.complete(complete_req(&g.grant_id, bad, 4096, "node-x")).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad:?}: {e:?}");
    }
    // A 12 MiB id (under the 16 MiB message limit) is refused before anything keeps it, and the
    // refusal does not echo it.
    let e = p.complete(complete_req(&g.grant_id, &"i".repeat(12 << 20), 4096, "node-x")).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().len() < 200, "{}", e.message().len());
    // The grant survived all of that: the first valid Complete works.
    p.complete(complete_req(&g.grant_id, "t-1", 4096, "node-x")).await.unwrap();

    // A second Complete under the same id, with another grant: ALREADY_EXISTS; the first record
    // keeps its bytes, and the second grant is still live (its owner can revoke it).
    let g2 = p.grant(grant_req("dst", "node-x", "c1", pb::Access::Write)).await.unwrap().into_inner();
    let e = p.complete(complete_req(&g2.grant_id, "t-1", 1, "node-x")).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    let rec = b.client().await.get_transfer(pb::GetTransferRequest { id: "loopback/t-1".into() }).await.unwrap().into_inner();
    assert_eq!((rec.length, rec.inbound), (4096, true), "{rec:?}");
    p.revoke(pb::RevokeRequest { grant_id: g2.grant_id }).await.unwrap();
    let list = b.client().await.list_transfers(pb::ListTransfersRequest {}).await.unwrap().into_inner().transfers;
    assert_eq!(list.len(), 1, "{list:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_history_is_bounded_and_listable() {
    let b = Agent::start("node-b");
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let _session = b.data_session("c1").await;
    let mut p = b.peer_client().await;
    let n = 1100;
    for i in 0..n {
        let g = p.grant(grant_req("dst", "node-x", "c1", pb::Access::Write)).await.unwrap().into_inner();
        // Longest valid ids, so the bound is tested at its largest records.
        let id = format!("{i:0>64}");
        p.complete(complete_req(&g.grant_id, &id, 4096, "node-x")).await.unwrap();
    }
    let list = b.client().await.list_transfers(pb::ListTransfersRequest {}).await.unwrap().into_inner().transfers;
    assert_eq!(list.len(), 1000, "history bound");
    // The oldest were forgotten, the newest kept.
    assert!(list.iter().all(|r| r.inbound));
    assert_eq!(list.last().unwrap().id, format!("loopback/{:0>64}", n - 1));
    assert!(!list.iter().any(|r| r.id == format!("loopback/{:0>64}", 0)));
}

/// `Peer.Complete`'s spans (what a batch's checksum covers at the target) are checked against the
/// grant before any memory is read: outside it, overflowing, empty, not adding up to `bytes`,
/// more of them than `transfer.max_segments`, or more than four passes over the grant, each is
/// refused, and nothing changed (no record, the grant still live). Spans that fit sum the grant's
/// bytes in the order given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_spans_outside_their_grant_are_refused_and_change_nothing() {
    let b = Agent::start("node-b");
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let mut c = b.client().await;
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 256) as u8).collect();
    b.put("dst", 0, &pattern).await;
    let _session = b.data_session("c1").await;
    let mut p = b.peer_client().await;
    let g = p.grant(grant_req("dst", "node-x", "c1", pb::Access::Write)).await.unwrap().into_inner();
    let spanned = |spans: Vec<(u64, u64)>, bytes: u64| pb::CompleteRequest {
        has_checksum: true,
        checksum: 1,
        algo: pb::ChecksumAlgo::Xxh3 as i32,
        spans: spans.into_iter().map(|(offset, length)| pb::GrantSpan { offset, length }).collect(),
        ..complete_req(&g.grant_id, "t-spans", bytes, "node-x")
    };
    type Spans = Vec<(u64, u64)>;
    let cases: Vec<(Spans, u64, Code, &str)> = vec![
        (vec![(4000, 200)], 200, Code::InvalidArgument, "outside the grant"),
        (vec![(u64::MAX - 10, 100)], 100, Code::InvalidArgument, "outside the grant"),
        (vec![(0, 0), (0, 10)], 10, Code::InvalidArgument, "empty"),
        (vec![(0, 100), (200, 100)], 300, Code::InvalidArgument, "add up to 200"),
        (vec![(0, 4096); 5], 5 * 4096, Code::InvalidArgument, "passes over the grant"),
        (vec![(0, 1); 100_000], 100_000, Code::ResourceExhausted, "transfer.max_segments"),
    ];
    for (spans, bytes, code, why) in cases {
        let n = spans.len();
        let e = p.complete(spanned(spans, bytes)).await.unwrap_err();
        assert_eq!(e.code(), code, "{n} spans: {e:?}");
        assert!(e.message().contains(why), "{n} spans: {}", e.message());
    }
    let list = c.list_transfers(pb::ListTransfersRequest {}).await.unwrap().into_inner().transfers;
    assert!(list.is_empty(), "a refused Complete recorded something: {list:?}");

    // The grant survived: spans that fit sum the bytes in their order (the second half first).
    let order = [&pattern[2048..], &pattern[..2048]].concat();
    let mut ok = spanned(vec![(2048, 2048), (0, 2048)], 4096);
    ok.checksum = xxhash_rust::xxh3::xxh3_64(&order);
    let v = p.complete(ok).await.unwrap().into_inner();
    assert!(v.checksum_matched, "{v:?}");
    let rec = c.get_transfer(pb::GetTransferRequest { id: "loopback/t-spans".into() }).await.unwrap().into_inner();
    assert!(rec.inbound && rec.verified, "{rec:?}");
}
