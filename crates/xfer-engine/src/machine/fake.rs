//! The machine against a fake fabric that kills paths at every step. P paths × Q QPs, each QP
//! executing its WRs in order at a fake target one step at a time, completions through a CQ.
//! Killing a path makes a prefix of its queued WRs land (none, half, all: RC lands in order, and
//! a lost ack hides what landed) and fails the rest; the machine learns it from the completions,
//! from the driver (an async event), or only when it posts there again (the fabric finds the QP
//! broken), its flushes coming once nothing else moves. The target counts markers like a one-shot
//! grant (fires at N, extras ignored) and checks every byte landed when it fires.
use super::*;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kill {
    Completion,
    Event,
    Post,
}

#[derive(Debug, Clone, Copy)]
enum Land {
    None,
    Half,
    All,
}

struct Fake {
    path_of: Vec<usize>,
    queues: Vec<VecDeque<Post>>,
    cq: VecDeque<(usize, u64, WcStatus)>,
    /// Flushes of a path that died silently, delivered once nothing else moves.
    withheld: VecDeque<(usize, u64, WcStatus)>,
    dead: Vec<bool>,
    mode: Kill,
    /// Per remote byte: landed (bytes outside the segments start landed).
    landed: Vec<bool>,
    /// Each chunk's place as first posted: a chunk posted again must keep it.
    places: BTreeMap<u64, (u64, u64, u32)>,
    markers: u32,
    n: u32,
    fired: u32,
    next: usize,
    /// 0: QPs take turns and every completion is delivered at once; else the seed of a
    /// generator that picks which QP executes and holds completions back.
    rng: u64,
}

impl Fake {
    fn new(c: &MachineConfig, path_of: &[usize], paths: usize, mode: Kill) -> Fake {
        let span = c.segs.iter().map(|s| s.remote + s.len).max().unwrap_or(0);
        let mut landed = vec![true; span as usize];
        for s in c.segs.iter() {
            landed[s.remote as usize..(s.remote + s.len) as usize].fill(false);
        }
        Fake {
            path_of: path_of.to_vec(),
            queues: vec![VecDeque::new(); c.qps],
            cq: VecDeque::new(),
            withheld: VecDeque::new(),
            dead: vec![false; paths],
            mode,
            landed,
            places: BTreeMap::new(),
            markers: 0,
            n: c.qps as u32,
            fired: 0,
            next: 0,
            rng: 0,
        }
    }

    /// Posts what the machine asks for, in order, the way the driver does: a post on a broken QP
    /// fails it and leaves every later WR of the batch unposted.
    fn post_all(&mut self, m: &mut Machine) -> bool {
        let batch: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
        for (i, p) in batch.iter().enumerate() {
            if !p.marker {
                let place = (p.local, p.remote, p.len);
                assert_eq!(*self.places.entry(p.seq).or_insert(place), place, "chunk {} moved", p.seq);
            }
            if self.dead[self.path_of[p.qp]] {
                if self.mode == Kill::Post {
                    let unposted: Vec<u64> = batch[i..].iter().map(|r| r.seq).collect();
                    m.handle_post_failure(p.qp, &unposted, "QP broken".into(), true);
                    break;
                }
                // An errored QP takes the post and flushes it.
                self.cq.push_back((p.qp, p.seq, WcStatus::WrFlushErr));
                continue;
            }
            self.queues[p.qp].push_back(*p);
        }
        !batch.is_empty()
    }

    fn land(&mut self, p: &Post) {
        if p.marker {
            self.markers += 1;
            if self.markers == self.n {
                self.fired += 1;
                let missing = self.landed.iter().filter(|&&b| !b).count();
                assert_eq!(missing, 0, "the notification fired with {missing} bytes not landed");
            }
        } else {
            self.landed[p.remote as usize..(p.remote + p.len as u64) as usize].fill(true);
        }
    }

    /// One WR of the next live QP that has one lands; its completion goes to the CQ.
    fn execute_one(&mut self) -> bool {
        let n = self.queues.len();
        let start = if self.rng == 0 { self.next } else { self.roll() as usize % n };
        for i in 0..n {
            let q = (start + i) % n;
            if self.dead[self.path_of[q]] {
                continue;
            }
            if let Some(p) = self.queues[q].pop_front() {
                self.next = (q + 1) % n;
                self.land(&p);
                if p.signaled {
                    self.cq.push_back((q, p.seq, WcStatus::Success));
                }
                return true;
            }
        }
        false
    }

    /// xorshift64: a reproducible schedule per seed.
    fn roll(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn kill(&mut self, m: &mut Machine, path: usize, land: Land) {
        self.dead[path] = true;
        let qps: Vec<usize> = (0..self.queues.len()).filter(|&q| self.path_of[q] == path).collect();
        for q in qps {
            let queued: Vec<Post> = self.queues[q].drain(..).collect();
            let k = match land {
                Land::None => 0,
                Land::Half => queued.len() / 2,
                Land::All => queued.len(),
            };
            for p in &queued[..k] {
                self.land(p);
            }
            // Landed or not, no ack came: the first fails, the rest are flushed. Only signaled
            // WRs report (a provider may skip unsignaled flushes), so the first error may come
            // after silent WRs that never ran.
            let errs = queued
                .iter()
                .filter(|p| p.signaled)
                .enumerate()
                .map(|(i, p)| (q, p.seq, if i == 0 { WcStatus::RetryExcErr } else { WcStatus::WrFlushErr }));
            match self.mode {
                Kill::Post => self.withheld.extend(errs),
                _ => self.cq.extend(errs),
            }
        }
        if self.mode == Kill::Event {
            m.handle_path_down(path, PathDown::Event("port down".into()));
        }
    }
}

/// A batch of four segments in 15 chunks of at most 4 bytes.
fn config(paths: usize, qps_per_path: usize, markers: Markers) -> MachineConfig {
    let segs: Arc<[Seg]> =
        [(0, 100, 25), (30, 0, 1), (50, 30, 10), (70, 60, 13)].iter().map(|&(local, remote, len)| Seg { local, remote, len }).collect();
    let qps = paths * qps_per_path;
    MachineConfig {
        segs,
        chunk: 4,
        qps,
        depth: 3,
        signal_every: 2,
        deadline: None,
        markers,
        path_of: (0..qps).map(|q| q / qps_per_path).collect(),
        weights: Vec::new(),
    }
}

const TOTAL: u64 = 49;

/// Runs `c` to its end, killing `kills` (step, path); the steps it took.
fn run(c: MachineConfig, kills: &[(usize, usize)], land: Land, mode: Kill) -> (Machine, Fake, usize) {
    run_seeded(c, kills, land, mode, 0)
}

/// [`run`] with the schedule of `seed` (0: QPs in turn, completions at once).
fn run_seeded(c: MachineConfig, kills: &[(usize, usize)], land: Land, mode: Kill, seed: u64) -> (Machine, Fake, usize) {
    run_machine(c, false, kills, land, mode, seed)
}

/// [`run_seeded`], with the markers held after a failover when `hold`.
fn run_machine(c: MachineConfig, hold: bool, kills: &[(usize, usize)], land: Land, mode: Kill, seed: u64) -> (Machine, Fake, usize) {
    let npaths = c.path_of.iter().max().map_or(1, |p| p + 1);
    let path_of = c.path_of.to_vec();
    let mut f = Fake::new(&c, &path_of, npaths, mode);
    f.rng = seed;
    let mut m = Machine::new(c);
    if hold {
        m = m.hold_markers_after_failover();
    }
    let mut step = 0;
    while !m.is_done() {
        let posted = f.post_all(&mut m);
        for &(k, p) in kills {
            if k == step {
                f.kill(&mut m, p, land);
            }
        }
        let moved = f.execute_one();
        // A seeded schedule delivers a random prefix of the CQ (all of it when nothing moved).
        let deliver = if f.rng == 0 || !moved { f.cq.len() } else { f.roll() as usize % (f.cq.len() + 1) };
        let delivered = deliver > 0;
        for _ in 0..deliver {
            let Some((q, seq, status)) = f.cq.pop_front() else { break };
            m.handle_completion(q, seq, status);
        }
        // (Holding the markers can end the machine inside a poll, with nothing posted.)
        if !(posted || moved || delivered || m.is_done()) {
            assert!(!f.withheld.is_empty(), "hang at step {step}: {m:?}");
            f.cq.extend(f.withheld.drain(..));
        }
        step += 1;
        assert!(step < 10_000, "no end");
    }
    (m, f, step)
}

fn assert_whole(m: &Machine, f: &Fake, markers: Markers, what: &str) {
    assert_eq!(m.state(), &State::Succeeded, "{what}");
    assert_eq!(m.bytes_done(), TOTAL, "{what}: every chunk counted once");
    assert_eq!(m.path_bytes().iter().sum::<u64>(), TOTAL, "{what}");
    assert!(f.landed.iter().all(|&b| b), "{what}: a byte never landed");
    let fired = if markers == Markers::None { 0 } else { 1 };
    assert_eq!(f.fired, fired, "{what}: the notification fired {} times", f.fired);
}

/// One path killed at every step, by every means, with none, half or all of its queued WRs
/// landed: the transfer completes on the others, each chunk counted once, every byte landed,
/// and the target's notification fires once, after the last byte.
#[test]
fn a_path_killed_at_any_step_fails_over_without_losing_or_repeating_a_chunk() {
    let (mut runs, mut failed_over, mut extra_markers) = (0, 0, 0);
    for paths in [2, 3] {
        for markers in [Markers::None, Markers::Pipelined, Markers::AfterData] {
            let (_, _, clean) = run(config(paths, 2, markers), &[], Land::All, Kill::Completion);
            for mode in [Kill::Completion, Kill::Event, Kill::Post] {
                for land in [Land::None, Land::Half, Land::All] {
                    for victim in [0, paths - 1] {
                        for k in 0..=clean {
                            let what = format!("{paths} paths, {markers:?}, {mode:?}, {land:?}, path {victim} at step {k}");
                            let (mut m, f, _) = run(config(paths, 2, markers), &[(k, victim)], land, mode);
                            assert_whole(&m, &f, markers, &what);
                            // The machine heard of the death at most once, as the victim's.
                            let events: Vec<PathEvent> = std::iter::from_fn(|| m.poll_event()).collect();
                            assert!(
                                events.len() <= 1 && events.iter().all(|PathEvent::Down { path, .. }| *path == victim),
                                "{what}: {events:?}"
                            );
                            assert_eq!(m.paths_up(), paths - events.len(), "{what}");
                            assert!(m.failovers() as usize <= events.len(), "{what}");
                            runs += 1;
                            failed_over += m.failovers();
                            extra_markers += u32::from(f.markers > f.n);
                        }
                    }
                }
            }
        }
    }
    // The enumeration reached what it is for: chunks re-posted, and markers that landed on a
    // dying path and were sent again (the target saw more than N).
    assert!(
        runs > 1000 && failed_over > 500 && extra_markers > 50,
        "{runs} runs, {failed_over} failovers, {extra_markers} with extra markers"
    );
}

/// Markers held after a failover (what a session asks): a path killed at any step, by any means,
/// still lands every chunk once; the marker count at the target reaches N at most once and only
/// after the last byte (the fake asserts it), and whenever a failover happened before the
/// markers all went out, the machine says it held them (`Peer.Complete` then publishes after
/// the end-to-end check). Without a failover (or a path that had carried bytes lost) nothing is
/// held.
#[test]
fn markers_held_after_a_failover_leave_the_notification_to_the_complete() {
    let (mut held, mut fired) = (0, 0);
    for markers in [Markers::Pipelined, Markers::AfterData] {
        let (m, f, clean) = run_machine(config(2, 2, markers), true, &[], Land::All, Kill::Completion, 0);
        assert!(!m.markers_held() && f.fired == 1, "{markers:?}: no failover, nothing held");
        for mode in [Kill::Completion, Kill::Event, Kill::Post] {
            for land in [Land::None, Land::Half, Land::All] {
                for k in 0..=clean {
                    let what = format!("{markers:?}, {mode:?}, {land:?}, path 1 at step {k}");
                    let (m, f, _) = run_machine(config(2, 2, markers), true, &[(k, 1)], land, mode, 0);
                    assert_eq!(m.state(), &State::Succeeded, "{what}");
                    assert_eq!(m.bytes_done(), TOTAL, "{what}: every chunk counted once");
                    assert!(f.landed.iter().all(|&b| b), "{what}: a byte never landed");
                    assert!(f.fired <= 1, "{what}: fired {} times", f.fired);
                    assert!(f.fired == 1 || m.markers_held(), "{what}: neither the markers nor the Complete announce it");
                    if !m.must_verify() {
                        assert!(!m.markers_held(), "{what}: held without a failover or a used path lost");
                    }
                    held += u32::from(m.markers_held());
                    fired += f.fired;
                }
            }
        }
    }
    assert!(held > 20 && fired > 20, "the enumeration reached both ends: {held} held, {fired} fired");
}

/// Two of three paths, killed at every pair of nearby steps: the third carries it.
#[test]
fn two_of_three_paths_killed_leave_the_third_to_finish() {
    for markers in [Markers::Pipelined, Markers::AfterData] {
        let (_, _, clean) = run(config(3, 2, markers), &[], Land::All, Kill::Completion);
        for mode in [Kill::Completion, Kill::Event, Kill::Post] {
            for land in [Land::None, Land::All] {
                for k in 0..=clean {
                    for d in [0, 1, 3, 7] {
                        let what = format!("{markers:?}, {mode:?}, {land:?}, paths 0, 2 at steps {k}, {}", k + d);
                        let (m, f, _) = run(config(3, 2, markers), &[(k, 0), (k + d, 2)], land, mode);
                        assert_whole(&m, &f, markers, &what);
                        assert_eq!(m.path_bytes()[1] + m.path_bytes()[0] + m.path_bytes()[2], TOTAL);
                    }
                }
            }
        }
    }
}

/// Every path killed: the transfer fails with `NoPath` (or succeeds when the last kill came
/// after the end), never hangs, and leaves nothing outstanding.
#[test]
fn every_path_killed_fails_with_no_path_and_no_hang() {
    for markers in [Markers::None, Markers::Pipelined, Markers::AfterData] {
        let (_, _, clean) = run(config(2, 2, markers), &[], Land::All, Kill::Completion);
        for mode in [Kill::Completion, Kill::Event, Kill::Post] {
            for land in [Land::None, Land::Half, Land::All] {
                for k in 0..clean {
                    for d in [0, 1, 2, 5] {
                        let what = format!("{markers:?}, {mode:?}, {land:?}, steps {k}, {}", k + d);
                        let (mut m, f, _) = run(config(2, 2, markers), &[(k, 0), (k + d, 1)], land, mode);
                        match m.state().clone() {
                            State::Succeeded => assert_whole(&m, &f, markers, &what),
                            State::Failed(Fault::NoPath { .. }) => {
                                assert_eq!(m.poll_transmit(), None, "{what}");
                                assert_eq!(m.outstanding(), 0, "{what}");
                                assert_eq!(m.paths_up(), 0, "{what}");
                                assert!(m.bytes_done() <= TOTAL, "{what}");
                                assert!(f.fired <= 1, "{what}");
                            }
                            other => panic!("{what}: {other:?}"),
                        }
                    }
                }
            }
        }
    }
    // Killed before anything moved: it fails, and says why the last path went.
    let (m, f, _) = run(config(2, 2, Markers::Pipelined), &[(0, 0), (0, 1)], Land::None, Kill::Event);
    assert_eq!(m.state(), &State::Failed(Fault::NoPath { last: PathDown::Event("port down".into()) }));
    assert_eq!(f.fired, 0);
}

fn one_seg(total: u64, qps: usize, path_of: &[usize], weights: Vec<u32>) -> MachineConfig {
    MachineConfig {
        segs: Arc::from([Seg { local: 0, remote: 0, len: total }]),
        chunk: 1,
        qps,
        depth: 1000,
        signal_every: 4,
        deadline: None,
        markers: Markers::None,
        path_of: path_of.into(),
        weights,
    }
}

/// Weights 3:1 with room everywhere: path 0 gets 75% of the bytes, within one run.
#[test]
fn weighted_striping_sends_proportional_bytes() {
    for (weights, share) in [(vec![3, 1], 300), (vec![1, 1], 200), (vec![1, 3], 100)] {
        let mut m = Machine::new(one_seg(400, 4, &[0, 0, 1, 1], weights.clone()));
        let posts: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
        assert_eq!(posts.len(), 400, "all posted: the windows are deep");
        let on0 = posts.iter().filter(|p| p.qp < 2).map(|p| p.len as u64).sum::<u64>();
        assert!(on0.abs_diff(share) <= 4, "{weights:?}: {on0} of 400 on path 0");
        // Both QPs of a path share its runs.
        assert!(posts.iter().any(|p| p.qp == 0) && posts.iter().any(|p| p.qp == 1), "{weights:?}");
        for p in posts.iter().filter(|p| p.signaled) {
            m.handle_completion(p.qp, p.seq, WcStatus::Success);
        }
        assert_eq!(m.state(), &State::Succeeded);
        assert!(m.path_bytes()[0].abs_diff(share) <= 4, "{weights:?}: {:?}", m.path_bytes());
        assert_eq!(m.path_bytes().iter().sum::<u64>(), 400);
    }
}

/// A weight-0 path is standby: nothing goes there while a positive-weight path is up, and it
/// takes over when that one goes.
#[test]
fn a_standby_path_carries_only_once_the_others_are_down() {
    let c = || MachineConfig { weights: vec![1, 0], ..config(2, 2, Markers::Pipelined) };
    let (m, f, clean) = run(c(), &[], Land::All, Kill::Completion);
    assert_whole(&m, &f, Markers::Pipelined, "no kill");
    assert_eq!(m.path_bytes(), &[TOTAL, 0]);
    for k in 0..clean {
        let (m, f, _) = run(c(), &[(k, 0)], Land::Half, Kill::Event);
        assert_whole(&m, &f, Markers::Pipelined, &format!("path 0 at step {k}"));
        assert!(m.path_bytes()[1] > 0 || m.path_bytes()[0] == TOTAL, "{k}: {:?}", m.path_bytes());
    }
}

/// A post that failed without breaking the QP fails the transfer; one that broke it takes its
/// path down, and the WRs the same failure left unposted on other QPs go out again.
#[test]
fn post_errors_fail_the_transfer_or_the_path() {
    let mut m = Machine::new(one_seg(16, 4, &[0, 0, 1, 1], vec![]));
    let p = m.poll_transmit().unwrap();
    m.handle_post_failure(p.qp, &[p.seq], "out of memory".into(), false);
    assert_eq!(m.state(), &State::Failed(Fault::Post("out of memory".into())));

    let mut m = Machine::new(one_seg(16, 4, &[0, 0, 1, 1], vec![]));
    let posts: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
    assert_eq!(posts.len(), 16);
    // Runs go to path 0, 1, 0, 1: the second run on path 0 (on QP 1) failed to post (QP
    // broken), so it and every later WR (path 1's second run) were not posted.
    assert_eq!(posts.iter().map(|p| p.qp).step_by(4).collect::<Vec<_>>(), vec![0, 2, 1, 3]);
    let at = posts.iter().position(|p| p.qp == 1).unwrap();
    let (failed, unposted) = (posts[at], &posts[at..]);
    let seqs: Vec<u64> = unposted.iter().map(|p| p.seq).collect();
    m.handle_post_failure(failed.qp, &seqs, "QP broken".into(), true);
    assert_eq!(m.paths_up(), 1);
    assert_eq!(
        m.poll_event(),
        Some(PathEvent::Down { path: 0, reason: PathDown::Post("QP broken".into()), requeued: 4 }),
        "QP 0's run was in flight on path 0; QP 1's never reached it"
    );
    assert_eq!(m.poll_event(), None);
    assert_eq!(m.failovers(), 1);
    // Completions of what did get posted, then of the re-posts: all on path 1, each chunk once.
    let mut seqs: Vec<u64> = posts[..at].iter().filter(|p| p.qp >= 2).map(|p| p.seq).collect();
    let mut guard = 0;
    while !m.is_done() {
        for p in posts[..at].iter().filter(|p| p.qp >= 2 && p.signaled) {
            m.handle_completion(p.qp, p.seq, WcStatus::Success);
        }
        let again: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
        assert!(again.iter().all(|p| p.qp >= 2), "{again:?}");
        seqs.extend(again.iter().map(|p| p.seq));
        for p in again.iter().filter(|p| p.signaled) {
            m.handle_completion(p.qp, p.seq, WcStatus::Success);
        }
        guard += 1;
        assert!(guard < 100);
    }
    assert_eq!(m.state(), &State::Succeeded);
    assert_eq!(m.bytes_done(), 16);
    assert_eq!(m.path_bytes(), &[0, 16]);
    seqs.sort_unstable();
    assert_eq!(seqs, (0..16).collect::<Vec<u64>>(), "every chunk posted once more, with its seq");
}

/// A path found broken by a post: the WRs it had in flight (k) are requeued from it and make it
/// a failover; the refused WRs and those after them (m, never posted there) simply go out on the
/// other path. With nothing in flight it is no failover and leaves nothing to verify; it used to
/// count the refused WRs as requeued (k + m) and as a failover.
#[test]
fn a_path_found_broken_at_post_counts_only_the_wrs_it_had_in_flight() {
    for in_flight in [0usize, 4] {
        let mut m = Machine::new(one_seg(16, 4, &[0, 0, 1, 1], vec![]));
        let posts: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
        // Runs of 4 go to QPs 0, 2, 1, 3 (paths 0, 1, 0, 1). The failed post is path 0's first
        // run (nothing of it in flight) or its second (QP 0's run in flight).
        let on_path0: Vec<usize> = (0..posts.len()).filter(|&i| posts[i].qp < 2).collect();
        let at = on_path0[in_flight];
        let unposted: Vec<u64> = posts[at..].iter().map(|p| p.seq).collect();
        m.handle_post_failure(posts[at].qp, &unposted, "QP broken".into(), true);
        let what = format!("{in_flight} in flight, {} refused", unposted.len());
        match m.poll_event() {
            Some(PathEvent::Down { path: 0, requeued, .. }) => assert_eq!(requeued as usize, in_flight, "{what}"),
            other => panic!("{what}: {other:?}"),
        }
        assert_eq!(m.failovers(), u32::from(in_flight > 0), "{what}");
        assert_eq!(m.must_verify(), in_flight > 0, "{what}");
        if in_flight > 0 {
            continue;
        }
        // Everything goes out on path 1 and succeeds, unverified.
        let mut guard = 0;
        while !m.is_done() {
            let again: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
            assert!(again.iter().all(|p| p.qp >= 2), "{again:?}");
            for p in again.iter().filter(|p| p.signaled) {
                m.handle_completion(p.qp, p.seq, WcStatus::Success);
            }
            guard += 1;
            assert!(guard < 100);
        }
        assert_eq!((m.state(), m.bytes_done(), m.failovers(), m.must_verify()), (&State::Succeeded, 16, 0, false));
    }
}

/// A path reported down while nothing of the transfer was on it: an event, no failover. A map
/// naming paths that cannot exist puts those QPs on path 0 instead of growing a table.
#[test]
fn an_idle_path_going_down_is_an_event_only_and_bad_maps_are_bounded() {
    let mut m = Machine::new(one_seg(4, 2, &[0, 1], vec![1, 0]));
    let posts: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
    assert!(posts.iter().all(|p| p.qp == 0));
    m.handle_path_down(1, PathDown::Event("port 1 down".into()));
    m.handle_path_down(1, PathDown::Event("again".into()));
    m.handle_path_down(7, PathDown::Event("no such path".into()));
    assert_eq!(m.poll_event(), Some(PathEvent::Down { path: 1, reason: PathDown::Event("port 1 down".into()), requeued: 0 }));
    assert_eq!(m.poll_event(), None);
    assert_eq!((m.paths_up(), m.failovers()), (1, 0));
    for p in posts.iter().filter(|p| p.signaled) {
        m.handle_completion(p.qp, p.seq, WcStatus::Success);
    }
    assert_eq!(m.state(), &State::Succeeded);
    assert!(!m.must_verify(), "a path that carried nothing proves nothing wrong");

    // A path that retired bytes and then went down with nothing outstanding: what it reported
    // is proven only by a checksum.
    let mut m = Machine::new(one_seg(8, 2, &[0, 1], vec![1, 1]));
    let posts: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
    assert!(posts.iter().any(|p| p.qp == 1), "{posts:?}");
    for p in posts.iter().filter(|p| p.signaled && p.qp == 1) {
        m.handle_completion(p.qp, p.seq, WcStatus::Success);
    }
    assert_eq!(m.outstanding(), posts.iter().filter(|p| p.qp == 0).count(), "path 1 has nothing outstanding");
    m.handle_path_down(1, PathDown::Event("port 1 down".into()));
    assert_eq!(m.failovers(), 0, "nothing of it went again");
    assert!(m.must_verify());

    let m = Machine::new(one_seg(4, 3, &[usize::MAX, 2, 1 << 40], vec![]));
    assert_eq!(m.paths_up(), 2, "QPs 0 and 2 on path 0, QP 1 on path 2");
    assert_eq!(m.path_bytes().len(), 3);
}

/// Random schedules: which QP executes next and how long completions wait are drawn per seed,
/// and so are the killed path, the step, how it dies and what of it landed. The same
/// guarantees hold.
#[test]
fn random_schedules_and_kills_keep_every_guarantee() {
    let modes = [Kill::Completion, Kill::Event, Kill::Post];
    let lands = [Land::None, Land::Half, Land::All];
    let markers = [Markers::None, Markers::Pipelined, Markers::AfterData];
    let (mut failovers, mut extra_markers) = (0, 0);
    for seed in 1..=3000u64 {
        let mut r = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut draw = |n: usize| {
            r ^= r << 13;
            r ^= r >> 7;
            r ^= r << 17;
            (r % n as u64) as usize
        };
        let paths = 2 + draw(2);
        let mk = markers[draw(3)];
        let (mode, land) = (modes[draw(3)], lands[draw(3)]);
        let kills: Vec<(usize, usize)> = (0..1 + draw(paths - 1)).map(|_| (draw(40), draw(paths))).collect();
        let what = format!("seed {seed}: {paths} paths, {mk:?}, {mode:?}, {land:?}, kills {kills:?}");
        let (m, f, _) = run_seeded(config(paths, 1 + draw(2), mk), &kills, land, mode, seed);
        assert_whole(&m, &f, mk, &what);
        failovers += m.failovers();
        extra_markers += u32::from(f.markers > f.n);
    }
    assert!(failovers > 1000 && extra_markers > 50, "{failovers} failovers, {extra_markers} runs with extra markers");
}
