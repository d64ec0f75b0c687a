//! The range of every configured duration and size, checked at load.
//!
//! A duration becomes a deadline (`Instant::now() + d`, `SystemTime::now() + d`, hyper's
//! keepalive timers) and a size becomes an allocation or a sum: a value near `u64::MAX` that
//! loads without complaint panics later, on a runtime thread or at SIGTERM. So every
//! `HumanDuration` and `ByteSize` key has a ceiling here, far above any sane setting and far
//! below an overflow, and [`check`] refuses a value over it naming the key and the range (the
//! binary exits 64). A unit test finds every such key in the configuration's defaults, so a new
//! one cannot be added without a ceiling.
use std::time::Duration;

use xfer_common::ByteSize;

use super::error::{bad, ConfigError};
use super::root::Config;

const SECOND: Duration = Duration::from_secs(1);
const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(24 * 3600);
const DAYS_30: Duration = Duration::from_secs(30 * 24 * 3600);
/// Largest memory budget (1 PiB): sums of several stay far from `u64::MAX`.
const PIB: u64 = 1 << 50;

/// Every duration key, its value and its ceiling.
fn durations(c: &Config) -> [(&'static str, Duration, Duration); 12] {
    [
        ("transfer.timeout", c.transfer.timeout.0, DAYS_30),
        // Spinning holds a core: a second is already far more than a completion takes.
        ("verbs.poll_spin", c.verbs.poll_spin.0, SECOND),
        ("verbs.marker_spin", c.verbs.marker_spin.0, SECOND),
        ("limits.data_handshake_timeout", c.limits.data_handshake_timeout.0, HOUR),
        ("limits.data_idle_timeout", c.limits.data_idle_timeout.0, DAYS_30),
        ("limits.data_payload_timeout", c.limits.data_payload_timeout.0, HOUR),
        ("limits.grpc_keepalive", c.limits.grpc_keepalive.0, DAY),
        ("grants.default_ttl", c.grants.default_ttl.0, DAYS_30),
        ("grants.max_ttl", c.grants.max_ttl.0, DAYS_30),
        ("regions.retry_interval", c.regions.retry_interval.0, DAY),
        ("shutdown.grace", c.shutdown.grace.0, DAY),
        ("unix_lock_wait", c.unix_lock_wait.0, HOUR),
    ]
}

/// Every size key, its value and its range.
fn sizes(c: &Config) -> [(&'static str, u64, u64, u64); 5] {
    [
        ("transfer.chunk_size", c.transfer.chunk_size.0, 1, xfer_engine::shape::MAX_CHUNK),
        ("verbs.max_read_wr", c.verbs.max_read_wr.0, 4096, xfer_engine::shape::MAX_CHUNK),
        ("limits.max_registered_bytes", c.limits.max_registered_bytes.0, 0, PIB),
        ("limits.max_bench_bytes", c.limits.max_bench_bytes.0, 0, PIB),
        // tonic takes a usize, gRPC frames a message with a 32-bit length; a message of a GiB
        // is already far past what any request of this API needs.
        ("limits.max_message_size", c.limits.max_message_size.0, 4096, 1 << 30),
    ]
}

/// Refuses the first duration or size outside its range, naming the key and the range.
pub(super) fn check(c: &Config) -> Result<(), ConfigError> {
    for (key, v, max) in durations(c) {
        if v > max {
            return Err(bad(key, format!("{} is too long: must be between 0s and {}", text(v), text(max))));
        }
    }
    for (key, v, min, max) in sizes(c) {
        if !(min..=max).contains(&v) {
            return Err(bad(key, format!("{} is out of range: must be between {} and {}", ByteSize(v), ByteSize(min), ByteSize(max))));
        }
    }
    Ok(())
}

/// A duration as the configuration writes it (`30days`, `1h`).
fn text(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

#[cfg(test)]
mod tests {
    use super::super::Overrides;
    use super::*;

    /// Keys of the defaults whose values read as a duration (`30s`) or a size (`1MiB`).
    fn typed_keys() -> (Vec<String>, Vec<String>) {
        fn walk(prefix: &str, v: &serde_json::Value, d: &mut Vec<String>, s: &mut Vec<String>) {
            match v {
                serde_json::Value::Object(m) => {
                    for (k, v) in m {
                        walk(&if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") }, v, d, s);
                    }
                }
                // A unit is what tells them from numbers in strings (a file mode "0600").
                serde_json::Value::String(t) if t.chars().any(|c| c.is_ascii_alphabetic()) => {
                    if xfer_common::parse_duration(t).is_ok() {
                        d.push(prefix.to_string());
                    } else if xfer_common::parse_size(t).is_ok() {
                        s.push(prefix.to_string());
                    }
                }
                _ => {}
            }
        }
        let (mut d, mut s) = (Vec::new(), Vec::new());
        walk("", &serde_json::to_value(Config::default()).unwrap(), &mut d, &mut s);
        (d, s)
    }

    #[test]
    fn every_duration_and_size_key_has_a_range() {
        let c = Config::default();
        let (d, s) = typed_keys();
        let mut dk: Vec<&str> = durations(&c).iter().map(|x| x.0).collect();
        let mut sk: Vec<&str> = sizes(&c).iter().map(|x| x.0).collect();
        dk.sort_unstable();
        sk.sort_unstable();
        let (mut d, mut s) = (d, s);
        d.sort_unstable();
        s.sort_unstable();
        assert_eq!(d, dk, "duration keys of the configuration vs. those with a ceiling");
        assert_eq!(s, sk, "size keys of the configuration vs. those with a range");
        assert!(check(&c).is_ok(), "the defaults are in range");
    }

    /// Each key set to (nearly) 2^64 seconds or bytes through the environment: load fails and
    /// names the key. Each at its ceiling loads.
    #[test]
    fn a_huge_value_of_any_key_fails_to_load_naming_it() {
        let c = Config::default();
        let env_of = |key: &str| format!("XFER_{}", key.to_uppercase().replace('.', "__"));
        let load = |key: &str, v: String| Config::load(None, vec![(env_of(key), v)], &Overrides::default());
        for (key, _, max) in durations(&c) {
            let e = load(key, u64::MAX.to_string()).unwrap_err();
            assert_eq!(e.key, key, "{e}");
            assert!(e.problem.contains("must be between 0s and"), "{e}");
            let e = load(key, (max.as_secs() + 1).to_string()).unwrap_err();
            assert_eq!(e.key, key, "one second past the ceiling: {e}");
            // grants.default_ttl at the ceiling is fine on its own.
            load(key, max.as_secs().to_string()).unwrap_or_else(|e| panic!("{key} at its ceiling: {e}"));
        }
        for (key, _, _, max) in sizes(&c) {
            let e = load(key, u64::MAX.to_string()).unwrap_err();
            assert_eq!(e.key, key, "{e}");
            let e = load(key, (max + 1).to_string()).unwrap_err();
            assert_eq!(e.key, key, "{e}");
        }
    }
}
