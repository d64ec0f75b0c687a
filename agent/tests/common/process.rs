//! Agent processes: how a test starts a real `xfer-agent` (one launcher, [`Agent::launch`]),
//! waits until it serves, talks to it and stops it.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tonic::transport::Channel;
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;
use xfer_proto::v1::peer_client::PeerClient;

use super::calls::{read_via, run_via};
use super::wire::open_data_stream;

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

/// How to start an agent process. Every start goes through [`Agent::launch`]; the `start_*`
/// functions name the usual cases.
pub struct Launch<'a> {
    /// `--fabric`: `tcp`, `verbs` or `auto`.
    pub fabric: &'a str,
    pub ports: Ports,
    /// More command-line arguments.
    pub extra: &'a [&'a str],
    /// More environment variables (e.g. `XFER_LIMITS__MAX_REGIONS`, `XFER_VERBS__DEVICES`).
    pub env: &'a [(&'a str, &'a str)],
    /// Start the agent under `ulimit -n N` (soft and hard, through `sh -c 'ulimit -n N; exec …'`,
    /// so no `pre_exec` and the agent's pid is the child's).
    pub nofile: Option<u64>,
    /// How long the start may take before the test gives up: a hang guard, not a
    /// synchronisation (readiness is the ready file).
    pub ready_within: Duration,
}

impl Default for Launch<'_> {
    fn default() -> Self {
        Launch { fabric: "tcp", ports: Ports::new(), extra: &[], env: &[], nofile: None, ready_within: READY_WITHIN }
    }
}

/// The start guard of a tcp agent on the host.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// The start guard of a verbs agent in the Soft-RoCE VM: it builds its prebuilt QPs on each of
/// its devices before it serves, which under TCG on a busy host took over a minute.
const DEVICE_READY_WITHIN: Duration = Duration::from_secs(600);

impl Agent {
    pub fn start(name: &str) -> Agent {
        Agent::launch_temp(name, Launch::default())
    }

    /// Starts an agent with extra environment variables (e.g. `XFER_LIMITS__MAX_REGIONS`).
    pub fn start_env(name: &str, env: &[(&str, &str)]) -> Agent {
        Agent::launch_temp(name, Launch { env, ..Launch::default() })
    }

    pub fn start_with(name: &str, state_dir: &Path, ports: Ports, extra: &[&str]) -> Agent {
        Agent::launch(name, state_dir, Launch { ports, extra, ..Launch::default() })
    }

    /// Starts an agent with extra environment variables under `ulimit -n NOFILE`.
    pub fn start_env_nofile(name: &str, env: &[(&str, &str)], nofile: u64) -> Agent {
        Agent::launch_temp(name, Launch { env, nofile: Some(nofile), ..Launch::default() })
    }

    /// Like [`Agent::start_with`], with extra environment variables (e.g. `XFER_INSECURE`).
    pub fn start_with_env(name: &str, state_dir: &Path, ports: Ports, extra: &[&str], env: &[(&str, &str)]) -> Agent {
        Agent::launch(name, state_dir, Launch { ports, extra, env, ..Launch::default() })
    }

    /// Starts an agent on `fabric` (`tcp`, `verbs`) with extra environment variables, listening on
    /// 127.0.0.1 like [`Agent::start_env`] (a loopback listener names no RoCE netdev, so a verbs
    /// agent picks each device's GID itself). For the device tests in the Soft-RoCE VM, where
    /// agents run the verbs fabric on the devices the environment names: their start may take
    /// [`DEVICE_READY_WITHIN`].
    pub fn start_fabric(name: &str, fabric: &str, env: &[(&str, &str)]) -> Agent {
        Agent::launch_temp(name, Launch { fabric, env, ready_within: DEVICE_READY_WITHIN, ..Launch::default() })
    }

    /// [`Agent::launch`] with its state in a temporary directory the agent owns (removed when it
    /// is dropped).
    fn launch_temp(name: &str, how: Launch) -> Agent {
        let tmp = tempfile::tempdir().unwrap();
        let mut a = Agent::launch(name, &tmp.path().join("state"), how);
        a._tmp = Some(tmp);
        a
    }

    /// Starts agent `name` with its state in `state_dir` (its log and ready file beside it) and
    /// waits until it serves; panics with its log if it exits first.
    pub fn launch(name: &str, state_dir: &Path, how: Launch) -> Agent {
        let Launch { fabric, ports, extra, env, nofile, ready_within } = how;
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
            .args(["--node-name", name, "--fabric", fabric, "--state-dir"])
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
        if let Err(logs) = a.wait_ready(&ready, ready_within) {
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
    /// bound ports. `Err(logs)` if the agent exited first. `within` is a safety net against a
    /// hung start, not a synchronisation: readiness is the file.
    fn wait_ready(&mut self, ready: &Path, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
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
            assert!(Instant::now() < deadline, "agent {} not ready after {within:?}: {}", self.name, self.logs());
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
        read_via(&mut self.client().await, region, offset, len).await
    }

    /// Submits a transfer and waits for its terminal record.
    pub async fn transfer(&self, req: pb::SubmitTransferRequest) -> Result<pb::Transfer, tonic::Status> {
        run_via(&mut self.client().await, req).await
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
    }
}
