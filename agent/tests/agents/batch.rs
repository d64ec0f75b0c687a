//! Batches and notifications end to end (issue 11), through real agents on the tcp fabric and
//! real gRPC clients: a KV-shaped batch of scattered blocks lands exactly and the target's
//! subscriber, reading the moment it is told, sees every byte; READ batches notify the target
//! that its blocks were read; every bad batch gets a clear status before any byte moves and
//! leaves nothing behind; a cancelled batch notifies nobody; xferctl's `cp --segments --notify`
//! and `watch-inbound` do the same from the shell.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

const BLOCK: u64 = 4096;

/// A permutation of `0..n` (deterministic).
fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

fn seg(local: u64, remote: u64, len: u64) -> pb::Segment {
    pb::Segment { local_offset: local, remote_offset: remote, length: len }
}

fn batch_req(
    op: pb::Op,
    local: &str,
    peer: &Agent,
    remote: &str,
    segments: Vec<pb::Segment>,
    tag: Option<&[u8]>,
) -> pb::SubmitTransferRequest {
    pb::SubmitTransferRequest {
        op: op as i32,
        local: Some(pb::LocalRange { region: local.into(), offset: 0 }),
        remote: Some(pb::RemoteRange { agent: peer.addr(), region: remote.into(), offset: 0 }),
        length: None,
        options: Some(pb::TransferOptions { chunk_size: 16 << 10, qps: 3, depth: 8, ..Default::default() }),
        segments,
        notify: tag.map(<[u8]>::to_vec),
    }
}

/// 1,024 blocks of 4 KiB scattered over an 8 MiB pool, in a random order on both sides (plus a
/// run of contiguous ones, which coalesce): the subscriber on the target, reading the region
/// the moment its notification arrives, finds every block in place, and the blocks not listed
/// are untouched.
#[tokio::test]
async fn a_kv_batch_lands_and_its_notification_follows_the_bytes() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    const POOL: u64 = 8 << 20;
    a.create("kv", POOL, pb::Access::ReadWrite).await;
    b.create("kv", POOL, pb::Access::ReadWrite).await;
    let src = random_bytes(POOL as usize, 11);
    let before = random_bytes(POOL as usize, 12);
    a.put("kv", 0, &src).await;
    b.put("kv", 0, &before).await;
    let (from, to) = (shuffled(POOL / BLOCK, 1), shuffled(POOL / BLOCK, 2));
    let mut segments: Vec<pb::Segment> = (0..1000).map(|i| seg(from[i] * BLOCK, to[i] * BLOCK, BLOCK)).collect();
    // 24 contiguous blocks on both sides, past the scattered ones' reach: 24 asked, 1 posted.
    let (lbase, rbase) = (from[1000] * BLOCK, to[1000] * BLOCK);
    let taken: std::collections::HashSet<u64> = to[..1000].iter().copied().collect();
    let run_ok = (0..24).all(|k| {
        let (l, r) = (lbase + k * BLOCK, rbase + k * BLOCK);
        l + BLOCK <= POOL && r + BLOCK <= POOL && !taken.contains(&(r / BLOCK))
    });
    if run_ok {
        segments.extend((0..24).map(|k| seg(lbase + k * BLOCK, rbase + k * BLOCK, BLOCK)));
    }
    let mut notes = subscribe(&b, "kv", Some(b"req-42")).await;
    let t = a
        .client()
        .await
        .submit_transfer(batch_req(pb::Op::Write, "kv", &b, "kv", segments.clone(), Some(b"req-42")))
        .await
        .unwrap()
        .into_inner();
    let n = next_note(&mut notes).await;
    // Read at once, before anything else happens.
    let landed = b.read("kv", 0, POOL).await;
    assert_eq!((n.region.as_str(), n.tag.as_slice(), n.op, n.via.as_str()), ("kv", &b"req-42"[..], pb::Op::Write as i32, "fabric"));
    // The peer's authenticated identity: a certificate's NAME, or in plaintext mode (this test)
    // what `identity::plaintext_name` calls a loopback caller.
    assert_eq!(n.peer, "loopback");
    let mut want = before.clone();
    for s in &segments {
        let (l, r, len) = (s.local_offset as usize, s.remote_offset as usize, s.length as usize);
        want[r..r + len].copy_from_slice(&src[l..l + len]);
    }
    assert!(landed == want, "when notified, the target held every listed block, and the rest was unchanged");
    let done = watch_to_end(&a, &t.id).await;
    assert_eq!(done.state, pb::TransferState::Succeeded as i32, "{done:?}");
    let total = segments.len() as u64 * BLOCK;
    assert_eq!((done.length, done.bytes_done), (total, total));
    let expect_posted = if run_ok { 1001 } else { 1000 };
    assert_eq!(done.segments, expect_posted, "contiguous blocks coalesced");
    assert_eq!(done.notify.as_deref(), Some(&b"req-42"[..]));
    // The target's counters: one notification via the fabric, three markers (one per QP).
    let text = scrape(&b);
    assert_eq!(labelled(&text, "xfer_notifications_total", &[("via", "fabric")]), 1.0, "{text}");
    assert_eq!(labelled(&text, "xfer_notify_markers_total", &[("result", "counted")]), 3.0);
    let text = scrape(&a);
    assert_eq!(labelled(&text, "xfer_batches_total", &[("op", "write")]), 1.0);
    assert_eq!(labelled(&text, "xfer_batch_segments_total", &[("op", "write"), ("form", "asked")]), segments.len() as f64);
    assert_eq!(labelled(&text, "xfer_batch_segments_total", &[("op", "write"), ("form", "posted")]), expect_posted as f64);
    // One WR per scattered block (each under the 16 KiB chunk), the coalesced 96 KiB run cut
    // into six 16 KiB chunks, and one marker per QP.
    let writes = if run_ok { 1000 + 6 } else { 1000 };
    assert_eq!(labelled(&text, "xfer_work_requests_total", &[("op", "write")]), writes as f64, "{text}");
    assert_eq!(labelled(&text, "xfer_work_requests_total", &[("op", "notify")]), 3.0);
    assert_eq!(labelled(&text, "xfer_work_requests_total", &[("op", "read")]), 0.0);
}

/// A READ batch pulls scattered blocks of the target's pool; the target is told (op READ) once
/// they were read, and a filter on another tag does not see it.
#[tokio::test]
async fn a_read_batch_notifies_the_target_that_its_blocks_were_read() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    const POOL: u64 = 1 << 20;
    a.create("dst", POOL, pb::Access::ReadWrite).await;
    b.create("pool", POOL, pb::Access::Read).await;
    let pool = random_bytes(POOL as usize, 21);
    b.put("pool", 0, &pool).await;
    let order = shuffled(POOL / BLOCK, 3);
    let segments: Vec<pb::Segment> = (0..64).map(|i| seg(i * BLOCK, order[i as usize] * BLOCK, BLOCK)).collect();
    let mut other = subscribe(&b, "", Some(b"someone-else")).await;
    let mut notes = subscribe(&b, "pool", None).await;
    let t = a.transfer(batch_req(pb::Op::Read, "dst", &b, "pool", segments.clone(), Some(b"read-7"))).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    let n = next_note(&mut notes).await;
    assert_eq!((n.tag.as_slice(), n.op), (&b"read-7"[..], pb::Op::Read as i32));
    // One READ WR per posted segment (blocks adjacent on both sides coalesce; each is under
    // the 16 KiB chunk).
    assert!(t.segments > 0 && t.segments <= 64, "{t:?}");
    assert_eq!(labelled(&scrape(&a), "xfer_work_requests_total", &[("op", "read")]), t.segments as f64);
    let got = a.read("dst", 0, 64 * BLOCK).await;
    for (i, s) in segments.iter().enumerate() {
        let r = s.remote_offset as usize;
        assert!(got[i * BLOCK as usize..(i + 1) * BLOCK as usize] == pool[r..r + BLOCK as usize], "block {i}");
    }
    // The other subscriber's next message, if any, is not this one: end its stream and look.
    drop(b);
    let last = tokio::time::timeout(Duration::from_secs(30), other.message()).await.expect("the stream ends with the agent");
    if let Ok(Some(n)) = last {
        panic!("a subscriber filtering on another tag got {n:?}");
    }
}

/// `verify` on a batch checksums its segments in the batch's order on both agents, WRITE and
/// READ (a READ batch may read one block twice): both records say verified, with one checksum.
#[tokio::test]
async fn a_verified_batch_compares_its_segments_in_order_on_both_agents() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    const POOL: u64 = 1 << 20;
    a.create("kv", POOL, pb::Access::ReadWrite).await;
    b.create("pool", POOL, pb::Access::ReadWrite).await;
    a.put("kv", 0, &random_bytes(POOL as usize, 5)).await;
    b.put("pool", 0, &random_bytes(POOL as usize, 6)).await;
    let order = shuffled(POOL / BLOCK, 9);
    let scattered: Vec<pb::Segment> = (0..128).map(|i| seg(i * BLOCK, order[i as usize] * BLOCK, BLOCK)).collect();
    // A READ batch reading block 0 of the pool into two places.
    let mut twice = scattered.clone();
    twice[1].remote_offset = twice[0].remote_offset;
    for (op, segments) in [(pb::Op::Write, scattered.clone()), (pb::Op::Read, scattered), (pb::Op::Read, twice)] {
        let mut req = batch_req(op, "kv", &b, "pool", segments, None);
        req.options.as_mut().unwrap().verify = true;
        let t = a.transfer(req).await.unwrap();
        assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{op:?}: {t:?}");
        assert!(t.verified && t.checksum != 0, "{op:?}: {t:?}");
        let inbound = b.client().await.get_transfer(pb::GetTransferRequest { id: format!("loopback/{}", t.id) }).await.unwrap();
        let inbound = inbound.into_inner();
        assert!(inbound.verified && inbound.checksum == t.checksum, "{op:?}: {inbound:?}");
    }
}

/// Every bad batch is refused with a clear status that names the problem, before any byte
/// moves: nothing lands, no transfer record is left on the initiator, no grant on the target.
#[tokio::test]
async fn bad_batches_are_refused_before_any_byte_moves() {
    let a = Agent::start_env("node-a", &[("XFER_TRANSFER__MAX_SEGMENTS", "4"), ("XFER_TRANSFER__MAX_NOTIFY_BYTES", "16")]);
    let b = Agent::start_env("node-b", &[("XFER_TRANSFER__MAX_NOTIFY_BYTES", "8")]);
    a.create("src", 1 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    a.put("src", 0, &random_bytes(1 << 20, 5)).await;
    let before = random_bytes(1 << 20, 6);
    b.put("dst", 0, &before).await;
    let w = |segs: Vec<pb::Segment>| batch_req(pb::Op::Write, "src", &b, "dst", segs, None);
    let mut with_offset = w(vec![seg(0, 0, 10)]);
    with_offset.local.as_mut().unwrap().offset = 5;
    let mut long_tag = w(vec![seg(0, 0, 10)]);
    long_tag.notify = Some(vec![b'x'; 17]);
    let mut tag_over_target = w(vec![seg(0, 0, 10)]);
    tag_over_target.notify = Some(vec![b'y'; 9]);
    let cases: Vec<(&str, pb::SubmitTransferRequest, Code, &str)> = vec![
        (
            "overlapping destinations",
            w(vec![seg(0, 100, 50), seg(100, 0, 10), seg(200, 120, 1)]),
            Code::InvalidArgument,
            "segments 0 and 2",
        ),
        ("a segment past the local region", w(vec![seg(0, 0, 1), seg((1 << 20) - 1, 8, 2)]), Code::InvalidArgument, "segment 1"),
        ("a zero-length segment", w(vec![seg(0, 0, 8), seg(8, 8, 0)]), Code::InvalidArgument, "segment 1: zero length"),
        ("an offset that overflows", w(vec![seg(0, u64::MAX - 1, 4)]), Code::InvalidArgument, "segment 0"),
        (
            "more segments than transfer.max_segments",
            w((0..5).map(|i| seg(i * 8, i * 8, 8)).collect()),
            Code::ResourceExhausted,
            "at most 4",
        ),
        ("segments past the remote region", w(vec![seg(0, (1 << 20) - 8, 16)]), Code::InvalidArgument, ""),
        ("offsets beside segments", with_offset, Code::InvalidArgument, "must be 0"),
        ("a tag over the initiator's limit", long_tag, Code::InvalidArgument, "at most 16"),
        ("a tag over the target's limit", tag_over_target, Code::InvalidArgument, "at most 8"),
    ];
    let mut c = a.client().await;
    for (what, r, code, says) in cases {
        let e = c.submit_transfer(r).await.expect_err(what);
        assert_eq!(e.code(), code, "{what}: {e:?}");
        assert!(e.message().contains(says), "{what}: {:?} does not say {says:?}", e.message());
    }
    assert!(b.read("dst", 0, 1 << 20).await == before, "the target region changed");
    let left = c.list_transfers(pb::ListTransfersRequest {}).await.unwrap().into_inner().transfers;
    assert!(left.is_empty(), "refused batches left records: {left:?}");
    wait_gauge(&b, "xfer_grants_active", 0.0).await;
    // The segment list from the CLI: an empty or malformed file is a usage error naming it.
    let dir = tempfile::tempdir().unwrap();
    let list = dir.path().join("segs");
    std::fs::write(&list, "# nothing\n").unwrap();
    let dst = format!("{}:dst", b.addr());
    let o = a.ctl(&["cp", "src", &dst, "--segments", list.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("empty"), "{o:?}");
    std::fs::write(&list, "0 0 4KiB\n0 8KiB\n").unwrap();
    let o = a.ctl(&["cp", "src", &dst, "--segments", list.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("line 2"), "{o:?}");
}

/// A cancelled batch notifies nobody: its grant is revoked without a notification, so the first
/// notification the subscriber gets is the next batch's.
#[tokio::test]
async fn a_cancelled_batch_notifies_nobody() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    a.create("src", 64 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 64 << 20, pb::Access::ReadWrite).await;
    let mut notes = subscribe(&b, "dst", None).await;
    let mut slow =
        batch_req(pb::Op::Write, "src", &b, "dst", (0..16).map(|i| seg(i << 22, i << 22, 4 << 20)).collect(), Some(b"cancelled"));
    make_slow(&mut slow);
    let mut c = a.client().await;
    let t = c.submit_transfer(slow).await.unwrap().into_inner();
    wait_progress(&a, &t.id).await;
    c.cancel_transfer(pb::CancelTransferRequest { id: t.id.clone() }).await.unwrap();
    let end = watch_to_end(&a, &t.id).await;
    assert_eq!(end.state, pb::TransferState::Cancelled as i32, "{end:?}");
    let ok = a.transfer(batch_req(pb::Op::Write, "src", &b, "dst", vec![seg(0, 0, 4096)], Some(b"next"))).await.unwrap();
    assert_eq!(ok.state, pb::TransferState::Succeeded as i32);
    let n = next_note(&mut notes).await;
    assert_eq!(n.tag, b"next", "the cancelled batch was notified: {n:?}");
}

/// The shell: `watch-inbound` on the target prints the notification of a `cp --segments
/// --notify` (a strided list from stdin), after which `get` finds the bytes.
#[tokio::test]
async fn xferctl_cp_segments_and_watch_inbound() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    a.create("src", 1 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let src = random_bytes(1 << 20, 31);
    a.put("src", 0, &src).await;
    let mut watch = Command::new(xferctl_bin())
        .args(["--agent", &b.addr(), "--json", "watch-inbound", "dst", "--tag", "layer-3", "--count", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Subscribed once it says so.
    let mut err = BufReader::new(watch.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert!(line.contains("watching dst"), "{line:?}");
    // 32 blocks of 4 KiB read every 16 KiB of SRC, written back to back from DST@64KiB.
    let mut cp = Command::new(xferctl_bin())
        .args(["--agent", &a.addr(), "cp", "src", &format!("{}:dst@64KiB", b.addr()), "--segments", "-", "--notify", "layer-3"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    cp.stdin.take().unwrap().write_all(b"# one strided line\n0 0 4KiB x32 16KiB\n").unwrap();
    let cp = cp.wait_with_output().unwrap();
    assert!(cp.status.success(), "{cp:?}");
    let out = watch.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let n: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((n["region"].as_str(), n["tag"]["text"].as_str(), n["op"].as_str()), (Some("dst"), Some("layer-3"), Some("write")), "{n}");
    let got = b.read("dst", 64 << 10, 32 * BLOCK).await;
    for k in 0..32usize {
        let s = (k * 16) << 10;
        assert!(got[k * 4096..(k + 1) * 4096] == src[s..s + 4096], "block {k}");
    }
}

/// `xferctl bench --pattern kv` runs real batches (the product path) and leaves no scratch
/// region behind on either agent.
#[tokio::test]
async fn the_kv_benchmark_runs_batches_and_cleans_up() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    let o = a.ctl(&["--json", "bench", "--peer", &b.addr(), "--pattern", "kv", "--block", "4KiB", "--blocks", "64", "--iters", "2"]);
    assert!(o.status.success(), "{o:?}");
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let row = &doc["rows"][0];
    assert_eq!((row["pattern"].as_str(), row["blocks"].as_u64(), row["iters"].as_u64()), (Some("kv"), Some(64), Some(2)), "{doc}");
    assert_eq!(row["bytes"].as_u64(), Some(64 * 4096 * 2));
    assert!(row["gbit_per_s"].as_f64().unwrap() > 0.0 && row["prep_ns_per_segment"].as_f64().unwrap() > 0.0, "{doc}");
    // Two batches, each notified on the target.
    assert_eq!(labelled(&scrape(&b), "xfer_notifications_total", &[]), 2.0);
    for agent in [&a, &b] {
        let regions = agent.client().await.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner().regions;
        assert!(regions.is_empty(), "scratch regions left: {regions:?}");
    }
}

/// `xferctl bench --pattern notify` maps a shared-memory pool on the peer, watches each round's
/// blocks land and receives each round's notification: every round is notified via the fabric
/// and never before its bytes were visible (else the command fails), and nothing is left behind
/// (regions on both agents, the pool's object in /dev/shm).
#[tokio::test]
async fn the_notify_benchmark_sees_bytes_before_notifications_and_cleans_up() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    let o = a.ctl(&["--json", "bench", "--peer", &b.addr(), "--pattern", "notify", "--blocks", "32", "--iters", "8"]);
    assert!(o.status.success(), "{o:?}");
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (doc["pattern"].as_str(), doc["rounds"].as_u64(), doc["blocks"].as_u64(), doc["via_fabric"].as_u64()),
        (Some("notify"), Some(8), Some(32), Some(8)),
        "{doc}"
    );
    let (p50, p99) = (doc["notify_delay_p50_us"].as_f64().unwrap(), doc["notify_delay_p99_us"].as_f64().unwrap());
    assert!(p50 >= 0.0 && p99 >= p50 && doc["batch_p50_us"].as_f64().unwrap() > 0.0, "{doc}");
    assert_eq!(labelled(&scrape(&b), "xfer_notifications_total", &[("via", "fabric")]), 8.0);
    for agent in [&a, &b] {
        let regions = agent.client().await.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner().regions;
        assert!(regions.is_empty(), "regions left: {regions:?}");
    }
    let left: Vec<_> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("xfer-notify-pool"))
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "shm objects left: {left:?}");
}

/// The connection-setup benchmark negotiates fresh connections, holds them all (the target
/// counts them), reports per-connection times and memory per QP, then gives them all back.
#[tokio::test]
async fn the_connect_benchmark_holds_fresh_connections_and_gives_them_back() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    let o = a.ctl(&["--json", "bench", "--peer", &b.addr(), "--pattern", "connect", "--connections", "6", "--qps", "2"]);
    assert!(o.status.success(), "{o:?}");
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((doc["connections"].as_u64(), doc["qps_held"].as_u64()), (Some(6), Some(12)), "{doc}");
    assert!(doc["connect_p50_us"].as_f64().unwrap() > 0.0, "{doc}");
    assert!(doc["rss_bytes_per_qp"].as_f64().is_some(), "{doc}");
    // The same-run baseline: Peer.Ping round trips to the same peer (each answered, or the
    // benchmark fails), faster than a whole negotiation.
    let rpc = doc["rpc_p50_us"].as_f64().unwrap();
    assert!(rpc > 0.0 && rpc < doc["connect_p50_us"].as_f64().unwrap(), "{doc}");
    wait_gauge(&b, "xfer_accepted_connections", 0.0).await;
    let o = a.ctl(&["bench", "--peer", &b.addr(), "--pattern", "connect", "--connections", "300"]);
    assert_eq!(o.status.code(), Some(4), "over the per-peer bound: INVALID_ARGUMENT ({o:?})");
    let o = a.ctl(&["bench", "--peer", &b.addr(), "--pattern", "connect", "--connections", "2", "--hold", "61s"]);
    assert_eq!(o.status.code(), Some(4), "a hold over 60 s: INVALID_ARGUMENT ({o:?})");
    let o = a.ctl(&["bench", "--peer", &b.addr(), "--pattern", "connect", "--connections", "2", "--interval", "1001ms"]);
    assert_eq!(o.status.code(), Some(4), "a pause over 1 s: INVALID_ARGUMENT ({o:?})");
    // Paced: each connection still fresh and timed; the pauses are not in the times.
    let o = a.ctl(&["--json", "bench", "--peer", &b.addr(), "--pattern", "connect", "--connections", "3", "--interval", "200ms"]);
    assert!(o.status.success(), "{o:?}");
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["connections"].as_u64(), Some(3), "{doc}");
    // The run took both pauses, and they are outside the connections' times: the run's length
    // is at least the sum of the three times plus 2 x 200 ms.
    let (seconds, timed) = (doc["seconds"].as_f64().unwrap(), doc["connect_avg_us"].as_f64().unwrap() * 3.0 / 1e6);
    assert!(seconds >= 0.4 + timed - 1e-6, "pauses outside the timed negotiations: {doc}");
    wait_gauge(&b, "xfer_accepted_connections", 0.0).await;
    // --hold keeps them all up once negotiated (what lets several initiators overlap): the
    // target counts all 4 while the command still runs, then none once it returned.
    let (addr, peer) = (a.addr(), b.addr());
    let run = std::thread::spawn(move || {
        std::process::Command::new(xferctl_bin())
            .args([
                "--agent",
                addr.as_str(),
                "bench",
                "--peer",
                peer.as_str(),
                "--pattern",
                "connect",
                "--connections",
                "4",
                "--qps",
                "1",
                "--hold",
                "10s",
            ])
            .output()
            .unwrap()
    });
    wait_gauge(&b, "xfer_accepted_connections", 4.0).await;
    assert!(!run.is_finished(), "the connections were counted while the command held them");
    let o = tokio::task::spawn_blocking(move || run.join().unwrap()).await.unwrap();
    assert!(o.status.success(), "{o:?}");
    wait_gauge(&b, "xfer_accepted_connections", 0.0).await;
}

/// WatchInbound subscribers are bounded (each publication wakes every one): past the limit a
/// new one gets RESOURCE_EXHAUSTED, and one leaving makes room.
#[tokio::test]
async fn watch_inbound_subscribers_are_bounded() {
    let b = Agent::start("node-b");
    let mut held = Vec::new();
    for _ in 0..256 {
        held.push(subscribe(&b, "", None).await);
    }
    let e = b.client().await.watch_inbound(pb::WatchInboundRequest::default()).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    drop(held.pop());
    // The server notices the cancelled stream when it next polls it; retry until it has (the
    // count, at least a minute of retries, is a hang guard).
    let mut ok = false;
    for _ in 0..6000 {
        if b.client().await.watch_inbound(pb::WatchInboundRequest::default()).await.is_ok() {
            ok = true;
            break;
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ok, "a subscriber that left freed its place");
}
