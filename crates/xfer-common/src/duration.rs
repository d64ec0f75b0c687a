//! Durations: one grammar for the agent's configuration and xferctl's flags (`30s`, `5m`,
//! `1h30m`, `250ms`; a bare number is seconds).
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

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
    humantime::parse_duration(s).map_err(|e| format!("invalid duration {input:?}: {e} (examples: 30s, 5m, 1h30m, 250ms)"))
}

/// A duration in configuration, in [`parse_duration`]'s grammar; serializes as humantime text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HumanDuration(pub Duration);

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(self.0).to_string())
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_duration(&s).map(HumanDuration).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("12"), Ok(Duration::from_secs(12)));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("soon").unwrap_err().contains("invalid duration"));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("-5s").is_err());
    }

    #[test]
    fn human_duration_serde() {
        let d: HumanDuration = serde_json::from_str("\"1h 30m\"").unwrap();
        assert_eq!(d.0, Duration::from_secs(5400));
        assert_eq!(serde_json::to_string(&HumanDuration(Duration::from_millis(250))).unwrap(), "\"250ms\"");
        assert!(serde_json::from_str::<HumanDuration>("\"soon\"").is_err());
    }
}
