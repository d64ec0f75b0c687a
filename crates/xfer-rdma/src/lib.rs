//! xfer-rdma: the one crate of xfer that contains `unsafe` code. Every other crate of the
//! workspace is `#![forbid(unsafe_code)]`.
//!
//! # Why unsafe lives here
//! RDMA hands raw addresses to a device that reads and writes them behind the compiler's back,
//! and libibverbs is a C API of raw pointers. Everything that touches either is in this crate,
//! every `unsafe` block carries a `// SAFETY:` note, and every public function is safe: its
//! safety does not depend on what the caller does. In particular memory that a posted work
//! request points at is kept alive *by this crate* (the QP's in-flight list holds the MR and its
//! memory) until the WR's completion is retired or the QP is destroyed.
//!
//! # Layout
//! * [`memory`]: [`memory::RegionMemory`], region memory shared with the NIC, peers and other
//!   processes; raw-pointer copies and zero-copy socket I/O, never a Rust reference out.
//! * [`ring`]: the notification ring's layout, writer and reader (safe code over the atomic
//!   word accessors of [`memory::RegionMemory`], which also sleep and wake on a futex).
//! * [`thread`]: [`thread::run_when_idle`], the lowest scheduling class for the calling thread.
//! * [`sigbus`]: the SIGBUS handler and registry that let a truncated file region fail instead of
//!   killing the process.
//! * With the `verbs` feature (sideway + rdma-mummy-sys):
//!   * [`cq`]: a completion queue with its completion channel, polled in batches, and
//!     [`cq::watch_channel`], which registers the channel's fd with tokio.
//!   * [`qp`]: an RC queue pair, its state transitions, and safe posting
//!     ([`qp::RcQp::post_rdma`], [`qp::RcQp::post_bind_mw`]) with the in-flight list.
//!   * [`mr`]: [`mr::Mr`], a memory registration that owns its memory.
//!   * [`mw`]: [`mw::Mw`], type-2 memory windows.
//!   * [`events`]: [`events::AsyncEvents`], a device's asynchronous events (ports, QPs, device).
//!   * [`error`]: [`error::VerbsError`], what these objects report.
//!
//! The fabric logic built on top (device selection, negotiation, connections, grants) is safe code
//! in `xfer-agent` (`agent/src/verbs/`). sideway is used for the device list, context, PD, MRs and
//! the completion channel; CQ, QP and MW objects are wrapped here directly over `rdma-mummy-sys`
//! because sideway 0.4 does not expose CQ events / QP numbers in completions, and its CQ/QP
//! wrappers `assert!` in `Drop` and `panic!` on unknown enum values — nothing a device or a peer
//! sends may panic the agent.
#![allow(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod gather;
pub mod landing;
pub mod memory;
pub mod ring;
pub mod scatter;
pub mod sigbus;
pub mod thread;

#[cfg(feature = "verbs")]
pub mod cq;
#[cfg(feature = "verbs")]
pub mod error;
#[cfg(feature = "verbs")]
pub mod events;
#[cfg(feature = "verbs")]
pub mod mr;
#[cfg(feature = "verbs")]
pub mod mw;
#[cfg(feature = "verbs")]
pub mod qp;

#[cfg(feature = "verbs")]
pub use error::VerbsError;
