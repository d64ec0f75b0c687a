//! A region as the catalog stores it ([`CatalogEntry`]), a catalog region that could not be
//! restored ([`UnavailableRegion`]), and what lookups show ([`RegionView`]: either of the two).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::region::{Region, RegionKind, RegionSpec};
use xfer_fabric::Access;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct CatalogEntry {
    pub(super) id: String,
    pub(super) name: String,
    pub(super) length: u64,
    pub(super) kind: RegionKind,
    pub(super) path: Option<String>,
    pub(super) access: Access,
    #[serde(default)]
    pub(super) labels: BTreeMap<String, String>,
    pub(super) created_at: SystemTime,
    pub(super) expires_at: Option<SystemTime>,
    #[serde(default)]
    pub(super) created_object: bool,
    /// The tenant the region is charged to (`crate::tenants`; none: exempt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) owner: Option<String>,
}

impl CatalogEntry {
    pub(super) fn of(r: &Region) -> CatalogEntry {
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

    pub(super) fn spec(&self) -> RegionSpec {
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
            create_file: false,
            shares: None,
        }
    }
}

/// A catalog region that could not be restored: what the catalog says, and why. It keeps its
/// name, counts toward `max_regions` (not toward registered bytes) and is retried.
#[derive(Debug, Clone)]
pub struct UnavailableRegion {
    pub(super) entry: CatalogEntry,
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
