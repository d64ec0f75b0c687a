//! xfer-agent library.
#![deny(unsafe_code)]

pub mod fabric;
pub mod verbs;
