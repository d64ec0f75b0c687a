//! The initiator's established multi-device connection: its QPs numbered rail after rail, each
//! post routed to the rail's device part (QP index, local MR and per-QP key translated), and the
//! parts polled, handed off and closed together. A tcp fallback rail, when there is one, comes
//! last: a standby path whose posts go to the tcp child with its registration and token.
//!
//! A rail whose QPs could not be moved to RTS at Connect (its device's route to the peer was
//! gone: a link going down before its port-down event arrived) is *dead from the start*: it
//! keeps its QP numbers, since the responder numbered its QPs and the grants' per-QP keys the
//! same way, but has no part, and a post on it is `QpBroken`, which the transfer machine takes
//! as that path failing (its chunks go on the other paths).
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::fallback::{key_for, TcpRail};
use super::register::RailsRegistration;
use super::{RailDevice, NO_KEY};
use crate::{Connection, FabricError, PathInfo, Registration, RemoteKey, WorkRequest, WrOp};

/// One rail of a connection: a device's part and where its QPs sit in the connection.
pub(crate) struct Rail {
    /// The device's part (a `VerbsConnection`); `None` for a rail dead from the start.
    pub conn: Option<Arc<dyn Connection>>,
    /// The path MTU its QPs negotiated, in bytes (0 for a dead rail).
    pub mtu: u32,
    /// The fabric's index of the local device.
    pub device: usize,
    pub name: String,
    pub remote_device: String,
    /// The connection's index of the rail's first QP.
    pub base: usize,
    pub qps: usize,
}

pub(crate) struct RailsConnection {
    rails: Vec<Rail>,
    qps: usize,
    devices: Arc<[Arc<RailDevice>]>,
    /// Devices that were down when the connection was made.
    down: Vec<usize>,
    /// The tcp fallback rail, after every device's.
    tcp: Option<TcpRail>,
    /// A grant named NO_KEY for a QP of a live part: the responder's half of that rail could
    /// not be made ready, so the rail is dead from its side and the connection wants replacing.
    responder_rail_dead: AtomicBool,
}

impl RailsConnection {
    pub fn new(rails: Vec<Rail>, devices: Arc<[Arc<RailDevice>]>, down: Vec<usize>) -> RailsConnection {
        let qps = rails.iter().map(|r| r.qps).sum();
        RailsConnection { rails, qps, devices, down, tcp: None, responder_rail_dead: AtomicBool::new(false) }
    }

    /// Adds the tcp fallback rail (its QPs numbered after every device's).
    pub fn with_fallback(mut self, tcp: Option<TcpRail>) -> RailsConnection {
        if let Some(t) = &tcp {
            self.qps = t.base + t.qps;
        }
        self.tcp = tcp;
        self
    }

    /// The parts of the rails that are not dead from the start.
    fn parts(&self) -> impl Iterator<Item = &Arc<dyn Connection>> {
        self.rails.iter().filter_map(|r| r.conn.as_ref())
    }

    /// The rail QP `qp` is on, and its index there.
    fn rail_of(&self, qp: usize) -> Option<(&Rail, usize)> {
        let (i, local) = locate(self.rails.iter().map(|r| (r.base, r.qps)), qp)?;
        Some((&self.rails[i], local))
    }
}

/// A rail the peer answered, once its QPs were moved (or not): its place in the connection
/// (`conn` unset), and its part with the path MTU it negotiated, or the local device's error.
pub(crate) struct Moved {
    pub rail: Rail,
    pub outcome: Result<(Arc<dyn Connection>, u32), FabricError>,
}

/// The connection's rails from `moved` (in rail order): each keeps its place in the QP
/// numbering; one whose QPs could not be moved is dead from the start, logged and counted
/// (`xfer_rail_connect_failures_total`). If every rail failed, the Connect fails with the first
/// rail's error, as a single device's would.
pub(crate) fn settle(peer: &str, moved: Vec<Moved>) -> Result<Vec<Rail>, FabricError> {
    let mut first_error = None;
    let mut rails = Vec::with_capacity(moved.len());
    for Moved { mut rail, outcome } in moved {
        match outcome {
            Ok((conn, mtu)) => {
                rail.conn = Some(conn);
                rail.mtu = mtu;
            }
            Err(e) => {
                tracing::warn!(device = %rail.name, remote_device = %rail.remote_device, %peer, error = %e,
                    "this device's QPs could not be moved to RTS: the connection goes on without this rail (its work requests go on the others)");
                crate::metrics::rail_connect_failure(&rail.name, "initiator");
                first_error.get_or_insert(e);
            }
        }
        rails.push(rail);
    }
    match first_error {
        Some(e) if rails.iter().all(|r| r.conn.is_none()) => Err(e),
        _ => Ok(rails),
    }
}

/// Which of the rails (`(base, qps)` each, in order) connection QP `qp` is on, and its index
/// on that rail.
pub(crate) fn locate(rails: impl Iterator<Item = (usize, usize)>, qp: usize) -> Option<(usize, usize)> {
    rails.enumerate().find(|(_, (base, qps))| (*base..*base + *qps).contains(&qp)).map(|(i, (base, _))| (i, qp - base))
}

/// `wr` as the rail's part takes it: the device's own registration of the local memory, and of
/// a per-QP key, the key of connection QP `qp`.
pub(crate) fn translate(mut wr: WorkRequest, device: usize, qp: usize) -> Result<WorkRequest, FabricError> {
    if let Some(ours) = wr.local.as_any().downcast_ref::<RailsRegistration>() {
        let part: Arc<dyn Registration> = ours
            .part(device)
            .cloned()
            .ok_or_else(|| FabricError::Registration(format!("the registration has no part on device {device}")))?;
        wr.local = part;
    }
    if matches!(wr.remote_key, RemoteKey::PerQp(_) | RemoteKey::Each(_)) {
        wr.remote_key = key_for(&wr.remote_key, qp)?;
        // The responder's word that its side of this QP's rail could not be made ready (its QPs
        // are in ERR, nothing exposed there): the QP is as good as broken, so its path fails
        // over at once instead of after the retry timeout, and key 0 never goes on the wire.
        if wr.remote_key == RemoteKey::Rkey(NO_KEY) {
            return Err(FabricError::QpBroken);
        }
    }
    Ok(wr)
}

fn op_name(op: WrOp) -> &'static str {
    match op {
        WrOp::Read => "read",
        WrOp::Write => "write",
        WrOp::Notify { .. } => "notify",
    }
}

impl Connection for RailsConnection {
    fn qps(&self) -> usize {
        self.qps
    }

    fn paths(&self) -> Vec<PathInfo> {
        let mut paths: Vec<PathInfo> = self
            .rails
            .iter()
            .map(|r| PathInfo {
                local_device: r.name.clone(),
                remote_device: r.remote_device.clone(),
                qps: r.base..r.base + r.qps,
                standby: false,
                mtu: r.mtu,
            })
            .collect();
        if let Some(t) = &self.tcp {
            paths.push(PathInfo {
                local_device: "tcp".into(),
                remote_device: "tcp".into(),
                qps: t.base..t.base + t.qps,
                standby: true,
                mtu: 0,
            });
        }
        paths
    }

    /// Also when the tcp rail broke (an idle data stream is closed by the peer after its
    /// `limits.data_idle_timeout`): a fresh connection has a fresh standby. And always with a
    /// rail dead from the start: each transfer on it would lose that path at its first post
    /// (and so verify its range end to end, as after any failover), while a fresh connection
    /// either leaves the device out (it went down meanwhile) or tries its route again.
    fn wants_reconnect(&self) -> bool {
        self.is_broken()
            || self.rails.iter().any(|r| r.conn.is_none())
            || self.responder_rail_dead.load(Ordering::Acquire)
            || self.tcp.as_ref().is_some_and(|t| t.conn.is_broken())
            || self.down.iter().any(|&d| self.devices.get(d).is_some_and(|d| d.offered()))
    }

    fn post(&self, qp: usize, wr: WorkRequest) -> Result<(), FabricError> {
        self.post_batch(qp, vec![wr]).map_err(|(_, e)| e)
    }

    fn post_batch(&self, qp: usize, wrs: Vec<WorkRequest>) -> Result<(), (u64, FabricError)> {
        let Some(first) = wrs.first().map(|w| w.wr_id) else { return Ok(()) };
        if let Some(t) = self.tcp.as_ref().filter(|t| (t.base..t.base + t.qps).contains(&qp)) {
            let mut routed = Vec::with_capacity(wrs.len());
            for wr in wrs {
                let id = wr.wr_id;
                routed.push(t.translate(wr, qp).map_err(|e| (id, e))?);
            }
            return t.conn.post_batch(qp - t.base, routed);
        }
        let (rail, local_qp) = self.rail_of(qp).ok_or((first, FabricError::NoSuchQp(qp)))?;
        let Some(part) = &rail.conn else { return Err((first, FabricError::QpBroken)) };
        let mut routed = Vec::with_capacity(wrs.len());
        let mut bytes = [0u64; 3];
        let mut count = [0u64; 3];
        for wr in wrs {
            let id = wr.wr_id;
            let slot = match wr.op {
                WrOp::Read => 0,
                WrOp::Write => 1,
                WrOp::Notify { .. } => 2,
            };
            bytes[slot] += u64::from(wr.len);
            count[slot] += 1;
            routed.push(translate(wr, rail.device, qp).map_err(|e| {
                if matches!(e, FabricError::QpBroken) {
                    self.responder_rail_dead.store(true, Ordering::Release);
                }
                (id, e)
            })?);
        }
        part.post_batch(local_qp, routed)?;
        for (slot, op) in [WrOp::Read, WrOp::Write, WrOp::Notify { slot: 0 }].into_iter().enumerate() {
            if count[slot] > 0 {
                crate::metrics::device_posted(&rail.name, op_name(op), count[slot], bytes[slot]);
            }
        }
        Ok(())
    }

    fn progress(&self) -> usize {
        self.parts().map(|p| p.progress()).sum()
    }

    fn hand_off(&self, to: Option<std::thread::Thread>) -> bool {
        // Every part is a verbs connection with a completion channel: each takes the same worker.
        let mut all = true;
        if let Some(t) = &self.tcp {
            // Its completions come from a forwarding task, which wakes the worker itself.
            t.hand_off(to.clone());
        }
        for p in self.parts() {
            all &= p.hand_off(to.clone());
        }
        all
    }

    fn arm_wake(&self) -> bool {
        // Every part must be armed, or a completion on an unarmed one would wake nobody.
        let mut all = true;
        for p in self.parts() {
            all &= p.arm_wake();
        }
        all
    }

    /// Whether a part broke after the connection was made (a QP hit an error, its device went
    /// down): work posted on it may be lost. A rail dead from the start does not count: it never
    /// carried any, and the rails left move data like a connection made without that device.
    /// The pool replaces the connection all the same (`wants_reconnect`), so it is never reused
    /// (where the session's one re-lease of a pooled connection that broke would look at this).
    fn is_broken(&self) -> bool {
        self.parts().any(|p| p.is_broken())
    }

    fn close(&self) {
        for p in self.parts() {
            p.close();
        }
        if let Some(t) = &self.tcp {
            t.conn.close();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xfer_rdma::memory::RegionMemory;

    #[test]
    fn connection_qps_map_to_their_rail_and_its_own_index() {
        let rails = [(0, 2), (2, 3)];
        assert_eq!(locate(rails.into_iter(), 0), Some((0, 0)));
        assert_eq!(locate(rails.into_iter(), 1), Some((0, 1)));
        assert_eq!(locate(rails.into_iter(), 2), Some((1, 0)));
        assert_eq!(locate(rails.into_iter(), 4), Some((1, 2)));
        assert_eq!(locate(rails.into_iter(), 5), None);
    }

    #[derive(Debug)]
    struct Plain(Arc<RegionMemory>);

    impl Registration for Plain {
        fn memory(&self) -> &Arc<RegionMemory> {
            &self.0
        }
        fn lkey(&self) -> u32 {
            0
        }
        fn rkey(&self) -> u32 {
            0
        }
        fn access(&self) -> crate::Access {
            crate::Access::ReadWrite
        }
        fn remote_key_exposed(&self) -> bool {
            false
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    fn wr(key: RemoteKey) -> WorkRequest {
        let memory = Arc::new(RegionMemory::anonymous(4096, false).unwrap());
        WorkRequest {
            wr_id: 1,
            op: WrOp::Write,
            local: Arc::new(Plain(memory)),
            local_offset: 0,
            len: 8,
            remote_addr: 0,
            remote_key: key,
            signaled: true,
        }
    }

    #[test]
    fn a_per_qp_key_becomes_the_key_of_the_connection_qp() {
        let keys: Arc<[u32]> = vec![10, 11, 20, 21].into();
        // Connection QP 3 is QP 1 of the second rail: the grant's fourth key, not its second.
        let t = translate(wr(RemoteKey::PerQp(Arc::clone(&keys))), 1, 3).unwrap();
        assert!(t.remote_key == RemoteKey::Rkey(21));
        assert!(translate(wr(RemoteKey::PerQp(keys)), 1, 4).is_err(), "no key for a QP past the grant's");
        // A single rkey (a single-device responder's grant) passes as it is.
        assert!(translate(wr(RemoteKey::Rkey(5)), 0, 1).unwrap().remote_key == RemoteKey::Rkey(5));
    }

    /// A grant whose key list does not cover the connection's QPs (a hostile or stale
    /// responder's answer) is refused per work request with a clear error, never indexed out of
    /// bounds: an empty list, one shorter than the QPs, and QP indices far past it.
    /// A grant whose key list holds 0 for a rail the responder could not make ready (or a
    /// hostile responder's 0 anywhere): a work request on such a QP fails as a broken QP (a path
    /// failure the transfer fails over from), with no key put on the wire; the other QPs keep
    /// their own keys, in a per-QP list and in a fallback's `Each` list alike.
    #[test]
    fn a_qp_whose_key_is_the_responders_no_key_is_broken() {
        let keys: Arc<[u32]> = vec![10, 11, NO_KEY, NO_KEY].into();
        for qp in [2, 3] {
            let e = translate(wr(RemoteKey::PerQp(Arc::clone(&keys))), 1, qp).unwrap_err();
            assert!(matches!(e, FabricError::QpBroken), "{e}");
        }
        assert!(translate(wr(RemoteKey::PerQp(Arc::clone(&keys))), 0, 1).unwrap().remote_key == RemoteKey::Rkey(11));
        let each: Arc<[RemoteKey]> = vec![RemoteKey::Rkey(NO_KEY), RemoteKey::Rkey(7), RemoteKey::Token([1; 16])].into();
        assert!(matches!(translate(wr(RemoteKey::Each(Arc::clone(&each))), 0, 0), Err(FabricError::QpBroken)));
        assert!(translate(wr(RemoteKey::Each(each)), 1, 1).unwrap().remote_key == RemoteKey::Rkey(7));
    }

    #[test]
    fn a_per_qp_key_list_shorter_than_the_connection_is_refused() {
        let short: Arc<[u32]> = vec![10, 11].into();
        for qp in [2, 3, 63, usize::MAX] {
            let e = translate(wr(RemoteKey::PerQp(Arc::clone(&short))), 1, qp).unwrap_err().to_string();
            assert!(e.contains(&format!("the grant has 2 per-QP keys and none for QP {qp}")), "{e}");
        }
        let e = translate(wr(RemoteKey::PerQp(Vec::new().into())), 0, 0).unwrap_err().to_string();
        assert!(e.contains("0 per-QP keys"), "{e}");
        // The QPs the list covers still get their own key: a short list fails only past its end.
        assert!(translate(wr(RemoteKey::PerQp(short)), 0, 1).unwrap().remote_key == RemoteKey::Rkey(11));
        // And a QP index past every rail is no rail's.
        assert_eq!(locate([(0, 2), (2, 2)].into_iter(), usize::MAX), None);
        assert_eq!(locate(std::iter::empty(), 0), None);
    }

    /// A device's part that records what is posted on it.
    #[derive(Default)]
    struct Part {
        qps: usize,
        posted: std::sync::Mutex<Vec<(usize, u64)>>,
        broken: std::sync::atomic::AtomicBool,
    }

    impl Connection for Part {
        fn qps(&self) -> usize {
            self.qps
        }
        fn post(&self, qp: usize, wr: WorkRequest) -> Result<(), FabricError> {
            self.posted.lock().unwrap().push((qp, wr.wr_id));
            Ok(())
        }
        fn is_broken(&self) -> bool {
            self.broken.load(std::sync::atomic::Ordering::Acquire)
        }
        fn close(&self) {}
    }

    /// Rails of two QPs each on `rxe0`, `rxe2`, `rxe4`; `dead` lists the ones whose QPs could not
    /// be moved. Also returns the live rails' parts.
    fn moved(dead: &[usize]) -> (Vec<Moved>, Vec<Option<Arc<Part>>>) {
        let mut out = Vec::new();
        let mut parts = Vec::new();
        for i in 0..3 {
            let rail = Rail {
                conn: None,
                mtu: 0,
                device: i,
                name: format!("rxe{}", 2 * i),
                remote_device: format!("rxe{}", 2 * i + 1),
                base: 2 * i,
                qps: 2,
            };
            let outcome = if dead.contains(&i) {
                parts.push(None);
                Err(FabricError::Negotiation {
                    step: "RTR",
                    attr: "dgid",
                    detail: format!("ibv_modify_qp: Network is unreachable (rail {i})"),
                })
            } else {
                let part = Arc::new(Part { qps: 2, ..Part::default() });
                parts.push(Some(Arc::clone(&part)));
                Ok((part as Arc<dyn Connection>, 1024))
            };
            out.push(Moved { rail, outcome });
        }
        (out, parts)
    }

    fn connection(rails: Vec<Rail>) -> RailsConnection {
        RailsConnection::new(rails, Vec::new().into(), Vec::new())
    }

    /// A rail whose QPs could not be moved keeps its QP numbers (the responder's QPs and the
    /// grant's per-QP keys are numbered the same way): the rails after it are where they were,
    /// a post on it is `QpBroken` (a path failure to the transfer machine), and the others'
    /// posts reach their own part under their own index.
    #[test]
    fn a_dead_rail_keeps_the_numbering_and_refuses_posts() {
        let (m, parts) = moved(&[1]);
        let conn = connection(settle("peer", m).unwrap());
        assert_eq!(conn.qps(), 6);
        let paths = conn.paths();
        let ranges: Vec<_> = paths.iter().map(|p| (p.local_device.as_str(), p.qps.clone(), p.mtu)).collect();
        assert_eq!(ranges, vec![("rxe0", 0..2, 1024), ("rxe2", 2..4, 0), ("rxe4", 4..6, 1024)]);
        for qp in [2, 3] {
            let mut w = wr(RemoteKey::PerQp(vec![1, 2, 3, 4, 5, 6].into()));
            w.wr_id = qp as u64;
            assert!(matches!(conn.post(qp, w), Err(FabricError::QpBroken)), "QP {qp} is on the dead rail");
        }
        for qp in [0, 1, 4, 5] {
            let mut w = wr(RemoteKey::PerQp(vec![1, 2, 3, 4, 5, 6].into()));
            w.wr_id = 100 + qp as u64;
            conn.post(qp, w).unwrap();
        }
        assert!(matches!(conn.post(6, wr(RemoteKey::Rkey(1))), Err(FabricError::NoSuchQp(6))));
        let posted = |i: usize| parts[i].as_ref().unwrap().posted.lock().unwrap().clone();
        assert_eq!(posted(0), vec![(0, 100), (1, 101)]);
        assert_eq!(posted(2), vec![(0, 104), (1, 105)], "the third rail's QPs are its own 0 and 1");
        // Not broken (nothing it carried was lost), but never pooled: a fresh connection tries
        // the rail's route again, or leaves its device out.
        assert!(!conn.is_broken());
        assert!(conn.wants_reconnect());
        // A live part that breaks later breaks the connection as before.
        parts[2].as_ref().unwrap().broken.store(true, std::sync::atomic::Ordering::Release);
        assert!(conn.is_broken());
    }

    #[test]
    fn a_connection_whose_rails_all_moved_is_pooled() {
        let (m, _) = moved(&[]);
        let conn = connection(settle("peer", m).unwrap());
        assert!(conn.rails.iter().all(|r| r.conn.is_some()));
        assert!(!conn.is_broken() && !conn.wants_reconnect());
        // A grant whose keys say the responder's half of the second rail is dead (NO_KEY): its
        // posts fail as QpBroken, and the connection is not pooled again (a fresh one offers
        // that rail anew or leaves it out), though nothing it carried was lost.
        let keys: Arc<[u32]> = vec![1, 2, NO_KEY, NO_KEY, 5, 6].into();
        conn.post(0, wr(RemoteKey::PerQp(Arc::clone(&keys)))).unwrap();
        assert!(!conn.wants_reconnect(), "a live rail's post says nothing");
        assert!(matches!(conn.post(2, wr(RemoteKey::PerQp(keys))), Err(FabricError::QpBroken)));
        assert!(!conn.is_broken() && conn.wants_reconnect());
    }

    /// Every rail failing fails the Connect, with the first rail's error (a single device's
    /// would be that error too).
    #[test]
    fn every_rail_failing_fails_the_connect_with_the_first_error() {
        let (m, _) = moved(&[0, 1, 2]);
        let e = settle("peer", m).err().expect("no rail is left").to_string();
        assert!(e.contains("RTR") && e.contains("Network is unreachable (rail 0)"), "{e}");
        // One rail left is enough.
        let (m, _) = moved(&[0, 2]);
        let rails = settle("peer", m).unwrap();
        let live: Vec<usize> = rails.iter().filter(|r| r.conn.is_some()).map(|r| r.base).collect();
        assert_eq!((rails.len(), live), (3, vec![2]));
    }

    #[test]
    fn op_names_are_the_metric_labels() {
        assert_eq!(op_name(WrOp::Read), "read");
        assert_eq!(op_name(WrOp::Notify { slot: 3 }), "notify");
    }
}
