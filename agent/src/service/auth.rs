//! Who is calling, and may they (SECURITY.md).
//!
//! A caller's **role** and **name** come from its client certificate, never from a field it sends:
//! a SPIFFE-style URI SAN `spiffe://TRUST_DOMAIN/xfer/{node,client,admin}/NAME`, or, for CAs that
//! cannot issue URI SANs, a DNS SAN matched by `tls.dns_roles`. A certificate with no role gets
//! nothing. In plaintext mode (only allowed on loopback or with `allow_plaintext_network`) there
//! is no identity: every caller may call everything, and its name is its address, so limits and
//! metric labels still cannot be multiplied by declaring names.
//!
//! [`AuthLayer`] applies [`required`] to every gRPC request before any handler runs and puts the
//! [`Caller`] into the request's extensions; handlers read it with [`caller`]. The table is
//! deny-by-default: a method not listed there is refused. Every refusal is counted
//! (`xfer_rpc_denied_total{method,role}`) and logged (at most about once a second).
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

pub use xfer_fabric::identity::{check_dns_pattern, check_trust_domain, plaintext_name, AuthError, Caller, Role, RolePolicy};

/// Which role a method needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Any caller with a role (health, reflection).
    AnyRole,
    Node,
    /// Client or admin.
    Client,
    Admin,
}

impl Need {
    fn describe(self) -> &'static str {
        match self {
            Need::AnyRole => "a node, client or admin certificate",
            Need::Node => "the node role (spiffe://…/xfer/node/NAME): only agents call xfer.v1.Peer",
            Need::Client => "the client or admin role (spiffe://…/xfer/client/NAME)",
            Need::Admin => "the admin role (spiffe://…/xfer/admin/NAME): benchmarks are admin-only",
        }
    }

    pub fn allows(self, role: Role) -> bool {
        matches!(
            (self, role),
            (_, Role::Plaintext)
                | (Need::AnyRole, _)
                | (Need::Node, Role::Node)
                | (Need::Client, Role::Client | Role::Admin)
                | (Need::Admin, Role::Admin)
        )
    }
}

/// The authorization table: the role a gRPC method (`/package.Service/Method`) needs, `None` for
/// anything not served (refused).
pub fn required(path: &str) -> Option<Need> {
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    match service {
        "xfer.v1.Peer" => Some(Need::Node),
        "xfer.v1.Agent" => match method {
            "Bench" | "TcpBaseline" => Some(Need::Admin),
            _ => Some(Need::Client),
        },
        "grpc.health.v1.Health" | "grpc.reflection.v1.ServerReflection" | "grpc.reflection.v1alpha.ServerReflection" => Some(Need::AnyRole),
        _ => None,
    }
}

/// How the server authenticates: mTLS with a role policy, or plaintext.
#[derive(Debug, Clone)]
pub enum Authenticator {
    Tls(Arc<RolePolicy>),
    Plaintext,
    /// The local unix socket: the caller is the peer process's uid (SO_PEERCRED), with the
    /// client role; the socket's mode and group decide who may connect at all.
    Local,
}

impl Authenticator {
    /// The caller of an HTTP/2 request, from the connection info tonic put in its extensions.
    pub fn caller(&self, ext: &http::Extensions) -> Result<Caller, AuthError> {
        match self {
            Authenticator::Plaintext => {
                let addr = ext.get::<TcpConnectInfo>().and_then(|i| i.remote_addr());
                Ok(Caller { role: Role::Plaintext, name: plaintext_name(addr) })
            }
            Authenticator::Local => {
                let uid = ext.get::<tonic::transport::server::UdsConnectInfo>().and_then(|i| i.peer_cred).map(|c| c.uid());
                match uid {
                    Some(uid) => Ok(Caller { role: Role::Client, name: format!("uid-{uid}") }),
                    None => Err(AuthError::NoCertificate),
                }
            }
            Authenticator::Tls(policy) => {
                let certs = ext.get::<TlsConnectInfo<TcpConnectInfo>>().and_then(|i| i.peer_certs()).ok_or(AuthError::NoCertificate)?;
                let leaf = certs.first().ok_or(AuthError::NoCertificate)?;
                policy.caller_of(leaf)
            }
        }
    }

    /// Authenticates and authorizes one request to `path`.
    pub fn authorize(&self, path: &str, ext: &http::Extensions) -> Result<Caller, AuthError> {
        let need = required(path).ok_or_else(|| AuthError::Unknown(path.to_string()))?;
        let caller = self.caller(ext)?;
        if need.allows(caller.role) {
            Ok(caller)
        } else {
            Err(AuthError::Denied {
                method: path.trim_start_matches('/').to_string(),
                need: need.describe(),
                role: caller.role,
                name: caller.name,
            })
        }
    }
}

/// Every `package.Service/Method` the gRPC port serves: the agent's own services from the
/// descriptor set it serves for reflection, plus health and reflection.
fn served() -> &'static std::collections::HashSet<String> {
    static SERVED: std::sync::OnceLock<std::collections::HashSet<String>> = std::sync::OnceLock::new();
    SERVED.get_or_init(|| {
        use prost::Message;
        let mut set: std::collections::HashSet<String> = [
            "grpc.health.v1.Health/Check",
            "grpc.health.v1.Health/Watch",
            "grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        // The descriptor set is compiled in; if it ever failed to decode, methods would be
        // labelled `unknown`, which stays bounded.
        if let Ok(fds) = prost_types::FileDescriptorSet::decode(xfer_proto::FILE_DESCRIPTOR_SET) {
            for file in fds.file {
                let package = file.package.unwrap_or_default();
                for service in file.service {
                    let sname = service.name.unwrap_or_default();
                    for m in service.method {
                        set.insert(format!("{package}.{sname}/{}", m.name.unwrap_or_default()));
                    }
                }
            }
        }
        set
    })
}

/// The `method` label of a refused call to `path` (`/package.Service/Method`): the method if
/// this agent serves it, else `unknown` (a caller cannot mint label values with made-up paths).
pub fn method_label(path: &str) -> String {
    let m = path.trim_start_matches('/');
    if served().contains(m) {
        m.to_string()
    } else {
        "unknown".to_string()
    }
}

/// Whether to log a refusal now: at most about once a second, so that a misconfigured client in a
/// retry loop cannot flood the log (the counter sees every refusal).
fn log_now() -> bool {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    LAST.swap(now, Ordering::Relaxed) != now
}

/// The caller [`AuthLayer`] put into a request's extensions.
pub fn caller<T>(req: &tonic::Request<T>) -> Option<&Caller> {
    req.extensions().get::<Caller>()
}

/// How a refusal becomes the answer's status: the service's error → status mapping, handed in
/// so that statuses are built in one place and this module depends on none of it.
pub type Refuse = fn(AuthError) -> tonic::Status;

/// Tower layer: authorizes every request by [`required`] and hands the [`Caller`] to handlers;
/// a refused request is answered with `refuse`'s status before any handler runs.
#[derive(Debug, Clone)]
pub struct AuthLayer {
    auth: Authenticator,
    refuse: Refuse,
}

impl AuthLayer {
    pub fn new(auth: Authenticator, refuse: Refuse) -> AuthLayer {
        AuthLayer { auth, refuse }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthService<S>;
    fn layer(&self, inner: S) -> AuthService<S> {
        AuthService { inner, auth: self.auth.clone(), refuse: self.refuse }
    }
}

#[derive(Debug, Clone)]
pub struct AuthService<S> {
    inner: S,
    auth: Authenticator,
    refuse: Refuse,
}

impl<S, B, R> tower::Service<http::Request<B>> for AuthService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    R: Default,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::Either<futures::future::Ready<Result<S::Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        match self.auth.authorize(req.uri().path(), req.extensions()) {
            Ok(caller) => {
                req.extensions_mut().insert(caller);
                futures::future::Either::Right(self.inner.call(req))
            }
            Err(e) => {
                let role = match &e {
                    AuthError::Denied { role, .. } => role.as_str(),
                    AuthError::Unknown(_) => self.auth.caller(req.extensions()).map(|c| c.role.as_str()).unwrap_or("none"),
                    _ => "none",
                };
                crate::metrics::rpc_denied(method_label(req.uri().path()), role);
                if log_now() {
                    tracing::warn!(path = req.uri().path(), role, error = %e, "call refused (xfer_rpc_denied_total counts them all)");
                }
                futures::future::Either::Left(futures::future::ready(Ok((self.refuse)(e).into_http())))
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use xfer_fabric::identity::{DnsRole, RoleName};

    fn cert_with(sans: Vec<rcgen::SanType>) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::default();
        p.subject_alt_names = sans;
        p.self_signed(&key).unwrap().der().to_vec()
    }

    fn uri(s: &str) -> rcgen::SanType {
        rcgen::SanType::URI(s.try_into().unwrap())
    }

    fn dns(s: &str) -> rcgen::SanType {
        rcgen::SanType::DnsName(s.try_into().unwrap())
    }

    #[test]
    fn roles_come_from_spiffe_uri_sans() {
        let any = RolePolicy::new("", &[]);
        let c = any.caller_of(&cert_with(vec![dns("node-a"), uri("spiffe://prod.example/xfer/node/node-a")])).unwrap();
        assert_eq!(c, Caller { role: Role::Node, name: "node-a".into() });
        let c = any.caller_of(&cert_with(vec![uri("spiffe://td/xfer/client/app-1")])).unwrap();
        assert_eq!(c.role, Role::Client);
        let c = any.caller_of(&cert_with(vec![uri("spiffe://td/xfer/admin/ops")])).unwrap();
        assert_eq!((c.role, c.name.as_str()), (Role::Admin, "ops"));
        // Anything else carries no role.
        for bad in [
            "spiffe://td/xfer/root/x",
            "spiffe://td/xfer/node/",
            "spiffe://td/xfer/node/a/b",
            "spiffe://td/other/node/a",
            "https://td/xfer/node/a",
            "spiffe://TD/xfer/node/a",
            "spiffe://td/xfer/node/a%20b",
        ] {
            assert!(matches!(any.caller_of(&cert_with(vec![uri(bad)])), Err(AuthError::NoRole { .. })), "{bad}");
        }
        assert!(matches!(any.caller_of(&cert_with(vec![dns("node-a")])), Err(AuthError::NoRole { .. })));
        assert!(matches!(any.caller_of(&cert_with(vec![])), Err(AuthError::NoRole { .. })));
        assert!(matches!(any.caller_of(b"junk"), Err(AuthError::Unusable(_))));
    }

    #[test]
    fn a_certificate_cannot_be_named_like_a_local_uid() {
        let any = RolePolicy::new("", &[DnsRole { pattern: "*.apps.example".into(), role: RoleName::Client }]);
        for sans in
            [vec![uri("spiffe://td/xfer/client/uid-0")], vec![uri("spiffe://td/xfer/admin/uid-1000")], vec![dns("uid-7.apps.example")]]
        {
            assert!(matches!(any.caller_of(&cert_with(sans)), Err(AuthError::Reserved(_))));
        }
        // Only `uid-` and digits is a unix socket caller's NAME.
        for name in ["uid-", "uid-0a", "uid0", "UID-0", "my-uid-0"] {
            let c = any.caller_of(&cert_with(vec![uri(&format!("spiffe://td/xfer/client/{name}"))])).unwrap();
            assert_eq!(c.name, name);
        }
    }

    #[test]
    fn a_pinned_trust_domain_refuses_others() {
        let pinned = RolePolicy::new("prod.example", &[]);
        assert!(pinned.caller_of(&cert_with(vec![uri("spiffe://prod.example/xfer/node/a")])).is_ok());
        assert!(pinned.caller_of(&cert_with(vec![uri("spiffe://dev.example/xfer/node/a")])).is_err());
        // The first URI with a role in the pinned domain wins, whatever precedes it.
        let c = pinned
            .caller_of(&cert_with(vec![uri("spiffe://dev.example/xfer/admin/a"), uri("spiffe://prod.example/xfer/client/b")]))
            .unwrap();
        assert_eq!((c.role, c.name.as_str()), (Role::Client, "b"));
        // Two role URIs that disagree: no role, whatever their order.
        for sans in [
            vec![uri("spiffe://prod.example/xfer/client/a"), uri("spiffe://prod.example/xfer/node/a")],
            vec![uri("spiffe://prod.example/xfer/node/a"), uri("spiffe://prod.example/xfer/client/a")],
            vec![uri("spiffe://prod.example/xfer/node/a"), uri("spiffe://prod.example/xfer/node/b")],
        ] {
            assert!(matches!(pinned.caller_of(&cert_with(sans)), Err(AuthError::Ambiguous(_))));
        }
        // The same one twice is not a conflict.
        let same = vec![uri("spiffe://prod.example/xfer/node/a"), uri("spiffe://prod.example/xfer/node/a")];
        assert_eq!(pinned.caller_of(&cert_with(same)).unwrap().name, "a");
    }

    #[test]
    fn dns_patterns_map_roles_for_cas_without_uri_sans() {
        let p = RolePolicy::new(
            "",
            &[
                DnsRole { pattern: "*.nodes.example.com".into(), role: RoleName::Node },
                DnsRole { pattern: "ops.example.com".into(), role: RoleName::Admin },
            ],
        );
        let c = p.caller_of(&cert_with(vec![dns("gpu-17.nodes.example.com")])).unwrap();
        assert_eq!(c, Caller { role: Role::Node, name: "gpu-17".into() });
        let c = p.caller_of(&cert_with(vec![dns("ops.example.com")])).unwrap();
        assert_eq!(c, Caller { role: Role::Admin, name: "ops.example.com".into() });
        // `*` is one label, not several, and not empty.
        assert!(p.caller_of(&cert_with(vec![dns("a.b.nodes.example.com")])).is_err());
        assert!(p.caller_of(&cert_with(vec![dns("nodes.example.com")])).is_err());
        assert!(check_dns_pattern("*.nodes.example.com").is_ok());
        assert!(check_dns_pattern("*").is_err());
        assert!(check_dns_pattern("a.*.com").is_err());
    }

    #[test]
    fn the_table_denies_by_default() {
        assert_eq!(required("/xfer.v1.Peer/Grant"), Some(Need::Node));
        // Even the no-op baseline call is for agents only.
        assert_eq!(required("/xfer.v1.Peer/Ping"), Some(Need::Node));
        assert_eq!(required("/xfer.v1.Agent/CreateRegion"), Some(Need::Client));
        assert_eq!(required("/xfer.v1.Agent/Bench"), Some(Need::Admin));
        assert_eq!(required("/xfer.v1.Agent/TcpBaseline"), Some(Need::Admin));
        assert_eq!(required("/grpc.health.v1.Health/Check"), Some(Need::AnyRole));
        assert_eq!(required("/xfer.v2.Agent/CreateRegion"), None);
        assert_eq!(required("/nope"), None);
        assert_eq!(required(""), None);
        assert!(Need::Client.allows(Role::Admin));
        assert!(!Need::Client.allows(Role::Node));
        assert!(!Need::Node.allows(Role::Admin));
        assert!(!Need::Admin.allows(Role::Client));
        assert!(Need::Admin.allows(Role::Plaintext));
    }

    #[test]
    fn method_labels_are_the_served_methods() {
        assert_eq!(method_label("/xfer.v1.Peer/Grant"), "xfer.v1.Peer/Grant");
        assert_eq!(method_label("/xfer.v1.Agent/Bench"), "xfer.v1.Agent/Bench");
        assert_eq!(method_label("/grpc.health.v1.Health/Check"), "grpc.health.v1.Health/Check");
        assert_eq!(method_label("/xfer.v1.Agent/NoSuchMethod"), "unknown");
        assert_eq!(method_label("/x"), "unknown");
    }

    #[test]
    fn plaintext_names_collapse_loopback() {
        let a = |s: &str| Some(s.parse::<SocketAddr>().unwrap());
        assert_eq!(plaintext_name(a("127.0.0.1:5000")), "loopback");
        assert_eq!(plaintext_name(a("127.9.9.9:1")), "loopback");
        assert_eq!(plaintext_name(a("[::1]:1")), "loopback");
        assert_eq!(plaintext_name(a("[::ffff:127.0.0.2]:1")), "loopback");
        assert_eq!(plaintext_name(a("10.1.2.3:9")), "10.1.2.3");
        assert_eq!(plaintext_name(a("[::ffff:10.1.2.3]:9")), "10.1.2.3");
    }
}
