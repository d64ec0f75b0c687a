//! Pure negotiation logic: GID parsing and selection, MTU codes, and validation of a peer's
//! endpoints before any QP reaches RTR. No IO, no device: unit-tested on the host.
use std::net::IpAddr;

use crate::{Endpoint, FabricError, GidInfo, VerbsEndpoint};

/// Link-layer names as carried in [`VerbsEndpoint::link_layer`] and [`crate::DeviceInfo`]; GIDs
/// as addresses and text. They live with the pure device matching, which `xferctl` runs too.
pub use xfer_engine::reach::{gid_ipv4, gid_string, LINK_ETHERNET, LINK_INFINIBAND};

/// GID type names as carried in [`VerbsEndpoint::gid_type`] and [`GidInfo::gid_type`].
pub const GID_ROCE_V2: &str = "RoCEv2";
pub const GID_ROCE_V1: &str = "RoCEv1";
pub const GID_IB: &str = "IB";

/// The most QPs a peer may ask for in one `Peer.Connect` (bounds what a peer can make us allocate).
pub const MAX_QPS_PER_CONNECTION: usize = 256;

/// `ibv_port_attr.link_layer` → name. Unknown values are named, never a panic.
pub fn link_layer_name(code: u8) -> String {
    match code {
        // IBV_LINK_LAYER_UNSPECIFIED is reported by old IB drivers: it means InfiniBand.
        0 | 1 => LINK_INFINIBAND.to_string(),
        2 => LINK_ETHERNET.to_string(),
        v => format!("unknown({v})"),
    }
}

/// `ibv_port_attr.state` → name.
pub fn port_state_name(code: u32) -> String {
    match code {
        0 => "NOP".into(),
        1 => "DOWN".into(),
        2 => "INIT".into(),
        3 => "ARMED".into(),
        4 => "ACTIVE".into(),
        5 => "ACTIVE_DEFER".into(),
        v => format!("UNKNOWN({v})"),
    }
}

/// `enum ibv_mtu` code → bytes.
pub fn mtu_bytes(code: u32) -> Option<u32> {
    match code {
        1..=5 => Some(128u32 << code),
        _ => None,
    }
}

/// Bytes → `enum ibv_mtu` code (exact powers of two from 256 to 4096 only).
pub fn mtu_code(bytes: u32) -> Option<u32> {
    (1..=5).find(|&c| 128u32 << c == bytes)
}

/// The GID type from sysfs `gid_attrs/types/<i>` ("IB/RoCE v1", "RoCE v2") and the link layer.
pub fn gid_type_from_sysfs(text: &str, link_layer: &str) -> String {
    match text.trim() {
        "RoCE v2" => GID_ROCE_V2.to_string(),
        "IB/RoCE v1" if link_layer == LINK_ETHERNET => GID_ROCE_V1.to_string(),
        "IB/RoCE v1" => GID_IB.to_string(),
        "" => String::new(),
        other => other.to_string(),
    }
}

fn gid_matches_ip(raw: &[u8; 16], ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => gid_ipv4(raw) == Some(v4),
        IpAddr::V6(v6) => v6.octets() == *raw,
    }
}

/// How the GID index was chosen (for the log and `xferctl doctor`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GidChoice {
    Configured(u32),
    /// The RoCEv2 GID carrying the agent's bind address.
    BindAddress(u32),
    /// No GID carries the bind address (or none was given): the first RoCEv2 IPv4-mapped GID.
    FirstRoceV2Ipv4(u32),
    /// No IPv4-mapped RoCEv2 GID: the first RoCEv2 GID.
    FirstRoceV2(u32),
    /// InfiniBand: addressing by LID; GID index 0 for the GRH-less path.
    InfiniBand(u32),
}

impl GidChoice {
    pub fn index(&self) -> u32 {
        match *self {
            GidChoice::Configured(i)
            | GidChoice::BindAddress(i)
            | GidChoice::FirstRoceV2Ipv4(i)
            | GidChoice::FirstRoceV2(i)
            | GidChoice::InfiniBand(i) => i,
        }
    }
}

/// Picks the GID: configured index, else the RoCEv2 GID of `bind_ip`, else the
/// first RoCEv2 IPv4-mapped GID (then any RoCEv2 GID); InfiniBand ports use index 0 and the LID.
/// `gids` holds only populated (non-zero) entries.
pub fn select_gid(gids: &[GidInfo], link_layer: &str, configured: Option<u32>, bind_ip: Option<IpAddr>) -> Result<GidChoice, String> {
    if let Some(i) = configured {
        let Some(entry) = gids.iter().find(|g| g.index == i) else {
            return Err(format!("configured gid_index {i} is not populated on this port"));
        };
        if link_layer == LINK_ETHERNET && entry.gid_type != GID_ROCE_V2 {
            return Err(format!("configured gid_index {i} is {}, not {GID_ROCE_V2}", entry.gid_type));
        }
        return Ok(GidChoice::Configured(i));
    }
    if link_layer != LINK_ETHERNET {
        return Ok(GidChoice::InfiniBand(gids.first().map(|g| g.index).unwrap_or(0)));
    }
    let v2 = || gids.iter().filter(|g| g.gid_type == GID_ROCE_V2);
    if let Some(ip) = bind_ip {
        if let Some(g) = v2().find(|g| gid_matches_ip(&g.raw, ip)) {
            return Ok(GidChoice::BindAddress(g.index));
        }
    }
    if let Some(g) = v2().find(|g| gid_ipv4(&g.raw).is_some()) {
        return Ok(GidChoice::FirstRoceV2Ipv4(g.index));
    }
    if let Some(g) = v2().next() {
        return Ok(GidChoice::FirstRoceV2(g.index));
    }
    Err("no RoCEv2 GID on this port (is an IP address configured on its netdev?)".into())
}

/// The facts about our own port that the peer's endpoints are checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalPort {
    pub link_layer: String,
    pub gid_type: String,
    /// active MTU in bytes
    pub mtu: u32,
    pub max_rd_atomic: u8,
}

/// What RTR/RTS of one local QP needs from the negotiation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathParams {
    pub remote: VerbsEndpoint,
    /// `enum ibv_mtu` code of min(local, remote active MTU)
    pub path_mtu: u32,
    /// RTS `max_rd_atomic`: min(local, remote) so we never exceed the peer's responder resources
    pub max_rd_atomic: u8,
}

fn neg(step: &'static str, attr: &'static str, detail: impl Into<String>) -> FabricError {
    FabricError::Negotiation { step, attr, detail: detail.into() }
}

/// Validates a peer's endpoints against our port, before any QP reaches RTR. `expected` is the
/// number of QPs we created (initiator) or `None` (responder: the peer decides, within a bound).
pub fn validate_remote(local: &LocalPort, remote: &[Endpoint], expected: Option<usize>) -> Result<Vec<PathParams>, FabricError> {
    const STEP: &str = "RTR";
    if remote.is_empty() {
        return Err(neg(STEP, "qps", "peer sent no endpoints"));
    }
    if let Some(n) = expected {
        if remote.len() != n {
            return Err(neg(STEP, "qps", format!("we created {n} QPs, peer answered with {}", remote.len())));
        }
    }
    if remote.len() > MAX_QPS_PER_CONNECTION {
        return Err(neg(STEP, "qps", format!("{} QPs asked, at most {MAX_QPS_PER_CONNECTION}", remote.len())));
    }
    let local_mtu = mtu_code(local.mtu).ok_or_else(|| neg(STEP, "path_mtu", format!("local MTU {} invalid", local.mtu)))?;
    let mut out = Vec::with_capacity(remote.len());
    for (i, ep) in remote.iter().enumerate() {
        let Endpoint::Verbs(ep) = ep else {
            return Err(neg(STEP, "fabric", format!("endpoint {i} is not a verbs endpoint (peer runs tcp?)")));
        };
        if ep.link_layer != local.link_layer {
            return Err(neg(STEP, "link_layer", format!("local port is {}, peer's endpoint {i} is {:?}", local.link_layer, ep.link_layer)));
        }
        if local.link_layer == LINK_ETHERNET {
            if local.gid_type != GID_ROCE_V2 {
                return Err(neg(STEP, "gid_type", format!("local GID is {:?}, need {GID_ROCE_V2}", local.gid_type)));
            }
            if ep.gid_type != GID_ROCE_V2 {
                return Err(neg(STEP, "gid_type", format!("peer's GID is {:?}, need {GID_ROCE_V2}", ep.gid_type)));
            }
            if ep.gid == [0u8; 16] {
                return Err(neg(STEP, "gid", format!("peer's endpoint {i} has an all-zero GID")));
            }
        } else if ep.lid == 0 || ep.lid > 0xBFFF {
            return Err(neg(STEP, "lid", format!("peer's LID {:#x} is not a unicast LID", ep.lid)));
        }
        if ep.qpn == 0 || ep.qpn > 0xFF_FFFF {
            return Err(neg(STEP, "dest_qp_num", format!("peer's QPN {:#x} is not a valid 24-bit QPN", ep.qpn)));
        }
        if ep.psn > 0xFF_FFFF {
            return Err(neg(STEP, "rq_psn", format!("peer's PSN {:#x} is wider than 24 bits", ep.psn)));
        }
        let remote_mtu = mtu_code(ep.mtu).ok_or_else(|| neg(STEP, "path_mtu", format!("peer's active MTU {} is not 256..4096", ep.mtu)))?;
        if ep.max_rd_atomic == 0 {
            return Err(neg(STEP, "max_rd_atomic", "peer allows no outstanding READs (max_rd_atomic 0)"));
        }
        let max_rd_atomic = ep.max_rd_atomic.min(local.max_rd_atomic as u32).min(255) as u8;
        out.push(PathParams { remote: ep.clone(), path_mtu: local_mtu.min(remote_mtu), max_rd_atomic });
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn gid4(a: [u8; 4]) -> [u8; 16] {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&a);
        g
    }

    fn entry(index: u32, raw: [u8; 16], t: &str) -> GidInfo {
        GidInfo { index, raw, gid_type: t.into(), netdev: "veth0".into() }
    }

    fn local() -> LocalPort {
        LocalPort { link_layer: LINK_ETHERNET.into(), gid_type: GID_ROCE_V2.into(), mtu: 4096, max_rd_atomic: 16 }
    }

    fn ep() -> VerbsEndpoint {
        VerbsEndpoint {
            qpn: 0x11,
            psn: 0xabcdef,
            gid: gid4([10, 0, 0, 2]),
            gid_index: 1,
            lid: 0,
            port: 1,
            mtu: 1024,
            max_rd_atomic: 8,
            gid_type: GID_ROCE_V2.into(),
            link_layer: LINK_ETHERNET.into(),
            ..Default::default()
        }
    }

    #[test]
    fn mtu_codes_round_trip() {
        assert_eq!(mtu_bytes(1), Some(256));
        assert_eq!(mtu_bytes(5), Some(4096));
        assert_eq!(mtu_bytes(0), None);
        assert_eq!(mtu_bytes(6), None);
        assert_eq!(mtu_code(1024), Some(3));
        assert_eq!(mtu_code(1500), None);
        for c in 1..=5 {
            assert_eq!(mtu_code(mtu_bytes(c).unwrap()), Some(c));
        }
    }

    #[test]
    fn gid_parsing() {
        let raw = gid4([10, 0, 0, 1]);
        assert_eq!(gid_ipv4(&raw), Some("10.0.0.1".parse().unwrap()));
        assert_eq!(gid_string(&raw), "0000:0000:0000:0000:0000:ffff:0a00:0001");
        let mut ll = [0u8; 16];
        ll[0] = 0xfe;
        ll[1] = 0x80;
        assert_eq!(gid_ipv4(&ll), None);
        assert_eq!(gid_type_from_sysfs("RoCE v2\n", LINK_ETHERNET), GID_ROCE_V2);
        assert_eq!(gid_type_from_sysfs("IB/RoCE v1\n", LINK_ETHERNET), GID_ROCE_V1);
        assert_eq!(gid_type_from_sysfs("IB/RoCE v1", LINK_INFINIBAND), GID_IB);
        assert_eq!(link_layer_name(2), LINK_ETHERNET);
        assert_eq!(link_layer_name(9), "unknown(9)");
        assert_eq!(port_state_name(4), "ACTIVE");
        assert_eq!(port_state_name(77), "UNKNOWN(77)");
    }

    #[test]
    fn gid_selection_prefers_bind_address() {
        let mut ll = [0u8; 16];
        ll[0] = 0xfe;
        ll[1] = 0x80;
        let gids = vec![
            entry(0, ll, GID_ROCE_V1),
            entry(1, ll, GID_ROCE_V2),
            entry(2, gid4([10, 0, 0, 1]), GID_ROCE_V1),
            entry(3, gid4([10, 0, 0, 1]), GID_ROCE_V2),
            entry(5, gid4([192, 168, 1, 1]), GID_ROCE_V2),
        ];
        let e = LINK_ETHERNET;
        assert_eq!(select_gid(&gids, e, None, Some("192.168.1.1".parse().unwrap())), Ok(GidChoice::BindAddress(5)));
        assert_eq!(select_gid(&gids, e, None, Some("172.16.0.1".parse().unwrap())), Ok(GidChoice::FirstRoceV2Ipv4(3)));
        assert_eq!(select_gid(&gids, e, None, None), Ok(GidChoice::FirstRoceV2Ipv4(3)));
        assert_eq!(select_gid(&gids, e, Some(1), None), Ok(GidChoice::Configured(1)));
        assert!(select_gid(&gids, e, Some(2), None).unwrap_err().contains("RoCEv1"));
        assert!(select_gid(&gids, e, Some(4), None).unwrap_err().contains("not populated"));
        assert_eq!(select_gid(&gids[..2], e, None, None), Ok(GidChoice::FirstRoceV2(1)));
        assert!(select_gid(&gids[..1], e, None, None).is_err());
        assert_eq!(select_gid(&gids, LINK_INFINIBAND, None, None), Ok(GidChoice::InfiniBand(0)));
    }

    #[test]
    fn validation_takes_min_mtu_and_rd_atomic() {
        let p = validate_remote(&local(), &[Endpoint::Verbs(ep())], Some(1)).unwrap();
        assert_eq!(p[0].path_mtu, 3);
        assert_eq!(p[0].max_rd_atomic, 8);
    }

    fn attr_of(e: FabricError) -> &'static str {
        match e {
            FabricError::Negotiation { step, attr, .. } => {
                assert_eq!(step, "RTR");
                attr
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn validation_names_the_attribute() {
        let l = local();
        let check = |f: &dyn Fn(&mut VerbsEndpoint)| {
            let mut e = ep();
            f(&mut e);
            attr_of(validate_remote(&l, &[Endpoint::Verbs(e)], Some(1)).unwrap_err())
        };
        assert_eq!(check(&|e| e.mtu = 1500), "path_mtu");
        assert_eq!(check(&|e| e.mtu = 0), "path_mtu");
        assert_eq!(check(&|e| e.gid_type = GID_ROCE_V1.into()), "gid_type");
        assert_eq!(check(&|e| e.link_layer = LINK_INFINIBAND.into()), "link_layer");
        assert_eq!(check(&|e| e.gid = [0; 16]), "gid");
        assert_eq!(check(&|e| e.psn = 1 << 24), "rq_psn");
        assert_eq!(check(&|e| e.qpn = 0), "dest_qp_num");
        assert_eq!(check(&|e| e.qpn = 1 << 24), "dest_qp_num");
        assert_eq!(check(&|e| e.max_rd_atomic = 0), "max_rd_atomic");
        assert_eq!(attr_of(validate_remote(&l, &[Endpoint::Verbs(ep())], Some(2)).unwrap_err()), "qps");
        assert_eq!(attr_of(validate_remote(&l, &[], None).unwrap_err()), "qps");
        let many = vec![Endpoint::Verbs(ep()); MAX_QPS_PER_CONNECTION + 1];
        assert_eq!(attr_of(validate_remote(&l, &many, None).unwrap_err()), "qps");
        let tcp = Endpoint::Tcp { address: "127.0.0.1:1".parse().unwrap(), secret: None };
        assert_eq!(attr_of(validate_remote(&l, &[tcp], None).unwrap_err()), "fabric");
        let mut l2 = local();
        l2.gid_type = GID_ROCE_V1.into();
        assert_eq!(attr_of(validate_remote(&l2, &[Endpoint::Verbs(ep())], None).unwrap_err()), "gid_type");
    }

    #[test]
    fn infiniband_checks_the_lid() {
        let l = LocalPort { link_layer: LINK_INFINIBAND.into(), gid_type: GID_IB.into(), mtu: 2048, max_rd_atomic: 4 };
        let mut e = ep();
        e.link_layer = LINK_INFINIBAND.into();
        e.gid_type = GID_IB.into();
        assert_eq!(attr_of(validate_remote(&l, &[Endpoint::Verbs(e.clone())], None).unwrap_err()), "lid");
        e.lid = 7;
        let p = validate_remote(&l, &[Endpoint::Verbs(e)], None).unwrap();
        assert_eq!(p[0].path_mtu, 3);
        assert_eq!(p[0].max_rd_atomic, 4);
    }
}
