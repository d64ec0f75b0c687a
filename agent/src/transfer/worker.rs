//! The data-path worker: one OS thread per device that drives transfer [`Machine`]s itself. It
//! posts their work requests (one doorbell per run), polls their connections' completion queues
//! and feeds the machines completions, cancellation and time — so a completion costs no tokio
//! wake-up and no task hop, only the worker's own loop. The tokio side pays one wake-up per
//! *batch*: when the job comes back.
//!
//! The shape follows fabric-lib's per-device worker (a thread that owns the data path, fed by a
//! bounded channel, busy-polling while work is outstanding) with Mooncake's idle behaviour (it
//! sleeps when there is nothing to do):
//! - **Spin, then sleep.** While jobs are outstanding the worker busy-polls for up to
//!   `verbs.poll_spin` after the last thing that happened. Past that it arms each job's
//!   connection ([`xfer_fabric::Connection::arm_wake`]), polls once more (a completion before the arm raised
//!   nothing) and parks; the connection's completion task unparks it on the next completion
//!   event. New jobs, cancels and closed connections unpark it too; a deadline bounds the park.
//!   Idle (no jobs), it blocks on its queue and costs nothing.
//! - **Hand-off.** A job's connection is handed to the worker ([`xfer_fabric::Connection::hand_off`]) for the
//!   job's life: only the worker polls it, and the fabric's completion task stands down. A
//!   fabric without that mode (tcp, whose completions come from its stream readers) refuses, and
//!   the job runs on the caller's task instead (the driver's own loop), as it does when the queue is
//!   full or the worker is off (`verbs.worker = false`).
//! - **Bounded.** The queue holds [`QUEUE`] jobs; a full queue is not an error, the caller drives
//!   the job itself. Jobs are stepped round-robin, so one large batch does not starve a small
//!   one.
//!
//! Every job comes back, whatever happens: its machine (terminal), its lease and its probe. A
//! caller that went away (its future dropped) cancels its job; the lease then drops on this
//! thread, inside the runtime (the worker enters the runtime's handle), so discarding the
//! connection still tells the peer.
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::job::{complete, path_events, post_runs, Done, Job, Leased};
use xfer_fabric::WorkRequest;

/// Jobs waiting for the worker; past this the caller drives its own.
pub const QUEUE: usize = 256;
/// Longest park when every connection is armed and no deadline is nearer: only a caller that
/// dropped its future without cancelling waits this long to be noticed.
const PARK_ARMED: Duration = Duration::from_millis(100);
/// Longest park when a connection could not be armed (it is polled again after this).
const PARK_UNARMED: Duration = Duration::from_micros(200);

struct Running<L> {
    job: Job<L>,
    reply: oneshot::Sender<Done<L>>,
    reported: u64,
    pending: Vec<(usize, WorkRequest)>,
    first_post: Option<Instant>,
    cancelled: bool,
}

/// The worker thread of one device. Dropping it stops the thread once its jobs are done.
pub struct Worker<L: Leased> {
    tx: Option<SyncSender<Running<L>>>,
    /// Longest park with every connection armed ([`PARK_ARMED`]; tests raise it so that a lost
    /// wake-up hangs instead of being covered by the cap).
    #[cfg_attr(not(test), allow(dead_code))]
    park_cap: Arc<std::sync::atomic::AtomicU64>,
    thread: Thread,
    join: Option<JoinHandle<()>>,
}

impl<L: Leased> Worker<L> {
    /// Starts the thread `name`, which busy-polls for up to `spin` after each event, pinned to
    /// the CPUs `pin` if given (a thread that cannot be pinned runs unpinned, with a warning).
    /// Dropped leases are discarded inside `runtime`.
    pub fn start(
        name: &str,
        spin: Duration,
        runtime: tokio::runtime::Handle,
        pin: Option<std::collections::BTreeSet<usize>>,
    ) -> std::io::Result<Worker<L>> {
        let (tx, rx) = mpsc::sync_channel::<Running<L>>(QUEUE);
        let park_cap = Arc::new(std::sync::atomic::AtomicU64::new(PARK_ARMED.as_micros() as u64));
        let cap = park_cap.clone();
        let join = std::thread::Builder::new().name(name.to_string()).spawn(move || {
            if let Some(cpus) = pin {
                if let Err(e) = crate::cpus::pin_current_thread(&cpus) {
                    tracing::warn!(error = %e, "the data-path worker runs unpinned");
                }
            }
            let _rt = runtime.enter();
            run(rx, spin, &cap);
        })?;
        Ok(Worker { tx: Some(tx), park_cap, thread: join.thread().clone(), join: Some(join) })
    }

    #[cfg(test)]
    fn set_park_cap(&mut self, cap: Duration) {
        self.park_cap.store(cap.as_micros() as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Runs `job` on the worker and returns it done; [`Refused::Busy`] hands it back untouched
    /// when the worker cannot take it (queue full, thread gone, or a connection that cannot be
    /// handed off), for the caller to drive itself.
    /// The job's progress callback is told the bytes done as they change (on this thread).
    pub async fn run(&self, job: Job<L>) -> Result<Done<L>, Refused<L>> {
        let Some(tx) = &self.tx else { return Err(Refused::Busy(Box::new(job))) };
        if !job.lease.conn().hand_off(Some(self.thread.clone())) {
            return Err(Refused::Busy(Box::new(job)));
        }
        let cancel = job.cancel.clone();
        let (reply, mut done) = oneshot::channel();
        let mut running = Running { job, reply, reported: 0, pending: Vec::new(), first_post: None, cancelled: false };
        // The first WRs go out from here, so the batch's start does not wait for the worker
        // thread to be scheduled (milliseconds on a busy 2-vCPU VM); the worker takes over from
        // their completions on (handed off already, so they wait in the CQ for its first poll).
        running.post();
        if let Err(TrySendError::Full(r) | TrySendError::Disconnected(r)) = tx.try_send(running) {
            r.job.lease.conn().hand_off(None);
            return Err(Refused::Busy(Box::new(r.job)));
        }
        self.thread.unpark();
        tokio::select! {
            r = &mut done => return r.map_err(|_| Refused::Lost),
            _ = cancel.cancelled() => self.thread.unpark(),
        }
        done.await.map_err(|_| Refused::Lost)
    }
}

/// Why [`Worker::run`] did not run a job.
pub enum Refused<L> {
    /// Not taken: drive it yourself.
    Busy(Box<Job<L>>),
    /// Taken, and the worker thread died with it (a bug: the thread does not panic on purpose).
    Lost,
}

impl<L: Leased> Drop for Worker<L> {
    fn drop(&mut self) {
        // Closing the queue ends the thread once its jobs are done.
        self.tx = None;
        self.thread.unpark();
        // Joined unless this is the worker itself (a job's closure held the last owner).
        if let Some(j) = self.join.take().filter(|_| std::thread::current().id() != self.thread.id()) {
            let _ = j.join();
        }
    }
}

/// The thread's loop (see the module docs).
fn run<L: Leased>(rx: Receiver<Running<L>>, spin: Duration, park_cap: &std::sync::atomic::AtomicU64) {
    let mut jobs: Vec<Running<L>> = Vec::new();
    let mut last_event = Instant::now();
    let mut open = true;
    loop {
        // Intake: block for work when there is none, else take what is queued.
        while open {
            let next = if jobs.is_empty() { rx.recv().map_err(|_| TryRecvError::Disconnected) } else { rx.try_recv() };
            match next {
                Ok(r) => {
                    jobs.push(r);
                    last_event = Instant::now();
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        if jobs.is_empty() {
            if open {
                continue;
            }
            return;
        }
        if step_all(&mut jobs) {
            last_event = Instant::now();
            continue;
        }
        if last_event.elapsed() < spin {
            std::hint::spin_loop();
            continue;
        }
        // Sleep: arm every connection, look once more, then park until woken or a deadline.
        let mut armed = true;
        for r in &jobs {
            armed &= r.job.lease.conn().arm_wake();
        }
        if step_all(&mut jobs) {
            last_event = Instant::now();
            continue;
        }
        let now = Instant::now();
        let cap = if armed { Duration::from_micros(park_cap.load(std::sync::atomic::Ordering::Relaxed)) } else { PARK_UNARMED };
        let until =
            jobs.iter().filter_map(|r| r.job.machine.poll_timeout()).min().map_or(cap, |d| d.saturating_duration_since(now).min(cap));
        std::thread::park_timeout(until);
    }
}

/// Steps every job once and sends back the finished ones; true if anything happened.
fn step_all<L: Leased>(jobs: &mut Vec<Running<L>>) -> bool {
    let now = Instant::now();
    let mut moved = false;
    let mut i = 0;
    while i < jobs.len() {
        let (m, finished) = jobs[i].step(now);
        moved |= m;
        if finished {
            jobs.swap_remove(i).finish();
            moved = true;
        } else {
            i += 1;
        }
    }
    moved
}

impl<L: Leased> Running<L> {
    /// Posts what the machine asks for, feeds it what arrived; `(anything happened, done)`.
    /// Posts every WR the machine's windows allow (one doorbell per run); true if it posted.
    fn post(&mut self) -> bool {
        let machine = &mut self.job.machine;
        while let Some(p) = machine.poll_transmit() {
            if let Some(pr) = self.job.probe.as_mut() {
                pr.posted(p.seq);
            }
            self.first_post.get_or_insert_with(Instant::now);
            self.pending.push((p.qp, self.job.wr.wr(&p)));
        }
        if self.pending.is_empty() {
            return false;
        }
        if let Err(f) = post_runs(self.job.lease.conn().as_ref(), &mut self.pending) {
            f.tell(machine);
        }
        true
    }

    fn step(&mut self, now: Instant) -> (bool, bool) {
        let mut moved = false;
        if !self.cancelled && (self.job.cancel.is_cancelled() || self.reply.is_closed()) {
            self.cancelled = true;
            self.job.machine.handle_cancel();
            moved = true;
        }
        moved |= self.post();
        let machine = &mut self.job.machine;
        if machine.is_done() {
            return (moved, true);
        }
        self.job.lease.conn().progress();
        loop {
            match self.job.lease.completions().try_recv() {
                Ok(c) => {
                    complete(machine, &mut self.job.probe.as_mut(), c.qp, c.wr_id, c.status);
                    moved = true;
                }
                Err(tokio::sync::mpsc::error::TryRecvError::Empty) => break,
                Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => {
                    machine.handle_post_error(u64::MAX, "connection closed".into());
                    moved = true;
                    break;
                }
            }
        }
        if machine.poll_timeout().is_some_and(|d| now >= d) {
            machine.handle_timeout(now);
            moved = true;
        }
        path_events(machine, self.job.lease.conn().as_ref());
        if let Some(report) = self.job.progress.as_mut() {
            if machine.bytes_done() != self.reported {
                self.reported = machine.bytes_done();
                report(self.reported);
            }
        }
        (moved, machine.is_done())
    }

    /// Gives the connection back to its fabric and the job back to its caller.
    fn finish(mut self) {
        if let Some(report) = self.job.progress.as_mut() {
            if self.job.machine.bytes_done() != self.reported {
                report(self.job.machine.bytes_done());
            }
        }
        self.job.lease.conn().hand_off(None);
        let done = Done { machine: self.job.machine, lease: self.job.lease, probe: self.job.probe, first_post: self.first_post };
        // A caller that went away drops `done` here, and with it the lease (discarded).
        let _ = self.reply.send(done);
    }
}

#[cfg(test)]
mod tests;
