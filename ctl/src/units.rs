//! Human sizes and durations for flags and output. Parsing and size formatting are
//! [`xfer_common`]'s (the agent's configuration reads the same grammar); rates are xferctl's.

use std::sync::atomic::{AtomicBool, Ordering};

pub use xfer_common::{format_bytes, format_size_compact, parse_duration};

/// Whether a decimal-unit size was warned about already (once per run is enough).
static WARNED_DECIMAL: AtomicBool = AtomicBool::new(false);

/// A size flag's value (`4KiB`, `1GiB`, `1GB`). Regions, chunks and pages are powers of two, so
/// a decimal unit (`1GB` = 10^9 bytes) is most likely a slip: it is honoured, with one warning
/// on stderr per run.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let n = xfer_common::parse_size(s)?;
    if let Some(unit) = decimal_unit(s) {
        if !WARNED_DECIMAL.swap(true, Ordering::Relaxed) {
            eprintln!(
                "warning: {s} uses the decimal unit {unit} ({n} bytes); write {}iB for a power of two",
                unit.trim_end_matches(['B', 'b'])
            );
        }
    }
    Ok(n)
}

/// The decimal unit `s` ends with (`kB`, `MB`, `GB`, ...), if any.
fn decimal_unit(s: &str) -> Option<&str> {
    let unit = s.trim().trim_start_matches(|c: char| c.is_ascii_digit() || c == '.' || c == '_').trim();
    let lower = unit.to_ascii_lowercase();
    matches!(lower.as_str(), "kb" | "mb" | "gb" | "tb" | "pb" | "eb").then_some(unit)
}

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
    fn decimal_units_are_told_apart() {
        assert_eq!(decimal_unit("1GB"), Some("GB"));
        assert_eq!(decimal_unit("64 kB"), Some("kB"));
        assert_eq!((decimal_unit("1GiB"), decimal_unit("4096"), decimal_unit("1G")), (None, None, None));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
    }

    #[test]
    fn rates() {
        assert_eq!(rate_summary(1 << 30, 2.0), "1073741824 bytes in 2.000 s (0.500 GiB/s)");
        assert_eq!(gbit_per_s(125_000_000, 1.0), 1.0);
        assert_eq!(gib_per_s(10, 0.0), 0.0);
    }
}
