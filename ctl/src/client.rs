//! Connecting to an agent's gRPC endpoint.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use tonic::transport::Channel;
use xfer_proto::v1::agent_client::AgentClient;

use crate::error::Failure;

/// How long to wait for the TCP (and HTTP/2) connection to an agent.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The generated client for the `xfer.v1.Agent` service.
pub type Client = AgentClient<Channel>;

/// TLS settings from `--cert/--key/--ca` (`--ca` turns TLS on; `--cert` and `--key` add a client
/// certificate, which agents with mTLS require).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub ca: PathBuf,
    /// Overrides the name the agent's certificate is verified against.
    pub server_name: Option<String>,
}

fn read(flag: &str, path: &Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("{flag} {}", path.display()))
}

/// Connects to the agent at `addr` (`host:port`) in plaintext (`xferctl demo`'s own agents).
pub async fn connect(addr: &str) -> anyhow::Result<Client> {
    connect_with(addr, None).await
}

/// Connects to the agent at `addr` (`host:port`, or `unix:///path` for its local socket), over
/// TLS when `tls` is given, through `xfer-client` (the same connection code applications use).
/// Connection problems (including a refused TLS handshake) become [`Failure::Connect`], which
/// exits with the UNAVAILABLE code.
pub async fn connect_with(addr: &str, tls: Option<&TlsFiles>) -> anyhow::Result<Client> {
    let client = match tls {
        None => xfer_client::Client::connect(addr).await,
        Some(t) => {
            let tls = xfer_client::Tls {
                ca_pem: read("--ca", &t.ca)?,
                cert_pem: t.cert.as_deref().map(|p| read("--cert", p)).transpose()?,
                key_pem: t.key.as_deref().map(|p| read("--key", p)).transpose()?,
                server_name: t.server_name.clone(),
            };
            xfer_client::Client::connect_tls(addr, tls).await
        }
    };
    match client {
        Ok(c) => Ok(c.raw()),
        Err(xfer_client::Error::Connect { addr, detail }) => Err(Failure::Connect { addr, reason: plain_reason(detail) }.into()),
        Err(e) => Err(e.into()),
    }
}

/// tonic's bare "transport error" says nothing: name what failed instead.
fn plain_reason(detail: String) -> String {
    if detail.is_empty() || detail == "transport error" {
        "connection failed".to_string()
    } else {
        detail
    }
}
