//! The client against real agents (tcp fabric on loopback, `xfer_client::testing::LocalAgent`:
//! the workspace's `xfer-agent` binary, which `make test` builds first): a KV-style producer fills a mapped
//! shared-memory pool, moves scattered blocks to another agent as one batch and over a channel,
//! and a consumer awaiting each notification reads the exact bytes from its own mapped pool;
//! bad input comes back as typed errors.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use xfer_client::testing::LocalAgent;
use xfer_client::{ChannelSpec, Client, Error, Segment, State, TransferSpec};

const BLOCK: u64 = 4096;

/// A real agent on loopback (`xfer_client::testing`).
struct Agent;

impl Agent {
    async fn start(name: &str) -> LocalAgent {
        LocalAgent::start(name).await.unwrap()
    }
}

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The KV-cache flow: producer fills its mapped pool in place, one batch of scattered
/// blocks with a notification, the consumer reads the exact bytes from its own mapped pool the
/// moment it is told; then the same over a channel with a prepared list, twice.
#[tokio::test]
async fn a_producer_fills_shared_memory_and_a_consumer_reads_what_it_was_told_landed() {
    let (a, b) = (Agent::start("prefill").await, Agent::start("decode").await);
    let (producer, consumer) = (Client::connect(&a.addr).await.unwrap(), Client::connect(&b.addr).await.unwrap());
    let tag = std::process::id();
    let (pa, pb) = (format!("kv-a-{tag}"), format!("kv-b-{tag}"));
    const POOL: u64 = 4 << 20;
    let src = producer.create_shm_region(&pa, POOL).await.unwrap();
    let dst = consumer.create_shm_region(&pb, POOL).await.unwrap();
    assert_eq!((src.len(), dst.len()), (POOL, POOL));
    // Filled in place: the agent sees the bytes written through the mapping.
    let data = pattern(1, POOL as usize);
    src.write_at(0, &data).unwrap();
    assert_eq!(producer.get(&pa, 12345, 100).await.unwrap(), &data[12345..12445]);

    let segs: Vec<Segment> = (0..200u64).map(|i| Segment { local: i * BLOCK, remote: ((i * 53) % 1024) * BLOCK, len: BLOCK }).collect();
    let mut inbound = consumer.watch_inbound(Some(&pb), Some(b"req-1")).await.unwrap();
    let t = producer.transfer(TransferSpec::write(&pa, &b.addr, &pb).segments(segs.clone()).notify(b"req-1")).await.unwrap();
    assert_eq!((t.state, t.bytes_done, t.segments), (State::Succeeded, 200 * BLOCK, 200));
    let n = inbound.next().await.unwrap();
    assert_eq!((n.tag.as_slice(), n.region.as_str(), n.via.as_str()), (&b"req-1"[..], pb.as_str(), "fabric"));
    for s in &segs {
        let got = dst.read_vec(s.remote, BLOCK as usize).unwrap();
        assert_eq!(got, &data[s.local as usize..(s.local + BLOCK) as usize], "block at {}", s.remote);
    }

    // A channel over the consumer's second MiB; the list prepared once, posted twice with new
    // bytes each time.
    let mut inbound = consumer.watch_inbound(Some(&pb), None).await.unwrap();
    let mut ch = producer.open_channel(ChannelSpec::write(&pa, &b.addr, &pb).range(1 << 20, 1 << 20)).await.unwrap();
    assert_eq!(ch.range(), (1 << 20, 1 << 20));
    let list: Vec<Segment> =
        (0..64u64).map(|i| Segment { local: i * BLOCK, remote: (1 << 20) + ((i * 7) % 256) * BLOCK, len: BLOCK }).collect();
    let p = ch.prepare(1, &list).await.unwrap();
    assert_eq!((p.segments, p.bytes), (64, 64 * BLOCK));
    for round in 0..2u64 {
        let data = pattern(10 + round, 64 * BLOCK as usize);
        src.write_at(0, &data).unwrap();
        let tag = format!("chan-{round}");
        let d = ch.post_list(1, Some(tag.as_bytes())).await.unwrap();
        assert_eq!((d.seq, d.bytes), (round, 64 * BLOCK));
        let n = inbound.next().await.unwrap();
        assert_eq!(n.tag, tag.as_bytes());
        for s in &list {
            assert_eq!(dst.read_vec(s.remote, BLOCK as usize).unwrap(), &data[s.local as usize..(s.local + BLOCK) as usize]);
        }
    }
    ch.close().await.unwrap();
    // Deleting the regions removes the objects the agents created (nothing left in /dev/shm).
    let objects = [src.region().path.clone(), dst.region().path.clone()];
    producer.delete_region(&pa).await.unwrap();
    consumer.delete_region(&pb).await.unwrap();
    for o in objects {
        assert!(!std::path::Path::new("/dev/shm").join(&o).exists(), "{o} left behind");
    }
}

/// The agent's local unix socket: the same API, the caller a client known by its uid.
#[tokio::test]
async fn the_local_unix_socket_serves_the_same_api() {
    let (a, b) = (Agent::start("a").await, Agent::start("b").await);
    let local = Client::connect(&a.unix).await.unwrap();
    assert_eq!(local.info().await.unwrap().node_name, "a");
    local.create_region("src", 1 << 20).await.unwrap();
    local.put("src", 0, &[9u8; 8192]).await.unwrap();
    Client::connect(&b.addr).await.unwrap().create_region("dst", 1 << 20).await.unwrap();
    let t = local.transfer(TransferSpec::write("src", &b.addr, "dst").range(0, 4096, 8192)).await.unwrap();
    assert_eq!(t.bytes_done, 8192);
    assert_eq!(Client::connect(&b.addr).await.unwrap().get("dst", 4096, 8192).await.unwrap(), vec![9u8; 8192]);
    match Client::connect("unix:///nonexistent/agent.sock").await {
        Err(Error::Connect { .. }) => {}
        other => panic!("{other:?}"),
    }
}

/// Bad input is a typed error the caller can match on, and the channel goes on after a refused
/// batch.
#[tokio::test]
async fn errors_are_typed() {
    let (a, b) = (Agent::start("a").await, Agent::start("b").await);
    let c = Client::connect(&a.addr).await.unwrap();
    c.create_region("src", 1 << 20).await.unwrap();
    Client::connect(&b.addr).await.unwrap().create_region("dst", 1 << 20).await.unwrap();
    assert!(matches!(c.region("nope").await, Err(Error::NotFound(_))));
    assert!(matches!(c.create_region("src", 1 << 20).await, Err(Error::AlreadyExists(_))));
    assert!(matches!(c.get("src", (1 << 20) - 10, 100).await, Err(Error::InvalidArgument(_) | Error::OutOfRange(_))));
    let overlap = vec![Segment { local: 0, remote: 0, len: 100 }, Segment { local: 200, remote: 50, len: 100 }];
    match c.submit(TransferSpec::write("src", &b.addr, "dst").segments(overlap)).await {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("overlap"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(c.map_shm_region("src").await, Err(Error::InvalidArgument(_))), "an anonymous region cannot be mapped");
    let mut ch = c.open_channel(ChannelSpec::write("src", &b.addr, "dst").range(0, 64 << 10)).await.unwrap();
    match ch.post(&[Segment { local: 0, remote: 1 << 19, len: BLOCK }], None).await {
        Err(Error::Batch { seq: 0, code, message }) => assert_eq!(code, "INVALID_ARGUMENT", "{message}"),
        other => panic!("{other:?}"),
    }
    let d = ch.post(&[Segment { local: 0, remote: 0, len: BLOCK }], None).await.unwrap();
    assert_eq!((d.seq, d.bytes), (1, BLOCK));
    // Pipelined: two batches sent, then a list prepared (and one refused) before reading their
    // answers. Each answer goes to its own call, in order: the batches' to `done`, the lists'
    // to `prepare`, including a refused batch's and a refused list's.
    let s2 = ch.send(&[Segment { local: 0, remote: BLOCK, len: BLOCK }], 0, None).await.unwrap();
    let s3 = ch.send(&[Segment { local: 0, remote: 1 << 19, len: BLOCK }], 0, None).await.unwrap();
    let p = ch.prepare(1, &[Segment { local: 0, remote: 0, len: 2 * BLOCK }]).await.unwrap();
    assert_eq!((p.list, p.segments, p.bytes), (1, 1, 2 * BLOCK));
    match ch.prepare(0, &[Segment { local: 0, remote: 0, len: BLOCK }]).await {
        Err(Error::Batch { code, message, .. }) => assert!(code == "INVALID_ARGUMENT" && message.contains("list 0"), "{code}: {message}"),
        other => panic!("list 0 must be refused: {other:?}"),
    }
    let d = ch.done().await.unwrap();
    assert_eq!((d.seq, d.bytes), (s2, BLOCK));
    match ch.done().await {
        Err(Error::Batch { seq, code, .. }) => assert_eq!((seq, code.as_str()), (s3, "INVALID_ARGUMENT")),
        other => panic!("batch {s3} is outside the channel's range: {other:?}"),
    }
    assert_eq!(ch.post_list(1, None).await.unwrap().bytes, 2 * BLOCK, "the list prepared between them works");
    ch.close().await.unwrap();
    match Client::connect("127.0.0.1:1").await {
        Err(Error::Connect { addr, .. }) => assert_eq!(addr, "127.0.0.1:1"),
        other => panic!("{other:?}"),
    }
}

/// A reader that yields `ok` bytes of 7s, then fails.
struct FailingReader {
    ok: usize,
}

impl tokio::io::AsyncRead for FailingReader {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.ok == 0 {
            return std::task::Poll::Ready(Err(std::io::Error::other("disk on fire")));
        }
        let n = self.ok.min(buf.remaining()).min(64 << 10);
        buf.put_slice(&vec![7u8; n]);
        self.ok -= n;
        std::task::Poll::Ready(Ok(()))
    }
}

/// Everything `xferctl` does goes through these calls: regions with labels, access and a lease
/// come back with every field; label selectors filter; a streamed put whose source fails says
/// how far it got and the agent holds exactly what was sent; a streamed read is checked and
/// complete; checksums, transfer records and peers are typed.
#[tokio::test]
async fn the_typed_api_covers_what_the_cli_needs() {
    use xfer_client::{Access, ChecksumAlgo, Fabric, RegionKind, RegionSpec};
    let (a, b) = (Agent::start("a").await, Agent::start("b").await);
    let c = Client::connect(&a.addr).await.unwrap();
    let info = c.info().await.unwrap();
    assert_eq!((info.node_name.as_str(), info.fabric), ("a", Fabric::Tcp));
    assert!(info.uptime.is_some() && info.limits.is_some(), "{info:?}");

    let spec = RegionSpec::anonymous("src", 4 << 20).access(Access::Read).label("team", "kv").ttl(std::time::Duration::from_secs(3600));
    let r = c.create(spec).await.unwrap();
    assert_eq!((r.kind, r.access, r.length), (RegionKind::Anonymous, Access::Read, 4 << 20));
    assert_eq!(r.labels.get("team").map(String::as_str), Some("kv"));
    let (created, expires) = (r.created_at.unwrap(), r.expires_at.unwrap());
    let lease = expires.duration_since(created).unwrap().as_secs();
    assert!((3599..=3601).contains(&lease), "lease {lease} s");
    c.create_region("other", 1 << 20).await.unwrap();
    let selected = c.regions_matching(&[("team".to_string(), "kv".to_string())].into()).await.unwrap();
    assert_eq!(selected.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["src"]);
    assert_eq!(c.regions().await.unwrap().len(), 2);

    // 1.5 MiB then a read error: the first full 1 MiB message was sent and written, the rest not.
    match c.put_reader("src", 0, FailingReader { ok: 3 << 19 }).await {
        Err(Error::Io { what, source }) => {
            assert!(what.contains("after 1048576 bytes were sent"), "{what}");
            assert_eq!(source.to_string(), "disk on fire");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.get("src", 0, 1 << 20).await.unwrap(), vec![7u8; 1 << 20]);
    assert_eq!(c.get("src", 1 << 20, 16).await.unwrap(), vec![0u8; 16], "nothing past what was sent");
    // A whole streamed put, then a streamed read of all 4 MiB.
    let n = c.put_reader("src", 0, std::io::Cursor::new(pattern(9, 4 << 20))).await.unwrap();
    assert_eq!(n, 4 << 20);
    let mut reader = c.read("src", 0, 4 << 20).await.unwrap();
    let mut back = Vec::new();
    while let Some(piece) = reader.next().await.unwrap() {
        back.extend_from_slice(&piece);
    }
    assert_eq!((reader.done(), back == pattern(9, 4 << 20)), (4 << 20, true));
    assert!(matches!(c.put_stream("src", 0, futures::stream::iter(Vec::<Vec<u8>>::new())).await, Err(Error::InvalidArgument(_))));

    // The same bytes on both agents have the same checksum; the transfer and the peer are typed.
    let d = Client::connect(&b.addr).await.unwrap();
    d.create_region("dst", 4 << 20).await.unwrap();
    let t = c.transfer(TransferSpec::read("other", &b.addr, "dst").range(0, 0, 1 << 20)).await.unwrap();
    assert_eq!(
        (t.op, t.local_region.as_str(), t.remote_agent.as_str(), t.remote_region.as_str()),
        (xfer_client::Op::Read, "other", b.addr.as_str(), "dst")
    );
    assert!(t.created_at.is_some() && t.finished_at.is_some() && t.elapsed_seconds > 0.0, "{t:?}");
    let t = c.transfer(TransferSpec::write("src", &b.addr, "dst")).await.unwrap();
    assert_eq!(t.bytes_done, 4 << 20);
    for algo in [ChecksumAlgo::Xxh3, ChecksumAlgo::Crc32c] {
        assert_eq!(c.checksum("src", 0, 4 << 20, algo).await.unwrap(), d.checksum("dst", 0, 4 << 20, algo).await.unwrap());
    }
    assert_ne!(
        c.checksum("src", 0, 4 << 20, ChecksumAlgo::Xxh3).await.unwrap(),
        c.checksum("other", 0, 4 << 20 >> 2, ChecksumAlgo::Xxh3).await.unwrap()
    );
    let records = c.transfers().await.unwrap();
    assert!(records.iter().any(|r| r.id == t.id && r.state == State::Succeeded), "{records:?}");
    let inbound = d.transfers().await.unwrap();
    assert!(inbound.iter().any(|r| r.inbound), "{inbound:?}");
    let peers = c.peers().await.unwrap();
    assert!(peers.iter().any(|p| p.address == b.addr && p.node_name == "b" && p.fabric == Fabric::Tcp), "{peers:?}");
}

/// A local attacker who can write /dev/shm plants something under a live region's object name
/// (after the agent's object was moved away): a symlink (to the agent's object, to another
/// file), a FIFO, a short file. Mapping the region over the unix socket refuses each one, maps
/// nothing, and changes nothing; with the agent's object back in place it maps again.
#[tokio::test]
async fn what_is_planted_under_an_shm_regions_name_is_not_mapped() {
    let a = Agent::start("shm-plant").await;
    let c = Client::connect(&a.unix).await.unwrap();
    let name = format!("plant-{}", std::process::id());
    let shm = std::path::Path::new("/dev/shm");
    let object = shm.join(format!("xfer-{name}"));
    let moved = shm.join(format!("xfer-{name}.moved"));
    let other = shm.join(format!("xfer-{name}.other"));
    let r = c.create_shm_region(&name, 1 << 20).await.unwrap();
    r.write_at(0, b"agent's bytes").unwrap();
    drop(r);
    std::fs::rename(&object, &moved).unwrap();
    std::fs::write(&other, vec![9u8; 1 << 20]).unwrap();
    for what in ["symlink to the agent's object", "symlink to another file", "fifo", "short file"] {
        match what {
            "symlink to the agent's object" => std::os::unix::fs::symlink(&moved, &object).unwrap(),
            "symlink to another file" => std::os::unix::fs::symlink(&other, &object).unwrap(),
            "fifo" => nix::unistd::mkfifo(&object, nix::sys::stat::Mode::from_bits_truncate(0o666)).unwrap(),
            _ => std::fs::write(&object, b"short").unwrap(),
        }
        let e = c.map_shm_region(&name).await.unwrap_err();
        assert!(matches!(e, Error::Io { .. } | Error::FailedPrecondition(_)), "{what}: {e:?}");
        assert_eq!(std::fs::read(&other).unwrap(), vec![9u8; 1 << 20], "{what}");
        assert_eq!(&std::fs::read(&moved).unwrap()[..13], b"agent's bytes", "{what}");
        std::fs::remove_file(&object).unwrap();
    }
    std::fs::remove_file(&other).unwrap();
    std::fs::rename(&moved, &object).unwrap();
    let r = c.map_shm_region(&name).await.unwrap();
    assert_eq!(r.read_vec(0, 13).unwrap(), b"agent's bytes");
    drop(r);
    c.delete_region(&name).await.unwrap();
    assert!(!object.exists());
}

/// Notifications through a shared-memory ring (`WatchInboundRing`): every field as the stream
/// gives it, the bytes already in the pool when the ring is read, the region and tag filters,
/// a reader that falls behind told once how many it lost and going on from the oldest held,
/// bad slot counts refused with nothing left in /dev/shm, and the object removed when the
/// subscription is dropped (a second ring of the same agent keeps working meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_delivers_notifications_in_shared_memory() {
    let (a, b) = (Agent::start("prefill").await, Agent::start("decode").await);
    let (producer, consumer) = (Client::connect(&a.addr).await.unwrap(), Client::connect(&b.addr).await.unwrap());
    let tag = std::process::id();
    let (pa, pb, other) = (format!("ring-a-{tag}"), format!("ring-b-{tag}"), format!("ring-o-{tag}"));
    const POOL: u64 = 1 << 20;
    let src = producer.create_shm_region(&pa, POOL).await.unwrap();
    let dst = consumer.create_shm_region(&pb, POOL).await.unwrap();
    consumer.create_region(&other, POOL).await.unwrap();
    let shm_objects = || -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("xfer.ring."))
            .collect()
    };
    let before = shm_objects();

    // Bad slot counts: refused, no object made.
    for slots in [8, 1000, 1 << 17, u32::MAX] {
        let e = consumer.watch_inbound_ring(Some(&pb), None, slots).await.unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{slots}: {e:?}");
    }
    let e = consumer.watch_inbound_ring(Some("no-such-region"), None, 0).await.unwrap_err();
    assert!(matches!(e, Error::NotFound(_)), "{e:?}");
    assert_eq!(shm_objects(), before, "a refused ring left an object");

    let mut all = consumer.watch_inbound_ring(Some(&pb), None, 16).await.unwrap();
    let mut tagged = consumer.watch_inbound_ring(None, Some(b"wanted"), 0).await.unwrap();
    let mut elsewhere = consumer.watch_inbound_ring(Some(&other), None, 0).await.unwrap();
    assert_eq!(shm_objects().len(), before.len() + 3);
    assert!(all.try_next().unwrap().is_none(), "nothing published yet");

    // One batch: every field, and the bytes are there when the ring says so.
    let data = pattern(7, 64 * BLOCK as usize);
    src.write_at(0, &data).unwrap();
    let segs: Vec<Segment> = (0..64u64).map(|i| Segment { local: i * BLOCK, remote: ((i * 5) % 256) * BLOCK, len: BLOCK }).collect();
    producer.transfer(TransferSpec::write(&pa, &b.addr, &pb).segments(segs.clone()).notify(b"wanted")).await.unwrap();
    let n = all.next().await.unwrap();
    for s in &segs {
        assert_eq!(dst.read_vec(s.remote, BLOCK as usize).unwrap(), &data[s.local as usize..(s.local + BLOCK) as usize]);
    }
    assert_eq!(
        (n.tag.as_slice(), n.region.as_str(), n.via.as_str(), n.op),
        (&b"wanted"[..], pb.as_str(), "fabric", xfer_client::Op::Write)
    );
    assert_eq!((n.offset, n.length), (0, 256 * BLOCK), "the granted span of the batch");
    assert!(!n.peer.is_empty() && n.at.is_some(), "{n:?}");
    assert_eq!(tagged.next().await.unwrap().tag, b"wanted", "the tag filter takes it");

    // Another tag: the region's ring gets it, the tag-filtered one does not.
    producer.transfer(TransferSpec::write(&pa, &b.addr, &pb).range(0, 0, BLOCK).notify(b"other-tag")).await.unwrap();
    assert_eq!(all.next().await.unwrap().tag, b"other-tag");
    assert!(tagged.try_next().unwrap().is_none(), "filtered out by tag");
    assert!(elsewhere.try_next().unwrap().is_none(), "filtered out by region");

    // 20 more into a ring of 16 slots before reading: 4 lost, told once, then the 16 in order.
    for i in 0..20u32 {
        producer.transfer(TransferSpec::write(&pa, &b.addr, &pb).range(0, 0, BLOCK).notify(format!("n{i}").as_bytes())).await.unwrap();
    }
    let e = all.try_next().unwrap_err();
    assert!(matches!(&e, Error::DataLoss(m) if m.contains("lost 4")), "{e:?}");
    for i in 4..20u32 {
        assert_eq!(all.next().await.unwrap().tag, format!("n{i}").as_bytes());
    }
    assert!(all.try_next().unwrap().is_none());

    // Dropping a subscription removes its object; the others keep working.
    let gone = all.object().to_string();
    drop(all);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::path::Path::new("/dev/shm").join(&gone).exists() {
        assert!(std::time::Instant::now() < deadline, "{gone} still there 30 s after its subscription closed");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    producer.transfer(TransferSpec::write(&pa, &b.addr, &pb).range(0, 0, BLOCK).notify(b"wanted")).await.unwrap();
    assert_eq!(tagged.next().await.unwrap().tag, b"wanted");
    let ours = [tagged.object().to_string(), elsewhere.object().to_string()];
    drop((tagged, elsewhere));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while ours.iter().any(|o| std::path::Path::new("/dev/shm").join(o).exists()) {
        assert!(std::time::Instant::now() < deadline, "ring objects left: {ours:?}");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}
