//! Human sizes and durations: parsing (`4KiB`, `1.5GiB`, `30s`) and formatting.

use std::time::Duration;

/// Parses a byte size: a plain number of bytes (`4096`) or a number with a unit.
///
/// Binary units (`K`, `KiB`, `M`, `MiB`, `G`, `GiB`, `T`, `TiB`, `P`, `PiB`, `E`, `EiB`) are powers
/// of 1024; decimal units (`KB`, `MB`, `GB`, `TB`, `PB`, `EB`) are powers of 1000; `B` is bytes.
/// Units are case-insensitive and may be separated from the number by spaces. A fraction is allowed
/// (`1.5GiB`) as long as the result is a whole number of bytes. Overflow of `u64` is an error.
pub fn parse_size(input: &str) -> Result<u64, String> {
    let s = input.trim();
    if s.is_empty() {
        return Err("empty size".into());
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number: String = number.chars().filter(|&c| c != '_').collect();
    let unit = unit.trim();
    if number.is_empty() {
        return Err(format!(
            "invalid size {input:?}: expected a number such as 4096, 4KiB, 64MiB or 1GiB"
        ));
    }
    let multiplier: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "p" | "pib" => 1 << 50,
        "e" | "eib" => 1 << 60,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        "eb" => 1_000_000_000_000_000_000,
        _ => {
            return Err(format!(
                "invalid size {input:?}: unknown unit {unit:?} (use B, KiB, MiB, GiB, TiB or KB, MB, GB, TB)"
            ))
        }
    };
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number.as_str(), ""),
    };
    if frac_part.contains('.') || (int_part.is_empty() && frac_part.is_empty()) {
        return Err(format!("invalid size {input:?}: malformed number"));
    }
    // Exact decimal arithmetic in u128: value = (int * 10^f + frac) * multiplier / 10^f.
    if frac_part.len() > 18 {
        return Err(format!("invalid size {input:?}: too many decimal places"));
    }
    let too_large = || {
        format!(
            "invalid size {input:?}: too large (maximum is {} bytes)",
            u64::MAX
        )
    };
    let parse_digits = |d: &str| -> Result<u128, String> {
        if d.is_empty() {
            Ok(0)
        } else {
            d.parse::<u128>().map_err(|_| too_large())
        }
    };
    let scale = 10u128.pow(frac_part.len() as u32);
    let mantissa = parse_digits(int_part)?
        .checked_mul(scale)
        .and_then(|v| v.checked_add(parse_digits(frac_part).ok()?))
        .ok_or_else(too_large)?;
    let scaled = mantissa.checked_mul(multiplier).ok_or_else(too_large)?;
    if scaled % scale != 0 {
        return Err(format!(
            "invalid size {input:?}: not a whole number of bytes"
        ));
    }
    u64::try_from(scaled / scale).map_err(|_| too_large())
}

/// Parses a duration such as `30s`, `5m`, `1h30m` or `250ms` (humantime syntax). A bare number is
/// taken as seconds.
pub fn parse_duration(input: &str) -> Result<Duration, String> {
    let s = input.trim();
    if s.is_empty() {
        return Err("empty duration".into());
    }
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(s)
        .map_err(|e| format!("invalid duration {input:?}: {e} (examples: 30s, 5m, 1h30m, 250ms)"))
}

/// Formats a byte count with a binary unit, e.g. `64.0 MiB`; exact counts below 1 KiB.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Formats a size compactly for tables and option values: `4KiB`, `1MiB`, or bytes when not a
/// whole number of a binary unit.
pub fn format_size_compact(bytes: u64) -> String {
    const UNITS: [(&str, u32); 4] = [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)];
    for (name, shift) in UNITS {
        let unit = 1u64 << shift;
        if bytes >= unit && bytes % unit == 0 {
            return format!("{}{name}", bytes / unit);
        }
    }
    bytes.to_string()
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
    format!(
        "{bytes} bytes in {seconds:.3} s ({:.3} GiB/s)",
        gib_per_s(bytes, seconds)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_bytes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size(" 17 "), Ok(17));
        assert_eq!(parse_size("1_048_576"), Ok(1 << 20));
        assert_eq!(parse_size("10B"), Ok(10));
    }

    #[test]
    fn binary_units() {
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("64 MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("1gib"), Ok(1 << 30));
        assert_eq!(parse_size("2TiB"), Ok(2 << 40));
        assert_eq!(parse_size("15EiB"), Ok(15 << 60));
    }

    #[test]
    fn decimal_units() {
        assert_eq!(parse_size("1KB"), Ok(1000));
        assert_eq!(parse_size("3MB"), Ok(3_000_000));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
    }

    #[test]
    fn fractions() {
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("0.5KiB"), Ok(512));
        assert_eq!(parse_size(".5KiB"), Ok(512));
        assert_eq!(parse_size("2.KiB"), Ok(2048));
        assert_eq!(parse_size("1.5KB"), Ok(1500));
        // 0.1 KiB = 102.4 bytes: not whole.
        assert!(parse_size("0.1KiB").unwrap_err().contains("whole number"));
        assert!(parse_size("1.5").unwrap_err().contains("whole number"));
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "", " ", "KiB", "abc", "4XB", "4KiBs", "-1", "1..5KiB", "1.2.3", ".", "0x10",
            "4 K i B", "1e3",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} should be rejected");
        }
        assert!(parse_size("4XB").unwrap_err().contains("unknown unit"));
    }

    #[test]
    fn rejects_overflow() {
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
        let err = parse_size("18446744073709551616").unwrap_err();
        assert!(err.contains("too large"), "{err}");
        assert!(parse_size("16EiB").unwrap_err().contains("too large"));
        assert!(
            parse_size("99999999999999999999999999999999999999999999GiB")
                .unwrap_err()
                .contains("too large")
        );
        assert!(parse_size("17179869184GiB")
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("12"), Ok(Duration::from_secs(12)));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("soon")
            .unwrap_err()
            .contains("invalid duration"));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("-5s").is_err());
    }

    #[test]
    fn formatting() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(64 << 20), "64.0 MiB");
        assert_eq!(format_bytes(3 << 29), "1.5 GiB");
        assert_eq!(format_size_compact(4096), "4KiB");
        assert_eq!(format_size_compact(16 << 20), "16MiB");
        assert_eq!(format_size_compact(1000), "1000");
        assert_eq!(
            rate_summary(1 << 30, 2.0),
            "1073741824 bytes in 2.000 s (0.500 GiB/s)"
        );
        assert_eq!(gbit_per_s(125_000_000, 1.0), 1.0);
        assert_eq!(gib_per_s(10, 0.0), 0.0);
    }
}
