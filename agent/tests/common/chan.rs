//! A test client's side of `Agent.OpenChannel`: opening a channel over a raw request stream,
//! posting and preparing on it, and reading its answers (each with a hang guard, not a
//! synchronisation). Shared by the channel tests and the channel red team.
use std::time::Duration;

use tokio::sync::mpsc;
use xfer_proto::v1 as pb;

use super::Agent;

pub fn seg(local: u64, remote: u64, len: u64) -> pb::Segment {
    pb::Segment { local_offset: local, remote_offset: remote, length: len }
}

/// An open channel: the request sender and the event stream.
pub struct Chan {
    pub tx: Option<mpsc::Sender<pb::ChannelRequest>>,
    pub events: tonic::Streaming<pb::ChannelEvent>,
    pub opened: pb::ChannelOpened,
}

/// A `ChannelOpen` over `[offset, offset + length)` of `remote` on `peer`, with 16 KiB chunks,
/// `qps` QPs and depth 8.
#[allow(clippy::too_many_arguments)]
pub fn open_msg_qps(
    op: pb::Op,
    local: &str,
    peer: &Agent,
    remote: &str,
    offset: u64,
    length: u64,
    notify: bool,
    qps: u32,
) -> pb::ChannelOpen {
    pb::ChannelOpen {
        op: op as i32,
        local_region: local.into(),
        remote: Some(pb::RemoteRange { agent: peer.addr(), region: remote.into(), offset }),
        length,
        options: Some(pb::TransferOptions { chunk_size: 16 << 10, qps, depth: 8, ..Default::default() }),
        ttl: None,
        notify,
    }
}

pub fn msg(m: pb::channel_request::Msg) -> pb::ChannelRequest {
    pb::ChannelRequest { msg: Some(m) }
}

pub fn post_msg(seq: u64, segments: Vec<pb::Segment>, list: u32, notify: Option<&[u8]>) -> pb::ChannelRequest {
    msg(pb::channel_request::Msg::Post(pb::ChannelPost { seq, segments, list, notify: notify.map(<[u8]>::to_vec) }))
}

/// Opens a channel; the first message is `open`.
pub async fn try_open(a: &Agent, open: pb::ChannelOpen) -> Result<Chan, tonic::Status> {
    try_open_depth(a, open, 16).await
}

/// Opens a channel whose request queue (in this test) holds `depth` messages.
pub async fn try_open_depth(a: &Agent, open: pb::ChannelOpen, depth: usize) -> Result<Chan, tonic::Status> {
    try_open_with(&mut a.client().await, open, depth).await
}

/// Opens a channel through `client` (e.g. an mTLS client of one identity).
pub async fn try_open_with(
    client: &mut xfer_proto::v1::agent_client::AgentClient<tonic::transport::Channel>,
    open: pb::ChannelOpen,
    depth: usize,
) -> Result<Chan, tonic::Status> {
    let (tx, rx) = mpsc::channel(depth);
    tx.send(msg(pb::channel_request::Msg::Open(open))).await.unwrap();
    let mut events = client.open_channel(tokio_stream::wrappers::ReceiverStream::new(rx)).await?.into_inner();
    match next_event(&mut events).await? {
        Some(pb::ChannelEvent { ev: Some(pb::channel_event::Ev::Opened(o)) }) => Ok(Chan { tx: Some(tx), events, opened: o }),
        other => panic!("expected ChannelOpened, got {other:?}"),
    }
}

pub async fn next_event(s: &mut tonic::Streaming<pb::ChannelEvent>) -> Result<Option<pb::ChannelEvent>, tonic::Status> {
    // A hang guard, not a synchronisation.
    tokio::time::timeout(Duration::from_secs(60), s.message()).await.expect("a channel event within 60 s")
}

impl Chan {
    pub async fn send(&self, m: pb::ChannelRequest) {
        self.tx.as_ref().unwrap().send(m).await.unwrap();
    }

    pub async fn post(&mut self, seq: u64, segments: Vec<pb::Segment>, list: u32, notify: Option<&[u8]>) -> pb::BatchDone {
        self.send(post_msg(seq, segments, list, notify)).await;
        self.done().await
    }

    pub async fn done(&mut self) -> pb::BatchDone {
        match next_event(&mut self.events).await {
            Ok(Some(pb::ChannelEvent { ev: Some(pb::channel_event::Ev::Done(d)) })) => d,
            other => panic!("expected BatchDone, got {other:?}"),
        }
    }

    pub async fn prepare(&mut self, list: u32, segments: Vec<pb::Segment>) -> pb::channel_event::Ev {
        self.send(msg(pb::channel_request::Msg::Prepare(pb::ChannelPrepare { list, segments }))).await;
        next_event(&mut self.events).await.unwrap().unwrap().ev.unwrap()
    }

    /// The status the stream ends with.
    pub async fn end(&mut self) -> tonic::Status {
        match next_event(&mut self.events).await {
            Err(s) => s,
            other => panic!("expected the stream to end with a status, got {other:?}"),
        }
    }

    /// Half-closes; the stream must then end cleanly.
    pub async fn close(mut self) {
        self.tx.take();
        assert!(next_event(&mut self.events).await.unwrap().is_none(), "the stream ends OK after a clean close");
    }
}

pub fn ok(d: &pb::BatchDone) {
    assert_eq!(d.state, pb::TransferState::Succeeded as i32, "{d:?}");
}
