//! How many regions the registry may hold ([`RegionLimits`]) and where they may live
//! ([`RegionPolicy`], the `regions.*` configuration).

use std::path::PathBuf;

#[derive(Debug, Clone, Copy)]
pub struct RegionLimits {
    pub max_regions: usize,
    pub max_registered_bytes: u64,
    /// Benchmarks' own budget ([`RegionRegistry::reserve_bench`](crate::regions::RegionRegistry::reserve_bench)).
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

    pub(super) fn roots_text(&self) -> String {
        let v: Vec<String> = self.file_roots.iter().map(|r| r.display().to_string()).collect();
        v.join(", ")
    }
}
