//! The real `xferctl` binary against real `xfer-agent` processes (tcp fabric, loopback, port 0):
//! regions, put/get, cp both ways, watch/show/cancel, failed transfers, peers, bench, and the exit
//! code and one-line error for each refusal. Statuses and messages are the agent's own, so a
//! change on either side shows up here. (`mock_agent.rs` keeps a fake only for the client's
//! stream framing, which a real agent cannot report.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "common/mod.rs"]
mod common;

use std::process::{Command, Stdio};

use common::*;

#[test]
fn regions_put_get_and_their_refusals() {
    let a = Agent::start("node-a");
    let dir = tempfile::tempdir().unwrap();
    for name in ["src", "dst"] {
        let o = a.ctl(&["region", "create", name, "--size", "4MiB"]);
        assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    }
    refused(&a.ctl(&["region", "create", "src", "--size", "1KiB"]), 13, "ALREADY_EXISTS", "duplicate name");
    let o = a.ctl(&["region", "show", "foo"]);
    refused(&o, 3, "NOT_FOUND", "missing region");
    assert!(err(&o).contains("foo"), "names the region: {}", err(&o));

    let o = a.ctl(&["--json", "region", "list"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    let mut names: Vec<&str> = v.as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["dst", "src"]);

    // put at an offset, get it back (to a file and to stdout).
    let payload: Vec<u8> = (0..(2 << 20) + 12345u32).map(|i| (i % 251) as u8).collect();
    let input = dir.path().join("in.bin");
    std::fs::write(&input, &payload).unwrap();
    let o = a.ctl(&["put", input.to_str().unwrap(), "src@4KiB"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert!(out(&o).contains(&format!("{} bytes in", payload.len())), "{}", out(&o));
    let output = dir.path().join("out.bin");
    let len = payload.len().to_string();
    let o = a.ctl(&["get", "src@4096", "--len", &len, output.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert!(std::fs::read(&output).unwrap() == payload);
    let o = a.ctl(&["get", "src@4KiB", "--len", "1000", "-"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert_eq!(o.stdout, payload[..1000]);
    assert!(err(&o).contains("1000 bytes in"), "summary on stderr: {}", err(&o));

    // Past the end: the agent says INVALID_ARGUMENT (the fake this replaced said OUT_OF_RANGE;
    // both exit 4).
    let o = a.ctl(&["get", "src@4MiB", "--len", "1", "-"]);
    refused(&o, 4, "INVALID_ARGUMENT", "read past the end");
    assert!(err(&o).contains("past the end"), "{}", err(&o));
    refused(&a.ctl(&["put", input.to_str().unwrap(), "src@3MiB"]), 4, "INVALID_ARGUMENT", "write past the end");

    let o = a.ctl(&["region", "delete", "dst"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    refused(&a.ctl(&["region", "delete", "dst"]), 3, "NOT_FOUND", "delete twice");
}

#[test]
fn cp_both_ways_watch_show_cancel_and_a_failed_transfer() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    let dir = tempfile::tempdir().unwrap();
    for (ag, name) in [(&a, "src"), (&b, "dst")] {
        let o = ag.ctl(&["region", "create", name, "--size", "4MiB"]);
        assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    }
    let payload: Vec<u8> = (0..4u32 << 20).map(|i| (i.wrapping_mul(7) >> 3) as u8).collect();
    let input = dir.path().join("in.bin");
    std::fs::write(&input, &payload).unwrap();
    assert_eq!(a.ctl(&["put", input.to_str().unwrap(), "src"]).status.code(), Some(0));

    // cp: WRITE from the SRC agent (A) to B, then the bytes are on B.
    let dst = format!("{}:dst@1MiB", b.addr);
    let o = a.ctl(&["cp", "src@4KiB", &dst, "--len", "2MiB"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert!(out(&o).trim().starts_with("copied 2097152 bytes in "), "{}", out(&o));
    let o = b.ctl(&["get", "dst@1MiB", "--len", "2MiB", "-"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert!(o.stdout == payload[4096..4096 + (2 << 20)], "WRITE landed on B");

    // --pull: READ initiated by the DST agent (B, here --agent); --json prints the final record.
    let src = format!("{}:src", a.addr);
    let o = b.ctl(&["--json", "cp", "--pull", "--verify", &src, "dst"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!((v["op"].as_str(), v["state"].as_str()), (Some("read"), Some("succeeded")), "{v}");
    assert_eq!((v["local"]["region"].as_str(), v["remote"]["region"].as_str()), (Some("dst"), Some("src")), "{v}");
    assert_eq!(v["verified"], true, "{v}");
    let pulled = v["id"].as_str().unwrap().to_string();
    let o = b.ctl(&["get", "dst", "-"]);
    assert!(o.stdout == payload, "READ brought every byte");

    // show / watch of the finished transfer; cancelling it changes nothing (the agent answers
    // with the record; the fake this replaced said FAILED_PRECONDITION).
    let o = b.ctl(&["transfer", "show", &pulled]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert!(out(&o).contains("succeeded"), "{}", out(&o));
    let o = b.ctl(&["transfer", "watch", &pulled]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let o = b.ctl(&["transfer", "cancel", &pulled]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert!(out(&o).contains(": had already succeeded ("), "{}", out(&o));
    let o = b.ctl(&["--json", "transfer", "show", &pulled]);
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(v["state"], "succeeded", "a cancel after the end leaves the record: {v}");
    refused(&b.ctl(&["transfer", "watch", "t-nope"]), 3, "NOT_FOUND", "watch an unknown transfer");

    // A transfer that runs out of its time (4 KiB chunks one at a time cannot finish within
    // 1 ms): DEADLINE_EXCEEDED, exit 9, with the error on one line (JSON under --json); watching
    // it later exits the same way.
    let o =
        a.ctl(&["--json", "cp", "src", &format!("{}:dst", b.addr), "--chunk", "4KiB", "--depth", "1", "--qps", "1", "--timeout", "1ms"]);
    assert_eq!(o.status.code(), Some(9), "{}\n{}", err(&o), out(&o));
    assert_eq!(err(&o).lines().count(), 1, "{}", err(&o));
    let e: serde_json::Value = serde_json::from_str(&err(&o)).unwrap();
    assert_eq!(e["error"]["status"], "DEADLINE_EXCEEDED", "{e}");
    let o = a.ctl(&["--json", "transfer", "list"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    let failed: Vec<&str> = v.as_array().unwrap().iter().filter(|t| t["state"] == "failed").map(|t| t["id"].as_str().unwrap()).collect();
    assert_eq!(failed.len(), 1, "{v}");
    let o = a.ctl(&["transfer", "watch", failed[0]]);
    assert_eq!(o.status.code(), Some(9), "{}", err(&o));
}

#[test]
fn unreachable_peer_and_bench() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    // A peer the agent cannot reach (nothing listens on port 1): UNAVAILABLE -> 8.
    refused(&a.ctl(&["connect", "127.0.0.1:1"]), 8, "UNAVAILABLE", "unreachable peer");
    // A reachable one: connect, then it is listed.
    let o = a.ctl(&["connect", &b.addr]);
    assert_eq!(o.status.code(), Some(0), "{}\n{}", err(&o), a.logs());
    let o = a.ctl(&["peers"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert!(out(&o).contains(&b.addr), "{}", out(&o));

    // bench between the two agents, with a raw TCP baseline, as JSON.
    let o = a.ctl(&["--json", "bench", "--peer", &b.addr, "--sizes", "4KiB,64KiB", "--iters", "2", "--baseline", "tcp"]);
    assert_eq!(o.status.code(), Some(0), "{}\n{}", err(&o), a.logs());
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{v}");
    assert!(v["baseline"]["bytes"].as_u64().unwrap() >= 1 << 30, "the baseline streams at least 1 GiB: {v}");
    assert_eq!(rows[0]["rounds"], 1, "{v}");

    // Rounds: each a baseline run and a fabric run; the row's ratio is the median of the
    // rounds' ratios, inside their range, against its own baseline figure.
    let o = a.ctl(&["--json", "bench", "--peer", &b.addr, "--sizes", "64KiB", "--iters", "2", "--baseline", "tcp", "--rounds", "3"]);
    assert_eq!(o.status.code(), Some(0), "{}\n{}", err(&o), a.logs());
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    let row = &v["rows"][0];
    assert_eq!(row["rounds"], 3, "{v}");
    let (lo, mid, hi) =
        (row["ratio_min"].as_f64().unwrap(), row["ratio_to_baseline"].as_f64().unwrap(), row["ratio_max"].as_f64().unwrap());
    assert!(0.0 < lo && lo <= mid && mid <= hi, "{v}");
    assert!(row["baseline_gbit_per_s"].as_f64().unwrap() > 0.0, "{v}");
    // --latency-iters 0: the bandwidth phase alone, and no latency figures; N: N latency WRs,
    // more than the bandwidth phase's if asked.
    let o = a.ctl(&["--json", "bench", "--peer", &b.addr, "--sizes", "4KiB", "--iters", "8", "--latency-iters", "0"]);
    assert_eq!(o.status.code(), Some(0), "{}\n{}", err(&o), a.logs());
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    let row = &v["rows"][0];
    assert_eq!((row["lat_iters"].as_u64(), row["bytes"].as_u64(), row["lat_p50_us"].as_f64()), (Some(0), Some(8 * 4096), Some(0.0)), "{v}");
    let o = a.ctl(&["bench", "--peer", &b.addr, "--sizes", "4KiB", "--iters", "8", "--latency-iters", "0"]);
    let line = out(&o).lines().find(|l| l.starts_with("4096")).map(str::to_string).unwrap_or_default();
    assert!(line.split_whitespace().rev().take(3).all(|c| c == "-"), "latency columns of a run without one: {}", out(&o));
    let o = a.ctl(&["--json", "bench", "--peer", &b.addr, "--sizes", "4KiB", "--iters", "2", "--latency-iters", "5"]);
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(v["rows"][0]["lat_iters"], 5, "{v}");
    for bad in
        [&["--latency-iters", "10001"][..], &["--latency-iters", "0", "--pattern", "kv"], &["--latency-iters", "1", "--pattern", "connect"]]
    {
        let o = a.ctl(&[&["bench", "--peer", &b.addr][..], bad].concat());
        assert_eq!(o.status.code(), Some(2), "{bad:?}: {}", err(&o));
        assert!(err(&o).contains("--latency-iters"), "{}", err(&o));
    }
    // Out of range: a usage error before anything runs.
    for bad in ["0", "16", "x"] {
        let o = a.ctl(&["bench", "--peer", &b.addr, "--baseline", "tcp", "--rounds", bad]);
        assert_eq!(o.status.code(), Some(2), "--rounds {bad}: {}", err(&o));
        assert!(err(&o).contains("--rounds"), "{}", err(&o));
    }
}

/// `xferctl version` names both sides; `--client` needs no agent; an unreachable agent is
/// UNAVAILABLE (8) after the client's own version is printed.
#[test]
fn version_names_the_client_and_the_agent() {
    let a = Agent::start("node-v");
    let want = env!("CARGO_PKG_VERSION");
    let o = a.ctl(&["version"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let text = out(&o);
    assert!(text.contains(&format!("client: xferctl {want}")), "{text}");
    assert!(text.contains("agent:  xfer-agent ") && text.contains("node node-v"), "{text}");
    let o = a.ctl(&["--json", "version"]);
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(v["client"]["version"], want);
    assert_eq!(v["agent"]["node_name"], "node-v");
    assert!(v["agent"]["version"].as_str().is_some_and(|s| !s.is_empty()), "{v}");

    let nowhere = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_xferctl")).args(["--agent", "127.0.0.1:1"]).args(args).env_remove("XFER_AGENT").output().unwrap()
    };
    let o = nowhere(&["version", "--client"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert_eq!(out(&o), format!("client: xferctl {want}\n"));
    let o = nowhere(&["version"]);
    assert_eq!(o.status.code(), Some(8), "{}", err(&o));
    assert_eq!(out(&o), format!("client: xferctl {want}\n"), "the client's version is still printed");
    assert_eq!(err(&o).lines().count(), 1, "{}", err(&o));
}

/// Waits (by asking the agent, no sleeps) until `a` has a running transfer that moved bytes;
/// its id.
fn running_transfer(a: &Agent) -> String {
    loop {
        let o = a.ctl(&["--json", "transfer", "list"]);
        let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
        let list = v.as_array().unwrap();
        if let Some(t) =
            list.iter().find(|t| t["state"] == "running" && t["bytes_done"].as_str().and_then(|b| b.parse::<u64>().ok()) > Some(0))
        {
            return t["id"].as_str().unwrap().to_string();
        }
        assert!(list.iter().all(|t| t["state"] != "succeeded"), "the transfer finished before it was seen running: {v}");
    }
}

fn state_of(a: &Agent, id: &str) -> String {
    let o = a.ctl(&["--json", "transfer", "show", id]);
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    v["state"].as_str().unwrap().to_string()
}

/// Ctrl-C during `cp` cancels the transfer and says so (exit 11), like scp or rclone; with
/// `--detach` it leaves the transfer running and prints its id. `transfer cancel` reports the
/// state the transfer stopped in, not the RUNNING snapshot of the moment of the cancel.
#[test]
fn ctrl_c_cancels_a_copy_and_detach_leaves_it_running() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    for (ag, name) in [(&a, "big"), (&b, "dst")] {
        let o = ag.ctl(&["region", "create", name, "--size", "256MiB"]);
        assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    }
    // 65,536 chunks of 4 KiB, one at a time: long enough to be interrupted.
    let dst = format!("{}:dst", b.addr);
    let cp = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_xferctl"))
            .args(["--agent", &a.addr, "cp", "big", &dst, "--chunk", "4KiB", "--depth", "1", "--qps", "1"])
            .args(extra)
            .env_remove("XFER_AGENT")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };

    let child = cp(&[]);
    let id = running_transfer(&a);
    kill(Pid::from_raw(child.id() as i32), Signal::SIGINT).unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(11), "{}{}", err(&o), out(&o));
    assert!(err(&o).contains(&format!("interrupted: cancelling transfer {id}")), "{}", err(&o));
    assert_eq!(state_of(&a, &id), "cancelled", "the agent stopped it");

    let child = cp(&["--detach"]);
    let id = running_transfer(&a);
    kill(Pid::from_raw(child.id() as i32), Signal::SIGINT).unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert_eq!(out(&o), format!("{id}\n"));
    assert!(err(&o).contains("keeps running"), "{}", err(&o));
    let state = state_of(&a, &id);
    assert!(state == "running" || state == "succeeded", "detached, not cancelled: {state}");
    // Cancel it now: the answer is the state it stopped in.
    let o = a.ctl(&["transfer", "cancel", &id]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let text = out(&o);
    assert!(text.contains(": cancelled (") || text.contains(": had already succeeded ("), "{text}");
    assert!(!text.contains("running"), "{text}");
}
