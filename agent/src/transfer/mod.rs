//! Transfers: domain types, the registry that `WatchTransfer` observes, and the engine that runs
//! them: the sans-IO [`session`] and [`machine`], the [`job`] the data path runs and its one
//! [`driver`] (which hands jobs to the device's [`worker`] thread when there is one).
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::checksum::Algo;
use crate::error::NodeError;

pub mod driver;
pub mod job;
pub mod worker;

/// The engine's session, carrying the agent's [`NodeError`] for the failures the driver
/// feeds in (a lease or grant that failed) and the refusals it returns.
pub mod session {
    pub use xfer_engine::session::{failure_of, SessionConfig};
    pub type Session = xfer_engine::session::Session<crate::error::NodeError>;
    pub type Command = xfer_engine::session::Command<crate::error::NodeError>;
    pub type Event = xfer_engine::session::Event<crate::error::NodeError>;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// local range → remote range
    Write,
    /// remote range → local range
    Read,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::Read => "read",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum TransferState {
    Queued,
    Connecting,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl TransferState {
    pub fn is_terminal(self) -> bool {
        matches!(self, TransferState::Succeeded | TransferState::Failed | TransferState::Cancelled)
    }
}

#[derive(Debug, Clone, Default)]
pub struct TransferOptions {
    pub chunk_size: Option<u64>,
    pub qps: Option<usize>,
    pub depth: Option<usize>,
    pub verify: bool,
    pub algo: Option<Algo>,
    pub timeout: Option<Duration>,
}

#[derive(Debug, Clone)]
pub struct TransferRequest {
    pub op: Op,
    pub local_region: String,
    pub local_offset: u64,
    pub remote_agent: String,
    pub remote_region: String,
    pub remote_offset: u64,
    /// 0 = the rest of the source range
    pub length: u64,
    pub options: TransferOptions,
    /// A batch (then the offsets and `length` above are 0); empty = one range.
    pub segments: Vec<xfer_engine::batch::SegmentSpec>,
    /// Notify the target's `WatchInbound` subscribers with this tag once every byte landed.
    pub notify: Option<Vec<u8>>,
}

#[derive(Debug, Clone)]
pub struct TransferRecord {
    pub id: String,
    pub op: Op,
    pub local_region: String,
    pub local_offset: u64,
    pub remote_agent: String,
    pub remote_region: String,
    pub remote_offset: u64,
    pub length: u64,
    pub state: TransferState,
    pub bytes_done: u64,
    pub error: Option<String>,
    pub error_code: Option<xfer_engine::failure::FailureCode>,
    pub created_at: SystemTime,
    pub started_at: Option<SystemTime>,
    pub finished_at: Option<SystemTime>,
    pub elapsed: Duration,
    pub verified: bool,
    pub checksum: Option<u64>,
    pub peer: String,
    /// Kept by the target when the initiator reported completion (`Peer.Complete`).
    pub inbound: bool,
    /// Segments after coalescing (1 for a single range).
    pub segments: u64,
    /// The notification tag asked for.
    pub notify: Option<Vec<u8>>,
    /// Paths of the connection the transfer ran on (0 before it had one).
    pub paths: u32,
    /// Paths lost mid-transfer with work requests in flight, which went on the others (it ran
    /// degraded), plus one per resume onto a fresh connection.
    pub failovers: u32,
    /// Every RDMA path was lost and the tcp fallback path carried bytes.
    pub fallback: bool,
    /// The peer's identity (its pool key; for an inbound record, its certificate name): what
    /// `limits.max_transfers_per_peer` counts by, whatever spelling of its address was used.
    pub peer_key: String,
    /// Who submitted it (the share of `limits.max_transfers` it counts against).
    pub owner: crate::tenants::Tenant,
}

/// A transfer's live record plus its cancel switch.
pub struct TransferHandle {
    /// Watchers (`WatchTransfer`) subscribe here; the driver publishes every change.
    pub record: watch::Sender<TransferRecord>,
    pub cancel: CancellationToken,
}

impl TransferHandle {
    pub fn snapshot(&self) -> TransferRecord {
        self.record.borrow().clone()
    }

    pub fn update(&self, f: impl FnOnce(&mut TransferRecord)) {
        self.record.send_modify(f);
    }
}

/// All transfers this agent knows: running ones and a bounded history of finished ones.
pub struct TransferRegistry {
    /// std Mutex: map operations only, never held across an await.
    inner: Mutex<Inner>,
    history: usize,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, Arc<TransferHandle>>,
    order: VecDeque<String>,
}

impl TransferRegistry {
    pub fn new(history: usize) -> Self {
        TransferRegistry { inner: Mutex::new(Inner::default()), history }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a record; returns its handle, whose record carries the id it was stored under. A record
    /// is never replaced: a record whose id is taken gets a fresh one (defence in depth: inbound
    /// records live in their own registry under `PEER/ID`, see [`TransferRegistry::insert_new`]).
    pub fn insert(&self, mut record: TransferRecord) -> Arc<TransferHandle> {
        let mut g = self.lock();
        while g.by_id.contains_key(&record.id) {
            record.id = xfer_engine::ids::new_id();
        }
        Self::insert_locked(&mut g, record, self.history)
    }

    /// Inserts `record` unless a record with its id exists (then `None`, and nothing changes).
    pub fn insert_new(&self, record: TransferRecord) -> Option<Arc<TransferHandle>> {
        let mut g = self.lock();
        if g.by_id.contains_key(&record.id) {
            return None;
        }
        Some(Self::insert_locked(&mut g, record, self.history))
    }

    /// [`TransferRegistry::insert_new`], keeping at most `max` finished records that `same`
    /// matches (one peer's inbound records): the oldest of them makes room, so one peer cannot
    /// push every other peer's records out of the history.
    pub fn insert_new_within(
        &self,
        record: TransferRecord,
        max: usize,
        same: impl Fn(&TransferRecord) -> bool,
    ) -> Option<Arc<TransferHandle>> {
        let mut g = self.lock();
        if g.by_id.contains_key(&record.id) {
            return None;
        }
        Self::make_room_within(&mut g, max, same);
        Some(Self::insert_locked(&mut g, record, self.history))
    }

    /// [`TransferRegistry::insert`] of a transfer a tenant submitted: its owner keeps at most
    /// `share` of the history's finished records (its oldest make room), so one client's stream
    /// of small transfers cannot push every other client's results out before they are read.
    /// Exempt owners (plaintext) are bounded by the history alone.
    pub fn insert_owned(&self, mut record: TransferRecord, share: f64) -> Arc<TransferHandle> {
        let mut g = self.lock();
        while g.by_id.contains_key(&record.id) {
            record.id = xfer_engine::ids::new_id();
        }
        if record.owner.key().is_some() {
            let owner = record.owner.clone();
            let max = crate::tenants::share_of(self.history as u64, share) as usize;
            Self::make_room_within(&mut g, max, |r| r.owner == owner);
        }
        Self::insert_locked(&mut g, record, self.history)
    }

    /// Forgets the oldest finished records that `same` matches until one more fits under `max`.
    fn make_room_within(g: &mut Inner, max: usize, same: impl Fn(&TransferRecord) -> bool) {
        let mine: Vec<String> = g
            .order
            .iter()
            .filter(|id| g.by_id.get(*id).is_some_and(|h| h.record.borrow().state.is_terminal() && same(&h.record.borrow())))
            .cloned()
            .collect();
        let excess = (mine.len() + 1).saturating_sub(max.max(1));
        for id in mine.into_iter().take(excess) {
            g.by_id.remove(&id);
            g.order.retain(|o| *o != id);
        }
    }

    fn insert_locked(g: &mut Inner, record: TransferRecord, history: usize) -> Arc<TransferHandle> {
        let id = record.id.clone();
        let (tx, _) = watch::channel(record);
        let handle = Arc::new(TransferHandle { record: tx, cancel: CancellationToken::new() });
        g.by_id.insert(id.clone(), handle.clone());
        g.order.push_back(id);
        // Forget the oldest finished transfers beyond the history bound.
        while g.order.len() > history {
            let Some(pos) = g.order.iter().position(|id| g.by_id.get(id).is_none_or(|h| h.snapshot().state.is_terminal())) else {
                break;
            };
            if let Some(old) = g.order.remove(pos) {
                g.by_id.remove(&old);
            }
        }
        handle
    }

    pub fn get(&self, id: &str) -> Result<Arc<TransferHandle>, NodeError> {
        self.lock().by_id.get(id).cloned().ok_or_else(|| NodeError::NotFound(id.to_string()))
    }

    /// Records kept: running transfers and the finished ones of the history.
    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn list(&self) -> Vec<TransferRecord> {
        let g = self.lock();
        g.order.iter().filter_map(|id| g.by_id.get(id)).map(|h| h.snapshot()).collect()
    }

    /// Running (non-terminal, outbound) transfers, optionally only those to `peer` (address).
    pub fn active(&self, peer: Option<&str>) -> Vec<Arc<TransferHandle>> {
        self.lock()
            .by_id
            .values()
            .filter(|h| {
                let r = h.record.borrow();
                !r.state.is_terminal() && !r.inbound && peer.is_none_or(|p| r.remote_agent == p)
            })
            .cloned()
            .collect()
    }
}
