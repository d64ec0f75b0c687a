//! What the agent remembers about a path (one local × remote device pair) across transfers: its
//! health with flap-damped back-off ([`PathHealth`]) and its measured rate ([`Rate`]). Sans-IO
//! like the rest of the crate: the caller passes the time, nothing here reads the clock, so back-off
//! and damping are tested on virtual time.
//!
//! A path that fails is down for a back-off, after which it may be tried again (a re-probe, or
//! the next connection using it). One that fails again soon after it came back is *flapping*: its
//! back-off doubles each time, up to a ceiling, and returns to the initial value only once the
//! path has stayed up for a stable period. So a link that bounces every few seconds is tried
//! rarely instead of at every bounce, and a path that was fixed comes back quickly.
use std::time::{Duration, Instant};

/// Back-off of a path that went down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Down for this long after a failure of a stable path.
    pub initial: Duration,
    /// The ceiling of the doubled back-off.
    pub max: Duration,
    /// Up for this long, the path counts as stable again: its next failure starts from `initial`.
    pub stable: Duration,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff { initial: Duration::from_secs(1), max: Duration::from_secs(60), stable: Duration::from_secs(30) }
    }
}

/// Where a path stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathState {
    Up,
    /// Failed; not to be tried before `until`.
    Down {
        until: Instant,
    },
}

/// A path's health across transfers, with flap damping.
#[derive(Debug, Clone)]
pub struct PathHealth {
    backoff: Backoff,
    state: PathState,
    /// The back-off of the last failure (the base the next doubling starts from).
    last: Option<Duration>,
    /// When it last came back up; `None` while it never went down (stable from the start).
    up_since: Option<Instant>,
    flaps: u32,
}

impl PathHealth {
    pub fn new(backoff: Backoff) -> PathHealth {
        let max = backoff.max.max(backoff.initial);
        PathHealth { backoff: Backoff { max, ..backoff }, state: PathState::Up, last: None, up_since: None, flaps: 0 }
    }

    /// The path failed at `now`. A second report while its back-off runs is the same failure
    /// (several QPs, an async event and a completion all tell it) and changes nothing.
    pub fn down(&mut self, now: Instant) {
        let flapped = match self.state {
            PathState::Down { until } if now < until => return,
            // Tried again once the back-off passed, and failed: it never came back.
            PathState::Down { .. } => true,
            PathState::Up => self.up_since.is_some_and(|t| now.saturating_duration_since(t) < self.backoff.stable),
        };
        let b = match self.last {
            Some(last) if flapped => {
                self.flaps = self.flaps.saturating_add(1);
                last.saturating_mul(2).min(self.backoff.max)
            }
            _ => self.backoff.initial,
        };
        self.last = Some(b);
        self.state = PathState::Down { until: now.checked_add(b).unwrap_or(now) };
    }

    /// The path works again (a probe or a transfer over it succeeded).
    pub fn up(&mut self, now: Instant) {
        if let PathState::Down { .. } = self.state {
            self.state = PathState::Up;
            self.up_since = Some(now);
        }
    }

    /// True when the path may carry data at `now`: it is up, or its back-off has passed (then
    /// using it is the re-probe; a failure calls [`PathHealth::down`] again).
    pub fn usable(&self, now: Instant) -> bool {
        match self.state {
            PathState::Up => true,
            PathState::Down { until } => now >= until,
        }
    }

    /// When a down path may be tried again.
    pub fn retry_at(&self) -> Option<Instant> {
        match self.state {
            PathState::Up => None,
            PathState::Down { until } => Some(until),
        }
    }

    pub fn state(&self) -> PathState {
        self.state
    }

    /// Failures that came within the stable period of the path coming back (each doubled the
    /// back-off).
    pub fn flaps(&self) -> u32 {
        self.flaps
    }
}

/// An exponentially weighted moving average of a path's throughput in bytes per second, fed
/// with what completed and how long it took. A sample's weight grows with the time it covers
/// (`1 - e^(-elapsed/tau)`), so many short samples and one long one give the same average.
#[derive(Debug, Clone)]
pub struct Rate {
    tau: Duration,
    value: Option<f64>,
    /// Bytes of updates with no elapsed time, carried into the next one.
    carry: u64,
}

impl Default for Rate {
    /// A one-second time constant.
    fn default() -> Rate {
        Rate::new(Duration::from_secs(1))
    }
}

impl Rate {
    /// `tau`: the time constant (how long ago a sample still counts ~37%).
    pub fn new(tau: Duration) -> Rate {
        Rate { tau: tau.max(Duration::from_micros(1)), value: None, carry: 0 }
    }

    /// `bytes` completed over `elapsed`.
    pub fn update(&mut self, bytes: u64, elapsed: Duration) {
        let bytes = bytes.saturating_add(std::mem::take(&mut self.carry));
        if elapsed.is_zero() {
            self.carry = bytes;
            return;
        }
        let dt = elapsed.as_secs_f64();
        let sample = bytes as f64 / dt;
        self.value = Some(match self.value {
            None => sample,
            Some(v) => v + (1.0 - (-dt / self.tau.as_secs_f64()).exp()) * (sample - v),
        });
    }

    /// The average, once one sample with elapsed time came in.
    pub fn bytes_per_sec(&self) -> Option<f64> {
        self.value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    fn health() -> PathHealth {
        PathHealth::new(Backoff { initial: secs(1), max: secs(8), stable: secs(10) })
    }

    #[test]
    fn a_stable_path_that_fails_is_down_for_the_initial_back_off() {
        let t0 = Instant::now();
        let mut h = health();
        assert!(h.usable(t0));
        assert_eq!(h.retry_at(), None);
        h.down(t0);
        assert_eq!(h.state(), PathState::Down { until: t0 + secs(1) });
        assert!(!h.usable(t0));
        assert!(h.usable(t0 + secs(1)), "re-probe once the back-off passed");
        h.down(t0 + Duration::from_millis(500));
        assert_eq!(h.retry_at(), Some(t0 + secs(1)), "a second report of the same failure");
        assert_eq!(h.flaps(), 0);
    }

    /// A path that keeps failing within the stable period of coming back doubles its back-off
    /// up to the ceiling; one that then stays up for the stable period starts over.
    #[test]
    fn a_flapping_path_backs_off_exponentially_and_a_stable_one_resets() {
        let t0 = Instant::now();
        let mut h = health();
        let mut t = t0;
        let mut downs = Vec::new();
        for _ in 0..6 {
            h.down(t);
            let until = h.retry_at().unwrap();
            downs.push(until - t);
            // Comes back when allowed, fails again 2 s later (within the 10 s stable period).
            h.up(until);
            t = until + secs(2);
        }
        assert_eq!(downs, vec![secs(1), secs(2), secs(4), secs(8), secs(8), secs(8)]);
        assert_eq!(h.flaps(), 5);
        // Stays up past the stable period: the next failure is a fresh one.
        let back = t - secs(2);
        h.down(back + secs(10));
        assert_eq!(h.retry_at(), Some(back + secs(11)));
        assert_eq!(h.flaps(), 5);
    }

    /// A re-probe that fails (the path never came back up) counts as a flap too.
    #[test]
    fn a_failed_re_probe_doubles_the_back_off() {
        let t0 = Instant::now();
        let mut h = health();
        h.down(t0);
        h.down(t0 + secs(1));
        assert_eq!(h.retry_at(), Some(t0 + secs(3)));
        h.down(t0 + secs(3));
        assert_eq!(h.retry_at(), Some(t0 + secs(7)));
        assert_eq!(h.flaps(), 2);
        h.up(t0 + secs(7));
        assert_eq!(h.state(), PathState::Up);
        assert!(h.usable(t0 + secs(7)));
    }

    #[test]
    fn rate_follows_the_throughput_weighted_by_time() {
        let mut r = Rate::new(secs(1));
        assert_eq!(r.bytes_per_sec(), None);
        r.update(100, Duration::ZERO);
        assert_eq!(r.bytes_per_sec(), None, "no time passed: carried");
        r.update(900, secs(1));
        assert_eq!(r.bytes_per_sec(), Some(1000.0));
        // A long sample at a new rate nearly replaces the average.
        r.update(20_000, secs(10));
        let v = r.bytes_per_sec().unwrap();
        assert!((v - 2000.0).abs() < 1.0, "{v}");
        // Ten short samples weigh what one long one does.
        let (mut a, mut b) = (Rate::new(secs(1)), Rate::new(secs(1)));
        a.update(1000, secs(1));
        b.update(1000, secs(1));
        for _ in 0..10 {
            a.update(300, Duration::from_millis(100));
        }
        b.update(3000, secs(1));
        let (va, vb) = (a.bytes_per_sec().unwrap(), b.bytes_per_sec().unwrap());
        assert!((va - vb).abs() < 1e-6, "{va} vs {vb}");
    }
}
