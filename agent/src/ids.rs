//! Identifiers: the random ids this agent makes (regions, grants, transfers, connections, its
//! own instance) and the check of ids a peer chooses.

/// A random 64-bit id, hex encoded (16 characters).
pub fn new_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// Ids a peer chooses (connection ids in `Peer.Connect`/`Grant` and the data-stream hello,
/// transfer ids in `Peer.Complete`): 1-64 characters of `[A-Za-z0-9_.-]`, so never a '/' (inbound
/// records are keyed `PEER/ID`) and never large.
pub fn valid_wire_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// A connection's id: chosen by the initiator, sent in `Peer.Connect`, `Peer.Grant`,
/// `Peer.Disconnect` and the data-stream hello. The only ways to get one are [`ConnectionId::random`]
/// and [`ConnectionId::parse`] (a [`valid_wire_id`]), so every function that takes one knows it is
/// short and has no '/' — the check cannot be forgotten at a new entry point.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnectionId(String);

/// An id that is not 1-64 characters of `[A-Za-z0-9_.-]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} must be 1-64 characters from [A-Za-z0-9_.-]")]
pub struct InvalidId {
    pub what: &'static str,
}

impl ConnectionId {
    /// A fresh random id (this agent initiates the connection).
    pub fn random() -> ConnectionId {
        ConnectionId(new_id())
    }

    /// An id from the wire or a caller.
    pub fn parse(s: &str) -> Result<ConnectionId, InvalidId> {
        if valid_wire_id(s) {
            Ok(ConnectionId(s.to_string()))
        } else {
            Err(InvalidId { what: "connection_id" })
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for ConnectionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::fmt::Debug for ConnectionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl TryFrom<&str> for ConnectionId {
    type Error = InvalidId;
    fn try_from(s: &str) -> Result<Self, InvalidId> {
        ConnectionId::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_valid_wire_ids_and_differ() {
        let (a, b) = (new_id(), new_id());
        assert!(valid_wire_id(&a) && a.len() == 16);
        assert_ne!(a, b);
        for bad in ["", "a/b", "x y", &"a".repeat(65), "é"] {
            assert!(!valid_wire_id(bad), "{bad:?}");
        }
        assert!(valid_wire_id(&"a".repeat(64)));
    }

    #[test]
    fn connection_ids_exist_only_valid() {
        assert!(ConnectionId::random().as_str().len() == 16);
        assert_eq!(ConnectionId::parse("conn-1").unwrap().to_string(), "conn-1");
        for bad in ["", "a/b", "x y", &"a".repeat(65)] {
            assert_eq!(ConnectionId::parse(bad).unwrap_err().to_string(), "connection_id must be 1-64 characters from [A-Za-z0-9_.-]");
        }
    }
}
