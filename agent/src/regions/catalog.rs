//! The catalog (`<state_dir>/regions.json`): file and shm regions written on every change, one
//! writer at a time and durably; restored at start, a corrupt one moved aside, entries that cannot
//! be restored kept as unavailable and retried.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::{error, info, warn};

use super::entry::{CatalogEntry, UnavailableRegion};
use super::error::{io_err, RegionError};
use super::names::validate_name;
use super::region::RegionKind;
use super::registry::RegionRegistry;
use crate::metrics as m;

/// The catalog's file name in the state directory.
pub(super) const CATALOG: &str = "regions.json";

impl RegionRegistry {
    pub(super) fn catalog_path(&self) -> PathBuf {
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
    pub(super) fn move_catalog_aside(&self, path: &Path, problem: &str, len: usize) -> Result<(), RegionError> {
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

    /// Writes the catalog; on failure marks it dirty (retried later) and says so loudly.
    pub(super) fn persist_or_mark_dirty(&self, what: &str, name: &str) {
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

    /// Writes the catalog: one writer at a time, unique temp file, fsync, rename, fsync dir.
    pub(super) fn persist(&self) -> Result<(), RegionError> {
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

/// Replaces `dir/name` with `bytes` so that after a crash or power loss it holds either the old
/// or the new content ([`crate::safe_file::write_atomically`]: a temp file of its own,
/// `regions.json.<pid>.<random>.tmp`, created `O_EXCL | O_NOFOLLOW` so concurrent writers never
/// share one and a planted link is never followed; fsync, rename, fsync of the directory).
fn write_durably(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), RegionError> {
    let target = dir.join(name);
    crate::safe_file::write_atomically(&target, bytes, 0o600).map_err(io_err(format!("writing {}", target.display())))
}

/// fsync of a directory, so a rename in it survives a crash.
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
