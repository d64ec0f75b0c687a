//! The verbs fabric: device/GID selection, negotiation, connections and grants over RC QPs — safe
//! code over the raw verbs objects of the `xfer-rdma` crate, which holds every `unsafe`
//! (region memory, the SIGBUS guard, CQ/QP/MR/MW and posting). This module has none.
//!
//! # Layout (feature `verbs`)
//! * [`device`]: device/port discovery, the GID table (from verbs + sysfs), GID selection, `probe`.
//! * [`negotiate`]: pure checks of a peer's endpoints (link layer, GID type, MTU, PSN...) — no IO.
//! * `mr`: region registrations (access flags per grant mode) over `xfer_rdma::mr::Mr`.
//! * `connection`: a set of `xfer_rdma::qp::RcQp`s to one peer sharing one CQ, completion
//!   delivery, and the tokio task that drives the CQ from its channel through `AsyncFd`
//!   (`xfer_rdma::cq::watch_channel`). The QPs' in-flight lists (in `xfer-rdma`) keep posted
//!   memory alive.
//! * `initiator`: the initiator half (`VerbsConnection`): posting and completion polling.
//! * `responder`: the responder half (`VerbsAccepted`) and grant mode `mw`: window binds on
//!   its QPs and what an `mw` grant keeps alive (`MwGrant`).
//! * `markers`: the responder's notification markers (receive CQ, receive task);
//!   `marker_poll`: the thread that busy-polls them while a notification is due.
//! * [`select`]: which probed ports the fabric opens (`auto`: every device up now or later).
//! * [`options`]: the fabric's settings ([`VerbsOptions`], [`GrantMode`]), validated.
//! * [`prebuilt`]: the bookkeeping of connections built ahead of need (generic, no verbs).
//! * `fabric`: [`VerbsFabric`], the `Fabric` implementation tying it together.
//! * [`rails`]: [`RailsFabric`], one fabric over several devices, each a `VerbsFabric`.
//!
//! sideway's safe API is used here for the device list, device context and PD.
use std::sync::Arc;

use crate::{Fabric, FabricError};

#[cfg(feature = "verbs")]
mod connection;
#[cfg(feature = "verbs")]
pub mod device;
#[cfg(feature = "verbs")]
mod fabric;
#[cfg(feature = "verbs")]
mod initiator;
#[cfg(feature = "verbs")]
mod marker_poll;
#[cfg(feature = "verbs")]
mod markers;
#[cfg(feature = "verbs")]
mod mr;
#[cfg(feature = "verbs")]
pub mod negotiate;
pub mod options;
pub mod prebuilt;
#[cfg(feature = "verbs")]
pub mod rails;
#[cfg(feature = "verbs")]
mod responder;
pub mod select;

#[cfg(feature = "verbs")]
pub use device::probe;
#[cfg(feature = "verbs")]
pub use fabric::VerbsFabric;
pub use options::{DeviceSpec, GrantMode, VerbsOptions, MAX_PREBUILT};
#[cfg(feature = "verbs")]
pub use rails::RailsFabric;

#[cfg(feature = "verbs")]
impl From<xfer_rdma::VerbsError> for FabricError {
    fn from(e: xfer_rdma::VerbsError) -> Self {
        use xfer_rdma::VerbsError as E;
        match e {
            E::Setup { step, attr, detail } => FabricError::Negotiation { step, attr, detail },
            E::Registration(s) => FabricError::Registration(s),
            E::LocalRange(s) => FabricError::LocalRange(s),
            E::Other(s) => FabricError::Other(s),
            E::Io(e) => FabricError::Io(e),
        }
    }
}

/// Name of a usable device (an ACTIVE port), or why there is none: `fabric = auto` picks the
/// verbs fabric with it. With `verbs.devices` listed, every listed port must exist with a
/// known link layer and at least one must be usable now; the others are opened and used once
/// their port is ACTIVE.
#[cfg(feature = "verbs")]
pub fn usable_device(opts: &VerbsOptions) -> Result<String, String> {
    use select::{port_use, PortUse};
    let devices = probe(opts).map_err(|e| e.to_string())?;
    if let Some(list) = &opts.devices {
        let port = |s: &DeviceSpec| u32::from(s.port.unwrap_or(opts.port));
        let state = |s: &DeviceSpec| devices.iter().find(|d| d.name == s.name && d.port == port(s)).map(port_use);
        let missing: Vec<String> = list
            .iter()
            .filter(|s| matches!(state(s), None | Some(PortUse::Never(_))))
            .map(|s| format!("{} port {}", s.name, port(s)))
            .collect();
        if !missing.is_empty() {
            return Err(format!("listed RDMA devices missing or without a usable port: {}", missing.join(", ")));
        }
        if !list.iter().any(|s| state(s) == Some(PortUse::Now)) {
            return Err("no listed RDMA device has an active port with a usable GID yet".into());
        }
        return Ok(list
            .iter()
            .map(|s| format!("{} port {}{}", s.name, port(s), if state(s) == Some(PortUse::Now) { "" } else { " (not ACTIVE yet)" }))
            .collect::<Vec<_>>()
            .join(", "));
    }
    if devices.is_empty() {
        return Err("no RDMA devices found".into());
    }
    devices.iter().find(|d| port_use(d) == PortUse::Now).map(|d| format!("{} port {}", d.name, d.port)).ok_or_else(|| {
        let seen: Vec<String> = devices.iter().map(|d| format!("{} port {} {}", d.name, d.port, d.state)).collect();
        format!("no RDMA device with an active port and a usable GID ({})", seen.join(", "))
    })
}

/// The options of each device the fabric opens: `verbs.device` (one), `verbs.devices` (those,
/// in order) or, with neither, every device whose `verbs.port` is usable now or once its link
/// is up ([`select::auto_pick`], in name order). Named devices are opened whatever their port's
/// state: one that is not ACTIVE is used once it is.
#[cfg(feature = "verbs")]
pub fn resolve_devices(opts: &VerbsOptions) -> Result<Vec<VerbsOptions>, FabricError> {
    opts.validate()?;
    let one = |name: String, port: u8, gid_index: Option<u32>| VerbsOptions {
        device: Some(name),
        devices: None,
        port,
        gid_index,
        ..opts.clone()
    };
    if let Some(d) = &opts.device {
        return Ok(vec![one(d.clone(), opts.port, opts.gid_index)]);
    }
    let (mut out, found): (Vec<VerbsOptions>, _) = match &opts.devices {
        Some(list) => {
            (list.iter().map(|s| one(s.name.clone(), s.port.unwrap_or(opts.port), s.gid_index.or(opts.gid_index))).collect(), None)
        }
        None => {
            let found = probe(opts)?;
            let pick = select::auto_pick(&found, u32::from(opts.port));
            if pick.devices.is_empty() {
                let seen: Vec<String> = found.iter().map(|d| format!("{} port {} {}", d.name, d.port, d.state)).collect();
                return Err(FabricError::NoDevice(if seen.is_empty() {
                    "no RDMA devices (is ib_uverbs loaded and /dev/infiniband visible?)".into()
                } else {
                    format!("no RDMA device with a usable port {} ({})", opts.port, seen.join(", "))
                }));
            }
            if !pick.left_out.is_empty() {
                tracing::info!(left_out = ?pick.left_out, "verbs.devices = auto: ports left out");
            }
            if !pick.later.is_empty() {
                tracing::warn!(devices = ?pick.later, "verbs.devices = auto: ports not ACTIVE at start, used once they are");
            }
            (pick.devices.into_iter().map(|name| one(name, opts.port, opts.gid_index)).collect(), Some(found))
        }
    };
    // The agent's address is on one device at most: the others pick their GID without it, as
    // they should, rather than each warning that none of its GIDs carries it.
    if let (Some(ip), true) = (opts.bind_ip, out.len() > 1) {
        let found = match found {
            Some(f) => f,
            None => probe(&VerbsOptions { device: None, devices: None, ..opts.clone() })?,
        };
        for o in &mut out {
            let carries = found.iter().any(|d| {
                Some(d.name.as_str()) == o.device.as_deref()
                    && d.gids.iter().any(|g| match ip {
                        std::net::IpAddr::V4(v4) => negotiate::gid_ipv4(&g.raw) == Some(v4),
                        std::net::IpAddr::V6(v6) => v6.octets() == g.raw,
                    })
            });
            if !carries {
                o.bind_ip = None;
            }
        }
    }
    Ok(out)
}

/// Opens the verbs fabric over the devices [`resolve_devices`] finds: one device is a plain
/// [`VerbsFabric`], several a [`RailsFabric`].
#[cfg(feature = "verbs")]
pub fn open_fabric(opts: VerbsOptions, markers: Arc<dyn crate::MarkerSink>) -> Result<Arc<dyn Fabric>, FabricError> {
    open_fabric_with_fallback(opts, markers, None)
}

/// [`open_fabric`], with `fallback` (the agent's tcp fabric) carried as every connection's last,
/// standby rail: then even one device is a [`RailsFabric`].
#[cfg(feature = "verbs")]
pub fn open_fabric_with_fallback(
    opts: VerbsOptions,
    markers: Arc<dyn crate::MarkerSink>,
    fallback: Option<Arc<dyn Fabric>>,
) -> Result<Arc<dyn Fabric>, FabricError> {
    let expected = opts.expected_shape;
    let mut per_device = resolve_devices(&opts)?;
    let mut f = if per_device.len() == 1 && fallback.is_none() {
        let Some(one) = per_device.pop() else { return Err(FabricError::NoDevice("no device resolved".into())) };
        let f = VerbsFabric::open(one)?;
        if f.device().view().active {
            let f = f.with_markers(markers);
            if let Some((qps, depth)) = expected {
                f.prebuild(qps, depth);
            }
            return Ok(Arc::new(f));
        }
        // A plain device fabric does not follow its port's state: one that is not ACTIVE yet
        // is carried by the fabric over devices, which offers it once it is.
        RailsFabric::over(vec![f], markers)
    } else {
        RailsFabric::open(per_device, markers)?
    };
    if let Some(tcp) = fallback {
        f = f.with_fallback(tcp);
    }
    tracing::info!(devices = ?f.device_names(), fallback = f.has_fallback(), "verbs fabric over its devices");
    if let Some((qps, depth)) = expected {
        f.prebuild(qps, depth);
    }
    Ok(Arc::new(f))
}

#[cfg(not(feature = "verbs"))]
pub fn usable_device(_opts: &VerbsOptions) -> Result<String, String> {
    Err("this agent was built without the verbs feature".to_string())
}

#[cfg(not(feature = "verbs"))]
pub fn open_fabric(_opts: VerbsOptions, _markers: Arc<dyn crate::MarkerSink>) -> Result<Arc<dyn Fabric>, FabricError> {
    Err(FabricError::NoDevice("this agent was built without the verbs feature".into()))
}

#[cfg(not(feature = "verbs"))]
pub fn open_fabric_with_fallback(
    _opts: VerbsOptions,
    _markers: Arc<dyn crate::MarkerSink>,
    _fallback: Option<Arc<dyn Fabric>>,
) -> Result<Arc<dyn Fabric>, FabricError> {
    Err(FabricError::NoDevice("this agent was built without the verbs feature".into()))
}
