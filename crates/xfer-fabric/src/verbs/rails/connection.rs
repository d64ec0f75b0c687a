//! The initiator's established multi-device connection: its QPs numbered rail after rail, each
//! post routed to the rail's device part (QP index, local MR and per-QP key translated), and the
//! parts polled, handed off and closed together. A tcp fallback rail, when there is one, comes
//! last: a standby path whose posts go to the tcp child with its registration and token.
use std::sync::Arc;

use super::fallback::{key_for, TcpRail};
use super::register::RailsRegistration;
use super::RailDevice;
use crate::verbs::initiator::VerbsConnection;
use crate::{Connection, FabricError, PathInfo, Registration, RemoteKey, WorkRequest, WrOp};

/// One rail of a connection: a device's part and where its QPs sit in the connection.
pub(crate) struct Rail {
    pub conn: Arc<VerbsConnection>,
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
}

impl RailsConnection {
    pub fn new(rails: Vec<Rail>, devices: Arc<[Arc<RailDevice>]>, down: Vec<usize>) -> RailsConnection {
        let qps = rails.iter().map(|r| r.qps).sum();
        RailsConnection { rails, qps, devices, down, tcp: None }
    }

    /// Adds the tcp fallback rail (its QPs numbered after every device's).
    pub fn with_fallback(mut self, tcp: Option<TcpRail>) -> RailsConnection {
        if let Some(t) = &tcp {
            self.qps = t.base + t.qps;
        }
        self.tcp = tcp;
        self
    }

    /// The rail QP `qp` is on, and its index there.
    fn rail_of(&self, qp: usize) -> Option<(&Rail, usize)> {
        let (i, local) = locate(self.rails.iter().map(|r| (r.base, r.qps)), qp)?;
        Some((&self.rails[i], local))
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
                mtu: r.conn.path_mtu(),
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
    /// `limits.data_idle_timeout`): a fresh connection has a fresh standby.
    fn wants_reconnect(&self) -> bool {
        self.is_broken()
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
            routed.push(translate(wr, rail.device, qp).map_err(|e| (id, e))?);
        }
        rail.conn.post_batch(local_qp, routed)?;
        for (slot, op) in [WrOp::Read, WrOp::Write, WrOp::Notify { slot: 0 }].into_iter().enumerate() {
            if count[slot] > 0 {
                crate::metrics::device_posted(&rail.name, op_name(op), count[slot], bytes[slot]);
            }
        }
        Ok(())
    }

    fn progress(&self) -> usize {
        self.rails.iter().map(|r| r.conn.progress()).sum()
    }

    fn hand_off(&self, to: Option<std::thread::Thread>) -> bool {
        // Every part is a verbs connection with a completion channel: each takes the same worker.
        let mut all = true;
        if let Some(t) = &self.tcp {
            // Its completions come from a forwarding task, which wakes the worker itself.
            t.hand_off(to.clone());
        }
        for r in &self.rails {
            all &= r.conn.hand_off(to.clone());
        }
        all
    }

    fn arm_wake(&self) -> bool {
        // Every part must be armed, or a completion on an unarmed one would wake nobody.
        let mut all = true;
        for r in &self.rails {
            all &= r.conn.arm_wake();
        }
        all
    }

    fn is_broken(&self) -> bool {
        self.rails.iter().any(|r| r.conn.is_broken())
    }

    fn close(&self) {
        for r in &self.rails {
            r.conn.close();
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

    #[test]
    fn op_names_are_the_metric_labels() {
        assert_eq!(op_name(WrOp::Read), "read");
        assert_eq!(op_name(WrOp::Notify { slot: 3 }), "notify");
    }
}
