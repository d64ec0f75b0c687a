//! The tokio driver of the transfer [`Machine`]: posts what the machine asks for, feeds it
//! completions (in batches), cancellation and time, and reports progress. Used by transfers and
//! by the data-path benchmark alike.
use std::collections::HashMap;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::machine::{Machine, Post};
use crate::fabric::{Completion, WorkRequest};
use crate::peers::Lease;

/// Per-WR round-trip times, for the latency benchmark.
#[derive(Default)]
pub struct LatencyProbe {
    posted: HashMap<u64, Instant>,
    pub samples: Vec<Duration>,
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
/// `deadline`.
pub async fn wait(
    lease: &mut Lease,
    cancel: &CancellationToken,
    deadline: Option<Instant>,
    mut on_completion: impl FnMut(Completion),
) -> Wake {
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

/// Runs `machine` to a terminal state over `lease`.
pub async fn pump(
    machine: &mut Machine,
    lease: &mut Lease,
    cancel: &CancellationToken,
    mut make_wr: impl FnMut(&Post) -> WorkRequest,
    mut on_progress: impl FnMut(u64),
    mut probe: Option<&mut LatencyProbe>,
) {
    let mut reported = 0;
    loop {
        while let Some(p) = machine.poll_transmit() {
            if let Some(pr) = probe.as_deref_mut() {
                pr.posted.insert(p.seq, Instant::now());
            }
            if let Err(e) = lease.conn().post(p.qp, make_wr(&p)) {
                machine.handle_post_error(p.seq, e.to_string());
                break;
            }
        }
        if machine.is_done() {
            break;
        }
        let deadline = machine.poll_timeout();
        match wait(lease, cancel, deadline, |c| complete(machine, &mut probe, c.qp, c.wr_id, c.status)).await {
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

fn complete(machine: &mut Machine, probe: &mut Option<&mut LatencyProbe>, qp: usize, seq: u64, status: crate::fabric::WcStatus) {
    if let Some(pr) = probe.as_deref_mut() {
        if let Some(t) = pr.posted.remove(&seq) {
            pr.samples.push(t.elapsed());
        }
    }
    machine.handle_completion(qp, seq, status);
}
