//! The small sections of the configuration and its choices: `fabric`, `log`, `transfer`, `tls`,
//! `grants` and `shutdown`, each with its defaults.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use xfer_common::{one_of, ByteSize, HumanDuration};

use xfer_fabric::identity::tls::KernelTls;
use xfer_fabric::identity::DnsRole;

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

/// What a verbs agent does when every RDMA path of a connection is lost (`transfer.fallback`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum Fallback {
    /// The transfer fails: nothing silently moves to TCP.
    #[default]
    Never,
    /// The agent also serves its tcp data listener, and every verbs connection carries a tcp
    /// path as a standby, used only when no RDMA path is up.
    Tcp,
}

impl TryFrom<String> for Fallback {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        one_of(&s, &[("never", Fallback::Never), ("tcp", Fallback::Tcp)])
    }
}

impl std::fmt::Display for Fallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Fallback::Never => "never",
            Fallback::Tcp => "tcp",
        })
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
    /// `never` (default) or `tcp`: a verbs agent's tcp standby path (see [`Fallback`]).
    pub fallback: Fallback,
    /// Times a transfer that lost every path of its connection resumes on a fresh connection
    /// and grant with what was left (0: it fails at once).
    pub resume_attempts: u32,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { format: LogFormat::Text, level: "info".into() }
    }
}

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
            fallback: Fallback::Never,
            resume_attempts: 2,
        }
    }
}

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
    /// Who runs the tcp data streams' TLS record layer after the handshake: rustls (`off`), or
    /// the kernel where it can, else rustls (`auto`).
    pub kernel: KernelTls,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct GrantsConfig {
    pub default_ttl: HumanDuration,
    pub max_ttl: HumanDuration,
}

impl Default for GrantsConfig {
    fn default() -> Self {
        GrantsConfig { default_ttl: HumanDuration(Duration::from_secs(600)), max_ttl: HumanDuration(Duration::from_secs(86400)) }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct ShutdownConfig {
    pub grace: HumanDuration,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig { grace: HumanDuration(Duration::from_secs(30)) }
    }
}
