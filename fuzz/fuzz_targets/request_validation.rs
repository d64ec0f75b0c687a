//! Request validation at the protobuf boundary, fed arbitrary bytes.
//!
//! The first byte picks a message; the rest is decoded with prost like tonic would. Decodable
//! messages go through the same conversion functions the gRPC handlers call
//! (`xfer_agent::service::convert`), and what they accept must satisfy the domain's invariants.
//! Nothing may panic.
#![no_main]

use std::time::{Duration, Instant, SystemTime};

use libfuzzer_sys::fuzz_target;
use prost::Message;
use xfer_agent::config::{parse_size, ByteSize};
use xfer_agent::regions::validate_name;
use xfer_agent::service::bounds::{Bounded, Bounds};
use xfer_agent::service::convert as c;
use xfer_fabric::{Endpoint, FabricKind, RemoteOp};
use xfer_proto::v1 as pb;

/// An accepted duration must be usable as a deadline from now: the agent adds ttls to
/// `SystemTime::now()` and timeouts (+ 60 s of grant slack) to `Instant::now()`.
fn check_deadline(d: Duration) {
    assert!(SystemTime::now().checked_add(d).is_some(), "accepted duration {d:?} overflows SystemTime");
    let slack = d.checked_add(Duration::from_secs(60)).expect("duration + 60 s");
    assert!(Instant::now().checked_add(slack).is_some(), "accepted duration {d:?} overflows Instant");
}

fn check_endpoint(pbe: &pb::Endpoint, e: &Endpoint) {
    match e {
        Endpoint::Verbs(v) => {
            assert!(v.qpn != 0 && v.qpn <= 0x00ff_ffff, "QPN {}", v.qpn);
            assert!(v.psn <= 0x00ff_ffff, "PSN {}", v.psn);
            assert!(matches!(v.mtu, 256 | 512 | 1024 | 2048 | 4096), "MTU {}", v.mtu);
        }
        Endpoint::Tcp { .. } => {}
    }
    // What the agent accepted survives its own encoding unchanged.
    let again = c::endpoint_from_pb(&c::endpoint_to_pb(e)).expect("re-encoded endpoint is valid");
    assert_eq!(format!("{again:?}"), format!("{e:?}"));
    if let Some(pb::endpoint::Kind::Verbs(v)) = &pbe.kind {
        assert_eq!(v.gid.len(), 16);
    }
}

fn check_enums(v: i32) {
    if let Ok(o) = c::op_from_pb(v) {
        assert!(v == pb::Op::Write as i32 || v == pb::Op::Read as i32, "op {v} → {o:?}");
    }
    if let Ok(a) = c::access_from_pb(v) {
        assert!(pb::Access::try_from(v).is_ok());
        if v != pb::Access::Unspecified as i32 {
            assert_eq!(c::access_to_pb(a) as i32, v);
        }
    }
    if c::kind_from_pb(v).is_ok() {
        assert!(pb::RegionKind::try_from(v).is_ok());
    }
    if let Ok(a) = c::algo_from_pb(v) {
        if v != pb::ChecksumAlgo::Unspecified as i32 {
            assert_eq!(c::algo_to_pb(a) as i32, v);
        }
    }
    if let Some(k) = c::fabric_from_pb(v) {
        assert_eq!(c::fabric_to_pb(k) as i32, v);
    }
}

fn check_text(s: &str) {
    let valid = !s.is_empty()
        && s.len() <= 128
        && !s.starts_with('.')
        && s.chars().all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '-' | '_' | '.'));
    assert_eq!(validate_name(s).is_ok(), valid, "validate_name({s:?})");
    if let Ok(n) = parse_size(s) {
        // Display picks the largest exact binary unit; parsing it back gives the same size.
        let shown = ByteSize(n).to_string();
        assert_eq!(parse_size(&shown), Ok(n), "{s:?} → {n} → {shown:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else { return };
    match sel % 8 {
        0 => {
            if let Ok(r) = pb::CreateRegionRequest::decode(rest) {
                // Labels that pass the bounds are inert: nothing but [A-Za-z0-9._/-], bounded.
                if r.check(&Bounds { max_tag: 1024, max_segments: 65_536 }).is_ok() {
                    assert!(r.labels.len() <= xfer_agent::labels::MAX_LABELS);
                    for (k, v) in &r.labels {
                        assert!(k.len() <= 253 + 1 + 63 && v.len() <= 63, "{k:?}={v:?}");
                        let inert = |s: &str| s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/'));
                        assert!(inert(k) && inert(v), "{k:?}={v:?}");
                    }
                }
                let name = r.name.clone();
                if let Ok(spec) = c::region_spec_from_pb(r) {
                    assert_eq!(spec.name, name);
                    if let Some(ttl) = spec.ttl {
                        assert!(!ttl.is_zero());
                        check_deadline(ttl);
                    }
                    assert!(spec.path.as_deref() != Some(""));
                    let _ = validate_name(&spec.name);
                }
            }
        }
        1 => {
            if let Ok(r) = pb::SubmitTransferRequest::decode(rest) {
                if let Ok(t) = c::transfer_request_from_pb(r) {
                    assert!(!t.local_region.is_empty() && !t.remote_region.is_empty() && !t.remote_agent.is_empty());
                    assert!(t.options.chunk_size != Some(0) && t.options.qps != Some(0) && t.options.depth != Some(0));
                    if let Some(d) = t.options.timeout {
                        check_deadline(d);
                    }
                }
            }
        }
        2 => {
            if let Ok(r) = pb::GrantRequest::decode(rest) {
                let op = r.op;
                if let Ok(g) = c::grant_params_from_pb(r) {
                    assert!(!g.region.is_empty() && !g.peer.is_empty());
                    let want = if g.op == RemoteOp::Read { pb::Access::Read } else { pb::Access::Write };
                    assert_eq!(op, want as i32);
                    if let Some(d) = g.ttl {
                        check_deadline(d);
                    }
                }
            }
        }
        3 => {
            if let Ok(r) = pb::PeerConnectRequest::decode(rest) {
                if let Ok((id, fabric, eps)) = c::peer_connect_from_pb(&r) {
                    assert_eq!(r.version, 1);
                    // An accepted id is the one sent, and a valid wire id.
                    assert_eq!(id.as_str(), r.connection_id);
                    assert!(xfer_engine::ids::valid_wire_id(id.as_str()));
                    assert!(matches!(fabric, FabricKind::Tcp | FabricKind::Verbs));
                    assert!(eps.len() <= 64);
                    assert_eq!(eps.len(), r.endpoints.len());
                    for (p, e) in r.endpoints.iter().zip(&eps) {
                        check_endpoint(p, e);
                    }
                }
            }
        }
        4 => {
            if let Ok(e) = pb::Endpoint::decode(rest) {
                if let Ok(d) = c::endpoint_from_pb(&e) {
                    check_endpoint(&e, &d);
                }
            }
        }
        5 => {
            if let Ok(d) = prost_types::Duration::decode(rest) {
                if let Some(x) = c::duration_from_pb(&d) {
                    assert_eq!(c::duration_to_pb(x), d);
                }
            }
        }
        6 => {
            if let Ok(t) = prost_types::Timestamp::decode(rest) {
                if let Some(x) = c::time_from_pb(t) {
                    assert_eq!(c::time_to_pb(x), t);
                }
            }
        }
        _ => {
            if let Some(b) = rest.get(..4) {
                check_enums(i32::from_le_bytes(b.try_into().expect("4 bytes")));
            }
            if let Ok(s) = std::str::from_utf8(rest) {
                check_text(s);
            }
        }
    }
});
