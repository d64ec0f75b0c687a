//! Two links per node on Soft-RoCE: two real agents, A on `rxe0,rxe2` and B on `rxe1,rxe3`
//! (`verbs.devices`), each device pair on its own veth pair and subnet (`scripts/rxe-vm`). A
//! transfer stripes over both links; a link taken down in the middle of a WRITE, a READ or a
//! notified batch moves the rest over the other link with every byte verified and the
//! notification sent once; a link brought back is used again; both links down fail the transfer
//! with a code instead of hanging.
//!
//! Links are flipped with `scripts/rxe-link` (`ip link set … down`; `up` restores the policy
//! route and neighbours `down` flushed and waits for the rxe ports to be ACTIVE). A [`Downed`]
//! guard brings every link it took down back up, also when a test fails, so the modules after
//! this one find the topology whole. "Mid-transfer" means: the transfer was submitted, its
//! progress shows bytes moving on the link about to go down, and it has bytes left.
//!
//! Every test needs the devices: `#[ignore = "needs Soft-RoCE"]`, run by
//! `scripts/rxe-guest-test` in the VM with `--include-ignored`.
#![cfg(feature = "verbs")]

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use xfer_proto::v1 as pb;

use crate::common::{labelled, metric, next_note, random_bytes, scrape, subscribe, Agent};

pub(crate) const MIB: u64 = 1 << 20;
/// A hang guard for one transfer under TCG (two emulated links share two vCPUs: tens of MiB/s),
/// not a performance bound.
const TRANSFER_GUARD: Duration = Duration::from_secs(900);

/// The devices and netdevs of both links, from the VM's environment.
pub(crate) struct Links {
    pub a: [String; 2],
    pub b: [String; 2],
    pub a_net: [String; 2],
    pub b_net: [String; 2],
}

pub(crate) fn links() -> Links {
    let var = |k: &str| std::env::var(format!("XFER_RXE_{k}")).unwrap_or_else(|_| panic!("XFER_RXE_{k} not set: run in scripts/rxe-vm"));
    Links {
        a: [var("A_DEV"), var("A2_DEV")],
        b: [var("B_DEV"), var("B2_DEV")],
        a_net: [var("A_NETDEV"), var("A2_NETDEV")],
        b_net: [var("B_NETDEV"), var("B2_NETDEV")],
    }
}

/// Agents A and B, each on both of its devices.
pub(crate) fn agents(l: &Links) -> (Agent, Agent) {
    let a_devs = l.a.join(",");
    let b_devs = l.b.join(",");
    let a = Agent::start_fabric("rail-a", "verbs", &[("XFER_VERBS__DEVICES", a_devs.as_str())]);
    let b = Agent::start_fabric("rail-b", "verbs", &[("XFER_VERBS__DEVICES", b_devs.as_str())]);
    (a, b)
}

fn rxe_link(cmd: &str, netdev: &str) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/rxe-link");
    let out = Command::new(script).args([cmd, netdev]).output().unwrap();
    assert!(out.status.success(), "rxe-link {cmd} {netdev}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Links taken down by a test; every one is brought back up when this is dropped.
pub(crate) struct Downed(Vec<String>);

impl Downed {
    pub(crate) fn new() -> Downed {
        Downed(Vec::new())
    }

    pub(crate) fn down(&mut self, netdev: &str) {
        self.0.push(netdev.to_string());
        rxe_link("down", netdev);
    }

    /// Brings every downed link back and waits until its ports are ACTIVE.
    pub(crate) fn restore(&mut self) {
        for n in std::mem::take(&mut self.0) {
            rxe_link("up", &n);
        }
    }
}

impl Drop for Downed {
    fn drop(&mut self) {
        for n in std::mem::take(&mut self.0) {
            let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/rxe-link");
            match Command::new(script).args(["up", &n]).output() {
                Ok(o) if o.status.success() => {}
                other => eprintln!("multi_rail: could not bring {n} back up: {other:?}"),
            }
        }
    }
}

pub(crate) fn tx_bytes(netdev: &str) -> u64 {
    std::fs::read_to_string(format!("/sys/class/net/{netdev}/statistics/tx_bytes")).unwrap().trim().parse().unwrap()
}

/// Bytes agent `a` moved through `device` (`xfer_device_bytes_total{device}`).
pub(crate) fn device_bytes(a: &Agent, device: &str) -> f64 {
    labelled(&scrape(a), "xfer_device_bytes_total", &[("device", device)])
}

fn failovers(a: &Agent) -> f64 {
    metric(&scrape(a), "xfer_path_failovers_total")
}

/// MiB block `i` of a region filled by [`fill`] from `base`: `base` rotated by a distinct amount
/// per block, so a block that landed at the wrong place or not at all does not compare equal.
fn block(base: &[u8], i: u64) -> Vec<u8> {
    let r = (i as usize * 7919 + 1) % base.len();
    let mut v = Vec::with_capacity(base.len());
    v.extend_from_slice(&base[r..]);
    v.extend_from_slice(&base[..r]);
    v
}

/// Creates region `name` of `blocks` MiB on `a`; with `seed`, fills it with [`block`]s of a
/// random MiB made from `seed` (streamed one MiB at a time). Returns that MiB, the `base` of
/// [`assert_blocks`].
pub(crate) async fn region(a: &Agent, name: &str, blocks: u64, seed: Option<u64>) -> Arc<Vec<u8>> {
    a.create(name, blocks * MIB, pb::Access::ReadWrite).await;
    let base = Arc::new(random_bytes(MIB as usize, seed.unwrap_or(1)));
    if seed.is_some() {
        let (b, first) = (Arc::clone(&base), name.to_string());
        let msgs = futures::stream::iter(0..blocks).map(move |i| pb::WriteRegionRequest {
            region: if i == 0 { first.clone() } else { String::new() },
            offset: 0,
            data: block(&b, i),
        });
        a.client().await.write_region(msgs).await.unwrap_or_else(|s| panic!("fill {name}: {s}"));
    }
    base
}

pub(crate) fn req(op: pb::Op, local: &str, peer: &Agent, remote: &str, len: u64) -> pb::SubmitTransferRequest {
    pb::SubmitTransferRequest {
        op: op as i32,
        local: Some(pb::LocalRange { region: local.into(), offset: 0 }),
        remote: Some(pb::RemoteRange { agent: peer.addr(), region: remote.into(), offset: 0 }),
        length: len,
        options: None,
        ..Default::default()
    }
}

pub(crate) async fn submit(a: &Agent, r: pb::SubmitTransferRequest) -> String {
    a.client().await.submit_transfer(r).await.unwrap_or_else(|s| panic!("submit: {s}")).into_inner().id
}

async fn get(a: &Agent, id: &str) -> pb::Transfer {
    a.client().await.get_transfer(pb::GetTransferRequest { id: id.into() }).await.unwrap().into_inner()
}

/// Waits until transfer `id` on `a` moves bytes over `netdev` (its tx counter more than a MiB
/// above `before`: data, not control traffic), and asserts it still has bytes left: the moment
/// to take that link down "mid-transfer".
pub(crate) async fn wait_moving_on(a: &Agent, id: &str, netdev: &str, before: u64) -> pb::Transfer {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let t = get(a, id).await;
        if t.bytes_done > 0 && tx_bytes(netdev) > before + MIB {
            assert!(t.bytes_done < t.length, "transfer {id} finished before the link could go down; make it bigger: {t:?}");
            return t;
        }
        let live = [pb::TransferState::Queued, pb::TransferState::Connecting, pb::TransferState::Running];
        assert!(live.iter().any(|s| t.state == *s as i32), "transfer {id} ended before moving bytes on {netdev}: {t:?}\n{}", scrape(a));
        assert!(Instant::now() < deadline, "transfer {id} never moved bytes on {netdev}: {t:?}\n{}", a.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The terminal record of transfer `id` (a hang guard of [`TRANSFER_GUARD`]).
pub(crate) async fn finish(a: &Agent, id: &str) -> pb::Transfer {
    let watch = async {
        let mut w = a.client().await.watch_transfer(pb::WatchTransferRequest { id: id.into() }).await.unwrap().into_inner();
        let mut last = None;
        while let Some(m) = w.message().await.unwrap() {
            last = Some(m);
        }
        last.unwrap()
    };
    tokio::time::timeout(TRANSFER_GUARD, watch).await.unwrap_or_else(|_| panic!("transfer {id} hung: {:?}\n{}", a.logs(), scrape(a)))
}

pub(crate) fn assert_succeeded(t: &pb::Transfer, a: &Agent) {
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "transfer failed: {t:?}\n{}", a.logs());
    assert_eq!(t.bytes_done, t.length, "{t:?}");
}

/// Asserts that the first `blocks` MiB of `region` on `at` are [`block`]s of `base`, read back
/// 16 MiB at a time. The bytes themselves are compared (not the agents' checksums: those take
/// minutes per GiB in a debug build under TCG, past the peers' RPC timeout).
pub(crate) async fn assert_blocks(at: &Agent, region: &str, base: &[u8], blocks: u64) {
    const STEP: u64 = 16;
    for first in (0..blocks).step_by(STEP as usize) {
        let n = STEP.min(blocks - first);
        let got = at.read(region, first * MIB, n * MIB).await;
        assert_eq!(got.len() as u64, n * MIB);
        for (k, mib) in got.chunks(MIB as usize).enumerate() {
            let i = first + k as u64;
            assert!(mib == block(base, i).as_slice(), "MiB {i} of {region} on {} differs from the source", at.name);
        }
    }
}

#[tokio::test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn a_transfer_uses_both_links() {
    let l = links();
    let (a, b) = agents(&l);
    const BLOCKS: u64 = 256;
    let base = region(&a, "src", BLOCKS, Some(11)).await;
    region(&b, "dst", BLOCKS, None).await;
    let tx0: Vec<u64> = l.a_net.iter().map(|n| tx_bytes(n)).collect();
    let acks0: Vec<u64> = l.b_net.iter().map(|n| tx_bytes(n)).collect();
    let t = finish(&a, &submit(&a, req(pb::Op::Write, "src", &b, "dst", BLOCKS * MIB)).await).await;
    assert_succeeded(&t, &a);
    let moved: Vec<u64> = l.a_net.iter().zip(&tx0).map(|(n, b0)| tx_bytes(n) - b0).collect();
    let dev: Vec<f64> = l.a.iter().map(|d| device_bytes(&a, d)).collect();
    println!("256 MiB WRITE: {} bytes {:?}, {} tx bytes {:?}, {:.1} s", l.a.join("/"), dev, l.a_net.join("/"), moved, t.elapsed_seconds);
    assert_blocks(&b, "dst", &base, BLOCKS).await;
    for (d, v) in l.a.iter().zip(&dev) {
        assert!(*v > 0.0, "no bytes through {d}: {}", scrape(&a));
    }
    // One connection over two devices is one build on each side, not one per device.
    let (sa, sb) = (scrape(&a), scrape(&b));
    assert_eq!(labelled(&sa, "xfer_connection_builds_total", &[("role", "initiator")]), 1.0, "{sa}");
    assert_eq!(labelled(&sb, "xfer_connection_builds_total", &[("role", "responder")]), 1.0, "{sb}");
    // B's end of each pair carried the acknowledgements.
    for (n, b0) in l.b_net.iter().zip(&acks0) {
        assert!(tx_bytes(n) > *b0, "{n} (B's end) sent nothing");
    }
    // More than control traffic: a real share of the data crossed each link.
    for (n, m) in l.a_net.iter().zip(&moved) {
        assert!(*m > 16 * MIB, "{n} carried only {m} bytes of a 256 MiB WRITE");
    }
}

/// Size of the transfers a link goes down in: at the tens of MiB/s of two emulated links it
/// runs for seconds, and the link goes down within milliseconds of its first MiB on that link.
const FAILOVER_BLOCKS: u64 = 512;

/// A transfer (`op`) during which the second link goes down completes with every byte in place
/// and a failover counted.
async fn survives_link_down(op: pb::Op) {
    let l = links();
    let (a, b) = agents(&l);
    const BLOCKS: u64 = FAILOVER_BLOCKS;
    // The source holds the data: B's region for a READ, A's for a WRITE.
    let read = op == pb::Op::Read;
    let rb = region(&b, "remote", BLOCKS, read.then_some(23)).await;
    let ra = region(&a, "local", BLOCKS, (!read).then_some(29)).await;
    let mut downed = Downed::new();
    // The data leaves through the source's end of the link: B's for a READ.
    let data_net = if read { &l.b_net[1] } else { &l.a_net[1] };
    let before = tx_bytes(data_net);
    let id = submit(&a, req(op, "local", &b, "remote", BLOCKS * MIB)).await;
    let at = wait_moving_on(&a, &id, data_net, before).await;
    downed.down(&l.a_net[1]);
    let first_dev = device_bytes(&a, &l.a[0]);
    let t = finish(&a, &id).await;
    assert_succeeded(&t, &a);
    let f = failovers(&a);
    println!(
        "{} MiB {op:?}: {} went down at {} MiB; completed in {:.1} s, {f} failover(s); {} moved {} more bytes after",
        BLOCKS,
        l.a_net[1],
        at.bytes_done / MIB,
        t.elapsed_seconds,
        l.a[0],
        device_bytes(&a, &l.a[0]) - first_dev
    );
    if read {
        assert_blocks(&a, "local", &rb, BLOCKS).await;
    } else {
        assert_blocks(&b, "remote", &ra, BLOCKS).await;
    }
    assert!(f > 0.0, "no failover counted (xfer_path_failovers_total): {}", scrape(&a));
    assert!(device_bytes(&a, &l.a[0]) > first_dev, "nothing moved on {} after {} went down", l.a[0], l.a_net[1]);
    downed.restore();
}

#[tokio::test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn a_write_survives_a_link_going_down() {
    survives_link_down(pb::Op::Write).await;
}

/// A READ stays on the connection's first path (READs are not striped nor failed over yet): the
/// second link going down under it changes nothing, nothing is posted on the second device, and
/// every byte lands.
#[tokio::test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn a_read_stays_on_the_first_link_when_the_second_goes_down() {
    let l = links();
    let (a, b) = agents(&l);
    const BLOCKS: u64 = FAILOVER_BLOCKS;
    let rb = region(&b, "remote", BLOCKS, Some(23)).await;
    region(&a, "local", BLOCKS, None).await;
    let mut downed = Downed::new();
    let second = device_bytes(&a, &l.a[1]);
    // The data leaves through B's end of the first link.
    let before = tx_bytes(&l.b_net[0]);
    let id = submit(&a, req(pb::Op::Read, "local", &b, "remote", BLOCKS * MIB)).await;
    wait_moving_on(&a, &id, &l.b_net[0], before).await;
    downed.down(&l.a_net[1]);
    let t = finish(&a, &id).await;
    assert_succeeded(&t, &a);
    assert_blocks(&a, "local", &rb, BLOCKS).await;
    assert_eq!(failovers(&a), 0.0, "a READ lost a path: {}", scrape(&a));
    assert_eq!(device_bytes(&a, &l.a[1]), second, "a READ posted on {}: {}", l.a[1], scrape(&a));
    downed.restore();
}

/// A notified batch across a failover: the target hears of it exactly once, and by then every
/// byte is in place.
#[tokio::test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn a_batch_across_a_failover_is_notified_once_after_every_byte() {
    let l = links();
    let (a, b) = agents(&l);
    // Segment k: A's MiB 2k to B's MiB 2(SEGS-1-k)+1 (scattered, reversed, none contiguous).
    const SEGS: u64 = FAILOVER_BLOCKS / 2;
    const BLOCKS: u64 = 2 * SEGS;
    let base = region(&a, "src", BLOCKS, Some(31)).await;
    region(&b, "dst", BLOCKS, None).await;
    let segments: Vec<pb::Segment> =
        (0..SEGS).map(|k| pb::Segment { local_offset: 2 * k * MIB, remote_offset: (2 * (SEGS - 1 - k) + 1) * MIB, length: MIB }).collect();
    let mut notes = subscribe(&b, "dst", None).await;
    let mut r = req(pb::Op::Write, "src", &b, "dst", 0);
    r.segments = segments.clone();
    r.notify = Some(b"across".to_vec());
    let mut downed = Downed::new();
    let before = tx_bytes(&l.a_net[1]);
    let id = submit(&a, r.clone()).await;
    wait_moving_on(&a, &id, &l.a_net[1], before).await;
    downed.down(&l.a_net[1]);

    let note = tokio::time::timeout(TRANSFER_GUARD, notes.message())
        .await
        .unwrap_or_else(|_| panic!("no notification of transfer {id}"))
        .unwrap()
        .expect("stream open");
    assert_eq!(note.tag, b"across");
    // Every byte is in place when the notification is seen.
    for s in &segments {
        let got = b.read("dst", s.remote_offset, s.length).await;
        assert!(got == block(&base, s.local_offset / MIB), "segment {s:?} not in place when notified");
    }
    let t = finish(&a, &id).await;
    assert_succeeded(&t, &a);
    assert!(failovers(&a) > 0.0, "no failover counted: {}", scrape(&a));

    // Exactly once: the next notification the subscriber sees is that of a following batch.
    downed.restore();
    r.segments = segments[..4].to_vec();
    r.notify = Some(b"after".to_vec());
    let id2 = submit(&a, r).await;
    assert_succeeded(&finish(&a, &id2).await, &a);
    let next = next_note(&mut notes).await;
    assert_eq!(next.tag, b"after", "a second notification of the batch across the failover: {next:?}");
}

/// A link brought back after a failure carries traffic again: the following transfer's bytes
/// grow its device counter.
#[tokio::test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn a_link_brought_back_is_used_again() {
    let l = links();
    let (a, b) = agents(&l);
    const BLOCKS: u64 = 256;
    let base = region(&a, "src", BLOCKS, Some(37)).await;
    region(&b, "dst", BLOCKS, None).await;
    let mut downed = Downed::new();
    let before = tx_bytes(&l.a_net[1]);
    let id = submit(&a, req(pb::Op::Write, "src", &b, "dst", BLOCKS * MIB)).await;
    wait_moving_on(&a, &id, &l.a_net[1], before).await;
    downed.down(&l.a_net[1]);
    assert_succeeded(&finish(&a, &id).await, &a);
    // While it is down, a transfer still completes (over the first link alone).
    assert_succeeded(&finish(&a, &submit(&a, req(pb::Op::Write, "src", &b, "dst", 64 * MIB)).await).await, &a);

    downed.restore();
    let (dev0, tx0) = (device_bytes(&a, &l.a[1]), tx_bytes(&l.a_net[1]));
    let t = finish(&a, &submit(&a, req(pb::Op::Write, "src", &b, "dst", BLOCKS * MIB)).await).await;
    assert_succeeded(&t, &a);
    let (dev1, tx1) = (device_bytes(&a, &l.a[1]), tx_bytes(&l.a_net[1]));
    println!("after {} came back: {} moved {} bytes ({} tx {} bytes)", l.a_net[1], l.a[1], dev1 - dev0, l.a_net[1], tx1 - tx0);
    assert_blocks(&b, "dst", &base, BLOCKS).await;
    assert!(dev1 > dev0, "{} not used again after {} came back: {}", l.a[1], l.a_net[1], scrape(&a));
    assert!(tx1 - tx0 > 16 * MIB, "{} carried only {} bytes after it came back", l.a_net[1], tx1 - tx0);
}

/// Both links down: the transfer fails with a code, not a hang.
#[tokio::test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn both_links_down_fail_the_transfer_with_a_code() {
    let l = links();
    let (a, b) = agents(&l);
    const BLOCKS: u64 = FAILOVER_BLOCKS;
    let base = region(&a, "src", BLOCKS, Some(41)).await;
    region(&b, "dst", BLOCKS, None).await;
    let mut downed = Downed::new();
    let before = tx_bytes(&l.a_net[1]);
    let id = submit(&a, req(pb::Op::Write, "src", &b, "dst", BLOCKS * MIB)).await;
    wait_moving_on(&a, &id, &l.a_net[1], before).await;
    let t0 = Instant::now();
    downed.down(&l.a_net[0]);
    downed.down(&l.a_net[1]);
    let t = finish(&a, &id).await;
    println!("both links down: {:?} after {:.1} s: {} ({})", t.state, t0.elapsed().as_secs_f64(), t.error_code, t.error);
    assert_eq!(t.state, pb::TransferState::Failed as i32, "{t:?}");
    assert!(!t.error_code.is_empty() && t.error_code != "INTERNAL", "no clear code: {t:?}");
    assert!(!t.error.is_empty(), "{t:?}");
    downed.restore();
    // The agents work again once the links are back.
    assert_succeeded(&finish(&a, &submit(&a, req(pb::Op::Write, "src", &b, "dst", 16 * MIB)).await).await, &a);
    assert_blocks(&b, "dst", &base, 16).await;
    // The responder did not die either.
    assert!(b.client().await.get_info(pb::GetInfoRequest {}).await.is_ok());
}
