//! What the data path runs, whoever runs it: a [`Job`] (a transfer [`Machine`] over one leased
//! connection), the one template that turns the machine's [`Post`]s into work requests
//! ([`WrTemplate`]), how they go out ([`post_runs`]) and how a completion comes back
//! ([`complete`]). The caller's task (`driver`) and the device's worker thread (`worker`) both
//! build on this module and on nothing of each other's but what the driver hands the worker.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use xfer_engine::machine::{Machine, PathDown, PathEvent, Post};
use xfer_fabric::{Completion, Connection, FabricError, PathInfo, Registration, RemoteKey, WcStatus, WorkRequest, WrOp};

/// What a job needs of its lease: the connection, and its completions (the job is their only
/// reader). The peer pool's lease in the agent; a bare connection in the worker's tests.
pub trait Leased: Send + 'static {
    fn conn(&self) -> &Arc<dyn Connection>;
    fn completions(&mut self) -> &mut tokio::sync::mpsc::UnboundedReceiver<Completion>;
}

/// Per-WR round-trip times, for the latency benchmark.
#[derive(Default)]
pub struct LatencyProbe {
    posted: HashMap<u64, Instant>,
    pub samples: Vec<Duration>,
}

impl LatencyProbe {
    /// WR `seq` is being posted now.
    pub fn posted(&mut self, seq: u64) {
        self.posted.insert(seq, Instant::now());
    }
}

/// How one job's [`Post`]s become work requests — the only place a `Post` becomes a
/// [`WorkRequest`], for transfers, channel batches and benchmark phases alike: data WRs carry
/// `op`, markers notify `notify_slot`, offsets are the post's (within the local registration,
/// and from `remote_addr` under `remote_key` on the peer).
#[derive(Clone)]
pub struct WrTemplate {
    /// WRITE or READ: what every data WR does.
    pub op: WrOp,
    /// The immediate of the markers (a grant's notification slot, or a channel batch's).
    pub notify_slot: u32,
    pub local: Arc<dyn Registration>,
    /// Where the post's remote offset 0 is on the peer.
    pub remote_addr: u64,
    pub remote_key: RemoteKey,
    /// Offsets are taken modulo this on both sides (a benchmark reuses one message's buffer for
    /// every message); `None`: as posted.
    pub wrap: Option<u64>,
}

impl WrTemplate {
    /// The work request for `p`.
    pub fn wr(&self, p: &Post) -> WorkRequest {
        let (local, remote) = match self.wrap {
            Some(n) => (p.local % n, p.remote % n),
            None => (p.local, p.remote),
        };
        WorkRequest {
            wr_id: p.seq,
            op: if p.marker { WrOp::Notify { slot: self.notify_slot } } else { self.op },
            local: self.local.clone(),
            local_offset: local,
            len: p.len,
            remote_addr: self.remote_addr + remote,
            remote_key: self.remote_key.clone(),
            signaled: p.signaled,
        }
    }
}

/// Told the machine's bytes done whenever they changed (on the worker thread it must not
/// block).
pub type Progress = Box<dyn FnMut(u64) + Send>;

/// One machine to run to a terminal state over one leased connection.
pub struct Job<L> {
    pub machine: Machine,
    pub lease: L,
    pub wr: WrTemplate,
    pub probe: Option<LatencyProbe>,
    pub cancel: CancellationToken,
    pub progress: Option<Progress>,
}

/// What a job hands back: its machine in a terminal state, the lease, the latency probe, and
/// when the first WR was posted.
pub struct Done<L> {
    pub machine: Machine,
    pub lease: L,
    pub probe: Option<LatencyProbe>,
    pub first_post: Option<Instant>,
}

/// WRs the fabric did not take: the QP of the refused run, the seqs (`wr_id`s) of every WR not
/// posted (the refused one, the rest of its run and every run queued after it, whichever QP
/// that was for), and why. `path_failure`: the QP is broken ([`FabricError::QpBroken`]), so its
/// path is gone and its WRs may go on another path.
pub struct PostFailure {
    pub qp: usize,
    pub seqs: Vec<u64>,
    pub reason: String,
    pub path_failure: bool,
}

impl PostFailure {
    /// Tells `machine`: a broken QP takes its path down (the chunks it had in flight move to
    /// the others) and the WRs not posted are taken back; any other refusal fails the job.
    pub fn tell(self, machine: &mut Machine) {
        machine.handle_post_failure(self.qp, &self.seqs, self.reason, self.path_failure);
    }
}

/// Posts `pending` in order, one doorbell per run of consecutive WRs on the same QP
/// ([`Connection::post_batch`]), and empties it. Stops at the first refusal; what was not posted
/// is in the [`PostFailure`].
pub fn post_runs(conn: &dyn Connection, pending: &mut Vec<(usize, WorkRequest)>) -> Result<(), PostFailure> {
    let mut items = pending.drain(..).peekable();
    while let Some((qp, first)) = items.next() {
        let mut run = vec![first];
        while let Some((_, wr)) = items.next_if(|(q, _)| *q == qp) {
            run.push(wr);
        }
        let ids: Vec<u64> = run.iter().map(|w| w.wr_id).collect();
        let mut ops = [0u64; 3];
        for w in &run {
            ops[match w.op {
                WrOp::Write => 0,
                WrOp::Read => 1,
                WrOp::Notify { .. } => 2,
            }] += 1;
        }
        if let Err((id, e)) = conn.post_batch(qp, run) {
            let from = ids.iter().position(|&x| x == id).unwrap_or(0);
            let mut seqs: Vec<u64> = ids[from..].to_vec();
            seqs.extend(items.map(|(_, w)| w.wr_id));
            return Err(PostFailure { qp, seqs, reason: e.to_string(), path_failure: matches!(e, FabricError::QpBroken) });
        }
        crate::metrics::work_requests(ops[0], ops[1], ops[2]);
    }
    Ok(())
}

/// Drains what happened to `machine`'s paths (a path lost mid-job, its WRs re-posted on the
/// others) into the log and the metrics, naming the paths as `conn` does.
pub fn path_events(machine: &mut Machine, conn: &dyn Connection) {
    while let Some(PathEvent::Down { path, reason, requeued }) = machine.poll_event() {
        let paths = conn.paths();
        let (local, remote) = paths.get(path).map(|p| (p.local_device.as_str(), p.remote_device.as_str())).unwrap_or(("", ""));
        let class = match &reason {
            PathDown::Completion(_) => "completion",
            PathDown::Post(_) => "post",
            PathDown::Event(_) => "event",
            PathDown::OutOfOrder { .. } => "out_of_order",
        };
        tracing::warn!(path, local_device = local, remote_device = remote, reason = ?reason, requeued, paths_up = machine.paths_up(), "path lost mid-transfer: its work requests go on the other paths");
        crate::metrics::path_failover(local, remote, class, requeued);
    }
}

/// Counts the bytes each path of `conn` carried for a job that ended.
pub fn path_bytes(machine: &Machine, conn: &dyn Connection) {
    for (p, bytes) in conn.paths().iter().zip(machine.path_bytes()) {
        crate::metrics::path_bytes(&p.local_device, &p.remote_device, *bytes);
    }
}

/// Whether a standby path of `conn` (the tcp fallback) carried bytes in `machine`'s job.
pub fn fell_back(machine: &Machine, conn: &dyn Connection) -> bool {
    conn.paths().iter().zip(machine.path_bytes()).any(|(p, &bytes)| p.standby && bytes > 0)
}

/// QP index → path index, from the paths' QP ranges (a QP no range covers goes to path 0).
pub fn qp_map(paths: &[PathInfo], qps: usize) -> Arc<[usize]> {
    let mut map = vec![0usize; qps];
    for (i, p) in paths.iter().enumerate() {
        for q in p.qps.clone() {
            if let Some(slot) = map.get_mut(q) {
                *slot = i;
            }
        }
    }
    map.into()
}

/// Feeds one completion to `machine`, timing it on `probe` if there is one.
pub fn complete(machine: &mut Machine, probe: &mut Option<&mut LatencyProbe>, qp: usize, seq: u64, status: WcStatus) {
    if let Some(pr) = probe.as_deref_mut() {
        if let Some(t) = pr.posted.remove(&seq) {
            pr.samples.push(t.elapsed());
        }
    }
    machine.handle_completion(qp, seq, status);
}

#[cfg(test)]
mod tests {
    use super::qp_map;
    use xfer_fabric::PathInfo;

    fn path(qps: std::ops::Range<usize>) -> PathInfo {
        PathInfo { local_device: String::new(), remote_device: String::new(), qps, standby: false, mtu: 0 }
    }

    #[test]
    fn qps_map_to_the_path_whose_range_holds_them() {
        let m = qp_map(&[path(0..2), path(2..5)], 5);
        assert_eq!(&m[..], &[0, 0, 1, 1, 1]);
        assert_eq!(&qp_map(&[path(0..3)], 3)[..], &[0, 0, 0]);
        // Ranges past the connection's QPs are ignored, never indexed.
        assert_eq!(&qp_map(&[path(0..1), path(1..9)], 2)[..], &[0, 1]);
    }
}
