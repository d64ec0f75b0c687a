//! Range checks of an offset and a length against a region.

use super::error::RegionError;

/// Checks `offset..offset+len` against a region `name` of `length` bytes.
pub fn check_range(name: &str, length: u64, offset: u64, len: u64) -> Result<(), RegionError> {
    match offset.checked_add(len) {
        None => Err(RegionError::Invalid(format!("offset {offset} + length {len} overflows"))),
        Some(end) if end > length => {
            Err(RegionError::Invalid(format!("range {offset}..{end} is outside region {name:?} of {length} bytes")))
        }
        Some(_) => Ok(()),
    }
}
