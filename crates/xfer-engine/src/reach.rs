//! Which device reaches which: the pure matching of one agent's devices (rails) to a peer's,
//! by link layer and subnet. The verbs fabric's responder runs it in `Peer.Connect` over the
//! initiator's rails, and `xferctl doctor --peer` runs it over two agents' `GetInfo` answers to
//! say which device pairs could carry a path and why the others cannot. No IO: the facts come
//! from endpoints, opened devices or `GetInfo`, and the result is unit tested.
//!
//! Two devices reach each other when their link layers are the same and:
//! * RoCE (Ethernet): both GIDs are IPv4-mapped and each address lies in the other's subnet by
//!   both sides' prefix lengths (what a packet needs to go out on-link and its answer to come
//!   back). A side whose prefix is unknown (0) borrows the other's; with neither known, or a GID
//!   that is not IPv4-mapped, the pair *may* reach: it is used only when nothing better is left.
//! * InfiniBand: the same subnet prefix (the GIDs' upper 64 bits).
use std::net::Ipv4Addr;

/// Link-layer names as carried in endpoints and device facts.
pub const LINK_ETHERNET: &str = "Ethernet";
pub const LINK_INFINIBAND: &str = "InfiniBand";

/// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
pub fn gid_ipv4(raw: &[u8; 16]) -> Option<Ipv4Addr> {
    std::net::Ipv6Addr::from(*raw).to_ipv4_mapped()
}

/// Formats a GID the way `show_gids` does (`0000:0000:0000:0000:0000:ffff:0a00:0001`).
pub fn gid_string(raw: &[u8; 16]) -> String {
    raw.chunks(2).map(|c| format!("{:02x}{:02x}", c[0], c[1])).collect::<Vec<_>>().join(":")
}

/// Whether `a` (on a `/a_prefix` network) and `b` (on a `/b_prefix` network) are on one subnet.
///
/// Both sides must agree, so the shorter prefix decides: the addresses must match on its leading
/// bits. A prefix of 0 (a default route, not a subnet) or above 32 (malformed) never matches.
pub fn same_subnet(a: Ipv4Addr, a_prefix: u8, b: Ipv4Addr, b_prefix: u8) -> bool {
    if a_prefix == 0 || a_prefix > 32 || b_prefix == 0 || b_prefix > 32 {
        return false;
    }
    let prefix = u32::from(a_prefix.min(b_prefix));
    // prefix is in 1..=32, so the shift is in 0..=31 and cannot overflow.
    let mask = u32::MAX << (32 - prefix);
    u32::from(a) & mask == u32::from(b) & mask
}

/// What matching needs to know of one device, ours or the peer's.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RailFacts {
    pub device: String,
    pub link_layer: String,
    pub gid: [u8; 16],
    /// 0 = unknown
    pub ipv4_prefix: u32,
}

impl RailFacts {
    /// `rxe0 (10.0.0.1/24, Ethernet)`, for the refusal's message.
    pub fn describe(&self) -> String {
        let name = if self.device.is_empty() { "(unnamed)" } else { &self.device };
        let addr = match (gid_ipv4(&self.gid), self.ipv4_prefix) {
            (Some(ip), 0) => format!("{ip}/?"),
            (Some(ip), p) => format!("{ip}/{p}"),
            (None, _) => gid_string(&self.gid),
        };
        format!("{name} ({addr}, {})", self.link_layer)
    }
}

/// Whether one device reaches another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reach {
    No,
    /// Nothing says no, nothing says yes (unknown prefixes, IPv6 GIDs).
    Maybe,
    Yes,
}

/// Whether `local` reaches `remote` (symmetric).
pub fn reaches(local: &RailFacts, remote: &RailFacts) -> Reach {
    if local.link_layer != remote.link_layer {
        return Reach::No;
    }
    match local.link_layer.as_str() {
        LINK_ETHERNET => roce(local, remote),
        LINK_INFINIBAND => {
            // An all-zero GID says nothing (an old peer that sent none).
            if local.gid == [0; 16] || remote.gid == [0; 16] {
                Reach::Maybe
            } else if local.gid[..8] == remote.gid[..8] {
                Reach::Yes
            } else {
                Reach::No
            }
        }
        _ => Reach::Maybe,
    }
}

fn roce(a: &RailFacts, b: &RailFacts) -> Reach {
    let (Some(ia), Some(ib)) = (gid_ipv4(&a.gid), gid_ipv4(&b.gid)) else { return Reach::Maybe };
    let (pa, pb) = match (prefix(a.ipv4_prefix), prefix(b.ipv4_prefix)) {
        (None, None) => return Reach::Maybe,
        (Some(p), None) | (None, Some(p)) => (p, p),
        (Some(pa), Some(pb)) => (pa, pb),
    };
    if in_subnet(ia, ib, pa) && in_subnet(ia, ib, pb) {
        Reach::Yes
    } else {
        Reach::No
    }
}

/// A usable prefix length (1..=32); 0 and anything malformed are unknown.
fn prefix(p: u32) -> Option<u8> {
    u8::try_from(p).ok().filter(|p| (1..=32).contains(p))
}

fn in_subnet(a: Ipv4Addr, b: Ipv4Addr, p: u8) -> bool {
    same_subnet(a, p, b, p)
}

/// Matches the peer's rails (`remote`, in order) to our devices (`local`) one to one: as many
/// pairs as possible that certainly reach each other, then, for rails still unmatched, devices
/// left that may. Returns `(remote index, local index)` pairs in remote order. Ties go to the
/// lower-numbered device, so both agents' device orders make the choice deterministic.
pub fn match_rails(local: &[RailFacts], remote: &[RailFacts]) -> Vec<(usize, usize)> {
    let mut owner: Vec<Option<usize>> = vec![None; local.len()];
    for want in [Reach::Yes, Reach::Maybe] {
        for r in 0..remote.len() {
            if owner.contains(&Some(r)) {
                continue;
            }
            let mut seen = vec![false; local.len()];
            augment(r, want, local, remote, &mut owner, &mut seen);
        }
    }
    let mut pairs: Vec<(usize, usize)> = owner.iter().enumerate().filter_map(|(l, r)| r.map(|r| (r, l))).collect();
    pairs.sort_unstable();
    pairs
}

/// One augmenting-path step of bipartite matching (Kuhn): gives rail `r` a device that reaches
/// it at least as well as `want`, moving earlier rails to other devices if that frees one.
/// Earlier rails only move along edges of their own kind, so a certain pair is never traded
/// for a doubtful one.
fn augment(r: usize, want: Reach, local: &[RailFacts], remote: &[RailFacts], owner: &mut [Option<usize>], seen: &mut [bool]) -> bool {
    // A free device first (the lowest): nobody moves unless that is the only way.
    if let Some(l) = (0..local.len()).find(|&l| owner[l].is_none() && !seen[l] && reaches(&local[l], &remote[r]) == want) {
        owner[l] = Some(r);
        return true;
    }
    for l in 0..local.len() {
        if seen[l] || reaches(&local[l], &remote[r]) != want {
            continue;
        }
        seen[l] = true;
        // Only a rail holding its device by an edge of this kind moves.
        let Some(other) = owner[l] else { continue };
        if reaches(&local[l], &remote[other]) == want && augment(other, want, local, remote, owner, seen) {
            owner[l] = Some(r);
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roce(dev: &str, ip: [u8; 4], prefix: u32) -> RailFacts {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&ip);
        RailFacts { device: dev.into(), link_layer: LINK_ETHERNET.into(), gid, ipv4_prefix: prefix }
    }

    fn ib(dev: &str, subnet: u8) -> RailFacts {
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[7] = subnet;
        gid[15] = 1;
        RailFacts { device: dev.into(), link_layer: LINK_INFINIBAND.into(), gid, ipv4_prefix: 0 }
    }

    #[test]
    fn two_by_two_on_two_subnets_gives_two_paths_crosswise() {
        // Our devices are listed in the other order than the peer's: each finds its own subnet.
        let local = [roce("rxe1", [10, 0, 1, 2], 24), roce("rxe3", [10, 0, 0, 2], 24)];
        let remote = [roce("rxe0", [10, 0, 0, 1], 24), roce("rxe2", [10, 0, 1, 1], 24)];
        assert_eq!(match_rails(&local, &remote), vec![(0, 1), (1, 0)]);
    }

    #[test]
    fn two_rails_to_one_device_give_one_path() {
        let local = [roce("mlx5_0", [10, 0, 1, 2], 24)];
        let remote = [roce("mlx5_0", [10, 0, 0, 1], 24), roce("mlx5_1", [10, 0, 1, 1], 24)];
        assert_eq!(match_rails(&local, &remote), vec![(1, 0)]);
        // And the other way round: one rail, two devices, only one of which reaches it.
        let local = [roce("a", [10, 0, 0, 2], 24), roce("b", [10, 0, 1, 2], 24)];
        assert_eq!(match_rails(&local, &[roce("x", [10, 0, 1, 1], 24)]), vec![(0, 1)]);
    }

    #[test]
    fn each_device_serves_one_rail_even_on_one_subnet() {
        let local = [roce("a", [10, 0, 0, 2], 16), roce("b", [10, 0, 0, 3], 16)];
        let remote = [roce("x", [10, 0, 0, 4], 16), roce("y", [10, 0, 0, 5], 16), roce("z", [10, 0, 0, 6], 16)];
        assert_eq!(match_rails(&local, &remote), vec![(0, 0), (1, 1)]);
    }

    #[test]
    fn a_certain_pair_is_not_traded_for_a_doubtful_one() {
        // Rail 0 only *may* reach `a` (no prefix known on either side); rail 1 certainly reaches
        // `a`. Rail 1 gets `a`, and rail 0 the device left if it may reach it.
        let mut unknown = roce("x", [192, 168, 0, 1], 0);
        let local = [roce("a", [10, 0, 0, 2], 0), roce("b", [172, 16, 0, 2], 0)];
        let remote = [unknown.clone(), roce("y", [10, 0, 0, 1], 24)];
        assert_eq!(match_rails(&local, &remote), vec![(0, 1), (1, 0)]);
        unknown.link_layer = LINK_INFINIBAND.into();
        assert_eq!(match_rails(&local, &[unknown, roce("y", [10, 0, 0, 1], 24)]), vec![(1, 0)]);
    }

    #[test]
    fn mismatched_link_layers_never_reach() {
        let local = [ib("mlx5_0", 1)];
        let remote = [roce("rxe0", [10, 0, 0, 1], 24)];
        assert_eq!(reaches(&local[0], &remote[0]), Reach::No);
        assert!(match_rails(&local, &remote).is_empty());
    }

    #[test]
    fn infiniband_matches_by_subnet_prefix() {
        assert_eq!(reaches(&ib("a", 1), &ib("b", 1)), Reach::Yes);
        assert_eq!(reaches(&ib("a", 1), &ib("b", 2)), Reach::No);
        let local = [ib("a", 1), ib("b", 2)];
        assert_eq!(match_rails(&local, &[ib("y", 2), ib("x", 1)]), vec![(0, 1), (1, 0)]);
    }

    #[test]
    fn no_overlap_matches_nothing() {
        let local = [roce("a", [10, 0, 0, 2], 24), roce("b", [10, 0, 1, 2], 24)];
        let remote = [roce("x", [10, 0, 2, 1], 24), roce("y", [10, 0, 3, 1], 24)];
        assert!(match_rails(&local, &remote).is_empty());
    }

    #[test]
    fn both_prefixes_must_hold_and_one_known_prefix_is_used_for_both() {
        // 10.0.1.1 is inside 10.0.0.0/16 but outside 10.0.0.0/24: the /24 side could not answer.
        assert_eq!(reaches(&roce("a", [10, 0, 0, 2], 24), &roce("x", [10, 0, 1, 1], 16)), Reach::No);
        assert_eq!(reaches(&roce("a", [10, 0, 0, 2], 16), &roce("x", [10, 0, 1, 1], 16)), Reach::Yes);
        assert_eq!(reaches(&roce("a", [10, 0, 0, 2], 0), &roce("x", [10, 0, 0, 1], 24)), Reach::Yes);
        assert_eq!(reaches(&roce("a", [10, 0, 0, 2], 0), &roce("x", [10, 0, 1, 1], 24)), Reach::No);
        assert_eq!(reaches(&roce("a", [10, 0, 0, 2], 0), &roce("x", [10, 9, 9, 1], 0)), Reach::Maybe);
    }

    #[test]
    fn descriptions_name_device_address_and_link() {
        assert_eq!(roce("rxe0", [10, 0, 0, 1], 24).describe(), "rxe0 (10.0.0.1/24, Ethernet)");
        assert_eq!(roce("", [10, 0, 0, 1], 0).describe(), "(unnamed) (10.0.0.1/?, Ethernet)");
    }

    /// What a peer controls in its facts (rail count, prefixes, GIDs, link layer strings) can
    /// make a pair doubtful or unreachable, never make one device carry two rails or a pair
    /// reach that its addresses say does not.
    #[test]
    fn hostile_facts_never_give_a_device_two_rails() {
        let local = [roce("a", [10, 0, 0, 2], 24), roce("b", [10, 0, 1, 2], 24)];
        // Sixty-four rails, every one reaching `a`: one pair.
        let many: Vec<RailFacts> = (0..64).map(|i| roce("x", [10, 0, 0, 10 + i], 24)).collect();
        assert_eq!(match_rails(&local, &many), vec![(0, 0)]);
        // Duplicated facts (one device offered twice): each device still serves one.
        let twice = [roce("y", [10, 0, 1, 1], 24), roce("y", [10, 0, 1, 1], 24)];
        assert_eq!(match_rails(&local, &twice), vec![(0, 1)]);
        // A prefix out of range (33, 255) is unknown, not "/0 = everything": the other's is used.
        for p in [33, 255, u32::MAX] {
            assert_eq!(reaches(&local[0], &roce("z", [10, 9, 9, 9], p)), Reach::No, "prefix {p}");
            assert_eq!(reaches(&local[0], &roce("z", [10, 0, 0, 9], p)), Reach::Yes, "prefix {p}");
        }
        // A GID that is not IPv4-mapped, with a prefix set: doubtful, used only when nothing
        // certain is left, and never taken over a certain pair.
        let mut v6 = roce("v6", [0, 0, 0, 0], 24);
        v6.gid = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(reaches(&local[0], &v6), Reach::Maybe);
        assert_eq!(match_rails(&local, &[v6.clone(), roce("y", [10, 0, 0, 1], 24)]), vec![(0, 1), (1, 0)]);
        // A 10 KB or empty link layer matches no device of ours.
        let mut odd = roce("w", [10, 0, 0, 1], 24);
        for ll in ["E".repeat(10 << 10), String::new(), "ethernet".into()] {
            odd.link_layer = ll;
            assert_eq!(reaches(&local[0], &odd), Reach::No);
            assert!(match_rails(&local, &[odd.clone()]).is_empty());
        }
        // No devices or no rails: nothing, no panic.
        assert!(match_rails(&[], &many).is_empty());
        assert!(match_rails(&local, &[]).is_empty());
        assert_eq!(prefix(33), None);
        assert_eq!(prefix(0), None);
        assert_eq!(prefix(32), Some(32));
    }
}
