//! The two-link harness of the device tests (`multi_rail`, `fallback`): two links per node on
//! Soft-RoCE, A on `rxe0,rxe2` and B on `rxe1,rxe3` (`verbs.devices`), each device pair on its
//! own veth pair and subnet (`scripts/rxe-vm`); real agents on both, regions of verifiable
//! MiB blocks, transfers followed to their end, and links taken down mid-transfer.
//!
//! Links are flipped with `scripts/rxe-link` (`ip link set … down`; `up` restores the policy
//! route and neighbours `down` flushed and waits for the rxe ports to be ACTIVE). "Mid-transfer"
//! means: the transfer was submitted, its progress shows bytes moving on the link about to go
//! down, and it has bytes left ([`down_mid_transfer`]); the links it took down come back up
//! also when a test fails.
#![cfg(feature = "verbs")]

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use xfer_proto::v1 as pb;

use crate::common::{labelled, metric, random_bytes, scrape, Agent};

pub(crate) const MIB: u64 = 1 << 20;
/// A hang guard for one transfer under TCG (two emulated links share two vCPUs: tens of MiB/s),
/// not a performance bound.
pub(crate) const TRANSFER_GUARD: Duration = Duration::from_secs(900);

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

/// Agents A and B, each on both of its devices, named `names`, with `env` more (e.g. the tcp
/// fallback).
pub(crate) fn agents(l: &Links, names: [&str; 2], env: &[(&str, &str)]) -> (Agent, Agent) {
    let start = |name: &str, devices: &[String; 2]| {
        let devices = devices.join(",");
        let mut all = vec![("XFER_VERBS__DEVICES", devices.as_str())];
        all.extend_from_slice(env);
        Agent::start_fabric(name, "verbs", &all)
    };
    (start(names[0], &l.a), start(names[1], &l.b))
}

fn rxe_link(cmd: &str, netdev: &str) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/rxe-link");
    let out = Command::new(script).args([cmd, netdev]).output().unwrap();
    assert!(out.status.success(), "rxe-link {cmd} {netdev}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Links taken down by a test; every one is brought back up when this is dropped.
struct Downed(Vec<String>);

impl Downed {
    fn new() -> Downed {
        Downed(Vec::new())
    }

    fn down(&mut self, netdev: &str) {
        self.0.push(netdev.to_string());
        rxe_link("down", netdev);
    }

    /// Brings every downed link back and waits until its ports are ACTIVE.
    fn restore(&mut self) {
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
                other => eprintln!("device tests: could not bring {n} back up: {other:?}"),
            }
        }
    }
}

/// Links taken down before the agents start (a cable plugged in later). They come back with
/// [`DownAtStart::restore`] (which waits for their ports), or when this is dropped.
pub(crate) struct DownAtStart(Downed);

impl DownAtStart {
    pub(crate) fn restore(mut self) {
        self.0.restore();
    }
}

/// Takes `netdevs` down now; see [`DownAtStart`].
pub(crate) fn down_at_start(netdevs: &[&str]) -> DownAtStart {
    let mut downed = Downed::new();
    for n in netdevs {
        downed.down(n);
    }
    DownAtStart(downed)
}

/// The port state (`ACTIVE`, `DOWN`, ...) `a`'s GetInfo reports for `device`.
pub(crate) async fn device_state(a: &Agent, device: &str) -> String {
    let info = a.client().await.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    let d = info.devices.iter().find(|d| d.name == device).unwrap_or_else(|| panic!("{} does not list {device}: {info:?}", a.name));
    d.state.clone()
}

pub(crate) fn tx_bytes(netdev: &str) -> u64 {
    std::fs::read_to_string(format!("/sys/class/net/{netdev}/statistics/tx_bytes")).unwrap().trim().parse().unwrap()
}

/// Bytes agent `a` moved through `device` (`xfer_device_bytes_total{device}`).
pub(crate) fn device_bytes(a: &Agent, device: &str) -> f64 {
    labelled(&scrape(a), "xfer_device_bytes_total", &[("device", device)])
}

pub(crate) fn failovers(a: &Agent) -> f64 {
    metric(&scrape(a), "xfer_path_failovers_total")
}

/// MiB block `i` of a region filled by [`fill`] from `base`: `base` rotated by a distinct amount
/// per block, so a block that landed at the wrong place or not at all does not compare equal.
pub(crate) fn block(base: &[u8], i: u64) -> Vec<u8> {
    let r = (i as usize * 7919 + 1) % base.len();
    let mut v = Vec::with_capacity(base.len());
    v.extend_from_slice(&base[r..]);
    v.extend_from_slice(&base[..r]);
    v
}

/// The file behind region `name` of `a`: every region of these tests is a FILE region under the
/// agent's default file root (`<state_dir>/files`), a `MAP_SHARED` mapping of a file on the
/// VM's tmpfs that the NIC reads and writes in place. The tests fill and check it through the
/// file itself: streaming a GiB through a debug agent's gRPC under TCG took minutes each way
/// (three quarters of a failover test), and the bytes compared are the region's own pages.
pub(crate) fn region_file(a: &Agent, name: &str) -> PathBuf {
    a.state_dir.join("files").join(name)
}

/// Creates region `name` of `blocks` MiB on `a` ([`region_file`]); with `seed`, fills it with
/// [`block`]s of a random MiB made from `seed` (zeros without). Returns that MiB, the `base` of
/// [`assert_blocks`].
pub(crate) async fn region(a: &Agent, name: &str, blocks: u64, seed: Option<u64>) -> Arc<Vec<u8>> {
    let base = Arc::new(random_bytes(MIB as usize, seed.unwrap_or(1)));
    let path = region_file(a, name);
    std::fs::create_dir_all(path.parent().expect("a file under the root")).unwrap();
    let mut f = std::fs::File::create(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if seed.is_some() {
        for i in 0..blocks {
            f.write_all(&block(&base, i)).unwrap();
        }
    } else {
        f.set_len(blocks * MIB).unwrap();
    }
    drop(f);
    let req = pb::CreateRegionRequest {
        name: name.into(),
        length: blocks * MIB,
        kind: pb::RegionKind::File as i32,
        path: name.into(),
        access: pb::Access::ReadWrite as i32,
        ..Default::default()
    };
    a.client().await.create_region(req).await.unwrap_or_else(|s| panic!("create {name}: {s}"));
    base
}

/// `len` bytes at `offset` of region `name` of `a`, read from its file ([`region_file`]).
pub(crate) fn read_back(a: &Agent, name: &str, offset: u64, len: u64) -> Vec<u8> {
    let f = std::fs::File::open(region_file(a, name)).unwrap();
    let mut got = vec![0u8; len as usize];
    f.read_exact_at(&mut got, offset).unwrap_or_else(|e| panic!("reading {len} bytes at {offset} of {name} on {}: {e}", a.name));
    got
}

/// Zeros the first `blocks` MiB of region `name` of `a` in place (its pages, through its file).
pub(crate) fn zero(a: &Agent, name: &str, blocks: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(region_file(a, name)).unwrap();
    let z = vec![0u8; MIB as usize];
    for i in 0..blocks {
        f.write_all_at(&z, i * MIB).unwrap();
    }
}

pub(crate) fn req(op: pb::Op, local: &str, peer: &Agent, remote: &str, len: u64) -> pb::SubmitTransferRequest {
    pb::SubmitTransferRequest {
        op: op as i32,
        local: Some(pb::LocalRange { region: local.into(), offset: 0 }),
        remote: Some(pb::RemoteRange { agent: peer.addr(), region: remote.into(), offset: 0 }),
        length: (len != 0).then_some(len),
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
async fn wait_moving_on(a: &Agent, id: &str, netdev: &str, before: u64) -> pb::Transfer {
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

/// A transfer that had links taken down while it moved bytes. The links come back up with
/// [`MidTransfer::restore`] (which waits for their ports), or when this is dropped (a test that
/// failed), so the tests after it find the topology whole.
pub(crate) struct MidTransfer {
    pub id: String,
    /// The transfer's record just before the links went down.
    pub at: pb::Transfer,
    /// When the first link went down.
    pub since: Instant,
    downed: Downed,
}

impl MidTransfer {
    /// Brings every downed link back and waits until its ports are ACTIVE.
    pub(crate) fn restore(mut self) {
        self.downed.restore();
    }
}

/// Submits `r` on `a`, waits until it moves bytes over `carrier` (the source's end of a link:
/// its tx counter; B's for a READ) with bytes left, then takes `netdevs` down: "mid-transfer".
pub(crate) async fn down_mid_transfer(a: &Agent, r: pb::SubmitTransferRequest, carrier: &str, netdevs: &[&str]) -> MidTransfer {
    let mut downed = Downed::new();
    let before = tx_bytes(carrier);
    let id = submit(a, r).await;
    let at = wait_moving_on(a, &id, carrier, before).await;
    let since = Instant::now();
    for n in netdevs {
        downed.down(n);
    }
    MidTransfer { id, at, since, downed }
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

/// The MiBs among the first `blocks` of `region` on `at` that are not [`block`]s of `base`, read
/// from its file 16 MiB at a time ([`read_back`]).
pub(crate) fn differing(at: &Agent, region: &str, base: &[u8], blocks: u64) -> Vec<u64> {
    const STEP: u64 = 16;
    let mut out = Vec::new();
    for first in (0..blocks).step_by(STEP as usize) {
        let n = STEP.min(blocks - first);
        let got = read_back(at, region, first * MIB, n * MIB);
        for (k, mib) in got.chunks(MIB as usize).enumerate() {
            let i = first + k as u64;
            if mib != block(base, i).as_slice() {
                out.push(i);
            }
        }
    }
    out
}

/// Asserts that the first `blocks` MiB of `region` on `at` are [`block`]s of `base`
/// ([`differing`]). The bytes themselves are compared (not the agents' checksums: those take
/// minutes per GiB in a debug build under TCG, past the peers' RPC timeout).
pub(crate) fn assert_blocks(at: &Agent, region: &str, base: &[u8], blocks: u64) {
    let bad = differing(at, region, base, blocks);
    assert!(bad.is_empty(), "MiBs {bad:?} of {region} on {} differ from the source", at.name);
}
