//! The only module with `unsafe`: region memory shared with hardware, and (with the `verbs`
//! feature) the sideway-based verbs fabric.
#![allow(unsafe_code)]

use std::sync::Arc;

use crate::config::Config;
use crate::fabric::{Fabric, FabricError};

pub mod memory;

/// Name of a usable device (active port), or why there is none.
pub fn usable_device(_cfg: &Config) -> Result<String, String> {
    Err("the verbs fabric is not built into this agent yet".to_string())
}

pub fn open_fabric(_cfg: &Config) -> Result<Arc<dyn Fabric>, FabricError> {
    Err(FabricError::NoDevice("the verbs fabric is not built into this agent yet".into()))
}
