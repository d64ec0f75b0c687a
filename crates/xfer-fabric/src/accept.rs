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
///
/// The count and its report change under one lock: with a bare atomic, two sockets closing at
/// once could report out of order (the second's 0 first, then the first's 1), and the gauge would
/// show a socket that is gone until the next change, which may never come.
pub struct Slots {
    open: std::sync::Mutex<usize>,
    max: usize,
    report: Box<dyn Fn(usize) + Send + Sync>,
}

impl std::fmt::Debug for Slots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slots").field("open", &self.count()).field("max", &self.max).finish()
    }
}

impl Slots {
    pub fn new(max: usize, report: impl Fn(usize) + Send + Sync + 'static) -> std::sync::Arc<Slots> {
        std::sync::Arc::new(Slots { open: std::sync::Mutex::new(0), max, report: Box::new(report) })
    }

    /// The open count. A poisoned lock means a panic in `report` while holding it; the count
    /// itself is still the last one set.
    fn lock(&self) -> std::sync::MutexGuard<'_, usize> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sockets holding a slot now.
    pub fn count(&self) -> usize {
        *self.lock()
    }

    /// A slot for one more socket, or None at the cap.
    pub fn take(self: &std::sync::Arc<Self>) -> Option<Slot> {
        let mut open = self.lock();
        if *open >= self.max {
            return None;
        }
        *open += 1;
        (self.report)(*open);
        drop(open);
        Some(Slot(self.clone()))
    }
}

/// One socket's place in its [`Slots`].
#[derive(Debug)]
pub struct Slot(std::sync::Arc<Slots>);

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.0.lock();
        *open = open.saturating_sub(1);
        (self.0.report)(*open);
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

    /// Many sockets taking and closing at once on many threads (the report yields first, to give
    /// another thread every chance to cut in): the reports still come one step apart in the
    /// order the count changed, so the last one is the count that is open (0 once all closed),
    /// and the cap holds.
    #[test]
    fn slots_report_every_change_in_order_whatever_the_interleaving() {
        use std::sync::{Arc, Mutex};
        let reported = Arc::new(Mutex::new(vec![0]));
        let r = reported.clone();
        let slots = Slots::new(8, move |n| {
            std::thread::yield_now();
            r.lock().unwrap().push(n)
        });
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let slots = slots.clone();
                std::thread::spawn(move || {
                    for _ in 0..500 {
                        let held: Vec<Slot> = (0..2).filter_map(|_| slots.take()).collect();
                        drop(held);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let reported = reported.lock().unwrap();
        let jumps: Vec<_> = reported.windows(2).filter(|w| w[0].abs_diff(w[1]) != 1).take(5).collect();
        assert!(jumps.is_empty(), "reports out of order: {jumps:?}");
        assert_eq!(reported.last(), Some(&0), "the gauge was left at {:?}", reported.last());
        assert!(reported.iter().all(|&n| n <= 8), "over the cap");
    }
}
