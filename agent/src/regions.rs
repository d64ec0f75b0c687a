//! Region registry: allocate or map memory, register it with the fabric, leases, and the catalog.
//!
//! Kinds: `anonymous` (agent-allocated, zeroed), `file` (a shared mapping of an existing file whose
//! data persists) and `shm` (a POSIX shared-memory object under /dev/shm that local applications
//! map too). The catalog of file and shm regions is written to `<state_dir>/regions.json` on every
//! change (write to a temp file, then rename), and read back at start so those regions survive an
//! agent restart with their data. Anonymous regions die with the agent by design.
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::fabric::{Access, Fabric, FabricError, Registration};
use crate::metrics as m;
use crate::verbs::memory::RegionMemory;

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
    /// shm object created by the agent (unlinked on delete)
    created_object: bool,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("name", &self.name).field("id", &self.id).field("length", &self.length).finish()
    }
}

impl Region {
    /// Marks the region in use until the guard drops.
    pub fn acquire(self: &Arc<Self>) -> RegionUse {
        self.in_use.fetch_add(1, Ordering::AcqRel);
        RegionUse(self.clone())
    }

    /// Checks `offset..offset+len` against the region.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<(), RegionError> {
        match offset.checked_add(len) {
            None => Err(RegionError::Invalid(format!("offset {offset} + length {len} overflows"))),
            Some(end) if end > self.length => Err(RegionError::Invalid(format!(
                "range {offset}..{end} is outside region {:?} of {} bytes",
                self.name, self.length
            ))),
            Some(_) => Ok(()),
        }
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
}

#[derive(Debug, Clone, Copy)]
pub struct RegionLimits {
    pub max_regions: usize,
    pub max_registered_bytes: u64,
}

/// All regions of this agent, by name.
pub struct RegionRegistry {
    fabric: Arc<dyn Fabric>,
    state_dir: PathBuf,
    shm_dir: PathBuf,
    limits: RegionLimits,
    /// name → region. A std Mutex: held only for map operations, never across an await.
    regions: Mutex<HashMap<String, Arc<Region>>>,
    /// Serialises creates so the catalog write order matches the map (held across mapping and
    /// registration, which may be slow, but never across an await).
    create_lock: Mutex<()>,
    /// Bytes the agent holds outside regions (benchmark buffers), counted against
    /// `max_registered_bytes` like regions ([`Reservation`]).
    reserved: Arc<AtomicU64>,
}

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

pub fn validate_name(name: &str) -> Result<(), RegionError> {
    let ok = !name.is_empty()
        && name.len() <= 128
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

impl RegionRegistry {
    pub fn new(fabric: Arc<dyn Fabric>, state_dir: PathBuf, limits: RegionLimits) -> Self {
        Self::with_shm_dir(fabric, state_dir, PathBuf::from("/dev/shm"), limits)
    }

    pub fn with_shm_dir(fabric: Arc<dyn Fabric>, state_dir: PathBuf, shm_dir: PathBuf, limits: RegionLimits) -> Self {
        RegionRegistry {
            fabric,
            state_dir,
            shm_dir,
            limits,
            regions: Mutex::new(HashMap::new()),
            create_lock: Mutex::new(()),
            reserved: Arc::new(AtomicU64::new(0)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Region>>> {
        // A poisoned lock means a panic while holding it; the map itself is still consistent
        // (inserts and removes are single operations), so keep serving.
        self.regions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn catalog_path(&self) -> PathBuf {
        self.state_dir.join("regions.json")
    }

    /// Re-creates file and shm regions from the catalog. Entries that cannot be restored are
    /// logged and dropped from the catalog.
    pub fn restore(&self) -> Result<usize, RegionError> {
        let path = self.catalog_path();
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(io_err(format!("reading {}", path.display()))(e)),
        };
        let entries: Vec<CatalogEntry> = serde_json::from_str(&text)
            .map_err(|e| RegionError::Invalid(format!("corrupt region catalog {}: {e}", path.display())))?;
        let mut restored = 0;
        for e in entries {
            if e.expires_at.is_some_and(|t| t <= SystemTime::now()) {
                info!(region = %e.name, "region lease expired while the agent was down; not restored");
                continue;
            }
            let spec = RegionSpec {
                name: e.name.clone(),
                length: e.length,
                kind: e.kind,
                path: e.path.clone(),
                access: e.access,
                hugepages: false,
                ttl: None,
                labels: e.labels.clone(),
            };
            match self.build(&spec, Some(&e)) {
                Ok(region) => {
                    self.lock().insert(region.name.clone(), region);
                    restored += 1;
                }
                Err(err) => warn!(region = %e.name, error = %err, "could not restore region from catalog"),
            }
        }
        self.persist()?;
        self.update_gauges();
        Ok(restored)
    }

    pub fn create(&self, spec: RegionSpec) -> Result<Arc<Region>, RegionError> {
        validate_name(&spec.name)?;
        if spec.length == 0 {
            return Err(RegionError::Invalid("region length must be greater than zero".into()));
        }
        let _serial = self.create_lock.lock().unwrap_or_else(|p| p.into_inner());
        {
            let map = self.lock();
            if map.contains_key(&spec.name) {
                return Err(RegionError::AlreadyExists(spec.name));
            }
            if map.len() >= self.limits.max_regions {
                return Err(RegionError::Limit(format!("max_regions = {}", self.limits.max_regions)));
            }
            let registered: u64 = map.values().map(|r| r.length).sum::<u64>().saturating_add(self.reserved.load(Ordering::Acquire));
            if registered.saturating_add(spec.length) > self.limits.max_registered_bytes {
                return Err(RegionError::Limit(format!(
                    "max_registered_bytes = {} ({} registered, {} requested)",
                    self.limits.max_registered_bytes, registered, spec.length
                )));
            }
        }
        let region = self.build(&spec, None)?;
        self.lock().insert(region.name.clone(), region.clone());
        if region.kind != RegionKind::Anonymous {
            self.persist()?;
        }
        self.update_gauges();
        info!(region = %region.name, id = %region.id, kind = ?region.kind, length = region.length, "region created");
        Ok(region)
    }

    /// Counts `bytes` the agent is about to allocate outside regions (for `what`) against
    /// `max_registered_bytes`; RESOURCE_EXHAUSTED when they do not fit.
    pub fn reserve(&self, bytes: u64, what: &str) -> Result<Reservation, RegionError> {
        let map = self.lock();
        let used = map.values().map(|r| r.length).sum::<u64>().saturating_add(self.reserved.load(Ordering::Acquire));
        if used.saturating_add(bytes) > self.limits.max_registered_bytes {
            return Err(RegionError::Limit(format!(
                "max_registered_bytes = {} ({used} in use, {bytes} needed for {what})",
                self.limits.max_registered_bytes
            )));
        }
        self.reserved.fetch_add(bytes, Ordering::AcqRel);
        Ok(Reservation { counter: self.reserved.clone(), bytes })
    }

    fn build(&self, spec: &RegionSpec, restored: Option<&CatalogEntry>) -> Result<Arc<Region>, RegionError> {
        let len = usize::try_from(spec.length)
            .map_err(|_| RegionError::Invalid(format!("length {} does not fit this machine", spec.length)))?;
        let mut created_object = restored.is_some_and(|e| e.created_object);
        let (memory, path) = match spec.kind {
            RegionKind::Anonymous => {
                let mem = RegionMemory::anonymous(len, spec.hugepages)
                    .map_err(io_err(format!("allocating {} bytes", spec.length)))?;
                (mem, None)
            }
            RegionKind::File => {
                let path = spec
                    .path
                    .clone()
                    .filter(|p| !p.is_empty())
                    .ok_or_else(|| RegionError::Invalid("file regions need a path".into()))?;
                let file = open_region_file(Path::new(&path), spec.access)?;
                let actual = file.metadata().map_err(io_err(format!("stat {path}")))?.len();
                if actual < spec.length {
                    return Err(RegionError::FileTooShort { path, actual, needed: spec.length });
                }
                let writable = spec.access != Access::Read;
                let mem = RegionMemory::map_file(&file, len, writable).map_err(io_err(format!("mapping {path}")))?;
                (mem, Some(path))
            }
            RegionKind::Shm => {
                let object = spec.path.clone().filter(|p| !p.is_empty()).unwrap_or_else(|| format!("xfer-{}", spec.name));
                if object.contains('/') || object.starts_with('.') || object.is_empty() {
                    return Err(RegionError::Invalid(format!("invalid shm object name {object:?}")));
                }
                let full = self.shm_dir.join(&object);
                let existed = full.exists();
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&full)
                    .map_err(io_err(format!("opening {}", full.display())))?;
                if !existed {
                    created_object = true;
                }
                let actual = file.metadata().map_err(io_err(format!("stat {}", full.display())))?.len();
                if actual < spec.length {
                    file.set_len(spec.length).map_err(io_err(format!("sizing {}", full.display())))?;
                }
                let mem = RegionMemory::map_file(&file, len, true).map_err(io_err(format!("mapping {}", full.display())))?;
                (mem, Some(object))
            }
        };
        let memory = Arc::new(memory);
        // The fabric records xfer_registration_duration_seconds (verbs: around ibv_reg_mr).
        let registration = self.fabric.register(memory.clone(), spec.access)?;
        let now = SystemTime::now();
        Ok(Arc::new(Region {
            id: restored.map(|e| e.id.clone()).unwrap_or_else(new_id),
            name: spec.name.clone(),
            length: spec.length,
            kind: spec.kind,
            path,
            access: spec.access,
            hugepages: spec.hugepages,
            labels: spec.labels.clone(),
            created_at: restored.map(|e| e.created_at).unwrap_or(now),
            expires_at: restored.and_then(|e| e.expires_at).or_else(|| spec.ttl.map(|t| now + t)),
            memory,
            registration,
            in_use: AtomicU32::new(0),
            created_object,
        }))
    }

    /// Looks a region up by name or id.
    pub fn get(&self, name_or_id: &str) -> Result<Arc<Region>, RegionError> {
        let map = self.lock();
        if let Some(r) = map.get(name_or_id) {
            return Ok(r.clone());
        }
        map.values()
            .find(|r| r.id == name_or_id)
            .cloned()
            .ok_or_else(|| RegionError::NotFound(name_or_id.to_string()))
    }

    pub fn list(&self, selector: &BTreeMap<String, String>) -> Vec<Arc<Region>> {
        let mut v: Vec<_> = self
            .lock()
            .values()
            .filter(|r| selector.iter().all(|(k, val)| r.labels.get(k) == Some(val)))
            .cloned()
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub fn delete(&self, name: &str) -> Result<Arc<Region>, RegionError> {
        let region = {
            let mut map = self.lock();
            let r = map.get(name).cloned().ok_or_else(|| RegionError::NotFound(name.to_string()))?;
            if r.in_use.load(Ordering::Acquire) > 0 {
                return Err(RegionError::Busy(name.to_string()));
            }
            map.remove(name);
            r
        };
        self.finish_removal(&region)?;
        info!(region = %region.name, "region deleted");
        Ok(region)
    }

    fn finish_removal(&self, region: &Region) -> Result<(), RegionError> {
        if region.kind != RegionKind::Anonymous {
            let _ = region.memory.flush();
            self.persist()?;
        }
        if region.kind == RegionKind::Shm && region.created_object {
            if let Some(obj) = &region.path {
                let _ = std::fs::remove_file(self.shm_dir.join(obj));
            }
        }
        self.update_gauges();
        Ok(())
    }

    /// Removes regions whose lease ended and are not in use; returns them.
    pub fn reap_expired(&self, now: SystemTime) -> Vec<Arc<Region>> {
        let expired: Vec<Arc<Region>> = {
            let mut map = self.lock();
            let names: Vec<String> = map
                .values()
                .filter(|r| r.expires_at.is_some_and(|t| t <= now) && r.in_use.load(Ordering::Acquire) == 0)
                .map(|r| r.name.clone())
                .collect();
            names.iter().filter_map(|n| map.remove(n)).collect()
        };
        for r in &expired {
            info!(region = %r.name, "region lease expired; deregistered");
            if let Err(e) = self.finish_removal(r) {
                warn!(region = %r.name, error = %e, "catalog update after lease expiry failed");
            }
        }
        expired
    }

    /// Flushes file-backed mappings (on shutdown).
    pub fn flush_all(&self) {
        for r in self.lock().values() {
            if r.kind != RegionKind::Anonymous {
                let _ = r.memory.flush();
            }
        }
    }

    pub fn totals(&self) -> (usize, u64) {
        let map = self.lock();
        (map.len(), map.values().map(|r| r.length).sum())
    }

    fn update_gauges(&self) {
        let (n, bytes) = self.totals();
        m::regions(n, bytes);
    }

    fn persist(&self) -> Result<(), RegionError> {
        let entries: Vec<CatalogEntry> = {
            let map = self.lock();
            let mut v: Vec<CatalogEntry> = map
                .values()
                .filter(|r| r.kind != RegionKind::Anonymous)
                .map(|r| CatalogEntry {
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
                })
                .collect();
            v.sort_by(|a, b| a.name.cmp(&b.name));
            v
        };
        let path = self.catalog_path();
        let tmp = self.state_dir.join("regions.json.tmp");
        let text = serde_json::to_vec_pretty(&entries).map_err(|e| RegionError::Invalid(e.to_string()))?;
        std::fs::write(&tmp, text).map_err(io_err(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, &path).map_err(io_err(format!("renaming to {}", path.display())))?;
        Ok(())
    }
}

fn open_region_file(path: &Path, access: Access) -> Result<File, RegionError> {
    if !path.exists() {
        return Err(RegionError::PathMissing { path: path.display().to_string() });
    }
    let writable = access != Access::Read;
    OpenOptions::new()
        .read(true)
        .write(writable)
        .open(path)
        .map_err(io_err(format!("opening {}", path.display())))
}

/// A random 64-bit id, hex encoded.
pub fn new_id() -> String {
    format!("{:016x}", rand::random::<u64>())
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
}
