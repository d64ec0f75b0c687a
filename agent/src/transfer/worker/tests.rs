//! The worker against a fake device: WRs complete on a "device" thread that only raises an
//! event (unparks the worker) when the connection was armed, like a CQ with a completion
//! channel. The park cap is an hour here, so a lost wake-up hangs the test instead of being
//! papered over by the cap.
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use tokio_util::sync::CancellationToken;

use super::*;
use crate::transfer::job::{LatencyProbe, WrTemplate};
use xfer_engine::batch::Seg;
use xfer_engine::machine::{Fault, Machine, MachineConfig, Markers, PathDown, State};
use xfer_fabric::{Access, Completion, Connection, FabricError, Registration, RemoteKey, WcStatus, WrOp};
use xfer_rdma::memory::RegionMemory;

#[derive(Debug)]
struct Buf(Arc<RegionMemory>);

impl Registration for Buf {
    fn memory(&self) -> &Arc<RegionMemory> {
        &self.0
    }
    fn lkey(&self) -> u32 {
        0
    }
    fn rkey(&self) -> u32 {
        0
    }
    fn access(&self) -> Access {
        Access::ReadWrite
    }
    fn remote_key_exposed(&self) -> bool {
        false
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// What the fake device does with posted WRs.
#[derive(Clone, Copy, PartialEq)]
enum Behaviour {
    /// Completes every signaled WR (in order, from the device thread).
    Complete,
    /// Never completes anything (a stalled peer).
    Stall,
    /// Refuses every post (a broken QP).
    RefusePosts,
    /// Drops its completion sink at the first post (the connection's task ended).
    CloseAtFirstPost,
}

#[derive(Default)]
struct Log {
    posted: Vec<u64>,
    hand_offs: Vec<bool>,
}

struct FakeConn {
    behaviour: Behaviour,
    /// Handed off (taken by `hand_off`): the thread to unpark on an event.
    worker: Mutex<Option<std::thread::Thread>>,
    armed: AtomicBool,
    can_hand_off: bool,
    /// Completions the device produced, waiting to be polled.
    cq: Mutex<VecDeque<Completion>>,
    sink: Mutex<Option<mpsc::UnboundedSender<Completion>>>,
    device: Mutex<Option<std::sync::mpsc::Sender<(usize, u64)>>>,
    log: Mutex<Log>,
    arms: AtomicUsize,
}

impl FakeConn {
    /// The device thread: completes each signaled WR it is handed, raising an event if armed.
    fn start(behaviour: Behaviour, can_hand_off: bool) -> (Arc<FakeConn>, mpsc::UnboundedReceiver<Completion>) {
        let (sink, completions) = mpsc::unbounded_channel();
        let (dev_tx, dev_rx) = std::sync::mpsc::channel::<(usize, u64)>();
        let conn = Arc::new(FakeConn {
            behaviour,
            worker: Mutex::new(None),
            armed: AtomicBool::new(false),
            can_hand_off,
            cq: Mutex::new(VecDeque::new()),
            sink: Mutex::new(Some(sink)),
            device: Mutex::new(Some(dev_tx)),
            log: Mutex::new(Log::default()),
            arms: AtomicUsize::new(0),
        });
        let weak = Arc::downgrade(&conn);
        std::thread::spawn(move || {
            while let Ok((qp, wr_id)) = dev_rx.recv() {
                let Some(c) = weak.upgrade() else { return };
                c.cq.lock().unwrap().push_back(Completion { wr_id, qp, status: WcStatus::Success, byte_len: 0 });
                if c.armed.swap(false, Ordering::AcqRel) {
                    if let Some(t) = c.worker.lock().unwrap().as_ref() {
                        t.unpark();
                    }
                } else if c.worker.lock().unwrap().is_none() {
                    // Not handed off: the fabric's own task would deliver it.
                    c.progress();
                }
            }
        });
        (conn, completions)
    }
}

impl Connection for FakeConn {
    fn qps(&self) -> usize {
        2
    }
    fn post(&self, qp: usize, wr: WorkRequest) -> Result<(), FabricError> {
        match self.behaviour {
            Behaviour::RefusePosts => return Err(FabricError::QpBroken),
            Behaviour::CloseAtFirstPost => {
                self.sink.lock().unwrap().take();
            }
            _ => {}
        }
        self.log.lock().unwrap().posted.push(wr.wr_id);
        if self.behaviour == Behaviour::Complete && wr.signaled {
            if let Some(d) = self.device.lock().unwrap().as_ref() {
                let _ = d.send((qp, wr.wr_id));
            }
        }
        Ok(())
    }
    fn progress(&self) -> usize {
        let mut cq = self.cq.lock().unwrap();
        let n = cq.len();
        let sink = self.sink.lock().unwrap();
        for c in cq.drain(..) {
            if let Some(s) = sink.as_ref() {
                let _ = s.send(c);
            }
        }
        n
    }
    fn hand_off(&self, to: Option<std::thread::Thread>) -> bool {
        if !self.can_hand_off {
            return false;
        }
        self.log.lock().unwrap().hand_offs.push(to.is_some());
        *self.worker.lock().unwrap() = to;
        true
    }
    fn arm_wake(&self) -> bool {
        self.arms.fetch_add(1, Ordering::Relaxed);
        self.armed.store(true, Ordering::Release);
        true
    }
    fn is_broken(&self) -> bool {
        false
    }
    fn close(&self) {}
}

/// The fake's lease; tells `dropped` when it is dropped (discarded).
struct FakeLease {
    conn: Arc<dyn Connection>,
    completions: mpsc::UnboundedReceiver<Completion>,
    dropped: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Leased for FakeLease {
    fn conn(&self) -> &Arc<dyn Connection> {
        &self.conn
    }
    fn completions(&mut self) -> &mut mpsc::UnboundedReceiver<Completion> {
        &mut self.completions
    }
}

impl Drop for FakeLease {
    fn drop(&mut self) {
        if let Some(d) = self.dropped.take() {
            let _ = d.send(());
        }
    }
}

fn worker(spin: Duration) -> Worker<FakeLease> {
    let mut w = Worker::start("test-data-path", spin, tokio::runtime::Handle::current(), None).unwrap();
    w.set_park_cap(Duration::from_secs(3600));
    w
}

/// A WRITE machine of `chunks` 4 KiB chunks over 2 QPs, depth 8, a run of 4 WRs per signal.
fn job(conn: &Arc<FakeConn>, completions: mpsc::UnboundedReceiver<Completion>, chunks: u64, deadline: Option<Instant>) -> Job<FakeLease> {
    let machine = Machine::new(MachineConfig {
        segs: Arc::from([Seg { local: 0, remote: 0, len: chunks * 4096 }]),
        chunk: 4096,
        qps: 2,
        depth: 8,
        signal_every: 4,
        deadline,
        markers: Markers::None,
        path_of: Arc::from([]),
        weights: Vec::new(),
    });
    let buf: Arc<dyn Registration> = Arc::new(Buf(Arc::new(RegionMemory::anonymous(4096, false).unwrap())));
    let wr = WrTemplate { op: WrOp::Write, notify_slot: 0, local: buf, remote_addr: 0, remote_key: RemoteKey::Rkey(1), wrap: None };
    let lease = FakeLease { conn: conn.clone() as Arc<dyn Connection>, completions, dropped: None };
    Job { machine, lease, wr, probe: Some(LatencyProbe::default()), cancel: CancellationToken::new(), progress: None }
}

fn posted(conn: &FakeConn) -> Vec<u64> {
    conn.log.lock().unwrap().posted.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_to_success_on_the_worker_and_its_connection_is_handed_back() {
    for spin in [Duration::ZERO, Duration::from_micros(50)] {
        let w = worker(spin);
        let (conn, rx) = FakeConn::start(Behaviour::Complete, true);
        let done = w.run(job(&conn, rx, 1000, None)).await.ok().unwrap();
        assert_eq!(done.machine.state(), &State::Succeeded, "spin {spin:?}");
        assert_eq!(done.machine.bytes_done(), 1000 * 4096);
        assert_eq!(posted(&conn), (0..1000).collect::<Vec<u64>>(), "every chunk posted once, in order");
        assert_eq!(conn.log.lock().unwrap().hand_offs, vec![true, false], "handed off for the job, then back");
        assert!(done.first_post.is_some());
        // The probe saw the signaled WRs' round trips (250 runs of 4).
        assert_eq!(done.probe.unwrap().samples.len(), 250);
        if spin.is_zero() {
            // Without a spin budget it slept between completions, so it armed.
            assert!(conn.arms.load(Ordering::Relaxed) > 0);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_jobs_share_the_worker_and_all_finish() {
    let w = Arc::new(worker(Duration::ZERO));
    let mut tasks = Vec::new();
    let mut conns = Vec::new();
    for i in 0..16u64 {
        let (conn, rx) = FakeConn::start(Behaviour::Complete, true);
        conns.push(conn.clone());
        let w = w.clone();
        let j = job(&conn, rx, 50 + i * 10, None);
        tasks.push(tokio::spawn(async move { w.run(j).await.ok().unwrap().machine }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let m = t.await.unwrap();
        assert_eq!(m.state(), &State::Succeeded);
        assert_eq!(m.bytes_done(), (50 + i as u64 * 10) * 4096);
        assert_eq!(posted(&conns[i]).len() as u64, 50 + i as u64 * 10);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_ends_a_stalled_job_and_gives_everything_back() {
    let w = worker(Duration::ZERO);
    let (conn, rx) = FakeConn::start(Behaviour::Stall, true);
    let j = job(&conn, rx, 1000, None);
    let cancel = j.cancel.clone();
    let run = tokio::spawn(async move { w.run(j).await.ok().map(|d| (d.machine, d.lease)) });
    // Wait until the worker has filled both windows (2 QPs x depth 8), then cancel.
    while posted(&conn).len() < 16 {
        tokio::task::yield_now().await;
    }
    cancel.cancel();
    let (machine, _lease) = run.await.unwrap().unwrap();
    assert_eq!(machine.state(), &State::Cancelled);
    assert_eq!(posted(&conn).len(), 16, "nothing posted past the windows");
    assert_eq!(conn.log.lock().unwrap().hand_offs, vec![true, false]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_goes_away_cancels_its_job_and_the_lease_is_dropped() {
    let w = worker(Duration::ZERO);
    let (conn, rx) = FakeConn::start(Behaviour::Stall, true);
    let mut j = job(&conn, rx, 1000, None);
    let (dropped_tx, dropped) = tokio::sync::oneshot::channel();
    j.lease.dropped = Some(dropped_tx);
    let run = tokio::spawn(async move {
        let _ = w.run(j).await;
    });
    while posted(&conn).len() < 16 {
        tokio::task::yield_now().await;
    }
    run.abort();
    let _ = run.await;
    // The worker notices at its next turn (the cap is an hour: it must be woken). The abort
    // dropped the receiver, and with it nothing wakes the worker but the next event; the
    // stalled device sends none, so poke it as a completion would.
    if let Some(t) = conn.worker.lock().unwrap().as_ref() {
        t.unpark();
    }
    dropped.await.expect("the lease is dropped on the worker");
    assert_eq!(conn.log.lock().unwrap().hand_offs, vec![true, false]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_posts_a_closed_connection_and_a_passed_deadline_fail_the_job() {
    let w = worker(Duration::ZERO);
    let (conn, rx) = FakeConn::start(Behaviour::RefusePosts, true);
    let m = w.run(job(&conn, rx, 10, None)).await.ok().unwrap().machine;
    // A broken QP takes its path down; with no other path the job fails, the post's reason kept.
    assert!(matches!(m.state(), State::Failed(Fault::NoPath { last: PathDown::Post(_) })), "{:?}", m.state());
    assert!(posted(&conn).is_empty());

    let (conn, rx) = FakeConn::start(Behaviour::CloseAtFirstPost, true);
    let m = w.run(job(&conn, rx, 10, None)).await.ok().unwrap().machine;
    assert_eq!(m.state(), &State::Failed(Fault::Post("connection closed".into())));

    let (conn, rx) = FakeConn::start(Behaviour::Stall, true);
    let m = w.run(job(&conn, rx, 10, Some(Instant::now()))).await.ok().unwrap().machine;
    assert_eq!(m.state(), &State::Failed(Fault::Timeout));
    assert_eq!(conn.log.lock().unwrap().hand_offs, vec![true, false]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_cannot_be_handed_off_runs_on_the_callers_task() {
    let w = worker(Duration::ZERO);
    let (conn, rx) = FakeConn::start(Behaviour::Complete, false);
    let j = match w.run(job(&conn, rx, 100, None)).await {
        Err(Refused::Busy(j)) => *j,
        _ => panic!("a tcp-like connection must be refused"),
    };
    assert!(posted(&conn).is_empty(), "refused untouched");
    let done = crate::transfer::driver::drive(j, Some(&w), Duration::ZERO).await.unwrap();
    assert_eq!(done.machine.state(), &State::Succeeded);
    assert_eq!(done.machine.bytes_done(), 100 * 4096);
    assert!(conn.log.lock().unwrap().hand_offs.is_empty());
}
