//! Range checks of an offset and a length against a region.

use super::error::RegionError;

/// Checks `offset..offset+len` against a region `name` of `length` bytes.
pub fn check_range(name: &str, length: u64, offset: u64, len: u64) -> Result<(), RegionError> {
    Ok(xfer_engine::range::check_range(name, length, offset, len)?)
}

impl From<xfer_engine::range::RangeError> for RegionError {
    fn from(e: xfer_engine::range::RangeError) -> RegionError {
        RegionError::Invalid(e.to_string())
    }
}
