//! The local unix socket (`unix_listen`): applications on the node reach `xfer.v1.Agent` there
//! with no TLS, known by their uid with the client role. The socket gets its mode before anyone
//! can reach it, admin methods and `xfer.v1.Peer` are refused there, a live socket of another
//! agent is never taken over, a stale one is replaced, and anything else at the path is left
//! alone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;
use xfer_proto::v1::peer_client::PeerClient;

/// Runs an agent with its unix socket at `sock` that is expected to refuse to start.
fn run_agent(dir: &Path, sock: &Path) -> std::process::Output {
    Command::new(agent_bin())
        .args(["--node-name", "node-a", "--fabric", "tcp", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .arg("--state-dir")
        .arg(dir.join("a"))
        .env("XFER_UNIX_LISTEN", sock)
        .output()
        .unwrap()
}

fn sock_in(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("agent.sock")
}

#[tokio::test]
async fn applications_reach_the_agent_over_its_unix_socket_as_clients() {
    let dir = tempfile::tempdir().unwrap();
    let sock = sock_in(&dir);
    let a = Agent::start_env("node-a", &[("XFER_UNIX_LISTEN", sock.to_str().unwrap())]);
    let meta = std::fs::symlink_metadata(&sock).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o660, "the socket's default mode: owner and group");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("agent.sock")], "the private bind directory is gone");

    let ch = unix_channel(&sock).await;
    let mut agent = AgentClient::new(ch.clone());
    let info = agent.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.node_name, "node-a");
    agent.create_region(anon("r", 1 << 20)).await.unwrap();
    // What the socket created is the agent's, seen over TCP too.
    a.read("r", 0, 16).await;
    // Admin methods and the Peer service are not for local applications.
    let s = agent.bench(pb::BenchRequest { peer: a.addr(), size: 4096, ..Default::default() }).await.unwrap_err();
    assert_eq!(s.code(), Code::PermissionDenied, "{s:?}");
    assert!(s.message().contains("uid-"), "the caller is named by its uid: {s:?}");
    let s = PeerClient::new(ch).revoke(pb::RevokeRequest { grant_id: "x".into() }).await.unwrap_err();
    // Refused by the role check before it could reach a service (which is not there either).
    assert_eq!(s.code(), Code::PermissionDenied, "xfer.v1.Peer is not for unix callers: {s:?}");
    assert!(s.message().contains("node role"), "{s:?}");
    // xferctl connects there too (through xfer-client).
    let o =
        Command::new(xferctl_bin()).args(["--agent", &format!("unix://{}", sock.display()), "--json", "region", "list"]).output().unwrap();
    assert!(o.status.success(), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stdout).contains("\"name\": \"r\""), "{o:?}");
    drop(a);
}

#[tokio::test]
async fn the_socket_mode_is_configurable_and_a_live_socket_is_never_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let sock = sock_in(&dir);
    let env = [("XFER_UNIX_LISTEN", sock.to_str().unwrap()), ("XFER_UNIX_MODE", "0600")];
    let mut a = Agent::start_env("node-a", &env);
    assert_eq!(std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777, 0o600);
    // A second agent on the same path refuses to start and leaves the first one's socket.
    let out = Command::new(agent_bin())
        .args(["--node-name", "node-b", "--fabric", "tcp", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .arg("--state-dir")
        .arg(dir.path().join("b"))
        .envs(env)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another process serves on it"), "{err}");
    AgentClient::new(unix_channel(&sock).await).get_info(pb::GetInfoRequest {}).await.unwrap();
    // A killed agent leaves a stale socket: the next one replaces it.
    a.kill9();
    assert!(std::fs::symlink_metadata(&sock).unwrap().file_type().is_socket());
    let _c = Agent::start_env("node-c", &env);
    let info = AgentClient::new(unix_channel(&sock).await).get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.node_name, "node-c");
}

#[tokio::test]
async fn anything_but_a_socket_at_the_path_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let sock = sock_in(&dir);
    std::fs::write(&sock, b"precious").unwrap();
    let out = run_agent(dir.path(), &sock);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a socket"), "{out:?}");
    assert_eq!(std::fs::read(&sock).unwrap(), b"precious");
    // A symlink there is not followed either.
    std::fs::remove_file(&sock).unwrap();
    let target = dir.path().join("elsewhere");
    std::fs::write(&target, b"other").unwrap();
    std::os::unix::fs::symlink(&target, &sock).unwrap();
    let out = run_agent(dir.path(), &sock);
    assert!(!out.status.success());
    assert_eq!(std::fs::read(&target).unwrap(), b"other");
    assert!(std::fs::symlink_metadata(&sock).unwrap().file_type().is_symlink());
}
