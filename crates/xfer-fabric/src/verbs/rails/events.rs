//! Each device's asynchronous events, read on a thread of its own and handed to a callback as
//! typed values ([`AsyncEvent`]). A [`RailsFabric`](super::RailsFabric) reacts to them: a port
//! that goes down (or a device that fails) is no longer offered to new connections, and the
//! QPs of its connections are moved to ERR so their outstanding work requests flush at once
//! instead of after the transport's retries; the transfer re-posts them on another path. A port
//! that comes back is offered again.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sideway::ibverbs::device_context::DeviceContext;
pub use xfer_rdma::events::AsyncEvent;
use xfer_rdma::events::AsyncEvents;

/// How long the thread waits for an event before it looks whether it should stop: the longest
/// a dropped fabric's thread (and the device context it holds) outlives it.
const STOP_CHECK: Duration = Duration::from_millis(250);

/// A running event thread; dropping this stops it (within [`STOP_CHECK`]).
pub(crate) struct EventThread {
    stop: Arc<AtomicBool>,
}

impl Drop for EventThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// Starts the thread that reads `ctx`'s asynchronous events and calls `on_event` with each.
pub(crate) fn spawn(
    device: &str,
    ctx: &Arc<DeviceContext>,
    on_event: impl Fn(AsyncEvent) + Send + 'static,
) -> std::io::Result<EventThread> {
    let events = AsyncEvents::new(ctx)?;
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = Arc::clone(&stop);
    let name = device.to_string();
    std::thread::Builder::new().name(format!("xfer-events-{device}")).spawn(move || {
        while !stopped.load(Ordering::Acquire) {
            match events.wait(STOP_CHECK) {
                Ok(Some(ev)) => on_event(ev),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(device = %name, error = %e, "reading the device's asynchronous events failed; no longer watching them");
                    return;
                }
            }
        }
    })?;
    Ok(EventThread { stop })
}

/// The metric label of an event.
pub(crate) fn label(ev: &AsyncEvent) -> &'static str {
    match ev {
        AsyncEvent::PortActive { .. } => "port_active",
        AsyncEvent::PortErr { .. } => "port_err",
        AsyncEvent::DeviceFatal => "device_fatal",
        AsyncEvent::QpFatal { .. } => "qp_fatal",
        AsyncEvent::Other { .. } => "other",
    }
}

/// What an event means for a device on `port`: `Some(true)` it is up again, `Some(false)` it
/// went down, `None` no change (another port's event, a QP's, anything else).
pub(crate) fn up_after(ev: &AsyncEvent, port: u8) -> Option<bool> {
    match *ev {
        AsyncEvent::PortActive { port: p } if p == port => Some(true),
        AsyncEvent::PortErr { port: p } if p == port => Some(false),
        AsyncEvent::DeviceFatal => Some(false),
        _ => None,
    }
}

/// `ibv_event_type` IBV_EVENT_LID_CHANGE and IBV_EVENT_GID_CHANGE.
const LID_CHANGE: u32 = 11;
const GID_CHANGE: u32 = 18;

/// Whether an event may change what the port's facts read (its LID or GID table), on any port
/// of the device (a GID change does not name its port): a device whose facts are not settled
/// reads them again.
pub(crate) fn facts_may_change(ev: &AsyncEvent) -> bool {
    matches!(*ev, AsyncEvent::Other { code: LID_CHANGE | GID_CHANGE })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_events_move_only_their_port_and_a_fatal_device_is_down() {
        assert_eq!(up_after(&AsyncEvent::PortErr { port: 1 }, 1), Some(false));
        assert_eq!(up_after(&AsyncEvent::PortActive { port: 1 }, 1), Some(true));
        assert_eq!(up_after(&AsyncEvent::PortErr { port: 2 }, 1), None);
        assert_eq!(up_after(&AsyncEvent::DeviceFatal, 1), Some(false));
        assert_eq!(up_after(&AsyncEvent::QpFatal { qpn: 9, code: 1 }, 1), None);
        assert_eq!(label(&AsyncEvent::Other { code: 18 }), "other");
    }

    #[test]
    fn lid_and_gid_changes_may_change_the_ports_facts_and_nothing_else_does() {
        assert!(facts_may_change(&AsyncEvent::Other { code: 18 }));
        assert!(facts_may_change(&AsyncEvent::Other { code: 11 }));
        assert!(!facts_may_change(&AsyncEvent::Other { code: 12 }));
        assert!(!facts_may_change(&AsyncEvent::PortErr { port: 1 }));
        assert!(!facts_may_change(&AsyncEvent::QpFatal { qpn: 1, code: 18 }));
    }
}
