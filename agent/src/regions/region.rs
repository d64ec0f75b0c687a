//! A region: what a caller asks for ([`RegionSpec`]), the live region with its memory and
//! registration ([`Region`]), and the guards that keep it in use ([`RegionUse`]) or keep bytes
//! counted against a budget ([`Reservation`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use xfer_rdma::memory::RegionMemory;

use super::error::RegionError;
use super::range::check_range;
use xfer_fabric::{Access, Registration};

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
    /// file: create the file (`length` zero bytes; an existing file is refused). A file region
    /// with `length` 0 and no `create_file` takes the existing file's size.
    pub create_file: bool,
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
            create_file: false,
            shares: None,
        }
    }
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
    /// The NUMA node holding most of its pages once registered (`None`: unknown, or a fabric
    /// with no devices to place on); transfers prefer devices on it.
    pub numa: Option<u32>,
    /// Running transfers that use this region (delete is refused while non-zero).
    pub(super) in_use: AtomicU32,
    /// Set under the registry lock when the region starts to end (delete, lease, ...): from then
    /// on it takes no new use and no new grant, while its grants are revoked and before it stops
    /// being visible (`RegionRegistry::retire`).
    pub(super) retiring: AtomicBool,
    /// shm object created by the agent (unlinked on delete)
    pub(super) created_object: bool,
    /// The creator's share of the per-identity limits, given back when the region is dropped.
    pub(super) _shares: Option<Arc<crate::tenants::Permits>>,
    /// A benchmark's scratch region: its bytes are held in `limits.max_bench_bytes` (released
    /// when the last user drops it) and it counts toward neither `max_regions` nor
    /// `max_registered_bytes`.
    pub(super) scratch: Option<Reservation>,
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

/// Keeps a region marked as in use by a transfer.
pub struct RegionUse(pub Arc<Region>);

impl Drop for RegionUse {
    fn drop(&mut self) {
        self.0.in_use.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Memory counted against `max_registered_bytes` while it lives; released on drop.
#[derive(Debug)]
pub struct Reservation {
    pub(super) counter: Arc<AtomicU64>,
    pub(super) bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}
