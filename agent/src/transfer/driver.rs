//! The tokio driver of the transfer [`Machine`]: posts what the machine asks for, feeds it
//! completions (in batches), cancellation and time, and reports progress. Used by transfers and
//! by the data-path benchmark alike.
use std::collections::HashMap;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::machine::{Machine, Post};
use super::worker::{Done, Job, Leased, Refused, Worker};
use xfer_fabric::{Completion, Connection, WorkRequest};

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

/// What woke a transfer that was waiting.
pub enum Wake {
    /// One or more completions, each already handed to `on_completion` (the first, then whatever
    /// else was queued: a batch, with no allocation on this hot path).
    Completions,
    /// The connection's completion channel closed.
    Closed,
    Cancelled,
    /// The deadline passed.
    Timeout,
}

/// Waits for the next completions on `lease` (each passed to `on_completion`), a cancel, or
/// `deadline`. With a `spin` budget it first polls the connection itself
/// ([`Connection::progress`]) for up to that long, so a completion that arrives within it is
/// handled without a wake-up through the fabric's completion task (`verbs.poll_spin`).
pub async fn wait<L: Leased>(
    lease: &mut L,
    cancel: &CancellationToken,
    deadline: Option<Instant>,
    spin: Duration,
    mut on_completion: impl FnMut(Completion),
) -> Wake {
    if !spin.is_zero() {
        let until = crate::deadline::instant_after(spin);
        loop {
            lease.conn().progress();
            if let Ok(c) = lease.completions().try_recv() {
                on_completion(c);
                while let Ok(c) = lease.completions().try_recv() {
                    on_completion(c);
                }
                return Wake::Completions;
            }
            if cancel.is_cancelled() || Instant::now() >= until {
                break;
            }
            std::hint::spin_loop();
        }
    }
    let sleep = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d.into()).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        c = lease.completions().recv() => match c {
            Some(c) => {
                on_completion(c);
                while let Ok(c) = lease.completions().try_recv() {
                    on_completion(c);
                }
                Wake::Completions
            }
            None => Wake::Closed,
        },
        _ = cancel.cancelled() => Wake::Cancelled,
        _ = sleep => Wake::Timeout,
    }
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
                xfer_fabric::WrOp::Write => 0,
                xfer_fabric::WrOp::Read => 1,
                xfer_fabric::WrOp::Notify { .. } => 2,
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

/// Runs `job` to a terminal state: on the device's data-path `worker` when there is one and it
/// takes the job, else on the calling task ([`pump`], polling for up to `spin` before each
/// sleep). Err only if the worker thread died holding the job.
pub async fn drive<L: Leased>(mut job: Job<L>, worker: Option<&Worker<L>>, spin: Duration) -> Result<Done<L>, String> {
    if let Some(w) = worker {
        job = match w.run(job).await {
            Ok(done) => {
                crate::metrics::data_path_job("worker");
                return Ok(done);
            }
            Err(Refused::Busy(job)) => *job,
            Err(Refused::Lost) => return Err("the data-path worker thread stopped".into()),
        };
    }
    let Job { mut machine, mut lease, mut make_wr, mut probe, cancel } = job;
    let mut first_post = None;
    let make = |p: &Post| {
        first_post.get_or_insert_with(Instant::now);
        make_wr(p)
    };
    pump(&mut machine, &mut lease, &cancel, make, |_| {}, probe.as_mut(), spin).await;
    crate::metrics::data_path_job("task");
    Ok(Done { machine, lease, probe, first_post })
}

/// Runs `machine` to a terminal state over `lease`.
pub async fn pump<L: Leased>(
    machine: &mut Machine,
    lease: &mut L,
    cancel: &CancellationToken,
    mut make_wr: impl FnMut(&Post) -> WorkRequest,
    mut on_progress: impl FnMut(u64),
    mut probe: Option<&mut LatencyProbe>,
    spin: Duration,
) {
    let mut reported = 0;
    let mut pending = Vec::new();
    loop {
        while let Some(p) = machine.poll_transmit() {
            if let Some(pr) = probe.as_deref_mut() {
                pr.posted(p.seq);
            }
            pending.push((p.qp, make_wr(&p)));
        }
        if let Err((seqs, reason)) = post_runs(lease.conn().as_ref(), &mut pending) {
            for seq in seqs {
                machine.handle_post_error(seq, reason.clone());
            }
        }
        if machine.is_done() {
            break;
        }
        let deadline = machine.poll_timeout();
        match wait(lease, cancel, deadline, spin, |c| complete(machine, &mut probe, c.qp, c.wr_id, c.status)).await {
            Wake::Completions => {}
            Wake::Closed => machine.handle_post_error(u64::MAX, "connection closed".into()),
            Wake::Cancelled => machine.handle_cancel(),
            Wake::Timeout => machine.handle_timeout(Instant::now()),
        }
        if machine.bytes_done() != reported {
            reported = machine.bytes_done();
            on_progress(reported);
        }
    }
    if machine.bytes_done() != reported {
        on_progress(machine.bytes_done());
    }
}

pub(super) fn complete(machine: &mut Machine, probe: &mut Option<&mut LatencyProbe>, qp: usize, seq: u64, status: xfer_fabric::WcStatus) {
    if let Some(pr) = probe.as_deref_mut() {
        if let Some(t) = pr.posted.remove(&seq) {
            pr.samples.push(t.elapsed());
        }
    }
    machine.handle_completion(qp, seq, status);
}
