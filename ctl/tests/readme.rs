//! README.md's "Using it" runs as written: every `sh` block of the section, in order, as one bash
//! script (`set -e`), with the built `xfer-agent` and `xferctl` first on `PATH`, in a fresh
//! home and working directory. Its agents take the ports the README states (7470/9470 and
//! 7471/9471 on loopback), so the test says so plainly when one is taken. The quick start's
//! `make` targets must exist in the Makefile.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The `sh` blocks between the heading `## NAME` and the next heading of any level.
fn blocks(readme: &str, section: &str) -> Vec<String> {
    let start = readme.find(&format!("\n## {section}\n")).unwrap_or_else(|| panic!("README has no section {section:?}"));
    let body = &readme[start + section.len() + 5..];
    let body = &body[..body.find("\n#").unwrap_or(body.len())];
    let mut out = Vec::new();
    let mut rest = body;
    while let Some(i) = rest.find("```sh\n") {
        let after = &rest[i + 6..];
        let end = after.find("\n```").expect("an unterminated sh block");
        out.push(after[..end].to_string());
        rest = &after[end + 4..];
    }
    out
}

/// Kills the script's whole process group (its background agents) however the test ends.
struct Group(i32);

impl Drop for Group {
    fn drop(&mut self) {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(self.0), nix::sys::signal::Signal::SIGKILL);
    }
}

#[test]
fn quick_start_names_make_targets_that_exist() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let makefile = std::fs::read_to_string(repo().join("Makefile")).unwrap();
    let quick = blocks(&readme, "Quick start (a fresh Debian 12 machine)");
    assert!(!quick.is_empty());
    for line in quick.iter().flat_map(|b| b.lines()) {
        let cmd = line.split('#').next().unwrap().trim();
        if let Some(target) = cmd.strip_prefix("make ") {
            assert!(makefile.lines().any(|l| l.starts_with(&format!("{target}:"))), "make {target}: no such target");
        }
    }
}

#[test]
fn using_it_runs_verbatim_against_two_fresh_agents() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let script = blocks(&readme, "Using it");
    assert!(script.len() >= 3, "the section's blocks: {script:?}");
    for port in [7470, 7471, 9470, 9471] {
        assert!(
            std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
            "port {port} is taken on this host: the README's agents need 7470, 7471, 9470 and 9471"
        );
    }
    let bin = Path::new(env!("CARGO_BIN_EXE_xferctl")).parent().unwrap().to_path_buf();
    assert!(bin.join("xfer-agent").exists(), "build xfer-agent first (cargo build --workspace --bins)");
    let home = tempfile::tempdir().unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let text = format!("set -e\n{}\n", script.join("\n"));
    std::fs::write(home.path().join("readme.sh"), &text).unwrap();
    let child = Command::new("bash")
        .arg("readme.sh")
        .current_dir(home.path())
        .env("HOME", home.path())
        .env("PATH", path)
        .env_remove("XFER_AGENT")
        .stdin(Stdio::null())
        // Files, not pipes: agents left running by a failed script would hold a pipe open.
        .stdout(std::fs::File::create(home.path().join("stdout")).unwrap())
        .stderr(std::fs::File::create(home.path().join("stderr")).unwrap())
        .process_group(0)
        .spawn()
        .unwrap();
    let _group = Group(child.id() as i32);
    let mut child = child;
    let status = child.wait().unwrap();
    let stdout = std::fs::read_to_string(home.path().join("stdout")).unwrap();
    let stderr = std::fs::read_to_string(home.path().join("stderr")).unwrap();
    let said = format!("script:\n{text}\nexit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}", status.code());
    assert!(status.success(), "{said}");
    // What the blocks claim: the copy came back whole, and node-b heard of the batch.
    assert!(stdout.contains("req-7"), "the notification was printed: {said}");
    assert!(stdout.contains("1 of 1 pair(s) ok"), "doctor --peer: {said}");
    assert_eq!(std::fs::read(home.path().join("copy.bin")).unwrap(), std::fs::read(home.path().join("model.bin")).unwrap());
}
