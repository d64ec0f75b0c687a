//! xfer-engine: the sans-IO core of a transfer. Everything here is a value or a state machine that
//! is told what happened and the time, and says what to do next; it does no IO, spawns nothing and
//! never reads the clock, so every path (every fault at every step) runs in unit tests on virtual
//! time. The agent's driver does the IO. Cargo keeps it that way: tokio, tonic and prost are not
//! among this crate's dependencies.
//!
//! # Layout
//! * [`session`] — one transfer's lifecycle (lease, grant, data, check, verify, complete, give back).
//! * [`machine`] — the chunk machine inside a session: chunks, runs per QP, signalling, completions,
//!   striping over paths by weight and failover when one goes down.
//! * [`paths`] — a path's health across transfers (flap-damped back-off) and its measured rate.
//! * [`placement`] — which paths a transfer uses, by NUMA node, capacity and load (pure).
//! * [`reach`] — which of two agents' devices reach each other, matched one to one (pure).
//! * [`batch`] — checked segment lists (KV-cache batches) and their coalescing.
//! * [`failure`] — the closed set of failure codes; [`status`] — work-completion statuses.
//! * [`notes`] — a grant's notification bookkeeping (markers counted, batches announced).
//! * [`frame`] — the tcp fabric's wire codec.
//! * [`shape`] — chunk size, QP count and depth bounds; [`range`] — byte ranges against a region.
//! * [`ids`] — random and peer-chosen ids.
//! * [`error`] — what the engine itself refuses.
#![forbid(unsafe_code)]

pub mod batch;
pub mod error;
pub mod failure;
pub mod frame;
pub mod ids;
pub mod machine;
pub mod notes;
pub mod paths;
pub mod placement;
pub mod range;
pub mod reach;
pub mod session;
pub mod shape;
pub mod status;

pub use error::Error;
