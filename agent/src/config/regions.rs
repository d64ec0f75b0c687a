//! The `regions` section: where file regions may live and who may see shared memory (host
//! safety), with its checks.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};
use xfer_common::HumanDuration;

use super::error::{bad, ConfigError};
use super::perms::{group_gid, FileMode};

/// A list of paths, or one string of comma-separated paths (how the environment carries a list).
fn paths_or_csv<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<PathBuf>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        List(Vec<PathBuf>),
        Csv(String),
    }
    Ok(match Raw::deserialize(d)? {
        Raw::List(v) => v,
        Raw::Csv(s) => s.split(',').map(str::trim).filter(|p| !p.is_empty()).map(PathBuf::from).collect(),
    })
}

/// Where regions may live and who may see shared memory (host safety).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct RegionsConfig {
    /// Directories file regions must live under (absolute). A relative `path` is relative to the
    /// first; an absolute one must be inside one of them. Empty = `<state_dir>/files`, created at
    /// start. Env: comma-separated.
    #[serde(deserialize_with = "paths_or_csv")]
    pub file_roots: Vec<PathBuf>,
    /// Permission bits of shm objects the agent creates (set with fchmod, whatever the umask).
    pub shm_mode: FileMode,
    /// Group (name or numeric gid) that created shm objects are given, for applications that must
    /// fill them (use with `shm_mode = "0660"`); unset = the agent's group.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shm_group: Option<String>,
    /// Owner (name or numeric uid) an existing shm object must have to be adopted
    /// (`adopt_existing`); unset = the agent's own uid.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shm_owner: Option<String>,
    /// How often regions that could not be restored from the catalog are retried.
    pub retry_interval: HumanDuration,
    /// Accept file regions whose file has other hard links (`st_nlink > 1`). Off: a hard link
    /// beneath a root to a file outside it is the same inode, and the link count is the only
    /// thing that tells, so such files are refused (PERMISSION_DENIED).
    pub allow_hard_links: bool,
}

impl Default for RegionsConfig {
    fn default() -> Self {
        RegionsConfig {
            file_roots: Vec::new(),
            shm_mode: FileMode(0o600),
            shm_group: None,
            shm_owner: None,
            retry_interval: HumanDuration(Duration::from_secs(10)),
            allow_hard_links: false,
        }
    }
}

impl RegionsConfig {
    /// `file_roots`, or `<state_dir>/files` when none are configured.
    pub fn effective_file_roots(&self, state_dir: &std::path::Path) -> Vec<PathBuf> {
        if self.file_roots.is_empty() {
            vec![state_dir.join("files")]
        } else {
            self.file_roots.clone()
        }
    }

    /// `shm_group` as a gid (a number, or a group name looked up in the group database).
    pub fn shm_gid(&self) -> Result<Option<u32>, ConfigError> {
        group_gid("regions.shm_group", self.shm_group.as_deref())
    }

    /// `shm_owner` as a uid (a number or a user name); unset = the agent's effective uid.
    pub fn shm_owner_uid(&self) -> Result<u32, ConfigError> {
        match self.shm_owner.as_deref().map(str::trim).filter(|u| !u.is_empty()) {
            None => Ok(nix::unistd::geteuid().as_raw()),
            Some(u) => match u.parse::<u32>() {
                Ok(n) => Ok(n),
                Err(_) => match nix::unistd::User::from_name(u) {
                    Ok(Some(user)) => Ok(user.uid.as_raw()),
                    Ok(None) => Err(bad("regions.shm_owner", format!("no user named {u:?}"))),
                    Err(e) => Err(bad("regions.shm_owner", format!("looking up user {u:?}: {e}"))),
                },
            },
        }
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        for (i, r) in self.file_roots.iter().enumerate() {
            if !r.is_absolute() {
                return Err(bad(&format!("regions.file_roots[{i}]"), format!("{} is not an absolute path", r.display())));
            }
        }
        if self.shm_mode.0 & !0o777 != 0 {
            return Err(bad("regions.shm_mode", format!("{:o} has bits beyond 0777 (setuid, setgid, sticky)", self.shm_mode.0)));
        }
        if self.retry_interval.0.is_zero() {
            return Err(bad("regions.retry_interval", "must be greater than zero"));
        }
        self.shm_gid()?;
        self.shm_owner_uid()?;
        Ok(())
    }
}
