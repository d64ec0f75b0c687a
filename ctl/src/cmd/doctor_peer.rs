//! `xferctl doctor --peer B`: every local × remote device pair, with a verdict and a fix.
//!
//! Asks both agents `GetInfo` (each device's port state, link layer, MTU and the IPv4 address
//! and prefix of its selected GID), runs the reachability test the responder runs in
//! `Peer.Connect` (`xfer_engine::reach`) on every pair, and probes the connection the local
//! agent makes to B with a short per-path benchmark (`Agent.Bench` with `per_path`: each path
//! alone, bandwidth and latency). A pair is `ok` when the connection has a path on it and the
//! probe worked there; `reachable, unused` when it could carry a path but a connection pairs
//! each device once and this one went elsewhere; `unreachable` with the reason (a port down,
//! link layers that differ, not one subnet); `failed` when the path exists and its probe failed.
//! On tcp agents there are no devices: one row, the link probed as one path.

use anyhow::Context;
use serde_json::{json, Value};
use xfer_client::{AgentInfo, BenchSpec, Device, Fabric, Op, PathProbe};
use xfer_engine::reach::{reaches, RailFacts, Reach};

use crate::view::{selected_ipv4_text, Table};
use crate::Ctx;

/// The probe's message size: long enough to see a path's bandwidth, short enough for a doctor.
const PROBE_SIZE: u64 = 1 << 20;
/// Messages per path in the bandwidth phase (and latency samples).
const PROBE_ITERS: u32 = 16;

/// The fix when the probe could not run at all.
const PROBE_FIX: &str =
    "make sure the local agent can connect to the peer (`xferctl connect --peer`) and that you may run benchmarks (admin)";

/// What a device pair is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairVerdict {
    /// In the connection, and the probe worked on it.
    Ok,
    /// Could carry a path; the connection paired these devices elsewhere.
    Unused,
    /// Cannot carry a path.
    Unreachable,
    /// In the connection, but the probe failed on it (or could not run).
    Failed,
}

impl PairVerdict {
    pub fn text(self) -> &'static str {
        match self {
            PairVerdict::Ok => "ok",
            PairVerdict::Unused => "reachable, unused",
            PairVerdict::Unreachable => "unreachable",
            PairVerdict::Failed => "failed",
        }
    }
}

/// One row of the matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    /// Empty on tcp.
    pub local: String,
    pub remote: String,
    pub verdict: PairVerdict,
    /// The measurement, or why not.
    pub detail: String,
    pub fix: Option<String>,
    /// The path's numbers when it was probed.
    pub gbit_per_s: Option<f64>,
    pub lat_p50_us: Option<f64>,
    pub mtu: Option<u32>,
}

impl Pair {
    /// A row with no detail, fix or numbers yet.
    fn new(local: &str, remote: &str, verdict: PairVerdict) -> Pair {
        Pair {
            local: local.into(),
            remote: remote.into(),
            verdict,
            detail: String::new(),
            fix: None,
            gbit_per_s: None,
            lat_p50_us: None,
            mtu: None,
        }
    }
}

/// The probe's outcome as the matrix needs it: each path's result, or why there are none.
pub type Probe = Result<Vec<PathProbe>, String>;

pub async fn run(peer: &str, ctx: &Ctx) -> anyhow::Result<()> {
    let client = ctx.client().await?;
    let local = client.info().await.with_context(|| format!("GetInfo on {}", ctx.agent))?;
    let remote_client = ctx.connect(peer).await?;
    let remote = remote_client.info().await.with_context(|| format!("GetInfo on {peer}"))?;
    let spec = BenchSpec {
        peer: peer.to_string(),
        op: Op::Write,
        size: PROBE_SIZE,
        iters: PROBE_ITERS,
        qps: 1,
        depth: 4,
        per_path: true,
        ..Default::default()
    };
    let probe: Probe = match client.bench(&spec).await {
        Ok(r) => Ok(r.paths),
        Err(e) => Err(crate::error::report(&anyhow::Error::new(e)).1),
    };
    let pairs = matrix(&local, &remote, &probe);
    let ok = pairs.iter().any(|p| p.verdict == PairVerdict::Ok);
    if ctx.json {
        ctx.print_json(&matrix_json(&ctx.agent, peer, &pairs))?;
    } else {
        ctx.print(&render(&ctx.agent, peer, &pairs))?;
    }
    if !ok {
        anyhow::bail!("doctor: no device pair between {} and {peer} works", ctx.agent);
    }
    Ok(())
}

/// Every local × remote device pair, local devices in the agent's order.
pub fn matrix(local: &AgentInfo, remote: &AgentInfo, probe: &Probe) -> Vec<Pair> {
    let tcp = |i: &AgentInfo| i.fabric != Fabric::Verbs || i.devices.is_empty();
    if tcp(local) || tcp(remote) {
        return vec![tcp_row(local, remote, probe)];
    }
    let paths: &[PathProbe] = probe.as_deref().unwrap_or(&[]);
    let mut out = Vec::with_capacity(local.devices.len() * remote.devices.len());
    for l in &local.devices {
        for r in &remote.devices {
            out.push(pair(l, r, paths, probe.as_ref().err()));
        }
    }
    out
}

/// One pair of devices.
fn pair(l: &Device, r: &Device, paths: &[PathProbe], probe_error: Option<&String>) -> Pair {
    let mut p = Pair::new(&l.name, &r.name, PairVerdict::Unreachable);
    if let Some(why) = unreachable(l, r) {
        p.detail = why.0;
        p.fix = Some(why.1);
        return p;
    }
    let path_mtu = l.active_mtu.min(r.active_mtu);
    if let Some(path) = paths.iter().find(|x| x.local_device == l.name && x.remote_device == r.name) {
        let mtu = if path.mtu > 0 { path.mtu } else { path_mtu };
        p.mtu = Some(mtu);
        match &path.error {
            None => {
                p.verdict = PairVerdict::Ok;
                p.gbit_per_s = Some(path.gbit_per_s);
                p.lat_p50_us = Some(path.lat_p50_us);
                p.detail = format!("{:.2} Gb/s, p50 {:.1} µs, MTU {mtu}", path.gbit_per_s, path.lat_p50_us);
            }
            Some(e) => {
                p.verdict = PairVerdict::Failed;
                p.detail = format!("in the connection, but the probe failed: {e}");
                p.fix = Some(format!("check the link between {} and {} (cables, switch ports, `ip link`, `rdma link`)", l.name, r.name));
            }
        }
        return p;
    }
    if let Some(e) = probe_error {
        p.verdict = PairVerdict::Failed;
        p.detail = format!("reachable, but the probe could not run: {e}");
        p.fix = Some(PROBE_FIX.into());
        return p;
    }
    p.verdict = PairVerdict::Unused;
    let l_elsewhere = paths.iter().find(|x| x.local_device == l.name).map(|x| x.remote_device.as_str());
    let r_elsewhere = paths.iter().find(|x| x.remote_device == r.name).map(|x| x.local_device.as_str());
    p.detail = match (l_elsewhere, r_elsewhere) {
        (Some(other), _) => format!("each device pairs once per connection: {} carries the path to {other}", l.name),
        (None, Some(other)) => format!("each device pairs once per connection: {} carries the path from {other}", r.name),
        (None, None) => "could carry a path, but the connection left both devices out".into(),
    };
    if l_elsewhere.is_none() && r_elsewhere.is_none() {
        p.fix = Some(format!(
            "see `xferctl info` on both agents: {} or {} may be held back or was down when the connection was made",
            l.name, r.name
        ));
    }
    p
}

/// Why two devices cannot carry a path, and what would fix it; `None` when they can (or may).
fn unreachable(l: &Device, r: &Device) -> Option<(String, String)> {
    for (d, side) in [(l, "local"), (r, "remote")] {
        if d.state != "ACTIVE" {
            return Some((
                format!(
                    "port down: {side} {} port {} is {}",
                    d.name,
                    d.port,
                    if d.state.is_empty() { "in an unknown state" } else { &d.state }
                ),
                format!(
                    "bring {}'s port up (its link: `ip link set {} up`, cable, switch port)",
                    d.name,
                    d.netdev.as_deref().unwrap_or("<netdev>")
                ),
            ));
        }
    }
    if l.link_layer != r.link_layer {
        return Some((
            format!("link layers differ: {} is {}, {} is {}", l.name, l.link_layer, r.name, r.link_layer),
            format!("pair devices of one link layer: list only matching devices in verbs.devices (leave {} or {} out)", l.name, r.name),
        ));
    }
    match reaches(&facts(l), &facts(r)) {
        Reach::No if l.link_layer == xfer_engine::reach::LINK_INFINIBAND => Some((
            format!("not one InfiniBand subnet: {} and {} have different GID subnet prefixes", l.name, r.name),
            format!("put {} and {} on one fabric subnet, or list only matching devices in verbs.devices", l.name, r.name),
        )),
        Reach::No => Some((
            format!("not one IPv4 subnet: {} {} vs {} {}", l.name, address(l), r.name, address(r)),
            format!("put {} and {} on one subnet, or list only matching devices in verbs.devices", l.name, r.name),
        )),
        Reach::Maybe | Reach::Yes => None,
    }
}

fn address(d: &Device) -> String {
    selected_ipv4_text(d).unwrap_or_else(|| "(no IPv4 GID)".into())
}

/// What the matching knows of a device, from `GetInfo`: its selected GID and that GID's prefix.
fn facts(d: &Device) -> RailFacts {
    let gid = d
        .gids
        .iter()
        .find(|g| Some(g.index) == d.selected_gid_index)
        .and_then(|g| <[u8; 16]>::try_from(g.raw.as_slice()).ok())
        .unwrap_or([0; 16]);
    RailFacts { device: d.name.clone(), link_layer: d.link_layer.clone(), gid, ipv4_prefix: d.ipv4_prefix.map_or(0, u32::from) }
}

/// A tcp agent (or a pair of agents on different fabrics): one row.
fn tcp_row(local: &AgentInfo, remote: &AgentInfo, probe: &Probe) -> Pair {
    let mut p = Pair::new("", "", PairVerdict::Failed);
    if local.fabric != remote.fabric {
        p.verdict = PairVerdict::Unreachable;
        p.detail = format!("fabrics differ: this agent runs {}, the peer {}", local.fabric, remote.fabric);
        p.fix = Some("run both agents on one fabric (`fabric = verbs` on both with RDMA devices, else tcp on both)".into());
        return p;
    }
    match probe {
        Ok(paths) => match paths.first() {
            Some(path) if path.error.is_none() => {
                p.verdict = PairVerdict::Ok;
                p.gbit_per_s = Some(path.gbit_per_s);
                p.lat_p50_us = Some(path.lat_p50_us);
                p.detail = format!("tcp: no devices; {:.2} Gb/s, p50 {:.1} µs", path.gbit_per_s, path.lat_p50_us);
            }
            Some(path) => {
                p.detail = format!("tcp: no devices; the probe failed: {}", path.error.as_deref().unwrap_or_default());
                p.fix = Some("check the network between the hosts and the peer's data listener (`xferctl info`: data address)".into());
            }
            None => {
                p.detail = "tcp: no devices; the probe reported no path".into();
                p.fix = Some("upgrade the local agent: it does not know the per-path probe".into());
            }
        },
        Err(e) => {
            p.detail = format!("tcp: no devices; the probe could not run: {e}");
            p.fix = Some(PROBE_FIX.into());
        }
    }
    p
}

/// The matrix as text: one row per pair, the fixes below it.
pub fn render(agent: &str, peer: &str, pairs: &[Pair]) -> String {
    let mut t = Table::new(&["LOCAL", "REMOTE", "VERDICT", "DETAIL"]);
    let name = |s: &str| if s.is_empty() { "-".to_string() } else { s.to_string() };
    for p in pairs {
        t.row(vec![name(&p.local), name(&p.remote), p.verdict.text().into(), p.detail.clone()]);
    }
    let mut out = format!("device pairs from {agent} to {peer}:\n");
    for line in t.render().lines() {
        out.push_str(&format!("  {line}\n"));
    }
    let fixes: Vec<&Pair> = pairs.iter().filter(|p| p.verdict != PairVerdict::Ok && p.fix.is_some()).collect();
    if !fixes.is_empty() {
        out.push_str("fixes:\n");
        for p in fixes {
            out.push_str(&format!("  {} → {}: {}\n", name(&p.local), name(&p.remote), p.fix.as_deref().unwrap_or_default()));
        }
    }
    let ok = pairs.iter().filter(|p| p.verdict == PairVerdict::Ok).count();
    out.push_str(&format!("{ok} of {} pair(s) ok\n", pairs.len()));
    out
}

/// The same matrix for `--json`.
pub fn matrix_json(agent: &str, peer: &str, pairs: &[Pair]) -> Value {
    json!({
        "agent": agent,
        "peer": peer,
        "ok": pairs.iter().any(|p| p.verdict == PairVerdict::Ok),
        "pairs": pairs.iter().map(|p| json!({
            "local_device": p.local,
            "remote_device": p.remote,
            "verdict": p.verdict.text(),
            "detail": p.detail,
            "fix": p.fix,
            "gbit_per_s": p.gbit_per_s,
            "lat_p50_us": p.lat_p50_us,
            "mtu": p.mtu,
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use xfer_client::Gid;

    fn dev(name: &str, ip: [u8; 4], prefix: u8) -> Device {
        let mut raw = vec![0u8; 10];
        raw.extend([0xff, 0xff]);
        raw.extend(ip);
        Device {
            name: name.into(),
            port: 1,
            state: "ACTIVE".into(),
            link_layer: "Ethernet".into(),
            active_mtu: 4096,
            gids: vec![Gid { index: 1, raw, kind: "RoCEv2".into(), netdev: format!("veth-{name}") }],
            selected_gid_index: Some(1),
            netdev: Some(format!("veth-{name}")),
            ipv4_prefix: Some(prefix),
            ..Default::default()
        }
    }

    fn verbs(devices: Vec<Device>) -> AgentInfo {
        AgentInfo { fabric: Fabric::Verbs, devices, ..Default::default() }
    }

    fn path(local: &str, remote: &str, gbit: f64) -> PathProbe {
        PathProbe { local_device: local.into(), remote_device: remote.into(), mtu: 0, gbit_per_s: gbit, lat_p50_us: 12.5, error: None }
    }

    fn find<'a>(pairs: &'a [Pair], l: &str, r: &str) -> &'a Pair {
        pairs.iter().find(|p| p.local == l && p.remote == r).unwrap_or_else(|| panic!("no row {l} → {r}"))
    }

    /// The two-link VM: A on rxe0 + rxe2, B on rxe1 + rxe3, each link its own /24.
    fn two_subnets() -> (AgentInfo, AgentInfo) {
        (
            verbs(vec![dev("rxe0", [10, 0, 0, 1], 24), dev("rxe2", [10, 0, 1, 1], 24)]),
            verbs(vec![dev("rxe1", [10, 0, 0, 2], 24), dev("rxe3", [10, 0, 1, 2], 24)]),
        )
    }

    #[test]
    fn two_by_two_on_two_subnets_gives_two_ok_pairs_and_two_unreachable() {
        let (a, mut b) = two_subnets();
        b.devices[1].active_mtu = 1024;
        let pairs = matrix(&a, &b, &Ok(vec![path("rxe0", "rxe1", 1.5), path("rxe2", "rxe3", 0.75)]));
        assert_eq!(pairs.len(), 4);
        let ok = find(&pairs, "rxe0", "rxe1");
        assert_eq!((ok.verdict, ok.gbit_per_s, ok.lat_p50_us, ok.mtu), (PairVerdict::Ok, Some(1.5), Some(12.5), Some(4096)));
        assert_eq!(ok.fix, None);
        // The path MTU is the smaller port's when the agent does not report one.
        assert_eq!(find(&pairs, "rxe2", "rxe3").mtu, Some(1024));
        // The MTU the path negotiated wins when the agent reports it (a port's active MTU can
        // be larger than what its QPs agreed on), in the matrix and its detail.
        let negotiated = PathProbe { mtu: 2048, ..path("rxe0", "rxe1", 1.5) };
        let pairs = matrix(&a, &b, &Ok(vec![negotiated]));
        let ok = find(&pairs, "rxe0", "rxe1");
        assert_eq!(ok.mtu, Some(2048));
        assert!(ok.detail.ends_with("MTU 2048"), "{}", ok.detail);
        for (l, r) in [("rxe0", "rxe3"), ("rxe2", "rxe1")] {
            let p = find(&pairs, l, r);
            assert_eq!(p.verdict, PairVerdict::Unreachable, "{l} → {r}");
            assert!(p.detail.starts_with("not one IPv4 subnet"), "{}", p.detail);
            assert!(p.detail.contains("10.0.") && p.detail.contains("/24"), "{}", p.detail);
            assert_eq!(
                p.fix.as_deref(),
                Some(format!("put {l} and {r} on one subnet, or list only matching devices in verbs.devices").as_str())
            );
        }
    }

    #[test]
    fn two_by_two_on_one_subnet_leaves_the_crossed_pairs_reachable_but_unused() {
        let a = verbs(vec![dev("rxe0", [10, 0, 0, 1], 16), dev("rxe2", [10, 0, 1, 1], 16)]);
        let b = verbs(vec![dev("rxe1", [10, 0, 0, 2], 16), dev("rxe3", [10, 0, 1, 2], 16)]);
        let pairs = matrix(&a, &b, &Ok(vec![path("rxe0", "rxe1", 1.0), path("rxe2", "rxe3", 1.0)]));
        assert_eq!(pairs.iter().filter(|p| p.verdict == PairVerdict::Ok).count(), 2);
        let unused = find(&pairs, "rxe0", "rxe3");
        assert_eq!(unused.verdict, PairVerdict::Unused);
        assert_eq!(unused.detail, "each device pairs once per connection: rxe0 carries the path to rxe1");
        assert_eq!(unused.fix, None, "nothing to fix: the devices are busy on other paths");
        assert_eq!(find(&pairs, "rxe2", "rxe1").verdict, PairVerdict::Unused);
    }

    #[test]
    fn a_port_down_is_unreachable_with_its_fix() {
        let (a, mut b) = two_subnets();
        b.devices[1].state = "DOWN".into();
        let pairs = matrix(&a, &b, &Ok(vec![path("rxe0", "rxe1", 1.0)]));
        for l in ["rxe0", "rxe2"] {
            let p = find(&pairs, l, "rxe3");
            assert_eq!(p.verdict, PairVerdict::Unreachable);
            assert_eq!(p.detail, "port down: remote rxe3 port 1 is DOWN");
            assert_eq!(p.fix.as_deref(), Some("bring rxe3's port up (its link: `ip link set veth-rxe3 up`, cable, switch port)"));
        }
        assert_eq!(find(&pairs, "rxe0", "rxe1").verdict, PairVerdict::Ok);
        assert_eq!(find(&pairs, "rxe2", "rxe1").verdict, PairVerdict::Unreachable, "another subnet");
    }

    #[test]
    fn mixed_link_layers_never_pair() {
        let mut ib = dev("mlx5_0", [0; 4], 0);
        ib.link_layer = "InfiniBand".into();
        ib.ipv4_prefix = None;
        let a = verbs(vec![ib, dev("rxe0", [10, 0, 0, 1], 24)]);
        let b = verbs(vec![dev("rxe1", [10, 0, 0, 2], 24)]);
        let pairs = matrix(&a, &b, &Ok(vec![path("rxe0", "rxe1", 1.0)]));
        let p = find(&pairs, "mlx5_0", "rxe1");
        assert_eq!(p.verdict, PairVerdict::Unreachable);
        assert_eq!(p.detail, "link layers differ: mlx5_0 is InfiniBand, rxe1 is Ethernet");
        assert!(p.fix.as_deref().is_some_and(|f| f.contains("verbs.devices")));
        assert_eq!(find(&pairs, "rxe0", "rxe1").verdict, PairVerdict::Ok);
    }

    #[test]
    fn a_path_whose_probe_failed_is_failed_and_a_probe_that_could_not_run_fails_every_reachable_pair() {
        let (a, b) = two_subnets();
        let mut bad = path("rxe2", "rxe3", 0.0);
        bad.error = Some("bandwidth phase: the path went down".into());
        let pairs = matrix(&a, &b, &Ok(vec![path("rxe0", "rxe1", 1.0), bad]));
        let p = find(&pairs, "rxe2", "rxe3");
        assert_eq!(p.verdict, PairVerdict::Failed);
        assert!(p.detail.contains("the path went down") && p.fix.is_some(), "{p:?}");

        let pairs = matrix(&a, &b, &Err("PERMISSION_DENIED: admin only".into()));
        assert!(pairs.iter().all(|p| p.verdict != PairVerdict::Ok));
        assert_eq!(find(&pairs, "rxe0", "rxe1").verdict, PairVerdict::Failed);
        assert!(find(&pairs, "rxe0", "rxe1").detail.contains("admin only"));
        assert_eq!(find(&pairs, "rxe0", "rxe3").verdict, PairVerdict::Unreachable, "still unreachable, probe or not");
    }

    #[test]
    fn tcp_agents_give_one_row_probed_as_one_path() {
        let tcp = AgentInfo { fabric: Fabric::Tcp, ..Default::default() };
        let pairs = matrix(&tcp, &tcp, &Ok(vec![path("", "", 3.0)]));
        assert_eq!(pairs.len(), 1);
        assert_eq!(pairs[0].verdict, PairVerdict::Ok);
        assert!(pairs[0].detail.starts_with("tcp: no devices; 3.00 Gb/s"), "{}", pairs[0].detail);
        let text = render("a:1", "b:2", &pairs);
        assert!(text.contains("-      -       ok"), "{text}");
        assert!(text.ends_with("1 of 1 pair(s) ok\n"), "{text}");

        let (verbs_side, _) = two_subnets();
        let mixed = matrix(&verbs_side, &tcp, &Err("refused".into()));
        assert_eq!(mixed.len(), 1);
        assert_eq!(mixed[0].verdict, PairVerdict::Unreachable);
        assert!(mixed[0].detail.starts_with("fabrics differ"), "{}", mixed[0].detail);
    }

    #[test]
    fn the_text_lists_every_pair_then_the_fixes_and_json_says_the_same() {
        let (a, b) = two_subnets();
        let pairs = matrix(&a, &b, &Ok(vec![path("rxe0", "rxe1", 1.5), path("rxe2", "rxe3", 1.5)]));
        let text = render("a:1", "b:2", &pairs);
        assert!(text.starts_with("device pairs from a:1 to b:2:\n  LOCAL  REMOTE  VERDICT      DETAIL\n"), "{text}");
        assert!(text.contains("  rxe0   rxe1    ok           1.50 Gb/s, p50 12.5 µs, MTU 4096\n"), "{text}");
        assert!(text.contains("fixes:\n  rxe0 → rxe3: put rxe0 and rxe3 on one subnet"), "{text}");
        assert!(text.ends_with("2 of 4 pair(s) ok\n"), "{text}");
        let v = matrix_json("a:1", "b:2", &pairs);
        assert_eq!(v["ok"], true);
        let rows = v["pairs"].as_array().unwrap();
        assert_eq!(rows.len(), 4);
        let verdicts: Vec<&str> = rows.iter().map(|r| r["verdict"].as_str().unwrap()).collect();
        assert_eq!(verdicts, ["ok", "unreachable", "unreachable", "ok"]);
        assert_eq!(rows[0]["mtu"], 4096);
        assert_eq!(rows[1]["fix"], "put rxe0 and rxe3 on one subnet, or list only matching devices in verbs.devices");
    }
}
