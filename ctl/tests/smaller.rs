//! The small promises a first hour runs into, against real agents: JSON that follows protobuf's
//! mapping (and errors as JSON under `--json`), exit 9 for a transfer out of its `--timeout`, a
//! warning for a decimal size, a hint for huge pages a host does not have, `peers` saying FAILED,
//! `transfer watch` into a pipe printing lines as it goes, `--print-config` naming unset keys,
//! and `demo --help`'s example flag being one the agent takes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "common/mod.rs"]
mod common;

use std::process::Command;

use common::*;
use serde_json::Value;

fn json(o: &std::process::Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}{}", out(o), err(o)))
}

#[test]
fn json_uses_strings_for_64_bit_integers_null_for_no_checksum_and_errors_are_json() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    for (agent, name) in [(&a, "src"), (&b, "dst")] {
        let o = agent.ctl(&["region", "create", name, "--size", "1MiB"]);
        assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    }
    let v = json(&a.ctl(&["--json", "region", "show", "src"]));
    assert_eq!(v["length"], "1048576", "{v}");
    let dst = format!("{}:dst", b.addr);
    let v = json(&a.ctl(&["--json", "cp", "src", &dst]));
    assert_eq!((v["length"].as_str(), v["bytes_done"].as_str()), (Some("1048576"), Some("1048576")), "{v}");
    assert_eq!((v["local"]["offset"].as_str(), v["segments"].as_str()), (Some("0"), Some("1")), "{v}");
    assert_eq!(v["checksum"], Value::Null, "nothing was checksummed: {v}");
    let v = json(&a.ctl(&["--json", "cp", "src", &dst, "--verify"]));
    assert!(v["checksum"].as_str().is_some_and(|c| c.parse::<u64>().is_ok()), "{v}");
    let v = json(&a.ctl(&["--json", "info"]));
    assert!(v["registered_bytes"].is_string() && v["limits"]["max_registered_bytes"].is_string(), "{v}");

    // Errors under --json: one JSON object on stderr, nothing on stdout.
    let o = a.ctl(&["--json", "region", "show", "nope"]);
    assert_eq!(o.status.code(), Some(3));
    assert!(o.stdout.is_empty());
    let e: Value = serde_json::from_str(err(&o).trim()).unwrap_or_else(|e| panic!("{e}: {}", err(&o)));
    assert_eq!((e["error"]["status"].as_str(), e["error"]["exit_code"].as_u64()), (Some("NOT_FOUND"), Some(3)), "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("nope"), "{e}");
}

#[test]
fn a_transfer_out_of_its_timeout_exits_9() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    for (agent, name) in [(&a, "src"), (&b, "dst")] {
        let o = agent.ctl(&["region", "create", name, "--size", "256MiB"]);
        assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    }
    let o = a.ctl(&["cp", "src", &format!("{}:dst", b.addr), "--timeout", "1ms"]);
    assert_eq!(o.status.code(), Some(9), "{}", err(&o));
    assert!(err(&o).contains("DEADLINE_EXCEEDED"), "{}", err(&o));
}

#[test]
fn sizes_hugepages_peers_and_watch() {
    let a = Agent::start("node-a");
    // A decimal unit is honoured, with one warning.
    let o = a.ctl(&["region", "create", "dec", "--size", "1MB"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert_eq!(err(&o).matches("warning").count(), 1, "{}", err(&o));
    assert!(out(&o).contains("1000000") || out(&o).contains("976.6 KiB"), "{}", out(&o));
    let o = a.ctl(&["region", "create", "bin", "--size", "1MiB"]);
    assert!(err(&o).is_empty(), "no warning for a binary unit: {}", err(&o));

    // Huge pages on a host without free ones: a hint, not INTERNAL.
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let free = meminfo.lines().find_map(|l| l.strip_prefix("HugePages_Free:")).map(|v| v.trim().parse::<u64>().unwrap());
    if free.unwrap_or(0) == 0 {
        let o = a.ctl(&["region", "create", "huge", "--size", "2MiB", "--hugepages"]);
        refused(&o, 6, "FAILED_PRECONDITION", "--hugepages without huge pages");
        assert!(err(&o).contains("nr_hugepages") || err(&o).contains("huge page"), "{}", err(&o));
    }

    // A peer that never answers is FAILED with its error, not NEW.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = closed.local_addr().unwrap().to_string();
    drop(closed);
    let o = a.ctl(&["cp", "bin", &format!("{dead}:dst")]);
    assert_eq!(o.status.code(), Some(8), "{}", err(&o));
    let peers = json(&a.ctl(&["--json", "peers"]));
    let p = peers.as_array().unwrap().iter().find(|p| p["address"] == dead.as_str()).unwrap_or_else(|| panic!("{peers}"));
    assert_eq!(p["state"], "FAILED", "{p}");
    assert!(p["error"].as_str().is_some_and(|e| !e.is_empty()), "{p}");

    // transfer watch into a pipe: a line per change, the last one the end state.
    let o = a.ctl(&["cp", "bin", &format!("{}:dec", a.addr), "--len", "4KiB", "--no-wait"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let id = out(&o).trim().to_string();
    let o = a.ctl(&["transfer", "watch", &id]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let text = out(&o);
    let changes: Vec<&str> = text.lines().filter(|l| l.starts_with(&id)).collect();
    assert!(changes.last().is_some_and(|l| l.contains("succeeded") && l.contains("4096/4096")), "{text}");
}

#[test]
fn print_config_names_unset_keys_and_demos_example_flag_exists() {
    let o = Command::new(agent_bin()).arg("--print-config").output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let text = out(&o);
    for key in ["data_listen", "health_listen", "ready_file", "unix_listen", "regions.shm_group"] {
        assert!(text.lines().any(|l| l == format!("#   {key}")), "{key}:\n{text}");
    }
    let help = Command::new(env!("CARGO_BIN_EXE_xferctl")).args(["demo", "--help"]).output().unwrap();
    let help = out(&help);
    let example = help.split("--agent-arg=").nth(1).and_then(|s| s.split(|c: char| c.is_whitespace()).next()).unwrap();
    let example = example.trim_end_matches('.');
    let o = Command::new(agent_bin()).args([example, "--print-config"]).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "the agent refuses demo --help's example {example}: {}", err(&o));
}
