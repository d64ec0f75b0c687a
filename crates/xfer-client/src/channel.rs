//! Channels (`Agent.OpenChannel`): one connection and one grant held by the agent, batches
//! posted on a stream. [`Channel::post`] sends a batch and waits for its answer;
//! [`Channel::send`] and [`Channel::done`] let a caller keep several in the queue (the agent
//! runs them in order). A refused batch is an [`Error::Batch`] and the channel goes on; a
//! batch that failed on the fabric is an [`Error::Batch`] too, and the next call returns the
//! status that ended the channel.
use std::collections::VecDeque;
use std::time::Duration;

use tokio::sync::mpsc;
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;

use crate::{duration_to_pb, Error, Op, Options, Result, Segment};

/// What to open a channel over.
#[derive(Clone, Debug)]
pub struct ChannelSpec {
    pub op: Op,
    pub local_region: String,
    /// The peer agent's gRPC address.
    pub peer: String,
    pub remote_region: String,
    /// The remote range every batch stays inside; length 0 = to the end of the region.
    pub remote_offset: u64,
    pub length: u64,
    /// qps, depth, chunk size; `timeout` is per batch.
    pub options: Options,
    /// How long the grant lives (None: the target's default).
    pub ttl: Option<Duration>,
    /// Batches may carry notification tags.
    pub notify: bool,
}

impl ChannelSpec {
    /// WRITEs from local region `local` into region `remote` of the agent at `peer` (the whole
    /// region, with notifications).
    pub fn write(local: &str, peer: &str, remote: &str) -> ChannelSpec {
        ChannelSpec::new(Op::Write, local, peer, remote)
    }

    /// READs from region `remote` of the agent at `peer` into local region `local`.
    pub fn read(local: &str, peer: &str, remote: &str) -> ChannelSpec {
        ChannelSpec::new(Op::Read, local, peer, remote)
    }

    fn new(op: Op, local: &str, peer: &str, remote: &str) -> ChannelSpec {
        ChannelSpec {
            op,
            local_region: local.into(),
            peer: peer.into(),
            remote_region: remote.into(),
            remote_offset: 0,
            length: 0,
            options: Options::default(),
            ttl: None,
            notify: true,
        }
    }

    /// Only `[offset, offset + length)` of the remote region.
    pub fn range(mut self, offset: u64, length: u64) -> ChannelSpec {
        (self.remote_offset, self.length) = (offset, length);
        self
    }

    pub fn options(mut self, options: Options) -> ChannelSpec {
        self.options = options;
        self
    }
}

/// How a batch ended (successfully: failures are [`Error::Batch`]).
#[derive(Clone, Debug)]
pub struct BatchDone {
    pub seq: u64,
    pub bytes: u64,
    /// After coalescing.
    pub segments: u64,
    pub seconds: f64,
    /// The agent's time from the post to its first work request, per segment.
    pub prep_ns_per_segment: f64,
}

/// A prepared list ([`Channel::prepare`]).
#[derive(Clone, Copy, Debug)]
pub struct Prepared {
    pub list: u32,
    pub segments: u64,
    pub bytes: u64,
}

/// An open channel. Dropping it cancels the batch in flight and gives the grant back;
/// [`Channel::close`] lets the posted batches finish first.
pub struct Channel {
    tx: Option<mpsc::Sender<pb::ChannelRequest>>,
    events: tonic::Streaming<pb::ChannelEvent>,
    opened: pb::ChannelOpened,
    next_seq: u64,
    /// Batches sent whose answers have not been read off the stream yet.
    unanswered: usize,
    /// Answers read off the stream ahead of [`Channel::done`] (by `prepare`), oldest first.
    early: VecDeque<pb::BatchDone>,
}

impl Channel {
    pub(crate) async fn open(mut agent: AgentClient<tonic::transport::Channel>, spec: ChannelSpec) -> Result<Channel> {
        let (tx, rx) = mpsc::channel(16);
        let open = pb::ChannelOpen {
            op: spec.op.to_pb(),
            local_region: spec.local_region,
            remote: Some(pb::RemoteRange { agent: spec.peer, region: spec.remote_region, offset: spec.remote_offset }),
            length: spec.length,
            options: Some(spec.options.to_pb()),
            ttl: spec.ttl.map(duration_to_pb),
            notify: spec.notify,
        };
        // The receiver is alive (`rx` is right here): the send cannot fail.
        let _ = tx.send(pb::ChannelRequest { msg: Some(pb::channel_request::Msg::Open(open)) }).await;
        let mut events = agent.open_channel(tokio_stream::wrappers::ReceiverStream::new(rx)).await?.into_inner();
        match events.message().await? {
            Some(pb::ChannelEvent { ev: Some(pb::channel_event::Ev::Opened(opened)) }) => {
                Ok(Channel { tx: Some(tx), events, opened, next_seq: 0, unanswered: 0, early: VecDeque::new() })
            }
            other => Err(Error::Protocol(format!("expected ChannelOpened, got {other:?}"))),
        }
    }

    /// The channel's id on the agent.
    pub fn id(&self) -> &str {
        &self.opened.channel_id
    }

    /// The granted remote range (offset, length).
    pub fn range(&self) -> (u64, u64) {
        (self.opened.remote_offset, self.opened.remote_length)
    }

    /// QPs (or tcp data streams) the channel's batches spread over.
    pub fn qps(&self) -> u32 {
        self.opened.qps
    }

    async fn send_msg(&self, msg: pb::channel_request::Msg) -> Result<()> {
        let tx = self.tx.as_ref().ok_or_else(|| Error::Protocol("the channel is closed".into()))?;
        tx.send(pb::ChannelRequest { msg: Some(msg) }).await.map_err(|_| Error::Unavailable("the channel's stream ended".into()))
    }

    async fn event(&mut self) -> Result<pb::channel_event::Ev> {
        match self.events.message().await? {
            Some(pb::ChannelEvent { ev: Some(ev) }) => Ok(ev),
            Some(_) => Err(Error::Protocol("an empty channel event".into())),
            None => Err(Error::Unavailable("the channel ended".into())),
        }
    }

    /// Checks and coalesces `segments` once and keeps them under `list` (1..=64) for
    /// [`Channel::post_list`].
    ///
    /// Batches already sent and not yet read with [`Channel::done`] keep their answers: the agent
    /// answers in request order, so theirs come first and are kept for `done`.
    pub async fn prepare(&mut self, list: u32, segments: &[Segment]) -> Result<Prepared> {
        let segments = segments.iter().map(|s| s.to_pb()).collect();
        self.send_msg(pb::channel_request::Msg::Prepare(pb::ChannelPrepare { list, segments })).await?;
        while self.unanswered > 0 {
            match self.event().await? {
                pb::channel_event::Ev::Done(d) => {
                    self.unanswered -= 1;
                    self.early.push_back(d);
                }
                other => return Err(Error::Protocol(format!("expected the BatchDone of a batch sent earlier, got {other:?}"))),
            }
        }
        match self.event().await? {
            pb::channel_event::Ev::Prepared(p) if p.list == list => Ok(Prepared { list: p.list, segments: p.segments, bytes: p.bytes }),
            pb::channel_event::Ev::Done(d) if d.list == list => Err(batch_error(d)),
            other => Err(Error::Protocol(format!("expected ChannelPrepared, got {other:?}"))),
        }
    }

    /// Sends a batch without waiting for it; its answer comes from [`Channel::done`], in order.
    /// Returns its sequence number.
    pub async fn send(&mut self, segments: &[Segment], list: u32, notify: Option<&[u8]>) -> Result<u64> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let post =
            pb::ChannelPost { seq, segments: segments.iter().map(|s| s.to_pb()).collect(), list, notify: notify.map(<[u8]>::to_vec) };
        self.send_msg(pb::channel_request::Msg::Post(post)).await?;
        self.unanswered += 1;
        Ok(seq)
    }

    /// The answer to the oldest batch sent and not yet answered.
    pub async fn done(&mut self) -> Result<BatchDone> {
        let ev = match self.early.pop_front() {
            Some(d) => pb::channel_event::Ev::Done(d),
            None => {
                let ev = self.event().await?;
                self.unanswered = self.unanswered.saturating_sub(1);
                ev
            }
        };
        match ev {
            pb::channel_event::Ev::Done(d) if d.state == pb::TransferState::Succeeded as i32 => Ok(BatchDone {
                seq: d.seq,
                bytes: d.bytes,
                segments: d.segments,
                seconds: d.seconds,
                prep_ns_per_segment: d.prep_ns_per_segment,
            }),
            pb::channel_event::Ev::Done(d) => Err(batch_error(d)),
            other => Err(Error::Protocol(format!("expected BatchDone, got {other:?}"))),
        }
    }

    /// Moves `segments` (absolute offsets; remote ones inside the channel's range) and waits.
    pub async fn post(&mut self, segments: &[Segment], notify: Option<&[u8]>) -> Result<BatchDone> {
        self.send(segments, 0, notify).await?;
        self.done().await
    }

    /// Moves a prepared list again and waits.
    pub async fn post_list(&mut self, list: u32, notify: Option<&[u8]>) -> Result<BatchDone> {
        self.send(&[], list, notify).await?;
        self.done().await
    }

    /// Closes the channel once the batches sent have run; their answers not yet read are
    /// dropped. `Ok` if it ended cleanly, else the status that ended it.
    pub async fn close(mut self) -> Result<()> {
        self.tx.take();
        loop {
            match self.events.message().await? {
                Some(_) => continue,
                None => return Ok(()),
            }
        }
    }
}

fn batch_error(d: pb::BatchDone) -> Error {
    Error::Batch { seq: d.seq, code: d.error_code, message: d.error }
}
