//! Transfers on the wire: `SubmitTransfer` into a [`TransferRequest`], a channel's messages both
//! ways, a transfer record into `pb::Transfer`, and the notifications of inbound transfers
//! (`WatchInbound`, `WatchInboundRing`).
use tonic::Status;
use xfer_proto::v1 as pb;

use super::peers::peer_address;
use super::scalars::{algo_from_pb, op_from_pb, op_to_pb, request_duration, time_to_pb};
use super::status::{invalid, require};
use crate::node::{ChannelInfo, ChannelInput, ChannelOutput, ChannelParams, InboundRing};
use crate::notify::Notification;
use crate::transfer::{TransferOptions, TransferRecord, TransferRequest, TransferState};
use xfer_engine::batch::SegmentSpec;
use xfer_fabric::RemoteOp;

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
        paths: t.paths,
        failovers: t.failovers,
        fallback: t.fallback,
    }
}

/// `Agent.ListTransfers`' answer.
pub fn transfer_list_to_pb(transfers: &[TransferRecord]) -> pb::ListTransfersResponse {
    pb::ListTransfersResponse { transfers: transfers.iter().map(transfer_to_pb).collect() }
}

/// `Agent.SubmitTransfer`: required fields, enums and the timeout.
pub fn transfer_request_from_pb(r: pb::SubmitTransferRequest) -> Result<TransferRequest, Status> {
    let local = r.local.ok_or_else(|| invalid("local range is required"))?;
    let remote = r.remote.ok_or_else(|| invalid("remote range is required"))?;
    require(!local.region.is_empty(), "local region is required")?;
    require(!remote.region.is_empty(), "remote region is required")?;
    require(!remote.agent.is_empty(), "remote agent address is required")?;
    peer_address(&remote.agent)?;
    let options = options_from_pb(r.options.unwrap_or_default())?;
    // Absent is "the rest of the source range"; a 0 the caller wrote is a mistake, never
    // "everything" (a script's empty variable must not copy a whole region).
    if r.length == Some(0) {
        return Err(invalid("length 0: a zero-length transfer moves nothing; leave length unset to move the rest of the source range"));
    }
    Ok(TransferRequest {
        op: op_from_pb(r.op)?,
        local_region: local.region,
        local_offset: local.offset,
        remote_agent: remote.agent,
        remote_region: remote.region,
        remote_offset: remote.offset,
        length: r.length.unwrap_or(0),
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

fn segments_from_pb(v: &[pb::Segment]) -> Vec<SegmentSpec> {
    v.iter().map(|s| SegmentSpec { local: s.local_offset, remote: s.remote_offset, len: s.length }).collect()
}

/// The first message of `Agent.OpenChannel`'s stream (`None`: the stream ended before one),
/// which must be a `ChannelOpen`.
pub fn channel_open_from_pb(first: Option<pb::ChannelRequest>) -> Result<ChannelParams, Status> {
    match first {
        Some(pb::ChannelRequest { msg: Some(pb::channel_request::Msg::Open(o)) }) => channel_params_from_pb(o),
        Some(_) => Err(invalid("the first channel message must be ChannelOpen")),
        None => Err(invalid("the channel stream ended before ChannelOpen")),
    }
}

/// `ChannelOpen`: the channel's range and options.
pub fn channel_params_from_pb(o: pb::ChannelOpen) -> Result<ChannelParams, Status> {
    let remote = o.remote.ok_or_else(|| invalid("remote range is required"))?;
    require(!o.local_region.is_empty(), "local region is required")?;
    require(!remote.region.is_empty(), "remote region is required")?;
    require(!remote.agent.is_empty(), "remote agent address is required")?;
    peer_address(&remote.agent)?;
    Ok(ChannelParams {
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
/// becomes [`ChannelInput::TooMany`], answered in its turn.
pub fn channel_input_from_pb(r: pb::ChannelRequest, max_segments: usize) -> Result<ChannelInput, Status> {
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
        Some(pb::channel_request::Msg::Open(_)) => Err(invalid("the channel is open already: ChannelOpen comes once, first")),
        None => Err(invalid("empty channel message")),
    }
}

pub fn channel_opened_to_pb(i: &ChannelInfo) -> pb::ChannelEvent {
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

pub fn channel_output_to_pb(o: ChannelOutput) -> pb::ChannelEvent {
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

/// A `WatchInboundRing` subscription's one message: where its ring is.
pub fn inbound_ring_to_pb(r: &InboundRing) -> pb::InboundRing {
    pb::InboundRing { object: r.object.clone(), length: r.length, slots: r.slots, slot_size: r.slot_size }
}

/// A notification for a `WatchInbound` subscriber.
pub fn notification_to_pb(n: &Notification) -> pb::Notification {
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
