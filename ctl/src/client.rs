//! Connecting to an agent's gRPC endpoint.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// Every command talks to agents through the client crate applications use.
pub use xfer_client::Client;

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
/// Connection problems (including a refused TLS handshake) are the client's `Error::Connect`,
/// which [`crate::error::report`] renders and exits with the UNAVAILABLE code.
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
    Ok(client?)
}
