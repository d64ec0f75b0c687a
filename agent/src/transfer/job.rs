//! What the data path runs, whoever runs it: a [`Job`] (a transfer [`Machine`] over one leased
//! connection), the one template that turns the machine's [`Post`]s into work requests
//! ([`WrTemplate`]), how they go out ([`post_runs`]) and how a completion comes back
//! ([`complete`]). The caller's task (`driver`) and the device's worker thread (`worker`) both
//! build on this module and on nothing of each other's but what the driver hands the worker.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use xfer_engine::machine::{Machine, Post};
use xfer_fabric::{Completion, Connection, Registration, RemoteKey, WcStatus, WorkRequest, WrOp};

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

/// Posts `pending` in order, one doorbell per run of consecutive WRs on the same QP
/// ([`Connection::post_batch`]), and empties it. On a failure: the seqs (`wr_id`s) of every WR
/// from the one that failed on — none of them counts as posted — and the reason.
pub fn post_runs(conn: &dyn Connection, pending: &mut Vec<(usize, WorkRequest)>) -> Result<(), (Vec<u64>, String)> {
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
            let mut failed: Vec<u64> = ids[from..].to_vec();
            failed.extend(items.map(|(_, w)| w.wr_id));
            return Err((failed, e.to_string()));
        }
        crate::metrics::work_requests(ops[0], ops[1], ops[2]);
    }
    Ok(())
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
