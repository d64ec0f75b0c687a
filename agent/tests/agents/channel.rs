//! Channels end to end (issue 11, prepared transfers), through real agents on the tcp fabric and
//! real gRPC clients: one grant serves many batches (inline and prepared lists), each batch's
//! notification comes after its bytes, bad batches are answered and the channel goes on, a
//! revoked grant ends the channel with a clear status, and closing it gives everything back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common::chan::*;
use crate::common::*;
use tokio::sync::mpsc;
use tonic::Code;
use xfer_proto::v1 as pb;

const BLOCK: u64 = 4096;

fn open_msg(op: pb::Op, local: &str, peer: &Agent, remote: &str, offset: u64, length: u64, notify: bool) -> pb::ChannelOpen {
    open_msg_qps(op, local, peer, remote, offset, length, notify, 3)
}

/// One grant, many batches: a prepared list posted twice (new source bytes in between) and an
/// inline batch, each notified on the target with its own tag after every byte of it is there
/// (the subscriber reads the region the moment it is told). The target holds one grant the
/// whole time; closing the channel gives it back and the channel gauge returns to zero.
#[tokio::test]
async fn one_grant_serves_many_batches_each_notified_after_its_bytes() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    const POOL: u64 = 8 << 20;
    a.create("kv", POOL, pb::Access::ReadWrite).await;
    b.create("kv", POOL, pb::Access::ReadWrite).await;
    let before = random_bytes(POOL as usize, 3);
    b.put("kv", 0, &before).await;
    // The channel covers [1 MiB, 5 MiB) of B's pool.
    let (lo, span) = (1u64 << 20, 4u64 << 20);
    let mut ch = try_open(&a, open_msg(pb::Op::Write, "kv", &b, "kv", lo, span, true)).await.unwrap();
    assert_eq!((ch.opened.remote_offset, ch.opened.remote_length, ch.opened.qps), (lo, span, 3));
    assert_eq!(ch.opened.peer, "node-b");
    assert_eq!(gauge(&b, "xfer_grants_active"), 1.0);
    let mut notes = subscribe(&b, "kv", None).await;
    // 300 blocks: block i of A's first MiB to a scattered place in the channel's range.
    let place = |i: u64| lo + ((i * 7919) % (span / BLOCK)) * BLOCK;
    let list: Vec<pb::Segment> = (0..300).map(|i| seg(i * BLOCK, place(i), BLOCK)).collect();
    match ch.prepare(1, list.clone()).await {
        pb::channel_event::Ev::Prepared(p) => assert_eq!((p.list, p.segments, p.bytes), (1, 300, 300 * BLOCK)),
        other => panic!("{other:?}"),
    }
    let mut want = before.clone();
    for round in 0..2u64 {
        let src = random_bytes(POOL as usize, 10 + round);
        a.put("kv", 0, &src).await;
        let tag = format!("prepared-{round}");
        let d = ch.post(100 + round, vec![], 1, Some(tag.as_bytes())).await;
        ok(&d);
        assert_eq!((d.seq, d.bytes, d.segments), (100 + round, 300 * BLOCK, 300));
        let n = next_note(&mut notes).await;
        let landed = b.read("kv", 0, POOL).await;
        assert_eq!((n.tag.as_slice(), n.via.as_str(), n.region.as_str()), (tag.as_bytes(), "fabric", "kv"));
        for s in &list {
            let (l, r) = (s.local_offset as usize, s.remote_offset as usize);
            want[r..r + BLOCK as usize].copy_from_slice(&src[l..l + BLOCK as usize]);
        }
        assert!(landed == want, "round {round}: when notified, every block of the batch was in place and nothing else changed");
    }
    // An inline batch: two contiguous blocks coalesce.
    let src = random_bytes(POOL as usize, 20);
    a.put("kv", 0, &src).await;
    let inline = vec![seg(0, lo, BLOCK), seg(BLOCK, lo + BLOCK, BLOCK), seg(8 * BLOCK, lo + span - BLOCK, BLOCK)];
    let d = ch.post(7, inline.clone(), 0, Some(b"inline")).await;
    ok(&d);
    assert_eq!((d.bytes, d.segments), (3 * BLOCK, 2));
    assert!(d.prep_ns_per_segment > 0.0, "{d:?}");
    let n = next_note(&mut notes).await;
    assert_eq!(n.tag, b"inline");
    for s in &inline {
        let (l, r) = (s.local_offset as usize, s.remote_offset as usize);
        want[r..r + BLOCK as usize].copy_from_slice(&src[l..l + BLOCK as usize]);
    }
    assert!(b.read("kv", 0, POOL).await == want);
    // A batch without a notification moves its bytes and tells nobody.
    let d = ch.post(8, vec![seg(0, lo + 5 * BLOCK, BLOCK)], 0, None).await;
    ok(&d);
    // Still the one grant; the initiator counted every batch.
    assert_eq!(gauge(&b, "xfer_grants_active"), 1.0);
    let text = scrape(&a);
    assert_eq!(labelled(&text, "xfer_channel_batches_total", &[("op", "write"), ("result", "succeeded")]), 4.0, "{text}");
    assert_eq!(gauge(&a, "xfer_channels_open"), 1.0);
    ch.close().await;
    wait_gauge(&b, "xfer_grants_active", 0.0).await;
    wait_gauge(&a, "xfer_channels_open", 0.0).await;
    assert_eq!(labelled(&scrape(&b), "xfer_notifications_total", &[("via", "fabric")]), 3.0);
    // Nothing else was published (the unnotified batch, the close): a transfer's notification,
    // published after all of them, is the subscriber's very next one. (A short wait for
    // silence would pass whenever an extra notification was merely late.)
    let sentinel = pb::SubmitTransferRequest { notify: Some(b"sentinel".to_vec()), ..write_req("kv", &b, "kv", BLOCK) };
    let t = a.transfer(sentinel).await.unwrap();
    assert_eq!(t.state, pb::TransferState::Succeeded as i32, "{t:?}");
    assert_eq!(next_note(&mut notes).await.tag, b"sentinel", "no further notification before the sentinel");
}

/// A READ channel: blocks of the target's pool read into the initiator's, notified on the target
/// once they were read (the markers go after the data completed).
#[tokio::test]
async fn a_read_channel_reads_scattered_blocks() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    a.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    b.create("pool", 2 << 20, pb::Access::Read).await;
    let data = random_bytes(2 << 20, 5);
    b.put("pool", 0, &data).await;
    let mut ch = try_open(&a, open_msg(pb::Op::Read, "dst", &b, "pool", 0, 0, true)).await.unwrap();
    assert_eq!(ch.opened.remote_length, 2 << 20, "length 0: to the end of the region");
    let mut notes = subscribe(&b, "pool", Some(b"read-1")).await;
    let segs: Vec<pb::Segment> = (0..64).map(|i| seg(i * BLOCK, ((i * 37) % 512) * BLOCK, BLOCK)).collect();
    let d = ch.post(1, segs.clone(), 0, Some(b"read-1")).await;
    ok(&d);
    let n = next_note(&mut notes).await;
    assert_eq!((n.op, n.tag.as_slice()), (pb::Op::Read as i32, &b"read-1"[..]));
    let got = a.read("dst", 0, 1 << 20).await;
    for s in &segs {
        let (l, r) = (s.local_offset as usize, s.remote_offset as usize);
        assert_eq!(&got[l..l + BLOCK as usize], &data[r..r + BLOCK as usize]);
    }
    ch.close().await;
}

/// Every bad batch is answered with its code before any byte moves, and the channel goes on: a
/// valid batch after them lands. Bad opens are refused with a status and hold nothing.
#[tokio::test]
async fn bad_batches_are_answered_and_the_channel_goes_on() {
    let a = Agent::start_env("node-a", &[("XFER_TRANSFER__MAX_SEGMENTS", "4"), ("XFER_TRANSFER__MAX_NOTIFY_BYTES", "8")]);
    let b = Agent::start("node-b");
    a.create("src", 1 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    b.create("ro", 1 << 20, pb::Access::Read).await;
    let before = random_bytes(1 << 20, 9);
    b.put("dst", 0, &before).await;
    a.put("src", 0, &random_bytes(1 << 20, 10)).await;

    // Opens that cannot be served.
    let bad_opens: Vec<(&str, pb::ChannelOpen, Code)> = vec![
        ("unknown local region", open_msg(pb::Op::Write, "nope", &b, "dst", 0, 0, false), Code::NotFound),
        ("unknown remote region", open_msg(pb::Op::Write, "src", &b, "nope", 0, 0, false), Code::NotFound),
        ("range past the remote region", open_msg(pb::Op::Write, "src", &b, "dst", 1 << 19, 1 << 20, false), Code::InvalidArgument),
        ("WRITE into a read-only region", open_msg(pb::Op::Write, "src", &b, "ro", 0, 0, false), Code::PermissionDenied),
        (
            "verify",
            pb::ChannelOpen {
                options: Some(pb::TransferOptions { verify: true, ..Default::default() }),
                ..open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, false)
            },
            Code::InvalidArgument,
        ),
    ];
    for (what, open, code) in bad_opens {
        match try_open(&a, open).await {
            Err(s) => assert_eq!(s.code(), code, "{what}: {s:?}"),
            Ok(c) => panic!("{what}: opened {:?}", c.opened),
        }
    }
    // The first message must be the open.
    let (tx, rx) = mpsc::channel(1);
    tx.send(pb::ChannelRequest { msg: Some(pb::channel_request::Msg::Post(pb::ChannelPost::default())) }).await.unwrap();
    let s = a.client().await.open_channel(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap_err();
    assert_eq!(s.code(), Code::InvalidArgument, "{s:?}");
    assert_eq!(gauge(&b, "xfer_grants_active"), 0.0, "refused opens hold no grant");

    // The channel covers [64 KiB, 128 KiB) of dst, with notifications.
    let (lo, span) = (64u64 << 10, 64u64 << 10);
    let mut ch = try_open(&a, open_msg(pb::Op::Write, "src", &b, "dst", lo, span, true)).await.unwrap();
    // (what, segments, list, tag, code, words in the error)
    type Case<'a> = (&'a str, Vec<pb::Segment>, u32, Option<&'a [u8]>, &'a str, &'a str);
    let cases: Vec<Case> = vec![
        ("empty", vec![], 0, None, "INVALID_ARGUMENT", "empty"),
        ("zero length", vec![seg(0, lo, BLOCK), seg(0, lo + BLOCK, 0)], 0, None, "INVALID_ARGUMENT", "segment 1"),
        ("below the channel's range", vec![seg(0, lo - BLOCK, BLOCK)], 0, None, "INVALID_ARGUMENT", "outside the granted range"),
        ("past the channel's range", vec![seg(0, lo + span - 100, BLOCK)], 0, None, "INVALID_ARGUMENT", "outside the granted range"),
        ("overlapping destinations", vec![seg(0, lo, BLOCK), seg(BLOCK, lo + 100, BLOCK)], 0, None, "INVALID_ARGUMENT", "overlap"),
        ("past the local region", vec![seg((1 << 20) - 10, lo, BLOCK)], 0, None, "INVALID_ARGUMENT", "beyond the end"),
        ("too many segments", (0..5).map(|i| seg(i * 8, lo + i * 8, 8)).collect(), 0, None, "RESOURCE_EXHAUSTED", "at most 4"),
        ("unknown list", vec![], 9, None, "NOT_FOUND", "no prepared list 9"),
        ("list and segments", vec![seg(0, lo, BLOCK)], 1, None, "INVALID_ARGUMENT", "not both"),
        ("tag over the limit", vec![seg(0, lo, BLOCK)], 0, Some(b"123456789"), "INVALID_ARGUMENT", "at most 8"),
    ];
    for (i, (what, segs, list, tag, code, msg)) in cases.into_iter().enumerate() {
        let d = ch.post(i as u64, segs, list, tag).await;
        assert_eq!((d.state, d.error_code.as_str(), d.seq), (pb::TransferState::Failed as i32, code, i as u64), "{what}: {d:?}");
        assert!(d.error.contains(msg), "{what}: {:?} lacks {msg:?}", d.error);
        assert_eq!(d.bytes, 0, "{what}");
    }
    // Lists: 0 is not a number, and a bad list is refused whole.
    for (list, segs, code) in [(0u32, vec![seg(0, lo, BLOCK)], "INVALID_ARGUMENT"), (2, vec![seg(0, 0, BLOCK)], "INVALID_ARGUMENT")] {
        match ch.prepare(list, segs).await {
            pb::channel_event::Ev::Done(d) => assert_eq!(d.error_code, code, "{d:?}"),
            other => panic!("{other:?}"),
        }
    }
    assert!(b.read("dst", 0, 1 << 20).await == before, "no refused batch moved a byte");
    // The channel goes on.
    let d = ch.post(99, vec![seg(0, lo, BLOCK)], 0, Some(b"ok")).await;
    ok(&d);
    let text = scrape(&a);
    assert_eq!(labelled(&text, "xfer_channel_batches_total", &[("op", "write"), ("result", "refused")]), 10.0, "{text}");
    ch.close().await;

    // A notification on a channel opened without one.
    let mut plain = try_open(&a, open_msg(pb::Op::Write, "src", &b, "dst", lo, span, false)).await.unwrap();
    let d = plain.post(1, vec![seg(0, lo, BLOCK)], 0, Some(b"t")).await;
    assert_eq!(d.error_code, "INVALID_ARGUMENT", "{d:?}");
    assert!(d.error.contains("opened with notify"), "{d:?}");
    plain.close().await;
    wait_gauge(&b, "xfer_grants_active", 0.0).await;
}

/// The target can take the grant back at any time: deleting the region revokes it, the next
/// batch fails on the fabric (remote access error), and the channel ends ABORTED with that.
#[tokio::test]
async fn a_revoked_grant_ends_the_channel() {
    let (a, b) = (Agent::start("node-a"), Agent::start("node-b"));
    a.create("src", 1 << 20, pb::Access::ReadWrite).await;
    b.create("dst", 1 << 20, pb::Access::ReadWrite).await;
    let mut ch = try_open(&a, open_msg(pb::Op::Write, "src", &b, "dst", 0, 0, false)).await.unwrap();
    ok(&ch.post(1, vec![seg(0, 0, BLOCK)], 0, None).await);
    b.client().await.delete_region(pb::DeleteRegionRequest { name: "dst".into() }).await.unwrap();
    assert_eq!(gauge(&b, "xfer_grants_active"), 0.0, "deleting the region revoked the channel's grant");
    let d = ch.post(2, vec![seg(0, 0, BLOCK)], 0, None).await;
    assert_eq!((d.state, d.error_code.as_str()), (pb::TransferState::Failed as i32, "REM_ACCESS_ERR"), "{d:?}");
    let end = next_event(&mut ch.events).await.unwrap_err();
    assert_eq!(end.code(), Code::Aborted, "{end:?}");
    assert!(end.message().contains("batch 2 failed"), "{end:?}");
    wait_gauge(&a, "xfer_channels_open", 0.0).await;
}
