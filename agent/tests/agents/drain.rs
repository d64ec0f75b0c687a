//! SIGTERM drain (DESIGN §9): the agent stops accepting transfers, lets running ones finish
//! within `shutdown.grace`, cancels the rest (CANCELLED, not FAILED), revokes grants and exits 0.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

/// `xfer_grants_active` from an agent's metrics endpoint.
fn grants_active(a: &Agent) -> f64 {
    let body = ureq::get(&format!("http://127.0.0.1:{}/metrics", a.ports.metrics)).call().unwrap().into_body().read_to_string().unwrap();
    body.lines().find_map(|l| l.strip_prefix("xfer_grants_active ")).map(|v| v.trim().parse().unwrap()).unwrap_or(0.0)
}

/// A watch opened before SIGTERM: the server stops only after the drain, so it sees the end.
async fn watch_in_background(a: &Agent, id: &str) -> tokio::task::JoinHandle<Vec<pb::Transfer>> {
    let mut w = a.client().await.watch_transfer(pb::WatchTransferRequest { id: id.into() }).await.unwrap().into_inner();
    tokio::spawn(async move {
        let mut seen = Vec::new();
        while let Ok(Some(m)) = w.message().await {
            seen.push(m);
        }
        seen
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_running_transfer_finish_within_the_grace() {
    let mut a = Agent::start_env("node-a", &[("XFER_SHUTDOWN__GRACE", "30s")]);
    let b = Agent::start("node-b");
    const LEN: u64 = 16 << 20;
    a.create("src", LEN, pb::Access::ReadWrite).await;
    b.create("dst", LEN, pb::Access::ReadWrite).await;
    let data = random_bytes(LEN as usize, 11);
    a.put("src", 0, &data).await;
    // 4 KiB chunks, one outstanding: about a second, so SIGTERM lands mid-transfer.
    let mut req = write_req("src", &b, "dst", LEN);
    req.options = Some(pb::TransferOptions { chunk_size: 4096, depth: 1, qps: 1, verify: true, ..Default::default() });
    let t = a.client().await.submit_transfer(req).await.unwrap().into_inner();
    let watch = watch_in_background(&a, &t.id).await;
    wait_progress(&a, &t.id).await;

    a.sigterm();
    let code = a.wait_exit(Duration::from_secs(30)).await.expect("agent exits after the transfer");
    assert_eq!(code, Some(0), "{}", a.logs());
    let seen = watch.await.unwrap();
    let last = seen.last().unwrap();
    assert_eq!(last.state, pb::TransferState::Succeeded as i32, "{last:?}\n{}", a.logs());
    assert!(last.verified && last.bytes_done == LEN, "{last:?}");
    assert!(b.read("dst", 0, LEN).await == data, "bytes landed");
    // SIGTERM landed while the transfer ran: the drain started before it succeeded.
    let logs = a.logs();
    let (drain, done) = (logs.find("shutting down: draining").unwrap(), logs.find("transfer succeeded").unwrap());
    assert!(drain < done, "SIGTERM came after the transfer had finished; make it slower:\n{logs}");
    assert!(!logs.contains("grace elapsed"), "{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_cancels_what_outlives_the_grace_refuses_new_work_and_exits_0() {
    let mut a = Agent::start_env("node-a", &[("XFER_SHUTDOWN__GRACE", "2s")]);
    let b = Agent::start("node-b");
    a.create("src", 256 << 20, pb::Access::ReadWrite).await;
    a.create("small", 4096, pb::Access::ReadWrite).await;
    b.create("dst", 256 << 20, pb::Access::ReadWrite).await;
    b.create("other", 4096, pb::Access::ReadWrite).await;
    let mut req = write_req("src", &b, "dst", 0);
    make_slow(&mut req);
    let mut c = a.client().await;
    let t = c.submit_transfer(req).await.unwrap().into_inner();
    let watch = watch_in_background(&a, &t.id).await;
    wait_progress(&a, &t.id).await;
    assert_eq!(grants_active(&b), 1.0, "B granted the running transfer");

    let term = Instant::now();
    a.sigterm();
    // (c) During the drain the agent still answers, but refuses new transfers with UNAVAILABLE.
    a.wait_log("shutting down: draining").await;
    let e = c.submit_transfer(write_req("small", &b, "other", 4096)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("shutting down"), "{e:?}");
    let info = c.get_info(pb::GetInfoRequest {}).await;
    assert!(info.is_ok(), "reads are still served while draining: {info:?}");

    // (b) The slow transfer outlives the 2 s grace: CANCELLED, exit 0 (no sooner than the grace:
    // a lower bound the agent's timer sets; the 60 s limit is only a safety net against a hang).
    let code = a.wait_exit(Duration::from_secs(60)).await.expect("agent exits after SIGTERM");
    let took = term.elapsed();
    assert_eq!(code, Some(0), "{}", a.logs());
    assert!(took >= Duration::from_secs(2), "exit after {took:?}, before the grace");
    let seen = watch.await.unwrap();
    let last = seen.last().unwrap();
    assert_eq!(last.state, pb::TransferState::Cancelled as i32, "CANCELLED, not FAILED: {last:?}");
    assert!(last.bytes_done > 0 && last.bytes_done < last.length, "{last:?}");
    // The peer's grant for the cancelled transfer was revoked before the agent exited.
    assert_eq!(grants_active(&b), 0.0, "grant on B revoked");
    let logs = a.logs();
    assert!(logs.contains("grace elapsed"), "{logs}");
    assert!(logs.contains("xfer-agent stopped"), "{logs}");
}
