//! `xferctl bench --pattern notify`: how long after a batch's last byte is visible in the
//! target's memory the target's application receives the batch's notification (the "last byte
//! visible → the application" latency), measured end to end from the application's side.
//!
//! xferctl runs on the target's node. It creates a shared-memory pool on the peer (`--peer`) and
//! maps it, so it sees the bytes as they land, and a source region on `--agent` filled once
//! with one set of blocks per round, every block ending in its round's number. Each round a
//! thread (the application) scans the last 8 bytes of every block of the mapped pool until all
//! carry the round's number (the moment the last byte is visible, to within one pass), while
//! the round's batch is submitted with a notification. The notification is received one of two
//! ways (`--notify-via`), one per run so that one does not load the machine while the other is
//! measured:
//! - `ring` (`WatchInboundRing`): the same thread polls the ring between two scans;
//! - `stream` (`WatchInbound`): the main task receives the stream's message.
//!
//! The delay is the notification's arrival minus the moment the last block was seen. A
//! notification that arrives before every block is visible is a failure (the stale-data case
//! the conformance suite also checks), not a sample.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use serde_json::json;
use xfer_client::{Client, Inbound, InboundRing, Notification, Segment, ShmRegion, TransferSpec};

use crate::Ctx;

/// How the application receives its notifications (`--notify-via`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NotifyVia {
    /// A shared-memory ring polled by the application's thread (`WatchInboundRing`).
    Ring,
    /// The `WatchInbound` gRPC stream.
    Stream,
}

impl NotifyVia {
    fn as_str(self) -> &'static str {
        match self {
            NotifyVia::Ring => "ring",
            NotifyVia::Stream => "stream",
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct NotifyRun {
    pub via: NotifyVia,
    pub rounds: usize,
    /// Per round, all in microseconds: notification arrival minus last byte seen.
    pub delays_us: Vec<f64>,
    /// Submit to notification.
    pub batches_us: Vec<f64>,
    /// The split of each delay at the notification's `at` (when the peer published it; same
    /// host, same clock): last byte seen -> published, and published -> received. Signed
    /// microseconds (the first can dip below 0 by up to one pass, or by however long the
    /// application's thread was off its core).
    pub published_us: Vec<f64>,
    pub delivered_us: Vec<f64>,
    /// The resolution: the mean time between two passes of the application's loop.
    pub scans_us: Vec<f64>,
    /// How the peer learnt of each batch (`fabric` or `complete`), as counts.
    pub via_fabric: usize,
}

/// The last 8 bytes of every block hold the round number (1-based), little-endian.
fn stamp_of(round: usize) -> [u8; 8] {
    (round as u64 + 1).to_le_bytes()
}

/// True when block `j` (of `block` bytes) of `pool` ends with `stamp`.
fn stamped(pool: &ShmRegion, block: u64, j: u64, stamp: [u8; 8]) -> bool {
    let mut tail = [0u8; 8];
    pool.read_at_poll(j * block + block - 8, &mut tail).is_ok() && tail == stamp
}

/// Blocks of `pool` not yet ending with `stamp`.
fn stale(pool: &ShmRegion, block: u64, blocks: usize, stamp: [u8; 8]) -> usize {
    (0..blocks as u64).filter(|&j| !stamped(pool, block, j, stamp)).count()
}

/// What the application thread saw in one round.
struct Seen {
    /// When the last block was first seen stamped.
    last_block: Option<Instant>,
    /// With a ring: the round's notification, when it was read and how many blocks were not
    /// yet visible then.
    from_ring: Option<(Notification, Instant, usize)>,
    /// The mean time between two passes of the loop.
    pass: Duration,
}

/// The application: scans `blocks` blocks of `block` bytes until each ends with `stamp` and,
/// with a ring, polls it for the notification tagged `tag` between two scans, until both
/// happened or `stop`.
fn watch_round(
    pool: &ShmRegion,
    mut ring: Option<&mut InboundRing>,
    block: u64,
    blocks: usize,
    stamp: [u8; 8],
    tag: &[u8],
    stop: &AtomicBool,
) -> anyhow::Result<Seen> {
    let mut seen = vec![false; blocks];
    let mut left = blocks;
    let (start, mut passes) = (Instant::now(), 0u32);
    let (mut last_block, mut from_ring) = (None, None);
    while (left > 0 || (ring.is_some() && from_ring.is_none())) && !stop.load(Ordering::Acquire) {
        passes += 1;
        if let Some(ring) = ring.as_deref_mut() {
            while from_ring.is_none() {
                match ring.try_next().context("reading the notification ring")? {
                    Some(n) if n.tag == tag => {
                        let at = Instant::now();
                        // Told: every block must be visible now.
                        from_ring = Some((n, at, stale(pool, block, blocks, stamp)));
                    }
                    Some(_) => {}
                    None => break,
                }
            }
        }
        if left > 0 {
            for (i, s) in seen.iter_mut().enumerate().filter(|(_, s)| !**s) {
                if stamped(pool, block, i as u64, stamp) {
                    *s = true;
                    left -= 1;
                }
            }
            if left == 0 {
                last_block = Some(Instant::now());
            }
        }
        // Give the core away between passes: on a small machine the agents, the kernel's RoCE
        // work and this process's runtime need it, and a pure spin would delay what it measures.
        std::thread::yield_now();
    }
    Ok(Seen { last_block, from_ring, pass: start.elapsed() / passes.max(1) })
}

/// Runs `rounds` batches of `blocks` × `block` from `--agent` into a pool on `peer`.
pub async fn run_notify(ctx: &Ctx, peer_addr: &str, block: u64, blocks: u32, rounds: u32, via: NotifyVia) -> anyhow::Result<NotifyRun> {
    if block < 8 || blocks == 0 || rounds == 0 {
        return Err(crate::error::usage("--pattern notify needs --block of at least 8 bytes, --blocks and --iters above zero"));
    }
    let (blocks, rounds) = (blocks as usize, rounds as usize);
    let initiator = ctx.client().await?;
    let peer = ctx.connect(peer_addr).await?;
    let tag = format!("{:x}", rand::random::<u64>());
    let (src_name, pool_name) = (format!("xfer-notify-src-{tag}"), format!("xfer-notify-pool-{tag}"));
    let pool_len = block * blocks as u64;
    let src_len = pool_len.checked_mul(rounds as u64).context("--blocks x --block x --iters overflows")?;
    let pool = peer.create_shm_region(&pool_name, pool_len).await.with_context(|| {
        format!("creating and mapping a shared-memory pool on {peer_addr} (xferctl must run on the peer's node, as the agent's user)")
    })?;
    let pool = Arc::new(pool);
    let result = async {
        initiator.create_region(&src_name, src_len).await.context("creating the source region")?;
        // Round r's blocks are src blocks r*blocks.., each ending in r+1.
        let mut src = vec![0u8; usize::try_from(src_len).context("the source does not fit in memory")?];
        for (i, b) in src.chunks_mut(block as usize).enumerate() {
            let at = b.len() - 8;
            b[at..].copy_from_slice(&stamp_of(i / blocks));
        }
        initiator.put(&src_name, 0, &src).await.context("filling the source region")?;
        drop(src);
        let shape = Shape { src: &src_name, peer_addr, block, blocks, rounds };
        rounds_over(&initiator, &peer, &pool, &shape, via).await
    }
    .await;
    let _ = initiator.delete_region(&src_name).await;
    drop(pool);
    let _ = peer.delete_region(&pool_name).await;
    result
}

/// What every round moves.
struct Shape<'a> {
    src: &'a str,
    peer_addr: &'a str,
    block: u64,
    blocks: usize,
    rounds: usize,
}

/// The subscription a run receives its notifications from.
enum Receiver {
    Ring(Option<InboundRing>),
    Stream(Inbound),
}

async fn rounds_over(
    initiator: &Client,
    peer: &Client,
    pool: &Arc<ShmRegion>,
    sh: &Shape<'_>,
    via: NotifyVia,
) -> anyhow::Result<NotifyRun> {
    let mut rx = match via {
        NotifyVia::Stream => {
            Receiver::Stream(peer.watch_inbound(Some(pool.name()), None).await.context("subscribing to the peer's notifications")?)
        }
        NotifyVia::Ring => Receiver::Ring(Some(peer.watch_inbound_ring(Some(pool.name()), None, 0).await.context(
            "subscribing to the peer's notifications through a ring (xferctl must run on the peer's node, as the agent's user)",
        )?)),
    };
    let mut run = NotifyRun {
        via,
        rounds: sh.rounds,
        delays_us: Vec::new(),
        batches_us: Vec::new(),
        published_us: Vec::new(),
        delivered_us: Vec::new(),
        scans_us: Vec::new(),
        via_fabric: 0,
    };
    // Instants to wall-clock time, to compare with the peer's publication time (`at`).
    let (anchor, anchor_wall) = clock_anchor();
    let wall_us = |i: Instant| micros(anchor_wall) + i.saturating_duration_since(anchor).as_secs_f64() * 1e6;
    let (block, blocks) = (sh.block, sh.blocks);
    for r in 0..sh.rounds {
        let stop = Arc::new(AtomicBool::new(false));
        let note_tag = format!("notify-{r}");
        let app = {
            let (pool, stop, tag) = (Arc::clone(pool), Arc::clone(&stop), note_tag.clone().into_bytes());
            let mut ring = match &mut rx {
                Receiver::Ring(r) => Some(r.take().context("the ring came back from no round")?),
                Receiver::Stream(_) => None,
            };
            std::thread::spawn(move || {
                let seen = watch_round(&pool, ring.as_mut(), block, blocks, stamp_of(r), &tag, &stop);
                (ring, seen)
            })
        };
        let segs: Vec<Segment> =
            (0..blocks as u64).map(|j| Segment { local: (r as u64 * blocks as u64 + j) * block, remote: j * block, len: block }).collect();
        let t0 = Instant::now();
        let submitted =
            initiator.submit(TransferSpec::write(sh.src, sh.peer_addr, pool.name()).segments(segs).notify(note_tag.as_bytes())).await;
        let t = match submitted {
            Ok(t) => t,
            Err(e) => {
                stop.store(true, Ordering::Release);
                let _ = tokio::task::spawn_blocking(move || app.join()).await;
                return Err(anyhow::Error::new(e).context(format!("submitting round {r}")));
            }
        };
        let from_stream = match &mut rx {
            Receiver::Stream(inbound) => {
                let note = loop {
                    let n = inbound.next().await.context("waiting for the notification")?;
                    if n.tag == note_tag.as_bytes() {
                        break n;
                    }
                };
                let arrived = Instant::now();
                // Told: every block must be visible now (read at once, as an application would).
                Some((note, arrived, stale(pool, block, blocks, stamp_of(r))))
            }
            Receiver::Ring(_) => None,
        };
        // The application thread ends once it saw the last block (and, with a ring, the
        // notification); one that never does is stopped after 10 s and the round fails.
        let give_up = {
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(10)).await;
                stop.store(true, Ordering::Release);
            })
        };
        let joined = tokio::task::spawn_blocking(move || app.join()).await;
        give_up.abort();
        let (ring, seen) =
            joined.context("joining the application thread")?.map_err(|_| anyhow::anyhow!("the application thread panicked"))?;
        if let Receiver::Ring(slot) = &mut rx {
            *slot = ring;
        }
        let seen = seen.with_context(|| format!("round {r}"))?;
        initiator.wait(&t.id).await.with_context(|| format!("round {r}'s transfer"))?;
        let Some((note, arrived, stale)) = from_stream.or(seen.from_ring) else {
            anyhow::bail!("round {r}: the notification did not come within 10 s of the batch");
        };
        if stale > 0 {
            anyhow::bail!("round {r}: notified while {stale} of {blocks} blocks were not yet visible in the pool (stale data)");
        }
        // The application may see the last block a pass after the notification: then the delay
        // is below one pass (the resolution), counted as 0.
        let last = seen.last_block.unwrap_or(arrived);
        run.delays_us.push(arrived.saturating_duration_since(last).as_secs_f64() * 1e6);
        if let Some(at) = note.at {
            // Split at the peer's publication. The application notices the last block at most a
            // pass late, so the publication can stamp before that: below the resolution, 0 (two
            // clocks read microseconds apart are no negative latency).
            run.published_us.push((micros(at) - wall_us(last)).max(0.0));
            run.delivered_us.push((wall_us(arrived) - micros(at)).max(0.0));
        }
        run.batches_us.push((arrived - t0).as_secs_f64() * 1e6);
        run.scans_us.push(seen.pass.as_secs_f64() * 1e6);
        run.via_fabric += usize::from(note.via == "fabric");
    }
    Ok(run)
}

/// A monotonic instant and the wall-clock time at that instant, to within the narrowest of 100
/// tries: a thread preempted between the two reads (often, on a small VM) would otherwise skew
/// every published -> received split of the run by the preemption.
fn clock_anchor() -> (Instant, SystemTime) {
    let mut best: Option<(Duration, Instant, SystemTime)> = None;
    for _ in 0..100 {
        let before = Instant::now();
        let wall = SystemTime::now();
        let after = Instant::now();
        let gap = after - before;
        if best.is_none_or(|(g, _, _)| gap < g) {
            best = Some((gap, before + gap / 2, wall));
        }
    }
    best.map_or_else(|| (Instant::now(), SystemTime::now()), |(_, i, w)| (i, w))
}

fn micros(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64() * 1e6
}

/// The `q` quantile of `v` (sorted here), 0 when empty.
fn pct(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(((v.len().max(1) - 1) as f64 * q).round() as usize).copied().unwrap_or(0.0)
}

/// Prints a run as a line (or JSON).
pub fn report(ctx: &Ctx, peer: &str, block: u64, blocks: u32, run: &NotifyRun) -> anyhow::Result<()> {
    let (d50, d99, dmax) = (pct(&run.delays_us, 0.5), pct(&run.delays_us, 0.99), pct(&run.delays_us, 1.0));
    let (batch50, scan50) = (pct(&run.batches_us, 0.5), pct(&run.scans_us, 0.5));
    let (published50, delivered50) = (pct(&run.published_us, 0.5), pct(&run.delivered_us, 0.5));
    if ctx.json {
        return ctx.print_json(&json!({
            "agent": ctx.agent,
            "peer": peer,
            "pattern": "notify",
            "via": run.via.as_str(),
            "block": block,
            "blocks": blocks,
            "rounds": run.rounds,
            "notify_delay_p50_us": d50,
            "notify_delay_p99_us": d99,
            "notify_delay_max_us": dmax,
            "batch_p50_us": batch50,
            "scan_p50_us": scan50,
            "published_p50_us": published50,
            "delivered_p50_us": delivered50,
            "via_fabric": run.via_fabric,
        }));
    }
    ctx.print(&notify_table(
        &format!("{} -> {peer} via {}: {} rounds of {blocks} x {block} B", ctx.agent, run.via.as_str(), run.rounds),
        &[
            ("last byte visible -> notification received", d50, Some((d99, dmax))),
            ("  last byte visible -> published by the peer", published50, None),
            ("  published -> received", delivered50, None),
            ("submit -> notification received", batch50, None),
            ("a pass of the application's loop (resolution)", scan50, None),
        ],
        &format!("{} of {} via the fabric", run.via_fabric, run.rounds),
    ))
}

/// One measure of the notify report: what, its p50, and its p99 and max where measured.
type Measure<'a> = (&'a str, f64, Option<(f64, f64)>);

/// The notify pattern's report as a table, one measure per line (p50, and p99 and max where
/// they are measured), a comment line above and below.
fn notify_table(title: &str, rows: &[Measure<'_>], footer: &str) -> String {
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let mut out = format!("# notify {title}, the application's view of the peer's pool\n");
    out.push_str(&format!("{:width$}  {:>10}  {:>10}  {:>10}\n", "#", "p50 us", "p99 us", "max us"));
    for (what, p50, tail) in rows {
        let (p99, max) = tail.map_or(("-".to_string(), "-".to_string()), |(a, b)| (format!("{a:.1}"), format!("{b:.1}")));
        out.push_str(&format!("{what:width$}  {p50:>10.1}  {p99:>10}  {max:>10}\n"));
    }
    out.push_str(&format!("# {footer}\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_is_a_table_of_short_lines() {
        let t = notify_table(
            "a -> b via stream: 3 rounds",
            &[("x -> y", 12.25, Some((20.0, 31.5))), ("  y -> z", 0.0, None)],
            "1 of 3 via the fabric",
        );
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 5, "{t}");
        assert!(lines.iter().all(|l| l.len() < 120), "{t}");
        assert!(lines[2].starts_with("x -> y") && lines[2].contains("12.2") && lines[2].contains("31.5"), "{t}");
    }

    #[test]
    fn percentiles_of_samples() {
        let s: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(pct(&s, 0.5), 51.0);
        assert_eq!(pct(&s, 0.99), 99.0);
        assert_eq!(pct(&s, 1.0), 100.0);
        assert_eq!(pct(&[], 0.5), 0.0);
        assert_eq!(stamp_of(0), 1u64.to_le_bytes());
        assert_eq!(pct(&[3.0, -1.0, 2.0], 0.5), 2.0);
    }
}
