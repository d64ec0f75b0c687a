//! How a live region ends (a delete, an expired lease, a benchmark's scratch region): retired
//! under the lock, cut off from its grants while still visible, then removed, so that once a
//! lookup answers NOT_FOUND no byte of it changes.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::SystemTime;

use tracing::info;

use super::error::RegionError;
use super::region::{Region, RegionKind};
use super::registry::RegionRegistry;

impl RegionRegistry {
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
    pub(super) fn retire(&self, region: &Arc<Region>, cut_off: impl FnOnce(&Arc<Region>)) {
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
    pub(super) fn finish_removal(&self, region: &Region) {
        if region.kind != RegionKind::Anonymous {
            let _ = region.memory.flush();
            self.persist_or_mark_dirty("deleting region", &region.name);
        }
        self.remove_created_object(region);
        self.update_gauges();
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
}
