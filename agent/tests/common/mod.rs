//! Test harness: real `xfer-agent` processes on 127.0.0.1 with temp state dirs, driven by the
//! real `xferctl` binary and by real gRPC clients. Agents listen on port 0 and report the ports
//! they bound in their ready file (`--ready-file`): no port is chosen before it is bound, so
//! parallel test binaries cannot race for one.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

pub mod calls;
pub mod chan;
pub mod pki;
pub mod wire;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tonic::transport::Channel;
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;
use xfer_proto::v1::peer_client::PeerClient;

// Re-exported for `use crate::common::*`; a binary that drives no raw streams or no second
// client leaves them unused, like the rest of this harness (`dead_code` above).
#[allow(unused_imports)]
pub use calls::{port_of, put_via, read_via, run_via, unix_channel};
#[allow(unused_imports)]
pub use wire::{
    assert_closed, frame, frame_header, open_data_stream, raw_read, raw_write, read_frame_answer, read_header, token_of, DataSession,
    Header, Kind,
};

/// `xfer_notify_markers_total{result}` of `a`.
pub fn notify_markers(a: &Agent, result: &str) -> f64 {
    labelled(&scrape(a), "xfer_notify_markers_total", &[("result", result)])
}

/// An anonymous read-write region request.
pub fn anon(name: &str, len: u64) -> pb::CreateRegionRequest {
    pb::CreateRegionRequest {
        name: name.into(),
        length: len,
        kind: pb::RegionKind::Anonymous as i32,
        access: pb::Access::ReadWrite as i32,
        ..Default::default()
    }
}

/// `Peer.Connect` (tcp) as connection `id`; the declared name is ignored by the agent.
pub fn connect_req(id: &str) -> pb::PeerConnectRequest {
    pb::PeerConnectRequest {
        version: 1,
        node_name: "whoever".into(),
        fabric: pb::FabricKind::Tcp as i32,
        endpoints: vec![],
        connection_id: id.into(),
    }
}

/// A 4 KiB grant at offset 0 of `region` for `op`, on the caller's connection `conn` (tcp grants
/// are bound to one), declaring the node name `declared` (which the agent ignores).
pub fn grant_req(region: &str, declared: &str, conn: &str, op: pb::Access) -> pb::GrantRequest {
    pb::GrantRequest {
        notify: None,
        region: region.into(),
        offset: 0,
        length: 4096,
        op: op as i32,
        ttl: None,
        node_name: declared.into(),
        connection_id: conn.into(),
    }
}

/// `Peer.Complete` of a WRITE grant, recorded as `transfer_id`.
pub fn complete_req(grant_id: &str, transfer_id: &str, bytes: u64, declared: &str) -> pb::CompleteRequest {
    pb::CompleteRequest {
        transfer_id: transfer_id.into(),
        grant_id: grant_id.into(),
        bytes,
        op: pb::Op::Write as i32,
        node_name: declared.into(),
        ..Default::default()
    }
}

/// How long a test's blocking socket read may wait before it fails the test instead of hanging
/// it. Never what a test waits *for*: every guarded read has its answer (bytes, EOF or a reset)
/// already on the way, so the bound is only reached when the agent is broken, and it is long so
/// that no loaded machine reaches it. Silence is never asserted by a read timing out: a stream
/// that must be closed is read to its end ([`wire::assert_closed`]), one that must stay open
/// answers a frame.
pub const READ_GUARD: Duration = Duration::from_secs(120);

/// GET /metrics from the agent's metrics listener (a plain HTTP/1.0 request: the server closes
/// when done); the answer must be a 200.
pub fn scrape(a: &Agent) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", a.ports.metrics)).unwrap();
    s.set_read_timeout(Some(READ_GUARD)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.0 200") || out.starts_with("HTTP/1.1 200"), "metrics answered {out:.200}");
    out
}

/// Sum of the samples of `series` in a scrape: an exact name with `{labels}`, or a bare name
/// (its unlabelled sample and every labelled one); 0 when absent.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series || (!series.contains('{') && name.starts_with(&format!("{series}{{")))).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

/// Sum of the samples of `name` carrying every one of `labels`, in whatever order the exporter
/// writes them (`metric` needs the exact series text).
pub fn labelled(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Lets this test process hold thousands of sockets (soft RLIMIT_NOFILE up to the hard limit).
pub fn raise_own_nofile() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
}

/// Open descriptors of process `pid`.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

/// Floods a control listener of the agent `pid` with idle HTTP/2 connections made by `connect`
/// (each sends the client preface and an empty SETTINGS frame, and is held once the server
/// answers with its SETTINGS) until the agent refuses one (closes it at once: the preface may
/// already meet EPIPE or a reset) or its descriptors reach `nofile`. Returns the sockets held
/// and whether one was refused.
pub fn flood_h2<S: std::io::Read + std::io::Write>(pid: u32, nofile: u64, mut connect: impl FnMut() -> S) -> (Vec<S>, bool) {
    let mut preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    preface.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    let mut held = Vec::new();
    while open_fds(pid) + 1 < nofile as usize {
        let mut s = connect();
        let mut h = [0u8; 9];
        if s.write_all(&preface).is_err() || s.read_exact(&mut h).is_err() {
            return (held, true);
        }
        assert_eq!(h[3], 4, "SETTINGS");
        held.push(s);
    }
    (held, false)
}

/// The value of the unlabelled gauge `name` in a scrape of `a` (0 if absent).
pub fn gauge(a: &Agent, name: &str) -> f64 {
    let prefix = format!("{name} ");
    scrape(a).lines().find_map(|l| l.strip_prefix(&prefix).map(|v| v.trim().parse().unwrap())).unwrap_or(0.0)
}

/// Waits until the unlabelled gauge `name` of `a` reads `want` (polled, at most 3000 times 20 ms
/// apart: a safety net against a hang; the wait is for the value).
pub async fn wait_gauge(a: &Agent, name: &str, want: f64) {
    for _ in 0..3000 {
        if gauge(a, name) == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{name} never reached {want}: {}", scrape(a));
}

/// A loopback port that is bound (so nobody else can take it) but not listening: a connection to
/// it is refused at once. The port stays reserved until this is dropped.
pub struct ClosedPort {
    _socket: tokio::net::TcpSocket,
    pub addr: std::net::SocketAddr,
}

pub fn closed_port() -> ClosedPort {
    // No SO_REUSEADDR: a listener bound with it (as std's and tokio's are) cannot share the port.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    ClosedPort { _socket: socket, addr }
}

pub fn agent_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_xfer-agent"))
}

/// `xferctl` is built next to `xfer-agent` (`make test` builds all binaries first).
pub fn xferctl_bin() -> PathBuf {
    let p = agent_bin().with_file_name("xferctl");
    assert!(p.exists(), "{} missing: run `cargo build --workspace --bins` first (make test does)", p.display());
    p
}

/// Ports to listen on (0: the agent's OS picks one); once the agent serves, the ports it bound,
/// read from its ready file.
pub struct Ports {
    pub grpc: u16,
    pub metrics: u16,
    /// The tcp data listener; 0 as input: no `--data-listen` flag (the host of `listen`, port 0).
    pub data: u16,
    /// Reported only: the health listener if one is configured (`health_listen`), else 0.
    pub health: u16,
}

impl Ports {
    /// Every listener on a port the agent's OS picks; the agent reports them.
    pub fn new() -> Ports {
        Ports { grpc: 0, metrics: 0, data: 0, health: 0 }
    }

    /// The same gRPC port again, to restart an agent where peers know it. Every other port is
    /// picked afresh (the data port: peers learn it through `Peer.Connect`; metrics: the test
    /// reads it from the ready file): a port held over a restart can be taken meanwhile by an
    /// agent of a test running in parallel, and each one kept is one more such race (seen:
    /// `metrics_listen` in use on restart).
    pub fn same(&self) -> Ports {
        Ports { grpc: self.grpc, metrics: 0, data: 0, health: 0 }
    }
}

pub struct Agent {
    pub name: String,
    pub child: Option<Child>,
    pub ports: Ports,
    pub state_dir: PathBuf,
    pub log: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl Agent {
    pub fn start(name: &str) -> Agent {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let mut a = Agent::start_with(name, &state, Ports::new(), &[]);
        a._tmp = Some(tmp);
        a
    }

    /// Starts an agent with extra environment variables (e.g. `XFER_LIMITS__MAX_REGIONS`).
    pub fn start_env(name: &str, env: &[(&str, &str)]) -> Agent {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let mut a = Agent::start_with_env(name, &state, Ports::new(), &[], env);
        a._tmp = Some(tmp);
        a
    }

    pub fn start_with(name: &str, state_dir: &Path, ports: Ports, extra: &[&str]) -> Agent {
        Agent::start_with_env(name, state_dir, ports, extra, &[])
    }

    /// Starts an agent with extra environment variables under `ulimit -n NOFILE` (soft and hard,
    /// through `sh -c 'ulimit -n N; exec …'`, so the agent's pid is the child's).
    pub fn start_env_nofile(name: &str, env: &[(&str, &str)], nofile: u64) -> Agent {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let mut a = Agent::spawn(name, &state, Ports::new(), &[], env, Some(nofile));
        a._tmp = Some(tmp);
        a
    }

    /// Like [`Agent::start_with`], with extra environment variables (e.g. `XFER_INSECURE`).
    pub fn start_with_env(name: &str, state_dir: &Path, ports: Ports, extra: &[&str], env: &[(&str, &str)]) -> Agent {
        Agent::spawn(name, state_dir, ports, extra, env, None)
    }

    /// `nofile`: start the agent under `ulimit -n N` (through `sh`, so no `pre_exec`).
    fn spawn(name: &str, state_dir: &Path, ports: Ports, extra: &[&str], env: &[(&str, &str)], nofile: Option<u64>) -> Agent {
        std::fs::create_dir_all(state_dir).unwrap();
        let log = state_dir.with_extension(format!("{name}.log"));
        let ready = state_dir.with_extension(format!("{name}.ready"));
        let _ = std::fs::remove_file(&log);
        // The agent removes a stale ready file itself, but only once it runs: before that, a
        // restarted agent's old file would read as ready.
        let _ = std::fs::remove_file(&ready);
        let logf = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let mut cmd = match nofile {
            None => Command::new(agent_bin()),
            Some(n) => {
                let mut c = Command::new("sh");
                c.arg("-c").arg(format!("ulimit -n {n} && exec \"$0\" \"$@\"")).arg(agent_bin());
                c
            }
        };
        let child = cmd
            .args(["--node-name", name, "--fabric", "tcp", "--state-dir"])
            .arg(state_dir)
            .arg("--ready-file")
            .arg(&ready)
            .args(["--listen", &format!("127.0.0.1:{}", ports.grpc)])
            .args(["--metrics-listen", &format!("127.0.0.1:{}", ports.metrics)])
            .args(if ports.data == 0 { vec![] } else { vec!["--data-listen".to_string(), format!("127.0.0.1:{}", ports.data)] })
            .args(extra)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(logf)
            .spawn()
            .unwrap();
        let mut a = Agent { name: name.into(), child: Some(child), ports, state_dir: state_dir.to_path_buf(), log, _tmp: None };
        if let Err(logs) = a.wait_ready(&ready) {
            panic!("agent {name} exited early: {logs}");
        }
        a
    }
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.ports.grpc)
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the agent serves: it writes its ready file (the ports it bound, as JSON) only
    /// after binding and serving every listener, and removes a stale one first. Records the
    /// bound ports. `Err(logs)` if the agent exited first.
    fn wait_ready(&mut self, ready: &Path) -> Result<(), String> {
        // A safety net against a hung start, not a synchronisation: readiness is the file.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            // The agent writes the file under a temporary name and renames it: all or nothing.
            if let Ok(text) = std::fs::read_to_string(ready) {
                let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("ready file {text:?}: {e}"));
                let port = |k: &str| -> u16 { v[k].as_str().map(|a| a.parse::<std::net::SocketAddr>().unwrap().port()).unwrap_or(0) };
                self.ports = Ports { grpc: port("grpc"), metrics: port("metrics"), data: port("data"), health: port("health") };
                assert!(self.ports.grpc != 0 && self.ports.metrics != 0, "ready file without ports: {text}");
                return Ok(());
            }
            if let Some(Ok(Some(st))) = self.child.as_mut().map(|c| c.try_wait()) {
                return Err(format!("{st}: {}", self.logs()));
            }
            assert!(Instant::now() < deadline, "agent {} not ready after 60 s: {}", self.name, self.logs());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub async fn client(&self) -> AgentClient<Channel> {
        let ch = Channel::from_shared(format!("http://{}", self.addr())).unwrap().connect().await.unwrap();
        AgentClient::new(ch).max_decoding_message_size(64 << 20)
    }

    pub async fn peer_client(&self) -> PeerClient<Channel> {
        let ch = Channel::from_shared(format!("http://{}", self.addr())).unwrap().connect().await.unwrap();
        PeerClient::new(ch)
    }

    /// Opens a tcp-fabric data stream the way an agent does: `Peer.Connect` as connection
    /// `connection_id` (which hands out the data secret), then a stream presenting that hello.
    pub async fn data_stream(&self, connection_id: &str) -> std::net::TcpStream {
        let (address, secret) = self.data_session(connection_id).await;
        open_data_stream(&address, connection_id, &secret)
    }

    /// `Peer.Connect` (tcp) as connection `connection_id`: the data address and secret.
    pub async fn data_session(&self, connection_id: &str) -> (String, Vec<u8>) {
        let r = self
            .peer_client()
            .await
            .connect(pb::PeerConnectRequest {
                version: 1,
                node_name: "node-a".into(),
                fabric: pb::FabricKind::Tcp as i32,
                endpoints: vec![],
                connection_id: connection_id.into(),
            })
            .await
            .unwrap()
            .into_inner();
        match &r.endpoints[0].kind {
            Some(pb::endpoint::Kind::Tcp(t)) => (t.address.clone(), t.secret.clone()),
            other => panic!("not a tcp endpoint: {other:?}"),
        }
    }

    /// Waits until the agent's log contains `needle` (polled, at most 6000 times 10 ms apart: a
    /// safety net against a hang; the wait is for the line).
    pub async fn wait_log(&self, needle: &str) {
        for _ in 0..6000 {
            if self.logs().contains(needle) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("agent {} never logged {needle:?}: {}", self.name, self.logs());
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGTERM without waiting.
    pub fn sigterm(&self) {
        let pid = self.pid().expect("agent running");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    }

    /// Waits up to `limit` for the process to exit; its exit code, `None` on timeout (still running).
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<Option<i32>> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(Ok(Some(st))) = self.child.as_mut().map(|c| c.try_wait()) {
                self.child = None;
                return Some(st.code());
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM and wait; returns the exit code.
    pub fn terminate(&mut self) -> Option<i32> {
        let mut c = self.child.take()?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            if let Ok(Some(st)) = c.try_wait() {
                return st.code();
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                panic!("agent {} did not exit after SIGTERM: {}", self.name, self.logs());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs xferctl against this agent.
    pub fn ctl(&self, args: &[&str]) -> Output {
        Command::new(xferctl_bin()).arg("--agent").arg(self.addr()).args(args).stdin(Stdio::null()).output().unwrap()
    }

    pub async fn create(&self, name: &str, len: u64, access: pb::Access) -> pb::Region {
        self.client()
            .await
            .create_region(pb::CreateRegionRequest {
                name: name.into(),
                length: len,
                kind: pb::RegionKind::Anonymous as i32,
                access: access as i32,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|s| panic!("create {name}: {s}"))
            .into_inner()
    }

    pub async fn put(&self, region: &str, offset: u64, data: &[u8]) {
        let msgs: Vec<pb::WriteRegionRequest> = data
            .chunks(1 << 20)
            .enumerate()
            .map(|(i, c)| pb::WriteRegionRequest {
                region: if i == 0 { region.into() } else { String::new() },
                offset: if i == 0 { offset } else { 0 },
                data: c.to_vec(),
            })
            .collect();
        self.client().await.write_region(futures::stream::iter(msgs)).await.unwrap();
    }

    pub async fn read(&self, region: &str, offset: u64, len: u64) -> Vec<u8> {
        let mut s = self
            .client()
            .await
            .read_region(pb::ReadRegionRequest { region: region.into(), offset, length: len })
            .await
            .unwrap()
            .into_inner();
        let mut out = Vec::new();
        while let Some(m) = s.message().await.unwrap() {
            out.extend_from_slice(&m.data);
        }
        out
    }

    /// Submits a transfer and waits for its terminal record.
    pub async fn transfer(&self, req: pb::SubmitTransferRequest) -> Result<pb::Transfer, tonic::Status> {
        let mut c = self.client().await;
        let t = c.submit_transfer(req).await?.into_inner();
        let mut w = c.watch_transfer(pb::WatchTransferRequest { id: t.id.clone() }).await?.into_inner();
        let mut last = t;
        while let Some(m) = w.message().await? {
            last = m;
        }
        Ok(last)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
    }
}

pub fn write_req(local: &str, peer: &Agent, remote: &str, len: u64) -> pb::SubmitTransferRequest {
    pb::SubmitTransferRequest {
        notify: None,
        segments: Vec::new(),
        op: pb::Op::Write as i32,
        local: Some(pb::LocalRange { region: local.into(), offset: 0 }),
        remote: Some(pb::RemoteRange { agent: peer.addr(), region: remote.into(), offset: 0 }),
        length: len,
        options: None,
    }
}

pub fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn stderr_lines(o: &Output) -> Vec<String> {
    String::from_utf8_lossy(&o.stderr).lines().filter(|l| !l.trim().is_empty()).map(String::from).collect()
}

/// 4 KiB chunks, one outstanding, one QP: a transfer slow enough to act on while it runs.
pub fn make_slow(req: &mut pb::SubmitTransferRequest) {
    req.options = Some(pb::TransferOptions { chunk_size: 4096, depth: 1, qps: 1, ..Default::default() });
}

/// Waits until the transfer has moved some bytes.
pub async fn wait_progress(a: &Agent, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let t = a.client().await.get_transfer(pb::GetTransferRequest { id: id.into() }).await.unwrap().into_inner();
        if t.bytes_done > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "transfer never progressed: {t:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Follows a transfer to its terminal record.
pub async fn watch_to_end(a: &Agent, id: &str) -> pb::Transfer {
    let mut w = a.client().await.watch_transfer(pb::WatchTransferRequest { id: id.into() }).await.unwrap().into_inner();
    let mut last = None;
    while let Some(m) = w.message().await.unwrap() {
        last = Some(m);
    }
    last.unwrap()
}

/// The agent's default file root (`<state_dir>/files`).
pub fn root_of(a: &Agent) -> PathBuf {
    a.state_dir.join("files")
}

/// CreateRegion for a file region over `path` (relative to a file root).
pub fn file_region_req(name: &str, len: u64, path: &str, access: pb::Access) -> pb::CreateRegionRequest {
    pb::CreateRegionRequest {
        name: name.into(),
        length: len,
        kind: pb::RegionKind::File as i32,
        path: path.into(),
        access: access as i32,
        ..Default::default()
    }
}

/// A tcp grant on `region` for `op` over its first `len` bytes on connection `conn`, asked
/// through the Peer service: (addr, token).
pub async fn grant_token(a: &Agent, region: &str, len: u64, op: pb::Access, conn: &str) -> Result<(u64, [u8; 16]), tonic::Status> {
    let g = a
        .peer_client()
        .await
        .grant(pb::GrantRequest {
            notify: None,
            region: region.into(),
            offset: 0,
            length: len,
            op: op as i32,
            ttl: None,
            node_name: "node-x".into(),
            connection_id: conn.into(),
        })
        .await?
        .into_inner();
    Ok((g.addr, g.token.as_slice().try_into().unwrap()))
}

/// Subscribes to `a`'s notifications (`WatchInbound`); subscribed once this returns.
pub async fn subscribe(a: &Agent, region: &str, tag: Option<&[u8]>) -> tonic::Streaming<pb::Notification> {
    a.client()
        .await
        .watch_inbound(pb::WatchInboundRequest { region: region.into(), tag: tag.map(<[u8]>::to_vec) })
        .await
        .unwrap()
        .into_inner()
}

/// The subscriber's next notification (30 s: a hang guard, not a synchronisation).
pub async fn next_note(s: &mut tonic::Streaming<pb::Notification>) -> pb::Notification {
    tokio::time::timeout(Duration::from_secs(30), s.message()).await.expect("a notification within 30 s").unwrap().expect("stream open")
}

impl Agent {
    /// Starts an agent on `fabric` (`tcp`, `verbs`) with extra environment variables, listening on
    /// 127.0.0.1 like [`Agent::start_env`] (a loopback listener names no RoCE netdev, so a verbs
    /// agent picks each device's GID itself). For the device tests in the Soft-RoCE VM, where
    /// agents run the verbs fabric on the devices the environment names.
    pub fn start_fabric(name: &str, fabric: &str, env: &[(&str, &str)]) -> Agent {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        std::fs::create_dir_all(&state).unwrap();
        let log = state.with_extension(format!("{name}.log"));
        let ready = state.with_extension(format!("{name}.ready"));
        let logf = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let child = Command::new(agent_bin())
            .args(["--node-name", name, "--fabric", fabric, "--state-dir"])
            .arg(&state)
            .arg("--ready-file")
            .arg(&ready)
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(logf)
            .spawn()
            .unwrap();
        let mut a = Agent { name: name.into(), child: Some(child), ports: Ports::new(), state_dir: state, log, _tmp: Some(tmp) };
        // A verbs agent on several emulated devices builds its prebuilt QPs on each before it
        // serves: under TCG on a busy host that took over a minute, past `wait_ready`'s guard.
        // The ready file is the synchronisation; this only bounds a hang.
        let deadline = Instant::now() + Duration::from_secs(600);
        while !ready.exists() {
            if let Some(Ok(Some(st))) = a.child.as_mut().map(|c| c.try_wait()) {
                panic!("agent {name} exited early: {st}: {}", a.logs());
            }
            assert!(Instant::now() < deadline, "agent {name} not ready after 600 s: {}", a.logs());
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Err(logs) = a.wait_ready(&ready) {
            panic!("agent {name} exited early: {logs}");
        }
        a
    }
}
