//! Files the agent writes, and files it maps for callers, without being turned against the host.
//!
//! The agent usually runs as root, and a directory it writes into (the ready file's, chosen by
//! whoever starts it) may be writable by others. A fixed temporary name such as `PATH.tmp` lets
//! anyone who can write that directory plant a symbolic link there and have the agent truncate
//! and overwrite whatever the link points to. [`write_atomically`] never opens a name that
//! already exists: its temporary file is created `O_CREAT | O_EXCL | O_NOFOLLOW` (and
//! `O_CLOEXEC`, as every std open) under a fresh random name, so a link, file or FIFO planted
//! there makes the open fail and another name is tried. The file is fsynced and renamed over the
//! target (a rename replaces a link at the target, it never writes through it), then the
//! directory is fsynced.
//!
//! [`check_hard_links`] is the other half of the same threat for file regions: a path resolved
//! beneath a file root without symbolic links can still name an inode that also lives outside
//! the root (a hard link is the same inode under another name), and only its link count tells.
use std::ffi::OsString;
use std::fs::{File, Metadata, OpenOptions};
use std::io::{Error, ErrorKind, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Names tried before giving up: a clash with 64 random bits happens only when someone plants
/// files to collide, and a bounded loop keeps that from spinning forever.
const NAME_ATTEMPTS: usize = 16;

/// Replaces `path` with `bytes` (permission bits `mode`, less the umask) so that a reader sees
/// the old file or the whole new one, never a part, and nothing at a temporary name is followed
/// or reused (module docs). The temporary file is `<name>.<pid>.<16 hex digits>.tmp` next to
/// `path`; it is removed again if writing or renaming fails.
pub fn write_atomically(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    write_with_nonces(path, bytes, mode, rand::random::<u64>)
}

/// [`write_atomically`] with the random part of the temporary names drawn from `nonce` (tests
/// make it predictable to plant links at the names it will try).
fn write_with_nonces(path: &Path, bytes: &[u8], mode: u32, mut nonce: impl FnMut() -> u64) -> std::io::Result<()> {
    let name = path.file_name().ok_or_else(|| Error::new(ErrorKind::InvalidInput, format!("{} does not name a file", path.display())))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let (tmp, mut file) = create_temp(dir, name.to_os_string(), mode, &mut nonce)?;
    let written = file.write_all(bytes).and_then(|()| file.sync_all()).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    File::open(dir).and_then(|d| d.sync_all())
}

/// A new file of our own next to the target, never one that was already there.
fn create_temp(dir: &Path, name: OsString, mode: u32, nonce: &mut impl FnMut() -> u64) -> std::io::Result<(PathBuf, File)> {
    for _ in 0..NAME_ATTEMPTS {
        let mut n = name.clone();
        n.push(format!(".{}.{:016x}.tmp", std::process::id(), nonce()));
        let tmp = dir.join(n);
        // create_new is O_CREAT | O_EXCL, which already refuses a symbolic link at the name;
        // O_NOFOLLOW says so in the flags themselves.
        match OpenOptions::new().write(true).create_new(true).mode(mode).custom_flags(nix::libc::O_NOFOLLOW).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(Error::new(
        ErrorKind::AlreadyExists,
        format!("{NAME_ATTEMPTS} temporary names next to {} were all taken (planted files?)", dir.join(&name).display()),
    ))
}

/// The refusal for a file region's file with other hard links (`st_nlink > 1`) unless the
/// operator allows them (`regions.allow_hard_links`): another name of the same inode may lie
/// outside every file root, and bytes granted through this one would be that file's.
pub fn check_hard_links(meta: &Metadata, allow: bool) -> Result<(), String> {
    let links = meta.nlink();
    if links > 1 && !allow {
        return Err(format!(
            "it has {links} hard links, and another name for the same file may lie outside the file roots; \
             set regions.allow_hard_links = true if every file under the roots may be linked"
        ));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// What a planted link must not change: the victim's bytes and modification time.
    fn victim_state(p: &Path) -> (Vec<u8>, i64, i64) {
        let m = std::fs::metadata(p).unwrap();
        (std::fs::read(p).unwrap(), m.mtime(), m.mtime_nsec())
    }

    #[test]
    fn links_planted_at_the_temporary_names_are_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"do not touch").unwrap();
        let before = victim_state(&victim);
        let target = dir.path().join("ready.json");
        // The first three names it will try are links to the victim (and one dangling link,
        // which O_CREAT alone would follow and create); the fourth is free.
        let pid = std::process::id();
        let planted: Vec<PathBuf> = (1..=3u64).map(|k| dir.path().join(format!("ready.json.{pid}.{k:016x}.tmp"))).collect();
        std::os::unix::fs::symlink(&victim, &planted[0]).unwrap();
        std::os::unix::fs::symlink(&victim, &planted[1]).unwrap();
        std::os::unix::fs::symlink(dir.path().join("created-through-a-link"), &planted[2]).unwrap();
        let mut k = 0u64;
        write_with_nonces(&target, b"{\"grpc\":1}", 0o644, || {
            k += 1;
            k
        })
        .unwrap();
        assert_eq!(k, 4, "three names were taken, the fourth was used");
        assert_eq!(std::fs::read(&target).unwrap(), b"{\"grpc\":1}");
        assert_eq!(victim_state(&victim), before);
        assert!(!dir.path().join("created-through-a-link").exists());
        for p in &planted {
            assert!(std::fs::symlink_metadata(p).unwrap().file_type().is_symlink(), "{} left as it was", p.display());
        }
        // Nothing else is left behind: the victim, the target and the three planted links.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 5);
    }

    #[test]
    fn a_link_at_the_target_is_replaced_not_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"do not touch").unwrap();
        let before = victim_state(&victim);
        let target = dir.path().join("ready.json");
        std::os::unix::fs::symlink(&victim, &target).unwrap();
        write_atomically(&target, b"new", 0o600).unwrap();
        let m = std::fs::symlink_metadata(&target).unwrap();
        assert!(m.file_type().is_file());
        assert_eq!(m.mode() & 0o077, 0, "mode 0600 asked for");
        assert_eq!(std::fs::read(&target).unwrap(), b"new");
        assert_eq!(victim_state(&victim), before);
    }

    #[test]
    fn when_every_name_is_taken_it_gives_up_and_leaves_the_target_alone() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("t");
        std::fs::write(&target, b"old").unwrap();
        std::fs::write(dir.path().join(format!("t.{}.{:016x}.tmp", std::process::id(), 7)), b"planted").unwrap();
        let e = write_with_nonces(&target, b"new", 0o644, || 7).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AlreadyExists);
        assert!(e.to_string().contains("temporary names"), "{e}");
        assert_eq!(std::fs::read(&target).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn a_failed_rename_removes_its_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        // A directory at the target: rename(2) of a file over it fails (EISDIR).
        std::fs::create_dir(dir.path().join("t")).unwrap();
        write_atomically(&dir.path().join("t"), b"x", 0o644).unwrap_err();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        assert!(write_atomically(Path::new("/"), b"x", 0o644).is_err());
    }

    #[test]
    fn hard_links_are_refused_unless_allowed() {
        let dir = tempfile::tempdir().unwrap();
        let one = dir.path().join("one");
        std::fs::write(&one, b"x").unwrap();
        check_hard_links(&std::fs::metadata(&one).unwrap(), false).unwrap();
        std::fs::hard_link(&one, dir.path().join("two")).unwrap();
        let e = check_hard_links(&std::fs::metadata(&one).unwrap(), false).unwrap_err();
        assert!(e.contains("2 hard links") && e.contains("regions.allow_hard_links"), "{e}");
        check_hard_links(&std::fs::metadata(&one).unwrap(), true).unwrap();
    }
}
