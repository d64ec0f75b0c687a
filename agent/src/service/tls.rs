//! mTLS for both gRPC services, for the agent's own client to its peers, and for the tcp
//! fabric's data plane.
//!
//! With `insecure = false` the agent reads `tls.cert`, `tls.key` and `tls.ca` once at start. The
//! server requires a client certificate that chains to `tls.ca` (rustls' WebPKI verifier, through
//! tonic). The agent presents the same certificate when it calls a peer and verifies the peer's
//! server certificate against the same CA, for the host of the peer address (or `tls.server_name`).
//! What a verified certificate may do is its role ([`super::auth`]); the agent's own certificate
//! must carry the node role, or peers would refuse it. The same material, as rustls configs, secures
//! the tcp fabric's data streams ([`DataTls`]).
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};

use super::auth::{Caller, Role, RolePolicy};
use super::tls_check;
use crate::config::TlsConfig;
pub use xfer_fabric::identity::tls::{data_tls, host_of, DataTls};

/// A slow or silent client cannot hold a connection slot in the handshake longer than this.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{key}: reading {path}: {source}")]
    Read { key: &'static str, path: String, source: std::io::Error },
    #[error("{key}: {path}: {detail}")]
    Invalid { key: &'static str, path: String, detail: String },
}

/// The agent's certificate, key and CA, read once at start.
#[derive(Clone)]
pub struct TlsMaterial {
    identity: Identity,
    ca: Certificate,
    server_name: Option<String>,
    /// This agent's own role and name (from its certificate; always the node role).
    pub own: Caller,
    /// How client certificates map to roles.
    pub policy: Arc<RolePolicy>,
    /// rustls configs for the tcp fabric's data streams.
    pub data: DataTls,
}

impl fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the key.
        f.debug_struct("TlsMaterial").field("own", &self.own).field("server_name", &self.server_name).finish()
    }
}

fn read(key: &'static str, path: &str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { key, path: path.to_string(), source })
}

impl TlsMaterial {
    /// Reads and checks the files: the certificate and key must load as a server identity and as
    /// a client identity, the CA must parse, and the certificate must carry the node role.
    pub fn load(cfg: &TlsConfig) -> Result<TlsMaterial, TlsError> {
        let cert = read("tls.cert", &cfg.cert)?;
        let key = read("tls.key", &cfg.key)?;
        let ca = read("tls.ca", &cfg.ca)?;
        let invalid = |key: &'static str, path: &str, detail: String| TlsError::Invalid { key, path: path.to_string(), detail };
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert)
            .collect::<Result<_, _>>()
            .map_err(|e| invalid("tls.cert", &cfg.cert, format!("bad PEM: {e}")))?;
        let leaf = chain.first().ok_or_else(|| invalid("tls.cert", &cfg.cert, "no PEM CERTIFICATE block".into()))?;
        let policy = Arc::new(RolePolicy::new(&cfg.trust_domain, &cfg.dns_roles));
        let own = policy.caller_of(leaf).map_err(|e| invalid("tls.cert", &cfg.cert, e.to_string()))?;
        if own.role != Role::Node {
            return Err(invalid(
                "tls.cert",
                &cfg.cert,
                format!("an agent's certificate needs the node role (spiffe://TRUST_DOMAIN/xfer/node/NAME); this one is {}", own.role),
            ));
        }
        let roots_der: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&ca)
            .collect::<Result<_, _>>()
            .map_err(|e| invalid("tls.ca", &cfg.ca, format!("bad PEM: {e}")))?;
        if roots_der.is_empty() {
            return Err(invalid("tls.ca", &cfg.ca, "no PEM CERTIFICATE block".into()));
        }
        let key_der =
            PrivateKeyDer::from_pem_slice(&key).map_err(|e| invalid("tls.key", &cfg.key, format!("no usable private key: {e}")))?;
        let server_name = Some(cfg.server_name.clone()).filter(|s| !s.is_empty());
        let files = tls_check::Files {
            chain: &chain,
            key: &key_der,
            roots: &roots_der,
            cert_path: &cfg.cert,
            ca_path: &cfg.ca,
            server_name: server_name.as_deref(),
        };
        tls_check::check(&files).map_err(|f| {
            let path = match f.key {
                "tls.key" => &cfg.key,
                "tls.ca" => &cfg.ca,
                "tls.server_name" => &cfg.server_name,
                _ => &cfg.cert,
            };
            invalid(f.key, path, f.detail)
        })?;
        let data = data_tls(chain, key_der, roots_der, policy.clone(), server_name.clone(), cfg.kernel)
            .map_err(|e| invalid("tls.key", &cfg.key, format!("unusable certificate, key or CA for the data plane: {e}")))?;
        let m = TlsMaterial { identity: Identity::from_pem(cert, key), ca: Certificate::from_pem(ca), server_name, own, policy, data };
        // Build both sides once so that a bad key or CA fails at start, not at the first call.
        Server::builder()
            .tls_config(m.server_config())
            .map_err(|e| invalid("tls.key", &cfg.key, format!("unusable certificate, key or CA: {}", chain_text(&e))))?;
        Endpoint::from_static("https://localhost")
            .tls_config(m.client_config("localhost:1"))
            .map_err(|e| invalid("tls.key", &cfg.key, format!("unusable as a client identity: {}", chain_text(&e))))?;
        Ok(m)
    }

    /// The gRPC listener's rustls config: the data plane's (same certificate, key and client
    /// verifier, without the data plane's kTLS changes) offering HTTP/2 by ALPN. The agent runs the handshake itself
    /// ([`super::handshake`]) so that a refused one is logged and counted with its reason.
    pub fn grpc_server_config(&self) -> Arc<rustls::ServerConfig> {
        let mut c = (*self.data.plain_server()).clone();
        c.alpn_protocols = vec![b"h2".to_vec()];
        Arc::new(c)
    }

    /// Server side: present the agent's certificate, require and verify client certificates.
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity.clone())
            .client_ca_root(self.ca.clone())
            .client_auth_optional(false)
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// Client side to the peer at `addr` (`host:port`): present the agent's certificate, verify the
    /// peer against the CA for `tls.server_name` or the address' host.
    pub fn client_config(&self, addr: &str) -> ClientTlsConfig {
        let name = self.server_name.clone().unwrap_or_else(|| host_of(addr).to_string());
        ClientTlsConfig::new().identity(self.identity.clone()).ca_certificate(self.ca.clone()).domain_name(name).timeout(HANDSHAKE_TIMEOUT)
    }
}

fn chain_text(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut src = e.source();
    while let Some(s) = src {
        parts.push(s.to_string());
        src = s.source();
    }
    parts.join(": ")
}
