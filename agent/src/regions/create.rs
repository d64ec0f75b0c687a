//! Creating a region: the name and the bytes are reserved under the lock, then the memory is
//! allocated or mapped and registered with no lock held; budgets outside regions
//! ([`Reservation`]s for rings and benchmarks).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use tracing::info;
use xfer_rdma::memory::RegionMemory;

use super::entry::CatalogEntry;
use super::error::{io_err, RegionError};
use super::names::{validate_name, validate_object_name, PRIVATE_SHM_PREFIX};
use super::region::{Region, RegionKind, RegionSpec, Reservation};
use super::registry::RegionRegistry;
use xfer_engine::ids::new_id;
use xfer_fabric::Access;

/// A mapped file or shm object, before registration.
struct Opened {
    pub(super) memory: RegionMemory,
    pub(super) path: Option<String>,
    /// An shm object the agent created (now or before a restart): removed on delete.
    pub(super) created_object: bool,
    /// An shm object this call created: removed again if registration fails.
    pub(super) created_now: bool,
}

impl RegionRegistry {
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
        let region = self.create_as(spec, Some(budget))?;
        fill_bench(&region.memory);
        Ok(region)
    }

    pub(super) fn create_as(&self, mut spec: RegionSpec, scratch: Option<Reservation>) -> Result<Arc<Region>, RegionError> {
        validate_name(&spec.name)?;
        crate::labels::check(&spec.labels).map_err(|e| RegionError::Invalid(e.to_string()))?;
        let file_path = spec.path.clone().filter(|p| !p.is_empty() && spec.kind == RegionKind::File);
        self.resolve_length(&mut spec)?;
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
        // The file is created only once the name and the bytes are reserved, so a refused
        // create leaves nothing behind; it is removed again if the region is not made after all.
        let created = match file_path.filter(|_| spec.create_file) {
            Some(path) => self.create_region_file(&path, spec.length).map(Some),
            None => Ok(None),
        };
        let (created, built) = match created {
            Err(e) => (None, Err(e)),
            Ok(c) => (c, self.build(&spec, None)),
        };
        let built = built.and_then(|mut region| {
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
            let region = match built {
                Ok(r) => r,
                Err(e) => {
                    if let Some(c) = created {
                        c.remove();
                    }
                    return Err(e);
                }
            };
            st.live.insert(region.name.clone(), region.clone());
            region
        };
        if region.kind != RegionKind::Anonymous {
            if let Err(e) = self.persist() {
                // Not in the catalog: undo, so the caller's error is the whole truth.
                self.lock().live.remove(&region.name);
                self.remove_created_object(&region);
                drop(region);
                if let Some(c) = created {
                    c.remove();
                }
                self.update_gauges();
                return Err(e);
            }
        }
        self.update_gauges();
        info!(region = %region.name, id = %region.id, kind = ?region.kind, length = region.length, "region created");
        Ok(region)
    }

    /// Checks `create_file` and gives a file region without a length its existing file's size,
    /// so that what is charged (shares, `max_registered_bytes`) is what will be mapped.
    pub fn resolve_length(&self, spec: &mut RegionSpec) -> Result<(), RegionError> {
        let file_path = spec.path.clone().filter(|p| !p.is_empty() && spec.kind == RegionKind::File);
        if spec.create_file && (file_path.is_none() || spec.length == 0) {
            return Err(RegionError::Invalid(
                "create_file applies to file regions with a path and a length (--kind file --path P --size SIZE)".into(),
            ));
        }
        if let (Some(path), 0, false) = (&file_path, spec.length, spec.create_file) {
            // The existing file says how long the region is.
            spec.length = self.region_file_size(path, spec.access)?;
        }
        Ok(())
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
    pub(super) fn build(&self, spec: &RegionSpec, restored: Option<&CatalogEntry>) -> Result<Arc<Region>, RegionError> {
        let len =
            usize::try_from(spec.length).map_err(|_| RegionError::Invalid(format!("length {} does not fit this machine", spec.length)))?;
        let opened = match spec.kind {
            RegionKind::Anonymous => {
                let memory = RegionMemory::anonymous(len, spec.hugepages).map_err(|e| allocation_error(e, spec))?;
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
        // Registration faulted the pages in, so they sit where they will stay. Only a fabric
        // with devices places transfers by NUMA node; tcp reads nothing.
        let numa = if self.fabric.polled() { xfer_fabric::topology::numa_maps::region_node(memory.addr(), spec.length) } else { None };
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
            numa,
            in_use: AtomicU32::new(0),
            retiring: AtomicBool::new(false),
            created_object: opened.created_object,
            _shares: spec.shares.clone(),
            scratch: None,
        }))
    }
}

/// An anonymous allocation's failure. With huge pages, ENOMEM almost always means the host has
/// none reserved (or too few free), and EINVAL a length that is not a multiple of their size or
/// a kernel without them: each is the caller's (or the host's) to fix, so the error says how
/// rather than reading as an internal one.
fn allocation_error(e: std::io::Error, spec: &RegionSpec) -> RegionError {
    let len = spec.length;
    match (spec.hugepages, e.raw_os_error()) {
        (true, Some(nix::libc::ENOMEM)) => RegionError::Unsupported(format!(
            "no huge pages for {len} bytes: the host has too few free (HugePages_Free in /proc/meminfo); \
             reserve them (sysctl vm.nr_hugepages=N, 2 MiB each on most hosts) or leave out --hugepages"
        )),
        (true, Some(nix::libc::EINVAL)) => RegionError::Unsupported(format!(
            "huge pages refused for {len} bytes: the length must be a multiple of the huge page size \
             (Hugepagesize in /proc/meminfo, 2 MiB on most hosts) and the kernel must have huge pages \
             (HugePages_Total in /proc/meminfo); round --size up, reserve huge pages, or leave out --hugepages"
        )),
        _ => io_err(format!("allocating {len} bytes"))(e),
    }
}

/// Fills a benchmark's memory with the byte the raw TCP baselines send (0xa5) before any clock
/// starts ([`RegionMemory::fill`]); a verbs registration pins, and so allocates, every page
/// anyway.
pub fn fill_bench(memory: &RegionMemory) {
    // Anonymous memory is writable and cannot be poisoned: fill cannot fail here.
    let _ = memory.fill(0xa5);
}
