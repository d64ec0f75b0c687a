//! # xfer-client
//!
//! A typed async client for the xfer agent (`xfer.v1.Agent`): create regions and fill or read
//! their bytes, move data between agents (single ranges, batches of segments, channels that
//! hold one grant for many batches), wait for transfers, and wait for the notifications peers'
//! batches raise on this node. Errors are one enum ([`Error`]) to match on, never a gRPC status.
//!
//! Shared-memory regions ([`Client::create_shm_region`]) are created by the agent and mapped
//! into the caller's process, so an application fills or reads their bytes with no copy
//! through gRPC; the mapping hands out bounds-checked copies ([`ShmRegion::write_at`],
//! [`ShmRegion::read_at`]), never a `&mut [u8]` over memory the NIC and the agent also touch.
//!
//! ```
//! use xfer_client::{ChannelSpec, Client, Segment, TransferSpec};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # // Two real agents on loopback stand in for two nodes (see `testing`).
//! # let (node_a, node_b) = (xfer_client::testing::LocalAgent::start("prefill").await?, xfer_client::testing::LocalAgent::start("decode").await?);
//! # let (a_addr, b_addr) = (node_a.unix.clone(), node_b.addr.clone());
//! # let pool_name = format!("kv-doc-{}", std::process::id());
//! // On the producer's node (here over the agent's local socket): a shared-memory pool,
//! // filled in place, with no copy through gRPC.
//! let prefill = Client::connect(&a_addr).await?;
//! let pool = prefill.create_shm_region(&pool_name, 1 << 20).await?;
//! pool.write_at(0, &[7u8; 4096])?;
//!
//! // On the consumer's node: a pool, and a subscription to request 42's notification.
//! let decode = Client::connect(&b_addr).await?;
//! decode.create_region("kv", 1 << 20).await?;
//! let mut inbound = decode.watch_inbound(Some("kv"), Some(b"req-42")).await?;
//!
//! // One batch, one notification: block 0 of the pool to block 9 of the peer's.
//! let spec = TransferSpec::write(&pool_name, &b_addr, "kv")
//!     .segments(vec![Segment { local: 0, remote: 9 * 4096, len: 4096 }])
//!     .notify(b"req-42");
//! let t = prefill.transfer(spec).await?;
//! assert_eq!(t.bytes_done, 4096);
//! let note = inbound.next().await?; // every byte of the batch is in place now
//! assert_eq!(note.tag, b"req-42");
//! assert_eq!(decode.get("kv", 9 * 4096, 4096).await?, vec![7u8; 4096]);
//!
//! // Many batches: a channel holds one connection and one grant; a list prepared once is
//! // posted again at no per-segment cost.
//! let mut ch = prefill.open_channel(ChannelSpec::write(&pool_name, &b_addr, "kv")).await?;
//! ch.prepare(1, &[Segment { local: 0, remote: 0, len: 4096 }]).await?;
//! for i in 0..3u8 {
//!     pool.write_at(0, &[i; 4096])?;
//!     ch.post_list(1, Some(format!("req-{i}").as_bytes())).await?;
//!     assert_eq!(decode.get("kv", 0, 4096).await?, vec![i; 4096]);
//! }
//! ch.close().await?;
//! # prefill.delete_region(&pool_name).await?;
//! # Ok(()) }
//! ```
//!
//! The example runs in `cargo test --doc` against two real agents ([`testing::LocalAgent`]).
//!
//! Connections: `host:port` in plaintext ([`Client::connect`]) or TLS with a client certificate
//! ([`Client::connect_tls`]); agents with mTLS take the caller's role from that certificate.
//! `unix:///run/xfer/agent.sock` connects to the agent's local unix socket (`unix_listen`),
//! where the caller is known by its uid and has the client role.
#![forbid(unsafe_code)]

mod channel;
mod error;
mod shm;
pub mod testing;

use std::time::Duration;

use futures::StreamExt;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;

pub use channel::{BatchDone, Channel, ChannelSpec, Prepared};
pub use error::{Error, Result};
pub use shm::ShmRegion;
/// The generated protobuf types, for what this crate does not wrap.
pub use xfer_proto::v1 as proto;

/// How long to wait for the TCP (and HTTP/2) connection to an agent.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes per `WriteRegion` message.
const PUT_PIECE: usize = 1 << 20;
/// Largest message the client accepts (a `ReadRegion` piece, a transfer list).
const MAX_MESSAGE: usize = 64 << 20;

/// TLS to the agent: the CA that signed its certificate and, for mTLS, this client's
/// certificate and key (PEM).
#[derive(Clone, Debug, Default)]
pub struct Tls {
    pub ca_pem: Vec<u8>,
    pub cert_pem: Option<Vec<u8>>,
    pub key_pem: Option<Vec<u8>>,
    /// The name the agent's certificate is checked against (default: the host of the address).
    pub server_name: Option<String>,
}

impl Tls {
    /// Reads the CA and, if given, the client certificate and key from PEM files.
    pub fn from_files(ca: &std::path::Path, cert_key: Option<(&std::path::Path, &std::path::Path)>) -> Result<Tls> {
        let read = |p: &std::path::Path| std::fs::read(p).map_err(|e| Error::io(p.display(), e));
        let (cert_pem, key_pem) = match cert_key {
            Some((c, k)) => (Some(read(c)?), Some(read(k)?)),
            None => (None, None),
        };
        Ok(Tls { ca_pem: read(ca)?, cert_pem, key_pem, server_name: None })
    }
}

/// A connection to one agent. Cheap to clone (one HTTP/2 connection shared).
#[derive(Clone, Debug)]
pub struct Client {
    agent: AgentClient<tonic::transport::Channel>,
    addr: String,
}

/// What a region is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegionKind {
    Anonymous,
    File,
    Shm,
}

/// A region as the agent describes it.
#[derive(Clone, Debug)]
pub struct Region {
    pub id: String,
    pub name: String,
    pub length: u64,
    pub kind: RegionKind,
    /// File path (file regions) or shared-memory object name (shm regions).
    pub path: String,
    /// Set when the agent could not restore the region (it retries).
    pub unavailable: Option<String>,
}

impl Region {
    fn from_pb(r: pb::Region) -> Region {
        let kind = match pb::RegionKind::try_from(r.kind) {
            Ok(pb::RegionKind::File) => RegionKind::File,
            Ok(pb::RegionKind::Shm) => RegionKind::Shm,
            _ => RegionKind::Anonymous,
        };
        Region {
            id: r.id,
            name: r.name,
            length: r.length,
            kind,
            path: r.path,
            unavailable: (!r.unavailable_reason.is_empty()).then_some(r.unavailable_reason),
        }
    }
}

/// One piece of a batch: `len` bytes between `local` of the local region and `remote` of the
/// remote region (absolute offsets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub local: u64,
    pub remote: u64,
    pub len: u64,
}

impl Segment {
    fn to_pb(self) -> pb::Segment {
        pb::Segment { local_offset: self.local, remote_offset: self.remote, length: self.len }
    }
}

/// WRITE (local bytes into the peer's region) or READ (the peer's bytes into the local region).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Write,
    Read,
}

impl Op {
    fn to_pb(self) -> i32 {
        match self {
            Op::Write => pb::Op::Write as i32,
            Op::Read => pb::Op::Read as i32,
        }
    }
}

/// Shape of the data path; `None` = the agent's default.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub chunk_size: Option<u64>,
    pub qps: Option<u32>,
    pub depth: Option<u32>,
    pub timeout: Option<Duration>,
    /// Compare checksums of source and destination (single ranges only).
    pub verify: bool,
}

impl Options {
    fn to_pb(&self) -> pb::TransferOptions {
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

/// A transfer to submit: built with [`TransferSpec::write`] or [`TransferSpec::read`] and the
/// chained setters.
#[derive(Clone, Debug)]
pub struct TransferSpec {
    pub op: Op,
    pub local_region: String,
    pub local_offset: u64,
    /// The peer agent's gRPC address (`host:port`).
    pub peer: String,
    pub remote_region: String,
    pub remote_offset: u64,
    /// 0 = the rest of the source range (single ranges).
    pub length: u64,
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

    fn new(op: Op, local: &str, peer: &str, remote: &str) -> TransferSpec {
        TransferSpec {
            op,
            local_region: local.into(),
            local_offset: 0,
            peer: peer.into(),
            remote_region: remote.into(),
            remote_offset: 0,
            length: 0,
            segments: Vec::new(),
            notify: None,
            options: Options::default(),
        }
    }

    /// One range: `length` bytes from `local_offset` to `remote_offset`.
    pub fn range(mut self, local_offset: u64, remote_offset: u64, length: u64) -> TransferSpec {
        (self.local_offset, self.remote_offset, self.length) = (local_offset, remote_offset, length);
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

    fn to_pb(&self) -> pb::SubmitTransferRequest {
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

/// A transfer's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Queued,
    Connecting,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl State {
    fn from_pb(v: i32) -> State {
        match pb::TransferState::try_from(v) {
            Ok(pb::TransferState::Connecting) => State::Connecting,
            Ok(pb::TransferState::Running) => State::Running,
            Ok(pb::TransferState::Succeeded) => State::Succeeded,
            Ok(pb::TransferState::Failed) => State::Failed,
            Ok(pb::TransferState::Cancelled) => State::Cancelled,
            _ => State::Queued,
        }
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, State::Succeeded | State::Failed | State::Cancelled)
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            State::Queued => "queued",
            State::Connecting => "connecting",
            State::Running => "running",
            State::Succeeded => "succeeded",
            State::Failed => "failed",
            State::Cancelled => "cancelled",
        })
    }
}

/// A transfer record.
#[derive(Clone, Debug)]
pub struct Transfer {
    pub id: String,
    pub state: State,
    pub length: u64,
    pub bytes_done: u64,
    /// Segments after coalescing (1 for a single range).
    pub segments: u64,
    /// `Transfer.error_code` and the reason, when FAILED or CANCELLED.
    pub error: Option<(String, String)>,
    pub elapsed: Duration,
    pub peer: String,
}

impl Transfer {
    fn from_pb(t: pb::Transfer) -> Transfer {
        Transfer {
            state: State::from_pb(t.state),
            error: (!t.error.is_empty() || !t.error_code.is_empty()).then(|| (t.error_code.clone(), t.error.clone())),
            elapsed: Duration::try_from_secs_f64(t.elapsed_seconds).unwrap_or_default(),
            id: t.id,
            length: t.length,
            bytes_done: t.bytes_done,
            segments: t.segments,
            peer: t.peer,
        }
    }

    /// `Ok` when it succeeded; the failure as an [`Error::Transfer`] otherwise.
    fn into_result(self) -> Result<Transfer> {
        match self.state {
            State::Failed | State::Cancelled => {
                let (code, message) = self.error.clone().unwrap_or_default();
                Err(Error::Transfer { id: self.id, state: self.state, code, message })
            }
            _ => Ok(self),
        }
    }
}

/// A notification a peer's batch raised on this agent.
#[derive(Clone, Debug)]
pub struct Notification {
    pub region: String,
    /// The moving agent's authenticated identity.
    pub peer: String,
    pub tag: Vec<u8>,
    pub op: Op,
    /// The granted range the batch lay in.
    pub offset: u64,
    pub length: u64,
    /// `fabric` (markers behind the data) or `complete` (the initiator's `Peer.Complete`).
    pub via: String,
}

/// A live subscription to this agent's notifications ([`Client::watch_inbound`]).
pub struct Inbound {
    stream: tonic::Streaming<pb::Notification>,
}

impl Inbound {
    /// The next notification. [`Error::DataLoss`] if this subscriber fell too far behind (then
    /// subscribe again); [`Error::Unavailable`] if the stream ended.
    pub async fn next(&mut self) -> Result<Notification> {
        let n = self.stream.message().await?.ok_or_else(|| Error::Unavailable("the notification stream ended".into()))?;
        Ok(Notification {
            region: n.region,
            peer: n.peer,
            tag: n.tag,
            op: if n.op == pb::Op::Read as i32 { Op::Read } else { Op::Write },
            offset: n.offset,
            length: n.length,
            via: n.via,
        })
    }
}

impl Client {
    /// Connects in plaintext to the agent at `addr` (`host:port`, or `unix:///path` for the
    /// agent's local socket).
    pub async fn connect(addr: &str) -> Result<Client> {
        Client::connect_with(addr, None).await
    }

    /// Connects over TLS (mTLS when `tls` carries a client certificate).
    pub async fn connect_tls(addr: &str, tls: Tls) -> Result<Client> {
        Client::connect_with(addr, Some(tls)).await
    }

    async fn connect_with(addr: &str, tls: Option<Tls>) -> Result<Client> {
        let bad = |detail: String| Error::Connect { addr: addr.to_string(), detail };
        if let Some(path) = addr.strip_prefix("unix://").or_else(|| addr.strip_prefix("unix:")) {
            if tls.is_some() {
                return Err(bad("the unix socket has no TLS: the agent knows its callers by uid".into()));
            }
            let path = std::path::PathBuf::from(path);
            // The URI is a placeholder: the connector below ignores it.
            let channel = Endpoint::from_static("http://localhost")
                .connect_timeout(CONNECT_TIMEOUT)
                .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                    let path = path.clone();
                    async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
                }))
                .await
                .map_err(|e| bad(root_cause(&e)))?;
            let agent = AgentClient::new(channel).max_decoding_message_size(MAX_MESSAGE).max_encoding_message_size(MAX_MESSAGE);
            return Ok(Client { agent, addr: addr.to_string() });
        }
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}")).map_err(|e| bad(format!("invalid address: {e}")))?;
        if let Some(t) = tls {
            let host = t.server_name.clone().unwrap_or_else(|| host_of(addr).to_string());
            let mut cfg = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&t.ca_pem)).domain_name(host);
            if let (Some(c), Some(k)) = (&t.cert_pem, &t.key_pem) {
                cfg = cfg.identity(Identity::from_pem(c, k));
            }
            endpoint = endpoint.tls_config(cfg).map_err(|e| bad(format!("TLS settings: {e}")))?;
        }
        let channel = endpoint
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .connect()
            .await
            .map_err(|e| bad(root_cause(&e)))?;
        let agent = AgentClient::new(channel).max_decoding_message_size(MAX_MESSAGE).max_encoding_message_size(MAX_MESSAGE);
        Ok(Client { agent, addr: addr.to_string() })
    }

    /// The address this client was connected to.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The generated `xfer.v1.Agent` client on the same connection, for what this crate does not
    /// wrap (its errors are then `tonic::Status`; `Error::from` maps them).
    pub fn raw(&self) -> AgentClient<tonic::transport::Channel> {
        self.agent.clone()
    }

    /// The agent's node name, fabric and limits (`GetInfo`).
    pub async fn info(&self) -> Result<pb::AgentInfo> {
        Ok(self.agent.clone().get_info(pb::GetInfoRequest {}).await?.into_inner())
    }

    // ------------------------------------------------------------------ regions

    /// An anonymous (agent-private) region of `length` bytes, readable and writable by peers.
    pub async fn create_region(&self, name: &str, length: u64) -> Result<Region> {
        self.create(pb::CreateRegionRequest { name: name.into(), length, access: pb::Access::ReadWrite as i32, ..Default::default() }).await
    }

    /// Creates a region from a full request (file or shm kind, access, lease, labels).
    pub async fn create(&self, req: pb::CreateRegionRequest) -> Result<Region> {
        Ok(Region::from_pb(self.agent.clone().create_region(req).await?.into_inner()))
    }

    pub async fn region(&self, name: &str) -> Result<Region> {
        Ok(Region::from_pb(self.agent.clone().get_region(pb::GetRegionRequest { name: name.into() }).await?.into_inner()))
    }

    pub async fn regions(&self) -> Result<Vec<Region>> {
        let r = self.agent.clone().list_regions(pb::ListRegionsRequest::default()).await?.into_inner();
        Ok(r.regions.into_iter().map(Region::from_pb).collect())
    }

    pub async fn delete_region(&self, name: &str) -> Result<()> {
        self.agent.clone().delete_region(pb::DeleteRegionRequest { name: name.into() }).await?;
        Ok(())
    }

    /// Writes `data` at `offset` of `region` through the agent (streamed in 1 MiB messages).
    /// For big or frequent fills, a shared-memory region avoids the copy.
    pub async fn put(&self, region: &str, offset: u64, data: &[u8]) -> Result<u64> {
        let mut msgs = Vec::with_capacity(data.len().div_ceil(PUT_PIECE).max(1));
        let mut pieces = data.chunks(PUT_PIECE).peekable();
        if pieces.peek().is_none() {
            return Err(Error::InvalidArgument("nothing to write".into()));
        }
        for (i, piece) in pieces.enumerate() {
            let first = i == 0;
            msgs.push(pb::WriteRegionRequest {
                region: if first { region.to_string() } else { String::new() },
                offset: if first { offset } else { 0 },
                data: piece.to_vec(),
            });
        }
        let r = self.agent.clone().write_region(futures::stream::iter(msgs)).await?.into_inner();
        Ok(r.bytes_written)
    }

    /// Reads `len` bytes at `offset` of `region` through the agent.
    pub async fn get(&self, region: &str, offset: u64, len: u64) -> Result<Vec<u8>> {
        let req = pb::ReadRegionRequest { region: region.into(), offset, length: len };
        let mut s = self.agent.clone().read_region(req).await?.into_inner();
        let mut out = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
        while let Some(piece) = s.message().await? {
            out.extend_from_slice(&piece.data);
        }
        if out.len() as u64 != len {
            return Err(Error::Protocol(format!("asked {len} bytes, got {}", out.len())));
        }
        Ok(out)
    }

    // ------------------------------------------------------------------ transfers

    /// Submits a transfer (a range or a batch). Bad input is refused here, before any byte moves.
    pub async fn submit(&self, spec: TransferSpec) -> Result<Transfer> {
        Ok(Transfer::from_pb(self.agent.clone().submit_transfer(spec.to_pb()).await?.into_inner()))
    }

    /// Waits until transfer `id` ends: `Ok` when it succeeded, [`Error::Transfer`] otherwise.
    pub async fn wait(&self, id: &str) -> Result<Transfer> {
        let mut s = self.agent.clone().watch_transfer(pb::WatchTransferRequest { id: id.into() }).await?.into_inner();
        let mut last = None;
        while let Some(t) = s.next().await {
            let t = Transfer::from_pb(t?);
            if t.state.is_terminal() {
                return t.into_result();
            }
            last = Some(t);
        }
        match last {
            Some(t) => Err(Error::Unavailable(format!("the watch of transfer {} ended while it was {}", t.id, t.state))),
            None => Err(Error::Unavailable(format!("the watch of transfer {id} ended"))),
        }
    }

    /// Submits and waits.
    pub async fn transfer(&self, spec: TransferSpec) -> Result<Transfer> {
        let t = self.submit(spec).await?;
        self.wait(&t.id).await
    }

    pub async fn get_transfer(&self, id: &str) -> Result<Transfer> {
        Ok(Transfer::from_pb(self.agent.clone().get_transfer(pb::GetTransferRequest { id: id.into() }).await?.into_inner()))
    }

    /// Cancels a running transfer (a no-op for a finished one); its record as it is now.
    pub async fn cancel(&self, id: &str) -> Result<Transfer> {
        Ok(Transfer::from_pb(self.agent.clone().cancel_transfer(pb::CancelTransferRequest { id: id.into() }).await?.into_inner()))
    }

    // ------------------------------------------------------------------ notifications

    /// Subscribes to the notifications peers' batches raise on this agent, for one region (name
    /// or id) or all, and one tag or all. Subscribed when this returns: batches that land from
    /// now on are seen.
    pub async fn watch_inbound(&self, region: Option<&str>, tag: Option<&[u8]>) -> Result<Inbound> {
        let req = pb::WatchInboundRequest { region: region.unwrap_or_default().into(), tag: tag.map(<[u8]>::to_vec) };
        Ok(Inbound { stream: self.agent.clone().watch_inbound(req).await?.into_inner() })
    }

    // ------------------------------------------------------------------ channels

    /// Opens a channel: one connection to the peer and one grant over its range, held until
    /// [`Channel::close`]; batches posted on it need no further round trip to set up.
    pub async fn open_channel(&self, spec: ChannelSpec) -> Result<Channel> {
        Channel::open(self.agent.clone(), spec).await
    }

    // ------------------------------------------------------------------ shared memory

    /// Has the agent create a shared-memory region of `length` bytes and maps it into this
    /// process (the caller must be allowed to open the agent's object: same uid, or the
    /// agent's `regions.shm_gid` group with `regions.shm_mode` 0660).
    pub async fn create_shm_region(&self, name: &str, length: u64) -> Result<ShmRegion> {
        let r = self
            .create(pb::CreateRegionRequest {
                name: name.into(),
                length,
                kind: pb::RegionKind::Shm as i32,
                access: pb::Access::ReadWrite as i32,
                ..Default::default()
            })
            .await?;
        ShmRegion::map(r)
    }

    /// Maps an existing shared-memory region of this agent into this process.
    pub async fn map_shm_region(&self, name: &str) -> Result<ShmRegion> {
        ShmRegion::map(self.region(name).await?)
    }
}

pub(crate) fn duration_to_pb(d: Duration) -> prost_types::Duration {
    prost_types::Duration { seconds: d.as_secs().min(i64::MAX as u64) as i64, nanos: d.subsec_nanos() as i32 }
}

/// The host of `host:port` or `[v6]:port`, without brackets.
fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    addr.rsplit_once(':').map_or(addr, |(h, _)| h)
}

fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}
