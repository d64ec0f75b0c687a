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

/// `--key` must be the private key of `--cert`: checked here so that a mismatch names both files
/// (tonic reports it as a bare "transport error").
fn check_key_matches(cert: &Path, cert_pem: &[u8], key: &Path, key_pem: &[u8]) -> anyhow::Result<()> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| crate::error::usage(format!("--cert {}: not a PEM certificate: {e}", cert.display())))?;
    if chain.is_empty() {
        return Err(crate::error::usage(format!("--cert {}: no PEM CERTIFICATE block", cert.display())));
    }
    let key_der = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| crate::error::usage(format!("--key {}: no usable PEM private key: {e}", key.display())))?;
    let provider = rustls::crypto::ring::default_provider();
    match rustls::sign::CertifiedKey::from_der(chain, key_der, &provider) {
        Ok(_) => Ok(()),
        Err(rustls::Error::InconsistentKeys(_)) => Err(crate::error::usage(format!(
            "--key {} does not match --cert {}: the key's public key is not the certificate's; give the key made with \
             that certificate (NAME.key next to NAME.crt from scripts/make-certs)",
            key.display(),
            cert.display()
        ))),
        Err(e) => Err(crate::error::usage(format!("--cert {} with --key {}: {e}", cert.display(), key.display()))),
    }
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
    crate::diagnose::remember(crate::diagnose::Target {
        addr: addr.to_string(),
        tls: tls.is_some(),
        client_cert: tls.is_some_and(|t| t.cert.is_some() && t.key.is_some()),
        ca: tls.map(|t| t.ca.clone()),
        cert: tls.and_then(|t| t.cert.clone()),
        key: tls.and_then(|t| t.key.clone()),
        server_name: tls.and_then(|t| t.server_name.clone()),
    });
    let client = match tls {
        None => xfer_client::Client::connect(addr).await,
        Some(t) => {
            let tls = xfer_client::Tls {
                ca_pem: read("--ca", &t.ca)?,
                cert_pem: t.cert.as_deref().map(|p| read("--cert", p)).transpose()?,
                key_pem: t.key.as_deref().map(|p| read("--key", p)).transpose()?,
                server_name: t.server_name.clone(),
            };
            if let (Some(cp), Some(kp), Some(c), Some(k)) = (&t.cert, &t.key, &tls.cert_pem, &tls.key_pem) {
                check_key_matches(cp, c, kp, k)?;
            }
            xfer_client::Client::connect_tls(addr, tls).await
        }
    };
    Ok(client?)
}
