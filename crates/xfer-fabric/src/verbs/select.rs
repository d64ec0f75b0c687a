//! Which probed ports the verbs fabric may open, and which `verbs.devices = auto` opens: a pure
//! choice over [`DeviceInfo`]s (what `probe` reports), without the `verbs` feature so it is
//! tested without a device.
//!
//! A port whose link is not up yet (cable plugged in later, a port still training, a netdev
//! brought up later) is opened all the same and offered once it is ACTIVE, so a NIC that comes
//! up after the agent started joins without a restart.
use xfer_engine::reach::{LINK_ETHERNET, LINK_INFINIBAND};

use crate::DeviceInfo;

/// What the fabric can do with one probed port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortUse {
    /// ACTIVE, with a usable GID (RoCE) or on InfiniBand: connections may use it now.
    Now,
    /// A known link layer and a state that becomes ACTIVE when the link comes up (`DOWN`,
    /// `INIT`, `ARMED`): opened, and offered once it is ACTIVE.
    Later,
    /// Neither; why.
    Never(String),
}

/// What the fabric can do with the port `d`.
pub fn port_use(d: &DeviceInfo) -> PortUse {
    let ib = d.link_layer.eq_ignore_ascii_case(LINK_INFINIBAND);
    if !ib && !d.link_layer.eq_ignore_ascii_case(LINK_ETHERNET) {
        return PortUse::Never(format!("link layer {:?}", d.link_layer));
    }
    match d.state.to_ascii_uppercase().as_str() {
        "ACTIVE" | "ACTIVE_DEFER" if ib || d.selected_gid_index.is_some() => PortUse::Now,
        // An ACTIVE RoCE port without a RoCEv2 GID (no address on its netdev): the device is
        // opened with a GID chosen, and none is.
        "ACTIVE" | "ACTIVE_DEFER" => PortUse::Never("ACTIVE without a usable GID (is an IP address configured on its netdev?)".into()),
        "DOWN" | "INIT" | "ARMED" => PortUse::Later,
        other => PortUse::Never(format!("port state {other}")),
    }
}

/// The devices `auto` opens on `port`: every device whose `port` is usable now or later, each
/// once, in name order, and which of them are not ACTIVE yet.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AutoPick {
    /// Every device to open, in name order.
    pub devices: Vec<String>,
    /// Those of `devices` whose port is not usable yet (offered once it is).
    pub later: Vec<String>,
    /// The ports on `port` left out, with why (for the error when nothing is picked).
    pub left_out: Vec<String>,
}

/// See [`AutoPick`].
pub fn auto_pick(found: &[DeviceInfo], port: u32) -> AutoPick {
    let mut on_port: Vec<&DeviceInfo> = found.iter().filter(|d| d.port == port).collect();
    on_port.sort_by(|a, b| a.name.cmp(&b.name));
    let mut pick = AutoPick::default();
    for d in on_port {
        if pick.devices.contains(&d.name) {
            continue;
        }
        match port_use(d) {
            PortUse::Now => pick.devices.push(d.name.clone()),
            PortUse::Later => {
                pick.devices.push(d.name.clone());
                pick.later.push(d.name.clone());
            }
            PortUse::Never(why) => pick.left_out.push(format!("{} port {}: {why}", d.name, d.port)),
        }
    }
    pick
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(name: &str, port: u32, state: &str, link_layer: &str, gid: Option<u32>) -> DeviceInfo {
        DeviceInfo {
            name: name.into(),
            port,
            state: state.into(),
            link_layer: link_layer.into(),
            selected_gid_index: gid,
            ..Default::default()
        }
    }

    #[test]
    fn a_port_that_is_down_at_start_is_opened_for_later() {
        assert_eq!(port_use(&port("rxe2", 1, "DOWN", "Ethernet", Some(1))), PortUse::Later);
        // No GID while down (the netdev's address may come with the link): still later.
        assert_eq!(port_use(&port("rxe2", 1, "DOWN", "Ethernet", None)), PortUse::Later);
        assert_eq!(port_use(&port("mlx5_3", 1, "INIT", "InfiniBand", None)), PortUse::Later);
        assert_eq!(port_use(&port("mlx5_3", 1, "ARMED", "InfiniBand", None)), PortUse::Later);
    }

    #[test]
    fn an_active_port_is_usable_now_only_with_a_gid_unless_infiniband() {
        assert_eq!(port_use(&port("rxe0", 1, "ACTIVE", "Ethernet", Some(1))), PortUse::Now);
        assert_eq!(port_use(&port("mlx5_0", 1, "ACTIVE", "InfiniBand", None)), PortUse::Now);
        assert!(matches!(port_use(&port("rxe0", 1, "ACTIVE", "Ethernet", None)), PortUse::Never(w) if w.contains("GID")));
    }

    #[test]
    fn unknown_link_layers_and_states_are_never_opened() {
        assert!(matches!(port_use(&port("x", 1, "ACTIVE", "Unspecified", Some(0))), PortUse::Never(w) if w.contains("link layer")));
        assert!(matches!(port_use(&port("x", 1, "NOP", "Ethernet", Some(0))), PortUse::Never(w) if w.contains("NOP")));
        assert!(matches!(port_use(&port("x", 1, "UNKNOWN(9)", "Ethernet", Some(0))), PortUse::Never(_)));
    }

    #[test]
    fn auto_opens_every_device_up_or_down_once_in_name_order() {
        let found = vec![
            port("rxe2", 1, "DOWN", "Ethernet", Some(1)),
            port("rxe0", 1, "ACTIVE", "Ethernet", Some(1)),
            port("rxe0", 2, "ACTIVE", "Ethernet", Some(1)),
            port("rxe1", 1, "ACTIVE", "Ethernet", None),
            port("mlx5_0", 1, "ACTIVE", "InfiniBand", None),
            port("mlx5_0", 2, "DOWN", "InfiniBand", None),
        ];
        let pick = auto_pick(&found, 1);
        assert_eq!(pick.devices, ["mlx5_0", "rxe0", "rxe2"]);
        assert_eq!(pick.later, ["rxe2"]);
        assert_eq!(pick.left_out.len(), 1);
        assert!(pick.left_out[0].starts_with("rxe1 port 1"), "{:?}", pick.left_out);
        let pick = auto_pick(&found, 2);
        assert_eq!(pick.devices, ["mlx5_0", "rxe0"]);
        assert_eq!(pick.later, ["mlx5_0"]);
    }

    #[test]
    fn with_every_port_down_auto_still_opens_them_all() {
        let found = vec![port("rxe1", 1, "DOWN", "Ethernet", None), port("rxe0", 1, "DOWN", "Ethernet", Some(1))];
        let pick = auto_pick(&found, 1);
        assert_eq!(pick.devices, ["rxe0", "rxe1"]);
        assert_eq!(pick.later, pick.devices);
        assert!(auto_pick(&[], 1).devices.is_empty());
    }
}
