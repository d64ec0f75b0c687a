//! The initiator side: `submit` validates a transfer, leases a connection and obtains the peer's
//! grant; `run`/`execute` drive the sans-IO machine over the fabric, verify, complete and release.
#[allow(unused_imports)]
use super::*;

impl Node {
    // ------------------------------------------------------------------ Initiator side

    /// Validates a transfer, obtains the peer's grant and starts it. Bad input fails here with a
    /// clear error; failures after this point are reported in the transfer record.
    pub async fn submit(self: &Arc<Self>, req: TransferRequest) -> Result<TransferRecord, TransferError> {
        if self.draining.is_cancelled() {
            return Err(TransferError::ShuttingDown);
        }
        let slot = self.reserve_slot(&req.remote_agent)?;
        // In use from the lookup on (under the registry lock): a DeleteRegion meanwhile is
        // refused as busy instead of deleting a region this transfer is about to move bytes in.
        let local_use = self.regions.acquire(&req.local_region)?;
        let local = Arc::clone(&local_use.0);
        if req.local_offset > local.length {
            return Err(TransferError::Invalid(format!(
                "offset {} is beyond the end of region {:?} ({} bytes)",
                req.local_offset, local.name, local.length
            )));
        }
        if req.op == Op::Read && !local.memory.writable() {
            return Err(TransferError::PermissionDenied(format!(
                "local region {:?} is mapped read-only and cannot receive a READ",
                local.name
            )));
        }
        let length = match (req.op, req.length) {
            (Op::Write, 0) => local.length - req.local_offset,
            (_, n) => n,
        };
        if req.op == Op::Write && length == 0 {
            return Err(TransferError::Invalid("zero-length transfer: nothing to copy".into()));
        }
        if req.length != 0 || req.op == Op::Write {
            local.check_range(req.local_offset, length)?;
        }
        let opts = &req.options;
        let chunk = opts.chunk_size.unwrap_or(self.config.transfer.chunk_size.0);
        if chunk == 0 || chunk > crate::fabric::frame::MAX_PAYLOAD as u64 {
            return Err(TransferError::Invalid(format!("chunk size must be between 1 and {} bytes", crate::fabric::frame::MAX_PAYLOAD)));
        }
        let qps = opts.qps.unwrap_or(self.config.transfer.qps);
        let depth = opts.depth.unwrap_or(self.config.transfer.depth);
        if !(1..=64).contains(&qps) || !(1..=4096).contains(&depth) {
            return Err(TransferError::Invalid("qps must be 1-64 and depth 1-4096".into()));
        }
        let timeout = opts.timeout.filter(|t| !t.is_zero()).unwrap_or(self.config.transfer.timeout.0);
        let peer = self.peers.peer(&req.remote_agent)?;
        let remote_op = match req.op {
            Op::Write => RemoteOp::Write,
            Op::Read => RemoteOp::Read,
        };
        let grant_ttl = timeout + Duration::from_secs(60);
        // Connect first: the grant is bound to this connection (grant mode mw binds its windows
        // on the connection's QPs). Connect failures are submit errors (UNAVAILABLE, ...).
        let ask = GrantAsk { region: &req.remote_region, offset: req.remote_offset, length, op: remote_op, ttl: grant_ttl };
        let (lease, grant) = self.lease_and_grant(&peer, qps, depth, &ask).await?;
        let length = if length == 0 { grant.length } else { length };
        let refuse = |e: TransferError, lease| {
            self.revoke_later(&peer, &grant.grant_id);
            self.peers.release(&peer, lease, true);
            Err(e)
        };
        if grant.length < length {
            return refuse(TransferError::Invalid(format!("peer granted {} bytes, {} needed", grant.length, length)), lease);
        }
        if let Err(e) = local.check_range(req.local_offset, length) {
            return refuse(e.into(), lease);
        }
        if length == 0 {
            return refuse(TransferError::Invalid("zero-length transfer: nothing to copy".into()), lease);
        }
        if self.draining.is_cancelled() {
            // SIGTERM arrived while the grant was in flight: drain may not see this transfer.
            return refuse(TransferError::ShuttingDown, lease);
        }
        let now = SystemTime::now();
        let record = TransferRecord {
            id: new_id(),
            op: req.op,
            local_region: local.name.clone(),
            local_offset: req.local_offset,
            remote_agent: req.remote_agent.clone(),
            remote_region: req.remote_region.clone(),
            remote_offset: req.remote_offset,
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
            peer: grant.node_name.clone(),
            inbound: false,
        };
        let handle = self.transfers.insert(record);
        // The id it was stored under (the registry never replaces a record).
        let record = handle.snapshot();
        drop(slot); // the registry counts it from here
        let plan = Plan {
            local: local_use,
            peer,
            grant,
            lease: Mutex::new(Some(lease)),
            chunk,
            depth,
            verify: opts.verify.then(|| opts.algo.unwrap_or(Algo::Xxh3)),
            deadline: Instant::now() + timeout,
        };
        let node = self.clone();
        let span = info_span!("transfer", id = %record.id, op = req.op.as_str(), peer = %req.remote_agent);
        tokio::spawn(async move { node.run(handle, plan).await }.instrument(span));
        Ok(record)
    }

    async fn run(self: Arc<Self>, handle: Arc<TransferHandle>, plan: Plan) {
        let rec = handle.snapshot();
        let started = Instant::now();
        info!(bytes = rec.length, "transfer started");
        let mut outcome = self.execute(&handle, &plan, &rec, started).await;
        // The local region's file shrank under its mapping while the transfer copied it: whatever
        // the fabric reported (a local protection error, or success over zeros standing in for
        // the missing pages), the transfer failed, and the code says why.
        if !matches!(outcome, Err(Outcome::Cancelled)) {
            if let Err(e) = plan.local.0.intact() {
                outcome = Err(Outcome::Failed(REGION_POISONED.into(), e.to_string()));
            }
        }
        let (state, code, msg) = match outcome {
            Ok(verified) => {
                handle.update(|r| {
                    r.verified = verified.is_some();
                    r.checksum = verified;
                });
                (TransferState::Succeeded, None, None)
            }
            Err(Outcome::Cancelled) => (TransferState::Cancelled, Some("CANCELLED".to_string()), Some("cancelled".to_string())),
            Err(Outcome::Failed(code, msg)) => (TransferState::Failed, Some(code), Some(msg)),
        };
        if state != TransferState::Succeeded {
            self.revoke_later(&plan.peer, &plan.grant.grant_id);
        }
        let elapsed = started.elapsed();
        handle.update(|r| {
            r.state = state;
            r.error_code = code.clone();
            r.error = msg.clone();
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
        m::transfer_bytes(rec.op.as_str(), &peer_label(&plan.peer), done);
        match state {
            TransferState::Succeeded => info!(bytes = done, secs = elapsed.as_secs_f64(), "transfer succeeded"),
            _ => warn!(result, code = ?code, error = ?msg, bytes = done, "transfer did not succeed"),
        }
    }

    /// Moves the data; `Ok(checksum)` on success (the checksum when verified).
    async fn execute(&self, handle: &TransferHandle, plan: &Plan, rec: &TransferRecord, started: Instant) -> Result<Option<u64>, Outcome> {
        // Leased at submit (the grant is bound to it).
        let Some(mut lease) = plan.lease.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Err(Outcome::Failed("INTERNAL".into(), "transfer started without its connection".into()));
        };
        if handle.cancel.is_cancelled() {
            self.peers.release(&plan.peer, lease, true);
            return Err(Outcome::Cancelled);
        }
        handle.update(|r| {
            r.state = TransferState::Running;
            r.started_at = Some(SystemTime::now());
        });
        let mut machine = Machine::new(MachineConfig {
            total: rec.length,
            chunk: plan.chunk,
            qps: lease.conn.qps(),
            depth: plan.depth,
            signal_every: self.config.transfer.signal_every,
            deadline: Some(plan.deadline),
        });
        let local = plan.local.0.registration.clone();
        let op = if rec.op == Op::Write { WrOp::Write } else { WrOp::Read };
        let (local_off, remote_addr, key) = (rec.local_offset, plan.grant.addr, plan.grant.key.clone());
        pump(
            &mut machine,
            &mut lease,
            &handle.cancel,
            |p| WorkRequest {
                wr_id: p.seq,
                op,
                local: local.clone(),
                local_offset: local_off + p.offset,
                len: p.len,
                remote_addr: remote_addr + p.offset,
                remote_key: key.clone(),
                signaled: p.signaled,
            },
            |bytes| {
                handle.update(|r| {
                    r.bytes_done = bytes;
                    r.elapsed = started.elapsed();
                })
            },
            None,
        )
        .await;
        let clean = machine.state() == &State::Succeeded && machine.outstanding() == 0;
        let state = machine.state().clone();
        let failed = match state {
            State::Succeeded => None,
            State::Cancelled => Some(Outcome::Cancelled),
            State::Failed(Failure::Completion { status, .. }) => Some(Outcome::Failed(
                status.name().to_string(),
                format!("work request failed with {status}{}", hint(status)),
            )),
            State::Failed(Failure::Post(e)) => Some(Outcome::Failed("POST_FAILED".into(), e)),
            State::Failed(Failure::Timeout) => Some(Outcome::Failed("DEADLINE_EXCEEDED".into(), "transfer timed out".into())),
            State::Running => Some(Outcome::Failed("INTERNAL".into(), "engine stopped early".into())),
        };
        if let Some(outcome) = failed {
            self.peers.release(&plan.peer, lease, clean);
            return Err(outcome);
        }
        // Data landed. Tell the target (and let it verify), then report. The connection goes back
        // to the pool only after `Peer.Complete`: the grant is bound to it, and another transfer
        // that leased it and then discarded it (a cancel) would make the target revoke this
        // transfer's grant before its Complete arrived ("grant not found" at verify).
        let result = self.finish(plan, rec).await;
        self.peers.release(&plan.peer, lease, true);
        result
    }

    /// Verifies (optionally) and sends `Peer.Complete` for a transfer whose data landed.
    async fn finish(&self, plan: &Plan, rec: &TransferRecord) -> Result<Option<u64>, Outcome> {
        let sum = match plan.verify {
            Some(algo) => {
                let mem = plan.local.0.memory.clone();
                let (off, len) = (rec.local_offset, rec.length);
                let v = tokio::task::spawn_blocking(move || checksum::checksum(&mem, off, len, algo))
                    .await
                    .map_err(|e| Outcome::Failed("INTERNAL".into(), e.to_string()))?
                    .map_err(|e| match plan.local.0.mem_error(e) {
                        e @ crate::regions::RegionError::Poisoned { .. } => Outcome::Failed(REGION_POISONED.into(), e.to_string()),
                        e => Outcome::Failed("INTERNAL".into(), e.to_string()),
                    })?;
                Some((algo, v))
            }
            None => None,
        };
        let params = CompleteParams {
            transfer_id: rec.id.clone(),
            grant_id: plan.grant.grant_id.clone(),
            bytes: rec.length,
            op_write: rec.op == Op::Write,
            node_name: self.config.node_name.clone(),
            checksum: sum,
            success: true,
        };
        match plan.peer.call(|| plan.peer.client.complete(params.clone())).await {
            Ok(true) => Ok(sum.map(|s| s.1)),
            Ok(false) => Err(Outcome::Failed(
                "CHECKSUM_MISMATCH".into(),
                "checksum of the destination range does not match the source".into(),
            )),
            Err(e) if sum.is_some() => Err(Outcome::Failed("VERIFY_FAILED".into(), format!("could not verify: {e}"))),
            Err(e) => {
                warn!(error = %e, "Peer.Complete failed; the data landed but the target did not record it");
                Ok(None)
            }
        }
    }

    /// Leases a connection to `peer`, then asks the peer for a grant bound to it
    /// (`GrantRequest.connection_id`: grant mode mw binds its windows on that connection's QPs).
    /// An idle connection may predate a restart of the peer, which then does not know it, or break
    /// while the grant is asked (the peer closed it for idleness): it is discarded and a fresh one
    /// negotiated (once). A pooled connection that breaks after this fails its transfer cleanly
    /// (`RETRY_EXC_ERR` in the record).
    pub(super) async fn lease_and_grant(
        &self,
        peer: &Arc<PeerEntry>,
        qps: usize,
        depth: usize,
        ask: &GrantAsk<'_>,
    ) -> Result<(Lease, GrantInfo), TransferError> {
        let me = &self.config.node_name;
        let mut retried = false;
        loop {
            let lease = self.peers.lease(peer, qps, depth).await?;
            let cid = lease.connection_id.clone();
            let r = peer.call(|| peer.client.grant(ask, me, &cid)).await;
            match r {
                Ok(grant) => {
                    peer.observe(&grant.node_name, &grant.instance_id);
                    if grant.instance_id == lease.instance_id() && lease.reused() && lease.conn.is_broken() && !retried {
                        // The pooled connection broke while the grant was asked (e.g. the peer
                        // closed its idle streams, limits.data_idle_timeout): the grant is bound to
                        // it, so drop both and start over on a fresh connection, once.
                        debug!(peer = %peer.addr, "pooled connection broke while granting; negotiating a fresh one");
                        self.revoke_later(peer, &grant.grant_id);
                        self.peers.release(peer, lease, false);
                        retried = true;
                        continue;
                    }
                    if grant.instance_id == lease.instance_id() {
                        return Ok((lease, grant));
                    }
                    // The peer restarted after this connection was made: its QPs are gone. The
                    // grant itself does not use the connection (an mw grant would have failed).
                    self.peers.release(peer, lease, false);
                    match self.peers.lease(peer, qps, depth).await {
                        Ok(fresh) => return Ok((fresh, grant)),
                        Err(e) => {
                            self.revoke_later(peer, &grant.grant_id);
                            return Err(e.into());
                        }
                    }
                }
                Err(PeerError::Remote { code: RemoteCode::FailedPrecondition, .. }) if lease.reused() && !retried => {
                    debug!(peer = %peer.addr, "peer does not know a pooled connection; negotiating a fresh one");
                    self.peers.release(peer, lease, false);
                    retried = true;
                }
                Err(e) => {
                    self.peers.release(peer, lease, true);
                    return Err(e.into());
                }
            }
        }
    }

    /// A transfer record by id: an outbound id, or `PEER/ID` for an inbound one.
    pub fn transfer(&self, id: &str) -> Result<Arc<TransferHandle>, TransferError> {
        if id.contains('/') {
            self.inbound.get(id)
        } else {
            self.transfers.get(id)
        }
    }

    /// Outbound records, then inbound ones, each oldest first.
    pub fn list_transfers(&self) -> Vec<TransferRecord> {
        let mut v = self.transfers.list();
        v.extend(self.inbound.list());
        v
    }

    /// Cancels a running transfer; no-op for finished ones.
    pub fn cancel(&self, id: &str) -> Result<TransferRecord, TransferError> {
        let h = self.transfers.get(id)?;
        h.cancel.cancel();
        Ok(h.snapshot())
    }

    /// Revokes a peer's grant in the background (best effort; `drain` waits for these).
    pub(super) fn revoke_later(&self, peer: &Arc<PeerEntry>, grant_id: &str) {
        let peer = peer.clone();
        let id = grant_id.to_string();
        let pending = self.pending_revokes.clone();
        pending.fetch_add(1, Ordering::AcqRel);
        tokio::spawn(async move {
            let _ = peer.call(|| peer.client.revoke(&id)).await;
            pending.fetch_sub(1, Ordering::AcqRel);
        });
    }
}


pub(super) struct Plan {
    local: RegionUse,
    peer: Arc<PeerEntry>,
    grant: GrantInfo,
    /// The connection the grant is bound to; `execute` takes it (std Mutex: no awaits held).
    lease: Mutex<Option<Lease>>,
    chunk: u64,
    depth: usize,
    verify: Option<Algo>,
    deadline: Instant,
}

pub(super) enum Outcome {
    Cancelled,
    Failed(String, String),
}

/// `error_code` of a transfer whose local region's file shrank under its mapping.
pub const REGION_POISONED: &str = "REGION_POISONED";

fn hint(status: crate::fabric::WcStatus) -> &'static str {
    use crate::fabric::WcStatus::*;
    match status {
        RemAccessErr => " (the peer refused access: outside the grant, wrong operation, expired or revoked)",
        RetryExcErr => " (the peer stopped answering: dead agent, broken link or closed connection)",
        RnrRetryExcErr => " (the peer's receive queue was not ready)",
        RemInvReqErr => " (the peer rejected the request as invalid)",
        _ => "",
    }
}

fn peer_label(peer: &PeerEntry) -> String {
    let n = peer.node_name();
    if n.is_empty() {
        peer.addr.clone()
    } else {
        n
    }
}
