//! File regions: a path is resolved beneath one of `regions.file_roots` with no symbolic link
//! and no `..` out of the root, opened without blocking, and must be a regular file. A file a
//! request asks to create is made `O_CREAT | O_EXCL` in its directory, itself opened beneath the
//! root the same way, so nothing that exists (a file, a planted link) is ever replaced.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;

use super::error::{io_err, RegionError};
use super::registry::RegionRegistry;
use xfer_fabric::Access;

impl RegionRegistry {
    /// Which root `path` belongs to and the part beneath it. A relative path is beneath the
    /// first root; an absolute one must start with a root (as configured or canonicalized).
    pub(super) fn locate(&self, path: &str) -> Result<(PathBuf, PathBuf), RegionError> {
        let p = Path::new(path);
        let first = self.policy.file_roots.first().ok_or_else(|| self.denied(path, "no file roots are configured"))?;
        if p.is_relative() {
            return Ok((first.clone(), p.to_path_buf()));
        }
        for root in &self.policy.file_roots {
            let canonical = std::fs::canonicalize(root).ok();
            for form in std::iter::once(root).chain(canonical.as_ref()) {
                if let Ok(rest) = p.strip_prefix(form) {
                    return Ok((root.clone(), rest.to_path_buf()));
                }
            }
        }
        Err(self.denied(path, "it is outside every file root"))
    }

    pub(super) fn denied(&self, path: &str, why: &str) -> RegionError {
        RegionError::Denied(format!(
            "file {path:?} refused: {why}; file regions must be regular files beneath regions.file_roots ({}) reached without symbolic links",
            self.policy.roots_text()
        ))
    }

    /// Opens a file region's file beneath its root: no symlink anywhere, no `..` out of the root,
    /// non-blocking (a FIFO or device never blocks), and it must be a regular file. Returns the
    /// file and its full path (root + the part beneath it).
    pub(super) fn open_region_file(&self, path: &str, access: Access) -> Result<(File, String), RegionError> {
        if path.contains('\0') {
            return Err(RegionError::Invalid(format!("file path {path:?} contains a NUL byte")));
        }
        let (root, rest) = self.locate(path)?;
        let full = root.join(&rest).display().to_string();
        if rest.as_os_str().is_empty() {
            return Err(RegionError::NotRegular { path: full, kind: "directory" });
        }
        let dir = nix::fcntl::open(&root, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|e| io_err(format!("opening file root {}", root.display()))(e.into()))?;
        let mode = if access == Access::Read { OFlag::O_RDONLY } else { OFlag::O_RDWR };
        let flags = mode | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW;
        let fd = open_beneath(dir.as_fd(), &rest, flags).map_err(|e| match e {
            Errno::ENOENT => RegionError::PathMissing { path: full.clone() },
            Errno::ELOOP => self.denied(path, "a component is a symbolic link"),
            Errno::EXDEV => self.denied(path, "it resolves outside its file root"),
            Errno::EACCES | Errno::EPERM => self.denied(path, "the agent may not open it"),
            Errno::EISDIR => RegionError::NotRegular { path: full.clone(), kind: "directory" },
            Errno::ENXIO => RegionError::NotRegular { path: full.clone(), kind: "special file" },
            Errno::ENOTDIR => RegionError::Invalid(format!("file {full:?}: a component of the path is not a directory")),
            Errno::ENAMETOOLONG => RegionError::Invalid(format!("file {full:?}: the path or a component of it is too long")),
            other => io_err(format!("opening {full}"))(other.into()),
        })?;
        let file = File::from(fd);
        let meta = file.metadata().map_err(io_err(format!("stat {full}")))?;
        if !meta.file_type().is_file() {
            return Err(RegionError::NotRegular { path: full, kind: file_kind(&meta.file_type()) });
        }
        crate::safe_file::check_hard_links(&meta, self.policy.allow_hard_links)
            .map_err(|why| RegionError::Denied(format!("file {full:?} refused: {why}")))?;
        Ok((file, full))
    }
}

/// A file a `create_file` request made: [`CreatedFile::remove`] takes it away again when the
/// region is not created after all.
pub(super) struct CreatedFile {
    parent: OwnedFd,
    name: OsString,
    dev: nix::libc::dev_t,
    ino: nix::libc::ino_t,
}

impl CreatedFile {
    /// Unlinks the file, only if its name still holds the inode this call created.
    pub(super) fn remove(self) {
        let st = nix::sys::stat::fstatat(self.parent.as_fd(), self.name.as_os_str(), nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW);
        if st.is_ok_and(|st| st.st_dev == self.dev && st.st_ino == self.ino) {
            let _ = nix::unistd::unlinkat(self.parent.as_fd(), self.name.as_os_str(), nix::unistd::UnlinkatFlags::NoRemoveDir);
        }
    }
}

impl RegionRegistry {
    /// The size of the existing file at `path` (opened as [`RegionRegistry::open_region_file`]
    /// does), for a file region created without a length.
    pub(super) fn region_file_size(&self, path: &str, access: Access) -> Result<u64, RegionError> {
        let (file, full) = self.open_region_file(path, access)?;
        let len = file.metadata().map_err(io_err(format!("stat {full}")))?.len();
        if len == 0 {
            return Err(RegionError::Invalid(format!(
                "file {full:?} is empty: a region needs a length (give --size; --create with --size makes a new file)"
            )));
        }
        Ok(len)
    }

    /// Creates the file `path` beneath its root with `length` zero bytes (mode 0600, less the
    /// umask). Its directory must exist and be reached without symbolic links; anything already
    /// at the name (a file, a link, a FIFO) is [`RegionError::FileExists`] and left alone.
    pub(super) fn create_region_file(&self, path: &str, length: u64) -> Result<CreatedFile, RegionError> {
        if path.contains('\0') {
            return Err(RegionError::Invalid(format!("file path {path:?} contains a NUL byte")));
        }
        let (root, rest) = self.locate(path)?;
        let full = root.join(&rest).display().to_string();
        let mut parts: Vec<&OsStr> = Vec::new();
        for c in rest.components() {
            match c {
                Component::Normal(p) => parts.push(p),
                Component::CurDir => {}
                // `..` is refused outright when creating: the file lands where the path says.
                Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                    return Err(self.denied(path, "a path to create may not contain `..`"))
                }
            }
        }
        let Some((name, dirs)) = parts.split_last() else {
            return Err(RegionError::NotRegular { path: full, kind: "directory" });
        };
        let rootfd = nix::fcntl::open(&root, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|e| io_err(format!("opening file root {}", root.display()))(e.into()))?;
        let parent = if dirs.is_empty() {
            rootfd
        } else {
            let dir: PathBuf = dirs.iter().collect();
            let opened = open_beneath(rootfd.as_fd(), &dir, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW);
            // A link as the directory's last component fails O_DIRECTORY | O_NOFOLLOW as ENOTDIR.
            let opened = opened.map_err(|e| if e == Errno::ENOTDIR { symlink_or(rootfd.as_fd(), dir.as_os_str(), e) } else { e });
            opened.map_err(|e| match e {
                Errno::ENOENT => RegionError::Invalid(format!("file {full:?}: its directory does not exist (create it first)")),
                Errno::ELOOP => self.denied(path, "a component is a symbolic link"),
                Errno::EXDEV => self.denied(path, "it resolves outside its file root"),
                Errno::ENOTDIR => RegionError::Invalid(format!("file {full:?}: a component of the path is not a directory")),
                Errno::EACCES | Errno::EPERM => self.denied(path, "the agent may not open its directory"),
                other => io_err(format!("opening the directory of {full}"))(other.into()),
            })?
        };
        let flags =
            OFlag::O_RDWR | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC;
        let fd = nix::fcntl::openat(parent.as_fd(), *name, flags, Mode::from_bits_truncate(0o600)).map_err(|e| match e {
            Errno::EEXIST => RegionError::FileExists { path: full.clone() },
            Errno::EACCES | Errno::EPERM => self.denied(path, "the agent may not create it"),
            Errno::ENAMETOOLONG => RegionError::Invalid(format!("file {full:?}: the name is too long")),
            other => io_err(format!("creating {full}"))(other.into()),
        })?;
        let st = nix::sys::stat::fstat(fd.as_fd()).map_err(|e| io_err(format!("stat {full}"))(e.into()))?;
        let file = File::from(fd);
        let created = CreatedFile { parent, name: name.to_os_string(), dev: st.st_dev, ino: st.st_ino };
        if let Err(e) = file.set_len(length) {
            created.remove();
            return Err(io_err(format!("sizing {full} to {length} bytes"))(e));
        }
        Ok(created)
    }
}

/// What a file that is not a regular file is, for the error.
pub(super) fn file_kind(t: &std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "directory"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_socket() {
        "socket"
    } else if t.is_symlink() {
        "symbolic link"
    } else {
        "special file"
    }
}

/// Opens `rest` beneath the directory `dir` with `flags`: no component may be a symbolic link
/// and none may leave `dir`. `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` when the kernel has
/// it (5.6+), else [`walk_beneath`].
fn open_beneath(dir: BorrowedFd<'_>, rest: &Path, flags: OFlag) -> Result<OwnedFd, Errno> {
    let how = OpenHow::new()
        .flags(flags)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let mut tries = 0;
    loop {
        match nix::fcntl::openat2(dir, rest, how) {
            Err(Errno::ENOSYS) => return walk_beneath(dir, rest, flags),
            // The kernel saw a concurrent rename while resolving `..`: retry a few times.
            Err(Errno::EAGAIN) if tries < 3 => tries += 1,
            other => return other,
        }
    }
}

/// The openat2 fallback: one `openat` per component, directories with `O_NOFOLLOW |
/// O_DIRECTORY`, the last with `flags | O_NOFOLLOW`. Stricter than openat2: any `..` is refused
/// (EXDEV), even one that would stay beneath `dir`.
fn walk_beneath(dir: BorrowedFd<'_>, rest: &Path, flags: OFlag) -> Result<OwnedFd, Errno> {
    let mut parts: Vec<&OsStr> = Vec::new();
    for c in rest.components() {
        match c {
            Component::Normal(p) => parts.push(p),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => return Err(Errno::EXDEV),
        }
    }
    let Some((last, dirs)) = parts.split_last() else { return Err(Errno::EISDIR) };
    let mut current: Option<OwnedFd> = None;
    for part in dirs {
        let at = current.as_ref().map_or(dir, |f| f.as_fd());
        let next =
            nix::fcntl::openat(at, *part, OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty())
                .map_err(|e| symlink_or(at, part, e))?;
        current = Some(next);
    }
    let at = current.as_ref().map_or(dir, |f| f.as_fd());
    nix::fcntl::openat(at, *last, flags | OFlag::O_NOFOLLOW, Mode::empty())
}

/// `O_NOFOLLOW | O_DIRECTORY` on a symlink may say ENOTDIR rather than ELOOP: report ELOOP.
fn symlink_or(at: BorrowedFd<'_>, part: &OsStr, e: Errno) -> Errno {
    if e == Errno::ENOTDIR {
        if let Ok(st) = nix::sys::stat::fstatat(at, part, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
            if nix::sys::stat::SFlag::from_bits_truncate(st.st_mode) & nix::sys::stat::SFlag::S_IFMT == nix::sys::stat::SFlag::S_IFLNK {
                return Errno::ELOOP;
            }
        }
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    /// openat2 and the fallback walk refuse the same escapes and open the same files.
    #[test]
    fn open_beneath_and_the_fallback_walk_refuse_escapes() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let outside = tmp.path().join("outside");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("secret"), b"secret").unwrap();
        std::fs::write(root.join("sub/ok.bin"), b"ok").unwrap();
        std::os::unix::fs::symlink(outside.join("secret"), root.join("link")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("dirlink")).unwrap();
        std::os::unix::fs::symlink("ok.bin", root.join("sub/inner-link")).unwrap();
        let dir = nix::fcntl::open(&root, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, Mode::empty()).unwrap();
        let flags = OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW;
        type Opener = fn(BorrowedFd<'_>, &Path, OFlag) -> Result<OwnedFd, Errno>;
        for (which, open) in [("openat2", open_beneath as Opener), ("walk", walk_beneath as Opener)] {
            let fd = open(dir.as_fd(), Path::new("sub/ok.bin"), flags).unwrap_or_else(|e| panic!("{which}: {e}"));
            assert_eq!(std::io::read_to_string(File::from(fd)).unwrap(), "ok", "{which}");
            for (path, want) in [
                ("link", [Errno::ELOOP].as_slice()),
                ("dirlink/secret", &[Errno::ELOOP]),
                ("sub/inner-link", &[Errno::ELOOP]),
                ("../outside/secret", &[Errno::EXDEV]),
                ("sub/../../outside/secret", &[Errno::EXDEV]),
                ("missing", &[Errno::ENOENT]),
            ] {
                let e = open(dir.as_fd(), Path::new(path), flags).map(drop).unwrap_err();
                assert!(want.contains(&e), "{which} {path}: {e}");
            }
        }
    }
}
