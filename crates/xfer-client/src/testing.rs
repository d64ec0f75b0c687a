//! Real agents for examples and tests: [`LocalAgent::start`] runs the workspace's `xfer-agent`
//! binary on loopback (tcp fabric, ports the OS picks, its own state directory and unix socket)
//! and stops it when dropped. The binary is `$XFER_AGENT`, else `target/debug/xfer-agent` of the
//! workspace this crate was built in (`make test` builds it first).
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running agent, killed when dropped.
pub struct LocalAgent {
    child: Child,
    /// Its gRPC address (`127.0.0.1:PORT`).
    pub addr: String,
    /// Its local unix socket (`unix:///…/agent.sock`).
    pub unix: String,
    dir: PathBuf,
}

impl LocalAgent {
    /// Starts an agent named `name` and waits until it serves (its ready file appears).
    pub async fn start(name: &str) -> std::io::Result<LocalAgent> {
        let bin = std::env::var_os("XFER_AGENT")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/xfer-agent"));
        let dir = std::env::temp_dir().join(format!("xfer-local-{name}-{}-{}", std::process::id(), unique()));
        std::fs::create_dir_all(&dir)?;
        let (ready, sock) = (dir.join("ready"), dir.join("agent.sock"));
        let child = Command::new(&bin)
            .args(["--node-name", name, "--fabric", "tcp", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--ready-file")
            .arg(&ready)
            .env("XFER_UNIX_LISTEN", &sock)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", bin.display())))?;
        let mut agent = LocalAgent { child, addr: String::new(), unix: format!("unix://{}", sock.display()), dir };
        // A hang guard, not a synchronisation: readiness is the file the agent writes once it
        // serves every listener.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(text) = std::fs::read_to_string(&ready) {
                if let Some(addr) = grpc_of(&text) {
                    agent.addr = addr;
                    return Ok(agent);
                }
            }
            if let Ok(Some(status)) = agent.child.try_wait() {
                return Err(std::io::Error::other(format!("agent {name} exited: {status}")));
            }
            if Instant::now() > deadline {
                return Err(std::io::Error::other(format!("agent {name} not ready within 60 s")));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for LocalAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `"grpc": "ADDR"` out of the ready file's JSON (flat, written whole by a rename).
fn grpc_of(json: &str) -> Option<String> {
    let rest = &json[json.find("\"grpc\"")? + 6..];
    let start = rest.find('"')? + 1;
    let len = rest[start..].find('"')?;
    Some(rest[start..start + len].to_string())
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}
