//! End-to-end tests: real `xfer-agent` binaries on loopback (tcp fabric), real `xferctl`, real
//! gRPC clients. Each bad input gets a clear status and changes no byte outside its range.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::time::Duration;

use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

fn s(o: &std::process::Output) -> String {
    format!("status {:?}\nstdout: {}\nstderr: {}", o.status.code(), String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_put_cp_write_and_pull_read_get_roundtrip() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    let dir = tempfile::tempdir().unwrap();
    let data = random_bytes(5 << 20 | 123, 42);
    let input = dir.path().join("in.bin");
    std::fs::write(&input, &data).unwrap();
    let n = data.len().to_string();

    for (agent, region) in [(&a, "src"), (&b, "dst"), (&a, "back")] {
        let o = agent.ctl(&["region", "create", region, "--size", "6MiB"]);
        assert!(o.status.success(), "{}", s(&o));
    }
    let o = a.ctl(&["put", input.to_str().unwrap(), "src"]);
    assert!(o.status.success(), "{}", s(&o));

    // WRITE initiated by A (holds SRC), verified end to end, chunked and pipelined.
    let dst = format!("{}:dst", b.addr());
    let o = a.ctl(&["--json", "cp", "src", &dst, "--len", &n, "--verify", "--chunk", "256KiB", "--depth", "4"]);
    assert!(o.status.success(), "{}", s(&o));
    let rec: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("json: {e}: {}", s(&o)));
    assert_eq!(rec["state"], "succeeded", "{rec}");
    assert_eq!(rec["bytes_done"].as_str(), Some(data.len().to_string().as_str()), "64-bit counts are strings: {rec}");
    assert_eq!(rec["verified"], true, "{rec}");

    // READ initiated by A (holds DST) with --pull.
    let src = format!("{}:dst", b.addr());
    let o = a.ctl(&["cp", &src, "back", "--len", &n, "--pull"]);
    assert!(o.status.success(), "{}", s(&o));
    let line = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(line.contains("GiB/s"), "final line with rate: {line}");

    let out = dir.path().join("out.bin");
    let o = a.ctl(&["get", "back", "--len", &n, out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", s(&o));
    assert!(std::fs::read(&out).unwrap() == data, "bytes after WRITE then READ differ");

    // The target recorded the inbound WRITE (Peer.Complete).
    let list = b.client().await.list_transfers(pb::ListTransfersRequest {}).await.unwrap().into_inner();
    assert!(list.transfers.iter().any(|t| t.inbound && t.bytes_done == data.len() as u64 && t.verified), "{list:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_transfer_inputs_get_clear_statuses_and_change_nothing() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    a.create("src", 1 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    b.create("ro", 1 << 20, pb::Access::Read).await;
    b.create("wo", 1 << 20, pb::Access::Write).await;
    a.put("src", 0, &random_bytes(1 << 20, 1)).await;
    let before = random_bytes(1 << 20, 2);
    for r in ["dst", "ro", "wo"] {
        b.put(r, 0, &before).await;
    }
    let req = |local: &str, remote: &str, op: pb::Op, loff: u64, roff: u64, len: u64| pb::SubmitTransferRequest {
        notify: None,
        segments: Vec::new(),
        op: op as i32,
        local: Some(pb::LocalRange { region: local.into(), offset: loff }),
        remote: Some(pb::RemoteRange { agent: b.addr(), region: remote.into(), offset: roff }),
        length: (len != 0).then_some(len),
        options: None,
    };
    let mut c = a.client().await;
    let cases: Vec<(&str, pb::SubmitTransferRequest, Code)> = vec![
        ("unknown local region", req("nope", "dst", pb::Op::Write, 0, 0, 10), Code::NotFound),
        ("unknown remote region", req("src", "nope", pb::Op::Write, 0, 0, 10), Code::NotFound),
        ("local range past the end", req("src", "dst", pb::Op::Write, 1 << 19, 0, (1 << 19) + 1), Code::InvalidArgument),
        ("remote range past the end", req("src", "dst", pb::Op::Write, 0, (1 << 20) - 10, 11), Code::InvalidArgument),
        ("offset + length overflows u64", req("src", "dst", pb::Op::Write, 0, u64::MAX - 5, 10), Code::InvalidArgument),
        ("local offset overflows", req("src", "dst", pb::Op::Write, u64::MAX, 0, 2), Code::InvalidArgument),
        ("zero length", req("src", "dst", pb::Op::Write, 1 << 20, 0, 0), Code::InvalidArgument),
        // A length the caller set to 0 is a mistake, never "the rest of the range".
        (
            "explicit zero length",
            pb::SubmitTransferRequest { length: Some(0), ..req("src", "dst", pb::Op::Write, 0, 0, 1) },
            Code::InvalidArgument,
        ),
        (
            "explicit zero length, READ",
            pb::SubmitTransferRequest { length: Some(0), ..req("src", "dst", pb::Op::Read, 0, 0, 1) },
            Code::InvalidArgument,
        ),
        ("write into a read-only region", req("src", "ro", pb::Op::Write, 0, 0, 4096), Code::PermissionDenied),
        ("read from a write-only region", req("src", "wo", pb::Op::Read, 0, 0, 4096), Code::PermissionDenied),
        ("op unspecified", req("src", "dst", pb::Op::Unspecified, 0, 0, 4096), Code::InvalidArgument),
    ];
    for (what, r, code) in cases {
        let e = c.submit_transfer(r).await.expect_err(what);
        assert_eq!(e.code(), code, "{what}: {e:?}");
        assert!(!e.message().is_empty(), "{what}: empty message");
    }
    // Unreachable peer.
    let mut r = req("src", "dst", pb::Op::Write, 0, 0, 10);
    let nobody = closed_port();
    r.remote.as_mut().unwrap().agent = nobody.addr.to_string();
    let e = c.submit_transfer(r).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");

    for r in ["dst", "ro", "wo"] {
        assert!(b.read(r, 0, 1 << 20).await == before, "region {r} changed after refused transfers");
    }
    // The agents keep serving.
    assert!(a.client().await.get_info(pb::GetInfoRequest {}).await.is_ok());

    // The CLI says it in one line with a script-friendly exit code.
    let o = a.ctl(&["cp", "nope", &format!("{}:dst", b.addr())]);
    assert_eq!(o.status.code(), Some(3), "{}", s(&o));
    assert_eq!(stderr_lines(&o).len(), 1, "{}", s(&o));
    let o = a.ctl(&["cp", "src", &format!("{}:ro", b.addr()), "--len", "4KiB"]);
    assert_eq!(o.status.code(), Some(5), "{}", s(&o));
    assert_eq!(stderr_lines(&o).len(), 1, "{}", s(&o));
    let o = a.ctl(&["cp", "src", &format!("{}:dst", nobody.addr)]);
    assert_eq!(o.status.code(), Some(8), "{}", s(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_region_inputs_get_clear_statuses() {
    let a = Agent::start("node-a");
    let mut c = a.client().await;
    // File regions live under the file roots (default <state_dir>/files).
    let short = a.state_dir.join("files/short.bin");
    std::fs::write(&short, vec![0u8; 100]).unwrap();
    let mk = |name: &str, len: u64, kind: pb::RegionKind, path: &str| pb::CreateRegionRequest {
        name: name.into(),
        length: len,
        kind: kind as i32,
        path: path.into(),
        ..Default::default()
    };
    c.create_region(mk("r1", 4096, pb::RegionKind::Anonymous, "")).await.unwrap();
    let cases = vec![
        ("duplicate name", mk("r1", 4096, pb::RegionKind::Anonymous, ""), Code::AlreadyExists),
        ("zero length", mk("r2", 0, pb::RegionKind::Anonymous, ""), Code::InvalidArgument),
        ("bad name", mk("a/b", 10, pb::RegionKind::Anonymous, ""), Code::InvalidArgument),
        ("file on a missing path", mk("f1", 4096, pb::RegionKind::File, "nonexistent/file"), Code::InvalidArgument),
        ("file outside the file roots", mk("f0", 4096, pb::RegionKind::File, "/nonexistent/xfer/file"), Code::PermissionDenied),
        ("file too short", mk("f2", 4096, pb::RegionKind::File, short.to_str().unwrap()), Code::InvalidArgument),
        ("file without a path", mk("f3", 4096, pb::RegionKind::File, ""), Code::InvalidArgument),
    ];
    for (what, r, code) in cases {
        let e = c.create_region(r).await.expect_err(what);
        assert_eq!(e.code(), code, "{what}: {e:?}");
    }
    let e = c.get_region(pb::GetRegionRequest { name: "nope".into() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = c.delete_region(pb::DeleteRegionRequest { name: "nope".into() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = c.read_region(pb::ReadRegionRequest { region: "r1".into(), offset: 4000, length: 200 }).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(std::fs::read(&short).unwrap(), vec![0u8; 100], "short file untouched");

    let o = a.ctl(&["region", "create", "r1", "--size", "4KiB"]);
    assert_eq!(o.status.code(), Some(13), "{}", s(&o));
    assert_eq!(stderr_lines(&o).len(), 1, "{}", s(&o));
    let o = a.ctl(&["region", "create", "f9", "--size", "4KiB", "--kind", "file", "--path", "nonexistent.bin"]);
    assert_eq!(o.status.code(), Some(4), "{}", s(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("does not exist"), "{}", s(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_grant_is_failed_precondition() {
    let b = Agent::start("node-b");
    b.create("dst", 8192, pb::Access::ReadWrite).await;
    let mut stream = b.data_stream("c1").await;
    let mut p = b.peer_client().await;
    let g = p
        .grant(pb::GrantRequest {
            notify: None,
            region: "dst".into(),
            offset: 0,
            length: 4096,
            op: pb::Access::Write as i32,
            ttl: Some(prost_types::Duration { seconds: 0, nanos: 200_000_000 }),
            node_name: "node-a".into(),
            connection_id: "c1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(g.token.len(), 16, "tcp grants carry a 128-bit token");
    // Past its 200 ms TTL the reaper drops it: wait for that, not for a fixed time.
    assert_eq!(gauge(&b, "xfer_grants_active"), 1.0, "the grant is active before its TTL");
    wait_gauge(&b, "xfer_grants_active", 0.0).await;
    let e = p
        .complete(pb::CompleteRequest {
            transfer_id: "t".into(),
            grant_id: g.grant_id.clone(),
            bytes: 4096,
            op: pb::Op::Write as i32,
            node_name: "node-a".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("expired"), "{e:?}");
    // And the data plane refuses the expired token on its own connection.
    let token: [u8; 16] = g.token.as_slice().try_into().unwrap();
    let status = raw_write(&mut stream, token, g.addr, b"x").0;
    assert_eq!(status, 10, "REM_ACCESS_ERR for an expired grant");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_forged_tokens_on_the_data_port_are_refused() {
    let b = Agent::start("node-b");
    b.create("dst", 65536, pb::Access::ReadWrite).await;
    let before = random_bytes(65536, 9);
    b.put("dst", 0, &before).await;
    let info = b.client().await.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();

    // Garbage instead of a hello, and garbage after a valid hello: NAK with REM_INV_REQ_ERR,
    // then the connection is closed.
    let plain = std::net::TcpStream::connect(&info.data_address).unwrap();
    plain.set_read_timeout(Some(READ_GUARD)).unwrap();
    for mut s in [plain, b.data_stream("c1").await] {
        s.write_all(&[0xde; 64]).unwrap();
        let h = read_header(&mut s);
        assert_eq!(h.kind, Kind::Nak);
        assert_eq!(h.status, 9, "REM_INV_REQ_ERR");
        assert_closed(&mut s, "connection closed after garbage");
    }

    // A forged token aimed at a granted address: NAK REM_ACCESS_ERR, nothing written.
    let mut s = b.data_stream("c2").await;
    let g = b
        .peer_client()
        .await
        .grant(pb::GrantRequest {
            region: "dst".into(),
            length: 65536,
            op: pb::Access::Write as i32,
            node_name: "node-a".into(),
            connection_id: "c2".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let (status, kind) = raw_write(&mut s, [0x41; 16], g.addr + 100, &[0xff; 4096]);
    assert_eq!((kind, status), (Kind::Nak, 10));
    assert!(b.read("dst", 0, 65536).await == before, "forged frame changed region bytes");
    assert!(b.client().await.get_info(pb::GetInfoRequest {}).await.is_ok(), "agent keeps serving");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_mid_transfer_fails_within_seconds_then_reconnects_after_restart() {
    let a = Agent::start("node-a");
    let tmp = tempfile::tempdir().unwrap();
    let b_state = tmp.path().join("b");
    let mut b = Agent::start_with("node-b", &b_state, Ports::new(), &[]);
    // The ports it got, for the restart below.
    let b_ports = b.ports.same();
    a.create("src", 512 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 512 << 20, pb::Access::ReadWrite).await;
    let mut req = write_req("src", &b, "dst", 0);
    make_slow(&mut req);
    let mut c = a.client().await;
    let t = c.submit_transfer(req).await.unwrap().into_inner();
    wait_progress(&a, &t.id).await;
    b.kill9();
    // The transfer ends FAILED on its own (the 60 s limit per message is a safety net against a
    // hang, not a bound on how fast: that is a benchmark's business, not make test's).
    let mut w = c.watch_transfer(pb::WatchTransferRequest { id: t.id.clone() }).await.unwrap().into_inner();
    let mut last = None;
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(60), w.message()).await.expect("no hang") {
        last = Some(m);
    }
    let last = last.unwrap();
    assert_eq!(last.state, pb::TransferState::Failed as i32, "{last:?}");
    assert!(!last.error.is_empty() && !last.error_code.is_empty(), "{last:?}");

    // The peer comes back on the same address: the next transfer reconnects by itself, once
    // the back-off its death started is over (the failed transfer's revoke and its resume, if
    // it made one, dialled the dead peer). Polled, bounded by a count of calls, as in
    // `dead_peer`: the window is a timer in the agent, and only it may refuse.
    let b = Agent::start_with("node-b", &b_state, b_ports, &[]);
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let data = random_bytes(1 << 20, 77);
    a.put("src", 0, &data).await;
    let mut refused = 0;
    let t = loop {
        match a.transfer(write_req("src", &b, "dst", 1 << 20)).await {
            Ok(t) => break t,
            Err(e) => {
                assert!(e.message().contains("backing off"), "only the back-off may refuse now: {e:?}");
                refused += 1;
                assert!(refused < 1200, "back-off never ended after {refused} calls");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert!(b.read("dst", 0, 1 << 20).await == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_reports_cancelled() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    a.create("src", 256 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 256 << 20, pb::Access::ReadWrite).await;
    let mut req = write_req("src", &b, "dst", 0);
    make_slow(&mut req);
    let t = a.client().await.submit_transfer(req).await.unwrap().into_inner();
    wait_progress(&a, &t.id).await;
    let o = a.ctl(&["transfer", "cancel", &t.id]);
    assert!(o.status.success(), "{}", s(&o));
    let o = a.ctl(&["transfer", "watch", &t.id]);
    assert_eq!(o.status.code(), Some(11), "watch of a cancelled transfer exits 11: {}", s(&o));
    let t = a.client().await.get_transfer(pb::GetTransferRequest { id: t.id }).await.unwrap().into_inner();
    assert_eq!(t.state, pb::TransferState::Cancelled as i32);
    assert!(t.bytes_done < t.length);
    // The pool still works after a cancel.
    let t = a.transfer(write_req("src", &b, "dst", 1 << 20)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_file_and_shm_regions_with_their_data() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let file = state.join("files/weights.bin");
    std::fs::create_dir_all(state.join("files")).unwrap();
    std::fs::write(&file, vec![0u8; 3 << 20]).unwrap();
    let shm_name = format!("xfer-test-{}", std::process::id());
    let mut a = Agent::start_with("node-a", &state, Ports::new(), &[]);
    let ports = a.ports.same();
    let o = a.ctl(&["region", "create", "weights", "--size", "2MiB", "--kind", "file", "--path", file.to_str().unwrap()]);
    assert!(o.status.success(), "{}", s(&o));
    let o = a.ctl(&["region", "create", "kv", "--size", "1MiB", "--kind", "shm", "--path", &shm_name]);
    assert!(o.status.success(), "{}", s(&o));
    a.create("scratch", 4096, pb::Access::ReadWrite).await;
    let data = random_bytes(2 << 20, 5);
    let kv = random_bytes(1 << 20, 6);
    a.put("weights", 0, &data).await;
    a.put("kv", 0, &kv).await;
    assert_eq!(a.terminate(), Some(0), "clean exit on SIGTERM: {}", a.logs());
    // A file region is a shared mapping: the bytes are in the file.
    assert!(std::fs::read(&file).unwrap()[..2 << 20] == data[..]);

    let a = Agent::start_with("node-a", &state, ports, &[]);
    let list = a.client().await.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner();
    let names: Vec<&str> = list.regions.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, vec!["kv", "weights"], "file and shm regions come back; anonymous ones do not");
    assert!(a.read("weights", 0, 2 << 20).await == data);
    assert!(a.read("kv", 0, 1 << 20).await == kv);
    let o = a.ctl(&["region", "delete", "kv"]);
    assert!(o.status.success(), "{}", s(&o));
    assert!(!std::path::Path::new("/dev/shm").join(&shm_name).exists(), "agent-created shm object removed on delete");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn region_lease_expires() {
    let a = Agent::start("node-a");
    let o = a.ctl(&["region", "create", "tmp", "--size", "4KiB", "--ttl", "300ms"]);
    assert!(o.status.success(), "{}", s(&o));
    // Polled (a lookup does not renew the lease) until the reaper removes it after its TTL.
    let mut c = a.client().await;
    let mut polls = 0;
    let e = loop {
        match c.get_region(pb::GetRegionRequest { name: "tmp".into() }).await {
            Ok(r) => assert!(r.into_inner().expires_at.is_some(), "a region with a TTL shows its expiry"),
            Err(e) => break e,
        }
        polls += 1;
        assert!(polls < 3000, "the lease never expired: {}", a.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_reflection_are_served() {
    let a = Agent::start("node-a");
    let ch = tonic::transport::Channel::from_shared(format!("http://{}", a.addr())).unwrap().connect().await.unwrap();
    let mut h = tonic_health::pb::health_client::HealthClient::new(ch.clone());
    let r = h.check(tonic_health::pb::HealthCheckRequest { service: "xfer.v1.Agent".into() }).await.unwrap().into_inner();
    assert_eq!(r.status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);
    // Reflection in both versions lists the services (v1alpha is what Python's grpcio-reflection
    // and many other tools speak).
    {
        use tonic_reflection::pb::v1 as r1;
        let req = r1::ServerReflectionRequest {
            message_request: Some(r1::server_reflection_request::MessageRequest::ListServices(String::new())),
            ..Default::default()
        };
        let mut c = r1::server_reflection_client::ServerReflectionClient::new(ch.clone());
        let mut answers = c.server_reflection_info(tokio_stream::iter([req])).await.unwrap().into_inner();
        let names: Vec<String> = match answers.message().await.unwrap().and_then(|m| m.message_response) {
            Some(r1::server_reflection_response::MessageResponse::ListServicesResponse(l)) => {
                l.service.into_iter().map(|s| s.name).collect()
            }
            other => panic!("v1: {other:?}"),
        };
        assert!(names.iter().any(|n| n == "xfer.v1.Agent") && names.iter().any(|n| n == "xfer.v1.Peer"), "v1: {names:?}");
    }
    {
        use tonic_reflection::pb::v1alpha as ra;
        let req = ra::ServerReflectionRequest {
            message_request: Some(ra::server_reflection_request::MessageRequest::FileContainingSymbol("xfer.v1.Agent".into())),
            ..Default::default()
        };
        let mut c = ra::server_reflection_client::ServerReflectionClient::new(ch.clone());
        let mut answers = c.server_reflection_info(tokio_stream::iter([req])).await.unwrap().into_inner();
        match answers.message().await.unwrap().and_then(|m| m.message_response) {
            Some(ra::server_reflection_response::MessageResponse::FileDescriptorResponse(f)) => {
                assert!(!f.file_descriptor_proto.is_empty(), "v1alpha: no descriptor for xfer.v1.Agent");
            }
            other => panic!("v1alpha: {other:?}"),
        }
    }
    let info = a.ctl(&["--json", "info"]);
    assert!(info.status.success(), "{}", s(&info));
    let v: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(v["node_name"], "node-a", "{v}");
}

#[test]
fn invalid_configuration_exits_64_naming_the_key_and_print_config_shows_layers() {
    let o = std::process::Command::new(agent_bin())
        .args(["--fabric", "tcp", "--print-config"])
        .env("XFER_TRANSFER__DEPTH", "0")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(64), "{}", s(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("transfer.depth"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("agent.toml");
    std::fs::write(&f, "node_name = \"from-file\"\n[transfer]\nchunk_size = \"4MiB\"\n").unwrap();
    let o = std::process::Command::new(agent_bin())
        .args(["--config", f.to_str().unwrap(), "--print-config", "--listen", "127.0.0.1:1234"])
        .env("XFER_TRANSFER__QPS", "3")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", s(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for want in ["node_name = \"from-file\"", "chunk_size = \"4MiB\"", "qps = 3", "listen = \"127.0.0.1:1234\""] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_listener_on_port_0_is_reported_in_the_ready_file_and_the_log() {
    let tmp = tempfile::tempdir().unwrap();
    // The harness passes --listen, --metrics-listen and --ready-file (port 0 for both listeners).
    let a = Agent::start_with("node-a", &tmp.path().join("state"), Ports::new(), &["--health-listen", "127.0.0.1:0"]);
    let p = &a.ports;
    assert!(p.grpc != 0 && p.metrics != 0 && p.data != 0 && p.health != 0, "all reported");
    // Each reported port is the one serving: gRPC (this call), the data listener (GetInfo says
    // the same), metrics and health.
    let info = a.client().await.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.data_address, format!("127.0.0.1:{}", p.data));
    a.client().await.create_region(pb::CreateRegionRequest { name: "r1".into(), length: 1 << 20, ..Default::default() }).await.unwrap();
    let text = scrape(&a);
    assert!(text.contains("xfer_build_info"), "metrics served on the reported port");
    // Registration time is recorded on the tcp fabric too (the dashboard's panel is not empty).
    assert_eq!(metric(&text, "xfer_registration_duration_seconds_count"), 1.0, "{text}");
    // process_* as every Prometheus client exports them (CPU, memory, descriptors).
    assert!(text.contains("# TYPE process_cpu_seconds_total counter"), "{text}");
    assert!(metric(&text, "process_resident_memory_bytes") > 0.0, "{text}");
    assert!(metric(&text, "process_open_fds") >= 3.0, "{text}");
    assert!(metric(&text, "process_threads") >= 1.0, "{text}");
    // The agent raises its soft open-file limit to the hard one it inherited from this test.
    let (_, hard) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
    assert_eq!(metric(&text, "process_max_fds"), hard as f64, "{text}");
    let ch = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{}", p.health)).unwrap().connect().await.unwrap();
    let r = tonic_health::pb::health_client::HealthClient::new(ch)
        .check(tonic_health::pb::HealthCheckRequest { service: String::new() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);
    // The "xfer-agent serving" line carries the same addresses.
    let logs = a.logs();
    let line = logs.lines().find(|l| l.contains("xfer-agent serving")).unwrap_or_else(|| panic!("{logs}"));
    for (key, port) in [("grpc", p.grpc), ("data", p.data), ("metrics", p.metrics), ("health", p.health)] {
        assert!(line.contains(&format!("{key}=127.0.0.1:{port}")), "{key} in {line}");
    }
    // The ready file is JSON with exactly these keys (unix: null without `unix_listen`).
    let ready: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(a.state_dir.with_extension("node-a.ready")).unwrap()).unwrap();
    assert_eq!(ready.as_object().unwrap().len(), 5, "{ready}");
    assert!(ready["unix"].is_null(), "{ready}");
    assert_eq!(ready["grpc"], format!("127.0.0.1:{}", p.grpc));
}

/// `transfer.fallback = tcp` on a tcp agent means nothing: accepted, logged, and GetInfo says the
/// fallback in effect is `never` (every path is tcp already).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_agent_accepts_and_ignores_a_tcp_fallback() {
    let a = Agent::start_fabric("fallback-tcp", "tcp", &[("XFER_TRANSFER__FALLBACK", "tcp")]);
    let info = a.client().await.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.fallback, "never", "{info:?}");
    assert!(a.logs().contains("transfer.fallback = tcp means nothing on the tcp fabric"), "{}", a.logs());
    let o = a.ctl(&["info"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("fallback:"), "{}", String::from_utf8_lossy(&o.stdout));
}
