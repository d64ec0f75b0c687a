//! Human sizes and durations for flags and output. Parsing and size formatting are
//! [`xfer_common`]'s (the agent's configuration reads the same grammar); rates are xferctl's.

pub use xfer_common::{format_bytes, format_size_compact, parse_duration, parse_size};

/// Bytes per second expressed in GiB/s (0 when no time elapsed).
pub fn gib_per_s(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / (1u64 << 30) as f64
    } else {
        0.0
    }
}

/// Bytes per second expressed in Gbit/s (10^9 bits), the unit perftest reports.
pub fn gbit_per_s(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 * 8.0 / seconds / 1e9
    } else {
        0.0
    }
}

/// The summary line used by `cp`, `put`, `get` and `demo`: `N bytes in S s (X GiB/s)`.
pub fn rate_summary(bytes: u64, seconds: f64) -> String {
    format!("{bytes} bytes in {seconds:.3} s ({:.3} GiB/s)", gib_per_s(bytes, seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates() {
        assert_eq!(rate_summary(1 << 30, 2.0), "1073741824 bytes in 2.000 s (0.500 GiB/s)");
        assert_eq!(gbit_per_s(125_000_000, 1.0), 1.0);
        assert_eq!(gib_per_s(10, 0.0), 0.0);
    }
}
