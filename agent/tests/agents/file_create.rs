//! File regions sized from their file and files created on request (`create_file`), and the
//! paths such a request must refuse: an existing file (never clobbered), a link at the name or in
//! the path, `..`, a path outside every root, a missing directory, a FIFO. Each refusal is
//! checked together with the disk: the file root and a directory beside it are the same, name by
//! name and byte by byte, before and after, and no region or catalog entry appears.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

/// Everything under `dir`: each name's type, mode, size, inode and bytes (a link's target).
fn tree(dir: &Path) -> BTreeMap<String, (String, u32, u64, u64, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let (kind, bytes) = if m.file_type().is_symlink() {
                ("link", std::fs::read_link(&p).unwrap().into_os_string().into_encoded_bytes())
            } else if m.is_dir() {
                stack.push(p.clone());
                ("dir", Vec::new())
            } else if m.is_file() {
                ("file", std::fs::read(&p).unwrap())
            } else {
                ("other", Vec::new())
            };
            out.insert(p.strip_prefix(dir).unwrap().display().to_string(), (kind.to_string(), m.mode(), m.len(), m.ino(), bytes));
        }
    }
    out
}

fn file_req(name: &str, path: &str, length: u64, create: bool) -> pb::CreateRegionRequest {
    pb::CreateRegionRequest {
        name: name.into(),
        length,
        kind: pb::RegionKind::File as i32,
        path: path.into(),
        access: pb::Access::ReadWrite as i32,
        create_file: create,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_region_takes_its_size_from_the_file_and_create_makes_a_new_one() {
    let a = Agent::start("node-a");
    let root = a.state_dir.join("files");
    let data = random_bytes(12345, 9);
    std::fs::write(root.join("w.bin"), &data).unwrap();
    let mut c = a.client().await;
    let r = c.create_region(file_req("w", "w.bin", 0, false)).await.unwrap().into_inner();
    assert_eq!(r.length, 12345, "the file's size");
    let info = c.get_info(pb::GetInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.registered_bytes, 12345, "charged what is mapped, not 0");
    assert_eq!(a.read("w", 0, 12345).await, data);

    // A missing file without create: the error says how to create it.
    let e = c.create_region(file_req("m", "missing.bin", 0, false)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("--create"), "{}", e.message());
    // An empty file has no size to take.
    std::fs::write(root.join("empty.bin"), b"").unwrap();
    let e = c.create_region(file_req("e", "empty.bin", 0, false)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("empty"), "{}", e.message());

    // create_file: a new file of that many zero bytes, in a subdirectory too; it outlives the region.
    std::fs::create_dir(root.join("sub")).unwrap();
    for (name, path) in [("n", "new.bin"), ("s", "sub/new.bin")] {
        let r = c.create_region(file_req(name, path, 8192, true)).await.unwrap().into_inner();
        assert_eq!(r.length, 8192);
        let f = root.join(path);
        let m = std::fs::symlink_metadata(&f).unwrap();
        assert!(m.is_file() && m.len() == 8192, "{path}: {m:?}");
        assert_eq!(m.mode() & 0o077, 0, "{path}: only the agent's user may touch it: {:o}", m.mode());
        a.put(name, 100, b"through the region").await;
        assert_eq!(&std::fs::read(&f).unwrap()[100..118], b"through the region");
        c.delete_region(pb::DeleteRegionRequest { name: name.into() }).await.unwrap();
        assert_eq!(std::fs::metadata(&f).unwrap().len(), 8192, "{path}: the file stays after delete");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_refuses_every_path_it_must_not_touch_and_changes_nothing() {
    let a = Agent::start("node-a");
    let root = a.state_dir.join("files");
    let outside = tempfile::tempdir().unwrap();
    let out = outside.path();
    std::fs::write(out.join("secret"), b"outside the root").unwrap();
    std::fs::write(root.join("existing.bin"), b"precious bytes").unwrap();
    std::fs::create_dir(root.join("sub")).unwrap();
    std::os::unix::fs::symlink(out.join("secret"), root.join("link.bin")).unwrap();
    std::os::unix::fs::symlink(out.join("dangling-target"), root.join("dangling.bin")).unwrap();
    std::os::unix::fs::symlink(out, root.join("dirlink")).unwrap();
    nix::unistd::mkfifo(&root.join("fifo"), nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let mut c = a.client().await;
    // A region named "taken" exists: a create under that name must not create its file.
    c.create_region(pb::CreateRegionRequest { name: "taken".into(), length: 4096, ..Default::default() }).await.unwrap();
    let outside_root = out.join("new.bin").display().to_string();

    let cases: Vec<(&str, pb::CreateRegionRequest, Code)> = vec![
        ("an existing file is never clobbered", file_req("r", "existing.bin", 4096, true), Code::AlreadyExists),
        ("a link at the name", file_req("r", "link.bin", 4096, true), Code::AlreadyExists),
        ("a dangling link at the name", file_req("r", "dangling.bin", 4096, true), Code::AlreadyExists),
        ("a FIFO at the name", file_req("r", "fifo", 4096, true), Code::AlreadyExists),
        ("a link to a directory in the path", file_req("r", "dirlink/new.bin", 4096, true), Code::PermissionDenied),
        ("`..` out of the root", file_req("r", "../new.bin", 4096, true), Code::PermissionDenied),
        ("`..` that stays inside", file_req("r", "sub/../new.bin", 4096, true), Code::PermissionDenied),
        ("an absolute path outside every root", file_req("r", &outside_root, 4096, true), Code::PermissionDenied),
        ("a missing directory", file_req("r", "nodir/new.bin", 4096, true), Code::InvalidArgument),
        ("a directory", file_req("r", "sub", 4096, true), Code::AlreadyExists),
        ("the root itself", file_req("r", ".", 4096, true), Code::InvalidArgument),
        ("no length", file_req("r", "new.bin", 0, true), Code::InvalidArgument),
        ("no path", file_req("r", "", 4096, true), Code::InvalidArgument),
        ("a NUL byte", file_req("r", "new\0.bin", 4096, true), Code::InvalidArgument),
        ("a region name already taken", file_req("taken", "new.bin", 4096, true), Code::AlreadyExists),
        ("a bad region name", file_req("bad name/", "new.bin", 4096, true), Code::InvalidArgument),
        (
            "an anonymous region",
            pb::CreateRegionRequest { kind: pb::RegionKind::Anonymous as i32, ..file_req("r", "new.bin", 4096, true) },
            Code::InvalidArgument,
        ),
        ("more than max_registered_bytes", file_req("r", "new.bin", 1 << 50, true), Code::ResourceExhausted),
    ];
    let catalog = || std::fs::read(a.state_dir.join("regions.json")).ok();
    let (root_before, out_before, catalog_before) = (tree(&root), tree(out), catalog());
    for (what, req, code) in cases {
        let e = c.create_region(req).await.expect_err(what);
        assert_eq!(e.code(), code, "{what}: {e:?}");
        assert!(!e.message().is_empty(), "{what}");
        assert_eq!(tree(&root), root_before, "{what}: the file root changed");
        assert_eq!(tree(out), out_before, "{what}: the directory outside the root changed");
        assert_eq!(catalog(), catalog_before, "{what}: the catalog changed");
    }
    let list = c.list_regions(pb::ListRegionsRequest::default()).await.unwrap().into_inner();
    assert_eq!(list.regions.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["taken"]);
    // The same agent still creates a file where it may.
    c.create_region(file_req("r", "new.bin", 4096, true)).await.unwrap();
    assert_eq!(std::fs::read(root.join("new.bin")).unwrap(), vec![0u8; 4096]);
}

/// A directory in the path swapped for a link out of the root while creates run: another thread
/// exchanges `sub` (a directory beneath the root) with `swap` (a link to a directory outside)
/// over and over (`renameat2(RENAME_EXCHANGE)`, so `sub` always exists). Whenever a create's
/// directory is looked up, it is either the directory (the file lands in it) or the link (refused):
/// nothing is ever created outside the root, and every file the agent reports lands in the
/// directory beneath it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_swapped_for_a_link_during_create_never_lets_a_file_out() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let a = Agent::start("node-a");
    let root = a.state_dir.join("files");
    let outside = tempfile::tempdir().unwrap();
    let out = outside.path().to_path_buf();
    std::fs::create_dir(root.join("sub")).unwrap();
    std::os::unix::fs::symlink(&out, root.join("swap")).unwrap();
    let out_before = tree(&out);
    let (stop, swaps) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let flipper = {
        let (root, stop, swaps) = (root.clone(), stop.clone(), swaps.clone());
        std::thread::spawn(move || {
            let dir = std::fs::File::open(&root).unwrap();
            while !stop.load(Ordering::Relaxed) {
                nix::fcntl::renameat2(&dir, "sub", &dir, "swap", nix::fcntl::RenameFlags::RENAME_EXCHANGE).unwrap();
                swaps.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let mut c = a.client().await;
    let mut made = Vec::new();
    for i in 0..200 {
        let name = format!("f{i}");
        match c.create_region(file_req(&name, &format!("sub/{name}.bin"), 4096, true)).await {
            Ok(_) => {
                c.delete_region(pb::DeleteRegionRequest { name: name.clone() }).await.unwrap();
                made.push(format!("{name}.bin"));
            }
            // A link met as the directory is refused as one; if the swap undid it before the
            // agent looked again to name the reason, the refusal says "not a directory".
            Err(e) => {
                assert!(matches!(e.code(), Code::PermissionDenied | Code::InvalidArgument), "{name}: refused only for the link: {e:?}")
            }
        }
        assert_eq!(tree(&out), out_before, "{name}: a file appeared outside the root");
    }
    stop.store(true, Ordering::Relaxed);
    flipper.join().unwrap();
    assert!(swaps.load(Ordering::Relaxed) > 0, "the directory was swapped while the creates ran");
    assert_eq!(tree(&out), out_before, "nothing was created outside the root");
    // Whichever name the directory has now, it holds exactly the files the agent reported.
    let real = ["sub", "swap"].into_iter().map(|n| root.join(n)).find(|p| std::fs::symlink_metadata(p).unwrap().is_dir()).unwrap();
    let mut inside: Vec<String> = std::fs::read_dir(&real).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    inside.sort();
    made.sort();
    assert_eq!(inside, made, "the files beneath the root are the ones created");
}
