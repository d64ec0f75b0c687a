//! Black-box tests of the `xferctl` binary that need no agent: help output, usage errors and the
//! exit code for an unreachable agent. `real_agent.rs` runs xferctl against real agents.

// A test helper that cannot run the binary has nothing better to do than fail the test.
#![allow(clippy::expect_used)]

use std::process::{Command, Output};

fn xferctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xferctl")).args(args).env_remove("XFER_AGENT").output().expect("run xferctl")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

const SUBCOMMANDS: &[&[&str]] = &[
    &["info"],
    &["doctor"],
    &["region"],
    &["region", "create"],
    &["region", "list"],
    &["region", "show"],
    &["region", "delete"],
    &["put"],
    &["get"],
    &["cp"],
    &["transfer"],
    &["transfer", "list"],
    &["transfer", "watch"],
    &["transfer", "show"],
    &["transfer", "cancel"],
    &["connect"],
    &["peers"],
    &["bench"],
    &["demo"],
    &["completions"],
];

#[test]
fn top_level_help_lists_commands_and_exit_codes() {
    let o = xferctl(&["--help"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    for cmd in ["info", "doctor", "region", "put", "get", "cp", "transfer", "connect", "peers", "bench", "demo"] {
        assert!(out.contains(&format!("  {cmd} ")), "help lacks {cmd}:\n{out}");
    }
    assert!(out.contains("Exit codes:"), "{out}");
    assert!(out.contains("8  UNAVAILABLE"), "{out}");
    assert!(out.contains("12  verification mismatch"), "{out}");
}

#[test]
fn every_subcommand_has_help() {
    for args in SUBCOMMANDS {
        let mut full: Vec<&str> = args.to_vec();
        full.push("--help");
        let o = xferctl(&full);
        assert_eq!(o.status.code(), Some(0), "xferctl {full:?}: {}", stderr(&o));
        assert!(stdout(&o).contains("Usage: xferctl"), "xferctl {full:?}: {}", stdout(&o));
    }
}

#[test]
fn unreachable_agent_exits_8_with_one_line() {
    let o = xferctl(&["--agent", "127.0.0.1:1", "info"]);
    assert_eq!(o.status.code(), Some(8), "{}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "expected one line, got:\n{err}");
    assert!(err.starts_with("error: cannot connect to agent at 127.0.0.1:1"), "{err}");
    assert!(err.trim_end().ends_with("(UNAVAILABLE)"), "{err}");
    assert!(o.stdout.is_empty());
}

#[test]
fn agent_comes_from_environment() {
    let o = Command::new(env!("CARGO_BIN_EXE_xferctl"))
        .args(["region", "list"])
        .env("XFER_AGENT", "127.0.0.1:1")
        .output()
        .expect("run xferctl");
    assert_eq!(o.status.code(), Some(8), "{}", stderr(&o));
    assert!(stderr(&o).contains("127.0.0.1:1"), "{}", stderr(&o));
}

#[test]
fn cp_to_unreachable_initiator_exits_8() {
    // The SRC agent initiates by default: it is the one we fail to reach.
    let o = xferctl(&["--agent", "127.0.0.1:2", "cp", "127.0.0.1:1:src", "dst"]);
    assert_eq!(o.status.code(), Some(8), "{}", stderr(&o));
    assert!(stderr(&o).contains("127.0.0.1:1"), "{}", stderr(&o));
    // With --pull the DST agent (here --agent) initiates.
    let o = xferctl(&["--agent", "127.0.0.1:2", "cp", "--pull", "127.0.0.1:1:src", "dst"]);
    assert_eq!(o.status.code(), Some(8), "{}", stderr(&o));
    assert!(stderr(&o).contains("127.0.0.1:2"), "{}", stderr(&o));
}

#[test]
fn usage_errors_exit_2() {
    for args in [
        &["region", "create", "r", "--size", "lots"][..],
        &["region", "create", "r", "--size", "99999999999EiB"][..],
        &["cp", "r@", "s"][..],
        &["cp", "::1:r", "s"][..],
        &["get", "r", "--len", "1.2.3", "out"][..],
        &["cp", "a", "b", "--timeout", "soon"][..],
        &["--agent", "h:notaport", "info"][..],
        &["bench", "--peer", "h", "--sizes", "4KiB,junk"][..],
        &["nonsense"][..],
    ] {
        let o = xferctl(args);
        assert_eq!(o.status.code(), Some(2), "xferctl {args:?}: {}", stderr(&o));
        assert!(stderr(&o).starts_with("error:"), "xferctl {args:?}: {}", stderr(&o));
    }
}

/// Hostile segment lists are usage errors naming the line, found before anything is allocated
/// for them or any agent is called (a count near 2^64 after another line once wrapped the
/// bound and allocated until the process aborted).
#[test]
fn hostile_segment_lists_exit_2_naming_the_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases = [
        (format!("0 0 4KiB\n0 0 4KiB x{}\n", u64::MAX), "line 2: the list expands to more than"),
        ("0 0 4KiB x1048576\n0 0 1\n".to_string(), "line 2: the list expands to more than"),
        (format!("{} 0 4KiB\n", u64::MAX - 1), "line 1: block 0 ends past 2^64 bytes"),
        ("0 0 4KiB x3 8EiB\n".to_string(), "line 1: block 2 ends past 2^64 bytes on the source side"),
    ];
    for (i, (list, want)) in cases.iter().enumerate() {
        let f = dir.path().join(format!("list{i}"));
        std::fs::write(&f, list).expect("write the list");
        // The agent address is unreachable: the list must be refused before any call.
        let o = xferctl(&["--agent", "127.0.0.1:1", "cp", "--segments", &f.display().to_string(), "src", "dst"]);
        assert_eq!(o.status.code(), Some(2), "{list:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(want), "{list:?}: {}", stderr(&o));
        assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
    }
}

#[test]
fn completions_generate() {
    let o = xferctl(&["completions", "bash"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("xferctl"));
}

#[test]
fn demo_without_agent_binary_fails_clearly() {
    let o =
        Command::new(env!("CARGO_BIN_EXE_xferctl")).args(["demo", "--agent-bin", "/nonexistent/xfer-agent"]).output().expect("run xferctl");
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("does not exist"), "{}", stderr(&o));
}
