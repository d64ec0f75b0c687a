//! `xferctl demo`: two agents on loopback, a WRITE and a READ between them, verified.
//!
//! Steps: find `xfer-agent` (next to this executable, else on `$PATH`), start two agents on free
//! loopback ports with the tcp fabric and temporary state dirs, wait until each answers `GetInfo`,
//! create regions, fill A's with random bytes through `WriteRegion`, copy A→B with an OP_WRITE
//! initiated by A, copy B→A (a second region) with an OP_READ initiated by A (the reading side),
//! compare checksums on both agents and read the bytes back. The agents are always stopped (SIGTERM,
//! then SIGKILL after a grace period) and the temporary directory removed, on success, on error and
//! on Ctrl-C.

use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use rand::RngCore;
use serde_json::{json, Value};
use tokio::process::{Child, Command};
use xfer_client::ChecksumAlgo;

use super::cp::{self, Tuning};
use crate::client::{self, Client};
use crate::error::Failure;
use crate::progress;
use crate::target::Location;
use crate::units::{self, parse_duration, parse_size};
use crate::Ctx;

const AGENT_BIN: &str = "xfer-agent";
/// How long a stopping agent gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug, Args)]
pub struct Opt {
    /// Size of each demo region.
    #[arg(long, value_parser = parse_size, default_value = "64MiB")]
    pub size: u64,
    /// The xfer-agent binary (default: next to xferctl, then on $PATH).
    #[arg(long, env = "XFER_AGENT_BIN", value_name = "PATH")]
    pub agent_bin: Option<PathBuf>,
    /// Extra argument passed to both agents (repeatable), e.g. --agent-arg=--log-format=json.
    #[arg(long = "agent-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub agent_args: Vec<String>,
    /// How long to wait for each agent to answer GetInfo.
    #[arg(long, value_parser = parse_duration, default_value = "20s")]
    pub startup_timeout: Duration,
    /// Keep the temporary directory (agent logs and state) and print its path.
    #[arg(long)]
    pub keep: bool,
}

pub async fn run(opt: Opt, ctx: &Ctx) -> anyhow::Result<()> {
    if opt.size == 0 {
        anyhow::bail!("--size must be greater than zero");
    }
    let bin = find_agent(opt.agent_bin.as_deref())?;
    // Dropping `tmp` removes the directory; it lives until the agents are stopped below.
    let tmp = tempfile::Builder::new().prefix("xferctl-demo-").tempdir().context("creating a temporary directory")?;
    let mut report = Report::new(ctx.json);

    let mut agents: Vec<DemoAgent> = Vec::new();
    let result = tokio::select! {
        r = steps(&opt, &bin, tmp.path(), &mut agents, &mut report) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    for agent in &mut agents {
        agent.stop().await;
    }
    if result.is_err() {
        for agent in &agents {
            agent.print_log_tail();
        }
    }
    if opt.keep {
        let kept = tmp.keep();
        report.line(&format!("kept {} (agent logs and state)", kept.display()));
    } else {
        let path = tmp.path().to_path_buf();
        tmp.close().with_context(|| format!("removing {}", path.display()))?;
    }
    result?;
    if ctx.json {
        ctx.print_json(&json!({"ok": true, "size": crate::view::u64s(opt.size), "steps": report.steps}))?;
    }
    Ok(())
}

/// Collects per-step results; prints them as text unless `--json`.
struct Report {
    json: bool,
    steps: Vec<Value>,
}

impl Report {
    fn new(json: bool) -> Self {
        Report { json, steps: Vec::new() }
    }

    fn line(&self, text: &str) {
        if !self.json {
            println!("{text}");
        }
    }

    fn rate(&mut self, step: &str, what: &str, bytes: u64, seconds: f64) {
        self.line(&format!("{what}: {}", units::rate_summary(bytes, seconds)));
        self.steps.push(json!({
            "step": step,
            "bytes": crate::view::u64s(bytes),
            "seconds": seconds,
            "gib_per_s": units::gib_per_s(bytes, seconds),
        }));
    }
}

async fn steps(opt: &Opt, bin: &Path, tmp: &Path, agents: &mut Vec<DemoAgent>, report: &mut Report) -> anyhow::Result<()> {
    let size = opt.size;
    let ports = free_ports(6)?;
    for (i, name) in ["demo-a", "demo-b"].into_iter().enumerate() {
        let p = &ports[i * 3..i * 3 + 3];
        let agent = DemoAgent::spawn(bin, name, [p[0], p[1], p[2]], tmp, &opt.agent_args)?;
        report.line(&format!(
            "started {name} (pid {}) on {} (metrics 127.0.0.1:{}, data 127.0.0.1:{})",
            agent.pid.unwrap_or(0),
            agent.addr,
            p[1],
            p[2]
        ));
        agents.push(agent);
    }
    let mut clients = Vec::new();
    for agent in agents.iter_mut() {
        let started = Instant::now();
        let (client, fabric) = agent.wait_ready(opt.startup_timeout).await?;
        report.line(&format!("{} ready in {:.2} s (fabric {fabric})", agent.name, started.elapsed().as_secs_f64()));
        clients.push(client);
    }
    let (a_addr, b_addr) = (agents[0].addr.clone(), agents[1].addr.clone());
    // Clones share the underlying HTTP/2 connection.
    let (a, b) = match <[Client; 2]>::try_from(clients) {
        Ok([a, b]) => (a, b),
        Err(_) => anyhow::bail!("internal error: expected two agents"),
    };

    for (client, agent, region) in [(a.clone(), &a_addr, "demo-src"), (b.clone(), &b_addr, "demo-dst"), (a.clone(), &a_addr, "demo-back")] {
        client.create_region(region, size).await.with_context(|| format!("creating region {region} on {agent}"))?;
        report.line(&format!("created region {region} ({}) on {agent}", units::format_bytes(size)));
    }

    let len = usize::try_from(size).context("--size does not fit in memory")?;
    let mut buf = vec![0u8; len];
    rand::rng().fill_bytes(&mut buf);
    let data: Arc<[u8]> = buf.into();

    let started = Instant::now();
    let written = a.put_reader("demo-src", 0, Cursor::new(data.clone())).await.context("filling demo-src on demo-a")?;
    report.rate("put", "put random data into demo-a:demo-src", written, started.elapsed().as_secs_f64());

    let at = |addr: &str, region: &str| Location { agent: Some(addr.to_string()), region: region.to_string(), offset: 0 };
    let copies = [
        (
            "write",
            "WRITE demo-a:demo-src -> demo-b:demo-dst (initiated by demo-a)",
            at(&a_addr, "demo-src"),
            at(&b_addr, "demo-dst"),
            false,
        ),
        ("read", "READ demo-b:demo-dst -> demo-a:demo-back (initiated by demo-a)", at(&b_addr, "demo-dst"), at(&a_addr, "demo-back"), true),
    ];
    for (step, what, src, dst, pull) in copies {
        let plan = cp::plan(&src, &dst, &a_addr, Some(size), pull, &Tuning::default(), &cp::Batch::default())?;
        // Both copies are initiated by demo-a: the WRITE because it holds the source, the READ
        // because it holds the destination.
        let started = Instant::now();
        let t = cp::submit(&a, &plan).await?;
        let t = progress::watch(&a, &t.id, true).await?;
        progress::outcome(&t, false).with_context(|| format!("{step} copy"))?;
        let secs = if t.elapsed_seconds > 0.0 { t.elapsed_seconds } else { started.elapsed().as_secs_f64() };
        report.rate(step, what, t.bytes_done, secs);
        if t.bytes_done != size {
            return Err(Failure::VerifyMismatch(format!("{step} copy moved {} bytes, expected {size}", t.bytes_done)).into());
        }
    }

    let mut sums = Vec::new();
    for (client, name, region) in [(a.clone(), "demo-a", "demo-src"), (b.clone(), "demo-b", "demo-dst"), (a.clone(), "demo-a", "demo-back")]
    {
        let algo = ChecksumAlgo::Xxh3;
        let sum = client.checksum(region, 0, size, algo).await.with_context(|| format!("checksum of {name}:{region}"))?;
        sums.push((format!("{name}:{region}"), sum, algo.as_str()));
    }
    let first = sums[0].1;
    let listing: Vec<String> = sums.iter().map(|(what, v, algo)| format!("{what}={algo}:{v:016x}")).collect();
    if sums.iter().any(|(_, v, _)| *v != first) {
        return Err(Failure::VerifyMismatch(format!("checksums differ: {}", listing.join(" "))).into());
    }
    report.line(&format!("checksums match: {}", listing.join(" ")));
    report.steps.push(json!({"step": "checksum", "value": format!("{first:016x}")}));

    for (client, name, region) in [(&b, "demo-b", "demo-dst"), (&a, "demo-a", "demo-back")] {
        let started = Instant::now();
        let back = client.get(region, 0, size).await.with_context(|| format!("reading back {name}:{region}"))?;
        let secs = started.elapsed().as_secs_f64();
        if let Some(i) = first_difference(&data, &back) {
            return Err(Failure::VerifyMismatch(format!("{name}:{region} differs from the data written, first at byte {i}")).into());
        }
        report.rate("get", &format!("read back {name}:{region}, bytes match"), back.len() as u64, secs);
    }
    report.line("demo OK");
    Ok(())
}

/// Index of the first differing byte, or of the end of the shorter slice.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => Some(i),
        None if a.len() != b.len() => Some(a.len().min(b.len())),
        None => None,
    }
}

/// `explicit`, else `xfer-agent` next to the current executable, else on `$PATH`.
pub fn find_agent(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        if p.is_file() {
            return Ok(p.to_path_buf());
        }
        anyhow::bail!("agent binary {} does not exist", p.display());
    }
    let exe_dir = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf));
    if let Some(dir) = &exe_dir {
        let candidate = dir.join(AGENT_BIN);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(AGENT_BIN);
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    anyhow::bail!(
        "cannot find {AGENT_BIN} next to {} or on $PATH (build it with `cargo build -p xfer-agent` or pass --agent-bin)",
        exe_dir.map(|d| d.display().to_string()).unwrap_or_else(|| "xferctl".into())
    )
}

/// Distinct free loopback ports: all are bound at once, then released. Another process could
/// take one before the agent binds it; the agent then fails to start and says so.
pub fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    let listeners =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0")).collect::<Result<Vec<_>, _>>().context("finding free loopback ports")?;
    listeners.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}

/// A child `xfer-agent` with its log file.
struct DemoAgent {
    name: String,
    addr: String,
    pid: Option<u32>,
    child: Child,
    log: PathBuf,
    stopped: bool,
}

impl DemoAgent {
    fn spawn(bin: &Path, name: &str, [grpc, metrics, data]: [u16; 3], tmp: &Path, extra: &[String]) -> anyhow::Result<Self> {
        let state = tmp.join(name);
        std::fs::create_dir_all(&state).with_context(|| format!("creating {}", state.display()))?;
        let log = tmp.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone().context("duplicating the log file handle")?;
        let addr = format!("127.0.0.1:{grpc}");
        let child = Command::new(bin)
            .arg("--node-name")
            .arg(name)
            .arg("--listen")
            .arg(&addr)
            .arg("--metrics-listen")
            .arg(format!("127.0.0.1:{metrics}"))
            .arg("--data-listen")
            .arg(format!("127.0.0.1:{data}"))
            .arg("--fabric")
            .arg("tcp")
            .arg("--state-dir")
            .arg(&state)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            // Backstop: if we are unwound without `stop()`, the agent is SIGKILLed.
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {} for {name}", bin.display()))?;
        Ok(DemoAgent { name: name.to_string(), addr, pid: child.id(), child, log, stopped: false })
    }

    /// Polls `GetInfo` until it answers; fails early if the agent exits.
    async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<(Client, String)> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().context("checking the agent process")? {
                self.stopped = true;
                anyhow::bail!("{} exited during startup ({status}); see its log above", self.name);
            }
            let last_error = match client::connect(&self.addr).await {
                Ok(client) => match client.info().await {
                    Ok(info) => return Ok((client, info.fabric.to_string())),
                    Err(e) => crate::error::report(&e.into()).1,
                },
                Err(e) => crate::error::report(&e).1,
            };
            if Instant::now() >= deadline {
                anyhow::bail!(
                    "{} did not answer GetInfo within {} (last error: {last_error}); see its log above",
                    self.name,
                    humantime::format_duration(timeout)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGTERM, wait up to [`STOP_GRACE`], then SIGKILL. Never fails: this runs on error paths.
    async fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        if let Some(pid) = self.pid.and_then(|p| i32::try_from(p).ok()) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
        }
        match tokio::time::timeout(STOP_GRACE, self.child.wait()).await {
            Ok(_) => {}
            Err(_) => {
                eprintln!("{} did not exit within {STOP_GRACE:?} of SIGTERM; killing it", self.name);
                let _ = self.child.kill().await;
            }
        }
    }

    /// The last lines of the agent's log on stderr (used when the demo fails).
    fn print_log_tail(&self) {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(20)..];
        if tail.is_empty() {
            return;
        }
        eprintln!("--- last {} lines of {} log ---", tail.len(), self.name);
        for l in tail {
            eprintln!("{l}");
        }
        eprintln!("---");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences() {
        assert_eq!(first_difference(b"abc", b"abc"), None);
        assert_eq!(first_difference(b"abc", b"abd"), Some(2));
        assert_eq!(first_difference(b"abc", b"ab"), Some(2));
        assert_eq!(first_difference(b"", b""), None);
    }

    #[test]
    fn ports_are_distinct_and_nonzero() {
        let ports = free_ports(6).unwrap();
        let mut sorted = ports.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 6);
        assert!(ports.iter().all(|&p| p != 0));
    }

    #[test]
    fn explicit_agent_binary_must_exist() {
        let err = find_agent(Some(Path::new("/nonexistent/xfer-agent"))).unwrap_err();
        assert!(err.to_string().contains("does not exist"));
    }
}
