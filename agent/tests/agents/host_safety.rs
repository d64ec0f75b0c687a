//! Host safety (DESIGN §8, the host-safety issue): file regions only beneath `regions.file_roots`
//! (no symlink, `..` or absolute escape; regular files only; a FIFO never blocks), private shm
//! objects that are never taken over or resized, and a catalog that survives concurrency,
//! corruption and missing files. Real agents on loopback. Every refusal also asserts that
//! nothing else changed: the other regions' bytes, the region list and the catalog file.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::time::Duration;

use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

fn shm_req(name: &str, len: u64, object: &str, adopt: bool) -> pb::CreateRegionRequest {
    pb::CreateRegionRequest {
        name: name.into(),
        length: len,
        kind: pb::RegionKind::Shm as i32,
        path: object.into(),
        adopt_existing: adopt,
        ..Default::default()
    }
}

/// What must not change when a request is refused: the region list (name, path, reason) and
/// the catalog's bytes.
#[derive(Debug, PartialEq)]
struct Snapshot {
    regions: Vec<(String, String, String)>,
    catalog: Option<Vec<u8>>,
}

async fn snapshot(a: &Agent) -> Snapshot {
    let list = a.client().await.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner();
    Snapshot {
        regions: list.regions.into_iter().map(|r| (r.name, r.path, r.unavailable_reason)).collect(),
        catalog: std::fs::read(a.state_dir.join("regions.json")).ok(),
    }
}

/// A unique shm object name for this test process.
fn shm_name(what: &str) -> String {
    format!("xfer-ht-{}-{what}", std::process::id())
}

struct ShmCleanup(Vec<PathBuf>);
impl Drop for ShmCleanup {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn refused(e: &tonic::Status, code: Code, needle: &str, what: &str) {
    assert_eq!(e.code(), code, "{what}: {e:?}");
    assert!(e.message().contains(needle), "{what}: message should name {needle:?}: {e:?}");
}

// ------------------------------------------------------------------ file roots

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_regions_cannot_escape_their_roots() {
    let a = Agent::start("node-a");
    let root = root_of(&a);
    assert!(root.is_dir(), "the default root <state_dir>/files is created at start");
    let root_text = root.display().to_string();
    let mut c = a.client().await;

    // Legitimate regions whose bytes must survive every refusal below.
    let good = random_bytes(4096, 1);
    std::fs::write(root.join("good.bin"), &good).unwrap();
    c.create_region(file_region_req("good", 4096, "good.bin", pb::Access::ReadWrite)).await.unwrap();
    a.create("anon", 4096, pb::Access::ReadWrite).await;
    let anon = random_bytes(4096, 2);
    a.put("anon", 0, &anon).await;

    // The "secret" outside every root stands for /etc/shadow.
    let outside = tempfile::tempdir().unwrap();
    let secret_bytes = b"root:$6$secret-hash:19000:0:99999:7:::\n".repeat(128);
    let secret = outside.path().join("shadow");
    std::fs::write(&secret, &secret_bytes).unwrap();
    std::os::unix::fs::symlink(&secret, root.join("innocent.bin")).unwrap();
    std::os::unix::fs::symlink(outside.path(), root.join("linkdir")).unwrap();
    std::fs::create_dir(root.join("sub")).unwrap();
    std::fs::write(root.join("sub/inner.bin"), vec![7u8; 4096]).unwrap();
    std::os::unix::fs::symlink("../good.bin", root.join("sub/relative-link.bin")).unwrap();

    let before = snapshot(&a).await;
    let depth = root.components().count();
    let dotdots = "../".repeat(depth);
    let secret_s = secret.display().to_string();
    let cases: Vec<(&str, String, Code, &str)> = vec![
        ("symlink to a file outside", "innocent.bin".into(), Code::PermissionDenied, &root_text),
        ("symlink, absolute path", format!("{root_text}/innocent.bin"), Code::PermissionDenied, &root_text),
        ("symlinked directory component", "linkdir/shadow".into(), Code::PermissionDenied, &root_text),
        ("symlink that stays inside the root", "sub/relative-link.bin".into(), Code::PermissionDenied, &root_text),
        ("relative .. escape", format!("{dotdots}{}", secret_s.trim_start_matches('/')), Code::PermissionDenied, &root_text),
        (
            "absolute .. escape",
            format!("{root_text}/sub/../../../{}", secret_s.trim_start_matches('/')),
            Code::PermissionDenied,
            &root_text,
        ),
        ("absolute path outside the roots", secret_s.clone(), Code::PermissionDenied, &root_text),
        ("/etc/shadow", "/etc/shadow".into(), Code::PermissionDenied, &root_text),
        ("a device node outside the roots", "/dev/null".into(), Code::PermissionDenied, &root_text),
        ("a directory", "sub".into(), Code::InvalidArgument, "directory"),
        ("the root itself", root_text.clone(), Code::InvalidArgument, "directory"),
        ("a missing file", "missing.bin".into(), Code::InvalidArgument, "does not exist"),
    ];
    for (what, path, code, needle) in &cases {
        for access in [pb::Access::Read, pb::Access::ReadWrite] {
            let e = c.create_region(file_region_req("evil", 4096, path, access)).await.expect_err(what);
            refused(&e, *code, needle, what);
        }
    }
    // A device node inside a root: not a regular file.
    nix::sys::stat::mknod(
        &root.join("null"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(1, 3),
    )
    .unwrap();
    let e = c.create_region(file_region_req("evil", 4096, "null", pb::Access::ReadWrite)).await.unwrap_err();
    refused(&e, Code::InvalidArgument, "character device", "a device node inside the root");

    // The reproducer of the issue, through xferctl: nothing is created, nothing can be read.
    let o = a.ctl(&["region", "create", "s", "--size", "4KiB", "--kind", "file", "--path", "innocent.bin", "--access", "r"]);
    assert!(!o.status.success(), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("file_roots"), "{o:?}");
    let out = outside.path().join("got");
    let o = a.ctl(&["get", "s", "--len", "4096", out.to_str().unwrap()]);
    assert!(!o.status.success(), "{o:?}");
    assert!(std::fs::read(&out).unwrap_or_default().is_empty(), "not one byte of the secret");

    // Nothing else changed.
    assert_eq!(snapshot(&a).await, before);
    assert!(a.read("good", 0, 4096).await == good);
    assert!(a.read("anon", 0, 4096).await == anon);
    assert!(std::fs::read(&secret).unwrap() == secret_bytes, "the secret is untouched");
    assert!(std::fs::read(root.join("good.bin")).unwrap() == good);

    // A hard link inside the root to a file outside is the same inode: no path check can tell it
    // from a file that was always there, only its link count, so it is refused unless
    // regions.allow_hard_links (files_redteam.rs has the rest).
    let hard = root.join("hard.bin");
    std::fs::hard_link(&secret, &hard).unwrap();
    assert_eq!(std::fs::metadata(&hard).unwrap().ino(), std::fs::metadata(&secret).unwrap().ino());
    let e = c.create_region(file_region_req("hard", 4096, "hard.bin", pb::Access::Read)).await.unwrap_err();
    refused(&e, Code::PermissionDenied, "regions.allow_hard_links", "a hard link to a file outside the root");
    assert!(std::fs::read(&secret).unwrap() == secret_bytes, "the secret is untouched");
    assert_eq!(std::fs::metadata(&root).unwrap().permissions().mode() & 0o777, 0o700, "the default root is private");
    assert_eq!(snapshot(&a).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_roots_take_absolute_and_relative_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let (r1, r2) = (tmp.path().join("r1"), tmp.path().join("r2"));
    std::fs::create_dir_all(&r1).unwrap();
    std::fs::create_dir_all(&r2).unwrap();
    std::fs::write(r1.join("a.bin"), vec![1u8; 4096]).unwrap();
    std::fs::write(r2.join("b.bin"), vec![2u8; 4096]).unwrap();
    let roots = format!("{},{}", r1.display(), r2.display());
    let a = Agent::start_env("node-a", &[("XFER_REGIONS__FILE_ROOTS", &roots)]);
    let mut c = a.client().await;
    let r = c.create_region(file_region_req("a", 4096, "a.bin", pb::Access::Read)).await.unwrap().into_inner();
    assert_eq!(r.path, r1.join("a.bin").display().to_string(), "relative = beneath the first root");
    let b = r2.join("b.bin").display().to_string();
    let r = c.create_region(file_region_req("b", 4096, &b, pb::Access::Read)).await.unwrap().into_inner();
    assert_eq!(r.path, b);
    let before = snapshot(&a).await;
    // A relative path never reaches the second root, and the default root is not a root now.
    let e = c.create_region(file_region_req("x", 4096, "b.bin", pb::Access::Read)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    std::fs::create_dir_all(root_of(&a)).unwrap();
    std::fs::write(root_of(&a).join("c.bin"), vec![3u8; 4096]).unwrap();
    let e = c.create_region(file_region_req("x", 4096, root_of(&a).join("c.bin").to_str().unwrap(), pb::Access::Read)).await.unwrap_err();
    refused(&e, Code::PermissionDenied, &r2.display().to_string(), "outside both configured roots");
    assert_eq!(snapshot(&a).await, before);
    assert!(a.read("a", 0, 4096).await == vec![1u8; 4096]);
    assert!(a.read("b", 0, 4096).await == vec![2u8; 4096]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_is_refused_at_once_and_blocks_no_other_create() {
    let a = Agent::start("node-a");
    let root = root_of(&a);
    nix::unistd::mkfifo(&root.join("pipe"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let shm_fifo = PathBuf::from("/dev/shm").join(shm_name("fifo"));
    let _cleanup = ShmCleanup(vec![shm_fifo.clone()]);
    nix::unistd::mkfifo(&shm_fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    a.create("keep", 4096, pb::Access::ReadWrite).await;
    let before = snapshot(&a).await;

    // Nobody ever opens the FIFOs for writing: a blocking open would hang these tasks and the
    // anonymous create behind them forever.
    let mut tasks = Vec::new();
    // Distinct names: creates of one name race for its reservation, and the losers rightly hear
    // ALREADY_EXISTS while the winner is still opening (that race made this test flaky).
    for (name, access) in [("fifo-r", pb::Access::Read), ("fifo-w", pb::Access::Write), ("fifo-rw", pb::Access::ReadWrite)] {
        let mut c = a.client().await;
        tasks.push(tokio::spawn(async move { c.create_region(file_region_req(name, 4096, "pipe", access)).await }));
    }
    let mut c = a.client().await;
    let shm_obj = shm_name("fifo");
    let shm_task = tokio::spawn(async move { c.create_region(shm_req("fifo-shm", 4096, &shm_obj, true)).await });
    for t in tasks {
        let e = t.await.unwrap().unwrap_err();
        refused(&e, Code::InvalidArgument, "FIFO", "a FIFO in a file root");
    }
    let e = shm_task.await.unwrap().unwrap_err();
    refused(&e, Code::InvalidArgument, "FIFO", "a FIFO in /dev/shm");
    assert_eq!(snapshot(&a).await, before);

    // And a create right after (and one racing a FIFO create) completes.
    let mut c1 = a.client().await;
    let fifo = tokio::spawn(async move { c1.create_region(file_region_req("fifo", 4096, "pipe", pb::Access::Read)).await });
    let mut c2 = a.client().await;
    let anon = tokio::spawn(async move {
        c2.create_region(pb::CreateRegionRequest { name: "after".into(), length: 4096, ..Default::default() }).await
    });
    assert_eq!(anon.await.unwrap().unwrap().into_inner().name, "after");
    assert_eq!(fifo.await.unwrap().unwrap_err().code(), Code::InvalidArgument);
    let names: Vec<String> = snapshot(&a).await.regions.into_iter().map(|r| r.0).collect();
    assert_eq!(names, ["after", "keep"]);
}

// ------------------------------------------------------------------ shared memory

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_objects_are_private_and_never_taken_over() {
    let a = Agent::start("node-a");
    let mut c = a.client().await;
    let app = shm_name("app-private");
    let app_path = PathBuf::from("/dev/shm").join(&app);
    let mine = shm_name("mine");
    let mine_path = PathBuf::from("/dev/shm").join(&mine);
    let short = shm_name("short");
    let short_path = PathBuf::from("/dev/shm").join(&short);
    let link = shm_name("link");
    let link_path = PathBuf::from("/dev/shm").join(&link);
    let _cleanup = ShmCleanup(vec![app_path.clone(), mine_path.clone(), short_path.clone(), link_path.clone()]);

    // Another app's object: 18 bytes, mode 0600, owned by uid 65534.
    let app_bytes = b"app-private-data!!".to_vec();
    std::fs::write(&app_path, &app_bytes).unwrap();
    std::fs::set_permissions(&app_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&app_path, Some(65534), Some(65534)).unwrap();
    // An object of the agent's own uid that is shorter than the region.
    std::fs::write(&short_path, b"short").unwrap();
    // A symlink planted in /dev/shm pointing at a file of root's.
    let target_dir = tempfile::tempdir().unwrap();
    let target = target_dir.path().join("target");
    std::fs::write(&target, vec![9u8; 64]).unwrap();
    std::os::unix::fs::symlink(&target, &link_path).unwrap();

    a.create("keep", 4096, pb::Access::ReadWrite).await;
    let keep = random_bytes(4096, 3);
    a.put("keep", 0, &keep).await;
    let before = snapshot(&a).await;

    let e = c.create_region(shm_req("s", 65536, &app, false)).await.unwrap_err();
    refused(&e, Code::AlreadyExists, "adopt", "an existing object without adopt_existing");
    let e = c.create_region(shm_req("s", 16, &app, true)).await.unwrap_err();
    refused(&e, Code::PermissionDenied, "65534", "an object of another owner");
    let e = c.create_region(shm_req("s", 65536, &app, true)).await.unwrap_err();
    refused(&e, Code::PermissionDenied, "65534", "an object of another owner, longer region");
    let e = c.create_region(shm_req("s", 4096, &short, true)).await.unwrap_err();
    refused(&e, Code::InvalidArgument, "shorter", "an own object shorter than the region");
    let e = c.create_region(shm_req("s", 64, &link, true)).await.unwrap_err();
    refused(&e, Code::PermissionDenied, "symbolic link", "a symlink in /dev/shm with adopt");
    let e = c.create_region(shm_req("s", 64, &link, false)).await.unwrap_err();
    refused(&e, Code::AlreadyExists, "adopt", "a symlink in /dev/shm without adopt");
    // xferctl --adopt says the same.
    let o = a.ctl(&["region", "create", "s", "--size", "64KiB", "--kind", "shm", "--path", &app, "--access", "r", "--adopt"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("65534"), "{o:?}");

    // Nothing else changed: not the other app's object (bytes, size, mode, owner), not the
    // short one, not the symlink's target, not the agent.
    let meta = std::fs::metadata(&app_path).unwrap();
    assert_eq!((meta.len(), meta.mode() & 0o777, meta.uid()), (18, 0o600, 65534));
    assert_eq!(std::fs::read(&app_path).unwrap(), app_bytes);
    assert_eq!(std::fs::read(&short_path).unwrap(), b"short", "never resized");
    assert_eq!(std::fs::read(&target).unwrap(), vec![9u8; 64]);
    assert!(std::fs::symlink_metadata(&link_path).unwrap().file_type().is_symlink());
    assert_eq!(snapshot(&a).await, before);
    assert!(a.read("keep", 0, 4096).await == keep);

    // A created object is 0600 and the agent's, and goes away with its region.
    let r = c.create_region(shm_req("kv", 8192, &mine, false)).await.unwrap().into_inner();
    assert_eq!(r.path, mine);
    let meta = std::fs::metadata(&mine_path).unwrap();
    assert_eq!((meta.mode() & 0o777, meta.uid(), meta.len()), (0o600, nix::unistd::geteuid().as_raw(), 8192));
    c.delete_region(pb::DeleteRegionRequest { name: "kv".into() }).await.unwrap();
    assert!(!mine_path.exists(), "created object removed on delete");

    // Adopting an own object that is long enough works; it is neither resized nor removed.
    std::fs::write(&short_path, vec![5u8; 4096]).unwrap();
    c.create_region(shm_req("adopted", 1024, &short, true)).await.unwrap();
    assert!(a.read("adopted", 0, 1024).await == vec![5u8; 1024]);
    c.delete_region(pb::DeleteRegionRequest { name: "adopted".into() }).await.unwrap();
    assert_eq!(std::fs::read(&short_path).unwrap(), vec![5u8; 4096], "an adopted object outlives its region");
    // The catalog now exists (it was written for kv and adopted) and lists nothing, as before.
    let after = snapshot(&a).await;
    assert_eq!(after.regions, before.regions);
    assert_eq!(after.catalog.as_deref(), Some(&b"[]"[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_mode_and_group_are_configurable() {
    let a = Agent::start_env("node-a", &[("XFER_REGIONS__SHM_MODE", "0660"), ("XFER_REGIONS__SHM_GROUP", "65534")]);
    let obj = shm_name("group");
    let path = PathBuf::from("/dev/shm").join(&obj);
    let _cleanup = ShmCleanup(vec![path.clone()]);
    a.client().await.create_region(shm_req("g", 4096, &obj, false)).await.unwrap();
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!((meta.mode() & 0o777, meta.gid()), (0o660, 65534));
}

// ------------------------------------------------------------------ the catalog

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_and_deletes_keep_the_catalog_whole() {
    const TASKS: usize = 16;
    const OPS: usize = 250; // 16 × 250 = 4,000
    const NAMES: usize = 24;
    let a = Agent::start_env("node-a", &[("XFER_LIMITS__MAX_REGIONS", "4096")]);
    let root = root_of(&a);
    for i in 0..NAMES {
        std::fs::write(root.join(format!("f{i}.bin")), vec![i as u8; 4096]).unwrap();
    }
    let cleanup = ShmCleanup((0..NAMES).map(|i| PathBuf::from("/dev/shm").join(shm_name(&format!("c{i}")))).collect());
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let mut c = a.client().await;
        tasks.push(tokio::spawn(async move {
            let mut codes = Vec::new();
            for i in 0..OPS {
                // Tasks share names, so creates collide (ALREADY_EXISTS) and deletes miss (NOT_FOUND).
                let n = (t * 7 + i / 2) % NAMES;
                let name = format!("r{n}");
                let result = if i % 2 == 0 {
                    let req = if (t + i / 2) % 2 == 0 {
                        file_region_req(&name, 4096, &format!("f{n}.bin"), pb::Access::ReadWrite)
                    } else {
                        shm_req(&name, 4096, &shm_name(&format!("c{n}")), false)
                    };
                    c.create_region(req).await.map(|_| ())
                } else {
                    c.delete_region(pb::DeleteRegionRequest { name }).await.map(|_| ())
                };
                codes.push(match result {
                    Ok(()) => Code::Ok,
                    Err(e) => {
                        // A shm create may meet the object of a region of the same name that
                        // another task is deleting right now: ALREADY_EXISTS, a proper status.
                        assert!(matches!(e.code(), Code::AlreadyExists | Code::NotFound), "op {i} of task {t}: {e:?}");
                        e.code()
                    }
                });
            }
            codes
        }));
    }
    let mut ok = 0;
    for t in tasks {
        ok += t.await.unwrap().iter().filter(|c| **c == Code::Ok).count();
    }
    assert!(ok > TASKS, "most operations succeed ({ok} of {})", TASKS * OPS);

    let list = a.client().await.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner();
    let listed: BTreeSet<String> = list.regions.iter().map(|r| r.name.clone()).collect();
    let catalog: serde_json::Value = serde_json::from_slice(&std::fs::read(a.state_dir.join("regions.json")).unwrap()).unwrap();
    let cataloged: BTreeSet<String> = catalog.as_array().unwrap().iter().map(|e| e["name"].as_str().unwrap().to_string()).collect();
    assert_eq!(listed, cataloged, "the catalog matches ListRegions");
    let leftovers: Vec<String> = std::fs::read_dir(&a.state_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temp files left: {leftovers:?}");
    // Every shm object on disk belongs to a listed shm region, and vice versa.
    for i in 0..NAMES {
        let listed_shm = list.regions.iter().any(|r| r.name == format!("r{i}") && r.kind == pb::RegionKind::Shm as i32);
        assert_eq!(cleanup.0[i].exists(), listed_shm, "shm object of r{i}");
    }
    // The files were never written through (no data ops), nor resized.
    for i in 0..NAMES {
        assert_eq!(std::fs::read(root.join(format!("f{i}.bin"))).unwrap(), vec![i as u8; 4096]);
    }
}

/// A valid catalog with one file region, written by a real agent.
fn real_catalog() -> Vec<u8> {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    std::fs::create_dir_all(state.join("files")).unwrap();
    std::fs::write(state.join("files/w.bin"), vec![0u8; 4096]).unwrap();
    let mut a = Agent::start_with("node-a", &state, Ports::new(), &[]);
    let o = a.ctl(&["region", "create", "w", "--size", "4KiB", "--kind", "file", "--path", "w.bin"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(a.terminate(), Some(0));
    std::fs::read(state.join("regions.json")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_catalog_is_moved_aside_and_the_agent_starts() {
    let valid = real_catalog();
    assert!(serde_json::from_slice::<serde_json::Value>(&valid).is_ok());
    let cases: Vec<(&str, Vec<u8>)> =
        vec![("truncated", valid[..valid.len() / 2].to_vec()), ("empty", Vec::new()), ("garbage", b"\x00\xff{{not json at all".to_vec())];
    for (what, content) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        std::fs::create_dir_all(&state).unwrap();
        std::fs::write(state.join("regions.json"), &content).unwrap();
        let a = Agent::start_with("node-a", &state, Ports::new(), &[]);
        let list = a.client().await.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner();
        assert!(list.regions.is_empty(), "{what}: starts with no regions");
        let aside: Vec<PathBuf> = std::fs::read_dir(&state)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("regions.json.corrupt-"))
            .collect();
        assert_eq!(aside.len(), 1, "{what}: moved aside once: {aside:?}");
        assert_eq!(std::fs::read(&aside[0]).unwrap(), content, "{what}: the corrupt catalog is kept as it was");
        let logs = a.logs();
        assert!(logs.contains("region catalog is corrupt") && logs.contains("ERROR"), "{what}: {logs}");
        // The catalog is usable again.
        let catalog: serde_json::Value = serde_json::from_slice(&std::fs::read(state.join("regions.json")).unwrap()).unwrap();
        assert_eq!(catalog, serde_json::json!([]), "{what}");
        a.create("after", 4096, pb::Access::ReadWrite).await;
    }
}

async fn poll_until_available(a: &Agent, name: &str) -> pb::Region {
    let mut c = a.client().await;
    for _ in 0..2000 {
        let r = c.get_region(pb::GetRegionRequest { name: name.into() }).await.unwrap().into_inner();
        if r.unavailable_reason.is_empty() {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("region {name} never became available: {}", a.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_file_makes_its_region_unavailable_until_the_file_is_back() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let env = [("XFER_REGIONS__RETRY_INTERVAL", "50ms"), ("XFER_LIMITS__MAX_REGIONS", "3")];
    let mut a = Agent::start_with_env("node-a", &state, Ports::new(), &[], &env);
    let root = root_of(&a);
    std::fs::write(root.join("w.bin"), vec![0u8; 8192]).unwrap();
    std::fs::write(root.join("other.bin"), random_bytes(4096, 7)).unwrap();
    let mut c = a.client().await;
    c.create_region(file_region_req("w", 8192, "w.bin", pb::Access::ReadWrite)).await.unwrap();
    c.create_region(file_region_req("other", 4096, "other.bin", pb::Access::ReadWrite)).await.unwrap();
    assert_eq!(a.terminate(), Some(0));
    let catalog_before = std::fs::read(state.join("regions.json")).unwrap();

    // The file is briefly gone while the agent starts.
    let away = tmp.path().join("w.away");
    std::fs::rename(root.join("w.bin"), &away).unwrap();
    let a = Agent::start_with_env("node-a", &state, Ports::new(), &[], &env);
    let mut c = a.client().await;
    let w = c.get_region(pb::GetRegionRequest { name: "w".into() }).await.unwrap().into_inner();
    assert!(w.unavailable_reason.contains("does not exist"), "{w:?}");
    assert_eq!((w.length, w.path.as_str()), (8192, root.join("w.bin").to_str().unwrap()));
    let list = c.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner();
    let shown: Vec<(String, bool)> = list.regions.iter().map(|r| (r.name.clone(), r.unavailable_reason.is_empty())).collect();
    assert_eq!(shown, [("other".to_string(), true), ("w".to_string(), false)]);
    let o = a.ctl(&["region", "list"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("unavailable: "), "{o:?}");
    assert_eq!(std::fs::read(state.join("regions.json")).unwrap(), catalog_before, "kept in the catalog");
    assert!(a.read("other", 0, 4096).await == random_bytes(4096, 7));

    // Data operations name the reason.
    let e = c.read_region(pb::ReadRegionRequest { region: "w".into(), offset: 0, length: 16 }).await.unwrap_err();
    refused(&e, Code::FailedPrecondition, "does not exist", "ReadRegion");
    let e = c
        .write_region(futures::stream::iter(vec![pb::WriteRegionRequest { region: "w".into(), offset: 0, data: vec![1; 16] }]))
        .await
        .unwrap_err();
    refused(&e, Code::FailedPrecondition, "does not exist", "WriteRegion");
    let e = c.checksum(pb::ChecksumRequest { region: "w".into(), offset: 0, length: 16, ..Default::default() }).await.unwrap_err();
    refused(&e, Code::FailedPrecondition, "does not exist", "Checksum");
    let e = c.submit_transfer(write_req("w", &a, "other", 16)).await.unwrap_err();
    refused(&e, Code::FailedPrecondition, "does not exist", "SubmitTransfer");
    // It counts toward max_regions (3) but not toward registered bytes.
    let info = c.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!((info.regions, info.registered_bytes), (2, 4096));
    a.create("third", 4096, pb::Access::ReadWrite).await;
    let e = c.create_region(pb::CreateRegionRequest { name: "fourth".into(), length: 4096, ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    let e = c.create_region(file_region_req("w", 8192, "other.bin", pb::Access::Read)).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "an unavailable region keeps its name: {e:?}");

    // The file comes back with new bytes: the region follows without a restart.
    let bytes = random_bytes(8192, 9);
    std::fs::write(&away, &bytes).unwrap();
    std::fs::rename(&away, root.join("w.bin")).unwrap();
    let w = poll_until_available(&a, "w").await;
    assert_eq!(w.length, 8192);
    assert!(a.read("w", 0, 8192).await == bytes, "the region's bytes are the file's");
    assert_eq!(std::fs::read(state.join("regions.json")).unwrap(), catalog_before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_region_leaves_the_catalog_only_by_delete() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let mut a = Agent::start_with("node-a", &state, Ports::new(), &[]);
    let root = root_of(&a);
    std::fs::write(root.join("gone.bin"), vec![0u8; 4096]).unwrap();
    let o = a.ctl(&["region", "create", "gone", "--size", "4KiB", "--kind", "file", "--path", "gone.bin"]);
    assert!(o.status.success(), "{o:?}");
    assert_eq!(a.terminate(), Some(0));
    std::fs::remove_file(root.join("gone.bin")).unwrap();
    // Two restarts with the file missing: still there, still unavailable.
    for _ in 0..2 {
        let mut a = Agent::start_with("node-a", &state, Ports::new(), &[]);
        let r = a.client().await.get_region(pb::GetRegionRequest { name: "gone".into() }).await.unwrap().into_inner();
        assert!(!r.unavailable_reason.is_empty(), "{r:?}");
        assert!(a.logs().contains("could not restore region"), "{}", a.logs());
        assert_eq!(a.terminate(), Some(0));
    }
    let a = Agent::start_with("node-a", &state, Ports::new(), &[]);
    let o = a.ctl(&["region", "delete", "gone"]);
    assert!(o.status.success(), "{o:?}");
    let catalog: serde_json::Value = serde_json::from_slice(&std::fs::read(state.join("regions.json")).unwrap()).unwrap();
    assert_eq!(catalog, serde_json::json!([]));
    let e = a.client().await.get_region(pb::GetRegionRequest { name: "gone".into() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
}
