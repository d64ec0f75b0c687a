//! The whole configuration: its top-level keys (listeners, fabric, state directory, plaintext or
//! mTLS), its sections, the defaults, and the values derived from them.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use xfer_common::HumanDuration;

use super::error::ConfigError;
use super::limits::LimitsConfig;
use super::perms::{group_gid, FileMode};
use super::regions::RegionsConfig;
use super::sections::{FabricChoice, GrantsConfig, LogConfig, ShutdownConfig, TlsConfig, TransferConfig};
use super::verbs::VerbsConfig;

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
    /// How long binding the unix socket waits for another process's lock on its directory
    /// (agents binding there take turns); a lock held longer is an error at start.
    pub unix_lock_wait: HumanDuration,
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
            unix_lock_wait: HumanDuration(std::time::Duration::from_secs(5)),
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

impl Config {
    /// The verbs fabric's options this configuration asks for.
    pub fn verbs_options(&self) -> xfer_fabric::verbs::VerbsOptions {
        let ip = self.listen.ip();
        xfer_fabric::verbs::VerbsOptions {
            device: Some(self.verbs.device.clone()).filter(|d| !d.is_empty()),
            // Validated at load: an entry that does not parse was refused there.
            devices: self.verbs.device_specs().ok().flatten(),
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

    /// Where the tcp fabric's data listener binds: `data_listen`, else the host of `listen`
    /// with a port the OS picks.
    pub fn data_listen_addr(&self) -> SocketAddr {
        self.data_listen.unwrap_or(SocketAddr::new(self.listen.ip(), 0))
    }

    /// `unix_group` as a gid.
    pub fn unix_gid(&self) -> Result<Option<u32>, ConfigError> {
        group_gid("unix_group", self.unix_group.as_deref())
    }
}
