//! Byte sizes: one grammar for the agent's configuration and xferctl's flags (`4096`, `4KiB`,
//! `1.5GiB`, Kubernetes' `16Gi`, decimal `3MB`), and their formatting.
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Parses a byte size: a plain number of bytes (`4096`) or a number with a unit.
///
/// Binary units (`K`, `KiB`, `Ki`, `M`, `MiB`, `Mi`, `G`, `GiB`, `Gi`, `T`, `TiB`, `Ti`, `P`, `PiB`,
/// `Pi`, `E`, `EiB`, `Ei`) are powers of 1024 — `Ki`/`Mi`/`Gi` are Kubernetes' quantity suffixes,
/// so a pod's `16Gi` reads the same here; decimal units (`KB`, `MB`, `GB`, `TB`, `PB`, `EB`) are
/// powers of 1000; `B` is bytes. A bare `K`/`M`/`G` is binary as in `dd` and `ls -h` (Kubernetes
/// reads `16G` as 16×10⁹: write `16Gi` or `16GB` to be unambiguous). Units are case-insensitive and
/// may be separated from the number by spaces. A fraction is allowed (`1.5GiB`) as long as the
/// result is a whole number of bytes. Overflow of `u64` is an error.
pub fn parse_size(input: &str) -> Result<u64, String> {
    let s = input.trim();
    if s.is_empty() {
        return Err("empty size".into());
    }
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_')).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number: String = number.chars().filter(|&c| c != '_').collect();
    let unit = unit.trim();
    if number.is_empty() {
        return Err(format!("invalid size {input:?}: expected a number such as 4096, 4KiB, 64MiB or 1GiB"));
    }
    let multiplier: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "ki" => 1 << 10,
        "m" | "mib" | "mi" => 1 << 20,
        "g" | "gib" | "gi" => 1 << 30,
        "t" | "tib" | "ti" => 1 << 40,
        "p" | "pib" | "pi" => 1 << 50,
        "e" | "eib" | "ei" => 1 << 60,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        "eb" => 1_000_000_000_000_000_000,
        _ => {
            return Err(format!("invalid size {input:?}: unknown unit {unit:?} (use B, KiB, MiB, GiB, TiB, Ki, Mi, Gi or KB, MB, GB, TB)"))
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
    let too_large = || format!("invalid size {input:?}: too large (maximum is {} bytes)", u64::MAX);
    let parse_digits = |d: &str| -> Result<u128, String> {
        if d.is_empty() {
            Ok(0)
        } else {
            d.parse::<u128>().map_err(|_| too_large())
        }
    };
    let scale = 10u128.pow(frac_part.len() as u32);
    let mantissa =
        parse_digits(int_part)?.checked_mul(scale).and_then(|v| v.checked_add(parse_digits(frac_part).ok()?)).ok_or_else(too_large)?;
    let scaled = mantissa.checked_mul(multiplier).ok_or_else(too_large)?;
    if scaled % scale != 0 {
        return Err(format!("invalid size {input:?}: not a whole number of bytes"));
    }
    u64::try_from(scaled / scale).map_err(|_| too_large())
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
        if bytes >= unit && bytes.is_multiple_of(unit) {
            return format!("{}{name}", bytes / unit);
        }
    }
    bytes.to_string()
}

/// A byte count in configuration: a number, or a string in [`parse_size`]'s grammar. Displays
/// (and serializes) in the largest binary unit that divides it (`64MiB`), else in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_size(s).map(ByteSize)
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_size_compact(self.0))
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(ByteSize(n)),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
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
        for bad in ["", " ", "KiB", "abc", "4XB", "4KiBs", "-1", "1..5KiB", "1.2.3", ".", "0x10", "4 K i B", "1e3"] {
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
        assert!(parse_size("99999999999999999999999999999999999999999999GiB").unwrap_err().contains("too large"));
        assert!(parse_size("17179869184GiB").unwrap_err().contains("too large"));
    }

    #[test]
    fn kubernetes_quantities_and_the_agents_old_grammar() {
        assert_eq!(parse_size("16Gi"), Ok(16 << 30));
        assert_eq!(parse_size("512Mi"), Ok(512 << 20));
        assert_eq!(parse_size("4Ki"), Ok(4096));
        assert_eq!(parse_size("1Ti"), Ok(1 << 40));
        assert_eq!(parse_size("4kib"), Ok(4096));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("2TiB"), Ok(2 << 40));
        assert_eq!(parse_size("1kB"), Ok(1000));
    }

    #[test]
    fn byte_size_round_trips_through_text_and_serde() {
        for (s, shown) in [
            ("4096", "4KiB"),
            ("4KiB", "4KiB"),
            ("64MiB", "64MiB"),
            ("1GiB", "1GiB"),
            ("2TiB", "2TiB"),
            ("1000", "1000"),
            ("16Gi", "16GiB"),
        ] {
            let b: ByteSize = s.parse().unwrap();
            assert_eq!(b.to_string(), shown);
            assert_eq!(shown.parse::<ByteSize>().unwrap(), b, "what is shown reads back");
        }
        let v: ByteSize = serde_json::from_str("\"16Gi\"").unwrap();
        assert_eq!(v, ByteSize(16 << 30));
        let n: ByteSize = serde_json::from_str("8192").unwrap();
        assert_eq!(n, ByteSize(8192));
        assert_eq!(serde_json::to_string(&ByteSize(64 << 20)).unwrap(), "\"64MiB\"");
        assert!(serde_json::from_str::<ByteSize>("\"4XB\"").unwrap_err().to_string().contains("unknown unit"));
    }

    #[test]
    fn formatting() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(64 << 20), "64.0 MiB");
        assert_eq!(format_bytes(3 << 29), "1.5 GiB");
        assert_eq!(format_size_compact(4096), "4KiB");
        assert_eq!(format_size_compact(16 << 20), "16MiB");
        assert_eq!(format_size_compact(1000), "1000");
    }
}
