//! mTLS for both gRPC services and for the agent's own client to its peers, and the peer identity
//! taken from an authenticated client certificate.
//!
//! With `insecure = false` the agent reads `tls.cert`, `tls.key` and `tls.ca` once at start. The
//! server requires a client certificate that chains to `tls.ca` (rustls' WebPKI verifier, through
//! tonic). The agent presents the same certificate when it calls a peer and verifies the peer's
//! server certificate against the same CA, for the host of the peer address (or `tls.server_name`).
//! The identity of a caller is the first DNS SAN of its leaf certificate, else its first IP SAN,
//! else its first URI SAN; grants are bound to it.
use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, Server, ServerTlsConfig};
use x509_parser::extensions::GeneralName;

use crate::config::TlsConfig;

/// A slow or silent client cannot hold a connection slot in the handshake longer than this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{key}: reading {path}: {source}")]
    Read { key: &'static str, path: String, source: std::io::Error },
    #[error("{key}: {path}: {detail}")]
    Invalid { key: &'static str, path: String, detail: String },
}

/// Why a client certificate yields no identity.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("a client certificate is required (mTLS)")]
    NoCertificate,
    #[error("certificate: {0}")]
    Unusable(String),
}

/// The agent's certificate, key and CA, read once at start.
#[derive(Clone)]
pub struct TlsMaterial {
    identity: Identity,
    ca: Certificate,
    server_name: Option<String>,
    /// The identity this agent presents (its own certificate's SAN), for logs.
    pub own_identity: String,
}

impl fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the key.
        f.debug_struct("TlsMaterial").field("own_identity", &self.own_identity).field("server_name", &self.server_name).finish()
    }
}

fn read(key: &'static str, path: &str) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { key, path: path.to_string(), source })
}

/// The first certificate of a PEM file (the leaf), as DER; tonic and rustls parse the rest.
fn first_pem_cert(pem: &[u8]) -> Option<Vec<u8>> {
    CertificateDer::pem_slice_iter(pem).next()?.ok().map(|c| c.to_vec())
}

impl TlsMaterial {
    /// Reads and checks the files: the certificate and key must load as a server identity and as
    /// a client identity, the CA must parse.
    pub fn load(cfg: &TlsConfig) -> Result<TlsMaterial, TlsError> {
        let cert = read("tls.cert", &cfg.cert)?;
        let key = read("tls.key", &cfg.key)?;
        let ca = read("tls.ca", &cfg.ca)?;
        let invalid = |key: &'static str, path: &str, detail: String| TlsError::Invalid { key, path: path.to_string(), detail };
        let leaf = first_pem_cert(&cert).ok_or_else(|| invalid("tls.cert", &cfg.cert, "no PEM CERTIFICATE block".into()))?;
        let own_identity = identity_of(&leaf).map_err(|e| invalid("tls.cert", &cfg.cert, e.to_string()))?;
        if first_pem_cert(&ca).is_none() {
            return Err(invalid("tls.ca", &cfg.ca, "no PEM CERTIFICATE block".into()));
        }
        let m = TlsMaterial {
            identity: Identity::from_pem(cert, key),
            ca: Certificate::from_pem(ca),
            server_name: Some(cfg.server_name.clone()).filter(|s| !s.is_empty()),
            own_identity,
        };
        // Build both sides once so that a bad key or CA fails at start, not at the first call.
        Server::builder()
            .tls_config(m.server_config())
            .map_err(|e| invalid("tls.key", &cfg.key, format!("unusable certificate, key or CA: {}", chain(&e))))?;
        Endpoint::from_static("https://localhost")
            .tls_config(m.client_config("localhost:1"))
            .map_err(|e| invalid("tls.key", &cfg.key, format!("unusable as a client identity: {}", chain(&e))))?;
        Ok(m)
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
        ClientTlsConfig::new()
            .identity(self.identity.clone())
            .ca_certificate(self.ca.clone())
            .domain_name(name)
            .timeout(HANDSHAKE_TIMEOUT)
    }
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

fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![e.to_string()];
    let mut src = e.source();
    while let Some(s) = src {
        parts.push(s.to_string());
        src = s.source();
    }
    parts.join(": ")
}

/// The identity in a DER certificate: first DNS SAN, else first IP SAN, else first URI SAN.
pub fn identity_of(der: &[u8]) -> Result<String, IdentityError> {
    let unusable = |m: String| IdentityError::Unusable(m);
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| unusable(format!("cannot parse: {e}")))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| unusable(format!("bad subjectAltName: {e}")))?
        .ok_or_else(|| unusable("has no subjectAltName (DNS, IP or URI) to identify it".into()))?;
    let names = &san.value.general_names;
    let dns = names.iter().find_map(|n| match n {
        GeneralName::DNSName(d) => Some(d.to_string()),
        _ => None,
    });
    let ip = || {
        names.iter().find_map(|n| match n {
            GeneralName::IPAddress(b) => match b.len() {
                4 => <[u8; 4]>::try_from(*b).ok().map(|a| IpAddr::from(a).to_string()),
                16 => <[u8; 16]>::try_from(*b).ok().map(|a| IpAddr::from(a).to_string()),
                _ => None,
            },
            _ => None,
        })
    };
    let uri = || {
        names.iter().find_map(|n| match n {
            GeneralName::URI(u) => Some(u.to_string()),
            _ => None,
        })
    };
    let id = dns.or_else(ip).or_else(uri).ok_or_else(|| unusable("has no DNS, IP or URI subjectAltName".into()))?;
    // The CA vouches for the name, but it still goes into logs, metrics labels and records.
    if id.is_empty() || id.len() > 253 || id.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(unusable(format!("identity {id:?} is empty, too long or has control characters")));
    }
    Ok(id)
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

    fn cert_with(sans: Vec<rcgen::SanType>) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::default();
        p.subject_alt_names = sans;
        p.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn identity_prefers_dns_then_ip_then_uri() {
        use rcgen::SanType::*;
        let ip: IpAddr = "10.1.2.3".parse().unwrap();
        let uri = || URI("spiffe://xfer/node-c".try_into().unwrap());
        let dns = |s: &str| DnsName(s.try_into().unwrap());
        assert_eq!(identity_of(&cert_with(vec![IpAddress(ip), dns("node-a"), dns("alt")])).unwrap(), "node-a");
        assert_eq!(identity_of(&cert_with(vec![uri(), IpAddress(ip)])).unwrap(), "10.1.2.3");
        assert_eq!(identity_of(&cert_with(vec![uri()])).unwrap(), "spiffe://xfer/node-c");
        assert!(matches!(identity_of(&cert_with(vec![])), Err(IdentityError::Unusable(_))));
        assert!(matches!(identity_of(b"not a certificate"), Err(IdentityError::Unusable(_))));
    }
}
