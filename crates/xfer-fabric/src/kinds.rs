//! The small closed sets the [`crate::Fabric`] trait speaks in: which data plane an agent runs,
//! what a peer may do with memory, and which one-sided operation it does.
use std::fmt;

/// Which data plane an agent runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FabricKind {
    Tcp,
    Verbs,
}

impl fmt::Display for FabricKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FabricKind::Tcp => "tcp",
            FabricKind::Verbs => "verbs",
        })
    }
}

/// What a remote peer may do with memory: the region's access ceiling, or a grant's operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Access {
    Read,
    Write,
    ReadWrite,
}

impl Access {
    pub fn allows(self, op: RemoteOp) -> bool {
        matches!((self, op), (Access::ReadWrite, _) | (Access::Read, RemoteOp::Read) | (Access::Write, RemoteOp::Write))
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::Read => "r",
            Access::Write => "w",
            Access::ReadWrite => "rw",
        })
    }
}

/// A one-sided operation as seen by the memory's owner: the peer READs from or WRITEs into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RemoteOp {
    Read,
    Write,
}

impl fmt::Display for RemoteOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RemoteOp::Read => "read",
            RemoteOp::Write => "write",
        })
    }
}
