//! Protobuf ⇄ domain conversions (the one proto boundary) and the mapping of every domain error
//! to a gRPC status (DESIGN §9).
use crate::ids::ConnectionId;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tonic::Status;
use xfer_proto::v1 as pb;

use crate::checksum::Algo;
use crate::fabric::{Access, Endpoint, FabricError, FabricKind, RemoteOp, VerbsEndpoint};
use crate::grants::GrantError;
use crate::node::GrantParams;
use crate::peer_api::{PeerError, RemoteCode};
use crate::regions::{Region, RegionError, RegionKind, RegionSpec, RegionView, UnavailableRegion};
use crate::transfer::{Op, TransferError, TransferOptions, TransferRecord, TransferRequest, TransferState};

pub fn duration_to_pb(d: Duration) -> prost_types::Duration {
    prost_types::Duration { seconds: d.as_secs().min(i64::MAX as u64) as i64, nanos: d.subsec_nanos() as i32 }
}

/// Longest ttl or timeout a request may carry (100 years). The agent turns them into deadlines
/// (`SystemTime::now() + ttl`, `Instant::now() + timeout`), which panic on overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `None` for negative, malformed or longer-than-[`MAX_DURATION`] durations.
pub fn duration_from_pb(d: &prost_types::Duration) -> Option<Duration> {
    if d.seconds < 0 || d.nanos < 0 || d.nanos >= 1_000_000_000 || d.seconds as u64 > MAX_DURATION.as_secs() {
        return None;
    }
    Some(Duration::new(d.seconds as u64, d.nanos as u32))
}

pub fn time_to_pb(t: SystemTime) -> prost_types::Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32 }
}

pub fn time_from_pb(t: prost_types::Timestamp) -> Option<SystemTime> {
    if t.seconds < 0 || !(0..1_000_000_000).contains(&t.nanos) {
        return None;
    }
    UNIX_EPOCH.checked_add(Duration::new(t.seconds as u64, t.nanos as u32))
}

pub fn fabric_to_pb(k: FabricKind) -> pb::FabricKind {
    match k {
        FabricKind::Tcp => pb::FabricKind::Tcp,
        FabricKind::Verbs => pb::FabricKind::Verbs,
    }
}

pub fn fabric_from_pb(v: i32) -> Option<FabricKind> {
    match pb::FabricKind::try_from(v).ok()? {
        pb::FabricKind::Tcp => Some(FabricKind::Tcp),
        pb::FabricKind::Verbs => Some(FabricKind::Verbs),
        pb::FabricKind::Unspecified => None,
    }
}

pub fn algo_to_pb(a: Algo) -> pb::ChecksumAlgo {
    match a {
        Algo::Xxh3 => pb::ChecksumAlgo::Xxh3,
        Algo::Crc32c => pb::ChecksumAlgo::Crc32c,
    }
}

pub fn algo_from_pb(v: i32) -> Result<Algo, Status> {
    match pb::ChecksumAlgo::try_from(v) {
        Ok(pb::ChecksumAlgo::Unspecified | pb::ChecksumAlgo::Xxh3) => Ok(Algo::Xxh3),
        Ok(pb::ChecksumAlgo::Crc32c) => Ok(Algo::Crc32c),
        Err(_) => Err(Status::invalid_argument(format!("unknown checksum algorithm {v}"))),
    }
}

pub fn access_to_pb(a: Access) -> pb::Access {
    match a {
        Access::Read => pb::Access::Read,
        Access::Write => pb::Access::Write,
        Access::ReadWrite => pb::Access::ReadWrite,
    }
}

pub fn access_from_pb(v: i32) -> Result<Access, Status> {
    match pb::Access::try_from(v) {
        Ok(pb::Access::Unspecified | pb::Access::ReadWrite) => Ok(Access::ReadWrite),
        Ok(pb::Access::Read) => Ok(Access::Read),
        Ok(pb::Access::Write) => Ok(Access::Write),
        Err(_) => Err(Status::invalid_argument(format!("unknown access {v}"))),
    }
}

pub fn kind_from_pb(v: i32) -> Result<RegionKind, Status> {
    match pb::RegionKind::try_from(v) {
        Ok(pb::RegionKind::Unspecified | pb::RegionKind::Anonymous) => Ok(RegionKind::Anonymous),
        Ok(pb::RegionKind::File) => Ok(RegionKind::File),
        Ok(pb::RegionKind::Shm) => Ok(RegionKind::Shm),
        Err(_) => Err(Status::invalid_argument(format!("unknown region kind {v}"))),
    }
}

fn kind_to_pb(k: RegionKind) -> pb::RegionKind {
    match k {
        RegionKind::Anonymous => pb::RegionKind::Anonymous,
        RegionKind::File => pb::RegionKind::File,
        RegionKind::Shm => pb::RegionKind::Shm,
    }
}

pub fn op_from_pb(v: i32) -> Result<Op, Status> {
    match pb::Op::try_from(v) {
        Ok(pb::Op::Write) => Ok(Op::Write),
        Ok(pb::Op::Read) => Ok(Op::Read),
        _ => Err(Status::invalid_argument("op must be OP_WRITE or OP_READ")),
    }
}

fn op_to_pb(o: Op) -> pb::Op {
    match o {
        Op::Write => pb::Op::Write,
        Op::Read => pb::Op::Read,
    }
}

pub fn region_to_pb(r: &Region) -> pb::Region {
    let exposed = r.registration.remote_key_exposed();
    pb::Region {
        id: r.id.clone(),
        name: r.name.clone(),
        length: r.length,
        kind: kind_to_pb(r.kind) as i32,
        path: r.path.clone().unwrap_or_default(),
        access: access_to_pb(r.access) as i32,
        labels: r.labels.clone().into_iter().collect(),
        created_at: Some(time_to_pb(r.created_at)),
        expires_at: r.expires_at.map(time_to_pb),
        // Keys and the registered address only where they are the region's remote access
        // anyway (verbs grant mode `region`); otherwise only grants expose memory (DESIGN §8).
        lkey: if exposed { r.registration.lkey() } else { 0 },
        rkey: if exposed { r.registration.rkey() } else { 0 },
        addr: if exposed { r.registration.addr() } else { 0 },
        // A region whose file shrank under its mapping stays listed (delete it to recreate).
        unavailable_reason: match r.intact() {
            Ok(()) => String::new(),
            Err(e) => e.to_string(),
        },
    }
}

/// A catalog region that could not be restored: what the catalog says, no keys, and the reason.
pub fn unavailable_region_to_pb(u: &UnavailableRegion) -> pb::Region {
    pb::Region {
        id: u.id().to_string(),
        name: u.name().to_string(),
        length: u.length(),
        kind: kind_to_pb(u.kind()) as i32,
        path: u.path().unwrap_or_default().to_string(),
        access: access_to_pb(u.access()) as i32,
        labels: u.labels().clone().into_iter().collect(),
        created_at: Some(time_to_pb(u.created_at())),
        expires_at: u.expires_at().map(time_to_pb),
        lkey: 0,
        rkey: 0,
        addr: 0,
        unavailable_reason: u.reason.clone(),
    }
}

pub fn region_view_to_pb(v: &RegionView) -> pb::Region {
    match v {
        RegionView::Live(r) => region_to_pb(r),
        RegionView::Unavailable(u) => unavailable_region_to_pb(u),
    }
}

fn state_to_pb(s: TransferState) -> pb::TransferState {
    match s {
        TransferState::Queued => pb::TransferState::Queued,
        TransferState::Connecting => pb::TransferState::Connecting,
        TransferState::Running => pb::TransferState::Running,
        TransferState::Succeeded => pb::TransferState::Succeeded,
        TransferState::Failed => pb::TransferState::Failed,
        TransferState::Cancelled => pb::TransferState::Cancelled,
    }
}

pub fn transfer_to_pb(t: &TransferRecord) -> pb::Transfer {
    pb::Transfer {
        id: t.id.clone(),
        op: op_to_pb(t.op) as i32,
        local: Some(pb::LocalRange { region: t.local_region.clone(), offset: t.local_offset }),
        remote: Some(pb::RemoteRange { agent: t.remote_agent.clone(), region: t.remote_region.clone(), offset: t.remote_offset }),
        length: t.length,
        state: state_to_pb(t.state) as i32,
        bytes_done: t.bytes_done,
        error: t.error.clone().unwrap_or_default(),
        error_code: t.error_code.map(|c| c.as_str().to_string()).unwrap_or_default(),
        created_at: Some(time_to_pb(t.created_at)),
        started_at: t.started_at.map(time_to_pb),
        finished_at: t.finished_at.map(time_to_pb),
        elapsed_seconds: t.elapsed.as_secs_f64(),
        verified: t.verified,
        checksum: t.checksum.unwrap_or(0),
        peer: t.peer.clone(),
        inbound: t.inbound,
        segments: t.segments,
        notify: t.notify.clone(),
    }
}

/// A `WatchInbound` subscriber fell `missed` notifications behind: its stream ends with this.
pub fn lagged_status(missed: u64) -> Status {
    Status::data_loss(format!("this subscriber fell {missed} notifications behind and missed them; subscribe again"))
}

/// A `WatchInboundRing` subscription whose ring the agent can no longer write ends with this.
pub fn ring_failed_status(why: &str) -> Status {
    Status::data_loss(why.to_string())
}

/// A `WatchInboundRing` subscription's one message: where its ring is.
pub fn inbound_ring_to_pb(r: &crate::node::InboundRing) -> pb::InboundRing {
    pb::InboundRing { object: r.object.clone(), length: r.length, slots: r.slots, slot_size: r.slot_size }
}

/// A notification for a `WatchInbound` subscriber.
pub fn notification_to_pb(n: &crate::notify::Notification) -> pb::Notification {
    pb::Notification {
        region: n.region.clone(),
        peer: n.peer.clone(),
        tag: n.tag.clone(),
        op: match n.op {
            RemoteOp::Write => pb::Op::Write,
            RemoteOp::Read => pb::Op::Read,
        } as i32,
        offset: n.offset,
        length: n.length,
        at: Some(time_to_pb(n.at)),
        via: n.via.as_str().to_string(),
    }
}

pub fn endpoint_to_pb(e: &Endpoint) -> pb::Endpoint {
    let kind = match e {
        Endpoint::Tcp { address, secret } => pb::endpoint::Kind::Tcp(pb::TcpEndpoint {
            address: address.to_string(),
            secret: secret.map(|s| s.0.to_vec()).unwrap_or_default(),
        }),
        Endpoint::Verbs(v) => pb::endpoint::Kind::Verbs(pb::VerbsEndpoint {
            qpn: v.qpn,
            psn: v.psn,
            gid: v.gid.to_vec(),
            gid_index: v.gid_index,
            lid: v.lid,
            port: v.port,
            mtu: v.mtu,
            max_rd_atomic: v.max_rd_atomic,
            gid_type: v.gid_type.clone(),
            link_layer: v.link_layer.clone(),
        }),
    };
    pb::Endpoint { kind: Some(kind) }
}

/// Validates what a peer sent: every field is checked, nothing is trusted.
pub fn endpoint_from_pb(e: &pb::Endpoint) -> Result<Endpoint, String> {
    match &e.kind {
        Some(pb::endpoint::Kind::Tcp(t)) => {
            let address = t.address.parse().map_err(|_| format!("invalid tcp data address {:?}", t.address))?;
            let secret = match t.secret.len() {
                0 => None,
                32 => t.secret.as_slice().try_into().ok().map(crate::fabric::DataSecret),
                n => return Err(format!("tcp data secret must be 32 bytes, got {n}")),
            };
            Ok(Endpoint::Tcp { address, secret })
        }
        Some(pb::endpoint::Kind::Verbs(v)) => {
            let gid: [u8; 16] = v.gid.as_slice().try_into().map_err(|_| format!("GID must be 16 bytes, got {}", v.gid.len()))?;
            if v.qpn == 0 || v.qpn > 0x00ff_ffff {
                return Err(format!("QPN {} is not a 24-bit non-zero value", v.qpn));
            }
            if v.psn > 0x00ff_ffff {
                return Err(format!("PSN {} is not a 24-bit value", v.psn));
            }
            if !matches!(v.mtu, 256 | 512 | 1024 | 2048 | 4096) {
                return Err(format!("MTU {} is not one of 256, 512, 1024, 2048, 4096", v.mtu));
            }
            Ok(Endpoint::Verbs(VerbsEndpoint {
                qpn: v.qpn,
                psn: v.psn,
                gid,
                gid_index: v.gid_index,
                lid: v.lid,
                port: v.port,
                mtu: v.mtu,
                max_rd_atomic: v.max_rd_atomic,
                gid_type: v.gid_type.clone(),
                link_layer: v.link_layer.clone(),
            }))
        }
        None => Err("endpoint without a kind".into()),
    }
}

// ---------------------------------------------------------------- requests → domain

pub(crate) fn require(cond: bool, msg: &str) -> Result<(), Status> {
    if cond {
        Ok(())
    } else {
        Err(invalid(msg))
    }
}

/// INVALID_ARGUMENT for a malformed request (what a domain type cannot express).
pub(crate) fn invalid(msg: impl Into<String>) -> Status {
    Status::invalid_argument(msg.into())
}

/// INTERNAL for a blocking task that panicked or was cancelled (the runtime shutting down).
pub(crate) fn join_status(e: tokio::task::JoinError) -> Status {
    Status::internal(format!("a blocking task failed: {e}"))
}

/// An optional request duration (ttl, timeout); `what` names the field in the error.
fn request_duration(d: Option<&prost_types::Duration>, what: &str) -> Result<Option<Duration>, Status> {
    match d {
        Some(d) => duration_from_pb(d).map(Some).ok_or_else(|| Status::invalid_argument(format!("{what} must be between 0 and 100 years"))),
        None => Ok(None),
    }
}

/// A peer address as a caller sent it: refused here, before any region, slot or dial is looked
/// at, unless it parses (`crate::peer_addr`); the pool canonicalizes it again when it keys.
pub fn peer_address(addr: &str) -> Result<(), Status> {
    crate::peer_addr::PeerAddr::parse(addr).map(|_| ()).map_err(|e| Status::invalid_argument(e.to_string()))
}

/// `Agent.CreateRegion`: everything that can be checked without the registry.
pub fn region_spec_from_pb(r: pb::CreateRegionRequest) -> Result<RegionSpec, Status> {
    Ok(RegionSpec {
        ttl: request_duration(r.ttl.as_ref(), "ttl")?.filter(|d| !d.is_zero()),
        kind: kind_from_pb(r.kind)?,
        access: access_from_pb(r.access)?,
        name: r.name,
        length: r.length,
        path: Some(r.path).filter(|p| !p.is_empty()),
        hugepages: r.hugepages,
        labels: r.labels.into_iter().collect(),
        adopt_existing: r.adopt_existing,
        shares: None,
    })
}

/// `Agent.SubmitTransfer`: required fields, enums and the timeout.
pub fn transfer_request_from_pb(r: pb::SubmitTransferRequest) -> Result<TransferRequest, Status> {
    let local = r.local.ok_or_else(|| Status::invalid_argument("local range is required"))?;
    let remote = r.remote.ok_or_else(|| Status::invalid_argument("remote range is required"))?;
    require(!local.region.is_empty(), "local region is required")?;
    require(!remote.region.is_empty(), "remote region is required")?;
    require(!remote.agent.is_empty(), "remote agent address is required")?;
    peer_address(&remote.agent)?;
    let options = options_from_pb(r.options.unwrap_or_default())?;
    Ok(TransferRequest {
        op: op_from_pb(r.op)?,
        local_region: local.region,
        local_offset: local.offset,
        remote_agent: remote.agent,
        remote_region: remote.region,
        remote_offset: remote.offset,
        length: r.length,
        segments: segments_from_pb(&r.segments),
        notify: r.notify,
        options,
    })
}

/// `TransferOptions`: 0 = the agent's default for each shape field.
fn options_from_pb(o: pb::TransferOptions) -> Result<TransferOptions, Status> {
    Ok(TransferOptions {
        chunk_size: (o.chunk_size > 0).then_some(o.chunk_size),
        qps: (o.qps > 0).then_some(o.qps as usize),
        depth: (o.depth > 0).then_some(o.depth as usize),
        verify: o.verify,
        algo: Some(algo_from_pb(o.verify_algo)?),
        timeout: request_duration(o.timeout.as_ref(), "timeout")?,
    })
}

fn segments_from_pb(v: &[pb::Segment]) -> Vec<crate::transfer::batch::SegmentSpec> {
    v.iter().map(|s| crate::transfer::batch::SegmentSpec { local: s.local_offset, remote: s.remote_offset, len: s.length }).collect()
}

/// `ChannelOpen`: the channel's range and options.
pub fn channel_params_from_pb(o: pb::ChannelOpen) -> Result<crate::node::ChannelParams, Status> {
    let remote = o.remote.ok_or_else(|| Status::invalid_argument("remote range is required"))?;
    require(!o.local_region.is_empty(), "local region is required")?;
    require(!remote.region.is_empty(), "remote region is required")?;
    require(!remote.agent.is_empty(), "remote agent address is required")?;
    peer_address(&remote.agent)?;
    Ok(crate::node::ChannelParams {
        op: op_from_pb(o.op)?,
        local_region: o.local_region,
        remote_agent: remote.agent,
        remote_region: remote.region,
        remote_offset: remote.offset,
        length: o.length,
        options: options_from_pb(o.options.unwrap_or_default())?,
        ttl: request_duration(o.ttl.as_ref(), "ttl")?,
        notify: o.notify,
    })
}

/// A message after `ChannelOpen`. A list over `max_segments` is not converted (nor kept): it
/// becomes [`crate::node::ChannelInput::TooMany`], answered in its turn.
pub fn channel_input_from_pb(r: pb::ChannelRequest, max_segments: usize) -> Result<crate::node::ChannelInput, Status> {
    use crate::node::ChannelInput;
    match r.msg {
        Some(pb::channel_request::Msg::Prepare(p)) if p.segments.len() > max_segments => {
            Ok(ChannelInput::TooMany { seq: 0, list: Some(p.list), n: p.segments.len() })
        }
        Some(pb::channel_request::Msg::Post(p)) if p.segments.len() > max_segments => {
            Ok(ChannelInput::TooMany { seq: p.seq, list: None, n: p.segments.len() })
        }
        Some(pb::channel_request::Msg::Prepare(p)) => Ok(ChannelInput::Prepare { list: p.list, segments: segments_from_pb(&p.segments) }),
        Some(pb::channel_request::Msg::Post(p)) => {
            Ok(ChannelInput::Post { seq: p.seq, segments: segments_from_pb(&p.segments), list: p.list, notify: p.notify })
        }
        Some(pb::channel_request::Msg::Open(_)) => {
            Err(Status::invalid_argument("the channel is open already: ChannelOpen comes once, first"))
        }
        None => Err(Status::invalid_argument("empty channel message")),
    }
}

pub fn channel_opened_to_pb(i: &crate::node::ChannelInfo) -> pb::ChannelEvent {
    pb::ChannelEvent {
        ev: Some(pb::channel_event::Ev::Opened(pb::ChannelOpened {
            channel_id: i.id.clone(),
            peer: i.peer.clone(),
            remote_offset: i.remote_offset,
            remote_length: i.remote_length,
            qps: i.qps as u32,
            expires_at: i.expires_at.map(time_to_pb),
        })),
    }
}

pub fn channel_output_to_pb(o: crate::node::ChannelOutput) -> pb::ChannelEvent {
    use crate::node::ChannelOutput;
    let ev = match o {
        ChannelOutput::Prepared { list, segments, bytes } => pb::channel_event::Ev::Prepared(pb::ChannelPrepared { list, segments, bytes }),
        ChannelOutput::Done(d) => {
            let state = if d.ok { pb::TransferState::Succeeded } else { pb::TransferState::Failed };
            let (error_code, error) = d.error.unwrap_or_default();
            pb::channel_event::Ev::Done(pb::BatchDone {
                seq: d.seq,
                state: state as i32,
                bytes: d.bytes,
                segments: d.segments,
                error,
                error_code,
                seconds: d.seconds,
                prep_ns_per_segment: d.prep_ns_per_segment,
                list: d.list.unwrap_or(0),
            })
        }
    };
    pb::ChannelEvent { ev: Some(ev) }
}

/// A connection id from a peer (INVALID_ARGUMENT unless 1-64 characters of `[A-Za-z0-9_.-]`).
pub fn connection_id_from_pb(id: &str) -> Result<ConnectionId, Status> {
    ConnectionId::parse(id).map_err(|e| Status::invalid_argument(e.to_string()))
}

/// `Peer.Connect`: protocol version, identity and every endpoint the peer sent.
pub fn peer_connect_from_pb(r: &pb::PeerConnectRequest) -> Result<(ConnectionId, FabricKind, Vec<Endpoint>), Status> {
    if r.version != 1 {
        return Err(Status::failed_precondition(format!("unsupported peer protocol version {} (this agent speaks 1)", r.version)));
    }
    require(!r.node_name.is_empty(), "node_name is required")?;
    let id = connection_id_from_pb(&r.connection_id)?;
    let fabric = fabric_from_pb(r.fabric).ok_or_else(|| Status::invalid_argument("fabric kind is required"))?;
    let eps = r.endpoints.iter().map(endpoint_from_pb).collect::<Result<Vec<_>, String>>().map_err(Status::invalid_argument)?;
    if eps.len() > 64 {
        return Err(Status::resource_exhausted("at most 64 QPs per connection"));
    }
    Ok((id, fabric, eps))
}

/// `Peer.Grant`: required fields, the operation and the ttl.
pub fn grant_params_from_pb(r: pb::GrantRequest) -> Result<GrantParams, Status> {
    require(!r.region.is_empty(), "region is required")?;
    require(!r.node_name.is_empty(), "node_name is required")?;
    let op = match pb::Access::try_from(r.op) {
        Ok(pb::Access::Read) => RemoteOp::Read,
        Ok(pb::Access::Write) => RemoteOp::Write,
        _ => return Err(Status::invalid_argument("grant op must be ACCESS_READ or ACCESS_WRITE")),
    };
    let ttl = request_duration(r.ttl.as_ref(), "ttl")?;
    let connection_id = match r.connection_id.as_str() {
        "" => None,
        id => Some(connection_id_from_pb(id)?),
    };
    let notify = r.notify.map(|n| match n.channel {
        true => crate::node::NotifyAsk::Channel { markers: n.markers },
        false => crate::node::NotifyAsk::Once { tag: n.tag, markers: n.markers },
    });
    Ok(GrantParams { region: r.region, offset: r.offset, length: r.length, op, ttl, peer: r.node_name, connection_id, notify })
}

// ---------------------------------------------------------------- errors → status

pub fn region_status(e: RegionError) -> Status {
    match &e {
        RegionError::NotFound(_) => Status::not_found(e.to_string()),
        RegionError::AlreadyExists(_) => Status::already_exists(e.to_string()),
        RegionError::Invalid(_) | RegionError::PathMissing { .. } | RegionError::FileTooShort { .. } => {
            Status::invalid_argument(e.to_string())
        }
        RegionError::NotRegular { .. } => Status::invalid_argument(e.to_string()),
        RegionError::Busy(_) | RegionError::Unavailable { .. } | RegionError::Poisoned { .. } => Status::failed_precondition(e.to_string()),
        RegionError::Denied(_) => Status::permission_denied(e.to_string()),
        RegionError::ShmExists { .. } => Status::already_exists(e.to_string()),
        RegionError::Limit(_) => Status::resource_exhausted(e.to_string()),
        RegionError::Io { source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied => Status::permission_denied(e.to_string()),
        RegionError::Io { .. } => Status::internal(e.to_string()),
        RegionError::Fabric(f) => fabric_status_code(f, e.to_string()),
    }
}

fn fabric_status_code(f: &FabricError, msg: String) -> Status {
    match f {
        FabricError::Registration(_) => Status::resource_exhausted(msg),
        // The responder keeps no more connections for this identity: a limit, not a mismatch.
        FabricError::Negotiation { attr: "connections", .. } => Status::resource_exhausted(msg),
        FabricError::Negotiation { .. } => Status::failed_precondition(msg),
        FabricError::Connect { .. } => Status::unavailable(msg),
        _ => Status::internal(msg),
    }
}

pub fn fabric_status(f: FabricError) -> Status {
    let msg = f.to_string();
    fabric_status_code(&f, msg)
}

/// A request field over its bound (`service::bounds`).
pub fn bound_status(e: super::bounds::BoundError) -> Status {
    use super::bounds::BoundError as B;
    match e {
        B::Invalid(m) => Status::invalid_argument(m),
        B::TooMany(m) => Status::resource_exhausted(m),
    }
}

pub fn grant_status(e: GrantError) -> Status {
    match &e {
        GrantError::NotFound(_) | GrantError::RegionGone(_) => Status::not_found(e.to_string()),
        GrantError::Expired(_) => Status::failed_precondition(e.to_string()),
        GrantError::WrongPeer(_) => Status::permission_denied(e.to_string()),
        GrantError::Limit(_) => Status::resource_exhausted(e.to_string()),
        GrantError::Invalid(_) => Status::invalid_argument(e.to_string()),
    }
}

/// Refused by the role check: no certificate is UNAUTHENTICATED; a certificate without the role
/// a method needs is PERMISSION_DENIED naming that role.
pub fn auth_status(e: super::auth::AuthError) -> Status {
    use super::auth::AuthError as A;
    match e {
        A::NoCertificate | A::Unusable(_) => Status::unauthenticated(e.to_string()),
        A::NoRole { .. } | A::Ambiguous(_) | A::Reserved(_) | A::Denied { .. } => Status::permission_denied(e.to_string()),
        A::Unknown(_) => Status::unimplemented(e.to_string()),
    }
}

pub fn peer_status(e: PeerError) -> Status {
    let msg = e.to_string();
    match &e {
        PeerError::BadAddress(_) | PeerError::InvalidAddress(_) => Status::invalid_argument(msg),
        PeerError::PoolFull { .. } | PeerError::ConnectionLimit { .. } => Status::resource_exhausted(msg),
        PeerError::Unreachable { .. } => Status::unavailable(msg),
        PeerError::Protocol { .. } => Status::internal(msg),
        PeerError::Fabric { source, .. } => fabric_status_code(source, msg),
        PeerError::Remote { code, .. } => match code {
            RemoteCode::NotFound => Status::not_found(msg),
            RemoteCode::InvalidArgument => Status::invalid_argument(msg),
            RemoteCode::PermissionDenied => Status::permission_denied(msg),
            RemoteCode::FailedPrecondition | RemoteCode::UnknownConnection => Status::failed_precondition(msg),
            RemoteCode::ResourceExhausted => Status::resource_exhausted(msg),
            RemoteCode::Unavailable => Status::unavailable(msg),
            RemoteCode::DeadlineExceeded => Status::deadline_exceeded(msg),
            RemoteCode::Other => Status::internal(msg),
        },
    }
}

pub fn transfer_status(e: TransferError) -> Status {
    match e {
        TransferError::Region(r) => region_status(r),
        TransferError::Peer(p) => peer_status(p),
        TransferError::Grant(g) => grant_status(g),
        TransferError::Invalid(m) => Status::invalid_argument(m),
        e @ TransferError::Shape(_) => Status::invalid_argument(e.to_string()),
        e @ TransferError::Batch(crate::transfer::batch::BatchError::TooMany { .. }) => Status::resource_exhausted(e.to_string()),
        e @ TransferError::Batch(_) => Status::invalid_argument(e.to_string()),
        TransferError::PermissionDenied(m) => Status::permission_denied(m),
        TransferError::FailedPrecondition(m) => Status::failed_precondition(m),
        TransferError::UnknownConnection(m) => {
            let mut s = Status::failed_precondition(m);
            s.metadata_mut().insert(
                crate::peer_api::ERROR_REASON_KEY,
                tonic::metadata::MetadataValue::from_static(crate::peer_api::UNKNOWN_CONNECTION),
            );
            s
        }
        e @ TransferError::NotFound(_) => Status::not_found(e.to_string()),
        e @ TransferError::Limit(_) => Status::resource_exhausted(e.to_string()),
        TransferError::AlreadyExists(m) => Status::already_exists(m),
        e @ TransferError::ShuttingDown => Status::unavailable(e.to_string()),
        TransferError::Aborted(m) => Status::aborted(m),
        TransferError::Internal(m) => Status::internal(m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_endpoints_are_validated() {
        let mut v = pb::VerbsEndpoint { qpn: 17, psn: 5, gid: vec![0; 16], mtu: 4096, ..Default::default() };
        let ok = pb::Endpoint { kind: Some(pb::endpoint::Kind::Verbs(v.clone())) };
        assert!(endpoint_from_pb(&ok).is_ok());
        v.gid = vec![0; 15];
        assert!(endpoint_from_pb(&pb::Endpoint { kind: Some(pb::endpoint::Kind::Verbs(v.clone())) }).unwrap_err().contains("GID"));
        v.gid = vec![0; 16];
        v.psn = 1 << 24;
        assert!(endpoint_from_pb(&pb::Endpoint { kind: Some(pb::endpoint::Kind::Verbs(v.clone())) }).unwrap_err().contains("PSN"));
        v.psn = 1;
        v.mtu = 1500;
        assert!(endpoint_from_pb(&pb::Endpoint { kind: Some(pb::endpoint::Kind::Verbs(v)) }).unwrap_err().contains("MTU"));
        assert!(endpoint_from_pb(&pb::Endpoint { kind: None }).is_err());
        let t = pb::Endpoint { kind: Some(pb::endpoint::Kind::Tcp(pb::TcpEndpoint { address: "nope".into(), secret: Vec::new() })) };
        assert!(endpoint_from_pb(&t).is_err());
    }

    #[test]
    fn durations_reject_negative_values() {
        assert_eq!(duration_from_pb(&prost_types::Duration { seconds: -1, nanos: 0 }), None);
        assert_eq!(duration_from_pb(&prost_types::Duration { seconds: 2, nanos: 5 }), Some(Duration::new(2, 5)));
    }

    /// A ttl/timeout of ~i64::MAX seconds used to be accepted, then `SystemTime::now() + ttl`
    /// (regions) / `Instant::now() + timeout` (submit) panicked. The request_validation fuzz
    /// target's deadline invariant catches it (fuzz/corpus/request_validation/seed-regress-huge-ttl).
    #[test]
    fn huge_durations_are_rejected_before_they_become_deadlines() {
        let huge = prost_types::Duration { seconds: i64::MAX, nanos: 0 };
        assert_eq!(duration_from_pb(&huge), None);
        let max = duration_to_pb(MAX_DURATION);
        let d = duration_from_pb(&max).unwrap();
        assert!(SystemTime::now().checked_add(d).is_some());
        assert!(std::time::Instant::now().checked_add(d + Duration::from_secs(60)).is_some());

        let region = pb::CreateRegionRequest { name: "r".into(), length: 1, ttl: Some(huge), ..Default::default() };
        let err = region_spec_from_pb(region).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("ttl"), "{}", err.message());
        let submit = pb::SubmitTransferRequest {
            op: pb::Op::Write as i32,
            local: Some(pb::LocalRange { region: "a".into(), offset: 0 }),
            remote: Some(pb::RemoteRange { agent: "h:1".into(), region: "b".into(), offset: 0 }),
            options: Some(pb::TransferOptions { timeout: Some(huge), ..Default::default() }),
            ..Default::default()
        };
        assert!(transfer_request_from_pb(submit).unwrap_err().message().contains("timeout"));
        let grant = pb::GrantRequest {
            region: "b".into(),
            node_name: "n".into(),
            op: pb::Access::Write as i32,
            ttl: Some(huge),
            ..Default::default()
        };
        assert!(grant_params_from_pb(grant).is_err());
    }

    #[test]
    fn error_codes_follow_the_design() {
        use tonic::Code;
        assert_eq!(region_status(RegionError::NotFound("x".into())).code(), Code::NotFound);
        assert_eq!(region_status(RegionError::Invalid("x".into())).code(), Code::InvalidArgument);
        assert_eq!(region_status(RegionError::Poisoned { name: "r".into() }).code(), Code::FailedPrecondition);
        assert_eq!(region_status(RegionError::Limit("x".into())).code(), Code::ResourceExhausted);
        assert_eq!(region_status(RegionError::Denied("x".into())).code(), Code::PermissionDenied);
        assert_eq!(region_status(RegionError::NotRegular { path: "p".into(), kind: "FIFO" }).code(), Code::InvalidArgument);
        assert_eq!(region_status(RegionError::ShmExists { object: "o".into() }).code(), Code::AlreadyExists);
        let unavailable = region_status(RegionError::Unavailable { name: "r".into(), reason: "file missing".into() });
        assert_eq!(unavailable.code(), Code::FailedPrecondition);
        assert!(unavailable.message().contains("file missing"), "{}", unavailable.message());
        assert_eq!(grant_status(GrantError::Expired("g".into())).code(), Code::FailedPrecondition);
        assert_eq!(peer_status(PeerError::Unreachable { addr: "a".into(), detail: "refused".into() }).code(), Code::Unavailable);
        assert_eq!(transfer_status(TransferError::PermissionDenied("ro".into())).code(), Code::PermissionDenied);
    }
}
