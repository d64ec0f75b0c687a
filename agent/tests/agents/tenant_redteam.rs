//! Red team, tenants: variants of "one tenant hurts another" that the fixes for peer identity and
//! per-identity shares do not cover by construction. An attacker holds an ordinary certificate
//! (client role, or a node certificate, or a uid on the unix socket) against real agents with
//! mTLS on loopback. Every test asserts the refusal *and* that the victim keeps service (its
//! first request served, its bytes landed, its records kept).
//!
//! Tests marked `#[ignore = "BUG: ..."]` demonstrate attacks that succeed against the current
//! code; they assert the correct behaviour and fail until the bug is fixed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::common::chan::{open_msg_qps, try_open_with};
use crate::common::pki::{role_uri, uri, Pki};
use crate::common::*;
use tonic::transport::Channel;
use tonic::Code;
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;

/// The test PKI plus a second client identity, `tenant-b` (the victim).
fn pki() -> Pki {
    let pki = Pki::new();
    pki.leaf("tenant-b", vec![uri(&role_uri("client", "tenant-b"))]);
    pki
}

fn share_refusal(e: &tonic::Status, who: &str) {
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("tenant_share") && e.message().contains(who), "names the share and who holds it: {e:?}");
}

/// One QP: the victim asks for the least a transfer can use.
fn one_qp(mut req: pb::SubmitTransferRequest) -> pb::SubmitTransferRequest {
    req.options = Some(pb::TransferOptions { qps: 1, ..Default::default() });
    req
}

/// The victim (`a_client`) copies fresh bytes from its `vsrc` to `dst` on `b` at `offset`, and
/// `b_client` reads them back there.
async fn victim_lands(a_client: &mut AgentClient<Channel>, b_client: &mut AgentClient<Channel>, b: &Agent, offset: u64, seed: u64) {
    let data = random_bytes(16 << 10, seed);
    put_via(a_client, "vsrc", 0, &data).await;
    let mut req = one_qp(write_req("vsrc", b, "dst", data.len() as u64));
    req.remote.as_mut().unwrap().offset = offset;
    let t = run_via(a_client, req).await;
    let t = t.unwrap_or_else(|e| panic!("the victim's transfer was refused: {e:?}"));
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert!(read_via(b_client, "dst", offset, data.len() as u64).await == data, "the victim's bytes arrived");
}

async fn grpc_connections(a: &Agent) -> f64 {
    labelled(&scrape(a), "xfer_listener_connections", &[("listener", "grpc")])
}

/// Waits until `a`'s gRPC listener counts `want` open connections (polled: a hang guard, the
/// wait is for the value).
async fn wait_grpc_connections(a: &Agent, want: f64) {
    for _ in 0..3000 {
        if grpc_connections(a).await == want {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("the gRPC listener never held {want} connections: {}", scrape(a));
}

// ------------------------------------------------------------------ the peer pool

/// Loopback listeners that accept TCP connections and then say nothing: a TLS handshake to one
/// never completes. Each accepted connection is reported on `dialled` with its listener's index
/// and held until the listeners are dropped.
struct Silent {
    addrs: Vec<String>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Silent {
    async fn new(n: usize, dialled: tokio::sync::mpsc::UnboundedSender<usize>) -> Silent {
        let mut addrs = Vec::new();
        let mut tasks = Vec::new();
        for i in 0..n {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            addrs.push(l.local_addr().unwrap().to_string());
            let tx = dialled.clone();
            tasks.push(tokio::spawn(async move {
                let mut held = Vec::new();
                while let Ok((s, _)) = l.accept().await {
                    held.push(s);
                    let _ = tx.send(i);
                }
            }));
        }
        Silent { addrs, tasks }
    }
}

impl Drop for Silent {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A client names `limits.max_peers` addresses that accept TCP but never finish the TLS
/// handshake, all at once. Each lookup inserts an entry keyed on the socket and holds it while
/// its `Peer.Ping` waits, so it cannot be evicted: the idle entry of the victim's peer is evicted
/// to make room, and then the pool is full of entries in use. The victim's next transfer to its
/// peer, and its first `Connect` to a new peer, must still be served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "BUG: pool lookups in flight pin entries; one client's silent addresses fill limits.max_peers and evict/refuse other tenants' peers"]
async fn a_client_naming_silent_addresses_cannot_take_the_peer_pool() {
    let pki = pki();
    let (a, _ta) = pki.agent_with("node-a", "[limits]\nmax_peers = 4\n", "", &[]);
    let (b, _tb) = pki.agent("node-b");
    let (c, _tc) = pki.agent("node-c");
    let attacker = pki.agent_client(&a, "xferctl").await;
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    let mut b_owner = pki.agent_client(&b, "xferctl").await;
    victim.create_region(anon("vsrc", 64 << 10)).await.unwrap();
    b_owner.create_region(anon("dst", 64 << 10)).await.unwrap();
    // node-b is in A's pool, idle.
    victim_lands(&mut victim, &mut b_owner, &b, 0, 1).await;

    // The attack: four silent addresses at once.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let silent = Silent::new(4, tx.clone()).await;
    let mut attacks = Vec::new();
    for (i, addr) in silent.addrs.iter().enumerate() {
        let (mut c, addr, tx) = (attacker.clone(), addr.clone(), tx.clone());
        attacks.push(tokio::spawn(async move {
            let r = c.connect(pb::ConnectRequest { peer: addr, qps: 1 }).await;
            let _ = tx.send(i);
            r
        }));
    }
    // Every attacking lookup has dialled its address (its entry is in the pool and in use) or
    // was already refused.
    let mut settled = BTreeSet::new();
    while settled.len() < silent.addrs.len() {
        settled.insert(rx.recv().await.unwrap());
    }

    // The victim keeps service: its peer, and a peer it names for the first time.
    victim_lands(&mut victim, &mut b_owner, &b, 16 << 10, 2).await;
    let p = victim.connect(pb::ConnectRequest { peer: c.addr(), qps: 1 }).await;
    assert_eq!(p.unwrap_or_else(|e| panic!("the victim's first Connect was refused: {e:?}")).into_inner().node_name, "node-c");

    // The attacker got nothing.
    drop(silent);
    for t in attacks {
        let e = t.await.unwrap().expect_err("a silent address never answers");
        assert!(matches!(e.code(), Code::Unavailable | Code::ResourceExhausted | Code::DeadlineExceeded), "{e:?}");
    }
}

/// Many concurrent first lookups of one peer under several spellings (leading zeros, the
/// IPv4-mapped IPv6 forms with zero runs, upper-case hex) race to create its entry: they end
/// in one entry, one alias per canonical spelling, and no gRPC connections left at the peer
/// beyond the pool's one channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_first_lookups_of_many_spellings_make_one_entry() {
    let pki = pki();
    let (a, _ta) = pki.agent("node-a");
    let (b, _tb) = pki.agent("node-b");
    let attacker = pki.agent_client(&a, "xferctl").await;
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    let mut b_owner = pki.agent_client(&b, "xferctl").await;
    victim.create_region(anon("vsrc", 64 << 10)).await.unwrap();
    b_owner.create_region(anon("dst", 64 << 10)).await.unwrap();
    let port = port_of(&b);
    let spellings = [
        format!("127.0.0.1:{port}"),
        format!("127.0.0.1:000{port}"),
        format!("[0:0:0:0:0:ffff:127.0.0.1]:{port}"),
        format!("[0000::FFFF:7F00:0001]:0{port}"),
        format!("[::ffff:127.0.0.1]:00{port}"),
    ];
    let mut racers = Vec::new();
    for i in 0..40 {
        let (mut c, s) = (attacker.clone(), spellings[i % spellings.len()].clone());
        racers.push(tokio::spawn(async move { c.connect(pb::ConnectRequest { peer: s, qps: 1 }).await }));
    }
    for r in racers {
        assert_eq!(r.await.unwrap().unwrap().into_inner().node_name, "node-b");
    }
    let peers = victim.list_peers(pb::ListPeersRequest {}).await.unwrap().into_inner().peers;
    assert_eq!(peers.len(), 1, "{peers:?}");
    assert_eq!(gauge(&a, "xfer_peers"), 1.0);
    assert_eq!(gauge(&a, "xfer_peer_aliases"), 1.0, "every spelling is one canonical spelling");
    // B holds A's one pooled channel and the test's own client; the racers' throwaway channels
    // are gone once their lookups joined the entry.
    wait_grpc_connections(&b, 2.0).await;
    victim_lands(&mut victim, &mut b_owner, &b, 0, 3).await;
}

/// A host name that reaches a peer's socket but that the peer's certificate does not cover
/// (`localhost`: node-b's certificate names node-b and 127.0.0.1). The attacker's lookup fails
/// verification; its entry, until the peer answers, holds the client made for that spelling. Keyed
/// on the resolved socket, it would be handed to another client that names the same socket
/// correctly (127.0.0.1), whose lookups would then fail verification (and back off) too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spelling_that_fails_verification_does_not_poison_the_socket() {
    let pki = pki();
    let (a, _ta) = pki.agent("node-a");
    let (b, _tb) = pki.agent("node-b");
    let mut attacker = pki.agent_client(&a, "xferctl").await;
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    let mut b_owner = pki.agent_client(&b, "xferctl").await;
    victim.create_region(anon("vsrc", 64 << 10)).await.unwrap();
    b_owner.create_region(anon("dst", 64 << 10)).await.unwrap();
    // The attack: B's port under a name its certificate does not carry, a few times (enough to
    // put the entry in back-off).
    for _ in 0..4 {
        let e = attacker.connect(pb::ConnectRequest { peer: format!("localhost:{}", port_of(&b)), qps: 1 }).await.unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    }
    // The victim names B by the address its certificate carries: verified, connected, served.
    let p = victim.connect(pb::ConnectRequest { peer: b.addr(), qps: 1 }).await;
    assert_eq!(p.unwrap_or_else(|e| panic!("the victim's first Connect to node-b failed: {e:?}")).into_inner().node_name, "node-b");
    victim_lands(&mut victim, &mut b_owner, &b, 0, 7).await;
}

// ------------------------------------------------------------------ connections to a peer

/// The connections A keeps to one peer are bounded (`limits.max_connections_per_peer`, and the
/// streams the peer advertises, `max_data_connections_per_peer` on tcp), but the bound is A's
/// as a whole: a client's channels, each with the most QPs a transfer may ask for, hold every
/// stream B keeps for A, well inside the client's share of transfers. Every other client's
/// transfer to B is then refused until the channels end (ttl up to 24 h).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_hold_every_stream_to_a_peer() {
    let pki = pki();
    let (a, _ta) = pki.agent("node-a");
    // B keeps 8 streams for A.
    let (b, _tb) = pki.agent_with("node-b", "[limits]\nmax_data_connections_per_peer = 8\n", "", &[]);
    let mut hoarder = pki.agent_client(&a, "xferctl").await;
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    let mut b_owner = pki.agent_client(&b, "xferctl").await;
    hoarder.create_region(anon("src", 64 << 10)).await.unwrap();
    victim.create_region(anon("vsrc", 64 << 10)).await.unwrap();
    b_owner.create_region(anon("dst", 1 << 20)).await.unwrap();

    // An idle channel with four QPs: the hoarder's share (half) of the 8 streams B keeps for A.
    let mut held = Vec::new();
    let mut open = open_msg_qps(pb::Op::Write, "src", &b, "dst", 0, 64 << 10, false, 4);
    open.ttl = Some(prost_types::Duration { seconds: 86_400, nanos: 0 });
    held.push(try_open_with(&mut hoarder, open, 4).await.unwrap());
    // A second would take the other half: the hoarder is refused, naming its share.
    let open = open_msg_qps(pb::Op::Write, "src", &b, "dst", 1 << 16, 64 << 10, false, 4);
    let e = try_open_with(&mut hoarder, open, 4).await.err().expect("refused");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("tenant_share") && e.message().contains("client/xferctl"), "{e:?}");

    // The victim's first transfer to B, with one QP, is served and lands.
    victim_lands(&mut victim, &mut b_owner, &b, 512 << 10, 4).await;
    drop(held);
}

// ------------------------------------------------------------------ registered bytes

/// `WatchInboundRing` maps a ring of up to 65,536 slots (about 96 MiB with the default
/// `transfer.max_notify_bytes`) counted against `max_registered_bytes`: it must come out of the
/// caller's share of registered bytes too, or rings alone let one client take every registered
/// byte and another client's first region is refused by the global limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notification_rings_count_against_the_callers_byte_share() {
    let pki = pki();
    // 256 MiB in all; a share of half is 128 MiB per identity.
    let (a, _t) = pki.agent_with("node-a", "[limits]\nmax_registered_bytes = \"256MiB\"\n", "", &[]);
    let mut hoarder = pki.agent_client(&a, "xferctl").await;
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    let big = pb::WatchInboundRingRequest { slots: 1 << 16, ..Default::default() };
    let mut first = hoarder.watch_inbound_ring(big.clone()).await.unwrap().into_inner();
    let ring = first.message().await.unwrap().unwrap();
    assert!(ring.length > 64 << 20 && ring.length <= 128 << 20, "{ring:?}");
    // A second ring would take the hoarder past its 128 MiB.
    let e = hoarder.watch_inbound_ring(big).await.unwrap_err();
    share_refusal(&e, "client/xferctl");
    assert_eq!(gauge(&a, "xfer_inbound_rings"), 1.0, "the refused ring was not created");
    // The victim's first region, as large as its own share, is served.
    victim.create_region(anon("mine", 128 << 20)).await.unwrap();
    // The hoarder's first ring is still there.
    assert!(Path::new("/dev/shm").join(&ring.object).exists());
    drop(first);
}

// ------------------------------------------------------------------ identities

fn own_uid() -> u32 {
    std::fs::metadata("/proc/self").unwrap().uid()
}

/// A local application on the unix socket is the tenant `client/uid-N`; a certificate whose
/// NAME is `uid-N` (DNS characters: a valid NAME) would be the very same tenant, spending the
/// local user's shares from the network until the local user's first request is refused. Such a
/// certificate carries no identity; the local user keeps its whole share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_named_like_a_local_uid_does_not_spend_that_uids_share() {
    let pki = pki();
    let uid = own_uid();
    pki.leaf("uid-cert", vec![uri(&role_uri("client", &format!("uid-{uid}")))]);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let (a, _t) =
        pki.agent_with("node-a", &format!("unix_listen = {:?}\n[limits]\nmax_regions = 4\n", sock.display().to_string()), "", &[]);
    let mut remote = pki.agent_client(&a, "uid-cert").await;
    for i in 0..3 {
        let e = remote.create_region(anon(&format!("r{i}"), 4096)).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains(&format!("uid-{uid}")) && e.message().contains("unix socket"), "{e:?}");
    }
    // The local user (this process's uid on the unix socket) has its whole share: two of four.
    let mut local = AgentClient::new(unix_channel(&sock).await);
    local.create_region(anon("mine0", 4096)).await.unwrap();
    local.create_region(anon("mine1", 4096)).await.unwrap();
    share_refusal(&local.create_region(anon("mine2", 4096)).await.unwrap_err(), &format!("client/uid-{uid}"));
    let n = local.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner().regions.len();
    assert_eq!(n, 2, "the refused requests created nothing");
}

/// An mTLS agent under certificate `name` whose config and state live in `dir` (so that it can
/// be restarted on the same state).
fn mtls_agent_in(pki: &Pki, name: &str, dir: &Path, extra: &str) -> Agent {
    let cfg = dir.join("agent.toml");
    let tls = format!(
        "[tls]\ncert = {:?}\nkey = {:?}\nca = {:?}\n",
        pki.path(&format!("{name}.crt")),
        pki.path(&format!("{name}.key")),
        pki.path("ca.crt")
    );
    std::fs::write(&cfg, format!("insecure = false\n{extra}\n{tls}")).unwrap();
    Agent::start_with_env(name, &dir.join("state"), Ports::new(), &["--config", cfg.to_str().unwrap()], &[])
}

/// Regions restored from the catalog at start must still count against their creator's share.
/// Charged to no one, they would give a client whose file regions fill its share that share
/// back at every restart of the agent: after one restart it would hold every region slot, and
/// another client's first region would be refused by `max_regions`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_does_not_give_a_client_its_share_again() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    let limits = "[limits]\nmax_regions = 4\n";
    let a = mtls_agent_in(&pki, "node-a", dir.path(), limits);
    for i in 0..4 {
        std::fs::write(root_of(&a).join(format!("f{i}.bin")), vec![i as u8; 4096]).unwrap();
    }
    let mut hoarder = pki.agent_client(&a, "xferctl").await;
    for i in 0..2 {
        hoarder.create_region(file_region_req(&format!("f{i}"), 4096, &format!("f{i}.bin"), pb::Access::ReadWrite)).await.unwrap();
    }
    share_refusal(
        &hoarder.create_region(file_region_req("f2", 4096, "f2.bin", pb::Access::ReadWrite)).await.unwrap_err(),
        "client/xferctl",
    );
    drop(hoarder);
    drop(a);

    let a = mtls_agent_in(&pki, "node-a", dir.path(), limits);
    let mut hoarder = pki.agent_client(&a, "xferctl").await;
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    assert_eq!(victim.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner().regions.len(), 2, "both restored");
    for i in 2..4 {
        let e = hoarder.create_region(file_region_req(&format!("f{i}"), 4096, &format!("f{i}.bin"), pb::Access::ReadWrite)).await;
        share_refusal(&e.expect_err("the restored regions are still the hoarder's"), "client/xferctl");
    }
    victim.create_region(anon("v0", 4096)).await.unwrap();
    victim.create_region(anon("v1", 4096)).await.unwrap();
}

/// Refused requests give back whatever share they took: a client whose creates, watches and
/// channels fail after the share was taken (a file region that is not there, a watch on a region
/// that is not there, a channel to a remote region that is not there), many times over, can
/// still take exactly its share afterwards; the victim is served throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_requests_give_back_every_share_they_took() {
    let pki = pki();
    let (a, _ta) = pki.agent_with("node-a", "[limits]\nmax_regions = 4\nmax_transfers = 4\ntenant_share = 0.5\n", "", &[]);
    let (b, _tb) = pki.agent("node-b");
    let mut attacker = pki.agent_client(&a, "xferctl").await;
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    let mut b_owner = pki.agent_client(&b, "xferctl").await;
    b_owner.create_region(anon("dst", 1 << 20)).await.unwrap();
    victim.create_region(anon("vsrc", 64 << 10)).await.unwrap();
    for i in 0..40 {
        let e = attacker.create_region(file_region_req(&format!("f{i}"), 4096, "missing.bin", pb::Access::ReadWrite)).await.unwrap_err();
        assert_ne!(e.code(), Code::ResourceExhausted, "{e:?}");
        let e = attacker.watch_inbound(pb::WatchInboundRequest { region: "missing".into(), ..Default::default() }).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
    }
    // One region of the attacker's, for the channels' local side (its share is 2 regions).
    attacker.create_region(anon("src", 64 << 10)).await.unwrap();
    for i in 0..20u64 {
        let open = open_msg_qps(pb::Op::Write, "src", &b, "missing", i << 12, 4096, false, 1);
        let e = try_open_with(&mut attacker, open, 4).await.err().expect("no such remote region");
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
    }
    // The whole share is still the attacker's to take, and no more.
    attacker.create_region(anon("r1", 4096)).await.unwrap();
    share_refusal(&attacker.create_region(anon("r2", 4096)).await.unwrap_err(), "client/xferctl");
    let mut chans = Vec::new();
    for i in 0..2u64 {
        let open = open_msg_qps(pb::Op::Write, "src", &b, "dst", i << 16, 4096, false, 1);
        chans.push(try_open_with(&mut attacker, open, 4).await.unwrap());
    }
    let open = open_msg_qps(pb::Op::Write, "src", &b, "dst", 2 << 16, 4096, false, 1);
    share_refusal(&try_open_with(&mut attacker, open, 4).await.err().expect("past the share"), "client/xferctl");
    // The victim is served.
    victim_lands(&mut victim, &mut b_owner, &b, 512 << 10, 5).await;
    drop(chans);
}

// ------------------------------------------------------------------ regions that do not end

/// A benchmark's scratch region on the target (`Peer.OpenBenchRegion`) is listed like any
/// region. A region in use can be neither deleted nor reaped at the end of its lease, so a
/// client's idle channel from it (ttl up to 24 h, reopened at will) would keep the scratch
/// region, its share of `limits.max_bench_bytes` and so the agent's one benchmark target after
/// the node that opened it closed it, and refuse every other node's benchmark. Clients do not
/// move a scratch region's bytes: the channel (and a write) is refused and the target is freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_keep_a_benchmark_target_after_its_node_closed_it() {
    let pki = pki();
    let (a, _ta) = pki.agent_with("node-a", "[limits]\nmax_bench_bytes = \"1MiB\"\n", "", &[]);
    let (b, _tb) = pki.agent("node-b");
    let mut attacker = pki.agent_client(&a, "xferctl").await;
    let mut b_owner = pki.agent_client(&b, "xferctl").await;
    b_owner.create_region(anon("dst", 1 << 20)).await.unwrap();
    let mut node_c = pki.peer(&a, "node-c").await;
    let scratch = node_c.open_bench_region(pb::OpenBenchRegionRequest { length: 1 << 20 }).await.unwrap().into_inner().region;
    let listed = attacker.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner().regions;
    assert!(listed.iter().any(|r| r.name == scratch), "clients see the scratch region: {listed:?}");
    // The attack: hold it in use.
    let mut open = open_msg_qps(pb::Op::Write, &scratch, &b, "dst", 0, 4096, false, 1);
    open.ttl = Some(prost_types::Duration { seconds: 86_400, nanos: 0 });
    let e = try_open_with(&mut attacker, open, 4).await.err().expect("refused");
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("scratch"), "{e:?}");
    let msg = pb::WriteRegionRequest { region: scratch.clone(), offset: 0, data: vec![1; 16] };
    assert_eq!(attacker.write_region(futures::stream::iter(vec![msg])).await.unwrap_err().code(), Code::PermissionDenied);
    // node-c's benchmark is over: its close frees the target, and another node's benchmark finds
    // it free with the whole budget.
    node_c.close_bench_region(pb::CloseBenchRegionRequest { region: scratch.clone() }).await.unwrap();
    let mut node_b = pki.peer(&a, "node-b").await;
    let again = node_b.open_bench_region(pb::OpenBenchRegionRequest { length: 1 << 20 }).await.unwrap().into_inner().region;
    node_b.close_bench_region(pb::CloseBenchRegionRequest { region: again }).await.unwrap();
}

// ------------------------------------------------------------------ the transfer history

/// The agent keeps the last 1,000 finished transfers for `GetTransfer`/`WatchTransfer`/
/// `ListTransfers`. Like a peer's inbound records, one client's finished transfers keep at most
/// its share of them: a stream of small transfers must not push every other client's results
/// out (a victim that polls for its result would get NOT_FOUND).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_push_another_clients_results_out_of_the_history() {
    let pki = pki();
    let (a, _ta) = pki.agent("node-a");
    let (b, _tb) = pki.agent("node-b");
    let mut attacker = pki.agent_client(&a, "xferctl").await;
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    let mut b_owner = pki.agent_client(&b, "xferctl").await;
    attacker.create_region(anon("src", 4096)).await.unwrap();
    victim.create_region(anon("vsrc", 64 << 10)).await.unwrap();
    b_owner.create_region(anon("dst", 1 << 20)).await.unwrap();
    let data = random_bytes(4096, 6);
    put_via(&mut victim, "vsrc", 0, &data).await;
    let mine = run_via(&mut victim, one_qp(write_req("vsrc", &b, "dst", 4096))).await.unwrap();
    assert_eq!(mine.state, pb::TransferState::Succeeded as i32);

    // The flood: 1,100 small transfers, 8 at a time (well inside the attacker's share).
    let base = one_qp(write_req("src", &b, "dst", 4096));
    let mut workers = Vec::new();
    for w in 0..8u64 {
        let (mut c, mut req) = (attacker.clone(), base.clone());
        req.remote.as_mut().unwrap().offset = (w + 1) << 16;
        workers.push(tokio::spawn(async move {
            for _ in 0..(1100 / 8 + 1) {
                let t = run_via(&mut c, req.clone()).await.unwrap();
                assert_eq!(t.state, pb::TransferState::Succeeded as i32);
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }

    // The attacker keeps about its share, 500 (each submit makes room among its finished
    // records; the 8 running then may finish beside them); the victim's result is still there.
    let list = victim.list_transfers(pb::ListTransfersRequest {}).await.unwrap().into_inner().transfers;
    assert!((501..=509).contains(&list.len()), "the attacker's share of the history and the victim's record: {}", list.len());
    let got = victim.get_transfer(pb::GetTransferRequest { id: mine.id.clone() }).await;
    let got = got.unwrap_or_else(|e| panic!("the victim's finished transfer was pushed out of the history: {e:?}")).into_inner();
    assert_eq!(got.state, pb::TransferState::Succeeded as i32);
    assert!(read_via(&mut b_owner, "dst", 0, 4096).await == data);
}

// ------------------------------------------------------------------ answers that list everyone's

/// The most labels a region may carry: 64 keys with a 16-character prefix and a 48-character
/// name, values of 63 (8,256 bytes).
fn largest_labels() -> std::collections::HashMap<String, String> {
    (0..64).map(|i| (format!("p{i:02}.example.com/{}", "n".repeat(48)), "v".repeat(63))).collect()
}

/// Labels are bounded per region so that the default 1,024 regions at their largest labels list
/// in the default 16 MiB message. `limits.max_message_size` may be set as low as 4 KiB (4 MiB
/// is gRPC's usual default): then one client's share of regions (512) at their largest labels
/// makes `ListRegions` larger than any answer the agent may send, and it fails for every client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "BUG: labels are bounded for the default max_message_size only; at 4 MiB one client's share of labelled regions breaks ListRegions for all"]
async fn one_clients_labels_cannot_break_list_regions_at_a_smaller_message_size() {
    let pki = pki();
    let (a, _t) = pki.agent_with("node-a", "[limits]\nmax_message_size = \"4MiB\"\n", "", &[]);
    let mut hoarder = pki.agent_client(&a, "xferctl").await;
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    victim.create_region(anon("mine", 4096)).await.unwrap();
    let labels = largest_labels();
    for i in 0..512 {
        hoarder.create_region(pb::CreateRegionRequest { labels: labels.clone(), ..anon(&format!("h{i:03}"), 4096) }).await.unwrap();
    }
    share_refusal(&hoarder.create_region(anon("h512", 4096)).await.unwrap_err(), "client/xferctl");
    let list = victim.list_regions(pb::ListRegionsRequest::default()).await;
    let list = list.unwrap_or_else(|e| panic!("the victim's ListRegions failed: {e:?}")).into_inner();
    assert_eq!(list.regions.len(), 513);
}

/// Every transfer record carries its notification tag (up to `transfer.max_notify_bytes`, which
/// may be raised to 64 KiB), and `ListTransfers` answers the whole history, outbound and
/// inbound, in one message. Inside its share, one client's 260 transfers with 64 KiB tags make
/// that answer larger than the 16 MiB the agent may send: `ListTransfers` fails for every
/// client of A, and, through the inbound records the same transfers leave, of B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "BUG: ListTransfers answers every record with its tag in one message; one client's tagged transfers break it for all"]
async fn one_clients_tags_cannot_break_list_transfers() {
    let pki = pki();
    let big_tags = "[transfer]\nmax_notify_bytes = 65536\n";
    let (a, _ta) = pki.agent_with("node-a", big_tags, "", &[]);
    let (b, _tb) = pki.agent_with("node-b", big_tags, "", &[]);
    let mut attacker = pki.agent_client(&a, "xferctl").await;
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    let mut b_owner = pki.agent_client(&b, "tenant-b").await;
    attacker.create_region(anon("src", 4096)).await.unwrap();
    b_owner.create_region(anon("dst", 1 << 20)).await.unwrap();
    let mut base = one_qp(write_req("src", &b, "dst", 4096));
    base.notify = Some(vec![b'x'; 65536]);
    let mut workers = Vec::new();
    for w in 0..4u64 {
        let (mut c, mut req) = (attacker.clone(), base.clone());
        req.remote.as_mut().unwrap().offset = w << 16;
        workers.push(tokio::spawn(async move {
            for _ in 0..65 {
                let t = run_via(&mut c, req.clone()).await.unwrap();
                assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    let list = victim.list_transfers(pb::ListTransfersRequest {}).await;
    assert!(list.is_ok(), "A's ListTransfers failed for the victim: {:?}", list.err());
    let list = b_owner.list_transfers(pb::ListTransfersRequest {}).await;
    assert!(list.is_ok(), "B's ListTransfers failed for its client: {:?}", list.err());
}

// ------------------------------------------------------------------ the gRPC port

/// `limits.max_grpc_connections` is first come, first served: one client that opens that many
/// authenticated connections (each kept alive by HTTP/2 pings) leaves no socket for any other
/// client, whose connection is closed at accept. Its first request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "BUG: the gRPC port's connection cap has no per-identity share; one client holds every connection"]
async fn one_client_cannot_hold_every_grpc_connection() {
    let pki = pki();
    let (a, _t) = pki.agent_with("node-a", "[limits]\nmax_grpc_connections = 8\n", "", &[]);
    let mut held = Vec::new();
    for _ in 0..8 {
        let Ok(ch) = pki.channel(&a.addr(), "ca.crt", Some("xferctl")).await else { break };
        let mut c = AgentClient::new(ch);
        if c.get_info(pb::GetInfoRequest {}).await.is_err() {
            break;
        }
        held.push(c);
    }
    assert!(!held.is_empty());
    // The victim's first connection and request are served.
    let ch = pki.channel(&a.addr(), "ca.crt", Some("tenant-b")).await;
    let ch = ch.unwrap_or_else(|e| panic!("the victim could not connect: {e:?}"));
    let r = AgentClient::new(ch).get_info(pb::GetInfoRequest {}).await;
    assert!(r.is_ok(), "the victim's first request failed while client/xferctl holds {} connections: {r:?}", held.len());
}

/// The same cap, filled by sockets that never start their TLS handshake: no certificate is
/// needed, and each socket would be held for the server's 10 s handshake timeout and reopened.
/// Sockets in their handshake hold at most half the cap (4 of 8); each newer one closes the
/// oldest, so a client with a certificate still connects and is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockets_that_never_start_tls_cannot_keep_clients_out() {
    let pki = pki();
    let (a, _t) = pki.agent_with("node-a", "[limits]\nmax_grpc_connections = 8\n", "", &[]);
    let silent: Vec<_> = (0..8).map(|_| std::net::TcpStream::connect(a.addr()).unwrap()).collect();
    // Every silent socket was accepted: each is held or was closed for a newer one.
    wait_held_or_evicted(&a, 8.0).await;
    let ch = pki.channel(&a.addr(), "ca.crt", Some("tenant-b")).await;
    let ch = ch.unwrap_or_else(|e| panic!("the victim could not connect: {e:?}"));
    let r = AgentClient::new(ch).get_info(pb::GetInfoRequest {}).await;
    assert!(r.is_ok(), "the victim's first request failed while {} silent sockets are held: {r:?}", silent.len());
    // The fifth to the eighth each closed one of the first four.
    wait_evicted(&a, 4.0).await;
    // The evicted sockets were closed by the agent: the oldest reads end-of-file at once.
    let mut first = &silent[0];
    let mut buf = [0u8; 1];
    assert_eq!(std::io::Read::read(&mut first, &mut buf).unwrap(), 0, "the oldest silent socket was closed");
}

/// A second wave of silent sockets while a client is connected: its established connection is
/// not pending, so no number of silent sockets closes it, and it keeps being served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sockets_never_close_an_authenticated_connection() {
    let pki = pki();
    let (a, _t) = pki.agent_with("node-a", "[limits]\nmax_grpc_connections = 8\n", "", &[]);
    let ch = pki.channel(&a.addr(), "ca.crt", Some("tenant-b")).await.unwrap();
    let mut victim = AgentClient::new(ch);
    victim.get_info(pb::GetInfoRequest {}).await.unwrap();
    let silent: Vec<_> = (0..32).map(|_| std::net::TcpStream::connect(a.addr()).unwrap()).collect();
    // The cap was reached: the victim's connection and 7 silent sockets, held or closed for newer ones.
    wait_held_or_evicted(&a, 8.0).await;
    let r = victim.get_info(pb::GetInfoRequest {}).await;
    assert!(r.is_ok(), "the victim's established connection failed after {} silent sockets: {r:?}", silent.len());
}

async fn evicted(a: &Agent) -> f64 {
    labelled(&scrape(a), "xfer_tls_handshake_failures_total", &[("reason", "evicted")])
}

/// Waits until `a`'s gRPC listener holds and has evicted at least `want` sockets together (polled:
/// a hang guard, the wait is for the value).
async fn wait_held_or_evicted(a: &Agent, want: f64) {
    for _ in 0..3000 {
        if grpc_connections(a).await + evicted(a).await >= want {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("the gRPC listener never held or evicted {want} sockets: {}", scrape(a));
}

/// Waits until `a` counts at least `want` handshakes closed for newer ones (polled: a hang
/// guard, the wait is for the value).
async fn wait_evicted(a: &Agent, want: f64) {
    for _ in 0..3000 {
        if evicted(a).await >= want {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("the gRPC listener never evicted {want} pending handshakes: {}", scrape(a));
}

/// The local unix socket's cap (`limits.max_grpc_connections`, at most a sixteenth of the
/// descriptors) is also first come, first served: one local uid that may open the socket holds
/// every connection, and another local user (uid 65534 here) cannot reach the agent at all.
/// Runs as root (to be the second uid).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "BUG: the unix socket's connection cap has no per-uid share; one local user holds every connection"]
async fn one_local_user_cannot_hold_every_unix_socket_connection() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    assert_eq!(own_uid(), 0, "needs root, to run the victim as another uid");
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = dir.path().join("agent.sock");
    let cfg = format!("unix_listen = {:?}\nunix_mode = \"0666\"\n[limits]\nmax_grpc_connections = 8\n", sock.display().to_string());
    let (a, _t) = pki.agent_with("node-a", &cfg, "", &[]);
    let (held, refused) = flood_h2(a.pid().unwrap(), 1 << 20, || std::os::unix::net::UnixStream::connect(&sock).unwrap());
    assert!(refused && held.len() <= 8, "{} sockets held", held.len());
    let out = std::process::Command::new(xferctl_bin())
        .args(["--agent", &format!("unix://{}", sock.display()), "--json", "info"])
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    assert!(out.status.success(), "uid 65534 was locked out while uid 0 holds {} connections: {:?}", held.len(), stderr_lines(&out));
}

// ------------------------------------------------------------------ streams that are not read

/// `ReadRegion` answers in 1 MiB pieces, each read from the region as the stream is polled. A
/// client that opens many of them on one connection and reads none makes the agent hold a piece
/// (or more) for each: HTTP/2 takes as many concurrent streams per connection as a client opens
/// (no `max_concurrent_streams`), so one client's unread streams grow the agent's memory without
/// bound, for every tenant. Bounded (64 ReadRegion/WriteRegion streams per agent, a tenant's
/// share of them), 400 unread streams over a 64 MiB region cost far less than 400 MiB, the rest
/// are refused, and another client is served meanwhile, its byte streams too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_read_region_streams_do_not_grow_the_agent_without_bound() {
    let pki = pki();
    let (a, _t) = pki.agent("node-a");
    let pid = a.pid().unwrap();
    let mut owner = pki.agent_client(&a, "tenant-b").await;
    owner.create_region(anon("big", 64 << 20)).await.unwrap();
    put_via(&mut owner, "big", 0, &random_bytes(1 << 20, 9)).await;
    let before = proc_status(pid, "VmRSS:");
    // One connection with a small window, 400 streams, none read.
    let ch = pki.channel(&a.addr(), "ca.crt", Some("xferctl")).await.unwrap();
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..400 {
        let mut c = AgentClient::new(ch.clone());
        match c.read_region(pb::ReadRegionRequest { region: "big".into(), offset: 0, length: 0 }).await {
            Ok(s) => held.push(s.into_inner()),
            Err(_) => refused += 1,
        }
    }
    let grown_mib = proc_status(pid, "VmRSS:").saturating_sub(before) / 1024;
    // Another client is served meanwhile.
    let mut victim = pki.agent_client(&a, "tenant-b").await;
    victim.create_region(anon("mine", 4096)).await.unwrap();
    put_via(&mut victim, "mine", 0, &[7u8; 4096]).await;
    let mut s = victim.read_region(pb::ReadRegionRequest { region: "mine".into(), offset: 0, length: 0 }).await.unwrap().into_inner();
    assert_eq!(s.message().await.unwrap().unwrap().data, vec![7u8; 4096], "the victim's own ReadRegion is served");
    assert!(grown_mib < 128, "{} unread streams ({refused} refused) grew the agent by {grown_mib} MiB", held.len());
    assert!(held.len() <= 32 && refused >= 368, "a tenant holds at most its share: {} held, {refused} refused", held.len());
}
