//! Obtaining what a transfer needs from its peer before bytes move — a leased connection (its
//! path plan) and a grant bound to it — by driving the session's acquire phase: for a new
//! transfer, a channel or a benchmark, and again for a transfer resuming after it lost every
//! path. The grant's key is checked against the connection here, before any work request.
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::held::Held;
use super::Node;
use crate::error::NodeError;
use crate::peer_api::{GrantAsk, PeerError, RemoteCode};
use crate::peers::PeerEntry;
use crate::tenants::Tenant;
use crate::transfer::session::{Command, Event, Session, SessionConfig};
use xfer_engine::failure::{Failure, FailureCode};
use xfer_engine::machine::Markers;

impl Node {
    /// Drives `s` through lease and grant until it accepts (the transfer's length) or refuses.
    /// Also used by channels and [`Node::acquire_exempt`], which then move the data themselves.
    pub(super) async fn acquire(
        &self,
        s: &mut Session,
        held: &mut Held,
        ask: &GrantAsk<'_>,
        qps: usize,
        depth: usize,
    ) -> Result<u64, NodeError> {
        match self.acquire_until(s, held, ask, qps, depth, None).await? {
            Command::Accept { length } => Ok(length),
            Command::Refuse(e) => Err(e),
            other => Err(NodeError::Internal(format!("unexpected {other:?} before the transfer started"))),
        }
    }

    /// Drives `s` through lease and grant (answering every `Lease` and `AskGrant`, starting with
    /// `first` when the caller already took it from the session) and returns the first other
    /// command: `Accept` or `Refuse` for a new transfer; `Resumed` or `Finish` for one that
    /// resumes after losing every path.
    pub(super) async fn acquire_until(
        &self,
        s: &mut Session,
        held: &mut Held,
        ask: &GrantAsk<'_>,
        qps: usize,
        depth: usize,
        mut first: Option<Command>,
    ) -> Result<Command, NodeError> {
        let me = &self.config.node_name;
        loop {
            let ev = match first.take().or_else(|| held.settle(s)) {
                Some(Command::Lease) => match self.initiator.peers.lease(&held.peer, qps, depth, &held.tenant).await {
                    Ok(l) => {
                        let qps = l.qps();
                        // A plan of an earlier, stale connection is dropped here: its charge goes back.
                        let plan = self.initiator.paths.plan(&held.peer.addr, l.conn().as_ref(), held.numa, ask.length);
                        s.set_paths(plan.path_of.clone(), plan.weights.clone());
                        held.paths = Some(plan);
                        let ev = Event::Leased { qps, reused: l.reused() };
                        held.lease = Some(l);
                        ev
                    }
                    Err(e) => Event::LeaseFailed(e.into()),
                },
                Some(Command::AskGrant) => {
                    let Some(lease) = held.lease.as_ref() else {
                        return Err(NodeError::Internal("grant asked without a connection".into()));
                    };
                    let peer = held.peer.clone();
                    let cid = lease.connection_id().clone();
                    // A notification waits for one marker per QP of this connection.
                    let qps = lease.qps();
                    let ask = GrantAsk { notify: ask.notify.map(|(t, _)| (t, qps as u32)), ..*ask };
                    let conn = lease.conn();
                    // The key is the peer's answer: one that cannot serve every QP of this
                    // connection is refused here, before any work request is posted under it (a
                    // short list would fail only at its first missing QP, after the other QPs
                    // moved bytes). The grant is still held, so it is revoked.
                    let answer = peer.call(|| peer.client.grant(&ask, me, &cid)).await;
                    let misfit = answer.as_ref().ok().and_then(|g| g.key.fits(conn.qps(), &conn.paths()).err());
                    match answer {
                        Ok(g) if misfit.is_some() => {
                            held.hold_grant(g);
                            let why = misfit.unwrap_or_default();
                            Event::GrantFailed(
                                PeerError::Protocol {
                                    addr: peer.addr.clone(),
                                    detail: format!("its grant's key does not fit connection {cid}: {why}"),
                                }
                                .into(),
                            )
                        }
                        Ok(g) if ask.notify.is_some() && g.notify_slot == 0 => {
                            // An agent that predates notifications ignores the ask: refuse
                            // rather than move bytes nobody will be told about.
                            held.hold_grant(g);
                            Event::GrantFailed(NodeError::FailedPrecondition(format!(
                                "peer {} does not support notifications (its grant carries no notification slot)",
                                peer.addr
                            )))
                        }
                        Ok(g) => {
                            peer.observe(&g.node_name, &g.instance_id);
                            let same_instance = g.instance_id == lease.instance_id();
                            if !same_instance {
                                debug!(peer = %peer.addr, "peer restarted since the connection was made; negotiating a fresh one");
                            }
                            let ev = Event::Granted { length: g.length, same_instance, conn_broken: lease.conn().is_broken() };
                            held.hold_grant(g);
                            ev
                        }
                        Err(e @ PeerError::Remote { code: RemoteCode::UnknownConnection, .. }) => {
                            debug!(peer = %peer.addr, "peer does not know the connection; negotiating a fresh one if it was pooled");
                            Event::GrantUnknownConnection(e.into())
                        }
                        Err(e) => Event::GrantFailed(e.into()),
                    }
                }
                Some(other) => return Ok(other),
                None => return Err(NodeError::Internal("transfer session stopped before accepting".into())),
            };
            s.handle(ev);
        }
    }

    /// [`Node::acquire_until`] for a transfer resuming after it lost every path (`first` is the
    /// session's `Lease`): it already runs, so its cancel (`CancelTransfer`, a drain) and its
    /// deadline end the resume mid-way rather than after the peer answered (a peer slow to
    /// answer Connect or Grant held them off, up to the RPC timeout per call). The call in
    /// flight is dropped; the session then discards the fresh connection, which makes the peer
    /// forget a grant it made on it. `Resumed`, or `Finish` with why not.
    pub(super) async fn acquire_resume(
        &self,
        s: &mut Session,
        held: &mut Held,
        ask: &GrantAsk<'_>,
        (qps, depth): (usize, usize),
        first: Command,
        cancel: &CancellationToken,
    ) -> Result<Command, NodeError> {
        let deadline = s.poll_timeout();
        let timed_out = {
            let acquiring = self.acquire_until(s, held, ask, qps, depth, Some(first));
            tokio::pin!(acquiring);
            let out_of_time = async move {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = &mut acquiring => return r,
                () = cancel.cancelled() => false,
                () = out_of_time => true,
            }
        };
        match (timed_out, deadline) {
            (true, Some(d)) => s.handle_timeout(Instant::now().max(d)),
            _ => s.handle(Event::Cancel),
        }
        held.settle(s).ok_or_else(|| NodeError::Internal("transfer session stopped while resuming".into()))
    }

    /// A connection and a grant for the agent itself (a benchmark's, on the peer's scratch
    /// region), through the transfer session's acquire phase: the same stale-connection handling
    /// as a transfer. Both are given back when the returned [`Held`] drops.
    pub async fn acquire_exempt(&self, peer: &Arc<PeerEntry>, ask: &GrantAsk<'_>, qps: usize, depth: usize) -> Result<Held, NodeError> {
        let mut s = Session::new(SessionConfig {
            length: ask.length,
            batch: None,
            markers: Markers::None,
            local_name: "bench buffer".into(),
            local_length: ask.length,
            local_offset: 0,
            chunk: ask.length,
            depth,
            signal_every: self.config.transfer.signal_every,
            verify: false,
            timeout: Duration::from_secs(600),
            resumes: 0,
        });
        let mut held = Held::new(peer.clone(), Tenant::exempt(), self.initiator.pending_revokes.clone());
        self.acquire(&mut s, &mut held, ask, qps, depth).await?;
        Ok(held)
    }
}

/// A transfer's end, told truly when it resumed on an instance of the peer other than the one
/// that granted it first (`restarted`: the first instance and the one resumed on): the peer
/// restarted, so what the first connection moved may be gone, and a destination that does not
/// match its source says that, not that a device reported work that did not land.
pub(super) fn after_restart(r: Result<Option<u64>, Failure>, restarted: Option<&(String, String)>) -> Result<Option<u64>, Failure> {
    match (r, restarted) {
        (Err(mut f), Some((first, then))) if f.code == FailureCode::ChecksumMismatch => {
            f.message = format!(
                "the peer restarted while the transfer ran (instance {first}, resumed on {then}): what the first connection \
                 moved may be gone, and the destination range does not match the source; run the transfer again"
            );
            Err(f)
        }
        (r, _) => r,
    }
}
