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
mod convert;
mod error;
mod model;
mod ring;
mod shm;
pub mod testing;

use std::time::Duration;

use futures::StreamExt;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
use xfer_proto::v1 as pb;
use xfer_proto::v1::agent_client::AgentClient;

pub use channel::{BatchDone, Channel, ChannelSpec, Prepared};
pub(crate) use convert::duration_to_pb;
pub use error::{Error, Result};
pub use model::*;
pub use ring::InboundRing;
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

/// A live subscription to this agent's notifications ([`Client::watch_inbound`]).
pub struct Inbound {
    stream: tonic::Streaming<pb::Notification>,
}

impl Inbound {
    /// The next notification. [`Error::DataLoss`] if this subscriber fell too far behind (then
    /// subscribe again); [`Error::Unavailable`] if the stream ended.
    pub async fn next(&mut self) -> Result<Notification> {
        self.try_next().await?.ok_or_else(|| Error::Unavailable("the notification stream ended".into()))
    }

    /// The next notification, or `None` when the agent ended the stream (it shuts down).
    pub async fn try_next(&mut self) -> Result<Option<Notification>> {
        Ok(self.stream.message().await?.map(Notification::from_pb))
    }
}

/// A transfer's states as they change ([`Client::watch`]): the current record first, then one
/// per change, ending with the terminal one.
pub struct TransferWatch {
    stream: tonic::Streaming<pb::Transfer>,
}

impl TransferWatch {
    /// The next record, or `None` once the agent ended the stream (after a terminal state, or
    /// early when it shuts down).
    pub async fn next(&mut self) -> Result<Option<Transfer>> {
        Ok(self.stream.message().await?.map(Transfer::from_pb))
    }
}

/// A region's bytes as the agent streams them ([`Client::read`]), checked to be contiguous and
/// complete.
pub struct RegionReader {
    stream: tonic::Streaming<pb::ReadRegionResponse>,
    offset: u64,
    len: u64,
    done: u64,
}

impl RegionReader {
    /// The next piece, or `None` after the last. [`Error::Protocol`] if the agent sends a
    /// piece out of place, more than asked for, or ends short.
    pub async fn next(&mut self) -> Result<Option<Vec<u8>>> {
        match self.stream.message().await? {
            Some(msg) => {
                // The offset is absolute in the region; tolerate agents that send it relative to
                // the start of the read.
                let expected = self.offset + self.done;
                if msg.offset != expected && msg.offset != self.done {
                    return Err(Error::Protocol(format!("the agent sent data for offset {} where {expected} was expected", msg.offset)));
                }
                self.done += msg.data.len() as u64;
                if self.done > self.len {
                    return Err(Error::Protocol(format!("the agent sent {} bytes, more than the {} asked for", self.done, self.len)));
                }
                Ok(Some(msg.data))
            }
            None if self.done != self.len => {
                Err(Error::Protocol(format!("short read: the agent sent {} of {} bytes", self.done, self.len)))
            }
            None => Ok(None),
        }
    }

    /// Bytes received so far.
    pub fn done(&self) -> u64 {
        self.done
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
        let channel = endpoint.connect_timeout(CONNECT_TIMEOUT).tcp_nodelay(true).connect().await.map_err(|e| bad(root_cause(&e)))?;
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

    /// The agent's node name, fabric, devices and limits (`GetInfo`).
    pub async fn info(&self) -> Result<AgentInfo> {
        Ok(AgentInfo::from_pb(self.agent.clone().get_info(pb::GetInfoRequest {}).await?.into_inner()))
    }

    // ------------------------------------------------------------------ regions

    /// An anonymous (agent-private) region of `length` bytes, readable and writable by peers.
    pub async fn create_region(&self, name: &str, length: u64) -> Result<Region> {
        self.create(RegionSpec::anonymous(name, length)).await
    }

    /// Creates a region of any kind ([`RegionSpec`]: file or shm, access, lease, labels).
    pub async fn create(&self, spec: RegionSpec) -> Result<Region> {
        Ok(Region::from_pb(self.agent.clone().create_region(spec.to_pb()).await?.into_inner()))
    }

    /// One region, by name or id.
    pub async fn region(&self, name: &str) -> Result<Region> {
        Ok(Region::from_pb(self.agent.clone().get_region(pb::GetRegionRequest { name: name.into() }).await?.into_inner()))
    }

    /// Every region of this agent.
    pub async fn regions(&self) -> Result<Vec<Region>> {
        self.regions_matching(&std::collections::BTreeMap::new()).await
    }

    /// The regions carrying every one of these labels.
    pub async fn regions_matching(&self, labels: &std::collections::BTreeMap<String, String>) -> Result<Vec<Region>> {
        let req = pb::ListRegionsRequest { label_selector: labels.clone().into_iter().collect() };
        let r = self.agent.clone().list_regions(req).await?.into_inner();
        Ok(r.regions.into_iter().map(Region::from_pb).collect())
    }

    pub async fn delete_region(&self, name: &str) -> Result<()> {
        self.agent.clone().delete_region(pb::DeleteRegionRequest { name: name.into() }).await?;
        Ok(())
    }

    /// Writes `data` at `offset` of `region` through the agent (streamed in 1 MiB messages).
    /// For big or frequent fills, a shared-memory region avoids the copy.
    pub async fn put(&self, region: &str, offset: u64, data: &[u8]) -> Result<u64> {
        if data.is_empty() {
            return Err(Error::InvalidArgument("nothing to write".into()));
        }
        let pieces: Vec<Vec<u8>> = data.chunks(PUT_PIECE).map(<[u8]>::to_vec).collect();
        self.put_stream(region, offset, futures::stream::iter(pieces)).await
    }

    /// Writes everything `reader` yields at `offset` of `region`, streaming it in 1 MiB
    /// messages (a file, stdin, a socket). A read error ends the write with [`Error::Io`]
    /// naming how many bytes had been sent; the agent keeps what it wrote.
    pub async fn put_reader<R>(&self, region: &str, offset: u64, reader: R) -> Result<u64>
    where
        R: tokio::io::AsyncRead + Unpin + Send + 'static,
    {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::{Arc, Mutex};
        use tokio::io::AsyncReadExt;
        let failed: Arc<Mutex<Option<std::io::Error>>> = Arc::default();
        let sent = Arc::new(AtomicU64::new(0));
        let (slot, count) = (failed.clone(), sent.clone());
        let pieces = futures::stream::unfold(Some(reader), move |reader| {
            let (slot, count) = (slot.clone(), count.clone());
            async move {
                let mut reader = reader?;
                let mut data = vec![0u8; PUT_PIECE];
                let mut filled = 0;
                let mut at_end = false;
                while filled < PUT_PIECE {
                    match reader.read(&mut data[filled..]).await {
                        Ok(0) => {
                            at_end = true;
                            break;
                        }
                        Ok(n) => filled += n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            if let Ok(mut s) = slot.lock() {
                                *s = Some(e);
                            }
                            return None;
                        }
                    }
                }
                if filled == 0 {
                    return None;
                }
                data.truncate(filled);
                count.fetch_add(filled as u64, Ordering::Relaxed);
                Some((data, (!at_end).then_some(reader)))
            }
        });
        let result = self.put_stream(region, offset, pieces).await;
        let sent = sent.load(Ordering::Relaxed);
        if let Some(e) = failed.lock().ok().and_then(|mut s| s.take()) {
            return Err(Error::io(format!("reading the data failed after {sent} bytes were sent"), e));
        }
        let written = result?;
        if written != sent {
            return Err(Error::Protocol(format!("the agent wrote {written} bytes but {sent} were sent")));
        }
        Ok(written)
    }

    /// Writes the pieces `data` yields, one after the other, at `offset` of `region`.
    /// Nothing to write (no piece, or only empty ones) is an [`Error::InvalidArgument`].
    pub async fn put_stream<S>(&self, region: &str, offset: u64, data: S) -> Result<u64>
    where
        S: futures::Stream<Item = Vec<u8>> + Send + 'static,
    {
        let mut first = Some((region.to_string(), offset));
        let msgs = data.map(move |piece| {
            let (region, offset) = first.take().unwrap_or_default();
            pb::WriteRegionRequest { region, offset, data: piece }
        });
        Ok(self.agent.clone().write_region(msgs).await?.into_inner().bytes_written)
    }

    /// Reads `len` bytes at `offset` of `region` through the agent.
    pub async fn get(&self, region: &str, offset: u64, len: u64) -> Result<Vec<u8>> {
        let mut reader = self.read(region, offset, len).await?;
        let mut out = Vec::with_capacity(usize::try_from(len).unwrap_or(0).min(MAX_MESSAGE));
        while let Some(piece) = reader.next().await? {
            out.extend_from_slice(&piece);
        }
        Ok(out)
    }

    /// Streams `len` bytes at `offset` of `region` (for ranges too big to hold in memory).
    pub async fn read(&self, region: &str, offset: u64, len: u64) -> Result<RegionReader> {
        let req = pb::ReadRegionRequest { region: region.into(), offset, length: len };
        let stream = self.agent.clone().read_region(req).await?.into_inner();
        Ok(RegionReader { stream, offset, len, done: 0 })
    }

    /// The checksum of a range, computed by the agent.
    pub async fn checksum(&self, region: &str, offset: u64, len: u64, algo: ChecksumAlgo) -> Result<u64> {
        let algo = match algo {
            ChecksumAlgo::Xxh3 => pb::ChecksumAlgo::Xxh3,
            ChecksumAlgo::Crc32c => pb::ChecksumAlgo::Crc32c,
        } as i32;
        let req = pb::ChecksumRequest { region: region.into(), offset, length: len, algo };
        Ok(self.agent.clone().checksum(req).await?.into_inner().value)
    }

    // ------------------------------------------------------------------ transfers

    /// Submits a transfer (a range or a batch). Bad input is refused here, before any byte moves.
    pub async fn submit(&self, spec: TransferSpec) -> Result<Transfer> {
        Ok(Transfer::from_pb(self.agent.clone().submit_transfer(spec.to_pb()).await?.into_inner()))
    }

    /// Follows transfer `id`: its record now, then each change.
    pub async fn watch(&self, id: &str) -> Result<TransferWatch> {
        let stream = self.agent.clone().watch_transfer(pb::WatchTransferRequest { id: id.into() }).await?.into_inner();
        Ok(TransferWatch { stream })
    }

    /// Waits until transfer `id` ends: `Ok` when it succeeded, [`Error::Transfer`] otherwise.
    pub async fn wait(&self, id: &str) -> Result<Transfer> {
        let mut s = self.watch(id).await?;
        let mut last = None;
        while let Some(t) = s.next().await? {
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

    /// The transfers this agent remembers (running and recently finished, inbound ones too).
    pub async fn transfers(&self) -> Result<Vec<Transfer>> {
        let r = self.agent.clone().list_transfers(pb::ListTransfersRequest {}).await?.into_inner();
        Ok(r.transfers.into_iter().map(Transfer::from_pb).collect())
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

    /// The same notifications as [`Client::watch_inbound`], through a shared-memory ring the
    /// agent writes and this process maps (the caller must run on the agent's host and be
    /// allowed to open its shm objects: same uid, or `regions.shm_group`). `slots`: a power of
    /// two from 16 to 65,536; 0 = 1,024. Subscribed when this returns.
    pub async fn watch_inbound_ring(&self, region: Option<&str>, tag: Option<&[u8]>, slots: u32) -> Result<InboundRing> {
        let req = pb::WatchInboundRingRequest { region: region.unwrap_or_default().into(), tag: tag.map(<[u8]>::to_vec), slots };
        let mut stream = self.agent.clone().watch_inbound_ring(req).await?.into_inner();
        let first = stream.message().await?.ok_or_else(|| Error::Protocol("WatchInboundRing sent no ring".into()))?;
        // After the ring, the stream only ever ends: with a status when the agent ended it.
        let rest = stream.map(|m| m.map(drop).map_err(Error::from)).boxed();
        InboundRing::open(&first.object, first.length, rest)
    }

    // ------------------------------------------------------------------ channels

    /// Opens a channel: one connection to the peer and one grant over its range, held until
    /// [`Channel::close`]; batches posted on it need no further round trip to set up.
    pub async fn open_channel(&self, spec: ChannelSpec) -> Result<Channel> {
        Channel::open(self.agent.clone(), spec).await
    }

    // ------------------------------------------------------------------ peers and benchmarks

    /// Has this agent connect to the peer at `addr` ahead of any transfer (`qps` QPs; 0 = its
    /// default).
    pub async fn connect_peer(&self, addr: &str, qps: u32) -> Result<Peer> {
        Ok(Peer::from_pb(self.agent.clone().connect(pb::ConnectRequest { peer: addr.into(), qps }).await?.into_inner()))
    }

    /// The peers this agent holds connections to.
    pub async fn peers(&self) -> Result<Vec<Peer>> {
        let r = self.agent.clone().list_peers(pb::ListPeersRequest {}).await?.into_inner();
        Ok(r.peers.into_iter().map(Peer::from_pb).collect())
    }

    /// Runs a benchmark from this agent to a peer (admin-only: on an agent with mTLS the
    /// caller's certificate must carry the admin role).
    pub async fn bench(&self, spec: &BenchSpec) -> Result<BenchResult> {
        Ok(BenchResult::from_pb(self.agent.clone().bench(spec.to_pb()).await?.into_inner()))
    }

    /// Streams raw TCP from this agent's host to the peer's: the baseline for [`Client::bench`].
    pub async fn tcp_baseline(&self, spec: &TcpBaselineSpec) -> Result<TcpBaseline> {
        Ok(TcpBaseline::from_pb(self.agent.clone().tcp_baseline(spec.to_pb()).await?.into_inner()))
    }

    // ------------------------------------------------------------------ shared memory

    /// Has the agent create a shared-memory region of `length` bytes and maps it into this
    /// process (the caller must be allowed to open the agent's object: same uid, or the
    /// agent's `regions.shm_gid` group with `regions.shm_mode` 0660).
    pub async fn create_shm_region(&self, name: &str, length: u64) -> Result<ShmRegion> {
        ShmRegion::map(self.create(RegionSpec::shm(name, length)).await?)
    }

    /// Maps an existing shared-memory region of this agent into this process.
    pub async fn map_shm_region(&self, name: &str) -> Result<ShmRegion> {
        ShmRegion::map(self.region(name).await?)
    }
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
