//! xfer-fabric: the data plane behind one trait, shaped after RDMA verbs.
//!
//! A [`Fabric`] registers region memory ([`Registration`]: lkey/rkey/address), exposes ranges of it
//! to peers ([`Exposure`]: the remote address and key a grant hands out), negotiates connections
//! (a set of reliable, ordered "QPs" per peer, described by [`Endpoint`]s exchanged over
//! `Peer.Connect`), and executes one-sided [`WorkRequest`]s whose results arrive as
//! [`Completion`]s with verbs-style [`WcStatus`]es on the sink given at connection time.
//!
//! Two implementations: [`tcp`] (software one-sided ops over TCP) and [`verbs`] (RC QPs over
//! sideway, feature `verbs`). The transfer engine only sees this trait, so both behave alike; one
//! conformance suite (`agent/tests/device/conformance.rs`) runs against both.
//!
//! # Layout
//! * this file — the [`Fabric`] trait and the types it speaks.
//! * [`tcp`] — the tcp fabric: initiator, target, limits; [`stall`] — its write-stall guard.
//! * [`verbs`] — the verbs fabric by role: device, negotiation, connection and CQ, initiator,
//!   responder, markers.
//! * [`grant`] — grant checks on the data plane: what the grant table answers, the grant's gate.
//! * [`identity`] — who a peer is, from its certificate (the data streams' TLS is checked with it).
//! * [`accept`] — socket caps and accept back-off; [`metrics`] — the metrics the data plane records.
//! * [`topology`] — where devices sit (sysfs, NUMA of regions) and local IPv4 subnets.
//!
//! Semantics every implementation keeps:
//! * Work requests on one QP complete in order. A successful completion of a signaled WR implies
//!   every earlier WR on that QP succeeded. Unsignaled WRs produce a completion only on error.
//! * After the first error on a QP, the QP is broken: remaining WRs complete with
//!   [`WcStatus::WrFlushErr`] and later posts fail with [`FabricError::QpBroken`].
//! * A posted WR keeps its [`Registration`] (and so the memory) alive until its completion or flush
//!   has been delivered — cancelling a transfer never frees memory under a WR.
#![forbid(unsafe_code)]

use std::any::Any;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use tokio::sync::mpsc;

use xfer_rdma::memory::RegionMemory;

pub use xfer_engine::frame;
pub use xfer_engine::status::WcStatus;

pub mod accept;
pub mod grant;
pub mod identity;
mod keys;
mod kinds;
pub use kinds::{Access, FabricKind, RemoteOp};
pub mod metrics;
pub mod stall;
pub mod tcp;
pub mod topology;
pub mod verbs;

/// Errors of fabric operations (not of individual work requests: those are [`WcStatus`]es).
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    #[error("no usable RDMA device: {0}")]
    NoDevice(String),
    #[error("{step}: {attr}: {detail}")]
    Negotiation { step: &'static str, attr: &'static str, detail: String },
    #[error("memory registration failed: {0}")]
    Registration(String),
    #[error("QP is in error state")]
    QpBroken,
    #[error("QP index {0} out of range")]
    NoSuchQp(usize),
    #[error("remote key is not valid for this fabric")]
    BadRemoteKey,
    #[error("work request out of range of its local registration: {0}")]
    LocalRange(String),
    #[error("connection to {addr} failed: {source}")]
    Connect { addr: String, source: std::io::Error },
    /// The field is not named `source` on purpose: the message already includes it, and a
    /// `source()` would make error chains print it twice.
    #[error("cannot bind {addr}: {error}")]
    Bind { addr: String, error: std::io::Error },
    #[error("fabric I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Other(String),
}

/// Memory registered with a fabric (an MR on verbs). Dropping the last handle deregisters it.
pub trait Registration: Send + Sync + fmt::Debug {
    fn memory(&self) -> &Arc<RegionMemory>;
    /// Local key for work requests that use this memory.
    fn lkey(&self) -> u32;
    /// Remote key of the whole registration (0 where the fabric has none).
    fn rkey(&self) -> u32;
    /// Address of the memory's first byte in the registered address space.
    fn addr(&self) -> u64 {
        self.memory().addr()
    }
    fn access(&self) -> Access;
    /// True if `rkey` (with `addr`) by itself gives a peer remote access to this memory: only a
    /// verbs region MR in grant mode `region`. Otherwise only grants do, and the
    /// Agent API must not show the keys or the registered address.
    fn remote_key_exposed(&self) -> bool;
    /// The concrete registration, for the fabric that made it (verbs binds windows to its MR).
    fn as_any(&self) -> &dyn Any;
}

/// The key a peer presents with one-sided operations on memory it was granted.
#[derive(Clone, PartialEq, Eq)]
pub enum RemoteKey {
    /// verbs rkey (of an MR, an MW, or the region's MR)
    Rkey(u32),
    /// verbs, grant mode `mw`: one type-2 window per QP of the connection the grant was bound to;
    /// a work request on QP `i` must use key `i` (a type-2 window only answers on its own QP).
    PerQp(Arc<[u32]>),
    /// tcp: unguessable 128-bit grant token, checked on every frame
    Token([u8; 16]),
    /// A verbs fabric with a tcp fallback rail: one key per QP of the grantee's connection, each
    /// in its own path's form (an rkey for a device's QPs, the tcp token for the fallback's).
    /// Only made when the connection has a tcp rail; otherwise `PerQp` says the same in less.
    Each(Arc<[RemoteKey]>),
}

impl fmt::Debug for RemoteKey {
    // Keys are secrets: never print them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoteKey::Rkey(_) => f.write_str("Rkey(..)"),
            RemoteKey::PerQp(k) => write!(f, "PerQp({} keys)", k.len()),
            RemoteKey::Token(_) => f.write_str("Token(..)"),
            RemoteKey::Each(k) => write!(f, "Each({} keys)", k.len()),
        }
    }
}

/// What a grant hands to a peer: where and with which key it may access the granted range.
/// Dropping it revokes the access (deregisters the MR / invalidates the window).
pub struct Exposure {
    pub addr: u64,
    pub key: RemoteKey,
    /// Fabric state that must live as long as the grant (a dedicated MR, a bound window).
    pub keepalive: Option<Box<dyn Keepalive>>,
}

/// Anything a fabric keeps alive for a grant; never looked into again, only dropped.
pub trait Keepalive: Send + Sync {}
impl<T: Send + Sync> Keepalive for T {}

impl fmt::Debug for Exposure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Neither the remote address nor the key is printed (SECURITY.md).
        f.debug_struct("Exposure").field("key", &self.key).finish_non_exhaustive()
    }
}

/// Everything a fabric needs to expose a range to a peer.
#[derive(Clone)]
pub struct ExposeRequest {
    /// Offset of the range inside the registration.
    pub offset: u64,
    pub len: u64,
    pub op: RemoteOp,
    pub expires_at: SystemTime,
    /// Node name of the peer the grant is for.
    pub peer: String,
    /// The grantee's connection (`GrantRequest.connection_id`), which the caller has checked is
    /// one this agent accepted from that peer: `mw` binds its windows on that connection's QPs
    /// (the fabric finds them by id). Other modes and tcp ignore it.
    pub connection: Option<xfer_engine::ids::ConnectionId>,
}

impl fmt::Debug for ExposeRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExposeRequest")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("op", &self.op)
            .field("expires_at", &self.expires_at)
            .field("peer", &self.peer)
            .field("connection", &self.connection.is_some())
            .finish()
    }
}

/// Device facts reported by `GetInfo` and `xferctl info`.
#[derive(Debug, Clone, Default)]
pub struct DeviceInfo {
    pub name: String,
    pub port: u32,
    pub state: String,
    pub link_layer: String,
    pub active_mtu: u32,
    pub lid: u32,
    pub gids: Vec<GidInfo>,
    pub selected_gid_index: Option<u32>,
    /// The NUMA node of the device's PCI function; `None` for software devices (rxe) and hosts
    /// without NUMA.
    pub numa_node: Option<u32>,
    /// `dddd:bb:dd.f`; `None` without a PCI parent.
    pub pci_address: Option<String>,
    /// The port's signalling rate; `None` when sysfs does not say.
    pub speed_mbps: Option<u64>,
    /// The netdev of the selected GID (else the port's first); `None` on InfiniBand.
    pub netdev: Option<String>,
    /// The prefix length of the selected GID's IPv4 address on its interface (the subnet peers
    /// are matched by); `None` without an IPv4 GID.
    pub ipv4_prefix: Option<u8>,
}

/// One device of a fabric over several, as [`Fabric::device_states`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceState {
    pub name: String,
    /// Its port is ACTIVE and no event said it went down since.
    pub up: bool,
    /// Left out of new connections by [`Fabric::hold_back`].
    pub held_back: bool,
}

impl DeviceState {
    /// New connections use it.
    pub fn offered(&self) -> bool {
        self.up && !self.held_back
    }
}

#[derive(Debug, Clone, Default)]
pub struct GidInfo {
    pub index: u32,
    pub raw: [u8; 16],
    pub gid_type: String,
    pub netdev: String,
}

#[derive(Debug, Clone)]
pub struct FabricInfo {
    pub kind: FabricKind,
    pub devices: Vec<DeviceInfo>,
    /// tcp: the data listener peers connect to
    pub data_address: Option<SocketAddr>,
}

/// One RC QP's parameters (verbs) or a data listener (tcp), exchanged by `Peer.Connect`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Verbs(VerbsEndpoint),
    /// The responder's data listener and the secret that binds data streams to this connection.
    Tcp {
        address: SocketAddr,
        secret: Option<DataSecret>,
    },
}

/// The per-connection secret of a tcp data connection (handed out by an authenticated
/// `Peer.Connect`, presented on every data stream). Never printed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DataSecret(pub [u8; 32]);

impl fmt::Debug for DataSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DataSecret(..)")
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VerbsEndpoint {
    pub qpn: u32,
    /// 24-bit initial packet sequence number, from a CSPRNG
    pub psn: u32,
    pub gid: [u8; 16],
    pub gid_index: u32,
    pub lid: u32,
    pub port: u32,
    /// active MTU in bytes
    pub mtu: u32,
    pub max_rd_atomic: u32,
    pub gid_type: String,
    pub link_layer: String,
    /// The initiator's index of this QP's local device within the connection (a connection over
    /// several devices offers one group of QPs per device); the responder answers each group it
    /// matched with the same number. 0 on a single-device connection.
    pub rail: u32,
    /// The sender's device name (for logs, paths and the responder's refusal); empty if unknown.
    pub device: String,
    /// Prefix length of the GID's IPv4 address on its netdev (RoCE), so the other side can tell
    /// which of its devices share the subnet; 0 if unknown.
    pub ipv4_prefix: u32,
}

/// The operation of a work request, from the initiator's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrOp {
    /// local → remote
    Write,
    /// remote → local
    Read,
    /// A zero-length notification marker for the grant's slot `slot` (`len` is 0): verbs posts
    /// an RDMA WRITE WITH IMMEDIATE (`imm = slot`) under the grant's key, tcp a NOTIFY frame
    /// under its token. It executes at the target after every earlier WR of its QP, and the
    /// target's [`MarkerSink`] counts it.
    Notify { slot: u32 },
}

/// Where a responder's fabric reports the notification markers that arrive on a connection it
/// accepted (the grant table counts them and publishes the notification).
pub trait MarkerSink: Send + Sync + 'static {
    /// A marker naming `slot` arrived on a QP of `connection`, after every earlier WR there.
    fn marker(&self, connection: &xfer_engine::ids::ConnectionId, slot: u32);
}

/// A one-sided work request. `wr_id` comes back in its [`Completion`].
#[derive(Clone)]
pub struct WorkRequest {
    pub wr_id: u64,
    pub op: WrOp,
    /// Local memory; held until the WR's completion or flush is delivered.
    pub local: Arc<dyn Registration>,
    /// Offset inside `local`.
    pub local_offset: u64,
    pub len: u32,
    pub remote_addr: u64,
    pub remote_key: RemoteKey,
    pub signaled: bool,
}

impl fmt::Debug for WorkRequest {
    // Remote addresses are not logged (SECURITY.md); the key's own Debug hides it anyway.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkRequest")
            .field("wr_id", &self.wr_id)
            .field("op", &self.op)
            .field("local_offset", &self.local_offset)
            .field("len", &self.len)
            .field("signaled", &self.signaled)
            .finish_non_exhaustive()
    }
}

/// The result of a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    pub qp: usize,
    pub status: WcStatus,
    pub byte_len: u32,
}

/// Where a connection delivers its completions.
pub type CompletionSink = mpsc::UnboundedSender<Completion>;

/// The initiator's half of a connection between `prepare` and `Peer.Connect`'s answer.
#[async_trait]
pub trait PendingConnection: Send {
    /// Endpoints to send to the responder.
    fn local_endpoints(&self) -> Vec<Endpoint>;
    /// Finish with the responder's endpoints (verbs: RTR → RTS; tcp: open the data streams).
    async fn complete(self: Box<Self>, remote: &[Endpoint]) -> Result<Arc<dyn Connection>, FabricError>;
}

/// The responder's half of a connection: keeps its QPs (or data session) alive until dropped.
pub trait Accepted: Send + Sync + 'static {
    /// Hands every notification marker that has already arrived on this connection to the
    /// marker sink before returning. `Peer.Complete` calls it before it publishes a notification
    /// itself. The default does nothing: a fabric whose markers are handled in order before
    /// they are acknowledged (tcp) has none waiting.
    fn drain_markers(&self) {}
    /// Markers are due on this connection soon (a grant with a notification was just made on
    /// it, or a channel batch announced): watch for them closely until `waiting` turns false
    /// or `until`. A hint for latency only; markers are seen without it too. The default does
    /// nothing: tcp handles a marker as its frame is read.
    fn expect_markers(&self, until: std::time::Instant, waiting: Box<dyn Fn() -> bool + Send>) {
        let _ = (until, waiting);
    }
    /// Where this half stands, when it becomes usable only after `Peer.Connect` was answered
    /// (verbs: the responder answers with its QP numbers at once and moves its QPs to RTR and
    /// RTS while the answer travels). `None`: usable from the answer on (tcp). The agent waits
    /// for [`Readiness::Ready`] before it answers a grant on the connection, and the initiator
    /// moves no byte without a grant, so no packet reaches a QP that is not yet in RTR.
    fn readiness(&self) -> Option<tokio::sync::watch::Receiver<Readiness>> {
        None
    }
}

/// See [`Accepted::readiness`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// The answer went out; the QPs are being moved to RTS.
    Pending,
    /// Usable.
    Ready,
    /// The QPs could not be moved to RTS (the device's reason): the connection is dead.
    Failed(String),
}

/// One path of a connection: a local device, the peer's device it reaches, and the QPs between
/// them. A path fails as a whole (a link or port goes down, a device dies) while the others go on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathInfo {
    /// The local device's name; empty for a fabric without devices (tcp).
    pub local_device: String,
    /// The peer's device on the other end, as the peer named it; empty for tcp.
    pub remote_device: String,
    /// The connection's QPs on this path (QP indices are the connection's, in `0..qps()`).
    pub qps: std::ops::Range<usize>,
    /// A fallback path (the tcp rail of a verbs connection): never given a weight, used only
    /// when no other path is up.
    pub standby: bool,
    /// The path MTU its QPs negotiated (the smaller of both ports' active MTU), in bytes; 0 where
    /// there is none (tcp).
    pub mtu: u32,
}

/// An established connection: `qps()` ordered, reliable queues to one peer.
pub trait Connection: Send + Sync {
    fn qps(&self) -> usize;
    /// The connection's paths, in QP order: together their `qps` ranges cover `0..qps()` without
    /// overlap. The default is one path over every QP (a single-device or tcp connection).
    fn paths(&self) -> Vec<PathInfo> {
        vec![PathInfo { local_device: String::new(), remote_device: String::new(), qps: 0..self.qps(), standby: false, mtu: 0 }]
    }
    /// True when the pool should replace this connection once it is idle: it is broken, or a path
    /// it lacks (a device that was down when it was made) is usable again. Default: broken.
    fn wants_reconnect(&self) -> bool {
        self.is_broken()
    }
    /// Posts a work request on QP `qp`. Non-blocking: the caller bounds the number of
    /// outstanding WRs per QP (`depth`), and the fabric sizes its queues from the same setting.
    fn post(&self, qp: usize, wr: WorkRequest) -> Result<(), FabricError>;
    /// Posts `wrs`, in order, on QP `qp`, with one doorbell where the fabric has one (verbs:
    /// one `ibv_wr_start`/`ibv_wr_complete` around all of them, so the device is kicked once).
    /// `Err((wr_id, e))` names the first WR that was not posted; it and every WR after it count
    /// as not posted (a fabric that cannot tell keeps their memory until the QP is gone).
    fn post_batch(&self, qp: usize, wrs: Vec<WorkRequest>) -> Result<(), (u64, FabricError)> {
        for wr in wrs {
            let id = wr.wr_id;
            self.post(qp, wr).map_err(|e| (id, e))?;
        }
        Ok(())
    }
    /// Polls for completions now, on the caller's thread, delivering them to the connection's
    /// sink like the fabric's own completion task would; returns how many. A connection is
    /// leased by one transfer at a time, so its driver may poll it directly instead of waiting
    /// to be woken (verbs: `ibv_poll_cq`; tcp has nothing to poll: 0).
    fn progress(&self) -> usize {
        0
    }
    /// Hands this connection's completion polling to a data-path worker thread
    /// (`transfer::worker`), or (`None`) gives it back to the fabric's completion task. While
    /// handed off, only the worker polls ([`Connection::progress`]); the fabric's task stands
    /// down and, once [`Connection::arm_wake`] armed it, unparks `to` when a completion is due.
    /// Returns false, changing nothing, when the fabric has no such mode (tcp: completions come
    /// from its stream reader tasks), so the caller drives the connection from its own task.
    fn hand_off(&self, to: Option<std::thread::Thread>) -> bool {
        let _ = to;
        false
    }
    /// While handed off: arms the completion notification, so the next completion unparks the
    /// worker. The worker polls once more after arming (a completion that arrived before the
    /// arm raised nothing) and then parks. False if arming failed (the worker keeps polling).
    fn arm_wake(&self) -> bool {
        false
    }
    /// True once any QP hit an error: the pool replaces the connection.
    fn is_broken(&self) -> bool;
    /// Tears the connection down; outstanding WRs complete with flush errors.
    fn close(&self);
}

/// The data plane. See the module docs for the semantics every implementation keeps.
#[async_trait]
pub trait Fabric: Send + Sync + 'static {
    fn kind(&self) -> FabricKind;

    /// Whether a grant works only on the grantee's connection, so asking one needs it: tcp
    /// tokens (checked per data stream) and verbs memory windows (bound on its QPs).
    fn grants_need_connection(&self) -> bool;
    fn info(&self) -> FabricInfo;

    /// Whether this process polls the fabric's completions itself (a device's completion queue:
    /// verbs), so that spinning before a sleep (`verbs.poll_spin`), a data-path worker thread and
    /// splitting long READs (`verbs.max_read_wr`) apply to it. False for a fabric whose
    /// completions come from its own readers (tcp) and whose frames need no split.
    fn polled(&self) -> bool {
        false
    }

    /// The device this fabric drives, by name (verbs); `None` for a fabric without one (tcp).
    /// Cheap, unlike [`Fabric::info`], which queries the device.
    fn device_name(&self) -> Option<&str> {
        None
    }

    /// The devices of a fabric over several (verbs `RailsFabric`), in order, and whether new
    /// connections use them; empty for a fabric that has one device or none.
    fn device_states(&self) -> Vec<DeviceState> {
        Vec::new()
    }

    /// Changes whenever a device of a fabric over several goes down, comes back or is held back
    /// (then read [`Fabric::device_states`]); `None` for other fabrics.
    fn device_changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }

    /// Leaves `device` out of new connections (`held`) or offers it again, whatever its port
    /// says: the agent holds back a device whose paths keep failing. False if the fabric has no
    /// device of that name (or only one device, which is never left out).
    fn hold_back(&self, device: &str, held: bool) -> bool {
        let _ = (device, held);
        false
    }

    /// Registers region memory. `access` is the region's ceiling for remote peers; local
    /// read access is implied, local write access whenever the memory is writable.
    fn register(&self, memory: Arc<RegionMemory>, access: Access) -> Result<Arc<dyn Registration>, FabricError>;

    /// Exposes a range of a registration to one peer for one operation. Never blocks the
    /// calling runtime thread: work that waits for a device (registering a grant MR pins pages;
    /// binding memory windows waits for their completions) runs on the blocking pool.
    async fn expose(&self, reg: &Arc<dyn Registration>, req: &ExposeRequest) -> Result<Exposure, FabricError>;

    /// The most QPs a connection prepared with `qps` holds ([`Connection::qps`] once made): `qps`
    /// for a fabric with one path per connection; a fabric over several devices offers `qps` on
    /// each device it uses now (and on its tcp fallback rail). What a connection is charged
    /// before it exists; the charge is settled to its real count once it does.
    fn connection_qps(&self, qps: usize) -> usize {
        qps
    }

    /// Initiator: creates `qps` local QPs (or prepares data streams) for a peer. `depth` is the
    /// most WRs the caller keeps outstanding per QP.
    /// `peer` is the address the peer's gRPC service was reached at; `connection_id` names the
    /// connection in `Peer.Connect`, `Grant` and `Disconnect`.
    async fn prepare(
        &self,
        peer: &str,
        connection_id: &xfer_engine::ids::ConnectionId,
        qps: usize,
        depth: usize,
        sink: CompletionSink,
    ) -> Result<Box<dyn PendingConnection>, FabricError>;

    /// Responder: validates the initiator's endpoints, brings up its side and returns its
    /// endpoints plus a handle that keeps them alive until the peer disconnects. `peer` is the
    /// caller's authenticated identity and `connection_id` the initiator's name for the connection.
    async fn accept(
        &self,
        peer: &str,
        connection_id: &xfer_engine::ids::ConnectionId,
        remote: &[Endpoint],
    ) -> Result<(Vec<Endpoint>, Box<dyn Accepted>), FabricError>;
}
