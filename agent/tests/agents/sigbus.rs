//! Host safety, bullet 2: a file that shrinks under a region's mapping never takes the agent
//! down (ARCHITECTURE.md, "SIGBUS"). Real agents on loopback, file regions under the default root
//! `<state_dir>/files`. Every test asserts the survival (GetInfo answers, same pid) and that
//! nothing else changed: other regions' bytes, other transfers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::*;
use tonic::Code;
use xfer_proto::v1 as pb;

const MIB: u64 = 1 << 20;
const REM_ACCESS_ERR: u16 = 10;

/// A file region `name` over `<root>/<name>.bin` holding `len` seeded bytes.
async fn file_region(a: &Agent, name: &str, len: u64, seed: u64) -> Vec<u8> {
    let bytes = random_bytes(len as usize, seed);
    std::fs::write(root_of(a).join(format!("{name}.bin")), &bytes).unwrap();
    a.client().await.create_region(file_region_req(name, len, &format!("{name}.bin"), pb::Access::ReadWrite)).await.unwrap();
    bytes
}

fn truncate(a: &Agent, name: &str, len: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(root_of(a).join(format!("{name}.bin"))).unwrap();
    f.set_len(len).unwrap();
}

/// The agent is the same process and still answers.
async fn alive(a: &mut Agent, pid: u32) {
    assert_eq!(a.pid(), Some(pid));
    if let Some(Ok(Some(st))) = a.child.as_mut().map(|c| c.try_wait()) {
        panic!("agent exited with {st}: {}", a.logs());
    }
    a.client().await.get_info(pb::GetInfoRequest {}).await.expect("GetInfo answers");
}

/// An anonymous region with known bytes, to check that nothing else changed.
async fn bystander(a: &Agent) -> Vec<u8> {
    a.create("anon", MIB, pb::Access::ReadWrite).await;
    let bytes = random_bytes(MIB as usize, 99);
    a.put("anon", 0, &bytes).await;
    bytes
}

fn poisoned_status(e: &tonic::Status, region: &str, what: &str) {
    assert_eq!(e.code(), Code::FailedPrecondition, "{what}: {e:?}");
    assert!(e.message().contains(region) && e.message().contains("shrank"), "{what}: names the region and the cause: {e:?}");
}

/// ReadRegion over the whole region; the stream's first error.
async fn read_err(a: &Agent, region: &str) -> tonic::Status {
    let mut c = a.client().await;
    let mut s = match c.read_region(pb::ReadRegionRequest { region: region.into(), offset: 0, length: 0 }).await {
        Ok(s) => s.into_inner(),
        Err(e) => return e,
    };
    loop {
        match s.message().await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("ReadRegion of {region} succeeded"),
            Err(e) => return e,
        }
    }
}

async fn region_reason(a: &Agent, region: &str) -> String {
    a.client().await.get_region(pb::GetRegionRequest { name: region.into() }).await.unwrap().into_inner().unavailable_reason
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_region_of_a_truncated_file_fails_and_the_agent_lives() {
    let mut a = Agent::start("node-a");
    let pid = a.pid().unwrap();
    let anon = bystander(&a).await;
    file_region(&a, "data", 4 * MIB, 1).await;
    let half = file_region(&a, "half", 4 * MIB, 2).await;
    file_region(&a, "sum", 4 * MIB, 3).await;

    // The reproducer: truncate to 0, then `xferctl get`.
    truncate(&a, "data", 0);
    let out = a.state_dir.join("out.bin");
    let o = a.ctl(&["get", "data", "--len", "4MiB", out.to_str().unwrap()]);
    assert!(!o.status.success(), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("FAILED_PRECONDITION") && err.contains("data") && err.contains("shrank"), "{err}");
    alive(&mut a, pid).await;
    poisoned_status(&read_err(&a, "data").await, "data", "ReadRegion after poisoning");
    assert!(region_reason(&a, "data").await.contains("shrank"), "GetRegion reports the fault");

    // Truncated to half: the first half is readable bytes, but the call as a whole fails.
    truncate(&a, "half", 2 * MIB);
    poisoned_status(&read_err(&a, "half").await, "half", "ReadRegion of a half-truncated file");
    alive(&mut a, pid).await;
    // The file's surviving half is what it was (the agent wrote nothing into it).
    assert!(std::fs::read(root_of(&a).join("half.bin")).unwrap() == half[..2 * MIB as usize]);

    // Checksum over a truncated file.
    truncate(&a, "sum", MIB);
    let e = a
        .client()
        .await
        .checksum(pb::ChecksumRequest { region: "sum".into(), offset: 0, length: 0, algo: pb::ChecksumAlgo::Xxh3 as i32 })
        .await
        .unwrap_err();
    poisoned_status(&e, "sum", "Checksum");

    // Nothing else changed; a poisoned region can be deleted and recreated.
    alive(&mut a, pid).await;
    assert!(a.read("anon", 0, MIB).await == anon, "anonymous region intact");
    let mut c = a.client().await;
    c.delete_region(pb::DeleteRegionRequest { name: "data".into() }).await.unwrap();
    let again = file_region(&a, "data", 4096, 4).await;
    assert!(a.read("data", 0, 4096).await == again);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_region_into_a_truncated_file_is_refused() {
    let mut a = Agent::start("node-a");
    let pid = a.pid().unwrap();
    let anon = bystander(&a).await;
    file_region(&a, "data", 4 * MIB, 1).await;
    truncate(&a, "data", 0);
    // Into pages past the file's new end: a store that would SIGBUS.
    let msgs = vec![pb::WriteRegionRequest { region: "data".into(), offset: MIB, data: vec![0xab; 64 << 10] }];
    let e = a.client().await.write_region(futures::stream::iter(msgs)).await.unwrap_err();
    poisoned_status(&e, "data", "WriteRegion");
    alive(&mut a, pid).await;
    assert_eq!(std::fs::metadata(root_of(&a).join("data.bin")).unwrap().len(), 0, "the file was not extended");
    assert!(region_reason(&a, "data").await.contains("shrank"));
    assert!(a.read("anon", 0, MIB).await == anon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_frames_on_a_truncated_file_are_naked() {
    let mut a = Agent::start("node-a");
    let pid = a.pid().unwrap();
    let anon = bystander(&a).await;
    file_region(&a, "rd", MIB, 1).await;
    file_region(&a, "wr", MIB, 2).await;
    let mut s = a.data_stream("c1").await;
    let (raddr, rtok) = grant_token(&a, "rd", MIB, pb::Access::Read, "c1").await.unwrap();
    let (waddr, wtok) = grant_token(&a, "wr", MIB, pb::Access::Write, "c1").await.unwrap();
    // A grant on the bystander, used after the faults on the same stream.
    let (aaddr, atok) = grant_token(&a, "anon", MIB, pb::Access::Read, "c1").await.unwrap();

    truncate(&a, "rd", 0);
    truncate(&a, "wr", 0);
    let (status, kind, data) = raw_read(&mut s, rtok, raddr + 4096, 4096);
    assert_eq!((status, data.len()), (REM_ACCESS_ERR, 0), "READ of a truncated page: REM_ACCESS_ERR, no bytes (kind {kind:?})");
    alive(&mut a, pid).await;
    assert_eq!(raw_write(&mut s, wtok, waddr + 8192, &[0xcd; 4096]), (REM_ACCESS_ERR, Kind::Nak), "WRITE into a truncated page");
    alive(&mut a, pid).await;
    assert_eq!(std::fs::metadata(root_of(&a).join("wr.bin")).unwrap().len(), 0, "the file was not extended");

    // The stream is still in sync and serves the other region.
    let (status, _, data) = raw_read(&mut s, atok, aaddr, 4096);
    assert_eq!(status, 0);
    assert!(data == anon[..4096]);
    // Both regions report the fault, and no new grant is handed out on them.
    for r in ["rd", "wr"] {
        assert!(region_reason(&a, r).await.contains("shrank"), "{r}");
        let e = grant_token(&a, r, 4096, pb::Access::Read, "c1").await.unwrap_err();
        poisoned_status(&e, r, "Grant on a poisoned region");
    }
    alive(&mut a, pid).await;
    assert!(a.read("anon", 0, MIB).await == anon);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_from_a_truncated_file_fails_while_another_succeeds() {
    let mut a = Agent::start("node-a");
    let mut b = Agent::start("node-b");
    let (pa, pb_) = (a.pid().unwrap(), b.pid().unwrap());
    file_region(&a, "src", 8 * MIB, 1).await;
    a.create("good", 8 * MIB, pb::Access::ReadWrite).await;
    let good = random_bytes(8 * MIB as usize, 2);
    a.put("good", 0, &good).await;
    b.create("dst", 8 * MIB, pb::Access::ReadWrite).await;
    b.create("dst2", 8 * MIB, pb::Access::ReadWrite).await;
    let before = random_bytes(8 * MIB as usize, 3);
    b.put("dst", 0, &before).await;
    // And a file region on B that A will READ from after it shrank.
    file_region(&b, "remote", MIB, 4).await;
    a.create("sink", MIB, pb::Access::ReadWrite).await;
    let sink = random_bytes(MIB as usize, 5);
    a.put("sink", 0, &sink).await;

    // Truncated while the transfer runs (slow: 4 KiB chunks, one outstanding): the transfer
    // fails with REGION_POISONED, a concurrent one from another region succeeds.
    let mut bad = write_req("src", &b, "dst", 8 * MIB);
    make_slow(&mut bad);
    let mut c = a.client().await;
    let started = c.submit_transfer(bad).await.unwrap().into_inner();
    wait_progress(&a, &started.id).await;
    truncate(&a, "src", 0);
    let ok = a.transfer(write_req("good", &b, "dst2", 8 * MIB)).await.unwrap();
    let bad = watch_to_end(&a, &started.id).await;
    assert_eq!(ok.state, pb::TransferState::Succeeded as i32, "{ok:?}");
    assert!(b.read("dst2", 0, 8 * MIB).await == good, "the concurrent transfer's bytes");
    assert_eq!(bad.state, pb::TransferState::Failed as i32, "{bad:?}");
    assert_eq!(bad.error_code, "REGION_POISONED", "{bad:?}");
    assert!(bad.error.contains("src") && bad.error.contains("shrank"), "{bad:?}");
    // Zeros standing in for the file never reached the target: what landed is the file's bytes
    // from before the truncation, the rest is as it was.
    let landed = b.read("dst", 0, 8 * MIB).await;
    let file_bytes = random_bytes(8 * MIB as usize, 1);
    assert!(
        landed.iter().zip(&before).zip(&file_bytes).all(|((l, old), f)| l == old || l == f),
        "the failed transfer's target holds only old bytes or the file's"
    );

    // A region whose file is already shorter than it is refused at once (its size is checked),
    // with the region and the cause named: on the initiator for a local source or sink, and on
    // the target for a grant.
    truncate(&b, "remote", 0);
    let read = pb::SubmitTransferRequest {
        notify: None,
        segments: Vec::new(),
        op: pb::Op::Read as i32,
        local: Some(pb::LocalRange { region: "sink".into(), offset: 0 }),
        remote: Some(pb::RemoteRange { agent: b.addr(), region: "remote".into(), offset: 0 }),
        length: Some(MIB),
        options: None,
    };
    let e = a.transfer(read).await.unwrap_err();
    poisoned_status(&e, "remote", "a READ from the peer's truncated file region");
    assert!(a.read("sink", 0, MIB).await == sink);

    file_region(&a, "into", MIB, 6).await;
    truncate(&a, "into", MIB / 2);
    let read = pb::SubmitTransferRequest {
        notify: None,
        segments: Vec::new(),
        op: pb::Op::Read as i32,
        local: Some(pb::LocalRange { region: "into".into(), offset: 0 }),
        remote: Some(pb::RemoteRange { agent: b.addr(), region: "dst2".into(), offset: 0 }),
        length: Some(MIB),
        options: None,
    };
    let e = a.transfer(read).await.unwrap_err();
    poisoned_status(&e, "into", "a READ into a truncated local file region");
    assert_eq!(std::fs::metadata(root_of(&a).join("into.bin")).unwrap().len(), MIB / 2, "not extended");

    alive(&mut a, pa).await;
    alive(&mut b, pb_).await;
    // A poisoned source is refused at submit from now on.
    let e = a.transfer(write_req("src", &b, "dst", 4096)).await.unwrap_err();
    poisoned_status(&e, "src", "SubmitTransfer from a poisoned region");
    // And transfers carry on.
    let t = a.transfer(write_req("good", &b, "dst", 8 * MIB)).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert!(b.read("dst", 0, 8 * MIB).await == good);
}

/// A SIGBUS that is not a fault in a registered file mapping still kills the agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_sigbus_is_still_fatal() {
    use std::os::unix::process::ExitStatusExt;
    let mut a = Agent::start("node-a");
    file_region(&a, "data", MIB, 1).await;
    let mut child = a.child.take().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGBUS).unwrap();
    let st = child.wait().unwrap();
    assert_eq!(st.signal(), Some(nix::libc::SIGBUS), "{st:?}");
}
