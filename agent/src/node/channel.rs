//! Channels (`Agent.OpenChannel`): set up once — a connection to the peer and one grant over a
//! remote range, both held for the channel's life — then post batches on it with no grant round
//! trip and no gRPC call per segment. Segment lists may be prepared once (checked and coalesced)
//! and posted again at no per-segment cost.
//!
//! A channel runs its batches one after another, each through the transfer [`Machine`] on the
//! held connection (its WRs spread over the connection's QPs, doorbells batched), placed over
//! the connection's paths as a transfer is ([`super::paths::PathBook::plan`]). A bad batch
//! (segments outside the channel's range, a bad list, a tag too long) is answered before any
//! byte moves and the channel goes on; a batch that fails on the fabric ends the channel (the
//! connection is in error, and the grant is revoked). The grant stays scoped: its range, its
//! operation and its expiry hold for every batch, and the target can revoke it at any time
//! (then the next WR fails with a remote access error and the channel ends).
//!
//! Notifications: a channel opened with `notify` holds a *channel* grant (`NotifyAsk::Channel`).
//! Each notified batch gets the next number of the channel's notification sequence; its
//! markers carry that number in their immediate ([`xfer_engine::notes::channel_imm`]) and its tag
//! goes to the target in a `Peer.Announce` sent while the data is in flight. The target
//! publishes once both arrived (`xfer_engine::notes::ChannelNotes`), so the guarantee is the one a single
//! transfer's notification gives: every byte of the batch is visible when it is published.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;

use super::held::Held;
use super::limits::ChannelSlot;
use super::Node;
use crate::checksum::Algo;
use crate::error::NodeError;
use crate::metrics as m;
use crate::peer_api::{GrantAsk, GrantInfo};
use crate::regions::RegionUse;
use crate::transfer::job::{Job, WrTemplate};
use crate::transfer::session::{failure_of, Session, SessionConfig};
use crate::transfer::Op;
use xfer_engine::batch::{Batch, BatchError, Dest, Seg, SegmentSpec};
use xfer_engine::failure::{Failure, FailureCode};
use xfer_engine::machine::{Machine, MachineConfig, Markers, State};
use xfer_engine::shape;
use xfer_fabric::{RemoteOp, WrOp};

/// Prepared lists one channel keeps at most.
pub const MAX_LISTS: usize = 64;
/// Prepared segments one channel keeps at most, over all its lists (24 bytes each), as a
/// multiple of `transfer.max_segments`.
pub const MAX_PREPARED_FACTOR: usize = 4;

/// What `Agent.OpenChannel`'s first message asks for, in domain terms.
#[derive(Debug, Clone)]
pub struct ChannelParams {
    pub op: Op,
    pub local_region: String,
    pub remote_agent: String,
    pub remote_region: String,
    /// The remote range every batch stays inside (absolute in the remote region); length 0 =
    /// to its end.
    pub remote_offset: u64,
    pub length: u64,
    pub options: crate::transfer::TransferOptions,
    pub ttl: Option<Duration>,
    pub notify: bool,
}

/// What a channel was given.
#[derive(Debug, Clone)]
pub struct ChannelInfo {
    pub id: String,
    pub peer: String,
    pub remote_offset: u64,
    pub remote_length: u64,
    pub qps: usize,
    pub expires_at: Option<SystemTime>,
}

/// One message on an open channel.
#[derive(Debug, Clone)]
pub enum ChannelInput {
    Prepare {
        list: u32,
        segments: Vec<SegmentSpec>,
    },
    Post {
        seq: u64,
        segments: Vec<SegmentSpec>,
        list: u32,
        notify: Option<Vec<u8>>,
    },
    /// A prepare (`list: Some`) or a post (`seq`) whose list had `n` segments, more than
    /// `transfer.max_segments`: refused in its turn, its list dropped as it arrived (see
    /// [`Channel::max_segments`]).
    TooMany {
        seq: u64,
        list: Option<u32>,
        n: usize,
    },
}

/// One answer.
#[derive(Debug, Clone)]
pub enum ChannelOutput {
    Prepared { list: u32, segments: u64, bytes: u64 },
    Done(BatchOutcome),
}

/// How one batch ended.
#[derive(Debug, Clone, Default)]
pub struct BatchOutcome {
    pub seq: u64,
    pub ok: bool,
    pub bytes: u64,
    pub segments: u64,
    /// (code, message) when it failed: `INVALID_ARGUMENT`, `RESOURCE_EXHAUSTED`, `NOT_FOUND` for a
    /// batch refused before any byte moved, else a [`FailureCode`].
    pub error: Option<(String, String)>,
    pub seconds: f64,
    pub prep_ns_per_segment: f64,
    /// Set when this refuses a prepare: the list it named (`seq` then means nothing).
    pub list: Option<u32>,
}

impl BatchOutcome {
    fn refused(seq: u64, code: &str, msg: impl Into<String>) -> BatchOutcome {
        BatchOutcome { seq, error: Some((code.to_string(), msg.into())), ..Default::default() }
    }

    /// A refused prepare of `list`.
    fn refused_list(list: u32, code: &str, msg: impl Into<String>) -> BatchOutcome {
        BatchOutcome { list: Some(list), ..BatchOutcome::refused(0, code, msg) }
    }
}

/// An open channel: owns its connection, its grant and its place under the transfer limits.
pub struct Channel {
    node: Arc<Node>,
    info: ChannelInfo,
    op: Op,
    held: Held,
    grant: GrantInfo,
    /// Keeps the local region in use (DeleteRegion refuses it as busy).
    local: RegionUse,
    chunk: u64,
    /// The depth the connection was leased for; each batch runs at most this deep.
    depth: usize,
    /// Whether the depth was asked for (else each batch's is the default for its WR length).
    asked_depth: bool,
    timeout: Duration,
    notify: bool,
    /// The next number of the channel's notification sequence.
    next_note: u64,
    lists: HashMap<u32, Batch>,
    prepared: usize,
    _slot: ChannelSlot,
}

impl Drop for Channel {
    fn drop(&mut self) {
        m::channels_open(-1.0);
    }
}

impl Node {
    /// Opens a channel: checks the ask, leases a connection and asks the peer's grant over the
    /// channel's range (one round trip), as a transfer does before its first byte.
    pub async fn open_channel(self: &Arc<Self>, p: ChannelParams) -> Result<Channel, NodeError> {
        self.open_channel_as(p, &crate::tenants::Tenant::exempt()).await
    }

    /// `OpenChannel` on behalf of `owner`: the channel counts as a transfer against its share of
    /// `limits.max_transfers` for its whole life.
    pub async fn open_channel_as(self: &Arc<Self>, p: ChannelParams, owner: &crate::tenants::Tenant) -> Result<Channel, NodeError> {
        if self.draining.is_cancelled() {
            return Err(NodeError::ShuttingDown);
        }
        if p.options.verify {
            return Err(NodeError::Invalid(
                "verify checks one contiguous range; on a channel, compare ranges with Agent.Checksum on both agents".into(),
            ));
        }
        let local = self.local_use(&p.local_region, owner)?;
        if p.op == Op::Read && !local.0.memory.writable() {
            return Err(NodeError::PermissionDenied(format!(
                "local region {:?} is mapped read-only and cannot receive a READ",
                local.0.name
            )));
        }
        let t = &self.config.transfer;
        let chunk = self.wr_chunk(p.op == Op::Read, shape::chunk(p.options.chunk_size.unwrap_or(t.chunk_size.0))?);
        let qps = shape::qps(p.options.qps.unwrap_or(t.qps))?;
        // A batch's segment sizes are known only when it is posted: the connection is leased for
        // the deepest default any WR length gets (on tcp; the configured depth on verbs), and each
        // batch runs at the default for its own WR length within it.
        let depth = match p.options.depth {
            Some(d) => shape::depth(d)?,
            None => self.depth_for(None, 1)?,
        };
        let timeout = p.options.timeout.filter(|t| !t.is_zero()).unwrap_or(t.timeout.0);
        let peer = self.initiator.peers.peer(&p.remote_agent).await?;
        let slot = self.channel_slot(&peer.key, owner)?;
        let remote_op = match p.op {
            Op::Write => RemoteOp::Write,
            Op::Read => RemoteOp::Read,
        };
        let ttl = p.ttl.filter(|t| !t.is_zero()).unwrap_or(self.config.grants.default_ttl.0);
        let ask = GrantAsk {
            region: &p.remote_region,
            offset: p.remote_offset,
            length: p.length,
            op: remote_op,
            ttl,
            notify: p.notify.then_some((&[][..], 0)),
            channel: true,
        };
        // The acquire phase of a transfer session (lease, grant, a fresh connection when the
        // pooled one is stale); nothing of its data phase runs.
        let mut session = Session::new(SessionConfig {
            length: p.length,
            batch: None,
            markers: Markers::None,
            local_name: local.0.name.clone(),
            // Batches are checked against the local region one by one.
            local_length: u64::MAX,
            local_offset: 0,
            chunk,
            depth,
            signal_every: t.signal_every,
            verify: false,
            timeout,
            // A channel moves its batches itself; only the acquire phase runs here.
            resumes: 0,
        });
        let mut held = Held::new(peer.clone(), owner.clone(), self.initiator.pending_revokes.clone());
        let granted = self.acquire(&mut session, &mut held, &ask, qps, depth).await?;
        let (grant, qps) = match (held.grant.as_ref(), held.lease.as_ref()) {
            (Some(g), Some(l)) => (g.info.clone(), l.qps()),
            _ => return Err(NodeError::Internal("channel accepted without a connection and a grant".into())),
        };
        if p.notify && grant.notify_slot & xfer_engine::notes::CHANNEL_BIT == 0 {
            return Err(NodeError::FailedPrecondition(format!(
                "peer {} does not support channel notifications (its grant carries no channel slot)",
                peer.addr
            )));
        }
        m::channels_open(1.0);
        let info = ChannelInfo {
            id: xfer_engine::ids::TransferId::random().to_string(),
            peer: peer.node_name(),
            remote_offset: p.remote_offset,
            remote_length: granted,
            qps,
            expires_at: grant.expires_at,
        };
        Ok(Channel {
            node: Arc::clone(self),
            info,
            op: p.op,
            held,
            grant,
            local,
            chunk,
            depth,
            asked_depth: p.options.depth.is_some(),
            timeout,
            notify: p.notify,
            next_note: 0,
            lists: HashMap::new(),
            prepared: 0,
            _slot: slot,
        })
    }
}

/// Why a channel ended before its caller closed it.
#[derive(Debug)]
pub enum ChannelEnd {
    /// The caller closed it (or went away): clean.
    Closed,
    /// A batch failed on the fabric, the grant expired or the agent is shutting down.
    Failed(NodeError),
}

impl Channel {
    pub fn info(&self) -> &ChannelInfo {
        &self.info
    }

    /// Segments one list may have (`transfer.max_segments`). Whoever queues inputs for
    /// [`Channel::run`] sends a longer list as [`ChannelInput::TooMany`] instead of keeping it:
    /// a caller that posts faster than batches run holds requests in the queue, and a list
    /// decoded from one gRPC message can be millions of segments.
    pub fn max_segments(&self) -> usize {
        self.node.config.transfer.max_segments
    }

    /// Serves the channel: every input gets one output on `out`, in order, until the inputs end
    /// (the caller half-closed: clean) or `cancel` fires (the caller went away), or a batch
    /// ends the channel. Gives the connection back (to the pool when clean) and revokes the
    /// grant in every case.
    pub async fn run(
        mut self,
        mut inputs: tokio::sync::mpsc::Receiver<ChannelInput>,
        out: tokio::sync::mpsc::Sender<ChannelOutput>,
        cancel: CancellationToken,
    ) -> ChannelEnd {
        // An idle channel ends when its grant does, rather than hold its slot until a post.
        let expiry = self.info.expires_at.map(|e| e.duration_since(SystemTime::now()).unwrap_or_default());
        let expired = async move {
            match expiry {
                Some(d) => tokio::time::sleep(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(expired);
        let end = loop {
            let input = tokio::select! {
                i = inputs.recv() => i,
                _ = cancel.cancelled() => break ChannelEnd::Closed,
                _ = self.node.draining.cancelled() => break ChannelEnd::Failed(NodeError::ShuttingDown),
                _ = &mut expired => break ChannelEnd::Failed(NodeError::FailedPrecondition(
                    "the channel's grant expired; open a new channel".into(),
                )),
            };
            let Some(input) = input else { break ChannelEnd::Closed };
            let (output, fatal) = match input {
                ChannelInput::Prepare { list, segments } => (self.prepare(list, &segments), None),
                ChannelInput::Post { seq, segments, list, notify } => {
                    let (done, fatal) = self.post(seq, &segments, list, notify, &cancel).await;
                    (ChannelOutput::Done(done), fatal)
                }
                ChannelInput::TooMany { seq, list, n } => (self.too_many(seq, list, n), None),
            };
            if out.send(output).await.is_err() {
                break ChannelEnd::Closed;
            }
            if let Some(e) = fatal {
                break ChannelEnd::Failed(e);
            }
        };
        let clean = matches!(end, ChannelEnd::Closed) && self.held.lease.as_ref().is_some_and(|l| !l.conn().is_broken());
        if let Some(l) = self.held.lease.take() {
            l.release(clean);
        }
        // Dropping `held` revokes the grant in the background.
        end
    }

    fn check(&self, segments: &[SegmentSpec], max: usize) -> Result<Batch, BatchError> {
        let dest = if self.op == Op::Write { Dest::Remote } else { Dest::Local };
        let b = Batch::new(segments, &self.local.0.name, self.local.0.length, dest, max)?;
        b.check_grant(self.info.remote_offset, self.info.remote_length)?;
        Ok(b)
    }

    fn prepare(&mut self, list: u32, segments: &[SegmentSpec]) -> ChannelOutput {
        let refuse = |code: &str, msg: String| ChannelOutput::Done(BatchOutcome::refused_list(list, code, format!("list {list}: {msg}")));
        if list == 0 {
            return refuse("INVALID_ARGUMENT", "lists are numbered from 1".into());
        }
        let max = self.node.config.transfer.max_segments;
        let old = self.lists.get(&list).map_or(0, |b| b.len());
        if !self.lists.contains_key(&list) && self.lists.len() >= MAX_LISTS {
            return refuse("RESOURCE_EXHAUSTED", format!("a channel keeps at most {MAX_LISTS} lists"));
        }
        let b = match self.check(segments, max) {
            Ok(b) => b,
            Err(e) => return refuse(batch_code(&e), e.to_string()),
        };
        let budget = max.saturating_mul(MAX_PREPARED_FACTOR);
        if self.prepared - old + b.len() > budget {
            return refuse("RESOURCE_EXHAUSTED", format!("a channel keeps at most {budget} prepared segments"));
        }
        self.prepared = self.prepared - old + b.len();
        let out = ChannelOutput::Prepared { list, segments: b.len() as u64, bytes: b.bytes() };
        self.lists.insert(list, b);
        out
    }

    /// The answer to a list over `transfer.max_segments` (what `prepare` or `post` would say).
    fn too_many(&self, seq: u64, list: Option<u32>, n: usize) -> ChannelOutput {
        let e = BatchError::TooMany { n, max: self.max_segments() };
        let code = batch_code(&e);
        match list {
            Some(list) => ChannelOutput::Done(BatchOutcome::refused_list(list, code, format!("list {list}: {e}"))),
            None => {
                m::channel_batch(self.op.as_str(), "refused");
                ChannelOutput::Done(BatchOutcome::refused(seq, code, e.to_string()))
            }
        }
    }

    /// Runs one batch. Returns its outcome, and the error that ends the channel, if any.
    async fn post(
        &mut self,
        seq: u64,
        segments: &[SegmentSpec],
        list: u32,
        notify: Option<Vec<u8>>,
        cancel: &CancellationToken,
    ) -> (BatchOutcome, Option<NodeError>) {
        let t0 = Instant::now();
        let op = self.op.as_str();
        let refused = |code: &str, msg: String| {
            m::channel_batch(op, "refused");
            (BatchOutcome::refused(seq, code, msg), None)
        };
        if let Some(tag) = &notify {
            if !self.notify {
                return refused("INVALID_ARGUMENT", "a notification needs a channel opened with notify".into());
            }
            if let Err(e) = self.node.check_notify_tag(tag) {
                return refused("INVALID_ARGUMENT", e.to_string());
            }
        }
        let fresh;
        let batch = match (list, segments.is_empty()) {
            (0, _) => match self.check(segments, self.node.config.transfer.max_segments) {
                Ok(b) => {
                    fresh = b;
                    &fresh
                }
                Err(e) => return refused(batch_code(&e), e.to_string()),
            },
            (n, true) => match self.lists.get(&n) {
                Some(b) => b,
                None => return refused("NOT_FOUND", format!("no prepared list {n} on this channel")),
            },
            (_, false) => return refused("INVALID_ARGUMENT", "a post names a prepared list or carries segments, not both".into()),
        };
        // An expired grant's keys are dead (or about to be): end the channel with a clear word
        // instead of a remote access error.
        if self.info.expires_at.is_some_and(|e| SystemTime::now() >= e) {
            m::channel_batch(op, "refused");
            let e = NodeError::FailedPrecondition("the channel's grant expired; open a new channel".into());
            return (BatchOutcome::refused(seq, "FAILED_PRECONDITION", e.to_string()), Some(e));
        }
        let (segs, shift, bytes, count) =
            (batch.segs().clone(), batch.remote_base() - self.info.remote_offset, batch.bytes(), batch.len() as u64);
        m::batch_submitted(op, batch.asked(), batch.len());
        let Some(lease) = self.held.lease.take() else {
            let e = NodeError::Internal("channel without its connection".into());
            return (BatchOutcome::refused(seq, "INTERNAL", e.to_string()), Some(e));
        };
        let markers = match (&notify, self.op) {
            (None, _) => Markers::None,
            (Some(_), Op::Write) => Markers::Pipelined,
            (Some(_), Op::Read) => Markers::AfterData,
        };
        // The tag goes out now, while the data does; the target publishes when both arrived.
        let announce = notify.map(|tag| {
            let note = self.next_note;
            self.next_note += 1;
            let peer = self.held.peer.clone();
            let id = self.grant.grant_id.clone();
            let imm = xfer_engine::notes::channel_imm(self.grant.notify_slot, note);
            (imm, tokio::spawn(async move { peer.call(|| peer.client.announce(&id, note, &tag)).await }))
        });
        let peer = self.held.peer.addr.clone();
        // Placed as a transfer's data phase is: by the local region's NUMA node, the devices'
        // speeds, the paths' measured rates, health and load.
        let plan = self.node.initiator.paths.plan(&peer, lease.conn().as_ref(), self.local.0.numa, bytes);
        let settle = announce.is_some();
        // As a transfer's: a WR is at most a chunk and never crosses a segment.
        let depth = match self.asked_depth {
            true => self.depth,
            false => {
                let wr_len = (bytes / count.max(1)).clamp(1, self.chunk);
                self.node.depth_for(None, wr_len).map_or(self.depth, |d| d.min(self.depth))
            }
        };
        let machine = Machine::new(MachineConfig {
            segs: segs.clone(),
            chunk: self.chunk,
            qps: lease.qps(),
            depth,
            signal_every: self.node.config.transfer.signal_every,
            deadline: Some(xfer_common::deadline::instant_after(self.timeout)),
            markers,
            path_of: plan.path_of.clone(),
            weights: plan.weights.clone(),
        })
        .hold_markers_after_failover();
        let wr_op = if self.op == Op::Write { WrOp::Write } else { WrOp::Read };
        let (registration, addr, key) = (self.local.0.registration.clone(), self.grant.addr + shift, self.grant.key.clone());
        let imm = announce.as_ref().map_or(0, |(imm, _)| *imm);
        let wr = WrTemplate { op: wr_op, notify_slot: imm, local: registration, remote_addr: addr, remote_key: key, wrap: None };
        let ran = Instant::now();
        // A job the driver refuses drops its plan, which gives the plan's charge back.
        let done = match self.node.run_job(Job { machine, lease, wr, probe: None, cancel: cancel.clone(), progress: None }).await {
            Ok(d) => d,
            Err(e) => return (BatchOutcome::refused(seq, "INTERNAL", e.to_string()), Some(e)),
        };
        self.node.initiator.paths.learn(&peer, done.lease.conn().as_ref(), &plan, &done.machine, ran.elapsed());
        self.held.lease = Some(done.lease);
        let machine = done.machine;
        let prep = done.first_post.map_or(0.0, |t| (t - t0).as_nanos() as f64 / count.max(1) as f64);
        let mut out = BatchOutcome { seq, bytes: machine.bytes_done(), segments: count, prep_ns_per_segment: prep, ..Default::default() };
        let failure = match machine.state() {
            State::Succeeded => None,
            State::Cancelled => Some(Failure::new(FailureCode::Cancelled, "the channel was closed mid-batch")),
            State::Failed(f) => Some(failure_of(f.clone())),
            State::Running => Some(Failure::new(FailureCode::Internal, "batch stopped while running")),
        };
        // Data done (or failed): the announcement must have reached the target for the batch to
        // count as notified.
        let failure = match (failure, announce) {
            (None, Some((_, task))) => match task.await {
                Ok(Ok(())) => None,
                Ok(Err(e)) => {
                    Some(Failure::new(FailureCode::Internal, format!("the data landed but the target was not told (Peer.Announce: {e})")))
                }
                Err(e) => Some(Failure::new(FailureCode::Internal, format!("Peer.Announce task: {e}"))),
            },
            (f, _) => f,
        };
        // A batch that failed over is checked end to end (a failing device may have reported work
        // complete that did not land), and its notification, whose markers were held back, is
        // published by the target only if the bytes match.
        let failure = match failure {
            None if machine.must_verify() => self.verify_failed_over(seq, &segs, shift, settle).await.err(),
            f => f,
        };
        out.seconds = t0.elapsed().as_secs_f64();
        match failure {
            None => {
                out.ok = true;
                out.bytes = bytes;
                m::channel_batch(op, "succeeded");
                m::transfer_bytes(op, "outbound", &self.held.peer.label_identity(), bytes);
                (out, None)
            }
            Some(f) => {
                m::channel_batch(op, "failed");
                out.error = Some((f.code.as_str().to_string(), f.message.clone()));
                // A fabric failure leaves the QPs in error: the channel is over.
                let fatal = NodeError::Aborted(format!("batch {seq} failed ({}): {}; the channel is closed", f.code.as_str(), f.message));
                (out, Some(fatal))
            }
        }
    }
}

impl Channel {
    /// `Peer.VerifyBatch` of batch `seq` (`segs`, remote offsets `shift` past the grant's start):
    /// this side's checksum of the segments in order against the target's.
    async fn verify_failed_over(&self, seq: u64, segs: &[Seg], shift: u64, settle: bool) -> Result<(), Failure> {
        let algo = Algo::Xxh3;
        let mem = self.local.0.memory.clone();
        let local: Vec<(u64, u64)> = segs.iter().map(|s| (s.local, s.len)).collect();
        let sum = tokio::task::spawn_blocking(move || crate::checksum::checksum_ranges(&mem, &local, algo))
            .await
            .map_err(|e| Failure::new(FailureCode::Internal, e.to_string()))?
            .map_err(|e| Failure::new(FailureCode::RegionPoisoned, self.local.0.mem_error(e).to_string()))?;
        let spans: Vec<(u64, u64)> = segs.iter().map(|s| (shift + s.remote, s.len)).collect();
        let (peer, id) = (&self.held.peer, &self.grant.grant_id);
        match peer.call(|| peer.client.verify_batch(id, seq, (algo, sum), spans.clone(), settle)).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(Failure::new(
                FailureCode::ChecksumMismatch,
                "a path failed over mid-batch and the destination does not match the source: the failing device reported \
                 work complete that did not land; the batch was not announced, run it again",
            )),
            Err(e) => Err(Failure::new(FailureCode::VerifyFailed, format!("could not verify the batch after a failover: {e}"))),
        }
    }
}

/// The status code a refused batch or list reports.
fn batch_code(e: &BatchError) -> &'static str {
    match e {
        BatchError::TooMany { .. } => "RESOURCE_EXHAUSTED",
        _ => "INVALID_ARGUMENT",
    }
}
