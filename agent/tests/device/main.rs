//! Tests that need RDMA devices (Soft-RoCE, rxe0 and rxe1): the fabric conformance suite (its tcp
//! cases run everywhere, its verbs cases only on the devices), the verbs smoke test, grant mode
//! `mw` and remote keys only through grants. Every case that needs a device is
//! `#[ignore = "needs Soft-RoCE (make test-rxe)"]`, so on a host without one `cargo test` reports
//! it as ignored, never as passed; `make test-rxe` runs this binary in the Soft-RoCE VM with
//! `--include-ignored` and fails unless every test in it ran and passed.
//!
//! Process-wide state: the tests only read `XFER_RXE_*` environment variables (set by the VM).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod conformance;
mod verbs_mw;
mod verbs_security;
mod verbs_smoke;
