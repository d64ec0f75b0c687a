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
//! * [`options`]: the fabric's settings ([`VerbsOptions`], [`GrantMode`]), validated.
//! * [`prebuilt`]: the bookkeeping of connections built ahead of need (generic, no verbs).
//! * `fabric`: [`VerbsFabric`], the `Fabric` implementation tying it together.
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
mod responder;

#[cfg(feature = "verbs")]
pub use device::probe;
#[cfg(feature = "verbs")]
pub use fabric::VerbsFabric;
pub use options::{GrantMode, VerbsOptions, MAX_PREBUILT};

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

/// Name of a usable device (an ACTIVE port), or why there is none.
#[cfg(feature = "verbs")]
pub fn usable_device(opts: &VerbsOptions) -> Result<String, String> {
    let devices = probe(opts).map_err(|e| e.to_string())?;
    if devices.is_empty() {
        return Err("no RDMA devices found".into());
    }
    devices
        .iter()
        .find(|d| {
            let ib = d.link_layer.eq_ignore_ascii_case("InfiniBand");
            d.state.eq_ignore_ascii_case("ACTIVE") && (ib || d.selected_gid_index.is_some())
        })
        .map(|d| format!("{} port {}", d.name, d.port))
        .ok_or_else(|| {
            let seen: Vec<String> = devices.iter().map(|d| format!("{} port {} {}", d.name, d.port, d.state)).collect();
            format!("no RDMA device with an active port and a usable GID ({})", seen.join(", "))
        })
}

#[cfg(feature = "verbs")]
pub fn open_fabric(opts: VerbsOptions, markers: Arc<dyn crate::MarkerSink>) -> Result<Arc<dyn Fabric>, FabricError> {
    let expected = opts.expected_shape;
    let f = VerbsFabric::open(opts)?.with_markers(markers);
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
