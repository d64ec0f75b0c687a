//! Metric names, help texts and recording helpers: the registry. Every metric the agent exports is
//! described here, so the names live in one place; other modules call the helpers below.
//!
//! Label cardinality is bounded: `peer` is an authenticated identity (a certificate's NAME, or
//! in plaintext mode an address) and at most `limits.max_peer_labels` distinct values are ever
//! used: later peers are counted under `other` ([`peer_label`]). `op`, `result` and `status` are
//! small enums.
use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

mod security;
pub use security::{rpc_denied, tls_handshake_failure, RPC_DENIED, TLS_HANDSHAKE_FAILURES};

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
// The data plane records these itself; their names and helpers live with it, described below.
pub use xfer_fabric::metrics::{
    accept_error, accept_ready, connection_build, data_connection_closed, data_connection_refused, data_connections, marker_spin,
    notify_marker, work_completion, ACCEPT_ERRORS, ACCEPT_READY, CONNECTION_BUILDS, DATA_CONNECTIONS, DATA_CONNECTIONS_CLOSED,
    DATA_CONNECTIONS_REFUSED, DATA_KTLS_STREAMS, DATA_TLS_HANDSHAKE_FAILURES, DEVICE_BYTES, DEVICE_EVENTS, DEVICE_PORT_UP,
    DEVICE_WORK_REQUESTS, MARKER_SPINS, NOTIFY_MARKERS, PREBUILT_QPS, RAIL_CONNECT_FAILURES, WORK_COMPLETIONS,
};

pub const TRANSFERS: &str = "xfer_transfers_total";
pub const TRANSFER_FAILURES: &str = "xfer_transfer_failures_total";
pub const TRANSFER_BYTES: &str = "xfer_transfer_bytes_total";
pub const TRANSFER_DURATION: &str = "xfer_transfer_duration_seconds";
pub const WORK_REQUESTS: &str = "xfer_work_requests_total";
pub const DATA_PATH_JOBS: &str = "xfer_data_path_jobs_total";
pub const QP_CONNECTIONS: &str = "xfer_qp_connections";
pub const CONNECT_DURATION: &str = "xfer_connect_duration_seconds";
pub const CONNECT_PHASE: &str = "xfer_connect_phase_seconds";
pub const ACCEPT_DURATION: &str = "xfer_accept_duration_seconds";
pub const GRANT_READY_WAITS: &str = "xfer_grant_ready_waits_total";
pub const REGIONS: &str = "xfer_regions";
pub const REGION_BYTES: &str = "xfer_region_registered_bytes";
/// Deprecated alias of [`REGION_BYTES`] (the unit was not last), still emitted for one release.
pub const REGION_BYTES_DEPRECATED: &str = "xfer_region_bytes_registered";
pub const REGISTRATION_DURATION: &str = "xfer_registration_duration_seconds";
pub const GRANTS_ACTIVE: &str = "xfer_grants_active";
pub const FABRIC_INFO: &str = "xfer_fabric_info";
pub const BUILD_INFO: &str = "xfer_build_info";
pub const PEERS: &str = "xfer_peers";
pub const PEERS_EVICTED: &str = "xfer_peers_evicted_total";
pub const SHARE_REFUSED: &str = "xfer_tenant_share_refused_total";
pub const PEER_ALIASES: &str = "xfer_peer_aliases";
pub const LIMIT: &str = "xfer_limit";
pub const ACCEPTED_CONNECTIONS: &str = "xfer_accepted_connections";
pub const CATALOG_WRITE_FAILURES: &str = "xfer_catalog_write_failures_total";
pub const LISTENER_CONNECTIONS: &str = "xfer_listener_connections";
pub const LISTENER_CONNECTIONS_REFUSED: &str = "xfer_listener_connections_refused_total";
pub const LIMIT_SECONDS: &str = "xfer_limit_seconds";
pub const BATCHES: &str = "xfer_batches_total";
pub const BATCH_SEGMENTS: &str = "xfer_batch_segments_total";
pub const NOTIFICATIONS: &str = "xfer_notifications_total";
pub const INBOUND_RINGS: &str = "xfer_inbound_rings";
pub const INBOUND_SUBSCRIBERS: &str = "xfer_inbound_subscribers";
pub const NOTIFICATION_DELAY: &str = "xfer_notification_delay_seconds";
pub const CHANNELS_OPEN: &str = "xfer_channels_open";
pub const CHANNEL_BATCHES: &str = "xfer_channel_batches_total";
pub const PATH_FAILOVERS: &str = "xfer_path_failovers_total";
pub const PATH_REQUEUED: &str = "xfer_path_requeued_work_requests_total";
pub const PATH_BYTES: &str = "xfer_path_bytes_total";
pub const PATH_UP: &str = "xfer_path_up";
pub const TRANSFER_FALLBACKS: &str = "xfer_transfer_fallbacks_total";
pub const TRANSFER_RESUMES: &str = "xfer_transfer_resumes_total";

/// Installs the Prometheus recorder, keeps its histograms drained, and describes every metric.
/// Returns the handle that renders the exposition; the admin server ([`crate::admin`]) serves it,
/// so this registry knows nothing of sockets. Must run inside a tokio runtime.
pub fn install() -> Result<PrometheusHandle, InstallError> {
    // Buckets from 50 µs to ~15 min: fits microsecond RDMA ops and minute-long checkpoints.
    let duration_buckets: Vec<f64> = (0..22).map(|i| 50e-6 * 2f64.powi(i)).collect();
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &duration_buckets)
        .map_err(|e| InstallError(e.to_string()))?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|e| InstallError(e.to_string()))?;
    // What the exporter's own listener would do: drain histograms' old buckets now and then.
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    describe();
    Ok(handle)
}

/// Why the recorder could not be installed (e.g. one is installed already in this process).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InstallError(String);

pub fn describe() {
    describe_counter!(TRANSFERS, Unit::Count, "Transfers finished, by operation and result (succeeded, failed, cancelled).");
    describe_counter!(
        TRANSFER_FAILURES,
        Unit::Count,
        "Transfers that failed or were cancelled, by operation and failure code (Transfer.error_code)."
    );
    describe_counter!(TRANSFER_BYTES, Unit::Bytes, "Bytes moved by transfers and channel batches, by operation (write, read), direction (outbound: this agent initiated them, counted as their chunks complete; inbound: a peer initiated them against this agent, counted when the peer completes them) and peer (the peer's certificate NAME, or without TLS its address: loopback or its IP; the same identity both agents use for each other).");
    describe_histogram!(TRANSFER_DURATION, Unit::Seconds, "Duration of finished transfers, from start to terminal state.");
    describe_counter!(WORK_COMPLETIONS, Unit::Count, "Work completions seen by the fabric, by status.");
    describe_counter!(WORK_REQUESTS, Unit::Count, "Work requests posted by transfers, channels and benchmarks, by operation (write, read, notify); with xfer_transfer_bytes_total it gives the bytes per WR (chunking, READ splitting).");
    describe_counter!(PATH_FAILOVERS, Unit::Count, "Paths (a local device and the peer's device it reaches) lost in the middle of a transfer, channel batch or benchmark phase (the work requests they had in flight, if any, were re-posted on the connection's other paths: xfer_path_requeued_work_requests_total), by local and remote device and the reason's class (completion, post, event, out_of_order).");
    describe_counter!(
        PATH_REQUEUED,
        Unit::Count,
        "Work requests in flight on a lost path (posted to it, not retired by a completion) and posted again on another, by local device; those a failed post never handed to the path are not counted."
    );
    describe_gauge!(PATH_UP, Unit::Count, "Whether each path to each peer (local and remote device) is in use: 1 up, 0 lost lately and waiting out its back-off as a standby (used only when no other path is up); set after every job that used it.");
    describe_counter!(TRANSFER_FALLBACKS, Unit::Count, "Transfers whose bytes went over the tcp fallback path (transfer.fallback = tcp) because every RDMA path of their connection was lost.");
    describe_counter!(TRANSFER_RESUMES, Unit::Count, "Times a transfer that lost every path resumed on a fresh connection and grant (transfer.resume_attempts), by how the resume ended: resumed (the fresh connection and grant were had), failed (they were not; the transfer failed with what stopped it, its deadline included) or cancelled (the transfer was cancelled, or the agent drained, while the resume was under way).");
    describe_counter!(PATH_BYTES, Unit::Bytes, "Bytes that transfers, channel batches and benchmark phases moved over each path, by local and remote device, counted when their job ends.");
    describe_counter!(DATA_PATH_JOBS, Unit::Count, "Channel batches and benchmark phases run to their end, by what drove them: the device's data-path worker thread (worker) or their own task (task: the tcp fabric, verbs.worker off, or a full worker queue).");
    describe_gauge!(QP_CONNECTIONS, Unit::Count, "QPs (or tcp data streams) to each peer, by state.");
    describe_histogram!(
        CONNECT_DURATION,
        Unit::Seconds,
        "Time to negotiate a connection with a peer (Peer.Connect round trip and QP bring-up)."
    );
    describe_histogram!(CONNECT_PHASE, Unit::Seconds, "The initiator's connection negotiation by phase: prepare (local QPs created, INIT), handshake (the Peer.Connect call, which includes the peer's accept), complete (local QPs to RTR and RTS).");
    describe_histogram!(ACCEPT_DURATION, Unit::Seconds, "The responder's half of Peer.Connect until it answers: a connection taken from the pool (or QPs created, receives posted) and, on tcp, its data session set up.");
    describe_histogram!(ACCEPT_READY, Unit::Seconds, "Verbs: from the responder's accept to its QPs in RTS; they are moved there after Peer.Connect was answered, while the answer travels.");
    describe_counter!(
        GRANT_READY_WAITS,
        Unit::Count,
        "Grants that waited for their connection's responder QPs to reach RTS (Peer.Connect answers before they do)."
    );
    describe_counter!(CONNECTION_BUILDS, Unit::Count, "Verbs connections (CQs and QPs in INIT) a negotiation started from, one per connection whatever its devices, by source: prebuilt (every device's part built ahead of need, verbs.prebuilt) or on_demand (built during the negotiation), by role (initiator or responder).");
    describe_gauge!(
        PREBUILT_QPS,
        Unit::Count,
        "QPs held built and in INIT ahead of need (verbs.prebuilt), summed over the node's devices."
    );
    describe_gauge!(REGIONS, Unit::Count, "Regions registered with the fabric.");
    describe_gauge!(REGION_BYTES, Unit::Bytes, "Bytes of region memory registered with the fabric.");
    describe_gauge!(
        REGION_BYTES_DEPRECATED,
        Unit::Bytes,
        "Deprecated: the same as xfer_region_registered_bytes, removed in the next release."
    );
    describe_histogram!(REGISTRATION_DURATION, Unit::Seconds, "Time to register memory with the fabric.");
    describe_gauge!(GRANTS_ACTIVE, Unit::Count, "Grants currently valid on this agent.");
    describe_gauge!(FABRIC_INFO, "Fabric in use (value 1), with kind and device labels.");
    describe_gauge!(BUILD_INFO, "Build information (value 1), with the version label.");
    describe_gauge!(DATA_CONNECTIONS, Unit::Count, "Open sockets on the tcp data port, from accept until close (including streams still before their hello); capped by limits.max_data_connections.");
    describe_counter!(
        DATA_CONNECTIONS_REFUSED,
        Unit::Count,
        "Data-port sockets closed at once because a cap was reached, by reason (total: limits.max_data_connections; per_peer: limits.max_data_connections_per_peer)."
    );
    describe_counter!(
        DATA_CONNECTIONS_CLOSED,
        Unit::Count,
        "Data streams closed by the agent, by reason (handshake: no hello within limits.data_handshake_timeout; evicted: closed before its hello to make room for a newer socket, limits.max_pending_data_connections; idle: no frame for limits.data_idle_timeout; payload: a WRITE payload not complete within limits.data_payload_timeout; revoked: the grant of a WRITE payload being received was revoked, expired or its region deleted)."
    );
    describe_counter!(
        DATA_TLS_HANDSHAKE_FAILURES,
        Unit::Count,
        "TLS handshakes of data streams that failed with an error (a certificate the CA did not sign, a protocol error, the peer closing mid-handshake), by role (target: a stream accepted on the data port; initiator: a stream this agent opened). One that runs out of time is xfer_data_connections_closed_total{reason=\"handshake\"}."
    );
    describe_counter!(
        DATA_KTLS_STREAMS,
        Unit::Count,
        "TLS data streams of an agent with tls.kernel = auto, by role (target, initiator) and result (kernel: the kernel runs the stream's record layer after the handshake; fallback: rustls in user space, because the kernel has no tls module or cannot take the negotiated cipher suite, the agent logs why once; failed: the kernel refused the stream's keys after its probe accepted the suite, the stream is lost and later streams fall back)."
    );
    describe_counter!(
        ACCEPT_ERRORS,
        Unit::Count,
        "Failed accepts (e.g. EMFILE, ENFILE), by listener (data, grpc, health); each backs off that listener 10 ms doubling to 1 s."
    );
    describe_gauge!(PEERS, Unit::Count, "Entries in the peer pool (peer agents by address); capped by limits.max_peers.");
    describe_counter!(
        PEERS_EVICTED,
        Unit::Count,
        "Peer pool entries evicted (least recently used, with no connection leased) to stay within limits.max_peers."
    );
    describe_counter!(
        SHARE_REFUSED,
        Unit::Count,
        "Requests refused because their identity holds its share (limits.tenant_share) of a limit, by limit (transfers, regions, registered_bytes, watchers, inbound)."
    );
    describe_gauge!(
        PEER_ALIASES,
        Unit::Count,
        "Distinct spellings of peer addresses remembered by the peer pool (at most 4 x limits.max_peers)."
    );
    describe_gauge!(
        LIMIT,
        Unit::Count,
        "Limits in force, by config key (limit=max_data_connections as enforced, i.e. at most half of open_files; max_data_connections_per_peer; max_peers; open_files: the soft RLIMIT_NOFILE after raising it)."
    );
    describe_gauge!(
        LIMIT_SECONDS,
        Unit::Seconds,
        "Time limits in force, by config key (data_handshake_timeout, data_idle_timeout, data_payload_timeout)."
    );
    describe_gauge!(
        LISTENER_CONNECTIONS,
        Unit::Count,
        "Open connections of a control listener (listener: grpc, health, metrics); capped (xfer_limit)."
    );
    describe_counter!(LISTENER_CONNECTIONS_REFUSED, Unit::Count, "Sockets a control listener closed at once because it was at its cap (limits.max_grpc_connections for grpc; health and metrics at most 64 each).");
    describe_counter!(CATALOG_WRITE_FAILURES, Unit::Count, "Catalog (regions.json) writes that failed after a region was deleted or expired; the catalog is rewritten later (regions.retry_interval).");
    describe_gauge!(ACCEPTED_CONNECTIONS, Unit::Count, "Connections peers made to this agent (Peer.Connect) that they have not disconnected; at most 256 per peer, the oldest without a grant evicted.");
    describe_gauge!(CHANNELS_OPEN, Unit::Count, "Channels (Agent.OpenChannel) open on this agent as initiator.");
    describe_counter!(
        CHANNEL_BATCHES,
        Unit::Count,
        "Batches posted on channels, by operation and result (succeeded, failed, refused: bad input answered before any byte moved)."
    );
    describe_counter!(BATCHES, Unit::Count, "Transfers submitted with a segment list (SubmitTransfer.segments), by operation.");
    describe_counter!(
        BATCH_SEGMENTS,
        Unit::Count,
        "Segments of submitted batches, by operation and form (asked: as listed; posted: after coalescing contiguous ones)."
    );
    describe_counter!(
        NOTIFICATIONS,
        Unit::Count,
        "Notifications published to WatchInbound subscribers on this (target) agent, by how they were known (fabric: every marker arrived behind the data; complete: Peer.Complete came first)."
    );
    describe_counter!(
        NOTIFY_MARKERS,
        Unit::Count,
        "Notification markers that arrived on this agent, by result (counted; refused: wrong connection or revoked grant; unknown_slot; no_notification: the grant asked for none; no_immediate; no_sink)."
    );
    describe_gauge!(
        INBOUND_RINGS,
        Unit::Count,
        "WatchInboundRing subscriptions alive (shared-memory notification rings this agent writes)."
    );
    describe_gauge!(
        INBOUND_SUBSCRIBERS,
        Unit::Count,
        "WatchInbound and WatchInboundRing subscriptions alive (at most 256); one that ended is no longer counted once everything kept for it is freed."
    );
    describe_gauge!(
        DEVICE_PORT_UP,
        Unit::Count,
        "Whether each RDMA device of a multi-device verbs fabric is up (1) or down (0), by device, as its port state and asynchronous events last said; a device that is down is not offered to new connections."
    );
    describe_counter!(
        DEVICE_EVENTS,
        Unit::Count,
        "Asynchronous events each RDMA device of a multi-device verbs fabric reported, by device and event (port_active, port_err, device_fatal, qp_fatal, other)."
    );
    describe_counter!(
        RAIL_CONNECT_FAILURES,
        Unit::Count,
        "Rails of new multi-device verbs connections left out because their QPs could not be moved to RTS (no route to the peer's device while the port was still ACTIVE), by device and role (initiator, responder); the connection went on over its other rails."
    );
    describe_counter!(
        DEVICE_WORK_REQUESTS,
        Unit::Count,
        "Work requests the initiator posted on each device of a multi-device verbs fabric, by device and op (read, write, notify)."
    );
    describe_counter!(
        DEVICE_BYTES,
        Unit::Bytes,
        "Bytes of the work requests the initiator posted on each device of a multi-device verbs fabric, by device and op: how the transfers' data spread over the paths."
    );
    describe_counter!(
        MARKER_SPINS,
        Unit::Count,
        "Responder connections the marker poller busy-polled for an expected notification (verbs.marker_spin), by event: asked (a grant with a notification or a channel announcement), published (the notification came within the budget), budget (it did not: the completion channel sees it)."
    );
    describe_histogram!(
        NOTIFICATION_DELAY,
        Unit::Seconds,
        "From the first marker of a batch arriving to its notification being published (the spread of the batch's last WRs over its QPs, plus dispatch); via=complete when Peer.Complete published it."
    );
    security::describe();
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
}

/// A batch was submitted: `asked` segments, `posted` after coalescing.
pub fn batch_submitted(op: &'static str, asked: usize, posted: usize) {
    counter!(BATCHES, "op" => op).increment(1);
    counter!(BATCH_SEGMENTS, "op" => op, "form" => "asked").increment(asked as u64);
    counter!(BATCH_SEGMENTS, "op" => op, "form" => "posted").increment(posted as u64);
}

/// Channels open (as initiator): +1 or -1.
pub fn channels_open(delta: f64) {
    gauge!(CHANNELS_OPEN).increment(delta);
}

/// A batch on a channel ended: `result` is succeeded, failed or refused.
pub fn channel_batch(op: &'static str, result: &'static str) {
    counter!(CHANNEL_BATCHES, "op" => op, "result" => result).increment(1);
}

/// A notification was published; `delay` from its first marker, if one arrived.
pub fn notification_published(via: &'static str, delay: Option<Duration>) {
    counter!(NOTIFICATIONS, "via" => via).increment(1);
    if let Some(d) = delay {
        histogram!(NOTIFICATION_DELAY, "via" => via).record(d.as_secs_f64());
    }
}

/// A notification ring was opened (+1) or closed (-1).
pub fn inbound_rings(delta: i64) {
    gauge!(INBOUND_RINGS).increment(delta as f64);
}

/// A WatchInbound subscription (stream or ring) began (+1) or everything kept for it was freed (-1).
pub fn inbound_subscribers(delta: i64) {
    gauge!(INBOUND_SUBSCRIBERS).increment(delta as f64);
}

/// Open connections of a control listener (grpc, health, metrics).
pub fn listener_connections(listener: &'static str, n: usize) {
    gauge!(LISTENER_CONNECTIONS, "listener" => listener).set(n as f64);
}

/// A control listener closed a socket at once because it was at its cap.
pub fn listener_connection_refused(listener: &'static str) {
    counter!(LISTENER_CONNECTIONS_REFUSED, "listener" => listener).increment(1);
}

/// The cap of a control listener (`xfer_limit{limit="max_<listener>_connections"}`).
pub fn limit_for_listener(listener: &'static str, max: u64) {
    let name = match listener {
        "grpc" => "max_grpc_connections",
        "health" => "max_health_connections",
        "metrics" => "max_metrics_connections",
        "unix" => "max_unix_connections",
        _ => "max_other_connections",
    };
    limit(name, max);
}

/// A catalog write failed (the catalog is retried; see `regions`).
pub fn catalog_write_failed() {
    counter!(CATALOG_WRITE_FAILURES).increment(1);
}

/// Connections peers made to this agent and have not disconnected.
pub fn accepted_connections(n: usize) {
    gauge!(ACCEPTED_CONNECTIONS).set(n as f64);
}

/// Publishes a count limit in force (`xfer_limit{limit=…}`).
pub fn limit(name: &'static str, value: u64) {
    gauge!(LIMIT, "limit" => name).set(value as f64);
}

/// Publishes a time limit in force (`xfer_limit_seconds{limit=…}`).
pub fn limit_seconds(name: &'static str, value: Duration) {
    gauge!(LIMIT_SECONDS, "limit" => name).set(value.as_secs_f64());
}

pub fn fabric_info(kind: &str, device: &str) {
    gauge!(FABRIC_INFO, "kind" => kind.to_string(), "device" => device.to_string()).set(1.0);
}

pub fn transfer_finished(op: &'static str, result: &'static str, elapsed: Duration) {
    counter!(TRANSFERS, "op" => op, "result" => result).increment(1);
    histogram!(TRANSFER_DURATION, "op" => op).record(elapsed.as_secs_f64());
}

/// A transfer that did not succeed, by its failure code (a closed set: the label stays bounded).
pub fn transfer_failure(op: &'static str, code: &'static str) {
    // Label values are lower snake case like every other label's; the API keeps the upper-case code.
    counter!(TRANSFER_FAILURES, "op" => op, "code" => code.to_ascii_lowercase()).increment(1);
}

/// Most distinct `peer` label values (`limits.max_peer_labels`).
static PEER_LABEL_LIMIT: AtomicUsize = AtomicUsize::new(256);
/// The `peer` label value for peers past the limit.
pub const OTHER_PEER: &str = "other";

pub fn set_peer_label_limit(n: usize) {
    PEER_LABEL_LIMIT.store(n.max(1), Ordering::Relaxed);
}

/// The `peer` label for `name`: the name itself while fewer than the limit have been used (a
/// name keeps its label once it has one), else `other`. Series are never dropped by the exporter,
/// so this bounds the number of series whatever callers do.
pub fn peer_label(name: &str) -> String {
    static SEEN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let mut seen = SEEN.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if name.is_empty() {
        return OTHER_PEER.to_string();
    }
    if seen.contains(name) || (seen.len() < PEER_LABEL_LIMIT.load(Ordering::Relaxed) && seen.insert(name.to_string())) {
        name.to_string()
    } else {
        OTHER_PEER.to_string()
    }
}

/// `bytes` more moved by a transfer or batch: `op` is write or read, `direction` outbound (this
/// agent initiated it) or inbound.
pub fn transfer_bytes(op: &'static str, direction: &'static str, peer: &str, bytes: u64) {
    if bytes > 0 {
        counter!(TRANSFER_BYTES, "op" => op, "direction" => direction, "peer" => peer_label(peer)).increment(bytes);
    }
}

/// A running outbound transfer has `total` bytes done; `counted` of them are in
/// `xfer_transfer_bytes_total` already. Counts the difference, so the counter moves with every
/// completed run of chunks, not only when the transfer ends.
pub fn transfer_progress(op: &'static str, peer: &str, total: u64, counted: &mut u64) {
    if total > *counted {
        transfer_bytes(op, "outbound", peer, total - *counted);
        *counted = total;
    }
}

/// `writes`, `reads` and `notifies` WRs were posted (one doorbell run).
pub fn work_requests(writes: u64, reads: u64, notifies: u64) {
    for (op, n) in [("write", writes), ("read", reads), ("notify", notifies)] {
        if n > 0 {
            counter!(WORK_REQUESTS, "op" => op).increment(n);
        }
    }
}

/// A path was lost mid-job; `requeued` WRs went to the other paths.
pub fn path_failover(local: &str, remote: &str, reason: &'static str, requeued: u32) {
    counter!(PATH_FAILOVERS, "local_device" => local.to_string(), "remote_device" => remote.to_string(), "reason" => reason).increment(1);
    counter!(PATH_REQUEUED, "local_device" => local.to_string()).increment(u64::from(requeued));
}

/// Whether a path to `peer` is up (1) or in its back-off (0).
pub fn path_up(peer: &str, local: &str, remote: &str, up: bool) {
    gauge!(PATH_UP, "peer" => peer_label(peer), "local_device" => local.to_string(), "remote_device" => remote.to_string()).set(if up {
        1.0
    } else {
        0.0
    });
}

/// A transfer fell back to tcp (its standby path carried bytes).
pub fn transfer_fallback() {
    counter!(TRANSFER_FALLBACKS).increment(1);
}

/// A transfer that lost every path tried to resume: `resumed`, `failed` or `cancelled`.
pub fn transfer_resume(result: &'static str) {
    counter!(TRANSFER_RESUMES, "result" => result).increment(1);
}

/// Bytes a job moved over one path.
pub fn path_bytes(local: &str, remote: &str, bytes: u64) {
    if bytes > 0 {
        counter!(PATH_BYTES, "local_device" => local.to_string(), "remote_device" => remote.to_string()).increment(bytes);
    }
}

/// A job ran to its end, driven by `driver` (`worker` or `task`).
pub fn data_path_job(driver: &'static str) {
    counter!(DATA_PATH_JOBS, "driver" => driver).increment(1);
}

pub fn qp_connections(peer: &str, state: &'static str, n: usize) {
    gauge!(QP_CONNECTIONS, "peer" => peer_label(peer), "state" => state).set(n as f64);
}

pub fn connect_duration(d: Duration) {
    histogram!(CONNECT_DURATION).record(d.as_secs_f64());
}

/// One phase of the initiator's negotiation (`prepare`, `handshake`, `complete`).
pub fn connect_phase(phase: &'static str, d: Duration) {
    histogram!(CONNECT_PHASE, "phase" => phase).record(d.as_secs_f64());
}

/// A grant waited for its connection's responder QPs to reach RTS.
pub fn grant_ready_wait() {
    counter!(GRANT_READY_WAITS).increment(1);
}

/// The responder's fabric accept took `d` (until it answered).
pub fn accept_duration(d: Duration) {
    histogram!(ACCEPT_DURATION).record(d.as_secs_f64());
}

pub fn regions(n: usize, bytes: u64) {
    gauge!(REGIONS).set(n as f64);
    gauge!(REGION_BYTES).set(bytes as f64);
    gauge!(REGION_BYTES_DEPRECATED).set(bytes as f64);
}

pub fn registration_duration(d: Duration) {
    histogram!(REGISTRATION_DURATION).record(d.as_secs_f64());
}

pub fn grants_active(n: usize) {
    gauge!(GRANTS_ACTIVE).set(n as f64);
}

pub fn peers(n: usize) {
    gauge!(PEERS).set(n as f64);
}

pub fn peer_evicted() {
    counter!(PEERS_EVICTED).increment(1);
}

pub fn share_refused(limit: &'static str) {
    counter!(SHARE_REFUSED, "limit" => limit).increment(1);
}

pub fn peer_aliases(n: usize) {
    gauge!(PEER_ALIASES).set(n as f64);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use metrics_exporter_prometheus::PrometheusBuilder;
    use xfer_fabric::metrics::{connection_build, PrebuiltShare, PrebuiltTotal};

    /// The sample of an unlabelled series in a rendered exposition.
    fn sample(text: &str, name: &str) -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }

    /// The outbound byte counter moves with each completed run of chunks: what a scrape sees
    /// in the middle of a transfer is what it has moved so far, never counted twice.
    #[test]
    fn transfer_bytes_count_as_chunks_complete() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let series = r#"xfer_transfer_bytes_total{op="write",direction="outbound",peer="node-b"}"#;
        metrics::with_local_recorder(&recorder, || {
            let mut counted = 0;
            super::transfer_progress("write", "node-b", 4096, &mut counted);
            assert_eq!(sample(&handle.render(), series), Some(4096.0));
            super::transfer_progress("write", "node-b", 3 * 4096, &mut counted);
            assert_eq!(sample(&handle.render(), series), Some(3.0 * 4096.0));
            // The same total told again (the end of the job, then the session's finish) adds nothing.
            super::transfer_progress("write", "node-b", 3 * 4096, &mut counted);
            assert_eq!(counted, 3 * 4096);
            super::transfer_failure("write", "CHECKSUM_MISMATCH");
        });
        assert_eq!(sample(&handle.render(), series), Some(3.0 * 4096.0));
        assert!(handle.render().contains(r#"code="checksum_mismatch""#), "{}", handle.render());
    }

    /// `xfer_prebuilt_qps` is the node's total over its devices (each device's pool used to
    /// overwrite it with its own count), and a connection build is one sample per call.
    #[test]
    fn prebuilt_qps_is_the_sum_over_devices_as_scraped() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            let total = Arc::new(PrebuiltTotal::default());
            let (rxe0, rxe2) = (PrebuiltShare::new(Arc::clone(&total)), PrebuiltShare::new(Arc::clone(&total)));
            rxe0.publish(8);
            rxe2.publish(8);
            assert_eq!(sample(&handle.render(), super::PREBUILT_QPS), Some(16.0));
            // rxe2 lent a connection of 2 QPs: the total drops by 2, not to rxe2's 6.
            assert_eq!(rxe2.publish(6), 14);
            assert_eq!(sample(&handle.render(), super::PREBUILT_QPS), Some(14.0));
            drop(rxe0);
            assert_eq!(sample(&handle.render(), super::PREBUILT_QPS), Some(6.0), "a device gone takes its QPs out");
            connection_build("initiator", true);
            connection_build("responder", false);
        });
        let text = handle.render();
        assert!(text.contains(r#"xfer_connection_builds_total{role="initiator",source="prebuilt"} 1"#), "{text}");
        assert!(text.contains(r#"xfer_connection_builds_total{role="responder",source="on_demand"} 1"#), "{text}");
    }
}
