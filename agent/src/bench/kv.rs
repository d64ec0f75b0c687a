//! The KV-cache pattern: `iters` batches of `blocks` blocks scattered over a pool on each side,
//! each with a notification — through `SubmitTransfer` (a batch per transfer, followed to its
//! end) or over one channel (the list prepared once, posted `iters` times).
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::params::{kv_result, percentile, BenchParams, BenchResult};
use super::sample::distinct_slots;
use crate::error::NodeError;
use crate::node::{ChannelInput, ChannelOutput, ChannelParams, Node, BENCH_REGION_TTL};
use crate::transfer::{Op, TransferRequest, TransferState};
use xfer_engine::batch::{Batch, Dest, SegmentSpec};
use xfer_engine::ids::new_id;

/// The KV-cache pattern through the product path: `iters` batches (after one untimed warm-up
/// batch), each `blocks` blocks of
/// `size` bytes at random distinct places of a local pool written (or read) to random
/// distinct places of the peer's pool, each with a notification, one after the other
/// (`SubmitTransfer` with segments, followed to SUCCEEDED). Both pools are scratch regions,
/// deleted at the end.
pub(super) async fn run(node: &Arc<Node>, p: BenchParams) -> Result<BenchResult, NodeError> {
    let block = xfer_engine::shape::bench_size(p.size)?;
    let blocks = u64::from(p.blocks);
    let pool = xfer_engine::shape::bench_region(if p.pool == 0 { blocks.saturating_mul(block).saturating_mul(4) } else { p.pool })?;
    if pool / block < blocks {
        return Err(NodeError::Invalid(format!("a pool of {pool} bytes holds fewer than {blocks} blocks of {block}")));
    }
    if blocks as usize > node.transfer_defaults().max_segments {
        return Err(NodeError::Limit(format!(
            "{blocks} blocks; a batch takes at most {} (transfer.max_segments)",
            node.transfer_defaults().max_segments
        )));
    }
    let _admin = node.admin_slot("Bench")?;
    let iters = if p.iters == 0 { 5 } else { p.iters.min(10_000) };
    let peer = node.peer_entry(&p.peer).await?;
    let local = format!("xfer-bench-kv-{}", new_id());
    // Mapping and pinning a pool of gigabytes takes seconds: on the blocking pool, never on
    // a runtime thread (which would stall this agent's gRPC connections meanwhile).
    let (n, spec) = (
        Arc::clone(node),
        crate::regions::RegionSpec {
            ttl: Some(BENCH_REGION_TTL),
            labels: [("xfer.io/scratch".to_string(), "bench".to_string())].into(),
            ..crate::regions::RegionSpec::anonymous(&local, pool, xfer_fabric::Access::ReadWrite)
        },
    );
    let budget = node.reserve_bench(pool, "the benchmark's local pool")?;
    tokio::task::spawn_blocking(move || n.create_scratch(spec, budget)).await.map_err(|e| NodeError::Internal(e.to_string()))??;
    let res = match peer.call(|| peer.client.open_bench_region(pool)).await {
        Ok(remote) => {
            let res = with(node, &p, &local, &remote, block, blocks, pool, iters).await;
            if let Err(e) = peer.client.close_bench_region(&remote).await {
                warn!(error = %e, region = %remote, "could not delete bench scratch region on peer (its lease ends it)");
            }
            res
        }
        Err(e) => Err(e.into()),
    };
    let (n, name) = (Arc::clone(node), local.clone());
    let deleted = match tokio::task::spawn_blocking(move || n.delete_region(&name)).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    if let Err(e) = deleted {
        warn!(error = %e, region = %local, "could not delete the local bench pool (its lease ends it)");
    }
    res
}

#[allow(clippy::too_many_arguments)]
async fn with(
    node: &Arc<Node>,
    p: &BenchParams,
    local: &str,
    remote: &str,
    block: u64,
    blocks: u64,
    pool: u64,
    iters: u32,
) -> Result<BenchResult, NodeError> {
    // Distinct random slots on each side, in memory for `blocks` (at most
    // transfer.max_segments), never for the pool's slots (which the caller chooses).
    let slots = pool / block;
    let pick = |seed: u64| distinct_slots(slots, blocks, seed);
    let (from, to) = (pick(0x9E37_79B9), pick(0x7F4A_7C15));
    let specs: Vec<SegmentSpec> =
        from.iter().zip(&to).map(|(&l, &r)| SegmentSpec { local: l * block, remote: r * block, len: block }).collect();
    if p.channel {
        return over_channel(node, p, local, remote, block, blocks, iters, specs).await;
    }
    // What checking and coalescing the list costs (the submit does it once more).
    let dest = if p.op == Op::Write { Dest::Remote } else { Dest::Local };
    let t = Instant::now();
    let prepared = Batch::new(&specs, local, pool, dest, node.transfer_defaults().max_segments)?;
    let prep_ns = t.elapsed().as_nanos() as f64 / blocks.max(1) as f64;
    drop(prepared);
    let (mut batch_us, mut submit_us) = (Vec::new(), Vec::new());
    let mut busy = Duration::ZERO;
    // One untimed batch first: the pools are fresh anonymous memory, and the first batch would
    // time the page faults that fill them in (a verbs registration takes those when it pins
    // the pool; a KV cache's pool is long-lived) along with the transfers.
    for i in (0..=iters).map(|i| i.checked_sub(1)) {
        let req = TransferRequest {
            op: p.op,
            local_region: local.to_string(),
            local_offset: 0,
            remote_agent: p.peer.clone(),
            remote_region: remote.to_string(),
            remote_offset: 0,
            length: 0,
            options: p.transfer_options(),
            segments: specs.clone(),
            // The warm-up is not the application's batch: nothing is announced for it.
            notify: i.map(|i| format!("bench-kv-{i}").into_bytes()),
        };
        let t0 = Instant::now();
        let rec = node.submit(req).await?;
        let submitted = t0.elapsed();
        let h = node.transfer(&rec.id)?;
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
        let Some(i) = i else {
            if end.state != TransferState::Succeeded {
                return Err(NodeError::Internal(format!("bench warm-up batch ended {:?}: {}", end.state, end.error.unwrap_or_default())));
            }
            continue;
        };
        if end.state != TransferState::Succeeded {
            return Err(NodeError::Internal(format!("bench batch {i} ended {:?}: {}", end.state, end.error.unwrap_or_default())));
        }
        submit_us.push(submitted.as_secs_f64() * 1e6);
        busy += took;
        batch_us.push(took.as_secs_f64() * 1e6);
    }
    Ok(kv_result(block, blocks, iters, busy, batch_us, submit_us, prep_ns))
}

/// The KV pattern over one channel: open it (timed), prepare the list once (timed), then post
/// it `iters` times, each with a notification, one after the other.
#[allow(clippy::too_many_arguments)]
async fn over_channel(
    node: &Arc<Node>,
    p: &BenchParams,
    local: &str,
    remote: &str,
    block: u64,
    blocks: u64,
    iters: u32,
    specs: Vec<SegmentSpec>,
) -> Result<BenchResult, NodeError> {
    let t = Instant::now();
    let ch = node
        .open_channel(ChannelParams {
            op: p.op,
            local_region: local.to_string(),
            remote_agent: p.peer.clone(),
            remote_region: remote.to_string(),
            remote_offset: 0,
            length: 0,
            options: p.transfer_options(),
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
    let lost = || NodeError::Internal("the bench channel ended early".into());
    let t = Instant::now();
    in_tx.send(ChannelInput::Prepare { list: 1, segments: specs }).await.map_err(|_| lost())?;
    match out_rx.recv().await {
        Some(ChannelOutput::Prepared { .. }) => {}
        Some(ChannelOutput::Done(d)) => return Err(NodeError::Invalid(d.error.map(|e| e.1).unwrap_or_default())),
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
            return Err(NodeError::Internal(format!("bench batch {i} failed ({code}): {msg}")));
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
