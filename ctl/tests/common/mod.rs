//! The harness the real-agent tests share: real `xfer-agent` processes on loopback and the real
//! `xferctl` binary, and the checks of its one-line errors.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `xfer-agent` is built next to `xferctl` (`cargo build --workspace --bins`; `make test` does).
pub fn agent_bin() -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_xferctl")).with_file_name("xfer-agent");
    assert!(p.exists(), "{} missing: run `cargo build --workspace --bins` first (make test does)", p.display());
    p
}

/// A real agent on 127.0.0.1, every listener on port 0; its gRPC address from its ready file.
pub struct Agent {
    pub child: Child,
    pub addr: String,
    pub log: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Agent {
    pub fn start(name: &str) -> Agent {
        Agent::start_with(name, &[])
    }

    /// An agent with `extra` flags after the defaults (later flags win).
    pub fn start_with(name: &str, extra: &[&str]) -> Agent {
        let dir = tempfile::tempdir().unwrap();
        let (ready, log) = (dir.path().join("ready.json"), dir.path().join("agent.log"));
        let mut child = Command::new(agent_bin())
            .args(["--node-name", name, "--fabric", "tcp", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .arg("--ready-file")
            .arg(&ready)
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        // Ready when the agent has written the file (after serving every listener); 60 s is a
        // safety net against a hung start.
        let deadline = Instant::now() + Duration::from_secs(60);
        let addr = loop {
            if let Ok(text) = std::fs::read_to_string(&ready) {
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                break v["grpc"].as_str().unwrap().to_string();
            }
            if let Ok(Some(st)) = child.try_wait() {
                panic!("agent {name} exited with {st}: {}", std::fs::read_to_string(&log).unwrap_or_default());
            }
            assert!(Instant::now() < deadline, "agent {name} not ready after 60 s");
            std::thread::sleep(Duration::from_millis(10));
        };
        Agent { child, addr, log, dir }
    }

    pub fn ctl(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_xferctl"))
            .arg("--agent")
            .arg(&self.addr)
            .args(args)
            .env_remove("XFER_AGENT")
            .stdin(Stdio::null())
            .output()
            .expect("run xferctl")
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Exit `code` with exactly one stderr line, `error: …(STATUS)`.
pub fn refused(o: &Output, code: i32, status: &str, what: &str) {
    let e = err(o);
    assert_eq!(o.status.code(), Some(code), "{what}: {e}");
    assert_eq!(e.lines().count(), 1, "{what}: one line: {e}");
    assert!(e.starts_with("error: "), "{what}: {e}");
    assert!(e.trim_end().ends_with(&format!("({status})")), "{what}: {e}");
}
