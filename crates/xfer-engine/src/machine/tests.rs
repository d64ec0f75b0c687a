//! The chunk machine on one path: chunking, windows, signalling, markers, faults.
use super::*;
use std::time::Duration;

fn cfg(total: u64, chunk: u64, qps: usize, depth: usize, signal_every: usize) -> MachineConfig {
    let segs: Arc<[Seg]> = if total == 0 { Arc::from([]) } else { Arc::from([Seg { local: 0, remote: 0, len: total }]) };
    MachineConfig {
        segs,
        chunk,
        qps,
        depth,
        signal_every,
        deadline: None,
        markers: Markers::None,
        path_of: Arc::from([]),
        weights: Vec::new(),
    }
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
                        // Complete the oldest signaled WR of the fullest window (a device reports
                        // a QP's signaled WRs in order).
                        let q = (0..qps).max_by_key(|&q| m.windows[q].len()).unwrap();
                        let oldest = m.windows[q].iter().find(|o| o.signaled).map(|o| o.chunk.seq).unwrap();
                        m.handle_completion(q, oldest, WcStatus::Success);
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

/// A device that reports a signaled WR complete while an earlier signaled WR on the same QP has
/// not reported broke the queue's order: nothing on that path counts as landed. With one path
/// the transfer fails (never succeeds with a chunk no completion proved); with two, the path's
/// WRs (the one reported too) go out again on the other and every chunk is counted once.
#[test]
fn an_out_of_order_success_takes_the_path_down_instead_of_retiring_what_it_skipped() {
    // One path, every WR signaled: report the second before the first.
    let mut m = Machine::new(cfg(4 * 100, 100, 1, 4, 1));
    let posts: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
    assert_eq!(posts.len(), 4);
    m.handle_completion(0, posts[1].seq, WcStatus::Success);
    assert_eq!(m.bytes_done(), 0, "the skipped WR was not counted");
    assert!(
        matches!(m.state(), State::Failed(Fault::NoPath { last: PathDown::OutOfOrder { seq } }) if *seq == posts[1].seq),
        "{:?}",
        m.state()
    );
    // In order, the same completions retire exactly what they report.
    let mut m = Machine::new(cfg(4 * 100, 100, 1, 4, 1));
    let posts: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
    m.handle_completion(0, posts[0].seq, WcStatus::Success);
    m.handle_completion(0, posts[1].seq, WcStatus::Success);
    assert_eq!((m.bytes_done(), m.state()), (200, &State::Running));

    // Two paths (QP 0 on path 0, QP 1 on path 1), runs of one WR.
    let mut c = cfg(8 * 100, 100, 2, 4, 1);
    c.path_of = Arc::from([0usize, 1]);
    let mut m = Machine::new(c);
    let first: Vec<Post> = std::iter::from_fn(|| m.poll_transmit()).collect();
    let on_1: Vec<Post> = first.iter().copied().filter(|p| p.qp == 1).collect();
    assert!(on_1.len() >= 2, "{first:?}");
    m.handle_completion(1, on_1[1].seq, WcStatus::Success);
    assert!(!m.path_is_up(1));
    assert!(
        matches!(m.poll_event(), Some(PathEvent::Down { path: 1, reason: PathDown::OutOfOrder { .. }, requeued }) if requeued as usize == on_1.len())
    );
    // Path 0 carries everything now: drive it in order to the end.
    let mut inflight: VecDeque<Post> = first.iter().copied().filter(|p| p.qp == 0).collect();
    let mut seen = std::collections::BTreeMap::new();
    for p in &inflight {
        *seen.entry(p.seq).or_insert(0) += 1;
    }
    while !m.is_done() {
        while let Some(p) = m.poll_transmit() {
            assert_eq!(p.qp, 0, "nothing goes to the untrusted path");
            *seen.entry(p.seq).or_insert(0) += 1;
            inflight.push_back(p);
        }
        let p = inflight.pop_front().expect("the machine waits on nothing");
        m.handle_completion(0, p.seq, WcStatus::Success);
    }
    assert_eq!(m.state(), &State::Succeeded);
    assert_eq!(m.bytes_done(), 800, "each chunk counted once");
    assert_eq!(m.path_bytes(), &[800, 0]);
    assert_eq!(seen.len(), 8, "every chunk went out on path 0: {seen:?}");
}

/// What a transfer resumed on a fresh connection still has to move: after every path is lost
/// at any point, `unretired` is disjoint, keeps each segment's local↔remote mapping, and with
/// the bytes retired covers every byte of the batch exactly once.
#[test]
fn unretired_is_exactly_what_no_completion_retired() {
    let segs: Arc<[Seg]> = Arc::from([
        Seg { local: 0, remote: 100, len: 30 },
        Seg { local: 50, remote: 0, len: 25 },
        Seg { local: 200, remote: 300, len: 40 },
    ]);
    let total: u64 = segs.iter().map(|s| s.len).sum();
    for completions in 0..12 {
        let mut m = Machine::new(MachineConfig { segs: segs.clone(), ..cfg(0, 10, 2, 4, 2) });
        let mut inflight: Vec<VecDeque<Post>> = vec![VecDeque::new(); 2];
        let mut retired: Vec<(u64, u64)> = Vec::new();
        let mut done = 0;
        while done < completions && !m.is_done() {
            while let Some(p) = m.poll_transmit() {
                inflight[p.qp].push_back(p);
            }
            let Some(q) = (0..2).find(|&q| inflight[q].iter().any(|p| p.signaled)) else { break };
            while let Some(p) = inflight[q].pop_front() {
                retired.push((p.local, p.len as u64));
                if p.signaled {
                    m.handle_completion(p.qp, p.seq, WcStatus::Success);
                    break;
                }
            }
            done += 1;
        }
        while let Some(p) = m.poll_transmit() {
            inflight[p.qp].push_back(p);
        }
        m.handle_path_down(0, PathDown::Event("port down".into()));
        let left = m.unretired();
        if m.state() == &State::Succeeded {
            assert!(left.is_empty());
            continue;
        }
        assert!(matches!(m.state(), State::Failed(Fault::NoPath { .. })), "{:?}", m.state());
        assert_eq!(left.iter().map(|s| s.len).sum::<u64>(), total - m.bytes_done(), "after {completions}: {left:?}");
        let mut bytes = std::collections::BTreeSet::new();
        for s in &left {
            let orig = segs.iter().find(|o| o.local <= s.local && s.local + s.len <= o.local + o.len).expect("inside one segment");
            assert_eq!(s.remote - orig.remote, s.local - orig.local, "the segment's mapping is kept: {s:?}");
            for b in s.local..s.local + s.len {
                assert!(bytes.insert(b), "byte {b} twice in {left:?}");
            }
        }
        for (l, n) in retired {
            for b in l..l + n {
                assert!(bytes.insert(b), "byte {b} both retired and left: {left:?}");
            }
        }
        assert_eq!(bytes.len() as u64, total, "after {completions}: every byte once");
    }
}
