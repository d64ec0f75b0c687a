//! A real Prometheus server (the Debian `prometheus` package, `/usr/bin/prometheus`) scrapes two
//! real agents on loopback every second. After WRITE, READ, failed and cancelled transfers the test
//! reads the counters back through Prometheus' HTTP API and compares them with what the transfer
//! records say was moved. Not a mock scrape: this is what a real deployment's dashboards see.
//!
//! `scripts/setup` installs the package. Without it this test fails (it never skips).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::Value;
use xfer_proto::v1 as pb;

const PROMETHEUS: &str = "/usr/bin/prometheus";

/// A `prometheus` process with its own config, TSDB directory and loopback port.
struct Prometheus {
    child: Child,
    url: String,
    log: PathBuf,
    http: ureq::Agent,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (`(node label, host:port)`) every second.
    /// Fails (never skips) when the server is not installed.
    fn require_installed() {
        assert!(
            Path::new(PROMETHEUS).exists(),
            "{PROMETHEUS} is missing: this test runs a real Prometheus server. Run scripts/setup \
             (or `apt-get install -y --no-install-recommends prometheus`) and try again."
        );
    }

    fn start(targets: &[(&str, String)]) -> Prometheus {
        Prometheus::require_installed();
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = String::from(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: xfer\n    static_configs:\n",
        );
        for (node, addr) in targets {
            cfg += &format!("      - targets: ['{addr}']\n        labels:\n          node: {node}\n");
        }
        let config = dir.path().join("prometheus.yml");
        std::fs::write(&config, cfg).unwrap();
        let data = dir.path().join("tsdb");
        let log = dir.path().join("prometheus.log");
        let child = Command::new(PROMETHEUS)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", data.display()))
            // Port 0: Prometheus logs the address it bound ("Listening on" address=…).
            .arg("--web.listen-address=127.0.0.1:0")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {PROMETHEUS}: {e}. Run scripts/setup."));
        let http = ureq::Agent::new_with_config(
            ureq::Agent::config_builder().timeout_global(Some(Duration::from_secs(5))).http_status_as_error(false).build(),
        );
        let mut p = Prometheus { child, url: String::new(), log, http, _dir: dir };
        p.url = format!("http://{}", p.bound_address());
        p.wait_ready();
        p
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// GET `path` (with `query` parameters); `None` while the server is not answering.
    fn get(&self, path: &str, query: &[(&str, &str)]) -> Option<(u16, String)> {
        let mut req = self.http.get(format!("{}{path}", self.url));
        for (k, v) in query {
            req = req.query(*k, *v);
        }
        let mut resp = req.call().ok()?;
        let status = resp.status().as_u16();
        Some((status, resp.body_mut().read_to_string().ok()?))
    }

    /// The address the web listener bound, from Prometheus' "Listening on" log line.
    fn bound_address(&mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let logs = self.logs();
            let found = logs
                .lines()
                .filter(|l| l.contains("msg=\"Listening on\""))
                .find_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("address=")).map(String::from));
            if let Some(addr) = found {
                return addr;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("prometheus exited early with {st}:\n{logs}");
            }
            assert!(Instant::now() < deadline, "prometheus never said where it listens after 30 s:\n{logs}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some((200, _)) = self.get("/-/ready", &[]) {
                return;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("prometheus exited early with {st}:\n{}", self.logs());
            }
            assert!(Instant::now() < deadline, "prometheus not ready after 30 s:\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `/api/v1/query`: the instant vector's samples as (labels, value).
    fn query(&self, q: &str) -> Vec<(Value, f64)> {
        let (status, body) = self.get("/api/v1/query", &[("query", q)]).unwrap_or_else(|| panic!("query {q}: no answer"));
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("query {q}: {e}: {body}"));
        assert!(status == 200 && v["status"] == "success", "query {q}: HTTP {status}: {body}");
        assert_eq!(v["data"]["resultType"], "vector", "query {q}: {body}");
        v["data"]["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s["metric"].clone(), s["value"][1].as_str().unwrap().parse::<f64>().unwrap()))
            .collect()
    }

    /// The single value of `q`, `None` while it has no sample.
    fn scalar(&self, q: &str) -> Option<f64> {
        let r = self.query(q);
        assert!(r.len() <= 1, "query {q} gave several series: {r:?}");
        r.first().map(|s| s.1)
    }

    /// Polls `q` until it equals `want` (30 s deadline; every value is final before polling starts).
    fn wait_eq(&self, q: &str, want: f64, context: &dyn Fn() -> String) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let got = self.scalar(q);
            if got == Some(want) {
                println!("prometheus: {q} = {want}");
                return want;
            }
            if Instant::now() > deadline {
                panic!("{q}: Prometheus says {got:?}, expected {want}\n{}", context());
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// `/api/v1/metadata` for one metric family: (type, help).
    fn metadata(&self, metric: &str) -> Option<(String, String)> {
        let (_, body) = self.get("/api/v1/metadata", &[("metric", metric)])?;
        let v: Value = serde_json::from_str(&body).ok()?;
        let m = v["data"][metric].as_array()?.first()?.clone();
        Some((m["type"].as_str()?.to_string(), m["help"].as_str()?.to_string()))
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn metrics_text(a: &Agent) -> String {
    let url = format!("http://127.0.0.1:{}/metrics", a.ports.metrics);
    ureq::get(&url).call().map(|mut r| r.body_mut().read_to_string().unwrap_or_default()).unwrap_or_else(|e| format!("{url}: {e}"))
}

fn req(op: pb::Op, local: &str, peer: &Agent, remote: &str, len: u64) -> pb::SubmitTransferRequest {
    pb::SubmitTransferRequest {
        notify: None,
        segments: Vec::new(),
        op: op as i32,
        local: Some(pb::LocalRange { region: local.into(), offset: 0 }),
        remote: Some(pb::RemoteRange { agent: peer.addr(), region: remote.into(), offset: 0 }),
        length: (len != 0).then_some(len),
        options: None,
    }
}

fn slow(mut r: pb::SubmitTransferRequest) -> pb::SubmitTransferRequest {
    // 4 KiB chunks, one outstanding: long enough to act on mid-transfer.
    r.options = Some(pb::TransferOptions { chunk_size: 4096, depth: 1, qps: 1, ..Default::default() });
    r
}

/// Submits a slow transfer, waits until bytes move, runs `act`, and returns the terminal record.
async fn interrupted(a: &Agent, r: pb::SubmitTransferRequest, act: impl AsyncFnOnce(&str)) -> pb::Transfer {
    let mut c = a.client().await;
    let t = c.submit_transfer(r).await.unwrap().into_inner();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let cur = c.get_transfer(pb::GetTransferRequest { id: t.id.clone() }).await.unwrap().into_inner();
        if cur.bytes_done > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "transfer never progressed: {cur:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    act(&t.id).await;
    let mut w = c.watch_transfer(pb::WatchTransferRequest { id: t.id.clone() }).await.unwrap().into_inner();
    let mut last = None;
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(10), w.message()).await.expect("transfer hangs") {
        last = Some(m);
    }
    last.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_prometheus_sees_transfer_counters() {
    Prometheus::require_installed();
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    let mut c = Agent::start("node-c"); // not scraped: the peer that dies
    let prom =
        Prometheus::start(&[("node-a", format!("127.0.0.1:{}", a.ports.metrics)), ("node-b", format!("127.0.0.1:{}", b.ports.metrics))]);
    let context = || {
        format!(
            "--- node-a /metrics:\n{}\n--- node-b /metrics:\n{}\n--- prometheus log:\n{}",
            metrics_text(&a),
            metrics_text(&b),
            prom.logs()
        )
    };
    tokio::task::block_in_place(|| prom.wait_eq(r#"sum(up{job="xfer"})"#, 2.0, &context));

    const BIG: u64 = 256 << 20;
    a.create("src", 8 << 20, pb::Access::ReadWrite).await;
    a.create("back", 8 << 20, pb::Access::ReadWrite).await;
    a.create("big", BIG, pb::Access::ReadWrite).await;
    b.create("dst", 8 << 20, pb::Access::ReadWrite).await;
    b.create("big", BIG, pb::Access::ReadWrite).await;
    b.create("out", 1 << 20, pb::Access::ReadWrite).await;
    c.create("big", BIG, pb::Access::ReadWrite).await;
    a.put("src", 0, &random_bytes(8 << 20, 3)).await;
    b.put("out", 0, &random_bytes(1 << 20, 4)).await;

    let ok = |t: &pb::Transfer| assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    // node-a WRITEs to node-b and READs from it; node-b WRITEs to node-a once.
    let writes_a = [1u64 << 20, (3 << 20) + 123, 64 << 10];
    let reads_a = [2u64 << 20, 4096 + 7];
    let writes_b = [512u64 << 10];
    for &n in &writes_a {
        ok(&a.transfer(req(pb::Op::Write, "src", &b, "dst", n)).await.unwrap());
    }
    for &n in &reads_a {
        ok(&a.transfer(req(pb::Op::Read, "back", &b, "dst", n)).await.unwrap());
    }
    for &n in &writes_b {
        ok(&b.transfer(req(pb::Op::Write, "out", &a, "back", n)).await.unwrap());
    }

    // A WRITE accepted by SubmitTransfer whose peer is SIGKILLed mid-way: FAILED.
    let failed = interrupted(&a, slow(req(pb::Op::Write, "big", &c, "big", BIG)), async |_: &str| c.kill9()).await;
    assert_eq!(failed.state, pb::TransferState::Failed as i32, "{failed:?}");
    // A WRITE cancelled mid-way: CANCELLED.
    let cancelled = interrupted(&a, slow(req(pb::Op::Write, "big", &b, "big", BIG)), async |id: &str| {
        a.client().await.cancel_transfer(pb::CancelTransferRequest { id: id.into() }).await.unwrap();
    })
    .await;
    assert_eq!(cancelled.state, pb::TransferState::Cancelled as i32, "{cancelled:?}");
    assert!(failed.bytes_done > 0 && failed.bytes_done < BIG, "{failed:?}");
    assert!(cancelled.bytes_done > 0 && cancelled.bytes_done < BIG, "{cancelled:?}");

    let sum = |v: &[u64]| v.iter().sum::<u64>() as f64;
    // The initiator counts what moved, partial transfers included; the target counts completed ones.
    let a_write_b = sum(&writes_a) + cancelled.bytes_done as f64;
    let a_write_c = failed.bytes_done as f64;
    tokio::task::block_in_place(|| {
        let q = |q: &str, want: f64| prom.wait_eq(q, want, &context);
        // Without TLS a peer is named by its address as both sides see it: on one host, loopback.
        q(r#"sum(xfer_transfer_bytes_total{node="node-a",op="write",direction="outbound"})"#, a_write_b + a_write_c);
        q(r#"xfer_transfer_bytes_total{node="node-a",op="write",direction="outbound",peer="loopback"}"#, a_write_b + a_write_c);
        q(r#"sum(xfer_transfer_bytes_total{node="node-a",op="read",direction="outbound"})"#, sum(&reads_a));
        q(r#"sum(xfer_transfer_bytes_total{node="node-b",op="write",direction="outbound"})"#, sum(&writes_b));
        q(r#"sum(xfer_transfer_bytes_total{node="node-b",op="write",direction="inbound"})"#, sum(&writes_a));
        q(r#"sum(xfer_transfer_bytes_total{node="node-b",op="read",direction="inbound"})"#, sum(&reads_a));
        q(r#"sum(xfer_transfer_bytes_total{node="node-a",op="write",direction="inbound"})"#, sum(&writes_b));
        // The deprecated name of the registered-bytes gauge is still there for one release.
        q(r#"sum(xfer_region_registered_bytes) - sum(xfer_region_bytes_registered)"#, 0.0);

        let n_ok = (writes_a.len() + reads_a.len() + writes_b.len()) as f64;
        q(r#"sum(xfer_transfers_total{result="succeeded"})"#, n_ok);
        q(r#"xfer_transfers_total{node="node-a",op="write",result="succeeded"}"#, writes_a.len() as f64);
        q(r#"xfer_transfers_total{node="node-a",op="read",result="succeeded"}"#, reads_a.len() as f64);
        q(r#"xfer_transfers_total{node="node-b",op="write",result="succeeded"}"#, writes_b.len() as f64);
        q(r#"xfer_transfers_total{node="node-a",op="write",result="failed"}"#, 1.0);
        q(r#"xfer_transfers_total{node="node-a",op="write",result="cancelled"}"#, 1.0);
        q(r#"sum(xfer_transfers_total{result=~"failed|cancelled"})"#, 2.0);
        // ... and why: the record's error_code is the metric's code label.
        q(r#"sum(xfer_transfer_failures_total{node="node-a",op="write"})"#, 2.0);
        // Label values are lower case; the record keeps the API's upper-case code.
        q(r#"xfer_transfer_failures_total{node="node-a",op="write",code="cancelled"}"#, 1.0);
        let code = failed.error_code.to_ascii_lowercase();
        q(&format!(r#"xfer_transfer_failures_total{{node="node-a",op="write",code="{code}"}}"#), 1.0);

        // The duration is a real histogram (buckets applied), one observation per finished transfer.
        q(r#"sum(xfer_transfer_duration_seconds_count)"#, n_ok + 2.0);
        q(r#"count(xfer_transfer_duration_seconds_bucket{node="node-a",op="write"})"#, 23.0);
        q(r#"xfer_transfer_duration_seconds_bucket{node="node-a",op="write",le="+Inf"}"#, writes_a.len() as f64 + 2.0);

        // Both targets stayed up the whole time.
        q(r#"count(min_over_time(up{job="xfer"}[1h]) == 1)"#, 2.0);

        // Every query of the shipped Grafana dashboard is valid PromQL for a real server, with
        // the variables filled as Grafana does; the per-op join of bytes and work requests
        // ("Bytes per work request") finds both operations this workload ran.
        // A rate needs two samples in its window: wait until every series the join reads has
        // them (the counters above may have been checked after their first scrape).
        for m in ["xfer_work_requests_total", "xfer_transfer_bytes_total"] {
            q(&format!(r#"min(count_over_time({m}{{node="node-a",op=~"read|write"}}[1m])) >= bool 2"#), 1.0);
        }
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/xfer-dashboard.json");
        let dash: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut queries = 0;
        for panel in dash["panels"].as_array().unwrap() {
            for t in panel["targets"].as_array().into_iter().flatten() {
                let expr = t["expr"].as_str().unwrap().replace("$instance", ".*").replace("$peer", ".*").replace("$__rate_interval", "1m");
                // Only labels every scrape has: not the `node` label this test's (and the
                // ServiceMonitor's) relabeling adds.
                assert!(!expr.contains("node"), "{}: {expr} depends on a node label", panel["title"]);
                let result = prom.query(&expr);
                queries += 1;
                if panel["title"] == "Bytes per work request" {
                    let ops: std::collections::BTreeSet<&str> = result.iter().filter_map(|(l, _)| l["op"].as_str()).collect();
                    assert_eq!(ops, ["read", "write"].into(), "{expr}: {result:?}");
                }
            }
        }
        assert!(queries > 20, "only {queries} dashboard queries");
    });

    // Help texts and types reached Prometheus' metadata store.
    for (metric, kind, help) in [
        ("xfer_transfers_total", "counter", "Transfers finished"),
        ("xfer_transfer_bytes_total", "counter", "Bytes moved by transfers"),
        ("xfer_transfer_duration_seconds", "histogram", "Duration of finished transfers"),
    ] {
        let got = tokio::task::block_in_place(|| prom.metadata(metric));
        let (t, h) = got.unwrap_or_else(|| panic!("no metadata for {metric}\n{}", context()));
        println!("prometheus: metadata {metric}: {t}: {h}");
        assert_eq!(t, kind, "{metric}");
        assert!(h.starts_with(help), "{metric} help: {h}");
    }
}
