//! The only module with `unsafe`: region memory shared with hardware, and (with the `verbs`
//! feature) the sideway-based verbs fabric.
#![allow(unsafe_code)]

pub mod memory;
