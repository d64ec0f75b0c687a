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

/// An id that is not 1-64 characters of `[A-Za-z0-9_.-]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} must be 1-64 characters from [A-Za-z0-9_.-]")]
pub struct InvalidId {
    pub what: &'static str,
}

/// An id newtype whose only constructors are `random` and `parse` (a [`valid_wire_id`]), so a
/// function that takes one knows it is short and has no '/' — the check cannot be forgotten at a
/// new entry point — and ids of different kinds cannot be swapped. It derefs to `str` for
/// lookups and formatting.
macro_rules! wire_id {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            /// A fresh random id.
            pub fn random() -> $name {
                $name(new_id())
            }

            /// An id from the wire or a caller.
            pub fn parse(s: &str) -> Result<$name, InvalidId> {
                if valid_wire_id(s) {
                    Ok($name(s.to_string()))
                } else {
                    Err(InvalidId { what: $what })
                }
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl std::ops::Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{:?}", self.0)
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl TryFrom<&str> for $name {
            type Error = InvalidId;
            fn try_from(s: &str) -> Result<Self, InvalidId> {
                $name::parse(s)
            }
        }
    };
}

wire_id!(
    /// A connection's id: chosen by the initiator, sent in `Peer.Connect`, `Peer.Grant`,
    /// `Peer.Disconnect` and every data-stream hello.
    ConnectionId,
    "connection_id"
);

wire_id!(
    /// A grant's id: made by the target, sent back by the grantee in `Peer.Revoke` and
    /// `Peer.Complete`.
    GrantId,
    "grant_id"
);

wire_id!(
    /// A transfer's id as the initiator made it; the target keys its inbound record `PEER/ID`.
    TransferId,
    "transfer_id"
);

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
    fn ids_exist_only_valid() {
        assert!(ConnectionId::random().as_str().len() == 16);
        assert_eq!(ConnectionId::parse("conn-1").unwrap().to_string(), "conn-1");
        let g = GrantId::parse("g-1").unwrap();
        assert!(g == "g-1" && &*g == "g-1", "compares and derefs as its text");
        for bad in ["", "a/b", "x y", &"a".repeat(65)] {
            assert_eq!(ConnectionId::parse(bad).unwrap_err().to_string(), "connection_id must be 1-64 characters from [A-Za-z0-9_.-]");
            assert_eq!(GrantId::parse(bad).unwrap_err().what, "grant_id");
            assert_eq!(TransferId::parse(bad).unwrap_err().what, "transfer_id");
        }
        assert_ne!(TransferId::random(), TransferId::random());
    }
}
