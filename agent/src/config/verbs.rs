//! The `verbs` section: which RDMA device and port, queue-pair attributes, how completions are
//! polled and where the data-path worker thread runs.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};
use xfer_common::{ByteSize, HumanDuration};

use xfer_fabric::verbs::GrantMode;

/// A list of device entries, or one string: `auto`, or comma-separated entries (how the
/// environment carries a list: `XFER_VERBS__DEVICES=rxe0,rxe2`). `auto` (alone) is the empty list.
fn devices_or_csv<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        List(Vec<String>),
        Csv(String),
    }
    let list = match Raw::deserialize(d)? {
        Raw::List(v) => v,
        Raw::Csv(s) => s.split(',').map(|e| e.trim().to_string()).filter(|e| !e.is_empty()).collect(),
    };
    Ok(if list.len() == 1 && list[0].eq_ignore_ascii_case(AUTO) { Vec::new() } else { list })
}

/// `verbs.devices` meaning every usable device.
const AUTO: &str = "auto";

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct VerbsConfig {
    /// One device by name; empty = as `devices` says. Refused together with `devices`.
    pub device: String,
    /// The devices to use, each `name`, `name:port` or `name:port:gid_index` (`mlx5_0`,
    /// `mlx5_1:1`, `rxe0:1:1`); `auto` or empty = every device whose port is ACTIVE with a
    /// usable GID or may become so (DOWN, INIT, ARMED: its link comes up later), in name order.
    /// A device whose port is not ACTIVE, listed or found, is opened and used once it is. With
    /// more than one, a connection has one path per local device that reaches one of the peer's.
    /// Env: comma-separated.
    #[serde(deserialize_with = "devices_or_csv", serialize_with = "devices_to_toml")]
    pub devices: Vec<String>,
    pub port: u8,
    /// -1 = automatic RoCEv2 IPv4-mapped GID on the netdev that carries the agent's address
    pub gid_index: i32,
    pub grant_mode: GrantMode,
    /// local ACK timeout exponent (4.096 µs × 2^timeout)
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    /// Poll the CQ in a loop while work requests are outstanding (lower latency, one core busy
    /// during transfers); otherwise completions arrive through the completion channel.
    pub busy_poll: bool,
    /// How long the data path busy-polls after its last completion before it sleeps until
    /// woken (0 = never spin): the device's worker thread for channel batches and benchmarks,
    /// a transfer's own task otherwise. Spinning trades a core for latency: a completion within
    /// the budget costs no wake-up.
    pub poll_spin: HumanDuration,
    /// Drive channel batches and benchmarks from one data-path thread per device that posts
    /// their work requests and polls their completion queues itself (no tokio wake-up per
    /// completion). `false`: each batch's own tokio task drives it.
    pub worker: bool,
    /// The CPUs the worker thread is pinned to: `auto` (the device's NUMA node, within the
    /// CPUs this process may run on; unpinned if the device names no node), `off`, or a CPU
    /// list (`3`, `8-15`). On Soft-RoCE one CPU keeps each QP's packets in order, which READs
    /// need (see [`crate::cpus`]).
    pub worker_cpu: crate::cpus::WorkerCpu,
    /// Largest READ work request: longer READ chunks (a `--chunk` above it, a benchmark's large
    /// messages) are posted as several READs of at most this many bytes.
    pub max_read_wr: ByteSize,
    /// Connections of each recently used shape (QP count, depth, initiator or responder) kept
    /// built and in INIT, so a negotiation only draws PSNs and moves QPs to RTR and RTS; one is
    /// rebuilt by the fabric's builder thread (`SCHED_IDLE`) after each is taken. At most 4
    /// shapes and 64 QPs in all are held (about 80-100 KiB each on rxe). 0 = build each
    /// connection while negotiating it.
    pub prebuilt: usize,
    /// RDMA READs outstanding per QP (the initiator depth and the responder resources both
    /// sides offer; a connection uses the smaller of the two agents'). 0 = the device's
    /// maximum, as perftest does (rxe 128, ConnectX 16).
    pub max_rd_atomic: u8,
    /// How long, at most, the responder busy-polls a connection's notification markers after a
    /// grant with a notification (or a channel batch's announcement) on it, until the
    /// notification is published: the last marker is seen within one poll instead of after a
    /// completion-channel wake-up. One core spins while any connection waits. 0 = never.
    pub marker_spin: HumanDuration,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        // timeout 16 ≈ 268 ms per try; × (1 + retry_cnt 6) ≈ 1.9 s to declare a peer dead.
        VerbsConfig {
            device: String::new(),
            devices: Vec::new(),
            port: 1,
            gid_index: -1,
            grant_mode: GrantMode::Mr,
            timeout: 16,
            retry_cnt: 6,
            rnr_retry: 6,
            busy_poll: false,
            poll_spin: HumanDuration(Duration::from_micros(50)),
            worker: true,
            worker_cpu: crate::cpus::WorkerCpu::Auto,
            max_read_wr: ByteSize(1 << 20),
            prebuilt: 2,
            max_rd_atomic: 0,
            marker_spin: HumanDuration(Duration::from_millis(50)),
        }
    }
}

/// The empty list prints as `auto`, so the printed configuration reads as it is meant.
fn devices_to_toml<S: serde::Serializer>(v: &[String], s: S) -> Result<S::Ok, S::Error> {
    if v.is_empty() {
        s.serialize_str(AUTO)
    } else {
        v.serialize(s)
    }
}

impl VerbsConfig {
    /// `devices` parsed (`None` = auto); the first entry that does not parse, with its index.
    pub fn device_specs(&self) -> Result<Option<Vec<xfer_fabric::verbs::DeviceSpec>>, (usize, String)> {
        if self.devices.is_empty() {
            return Ok(None);
        }
        self.devices.iter().enumerate().map(|(i, d)| d.parse().map_err(|e| (i, e))).collect::<Result<Vec<_>, _>>().map(Some)
    }
}
