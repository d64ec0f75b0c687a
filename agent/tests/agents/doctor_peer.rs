//! `xferctl doctor --peer` between two tcp agents on loopback: no devices, so one row, the link
//! probed as one path by the per-path benchmark; exit 0, the probe's scratch region gone from
//! the peer, and a non-zero exit when the peer does not answer.

use xfer_proto::v1 as pb;

use crate::common::Agent;

#[tokio::test]
async fn doctor_peer_between_tcp_agents_prints_one_probed_row() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    let o = a.ctl(&["doctor", "--peer", &b.addr()]);
    assert!(o.status.success(), "{o:?}");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains(&format!("device pairs from {} to {}:", a.addr(), b.addr())), "{text}");
    assert!(text.contains("ok") && text.contains("tcp: no devices; "), "{text}");
    assert!(text.ends_with("1 of 1 pair(s) ok\n"), "{text}");

    let o = a.ctl(&["--json", "doctor", "--peer", &b.addr()]);
    assert!(o.status.success(), "{o:?}");
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let pairs = doc["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 1, "{doc}");
    assert_eq!((pairs[0]["verdict"].as_str(), pairs[0]["local_device"].as_str()), (Some("ok"), Some("")), "{doc}");
    assert!(pairs[0]["gbit_per_s"].as_f64().unwrap() > 0.0 && pairs[0]["lat_p50_us"].as_f64().unwrap() > 0.0, "{doc}");
    assert_eq!(doc["ok"], true);
    let regions = b.client().await.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner().regions;
    assert!(regions.is_empty(), "scratch regions left on the peer: {regions:?}");
}

#[tokio::test]
async fn doctor_peer_fails_when_the_peer_does_not_answer() {
    let a = Agent::start("node-a");
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let o = a.ctl(&["doctor", "--peer", &dead]);
    assert!(!o.status.success(), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains(&dead), "{o:?}");
}
