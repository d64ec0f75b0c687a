//! Inputs that once moved or destroyed data they should have refused, against real agents: a
//! zero `--len`, a `put` that does not fit, a `get` past the region's end, a copy whose source
//! and destination overlap in one region. Each is refused with INVALID_ARGUMENT (exit 4) and
//! leaves every byte, and the output file, as it was.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "common/mod.rs"]
mod common;

use common::*;

const KIB: usize = 1024;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Creates region `name` of `len` bytes on `a` and fills it with `data`.
fn filled(a: &Agent, dir: &std::path::Path, name: &str, data: &[u8]) {
    let o = a.ctl(&["region", "create", name, "--size", &data.len().to_string()]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let f = dir.join(format!("{name}.init"));
    std::fs::write(&f, data).unwrap();
    let o = a.ctl(&["put", f.to_str().unwrap(), name]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
}

/// The whole of region `name`, read back through `get`.
fn contents(a: &Agent, name: &str) -> Vec<u8> {
    let o = a.ctl(&["get", name, "-"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    o.stdout
}

#[test]
fn zero_len_copies_nothing_either_way() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    let dir = tempfile::tempdir().unwrap();
    let (src, dst) = (pattern(64 * KIB, 1), pattern(64 * KIB, 2));
    filled(&a, dir.path(), "src", &src);
    filled(&b, dir.path(), "dst", &dst);
    let remote = format!("{}:dst", b.addr);
    for extra in [&[][..], &["--pull"][..], &["--verify"][..], &["--no-wait"][..]] {
        let mut args = vec!["cp", "src", remote.as_str(), "--len", "0"];
        args.extend_from_slice(extra);
        let o = a.ctl(&args);
        refused(&o, 4, "INVALID_ARGUMENT", &format!("--len 0 {extra:?}"));
        assert!(err(&o).contains("zero-length"), "{}", err(&o));
    }
    assert!(contents(&a, "src") == src, "source changed");
    assert!(contents(&b, "dst") == dst, "destination changed by a refused --len 0");
    let o = a.ctl(&["--json", "transfer", "list"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    assert_eq!(serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap().as_array().map(Vec::len), Some(0), "no record");
    // Without --len the rest of SRC still moves.
    let o = a.ctl(&["cp", "src@60KiB", &remote]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let mut want = dst.clone();
    want[..4 * KIB].copy_from_slice(&src[60 * KIB..]);
    assert!(contents(&b, "dst") == want);
}

#[test]
fn put_that_does_not_fit_writes_nothing() {
    let a = Agent::start("node-a");
    let dir = tempfile::tempdir().unwrap();
    // Larger than one WriteRegion message (1 MiB), so that a check made message by message
    // would already have written the first ones.
    let before = pattern(2048 * KIB, 3);
    filled(&a, dir.path(), "r", &before);
    let big = dir.path().join("big.bin");
    std::fs::write(&big, pattern(2048 * KIB + 1, 4)).unwrap();
    let fits = dir.path().join("fits.bin");
    std::fs::write(&fits, pattern(1536 * KIB, 5)).unwrap();
    let cases = [
        (big.to_str().unwrap(), "r", "one byte larger than the region"),
        (fits.to_str().unwrap(), "r@1MiB", "fits the region, not from that offset"),
        (fits.to_str().unwrap(), "r@4MiB", "offset past the end"),
    ];
    for (file, dest, what) in cases {
        let o = a.ctl(&["put", file, dest]);
        refused(&o, 4, "INVALID_ARGUMENT", what);
        assert!(err(&o).contains("nothing was written"), "{what}: {}", err(&o));
        assert!(contents(&a, "r") == before, "{what}: the region holds bytes of a refused put");
    }
    // The largest put that fits still lands.
    let o = a.ctl(&["put", fits.to_str().unwrap(), "r@512KiB"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
}

#[test]
fn get_past_the_end_leaves_no_file_and_keeps_an_existing_one() {
    let a = Agent::start("node-a");
    let dir = tempfile::tempdir().unwrap();
    filled(&a, dir.path(), "r", &pattern(64 * KIB, 6));
    let fresh = dir.path().join("out.bin");
    let kept = dir.path().join("kept.bin");
    std::fs::write(&kept, b"precious").unwrap();
    for (src, len, what) in [
        ("r", "16MiB", "longer than the region"),
        ("r@60KiB", "8KiB", "runs past the end from the offset"),
        ("r@1MiB", "1", "offset past the end"),
        ("r@1MiB", "", "offset past the end, no --len"),
        ("r", "0", "zero length"),
    ] {
        for out_file in [&fresh, &kept] {
            let mut args = vec!["get", src];
            if !len.is_empty() {
                args.extend(["--len", len]);
            }
            args.push(out_file.to_str().unwrap());
            refused(&a.ctl(&args), 4, "INVALID_ARGUMENT", what);
        }
        assert!(!fresh.exists(), "{what}: a refused get created its output file");
        assert_eq!(std::fs::read(&kept).unwrap(), b"precious", "{what}: a refused get truncated its output file");
    }
    // A missing region: NOT_FOUND, no file either.
    refused(&a.ctl(&["get", "nope", fresh.to_str().unwrap()]), 3, "NOT_FOUND", "missing region");
    assert!(!fresh.exists());
}

#[test]
fn overlapping_copy_in_one_region_is_refused_and_apart_it_works() {
    let a = Agent::start("node-a");
    let dir = tempfile::tempdir().unwrap();
    let before = pattern(2048 * KIB + 4 * KIB, 7);
    filled(&a, dir.path(), "kv", &before);
    let self_kv = |at: &str| format!("{}:kv@{at}", a.addr);
    for (src, dst, len, pull) in
        [("kv", "4KiB", "1MiB", false), ("kv@4KiB", "0", "1MiB", false), ("kv", "4KiB", "1MiB", true), ("kv@1MiB", "1MiB", "4KiB", false)]
    {
        let d = self_kv(dst);
        let mut args = vec!["cp", src, d.as_str(), "--len", len, "--verify"];
        if pull {
            args.push("--pull");
        }
        let o = a.ctl(&args);
        refused(&o, 4, "INVALID_ARGUMENT", &format!("{src} -> {d} (pull {pull})"));
        assert!(err(&o).contains("overlap"), "says why: {}", err(&o));
        assert!(contents(&a, "kv") == before, "{src} -> {d}: the region changed");
    }
    // Ranges that touch but do not overlap copy correctly, verified.
    let o = a.ctl(&["cp", "kv", &self_kv("1MiB"), "--len", "1MiB", "--verify"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let mut want = before.clone();
    want.copy_within(..1024 * KIB, 1024 * KIB);
    assert!(contents(&a, "kv") == want);
}
