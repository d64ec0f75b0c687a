//! RC queue pair with the extended (`ibv_wr_*`) posting API, its state transitions, and the
//! in-flight list that makes posting safe.
//!
//! Unsafe lives here because a posted work request hands the device a raw address: the memory
//! must stay registered and mapped until the device is done with it. [`RcQp`] guarantees that
//! itself. Every posting function takes the MR (an `Arc<`[`Mr`](crate::mr::Mr)`>`, which owns its memory) and,
//! for a window bind, the `Arc<`[`Mw`](crate::mw::Mw)`>`; the QP keeps those clones on its in-flight list, next
//! to the caller's own value `K`, until [`RcQp::retire`] is given the WR's completion (or a
//! completion that retires it: WRs complete in order on an RC QP), or until the QP is destroyed
//! (which ends all DMA) — whichever comes first. Posting is serialized by the same lock, so no
//! caller contract remains.
//!
//! Wrapped here over rdma-mummy-sys: sideway's `ExtendedQueuePair` asserts in `Drop`, converts
//! `qp->state` with a `panic!` on unknown values inside `modify`'s error path, and hides the
//! `ibv_qp_ex` pointer needed to post without its guard's `&mut self` borrow.
//!
//! `rc.rs` holds the QP and its in-flight list, `post.rs` posting, `transitions.rs` the state
//! changes and `wr.rs` what is posted.

mod post;
mod rc;
mod transitions;
mod wr;

pub use rc::RcQp;
pub use transitions::{Route, RtrAttrs, RtsAttrs};
pub use wr::{queue_of, Posting, RdmaOp, RdmaWr, WindowAccess, MAX_INDEX};
