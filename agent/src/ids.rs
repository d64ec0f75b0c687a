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
}
