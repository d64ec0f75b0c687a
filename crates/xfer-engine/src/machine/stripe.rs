//! Striping: which path and QP a new run goes to. Among the paths that are up and have a QP with
//! room, the one that was given the fewest bytes per unit of weight so far (weighted fair
//! queueing over runs); weight-0 paths only while no positive-weight path is up. Inside the
//! path, the QP with the most free slots, ties from `next_qp` on.
//!
//! Only paths with room compete: a path whose windows are full waits for its completions, and
//! the others carry on. So when windows are the limit, each path carries what its completions
//! clock (its real rate), and the weights split the runs whenever several paths could take one.
use super::Machine;

impl Machine {
    /// The QP for a new run and its free slots, if any usable path has room.
    pub(super) fn pick(&self) -> Option<(usize, usize)> {
        let standby_only = !self.paths.iter().any(|s| s.up && s.weight > 0);
        // (path, bytes assigned, weight)
        let mut best: Option<(usize, u64, u64)> = None;
        for (p, s) in self.paths.iter().enumerate() {
            if !s.up || (s.weight == 0 && !standby_only) || !s.qps.iter().any(|&q| self.room(q) > 0) {
                continue;
            }
            let w = u64::from(s.weight.max(1));
            // Fewer bytes per weight: a/wa < b/wb, cross-multiplied (exact, no overflow in u128).
            let better = best.is_none_or(|(_, ba, bw)| u128::from(s.assigned) * u128::from(bw) < u128::from(ba) * u128::from(w));
            if better {
                best = Some((p, s.assigned, w));
            }
        }
        let (path, _, _) = best?;
        self.roomiest_in(path)
    }

    /// The QP of `path` with the most free window slots (ties: the first from `next_qp` on).
    fn roomiest_in(&self, path: usize) -> Option<(usize, usize)> {
        let n = self.cfg.qps;
        let mut best: Option<(usize, usize)> = None;
        for i in 0..n {
            let q = (self.next_qp + i) % n;
            if self.path_of[q] != path {
                continue;
            }
            let room = self.room(q);
            if room > 0 && best.is_none_or(|(_, r)| room > r) {
                best = Some((q, room));
            }
        }
        best
    }
}
