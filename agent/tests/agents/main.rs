//! Black-box tests: real `xfer-agent` processes (and `xferctl`) on loopback, driven over real
//! sockets — gRPC, the tcp fabric's data streams, the unix socket, Prometheus. One module per
//! subject; the harness (`common`) starts agents on port 0 with temp state dirs, so the tests of
//! every module run in parallel in this one binary.
//!
//! Process-wide state: `common::raise_own_nofile` raises this process's soft RLIMIT_NOFILE to its
//! hard limit. That is safe to share: it only ever raises, to the same value, and agents are
//! started with their own limit (`ulimit -n` in `Agent::start_env_nofile`) or raise theirs to
//! the same hard limit themselves. No test here sets environment variables, the working
//! directory or signal handlers of this process (children get their environment per `Command`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../common/mod.rs"]
mod common;

mod batch;
mod bounded_inputs;
mod channel;
mod channel_redteam;
mod dead_peer;
mod doctor_peer;
mod drain;
mod e2e;
mod exhaustion;
mod fairness;
mod file_create;
mod files_redteam;
mod host_safety;
mod host_safety_redteam;
mod inbound;
mod ktls;
mod limits;
mod metrics_live;
mod notify_redteam;
mod peer_identity;
mod prometheus;
mod rails_redteam;
mod revocation;
mod ring_redteam;
mod security;
mod security_redteam;
mod sigbus;
mod tenant_redteam;
mod tls;
mod tls_explained;
mod unix_socket;
mod unix_socket_redteam;
