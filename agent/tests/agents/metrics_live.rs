//! `xfer_transfer_bytes_total` counts bytes as they move: a scrape in the middle of a transfer
//! sees what it has moved so far (it used to jump only when the transfer ended), labelled with
//! the direction and the same peer identity both agents use.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::*;
use xfer_proto::v1 as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_bytes_move_while_the_transfer_runs() {
    const LEN: u64 = 64 << 20;
    let a = Agent::start("node-a");
    let b = Agent::start("node-b");
    a.create("big", LEN, pb::Access::ReadWrite).await;
    b.create("big", LEN, pb::Access::ReadWrite).await;
    let mut r = write_req("big", &b, "big", LEN);
    // 4 KiB chunks, one outstanding: a transfer that is still running when the test looks.
    make_slow(&mut r);
    let mut c = a.client().await;
    let t = c.submit_transfer(r).await.unwrap().into_inner();
    let mut w = c.watch_transfer(pb::WatchTransferRequest { id: t.id.clone() }).await.unwrap().into_inner();
    let seen = loop {
        let m = w.message().await.unwrap().expect("the watch ended before any progress");
        if m.bytes_done > 0 {
            break m.bytes_done;
        }
    };
    let series = [("op", "write"), ("direction", "outbound"), ("peer", "loopback")];
    let mid = labelled(&scrape(&a), "xfer_transfer_bytes_total", &series);
    // Cancelled after the scrape, so the scrape saw a running transfer.
    c.cancel_transfer(pb::CancelTransferRequest { id: t.id.clone() }).await.unwrap();
    let mut last = None;
    while let Some(m) = w.message().await.unwrap() {
        last = Some(m);
    }
    let last = last.unwrap();
    assert_eq!(last.state, pb::TransferState::Cancelled as i32, "{last:?}");
    assert!(mid >= seen as f64 && mid < LEN as f64, "mid-transfer scrape: {mid}, progress seen: {seen}, of {LEN}");
    // At the end the counter holds exactly what the record says moved.
    let end = labelled(&scrape(&a), "xfer_transfer_bytes_total", &series);
    assert_eq!(end, last.bytes_done as f64, "{last:?}");
}
