//! Addresses on the command line: agent addresses (`host`, `host:port`, `[v6]:port`) and region
//! locations (`[AGENT:]REGION[@OFFSET]`).

use std::fmt;

use crate::units::parse_size;

/// The gRPC port an agent listens on by default.
pub const DEFAULT_PORT: u16 = 7470;

/// The agent address used when neither `--agent` nor `$XFER_AGENT` is given.
pub const DEFAULT_AGENT: &str = "127.0.0.1:7470";

/// Normalises an agent address to `host:port`: a host without a port gets [`DEFAULT_PORT`], IPv6
/// literals must be bracketed (`[::1]` or `[::1]:7470`). A leading `http://` is accepted and
/// dropped; a leading `https://` is kept on the result (`https://host:port`): it asks for TLS,
/// which [`split_tls_scheme`] takes off again where the TLS options are known.
pub fn normalize_agent(input: &str) -> Result<String, String> {
    let s = input.trim();
    // The agent's local unix socket: `unix:///abs/path` (or `unix:/abs/path`).
    if let Some(rest) = s.strip_prefix("unix:") {
        let path = rest.strip_prefix("//").unwrap_or(rest);
        if !path.starts_with('/') || path.len() < 2 {
            return Err(format!("invalid agent address {input:?}: a unix socket is unix:///absolute/path"));
        }
        return Ok(format!("unix://{path}"));
    }
    if let Some(rest) = s.strip_prefix("https://") {
        return normalize_plain(input, rest).map(|a| format!("https://{a}"));
    }
    normalize_plain(input, s.strip_prefix("http://").unwrap_or(s))
}

/// `https://host:port` → (`host:port`, true); anything else → (itself, false).
pub fn split_tls_scheme(agent: &str) -> (&str, bool) {
    match agent.strip_prefix("https://") {
        Some(a) => (a, true),
        None => (agent, false),
    }
}

fn normalize_plain(input: &str, s: &str) -> Result<String, String> {
    if s.contains("://") {
        return Err(format!("invalid agent address {input:?}: only http://, https:// and unix:// are understood"));
    }
    let s = s.strip_suffix('/').unwrap_or(s);
    if s.is_empty() {
        return Err("empty agent address".into());
    }
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or_else(|| format!("invalid agent address {input:?}: missing ']'"))?;
        if host.is_empty() || host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("invalid agent address {input:?}: {host:?} is not an IPv6 address"));
        }
        return match after {
            "" => Ok(format!("[{host}]:{DEFAULT_PORT}")),
            _ => {
                let port = after.strip_prefix(':').ok_or_else(|| format!("invalid agent address {input:?}: expected ':PORT' after ']'"))?;
                Ok(format!("[{host}]:{}", parse_port(input, port)?))
            }
        };
    }
    match s.split_once(':') {
        None => Ok(format!("{s}:{DEFAULT_PORT}")),
        Some((host, port)) => {
            if port.contains(':') {
                return Err(format!("invalid agent address {input:?}: IPv6 addresses must be bracketed, e.g. [::1]:7470"));
            }
            if host.is_empty() {
                return Err(format!("invalid agent address {input:?}: missing host"));
            }
            Ok(format!("{host}:{}", parse_port(input, port)?))
        }
    }
}

fn parse_port(input: &str, port: &str) -> Result<u16, String> {
    match port.parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(format!("invalid agent address {input:?}: bad port {port:?}")),
    }
}

/// One side of `cp`, or the target of `put`/`get`: `[AGENT:]REGION[@OFFSET]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// Normalised `host:port`, or `None` for "the agent given by `--agent`".
    pub agent: Option<String>,
    pub region: String,
    pub offset: u64,
}

impl Location {
    /// The agent holding this location, falling back to `default` (the `--agent` address).
    pub fn agent_or<'a>(&'a self, default: &'a str) -> &'a str {
        self.agent.as_deref().unwrap_or(default)
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(agent) = &self.agent {
            write!(f, "{agent}:")?;
        }
        write!(f, "{}", self.region)?;
        if self.offset != 0 {
            write!(f, "@{}", self.offset)?;
        }
        Ok(())
    }
}

/// Parses `[AGENT:]REGION[@OFFSET]`. The LAST `:` separates the agent address from the region, so
/// `[::1]:7470:reg@10` and `host:reg` both work; the offset accepts human sizes (`r@4KiB`).
pub fn parse_location(input: &str) -> Result<Location, String> {
    let s = input.trim();
    let (agent, rest) = match s.rfind(':') {
        Some(i) => {
            let agent = &s[..i];
            if agent.is_empty() {
                return Err(format!("invalid location {input:?}: empty agent address before ':'"));
            }
            let agent = normalize_agent(agent).map_err(|e| format!("in {input:?}: {e}"))?;
            (Some(agent), &s[i + 1..])
        }
        None => (None, s),
    };
    let (region, offset) = match rest.split_once('@') {
        Some((region, off)) => {
            if off.trim().is_empty() {
                return Err(format!("invalid location {input:?}: missing offset after '@'"));
            }
            let off = parse_size(off).map_err(|e| format!("invalid offset in {input:?}: {e}"))?;
            (region, off)
        }
        None => (rest, 0),
    };
    if region.is_empty() {
        return Err(format!("invalid location {input:?}: missing region name (expected [AGENT:]REGION[@OFFSET])"));
    }
    if region.contains('@') || region.contains(char::is_whitespace) {
        return Err(format!("invalid location {input:?}: bad region name {region:?}"));
    }
    Ok(Location { agent, region: region.to_string(), offset })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(agent: Option<&str>, region: &str, offset: u64) -> Location {
        Location { agent: agent.map(str::to_string), region: region.to_string(), offset }
    }

    #[test]
    fn agent_addresses() {
        assert_eq!(normalize_agent("node1").as_deref(), Ok("node1:7470"));
        assert_eq!(normalize_agent("node1:9000").as_deref(), Ok("node1:9000"));
        assert_eq!(normalize_agent("10.0.0.2").as_deref(), Ok("10.0.0.2:7470"));
        assert_eq!(normalize_agent("[::1]").as_deref(), Ok("[::1]:7470"));
        assert_eq!(normalize_agent("[::1]:8000").as_deref(), Ok("[::1]:8000"));
        assert_eq!(normalize_agent("http://h:1/").as_deref(), Ok("h:1"));
        assert!(normalize_agent("::1").unwrap_err().contains("bracketed"));
        // https:// asks for TLS: kept on the address until the TLS options are known.
        assert_eq!(normalize_agent("https://node-b:7470/").as_deref(), Ok("https://node-b:7470"));
        assert_eq!(normalize_agent("https://[::1]").as_deref(), Ok("https://[::1]:7470"));
        assert_eq!(split_tls_scheme("https://node-b:7470"), ("node-b:7470", true));
        assert_eq!(normalize_agent("unix:///run/xfer/agent.sock").unwrap(), "unix:///run/xfer/agent.sock");
        assert_eq!(normalize_agent("unix:/run/xfer/agent.sock").unwrap(), "unix:///run/xfer/agent.sock");
        assert!(normalize_agent("unix://relative.sock").is_err());
        assert_eq!(split_tls_scheme("node-b:7470"), ("node-b:7470", false));
        assert!(normalize_agent("grpc://h:1").unwrap_err().contains("only http://, https:// and unix://"));
        assert!(normalize_agent("h:port").unwrap_err().contains("bad port"));
        assert!(normalize_agent("h:0").is_err());
        assert!(normalize_agent("h:70000").is_err());
        assert!(normalize_agent("[::1").unwrap_err().contains("missing ']'"));
        assert!(normalize_agent("[nothost]:1").is_err());
        assert!(normalize_agent("[::1]x").is_err());
        assert!(normalize_agent(":7470").unwrap_err().contains("missing host"));
        assert!(normalize_agent("").is_err());
    }

    #[test]
    fn plain_region() {
        assert_eq!(parse_location("weights"), Ok(loc(None, "weights", 0)));
        assert_eq!(parse_location("r@10"), Ok(loc(None, "r", 10)));
        assert_eq!(parse_location("r@4KiB"), Ok(loc(None, "r", 4096)));
        assert_eq!(parse_location("r@1.5MiB"), Ok(loc(None, "r", 3 << 19)));
    }

    #[test]
    fn with_agent() {
        assert_eq!(parse_location("node-b:r"), Ok(loc(Some("node-b:7470"), "r", 0)));
        assert_eq!(parse_location("node-b:9000:r@64MiB"), Ok(loc(Some("node-b:9000"), "r", 64 << 20)));
        assert_eq!(parse_location("[::1]:7470:reg@10"), Ok(loc(Some("[::1]:7470"), "reg", 10)));
        assert_eq!(parse_location("[::1]:reg"), Ok(loc(Some("[::1]:7470"), "reg", 0)));
        assert_eq!(parse_location("127.0.0.1:7471:dst"), Ok(loc(Some("127.0.0.1:7471"), "dst", 0)));
    }

    #[test]
    fn errors() {
        assert!(parse_location("").unwrap_err().contains("missing region"));
        assert!(parse_location("host:").unwrap_err().contains("missing region"));
        assert!(parse_location("@5").unwrap_err().contains("missing region"));
        assert!(parse_location("r@").unwrap_err().contains("missing offset"));
        assert!(parse_location("r@lots").unwrap_err().contains("invalid offset"));
        assert!(parse_location("r@1@2").unwrap_err().contains("invalid offset"));
        assert!(parse_location(":r").unwrap_err().contains("empty agent"));
        assert!(parse_location("::1:r").unwrap_err().contains("bracketed"));
        assert!(parse_location("h:x:r").unwrap_err().contains("bad port"));
    }

    #[test]
    fn display_round_trips() {
        for s in ["r", "h:7470:r", "r@4096", "[::1]:7470:r@1"] {
            let l = parse_location(s).unwrap();
            assert_eq!(parse_location(&l.to_string()), Ok(l));
        }
        assert_eq!(loc(Some("h:1"), "r", 5).agent_or("d:2"), "h:1");
        assert_eq!(loc(None, "r", 5).agent_or("d:2"), "d:2");
    }
}
