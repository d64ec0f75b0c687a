//! Byte ranges against a region's length: the one check every offset a caller, a peer or a batch
//! names goes through, so an overflowing `offset + len` is refused before it is added anywhere.

/// `offset..offset+len` does not fit a region.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    #[error("offset {offset} + length {len} overflows")]
    Overflow { offset: u64, len: u64 },
    #[error("range {offset}..{end} is outside region {name:?} of {length} bytes")]
    Outside { name: String, offset: u64, end: u64, length: u64 },
}

/// Checks `offset..offset+len` against a region `name` of `length` bytes.
pub fn check_range(name: &str, length: u64, offset: u64, len: u64) -> Result<(), RangeError> {
    match offset.checked_add(len) {
        None => Err(RangeError::Overflow { offset, len }),
        Some(end) if end > length => Err(RangeError::Outside { name: name.to_string(), offset, end, length }),
        Some(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::{check_range, RangeError};

    #[test]
    fn the_last_byte_fits_and_one_past_it_does_not() {
        assert_eq!(check_range("r", 10, 0, 10), Ok(()));
        assert_eq!(check_range("r", 10, 10, 0), Ok(()));
        assert!(matches!(check_range("r", 10, 1, 10), Err(RangeError::Outside { end: 11, .. })));
        assert!(matches!(check_range("r", 10, u64::MAX, 1), Err(RangeError::Overflow { .. })));
        assert_eq!(
            check_range("r", 10, 4, 8).map_err(|e| e.to_string()),
            Err("range 4..12 is outside region \"r\" of 10 bytes".to_string())
        );
    }
}
