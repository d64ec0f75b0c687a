//! Generated protobuf and gRPC code for the `xfer.v1` package (the `Agent` and `Peer` services).
//!
//! Only the agent's `service` module and `xferctl` use these types; the agent's domain types live in
//! its own modules and are converted at that one boundary.
#![allow(clippy::all, missing_docs)]
#![forbid(unsafe_code)]

pub mod v1 {
    tonic::include_proto!("xfer.v1");
}

/// Encoded `FileDescriptorSet` for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("xfer_descriptor");
