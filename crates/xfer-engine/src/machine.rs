//! Sans-IO data movement of one transfer: chunking, the per-QP window, selective signalling,
//! progress, striping over paths, failover, failure and cancellation. It does no IO and never
//! reads the clock: the driver feeds it completions ([`Machine::handle_completion`]), lost paths
//! ([`Machine::handle_path_down`]), cancellation and the current time, and asks it what to post
//! next ([`Machine::poll_transmit`]) and when it times out ([`Machine::poll_timeout`]). The
//! transfer's whole lifecycle around it (lease, grant, verify, complete, revoke, release) is the
//! [`crate::session::Session`].
//!
//! Chunks go out in *runs*: a run picks a path by weight (`stripe`), then the QP of that path
//! with the most free window slots (ties round-robin), reserves up to `signal_every` slots (never
//! more than the chunks left) and posts that many consecutive chunks there, signalling only the
//! run's last WR. So one slow or full QP never holds back the others, and every QP's window ends
//! in a signaled WR whenever no run is open — the machine never waits on silent WRs. A
//! successful signaled completion retires every earlier WR on its QP (RC ordering).
//!
//! A batch's segments are walked in order, each cut into chunks of at most `chunk` bytes (a
//! segment never shares a WR with another: their addresses are not contiguous). With
//! [`Markers`], the machine ends every QP with one zero-length *marker* WR that carries the
//! batch's notification to the target; the transfer succeeds once the markers completed too.
//!
//! A path that fails (a completion error another path could succeed at, a post the fabric says
//! broke the QP, or the driver's word) is dropped for the rest of the transfer (`failover`):
//! every WR on its QPs that no successful completion retired goes back to be posted again, on the
//! paths left, before any new chunk; later completions from its QPs are ignored. A chunk keeps
//! its `seq` and is counted in [`Machine::bytes_done`] once, when some path retires it.
use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use crate::batch::Seg;
use crate::status::WcStatus;

mod failover;
mod stripe;

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
    /// The path of each QP (`Connection::paths`). Empty: every QP is on path 0. A QP past its
    /// end, or naming a path past `max(qps, weights.len())`, is on path 0.
    pub path_of: Arc<[usize]>,
    /// Per path, its share of the runs. Empty: all 1; a path past its end: 1. Weight 0 is a
    /// standby path: used only while no path of positive weight is up.
    pub weights: Vec<u32>,
}

/// A work request to post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Post {
    pub qp: usize,
    /// Per-transfer sequence number (the chunk index; markers follow the chunks); the driver
    /// uses it as `wr_id`. A chunk posted again after its path failed keeps it.
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
    Completion {
        status: WcStatus,
        seq: u64,
    },
    Post(String),
    Timeout,
    /// Every path went down; `last` is why the last one did.
    NoPath {
        last: PathDown,
    },
}

/// Why a path went down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathDown {
    /// A work completion failed with a status another path could succeed at
    /// ([`WcStatus::is_path_failure`]).
    Completion(WcStatus),
    /// Posting failed because the fabric found the QP broken.
    Post(String),
    /// The driver learnt it otherwise (a port-down or device-fatal async event).
    Event(String),
    /// The device reported WR `seq` complete while an earlier signaled WR on its QP had not
    /// reported: it broke the queue's completion order, so the path cannot be trusted.
    OutOfOrder { seq: u64 },
}

impl fmt::Display for PathDown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathDown::Completion(s) => write!(f, "work request failed with {s}"),
            PathDown::Post(e) => write!(f, "post failed: {e}"),
            PathDown::Event(e) => f.write_str(e),
            PathDown::OutOfOrder { seq } => {
                write!(f, "the device reported work request {seq} complete before an earlier signaled one on its queue pair")
            }
        }
    }
}

/// What happened to a path during the transfer ([`Machine::poll_event`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathEvent {
    /// `path` went down; `requeued` of its WRs (chunks and markers) were in flight on it
    /// (posted, not known to have landed) and go out again on the paths left. WRs a failed post
    /// left unposted are not among them.
    Down { path: usize, reason: PathDown, requeued: u32 },
}

/// One chunk's place: where it comes from and goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Chunk {
    seq: u64,
    local: u64,
    remote: u64,
    len: u32,
}

#[derive(Debug, Clone, Copy)]
struct Outstanding {
    chunk: Chunk,
    marker: bool,
    /// Its completion is reported by itself (a run's last WR, a marker); the others are
    /// retired by a later signaled one on their QP.
    signaled: bool,
}

/// One path's standing in this transfer.
#[derive(Debug, Clone)]
struct PathSlot {
    /// Up, and it has QPs.
    up: bool,
    weight: u32,
    /// Bytes of the runs it was given (the striping's account).
    assigned: u64,
    qps: Vec<usize>,
}

#[derive(Debug)]
pub struct Machine {
    cfg: MachineConfig,
    chunks: u64,
    next_chunk: u64,
    /// Where the next chunk starts: a segment index and the offset inside it.
    seg: usize,
    seg_off: u64,
    /// Per QP: its own marker was posted, or handed to `owed` when its path went down.
    marker_sent: Vec<bool>,
    /// Markers that must go out on any live QP once every chunk is retired: those of a down
    /// path that no successful completion confirmed.
    owed: u32,
    /// Owed markers posted so far (their seqs follow the QPs' own markers').
    resent: u64,
    windows: Vec<VecDeque<Outstanding>>,
    /// Chunks of down paths, to post again before any new chunk (in seq order).
    retry: VecDeque<Chunk>,
    /// The open run: its QP and the chunks still to post in it (slots already reserved).
    run: Option<(usize, usize)>,
    /// Where the next QP search starts (ties go round-robin).
    next_qp: usize,
    path_of: Vec<usize>,
    paths: Vec<PathSlot>,
    path_bytes: Vec<u64>,
    events: VecDeque<PathEvent>,
    failovers: u32,
    /// A path that had retired bytes went down while the transfer ran.
    lost_after_use: bool,
    /// Markers not yet posted when a path failed over are held, not sent (see
    /// [`Machine::hold_markers_after_failover`]).
    hold: bool,
    held: bool,
    markers_posted: u64,
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
        // Path indices are bounded by what the config can mean, so a bad map cannot make a
        // huge table.
        let limit = cfg.qps.max(cfg.weights.len());
        let path_of: Vec<usize> = (0..cfg.qps).map(|q| cfg.path_of.get(q).copied().filter(|&p| p < limit).unwrap_or(0)).collect();
        let npaths = path_of.iter().map(|&p| p + 1).max().unwrap_or(1).max(cfg.weights.len());
        let paths: Vec<PathSlot> = (0..npaths)
            .map(|p| {
                let qps: Vec<usize> = (0..cfg.qps).filter(|&q| path_of[q] == p).collect();
                PathSlot { up: !qps.is_empty(), weight: cfg.weights.get(p).copied().unwrap_or(1), assigned: 0, qps }
            })
            .collect();
        Machine {
            chunks,
            next_chunk: 0,
            seg: 0,
            seg_off: 0,
            marker_sent,
            owed: 0,
            resent: 0,
            windows: vec![VecDeque::new(); cfg.qps],
            retry: VecDeque::new(),
            run: None,
            next_qp: 0,
            path_of,
            path_bytes: vec![0; npaths],
            paths,
            events: VecDeque::new(),
            failovers: 0,
            lost_after_use: false,
            hold: false,
            held: false,
            markers_posted: 0,
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

    /// WRs posted and not yet retired, on paths that are up.
    pub fn outstanding(&self) -> usize {
        self.windows.iter().map(|w| w.len()).sum()
    }

    /// Bytes retired per path (a chunk counts on the path that retired it).
    pub fn path_bytes(&self) -> &[u64] {
        &self.path_bytes
    }

    /// Whether `path` is still up (false for a path it does not have).
    pub fn path_is_up(&self, path: usize) -> bool {
        self.paths.get(path).is_some_and(|p| p.up)
    }

    /// Paths still up.
    pub fn paths_up(&self) -> usize {
        self.paths.iter().filter(|p| p.up).count()
    }

    /// Paths lost while the transfer ran that had WRs in flight (posted to the path and not
    /// retired by a successful completion), which went out again on the paths left. A path
    /// lost with nothing in flight (idle, or found broken by a post: the refused WRs simply go
    /// elsewhere) is not a failover.
    pub fn failovers(&self) -> u32 {
        self.failovers
    }

    /// Whether what the paths reported retired is proven only by a checksum: a path failed
    /// over, or one that had retired bytes was lost while the transfer ran (with nothing of it
    /// outstanding: a failing device may have reported work complete just before it went).
    pub fn must_verify(&self) -> bool {
        self.failovers > 0 || self.lost_after_use
    }

    /// Once a path failed over, the markers not yet posted are held rather than sent, and the
    /// machine succeeds without them. A failing device may have reported work complete that did
    /// not land; the session then verifies the segments end to end and the target publishes
    /// the notification on `Peer.Complete` only if they match, so no notification announces a
    /// batch that did not fully land. (Markers already posted still count at the target: a
    /// QP's own marker trails its data in RC order.)
    pub fn hold_markers_after_failover(mut self) -> Machine {
        self.hold = true;
        self
    }

    /// Whether markers were held after a failover (the notification is `Peer.Complete`'s).
    pub fn markers_held(&self) -> bool {
        self.held
    }

    /// Notification markers posted so far (a QP's own and owed ones): once this reaches the
    /// number the target counts, it may have published the notification.
    pub fn markers_posted(&self) -> u64 {
        self.markers_posted
    }

    /// The absolute deadline the machine was given.
    pub fn deadline(&self) -> Option<Instant> {
        self.cfg.deadline
    }

    /// The chunks no successful completion retired, as segments in the order they were cut
    /// (chunks contiguous on both sides merged): what a transfer resumed on a fresh connection
    /// still has to move. Markers are not data and are not in it.
    pub fn unretired(&self) -> Vec<Seg> {
        let mut chunks: Vec<Chunk> =
            self.windows.iter().flatten().filter(|o| !o.marker).map(|o| o.chunk).chain(self.retry.iter().copied()).collect();
        chunks.sort_unstable_by_key(|c| c.seq);
        let mut out: Vec<Seg> = Vec::new();
        let mut push = |s: Seg| match out.last_mut() {
            Some(l) if l.local.checked_add(l.len) == Some(s.local) && l.remote.checked_add(l.len) == Some(s.remote) => l.len += s.len,
            _ => out.push(s),
        };
        for c in chunks {
            push(Seg { local: c.local, remote: c.remote, len: c.len as u64 });
        }
        // Then what was never cut into chunks: the rest of the current segment and every later one.
        if let Some(s) = self.cfg.segs.get(self.seg) {
            push(Seg { local: s.local + self.seg_off, remote: s.remote + self.seg_off, len: s.len - self.seg_off });
            for s in self.cfg.segs.iter().skip(self.seg + 1) {
                push(*s);
            }
        }
        out
    }

    /// What happened to paths since the last call (for logs and metrics); at most one event per
    /// path.
    pub fn poll_event(&mut self) -> Option<PathEvent> {
        self.events.pop_front()
    }

    /// The next WR to post, if a window has room.
    pub fn poll_transmit(&mut self) -> Option<Post> {
        if self.state != State::Running {
            return None;
        }
        let left = self.data_left();
        if left == 0 {
            return self.poll_marker();
        }
        let (qp, in_run) = match self.run {
            Some(run) => run,
            None => {
                let (qp, room) = self.pick()?;
                self.next_qp = (qp + 1) % self.cfg.qps;
                (qp, self.cfg.signal_every.min(room).min(usize::try_from(left).unwrap_or(usize::MAX)))
            }
        };
        // The run's last WR is signaled; the slots were reserved when it opened, and the chunks
        // left only grow while it is open (a failed path adds its chunks back).
        let signaled = in_run <= 1;
        self.run = (!signaled).then_some((qp, in_run - 1));
        let c = match self.retry.pop_front() {
            Some(c) => c,
            None => self.fresh()?,
        };
        let path = self.path_of[qp];
        self.paths[path].assigned += c.len as u64;
        self.windows[qp].push_back(Outstanding { chunk: c, marker: false, signaled });
        Some(Post { qp, seq: c.seq, local: c.local, remote: c.remote, len: c.len, signaled, marker: false })
    }

    /// The next chunk never posted before.
    fn fresh(&mut self) -> Option<Chunk> {
        // `next_chunk < chunks` means a segment with bytes left remains at `seg`.
        let s = *self.cfg.segs.get(self.seg)?;
        let len = (s.len - self.seg_off).min(self.cfg.chunk);
        let c = Chunk { seq: self.next_chunk, local: s.local + self.seg_off, remote: s.remote + self.seg_off, len: len as u32 };
        self.seg_off += len;
        if self.seg_off >= s.len {
            self.seg += 1;
            self.seg_off = 0;
        }
        self.next_chunk += 1;
        Some(c)
    }

    /// Chunks still to post: new ones and those of failed paths.
    fn data_left(&self) -> u64 {
        (self.retry.len() as u64).saturating_add(self.chunks - self.next_chunk)
    }

    /// Every chunk posted and retired by a successful completion on some path.
    fn data_retired(&self) -> bool {
        self.data_left() == 0 && self.windows.iter().flatten().all(|o| o.marker)
    }

    /// The next marker, once every chunk is posted (and, for [`Markers::AfterData`], retired).
    /// A QP's own marker goes on that QP; an owed one (its path went down before it was
    /// confirmed) on any live QP, and only once every chunk is retired: so whichever N markers
    /// the target counts first, either each is a QP's own (behind every chunk's first posting on
    /// that QP) or one of them left after every chunk had landed.
    fn poll_marker(&mut self) -> Option<Post> {
        if self.hold && self.must_verify() && self.cfg.markers != Markers::None {
            if self.owed > 0 || self.marker_sent.iter().any(|&m| !m) {
                self.held = true;
                self.owed = 0;
                self.marker_sent.fill(true);
                self.check_done();
            }
            return None;
        }
        let retired = self.data_retired();
        if self.cfg.markers == Markers::AfterData && !retired {
            return None;
        }
        let own = (0..self.cfg.qps).find(|&q| !self.marker_sent[q] && self.paths[self.path_of[q]].up && self.room(q) > 0);
        let (qp, seq) = if let Some(q) = own {
            self.marker_sent[q] = true;
            (q, self.chunks.saturating_add(q as u64))
        } else if self.owed > 0 && retired {
            let (q, _) = self.pick()?;
            self.owed -= 1;
            let seq = self.chunks.saturating_add(self.cfg.qps as u64).saturating_add(self.resent);
            self.resent += 1;
            (q, seq)
        } else {
            return None;
        };
        self.markers_posted += 1;
        self.windows[qp].push_back(Outstanding { chunk: Chunk { seq, local: 0, remote: 0, len: 0 }, marker: true, signaled: true });
        Some(Post { qp, seq, local: 0, remote: 0, len: 0, signaled: true, marker: true })
    }

    /// Free window slots of `qp`.
    fn room(&self, qp: usize) -> usize {
        self.cfg.depth.saturating_sub(self.windows[qp].len())
    }

    /// Succeeds once every chunk is retired and every marker confirmed.
    fn check_done(&mut self) {
        if self.state == State::Running
            && self.data_left() == 0
            && self.owed == 0
            && self.marker_sent.iter().all(|&m| m)
            && self.outstanding() == 0
        {
            self.state = State::Succeeded;
        }
    }

    /// Feeds one work completion.
    pub fn handle_completion(&mut self, qp: usize, seq: u64, status: WcStatus) {
        let Some(&path) = self.path_of.get(qp) else { return };
        if !self.paths[path].up {
            return; // its WRs went back to be posted again when it went down
        }
        let Some(pos) = self.windows[qp].iter().position(|o| o.chunk.seq == seq) else {
            return; // stale or duplicate
        };
        if status.is_success() && self.windows[qp].iter().take(pos).any(|o| o.signaled) {
            // An earlier signaled WR on this QP has not reported: the device completed out of
            // order, so no completion on this path proves which WRs landed (seen on Soft-RoCE
            // under load: a READ retired silently whose bytes never arrived). Nothing on the path
            // counts; its WRs go out again on the others, as after a failure.
            if self.state == State::Running {
                self.path_down(path, PathDown::OutOfOrder { seq });
            }
        } else if status.is_success() {
            // Everything up to `pos` completed successfully (in-order QP), silently if unsignaled.
            for o in self.windows[qp].drain(..=pos) {
                if !o.marker {
                    self.bytes_done += o.chunk.len as u64;
                    self.path_bytes[path] += o.chunk.len as u64;
                }
            }
            self.check_done();
        } else if self.state == State::Running && status.is_path_failure() {
            // Nothing on the path counts as landed, not even the WRs before this one: after a
            // link failure a flush may be the first completion a silent WR gets.
            self.path_down(path, PathDown::Completion(status));
        } else {
            for o in self.windows[qp].drain(..pos) {
                self.bytes_done += o.chunk.len as u64;
                self.path_bytes[path] += o.chunk.len as u64;
            }
            self.windows[qp].pop_front();
            if self.state == State::Running {
                // Flushes after the first error are expected and not separate failures.
                self.state = State::Failed(Fault::Completion { status, seq });
            }
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
mod tests;

#[cfg(test)]
mod fake;
