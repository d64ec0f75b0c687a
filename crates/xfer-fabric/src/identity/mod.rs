//! Who a peer or caller is, from its certificate — never from a field it sends
//! (SECURITY.md): roles and names from a SPIFFE-style URI SAN
//! `spiffe://TRUST_DOMAIN/xfer/{node,client,admin}/NAME` or a `tls.dns_roles` DNS SAN, the
//! plaintext-mode identity of an address, and ([`tls`]) the data plane's rustls configuration.
//!
//! Below the fabric and the configuration on purpose: the tcp fabric authenticates its data
//! streams with it and the configuration validates its patterns with it, while the gRPC side
//! (`service::auth`: which method needs which role, the tower layer) builds on top.
use std::fmt;
use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};
use x509_parser::extensions::GeneralName;

pub mod tls;

/// A caller role: what a certificate may call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RoleName {
    /// Another agent: `xfer.v1.Peer` only.
    Node,
    /// xferctl or an application: `xfer.v1.Agent`.
    Client,
    /// A client that may also run benchmarks (`Bench`, `TcpBaseline`).
    Admin,
}

/// Maps a DNS SAN to a role, for CAs that cannot issue URI SANs: `pattern` is a DNS name whose
/// first label may be `*`, which matches exactly one label; that label (or the whole name without
/// a `*`) becomes the caller's NAME.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DnsRole {
    pub pattern: String,
    pub role: RoleName,
}

/// What a caller is allowed to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Another agent: `xfer.v1.Peer`.
    Node,
    /// xferctl or a local application: `xfer.v1.Agent`.
    Client,
    /// A client that may also run benchmarks.
    Admin,
    /// Plaintext mode: no identity, every call allowed.
    Plaintext,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Node => "node",
            Role::Client => "client",
            Role::Admin => "admin",
            Role::Plaintext => "plaintext",
        }
    }
}

impl From<RoleName> for Role {
    fn from(r: RoleName) -> Role {
        match r {
            RoleName::Node => Role::Node,
            RoleName::Client => Role::Client,
            RoleName::Admin => Role::Admin,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The authenticated caller of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub role: Role,
    /// The identity that grants, limits and metric labels are keyed on: NAME from the certificate;
    /// in plaintext mode `loopback` for any loopback address, else the remote IP.
    pub name: String,
}

/// Why a request is refused.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AuthError {
    #[error("a client certificate is required (mTLS)")]
    NoCertificate,
    #[error("certificate: {0}")]
    Unusable(String),
    #[error("certificate carries no xfer role: it needs a URI SAN spiffe://{trust_domain}/xfer/{{node|client|admin}}/NAME{dns}")]
    NoRole { trust_domain: String, dns: &'static str },
    #[error("certificate carries conflicting xfer role URIs ({0}): a certificate must carry one identity")]
    Ambiguous(String),
    #[error("certificate names {0:?}: NAMEs uid-N are the local unix socket's callers, never a certificate's")]
    Reserved(String),
    #[error("{method} needs {need}; the caller {name:?} has the {role} role")]
    Denied { method: String, need: &'static str, role: Role, name: String },
    #[error("{0} is not a method this agent serves")]
    Unknown(String),
}

/// How certificates map to roles: `tls.trust_domain` and `tls.dns_roles`.
#[derive(Debug, Clone, Default)]
pub struct RolePolicy {
    trust_domain: Option<String>,
    dns_roles: Vec<DnsRole>,
}

impl RolePolicy {
    pub fn new(trust_domain: &str, dns_roles: &[DnsRole]) -> RolePolicy {
        RolePolicy { trust_domain: Some(trust_domain.to_ascii_lowercase()).filter(|s| !s.is_empty()), dns_roles: dns_roles.to_vec() }
    }

    /// The role and name in a DER certificate (the verified leaf of a TLS peer).
    pub fn caller_of(&self, der: &[u8]) -> Result<Caller, AuthError> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| AuthError::Unusable(format!("cannot parse: {e}")))?;
        let names: Vec<GeneralName<'_>> = match cert.subject_alternative_name() {
            Ok(Some(ext)) => ext.value.general_names.clone(),
            Ok(None) => Vec::new(),
            Err(e) => return Err(AuthError::Unusable(format!("bad subjectAltName: {e}"))),
        };
        // URI SANs first: the SPIFFE convention is the primary one. An SVID has exactly one URI
        // SAN; a certificate whose role URIs disagree (say a client and a node URI) is ambiguous
        // and gets no role, rather than whichever its issuer happened to list first.
        let mut uri_callers = names.iter().filter_map(|n| match n {
            GeneralName::URI(u) => self.role_of_uri(u),
            _ => None,
        });
        if let Some(first) = uri_callers.next() {
            if let Some(other) = uri_callers.find(|c| *c != first) {
                return Err(AuthError::Ambiguous(format!("{} {:?} and {} {:?}", first.role, first.name, other.role, other.name)));
            }
            return not_local(first);
        }
        for n in &names {
            if let GeneralName::DNSName(d) = n {
                if let Some(c) = self.role_of_dns(d) {
                    return not_local(c);
                }
            }
        }
        Err(AuthError::NoRole {
            trust_domain: self.trust_domain.clone().unwrap_or_else(|| "TRUST_DOMAIN".into()),
            dns: if self.dns_roles.is_empty() { "" } else { " or a DNS SAN matching tls.dns_roles" },
        })
    }

    fn role_of_uri(&self, uri: &str) -> Option<Caller> {
        let rest = uri.strip_prefix("spiffe://")?;
        let (td, path) = rest.split_once('/')?;
        if check_trust_domain(td).is_err() {
            return None;
        }
        if let Some(want) = &self.trust_domain {
            if !td.eq_ignore_ascii_case(want) {
                return None;
            }
        }
        let mut parts = path.split('/');
        let (Some("xfer"), Some(role), Some(name), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return None;
        };
        let role = match role {
            "node" => Role::Node,
            "client" => Role::Client,
            "admin" => Role::Admin,
            _ => return None,
        };
        valid_name(name).then(|| Caller { role, name: name.to_string() })
    }

    fn role_of_dns(&self, dns: &str) -> Option<Caller> {
        let dns = dns.to_ascii_lowercase();
        self.dns_roles.iter().find_map(|r| {
            let pattern = r.pattern.to_ascii_lowercase();
            let name = match pattern.strip_prefix("*.") {
                Some(suffix) => {
                    let (label, rest) = dns.split_once('.')?;
                    (rest == suffix && !label.is_empty()).then(|| label.to_string())?
                }
                None => (dns == pattern).then(|| dns.clone())?,
            };
            valid_name(&name).then(|| Caller { role: r.role.into(), name })
        })
    }
}

/// A certificate's caller, unless its NAME is one the local unix socket gives its callers
/// (`uid-N`, `service::auth`): limits, shares and grants are keyed on the NAME, so a certificate
/// named like a local uid would spend that local user's shares from the network.
fn not_local(c: Caller) -> Result<Caller, AuthError> {
    let local = c.name.strip_prefix("uid-").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    if local {
        return Err(AuthError::Reserved(c.name));
    }
    Ok(c)
}

/// Longest NAME (a DNS name's limit).
pub const MAX_NAME_LEN: usize = 253;

/// NAME: what goes into grants, logs and metric labels. DNS-name characters, 1-253 bytes.
fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME_LEN && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
}

/// A trust domain: lower-case letters, digits, `-`, `.` and `_` (the SPIFFE ID rules).
pub fn check_trust_domain(td: &str) -> Result<(), String> {
    if td.is_empty()
        || td.len() > 255
        || !td.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'.' | b'_'))
    {
        return Err(format!("{td:?} is not a trust domain (lower-case letters, digits, '-', '.', '_')"));
    }
    Ok(())
}

/// A `tls.dns_roles` pattern: a DNS name, optionally starting with `*.`.
pub fn check_dns_pattern(p: &str) -> Result<(), String> {
    let rest = p.strip_prefix("*.").unwrap_or(p);
    let ok = !rest.is_empty() && rest.split('.').all(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!("{p:?} is not a DNS name or a `*.` wildcard of one"))
    }
}

/// The plaintext-mode identity of a remote address: all loopback addresses are one caller.
pub fn plaintext_name(addr: Option<SocketAddr>) -> String {
    match addr.map(|a| a.ip()) {
        Some(ip) if ip.is_loopback() => "loopback".to_string(),
        Some(IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
            Some(v4) if v4.is_loopback() => "loopback".to_string(),
            Some(v4) => v4.to_string(),
            None => v6.to_string(),
        },
        Some(ip) => ip.to_string(),
        None => "local".to_string(),
    }
}
