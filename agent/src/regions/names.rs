//! Which names a region and an shm object may have, and the prefix of the agent's own objects.

use super::error::RegionError;

/// Longest region name.
pub const MAX_NAME_LEN: usize = 128;

/// Names of the agent's own shm objects (notification rings) start with this; no region may
/// create or adopt one (a region over a ring would let its holder forge notifications). A
/// region's default object is `xfer-<name>`, which never does.
pub const PRIVATE_SHM_PREFIX: &str = "xfer.ring.";

/// An shm object name: one path component under the shm directory, never `.`-leading.
pub(super) fn validate_object_name(object: &str) -> Result<(), RegionError> {
    if object.is_empty() || object.contains('/') || object.starts_with('.') || object.len() > 255 || object.contains('\0') {
        return Err(RegionError::Invalid(format!("invalid shm object name {object:?}")));
    }
    Ok(())
}

/// A region name: 1-128 characters of `A-Z a-z 0-9 . _ -`, not starting with `.`.
pub fn validate_name(name: &str) -> Result<(), RegionError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(RegionError::Invalid(format!(
            "invalid region name {name:?}: use 1-128 characters of A-Z a-z 0-9 . _ - (not starting with '.')"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        assert!(validate_name("weights-0.bin").is_ok());
        assert!(validate_name("").is_err());
        assert!(validate_name("a/b").is_err());
        assert!(validate_name(".hidden").is_err());
        assert!(validate_name(&"x".repeat(129)).is_err());
    }
}
