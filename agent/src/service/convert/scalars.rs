//! Durations, timestamps and the enums many messages share (fabric kind, checksum algorithm,
//! access, region kind, operation), both ways. A value a caller sent that no domain value
//! matches is INVALID_ARGUMENT; a duration or time out of range is `None`.
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tonic::Status;
use xfer_proto::v1 as pb;

use super::status::invalid;
use crate::checksum::Algo;
use crate::fabric::{Access, FabricKind};
use crate::regions::RegionKind;
use crate::transfer::Op;

pub fn duration_to_pb(d: Duration) -> prost_types::Duration {
    prost_types::Duration { seconds: d.as_secs().min(i64::MAX as u64) as i64, nanos: d.subsec_nanos() as i32 }
}

/// Longest ttl or timeout a request may carry (100 years). The agent turns them into deadlines
/// (`SystemTime::now() + ttl`, `Instant::now() + timeout`), which panic on overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `None` for negative, malformed or longer-than-[`MAX_DURATION`] durations.
pub fn duration_from_pb(d: &prost_types::Duration) -> Option<Duration> {
    if d.seconds < 0 || d.nanos < 0 || d.nanos >= 1_000_000_000 || d.seconds as u64 > MAX_DURATION.as_secs() {
        return None;
    }
    Some(Duration::new(d.seconds as u64, d.nanos as u32))
}

/// An optional request duration (ttl, timeout); `what` names the field in the error.
pub(super) fn request_duration(d: Option<&prost_types::Duration>, what: &str) -> Result<Option<Duration>, Status> {
    match d {
        Some(d) => duration_from_pb(d).map(Some).ok_or_else(|| invalid(format!("{what} must be between 0 and 100 years"))),
        None => Ok(None),
    }
}

pub fn time_to_pb(t: SystemTime) -> prost_types::Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp { seconds: d.as_secs() as i64, nanos: d.subsec_nanos() as i32 }
}

pub fn time_from_pb(t: prost_types::Timestamp) -> Option<SystemTime> {
    if t.seconds < 0 || !(0..1_000_000_000).contains(&t.nanos) {
        return None;
    }
    UNIX_EPOCH.checked_add(Duration::new(t.seconds as u64, t.nanos as u32))
}

pub fn fabric_to_pb(k: FabricKind) -> pb::FabricKind {
    match k {
        FabricKind::Tcp => pb::FabricKind::Tcp,
        FabricKind::Verbs => pb::FabricKind::Verbs,
    }
}

pub fn fabric_from_pb(v: i32) -> Option<FabricKind> {
    match pb::FabricKind::try_from(v).ok()? {
        pb::FabricKind::Tcp => Some(FabricKind::Tcp),
        pb::FabricKind::Verbs => Some(FabricKind::Verbs),
        pb::FabricKind::Unspecified => None,
    }
}

pub fn algo_to_pb(a: Algo) -> pb::ChecksumAlgo {
    match a {
        Algo::Xxh3 => pb::ChecksumAlgo::Xxh3,
        Algo::Crc32c => pb::ChecksumAlgo::Crc32c,
    }
}

pub fn algo_from_pb(v: i32) -> Result<Algo, Status> {
    match pb::ChecksumAlgo::try_from(v) {
        Ok(pb::ChecksumAlgo::Unspecified | pb::ChecksumAlgo::Xxh3) => Ok(Algo::Xxh3),
        Ok(pb::ChecksumAlgo::Crc32c) => Ok(Algo::Crc32c),
        Err(_) => Err(invalid(format!("unknown checksum algorithm {v}"))),
    }
}

pub fn access_to_pb(a: Access) -> pb::Access {
    match a {
        Access::Read => pb::Access::Read,
        Access::Write => pb::Access::Write,
        Access::ReadWrite => pb::Access::ReadWrite,
    }
}

pub fn access_from_pb(v: i32) -> Result<Access, Status> {
    match pb::Access::try_from(v) {
        Ok(pb::Access::Unspecified | pb::Access::ReadWrite) => Ok(Access::ReadWrite),
        Ok(pb::Access::Read) => Ok(Access::Read),
        Ok(pb::Access::Write) => Ok(Access::Write),
        Err(_) => Err(invalid(format!("unknown access {v}"))),
    }
}

pub fn kind_from_pb(v: i32) -> Result<RegionKind, Status> {
    match pb::RegionKind::try_from(v) {
        Ok(pb::RegionKind::Unspecified | pb::RegionKind::Anonymous) => Ok(RegionKind::Anonymous),
        Ok(pb::RegionKind::File) => Ok(RegionKind::File),
        Ok(pb::RegionKind::Shm) => Ok(RegionKind::Shm),
        Err(_) => Err(invalid(format!("unknown region kind {v}"))),
    }
}

pub(super) fn kind_to_pb(k: RegionKind) -> pb::RegionKind {
    match k {
        RegionKind::Anonymous => pb::RegionKind::Anonymous,
        RegionKind::File => pb::RegionKind::File,
        RegionKind::Shm => pb::RegionKind::Shm,
    }
}

pub fn op_from_pb(v: i32) -> Result<Op, Status> {
    match pb::Op::try_from(v) {
        Ok(pb::Op::Write) => Ok(Op::Write),
        Ok(pb::Op::Read) => Ok(Op::Read),
        _ => Err(invalid("op must be OP_WRITE or OP_READ")),
    }
}

pub(super) fn op_to_pb(o: Op) -> pb::Op {
    match o {
        Op::Write => pb::Op::Write,
        Op::Read => pb::Op::Read,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_reject_negative_values() {
        assert_eq!(duration_from_pb(&prost_types::Duration { seconds: -1, nanos: 0 }), None);
        assert_eq!(duration_from_pb(&prost_types::Duration { seconds: 2, nanos: 5 }), Some(Duration::new(2, 5)));
    }
}
