//! Every input is bounded before it costs anything: what a client (or a peer, or the operator's
//! configuration) sends is checked where it is decoded, and refused there, naming what is wrong,
//! before the agent allocates, stores or shows it to anyone.
//!
//! * Region labels follow Kubernetes' rules (`labels.rs`), at CreateRegion, in ListRegions
//!   selectors and when the catalog is restored.
//! * Every string and bytes field of every request has a bound (`service/bounds.rs`).
//! * Allocations sized by a request: the KV benchmark's slot draw, and benchmarks' memory from a
//!   budget of their own (`limits.max_bench_bytes`), never from the clients'.
//! * Every configured duration and size has a range checked at load (exit 64 naming the key).
//!
//! Each test asserts the refusal and that nothing else changed: the regions, their labels, the
//! counts and bytes the agent reports, the agent's pid, and another tenant's transfer.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;

use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

/// What other tenants can observe: every region with its labels, and the totals GetInfo reports.
async fn observable(a: &Agent) -> (Vec<(String, Vec<(String, String)>)>, u32, u64) {
    let mut c = a.client().await;
    let list = c.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner();
    let regions = list
        .regions
        .into_iter()
        .map(|r| {
            let mut l: Vec<(String, String)> = r.labels.into_iter().collect();
            l.sort();
            (r.name, l)
        })
        .collect();
    let info = c.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    (regions, info.regions, info.registered_bytes)
}

/// Another tenant's 1 MiB transfer from `a` to `b` still succeeds, every byte in place.
async fn victim_transfer(a: &Agent, b: &Agent, seed: u64) {
    let data = random_bytes(1 << 20, seed);
    let (src, dst) = (format!("victim-src-{seed}"), format!("victim-dst-{seed}"));
    a.create(&src, 1 << 20, pb::Access::ReadWrite).await;
    b.create(&dst, 1 << 20, pb::Access::ReadWrite).await;
    a.put(&src, 0, &data).await;
    let t = a.transfer(write_req(&src, b, &dst, 1 << 20)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert!(b.read(&dst, 0, 1 << 20).await == data, "the victim's bytes landed");
    for (agent, name) in [(a, &src), (b, &dst)] {
        agent.client().await.delete_region(pb::DeleteRegionRequest { name: name.clone() }).await.unwrap();
    }
}

fn with_labels(name: &str, labels: &[(&str, &str)]) -> pb::CreateRegionRequest {
    let labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    pb::CreateRegionRequest { labels, ..anon(name, 4096) }
}

// ------------------------------------------------------------------ labels

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_that_break_the_rules_are_refused_and_change_nothing() {
    let a = Agent::start("node-a");
    let b = Agent::start("node-b");
    let mut c = a.client().await;
    c.create_region(with_labels("kept", &[("app.example.com/tier", "db"), ("team", "")])).await.unwrap();
    let before = observable(&a).await;

    let many: Vec<(String, String)> = (0..65).map(|i| (format!("k{i}"), "v".to_string())).collect();
    let big: Vec<(String, String)> = (0..64).map(|i| (format!("p{i}.example.com/{}", "n".repeat(63)), "v".repeat(63))).collect();
    let flood: Vec<(String, String)> = (0..1000).map(|i| (format!("k{i}"), "v".repeat(60))).collect();
    let as_refs = |v: &[(String, String)]| v.iter().map(|(k, v)| (k.clone(), v.clone())).collect::<HashMap<_, _>>();
    let cases: Vec<(&str, HashMap<String, String>, &str)> = vec![
        ("an escape sequence in a value", HashMap::from([("k".into(), "\u{1b}]0;pwned\u{7}".into())]), "label \"k\""),
        ("a C1 CSI in a key", HashMap::from([("a\u{9b}2J".into(), "v".into())]), "label key \"a\\u{9b}2J\""),
        ("a key of 64 characters", HashMap::from([("k".repeat(64), "v".into())]), "longer than 63"),
        ("a value of 64 characters", HashMap::from([("k".into(), "v".repeat(64))]), "label \"k\""),
        ("an upper-case prefix", HashMap::from([("Example.com/k".into(), "v".into())]), "DNS subdomain"),
        ("a key starting with a dash", HashMap::from([("-k".into(), "v".into())]), "label key \"-k\""),
        ("65 labels", as_refs(&many), "65 entries"),
        ("64 labels of 24 KiB in all", as_refs(&big), "at most 8192"),
        ("1,000 labels", as_refs(&flood), "1000 entries"),
    ];
    for (what, labels, needle) in cases {
        let e = c.create_region(pb::CreateRegionRequest { labels, ..anon("attacker", 4096) }).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
        assert!(e.message().contains(needle), "{what}: {}", e.message());
        assert!(!e.message().chars().any(|c| c.is_control()), "{what}: the refusal echoes no control characters: {:?}", e.message());
        assert_eq!(observable(&a).await, before, "{what}: nothing else changed");
    }
    // The CLI exits 4 for INVALID_ARGUMENT, and prints the refusal inert.
    let o = a.ctl(&["region", "create", "attacker", "--size", "4KiB", "--label", "k=\u{1b}[2J"]);
    assert_eq!(o.status.code(), Some(4), "{o:?}");
    assert!(!String::from_utf8_lossy(&o.stderr).contains('\u{1b}'), "{o:?}");
    assert_eq!(observable(&a).await, before);
    victim_transfer(&a, &b, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn label_selectors_are_checked_like_labels() {
    let a = Agent::start("node-a");
    let mut c = a.client().await;
    c.create_region(with_labels("db", &[("tier", "db")])).await.unwrap();
    c.create_region(with_labels("web", &[("tier", "web")])).await.unwrap();
    let before = observable(&a).await;
    let select = |m: HashMap<String, String>| pb::ListRegionsRequest { label_selector: m };
    let found = c.list_regions(select(HashMap::from([("tier".into(), "db".into())]))).await.unwrap().into_inner();
    assert_eq!(found.regions.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["db"]);
    let many: HashMap<String, String> = (0..100_000).map(|i| (format!("k{i}"), String::new())).collect();
    for (what, sel, needle) in [
        ("a bad key", HashMap::from([("bad key".to_string(), "v".to_string())]), "label key \"bad key\""),
        ("a bad value", HashMap::from([("tier".to_string(), "\u{7}".to_string())]), "label \"tier\""),
        ("100,000 terms", many, "100000 entries"),
    ] {
        let e = c.list_regions(select(sel)).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
        assert!(e.message().starts_with("label_selector: ") && e.message().contains(needle), "{what}: {}", e.message());
    }
    assert_eq!(observable(&a).await, before);
}

/// One tenant once made ListRegions fail for every client (15 MiB of labels on one region, over
/// the message limit). Labels are bounded per region now, tightly enough that the default
/// 1,024 regions, each with the most labels it may carry, still list in one message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_region_at_its_largest_labels_still_lists() {
    let a = Agent::start("node-a");
    let mut c = a.client().await;
    let labels: HashMap<String, String> = (0..64).map(|i| (format!("p{i:02}.example.com/{}", "n".repeat(48)), "v".repeat(63))).collect();
    let bytes: usize = labels.iter().map(|(k, v)| k.len() + v.len()).sum();
    assert!(bytes > 8000, "{bytes}");
    for i in 0..1024 {
        c.create_region(pb::CreateRegionRequest { labels: labels.clone(), ..anon(&format!("r{i:04}"), 4096) }).await.unwrap();
    }
    let e = c.create_region(anon("one-more", 4096)).await.unwrap_err();
    assert!(e.code() == Code::ResourceExhausted && e.message().contains("max_regions"), "{e:?}");
    // Another client lists them all: the answer fits the agent's 16 MiB message limit.
    let list = a.client().await.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner();
    assert_eq!(list.regions.len(), 1024);
    assert!(list.regions.iter().all(|r| r.labels == labels));
    let size = prost::Message::encoded_len(&list);
    println!("ListRegions of 1,024 regions with {bytes} bytes of labels each: {size} bytes");
    assert!(size < 16 << 20, "{size}");
}

/// A catalog edited behind the agent's back (a bad label on one entry) cannot show anyone what
/// CreateRegion would have refused: that entry is ignored, with a warning; the others restore.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_catalog_cannot_show_bad_labels() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    std::fs::create_dir_all(state.join("files")).unwrap();
    for f in ["good.bin", "bad.bin"] {
        std::fs::write(state.join("files").join(f), vec![7u8; 4096]).unwrap();
    }
    let mut a = Agent::start_with("node-a", &state, Ports::new(), &[]);
    for (name, path) in [("good", "good.bin"), ("bad", "bad.bin")] {
        let req = pb::CreateRegionRequest {
            labels: HashMap::from([("tier".into(), "db".into())]),
            ..file_region_req(name, 4096, path, pb::Access::ReadWrite)
        };
        a.client().await.create_region(req).await.unwrap();
    }
    assert_eq!(a.terminate(), Some(0));

    let catalog = state.join("regions.json");
    let mut entries: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(&catalog).unwrap()).unwrap();
    for e in entries.iter_mut().filter(|e| e["name"] == "bad") {
        e["labels"]["tier"] = serde_json::json!("\u{1b}]0;pwned\u{7}\u{1b}[2J");
    }
    std::fs::write(&catalog, serde_json::to_vec(&entries).unwrap()).unwrap();

    let a = Agent::start_with("node-a", &state, Ports::new(), &[]);
    let (regions, count, bytes) = observable(&a).await;
    assert_eq!(regions, [("good".to_string(), vec![("tier".to_string(), "db".to_string())])]);
    assert_eq!((count, bytes), (1, 4096));
    assert!(a.logs().contains("catalog entry with invalid labels ignored"), "{}", a.logs());
    let o = a.ctl(&["region", "list"]);
    assert!(o.status.success(), "{o:?}");
    assert!(!String::from_utf8_lossy(&o.stdout).contains('\u{1b}'), "{o:?}");
    // The good region still serves its bytes.
    assert_eq!(a.read("good", 0, 4096).await, vec![7u8; 4096]);
}

// ------------------------------------------------------------------ fields of every request

/// One field past its bound in a request of each service: INVALID_ARGUMENT naming the field,
/// before any lookup (the names and ids below would be NOT_FOUND if they were looked up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_fields_over_their_bounds_are_refused_before_they_are_used() {
    let a = Agent::start("node-a");
    let b = Agent::start("node-b");
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let before = (observable(&a).await, observable(&b).await);
    let long = |n: usize| "x".repeat(n);
    let mut c = a.client().await;
    let mut p = b.peer_client().await;
    let submit = |f: &dyn Fn(&mut pb::SubmitTransferRequest)| {
        let mut r = write_req("nowhere", &b, "dst", 4096);
        f(&mut r);
        r
    };
    let results: Vec<(&str, Result<(), tonic::Status>)> = vec![
        ("path", c.create_region(pb::CreateRegionRequest { path: long(5000), ..anon("r", 4096) }).await.map(drop)),
        ("name", c.get_region(pb::GetRegionRequest { name: long(129) }).await.map(drop)),
        ("name", c.delete_region(pb::DeleteRegionRequest { name: long(129) }).await.map(drop)),
        ("region", c.checksum(pb::ChecksumRequest { region: long(129), ..Default::default() }).await.map(drop)),
        ("id", c.get_transfer(pb::GetTransferRequest { id: long(65) }).await.map(drop)),
        ("id", c.cancel_transfer(pb::CancelTransferRequest { id: long(65) }).await.map(drop)),
        ("remote.agent", c.submit_transfer(submit(&|r| r.remote.as_mut().unwrap().agent = long(301))).await.map(drop)),
        ("notify", c.submit_transfer(submit(&|r| r.notify = Some(vec![0; 1025]))).await.map(drop)),
        ("tag", c.watch_inbound(pb::WatchInboundRequest { region: String::new(), tag: Some(vec![1; 1025]) }).await.map(drop)),
        ("peer", c.connect(pb::ConnectRequest { peer: long(301), qps: 0 }).await.map(drop)),
        ("node_name", p.grant(pb::GrantRequest { node_name: long(254), ..grant_req("dst", "n", "", pb::Access::Write) }).await.map(drop)),
        ("tag", p.announce(pb::AnnounceRequest { grant_id: "g".into(), seq: 0, tag: vec![0; 1025] }).await.map(drop)),
        ("grant_id", p.revoke(pb::RevokeRequest { grant_id: long(65) }).await.map(drop)),
        ("connection_id", p.disconnect(pb::DisconnectRequest { connection_id: long(65), node_name: String::new() }).await.map(drop)),
        ("region", p.close_bench_region(pb::CloseBenchRegionRequest { region: long(129) }).await.map(drop)),
        (
            "endpoints[0].verbs.link_layer",
            p.connect(pb::PeerConnectRequest {
                endpoints: vec![pb::Endpoint {
                    kind: Some(pb::endpoint::Kind::Verbs(pb::VerbsEndpoint { link_layer: long(33), ..Default::default() })),
                }],
                ..connect_req("c1")
            })
            .await
            .map(drop),
        ),
    ];
    for (field, r) in results {
        let e = r.expect_err(field);
        assert_eq!(e.code(), Code::InvalidArgument, "{field}: {e:?}");
        assert!(e.message().starts_with(&format!("{field}: ")), "{field}: {}", e.message());
    }
    // A request stream is checked message by message: a WriteRegion naming a region by 129
    // characters is refused, and no byte is written anywhere.
    let msgs = vec![pb::WriteRegionRequest { region: long(129), offset: 0, data: vec![1; 16] }];
    let e = c.write_region(futures::stream::iter(msgs)).await.unwrap_err();
    assert!(e.code() == Code::InvalidArgument && e.message().starts_with("region: "), "{e:?}");
    assert_eq!((observable(&a).await, observable(&b).await), before);
    assert_eq!(b.read("dst", 0, 1 << 20).await, vec![0u8; 1 << 20]);
    victim_transfer(&a, &b, 2).await;
}

// ------------------------------------------------------------------ benchmarks

/// The KV benchmark with 1-byte blocks over an 8 GiB pool once drew its random slots from a
/// vector of every slot (64 GiB) and aborted the agent. Now: refused by the benchmarks' budget
/// by default, and with a budget that fits, run on a draw the size of the block list: over a
/// 1 GiB pool (a vector of every slot would be 8 GiB) neither agent's peak resident memory
/// passes the pool's (bench pools are filled, so a pool is resident while it lives).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_bench_of_tiny_blocks_over_a_huge_pool_is_bounded() {
    let a = Agent::start("node-a");
    let b = Agent::start("node-b");
    let before = (observable(&a).await, observable(&b).await, a.pid(), b.pid());
    let kv = |peer: &Agent, pool: u64| pb::BenchRequest {
        peer: peer.addr(),
        op: pb::Op::Write as i32,
        size: 1,
        iters: 1,
        qps: 1,
        depth: 1,
        blocks: 16,
        pool,
        ..Default::default()
    };
    // A latency phase's length is a message-benchmark field: with another pattern it is
    // refused before anything runs, not ignored.
    let lat = Some(0);
    let other_patterns = [
        pb::BenchRequest { lat_iters: lat, ..kv(&b, 1 << 20) },
        pb::BenchRequest { peer: b.addr(), size: 4096, connections: 1, lat_iters: lat, ..Default::default() },
        pb::BenchRequest { peer: b.addr(), size: 4096, per_path: true, lat_iters: lat, ..Default::default() },
    ];
    for req in other_patterns {
        let e = a.client().await.bench(req).await.unwrap_err();
        assert!(e.code() == Code::InvalidArgument && e.message().contains("lat_iters"), "{e:?}");
    }
    assert_eq!((observable(&a).await, observable(&b).await, a.pid(), b.pid()), before);
    let e = a.client().await.bench(kv(&b, 8 << 30)).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("limits.max_bench_bytes"), "{e:?}");
    assert_eq!((observable(&a).await, observable(&b).await, a.pid(), b.pid()), before);
    victim_transfer(&a, &b, 3).await;

    // Budgets that fit the pools: it runs, and no agent held more than its pool and change.
    let env = [("XFER_LIMITS__MAX_BENCH_BYTES", "2GiB")];
    let (a, b) = (Agent::start_env("node-a", &env), Agent::start_env("node-b", &env));
    let r = a.client().await.bench(kv(&b, 1 << 30)).await.unwrap().into_inner();
    assert_eq!((r.blocks, r.iters, r.bytes), (16, 1, 16), "{r:?}");
    for agent in [&a, &b] {
        let peak_kib = proc_status(agent.pid().expect("running"), "VmHWM:");
        assert!(peak_kib < (1 << 20) + (512 << 10), "peak resident {peak_kib} KiB for a 1 GiB pool");
    }
    // The scratch pools are gone on both sides, and both agents still serve.
    assert!(observable(&a).await.0.is_empty() && observable(&b).await.0.is_empty());
    victim_transfer(&a, &b, 4).await;
}

/// A peer's benchmark region at the whole `max_bench_bytes` (renewable, 10 minutes each) once
/// took `max_registered_bytes` from every client. It comes from the benchmarks' own budget now:
/// a client still creates a region of the whole client limit beside it, and transfers into it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bench_region_at_its_budget_leaves_clients_every_byte() {
    let a = Agent::start("node-a");
    let b = Agent::start_env("node-b", &[("XFER_LIMITS__MAX_REGISTERED_BYTES", "8MiB"), ("XFER_LIMITS__MAX_BENCH_BYTES", "4MiB")]);
    let mut p = b.peer_client().await;
    let e = p.open_bench_region(pb::OpenBenchRegionRequest { length: (4 << 20) + 1 }).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("limits.max_bench_bytes"), "{e:?}");
    let scratch = p.open_bench_region(pb::OpenBenchRegionRequest { length: 4 << 20 }).await.unwrap().into_inner().region;

    // The client's first request succeeds: all 8 MiB, and max_regions is not touched either.
    b.create("dst", 8 << 20, pb::Access::ReadWrite).await;
    let e = b.client().await.create_region(anon("one-more", 4096)).await.unwrap_err();
    assert!(e.code() == Code::ResourceExhausted && e.message().contains("max_registered_bytes"), "{e:?}");
    let data = random_bytes(8 << 20, 5);
    a.create("src", 8 << 20, pb::Access::ReadWrite).await;
    a.put("src", 0, &data).await;
    let t = a.transfer(write_req("src", &b, "dst", 8 << 20)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert!(b.read("dst", 0, 8 << 20).await == data);

    // Closing the benchmark gives its budget back (and leaves the client's region alone).
    p.close_bench_region(pb::CloseBenchRegionRequest { region: scratch }).await.unwrap();
    let again = p.open_bench_region(pb::OpenBenchRegionRequest { length: 4 << 20 }).await.unwrap().into_inner().region;
    p.close_bench_region(pb::CloseBenchRegionRequest { region: again }).await.unwrap();
    let (regions, count, bytes) = observable(&b).await;
    assert_eq!((regions.len(), count, bytes), (1, 1, 8 << 20), "{regions:?}");
}

// ------------------------------------------------------------------ configuration

/// Durations near 2^64 s once loaded and then panicked a runtime thread (or `main` at
/// SIGTERM); sizes near 2^64 overflowed sums. The binary refuses each at start, exit 64,
/// naming the key and its range.
#[test]
fn huge_durations_and_sizes_in_the_configuration_exit_64_naming_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    for key in [
        "transfer.timeout",
        "limits.grpc_keepalive",
        "limits.data_payload_timeout",
        "shutdown.grace",
        "grants.max_ttl",
        "limits.max_registered_bytes",
        "limits.max_bench_bytes",
    ] {
        let env = format!("XFER_{}", key.to_uppercase().replace('.', "__"));
        let o = std::process::Command::new(agent_bin())
            .args(["--fabric", "tcp", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--state-dir"])
            .arg(tmp.path().join("state"))
            .env(&env, u64::MAX.to_string())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(64), "{key}: {err}");
        assert!(err.contains(&format!("invalid configuration: {key}: ")) && err.contains("must be between"), "{key}: {err}");
    }
}
