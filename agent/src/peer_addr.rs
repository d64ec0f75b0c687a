//! Peer addresses as callers spell them, parsed into one canonical spelling before they key
//! anything.
//!
//! A client names a peer agent by `host:port` in `Agent.Connect`, a submit or a channel. The
//! string is not an identity: `127.0.0.1:7470`, `127.0.0.1:07470`, `[::ffff:127.0.0.1]:7470` and
//! `LOCALHOST.:7470` reach the same socket. [`PeerAddr::parse`] is total and strict: the port is
//! decimal 1–65535 (leading zeros are dropped, so they cannot mint new keys), an IP literal is
//! printed in its canonical form (an IPv4-mapped IPv6 address as IPv4), a host name is lowercased
//! without a trailing dot and must be a valid DNS name. What reaches the peer pool is therefore a
//! bounded set of spellings per socket; the pool then keys connections on what answers there
//! (the certificate's node name under mTLS, the resolved socket address in plaintext), so even
//! distinct spellings of one agent (two host names, two of its interface addresses) share one
//! entry.
use std::fmt;
use std::net::{IpAddr, SocketAddr};

/// Longest address accepted (a DNS name is at most 253 characters, plus `:65535`).
pub const MAX_ADDR_LEN: usize = 260;

/// A parsed peer address: a canonical host (IP or lowercase DNS name) and a port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PeerAddr {
    host: Host,
    port: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Host {
    Ip(IpAddr),
    Name(String),
}

/// Why an address was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid peer address {addr:?}: {why}")]
pub struct AddrError {
    pub addr: String,
    pub why: &'static str,
}

impl PeerAddr {
    pub fn parse(s: &str) -> Result<PeerAddr, AddrError> {
        let err = |why| AddrError { addr: s.chars().take(64).collect(), why };
        if s.is_empty() {
            return Err(err("empty; expected host:port"));
        }
        if s.len() > MAX_ADDR_LEN {
            return Err(err("longer than 260 characters"));
        }
        let (host, port) = if let Some(rest) = s.strip_prefix('[') {
            let (h, p) = rest.split_once(']').ok_or_else(|| err("an IPv6 address needs a closing ']'"))?;
            let p = p.strip_prefix(':').ok_or_else(|| err("expected [v6]:port"))?;
            let ip: std::net::Ipv6Addr = h.parse().map_err(|_| err("not an IPv6 address between the brackets"))?;
            (Host::Ip(IpAddr::V6(ip)), p)
        } else {
            let (h, p) = s.rsplit_once(':').ok_or_else(|| err("no port; expected host:port"))?;
            if h.contains(':') {
                return Err(err("an IPv6 address must be written [v6]:port"));
            }
            let host = match h.parse::<std::net::Ipv4Addr>() {
                Ok(ip) => Host::Ip(IpAddr::V4(ip)),
                Err(_) => Host::Name(dns_name(h).ok_or_else(|| err("the host is neither an IP address nor a DNS name"))?),
            };
            (host, p)
        };
        let port = parse_port(port).ok_or_else(|| err("the port must be a decimal number 1-65535"))?;
        let host = match host {
            // An IPv4-mapped IPv6 address is the IPv4 socket; print it as such.
            Host::Ip(ip) => Host::Ip(ip.to_canonical()),
            h => h,
        };
        Ok(PeerAddr { host, port })
    }

    /// The socket address, if the host is an IP literal (a name needs resolving).
    pub fn socket(&self) -> Option<SocketAddr> {
        match &self.host {
            Host::Ip(ip) => Some(SocketAddr::new(*ip, self.port)),
            Host::Name(_) => None,
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Host::Ip(ip) => write!(f, "{}", SocketAddr::new(*ip, self.port)),
            Host::Name(n) => write!(f, "{n}:{}", self.port),
        }
    }
}

/// The canonical form of a resolved socket address (IPv4-mapped IPv6 as IPv4).
pub fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// A port of 1-8 ASCII digits in 1..=65535 (leading zeros are read and dropped: every such
/// spelling is the same port).
fn parse_port(p: &str) -> Option<u16> {
    if p.is_empty() || p.len() > 8 || !p.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    p.parse::<u16>().ok().filter(|&n| n != 0)
}

/// A DNS name in canonical form (lowercase, no trailing dot), or `None` if it is not one:
/// labels of 1-63 characters of `[a-z0-9-]`, not starting or ending with `-`; 253 in all.
fn dns_name(h: &str) -> Option<String> {
    let h = h.strip_suffix('.').unwrap_or(h).to_ascii_lowercase();
    if h.is_empty() || h.len() > 253 {
        return None;
    }
    let ok = h.split('.').all(|l| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    });
    // A name of digits and dots only would be an IPv4 spelling Rust refuses ("127.1",
    // "0127.0.0.1"); resolvers read some of those as addresses, so they are no names either.
    let numeric = h.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    (ok && !numeric).then_some(h)
}

#[cfg(test)]
mod tests {
    use super::PeerAddr;

    fn canon(s: &str) -> String {
        PeerAddr::parse(s).map(|a| a.to_string()).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn every_spelling_of_one_socket_is_one_address() {
        for s in ["127.0.0.1:7470", "127.0.0.1:07470", "127.0.0.1:0007470", "[::ffff:127.0.0.1]:7470", "[::FFFF:7f00:1]:7470"] {
            assert_eq!(canon(s), "127.0.0.1:7470", "{s}");
        }
        assert_eq!(canon("[::1]:7470"), "[::1]:7470");
        assert_eq!(canon("[0:0:0:0:0:0:0:1]:007470"), "[::1]:7470");
        assert_eq!(canon("LocalHost.:7470"), "localhost:7470");
        assert_eq!(canon("Node-B.cluster.local:7470"), "node-b.cluster.local:7470");
    }

    #[test]
    fn malformed_addresses_are_refused() {
        for s in [
            "",
            "127.0.0.1",
            "127.0.0.1:",
            "127.0.0.1:0",
            "127.0.0.1:65536",
            "127.0.0.1:+80",
            "127.0.0.1:000007470",
            "127.1:7470",
            "0127.0.0.1:7470",
            "::1:7470",
            "[::1:7470",
            "[::1]7470",
            "[127.0.0.1]:7470",
            "a b:1",
            "-a:1",
            "a..b:1",
            "a_b:1",
            "héllo:1",
            "a/b:1",
            "user@host:1",
            "http://host:1",
        ] {
            assert!(PeerAddr::parse(s).is_err(), "{s:?} was accepted as {:?}", PeerAddr::parse(s));
        }
        let long = format!("{}:1", "a".repeat(300));
        assert!(PeerAddr::parse(&long).is_err());
        let label = format!("{}.b:1", "a".repeat(64));
        assert!(PeerAddr::parse(&label).is_err());
    }

    #[test]
    fn an_error_quotes_a_bounded_prefix_of_the_input() {
        let e = PeerAddr::parse(&"x".repeat(10_000)).unwrap_err();
        assert!(e.to_string().len() < 200, "{e}");
    }
}
