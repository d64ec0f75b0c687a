//! Region registry: allocate or map memory, register it with the fabric, leases, and the catalog.
//!
//! Kinds: `anonymous` (agent-allocated, zeroed), `file` (a shared mapping of an existing file whose
//! data persists) and `shm` (a POSIX shared-memory object under /dev/shm that local applications
//! map too). Anonymous regions die with the agent by design.
//!
//! # Host safety
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
//!
//! # Files
//!
//! [`RegionRegistry`] and its lookups are in `registry.rs`; `create.rs` creates regions,
//! `files.rs` and `shm.rs` open what file and shm regions map, `removal.rs` ends them and
//! `catalog.rs` persists them. `region.rs`, `entry.rs`, `policy.rs`, `names.rs`, `range.rs` and
//! `error.rs` hold the types these share.

mod catalog;
mod create;
mod entry;
mod error;
mod files;
mod names;
mod policy;
mod range;
mod region;
mod registry;
mod removal;
mod shm;

pub use create::fill_bench;
pub use entry::{RegionView, UnavailableRegion};
pub use error::RegionError;
pub use names::{validate_name, MAX_NAME_LEN, PRIVATE_SHM_PREFIX};
pub use policy::{RegionLimits, RegionPolicy};
pub use range::check_range;
pub use region::{Region, RegionKind, RegionSpec, RegionUse, Reservation};
pub use registry::{Charge, RegionRegistry};

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::os::unix::fs::MetadataExt;
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    use super::catalog::CATALOG;
    use super::*;
    use xfer_fabric::Access;

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
            create_file: false,
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
