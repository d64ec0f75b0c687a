//! The attacker's test file (SECURITY.md, DESIGN §8): every trust-boundary promise, tried the way
//! an attacker would, against real agents on loopback. Each test asserts the refusal *and* that
//! nothing else changed (regions, bytes, grants, metrics). Host-safety attacks (paths, shm,
//! SIGBUS, exhaustion) are the host-safety issue's; the region-rkey-over-a-QP attack needs a
//! device and runs in the Soft-RoCE VM (`tests/device/verbs_security.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::process::Command;

use crate::common::pki::{dns, role_uri, uri, Pki};
use crate::common::*;
use tonic::transport::Channel;
use tonic::Code;
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;
use xfer_proto::v1::peer_client::PeerClient;

async fn region_names(c: &mut AgentClient<Channel>) -> Vec<String> {
    c.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner().regions.into_iter().map(|r| r.name).collect()
}

fn denied(e: &tonic::Status, role: &str) {
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains(role), "the refusal names the role needed ({role}): {e:?}");
}

// ------------------------------------------------------------------ roles from certificates

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_certificate_cannot_call_the_agent_service() {
    let pki = Pki::new();
    let (b, _t) = pki.agent("node-b");
    let mut owner = pki.agent_client(&b, "xferctl").await;
    owner.create_region(anon("secret", 4096)).await.unwrap();
    let data = random_bytes(4096, 1);
    put_via(&mut owner, "secret", 0, &data).await;

    let mut as_node = pki.agent_client(&b, "node-a").await;
    denied(&as_node.create_region(anon("evil", 4096)).await.unwrap_err(), "client");
    let mut file = anon("evil-file", 4096);
    file.kind = pb::RegionKind::File as i32;
    file.path = "/etc/shadow".into();
    denied(&as_node.create_region(file).await.unwrap_err(), "client");
    let e = match as_node.read_region(pb::ReadRegionRequest { region: "secret".into(), offset: 0, length: 0 }).await {
        Err(e) => e,
        Ok(mut s) => s.get_mut().message().await.unwrap_err(),
    };
    denied(&e, "client");
    denied(&as_node.delete_region(pb::DeleteRegionRequest { name: "secret".into() }).await.unwrap_err(), "client");
    denied(&as_node.get_info(pb::GetInfoRequest {}).await.unwrap_err(), "client");

    // Nothing changed.
    assert_eq!(region_names(&mut owner).await, ["secret"]);
    assert!(read_via(&mut owner, "secret", 0, 0).await == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_cannot_call_the_peer_service() {
    let pki = Pki::new();
    let (b, _t) = pki.agent("node-b");
    let mut owner = pki.agent_client(&b, "xferctl").await;
    owner.create_region(anon("dst", 4096)).await.unwrap();
    for who in ["xferctl", "admin"] {
        let mut p = pki.peer(&b, who).await;
        denied(&p.connect(connect_req("c1")).await.unwrap_err(), "node");
        denied(&p.grant(grant_req("dst", "node-a", "c1", pb::Access::Read)).await.unwrap_err(), "node");
        denied(&p.open_sink(pb::OpenSinkRequest { connections: 1, tls: false, pool: 0, scatter: 0 }).await.unwrap_err(), "node");
        denied(&p.open_bench_region(pb::OpenBenchRegionRequest { length: 4096 }).await.unwrap_err(), "node");
    }
    // No grant was made: the first one a real node asks for is the only one.
    let mut node = pki.peer(&b, "node-a").await;
    node.connect(connect_req("c1")).await.unwrap();
    node.grant(grant_req("dst", "node-a", "c1", pb::Access::Read)).await.unwrap();
    assert!(scrape(&b).lines().any(|l| l == "xfer_grants_active 1"), "{}", scrape(&b));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn benchmarks_need_the_admin_role() {
    let pki = Pki::new();
    let (a, _ta) = pki.agent("node-a");
    let (b, _tb) = pki.agent("node-b");
    let baseline =
        pb::TcpBaselineRequest { peer: b.addr(), bytes: 4 << 20, connections: 1, block: 1 << 20, tls: false, pool: 0, scatter: 0 };
    let bench = pb::BenchRequest { peer: b.addr(), op: pb::Op::Write as i32, size: 4096, iters: 4, qps: 1, depth: 1, ..Default::default() };
    let mut client = pki.agent_client(&a, "xferctl").await;
    denied(&client.tcp_baseline(baseline.clone()).await.unwrap_err(), "admin");
    denied(&client.bench(bench.clone()).await.unwrap_err(), "admin");
    // The admin may, and is a client too.
    let mut admin = pki.agent_client(&a, "admin").await;
    let r = admin.tcp_baseline(baseline.clone()).await.unwrap().into_inner();
    assert_eq!(r.bytes, 4 << 20);
    // Over pools (each of the two streams walks its 2 MiB share on both ends): every byte counted.
    let pooled = pb::TcpBaselineRequest { connections: 2, pool: 4 << 20, ..baseline };
    let r = admin.tcp_baseline(pooled.clone()).await.unwrap().into_inner();
    assert_eq!(r.bytes, 4 << 20);
    // Scattered over those pools in 4 KiB pieces, ending mid-piece: every byte counted too.
    let scattered = pb::TcpBaselineRequest { bytes: (4 << 20) + 1000, scatter: 4096, ..pooled };
    let r = admin.tcp_baseline(scattered).await.unwrap().into_inner();
    assert_eq!(r.bytes, (4 << 20) + 1000);
    let r = admin.bench(bench).await.unwrap().into_inner();
    assert_eq!(r.bytes, 4 * 4096);
    admin.get_info(pb::GetInfoRequest {}).await.unwrap();
    // The benchmark's scratch region on B is gone again.
    assert!(region_names(&mut pki.agent_client(&b, "xferctl").await).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_without_a_role_get_nothing() {
    let pki = Pki::new();
    pki.leaf("other-td", vec![uri("spiffe://other.example/xfer/client/x")]);
    pki.leaf("bad-role", vec![uri(&role_uri("root", "x"))]);
    let (b, _t) = pki.agent_with("node-b", "", "trust_domain = \"xfer.test\"", &[]);
    for who in ["norole", "other-td", "bad-role"] {
        let ch = pki.channel(&b.addr(), "ca.crt", Some(who)).await.unwrap();
        let e = AgentClient::new(ch.clone()).get_info(pb::GetInfoRequest {}).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{who}: {e:?}");
        assert!(e.message().contains("no xfer role"), "{who}: {e:?}");
        let e = PeerClient::new(ch.clone()).connect(connect_req("c1")).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{who}: {e:?}");
        let e = tonic_health::pb::health_client::HealthClient::new(ch)
            .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{who}: health is not open to role-less certificates: {e:?}");
    }
    // The same foreign-trust-domain certificate is a client where no trust domain is pinned.
    let (c, _tc) = pki.agent("node-c");
    let ch = pki.channel(&c.addr(), "ca.crt", Some("other-td")).await.unwrap();
    AgentClient::new(ch).get_info(pb::GetInfoRequest {}).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_roles_map_certificates_without_uri_sans() {
    let pki = Pki::new();
    pki.leaf("app", vec![dns("app-7.clients.xfer.test")]);
    pki.leaf("app-deep", vec![dns("a.b.clients.xfer.test")]);
    let (b, _t) = pki.agent_with("node-b", "", "dns_roles = [{ pattern = \"*.clients.xfer.test\", role = \"client\" }]", &[]);
    let ch = pki.channel(&b.addr(), "ca.crt", Some("app")).await.unwrap();
    AgentClient::new(ch.clone()).create_region(anon("r", 4096)).await.unwrap();
    denied(&PeerClient::new(ch).connect(connect_req("c1")).await.unwrap_err(), "node");
    let ch = pki.channel(&b.addr(), "ca.crt", Some("app-deep")).await.unwrap();
    let e = AgentClient::new(ch).get_info(pb::GetInfoRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "'*' matches one label only: {e:?}");
}

#[test]
fn an_agent_certificate_without_the_node_role_is_refused_at_start() {
    let pki = Pki::new();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            "insecure = false\n[tls]\ncert = {:?}\nkey = {:?}\nca = {:?}\n",
            pki.path("xferctl.crt"),
            pki.path("xferctl.key"),
            pki.path("ca.crt")
        ),
    )
    .unwrap();
    let o = Command::new(agent_bin())
        .args(["--node-name", "x", "--fabric", "tcp", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--state-dir"])
        .arg(tmp.path().join("state"))
        .arg("--config")
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("tls.cert") && err.contains("node role"), "{err}");
}

// ------------------------------------------------------------------ secure by default

fn run_agent(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let tmp = tempfile::tempdir().unwrap();
    Command::new(agent_bin())
        .args(["--node-name", "x", "--fabric", "tcp", "--state-dir"])
        .arg(tmp.path())
        .args(args)
        .env_remove("XFER_ALLOW_PLAINTEXT_NETWORK")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

#[test]
fn plaintext_on_a_network_address_is_refused_at_start() {
    let metrics = "127.0.0.1:0".to_string();
    for (args, key) in [
        (vec!["--listen", "0.0.0.0:0"], "listen = 0.0.0.0:0"),
        (vec!["--listen", "127.0.0.1:0", "--data-listen", "0.0.0.0:0"], "data_listen = 0.0.0.0:0"),
        (vec!["--listen", "[::]:0"], "listen = [::]:0"),
    ] {
        let mut args = args.clone();
        args.extend(["--metrics-listen", &metrics]);
        let o = run_agent(&args, &[]);
        assert_eq!(o.status.code(), Some(64), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        let lines = stderr_lines(&o);
        assert_eq!(lines.len(), 1, "one line: {lines:?}");
        assert!(lines[0].contains("allow_plaintext_network") && lines[0].contains(key), "{lines:?}");
    }
    // The default listener is loopback: an agent with no listener flags starts (and the data
    // listener follows its host); checked without starting it through --print-config.
    let o = run_agent(&["--print-config"], &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("listen = \"127.0.0.1:7470\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_on_the_network_needs_the_explicit_opt_in_and_warns() {
    let tmp = tempfile::tempdir().unwrap();
    let a = Agent::start_with_env(
        "node-a",
        &tmp.path().join("state"),
        Ports::new(),
        &["--data-listen", "0.0.0.0:0"],
        &[("XFER_ALLOW_PLAINTEXT_NETWORK", "true")],
    );
    assert!(a.logs().contains("allow_plaintext_network = true"), "{}", a.logs());
    // The data listener on 0.0.0.0 is advertised as such; peers reach it at the host they
    // dialled for gRPC.
    let b = Agent::start("node-b");
    b.create("src", 1 << 20, pb::Access::ReadWrite).await;
    a.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let data = random_bytes(1 << 20, 4);
    b.put("src", 0, &data).await;
    let t = b.transfer(write_req("src", &a, "dst", 1 << 20)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert!(a.read("dst", 0, 1 << 20).await == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_errors_say_bind_name_the_setting_and_appear_once() {
    let a = Agent::start("node-a");
    let info = a.client().await.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    let data = info.data_address;
    for (args, key) in [
        (vec!["--listen".to_string(), "127.0.0.1:0".into(), "--data-listen".into(), data.clone()], "data_listen"),
        (vec!["--listen".to_string(), a.addr()], "listen"),
        (vec!["--listen".to_string(), "127.0.0.1:0".into(), "--health-listen".into(), a.addr()], "health_listen"),
        (
            vec!["--listen".to_string(), "127.0.0.1:0".into(), "--metrics-listen".into(), format!("127.0.0.1:{}", a.ports.metrics)],
            "metrics_listen",
        ),
    ] {
        let mut args = args.clone();
        if !args.iter().any(|a| a == "--metrics-listen") {
            args.extend(["--metrics-listen".to_string(), "127.0.0.1:0".to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = run_agent(&args, &[("RUST_LOG", "error")]);
        assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(err.matches("bind").count(), 1, "{err}");
        assert_eq!(err.matches("Address already in use").count(), 1, "{err}");
        assert!(err.contains(&format!("({key})")), "names {key}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_work_with_mtls_on_through_the_health_listener_only() {
    let pki = Pki::new();
    let (a, _t) = pki.agent_with("node-a", "health_listen = \"127.0.0.1:0\"", "", &[]);
    let health = a.ports.health;
    assert_ne!(health, 0, "the ready file reports the health listener");
    let ch = Channel::from_shared(format!("http://127.0.0.1:{health}")).unwrap().connect().await.unwrap();
    let r = tonic_health::pb::health_client::HealthClient::new(ch.clone())
        .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);
    // It serves nothing else.
    let e = AgentClient::new(ch.clone()).get_info(pb::GetInfoRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented, "{e:?}");
    let e = PeerClient::new(ch).connect(connect_req("c1")).await.unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented, "{e:?}");
    // And the main port still wants a certificate.
    assert!(
        pki.channel(&a.addr(), "ca.crt", None).await.is_err()
            || AgentClient::new(pki.channel(&a.addr(), "ca.crt", None).await.unwrap()).get_info(pb::GetInfoRequest {}).await.is_err()
    );
}

// ------------------------------------------------------------------ the tcp data plane

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_works_only_on_the_connection_it_was_granted_on() {
    let b = Agent::start("node-b");
    b.create("dst", 8192, pb::Access::ReadWrite).await;
    let before = random_bytes(8192, 3);
    b.put("dst", 0, &before).await;
    let mut s1 = b.data_stream("c1").await;
    let mut s2 = b.data_stream("c2").await;
    let mut p = b.peer_client().await;
    let gw = p.grant(grant_req("dst", "node-a", "c1", pb::Access::Write)).await.unwrap().into_inner();
    let gr = p.grant(grant_req("dst", "node-a", "c1", pb::Access::Read)).await.unwrap().into_inner();
    let (tw, tr): ([u8; 16], [u8; 16]) = (gw.token.as_slice().try_into().unwrap(), gr.token.as_slice().try_into().unwrap());

    // On another connection (same caller, its own valid secret) both tokens are dead.
    assert_eq!(raw_write(&mut s2, tw, gw.addr, &[0xee; 4096]), (10, Kind::Nak), "REM_ACCESS_ERR NAK");
    let mut s2 = b.data_stream("c3").await;
    let (status, _, data) = raw_read(&mut s2, tr, gr.addr, 4096);
    assert_eq!((status, data.len()), (10, 0), "no bytes read through another connection");
    assert!(b.read("dst", 0, 8192).await == before, "bytes changed");

    // On their own connection they work.
    let (status, _, data) = raw_read(&mut s1, tr, gr.addr, 4096);
    assert_eq!(status, 0);
    assert!(data == before[..4096]);
    assert_eq!(raw_write(&mut s1, tw, gw.addr, &[0xee; 4096]), (0, Kind::Ack), "ACK");
    assert!(b.read("dst", 0, 4096).await == vec![0xee; 4096]);
}

fn expect_refused(mut s: std::net::TcpStream, status: u16) {
    let h = read_header(&mut s);
    assert_eq!((h.kind, h.status), (Kind::Nak, status), "NAK with status {status}");
    assert_closed(&mut s, "closed after the refusal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_streams_need_the_secret_of_a_live_connection() {
    let b = Agent::start("node-b");
    b.create("dst", 8192, pb::Access::ReadWrite).await;
    let before = random_bytes(8192, 5);
    b.put("dst", 0, &before).await;
    let (address, secret) = b.data_session("c1").await;
    let g = b.peer_client().await.grant(grant_req("dst", "node-a", "c1", pb::Access::Write)).await.unwrap().into_inner();
    let token: [u8; 16] = g.token.as_slice().try_into().unwrap();

    // A wrong secret, another connection's id, an unknown id, a short hello: refused before any
    // frame is read; the frame that follows is never applied.
    let mut wrong = secret.clone();
    wrong[0] ^= 1;
    let (_, other) = b.data_session("c2").await;
    for (id, sec) in [("c1", wrong.as_slice()), ("c2", secret.as_slice()), ("c1", other.as_slice()), ("nope", secret.as_slice())] {
        let mut s = open_data_stream(&address, id, sec);
        let _ = s.write_all(&frame_header(Kind::Write, 0, 0, token, 0, 4));
        let _ = s.write_all(&[0xee; 4]);
        expect_refused(s, 10);
    }
    // No hello at all: a frame straight away is garbage.
    let mut s = std::net::TcpStream::connect(&address).unwrap();
    s.set_read_timeout(Some(READ_GUARD)).unwrap();
    s.write_all(&[0u8; frame::HEADER_LEN]).unwrap();
    expect_refused(s, 9);
    assert!(b.read("dst", 0, 8192).await == before, "bytes changed");

    // Disconnect ends the session: open streams are closed, new ones refused, the grant is gone.
    let mut live = open_data_stream(&address, "c1", &secret);
    assert_eq!(raw_write(&mut live, token, g.addr, &[0xaa; 16]), (0, Kind::Ack));
    b.peer_client().await.disconnect(pb::DisconnectRequest { connection_id: "c1".into(), node_name: String::new() }).await.unwrap();
    assert_closed(&mut live, "stream closed by Disconnect");
    expect_refused(open_data_stream(&address, "c1", &secret), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_mtls_the_data_port_speaks_tls_only() {
    let pki = Pki::new();
    let (b, _t) = pki.agent("node-b");
    let mut c = pki.agent_client(&b, "xferctl").await;
    let info = c.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    c.create_region(anon("dst", 4096)).await.unwrap();
    let before = random_bytes(4096, 8);
    put_via(&mut c, "dst", 0, &before).await;
    // node-a's connection secret, presented in clear text on the data port: the TLS server
    // never sees a ClientHello and closes.
    let r = pki.peer(&b, "node-a").await.connect(connect_req("c1")).await.unwrap().into_inner();
    let Some(pb::endpoint::Kind::Tcp(t)) = &r.endpoints[0].kind else { panic!("tcp endpoint") };
    assert_eq!(t.secret.len(), 32);
    let mut s = open_data_stream(&info.data_address, "c1", &t.secret);
    let _ = s.write_all(&[0u8; frame::HEADER_LEN]);
    // Whatever the TLS server answers (an alert, or nothing), it closes: a read that runs into
    // the guard is a stream left open, never a pass.
    let mut buf = Vec::new();
    if let Err(e) = s.read_to_end(&mut buf) {
        assert!(
            !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
            "the TLS port left a plaintext stream open: {e}"
        );
    }
    assert!(!buf.starts_with(&frame::MAGIC.to_le_bytes()), "a plaintext stream got an xfer frame back");
    assert!(read_via(&mut c, "dst", 0, 0).await == before);
}

// ------------------------------------------------------------------ identity-keyed limits

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_names_do_not_multiply_the_grant_quota() {
    let b = Agent::start_env("node-b", &[("XFER_LIMITS__MAX_GRANTS_PER_PEER", "100")]);
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let _session = b.data_session("c1").await;
    let mut p = b.peer_client().await;
    let (mut ok, mut exhausted) = (0, 0);
    for i in 0..2000 {
        match p.grant(grant_req("dst", &format!("node-{}", i % 50), "c1", pb::Access::Write)).await {
            Ok(_) => ok += 1,
            Err(e) => {
                assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
                exhausted += 1;
            }
        }
    }
    assert_eq!((ok, exhausted), (100, 1900), "2,000 grants under 50 names: the limit holds for the one caller");
    assert!(scrape(&b).lines().any(|l| l == "xfer_grants_active 100"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_are_per_certificate_identity() {
    let pki = Pki::new();
    let (b, _t) = pki.agent_with("node-b", "[limits]\nmax_grants_per_peer = 3", "", &[]);
    pki.agent_client(&b, "xferctl").await.create_region(anon("dst", 1 << 20)).await.unwrap();
    let mut as_a = pki.peer(&b, "node-a").await;
    let mut as_c = pki.peer(&b, "node-c").await;
    as_a.connect(connect_req("conn-a")).await.unwrap();
    as_c.connect(connect_req("conn-c")).await.unwrap();
    for i in 0..3 {
        as_a.grant(grant_req("dst", &format!("alias-{i}"), "conn-a", pb::Access::Write)).await.unwrap();
    }
    let e = as_a.grant(grant_req("dst", "node-c", "conn-a", pb::Access::Write)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "claiming node-c's name is no way out: {e:?}");
    // node-c's quota is its own, and it cannot use node-a's connection.
    as_c.grant(grant_req("dst", "node-c", "conn-c", pb::Access::Write)).await.unwrap();
    denied(&as_c.grant(grant_req("dst", "node-c", "conn-a", pb::Access::Write)).await.unwrap_err(), "another peer");
    // Nor take it over by connecting under its id, nor tear it down.
    let e = as_c.connect(connect_req("conn-a")).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    as_c.disconnect(pb::DisconnectRequest { connection_id: "conn-a".into(), node_name: "node-a".into() }).await.unwrap();
    let e = as_a.grant(grant_req("dst", "node-a", "conn-a", pb::Access::Write)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "conn-a survived and node-a's grants are intact: {e:?}");
    assert!(scrape(&b).lines().any(|l| l == "xfer_grants_active 4"), "{}", scrape(&b));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_names_do_not_create_metric_series() {
    let b = Agent::start("node-b");
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let _session = b.data_session("c1").await;
    let mut p = b.peer_client().await;
    for i in 0..300 {
        let name = format!("forged-{i}");
        let g = p.grant(grant_req("dst", &name, "c1", pb::Access::Write)).await.unwrap().into_inner();
        p.complete(pb::CompleteRequest {
            transfer_id: format!("t{i}"),
            grant_id: g.grant_id,
            bytes: 4096,
            op: pb::Op::Write as i32,
            node_name: name,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let text = scrape(&b);
    let series: Vec<&str> = text.lines().filter(|l| l.starts_with("xfer_transfer_bytes_total{")).collect();
    assert_eq!(series.len(), 1, "{series:?}");
    assert!(series[0].contains("peer=\"loopback\""), "{series:?}");
    assert!(!text.contains("forged-"), "a declared name reached the metrics");
}

// ------------------------------------------------------------------ bounded admin calls

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn benchmark_targets_are_one_at_a_time_and_count_against_their_own_budget() {
    let b = Agent::start_env("node-b", &[("XFER_LIMITS__MAX_REGISTERED_BYTES", "8MiB"), ("XFER_LIMITS__MAX_BENCH_BYTES", "8MiB")]);
    let mut p = b.peer_client().await;
    // A sink whose pool is past the benchmarks' budget (or past any size) is refused before
    // anything is allocated, and holds no slot: the next sink opens.
    for pool in [16 << 20, u64::MAX] {
        let e = p.open_sink(pb::OpenSinkRequest { connections: 2, tls: false, pool, scatter: 0 }).await.unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "pool {pool}: {e:?}");
        assert!(e.message().contains("max_bench_bytes"), "{e:?}");
    }
    // Scattered pieces the pool cannot hold (no pool, past a stream's share, tiny, u64::MAX) are
    // refused before anything is allocated, and hold no slot either.
    for (pool, scatter, tls) in [(0, 4096, false), (1 << 20, (1 << 20) / 2 + 1, false), (1 << 20, 1, false), (1 << 20, u64::MAX, false)] {
        let e = p.open_sink(pb::OpenSinkRequest { connections: 2, tls, pool, scatter }).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "pool {pool}, scatter {scatter}, tls {tls}: {e:?}");
    }
    p.open_sink(pb::OpenSinkRequest { connections: 1, tls: false, pool: 0, scatter: 0 }).await.unwrap();
    let e = p.open_sink(pb::OpenSinkRequest { connections: 1, tls: false, pool: 0, scatter: 0 }).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "one sink at a time: {e:?}");

    let e = p.open_bench_region(pb::OpenBenchRegionRequest { length: 16 << 20 }).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "over max_bench_bytes: {e:?}");
    assert!(e.message().contains("max_bench_bytes"), "{e:?}");
    let r = p.open_bench_region(pb::OpenBenchRegionRequest { length: 4 << 20 }).await.unwrap().into_inner();
    let e = p.open_bench_region(pb::OpenBenchRegionRequest { length: 4096 }).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "one benchmark at a time: {e:?}");
    // It is a real region, but from the benchmarks' budget: a client still gets every byte of
    // max_registered_bytes beside it.
    let mut c = b.client().await;
    c.create_region(anon("big", 8 << 20)).await.unwrap();
    p.close_bench_region(pb::CloseBenchRegionRequest { region: r.region.clone() }).await.unwrap();
    // Closing anything else is NOT_FOUND, and deletes nothing.
    let e = p.close_bench_region(pb::CloseBenchRegionRequest { region: "big".into() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    assert_eq!(region_names(&mut c).await, ["big"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_calls_run_one_at_a_time_and_their_buffers_count() {
    let a = Agent::start_env("node-a", &[("XFER_LIMITS__MAX_BENCH_BYTES", "1MiB")]);
    let b = Agent::start("node-b");
    let mut c = a.client().await;
    // A 4 MiB baseline buffer does not fit in the benchmarks' 1 MiB.
    let e = c
        .tcp_baseline(pb::TcpBaselineRequest {
            peer: b.addr(),
            bytes: 1 << 20,
            connections: 1,
            block: 4 << 20,
            tls: false,
            pool: 0,
            scatter: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("max_bench_bytes"), "{e:?}");

    // A peer that accepts TCP and never answers holds the first call; the second is refused at
    // once. Whichever gets the slot, the other must come back first, with RESOURCE_EXHAUSTED.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = silent.local_addr().unwrap().to_string();
    let req =
        pb::BenchRequest { peer: peer.clone(), op: pb::Op::Write as i32, size: 4096, iters: 1, qps: 1, depth: 1, ..Default::default() };
    let (mut c1, mut c2) = (a.client().await, a.client().await);
    let base = pb::TcpBaselineRequest { peer, bytes: 4096, connections: 1, block: 4096, tls: false, pool: 0, scatter: 0 };
    let first = c1.bench(req);
    let second = c2.tcp_baseline(base);
    let e = tokio::select! {
        r = first => r.map(|_| ()).unwrap_err(),
        r = second => r.map(|_| ()).unwrap_err(),
    };
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("one at a time"), "{e:?}");
    drop(silent);
}
