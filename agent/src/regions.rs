//! Region registry: allocate or map memory, register it with the fabric, leases, and the catalog.
//!
//! Kinds: `anonymous` (agent-allocated, zeroed), `file` (a shared mapping of an existing file whose
//! data persists) and `shm` (a POSIX shared-memory object under /dev/shm that local applications
//! map too). Anonymous regions die with the agent by design.
//!
//! # Host safety (DESIGN §8)
//!
//! - **File regions live under `regions.file_roots`.** A path is resolved beneath its root with
//!   `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` (or, on kernels without openat2, a
//!   component-by-component walk with `O_NOFOLLOW | O_DIRECTORY`), opened `O_NONBLOCK | O_NOCTTY`
//!   (a FIFO never blocks) and must be a regular file. A hard link inside a root to a file outside
//!   it is the same inode and cannot be told apart by path, only by its link count: a file with
//!   other links is refused unless `regions.allow_hard_links` ([`crate::safe_file::check_hard_links`]).
//! - **shm objects are private.** Created with `O_CREAT | O_EXCL | O_NOFOLLOW` and
//!   `regions.shm_mode` (0600), optionally given `regions.shm_group`. An existing object is used
//!   only with `adopt_existing`, only if it is a regular file owned by the agent's uid (or
//!   `regions.shm_owner`) and long enough: it is never resized.
//! - **No lock is held across an open.** A create reserves its name and bytes under the map lock,
//!   opens, maps and registers without any lock, then inserts.
//!
//! # The catalog
//!
//! File and shm regions are written to `<state_dir>/regions.json` on every change: one writer at
//! a time (`persist_lock`), a unique `O_EXCL` temp file, fsync, rename, fsync of the directory. A
//! catalog that does not parse is moved aside (`regions.json.corrupt-<unix time>`) and the agent
//! starts without regions. An entry that cannot be restored stays in the catalog as an
//! *unavailable* region with its reason, is retried periodically ([`RegionRegistry::retry_unavailable`])
//! and leaves the catalog only through `DeleteRegion` (or its lease).
use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;
use serde::{Deserialize, Serialize};
use tracing::{error, info, warn};

use crate::ids::new_id;

use crate::metrics as m;
use xfer_fabric::{Access, Fabric, FabricError, Registration};
use xfer_rdma::memory::RegionMemory;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RegionKind {
    Anonymous,
    File,
    Shm,
}

/// What a caller asks for.
#[derive(Debug, Clone)]
pub struct RegionSpec {
    pub name: String,
    pub length: u64,
    pub kind: RegionKind,
    /// file: path of the file; shm: object name (default `xfer-<name>`)
    pub path: Option<String>,
    pub access: Access,
    pub hugepages: bool,
    pub ttl: Option<Duration>,
    pub labels: BTreeMap<String, String>,
    /// shm: use an object that already exists (never resized, never removed by the agent).
    pub adopt_existing: bool,
    /// The creator's share of the per-identity limits (`crate::tenants`), held by the region
    /// for as long as it exists.
    pub shares: Option<Arc<crate::tenants::Permits>>,
}

impl RegionSpec {
    /// Private, zeroed anonymous memory of `length` bytes with remote access ceiling `access`, no
    /// lease and no labels (set the fields to change that).
    pub fn anonymous(name: &str, length: u64, access: Access) -> RegionSpec {
        RegionSpec {
            name: name.to_string(),
            length,
            kind: RegionKind::Anonymous,
            path: None,
            access,
            hugepages: false,
            ttl: None,
            labels: BTreeMap::new(),
            adopt_existing: false,
            shares: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("region {0:?} not found")]
    NotFound(String),
    #[error("region {0:?} already exists")]
    AlreadyExists(String),
    #[error("{0}")]
    Invalid(String),
    #[error("file {path:?} does not exist")]
    PathMissing { path: String },
    #[error("file {path:?} is {actual} bytes, shorter than the region length {needed}")]
    FileTooShort { path: String, actual: u64, needed: u64 },
    #[error("region {0:?} is in use by a running transfer")]
    Busy(String),
    /// Outside every file root, through a symlink, or an shm object of another owner.
    #[error("{0}")]
    Denied(String),
    #[error("{path:?} is not a regular file (it is a {kind}); regions map regular files only")]
    NotRegular { path: String, kind: &'static str },
    #[error("shm object {object:?} already exists; pass adopt_existing (xferctl region create --adopt) to use it")]
    ShmExists { object: String },
    #[error("region {name:?} is unavailable: {reason}")]
    Unavailable { name: String, reason: String },
    /// The region's file (or shm object) shrank under its mapping (`xfer_rdma::sigbus`).
    #[error("region {name:?}'s file shrank under its mapping; recreate the region")]
    Poisoned { name: String },
    #[error("limit reached: {0}")]
    Limit(String),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    #[error(transparent)]
    Fabric(#[from] FabricError),
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> RegionError {
    let context = context.into();
    move |source| RegionError::Io { context, source }
}

/// A live region.
pub struct Region {
    pub id: String,
    pub name: String,
    pub length: u64,
    pub kind: RegionKind,
    pub path: Option<String>,
    pub access: Access,
    pub hugepages: bool,
    pub labels: BTreeMap<String, String>,
    pub created_at: SystemTime,
    pub expires_at: Option<SystemTime>,
    pub memory: Arc<RegionMemory>,
    pub registration: Arc<dyn Registration>,
    /// Running transfers that use this region (delete is refused while non-zero).
    in_use: AtomicU32,
    /// Set under the registry lock when the region starts to end (delete, lease, ...): from then
    /// on it takes no new use and no new grant, while its grants are revoked and before it stops
    /// being visible (`RegionRegistry::retire`).
    retiring: AtomicBool,
    /// shm object created by the agent (unlinked on delete)
    created_object: bool,
    /// The creator's share of the per-identity limits, given back when the region is dropped.
    _shares: Option<Arc<crate::tenants::Permits>>,
    /// A benchmark's scratch region: its bytes are held in `limits.max_bench_bytes` (released
    /// when the last user drops it) and it counts toward neither `max_regions` nor
    /// `max_registered_bytes`.
    scratch: Option<Reservation>,
}

impl Region {
    /// `Err(Poisoned)` once the region's file shrank under its mapping. Call it after copying
    /// region memory, before using or acknowledging the bytes.
    pub fn intact(&self) -> Result<(), RegionError> {
        self.memory.intact().map_err(|_| RegionError::Poisoned { name: self.name.clone() })
    }

    /// Maps a memory error of this region to a region error (poisoning names the region).
    pub fn mem_error(&self, e: xfer_rdma::memory::MemError) -> RegionError {
        use xfer_rdma::memory::MemError;
        match e {
            MemError::Poisoned => RegionError::Poisoned { name: self.name.clone() },
            MemError::OutOfRange(r) => RegionError::Invalid(r.to_string()),
            MemError::ReadOnly(r) => RegionError::Denied(format!("region {:?}: {r}", self.name)),
        }
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("name", &self.name).field("id", &self.id).field("length", &self.length).finish()
    }
}

impl Region {
    /// Whether the region is ending: no new use or grant may start on it.
    pub fn is_retiring(&self) -> bool {
        self.retiring.load(Ordering::Acquire)
    }

    /// Marks the region in use until the guard drops.
    pub fn acquire(self: &Arc<Self>) -> RegionUse {
        self.in_use.fetch_add(1, Ordering::AcqRel);
        RegionUse(self.clone())
    }

    /// Checks `offset..offset+len` against the region.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<(), RegionError> {
        check_range(&self.name, self.length, offset, len)
    }
}

/// Checks `offset..offset+len` against a region `name` of `length` bytes.
pub fn check_range(name: &str, length: u64, offset: u64, len: u64) -> Result<(), RegionError> {
    Ok(xfer_engine::range::check_range(name, length, offset, len)?)
}

impl From<xfer_engine::range::RangeError> for RegionError {
    fn from(e: xfer_engine::range::RangeError) -> RegionError {
        RegionError::Invalid(e.to_string())
    }
}

/// Keeps a region marked as in use by a transfer.
pub struct RegionUse(pub Arc<Region>);

impl Drop for RegionUse {
    fn drop(&mut self) {
        self.0.in_use.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct CatalogEntry {
    id: String,
    name: String,
    length: u64,
    kind: RegionKind,
    path: Option<String>,
    access: Access,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    created_at: SystemTime,
    expires_at: Option<SystemTime>,
    #[serde(default)]
    created_object: bool,
    /// The tenant the region is charged to (`crate::tenants`; none: exempt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    owner: Option<String>,
}

impl CatalogEntry {
    fn of(r: &Region) -> CatalogEntry {
        CatalogEntry {
            id: r.id.clone(),
            name: r.name.clone(),
            length: r.length,
            kind: r.kind,
            path: r.path.clone(),
            access: r.access,
            labels: r.labels.clone(),
            created_at: r.created_at,
            expires_at: r.expires_at,
            created_object: r.created_object,
            owner: r._shares.as_ref().and_then(|p| p.tenant()).map(str::to_string),
        }
    }

    fn spec(&self) -> RegionSpec {
        RegionSpec {
            name: self.name.clone(),
            length: self.length,
            kind: self.kind,
            path: self.path.clone(),
            access: self.access,
            hugepages: false,
            ttl: None,
            labels: self.labels.clone(),
            adopt_existing: !self.created_object,
            shares: None,
        }
    }
}

/// A catalog region that could not be restored: what the catalog says, and why. It keeps its
/// name, counts toward `max_regions` (not toward registered bytes) and is retried.
#[derive(Debug, Clone)]
pub struct UnavailableRegion {
    entry: CatalogEntry,
    pub reason: String,
}

impl UnavailableRegion {
    pub fn id(&self) -> &str {
        &self.entry.id
    }
    pub fn name(&self) -> &str {
        &self.entry.name
    }
    pub fn length(&self) -> u64 {
        self.entry.length
    }
    pub fn kind(&self) -> RegionKind {
        self.entry.kind
    }
    pub fn path(&self) -> Option<&str> {
        self.entry.path.as_deref()
    }
    pub fn access(&self) -> Access {
        self.entry.access
    }
    pub fn labels(&self) -> &BTreeMap<String, String> {
        &self.entry.labels
    }
    pub fn created_at(&self) -> SystemTime {
        self.entry.created_at
    }
    pub fn expires_at(&self) -> Option<SystemTime> {
        self.entry.expires_at
    }
}

/// What `GetRegion`/`ListRegions` show: a live region or an unavailable catalog entry.
#[derive(Debug, Clone)]
pub enum RegionView {
    Live(Arc<Region>),
    Unavailable(UnavailableRegion),
}

impl RegionView {
    pub fn name(&self) -> &str {
        match self {
            RegionView::Live(r) => &r.name,
            RegionView::Unavailable(u) => u.name(),
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct RegionLimits {
    pub max_regions: usize,
    pub max_registered_bytes: u64,
    /// Benchmarks' own budget ([`RegionRegistry::reserve_bench`]).
    pub max_bench_bytes: u64,
}

/// Where regions may live and who may see shared memory (`regions.*` in the configuration).
#[derive(Debug, Clone)]
pub struct RegionPolicy {
    /// Absolute directories file regions must live under; the first is where relative paths go.
    pub file_roots: Vec<PathBuf>,
    /// Directory of POSIX shared-memory objects (`/dev/shm`).
    pub shm_dir: PathBuf,
    /// Permission bits of created shm objects.
    pub shm_mode: u32,
    /// Group given to created shm objects.
    pub shm_gid: Option<u32>,
    /// Owner an existing shm object must have to be adopted.
    pub shm_owner: u32,
    /// Accept file regions whose file has other hard links (`regions.allow_hard_links`).
    pub allow_hard_links: bool,
}

impl RegionPolicy {
    /// Private defaults: shm objects 0600 in /dev/shm, adopted only from the agent's own uid.
    pub fn new(file_roots: Vec<PathBuf>) -> RegionPolicy {
        RegionPolicy {
            file_roots,
            shm_dir: PathBuf::from("/dev/shm"),
            shm_mode: 0o600,
            shm_gid: None,
            shm_owner: nix::unistd::geteuid().as_raw(),
            allow_hard_links: false,
        }
    }

    fn roots_text(&self) -> String {
        let v: Vec<String> = self.file_roots.iter().map(|r| r.display().to_string()).collect();
        v.join(", ")
    }
}

/// The registry's maps, under one lock.
#[derive(Default)]
struct Inner {
    /// name → live region.
    live: HashMap<String, Arc<Region>>,
    /// name → catalog entry that could not be restored.
    unavailable: HashMap<String, UnavailableRegion>,
    /// name → bytes of a create in progress (opening, mapping, registering with no lock held):
    /// the name is taken and the bytes are counted until it is inserted or fails.
    pending: HashMap<String, u64>,
    /// Names of benchmark scratch regions being created (their bytes are in the bench budget).
    pending_scratch: std::collections::HashSet<String>,
}

impl Inner {
    /// Regions counted toward `max_regions` (benchmark scratch regions are not).
    fn count(&self) -> usize {
        self.live.values().filter(|r| r.scratch.is_none()).count() + self.unavailable.len() + self.pending.len()
    }

    fn taken(&self, name: &str) -> bool {
        self.live.contains_key(name)
            || self.unavailable.contains_key(name)
            || self.pending.contains_key(name)
            || self.pending_scratch.contains(name)
    }

    /// Bytes counted toward `max_registered_bytes` (benchmark scratch regions' are not).
    fn registered_bytes(&self) -> u64 {
        let live: u64 = self.live.values().filter(|r| r.scratch.is_none()).map(|r| r.length).sum();
        live.saturating_add(self.pending.values().sum::<u64>())
    }
}

/// All regions of this agent, by name.
pub struct RegionRegistry {
    fabric: Arc<dyn Fabric>,
    state_dir: PathBuf,
    policy: RegionPolicy,
    limits: RegionLimits,
    /// A std Mutex: held only for map operations, never across an open, a mapping or an await.
    inner: Mutex<Inner>,
    /// One catalog writer at a time. A writer takes it, *then* snapshots the maps, so the last
    /// rename always carries the newest state. Never held across an await.
    persist_lock: Mutex<()>,
    /// The last catalog write failed: the catalog on disk is stale (see `finish_removal`).
    catalog_dirty: std::sync::atomic::AtomicBool,
    /// Bytes the agent holds outside regions (notification rings), counted against
    /// `max_registered_bytes` like regions ([`Reservation`]).
    reserved: Arc<AtomicU64>,
    /// Bytes benchmarks hold (buffers, pools, scratch regions), against `max_bench_bytes`.
    bench: Arc<AtomicU64>,
    /// Charges a restored region to the tenant that created it ([`RegionRegistry::set_charge`]).
    charge: std::sync::OnceLock<Charge>,
}

/// (tenant key, bytes) → the permits a region of that tenant holds (`crate::tenants`).
pub type Charge = Box<dyn Fn(&str, u64) -> Arc<crate::tenants::Permits> + Send + Sync>;

/// Memory counted against `max_registered_bytes` while it lives; released on drop.
#[derive(Debug)]
pub struct Reservation {
    counter: Arc<AtomicU64>,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Longest region name.
pub const MAX_NAME_LEN: usize = 128;

/// Names of the agent's own shm objects (notification rings) start with this; no region may
/// create or adopt one (a region over a ring would let its holder forge notifications). A
/// region's default object is `xfer-<name>`, which never does.
pub const PRIVATE_SHM_PREFIX: &str = "xfer.ring.";

/// An shm object name: one path component under the shm directory, never `.`-leading.
fn validate_object_name(object: &str) -> Result<(), RegionError> {
    if object.is_empty() || object.contains('/') || object.starts_with('.') || object.len() > 255 || object.contains('\0') {
        return Err(RegionError::Invalid(format!("invalid shm object name {object:?}")));
    }
    Ok(())
}

pub fn validate_name(name: &str) -> Result<(), RegionError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(RegionError::Invalid(format!(
            "invalid region name {name:?}: use 1-128 characters of A-Z a-z 0-9 . _ - (not starting with '.')"
        )))
    }
}

/// A mapped file or shm object, before registration.
struct Opened {
    memory: RegionMemory,
    path: Option<String>,
    /// An shm object the agent created (now or before a restart): removed on delete.
    created_object: bool,
    /// An shm object this call created: removed again if registration fails.
    created_now: bool,
}

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
    fn restored_spec(&self, e: &CatalogEntry) -> RegionSpec {
        let mut spec = e.spec();
        spec.shares = e.owner.as_deref().zip(self.charge.get()).map(|(owner, charge)| charge(owner, e.length));
        spec
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A poisoned lock means a panic while holding it; the maps themselves are still
        // consistent (inserts and removes are single operations), so keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn catalog_path(&self) -> PathBuf {
        self.state_dir.join(CATALOG)
    }

    /// Re-creates file and shm regions from the catalog. An entry that cannot be restored stays
    /// in the catalog as unavailable, with its reason. A catalog that does not parse is moved
    /// aside and the agent starts with no regions; other read errors are returned.
    pub fn restore(&self) -> Result<usize, RegionError> {
        remove_stale_temp_files(&self.state_dir);
        let path = self.catalog_path();
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(io_err(format!("reading {}", path.display()))(e)),
        };
        let entries: Vec<CatalogEntry> = match serde_json::from_slice(&text) {
            Ok(v) => v,
            Err(e) => {
                self.move_catalog_aside(&path, &e.to_string(), text.len())?;
                // A fresh, empty catalog in its place.
                self.persist()?;
                return Ok(0);
            }
        };
        let mut restored = 0;
        for e in entries {
            if e.expires_at.is_some_and(|t| t <= SystemTime::now()) {
                info!(region = %e.name, "region lease expired while the agent was down; not restored");
                continue;
            }
            if validate_name(&e.name).is_err() || self.lock().taken(&e.name) {
                warn!(region = %e.name, "catalog entry with an invalid or duplicate name ignored");
                continue;
            }
            // A catalog edited by hand (or by an attacker) must not show other users what
            // CreateRegion would have refused.
            if let Err(why) = crate::labels::check(&e.labels) {
                warn!(region = %e.name, error = %why, "catalog entry with invalid labels ignored");
                continue;
            }
            match self.build(&self.restored_spec(&e), Some(&e)) {
                Ok(region) => {
                    self.lock().live.insert(region.name.clone(), region);
                    restored += 1;
                }
                Err(err) => {
                    warn!(region = %e.name, error = %err, "could not restore region from the catalog; it is listed as unavailable and retried");
                    let u = UnavailableRegion { reason: err.to_string(), entry: e };
                    self.lock().unavailable.insert(u.entry.name.clone(), u);
                }
            }
        }
        self.persist()?;
        self.update_gauges();
        Ok(restored)
    }

    /// Renames an unreadable catalog to `regions.json.corrupt-<unix time>` so the agent can
    /// start (a crash loop helps nobody) while the file stays for a human to inspect.
    fn move_catalog_aside(&self, path: &Path, problem: &str, len: usize) -> Result<(), RegionError> {
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let mut aside = self.state_dir.join(format!("{CATALOG}.corrupt-{secs}"));
        let mut n = 1;
        while aside.exists() {
            aside = self.state_dir.join(format!("{CATALOG}.corrupt-{secs}.{n}"));
            n += 1;
        }
        std::fs::rename(path, &aside).map_err(io_err(format!("moving the corrupt catalog {} aside", path.display())))?;
        sync_dir(&self.state_dir)?;
        error!(
            catalog = %path.display(),
            moved_to = %aside.display(),
            bytes = len,
            problem,
            "region catalog is corrupt (unparseable, truncated or empty): moved aside, starting with no file or shm regions"
        );
        Ok(())
    }

    pub fn create(&self, spec: RegionSpec) -> Result<Arc<Region>, RegionError> {
        self.create_as(spec, None)
    }

    /// A benchmark's scratch region (anonymous), its bytes already in `budget`
    /// ([`RegionRegistry::reserve_bench`]) and held by the region until its last user drops it:
    /// it takes nothing from `max_regions` or `max_registered_bytes`, so no client's
    /// CreateRegion is refused because a benchmark is running.
    pub fn create_scratch(&self, spec: RegionSpec, budget: Reservation) -> Result<Arc<Region>, RegionError> {
        if spec.kind != RegionKind::Anonymous || budget.bytes < spec.length {
            return Err(RegionError::Invalid("a scratch region is anonymous memory inside its bench budget".into()));
        }
        self.create_as(spec, Some(budget))
    }

    fn create_as(&self, spec: RegionSpec, scratch: Option<Reservation>) -> Result<Arc<Region>, RegionError> {
        validate_name(&spec.name)?;
        crate::labels::check(&spec.labels).map_err(|e| RegionError::Invalid(e.to_string()))?;
        if spec.length == 0 {
            return Err(RegionError::Invalid("region length must be greater than zero".into()));
        }
        {
            let mut st = self.lock();
            if st.taken(&spec.name) {
                return Err(RegionError::AlreadyExists(spec.name));
            }
            if scratch.is_some() {
                st.pending_scratch.insert(spec.name.clone());
            } else {
                if st.count() >= self.limits.max_regions {
                    return Err(RegionError::Limit(format!("max_regions = {}", self.limits.max_regions)));
                }
                let registered = st.registered_bytes().saturating_add(self.reserved.load(Ordering::Acquire));
                if registered.saturating_add(spec.length) > self.limits.max_registered_bytes {
                    return Err(RegionError::Limit(format!(
                        "max_registered_bytes = {} ({} registered, {} requested)",
                        self.limits.max_registered_bytes, registered, spec.length
                    )));
                }
                st.pending.insert(spec.name.clone(), spec.length);
            }
        }
        // No lock from here to the insert: opening a file (even one on a hung NFS mount),
        // mapping and registering must not stall other creates, deletes or lookups.
        let built = self.build(&spec, None).and_then(|mut region| {
            if scratch.is_some() {
                // Just built: no one else holds it yet.
                let r = Arc::get_mut(&mut region).ok_or_else(|| RegionError::Invalid("scratch region shared while built".into()))?;
                r.scratch = scratch;
            }
            Ok(region)
        });
        let region = {
            let mut st = self.lock();
            st.pending.remove(&spec.name);
            st.pending_scratch.remove(&spec.name);
            let region = built?;
            st.live.insert(region.name.clone(), region.clone());
            region
        };
        if region.kind != RegionKind::Anonymous {
            if let Err(e) = self.persist() {
                // Not in the catalog: undo, so the caller's error is the whole truth.
                self.lock().live.remove(&region.name);
                self.remove_created_object(&region);
                self.update_gauges();
                return Err(e);
            }
        }
        self.update_gauges();
        info!(region = %region.name, id = %region.id, kind = ?region.kind, length = region.length, "region created");
        Ok(region)
    }

    /// Counts `bytes` the agent is about to allocate outside regions (for `what`) against
    /// `max_registered_bytes`; RESOURCE_EXHAUSTED when they do not fit.
    pub fn reserve(&self, bytes: u64, what: &str) -> Result<Reservation, RegionError> {
        let st = self.lock();
        let used = st.registered_bytes().saturating_add(self.reserved.load(Ordering::Acquire));
        if used.saturating_add(bytes) > self.limits.max_registered_bytes {
            return Err(RegionError::Limit(format!(
                "max_registered_bytes = {} ({used} in use, {bytes} needed for {what})",
                self.limits.max_registered_bytes
            )));
        }
        self.reserved.fetch_add(bytes, Ordering::AcqRel);
        Ok(Reservation { counter: self.reserved.clone(), bytes })
    }

    /// Counts `bytes` a benchmark is about to hold (for `what`) against `limits.max_bench_bytes`,
    /// apart from everything clients use; RESOURCE_EXHAUSTED when they do not fit.
    pub fn reserve_bench(&self, bytes: u64, what: &str) -> Result<Reservation, RegionError> {
        let max = self.limits.max_bench_bytes;
        self.bench.fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| used.checked_add(bytes).filter(|&n| n <= max)).map_err(
            |used| RegionError::Limit(format!("limits.max_bench_bytes = {max} ({used} in use by benchmarks, {bytes} needed for {what})")),
        )?;
        Ok(Reservation { counter: self.bench.clone(), bytes })
    }

    /// Bytes benchmarks hold now.
    pub fn bench_bytes(&self) -> u64 {
        self.bench.load(Ordering::Acquire)
    }

    /// Opens, maps and registers. Takes no lock. `restored`: the catalog entry being restored.
    fn build(&self, spec: &RegionSpec, restored: Option<&CatalogEntry>) -> Result<Arc<Region>, RegionError> {
        let len =
            usize::try_from(spec.length).map_err(|_| RegionError::Invalid(format!("length {} does not fit this machine", spec.length)))?;
        let opened = match spec.kind {
            RegionKind::Anonymous => {
                let memory = RegionMemory::anonymous(len, spec.hugepages).map_err(io_err(format!("allocating {} bytes", spec.length)))?;
                Opened { memory, path: None, created_object: false, created_now: false }
            }
            RegionKind::File => {
                let path =
                    spec.path.clone().filter(|p| !p.is_empty()).ok_or_else(|| RegionError::Invalid("file regions need a path".into()))?;
                let (file, full) = self.open_region_file(&path, spec.access)?;
                let actual = file.metadata().map_err(io_err(format!("stat {full}")))?.len();
                if actual < spec.length {
                    return Err(RegionError::FileTooShort { path: full, actual, needed: spec.length });
                }
                let writable = spec.access != Access::Read;
                let memory = RegionMemory::map_file(&file, len, writable).map_err(io_err(format!("mapping {full}")))?;
                Opened { memory, path: Some(full), created_object: false, created_now: false }
            }
            RegionKind::Shm => {
                let object = spec.path.clone().filter(|p| !p.is_empty()).unwrap_or_else(|| format!("xfer-{}", spec.name));
                validate_object_name(&object)?;
                if object.starts_with(PRIVATE_SHM_PREFIX) {
                    return Err(RegionError::Denied(format!(
                        "shm object {object:?}: names starting with {PRIVATE_SHM_PREFIX:?} are the agent's own (notification rings)"
                    )));
                }
                let may_create = match restored {
                    // Re-created only if the agent created it in the first place.
                    Some(e) => e.created_object,
                    None => true,
                };
                let (file, created) = self.open_shm(&object, spec.length, spec.adopt_existing || restored.is_some(), may_create)?;
                let mapped = RegionMemory::map_file(&file, len, true).map_err(io_err(format!("mapping shm object {object}")));
                match mapped {
                    Ok(memory) => Opened {
                        memory,
                        path: Some(object),
                        created_object: created || restored.is_some_and(|e| e.created_object),
                        created_now: created,
                    },
                    Err(e) => {
                        if created {
                            self.unlink_shm(&object);
                        }
                        return Err(e);
                    }
                }
            }
        };
        let created_now = opened.created_now;
        let memory = Arc::new(opened.memory);
        // xfer_registration_duration_seconds on every fabric (verbs: ibv_reg_mr pins the pages;
        // tcp registers nothing, and its near-zero times say so instead of an empty panel).
        let started = std::time::Instant::now();
        let registration = match self.fabric.register(memory.clone(), spec.access) {
            Ok(r) => {
                crate::metrics::registration_duration(started.elapsed());
                r
            }
            Err(e) => {
                if created_now {
                    if let Some(obj) = &opened.path {
                        self.unlink_shm(obj);
                    }
                }
                return Err(e.into());
            }
        };
        let now = SystemTime::now();
        Ok(Arc::new(Region {
            id: restored.map(|e| e.id.clone()).unwrap_or_else(new_id),
            name: spec.name.clone(),
            length: spec.length,
            kind: spec.kind,
            path: opened.path,
            access: spec.access,
            hugepages: spec.hugepages,
            labels: spec.labels.clone(),
            created_at: restored.map(|e| e.created_at).unwrap_or(now),
            // A ttl past what a SystemTime holds would panic; requests bound it to 100 years anyway.
            expires_at: restored.and_then(|e| e.expires_at).or_else(|| spec.ttl.and_then(|t| now.checked_add(t))),
            memory,
            registration,
            in_use: AtomicU32::new(0),
            retiring: AtomicBool::new(false),
            created_object: opened.created_object,
            _shares: spec.shares.clone(),
            scratch: None,
        }))
    }

    /// Which root `path` belongs to and the part beneath it. A relative path is beneath the
    /// first root; an absolute one must start with a root (as configured or canonicalized).
    fn locate(&self, path: &str) -> Result<(PathBuf, PathBuf), RegionError> {
        let p = Path::new(path);
        let first = self.policy.file_roots.first().ok_or_else(|| self.denied(path, "no file roots are configured"))?;
        if p.is_relative() {
            return Ok((first.clone(), p.to_path_buf()));
        }
        for root in &self.policy.file_roots {
            let canonical = std::fs::canonicalize(root).ok();
            for form in std::iter::once(root).chain(canonical.as_ref()) {
                if let Ok(rest) = p.strip_prefix(form) {
                    return Ok((root.clone(), rest.to_path_buf()));
                }
            }
        }
        Err(self.denied(path, "it is outside every file root"))
    }

    fn denied(&self, path: &str, why: &str) -> RegionError {
        RegionError::Denied(format!(
            "file {path:?} refused: {why}; file regions must be regular files beneath regions.file_roots ({}) reached without symbolic links",
            self.policy.roots_text()
        ))
    }

    /// Opens a file region's file beneath its root: no symlink anywhere, no `..` out of the root,
    /// non-blocking (a FIFO or device never blocks), and it must be a regular file. Returns the
    /// file and its full path (root + the part beneath it).
    fn open_region_file(&self, path: &str, access: Access) -> Result<(File, String), RegionError> {
        if path.contains('\0') {
            return Err(RegionError::Invalid(format!("file path {path:?} contains a NUL byte")));
        }
        let (root, rest) = self.locate(path)?;
        let full = root.join(&rest).display().to_string();
        if rest.as_os_str().is_empty() {
            return Err(RegionError::NotRegular { path: full, kind: "directory" });
        }
        let dir = nix::fcntl::open(&root, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|e| io_err(format!("opening file root {}", root.display()))(e.into()))?;
        let mode = if access == Access::Read { OFlag::O_RDONLY } else { OFlag::O_RDWR };
        let flags = mode | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW;
        let fd = open_beneath(dir.as_fd(), &rest, flags).map_err(|e| match e {
            Errno::ENOENT => RegionError::PathMissing { path: full.clone() },
            Errno::ELOOP => self.denied(path, "a component is a symbolic link"),
            Errno::EXDEV => self.denied(path, "it resolves outside its file root"),
            Errno::EACCES | Errno::EPERM => self.denied(path, "the agent may not open it"),
            Errno::EISDIR => RegionError::NotRegular { path: full.clone(), kind: "directory" },
            Errno::ENXIO => RegionError::NotRegular { path: full.clone(), kind: "special file" },
            Errno::ENOTDIR => RegionError::Invalid(format!("file {full:?}: a component of the path is not a directory")),
            Errno::ENAMETOOLONG => RegionError::Invalid(format!("file {full:?}: the path or a component of it is too long")),
            other => io_err(format!("opening {full}"))(other.into()),
        })?;
        let file = File::from(fd);
        let meta = file.metadata().map_err(io_err(format!("stat {full}")))?;
        if !meta.file_type().is_file() {
            return Err(RegionError::NotRegular { path: full, kind: file_kind(&meta.file_type()) });
        }
        crate::safe_file::check_hard_links(&meta, self.policy.allow_hard_links)
            .map_err(|why| RegionError::Denied(format!("file {full:?} refused: {why}")))?;
        Ok((file, full))
    }

    /// Opens or creates the shm object `object`: `adopt` allows using an existing one (regular,
    /// right owner, long enough: never resized), `create` allows creating a missing one (0600 or
    /// `shm_mode`, `O_EXCL`). Returns the file and whether this call created it.
    fn open_shm(&self, object: &str, length: u64, adopt: bool, create: bool) -> Result<(File, bool), RegionError> {
        let shm = &self.policy.shm_dir;
        let dir = nix::fcntl::open(shm, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|e| io_err(format!("opening {}", shm.display()))(e.into()))?;
        if adopt {
            let flags = OFlag::O_RDWR | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC;
            match nix::fcntl::openat(dir.as_fd(), object, flags, Mode::empty()) {
                Ok(fd) => return self.check_adopted(File::from(fd), object, length).map(|f| (f, false)),
                Err(Errno::ENOENT) if create => {}
                Err(Errno::ENOENT) => {
                    return Err(RegionError::PathMissing { path: shm.join(object).display().to_string() });
                }
                Err(Errno::ELOOP) => {
                    return Err(RegionError::Denied(format!("shm object {object:?} is a symbolic link; it is not adopted")));
                }
                Err(e) => return Err(io_err(format!("opening shm object {object}"))(e.into())),
            }
        }
        let flags = OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let mode = Mode::from_bits_truncate(self.policy.shm_mode);
        let fd = match nix::fcntl::openat(dir.as_fd(), object, flags, mode) {
            Ok(fd) => fd,
            Err(Errno::EEXIST) => return Err(RegionError::ShmExists { object: object.to_string() }),
            Err(e) => return Err(io_err(format!("creating shm object {object}"))(e.into())),
        };
        let file = File::from(fd);
        let setup = || -> std::io::Result<()> {
            // The umask may have cleared bits of the mode asked for: set it exactly.
            nix::sys::stat::fchmod(file.as_fd(), mode)?;
            if let Some(gid) = self.policy.shm_gid {
                std::os::unix::fs::fchown(&file, None, Some(gid))?;
            }
            file.set_len(length)
        };
        if let Err(e) = setup() {
            let _ = nix::unistd::unlinkat(dir.as_fd(), object, nix::unistd::UnlinkatFlags::NoRemoveDir);
            return Err(io_err(format!("setting up shm object {object}"))(e));
        }
        Ok((file, true))
    }

    fn check_adopted(&self, file: File, object: &str, length: u64) -> Result<File, RegionError> {
        let meta = file.metadata().map_err(io_err(format!("stat shm object {object}")))?;
        if !meta.file_type().is_file() {
            return Err(RegionError::NotRegular { path: object.to_string(), kind: file_kind(&meta.file_type()) });
        }
        if meta.uid() != self.policy.shm_owner {
            return Err(RegionError::Denied(format!(
                "shm object {object:?} is owned by uid {}; only objects owned by uid {} (the agent, or regions.shm_owner) are adopted",
                meta.uid(),
                self.policy.shm_owner
            )));
        }
        if meta.len() < length {
            return Err(RegionError::FileTooShort { path: object.to_string(), actual: meta.len(), needed: length });
        }
        Ok(file)
    }

    /// A fresh shm object of `length` bytes for the agent's own use (a notification ring):
    /// created like a region's (`O_EXCL | O_NOFOLLOW`, `regions.shm_mode`, `regions.shm_group`),
    /// never an existing one. The caller removes it with [`RegionRegistry::remove_private_shm`].
    pub fn create_private_shm(&self, object: &str, length: u64) -> Result<File, RegionError> {
        validate_object_name(object)?;
        if !object.starts_with(PRIVATE_SHM_PREFIX) {
            return Err(RegionError::Invalid(format!("a private shm object's name starts with {PRIVATE_SHM_PREFIX:?}: {object:?}")));
        }
        self.open_shm(object, length, false, true).map(|(f, _)| f)
    }

    /// Removes an object [`RegionRegistry::create_private_shm`] made.
    pub fn remove_private_shm(&self, object: &str) {
        self.unlink_shm(object);
    }

    /// Removes the objects whose names start with `prefix` (one of [`PRIVATE_SHM_PREFIX`]) that
    /// are regular files of the agent's uid: what an earlier run of this agent (same state dir)
    /// left when it was killed. Returns how many.
    pub fn sweep_private_shm(&self, prefix: &str) -> usize {
        if !prefix.starts_with(PRIVATE_SHM_PREFIX) {
            return 0;
        }
        let Ok(dir) = std::fs::read_dir(&self.policy.shm_dir) else { return 0 };
        let me = nix::unistd::geteuid().as_raw();
        let mut removed = 0;
        for e in dir.flatten() {
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            // symlink_metadata: a link planted under such a name is not followed, and not ours.
            let ours = name.starts_with(prefix) && e.path().symlink_metadata().is_ok_and(|m| m.file_type().is_file() && m.uid() == me);
            if ours && std::fs::remove_file(e.path()).is_ok() {
                removed += 1;
            }
        }
        if removed > 0 {
            warn!(removed, prefix, "removed notification rings an earlier run of this agent left behind");
        }
        removed
    }

    /// Where the shm object `object` lives.
    pub fn shm_path(&self, object: &str) -> PathBuf {
        self.policy.shm_dir.join(object)
    }

    fn unlink_shm(&self, object: &str) {
        if let Err(e) = std::fs::remove_file(self.policy.shm_dir.join(object)) {
            warn!(object, error = %e, "could not remove shm object");
        }
    }

    fn remove_created_object(&self, region: &Region) {
        if region.kind == RegionKind::Shm && region.created_object {
            if let Some(obj) = &region.path {
                self.unlink_shm(obj);
            }
        }
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

    fn acquire_as(&self, name_or_id: &str, scratch: bool) -> Result<RegionUse, RegionError> {
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
    fn find(st: &Inner, name_or_id: &str) -> Option<RegionView> {
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
    fn live(view: RegionView) -> Result<Arc<Region>, RegionError> {
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

    /// Deletes a region; an unavailable one just leaves the catalog (its file or object is not
    /// touched). Returns the live region that was removed, if it was live. `cut_off` is called
    /// as in [`RegionRegistry::retire`].
    pub fn delete(&self, name: &str, cut_off: impl FnOnce(&Arc<Region>)) -> Result<Option<Arc<Region>>, RegionError> {
        let removed = {
            let mut st = self.lock();
            if let Some(r) = st.live.get(name).cloned() {
                if r.in_use.load(Ordering::Acquire) > 0 {
                    return Err(RegionError::Busy(name.to_string()));
                }
                if r.retiring.swap(true, Ordering::AcqRel) {
                    // Its lease ended and the reaper is removing it.
                    return Err(RegionError::NotFound(name.to_string()));
                }
                Some(r)
            } else if st.unavailable.remove(name).is_some() {
                None
            } else {
                return Err(RegionError::NotFound(name.to_string()));
            }
        };
        match &removed {
            Some(region) => self.retire(region, cut_off),
            None => {
                self.persist()?;
                self.update_gauges();
            }
        }
        info!(region = %name, "region deleted");
        Ok(removed)
    }

    /// The one way a live region ends (delete, lease, a benchmark's scratch region): the caller
    /// marked it retiring under the registry lock (no new use, no new grant; none in use).
    /// `cut_off` then revokes what reaches it from outside (its grants: chunks being copied
    /// finish, streams mid-payload are closed) while it is still visible, and only then does it
    /// leave the registry: once a lookup answers NOT_FOUND, no byte of it changes.
    fn retire(&self, region: &Arc<Region>, cut_off: impl FnOnce(&Arc<Region>)) {
        cut_off(region);
        {
            let mut st = self.lock();
            if st.live.get(&region.name).is_some_and(|r| Arc::ptr_eq(r, region)) {
                st.live.remove(&region.name);
            }
        }
        self.finish_removal(region);
    }

    /// Completes the removal of a region already taken out of `live`. A catalog that cannot be
    /// written (ENOSPC, EIO, EMFILE...) does not undo the delete: the region is gone for callers,
    /// and the caller revokes its grants, so nothing can reach it; the catalog is marked dirty
    /// and rewritten by the next catalog write or [`RegionRegistry::retry_unavailable`]'s pass.
    /// (Undoing it instead would leave an agent out of descriptors unable to free any.) Until
    /// then a crash would bring the region back from the stale catalog, which is logged.
    fn finish_removal(&self, region: &Region) {
        if region.kind != RegionKind::Anonymous {
            let _ = region.memory.flush();
            self.persist_or_mark_dirty("deleting region", &region.name);
        }
        self.remove_created_object(region);
        self.update_gauges();
    }

    /// Writes the catalog; on failure marks it dirty (retried later) and says so loudly.
    fn persist_or_mark_dirty(&self, what: &str, name: &str) {
        if let Err(e) = self.persist() {
            self.catalog_dirty.store(true, Ordering::Release);
            m::catalog_write_failed();
            error!(region = %name, error = %e, "{what}: the catalog could not be written; it is retried, and until it is written a crash would bring the region back");
        }
    }

    /// Rewrites a catalog whose last write failed. Returns whether it is clean now.
    pub fn retry_dirty_catalog(&self) -> bool {
        if !self.catalog_dirty.load(Ordering::Acquire) {
            return true;
        }
        match self.persist() {
            Ok(()) => {
                info!("catalog rewritten after an earlier failure");
                true
            }
            Err(e) => {
                warn!(error = %e, "catalog still cannot be written");
                false
            }
        }
    }

    /// Whether a lease has ended at `now`, or a retry pass has work (an unavailable region, a
    /// stale catalog): the background ticks look first, so an idle agent sends nothing to the
    /// blocking pool and its threads can leave.
    pub fn housekeeping_due(&self, now: Option<SystemTime>) -> bool {
        let st = self.lock();
        match now {
            Some(now) => {
                st.live.values().any(|r| r.expires_at.is_some_and(|t| t <= now))
                    || st.unavailable.values().any(|u| u.expires_at().is_some_and(|t| t <= now))
            }
            None => !st.unavailable.is_empty() || self.catalog_dirty.load(Ordering::Acquire),
        }
    }

    /// Removes regions whose lease ended and are not in use, each like a delete (`cut_off` as
    /// in [`RegionRegistry::retire`]); returns the live ones. Unavailable regions whose lease
    /// ended leave the catalog too.
    pub fn reap_expired(&self, now: SystemTime, cut_off: impl Fn(&Arc<Region>)) -> Vec<Arc<Region>> {
        let (expired, dropped) = {
            let mut st = self.lock();
            let mut expired = Vec::new();
            for r in st.live.values() {
                let due = r.expires_at.is_some_and(|t| t <= now) && r.in_use.load(Ordering::Acquire) == 0;
                // A region being deleted already is left to its deleter.
                if due && !r.retiring.swap(true, Ordering::AcqRel) {
                    expired.push(Arc::clone(r));
                }
            }
            let before = st.unavailable.len();
            st.unavailable.retain(|_, u| u.expires_at().is_none_or(|t| t > now));
            (expired, before != st.unavailable.len())
        };
        for r in &expired {
            self.retire(r, &cut_off);
            info!(region = %r.name, "region lease expired; deregistered");
        }
        if dropped {
            self.persist_or_mark_dirty("dropping expired unavailable regions", "-");
            self.update_gauges();
        }
        expired
    }

    /// Tries every unavailable region again (the same checks as a create); those that can be
    /// opened now become live. Returns how many did. Blocking: call it off the reactor.
    pub fn retry_unavailable(&self) -> usize {
        let candidates: Vec<UnavailableRegion> = self.lock().unavailable.values().cloned().collect();
        let mut revived = 0;
        for u in candidates {
            let result = self.build(&self.restored_spec(&u.entry), Some(&u.entry));
            let mut st = self.lock();
            // Deleted or replaced while we were opening: drop what we built.
            let still = st.unavailable.get(u.name()).is_some_and(|x| x.id() == u.id());
            match result {
                Ok(region) if still => {
                    st.unavailable.remove(u.name());
                    st.live.insert(region.name.clone(), region);
                    revived += 1;
                    info!(region = %u.name(), "unavailable region restored");
                }
                Ok(_) => {}
                Err(e) => {
                    if let Some(x) = st.unavailable.get_mut(u.name()).filter(|_| still) {
                        let reason = e.to_string();
                        if x.reason != reason {
                            info!(region = %u.name(), %reason, "region still unavailable");
                            x.reason = reason;
                        }
                    }
                }
            }
        }
        if revived > 0 {
            if let Err(e) = self.persist() {
                warn!(error = %e, "catalog update after restoring regions failed");
            }
            self.update_gauges();
        }
        revived
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

    fn update_gauges(&self) {
        let (n, bytes) = self.totals();
        m::regions(n, bytes);
    }

    /// Writes the catalog: one writer at a time, unique temp file, fsync, rename, fsync dir.
    fn persist(&self) -> Result<(), RegionError> {
        let _writer = self.persist_lock.lock().unwrap_or_else(|p| p.into_inner());
        let entries: Vec<CatalogEntry> = {
            let st = self.lock();
            let mut v: Vec<CatalogEntry> = st
                .live
                .values()
                .filter(|r| r.kind != RegionKind::Anonymous)
                .map(|r| CatalogEntry::of(r))
                .chain(st.unavailable.values().map(|u| u.entry.clone()))
                .collect();
            v.sort_by(|a, b| a.name.cmp(&b.name));
            v
        };
        let text = serde_json::to_vec_pretty(&entries).map_err(|e| RegionError::Invalid(e.to_string()))?;
        write_durably(&self.state_dir, CATALOG, &text)?;
        self.catalog_dirty.store(false, Ordering::Release);
        Ok(())
    }
}

const CATALOG: &str = "regions.json";

/// Replaces `dir/name` with `bytes` so that after a crash or power loss it holds either the old
/// or the new content ([`crate::safe_file::write_atomically`]: a temp file of its own,
/// `regions.json.<pid>.<random>.tmp`, created `O_EXCL | O_NOFOLLOW` so concurrent writers never
/// share one and a planted link is never followed; fsync, rename, fsync of the directory).
fn write_durably(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), RegionError> {
    let target = dir.join(name);
    crate::safe_file::write_atomically(&target, bytes, 0o600).map_err(io_err(format!("writing {}", target.display())))
}

fn sync_dir(dir: &Path) -> Result<(), RegionError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(format!("syncing directory {}", dir.display())))
}

/// Temp files a killed agent left behind (`regions.json.<pid>.<random>.tmp`).
fn remove_stale_temp_files(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("regions.json.") && name.ends_with(".tmp") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn file_kind(t: &std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "directory"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_socket() {
        "socket"
    } else if t.is_symlink() {
        "symbolic link"
    } else {
        "special file"
    }
}

/// Opens `rest` beneath the directory `dir` with `flags`: no component may be a symbolic link
/// and none may leave `dir`. `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` when the kernel has
/// it (5.6+), else [`walk_beneath`].
fn open_beneath(dir: BorrowedFd<'_>, rest: &Path, flags: OFlag) -> Result<OwnedFd, Errno> {
    let how = OpenHow::new()
        .flags(flags)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let mut tries = 0;
    loop {
        match nix::fcntl::openat2(dir, rest, how) {
            Err(Errno::ENOSYS) => return walk_beneath(dir, rest, flags),
            // The kernel saw a concurrent rename while resolving `..`: retry a few times.
            Err(Errno::EAGAIN) if tries < 3 => tries += 1,
            other => return other,
        }
    }
}

/// The openat2 fallback: one `openat` per component, directories with `O_NOFOLLOW |
/// O_DIRECTORY`, the last with `flags | O_NOFOLLOW`. Stricter than openat2: any `..` is refused
/// (EXDEV), even one that would stay beneath `dir`.
fn walk_beneath(dir: BorrowedFd<'_>, rest: &Path, flags: OFlag) -> Result<OwnedFd, Errno> {
    let mut parts: Vec<&OsStr> = Vec::new();
    for c in rest.components() {
        match c {
            Component::Normal(p) => parts.push(p),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => return Err(Errno::EXDEV),
        }
    }
    let Some((last, dirs)) = parts.split_last() else { return Err(Errno::EISDIR) };
    let mut current: Option<OwnedFd> = None;
    for part in dirs {
        let at = current.as_ref().map_or(dir, |f| f.as_fd());
        let next =
            nix::fcntl::openat(at, *part, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty())
                .map_err(|e| symlink_or(at, part, e))?;
        current = Some(next);
    }
    let at = current.as_ref().map_or(dir, |f| f.as_fd());
    nix::fcntl::openat(at, *last, flags | OFlag::O_NOFOLLOW, Mode::empty())
}

/// `O_NOFOLLOW | O_DIRECTORY` on a symlink may say ENOTDIR rather than ELOOP: report ELOOP.
fn symlink_or(at: BorrowedFd<'_>, part: &OsStr, e: Errno) -> Errno {
    if e == Errno::ENOTDIR {
        if let Ok(st) = nix::sys::stat::fstatat(at, part, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
            if nix::sys::stat::SFlag::from_bits_truncate(st.st_mode) & nix::sys::stat::SFlag::S_IFMT == nix::sys::stat::SFlag::S_IFLNK {
                return Errno::ELOOP;
            }
        }
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        assert!(validate_name("weights-0.bin").is_ok());
        assert!(validate_name("").is_err());
        assert!(validate_name("a/b").is_err());
        assert!(validate_name(".hidden").is_err());
        assert!(validate_name(&"x".repeat(129)).is_err());
    }

    /// openat2 and the fallback walk refuse the same escapes and open the same files.
    #[test]
    fn open_beneath_and_the_fallback_walk_refuse_escapes() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let outside = tmp.path().join("outside");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("secret"), b"secret").unwrap();
        std::fs::write(root.join("sub/ok.bin"), b"ok").unwrap();
        std::os::unix::fs::symlink(outside.join("secret"), root.join("link")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("dirlink")).unwrap();
        std::os::unix::fs::symlink("ok.bin", root.join("sub/inner-link")).unwrap();
        let dir = nix::fcntl::open(&root, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty()).unwrap();
        let flags = OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW;
        type Opener = fn(BorrowedFd<'_>, &Path, OFlag) -> Result<OwnedFd, Errno>;
        for (which, open) in [("openat2", open_beneath as Opener), ("walk", walk_beneath as Opener)] {
            let fd = open(dir.as_fd(), Path::new("sub/ok.bin"), flags).unwrap_or_else(|e| panic!("{which}: {e}"));
            assert_eq!(std::io::read_to_string(File::from(fd)).unwrap(), "ok", "{which}");
            for (path, want) in [
                ("link", [Errno::ELOOP].as_slice()),
                ("dirlink/secret", &[Errno::ELOOP]),
                ("sub/inner-link", &[Errno::ELOOP]),
                ("../outside/secret", &[Errno::EXDEV]),
                ("sub/../../outside/secret", &[Errno::EXDEV]),
                ("missing", &[Errno::ENOENT]),
            ] {
                let e = open(dir.as_fd(), Path::new(path), flags).map(drop).unwrap_err();
                assert!(want.contains(&e), "{which} {path}: {e}");
            }
        }
    }

    #[test]
    fn concurrent_durable_writes_never_share_a_temp_file() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let threads: Vec<_> = (0..16)
            .map(|t| {
                let dir = dir.clone();
                std::thread::spawn(move || {
                    for i in 0..25 {
                        write_durably(&dir, CATALOG, format!("[{t}, {i}]").as_bytes()).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let v: Vec<u32> = serde_json::from_slice(&std::fs::read(dir.join(CATALOG)).unwrap()).unwrap();
        assert_eq!(v.len(), 2);
        let names: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(names, [CATALOG], "no temp file left behind");
    }

    async fn registry(state: &Path, policy: RegionPolicy, max_regions: usize) -> RegionRegistry {
        let grants = Arc::new(crate::grants::GrantTable::new(16));
        let fabric = xfer_fabric::tcp::TcpFabric::bind("127.0.0.1:0".parse().unwrap(), grants, None).await.unwrap();
        let limits = RegionLimits { max_regions, max_registered_bytes: 1 << 30, max_bench_bytes: 1 << 20 };
        RegionRegistry::new(Arc::new(fabric), state.to_path_buf(), limits, policy)
    }

    fn spec(name: &str, kind: RegionKind, path: &str, length: u64) -> RegionSpec {
        RegionSpec {
            name: name.into(),
            length,
            kind,
            path: Some(path.into()),
            access: Access::ReadWrite,
            hugepages: false,
            ttl: None,
            labels: BTreeMap::new(),
            adopt_existing: false,
            shares: None,
        }
    }

    #[tokio::test]
    async fn a_region_in_use_cannot_be_deleted_and_use_starts_under_the_lock() {
        let tmp = tempfile::tempdir().unwrap();
        let reg = registry(tmp.path(), RegionPolicy::new(vec![tmp.path().to_path_buf()]), 4).await;
        let mut anon = spec("a", RegionKind::Anonymous, "", 4096);
        anon.path = None;
        let r = reg.create(anon).unwrap();
        // By name and by id; the use is the very region.
        let u = reg.acquire("a").unwrap();
        assert!(Arc::ptr_eq(&u.0, &r));
        let by_id = reg.acquire(&r.id).unwrap();
        assert!(matches!(reg.delete("a", |_| {}), Err(RegionError::Busy(_))));
        drop(u);
        assert!(matches!(reg.delete("a", |_| {}), Err(RegionError::Busy(_))), "still used through its id");
        drop(by_id);
        reg.delete("a", |_| {}).unwrap();
        assert!(matches!(reg.acquire("a"), Err(RegionError::NotFound(_))));
        assert!(matches!(reg.acquire(&r.id), Err(RegionError::NotFound(_))));
    }

    #[tokio::test]
    async fn an_unrestorable_region_stays_unavailable_until_its_file_is_back() {
        let tmp = tempfile::tempdir().unwrap();
        let (state, root) = (tmp.path().join("state"), tmp.path().join("root"));
        std::fs::create_dir_all(&state).unwrap();
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("a.bin"), vec![1u8; 4096]).unwrap();
        let reg = registry(&state, RegionPolicy::new(vec![root.clone()]), 2).await;
        reg.create(spec("a", RegionKind::File, "a.bin", 4096)).unwrap();
        drop(reg);
        let catalog = std::fs::read(state.join(CATALOG)).unwrap();
        std::fs::rename(root.join("a.bin"), tmp.path().join("away")).unwrap();

        let reg = registry(&state, RegionPolicy::new(vec![root.clone()]), 2).await;
        assert_eq!(reg.restore().unwrap(), 0);
        let RegionView::Unavailable(u) = reg.describe("a").unwrap() else { panic!("a is live") };
        assert!(u.reason.contains("does not exist"), "{}", u.reason);
        assert!(matches!(reg.get("a"), Err(RegionError::Unavailable { .. })));
        assert_eq!(reg.totals(), (1, 0), "counted as a region, not as registered bytes");
        assert_eq!(std::fs::read(state.join(CATALOG)).unwrap(), catalog, "kept in the catalog");
        reg.create(RegionSpec { kind: RegionKind::Anonymous, path: None, ..spec("b", RegionKind::Anonymous, "", 10) }).unwrap();
        let e = reg.create(RegionSpec { kind: RegionKind::Anonymous, path: None, ..spec("c", RegionKind::Anonymous, "", 10) }).unwrap_err();
        assert!(matches!(e, RegionError::Limit(_)), "{e}");
        assert_eq!(reg.retry_unavailable(), 0);

        std::fs::rename(tmp.path().join("away"), root.join("a.bin")).unwrap();
        assert_eq!(reg.retry_unavailable(), 1);
        let a = reg.get("a").unwrap();
        assert_eq!(a.memory.len(), 4096);
        assert_eq!(std::fs::read(state.join(CATALOG)).unwrap(), catalog);

        // A root that moved away makes the same entry unavailable again at the next start.
        drop(a);
        drop(reg);
        let reg = registry(&state, RegionPolicy::new(vec![tmp.path().join("elsewhere")]), 2).await;
        reg.restore().unwrap();
        let RegionView::Unavailable(u) = reg.describe("a").unwrap() else { panic!("a is live") };
        assert!(u.reason.contains("outside every file root"), "{}", u.reason);
        // Deleting it is the only way out of the catalog, and it leaves the file alone.
        assert!(reg.delete("a", |_| {}).unwrap().is_none());
        assert_eq!(std::fs::read(state.join(CATALOG)).unwrap(), b"[]");
        assert_eq!(std::fs::read(root.join("a.bin")).unwrap(), vec![1u8; 4096]);
    }

    #[tokio::test]
    async fn shm_objects_are_created_private_and_adopted_only_when_safe() {
        let tmp = tempfile::tempdir().unwrap();
        let (state, shm) = (tmp.path().join("state"), tmp.path().join("shm"));
        std::fs::create_dir_all(&state).unwrap();
        std::fs::create_dir_all(&shm).unwrap();
        let mut policy = RegionPolicy::new(vec![tmp.path().join("files")]);
        policy.shm_dir = shm.clone();
        let reg = registry(&state, policy, 16).await;
        reg.create(spec("mine", RegionKind::Shm, "mine", 8192)).unwrap();
        let meta = std::fs::metadata(shm.join("mine")).unwrap();
        assert_eq!((meta.mode() & 0o777, meta.len()), (0o600, 8192));
        // Another app's object.
        std::fs::write(shm.join("app"), b"app-private-data!!").unwrap();
        std::os::unix::fs::chown(shm.join("app"), Some(65534), None).unwrap();
        let e = reg.create(spec("s", RegionKind::Shm, "app", 65536)).unwrap_err();
        assert!(matches!(e, RegionError::ShmExists { .. }), "{e}");
        let e = reg.create(RegionSpec { adopt_existing: true, ..spec("s", RegionKind::Shm, "app", 16) }).unwrap_err();
        assert!(matches!(e, RegionError::Denied(_)), "{e}");
        std::os::unix::fs::chown(shm.join("app"), Some(nix::unistd::geteuid().as_raw()), None).unwrap();
        let e = reg.create(RegionSpec { adopt_existing: true, ..spec("s", RegionKind::Shm, "app", 65536) }).unwrap_err();
        assert!(matches!(e, RegionError::FileTooShort { .. }), "{e}");
        assert_eq!(std::fs::read(shm.join("app")).unwrap(), b"app-private-data!!", "never resized");
        assert_eq!(reg.list(&BTreeMap::new()).len(), 1);

        // Restart with the created object gone: re-created (the catalog says the agent made it).
        // An adopted object that is gone is not: the region is unavailable.
        reg.create(RegionSpec { adopt_existing: true, ..spec("adopted", RegionKind::Shm, "app", 16) }).unwrap();
        drop(reg);
        std::fs::remove_file(shm.join("mine")).unwrap();
        std::fs::remove_file(shm.join("app")).unwrap();
        let mut policy = RegionPolicy::new(vec![tmp.path().join("files")]);
        policy.shm_dir = shm.clone();
        let reg = registry(&state, policy, 16).await;
        assert_eq!(reg.restore().unwrap(), 1);
        assert!(reg.get("mine").is_ok());
        assert_eq!(std::fs::metadata(shm.join("mine")).unwrap().mode() & 0o777, 0o600);
        assert!(matches!(reg.get("adopted"), Err(RegionError::Unavailable { .. })));
        assert!(!shm.join("app").exists(), "an adopted object is never re-created");
    }

    #[tokio::test]
    async fn a_corrupt_catalog_is_moved_aside() {
        for content in [&b""[..], &b"[{\"id\": \"x\", \"na"[..], &b"\xff\x00garbage"[..]] {
            let tmp = tempfile::tempdir().unwrap();
            let state = tmp.path().to_path_buf();
            std::fs::write(state.join(CATALOG), content).unwrap();
            let reg = registry(&state, RegionPolicy::new(vec![state.join("files")]), 16).await;
            assert_eq!(reg.restore().unwrap(), 0);
            let aside: Vec<PathBuf> = std::fs::read_dir(&state)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.to_string_lossy().contains(".corrupt-"))
                .collect();
            assert_eq!(aside.len(), 1);
            assert_eq!(std::fs::read(&aside[0]).unwrap(), content);
            assert_eq!(std::fs::read(state.join(CATALOG)).unwrap(), b"[]");
        }
    }
}
