//! Resuming a transfer that lost every path: the connection and grant are given back, fresh
//! ones are acquired, and a machine over the chunks no successful completion retired moves on
//! (see the session's docs for when it applies).
use std::sync::Arc;
use std::time::Instant;

use super::{Command, Phase, Session};
use crate::error::Error;
use crate::failure::{Failure, FailureCode};
use crate::machine::{Machine, MachineConfig, Markers};

/// A resume being acquired: what its machine will move, by when, and what the transfer fails
/// with if no fresh connection and grant can be had.
#[derive(Debug)]
pub(super) struct Resume {
    pub segs: Arc<[crate::batch::Seg]>,
    pub deadline: Option<Instant>,
    pub failure: Failure,
}

impl<E: From<Error> + std::fmt::Display> Session<E> {
    /// Every path was lost: gives the connection and grant back and asks for fresh ones.
    pub(super) fn begin_resume(&mut self, r: Resume) {
        self.resumes_left -= 1;
        self.resumed += 1;
        self.bytes_base = self.bytes_done;
        // Whatever the old paths reported retired is proven only by the checksum.
        self.failed_over = true;
        self.release(false);
        self.revoke();
        self.resume = Some(r);
        self.out.push_back(Command::Lease);
        self.phase = Phase::Leasing { have_grant: false, retried: false };
    }

    /// The fresh connection and grant are held: the data phase goes on with what is left.
    pub(super) fn resume_with(&mut self, r: Resume) -> Phase {
        let fits = match &self.batch {
            Some(b) if self.cfg.batch.is_some() => b.check_grant(b.remote_base(), self.grant_len).is_ok(),
            Some(b) => self.grant_len >= b.bytes(),
            None => false,
        };
        if !fits {
            let why = format!("the fresh grant has {} bytes, less than the transfer's", self.grant_len);
            return self.resume_failed(&why);
        }
        let m = Machine::new(MachineConfig {
            segs: r.segs,
            // The target publishes the notification on the matching Complete (always verified).
            markers: Markers::None,
            chunk: self.cfg.chunk,
            qps: self.qps,
            depth: self.cfg.depth,
            signal_every: self.cfg.signal_every,
            deadline: r.deadline,
            path_of: self.path_of.clone(),
            weights: self.weights.clone(),
        });
        self.out.push_back(Command::Resumed);
        self.phase = Phase::Running(Box::new(m));
        self.after_machine();
        std::mem::replace(&mut self.phase, Phase::Done)
    }

    /// The transfer's deadline passed while a resume was acquiring its connection and grant (a
    /// peer slow to answer them): it fails as a transfer out of time does, everything given back.
    pub(super) fn resume_timed_out(&mut self, now: Instant) {
        if !matches!(self.phase, Phase::Leasing { .. } | Phase::Granting { .. }) {
            return;
        }
        let Some(r) = self.resume.take_if(|r| r.deadline.is_some_and(|d| now >= d)) else { return };
        self.release(false);
        self.revoke();
        let why = format!("transfer timed out while resuming on a fresh connection, after: {}", r.failure.message);
        self.phase = self.finish(Err(Failure::new(FailureCode::DeadlineExceeded, why)));
    }

    /// No fresh connection or grant for a resume: the transfer fails as the lost paths made it.
    pub(super) fn resume_failed(&mut self, why: &dyn std::fmt::Display) -> Phase {
        self.release(false);
        self.revoke();
        let mut f = match self.resume.take() {
            Some(r) => r.failure,
            None => Failure::new(FailureCode::NoPath, "every path to the peer is down"),
        };
        f.message = format!("{}; resuming on a fresh connection failed: {why}", f.message);
        self.finish(Err(f))
    }
}
