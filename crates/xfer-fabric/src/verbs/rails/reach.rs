//! Which local device reaches which of the peer's, as the responder matches them in
//! `Peer.Connect` over the initiator's rails (one group of endpoints per initiator device). The
//! matching itself is pure and lives in [`xfer_engine::reach`] (so `xferctl doctor` can run it
//! over two agents' `GetInfo` answers); this module gives it the facts an endpoint carries.
pub use xfer_engine::reach::{match_rails, reaches, RailFacts, Reach};

use crate::VerbsEndpoint;

/// What matching knows of the peer's device behind `e`.
pub fn facts_of(e: &VerbsEndpoint) -> RailFacts {
    RailFacts { device: e.device.clone(), link_layer: e.link_layer.clone(), gid: e.gid, ipv4_prefix: e.ipv4_prefix }
}

#[cfg(test)]
mod tests {
    use super::facts_of;
    use crate::VerbsEndpoint;
    use xfer_engine::reach::LINK_ETHERNET;

    #[test]
    fn facts_are_the_endpoints_as_sent() {
        let e =
            VerbsEndpoint { device: "rxe1".into(), link_layer: LINK_ETHERNET.into(), gid: [7; 16], ipv4_prefix: 33, ..Default::default() };
        let f = facts_of(&e);
        assert_eq!((f.device.as_str(), f.link_layer.as_str(), f.gid, f.ipv4_prefix), ("rxe1", LINK_ETHERNET, [7; 16], 33));
    }
}
