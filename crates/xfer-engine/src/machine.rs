//! Sans-IO data movement of one transfer: chunking, the per-QP window, selective signalling,
//! progress, failure and cancellation. It does no IO and never reads the clock: the driver feeds
//! it completions ([`Machine::handle_completion`]), cancellation and the current time, and asks it
//! what to post next ([`Machine::poll_transmit`]) and when it times out
//! ([`Machine::poll_timeout`]). The transfer's whole lifecycle around it (lease, grant, verify,
//! complete, revoke, release) is the [`crate::session::Session`].
//!
//! Chunks go to whichever QP has room, in *runs*: a run picks the QP with the most free window
//! slots (ties round-robin), reserves up to `signal_every` of them (never more than the chunks
//! left) and posts that many consecutive chunks there, signalling only the run's last WR. So one
//! slow or full QP never holds back the others, and every QP's window ends in a signaled WR
//! whenever no run is open — the machine never waits on silent WRs. A successful signaled
//! completion retires every earlier WR on its QP (RC ordering).
//!
//! A batch's segments are walked in order, each cut into chunks of at most `chunk` bytes (a
//! segment never shares a WR with another: their addresses are not contiguous). With
//! [`Markers`], the machine ends every QP with one zero-length *marker* WR that carries the
//! batch's notification to the target; the transfer succeeds once the markers completed too.
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use crate::batch::Seg;
use crate::status::WcStatus;

/// Whether and when the machine posts one notification marker per QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Markers {
    None,
    /// Right behind the QP's last data WR. For WRITEs: an RC QP (and a tcp stream) executes in
    /// order at the target, so the marker arrives after every byte before it is in place.
    Pipelined,
    /// Once every data WR has completed. For READs: the target's memory has been read only when
    /// the READ responses are back.
    AfterData,
}

#[derive(Debug, Clone)]
pub struct MachineConfig {
    /// The segments, in order (never empty for a transfer).
    pub segs: Arc<[Seg]>,
    pub chunk: u64,
    pub qps: usize,
    pub depth: usize,
    pub signal_every: usize,
    /// Absolute deadline for the whole transfer.
    pub deadline: Option<Instant>,
    pub markers: Markers,
}

/// A work request to post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Post {
    pub qp: usize,
    /// Per-transfer sequence number (the chunk index; markers follow the chunks); the driver
    /// uses it as `wr_id`.
    pub seq: u64,
    /// Absolute offset in the local region.
    pub local: u64,
    /// Offset from the grant's start.
    pub remote: u64,
    pub len: u32,
    pub signaled: bool,
    /// A zero-length notification marker (see [`Markers`]).
    pub marker: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Running,
    Succeeded,
    /// The first error; later flushes are not separate failures.
    Failed(Fault),
    Cancelled,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    Completion { status: WcStatus, seq: u64 },
    Post(String),
    Timeout,
}

#[derive(Debug, Clone, Copy)]
struct Outstanding {
    seq: u64,
    len: u32,
}

#[derive(Debug)]
pub struct Machine {
    cfg: MachineConfig,
    chunks: u64,
    next_chunk: u64,
    /// Where the next chunk starts: a segment index and the offset inside it.
    seg: usize,
    seg_off: u64,
    /// Per QP: its marker was posted.
    marker_sent: Vec<bool>,
    windows: Vec<VecDeque<Outstanding>>,
    /// The open run: its QP and the chunks still to post in it (slots already reserved).
    run: Option<(usize, usize)>,
    /// Where the next QP search starts (ties go round-robin).
    next_qp: usize,
    bytes_done: u64,
    state: State,
}

impl Machine {
    pub fn new(mut cfg: MachineConfig) -> Machine {
        cfg.chunk = cfg.chunk.clamp(1, u32::MAX as u64);
        cfg.qps = cfg.qps.max(1);
        cfg.depth = cfg.depth.max(1);
        // 0 = auto: four signaled WRs per window.
        if cfg.signal_every == 0 {
            cfg.signal_every = (cfg.depth / 4).max(1);
        }
        cfg.signal_every = cfg.signal_every.clamp(1, cfg.depth);
        let chunk = cfg.chunk;
        let chunks = cfg.segs.iter().map(|s| s.len.div_ceil(chunk)).fold(0u64, u64::saturating_add);
        let marker_sent = vec![cfg.markers == Markers::None; cfg.qps];
        let done = chunks == 0 && cfg.markers == Markers::None;
        Machine {
            chunks,
            next_chunk: 0,
            seg: 0,
            seg_off: 0,
            marker_sent,
            windows: vec![VecDeque::new(); cfg.qps],
            run: None,
            next_qp: 0,
            bytes_done: 0,
            state: if done { State::Succeeded } else { State::Running },
            cfg,
        }
    }

    pub fn state(&self) -> &State {
        &self.state
    }

    pub fn is_done(&self) -> bool {
        self.state != State::Running
    }

    pub fn bytes_done(&self) -> u64 {
        self.bytes_done
    }

    /// WRs posted and not yet retired.
    pub fn outstanding(&self) -> usize {
        self.windows.iter().map(|w| w.len()).sum()
    }

    /// The next WR to post, if a window has room.
    pub fn poll_transmit(&mut self) -> Option<Post> {
        if self.state != State::Running {
            return None;
        }
        if self.next_chunk >= self.chunks {
            return self.poll_marker();
        }
        let (qp, left) = match self.run {
            Some(run) => run,
            None => {
                let (qp, room) = self.roomiest()?;
                self.next_qp = (qp + 1) % self.cfg.qps;
                let chunks_left = usize::try_from(self.chunks - self.next_chunk).unwrap_or(usize::MAX);
                (qp, self.cfg.signal_every.min(room).min(chunks_left))
            }
        };
        // The run's last WR is signaled; the slots were reserved when it opened.
        let signaled = left <= 1;
        self.run = (!signaled).then_some((qp, left - 1));
        let c = self.next_chunk;
        // `next_chunk < chunks` means a segment with bytes left remains at `seg`.
        let s = *self.cfg.segs.get(self.seg)?;
        let len = (s.len - self.seg_off).min(self.cfg.chunk);
        let post =
            Post { qp, seq: c, local: s.local + self.seg_off, remote: s.remote + self.seg_off, len: len as u32, signaled, marker: false };
        self.seg_off += len;
        if self.seg_off >= s.len {
            self.seg += 1;
            self.seg_off = 0;
        }
        self.windows[qp].push_back(Outstanding { seq: c, len: post.len });
        self.next_chunk += 1;
        Some(post)
    }

    /// The next marker, once every chunk is posted (and, for [`Markers::AfterData`], retired).
    fn poll_marker(&mut self) -> Option<Post> {
        // After-data markers wait for every data WR to retire (once one marker is out, they
        // have: what is outstanding then is markers).
        let started = self.marker_sent.iter().any(|&m| m);
        if self.cfg.markers == Markers::AfterData && !started && self.outstanding() > 0 {
            return None;
        }
        let qp = (0..self.cfg.qps).find(|&q| !self.marker_sent[q] && self.windows[q].len() < self.cfg.depth)?;
        self.marker_sent[qp] = true;
        let seq = self.chunks.saturating_add(qp as u64);
        self.windows[qp].push_back(Outstanding { seq, len: 0 });
        Some(Post { qp, seq, local: 0, remote: 0, len: 0, signaled: true, marker: true })
    }

    /// Every chunk and marker posted.
    fn all_posted(&self) -> bool {
        self.next_chunk >= self.chunks && self.marker_sent.iter().all(|&m| m)
    }

    /// The QP with the most free window slots (ties: the first from `next_qp` on), if any has one.
    fn roomiest(&self) -> Option<(usize, usize)> {
        let n = self.cfg.qps;
        let mut best: Option<(usize, usize)> = None;
        for i in 0..n {
            let q = (self.next_qp + i) % n;
            let room = self.cfg.depth - self.windows[q].len();
            if room > 0 && best.is_none_or(|(_, r)| room > r) {
                best = Some((q, room));
            }
        }
        best
    }

    /// Feeds one work completion.
    pub fn handle_completion(&mut self, qp: usize, seq: u64, status: WcStatus) {
        let Some(window) = self.windows.get_mut(qp) else { return };
        let Some(pos) = window.iter().position(|o| o.seq == seq) else {
            return; // stale or duplicate
        };
        // Everything before `pos` completed successfully (in-order QP), silently if unsignaled.
        for o in window.drain(..pos) {
            self.bytes_done += o.len as u64;
        }
        let Some(o) = window.pop_front() else { return };
        if status.is_success() {
            self.bytes_done += o.len as u64;
            if self.state == State::Running && self.all_posted() && self.outstanding() == 0 {
                self.state = State::Succeeded;
            }
        } else if self.state == State::Running {
            // Flushes after the first error are expected and not separate failures.
            self.state = State::Failed(Fault::Completion { status, seq });
        }
    }

    /// Posting failed (e.g. the QP broke): fail with the fabric's reason.
    pub fn handle_post_error(&mut self, seq: u64, reason: String) {
        for w in &mut self.windows {
            w.retain(|o| o.seq != seq);
        }
        if self.state == State::Running {
            self.state = State::Failed(Fault::Post(reason));
        }
    }

    pub fn handle_cancel(&mut self) {
        if self.state == State::Running {
            self.state = State::Cancelled;
        }
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.state == State::Running {
            self.cfg.deadline
        } else {
            None
        }
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        if self.state == State::Running && self.cfg.deadline.is_some_and(|d| now >= d) {
            self.state = State::Failed(Fault::Timeout);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn cfg(total: u64, chunk: u64, qps: usize, depth: usize, signal_every: usize) -> MachineConfig {
        let segs: Arc<[Seg]> = if total == 0 { Arc::from([]) } else { Arc::from([Seg { local: 0, remote: 0, len: total }]) };
        MachineConfig { segs, chunk, qps, depth, signal_every, deadline: None, markers: Markers::None }
    }

    /// Drives a machine against a perfect in-order fabric: completes the signaled WRs in order.
    fn run_perfect(m: &mut Machine) -> Vec<Post> {
        let mut posted = Vec::new();
        let mut inflight: Vec<VecDeque<Post>> = vec![VecDeque::new(); m.cfg.qps];
        while !m.is_done() {
            let mut progressed = false;
            while let Some(p) = m.poll_transmit() {
                inflight[p.qp].push_back(p);
                posted.push(p);
                progressed = true;
            }
            for q in inflight.iter_mut() {
                while let Some(p) = q.pop_front() {
                    if p.signaled {
                        m.handle_completion(p.qp, p.seq, WcStatus::Success);
                        progressed = true;
                        break;
                    }
                }
            }
            assert!(progressed, "machine stalled: {m:?}");
        }
        posted
    }

    #[test]
    fn chunks_cover_the_range_exactly_once() {
        let mut m = Machine::new(cfg(10 * 1000 + 7, 1000, 3, 4, 2));
        let posts = run_perfect(&mut m);
        assert_eq!(m.state(), &State::Succeeded);
        assert_eq!(m.bytes_done(), 10_007);
        let mut next = 0;
        for p in &posts {
            assert_eq!((p.local, p.remote), (next, next));
            next += p.len as u64;
        }
        assert_eq!(next, 10_007);
        assert_eq!(posts.last().map(|p| p.len), Some(7));
        assert!(posts.last().is_some_and(|p| p.signaled));
        let used: std::collections::BTreeSet<usize> = posts.iter().map(|p| p.qp).collect();
        assert_eq!(used.len(), 3, "every QP carried chunks");
    }

    /// Whenever no run is open, the newest WR of every non-empty window is signaled: the machine
    /// can always make progress from completions alone. Checked over many shapes.
    #[test]
    fn no_window_ever_ends_in_a_silent_wr() {
        for qps in 1..=4 {
            for depth in 1..=6 {
                for every in 1..=7 {
                    for total in [1u64, 2, 5, 13, 40] {
                        let mut m = Machine::new(cfg(total, 1, qps, depth, every));
                        let mut tails: Vec<Option<Post>> = vec![None; qps];
                        let mut rounds = 0;
                        while !m.is_done() {
                            while let Some(p) = m.poll_transmit() {
                                tails[p.qp] = Some(p);
                            }
                            assert!(m.run.is_none(), "poll_transmit returned None inside a run");
                            for (q, t) in tails.iter().enumerate() {
                                if !m.windows[q].is_empty() {
                                    assert!(t.is_some_and(|p| p.signaled), "qps {qps} depth {depth} every {every}: QP {q} ends silent");
                                }
                            }
                            // Complete the oldest signaled WR of the fullest window.
                            let q = (0..qps).max_by_key(|&q| m.windows[q].len()).unwrap();
                            let tail = tails[q].unwrap();
                            m.handle_completion(q, tail.seq, WcStatus::Success);
                            rounds += 1;
                            assert!(rounds < 1000, "no progress");
                        }
                        assert_eq!(m.bytes_done(), total);
                    }
                }
            }
        }
    }

    /// A QP whose completions do not come (a slow path) does not hold back the others: chunks
    /// keep flowing to whichever QP has room.
    #[test]
    fn a_stalled_qp_does_not_stall_the_others() {
        let mut m = Machine::new(cfg(1000, 1, 2, 4, 2));
        let mut stalled = 0;
        let mut done_elsewhere = 0;
        for _ in 0..100 {
            let posts: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
            for p in posts {
                if p.qp == 0 {
                    stalled += 1; // never completed
                } else if p.signaled {
                    m.handle_completion(p.qp, p.seq, WcStatus::Success);
                }
            }
            done_elsewhere = m.bytes_done();
        }
        assert_eq!(stalled, 4, "QP 0 got one window and then no more");
        assert!(done_elsewhere >= 190, "QP 1 kept moving: {done_elsewhere}");
    }

    fn segs(v: &[(u64, u64, u64)]) -> Arc<[Seg]> {
        v.iter().map(|&(local, remote, len)| Seg { local, remote, len }).collect()
    }

    /// Every byte of every segment is posted once, to the right place, and no WR crosses a
    /// segment boundary.
    #[test]
    fn segments_are_walked_in_chunks_that_never_cross_them() {
        let list = segs(&[(0, 500, 25), (100, 0, 1), (40, 30, 10)]);
        let mut c = cfg(0, 10, 2, 3, 2);
        c.segs = list.clone();
        let mut m = Machine::new(c);
        let posts = run_perfect(&mut m);
        assert_eq!(m.state(), &State::Succeeded);
        assert_eq!(m.bytes_done(), 36);
        let got: Vec<(u64, u64, u32)> = posts.iter().map(|p| (p.local, p.remote, p.len)).collect();
        assert_eq!(got, vec![(0, 500, 10), (10, 510, 10), (20, 520, 5), (100, 0, 1), (40, 30, 10)]);
        assert!(posts.iter().all(|p| !p.marker));
    }

    /// Pipelined markers: one per QP (also a QP that carried no data), each behind that QP's
    /// last data WR, and the transfer succeeds only once they completed.
    #[test]
    fn pipelined_markers_end_every_qp_and_gate_success() {
        let mut c = cfg(3, 1, 4, 8, 1);
        c.markers = Markers::Pipelined;
        let mut m = Machine::new(c);
        let posts: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
        assert_eq!(posts.iter().filter(|p| !p.marker).count(), 3);
        let markers: Vec<&Post> = posts.iter().filter(|p| p.marker).collect();
        assert_eq!(markers.iter().map(|p| p.qp).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        assert!(markers.iter().all(|p| p.signaled && p.len == 0));
        for q in 0..4 {
            let on_q: Vec<&Post> = posts.iter().filter(|p| p.qp == q).collect();
            assert!(on_q.last().is_some_and(|p| p.marker), "QP {q} does not end in its marker");
        }
        // Data completes first: still running until every marker is back.
        for p in posts.iter().filter(|p| !p.marker) {
            m.handle_completion(p.qp, p.seq, WcStatus::Success);
        }
        assert_eq!(m.state(), &State::Running);
        for p in &markers[..3] {
            m.handle_completion(p.qp, p.seq, WcStatus::Success);
        }
        assert_eq!(m.state(), &State::Running);
        m.handle_completion(markers[3].qp, markers[3].seq, WcStatus::Success);
        assert_eq!(m.state(), &State::Succeeded);
        assert_eq!(m.bytes_done(), 3);
    }

    /// After-data markers (READs) wait until every data WR is retired, and a failed marker
    /// fails the transfer.
    #[test]
    fn after_data_markers_wait_for_the_data_and_can_fail() {
        let mut c = cfg(4, 1, 2, 4, 2);
        c.markers = Markers::AfterData;
        let mut m = Machine::new(c);
        let data: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
        assert_eq!(data.len(), 4);
        assert!(data.iter().all(|p| !p.marker));
        let signaled: Vec<&Post> = data.iter().filter(|p| p.signaled).collect();
        m.handle_completion(signaled[0].qp, signaled[0].seq, WcStatus::Success);
        assert_eq!(m.poll_transmit(), None, "a marker before the data is back");
        m.handle_completion(signaled[1].qp, signaled[1].seq, WcStatus::Success);
        let markers: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
        assert_eq!(markers.len(), 2);
        assert!(markers.iter().all(|p| p.marker));
        m.handle_completion(markers[0].qp, markers[0].seq, WcStatus::RemAccessErr);
        assert!(matches!(m.state(), State::Failed(Fault::Completion { status: WcStatus::RemAccessErr, .. })));
    }

    /// A full QP delays its marker; it goes out once the window has room.
    #[test]
    fn a_marker_waits_for_room_on_its_qp() {
        let mut c = cfg(2, 1, 1, 2, 2);
        c.markers = Markers::Pipelined;
        let mut m = Machine::new(c);
        let data: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
        assert_eq!(data.len(), 2, "window of 2 full of data");
        m.handle_completion(0, data[1].seq, WcStatus::Success);
        let marker = m.poll_transmit().expect("marker once there is room");
        assert!(marker.marker);
        m.handle_completion(0, marker.seq, WcStatus::Success);
        assert_eq!(m.state(), &State::Succeeded);
    }

    #[test]
    fn signal_every_zero_signals_four_times_per_window() {
        let mut m = Machine::new(cfg(64, 1, 1, 16, 0));
        let posts: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
        assert_eq!(posts.len(), 16);
        assert_eq!(posts.iter().filter(|p| p.signaled).count(), 4, "depth 16 / 4");
        let mut m = Machine::new(cfg(8, 1, 1, 2, 0));
        let posts: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
        assert!(posts.iter().all(|p| p.signaled), "depth 2: every WR (at least 1)");
    }

    #[test]
    fn window_bounds_outstanding_per_qp() {
        let mut m = Machine::new(cfg(100, 1, 2, 3, 8));
        let mut n = 0;
        while m.poll_transmit().is_some() {
            n += 1;
        }
        assert_eq!(n, 6, "2 QPs x depth 3");
        assert_eq!(m.outstanding(), 6);
    }

    #[test]
    fn every_full_window_ends_with_a_signaled_wr() {
        let mut m = Machine::new(cfg(64, 1, 1, 4, 100));
        let posts: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
        assert_eq!(posts.len(), 4);
        assert!(posts[3].signaled && !posts[0].signaled && !posts[1].signaled);
    }

    #[test]
    fn signaled_completion_retires_earlier_unsignaled_wrs() {
        let mut m = Machine::new(cfg(4, 1, 1, 4, 4));
        let posts: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
        assert_eq!(posts.iter().filter(|p| p.signaled).count(), 1);
        m.handle_completion(0, 3, WcStatus::Success);
        assert_eq!(m.bytes_done(), 4);
        assert_eq!(m.state(), &State::Succeeded);
    }

    #[test]
    fn first_error_wins_and_flushes_are_not_failures() {
        let mut m = Machine::new(cfg(8, 1, 1, 8, 1));
        while m.poll_transmit().is_some() {}
        m.handle_completion(0, 0, WcStatus::Success);
        m.handle_completion(0, 1, WcStatus::RemAccessErr);
        m.handle_completion(0, 2, WcStatus::WrFlushErr);
        assert_eq!(m.state(), &State::Failed(Fault::Completion { status: WcStatus::RemAccessErr, seq: 1 }));
        assert_eq!(m.bytes_done(), 1);
        assert_eq!(m.poll_transmit(), None);
    }

    #[test]
    fn cancel_stops_posting_and_is_terminal() {
        let mut m = Machine::new(cfg(100, 10, 1, 2, 1));
        assert!(m.poll_transmit().is_some());
        m.handle_cancel();
        assert_eq!(m.state(), &State::Cancelled);
        assert_eq!(m.poll_transmit(), None);
        m.handle_completion(0, 0, WcStatus::RetryExcErr);
        assert_eq!(m.state(), &State::Cancelled);
    }

    #[test]
    fn deadline_fails_with_timeout_on_virtual_time() {
        let t0 = Instant::now();
        let mut c = cfg(100, 10, 1, 2, 1);
        c.deadline = Some(t0 + Duration::from_secs(5));
        let mut m = Machine::new(c);
        m.poll_transmit();
        assert_eq!(m.poll_timeout(), Some(t0 + Duration::from_secs(5)));
        m.handle_timeout(t0 + Duration::from_secs(4));
        assert_eq!(m.state(), &State::Running);
        m.handle_timeout(t0 + Duration::from_secs(5));
        assert_eq!(m.state(), &State::Failed(Fault::Timeout));
        assert_eq!(m.poll_timeout(), None);
    }

    #[test]
    fn zero_length_is_immediately_done() {
        let mut m = Machine::new(cfg(0, 10, 1, 2, 1));
        assert_eq!(m.state(), &State::Succeeded);
        assert_eq!(m.poll_transmit(), None);
    }

    #[test]
    fn stale_completions_are_ignored() {
        let mut m = Machine::new(cfg(10, 5, 1, 2, 1));
        m.poll_transmit();
        m.handle_completion(0, 42, WcStatus::RemAccessErr);
        m.handle_completion(7, 0, WcStatus::RemAccessErr);
        assert_eq!(m.state(), &State::Running);
    }
}
