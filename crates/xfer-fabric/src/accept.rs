//! Accept loops that run out of file descriptors: the count of open sockets under a cap
//! ([`Slots`]), and the back-off that keeps a failing accept loop from spinning
//! ([`AcceptBackoff`]). The data port uses both; the agent's control listeners too.
use std::time::Duration;

/// First pause after a failed accept.
pub const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest pause between failed accepts.
pub const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Exponential back-off of an accept loop: a failed accept (EMFILE, ENFILE, ...) pauses the loop
/// 10 ms, doubling to 1 s while accepts keep failing; a successful accept resets it. Without it
/// a listener out of file descriptors is readable forever and its loop spins.
#[derive(Debug, Default)]
pub struct AcceptBackoff {
    next: Option<Duration>,
}

impl AcceptBackoff {
    /// Counts a failed accept on `listener` (metric label) and returns how long to pause.
    pub fn failed(&mut self, listener: &'static str) -> Duration {
        crate::metrics::accept_error(listener);
        let d = self.next.unwrap_or(ACCEPT_BACKOFF_MIN);
        self.next = Some((d * 2).min(ACCEPT_BACKOFF_MAX));
        d
    }

    pub fn succeeded(&mut self) {
        self.next = None;
    }
}

/// Open sockets, at most `max`: [`Slots::take`] gives a [`Slot`] that holds one until it is
/// dropped, and `report` hears the new count on every change (a gauge). The data port and the
/// control listeners count their sockets with it.
pub struct Slots {
    open: std::sync::atomic::AtomicUsize,
    max: usize,
    report: Box<dyn Fn(usize) + Send + Sync>,
}

impl std::fmt::Debug for Slots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slots").field("open", &self.open).field("max", &self.max).finish()
    }
}

impl Slots {
    pub fn new(max: usize, report: impl Fn(usize) + Send + Sync + 'static) -> std::sync::Arc<Slots> {
        std::sync::Arc::new(Slots { open: Default::default(), max, report: Box::new(report) })
    }

    /// A slot for one more socket, or None at the cap.
    pub fn take(self: &std::sync::Arc<Self>) -> Option<Slot> {
        use std::sync::atomic::Ordering;
        let n = self.open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.max).then_some(n + 1)).ok()?;
        (self.report)(n + 1);
        Some(Slot(self.clone()))
    }
}

/// One socket's place in its [`Slots`].
#[derive(Debug)]
pub struct Slot(std::sync::Arc<Slots>);

impl Drop for Slot {
    fn drop(&mut self) {
        let n = self.0.open.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        (self.0.report)(n.saturating_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_backoff_doubles_to_the_cap_and_resets() {
        let mut b = AcceptBackoff::default();
        let mut seen = Vec::new();
        for _ in 0..10 {
            seen.push(b.failed("test"));
        }
        assert_eq!(seen[0], ACCEPT_BACKOFF_MIN);
        assert_eq!(seen[1], ACCEPT_BACKOFF_MIN * 2);
        assert_eq!(*seen.last().unwrap(), ACCEPT_BACKOFF_MAX);
        assert!(seen.windows(2).all(|w| w[0] <= w[1]));
        b.succeeded();
        assert_eq!(b.failed("test"), ACCEPT_BACKOFF_MIN);
    }
}
