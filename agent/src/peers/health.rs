//! A peer's transport health: consecutive failures and the back-off window (see the module
//! doc of [`super`]).
use std::time::{Duration, Instant};

/// Consecutive transport failures after which a peer is put in back-off.
pub const BACKOFF_AFTER: u32 = 3;
/// First back-off window; it doubles with every failed probe.
pub const BACKOFF_BASE: Duration = Duration::from_secs(1);
/// Longest back-off window.
pub const BACKOFF_CAP: Duration = Duration::from_secs(30);

/// Transport health of one peer: consecutive failures and the back-off window.
#[derive(Debug, Default)]
pub(super) struct Health {
    pub(super) failures: u32,
    window: Duration,
    pub(super) until: Option<Instant>,
    pub(super) last_error: String,
}

impl Health {
    /// `Some(remaining)` while backing off at `now`.
    pub(super) fn backing_off(&self, now: Instant) -> Option<Duration> {
        self.until.and_then(|u| u.checked_duration_since(now)).filter(|d| !d.is_zero())
    }

    pub(super) fn success(&mut self) {
        *self = Health::default();
    }

    /// Records a transport failure; returns the new window when it starts one. A `slow` failure
    /// (a timeout) starts one at once.
    pub(super) fn failure(&mut self, now: Instant, error: String, slow: bool) -> Option<Duration> {
        self.failures = self.failures.saturating_add(1);
        self.last_error = error;
        if self.failures < BACKOFF_AFTER && !slow {
            return None;
        }
        self.window = if self.window.is_zero() { BACKOFF_BASE } else { (self.window * 2).min(BACKOFF_CAP) };
        self.until = Some(now + self.window);
        Some(self.window)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::{Health, BACKOFF_AFTER, BACKOFF_BASE, BACKOFF_CAP};

    #[test]
    fn back_off_starts_after_consecutive_failures_doubles_to_the_cap_and_resets() {
        let t0 = Instant::now();
        let mut h = Health::default();
        for _ in 1..BACKOFF_AFTER {
            assert_eq!(h.failure(t0, "refused".into(), false), None);
            assert_eq!(h.backing_off(t0), None, "no back-off before {BACKOFF_AFTER} failures");
        }
        assert_eq!(h.failure(t0, "refused".into(), false), Some(BACKOFF_BASE));
        assert_eq!(h.backing_off(t0), Some(BACKOFF_BASE));
        assert_eq!(h.backing_off(t0 + BACKOFF_BASE), None, "the window ends: the next call probes");
        // Failed probes double the window, up to the cap.
        let mut want = BACKOFF_BASE;
        for _ in 0..20 {
            want = (want * 2).min(BACKOFF_CAP);
            assert_eq!(h.failure(t0, "refused".into(), false), Some(want));
        }
        assert_eq!(want, BACKOFF_CAP);
        h.success();
        assert_eq!(h.backing_off(t0), None);
        assert_eq!(h.failure(t0, "x".into(), false), None, "a success resets the count");
        h.success();
        assert_eq!(h.failure(t0, "connect timed out".into(), true), Some(BACKOFF_BASE), "a timeout backs off at once");
    }
}
