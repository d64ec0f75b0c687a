//! Files the agent writes and files it maps, attacked as a local user who can write a directory
//! the agent (root) writes into or a file root (SECURITY.md promise 7): a link planted where the
//! agent writes its ready file, and a hard link that brings a file from outside a file root into
//! it. Each test asserts the refusal (or the write that does not go through the link) and that
//! nothing else changed: the victim file's bytes and modification time, the agent's regions and
//! catalog, other regions' service.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

/// What a planted link must not change: a file's bytes, inode and modification time.
fn file_state(p: &Path) -> (Vec<u8>, u64, i64, i64) {
    let m = std::fs::metadata(p).unwrap();
    (std::fs::read(p).unwrap(), m.ino(), m.mtime(), m.mtime_nsec())
}

/// Region names, paths and unavailable reasons, and the catalog's bytes.
async fn snapshot(a: &Agent) -> (Vec<(String, String, String)>, Option<Vec<u8>>) {
    let list = a.client().await.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner();
    (
        list.regions.into_iter().map(|r| (r.name, r.path, r.unavailable_reason)).collect(),
        std::fs::read(a.state_dir.join("regions.json")).ok(),
    )
}

// ------------------------------------------------------------------ the ready file

/// The ready file was written through `PATH.tmp` with a plain open: a symbolic link planted
/// there by anyone who may write the ready file's directory made the agent (root) truncate and
/// overwrite the file it points to. Links at that name and at other names a writer might use
/// are left alone; the victim keeps its bytes and mtime; the ready file is a regular file with
/// the ports; no temporary file is left behind. A restart over the same planted links does the
/// same (a stale ready file is removed first, the links are not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_planted_where_the_ready_file_is_written_are_not_followed() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    // The harness's ready file for node-a: `<state>.node-a.ready`, in `tmp`.
    let ready = state.with_extension("node-a.ready");
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, b"the victim's bytes\n").unwrap();
    let before = file_state(&victim);
    let mut planted: Vec<PathBuf> =
        ["node-a.ready.tmp", "node-a.ready.new", "node-a.ready~", "node-a.ready.swp"].iter().map(|ext| state.with_extension(ext)).collect();
    planted.push(tmp.path().join(".state.node-a.ready.tmp"));
    for p in &planted {
        std::os::unix::fs::symlink(&victim, p).unwrap();
    }
    // And a dangling one: a plain O_CREAT would follow it and create the file it names.
    let dangling_target = tmp.path().join("created-through-a-link");
    let dangling = state.with_extension("node-a.ready.tmp2");
    std::os::unix::fs::symlink(&dangling_target, &dangling).unwrap();
    planted.push(dangling.clone());
    let names_before: std::collections::BTreeSet<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();

    for round in 0..2 {
        let mut a = Agent::start_with("node-a", &state, Ports::new(), &[]);
        assert_eq!(file_state(&victim), before, "round {round}: the victim is unchanged");
        assert!(!dangling_target.exists(), "round {round}: nothing created through the dangling link");
        let m = std::fs::symlink_metadata(&ready).unwrap();
        assert!(m.file_type().is_file(), "round {round}: the ready file is a regular file");
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&ready).unwrap()).unwrap();
        assert_eq!(v["grpc"].as_str().unwrap(), a.addr(), "round {round}");
        for p in &planted {
            assert!(std::fs::symlink_metadata(p).unwrap().file_type().is_symlink(), "round {round}: {} left alone", p.display());
        }
        // The agent serves (a region round trip), and its directory holds only what was there
        // plus its state dir, log and ready file: no temporary file left behind.
        a.create("r", 4096, pb::Access::ReadWrite).await;
        a.put("r", 0, b"still served").await;
        assert_eq!(a.read("r", 0, 12).await, b"still served");
        let names: std::collections::BTreeSet<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        let mut expected = names_before.clone();
        expected.extend([state.file_name().unwrap(), ready.file_name().unwrap(), a.log.file_name().unwrap()].map(|n| n.to_os_string()));
        assert_eq!(names, expected, "round {round}");
        assert_eq!(a.terminate(), Some(0));
    }
    assert_eq!(file_state(&victim), before);
}

// ------------------------------------------------------------------ hard links into a root

/// A file outside every root, hard-linked into the root (the same inode: the path check sees
/// nothing wrong): CreateRegion is PERMISSION_DENIED naming `regions.allow_hard_links`, for
/// every access and for the relative and absolute spellings; the outside file keeps its bytes
/// and mtime, the region count and catalog are unchanged, and a region created before is
/// served as before. A file with one name in the same root is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hard_link_into_a_root_is_refused_and_changes_nothing() {
    let a = Agent::start("node-a");
    let root = root_of(&a);
    let good = random_bytes(4096, 1);
    std::fs::write(root.join("good.bin"), &good).unwrap();
    let mut c = a.client().await;
    c.create_region(file_region_req("good", 4096, "good.bin", pb::Access::ReadWrite)).await.unwrap();
    let outside = tempfile::tempdir().unwrap();
    let secret = outside.path().join("secret");
    std::fs::write(&secret, random_bytes(8192, 2)).unwrap();
    std::fs::hard_link(&secret, root.join("link.bin")).unwrap();
    let secret_before = file_state(&secret);
    let before = snapshot(&a).await;
    let info_before = c.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();

    let absolute = root.join("link.bin").display().to_string();
    for path in ["link.bin", absolute.as_str()] {
        for access in [pb::Access::Read, pb::Access::ReadWrite, pb::Access::Write] {
            let e = c.create_region(file_region_req("evil", 8192, path, access)).await.unwrap_err();
            assert_eq!(e.code(), Code::PermissionDenied, "{path} {access:?}: {e:?}");
            assert!(e.message().contains("2 hard links") && e.message().contains("regions.allow_hard_links"), "{e:?}");
        }
    }
    assert_eq!(file_state(&secret), secret_before);
    assert_eq!(snapshot(&a).await, before);
    let info = c.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!((info.regions, info.registered_bytes), (info_before.regions, info_before.registered_bytes));
    assert_eq!((info.regions, info.registered_bytes), (1, 4096));
    let e = c.get_region(pb::GetRegionRequest { name: "evil".into() }).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert_eq!(a.read("good", 0, 4096).await, good);

    // Two names for one file inside the root are refused alike (the check cannot tell where
    // the other name is); a file with one name is accepted.
    std::fs::write(root.join("twin-a.bin"), vec![3u8; 4096]).unwrap();
    std::fs::hard_link(root.join("twin-a.bin"), root.join("twin-b.bin")).unwrap();
    let e = c.create_region(file_region_req("twin", 4096, "twin-a.bin", pb::Access::Read)).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    std::fs::remove_file(root.join("twin-b.bin")).unwrap();
    c.create_region(file_region_req("twin", 4096, "twin-a.bin", pb::Access::Read)).await.unwrap();
    assert_eq!(a.read("twin", 0, 4096).await, vec![3u8; 4096]);
}

/// With `regions.allow_hard_links = true` the operator accepts linked files: the same
/// hard-linked file is a region, and its bytes are the outside file's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_links_are_accepted_when_the_operator_allows_them() {
    let a = Agent::start_env("node-a", &[("XFER_REGIONS__ALLOW_HARD_LINKS", "true")]);
    let root = root_of(&a);
    let outside = tempfile::tempdir().unwrap();
    let data = random_bytes(8192, 3);
    std::fs::write(outside.path().join("shared"), &data).unwrap();
    std::fs::hard_link(outside.path().join("shared"), root.join("link.bin")).unwrap();
    let mut c = a.client().await;
    c.create_region(file_region_req("linked", 8192, "link.bin", pb::Access::ReadWrite)).await.unwrap();
    assert_eq!(a.read("linked", 0, 8192).await, data);
}

/// A region restored from the catalog whose file gained another hard link while the agent was
/// down stays unavailable with that reason (counted, kept in the catalog, its data operations
/// refused), other regions are restored and served; once the extra link is gone the periodic
/// retry brings it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_region_whose_file_gained_a_link_stays_unavailable() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let env = [("XFER_REGIONS__RETRY_INTERVAL", "50ms")];
    let mut a = Agent::start_with_env("node-a", &state, Ports::new(), &[], &env);
    let root = root_of(&a);
    let data = random_bytes(4096, 4);
    std::fs::write(root.join("f.bin"), &data).unwrap();
    std::fs::write(root.join("other.bin"), random_bytes(4096, 5)).unwrap();
    let mut c = a.client().await;
    c.create_region(file_region_req("f", 4096, "f.bin", pb::Access::ReadWrite)).await.unwrap();
    c.create_region(file_region_req("other", 4096, "other.bin", pb::Access::ReadWrite)).await.unwrap();
    assert_eq!(a.terminate(), Some(0));
    let catalog = std::fs::read(state.join("regions.json")).unwrap();

    let elsewhere = tmp.path().join("alias");
    std::fs::hard_link(root.join("f.bin"), &elsewhere).unwrap();
    let a = Agent::start_with_env("node-a", &state, Ports::new(), &[], &env);
    let mut c = a.client().await;
    let f = c.get_region(pb::GetRegionRequest { name: "f".into() }).await.unwrap().into_inner();
    assert!(f.unavailable_reason.contains("hard links") && f.unavailable_reason.contains("regions.allow_hard_links"), "{f:?}");
    let list = c.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner();
    let shown: Vec<(String, bool)> = list.regions.iter().map(|r| (r.name.clone(), r.unavailable_reason.is_empty())).collect();
    assert_eq!(shown, [("f".to_string(), false), ("other".to_string(), true)]);
    assert_eq!(std::fs::read(state.join("regions.json")).unwrap(), catalog, "kept in the catalog as it was");
    let e = c.read_region(pb::ReadRegionRequest { region: "f".into(), offset: 0, length: 16 }).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("regions.allow_hard_links"), "{e:?}");
    assert_eq!(a.read("other", 0, 4096).await, random_bytes(4096, 5));
    assert_eq!(file_state(&elsewhere).0, data, "the other name's bytes are untouched");

    std::fs::remove_file(&elsewhere).unwrap();
    let mut back = None;
    // A hang guard, not a synchronisation: the retry every 50 ms is the event.
    for _ in 0..2000 {
        let r = c.get_region(pb::GetRegionRequest { name: "f".into() }).await.unwrap().into_inner();
        if r.unavailable_reason.is_empty() {
            back = Some(r);
            break;
        }
        assert!(r.unavailable_reason.contains("hard links"), "{r:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(back.is_some(), "region f never came back: {}", a.logs());
    assert_eq!(a.read("f", 0, 4096).await, data);
}
