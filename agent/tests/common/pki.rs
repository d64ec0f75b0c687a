//! Test PKI made with rcgen (no openssl): a CA, role certificates in the SPIFFE convention
//! (`spiffe://xfer.test/xfer/{node,client,admin}/NAME`), a certificate with no role, and a
//! foreign CA; plus mTLS agents and clients built from them.
use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use xfer_proto::v1::agent_client::AgentClient;
use xfer_proto::v1::peer_client::PeerClient;

use super::{Agent, Ports};

pub const TRUST_DOMAIN: &str = "xfer.test";

pub fn role_uri(role: &str, name: &str) -> String {
    format!("spiffe://{TRUST_DOMAIN}/xfer/{role}/{name}")
}

/// A CA and certificates it signed, as PEM files in a temp dir.
pub struct Pki {
    pub dir: tempfile::TempDir,
    ca: Issuer<'static, KeyPair>,
}

fn make_ca(dir: &Path, name: &str) -> Issuer<'static, KeyPair> {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name.push(rcgen::DnType::CommonName, format!("{name} CA"));
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let cert = p.self_signed(&key).unwrap();
    std::fs::write(dir.join(format!("{name}.crt")), cert.pem()).unwrap();
    Issuer::new(p, key)
}

/// `file.crt`/`file.key` with exactly `sans`, signed by `ca`.
fn make_leaf(dir: &Path, file: &str, sans: Vec<SanType>, ca: &Issuer<'_, KeyPair>) {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.subject_alt_names = sans;
    p.distinguished_name.push(rcgen::DnType::CommonName, file);
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let cert = p.signed_by(&key, ca).unwrap();
    std::fs::write(dir.join(format!("{file}.crt")), cert.pem()).unwrap();
    std::fs::write(dir.join(format!("{file}.key")), key.serialize_pem()).unwrap();
}

pub fn uri(s: &str) -> SanType {
    SanType::URI(s.try_into().unwrap())
}

pub fn dns(s: &str) -> SanType {
    SanType::DnsName(s.try_into().unwrap())
}

pub fn ip(s: &str) -> SanType {
    SanType::IpAddress(s.parse().unwrap())
}

impl Pki {
    /// `ca.crt` with nodes node-a, node-b, node-c (node role, valid as servers for 127.0.0.1),
    /// `xferctl` (client), `admin` (admin) and `norole` (chains to the CA, DNS SAN only);
    /// `other.crt` (another CA) with an `impostor` that has node-a's names.
    pub fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca = make_ca(dir.path(), "ca");
        let pki = Pki { dir, ca };
        for n in ["node-a", "node-b", "node-c"] {
            pki.leaf(n, vec![uri(&role_uri("node", n)), dns(n), ip("127.0.0.1")]);
        }
        pki.leaf("xferctl", vec![uri(&role_uri("client", "xferctl"))]);
        pki.leaf("admin", vec![uri(&role_uri("admin", "ops"))]);
        pki.leaf("norole", vec![dns("node-a"), ip("127.0.0.1")]);
        let other = make_ca(pki.dir.path(), "other");
        make_leaf(pki.dir.path(), "impostor", vec![uri(&role_uri("node", "node-a")), dns("node-a"), ip("127.0.0.1")], &other);
        pki
    }

    /// Another certificate signed by this CA.
    pub fn leaf(&self, file: &str, sans: Vec<SanType>) {
        make_leaf(self.dir.path(), file, sans, &self.ca);
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    pub fn read(&self, file: &str) -> Vec<u8> {
        std::fs::read(self.path(file)).unwrap()
    }

    /// An agent with mTLS under certificate `name`, configured through a `--config` TOML file
    /// (plus `extra` TOML lines at the top level, and `tls_extra` inside `[tls]`) and `env`.
    pub fn agent_with(&self, name: &str, extra: &str, tls_extra: &str, env: &[(&str, &str)]) -> (Agent, tempfile::TempDir) {
        self.agent_on(name, Ports::new(), extra, tls_extra, env)
    }

    /// [`Pki::agent_with`] on `ports` (e.g. another agent's gRPC port, `Ports::same`).
    pub fn agent_on(&self, name: &str, ports: Ports, extra: &str, tls_extra: &str, env: &[(&str, &str)]) -> (Agent, tempfile::TempDir) {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = tmp.path().join("agent.toml");
        std::fs::write(
            &cfg,
            format!(
                "insecure = false\n{extra}\n[tls]\ncert = {:?}\nkey = {:?}\nca = {:?}\n{tls_extra}\n",
                self.path(&format!("{name}.crt")),
                self.path(&format!("{name}.key")),
                self.path("ca.crt"),
            ),
        )
        .unwrap();
        let state = tmp.path().join("state");
        let cfg = cfg.display().to_string();
        let a = Agent::start_with_env(name, &state, ports, &["--config", &cfg], env);
        (a, tmp)
    }

    pub fn agent(&self, name: &str) -> (Agent, tempfile::TempDir) {
        self.agent_with(name, "", "", &[])
    }

    /// A TLS channel that trusts `ca` and presents `who`'s certificate (None: no certificate).
    pub async fn channel(&self, addr: &str, ca: &str, who: Option<&str>) -> Result<Channel, tonic::transport::Error> {
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(self.read(ca))).domain_name("127.0.0.1");
        if let Some(w) = who {
            tls = tls.identity(Identity::from_pem(self.read(&format!("{w}.crt")), self.read(&format!("{w}.key"))));
        }
        Channel::from_shared(format!("https://{addr}")).unwrap().tls_config(tls)?.connect().await
    }

    pub async fn peer(&self, agent: &Agent, who: &str) -> PeerClient<Channel> {
        PeerClient::new(self.channel(&agent.addr(), "ca.crt", Some(who)).await.unwrap())
    }

    pub async fn agent_client(&self, agent: &Agent, who: &str) -> AgentClient<Channel> {
        AgentClient::new(self.channel(&agent.addr(), "ca.crt", Some(who)).await.unwrap()).max_decoding_message_size(64 << 20)
    }
}
