//! TLS that explains itself: what the agent refuses at start (exit 64, naming the file), what
//! xferctl says for each connection mistake, and that the agent logs and counts every refused
//! handshake (`xfer_tls_handshake_failures_total{reason}`) and denied call
//! (`xfer_rpc_denied_total{method,role}`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Stdio};

use crate::common::pki::Pki;
use crate::common::*;
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;

/// Starts an agent with these TLS files and expects it to refuse: its exit code and stderr.
fn refused_start(pki: &Pki, cert: &str, key: &str, ca: &str, tls_extra: &str) -> (Option<i32>, String) {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("agent.toml");
    std::fs::write(
        &cfg,
        format!("insecure = false\n[tls]\ncert = {:?}\nkey = {:?}\nca = {:?}\n{tls_extra}\n", pki.path(cert), pki.path(key), pki.path(ca)),
    )
    .unwrap();
    let o = Command::new(agent_bin())
        .args(["--node-name", "node-a", "--fabric", "tcp", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--config"])
        .arg(&cfg)
        .arg("--state-dir")
        .arg(tmp.path().join("state"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn the_agent_refuses_tls_files_that_do_not_fit_and_names_the_fix() {
    let pki = Pki::new();
    let (code, err) = refused_start(&pki, "node-a.crt", "node-b.key", "ca.crt", "");
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("tls.key") && err.contains("node-b.key") && err.contains("does not match the certificate in tls.cert"), "{err}");

    // A leaf given as the CA: before, the agent started and every caller saw "broken pipe".
    let (code, err) = refused_start(&pki, "node-a.crt", "node-a.key", "node-b.crt", "");
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("tls.ca") && err.contains("a leaf, not a CA certificate"), "{err}");

    let (code, err) = refused_start(&pki, "impostor.crt", "impostor.key", "ca.crt", "");
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("tls.cert") && err.contains("does not chain to tls.ca"), "{err}");

    let (code, err) = refused_start(&pki, "xferctl.crt", "xferctl.key", "ca.crt", "");
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("needs the node role"), "{err}");

    let (code, err) = refused_start(&pki, "node-a.crt", "node-a.key", "ca.crt", "server_name = \"xfer-agent.xfer-system.svc\"");
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("tls.server_name") && err.contains("is not a name tls.cert"), "{err}");
}

fn ctl(addr: &str, args: &[&str]) -> std::process::Output {
    Command::new(xferctl_bin())
        .arg("--agent")
        .arg(addr)
        .args(args)
        .env_remove("XFER_CERT")
        .env_remove("XFER_KEY")
        .env_remove("XFER_CA")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn one_line(o: &std::process::Output) -> String {
    let lines = stderr_lines(o);
    assert_eq!(lines.len(), 1, "{lines:?}");
    lines[0].clone()
}

/// Waits until `series{labels}` of `a` reaches `want`: the agent counts a refused handshake in
/// the task that ran it, which may finish just after the client saw the refusal (polled, a safety
/// net against a hang; the wait is for the value).
async fn wait_counter(a: &Agent, name: &str, labels: &[(&str, &str)], want: f64) {
    for _ in 0..3000 {
        if labelled(&scrape(a), name, labels) >= want {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{name}{labels:?} never reached {want}: {}", scrape(a));
}

const HS: &str = "xfer_tls_handshake_failures_total";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_client_mistake_gets_its_own_message_and_the_agent_counts_it() {
    let pki = Pki::new();
    let (a, _ta) = pki.agent("node-a");
    let (cert, key, ca) = (pki.path("xferctl.crt"), pki.path("xferctl.key"), pki.path("ca.crt"));
    let (cert, key, ca) = (cert.to_str().unwrap(), key.to_str().unwrap(), ca.to_str().unwrap());

    // Plaintext to the mTLS agent.
    let o = ctl(&a.addr(), &["info"]);
    assert_eq!(o.status.code(), Some(8));
    let line = one_line(&o);
    assert!(line.contains("requires mTLS and this connection was plaintext") && line.contains("--cert"), "{line}");
    wait_counter(&a, HS, &[("reason", "protocol")], 1.0).await;

    // TLS without a client certificate.
    let o = ctl(&a.addr(), &["--ca", ca, "info"]);
    assert_eq!(o.status.code(), Some(8));
    let line = one_line(&o);
    assert!(line.contains("requires a client certificate (mTLS) and none was given"), "{line}");
    wait_counter(&a, HS, &[("reason", "no_certificate")], 1.0).await;

    // A client certificate from another CA.
    let (ic, ik) = (pki.path("impostor.crt"), pki.path("impostor.key"));
    let o = ctl(&a.addr(), &["--cert", ic.to_str().unwrap(), "--key", ik.to_str().unwrap(), "--ca", ca, "info"]);
    assert_eq!(o.status.code(), Some(8));
    let line = one_line(&o);
    assert!(line.contains("refused the client certificate"), "{line}");
    wait_counter(&a, HS, &[("reason", "unknown_ca")], 1.0).await;

    // A key that is not the certificate's: named before any connection (usage error).
    let wrong_key = pki.path("admin.key");
    let o = ctl(&a.addr(), &["--cert", cert, "--key", wrong_key.to_str().unwrap(), "--ca", ca, "info"]);
    assert_eq!(o.status.code(), Some(2));
    let line = one_line(&o);
    assert!(line.contains("does not match --cert") && line.contains("admin.key"), "{line}");

    // --agent at the metrics port.
    let metrics = format!("127.0.0.1:{}", a.ports.metrics);
    let o = ctl(&metrics, &["--cert", cert, "--key", key, "--ca", ca, "info"]);
    assert_eq!(o.status.code(), Some(8));
    let line = one_line(&o);
    assert!(line.contains("metrics/health port") && line.contains("gRPC address"), "{line}");
    let o = ctl(&metrics, &["info"]);
    assert!(one_line(&o).contains("metrics/health port"), "{:?}", stderr_lines(&o));

    // doctor without client certificates: not "start xfer-agent".
    let o = ctl(&a.addr(), &["doctor"]);
    let out = String::from_utf8_lossy(&o.stdout);
    let agent_line = out.lines().find(|l| l.contains("agent")).unwrap_or_default().to_string();
    assert!(agent_line.contains("requires mTLS") && !agent_line.contains("start xfer-agent"), "{out}");

    // The right files work, and none of the mistakes above was a denied call.
    let o = ctl(&a.addr(), &["--cert", cert, "--key", key, "--ca", ca, "info"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(metric(&scrape(&a), "xfer_rpc_denied_total"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_client_against_a_plaintext_agent_is_named() {
    let pki = Pki::new();
    let a = Agent::start("plain");
    let (cert, key, ca) = (pki.path("xferctl.crt"), pki.path("xferctl.key"), pki.path("ca.crt"));
    let o = ctl(&a.addr(), &["--cert", cert.to_str().unwrap(), "--key", key.to_str().unwrap(), "--ca", ca.to_str().unwrap(), "info"]);
    assert_eq!(o.status.code(), Some(8));
    let line = one_line(&o);
    assert!(line.contains("speaks plaintext (insecure = true), not TLS") && line.contains("drop --ca"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_calls_are_counted_by_method_and_role() {
    let pki = Pki::new();
    let (a, _ta) = pki.agent("node-a");
    // A client certificate calling the agents-only service.
    let mut as_client = pki.peer(&a, "xferctl").await;
    let e = as_client.ping(pb::PingRequest::default()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("needs the node role"), "{e:?}");
    // A node certificate calling the users' service.
    let e = AgentClient::new(pki.channel(&a.addr(), "ca.crt", Some("node-b")).await.unwrap())
        .get_info(pb::GetInfoRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    // A certificate of this CA that carries no role.
    let e = AgentClient::new(pki.channel(&a.addr(), "ca.crt", Some("norole")).await.unwrap())
        .get_info(pb::GetInfoRequest {})
        .await
        .unwrap_err();
    assert!(e.message().contains("carries no xfer role"), "{e:?}");
    let text = scrape(&a);
    assert_eq!(labelled(&text, "xfer_rpc_denied_total", &[("method", "xfer.v1.Peer/Ping"), ("role", "client")]), 1.0, "{text}");
    assert_eq!(labelled(&text, "xfer_rpc_denied_total", &[("method", "xfer.v1.Agent/GetInfo"), ("role", "node")]), 1.0, "{text}");
    assert_eq!(labelled(&text, "xfer_rpc_denied_total", &[("method", "xfer.v1.Agent/GetInfo"), ("role", "none")]), 1.0, "{text}");
    assert!(a.logs().contains("call refused"), "{}", a.logs());
}

/// A data-port connection whose first bytes are not a TLS handshake is refused in that
/// handshake and counted (`xfer_data_tls_handshake_failures_total{role="target"}`), and the agent
/// goes on serving its callers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_port_connection_that_is_not_tls_is_counted_and_changes_nothing_else() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const DATA_HS: &str = "xfer_data_tls_handshake_failures_total";
    let pki = Pki::new();
    let (a, _ta) = pki.agent("node-a");
    assert_eq!(labelled(&scrape(&a), DATA_HS, &[("role", "target")]), 0.0);
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", a.ports.data)).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: xfer\r\n\r\n").await.unwrap();
    // The agent ends the connection (an alert, then EOF, or a reset): nothing else comes back.
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf).await;
    wait_counter(&a, DATA_HS, &[("role", "target")], 1.0).await;
    let (cert, key, ca) = (pki.path("xferctl.crt"), pki.path("xferctl.key"), pki.path("ca.crt"));
    let o = ctl(&a.addr(), &["--cert", cert.to_str().unwrap(), "--key", key.to_str().unwrap(), "--ca", ca.to_str().unwrap(), "info"]);
    assert!(o.status.success(), "{}", one_line(&o));
}
