//! The initiator side, driving the sans-IO [`Session`]: `submit` validates a transfer and runs the
//! session through lease and grant (errors there are the submit's errors); `run` drives it through
//! the data, the local check, verification and `Peer.Complete` in a task. What the transfer holds
//! from its peer — the leased connection and the grant — lives in [`Held`] as RAII guards, so a
//! path that forgets them, or a dropped future, still gives them back.
use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use tracing::{info, info_span, warn, Instrument};

use super::held::Held;
use super::Node;
use crate::checksum::{self, Algo};
use crate::error::NodeError;
use crate::metrics as m;
use crate::peer_api::{CompleteParams, GrantAsk, GrantInfo};
use crate::peers::{Lease, PeerPool};
use crate::regions::RegionUse;
use crate::tenants::Tenant;
use crate::transfer::job::{Job, Progress, WrTemplate};
use crate::transfer::session::{Command, Event, Session, SessionConfig};
use crate::transfer::worker::Worker;
use crate::transfer::{Op, TransferHandle, TransferRecord, TransferRegistry, TransferRequest, TransferState};
use xfer_engine::batch::{Batch, Dest};
use xfer_engine::failure::{Failure, FailureCode};
use xfer_engine::machine::Markers;
use xfer_engine::shape;
use xfer_fabric::{RemoteOp, WrOp};

impl Node {
    // ------------------------------------------------------------------ Initiator side

    /// Validates a transfer, obtains the peer's grant and starts it. Bad input fails here with a
    /// clear error; failures after this point are reported in the transfer record.
    pub async fn submit(self: &Arc<Self>, req: TransferRequest) -> Result<TransferRecord, NodeError> {
        self.submit_as(req, &Tenant::exempt()).await
    }

    /// `SubmitTransfer` on behalf of `owner`: it counts against `owner`'s shares until it ends.
    pub async fn submit_as(self: &Arc<Self>, req: TransferRequest, owner: &Tenant) -> Result<TransferRecord, NodeError> {
        if self.draining.is_cancelled() {
            return Err(NodeError::ShuttingDown);
        }
        // In use from the lookup on (under the registry lock): a DeleteRegion meanwhile is
        // refused as busy instead of deleting a region this transfer is about to move bytes in.
        let local_use = self.local_use(&req.local_region, owner)?;
        let local = Arc::clone(&local_use.0);
        if req.local_offset > local.length {
            return Err(NodeError::Invalid(format!(
                "offset {} is beyond the end of region {:?} ({} bytes)",
                req.local_offset, local.name, local.length
            )));
        }
        if req.op == Op::Read && !local.memory.writable() {
            return Err(NodeError::PermissionDenied(format!(
                "local region {:?} is mapped read-only and cannot receive a READ",
                local.name
            )));
        }
        if let Some(tag) = &req.notify {
            self.check_notify_tag(tag)?;
        }
        // A batch: its segments are checked (naming the bad one) and coalesced before anything
        // is asked of the peer; the grant spans them.
        let batch = if req.segments.is_empty() {
            None
        } else {
            if req.local_offset != 0 || req.remote_offset != 0 || req.length != 0 {
                return Err(NodeError::Invalid(
                    "with segments, the local and remote offsets and the length come from the segments and must be 0".into(),
                ));
            }
            let dest = if req.op == Op::Write { Dest::Remote } else { Dest::Local };
            Some(Batch::new(&req.segments, &local.name, local.length, dest, self.config.transfer.max_segments)?)
        };
        let length = match (req.op, req.length) {
            (Op::Write, 0) => local.length - req.local_offset,
            (_, n) => n,
        };
        if batch.is_none() {
            if req.op == Op::Write && length == 0 {
                return Err(NodeError::Invalid("zero-length transfer: nothing to copy".into()));
            }
            if req.length != 0 || req.op == Op::Write {
                local.check_range(req.local_offset, length)?;
            }
        }
        let opts = &req.options;
        let t = &self.config.transfer;
        let chunk = self.wr_chunk(req.op == Op::Read, shape::chunk(opts.chunk_size.unwrap_or(t.chunk_size.0))?);
        let qps = shape::qps(opts.qps.unwrap_or(t.qps))?;
        // A WR is at most a chunk and never crosses a segment: a batch's WRs are as long as its
        // segments on average (a READ of the rest of the range, length 0, counts in chunks).
        let wr_len = batch.as_ref().map_or(length, |b| b.bytes() / b.len().max(1) as u64);
        let wr_len = if wr_len == 0 { chunk } else { wr_len.min(chunk) };
        let depth = self.depth_for(opts.depth, wr_len)?;
        let timeout = opts.timeout.filter(|t| !t.is_zero()).unwrap_or(t.timeout.0);
        let peer = self.initiator.peers.peer(&req.remote_agent).await?;
        let slot = self.reserve_slot(&peer.key, owner)?;
        let remote_op = match req.op {
            Op::Write => RemoteOp::Write,
            Op::Read => RemoteOp::Read,
        };
        let markers = match (&req.notify, req.op) {
            (None, _) => Markers::None,
            (Some(_), Op::Write) => Markers::Pipelined,
            (Some(_), Op::Read) => Markers::AfterData,
        };
        let (ask_offset, ask_length) = match &batch {
            Some(b) => (b.remote_base(), b.remote_span()),
            None => (req.remote_offset, length),
        };
        let segments = batch.as_ref().map_or(1, |b| b.len() as u64);
        let one_range = batch.is_none();
        let local_lo = batch.as_ref().map_or(req.local_offset, |b| b.local_lo());
        if let Some(b) = &batch {
            m::batch_submitted(req.op.as_str(), b.asked(), b.len());
        }
        let mut session = Session::new(SessionConfig {
            length,
            batch,
            markers,
            local_name: local.name.clone(),
            local_length: local.length,
            local_offset: req.local_offset,
            chunk,
            depth,
            signal_every: t.signal_every,
            verify: opts.verify,
            timeout,
            resumes: t.resume_attempts,
        });
        // Connect first: the grant is bound to this connection (grant mode mw binds its windows
        // on the connection's QPs). Connect failures are submit errors (UNAVAILABLE, ...).
        let ask = GrantAsk {
            region: &req.remote_region,
            offset: ask_offset,
            length: ask_length,
            op: remote_op,
            ttl: timeout.saturating_add(Duration::from_secs(60)),
            // The markers count is the leased connection's QPs, filled in when the grant is asked.
            notify: req.notify.as_deref().map(|t| (t, 0)),
            channel: false,
        };
        let mut held = Held::new(peer.clone(), owner.clone(), self.initiator.pending_revokes.clone());
        held.numa = local.numa;
        let length = self.acquire(&mut session, &mut held, &ask, qps, depth).await?;
        // `Some(None)`: shutting down; `Some(Some(why))`: an invalid request.
        let refusal = if self.draining.is_cancelled() {
            // SIGTERM arrived while the grant was in flight: drain may not see this transfer.
            Some(None)
        } else if one_range && held.grant_instance() == Some(self.instance_id.as_str()) && req.remote_region == local.name {
            // The peer is this agent and both sides name one region: overlapping ranges would
            // read bytes the copy already overwrote (and a checksum of a source that moved).
            overlap(req.local_offset, ask_offset, length).map(Some)
        } else {
            None
        };
        if let Some(why) = refusal {
            let err = || why.clone().map_or(NodeError::ShuttingDown, NodeError::Invalid);
            session.handle(Event::Abort(err()));
            return Err(match held.settle(&mut session) {
                Some(Command::Refuse(e)) => e,
                _ => err(),
            });
        }
        let now = SystemTime::now();
        let record = TransferRecord {
            id: xfer_engine::ids::TransferId::random().to_string(),
            op: req.op,
            local_region: local.name.clone(),
            local_offset: local_lo,
            remote_agent: req.remote_agent.clone(),
            remote_region: req.remote_region.clone(),
            remote_offset: ask_offset,
            length,
            state: TransferState::Connecting,
            bytes_done: 0,
            error: None,
            error_code: None,
            created_at: now,
            started_at: None,
            finished_at: None,
            elapsed: Duration::ZERO,
            verified: false,
            checksum: None,
            peer: peer.node_name(),
            inbound: false,
            segments,
            notify: req.notify.clone(),
            paths: 0,
            failovers: 0,
            fallback: false,
            peer_key: peer.key.to_string(),
            owner: owner.clone(),
        };
        let handle = self.initiator.transfers.insert_owned(record, self.config.limits.tenant_share);
        // The id it was stored under (the registry never replaces a record).
        let record = handle.snapshot();
        drop(slot); // the registry counts it from here
                    // A resume asks the same peer for the same range (the whole accepted length: a READ of
                    // "the rest" was granted that much), on a fresh connection of the same shape.
        let again = AskAgain {
            region: req.remote_region.clone(),
            offset: ask_offset,
            length: if one_range { length } else { ask_length },
            op: remote_op,
            ttl: ask.ttl,
            notify: req.notify.clone(),
            qps,
            depth,
        };
        let plan = Plan { session, held, local: local_use, algo: opts.algo.unwrap_or(Algo::Xxh3), again };
        let node = self.clone();
        let span = info_span!("transfer", id = %record.id, op = req.op.as_str(), peer = %req.remote_agent);
        tokio::spawn(async move { node.run(handle, plan).await }.instrument(span));
        Ok(record)
    }

    async fn run(self: Arc<Self>, handle: Arc<TransferHandle>, mut plan: Plan) {
        let rec = handle.snapshot();
        let started = Instant::now();
        info!(bytes = rec.length, "transfer started");
        if handle.cancel.is_cancelled() {
            plan.session.handle(Event::Cancel);
        } else {
            handle.update(|r| {
                r.state = TransferState::Running;
                r.started_at = Some(SystemTime::now());
            });
            plan.session.start(Instant::now());
        }
        let outcome = self.drive(&handle, &mut plan, &rec, started).await;
        let elapsed = started.elapsed();
        let (state, failure) = match outcome {
            Ok(sum) => {
                handle.update(|r| {
                    r.verified = sum.is_some();
                    r.checksum = sum;
                });
                (TransferState::Succeeded, None)
            }
            Err(f) if f.code == FailureCode::Cancelled => (TransferState::Cancelled, Some(f)),
            Err(f) => (TransferState::Failed, Some(f)),
        };
        handle.update(|r| {
            r.state = state;
            r.error_code = failure.as_ref().map(|f| f.code);
            r.error = failure.as_ref().map(|f| f.message.clone());
            r.finished_at = Some(SystemTime::now());
            r.elapsed = elapsed;
        });
        let done = handle.snapshot().bytes_done;
        let result = match state {
            TransferState::Succeeded => "succeeded",
            TransferState::Cancelled => "cancelled",
            _ => "failed",
        };
        m::transfer_finished(rec.op.as_str(), result, elapsed);
        match failure {
            None => info!(bytes = done, secs = elapsed.as_secs_f64(), "transfer succeeded"),
            Some(f) => {
                m::transfer_failure(rec.op.as_str(), f.code.as_str());
                warn!(result, code = %f.code, error = %f.message, bytes = done, "transfer did not succeed");
            }
        }
    }

    /// Runs the session from `start` to `Finish`: its data phase is a job on the data path's one
    /// driver ([`Node::run_job`]: posts, completions, cancel, time, progress into the record);
    /// what comes after — the local check, the checksum and `Peer.Complete` — is done here, as
    /// the session asks.
    async fn drive(
        &self,
        handle: &Arc<TransferHandle>,
        plan: &mut Plan,
        rec: &TransferRecord,
        started: Instant,
    ) -> Result<Option<u64>, Failure> {
        let Plan { session: s, held, local, algo, again } = plan;
        // The session accepts only with a grant, and `held` keeps it until the session's own
        // Revoke/GrantConsumed (even a cancel before the start is settled in the loop below).
        let template = |held: &Held| {
            let grant: &GrantInfo = &held.grant.as_ref()?.info;
            Some(WrTemplate {
                op: if rec.op == Op::Write { WrOp::Write } else { WrOp::Read },
                notify_slot: grant.notify_slot,
                local: local.0.registration.clone(),
                remote_addr: grant.addr,
                remote_key: grant.key.clone(),
                wrap: None,
            })
        };
        let Some(mut wr) = template(held) else {
            return Err(Failure::new(FailureCode::Internal, "transfer started without its grant"));
        };
        // The peer instance that granted first, and the one a resume found instead, if another.
        let first = held.grant_instance().unwrap_or_default().to_string();
        let mut restarted = None;
        let mut reported = 0;
        loop {
            // The data phase: the session lends its machine whenever it is moving data.
            if let Some(machine) = s.lend_machine() {
                let Some(lease) = held.lease.take() else {
                    s.return_machine(machine);
                    return Err(Failure::new(FailureCode::Internal, "transfer session runs without a connection"));
                };
                let h = handle.clone();
                let mut shown = reported;
                let (op, peer) = (rec.op.as_str(), held.peer.label_identity());
                // A resumed machine counts from 0: what the earlier ones retired comes first.
                let base = s.bytes_base();
                let progress: Progress = Box::new(move |bytes| report(&h, op, &peer, base + bytes, &mut shown, started));
                let job = Job { machine, lease, wr: wr.clone(), probe: None, cancel: handle.cancel.clone(), progress: Some(progress) };
                let ran = Instant::now();
                let done = self.run_job(job).await.map_err(|e| Failure::new(FailureCode::Internal, e.to_string()))?;
                let (paths, lost) = (done.lease.conn().paths().len() as u32, done.machine.failovers());
                let fell_back = crate::transfer::job::fell_back(&done.machine, done.lease.conn().as_ref());
                let mut first_fallback = false;
                handle.record.send_modify(|r| {
                    r.paths = paths;
                    r.failovers += lost;
                    first_fallback = fell_back && !r.fallback;
                    r.fallback |= fell_back;
                });
                if first_fallback {
                    crate::metrics::transfer_fallback();
                    tracing::warn!(transfer = %rec.id, peer = %held.peer.addr, "every RDMA path to the peer was lost: the transfer fell back to tcp");
                }
                if let Some(plan) = held.paths.take() {
                    self.initiator.paths.learn(&held.peer.addr, done.lease.conn().as_ref(), &plan, &done.machine, ran.elapsed());
                }
                held.lease = Some(done.lease);
                reported = base + done.machine.bytes_done();
                s.return_machine(done.machine);
                continue;
            }
            match held.settle(s) {
                Some(lease @ Command::Lease) => {
                    // Every path was lost: the session resumes on a fresh connection and grant.
                    warn!(peer = %held.peer.addr, bytes_done = s.bytes_done(), resume = s.resumed(),
                        "every path to the peer was lost; resuming on a fresh connection with what is left");
                    let ask = again.ask();
                    match self.acquire_resume(s, held, &ask, (again.qps, again.depth), lease, &handle.cancel).await {
                        Ok(Command::Resumed) => {
                            restarted = held.grant_instance().filter(|i| *i != first).map(|i| (first.clone(), i.to_string()));
                            m::transfer_resume("resumed");
                            handle.record.send_modify(|r| r.failovers += 1);
                            let Some(fresh) = template(held) else {
                                return Err(Failure::new(FailureCode::Internal, "transfer resumed without a grant"));
                            };
                            wr = fresh;
                        }
                        Ok(Command::Finish(r)) => {
                            // A cancel (the transfer's own or a drain's) ended the resume, not the
                            // peer or the network: `failed` stays what an alert can watch.
                            let cancelled = matches!(&r, Err(f) if f.code == FailureCode::Cancelled);
                            m::transfer_resume(if cancelled { "cancelled" } else { "failed" });
                            return r;
                        }
                        Ok(other) => return Err(Failure::new(FailureCode::Internal, format!("unexpected {other:?} while resuming"))),
                        Err(e) => {
                            m::transfer_resume("failed");
                            return Err(Failure::new(FailureCode::Internal, format!("resuming: {e}")));
                        }
                    }
                }
                Some(Command::CheckLocal) => s.handle(Event::LocalChecked(local.0.intact().map_err(|e| e.to_string()))),
                Some(Command::Checksum) => {
                    let r = self.checksum(local, &sums(s, rec).0, *algo).await;
                    s.handle(Event::Checksummed(r));
                }
                Some(Command::Complete { checksum }) => {
                    let spans = checksum.map(|_| sums(s, rec).1).unwrap_or_default();
                    let r = self.complete(held, rec, checksum.map(|c| (*algo, c)), spans).await;
                    s.handle(Event::Completed(r));
                }
                Some(Command::Finish(r)) => {
                    report(handle, rec.op.as_str(), &held.peer.label_identity(), s.bytes_done(), &mut reported, started);
                    return super::acquire::after_restart(r, restarted.as_ref());
                }
                Some(other) => {
                    return Err(Failure::new(FailureCode::Internal, format!("unexpected {other:?} while running")));
                }
                None => return Err(Failure::new(FailureCode::Internal, "transfer session stopped before finishing")),
            }
        }
    }

    async fn checksum(&self, local: &RegionUse, ranges: &[(u64, u64)], algo: Algo) -> Result<u64, Failure> {
        let mem = local.0.memory.clone();
        let ranges = ranges.to_vec();
        tokio::task::spawn_blocking(move || checksum::checksum_ranges(&mem, &ranges, algo))
            .await
            .map_err(|e| Failure::new(FailureCode::Internal, e.to_string()))?
            .map_err(|e| match local.0.mem_error(e) {
                e @ crate::regions::RegionError::Poisoned { .. } => Failure::new(FailureCode::RegionPoisoned, e.to_string()),
                e => Failure::new(FailureCode::Internal, e.to_string()),
            })
    }

    /// `Peer.Complete`: `Ok(matched)` (true without a checksum), or why the call failed.
    async fn complete(
        &self,
        held: &Held,
        rec: &TransferRecord,
        checksum: Option<(Algo, u64)>,
        spans: Vec<(u64, u64)>,
    ) -> Result<bool, String> {
        let Some(grant) = held.grant.as_ref() else { return Err("no grant to complete".into()) };
        // Invariant of outbound records: their ids are made by `TransferId::random` (the
        // registry re-draws one on a collision), so they parse.
        let transfer_id = xfer_engine::ids::TransferId::parse(&rec.id).map_err(|e| format!("transfer id: {e}"))?;
        let params = CompleteParams {
            transfer_id,
            grant_id: grant.info.grant_id.clone(),
            bytes: rec.length,
            op_write: rec.op == Op::Write,
            node_name: self.config.node_name.clone(),
            checksum,
            spans,
            success: true,
        };
        let peer = &held.peer;
        peer.call(|| peer.client.complete(params.clone())).await.map_err(|e| {
            warn!(error = %e, "Peer.Complete failed; the data landed but the target did not record it");
            e.to_string()
        })
    }

    /// A transfer record by id: an outbound id, or `PEER/ID` for an inbound one.
    pub fn transfer(&self, id: &str) -> Result<Arc<TransferHandle>, NodeError> {
        if id.contains('/') {
            self.responder.inbound.get(id)
        } else {
            self.initiator.transfers.get(id)
        }
    }

    /// Outbound records, then inbound ones, each oldest first.
    pub fn list_transfers(&self) -> Vec<TransferRecord> {
        let mut v = self.initiator.transfers.list();
        v.extend(self.responder.inbound.list());
        v
    }

    /// Cancels a running transfer; no-op for finished ones.
    pub fn cancel(&self, id: &str) -> Result<TransferRecord, NodeError> {
        let h = self.initiator.transfers.get(id)?;
        h.cancel.cancel();
        Ok(h.snapshot())
    }
}

/// (offset, length) pairs.
type Ranges = Vec<(u64, u64)>;

/// What a checksum covers on each side, in the batch's order: the local ranges (absolute), and
/// the spans of the grant the target sums (none for one range from the grant's start, which is
/// what a target sums without spans).
fn sums(s: &Session, rec: &TransferRecord) -> (Ranges, Ranges) {
    let Some(b) = s.batch() else { return (vec![(rec.local_offset, rec.length)], Vec::new()) };
    let local = b.segs().iter().map(|g| (g.local, g.len)).collect();
    let spans: Vec<(u64, u64)> = b.segs().iter().map(|g| (g.remote, g.len)).collect();
    let spans = if spans == [(0, rec.length)] { Vec::new() } else { spans };
    (local, spans)
}

/// Tells the record (and its watchers) and `xfer_transfer_bytes_total` that `bytes` are done: the
/// counter first, so a watcher that saw the progress finds it counted.
fn report(handle: &TransferHandle, op: &'static str, peer: &str, bytes: u64, reported: &mut u64, started: Instant) {
    let mut counted = *reported;
    m::transfer_progress(op, peer, bytes, &mut counted);
    if bytes != *reported {
        *reported = bytes;
        handle.update(|r| {
            r.bytes_done = bytes;
            r.elapsed = started.elapsed();
        });
    }
}

/// The initiator side's state: what this agent runs against its peers.
pub(super) struct Initiator {
    /// Transfers this agent initiated.
    pub(super) transfers: TransferRegistry,
    pub(super) peers: PeerPool,
    /// Submits past the limit check that have not inserted their record yet, and open
    /// channels, by peer identity and owner. Counted with the active transfers so concurrent
    /// submits cannot overshoot the limits.
    pub(super) submitting: Mutex<HashMap<(String, Tenant), usize>>,
    /// Background revocations of peer grants in flight; `drain` waits for them.
    pub(super) pending_revokes: Arc<AtomicUsize>,
    /// The device's data-path worker thread (verbs with `verbs.worker`), started on first use.
    pub(super) worker: OnceLock<Option<Worker<Lease>>>,
    /// What each path to each peer carries, for the weights a job stripes by.
    pub(super) paths: super::paths::PathBook,
}

/// What a running transfer owns.
pub(super) struct Plan {
    session: Session,
    held: Held,
    /// Keeps the local region in use (DeleteRegion refuses it as busy).
    local: RegionUse,
    /// The checksum algorithm when verifying.
    algo: Algo,
    /// What a resume asks the peer for.
    again: AskAgain,
}

/// The grant a transfer asked for, owned, to ask it again when it resumes.
struct AskAgain {
    region: String,
    offset: u64,
    length: u64,
    op: xfer_fabric::RemoteOp,
    ttl: Duration,
    notify: Option<Vec<u8>>,
    qps: usize,
    depth: usize,
}

impl AskAgain {
    fn ask(&self) -> GrantAsk<'_> {
        GrantAsk {
            region: &self.region,
            offset: self.offset,
            length: self.length,
            op: self.op,
            ttl: self.ttl,
            notify: self.notify.as_deref().map(|t| (t, 0)),
            channel: false,
        }
    }
}

/// Why copying `len` bytes from `a` to `b` within one region is refused, when the two ranges
/// overlap.
fn overlap(a: u64, b: u64, len: u64) -> Option<String> {
    let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
    (hi - lo < len).then(|| {
        format!(
            "source and destination overlap in one region on this agent (offsets {a} and {b}, {len} bytes): \
             the copy would read bytes it already overwrote; use ranges at least {len} bytes apart or another region"
        )
    })
}
