//! The metrics the data plane records: names and recording helpers. The agent describes them
//! (help texts, units) with the rest of its metrics and installs the recorder; without one
//! (tests, tools) recording does nothing.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics::{counter, gauge, histogram};

pub const WORK_COMPLETIONS: &str = "xfer_work_completions_total";
pub const ACCEPT_READY: &str = "xfer_accept_ready_seconds";
pub const CONNECTION_BUILDS: &str = "xfer_connection_builds_total";
pub const PREBUILT_QPS: &str = "xfer_prebuilt_qps";
pub const DATA_CONNECTIONS: &str = "xfer_data_connections";
pub const DATA_CONNECTIONS_REFUSED: &str = "xfer_data_connections_refused_total";
pub const DATA_CONNECTIONS_CLOSED: &str = "xfer_data_connections_closed_total";
pub const DATA_TLS_HANDSHAKE_FAILURES: &str = "xfer_data_tls_handshake_failures_total";
pub const DATA_KTLS_STREAMS: &str = "xfer_data_ktls_streams_total";
pub const ACCEPT_ERRORS: &str = "xfer_accept_errors_total";
pub const NOTIFY_MARKERS: &str = "xfer_notify_markers_total";
pub const MARKER_SPINS: &str = "xfer_marker_spins_total";
pub const DEVICE_PORT_UP: &str = "xfer_device_port_up";
pub const DEVICE_EVENTS: &str = "xfer_device_events_total";
pub const DEVICE_WORK_REQUESTS: &str = "xfer_device_work_requests_total";
pub const DEVICE_BYTES: &str = "xfer_device_bytes_total";
pub const RAIL_CONNECT_FAILURES: &str = "xfer_rail_connect_failures_total";

/// A work completion with `status`, a verbs-style name (`WcStatus::name`); the label value is
/// its lower-case form, like every other label's values.
pub fn work_completion(status: &'static str) {
    counter!(WORK_COMPLETIONS, "status" => status_label(status)).increment(1);
}

/// The lower-case label of a completion status name, without allocating on the completion path.
fn status_label(name: &'static str) -> &'static str {
    match name {
        "SUCCESS" => "success",
        "LOC_LEN_ERR" => "loc_len_err",
        "LOC_QP_OP_ERR" => "loc_qp_op_err",
        "LOC_PROT_ERR" => "loc_prot_err",
        "WR_FLUSH_ERR" => "wr_flush_err",
        "REM_INV_REQ_ERR" => "rem_inv_req_err",
        "REM_ACCESS_ERR" => "rem_access_err",
        "REM_OP_ERR" => "rem_op_err",
        "RETRY_EXC_ERR" => "retry_exc_err",
        "RNR_RETRY_EXC_ERR" => "rnr_retry_exc_err",
        "GENERAL_ERR" => "general_err",
        _ => "other_err",
    }
}

/// The responder's QPs reached RTS (or failed to), `d` after its accept started.
pub fn accept_ready(d: Duration) {
    histogram!(ACCEPT_READY).record(d.as_secs_f64());
}

/// A verbs connection's CQs and QPs were built for `role` (`initiator` or `responder`): once per
/// connection, whatever its devices; `prebuilt` when every device's part came from its pool.
pub fn connection_build(role: &'static str, prebuilt: bool) {
    let source = if prebuilt { "prebuilt" } else { "on_demand" };
    counter!(CONNECTION_BUILDS, "role" => role, "source" => source).increment(1);
}

/// The node's prebuilt QPs, summed over its devices: each device's pool publishes its own count
/// through a [`PrebuiltShare`] and `xfer_prebuilt_qps` shows the sum. A fabric over several
/// devices gives all of them one total; a single device has its own.
#[derive(Debug, Default)]
pub struct PrebuiltTotal(Mutex<usize>);

/// One device's part of a [`PrebuiltTotal`]; dropping it takes its count out of the total.
#[derive(Debug)]
pub struct PrebuiltShare {
    total: Arc<PrebuiltTotal>,
    mine: AtomicUsize,
}

impl PrebuiltShare {
    pub fn new(total: Arc<PrebuiltTotal>) -> PrebuiltShare {
        PrebuiltShare { total, mine: AtomicUsize::new(0) }
    }

    /// This device's pool now holds `n` QPs: sets the gauge to the node's total and returns it.
    pub fn publish(&self, n: usize) -> usize {
        // Under the total's lock, so the gauge is set to the totals in the order they were made.
        let mut total = self.total.0.lock().unwrap_or_else(|e| e.into_inner());
        let old = self.mine.swap(n, Ordering::AcqRel);
        *total = total.saturating_sub(old).saturating_add(n);
        gauge!(PREBUILT_QPS).set(*total as f64);
        *total
    }
}

impl Drop for PrebuiltShare {
    fn drop(&mut self) {
        // A share that never held anything (a device's own, replaced at open) leaves the gauge.
        if self.mine.load(Ordering::Acquire) != 0 {
            self.publish(0);
        }
    }
}

pub fn data_connections(n: usize) {
    gauge!(DATA_CONNECTIONS).set(n as f64);
}

/// `reason`: `total` or `per_peer`.
pub fn data_connection_refused(reason: &'static str) {
    counter!(DATA_CONNECTIONS_REFUSED, "reason" => reason).increment(1);
}

/// `reason`: `handshake`, `evicted`, `idle`, `stalled`, `payload` or `revoked`.
pub fn data_connection_closed(reason: &'static str) {
    counter!(DATA_CONNECTIONS_CLOSED, "reason" => reason).increment(1);
}

/// A data stream's TLS handshake failed with an error (a certificate the CA did not sign, a
/// protocol error, the peer closing mid-handshake; one that runs out of time is
/// `data_connection_closed("handshake")` on the target). `role`: `target` (a stream accepted on
/// the data port) or `initiator` (a stream this agent opened).
pub fn data_tls_handshake_failed(role: &'static str) {
    counter!(DATA_TLS_HANDSHAKE_FAILURES, "role" => role).increment(1);
}

/// A TLS data stream of an agent with `tls.kernel = auto` runs its record layer in the kernel
/// (`result`: `kernel`), stays with rustls in user space (`fallback`), or was lost because the
/// kernel refused its keys (`failed`). `role`: `target` or `initiator`.
pub fn data_ktls_stream(role: &'static str, result: &'static str) {
    counter!(DATA_KTLS_STREAMS, "role" => role, "result" => result).increment(1);
}

/// `listener`: `data`, `grpc` or `health`.
pub fn accept_error(listener: &'static str) {
    counter!(ACCEPT_ERRORS, "listener" => listener).increment(1);
}

/// A notification marker arrived (`result` is a closed set).
pub fn notify_marker(result: &'static str) {
    counter!(NOTIFY_MARKERS, "result" => result).increment(1);
}

/// The marker poller took a connection or let it go (`event` is a closed set).
pub fn marker_spin(event: &'static str) {
    counter!(MARKER_SPINS, "event" => event).increment(1);
}

/// Whether `device`'s port is up (1) or down (0), as its events last said.
pub fn device_port_up(device: &str, up: bool) {
    gauge!(DEVICE_PORT_UP, "device" => device.to_string()).set(if up { 1.0 } else { 0.0 });
}

/// `device` reported an asynchronous event (`event` is a closed set: `port_active`, `port_err`,
/// `device_fatal`, `qp_fatal`, `other`).
pub fn device_event(device: &str, event: &'static str) {
    counter!(DEVICE_EVENTS, "device" => device.to_string(), "event" => event).increment(1);
}

/// A rail of a new connection on `device` could not be made ready by `role` (`initiator` or
/// `responder`): its QPs could not be moved to RTS, and the connection went on without it.
pub fn rail_connect_failure(device: &str, role: &'static str) {
    counter!(RAIL_CONNECT_FAILURES, "device" => device.to_string(), "role" => role).increment(1);
}

/// The initiator posted `count` work requests of `op` (`read`, `write`, `notify`) moving `bytes`
/// on `device` (a fabric over several devices counts per device).
pub fn device_posted(device: &str, op: &'static str, count: u64, bytes: u64) {
    counter!(DEVICE_WORK_REQUESTS, "device" => device.to_string(), "op" => op).increment(count);
    counter!(DEVICE_BYTES, "device" => device.to_string(), "op" => op).increment(bytes);
}
