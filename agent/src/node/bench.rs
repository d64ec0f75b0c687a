//! Benchmarks (`Agent.Bench`: perftest-style WRITE/READ over a scratch region on the target),
//! the raw TCP baseline client and its one-shot sink (`Peer.OpenSink`), and bench scratch
//! regions (`Peer.OpenBenchRegion`/`CloseBenchRegion`).
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::initiator::Held;
use super::Node;
use crate::fabric::{Registration, RemoteOp, WorkRequest, WrOp};
use crate::ids::new_id;
use crate::peer_api::{GrantAsk, GrantInfo, PeerError};
use crate::peers::{Lease, PeerEntry};
use crate::transfer::batch::{Batch, Dest, Seg, SegmentSpec};
use crate::transfer::driver::LatencyProbe;
use crate::transfer::machine::{Machine, MachineConfig, Markers, State};
use crate::transfer::session::{Session, SessionConfig};
use crate::transfer::worker::{Job, MakeWr};
use crate::transfer::{Op, TransferError, TransferRequest, TransferState};
use xfer_rdma::memory::RegionMemory;

#[derive(Debug, Clone)]
pub struct BenchParams {
    pub peer: String,
    pub op: Op,
    pub size: u64,
    pub iters: u32,
    pub qps: usize,
    pub depth: usize,
    /// KV pattern: blocks of `size` per batch (0 = the perftest-style message benchmark).
    pub blocks: u32,
    /// KV pattern: pool bytes on each side (0 = 4 x blocks x size).
    pub pool: u64,
    /// KV pattern over a channel: the list prepared once and posted `iters` times.
    pub channel: bool,
    /// Connection setup: fresh connections to negotiate and hold (0 = another pattern).
    pub connections: u32,
    /// Connection setup: how long to keep them all once the last is up (at most
    /// [`BENCH_MAX_HOLD`]).
    pub hold: Duration,
    /// Connection setup: untimed wait before each connection after the first (at most
    /// [`BENCH_MAX_INTERVAL`]); zero = back to back.
    pub interval: Duration,
}

#[derive(Debug, Clone, Default)]
pub struct BenchResult {
    pub size: u64,
    pub iters: u32,
    pub bytes: u64,
    pub seconds: f64,
    pub lat_avg_us: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub lat_iters: u32,
    pub blocks: u32,
    pub submit_p50_us: f64,
    pub prep_ns_per_segment: f64,
    pub channel: bool,
    pub repost_ns_per_segment: f64,
    pub channel_open_us: f64,
    pub connections: u32,
    pub qps_held: u32,
    pub rss_bytes_per_qp: f64,
    /// Connection setup: p50 of a `Peer.Ping` round trip to the same peer, same run.
    pub rpc_p50_us: f64,
}

/// A KV run's result: `iters` batches of `blocks` blocks of `block` bytes that took `busy` in
/// all; `batch_us` per batch, `submit_us` per submit (or post to first work request), and the
/// list's cost per segment.
fn kv_result(
    block: u64,
    blocks: u64,
    iters: u32,
    busy: Duration,
    mut batch_us: Vec<f64>,
    mut submit_us: Vec<f64>,
    prep_ns: f64,
) -> BenchResult {
    let avg = batch_us.iter().sum::<f64>() / batch_us.len().max(1) as f64;
    batch_us.sort_by(|a, b| a.total_cmp(b));
    submit_us.sort_by(|a, b| a.total_cmp(b));
    BenchResult {
        size: block,
        iters,
        bytes: block * blocks * iters as u64,
        seconds: busy.as_secs_f64(),
        lat_avg_us: avg,
        lat_p50_us: percentile(&batch_us, 0.5),
        lat_p99_us: percentile(&batch_us, 0.99),
        lat_iters: batch_us.len() as u32,
        blocks: blocks as u32,
        submit_p50_us: percentile(&submit_us, 0.5),
        prep_ns_per_segment: prep_ns,
        ..Default::default()
    }
}

/// Longest the connection benchmark keeps its connections once they are all up.
pub const BENCH_MAX_HOLD: Duration = Duration::from_secs(60);

/// Longest pause the connection benchmark takes between two connections.
pub const BENCH_MAX_INTERVAL: Duration = Duration::from_secs(1);

/// Most connections the connection benchmark holds: what a peer keeps per identity.
const BENCH_MAX_CONNECTIONS: u32 = 256;

/// `Peer.Ping` round trips the connect benchmark times as its baseline.
const BENCH_PINGS: usize = 50;

/// This process's resident memory (VmRSS), in bytes.
fn rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = s.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted.get(((sorted.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0)
}

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
/// A benchmark's scratch region on the target is reaped after this at the latest.
const BENCH_REGION_TTL: Duration = Duration::from_secs(600);

impl Node {
    /// `Peer.OpenSink`: a one-shot listener that reads and discards, for the raw TCP baseline.
    /// Bounded like the admin calls that use it: one sink at a time per agent, its buffers
    /// counted against `limits.max_bench_bytes`, [`SINK_ACCEPT_WITHIN`] to connect and
    /// [`SINK_LIFETIME`] in all.
    pub async fn open_sink(&self, local_ip: std::net::IpAddr, connections: u32) -> Result<SocketAddr, TransferError> {
        let n = connections.clamp(1, 64);
        let slot = self
            .sink_slot
            .clone()
            .try_acquire_owned()
            .map_err(|_| TransferError::Limit("a TCP baseline sink is already open on this agent (one at a time)".into()))?;
        let reservation = self.regions.reserve_bench(n as u64 * SINK_BUFFER as u64, "TCP baseline sink buffers")?;
        let listener =
            TcpListener::bind(SocketAddr::new(local_ip, 0)).await.map_err(|e| TransferError::Internal(format!("opening sink: {e}")))?;
        let addr = listener.local_addr().map_err(|e| TransferError::Internal(format!("opening sink: {e}")))?;
        tokio::spawn(async move {
            let _held = (slot, reservation);
            match run_sink(listener, n, SINK_ACCEPT_WITHIN, SINK_LIFETIME).await {
                Err(SinkEnd::Lifetime) => warn!("tcp baseline sink reached its lifetime; closed"),
                Err(SinkEnd::Io(e)) => debug!(error = %e, "tcp baseline sink closed"),
                Ok(()) => {}
            }
        });
        Ok(addr)
    }

    /// `Peer.OpenBenchRegion`: the target side of a benchmark, a scratch region for `owner`. One
    /// at a time per agent; the region's bytes come from `limits.max_bench_bytes` (not from the
    /// clients' region limits) and its lease ends after [`BENCH_REGION_TTL`] even if the caller
    /// never closes it.
    pub fn open_bench_region(&self, owner: &str, length: u64) -> Result<String, TransferError> {
        crate::shape::bench_region(length)?;
        let mut slot = self.bench_region.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((name, _)) = slot.as_ref() {
            if self.regions.get(name).is_ok() {
                return Err(TransferError::Limit("a benchmark against this agent is already running (one at a time)".into()));
            }
        }
        let name = format!("xfer-bench-{}", new_id());
        let budget = self.regions.reserve_bench(length, "a benchmark scratch region")?;
        let mut labels: std::collections::BTreeMap<String, String> = [("xfer.io/scratch".to_string(), "bench".to_string())].into();
        // A NAME can be longer than a label value (or an address, in plaintext): shown only
        // when it is one.
        if crate::labels::check_value("xfer.io/owner", owner).is_ok() {
            labels.insert("xfer.io/owner".to_string(), owner.to_string());
        }
        let spec = crate::regions::RegionSpec {
            ttl: Some(BENCH_REGION_TTL),
            labels,
            ..crate::regions::RegionSpec::anonymous(&name, length, crate::fabric::Access::ReadWrite)
        };
        self.regions.create_scratch(spec, budget)?;
        *slot = Some((name.clone(), owner.to_string()));
        Ok(name)
    }

    /// `Peer.CloseBenchRegion`: deletes the caller's scratch region (no-op for anything else).
    pub fn close_bench_region(&self, owner: &str, name: &str) -> Result<(), TransferError> {
        let mut slot = self.bench_region.lock().unwrap_or_else(|e| e.into_inner());
        match slot.as_ref() {
            Some((n, o)) if n == name && o == owner => {
                let n = n.clone();
                *slot = None;
                drop(slot);
                match self.delete_region(&n) {
                    Ok(()) | Err(crate::regions::RegionError::NotFound(_)) => Ok(()),
                    Err(e) => Err(e.into()),
                }
            }
            _ => Err(crate::regions::RegionError::NotFound(name.to_string()).into()),
        }
    }

    // ------------------------------------------------------------------ benchmarks

    /// perftest-style data-path benchmark against `peer`. Admin-only; one at a time; its buffer
    /// counts against `limits.max_bench_bytes` here and the target's scratch region against the
    /// target's.
    pub async fn bench(self: &Arc<Self>, p: BenchParams) -> Result<BenchResult, TransferError> {
        if p.connections > 0 {
            return self.bench_connect(p).await;
        }
        if p.blocks > 0 {
            return self.bench_kv(p).await;
        }
        crate::shape::bench_size(p.size)?;
        let _admin = self.admin_slot("Bench")?;
        let _memory = self.regions.reserve_bench(p.size, "the benchmark buffer")?;
        let iters = if p.iters == 0 { 100 } else { p.iters.min(1_000_000) };
        let peer = self.peers.peer(&p.peer).await?;
        let scratch = peer.call(|| peer.client.open_bench_region(p.size)).await?;
        let res = self.bench_with(&peer, &scratch, &p, iters).await;
        if let Err(e) = peer.client.close_bench_region(&scratch).await {
            warn!(error = %e, region = %scratch, "could not delete bench scratch region on peer (its lease ends it)");
        }
        res
    }

    async fn bench_with(&self, peer: &Arc<PeerEntry>, scratch: &str, p: &BenchParams, iters: u32) -> Result<BenchResult, TransferError> {
        let remote_op = if p.op == Op::Write { RemoteOp::Write } else { RemoteOp::Read };
        let ask = GrantAsk {
            region: scratch,
            offset: 0,
            length: p.size,
            op: remote_op,
            ttl: Duration::from_secs(3600),
            notify: None,
            channel: false,
        };
        let len = usize::try_from(p.size).map_err(|_| TransferError::Invalid("size too large".into()))?;
        // Mapping and pinning the buffer (up to 256 MiB) on the blocking pool.
        let fabric = Arc::clone(&self.fabric);
        let local = tokio::task::spawn_blocking(move || {
            let mem = Arc::new(RegionMemory::anonymous(len, false).map_err(|e| TransferError::Internal(e.to_string()))?);
            fabric.register(mem, crate::fabric::Access::ReadWrite).map_err(|e| TransferError::Internal(e.to_string()))
        })
        .await
        .map_err(|e| TransferError::Internal(e.to_string()))??;
        let cancel = CancellationToken::new();
        let op = if p.op == Op::Write { WrOp::Write } else { WrOp::Read };
        let qps = crate::shape::or_default(p.qps, self.config.transfer.qps, crate::shape::qps)?;
        let depth = crate::shape::or_default(p.depth, self.config.transfer.depth, crate::shape::depth)?;

        // Bandwidth: iters messages of `size`, `depth` WRs outstanding per QP: one WR per message,
        // except that READs longer than `verbs.max_read_wr` are split as a transfer's are (each
        // message its own segment, cut into WRs of that length). Each phase has its own
        // connection, and so its own grant (mw grants are bound to a connection); both are RAII
        // guards in `held`, given back when it drops.
        let piece = self.wr_chunk(op == WrOp::Read, p.size);
        let segs: Arc<[Seg]> = if piece < p.size {
            (0..iters).map(|_| Seg { local: 0, remote: 0, len: p.size }).collect()
        } else {
            Arc::from([Seg { local: 0, remote: 0, len: p.size * iters as u64 }])
        };
        let mut held = self.bench_acquire(peer, &ask, qps, depth).await?;
        let (lease, grant) = held_parts(&mut held)?;
        let machine = Machine::new(MachineConfig {
            segs,
            markers: Markers::None,
            chunk: piece,
            qps: lease.qps(),
            depth,
            signal_every: self.config.transfer.signal_every,
            deadline: Some(Instant::now() + Duration::from_secs(600)),
        });
        let (buf, size) = (local.clone(), p.size);
        let make_wr: MakeWr = Box::new(move |q| bench_wr(q, op, &buf, size, &grant, q.signaled));
        let t0 = Instant::now();
        let done = self.run_job(Job { machine, lease, make_wr, probe: None, cancel: cancel.clone() }).await?;
        let seconds = t0.elapsed().as_secs_f64();
        let bw_state = done.machine.state().clone();
        done.lease.release(bw_state == State::Succeeded);
        drop(held);
        if let State::Failed(f) = bw_state {
            return Err(TransferError::Internal(format!("bench bandwidth phase failed: {f:?}")));
        }

        // Latency: one WR at a time on one QP.
        let lat_iters = iters.clamp(1, 10_000);
        let mut held = self.bench_acquire(peer, &ask, 1, 1).await?;
        let (lease, grant) = held_parts(&mut held)?;
        let machine = Machine::new(MachineConfig {
            segs: Arc::from([Seg { local: 0, remote: 0, len: p.size * lat_iters as u64 }]),
            markers: Markers::None,
            chunk: p.size,
            qps: 1,
            depth: 1,
            signal_every: 1,
            deadline: Some(Instant::now() + Duration::from_secs(600)),
        });
        let size = p.size;
        let make_wr: MakeWr = Box::new(move |q| bench_wr(q, op, &local, size, &grant, true));
        let probe = Some(LatencyProbe::default());
        let done = self.run_job(Job { machine, lease, make_wr, probe, cancel }).await?;
        let lat_ok = done.machine.state() == &State::Succeeded;
        done.lease.release(lat_ok);
        drop(held);
        if !lat_ok {
            return Err(TransferError::Internal(format!("bench latency phase failed: {:?}", done.machine.state())));
        }
        let samples = done.probe.map(|p| p.samples).unwrap_or_default();
        let mut us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
        us.sort_by(|a, b| a.total_cmp(b));
        let pct = |q: f64| percentile(&us, q);
        Ok(BenchResult {
            size: p.size,
            iters,
            bytes: p.size * iters as u64,
            seconds,
            lat_avg_us: us.iter().sum::<f64>() / us.len().max(1) as f64,
            lat_p50_us: pct(0.5),
            lat_p99_us: pct(0.99),
            lat_iters: us.len() as u32,
            ..Default::default()
        })
    }

    /// The KV-cache pattern through the product path: `iters` batches, each `blocks` blocks of
    /// `size` bytes at random distinct places of a local pool written (or read) to random
    /// distinct places of the peer's pool, each with a notification, one after the other
    /// (`SubmitTransfer` with segments, followed to SUCCEEDED). Both pools are scratch regions,
    /// deleted at the end.
    async fn bench_kv(self: &Arc<Self>, p: BenchParams) -> Result<BenchResult, TransferError> {
        let block = crate::shape::bench_size(p.size)?;
        let blocks = u64::from(p.blocks);
        let pool = crate::shape::bench_region(if p.pool == 0 { blocks.saturating_mul(block).saturating_mul(4) } else { p.pool })?;
        if pool / block < blocks {
            return Err(TransferError::Invalid(format!("a pool of {pool} bytes holds fewer than {blocks} blocks of {block}")));
        }
        if blocks as usize > self.config.transfer.max_segments {
            return Err(TransferError::Limit(format!(
                "{blocks} blocks; a batch takes at most {} (transfer.max_segments)",
                self.config.transfer.max_segments
            )));
        }
        let _admin = self.admin_slot("Bench")?;
        let iters = if p.iters == 0 { 5 } else { p.iters.min(10_000) };
        let peer = self.peers.peer(&p.peer).await?;
        let local = format!("xfer-bench-kv-{}", new_id());
        // Mapping and pinning a pool of gigabytes takes seconds: on the blocking pool, never on
        // a runtime thread (which would stall this agent's gRPC connections meanwhile).
        let (node, spec) = (
            Arc::clone(self),
            crate::regions::RegionSpec {
                ttl: Some(BENCH_REGION_TTL),
                labels: [("xfer.io/scratch".to_string(), "bench".to_string())].into(),
                ..crate::regions::RegionSpec::anonymous(&local, pool, crate::fabric::Access::ReadWrite)
            },
        );
        let budget = self.regions.reserve_bench(pool, "the benchmark's local pool")?;
        tokio::task::spawn_blocking(move || node.regions.create_scratch(spec, budget))
            .await
            .map_err(|e| TransferError::Internal(e.to_string()))??;
        let res = match peer.call(|| peer.client.open_bench_region(pool)).await {
            Ok(remote) => {
                let res = self.bench_kv_with(&p, &local, &remote, block, blocks, pool, iters).await;
                if let Err(e) = peer.client.close_bench_region(&remote).await {
                    warn!(error = %e, region = %remote, "could not delete bench scratch region on peer (its lease ends it)");
                }
                res
            }
            Err(e) => Err(e.into()),
        };
        let (node, name) = (Arc::clone(self), local.clone());
        let deleted = match tokio::task::spawn_blocking(move || node.delete_region(&name)).await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = deleted {
            warn!(error = %e, region = %local, "could not delete the local bench pool (its lease ends it)");
        }
        res
    }

    #[allow(clippy::too_many_arguments)]
    async fn bench_kv_with(
        self: &Arc<Self>,
        p: &BenchParams,
        local: &str,
        remote: &str,
        block: u64,
        blocks: u64,
        pool: u64,
        iters: u32,
    ) -> Result<BenchResult, TransferError> {
        // Distinct random slots on each side, in memory for `blocks` (at most
        // transfer.max_segments), never for the pool's slots (which the caller chooses).
        let slots = pool / block;
        let pick = |seed: u64| super::sample::distinct_slots(slots, blocks, seed);
        let (from, to) = (pick(0x9E37_79B9), pick(0x7F4A_7C15));
        let specs: Vec<SegmentSpec> =
            from.iter().zip(&to).map(|(&l, &r)| SegmentSpec { local: l * block, remote: r * block, len: block }).collect();
        if p.channel {
            return self.bench_kv_channel(p, local, remote, block, blocks, iters, specs).await;
        }
        // What checking and coalescing the list costs (the submit does it once more).
        let dest = if p.op == Op::Write { Dest::Remote } else { Dest::Local };
        let t = Instant::now();
        let prepared = Batch::new(&specs, local, pool, dest, self.config.transfer.max_segments)?;
        let prep_ns = t.elapsed().as_nanos() as f64 / blocks.max(1) as f64;
        drop(prepared);
        let (mut batch_us, mut submit_us) = (Vec::new(), Vec::new());
        let mut busy = Duration::ZERO;
        for i in 0..iters {
            let req = TransferRequest {
                op: p.op,
                local_region: local.to_string(),
                local_offset: 0,
                remote_agent: p.peer.clone(),
                remote_region: remote.to_string(),
                remote_offset: 0,
                length: 0,
                options: crate::transfer::TransferOptions {
                    qps: (p.qps > 0).then_some(p.qps),
                    depth: (p.depth > 0).then_some(p.depth),
                    ..Default::default()
                },
                segments: specs.clone(),
                notify: Some(format!("bench-kv-{i}").into_bytes()),
            };
            let t0 = Instant::now();
            let rec = self.submit(req).await?;
            submit_us.push(t0.elapsed().as_secs_f64() * 1e6);
            let h = self.transfers.get(&rec.id)?;
            let mut rx = h.record.subscribe();
            let end = loop {
                let r = rx.borrow_and_update().clone();
                if r.state.is_terminal() {
                    break r;
                }
                if rx.changed().await.is_err() {
                    break h.snapshot();
                }
            };
            let took = t0.elapsed();
            if end.state != TransferState::Succeeded {
                return Err(TransferError::Internal(format!("bench batch {i} ended {:?}: {}", end.state, end.error.unwrap_or_default())));
            }
            busy += took;
            batch_us.push(took.as_secs_f64() * 1e6);
        }
        Ok(kv_result(block, blocks, iters, busy, batch_us, submit_us, prep_ns))
    }

    /// Connection setup: negotiates `p.connections` fresh connections of `p.qps` QPs to the peer
    /// one after another (each `Peer.Connect` to RTS timed), holds them all, measures this
    /// process's resident memory growth per QP and times [`BENCH_PINGS`] `Peer.Ping` round trips
    /// to the same peer (the baseline), then discards them (the peer forgets them).
    async fn bench_connect(self: &Arc<Self>, p: BenchParams) -> Result<BenchResult, TransferError> {
        if p.connections > BENCH_MAX_CONNECTIONS {
            return Err(TransferError::Invalid(format!("at most {BENCH_MAX_CONNECTIONS} connections (what a peer keeps per identity)")));
        }
        if p.hold > BENCH_MAX_HOLD {
            return Err(TransferError::Invalid(format!("connections are held at most {BENCH_MAX_HOLD:?}")));
        }
        if p.interval > BENCH_MAX_INTERVAL {
            return Err(TransferError::Invalid(format!("the pause between connections is at most {BENCH_MAX_INTERVAL:?}")));
        }
        let _admin = self.admin_slot("Bench")?;
        let qps = crate::shape::or_default(p.qps, self.config.transfer.qps, crate::shape::qps)?;
        let depth = crate::shape::or_default(p.depth, self.config.transfer.depth, crate::shape::depth)?;
        let peer = self.peers.peer(&p.peer).await?;
        let before = rss_bytes();
        let mut held = Vec::with_capacity(p.connections as usize);
        let mut us = Vec::with_capacity(p.connections as usize);
        let t = Instant::now();
        for i in 0..p.connections {
            if i > 0 && !p.interval.is_zero() {
                // Pacing, not synchronisation: each negotiation starts on agents that finished
                // the previous one's background work (pool refill, the peer's RTS).
                tokio::time::sleep(p.interval).await;
            }
            let t0 = Instant::now();
            // Every lease is held, so each one is a fresh negotiation (the idle list is empty or
            // holds other shapes).
            let lease = self.peers.lease(&peer, qps, depth, &crate::tenants::Tenant::exempt()).await?;
            if !lease.reused() {
                us.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            held.push(lease);
        }
        let seconds = t.elapsed().as_secs_f64();
        let after = rss_bytes();
        let qps_held: usize = held.iter().map(|l| l.qps()).sum();
        // The baseline, same peer, same run: a gRPC round trip that does nothing. Peer.Connect's
        // handshake is one such call plus the responder's work.
        let mut rpc_us = Vec::with_capacity(BENCH_PINGS);
        for _ in 0..BENCH_PINGS {
            let t0 = Instant::now();
            peer.call(|| peer.client.ping()).await?;
            rpc_us.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        rpc_us.sort_by(|a, b| a.total_cmp(b));
        if !p.hold.is_zero() {
            tokio::time::sleep(p.hold).await;
        }
        for l in held {
            // Discarded, not pooled: the peer is told to forget each.
            l.release(false);
        }
        let per_qp = match (before, after) {
            (Some(b), Some(a)) if qps_held > 0 => a.saturating_sub(b) as f64 / qps_held as f64,
            _ => 0.0,
        };
        let avg = us.iter().sum::<f64>() / us.len().max(1) as f64;
        us.sort_by(|a, b| a.total_cmp(b));
        Ok(BenchResult {
            iters: p.connections,
            seconds,
            lat_avg_us: avg,
            lat_p50_us: percentile(&us, 0.5),
            lat_p99_us: percentile(&us, 0.99),
            lat_iters: us.len() as u32,
            connections: p.connections,
            qps_held: qps_held as u32,
            rss_bytes_per_qp: per_qp,
            rpc_p50_us: percentile(&rpc_us, 0.5),
            ..Default::default()
        })
    }

    /// The KV pattern over one channel: open it (timed), prepare the list once (timed), then post
    /// it `iters` times, each with a notification, one after the other.
    #[allow(clippy::too_many_arguments)]
    async fn bench_kv_channel(
        self: &Arc<Self>,
        p: &BenchParams,
        local: &str,
        remote: &str,
        block: u64,
        blocks: u64,
        iters: u32,
        specs: Vec<SegmentSpec>,
    ) -> Result<BenchResult, TransferError> {
        use super::channel::{ChannelInput, ChannelOutput, ChannelParams};
        let t = Instant::now();
        let ch = self
            .open_channel(ChannelParams {
                op: p.op,
                local_region: local.to_string(),
                remote_agent: p.peer.clone(),
                remote_region: remote.to_string(),
                remote_offset: 0,
                length: 0,
                options: crate::transfer::TransferOptions {
                    qps: (p.qps > 0).then_some(p.qps),
                    depth: (p.depth > 0).then_some(p.depth),
                    ..Default::default()
                },
                ttl: None,
                notify: true,
            })
            .await?;
        let open_us = t.elapsed().as_secs_f64() * 1e6;
        let (in_tx, in_rx) = tokio::sync::mpsc::channel(2);
        let (out_tx, mut out_rx) = tokio::sync::mpsc::channel(2);
        let cancel = CancellationToken::new();
        let _stop = cancel.clone().drop_guard();
        let task = tokio::spawn(ch.run(in_rx, out_tx, cancel));
        let lost = || TransferError::Internal("the bench channel ended early".into());
        let t = Instant::now();
        in_tx.send(ChannelInput::Prepare { list: 1, segments: specs }).await.map_err(|_| lost())?;
        match out_rx.recv().await {
            Some(ChannelOutput::Prepared { .. }) => {}
            Some(ChannelOutput::Done(d)) => return Err(TransferError::Invalid(d.error.map(|e| e.1).unwrap_or_default())),
            None => return Err(lost()),
        }
        let prep_ns = t.elapsed().as_nanos() as f64 / blocks.max(1) as f64;
        let (mut batch_us, mut first_us, mut repost_ns) = (Vec::new(), Vec::new(), Vec::new());
        let mut busy = Duration::ZERO;
        for i in 0..iters {
            let t0 = Instant::now();
            let post =
                ChannelInput::Post { seq: u64::from(i), segments: Vec::new(), list: 1, notify: Some(format!("bench-kv-{i}").into_bytes()) };
            in_tx.send(post).await.map_err(|_| lost())?;
            let d = match out_rx.recv().await {
                Some(ChannelOutput::Done(d)) => d,
                _ => return Err(lost()),
            };
            let took = t0.elapsed();
            if !d.ok {
                let (code, msg) = d.error.unwrap_or_default();
                return Err(TransferError::Internal(format!("bench batch {i} failed ({code}): {msg}")));
            }
            busy += took;
            batch_us.push(took.as_secs_f64() * 1e6);
            repost_ns.push(d.prep_ns_per_segment);
            first_us.push(d.prep_ns_per_segment * d.segments as f64 / 1e3);
        }
        drop(in_tx);
        let _ = task.await;
        repost_ns.sort_by(|a, b| a.total_cmp(b));
        Ok(BenchResult {
            channel: true,
            repost_ns_per_segment: percentile(&repost_ns, 0.5),
            channel_open_us: open_us,
            ..kv_result(block, blocks, iters, busy, batch_us, first_us, prep_ns)
        })
    }

    /// A connection and a grant on the scratch region, through the transfer session's acquire
    /// phase (the same stale-connection handling as a transfer).
    async fn bench_acquire(&self, peer: &Arc<PeerEntry>, ask: &GrantAsk<'_>, qps: usize, depth: usize) -> Result<Held, TransferError> {
        let mut s = Session::new(SessionConfig {
            length: ask.length,
            batch: None,
            markers: Markers::None,
            local_name: "bench buffer".into(),
            local_length: ask.length,
            local_offset: 0,
            chunk: ask.length,
            depth,
            signal_every: self.config.transfer.signal_every,
            verify: false,
            timeout: Duration::from_secs(600),
        });
        let mut held = Held::new(peer.clone(), crate::tenants::Tenant::exempt(), self.pending_revokes.clone());
        self.acquire(&mut s, &mut held, ask, qps, depth).await?;
        Ok(held)
    }

    /// Raw TCP throughput to the peer's host: what `--baseline tcp` compares against. Admin-only;
    /// one at a time; one shared send buffer of at most [`BASELINE_MAX_BLOCK`], counted against
    /// `limits.max_bench_bytes`.
    pub async fn tcp_baseline(&self, peer_addr: &str, bytes: u64, connections: u32, block: u64) -> Result<(u64, f64), TransferError> {
        let _admin = self.admin_slot("TcpBaseline")?;
        let block = block.clamp(4096, BASELINE_MAX_BLOCK) as usize;
        let _memory = self.regions.reserve_bench(block as u64, "the TCP baseline buffer")?;
        let peer = self.peers.peer(peer_addr).await?;
        let n = connections.clamp(1, 64);
        let sink = peer.call(|| peer.client.open_sink(n)).await?;
        let per = bytes.div_ceil(n as u64);
        let buf: Arc<[u8]> = vec![0xa5u8; block].into();
        let t0 = Instant::now();
        // The senders are aborted if this call is dropped (its caller went away) or when the
        // sink's lifetime has passed: a sink that stops reading holds neither them nor the
        // admin slot for ever.
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..n {
            let sink = sink.clone();
            let buf = buf.clone();
            tasks.spawn(async move {
                let mut s = TcpStream::connect(&sink).await?;
                s.set_nodelay(true)?;
                let mut left = per;
                while left > 0 {
                    let k = (left as usize).min(buf.len());
                    s.write_all(&buf[..k]).await?;
                    left -= k as u64;
                }
                s.shutdown().await?;
                // Wait for the sink to close: all bytes were read on the far side.
                let mut one = [0u8; 1];
                let _ = s.read(&mut one).await;
                Ok::<u64, std::io::Error>(per)
            });
        }
        let unreachable = |detail: String| TransferError::Peer(PeerError::Unreachable { addr: sink.clone(), detail });
        let collect = async {
            let mut total = 0;
            while let Some(t) = tasks.join_next().await {
                total += t.map_err(|e| TransferError::Internal(e.to_string()))?.map_err(|e| unreachable(e.to_string()))?;
            }
            Ok::<u64, TransferError>(total)
        };
        let total = tokio::time::timeout(SINK_SPAN, collect)
            .await
            .map_err(|_| unreachable(format!("the sink took no more bytes within {SINK_SPAN:?}")))??;
        Ok((total, t0.elapsed().as_secs_f64()))
    }
}

/// The WR for `q` of a benchmark whose messages are `size` bytes: every message reuses the
/// same buffer on both sides, so offsets are taken within a message.
fn bench_wr(
    q: &crate::transfer::machine::Post,
    op: WrOp,
    local: &Arc<dyn Registration>,
    size: u64,
    grant: &GrantInfo,
    signaled: bool,
) -> WorkRequest {
    WorkRequest {
        wr_id: q.seq,
        op,
        local: local.clone(),
        local_offset: q.local % size,
        len: q.len,
        remote_addr: grant.addr + q.remote % size,
        remote_key: grant.key.clone(),
        signaled,
    }
}

/// Why a TCP baseline sink ended early.
#[derive(Debug)]
enum SinkEnd {
    Lifetime,
    Io(std::io::Error),
}

/// A sink's work: accepts `n` connections, each within `accept_within`, and reads each to its
/// end, discarding the bytes; all within `lifetime`. The reading tasks live in a `JoinSet`, so
/// when the lifetime ends (or the sink fails) every connection still open is closed with them:
/// a peer that keeps trickling bytes cannot keep a sink's tasks and buffers past its lifetime
/// and the slot it gave back.
async fn run_sink(listener: TcpListener, n: u32, accept_within: Duration, lifetime: Duration) -> Result<(), SinkEnd> {
    let mut readers = tokio::task::JoinSet::new();
    let work = async {
        for _ in 0..n {
            let (mut s, _) = tokio::time::timeout(accept_within, listener.accept())
                .await
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no baseline connection in time"))??;
            readers.spawn(async move {
                let mut buf = vec![0u8; SINK_BUFFER];
                while s.read(&mut buf).await.map(|k| k > 0).unwrap_or(false) {}
                let _ = s.shutdown().await;
            });
        }
        drop(listener);
        while readers.join_next().await.is_some() {}
        Ok::<(), std::io::Error>(())
    };
    match tokio::time::timeout(lifetime, work).await {
        Err(_) => Err(SinkEnd::Lifetime),
        Ok(r) => r.map_err(SinkEnd::Io),
    }
    // `readers` drops here: whatever still runs is aborted.
}

/// The lease (taken: the caller gives it back) and a copy of the grant an accepted acquire
/// holds.
fn held_parts(held: &mut Held) -> Result<(Lease, GrantInfo), TransferError> {
    let grant = held.grant.as_ref().map(|g| g.info.clone());
    match (held.lease.take(), grant) {
        (Some(l), Some(g)) => Ok((l, g)),
        _ => Err(TransferError::Internal("accepted without a connection and a grant".into())),
    }
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
        let sink = tokio::spawn(run_sink(listener, 1, Duration::from_secs(10), lifetime));
        let mut peer = TcpStream::connect(addr).await.expect("connect");
        peer.write_all(&[0x5a; 4096]).await.expect("the sink reads");
        let start = tokio::time::Instant::now();
        let mut one = [0u8; 1];
        let closed = tokio::time::timeout(lifetime * 10, peer.read(&mut one)).await;
        assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "the connection outlived the sink: {closed:?}");
        assert!(start.elapsed() >= lifetime - Duration::from_secs(1), "closed before its lifetime: {:?}", start.elapsed());
        let ended = sink.await.expect("the sink task");
        assert!(matches!(ended, Err(SinkEnd::Lifetime)), "{ended:?}");
    }
}
