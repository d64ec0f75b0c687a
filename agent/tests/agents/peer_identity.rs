//! Red team, peer identity: a client that names one peer agent under many spellings of its
//! address must not make the agent hold many pool entries, gRPC channels or connections to it,
//! and an initiator never opens more connections to a peer than that peer keeps for it. Real
//! agents on loopback (mTLS and plaintext); each test asserts the refusal or the sharing *and*
//! that another client's transfer to the same peer still lands its bytes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::chan::{open_msg_qps, try_open_with};
use crate::common::pki::{dns, ip, role_uri, uri, Pki};
use crate::common::*;
use tonic::transport::Channel;
use tonic::Code;
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;

/// Spellings of `127.0.0.1:port` a caller may send: all reach one socket.
fn spellings(port: u16) -> Vec<String> {
    vec![
        format!("127.0.0.1:{port}"),
        format!("127.0.0.1:0{port}"),
        format!("127.0.0.1:00{port}"),
        format!("[::ffff:127.0.0.1]:{port}"),
        format!("[::FFFF:7f00:1]:0{port}"),
    ]
}

async fn peers(c: &mut AgentClient<Channel>) -> Vec<pb::PeerInfo> {
    c.list_peers(pb::ListPeersRequest {}).await.unwrap().into_inner().peers
}

/// A's client copies fresh bytes to B's `dst` and B's client reads them back.
async fn victim_transfer_lands(a_client: &mut AgentClient<Channel>, b_client: &mut AgentClient<Channel>, b: &Agent, seed: u64) {
    let data = random_bytes(64 << 10, seed);
    put_via(a_client, "src", 0, &data).await;
    let t = run_via(a_client, write_req("src", b, "dst", data.len() as u64)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert!(read_via(b_client, "dst", 0, 0).await == data, "the bytes arrived");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spelling_of_a_peer_is_one_entry_with_one_channel_and_its_connections() {
    let pki = Pki::new();
    let (a, _ta) = pki.agent("node-a");
    let (b, _tb) = pki.agent("node-b");
    let mut attacker = pki.agent_client(&a, "xferctl").await;
    let mut a_owner = pki.agent_client(&a, "xferctl").await;
    let mut b_owner = pki.agent_client(&b, "xferctl").await;
    a_owner.create_region(anon("src", 64 << 10)).await.unwrap();
    b_owner.create_region(anon("dst", 64 << 10)).await.unwrap();

    // One connection of each shape the attack will ask for, so what follows is the steady state.
    let port = port_of(&b);
    for qps in 1..=4 {
        attacker.connect(pb::ConnectRequest { peer: b.addr(), qps }).await.unwrap();
    }
    let (fds0, threads0) = (open_fds(a.pid().unwrap()), proc_status(a.pid().unwrap(), "Threads:") as usize);
    // The attack: one peer named again and again under every spelling the parser accepts.
    for round in 0..40 {
        for s in spellings(port) {
            let p = attacker.connect(pb::ConnectRequest { peer: s.clone(), qps: 1 + (round % 4) }).await.unwrap().into_inner();
            assert_eq!(p.node_name, "node-b", "{s}");
        }
    }
    let listed = peers(&mut a_owner).await;
    assert_eq!(listed.len(), 1, "one entry for node-b: {listed:?}");
    assert_eq!(gauge(&a, "xfer_peers"), 1.0);
    assert_eq!(gauge(&a, "xfer_peer_aliases"), 1.0, "leading zeros and the IPv4-mapped form are one canonical spelling");
    // Its connections: one per QP shape asked for (4), each kept idle for reuse — not one per
    // spelling. B holds exactly those.
    assert!(gauge(&b, "xfer_accepted_connections") <= 4.0, "{}", scrape(&b));
    // gRPC connections at B: A's one channel, the test's own client, nothing per spelling.
    let grpc = labelled(&scrape(&b), "xfer_listener_connections", &[("listener", "grpc")]);
    assert!(grpc <= 3.0, "B holds {grpc} gRPC connections");
    // A holds what it held before the 200 calls: no descriptor or thread per spelling.
    let (fds1, threads1) = (open_fds(a.pid().unwrap()), proc_status(a.pid().unwrap(), "Threads:") as usize);
    assert!(fds1 <= fds0 + 2, "A's descriptors {fds0} -> {fds1}");
    assert!(threads1 <= threads0 + 2, "A's threads {threads0} -> {threads1}");

    // The victim's transfer to B still runs, on the shared entry.
    victim_transfer_lands(&mut a_owner, &mut b_owner, &b, 7).await;
    assert_eq!(peers(&mut a_owner).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_addresses_are_refused_before_anything_is_dialled() {
    let pki = Pki::new();
    let (a, _ta) = pki.agent("node-a");
    let (b, _tb) = pki.agent("node-b");
    let mut c = pki.agent_client(&a, "xferctl").await;
    let port = port_of(&b);
    for bad in [
        format!("127.0.0.1:0000{port}"),
        format!("127.1:{port}"),
        format!("0127.0.0.1:{port}"),
        format!("::1:{port}"),
        format!("http://127.0.0.1:{port}"),
        format!("user@127.0.0.1:{port}"),
        "127.0.0.1:0".to_string(),
        "127.0.0.1:70000".to_string(),
        format!("{}:{port}", "a".repeat(300)),
        format!("a_b:{port}"),
        "\u{1b}[31mred:1".to_string(),
    ] {
        let e = c.connect(pb::ConnectRequest { peer: bad.clone(), qps: 1 }).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad:?}: {e:?}");
        assert!(e.message().contains("invalid peer address") || e.message().starts_with("peer: "), "names the field: {e:?}");
        assert!(!e.message().contains('\u{1b}'), "the refusal does not echo control characters: {e:?}");
        let mut t = write_req("src", &b, "dst", 16);
        t.remote.as_mut().unwrap().agent = bad.clone();
        assert_eq!(c.submit_transfer(t).await.unwrap_err().code(), Code::InvalidArgument, "{bad:?}");
    }
    // Nothing was created, dialled or counted.
    assert!(peers(&mut c).await.is_empty());
    assert_eq!(gauge(&a, "xfer_peers"), 0.0);
    assert_eq!(gauge(&b, "xfer_accepted_connections"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_name_and_an_address_of_one_node_share_its_entry() {
    let pki = Pki::new();
    // node-d's certificate is valid for `localhost` and 127.0.0.1: both spellings verify.
    pki.leaf("node-d", vec![uri(&role_uri("node", "node-d")), dns("localhost"), ip("127.0.0.1")]);
    let (a, _ta) = pki.agent("node-a");
    let (d, _td) = pki.agent("node-d");
    let mut c = pki.agent_client(&a, "xferctl").await;
    let port = port_of(&d);
    for s in [format!("127.0.0.1:{port}"), format!("localhost:{port}"), format!("LOCALHOST.:0{port}")] {
        let p = c.connect(pb::ConnectRequest { peer: s.clone(), qps: 1 }).await.unwrap().into_inner();
        assert_eq!(p.node_name, "node-d", "{s}");
    }
    let listed = peers(&mut c).await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(gauge(&a, "xfer_peers"), 1.0);
    assert!(gauge(&d, "xfer_accepted_connections") <= 1.0, "one idle connection, reused: {}", scrape(&d));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_initiator_opens_no_more_connections_than_the_responder_keeps_for_it() {
    let pki = Pki::new();
    // One client alone (shares off): the bound under test is the agent's as a whole.
    let (a, _ta) = pki.agent_with("node-a", "[limits]\ntenant_share = 1.0\n", "", &[]);
    let (b, _tb) = pki.agent_with("node-b", "[limits]\nmax_connections_per_peer = 2\n", "", &[]);
    let mut c = pki.agent_client(&a, "xferctl").await;
    let mut b_owner = pki.agent_client(&b, "xferctl").await;
    c.create_region(anon("src", 64 << 10)).await.unwrap();
    b_owner.create_region(anon("dst", 1 << 20)).await.unwrap();

    // Two channels hold two connections for their whole life (idle, no post).
    let port = port_of(&b);
    let mut held = Vec::new();
    for (i, s) in [format!("127.0.0.1:{port}"), format!("127.0.0.1:0{port}")].into_iter().enumerate() {
        let mut open = open_msg_qps(pb::Op::Write, "src", &b, "dst", (i as u64) << 16, 64 << 10, false, 1);
        open.remote.as_mut().unwrap().agent = s;
        held.push(try_open_with(&mut c, open, 4).await.unwrap());
    }
    assert_eq!(gauge(&b, "xfer_accepted_connections"), 2.0);
    // A third, under yet another spelling, would need a third connection: A refuses it itself,
    // instead of letting B evict one of the two in use.
    let mut open = open_msg_qps(pb::Op::Write, "src", &b, "dst", 2 << 16, 64 << 10, false, 1);
    open.remote.as_mut().unwrap().agent = format!("[::ffff:127.0.0.1]:{port}");
    let e = try_open_with(&mut c, open, 4).await.err().expect("refused");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("max_connections_per_peer"), "{e:?}");
    assert_eq!(gauge(&b, "xfer_accepted_connections"), 2.0, "nothing evicted at B");
    assert!(!b.logs().contains("evicted the oldest idle connection"), "B never had to evict");

    // Both held channels still work: a post on each lands.
    for (i, ch) in held.iter_mut().enumerate() {
        let data = random_bytes(4096, i as u64 + 1);
        put_via(&mut c, "src", 0, &data).await;
        let d = ch.post(1, vec![crate::common::chan::seg(0, (i as u64) << 16, 4096)], 0, None).await;
        assert_eq!(d.state, pb::TransferState::Succeeded as i32, "{d:?}");
        let got = read_via(&mut b_owner, "dst", 0, 0).await;
        let at = i << 16;
        assert!(got[at..at + 4096] == data[..], "channel {i}'s bytes arrived");
    }
    // Once they close, their connections are A's to use again.
    drop(held);
    victim_transfer_lands_plain(&mut c, &mut b_owner, &b).await;
}

async fn victim_transfer_lands_plain(a_client: &mut AgentClient<Channel>, b_client: &mut AgentClient<Channel>, b: &Agent) {
    let data = random_bytes(64 << 10, 99);
    put_via(a_client, "src", 0, &data).await;
    // The channels' connections go back to A's pool as A notices their streams closed; until
    // then a transfer would find them leased and be refused. ListPeers counts the pool's idle
    // connections: once both are back, the transfer must land at the first try. Polled by count,
    // each poll a call.
    let mut idle = 0;
    for _ in 0..100_000 {
        idle = peers(a_client).await.iter().map(|p| p.qps).sum::<u32>();
        if idle == 2 {
            break;
        }
    }
    assert_eq!(idle, 2, "the channels' connections never came back");
    let t = a_client.submit_transfer(write_req("src", b, "dst", data.len() as u64)).await.unwrap();
    let mut w = a_client.watch_transfer(pb::WatchTransferRequest { id: t.into_inner().id }).await.unwrap().into_inner();
    let mut last = None;
    while let Some(m) = w.message().await.unwrap() {
        last = Some(m);
    }
    assert_eq!(last.unwrap().state, pb::TransferState::Succeeded as i32);
    assert!(read_via(b_client, "dst", 0, 0).await[..data.len()] == data[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_plaintext_every_spelling_of_one_socket_is_one_entry() {
    let a = Agent::start("node-a");
    let b = Agent::start("node-b");
    a.create("src", 64 << 10, pb::Access::ReadWrite).await;
    b.create("dst", 64 << 10, pb::Access::ReadWrite).await;
    let mut c = a.client().await;
    for _ in 0..50 {
        for s in spellings(port_of(&b)) {
            c.connect(pb::ConnectRequest { peer: s, qps: 1 }).await.unwrap();
        }
    }
    assert_eq!(peers(&mut c).await.len(), 1);
    assert!(gauge(&b, "xfer_accepted_connections") <= 1.0, "{}", scrape(&b));
    let data = random_bytes(64 << 10, 3);
    a.put("src", 0, &data).await;
    let t = a.transfer(write_req("src", &b, "dst", data.len() as u64)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert!(b.read("dst", 0, data.len() as u64).await == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_taken_over_by_another_node_never_gets_the_first_nodes_calls() {
    let pki = Pki::new();
    let (a, _ta) = pki.agent("node-a");
    let (mut b, _tb) = pki.agent("node-b");
    let mut c = pki.agent_client(&a, "xferctl").await;
    let addr = b.addr();
    let p = c.connect(pb::ConnectRequest { peer: addr.clone(), qps: 1 }).await.unwrap().into_inner();
    assert_eq!(p.node_name, "node-b");
    // node-b goes away and node-c comes up on its gRPC port.
    b.kill9();
    let (other, _tc) = pki.agent_on("node-c", b.ports.same(), "", "", &[]);
    assert_eq!(other.addr(), addr);
    let mut c_owner = pki.agent_client(&other, "xferctl").await;
    c_owner.create_region(anon("dst", 4096)).await.unwrap();
    // The entry pinned to node-b refuses to send node-b's calls to node-c...
    let e = c.connect(pb::ConnectRequest { peer: addr.clone(), qps: 1 }).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("node-c") && e.message().contains("node-b"), "names both: {e:?}");
    assert_eq!(gauge(&other, "xfer_accepted_connections"), 0.0, "no connection reached node-c as node-b's");
    // ...and the next lookup starts over: the address is node-c's now.
    let p = c.connect(pb::ConnectRequest { peer: addr.clone(), qps: 1 }).await.unwrap().into_inner();
    assert_eq!(p.node_name, "node-c");
    let listed = peers(&mut c).await;
    assert_eq!(listed.iter().map(|p| p.node_name.as_str()).collect::<Vec<_>>(), ["node-c"], "{listed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responder_keeps_its_bound_per_identity_and_other_identities_keep_theirs() {
    let pki = Pki::new();
    let (b, _tb) = pki.agent_with("node-b", "[limits]\nmax_connections_per_peer = 2\n", "", &[]);
    let mut owner = pki.agent_client(&b, "xferctl").await;
    owner.create_region(anon("dst", 1 << 20)).await.unwrap();
    let mut a = pki.peer(&b, "node-a").await;
    let reply = a.connect(connect_req("a-1")).await.unwrap().into_inner();
    assert_eq!((reply.max_connections, reply.max_streams), (2, 256), "B advertises what it keeps for a peer");
    a.connect(connect_req("a-2")).await.unwrap();
    let g1 = a.grant(grant_req("dst", "node-a", "a-1", pb::Access::Write)).await.unwrap().into_inner();
    let g2 = a.grant(grant_req("dst", "node-a", "a-2", pb::Access::Write)).await.unwrap().into_inner();
    // Both hold a live grant: a third is refused, and nothing of the two is touched.
    let e = a.connect(connect_req("a-3")).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("max_connections_per_peer"), "{e:?}");
    assert_eq!(gauge(&b, "xfer_accepted_connections"), 2.0);
    a.complete(complete_req(&g2.grant_id, "t-2", 4096, "node-a")).await.unwrap();
    // Another identity has its own bound.
    let mut c = pki.peer(&b, "node-c").await;
    c.connect(connect_req("c-1")).await.unwrap();
    c.grant(grant_req("dst", "node-c", "c-1", pb::Access::Write)).await.unwrap();
    // a-2's grant ended with its Complete: a-2 holds none now, and a new connection of node-a's
    // replaces it (the oldest without a grant), never a-1, whose grant is live.
    a.connect(connect_req("a-3")).await.unwrap();
    assert_eq!(gauge(&b, "xfer_accepted_connections"), 3.0);
    a.complete(complete_req(&g1.grant_id, "t-1", 4096, "node-a")).await.unwrap();
}
