//! IPv4 subnets of local interfaces: the prefix length of a local address (from `getifaddrs`) and
//! the pure "same subnet" test two devices' GIDs are matched with.

use std::net::Ipv4Addr;

use nix::ifaddrs::getifaddrs;

/// The prefix length of the local interface address `addr` (`Some(8)` for 127.0.0.1), or `None`
/// when no interface holds `addr`, the interfaces cannot be listed, or the netmask is not a
/// contiguous run of leading ones.
pub fn ipv4_prefix(addr: Ipv4Addr) -> Option<u8> {
    let interfaces = getifaddrs().ok()?;
    for interface in interfaces {
        let Some(address) = interface.address.as_ref().and_then(|a| a.as_sockaddr_in()) else {
            continue;
        };
        if address.ip() != addr {
            continue;
        }
        let Some(mask) = interface.netmask.as_ref().and_then(|m| m.as_sockaddr_in()) else {
            continue;
        };
        return mask_prefix(mask.ip());
    }
    None
}

/// The prefix length a netmask encodes, `None` when its ones are not contiguous from the top.
fn mask_prefix(mask: Ipv4Addr) -> Option<u8> {
    let bits = u32::from(mask);
    let ones = bits.leading_ones();
    // A valid mask is `ones` leading ones followed only by zeros.
    if bits.checked_shl(ones).unwrap_or(0) != 0 {
        return None;
    }
    u8::try_from(ones).ok()
}

/// The "same subnet" test lives with the pure device matching, which `xferctl` runs too.
pub use xfer_engine::reach::same_subnet;

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn loopback_is_a_slash_8() {
        assert_eq!(ipv4_prefix(Ipv4Addr::LOCALHOST), Some(8));
    }

    #[test]
    fn an_address_no_interface_holds_has_no_prefix() {
        // TEST-NET-3, never assigned to a host's interface.
        assert_eq!(ipv4_prefix(ip("203.0.113.77")), None);
    }

    #[test]
    fn masks_map_to_prefixes() {
        assert_eq!(mask_prefix(ip("255.0.0.0")), Some(8));
        assert_eq!(mask_prefix(ip("255.255.255.0")), Some(24));
        assert_eq!(mask_prefix(ip("255.255.255.255")), Some(32));
        assert_eq!(mask_prefix(ip("255.255.252.0")), Some(22));
        assert_eq!(mask_prefix(ip("0.0.0.0")), Some(0));
        assert_eq!(mask_prefix(ip("255.0.255.0")), None);
        assert_eq!(mask_prefix(ip("0.0.0.255")), None);
    }

    #[test]
    fn same_prefix_same_network() {
        assert!(same_subnet(ip("10.1.0.1"), 24, ip("10.1.0.200"), 24));
        assert!(!same_subnet(ip("10.1.0.1"), 24, ip("10.1.1.1"), 24));
        assert!(same_subnet(ip("192.168.7.9"), 32, ip("192.168.7.9"), 32));
        assert!(!same_subnet(ip("192.168.7.9"), 32, ip("192.168.7.10"), 32));
    }

    #[test]
    fn the_shorter_prefix_decides() {
        // 10.1.1.1/16 and 10.1.0.1/24: on /16 they agree.
        assert!(same_subnet(ip("10.1.1.1"), 16, ip("10.1.0.1"), 24));
        assert!(same_subnet(ip("10.1.0.1"), 24, ip("10.1.1.1"), 16));
        assert!(!same_subnet(ip("10.2.1.1"), 16, ip("10.1.0.1"), 24));
        // Non-octet boundaries: /22 spans 10.0.0.0-10.0.3.255.
        assert!(same_subnet(ip("10.0.3.255"), 22, ip("10.0.0.1"), 22));
        assert!(!same_subnet(ip("10.0.4.0"), 22, ip("10.0.0.1"), 22));
        assert!(same_subnet(ip("1.2.3.4"), 1, ip("100.0.0.0"), 32));
        assert!(!same_subnet(ip("1.2.3.4"), 1, ip("200.0.0.0"), 32));
    }

    #[test]
    fn zero_or_oversized_prefixes_never_match() {
        let a = ip("10.0.0.1");
        assert!(!same_subnet(a, 0, a, 0));
        assert!(!same_subnet(a, 0, a, 24));
        assert!(!same_subnet(a, 24, a, 0));
        assert!(!same_subnet(a, 33, a, 24));
        assert!(!same_subnet(a, 24, a, 255));
    }
}
