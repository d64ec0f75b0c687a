//! mTLS (DESIGN §8): real agents with `insecure = false`, certificates made here with rcgen (no
//! openssl needed). Checks a transfer between two mTLS agents, that callers without a certificate
//! or with one from another CA are refused, that grants are bound to the caller's certificate
//! identity (not its self-declared node name), and xferctl's `--cert/--key/--ca`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::common::pki::Pki;
use crate::common::*;
use tonic::transport::Channel;
use tonic::Code;
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;
use xfer_proto::v1::peer_client::PeerClient;

/// GetInfo with `who`'s certificate, trusting `ca`: the status code, or Ok.
async fn get_info(pki: &Pki, agent: &Agent, ca: &str, who: Option<&str>) -> Result<String, String> {
    let ch = pki.channel(&agent.addr(), ca, who).await.map_err(|e| format!("connect: {e:?}"))?;
    AgentClient::new(ch).get_info(pb::GetInfoRequest {}).await.map(|r| r.into_inner().node_name).map_err(|s| format!("{s:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_mtls_agents_write() {
    let pki = Pki::new();
    let (a, _ta) = pki.agent("node-a");
    let (b, _tb) = pki.agent("node-b");
    assert!(a.logs().contains("mTLS on"), "{}", a.logs());
    let len = 4 << 20;
    let data = random_bytes(len, 7);
    let ca = pki.agent_client(&a, "xferctl").await;
    let cb = pki.agent_client(&b, "xferctl").await;
    for (mut c, name, access) in [(ca.clone(), "src", pb::Access::Read), (cb.clone(), "dst", pb::Access::ReadWrite)] {
        c.create_region(pb::CreateRegionRequest {
            name: name.into(),
            length: len as u64,
            kind: pb::RegionKind::Anonymous as i32,
            access: access as i32,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let msgs = data.chunks(1 << 20).enumerate().map(|(i, c)| pb::WriteRegionRequest {
        region: if i == 0 { "src".into() } else { String::new() },
        offset: 0,
        data: c.to_vec(),
    });
    ca.clone().write_region(futures::stream::iter(msgs.collect::<Vec<_>>())).await.unwrap();

    let mut req = write_req("src", &b, "dst", len as u64);
    req.options = Some(pb::TransferOptions { verify: true, ..Default::default() });
    let t = ca.clone().submit_transfer(req).await.unwrap().into_inner();
    let mut w = ca.clone().watch_transfer(pb::WatchTransferRequest { id: t.id.clone() }).await.unwrap().into_inner();
    let mut last = t;
    while let Some(m) = w.message().await.unwrap() {
        last = m;
    }
    assert_eq!(last.state, pb::TransferState::Succeeded as i32, "{last:?}\nA: {}\nB: {}", a.logs(), b.logs());
    assert!(last.verified);

    let mut s = cb.clone().read_region(pb::ReadRegionRequest { region: "dst".into(), offset: 0, length: 0 }).await.unwrap().into_inner();
    let mut got = Vec::new();
    while let Some(m) = s.message().await.unwrap() {
        got.extend_from_slice(&m.data);
    }
    assert!(got == data, "bytes differ after an mTLS WRITE");

    // B recorded the inbound transfer under A's certificate identity.
    let list = cb.clone().list_transfers(pb::ListTransfersRequest {}).await.unwrap().into_inner();
    let inbound = list.transfers.iter().find(|t| t.inbound).expect("inbound record on B");
    assert_eq!(inbound.peer, "node-a");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_and_foreign_clients_are_refused() {
    let pki = Pki::new();
    let (a, _ta) = pki.agent("node-a");
    assert_eq!(get_info(&pki, &a, "ca.crt", Some("xferctl")).await, Ok("node-a".into()));

    // Plaintext HTTP/2 to a TLS port.
    let plain = Channel::from_shared(format!("http://{}", a.addr())).unwrap().connect().await;
    if let Ok(ch) = plain {
        let r = AgentClient::new(ch).get_info(pb::GetInfoRequest {}).await;
        assert!(r.is_err(), "plaintext call answered: {r:?}");
    }
    // TLS without a client certificate.
    let r = get_info(&pki, &a, "ca.crt", None).await;
    assert!(r.is_err(), "no client certificate but answered: {r:?}");
    // A client certificate from another CA, with the same names as a real node.
    let r = get_info(&pki, &a, "ca.crt", Some("impostor")).await;
    assert!(r.is_err(), "foreign-CA certificate but answered: {r:?}");
    // And the client side: a server that does not chain to the CA we trust is refused too.
    let r = get_info(&pki, &a, "other.crt", Some("xferctl")).await;
    assert!(r.is_err(), "server verified against the wrong CA: {r:?}");
    // The agent is still fine.
    assert_eq!(get_info(&pki, &a, "ca.crt", Some("xferctl")).await, Ok("node-a".into()));
}

/// `Peer.Connect` (tcp) as connection `id`, over the caller's mTLS channel.
async fn connect(p: &mut PeerClient<Channel>, id: &str) {
    p.connect(pb::PeerConnectRequest {
        version: 1,
        node_name: "whoever".into(),
        fabric: pb::FabricKind::Tcp as i32,
        endpoints: vec![],
        connection_id: id.into(),
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_are_bound_to_the_certificate_identity() {
    let pki = Pki::new();
    let (b, _tb) = pki.agent("node-b");
    pki.agent_client(&b, "xferctl")
        .await
        .create_region(pb::CreateRegionRequest {
            name: "dst".into(),
            length: 1 << 20,
            kind: pb::RegionKind::Anonymous as i32,
            access: pb::Access::ReadWrite as i32,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut as_a = pki.peer(&b, "node-a").await;
    let mut as_c = pki.peer(&b, "node-c").await;
    connect(&mut as_a, "conn-a").await;
    connect(&mut as_c, "conn-c").await;

    // node-a's grant: node-c cannot complete or revoke it, even when it claims to be node-a.
    let g = as_a.grant(grant_req("dst", "node-a", "conn-a", pb::Access::Write)).await.unwrap().into_inner();
    for declared in ["node-c", "node-a"] {
        let e = as_c.complete(complete_req(&g.grant_id, &format!("t-{}", g.grant_id), 4096, declared)).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "complete as {declared}: {e:?}");
    }
    let e = as_c.revoke(pb::RevokeRequest { grant_id: g.grant_id.clone() }).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // The owner can.
    as_a.complete(complete_req(&g.grant_id, &format!("t-{}", g.grant_id), 4096, "node-a")).await.unwrap();
    let g2 = as_a.grant(grant_req("dst", "node-a", "conn-a", pb::Access::Write)).await.unwrap().into_inner();
    as_a.revoke(pb::RevokeRequest { grant_id: g2.grant_id.clone() }).await.unwrap();
    let e = as_a.revoke(pb::RevokeRequest { grant_id: g2.grant_id }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    // A grant requested by node-c while claiming to be node-a is node-c's, not node-a's.
    let g3 = as_c.grant(grant_req("dst", "node-a", "conn-c", pb::Access::Write)).await.unwrap().into_inner();
    let e = as_a.complete(complete_req(&g3.grant_id, &format!("t-{}", g3.grant_id), 4096, "node-a")).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    as_c.complete(complete_req(&g3.grant_id, &format!("t-{}", g3.grant_id), 4096, "whatever")).await.unwrap();
    let list = pki.agent_client(&b, "xferctl").await.list_transfers(pb::ListTransfersRequest {}).await.unwrap().into_inner();
    let mut peers: Vec<_> = list.transfers.iter().filter(|t| t.inbound).map(|t| t.peer.clone()).collect();
    peers.sort();
    assert_eq!(peers, ["node-a", "node-c"], "inbound records carry certificate identities, not declared names");
}

fn xferctl(agent: &Agent, args: &[&str], env: &[(&str, PathBuf)]) -> std::process::Output {
    Command::new(xferctl_bin())
        .arg("--agent")
        .arg(agent.addr())
        .args(args)
        .env_remove("XFER_CERT")
        .env_remove("XFER_KEY")
        .env_remove("XFER_CA")
        .envs(env.iter().map(|(k, v)| (*k, v)))
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[test]
fn xferctl_with_and_without_certificates() {
    let pki = Pki::new();
    let (a, _ta) = pki.agent("node-a");
    let (cert, key, ca) = (pki.path("xferctl.crt"), pki.path("xferctl.key"), pki.path("ca.crt"));
    let o = xferctl(&a, &["--cert", cert.to_str().unwrap(), "--key", key.to_str().unwrap(), "--ca", ca.to_str().unwrap(), "info"], &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("node-a"));

    let o = xferctl(&a, &["--json", "info"], &[("XFER_CERT", cert.clone()), ("XFER_KEY", key.clone()), ("XFER_CA", ca.clone())]);
    assert!(o.status.success(), "env: {}", String::from_utf8_lossy(&o.stderr));

    // An https:// agent address works with the TLS options ...
    let https = format!("https://{}", a.addr());
    let at_https = |args: &[&str]| {
        Command::new(xferctl_bin())
            .args(["--agent", &https])
            .args(args)
            .env_remove("XFER_CERT")
            .env_remove("XFER_KEY")
            .env_remove("XFER_CA")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let o = at_https(&["--cert", cert.to_str().unwrap(), "--key", key.to_str().unwrap(), "--ca", ca.to_str().unwrap(), "info"]);
    assert!(o.status.success(), "https:// address: {}", String::from_utf8_lossy(&o.stderr));
    // ... and without them it is a usage error that says what is missing, not a parse error.
    let o = at_https(&["info"]);
    assert_eq!(o.status.code(), Some(2), "{}", String::from_utf8_lossy(&o.stderr));
    let lines = stderr_lines(&o);
    assert!(lines.len() == 1 && lines[0].contains("asks for TLS: give --ca"), "{lines:?}");

    let o = xferctl(&a, &["info"], &[]);
    assert_eq!(o.status.code(), Some(8), "{}", String::from_utf8_lossy(&o.stderr));
    let lines = stderr_lines(&o);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with("error: ") && lines[0].ends_with("(UNAVAILABLE)"), "{lines:?}");

    // A certificate from another CA: refused the same way.
    let (ic, ik) = (pki.path("impostor.crt"), pki.path("impostor.key"));
    let o = xferctl(&a, &["--cert", ic.to_str().unwrap(), "--key", ik.to_str().unwrap(), "--ca", ca.to_str().unwrap(), "info"], &[]);
    assert_eq!(o.status.code(), Some(8), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(stderr_lines(&o).len(), 1, "{:?}", stderr_lines(&o));
}

#[test]
fn secure_mode_without_tls_files_is_a_config_error() {
    let tmp = tempfile::tempdir().unwrap();
    let o = Command::new(agent_bin())
        .args(["--node-name", "x", "--fabric", "tcp", "--print-config", "--state-dir"])
        .arg(tmp.path())
        .env("XFER_INSECURE", "false")
        .env("XFER_TLS__CERT", tmp.path().join("missing.crt"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(64));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("tls.cert") && err.contains("missing.crt"), "{err}");
}
