//! Connecting to an agent's gRPC endpoint.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
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

impl TlsFiles {
    fn client_config(&self, addr: &str) -> anyhow::Result<ClientTlsConfig> {
        let mut cfg = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read("--ca", &self.ca)?))
            .domain_name(
                self.server_name
                    .clone()
                    .unwrap_or_else(|| host_of(addr).to_string()),
            );
        if let (Some(cert), Some(key)) = (&self.cert, &self.key) {
            cfg = cfg.identity(Identity::from_pem(
                read("--cert", cert)?,
                read("--key", key)?,
            ));
        }
        Ok(cfg)
    }
}

/// The host of `host:port` or `[v6]:port`, without brackets.
fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    addr.rsplit_once(':').map_or(addr, |(h, _)| h)
}

/// Connects to the agent at `addr` (`host:port`) in plaintext (`xferctl demo`'s own agents).
pub async fn connect(addr: &str) -> anyhow::Result<Client> {
    connect_with(addr, None).await
}

/// Connects to the agent at `addr` (`host:port`), over TLS when `tls` is given. Connection
/// problems (including a refused TLS handshake) become [`Failure::Connect`], which exits with the
/// UNAVAILABLE code.
pub async fn connect_with(addr: &str, tls: Option<&TlsFiles>) -> anyhow::Result<Client> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .map_err(|e| anyhow::anyhow!("invalid agent address {addr:?}: {e}"))?;
    if let Some(t) = tls {
        endpoint = endpoint
            .tls_config(t.client_config(addr)?)
            .map_err(|e| anyhow::anyhow!("TLS settings: {}", root_cause(&e)))?;
    }
    let channel = endpoint
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .connect()
        .await
        .map_err(|e| Failure::Connect {
            addr: addr.to_string(),
            reason: root_cause(&e),
        })?;
    // Large ReadRegion/WriteRegion messages (1 MiB of data plus framing) exceed tonic's 4 MiB
    // default only if an agent chose bigger chunks; allow generous limits anyway.
    Ok(AgentClient::new(channel)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20))
}

/// The innermost error message, e.g. "Connection refused (os error 111)" instead of tonic's
/// "transport error".
fn root_cause(err: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = err;
    while let Some(next) = cur.source() {
        cur = next;
    }
    let text = cur.to_string();
    if text.is_empty() || text == "transport error" {
        "connection failed".to_string()
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn host_of() {
        assert_eq!(super::host_of("127.0.0.1:7470"), "127.0.0.1");
        assert_eq!(super::host_of("[::1]:7470"), "::1");
        assert_eq!(super::host_of("node-b:7470"), "node-b");
    }
}
