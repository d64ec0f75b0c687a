//! The crate's one protobuf boundary: every conversion between the generated `xfer.v1` types
//! and the domain types of [`crate::model`]. Unknown enum values (from a newer agent) map to the
//! type's default rather than failing the call.
use std::time::{Duration, SystemTime};

use xfer_proto::v1 as pb;

use crate::model::*;

pub(crate) fn duration_to_pb(d: Duration) -> prost_types::Duration {
    prost_types::Duration { seconds: d.as_secs().min(i64::MAX as u64) as i64, nanos: d.subsec_nanos() as i32 }
}

fn duration(d: Option<prost_types::Duration>) -> Option<Duration> {
    d.and_then(|d| Duration::try_from(d).ok())
}

fn time(t: Option<prost_types::Timestamp>) -> Option<SystemTime> {
    t.and_then(|t| SystemTime::try_from(t).ok())
}

impl Fabric {
    pub(crate) fn from_pb(v: i32) -> Fabric {
        match pb::FabricKind::try_from(v) {
            Ok(pb::FabricKind::Tcp) => Fabric::Tcp,
            Ok(pb::FabricKind::Verbs) => Fabric::Verbs,
            _ => Fabric::Unspecified,
        }
    }
}

impl RegionKind {
    pub(crate) fn from_pb(v: i32) -> RegionKind {
        match pb::RegionKind::try_from(v) {
            Ok(pb::RegionKind::File) => RegionKind::File,
            Ok(pb::RegionKind::Shm) => RegionKind::Shm,
            _ => RegionKind::Anonymous,
        }
    }

    pub(crate) fn to_pb(self) -> i32 {
        match self {
            RegionKind::Anonymous => pb::RegionKind::Anonymous as i32,
            RegionKind::File => pb::RegionKind::File as i32,
            RegionKind::Shm => pb::RegionKind::Shm as i32,
        }
    }
}

impl Access {
    pub(crate) fn from_pb(v: i32) -> Access {
        match pb::Access::try_from(v) {
            Ok(pb::Access::Read) => Access::Read,
            Ok(pb::Access::Write) => Access::Write,
            _ => Access::ReadWrite,
        }
    }

    pub(crate) fn to_pb(self) -> i32 {
        match self {
            Access::Read => pb::Access::Read as i32,
            Access::Write => pb::Access::Write as i32,
            Access::ReadWrite => pb::Access::ReadWrite as i32,
        }
    }
}

impl Op {
    pub(crate) fn from_pb(v: i32) -> Op {
        if v == pb::Op::Read as i32 {
            Op::Read
        } else {
            Op::Write
        }
    }

    pub(crate) fn to_pb(self) -> i32 {
        match self {
            Op::Write => pb::Op::Write as i32,
            Op::Read => pb::Op::Read as i32,
        }
    }
}

impl State {
    pub(crate) fn from_pb(v: i32) -> State {
        match pb::TransferState::try_from(v) {
            Ok(pb::TransferState::Connecting) => State::Connecting,
            Ok(pb::TransferState::Running) => State::Running,
            Ok(pb::TransferState::Succeeded) => State::Succeeded,
            Ok(pb::TransferState::Failed) => State::Failed,
            Ok(pb::TransferState::Cancelled) => State::Cancelled,
            _ => State::Queued,
        }
    }
}

impl Region {
    pub(crate) fn from_pb(r: pb::Region) -> Region {
        Region {
            kind: RegionKind::from_pb(r.kind),
            access: Access::from_pb(r.access),
            labels: r.labels.into_iter().collect(),
            created_at: time(r.created_at),
            expires_at: time(r.expires_at),
            unavailable: (!r.unavailable_reason.is_empty()).then_some(r.unavailable_reason),
            id: r.id,
            name: r.name,
            length: r.length,
            path: r.path,
            lkey: r.lkey,
            rkey: r.rkey,
            addr: r.addr,
        }
    }
}

impl RegionSpec {
    pub(crate) fn to_pb(&self) -> pb::CreateRegionRequest {
        pb::CreateRegionRequest {
            name: self.name.clone(),
            length: self.length,
            kind: self.kind.to_pb(),
            path: self.path.clone(),
            access: self.access.to_pb(),
            hugepages: self.hugepages,
            ttl: self.ttl.map(duration_to_pb),
            labels: self.labels.clone().into_iter().collect(),
            adopt_existing: self.adopt_existing,
            create_file: self.create_file,
        }
    }
}

impl Segment {
    pub(crate) fn to_pb(self) -> pb::Segment {
        pb::Segment { local_offset: self.local, remote_offset: self.remote, length: self.len }
    }
}

impl Options {
    pub(crate) fn to_pb(&self) -> pb::TransferOptions {
        pb::TransferOptions {
            chunk_size: self.chunk_size.unwrap_or(0),
            qps: self.qps.unwrap_or(0),
            depth: self.depth.unwrap_or(0),
            verify: self.verify,
            timeout: self.timeout.map(duration_to_pb),
            verify_algo: 0,
        }
    }
}

impl TransferSpec {
    pub(crate) fn to_pb(&self) -> pb::SubmitTransferRequest {
        pb::SubmitTransferRequest {
            op: self.op.to_pb(),
            local: Some(pb::LocalRange { region: self.local_region.clone(), offset: self.local_offset }),
            remote: Some(pb::RemoteRange { agent: self.peer.clone(), region: self.remote_region.clone(), offset: self.remote_offset }),
            length: self.length,
            options: Some(self.options.to_pb()),
            segments: self.segments.iter().map(|s| s.to_pb()).collect(),
            notify: self.notify.clone(),
        }
    }
}

impl Transfer {
    pub(crate) fn from_pb(t: pb::Transfer) -> Transfer {
        let (local_region, local_offset) = t.local.map(|l| (l.region, l.offset)).unwrap_or_default();
        let (remote_agent, remote_region, remote_offset) = t.remote.map(|r| (r.agent, r.region, r.offset)).unwrap_or_default();
        Transfer {
            op: Op::from_pb(t.op),
            state: State::from_pb(t.state),
            local_region,
            local_offset,
            remote_agent,
            remote_region,
            remote_offset,
            created_at: time(t.created_at),
            started_at: time(t.started_at),
            finished_at: time(t.finished_at),
            id: t.id,
            length: t.length,
            bytes_done: t.bytes_done,
            error: t.error,
            error_code: t.error_code,
            elapsed_seconds: t.elapsed_seconds,
            verified: t.verified,
            checksum: t.checksum,
            peer: t.peer,
            inbound: t.inbound,
            segments: t.segments,
            notify: t.notify,
            paths: t.paths,
            failovers: t.failovers,
            fallback: t.fallback,
        }
    }
}

impl Notification {
    pub(crate) fn from_pb(n: pb::Notification) -> Notification {
        Notification {
            op: Op::from_pb(n.op),
            at: time(n.at),
            region: n.region,
            peer: n.peer,
            tag: n.tag,
            offset: n.offset,
            length: n.length,
            via: n.via,
        }
    }
}

impl AgentInfo {
    pub(crate) fn from_pb(i: pb::AgentInfo) -> AgentInfo {
        AgentInfo {
            fabric: Fabric::from_pb(i.fabric),
            devices: i.devices.into_iter().map(Device::from_pb).collect(),
            limits: i.limits.map(|l| Limits {
                memlock_soft: l.memlock_soft,
                memlock_hard: l.memlock_hard,
                cap_ipc_lock: l.cap_ipc_lock,
                max_regions: l.max_regions,
                max_registered_bytes: l.max_registered_bytes,
                max_transfers: l.max_transfers,
            }),
            uptime: duration(i.uptime),
            node_name: i.node_name,
            version: i.version,
            fabric_reason: i.fabric_reason,
            data_address: i.data_address,
            regions: i.regions,
            registered_bytes: i.registered_bytes,
            fallback: i.fallback,
        }
    }
}

impl Device {
    fn from_pb(d: pb::DeviceInfo) -> Device {
        Device {
            gids: d.gids.into_iter().map(|g| Gid { index: g.index, raw: g.raw, kind: g.r#type, netdev: g.netdev }).collect(),
            selected_gid_index: u32::try_from(d.selected_gid_index).ok(),
            numa_node: d.numa_node,
            pci_address: Some(d.pci_address).filter(|a| !a.is_empty()),
            speed_mbps: Some(d.speed_mbps).filter(|s| *s > 0),
            netdev: Some(d.netdev).filter(|n| !n.is_empty()),
            // 0 is unknown and anything above 32 is not an IPv4 prefix.
            ipv4_prefix: u8::try_from(d.ipv4_prefix).ok().filter(|p| (1..=32).contains(p)),
            name: d.name,
            port: d.port,
            state: d.state,
            link_layer: d.link_layer,
            active_mtu: d.active_mtu,
            lid: d.lid,
        }
    }
}

impl Peer {
    pub(crate) fn from_pb(p: pb::PeerInfo) -> Peer {
        Peer {
            fabric: Fabric::from_pb(p.fabric),
            connect_duration: duration(p.connect_duration),
            address: p.address,
            node_name: p.node_name,
            qps: p.qps,
            state: p.state,
            error: p.error,
        }
    }
}

impl BenchSpec {
    pub(crate) fn to_pb(&self) -> pb::BenchRequest {
        pb::BenchRequest {
            peer: self.peer.clone(),
            op: self.op.to_pb(),
            size: self.size,
            iters: self.iters,
            qps: self.qps,
            depth: self.depth,
            blocks: self.blocks,
            pool: self.pool,
            channel: self.channel,
            connections: self.connections,
            hold_ms: self.hold_ms,
            interval_ms: self.interval_ms,
            per_path: self.per_path,
            lat_iters: self.lat_iters,
        }
    }
}

impl BenchResult {
    pub(crate) fn from_pb(r: pb::BenchResponse) -> BenchResult {
        BenchResult {
            size: r.size,
            iters: r.iters,
            bytes: r.bytes,
            seconds: r.seconds,
            gbit_per_s: r.gbit_per_s,
            lat_avg_us: r.lat_avg_us,
            lat_p50_us: r.lat_p50_us,
            lat_p99_us: r.lat_p99_us,
            lat_iters: r.lat_iters,
            fabric: Fabric::from_pb(r.fabric),
            blocks: r.blocks,
            submit_p50_us: r.submit_p50_us,
            prep_ns_per_segment: r.prep_ns_per_segment,
            channel: r.channel,
            repost_ns_per_segment: r.repost_ns_per_segment,
            channel_open_us: r.channel_open_us,
            connections: r.connections,
            qps_held: r.qps_held,
            rss_bytes_per_qp: r.rss_bytes_per_qp,
            rpc_p50_us: r.rpc_p50_us,
            paths: r.paths.into_iter().map(PathProbe::from_pb).collect(),
        }
    }
}

impl PathProbe {
    pub(crate) fn from_pb(p: pb::PathProbe) -> PathProbe {
        PathProbe {
            local_device: p.local_device,
            remote_device: p.remote_device,
            mtu: p.mtu,
            gbit_per_s: p.gbit_per_s,
            lat_p50_us: p.lat_p50_us,
            error: Some(p.error).filter(|e| !e.is_empty()),
        }
    }
}

impl TcpBaselineSpec {
    pub(crate) fn to_pb(&self) -> pb::TcpBaselineRequest {
        pb::TcpBaselineRequest {
            peer: self.peer.clone(),
            bytes: self.bytes,
            connections: self.connections,
            block: self.block,
            tls: self.tls,
            pool: self.pool,
            scatter: self.scatter,
        }
    }
}

impl TcpBaseline {
    pub(crate) fn from_pb(r: pb::TcpBaselineResponse) -> TcpBaseline {
        TcpBaseline { bytes: r.bytes, seconds: r.seconds, gbit_per_s: r.gbit_per_s }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_enum_values_from_a_newer_agent_map_to_defaults() {
        assert_eq!(Fabric::from_pb(99), Fabric::Unspecified);
        assert_eq!(RegionKind::from_pb(0), RegionKind::Anonymous);
        assert_eq!(Access::from_pb(0), Access::ReadWrite);
        assert_eq!(State::from_pb(99), State::Queued);
    }

    #[test]
    fn a_region_keeps_every_field() {
        let r = Region::from_pb(pb::Region {
            id: "r-1".into(),
            name: "kv".into(),
            length: 4096,
            kind: pb::RegionKind::Shm as i32,
            path: "xfer-kv".into(),
            access: pb::Access::Read as i32,
            labels: [("team".to_string(), "infra".to_string())].into(),
            created_at: Some(prost_types::Timestamp { seconds: 1_700_000_000, nanos: 0 }),
            expires_at: None,
            lkey: 1,
            rkey: 2,
            addr: u64::MAX - 2,
            unavailable_reason: String::new(),
        });
        assert_eq!((r.kind, r.access, r.addr, r.unavailable.clone()), (RegionKind::Shm, Access::Read, u64::MAX - 2, None));
        assert_eq!(r.labels.get("team").map(String::as_str), Some("infra"));
        assert_eq!(r.created_at, Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)));
        assert_eq!(r.expires_at, None);
    }

    #[test]
    fn a_device_without_a_selected_gid() {
        let d = Device::from_pb(pb::DeviceInfo { selected_gid_index: -1, ..Default::default() });
        assert_eq!(d.selected_gid_index, None);
        let d = Device::from_pb(pb::DeviceInfo { selected_gid_index: 3, ..Default::default() });
        assert_eq!(d.selected_gid_index, Some(3));
    }

    #[test]
    fn a_devices_placement_unknowns_are_none() {
        let d = Device::from_pb(pb::DeviceInfo {
            numa_node: Some(1),
            pci_address: "0000:af:00.0".into(),
            speed_mbps: 200_000,
            netdev: "ens1np0".into(),
            ipv4_prefix: 24,
            ..Default::default()
        });
        assert_eq!((d.numa_node, d.pci_address.as_deref(), d.speed_mbps), (Some(1), Some("0000:af:00.0"), Some(200_000)));
        assert_eq!((d.netdev.as_deref(), d.ipv4_prefix), (Some("ens1np0"), Some(24)));
        let d = Device::from_pb(pb::DeviceInfo { numa_node: None, ..Default::default() });
        assert_eq!((d.numa_node, d.pci_address, d.speed_mbps, d.netdev, d.ipv4_prefix), (None, None, None, None, None));
        for bad in [33, 256, u32::MAX] {
            assert_eq!(Device::from_pb(pb::DeviceInfo { ipv4_prefix: bad, ..Default::default() }).ipv4_prefix, None, "{bad}");
        }
    }
}
