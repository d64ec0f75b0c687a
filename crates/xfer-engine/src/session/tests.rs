//! The session against a fault-injecting fake fabric and peer, on virtual time: every fault, and
//! a cancel (or a submit abort) injected before every step, must end in one terminal command with
//! every lease released once and every grant revoked or consumed once.
use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use super::SessionConfig;
use crate::error::Error;
use crate::failure::{Failure, FailureCode};
use crate::machine::Post;
use crate::status::WcStatus;

/// The driver's error in these tests: what the engine refused, or a failure from outside it (a
/// lease or grant the fake peer fails) — the agent's `TransferError` plays this part in product.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(super) enum TestError {
    #[error(transparent)]
    Engine(#[from] Error),
    #[error("{0}")]
    Outside(&'static str),
}

pub(super) type Session = super::Session<TestError>;
pub(super) type Command = super::Command<TestError>;
pub(super) type Event = super::Event<TestError>;

const CHUNK: u64 = 10;

pub(super) fn cfg(length: u64, verify: bool) -> SessionConfig {
    SessionConfig {
        length,
        batch: None,
        markers: crate::machine::Markers::None,
        local_name: "src".into(),
        local_length: 1000,
        local_offset: 0,
        chunk: CHUNK,
        depth: 3,
        signal_every: 2,
        verify,
        timeout: Duration::from_secs(30),
        resumes: 0,
    }
}

/// Faults the fake world injects.
#[derive(Debug, Clone, Default)]
pub(super) struct Faults {
    /// The first lease comes from the idle pool.
    pub(super) pooled: bool,
    /// The peer does not know the pooled connection (grant → unknown connection).
    pub(super) peer_forgot_pooled: bool,
    /// The pooled connection broke while the grant was asked.
    pub(super) pooled_broke: bool,
    /// The first grant comes from a restarted peer (new instance).
    pub(super) peer_restarted: bool,
    /// Grant attempt n (0-based) comes from an instance other than its connection's.
    pub(super) restarted_grant: Option<usize>,
    /// Lease attempt number n (0-based) fails.
    pub(super) lease_fails: Option<usize>,
    pub(super) grant_fails: bool,
    /// Bytes the peer grants (None = what was asked).
    pub(super) grant_len: Option<u64>,
    /// This WR's completion is never delivered (a dropped packet the fabric never reports).
    pub(super) drop_seq: Option<u64>,
    /// Completions arrive this many steps late (others keep flowing).
    pub(super) delay: usize,
    /// From this WR on, the peer is dead: RETRY_EXC_ERR, and Complete fails.
    pub(super) dead_from: Option<u64>,
    /// From this WR on, the grant is revoked: REM_ACCESS_ERR.
    pub(super) revoked_from: Option<u64>,
    /// Posting this WR fails.
    pub(super) post_fails: Option<u64>,
    /// The completion channel closes after this many completions.
    pub(super) closes_after: Option<usize>,
    /// The local file shrank.
    pub(super) file_shrank: bool,
    pub(super) checksum_fails: bool,
    pub(super) mismatch: bool,
    pub(super) complete_fails: bool,
    /// Feed `Event::Cancel` (or `Event::Abort` before Accept) before step n.
    pub(super) cancel_at: Option<usize>,
    /// Resumes the session may make ([`SessionConfig::resumes`]).
    pub(super) resumes: u32,
    /// On the connection of lease n (0-based), every WR from this one on is flushed
    /// (WR_FLUSH_ERR, as Soft-RoCE does under load with no port event): its one path is lost.
    pub(super) flushed_from: Option<(usize, u64)>,
}

#[derive(Debug, Default)]
pub(super) struct Trace {
    pub(super) leases: usize,
    pub(super) releases: Vec<bool>,
    pub(super) grants: usize,
    pub(super) revokes: usize,
    pub(super) consumed: usize,
    /// (lease, seq) of every WR posted: a resumed machine numbers its chunks afresh.
    pub(super) posted: BTreeSet<(usize, u64)>,
    /// Local ranges a successful completion retired (its own and the silent WRs before it).
    pub(super) landed: Vec<(u64, u64)>,
    pub(super) resumed: usize,
    pub(super) completes: Vec<Option<u64>>,
    pub(super) accepted: Option<u64>,
    pub(super) refused: Option<String>,
    pub(super) finished: Option<Result<Option<u64>, Failure>>,
    pub(super) steps: usize,
}

impl Trace {
    fn balanced(&self) {
        assert_eq!(self.releases.len(), self.leases, "every lease released exactly once: {self:?}");
        assert_eq!(self.revokes + self.consumed, self.grants, "every grant revoked or consumed exactly once: {self:?}");
        assert!(self.refused.is_some() != self.finished.is_some(), "exactly one terminal command: {self:?}");
        assert!(self.accepted.is_some() || self.finished.is_none(), "finished without being accepted");
    }

    pub(super) fn code(&self) -> Option<FailureCode> {
        match &self.finished {
            Some(Err(f)) => Some(f.code),
            _ => None,
        }
    }
}

/// A posted WR awaiting delivery: its seq, local range, whether signaled, and the step it is due.
type OnWire = (u64, (u64, u64), bool, usize);

/// Runs a session to its end in a fake world; virtual time starts at `t0` and advances 1 ms per
/// step, or jumps to the session's deadline when nothing else can happen.
pub(super) fn run(length: u64, verify: bool, f: Faults) -> Trace {
    let t0 = Instant::now();
    let mut now = t0;
    let mut s = Session::new(SessionConfig { resumes: f.resumes, ..cfg(length, verify) });
    let mut t = Trace::default();
    let mut lease_attempts = 0;
    let mut grant_attempts = 0;
    // Posted WRs per QP awaiting delivery: (seq, local range, signaled, step due); and per QP
    // the silent WRs delivered since its last signaled one.
    let mut wire: Vec<VecDeque<OnWire>> = Vec::new();
    let mut silent: Vec<Vec<(u64, u64)>> = Vec::new();
    let mut delivered = 0usize;
    let mut events: VecDeque<Event> = VecDeque::new();
    let mut closed = false;
    loop {
        t.steps += 1;
        assert!(t.steps < 10_000, "session does not terminate: {s:?}");
        if f.cancel_at == Some(t.steps) {
            if t.accepted.is_some() {
                s.handle(Event::Cancel);
            } else {
                s.handle(Event::Abort(TestError::Outside("agent is shutting down")));
            }
        }
        while let Some(c) = s.poll() {
            match c {
                Command::Lease => {
                    let n = lease_attempts;
                    lease_attempts += 1;
                    if f.lease_fails == Some(n) {
                        events.push_back(Event::LeaseFailed(TestError::Outside("no connection")));
                    } else {
                        t.leases += 1;
                        events.push_back(Event::Leased { qps: 2, reused: f.pooled && n == 0 });
                    }
                }
                Command::AskGrant => {
                    let n = grant_attempts;
                    grant_attempts += 1;
                    let stale = f.pooled && n == 0;
                    if f.grant_fails {
                        events.push_back(Event::GrantFailed(TestError::Outside("region not found")));
                    } else if stale && f.peer_forgot_pooled {
                        events.push_back(Event::GrantUnknownConnection(TestError::Outside("unknown connection")));
                    } else {
                        t.grants += 1;
                        events.push_back(Event::Granted {
                            length: f.grant_len.unwrap_or(if length == 0 { 77 } else { length }),
                            same_instance: !(f.peer_restarted && n == 0) && f.restarted_grant != Some(n),
                            conn_broken: stale && f.pooled_broke,
                        });
                    }
                }
                Command::Release { clean } => {
                    t.releases.push(clean);
                    // The connection is gone, and its completions with it.
                    wire.clear();
                    silent.clear();
                }
                Command::Resumed => t.resumed += 1,
                Command::Revoke => t.revokes += 1,
                Command::GrantConsumed => t.consumed += 1,
                Command::Accept { length } => {
                    t.accepted = Some(length);
                    s.start(now);
                }
                Command::Refuse(e) => t.refused = Some(e.to_string()),
                Command::Post(p) => {
                    let conn = t.leases - 1;
                    assert!(t.posted.insert((conn, p.seq)), "chunk {} posted twice on one connection", p.seq);
                    assert_eq!(p.local, p.remote, "one range: local and remote offsets are the same here");
                    if t.resumed == 0 {
                        assert_eq!(p.local, p.seq * CHUNK);
                    }
                    if f.post_fails == Some(p.seq) {
                        events.push_back(Event::PostFailed { seq: p.seq, reason: "QP in error".into() });
                        continue;
                    }
                    if wire.len() <= p.qp {
                        wire.resize(p.qp + 1, VecDeque::new());
                    }
                    wire[p.qp].push_back((p.seq, (p.local, p.len as u64), p.signaled, t.steps + f.delay));
                }
                Command::CheckLocal => events.push_back(Event::LocalChecked(match f.file_shrank {
                    true => Err("file shrank".into()),
                    false => Ok(()),
                })),
                Command::Checksum => events.push_back(Event::Checksummed(match f.checksum_fails {
                    true => Err(Failure::new(FailureCode::RegionPoisoned, "poisoned")),
                    false => Ok(0xfeed),
                })),
                Command::Complete { checksum } => {
                    t.completes.push(checksum);
                    let dead = f.dead_from.is_some();
                    events.push_back(Event::Completed(match (f.complete_fails || dead, f.mismatch) {
                        (true, _) => Err("peer unreachable".into()),
                        (false, m) => Ok(!m),
                    }));
                }
                Command::Finish(r) => t.finished = Some(r),
            }
        }
        if let Some(ev) = events.pop_front() {
            s.handle(ev);
            continue;
        }
        if s.is_done() {
            break;
        }
        // The fabric: deliver the due signaled completions, in order per QP.
        let mut progressed = false;
        if silent.len() < wire.len() {
            silent.resize(wire.len(), Vec::new());
        }
        let conn = t.leases.saturating_sub(1);
        for (qp, q) in wire.iter_mut().enumerate() {
            while let Some(&(seq, range, signaled, due)) = q.front() {
                if due > t.steps {
                    break;
                }
                q.pop_front();
                if !signaled || f.drop_seq == Some(seq) {
                    silent[qp].push(range);
                    continue; // silent (retired by a later signaled one) or lost
                }
                if f.closes_after == Some(delivered) && !closed {
                    closed = true;
                    events.push_back(Event::ConnectionClosed);
                    progressed = true;
                    break;
                }
                delivered += 1;
                let status = if f.flushed_from.is_some_and(|(c, from)| c == conn && seq >= from) {
                    WcStatus::WrFlushErr
                } else if f.dead_from.is_some_and(|d| seq >= d) {
                    WcStatus::RetryExcErr
                } else if f.revoked_from.is_some_and(|r| seq >= r) {
                    WcStatus::RemAccessErr
                } else {
                    WcStatus::Success
                };
                let retired = std::mem::take(&mut silent[qp]);
                if status.is_success() {
                    t.landed.extend(retired);
                    t.landed.push(range);
                }
                events.push_back(Event::Completion { qp, seq, status });
                progressed = true;
            }
        }
        if progressed {
            continue;
        }
        if wire.iter().any(|q| !q.is_empty()) {
            now += Duration::from_millis(1);
            continue; // delayed completions are on their way
        }
        // Nothing will happen unless time passes: jump to the deadline (virtual time).
        match s.poll_timeout() {
            Some(d) => {
                now = d;
                s.handle_timeout(now);
            }
            None => panic!("session stuck with nothing to wait for: {s:?}"),
        }
    }
    t.balanced();
    t
}

#[test]
fn a_clean_write_lands_completes_and_gives_everything_back() {
    for verify in [false, true] {
        let t = run(95, verify, Faults::default());
        assert_eq!(t.finished, Some(Ok(verify.then_some(0xfeed))));
        assert_eq!(t.posted.len(), 10, "95 bytes in 10-byte chunks");
        assert_eq!(t.completes, vec![verify.then_some(0xfeed)]);
        assert_eq!(t.releases, vec![true], "clean connection back to the pool");
        assert_eq!((t.grants, t.consumed, t.revokes), (1, 1, 0), "the target's Complete took the grant");
    }
}

#[test]
fn a_read_of_the_rest_takes_the_granted_length() {
    let t = run(0, false, Faults::default());
    assert_eq!(t.accepted, Some(77));
    assert_eq!(t.posted.len(), 8);
}

#[test]
fn submit_refusals_give_back_what_was_taken() {
    let t = run(95, false, Faults { grant_len: Some(50), ..Default::default() });
    assert!(t.refused.as_deref().is_some_and(|e| e.contains("granted 50 bytes, 95 needed")), "{t:?}");
    assert_eq!((t.releases.len(), t.revokes), (1, 1));
    let t = run(2000, false, Faults::default());
    assert!(t.refused.as_deref().is_some_and(|e| e.contains("outside region")), "{t:?}");
    let t = run(0, false, Faults { grant_len: Some(0), ..Default::default() });
    assert!(t.refused.as_deref().is_some_and(|e| e.contains("zero-length")), "{t:?}");
    let t = run(95, false, Faults { lease_fails: Some(0), ..Default::default() });
    assert_eq!((t.leases, t.grants), (0, 0));
    assert!(t.refused.is_some());
    let t = run(95, false, Faults { grant_fails: true, ..Default::default() });
    assert_eq!(t.releases, vec![true], "the connection is fine: back to the pool");
    assert!(t.refused.as_deref().is_some_and(|e| e.contains("region")), "{t:?}");
}

#[test]
fn a_stale_pooled_connection_is_replaced_once() {
    // The peer forgot the pooled connection: a fresh one is negotiated, and the transfer runs.
    let t = run(95, false, Faults { pooled: true, peer_forgot_pooled: true, ..Default::default() });
    assert_eq!(t.finished, Some(Ok(None)));
    assert_eq!(t.leases, 2);
    assert_eq!(t.releases, vec![false, true], "the stale one is discarded, the fresh one kept");
    // It broke while granting: its grant is revoked too.
    let t = run(95, false, Faults { pooled: true, pooled_broke: true, ..Default::default() });
    assert_eq!(t.finished, Some(Ok(None)));
    assert_eq!((t.grants, t.revokes, t.consumed), (2, 1, 1));
    // The peer restarted: the grant is kept, the connection replaced.
    let t = run(95, false, Faults { pooled: true, peer_restarted: true, ..Default::default() });
    assert_eq!(t.finished, Some(Ok(None)));
    assert_eq!((t.leases, t.grants), (2, 1));
    // ... and if the fresh lease fails, the kept grant is revoked.
    let t = run(95, false, Faults { pooled: true, peer_restarted: true, lease_fails: Some(1), ..Default::default() });
    assert!(t.refused.is_some());
    assert_eq!((t.grants, t.revokes), (1, 1));
    // A fresh connection the peer does not know is not retried.
    let t = run(95, false, Faults { peer_forgot_pooled: true, ..Default::default() });
    assert_eq!(t.finished, Some(Ok(None)), "only a pooled connection can be stale");
}

#[test]
fn data_path_faults_fail_with_their_code_and_revoke() {
    use FailureCode as C;
    let cases: Vec<(Faults, C)> = vec![
        (Faults { dead_from: Some(3), ..Default::default() }, C::Completion(WcStatus::RetryExcErr)),
        (Faults { revoked_from: Some(5), ..Default::default() }, C::Completion(WcStatus::RemAccessErr)),
        (Faults { post_fails: Some(4), ..Default::default() }, C::PostFailed),
        (Faults { closes_after: Some(1), ..Default::default() }, C::PostFailed),
        // The last WR's completion never comes (an earlier lost one is covered by a later one).
        (Faults { drop_seq: Some(9), ..Default::default() }, C::DeadlineExceeded),
        (Faults { file_shrank: true, ..Default::default() }, C::RegionPoisoned),
        (Faults { file_shrank: true, dead_from: Some(0), ..Default::default() }, C::RegionPoisoned),
        (Faults { checksum_fails: true, ..Default::default() }, C::RegionPoisoned),
        (Faults { mismatch: true, ..Default::default() }, C::ChecksumMismatch),
        (Faults { complete_fails: true, ..Default::default() }, C::VerifyFailed),
    ];
    for (f, want) in cases {
        let t = run(95, true, f.clone());
        assert_eq!(t.code(), Some(want), "{f:?}: {t:?}");
        assert!(t.releases.iter().all(|c| !c) || matches!(want, C::RegionPoisoned | C::ChecksumMismatch | C::VerifyFailed), "{f:?}: {t:?}");
        let after_data =
            matches!(want, C::ChecksumMismatch | C::VerifyFailed) || f.checksum_fails || (f.file_shrank && f.dead_from.is_none());
        let data_failed = !after_data;
        if data_failed {
            assert!(t.completes.is_empty(), "no Peer.Complete for data that did not land: {f:?}");
            assert_eq!(t.revokes, 1, "{f:?}");
        }
    }
    // Without verification a failed Complete does not fail the transfer: the data landed.
    let t = run(95, false, Faults { complete_fails: true, ..Default::default() });
    assert_eq!(t.finished, Some(Ok(None)));
    assert_eq!(t.revokes, 1, "and the grant is revoked");
}

#[test]
fn late_completions_and_delays_do_not_change_the_result() {
    for delay in [0, 1, 2, 5, 17] {
        let t = run(95, false, Faults { delay, ..Default::default() });
        assert_eq!(t.finished, Some(Ok(None)), "delay {delay}");
        assert_eq!(t.posted.len(), 10);
    }
}

/// Cancel (after Accept) or abort (before) injected before every step of every scenario: the
/// session always ends, gives everything back, and a cancel before the data landed means
/// CANCELLED with no `Peer.Complete`.
#[test]
fn cancel_at_every_step_of_every_scenario() {
    let scenarios = [
        Faults::default(),
        Faults { delay: 3, ..Default::default() },
        Faults { pooled: true, peer_forgot_pooled: true, ..Default::default() },
        Faults { pooled: true, pooled_broke: true, ..Default::default() },
        Faults { pooled: true, peer_restarted: true, ..Default::default() },
        Faults { dead_from: Some(4), ..Default::default() },
        Faults { revoked_from: Some(2), ..Default::default() },
        Faults { drop_seq: Some(5), ..Default::default() },
        Faults { mismatch: true, ..Default::default() },
        Faults { complete_fails: true, ..Default::default() },
    ];
    let mut cancelled = 0;
    for base in scenarios {
        let full = run(95, true, base.clone()).steps;
        for k in 1..=full + 1 {
            let t = run(95, true, Faults { cancel_at: Some(k), ..base.clone() });
            match (&t.refused, &t.finished) {
                (Some(_), None) => assert!(t.accepted.is_none() || t.posted.is_empty(), "{base:?} at {k}"),
                (None, Some(Err(f))) if f.code == FailureCode::Cancelled => {
                    cancelled += 1;
                    assert!(t.completes.is_empty(), "a cancelled transfer sends no Complete: {base:?} at {k}");
                    assert_eq!(t.revokes, t.grants, "{base:?} at {k}");
                }
                (None, Some(_)) => {} // the cancel came after the data landed, or after a failure
                _ => unreachable!(),
            }
        }
    }
    assert!(cancelled > 20, "cancels landed mid-transfer: {cancelled}");
}

#[test]
fn events_after_the_end_are_ignored() {
    let mut s = Session::new(cfg(10, false));
    assert!(matches!(s.poll(), Some(Command::Lease)));
    s.handle(Event::LeaseFailed(TestError::Outside("x")));
    assert!(matches!(s.poll(), Some(Command::Refuse(_))));
    assert!(s.is_done());
    s.handle(Event::Cancel);
    s.handle(Event::Completion { qp: 0, seq: 0, status: WcStatus::Success });
    s.start(Instant::now());
    assert!(s.poll().is_none());
    // A lease or grant that arrives late is given back at once.
    s.handle(Event::Leased { qps: 1, reused: false });
    s.handle(Event::Granted { length: 10, same_instance: true, conn_broken: false });
    assert!(matches!(s.poll(), Some(Command::Release { clean: true })));
    assert!(matches!(s.poll(), Some(Command::Revoke)));
    assert!(s.poll().is_none());
    assert!(s.is_done());
}

/// A batch session: the grant must span the segments (a shorter one is refused naming the
/// segment, with everything given back), the machine posts each segment's chunks to their own
/// places, and with markers every QP ends in one before the data counts as landed.
#[test]
fn a_batch_posts_its_segments_and_ends_every_qp_with_a_marker() {
    use crate::batch::{Batch, Dest, SegmentSpec};
    use crate::machine::Markers;
    let specs = [
        SegmentSpec { local: 0, remote: 500, len: 25 },
        SegmentSpec { local: 100, remote: 300, len: 10 },
        SegmentSpec { local: 40, remote: 700, len: 5 },
    ];
    let batch = Batch::new(&specs, "src", 1000, Dest::Remote, 16).unwrap();
    assert_eq!((batch.remote_base(), batch.remote_span()), (300, 405));
    let new = || {
        let mut c = cfg(0, false);
        c.batch = Some(batch.clone());
        c.markers = Markers::Pipelined;
        Session::new(c)
    };
    let drain = |s: &mut Session| std::iter::from_fn(|| s.poll()).collect::<Vec<Command>>();

    // Granted less than the span: refused, naming the segment, and both given back.
    let mut s = new();
    assert!(matches!(drain(&mut s)[..], [Command::Lease]));
    s.handle(Event::Leased { qps: 2, reused: false });
    assert!(matches!(drain(&mut s)[..], [Command::AskGrant]));
    s.handle(Event::Granted { length: 404, same_instance: true, conn_broken: false });
    let out = drain(&mut s);
    assert!(matches!(out[..], [Command::Release { clean: true }, Command::Revoke, Command::Refuse(_)]), "{out:?}");
    let Command::Refuse(e) = &out[2] else { unreachable!() };
    assert!(e.to_string().contains("segment 2"), "{e}");

    // The whole span granted: accepted with the batch's bytes, then every segment's chunks.
    let mut s = new();
    drain(&mut s);
    s.handle(Event::Leased { qps: 2, reused: false });
    drain(&mut s);
    s.handle(Event::Granted { length: 405, same_instance: true, conn_broken: false });
    assert!(matches!(drain(&mut s)[..], [Command::Accept { length: 40 }]));
    s.start(Instant::now());
    // The fabric completes every signaled WR after each round of posts (depth 3 on 2 QPs keeps
    // one QP's marker waiting for room).
    let mut posts: Vec<Post> = Vec::new();
    let mut checked = false;
    for _ in 0..10 {
        let round: Vec<Post> = drain(&mut s)
            .into_iter()
            .filter_map(|c| match c {
                Command::Post(p) => Some(p),
                Command::CheckLocal => {
                    checked = true;
                    None
                }
                other => panic!("{other:?}"),
            })
            .collect();
        if checked {
            break;
        }
        for p in round.iter().filter(|p| p.signaled) {
            s.handle(Event::Completion { qp: p.qp, seq: p.seq, status: WcStatus::Success });
        }
        posts.extend(round);
    }
    assert!(checked, "the data never landed: {posts:?}");
    let data: Vec<(u64, u64, u32)> = posts.iter().filter(|p| !p.marker).map(|p| (p.local, p.remote, p.len)).collect();
    assert_eq!(data, vec![(0, 200, 10), (10, 210, 10), (20, 220, 5), (100, 0, 10), (40, 400, 5)]);
    let mut markers: Vec<usize> = posts.iter().filter(|p| p.marker).map(|p| p.qp).collect();
    markers.sort_unstable();
    assert_eq!(markers, vec![0, 1], "one marker per QP");
    for q in 0..2 {
        assert!(posts.iter().rfind(|p| p.qp == q).is_some_and(|p| p.marker), "QP {q} ends in its marker");
    }
    assert_eq!(s.bytes_done(), 40);
}

/// The running machine can be lent to a driver (the data-path worker) only when no command is
/// waiting; while lent the session is inert (no commands, no deadline, events ignored); given
/// back finished, the session moves on exactly as if it had run the machine itself: the local
/// check, then Complete; given back failed, it releases the connection unclean and revokes.
#[test]
fn a_lent_machine_comes_back_and_the_session_moves_on() {
    for fail in [false, true] {
        let mut s = Session::new(cfg(40, false));
        assert!(s.lend_machine().is_none(), "nothing runs before the start");
        assert!(matches!(s.poll(), Some(Command::Lease)));
        s.handle(Event::Leased { qps: 1, reused: false });
        assert!(matches!(s.poll(), Some(Command::AskGrant)));
        s.handle(Event::Granted { length: 40, same_instance: true, conn_broken: false });
        assert!(matches!(s.poll(), Some(Command::Accept { length: 40 })));
        let t0 = Instant::now();
        s.start(t0);
        assert!(s.poll_timeout().is_some());
        let mut m = s.lend_machine().expect("running, nothing waiting");
        assert!(s.lend_machine().is_none(), "lent once");
        assert!(s.poll().is_none() && s.poll_timeout().is_none() && !s.is_done());
        s.handle(Event::Cancel);
        // The driver runs the machine: 4 chunks of 10 on one QP (depth 3, signal every 2).
        let mut posted = Vec::new();
        while !m.is_done() {
            while let Some(p) = m.poll_transmit() {
                posted.push(p);
            }
            // The oldest signaled WR (a device reports a QP's signaled WRs in order); it and
            // the silent ones before it on its QP are done.
            let i = posted.iter().position(|p| p.signaled).unwrap();
            let p = posted[i];
            let status = if fail { WcStatus::RemAccessErr } else { WcStatus::Success };
            m.handle_completion(p.qp, p.seq, status);
            let mut k = 0;
            posted.retain(|q| {
                k += 1;
                !(q.qp == p.qp && k <= i + 1)
            });
        }
        s.return_machine(m);
        if fail {
            assert!(matches!(s.poll(), Some(Command::CheckLocal)));
            s.handle(Event::LocalChecked(Ok(())));
            assert!(matches!(s.poll(), Some(Command::Release { clean: false })));
            assert!(matches!(s.poll(), Some(Command::Revoke)));
            assert!(
                matches!(s.poll(), Some(Command::Finish(Err(f))) if f.code == FailureCode::Completion(WcStatus::RemAccessErr)),
                "the lent machine's fault is the transfer's"
            );
        } else {
            assert_eq!(s.bytes_done(), 40, "the cancel fed while lent was ignored");
            assert!(matches!(s.poll(), Some(Command::CheckLocal)));
            s.handle(Event::LocalChecked(Ok(())));
            assert!(matches!(s.poll(), Some(Command::Complete { checksum: None })));
        }
    }
}
