//! Whether a grant's key fits the connection it was granted on, checked by the initiator when the
//! grant arrives: a peer's answer is input, and a key list that is short, long or of the wrong
//! form would otherwise only fail at the first post (or, for a QP that happens to be posted last,
//! after other QPs already moved bytes). Refusing it up front means no work request is posted
//! under a key the connection cannot use.
use crate::{PathInfo, RemoteKey};

impl RemoteKey {
    /// Whether this key gives every QP of a connection of `qps` QPs over `paths` the key it would
    /// post with: a per-QP list has exactly one key per QP; an `Each` list has a plain key per
    /// QP, except that a last token serves every QP past the list (the tcp rail's QPs), and never
    /// more keys than QPs; one rkey cannot serve a connection over several devices, since each
    /// device has its own keys. `Err` says what does not fit, in the peer's terms.
    pub fn fits(&self, qps: usize, paths: &[PathInfo]) -> Result<(), String> {
        let devices = paths.iter().filter(|p| !p.standby).count();
        match self {
            RemoteKey::Rkey(_) if devices > 1 => {
                Err(format!("one rkey for a connection over {devices} devices (each device has its own keys: one per QP is needed)"))
            }
            RemoteKey::Rkey(_) | RemoteKey::Token(_) => Ok(()),
            RemoteKey::PerQp(keys) if keys.len() == qps => Ok(()),
            RemoteKey::PerQp(keys) => Err(format!("{} per-QP keys for a connection of {qps} QPs", keys.len())),
            RemoteKey::Each(keys) => {
                if keys.len() > qps {
                    return Err(format!("{} per-QP keys for a connection of {qps} QPs", keys.len()));
                }
                if keys.iter().any(|k| matches!(k, RemoteKey::PerQp(_) | RemoteKey::Each(_))) {
                    return Err("a per-QP key list inside a per-QP key list".into());
                }
                if keys.len() < qps && !matches!(keys.last(), Some(RemoteKey::Token(_))) {
                    return Err(format!("{} per-QP keys for a connection of {qps} QPs, and no token last to serve the rest", keys.len()));
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{PathInfo, RemoteKey};

    fn path(device: &str, qps: std::ops::Range<usize>, standby: bool) -> PathInfo {
        PathInfo { local_device: device.into(), remote_device: device.into(), qps, standby, mtu: 0 }
    }

    #[test]
    fn keys_that_fit_their_connection() {
        let one = [path("", 0..4, false)];
        let two = [path("rxe0", 0..2, false), path("rxe2", 2..4, false)];
        let fallback = [path("rxe0", 0..2, false), path("tcp", 2..4, true)];
        assert!(RemoteKey::Rkey(1).fits(4, &one).is_ok());
        assert!(RemoteKey::Token([1; 16]).fits(4, &one).is_ok());
        assert!(RemoteKey::PerQp(vec![1, 2, 3, 4].into()).fits(4, &two).is_ok());
        // An rkey per verbs QP, then one token for the tcp rail's QPs.
        let each = RemoteKey::Each(vec![RemoteKey::Rkey(1), RemoteKey::Rkey(2), RemoteKey::Token([3; 16])].into());
        assert!(each.fits(4, &fallback).is_ok());
        let all =
            RemoteKey::Each(vec![RemoteKey::Rkey(1), RemoteKey::Rkey(2), RemoteKey::Token([3; 16]), RemoteKey::Token([3; 16])].into());
        assert!(all.fits(4, &fallback).is_ok());
    }

    /// What a hostile or mistaken peer can answer: lists short, long, empty or nested, and one
    /// rkey for several devices. Each is refused naming the counts; none panics.
    #[test]
    fn keys_that_do_not_fit_are_refused_with_the_counts() {
        let one = [path("", 0..4, false)];
        let two = [path("rxe0", 0..2, false), path("rxe2", 2..4, false)];
        let e = RemoteKey::PerQp(vec![1, 2, 3].into()).fits(4, &two).unwrap_err();
        assert_eq!(e, "3 per-QP keys for a connection of 4 QPs");
        let e = RemoteKey::PerQp(vec![1; 5].into()).fits(4, &one).unwrap_err();
        assert_eq!(e, "5 per-QP keys for a connection of 4 QPs");
        assert!(RemoteKey::PerQp(Vec::new().into()).fits(1, &one).is_err());
        assert!(RemoteKey::PerQp(vec![1; 70_000].into()).fits(64, &one).is_err());
        let e = RemoteKey::Rkey(9).fits(4, &two).unwrap_err();
        assert!(e.contains("one rkey for a connection over 2 devices"), "{e}");
        let short = RemoteKey::Each(vec![RemoteKey::Rkey(1), RemoteKey::Rkey(2)].into());
        assert!(short.fits(3, &one).unwrap_err().contains("no token last"));
        let long = RemoteKey::Each(vec![RemoteKey::Rkey(1); 5].into());
        assert_eq!(long.fits(4, &one).unwrap_err(), "5 per-QP keys for a connection of 4 QPs");
        let nested = RemoteKey::Each(vec![RemoteKey::PerQp(vec![1].into()), RemoteKey::Token([0; 16])].into());
        assert!(nested.fits(2, &one).unwrap_err().contains("inside"));
        assert!(RemoteKey::Each(Vec::new().into()).fits(1, &one).is_err());
    }
}
