//! Sans-IO transfer session: the initiator's whole lifecycle of one transfer as a state machine —
//! lease a connection, obtain the peer's grant bound to it (retrying once on a stale pooled
//! connection), run the data [`Machine`], check the local region, verify, send `Peer.Complete`,
//! and give back the lease and the grant on every path.
//!
//! It does no IO and never reads the clock. The driver (`node::initiator`) asks it what to do
//! ([`Session::poll`] → [`Command`]), does it, and feeds back what happened ([`Session::handle`] →
//! [`Event`]), plus the time ([`Session::poll_timeout`], [`Session::handle_timeout`]).
//!
//! ```text
//!  Lease ─Leased─▶ AskGrant ─Granted─▶ Accept ─start─▶ Post… ─landed─▶ CheckLocal ─▶ [Checksum] ─▶ Complete ─▶ Finish
//!    ▲                │ stale pooled connection: Release, Lease again (once)   │ fault/cancel/timeout: Release, Revoke, Finish
//!    └────────────────┘ any error before Accept: Release, Revoke, Refuse
//! ```
//!
//! Resource rule (checked by the tests for every fault at every step): each `Leased` is matched
//! by exactly one `Release`, and each `Granted` by exactly one `Revoke` or `GrantConsumed`, before
//! the session's last command (`Refuse` or `Finish`). The driver backs this with RAII guards, so
//! even a dropped driver future gives both back.
//!
//! Resume: a data phase that lost every path ([`Fault::NoPath`]) — a device that flushed its
//! QPs under load with no port event, links flapping one after the other — gives back its
//! connection and grant and starts over from `Lease`, up to [`SessionConfig::resumes`] times,
//! with a machine over only the chunks no successful completion retired (`Resumed`). A resumed
//! transfer is verified end to end, as after a failover, and sends no markers: its notification
//! is published by the target on the matching `Peer.Complete`. It does not resume once it has
//! posted as many markers as the target counts (the target may have published already), nor
//! when the fresh lease or grant fails (it then finishes with the failure that stopped it).
//!
//! Cancellation counts until the data has landed. After the last completion the bytes are at
//! the destination and the session finishes its bookkeeping (check, verify, complete) regardless.
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::batch::Batch;
use crate::error::Error;
use crate::failure::{Failure, FailureCode};
use crate::machine::{Fault, Machine, MachineConfig, Markers, Post, State};
use crate::range::check_range;
use crate::status::WcStatus;

/// What the session needs to know up front.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Bytes asked for; 0 = the rest of the source range, which for a READ is what the peer grants.
    /// Ignored with `batch`.
    pub length: u64,
    /// A batch's checked segments (the grant must span [`Batch::remote_span`]); `None` = one
    /// range of `length` bytes at `local_offset`.
    pub batch: Option<Batch>,
    /// Notification markers to end every QP with.
    pub markers: Markers,
    /// The local region's name and length, and the transfer's offset in it.
    pub local_name: String,
    pub local_length: u64,
    pub local_offset: u64,
    pub chunk: u64,
    pub depth: usize,
    pub signal_every: usize,
    /// Checksum the local range and have the target compare (`Peer.Complete`).
    pub verify: bool,
    /// From `start` to the last completion.
    pub timeout: Duration,
    /// How many times a transfer whose every path was lost may resume on a fresh connection
    /// and grant (0: never; see [`Session`]).
    pub resumes: u32,
}

/// What the driver must do next.
#[derive(Debug)]
pub enum Command<E> {
    /// Lease a connection to the peer → [`Event::Leased`] or [`Event::LeaseFailed`].
    Lease,
    /// Ask the peer for a grant bound to the leased connection → [`Event::Granted`],
    /// [`Event::GrantUnknownConnection`] or [`Event::GrantFailed`].
    AskGrant,
    /// Give the lease back; `clean` = no WR of it is outstanding or failed, so it may be reused.
    Release { clean: bool },
    /// Revoke the peer's grant (best effort, in the background).
    Revoke,
    /// The peer's `Peer.Complete` took the grant: forget it without revoking.
    GrantConsumed,
    /// The transfer is accepted with this length: record it and call [`Session::start`] (or
    /// feed [`Event::Abort`] to refuse it after all, e.g. the agent started draining).
    Accept { length: u64 },
    /// The submit fails with this error (nothing is held any more).
    Refuse(E),
    /// Post this work request → completions, or [`Event::PostFailed`].
    Post(Post),
    /// Check that the local region's backing is intact → [`Event::LocalChecked`].
    CheckLocal,
    /// Checksum the local range → [`Event::Checksummed`].
    Checksum,
    /// Send `Peer.Complete` (with the checksum when verifying) → [`Event::Completed`].
    Complete { checksum: Option<u64> },
    /// The transfer lost every path and resumes on the fresh connection and grant just
    /// obtained: the driver takes the new grant's address and key for the WRs that follow
    /// (the session is moving data again).
    Resumed,
    /// The transfer ended: `Ok(checksum when verified)` or why not.
    Finish(Result<Option<u64>, Failure>),
}

/// What happened.
#[derive(Debug)]
pub enum Event<E> {
    /// A connection with `qps` QPs; `reused` = from the idle pool (negotiated earlier).
    Leased {
        qps: usize,
        reused: bool,
    },
    LeaseFailed(E),
    /// The peer's grant: its length, whether the peer is the same instance the connection was
    /// made with, and whether the connection broke meanwhile.
    Granted {
        length: u64,
        same_instance: bool,
        conn_broken: bool,
    },
    /// The peer does not know the leased connection (it closed it, or restarted).
    GrantUnknownConnection(E),
    GrantFailed(E),
    /// Before `start`: give up with this error (the caller went away, the agent is draining).
    Abort(E),
    Completion {
        qp: usize,
        seq: u64,
        status: WcStatus,
    },
    PostFailed {
        seq: u64,
        reason: String,
    },
    /// The connection's completion channel closed.
    ConnectionClosed,
    /// `CancelTransfer` or drain.
    Cancel,
    /// `Err(why)`: the local region's file shrank under its mapping.
    LocalChecked(Result<(), String>),
    Checksummed(Result<u64, Failure>),
    /// `Ok(checksum matched, or no checksum sent)`, or why the call failed.
    Completed(Result<bool, String>),
}

#[derive(Debug)]
enum Phase {
    Leasing {
        have_grant: bool,
        retried: bool,
    },
    Granting {
        retried: bool,
    },
    Accepted,
    /// Boxed: the machine is large beside the other phases.
    Running(Box<Machine>),
    /// The machine is on loan to a driver that runs it to its end ([`Session::lend_machine`]).
    Lent,
    /// `CheckLocal` sent; then the machine's result applies.
    Checking(Result<(), Failure>),
    Verifying,
    Completing {
        checksum: Option<u64>,
    },
    Done,
}

#[derive(Debug)]
pub struct Session<E> {
    cfg: SessionConfig,
    phase: Phase,
    out: VecDeque<Command<E>>,
    leased: bool,
    granted: bool,
    reused: bool,
    qps: usize,
    /// The leased connection's path per QP and the paths' weights (empty: one path).
    path_of: Arc<[usize]>,
    weights: Vec<u32>,
    grant_len: u64,
    /// Set on accept: what the machine moves.
    batch: Option<Batch>,
    bytes_done: u64,
    /// The data phase succeeded after a path failed over: the range is verified end to end
    /// even when the caller did not ask, because a device that is failing may have reported
    /// work complete that never landed (Soft-RoCE did so under load: a READ retired as
    /// successful whose bytes never arrived, its QP flushed moments later).
    failed_over: bool,
    /// Resumes left, and the one being acquired.
    resumes_left: u32,
    resume: Option<resume::Resume>,
    /// Resumes made; bytes retired by the machines before the current one.
    resumed: u32,
    bytes_base: u64,
}

impl<E: From<Error> + std::fmt::Display> Session<E> {
    pub fn new(cfg: SessionConfig) -> Session<E> {
        let mut s = Session {
            cfg,
            phase: Phase::Leasing { have_grant: false, retried: false },
            out: VecDeque::new(),
            leased: false,
            granted: false,
            reused: false,
            qps: 1,
            path_of: Arc::from([]),
            weights: Vec::new(),
            grant_len: 0,
            batch: None,
            bytes_done: 0,
            failed_over: false,
            resumes_left: 0,
            resume: None,
            resumed: 0,
            bytes_base: 0,
        };
        s.resumes_left = s.cfg.resumes;
        s.out.push_back(Command::Lease);
        s
    }

    /// The next command, if any. In the running phase this is the next WR the windows allow.
    pub fn poll(&mut self) -> Option<Command<E>> {
        if let Some(c) = self.out.pop_front() {
            return Some(c);
        }
        match &mut self.phase {
            Phase::Running(m) => m.poll_transmit().map(Command::Post),
            _ => None,
        }
    }
    /// The segments being moved (a transfer without segments is one), once accepted: what a
    /// checksum covers on each side, in order.
    pub fn batch(&self) -> Option<&Batch> {
        self.batch.as_ref()
    }

    pub fn bytes_done(&self) -> u64 {
        self.bytes_done
    }

    /// Bytes the machines before the running one retired (0 until a resume): a running
    /// machine's own count starts from here.
    pub fn bytes_base(&self) -> u64 {
        self.bytes_base
    }

    /// Times the transfer resumed on a fresh connection.
    pub fn resumed(&self) -> u32 {
        self.resumed
    }

    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done) && self.out.is_empty()
    }

    /// The leased connection's paths: the path of each QP and each path's weight (see
    /// [`MachineConfig::path_of`], [`MachineConfig::weights`]), for the machine `start` makes.
    /// Not called: one path.
    pub fn set_paths(&mut self, path_of: Arc<[usize]>, weights: Vec<u32>) {
        self.path_of = path_of;
        self.weights = weights;
    }

    /// Starts moving data (after `Accept`); the deadline is `now + timeout`.
    pub fn start(&mut self, now: Instant) {
        if !matches!(self.phase, Phase::Accepted) {
            return;
        }
        let Some(batch) = self.batch.as_ref() else { return };
        let m = Machine::new(MachineConfig {
            segs: batch.segs().clone(),
            markers: self.cfg.markers,
            chunk: self.cfg.chunk,
            qps: self.qps,
            depth: self.cfg.depth,
            signal_every: self.cfg.signal_every,
            deadline: now.checked_add(self.cfg.timeout),
            path_of: self.path_of.clone(),
            weights: self.weights.clone(),
        })
        .hold_markers_after_failover();
        self.phase = Phase::Running(Box::new(m));
        self.after_machine();
    }

    /// Lends the running machine to a driver that runs it to a terminal state on its own (the
    /// device's data-path worker), when there is one and no command is waiting. Until
    /// [`Session::return_machine`] the session is inert: no commands, no deadline, and events
    /// are the driver's to feed to the machine.
    pub fn lend_machine(&mut self) -> Option<Machine> {
        if !self.out.is_empty() || !matches!(self.phase, Phase::Running(_)) {
            return None;
        }
        match std::mem::replace(&mut self.phase, Phase::Lent) {
            Phase::Running(m) => Some(*m),
            other => {
                self.phase = other;
                None
            }
        }
    }

    /// Takes the lent machine back and moves on from its state (as after any event).
    pub fn return_machine(&mut self, m: Machine) {
        if matches!(self.phase, Phase::Lent) {
            self.phase = Phase::Running(Box::new(m));
            self.after_machine();
        }
    }

    /// The deadline while moving data, and while a resume acquires its connection and grant.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.phase {
            Phase::Running(m) => m.poll_timeout(),
            _ => self.resume.as_ref().and_then(|r| r.deadline),
        }
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        if let Phase::Running(m) = &mut self.phase {
            m.handle_timeout(now);
            self.after_machine();
        } else {
            self.resume_timed_out(now);
        }
    }

    pub fn handle(&mut self, ev: Event<E>) {
        let phase = std::mem::replace(&mut self.phase, Phase::Done);
        self.phase = match (phase, ev) {
            // A lease or grant that arrives after the end (the session was aborted while it was
            // being obtained) is given straight back.
            (Phase::Done, Event::Leased { .. }) => {
                self.out.push_back(Command::Release { clean: true });
                Phase::Done
            }
            (Phase::Done, Event::Granted { .. }) => {
                self.out.push_back(Command::Revoke);
                Phase::Done
            }
            (Phase::Done, _) => Phase::Done,

            // ---- acquiring: lease, then grant
            (Phase::Leasing { have_grant, retried }, Event::Leased { qps, reused }) => {
                self.leased = true;
                self.reused = reused;
                self.qps = qps.max(1);
                if have_grant {
                    self.accept()
                } else {
                    self.out.push_back(Command::AskGrant);
                    Phase::Granting { retried }
                }
            }
            (Phase::Leasing { .. }, Event::LeaseFailed(e)) if self.resume.is_some() => self.resume_failed(&e),
            (Phase::Leasing { .. }, Event::LeaseFailed(e)) => self.refuse(e),
            (Phase::Granting { retried }, Event::Granted { length, same_instance, conn_broken }) => {
                self.granted = true;
                self.grant_len = length;
                if same_instance && self.reused && conn_broken && !retried {
                    // The pooled connection broke while the grant was asked (the peer closed its
                    // idle streams): the grant is bound to it, so drop both and start over, once.
                    self.revoke();
                    self.release(false);
                    self.out.push_back(Command::Lease);
                    Phase::Leasing { have_grant: false, retried: true }
                } else if same_instance {
                    self.accept()
                } else {
                    // The peer restarted after this connection was made: its QPs are gone. The
                    // grant does not use the connection (a bound grant would have failed).
                    self.release(false);
                    self.out.push_back(Command::Lease);
                    Phase::Leasing { have_grant: true, retried }
                }
            }
            (Phase::Granting { retried: false }, Event::GrantUnknownConnection(_)) if self.reused => {
                self.release(false);
                self.out.push_back(Command::Lease);
                Phase::Leasing { have_grant: false, retried: true }
            }
            (Phase::Granting { .. }, Event::GrantUnknownConnection(e) | Event::GrantFailed(e)) if self.resume.is_some() => {
                self.resume_failed(&e)
            }
            (Phase::Granting { .. }, Event::GrantUnknownConnection(e) | Event::GrantFailed(e)) => self.refuse(e),
            (Phase::Leasing { .. } | Phase::Granting { .. }, Event::Abort(e)) if self.resume.is_some() => self.resume_failed(&e),
            (Phase::Leasing { .. } | Phase::Granting { .. } | Phase::Accepted, Event::Abort(e)) => self.refuse(e),
            // Cancelled while a resume is being acquired: a lease or grant still on its way is
            // given back when it arrives (see the `Phase::Done` arms).
            // The fresh connection is discarded (the driver may have dropped a grant call the
            // peer answered: a disconnect revokes what it granted on it), a grant held is revoked.
            (Phase::Leasing { .. } | Phase::Granting { .. }, Event::Cancel) if self.resume.is_some() => {
                self.resume = None;
                self.release(false);
                self.revoke();
                self.finish(Err(Failure::cancelled()))
            }
            (Phase::Accepted, Event::Cancel) => {
                self.release(true);
                self.revoke();
                self.finish(Err(Failure::cancelled()))
            }

            // ---- moving data
            (Phase::Running(mut m), ev) => {
                match ev {
                    Event::Completion { qp, seq, status } => m.handle_completion(qp, seq, status),
                    Event::PostFailed { seq, reason } => m.handle_post_error(seq, reason),
                    Event::ConnectionClosed => m.handle_post_error(u64::MAX, "connection closed".into()),
                    Event::Cancel => m.handle_cancel(),
                    _ => {}
                }
                self.phase = Phase::Running(m);
                self.after_machine();
                std::mem::replace(&mut self.phase, Phase::Done)
            }

            // ---- after the data: check, verify, complete
            (Phase::Checking(_), Event::LocalChecked(Err(why))) => {
                self.release(false);
                self.revoke();
                self.finish(Err(Failure::new(FailureCode::RegionPoisoned, why)))
            }
            (Phase::Checking(Err(f)), Event::LocalChecked(Ok(()))) => {
                self.release(false);
                self.revoke();
                self.finish(Err(f))
            }
            (Phase::Checking(Ok(())), Event::LocalChecked(Ok(()))) => {
                if self.cfg.verify || self.failed_over {
                    self.out.push_back(Command::Checksum);
                    Phase::Verifying
                } else {
                    self.out.push_back(Command::Complete { checksum: None });
                    Phase::Completing { checksum: None }
                }
            }
            (Phase::Verifying, Event::Checksummed(Ok(sum))) => {
                self.out.push_back(Command::Complete { checksum: Some(sum) });
                Phase::Completing { checksum: Some(sum) }
            }
            (Phase::Verifying, Event::Checksummed(Err(f))) => {
                self.release(true);
                self.revoke();
                self.finish(Err(f))
            }
            (Phase::Completing { checksum }, Event::Completed(r)) => {
                // The connection goes back only now: the grant is bound to it, and a transfer that
                // leased it and then discarded it would make the target revoke this transfer's
                // grant before its Complete arrived.
                self.release(true);
                match r {
                    Ok(matched) => {
                        // The target recorded the transfer and revoked the grant either way.
                        self.granted = false;
                        self.out.push_back(Command::GrantConsumed);
                        self.finish(match matched {
                            true => Ok(checksum),
                            false if self.failed_over && !self.cfg.verify => Err(Failure::new(
                                FailureCode::ChecksumMismatch,
                                "a path failed over mid-transfer and the destination range does not match the source: the failing \
                                 device reported work complete that did not land; run the transfer again",
                            )),
                            false => Err(Failure::new(
                                FailureCode::ChecksumMismatch,
                                "checksum of the destination range does not match the source",
                            )),
                        })
                    }
                    Err(why) => {
                        self.revoke();
                        match checksum {
                            Some(_) => self.finish(Err(Failure::new(FailureCode::VerifyFailed, format!("could not verify: {why}")))),
                            // The data landed; the target just did not record it.
                            None => self.finish(Ok(None)),
                        }
                    }
                }
            }
            // Anything else does not apply in this phase (a cancel after the data landed, a late
            // completion, a duplicate answer): ignored.
            (phase, _) => phase,
        };
    }

    fn accept(&mut self) -> Phase {
        if let Some(r) = self.resume.take() {
            return self.resume_with(r);
        }
        if let Some(b) = &self.cfg.batch {
            // The grant was asked over the batch's remote span; a peer that granted less
            // (its region is shorter) names the first segment it cannot take.
            if let Err(e) = b.check_grant(b.remote_base(), self.grant_len) {
                return self.refuse(Error::Invalid(format!("peer granted {} bytes: {e}", self.grant_len)).into());
            }
            let length = b.bytes();
            self.batch = Some(b.clone());
            self.out.push_back(Command::Accept { length });
            return Phase::Accepted;
        }
        let length = if self.cfg.length == 0 { self.grant_len } else { self.cfg.length };
        let c = &self.cfg;
        let refusal = if self.grant_len < length {
            Some(Error::Invalid(format!("peer granted {} bytes, {} needed", self.grant_len, length)))
        } else if let Err(e) = check_range(&c.local_name, c.local_length, c.local_offset, length) {
            Some(Error::Range(e))
        } else if length == 0 {
            Some(Error::Invalid("zero-length transfer: nothing to copy".into()))
        } else {
            None
        };
        if let Some(e) = refusal {
            return self.refuse(e.into());
        }
        self.batch = Some(Batch::single(c.local_offset, 0, length));
        self.out.push_back(Command::Accept { length });
        Phase::Accepted
    }

    /// Moves on when the machine reached a terminal state.
    fn after_machine(&mut self) {
        let Phase::Running(m) = &self.phase else { return };
        self.bytes_done = self.bytes_base.saturating_add(m.bytes_done());
        if !m.is_done() {
            return;
        }
        if let State::Failed(fault @ Fault::NoPath { .. }) = m.state() {
            // The target counts one marker per QP of the connection; once that many went out it
            // may have published the notification, and a resume would publish it again.
            let may_have_published = self.cfg.markers != Markers::None && m.markers_posted() >= self.qps as u64;
            if self.resumes_left > 0 && !may_have_published {
                let r = resume::Resume { segs: m.unretired().into(), deadline: m.deadline(), failure: failure_of(fault.clone()) };
                self.begin_resume(r);
                return;
            }
        }
        // A batch is compared segment by segment, in order, on both sides (`Peer.Complete`'s spans).
        self.failed_over |= *m.state() == State::Succeeded && m.must_verify();
        let clean = m.outstanding() == 0;
        let next = match m.state().clone() {
            State::Running => return,
            State::Succeeded if clean => Phase::Checking(Ok(())),
            State::Succeeded => Phase::Checking(Err(Failure::new(FailureCode::Internal, "engine stopped with WRs outstanding"))),
            State::Cancelled => {
                self.release(false);
                self.revoke();
                self.phase = self.finish(Err(Failure::cancelled()));
                return;
            }
            State::Failed(fault) => Phase::Checking(Err(failure_of(fault))),
        };
        self.out.push_back(Command::CheckLocal);
        self.phase = next;
    }

    fn release(&mut self, clean: bool) {
        if std::mem::take(&mut self.leased) {
            self.out.push_back(Command::Release { clean });
        }
    }

    fn revoke(&mut self) {
        if std::mem::take(&mut self.granted) {
            self.out.push_back(Command::Revoke);
        }
    }

    fn refuse(&mut self, e: E) -> Phase {
        // Nothing was posted: the connection is as good as it was.
        self.release(true);
        self.revoke();
        self.out.push_back(Command::Refuse(e));
        Phase::Done
    }

    fn finish(&mut self, r: Result<Option<u64>, Failure>) -> Phase {
        self.out.push_back(Command::Finish(r));
        Phase::Done
    }
}

/// The failure a machine fault is reported as (re-exported: the agent names it here).
pub use crate::failure::failure_of;

mod resume;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod resume_tests;

#[cfg(test)]
mod verify_tests;
