//! Device and port discovery, the GID table, and the opened device (context + PD) that every
//! connection of a [`super::fabric::VerbsFabric`] shares.
//!
//! Only panic-free sideway calls are used here: device names, `open`, raw `query_port` /
//! `query_device` attributes and `query_gid`. sideway's `PortAttr::active_mtu()`,
//! `link_layer()`, `port_state()`, `Device::transport_type()` and `query_gid_table()` all `panic!`
//! (or `unwrap`) on values this build does not know, so the raw fields are converted here.
use std::path::Path;
use std::sync::{Arc, RwLock};

use sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::protection_domain::ProtectionDomain;

use super::negotiate::{self, GidChoice, LocalPort, LINK_ETHERNET};
use super::options::VerbsOptions;
use crate::topology::device_info::add_topology;
use crate::topology::sysfs::{read_device, read_devices};
use crate::{DeviceInfo, FabricError, GidInfo};

const PORT_ACTIVE: u32 = 4;
/// Where the kernel's device tree is mounted.
const SYSFS: &str = "/sys";

/// Facts about one port, converted from `ibv_port_attr` without panicking.
#[derive(Debug, Clone)]
pub(crate) struct PortFacts {
    pub state: u32,
    pub link_layer: String,
    pub active_mtu: u32,
    pub lid: u16,
    pub gid_tbl_len: u32,
}

pub(crate) fn query_port(ctx: &DeviceContext, port: u8) -> Result<PortFacts, FabricError> {
    let attr = ctx.query_port(port).map_err(|e| FabricError::NoDevice(format!("query port {port}: {e}")))?;
    let a = attr.attr;
    Ok(PortFacts {
        state: a.state,
        link_layer: negotiate::link_layer_name(a.link_layer),
        active_mtu: negotiate::mtu_bytes(a.active_mtu).unwrap_or(0),
        lid: a.lid,
        gid_tbl_len: a.gid_tbl_len.max(0) as u32,
    })
}

fn sysfs_attr(dev: &str, port: u8, kind: &str, index: u32) -> String {
    std::fs::read_to_string(format!("/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/{kind}/{index}"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The populated entries of a port's GID table, with type and netdev from sysfs.
pub(crate) fn read_gids(ctx: &DeviceContext, dev: &str, port: u8, facts: &PortFacts) -> Vec<GidInfo> {
    let mut out = Vec::new();
    for index in 0..facts.gid_tbl_len {
        // Unpopulated entries read as zero or fail (EINVAL/ENODATA on newer kernels): skip both.
        let Ok(gid) = ctx.query_gid(port, index) else { continue };
        if gid.raw == [0u8; 16] {
            continue;
        }
        let mut gid_type = negotiate::gid_type_from_sysfs(&sysfs_attr(dev, port, "types", index), &facts.link_layer);
        if gid_type.is_empty() {
            // No sysfs (containers without /sys/class/infiniband): ask verbs. 0 = IB/RoCE v1, 1 = RoCE v2.
            gid_type = match ctx.query_gid_type(port, index) {
                Ok(1) => negotiate::GID_ROCE_V2.into(),
                Ok(0) => negotiate::gid_type_from_sysfs("IB/RoCE v1", &facts.link_layer),
                Ok(v) => format!("unknown({v})"),
                Err(_) => String::new(),
            };
        }
        out.push(GidInfo { index, raw: gid.raw, gid_type, netdev: sysfs_attr(dev, port, "ndevs", index) });
    }
    out
}

fn port_info(ctx: &DeviceContext, name: &str, port: u8, opts: &VerbsOptions) -> Result<DeviceInfo, FabricError> {
    let facts = query_port(ctx, port)?;
    let gids = read_gids(ctx, name, port, &facts);
    let selected = negotiate::select_gid(&gids, &facts.link_layer, opts.gid_index, opts.bind_ip).ok().map(|c| c.index());
    Ok(DeviceInfo {
        name: name.to_string(),
        port: port as u32,
        state: negotiate::port_state_name(facts.state),
        link_layer: facts.link_layer,
        active_mtu: facts.active_mtu,
        lid: facts.lid as u32,
        gids,
        selected_gid_index: selected,
        ..Default::default()
    })
}

/// Lists every device and port (with its GID table and the GID `opts` would select) without
/// keeping anything open. With `opts.device` set, only that device.
pub fn probe(opts: &VerbsOptions) -> Result<Vec<DeviceInfo>, FabricError> {
    let list = DeviceList::new().map_err(|e| FabricError::NoDevice(format!("ibv_get_device_list: {e}")))?;
    let mut out = Vec::new();
    for i in 0..list.len() {
        let Some(dev) = list.get(i) else { continue };
        let name = dev.name();
        if opts.device.as_ref().is_some_and(|d| *d != name) {
            continue;
        }
        let ctx = match dev.open() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(device = %name, error = %e, "cannot open RDMA device");
                continue;
            }
        };
        let ports = ctx.query_device().map(|a| a.attr.orig_attr.phys_port_cnt).unwrap_or(1);
        for port in 1..=ports {
            match port_info(&ctx, &name, port, opts) {
                Ok(info) => out.push(info),
                Err(e) => tracing::warn!(device = %name, port, error = %e, "cannot query port"),
            }
        }
    }
    let topology = read_devices(Path::new(SYSFS));
    out.iter_mut().for_each(|info| add_topology(info, &topology));
    Ok(out)
}

/// The opened device: one context and one PD shared (through `Arc`s) by every registration and
/// connection, so the context outlives everything created from it. What depends on the port's
/// state (LID, MTU, the chosen GID) is a [`PortView`] that can be read again: a device opened
/// while its port was down learns them once the port is ACTIVE ([`Device::refresh`]).
pub(crate) struct Device {
    pub pd: Arc<ProtectionDomain>,
    pub ctx: Arc<DeviceContext>,
    pub name: String,
    pub port: u8,
    /// min(option, device initiator depth, device responder resources)
    pub max_rd_atomic: u8,
    pub max_qp_wr: u32,
    pub max_cqe: u32,
    /// Memory windows the device supports (0 = none).
    pub max_mw: u32,
    /// `verbs.gid_index` and `bind_ip`: the GID is chosen again with them on a refresh.
    want_gid: Option<u32>,
    bind_ip: Option<std::net::IpAddr>,
    view: RwLock<PortView>,
}

/// The port's facts as connections use them, read at open and again by [`Device::refresh`].
#[derive(Debug, Clone)]
pub(crate) struct PortView {
    pub link_layer: String,
    pub lid: u16,
    pub active_mtu: u32,
    pub gid_index: u32,
    pub gid: [u8; 16],
    pub gid_type: String,
    /// `None` while the port has no usable GID (only while it is not ACTIVE).
    pub gid_choice: Option<GidChoice>,
    /// Prefix length of the GID's IPv4 address on its netdev, 0 if unknown (not IPv4-mapped, or
    /// no interface holds it): peers match devices by subnet with it.
    pub ipv4_prefix: u32,
    /// Read while the port was ACTIVE, with a GID chosen: connections may use these facts.
    pub active: bool,
    /// Nothing better is expected from reading again: active, and either read at open (as
    /// every device whose port was up at start) or the GID carries an IPv4 address (RoCE) or
    /// is InfiniBand's. A device that came up after start may see its IPv4 GID only after the
    /// port event, so until then it keeps reading.
    pub settled: bool,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("name", &self.name).field("port", &self.port).field("view", &self.view()).finish()
    }
}

/// The [`PortView`] of `facts` and `gids`: with the port ACTIVE a GID must be chosen and a RoCE
/// port must know its MTU (errors say why); a port that is not ACTIVE yet gets a view that is
/// not `active`, whatever it lacks.
pub(crate) fn port_view(
    facts: &PortFacts,
    gids: &[GidInfo],
    want_gid: Option<u32>,
    bind_ip: Option<std::net::IpAddr>,
    at_open: bool,
) -> Result<PortView, String> {
    let is_active = facts.state == PORT_ACTIVE;
    let choice = match negotiate::select_gid(gids, &facts.link_layer, want_gid, bind_ip) {
        Ok(c) => Some(c),
        Err(e) if is_active => return Err(e),
        Err(_) => None,
    };
    if is_active && facts.link_layer == LINK_ETHERNET && facts.active_mtu == 0 {
        return Err("unknown active MTU".into());
    }
    let gid_index = choice.as_ref().map_or(0, GidChoice::index);
    let (gid, gid_type) = match choice.as_ref().and_then(|_| gids.iter().find(|g| g.index == gid_index)) {
        Some(g) => (g.raw, g.gid_type.clone()),
        None => ([0u8; 16], negotiate::GID_IB.to_string()),
    };
    let active = is_active && choice.is_some();
    let strong = !matches!(choice, Some(GidChoice::FirstRoceV2(_)));
    Ok(PortView {
        link_layer: facts.link_layer.clone(),
        lid: facts.lid,
        active_mtu: facts.active_mtu,
        gid_index,
        gid,
        gid_type,
        ipv4_prefix: negotiate::gid_ipv4(&gid).and_then(crate::topology::net::ipv4_prefix).map_or(0, u32::from),
        gid_choice: choice,
        active,
        settled: active && (at_open || strong),
    })
}

impl Device {
    /// Opens `opts.device`, or the first device whose `opts.port` is ACTIVE, and picks the GID.
    /// A named device is opened whatever its port's state: one that is not ACTIVE yet learns
    /// its port's facts when it is ([`Device::refresh`]), and is not used until then.
    pub fn open(opts: &VerbsOptions) -> Result<Device, FabricError> {
        let list = DeviceList::new().map_err(|e| FabricError::NoDevice(format!("ibv_get_device_list: {e}")))?;
        let port = opts.port;
        let mut seen = Vec::new();
        for i in 0..list.len() {
            let Some(dev) = list.get(i) else { continue };
            let name = dev.name();
            if opts.device.as_ref().is_some_and(|d| *d != name) {
                continue;
            }
            let ctx = match dev.open() {
                Ok(c) => c,
                Err(e) => {
                    seen.push(format!("{name}: open failed: {e}"));
                    continue;
                }
            };
            let facts = match query_port(&ctx, port) {
                Ok(f) => f,
                Err(e) => {
                    seen.push(format!("{name}: {e}"));
                    continue;
                }
            };
            if facts.state != PORT_ACTIVE && opts.device.is_none() {
                seen.push(format!("{name} port {port}: {}", negotiate::port_state_name(facts.state)));
                continue;
            }
            return Self::from_context(ctx, name, port, facts, opts);
        }
        let what = match &opts.device {
            Some(d) if seen.is_empty() => format!("device {d} not found ({} devices listed)", list.len()),
            _ if seen.is_empty() => "no RDMA devices (is ib_uverbs loaded and /dev/infiniband visible?)".into(),
            _ => format!("no ACTIVE port {port}: {}", seen.join("; ")),
        };
        Err(FabricError::NoDevice(what))
    }

    fn from_context(ctx: Arc<DeviceContext>, name: String, port: u8, facts: PortFacts, opts: &VerbsOptions) -> Result<Device, FabricError> {
        let gids = read_gids(&ctx, &name, port, &facts);
        let view = port_view(&facts, &gids, opts.gid_index, opts.bind_ip, true)
            .map_err(|e| FabricError::NoDevice(format!("{name} port {port}: {e}")))?;
        if let (Some(ip), Some(GidChoice::FirstRoceV2Ipv4(_) | GidChoice::FirstRoceV2(_))) = (opts.bind_ip, &view.gid_choice) {
            tracing::warn!(device = %name, %ip, choice = ?view.gid_choice, "no RoCEv2 GID carries the bind address; using another GID");
        }
        let attr = ctx.query_device().map_err(|e| FabricError::NoDevice(format!("{name}: query device: {e}")))?;
        let a = &attr.attr.orig_attr;
        let dev_rd = a.max_qp_rd_atom.min(a.max_qp_init_rd_atom).clamp(1, 255) as u8;
        let pd = ctx.alloc_pd().map_err(|e| FabricError::NoDevice(format!("{name}: alloc PD: {e}")))?;
        let dev = Device {
            pd,
            name,
            port,
            // 0 = the device's maximum; never 0 (READs could not be issued).
            max_rd_atomic: if opts.max_rd_atomic == 0 { dev_rd } else { opts.max_rd_atomic.min(dev_rd) }.max(1),
            max_qp_wr: a.max_qp_wr.max(1) as u32,
            max_cqe: a.max_cqe.max(1) as u32,
            max_mw: a.max_mw.max(0) as u32,
            want_gid: opts.gid_index,
            bind_ip: opts.bind_ip,
            view: RwLock::new(view.clone()),
            ctx,
        };
        if view.active {
            tracing::info!(device = %dev.name, port, gid_index = view.gid_index, gid = %negotiate::gid_string(&view.gid),
                choice = ?view.gid_choice, mtu = view.active_mtu, "verbs device opened");
        } else {
            tracing::warn!(device = %dev.name, port, state = %negotiate::port_state_name(facts.state),
                "verbs device opened with its port not ACTIVE: used once the port is ACTIVE");
        }
        Ok(dev)
    }

    /// The port's facts as last read.
    pub fn view(&self) -> PortView {
        self.view.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Reads the port's facts again and keeps them if the port is ACTIVE with a usable GID
    /// (else the last facts stay, and the error says what is missing). Returns the facts kept,
    /// and whether they changed.
    pub fn refresh(&self) -> Result<(PortView, bool), FabricError> {
        let facts = query_port(&self.ctx, self.port)?;
        let gids = read_gids(&self.ctx, &self.name, self.port, &facts);
        let fresh = port_view(&facts, &gids, self.want_gid, self.bind_ip, false)
            .map_err(|e| FabricError::NoDevice(format!("{} port {}: {e}", self.name, self.port)))?;
        if !fresh.active {
            return Err(FabricError::NoDevice(format!(
                "{} port {}: {}{}",
                self.name,
                self.port,
                negotiate::port_state_name(facts.state),
                if fresh.gid_choice.is_none() { ", no usable GID" } else { "" }
            )));
        }
        let mut view = self.view.write().unwrap_or_else(|e| e.into_inner());
        let changed = (view.gid, view.gid_index, view.lid, view.active_mtu, view.active, view.ipv4_prefix)
            != (fresh.gid, fresh.gid_index, fresh.lid, fresh.active_mtu, fresh.active, fresh.ipv4_prefix);
        if changed {
            tracing::info!(device = %self.name, port = self.port, gid_index = fresh.gid_index, gid = %negotiate::gid_string(&fresh.gid),
                choice = ?fresh.gid_choice, mtu = fresh.active_mtu, lid = fresh.lid, "verbs device's port facts read again");
        }
        *view = fresh;
        Ok((view.clone(), changed))
    }

    pub fn local_port(&self) -> LocalPort {
        let v = self.view();
        LocalPort { link_layer: v.link_layer, gid_type: v.gid_type, mtu: v.active_mtu, max_rd_atomic: self.max_rd_atomic }
    }

    /// Current facts (port state may change while the agent runs).
    pub fn info(&self) -> DeviceInfo {
        let mut info = match query_port(&self.ctx, self.port) {
            Ok(facts) => DeviceInfo {
                name: self.name.clone(),
                port: self.port as u32,
                state: negotiate::port_state_name(facts.state),
                link_layer: facts.link_layer.clone(),
                active_mtu: facts.active_mtu,
                lid: facts.lid as u32,
                gids: read_gids(&self.ctx, &self.name, self.port, &facts),
                selected_gid_index: None,
                ..Default::default()
            },
            Err(e) => DeviceInfo {
                name: self.name.clone(),
                port: self.port as u32,
                state: format!("query failed: {e}"),
                link_layer: self.view().link_layer,
                ..Default::default()
            },
        };
        // None while the port has had no usable GID yet.
        info.selected_gid_index = self.view().gid_choice.as_ref().map(GidChoice::index);
        // This device's facts only: reading every device's made each GetInfo (and each agent
        // start) read every GID entry of every device once per device.
        add_topology(&mut info, read_device(Path::new(SYSFS), &self.name).as_slice());
        info
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(state: u32, link_layer: &str, mtu: u32) -> PortFacts {
        PortFacts { state, link_layer: link_layer.into(), active_mtu: mtu, lid: 0, gid_tbl_len: 4 }
    }

    fn roce_v2(index: u32, raw: [u8; 16]) -> GidInfo {
        GidInfo { index, raw, gid_type: negotiate::GID_ROCE_V2.into(), netdev: "veth2".into() }
    }

    const LINK_LOCAL: [u8; 16] = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe, 0, 0, 1];
    const V4_MAPPED: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 1, 1];
    const DOWN: u32 = 1;

    #[test]
    fn a_port_down_at_open_gets_a_view_that_is_not_active_with_or_without_a_gid() {
        let v = port_view(&facts(DOWN, LINK_ETHERNET, 1024), &[roce_v2(1, V4_MAPPED)], None, None, true).unwrap();
        assert!(!v.active && !v.settled);
        assert_eq!((v.gid_index, v.gid), (1, V4_MAPPED));
        // No address on the netdev yet, no MTU known yet: still opened, with nothing chosen.
        let v = port_view(&facts(DOWN, LINK_ETHERNET, 0), &[], None, None, true).unwrap();
        assert!(!v.active && v.gid_choice.is_none());
        assert_eq!(v.gid, [0; 16]);
    }

    #[test]
    fn an_active_port_needs_a_gid_and_on_roce_an_mtu() {
        let err = port_view(&facts(PORT_ACTIVE, LINK_ETHERNET, 1024), &[], None, None, true).unwrap_err();
        assert!(err.contains("RoCEv2"), "{err}");
        let err = port_view(&facts(PORT_ACTIVE, LINK_ETHERNET, 0), &[roce_v2(1, V4_MAPPED)], None, None, true).unwrap_err();
        assert!(err.contains("MTU"), "{err}");
        let v = port_view(&facts(PORT_ACTIVE, negotiate::LINK_INFINIBAND, 0), &[], None, None, false).unwrap();
        assert!(v.active && v.settled);
    }

    #[test]
    fn a_port_that_came_up_later_settles_only_on_an_ipv4_gid() {
        // The port event may come before the IPv4 GID is back: read again until it is.
        let v = port_view(&facts(PORT_ACTIVE, LINK_ETHERNET, 1024), &[roce_v2(0, LINK_LOCAL)], None, None, false).unwrap();
        assert!(v.active && !v.settled);
        let gids = [roce_v2(0, LINK_LOCAL), roce_v2(1, V4_MAPPED)];
        let v = port_view(&facts(PORT_ACTIVE, LINK_ETHERNET, 1024), &gids, None, None, false).unwrap();
        assert!(v.active && v.settled);
        assert_eq!(v.gid_index, 1);
        // A port up at open keeps what it read then, as it always did.
        let v = port_view(&facts(PORT_ACTIVE, LINK_ETHERNET, 1024), &[roce_v2(0, LINK_LOCAL)], None, None, true).unwrap();
        assert!(v.active && v.settled);
    }
}
