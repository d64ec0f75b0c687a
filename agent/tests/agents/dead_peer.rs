//! Bounded retries and per-peer back-off (DESIGN §9): a dead peer costs its own callers at most a
//! connect timeout per back-off window and does not hold up transfers to live peers.
//!
//! No sleeps to order events and no upper bounds on elapsed time (a loaded machine only makes
//! things slower): the tests wait on what the agent reports (its peer-pool gauge, its log, the
//! calls' results). Lower bounds stay where the agent's own timers set them: load can only
//! lengthen those.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use crate::common::*;
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
        notify: None,
        segments: Vec::new(),
        op: pb::Op::Write as i32,
        local: Some(pb::LocalRange { region: local.into(), offset: 0 }),
        remote: Some(pb::RemoteRange { agent: agent.into(), region: remote.into(), offset: 0 }),
        length: (len != 0).then_some(len),
        options: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_peer_backs_off_and_live_peers_keep_moving() {
    let (_l, _held, dead) = blackhole();
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    a.create("src", 1 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;

    // Three submits to the dead peer. The channel connects for one request at a time; the first
    // waits out the 3 s connect timeout, which starts the back-off and releases the other two.
    let t0 = Instant::now();
    let mut dead_calls = Vec::new();
    for _ in 0..3 {
        let mut c = a.client().await;
        let req = to(&dead, "src", "dst", 4096);
        dead_calls.push(tokio::spawn(async move { (c.submit_transfer(req).await, t0.elapsed()) }));
    }
    // The dead peer is in the pool (its entry exists while its calls wait for the connect).
    let mut polls = 0;
    while metric(&scrape(&a), "xfer_peers") < 1.0 {
        polls += 1;
        assert!(polls < 2000, "the dead peer never entered the pool: {}", scrape(&a));
        tokio::task::yield_now().await;
    }
    // Meanwhile transfers to the live peer go through: they do not queue behind the dead one.
    for i in 0..3 {
        let t = a.transfer(to(&b.addr(), "src", "dst", 1 << 20)).await.unwrap();
        assert_eq!(t.state, pb::TransferState::Succeeded as i32, "live transfer {i}: {t:?}");
    }
    assert!(dead_calls.iter().all(|t| !t.is_finished()), "the live transfers finished while the dead peer was still connecting");
    for t in dead_calls {
        let (r, took) = t.await.unwrap();
        let e = r.unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
        // A lower bound set by the connect timeout (3 s): the calls waited for the connect.
        assert!(took >= Duration::from_secs(2), "dead submit took {took:?}");
    }
    // Callers queued behind a dead connect wait one timeout, not one each: one connect timed
    // out and started the back-off; the other two failed when it started.
    let logs = a.logs();
    assert_eq!(logs.matches("peer unreachable; backing off").count(), 1, "{logs}");

    // A connect timeout backs off at once: a submit now fails without network IO (the message
    // says so; no timing needed).
    let e = a.client().await.submit_transfer(to(&dead, "src", "dst", 4096)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("backing off"), "{e:?}");
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
    // The peer's address: where an agent listened (port 0, reported) until it was killed.
    let tmp = tempfile::tempdir().unwrap();
    let mut gone = Agent::start_with("node-b", &tmp.path().join("b"), Ports::new(), &[]);
    let ports = gone.ports.same();
    gone.kill9();
    let addr = format!("127.0.0.1:{}", ports.grpc);
    let mut c = a.client().await;

    // Nothing listens: each attempt is refused at once; 3 attempts, 100 ms then 200 ms apart
    // (a lower bound set by the agent's retry delays; no upper bound).
    let t0 = Instant::now();
    let e = c.submit_transfer(to(&addr, "src", "dst", 4096)).await.unwrap_err();
    let took = t0.elapsed();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(took >= Duration::from_millis(300), "bounded retries took {took:?}");
    // That was three failures: backing off now.
    let e = c.submit_transfer(to(&addr, "src", "dst", 4096)).await.unwrap_err();
    assert!(e.message().contains("backing off"), "{e:?}");

    // The peer comes up; after the window a probe gets through and the back-off resets. Polled
    // (bounded by a count of calls) until the back-off window, a timer in the agent, has passed.
    let b = Agent::start_with("node-b", &tmp.path().join("b"), ports, &[]);
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let mut refused = 0;
    let t = loop {
        match a.transfer(to(&addr, "src", "dst", 1 << 20)).await {
            Ok(t) => break t,
            Err(e) => {
                assert!(e.message().contains("backing off"), "only the back-off may refuse now: {e:?}");
                refused += 1;
                assert!(refused < 600, "back-off never ended after {refused} calls");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert!(a.logs().contains("back-off reset"), "{}", a.logs());
}
