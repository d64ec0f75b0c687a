//! `xferctl doctor`: is this node ready for RDMA transfers, and if not, what to fix.
//!
//! Asks the agent (`GetInfo`: fabric choice, devices, its memlock limit and CAP_IPC_LOCK) and, when
//! the agent runs on this host, also looks at the host directly: RLIMIT_MEMLOCK and CAP_IPC_LOCK of
//! this shell, `/sys/class/infiniband` devices, port states and GID tables, `/dev/infiniband`.
//! Prints one line per check: `OK`, `WARN`, `FAIL` or `INFO`, with the fix where there is one.
//! `--peer B` asks about the device pairs between this agent and B instead ([`super::doctor_peer`]).

use std::fmt;
use std::path::Path;

use clap::Args;
use serde_json::json;
use xfer_client::{AgentInfo, Fabric};

use crate::view::{device_placement, device_table, limit_bytes};
use crate::Ctx;

/// Below this a verbs agent cannot register useful regions (containerd's default is 8 MiB).
const MEMLOCK_MIN: u64 = 64 << 20;

#[derive(Debug, Args)]
pub struct Opt {
    /// Instead of the node checks: every device pair between the agent and this peer agent
    /// (host, host:port or [v6]:port), each with a verdict, a short probe and a fix.
    #[arg(long, value_parser = crate::target::normalize_agent)]
    pub peer: Option<String>,
    /// Run the host checks even if the agent address does not look local.
    #[arg(long)]
    pub local: bool,
    /// sysfs directory of RDMA devices (for testing and unusual layouts).
    #[arg(long, default_value = "/sys/class/infiniband", hide = true)]
    pub sysfs: std::path::PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    Warn,
    Fail,
    Info,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Ok => "OK",
            Verdict::Warn => "WARN",
            Verdict::Fail => "FAIL",
            Verdict::Info => "INFO",
        })
    }
}

#[derive(Debug, Clone)]
pub struct Check {
    pub name: String,
    pub verdict: Verdict,
    pub detail: String,
    pub fix: Option<String>,
}

fn check(name: &str, verdict: Verdict, detail: impl Into<String>, fix: Option<&str>) -> Check {
    Check { name: name.to_string(), verdict, detail: detail.into(), fix: fix.map(str::to_string) }
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    if let Some(peer) = &opt.peer {
        return super::doctor_peer::run(peer, ctx).await;
    }
    let mut checks = Vec::new();
    let mut connect_error = None;
    let info = match ctx.client().await {
        Ok(client) => match client.info().await {
            Ok(info) => Some(info),
            Err(e) => {
                connect_error = Some(anyhow::Error::new(e).context("GetInfo"));
                None
            }
        },
        Err(e) => {
            connect_error = Some(e);
            None
        }
    };
    match &info {
        Some(info) => checks.extend(agent_checks(info, &ctx.agent)),
        None => {
            let line = connect_error.as_ref().map(|e| crate::error::report(e).1).unwrap_or_default();
            // An agent that answered but refused (TLS, wrong port) needs another fix than one that is down.
            let fix = if connect_error.as_ref().and_then(crate::error::connect_hint).is_some() {
                "see the message: the agent is up but this connection does not fit it"
            } else {
                "start xfer-agent, or point --agent / $XFER_AGENT at it"
            };
            checks.push(check("agent", Verdict::Fail, line, Some(fix)));
        }
    }
    let local = opt.local || is_local(&ctx.agent, info.as_ref());
    if local {
        checks.extend(host_checks(&opt.sysfs));
    } else {
        checks.push(check(
            "host",
            Verdict::Info,
            format!("agent {} is not on this host: host checks skipped (use --local to force)", ctx.agent),
            None,
        ));
    }
    let rxe = info.as_ref().map(|i| i.devices.iter().any(|d| d.name.starts_with("rxe"))).unwrap_or(false)
        || (local && list_devices(&opt.sysfs).iter().any(|d| d.starts_with("rxe")));
    checks.push(check(
        "grant mode",
        if rxe { Verdict::Warn } else { Verdict::Info },
        "`mw` grant mode is range-safe only on devices that enforce memory-window bounds — rxe does not",
        Some("use the default `mr` grant mode on rxe (Soft-RoCE) and on HCAs you have not verified"),
    ));

    let failed = checks.iter().filter(|c| c.verdict == Verdict::Fail).count();
    if ctx.json {
        ctx.print_json(&json!({
            "agent": ctx.agent,
            "ok": failed == 0,
            "checks": checks.iter().map(|c| json!({
                "name": c.name,
                "status": c.verdict.to_string(),
                "detail": c.detail,
                "fix": c.fix,
            })).collect::<Vec<_>>(),
        }))?;
    } else {
        let mut text = render(&checks);
        // Several devices: where each sits, side by side (the checks above say what is wrong).
        if let Some(devices) = info.as_ref().map(|i| &i.devices).filter(|d| d.len() > 1) {
            text.push_str("\nagent devices:\n");
            for line in device_table(devices).lines() {
                text.push_str(&format!("  {line}\n"));
            }
        }
        ctx.print(&text)?;
    }
    if let Some(e) = connect_error {
        return Err(e);
    }
    if failed > 0 {
        anyhow::bail!("doctor: {failed} check(s) failed");
    }
    Ok(())
}

pub fn render(checks: &[Check]) -> String {
    let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
    let mut out = String::new();
    for c in checks {
        out.push_str(&format!("{:<5} {:<width$}  {}", c.verdict.to_string(), c.name, c.detail));
        if let Some(fix) = &c.fix {
            if c.verdict != Verdict::Ok {
                out.push_str(&format!(" — fix: {fix}"));
            }
        }
        out.push('\n');
    }
    out
}

/// The agent counts as local when its host is a loopback address or this host's name.
fn is_local(agent: &str, info: Option<&AgentInfo>) -> bool {
    let host = match agent.rsplit_once(':') {
        Some((h, _)) => h.trim_start_matches('[').trim_end_matches(']'),
        None => agent,
    };
    if host == "localhost" {
        return true;
    }
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        if ip.is_loopback() {
            return true;
        }
    }
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default();
    !hostname.is_empty() && (host == hostname || info.is_some_and(|i| i.node_name == hostname))
}

/// Checks from the agent's own view (`GetInfo`).
pub fn agent_checks(info: &AgentInfo, addr: &str) -> Vec<Check> {
    let mut out = vec![check("agent", Verdict::Ok, format!("{addr} answers: node {}, version {}", info.node_name, info.version), None)];
    let verbs = info.fabric == Fabric::Verbs;
    out.push(if verbs {
        check("fabric", Verdict::Ok, format!("verbs ({})", info.fabric_reason), None)
    } else {
        check(
            "fabric",
            Verdict::Warn,
            format!("{} ({})", info.fabric, info.fabric_reason),
            Some("no usable RDMA device/port/GID: see the device checks; run the agent with --fabric verbs to get a hard error"),
        )
    });
    if let Some(l) = &info.limits {
        let enough = l.cap_ipc_lock || l.memlock_soft >= MEMLOCK_MIN;
        let detail = format!(
            "agent memlock soft {} / hard {}, CAP_IPC_LOCK {}",
            limit_bytes(l.memlock_soft),
            limit_bytes(l.memlock_hard),
            if l.cap_ipc_lock { "yes" } else { "no" }
        );
        out.push(check(
            "agent memlock",
            match (enough, verbs) {
                (true, _) => Verdict::Ok,
                (false, true) => Verdict::Fail,
                (false, false) => Verdict::Warn,
            },
            detail,
            Some("raise the agent's RLIMIT_MEMLOCK (systemd LimitMEMLOCK=infinity; docker --ulimit memlock=-1; Kubernetes: add the IPC_LOCK capability)"),
        ));
    }
    for d in &info.devices {
        let name = format!("agent {}/{}", d.name, d.port);
        let active = d.state.eq_ignore_ascii_case("ACTIVE") || d.state.ends_with("ACTIVE");
        let gid_ok = d.selected_gid_index.is_some() || d.link_layer.eq_ignore_ascii_case("InfiniBand");
        let detail = format!(
            "{} {} MTU {} selected GID {}; {}",
            d.state,
            d.link_layer,
            d.active_mtu,
            d.selected_gid_index.map_or_else(|| "none".to_string(), |i| i.to_string()),
            device_placement(d)
        );
        out.push(match (active, gid_ok) {
            (false, _) => check(
                &name,
                Verdict::Fail,
                detail,
                Some("port is not ACTIVE: bring its netdev up (ip link set DEV up) / check the cable and subnet manager"),
            ),
            (true, false) => {
                check(&name, Verdict::Fail, detail, Some("no usable GID: give the netdev an IP address so a RoCEv2 GID appears"))
            }
            (true, true) if d.active_mtu != 0 && d.active_mtu < 1024 => {
                check(&name, Verdict::Warn, detail, Some("small active MTU: raise the netdev MTU (RoCE uses the largest IB MTU that fits)"))
            }
            _ => check(&name, Verdict::Ok, detail, None),
        });
    }
    out
}

/// Checks of this host: limits and capabilities of this shell, RDMA devices in sysfs.
pub fn host_checks(sysfs: &Path) -> Vec<Check> {
    let mut out = Vec::new();
    let cap = std::fs::read_to_string("/proc/self/status").ok().and_then(|s| cap_ipc_lock(&s));
    match nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_MEMLOCK) {
        Ok((soft, hard)) => {
            // rlim_t is u64 on Linux; RLIM_INFINITY is u64::MAX, which limit_bytes shows as "unlimited".
            let enough = soft >= MEMLOCK_MIN || cap == Some(true);
            out.push(check(
                "host memlock",
                if enough { Verdict::Ok } else { Verdict::Warn },
                format!(
                    "this shell: soft {} / hard {}",
                    limit_bytes(soft),
                    limit_bytes(hard)
                ),
                Some("`ulimit -l unlimited` before starting the agent (or LimitMEMLOCK=infinity in its unit); at least 64 MiB plus all registered bytes"),
            ));
        }
        Err(e) => out.push(check("host memlock", Verdict::Warn, format!("getrlimit failed: {e}"), None)),
    }
    out.push(match cap {
        Some(true) => check("host CAP_IPC_LOCK", Verdict::Ok, "this shell has CAP_IPC_LOCK", None),
        Some(false) => check(
            "host CAP_IPC_LOCK",
            Verdict::Info,
            "this shell lacks CAP_IPC_LOCK (fine if the memlock limit is high enough)",
            Some("run the agent as root or with CAP_IPC_LOCK (Kubernetes: securityContext.capabilities.add: [IPC_LOCK])"),
        ),
        None => check("host CAP_IPC_LOCK", Verdict::Warn, "could not read CapEff from /proc/self/status", None),
    });

    let devices = list_devices(sysfs);
    if devices.is_empty() {
        out.push(check(
            "host devices",
            Verdict::Warn,
            format!("no RDMA devices in {}: the agent can only use the tcp fabric", sysfs.display()),
            Some("load the NIC's RDMA driver, or for Soft-RoCE: modprobe rdma_rxe && rdma link add rxe0 type rxe netdev IFACE"),
        ));
        return out;
    }
    out.push(check("host devices", Verdict::Ok, devices.join(", "), None));
    let uverbs = std::fs::read_dir("/dev/infiniband")
        .map(|rd| rd.filter_map(Result::ok).any(|e| e.file_name().to_string_lossy().starts_with("uverbs")))
        .unwrap_or(false);
    out.push(if uverbs {
        check("host /dev/infiniband", Verdict::Ok, "uverbs device nodes present", None)
    } else {
        check(
            "host /dev/infiniband",
            Verdict::Fail,
            "no /dev/infiniband/uverbs* device nodes",
            Some("modprobe ib_uverbs; in a container mount /dev/infiniband or request an rdma/… device-plugin resource"),
        )
    });
    for dev in &devices {
        for port in scan_ports(&sysfs.join(dev)) {
            out.push(port_check(dev, &port));
        }
    }
    out
}

/// Device names under the sysfs class directory, sorted.
pub fn list_devices(sysfs: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(sysfs)
        .map(|rd| rd.filter_map(Result::ok).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

/// What sysfs says about one port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortStatus {
    pub port: u32,
    /// `ACTIVE`, `DOWN`, ... (without the numeric prefix).
    pub state: String,
    pub link_layer: String,
    /// Non-zero GIDs: (index, type such as "RoCE v2", netdev).
    pub gids: Vec<(u32, String, String)>,
}

pub fn scan_ports(dev_dir: &Path) -> Vec<PortStatus> {
    let read = |p: &Path| std::fs::read_to_string(p).map(|s| s.trim().to_string()).ok();
    let mut ports: Vec<PortStatus> = std::fs::read_dir(dev_dir.join("ports"))
        .map(|rd| rd.filter_map(Result::ok).filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok()).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|port| {
            let dir = dev_dir.join("ports").join(port.to_string());
            let state = read(&dir.join("state")).map(|s| port_state(&s)).unwrap_or_else(|| "UNKNOWN".into());
            let link_layer = read(&dir.join("link_layer")).unwrap_or_default();
            let mut gids = Vec::new();
            if let Ok(rd) = std::fs::read_dir(dir.join("gids")) {
                for e in rd.filter_map(Result::ok) {
                    let Ok(index) = e.file_name().to_string_lossy().parse::<u32>() else {
                        continue;
                    };
                    let Some(gid) = read(&e.path()) else { continue };
                    if is_zero_gid(&gid) {
                        continue;
                    }
                    // Reading the type of an unused entry fails with EINVAL: skip it.
                    let Some(ty) = read(&dir.join("gid_attrs/types").join(index.to_string())) else {
                        continue;
                    };
                    let ndev = read(&dir.join("gid_attrs/ndevs").join(index.to_string())).unwrap_or_default();
                    gids.push((index, ty, ndev));
                }
            }
            gids.sort();
            PortStatus { port, state, link_layer, gids }
        })
        .collect();
    ports.sort_by_key(|p| p.port);
    ports
}

fn port_check(dev: &str, p: &PortStatus) -> Check {
    let name = format!("host {dev}/{}", p.port);
    let roce_v2: Vec<&(u32, String, String)> = p.gids.iter().filter(|(_, ty, _)| ty.eq_ignore_ascii_case("RoCE v2")).collect();
    let gid_summary = match roce_v2.first() {
        Some((i, _, ndev)) => format!("{} GIDs, first RoCE v2 GID index {i} on {ndev}", p.gids.len()),
        None => format!("{} GIDs, none RoCE v2", p.gids.len()),
    };
    let detail = format!("{} {}, {gid_summary}", p.state, p.link_layer);
    if p.state != "ACTIVE" {
        return check(
            &name,
            Verdict::Fail,
            detail,
            Some("port not ACTIVE: `ip link set IFACE up` for RoCE, check cable/subnet manager for IB"),
        );
    }
    if p.link_layer.eq_ignore_ascii_case("Ethernet") && roce_v2.is_empty() {
        return check(&name, Verdict::Fail, detail, Some("no RoCE v2 GID: assign an IPv4/IPv6 address to the port's netdev"));
    }
    check(&name, Verdict::Ok, detail, None)
}

/// `4: ACTIVE` → `ACTIVE`.
pub fn port_state(raw: &str) -> String {
    raw.split_once(':').map(|(_, s)| s).unwrap_or(raw).trim().to_string()
}

fn is_zero_gid(gid: &str) -> bool {
    gid.chars().all(|c| c == '0' || c == ':')
}

/// Whether `CapEff` in a `/proc/PID/status` text has CAP_IPC_LOCK (parsing shared with the agent).
pub fn cap_ipc_lock(status: &str) -> Option<bool> {
    xfer_common::host::has_cap(status, xfer_common::host::CAP_IPC_LOCK)
}

#[cfg(test)]
mod tests {
    use super::*;
    use xfer_client::{Device, Limits};

    #[test]
    fn cap_eff_bit_14() {
        let with = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        assert_eq!(cap_ipc_lock(with), Some(true));
        let without = "CapEff:\t0000000000000000\n";
        assert_eq!(cap_ipc_lock(without), Some(false));
        let only_ipc_lock = "CapEff:\t0000000000004000\n";
        assert_eq!(cap_ipc_lock(only_ipc_lock), Some(true));
        let bit_13 = "CapEff:\t0000000000002000\n";
        assert_eq!(cap_ipc_lock(bit_13), Some(false));
        assert_eq!(cap_ipc_lock("Name: x\n"), None);
        assert_eq!(cap_ipc_lock("CapEff:\tzz\n"), None);
    }

    #[test]
    fn port_states() {
        assert_eq!(port_state("4: ACTIVE"), "ACTIVE");
        assert_eq!(port_state("1: DOWN"), "DOWN");
        assert_eq!(port_state("ACTIVE"), "ACTIVE");
    }

    fn write(p: &Path, s: &str) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, s).unwrap();
    }

    #[test]
    fn sysfs_scan() {
        let dir = tempfile::tempdir().unwrap();
        let port = dir.path().join("rxe0/ports/1");
        write(&port.join("state"), "4: ACTIVE\n");
        write(&port.join("link_layer"), "Ethernet\n");
        write(&port.join("gids/0"), "fe80:0000:0000:0000:0000:0000:0000:0001\n");
        write(&port.join("gid_attrs/types/0"), "IB/RoCE v1\n");
        write(&port.join("gid_attrs/ndevs/0"), "eth0\n");
        write(&port.join("gids/1"), "0000:0000:0000:0000:0000:ffff:0a00:0001\n");
        write(&port.join("gid_attrs/types/1"), "RoCE v2\n");
        write(&port.join("gid_attrs/ndevs/1"), "eth0\n");
        write(&port.join("gids/2"), "0000:0000:0000:0000:0000:0000:0000:0000\n");
        let down = dir.path().join("mlx5_0/ports/1");
        write(&down.join("state"), "1: DOWN\n");
        write(&down.join("link_layer"), "Ethernet\n");

        assert_eq!(list_devices(dir.path()), ["mlx5_0", "rxe0"]);
        let ports = scan_ports(&dir.path().join("rxe0"));
        assert_eq!(ports.len(), 1);
        assert_eq!(ports[0].state, "ACTIVE");
        assert_eq!(ports[0].gids, [(0, "IB/RoCE v1".to_string(), "eth0".to_string()), (1, "RoCE v2".to_string(), "eth0".to_string())]);
        let ok = port_check("rxe0", &ports[0]);
        assert_eq!(ok.verdict, Verdict::Ok, "{ok:?}");
        assert!(ok.detail.contains("RoCE v2 GID index 1 on eth0"));

        let down_ports = scan_ports(&dir.path().join("mlx5_0"));
        assert_eq!(port_check("mlx5_0", &down_ports[0]).verdict, Verdict::Fail);

        let mut no_v2 = ports[0].clone();
        no_v2.gids.retain(|g| g.1 != "RoCE v2");
        let c = port_check("rxe0", &no_v2);
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(c.fix.unwrap().contains("address"));
    }

    #[test]
    fn agent_view() {
        let info = AgentInfo {
            node_name: "n1".into(),
            fabric: Fabric::Verbs,
            limits: Some(Limits { memlock_soft: 8 << 20, memlock_hard: 8 << 20, cap_ipc_lock: false, ..Default::default() }),
            devices: vec![Device {
                name: "rxe0".into(),
                port: 1,
                state: "ACTIVE".into(),
                link_layer: "Ethernet".into(),
                active_mtu: 1024,
                selected_gid_index: None,
                ..Default::default()
            }],
            ..Default::default()
        };
        let checks = agent_checks(&info, "h:1");
        let by = |n: &str| checks.iter().find(|c| c.name == n).unwrap().verdict;
        assert_eq!(by("agent"), Verdict::Ok);
        assert_eq!(by("fabric"), Verdict::Ok);
        assert_eq!(by("agent memlock"), Verdict::Fail);
        assert_eq!(by("agent rxe0/1"), Verdict::Fail);

        let mut fine = info.clone();
        fine.limits.as_mut().unwrap().cap_ipc_lock = true;
        fine.devices[0].selected_gid_index = Some(1);
        let checks = agent_checks(&fine, "h:1");
        assert!(checks.iter().all(|c| c.verdict == Verdict::Ok), "{checks:?}");
        let text = render(&checks);
        assert!(text.lines().all(|l| l.starts_with("OK ")), "{text}");

        let mut placed = fine.clone();
        let d = &mut placed.devices[0];
        (d.numa_node, d.pci_address, d.speed_mbps, d.netdev) =
            (Some(1), Some("0000:af:00.0".into()), Some(100_000), Some("ens1np0".into()));
        let checks = agent_checks(&placed, "h:1");
        let dev = checks.iter().find(|c| c.name == "agent rxe0/1").unwrap();
        assert_eq!(dev.detail, "ACTIVE Ethernet MTU 1024 selected GID 1; speed 100 Gb/s, NUMA node 1, PCI 0000:af:00.0, netdev ens1np0");
    }

    #[test]
    fn local_detection() {
        assert!(is_local("127.0.0.1:7470", None));
        assert!(is_local("[::1]:7470", None));
        assert!(is_local("localhost:1", None));
        assert!(!is_local("192.0.2.7:7470", None));
    }
}
