//! xfer-agent: owns the node's RDMA device (or the TCP fabric), registers memory regions,
//! grants peers scoped access to them, and moves data with one-sided WRITE and READ.
//!
//! # Layout
//! * [`app`] — start-up and shutdown (the binary calls [`app::run`]); [`config`] — defaults < file
//!   < env < flags, validated.
//! * [`service`] — the only protobuf boundary: tonic services, the peer client, conversions and
//!   the error → status mapping.
//! * [`node`] — the core: the operations both gRPC services expose, in domain types, on a `Node`
//!   made of parts (regions, initiator, responder); [`error`] — its one error.
//! * [`bench`] — benchmarks, above the core.
//! * [`transfer`] — transfer records, the data path's jobs and its one driver (the sans-IO
//!   session and machine are the `xfer-engine` crate's).
//! * [`regions`] — region registry, leases, catalog; [`grants`] — grant table, expiry,
//!   revocation, the data plane's access check; [`notify`] — notifications to local subscribers.
//! * [`peers`] — connection pool per peer identity; [`peer_api`] — the calls made on a peer;
//!   [`peer_addr`] — addresses in one spelling; [`tenants`] — per-identity shares.
//! * [`admin`] — /metrics and /health; [`metrics`] — every metric name and help text.
//! * [`checksum`], [`sys`], [`cpus`], [`safe_file`], [`labels`] — checksums, process limits, the
//!   worker's CPU, files written without following planted links, label rules.
//!
//! The data plane is the `xfer-fabric` crate (the `Fabric` trait, tcp and verbs), the sans-IO
//! core is `xfer-engine`, and every `unsafe` is in `xfer-rdma`.
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
