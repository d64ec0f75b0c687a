//! In-process tests: agent cores (`Node`s) and their parts driven directly in this process over
//! the tcp fabric on loopback, where a test needs to say when something happens (a lease ends,
//! a peer call is held); some modules also check the same promise against real agents.
//!
//! Process-wide state: none is set (no environment variables, rlimits, signal handlers or working
//! directory); a file region's SIGBUS guard is installed once per process by the product itself.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../common/mod.rs"]
mod common;

mod false_completion;
mod initiator;
mod lease_end;
mod resume;
mod resume_redteam;
mod state_lifetime;
mod wrapped;
