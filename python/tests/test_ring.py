"""Notifications through the shared-memory ring (``watch_inbound_ring``) against real agents: every
field of a WRITE (and a READ) batch's notification with its bytes already in place, the region and
tag filters, the object's removal when the ring is closed, an agent that went away, refused slot
counts, hostile headers, a reader that falls behind, one that the agent laps while it reads, and
an object truncated under its readers."""
import asyncio
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time

import numpy
import pytest

import xfer
from xfer import ring as xring

BLOCK = 4096
POOL = 1 << 20
SHM = "/dev/shm"


def pattern(seed, n):
    return numpy.random.default_rng(seed).integers(0, 256, n, dtype=numpy.uint8).tobytes()


def names(tag):
    return f"rg-a-{os.getpid()}-{tag}", f"rg-b-{os.getpid()}-{tag}"


@pytest.fixture(autouse=True)
def no_leftover_objects():
    """The agents are killed after each test: remove the shm regions (named for this process)
    and the test's own objects that a failed test left behind."""
    yield
    for n in os.listdir(SHM):
        if n.startswith(("xfer-rg-", "xfer-test-")) and f"-{os.getpid()}-" in n:
            os.unlink(os.path.join(SHM, n))


def until(cond, what, timeout=30):
    """Polls ``cond`` (a hang guard, not a synchronisation: the condition is the event)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def ring_objects():
    """The agent's ring objects (xfer.ring., an 8-hex-digit state-dir tag, '.', 16 hex digits) in /dev/shm."""
    return {n for n in os.listdir(SHM) if re.fullmatch(r"xfer\.ring\.[0-9a-f]{8}\.[0-9a-f]{16}", n)}


def mapped_by_others(name, pid):
    """True if a live process other than ``pid`` maps /dev/shm/``name``: the ring of another
    agent on this machine (other test runs share /dev/shm), not one this test's agent left."""
    needle = os.path.join(SHM, name).encode()
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == pid:
            continue
        try:
            with open(f"/proc/{p}/maps", "rb") as f:
                if needle in f.read():
                    return True
        except OSError:
            pass
    return False


def stream_note(inbound, timeout=30):
    """The next notification of a WatchInbound stream, with a hang guard."""
    box = []
    t = threading.Thread(target=lambda: box.append(next(inbound)), daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        pytest.fail("no notification on the stream")
    return box[0]


def test_a_write_batch_arrives_through_the_ring_with_every_field_and_its_bytes_in_place(agents):
    a, b = agents
    pa, pb = names("fields")
    with xfer.Client(a.addr) as producer, xfer.Client(b.addr) as consumer:
        src = producer.create_shm_region(pa, POOL)
        dst = consumer.create_shm_region(pb, POOL)
        # A plaintext peer is named by its address: on loopback, "loopback".
        peer = "loopback"
        data = pattern(1, POOL)
        src.buffer[:] = data
        # Scattered blocks in the destination's [16 KiB, 16 KiB + 64 blocks).
        segs = [xfer.Segment(i * BLOCK, (4 + (i * 37) % 64) * BLOCK, BLOCK) for i in range(64)]
        with consumer.watch_inbound_ring(pb, slots=64) as ring:
            assert ring.slots == 64 and ring.slot_size % 64 == 0 and ring.position == 0
            assert os.path.exists(os.path.join(SHM, ring.object))
            assert ring.try_next() is None
            stream = consumer.watch_inbound(pb)
            producer.submit(xfer.WRITE, pa, b.addr, pb, segments=segs, notify=b"req-1")
            n = ring.next(timeout=30)
            # Read through the mapping at once: every byte has landed when the ring has it.
            got = bytes(dst.buffer)
            for s in segs:
                assert got[s.remote:s.remote + BLOCK] == data[s.local:s.local + BLOCK], s
            assert n == xfer.Notification(region=pb, peer=peer, tag=b"req-1", op=xfer.WRITE, offset=4 * BLOCK,
                                          length=64 * BLOCK, via="fabric")
            assert stream_note(stream) == n, "the ring and the stream carry the same notification"
            assert ring.try_next() is None and ring.position == 1
            # A READ batch (the peer read from this region) with a tag of every byte value.
            tag = bytes(range(256))
            producer.transfer(xfer.READ, pa, b.addr, pb, segments=[xfer.Segment(0, 8 * BLOCK, 2 * BLOCK)], notify=tag)
            n = ring.next(timeout=30)
            assert (n.region, n.peer, n.tag, n.op, n.offset, n.length) == (pb, peer, tag, xfer.READ, 8 * BLOCK, 2 * BLOCK)
            assert n == stream_note(stream)
            stream.cancel()
        src.close()
        dst.close()


def test_asyncio_ring_delivers_a_batch(agents):
    a, b = agents
    pa, pb = names("aio")

    async def run():
        async with xfer.AsyncClient(a.addr) as producer, xfer.AsyncClient(b.addr) as consumer:
            src = await producer.create_shm_region(pa, POOL)
            dst = await consumer.create_shm_region(pb, POOL)
            src.buffer[:BLOCK] = pattern(3, BLOCK)
            async with await consumer.watch_inbound_ring(pb, tag=b"req-9", slots=16) as ring:
                assert isinstance(ring, xfer.AsyncRing)
                assert await ring.next(timeout=0.01) is None
                waiter = asyncio.create_task(ring.next(timeout=30))
                await producer.submit(xfer.WRITE, pa, b.addr, pb, segments=[xfer.Segment(0, BLOCK, BLOCK)], notify=b"req-9")
                n = await waiter
                assert (n.tag, n.region, n.op, n.offset, n.length) == (b"req-9", pb, xfer.WRITE, BLOCK, BLOCK)
                assert dst.read(BLOCK, BLOCK) == src.read(0, BLOCK)
                obj = ring.object
            until(lambda: not os.path.exists(os.path.join(SHM, obj)), "the agent to remove the ring")
            src.close()
            dst.close()

    asyncio.run(run())


def test_region_and_tag_filters_deliver_only_matching_notifications(agents):
    a, b = agents
    pa, pb = names("filt")
    pb2 = pb + "-2"
    with xfer.Client(a.addr) as producer, xfer.Client(b.addr) as consumer:
        producer.create_region(pa, POOL)
        consumer.create_region(pb, POOL)
        consumer.create_region(pb2, POOL)
        everything = consumer.watch_inbound_ring(slots=16)
        by_region = consumer.watch_inbound_ring(pb, slots=16)
        by_tag = consumer.watch_inbound_ring(tag=b"x", slots=16)
        both = consumer.watch_inbound_ring(pb, tag=b"x", slots=16)
        sent = [(pb, b"x", 0), (pb, b"y", 1), (pb2, b"x", 2), (pb2, b"y", 3), (pb, b"xx", 4), (pb2, b"z", 5)]
        for region, tag, i in sent:
            producer.transfer(xfer.WRITE, pa, b.addr, region, segments=[xfer.Segment(0, i * BLOCK, BLOCK)], notify=tag)
        # Every notification was written into every ring once the unfiltered one has them all.
        seen = []
        while len(seen) < len(sent):
            n = everything.next(timeout=30)
            assert n is not None, f"only {seen} arrived"
            seen.append((n.region, n.tag, n.offset // BLOCK))
        assert sorted(seen, key=lambda s: s[2]) == sent
        # A last one that every filter takes ends each ring's list.
        producer.transfer(xfer.WRITE, pa, b.addr, pb, segments=[xfer.Segment(0, 100 * BLOCK, BLOCK)], notify=b"x")

        def drain(r):
            out = []
            while True:
                n = r.next(timeout=30)
                assert n is not None
                if n.offset == 100 * BLOCK:
                    assert r.try_next() is None
                    return sorted(out, key=lambda s: s[2])
                out.append((n.region, n.tag, n.offset // BLOCK))

        assert drain(by_region) == [s for s in sent if s[0] == pb]
        assert drain(by_tag) == [s for s in sent if s[1] == b"x"]
        assert drain(both) == [(pb, b"x", 0)]
        for r in (everything, by_region, by_tag, both):
            r.close()


def test_closing_the_ring_has_the_agent_close_it_and_remove_the_object(agents):
    _, b = agents
    _, pb = names("close")
    with xfer.Client(b.addr) as c:
        c.create_region(pb, POOL)
        ring = c.watch_inbound_ring(pb)
        assert ring.slots == 1024
        path = os.path.join(SHM, ring.object)
        st = os.stat(path)
        assert st.st_size == ring.length and st.st_mode & 0o077 == 0, oct(st.st_mode)
        # A second reader of the same object (no subscription of its own) sees the agent close it.
        watcher = xring.Ring(ring.object)
        assert not watcher.closed and watcher.try_next() is None
        ring.close()
        ring.close()  # idempotent
        with pytest.raises(xfer.Unavailable):
            ring.try_next()
        until(lambda: not os.path.exists(path), f"the agent to remove {path}")
        assert watcher.closed
        with pytest.raises(xfer.Unavailable, match="closed"):
            watcher.try_next()
        watcher.close()
        # The context manager does the same.
        with c.watch_inbound_ring(tag=b"t") as ring:
            path = os.path.join(SHM, ring.object)
            assert os.path.exists(path)
        until(lambda: not os.path.exists(path), f"the agent to remove {path}")


def test_a_ring_whose_agent_went_away_is_unavailable(agents):
    _, b = agents
    with xfer.Client(b.addr) as c:
        ring = c.watch_inbound_ring()
        path = os.path.join(SHM, ring.object)
        b.proc.kill()
        b.proc.wait()
        try:
            # Killed, the agent never marks the ring closed: the reader learns it from the call.
            with pytest.raises(xfer.Unavailable, match="ended"):
                ring.next(timeout=30)
        finally:
            ring.close()
            # Nobody removes a killed agent's ring but this test.
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.parametrize("slots", [1000, 8, 1 << 20, 17, 1 << 17])
def test_invalid_slot_counts_are_refused_and_leave_no_object(agents, slots):
    _, b = agents
    before = ring_objects()
    with xfer.Client(b.addr) as c:
        with pytest.raises(xfer.InvalidArgument, match="power of two"):
            c.watch_inbound_ring(slots=slots)
        with pytest.raises(xfer.NotFound):
            c.watch_inbound_ring("no-such-region")
    left = {n for n in ring_objects() - before if not mapped_by_others(n, b.proc.pid)}
    assert left == set()


def _corrupt_copy(ring, name, patch):
    """A private object in /dev/shm holding ``ring``'s bytes with ``patch(bytearray)`` applied."""
    with open(os.path.join(SHM, ring.object), "rb") as f:
        raw = bytearray(f.read())
    patch(raw)
    fd = os.open(os.path.join(SHM, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
    return name


def test_a_corrupt_or_hostile_ring_is_refused(agents, tmp_path):
    a, b = agents
    pa, pb = names("hostile")
    made = []
    with xfer.Client(a.addr) as producer, xfer.Client(b.addr) as consumer:
        producer.create_region(pa, POOL)
        consumer.create_region(pb, POOL)
        ring = consumer.watch_inbound_ring(pb, slots=16)
        producer.transfer(xfer.WRITE, pa, b.addr, pb, segments=[xfer.Segment(0, 0, BLOCK)], notify=b"t")
        assert ring.next(timeout=30).tag == b"t"

        def copy(what, patch):
            name = f"xfer-test-{os.getpid()}-{what}"
            made.append(name)
            return _corrupt_copy(ring, name, patch)

        def put32(off, v):
            return lambda raw: raw.__setitem__(slice(off, off + 4), struct.pack("<I", v))

        try:
            # The untouched copy reads like the ring.
            good = xring.Ring(copy("good", lambda raw: None))
            assert good.next(timeout=1).tag == b"t"
            good.close()
            cases = [
                ("magic", lambda raw: raw.__setitem__(slice(0, 8), b"NOTARING"), "magic"),
                ("version", put32(8, 2), "version 2"),
                ("slots", put32(16, 1000), "1000 slots"),
                ("few-slots", put32(16, 8), "8 slots"),
                ("many-slots", put32(16, 1 << 20), "1048576 slots"),
                ("more-slots", put32(16, 32), "32 slots of .* do not fit"),
                ("slot-size", put32(12, 100), "slots of 100 bytes"),
                ("small-slot", put32(12, 0), "slots of 0 bytes"),
                ("short", lambda raw: raw.__delitem__(slice(HEADER_PLUS(ring), None)), "do not fit"),
                ("tiny", lambda raw: raw.__delitem__(slice(100, None)), "less than its header"),
            ]
            cases.append(("wide-slot", put32(12, 1 << 20), "slots of 1048576 bytes"))
            for what, patch, msg in cases:
                with pytest.raises(xfer.FailedPrecondition, match=msg):
                    xring.Ring(copy(what, patch))
            # A slot whose lengths point past it is an error, not a crash or a garbage read.
            bad = xring.Ring(copy("slot", lambda raw: raw.__setitem__(slice(256 + 40, 256 + 44), b"\xff\xff\xff\xff")))
            with pytest.raises(xfer.FailedPrecondition, match="lengths past its slot"):
                bad.try_next()
            bad.close()
            # Names that are paths, a symbolic link, something that is not a regular file.
            for name in ("../etc/passwd", ".hidden", "", "a/b"):
                with pytest.raises(xfer.FailedPrecondition, match="object name"):
                    xring.Ring(name)
            link = f"xfer-test-{os.getpid()}-link"
            os.symlink(os.path.join(SHM, ring.object), os.path.join(SHM, link))
            made.append(link)
            with pytest.raises(xfer.FailedPrecondition):
                xring.Ring(link)
            fifo = f"xfer-test-{os.getpid()}-fifo"
            os.mkfifo(os.path.join(SHM, fifo), 0o600)
            made.append(fifo)
            with pytest.raises(xfer.FailedPrecondition):
                xring.Ring(fifo)
            with pytest.raises(xfer.FailedPrecondition):
                xring.Ring(f"xfer-test-{os.getpid()}-missing")
            # A length the stream claims that the object does not have.
            with pytest.raises(xfer.FailedPrecondition, match="the agent said"):
                xring.Ring(ring.object, ring.length + 4096)
        finally:
            for name in made:
                try:
                    os.unlink(os.path.join(SHM, name))
                except FileNotFoundError:
                    pass
            ring.close()


def HEADER_PLUS(ring):
    """A length that holds the header and all slots but the last."""
    return xring.HEADER + (ring.slots - 1) * ring.slot_size


def test_a_reader_that_falls_behind_gets_data_loss_once_then_the_oldest_held_in_order(agents):
    a, b = agents
    pa, pb = names("lag")
    total = 40
    with xfer.Client(a.addr) as producer, xfer.Client(b.addr) as consumer:
        producer.create_region(pa, POOL)
        consumer.create_region(pb, POOL)
        ring = consumer.watch_inbound_ring(pb, slots=16)
        stream = consumer.watch_inbound(pb)
        with producer.open_channel(xfer.WRITE, pa, b.addr, pb) as ch:
            for i in range(total):
                ch.post([xfer.Segment(0, i * BLOCK, BLOCK)], notify=f"n-{i}".encode())
        # The agent writes the rings before the streams: once the stream has all, so has the ring.
        tags = [stream_note(stream).tag for _ in range(total)]
        assert sorted(tags) == sorted(f"n-{i}".encode() for i in range(total))
        stream.cancel()
        with pytest.raises(xfer.DataLoss, match=f"lost {total - 16}") as e:
            ring.try_next()
        assert e.value.lost == total - 16
        held = [ring.try_next() for _ in range(16)]
        assert [n.tag for n in held] == tags[total - 16:], "the oldest held, in the order published"
        assert ring.try_next() is None and ring.position == total
        ring.close()


def test_other_processors_are_told_to_use_the_stream(monkeypatch):
    monkeypatch.setattr(xring.platform, "machine", lambda: "aarch64")
    with pytest.raises(xfer.FailedPrecondition, match="watch_inbound"):
        xring.Ring("xfer.ring.00000000.0000000000000000")


def test_a_reader_racing_the_agent_sees_no_torn_notification(agents):
    """Notifications published while the reader reads a small ring: each one read is whole (its
    tag's parts and the names after it agree), and those read plus those reported lost are all of
    them. (A channel's notifications carry its grant's range: the tag is what varies.)"""
    a, b = agents
    pa, pb = names("race")
    total = 1000
    with xfer.Client(a.addr) as producer, xfer.Client(b.addr) as consumer:
        producer.create_region(pa, POOL)
        consumer.create_region(pb, POOL)
        ring = consumer.watch_inbound_ring(pb, slots=16)
        errors = []

        def tag(i):
            return f"{i}:".encode() + bytes([i % 251]) * (i % 97)

        def produce():
            try:
                with producer.open_channel(xfer.WRITE, pa, b.addr, pb) as ch:
                    for i in range(total):
                        ch.send([xfer.Segment(0, (i % 200) * BLOCK, BLOCK)], notify=tag(i))
                    for _ in range(total):
                        ch.done()
            except Exception as e:  # reported by the main thread
                errors.append(e)

        t = threading.Thread(target=produce, daemon=True)
        t.start()
        seen, lost, last = 0, 0, -1
        while seen + lost < total and not errors:
            try:
                n = ring.next(timeout=30)
            except xfer.DataLoss as e:
                lost += e.lost
                continue
            assert n is not None, f"{seen} read and {lost} lost of {total}"
            i = int(n.tag.split(b":")[0])
            assert (n.tag, n.region, n.peer, n.op) == (tag(i), pb, "loopback", xfer.WRITE), f"a torn slot: {n}"
            assert i > last, "in the order published"
            last = i
            seen += 1
            if seen % 8 == 0:
                # Not a synchronisation: a slow reader, so the agent laps it while it reads.
                time.sleep(0.02)
        t.join(60)
        assert not errors, errors
        assert seen + lost == total and ring.try_next() is None
        ring.close()


# A second process reading the ring: it reads the first notification, waits for its parent to
# truncate the object, then reads on twice. A reader that loads through a mapping dies here of
# SIGBUS, which the parent sees as the child's signal instead of killing the test run.
_TRUNCATED_READER = r"""
import sys
from xfer import ring as xring
r = xring.Ring(sys.argv[1])
print(r.next(timeout=30).tag.decode(), flush=True)
sys.stdin.readline()
for _ in range(2):
    try:
        print(f"returned {r.try_next()!r}", flush=True)
    except Exception as e:
        print(f"{type(e).__name__}: {e}", flush=True)
try:
    print(f"closed: {r.closed}", flush=True)
except Exception as e:
    print(f"closed: {type(e).__name__}", flush=True)
r.close()
"""


@pytest.mark.parametrize("keep", ["nothing", "part of the header", "the header and the first slot"])
def test_a_ring_truncated_under_its_readers_is_a_clear_error_not_sigbus(agents, keep):
    a, b = agents
    pa, pb = names(f"trunc-{keep.split()[0]}")
    with xfer.Client(a.addr) as producer, xfer.Client(b.addr) as consumer:
        src = producer.create_shm_region(pa, POOL)
        dst = consumer.create_shm_region(pb, POOL)
        ring = consumer.watch_inbound_ring(pb, slots=16)
        stream = consumer.watch_inbound(pb)
        path = os.path.join(SHM, ring.object)
        # Two notifications: the first read by both readers before the truncation, the second
        # (in slot 1) left for after it.
        for tag in (b"one", b"two"):
            producer.transfer(xfer.WRITE, pa, b.addr, pb, segments=[xfer.Segment(0, 0, BLOCK)], notify=tag)
            assert stream_note(stream).tag == tag
        assert ring.next(timeout=30).tag == b"one"
        child = subprocess.Popen([sys.executable, "-c", _TRUNCATED_READER, ring.object],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "one", child.stderr.read()
            size = {"nothing": 0, "part of the header": 40, "the header and the first slot": xring.HEADER + ring.slot_size}[keep]
            os.truncate(path, size)
            out, err = child.communicate("go\n", timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode != -signal.SIGBUS, f"the reader died of SIGBUS: {err}"
        assert child.returncode == 0, err
        lines = out.splitlines()
        want = re.compile(rf"FailedPrecondition: notification ring {re.escape(ring.object)} was truncated under this "
                          rf"reader: it has {size} bytes, the ring needs \d+; open a new ring")
        assert len(lines) == 3 and all(want.fullmatch(line) for line in lines[:2]), out
        # `closed` reads the flags and head (bytes 20 to 72): an error while they are gone.
        assert lines[2] == ("closed: False" if size >= 72 else "closed: FailedPrecondition"), out
        # The reader in this process (it holds the subscription) is told the same, and stays so.
        for _ in range(2):
            with pytest.raises(xfer.FailedPrecondition, match="was truncated under this reader"):
                ring.try_next()
        # Nothing else changed: the agent still serves, its stream subscribers still hear of
        # batches, and the bytes land.
        data = pattern(7, BLOCK)
        src.buffer[:BLOCK] = data
        producer.transfer(xfer.WRITE, pa, b.addr, pb, segments=[xfer.Segment(0, BLOCK, BLOCK)], notify=b"three")
        assert stream_note(stream).tag == b"three"
        assert bytes(dst.buffer[BLOCK:2 * BLOCK]) == data
        stream.cancel()
        ring.close()
        src.close()
        dst.close()
