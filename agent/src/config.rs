//! Agent configuration: built-in defaults < config file (TOML or YAML, `--config`) < environment
//! (`XFER_` prefix, `__` between nested keys, e.g. `XFER_TRANSFER__CHUNK_SIZE=4MiB`) < flags.
//!
//! Everything is parsed into validated types (sizes like `4MiB`, durations like `30s`); an
//! invalid value is a [`ConfigError`] naming the key, which the binary reports with exit code 64.

use std::net::SocketAddr;
use std::path::PathBuf;

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use xfer_fabric::verbs::GrantMode;

mod bounds;

#[derive(Debug, thiserror::Error)]
#[error("{key}: {problem}")]
pub struct ConfigError {
    pub key: String,
    pub problem: String,
}

fn bad(key: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError { key: key.to_string(), problem: problem.into() }
}

use xfer_common::one_of;
/// Sizes (`4KiB`, `1.5GiB`, `16Gi`) and durations (`30s`) in the grammar xferctl's flags use too.
pub use xfer_common::{parse_size, ByteSize, HumanDuration};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum FabricChoice {
    Auto,
    Tcp,
    Verbs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum LogFormat {
    Text,
    Json,
}

impl TryFrom<String> for FabricChoice {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        one_of(&s, &[("auto", FabricChoice::Auto), ("tcp", FabricChoice::Tcp), ("verbs", FabricChoice::Verbs)])
    }
}

impl TryFrom<String> for LogFormat {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        one_of(&s, &[("text", LogFormat::Text), ("json", LogFormat::Json)])
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct LogConfig {
    pub format: LogFormat,
    /// tracing filter directive; `RUST_LOG` wins when set.
    pub level: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct TransferConfig {
    pub chunk_size: ByteSize,
    pub depth: usize,
    pub qps: usize,
    /// Signal one WR in this many (0 = a quarter of the transfer's depth: four completions per
    /// window, so a window never drains before its refill is under way).
    pub signal_every: usize,
    pub timeout: HumanDuration,
    /// Most segments one batch may list (SubmitTransfer.segments): RESOURCE_EXHAUSTED above.
    pub max_segments: usize,
    /// Largest notification tag this agent sends or accepts, in bytes.
    pub max_notify_bytes: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct VerbsConfig {
    /// empty = first device with an active port
    pub device: String,
    pub port: u8,
    /// -1 = automatic RoCEv2 IPv4-mapped GID on the netdev that carries the agent's address
    pub gid_index: i32,
    pub grant_mode: GrantMode,
    /// local ACK timeout exponent (4.096 µs × 2^timeout)
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    /// Poll the CQ in a loop while work requests are outstanding (lower latency, one core busy
    /// during transfers); otherwise completions arrive through the completion channel.
    pub busy_poll: bool,
    /// How long the data path busy-polls after its last completion before it sleeps until
    /// woken (0 = never spin): the device's worker thread for channel batches and benchmarks,
    /// a transfer's own task otherwise. Spinning trades a core for latency: a completion within
    /// the budget costs no wake-up.
    pub poll_spin: HumanDuration,
    /// Drive channel batches and benchmarks from one data-path thread per device that posts
    /// their work requests and polls their completion queues itself (no tokio wake-up per
    /// completion). `false`: each batch's own tokio task drives it.
    pub worker: bool,
    /// The CPUs the worker thread is pinned to: `auto` (the device's NUMA node, within the
    /// CPUs this process may run on; unpinned if the device names no node), `off`, or a CPU
    /// list (`3`, `8-15`). On Soft-RoCE one CPU keeps each QP's packets in order, which READs
    /// need (see [`crate::cpus`]).
    pub worker_cpu: crate::cpus::WorkerCpu,
    /// Largest READ work request: longer READ chunks (a `--chunk` above it, a benchmark's large
    /// messages) are posted as several READs of at most this many bytes.
    pub max_read_wr: ByteSize,
    /// Connections of each recently used shape (QP count, depth, initiator or responder) kept
    /// built and in INIT, so a negotiation only draws PSNs and moves QPs to RTR and RTS; one is
    /// rebuilt by the fabric's builder thread (`SCHED_IDLE`) after each is taken. At most 4
    /// shapes and 64 QPs in all are held (about 80-100 KiB each on rxe). 0 = build each
    /// connection while negotiating it.
    pub prebuilt: usize,
    /// RDMA READs outstanding per QP (the initiator depth and the responder resources both
    /// sides offer; a connection uses the smaller of the two agents'). 0 = the device's
    /// maximum, as perftest does (rxe 128, ConnectX 16).
    pub max_rd_atomic: u8,
    /// How long, at most, the responder busy-polls a connection's notification markers after a
    /// grant with a notification (or a channel batch's announcement) on it, until the
    /// notification is published: the last marker is seen within one poll instead of after a
    /// completion-channel wake-up. One core spins while any connection waits. 0 = never.
    pub marker_spin: HumanDuration,
}

pub use crate::identity::{DnsRole, RoleName};

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct TlsConfig {
    /// PEM certificate chain of this agent, presented as server AND as client (to peers).
    pub cert: String,
    /// PEM private key of `cert`.
    pub key: String,
    /// PEM CA bundle: client certificates (xferctl, peers) and peers' server certificates must
    /// chain to it.
    pub ca: String,
    /// Name to verify peers' server certificates against; empty = the host of the peer address.
    pub server_name: String,
    /// Trust domain of role URI SANs (`spiffe://TRUST_DOMAIN/xfer/ROLE/NAME`); empty = any
    /// trust domain that `ca` signs.
    pub trust_domain: String,
    /// Extra DNS-SAN → role mappings, tried when a certificate has no role URI SAN.
    pub dns_roles: Vec<DnsRole>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct LimitsConfig {
    pub max_regions: usize,
    pub max_registered_bytes: ByteSize,
    /// Memory of benchmarks (an admin's `Bench` and `TcpBaseline` buffers and pools, a peer's
    /// `OpenBenchRegion` scratch region, `OpenSink` buffers): a budget of its own, not counted
    /// against `max_registered_bytes`, so a benchmark never makes a client's region fail.
    pub max_bench_bytes: ByteSize,
    pub max_grants_per_peer: usize,
    pub max_transfers: usize,
    pub max_transfers_per_peer: usize,
    pub max_message_size: ByteSize,
    /// Distinct `peer` label values in metrics; further peers are counted as `other`.
    pub max_peer_labels: usize,
    /// Open sockets on the tcp data port, from accept until close (hello or not).
    pub max_data_connections: usize,
    /// Data streams of one identity (a session's owner), counted once the hello names a session.
    pub max_data_connections_per_peer: usize,
    /// Open connections on the gRPC port (enforced as at most a quarter of RLIMIT_NOFILE); further
    /// sockets are closed at once.
    pub max_grpc_connections: usize,
    /// Sockets on the tcp data port still before their hello; at the cap the oldest is closed to
    /// make room, so silent sockets can never keep a real peer's stream out.
    pub max_pending_data_connections: usize,
    /// A data stream must complete its (TLS handshake and) hello within this.
    pub data_handshake_timeout: HumanDuration,
    /// A data stream that sends no frame for this long is closed.
    pub data_idle_timeout: HumanDuration,
    /// A WRITE payload (or a refused one being discarded) must arrive in full within this of its
    /// header, or the stream is closed.
    pub data_payload_timeout: HumanDuration,
    /// Entries in the peer pool (peer agents by address); the least recently used idle one is
    /// evicted.
    pub max_peers: usize,
    /// The gRPC servers (network port and unix socket) ping every connection this often and
    /// close one that does not answer within as long again, with every stream on it (0 = never
    /// ping): what a vanished client held — a notification ring, a channel — is given back.
    pub grpc_keepalive: HumanDuration,
    /// Negotiated connections kept for one peer identity, as responder and as initiator (an
    /// initiator also stays under what the responder advertises).
    pub max_connections_per_peer: usize,
    /// The share (0 < f <= 1) of each global limit one authenticated identity may hold:
    /// transfers and channels, `WatchInbound` subscriptions, regions, registered bytes and a
    /// peer's inbound records. 1 turns shares off.
    pub tenant_share: f64,
}

impl LimitsConfig {
    /// `grpc_keepalive`, `None` when off.
    pub fn grpc_keepalive(&self) -> Option<Duration> {
        Some(self.grpc_keepalive.0).filter(|d| !d.is_zero())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct GrantsConfig {
    pub default_ttl: HumanDuration,
    pub max_ttl: HumanDuration,
}

/// A file mode (permission bits) that reads `"0600"` (octal, as a string) or an integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileMode(pub u32);

impl Serialize for FileMode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{:04o}", self.0))
    }
}

impl<'de> Deserialize<'de> for FileMode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u32),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(FileMode(n)),
            Raw::S(s) => u32::from_str_radix(s.trim().trim_start_matches("0o"), 8)
                .map(FileMode)
                .map_err(|_| serde::de::Error::custom(format!("invalid file mode {s:?}: expected octal like \"0600\""))),
        }
    }
}

/// A list of paths, or one string of comma-separated paths (how the environment carries a list).
fn paths_or_csv<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<PathBuf>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        List(Vec<PathBuf>),
        Csv(String),
    }
    Ok(match Raw::deserialize(d)? {
        Raw::List(v) => v,
        Raw::Csv(s) => s.split(',').map(str::trim).filter(|p| !p.is_empty()).map(PathBuf::from).collect(),
    })
}

/// Where regions may live and who may see shared memory (DESIGN §8, host safety).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct RegionsConfig {
    /// Directories file regions must live under (absolute). A relative `path` is relative to the
    /// first; an absolute one must be inside one of them. Empty = `<state_dir>/files`, created at
    /// start. Env: comma-separated.
    #[serde(deserialize_with = "paths_or_csv")]
    pub file_roots: Vec<PathBuf>,
    /// Permission bits of shm objects the agent creates (set with fchmod, whatever the umask).
    pub shm_mode: FileMode,
    /// Group (name or numeric gid) that created shm objects are given, for applications that must
    /// fill them (use with `shm_mode = "0660"`); unset = the agent's group.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shm_group: Option<String>,
    /// Owner (name or numeric uid) an existing shm object must have to be adopted
    /// (`adopt_existing`); unset = the agent's own uid.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shm_owner: Option<String>,
    /// How often regions that could not be restored from the catalog are retried.
    pub retry_interval: HumanDuration,
    /// Accept file regions whose file has other hard links (`st_nlink > 1`). Off: a hard link
    /// beneath a root to a file outside it is the same inode, and the link count is the only
    /// thing that tells, so such files are refused (PERMISSION_DENIED).
    pub allow_hard_links: bool,
}

impl Default for RegionsConfig {
    fn default() -> Self {
        RegionsConfig {
            file_roots: Vec::new(),
            shm_mode: FileMode(0o600),
            shm_group: None,
            shm_owner: None,
            retry_interval: HumanDuration(Duration::from_secs(10)),
            allow_hard_links: false,
        }
    }
}

impl RegionsConfig {
    /// `file_roots`, or `<state_dir>/files` when none are configured.
    pub fn effective_file_roots(&self, state_dir: &std::path::Path) -> Vec<PathBuf> {
        if self.file_roots.is_empty() {
            vec![state_dir.join("files")]
        } else {
            self.file_roots.clone()
        }
    }

    /// `shm_group` as a gid (a number, or a group name looked up in the group database).
    pub fn shm_gid(&self) -> Result<Option<u32>, ConfigError> {
        group_gid("regions.shm_group", self.shm_group.as_deref())
    }

    /// `shm_owner` as a uid (a number or a user name); unset = the agent's effective uid.
    pub fn shm_owner_uid(&self) -> Result<u32, ConfigError> {
        match self.shm_owner.as_deref().map(str::trim).filter(|u| !u.is_empty()) {
            None => Ok(nix::unistd::geteuid().as_raw()),
            Some(u) => match u.parse::<u32>() {
                Ok(n) => Ok(n),
                Err(_) => match nix::unistd::User::from_name(u) {
                    Ok(Some(user)) => Ok(user.uid.as_raw()),
                    Ok(None) => Err(bad("regions.shm_owner", format!("no user named {u:?}"))),
                    Err(e) => Err(bad("regions.shm_owner", format!("looking up user {u:?}: {e}"))),
                },
            },
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        for (i, r) in self.file_roots.iter().enumerate() {
            if !r.is_absolute() {
                return Err(bad(&format!("regions.file_roots[{i}]"), format!("{} is not an absolute path", r.display())));
            }
        }
        if self.shm_mode.0 & !0o777 != 0 {
            return Err(bad("regions.shm_mode", format!("{:o} has bits beyond 0777 (setuid, setgid, sticky)", self.shm_mode.0)));
        }
        if self.retry_interval.0.is_zero() {
            return Err(bad("regions.retry_interval", "must be greater than zero"));
        }
        self.shm_gid()?;
        self.shm_owner_uid()?;
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct ShutdownConfig {
    pub grace: HumanDuration,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    /// empty = the host name
    pub node_name: String,
    pub listen: SocketAddr,
    pub metrics_listen: SocketAddr,
    /// tcp fabric data listener; unset = the host of `listen` with a port the OS picks, which
    /// peers learn through `Peer.Connect`
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_listen: Option<SocketAddr>,
    /// Plaintext gRPC server with nothing but `grpc.health.v1.Health`, for probes that carry no
    /// client certificate (kubelet); unset = off
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_listen: Option<SocketAddr>,
    /// Once every listener is bound, the agent writes the addresses it bound (ports the OS
    /// picked for port 0 included) to this file as JSON (`app::Bound`); removed at start. Unset =
    /// no file (the "xfer-agent serving" log line carries the same addresses).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready_file: Option<PathBuf>,
    /// A unix socket for applications on this node (`xfer.v1.Agent`, health and reflection; not
    /// `xfer.v1.Peer`), with no TLS: a caller is known by its uid (SO_PEERCRED) and gets the
    /// client role; who may connect is the socket's `unix_mode` and `unix_group`. Unset = off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unix_listen: Option<PathBuf>,
    /// Permission bits of the unix socket (who may connect): owner and group by default.
    pub unix_mode: FileMode,
    /// Group of the unix socket (a name or a gid), so applications in it may connect; unset =
    /// the agent's group.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unix_group: Option<String>,
    pub fabric: FabricChoice,
    pub state_dir: PathBuf,
    /// plaintext gRPC; false = mTLS on both services with the `tls` files
    pub insecure: bool,
    /// Allow plaintext (`insecure = true`) on listeners that are not loopback addresses. Off by
    /// default: a plaintext agent on the network lets anyone call it.
    pub allow_plaintext_network: bool,
    pub log: LogConfig,
    pub transfer: TransferConfig,
    pub verbs: VerbsConfig,
    pub tls: TlsConfig,
    pub limits: LimitsConfig,
    pub grants: GrantsConfig,
    pub regions: RegionsConfig,
    pub shutdown: ShutdownConfig,
}

fn addr(s: &str) -> SocketAddr {
    // Literal constants below; parsing them cannot fail.
    s.parse().unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)))
}

impl Default for Config {
    fn default() -> Self {
        Config {
            node_name: String::new(),
            listen: addr("127.0.0.1:7470"),
            metrics_listen: addr("0.0.0.0:9470"),
            data_listen: None,
            health_listen: None,
            ready_file: None,
            unix_listen: None,
            unix_mode: FileMode(0o660),
            unix_group: None,
            fabric: FabricChoice::Auto,
            state_dir: PathBuf::from("/var/lib/xfer"),
            insecure: true,
            allow_plaintext_network: false,
            log: LogConfig::default(),
            transfer: TransferConfig::default(),
            verbs: VerbsConfig::default(),
            tls: TlsConfig::default(),
            limits: LimitsConfig::default(),
            grants: GrantsConfig::default(),
            regions: RegionsConfig::default(),
            shutdown: ShutdownConfig::default(),
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { format: LogFormat::Text, level: "info".into() }
    }
}

/// Upper bounds of `transfer.max_segments` and `transfer.max_notify_bytes`. A segment costs at
/// most ~35 bytes of a SubmitTransfer message, so the default 65,536 fit gRPC's 4 MiB message
/// limit; the ceiling only keeps a typo from disabling the bound. A tag is metadata, not data.
const MAX_SEGMENTS_CEILING: usize = 1 << 20;
const MAX_NOTIFY_CEILING: usize = 64 << 10;

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            chunk_size: ByteSize(1 << 20),
            depth: 16,
            qps: 2,
            signal_every: 0,
            timeout: HumanDuration(Duration::from_secs(300)),
            max_segments: 65_536,
            max_notify_bytes: 1024,
        }
    }
}

impl Default for VerbsConfig {
    fn default() -> Self {
        // timeout 16 ≈ 268 ms per try; × (1 + retry_cnt 6) ≈ 1.9 s to declare a peer dead.
        VerbsConfig {
            device: String::new(),
            port: 1,
            gid_index: -1,
            grant_mode: GrantMode::Mr,
            timeout: 16,
            retry_cnt: 6,
            rnr_retry: 6,
            busy_poll: false,
            poll_spin: HumanDuration(Duration::from_micros(50)),
            worker: true,
            worker_cpu: crate::cpus::WorkerCpu::Auto,
            max_read_wr: ByteSize(1 << 20),
            prebuilt: 2,
            max_rd_atomic: 0,
            marker_spin: HumanDuration(Duration::from_millis(50)),
        }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_regions: 1024,
            max_registered_bytes: ByteSize(64 << 30),
            max_bench_bytes: ByteSize(1 << 30),
            max_grants_per_peer: 1024,
            max_transfers: 256,
            max_transfers_per_peer: 64,
            max_message_size: ByteSize(16 << 20),
            max_peer_labels: 256,
            max_data_connections: 4096,
            max_data_connections_per_peer: 256,
            max_pending_data_connections: 128,
            max_grpc_connections: 1024,
            data_handshake_timeout: HumanDuration(Duration::from_secs(10)),
            data_idle_timeout: HumanDuration(Duration::from_secs(300)),
            data_payload_timeout: HumanDuration(Duration::from_secs(30)),
            max_peers: 1024,
            grpc_keepalive: HumanDuration(Duration::from_secs(30)),
            max_connections_per_peer: 256,
            tenant_share: 0.5,
        }
    }
}

impl Default for GrantsConfig {
    fn default() -> Self {
        GrantsConfig { default_ttl: HumanDuration(Duration::from_secs(600)), max_ttl: HumanDuration(Duration::from_secs(86400)) }
    }
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig { grace: HumanDuration(Duration::from_secs(30)) }
    }
}

/// Command-line values that override everything else (`None` = not given).
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub node_name: Option<String>,
    pub listen: Option<String>,
    pub metrics_listen: Option<String>,
    pub data_listen: Option<String>,
    pub health_listen: Option<String>,
    pub ready_file: Option<PathBuf>,
    pub fabric: Option<FabricChoice>,
    pub state_dir: Option<PathBuf>,
    pub log_format: Option<LogFormat>,
    pub device: Option<String>,
}

impl Config {
    /// Layers defaults < file < environment (`env` pairs, normally `std::env::vars()`) < flags.
    pub fn load(
        file: Option<&std::path::Path>,
        env: impl IntoIterator<Item = (String, String)>,
        flags: &Overrides,
    ) -> Result<Config, ConfigError> {
        let defaults = ::config::Config::try_from(&Config::default()).map_err(|e| bad("defaults", e.to_string()))?;
        let mut b = ::config::Config::builder().add_source(defaults);
        if let Some(path) = file {
            if !path.exists() {
                return Err(bad("config", format!("file {} does not exist", path.display())));
            }
            b = b.add_source(::config::File::from(path));
        }
        // Nested variables (`XFER_SECTION__KEY`) must name a known key; a single-level `XFER_X` is
        // read only when X is a top-level key (others belong to other tools: xferctl's
        // XFER_AGENT/XFER_CERT, test harnesses), so the check below never sees them.
        let known = known_keys();
        let env: std::collections::HashMap<String, String> = env
            .into_iter()
            .filter(|(k, _)| match k.strip_prefix("XFER_") {
                Some(rest) => rest.contains("__") || known.contains(&rest.to_lowercase()),
                None => false,
            })
            .collect();
        let env_names: Vec<String> = env.keys().cloned().collect();
        b = b.add_source(::config::Environment::with_prefix("XFER").prefix_separator("_").separator("__").source(Some(env)));
        let set = |b: ::config::ConfigBuilder<::config::builder::DefaultState>, k: &str, v: Option<String>| match v {
            Some(v) => b.set_override(k, v).map_err(|e| bad(k, e.to_string())),
            None => Ok(b),
        };
        b = set(b, "node_name", flags.node_name.clone())?;
        b = set(b, "listen", flags.listen.clone())?;
        b = set(b, "metrics_listen", flags.metrics_listen.clone())?;
        b = set(b, "data_listen", flags.data_listen.clone())?;
        b = set(b, "health_listen", flags.health_listen.clone())?;
        b = set(b, "ready_file", flags.ready_file.as_ref().map(|p| p.display().to_string()))?;
        b = set(b, "fabric", flags.fabric.map(|f| format!("{f:?}").to_lowercase()))?;
        b = set(b, "state_dir", flags.state_dir.as_ref().map(|p| p.display().to_string()))?;
        b = set(b, "log.format", flags.log_format.map(|f| format!("{f:?}").to_lowercase()))?;
        b = set(b, "verbs.device", flags.device.clone())?;
        let built = b.build().map_err(config_error)?;
        // Unknown keys are errors, not silently ignored: `[limit]`, `chunksize` or
        // XFER_TRANFER__DEPTH would otherwise load and leave the defaults in force.
        let merged: serde_json::Value = built.clone().try_deserialize().map_err(config_error)?;
        if let Some(key) = unknown_keys(&merged, &known).into_iter().next() {
            let env_name = format!("XFER_{}", key.to_uppercase().replace('.', "__"));
            let from = if env_names.iter().any(|n| n == &env_name) {
                format!("environment variable {env_name}")
            } else {
                "the config file".to_string()
            };
            let hint = closest_key(&key, &known).map(|k| format!("; did you mean `{k}`?")).unwrap_or_default();
            return Err(bad(&key, format!("unknown key (from {from}){hint}")));
        }
        let mut cfg: Config = built.try_deserialize().map_err(config_error)?;
        if cfg.node_name.is_empty() {
            cfg.node_name = nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_else(|| "localhost".into());
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// The verbs fabric's options this configuration asks for.
    pub fn verbs_options(&self) -> xfer_fabric::verbs::VerbsOptions {
        let ip = self.listen.ip();
        xfer_fabric::verbs::VerbsOptions {
            device: Some(self.verbs.device.clone()).filter(|d| !d.is_empty()),
            port: self.verbs.port,
            gid_index: u32::try_from(self.verbs.gid_index).ok(),
            // Neither an unspecified nor a loopback listener (the default) names a RoCE netdev.
            bind_ip: (!ip.is_unspecified() && !ip.is_loopback()).then_some(ip),
            timeout: self.verbs.timeout,
            retry_cnt: self.verbs.retry_cnt,
            rnr_retry: self.verbs.rnr_retry,
            busy_poll: self.verbs.busy_poll,
            grant_mode: self.verbs.grant_mode,
            prebuilt: self.verbs.prebuilt,
            expected_shape: Some((self.transfer.qps, self.transfer.depth)),
            max_rd_atomic: self.verbs.max_rd_atomic,
            marker_spin: self.verbs.marker_spin.0,
            ..xfer_fabric::verbs::VerbsOptions::default()
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        // Every duration and size first: nothing accepted may overflow a deadline or a sum later.
        bounds::check(self)?;
        let t = &self.transfer;
        crate::shape::chunk(t.chunk_size.0)
            .map_err(|_| bad("transfer.chunk_size", format!("must be between 1 and {}", ByteSize(crate::shape::MAX_CHUNK))))?;
        crate::shape::depth(t.depth).map_err(|e| bad("transfer.depth", e.to_string()))?;
        crate::shape::qps(t.qps).map_err(|e| bad("transfer.qps", e.to_string()))?;
        if !(1..=MAX_SEGMENTS_CEILING).contains(&t.max_segments) {
            return Err(bad("transfer.max_segments", format!("must be between 1 and {MAX_SEGMENTS_CEILING}")));
        }
        if t.max_notify_bytes > MAX_NOTIFY_CEILING {
            return Err(bad("transfer.max_notify_bytes", format!("must be at most {MAX_NOTIFY_CEILING}")));
        }
        // The verbs fabric's own checks (one place for the retry and timeout bounds).
        self.verbs_options().validate().map_err(|e| match e {
            xfer_fabric::FabricError::Negotiation { attr, detail, .. } => bad(&format!("verbs.{attr}"), detail),
            other => bad("verbs", other.to_string()),
        })?;
        if !(4096..=crate::shape::MAX_CHUNK).contains(&self.verbs.max_read_wr.0) {
            return Err(bad("verbs.max_read_wr", format!("must be between 4KiB and {}", ByteSize(crate::shape::MAX_CHUNK))));
        }
        if let crate::cpus::WorkerCpu::Cpus(_) = self.verbs.worker_cpu {
            // Only CPUs this process may run on (its affinity mask, which a cpuset narrows).
            let allowed = crate::cpus::allowed().map_err(|e| bad("verbs.worker_cpu", e))?;
            crate::cpus::choose(&self.verbs.worker_cpu, &allowed, None).map_err(|e| bad("verbs.worker_cpu", e))?;
        }
        if self.verbs.gid_index < -1 {
            return Err(bad("verbs.gid_index", "must be -1 (auto) or a GID table index"));
        }
        if !self.insecure {
            for (key, path) in [("tls.cert", &self.tls.cert), ("tls.key", &self.tls.key), ("tls.ca", &self.tls.ca)] {
                if path.is_empty() {
                    return Err(bad(key, "is required when insecure = false (mTLS)"));
                }
                if !std::path::Path::new(path).is_file() {
                    return Err(bad(key, format!("file {path} does not exist")));
                }
            }
        }
        if self.node_name.is_empty() || self.node_name.len() > 253 {
            return Err(bad("node_name", "must be 1-253 characters"));
        }
        if self.limits.max_peer_labels == 0 {
            return Err(bad("limits.max_peer_labels", "must be at least 1"));
        }
        for (key, v) in [
            ("limits.max_data_connections", self.limits.max_data_connections),
            ("limits.max_data_connections_per_peer", self.limits.max_data_connections_per_peer),
            ("limits.max_pending_data_connections", self.limits.max_pending_data_connections),
            ("limits.max_grpc_connections", self.limits.max_grpc_connections),
            ("limits.max_peers", self.limits.max_peers),
            ("limits.max_connections_per_peer", self.limits.max_connections_per_peer),
        ] {
            if v == 0 {
                return Err(bad(key, "must be at least 1"));
            }
        }
        if self.limits.max_connections_per_peer > 4096 {
            return Err(bad("limits.max_connections_per_peer", "must be at most 4096"));
        }
        let share = self.limits.tenant_share;
        if !(share > 0.0 && share <= 1.0) {
            return Err(bad("limits.tenant_share", format!("must be a fraction in (0, 1], not {share}")));
        }
        for (key, v) in [
            ("limits.data_handshake_timeout", self.limits.data_handshake_timeout.0),
            ("limits.data_idle_timeout", self.limits.data_idle_timeout.0),
            ("limits.data_payload_timeout", self.limits.data_payload_timeout.0),
        ] {
            if v.is_zero() {
                return Err(bad(key, "must be longer than 0"));
            }
        }
        for (i, r) in self.tls.dns_roles.iter().enumerate() {
            crate::identity::check_dns_pattern(&r.pattern).map_err(|e| bad(&format!("tls.dns_roles[{i}].pattern"), e))?;
        }
        if !self.tls.trust_domain.is_empty() {
            crate::identity::check_trust_domain(&self.tls.trust_domain).map_err(|e| bad("tls.trust_domain", e))?;
        }
        self.regions.validate()?;
        if self.unix_mode.0 & !0o777 != 0 {
            return Err(bad("unix_mode", format!("{:o} has bits beyond 0777 (setuid, setgid, sticky)", self.unix_mode.0)));
        }
        self.unix_gid()?;
        self.check_plaintext()
    }

    /// Where the tcp fabric's data listener binds: `data_listen`, else the host of `listen`
    /// with a port the OS picks.
    pub fn data_listen_addr(&self) -> SocketAddr {
        self.data_listen.unwrap_or(SocketAddr::new(self.listen.ip(), 0))
    }

    /// Secure by default: plaintext only where nobody else can connect (loopback), unless the
    /// operator opts in with `allow_plaintext_network`. Metrics and the health listener serve
    /// nothing that changes state or reveals data and are not checked.
    fn check_plaintext(&self) -> Result<(), ConfigError> {
        if !self.insecure || self.allow_plaintext_network {
            return Ok(());
        }
        for (key, a) in [("listen", self.listen), ("data_listen", self.data_listen_addr())] {
            if !a.ip().is_loopback() {
                return Err(bad(
                    "allow_plaintext_network",
                    format!(
                        "plaintext gRPC (insecure = true) with {key} = {a}, which is not a loopback address: \
                         anyone who reaches it could read and write this node's memory. Turn on mTLS \
                         (insecure = false with tls.cert, tls.key, tls.ca), listen on 127.0.0.1, or set \
                         allow_plaintext_network = true (env XFER_ALLOW_PLAINTEXT_NETWORK=true) to accept that"
                    ),
                ));
            }
        }
        Ok(())
    }

    pub fn to_toml(&self) -> String {
        toml_like(self)
    }
}

/// A group setting as a gid: a number, or a group name looked up in the group database.
fn group_gid(key: &str, group: Option<&str>) -> Result<Option<u32>, ConfigError> {
    match group.map(str::trim).filter(|g| !g.is_empty()) {
        None => Ok(None),
        Some(g) => match g.parse::<u32>() {
            // (gid_t)-1 is chown's "leave the group as it is": the group asked for would silently
            // not be given.
            Ok(u32::MAX) => Err(bad(key, format!("{g} is not a group id (chown reads it as \"no change\")"))),
            Ok(n) => Ok(Some(n)),
            Err(_) => match nix::unistd::Group::from_name(g) {
                Ok(Some(grp)) => Ok(Some(grp.gid.as_raw())),
                Ok(None) => Err(bad(key, format!("no group named {g:?}"))),
                Err(e) => Err(bad(key, format!("looking up group {g:?}: {e}"))),
            },
        },
    }
}

impl Config {
    /// `unix_group` as a gid.
    pub fn unix_gid(&self) -> Result<Option<u32>, ConfigError> {
        group_gid("unix_group", self.unix_group.as_deref())
    }
}

/// Every key the configuration has, as dotted paths (`transfer.depth`), sections included.
fn known_keys() -> std::collections::BTreeSet<String> {
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut std::collections::BTreeSet<String>) {
        if let serde_json::Value::Object(m) = v {
            for (k, v) in m {
                let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                walk(&path, v, out);
                out.insert(path);
            }
        }
    }
    // The defaults with every optional key set: keys that are `None` by default are skipped
    // when serializing (`skip_serializing_if`, for --print-config's TOML) and would look unknown.
    // A new optional key must be filled here too; the config tests set each of them.
    let mut every = Config::default();
    every.data_listen = Some(every.listen);
    every.health_listen = Some(every.listen);
    every.ready_file = Some(PathBuf::from("ready"));
    every.unix_listen = Some(PathBuf::from("agent.sock"));
    every.unix_group = Some(String::new());
    every.regions.shm_group = Some(String::new());
    every.regions.shm_owner = Some(String::new());
    let mut out = std::collections::BTreeSet::new();
    // Serializing plain structs, strings and numbers cannot fail; an empty set would only make
    // every key unknown, which the tests would show at once.
    if let Ok(v) = serde_json::to_value(every) {
        walk("", &v, &mut out);
    }
    out
}

/// Keys in `merged` that the configuration does not have. Values of known leaves (strings,
/// lists such as `tls.dns_roles`) are not looked into.
fn unknown_keys(merged: &serde_json::Value, known: &std::collections::BTreeSet<String>) -> Vec<String> {
    fn walk(prefix: &str, v: &serde_json::Value, known: &std::collections::BTreeSet<String>, out: &mut Vec<String>) {
        let serde_json::Value::Object(m) = v else { return };
        for (k, v) in m {
            let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
            match v {
                // An unknown table is reported by its keys (`tranfer.depth`, which names the
                // variable XFER_TRANFER__DEPTH and is closest to `transfer.depth`).
                serde_json::Value::Object(inner) if !known.contains(&path) && !inner.is_empty() => walk(&path, v, &Default::default(), out),
                _ if known.contains(&path) => walk(&path, v, known, out),
                _ => out.push(path),
            }
        }
    }
    let mut out = Vec::new();
    walk("", merged, known, &mut out);
    out
}

/// The known key closest to `key` (by the whole path or by its last part), if one is close.
fn closest_key(key: &str, known: &std::collections::BTreeSet<String>) -> Option<String> {
    let last = |s: &str| s.rsplit('.').next().unwrap_or(s).to_string();
    let (k_last, k_flat) = (last(key), key.replace('_', ""));
    known
        .iter()
        .map(|p| {
            let d = strsim::levenshtein(key, p)
                .min(strsim::levenshtein(&k_last, &last(p)))
                .min(strsim::levenshtein(&k_flat, &last(p).replace('_', "")));
            (d, p)
        })
        .filter(|(d, _)| *d <= 2.max(k_last.len() / 3))
        .min_by_key(|(d, p)| (*d, p.len()))
        .map(|(_, p)| p.clone())
}

fn config_error(e: ::config::ConfigError) -> ConfigError {
    use ::config::ConfigError as E;
    match e {
        E::Type { key: Some(ref key), .. } | E::At { key: Some(ref key), .. } => {
            let text = e.to_string();
            // The key is printed in front already.
            bad(key, text.split(" for key `").next().unwrap_or(&text))
        }
        E::Message(m) => {
            // serde messages look like "invalid size \"x\"... for key `transfer.chunk_size`"
            let key = m.split("for key `").nth(1).and_then(|r| r.split('`').next()).unwrap_or("config").to_string();
            // The key is printed in front already.
            let m = m.split(" for key `").next().unwrap_or(&m).to_string();
            bad(&key, m)
        }
        other => bad("config", other.to_string()),
    }
}

/// Effective configuration in the config file's own format (TOML), so it can be saved and reused.
/// `toml` is already in the tree through the `config` crate.
fn toml_like(c: &Config) -> String {
    toml::to_string_pretty(c).unwrap_or_else(|e| format!("# cannot render configuration: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert!(parse_size("").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("99999999999TiB").is_err());
        assert_eq!(ByteSize(64 << 20).to_string(), "64MiB");
    }

    /// A key the configuration does not have is an error naming it, where it came from and the
    /// closest known key — never silently ignored with the default left in force.
    #[test]
    fn unknown_keys_are_refused_with_the_closest_known_key() {
        let dir = tempfile::tempdir().unwrap();
        let load_file = |text: &str| {
            let f = dir.path().join("agent.toml");
            std::fs::write(&f, text).unwrap();
            Config::load(Some(&f), Vec::new(), &Overrides::default())
        };
        for (text, key, closest) in [
            ("[limit]\nmax_regions = 3\n", "limit.max_regions", "limits.max_regions"),
            ("chunksize = \"1MiB\"\n", "chunksize", "transfer.chunk_size"),
            ("[transfer]\ndept = 3\n", "transfer.dept", "transfer.depth"),
            ("[verbs]\ngrantmode = \"mw\"\n", "verbs.grantmode", "verbs.grant_mode"),
        ] {
            let e = load_file(text).unwrap_err();
            assert_eq!(e.key, key, "{text}: {e}");
            assert!(e.problem.contains("the config file") && e.problem.contains(&format!("did you mean `{closest}`")), "{text}: {e}");
        }
        let env = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        let e = Config::load(None, env("XFER_TRANFER__DEPTH", "8"), &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "tranfer.depth");
        assert!(e.problem.contains("environment variable XFER_TRANFER__DEPTH") && e.problem.contains("`transfer.depth`"), "{e}");
        // Nothing like a known key: no suggestion.
        let e = load_file("zzzzzzzzzz = 1\n").unwrap_err();
        assert!(!e.problem.contains("did you mean"), "{e}");
        // Single-level XFER_ variables that are not keys belong to other tools and are ignored.
        let others =
            vec![("XFER_AGENT".into(), "h:1".into()), ("XFER_CERT".into(), "c.pem".into()), ("XFER_RXE_A_DEV".into(), "rxe0".into())];
        assert!(Config::load(None, others, &Overrides::default()).is_ok());
        // Every optional key is known (they are skipped when None in --print-config).
        let f = dir.path().join("all.toml");
        std::fs::write(
            &f,
            "data_listen = \"127.0.0.1:0\"\nhealth_listen = \"127.0.0.1:0\"\nready_file = \"r.json\"\n[regions]\nshm_owner = \"\"\n",
        )
        .unwrap();
        Config::load(Some(&f), Vec::new(), &Overrides::default()).unwrap();
    }

    #[test]
    fn enum_values_are_refused_with_their_choices() {
        let env = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        let e = Config::load(None, env("XFER_FABRIC", "tpc"), &Overrides::default()).unwrap_err();
        assert_eq!((e.key.as_str(), e.problem.as_str()), ("fabric", "\"tpc\" is not one of: auto, tcp, verbs"));
        let e = Config::load(None, env("XFER_VERBS__GRANT_MODE", "window"), &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "verbs.grant_mode");
        assert!(e.problem.contains("mr, mw, region"), "{e}");
        let e = Config::load(None, env("XFER_LOG__FORMAT", "yaml"), &Overrides::default()).unwrap_err();
        assert!(e.problem.contains("text, json"), "{e}");
        // Case does not matter, as before.
        assert_eq!(Config::load(None, env("XFER_FABRIC", "TCP"), &Overrides::default()).unwrap().fabric, FabricChoice::Tcp);
    }

    #[test]
    fn layering_defaults_file_env_flags() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(&f, "node_name = \"from-file\"\n[transfer]\nchunk_size = \"2MiB\"\ndepth = 4\n").unwrap();
        let env = vec![("XFER_TRANSFER__DEPTH".to_string(), "8".to_string())];
        let c = Config::load(Some(&f), env.clone(), &Overrides::default()).unwrap();
        assert_eq!(c.node_name, "from-file");
        assert_eq!(c.transfer.chunk_size, ByteSize(2 << 20));
        assert_eq!(c.transfer.depth, 8, "env beats file");
        assert_eq!(c.transfer.qps, 2, "default");
        let flags = Overrides { node_name: Some("from-flag".into()), ..Default::default() };
        let c = Config::load(Some(&f), env, &flags).unwrap();
        assert_eq!(c.node_name, "from-flag");
    }

    #[test]
    fn worker_cpu_is_auto_off_or_cpus_this_process_may_run_on() {
        use crate::cpus::WorkerCpu;
        let one = |c: usize| WorkerCpu::Cpus([c].into_iter().collect());
        let env = |v: &str| vec![("XFER_VERBS__WORKER_CPU".to_string(), v.to_string())];
        assert_eq!(Config::load(None, vec![], &Overrides::default()).unwrap().verbs.worker_cpu, WorkerCpu::Auto, "default");
        assert_eq!(Config::load(None, env("off"), &Overrides::default()).unwrap().verbs.worker_cpu, WorkerCpu::Off);
        let &cpu = crate::cpus::allowed().unwrap().last().unwrap();
        assert_eq!(Config::load(None, env(&cpu.to_string()), &Overrides::default()).unwrap().verbs.worker_cpu, one(cpu));
        // A file's integer, as TOML writes it, and the printed form loads back.
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("agent.toml");
        std::fs::write(&f, format!("[verbs]\nworker_cpu = {cpu}\n")).unwrap();
        let c = Config::load(Some(&f), vec![], &Overrides::default()).unwrap();
        assert_eq!(c.verbs.worker_cpu, one(cpu));
        assert!(c.to_toml().contains(&format!("worker_cpu = \"{cpu}\"")), "{}", c.to_toml());
        // Not a setting, past the mask type, or a CPU outside this process's mask: refused,
        // naming the key.
        for v in ["fast", "-1", "1024", "3-1", ""] {
            let e = Config::load(None, env(v), &Overrides::default()).unwrap_err();
            assert!(e.to_string().contains("worker_cpu"), "{v}: {e}");
        }
        if !crate::cpus::allowed().unwrap().contains(&crate::cpus::MAX_CPU) {
            let e = Config::load(None, env(&crate::cpus::MAX_CPU.to_string()), &Overrides::default()).unwrap_err();
            assert_eq!(e.key, "verbs.worker_cpu");
            assert!(e.problem.contains("may run on"), "{e}");
            // One CPU outside the mask spoils a list.
            let e = Config::load(None, env(&format!("{cpu},{}", crate::cpus::MAX_CPU)), &Overrides::default()).unwrap_err();
            assert_eq!(e.key, "verbs.worker_cpu");
        }
    }

    #[test]
    fn printed_config_loads_back_unchanged() {
        let c = Config::load(None, Vec::new(), &Overrides { node_name: Some("n1".into()), ..Default::default() }).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("printed.toml");
        std::fs::write(&f, c.to_toml()).unwrap();
        let back = Config::load(Some(&f), Vec::new(), &Overrides::default()).unwrap();
        assert_eq!(back.to_toml(), c.to_toml());
        assert!(c.to_toml().contains("chunk_size = \"1MiB\""), "{}", c.to_toml());
    }

    #[test]
    fn exhaustion_limits_load_from_env_and_refuse_zero() {
        let env = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
        let c = Config::load(None, env(&[]), &Overrides::default()).unwrap();
        assert_eq!(c.limits.max_data_connections, 4096);
        assert_eq!(c.limits.max_data_connections_per_peer, 256);
        assert_eq!(c.limits.max_pending_data_connections, 128);
        assert_eq!(c.limits.max_grpc_connections, 1024);
        assert_eq!(c.limits.data_handshake_timeout.0, Duration::from_secs(10));
        assert_eq!(c.limits.data_idle_timeout.0, Duration::from_secs(300));
        assert_eq!(c.limits.data_payload_timeout.0, Duration::from_secs(30));
        assert_eq!(c.limits.grpc_keepalive(), Some(Duration::from_secs(30)));
        assert_eq!(c.limits.max_peers, 1024);
        let c = Config::load(
            None,
            env(&[
                ("XFER_LIMITS__DATA_IDLE_TIMEOUT", "200ms"),
                ("XFER_LIMITS__DATA_PAYLOAD_TIMEOUT", "300ms"),
                ("XFER_LIMITS__MAX_DATA_CONNECTIONS_PER_PEER", "4"),
            ]),
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!(c.limits.data_idle_timeout.0, Duration::from_millis(200));
        assert_eq!(c.limits.data_payload_timeout.0, Duration::from_millis(300));
        assert_eq!(c.limits.max_data_connections_per_peer, 4);
        for key in ["MAX_DATA_CONNECTIONS", "MAX_DATA_CONNECTIONS_PER_PEER", "MAX_PEERS"] {
            let e = Config::load(None, env(&[(&format!("XFER_LIMITS__{key}"), "0")]), &Overrides::default()).unwrap_err();
            assert_eq!(e.key, format!("limits.{}", key.to_lowercase()));
        }
        for key in ["DATA_HANDSHAKE_TIMEOUT", "DATA_IDLE_TIMEOUT", "DATA_PAYLOAD_TIMEOUT"] {
            let e = Config::load(None, env(&[(&format!("XFER_LIMITS__{key}"), "0s")]), &Overrides::default()).unwrap_err();
            assert_eq!(e.key, format!("limits.{}", key.to_lowercase()));
        }
    }

    #[test]
    fn invalid_values_name_the_key() {
        let env = vec![("XFER_TRANSFER__CHUNK_SIZE".to_string(), "lots".to_string())];
        let e = Config::load(None, env, &Overrides::default()).unwrap_err();
        assert!(e.to_string().contains("chunk_size"), "{e}");
        let env = vec![("XFER_VERBS__RETRY_CNT".to_string(), "7".to_string())];
        let e = Config::load(None, env, &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "verbs.retry_cnt");
        for v in ["1KiB", "1GiB"] {
            let env = vec![("XFER_VERBS__MAX_READ_WR".to_string(), v.to_string())];
            let e = Config::load(None, env, &Overrides::default()).unwrap_err();
            assert_eq!(e.key, "verbs.max_read_wr", "{v}");
        }
        let env = vec![("XFER_VERBS__MAX_READ_WR".to_string(), "256KiB".to_string())];
        assert_eq!(Config::load(None, env, &Overrides::default()).unwrap().verbs.max_read_wr, ByteSize(256 << 10));
        assert_eq!(
            Config::load(None, vec![], &Overrides::default()).unwrap().verbs_options().max_rd_atomic,
            0,
            "default: the device's maximum"
        );
        let env = vec![("XFER_VERBS__MAX_RD_ATOMIC".to_string(), "8".to_string())];
        assert_eq!(Config::load(None, env, &Overrides::default()).unwrap().verbs_options().max_rd_atomic, 8);
        let env = vec![("XFER_VERBS__PREBUILT".to_string(), "17".to_string())];
        let e = Config::load(None, env, &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "verbs.prebuilt");
        for (v, want) in [("0", 0), ("16", 16)] {
            let env = vec![("XFER_VERBS__PREBUILT".to_string(), v.to_string())];
            assert_eq!(Config::load(None, env, &Overrides::default()).unwrap().verbs_options().prebuilt, want);
        }
    }

    #[test]
    fn regions_keys() {
        let env = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
        let c = Config::load(None, env(&[]), &Overrides::default()).unwrap();
        assert_eq!(c.regions.shm_mode, FileMode(0o600));
        assert_eq!(c.regions.effective_file_roots(std::path::Path::new("/s")), vec![PathBuf::from("/s/files")]);
        assert_eq!(c.regions.shm_gid().unwrap(), None);
        let c = Config::load(
            None,
            env(&[("XFER_REGIONS__FILE_ROOTS", "/data/a,/data/b"), ("XFER_REGIONS__SHM_MODE", "0660"), ("XFER_REGIONS__SHM_GROUP", "0")]),
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!(c.regions.file_roots, vec![PathBuf::from("/data/a"), PathBuf::from("/data/b")]);
        assert_eq!(c.regions.shm_mode, FileMode(0o660));
        assert_eq!(c.regions.shm_gid().unwrap(), Some(0));
        assert!(c.to_toml().contains("shm_mode = \"0660\""), "{}", c.to_toml());
        let e = Config::load(None, env(&[("XFER_REGIONS__FILE_ROOTS", "relative/dir")]), &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "regions.file_roots[0]");
        let e = Config::load(None, env(&[("XFER_REGIONS__SHM_MODE", "4755")]), &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "regions.shm_mode");
        let e = Config::load(None, env(&[("XFER_REGIONS__SHM_GROUP", "no-such-group-xfer")]), &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "regions.shm_group");
        // (gid_t)-1 would be chown's "no change": refused, not silently ignored.
        let e = Config::load(None, env(&[("XFER_REGIONS__SHM_GROUP", "4294967295")]), &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "regions.shm_group");
    }

    #[test]
    fn tls_requires_all_three_files() {
        let dir = tempfile::tempdir().unwrap();
        let env = |pairs: &[(&str, &str)]| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
        let c = Config::load(None, env(&[]), &Overrides::default()).unwrap();
        assert!(c.insecure, "plaintext stays the default");
        let e = Config::load(None, env(&[("XFER_INSECURE", "false")]), &Overrides::default()).unwrap_err();
        assert_eq!(e.key, "tls.cert");
        let f = |n: &str| {
            let p = dir.path().join(n);
            std::fs::write(&p, "x").unwrap();
            p.display().to_string()
        };
        let (cert, key) = (f("a.crt"), f("a.key"));
        let e = Config::load(
            None,
            env(&[("XFER_INSECURE", "false"), ("XFER_TLS__CERT", &cert), ("XFER_TLS__KEY", &key), ("XFER_TLS__CA", "/nonexistent/ca.crt")]),
            &Overrides::default(),
        )
        .unwrap_err();
        assert_eq!(e.key, "tls.ca");
        assert!(e.to_string().contains("/nonexistent/ca.crt"), "{e}");
        let ca = f("ca.crt");
        let c = Config::load(
            None,
            env(&[("XFER_INSECURE", "false"), ("XFER_TLS__CERT", &cert), ("XFER_TLS__KEY", &key), ("XFER_TLS__CA", &ca)]),
            &Overrides::default(),
        )
        .unwrap();
        assert!(!c.insecure);
    }
}
