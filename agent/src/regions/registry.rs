//! The registry: every region of this agent by name, under one lock that is never held across
//! an open, a mapping or an await; lookups, and the totals behind the gauges.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use super::entry::{CatalogEntry, RegionView, UnavailableRegion};
use super::error::RegionError;
use super::policy::{RegionLimits, RegionPolicy};
use super::region::{Region, RegionKind, RegionSpec, RegionUse};
use crate::metrics as m;
use xfer_fabric::Fabric;

/// The registry's maps, under one lock.
#[derive(Default)]
pub(super) struct Inner {
    /// name → live region.
    pub(super) live: HashMap<String, Arc<Region>>,
    /// name → catalog entry that could not be restored.
    pub(super) unavailable: HashMap<String, UnavailableRegion>,
    /// name → bytes of a create in progress (opening, mapping, registering with no lock held):
    /// the name is taken and the bytes are counted until it is inserted or fails.
    pub(super) pending: HashMap<String, u64>,
    /// Names of benchmark scratch regions being created (their bytes are in the bench budget).
    pub(super) pending_scratch: std::collections::HashSet<String>,
}

impl Inner {
    /// Regions counted toward `max_regions` (benchmark scratch regions are not).
    pub(super) fn count(&self) -> usize {
        self.live.values().filter(|r| r.scratch.is_none()).count() + self.unavailable.len() + self.pending.len()
    }

    pub(super) fn taken(&self, name: &str) -> bool {
        self.live.contains_key(name)
            || self.unavailable.contains_key(name)
            || self.pending.contains_key(name)
            || self.pending_scratch.contains(name)
    }

    /// Bytes counted toward `max_registered_bytes` (benchmark scratch regions' are not).
    pub(super) fn registered_bytes(&self) -> u64 {
        let live: u64 = self.live.values().filter(|r| r.scratch.is_none()).map(|r| r.length).sum();
        live.saturating_add(self.pending.values().sum::<u64>())
    }
}

/// All regions of this agent, by name.
pub struct RegionRegistry {
    pub(super) fabric: Arc<dyn Fabric>,
    pub(super) state_dir: PathBuf,
    pub(super) policy: RegionPolicy,
    pub(super) limits: RegionLimits,
    /// A std Mutex: held only for map operations, never across an open, a mapping or an await.
    pub(super) inner: Mutex<Inner>,
    /// One catalog writer at a time. A writer takes it, *then* snapshots the maps, so the last
    /// rename always carries the newest state. Never held across an await.
    pub(super) persist_lock: Mutex<()>,
    /// The last catalog write failed: the catalog on disk is stale (see `finish_removal`).
    pub(super) catalog_dirty: std::sync::atomic::AtomicBool,
    /// Bytes the agent holds outside regions (notification rings), counted against
    /// `max_registered_bytes` like regions ([`Reservation`]).
    pub(super) reserved: Arc<AtomicU64>,
    /// Bytes benchmarks hold (buffers, pools, scratch regions), against `max_bench_bytes`.
    pub(super) bench: Arc<AtomicU64>,
    /// Charges a restored region to the tenant that created it ([`RegionRegistry::set_charge`]).
    pub(super) charge: std::sync::OnceLock<Charge>,
}

/// (tenant key, bytes) → the permits a region of that tenant holds (`crate::tenants`).
pub type Charge = Box<dyn Fn(&str, u64) -> Arc<crate::tenants::Permits> + Send + Sync>;

impl RegionRegistry {
    pub fn new(fabric: Arc<dyn Fabric>, state_dir: PathBuf, limits: RegionLimits, policy: RegionPolicy) -> Self {
        RegionRegistry {
            fabric,
            state_dir,
            policy,
            limits,
            inner: Mutex::new(Inner::default()),
            persist_lock: Mutex::new(()),
            catalog_dirty: Default::default(),
            reserved: Arc::new(AtomicU64::new(0)),
            bench: Arc::new(AtomicU64::new(0)),
            charge: std::sync::OnceLock::new(),
        }
    }

    /// How restored regions are charged to their tenants (set once, before `restore`): restoring
    /// a tenant's regions must not give it its share again.
    pub fn set_charge(&self, charge: Charge) {
        let _ = self.charge.set(charge);
    }

    /// What it takes to rebuild a catalog entry, charged to its tenant.
    pub(super) fn restored_spec(&self, e: &CatalogEntry) -> RegionSpec {
        let mut spec = e.spec();
        spec.shares = e.owner.as_deref().zip(self.charge.get()).map(|(owner, charge)| charge(owner, e.length));
        spec
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock means a panic while holding it; the maps themselves are still
        // consistent (inserts and removes are single operations), so keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Looks a live region up by name or id; an unavailable or poisoned one is
    /// FAILED_PRECONDITION naming its reason.
    pub fn get(&self, name_or_id: &str) -> Result<Arc<Region>, RegionError> {
        let r = Self::live(self.describe(name_or_id)?)?;
        if r.is_retiring() {
            return Err(RegionError::NotFound(name_or_id.to_string()));
        }
        r.intact()?;
        Ok(r)
    }

    /// A live region by name or id, marked in use *before* the registry lock is released:
    /// [`RegionRegistry::delete`] refuses a region in use under the same lock, so once this
    /// returns the region cannot be deleted until the [`RegionUse`] is dropped (looking it up and
    /// then calling [`Region::acquire`] leaves a window in which a delete can slip through, after
    /// which bytes would still land in a deleted file region).
    pub fn acquire(&self, name_or_id: &str) -> Result<RegionUse, RegionError> {
        self.acquire_as(name_or_id, true)
    }

    /// [`RegionRegistry::acquire`] for a client: a benchmark's scratch region is refused. In use
    /// by a client it could be neither closed nor reaped, and it (with the bench budget and the
    /// agent's one benchmark target) would outlive its benchmark.
    pub fn acquire_for_client(&self, name_or_id: &str) -> Result<RegionUse, RegionError> {
        self.acquire_as(name_or_id, false)
    }

    pub(super) fn acquire_as(&self, name_or_id: &str, scratch: bool) -> Result<RegionUse, RegionError> {
        let u = {
            let st = self.lock();
            let view = Self::find(&st, name_or_id).ok_or_else(|| RegionError::NotFound(name_or_id.to_string()))?;
            let r = Self::live(view)?;
            if r.is_retiring() {
                return Err(RegionError::NotFound(name_or_id.to_string()));
            }
            if r.scratch.is_some() && !scratch {
                return Err(RegionError::Denied(format!(
                    "region {:?} is a benchmark's scratch region: only the benchmark uses it",
                    r.name
                )));
            }
            r.acquire()
        };
        u.0.intact()?;
        Ok(u)
    }

    /// A region by name or id, live or unavailable.
    pub fn describe(&self, name_or_id: &str) -> Result<RegionView, RegionError> {
        Self::find(&self.lock(), name_or_id).ok_or_else(|| RegionError::NotFound(name_or_id.to_string()))
    }

    /// The lookup `describe`, `get` and `acquire` share: a name first (live, then unavailable),
    /// then an id.
    pub(super) fn find(st: &Inner, name_or_id: &str) -> Option<RegionView> {
        if let Some(r) = st.live.get(name_or_id) {
            return Some(RegionView::Live(r.clone()));
        }
        if let Some(u) = st.unavailable.get(name_or_id) {
            return Some(RegionView::Unavailable(u.clone()));
        }
        if let Some(r) = st.live.values().find(|r| r.id == name_or_id) {
            return Some(RegionView::Live(r.clone()));
        }
        st.unavailable.values().find(|u| u.id() == name_or_id).map(|u| RegionView::Unavailable(u.clone()))
    }

    /// The live region of a view; an unavailable one is FAILED_PRECONDITION naming its reason.
    pub(super) fn live(view: RegionView) -> Result<Arc<Region>, RegionError> {
        match view {
            RegionView::Live(r) => Ok(r),
            RegionView::Unavailable(u) => Err(RegionError::Unavailable { name: u.name().to_string(), reason: u.reason }),
        }
    }

    /// Live and unavailable regions whose labels match `selector`, by name.
    pub fn list(&self, selector: &BTreeMap<String, String>) -> Vec<RegionView> {
        let matches = |labels: &BTreeMap<String, String>| selector.iter().all(|(k, val)| labels.get(k) == Some(val));
        let st = self.lock();
        let mut v: Vec<RegionView> = st
            .live
            .values()
            .filter(|r| matches(&r.labels))
            .map(|r| RegionView::Live(r.clone()))
            .chain(st.unavailable.values().filter(|u| matches(u.labels())).map(|u| RegionView::Unavailable(u.clone())))
            .collect();
        v.sort_by(|a, b| a.name().cmp(b.name()));
        v
    }

    /// Flushes file-backed mappings (on shutdown).
    pub fn flush_all(&self) {
        for r in self.lock().live.values() {
            if r.kind != RegionKind::Anonymous {
                let _ = r.memory.flush();
            }
        }
    }

    /// Number of regions (live and unavailable) and bytes registered by live ones.
    pub fn totals(&self) -> (usize, u64) {
        let st = self.lock();
        (st.live.len() + st.unavailable.len(), st.live.values().map(|r| r.length).sum())
    }

    pub(super) fn update_gauges(&self) {
        let (n, bytes) = self.totals();
        m::regions(n, bytes);
    }
}
