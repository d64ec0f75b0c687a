//! The size of every string and bytes field of every request, checked as it is decoded, before
//! a handler copies, converts, looks up or stores anything.
//!
//! tonic bounds a whole message (`limits.max_message_size`); this bounds each field to what it
//! can mean: a region name is a region name's length, an id an id's, a tag at most
//! `transfer.max_notify_bytes`, labels by [`crate::labels`]. A field over its bound is
//! INVALID_ARGUMENT naming the field ([`BoundError`], mapped to a status in `convert`), so what
//! a caller sent never reaches a log, a record, a notification or another caller at a size
//! nobody planned for. Every request type of the proto has an impl here (a test compares them
//! with `xfer.proto`), and every handler takes its request through `Services::checked` (a test
//! reads `service/agent.rs` and `service/peer.rs`).
use xfer_proto::v1 as pb;

/// Longest `host:port` a request may name (a 253-character DNS name, brackets, a port).
pub const MAX_ADDRESS: usize = 300;
/// Longest file path (Linux PATH_MAX).
pub const MAX_PATH: usize = 4096;
/// Longest id (transfer, grant, connection; [`xfer_engine::ids`]).
pub const MAX_ID: usize = 64;
/// Longest descriptive string a peer's endpoint carries (`gid_type`, `link_layer`).
pub const MAX_ENDPOINT_WORD: usize = 32;
/// Most endpoints (QPs) one `Peer.Connect` may carry (an initiator checks its own offers against
/// the same number).
pub const MAX_ENDPOINTS: usize = xfer_engine::shape::MAX_ENDPOINTS;
/// A region is named by its name or its id: the longer of the two.
const MAX_REGION_REF: usize = crate::regions::MAX_NAME_LEN;
/// A node's name (a certificate's NAME).
const MAX_NODE_NAME: usize = xfer_fabric::identity::MAX_NAME_LEN;

/// The configured bounds a check needs.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// `transfer.max_notify_bytes`: the longest notification tag (and tag filter).
    pub max_tag: usize,
    /// `transfer.max_segments`: the most segments a batch may list.
    pub max_segments: usize,
}

/// A field over its bound; every message starts with the field's name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BoundError {
    /// INVALID_ARGUMENT: the field cannot mean anything at this size.
    #[error("{0}")]
    Invalid(String),
    /// RESOURCE_EXHAUSTED: more items than a configured limit (segments, QPs).
    #[error("{0}")]
    TooMany(String),
}

/// A request whose fields can be checked against [`Bounds`].
pub trait Bounded {
    fn check(&self, b: &Bounds) -> Result<(), BoundError>;
}

fn at_most(field: &str, n: usize, max: usize) -> Result<(), BoundError> {
    if n > max {
        return Err(BoundError::Invalid(format!("{field}: {n} bytes; at most {max}")));
    }
    Ok(())
}

fn labels(field: &str, m: &std::collections::HashMap<String, String>) -> Result<(), BoundError> {
    // Counted before anything is copied: a map of a million entries is refused as it is.
    if m.len() > crate::labels::MAX_LABELS {
        return Err(BoundError::Invalid(format!("{field}: {} entries; at most {}", m.len(), crate::labels::MAX_LABELS)));
    }
    let sorted: std::collections::BTreeMap<String, String> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    crate::labels::check(&sorted).map_err(|e| BoundError::Invalid(format!("{field}: {e}")))
}

fn tag(field: &str, t: Option<&[u8]>, b: &Bounds) -> Result<(), BoundError> {
    match t {
        Some(t) if t.len() > b.max_tag => Err(BoundError::Invalid(format!(
            "{field}: a tag of {} bytes; this agent takes at most {} (transfer.max_notify_bytes)",
            t.len(),
            b.max_tag
        ))),
        _ => Ok(()),
    }
}

fn local(field: &str, r: Option<&pb::LocalRange>) -> Result<(), BoundError> {
    r.map_or(Ok(()), |r| at_most(&format!("{field}.region"), r.region.len(), MAX_REGION_REF))
}

fn remote(field: &str, r: Option<&pb::RemoteRange>) -> Result<(), BoundError> {
    match r {
        Some(r) => {
            at_most(&format!("{field}.agent"), r.agent.len(), MAX_ADDRESS)?;
            at_most(&format!("{field}.region"), r.region.len(), MAX_REGION_REF)
        }
        None => Ok(()),
    }
}

fn endpoint(i: usize, e: &pb::Endpoint) -> Result<(), BoundError> {
    match &e.kind {
        Some(pb::endpoint::Kind::Tcp(t)) => {
            at_most(&format!("endpoints[{i}].tcp.address"), t.address.len(), MAX_ADDRESS)?;
            at_most(&format!("endpoints[{i}].tcp.secret"), t.secret.len(), 32)
        }
        Some(pb::endpoint::Kind::Verbs(v)) => {
            at_most(&format!("endpoints[{i}].verbs.gid"), v.gid.len(), 16)?;
            at_most(&format!("endpoints[{i}].verbs.gid_type"), v.gid_type.len(), MAX_ENDPOINT_WORD)?;
            at_most(&format!("endpoints[{i}].verbs.link_layer"), v.link_layer.len(), MAX_ENDPOINT_WORD)?;
            at_most(&format!("endpoints[{i}].verbs.device"), v.device.len(), MAX_ENDPOINT_WORD)
        }
        None => Ok(()),
    }
}

/// One impl per request type, and the list of their names for the completeness test.
macro_rules! bounded {
    ($($t:ident => |$r:ident, $b:ident| $body:block)*) => {
        $(impl Bounded for pb::$t {
            #[allow(unused_variables)]
            fn check(&self, $b: &Bounds) -> Result<(), BoundError> {
                let $r = self;
                $body
            }
        })*
        #[cfg(test)]
        const CHECKED: &[&str] = &[$(stringify!($t)),*];
    };
}

bounded! {
    GetInfoRequest => |r, b| { Ok(()) }
    CreateRegionRequest => |r, b| {
        at_most("name", r.name.len(), crate::regions::MAX_NAME_LEN)?;
        at_most("path", r.path.len(), MAX_PATH)?;
        labels("labels", &r.labels)
    }
    DeleteRegionRequest => |r, b| { at_most("name", r.name.len(), MAX_REGION_REF) }
    ListRegionsRequest => |r, b| { labels("label_selector", &r.label_selector) }
    GetRegionRequest => |r, b| { at_most("name", r.name.len(), MAX_REGION_REF) }
    // `data` is bounded by the message size and copied straight into the region.
    WriteRegionRequest => |r, b| { at_most("region", r.region.len(), MAX_REGION_REF) }
    ReadRegionRequest => |r, b| { at_most("region", r.region.len(), MAX_REGION_REF) }
    ChecksumRequest => |r, b| { at_most("region", r.region.len(), MAX_REGION_REF) }
    SubmitTransferRequest => |r, b| {
        local("local", r.local.as_ref())?;
        remote("remote", r.remote.as_ref())?;
        tag("notify", r.notify.as_deref(), b)?;
        // Refused before the list is converted (a copy of up to a message of segments).
        if r.segments.len() > b.max_segments {
            return Err(BoundError::TooMany(format!(
                "segments: {} segments in one batch; this agent takes at most {} (transfer.max_segments)",
                r.segments.len(),
                b.max_segments
            )));
        }
        Ok(())
    }
    WatchTransferRequest => |r, b| { at_most("id", r.id.len(), MAX_ID) }
    GetTransferRequest => |r, b| { at_most("id", r.id.len(), MAX_ID) }
    ListTransfersRequest => |r, b| { Ok(()) }
    CancelTransferRequest => |r, b| { at_most("id", r.id.len(), MAX_ID) }
    WatchInboundRequest => |r, b| {
        at_most("region", r.region.len(), MAX_REGION_REF)?;
        tag("tag", r.tag.as_deref(), b)
    }
    WatchInboundRingRequest => |r, b| {
        at_most("region", r.region.len(), MAX_REGION_REF)?;
        tag("tag", r.tag.as_deref(), b)
    }
    // Every message of a channel's stream. A post's list and tag are answered in their turn
    // instead (a bad batch does not end a channel): lists over transfer.max_segments are dropped
    // as they arrive (`convert::channel_input_from_pb`), and the channel checks a tag against
    // transfer.max_notify_bytes before anything uses it; the input queue holds four messages.
    ChannelRequest => |r, b| {
        match &r.msg {
            Some(pb::channel_request::Msg::Open(o)) => {
                at_most("open.local_region", o.local_region.len(), MAX_REGION_REF)?;
                remote("open.remote", o.remote.as_ref())
            }
            Some(pb::channel_request::Msg::Post(_) | pb::channel_request::Msg::Prepare(_)) | None => Ok(()),
        }
    }
    ConnectRequest => |r, b| { at_most("peer", r.peer.len(), MAX_ADDRESS) }
    ListPeersRequest => |r, b| { Ok(()) }
    BenchRequest => |r, b| { at_most("peer", r.peer.len(), MAX_ADDRESS) }
    TcpBaselineRequest => |r, b| { at_most("peer", r.peer.len(), MAX_ADDRESS) }
    PeerConnectRequest => |r, b| {
        at_most("node_name", r.node_name.len(), MAX_NODE_NAME)?;
        at_most("connection_id", r.connection_id.len(), MAX_ID)?;
        if r.endpoints.len() > MAX_ENDPOINTS {
            return Err(BoundError::TooMany(format!("endpoints: {}; at most {MAX_ENDPOINTS} QPs per connection", r.endpoints.len())));
        }
        r.endpoints.iter().enumerate().try_for_each(|(i, e)| endpoint(i, e))
    }
    GrantRequest => |r, b| {
        at_most("region", r.region.len(), MAX_REGION_REF)?;
        at_most("node_name", r.node_name.len(), MAX_NODE_NAME)?;
        at_most("connection_id", r.connection_id.len(), MAX_ID)?;
        tag("notify.tag", r.notify.as_ref().map(|n| n.tag.as_slice()), b)
    }
    RevokeRequest => |r, b| { at_most("grant_id", r.grant_id.len(), MAX_ID) }
    CompleteRequest => |r, b| {
        at_most("transfer_id", r.transfer_id.len(), MAX_ID)?;
        at_most("grant_id", r.grant_id.len(), MAX_ID)?;
        at_most("node_name", r.node_name.len(), MAX_NODE_NAME)?;
        if r.spans.len() > b.max_segments {
            return Err(BoundError::TooMany(format!(
                "spans: {} spans in one completion; this agent takes at most {} (transfer.max_segments)",
                r.spans.len(),
                b.max_segments
            )));
        }
        Ok(())
    }
    VerifyBatchRequest => |r, b| {
        at_most("grant_id", r.grant_id.len(), MAX_ID)?;
        if r.spans.len() > b.max_segments {
            return Err(BoundError::TooMany(format!(
                "spans: {} spans in one batch; this agent takes at most {} (transfer.max_segments)",
                r.spans.len(),
                b.max_segments
            )));
        }
        Ok(())
    }
    AnnounceRequest => |r, b| {
        at_most("grant_id", r.grant_id.len(), MAX_ID)?;
        tag("tag", Some(&r.tag), b)
    }
    DisconnectRequest => |r, b| {
        at_most("connection_id", r.connection_id.len(), MAX_ID)?;
        at_most("node_name", r.node_name.len(), MAX_NODE_NAME)
    }
    OpenSinkRequest => |r, b| { Ok(()) }
    OpenBenchRegionRequest => |r, b| { Ok(()) }
    CloseBenchRegionRequest => |r, b| { at_most("region", r.region.len(), MAX_REGION_REF) }
    PingRequest => |r, b| { Ok(()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const B: Bounds = Bounds { max_tag: 1024, max_segments: 16 };

    fn s(n: usize) -> String {
        "a".repeat(n)
    }

    /// Each row: a request with one field one past its bound, the field the refusal must name,
    /// and the same request at the bound, which must pass.
    #[test]
    fn every_field_is_refused_one_past_its_bound_and_accepted_at_it() {
        type Case = (&'static str, Box<dyn Fn(usize) -> Box<dyn Bounded>>, usize);
        let remote = |agent: usize, region: usize| Some(pb::RemoteRange { agent: s(agent), region: s(region), offset: 0 });
        let ep_tcp =
            |addr: usize| pb::Endpoint { kind: Some(pb::endpoint::Kind::Tcp(pb::TcpEndpoint { address: s(addr), secret: vec![] })) };
        let ep_verbs = |w: usize| pb::Endpoint {
            kind: Some(pb::endpoint::Kind::Verbs(pb::VerbsEndpoint { gid_type: s(w), link_layer: "IB".into(), ..Default::default() })),
        };
        let cases: Vec<Case> = vec![
            ("name", Box::new(|n| Box::new(pb::CreateRegionRequest { name: s(n), ..Default::default() })), 128),
            ("path", Box::new(|n| Box::new(pb::CreateRegionRequest { path: s(n), ..Default::default() })), MAX_PATH),
            ("name", Box::new(|n| Box::new(pb::DeleteRegionRequest { name: s(n) })), 128),
            ("name", Box::new(|n| Box::new(pb::GetRegionRequest { name: s(n) })), 128),
            ("region", Box::new(|n| Box::new(pb::WriteRegionRequest { region: s(n), ..Default::default() })), 128),
            ("region", Box::new(|n| Box::new(pb::ReadRegionRequest { region: s(n), ..Default::default() })), 128),
            ("region", Box::new(|n| Box::new(pb::ChecksumRequest { region: s(n), ..Default::default() })), 128),
            (
                "local.region",
                Box::new(|n| {
                    Box::new(pb::SubmitTransferRequest { local: Some(pb::LocalRange { region: s(n), offset: 0 }), ..Default::default() })
                }),
                128,
            ),
            (
                "remote.agent",
                Box::new(move |n| Box::new(pb::SubmitTransferRequest { remote: remote(n, 1), ..Default::default() })),
                MAX_ADDRESS,
            ),
            ("remote.region", Box::new(move |n| Box::new(pb::SubmitTransferRequest { remote: remote(1, n), ..Default::default() })), 128),
            ("notify", Box::new(|n| Box::new(pb::SubmitTransferRequest { notify: Some(vec![0; n]), ..Default::default() })), 1024),
            ("id", Box::new(|n| Box::new(pb::WatchTransferRequest { id: s(n) })), MAX_ID),
            ("id", Box::new(|n| Box::new(pb::GetTransferRequest { id: s(n) })), MAX_ID),
            ("id", Box::new(|n| Box::new(pb::CancelTransferRequest { id: s(n) })), MAX_ID),
            ("region", Box::new(|n| Box::new(pb::WatchInboundRequest { region: s(n), tag: None })), 128),
            ("tag", Box::new(|n| Box::new(pb::WatchInboundRequest { region: String::new(), tag: Some(vec![7; n]) })), 1024),
            ("region", Box::new(|n| Box::new(pb::WatchInboundRingRequest { region: s(n), ..Default::default() })), 128),
            ("tag", Box::new(|n| Box::new(pb::WatchInboundRingRequest { tag: Some(vec![7; n]), ..Default::default() })), 1024),
            (
                "open.local_region",
                Box::new(|n| {
                    Box::new(pb::ChannelRequest {
                        msg: Some(pb::channel_request::Msg::Open(pb::ChannelOpen { local_region: s(n), ..Default::default() })),
                    })
                }),
                128,
            ),
            (
                "open.remote.agent",
                Box::new(move |n| {
                    Box::new(pb::ChannelRequest {
                        msg: Some(pb::channel_request::Msg::Open(pb::ChannelOpen { remote: remote(n, 1), ..Default::default() })),
                    })
                }),
                MAX_ADDRESS,
            ),
            ("peer", Box::new(|n| Box::new(pb::ConnectRequest { peer: s(n), qps: 0 })), MAX_ADDRESS),
            ("peer", Box::new(|n| Box::new(pb::BenchRequest { peer: s(n), ..Default::default() })), MAX_ADDRESS),
            ("peer", Box::new(|n| Box::new(pb::TcpBaselineRequest { peer: s(n), ..Default::default() })), MAX_ADDRESS),
            ("node_name", Box::new(|n| Box::new(pb::PeerConnectRequest { node_name: s(n), ..Default::default() })), 253),
            ("connection_id", Box::new(|n| Box::new(pb::PeerConnectRequest { connection_id: s(n), ..Default::default() })), MAX_ID),
            (
                "endpoints[0].tcp.address",
                Box::new(move |n| Box::new(pb::PeerConnectRequest { endpoints: vec![ep_tcp(n)], ..Default::default() })),
                MAX_ADDRESS,
            ),
            (
                "endpoints[0].verbs.gid_type",
                Box::new(move |n| Box::new(pb::PeerConnectRequest { endpoints: vec![ep_verbs(n)], ..Default::default() })),
                MAX_ENDPOINT_WORD,
            ),
            ("region", Box::new(|n| Box::new(pb::GrantRequest { region: s(n), ..Default::default() })), 128),
            ("node_name", Box::new(|n| Box::new(pb::GrantRequest { node_name: s(n), ..Default::default() })), 253),
            ("connection_id", Box::new(|n| Box::new(pb::GrantRequest { connection_id: s(n), ..Default::default() })), MAX_ID),
            (
                "notify.tag",
                Box::new(|n| {
                    Box::new(pb::GrantRequest {
                        notify: Some(pb::NotifyRequest { tag: vec![0; n], markers: 1, channel: false }),
                        ..Default::default()
                    })
                }),
                1024,
            ),
            ("grant_id", Box::new(|n| Box::new(pb::RevokeRequest { grant_id: s(n) })), MAX_ID),
            ("transfer_id", Box::new(|n| Box::new(pb::CompleteRequest { transfer_id: s(n), ..Default::default() })), MAX_ID),
            ("grant_id", Box::new(|n| Box::new(pb::CompleteRequest { grant_id: s(n), ..Default::default() })), MAX_ID),
            ("node_name", Box::new(|n| Box::new(pb::CompleteRequest { node_name: s(n), ..Default::default() })), 253),
            ("grant_id", Box::new(|n| Box::new(pb::AnnounceRequest { grant_id: s(n), ..Default::default() })), MAX_ID),
            ("tag", Box::new(|n| Box::new(pb::AnnounceRequest { tag: vec![0; n], ..Default::default() })), 1024),
            ("connection_id", Box::new(|n| Box::new(pb::DisconnectRequest { connection_id: s(n), node_name: String::new() })), MAX_ID),
            ("node_name", Box::new(|n| Box::new(pb::DisconnectRequest { connection_id: String::new(), node_name: s(n) })), 253),
            ("region", Box::new(|n| Box::new(pb::CloseBenchRegionRequest { region: s(n) })), 128),
        ];
        for (field, make, max) in &cases {
            make(*max).check(&B).unwrap_or_else(|e| panic!("{field} at its bound {max}: {e:?}"));
            let e = make(max + 1).check(&B).err().unwrap_or_else(|| panic!("{field} one past its bound {max} was accepted"));
            assert!(matches!(e, BoundError::Invalid(_)), "{field}: {e:?}");
            assert!(e.to_string().starts_with(&format!("{field}: ")), "{field}: {e}");
        }
    }

    #[test]
    fn labels_and_selectors_follow_the_label_rules() {
        let one = |k: &str, v: &str| HashMap::from([(k.to_string(), v.to_string())]);
        let ok = pb::CreateRegionRequest { name: "r".into(), labels: one("app.example.com/tier", "db"), ..Default::default() };
        assert!(ok.check(&B).is_ok());
        let bad = pb::CreateRegionRequest { name: "r".into(), labels: one("k", "\u{1b}[2J"), ..Default::default() };
        let e = bad.check(&B).unwrap_err();
        assert!(matches!(e, BoundError::Invalid(_)), "{e:?}");
        assert!(e.to_string().starts_with("labels: label \"k\""), "{e}");
        let many: HashMap<String, String> = (0..65).map(|i| (format!("k{i}"), String::new())).collect();
        let e = pb::ListRegionsRequest { label_selector: many }.check(&B).unwrap_err();
        assert!(e.to_string().starts_with("label_selector: 65 entries"), "{e}");
        let e = pb::ListRegionsRequest { label_selector: one("bad key", "v") }.check(&B).unwrap_err();
        assert!(e.to_string().contains("bad key"), "{e}");
    }

    #[test]
    fn too_many_segments_are_refused_before_they_are_converted() {
        let seg = pb::Segment { local_offset: 0, remote_offset: 0, length: 1 };
        assert!(pb::SubmitTransferRequest { segments: vec![seg; 16], ..Default::default() }.check(&B).is_ok());
        let e = pb::SubmitTransferRequest { segments: vec![seg; 17], ..Default::default() }.check(&B).unwrap_err();
        assert!(matches!(e, BoundError::TooMany(_)), "{e:?}");
        assert!(e.to_string().starts_with("segments: 17 segments"), "{e}");
    }

    #[test]
    fn too_many_endpoints_are_refused_before_any_is_looked_at() {
        let r = pb::PeerConnectRequest { endpoints: vec![pb::Endpoint::default(); MAX_ENDPOINTS + 1], ..Default::default() };
        assert!(matches!(r.check(&B), Err(BoundError::TooMany(_))));
    }

    /// Every request type of xfer.proto has a check (a new RPC cannot be added without one).
    #[test]
    fn every_request_type_of_the_proto_is_bounded() {
        let proto = include_str!("../../../proto/xfer/v1/xfer.proto");
        let mut missing = Vec::new();
        for line in proto.lines().map(str::trim).filter(|l| l.starts_with("rpc ")) {
            let arg = line.split('(').nth(1).and_then(|a| a.split(')').next()).unwrap_or_default();
            let name = arg.trim_start_matches("stream ").trim();
            if !CHECKED.contains(&name) {
                missing.push(name.to_string());
            }
        }
        assert!(missing.is_empty(), "request types without a bound: {missing:?}");
    }

    /// Every handler takes its request (or each message of its stream) through `checked`,
    /// `checked_ref` or `checked_msg` before using it.
    #[test]
    fn every_handler_checks_its_request() {
        let src = [include_str!("agent.rs"), include_str!("peer.rs")].concat();
        let mut unchecked = Vec::new();
        let mut rest = src.as_str();
        while let Some(at) = rest.find("async fn ") {
            rest = &rest[at + 9..];
            let name = rest.split('(').next().unwrap_or_default().to_string();
            let body_end = rest.find("async fn ").unwrap_or(rest.len());
            let body = &rest[..body_end];
            let takes_request = body.split('{').next().is_some_and(|sig| sig.contains(", req: Request<"));
            let checks = ["self.checked(req", "self.checked_ref(&req", "self.checked_msg("].iter().any(|c| body.contains(c));
            if takes_request && !checks {
                unchecked.push(name);
            }
        }
        assert!(unchecked.is_empty(), "handlers that use their request unchecked: {unchecked:?}");
    }
}
