//! A rail that cannot be made ready at Connect (the `links` harness: A on `rxe0,rxe2`, B on
//! `rxe1,rxe3`): A's second device keeps its port ACTIVE but can no longer resolve B's second
//! device's address (A's neighbour entry for it is gone and B's netdev answers no ARP), so moving
//! that rail's QPs to RTR fails ("dgid", ETIMEDOUT) — what a link going down does before its
//! port-down event arrives (ENETUNREACH then). A routing rule cannot do it: a lookup bound to
//! the netdev, as the device's is, treats an unreachable route as on-link. The connection is
//! made on the first rail alone, a transfer completes with its bytes verified, the rail failure
//! is counted; once the address resolves again, the next fresh connection uses both links.
//!
//! Needs the devices: `#[ignore = "needs Soft-RoCE"]`, run by `scripts/rxe-guest-test` in the
//! VM with `--include-ignored`.
#![cfg(feature = "verbs")]

use std::process::Command;
use std::time::{Duration, Instant};

use xfer_proto::v1 as pb;

use crate::common::{labelled, scrape};
use crate::links::{agents, assert_blocks, assert_succeeded, device_bytes, finish, links, region, req, submit, MIB};

/// B's second address made unresolvable from A's second netdev while it lives: A's permanent
/// neighbour entry for it removed, and B's netdev answering no ARP (`arp_ignore` 8).
struct Unresolvable {
    from: String,
    to: String,
    addr: String,
    arp_ignore: String,
    active: bool,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip {args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {args:?}: {}", String::from_utf8_lossy(&out.stderr)))
    }
}

fn ipv4_of(netdev: &str) -> String {
    let out = Command::new("ip").args(["-4", "-o", "addr", "show", "dev", netdev]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    // "5: veth3    inet 10.0.1.2/24 scope global veth3 ..."
    let cidr =
        text.split_whitespace().skip_while(|w| *w != "inet").nth(1).unwrap_or_else(|| panic!("{netdev} has no IPv4 address: {text}"));
    cidr.split('/').next().unwrap().to_string()
}

fn arp_ignore_path(netdev: &str) -> String {
    format!("/proc/sys/net/ipv4/conf/{netdev}/arp_ignore")
}

impl Unresolvable {
    /// From now on `from` cannot resolve `to`'s address: the lookup the device makes when a QP
    /// moves to RTR towards it times out, while both ports stay ACTIVE.
    fn add(from: &str, to: &str) -> Unresolvable {
        let addr = ipv4_of(to);
        let arp_ignore = std::fs::read_to_string(arp_ignore_path(to)).unwrap().trim().to_string();
        std::fs::write(arp_ignore_path(to), "8").unwrap();
        ip(&["neigh", "del", &addr, "dev", from]).unwrap();
        Unresolvable { from: from.into(), to: to.into(), addr, arp_ignore, active: true }
    }

    fn restore(&mut self) -> Result<(), String> {
        self.active = false;
        std::fs::write(arp_ignore_path(&self.to), &self.arp_ignore).map_err(|e| e.to_string())?;
        let mac = std::fs::read_to_string(format!("/sys/class/net/{}/address", self.to)).map_err(|e| e.to_string())?;
        ip(&["neigh", "replace", &self.addr, "lladdr", mac.trim(), "dev", &self.from, "nud", "permanent"])
    }

    fn remove(mut self) {
        self.restore().unwrap();
    }
}

impl Drop for Unresolvable {
    fn drop(&mut self) {
        if self.active {
            if let Err(e) = self.restore() {
                eprintln!("device tests: could not restore {}'s neighbour entry for {}: {e}", self.from, self.addr);
            }
        }
    }
}

#[tokio::test]
#[ignore = "needs Soft-RoCE (make test-rxe)"]
async fn a_rail_without_a_route_is_left_out_of_the_connection() {
    let l = links();
    let (a, b) = agents(&l, ["noroute-a", "noroute-b"], &[]);
    const BLOCKS: u64 = 64;
    let base = region(&a, "src", BLOCKS, Some(47)).await;
    region(&b, "dst", BLOCKS, None).await;

    let rule = Unresolvable::add(&l.a_net[1], &l.b_net[1]);
    let t = finish(&a, &submit(&a, req(pb::Op::Write, "src", &b, "dst", BLOCKS * MIB)).await).await;
    assert_succeeded(&t, &a);
    assert_blocks(&b, "dst", &base, BLOCKS);
    let s = scrape(&a);
    let failed = labelled(&s, "xfer_rail_connect_failures_total", &[("device", &l.a[1]), ("role", "initiator")]);
    println!(
        "{} unresolvable from {}: {BLOCKS} MiB WRITE in {:.1} s ({} failover(s), verified {}), {failed} rail failure(s), {} bytes \
         through {}, {} through {}",
        l.b_net[1],
        l.a_net[1],
        t.elapsed_seconds,
        t.failovers,
        t.verified,
        device_bytes(&a, &l.a[0]),
        l.a[0],
        device_bytes(&a, &l.a[1]),
        l.a[1]
    );
    assert!(failed > 0.0, "the rail left out was not counted: {s}\n{}", a.logs());
    // The dead rail's path is lost at its first post, like a path that fails mid-transfer: the
    // transfer that lost it was checked end to end.
    assert!(t.failovers == 0 || t.verified, "a transfer that lost a path was not verified: {t:?}");
    assert!(device_bytes(&a, &l.a[0]) >= (BLOCKS * MIB) as f64, "the first link did not carry the transfer: {s}");
    assert_eq!(device_bytes(&a, &l.a[1]), 0.0, "bytes posted on the rail without a route: {s}");
    // Its port stayed ACTIVE throughout: only the route was gone.
    assert_eq!(crate::links::device_state(&a, &l.a[1]).await, "ACTIVE");

    rule.remove();
    // The connection with the dead rail was not pooled, so the next transfer makes a fresh one
    // over both links. The path that failed waits out its back-off (1 s) before placement gives
    // it a share again: transfers until one uses it, within a hang guard.
    let guard = Instant::now() + Duration::from_secs(120);
    let before = device_bytes(&a, &l.a[1]);
    loop {
        let t = finish(&a, &submit(&a, req(pb::Op::Write, "src", &b, "dst", 16 * MIB)).await).await;
        assert_succeeded(&t, &a);
        if device_bytes(&a, &l.a[1]) > before {
            break;
        }
        assert!(Instant::now() < guard, "{} never used again once its route was back: {}\n{}", l.a[1], scrape(&a), a.logs());
    }
    assert_blocks(&b, "dst", &base, 16);
    let after = labelled(&scrape(&a), "xfer_rail_connect_failures_total", &[("device", &l.a[1]), ("role", "initiator")]);
    assert_eq!(after, failed, "a rail failed again with its route back");
    // The responder's halves of both rails were made ready: nothing failed on B.
    assert_eq!(labelled(&scrape(&b), "xfer_rail_connect_failures_total", &[("role", "responder")]), 0.0);
}
