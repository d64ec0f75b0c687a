//! Admission: a submit's slot under `limits.max_transfers`/`max_transfers_per_peer` (held from
//! the check until the transfer's record counts), and the one-at-a-time admin and sink slots;
//! and the data path: the poll spin, the device's worker thread, the WR length (as the fabric
//! reports what applies to it), the default depth (deeper on tcp), and the one entry every job
//! takes ([`Node::run_job`]).
use std::sync::Arc;
use std::time::Duration;

use tracing::{info, warn};

use super::initiator::Initiator;
use super::Node;
use crate::config::LimitsConfig;
use crate::error::NodeError;
use crate::metrics as m;
use crate::peers::{Lease, PeerKey};
use crate::tenants::Tenant;
use crate::transfer::job::{Done, Job, Leased};
use crate::transfer::worker::Worker;
use xfer_fabric::Connection;

/// Bytes a tcp transfer keeps in flight per QP when its depth is not asked for
/// ([`Node::depth_for`]).
pub const TCP_IN_FLIGHT: u64 = 1 << 20;
/// Most WRs per QP a tcp transfer keeps in flight when its depth is not asked for.
pub const TCP_MAX_DEFAULT_DEPTH: usize = 256;

/// [`Node::depth_for`] when no depth is asked: `configured`, raised on a fabric that is not
/// `polled` (tcp) to keep [`TCP_IN_FLIGHT`] bytes of `wr_len`-byte WRs per QP, up to
/// [`TCP_MAX_DEFAULT_DEPTH`] (never below `configured`).
fn default_depth(configured: usize, wr_len: u64, polled: bool) -> usize {
    if polled {
        return configured;
    }
    let filling = usize::try_from(TCP_IN_FLIGHT.div_ceil(wr_len.max(1))).unwrap_or(usize::MAX);
    configured.max(filling.min(TCP_MAX_DEFAULT_DEPTH))
}

/// The data path drives a pooled connection's lease.
impl Leased for Lease {
    fn conn(&self) -> &Arc<dyn Connection> {
        Lease::conn(self)
    }
    fn completions(&mut self) -> &mut tokio::sync::mpsc::UnboundedReceiver<xfer_fabric::Completion> {
        Lease::completions(self)
    }
}

/// A submit's slot under `limits.max_transfers` and `max_transfers_per_peer`, held from the
/// limit check until the transfer's record is in the registry (which then counts it).
pub(super) struct SubmitSlot<'a> {
    node: &'a Node,
    key: (String, Tenant),
}

impl Drop for SubmitSlot<'_> {
    fn drop(&mut self) {
        self.node.initiator.release_slot(&self.key);
    }
}

/// A channel's slot under the same limits, held for the channel's life (a channel counts as a
/// running transfer to its peer).
pub(super) struct ChannelSlot {
    node: Arc<Node>,
    key: (String, Tenant),
}

impl Drop for ChannelSlot {
    fn drop(&mut self) {
        self.node.initiator.release_slot(&self.key);
    }
}

impl Initiator {
    /// Slots taken and not yet counted by a record (submits in flight, open channels).
    pub(super) fn submitting_count(&self) -> usize {
        self.submitting.lock().map(|m| m.values().sum()).unwrap_or(0)
    }

    /// Gives back a slot [`Initiator::take_slot`] took.
    fn release_slot(&self, key: &(String, Tenant)) {
        let mut m = self.submitting.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                m.remove(key);
            }
        }
    }

    /// Takes a slot under `limits.max_transfers`, `limits.max_transfers_per_peer` and `tenant`'s
    /// share of both, counting the running transfers and the slots already taken.
    fn take_slot(&self, limits: &LimitsConfig, peer: &PeerKey, tenant: &Tenant) -> Result<(String, Tenant), NodeError> {
        let peer = peer.to_string();
        let mut m = self.submitting.lock().unwrap_or_else(|p| p.into_inner());
        let active = self.transfers.active(None);
        let total = active.len() + m.values().sum::<usize>();
        if total >= limits.max_transfers {
            return Err(NodeError::Limit(format!("max_transfers = {} ({total} running)", limits.max_transfers)));
        }
        let pending = |f: &dyn Fn(&(String, Tenant)) -> bool| m.iter().filter(|(k, _)| f(k)).map(|(_, n)| *n).sum::<usize>();
        let to_peer = active.iter().filter(|h| h.record.borrow().peer_key == peer).count() + pending(&|k| k.0 == peer);
        if to_peer >= limits.max_transfers_per_peer {
            return Err(NodeError::Limit(format!(
                "max_transfers_per_peer = {} ({to_peer} running to {peer})",
                limits.max_transfers_per_peer
            )));
        }
        if tenant.key().is_some() {
            let share = |max: usize| crate::tenants::share_of(max as u64, limits.tenant_share) as usize;
            let mine = |to: Option<&str>| {
                active.iter().filter(|h| h.record.borrow().owner == *tenant && to.is_none_or(|p| h.record.borrow().peer_key == p)).count()
                    + pending(&|k| k.1 == *tenant && to.is_none_or(|p| k.0 == p))
            };
            // Both the agent's transfers and those to one peer: a tenant filling either would
            // refuse every other tenant's transfers (to that peer).
            for (key, max, held) in [
                ("max_transfers", limits.max_transfers, mine(None)),
                ("max_transfers_per_peer", limits.max_transfers_per_peer, mine(Some(&peer))),
            ] {
                let cap = share(max);
                if held >= cap {
                    m::share_refused("transfers");
                    return Err(NodeError::Limit(format!(
                        "{tenant} holds {held} transfers and channels: its share ({cap} of {key} = {max}, limits.tenant_share); \
                         other identities keep the rest"
                    )));
                }
            }
        }
        let key = (peer, tenant.clone());
        *m.entry(key.clone()).or_insert(0) += 1;
        Ok(key)
    }
}

impl Node {
    /// Checks `limits.max_transfers`, `limits.max_transfers_per_peer` (per peer identity, the
    /// pool entry's key) and the caller's share, and holds a slot until the transfer's record is
    /// inserted, so concurrent submits cannot overshoot.
    pub(super) fn reserve_slot(&self, peer: &PeerKey, tenant: &Tenant) -> Result<SubmitSlot<'_>, NodeError> {
        let key = self.initiator.take_slot(&self.config.limits, peer, tenant)?;
        Ok(SubmitSlot { node: self, key })
    }

    /// [`Node::reserve_slot`] for a channel's whole life.
    pub(super) fn channel_slot(self: &Arc<Self>, peer: &PeerKey, tenant: &Tenant) -> Result<ChannelSlot, NodeError> {
        let key = self.initiator.take_slot(&self.config.limits, peer, tenant)?;
        Ok(ChannelSlot { node: Arc::clone(self), key })
    }

    /// How long a transfer polls its own connection before sleeping (`verbs.poll_spin`; only
    /// the verbs fabric has anything to poll).
    pub(super) fn poll_spin(&self) -> Duration {
        if self.fabric.polled() {
            self.config.verbs.poll_spin.0
        } else {
            Duration::ZERO
        }
    }

    /// The device's data-path worker (`transfer::worker`), started on first use: verbs with
    /// `verbs.worker` only (a tcp connection cannot be handed off). `None` if it could not start
    /// (logged once); then every job runs on its caller's task.
    pub(super) fn worker(&self) -> Option<&Worker<Lease>> {
        if !self.fabric.polled() || !self.config.verbs.worker {
            return None;
        }
        self.initiator
            .worker
            .get_or_init(|| {
                let rt = tokio::runtime::Handle::try_current().ok()?;
                Worker::start("xfer-data-path", self.config.verbs.poll_spin.0, rt, self.worker_cpu())
                    .map_err(|e| warn!(error = %e, "cannot start the data-path worker thread; batches run on their own tasks"))
                    .ok()
            })
            .as_ref()
    }

    /// The CPUs `verbs.worker_cpu` pins the data-path worker to (logged once, when the worker
    /// starts). Configured CPUs were checked against the affinity mask when the configuration
    /// loaded; if the mask changed since, or cannot be read, the worker runs unpinned.
    fn worker_cpu(&self) -> Option<std::collections::BTreeSet<usize>> {
        let setting = &self.config.verbs.worker_cpu;
        let device = self.fabric.device_name().unwrap_or_default();
        // Only `auto` asks the device for its NUMA node.
        let local = if *setting == crate::cpus::WorkerCpu::Auto { crate::cpus::device_local(device) } else { None };
        let chosen = crate::cpus::allowed().and_then(|allowed| crate::cpus::choose(setting, &allowed, local.as_ref()));
        match chosen {
            Ok(Some((cpus, why))) => {
                info!(device = %device, "data-path worker pinned to CPUs {} ({why})", crate::cpus::format_cpulist(&cpus));
                Some(cpus)
            }
            Ok(None) if *setting == crate::cpus::WorkerCpu::Off => {
                info!("data-path worker not pinned (verbs.worker_cpu = off)");
                None
            }
            Ok(None) => {
                info!(device = %device, "data-path worker not pinned: the device names no NUMA node this process may run on");
                None
            }
            Err(e) => {
                warn!(error = %e, "the data-path worker runs unpinned");
                None
            }
        }
    }

    /// Runs `job` to its end through the data path's one driver: on the data-path worker, or on
    /// this task without one. Transfers, channel batches and benchmark phases all come here.
    pub async fn run_job(&self, job: Job<Lease>) -> Result<Done<Lease>, NodeError> {
        crate::transfer::driver::drive(job, self.worker(), self.poll_spin()).await.map_err(NodeError::Internal)
    }

    /// The WR length for a transfer's chunks (`verbs.max_read_wr` splits long READs; the tcp
    /// fabric's frames need no split).
    pub fn wr_chunk(&self, read: bool, chunk: u64) -> u64 {
        if self.fabric.polled() {
            xfer_engine::shape::wr_chunk(read, chunk, self.config.verbs.max_read_wr.0)
        } else {
            chunk
        }
    }

    /// The depth (WRs per QP) a transfer runs at: `asked`, else `transfer.depth`; on the tcp
    /// fabric (not `polled`), raised so that each QP keeps at least [`TCP_IN_FLIGHT`] bytes of
    /// WRs of `wr_len` bytes in flight, up to [`TCP_MAX_DEFAULT_DEPTH`] WRs. A tcp WR completes
    /// through two task hand-offs (the stream's reader, then the driver, then the writer), so a
    /// window of a few small WRs drains long before its refill is written: 16 WRs of 4 KiB moved
    /// a third of raw TCP's bytes. A tcp QP has no queue to size, so depth costs it nothing
    /// but the WRs' bookkeeping; verbs keeps `transfer.depth` (its QPs are sized by it).
    pub fn depth_for(&self, asked: Option<usize>, wr_len: u64) -> Result<usize, xfer_engine::shape::ShapeError> {
        let depth = asked.unwrap_or_else(|| default_depth(self.config.transfer.depth, wr_len, self.fabric.polled()));
        xfer_engine::shape::depth(depth)
    }

    /// One admin call (`Bench`, `TcpBaseline`) at a time on this agent.
    pub fn admin_slot(&self, what: &str) -> Result<tokio::sync::OwnedSemaphorePermit, NodeError> {
        self.admin_slot
            .clone()
            .try_acquire_owned()
            .map_err(|_| NodeError::Limit(format!("another benchmark is running on this agent ({what} runs one at a time)")))
    }

    /// One `Peer.OpenSink` at a time; the sink's task holds the permit until the sink closes.
    pub fn sink_slot(&self) -> Result<tokio::sync::OwnedSemaphorePermit, NodeError> {
        self.sink_slot
            .clone()
            .try_acquire_owned()
            .map_err(|_| NodeError::Limit("a TCP baseline sink is already open on this agent (one at a time)".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::{default_depth, TCP_MAX_DEFAULT_DEPTH};

    #[test]
    fn tcp_keeps_a_mebibyte_in_flight_per_qp_and_verbs_keeps_its_configured_depth() {
        // tcp: 4 KiB WRs fill 1 MiB with 256; 64 KiB ones with 16; 1 MiB ones need no more.
        assert_eq!(default_depth(16, 4096, false), 256);
        assert_eq!(default_depth(16, 64 << 10, false), 16);
        assert_eq!(default_depth(16, 1 << 20, false), 16);
        // Capped, never below what is configured, and a zero length cannot divide by zero.
        assert_eq!(default_depth(16, 16, false), TCP_MAX_DEFAULT_DEPTH);
        assert_eq!(default_depth(1024, 4096, false), 1024);
        assert_eq!(default_depth(16, 0, false), TCP_MAX_DEFAULT_DEPTH);
        // verbs sizes its QPs by the configured depth: unchanged.
        assert_eq!(default_depth(16, 4096, true), 16);
    }
}
