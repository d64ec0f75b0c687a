//! A session whose data phase failed over verifies its range or batch end to end before it
//! succeeds.
use std::time::Instant;

use super::tests::{cfg, Command, Event, Session};
use crate::failure::FailureCode;
use crate::machine::Post;
use crate::status::WcStatus;

/// A data phase that succeeded after a path failed over is verified end to end although the
/// caller did not ask: a failing device may have reported work complete that did not land. A
/// match finishes with the checksum; a mismatch fails CHECKSUM_MISMATCH and says why. A batch is
/// verified alike (its segments in order on both sides); without a failover nothing is.
#[test]
fn a_transfer_that_failed_over_is_verified_and_a_mismatch_fails_it() {
    use crate::batch::{Batch, Dest, SegmentSpec};
    use crate::machine::PathDown;
    let landed = |batch: bool, fail_over: bool| {
        let mut c = cfg(40, false);
        if batch {
            c.batch = Some(Batch::new(&[SegmentSpec { local: 0, remote: 0, len: 40 }], "src", 1000, Dest::Remote, 16).unwrap());
        }
        let mut s = Session::new(c);
        assert!(matches!(s.poll(), Some(Command::Lease)));
        s.handle(Event::Leased { qps: 2, reused: false });
        s.set_paths([0usize, 1].into(), vec![1, 1]);
        assert!(matches!(s.poll(), Some(Command::AskGrant)));
        s.handle(Event::Granted { length: 40, same_instance: true, conn_broken: false });
        assert!(matches!(s.poll(), Some(Command::Accept { length: 40 })));
        s.start(Instant::now());
        let mut m = s.lend_machine().expect("running");
        let mut posted: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
        if fail_over {
            assert!(posted.iter().any(|p| p.qp == 1), "{posted:?}");
            m.handle_path_down(1, PathDown::Event("port down".into()));
        }
        while !m.is_done() {
            posted.extend(std::iter::from_fn(|| m.poll_transmit()));
            let i = posted.iter().position(|p| p.signaled && m.path_is_up(usize::from(p.qp == 1))).expect("a signaled WR on a live path");
            let p = posted.remove(i);
            posted.retain(|q| q.qp != p.qp || q.seq > p.seq);
            m.handle_completion(p.qp, p.seq, WcStatus::Success);
        }
        assert_eq!(m.state(), &crate::machine::State::Succeeded);
        s.return_machine(m);
        assert!(matches!(s.poll(), Some(Command::CheckLocal)));
        s.handle(Event::LocalChecked(Ok(())));
        s
    };
    for batch in [false, true] {
        let mut s = landed(batch, false);
        assert!(matches!(s.poll(), Some(Command::Complete { checksum: None })), "batch {batch}: no failover, no verify");
    }
    for (batch, matched) in [(false, true), (false, false), (true, true), (true, false)] {
        let mut s = landed(batch, true);
        assert!(matches!(s.poll(), Some(Command::Checksum)), "a failed-over transfer is verified");
        s.handle(Event::Checksummed(Ok(7)));
        assert!(matches!(s.poll(), Some(Command::Complete { checksum: Some(7) })));
        s.handle(Event::Completed(Ok(matched)));
        let end = std::iter::from_fn(|| s.poll()).find_map(|c| match c {
            Command::Finish(r) => Some(r),
            _ => None,
        });
        match end {
            Some(Ok(Some(7))) if matched => {}
            Some(Err(f)) if !matched => {
                assert_eq!(f.code, FailureCode::ChecksumMismatch);
                assert!(f.message.contains("a path failed over mid-transfer"), "{f:?}");
            }
            other => panic!("batch {batch}, matched {matched}: {other:?}"),
        }
    }
}
