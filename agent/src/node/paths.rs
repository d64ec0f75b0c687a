//! Which paths of a leased connection a job uses, and how much each carries. A connection to a
//! peer has one path per pair of devices that reach each other ([`Connection::paths`]); the
//! [`PathBook`] remembers what each path moved (an EWMA of its rate, by peer and device pair) and
//! how many bytes each local device has in flight, which paths failed lately (a
//! [`PathHealth`] each: one that keeps failing waits out a growing back-off as a standby, used
//! only when no other path is up), and asks the placement policy
//! ([`xfer_engine::placement::place`]) for the weights the machine stripes a job's chunks by.
//! The policy is pure; this module only gathers its inputs and learns from each job's outcome.
//! A standby path (`PathInfo::standby`: the tcp fallback) is never placed: weight 0 always.
//!
//! Transfers and channel batches, READs and WRITEs, are placed alike ([`PathBook::plan`]). Benchmarks are not:
//! they drive every path at equal weight (or one path alone, `per_path`), because their figures
//! are what placement is judged against: weights learnt from earlier jobs would make them depend
//! on the agent's history, and their buffer is scratch memory whose NUMA node says nothing about
//! where the user's data lives.
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::transfer::job::qp_map;
use xfer_engine::machine::Machine;
use xfer_engine::paths::{Backoff, PathHealth, Rate};
use xfer_engine::placement::{place, DeviceFacts, PathView};
use xfer_fabric::{Connection, DeviceInfo};

/// Jobs smaller than this teach no rate. A small job is latency-bound: its split between paths
/// follows the weights it was given, so learning from it would feed the weights back into
/// themselves and starve a path that once got less. A large one keeps every path's window full,
/// where each path carries what its own completions allow, which is what it can carry.
pub const LEARN_MIN_BYTES: u64 = 16 << 20;

/// The QP → path map and the per-path weights of one job (what `Session::set_paths` takes).
/// The bytes it charged to its devices go back when the book learns from the job, or when the
/// plan is dropped (a job that failed before or without running).
pub struct PathPlan {
    pub path_of: Arc<[usize]>,
    pub weights: Vec<u32>,
    charge: Charge,
}

/// Bytes a plan charged to each path's local device, given back once.
struct Charge {
    book: Weak<Mutex<BookState>>,
    bytes: Mutex<Vec<(String, u64)>>,
}

impl Charge {
    fn none() -> Charge {
        Charge { book: Weak::new(), bytes: Mutex::default() }
    }

    /// Gives the bytes back (once: they are taken).
    fn give_back(&self) {
        let taken = std::mem::take(&mut *self.bytes.lock().unwrap_or_else(|e| e.into_inner()));
        if taken.is_empty() {
            return;
        }
        let Some(book) = self.book.upgrade() else { return };
        let mut st = book.lock().unwrap_or_else(|e| e.into_inner());
        for (dev, b) in taken {
            if let Some(n) = st.in_flight.get_mut(&dev) {
                *n = n.saturating_sub(b);
            }
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.give_back();
    }
}

/// Path rates and device load, shared by every job of this agent.
pub struct PathBook {
    /// This agent's devices as the placement policy sees them (NUMA node, nominal speed).
    devices: Vec<DeviceFacts>,
    state: Arc<Mutex<BookState>>,
}

#[derive(Default)]
struct BookState {
    /// Measured rate per (peer, local device, remote device).
    rates: HashMap<(String, String, String), Rate>,
    /// Failures and back-off per (peer, local device, remote device).
    health: HashMap<(String, String, String), PathHealth>,
    /// Bytes of running jobs per local device.
    in_flight: HashMap<String, u64>,
}

impl PathBook {
    /// A book for the devices the fabric reports (empty for tcp: one path, no placement).
    pub fn new(devices: &[DeviceInfo]) -> PathBook {
        let devices = devices.iter().map(|d| DeviceFacts { name: d.name.clone(), numa: d.numa_node, speed_mbps: d.speed_mbps }).collect();
        PathBook { devices, state: Arc::default() }
    }

    /// The plan for a job of `bytes` over `conn` to `peer`, from memory on NUMA node
    /// `region_numa`. A single-path connection gets the machine's defaults (one path).
    pub fn plan(&self, peer: &str, conn: &dyn Connection, region_numa: Option<u32>, bytes: u64) -> PathPlan {
        let now = Instant::now();
        let all = conn.paths();
        let path_of = qp_map(&all, conn.qps());
        if all.len() <= 1 {
            return PathPlan { path_of, weights: Vec::new(), charge: Charge::none() };
        }
        // Standby paths (the tcp fallback) are never placed: weight 0, used only when no other
        // path is up. The policy weighs the others.
        let active: Vec<usize> = (0..all.len()).filter(|&i| !all[i].standby).collect();
        let spread = |w: &[u32]| -> Vec<u32> {
            let mut out = vec![0; all.len()];
            for (&i, &w) in active.iter().zip(w) {
                out[i] = w;
            }
            out
        };
        if active.len() <= 1 {
            return PathPlan { path_of, weights: spread(&[1]), charge: Charge::none() };
        }
        let Ok(mut st) = self.state.lock() else {
            return PathPlan { path_of, weights: spread(&vec![1; active.len()]), charge: Charge::none() };
        };
        let paths: Vec<&xfer_fabric::PathInfo> = active.iter().map(|&i| &all[i]).collect();
        let mut devices = self.devices.clone();
        let views: Vec<PathView> = paths
            .iter()
            .map(|p| {
                let device = match devices.iter().position(|d| d.name == p.local_device) {
                    Some(i) => i,
                    None => {
                        devices.push(DeviceFacts { name: p.local_device.clone(), numa: None, speed_mbps: None });
                        devices.len() - 1
                    }
                };
                let key = (peer.to_string(), p.local_device.clone(), p.remote_device.clone());
                PathView {
                    device,
                    usable: st.health.get(&key).is_none_or(|h| h.usable(now)),
                    rate: st.rates.get(&key).and_then(Rate::bytes_per_sec),
                    in_flight: st.in_flight.get(&p.local_device).copied().unwrap_or(0),
                }
            })
            .collect();
        let mut weights = place(region_numa, &devices, &views, bytes);
        if all.len() != active.len() && weights.iter().all(|&w| w == 0) {
            // Every RDMA path is backing off: they still carry the job (at weight 0 the standby
            // would share it), since nothing moves to the fallback while one is up.
            weights.iter_mut().for_each(|w| *w = 1);
        }
        let total: u64 = weights.iter().map(|&w| u64::from(w)).sum::<u64>().max(1);
        let charged: Vec<(String, u64)> = paths
            .iter()
            .zip(&weights)
            .map(|(p, &w)| (p.local_device.clone(), (u128::from(bytes) * u128::from(w) / u128::from(total)) as u64))
            .collect();
        for (dev, b) in &charged {
            *st.in_flight.entry(dev.clone()).or_default() += b;
        }
        let charge = Charge { book: Arc::downgrade(&self.state), bytes: Mutex::new(charged) };
        PathPlan { path_of, weights: spread(&weights), charge }
    }

    /// Learns from a job that ran `elapsed` under `plan`: which paths it lost (their health goes
    /// down, a back-off starts) and which carried bytes (up again), each path's rate from the
    /// bytes it carried in a job of at least [`LEARN_MIN_BYTES`], and the job's bytes leave the
    /// devices' in-flight count (at once, not when the plan drops).
    pub fn learn(&self, peer: &str, conn: &dyn Connection, plan: &PathPlan, machine: &Machine, elapsed: Duration) {
        plan.charge.give_back();
        let Ok(mut st) = self.state.lock() else { return };
        if plan.weights.is_empty() {
            return;
        }
        let now = Instant::now();
        for (i, p) in conn.paths().iter().enumerate() {
            if p.standby {
                // Never placed: neither its rate nor its health steers anything.
                continue;
            }
            let key = (peer.to_string(), p.local_device.clone(), p.remote_device.clone());
            let bytes = machine.path_bytes().get(i).copied().unwrap_or(0);
            if !machine.path_is_up(i) {
                st.health.entry(key).or_insert_with(|| PathHealth::new(Backoff::default())).down(now);
                crate::metrics::path_up(peer, &p.local_device, &p.remote_device, false);
                continue;
            }
            if bytes == 0 || elapsed.is_zero() {
                continue;
            }
            if let Some(h) = st.health.get_mut(&key) {
                h.up(now);
            }
            crate::metrics::path_up(peer, &p.local_device, &p.remote_device, true);
            if machine.bytes_done() >= LEARN_MIN_BYTES {
                st.rates.entry(key).or_insert_with(Rate::default).update(bytes, elapsed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::{PathBook, LEARN_MIN_BYTES};
    use xfer_engine::batch::Seg;
    use xfer_engine::machine::{Machine, MachineConfig, Markers};
    use xfer_engine::status::WcStatus;
    use xfer_fabric::{Connection, DeviceInfo, FabricError, PathInfo, WorkRequest};

    /// A connection of these paths, its QPs the paths' ranges; nothing is ever posted.
    pub(super) struct Paths(pub(super) Vec<PathInfo>);

    impl Connection for Paths {
        fn qps(&self) -> usize {
            self.0.iter().map(|p| p.qps.end).max().unwrap_or(0)
        }
        fn paths(&self) -> Vec<PathInfo> {
            self.0.clone()
        }
        fn post(&self, _qp: usize, _wr: WorkRequest) -> Result<(), FabricError> {
            Err(FabricError::QpBroken)
        }
        fn is_broken(&self) -> bool {
            false
        }
        fn close(&self) {}
    }

    /// A path `local` → `remote` over QPs `qps`.
    pub(super) fn path(local: &str, remote: &str, qps: std::ops::Range<usize>, standby: bool) -> PathInfo {
        PathInfo { local_device: local.into(), remote_device: remote.into(), qps, standby, mtu: 0 }
    }

    /// Two paths of two QPs each, rxe0→rxe1 and rxe2→rxe3.
    fn two_paths() -> Paths {
        Paths(vec![path("rxe0", "rxe1", 0..2, false), path("rxe2", "rxe3", 2..4, false)])
    }

    fn book() -> PathBook {
        PathBook::new(&[DeviceInfo { name: "rxe0".into(), ..Default::default() }, DeviceInfo { name: "rxe2".into(), ..Default::default() }])
    }

    /// Runs a machine of `bytes` over the plan's paths; `kill` fails path 1's first completion.
    fn run(book: &PathBook, bytes: u64, kill: bool) -> Machine {
        let plan = book.plan("peer", &two_paths(), None, bytes);
        let mut m = Machine::new(MachineConfig {
            segs: Arc::from([Seg { local: 0, remote: 0, len: bytes }]),
            chunk: 1 << 20,
            qps: 4,
            depth: 4,
            signal_every: 1,
            deadline: None,
            markers: Markers::None,
            path_of: plan.path_of.clone(),
            weights: plan.weights.clone(),
        });
        let mut killed = false;
        while !m.is_done() {
            let posts: Vec<_> = std::iter::from_fn(|| m.poll_transmit()).collect();
            assert!(!posts.is_empty() || m.outstanding() > 0, "stalled");
            for p in posts {
                let fail = kill && !killed && p.qp >= 2;
                killed |= fail;
                m.handle_completion(p.qp, p.seq, if fail { WcStatus::RetryExcErr } else { WcStatus::Success });
            }
        }
        book.learn("peer", &two_paths(), &plan, &m, Duration::from_millis(100));
        m
    }

    #[test]
    fn both_paths_carry_a_large_job_and_a_lost_one_waits_as_a_standby() {
        let b = book();
        let plan = b.plan("peer", &two_paths(), None, 64 << 20);
        assert_eq!(&plan.path_of[..], &[0, 0, 1, 1]);
        assert!(plan.weights.iter().all(|&w| w > 0), "both paths chosen: {:?}", plan.weights);
        b.learn("peer", &two_paths(), &plan, &run(&b, 0, false), Duration::ZERO);

        let m = run(&b, LEARN_MIN_BYTES, true);
        assert_eq!(m.bytes_done(), LEARN_MIN_BYTES, "the job completed on the path left");
        assert!(!m.path_is_up(1));
        // The lost path is in its back-off: a standby (weight 0) for the next job, never chosen.
        let next = b.plan("peer", &two_paths(), None, 64 << 20);
        assert!(next.weights[0] > 0 && next.weights[1] == 0, "{:?}", next.weights);
        // Another peer's paths over the same devices are not held against it.
        let other = b.plan("other", &two_paths(), None, 64 << 20);
        assert!(other.weights.iter().all(|&w| w > 0), "{:?}", other.weights);
    }

    #[test]
    fn in_flight_bytes_are_charged_per_device_and_given_back() {
        let b = book();
        let plan = b.plan("peer", &two_paths(), None, 1 << 30);
        let charged: u64 = b.state.lock().unwrap().in_flight.values().sum();
        assert!(charged > (1 << 30) - 2 && charged <= 1 << 30, "{charged}");
        let m = run(&b, 1 << 20, false);
        b.learn("peer", &two_paths(), &plan, &m, Duration::from_millis(10));
        assert_eq!(b.state.lock().unwrap().in_flight.values().sum::<u64>(), 0);
    }

    #[test]
    fn a_plan_dropped_without_learning_gives_its_charge_back() {
        let b = book();
        let plan = b.plan("peer", &two_paths(), None, 1 << 30);
        assert!(b.state.lock().unwrap().in_flight.values().sum::<u64>() > 0);
        // The job never ran (its driver refused it, or the transfer failed before its data).
        drop(plan);
        assert_eq!(b.state.lock().unwrap().in_flight.values().sum::<u64>(), 0);
    }

    /// rxe0 on NUMA node 0 and rxe2 on node 1, both 100 Gb/s.
    fn two_sockets() -> PathBook {
        let dev =
            |name: &str, numa| DeviceInfo { name: name.into(), numa_node: Some(numa), speed_mbps: Some(100_000), ..Default::default() };
        PathBook::new(&[dev("rxe0", 0), dev("rxe2", 1)])
    }

    /// A channel batch's paths (`PathBook::plan`, as a transfer's) are placed by its memory's
    /// NUMA node: a small batch goes to the device on that node alone, a large one spreads over
    /// both.
    #[test]
    fn a_batch_is_placed_by_its_regions_numa_node() {
        let b = two_sockets();
        let on_1 = b.plan("peer", &two_paths(), Some(1), 1 << 20);
        assert_eq!(&on_1.path_of[..], &[0, 0, 1, 1][..]);
        assert!(on_1.weights[0] == 0 && on_1.weights[1] > 0, "memory on node 1: rxe2 alone: {:?}", on_1.weights);
        let on_0 = b.plan("peer", &two_paths(), Some(0), 1 << 20);
        assert!(on_0.weights[0] > 0 && on_0.weights[1] == 0, "memory on node 0: rxe0 alone: {:?}", on_0.weights);
        let big = b.plan("peer", &two_paths(), Some(1), 8 << 30);
        assert!(big.weights.iter().all(|&w| w > 0), "8 GiB spills to the other socket: {:?}", big.weights);
    }
}

/// A standby path (the tcp fallback) beside RDMA paths.
#[cfg(test)]
mod standby_tests {
    use super::tests::{path, Paths};
    use super::*;

    /// A connection of two RDMA paths of one QP each, and a tcp standby of two.
    fn two_rails_and_tcp() -> Paths {
        Paths(vec![path("rxe0", "rxe1", 0..1, false), path("rxe2", "rxe3", 1..2, false), path("tcp", "tcp", 2..4, true)])
    }

    fn device(name: &str) -> DeviceInfo {
        DeviceInfo { name: name.into(), ..Default::default() }
    }

    #[test]
    fn a_standby_path_gets_weight_zero_and_the_rdma_paths_share_the_job() {
        let book = PathBook::new(&[device("rxe0"), device("rxe2")]);
        let plan = book.plan("peer", &two_rails_and_tcp(), None, 1 << 30);
        assert_eq!(plan.weights.len(), 3);
        assert_eq!(plan.weights[2], 0, "the tcp fallback is never given a weight");
        assert!(plan.weights[0] > 0 && plan.weights[1] > 0, "{:?}", plan.weights);
        assert_eq!(&plan.path_of[..], &[0, 1, 2, 2]);
        // Nothing is charged to the standby.
        assert!(plan.charge.bytes.lock().unwrap().iter().all(|(dev, _)| dev != "tcp"));
    }

    #[test]
    fn backing_off_rdma_paths_still_carry_the_job_before_the_standby() {
        let book = PathBook::new(&[device("rxe0"), device("rxe2")]);
        {
            let mut st = book.state.lock().unwrap();
            let now = Instant::now();
            for dev in [("rxe0", "rxe1"), ("rxe2", "rxe3")] {
                let key = ("peer".to_string(), dev.0.to_string(), dev.1.to_string());
                st.health.entry(key).or_insert_with(|| PathHealth::new(Backoff::default())).down(now);
            }
        }
        let plan = book.plan("peer", &two_rails_and_tcp(), None, 1 << 20);
        assert_eq!(plan.weights, vec![1, 1, 0]);
    }

    /// One RDMA path and the standby: the RDMA path takes everything.
    #[test]
    fn one_rdma_path_and_a_standby_weigh_one_and_zero() {
        let one = Paths(vec![path("rxe0", "rxe1", 0..1, false), path("tcp", "tcp", 1..2, true)]);
        let plan = PathBook::new(&[device("rxe0")]).plan("peer", &one, None, 1 << 20);
        assert_eq!(plan.weights, vec![1, 0]);
    }
}
