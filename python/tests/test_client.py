"""The Python client against real agents: the KV flow (a producer fills a mapped shared-memory
pool, submits a batch with a notification, a consumer awaiting it reads the exact bytes from its
own mapping) in both flavours, channels with a prepared list, typed errors, and gRPC reflection
v1alpha as grpcio-reflection speaks it."""
import asyncio
import os

import grpc
import numpy
import pytest

import xfer

BLOCK = 4096
POOL = 4 << 20


def pattern(seed, n):
    return numpy.random.default_rng(seed).integers(0, 256, n, dtype=numpy.uint8).tobytes()


def names(tag):
    return f"kv-a-{os.getpid()}-{tag}", f"kv-b-{os.getpid()}-{tag}"


def test_blocking_kv_batch_is_read_exactly_when_notified(agents):
    a, b = agents
    pa, pb = names("sync")
    with xfer.Client(a.addr) as producer, xfer.Client(b.addr) as consumer:
        src = producer.create_shm_region(pa, POOL)
        dst = consumer.create_shm_region(pb, POOL)
        data = pattern(1, POOL)
        src.buffer[:] = data  # filled in place, no gRPC
        assert producer.get(pa, 1000, 64) == data[1000:1064], "the agent sees the mapped bytes"
        segs = [xfer.Segment(i * BLOCK, ((i * 53) % 1024) * BLOCK, BLOCK) for i in range(200)]
        inbound = consumer.watch_inbound(pb, tag=b"req-1")
        t = producer.transfer(xfer.WRITE, pa, b.addr, pb, segments=segs, notify=b"req-1")
        assert (t.state, t.bytes_done, t.segments) == ("succeeded", 200 * BLOCK, 200)
        n = next(inbound)
        assert (n.tag, n.region, n.via, n.op) == (b"req-1", pb, "fabric", xfer.WRITE)
        arr = dst.array()
        for s in segs:
            assert arr[s.remote:s.remote + BLOCK].tobytes() == data[s.local:s.local + BLOCK]
        del arr
        inbound.cancel()
        # A channel over the second MiB, a list prepared once and posted twice.
        with producer.open_channel(xfer.WRITE, pa, b.addr, pb, offset=1 << 20, length=1 << 20) as ch:
            assert ch.range == (1 << 20, 1 << 20)
            lst = [xfer.Segment(i * BLOCK, (1 << 20) + ((i * 7) % 256) * BLOCK, BLOCK) for i in range(64)]
            assert ch.prepare(1, lst) == 64
            # Pipelined: a batch sent, then a list prepared before its answer is read; each
            # answer reaches its own call (the agent answers in request order).
            early = ch.send([xfer.Segment(0, 1 << 20, BLOCK)])
            assert ch.prepare(2, lst[:8]) == 8
            d = ch.done()
            assert (d.seq, d.bytes) == (early, BLOCK)
            inbound = consumer.watch_inbound(pb)
            for r in range(2):
                data = pattern(10 + r, 64 * BLOCK)
                src.write(0, data)
                d = ch.post_list(1, notify=f"chan-{r}".encode())
                assert (d.seq, d.bytes) == (early + 1 + r, 64 * BLOCK)
                assert next(inbound).tag == f"chan-{r}".encode()
                for s in lst:
                    assert dst.read(s.remote, BLOCK) == data[s.local:s.local + BLOCK]
            inbound.cancel()
        src.close()
        dst.close()
        producer.delete_region(pa)
        consumer.delete_region(pb)
        assert not os.path.exists(f"/dev/shm/xfer-{pa}")


def test_asyncio_kv_batch_is_read_exactly_when_notified(agents):
    a, b = agents
    pa, pb = names("aio")

    async def run():
        async with xfer.AsyncClient(a.addr) as producer, xfer.AsyncClient(b.addr) as consumer:
            src = await producer.create_shm_region(pa, POOL)
            dst = await consumer.create_shm_region(pb, POOL)
            data = pattern(2, POOL)
            src.array()[:] = numpy.frombuffer(data, dtype=numpy.uint8)
            segs = [xfer.Segment(i * BLOCK, ((i * 31) % 1024) * BLOCK, BLOCK) for i in range(128)]
            inbound = await consumer.watch_inbound(pb, tag=b"req-9")
            waiter = asyncio.create_task(inbound.next())
            t = await producer.submit(xfer.WRITE, pa, b.addr, pb, segments=segs, notify=b"req-9")
            n = await asyncio.wait_for(waiter, 30)
            assert n.tag == b"req-9"
            for s in segs:
                assert dst.read(s.remote, BLOCK) == data[s.local:s.local + BLOCK]
            assert (await producer.wait(t.id)).state == "succeeded"
            async with await producer.open_channel(xfer.WRITE, pa, b.addr, pb, notify=False) as ch:
                with pytest.raises(xfer.BatchFailed) as e:
                    await ch.post([xfer.Segment(0, POOL - 10, BLOCK)])
                assert e.value.code == "INVALID_ARGUMENT"
                d = await ch.post([xfer.Segment(0, 0, BLOCK)])
                assert d.seq == 1
                # Pipelined: two batches sent (one refused), then a list prepared (and one
                # refused) before their answers are read; each answer reaches its own call.
                s2 = await ch.send([xfer.Segment(0, BLOCK, BLOCK)])
                s3 = await ch.send([xfer.Segment(0, POOL - 10, BLOCK)])
                assert await ch.prepare(1, [xfer.Segment(0, 0, 2 * BLOCK)]) == 1
                with pytest.raises(xfer.BatchFailed) as e:
                    await ch.prepare(0, [xfer.Segment(0, 0, BLOCK)])
                assert e.value.code == "INVALID_ARGUMENT"
                d = await ch.done()
                assert (d.seq, d.bytes) == (s2, BLOCK)
                with pytest.raises(xfer.BatchFailed) as e:
                    await ch.done()
                assert (e.value.seq, e.value.code) == (s3, "INVALID_ARGUMENT")
                assert (await ch.post_list(1)).bytes == 2 * BLOCK
            inbound.cancel()
            src.close()
            dst.close()
            await producer.delete_region(pa)
            await consumer.delete_region(pb)

    asyncio.run(run())


def test_errors_are_typed(agents):
    a, b = agents
    with xfer.Client(a.addr) as c:
        c.create_region("src", 1 << 20)
        with pytest.raises(xfer.NotFound):
            c.region("nope")
        with pytest.raises(xfer.AlreadyExists):
            c.create_region("src", 1 << 20)
        xfer.Client(b.addr).create_region("dst", 1 << 20)
        with pytest.raises(xfer.InvalidArgument, match="overlap"):
            c.submit(xfer.WRITE, "src", b.addr, "dst", segments=[xfer.Segment(0, 0, 100), xfer.Segment(200, 50, 100)])
        with pytest.raises(xfer.InvalidArgument):
            c.map_shm_region("src")
        with pytest.raises(xfer.XferError) as e:
            c.transfer(xfer.WRITE, "src", b.addr, "dst", local_offset=0, remote_offset=(1 << 20) - 10, length=4096)
        assert e.value.code == "INVALID_ARGUMENT"


def test_the_local_unix_socket_serves_applications_as_clients(agents):
    a, b = agents
    with xfer.Client(a.unix) as local, xfer.Client(b.addr) as remote:
        assert local.info().node_name == "prefill"
        src = local.create_shm_region(f"u-{os.getpid()}", 1 << 20)
        remote.create_region("dst", 1 << 20)
        src.write(0, b"x" * 4096)
        local.transfer(xfer.WRITE, src.name, b.addr, "dst", segments=[xfer.Segment(0, 8192, 4096)])
        assert remote.get("dst", 8192, 4096) == b"x" * 4096
        with pytest.raises(xfer.PermissionDenied, match="admin"):
            _bench(local, b.addr)
        src.close()
        local.delete_region(src.name)


def _bench(client, peer):
    from xfer._sync import _call
    from xfer.v1 import xfer_pb2 as pb

    return _call(client._stub.Bench, pb.BenchRequest(peer=peer, size=4096))


def test_reflection_v1alpha_lists_the_services(agents):
    """grpcio-reflection's client speaks only v1alpha; the agent answers it."""
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    a, _ = agents
    with grpc.insecure_channel(a.addr) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"xfer.v1.Agent", "xfer.v1.Peer"} <= services, services
        desc = db.FindFileContainingSymbol("xfer.v1.Agent")
        assert desc.package == "xfer.v1"


def test_shm_region_read_and_write_survive_a_truncated_object(agents):
    """Truncating the object under a mapped ShmRegion makes read/write raise FailedPrecondition
    (pread/pwrite on the fd), not kill the process with SIGBUS; the agent and other regions carry
    on."""
    a, b = agents
    name = f"trunc-{os.getpid()}"
    with xfer.Client(a.addr) as c:
        r = c.create_shm_region(name, 1 << 20)
        r.write(0, b"y" * 8192)
        assert r.read(4096, 16) == b"y" * 16
        os.truncate(f"/dev/shm/{r.region.path}", 4096)
        for op in (lambda: r.read(4096, 16), lambda: r.read(0, 8192), lambda: r.write(8192, b"z" * 16)):
            with pytest.raises(xfer.FailedPrecondition, match="truncated"):
                op()
        # A write does not grow the object back.
        assert os.stat(f"/dev/shm/{r.region.path}").st_size == 4096
        assert r.read(0, 16) == b"y" * 16, "the bytes still there are readable"
        r.close()
        c.delete_region(name)
        other = c.create_region(f"other-{os.getpid()}", 4096)
        c.put(other.name, 0, b"q" * 4096)
        assert c.get(other.name, 0, 4096) == b"q" * 4096
        c.delete_region(other.name)
