//! Red team: the local unix socket (`unix_listen`, `unix_mode`, `unix_group`). Every attack
//! asserts the refusal *and* that nothing else changed: what was at the path (its inode, type,
//! content), its neighbours in the directory, other agents' sockets, files and shm objects.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;
use xfer_proto::v1::peer_client::PeerClient;

/// A channel over the unix socket `path`, whose requests name `authority` (any string a caller
/// likes: it must mean nothing).
async fn unix_channel_as(path: &Path, authority: &'static str) -> tonic::transport::Channel {
    let path = path.to_path_buf();
    tonic::transport::Endpoint::from_static(authority)
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
        }))
        .await
        .unwrap()
}

/// What a directory holds, one level: name -> (type, mode, inode, size, link target, content of
/// small regular files). Equal snapshots mean nothing there changed.
type Snapshot = BTreeMap<String, (String, u32, u64, u64, Option<PathBuf>, Option<Vec<u8>>)>;

fn snapshot(dir: &Path) -> Snapshot {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            let t = m.file_type();
            let kind = if t.is_symlink() {
                "symlink"
            } else if t.is_socket() {
                "socket"
            } else if t.is_dir() {
                "dir"
            } else if t.is_fifo() {
                "fifo"
            } else {
                "file"
            };
            let link = t.is_symlink().then(|| std::fs::read_link(e.path()).unwrap());
            let content = (t.is_file() && m.len() < 4096).then(|| std::fs::read(e.path()).unwrap());
            (e.file_name().to_string_lossy().into_owned(), (kind.to_string(), m.mode(), m.ino(), m.len(), link, content))
        })
        .collect()
}

/// The agent command, with its unix socket at `sock` and `env`, state in `state`.
fn agent_cmd(state: &Path, sock: &Path, env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(agent_bin());
    c.args(["--node-name", "node-x", "--fabric", "tcp", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .arg("--state-dir")
        .arg(state)
        .env("XFER_UNIX_LISTEN", sock)
        .envs(env.iter().copied());
    c
}

/// Runs an agent that must refuse to start; returns its stderr. Reads its log as it comes: the
/// line saying it serves means it did start (it is killed and the test fails), the end of the
/// log means it exited. No timing involved.
fn refused(state: &Path, sock: &Path, env: &[(&str, &str)]) -> String {
    refused_cmd(agent_cmd(state, sock, env))
}

fn refused_cmd(mut cmd: Command) -> String {
    use std::io::BufRead;
    let mut child = cmd.env("RUST_LOG", "info").stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let mut log = String::new();
    for line in std::io::BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        log.push_str(&line);
        log.push('\n');
        if line.contains("xfer-agent serving") {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the agent started: {log}");
        }
    }
    assert!(!child.wait().unwrap().success(), "{log}");
    log
}

// ------------------------------------------------------------------ what is at the path

/// A symlink at the path (to a file, to a directory, to another agent's live socket), a directory,
/// a FIFO, or a path whose directory does not exist: the agent refuses, follows no link, creates
/// nothing, and the other agent keeps serving on its socket.
#[tokio::test]
async fn nothing_but_a_stale_socket_at_the_path_is_touched() {
    let dir = tempfile::tempdir().unwrap();
    let state_dir = tempfile::tempdir().unwrap();
    let state = state_dir.path().join("state");
    let other_dir = tempfile::tempdir().unwrap();
    let other_sock = other_dir.path().join("other.sock");
    let other = Agent::start_env("node-o", &[("XFER_UNIX_LISTEN", other_sock.to_str().unwrap())]);
    let other_before = snapshot(other_dir.path());
    let target_file = dir.path().join("target-file");
    std::fs::write(&target_file, b"precious").unwrap();
    std::fs::set_permissions(&target_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let target_dir = dir.path().join("target-dir");
    std::fs::create_dir(&target_dir).unwrap();
    std::fs::set_permissions(&target_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(target_dir.join("inside"), b"x").unwrap();

    for what in ["symlink to a file", "symlink to a directory", "symlink to a live socket", "dangling symlink", "directory", "fifo"] {
        let sock = dir.path().join("agent.sock");
        match what {
            "symlink to a file" => std::os::unix::fs::symlink(&target_file, &sock).unwrap(),
            "symlink to a directory" => std::os::unix::fs::symlink(&target_dir, &sock).unwrap(),
            "symlink to a live socket" => std::os::unix::fs::symlink(&other_sock, &sock).unwrap(),
            "dangling symlink" => std::os::unix::fs::symlink(dir.path().join("nowhere"), &sock).unwrap(),
            "directory" => std::fs::create_dir(&sock).unwrap(),
            _ => nix::unistd::mkfifo(&sock, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap(),
        }
        let before = snapshot(dir.path());
        let target_inside = snapshot(&target_dir);
        let err = refused(&state, &sock, &[]);
        assert!(err.contains("not a socket"), "{what}: {err}");
        assert_eq!(snapshot(dir.path()), before, "{what}: the directory changed");
        assert_eq!(snapshot(&target_dir), target_inside, "{what}: the symlink's target directory changed");
        assert_eq!(std::fs::read(&target_file).unwrap(), b"precious", "{what}");
        // Remove what was planted for the next case.
        if std::fs::symlink_metadata(&sock).unwrap().is_dir() {
            std::fs::remove_dir(&sock).unwrap();
        } else {
            std::fs::remove_file(&sock).unwrap();
        }
    }
    // A directory that does not exist is not created.
    let missing = dir.path().join("no-such-dir").join("agent.sock");
    let before = snapshot(dir.path());
    refused(&state, &missing, &[]);
    assert_eq!(snapshot(dir.path()), before);
    // The other agent's socket never moved and it still serves there.
    assert_eq!(snapshot(other_dir.path()), other_before);
    let info = AgentClient::new(unix_channel(&other_sock).await).get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.node_name, "node-o");
    drop(other);
}

/// A live socket that is not a stream socket (a datagram socket like `/dev/log`): connecting to
/// it as a stream fails (EPROTOTYPE), but nobody may call it stale. The agent must refuse and
/// leave it bound and working.
#[tokio::test]
async fn a_live_datagram_socket_at_the_path_is_not_taken_for_stale() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let live = std::os::unix::net::UnixDatagram::bind(&sock).unwrap();
    let state = tempfile::tempdir().unwrap();
    let before = snapshot(dir.path());
    let err = refused(state.path(), &sock, &[]);
    assert!(err.contains("agent.sock"), "{err}");
    assert_eq!(snapshot(dir.path()), before, "the live datagram socket was replaced");
    // It still receives what is sent to its path.
    std::os::unix::net::UnixDatagram::unbound().unwrap().send_to(b"still here", &sock).unwrap();
    let mut buf = [0u8; 16];
    let n = live.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"still here");
}

/// A live listening socket the agent may not connect to (EACCES: another uid's socket with a
/// mode that keeps the agent out) is live all the same: the agent must not unlink it. As root
/// the agent runs as `nobody` for this (root connects anywhere); otherwise the socket is made
/// mode 0000, which keeps its own (unprivileged) owner out too.
#[tokio::test]
async fn a_live_socket_the_agent_may_not_connect_to_is_not_taken_for_stale() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let sock = dir.path().join("agent.sock");
    let live = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let as_root = nix::unistd::geteuid().is_root();
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(if as_root { 0o600 } else { 0 })).unwrap();
    let state = tempfile::tempdir().unwrap();
    std::fs::set_permissions(state.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let before = snapshot(dir.path());
    let mut cmd = agent_cmd(&state.path().join("state"), &sock, &[]);
    if as_root {
        cmd.uid(65534).gid(65534);
    }
    let err = refused_cmd(cmd);
    assert!(err.contains("agent.sock"), "refused for another reason: {err}");
    assert_eq!(snapshot(dir.path()), before, "the live socket was replaced: {err}");
    // Its listener still gets the connections made to its path.
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600)).unwrap();
    if !as_root {
        return; // mode 0600 lets the owner in; nothing more to show without root
    }
    let mut c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    let (mut s, _) = live.accept().unwrap();
    c.write_all(b"ok").unwrap();
    let mut b = [0u8; 2];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ok");
}

/// On shutdown the agent removes its socket, and only its socket: what someone put at the path
/// after it started (another agent's socket, a file) stays.
#[tokio::test]
async fn shutdown_removes_only_the_agents_own_socket() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let env = [("XFER_UNIX_LISTEN", sock.to_str().unwrap())];
    let mut a = Agent::start_env("node-a", &env);
    // A's socket is moved away (an operator, a cleanup script); B starts on the free path.
    std::fs::rename(&sock, dir.path().join("a.sock")).unwrap();
    let mut b = Agent::start_env("node-b", &env);
    let before = snapshot(dir.path());
    assert_eq!(a.terminate(), Some(0), "{}", a.logs());
    assert_eq!(snapshot(dir.path()), before, "stopping A removed B's socket");
    let info = AgentClient::new(unix_channel(&sock).await).get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.node_name, "node-b");
    // B's socket is replaced by a file: stopping B leaves the file.
    std::fs::remove_file(&sock).unwrap();
    std::fs::write(&sock, b"precious").unwrap();
    let before = snapshot(dir.path());
    assert_eq!(b.terminate(), Some(0), "{}", b.logs());
    assert_eq!(snapshot(dir.path()), before, "stopping B removed a file it did not create");
    // And an agent that still owns its socket removes it.
    std::fs::remove_file(&sock).unwrap();
    let mut c = Agent::start_env("node-c", &env);
    assert_eq!(c.terminate(), Some(0));
    assert!(std::fs::symlink_metadata(&sock).is_err(), "the agent's own socket is removed");
}

// ------------------------------------------------------------------ mode and group

/// Modes beyond 0777 (setuid, setgid, sticky), groups that do not exist and the gid that means
/// "leave the group alone" (-1) are refused before anything is created; a mode is applied
/// exactly, whatever the umask.
#[tokio::test]
async fn socket_mode_and_group_are_exact_or_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let state_dir = tempfile::tempdir().unwrap();
    let state = state_dir.path().join("state");
    let before = snapshot(dir.path());
    for (k, v, says) in [
        ("XFER_UNIX_MODE", "4755", "unix_mode"),
        ("XFER_UNIX_MODE", "01777", "unix_mode"),
        ("XFER_UNIX_MODE", "2660", "unix_mode"),
        ("XFER_UNIX_MODE", "rw-rw----", "mode"),
        ("XFER_UNIX_GROUP", "no-such-group-xfer", "unix_group"),
        ("XFER_UNIX_GROUP", "4294967295", "unix_group"),
        ("XFER_UNIX_GROUP", "-1", "unix_group"),
    ] {
        let err = refused(&state, &sock, &[(k, v)]);
        assert!(err.contains(says), "{k}={v}: {err}");
        assert_eq!(snapshot(dir.path()), before, "{k}={v}: something was created");
    }
    // A mode is applied exactly, whatever the umask (022 would clear the others' write bit).
    let _a = Agent::start_env(
        "node-m",
        &[("XFER_UNIX_LISTEN", sock.to_str().unwrap()), ("XFER_UNIX_MODE", "0606"), ("XFER_UNIX_GROUP", "54321")],
    );
    let m = std::fs::symlink_metadata(&sock).unwrap();
    assert_eq!(m.mode() & 0o7777, 0o606);
    if nix::unistd::geteuid().is_root() {
        assert_eq!(m.gid(), 54321, "a numeric gid need not have a name");
    }
}

// ------------------------------------------------------------------ who the caller is

/// `msg` with metadata claiming another identity: a forwarded client certificate, a SPIFFE id,
/// a role.
fn spoof<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    let md = r.metadata_mut();
    md.insert("x-forwarded-client-cert", "URI=spiffe://td/xfer/admin/ops".parse().unwrap());
    md.insert("x-spiffe-id", "spiffe://td/xfer/node/node-b".parse().unwrap());
    md.insert("x-xfer-caller", "admin".parse().unwrap());
    md.insert("x-real-ip", "127.0.0.1".parse().unwrap());
    r
}

/// A caller on the socket is a client named by its uid, whatever it sends: metadata that looks
/// like a forwarded certificate or an identity, or another authority, changes nothing. It cannot
/// run admin methods or reach `xfer.v1.Peer`.
#[tokio::test]
async fn a_unix_caller_is_its_uid_whatever_it_sends() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let a = Agent::start_env("node-a", &[("XFER_UNIX_LISTEN", sock.to_str().unwrap())]);
    let uid = nix::unistd::geteuid().as_raw();
    let ch = unix_channel_as(&sock, "http://node-b.spiffe").await;
    let mut agent = AgentClient::new(ch.clone());
    for s in [
        agent.bench(spoof(pb::BenchRequest { peer: a.addr(), size: 4096, ..Default::default() })).await.unwrap_err(),
        agent.tcp_baseline(spoof(pb::TcpBaselineRequest::default())).await.unwrap_err(),
    ] {
        assert_eq!(s.code(), Code::PermissionDenied, "{s:?}");
        assert!(s.message().contains(&format!("uid-{uid}")), "{s:?}");
    }
    let mut peer = PeerClient::new(ch.clone());
    let denied = |s: tonic::Status| {
        assert_eq!(s.code(), Code::PermissionDenied, "{s:?}");
        assert!(s.message().contains("node role") && s.message().contains(&format!("uid-{uid}")), "{s:?}");
    };
    denied(peer.connect(spoof(connect_req("c1"))).await.unwrap_err());
    denied(peer.grant(spoof(grant_req("r", "node-b", "c1", pb::Access::Write))).await.unwrap_err());
    denied(peer.open_sink(spoof(pb::OpenSinkRequest::default())).await.unwrap_err());
    denied(peer.revoke(spoof(pb::RevokeRequest { grant_id: "x".into() })).await.unwrap_err());
    // Nothing on the agent changed: no connection, grant or sink came of it.
    assert!(a.client().await.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner().regions.is_empty());
    // What a client may do, it may (the metadata does not break anything either).
    agent.get_info(spoof(pb::GetInfoRequest {})).await.unwrap();
}

/// The socket's callers get the client role's rules for regions: no file outside
/// `regions.file_roots` (absolute, `..`, through a symlink), no shm object named like a path or
/// longer than a name may be; the refused files and `/dev/shm` are unchanged.
#[tokio::test]
async fn unix_callers_create_regions_only_under_the_agents_rules() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let a = Agent::start_env("node-a", &[("XFER_UNIX_LISTEN", sock.to_str().unwrap())]);
    let outside = dir.path().join("outside.bin");
    std::fs::write(&outside, vec![7u8; 4096]).unwrap();
    let root = root_of(&a);
    std::os::unix::fs::symlink(&outside, root.join("link.bin")).unwrap();
    let before = (snapshot(dir.path()), snapshot(&root));
    let mut c = AgentClient::new(unix_channel(&sock).await);
    let up = format!("{}/outside.bin", pathdiff(&root, dir.path()));
    for path in [outside.to_str().unwrap(), up.as_str(), "link.bin", "/etc/passwd"] {
        let s = c.create_region(file_region_req("f", 16, path, pb::Access::ReadWrite)).await.unwrap_err();
        assert_eq!(s.code(), Code::PermissionDenied, "{path}: {s:?}");
    }
    let passwd = std::fs::read("/etc/passwd").unwrap();
    let long = "x".repeat(300);
    for object in ["a/b", "../etc/passwd", "..", ".hidden", long.as_str(), "nul\0byte"] {
        let mut req = anon("s", 4096);
        req.kind = pb::RegionKind::Shm as i32;
        req.path = object.to_string();
        let s = c.create_region(req).await.unwrap_err();
        assert_eq!(s.code(), Code::InvalidArgument, "{object:?}: {s:?}");
    }
    // A region name that makes the default object name (`xfer-<name>`) too long.
    let mut req = anon(&"n".repeat(252), 4096);
    req.kind = pb::RegionKind::Shm as i32;
    assert_ne!(c.create_region(req).await.map(|_| ()).unwrap_err().code(), Code::Ok);
    for made in ["/dev/shm/a", "/dev/shm/.hidden", "/dev/shm/xfer-s"] {
        assert!(std::fs::symlink_metadata(made).is_err(), "{made} was created");
    }
    assert!(std::fs::read_dir("/dev/shm").unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().contains("xxxxxxxxxx")));
    assert_eq!(std::fs::read("/etc/passwd").unwrap(), passwd);
    assert_eq!((snapshot(dir.path()), snapshot(&root)), before);
    assert!(c.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner().regions.is_empty());
}

/// `..` components leading from `from` to `to` (both absolute, `to` an ancestor's sibling).
fn pathdiff(from: &Path, to: &Path) -> String {
    let common = from.ancestors().find(|a| to.starts_with(a)).unwrap();
    let ups = from.strip_prefix(common).unwrap().components().count();
    let mut s = vec![".."; ups].join("/");
    let rest = to.strip_prefix(common).unwrap();
    if !rest.as_os_str().is_empty() {
        s.push('/');
        s.push_str(rest.to_str().unwrap());
    }
    s
}

// ------------------------------------------------------------------ exhaustion

/// The unix socket's connections are counted and capped like the gRPC port's: a local
/// application that opens sockets without end cannot take the descriptors region files and the
/// catalog need (nor make the accept loop spin on EMFILE).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_socket_flood_leaves_descriptors_for_regions_and_the_catalog() {
    const NOFILE: u64 = 256;
    raise_own_nofile();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let a = Agent::start_env_nofile("node-a", &[("XFER_UNIX_LISTEN", sock.to_str().unwrap())], NOFILE);
    let pid = a.pid().unwrap();
    std::fs::write(root_of(&a).join("f.bin"), vec![1u8; 4096]).unwrap();
    let mut c = a.client().await;
    let (held, refused) = flood_h2(pid, NOFILE, || std::os::unix::net::UnixStream::connect(&sock).unwrap());
    assert!(refused, "{} idle unix sockets were all accepted", held.len());
    c.create_region(file_region_req("f", 4096, "f.bin", pb::Access::ReadWrite)).await.unwrap();
    assert!(labelled(&scrape(&a), "xfer_listener_connections_refused_total", &[("listener", "unix")]) >= 1.0);
    // Once the flood goes away (the agent has closed its side: the gauge says so), applications
    // get in again. Polled like `wait_gauge`: the wait is for the value, the bound a hang guard.
    drop(held);
    let open = || labelled(&scrape(&a), "xfer_listener_connections", &[("listener", "unix")]);
    for _ in 0..3000 {
        if open() == 0.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(open(), 0.0, "the flood's sockets are still counted");
    let mut u = AgentClient::new(unix_channel(&sock).await);
    u.get_info(pb::GetInfoRequest {}).await.unwrap();
}

// ------------------------------------------------------------------ two agents binding at once

/// Two agents binding in one directory are serialized by a lock on the directory, held only
/// while binding: without it, both could judge one stale socket stale, and the second would
/// delete the socket the first had just put in place. While another process holds the lock the
/// agent waits (it says so), and touches nothing: the stale socket keeps its inode and the
/// directory is unchanged. Once the lock is free it replaces the stale socket and serves. A
/// lock held past the bound (`unix_lock_wait`) is a refusal, with nothing touched either.
///
/// No timing window: the refused agent's bound is short because the lock is held throughout;
/// the waiting agent's is the longest allowed, so it is still waiting whenever this test gets
/// round to reading its log line and freeing the lock, however loaded the machine.
#[tokio::test]
async fn binding_waits_for_the_directory_lock_and_touches_nothing_meanwhile() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap()); // stale: nobody listens
                                                                  // An O_PATH descriptor pins the stale socket's inode: while it is open, the number cannot be
                                                                  // given to the socket the agent binds once it has removed the stale one (a file system
                                                                  // reuses a freed inode's number at once), so "same inode" means "the same file" here.
    let _pin = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_PATH | nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
            .open(&sock)
            .unwrap()
    };
    let stale_ino = std::fs::symlink_metadata(&sock).unwrap().ino();
    let before = snapshot(dir.path());
    let state = tempfile::tempdir().unwrap();

    // Held past the bound: refused, nothing touched.
    let held = nix::fcntl::Flock::lock(std::fs::File::open(dir.path()).unwrap(), nix::fcntl::FlockArg::LockExclusive).unwrap();
    let log = refused(&state.path().join("a"), &sock, &[("XFER_UNIX_LOCK_WAIT", "100ms")]);
    assert!(log.contains("stayed locked for 100ms (unix_lock_wait)"), "{log}");
    assert_eq!(snapshot(dir.path()), before);

    // Freed while the agent waits: it binds then.
    let mut child = agent_cmd(&state.path().join("b"), &sock, &[("XFER_UNIX_LOCK_WAIT", "1h")])
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut log = String::new();
    let mut held = Some(held);
    for line in lines.by_ref() {
        let line = line.unwrap();
        log.push_str(&line);
        log.push('\n');
        if line.contains("waiting for the lock") {
            // The agent is parked on the lock: nothing at the path was touched.
            assert_eq!(std::fs::symlink_metadata(&sock).unwrap().ino(), stale_ino, "{log}");
            assert_eq!(snapshot(dir.path()), before, "{log}");
            drop(held.take());
        }
        if line.contains("xfer-agent serving") {
            break;
        }
    }
    assert!(held.is_none(), "the agent never waited for the lock: {log}");
    // Keep draining its log so it never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    let now = std::fs::symlink_metadata(&sock).unwrap();
    assert!(now.file_type().is_socket() && now.ino() != stale_ino, "{log}");
    std::os::unix::net::UnixStream::connect(&sock).expect("the socket at the path is live");
    let info = AgentClient::new(unix_channel(&sock).await).get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.node_name, "node-x");
    let _ = child.kill();
    let _ = child.wait();
}
