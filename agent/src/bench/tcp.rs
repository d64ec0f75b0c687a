//! The raw TCP baseline (`Agent.TcpBaseline`: what `--baseline tcp` compares against) and its
//! one-shot sink on the peer (`Peer.OpenSink`), which reads and discards. With `tls`, the streams
//! are TLS with the agents' data-plane rustls configurations (the same library, provider, cipher
//! suites and certificates as the tcp fabric's mTLS data streams): what `--baseline tls`
//! compares the fabric's TLS streams against. With a `pool`, both ends walk buffers of that many
//! bytes instead of one small buffer each: raw TCP with the memory footprint of a KV pool (bytes
//! leave from and land in lines no cache holds, as the fabric's do), beside the hot baseline;
//! with `scatter` too, in pieces at random places of them ([`super::walk`]).
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use memmap2::MmapMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

use crate::error::NodeError;
use crate::node::Node;
use crate::peer_api::{PeerError, Walk};
use xfer_fabric::identity::tls::DataTls;

/// Each sink connection's read buffer.
const SINK_BUFFER: usize = 256 << 10;
/// A sink waits this long for each baseline connection.
const SINK_ACCEPT_WITHIN: Duration = Duration::from_secs(10);
/// A sink closes after this, whatever its state.
const SINK_LIFETIME: Duration = Duration::from_secs(120);
/// The longest a sink can take bytes: the baseline's senders give up after this.
const SINK_SPAN: Duration = SINK_ACCEPT_WITHIN.saturating_add(SINK_LIFETIME);
/// Largest TCP baseline send buffer.
const BASELINE_MAX_BLOCK: u64 = 16 << 20;

/// `Peer.OpenSink`: a one-shot listener that reads and discards, for the raw TCP baseline.
/// Bounded like the admin calls that use it: one sink at a time per agent, its buffers
/// counted against `limits.max_bench_bytes`, [`SINK_ACCEPT_WITHIN`] to connect and
/// [`SINK_LIFETIME`] in all.
///
/// With `tls` (the agent's data-plane configurations), the sink takes TLS streams. With a
/// `pool`, each stream reads into its share of `pool` bytes, walked in order.
pub async fn open_sink(
    node: &Node,
    local_ip: std::net::IpAddr,
    connections: u32,
    tls: Option<DataTls>,
    walk: Walk,
) -> Result<SocketAddr, NodeError> {
    let n = connections.clamp(1, 64);
    super::walk::check(walk, n, tls.is_some())?;
    let pool = walk.pool;
    let acceptor = tls.map(|t| tokio_rustls::TlsAcceptor::from(t.server));
    let slot = node.sink_slot()?;
    let share = sink_share(pool, n)?;
    let reservation = node.reserve_bench(n as u64 * share as u64, "TCP baseline sink buffers")?;
    // Every buffer is mapped and touched before the sender is told where to connect (its clock
    // runs from then): on the blocking pool, as a pool can be a gigabyte.
    let buffers = tokio::task::spawn_blocking(move || (0..n).map(|_| memory(share, 1)).collect::<std::io::Result<Vec<_>>>())
        .await
        .map_err(|e| NodeError::Internal(e.to_string()))?
        .map_err(|e| NodeError::Internal(format!("sink buffers: {e}")))?;
    let listener = TcpListener::bind(SocketAddr::new(local_ip, 0)).await.map_err(|e| NodeError::Internal(format!("opening sink: {e}")))?;
    let addr = listener.local_addr().map_err(|e| NodeError::Internal(format!("opening sink: {e}")))?;
    tokio::spawn(async move {
        let held = (slot, reservation);
        match run_sink(listener, acceptor, buffers, walk.scatter as usize, SINK_ACCEPT_WITHIN, SINK_LIFETIME).await {
            Err(SinkEnd::Lifetime) => warn!("tcp baseline sink reached its lifetime; closed"),
            Err(SinkEnd::Io(e)) => debug!(error = %e, "tcp baseline sink closed"),
            Ok(done) => {
                // The senders finish when their streams close: the slot is given back first,
                // so a baseline run right behind this one finds it free.
                drop(held);
                for mut s in done {
                    let _ = s.shutdown().await;
                }
            }
        }
    });
    Ok(addr)
}

/// Raw TCP throughput to the peer's host: what `--baseline tcp` compares against. Admin-only;
/// one at a time; one shared send buffer of at most [`BASELINE_MAX_BLOCK`], counted against
/// `limits.max_bench_bytes`.
///
/// With `tls` (the agent's data-plane configurations), the streams are TLS. With a `pool`, the
/// senders write from `pool` bytes (each stream from its own share, in order) and the sink reads
/// into as many: see the module docs.
pub async fn tcp_baseline(
    node: &Node,
    peer_addr: &str,
    bytes: u64,
    connections: u32,
    block: u64,
    tls: Option<DataTls>,
    walk: Walk,
) -> Result<(u64, f64), NodeError> {
    super::walk::check(walk, connections.clamp(1, 64), tls.is_some())?;
    let _admin = node.admin_slot("TcpBaseline")?;
    let tls = match tls {
        Some(data) => {
            let name = data.server_name_for(peer_addr).map_err(NodeError::Invalid)?;
            Some((tokio_rustls::TlsConnector::from(data.client), name))
        }
        None => None,
    };
    let block = block.clamp(4096, BASELINE_MAX_BLOCK) as usize;
    let n = connections.clamp(1, 64);
    let pool = usize::try_from(walk.pool).map_err(|_| NodeError::Invalid("pool too large".into()))?;
    // Each stream walks its own share of the pool (at least one block); without a pool all
    // share one block.
    let share = if pool == 0 { block } else { (pool / n as usize).max(block) };
    let total = if pool == 0 { block } else { share * n as usize };
    let _memory = node.reserve_bench(total as u64, "the TCP baseline buffer")?;
    let peer = node.peer_entry(peer_addr).await?;
    let sink = peer.call(|| peer.client.open_sink(n, tls.is_some(), walk)).await?;
    let per = bytes.div_ceil(n as u64);
    // Filled (so every page is touched before the clock starts), on the blocking pool: a pool
    // can be a gigabyte.
    let buf: Arc<MmapMut> = tokio::task::spawn_blocking(move || memory(total, 0xa5))
        .await
        .map_err(|e| NodeError::Internal(e.to_string()))?
        .map(Arc::new)
        .map_err(|e| NodeError::Internal(format!("baseline buffer: {e}")))?;
    let t0 = Instant::now();
    // The senders are aborted if this call is dropped (its caller went away) or when the
    // sink's lifetime has passed: a sink that stops reading holds neither them nor the
    // admin slot for ever.
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n as usize {
        let sink = sink.clone();
        let buf = buf.clone();
        let tls = tls.clone();
        // Stream i's share: the whole block without a pool, else its slice of the pool.
        let (from, len) = if pool == 0 { (0, block) } else { (i * share, share) };
        tasks.spawn(async move {
            let s = TcpStream::connect(&sink).await?;
            s.set_nodelay(true)?;
            let mine = &buf[from..from + len];
            match tls {
                None if walk.scatter > 0 => super::walk::send(s, per, mine, walk.scatter as usize).await,
                None => send(s, per, mine, block).await,
                Some((connector, name)) => {
                    // The fabric's data streams' send buffer, so the baseline writes as they do.
                    let mut t = connector.connect(name, tls_socket(s)).await?;
                    t.get_mut().1.set_buffer_limit(Some(xfer_fabric::identity::tls::SEND_BUFFER));
                    send(t, per, mine, block).await
                }
            }
        });
    }
    let unreachable = |detail: String| NodeError::Peer(PeerError::Unreachable { addr: sink.clone(), detail });
    let collect = async {
        let mut total = 0;
        while let Some(t) = tasks.join_next().await {
            total += t.map_err(|e| NodeError::Internal(e.to_string()))?.map_err(|e| unreachable(e.to_string()))?;
        }
        Ok::<u64, NodeError>(total)
    };
    let total = tokio::time::timeout(SINK_SPAN, collect)
        .await
        .map_err(|_| unreachable(format!("the sink took no more bytes within {SINK_SPAN:?}")))??;
    Ok((total, t0.elapsed().as_secs_f64()))
}

/// Streams `per` bytes of `buf` on `s` in writes of up to `block` bytes, walking `buf` in order
/// and wrapping, then waits for the sink to close: all bytes were read on the far side.
async fn send<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, per: u64, buf: &[u8], block: usize) -> std::io::Result<u64> {
    let mut left = per;
    let mut at = 0usize;
    while left > 0 {
        let k = (left as usize).min(block).min(buf.len() - at);
        s.write_all(&buf[at..at + k]).await?;
        left -= k as u64;
        at = if at + k == buf.len() { 0 } else { at + k };
    }
    s.shutdown().await?;
    let mut one = [0u8; 1];
    let _ = s.read(&mut one).await;
    Ok(per)
}

/// `len` bytes of `fill` in anonymous memory that asks for transparent huge pages, as an
/// anonymous region does (`RegionMemory::anonymous`): a walk over a pool pays the TLB misses a
/// region's blocks pay, and no more (a heap buffer on 4 KiB pages cost a scattered 4 KiB walk
/// about a sixth of its time in a C loopback test on this kind of host).
fn memory(len: usize, fill: u8) -> std::io::Result<MmapMut> {
    let mut map = MmapMut::map_anon(len)?;
    // A hint: a host with huge pages off keeps 4 KiB pages.
    let _ = map.advise(memmap2::Advice::HugePage);
    map.fill(fill);
    Ok(map)
}

/// The socket under a baseline TLS stream, read through a buffer as the tcp fabric's TLS streams
/// are (rustls reads at most 4 KiB per call on its own): the baseline gets the same help.
fn tls_socket(s: TcpStream) -> tokio::io::BufReader<TcpStream> {
    tokio::io::BufReader::with_capacity(64 << 10, s)
}

/// A sink's stream read to its end, still open (closing it tells the sender all was read).
type Drained = Box<dyn AsyncWrite + Send + Unpin>;

/// Bytes each of a sink's `n` streams reads into: [`SINK_BUFFER`], or its share of `pool`.
fn sink_share(pool: u64, n: u32) -> Result<usize, NodeError> {
    let share = usize::try_from(pool / n as u64).map_err(|_| NodeError::Invalid("pool too large".into()))?;
    Ok(share.max(SINK_BUFFER))
}

/// Reads `s` to its end into `buf`, [`SINK_BUFFER`] at a time, walking it in order and
/// wrapping; the bytes are dropped.
async fn drain<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(mut s: S, mut buf: MmapMut) -> Option<Drained> {
    let share = buf.len().max(1);
    let mut at = 0usize;
    loop {
        let end = (at + SINK_BUFFER).min(share);
        match s.read(&mut buf[at..end]).await {
            Ok(k) if k > 0 => at = if at + k == share { 0 } else { at + k },
            _ => break,
        }
    }
    Some(Box::new(s))
}

/// Why a TCP baseline sink ended early.
#[derive(Debug)]
enum SinkEnd {
    Lifetime,
    Io(std::io::Error),
}

/// A sink's work: accepts one connection per buffer of `buffers` (each read into its own), each within `accept_within`, and reads each to its
/// end, discarding the bytes; all within `lifetime`. Returns the streams, still open. The reading tasks live in a `JoinSet`, so
/// when the lifetime ends (or the sink fails) every connection still open is closed with them:
/// a peer that keeps trickling bytes cannot keep a sink's tasks and buffers past its lifetime
/// and the slot it gave back.
async fn run_sink(
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    buffers: Vec<MmapMut>,
    scatter: usize,
    accept_within: Duration,
    lifetime: Duration,
) -> Result<Vec<Drained>, SinkEnd> {
    let mut readers = tokio::task::JoinSet::new();
    let work = async {
        for buf in buffers {
            let (s, _) = tokio::time::timeout(accept_within, listener.accept())
                .await
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no baseline connection in time"))??;
            let tls = tls.clone();
            readers.spawn(async move {
                match tls {
                    None if scatter > 0 => super::walk::drain(s, buf, scatter).await.map(|(s, _)| Box::new(s) as Drained),
                    None => drain(s, buf).await,
                    Some(acceptor) => match acceptor.accept(tls_socket(s)).await {
                        Ok(mut s) => {
                            s.get_mut().1.set_buffer_limit(Some(xfer_fabric::identity::tls::SEND_BUFFER));
                            drain(s, buf).await
                        }
                        Err(e) => {
                            debug!(error = %e, "tls baseline sink: handshake failed");
                            None
                        }
                    },
                }
            });
        }
        drop(listener);
        let mut done = Vec::new();
        while let Some(r) = readers.join_next().await {
            done.extend(r.ok().flatten());
        }
        Ok::<_, std::io::Error>(done)
    };
    match tokio::time::timeout(lifetime, work).await {
        Err(_) => Err(SinkEnd::Lifetime),
        Ok(r) => r.map_err(SinkEnd::Io),
    }
    // `readers` drops here: whatever still runs is aborted.
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that connects to a sink and keeps its connection open past the sink's lifetime:
    /// the sink closes it then (the peer reads the end of the stream) and ends with
    /// `Lifetime`. Its reading tasks used to be detached, so they outlived the lifetime and the
    /// slot and buffers it gave back. Virtual time: the lifetime passes without waiting.
    #[tokio::test(start_paused = true)]
    async fn a_sink_closes_connections_still_open_at_its_lifetime() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let lifetime = Duration::from_secs(120);
        let sink =
            tokio::spawn(run_sink(listener, None, vec![memory(SINK_BUFFER, 0).expect("memory")], 0, Duration::from_secs(10), lifetime));
        let mut peer = TcpStream::connect(addr).await.expect("connect");
        peer.write_all(&[0x5a; 4096]).await.expect("the sink reads");
        let start = tokio::time::Instant::now();
        let mut one = [0u8; 1];
        let closed = tokio::time::timeout(lifetime * 10, peer.read(&mut one)).await;
        assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "the connection outlived the sink: {closed:?}");
        assert!(start.elapsed() >= lifetime - Duration::from_secs(1), "closed before its lifetime: {:?}", start.elapsed());
        let ended = sink.await.expect("the sink task");
        assert!(matches!(ended, Err(SinkEnd::Lifetime)), "{:?}", ended.map(|s| s.len()));
    }
}
