//! A session that loses every path: the leased paths reach its machine, and it resumes on a
//! fresh connection and grant (within its allowance, never once the target may have published
//! the notification) with only the chunks not yet retired, verified end to end — or fails with
//! the code that stopped it, everything given back.
use std::time::Instant;

use super::tests::{cfg, run, Command, Event, Faults, Session, Trace};
use super::SessionConfig;
use crate::failure::FailureCode;
use crate::machine::{Markers, Post};
use crate::status::WcStatus;

/// Every byte of `0..len` was retired by a successful completion on some connection.
fn all_landed(t: &Trace, len: u64) -> bool {
    let mut r = t.landed.clone();
    r.sort_unstable();
    let mut end = 0;
    for (start, n) in r {
        if start > end {
            return false;
        }
        end = end.max(start + n);
    }
    end >= len
}

fn flushed(resumes: u32) -> Faults {
    Faults { resumes, flushed_from: Some((0, 4)), ..Default::default() }
}

#[test]
fn a_transfer_that_loses_its_only_path_resumes_with_what_was_left_and_is_verified() {
    for verify in [false, true] {
        let t = run(95, verify, flushed(2));
        assert_eq!(t.finished, Some(Ok(Some(0xfeed))), "verified end to end even unasked: {t:?}");
        assert_eq!((t.resumed, t.leases), (1, 2), "{t:?}");
        assert_eq!(t.releases, vec![false, true], "the flushed connection is discarded, the fresh one kept");
        assert_eq!((t.grants, t.revokes, t.consumed), (2, 1, 1), "the first grant revoked, the second consumed");
        assert_eq!(t.completes, vec![Some(0xfeed)]);
        assert!(all_landed(&t, 95), "{t:?}");
        // The fresh connection moved only what the first one did not retire.
        let second = t.posted.iter().filter(|(c, _)| *c == 1).count();
        assert!(second < 10, "{second} WRs again: {t:?}");
    }
    // Not allowed to resume: it fails as before, with the path's code.
    let t = run(95, false, flushed(0));
    assert_eq!(t.code(), Some(FailureCode::Completion(WcStatus::WrFlushErr)), "{t:?}");
    assert_eq!((t.leases, t.resumed), (1, 0));
}

#[test]
fn resumes_are_bounded_and_a_failed_resume_reports_what_stopped_the_transfer() {
    // A dead peer: every connection dies; two resumes, then RETRY_EXC_ERR.
    let t = run(95, false, Faults { resumes: 2, dead_from: Some(3), ..Default::default() });
    assert_eq!(t.code(), Some(FailureCode::Completion(WcStatus::RetryExcErr)), "{t:?}");
    assert_eq!((t.leases, t.resumed), (3, 2), "{t:?}");
    assert!(t.completes.is_empty(), "no Complete for data that did not land");
    assert_eq!(t.revokes, t.grants);
    // The fresh lease fails: the flush's code, and the message says the resume failed.
    let t = run(95, false, Faults { lease_fails: Some(1), ..flushed(2) });
    match &t.finished {
        Some(Err(f)) => {
            assert_eq!(f.code, FailureCode::Completion(WcStatus::WrFlushErr));
            assert!(f.message.contains("resuming on a fresh connection failed: no connection"), "{f:?}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!((t.grants, t.revokes), (1, 1));
    // The fresh grant fails alike.
    let t = run(95, false, Faults { grant_fails: true, ..flushed(2) });
    assert!(t.refused.is_some(), "the first grant failing is a refusal: {t:?}");
    // A mismatch after a resume says the failing device's completions cannot be trusted.
    let t = run(95, false, Faults { mismatch: true, ..flushed(2) });
    match &t.finished {
        Some(Err(f)) => assert!(f.code == FailureCode::ChecksumMismatch && f.message.contains("failed over"), "{f:?}"),
        other => panic!("{other:?}"),
    }
}

/// A cancel (or abort) before every step of the resume scenarios still ends in one terminal
/// command with everything given back (`run` checks the balance).
#[test]
fn cancel_at_every_step_of_a_resume() {
    let scenarios = [
        flushed(2),
        Faults { resumes: 1, dead_from: Some(2), ..Default::default() },
        Faults { lease_fails: Some(1), ..flushed(1) },
        // The resume's grant comes from a peer that restarted since its connection was made:
        // the session holds that grant while it leases yet another connection.
        Faults { restarted_grant: Some(1), ..flushed(2) },
    ];
    let mut cancelled = 0;
    for base in scenarios {
        let full = run(95, false, base.clone()).steps;
        for k in 1..=full + 1 {
            let t = run(95, false, Faults { cancel_at: Some(k), ..base.clone() });
            if let Some(Err(f)) = &t.finished {
                if f.code == FailureCode::Cancelled {
                    cancelled += 1;
                    assert!(t.completes.is_empty(), "{base:?} at {k}");
                }
            }
        }
    }
    assert!(cancelled > 10, "{cancelled}");
}

/// Drives a session with markers on one path of `qps` QPs; posts what the machine allows
/// (`before_loss` rounds), then loses the path: whether it resumed.
fn markers_then_loss(qps: usize, chunks_posted_all: bool) -> (Session, Vec<Post>) {
    let mut s = Session::new(SessionConfig { resumes: 1, markers: Markers::Pipelined, depth: 16, ..cfg(40, false) });
    assert!(matches!(s.poll(), Some(Command::Lease)));
    s.handle(Event::Leased { qps, reused: false });
    assert!(matches!(s.poll(), Some(Command::AskGrant)));
    s.handle(Event::Granted { length: 40, same_instance: true, conn_broken: false });
    assert!(matches!(s.poll(), Some(Command::Accept { length: 40 })));
    s.start(Instant::now());
    let mut posts = Vec::new();
    while let Some(Command::Post(p)) = s.poll() {
        posts.push(p);
        if !chunks_posted_all && posts.len() == 2 {
            break;
        }
    }
    let first = posts[0];
    s.handle(Event::Completion { qp: first.qp, seq: first.seq, status: WcStatus::WrFlushErr });
    (s, posts)
}

#[test]
fn no_resume_once_the_target_may_have_published_the_notification() {
    // Every chunk and both markers went out: the target may have counted them and published.
    let (mut s, posts) = markers_then_loss(2, true);
    assert_eq!(posts.iter().filter(|p| p.marker).count(), 2, "{posts:?}");
    let cmds: Vec<Command> = std::iter::from_fn(|| s.poll()).collect();
    assert!(matches!(cmds.as_slice(), [Command::CheckLocal]), "no resume: {cmds:?}");
    s.handle(Event::LocalChecked(Ok(())));
    let cmds: Vec<Command> = std::iter::from_fn(|| s.poll()).collect();
    assert!(!cmds.iter().any(|c| matches!(c, Command::Lease)), "{cmds:?}");
    assert!(
        cmds.iter().any(|c| matches!(c, Command::Finish(Err(f)) if f.code == FailureCode::Completion(WcStatus::WrFlushErr))),
        "{cmds:?}"
    );

    // Lost before any marker went out: it resumes, and the resumed machine posts no marker
    // (the target publishes on the matching Complete, which is verified).
    let (mut s, posts) = markers_then_loss(2, false);
    assert!(posts.iter().all(|p| !p.marker));
    let cmds: Vec<Command> = std::iter::from_fn(|| s.poll()).collect();
    assert!(matches!(cmds.as_slice(), [Command::Release { clean: false }, Command::Revoke, Command::Lease]), "{cmds:?}");
    s.handle(Event::Leased { qps: 2, reused: false });
    assert!(matches!(s.poll(), Some(Command::AskGrant)));
    s.handle(Event::Granted { length: 40, same_instance: true, conn_broken: false });
    assert!(matches!(s.poll(), Some(Command::Resumed)));
    let mut again = Vec::new();
    while let Some(Command::Post(p)) = s.poll() {
        again.push(p);
    }
    assert!(!again.is_empty() && again.iter().all(|p| !p.marker), "{again:?}");
    assert_eq!(again.iter().map(|p| p.len as u64).sum::<u64>(), 40, "nothing was retired before the loss");
    for p in again.iter().filter(|p| p.signaled) {
        s.handle(Event::Completion { qp: p.qp, seq: p.seq, status: WcStatus::Success });
    }
    assert_eq!(s.bytes_done(), 40);
    assert!(matches!(s.poll(), Some(Command::CheckLocal)));
    s.handle(Event::LocalChecked(Ok(())));
    assert!(matches!(s.poll(), Some(Command::Checksum)), "a resumed transfer is verified");
}
/// The connection's paths reach the machine the session starts: a standby path gets nothing
/// while the other is up. Every path lost ends the transfer with the last path's code, or
/// NO_PATH when an event took it.
#[test]
fn the_leased_paths_reach_the_machine_and_losing_all_of_them_is_reported() {
    use crate::machine::{Fault, PathDown};
    let started = |path_of: &[usize], weights: Vec<u32>| {
        let mut s = Session::new(cfg(40, false));
        assert!(matches!(s.poll(), Some(Command::Lease)));
        s.handle(Event::Leased { qps: 2, reused: false });
        s.set_paths(path_of.into(), weights);
        assert!(matches!(s.poll(), Some(Command::AskGrant)));
        s.handle(Event::Granted { length: 40, same_instance: true, conn_broken: false });
        assert!(matches!(s.poll(), Some(Command::Accept { length: 40 })));
        s.start(Instant::now());
        s
    };
    let mut s = started(&[0, 1], vec![1, 0]);
    let mut m = s.lend_machine().expect("running");
    let posts: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
    assert!(!posts.is_empty() && posts.iter().all(|p| p.qp == 0), "{posts:?}");
    assert_eq!(m.paths_up(), 2);

    for (reason, code) in [
        (PathDown::Completion(WcStatus::RetryExcErr), FailureCode::Completion(WcStatus::RetryExcErr)),
        (PathDown::Post("QP broken".into()), FailureCode::PostFailed),
        (PathDown::Event("port down".into()), FailureCode::NoPath),
    ] {
        let f = super::failure_of(Fault::NoPath { last: reason });
        assert_eq!(f.code, code);
        assert!(f.message.contains("every path to the peer is down"), "{f:?}");
    }
}

/// A session that lost its only path and is resuming (its first connection released and grant
/// revoked, a fresh lease asked), started at `t0` with the default 30 s timeout.
fn resuming(t0: Instant) -> Session {
    let mut s = Session::new(SessionConfig { resumes: 2, ..cfg(40, false) });
    assert!(matches!(s.poll(), Some(Command::Lease)));
    s.handle(Event::Leased { qps: 1, reused: false });
    assert!(matches!(s.poll(), Some(Command::AskGrant)));
    s.handle(Event::Granted { length: 40, same_instance: true, conn_broken: false });
    assert!(matches!(s.poll(), Some(Command::Accept { length: 40 })));
    s.start(t0);
    let Some(Command::Post(p)) = s.poll() else { panic!("nothing posted: {s:?}") };
    s.handle(Event::Completion { qp: p.qp, seq: p.seq, status: WcStatus::WrFlushErr });
    let cmds: Vec<Command> = std::iter::from_fn(|| s.poll()).collect();
    assert!(matches!(cmds.as_slice(), [Command::Release { clean: false }, Command::Revoke, Command::Lease]), "{cmds:?}");
    s
}

/// The transfer's deadline holds while a resume waits for its connection and grant (a peer slow
/// to answer Connect or Grant): the session says when, and at that time it fails out of time
/// with the lost paths' story, the fresh connection discarded and a grant answered late revoked.
#[test]
fn the_deadline_holds_while_a_resume_acquires() {
    use std::time::Duration;
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(30);
    for granting in [false, true] {
        let mut s = resuming(t0);
        if granting {
            s.handle(Event::Leased { qps: 1, reused: false });
            assert!(matches!(s.poll(), Some(Command::AskGrant)));
        }
        assert_eq!(s.poll_timeout(), Some(deadline), "the resume keeps the transfer's deadline");
        s.handle_timeout(deadline - Duration::from_millis(1));
        assert!(s.poll().is_none(), "not yet");
        s.handle_timeout(deadline);
        let cmds: Vec<Command> = std::iter::from_fn(|| s.poll()).collect();
        let released = cmds.iter().filter(|c| matches!(c, Command::Release { clean: false })).count();
        assert_eq!(released, usize::from(granting), "the fresh connection is discarded: {cmds:?}");
        assert!(!cmds.iter().any(|c| matches!(c, Command::Revoke)), "no grant is held yet: {cmds:?}");
        match cmds.last() {
            Some(Command::Finish(Err(f))) => {
                assert_eq!(f.code, FailureCode::DeadlineExceeded, "{f:?}");
                assert!(f.message.contains("resuming") && f.message.contains("every path to the peer is down"), "{f:?}");
            }
            other => panic!("{other:?}"),
        }
        assert!(s.is_done() && s.poll_timeout().is_none());
        // What was on its way arrives after the end: given straight back.
        s.handle(if granting {
            Event::Granted { length: 40, same_instance: true, conn_broken: false }
        } else {
            Event::Leased { qps: 1, reused: false }
        });
        let late: Vec<Command> = std::iter::from_fn(|| s.poll()).collect();
        assert!(matches!(late.as_slice(), [Command::Revoke] | [Command::Release { clean: true }]), "{late:?}");
    }
}

/// A cancel while the resume acquires discards the fresh connection (the driver drops the call
/// in flight; a grant the peer made on that connection goes with it) and revokes a grant it
/// holds while it leases again (the grant came from a restarted peer).
#[test]
fn a_cancel_while_resuming_gives_back_the_fresh_connection_and_grant() {
    let t0 = Instant::now();
    let mut s = resuming(t0);
    s.handle(Event::Leased { qps: 1, reused: false });
    assert!(matches!(s.poll(), Some(Command::AskGrant)));
    s.handle(Event::Cancel);
    let cmds: Vec<Command> = std::iter::from_fn(|| s.poll()).collect();
    assert!(
        matches!(cmds.as_slice(), [Command::Release { clean: false }, Command::Finish(Err(f))] if f.code == FailureCode::Cancelled),
        "{cmds:?}"
    );
    let mut s = resuming(t0);
    s.handle(Event::Leased { qps: 1, reused: false });
    assert!(matches!(s.poll(), Some(Command::AskGrant)));
    s.handle(Event::Granted { length: 40, same_instance: false, conn_broken: false });
    assert!(matches!(s.poll(), Some(Command::Release { clean: false })));
    assert!(matches!(s.poll(), Some(Command::Lease)));
    s.handle(Event::Cancel);
    let cmds: Vec<Command> = std::iter::from_fn(|| s.poll()).collect();
    assert!(
        matches!(cmds.as_slice(), [Command::Revoke, Command::Finish(Err(f))] if f.code == FailureCode::Cancelled),
        "the restarted peer's grant is revoked: {cmds:?}"
    );
}

/// A READ's markers go out once every chunk is retired (`AfterData`): once they all did, the
/// target may have published, so a loss then is not resumed (it fails with the loss's code,
/// every byte having landed); a loss before the markers is resumed, with none sent again.
#[test]
fn a_read_whose_markers_went_out_does_not_resume() {
    let start = |qps: usize| {
        let mut s = Session::new(SessionConfig { resumes: 2, markers: Markers::AfterData, depth: 16, signal_every: 1, ..cfg(40, false) });
        assert!(matches!(s.poll(), Some(Command::Lease)));
        s.handle(Event::Leased { qps, reused: false });
        assert!(matches!(s.poll(), Some(Command::AskGrant)));
        s.handle(Event::Granted { length: 40, same_instance: true, conn_broken: false });
        assert!(matches!(s.poll(), Some(Command::Accept { length: 40 })));
        s.start(Instant::now());
        s
    };
    let mut s = start(2);
    let data: Vec<Post> = std::iter::from_fn(|| match s.poll() {
        Some(Command::Post(p)) => Some(p),
        _ => None,
    })
    .collect();
    assert!(data.iter().all(|p| !p.marker), "no marker before the data is retired: {data:?}");
    for p in &data {
        s.handle(Event::Completion { qp: p.qp, seq: p.seq, status: WcStatus::Success });
    }
    let markers: Vec<Post> = std::iter::from_fn(|| match s.poll() {
        Some(Command::Post(p)) => Some(p),
        _ => None,
    })
    .collect();
    assert_eq!(markers.iter().filter(|p| p.marker).count(), 2, "{markers:?}");
    s.handle(Event::Completion { qp: markers[0].qp, seq: markers[0].seq, status: WcStatus::WrFlushErr });
    let cmds: Vec<Command> = std::iter::from_fn(|| s.poll()).collect();
    assert!(matches!(cmds.as_slice(), [Command::CheckLocal]), "no resume once every marker went out: {cmds:?}");

    // Lost with the data still out: resumed, and the fresh machine sends no marker.
    let mut s = start(2);
    let Some(Command::Post(p)) = s.poll() else { panic!("nothing posted") };
    s.handle(Event::Completion { qp: p.qp, seq: p.seq, status: WcStatus::WrFlushErr });
    let cmds: Vec<Command> = std::iter::from_fn(|| s.poll()).collect();
    assert!(matches!(cmds.as_slice(), [Command::Release { clean: false }, Command::Revoke, Command::Lease]), "{cmds:?}");
    s.handle(Event::Leased { qps: 2, reused: false });
    assert!(matches!(s.poll(), Some(Command::AskGrant)));
    s.handle(Event::Granted { length: 40, same_instance: true, conn_broken: false });
    assert!(matches!(s.poll(), Some(Command::Resumed)));
    let again: Vec<Post> = std::iter::from_fn(|| match s.poll() {
        Some(Command::Post(p)) => Some(p),
        _ => None,
    })
    .collect();
    for p in &again {
        s.handle(Event::Completion { qp: p.qp, seq: p.seq, status: WcStatus::Success });
    }
    let rest: Vec<Command> = std::iter::from_fn(|| s.poll()).collect();
    assert!(
        again
            .iter()
            .chain(rest.iter().filter_map(|c| match c {
                Command::Post(p) => Some(p),
                _ => None,
            }))
            .all(|p| !p.marker),
        "a resumed READ sends no marker"
    );
    assert_eq!(s.bytes_done(), 40);
}
