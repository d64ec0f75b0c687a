//! Bounded retries and per-peer back-off (DESIGN §9): a dead peer costs its own callers at most a
//! connect timeout per back-off window and does not hold up transfers to live peers.
#![allow(clippy::unwrap_used, clippy::expect_used)]
mod common;

use std::time::{Duration, Instant};

use common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

/// An address that never answers: a listener with a backlog of 1 that never accepts, its queue
/// filled, so further SYNs are dropped and connects hang until the client's connect timeout
/// (loopback refusals are instant; outbound addresses here may be answered by a proxy).
fn blackhole() -> (tokio::net::TcpListener, Vec<std::net::TcpStream>, String) {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let l = sock.listen(1).unwrap();
    let addr = l.local_addr().unwrap();
    let mut held = Vec::new();
    while let Ok(s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
        held.push(s);
        assert!(held.len() < 64, "backlog never filled");
    }
    (l, held, addr.to_string())
}

fn to(agent: &str, local: &str, remote: &str, len: u64) -> pb::SubmitTransferRequest {
    pb::SubmitTransferRequest {
        op: pb::Op::Write as i32,
        local: Some(pb::LocalRange { region: local.into(), offset: 0 }),
        remote: Some(pb::RemoteRange { agent: agent.into(), region: remote.into(), offset: 0 }),
        length: len,
        options: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_peer_backs_off_and_live_peers_keep_moving() {
    let (_l, _held, dead) = blackhole();
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    a.create("src", 32 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 32 << 20, pb::Access::ReadWrite).await;

    // Three submits to the dead peer. The channel connects for one request at a time; the first
    // waits out the 3 s connect timeout, which starts the back-off and releases the other two.
    let t0 = Instant::now();
    let mut dead_calls = Vec::new();
    for _ in 0..3 {
        let mut c = a.client().await;
        let req = to(&dead, "src", "dst", 4096);
        dead_calls.push(tokio::spawn(async move { (c.submit_transfer(req).await, t0.elapsed()) }));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Meanwhile transfers to the live peer run at full speed.
    for i in 0..3 {
        let t = a.transfer(to(&b.addr(), "src", "dst", 32 << 20)).await.unwrap();
        assert_eq!(t.state, pb::TransferState::Succeeded as i32, "live transfer {i}: {t:?}");
    }
    let live_done = t0.elapsed();
    assert!(dead_calls.iter().all(|t| !t.is_finished()), "the live transfers finished while the dead peer was still connecting");
    for t in dead_calls {
        let (r, took) = t.await.unwrap();
        let e = r.unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
        assert!(took > live_done && took >= Duration::from_secs(2), "dead submit took {took:?}");
        assert!(took < Duration::from_secs(5), "callers queued behind a dead connect wait one timeout, not one each: {took:?}");
    }

    // A connect timeout backs off at once: a submit now fails without waiting.
    let t1 = Instant::now();
    let e = a.client().await.submit_transfer(to(&dead, "src", "dst", 4096)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("backing off"), "{e:?}");
    assert!(t1.elapsed() < Duration::from_millis(500), "fail fast took {:?}", t1.elapsed());
    // The CLI exits 8 (UNAVAILABLE) and says why.
    let o = a.ctl(&["cp", "src", &format!("{dead}:dst"), "--len", "4KiB"]);
    assert_eq!(o.status.code(), Some(8), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("backing off"), "{o:?}");
    assert!(a.logs().contains("backing off"), "{}", a.logs());
    // And the live peer is untouched.
    let t = a.transfer(to(&b.addr(), "src", "dst", 1 << 20)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_peer_is_retried_a_bounded_number_of_times_and_recovers_when_it_comes_back() {
    let a = Agent::start("node-a");
    a.create("src", 1 << 20, pb::Access::ReadWrite).await;
    let ports = Ports::new();
    let addr = format!("127.0.0.1:{}", ports.grpc);
    let mut c = a.client().await;

    // Nothing listens: each attempt is refused at once; 3 attempts, 100 ms then 200 ms apart.
    let t0 = Instant::now();
    let e = c.submit_transfer(to(&addr, "src", "dst", 4096)).await.unwrap_err();
    let took = t0.elapsed();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(3), "bounded retries took {took:?}");
    // That was three failures: backing off now.
    let e = c.submit_transfer(to(&addr, "src", "dst", 4096)).await.unwrap_err();
    assert!(e.message().contains("backing off"), "{e:?}");

    // The peer comes up; after the window a probe gets through and the back-off resets.
    let tmp = tempfile::tempdir().unwrap();
    let b = Agent::start_with("node-b", &tmp.path().join("b"), ports, &[]);
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    let t = loop {
        match a.transfer(to(&addr, "src", "dst", 1 << 20)).await {
            Ok(t) => break t,
            Err(e) => {
                assert!(e.message().contains("backing off"), "only the back-off may refuse now: {e:?}");
                assert!(Instant::now() < deadline, "back-off never ended");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert!(a.logs().contains("back-off reset"), "{}", a.logs());
}
