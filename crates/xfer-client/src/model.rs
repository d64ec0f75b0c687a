//! The client's domain types: what an agent, a region, a transfer, a peer, a notification and a
//! benchmark run are, in Rust terms (enums rather than protobuf integers, `SystemTime` and
//! `Duration` rather than well-known types, `None` rather than empty strings). They carry every
//! field the API returns, so a program (and `xferctl`) never needs the generated types. The
//! conversions to and from protobuf live in one place, `convert.rs`.
use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime};

use crate::{Error, Result};

/// Writes the short lower-case names used in text and JSON (`tcp`, `shm`, `rw`, `succeeded`).
macro_rules! names {
    ($t:ty { $($v:ident => $s:literal),* $(,)? }) => {
        impl $t {
            /// The short lower-case name (`xferctl`'s text and JSON use it).
            pub fn as_str(&self) -> &'static str {
                match self { $(<$t>::$v => $s),* }
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

/// The fabric an agent moves data over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fabric {
    /// An agent that did not say (an older agent, or a peer not connected yet).
    #[default]
    Unspecified,
    Tcp,
    Verbs,
}
names!(Fabric { Unspecified => "unspecified", Tcp => "tcp", Verbs => "verbs" });

/// What backs a region's memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RegionKind {
    /// Agent-private anonymous memory.
    #[default]
    Anonymous,
    /// A file mapped by the agent.
    File,
    /// A POSIX shared-memory object other local processes can map.
    Shm,
}
names!(RegionKind { Anonymous => "anonymous", File => "file", Shm => "shm" });

/// What remote peers may do to a region (its ceiling; grants narrow it further).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Access {
    /// Peers may READ from it.
    Read,
    /// Peers may WRITE into it.
    Write,
    #[default]
    ReadWrite,
}
names!(Access { Read => "r", Write => "w", ReadWrite => "rw" });

/// WRITE (local bytes into the peer's region) or READ (the peer's bytes into the local region).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Op {
    #[default]
    Write,
    Read,
}
names!(Op { Write => "write", Read => "read" });

/// A transfer's state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum State {
    #[default]
    Queued,
    Connecting,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}
names!(State {
    Queued => "queued",
    Connecting => "connecting",
    Running => "running",
    Succeeded => "succeeded",
    Failed => "failed",
    Cancelled => "cancelled",
});

impl State {
    /// SUCCEEDED, FAILED or CANCELLED: the transfer will not change again.
    pub fn is_terminal(self) -> bool {
        matches!(self, State::Succeeded | State::Failed | State::Cancelled)
    }
}

/// An end-to-end checksum algorithm.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ChecksumAlgo {
    #[default]
    Xxh3,
    Crc32c,
}
names!(ChecksumAlgo { Xxh3 => "xxh3", Crc32c => "crc32c" });

// ------------------------------------------------------------------------------------ agent

/// One GID of a port.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Gid {
    pub index: u32,
    /// The 16 raw bytes.
    pub raw: Vec<u8>,
    /// `RoCEv2`, `RoCEv1` or `IB`.
    pub kind: String,
    pub netdev: String,
}

/// An RDMA device port the agent sees.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Device {
    pub name: String,
    pub port: u32,
    /// e.g. `ACTIVE`.
    pub state: String,
    /// `Ethernet` or `InfiniBand`.
    pub link_layer: String,
    /// Bytes.
    pub active_mtu: u32,
    pub lid: u32,
    pub gids: Vec<Gid>,
    /// The GID the agent uses; `None` when it uses none.
    pub selected_gid_index: Option<u32>,
    /// The NUMA node of the device's PCI function; `None` when unknown (software devices such as
    /// rxe, hosts without NUMA).
    pub numa_node: Option<u32>,
    /// `dddd:bb:dd.f`; `None` without a PCI parent.
    pub pci_address: Option<String>,
    /// The port's signalling rate in Mb/s; `None` when unknown.
    pub speed_mbps: Option<u64>,
    /// The netdev of the selected GID (else the port's first); `None` on InfiniBand.
    pub netdev: Option<String>,
    /// The prefix length of the selected GID's IPv4 address on its interface; `None` when unknown.
    pub ipv4_prefix: Option<u8>,
}

/// The agent's resource limits.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Bytes; `u64::MAX` = unlimited.
    pub memlock_soft: u64,
    pub memlock_hard: u64,
    pub cap_ipc_lock: bool,
    pub max_regions: u32,
    pub max_registered_bytes: u64,
    pub max_transfers: u32,
}

/// What an agent says about itself (`GetInfo`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AgentInfo {
    pub node_name: String,
    pub version: String,
    pub fabric: Fabric,
    /// Why the agent chose that fabric.
    pub fabric_reason: String,
    pub devices: Vec<Device>,
    pub limits: Option<Limits>,
    pub uptime: Option<Duration>,
    /// The TCP fabric's data listener, if any.
    pub data_address: String,
    pub regions: u32,
    pub registered_bytes: u64,
    /// `transfer.fallback` in effect: `never` or `tcp` (a verbs agent's tcp standby path); empty
    /// from an older agent.
    pub fallback: String,
}

/// A peer agent this agent holds a connection to.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Peer {
    /// The peer's gRPC address as it was dialled.
    pub address: String,
    pub node_name: String,
    pub fabric: Fabric,
    pub qps: u32,
    /// `NEW` (never answered), `CONNECTED`, or `FAILED` (its last call did not reach it).
    pub state: String,
    pub connect_duration: Option<Duration>,
    /// `FAILED`: the last transport error.
    pub error: String,
}

// ------------------------------------------------------------------------------------ regions

/// A region as the agent describes it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Region {
    pub id: String,
    pub name: String,
    pub length: u64,
    pub kind: RegionKind,
    /// File path (file regions) or shared-memory object name (shm regions).
    pub path: String,
    pub access: Access,
    pub labels: BTreeMap<String, String>,
    pub created_at: Option<SystemTime>,
    /// When its lease ends; `None` = no lease.
    pub expires_at: Option<SystemTime>,
    /// The region-wide keys and registered address: set only in verbs grant mode `region`
    /// (elsewhere 0: remote access goes through grants).
    pub lkey: u32,
    pub rkey: u32,
    pub addr: u64,
    /// Set when the agent could not restore the region (it retries).
    pub unavailable: Option<String>,
}

/// A region to create ([`crate::Client::create`]): built with [`RegionSpec::anonymous`],
/// [`RegionSpec::file`] or [`RegionSpec::shm`] and the chained setters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RegionSpec {
    pub name: String,
    pub length: u64,
    pub kind: RegionKind,
    /// File regions: the file's path (inside the agent's allowed roots). Shm regions: the
    /// object's name (default `xfer-<name>`).
    pub path: String,
    pub access: Access,
    pub hugepages: bool,
    /// A lease: the agent deletes the region this long after creating it.
    pub ttl: Option<Duration>,
    pub labels: BTreeMap<String, String>,
    /// Shm regions: map an object that exists already (its bytes are kept) instead of refusing.
    pub adopt_existing: bool,
    /// File regions: create the file (`length` zero bytes beneath the agent's file root; a file
    /// already there is refused, never replaced). Without it the file must exist, and a
    /// `length` of 0 takes the file's size.
    pub create_file: bool,
}

impl RegionSpec {
    /// Agent-private memory of `length` bytes.
    pub fn anonymous(name: &str, length: u64) -> RegionSpec {
        RegionSpec { name: name.into(), length, ..Default::default() }
    }

    /// The existing file at `path` on the agent's node (`length` 0: the file's size); set
    /// `create_file` to create it.
    pub fn file(name: &str, path: &str, length: u64) -> RegionSpec {
        RegionSpec { name: name.into(), length, kind: RegionKind::File, path: path.into(), ..Default::default() }
    }

    /// A shared-memory object of `length` bytes other local processes can map.
    pub fn shm(name: &str, length: u64) -> RegionSpec {
        RegionSpec { name: name.into(), length, kind: RegionKind::Shm, ..Default::default() }
    }

    pub fn access(mut self, access: Access) -> RegionSpec {
        self.access = access;
        self
    }

    pub fn ttl(mut self, ttl: Duration) -> RegionSpec {
        self.ttl = Some(ttl);
        self
    }

    pub fn label(mut self, key: &str, value: &str) -> RegionSpec {
        self.labels.insert(key.into(), value.into());
        self
    }

    pub fn hugepages(mut self, on: bool) -> RegionSpec {
        self.hugepages = on;
        self
    }

    pub fn adopt_existing(mut self, on: bool) -> RegionSpec {
        self.adopt_existing = on;
        self
    }

    /// Shm regions: the object's name instead of `xfer-<name>`.
    pub fn path(mut self, path: &str) -> RegionSpec {
        self.path = path.into();
        self
    }
}

// ------------------------------------------------------------------------------------ transfers

/// One piece of a batch: `len` bytes between `local` of the local region and `remote` of the
/// remote region (absolute offsets).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Segment {
    pub local: u64,
    pub remote: u64,
    pub len: u64,
}

/// Shape of the data path; `None` = the agent's default.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Options {
    pub chunk_size: Option<u64>,
    pub qps: Option<u32>,
    pub depth: Option<u32>,
    pub timeout: Option<Duration>,
    /// Compare checksums of source and destination (single ranges only).
    pub verify: bool,
}

/// A transfer to submit: built with [`TransferSpec::write`] or [`TransferSpec::read`] and the
/// chained setters.
#[derive(Clone, Debug, PartialEq)]
pub struct TransferSpec {
    pub op: Op,
    pub local_region: String,
    pub local_offset: u64,
    /// The peer agent's gRPC address (`host:port`).
    pub peer: String,
    pub remote_region: String,
    pub remote_offset: u64,
    /// `None` = the rest of the source range (single ranges). `Some(0)` is refused by the agent
    /// (INVALID_ARGUMENT): a zero-length copy is a mistake, not "everything".
    pub length: Option<u64>,
    /// A batch; empty = one range.
    pub segments: Vec<Segment>,
    pub notify: Option<Vec<u8>>,
    pub options: Options,
}

impl TransferSpec {
    /// Local region `local` into region `remote` of the agent at `peer`.
    pub fn write(local: &str, peer: &str, remote: &str) -> TransferSpec {
        TransferSpec::new(Op::Write, local, peer, remote)
    }

    /// Region `remote` of the agent at `peer` into local region `local`.
    pub fn read(local: &str, peer: &str, remote: &str) -> TransferSpec {
        TransferSpec::new(Op::Read, local, peer, remote)
    }

    pub fn new(op: Op, local: &str, peer: &str, remote: &str) -> TransferSpec {
        TransferSpec {
            op,
            local_region: local.into(),
            local_offset: 0,
            peer: peer.into(),
            remote_region: remote.into(),
            remote_offset: 0,
            length: None,
            segments: Vec::new(),
            notify: None,
            options: Options::default(),
        }
    }

    /// One range: `length` bytes from `local_offset` to `remote_offset`.
    pub fn range(mut self, local_offset: u64, remote_offset: u64, length: u64) -> TransferSpec {
        (self.local_offset, self.remote_offset, self.length) = (local_offset, remote_offset, Some(length));
        self
    }

    /// One range from `local_offset` to `remote_offset`, to the end of the source range.
    pub fn at(mut self, local_offset: u64, remote_offset: u64) -> TransferSpec {
        (self.local_offset, self.remote_offset, self.length) = (local_offset, remote_offset, None);
        self
    }

    /// A batch of segments, moved as one transfer.
    pub fn segments(mut self, segments: Vec<Segment>) -> TransferSpec {
        self.segments = segments;
        self
    }

    /// Have the target tell its `watch_inbound` subscribers, with `tag`, once every byte landed.
    pub fn notify(mut self, tag: &[u8]) -> TransferSpec {
        self.notify = Some(tag.to_vec());
        self
    }

    pub fn options(mut self, options: Options) -> TransferSpec {
        self.options = options;
        self
    }
}

/// A transfer record.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Transfer {
    pub id: String,
    pub op: Op,
    pub state: State,
    pub local_region: String,
    pub local_offset: u64,
    /// The other agent's gRPC address as the initiator dialled it (inbound records: as the
    /// initiator named itself).
    pub remote_agent: String,
    pub remote_region: String,
    pub remote_offset: u64,
    pub length: u64,
    pub bytes_done: u64,
    /// The human reason when FAILED or CANCELLED; empty otherwise.
    pub error: String,
    /// The machine-readable cause (`REM_ACCESS_ERR`, `GRANT_EXPIRED`, `CHECKSUM_MISMATCH`, …).
    pub error_code: String,
    pub created_at: Option<SystemTime>,
    pub started_at: Option<SystemTime>,
    pub finished_at: Option<SystemTime>,
    /// Running time so far (or in total), in seconds.
    pub elapsed_seconds: f64,
    pub verified: bool,
    pub checksum: u64,
    /// The peer's node name once known.
    pub peer: String,
    /// True on the target's record of a transfer another agent initiated.
    pub inbound: bool,
    /// Segments after coalescing (1 for a single range).
    pub segments: u64,
    pub notify: Option<Vec<u8>>,
    /// Paths (device pairs) of the connection it ran on; 0 before it had one.
    pub paths: u32,
    /// Paths lost mid-transfer whose work went on the others: it ran degraded.
    pub failovers: u32,
    /// Every RDMA path was lost and the tcp fallback path carried bytes.
    pub fallback: bool,
}

impl Transfer {
    /// `Ok` when it succeeded (or has not ended); the failure as an [`Error::Transfer`]
    /// otherwise.
    pub fn into_result(self) -> Result<Transfer> {
        match self.state {
            State::Failed | State::Cancelled => {
                Err(Error::Transfer { id: self.id, state: self.state, code: self.error_code, message: self.error })
            }
            _ => Ok(self),
        }
    }

    pub fn elapsed(&self) -> Duration {
        Duration::try_from_secs_f64(self.elapsed_seconds).unwrap_or_default()
    }
}

/// A notification a peer's batch raised on this agent.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Notification {
    pub region: String,
    /// The moving agent's authenticated identity.
    pub peer: String,
    pub tag: Vec<u8>,
    pub op: Op,
    /// The granted range the batch lay in.
    pub offset: u64,
    pub length: u64,
    /// When the agent published it.
    pub at: Option<SystemTime>,
    /// `fabric` (markers behind the data) or `complete` (the initiator's `Peer.Complete`).
    pub via: String,
}

// ------------------------------------------------------------------------------------ benchmarks

mod bench;
pub use bench::{BenchResult, BenchSpec, PathProbe, TcpBaseline, TcpBaselineSpec};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_names() {
        assert_eq!(Fabric::Verbs.to_string(), "verbs");
        assert_eq!(RegionKind::Shm.as_str(), "shm");
        assert_eq!(Access::Read.as_str(), "r");
        assert_eq!(Access::default().as_str(), "rw");
        assert_eq!(State::Succeeded.to_string(), "succeeded");
        assert_eq!(Op::Read.to_string(), "read");
        assert!(State::Cancelled.is_terminal() && !State::Running.is_terminal());
    }

    #[test]
    fn a_failed_transfer_is_an_error_with_its_code() {
        let t = Transfer {
            id: "t".into(),
            state: State::Failed,
            error: "boom".into(),
            error_code: "RETRY_EXC_ERR".into(),
            ..Default::default()
        };
        match t.into_result() {
            Err(Error::Transfer { id, state: State::Failed, code, message }) => {
                assert_eq!((id.as_str(), code.as_str(), message.as_str()), ("t", "RETRY_EXC_ERR", "boom"))
            }
            other => panic!("{other:?}"),
        }
        assert!(Transfer { state: State::Running, ..Default::default() }.into_result().is_ok());
    }
}
