//! The one driver of the data path: runs a [`Job`] — a transfer's data phase, a channel batch
//! or a benchmark phase — to a terminal state, on the device's data-path worker when there is
//! one and it takes the job, else on the calling task ([`pump`]: posts what the machine asks
//! for, feeds it completions in batches, cancellation and time, and reports progress).
//! Whatever is specific to the caller comes in the job: its WR template, its probe, its cancel
//! switch and its progress callback.
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::job::{complete, path_bytes, path_events, post_runs, Done, Job, LatencyProbe, Leased, WrTemplate};
use super::worker::{Refused, Worker};
use xfer_engine::machine::Machine;
use xfer_fabric::Completion;

/// What woke the driver while it waited.
enum Wake {
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
async fn wait<L: Leased>(
    lease: &mut L,
    cancel: &CancellationToken,
    deadline: Option<Instant>,
    spin: Duration,
    mut on_completion: impl FnMut(Completion),
) -> Wake {
    if !spin.is_zero() {
        let until = xfer_common::deadline::instant_after(spin);
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

/// Runs `job` to a terminal state: on the device's data-path `worker` when there is one and it
/// takes the job, else on the calling task ([`pump`], polling for up to `spin` before each
/// sleep). Err only if the worker thread died holding the job.
pub async fn drive<L: Leased>(mut job: Job<L>, worker: Option<&Worker<L>>, spin: Duration) -> Result<Done<L>, String> {
    if let Some(w) = worker {
        job = match w.run(job).await {
            Ok(mut done) => {
                crate::metrics::data_path_job("worker");
                // A path lost in the worker's last step (the one that ended the job) is still
                // unlogged: the worker drains events only while the job runs.
                path_events(&mut done.machine, done.lease.conn().as_ref());
                path_bytes(&done.machine, done.lease.conn().as_ref());
                return Ok(done);
            }
            Err(Refused::Busy(job)) => *job,
            Err(Refused::Lost) => return Err("the data-path worker thread stopped".into()),
        };
    }
    let Job { mut machine, mut lease, wr, mut probe, cancel, mut progress } = job;
    let mut first_post = None;
    let report = |bytes| {
        if let Some(p) = progress.as_mut() {
            p(bytes)
        }
    };
    pump(&mut machine, &mut lease, &cancel, &wr, &mut first_post, report, probe.as_mut(), spin).await;
    path_events(&mut machine, lease.conn().as_ref());
    path_bytes(&machine, lease.conn().as_ref());
    crate::metrics::data_path_job("task");
    Ok(Done { machine, lease, probe, first_post })
}

/// Runs `machine` to a terminal state over `lease`, its WRs built from `wr`; `first_post` is set
/// when the first goes out.
#[allow(clippy::too_many_arguments)]
async fn pump<L: Leased>(
    machine: &mut Machine,
    lease: &mut L,
    cancel: &CancellationToken,
    wr: &WrTemplate,
    first_post: &mut Option<Instant>,
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
            first_post.get_or_insert_with(Instant::now);
            pending.push((p.qp, wr.wr(&p)));
        }
        if let Err(f) = post_runs(lease.conn().as_ref(), &mut pending) {
            f.tell(machine);
        }
        path_events(machine, lease.conn().as_ref());
        // Progress is told only once the window is refilled: telling it wakes the record's
        // watchers, and the WRs that completions made room for must not wait behind that.
        if machine.bytes_done() != reported {
            reported = machine.bytes_done();
            on_progress(reported);
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
    }
    if machine.bytes_done() != reported {
        on_progress(machine.bytes_done());
    }
}
