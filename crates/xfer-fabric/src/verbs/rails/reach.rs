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
