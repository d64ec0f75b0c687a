//! xfer-agent: owns the node's RDMA device (or the TCP fabric), registers memory regions,
//! grants peers scoped access to them, and moves data with one-sided WRITE and READ.
//!
//! # Layout
//! * [`app`] — start-up and shutdown (the binary calls [`app::run`]).
//! * [`admin`] — the admin HTTP server: /metrics (the [`metrics`] registry's exposition) and /health.
//! * [`config`] — defaults < file < env < flags, validated.
//! * [`node`] — the core: the operations both gRPC services expose, in domain types.
//! * [`service`] — the only protobuf boundary: tonic services, the peer client, conversions and
//!   the error → status mapping.
//! * [`regions`] — region registry, leases, catalog persistence.
//! * [`grants`] — grant table, expiry, revocation; the TCP fabric's access check.
//! * [`transfer`] — transfer records, the sans-IO [`transfer::machine`] and its tokio driver.
//! * [`peer_api`] — the calls made on a peer agent ([`peer_api::PeerApi`]), in domain types.
//! * [`peer_addr`] — peer addresses parsed into one canonical spelling.
//! * [`peers`] — connection pool per peer identity (lease, reuse, recreate, bounds).
//! * [`tenants`] — per-identity shares of the global limits.
//! * The data plane is the `xfer-fabric` crate: the `Fabric` trait, the tcp fabric and the verbs
//!   fabric (safe code over the `xfer-rdma` crate, which holds every `unsafe`).
//! * [`metrics`], [`checksum`], [`sys`], [`ids`] — metric names, checksums, process limits, ids.
//! * [`safe_file`] — files written without following planted links; the hard-link check of file regions.
//! * [`cpus`] — which CPU the data-path worker thread is pinned to (`verbs.worker_cpu`).
//! * [`labels`] — the rules region labels and selectors follow; [`deadline`] — deadlines that never overflow.
#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod bench;
pub mod checksum;
pub mod config;
pub mod cpus;
pub mod error;
pub mod grants;
pub mod labels;
pub mod metrics;
pub mod node;
pub mod notify;
pub mod peer_addr;
pub mod peer_api;
pub mod peers;
pub mod regions;
pub mod safe_file;
pub mod service;
pub mod sys;
pub mod tenants;
pub mod transfer;
