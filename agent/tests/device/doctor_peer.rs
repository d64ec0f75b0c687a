//! `xferctl doctor --peer` on the two-link Soft-RoCE topology: A on `rxe0,rxe2`, B on
//! `rxe1,rxe3` (the `links` harness), each link its own subnet. The matrix has the two pairs
//! of one link `ok` (probed: bandwidth, latency and MTU) and the two crossed pairs unreachable
//! (not one subnet, with a fix naming both devices); the command exits 0.
#![cfg(feature = "verbs")]

use crate::links::{agents, links};

#[test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
fn doctor_peer_finds_two_ok_pairs_and_two_unreachable() {
    let l = links();
    let (a, b) = agents(&l, ["doctor-a", "doctor-b"], &[]);
    let o = a.ctl(&["--json", "doctor", "--peer", &b.addr()]);
    assert!(o.status.success(), "{o:?}");
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let pairs = doc["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 4, "{doc}");
    let row = |local: &str, remote: &str| {
        pairs
            .iter()
            .find(|p| p["local_device"] == local && p["remote_device"] == remote)
            .unwrap_or_else(|| panic!("no row {local} → {remote}: {doc}"))
    };
    // A pair that is not ok says why in the agent's own words: the end of its log (paths lost,
    // QPs in error) goes with the matrix.
    let log_tail = || {
        let logs = a.logs();
        let lines: Vec<&str> = logs.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    };
    for i in 0..2 {
        let p = row(&l.a[i], &l.b[i]);
        assert_eq!(p["verdict"], "ok", "{p}\nthe whole matrix: {doc}\nthe end of agent A's log:\n{}", log_tail());
        assert!(p["gbit_per_s"].as_f64().unwrap() > 0.0 && p["lat_p50_us"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["mtu"].as_u64().unwrap() >= 256, "{p}");
        assert!(p["fix"].is_null(), "{p}");
    }
    for (x, y) in [(&l.a[0], &l.b[1]), (&l.a[1], &l.b[0])] {
        let p = row(x, y);
        assert_eq!(p["verdict"], "unreachable", "{p}");
        assert!(p["detail"].as_str().unwrap().starts_with("not one IPv4 subnet"), "{p}");
        assert_eq!(p["fix"].as_str().unwrap(), format!("put {x} and {y} on one subnet, or list only matching devices in verbs.devices"));
    }

    let o = a.ctl(&["doctor", "--peer", &b.addr()]);
    assert!(o.status.success(), "{o:?}");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("2 of 4 pair(s) ok") && text.contains("fixes:"), "{text}");
}
