//! Deadlines from durations, without the panic of `Instant + Duration` on overflow.
//!
//! Durations reach deadlines from requests (ttls, timeouts: at most 100 years, checked at
//! decode) and from the configuration (ranges checked at load). Those checks are the bound;
//! these functions are the net under them: a duration that slipped past a check yields a
//! deadline far away (clamped to [`FAR`]), never a panic on a runtime thread.
use std::time::{Duration, Instant, SystemTime};

/// The farthest deadline handed out: 100 years.
pub const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `now + d`, with `d` clamped to [`FAR`].
pub fn instant_after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d.min(FAR)).unwrap_or(now)
}

/// `now + d` on the wall clock, with `d` clamped to [`FAR`].
pub fn system_after(d: Duration) -> SystemTime {
    let now = SystemTime::now();
    now.checked_add(d.min(FAR)).unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_durations_clamp_instead_of_panicking() {
        let before = Instant::now();
        assert!(instant_after(Duration::MAX) >= before + FAR);
        assert!(instant_after(Duration::from_secs(u64::MAX)) >= before + FAR);
        assert!(system_after(Duration::MAX) > SystemTime::now() + FAR - Duration::from_secs(60));
        assert!(instant_after(Duration::from_secs(1)) >= before + Duration::from_secs(1));
    }
}
