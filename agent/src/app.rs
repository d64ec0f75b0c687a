//! Start-up and shutdown: choose the fabric, restore regions, serve gRPC and metrics, and drain
//! on SIGTERM. `main.rs` only parses flags and calls [`run`].
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{Config, FabricChoice};
use crate::fabric::tcp::TcpFabric;
use crate::fabric::{Fabric, FabricError};
use crate::grants::GrantTable;
use crate::node::Node;
use crate::service::tls::TlsMaterial;
use crate::service::Services;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("state dir {path}: {source}")]
    StateDir { path: String, source: std::io::Error },
    #[error("fabric: {0}")]
    Fabric(#[from] FabricError),
    #[error("region catalog: {0}")]
    Catalog(#[from] crate::regions::RegionError),
    #[error("metrics: {0}")]
    Metrics(String),
    #[error(transparent)]
    Tls(#[from] crate::service::tls::TlsError),
    #[error("gRPC listener {addr}: {detail}")]
    Listen { addr: String, detail: String },
}

/// Picks and opens the fabric; returns it with the reason (shown in logs and GetInfo).
async fn open_fabric(cfg: &Config, grants: &Arc<GrantTable>) -> Result<(Arc<dyn Fabric>, String), StartError> {
    let want_verbs = match cfg.fabric {
        FabricChoice::Tcp => false,
        FabricChoice::Verbs => true,
        FabricChoice::Auto => match crate::verbs::usable_device(cfg) {
            Ok(dev) => {
                info!(device = %dev, "auto: usable RDMA device found");
                true
            }
            Err(why) => {
                info!(reason = %why, "auto: no usable RDMA device; using the tcp fabric");
                return Ok((open_tcp(cfg, grants).await?, format!("auto: {why}; using tcp")));
            }
        },
    };
    if want_verbs {
        let f = crate::verbs::open_fabric(cfg)?;
        let reason = if cfg.fabric == FabricChoice::Auto { "auto: usable RDMA device" } else { "configured: verbs" };
        return Ok((f, reason.to_string()));
    }
    Ok((open_tcp(cfg, grants).await?, "configured: tcp".to_string()))
}

/// The TCP fabric checks every frame against the agent's grant table.
async fn open_tcp(cfg: &Config, grants: &Arc<GrantTable>) -> Result<Arc<dyn Fabric>, StartError> {
    Ok(Arc::new(TcpFabric::bind(cfg.data_listen, grants.clone()).await?))
}

/// Runs the agent until `shutdown` is cancelled, then drains and returns.
pub async fn run(cfg: Config, shutdown: CancellationToken) -> Result<(), StartError> {
    std::fs::create_dir_all(&cfg.state_dir)
        .map_err(|e| StartError::StateDir { path: cfg.state_dir.display().to_string(), source: e })?;
    log_limits();
    crate::metrics::install(cfg.metrics_listen).map_err(StartError::Metrics)?;
    let grants = Arc::new(GrantTable::new(cfg.limits.max_grants_per_peer));
    let (fabric, reason) = open_fabric(&cfg, &grants).await?;
    let info = fabric.info();
    let device = info.devices.first().map(|d| d.name.clone()).unwrap_or_default();
    crate::metrics::fabric_info(&fabric.kind().to_string(), &device);
    info!(fabric = %fabric.kind(), %reason, data = ?info.data_address, "fabric ready");
    let tls = if cfg.insecure {
        warn!("gRPC is plaintext (insecure = true): do not expose this agent on an untrusted network");
        if !(cfg.tls.cert.is_empty() && cfg.tls.key.is_empty() && cfg.tls.ca.is_empty()) {
            warn!("tls.cert/tls.key/tls.ca are set but ignored because insecure = true");
        }
        None
    } else {
        let t = Arc::new(TlsMaterial::load(&cfg.tls)?);
        info!(identity = %t.own_identity, "mTLS on: client certificates required, grants bound to the caller's certificate identity");
        if t.own_identity != cfg.node_name {
            warn!(identity = %t.own_identity, node = %cfg.node_name, "tls.cert's identity differs from node_name: peers bind this agent's grants to the certificate identity");
        }
        Some(t)
    };
    let node = Node::new(cfg.clone(), fabric, reason, grants, tls.clone());
    let restored = node.regions.restore()?;
    if restored > 0 {
        info!(regions = restored, "restored regions from the catalog");
    }
    node.spawn_reapers(shutdown.clone());

    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| StartError::Listen { addr: cfg.listen.to_string(), detail: e.to_string() })?;
    let local = listener.local_addr().map_err(|e| StartError::Listen { addr: cfg.listen.to_string(), detail: e.to_string() })?;
    let router = Services::new(node.clone())
        .router(cfg.limits.max_message_size.0 as usize, tls.as_deref())
        .await
        .map_err(|e| StartError::Listen { addr: local.to_string(), detail: e })?;
    info!(node = %cfg.node_name, grpc = %local, metrics = %cfg.metrics_listen, "xfer-agent serving");

    // gRPC stops accepting when draining starts; in-flight transfers keep their connections.
    let stop_grpc = CancellationToken::new();
    let server = {
        let stop = stop_grpc.clone();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        tokio::spawn(async move { router.serve_with_incoming_shutdown(incoming, stop.cancelled_owned()).await })
    };
    shutdown.cancelled().await;
    info!(grace = ?cfg.shutdown.grace.0, "shutting down: draining transfers");
    node.drain(cfg.shutdown.grace.0).await;
    stop_grpc.cancel();
    match tokio::time::timeout(Duration::from_secs(5), server).await {
        Ok(Ok(Err(e))) => warn!(error = %e, "gRPC server ended with an error"),
        Err(_) => warn!("gRPC server did not stop within 5 s"),
        _ => {}
    }
    info!("xfer-agent stopped");
    Ok(())
}

fn log_limits() {
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
