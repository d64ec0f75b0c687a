//! Failover inside a transfer: a path that went down gives back every WR no successful
//! completion retired (chunks to the retry queue, markers to the owed count), and post errors
//! either fail the transfer or, when the fabric found the QP broken, take the path down and give
//! the unposted WRs back.
use super::{Fault, Machine, PathDown, PathEvent, State};

impl Machine {
    /// The driver learnt (an async event, a broken QP) that `path` is gone: its WRs go out again
    /// on the paths left, or the transfer fails with [`Fault::NoPath`] when none is.
    pub fn handle_path_down(&mut self, path: usize, reason: PathDown) {
        self.path_down(path, reason);
    }

    /// Posting failed (e.g. the connection closed): fail with the fabric's reason.
    pub fn handle_post_error(&mut self, seq: u64, reason: String) {
        for w in &mut self.windows {
            w.retain(|o| o.chunk.seq != seq);
        }
        if self.state == State::Running {
            self.state = State::Failed(Fault::Post(reason));
        }
    }

    /// Posting failed on QP `qp` and left `seqs` unposted (the refused WR, the rest of its run
    /// and every run queued after it, whichever QP each was for). With `path_failure` (the
    /// fabric found the QP broken) they are taken back first, to go out again wherever there is
    /// room, and then the path of `qp` goes down: only the WRs it had in flight (posted and not
    /// retired) are requeued from it and make it a failover; WRs that never reached its device
    /// were not work redone elsewhere. Without, it fails the transfer as
    /// [`Machine::handle_post_error`] does.
    pub fn handle_post_failure(&mut self, qp: usize, seqs: &[u64], reason: String, path_failure: bool) {
        if !path_failure {
            for &seq in seqs {
                self.handle_post_error(seq, reason.clone());
            }
            return;
        }
        for &seq in seqs {
            self.unpost(seq);
        }
        if let Some(&path) = self.path_of.get(qp) {
            self.path_down(path, PathDown::Post(reason));
        }
    }

    /// Takes `path` down: requeues what it had not retired and records the event.
    pub(super) fn path_down(&mut self, path: usize, reason: PathDown) {
        let Some(slot) = self.paths.get_mut(path) else { return };
        if !slot.up {
            return;
        }
        slot.up = false;
        if self.run.is_some_and(|(q, _)| self.path_of[q] == path) {
            self.run = None;
        }
        // Every WR left in its windows was posted (those a failed post left unposted were taken
        // back first): what the path had in flight.
        let mut requeued = 0u32;
        for &q in &self.paths[path].qps {
            for o in self.windows[q].drain(..) {
                if o.marker {
                    self.owed += 1;
                } else {
                    self.retry.push_back(o.chunk);
                }
                requeued = requeued.saturating_add(1);
            }
            // Its own marker, not yet posted, goes on another QP.
            if !self.marker_sent[q] {
                self.marker_sent[q] = true;
                self.owed += 1;
            }
        }
        self.retry.make_contiguous().sort_unstable_by_key(|c| c.seq);
        let running = self.state == State::Running;
        let left = self.paths_up();
        // A failover is work in flight on the lost path going out again on another.
        if running && requeued > 0 && left > 0 {
            self.failovers += 1;
        }
        if running && self.path_bytes.get(path).is_some_and(|&b| b > 0) {
            self.lost_after_use = true;
        }
        self.events.push_back(PathEvent::Down { path, reason: reason.clone(), requeued });
        if running && left == 0 {
            self.state = State::Failed(Fault::NoPath { last: reason });
        }
    }

    /// WR `seq` was never posted (the post that failed came before it): back to be posted again.
    fn unpost(&mut self, seq: u64) {
        for q in 0..self.windows.len() {
            let Some(pos) = self.windows[q].iter().position(|o| o.chunk.seq == seq) else { continue };
            let Some(o) = self.windows[q].remove(pos) else { return };
            if !o.marker {
                let at = self.retry.partition_point(|c| c.seq < seq);
                self.retry.insert(at, o.chunk);
            } else if seq.checked_sub(self.chunks) == Some(q as u64) && self.paths[self.path_of[q]].up {
                // The QP's own marker, its QP still up: it goes there again.
                self.marker_sent[q] = false;
            } else {
                self.owed += 1;
            }
            return;
        }
    }
}
