//! Start-up and shutdown: choose the fabric, restore regions, serve gRPC and metrics, and drain
//! on SIGTERM. `main.rs` only parses flags and calls [`run`].
use std::net::SocketAddr;
use std::os::unix::fs::DirBuilderExt;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{Config, FabricChoice, Fallback};
use crate::grants::GrantTable;
use crate::node::Node;
use crate::service::tls::TlsMaterial;
use crate::service::Services;
use xfer_fabric::tcp::{DataLimits, Serving, TcpFabric};
use xfer_fabric::{Fabric, FabricError};

/// Why the agent could not start. Each message is complete on its own (no `source()` chain that
/// would repeat it): `main` prints it once.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("state dir {path}: {error}")]
    StateDir { path: String, error: std::io::Error },
    #[error("cannot bind {addr} ({key}): {error}")]
    Bind { key: &'static str, addr: SocketAddr, error: std::io::Error },
    #[error("fabric: {0}")]
    Fabric(FabricError),
    /// A setting that only the opened fabric shows to be unusable (`transfer.qps` × the devices
    /// `verbs.devices = auto` found).
    #[error("invalid configuration: {0}")]
    Config(crate::config::ConfigError),
    #[error("region catalog: {0}")]
    Catalog(crate::regions::RegionError),
    #[error("metrics exporter: {0}")]
    Metrics(crate::metrics::InstallError),
    #[error("ready file {path}: {error}")]
    ReadyFile { path: String, error: std::io::Error },
    #[error("{0}")]
    Tls(crate::service::tls::TlsError),
    #[error("gRPC server: {0}")]
    Grpc(String),
    #[error("cannot install the SIGBUS handler: {0}")]
    Sigbus(std::io::Error),
    #[error("unix socket {path}: {error}")]
    Unix { path: String, error: std::io::Error },
}

impl StartError {
    /// A start error that a change of configuration fixes (exit 64, like a configuration that
    /// does not load): a setting only the opened fabric shows to be unusable, TLS files that do
    /// not fit together.
    pub fn is_bad_configuration(&self) -> bool {
        matches!(self, StartError::Config(_) | StartError::Tls(_))
    }
}

/// The socket file the agent bound at `unix_listen`, known by its inode: on shutdown the agent
/// removes the file at the path only if it is still this one, never what someone (another agent,
/// an operator) put there since.
#[derive(Debug, Clone)]
struct UnixSocketFile {
    path: std::path::PathBuf,
    dev: u64,
    ino: u64,
}

impl UnixSocketFile {
    fn remove_if_ours(&self) {
        use std::os::unix::fs::MetadataExt;
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) if m.dev() == self.dev && m.ino() == self.ino => {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    warn!(path = %self.path.display(), error = %e, "could not remove the unix socket");
                }
            }
            Ok(_) => warn!(path = %self.path.display(), "the unix socket path holds something else now; left alone"),
            Err(_) => {}
        }
    }
}

/// The directory the unix socket `path` lives in (`.` for a bare name).
fn socket_dir(path: &std::path::Path) -> &std::path::Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."))
}

/// Serializes [`bind_unix`]'s check-then-bind between processes: an exclusive `flock(2)` on the
/// socket's directory, held only while binding. Without it, two agents starting at once on one
/// stale socket could both judge it stale, and the second would delete the socket the first had
/// just put in place. No file is created for it (the directory itself is locked). A lock held
/// by someone else for longer than `wait` (`unix_lock_wait`) is an error, not an endless wait.
async fn lock_socket_dir(path: &std::path::Path, wait: Duration) -> Result<nix::fcntl::Flock<std::fs::File>, StartError> {
    use std::os::unix::fs::OpenOptionsExt;
    let err = |error: std::io::Error| StartError::Unix { path: path.display().to_string(), error };
    let parent = socket_dir(path);
    let mut dir =
        std::fs::OpenOptions::new().read(true).custom_flags(nix::libc::O_DIRECTORY | nix::libc::O_CLOEXEC).open(parent).map_err(err)?;
    let deadline = tokio::time::Instant::now() + wait;
    let mut told = false;
    loop {
        match nix::fcntl::Flock::lock(dir, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return Ok(lock),
            Err((back, nix::errno::Errno::EWOULDBLOCK)) => {
                if tokio::time::Instant::now() >= deadline {
                    return Err(err(std::io::Error::new(
                        std::io::ErrorKind::WouldBlock,
                        format!(
                            "{} stayed locked for {} (unix_lock_wait) by another process (another agent binding there?)",
                            parent.display(),
                            humantime::format_duration(wait)
                        ),
                    )));
                }
                if !told {
                    warn!(dir = %parent.display(), "waiting for the lock on the unix socket's directory (another process is binding there)");
                    told = true;
                }
                dir = back;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err((_, e)) => return Err(err(e.into())),
        }
    }
}

/// Binds the local unix socket at `path` with `mode` and `gid`, so that nobody outside them can
/// ever reach it: the socket is bound inside a fresh 0700 directory next to `path`, given its
/// mode and group there, and only then linked into place, which fails if anything appeared at
/// `path` meanwhile (nothing is ever replaced). A stale socket at `path` (connecting is refused:
/// nothing listens) is removed first; anything else there — a socket that may be live (a
/// datagram socket, one the agent may not connect to), a file, a directory, a symlink — is an
/// error, never removed. The caller holds [`lock_socket_dir`]'s lock.
fn bind_unix(path: &std::path::Path, mode: u32, gid: Option<u32>) -> Result<(tokio::net::UnixListener, UnixSocketFile), StartError> {
    use std::io::{Error, ErrorKind};
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
    let err = |error: Error| StartError::Unix { path: path.display().to_string(), error };
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => return Err(err(Error::new(ErrorKind::AddrInUse, "another process serves on it"))),
            // Only ECONNREFUSED says nobody listens. EACCES (a socket of another uid) or
            // EPROTOTYPE (a datagram socket, like /dev/log) say nothing about whether it is live.
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => std::fs::remove_file(path).map_err(err)?,
            Err(e) => {
                return Err(err(Error::new(
                    ErrorKind::AddrInUse,
                    format!("a socket that may be in use ({e}); remove it yourself if it is stale"),
                )))
            }
        },
        Ok(_) => return Err(err(Error::new(ErrorKind::AlreadyExists, "exists and is not a socket"))),
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let parent = socket_dir(path);
    let private = tempfile::Builder::new().prefix(".xfer-agent-sock").tempdir_in(parent).map_err(err)?;
    std::fs::set_permissions(private.path(), std::fs::Permissions::from_mode(0o700)).map_err(err)?;
    let tmp = private.path().join("sock");
    let listener = tokio::net::UnixListener::bind(&tmp).map_err(err)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode)).map_err(err)?;
    if let Some(g) = gid {
        nix::unistd::chown(&tmp, None, Some(nix::unistd::Gid::from_raw(g))).map_err(|e| err(Error::from(e)))?;
    }
    let meta = std::fs::symlink_metadata(&tmp).map_err(err)?;
    // link(2), unlike rename(2), never replaces what is at `path` (EEXIST): something put there
    // since the check above stays. The private directory and its name go when `private` drops.
    std::fs::hard_link(&tmp, path).map_err(|e| match e.kind() {
        ErrorKind::AlreadyExists => err(Error::new(ErrorKind::AlreadyExists, "something appeared at the path while binding; left alone")),
        _ => err(e),
    })?;
    Ok((listener, UnixSocketFile { path: path.to_path_buf(), dev: meta.dev(), ino: meta.ino() }))
}

/// Binds a listener for the setting `key`; the error says so.
async fn bind(key: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr).await.map_err(|error| StartError::Bind { key, addr, error })
}

/// Picks and opens the fabric; returns it with the reason (shown in logs and GetInfo).
async fn open_fabric(cfg: &Config, grants: &Arc<GrantTable>, tls: Option<&TlsMaterial>) -> Result<(Arc<dyn Fabric>, String), StartError> {
    let want_verbs = match cfg.fabric {
        FabricChoice::Tcp => false,
        FabricChoice::Verbs => true,
        FabricChoice::Auto => match xfer_fabric::verbs::usable_device(&cfg.verbs_options()) {
            Ok(dev) => {
                info!(device = %dev, "auto: usable RDMA device found");
                true
            }
            Err(why) => {
                info!(reason = %why, "auto: no usable RDMA device; using the tcp fabric");
                if cfg.transfer.fallback == Fallback::Tcp {
                    info!("transfer.fallback = tcp means nothing on the tcp fabric (every path is tcp already); ignored");
                }
                return Ok((open_tcp(cfg, grants, tls, Serving::Connections).await?, format!("auto: {why}; using tcp")));
            }
        },
    };
    if want_verbs {
        // The fallback's data listener serves like a tcp agent's (same limits, same TLS); on a
        // real node it binds the node's primary network (`data_listen`), not an RDMA link.
        let fallback = match cfg.transfer.fallback {
            Fallback::Never => None,
            Fallback::Tcp => Some(open_tcp(cfg, grants, tls, Serving::StandbyRails).await?),
        };
        let with_tcp = fallback.is_some();
        let f = xfer_fabric::verbs::open_fabric_with_fallback(cfg.verbs_options(), grants.clone(), fallback).map_err(StartError::Fabric)?;
        // `auto` found how many devices every connection offers its QPs on.
        cfg.check_endpoints(f.device_states().len()).map_err(StartError::Config)?;
        let reason = if cfg.fabric == FabricChoice::Auto { "auto: usable RDMA device" } else { "configured: verbs" };
        let reason = if with_tcp { format!("{reason}, tcp fallback") } else { reason.to_string() };
        return Ok((f, reason));
    }
    if cfg.transfer.fallback == Fallback::Tcp {
        info!("transfer.fallback = tcp means nothing on the tcp fabric (every path is tcp already); ignored");
    }
    Ok((open_tcp(cfg, grants, tls, Serving::Connections).await?, "configured: tcp".to_string()))
}

/// The TCP fabric checks every frame against the agent's grant table; with mTLS its data
/// streams are TLS with the same certificates.
async fn open_tcp(
    cfg: &Config,
    grants: &Arc<GrantTable>,
    tls: Option<&TlsMaterial>,
    serving: Serving,
) -> Result<Arc<dyn Fabric>, StartError> {
    let listener = bind("data_listen", cfg.data_listen_addr()).await?;
    let l = &cfg.limits;
    let nofile = crate::sys::nofile();
    let max_connections = match crate::sys::clamp_connections(l.max_data_connections, nofile) {
        Some(clamped) => {
            warn!(
                configured = l.max_data_connections,
                enforced = clamped,
                nofile,
                "limits.max_data_connections is more than half the open-file limit (RLIMIT_NOFILE); enforcing half of it. \
                 Raise LimitNOFILE (or the container's nofile ulimit) to allow more"
            );
            clamped
        }
        None => l.max_data_connections,
    };
    crate::metrics::limit("open_files", nofile);
    crate::metrics::limit("max_data_connections", max_connections as u64);
    crate::metrics::limit("max_data_connections_per_peer", l.max_data_connections_per_peer as u64);
    crate::metrics::limit_seconds("data_handshake_timeout", l.data_handshake_timeout.0);
    crate::metrics::limit_seconds("data_idle_timeout", l.data_idle_timeout.0);
    crate::metrics::limit_seconds("data_payload_timeout", l.data_payload_timeout.0);
    // Pending sockets are part of the total, and never all of it.
    let max_pending = l.max_pending_data_connections.min(max_connections.div_ceil(2));
    crate::metrics::limit("max_pending_data_connections", max_pending as u64);
    let limits = DataLimits {
        max_pending,
        max_connections,
        max_connections_per_peer: l.max_data_connections_per_peer,
        handshake_timeout: l.data_handshake_timeout.0,
        idle_timeout: l.data_idle_timeout.0,
        payload_timeout: l.data_payload_timeout.0,
    };
    let fabric = TcpFabric::serve(listener, grants.clone(), tls.map(|t| t.data.clone()), limits, serving).map_err(StartError::Fabric)?;
    Ok(Arc::new(fabric))
}

/// The bound address of a listener (the port the OS chose if `configured` has port 0).
fn local_addr(key: &'static str, configured: SocketAddr, l: &TcpListener) -> Result<SocketAddr, StartError> {
    l.local_addr().map_err(|error| StartError::Bind { key, addr: configured, error })
}

/// What the agent bound, as written to `ready_file`: JSON
/// `{"grpc": "IP:PORT", "data": "IP:PORT" | null, "metrics": "IP:PORT", "health": "IP:PORT" | null,
/// "unix": "PATH" | null}` (`data`: the tcp fabric's data listener, also a verbs agent's with
/// `transfer.fallback = tcp`; null on verbs otherwise. `health`: null
/// unless `health_listen`; `unix`: null unless `unix_listen`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Bound {
    pub grpc: SocketAddr,
    pub data: Option<SocketAddr>,
    pub metrics: SocketAddr,
    pub health: Option<SocketAddr>,
    #[serde(default)]
    pub unix: Option<std::path::PathBuf>,
}

impl Bound {
    /// Writes the JSON to `path` through a temporary file and a rename, so a reader sees the
    /// whole file or none. The temporary file is a new one of its own (`O_EXCL | O_NOFOLLOW`,
    /// [`crate::safe_file`]): the agent runs as root and the ready file's directory may be
    /// writable by others, who must not be able to plant a link the agent writes through.
    pub fn write(&self, path: &std::path::Path) -> std::io::Result<()> {
        let json = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        crate::safe_file::write_atomically(path, &json, 0o644)
    }
}

/// Runs the agent until `shutdown` is cancelled, then drains and returns.
pub async fn run(cfg: Config, shutdown: CancellationToken) -> Result<(), StartError> {
    // Before any region is mapped: a file that shrinks under its mapping poisons that region
    // instead of killing the agent (xfer_rdma::sigbus; file mappings also install it on first use).
    xfer_rdma::sigbus::install().map_err(StartError::Sigbus)?;
    std::fs::create_dir_all(&cfg.state_dir).map_err(|error| StartError::StateDir { path: cfg.state_dir.display().to_string(), error })?;
    if cfg.regions.file_roots.is_empty() {
        // The default file root, private to the agent: only root (the node's admin) puts files
        // (or links) there.
        let files = cfg.state_dir.join("files");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&files)
            .map_err(|error| StartError::StateDir { path: files.display().to_string(), error })?;
    }
    for root in cfg.regions.effective_file_roots(&cfg.state_dir) {
        if !root.is_dir() {
            warn!(root = %root.display(), "regions.file_roots entry is not a directory; file regions under it will be refused");
        }
    }
    log_limits();
    let tls = if cfg.insecure {
        if cfg.allow_plaintext_network {
            warn!(
                listen = %cfg.listen,
                "plaintext gRPC and data plane on the network (allow_plaintext_network = true): anyone who can reach \
                 these ports can read and write this node's registered memory"
            );
        } else {
            info!("plaintext on loopback only (insecure = true): every local process is trusted");
        }
        if !(cfg.tls.cert.is_empty() && cfg.tls.key.is_empty() && cfg.tls.ca.is_empty()) {
            warn!("tls.cert/tls.key/tls.ca are set but ignored because insecure = true");
        }
        None
    } else {
        let t = Arc::new(TlsMaterial::load(&cfg.tls).map_err(StartError::Tls)?);
        info!(identity = %t.own.name, "mTLS on: callers need a certificate with a role (node, client, admin); the data plane is TLS too");
        if t.own.name != cfg.node_name {
            warn!(identity = %t.own.name, node = %cfg.node_name, "the certificate's node NAME differs from node_name: peers key this agent's grants and limits on the certificate's NAME");
        }
        Some(t)
    };
    if let Some(path) = &cfg.ready_file {
        // A ready file that exists is this run's: a stale one from an earlier run goes first.
        match std::fs::remove_file(path) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                return Err(StartError::ReadyFile { path: path.display().to_string(), error })
            }
            _ => {}
        }
    }
    let listener = bind("listen", cfg.listen).await?;
    let health_listener = match cfg.health_listen {
        Some(a) => {
            let l = bind("health_listen", a).await?;
            let bound = local_addr("health_listen", a, &l)?;
            Some((l, bound))
        }
        None => None,
    };
    let metrics_listener = bind("metrics_listen", cfg.metrics_listen).await?;
    let metrics_addr = local_addr("metrics_listen", cfg.metrics_listen, &metrics_listener)?;
    let exposition = crate::metrics::install().map_err(StartError::Metrics)?;
    crate::admin::spawn(metrics_listener, exposition);
    crate::metrics::set_peer_label_limit(cfg.limits.max_peer_labels);
    let grants = Arc::new(GrantTable::new(cfg.limits.max_grants_per_peer));
    let (fabric, reason) = open_fabric(&cfg, &grants, tls.as_deref()).await?;
    let info = fabric.info();
    let device = info.devices.first().map(|d| d.name.clone()).unwrap_or_default();
    crate::metrics::fabric_info(&fabric.kind().to_string(), &device);
    let devices: Vec<String> = info.devices.iter().map(|d| format!("{}:{}", d.name, d.port)).collect();
    info!(fabric = %fabric.kind(), %reason, devices = %devices.join(","), data = ?info.data_address, "fabric ready");
    crate::metrics::limit("max_peers", cfg.limits.max_peers as u64);
    let node = Node::new(cfg.clone(), fabric, reason, grants, crate::service::client::connector(tls.clone()));
    let restored = node.restore_regions().map_err(StartError::Catalog)?;
    if restored > 0 {
        info!(regions = restored, "restored regions from the catalog");
    }
    node.spawn_reapers(shutdown.clone());

    let local = local_addr("listen", cfg.listen, &listener)?;
    let health = tonic_health::server::HealthReporter::new();
    let router = Services::new(node.clone())
        .router(cfg.limits.max_message_size.0 as usize, cfg.limits.grpc_keepalive(), tls.as_deref(), health.clone())
        .await
        .map_err(StartError::Grpc)?;
    // gRPC stops accepting when draining starts; in-flight transfers keep their connections.
    let stop_grpc = CancellationToken::new();
    let health_addr = health_listener.as_ref().map(|(_, a)| *a);
    if let Some((l, probe)) = health_listener {
        let stop = stop_grpc.clone();
        let cap = crate::sys::probe_cap(crate::sys::nofile());
        let incoming = Box::pin(crate::sys::incoming_with_backoff(l, "health", crate::sys::ConnLimit::new("health", cap)));
        let server = crate::service::health_router(&health);
        tokio::spawn(async move {
            if let Err(e) = server.serve_with_incoming_shutdown(incoming, stop.cancelled_owned()).await {
                warn!(error = %e, "health listener stopped");
            }
        });
        info!(health = %probe, "plaintext health listener (grpc.health.v1 only) for probes");
    }

    // The local unix socket (no TLS; callers known by uid, client role).
    let unix = match &cfg.unix_listen {
        None => None,
        Some(path) => {
            let gid = cfg.unix_gid().map_err(|e| StartError::Grpc(e.to_string()))?;
            let lock = lock_socket_dir(path, cfg.unix_lock_wait.0).await?;
            let (listener, file) = bind_unix(path, cfg.unix_mode.0, gid)?;
            drop(lock);
            let router = Services::new(node.clone())
                .local_router(cfg.limits.max_message_size.0 as usize, cfg.limits.grpc_keepalive(), &health)
                .map_err(StartError::Grpc)?;
            let stop = stop_grpc.clone();
            // Counted and capped like the gRPC port, with the same back-off on EMFILE: local
            // applications cannot take the descriptors region files and the data plane need.
            let cap = crate::sys::unix_cap(cfg.limits.max_grpc_connections, crate::sys::nofile());
            let incoming = Box::pin(crate::sys::incoming_with_backoff(listener, "unix", crate::sys::ConnLimit::new("unix", cap)));
            tokio::spawn(async move {
                if let Err(e) = router.serve_with_incoming_shutdown(incoming, stop.cancelled_owned()).await {
                    warn!(error = %e, "unix socket listener stopped");
                }
            });
            info!(path = %path.display(), mode = format!("{:04o}", cfg.unix_mode.0), "local unix socket (xfer.v1.Agent, client role by uid)");
            Some(file)
        }
    };

    let server = {
        let stop = stop_grpc.clone();
        let cap = crate::sys::grpc_cap(cfg.limits.max_grpc_connections, crate::sys::nofile());
        let incoming = crate::sys::incoming_with_backoff(listener, "grpc", crate::sys::ConnLimit::new("grpc", cap));
        match tls.as_deref() {
            Some(t) => {
                let incoming = Box::pin(crate::service::handshake::tls_incoming(
                    incoming,
                    t.grpc_server_config(),
                    crate::service::tls::HANDSHAKE_TIMEOUT,
                    // Half the slots at most for sockets not yet authenticated: the rest stay
                    // for clients with certificates (a newer pending socket closes the oldest).
                    cap.div_ceil(2),
                ));
                tokio::spawn(async move { router.serve_with_incoming_shutdown(incoming, stop.cancelled_owned()).await })
            }
            None => {
                let incoming = Box::pin(incoming);
                tokio::spawn(async move { router.serve_with_incoming_shutdown(incoming, stop.cancelled_owned()).await })
            }
        }
    };
    // Every listener is bound and served: report the addresses (ports chosen by the OS for port 0
    // included), in this log line and, if configured, the ready file.
    let bound = Bound {
        grpc: local,
        data: info.data_address,
        metrics: metrics_addr,
        health: health_addr,
        unix: unix.as_ref().map(|f| f.path.clone()),
    };
    if let Some(path) = &cfg.ready_file {
        bound.write(path).map_err(|error| StartError::ReadyFile { path: path.display().to_string(), error })?;
    }
    info!(
        node = %cfg.node_name,
        grpc = %bound.grpc,
        data = %bound.data.map(|a| a.to_string()).unwrap_or_else(|| "-".into()),
        metrics = %bound.metrics,
        health = %bound.health.map(|a| a.to_string()).unwrap_or_else(|| "-".into()),
        "xfer-agent serving"
    );
    shutdown.cancelled().await;
    info!(grace = ?cfg.shutdown.grace.0, "shutting down: draining transfers");
    health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
    node.drain(cfg.shutdown.grace.0).await;
    stop_grpc.cancel();
    match tokio::time::timeout(Duration::from_secs(5), server).await {
        Ok(Ok(Err(e))) => warn!(error = %e, "gRPC server ended with an error"),
        Err(_) => warn!("gRPC server did not stop within 5 s"),
        _ => {}
    }
    if let Some(f) = &unix {
        f.remove_if_ours();
    }
    info!("xfer-agent stopped");
    Ok(())
}

fn log_limits() {
    // Sockets and region files are descriptors; systemd's default soft limit (1024) is far below
    // what the data-port and peer caps allow, so take everything the hard limit gives.
    match crate::sys::raise_nofile() {
        Ok((before, soft, hard)) => info!(nofile_soft_before = before, nofile_soft = soft, nofile_hard = hard, "RLIMIT_NOFILE"),
        Err(e) => warn!(error = %e, "could not raise RLIMIT_NOFILE to its hard limit"),
    }
    let (soft, hard) = crate::sys::memlock();
    let cap = crate::sys::cap_ipc_lock();
    let fmt = |v: u64| if v == u64::MAX { "unlimited".to_string() } else { format!("{v}") };
    info!(memlock_soft = %fmt(soft), memlock_hard = %fmt(hard), cap_ipc_lock = cap, "process limits");
    if !cap && soft != u64::MAX && soft < (64 << 20) {
        warn!(
            memlock = %fmt(soft),
            "RLIMIT_MEMLOCK is low and CAP_IPC_LOCK is missing: verbs memory registration will fail beyond it. \
             Fix: `ulimit -l unlimited`, LimitMEMLOCK=infinity in the service unit, or grant CAP_IPC_LOCK"
        );
    }
}
