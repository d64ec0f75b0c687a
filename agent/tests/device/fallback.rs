//! `transfer.fallback = tcp` on two real agents with two links each (the `multi_rail` topology):
//! both links taken down in the middle of a transfer move the rest onto the tcp standby path
//! (the agents' tcp data listeners, on loopback, which a downed veth does not touch), and the
//! transfer completes with every byte verified, the record saying it fell back and the metric
//! counted. While any RDMA link is up nothing goes over tcp. With `never`, `multi_rail`'s
//! `both_links_down_fail_the_transfer_with_a_code` is the other half.
//!
//! On real nodes the fallback's data listener is `data_listen` on the node's primary network.
#![cfg(feature = "verbs")]

use xfer_proto::v1 as pb;

use crate::common::{labelled, metric, scrape, Agent};
use crate::links::{
    agents, assert_blocks, assert_succeeded, device_bytes, down_mid_transfer, finish, links, region, req, submit, Links, MIB,
};

/// Agents A and B on both of their devices, each with the tcp fallback on.
fn agents_with_fallback(l: &Links) -> (Agent, Agent) {
    agents(l, ["fallback-a", "fallback-b"], &[("XFER_TRANSFER__FALLBACK", "tcp")])
}

/// Bytes agent `a` moved over its tcp fallback path.
fn tcp_path_bytes(a: &Agent) -> f64 {
    labelled(&scrape(a), "xfer_path_bytes_total", &[("local_device", "tcp")])
}

#[tokio::test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn with_links_up_nothing_goes_over_the_tcp_fallback() {
    let l = links();
    let (a, b) = agents_with_fallback(&l);
    let base = region(&a, "src", 64, Some(51)).await;
    region(&b, "dst", 64, None).await;
    let info = a.client().await.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.fallback, "tcp", "{info:?}");
    let t = finish(&a, &submit(&a, req(pb::Op::Write, "src", &b, "dst", 64 * MIB)).await).await;
    assert_succeeded(&t, &a);
    assert_blocks(&b, "dst", &base, 64);
    assert!(!t.fallback, "a transfer with its RDMA paths up fell back: {t:?}");
    assert_eq!(tcp_path_bytes(&a), 0.0, "bytes over tcp while RDMA was up: {}", scrape(&a));
    for d in &l.a {
        assert!(device_bytes(&a, d) > 0.0, "no bytes through {d}: {}", scrape(&a));
    }
}

/// Both links down mid-transfer (`op`): the transfer completes over tcp, verified.
async fn falls_back_when_both_links_go_down(op: pb::Op) {
    let l = links();
    let (a, b) = agents_with_fallback(&l);
    // 1 GiB: taking two links down (each `ip link set` and its port event) takes seconds under
    // TCG, and a 256 MiB READ once finished on the second link before it went down (1 failover,
    // nothing over tcp). At tens of MiB/s this leaves most of the transfer to the tcp path.
    const BLOCKS: u64 = 1024;
    let read = op == pb::Op::Read;
    let rb = region(&b, "remote", BLOCKS, read.then_some(53)).await;
    let ra = region(&a, "local", BLOCKS, (!read).then_some(59)).await;
    // The data leaves from the source's end of the second link: B's for a READ.
    let carrier = if read { &l.b_net[1] } else { &l.a_net[1] };
    let both = [l.a_net[0].as_str(), l.a_net[1].as_str()];
    let mid = down_mid_transfer(&a, req(op, "local", &b, "remote", BLOCKS * MIB), carrier, &both).await;
    let t = finish(&a, &mid.id).await;
    assert_succeeded(&t, &a);
    if read {
        assert_blocks(&a, "local", &rb, BLOCKS);
    } else {
        assert_blocks(&b, "remote", &ra, BLOCKS);
    }
    let (tcp, counted) = (tcp_path_bytes(&a), metric(&scrape(&a), "xfer_transfer_fallbacks_total"));
    println!(
        "{op:?} {BLOCKS} MiB: both links down at {} MiB; completed in {:.1} s, {tcp} bytes over tcp",
        mid.at.bytes_done / MIB,
        t.elapsed_seconds
    );
    assert!(t.fallback, "the record does not say it fell back: {t:?}");
    assert!(t.failovers > 0, "{t:?}");
    assert!(tcp > 0.0, "no bytes over the tcp path: {}", scrape(&a));
    assert_eq!(counted, 1.0, "xfer_transfer_fallbacks_total: {}", scrape(&a));
    assert!(a.logs().contains("fell back to tcp"), "no warn line: {}", a.logs());
    mid.restore();
}

#[tokio::test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn a_write_falls_back_to_tcp_when_both_links_go_down() {
    falls_back_when_both_links_go_down(pb::Op::Write).await;
}

/// Both links down in the middle of a READ: the READs outstanding on them are read again over
/// tcp, the record says it fell back, and every byte lands.
#[tokio::test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn a_read_falls_back_to_tcp_when_both_links_go_down() {
    falls_back_when_both_links_go_down(pb::Op::Read).await;
}
