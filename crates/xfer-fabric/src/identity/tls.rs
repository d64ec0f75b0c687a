//! The tcp fabric's data-plane TLS: rustls server and client configs from the agent's
//! certificate and CA (tokio-rustls, ring provider like tonic's), and who a data-stream peer is.
use std::fmt;
use std::sync::Arc;

use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::{AuthError, Caller, RolePolicy};

/// Encrypted bytes a rustls data stream may hold before its writer waits on the socket
/// (`set_buffer_limit`; rustls's default is 64 KiB). With the default, a gathered write of a
/// run of frames left as one system call per 64 KiB of records; at 512 KiB the tcp fabric's
/// mTLS streams moved 1.14-1.22x the bytes per second at 0.78-0.88x the CPU per byte, from 4 KiB
/// to 16 MiB messages, WRITE and READ (same-run A/B on loopback). It is memory only while the
/// socket takes less than is written. The raw TLS baseline of `xferctl bench` uses it too.
pub const SEND_BUFFER: usize = 512 << 10;

/// TLS for the tcp fabric's data streams: the same certificate, key and CA as gRPC, through
/// tokio-rustls (ring provider, like tonic's). Clients must present a certificate; the caller's
/// role is checked by the data listener against the connection it names.
#[derive(Clone)]
pub struct DataTls {
    /// The data listener's config: no TLS 1.3 session tickets (see [`data_tls`]).
    pub server: Arc<rustls::ServerConfig>,
    pub client: Arc<rustls::ClientConfig>,
    pub policy: Arc<RolePolicy>,
    /// Whether a stream's record layer goes to the kernel after the handshake (`tls.kernel`).
    pub kernel: KernelTls,
    /// The server config as built, before the data plane's changes: what gRPC serves with.
    plain_server: Arc<rustls::ServerConfig>,
    server_name: Option<String>,
}

/// `tls.kernel`: who runs a data stream's TLS record layer once rustls has done the handshake
/// and the certificate checks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum KernelTls {
    /// rustls, in user space, for every stream.
    #[default]
    Off,
    /// The kernel (kTLS) where it can take the stream's cipher suite; rustls for every stream it
    /// cannot (no `tls` module, a suite it lacks), and the stream goes on either way.
    Auto,
}

impl TryFrom<String> for KernelTls {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        xfer_common::one_of(&s, &[("off", KernelTls::Off), ("auto", KernelTls::Auto)])
    }
}

impl fmt::Debug for DataTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataTls").field("server_name", &self.server_name).field("kernel", &self.kernel).finish()
    }
}

impl DataTls {
    /// The server config without the data plane's changes (session tickets as rustls sends them,
    /// no secret extraction): the gRPC listener's base.
    pub fn plain_server(&self) -> Arc<rustls::ServerConfig> {
        self.plain_server.clone()
    }

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
    kernel: KernelTls,
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
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| e.to_string())?;
    let plain_server = Arc::new(server.clone());
    let mut data_server = server;
    // A TLS 1.3 ticket arrives after the handshake as a record the kernel hands back as a
    // control message, not data; data streams never resume, so none is sent, whatever this
    // agent's own `tls.kernel` (its peer's may be `auto`).
    data_server.send_tls13_tickets = 0;
    if kernel == KernelTls::Auto {
        // The kernel needs the traffic keys rustls derived; only the data plane's configs allow
        // taking them out, and only with `tls.kernel = auto`.
        data_server.enable_secret_extraction = true;
        client.enable_secret_extraction = true;
    }
    Ok(DataTls { server: Arc::new(data_server), client: Arc::new(client), policy, kernel, plain_server, server_name })
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

    /// The data plane's configs send no session tickets (whatever `tls.kernel`) and allow taking
    /// the keys out only with `auto`; the server config gRPC gets keeps rustls's defaults.
    #[test]
    fn only_the_data_plane_configs_change_for_kernel_tls() {
        let key = rcgen::KeyPair::generate().expect("a key");
        let cert = rcgen::CertificateParams::new(vec!["n1".to_string()]).expect("params").self_signed(&key).expect("a certificate");
        let der = PrivateKeyDer::Pkcs8(rustls_pki_types::PrivatePkcs8KeyDer::from(key.serialize_der()));
        let policy = Arc::new(RolePolicy::new("", &[]));
        for kernel in [KernelTls::Off, KernelTls::Auto] {
            let t = data_tls(vec![cert.der().clone()], der.clone_key(), vec![cert.der().clone()], policy.clone(), None, kernel)
                .expect("data TLS");
            assert_eq!(t.server.send_tls13_tickets, 0, "{kernel:?}");
            let auto = kernel == KernelTls::Auto;
            assert_eq!((t.server.enable_secret_extraction, t.client.enable_secret_extraction), (auto, auto), "{kernel:?}");
            let grpc = t.plain_server();
            assert!(grpc.send_tls13_tickets > 0 && !grpc.enable_secret_extraction, "{kernel:?}");
        }
    }

    #[test]
    fn hosts() {
        assert_eq!(host_of("127.0.0.1:7470"), "127.0.0.1");
        assert_eq!(host_of("node-b:7470"), "node-b");
        assert_eq!(host_of("[::1]:7470"), "::1");
        assert_eq!(host_of("node-b"), "node-b");
    }
}
