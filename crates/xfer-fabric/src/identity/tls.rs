//! The tcp fabric's data-plane TLS: rustls server and client configs from the agent's
//! certificate and CA (tokio-rustls, ring provider like tonic's), and who a data-stream peer is.
use std::fmt;
use std::sync::Arc;

use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::{AuthError, Caller, RolePolicy};

/// TLS for the tcp fabric's data streams: the same certificate, key and CA as gRPC, through
/// tokio-rustls (ring provider, like tonic's). Clients must present a certificate; the caller's
/// role is checked by the data listener against the connection it names.
#[derive(Clone)]
pub struct DataTls {
    pub server: Arc<rustls::ServerConfig>,
    pub client: Arc<rustls::ClientConfig>,
    pub policy: Arc<RolePolicy>,
    server_name: Option<String>,
}

impl fmt::Debug for DataTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataTls").field("server_name", &self.server_name).finish()
    }
}

impl DataTls {
    /// The name a peer's data-plane certificate is verified for: `tls.server_name`, else the host
    /// of the peer's gRPC address.
    pub fn server_name_for(&self, peer_addr: &str) -> Result<rustls_pki_types::ServerName<'static>, String> {
        let name = self.server_name.clone().unwrap_or_else(|| host_of(peer_addr).to_string());
        rustls_pki_types::ServerName::try_from(name.clone()).map_err(|e| format!("{name:?} is not a TLS server name: {e}"))
    }

    /// The role and name of a TLS peer from its verified certificate chain.
    pub fn caller_of(&self, certs: Option<&[CertificateDer<'_>]>) -> Result<Caller, AuthError> {
        let leaf = certs.and_then(|c| c.first()).ok_or(AuthError::NoCertificate)?;
        self.policy.caller_of(leaf)
    }
}

pub fn data_tls(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots_der: Vec<CertificateDer<'static>>,
    policy: Arc<RolePolicy>,
    server_name: Option<String>,
) -> Result<DataTls, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in roots_der {
        roots.add(c).map_err(|e| e.to_string())?;
    }
    let roots = Arc::new(roots);
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone()).build().map_err(|e| e.to_string())?;
    let server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| e.to_string())?;
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| e.to_string())?;
    Ok(DataTls { server: Arc::new(server), client: Arc::new(client), policy, server_name })
}

/// The host of `host:port` or `[v6]:port`, without brackets.
pub fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match addr.rsplit_once(':') {
        Some((h, _)) => h,
        None => addr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts() {
        assert_eq!(host_of("127.0.0.1:7470"), "127.0.0.1");
        assert_eq!(host_of("node-b:7470"), "node-b");
        assert_eq!(host_of("[::1]:7470"), "::1");
        assert_eq!(host_of("node-b"), "node-b");
    }
}
