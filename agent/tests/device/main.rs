//! Tests that need RDMA devices (Soft-RoCE: rxe0 and rxe1; multi_rail also rxe2 and rxe3): the fabric conformance suite (its tcp
//! cases run everywhere, its verbs cases only on the devices), the verbs smoke test, grant mode
//! `mw`, remote keys only through grants, two real agents on two links each (`multi_rail`:
//! striping and failover; it starts agents through the `common` harness), the same agents with
//! `transfer.fallback = tcp` (`fallback`: both links down, a WRITE or a READ completes over
//! tcp), READs striped round after round (`read_rails`), the device-pair matrix of `xferctl
//! doctor --peer` (`doctor_peer`), hostile rail offers to a two-device responder
//! (`rails_redteam`), a rail whose route is gone at Connect left out of the connection
//! (`rail_unreachable`), and kernel TLS on the tcp fabric's mTLS streams (`ktls`: needs the
//! kernel's `tls` module, not a device; `#[ignore = "needs the kernel tls module"]`). Every case
//! that needs a device is
//! `#[ignore = "needs Soft-RoCE (make test-rxe)"]`, so on a host without one `cargo test` reports
//! it as ignored, never as passed; `make test-rxe` runs this binary in the Soft-RoCE VM with
//! `--include-ignored` and fails unless every test in it ran and passed.
//!
//! Process-wide state: the tests only read `XFER_RXE_*` environment variables (set by the VM);
//! `multi_rail` and `fallback` take links of the VM down (through the two-link harness `links`)
//! and bring them back before they return (run with `--test-threads=1`, as
//! `scripts/rxe-guest-test` does).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../common/mod.rs"]
mod common;

mod conformance;
mod doctor_peer;
mod fallback;
mod ktls;
mod links;
mod multi_rail;
mod rail_unreachable;
mod rails_redteam;
mod read_rails;
mod verbs_mw;
mod verbs_security;
mod verbs_smoke;
