//! shm regions and the agent's own shm objects: created private (`O_CREAT | O_EXCL |
//! O_NOFOLLOW`, `regions.shm_mode`), adopted only when they are regular files of the right owner
//! and long enough (never resized), removed only when the agent created them.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use tracing::warn;

use super::error::{io_err, RegionError};
use super::files::file_kind;
use super::names::{validate_object_name, PRIVATE_SHM_PREFIX};
use super::region::{Region, RegionKind};
use super::registry::RegionRegistry;

impl RegionRegistry {
    /// Opens or creates the shm object `object`: `adopt` allows using an existing one (regular,
    /// right owner, long enough: never resized), `create` allows creating a missing one (0600 or
    /// `shm_mode`, `O_EXCL`). Returns the file and whether this call created it.
    pub(super) fn open_shm(&self, object: &str, length: u64, adopt: bool, create: bool) -> Result<(File, bool), RegionError> {
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

    pub(super) fn check_adopted(&self, file: File, object: &str, length: u64) -> Result<File, RegionError> {
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

    pub(super) fn unlink_shm(&self, object: &str) {
        if let Err(e) = std::fs::remove_file(self.policy.shm_dir.join(object)) {
            warn!(object, error = %e, "could not remove shm object");
        }
    }

    pub(super) fn remove_created_object(&self, region: &Region) {
        if region.kind == RegionKind::Shm && region.created_object {
            if let Some(obj) = &region.path {
                self.unlink_shm(obj);
            }
        }
    }
}
